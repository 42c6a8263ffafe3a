//! Paced requests (a token-bucket rule's `delay`, see [`crate::limits::pacing`]) once the store
//! has answered: how long an admitted request waits before it goes on, what gives back the
//! tokens it spent, and the refusal of one that would wait past its rule's `max_wait_ms` or
//! that finds no room to wait.

use crate::engine::decision::{Cause, Checked, Decision, Reason, Refusal};
use crate::limits::limiter::ceil_secs;
use crate::policy::rule::Mode;
use crate::store::{AdjustOp, BucketOp, Group, OpResults};
use smallvec::SmallVec;

/// An admitted request's wait, and the tokens it holds meanwhile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paced {
    /// Microseconds to wait before going on: the longest of its paced rules' waits.
    pub wait_us: u64,
    /// Index (in [`Checked::rules`]) of the rule with that wait.
    pub rule: usize,
    /// Every enforced bucket the request spent on, with the index of its outcome: refunded
    /// together when the request is refused after all or its client goes away while waiting
    /// (all or nothing, as it was spent).
    pub refund: SmallVec<[(usize, AdjustOp); 2]>,
}

impl Paced {
    /// The store operations giving the tokens back.
    pub fn refund_ops(&self) -> SmallVec<[AdjustOp; 2]> {
        self.refund.iter().map(|(_, op)| *op).collect()
    }
}

/// The decision of a request the store admitted, under a bundle with paced rules: allowed at
/// once, allowed with a wait ([`Checked::paced`]), or refused because a rule's wait is longer
/// than its `max_wait_ms` (the spent tokens are then in [`Checked::paced`], for the caller to
/// give back).
pub(crate) fn paced<'b>(
    mut checked: Checked<'b>,
    ops: &[BucketOp],
    results: &OpResults,
) -> Decision<'b> {
    let mut wait_us = 0;
    let mut rule = 0;
    let mut over_us = 0;
    for (i, outcome) in checked.rules.iter().enumerate() {
        let Some(pacing) = outcome.rule.pacing else {
            continue;
        };
        if outcome.rule.mode != Mode::Enforce
            || !outcome.committed
            || outcome.fail_open
            || outcome.away.is_some()
        {
            continue;
        }
        let wait = pacing.wait_us(&outcome.quota, outcome.tokens);
        over_us = over_us.max(wait.saturating_sub(pacing.max_wait_us(&outcome.quota)));
        if wait > wait_us {
            (wait_us, rule) = (wait, i);
        }
    }
    if wait_us == 0 {
        return Decision::Allow(checked);
    }
    let refund = ops
        .iter()
        .zip(results.iter())
        .enumerate()
        .filter(|(_, (op, r))| op.group == Group::Enforce && r.committed && !r.fail_open)
        .map(|(i, (op, _))| {
            (
                i,
                AdjustOp {
                    key: op.key,
                    quota: op.quota,
                    window_id: op.window.map(|w| w.id),
                    delta: -(op.cost.min(i64::MAX as u64) as i64),
                },
            )
        })
        .collect();
    checked.paced = Some(Box::new(Paced {
        wait_us,
        rule,
        refund,
    }));
    if over_us > 0 {
        return refuse(checked, over_us);
    }
    Decision::Allow(checked)
}

/// Turns a paced request into a refusal by its paced rule, telling the client to come back in
/// `retry_us`: every enforced bucket it spent on reads as unspent (the caller gives the
/// tokens back with [`Paced::refund_ops`]). A decision without a wait is returned as it is.
pub fn refuse(mut checked: Checked<'_>, retry_us: u64) -> Decision<'_> {
    let Some(paced) = checked.paced.as_deref() else {
        return Decision::Allow(checked);
    };
    let rule = paced.rule;
    let refunded: SmallVec<[(usize, u64); 2]> = paced
        .refund
        .iter()
        .map(|(i, op)| (*i, op.delta.unsigned_abs()))
        .collect();
    for (i, cost) in refunded {
        if let Some(outcome) = checked.rules.get_mut(i) {
            outcome.committed = false;
            outcome.tokens = outcome
                .tokens
                .saturating_add(cost)
                .min(outcome.quota.burst());
        }
    }
    let retry_after = ceil_secs(retry_us).max(1);
    if let Some(outcome) = checked.rules.get_mut(rule) {
        outcome.allowed = false;
        outcome.retry_after = retry_after;
    }
    checked.stage = None;
    Decision::Refuse(Refusal {
        reason: Reason::TokenBucketExceeded,
        retry_after,
        retry_by_deadline: false,
        cause: Cause::Buckets,
        checked: Some(checked),
    })
}

/// The wait a decision asks for before its request goes on (0: none, or refused).
pub fn wait_us(decision: &Decision<'_>) -> u64 {
    match decision {
        Decision::Allow(checked) => checked.paced.as_ref().map_or(0, |p| p.wait_us),
        _ => 0,
    }
}
