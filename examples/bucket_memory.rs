//! Memory per live bucket as the operating system sees it: the process's resident set size
//! (VmRSS) before and after a flood of distinct client addresses through the real engine and
//! embedded store, divided by the buckets held. Run by hand:
//!
//! ```sh
//! cargo run --release --example bucket_memory -- 1000000
//! ```

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// The shipped binary's allocator: RSS depends on it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::{IpAddr, Ipv4Addr};
use tollgate::engine::{decide_local, EngineConfig};
use tollgate::policy::compile_bundle;
use tollgate::request::descriptor::RequestFacts;
use tollgate::store::{MemoryStore, MemoryStoreConfig};

#[path = "common/rss.rs"]
mod rss;
use rss::rss_bytes;

fn main() {
    let keys: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let bundle = compile_bundle(
        &serde_json::json!({"rules": [{"name": "per-ip", "limit_keys": ["ip:address"],
            "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 10}}]}),
        "flood",
    )
    .expect("bundle");
    let store = MemoryStore::new(MemoryStoreConfig {
        max_buckets: keys as usize + 1, // + the warm-up key
        ..MemoryStoreConfig::default()
    });
    let decide = |facts: &RequestFacts<'_>| {
        decide_local(&bundle, facts, &store, 0, 0, EngineConfig::default()).is_allowed()
    };
    let headers: Vec<(String, String)> = Vec::new();
    // Warm up allocator and thread-local buffers before the baseline.
    let _ = decide(&RequestFacts::from_uri(
        "GET",
        "/",
        None,
        Some(IpAddr::V4(Ipv4Addr::new(255, 255, 255, 255))),
        &headers,
    ));
    let before = rss_bytes();
    for i in 0..keys {
        let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
        assert!(decide(&RequestFacts::from_uri(
            "GET",
            "/",
            None,
            Some(ip),
            &headers,
        )));
    }
    // Let the allocator return pages freed by table growth (it purges after a short delay,
    // on its next calls), as a running gateway's would be by its next requests.
    for _ in 0..20 {
        crossbeam_epoch::pin().flush();
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(std::hint::black_box(vec![0u8; 4096]));
    }
    let after = rss_bytes();
    let stats = store.stats();
    let entries = stats.entries.unwrap_or(0);
    println!(
        "{} buckets held ({} fail-open): RSS {:.1} MiB -> {:.1} MiB, {:.1} bytes per bucket",
        entries,
        stats.fail_open,
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        (after - before) as f64 / entries.max(1) as f64
    );
}
