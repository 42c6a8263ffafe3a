//! The embedded store against a `Mutex<HashMap>` baseline, at 1 and 2 threads, on a mix of 64k
//! keys; 1 M distinct keys (insert cost and memory per live key, printed); and a key flood
//! against a full store (each new key evicting an entry).

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Same allocator as the shipped binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};
use tollgate::limits::limiter::{self, BucketState, Quota, MICRO, US_PER_SEC};
use tollgate::store::{BucketKey, BucketOp, Group, MemoryStore, MemoryStoreConfig, OpResults};

/// Size of the key mix (default 65 536; `TOLLGATE_BENCH_KEYS` overrides).
fn key_count() -> usize {
    std::env::var("TOLLGATE_BENCH_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(65_536)
}

fn keys() -> Vec<BucketKey> {
    (0..key_count())
        .map(|i| BucketKey::of(&format!("tb:bench:{i}")))
        .collect()
}

fn quota() -> Quota {
    Quota::new(1_000_000 * MICRO, 1_000_000 * MICRO, US_PER_SEC).expect("quota")
}

/// The naive design: one lock around a std HashMap keyed by the full key.
struct MutexMap(Mutex<HashMap<BucketKey, BucketState, ahash::RandomState>>);

impl MutexMap {
    fn apply(&self, now: u64, key: BucketKey, q: &Quota) -> bool {
        let mut map = self.0.lock().expect("lock");
        let state = map.get(&key).copied();
        let v = limiter::check(state, q, now, MICRO);
        if v.allowed {
            map.insert(key, v.next);
        }
        v.allowed
    }
}

/// The key thread `t` uses for its `i`-th operation: spread over every key, or over the
/// thread's own half when `disjoint`.
fn key_index(n: usize, t: usize, i: u64, disjoint: bool) -> usize {
    let step = (i as usize).wrapping_mul(7919);
    if disjoint {
        let half = n / 2;
        t * half + step % half
    } else {
        (step + t * 31) % n
    }
}

/// Runs `op` `iters` times split across `threads`, returning the wall time.
fn run_threads(threads: usize, iters: u64, op: Arc<dyn Fn(usize, u64) + Send + Sync>) -> Duration {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let per = iters / threads as u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            let op = Arc::clone(&op);
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..per {
                    op(t, i);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().expect("bench thread");
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let keys = Arc::new(keys());
    let q = quota();
    let mut group = c.benchmark_group("store");
    // `shared`: every thread draws from the whole key mix (worst case: most updates pull the
    // bucket's cache line from the other core). `disjoint`: each thread owns half the keys, as
    // when each client's keep-alive connection stays on one worker thread.
    for (mix, disjoint) in [("shared", false), ("disjoint", true)] {
        for threads in [1usize, 2] {
            let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
            let ks = Arc::clone(&keys);
            let s = Arc::clone(&store);
            let op: Arc<dyn Fn(usize, u64) + Send + Sync> = Arc::new(move |t, i| {
                let index = key_index(ks.len(), t, i, disjoint);
                let mut results = OpResults::new();
                let r = s.apply(
                    i,
                    &[BucketOp {
                        key: ks[index],
                        quota: q,
                        cost: MICRO,
                        group: Group::Enforce,
                        window: None,
                        on_store_error: None,
                        probe: false,
                    }],
                    &mut results,
                );
                black_box(r.is_ok());
            });
            group.bench_function(format!("memory_store_{mix}_{threads}_threads"), |b| {
                b.iter_custom(|iters| {
                    run_threads(threads, iters.max(threads as u64), Arc::clone(&op))
                })
            });
            let baseline = Arc::new(MutexMap(Mutex::new(HashMap::default())));
            let ks = Arc::clone(&keys);
            let op: Arc<dyn Fn(usize, u64) + Send + Sync> = Arc::new(move |t, i| {
                let index = key_index(ks.len(), t, i, disjoint);
                black_box(baseline.apply(i, ks[index], &q));
            });
            group.bench_function(format!("mutex_hashmap_{mix}_{threads}_threads"), |b| {
                b.iter_custom(|iters| {
                    run_threads(threads, iters.max(threads as u64), Arc::clone(&op))
                })
            });
        }
    }
    group.finish();

    // 1 M distinct keys: insert throughput, then memory per live key.
    let mut group = c.benchmark_group("store_1m_keys");
    group.sample_size(10);
    let million: Vec<BucketKey> = (0..1_000_000)
        .map(|i| BucketKey::of(&format!("tb:bench:{i}")))
        .collect();
    // A fresh store holding every key once (what the 1 M insert costs, and what it weighs).
    let fill = |keys: &[BucketKey]| {
        let store = MemoryStore::new(MemoryStoreConfig {
            max_buckets: 1_000_000,
            ..MemoryStoreConfig::default()
        });
        let mut results = OpResults::new();
        for key in keys {
            let op = BucketOp {
                key: *key,
                quota: q,
                cost: MICRO,
                group: Group::Enforce,
                window: None,
                on_store_error: None,
                probe: false,
            };
            let _ = store.apply(0, &[op], &mut results);
        }
        store
    };
    group.bench_function("insert_1m_distinct", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                black_box(fill(&million));
                total += start.elapsed();
            }
            // Per key, not per million.
            total / 1_000_000
        })
    });
    group.finish();
    let store = fill(&million);
    let stats = store.stats();
    println!(
        "memory: {} live keys, {} bytes of map storage, {:.1} bytes per live key (fail-open: {})",
        stats.entries.unwrap_or(0),
        store.allocated_bytes(),
        store.allocated_bytes() as f64 / stats.entries.unwrap_or(0).max(1) as f64,
        stats.fail_open
    );
}

/// A key flood against a full store: 100 000 entries each holding spend, then new keys, each
/// evicting one (what an eviction costs: sampling, removal, the record of evicted spend) and
/// each first looking the record up.
fn flood(c: &mut Criterion) {
    let mut group = c.benchmark_group("store_flood");
    let slow = Quota::new(10 * MICRO, MICRO, 3_600 * US_PER_SEC).expect("quota");
    let store = MemoryStore::new(MemoryStoreConfig {
        max_buckets: 100_000,
        ..MemoryStoreConfig::default()
    });
    let mut results = OpResults::new();
    let op = |i: u64| BucketOp {
        key: BucketKey::of(&format!("tb:flood:{i}")),
        quota: slow,
        cost: MICRO,
        group: Group::Enforce,
        window: None,
        on_store_error: None,
        probe: false,
    };
    for i in 0..100_000 {
        let _ = store.apply(0, &[op(i)], &mut results);
    }
    let fresh: Vec<BucketOp> = (100_000..1_100_000).map(op).collect();
    let mut next = 0usize;
    group.bench_function("evict_for_new_key_100k", |b| {
        b.iter(|| {
            let o = &fresh[next % fresh.len()];
            next += 1;
            black_box(
                store
                    .apply(1, std::slice::from_ref(o), &mut results)
                    .is_ok(),
            );
        })
    });
    group.finish();
}

criterion_group!(benches, bench, flood);
criterion_main!(benches);
