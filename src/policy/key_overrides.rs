//! Per-key overrides set at runtime (`PUT /v1/overrides`): what one override is
//! ([`KeyOverride`], the request body and the stored form alike), and the quotas they give once
//! compiled against a bundle ([`KeyQuotas`]), looked up by the engine before the rule's own
//! quota. A bundle carries one [`KeyQuotas`] (shared with its all-shadow twin); the running
//! gateway fills it from its override table whenever the table or the bundle changes. Empty, a
//! lookup costs one relaxed atomic load.

use crate::limits::limiter::Quota;
use ahash::AHashMap;
use arc_swap::ArcSwap;
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The fields of an override that name it and bound it in time; every other field of its
/// body is one of its rule's quota fields.
pub const META_FIELDS: [&str; 4] = ["policy", "rule", "key", "expires_at"];

/// One override: the quota fields of `policy`'s rule `rule` for the bucket key `key` (the key as
/// `/v1/buckets` names it after the rule), until `expires_at` (Unix seconds) if set.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyOverride {
    pub policy: String,
    pub rule: String,
    pub key: String,
    /// The quota fields as sent (`burst`, `tokens_per_second`, `budget`...), checked against
    /// the rule's kind by the compiler.
    pub fields: Map<String, Value>,
    pub expires_at: Option<i64>,
}

impl KeyOverride {
    /// What names it in a table: policy, rule and key.
    pub fn id(&self) -> (String, String, String) {
        (self.policy.clone(), self.rule.clone(), self.key.clone())
    }

    /// Whether it has stopped applying at `unix_us`.
    pub fn expired(&self, unix_us: u64) -> bool {
        self.expires_at
            .is_some_and(|at| unix_us >= (at.max(0) as u64).saturating_mul(1_000_000))
    }

    /// Its JSON form: the `PUT` body it came from (`expires_at` in RFC 3339).
    pub fn to_json(&self) -> Value {
        let mut out = Map::new();
        out.insert("policy".into(), self.policy.clone().into());
        out.insert("rule".into(), self.rule.clone().into());
        out.insert("key".into(), self.key.clone().into());
        for (name, value) in &self.fields {
            out.insert(name.clone(), value.clone());
        }
        if let Some(at) = self.expires_at {
            out.insert("expires_at".into(), rfc3339(at).into());
        }
        Value::Object(out)
    }
}

/// Unix seconds as an RFC 3339 UTC time (`2030-01-01T00:00:00Z`).
pub fn rfc3339(unix_secs: i64) -> String {
    humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix_secs.max(0) as u64),
    )
    .to_string()
}

/// The quota an override gives one key, and when it stops applying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyQuota {
    pub quota: Quota,
    /// Unix µs; `None`: until deleted.
    pub expires_us: Option<u64>,
}

/// The overrides compiled against one bundle: by rule (its index in the bundle), by key.
#[derive(Debug, Default)]
pub struct KeyQuotaTable {
    by_rule: AHashMap<usize, AHashMap<String, KeyQuota>>,
}

impl KeyQuotaTable {
    /// Adds (or replaces) the quota of `key` under rule `rule`.
    pub fn insert(&mut self, rule: usize, key: String, quota: KeyQuota) {
        self.by_rule.entry(rule).or_default().insert(key, quota);
    }

    pub fn is_empty(&self) -> bool {
        self.by_rule.is_empty()
    }

    /// The override's quota for `key` under rule `rule`, if one applies at `unix_us`.
    pub fn get(&self, rule: usize, key: &str, unix_us: u64) -> Option<Quota> {
        let found = self.by_rule.get(&rule)?.get(key)?;
        match found.expires_us {
            Some(at) if unix_us >= at => None,
            _ => Some(found.quota),
        }
    }
}

/// A bundle's overrides in force: swapped whole by the gateway, read by every decision.
#[derive(Debug, Default)]
pub struct KeyQuotas {
    /// Whether the table holds anything: read first, so an empty table costs one load.
    active: AtomicBool,
    table: ArcSwap<KeyQuotaTable>,
}

impl KeyQuotas {
    /// Puts `table` in force.
    pub fn set(&self, table: KeyQuotaTable) {
        let active = !table.is_empty();
        self.table.store(Arc::new(table));
        self.active.store(active, Ordering::Release);
    }

    /// The override's quota for `key` under rule `rule` at `unix_us`, if any.
    #[inline]
    pub fn get(&self, rule: usize, key: &str, unix_us: u64) -> Option<Quota> {
        if !self.active.load(Ordering::Relaxed) {
            return None;
        }
        self.lookup(rule, key, unix_us)
    }

    /// [`KeyQuotas::get`] once the table holds something: kept out of line, so the decision
    /// path of a gateway without overrides carries only the flag's load.
    #[inline(never)]
    fn lookup(&self, rule: usize, key: &str, unix_us: u64) -> Option<Quota> {
        self.table.load().get(rule, key, unix_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::MICRO;

    fn quota(burst: u64) -> Quota {
        Quota::new(burst * MICRO, MICRO, 1_000_000).unwrap()
    }

    #[test]
    fn an_empty_table_answers_nothing_and_a_set_one_answers_until_it_expires() {
        let quotas = KeyQuotas::default();
        assert_eq!(quotas.get(0, "k", 0), None);
        let mut table = KeyQuotaTable::default();
        table.insert(
            2,
            "acme".into(),
            KeyQuota {
                quota: quota(50),
                expires_us: Some(10_000_000),
            },
        );
        table.insert(
            2,
            "globex".into(),
            KeyQuota {
                quota: quota(7),
                expires_us: None,
            },
        );
        quotas.set(table);
        assert_eq!(quotas.get(2, "acme", 9_999_999), Some(quota(50)));
        assert_eq!(quotas.get(2, "acme", 10_000_000), None);
        assert_eq!(quotas.get(2, "globex", u64::MAX), Some(quota(7)));
        assert_eq!(quotas.get(1, "acme", 0), None);
        assert_eq!(quotas.get(2, "other", 0), None);
        quotas.set(KeyQuotaTable::default());
        assert_eq!(quotas.get(2, "globex", 0), None);
    }

    #[test]
    fn an_override_reads_back_as_the_body_it_came_from() {
        let mut fields = Map::new();
        fields.insert("burst".into(), 50.into());
        let o = KeyOverride {
            policy: "p".into(),
            rule: "per-tenant".into(),
            key: "acme".into(),
            fields,
            expires_at: Some(1_893_456_000),
        };
        assert_eq!(
            o.to_json(),
            serde_json::json!({"policy": "p", "rule": "per-tenant", "key": "acme", "burst": 50,
                               "expires_at": "2030-01-01T00:00:00Z"})
        );
        assert!(!o.expired(1_893_455_999_999_999));
        assert!(o.expired(1_893_456_000_000_000));
    }
}
