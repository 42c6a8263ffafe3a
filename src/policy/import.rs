//! `tollgate import envoy-ratelimit`: converts an envoyproxy/ratelimit configuration (YAML:
//! `domain`, nested `descriptors` of `key` / `value`, `rate_limit {unit, requests_per_unit,
//! unlimited, name}`, `shadow_mode`) into a tollgate bundle for the gRPC rate-limit service,
//! and lists what it could not carry over exactly.
//!
//! envoyproxy/ratelimit applies at most one limit per descriptor: the one at the end of a walk
//! down its tree that must consume every entry, preferring `key_value` over a bare `key` at
//! each level. tollgate applies every matching rule, so each limit becomes a rule matching the
//! descriptor's exact shape (`descriptor_keys`) and its fixed values; a bare `key` becomes a
//! limit key (one bucket per value). Where a bare `key` has valued siblings at the last level,
//! they form one policy with the bare `key` as its `fallback_limit`, so a valued entry is never
//! also counted by its wildcard sibling. Fixed windows of N per unit become token buckets of
//! burst N refilled at N per unit: the same average, without the double burst at a window's
//! edge.

use serde::Deserialize;
use serde_json::{json, Map, Value};

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RatelimitConfig {
    pub domain: String,
    #[serde(default)]
    pub descriptors: Vec<DescriptorNode>,
}

/// One node of the descriptor tree.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorNode {
    pub key: String,
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub rate_limit: Option<RateLimitSpec>,
    #[serde(default)]
    pub descriptors: Vec<DescriptorNode>,
    #[serde(default)]
    pub shadow_mode: bool,
    #[serde(default)]
    pub detailed_metric: bool,
    #[serde(default)]
    pub value_to_metric: bool,
}

/// `rate_limit`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitSpec {
    #[serde(default)]
    pub unit: Option<String>,
    #[serde(default)]
    pub requests_per_unit: Option<u64>,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub replaces: Vec<serde_yaml_ng::Value>,
}

/// Why a file cannot be imported at all.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: not an envoyproxy/ratelimit configuration: {source}")]
    Parse {
        file: String,
        source: serde_yaml_ng::Error,
    },
    #[error("{file}: domain must not be empty")]
    EmptyDomain { file: String },
    #[error("{file}: the converted bundle is invalid (please report this): {errors}")]
    Invalid { file: String, errors: String },
}

/// The bundle, and what was not carried over exactly (one line each).
#[derive(Debug)]
pub struct Imported {
    pub bundle: Value,
    pub notes: Vec<String>,
}

/// One limit found in the tree.
struct Limit {
    /// `(key, value)` from the root.
    path: Vec<(String, Option<String>)>,
    /// `None`: `unlimited`.
    quota: Option<(u64, &'static str)>,
    name: Option<String>,
    shadow: bool,
    /// A valued node without a limit of its own: upstream gives such a descriptor no limit,
    /// so next to a bare-key sibling it becomes an unlimited "keeper"; alone, nothing.
    implicit: bool,
    /// Where it came from, for notes (`descriptors[0].descriptors[1]`); empty for a rule made
    /// up by the import.
    at: String,
}

/// Reads and converts `file`.
///
/// # Errors
/// The file cannot be read or is not an envoyproxy/ratelimit configuration.
pub fn envoy_ratelimit_file(file: &std::path::Path) -> Result<Imported, ImportError> {
    let name = file.display().to_string();
    let text = std::fs::read_to_string(file).map_err(|source| ImportError::Read {
        file: name.clone(),
        source,
    })?;
    let config: RatelimitConfig =
        serde_yaml_ng::from_str(&text).map_err(|source| ImportError::Parse {
            file: name.clone(),
            source,
        })?;
    let imported =
        envoy_ratelimit(&config).map_err(|()| ImportError::EmptyDomain { file: name.clone() })?;
    // What we print must load: checked with the real compiler.
    if let Err(errors) = crate::policy::compile_bundle(&imported.bundle, "imported") {
        return Err(ImportError::Invalid {
            file: name,
            errors: errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    Ok(imported)
}

/// Converts a parsed configuration. `Err(())` when the domain is empty.
#[allow(clippy::result_unit_err)]
pub fn envoy_ratelimit(config: &RatelimitConfig) -> Result<Imported, ()> {
    if config.domain.is_empty() {
        return Err(());
    }
    let mut notes = Vec::new();
    let mut limits = Vec::new();
    note_deep_precedence(&config.descriptors, "", &mut notes);
    for (i, node) in config.descriptors.iter().enumerate() {
        walk(
            node,
            &mut Vec::new(),
            format!("descriptors[{i}]"),
            &mut limits,
            &mut notes,
        );
    }
    let mut conversion = Conversion {
        domain: &config.domain,
        names: Vec::new(),
        notes,
    };
    let mut used = vec![false; limits.len()];
    let mut policies = conversion.sibling_policies(&limits, &mut used);
    for shadow in [false, true] {
        policies.extend(conversion.mode_policy(&limits, &used, shadow));
    }
    Ok(Imported {
        bundle: json!({ "bundle_version": 1, "policies": policies }),
        notes: conversion.notes,
    })
}

/// The policies of one imported domain being written: the rule names taken so far and the
/// notes on what did not map one to one.
struct Conversion<'c> {
    domain: &'c str,
    names: Vec<String>,
    notes: Vec<String>,
}

impl Conversion<'_> {
    /// Sibling groups at the last level with a wildcard and valued entries: one policy each,
    /// the wildcard as the fallback. Marks the limits it places in `used`.
    fn sibling_policies(&mut self, limits: &[Limit], used: &mut [bool]) -> Vec<Value> {
        let mut policies = Vec::new();
        for (i, wildcard) in limits.iter().enumerate() {
            let is_wildcard = wildcard.path.last().is_some_and(|(_, v)| v.is_none());
            if !is_wildcard || wildcard.quota.is_none() {
                continue;
            }
            let group = sibling_group(wildcard);
            let valued: Vec<usize> = limits
                .iter()
                .enumerate()
                .filter(|(j, l)| {
                    *j != i
                        && !used[*j]
                        && l.path.last().is_some_and(|(_, v)| v.is_some())
                        && sibling_group(l) == group
                })
                .map(|(j, _)| j)
                .collect();
            if valued.is_empty() {
                continue;
            }
            used[i] = true;
            let mut rules = Vec::new();
            for &j in &valued {
                if limits[j].shadow == wildcard.shadow {
                    used[j] = true;
                    rules.push(Value::Object(self.rule(&limits[j])));
                } else {
                    let keeper = self.precedence_keeper(&limits[j], wildcard);
                    rules.push(Value::Object(self.rule(&keeper)));
                }
            }
            let fallback = self.rule(wildcard);
            policies.push(json!({
                "id": fallback["name"].clone(),
                "spec": {
                    "selector": { "domains": [self.domain] },
                    "mode": if wildcard.shadow { "shadow" } else { "enforce" },
                    "rules": rules,
                    "fallback_limit": Value::Object(fallback),
                }
            }));
        }
        policies
    }

    /// A valued limit whose `shadow_mode` differs from its wildcard sibling's: its own limit
    /// runs in the other mode's policy; in the wildcard's, an unlimited rule keeps the
    /// wildcard's limit off this value, as envoyproxy/ratelimit's lookup does.
    fn precedence_keeper(&mut self, valued: &Limit, wildcard: &Limit) -> Limit {
        let mode = if valued.shadow { "shadow" } else { "enforce" };
        self.notes.push(format!(
            "{}: shadow_mode differs from its wildcard sibling {}: its limit runs in the {mode} policy, and a rule of 1000000000 per second keeps the wildcard's limit off it",
            valued.at, wildcard.at
        ));
        Limit {
            path: valued.path.clone(),
            quota: None,
            name: Some(format!(
                "{}-precedence",
                valued
                    .name
                    .clone()
                    .unwrap_or_else(|| default_name(self.domain, &valued.path))
            )),
            shadow: wildcard.shadow,
            implicit: false,
            at: String::new(),
        }
    }

    /// The policy (enforced or shadow) holding the limits no sibling group took; `None` when
    /// there are none.
    fn mode_policy(&mut self, limits: &[Limit], used: &[bool], shadow: bool) -> Option<Value> {
        let mut rules = Vec::new();
        for (i, limit) in limits.iter().enumerate() {
            if used[i] || limit.shadow != shadow {
                continue;
            }
            if limit.quota.is_none() {
                if !limit.implicit {
                    self.notes.push(format!(
                        "{}: unlimited with no wildcard sibling to take precedence over: no rule needed",
                        limit.at
                    ));
                }
                continue;
            }
            rules.push(Value::Object(self.rule(limit)));
        }
        if rules.is_empty() {
            return None;
        }
        let id = if shadow {
            format!("{}-shadow", self.domain)
        } else {
            self.domain.to_string()
        };
        Some(json!({
            "id": id,
            "spec": {
                "selector": { "domains": [self.domain] },
                "mode": if shadow { "shadow" } else { "enforce" },
                "rules": rules,
            }
        }))
    }

    /// A limit as a `token_bucket` rule: named uniquely, its valued descriptor entries as
    /// `match`, its wildcard ones as `limit_keys`; an unlimited one as 1000000000 per second.
    fn rule(&mut self, limit: &Limit) -> Map<String, Value> {
        let base = limit
            .name
            .clone()
            .unwrap_or_else(|| default_name(self.domain, &limit.path));
        let mut name = base.clone();
        let mut n = 2;
        while self.names.contains(&name) {
            name = format!("{base}-{n}");
            n += 1;
        }
        self.names.push(name.clone());
        let keys: Vec<&str> = limit.path.iter().map(|(k, _)| k.as_str()).collect();
        let mut matches = Map::new();
        matches.insert("descriptor_keys".into(), json!(keys.join(",")));
        let mut limit_keys = Vec::new();
        for (key, value) in &limit.path {
            match value {
                Some(v) => {
                    matches.insert(format!("descriptor:{key}"), json!(v));
                }
                None => limit_keys.push(json!(format!("descriptor:{key}"))),
            }
        }
        let (count, period) = match limit.quota {
            Some(q) => q,
            None => {
                if !limit.at.is_empty() && !limit.implicit {
                    self.notes.push(format!(
                        "{}: unlimited, mapped to a rule of 1000000000 per second so that it takes precedence over its wildcard sibling",
                        limit.at
                    ));
                }
                (1_000_000_000, "1s")
            }
        };
        let mut rule = Map::new();
        rule.insert("name".into(), json!(name));
        rule.insert("limit_keys".into(), Value::Array(limit_keys));
        rule.insert("match".into(), Value::Object(matches));
        rule.insert("algorithm".into(), json!("token_bucket"));
        rule.insert(
            "algorithm_config".into(),
            json!({ "count": count, "period": period, "burst": count }),
        );
        rule
    }
}

/// A limit's sibling group: the path above its last entry, and that entry's key.
fn sibling_group(limit: &Limit) -> (Vec<(String, Option<String>)>, String) {
    let (last, parent) = limit.path.split_last().map_or_else(
        || (String::new(), Vec::new()),
        |(last, parent)| (last.0.clone(), parent.to_vec()),
    );
    (parent, last)
}

fn walk(
    node: &DescriptorNode,
    path: &mut Vec<(String, Option<String>)>,
    at: String,
    limits: &mut Vec<Limit>,
    notes: &mut Vec<String>,
) {
    path.push((node.key.clone(), node.value.clone()));
    if node.detailed_metric || node.value_to_metric {
        notes.push(format!(
            "{at}: detailed_metric / value_to_metric ignored (tollgate's metrics are per rule, with bounded labels)"
        ));
    }
    if let Some(spec) = &node.rate_limit {
        if !spec.replaces.is_empty() {
            notes.push(format!(
                "{at}: replaces ignored (tollgate applies every matching rule; the most restrictive decides)"
            ));
        }
        let quota = if spec.unlimited {
            Some(None)
        } else {
            match (
                spec.unit.as_deref().and_then(period_of),
                spec.requests_per_unit,
            ) {
                (Some(period), Some(n)) if (1..=1_000_000_000).contains(&n) => {
                    Some(Some((n, period)))
                }
                (None, _) => {
                    notes.push(format!(
                        "{at}: rate_limit.unit {:?} is not second, minute, hour, day, week, month or year: not mapped",
                        spec.unit.as_deref().unwrap_or("")
                    ));
                    None
                }
                (_, n) => {
                    notes.push(format!(
                        "{at}: rate_limit.requests_per_unit {n:?} is not between 1 and 1000000000: not mapped"
                    ));
                    None
                }
            }
        };
        if let Some(quota) = quota {
            limits.push(Limit {
                path: path.clone(),
                quota,
                name: spec.name.clone(),
                shadow: node.shadow_mode,
                implicit: false,
                at: at.clone(),
            });
        }
    } else if node.value.is_some() {
        limits.push(Limit {
            path: path.clone(),
            quota: None,
            name: None,
            shadow: node.shadow_mode,
            implicit: true,
            at: at.clone(),
        });
    }
    if node.value.as_deref().is_some_and(|v| v.contains('*')) {
        notes.push(format!(
            "{at}: value {:?} is matched literally; envoyproxy/ratelimit reads a trailing * as a prefix wildcard",
            node.value.as_deref().unwrap_or("")
        ));
    }
    note_deep_precedence(&node.descriptors, &format!("{at}."), notes);
    for (i, child) in node.descriptors.iter().enumerate() {
        walk(child, path, format!("{at}.descriptors[{i}]"), limits, notes);
    }
    path.pop();
}

/// Siblings where a valued entry sits next to a bare `key` with nested descriptors: at that
/// level envoyproxy/ratelimit commits to the valued entry (a deeper miss is a miss), while
/// tollgate also applies the bare branch's deeper limits to the value.
fn note_deep_precedence(siblings: &[DescriptorNode], prefix: &str, notes: &mut Vec<String>) {
    for (i, valued) in siblings.iter().enumerate() {
        if valued.value.is_none() {
            continue;
        }
        let wildcard = siblings
            .iter()
            .position(|w| w.key == valued.key && w.value.is_none() && !w.descriptors.is_empty());
        if let Some(w) = wildcard {
            notes.push(format!(
                "{prefix}descriptors[{i}]: key {:?} value {:?} next to bare key {:?} with nested limits ({prefix}descriptors[{w}]): tollgate applies the bare branch's deeper limits to this value too, envoyproxy/ratelimit never falls back to them",
                valued.key,
                valued.value.as_deref().unwrap_or(""),
                valued.key
            ));
        }
    }
}

/// `second`... `year` (any case) as a tollgate period; a month is 30 days, a year 365, as
/// envoyproxy/ratelimit counts them.
fn period_of(unit: &str) -> Option<&'static str> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "second" => "1s",
        "minute" => "1m",
        "hour" => "1h",
        "day" => "1d",
        "week" => "7d",
        "month" => "30d",
        "year" => "365d",
        _ => return None,
    })
}

/// `<domain>.<key>_<value>.<key>`: envoyproxy/ratelimit's own spelling of a descriptor path.
fn default_name(domain: &str, path: &[(String, Option<String>)]) -> String {
    let mut name = domain.to_string();
    for (key, value) in path {
        name.push('.');
        name.push_str(key);
        if let Some(v) = value {
            name.push('_');
            name.push_str(v);
        }
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{decide_local, EngineConfig};
    use crate::policy::compile_bundle;
    use crate::request::descriptor::{EnvoyDescriptor, RequestFacts};
    use crate::store::{MemoryStore, MemoryStoreConfig};

    const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 2 }
  - key: tenant
    value: vip
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: tenant
    value: internal
    rate_limit: { unlimited: true }
  - key: tenant
    rate_limit: { unit: minute, requests_per_unit: 1, name: per-tenant }
  - key: generic_key
    value: login
    descriptors:
      - key: remote_address
        rate_limit: { unit: hour, requests_per_unit: 3 }
        shadow_mode: true
        detailed_metric: true
  - key: bad
    rate_limit: { unit: fortnight, requests_per_unit: 1 }
  - key: plan
    rate_limit: { unit: second, requests_per_unit: 1 }
  - key: plan
    value: free
    descriptors:
      - key: path
        rate_limit: { unit: second, requests_per_unit: 1 }
  - key: route
    value: "/v1/*"
    rate_limit: { unit: second, requests_per_unit: 1 }
"#;

    fn import() -> Imported {
        let config: RatelimitConfig = serde_yaml_ng::from_str(CONFIG).unwrap();
        envoy_ratelimit(&config).unwrap()
    }

    /// Admitted calls out of `n` for one descriptor, at time 0.
    fn admitted(
        bundle: &crate::policy::Bundle,
        store: &MemoryStore,
        entries: &[(&str, &str)],
        n: usize,
    ) -> usize {
        let entries: Vec<(String, String)> = entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        (0..n)
            .filter(|_| {
                let facts = RequestFacts::for_envoy(EnvoyDescriptor {
                    domain: "edge",
                    entries: &entries,
                });
                decide_local(bundle, &facts, store, 0, 0, EngineConfig::default()).is_allowed()
            })
            .count()
    }

    #[test]
    fn converts_to_a_bundle_that_behaves_like_envoyproxy_ratelimit() {
        let imported = import();
        let bundle = compile_bundle(&imported.bundle, "imported").unwrap();
        let store = MemoryStore::new(MemoryStoreConfig::default());
        // Per client address: 2 per second.
        assert_eq!(
            admitted(&bundle, &store, &[("remote_address", "10.0.0.1")], 5),
            2
        );
        assert_eq!(
            admitted(&bundle, &store, &[("remote_address", "10.0.0.2")], 5),
            2
        );
        // A valued tenant is limited by its own entry only, never also by the wildcard.
        assert_eq!(admitted(&bundle, &store, &[("tenant", "vip")], 9), 5);
        assert_eq!(admitted(&bundle, &store, &[("tenant", "internal")], 50), 50);
        assert_eq!(admitted(&bundle, &store, &[("tenant", "t1")], 3), 1);
        assert_eq!(admitted(&bundle, &store, &[("tenant", "t2")], 3), 1);
        // A value with nested limits only has no limit of its own, as upstream: not the
        // bare key's either.
        assert_eq!(admitted(&bundle, &store, &[("plan", "free")], 5), 5);
        assert_eq!(admitted(&bundle, &store, &[("plan", "pro")], 5), 1);
        assert_eq!(
            admitted(&bundle, &store, &[("plan", "free"), ("path", "/a")], 5),
            1
        );
        // A limit applies to its exact shape only: [tenant, remote_address] is another one.
        assert_eq!(
            admitted(
                &bundle,
                &store,
                &[("tenant", "t1"), ("remote_address", "10.0.0.9")],
                3
            ),
            3
        );
        // Shadow mode: never refuses.
        assert_eq!(
            admitted(
                &bundle,
                &store,
                &[("generic_key", "login"), ("remote_address", "10.0.0.1")],
                9
            ),
            9
        );
        let names: Vec<&str> = bundle.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "edge.tenant_vip",
                "edge.tenant_internal",
                "per-tenant",
                "edge.plan_free",
                "edge.plan",
                "edge.remote_address",
                "edge.plan_free.path",
                "edge.route_/v1/*",
                "edge.generic_key_login.remote_address"
            ]
        );
        let login = bundle
            .rule("edge.generic_key_login.remote_address")
            .unwrap();
        assert_eq!(login.mode, crate::policy::Mode::Shadow);
    }

    #[test]
    fn says_what_it_could_not_map() {
        let notes = import().notes;
        assert_eq!(notes.len(), 4, "{notes:#?}");
        assert!(notes[0].starts_with("descriptors[4].descriptors[0]: detailed_metric"));
        assert!(notes[1].starts_with("descriptors[5]: rate_limit.unit \"fortnight\""));
        assert!(notes[2].starts_with("descriptors[8]: value \"/v1/*\" is matched literally"));
        assert!(notes[3].starts_with("descriptors[2]: unlimited, mapped to a rule of 1000000000"));
        // A value next to a bare key with nested limits.
        let config: RatelimitConfig = serde_yaml_ng::from_str(
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    descriptors:\n      - key: x\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .unwrap();
        let notes = envoy_ratelimit(&config).unwrap().notes;
        assert_eq!(notes.len(), 1, "{notes:#?}");
        assert!(notes[0].starts_with("descriptors[0]: key \"k\" value \"v\" next to bare key \"k\" with nested limits (descriptors[1])"));
    }
}
