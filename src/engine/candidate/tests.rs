//! A candidate decided beside the live bundle on the embedded store, with a manual clock.

use super::*;
use crate::engine::decide_local;
use crate::limits::clock::{Clock, ManualClock};
use crate::policy::{compile_bundle, compile_bundle_with, CompileOptions};
use crate::store::{MemoryStore, MemoryStoreConfig};
use serde_json::json;

fn rule(name: &str, burst: u64) -> serde_json::Value {
    json!({"name": name, "limit_keys": ["ip:address"], "algorithm": "token_bucket",
           "algorithm_config": {"tokens_per_second": 10, "burst": burst}})
}

fn bundle(rules: Vec<serde_json::Value>) -> serde_json::Value {
    json!({"bundle_version": 1, "policies": [{"id": "p", "spec": {"rules": rules}}]})
}

fn candidate_of(v: &serde_json::Value) -> Arc<Bundle> {
    let options = CompileOptions {
        candidate: true,
        ..CompileOptions::default()
    };
    Arc::new(compile_bundle_with(v, "candidate", options).unwrap())
}

struct Bench {
    live: Arc<Bundle>,
    candidate: CandidateBundle,
    store: MemoryStore,
    clock: ManualClock,
}

impl Bench {
    fn new(live: &serde_json::Value, candidate: &serde_json::Value, share: bool) -> Bench {
        let live = Arc::new(compile_bundle(live, "live").unwrap());
        let candidate = CandidateBundle::new(candidate_of(candidate), share.then(|| live.clone()));
        Bench {
            live,
            candidate,
            store: MemoryStore::new(MemoryStoreConfig::default()),
            clock: ManualClock::new(1_800_000_000),
        }
    }

    /// One request from `ip`: whether the live bundle allowed it, and the candidate's refusals
    /// as `rule` names (kill switches as `kill_switch`).
    fn request(&self, ip: &str) -> (bool, Vec<String>) {
        self.request_with(ip, &[])
    }

    fn request_with(&self, ip: &str, headers: &[(&str, &str)]) -> (bool, Vec<String>) {
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let facts = RequestFacts::from_uri(
            "GET",
            "/v1/orders",
            Some("api.example.com"),
            Some(ip.parse().unwrap()),
            &headers,
        );
        let (now, unix) = (self.clock.now_us(), self.clock.unix_us());
        let config = EngineConfig::default();
        let live = decide_local(&self.live, &facts, &self.store, now, unix, config);
        let refused = decide_candidate_local(
            &self.candidate,
            &live,
            &facts,
            &self.store,
            now,
            unix,
            config,
        );
        let names = refused
            .iter()
            .map(|r| match r {
                Refuser::Rule(i) => self.candidate.bundle().rules[*i as usize].name.clone(),
                Refuser::KillSwitch(_) => "kill_switch".to_string(),
            })
            .collect();
        (live.is_allowed(), names)
    }
}

#[test]
fn a_candidate_with_a_smaller_burst_would_refuse_exactly_the_excess_and_changes_nothing_live() {
    let live = bundle(vec![rule("per-ip", 10)]);
    let candidate = bundle(vec![rule("per-ip", 5)]);
    for share in [false, true] {
        let b = Bench::new(&live, &candidate, share);
        assert!(!b.candidate.is_shared(0), "a changed rule is never shared");
        let mut refused = 0;
        for _ in 0..10 {
            let (allowed, names) = b.request("10.0.0.1");
            assert!(allowed, "the live bundle allows all 10");
            refused += names.iter().filter(|n| *n == "per-ip").count();
            assert!(names.iter().all(|n| n == "per-ip"));
        }
        assert_eq!(refused, 5);
        // The live bucket spent 10 of its 10 tokens, the candidate's 5 of 5: separate buckets.
        assert!(!b.request("10.0.0.1").0);
    }
}

#[test]
fn every_key_of_a_candidate_is_under_its_own_prefix() {
    let candidate = candidate_of(&bundle(vec![rule("per-ip", 5)]));
    assert_eq!(candidate.rules[0].key_prefix, "candidate:tb:per-ip:");
    let live = compile_bundle(&bundle(vec![rule("per-ip", 5)]), "live").unwrap();
    assert_eq!(live.rules[0].key_prefix, "tb:per-ip:");
    assert_eq!(live.rules[0].definition, candidate.rules[0].definition);
    // Made a candidate after compiling: the same keys, once.
    let mut late = compile_bundle(&bundle(vec![rule("per-ip", 5)]), "live").unwrap();
    assert!(!late.is_candidate());
    late.make_candidate();
    late.make_candidate();
    assert!(late.is_candidate());
    assert_eq!(late.rules[0].key_prefix, "candidate:tb:per-ip:");
    assert_eq!(
        late.envoy_override.key_prefix,
        "candidate:tb:envoy-limit-override:"
    );
}

#[test]
fn an_unchanged_rule_reports_exactly_the_live_rules_refusals_and_a_changed_one_its_own() {
    let live = bundle(vec![rule("same", 3), rule("changed", 10)]);
    let candidate = bundle(vec![rule("same", 3), rule("changed", 4)]);
    let b = Bench::new(&live, &candidate, true);
    assert!(b.candidate.is_shared(0));
    assert!(!b.candidate.is_shared(1));
    assert_eq!(b.candidate.shared_rules(), 1);
    let (mut live_refused, mut same, mut changed) = (0, 0, 0);
    for _ in 0..8 {
        let (allowed, names) = b.request("10.0.0.2");
        live_refused += usize::from(!allowed);
        same += names.iter().filter(|n| *n == "same").count();
        changed += names.iter().filter(|n| *n == "changed").count();
    }
    // Live: `same` (burst 3) refuses 5 of 8, and nothing is spent on those (all-or-nothing).
    assert_eq!(live_refused, 5);
    assert_eq!(
        same, live_refused,
        "the unchanged rule reports the live verdicts"
    );
    // `changed` (burst 4) on its own bucket, spent on all 8 requests: refuses 4.
    assert_eq!(changed, 4);
}

#[test]
fn a_candidate_compared_to_no_live_bundle_decides_every_rule_on_its_own_buckets() {
    let same = bundle(vec![rule("per-ip", 3)]);
    let b = Bench::new(&same, &same, false);
    assert_eq!(b.candidate.shared_rules(), 0);
    let mut refused = 0;
    for _ in 0..5 {
        refused += b.request("10.0.0.3").1.len();
    }
    assert_eq!(refused, 2);
}

#[test]
fn a_candidate_kill_switch_and_a_changed_selector_are_the_candidates_own() {
    let live = bundle(vec![rule("per-ip", 10)]);
    let mut candidate = bundle(vec![rule("per-ip", 10)]);
    candidate["kill_switches"] =
        json!([{"scope_key": "ip:address", "scope_value": "10.0.0.9", "reason": "abuse"}]);
    let b = Bench::new(&live, &candidate, true);
    assert_eq!(
        b.request("10.0.0.9"),
        (true, vec!["kill_switch".to_string()])
    );
    assert_eq!(b.request("10.0.0.8"), (true, vec![]));

    let mut moved = bundle(vec![rule("per-ip", 10)]);
    moved["policies"][0]["spec"]["selector"] = json!({"pathPrefix": "/v1"});
    let b = Bench::new(&live, &moved, true);
    assert_eq!(
        b.candidate.shared_rules(),
        0,
        "a selector change changes every rule"
    );
}

#[test]
fn a_candidate_concurrency_slot_is_given_back_at_once() {
    let live = bundle(vec![rule("per-ip", 10)]);
    let candidate = bundle(vec![
        rule("per-ip", 10),
        json!({"name": "one-at-a-time", "limit_keys": ["ip:address"], "algorithm": "concurrency",
               "algorithm_config": {"max_in_flight": 1}}),
    ]);
    let b = Bench::new(&live, &candidate, true);
    for _ in 0..3 {
        assert_eq!(b.request("10.0.0.4"), (true, vec![]));
    }
}

#[test]
fn an_unchanged_policy_is_read_whole_from_the_live_decision() {
    let policies = |changed_burst: u64| {
        json!({"bundle_version": 1, "policies": [
            {"id": "same", "spec": {"rules": [rule("strict", 3)]}},
            {"id": "changed", "spec": {"rules": [rule("loose", changed_burst)]}}
        ]})
    };
    let b = Bench::new(&policies(100), &policies(4), true);
    assert_eq!(b.candidate.unchanged_policies(), 1);
    let (mut live_refused, mut strict, mut loose) = (0, 0, 0);
    for _ in 0..7 {
        let (allowed, names) = b.request("10.0.0.5");
        live_refused += usize::from(!allowed);
        strict += names.iter().filter(|n| *n == "strict").count();
        loose += names.iter().filter(|n| *n == "loose").count();
    }
    assert_eq!(live_refused, 4);
    assert_eq!(strict, live_refused);
    // `loose` (burst 4) on its own bucket, spent by all 7.
    assert_eq!(loose, 3);
}

#[test]
fn a_fallback_that_applies_only_under_the_candidate_is_decided_on_its_own_bucket() {
    let gold = json!({"name": "gold", "limit_keys": ["ip:address"], "match": {"header:x-tier": "gold"},
        "algorithm": "token_bucket", "algorithm_config": {"tokens_per_second": 1, "burst": 100}});
    let rest = json!({"name": "rest", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
        "algorithm_config": {"tokens_per_second": 1, "burst": 2}});
    let live = json!({"bundle_version": 1, "policies": [
        {"id": "p", "spec": {"rules": [gold], "fallback_limit": rest.clone()}}]});
    let candidate = json!({"bundle_version": 1, "policies": [
        {"id": "p", "spec": {"rules": [], "fallback_limit": rest}}]});
    let b = Bench::new(&live, &candidate, true);
    assert_eq!(b.candidate.shared_rules(), 1, "the fallback is unchanged");
    assert_eq!(
        b.candidate.unchanged_policies(),
        0,
        "the policy lost a rule"
    );
    let mut refused = 0;
    for _ in 0..3 {
        let (allowed, names) = b.request_with("10.0.0.6", &[("x-tier", "gold")]);
        assert!(allowed);
        refused += names.iter().filter(|n| *n == "rest").count();
    }
    // The live decision never reached `rest` (gold applied): its own bucket, burst 2.
    assert_eq!(refused, 1);
}
