//! Memory per bundle entry: the heap bytes a compiled bundle of `n` one-rule policies (selected
//! by path prefix) or `n` kill switches keeps, divided by `n` (counted by the allocator, so the
//! parser's transient JSON tree does not count), and the resident set size the process grew by.
//! Run by hand:
//!
//! ```sh
//! cargo run --release --example bundle_memory -- policies 10000
//! cargo run --release --example bundle_memory -- kill_switches 100000
//! ```

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/counting.rs"]
mod counting;
use counting::LIVE;
use std::sync::atomic::Ordering;

#[path = "common/rss.rs"]
mod rss;
use rss::rss_bytes;

fn main() {
    let mut args = std::env::args().skip(1);
    let kind = args.next().unwrap_or_else(|| "policies".to_string());
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let rule = r#"{"name": "r", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 10, "burst": 20}}"#;
    let text = if kind == "kill_switches" {
        let switches: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"scope_key": "header:x-api-key", "scope_value": "blocked-key-{i:08}", "reason": "abuse"}}"#))
            .collect();
        format!(
            r#"{{"bundle_version": 1, "kill_switches": [{}], "policies": [{{"id": "p", "spec": {{"rules": [{rule}]}}}}]}}"#,
            switches.join(",")
        )
    } else {
        let policies: Vec<String> = (0..n)
            .map(|i| {
                format!(r#"{{"id": "tenant-{i}", "spec": {{"selector": {{"pathPrefix": "/t/{i}"}}, "rules": [{}]}}}}"#,
                    rule.replace("\"r\"", &format!("\"r{i}\"")))
            })
            .collect();
        format!(
            r#"{{"bundle_version": 1, "policies": [{}]}}"#,
            policies.join(",")
        )
    };
    // The source text is not part of the bundle: measure after it exists.
    let before = rss_bytes();
    let live_before = LIVE.load(Ordering::Relaxed);
    let start = std::time::Instant::now();
    let bundle = tollgate::policy::parse_bundle(text.as_bytes(), "memory").expect("bundle");
    let took = start.elapsed();
    let kept = LIVE.load(Ordering::Relaxed).saturating_sub(live_before);
    let before_collect = rss_bytes();
    tollgate::policy::release_parse_memory();
    let after = rss_bytes();
    println!(
        "RSS grew {} MB before the allocator gave the parse's memory back",
        before_collect.saturating_sub(before) / 1_000_000
    );
    println!(
        "{n} {kind}: compiled in {:.0} ms; {} heap bytes kept per entry ({:.1} MB); RSS grew {} MB ({} policies, {} kill switches)",
        took.as_secs_f64() * 1000.0,
        kept / n.max(1),
        kept as f64 / 1e6,
        after.saturating_sub(before) / 1_000_000,
        bundle.policies.len(),
        bundle.kill_switches.len()
    );
}
