//! Where a rule's keys come from: which descriptors a client can make up at will (every new
//! value is a fresh bucket and a new store entry) and which rules hold what they count long
//! enough for that to matter. `validate` and the gateway's policy load warn about a rule that is
//! both; nothing here fails a bundle.
//!
//! A made-up key costs twice: the client spreads its use over as many buckets as it likes (a
//! budget per made-up value), and a flood of made-up values fills the store, whose bound then
//! decides what is forgotten. For a short token bucket neither lasts (its entry is worth nothing
//! again within the hour); a budget, or a bucket that takes hours to refill, keeps both for its
//! whole window.

use super::bundle::Bundle;
use super::error::FieldError;
use super::rule::{LlmLimit, LlmPart, MatchValue, Rule, RuleKind};
use crate::request::descriptor::Descriptor;

/// A token bucket taking longer than this to refill from empty counts as long-window (seconds).
pub const LONG_WINDOW_SECS: u64 = 3_600;

/// The longest IPv6 prefix one client cannot multiply: a host is usually handed a whole `/64`,
/// so keys on longer prefixes (down to single addresses) are 2^64 values it can pick from.
pub const HOST_V6_PREFIX: u8 = 64;

/// What the gateway verifies about a request's identities, for [`made_up_by_client`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyTrust {
    /// `jwt:` claims come from tokens whose signature was checked (false under
    /// `--jwt-unverified`: anyone can write a token).
    pub jwt_claims_verified: bool,
    /// The prefix `ip:address` without `/N` reduces IPv6 clients to (`--ipv6-prefix`).
    pub default_v6_prefix: u8,
}

impl Default for KeyTrust {
    /// The gateway's defaults: signatures checked, IPv6 clients keyed per `/64`.
    fn default() -> Self {
        KeyTrust {
            jwt_claims_verified: true,
            default_v6_prefix: 64,
        }
    }
}

/// Whether any client can give `descriptor` a value of its choosing on every request.
///
/// Made up: `header:`, `query:`, `path`, `host` and `method` (a client writes them all),
/// `jwt:` claims under `--jwt-unverified`, and `ip:address` keyed on IPv6 prefixes longer than
/// `/64`. Not made up: `jwt:` claims of verified tokens, `ip:address` (the TCP peer, or what a
/// `--trusted-proxy` vouches for) per `/64` or wider, the network facts `ip:country`...
/// (bounded sets, and read from trusted headers only), and the Envoy descriptor parts:
/// `domain` and `descriptor_keys` are Envoy's configuration, and a `descriptor:<key>` entry is
/// whatever Envoy's rate-limit actions put there (a `request_headers` action copies a client
/// header: key budgets on such entries only when a layer before Envoy verified it).
pub fn made_up_by_client(descriptor: &Descriptor, trust: &KeyTrust) -> bool {
    match descriptor {
        Descriptor::Header(_)
        | Descriptor::Query(_)
        | Descriptor::Path
        | Descriptor::Host
        | Descriptor::Method
        | Descriptor::Grpc(_) => true,
        Descriptor::LlmModel => true,
        Descriptor::Jwt(_) => !trust.jwt_claims_verified,
        Descriptor::Ip { v6_prefix } => {
            v6_prefix.unwrap_or(trust.default_v6_prefix) > HOST_V6_PREFIX
        }
        Descriptor::Network(_)
        | Descriptor::Domain
        | Descriptor::EntryKeys
        | Descriptor::LlmProvider
        | Descriptor::Entry(_) => false,
    }
}

/// What a rule holds for long enough that made-up keys matter, as the warning words it; `None`
/// for short token buckets, concurrency slots (leases end with their requests) and the policy
/// guards (loop marks and breakers key on the policy's own rules).
pub fn long_lived(rule: &Rule) -> Option<String> {
    match &rule.kind {
        RuleKind::Concurrency(_) | RuleKind::Guard(_) => None,
        RuleKind::Budget(_) => Some("a budget".to_string()),
        RuleKind::Spend(_) => Some("a spend budget".to_string()),
        RuleKind::Llm(LlmLimit {
            part: LlmPart::Day(_),
            ..
        }) => Some("a tokens_per_day budget".to_string()),
        RuleKind::TokenBucket | RuleKind::Llm(_) => {
            let refill_secs = rule.quota.window_secs();
            (refill_secs > LONG_WINDOW_SECS)
                .then(|| format!("a token bucket taking {refill_secs} s to refill"))
        }
    }
}

impl Bundle {
    /// The limit keys of `rule` a client can make up, in order: none when its policy's selector
    /// or the rule's own `match` pins the descriptor to fixed values (`methods`, `hosts`,
    /// `pathExact`, `"match": {"header:x-tier": "gold"}`).
    pub fn made_up_keys<'r>(&self, rule: &'r Rule, trust: &KeyTrust) -> Vec<&'r Descriptor> {
        let selector = self.policies.get(rule.policy).map(|p| &p.selector);
        rule.limit_keys
            .iter()
            .filter(|d| made_up_by_client(d, trust))
            .filter(|d| {
                let pinned_by_selector = match d {
                    Descriptor::Method => selector.is_some_and(|s| s.methods.is_some()),
                    Descriptor::Host => selector.is_some_and(|s| s.hosts.is_some()),
                    Descriptor::Path => selector.is_some_and(|s| s.path_exact.is_some()),
                    _ => false,
                };
                let pinned_by_match = rule
                    .conditions
                    .iter()
                    .any(|c| c.descriptor == **d && matches!(c.expected, MatchValue::Text(_)));
                !pinned_by_selector && !pinned_by_match
            })
            .collect()
    }

    /// One warning per budget or long-window rule keyed on something a client can make up, at
    /// the JSON path of its `limit_keys`.
    pub fn made_up_key_warnings(&self, trust: &KeyTrust) -> Vec<FieldError> {
        self.long_lived_keys
            .iter()
            .filter_map(|(index, path)| {
                let rule = self.rules.get(*index)?;
                let what = long_lived(rule)?;
                let made_up = self.made_up_keys(rule, trust);
                if made_up.is_empty() {
                    return None;
                }
                let listed: Vec<String> = made_up.iter().map(ToString::to_string).collect();
                Some(FieldError {
                    path: path.to_string(),
                    message: format!(
                        "rule '{}' ({what}) is keyed on {}, which any client can make up: every new value starts a fresh count and takes a store entry, so one client can spread its use over as many entries as it likes, and a flood of made-up values fills the store; key it on a verified JWT claim (jwt:sub, jwt:org_id...) instead",
                        rule.name,
                        listed.join(", ")
                    ),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::compile_bundle;
    use serde_json::json;

    fn d(text: &str) -> Descriptor {
        Descriptor::parse(text).unwrap()
    }

    #[test]
    fn which_descriptors_a_client_makes_up() {
        let trust = KeyTrust::default();
        for made_up in [
            "header:x-api-key",
            "query:key",
            "path",
            "host",
            "method",
            "ip:address/96",
            "ip:address/128",
        ] {
            assert!(made_up_by_client(&d(made_up), &trust), "{made_up}");
        }
        for verified in [
            "jwt:sub",
            "jwt:org.id",
            "ip:address",
            "ip:address/64",
            "ip:address/48",
            "ip:country",
            "ip:asn",
            "ip:type",
            "ip:tor",
            "domain",
            "descriptor_keys",
            "descriptor:remote_address",
            "descriptor:api_key",
        ] {
            assert!(!made_up_by_client(&d(verified), &trust), "{verified}");
        }
    }

    #[test]
    fn unverified_claims_and_long_default_prefixes_are_made_up() {
        let unverified = KeyTrust {
            jwt_claims_verified: false,
            ..KeyTrust::default()
        };
        assert!(made_up_by_client(&d("jwt:sub"), &unverified));
        let per_address = KeyTrust {
            default_v6_prefix: 128,
            ..KeyTrust::default()
        };
        assert!(made_up_by_client(&d("ip:address"), &per_address));
        // An explicit prefix on the rule wins over the default.
        assert!(!made_up_by_client(&d("ip:address/56"), &per_address));
    }

    fn warnings(bundle: serde_json::Value, trust: &KeyTrust) -> Vec<String> {
        compile_bundle(&bundle, "test")
            .unwrap()
            .made_up_key_warnings(trust)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn budget(keys: serde_json::Value) -> serde_json::Value {
        json!({"name": "monthly", "limit_keys": keys, "algorithm": "cost_based",
               "algorithm_config": {"budget": 20, "period": "1M", "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}})
    }

    #[test]
    fn a_budget_on_a_header_is_warned_at_its_limit_keys() {
        let bundle = json!({"bundle_version": 1, "policies": [{"id": "api", "spec": {"rules": [
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 5, "burst": 10}},
            budget(json!(["header:x-api-key", "query:k", "jwt:sub"]))
        ]}}]});
        assert_eq!(
            warnings(bundle, &KeyTrust::default()),
            ["policies[0].spec.rules[1].limit_keys: rule 'monthly' (a budget) is keyed on header:x-api-key, query:k, which any client can make up: every new value starts a fresh count and takes a store entry, so one client can spread its use over as many entries as it likes, and a flood of made-up values fills the store; key it on a verified JWT claim (jwt:sub, jwt:org_id...) instead"]
        );
    }

    #[test]
    fn verified_keys_short_buckets_and_pinned_values_are_not_warned() {
        let bundle = json!({"bundle_version": 1, "policies": [
            {"id": "a", "spec": {"rules": [
                budget(json!(["jwt:sub"])),
                {"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 3600}},
                {"name": "in-flight", "limit_keys": ["header:x-api-key"], "algorithm": "concurrency",
                 "algorithm_config": {"max_in_flight": 2}}
            ]}},
            {"id": "b", "spec": {"selector": {"methods": ["GET"], "pathExact": "/v1/x"}, "rules": [
                {"name": "b-budget", "limit_keys": ["method", "path", "ip:address"], "algorithm": "cost_based",
                 "algorithm_config": {"budget": 5, "period": "1d", "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
                {"name": "gold", "limit_keys": ["header:x-tier"], "match": {"header:x-tier": "gold"},
                 "algorithm": "cost_based", "algorithm_config": {"budget": 5, "period": "1d", "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}}
            ]}}
        ]});
        assert_eq!(warnings(bundle, &KeyTrust::default()), Vec::<String>::new());
    }

    #[test]
    fn slow_buckets_and_daily_llm_budgets_are_long_lived() {
        let bundle = json!({"rules": [
            {"name": "slow", "limit_keys": ["query:user"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 3601}},
            {"name": "chat", "limit_keys": ["jwt:sub"], "algorithm": "token_bucket_llm",
             "algorithm_config": {"tokens_per_minute": 1000, "tokens_per_day": 100000}}
        ]});
        assert_eq!(
            warnings(bundle.clone(), &KeyTrust::default()),
            ["rules[0].limit_keys: rule 'slow' (a token bucket taking 3601 s to refill) is keyed on query:user, which any client can make up: every new value starts a fresh count and takes a store entry, so one client can spread its use over as many entries as it likes, and a flood of made-up values fills the store; key it on a verified JWT claim (jwt:sub, jwt:org_id...) instead"]
        );
        let unverified = KeyTrust {
            jwt_claims_verified: false,
            ..KeyTrust::default()
        };
        let found = warnings(bundle, &unverified);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[1].starts_with("rules[1].limit_keys: rule 'chat:tpd' (a tokens_per_day budget) is keyed on jwt:sub, which any client can make up"),
            "{}",
            found[1]
        );
    }
}
