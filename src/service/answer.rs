//! What a front end needs to answer a request ([`Answer`]), from the gateway's decision.

use crate::engine::headers::Response;
use crate::engine::{Decision, Reason, Reservation};
use crate::store::lease::Lease;
use crate::telemetry::traces::DecisionSummary;

/// What a front end needs to answer a request.
#[derive(Debug)]
pub struct Answer {
    /// Forward it (allowed, or no policy loaded: the proxy fails open).
    pub allowed: bool,
    /// A budget's throttle stage: milliseconds [`crate::service::Gateway::decide`] waited before answering.
    pub throttle_ms: u64,
    /// The concurrency slots an allowed request holds: give them back with
    /// [`crate::service::Gateway::release`] when it is done (they expire otherwise).
    pub lease: Option<Lease>,
    /// The tokens an allowed request reserved on `token_bucket_llm` rules: settle them with
    /// [`crate::service::Tokens::settle`] once the response's usage is known.
    pub reservation: Option<Reservation>,
    /// No valid bundle is loaded (the decision service answers 503).
    pub no_policy: bool,
    /// Why it was refused.
    pub reason: Option<Reason>,
    /// The rule that refused it (a refusal by buckets or by a rule's missing descriptor).
    pub rule: Option<String>,
    /// Status, headers and body of a refusal; headers to add upstream on allow.
    pub response: Response,
    /// What a trace's span says of the decision (only for a sampled request).
    pub summary: Option<Box<DecisionSummary>>,
}

impl Answer {
    /// The access log's verdict: the refusal's reason, `no_policy` or `allow`.
    pub fn verdict(&self) -> &'static str {
        match self.reason {
            Some(reason) => reason.as_str(),
            None if self.no_policy => "no_policy",
            None => "allow",
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
        .filter_map(|s| s.rule.concurrency.map(|c| c.lease_ttl_us))
        .max()
        .unwrap_or(0);
    Some(Lease {
        id: checked.lease_id,
        keys,
        ttl_secs: ttl_us / crate::limits::limiter::US_PER_SEC,
    })
}
