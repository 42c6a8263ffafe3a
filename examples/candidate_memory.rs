//! Memory of a candidate bundle: a gateway (the library's `Gateway`, embedded store) with a live
//! bundle of `n` one-rule policies selected by path prefix, then the same bundle with one rule
//! changed set as its candidate. Prints the heap bytes each keeps (counted by the allocator) and
//! the resident set size after each. Run by hand:
//!
//! ```sh
//! cargo run --release --example candidate_memory -- 10000
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

fn bundle(n: usize, changed_burst: u64) -> String {
    let policies: Vec<String> = (0..n)
        .map(|i| {
            let burst = if i == 0 { changed_burst } else { 20 };
            format!(
                r#"{{"id": "tenant-{i}", "spec": {{"selector": {{"pathPrefix": "/t/{i}"}}, "rules": [{{"name": "r{i}", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {{"rps": 10, "burst": {burst}}}}}]}}}}"#
            )
        })
        .collect();
    format!(
        r#"{{"bundle_version": 1, "policies": [{}]}}"#,
        policies.join(",")
    )
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, bundle(n, 20)).expect("policy file");
    let candidate_text = bundle(n, 5);
    let cli = <tollgate::config::cli::Cli as clap::Parser>::try_parse_from([
        "tollgate",
        "run",
        "--policy",
        policy.to_str().expect("utf-8 path"),
        "--upstream",
        "127.0.0.1:9",
    ])
    .expect("arguments");
    let tollgate::config::cli::Command::Run(args) = cli.command else {
        unreachable!("a run command")
    };
    let config = tollgate::config::Config::from_args(&args).expect("config");
    let gateway = tollgate::service::Gateway::new(config).expect("gateway");

    let heap = || LIVE.load(Ordering::Relaxed) as u64;
    let (rss_start, heap_start) = (rss_bytes(), heap());
    gateway
        .load_policy(tollgate::service::Trigger::Startup)
        .expect("live bundle");
    tollgate::policy::release_parse_memory();
    let (rss_live, heap_live) = (rss_bytes(), heap());

    let options = tollgate::policy::CompileOptions {
        candidate: true,
        ..Default::default()
    };
    let candidate =
        tollgate::policy::parse_bundle_with(candidate_text.as_bytes(), "candidate", options)
            .expect("candidate bundle");
    gateway.set_candidate(Some(candidate));
    tollgate::policy::release_parse_memory();
    let (rss_candidate, heap_candidate) = (rss_bytes(), heap());
    // The candidate's source text lived through both measurements: it counts in neither.
    drop(candidate_text);
    let summary = gateway.candidate.summary().expect("a candidate");
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "{n} policies: live bundle {:.1} MB heap, RSS {:.1} -> {:.1} MB; candidate ({} of {} rules unchanged) {:.1} MB heap ({} bytes per policy), RSS {:.1} MB (+{:.1})",
        mb(heap_live.saturating_sub(heap_start)),
        mb(rss_start),
        mb(rss_live),
        summary.shared_rules,
        summary.rules,
        mb(heap_candidate.saturating_sub(heap_live)),
        heap_candidate.saturating_sub(heap_live) / n.max(1) as u64,
        mb(rss_candidate),
        mb(rss_candidate.saturating_sub(rss_live)),
    );
}
