//! The compiler's tests: every error with its path, the shipped and Fairvisor bundles, and
//! property tests that no input panics (the per-kind fields are tested in [`crate::limits`]).

use super::*;
use crate::limits::limiter::{Quota, MICRO, US_PER_SEC};
use crate::policy::{parse_bundle, PolicyError};
use crate::policy::{CostLimits, CostSource};
use serde_json::json;

pub(crate) fn errors_of(v: Value) -> Vec<String> {
    match compile_bundle(&v, "test") {
        Ok(_) => Vec::new(),
        Err(errors) => errors.into_iter().map(|e| e.to_string()).collect(),
    }
}

pub(crate) fn rule(config: Value) -> Value {
    json!({"rules": [{"name": "r", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": config}]})
}

pub(crate) fn llm_rule(config: Value) -> Value {
    json!({"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket_llm", "algorithm_config": config}]})
}

#[test]
fn full_bundle_compiles() {
    let v = json!({
        "bundle_version": 3,
        "policies": [{
            "id": "public-api",
            "spec": {
                "selector": {"pathPrefix": "/api/", "methods": ["get", "POST"], "hosts": ["API.example.com:443"]},
                "mode": "shadow",
                "rules": [
                    {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                     "algorithm_config": {"tokens_per_second": 10, "burst": 15}},
                    {"name": "enterprise", "limit_keys": ["header:x-api-key"], "match": {"jwt:plan": "enterprise", "jwt:tier": 3},
                     "algorithm": "token_bucket", "algorithm_config": {"rps": 1000, "burst": 2000, "cost_source": "header:X-Weight", "default_cost": 2}}
                ],
                "fallback_limit": {"name": "no-matching-tier", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                                   "algorithm_config": {"rps": 1, "burst": 5}}
            }
        }],
        "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "tenant-42", "route": "/v1/inference/",
                           "reason": "incident 123", "expires_at": "2030-01-01T00:00:00Z"}]
    });
    let b = compile_bundle(&v, "x").unwrap();
    assert_eq!(b.version, "3");
    assert_eq!(b.policies.len(), 1);
    let p = &b.policies[0];
    assert_eq!(p.mode, Mode::Shadow);
    assert_eq!(p.rules, 0..2);
    assert_eq!(p.fallback, Some(2));
    assert_eq!(p.selector.path_prefix.as_deref(), Some("/api"));
    assert_eq!(
        p.selector.methods.as_deref(),
        Some(&["GET".to_string(), "POST".to_string()][..])
    );
    assert_eq!(
        p.selector.hosts.as_deref(),
        Some(&["api.example.com".to_string()][..])
    );
    assert_eq!(b.rules[0].key_prefix, "shadow:tb:per-ip:");
    assert_eq!(
        b.rules[0].quota,
        Quota::new(15 * MICRO, 10 * MICRO, US_PER_SEC).unwrap()
    );
    assert_eq!(
        b.rules[1].cost,
        CostSource::Header {
            name: "x-weight".into(),
            limits: CostLimits {
                default: 2 * MICRO,
                min: 2 * MICRO,
                max: None
            }
        }
    );
    assert_eq!(
        b.rules[1].conditions[1].expected,
        MatchValue::Text("3".into())
    );
    let ks = &b.kill_switches[0];
    assert_eq!(ks.route.as_deref(), Some("/v1/inference"));
    assert_eq!(ks.expires_at, Some(1_893_456_000));
}

#[test]
fn fairvisor_bundles_load_as_written() {
    let b = compile_bundle(
        &json!({
        "bundle_version": 1.5, "issued_at": "2026-11-01T00:00:00Z",
        "defaults": {"default_cost": 1},
        "policies": [
            {"id": "empty", "spec": {"selector": {"pathPrefix": "/"}, "rules": []}},
            {"id": "a", "spec": {"selector": {"pathPrefix": "/a/", "methods": []}, "rules": [],
             "fallback_limit": {"limit_keys": ["header:x_api_key"], "algorithm": "token_bucket",
                                "algorithm_config": {"tokens_per_second": 1, "burst": 2}}}},
            {"id": "b", "spec": {"selector": {"pathPrefix": "/b/"}, "rules": [],
             "fallback_limit": {"limit_keys": [], "algorithm": "token_bucket",
                                "algorithm_config": {"tokens_per_second": 1, "burst": 2}}}}
        ]}),
        "x",
    )
    .unwrap();
    assert_eq!(b.version, "1.5");
    assert_eq!(b.policies.len(), 3);
    let names: Vec<&str> = b.rules.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["fallback_limit", "fallback_limit@b"]);
    assert_eq!(
        b.rules[0].limit_keys,
        [Descriptor::Header("x-api-key".into())]
    );
    assert_eq!(b.policies[1].selector.methods, Some(Vec::new()));
    let warned: Vec<&str> = b.warnings.iter().map(|w| w.path.as_str()).collect();
    assert!(warned.contains(&"defaults"), "{warned:?}");
    assert!(
        warned.contains(&"policies[1].spec.selector.methods"),
        "{warned:?}"
    );
    // A string version is kept as written.
    let b = compile_bundle(
        &json!({"bundle_version": "2026-11-22.1", "policies": []}),
        "x",
    )
    .unwrap();
    assert_eq!(b.version, "2026-11-22.1");
    assert!(!errors_of(json!({"bundle_version": -1, "policies": []})).is_empty());
}

#[test]
fn expired_bundles_and_overrides_are_refused_at_load() {
    let b = compile_bundle(
        &json!({"bundle_version": 1, "expires_at": "2027-01-15T08:00:00Z", "policies": [],
                "global_shadow": {"enabled": true, "reason": "r", "expires_at": "2027-01-15T09:00:00Z"}}),
        "x",
    )
    .unwrap();
    assert!(b.check_current(1_799_999_999).is_ok());
    let errors = b.check_current(1_800_000_000).unwrap_err();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].path, "expires_at");
    assert!(
        errors[0]
            .message
            .starts_with("2027-01-15T08:00:00Z has passed"),
        "{}",
        errors[0]
    );
    assert_eq!(b.check_current(1_800_003_600).unwrap_err().len(), 2);
}

#[test]
fn runtime_overrides_follow_fairvisor_rules() {
    let errors = errors_of(json!({"bundle_version": 1, "policies": [],
        "global_shadow": {"enabled": true, "reason": ""},
        "kill_switch_override": {"enabled": "yes"}}));
    assert_eq!(
        errors,
        [
            "global_shadow.reason: must not be empty",
            "global_shadow.expires_at: is required when enabled (an override always ends)",
            "kill_switch_override.enabled: must be true or false",
        ]
    );
    // Disabled: nothing else is read, nothing is built.
    let b = compile_bundle(
        &json!({"bundle_version": 1, "policies": [],
        "global_shadow": {"enabled": false, "reason": 7}}),
        "x",
    )
    .unwrap();
    assert!(b.global_shadow.is_none() && b.shadow_twin.is_none());
    let b = compile_bundle(&json!({"bundle_version": 1,
        "global_shadow": {"enabled": true, "reason": "r", "expires_at": "2030-01-01T00:00:00Z"},
        "policies": [{"id": "p", "spec": {"rules": [{"name": "r", "limit_keys": [], "algorithm": "token_bucket",
                                               "algorithm_config": {"rps": 1, "burst": 1}}]}}]}), "x").unwrap();
    let twin = b.shadow_twin.as_ref().unwrap();
    assert_eq!(
        (b.rules[0].mode, twin.rules[0].mode),
        (Mode::Enforce, Mode::Shadow)
    );
    assert_eq!(twin.rules[0].key_prefix, "shadow:tb:r:");
    assert_eq!(b.in_force(1_893_455_999).rules[0].mode, Mode::Shadow);
    assert_eq!(b.in_force(1_893_456_000).rules[0].mode, Mode::Enforce);
}

#[test]
fn invalid_policies_can_be_skipped() {
    let bundle = json!({"bundle_version": 1, "policies": [
        {"id": "bad", "spec": {"rules": [{"name": "shared-name", "limit_keys": [], "algorithm": "leaky_bucket",
                                          "algorithm_config": {"rps": 1, "burst": 1}}]}},
        {"id": "good", "spec": {"rules": [{"name": "shared-name", "limit_keys": [], "algorithm": "token_bucket",
                                           "algorithm_config": {"rps": 1, "burst": 1}}]}}]});
    let errors = errors_of(bundle.clone());
    assert_eq!(
        errors,
        [
            "policies[0].spec.rules[0].algorithm: unknown algorithm 'leaky_bucket' (supported: token_bucket, cost_based, concurrency, token_bucket_llm, llm_spend)",
            "policies[1].spec.rules[0].name: duplicate rule name 'shared-name' (first defined at policies[0].spec.rules[0].name); rule names are bucket namespaces and must be unique across the bundle",
        ]
    );
    let options = CompileOptions {
        skip_invalid_policies: true,
        ..CompileOptions::default()
    };
    let b = compile_bundle_with(&bundle, "x", options).unwrap();
    assert_eq!(b.policies.len(), 1);
    assert_eq!(b.policies[0].id, "good");
    assert_eq!(
        (b.rules.len(), b.rules[0].policy, b.rules[0].index),
        (1, 0, 0)
    );
    assert_eq!(b.skipped.len(), 1);
    assert_eq!(
        (b.skipped[0].path.as_str(), b.skipped[0].id.as_str()),
        ("policies[0]", "bad")
    );
    // Errors outside policies still refuse the bundle.
    let broken = json!({"bundle_version": "", "policies": []});
    assert!(compile_bundle_with(&broken, "x", options).is_err());
}

#[test]
fn bare_rules_form_uses_the_file_name() {
    let b = compile_bundle(&rule(json!({"rps": 5, "burst": 10})), "global").unwrap();
    assert_eq!(b.policies[0].id, "global");
    assert_eq!(b.policies[0].mode, Mode::Enforce);
    assert_eq!(b.rules[0].key_prefix, "tb:r:");
}

#[test]
fn boulder_form_and_overrides() {
    let b = compile_bundle(
        &rule(json!({"burst": 20, "count": 20, "period": "1s",
                     "overrides": [{"ids": ["10.0.0.2", "10.0.0.5"], "burst": 20, "count": 40, "period": "1s"},
                                   {"ids": ["2001:0db8:0000::/48"], "count": 10, "period": "1m"}]})),
        "x",
    )
    .unwrap();
    let r = &b.rules[0];
    assert_eq!(
        r.quota,
        Quota::new(20 * MICRO, 20 * MICRO, US_PER_SEC).unwrap()
    );
    assert_eq!(
        *r.quota_for("10.0.0.5"),
        Quota::new(20 * MICRO, 40 * MICRO, US_PER_SEC).unwrap()
    );
    assert_eq!(*r.quota_for("10.0.0.9"), r.quota);
    // Burst inherited from the rule; the ID canonicalised.
    assert_eq!(
        *r.quota_for("2001:db8::/48"),
        Quota::new(20 * MICRO, 10 * MICRO, 60 * US_PER_SEC).unwrap()
    );
    let slow = compile_bundle(
        &rule(json!({"burst": 300, "count": 300, "period": "180m"})),
        "x",
    )
    .unwrap();
    assert_eq!(slow.rules[0].quota.period_us(), 10_800 * US_PER_SEC);
}

#[test]
fn every_error_is_collected_with_its_path() {
    let v = json!({
        "bundle_version": 1,
        "policies": [{
            "id": "p",
            "spec": {
                "mode": "loud",
                "selector": {"pathPrefix": "api"},
                "rules": [
                    {"name": "a", "limit_keys": ["ip:adress"], "algorithm": "token_bucket",
                     "algorithm_config": {"tokens_per_second": 0, "burst": -1}},
                    {"name": "a", "limit_keys": [], "algorithm": "leaky", "colour": "red",
                     "algorithm_config": {"rps": "fast", "burst": 1e300, "cost_source": "cookie:x"}}
                ]
            }
        }]
    });
    let errors = errors_of(v);
    let expect = [
        "policies[0].spec.selector.pathPrefix: must start with '/'",
        "policies[0].spec.mode: must be \"enforce\" or \"shadow\"",
        "policies[0].spec.rules[0].limit_keys[0]: unknown descriptor 'ip:adress'",
        "policies[0].spec.rules[0].algorithm_config.burst: must be > 0",
        "policies[0].spec.rules[0].algorithm_config.tokens_per_second: must be > 0",
        "policies[0].spec.rules[1].colour: unknown field",
        "policies[0].spec.rules[1].name: duplicate rule name 'a'",
        "policies[0].spec.rules[1].algorithm: unknown algorithm 'leaky'",
        "policies[0].spec.rules[1].algorithm_config.burst: must be at most 1000000000",
        "policies[0].spec.rules[1].algorithm_config.rps: must be a number, found a string",
        "policies[0].spec.rules[1].algorithm_config.cost_source: 'cookie:x' is not",
    ];
    for e in expect {
        assert!(
            errors.iter().any(|got| got.starts_with(e)),
            "missing {e:?} in {errors:#?}"
        );
    }
    assert_eq!(errors.len(), expect.len(), "{errors:#?}");
}

#[test]
fn hostile_inputs_never_panic() {
    for text in [
        "[]", "null", "42", "\"rules\"", "{}", "{\"rules\": 5}", "{\"rules\": [null, 1, []]}",
        "{\"policies\": {}}", "{\"bundle_version\": -1, \"policies\": []}",
        "{\"rules\": [{\"name\": \"x\", \"limit_keys\": [\"ip:address\"], \"algorithm\": \"token_bucket\", \"algorithm_config\": {\"rps\": 1e-9, \"burst\": 1e999}}]}",
        "{\"rules\": [{\"name\": \"x\", \"limit_keys\": [\"ip:address\"], \"algorithm\": \"token_bucket\", \"algorithm_config\": {\"rps\": \"NaN\", \"burst\": \"Infinity\"}}]}",
    ] {
        let _ = parse_bundle(text.as_bytes(), "x");
    }
    let deep = "[".repeat(100_000) + &"]".repeat(100_000);
    assert!(matches!(
        parse_bundle(deep.as_bytes(), "x"),
        Err(PolicyError::Json { .. })
    ));
    let not_object = errors_of(json!([1, 2]));
    assert_eq!(
        not_object,
        vec!["(root): a bundle must be a JSON object, found an array"]
    );
    let huge = errors_of(rule(json!({"rps": 1e-9, "burst": 5})));
    assert_eq!(
        huge,
        vec!["rules[0].algorithm_config.rps: must be at least 0.000001"]
    );
}

#[test]
fn rule_names_cannot_make_buckets_collide() {
    let b = compile_bundle(
        &json!({"rules": [
            {"name": "a", "limit_keys": ["header:x"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}},
            {"name": "a:b", "limit_keys": ["header:x"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}
        ]}),
        "x",
    )
    .unwrap();
    assert_eq!(b.rules[0].key_prefix, "tb:a:");
    assert_eq!(b.rules[1].key_prefix, "tb:a\\:b:");
    assert_ne!(
        format!("{}b:c", b.rules[0].key_prefix),
        format!("{}c", b.rules[1].key_prefix)
    );
}

/// Issue 13, attack 12: an IPv6 `/48` override on a per-address rule (IPv6 keys are
/// `/64` networks) used to be stored as a text ID that no key could equal.
#[test]
fn address_overrides_apply_to_every_client_inside_them() {
    let b = compile_bundle(
        &rule(json!({"rps": 1, "burst": 1, "overrides": [
            {"ids": ["2001:db8:1::/48"], "burst": 48},
            {"ids": ["2001:db8:1:5::/64"], "burst": 64},
            {"ids": ["2001:db8:9::7"], "burst": 7},
            {"ids": ["10.0.0.0/24"], "burst": 24},
            {"ids": ["10.0.0.9"], "burst": 9},
            {"ids": ["acct-1"], "burst": 2}]})),
        "x",
    )
    .unwrap();
    let r = &b.rules[0];
    let burst = |key: &str| r.quota_for(key).burst() / MICRO;
    // Keys as the engine writes them: IPv4 bare, IPv6 as the client's /64 network.
    assert_eq!(burst("2001:db8:1:2::/64"), 48);
    assert_eq!(burst("2001:db8:1:5::/64"), 64, "most specific first");
    assert_eq!(burst("2001:db8:2::/64"), 1);
    // A single IPv6 address applies to the /64 bucket that holds it (and with
    // --ipv6-prefix 48 to the /48), so clients sharing a bucket share its quota.
    assert_eq!(burst("2001:db8:9::/64"), 7);
    assert_eq!(burst("2001:db8:9::/48"), 7);
    assert_eq!(burst("10.0.0.77"), 24);
    assert_eq!(burst("10.0.0.9"), 9);
    assert_eq!(burst("10.0.1.1"), 1);
    let warned: Vec<&str> = b.warnings.iter().map(|w| w.message.as_str()).collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].starts_with("ID 'acct-1' can never equal"));
}

#[test]
fn overrides_narrower_than_an_explicit_ipv6_key_are_rejected() {
    let v = json!({"rules": [{"name": "r", "limit_keys": ["ip:address/48"], "algorithm": "token_bucket",
        "algorithm_config": {"rps": 1, "burst": 1, "overrides": [{"ids": ["2001:db8:1:2::/64"], "burst": 5}]}}]});
    assert_eq!(
        errors_of(v),
        ["rules[0].algorithm_config.overrides[0].ids: ID '2001:db8:1:2::/64' is narrower than this rule's /48 IPv6 keys: it would apply to the whole /48 network; list that network instead"]
    );
}

#[test]
fn client_header_keys_with_skip_warn() {
    let v = json!({"rules": [
        {"name": "k", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}},
        {"name": "s", "limit_keys": ["header:x-api-key"], "on_missing": "shared", "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}]});
    let b = compile_bundle(&v, "x").unwrap();
    assert_eq!(b.warnings.len(), 1);
    assert_eq!(b.warnings[0].path, "rules[0].on_missing");
    assert!(b.warnings[0].message.starts_with(
        "rule 'k' is keyed on the client-supplied header 'x-api-key' with on_missing \"skip\""
    ));
    assert_eq!(b.rules[0].header_names, ["x-api-key"]);
}

#[test]
fn host_kill_switches_ignore_case() {
    let b = compile_bundle(
        &json!({"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "host", "scope_value": "API.Example.com"}]}),
        "x",
    )
    .unwrap();
    assert_eq!(&*b.kill_switches[0].value, "api.example.com");
}

#[test]
fn burst_below_rate_is_a_warning_not_an_error() {
    let b = compile_bundle(&rule(json!({"rps": 10, "burst": 5})), "x").unwrap();
    assert_eq!(b.warnings.len(), 1);
    assert_eq!(b.warnings[0].path, "rules[0].algorithm_config.burst");
}

#[test]
fn match_on_ip_takes_networks() {
    let v = json!({"rules": [{"name": "r", "limit_keys": [], "match": {"ip:address": "10.0.0.0/8"},
                    "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}]});
    let b = compile_bundle(&v, "x").unwrap();
    assert!(matches!(
        b.rules[0].conditions[0].expected,
        MatchValue::Network(_)
    ));
    let bad = json!({"rules": [{"name": "r", "limit_keys": [], "match": {"ip:address": "ten"},
                    "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}]});
    assert_eq!(
        errors_of(bad),
        vec!["rules[0].match.ip:address: must be an IP address or CIDR network"]
    );
}

/// No JSON value or byte string makes the compiler panic.
mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// Arbitrary JSON, biased towards the shapes a bundle has, so the walker goes deep.
    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            any::<i64>().prop_map(|i| Value::Number(i.into())),
            prop_oneof![
                Just("token_bucket".to_string()),
                Just("ip:address".to_string()),
                Just("header:x".to_string()),
                Just("1s".to_string()),
                Just("shadow".to_string()),
                ".{0,12}",
            ]
            .prop_map(Value::String),
        ];
        let keys = prop_oneof![
            Just("rules".to_string()),
            Just("policies".to_string()),
            Just("bundle_version".to_string()),
            Just("spec".to_string()),
            Just("id".to_string()),
            Just("name".to_string()),
            Just("limit_keys".to_string()),
            Just("algorithm".to_string()),
            Just("algorithm_config".to_string()),
            Just("burst".to_string()),
            Just("rps".to_string()),
            Just("count".to_string()),
            Just("period".to_string()),
            Just("overrides".to_string()),
            Just("ids".to_string()),
            Just("match".to_string()),
            Just("kill_switches".to_string()),
            Just("selector".to_string()),
            Just("fallback_limit".to_string()),
            "[a-z_]{1,8}",
        ];
        leaf.prop_recursive(5, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((keys.clone(), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever the JSON, compiling returns a bundle or a list of errors; it never panics,
        /// and every error names a path.
        #[test]
        fn compile_never_panics(value in arb_json()) {
            if let Err(errors) = compile_bundle(&value, "prop") {
                prop_assert!(!errors.is_empty());
                prop_assert!(errors.iter().all(|e| !e.path.is_empty()));
            }
        }

        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_bundle(&bytes, "prop");
        }
    }
}
