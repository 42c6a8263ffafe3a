//! The compiler's state ([`Compiler`]) and what every part of it shares, the limit kinds'
//! compile halves under [`crate::limits`] included: bucket shapes, key prefixes, the headers a
//! rule reads, a plain rule to fill in, the amounts allowed, and unclaimed rule names.

use crate::limits::limiter::{Quota, MICRO};
use crate::policy::bundle::{RuntimeOverride, SkippedPolicy};
use crate::policy::error::FieldError;
use crate::policy::rule::{
    push_sf_string, CostSource, KillSwitch, Mode, OnMissing, Policy, Rule, RuleKind,
};
use crate::request::descriptor::Descriptor;
use ahash::{AHashMap, AHashSet};

/// Largest accepted burst, rate or cost, in tokens: keeps every micro-token amount and product
/// far inside 64-bit integers (and inside the 2^53 exact range of Lua and PostgreSQL doubles).
pub(crate) const MAX_AMOUNT: f64 = 1e9;
/// Smallest accepted amount: one micro-token.
pub(crate) const MIN_AMOUNT: f64 = 1e-6;

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
    /// Hash of the policy being compiled's id, selector and mode: part of each of its rules'
    /// [`Rule::definition`].
    pub(crate) current_policy_definition: u64,
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
    /// [`Bundle::long_lived_keys`] so far.
    pub(crate) long_lived_keys: Vec<(usize, Box<str>)>,
    /// The `limit_keys` path of each rule of the policy being compiled that has a
    /// `tokens_per_day` rule (by the minute rule's index): that rule shares those keys.
    pub(crate) day_rule_paths: Vec<(usize, Box<str>)>,
    pub(crate) policy_ids: AHashSet<String>,
    /// The bundle's `llm_prices`, compiled before its policies (`None` also when invalid).
    pub(crate) llm_prices: Option<crate::limits::prices::PriceTable>,
    /// The bundle has an `llm_prices` block (valid or not: an invalid one is reported once).
    pub(crate) llm_prices_written: bool,
}

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
/// syntax (`Rule { kind: RuleKind::Guard(..), ..plain_rule(..) }`). `window_secs` is what its
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
        on_store_error: None,
        key_prefix: String::new(),
        header_names: Vec::new(),
        kind: RuleKind::TokenBucket,
        pacing: None,
        definition: 0,
        after_response: None,
        burst_from: None,
    }
}

pub(crate) fn policy_item(name: &str, quota: &Quota, window_secs: u64) -> (String, String) {
    let mut sf_name = String::with_capacity(name.len() + 2);
    push_sf_string(&mut sf_name, name);
    let item = format!("{sf_name};q={};w={window_secs}", quota.burst() / MICRO);
    (sf_name, item)
}

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
    "count_when",
    "penalty",
    "delay",
    "burst_from",
    "max_burst",
];

impl Compiler {
    /// `base`, or `base@<policy id>` when another policy's rule took `base` first (rule names
    /// are bucket namespaces: an unnamed fallback, a guard).
    pub(crate) fn unclaimed_name(&self, base: &str) -> String {
        if self.rule_names.contains_key(base) {
            format!("{base}@{}", self.current_policy_id)
        } else {
            base.to_string()
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
