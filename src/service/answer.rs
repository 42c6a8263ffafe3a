//! What a front end needs to answer a request ([`Answer`]), from the gateway's decision.

use crate::engine::headers::Response;
use crate::engine::{Decision, Reason, Reservation};
use crate::store::lease::Lease;
use crate::telemetry::traces::DecisionSummary;

/// What a front end needs to answer a request.
#[derive(Debug)]
pub struct Answer {
    /// Allowed, refused, or not decided for want of a policy.
    pub verdict: Verdict,
    /// A budget's throttle stage: milliseconds [`crate::service::Gateway::decide`] waited before answering.
    pub throttle_ms: u64,
    /// A request paced by a `delay` rule: its place in line, to wait for its turn
    /// ([`crate::service::Pace::wait`]) before it goes on. Taken (and waited for) by
    /// [`crate::service::Gateway::decide`]; the proxy waits itself.
    /// Boxed, as `reservation` and `response` are: an answer is moved several times on every
    /// request, and most carry neither.
    pub pace: Option<Box<super::pacing::Pace>>,
    /// How long the request waited for its turn under a `delay` rule (0: it did not).
    pub waited_us: u64,
    /// The rule that made it wait (with `pace`).
    pub paced_by: Option<String>,
    /// The concurrency slots an allowed request holds: give them back with
    /// [`crate::service::Gateway::release`] when it is done (they expire otherwise).
    pub lease: Option<Lease>,
    /// The tokens an allowed request reserved on `token_bucket_llm` rules: settle them with
    /// [`crate::service::Tokens::settle`] once the response's usage is known.
    pub reservation: Option<Box<Reservation>>,
    /// What an allowed request owes rules that read its response (`count_when`, a
    /// response-priced cost): settle it on the response's status and headers, and apply that
    /// with [`crate::service::Penalties::apply`].
    /// Boxed: an answer is moved on every request, and most carry none.
    pub charges: Option<Box<crate::engine::charges::ResponseCharges>>,
    /// Status, headers and body of a refusal; headers to add upstream on allow.
    /// Boxed: inline, its header list would make the answer over a kilobyte, copied at each
    /// move.
    pub response: Box<Response>,
    /// What a trace's span says of the decision (only for a sampled request).
    pub summary: Option<Box<DecisionSummary>>,
    /// The model an `llm_spend` rule's fallback admitted the request with instead of the one
    /// it named: the front end rewrites the request's `model` to it.
    pub model: Option<Box<str>>,
}

/// What an answer is: exactly one of allowed, refused (with its reason) or no policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward it.
    Allowed,
    /// No valid bundle is loaded: the proxy forwards it (failing open), the decision service
    /// answers 503.
    NoPolicy,
    /// Refused: why, and the rule that refused it (a refusal by buckets or by a rule's missing
    /// descriptor; `None` otherwise).
    Refused {
        reason: Reason,
        rule: Option<String>,
    },
}

impl Verdict {
    /// Whether the request goes on to its upstream: allowed, or no policy loaded (the proxy
    /// fails open).
    #[inline]
    pub fn forwards(&self) -> bool {
        !matches!(self, Verdict::Refused { .. })
    }

    /// Why it was refused (`None` when it was not).
    #[inline]
    pub fn reason(&self) -> Option<Reason> {
        match self {
            Verdict::Refused { reason, .. } => Some(*reason),
            Verdict::Allowed | Verdict::NoPolicy => None,
        }
    }

    /// The rule that refused it, when one did.
    pub fn rule(&self) -> Option<&str> {
        match self {
            Verdict::Refused { rule, .. } => rule.as_deref(),
            Verdict::Allowed | Verdict::NoPolicy => None,
        }
    }

    /// The access log's verdict: the refusal's reason, `no_policy` or `allow`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Refused { reason, .. } => reason.as_str(),
            Verdict::NoPolicy => "no_policy",
            Verdict::Allowed => "allow",
        }
    }
}

/// The lease an allowed decision holds: its committed concurrency slots, with the longest of
/// their rules' lease TTLs (a refused decision's leases were given back already).
pub(super) fn held_lease(decision: &Decision<'_>) -> Option<Lease> {
    let Decision::Allow(checked) = decision else {
        return None;
    };
    let keys = checked.held_leases();
    if keys.is_empty() {
        return None;
    }
    let ttl_us = checked
        .slots
        .iter()
        .filter_map(|s| s.rule.concurrency().map(|c| c.lease_ttl_us))
        .max()
        .unwrap_or(0);
    Some(Lease {
        id: checked.lease_id,
        keys,
        ttl_secs: ttl_us / crate::limits::limiter::US_PER_SEC,
    })
}
