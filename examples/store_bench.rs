//! Decisions per second and p50/p99 latency of one store call, per store, at 1 and 8 rules per
//! request (by hand: `cargo run --release --example store_bench -- URL...` with any
//! `redis://`, `redis+cluster://` or `postgres://` URLs). Without a URL only the embedded store
//! is measured. Sequential calls from one task, on
//! loopback: latency is a round trip plus the script; throughput scales with concurrency.

use std::time::{Duration, Instant};
use tollgate::limiter::{Quota, MICRO, US_PER_SEC};
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
    for url in std::env::args().skip(1) {
        let store = Store::open(
            &url,
            Duration::from_secs(1),
            std::sync::Arc::new(tollgate::clock::SystemClock::new()),
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
