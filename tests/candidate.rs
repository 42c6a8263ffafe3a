//! A candidate bundle on a gateway whose buckets are in a real `redis-server`: the library's
//! `Gateway` (the command line has no way to set a candidate; the policy store's follower
//! does), deciding through `Gateway::decide` as the decision service and ext_authz do. The
//! candidate's store calls run in tasks of their own: the test waits for their count, bounded.

use crate::support;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate::policy::{parse_bundle_with, CompileOptions};
use tollgate::request::descriptor::RequestFacts;
use tollgate::service::{Gateway, Trigger};

/// `redis-server` on a free loopback port, stopped when dropped.
struct Redis(Child, u16, #[allow(dead_code)] tempfile::TempDir);

impl Redis {
    fn start() -> Redis {
        let port = support::free_port();
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run `bash scripts/test.sh` (it installs it)");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis(child, port, dir)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Burst `burst`, refilled so slowly (one token in 100 s) that the test's own time never
/// refills anything.
fn bundle(version: u32, burst: u32) -> String {
    format!(
        r#"{{"bundle_version": {version}, "policies": [{{"id": "api", "spec": {{"rules": [
        {{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
          "algorithm_config": {{"tokens_per_second": 0.01, "burst": {burst}}}}}]}}}}]}}"#
    )
}

fn gateway(redis: &Redis, dir: &tempfile::TempDir) -> Arc<Gateway> {
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, bundle(1, 10)).unwrap();
    let cli = <tollgate::config::cli::Cli as clap::Parser>::try_parse_from([
        "tollgate",
        "run",
        "--policy",
        policy.to_str().unwrap(),
        "--upstream",
        "127.0.0.1:9",
        "--store",
        &format!("redis://127.0.0.1:{}/0", redis.1),
        // A debug build on a busy machine: no store call may time out and fail open.
        "--store-timeout-ms",
        "5000",
    ])
    .unwrap();
    let tollgate::config::cli::Command::Run(args) = cli.command else {
        unreachable!("a run command")
    };
    let config = tollgate::config::Config::from_args(&args).unwrap();
    let gateway = Arc::new(Gateway::new(config).unwrap());
    gateway.load_policy(Trigger::Sighup).unwrap();
    gateway
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_candidate_counts_from_its_own_buckets_without_changing_an_answer() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&redis, &dir);
    // The store connects in the background (a request before fails open).
    gw.store.connect_in_background();
    let start = Instant::now();
    while !gw.store.connected() {
        assert!(start.elapsed() < Duration::from_secs(10), "never connected");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let options = CompileOptions {
        candidate: true,
        ..CompileOptions::default()
    };
    let candidate = parse_bundle_with(bundle(2, 5).as_bytes(), "candidate", options).unwrap();
    // Shown under the SHA-256 of its text, as published bundles are.
    let hash = candidate.sha256.clone();
    gw.set_candidate(Some(candidate));
    let headers: Vec<(String, String)> = Vec::new();
    for _ in 0..10 {
        let facts = RequestFacts::from_uri(
            "GET",
            "/v1/orders",
            Some("api.example.com"),
            Some("10.0.0.1".parse().unwrap()),
            &headers,
        );
        let answer = gw.decide(&facts).await;
        assert!(
            answer.verdict.forwards(),
            "the live bundle (burst 10) allows all 10"
        );
        assert_eq!(answer.verdict.reason(), None);
    }
    // The candidate's calls are not awaited by the requests: wait for their count, and for
    // the would-refuse counts (each call counts its decision first, then its refusals).
    let start = Instant::now();
    while gw.candidate.summary().unwrap().decisions < 10
        || gw.candidate.refusals().get("api/per-ip") != Some(&5)
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "candidate calls never ended: {:?}",
            gw.candidate.summary().map(|s| (s.decisions, s.refusals))
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refusals = gw.candidate.refusals();
    assert_eq!(refusals.get("api/per-ip"), Some(&5), "{refusals:?}");
    assert_eq!(gw.candidate.info(), Some(("2".to_string(), hash.clone())));
    let text = gw.metrics_text();
    for line in [
        "tollgate_candidate_would_refuse_total{policy=\"api\",rule=\"per-ip\"} 5".to_string(),
        "tollgate_candidate_decisions_total 10".to_string(),
        "tollgate_candidate_skipped_total 0".to_string(),
        format!("tollgate_candidate_info{{hash=\"{hash}\",version=\"2\"}} 1"),
        "tollgate_store_errors_total 0".to_string(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // The live buckets saw the live requests alone: the 11th is the first refused.
    let facts = RequestFacts::from_uri(
        "GET",
        "/v1/orders",
        Some("api.example.com"),
        Some("10.0.0.1".parse().unwrap()),
        &headers,
    );
    assert!(!gw.decide(&facts).await.verdict.forwards());
}
