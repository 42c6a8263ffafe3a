//! Decisions per second and p50/p99 latency of one store call, per store, at 1 and 8 rules per
//! request (by hand: `cargo run --release --example store_bench -- URL...` with any
//! `redis://`, `redis+cluster://` or `postgres://` URLs). Without a URL only the embedded store
//! is measured. Sequential calls from one task, on
//! loopback: latency is a round trip plus the script; throughput scales with concurrency.
//!
//! Then the embedded store under a sustained flood of new keys, on one thread: a store of
//! 100 000 filled with slow-refilling buckets, then 500 000 decisions each for a key never seen
//! (one rule: a bucket; two rules: a bucket and a monthly budget), 10 µs of clock apart. Every
//! one needs room in a full store. For reference, the same keys in a store with room for all of
//! them.

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};
use tollgate::limits::limiter::{Quota, MICRO, US_PER_SEC};
use tollgate::store::{
    BucketKey, BucketOp, Group, MemoryStore, MemoryStoreConfig, OpResults, Store,
};

fn ops(rules: usize, client: u64) -> Vec<BucketOp> {
    let quota = Quota::new(1_000_000_000 * MICRO, 1_000_000 * MICRO, US_PER_SEC).expect("quota");
    (0..rules)
        .map(|r| BucketOp {
            key: BucketKey::of(&format!("tb:bench-rule-{r}:client-{client}")),
            quota,
            cost: MICRO,
            group: Group::Enforce,
            window: None,
            on_store_error: None,
            probe: false,
        })
        .collect()
}

fn report(store: &str, rules: usize, mut latencies: Vec<Duration>, wall: Duration) {
    latencies.sort_unstable();
    let n = latencies.len();
    let pct = |p: f64| latencies[((n as f64 * p) as usize).min(n - 1)];
    println!(
        "| {store} | {rules} | {:.0} | {:.1} | {:.1} |",
        n as f64 / wall.as_secs_f64(),
        pct(0.50).as_secs_f64() * 1e6,
        pct(0.99).as_secs_f64() * 1e6
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    const N: u64 = 10_000;
    println!("| store | rules/request | decisions/s (1 task) | p50 µs | p99 µs |");
    println!("|---|---|---|---|---|");
    for rules in [1usize, 8] {
        let memory = MemoryStore::new(MemoryStoreConfig::default());
        let mut results = OpResults::new();
        let mut latencies = Vec::with_capacity(N as usize);
        let wall = Instant::now();
        for i in 0..N {
            let batch = ops(rules, i % 1024);
            let t = Instant::now();
            memory.apply(i, &batch, &mut results).expect("memory store");
            latencies.push(t.elapsed());
        }
        report("embedded", rules, latencies, wall.elapsed());
    }
    flood();
    for url in std::env::args().skip(1) {
        let store = Store::open(
            &url.parse().expect("store url"),
            Duration::from_secs(1),
            std::sync::Arc::new(tollgate::limits::clock::SystemClock::new()),
        )
        .expect("store url");
        store.connect_in_background();
        let start = Instant::now();
        while !store.connected() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "cannot connect to {url}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let name = if url.starts_with("redis+cluster") {
            "redis cluster"
        } else {
            store.kind()
        };
        for rules in [1usize, 8] {
            let mut results = OpResults::new();
            let mut latencies = Vec::with_capacity(N as usize);
            let wall = Instant::now();
            let base = 1_800_000_000 * US_PER_SEC;
            for i in 0..N {
                let batch = ops(rules, i % 1024);
                let t = Instant::now();
                store
                    .apply(base + i, &batch, &mut results)
                    .await
                    .expect("store call");
                latencies.push(t.elapsed());
            }
            report(name, rules, latencies, wall.elapsed());
        }
    }
}

/// The flood rows (see the module doc).
fn flood() {
    const BOUND: usize = 100_000;
    const FLOOD: u64 = 500_000;
    // Ten tokens, one an hour: nothing refills during the run.
    let slow = Quota::new(10 * MICRO, MICRO, 3_600 * US_PER_SEC).expect("quota");
    let month = 30 * 86_400 * US_PER_SEC;
    let budget = Quota::new(20 * MICRO, 20 * MICRO, month).expect("quota");
    let request = |rules: usize, i: u64| -> Vec<BucketOp> {
        let mut ops = vec![BucketOp {
            key: BucketKey::of(&format!("tb:ip:{i}")),
            quota: slow,
            cost: MICRO,
            group: Group::Enforce,
            window: None,
            on_store_error: None,
            probe: false,
        }];
        if rules == 2 {
            ops.push(BucketOp {
                key: BucketKey::of(&format!("tb:monthly:{i}")),
                quota: budget,
                cost: MICRO,
                group: Group::Enforce,
                window: Some(tollgate::limits::limiter::Window {
                    id: 1_800_000_000,
                    ends_in_us: month,
                }),
                on_store_error: None,
                probe: false,
            });
        }
        ops
    };
    // A full store (every new key needs room), then, for reference, the same keys in a store
    // with room for all of them (every new key is simply stored).
    for (rules, bound) in [
        (1usize, BOUND),
        (2, BOUND),
        (1, 10 * BOUND),
        (2, 20 * BOUND),
    ] {
        let memory = MemoryStore::new(MemoryStoreConfig {
            max_buckets: bound,
            ..MemoryStoreConfig::default()
        });
        let mut results = OpResults::new();
        let fill = BOUND as u64 / rules as u64;
        for i in 0..fill {
            memory
                .apply(i * 10, &request(rules, i), &mut results)
                .expect("memory store");
        }
        let batches: Vec<Vec<BucketOp>> = (fill..fill + FLOOD).map(|i| request(rules, i)).collect();
        let mut latencies = Vec::with_capacity(FLOOD as usize);
        let wall = Instant::now();
        for (i, batch) in (fill..).zip(&batches) {
            let t = Instant::now();
            memory
                .apply(i * 10, batch, &mut results)
                .expect("memory store");
            latencies.push(t.elapsed());
        }
        let wall = wall.elapsed();
        let stats = memory.stats();
        report(
            &format!(
                "embedded, key flood, bound {bound} (entries {}, evictions {}, fail-open {})",
                stats.entries.unwrap_or(0),
                stats.evictions,
                stats.fail_open
            ),
            rules,
            latencies,
            wall,
        );
    }
}
