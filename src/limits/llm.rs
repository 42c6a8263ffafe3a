//! `token_bucket_llm`: LLM token budgets. Compiles the rule's fields (the minute bucket, its
//! `tokens_per_day` budget rule, the prompt and completion caps, the estimator, the `streaming`
//! block) and plans a request under it: the reservation (prompt estimate + completion) taken
//! from both buckets, all-or-nothing with the request's other rules. Reading request and
//! response bodies is [`crate::request::llm`]'s; settling is the engine's [`crate::engine::Reservation`].

use super::token_bucket::{planned_bucket, Cost};
use crate::engine::decision::{Reason, Reserved};
use crate::engine::planning::{write_bucket, PlanContext, Planning, KEY_BUFFER};
use crate::limits::budget_window::{Action, Budget};
use crate::limits::limiter::{Quota, MICRO, US_PER_SEC};
use crate::policy::bundle::Bundle;
use crate::policy::compile::compiler::{key_prefix, plain_rule, Compiler, Shape};
use crate::policy::json::join;
use crate::policy::rule::{
    CostSource, LlmLimit, LlmPart, MatchCondition, Mode, OnMissing, Rule, RuleKind,
};
use crate::request::descriptor::Descriptor;
use crate::request::descriptor::RequestFacts;
use crate::store::BucketKey;
use serde_json::{Map, Value};

/// The fields of a `token_bucket_llm` rule's `streaming` block (Fairvisor's).
const LLM_STREAMING_FIELDS: &[&str] = &[
    "enabled",
    "enforce_mid_stream",
    "buffer_tokens",
    "on_limit_exceeded",
    "include_partial_usage",
];

/// Fairvisor's default `streaming.buffer_tokens`.
const DEFAULT_STREAM_BUFFER_TOKENS: u64 = 100;

/// Fairvisor's default completion reservation.
const DEFAULT_MAX_COMPLETION: u64 = 1000;

/// The fields of a `token_bucket_llm` rule's `algorithm_config` (Fairvisor's).
pub(crate) const LLM_FIELDS: &[&str] = &[
    "tokens_per_minute",
    "tokens_per_day",
    "burst_tokens",
    "max_tokens_per_request",
    "max_prompt_tokens",
    "max_completion_tokens",
    "default_max_completion",
    "token_source",
    "streaming",
];

impl Compiler {
    /// What a `token_bucket_llm` rule adds beside its bucket: the token-estimate header it
    /// reads (`header_hint`) and its `tokens_per_day` rule, shaped by the minute rule (its
    /// name, policy and mode; its keys, `match` and `on_missing`).
    pub(crate) fn llm_companions(
        &mut self,
        (limit, tokens_per_day): (&LlmLimit, Option<u64>),
        (name, policy, mode): (&str, usize, Mode),
        header_names: &mut Vec<String>,
        (limit_keys, conditions, on_missing): (&[Descriptor], &[MatchCondition], OnMissing),
    ) {
        if limit.estimator == crate::request::llm::Estimator::HeaderHint {
            header_names.push(crate::request::llm::TOKEN_ESTIMATE_HEADER.to_string());
        }
        let Some(tpd) = tokens_per_day else {
            return;
        };
        let day = self.llm_day_rule(
            name,
            policy,
            mode,
            tpd,
            limit,
            (limit_keys, conditions, on_missing, header_names),
        );
        if let Some(day) = day {
            self.day_rules.push((self.rules.len(), day));
        }
    }

    /// The `tokens_per_day` rule of a `token_bucket_llm` rule: a one-day UTC budget named
    /// `<rule>:tpd` (with `@<policy id>` on a clash), keyed `tpd:<rule>:`, sharing the minute
    /// rule's keys and limits (`minute`).
    #[allow(clippy::too_many_arguments)]
    fn llm_day_rule(
        &mut self,
        minute_name: &str,
        policy: usize,
        mode: Mode,
        tpd: u64,
        minute: &LlmLimit,
        (limit_keys, conditions, on_missing, header_names): (
            &[Descriptor],
            &[MatchCondition],
            OnMissing,
            &[String],
        ),
    ) -> Option<Rule> {
        let name = self.unclaimed_name(&format!("{minute_name}:tpd"));
        self.rule_names
            .insert(name.clone(), format!("{minute_name}.tokens_per_day"));
        let period = crate::limits::budget_window::Period::Day;
        let quota =
            Quota::new(tpd * MICRO, tpd * MICRO, period.nominal_secs() * US_PER_SEC).ok()?;
        Some(Rule {
            limit_keys: limit_keys.to_vec(),
            conditions: conditions.to_vec(),
            cost: CostSource::Fixed(0),
            on_missing,
            key_prefix: key_prefix("tpd", minute_name, mode),
            header_names: header_names.to_vec(),
            kind: RuleKind::Llm(LlmLimit {
                part: LlmPart::Day(Budget {
                    period,
                    stages: vec![crate::limits::budget_window::Stage {
                        threshold_percent: 100.0,
                        action: Action::Reject,
                    }],
                    zone: crate::limits::budget_window::Zone::Utc,
                    notify_at: Vec::new(),
                }),
                ..minute.clone()
            }),
            ..plain_rule(name, policy, mode, quota, period.nominal_secs())
        })
    }

    /// A `token_bucket_llm` rule's fields (Fairvisor's names and checks): `tokens_per_minute`
    /// (required), `tokens_per_day`, `burst_tokens` (default and minimum `tokens_per_minute`),
    /// `max_tokens_per_request`, `max_prompt_tokens`, `max_completion_tokens`,
    /// `default_max_completion` (default 1000) and `token_source.estimator` (`simple_word`, the
    /// default, or `header_hint`). Returns the minute bucket's shape, the limits and the daily
    /// budget.
    pub(crate) fn llm(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<(Shape, LlmLimit, Option<u64>)> {
        let errors_before = self.errors.len();
        let range = 1..=crate::request::llm::MAX_TOKENS;
        if !config.contains_key("tokens_per_minute") {
            self.error(&join(path, "tokens_per_minute"), "is required");
        }
        let tpm = self.whole(config, path, "tokens_per_minute", range.clone(), false);
        let tpd = self.whole(config, path, "tokens_per_day", range.clone(), false);
        let burst = self.whole(config, path, "burst_tokens", range.clone(), false);
        let max_request = self.whole(config, path, "max_tokens_per_request", range.clone(), false);
        let max_prompt = self.whole(config, path, "max_prompt_tokens", range.clone(), false);
        let max_completion =
            self.whole(config, path, "max_completion_tokens", range.clone(), false);
        let default_completion = self
            .whole(config, path, "default_max_completion", range, false)
            .unwrap_or(DEFAULT_MAX_COMPLETION);
        if let (Some(tpm), Some(burst)) = (tpm, burst) {
            if burst < tpm {
                self.error(&join(path, "burst_tokens"), "must be >= tokens_per_minute");
            }
        }
        let estimator = self.llm_estimator(config, path);
        let stream_cap = match config.get("streaming") {
            None => Some(None),
            // An invalid `max_completion_tokens` is reported once, at its own path.
            Some(v) => self.llm_streaming(
                v,
                &join(path, "streaming"),
                max_completion.ok_or(config.contains_key("max_completion_tokens")),
            ),
        };
        if self.errors.len() > errors_before {
            return None;
        }
        let (tpm, estimator, stream_cap) = (tpm?, estimator?, stream_cap?);
        let burst = burst.unwrap_or(tpm);
        let quota = Quota::new(burst * MICRO, tpm * MICRO, 60 * US_PER_SEC).ok()?;
        Some((
            Shape {
                quota,
                burst: burst as f64,
                rate: tpm as f64 / 60.0,
            },
            LlmLimit {
                part: LlmPart::Minute,
                day_rule: None,
                max_prompt_tokens: max_prompt,
                max_tokens_per_request: max_request,
                max_completion_tokens: max_completion,
                default_max_completion: max_completion
                    .map_or(default_completion, |max| default_completion.min(max)),
                estimator,
                stream_cap,
            },
            tpd,
        ))
    }

    /// A rule's `token_source` (`token_bucket_llm` and `llm_spend`): `estimator` is
    /// `simple_word` (the default), `header_hint` or `tiktoken` (with its `encoding`).
    pub(crate) fn llm_estimator(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<crate::request::llm::Estimator> {
        match config.get("token_source") {
            None => Some(crate::request::llm::Estimator::SimpleWord),
            Some(v) => {
                let sp = join(path, "token_source");
                self.object(v, &sp, &["estimator", "encoding"])
                    .and_then(|m| {
                        let encoding = match m.get("encoding").map(|e| e.as_str()) {
                            None => Some(crate::request::llm::TokenEncoding::O200kBase),
                            Some(Some(name)) => crate::request::llm::TokenEncoding::parse(name),
                            Some(None) => None,
                        };
                        let estimator = m.get("estimator").map(|e| e.as_str());
                        if m.contains_key("encoding") && estimator != Some(Some("tiktoken")) {
                            self.error(
                                &join(&sp, "encoding"),
                                "only goes with \"estimator\": \"tiktoken\"",
                            );
                            return None;
                        }
                        match estimator {
                            None | Some(Some("simple_word")) => {
                                Some(crate::request::llm::Estimator::SimpleWord)
                            }
                            Some(Some("header_hint")) => {
                                Some(crate::request::llm::Estimator::HeaderHint)
                            }
                            Some(Some("tiktoken")) => match encoding {
                                Some(encoding) => {
                                    Some(crate::request::llm::Estimator::Tiktoken(encoding))
                                }
                                None => {
                                    self.error(
                                        &join(&sp, "encoding"),
                                        "must be \"o200k_base\" or \"cl100k_base\"",
                                    );
                                    None
                                }
                            },
                            Some(_) => {
                                self.error(
                                    &join(&sp, "estimator"),
                                    "must be \"simple_word\", \"header_hint\" or \"tiktoken\"",
                                );
                                None
                            }
                        }
                    })
            }
        }
    }

    /// A `token_bucket_llm` rule's `streaming` block (Fairvisor's fields and defaults once the
    /// block is written): `enabled` and `enforce_mid_stream` (default true), `buffer_tokens`
    /// (default 100), `on_limit_exceeded` (`graceful_close`, the default, or `error_chunk`) and
    /// `include_partial_usage` (default true). `Some(None)` when streams are not stopped;
    /// stopping needs the rule's `max_completion_tokens` (`Err(true)`: written but invalid,
    /// already reported; `Err(false)`: absent).
    pub(crate) fn llm_streaming(
        &mut self,
        v: &Value,
        path: &str,
        max_completion: Result<u64, bool>,
    ) -> Option<Option<crate::request::llm::StreamCap>> {
        let map = self.object(v, path, LLM_STREAMING_FIELDS)?;
        let enabled = self.flag(map, path, "enabled", true);
        let enforce = self.flag(map, path, "enforce_mid_stream", true);
        let include_partial_usage = self.flag(map, path, "include_partial_usage", true);
        let buffer_tokens = self
            .whole(
                map,
                path,
                "buffer_tokens",
                1..=crate::request::llm::MAX_TOKENS,
                false,
            )
            .unwrap_or(DEFAULT_STREAM_BUFFER_TOKENS);
        let on_exceeded = match map.get("on_limit_exceeded").map(Value::as_str) {
            None | Some(Some("graceful_close")) => {
                Some(crate::request::llm::StreamCutStyle::GracefulClose)
            }
            Some(Some("error_chunk")) => Some(crate::request::llm::StreamCutStyle::ErrorChunk),
            Some(_) => {
                self.error(
                    &join(path, "on_limit_exceeded"),
                    "must be \"graceful_close\" or \"error_chunk\"",
                );
                None
            }
        };
        let (enabled, enforce, include_partial_usage, on_exceeded) =
            (enabled?, enforce?, include_partial_usage?, on_exceeded?);
        if !(enabled && enforce) {
            return Some(None);
        }
        let max_completion_tokens = match max_completion {
            Ok(max) => max,
            Err(written_but_invalid) => {
                if !written_but_invalid {
                    self.error(
                        path,
                        "stops streams past max_completion_tokens, which this rule does not set",
                    );
                }
                return None;
            }
        };
        Some(Some(crate::request::llm::StreamCap {
            max_completion_tokens,
            buffer_tokens,
            on_exceeded,
            include_partial_usage,
        }))
    }
}

/// What a request asks of the model, as a rule counts it: the prompt (by its `estimator`: the
/// `X-Token-Estimate` hint, the body's estimate or its exact count) and the completion it may
/// produce (`max_tokens`, at most `max_completion`, else `default_completion`).
pub(crate) fn asked_tokens(
    facts: &RequestFacts<'_>,
    estimator: crate::request::llm::Estimator,
    default_completion: u64,
    max_completion: Option<u64>,
) -> (u64, u64) {
    let unread = crate::request::llm::LlmRequest::default();
    let body = facts.llm.unwrap_or(&unread);
    let prompt = match estimator {
        crate::request::llm::Estimator::HeaderHint => facts
            .headers
            .header_text(crate::request::llm::TOKEN_ESTIMATE_HEADER)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(body.prompt_tokens),
        estimator => body.prompt_for(estimator),
    };
    let completion = body.max_completion.unwrap_or(default_completion);
    let completion = max_completion.map_or(completion, |max| completion.min(max));
    (prompt, completion)
}

/// The tokens a `token_bucket_llm` rule reserves for this request: the prompt estimate and the
/// completion it may produce (`max_tokens`, at most `max_completion_tokens`, else the rule's
/// default), with the prompt estimate alone; or why the request can never be admitted.
///
/// # Errors
/// `prompt_tokens_exceeded` or `max_tokens_per_request_exceeded` (also for a reservation the
/// rule's burst or daily budget can never hold).
pub fn llm_reservation(
    rule: &Rule,
    bundle: &Bundle,
    facts: &RequestFacts<'_>,
) -> Result<(u64, u64), Reason> {
    let Some(limit) = rule.llm() else {
        return Ok((0, 0));
    };
    let (prompt, completion) = asked_tokens(
        facts,
        limit.estimator,
        limit.default_max_completion,
        limit.max_completion_tokens,
    );
    if limit.max_prompt_tokens.is_some_and(|max| prompt > max) {
        return Err(Reason::PromptTokensExceeded);
    }
    let tokens = prompt.saturating_add(completion);
    let day_budget = limit
        .day_rule
        .map_or(u64::MAX, |d| bundle.rules[d].quota.burst());
    let never_fits =
        tokens.saturating_mul(crate::limits::limiter::MICRO) > rule.quota.burst().min(day_budget);
    if never_fits || limit.max_tokens_per_request.is_some_and(|max| tokens > max) {
        return Err(Reason::MaxTokensPerRequestExceeded);
    }
    Ok((tokens, prompt))
}

/// Plans a `token_bucket_llm` rule: its minute bucket and its daily budget (the same key under
/// `tpd:`), both costing the reservation, all-or-nothing with the request's other rules. A
/// request the rule can never admit is refused before the store (in shadow: reported as a
/// would-refusal that cannot fit).
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    limit: &LlmLimit,
    (key, quota): (BucketKey, Quota),
    facts: &RequestFacts<'_>,
    context: PlanContext<'b>,
    planning: &mut Planning<'b>,
) {
    let PlanContext {
        bundle,
        unix_us,
        ipv6_prefix: prefix,
    } = context;
    let (cost, prompt_tokens) = match llm_reservation(rule, bundle, facts) {
        Ok((tokens, prompt)) => (Cost::Fits(tokens * crate::limits::limiter::MICRO), prompt),
        Err(reason) if rule.mode == Mode::Enforce => {
            planning.refused.get_or_insert((rule, reason));
            return;
        }
        Err(_) => (Cost::Exceeds, 0),
    };
    let day = limit.day_rule.map(|d| &bundle.rules[d]);
    let day_key = day.and_then(|day| {
        KEY_BUFFER.with(|buffer| {
            let mut bucket = buffer.borrow_mut();
            write_bucket(day, facts, prefix, &mut bucket).then(|| BucketKey::of(&bucket))
        })
    });
    let parts =
        std::iter::once((rule, key, quota, None)).chain(day.zip(day_key).map(|(day, k)| {
            (
                day,
                k,
                day.quota,
                Some(crate::limits::budget_window::Period::Day.window(unix_us)),
            )
        }));
    for (rule, key, quota, window) in parts {
        let (op, outcome) = planned_bucket(rule, key, quota, cost, window);
        if let Cost::Fits(cost) = cost {
            planning.checked.reserved.push(Reserved {
                outcome: planning.checked.rules.len(),
                key,
                quota,
                window_id: window.map(|w| w.id),
                cost,
                group: op.group,
                prompt_tokens,
                spend: None,
            });
        }
        planning.ops.push(op);
        planning.checked.rules.push(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::compile::compile_bundle;
    use crate::policy::compile::tests::{errors_of, llm_rule};
    use serde_json::json;

    /// Issue 27: the `tiktoken` estimator and its encoding; the bundle says which encodings
    /// its front ends must count.
    #[test]
    fn tiktoken_estimators_name_their_encoding() {
        use crate::request::llm::{Estimator, TokenEncoding};
        let rule =
            |source: Value| llm_rule(json!({"tokens_per_minute": 600, "token_source": source}));
        let b = compile_bundle(
            &rule(json!({"estimator": "tiktoken", "encoding": "cl100k_base"})),
            "t",
        )
        .unwrap();
        assert_eq!(
            b.rules[0].llm().unwrap().estimator,
            Estimator::Tiktoken(TokenEncoding::Cl100kBase)
        );
        assert_eq!(b.tiktoken, TokenEncoding::Cl100kBase.bit());
        let b = compile_bundle(&rule(json!({"estimator": "tiktoken"})), "t").unwrap();
        assert_eq!(b.tiktoken, TokenEncoding::O200kBase.bit());
        let b = compile_bundle(&rule(json!({"estimator": "simple_word"})), "t").unwrap();
        assert_eq!(b.tiktoken, 0);
        for (source, message) in [
            (
                json!({"estimator": "tiktoken", "encoding": "p50k"}),
                "rules[0].algorithm_config.token_source.encoding: must be \"o200k_base\" or \"cl100k_base\"",
            ),
            (
                json!({"estimator": "simple_word", "encoding": "o200k_base"}),
                "rules[0].algorithm_config.token_source.encoding: only goes with \"estimator\": \"tiktoken\"",
            ),
            (
                json!({"estimator": "bpe"}),
                "rules[0].algorithm_config.token_source.estimator: must be \"simple_word\", \"header_hint\" or \"tiktoken\"",
            ),
        ] {
            let errors = compile_bundle(&rule(source), "t").unwrap_err();
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].to_string(), message);
        }
    }

    #[test]
    fn llm_rules_check_fairvisor_fields_and_streaming() {
        let b = compile_bundle(
            &llm_rule(json!({"tokens_per_minute": 600, "tokens_per_day": 9000,
                "max_completion_tokens": 300, "default_max_completion": 500,
                "streaming": {"buffer_tokens": 50, "on_limit_exceeded": "error_chunk",
                              "include_partial_usage": false}})),
            "t",
        )
        .unwrap();
        let llm = b.rules[0].llm().unwrap();
        assert_eq!((&llm.part, llm.day_rule), (&LlmPart::Minute, Some(1)));
        // The default completion never asks for more than the cap.
        assert_eq!(llm.default_max_completion, 300);
        assert_eq!(
            llm.stream_cap,
            Some(crate::request::llm::StreamCap {
                max_completion_tokens: 300,
                buffer_tokens: 50,
                on_exceeded: crate::request::llm::StreamCutStyle::ErrorChunk,
                include_partial_usage: false,
            })
        );
        assert_eq!(b.rules[1].name, "chat:tpd");
        assert!(matches!(
            b.rules[1].llm().map(|l| &l.part),
            Some(LlmPart::Day(_))
        ));
        // No `streaming` block, or one turned off: streams run to their end.
        for streaming in [
            None,
            Some(json!({"enforce_mid_stream": false})),
            Some(json!({"enabled": false})),
        ] {
            let mut config = json!({"tokens_per_minute": 600, "max_completion_tokens": 300});
            if let Some(s) = streaming {
                config["streaming"] = s;
            }
            let b = compile_bundle(&llm_rule(config), "t").unwrap();
            assert_eq!(b.rules[0].llm().unwrap().stream_cap, None);
        }
        // Written with only Fairvisor's defaults: graceful close, 100 tokens of buffer.
        let b = compile_bundle(
            &llm_rule(
                json!({"tokens_per_minute": 600, "max_completion_tokens": 300, "streaming": {}}),
            ),
            "t",
        )
        .unwrap();
        assert_eq!(
            b.rules[0].llm().unwrap().stream_cap.map(|c| (
                c.limit(),
                c.on_exceeded,
                c.include_partial_usage
            )),
            Some((
                400,
                crate::request::llm::StreamCutStyle::GracefulClose,
                true
            ))
        );
        assert_eq!(
            errors_of(llm_rule(json!({"tokens_per_minute": 600, "burst_tokens": 10,
                "streaming": {"buffer_tokens": 0, "on_limit_exceeded": "cut", "enabled": "yes", "speed": 1}}))),
            [
                "rules[0].algorithm_config.burst_tokens: must be >= tokens_per_minute",
                "rules[0].algorithm_config.streaming.speed: unknown field (expected one of: enabled, enforce_mid_stream, buffer_tokens, on_limit_exceeded, include_partial_usage)",
                "rules[0].algorithm_config.streaming.enabled: must be a boolean, found a string",
                "rules[0].algorithm_config.streaming.buffer_tokens: must be a whole number from 1 to 1000000000",
                "rules[0].algorithm_config.streaming.on_limit_exceeded: must be \"graceful_close\" or \"error_chunk\"",
            ]
        );
        assert_eq!(
            errors_of(llm_rule(json!({"tokens_per_minute": 600, "streaming": {"enforce_mid_stream": true}}))),
            ["rules[0].algorithm_config.streaming: stops streams past max_completion_tokens, which this rule does not set"]
        );
        // An invalid max_completion_tokens is reported once, where it is.
        assert_eq!(
            errors_of(llm_rule(
                json!({"tokens_per_minute": 600, "max_completion_tokens": 0, "streaming": {}})
            )),
            ["rules[0].algorithm_config.max_completion_tokens: must be a whole number from 1 to 1000000000"]
        );
    }

    // The engine's view: requests decided under this kind's rules.
    mod decided {
        use crate::engine::tests::*;
        use crate::engine::*;
        use crate::limits::clock::Clock;
        use crate::limits::limiter::MICRO;
        use serde_json::json;

        #[test]
        fn a_stream_is_stopped_at_the_tightest_enforced_cap() {
            let rule = |name: &str, max: u64, buffer: u64| {
                json!({"name": name, "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket_llm",
                       "algorithm_config": {"tokens_per_minute": 100000, "max_completion_tokens": max,
                                            "streaming": {"buffer_tokens": buffer}}})
            };
            // The shadow policy's cap (5 + 1) would be the tightest: shadow mode changes no
            // response, so the enforced ones decide (100 + 50 beats 120 + 100).
            let (e, _) = engine(json!({"bundle_version": 1, "policies": [
                {"id": "live", "spec": {"rules": [rule("wide", 120, 100), rule("tight", 100, 50)]}},
                {"id": "trial", "spec": {"mode": "shadow", "rules": [rule("trial", 5, 1)]}}]}));
            let body = r#"{"max_tokens": 800, "messages": [{"role": "user", "content": "one two three"}]}"#;
            let d = ask_llm(&e, body, &[("X-Api-Key", "t")]);
            let reservation = d.reservation().unwrap();
            let caps: Vec<(&str, Option<u64>)> = reservation
                .rules
                .iter()
                .map(|r| (r.rule.as_str(), r.stream_cap.map(|c| c.limit())))
                .collect();
            assert_eq!(
                caps,
                [("wide", Some(220)), ("tight", Some(150)), ("trial", None)]
            );
            assert_eq!(reservation.stream_cap().map(|c| c.limit()), Some(150));
            assert_eq!(reservation.prompt_tokens(), 4);
            // A usage past any policy's reach settles as the largest one, in every store's range.
            let over = reservation.adjustments(u64::MAX);
            assert_eq!(
                over[0].delta,
                (crate::request::llm::MAX_TOKENS * MICRO - reservation.ops[0].cost) as i64
            );
            assert_eq!(
                reservation.settled(u64::MAX).used,
                crate::request::llm::MAX_TOKENS
            );
        }

        #[test]
        fn llm_reservations_are_settled_by_real_usage() {
            // 1 200 tokens a minute (20 a second), 2 000 of burst, 5 000 a UTC day.
            let (e, clock) = engine(
                json!({"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
                "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 1200,
                "burst_tokens": 2000, "tokens_per_day": 5000, "max_prompt_tokens": 100,
                "max_tokens_per_request": 1500, "default_max_completion": 500}}]}),
            );
            let key = [("X-Api-Key", "tenant-a")];
            // "one two three": 3 words → 4 tokens; 800 asked: 804 reserved on both budgets.
            let body = r#"{"max_tokens": 800, "messages": [{"role": "user", "content": "one two three"}]}"#;
            let d = ask_llm(&e, body, &key);
            assert!(d.is_allowed());
            let tokens: Vec<(&str, u64)> = d
                .rules()
                .iter()
                .map(|o| (o.rule.name.as_str(), o.tokens / MICRO))
                .collect();
            assert_eq!(tokens, [("chat", 1196), ("chat:tpd", 4196)]);
            assert_eq!(bucket(&d, 1, "10.0.0.1", &key), "tpd:chat:tenant-a");
            let reservation = d.reservation().unwrap();
            assert_eq!(reservation.tokens(), 804);
            assert_eq!(reservation.rules[0].prompt_tokens, 4);
            // 300 really used: 504 back on each.
            let adjust = reservation.adjustments(300);
            assert_eq!(
                adjust.iter().map(|a| a.delta).collect::<Vec<_>>(),
                [-504 * MICRO as i64; 2]
            );
            e.store.adjust(clock.now_us(), &adjust);
            let d = ask_llm(&e, body, &key);
            let tokens: Vec<u64> = d.rules().iter().map(|o| o.tokens / MICRO).collect();
            assert_eq!(tokens, [1700 - 804, 4700 - 804]);
            e.store
                .adjust(clock.now_us(), &d.reservation().unwrap().adjustments(300));
            // Without max_tokens the default completion is reserved: 504.
            let d = ask_llm(&e, r#"{"messages": [{"content": "one two three"}]}"#, &key);
            assert_eq!(d.rules()[0].tokens / MICRO, 1400 - 504);
            // An overrun puts the minute bucket in debt: 896 left, 2 000 used beyond 504.
            e.store
                .adjust(clock.now_us(), &d.reservation().unwrap().adjustments(2504));
            let d = ask_llm(&e, body, &key);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::TpmExceeded));
            // 1 104 of debt (55.2 s) and then 804 to refill (40.2 s).
            assert_eq!(d.retry_after(), 96);
            assert_eq!(d.status(), 429);
            // The minute bucket holds 804 again after 95.4 s; the day has used 300 + 300 + 2 504.
            clock.set_secs(96.0);
            let d = ask_llm(&e, body, &key);
            assert_eq!(d.rules()[1].tokens / MICRO, 5000 - 3104 - 804);
            // 1 896 really used: the day budget is spent (and the minute bucket in debt again).
            e.store
                .adjust(clock.now_us(), &d.reservation().unwrap().adjustments(1896));
            let d = ask_llm(&e, body, &key);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::TpdExceeded));
            assert_eq!(d.rules()[1].tokens, 0);
            // Until UTC midnight (16 h after the origin, 08:00), minus the 96 s gone.
            assert_eq!(d.retry_after(), 16 * 3600 - 96);
            // Requests too large for the rule are refused before any bucket.
            let long = format!(r#"{{"messages": [{{"content": "{}"}}]}}"#, "w ".repeat(100));
            assert_eq!(
                ask_llm(&e, &long, &key).outcome(),
                Outcome::Reject(Reason::PromptTokensExceeded)
            );
            let big = r#"{"max_tokens": 1600, "messages": []}"#;
            assert_eq!(
                ask_llm(&e, big, &key).outcome(),
                Outcome::Reject(Reason::MaxTokensPerRequestExceeded)
            );
            assert_eq!(Reason::TpmExceeded.content_type(), "application/json");
            // Another tenant has its own budgets.
            assert!(ask_llm(&e, body, &[("X-Api-Key", "tenant-b")]).is_allowed());
        }

        #[test]
        fn header_hints_and_completion_caps() {
            let (e, _clock) = engine(json!({"rules": [{"name": "chat", "limit_keys": [],
                "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 10000,
                "max_completion_tokens": 300, "token_source": {"estimator": "header_hint"}}}]}));
            let body = r#"{"max_tokens": 800, "messages": [{"content": "one two three"}]}"#;
            // The client's estimate (50) and the completion cap (300).
            let d = ask_llm(&e, body, &[("X-Token-Estimate", "50")]);
            assert_eq!(d.reservation().unwrap().tokens(), 350);
            // No hint (or a bad one): the body's estimate.
            let d = ask_llm(&e, body, &[("X-Token-Estimate", "lots")]);
            assert_eq!(d.reservation().unwrap().tokens(), 304);
            // Fairvisor's default completion (1 000) is capped too.
            let d = ask_llm(&e, r#"{"prompt": "a"}"#, &[]);
            assert_eq!(d.reservation().unwrap().tokens(), 302);
        }
    }
}
