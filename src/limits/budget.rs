//! `cost_based`: budgets per period with warn / throttle / reject stages. Compiles `budget`,
//! `period` and `staged_actions`, and plans a request's spend in the current window; the
//! window and stage arithmetic is [`crate::limits::budget_window`]'s.

use crate::engine::planning::{PlanContext, Planning};
use crate::limits::budget_window::{Action, Budget, Stage, MAX_THROTTLE_MS};
use crate::limits::limiter::{tokens_to_micro, Quota, US_PER_SEC};
use crate::policy::compile::compiler::{Compiler, Shape};
use crate::policy::json::join;
use crate::policy::rule::{CostSource, Rule};
use crate::request::descriptor::RequestFacts;
use crate::store::BucketKey;
use serde_json::{Map, Value};

/// The fields of a `cost_based` rule's `algorithm_config`.
pub(crate) const COST_BASED_FIELDS: &[&str] = &[
    "budget",
    "period",
    "cost_key",
    "fixed_cost",
    "default_cost",
    "min_cost",
    "max_cost",
    "staged_actions",
    "count_when",
    "penalty",
    "notify_at",
];

/// The quota field a runtime override of a `cost_based` rule may set.
pub(crate) const KEY_OVERRIDE_FIELDS: &[&str] = &["budget"];

impl Compiler {
    /// A runtime override's `budget` over a `cost_based` rule's own window (its period and
    /// stages stay the rule's), checked as the rule's own `budget` is.
    pub(crate) fn key_override_budget(
        &mut self,
        fields: &Map<String, Value>,
        rule: &Rule,
    ) -> Option<Quota> {
        let amount = match fields.get("budget") {
            Some(v) => self.amount(v, "budget")?,
            None => {
                self.error("budget", "is required");
                return None;
            }
        };
        let budget_micro = tokens_to_micro(amount);
        match Quota::new(budget_micro, budget_micro, rule.quota.period_us()) {
            Ok(quota) => Some(quota),
            Err(e) => {
                self.error("budget", e.to_string());
                None
            }
        }
    }
}
/// The most thresholds a rule's `notify_at` lists.
pub(crate) const MAX_NOTIFY_AT: usize = 10;

impl Compiler {
    /// A `cost_based` rule's budget, cost and stages (Fairvisor's fields: `budget`, `period`,
    /// `cost_key`, `fixed_cost`, `default_cost`, `staged_actions`; tollgate adds `min_cost`,
    /// `max_cost` and the calendar month).
    pub(crate) fn budget(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<(Shape, CostSource, Budget)> {
        let errors_before = self.errors.len();
        let amount = match config.get("budget") {
            Some(v) => self.amount(v, &join(path, "budget")),
            None => {
                self.error(&join(path, "budget"), "is required");
                None
            }
        };
        let period = match config.get("period") {
            Some(v) => {
                let p = join(path, "period");
                let text = self.non_empty_string(v, &p);
                let period = text.and_then(crate::limits::budget_window::Period::parse);
                if text.is_some() && period.is_none() {
                    self.error(&p, "must be one of 5m, 1h, 1d, 7d, 1M (a calendar month)");
                }
                period
            }
            None => {
                self.error(&join(path, "period"), "is required");
                None
            }
        };
        // `cost_key` is Fairvisor's name for tollgate's `cost_source`.
        let mut cost_config = config.clone();
        if let Some(key) = cost_config.remove("cost_key") {
            cost_config.insert("cost_source".into(), key);
        }
        let cost = self.cost_source_named(&cost_config, path, "cost_key");
        let notify_at = self.notify_at(config, path);
        let mut stages = Vec::new();
        let sp = join(path, "staged_actions");
        match config.get("staged_actions") {
            Some(v) => {
                if let Some(items) = self.array(v, &sp) {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(stage) = self.stage(item, &format!("{sp}[{i}]")) {
                            stages.push(stage);
                        }
                    }
                    if items.is_empty() {
                        self.error(&sp, "must list at least the reject stage at 100");
                    }
                }
            }
            None => self.error(
                &sp,
                "is required (at least {\"threshold_percent\": 100, \"action\": \"reject\"})",
            ),
        }
        if self.errors.len() > errors_before {
            return None;
        }
        stages.sort_by(|a, b| a.threshold_percent.total_cmp(&b.threshold_percent));
        if stages
            .windows(2)
            .any(|w| w[0].threshold_percent == w[1].threshold_percent)
        {
            self.error(
                &sp,
                "thresholds must be strictly ascending (no two stages at the same percent)",
            );
            return None;
        }
        if !stages
            .iter()
            .any(|s| s.threshold_percent == 100.0 && s.action == Action::Reject)
        {
            self.error(
                &sp,
                "must include {\"threshold_percent\": 100, \"action\": \"reject\"}",
            );
            return None;
        }
        let (amount, period, cost) = (amount?, period?, cost?);
        let budget_micro = tokens_to_micro(amount);
        let quota = match Quota::new(
            budget_micro,
            budget_micro,
            period.nominal_secs() * US_PER_SEC,
        ) {
            Ok(q) => q,
            Err(e) => {
                self.error(&join(path, "budget"), e.to_string());
                return None;
            }
        };
        Some((
            Shape {
                quota,
                burst: amount,
                rate: amount / period.nominal_secs() as f64,
            },
            cost,
            Budget {
                period,
                stages,
                zone: crate::limits::budget_window::Zone::Utc,
                notify_at,
            },
        ))
    }

    /// A budget rule's `notify_at`: 1 to [`MAX_NOTIFY_AT`] shares of the budget, each above 0
    /// and at most 1, strictly ascending (empty when absent).
    pub(crate) fn notify_at(&mut self, config: &Map<String, Value>, path: &str) -> Vec<f64> {
        let Some(value) = config.get("notify_at") else {
            return Vec::new();
        };
        let p = join(path, "notify_at");
        let Some(items) = self.array(value, &p) else {
            return Vec::new();
        };
        if items.is_empty() || items.len() > MAX_NOTIFY_AT {
            self.error(
                &p,
                format!("must list 1 to {MAX_NOTIFY_AT} shares of the budget"),
            );
            return Vec::new();
        }
        let mut shares = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item.as_f64() {
                Some(t) if t > 0.0 && t <= 1.0 => {
                    if shares.last().is_some_and(|last| *last >= t) {
                        self.error(&format!("{p}[{i}]"), "must be above the share before it");
                    }
                    shares.push(t);
                }
                _ => self.error(
                    &format!("{p}[{i}]"),
                    "must be a share of the budget above 0 and at most 1 (0.8 for 80 %)",
                ),
            }
        }
        shares
    }

    pub(crate) fn stage(&mut self, v: &Value, path: &str) -> Option<Stage> {
        let map = self.object(v, path, &["threshold_percent", "action", "delay_ms"])?;
        let threshold = match map.get("threshold_percent").map(Value::as_f64) {
            Some(Some(t)) if (0.0..=100.0).contains(&t) => Some(t),
            Some(_) => {
                self.error(
                    &join(path, "threshold_percent"),
                    "must be a number from 0 to 100",
                );
                None
            }
            None => {
                self.error(&join(path, "threshold_percent"), "is required");
                None
            }
        };
        let delay = map.get("delay_ms").map(|v| match v.as_f64() {
            Some(d) if d > 0.0 && d.is_finite() => {
                if d > MAX_THROTTLE_MS as f64 {
                    self.warn(
                        &join(path, "delay_ms"),
                        format!("capped at {MAX_THROTTLE_MS} ms"),
                    );
                }
                Some((d.ceil() as u64).min(MAX_THROTTLE_MS))
            }
            _ => {
                self.error(
                    &join(path, "delay_ms"),
                    "must be a positive number of milliseconds",
                );
                None
            }
        });
        let action = match map.get("action").and_then(Value::as_str) {
            Some("warn") => Some(Action::Warn),
            Some("reject") => Some(Action::Reject),
            Some("throttle") => match delay {
                Some(Some(delay_ms)) => Some(Action::Throttle { delay_ms }),
                Some(None) => None,
                None => {
                    self.error(&join(path, "delay_ms"), "is required for a throttle stage");
                    None
                }
            },
            _ => {
                self.error(
                    &join(path, "action"),
                    "must be \"warn\", \"throttle\" or \"reject\"",
                );
                None
            }
        };
        Some(Stage {
            threshold_percent: threshold?,
            action: action?,
        })
    }
}

/// Plans a budget's spend: the request's cost, in the budget's current window (a new window
/// starts full).
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    budget: &Budget,
    bucket: (BucketKey, Quota),
    facts: &RequestFacts<'_>,
    context: PlanContext<'b>,
    planning: &mut Planning<'b>,
) {
    let window = budget.window(context.unix_us);
    super::token_bucket::plan(rule, bucket, facts, Some(window), planning);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::MICRO;
    use crate::policy::compile::compile_bundle;
    use crate::policy::compile::tests::errors_of;
    use serde_json::json;

    #[test]
    fn cost_based_rules_compile_with_fairvisor_fields() {
        let rule = |config: Value| json!({"rules": [{"name": "b", "limit_keys": ["jwt:org_id"], "algorithm": "cost_based", "algorithm_config": config}]});
        let b = compile_bundle(
            &rule(json!({"budget": 5000, "period": "5m", "cost_key": "fixed", "fixed_cost": 2,
                         "staged_actions": [{"threshold_percent": 100, "action": "reject"},
                                            {"threshold_percent": 80, "action": "warn"},
                                            {"threshold_percent": 95, "action": "throttle", "delay_ms": 200}]})),
            "x",
        )
        .unwrap();
        let r = &b.rules[0];
        assert_eq!(r.key_prefix, "cb:b:");
        assert_eq!(r.policy_item, "\"b\";q=5000;w=300");
        assert_eq!(r.cost, CostSource::Fixed(2 * MICRO));
        let budget = r.budget().unwrap();
        assert_eq!(
            budget.period,
            crate::limits::budget_window::Period::FiveMinutes
        );
        let thresholds: Vec<f64> = budget.stages.iter().map(|s| s.threshold_percent).collect();
        assert_eq!(thresholds, [80.0, 95.0, 100.0]);
        assert_eq!(
            errors_of(rule(json!({"budget": 0, "period": "2h", "cost_key": "cookie:x",
                                  "staged_actions": [{"threshold_percent": 50, "action": "throttle"},
                                                     {"threshold_percent": 101, "action": "reject"}]}))),
            [
                "rules[0].algorithm_config.budget: must be > 0",
                "rules[0].algorithm_config.period: must be one of 5m, 1h, 1d, 7d, 1M (a calendar month)",
                "rules[0].algorithm_config.cost_key: 'cookie:x' is not \"fixed\", \"header:<name>\", \"query:<name>\" or \"response_header:<name>\"",
                "rules[0].algorithm_config.staged_actions[0].delay_ms: is required for a throttle stage",
                "rules[0].algorithm_config.staged_actions[1].threshold_percent: must be a number from 0 to 100",
            ]
        );
        assert_eq!(
            errors_of(rule(json!({"budget": 10, "period": "1M",
                                  "staged_actions": [{"threshold_percent": 90, "action": "reject"}]}))),
            ["rules[0].algorithm_config.staged_actions: must include {\"threshold_percent\": 100, \"action\": \"reject\"}"]
        );
    }

    #[test]
    fn notify_at_lists_ascending_shares_of_the_budget() {
        let rule = |notify: Value| json!({"rules": [{"name": "b", "limit_keys": ["jwt:org_id"], "algorithm": "cost_based", "algorithm_config": {"budget": 100, "period": "1M", "notify_at": notify, "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}}]});
        let b = compile_bundle(&rule(json!([0.5, 0.8, 1.0])), "x").unwrap();
        assert_eq!(b.rules[0].budget().unwrap().notify_at, [0.5, 0.8, 1.0]);
        assert_eq!(
            errors_of(rule(json!([0.8, 0.5, 0, 1.5, "x"]))),
            [
                "rules[0].algorithm_config.notify_at[1]: must be above the share before it",
                "rules[0].algorithm_config.notify_at[2]: must be a share of the budget above 0 and at most 1 (0.8 for 80 %)",
                "rules[0].algorithm_config.notify_at[3]: must be a share of the budget above 0 and at most 1 (0.8 for 80 %)",
                "rules[0].algorithm_config.notify_at[4]: must be a share of the budget above 0 and at most 1 (0.8 for 80 %)",
            ]
        );
        assert_eq!(
            errors_of(rule(json!([]))),
            ["rules[0].algorithm_config.notify_at: must list 1 to 10 shares of the budget"]
        );
        assert_eq!(
            errors_of(rule(json!(0.8))),
            ["rules[0].algorithm_config.notify_at: must be an array, found a number"]
        );
    }

    // The engine's view: requests decided under this kind's rules.
    mod decided {
        use crate::engine::tests::*;
        use crate::engine::*;
        use crate::limits::limiter::{MICRO, US_PER_SEC};
        use serde_json::json;

        #[test]
        fn budgets_count_per_utc_window_and_roll_back_refusals() {
            // Wall origin 2027-01-15T08:00:00Z: a 5-minute window starts right there.
            let (e, clock) = engine(
                json!({"bundle_version": 1, "policies": [{"id": "p", "spec": {"rules": [
                budget("five-min", 10.0, "5m", json!([
                    {"threshold_percent": 50, "action": "warn"},
                    {"threshold_percent": 80, "action": "throttle", "delay_ms": 250},
                    {"threshold_percent": 100, "action": "reject"}]))]}}]}),
            );
            let key = [("X-Api-Key", "k1")];
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0], ("X-Cost", "4")]);
            assert!(d.is_allowed());
            assert_eq!((d.rules()[0].tokens, d.rules()[0].reset), (6 * MICRO, 300));
            assert_eq!(d.checked().unwrap().stage, None);
            assert_eq!(bucket(&d, 0, "10.0.0.1", &key), "cb:five-min:k1");
            clock.set_secs(60.0);
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0], ("X-Cost", "2")]);
            assert_eq!(d.checked().unwrap().warning(), Some("budget_warn"));
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0], ("X-Cost", "3")]);
            assert_eq!(d.checked().unwrap().throttle_ms(), 250);
            assert_eq!(d.rules()[0].tokens, MICRO);
            // 2 more would pass the budget: refused, nothing spent, back when the window ends.
            clock.set_secs(100.5);
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0], ("X-Cost", "2")]);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::BudgetExceeded));
            assert_eq!(d.retry_after(), 199);
            assert_eq!(d.rules()[0].tokens, MICRO);
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0], ("X-Cost", "1")]);
            assert!(d.is_allowed());
            assert_eq!(d.rules()[0].tokens, 0);
            // Other keys have their own budget.
            assert!(ask(
                &e,
                "GET",
                "/",
                "10.0.0.1",
                &[("X-Api-Key", "k2"), ("X-Cost", "10")]
            )
            .is_allowed());
            // One microsecond before the window ends: still spent. At the boundary: whole again.
            clock.set_us(300 * US_PER_SEC - 1);
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0]]);
            assert_eq!(
                (d.outcome(), d.retry_after()),
                (Outcome::Reject(Reason::BudgetExceeded), 1)
            );
            clock.set_us(300 * US_PER_SEC);
            let d = ask(&e, "GET", "/", "10.0.0.1", &[key[0]]);
            assert!(d.is_allowed());
            assert_eq!(d.rules()[0].tokens, 9 * MICRO);
        }

        #[test]
        fn a_budget_refusal_keeps_the_other_rules_whole() {
            let (e, _) = engine(
                json!({"bundle_version": 1, "policies": [{"id": "p", "spec": {"rules": [
                tb("per-ip", json!(["ip:address"]), 1.0, 10.0),
                budget("hourly", 3.0, "1h", json!([{"threshold_percent": 100, "action": "reject"}]))]}}]}),
            );
            let h = [("X-Api-Key", "k"), ("X-Cost", "3")];
            assert!(ask(&e, "GET", "/", "10.0.0.1", &h).is_allowed());
            let d = ask(&e, "GET", "/", "10.0.0.1", &h);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::BudgetExceeded));
            // The bucket was not charged for the refused request: 9 left, not 8.
            assert_eq!(d.rules()[0].tokens, 9 * MICRO);
            assert_eq!(d.retry_after(), 3600);
            let Decision::Refuse(r) = &d else {
                unreachable!()
            };
            assert!(r.retry_by_deadline);
        }
    }
}
