//! The engine's tests, and the helpers other modules' tests decide with ([`TestEngine`]).

use super::*;
use crate::limits::clock::{Clock, ManualClock};
use crate::limits::limiter::MICRO;
use crate::policy::compile_bundle;
use crate::store::{MemoryStore, MemoryStoreConfig};
use serde_json::json;
use std::cell::Cell;

/// A bundle (leaked: tests only), an embedded store and a manual clock, decided the way the
/// gateway does.
pub(crate) struct TestEngine {
    pub(crate) bundle: Cell<Option<&'static Bundle>>,
    pub(crate) store: MemoryStore,
    pub(crate) clock: ManualClock,
}

impl TestEngine {
    pub(crate) fn install(&self, bundle: Bundle) {
        self.bundle.set(Some(Box::leak(Box::new(bundle))));
    }

    pub(crate) fn decide(&self, facts: &RequestFacts<'_>) -> Decision<'static> {
        match self.bundle.get() {
            None => Decision::NoPolicy,
            Some(bundle) => decide_local(
                bundle,
                facts,
                &self.store,
                self.clock.now_us(),
                self.clock.unix_us(),
                EngineConfig::default(),
            ),
        }
    }
}

pub(crate) fn empty_engine(wall_origin: i64) -> TestEngine {
    TestEngine {
        bundle: Cell::new(None),
        store: MemoryStore::new(MemoryStoreConfig::default()),
        clock: ManualClock::new(wall_origin),
    }
}

pub(crate) fn engine(bundle: serde_json::Value) -> (TestEngine, ManualClock) {
    let e = empty_engine(1_800_000_000);
    e.install(compile_bundle(&bundle, "test").unwrap());
    let clock = e.clock.clone();
    (e, clock)
}

pub(crate) fn ask(
    e: &TestEngine,
    method: &str,
    uri: &str,
    ip: &str,
    headers: &[(&str, &str)],
) -> Decision<'static> {
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let facts = RequestFacts::from_uri(
        method,
        uri,
        Some("api.example.com"),
        Some(ip.parse().unwrap()),
        &headers,
    );
    e.decide(&facts)
}

/// The readable bucket name the request's `index`-th applicable rule used.
pub(crate) fn bucket(d: &Decision<'_>, index: usize, ip: &str, headers: &[(&str, &str)]) -> String {
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let facts = RequestFacts::from_uri(
        "GET",
        "/",
        Some("api.example.com"),
        Some(ip.parse().unwrap()),
        &headers,
    );
    bucket_name(d.rules()[index].rule, &facts, EngineConfig::default())
        .unwrap()
        .0
}

pub(crate) fn tb(name: &str, keys: serde_json::Value, rps: f64, burst: f64) -> serde_json::Value {
    json!({"name": name, "limit_keys": keys, "algorithm": "token_bucket",
           "algorithm_config": {"rps": rps, "burst": burst}})
}

#[test]
fn no_bundle_means_no_policy() {
    let e = empty_engine(0);
    let headers: Vec<(String, String)> = Vec::new();
    let d = e.decide(&RequestFacts::from_uri("GET", "/", None, None, &headers));
    assert_eq!(d.outcome(), Outcome::NoPolicy);
}

#[test]
fn all_or_nothing_across_policies() {
    let (e, _) = engine(json!({"bundle_version": 1, "policies": [
        {"id": "a", "spec": {"rules": [tb("wide", json!(["ip:address"]), 1.0, 10.0)]}},
        {"id": "b", "spec": {"selector": {"pathPrefix": "/fills"}, "rules": [tb("fills", json!(["ip:address"]), 1.0, 2.0)]}}
    ]}));
    for _ in 0..2 {
        assert!(ask(&e, "GET", "/fills", "10.0.0.1", &[]).is_allowed());
    }
    let d = ask(&e, "GET", "/fills", "10.0.0.1", &[]);
    assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
    assert_eq!(d.rules().len(), 2);
    // The wide rule was refunded: 8 left, not 7.
    assert_eq!(d.rules()[0].tokens, 8 * MICRO);
    assert!(!d.rules()[0].committed);
    assert_eq!(d.retry_after(), 1);
    // A path outside /fills only meets the wide rule.
    let d = ask(&e, "GET", "/fillsx", "10.0.0.1", &[]);
    assert!(d.is_allowed());
    assert_eq!(d.rules().len(), 1);
    assert_eq!(d.rules()[0].tokens, 7 * MICRO);
}

#[test]
fn shadow_never_rejects_and_uses_its_own_buckets() {
    let (e, _) = engine(json!({"bundle_version": 1, "policies": [
        {"id": "s", "spec": {"mode": "shadow", "rules": [tb("per-ip", json!(["ip:address"]), 1.0, 1.0)]}}
    ]}));
    assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
    let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
    assert!(d.is_allowed());
    assert_eq!(d.shadow_rejections().count(), 1);
    assert_eq!(bucket(&d, 0, "10.0.0.1", &[]), "shadow:tb:per-ip:10.0.0.1");
    assert_eq!(d.rules()[0].key, BucketKey::of("shadow:tb:per-ip:10.0.0.1"));
}

#[test]
fn tiers_match_and_fallback() {
    let (e, _) = engine(
        json!({"bundle_version": 1, "policies": [{"id": "tiers", "spec": {
            "rules": [
                {"name": "enterprise", "limit_keys": ["header:x-api-key"], "match": {"header:x-plan": "enterprise"},
                 "algorithm": "token_bucket", "algorithm_config": {"rps": 100, "burst": 200}},
                {"name": "office", "limit_keys": ["ip:address"], "match": {"ip:address": "10.0.0.0/8"},
                 "algorithm": "token_bucket", "algorithm_config": {"rps": 100, "burst": 50}}
            ],
            "fallback_limit": tb("free", json!(["header:x-api-key"]), 1.0, 2.0)
        }}]}),
    );
    let d = ask(
        &e,
        "GET",
        "/",
        "192.0.2.1",
        &[("x-api-key", "k1"), ("x-plan", "enterprise")],
    );
    assert_eq!(d.rules().len(), 1);
    assert_eq!(d.rules()[0].names(), ("tiers", "enterprise"));
    let d = ask(&e, "GET", "/", "10.9.9.9", &[("x-api-key", "k1")]);
    assert_eq!(d.rules()[0].names().1, "office");
    let d = ask(
        &e,
        "GET",
        "/",
        "192.0.2.1",
        &[("x-api-key", "k2"), ("x-plan", "free")],
    );
    assert_eq!(d.rules()[0].names().1, "free");
    assert_eq!(
        bucket(&d, 0, "192.0.2.1", &[("x-api-key", "k2")]),
        "tb:free:k2"
    );
}

#[test]
fn missing_descriptors_skip_share_or_reject() {
    let mut shared = tb("shared", json!(["header:x-api-key"]), 1.0, 1.0);
    shared["on_missing"] = json!("shared");
    let (e, _) = engine(json!({"rules": [tb("skip", json!(["header:x-user"]), 1.0, 1.0), shared]}));
    let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
    assert_eq!(d.rules().len(), 1);
    assert_eq!(bucket(&d, 0, "10.0.0.1", &[]), "tb:shared:\\0");
    assert_eq!(d.rules()[0].key, BucketKey::of("tb:shared:\\0"));
    // Every key-less request shares that one bucket.
    assert!(!ask(&e, "GET", "/", "10.0.0.2", &[]).is_allowed());
    let mut reject = tb("need-key", json!(["header:x-api-key"]), 1.0, 1.0);
    reject["on_missing"] = json!("reject");
    let (e, _) = engine(json!({"rules": [reject]}));
    let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
    assert_eq!(d.outcome(), Outcome::Reject(Reason::MissingDescriptor));
    assert_eq!(d.status(), 401);
    assert!(ask(&e, "GET", "/", "10.0.0.1", &[("X-Api-Key", "k")]).is_allowed());
}

#[test]
fn kill_switch_wins_and_expires() {
    let (e, clock) = engine(json!({"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "tenant-42", "route": "/v1/inference",
                           "reason": "incident 123", "expires_at": "2027-01-15T08:00:10Z"}]}));
    // ManualClock wall origin 1_800_000_000 = 2027-01-15T08:00:00Z.
    let d = ask(
        &e,
        "POST",
        "/v1/inference/run",
        "10.0.0.1",
        &[("X-Tenant-Id", "tenant-42")],
    );
    assert_eq!(d.outcome(), Outcome::Reject(Reason::KillSwitch));
    assert_eq!(d.retry_after(), 10);
    assert!(ask(
        &e,
        "POST",
        "/v1/other",
        "10.0.0.1",
        &[("X-Tenant-Id", "tenant-42")]
    )
    .is_allowed());
    assert!(ask(
        &e,
        "POST",
        "/v1/inference",
        "10.0.0.1",
        &[("X-Tenant-Id", "tenant-7")]
    )
    .is_allowed());
    clock.set_secs(10.0);
    assert!(ask(
        &e,
        "POST",
        "/v1/inference",
        "10.0.0.1",
        &[("X-Tenant-Id", "tenant-42")]
    )
    .is_allowed());
}

pub(crate) fn budget(
    name: &str,
    budget: f64,
    period: &str,
    stages: serde_json::Value,
) -> serde_json::Value {
    json!({"name": name, "limit_keys": ["header:x-api-key"], "on_missing": "shared",
           "algorithm": "cost_based",
           "algorithm_config": {"budget": budget, "period": period, "cost_key": "header:x_cost",
                                "staged_actions": stages}})
}

pub(crate) fn ask_llm(e: &TestEngine, body: &str, headers: &[(&str, &str)]) -> Decision<'static> {
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let llm = crate::request::llm::LlmRequest::parse(body.as_bytes());
    let facts = RequestFacts::from_uri(
        "POST",
        "/v1/chat/completions",
        Some("api.example.com"),
        Some("10.0.0.1".parse().unwrap()),
        &headers,
    )
    .with_llm(Some(&llm));
    e.decide(&facts)
}

pub(crate) fn guarded(
    loop_detection: serde_json::Value,
    circuit_breaker: serde_json::Value,
    rules: serde_json::Value,
) -> serde_json::Value {
    json!({"bundle_version": 1, "policies": [{"id": "agents", "spec": {
        "rules": rules, "loop_detection": loop_detection, "circuit_breaker": circuit_breaker}}]})
}

pub(crate) fn reason_of(d: &Decision<'_>) -> Option<&'static str> {
    match d {
        Decision::Refuse(r) => Some(r.reason.as_str()),
        _ => None,
    }
}

#[test]
fn global_shadow_and_kill_switch_override_expire_by_themselves() {
    // Both end 10 s after the clock's wall origin (2027-01-15T08:00:00Z).
    let (e, clock) = engine(json!({"bundle_version": 1,
        "global_shadow": {"enabled": true, "reason": "incident 7", "expires_at": "2027-01-15T08:00:10Z"},
        "kill_switch_override": {"enabled": true, "reason": "incident 7", "expires_at": "2027-01-15T08:00:05Z"},
        "kill_switches": [{"scope_key": "ip:address", "scope_value": "10.0.0.9"}],
        "policies": [{"id": "p", "spec": {"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 1.0)]}}]}));
    assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
    let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
    assert!(d.is_allowed());
    assert_eq!(d.shadow_rejections().count(), 1);
    assert_eq!(bucket(&d, 0, "10.0.0.1", &[]), "shadow:tb:per-ip:10.0.0.1");
    assert!(ask(&e, "GET", "/", "10.0.0.9", &[]).is_allowed());
    clock.set_secs(5.0);
    assert_eq!(
        ask(&e, "GET", "/", "10.0.0.9", &[]).outcome(),
        Outcome::Reject(Reason::KillSwitch)
    );
    // At 10 s the policy enforces again, on its own (never spent) bucket.
    clock.set_secs(10.0);
    assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
    let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
    assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
}

#[test]
fn buckets_survive_reload_and_lowered_burst_caps() {
    let (e, _) = engine(json!({"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 10.0)]}));
    ask(&e, "GET", "/", "10.0.0.1", &[]);
    ask(&e, "GET", "/", "10.0.0.1", &[]);
    // Unchanged rule: state kept exactly.
    e.install(
        compile_bundle(
            &json!({"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 10.0)]}),
            "t",
        )
        .unwrap(),
    );
    assert_eq!(
        ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
        7 * MICRO
    );
    // Lowered burst: 7 tokens capped to 3, then one spent.
    e.install(
        compile_bundle(
            &json!({"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 3.0)]}),
            "t",
        )
        .unwrap(),
    );
    assert_eq!(
        ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
        2 * MICRO
    );
}

#[test]
fn boulder_overrides_apply_per_id() {
    let (e, _) = engine(
        json!({"rules": [{"name": "NewRegistrationsPerIPAddress", "limit_keys": ["ip:address"],
        "algorithm": "token_bucket", "algorithm_config": {"burst": 20, "count": 20, "period": "1s",
        "overrides": [{"ids": ["10.0.0.2", "10.0.0.5"], "burst": 20, "count": 40, "period": "1s"}]}}]}),
    );
    let d = ask(&e, "POST", "/new-reg", "10.0.0.5", &[]);
    assert_eq!(d.rules()[0].quota.refill(), 40 * MICRO);
    let d = ask(&e, "POST", "/new-reg", "10.0.0.9", &[]);
    assert_eq!(d.rules()[0].quota.refill(), 20 * MICRO);
}

/// Issue 13, attack 11: with two `X-Api-Key` lines tollgate limited the first while many
/// frameworks authenticate the last.
#[test]
fn repeated_limit_key_headers_are_refused() {
    let (e, _) = engine(json!({"rules": [
        tb("per-key", json!(["header:x-api-key"]), 1.0, 5.0),
        {"name": "weighted", "limit_keys": [], "algorithm": "token_bucket",
         "algorithm_config": {"rps": 1, "burst": 100, "cost_source": "header:x-weight"}}
    ]}));
    let d = ask(
        &e,
        "GET",
        "/",
        "10.0.0.1",
        &[("X-Api-Key", "a"), ("x-api-key", "b")],
    );
    assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
    assert_eq!(d.status(), 400);
    assert_eq!(d.rules().len(), 0, "nothing checked, nothing spent");
    let d = ask(
        &e,
        "GET",
        "/",
        "10.0.0.1",
        &[("X-Weight", "1"), ("X-Weight", "90")],
    );
    assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
    // Repeating a header no rule reads is fine.
    assert!(ask(
        &e,
        "GET",
        "/",
        "10.0.0.1",
        &[("Accept", "a"), ("Accept", "b")]
    )
    .is_allowed());

    // A kill switch on a header sees the same value the upstream does.
    let (e, _) = engine(json!({"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "t-1"}]}));
    let d = ask(
        &e,
        "GET",
        "/",
        "10.0.0.1",
        &[("X-Tenant-Id", "t-2"), ("X-Tenant-Id", "t-1")],
    );
    assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
    // Not on a switch's route, or past its expiry: repeats are the upstream's business.
    let (e, _) = engine(json!({"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "t-1", "route": "/llm"},
                          {"scope_key": "header:x-org", "scope_value": "o", "expires_at": "2020-01-01T00:00:00Z"}]}));
    let twice = [
        ("X-Tenant-Id", "a"),
        ("X-Tenant-Id", "b"),
        ("X-Org", "a"),
        ("X-Org", "b"),
    ];
    assert!(ask(&e, "GET", "/other", "10.0.0.1", &twice).is_allowed());
    let d = ask(&e, "GET", "/llm/x", "10.0.0.1", &twice);
    assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
}

/// Issue 13, attack 1: encoded slashes walked past kill switches (8 of 38 spellings).
#[test]
fn no_spelling_of_a_killed_route_gets_through() {
    let (e, _) = engine(json!({"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "method", "scope_value": "GET", "route": "/api/llm"}]}));
    let spellings = [
        "/api/llm",
        "/api/llm/",
        "/api/llm/x",
        "/api/llm?q=1",
        "//api/llm",
        "/api//llm",
        "/./api/llm",
        "/api/./llm",
        "/x/../api/llm",
        "/api/x/../llm",
        "/%61pi/llm",
        "/api/%6c%6c%6d",
        "/api/%2e/llm",
        "/api/x/%2e%2e/llm",
        "/api/x/%2E%2E/llm",
        "/api%2Fllm",
        "/api%2fllm",
        "/%2Fapi/llm",
        "/%2fapi%2fllm",
        "/api/llm%2F",
        "/api/llm%2Fx",
        "/api/x%2F..%2Fllm",
        "/api/x%2F%2E%2E%2Fllm",
        "/api%2F%2Fllm",
        "/api%5Cllm",
        "/api%5cllm",
        "/api\\llm",
        "/%5Capi%5Cllm",
        "/api/x%5C..%5Cllm",
        "/api/llm%5C",
        "/api\\x\\..\\llm",
        "/%2F%2Fapi/llm",
        "/api/llm/.",
        "/api/llm/x/..",
        "/api/llm#frag",
        "/api/./x/../llm",
        "/a/../api/llm",
        "/api%2F./llm",
    ];
    assert_eq!(spellings.len(), 38);
    for path in spellings {
        let d = ask(&e, "GET", path, "10.0.0.1", &[]);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::KillSwitch), "{path}");
    }
    for path in ["/api/llmx", "/api", "/api%252Fllm", "/apillm", "/api/ll"] {
        assert!(ask(&e, "GET", path, "10.0.0.1", &[]).is_allowed(), "{path}");
    }
}

/// Issue 13, attack 6: `Host: api.example.com:abc` skipped host selectors.
#[test]
fn a_host_with_a_bad_port_still_matches_its_selector() {
    let (e, _) = engine(
        json!({"bundle_version": 1, "policies": [{"id": "api", "spec": {
        "selector": {"hosts": ["api.example.com"]},
        "rules": [tb("per-ip", json!(["ip:address"]), 1.0, 1.0)]}}]}),
    );
    let headers: Vec<(String, String)> = Vec::new();
    for host in [
        "api.example.com:abc",
        "API.example.com:",
        "api.example.com:443",
        "api.example.com.:x",
    ] {
        let facts = RequestFacts::from_uri(
            "GET",
            "/",
            Some(host),
            Some("10.9.0.1".parse().unwrap()),
            &headers,
        );
        assert_eq!(e.decide(&facts).rules().len(), 1, "{host}");
    }
}

/// Issue 13, attack 12, end to end: the /48 override reaches a client of that network.
#[test]
fn ipv6_network_overrides_reach_their_clients() {
    let (e, _) = engine(
        json!({"rules": [{"name": "per-ip", "limit_keys": ["ip:address"],
        "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 2,
        "overrides": [{"ids": ["2001:db8:1::/48"], "burst": 40}]}}]}),
    );
    let d = ask(&e, "GET", "/", "2001:db8:1:7::99", &[]);
    assert_eq!(d.rules()[0].quota.burst(), 40 * MICRO);
    let d = ask(&e, "GET", "/", "2001:db8:2::1", &[]);
    assert_eq!(d.rules()[0].quota.burst(), 2 * MICRO);
}

/// A plan, written out in full (every op, lease, outcome and refusal, with the rules they
/// name), for comparing two ways of planning.
fn digest(plan: &Plan<'_>) -> String {
    match plan {
        Plan::Done(d) => format!("done {d:?}"),
        Plan::Store(p) => format!("store {:?} {:?} {:?}", p.ops, p.leases, p.checked),
    }
}

mod differential {
    use super::*;
    use proptest::prelude::*;

    const HOSTS: &[&str] = &["a.example", "B.example", "c.example:8443"];
    const PREFIXES: &[&str] = &["/", "/api", "/api/v1", "/x", "/api//v1"];
    const EXACT: &[&str] = &["/api", "/api/v1/x", "/"];
    const METHODS: &[&str] = &["GET", "post", "DELETE"];
    const TIERS: &[&str] = &["gold", "silver", "bronze"];
    const KEYS: &[&str] = &["k1", "k2", "k|3"];
    const NETS: &[&str] = &[
        "10.0.0.0/8",
        "10.1.2.3",
        "2001:db8::/32",
        "192.0.2.0/24",
        "::ffff:10.0.0.1",
    ];

    fn selector() -> impl Strategy<Value = serde_json::Value> {
        (
            proptest::option::of(proptest::sample::subsequence(HOSTS, 1..3)),
            proptest::option::of(proptest::sample::select(PREFIXES)),
            proptest::option::of(proptest::sample::select(EXACT)),
            proptest::option::of(proptest::sample::subsequence(METHODS, 1..3)),
        )
            .prop_map(|(hosts, prefix, exact, methods)| {
                let mut s = serde_json::Map::new();
                if let Some(h) = hosts {
                    s.insert("hosts".into(), json!(h));
                }
                if let Some(p) = prefix {
                    s.insert("pathPrefix".into(), json!(p));
                }
                if let Some(e) = exact {
                    s.insert("pathExact".into(), json!(e));
                }
                if let Some(m) = methods {
                    s.insert("methods".into(), json!(m));
                }
                serde_json::Value::Object(s)
            })
    }

    fn condition() -> impl Strategy<Value = Option<serde_json::Value>> {
        prop_oneof![
            Just(None),
            proptest::sample::select(TIERS).prop_map(|t| Some(json!({"header:x-tier": t}))),
            proptest::sample::select(TIERS)
                .prop_map(|t| Some(json!({"header:x-tier": t, "method": "GET"}))),
            proptest::sample::select(NETS).prop_map(|n| Some(json!({"ip:address": n}))),
            proptest::sample::select(HOSTS).prop_map(|h| Some(json!({"host": h}))),
            proptest::sample::select(KEYS).prop_map(|k| Some(json!({"query:k": k}))),
        ]
    }

    fn rule(name: String) -> impl Strategy<Value = serde_json::Value> {
        (
            condition(),
            proptest::sample::select(&["ip:address", "header:x-api-key", "header:x-tier"][..]),
            1u32..4,
        )
            .prop_map(move |(cond, key, burst)| {
                let mut r = json!({"name": name, "limit_keys": [key], "algorithm": "token_bucket",
                    "algorithm_config": {"rps": 1, "burst": burst}});
                if let Some(c) = cond {
                    r["match"] = c;
                }
                r
            })
    }

    fn policy(p: usize) -> impl Strategy<Value = serde_json::Value> {
        (
            selector(),
            proptest::collection::vec(0u8..1, 0..5),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_flat_map(move |(selector, rules, fallback, shadow)| {
                let rules: Vec<_> = (0..rules.len())
                    .map(|r| rule(format!("p{p}r{r}")))
                    .collect();
                (
                    Just(selector),
                    rules,
                    Just(fallback),
                    Just(shadow),
                    rule(format!("p{p}fb")),
                )
            })
            .prop_map(move |(selector, rules, fallback, shadow, fb)| {
                let mut spec = json!({"selector": selector, "rules": rules});
                if fallback {
                    spec["fallback_limit"] = fb;
                }
                if shadow {
                    spec["mode"] = json!("shadow");
                }
                json!({"id": format!("p{p}"), "spec": spec})
            })
    }

    fn kill_switch() -> impl Strategy<Value = serde_json::Value> {
        (
            prop_oneof![
                proptest::sample::select(KEYS).prop_map(|k| ("header:x-api-key", k)),
                proptest::sample::select(NETS).prop_map(|n| ("ip:address", n)),
                proptest::sample::select(&["not-an-address", "10.0.0.0/99"][..])
                    .prop_map(|v| ("ip:address", v)),
                proptest::sample::select(EXACT).prop_map(|p| ("path", p)),
                proptest::sample::select(TIERS).prop_map(|t| ("header:x-tier", t)),
            ],
            proptest::option::of(proptest::sample::select(PREFIXES)),
            any::<bool>(),
        )
            .prop_map(|((scope, value), route, expired)| {
                let mut ks = json!({"scope_key": scope, "scope_value": value, "reason": "r"});
                if let Some(r) = route {
                    ks["route"] = json!(r);
                }
                // The clock's wall origin is 2027-01-15T08:00:00Z.
                ks["expires_at"] = json!(if expired {
                    "2027-01-15T07:00:00Z"
                } else {
                    "2027-02-01T00:00:00Z"
                });
                ks
            })
    }

    fn bundle() -> impl Strategy<Value = serde_json::Value> {
        (1usize..7, proptest::collection::vec(kill_switch(), 0..5)).prop_flat_map(
            |(n, switches)| {
                let policies: Vec<_> = (0..n).map(policy).collect();
                (policies, Just(switches)).prop_map(|(policies, switches)| {
                json!({"bundle_version": 1, "policies": policies, "kill_switches": switches})
            })
            },
        )
    }

    #[derive(Debug, Clone)]
    struct Request {
        method: &'static str,
        uri: String,
        host: Option<&'static str>,
        ip: Option<&'static str>,
        headers: Vec<(String, String)>,
    }

    fn request() -> impl Strategy<Value = Request> {
        (
            proptest::sample::select(&["GET", "POST", "get", "DELETE", "PUT"][..]),
            proptest::sample::select(
                &[
                    "/",
                    "/api",
                    "/api/v1",
                    "/api/v1/x",
                    "/apix",
                    "/x/y",
                    "/api//v1/z",
                    "api",
                    "/API",
                ][..],
            ),
            proptest::option::of(proptest::sample::select(KEYS)),
            proptest::option::of(proptest::sample::select(
                &[
                    "a.example",
                    "A.EXAMPLE",
                    "b.example:443",
                    "c.example",
                    "c.example.",
                    "z.example",
                ][..],
            )),
            proptest::option::of(proptest::sample::select(
                &[
                    "10.1.2.3",
                    "10.0.0.1",
                    "192.0.2.77",
                    "2001:db8::1",
                    "::ffff:10.0.0.1",
                    "203.0.113.9",
                ][..],
            )),
            proptest::collection::vec(
                (
                    proptest::sample::select(&["x-tier", "x-api-key", "X-Tier"][..]),
                    proptest::sample::select(&["gold", "silver", "k1", "k2", "k|3"][..]),
                ),
                0..4,
            ),
        )
            .prop_map(|(method, path, k, host, ip, headers)| Request {
                method,
                uri: match k {
                    Some(k) => format!("{path}?k={k}"),
                    None => path.to_string(),
                },
                host,
                ip,
                headers: headers
                    .into_iter()
                    .map(|(n, v)| (n.to_ascii_lowercase(), v.to_string()))
                    .collect(),
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Issue 28: the indexed selection plans exactly what trying every policy, rule and
        /// kill switch in turn plans, on random bundles and requests.
        #[test]
        fn indexed_selection_plans_what_a_scan_plans(
            bundle in bundle(),
            requests in proptest::collection::vec(request(), 1..12),
        ) {
            let compiled = compile_bundle(&bundle, "test").unwrap();
            let clock = ManualClock::new(1_800_000_000);
            for r in &requests {
                let facts = RequestFacts::from_uri(
                    r.method,
                    &r.uri,
                    r.host,
                    r.ip.map(|ip| ip.parse().unwrap()),
                    &r.headers,
                );
                let config = EngineConfig::default();
                let indexed = plan_with(&compiled, &facts, clock.unix_us(), config, Selection::IndexedAlways);
                let scanned = plan_with(&compiled, &facts, clock.unix_us(), config, Selection::Scan);
                prop_assert_eq!(digest(&indexed), digest(&scanned), "request {:?}", r);
            }
        }
    }
}

/// A store that does not answer, decided by each rule's `on_store_error`: a `closed` rule
/// refuses with 503 `store_unavailable` (nothing spent on the others), an `open` one admits
/// uncounted, a `local` one spends this gateway's share.
#[test]
fn on_store_error_decides_while_the_store_is_away() {
    use crate::store::local::{LocalConfig, LocalMode};
    let rule = |name: &str, header: &str, mode: &str| {
        json!({"name": name, "limit_keys": [format!("header:{header}")], "on_store_error": mode,
               "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 4}})
    };
    let (e, clock) = engine(json!({"rules": [
        rule("strict", "x-strict", "closed"),
        rule("loose", "x-loose", "open"),
        rule("shared", "x-key", "local"),
    ]}));
    let local = LocalMode::new(LocalConfig {
        default_mode: crate::policy::OnStoreError::Local,
        max_buckets: std::num::NonZeroUsize::new(100).unwrap(),
        gateway_id: "gw".into(),
        journal: None,
    });
    local.set_gateways(2);
    let bundle = e.bundle.get().unwrap();
    let decide = |headers: &[(&str, &str)]| {
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let facts = RequestFacts::from_uri(
            "GET",
            "/",
            Some("h"),
            Some("10.0.0.1".parse().unwrap()),
            &headers,
        );
        let Plan::Store(pending) = plan(bundle, &facts, clock.unix_us(), EngineConfig::default())
        else {
            panic!("the rules need the store");
        };
        let mut results = OpResults::new();
        local.decide(clock.unix_us(), &pending.ops, &mut results);
        finish(pending, Ok(&results))
    };
    let refused = decide(&[("x-strict", "a"), ("x-key", "k")]);
    assert_eq!(refused.outcome(), Outcome::Reject(Reason::StoreUnavailable));
    assert_eq!(Reason::StoreUnavailable.status(), 503);
    assert_eq!(refused.retry_after(), 1);
    assert!(refused.store_error());
    // The local rule was not spent by the refused request: its share (2 of 4) is whole.
    let shares: Vec<bool> = (0..3)
        .map(|_| decide(&[("x-key", "k")]).is_allowed())
        .collect();
    assert_eq!(shares, [true, true, false]);
    let open = decide(&[("x-loose", "b")]);
    assert!(open.is_allowed());
    assert!(open.rules()[0].fail_open);
    assert_eq!(
        open.rules()[0].away,
        Some(crate::policy::OnStoreError::Open)
    );
}
