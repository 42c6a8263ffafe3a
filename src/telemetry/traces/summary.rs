//! What a trace's SERVER span says of a decision: the `tollgate.*` attributes, read once from
//! the engine's [`Decision`] for a recorded request (an unrecorded one makes no summary).

use crate::engine::{Decision, Reason, RefusedBy, RuleOutcome};
use crate::policy::Mode;

/// A decision as a span's attributes tell it (`tollgate.decision`, `tollgate.policy`,
/// `tollgate.rule`, `tollgate.reason`, `tollgate.remaining`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionSummary {
    /// `allow`, `refuse`, or `shadow_refuse` (allowed; a shadow rule would have refused it).
    pub decision: &'static str,
    pub policy: Option<String>,
    pub rule: Option<String>,
    /// The refusal's (or shadow refusal's) reason; `no_policy` when none is loaded.
    pub reason: Option<&'static str>,
    /// Requests left on the tightest enforced rule (`RateLimit-Remaining`'s value).
    pub remaining: Option<u64>,
}

impl DecisionSummary {
    /// The summary of a refusal made before any rule was read (an encoded slash).
    pub fn refused(reason: Reason) -> DecisionSummary {
        DecisionSummary {
            decision: "refuse",
            policy: None,
            rule: None,
            reason: Some(reason.as_str()),
            remaining: None,
        }
    }

    /// The summary of one decision.
    pub fn of(decision: &Decision<'_>) -> DecisionSummary {
        let enforced = || {
            decision
                .rules()
                .iter()
                .filter(|r| r.rule.mode == Mode::Enforce && !r.fail_open)
        };
        let tightest = enforced().min_by_key(|r| r.tokens);
        let remaining = |r: &RuleOutcome<'_>| r.tokens / crate::limits::limiter::MICRO;
        match decision {
            Decision::NoPolicy => DecisionSummary {
                decision: "allow",
                policy: None,
                rule: None,
                reason: Some("no_policy"),
                remaining: None,
            },
            Decision::Refuse(refusal) => {
                let (policy, rule) = match decision.refused_by() {
                    Some(RefusedBy::Rule(rule)) => {
                        (Some(rule.policy_id.clone()), Some(rule.name.clone()))
                    }
                    Some(RefusedBy::KillSwitch(_)) => (Some("kill_switch".to_string()), None),
                    _ => (None, None),
                };
                DecisionSummary {
                    decision: "refuse",
                    policy,
                    rule,
                    reason: Some(refusal.reason.as_str()),
                    remaining: decision
                        .rejecting_rule()
                        .filter(|r| r.cost_exceeds)
                        .map_or(Some(0), |r| Some(remaining(r))),
                }
            }
            Decision::Allow(checked) => {
                let shadow = decision.shadow_rejections().next();
                let shadow_missing = checked.shadow_missing;
                let remaining = tightest.map(remaining);
                if let Some(outcome) = shadow {
                    DecisionSummary {
                        decision: "shadow_refuse",
                        policy: Some(outcome.rule.policy_id.clone()),
                        rule: Some(outcome.rule.name.clone()),
                        reason: Some(if outcome.cost_exceeds {
                            Reason::CostExceedsLimit.as_str()
                        } else {
                            Reason::TokenBucketExceeded.as_str()
                        }),
                        remaining,
                    }
                } else if let Some(rule) = shadow_missing {
                    DecisionSummary {
                        decision: "shadow_refuse",
                        policy: Some(rule.policy_id.clone()),
                        rule: Some(rule.name.clone()),
                        reason: Some("missing_descriptor"),
                        remaining,
                    }
                } else {
                    DecisionSummary {
                        decision: "allow",
                        policy: tightest.map(|r| r.rule.policy_id.clone()),
                        rule: tightest.map(|r| r.rule.name.clone()),
                        reason: None,
                        remaining,
                    }
                }
            }
        }
    }
}
