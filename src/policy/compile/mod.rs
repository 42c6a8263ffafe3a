//! JSON → [`Bundle`]. Walks a `serde_json::Value` by hand instead of deriving `Deserialize`, so
//! that *every* problem is reported with its JSON path in one pass (serde stops at the first),
//! and so that no input — wrong types, huge numbers, unknown fields — can panic.

pub(crate) mod compiler;
mod fields;
pub mod key_override;

use crate::limits::LimitKind;
use crate::policy::bundle::{Bundle, RuntimeOverride, SkippedPolicy};
use crate::policy::error::FieldError;
use crate::policy::json::{join, type_name};
use crate::policy::rule::{
    KillSwitch, MatchCondition, MatchValue, Mode, OnMissing, OnStoreError, Policy, Rule, RuleKind,
    Selector,
};
use crate::request::descriptor::{Descriptor, IpNet};
use compiler::{headers_read, key_prefix, plain_rule, Compiler, CONFIG_FIELDS};
use serde_json::{Map, Value};

/// Compiles a parsed bundle.
///
/// # Errors
/// Every validation error, each with its JSON path.
pub fn compile_bundle(root: &Value, default_id: &str) -> Result<Bundle, Vec<FieldError>> {
    compile_bundle_with(root, default_id, CompileOptions::default())
}

/// How strictly a bundle is compiled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileOptions {
    /// Leave out a policy with errors (listed in [`Bundle::skipped`]) instead of refusing the
    /// bundle, as Fairvisor's loader does. Errors outside policies still refuse it.
    pub skip_invalid_policies: bool,
    /// A candidate bundle, decided in shadow beside the live one: every bucket, slot and mark
    /// of its rules is named under `candidate:`, so it never touches the live bundle's.
    pub candidate: bool,
}

/// [`compile_bundle`] with options.
///
/// # Errors
/// Every validation error, each with its JSON path.
pub fn compile_bundle_with(
    root: &Value,
    default_id: &str,
    options: CompileOptions,
) -> Result<Bundle, Vec<FieldError>> {
    let mut c = Compiler {
        skip_invalid: options.skip_invalid_policies,
        ..Compiler::default()
    };
    c.bundle(root, default_id);
    if !c.errors.is_empty() {
        return Err(c.errors);
    }
    let shadow_twin = match &c.global_shadow {
        Some(_) => {
            let mut twin = Compiler {
                skip_invalid: options.skip_invalid_policies,
                force_shadow: true,
                ..Compiler::default()
            };
            twin.bundle(root, default_id);
            Some(Box::new(twin.finish()))
        }
        None => None,
    };
    let mut bundle = c.finish();
    bundle.shadow_twin = shadow_twin.map(|mut twin| {
        twin.key_quotas = std::sync::Arc::clone(&bundle.key_quotas);
        twin
    });
    if options.candidate {
        bundle.make_candidate();
    }
    Ok(bundle)
}

/// The quota fields a runtime override of `rule` may set, by its kind (`None`: its kind takes
/// no override): the kinds' compile halves answer, through this file as every other call of
/// the compiler into them.
pub(crate) fn key_override_fields(rule: &Rule) -> Option<&'static [&'static str]> {
    crate::limits::key_override_fields(rule)
}

impl Compiler {
    /// A runtime override's quota over `rule`'s own, compiled by the rule's kind.
    pub(crate) fn key_override_quota(
        &mut self,
        fields: &Map<String, Value>,
        rule: &Rule,
    ) -> Option<crate::limits::limiter::Quota> {
        crate::limits::key_override_quota(self, fields, rule)
    }
}

/// The hash of a JSON value as written (two equal texts hash alike), seeded with `seed`.
pub(crate) fn definition_hash(seed: u64, v: &Value) -> u64 {
    let text = serde_json::to_vec(v).unwrap_or_default();
    twox_hash::XxHash3_64::oneshot_with_seed(seed, &text)
}

/// An `llm_spend` rule's `RateLimit-Policy` item up to its window: `q` in millionths of the
/// currency, exactly.
fn spend_quota_item(name: &str, quota: &crate::limits::limiter::Quota) -> String {
    let mut item = String::new();
    crate::policy::rule::push_sf_string(&mut item, name);
    format!("{item};q={}", quota.burst())
}

/// What an unnamed `fallback_limit` is called.
const FALLBACK_NAME: &str = "fallback_limit";

/// The fields of a rule.
const RULE_FIELDS: &[&str] = &[
    "name",
    "limit_keys",
    "algorithm",
    "algorithm_config",
    "match",
    "on_missing",
    "on_store_error",
    "overrides",
    "description",
];

impl Compiler {
    /// The bundle of a compile that found no error.
    pub(crate) fn finish(mut self) -> Bundle {
        // Held for the bundle's whole life: no room left over from growing while compiling.
        self.policies.shrink_to_fit();
        self.rules.shrink_to_fit();
        self.kill_switches.shrink_to_fit();
        let fingerprints_bodies = self.policies.iter().any(|p| p.loop_detection.is_some());
        let network = |d: &Descriptor| matches!(d, Descriptor::Network(_));
        let uses_network = self.rules.iter().any(|r| {
            r.limit_keys.iter().any(network) || r.conditions.iter().any(|c| network(&c.descriptor))
        }) || self.kill_switches.iter().any(|k| network(&k.scope));
        let meters_tokens = self.policies.iter().any(|p| p.meters_tokens);
        let counts_grpc_messages = self.rules.iter().any(Rule::counts_grpc_messages);
        let paces = self.rules.iter().any(|r| r.pacing.is_some());
        let tiktoken = self
            .rules
            .iter()
            .filter_map(|r| {
                match r
                    .llm()
                    .map(|l| l.estimator)
                    .or(r.spend().map(|s| s.estimator))
                {
                    Some(crate::request::llm::Estimator::Tiktoken(encoding)) => {
                        Some(encoding.bit())
                    }
                    _ => None,
                }
            })
            .fold(0, |set, bit| set | bit);
        let index = crate::policy::index::BundleIndex::build(
            &self.policies,
            &self.rules,
            &self.kill_switches,
        );
        Bundle {
            version: self.version,
            expires_at: self.expires_at,
            hash: String::new(),
            sha256: String::new(),
            policies: self.policies,
            rules: self.rules,
            kill_switches: self.kill_switches,
            warnings: self.warnings,
            long_lived_keys: self.long_lived_keys,
            envoy_override: Rule::envoy_override(),
            global_shadow: self.global_shadow,
            kill_switch_override: self.kill_switch_override,
            shadow_twin: None,
            fingerprints_bodies,
            uses_network,
            meters_tokens,
            counts_grpc_messages,
            paces,
            skipped: self.skipped,
            index,
            tiktoken,
            llm_prices: self.llm_prices.map(std::sync::Arc::new),
            key_quotas: std::sync::Arc::default(),
        }
    }

    /// A `global_shadow` / `kill_switch_override` block: `enabled` (boolean, required); when
    /// true, a non-empty `reason` of at most 256 bytes and an `expires_at`.
    pub(crate) fn runtime_override(&mut self, v: &Value, path: &str) -> Option<RuntimeOverride> {
        let map = self.object(v, path, &["enabled", "reason", "expires_at"])?;
        match map.get("enabled") {
            Some(Value::Bool(true)) => {}
            Some(Value::Bool(false)) => return None,
            Some(_) => {
                self.error(&join(path, "enabled"), "must be true or false");
                return None;
            }
            None => {
                self.error(&join(path, "enabled"), "is required");
                return None;
            }
        }
        let reason = match map.get("reason") {
            Some(v) => self.non_empty_string(v, &join(path, "reason")),
            None => {
                self.error(&join(path, "reason"), "is required when enabled");
                None
            }
        };
        if reason.is_some_and(|r| r.len() > 256) {
            self.error(&join(path, "reason"), "must be at most 256 bytes");
            return None;
        }
        let expires_at = match map.get("expires_at") {
            Some(v) => self.time(v, &join(path, "expires_at")),
            None => {
                self.error(
                    &join(path, "expires_at"),
                    "is required when enabled (an override always ends)",
                );
                None
            }
        };
        Some(RuntimeOverride {
            reason: reason?.to_string(),
            expires_at: expires_at?,
        })
    }

    pub(crate) fn bundle(&mut self, root: &Value, default_id: &str) {
        let Some(map) = root.as_object() else {
            self.error(
                "",
                format!("a bundle must be a JSON object, found {}", type_name(root)),
            );
            return;
        };
        if map.contains_key("policies") || map.contains_key("bundle_version") {
            let Some(map) = self.object(
                root,
                "",
                &[
                    "bundle_version",
                    "policies",
                    "kill_switches",
                    "issued_at",
                    "expires_at",
                    "description",
                    "defaults",
                    "global_shadow",
                    "kill_switch_override",
                    "llm_prices",
                ],
            ) else {
                return;
            };
            // Before the policies: their `llm_spend` rules are checked against it.
            if let Some(v) = map.get("llm_prices") {
                self.llm_prices = self.llm_prices(v, "llm_prices");
                self.llm_prices_written = true;
            }
            match map.get("bundle_version") {
                Some(v) => self.bundle_version(v),
                None => self.error("bundle_version", "is required"),
            }
            if let Some(v) = map.get("global_shadow") {
                self.global_shadow = self.runtime_override(v, "global_shadow");
            }
            if let Some(v) = map.get("kill_switch_override") {
                self.kill_switch_override = self.runtime_override(v, "kill_switch_override");
            }
            if let Some(v) = map.get("issued_at") {
                self.time(v, "issued_at");
            }
            if let Some(v) = map.get("expires_at") {
                self.expires_at = self.time(v, "expires_at");
            }
            if let Some(v) = map.get("defaults") {
                // Fairvisor accepts `defaults` and reads nothing from it; so does tollgate, and
                // says so rather than pretend it applied.
                if v.is_object() {
                    self.warn("defaults", "accepted and not used: write each setting on its rule (Fairvisor ignores it too)");
                } else {
                    self.error(
                        "defaults",
                        format!("must be an object, found {}", type_name(v)),
                    );
                }
            }
            match map.get("policies") {
                Some(v) => {
                    if let Some(items) = self.array(v, "policies") {
                        for (i, item) in items.iter().enumerate() {
                            let path = format!("policies[{i}]");
                            let errors_before = self.errors.len();
                            let (rules_before, policies_before) =
                                (self.rules.len(), self.policies.len());
                            self.policy(item, &path);
                            if self.skip_invalid && self.errors.len() > errors_before {
                                self.skip_policy(
                                    item,
                                    &path,
                                    errors_before,
                                    rules_before,
                                    policies_before,
                                );
                            }
                        }
                    }
                }
                None => self.error("policies", "is required"),
            }
            if let Some(v) = map.get("kill_switches") {
                if let Some(items) = self.array(v, "kill_switches") {
                    for (i, item) in items.iter().enumerate() {
                        self.kill_switch(item, &format!("kill_switches[{i}]"));
                    }
                }
            }
        } else if map.contains_key("rules") {
            let Some(map) = self.object(root, "", &["rules", "fallback_limit", "kill_switches"])
            else {
                return;
            };
            self.version = "0".to_string();
            let mode = if self.force_shadow {
                Mode::Shadow
            } else {
                Mode::Enforce
            };
            self.current_policy_definition =
                definition_hash(0, &serde_json::json!([default_id, self.force_shadow]));
            self.policy_body(map, "", default_id.to_string(), Selector::default(), mode);
            if let Some(v) = map.get("kill_switches") {
                if let Some(items) = self.array(v, "kill_switches") {
                    for (i, item) in items.iter().enumerate() {
                        self.kill_switch(item, &format!("kill_switches[{i}]"));
                    }
                }
            }
        } else {
            self.error(
                "",
                "expected a bundle with \"bundle_version\" and \"policies\", or a bare {\"rules\": [...]} list",
            );
        }
    }

    /// `bundle_version` as written: a non-negative integer, a number, or a non-empty string
    /// (Fairvisor bundles use all three).
    pub(crate) fn bundle_version(&mut self, v: &Value) {
        match v {
            Value::Number(n) if n.as_f64().is_some_and(|f| f.is_finite() && f >= 0.0) => {
                self.version = n.to_string();
            }
            Value::String(s)
                if !s.trim().is_empty() && s.len() <= 128 && !s.chars().any(char::is_control) =>
            {
                self.version = s.clone();
            }
            _ => self.error(
                "bundle_version",
                "must be a non-negative number or a non-empty string of at most 128 printable characters",
            ),
        }
    }

    /// Drops a policy that failed to compile (`--skip-invalid-policies`): its errors move to
    /// [`SkippedPolicy`], and its rules, names and id are forgotten, so the rest of the bundle
    /// compiles as if it had never been there.
    pub(crate) fn skip_policy(
        &mut self,
        item: &Value,
        path: &str,
        errors_before: usize,
        rules_before: usize,
        policies_before: usize,
    ) {
        let errors = self.errors.split_off(errors_before);
        self.rules.truncate(rules_before);
        self.long_lived_keys.retain(|(i, _)| *i < rules_before);
        self.policies.truncate(policies_before);
        let own = |p: &String| p == path || p.starts_with(&format!("{path}."));
        self.rule_names.retain(|_, p| !own(p));
        let id = item
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if self.policy_ids.contains(&id) && !self.skipped.iter().any(|s| s.id == id) {
            // A duplicate id is this policy's error: the first holder keeps it.
            if !errors
                .iter()
                .any(|e| e.message.starts_with("duplicate policy id"))
            {
                self.policy_ids.remove(&id);
            }
        }
        self.skipped.push(SkippedPolicy {
            path: path.to_string(),
            id,
            errors,
        });
    }

    pub(crate) fn policy(&mut self, v: &Value, path: &str) {
        let Some(map) = self.object(v, path, &["id", "spec", "version", "description"]) else {
            return;
        };
        let id = match map.get("id") {
            Some(v) => self
                .non_empty_string(v, &join(path, "id"))
                .map(str::to_string),
            None => {
                self.error(&join(path, "id"), "is required");
                None
            }
        };
        if let Some(id) = &id {
            if !self.policy_ids.insert(id.clone()) {
                self.error(&join(path, "id"), format!("duplicate policy id '{id}'"));
            }
        }
        let spec_path = join(path, "spec");
        let Some(spec_value) = map.get("spec") else {
            self.error(&spec_path, "is required");
            return;
        };
        let Some(spec) = self.object(
            spec_value,
            &spec_path,
            &[
                "selector",
                "mode",
                "rules",
                "fallback_limit",
                "loop_detection",
                "circuit_breaker",
                "description",
            ],
        ) else {
            return;
        };
        let selector = match spec.get("selector") {
            Some(v) => self.selector(v, &join(&spec_path, "selector")),
            None => Selector::default(),
        };
        let mode = match spec.get("mode") {
            _ if self.force_shadow => Mode::Shadow,
            None => Mode::Enforce,
            Some(v) => match v.as_str() {
                Some("enforce") => Mode::Enforce,
                Some("shadow") => Mode::Shadow,
                _ => {
                    self.error(
                        &join(&spec_path, "mode"),
                        "must be \"enforce\" or \"shadow\"",
                    );
                    Mode::Enforce
                }
            },
        };
        let context = serde_json::json!([
            map.get("id"),
            spec.get("selector"),
            spec.get("mode"),
            self.force_shadow
        ]);
        self.current_policy_definition = definition_hash(0, &context);
        self.policy_body(spec, &spec_path, id.unwrap_or_default(), selector, mode);
    }

    /// The `rules` and `fallback_limit` of a policy (or of a bare bundle).
    pub(crate) fn policy_body(
        &mut self,
        spec: &Map<String, Value>,
        path: &str,
        id: String,
        selector: Selector,
        mode: Mode,
    ) {
        let policy_index = self.policies.len();
        let start = self.rules.len();
        self.current_policy_id.clone_from(&id);
        let rules_path = join(path, "rules");
        match spec.get("rules") {
            Some(v) => {
                if let Some(items) = self.array(v, &rules_path) {
                    // An empty list is a policy that limits nothing (Fairvisor loads it too).
                    for (i, item) in items.iter().enumerate() {
                        self.rule(item, &format!("{rules_path}[{i}]"), policy_index, mode);
                    }
                }
            }
            None => self.error(&rules_path, "is required"),
        }
        let end = self.rules.len();
        let fallback = spec.get("fallback_limit").and_then(|v| {
            let before = self.rules.len();
            self.fallback_rule(v, &join(path, "fallback_limit"), policy_index, mode);
            (self.rules.len() > before).then_some(before)
        });
        let loop_detection = spec.get("loop_detection").and_then(|v| {
            self.loop_detection(v, &join(path, "loop_detection"), policy_index, mode, start)
        });
        let circuit_breaker = spec.get("circuit_breaker").and_then(|v| {
            self.circuit_breaker(v, &join(path, "circuit_breaker"), policy_index, mode, start)
        });
        let metered = |r: &Rule| r.llm().is_some() || r.spend().is_some();
        let meters_tokens = self.rules[start..].iter().any(metered);
        let enforces_tokens = self.rules[start..]
            .iter()
            .any(|r| metered(r) && r.mode == Mode::Enforce);
        let day_rule_paths = std::mem::take(&mut self.day_rule_paths);
        for (minute, mut day) in std::mem::take(&mut self.day_rules) {
            day.index = self.rules.len();
            day.definition = self.rules[minute].definition;
            if let RuleKind::Llm(llm) = &mut self.rules[minute].kind {
                llm.day_rule = Some(day.index);
            }
            if let Some((_, path)) = day_rule_paths.iter().find(|(m, _)| *m == minute) {
                self.long_lived_keys.push((day.index, path.clone()));
            }
            self.rules.push(day);
        }
        // Rules carry their policy's id, so headers, logs and metrics need nothing else.
        for rule in &mut self.rules[start..] {
            rule.policy_id.clone_from(&id);
        }
        self.policies.push(Policy {
            id,
            selector,
            mode,
            rules: start..end,
            fallback,
            loop_detection,
            circuit_breaker,
            meters_tokens,
            enforces_tokens,
        });
    }

    pub(crate) fn selector(&mut self, v: &Value, path: &str) -> Selector {
        let mut selector = Selector::default();
        let Some(map) = self.object(
            v,
            path,
            &["pathPrefix", "pathExact", "methods", "hosts", "domains"],
        ) else {
            return selector;
        };
        if let Some(v) = map.get("pathPrefix") {
            let p = join(path, "pathPrefix");
            if let Some(s) = self.string(v, &p) {
                if !s.starts_with('/') {
                    self.error(&p, "must start with '/'");
                } else {
                    let trimmed = s.trim_end_matches('/');
                    selector.path_prefix = Some(if trimmed.is_empty() {
                        "/".into()
                    } else {
                        trimmed.into()
                    });
                }
            }
        }
        if let Some(v) = map.get("pathExact") {
            let p = join(path, "pathExact");
            if let Some(s) = self.string(v, &p) {
                if !s.starts_with('/') {
                    self.error(&p, "must start with '/'");
                } else {
                    selector.path_exact = Some(s.to_string());
                }
            }
        }
        if let Some(v) = map.get("methods") {
            let p = join(path, "methods");
            if let Some(list) = self.string_list(v, &p) {
                if list.is_empty() {
                    self.warn(
                        &p,
                        "is empty: this policy matches no request (omit it to match every method)",
                    );
                }
                selector.methods = Some(list.into_iter().map(|m| m.to_ascii_uppercase()).collect());
            }
        }
        if let Some(v) = map.get("hosts") {
            let p = join(path, "hosts");
            if let Some(list) = self.string_list(v, &p) {
                if list.is_empty() {
                    self.error(&p, "must not be empty (omit it to match every host)");
                }
                selector.hosts = Some(
                    list.into_iter()
                        .map(|h| crate::request::descriptor::strip_port(&h).to_ascii_lowercase())
                        .collect(),
                );
            }
        }
        if let Some(v) = map.get("domains") {
            let p = join(path, "domains");
            if let Some(list) = self.string_list(v, &p) {
                if list.is_empty() {
                    self.error(&p, "must not be empty (omit it to match every domain)");
                }
                selector.domains = Some(list);
            }
        }
        selector
    }

    pub(crate) fn descriptor(&mut self, v: &Value, path: &str) -> Option<Descriptor> {
        let text = self.non_empty_string(v, path)?;
        match Descriptor::parse(text) {
            Ok(d) => Some(d),
            Err(e) => {
                self.error(path, e.to_string());
                None
            }
        }
    }

    /// A policy's `fallback_limit`. Its `name` may be left out, as Fairvisor allows: it is then
    /// called `fallback_limit`, or `fallback_limit@<policy id>` when another policy's unnamed
    /// fallback took that name first (rule names are bucket namespaces).
    pub(crate) fn fallback_rule(&mut self, v: &Value, path: &str, policy: usize, mode: Mode) {
        match v.as_object() {
            Some(map) if !map.contains_key("name") => {
                let mut named = map.clone();
                let name = self.unclaimed_name(FALLBACK_NAME);
                named.insert("name".into(), Value::String(name));
                self.rule(&Value::Object(named), path, policy, mode);
            }
            _ => self.rule(v, path, policy, mode),
        }
    }

    /// A rule's `match`: descriptor → expected value (an address or network for `ip:address`,
    /// the JSON text of a number or boolean).
    fn conditions(&mut self, v: &Value, path: &str) -> Vec<MatchCondition> {
        let mut conditions = Vec::new();
        if !v.is_object() {
            self.error(path, format!("must be an object, found {}", type_name(v)));
        }
        if let Some(entries) = v.as_object() {
            for (key, expected) in entries {
                let ep = format!("{path}.{key}");
                let descriptor = match Descriptor::parse(key) {
                    Ok(d) => d,
                    Err(e) => {
                        self.error(&ep, e.to_string());
                        continue;
                    }
                };
                // Numbers and booleans compare as their JSON text (`42` matches "42").
                let text = match expected {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    Value::Bool(b) => b.to_string(),
                    other => {
                        self.error(
                            &ep,
                            format!(
                                "must be a string, number or boolean, found {}",
                                type_name(other)
                            ),
                        );
                        continue;
                    }
                };
                let expected = match &descriptor {
                    Descriptor::Ip { .. } => match IpNet::parse(&text) {
                        Some(net) => MatchValue::Network(net),
                        None => {
                            self.error(&ep, "must be an IP address or CIDR network");
                            continue;
                        }
                    },
                    Descriptor::LlmModel if text.contains('*') => MatchValue::Pattern(text),
                    _ => MatchValue::Text(text),
                };
                conditions.push(MatchCondition {
                    descriptor,
                    expected,
                });
            }
        }
        conditions
    }

    /// One rule: what every kind shares (name, `limit_keys`, `match`, `on_missing`, overrides,
    /// the headers it reads) here, its `algorithm_config` by its kind's module. Every problem
    /// is reported in one pass, in the order of the fields below.
    pub(crate) fn rule(&mut self, v: &Value, path: &str, policy: usize, mode: Mode) {
        let Some(map) = self.object(v, path, RULE_FIELDS) else {
            return;
        };
        let errors_before = self.errors.len();
        let name = self.rule_name(map, path);
        let limit_keys = self.limit_keys(map, path);
        let conditions = map
            .get("match")
            .map_or_else(Vec::new, |v| self.conditions(v, &join(path, "match")));
        let on_missing = self.on_missing(map, path);
        let on_store_error = self.on_store_error(map, path);
        let algorithm = self.algorithm(map, path);
        let config_path = join(path, "algorithm_config");
        let Some(config) = self.algorithm_config(map, &config_path, algorithm) else {
            return;
        };
        // An unknown algorithm is an error already; its config is still checked as a token
        // bucket's, so every other problem is reported in the same pass.
        let kind = algorithm.unwrap_or(LimitKind::TokenBucket);
        let parts = self.kind_config(kind, config, path, map.contains_key("overrides"));
        let (overrides, ip_overrides) = self.overrides(
            (map, config),
            (path, &config_path),
            parts.shape,
            &limit_keys,
        );
        if self.errors.len() > errors_before {
            return;
        }
        let (Some(name), Some(shape), Some(cost)) = (name, parts.shape, parts.cost) else {
            return;
        };
        if on_missing == OnMissing::Skip {
            self.warn_header_skipped(&name, &limit_keys, path);
        }
        let mut header_names = headers_read(
            limit_keys
                .iter()
                .chain(conditions.iter().map(|c| &c.descriptor)),
            &cost,
        );
        if let RuleKind::Llm(limit) = &parts.kind {
            self.llm_companions(
                (limit, parts.tokens_per_day),
                (&name, policy, mode),
                &mut header_names,
                (&limit_keys, &conditions, on_missing),
            );
        }
        let window_secs = match &parts.kind {
            RuleKind::Budget(b)
            | RuleKind::Spend(crate::policy::rule::SpendLimit { budget: b, .. }) => {
                b.period.nominal_secs()
            }
            _ => shape.quota.window_secs(),
        };
        let keys_path: Box<str> = join(path, "limit_keys").into();
        if self
            .day_rules
            .last()
            .is_some_and(|(m, _)| *m == self.rules.len())
        {
            self.day_rule_paths
                .push((self.rules.len(), keys_path.clone()));
        }
        let index = self.rules.len();
        let spend_item = matches!(parts.kind, RuleKind::Spend(_))
            .then(|| format!("{};w={window_secs}", spend_quota_item(&name, &shape.quota)));
        self.rules.push(Rule {
            index,
            limit_keys,
            conditions,
            cost,
            overrides,
            ip_overrides,
            on_missing,
            on_store_error,
            key_prefix: key_prefix(kind.key_tag(), &name, mode),
            header_names,
            kind: parts.kind,
            pacing: parts.pacing,
            definition: definition_hash(self.current_policy_definition, v),
            after_response: parts.after_response,
            burst_from: parts.burst_from,
            ..plain_rule(name, policy, mode, shape.quota, window_secs)
        });
        if let (Some(item), Some(rule)) = (spend_item, self.rules.last_mut()) {
            rule.policy_item = item;
        }
        if self
            .rules
            .last()
            .is_some_and(|r| crate::policy::key_origin::long_lived(r).is_some())
        {
            self.long_lived_keys.push((index, keys_path));
        }
    }

    /// A rule's `name`: required, non-empty, unique across the bundle (it is the namespace of
    /// its buckets).
    fn rule_name(&mut self, map: &Map<String, Value>, path: &str) -> Option<String> {
        let name = match map.get("name") {
            Some(v) => self
                .non_empty_string(v, &join(path, "name"))
                .map(str::to_string),
            None => {
                self.error(&join(path, "name"), "is required");
                None
            }
        };
        if let Some(name) = &name {
            if let Some(first) = self.rule_names.get(name).cloned() {
                self.error(
                    &join(path, "name"),
                    format!("duplicate rule name '{name}' (first defined at {first}); rule names are bucket namespaces and must be unique across the bundle"),
                );
            } else {
                self.rule_names.insert(name.clone(), join(path, "name"));
            }
        }
        name
    }

    /// A rule's `limit_keys` (required; `[]` for one global bucket).
    fn limit_keys(&mut self, map: &Map<String, Value>, path: &str) -> Vec<Descriptor> {
        let mut limit_keys = Vec::new();
        let p = join(path, "limit_keys");
        match map.get("limit_keys") {
            Some(v) => {
                if let Some(items) = self.array(v, &p) {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(d) = self.descriptor(item, &format!("{p}[{i}]")) {
                            limit_keys.push(d);
                        }
                    }
                }
            }
            None => self.error(&p, "is required (use [] for one global bucket)"),
        }
        limit_keys
    }

    /// A rule's `on_missing` (default `skip`).
    fn on_missing(&mut self, map: &Map<String, Value>, path: &str) -> OnMissing {
        let Some(v) = map.get("on_missing") else {
            return OnMissing::Skip;
        };
        match v.as_str() {
            Some("skip") => OnMissing::Skip,
            Some("shared") => OnMissing::Shared,
            Some("reject") => OnMissing::Reject,
            _ => {
                self.error(
                    &join(path, "on_missing"),
                    "must be \"skip\", \"shared\" or \"reject\"",
                );
                OnMissing::Skip
            }
        }
    }

    /// A rule's `on_store_error` (`None`: the gateway's `--on-store-error`).
    fn on_store_error(&mut self, map: &Map<String, Value>, path: &str) -> Option<OnStoreError> {
        let v = map.get("on_store_error")?;
        let mode = v.as_str().and_then(OnStoreError::parse);
        if mode.is_none() {
            self.error(
                &join(path, "on_store_error"),
                "must be \"local\", \"open\" or \"closed\"",
            );
        }
        mode
    }

    /// A rule's `algorithm`: the kind of limit it is (required).
    fn algorithm(&mut self, map: &Map<String, Value>, path: &str) -> Option<LimitKind> {
        let Some(v) = map.get("algorithm") else {
            self.error(
                &join(path, "algorithm"),
                "is required (\"token_bucket\" or \"cost_based\")",
            );
            return None;
        };
        let a = self.string(v, &join(path, "algorithm"))?;
        let kind = LimitKind::named(a);
        if kind.is_none() {
            self.error(
                &join(path, "algorithm"),
                format!("unknown algorithm '{a}' (supported: token_bucket, cost_based, concurrency, token_bucket_llm, llm_spend)"),
            );
        }
        kind
    }

    /// A rule's `algorithm_config` (required), with the fields its kind allows (a token
    /// bucket's when the algorithm is unknown).
    fn algorithm_config<'v>(
        &mut self,
        map: &'v Map<String, Value>,
        config_path: &str,
        algorithm: Option<LimitKind>,
    ) -> Option<&'v Map<String, Value>> {
        let allowed = algorithm.map_or(CONFIG_FIELDS, LimitKind::config_fields);
        match map.get("algorithm_config") {
            Some(v) => self.object(v, config_path, allowed),
            None => {
                self.error(config_path, "is required");
                None
            }
        }
    }

    /// Warns of a rule keyed on a client-supplied header with `on_missing: skip`: leaving the
    /// header out escapes the rule.
    fn warn_header_skipped(&mut self, name: &str, limit_keys: &[Descriptor], path: &str) {
        if let Some(header) = limit_keys.iter().find_map(|d| match d {
            Descriptor::Header(h) => Some(h),
            _ => None,
        }) {
            self.warn(
                &join(path, "on_missing"),
                format!("rule '{name}' is keyed on the client-supplied header '{header}' with on_missing \"skip\": a client that leaves the header out is not limited by this rule at all; use \"shared\" (one bucket for every request without it) or \"reject\" (401)"),
            );
        }
    }

    pub(crate) fn kill_switch(&mut self, v: &Value, path: &str) {
        let Some(map) = self.object(
            v,
            path,
            &["scope_key", "scope_value", "route", "reason", "expires_at"],
        ) else {
            return;
        };
        let errors_before = self.errors.len();
        let scope = match map.get("scope_key") {
            Some(v) => self.descriptor(v, &join(path, "scope_key")),
            None => {
                self.error(&join(path, "scope_key"), "is required");
                None
            }
        };
        let value = match map.get("scope_value") {
            Some(Value::Number(n)) => Some(n.to_string()),
            Some(v) => self
                .non_empty_string(v, &join(path, "scope_value"))
                .map(str::to_string),
            None => {
                self.error(&join(path, "scope_value"), "is required");
                None
            }
        };
        let route = map.get("route").and_then(|v| {
            let p = join(path, "route");
            let s = self.string(v, &p)?;
            if !s.starts_with('/') {
                self.error(&p, "must start with '/'");
                return None;
            }
            let trimmed = s.trim_end_matches('/');
            Some(if trimmed.is_empty() {
                "/".to_string()
            } else {
                trimmed.to_string()
            })
        });
        let reason = match map.get("reason") {
            Some(v) => self
                .string(v, &join(path, "reason"))
                .unwrap_or_default()
                .to_string(),
            None => String::new(),
        };
        let reason = match self.kill_switches.last() {
            Some(previous) if *previous.reason == *reason => {
                std::sync::Arc::clone(&previous.reason)
            }
            _ => std::sync::Arc::from(reason),
        };
        let expires_at = map
            .get("expires_at")
            .and_then(|v| self.time(v, &join(path, "expires_at")));
        if self.errors.len() > errors_before {
            return;
        }
        if let (Some(scope), Some(value)) = (scope, value) {
            // Hosts compare case-insensitively (the request side is lower-cased).
            let value = if scope == Descriptor::Host {
                value.to_ascii_lowercase()
            } else {
                value
            };
            // Shared with the previous switch when it has the same scope (a block list of
            // 100 000 keys usually has one): 40 bytes less per switch.
            let scope = match self.kill_switches.last() {
                Some(previous) if *previous.scope == scope => {
                    std::sync::Arc::clone(&previous.scope)
                }
                _ => std::sync::Arc::new(scope),
            };
            self.kill_switches.push(KillSwitch {
                scope,
                value: value.into(),
                route: route.map(String::into_boxed_str),
                reason,
                expires_at,
            });
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
