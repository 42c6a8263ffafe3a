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
