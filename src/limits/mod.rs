//! One module per limit kind: each compiles its own wire fields (as `impl Compiler` blocks
//! beside `policy::compile`, which keeps what every rule shares: selectors, `match`,
//! keys, modes, kill switches) and plans a request under a rule of its kind for the engine
//! ([`crate::engine`] keeps what is common: selection, keys, kill switches, all-or-nothing
//! commit, shadow).
//!
//! [`LimitKind`] is the `algorithm` a rule names: `Compiler::kind_config` hands its
//! `algorithm_config` to its module and gets back the rule's [`RuleKind`] (the kind with its
//! part, built once); `limits::plan` matches on that kind and hands a request's bucket under
//! the rule to the same module, which adds its store operations and outcomes to the request's
//! `Planning`.
//!
//! The calls only go down: this file and the engine call the kinds; a kind reads the planning
//! vocabulary (`engine/planning.rs`, `engine/decision.rs`) and the compiler's
//! shared readers (`policy/compile/compiler.rs`), never this file, the engine's
//! `mod.rs` or the compiler's.
//!
//! - [`token_bucket`]: bucket shapes and request costs, shared by every bucketed kind;
//! - [`pacing`]: a token bucket's `delay` (paced bursts, as nginx `limit_req`);
//! - [`budget`]: `cost_based` budgets and their stages;
//! - [`concurrency`]: in-flight caps;
//! - [`llm`]: `token_bucket_llm` token budgets;
//! - [`spend`]: `llm_spend` budgets in money, priced by [`prices`];
//! - [`guards`]: loop detection and circuit breakers (a policy's guards, planned before its
//!   rules);
//! - [`response`]: what a counting rule reads from the response (`count_when`, a
//!   response-priced cost, the penalty box).

pub mod budget_window;
pub mod clock;
pub mod limiter;

pub mod budget;
pub mod concurrency;
pub mod guards;
pub mod llm;
pub mod pacing;
pub mod prices;
pub mod response;
pub mod spend;
pub mod token_bucket;

use crate::engine::planning::{PlanContext, Planning};
use crate::limits::limiter::{Quota, MICRO};
use crate::policy::compile::compiler::{Compiler, Shape, CONFIG_FIELDS};
use crate::policy::json::join;
use crate::policy::rule::{CostSource, Rule, RuleKind};
use crate::request::descriptor::RequestFacts;
use crate::store::BucketKey;
use serde_json::{Map, Value};

/// The `algorithm` of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    TokenBucket,
    CostBased,
    Concurrency,
    Llm,
    Spend,
}

impl LimitKind {
    /// The kind an `algorithm` names, if any.
    pub fn named(algorithm: &str) -> Option<LimitKind> {
        match algorithm {
            "token_bucket" => Some(LimitKind::TokenBucket),
            "cost_based" => Some(LimitKind::CostBased),
            "concurrency" => Some(LimitKind::Concurrency),
            "token_bucket_llm" => Some(LimitKind::Llm),
            "llm_spend" => Some(LimitKind::Spend),
            _ => None,
        }
    }

    /// The fields its `algorithm_config` may have.
    pub fn config_fields(self) -> &'static [&'static str] {
        match self {
            LimitKind::TokenBucket => CONFIG_FIELDS,
            LimitKind::CostBased => budget::COST_BASED_FIELDS,
            LimitKind::Concurrency => concurrency::CONCURRENCY_FIELDS,
            LimitKind::Llm => llm::LLM_FIELDS,
            LimitKind::Spend => spend::SPEND_FIELDS,
        }
    }

    /// Whether a rule of this kind may carry per-ID `overrides` (the others write one rule per
    /// tier with `match`).
    fn takes_overrides(self) -> bool {
        self == LimitKind::TokenBucket
    }

    /// The tag a rule's bucket keys start with (`tb:<name>:`): one namespace per kind.
    pub(crate) fn key_tag(self) -> &'static str {
        match self {
            LimitKind::TokenBucket => "tb",
            LimitKind::CostBased => "cb",
            LimitKind::Concurrency => "cc",
            LimitKind::Llm => "tpm",
            LimitKind::Spend => "sp",
        }
    }

    fn name(self) -> &'static str {
        match self {
            LimitKind::TokenBucket => "token_bucket",
            LimitKind::CostBased => "cost_based",
            LimitKind::Concurrency => "concurrency",
            LimitKind::Llm => "token_bucket_llm",
            LimitKind::Spend => "llm_spend",
        }
    }
}

/// Plans this request under `rule` in its bucket (the key and the quota that applies to it),
/// by the rule's kind: the one classification of a compiled rule ([`RuleKind`]), matched here
/// once per rule. A guard's rule is planned by [`guards`] before the policy's rules and never
/// comes here; were it to, it would be a plain bucket.
#[inline]
pub(crate) fn plan<'b>(
    (rule, bucket): (&'b Rule, (BucketKey, Quota)),
    facts: &RequestFacts<'_>,
    context: PlanContext<'b>,
    planning: &mut Planning<'b>,
) {
    match &rule.kind {
        RuleKind::TokenBucket | RuleKind::Guard(_) => {
            token_bucket::plan(rule, bucket, facts, None, planning);
        }
        RuleKind::Budget(budget) => budget::plan(rule, budget, bucket, facts, context, planning),
        RuleKind::Concurrency(c) => concurrency::plan(rule, *c, bucket.0, planning),
        RuleKind::Llm(limit) => llm::plan(rule, limit, bucket, facts, context, planning),
        RuleKind::Spend(limit) => spend::plan(rule, limit, bucket, facts, context, planning),
    }
}

/// What a rule's `algorithm_config` compiled to: its bucket's shape and cost (`None` after an
/// error), and its kind with that kind's part.
pub(crate) struct KindParts {
    pub(crate) shape: Option<Shape>,
    pub(crate) cost: Option<CostSource>,
    pub(crate) kind: RuleKind,
    /// A `token_bucket_llm` rule's `tokens_per_day` (its own budget rule, added beside it).
    pub(crate) tokens_per_day: Option<u64>,
    /// A counting rule's `count_when` and `penalty` ([`response`]).
    pub(crate) after_response: Option<std::sync::Arc<crate::policy::rule::AfterResponse>>,
    /// A `token_bucket` rule's `delay`.
    pub(crate) pacing: Option<pacing::Pacing>,
    /// A `token_bucket` rule's `burst_from`.
    pub(crate) burst_from: Option<Box<crate::policy::rule::BurstFrom>>,
}

impl Default for KindParts {
    fn default() -> Self {
        KindParts {
            shape: None,
            cost: None,
            kind: RuleKind::TokenBucket,
            tokens_per_day: None,
            after_response: None,
            pacing: None,
            burst_from: None,
        }
    }
}

impl Compiler {
    /// Compiles a rule's `algorithm_config` (at `rule_path`) as its kind says.
    pub(crate) fn kind_config(
        &mut self,
        kind: LimitKind,
        config: &Map<String, Value>,
        rule_path: &str,
        has_overrides: bool,
    ) -> KindParts {
        let path = join(rule_path, "algorithm_config");
        if has_overrides && !kind.takes_overrides() {
            self.error(
                &join(rule_path, "overrides"),
                format!(
                    "is not supported on {} rules (write one rule per tier with match)",
                    kind.name()
                ),
            );
        }
        match kind {
            LimitKind::TokenBucket => {
                let shape = self.bucket_shape(config, &path, None);
                KindParts {
                    pacing: self.pacing(config, &path, shape.as_ref()),
                    burst_from: self.burst_from(config, &path, shape.as_ref()),
                    shape,
                    cost: self.cost_source(config, &path),
                    after_response: self.after_response(config, &path),
                    ..KindParts::default()
                }
            }
            LimitKind::CostBased => match self.budget(config, &path) {
                Some((shape, cost, budget)) => KindParts {
                    shape: Some(shape),
                    cost: Some(cost),
                    kind: RuleKind::Budget(budget),
                    after_response: self.after_response(config, &path),
                    ..KindParts::default()
                },
                None => KindParts::default(),
            },
            LimitKind::Concurrency => {
                let Some(c) = self.concurrency(config, &path) else {
                    return KindParts::default();
                };
                // A slot is a bucket of `max_in_flight` tokens that never refills: leases give
                // them back.
                let max = u64::from(c.max_in_flight) * MICRO;
                KindParts {
                    shape: Quota::new(max, max, c.lease_ttl_us)
                        .ok()
                        .map(|quota| Shape {
                            quota,
                            burst: f64::from(c.max_in_flight),
                            rate: 0.0,
                        }),
                    cost: Some(CostSource::Fixed(MICRO)),
                    kind: RuleKind::Concurrency(c),
                    ..KindParts::default()
                }
            }
            LimitKind::Llm => match self.llm(config, &path) {
                Some((shape, limit, tpd)) => KindParts {
                    shape: Some(shape),
                    cost: Some(CostSource::Fixed(0)),
                    kind: RuleKind::Llm(limit),
                    tokens_per_day: tpd,
                    ..KindParts::default()
                },
                None => KindParts::default(),
            },
            LimitKind::Spend => match self.spend(config, &path) {
                Some((shape, limit)) => KindParts {
                    shape: Some(shape),
                    cost: Some(CostSource::Fixed(0)),
                    kind: RuleKind::Spend(limit),
                    ..KindParts::default()
                },
                None => KindParts::default(),
            },
        }
    }
}

/// The quota fields a runtime override of `rule` may set (`None`: its kind takes none): a
/// `token_bucket` rule's are those of the bundle's `overrides`, a `cost_based` rule's its
/// `budget`.
pub(crate) fn key_override_fields(rule: &Rule) -> Option<&'static [&'static str]> {
    match rule.kind {
        RuleKind::TokenBucket => Some(&CONFIG_FIELDS[..5]),
        RuleKind::Budget(_) => Some(budget::KEY_OVERRIDE_FIELDS),
        _ => None,
    }
}

/// A runtime override's quota over `rule`'s own, by the rule's kind (one that
/// [`key_override_fields`] names fields for).
pub(crate) fn key_override_quota(
    compiler: &mut Compiler,
    fields: &Map<String, Value>,
    rule: &Rule,
) -> Option<Quota> {
    match rule.kind {
        RuleKind::Budget(_) => compiler.key_override_budget(fields, rule),
        _ => compiler.key_override_bucket(fields, rule),
    }
}
