//! Token buckets: the shape every bucketed rule shares (burst and refill, from any of the
//! accepted spellings), where a request's cost comes from (`fixed`, a header or a query
//! parameter, with its limits), and a request's bucket operation under a rule (what every
//! bucketed kind plans through).

use crate::engine::decision::RuleOutcome;
use crate::engine::planning::{group_of, Planning};
use crate::limits::limiter::{micro_to_tokens, tokens_to_micro, Quota, Window, MICRO, US_PER_SEC};
use crate::policy::compile::compiler::{Compiler, Shape, CONFIG_FIELDS};
use crate::policy::json::join;
use crate::policy::rule::canonical_id;
use crate::policy::rule::{BurstFrom, CostLimits, CostSource, Rule};
use crate::request::descriptor::RequestFacts;
use crate::request::descriptor::{Descriptor, IpNet};
use crate::store::{BucketKey, BucketOp};
use ahash::AHashMap;
use serde_json::{Map, Value};
use std::net::IpAddr;

impl Compiler {
    /// Burst and rate from a config (or an override, whose missing fields come from `base`).
    pub(crate) fn bucket_shape(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
        base: Option<&Shape>,
    ) -> Option<Shape> {
        let burst = match config.get("burst") {
            Some(v) => self.amount(v, &join(path, "burst")),
            None => match base {
                Some(b) => Some(b.burst),
                None => {
                    self.error(&join(path, "burst"), "is required");
                    None
                }
            },
        };
        if burst.is_some_and(|b| b < 1.0) {
            self.error(&join(path, "burst"), "must be >= 1");
        }
        let tps = config.get("tokens_per_second");
        let rps = config.get("rps");
        let count = config.get("count");
        let period = config.get("period");
        let rate: Option<(u64, u64, f64)> = if tps.is_some() && rps.is_some() {
            self.error(
                &join(path, "rps"),
                "set tokens_per_second or its alias rps, not both",
            );
            None
        } else if (tps.is_some() || rps.is_some()) && (count.is_some() || period.is_some()) {
            self.error(
                &join(path, "count"),
                "set either tokens_per_second/rps or count + period, not both",
            );
            None
        } else if let Some(v) = tps.or(rps) {
            let field = if tps.is_some() {
                "tokens_per_second"
            } else {
                "rps"
            };
            self.amount(v, &join(path, field))
                .map(|r| (tokens_to_micro(r), US_PER_SEC, r))
        } else if count.is_some() || period.is_some() {
            let count = match count {
                Some(c) => self.amount(c, &join(path, "count")),
                None => {
                    self.error(&join(path, "count"), "is required with period");
                    None
                }
            };
            let period = match period {
                Some(p) => self.period(p, &join(path, "period")),
                None => {
                    self.error(&join(path, "period"), "is required with count");
                    None
                }
            };
            let (count, period_us) = (count?, period?);
            Some((
                tokens_to_micro(count),
                period_us,
                count / (period_us as f64 / US_PER_SEC as f64),
            ))
        } else if let Some(b) = base {
            Some((b.quota.refill(), b.quota.period_us(), b.rate))
        } else {
            self.error(
                &join(path, "tokens_per_second"),
                "is required (or rps, or count + period)",
            );
            None
        };
        let (burst, (refill, period_us, rate)) = (burst?, rate?);
        if burst < 1.0 {
            return None;
        }
        if base.is_none() && burst < rate {
            self.warn(
                &join(path, "burst"),
                format!("burst {burst} is below the rate {rate}/s: the bucket can never hold one second of traffic"),
            );
        }
        match Quota::new(tokens_to_micro(burst), refill, period_us) {
            Ok(quota) => Some(Shape { quota, burst, rate }),
            Err(e) => {
                self.error(path, e.to_string());
                None
            }
        }
    }

    pub(crate) fn cost_source(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<CostSource> {
        self.cost_source_named(config, path, "cost_source")
    }

    /// The cost source of a config whose `cost_source` field is called `field` in the file.
    pub(crate) fn cost_source_named(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
        field_name: &str,
    ) -> Option<CostSource> {
        let amount = |c: &mut Self, field: &str| -> Result<Option<u64>, ()> {
            match config.get(field) {
                Some(v) => c
                    .amount(v, &join(path, field))
                    .map(|a| Some(tokens_to_micro(a)))
                    .ok_or(()),
                None => Ok(None),
            }
        };
        let fixed = amount(self, "fixed_cost").ok()?.unwrap_or(MICRO);
        let default = amount(self, "default_cost").ok()?.unwrap_or(MICRO);
        let min = amount(self, "min_cost").ok()?;
        let max = amount(self, "max_cost").ok()?;
        let source = match config.get("cost_source") {
            None => "fixed",
            Some(v) => self.string(v, &join(path, field_name))?,
        };
        if source == "fixed" {
            for field in ["min_cost", "max_cost", "default_cost"] {
                if config.contains_key(field) {
                    self.warn(
                        &join(path, field),
                        format!("ignored: {field_name} is \"fixed\""),
                    );
                }
            }
            return Some(CostSource::Fixed(fixed));
        }
        if config.contains_key("fixed_cost") {
            self.warn(
                &join(path, "fixed_cost"),
                format!("ignored: {field_name} is not \"fixed\""),
            );
        }
        let limits = CostLimits {
            default,
            min: min.unwrap_or(default),
            max,
        };
        if let Some(max) = max {
            if limits.min > max {
                self.error(
                    &join(path, "min_cost"),
                    format!(
                        "min_cost {} is above max_cost {}",
                        micro_to_tokens(limits.min),
                        micro_to_tokens(max)
                    ),
                );
                return None;
            }
            if default > max {
                self.error(
                    &join(path, "default_cost"),
                    format!(
                        "default_cost {} is above max_cost {}: requests without a cost would all be refused",
                        micro_to_tokens(default),
                        micro_to_tokens(max)
                    ),
                );
                return None;
            }
        }
        let named = |prefix: &str| source.strip_prefix(prefix).filter(|n| !n.is_empty());
        if let Some(name) = named("header:") {
            Some(CostSource::Header {
                name: crate::request::descriptor::header_name(name),
                limits,
            })
        } else if let Some(name) = named("query:") {
            Some(CostSource::Query {
                name: name.to_string(),
                limits,
            })
        } else if let Some(name) = named("response_header:") {
            Some(CostSource::Response {
                name: crate::request::descriptor::header_name(name),
                limits,
            })
        } else {
            self.error(
                &join(path, field_name),
                format!("'{source}' is not \"fixed\", \"header:<name>\", \"query:<name>\" or \"response_header:<name>\""),
            );
            None
        }
    }
}

impl Compiler {
    /// A rule's per-ID `overrides` (on the rule or in its `algorithm_config`), each a bucket
    /// shape over `base`: on a rule keyed on the client address alone, per-network quotas
    /// (most specific first, see `Rule::quota_for`); on any other, per-key-value quotas.
    pub(crate) fn overrides(
        &mut self,
        (map, config): (&Map<String, Value>, &Map<String, Value>),
        (path, config_path): (&str, &str),
        base: Option<Shape>,
        limit_keys: &[Descriptor],
    ) -> (AHashMap<String, Quota>, Vec<(IpNet, Quota)>) {
        let mut overrides = AHashMap::new();
        let mut ip_overrides: Vec<(IpNet, Quota)> = Vec::new();
        // `Some(explicit IPv6 prefix)` when the rule is keyed on the client address alone.
        let ip_keyed = match limit_keys {
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
            (None, Some(v)) => Some((v, join(config_path, "overrides"))),
            (None, None) => None,
        };
        if let (Some((v, op)), Some(base)) = (override_value, base) {
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
        (overrides, ip_overrides)
    }
}

impl Compiler {
    /// `burst_from` (`"jwt:<claim>"`) and its bound `max_burst` (at least the rule's `burst`,
    /// which it defaults to).
    pub(crate) fn burst_from(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
        shape: Option<&Shape>,
    ) -> Option<Box<BurstFrom>> {
        let max = config.get("max_burst");
        let Some(v) = config.get("burst_from") else {
            if max.is_some() {
                self.error(&join(path, "max_burst"), "is only read with burst_from");
            }
            return None;
        };
        let from_path = join(path, "burst_from");
        let text = self.non_empty_string(v, &from_path)?;
        let claim = text
            .strip_prefix("jwt:")
            .filter(|c| !c.is_empty() && c.split('.').all(|part| !part.is_empty()));
        let Some(claim) = claim else {
            self.error(
                &from_path,
                format!("'{text}' is not \"jwt:<claim>\" (a dotted path for a nested claim: jwt:limits.burst)"),
            );
            return None;
        };
        let shape = shape?;
        let max_burst = match max {
            None => shape.quota.burst(),
            Some(v) => {
                let max_path = join(path, "max_burst");
                let m = self.amount(v, &max_path)?;
                if m < shape.burst {
                    self.error(
                        &max_path,
                        format!("max_burst {m} is below burst {}: the claim's bound must be at least the rule's own burst", shape.burst),
                    );
                    return None;
                }
                tokens_to_micro(m)
            }
        };
        Some(Box::new(BurstFrom {
            claim: claim.to_string(),
            max_burst,
        }))
    }

    /// A runtime override's quota fields (`burst`, `tokens_per_second`/`rps`, `count` +
    /// `period`) over a `token_bucket` rule's own quota, checked as the bundle's `overrides`
    /// are: the same fields, the same code, the same messages.
    pub(crate) fn key_override_bucket(
        &mut self,
        fields: &Map<String, Value>,
        rule: &Rule,
    ) -> Option<Quota> {
        let base = Shape {
            quota: rule.quota,
            burst: micro_to_tokens(rule.quota.burst()),
            rate: micro_to_tokens(rule.quota.refill()) * US_PER_SEC as f64
                / rule.quota.period_us() as f64,
        };
        self.bucket_shape(fields, "", Some(&base))
            .map(|shape| shape.quota)
    }
}

/// Plans a plain bucket: the request's cost under the applied quota, spent in `window` (a
/// budget's) or in the bucket alone.
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    (key, quota): (BucketKey, Quota),
    facts: &RequestFacts<'_>,
    window: Option<Window>,
    planning: &mut Planning<'b>,
) {
    let cost = cost_of(&rule.cost, facts, &quota);
    let (op, outcome) = planned_bucket(rule, key, quota, cost, window);
    planning.ops.push(op);
    planning.checked.rules.push(outcome);
    if rule.after_response.is_some() || matches!(rule.cost, CostSource::Response { .. }) {
        let at = planning.ops.len() - 1;
        super::response::plan(rule, (key, quota, window.map(|w| w.id)), at, planning);
    }
}

/// A rule's bucket for the store and the outcome the store's answer fills in. A cost that
/// can never fit is sent as one micro-token more than the bucket can hold: the store refuses
/// it whatever its state, and spends nothing anywhere.
pub(crate) fn planned_bucket(
    rule: &Rule,
    key: BucketKey,
    quota: Quota,
    cost: Cost,
    window: Option<Window>,
) -> (BucketOp, RuleOutcome<'_>) {
    let (cost, cost_exceeds) = match cost {
        Cost::Fits(cost) => (cost, false),
        Cost::Exceeds => (quota.burst().saturating_add(1), true),
    };
    let op = BucketOp {
        key,
        quota,
        cost,
        group: group_of(rule.mode),
        window,
        on_store_error: rule.on_store_error,
        probe: false,
    };
    let outcome = RuleOutcome {
        rule,
        key,
        quota,
        allowed: true,
        committed: false,
        fail_open: false,
        cost_exceeds,
        tokens: 0,
        retry_after: 0,
        reset: 0,
        budget_ends_in_us: window.map_or(0, |w| w.ends_in_us),
        away: None,
    };
    (op, outcome)
}

/// A request's cost under one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// Micro-tokens to spend.
    Fits(u64),
    /// Above the rule's `max_cost` or the bucket's burst: refused, never admissible.
    Exceeds,
}

/// The cost of this request under `source` and the applied `quota`. A stated cost that is
/// absent, empty, not a number, not finite or not positive gives the default; one below
/// `min_cost` is raised to it (the client may raise its price, never lower it).
pub fn cost_of(source: &CostSource, facts: &RequestFacts<'_>, quota: &Quota) -> Cost {
    let (raw, limits) = match source {
        CostSource::Fixed(cost) => {
            return if *cost > quota.burst() {
                Cost::Exceeds
            } else {
                Cost::Fits(*cost)
            };
        }
        CostSource::Header { name, limits } => (facts.headers.header_text(name), limits),
        CostSource::Query { name, limits } => (facts.query_param(name), limits),
        // Priced by the response: its default is reserved now.
        CostSource::Response { limits, .. } => (None, limits),
    };
    let cost = raw
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|tokens| tokens.is_finite() && *tokens > 0.0)
        .map_or(limits.default, |tokens| {
            tokens_to_micro(tokens).max(limits.min)
        });
    let ceiling = limits
        .max
        .map_or(quota.burst(), |max| max.min(quota.burst()));
    if cost > ceiling {
        Cost::Exceeds
    } else {
        Cost::Fits(cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::compile::compile_bundle;
    use crate::policy::compile::tests::{errors_of, rule};
    use serde_json::json;

    #[test]
    fn cost_limits_compile_and_are_checked() {
        let b = compile_bundle(
            &rule(json!({"rps": 1, "burst": 20, "cost_source": "header:X-Weight", "default_cost": 2, "max_cost": 10})),
            "x",
        )
        .unwrap();
        assert_eq!(
            b.rules[0].cost,
            CostSource::Header {
                name: "x-weight".into(),
                limits: CostLimits {
                    default: 2 * MICRO,
                    min: 2 * MICRO,
                    max: Some(10 * MICRO)
                }
            }
        );
        assert_eq!(b.rules[0].header_names, ["x-weight"]);
        assert_eq!(
            errors_of(rule(
                json!({"rps": 1, "burst": 20, "cost_source": "query:w", "min_cost": 5, "max_cost": 3})
            )),
            ["rules[0].algorithm_config.min_cost: min_cost 5 is above max_cost 3"]
        );
        assert_eq!(
            errors_of(rule(json!({"rps": 1, "burst": 20, "cost_source": "query:w", "default_cost": 4, "min_cost": 1, "max_cost": 3}))),
            ["rules[0].algorithm_config.default_cost: default_cost 4 is above max_cost 3: requests without a cost would all be refused"]
        );
    }

    /// A request's cost, planned and spent through the engine.
    mod planning {
        use crate::engine::tests::*;
        use crate::engine::*;
        use crate::limits::limiter::MICRO;
        use serde_json::json;

        #[test]
        fn variable_cost_from_header_and_query_with_fallback() {
            let (e, _) = engine(json!({"rules": [
                {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 10, "cost_source": "header:x-weight", "default_cost": 2}}
            ]}));
            let d = ask(&e, "GET", "/", "10.0.0.1", &[("X-Weight", "5")]);
            assert_eq!(d.rules()[0].tokens, 5 * MICRO);
            for (i, bad) in ["", "abc", "-3", "0", "NaN", "inf"].into_iter().enumerate() {
                let ip = format!("10.0.1.{i}");
                let before = ask(&e, "GET", "/", &ip, &[]).rules()[0].tokens;
                let after = ask(&e, "GET", "/", &ip, &[("X-Weight", bad)]).rules()[0].tokens;
                assert_eq!(
                    before - after,
                    2 * MICRO,
                    "cost header {bad:?} must fall back to default_cost"
                );
            }
            let (e, _) = engine(json!({"rules": [
                {"name": "q", "limit_keys": [], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 10, "cost_source": "query:cost"}}
            ]}));
            assert_eq!(
                ask(&e, "GET", "/x?cost=2.5", "10.0.0.1", &[]).rules()[0].tokens,
                7_500_000
            );
            assert_eq!(
                ask(&e, "GET", "/x", "10.0.0.1", &[]).rules()[0].tokens,
                6_500_000
            );
        }

        /// Issue 13, attack 2: a client stating a tiny cost used to pass 2 000 of 2 000 requests
        /// through a burst of 20; a cost above the burst got `Retry-After: 204065720593`.
        #[test]
        fn the_client_cannot_pick_its_own_price() {
            use crate::engine::headers::{build, HeaderConfig};
            let (e, _) = engine(json!({"rules": [
                {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 20, "cost_source": "header:x-request-weight"}}
            ]}));
            let admitted = (0..2_000)
                .filter(|_| {
                    ask(
                        &e,
                        "GET",
                        "/",
                        "10.0.0.1",
                        &[("X-Request-Weight", "0.000001")],
                    )
                    .is_allowed()
                })
                .count();
            assert_eq!(admitted, 20);

            // Above the burst: refused without a Retry-After, nothing spent.
            let d = ask(&e, "GET", "/", "10.0.0.2", &[("X-Request-Weight", "21")]);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
            assert_eq!(d.status(), 429);
            assert_eq!(d.retry_after(), 0);
            assert_eq!(d.rules()[0].tokens, 20 * MICRO);
            let decided = Decided {
                decision: d,
                request: RequestView::default(),
            };
            let r = build(&decided, &HeaderConfig::default());
            assert!(
                r.headers.iter().all(|(n, _)| n != "retry-after"),
                "{:?}",
                r.headers
            );
            let get = |name: &str| {
                r.headers
                    .iter()
                    .find(|(n, _)| n.as_str().eq_ignore_ascii_case(name))
                    .and_then(|(_, v)| v.to_str().ok())
            };
            assert_eq!(get("X-Tollgate-Reason"), Some("cost_exceeds_limit"));
            assert_eq!(get("RateLimit"), Some("\"weighted\";r=20;t=0"));
            assert_eq!(get("RateLimit-Remaining"), Some("20"));
            // Exactly the burst still fits.
            assert!(ask(&e, "GET", "/", "10.0.0.2", &[("X-Request-Weight", "20")]).is_allowed());

            // An explicit max_cost below the burst, and min_cost below the default.
            let (e, _) = engine(json!({"rules": [
                {"name": "w", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 100, "cost_source": "query:w",
                                      "default_cost": 5, "min_cost": 0.5, "max_cost": 10}}
            ]}));
            assert_eq!(
                ask(&e, "GET", "/?w=0.1", "10.0.0.3", &[]).rules()[0].tokens,
                99_500_000
            );
            assert_eq!(
                ask(&e, "GET", "/", "10.0.0.3", &[]).rules()[0].tokens,
                94_500_000
            );
            let d = ask(&e, "GET", "/?w=10.5", "10.0.0.3", &[]);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
            assert_eq!(d.rules()[0].tokens, 94_500_000);
        }

        /// All-or-nothing: a cost that can never fit under one rule spends nothing under another.
        #[test]
        fn a_never_admissible_cost_spends_nothing_anywhere() {
            let (e, _) = engine(json!({"rules": [
                tb("plain", json!(["ip:address"]), 1.0, 50.0),
                {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 5, "cost_source": "header:x-w"}}
            ]}));
            let d = ask(&e, "GET", "/", "10.0.0.1", &[("X-W", "6")]);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
            assert!(d.rules().iter().all(|r| !r.committed));
            assert_eq!(
                ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
                49 * MICRO
            );
        }
    }
}
