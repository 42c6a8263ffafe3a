//! A runtime override (`PUT /v1/overrides`) read from its JSON body and checked against a
//! bundle: the rule it names must exist, be of a kind whose quota an override sets
//! (`token_bucket`, `cost_based`), and its quota fields are compiled by that kind's own
//! compile half (so an error reads as the bundle's would, at the field's path). Also the table
//! a bundle's decisions read ([`key_quota_table`]), and which overrides it leaves out
//! (orphaned: their rule or policy is gone, or no longer takes them).

use super::compiler::Compiler;
use crate::limits::limiter::Quota;
use crate::policy::bundle::Bundle;
use crate::policy::error::FieldError;
use crate::policy::json;
use crate::policy::key_overrides::{KeyOverride, KeyQuota, KeyQuotaTable, META_FIELDS};
use crate::policy::rule::{Rule, RuleKind};
use serde_json::{Map, Value};

/// The longest key an override may name (a bucket name's limit).
pub const MAX_KEY_BYTES: usize = 1024;

/// Why an override was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverrideRefused {
    /// Its body or quota fields are invalid: every error, each at its field's path.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
    #[error("no policy \"{0}\" in the bundle in force")]
    NoPolicy(String),
    #[error("no rule \"{rule}\" in policy \"{policy}\" of the bundle in force")]
    NoRule { policy: String, rule: String },
    #[error("rule \"{rule}\" is a {kind} rule: an override sets the quota of a token_bucket or cost_based rule")]
    Unsupported { rule: String, kind: &'static str },
}

/// Reads an override's body: `policy`, `rule` and `key` (non-empty strings), an optional
/// `expires_at` (RFC 3339), and its quota fields (everything else, checked against the rule
/// by [`compile_key_override`]).
///
/// # Errors
/// Every problem, each at its field's path.
pub fn read_key_override(body: &Value) -> Result<KeyOverride, Vec<FieldError>> {
    let mut c = Compiler::default();
    let Some(map) = body.as_object() else {
        c.error(
            "",
            format!("must be an object, found {}", json::type_name(body)),
        );
        return Err(c.errors);
    };
    let text = |c: &mut Compiler, field: &str| match map.get(field) {
        Some(v) => c.non_empty_string(v, field).map(str::to_string),
        None => {
            c.error(field, "is required");
            None
        }
    };
    let policy = text(&mut c, "policy");
    let rule = text(&mut c, "rule");
    let key = text(&mut c, "key");
    if key.as_ref().is_some_and(|k| k.len() > MAX_KEY_BYTES) {
        c.error("key", format!("is longer than {MAX_KEY_BYTES} bytes"));
    }
    let expires_at = match map.get("expires_at") {
        Some(v) => c.time(v, "expires_at").map(Some),
        None => Some(None),
    };
    let fields: Map<String, Value> = map
        .iter()
        .filter(|(name, _)| !META_FIELDS.contains(&name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    match (policy, rule, key, expires_at) {
        (Some(policy), Some(rule), Some(key), Some(expires_at)) if c.errors.is_empty() => {
            Ok(KeyOverride {
                policy,
                rule,
                key,
                fields,
                expires_at,
            })
        }
        _ => Err(c.errors),
    }
}

/// The rule `policy`/`rule` names in `bundle`.
///
/// # Errors
/// No such policy, or no such rule in it.
pub fn rule_of<'b>(
    bundle: &'b Bundle,
    policy: &str,
    rule: &str,
) -> Result<&'b Rule, OverrideRefused> {
    if !bundle.policies.iter().any(|p| p.id == policy) {
        return Err(OverrideRefused::NoPolicy(policy.to_string()));
    }
    bundle
        .rules
        .iter()
        .find(|r| r.name == rule && r.policy_id == policy)
        .ok_or_else(|| OverrideRefused::NoRule {
            policy: policy.to_string(),
            rule: rule.to_string(),
        })
}

/// The quota `o` gives its key under its rule in `bundle`.
///
/// # Errors
/// The rule is missing or of another kind, or a quota field is invalid.
pub fn compile_key_override(
    bundle: &Bundle,
    o: &KeyOverride,
) -> Result<(usize, Quota), OverrideRefused> {
    let rule = rule_of(bundle, &o.policy, &o.rule)?;
    let Some(kind_fields) = super::key_override_fields(rule) else {
        return Err(OverrideRefused::Unsupported {
            rule: rule.name.clone(),
            kind: kind_name(&rule.kind),
        });
    };
    let mut c = Compiler::default();
    let allowed: Vec<&str> = META_FIELDS.iter().chain(kind_fields).copied().collect();
    for name in o.fields.keys() {
        if !kind_fields.contains(&name.as_str()) {
            c.error(
                name,
                format!("unknown field (expected one of: {})", allowed.join(", ")),
            );
        }
    }
    if o.fields.is_empty() {
        c.error(
            "",
            format!(
                "sets no quota field: name at least one of {}",
                kind_fields.join(", ")
            ),
        );
    }
    if !c.errors.is_empty() {
        return Err(OverrideRefused::Invalid(c.errors));
    }
    let quota = c.key_override_quota(&o.fields, rule);
    match quota {
        Some(quota) if c.errors.is_empty() => Ok((rule.index, quota)),
        _ => Err(OverrideRefused::Invalid(c.errors)),
    }
}

fn kind_name(kind: &RuleKind) -> &'static str {
    match kind {
        RuleKind::TokenBucket => "token_bucket",
        RuleKind::Budget(_) => "cost_based",
        RuleKind::Concurrency(_) => "concurrency",
        RuleKind::Llm(_) => "token_bucket_llm",
        RuleKind::Guard(_) => "loop_detection or circuit_breaker",
        RuleKind::Spend(_) => "llm_spend",
    }
}

/// The quotas `overrides` give under `bundle`, and the positions (in `overrides`) of those it
/// leaves out: orphaned, their rule or policy gone (or no longer one they fit).
pub fn key_quota_table<'o>(
    bundle: &Bundle,
    overrides: impl IntoIterator<Item = &'o KeyOverride>,
) -> (KeyQuotaTable, Vec<usize>) {
    let mut table = KeyQuotaTable::default();
    let mut orphaned = Vec::new();
    for (i, o) in overrides.into_iter().enumerate() {
        match compile_key_override(bundle, o) {
            Ok((rule, quota)) => table.insert(
                rule,
                o.key.clone(),
                KeyQuota {
                    quota,
                    expires_us: o
                        .expires_at
                        .map(|at| (at.max(0) as u64).saturating_mul(1_000_000)),
                },
            ),
            Err(_) => orphaned.push(i),
        }
    }
    (table, orphaned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::MICRO;
    use crate::policy::compile::compile_bundle;
    use serde_json::json;

    fn bundle() -> Bundle {
        compile_bundle(
            &json!({"bundle_version": 1, "policies": [{"id": "api", "spec": {"rules": [
                {"name": "per-tenant", "limit_keys": ["header:x-tenant"], "algorithm": "token_bucket",
                 "algorithm_config": {"tokens_per_second": 1, "burst": 10}},
                {"name": "monthly", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
                 "algorithm_config": {"budget": 1000, "period": "1d", "cost_key": "fixed", "fixed_cost": 1,
                                      "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
                {"name": "slots", "limit_keys": ["header:x-tenant"], "algorithm": "concurrency",
                 "algorithm_config": {"max_in_flight": 2}}
            ]}}]}),
            "t",
        )
        .unwrap()
    }

    fn refused(body: Value) -> Vec<String> {
        let o = match read_key_override(&body) {
            Ok(o) => o,
            Err(errors) => return errors.iter().map(ToString::to_string).collect(),
        };
        match compile_key_override(&bundle(), &o) {
            Ok(_) => Vec::new(),
            Err(OverrideRefused::Invalid(errors)) => {
                errors.iter().map(ToString::to_string).collect()
            }
            Err(other) => vec![other.to_string()],
        }
    }

    #[test]
    fn an_override_compiles_over_its_rules_quota() {
        let b = bundle();
        let o = read_key_override(
            &json!({"policy": "api", "rule": "per-tenant", "key": "acme",
                                         "burst": 50, "expires_at": "2030-01-01T00:00:00Z"}),
        )
        .unwrap();
        assert_eq!(o.expires_at, Some(1_893_456_000));
        let (rule, quota) = compile_key_override(&b, &o).unwrap();
        assert_eq!(rule, 0);
        // The rate is the rule's: 1 token a second.
        assert_eq!(quota, Quota::new(50 * MICRO, MICRO, 1_000_000).unwrap());
        let o = read_key_override(&json!({"policy": "api", "rule": "monthly", "key": "acme",
                                         "budget": 5000}))
        .unwrap();
        let (rule, quota) = compile_key_override(&b, &o).unwrap();
        assert_eq!(rule, 1);
        assert_eq!(quota.burst(), 5000 * MICRO);
        assert_eq!(quota.period_us(), b.rules[1].quota.period_us());
    }

    #[test]
    fn quota_fields_are_refused_as_the_bundles_are() {
        let base = |extra: Value| {
            let mut body = json!({"policy": "api", "rule": "per-tenant", "key": "acme"});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            refused(body)
        };
        assert_eq!(base(json!({"burst": 0.5})), ["burst: must be >= 1"]);
        assert_eq!(
            base(json!({"burst": "ten"})),
            ["burst: must be a number, found a string"]
        );
        assert_eq!(
            base(json!({"rps": 1, "tokens_per_second": 2})),
            ["rps: set tokens_per_second or its alias rps, not both"]
        );
        assert_eq!(
            base(json!({"count": 5})),
            ["period: is required with count"]
        );
        assert_eq!(
            base(json!({"budget": 5})),
            ["budget: unknown field (expected one of: policy, rule, key, expires_at, tokens_per_second, rps, burst, count, period)"]
        );
        assert_eq!(
            base(json!({})),
            ["(root): sets no quota field: name at least one of tokens_per_second, rps, burst, count, period"]
        );
        assert_eq!(
            base(json!({"burst": 5, "expires_at": "tomorrow"})),
            ["expires_at: must be an RFC 3339 UTC time such as 2030-01-01T00:00:00Z"]
        );
        assert_eq!(
            refused(json!({"rule": "per-tenant", "key": "", "burst": 5})),
            ["policy: is required", "key: must not be empty"]
        );
        assert_eq!(
            refused(json!({"policy": "api", "rule": "nope", "key": "k", "burst": 5})),
            ["no rule \"nope\" in policy \"api\" of the bundle in force"]
        );
        assert_eq!(
            refused(json!({"policy": "web", "rule": "per-tenant", "key": "k", "burst": 5})),
            ["no policy \"web\" in the bundle in force"]
        );
        assert_eq!(
            refused(json!({"policy": "api", "rule": "slots", "key": "k", "burst": 5})),
            ["rule \"slots\" is a concurrency rule: an override sets the quota of a token_bucket or cost_based rule"]
        );
        assert_eq!(
            refused(json!({"policy": "api", "rule": "monthly", "key": "k", "budget": -1})),
            ["budget: must be > 0"]
        );
    }

    #[test]
    fn the_table_leaves_out_what_the_bundle_no_longer_has() {
        let b = bundle();
        let good = read_key_override(
            &json!({"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 50}),
        )
        .unwrap();
        let gone = KeyOverride {
            rule: "removed".into(),
            ..good.clone()
        };
        let (table, orphaned) = key_quota_table(&b, [&gone, &good]);
        assert_eq!(orphaned, [0]);
        assert_eq!(table.get(0, "acme", 0).map(|q| q.burst()), Some(50 * MICRO));
    }

    /// Decided through the engine: an override set at runtime beats the bundle's own for its
    /// key, until it expires; `burst_from` reads a verified claim, bounded.
    mod deciding {
        use super::*;
        use crate::engine::tests::{ask, engine};

        #[test]
        fn a_runtime_override_beats_the_bundles_until_it_expires() {
            let (e, clock) = engine(
                json!({"bundle_version": 1, "policies": [{"id": "api", "spec": {"rules": [
                    {"name": "per-tenant", "limit_keys": ["header:x-tenant"], "algorithm": "token_bucket",
                     "algorithm_config": {"count": 2, "period": "1h", "burst": 2,
                                          "overrides": [{"ids": ["acme"], "burst": 4}]}}
                ]}}]}),
            );
            let b = e.bundle.get().unwrap();
            let o = read_key_override(
                &json!({"policy": "api", "rule": "per-tenant", "key": "acme",
                "burst": 6, "expires_at": "2027-01-15T08:10:00Z"}),
            )
            .unwrap();
            b.key_quotas.set(key_quota_table(b, [&o]).0);
            let admitted = |tenant: &str, n: usize| {
                (0..n)
                    .filter(|_| {
                        ask(&e, "GET", "/", "10.0.0.1", &[("X-Tenant", tenant)]).is_allowed()
                    })
                    .count()
            };
            assert_eq!(admitted("acme", 10), 6);
            assert_eq!(admitted("globex", 10), 2);
            // Expired (2027-01-15T08:10:00Z is 600 s after the test clock's origin): the
            // bundle's own override applies to a fresh key again.
            clock.set_secs(600.0);
            let o2 = KeyOverride {
                key: "initech".into(),
                ..o
            };
            b.key_quotas.set(key_quota_table(b, [&o2]).0);
            assert_eq!(admitted("initech", 10), 2);
        }

        #[test]
        fn burst_from_reads_a_verified_claim_within_its_bound() {
            let (e, _) = engine(json!({"rules": [
                {"name": "plan", "limit_keys": ["jwt:sub"], "algorithm": "token_bucket",
                 "algorithm_config": {"count": 1, "period": "1h", "burst": 2,
                                      "burst_from": "jwt:limits.burst", "max_burst": 5}}
            ]}));
            let headers: Vec<(String, String)> = Vec::new();
            let admitted = |claims: Value| {
                let claims = claims.as_object().cloned().unwrap();
                (0..10)
                    .filter(|_| {
                        let facts = crate::request::descriptor::RequestFacts::from_uri(
                            "GET",
                            "/",
                            None,
                            Some("10.0.0.1".parse().unwrap()),
                            &headers,
                        )
                        .with_claims(Some(&claims));
                        e.decide(&facts).is_allowed()
                    })
                    .count()
            };
            assert_eq!(admitted(json!({"sub": "a", "limits": {"burst": 4}})), 4);
            assert_eq!(admitted(json!({"sub": "b", "limits": {"burst": 100}})), 5);
            assert_eq!(
                admitted(json!({"sub": "c", "limits": {"burst": "lots"}})),
                2
            );
            assert_eq!(admitted(json!({"sub": "d"})), 2);
            assert_eq!(admitted(json!({"sub": "e", "limits": {"burst": "3"}})), 3);
        }

        #[test]
        fn burst_from_is_checked_at_compile_time() {
            let errors = |config: Value| {
                crate::policy::compile::tests::errors_of(json!({"rules": [
                    {"name": "plan", "limit_keys": ["jwt:sub"], "algorithm": "token_bucket",
                     "algorithm_config": config}
                ]}))
            };
            assert_eq!(
                errors(json!({"rps": 1, "burst": 2, "burst_from": "header:x-burst"})),
                ["rules[0].algorithm_config.burst_from: 'header:x-burst' is not \"jwt:<claim>\" (a dotted path for a nested claim: jwt:limits.burst)"]
            );
            assert_eq!(
                errors(json!({"rps": 1, "burst": 2, "burst_from": "jwt:a..b"})),
                ["rules[0].algorithm_config.burst_from: 'jwt:a..b' is not \"jwt:<claim>\" (a dotted path for a nested claim: jwt:limits.burst)"]
            );
            assert_eq!(
                errors(json!({"rps": 1, "burst": 2, "burst_from": "jwt:b", "max_burst": 1})),
                ["rules[0].algorithm_config.max_burst: max_burst 1 is below burst 2: the claim's bound must be at least the rule's own burst"]
            );
            assert_eq!(
                errors(json!({"rps": 1, "burst": 2, "max_burst": 10})),
                ["rules[0].algorithm_config.max_burst: is only read with burst_from"]
            );
        }
    }
}
