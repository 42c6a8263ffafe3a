//! The candidate on a gateway with the embedded store and a manual clock: counted exactly,
//! on its own buckets, never changing an answer, a header, the live metrics or the top list.

use super::*;
use crate::config::Config;
use crate::limits::clock::ManualClock;
use crate::policy::{compile_bundle_with, CompileOptions};
use crate::service::{Answer, Gateway, Trigger};
use serde_json::json;

fn rule(burst: u64) -> serde_json::Value {
    json!({"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
           "algorithm_config": {"tokens_per_second": 10, "burst": burst}})
}

fn bundle(version: u64, rules: Vec<serde_json::Value>) -> serde_json::Value {
    json!({"bundle_version": version, "policies": [{"id": "p", "spec": {"rules": rules}}]})
}

fn candidate(v: &serde_json::Value) -> Bundle {
    let options = CompileOptions {
        candidate: true,
        ..CompileOptions::default()
    };
    let mut bundle = compile_bundle_with(v, "candidate", options).unwrap();
    bundle.hash = "c0ffee".to_string();
    bundle
}

/// A gateway on the embedded store with `live` loaded from a file in `dir`.
fn gateway(dir: &tempfile::TempDir, live: &serde_json::Value) -> (Gateway, ManualClock) {
    gateway_with(dir, live, &[])
}

fn gateway_with(
    dir: &tempfile::TempDir,
    live: &serde_json::Value,
    extra: &[&str],
) -> (Gateway, ManualClock) {
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, live.to_string()).unwrap();
    let mut argv = vec![
        "tollgate",
        "run",
        "--policy",
        policy.to_str().unwrap(),
        "--upstream",
        "127.0.0.1:9",
    ];
    argv.extend(extra);
    let cli = <crate::config::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap();
    let crate::config::cli::Command::Run(args) = cli.command else {
        unreachable!("a run command")
    };
    let config = Config::from_args(&args).unwrap();
    let clock = ManualClock::new(1_800_000_000);
    let gateway = Gateway::with_clock(config, Arc::new(clock.clone())).unwrap();
    gateway.load_policy(Trigger::Sighup).unwrap();
    (gateway, clock)
}

fn decide(gateway: &Gateway, ip: &str) -> Answer {
    let headers: Vec<(String, String)> = Vec::new();
    let facts = RequestFacts::from_uri(
        "GET",
        "/v1/orders",
        Some("api.example.com"),
        Some(ip.parse().unwrap()),
        &headers,
    );
    gateway.decide_in_memory(&facts).unwrap()
}

/// The metrics text without the candidate's lines, the latency histogram (timed) and the
/// embedded store's entries (the candidate's buckets are held there too).
fn live_metrics(gateway: &Gateway) -> String {
    gateway
        .metrics_text()
        .lines()
        .filter(|l| {
            !l.contains("candidate")
                && !l.contains("tollgate_decision_duration")
                && !l.starts_with("tollgate_store_entries")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_candidate_with_half_the_burst_would_refuse_exactly_five_of_ten_and_changes_nothing() {
    let live = bundle(1, vec![rule(10)]);
    let (dir, plain_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (gw, _clock) = gateway(&dir, &live);
    let (plain, _plain_clock) = gateway(&plain_dir, &live);
    gw.set_candidate(Some(candidate(&bundle(2, vec![rule(5)]))));
    assert_eq!(
        gw.candidate.info(),
        Some(("2".to_string(), "c0ffee".to_string()))
    );
    for _ in 0..10 {
        let (with, without) = (decide(&gw, "10.0.0.1"), decide(&plain, "10.0.0.1"));
        assert!(with.verdict.forwards());
        assert_eq!(with.verdict.as_str(), without.verdict.as_str());
        assert_eq!(
            format!("{:?}", with.response),
            format!("{:?}", without.response),
            "headers and status unchanged"
        );
    }
    let expected: BTreeMap<String, u64> = [("p/per-ip".to_string(), 5)].into();
    assert_eq!(gw.candidate.refusals(), expected);
    let text = gw.metrics_text();
    for line in [
        "tollgate_candidate_would_refuse_total{policy=\"p\",rule=\"per-ip\"} 5",
        "tollgate_candidate_decisions_total 10",
        "tollgate_candidate_skipped_total 0",
        "tollgate_candidate_info{hash=\"c0ffee\",version=\"2\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    assert_eq!(
        live_metrics(&gw),
        live_metrics(&plain),
        "live metrics unchanged"
    );
    let now = 1_800_000_000;
    assert!(
        gw.top.lock().top(20, None, now).entries.is_empty(),
        "top list unchanged"
    );
    // The live bucket is untouched by the candidate's spending: its 11th request is its first
    // refusal, as on the gateway without a candidate.
    assert_eq!(
        decide(&gw, "10.0.0.1").verdict.forwards(),
        decide(&plain, "10.0.0.1").verdict.forwards()
    );
    let summary = gw.candidate.summary().unwrap();
    assert_eq!(
        (summary.decisions, summary.shared_rules, summary.rules),
        (11, 0, 1)
    );
}

#[test]
fn replacing_or_clearing_the_candidate_starts_its_counts_again() {
    let live = bundle(1, vec![rule(10)]);
    let dir = tempfile::tempdir().unwrap();
    let (gw, _clock) = gateway(&dir, &live);
    gw.set_candidate(Some(candidate(&bundle(2, vec![rule(1)]))));
    for _ in 0..3 {
        decide(&gw, "10.0.0.2");
    }
    assert_eq!(gw.candidate.refusals().get("p/per-ip"), Some(&2));
    // Replaced: counts from zero (its buckets are the same `candidate:` keys, whose history
    // the new candidate inherits, as the live bundle's do across a reload).
    gw.set_candidate(Some(candidate(&bundle(3, vec![rule(2)]))));
    assert!(gw.candidate.refusals().is_empty());
    assert!(gw
        .metrics_text()
        .contains("tollgate_candidate_info{hash=\"c0ffee\",version=\"3\"} 1"));
    assert!(!gw.metrics_text().contains("version=\"2\""));
    decide(&gw, "10.0.0.3");
    assert_eq!(gw.candidate.summary().unwrap().decisions, 1);
    // A reload of the live bundle keeps the candidate and its counts.
    std::fs::write(
        dir.path().join("policy.json"),
        bundle(4, vec![rule(10)]).to_string(),
    )
    .unwrap();
    gw.load_policy(Trigger::Sighup).unwrap();
    assert_eq!(gw.candidate.summary().unwrap().decisions, 1);
    gw.set_candidate(None);
    assert_eq!(gw.candidate.info(), None);
    assert!(gw.candidate.refusals().is_empty());
    let text = gw.metrics_text();
    assert!(text
        .lines()
        .any(|l| l == "tollgate_candidate_decisions_total 0"));
    assert!(!text.contains("tollgate_candidate_info{"));
    decide(&gw, "10.0.0.3");
    assert!(gw
        .metrics_text()
        .lines()
        .any(|l| l == "tollgate_candidate_decisions_total 0"));
}

#[test]
fn an_unchanged_rule_beside_a_changed_one_reports_the_live_refusals() {
    let strict = json!({"name": "strict", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
           "algorithm_config": {"tokens_per_second": 1, "burst": 2}});
    let live = bundle(1, vec![rule(10), strict.clone()]);
    let dir = tempfile::tempdir().unwrap();
    let (gw, _clock) = gateway(&dir, &live);
    gw.set_candidate(Some(candidate(&bundle(2, vec![rule(3), strict]))));
    assert_eq!(gw.candidate.summary().unwrap().shared_rules, 1);
    let mut live_refused = 0;
    for _ in 0..6 {
        live_refused += u64::from(!decide(&gw, "10.0.0.4").verdict.forwards());
    }
    assert_eq!(live_refused, 4);
    let expected: BTreeMap<String, u64> = [
        ("p/strict".to_string(), live_refused),
        // `per-ip` on its own candidate bucket (burst 3), spent by all 6 requests.
        ("p/per-ip".to_string(), 3),
    ]
    .into();
    assert_eq!(gw.candidate.refusals(), expected);
}

#[tokio::test]
async fn envoy_calls_are_decided_under_the_candidate_too() {
    let live = json!({"rules": [{"name": "per-ip", "limit_keys": ["ip:address"],
        "algorithm": "token_bucket", "algorithm_config": {"tokens_per_second": 10, "burst": 10}}]});
    let dir = tempfile::tempdir().unwrap();
    let (gw, _clock) = gateway(&dir, &live);
    let mut next = live.clone();
    next["rules"][0]["algorithm_config"]["burst"] = json!(5);
    gw.set_candidate(Some(candidate(&next)));
    let request = RlsRequest {
        domain: "edge".into(),
        descriptors: vec![crate::engine::rls::RlsDescriptor {
            entries: vec![("remote_address".into(), "10.0.0.5".into())],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    for _ in 0..10 {
        let reply = gw.should_rate_limit(&request, true).await.unwrap();
        assert!(!reply.over_limit);
    }
    // A bare bundle's policy is named after what it was compiled as.
    let expected: BTreeMap<String, u64> = [("candidate/per-ip".to_string(), 5)].into();
    assert_eq!(gw.candidate.refusals(), expected);
}

#[tokio::test]
async fn with_a_shared_store_too_many_outstanding_candidate_calls_skip_and_count() {
    let live = bundle(1, vec![rule(10)]);
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there: the live decision fails open, and no candidate call is made.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://127.0.0.1:{port}/0");
    let (gw, _clock) = gateway_with(&dir, &live, &["--store", &url]);
    gw.set_candidate(Some(candidate(&bundle(2, vec![rule(5)]))));
    gw.candidate
        .pending
        .store(MAX_CANDIDATE_PENDING, Ordering::Release);
    let headers: Vec<(String, String)> = Vec::new();
    let facts = RequestFacts::from_uri(
        "GET",
        "/v1/orders",
        Some("api.example.com"),
        Some("10.0.0.6".parse().unwrap()),
        &headers,
    );
    assert!(gw.decide(&facts).await.verdict.forwards());
    let summary = gw.candidate.summary().unwrap();
    assert_eq!((summary.skipped, summary.decisions), (1, 0));
    assert_eq!(
        gw.candidate.pending.load(Ordering::Acquire),
        MAX_CANDIDATE_PENDING,
        "the skipped request gave its slot back"
    );
    assert!(gw
        .metrics_text()
        .lines()
        .any(|l| l == "tollgate_candidate_skipped_total 1"));
}
