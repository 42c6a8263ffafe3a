//! JSON → [`Bundle`]. Walks a `serde_json::Value` by hand instead of deriving `Deserialize`, so
//! that *every* problem is reported with its JSON path in one pass (serde stops at the first),
//! and so that no input — wrong types, huge numbers, unknown fields — can panic.

use super::{
    canonical_id, Bundle, CostSource, FieldError, KillSwitch, LlmLimit, LlmPart, MatchCondition,
    MatchValue, Mode, OnMissing, Policy, PolicyError, Rule, RuntimeOverride, Selector,
    SkippedPolicy,
};
use crate::descriptor::{Descriptor, IpNet};
use crate::limiter::{Quota, MICRO};
use ahash::{AHashMap, AHashSet};
use serde_json::{Map, Value};
use std::net::IpAddr;
use std::path::Path;

/// Largest accepted burst, rate or cost, in tokens: keeps every micro-token amount and product
/// far inside 64-bit integers (and inside the 2^53 exact range of Lua and PostgreSQL doubles).
pub(crate) const MAX_AMOUNT: f64 = 1e9;
/// Smallest accepted amount: one micro-token.
pub(crate) const MIN_AMOUNT: f64 = 1e-6;

/// Reads, parses and compiles a bundle file. The bare `{"rules": [...]}` form takes the file
/// stem as its policy id.
///
/// # Errors
/// The file cannot be read, is not JSON, or fails validation (all errors listed).
pub fn load_file(path: &Path) -> Result<Bundle, PolicyError> {
    load_file_with(path, CompileOptions::default())
}

/// Loads a bundle the gateway can put in force at `unix_secs`: [`load_file_with`], then
/// [`Bundle::check_current`] (an expired bundle or override is an error naming the file).
///
/// # Errors
/// As [`load_file_with`], or something in the bundle has expired.
pub fn load_current(
    path: &Path,
    options: CompileOptions,
    unix_secs: i64,
) -> Result<Bundle, PolicyError> {
    let bundle = load_file_with(path, options)?;
    bundle
        .check_current(unix_secs)
        .map_err(|errors| PolicyError::Invalid {
            file: path.to_path_buf(),
            errors,
        })?;
    Ok(bundle)
}

/// [`load_file`] with options.
///
/// # Errors
/// The file cannot be read, is not JSON, or fails validation (all errors listed).
pub fn load_file_with(path: &Path, options: CompileOptions) -> Result<Bundle, PolicyError> {
    let bytes = std::fs::read(path).map_err(|source| PolicyError::Io {
        file: path.to_path_buf(),
        source,
    })?;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "policy".to_string());
    parse_bundle_with(&bytes, &stem, options).map_err(|e| match e {
        PolicyError::Json {
            line,
            column,
            message,
            ..
        } => PolicyError::Json {
            file: path.to_path_buf(),
            line,
            column,
            message,
        },
        PolicyError::Invalid { errors, .. } => PolicyError::Invalid {
            file: path.to_path_buf(),
            errors,
        },
        other => other,
    })
}

/// Parses and compiles bundle bytes; `default_id` names a bare rule list's policy.
///
/// # Errors
/// Not JSON, or invalid (every error with its JSON path).
pub fn parse_bundle(bytes: &[u8], default_id: &str) -> Result<Bundle, PolicyError> {
    parse_bundle_with(bytes, default_id, CompileOptions::default())
}

/// [`parse_bundle`] with options.
///
/// # Errors
/// Not JSON, or invalid (every error with its JSON path).
pub fn parse_bundle_with(
    bytes: &[u8],
    default_id: &str,
    options: CompileOptions,
) -> Result<Bundle, PolicyError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| PolicyError::Json {
        file: "<input>".into(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let mut bundle = compile_bundle_with(&value, default_id, options).map_err(|errors| {
        PolicyError::Invalid {
            file: "<input>".into(),
            errors,
        }
    })?;
    bundle.hash = format!("{:016x}", twox_hash::XxHash3_64::oneshot(bytes));
    if let Some(twin) = bundle.shadow_twin.as_mut() {
        twin.hash.clone_from(&bundle.hash);
    }
    Ok(bundle)
}

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
    bundle.shadow_twin = shadow_twin;
    Ok(bundle)
}

/// The bundle compiler: walks the JSON once, collecting every error with its path. Each limit
/// kind compiles its own fields in its module under [`crate::limits`].
#[derive(Default)]
pub(crate) struct Compiler {
    pub(crate) errors: Vec<FieldError>,
    pub(crate) warnings: Vec<FieldError>,
    pub(crate) version: String,
    pub(crate) expires_at: Option<i64>,
    /// `--skip-invalid-policies`: a policy with errors is dropped instead of failing the bundle.
    pub(crate) skip_invalid: bool,
    pub(crate) skipped: Vec<SkippedPolicy>,
    /// The id of the policy being compiled (names an unnamed fallback).
    pub(crate) current_policy_id: String,
    /// Compile every policy as shadow (the `global_shadow` twin).
    pub(crate) force_shadow: bool,
    pub(crate) global_shadow: Option<RuntimeOverride>,
    pub(crate) kill_switch_override: Option<RuntimeOverride>,
    pub(crate) policies: Vec<Policy>,
    pub(crate) rules: Vec<Rule>,
    pub(crate) kill_switches: Vec<KillSwitch>,
    /// Rule name → path of its first definition.
    pub(crate) rule_names: AHashMap<String, String>,
    /// `tokens_per_day` rules of the policy being compiled, with the index of their minute
    /// rule: added after the policy's rules, outside its range.
    pub(crate) day_rules: Vec<(usize, Rule)>,
    pub(crate) policy_ids: AHashSet<String>,
}

use super::json::{join, type_name};
use crate::limits::{KindParts, LimitKind};

/// A name as a key segment: `:` and `\` escaped, so the name ends at the first unescaped `:`
/// and rule `a` with key `b:c` can never share a bucket with rule `a:b` and key `c`.
pub(crate) fn escape_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, ':' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A rule's key prefix: `<kind>:<escaped name>:`, under `shadow:` for a shadow rule.
pub(crate) fn key_prefix(kind: &str, name: &str, mode: Mode) -> String {
    let escaped = escape_name(name);
    match mode {
        Mode::Enforce => format!("{kind}:{escaped}:"),
        Mode::Shadow => format!("shadow:{kind}:{escaped}:"),
    }
}

/// Lower-case names of the request headers a rule reads (its descriptors and its cost), once
/// each: a request repeating one of them is refused rather than limited on a guess.
pub(crate) fn headers_read<'d>(
    descriptors: impl Iterator<Item = &'d Descriptor>,
    cost: &CostSource,
) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let read = descriptors
        .filter_map(|d| match d {
            Descriptor::Header(h) => Some(h.clone()),
            _ => None,
        })
        .chain(match cost {
            CostSource::Header { name, .. } => Some(name.clone()),
            _ => None,
        });
    for h in read {
        if !names.contains(&h) {
            names.push(h);
        }
    }
    names
}

/// A rule's name as a structured-field string, and its `RateLimit-Policy` item
/// (`"name";q=<burst>;w=<window_secs>`), serialised once at load.
/// A rule with its name, owner, mode and quota, and nothing else yet: no keys, conditions,
/// overrides or kind-specific part. Each limit kind fills in what it has with struct update
/// syntax (`Rule { guard: Some(..), ..plain_rule(..) }`). `window_secs` is what its
/// `RateLimit-Policy` item states as the window.
pub(crate) fn plain_rule(
    name: String,
    policy: usize,
    mode: Mode,
    quota: Quota,
    window_secs: u64,
) -> Rule {
    let (sf_name, policy_item) = policy_item(&name, &quota, window_secs);
    Rule {
        index: 0,
        sf_name,
        policy_item,
        name,
        policy,
        policy_id: String::new(),
        mode,
        limit_keys: Vec::new(),
        conditions: Vec::new(),
        quota,
        cost: CostSource::Fixed(0),
        overrides: AHashMap::new(),
        ip_overrides: Vec::new(),
        on_missing: OnMissing::Shared,
        key_prefix: String::new(),
        header_names: Vec::new(),
        budget: None,
        concurrency: None,
        guard: None,
        llm: None,
    }
}

pub(crate) fn policy_item(name: &str, quota: &Quota, window_secs: u64) -> (String, String) {
    let mut sf_name = String::with_capacity(name.len() + 2);
    super::push_sf_string(&mut sf_name, name);
    let item = format!("{sf_name};q={};w={window_secs}", quota.burst() / MICRO);
    (sf_name, item)
}

/// What an unnamed `fallback_limit` is called.
const FALLBACK_NAME: &str = "fallback_limit";

/// The fields allowed in an `algorithm_config` (and, minus `overrides`, in an override).
pub(crate) const CONFIG_FIELDS: &[&str] = &[
    "tokens_per_second",
    "rps",
    "burst",
    "count",
    "period",
    "cost_source",
    "fixed_cost",
    "default_cost",
    "min_cost",
    "max_cost",
    "overrides",
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
        let tiktoken = self
            .rules
            .iter()
            .filter_map(|r| match r.llm.map(|l| l.estimator) {
                Some(crate::llm::Estimator::Tiktoken(encoding)) => Some(encoding.bit()),
                _ => None,
            })
            .fold(0, |set, bit| set | bit);
        let index =
            super::index::BundleIndex::build(&self.policies, &self.rules, &self.kill_switches);
        Bundle {
            version: self.version,
            expires_at: self.expires_at,
            hash: String::new(),
            policies: self.policies,
            rules: self.rules,
            kill_switches: self.kill_switches,
            warnings: self.warnings,
            envoy_override: super::Rule::envoy_override(),
            global_shadow: self.global_shadow,
            kill_switch_override: self.kill_switch_override,
            shadow_twin: None,
            fingerprints_bodies,
            uses_network,
            meters_tokens,
            skipped: self.skipped,
            index,
            tiktoken,
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

    pub(crate) fn error(&mut self, path: &str, message: impl Into<String>) {
        super::json::error(&mut self.errors, path, message);
    }

    pub(crate) fn warn(&mut self, path: &str, message: impl Into<String>) {
        self.warnings.push(FieldError {
            path: path.to_string(),
            message: message.into(),
        });
    }

    /// `v` as an object whose keys are all in `allowed`; unknown keys are errors.
    pub(crate) fn object<'v>(
        &mut self,
        v: &'v Value,
        path: &str,
        allowed: &[&str],
    ) -> Option<&'v Map<String, Value>> {
        super::json::object(&mut self.errors, v, path, allowed)
    }

    pub(crate) fn string<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v str> {
        super::json::string(&mut self.errors, v, path)
    }

    pub(crate) fn non_empty_string<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v str> {
        super::json::non_empty_string(&mut self.errors, v, path)
    }

    pub(crate) fn array<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v Vec<Value>> {
        match v.as_array() {
            Some(a) => Some(a),
            None => {
                self.error(path, format!("must be an array, found {}", type_name(v)));
                None
            }
        }
    }

    pub(crate) fn string_list(&mut self, v: &Value, path: &str) -> Option<Vec<String>> {
        let items = self.array(v, path)?;
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            match self.non_empty_string(item, &format!("{path}[{i}]")) {
                Some(s) => out.push(s.to_string()),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// A token amount in `[1e-6, 1e9]`.
    pub(crate) fn amount(&mut self, v: &Value, path: &str) -> Option<f64> {
        let Some(n) = v.as_f64() else {
            self.error(path, format!("must be a number, found {}", type_name(v)));
            return None;
        };
        if !n.is_finite() || n <= 0.0 {
            self.error(path, "must be > 0");
            return None;
        }
        if n < MIN_AMOUNT {
            self.error(path, "must be at least 0.000001");
            return None;
        }
        if n > MAX_AMOUNT {
            self.error(path, "must be at most 1000000000");
            return None;
        }
        Some(n)
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
                ],
            ) else {
                return;
            };
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

    /// An RFC 3339 time, as Unix seconds.
    pub(crate) fn time(&mut self, v: &Value, path: &str) -> Option<i64> {
        let s = self.string(v, path)?;
        match humantime::parse_rfc3339_weak(s) {
            Ok(t) => Some(
                t.duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs().min(i64::MAX as u64) as i64)
                    .unwrap_or(0),
            ),
            Err(_) => {
                self.error(
                    path,
                    "must be an RFC 3339 UTC time such as 2030-01-01T00:00:00Z",
                );
                None
            }
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
        let meters_tokens = self.rules[start..].iter().any(|r| r.llm.is_some());
        let enforces_tokens = self.rules[start..]
            .iter()
            .any(|r| r.llm.is_some() && r.mode == Mode::Enforce);
        for (minute, mut day) in std::mem::take(&mut self.day_rules) {
            day.index = self.rules.len();
            if let Some(llm) = self.rules[minute].llm.as_mut() {
                llm.day_rule = Some(day.index);
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
                        .map(|h| crate::descriptor::strip_port(&h).to_ascii_lowercase())
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

    /// `base`, or `base@<policy id>` when another policy's rule took `base` first (rule names
    /// are bucket namespaces: an unnamed fallback, a guard).
    pub(crate) fn unclaimed_name(&self, base: &str) -> String {
        if self.rule_names.contains_key(base) {
            format!("{base}@{}", self.current_policy_id)
        } else {
            base.to_string()
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

    pub(crate) fn rule(&mut self, v: &Value, path: &str, policy: usize, mode: Mode) {
        let Some(map) = self.object(
            v,
            path,
            &[
                "name",
                "limit_keys",
                "algorithm",
                "algorithm_config",
                "match",
                "on_missing",
                "overrides",
                "description",
            ],
        ) else {
            return;
        };
        let errors_before = self.errors.len();
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
        let mut limit_keys = Vec::new();
        match map.get("limit_keys") {
            Some(v) => {
                let p = join(path, "limit_keys");
                if let Some(items) = self.array(v, &p) {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(d) = self.descriptor(item, &format!("{p}[{i}]")) {
                            limit_keys.push(d);
                        }
                    }
                }
            }
            None => self.error(
                &join(path, "limit_keys"),
                "is required (use [] for one global bucket)",
            ),
        }
        let mut conditions = Vec::new();
        if let Some(v) = map.get("match") {
            let p = join(path, "match");
            if !v.is_object() {
                self.error(&p, format!("must be an object, found {}", type_name(v)));
            }
            if let Some(entries) = v.as_object() {
                for (key, expected) in entries {
                    let ep = format!("{p}.{key}");
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
                        _ => MatchValue::Text(text),
                    };
                    conditions.push(MatchCondition {
                        descriptor,
                        expected,
                    });
                }
            }
        }
        let on_missing = match map.get("on_missing") {
            None => OnMissing::Skip,
            Some(v) => match v.as_str() {
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
            },
        };
        let algorithm = match map.get("algorithm") {
            Some(v) => match self.string(v, &join(path, "algorithm")) {
                Some(a) if LimitKind::named(a).is_some() => LimitKind::named(a),
                Some(a) => {
                    self.error(
                        &join(path, "algorithm"),
                        format!("unknown algorithm '{a}' (supported: token_bucket, cost_based, concurrency, token_bucket_llm)"),
                    );
                    None
                }
                None => None,
            },
            None => {
                self.error(
                    &join(path, "algorithm"),
                    "is required (\"token_bucket\" or \"cost_based\")",
                );
                None
            }
        };
        let config_path = join(path, "algorithm_config");
        let allowed = algorithm.map_or(CONFIG_FIELDS, LimitKind::config_fields);
        let config = match map.get("algorithm_config") {
            Some(v) => self.object(v, &config_path, allowed),
            None => {
                self.error(&config_path, "is required");
                None
            }
        };
        let Some(config) = config else {
            return;
        };
        // An unknown algorithm is an error already; its config is still checked as a token
        // bucket's, so every other problem is reported in the same pass.
        let KindParts {
            shape,
            cost,
            budget,
            concurrency,
            llm,
        } = self.kind_config(
            algorithm.unwrap_or(LimitKind::TokenBucket),
            config,
            path,
            map.contains_key("overrides"),
        );
        let mut overrides = AHashMap::new();
        let mut ip_overrides: Vec<(IpNet, Quota)> = Vec::new();
        // `Some(explicit IPv6 prefix)` when the rule is keyed on the client address alone.
        let ip_keyed = match limit_keys.as_slice() {
            [Descriptor::Ip { v6_prefix }] => Some(*v6_prefix),
            _ => None,
        };
        let override_value = match (map.get("overrides"), config.get("overrides")) {
            (Some(_), Some(_)) => {
                self.error(
                    &join(path, "overrides"),
                    "set overrides either on the rule or in algorithm_config, not both",
                );
                None
            }
            (Some(v), None) => Some((v, join(path, "overrides"))),
            (None, Some(v)) => Some((v, join(&config_path, "overrides"))),
            (None, None) => None,
        };
        if let (Some((v, op)), Some(base)) = (override_value, shape) {
            if let Some(items) = self.array(v, &op) {
                for (i, item) in items.iter().enumerate() {
                    let ip = format!("{op}[{i}]");
                    let mut allowed: Vec<&str> = CONFIG_FIELDS[..5].to_vec();
                    allowed.push("ids");
                    let Some(omap) = self.object(item, &ip, &allowed) else {
                        continue;
                    };
                    let ids = match omap.get("ids") {
                        Some(v) => self.string_list(v, &join(&ip, "ids")),
                        None => {
                            self.error(&join(&ip, "ids"), "is required");
                            None
                        }
                    };
                    if ids.as_ref().is_some_and(|ids| ids.is_empty()) {
                        self.error(&join(&ip, "ids"), "must list at least one ID");
                    }
                    if let (Some(ids), Some(shape)) =
                        (ids, self.bucket_shape(omap, &ip, Some(&base)))
                    {
                        for id in ids {
                            let id = canonical_id(&id);
                            match (ip_keyed, IpNet::parse(&id)) {
                                // A network (or address) on a per-client-address rule: applies
                                // to every client inside it (see `Rule::quota_for`).
                                (Some(key_prefix), Some(net)) => {
                                    if let (Some(p), IpAddr::V6(_)) = (key_prefix, net.addr()) {
                                        if net.prefix() > p {
                                            self.error(
                                                &join(&ip, "ids"),
                                                format!("ID '{id}' is narrower than this rule's /{p} IPv6 keys: it would apply to the whole /{p} network; list that network instead"),
                                            );
                                            continue;
                                        }
                                    }
                                    if ip_overrides.iter().any(|(n, _)| *n == net) {
                                        self.error(
                                            &join(&ip, "ids"),
                                            format!("ID '{id}' is overridden more than once"),
                                        );
                                    }
                                    ip_overrides.push((net, shape.quota));
                                }
                                (Some(_), None) => {
                                    self.warn(
                                        &join(&ip, "ids"),
                                        format!("ID '{id}' can never equal this rule's keys (client addresses and networks)"),
                                    );
                                }
                                (None, _) => {
                                    if overrides.insert(id.clone(), shape.quota).is_some() {
                                        self.error(
                                            &join(&ip, "ids"),
                                            format!("ID '{id}' is overridden more than once"),
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // Most specific first: a /64 override wins over the /48 around it.
        ip_overrides.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix()));
        if self.errors.len() > errors_before {
            return;
        }
        let (Some(name), Some(shape), Some(cost)) = (name, shape, cost) else {
            return;
        };
        let kind = match (&budget, &concurrency, &llm) {
            (Some(_), _, _) => "cb",
            (_, Some(_), _) => "cc",
            (_, _, Some(_)) => "tpm",
            _ => "tb",
        };
        let key_prefix = key_prefix(kind, &name, mode);
        if on_missing == OnMissing::Skip {
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
        let mut header_names = headers_read(
            limit_keys
                .iter()
                .chain(conditions.iter().map(|c| &c.descriptor)),
            &cost,
        );
        if llm.is_some_and(|(l, _)| l.estimator == crate::llm::Estimator::HeaderHint) {
            header_names.push(crate::llm::TOKEN_ESTIMATE_HEADER.to_string());
        }
        if let Some((limit, Some(tpd))) = llm {
            let day = self.llm_day_rule(
                &name,
                policy,
                mode,
                tpd,
                LlmLimit {
                    part: LlmPart::Day,
                    ..limit
                },
                (&limit_keys, &conditions, on_missing, &header_names),
            );
            if let Some(day) = day {
                self.day_rules.push((self.rules.len(), day));
            }
        }
        let window_secs = budget
            .as_ref()
            .map_or(shape.quota.window_secs(), |b| b.period.nominal_secs());
        self.rules.push(Rule {
            index: self.rules.len(),
            limit_keys,
            conditions,
            cost,
            overrides,
            ip_overrides,
            on_missing,
            key_prefix,
            header_names,
            budget,
            concurrency,
            llm: llm.map(|(limit, _)| limit),
            ..plain_rule(name, policy, mode, shape.quota, window_secs)
        });
    }

    /// A boolean at `map[field]`, `default` when absent; `None` (an error) when not a boolean.
    pub(crate) fn flag(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        field: &str,
        default: bool,
    ) -> Option<bool> {
        match map.get(field) {
            None => Some(default),
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => {
                self.error(
                    &join(path, field),
                    format!("must be a boolean, found {}", type_name(other)),
                );
                None
            }
        }
    }

    /// `enabled` of a guard block: absent or false turns it off (Fairvisor's reading).
    pub(crate) fn enabled(&mut self, map: &Map<String, Value>, path: &str) -> bool {
        self.flag(map, path, "enabled", false).unwrap_or(false)
    }

    /// A whole number in `range` at `map[field]`, required when `required`.
    pub(crate) fn whole(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        field: &str,
        range: std::ops::RangeInclusive<u64>,
        required: bool,
    ) -> Option<u64> {
        let p = join(path, field);
        match map.get(field) {
            None if required => {
                self.error(&p, "is required when enabled is true");
                None
            }
            None => None,
            Some(v) => match v.as_u64().filter(|n| range.contains(n)) {
                Some(n) => Some(n),
                None => {
                    self.error(
                        &p,
                        format!(
                            "must be a whole number from {} to {}",
                            range.start(),
                            range.end()
                        ),
                    );
                    None
                }
            },
        }
    }

    pub(crate) fn period(&mut self, v: &Value, path: &str) -> Option<u64> {
        let s = self.non_empty_string(v, path)?;
        match humantime::parse_duration(s) {
            Ok(d) if d.as_micros() >= 1 && d.as_secs() <= 366 * 86_400 => {
                Some(d.as_micros() as u64)
            }
            Ok(_) => {
                self.error(path, "must be between 1µs and 366 days");
                None
            }
            Err(e) => {
                self.error(
                    path,
                    format!("not a duration like \"1s\", \"180m\" or \"1h\": {e}"),
                );
                None
            }
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

/// A bucket's shape as a rule wrote it: its quota, and the burst and rate in tokens.
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) quota: Quota,
    pub(crate) burst: f64,
    pub(crate) rate: f64,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::limiter::US_PER_SEC;
    use crate::policy::CostLimits;
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
                    "fallback_limit": {"name": "anonymous", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
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
                "policies[0].spec.rules[0].algorithm: unknown algorithm 'leaky_bucket' (supported: token_bucket, cost_based, concurrency, token_bucket_llm)",
                "policies[1].spec.rules[0].name: duplicate rule name 'shared-name' (first defined at policies[0].spec.rules[0].name); rule names are bucket namespaces and must be unique across the bundle",
            ]
        );
        let options = CompileOptions {
            skip_invalid_policies: true,
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
}

#[cfg(test)]
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
