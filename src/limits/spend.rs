//! `llm_spend`: LLM budgets in money. Compiles the bundle's `llm_prices` table and the rule's
//! fields (the budget, its calendar period and time zone, the completion reserved, the
//! estimator, `on_exhausted.fallback_model`) and plans a request under it: the most the call
//! can cost at its model's prices, reserved against the period's budget all-or-nothing with the
//! request's other rules. Money arithmetic is [`crate::limits::prices`]'; settling is the
//! engine's [`crate::engine::Reservation`].

use super::llm::asked_tokens;
use super::prices::{micro_units, Price, PriceEntry, PriceTable, MILLION};
use super::token_bucket::{planned_bucket, Cost};
use crate::engine::decision::{Reason, Reserved, SpendPrice};
use crate::engine::planning::{PlanContext, Planning};
use crate::limits::budget_window::{Action, Budget, Period, Stage, Zone};
use crate::limits::limiter::{Quota, US_PER_SEC};
use crate::policy::compile::compiler::{Compiler, Shape};
use crate::policy::json::{join, type_name};
use crate::policy::rule::{Mode, Rule, SpendLimit};
use crate::request::descriptor::RequestFacts;
use crate::store::BucketKey;
use serde_json::{Map, Value};

/// The fields of an `llm_spend` rule's `algorithm_config`.
pub(crate) const SPEND_FIELDS: &[&str] = &[
    "budget",
    "period",
    "timezone",
    "on_exhausted",
    "max_completion_tokens",
    "default_max_completion",
    "token_source",
    "notify_at",
];

/// The fields of one model's prices.
const PRICE_FIELDS: &[&str] = &[
    "input_per_mtok",
    "cached_input_per_mtok",
    "cache_write_per_mtok",
    "output_per_mtok",
];

/// The completion reserved when neither the request nor the rule says (as `token_bucket_llm`).
const DEFAULT_MAX_COMPLETION: u64 = 1000;

impl Compiler {
    /// The bundle's `llm_prices`: `currency` (required), `models` (name or `*` pattern →
    /// prices) and `unknown_model` (`"refuse"`, the default, or a price entry). Patterns that
    /// can both match one model are reported as warnings naming the one that wins.
    pub(crate) fn llm_prices(&mut self, v: &Value, path: &str) -> Option<PriceTable> {
        let errors_before = self.errors.len();
        let map = self.object(v, path, &["currency", "models", "unknown_model"])?;
        let currency = match map.get("currency") {
            Some(v) => self.non_empty_string(v, &join(path, "currency")),
            None => {
                self.error(&join(path, "currency"), "is required (\"USD\", \"EUR\"...)");
                None
            }
        };
        let mut models = Vec::new();
        match map.get("models") {
            Some(Value::Object(entries)) => {
                let models_path = join(path, "models");
                if entries.len() > PriceTable::MAX_ENTRIES {
                    self.error(
                        &models_path,
                        format!("has more than {} entries", PriceTable::MAX_ENTRIES),
                    );
                }
                for (pattern, prices) in entries {
                    let entry_path = format!("{models_path}.{pattern}");
                    if pattern.is_empty() || pattern.len() > crate::request::llm::MAX_MODEL_LEN {
                        self.error(&entry_path, "a model name must have 1 to 256 bytes");
                        continue;
                    }
                    if let Some(price) = self.price(prices, &entry_path) {
                        models.push(PriceEntry {
                            pattern: pattern.clone(),
                            price,
                        });
                    }
                }
            }
            Some(other) => self.error(
                &join(path, "models"),
                format!("must be an object, found {}", type_name(other)),
            ),
            None => self.error(&join(path, "models"), "is required"),
        }
        let unknown = match map.get("unknown_model") {
            None => None,
            Some(Value::String(s)) if s == "refuse" => None,
            Some(v @ Value::Object(_)) => self.price(v, &join(path, "unknown_model")),
            Some(_) => {
                self.error(
                    &join(path, "unknown_model"),
                    "must be \"refuse\" or a price entry ({\"input_per_mtok\": ..., \"output_per_mtok\": ...})",
                );
                None
            }
        };
        PriceTable::sort(&mut models);
        self.overlapping_patterns(&models, &join(path, "models"));
        if self.errors.len() > errors_before {
            return None;
        }
        Some(PriceTable {
            currency: currency?.to_string(),
            models,
            unknown,
        })
    }

    /// Warns of every two patterns one model name could match, naming the one that prices it
    /// (the first in [`PriceTable::models`]' order).
    fn overlapping_patterns(&mut self, models: &[PriceEntry], path: &str) {
        for (i, winner) in models.iter().enumerate() {
            for loser in &models[i + 1..] {
                let both = if winner.pattern.contains('*') {
                    super::prices::globs_overlap(&winner.pattern, &loser.pattern)
                } else {
                    super::prices::glob_match(&loser.pattern, &winner.pattern)
                };
                if both {
                    self.warn(
                        &format!("{path}.{}", loser.pattern),
                        format!(
                            "overlaps \"{}\": a model both match is priced by \"{}\" (exact names first, then the pattern with more literal characters)",
                            winner.pattern, winner.pattern
                        ),
                    );
                }
            }
        }
    }

    /// One model's prices: `input_per_mtok` and `output_per_mtok` (required),
    /// `cached_input_per_mtok` and `cache_write_per_mtok` (default: the input price), each an
    /// amount of the currency per million tokens, exact to a millionth.
    fn price(&mut self, v: &Value, path: &str) -> Option<Price> {
        let map = self.object(v, path, PRICE_FIELDS)?;
        let errors_before = self.errors.len();
        let mut read = |field: &str, required: bool| -> Option<u64> {
            let p = join(path, field);
            match map.get(field) {
                None if required => {
                    self.error(&p, "is required");
                    None
                }
                None => None,
                Some(v) => match micro_units(v) {
                    Ok(micro) => Some(micro),
                    Err(e) => {
                        self.error(&p, e.to_string());
                        None
                    }
                },
            }
        };
        let input = read("input_per_mtok", true);
        let cached = read("cached_input_per_mtok", false);
        let cache_write = read("cache_write_per_mtok", false);
        let output = read("output_per_mtok", true);
        if self.errors.len() > errors_before {
            return None;
        }
        let input = input?;
        Some(Price {
            input,
            cached_input: cached.unwrap_or(input),
            cache_write: cache_write.unwrap_or(input),
            output: output?,
        })
    }

    /// An `llm_spend` rule's fields: `budget` (required, an amount of the price table's
    /// currency), `period` (`1h`, `1d`, `1w`, `1M`; default `1d`), `timezone` (an IANA name;
    /// default `UTC`), `on_exhausted.fallback_model`, `max_completion_tokens`,
    /// `default_max_completion` (default 1000) and `token_source`. The bundle must have an
    /// `llm_prices` table, and a fallback model must have a price in it.
    pub(crate) fn spend(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<(Shape, SpendLimit)> {
        let errors_before = self.errors.len();
        if !self.llm_prices_written {
            self.error(
                path,
                "an llm_spend rule prices requests with the bundle's llm_prices, which this bundle does not have",
            );
        }
        let budget = match config.get("budget") {
            None => {
                self.error(&join(path, "budget"), "is required");
                None
            }
            Some(v) => match micro_units(v) {
                Ok(0) => {
                    self.error(&join(path, "budget"), "must be more than 0");
                    None
                }
                Ok(micro) => Some(micro),
                Err(e) => {
                    self.error(&join(path, "budget"), e.to_string());
                    None
                }
            },
        };
        let period = match config.get("period") {
            None => Some(Period::Day),
            Some(v) => {
                let p = join(path, "period");
                let period = v.as_str().and_then(Period::parse_spend);
                if period.is_none() {
                    self.error(&p, "must be \"1h\", \"1d\", \"1w\" or \"1M\"");
                }
                period
            }
        };
        let zone = match config.get("timezone") {
            None => Some(Zone::Utc),
            Some(v) => {
                let p = join(path, "timezone");
                let zone = v.as_str().and_then(Zone::named);
                if zone.is_none() {
                    self.error(
                        &p,
                        "must be an IANA time zone name (\"America/New_York\", \"Europe/Paris\", \"UTC\")",
                    );
                }
                zone
            }
        };
        let fallback_model = self.fallback_model(config, path);
        let range = 1..=crate::request::llm::MAX_TOKENS;
        let max_completion =
            self.whole(config, path, "max_completion_tokens", range.clone(), false);
        let default_completion = self
            .whole(config, path, "default_max_completion", range, false)
            .unwrap_or(DEFAULT_MAX_COMPLETION);
        let estimator = self.llm_estimator(config, path);
        let notify_at = self.notify_at(config, path);
        if self.errors.len() > errors_before {
            return None;
        }
        let (budget, period, zone, estimator) = (budget?, period?, zone?, estimator?);
        let quota = Quota::new(budget, budget, period.nominal_secs() * US_PER_SEC).ok()?;
        let units = budget as f64 / MILLION as f64;
        Some((
            Shape {
                quota,
                burst: units,
                rate: units / period.nominal_secs() as f64,
            },
            SpendLimit {
                budget: Budget {
                    period,
                    stages: vec![Stage {
                        threshold_percent: 100.0,
                        action: Action::Reject,
                    }],
                    zone,
                    notify_at,
                },
                fallback_model,
                max_completion_tokens: max_completion,
                default_max_completion: max_completion
                    .map_or(default_completion, |max| default_completion.min(max)),
                estimator,
            },
        ))
    }

    /// `on_exhausted`: `{"fallback_model": "<a model the price table prices>"}`.
    fn fallback_model(&mut self, config: &Map<String, Value>, path: &str) -> Option<String> {
        let p = join(path, "on_exhausted");
        let map = self.object(config.get("on_exhausted")?, &p, &["fallback_model"])?;
        let fp = join(&p, "fallback_model");
        let model = self.non_empty_string(map.get("fallback_model")?, &fp)?;
        let priced = self.llm_prices.as_ref().is_some_and(|t| {
            t.lookup(Some(model))
                .is_some_and(|(label, _)| label != PriceTable::OTHER)
        });
        if self.llm_prices.is_some() && !priced {
            self.error(&fp, format!("'{model}' has no entry in llm_prices.models"));
            return None;
        }
        Some(model.to_string())
    }
}

/// Plans an `llm_spend` rule: the most the call can cost at its model's prices (the prompt at
/// the dearest input price, the completion it may produce at the output price), taken from the
/// budget of the period holding now. A model the price table refuses is refused before the
/// store (`unknown_model`); a call dearer than the whole budget can never be admitted.
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    limit: &SpendLimit,
    (key, quota): (BucketKey, Quota),
    facts: &RequestFacts<'_>,
    context: PlanContext<'b>,
    planning: &mut Planning<'b>,
) {
    let model = facts.llm_model();
    let priced = context
        .bundle
        .llm_prices
        .as_deref()
        .and_then(|table| table.lookup(model.as_deref()));
    let Some((label, price)) = priced else {
        if rule.mode == Mode::Enforce {
            planning.refused.get_or_insert((rule, Reason::UnknownModel));
        }
        return;
    };
    let (prompt, completion) = asked_tokens(
        facts,
        limit.estimator,
        limit.default_max_completion,
        limit.max_completion_tokens,
    );
    let most = price.most(prompt, completion);
    let cost = if most <= quota.burst() {
        Cost::Fits(most)
    } else {
        Cost::Exceeds
    };
    let window = limit.budget.window(context.unix_us);
    let (op, outcome) = planned_bucket(rule, key, quota, cost, Some(window));
    if let Cost::Fits(cost) = cost {
        planning.checked.reserved.push(Reserved {
            outcome: planning.checked.rules.len(),
            key,
            quota,
            window_id: Some(window.id),
            cost,
            group: op.group,
            prompt_tokens: prompt,
            spend: Some(SpendPrice { price, label }),
        });
    }
    planning.ops.push(op);
    planning.checked.rules.push(outcome);
}

#[cfg(test)]
mod tests {
    use crate::engine::tests::*;
    use crate::engine::*;
    use crate::limits::clock::Clock;
    use crate::policy::compile::compile_bundle;
    use serde_json::{json, Value};

    /// A bundle pricing gpt-4o ($2.50 in, $1.25 cached, $10 out per million tokens), gpt-4o-mini
    /// and `claude-*`, with one `llm_spend` rule per team.
    fn bundle(config: Value, unknown: Value) -> Value {
        json!({"bundle_version": 1,
            "llm_prices": {"currency": "USD", "unknown_model": unknown, "models": {
                "gpt-4o": {"input_per_mtok": 2.5, "cached_input_per_mtok": 1.25, "output_per_mtok": 10},
                "gpt-4o-mini": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
                "claude-*": {"input_per_mtok": 3, "cache_write_per_mtok": 3.75,
                             "cached_input_per_mtok": 0.3, "output_per_mtok": 15}}},
            "policies": [{"id": "llm", "spec": {"rules": [{"name": "team-day",
                "limit_keys": ["header:x-team"], "on_missing": "reject", "algorithm": "llm_spend",
                "algorithm_config": config}]}}]})
    }

    fn errors(bundle: Value) -> Vec<String> {
        compile_bundle(&bundle, "t")
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn price_tables_and_spend_rules_are_checked_at_their_paths() {
        let b = compile_bundle(
            &bundle(
                json!({"budget": 25.00, "period": "1d", "timezone": "America/New_York",
                       "on_exhausted": {"fallback_model": "gpt-4o-mini"}}),
                json!("refuse"),
            ),
            "t",
        )
        .unwrap();
        let rule = &b.rules[0];
        assert_eq!(rule.quota.burst(), 25_000_000);
        assert_eq!(rule.key_prefix, "sp:team-day:");
        assert_eq!(rule.policy_item, "\"team-day\";q=25000000;w=86400");
        let spend = rule.spend().unwrap();
        assert_eq!(spend.budget.zone.name(), "America/New_York");
        assert_eq!(spend.fallback_model.as_deref(), Some("gpt-4o-mini"));
        let prices = b.llm_prices.as_deref().unwrap();
        let names: Vec<&str> = prices.models.iter().map(|e| e.pattern.as_str()).collect();
        assert_eq!(names, ["gpt-4o-mini", "gpt-4o", "claude-*"]);
        assert_eq!(prices.unknown, None);
        assert!(b.policies[0].meters_tokens && b.policies[0].enforces_tokens);
        assert_eq!(
            errors(bundle(
                json!({"budget": -1, "period": "2d", "timezone": "Mars/Olympus",
                       "on_exhausted": {"fallback_model": "llama"}}),
                json!({"input_per_mtok": 0.0000001, "output_per_mtok": "x"})
            )),
            [
                "llm_prices.unknown_model.input_per_mtok: has more than 6 decimals (amounts are held in millionths)",
                "llm_prices.unknown_model.output_per_mtok: must be a number (or a string holding one)",
                "policies[0].spec.rules[0].algorithm_config.budget: must not be negative",
                "policies[0].spec.rules[0].algorithm_config.period: must be \"1h\", \"1d\", \"1w\" or \"1M\"",
                "policies[0].spec.rules[0].algorithm_config.timezone: must be an IANA time zone name (\"America/New_York\", \"Europe/Paris\", \"UTC\")",
            ]
        );
        let mut no_table = bundle(json!({"budget": 1}), json!("refuse"));
        no_table.as_object_mut().unwrap().remove("llm_prices");
        assert_eq!(
            errors(no_table),
            ["policies[0].spec.rules[0].algorithm_config: an llm_spend rule prices requests with the bundle's llm_prices, which this bundle does not have"]
        );
        assert_eq!(
            errors(bundle(
                json!({"budget": 1, "on_exhausted": {"fallback_model": "llama"}}),
                json!("refuse")
            )),
            ["policies[0].spec.rules[0].algorithm_config.on_exhausted.fallback_model: 'llama' has no entry in llm_prices.models"]
        );
        let mut negative = bundle(json!({"budget": 1}), json!("refuse"));
        negative["llm_prices"]["models"]["gpt-4o"]["output_per_mtok"] = json!(-10);
        assert_eq!(
            errors(negative),
            ["llm_prices.models.gpt-4o.output_per_mtok: must not be negative"]
        );
        // Overlapping patterns are warnings naming the winner.
        let mut overlapping = bundle(json!({"budget": 1}), json!("refuse"));
        overlapping["llm_prices"]["models"]["claude-3*"] =
            json!({"input_per_mtok": 1, "output_per_mtok": 1});
        let b = compile_bundle(&overlapping, "t").unwrap();
        let warned: Vec<String> = b.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(
            warned,
            ["llm_prices.models.claude-*: overlaps \"claude-3*\": a model both match is priced by \"claude-3*\" (exact names first, then the pattern with more literal characters)"]
        );
    }

    fn body(model: &str, max_tokens: u64) -> String {
        format!(
            r#"{{"model": "{model}", "max_tokens": {max_tokens}, "messages": [{{"role": "user", "content": "one two three"}}]}}"#
        )
    }

    #[test]
    fn spend_is_reserved_at_the_model_price_and_settled_on_usage() {
        // $0.005 a New York day: 5 000 millionths. The clock is 2027-01-15T08:00:00Z, 03:00
        // in New York, 21 hours before its midnight.
        let (e, clock) = engine(bundle(
            json!({"budget": 0.005, "period": "1d", "timezone": "America/New_York",
                   "on_exhausted": {"fallback_model": "gpt-4o-mini"}}),
            json!("refuse"),
        ));
        let team = [("X-Team", "blue")];
        // "one two three": 4 prompt tokens at $2.50 and 100 completion tokens at $10 per
        // million: 10 + 1 000 millionths reserved.
        let d = ask_llm(&e, &body("gpt-4o", 100), &team);
        let reservation = d.reservation().unwrap();
        assert_eq!(reservation.spend.len(), 1);
        assert_eq!(reservation.spend[0].cost, 1_010);
        assert_eq!(reservation.spend[0].model, "gpt-4o");
        assert_eq!(d.rules()[0].tokens, 5_000 - 1_010);
        // It used 800 cached and 200 fresh prompt tokens and 50 of completion: 500 + 1 000
        // + 500 = 2 000 millionths, 990 more than reserved.
        let spent = Spent::Tokens(crate::request::llm::BilledTokens {
            input: 200,
            cached: 800,
            cache_write: 0,
            output: 50,
        });
        let settled = reservation.spend_settled(spent);
        assert_eq!((settled[0].reserved, settled[0].charged), (1_010, 2_000));
        e.store
            .adjust(clock.now_us(), &reservation.spend_adjustments(spent));
        // 3 000 left: two reservations of 1 010 fit, the third does not.
        for _ in 0..2 {
            assert!(ask_llm(&e, &body("gpt-4o", 100), &team).is_allowed());
        }
        let d = ask_llm(&e, &body("gpt-4o", 100), &team);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::SpendExceeded));
        assert_eq!(d.status(), 429);
        assert_eq!(Reason::SpendExceeded.as_str(), "budget_exceeded");
        assert!(Reason::SpendExceeded
            .body()
            .contains("\"code\":\"budget_exceeded\""));
        // Until midnight in New York.
        assert_eq!(d.retry_after(), 21 * 3_600);
        // The front end may send it to the fallback model instead, which costs 1 millionth
        // for the prompt and 60 for the completion.
        assert_eq!(d.spend_fallback(Some("gpt-4o")), Some("gpt-4o-mini"));
        assert_eq!(d.spend_fallback(Some("gpt-4o-mini")), None);
        assert_eq!(d.spend_fallback(None), None);
        let mini = ask_llm(&e, &body("gpt-4o-mini", 100), &team);
        assert_eq!(mini.reservation().unwrap().spend[0].cost, 61);
        // A model the table does not price is refused before the store.
        let d = ask_llm(&e, &body("llama-3", 100), &team);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::UnknownModel));
        assert!(Reason::UnknownModel
            .body()
            .contains("\"code\":\"unknown_model\""));
        // Another team has its own budget; a call dearer than the whole budget never fits
        // (its fallback may).
        let red = [("X-Team", "red")];
        assert!(ask_llm(&e, &body("gpt-4o", 100), &red).is_allowed());
        let d = ask_llm(&e, &body("gpt-4o", 1_000), &red);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
        assert_eq!(d.spend_fallback(Some("gpt-4o")), Some("gpt-4o-mini"));
        // New York's midnight renews the budget.
        clock.set_secs(21.0 * 3_600.0);
        assert!(ask_llm(&e, &body("gpt-4o", 100), &team).is_allowed());
    }

    #[test]
    fn unknown_models_may_have_a_price_and_models_match_patterns() {
        let mut b = bundle(
            json!({"budget": 1}),
            json!({"input_per_mtok": 100, "output_per_mtok": 100}),
        );
        b["policies"][0]["spec"]["rules"][0]["match"] = json!({"llm:model": "claude-*"});
        b["policies"][0]["spec"]["rules"][0]["limit_keys"] = json!(["header:x-team", "llm:model"]);
        let (e, _) = engine(b);
        let team = [("X-Team", "blue")];
        // Only Claude models are under the rule; keyed per model.
        let d = ask_llm(&e, &body("claude-3-5-sonnet", 10), &team);
        let reservation = d.reservation().unwrap();
        // 4 prompt tokens at the cache-write price (3.75) and 10 at 15: 15 + 150.
        assert_eq!(reservation.spend[0].cost, 165);
        assert_eq!(reservation.spend[0].model, "claude-*");
        assert_eq!(d.rules()[0].tokens, 1_000_000 - 165);
        // Keyed per model: another Claude model has the whole budget.
        let d = ask_llm(&e, &body("claude-3-haiku", 10), &team);
        assert_eq!(d.rules()[0].tokens, 1_000_000 - 165);
        assert!(ask_llm(&e, &body("gpt-4o", 10), &team)
            .reservation()
            .is_none());
        let mut other = bundle(
            json!({"budget": 1}),
            json!({"input_per_mtok": 100, "output_per_mtok": 100}),
        );
        other["policies"][0]["spec"]["rules"][0]["limit_keys"] = json!(["llm:model"]);
        let (e, _) = engine(other);
        let d = ask_llm(&e, &body("llama-3", 10), &team);
        assert_eq!(d.reservation().unwrap().spend[0].model, "other");
        assert_eq!(d.reservation().unwrap().spend[0].cost, 1_400);
    }
}
