//! Paced requests (a token-bucket rule's `delay`, see [`crate::limits::pacing`]) once the store
//! has answered: how long an admitted request waits before it goes on, what gives back the
//! tokens it spent, and the refusal of one that would wait past its rule's `max_wait_ms` or
//! that finds no room to wait.

use crate::engine::decision::{Cause, Checked, Decision, Paced, Reason, Refusal};
use crate::limits::limiter::ceil_secs;
use crate::policy::rule::Mode;
use crate::store::{AdjustOp, BucketOp, Group, OpResults};
use smallvec::SmallVec;

/// The decision of a request the store admitted, under a bundle with paced rules: allowed at
/// once, allowed with a wait ([`Checked::paced`]), or refused because a rule's wait is longer
/// than its `max_wait_ms` (the spent tokens are then in [`Checked::paced`], for the caller to
/// give back).
pub(crate) fn paced<'b>(
    mut checked: Box<Checked<'b>>,
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
pub fn refuse(mut checked: Box<Checked<'_>>, retry_us: u64) -> Decision<'_> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tests::{ask, engine};
    use crate::engine::{Outcome, Reason};
    use crate::limits::limiter::MICRO;
    use serde_json::json;

    fn waits(d: &Decision<'_>) -> Option<u64> {
        d.is_allowed().then(|| wait_us(d) / 1_000)
    }

    /// nginx `rate=10r/s burst=3` (no `nodelay`): burst 4, one at once, then 100 ms apart;
    /// the fifth refused; once time passes, the line moves up.
    #[test]
    fn a_burst_is_paced_at_the_rate_and_refused_past_it() {
        let (e, clock) = engine(json!({"rules": [
            {"name": "paced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 10, "burst": 4, "delay": {}}}
        ]}));
        let got: Vec<Option<u64>> = (0..5)
            .map(|_| waits(&ask(&e, "GET", "/", "10.0.0.1", &[])))
            .collect();
        assert_eq!(got, [Some(0), Some(100), Some(200), Some(300), None]);
        let refused = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(
            refused.outcome(),
            Outcome::Reject(Reason::TokenBucketExceeded)
        );
        assert!(refused.checked().unwrap().paced.is_none());
        // 150 ms later one and a half tokens are back: the next waits 250 ms, behind the
        // two still waiting (until 200 and 300 ms).
        clock.advance_us(150_000);
        assert_eq!(waits(&ask(&e, "GET", "/", "10.0.0.1", &[])), Some(250));
        // Another client has a bucket of its own.
        assert_eq!(waits(&ask(&e, "GET", "/", "10.0.0.2", &[])), Some(0));
    }

    /// The paced request's refund names every enforced bucket it spent on, and a shadow
    /// paced rule never makes anyone wait.
    #[test]
    fn the_refund_covers_every_enforced_bucket_and_shadow_never_waits() {
        let (e, _) = engine(json!({"bundle_version": 1, "policies": [
            {"id": "live", "spec": {"rules": [
                {"name": "paced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 3, "delay": {"immediate": 1}}},
                {"name": "plain", "limit_keys": [], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 100, "burst": 100, "fixed_cost": 2}}
            ]}},
            {"id": "trial", "spec": {"mode": "shadow", "rules": [
                {"name": "shadow-paced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                 "algorithm_config": {"rps": 1, "burst": 10, "delay": {"immediate": 0}}}
            ]}}
        ]}));
        assert_eq!(waits(&ask(&e, "GET", "/", "10.0.0.1", &[])), Some(0));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        let paced = d.checked().unwrap().paced.as_deref().unwrap();
        assert_eq!(paced.wait_us, 1_000_000);
        assert_eq!(d.rules()[paced.rule].rule.name, "paced");
        let refund: Vec<(usize, i64)> = paced.refund.iter().map(|(i, op)| (*i, op.delta)).collect();
        assert_eq!(refund, [(0, -(MICRO as i64)), (1, -2 * MICRO as i64)]);
    }

    /// A wait past `max_wait_ms` is refused, with its spend handed back for the caller to give
    /// back and every bucket reported as before the request.
    #[test]
    fn a_wait_past_max_wait_is_refused_with_its_spend_to_give_back() {
        let (e, _) = engine(json!({"rules": [
            {"name": "paced", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 2, "burst": 10, "delay": {"immediate": 2, "max_wait_ms": 1000}}}
        ]}));
        let got: Vec<Option<u64>> = (0..4)
            .map(|_| waits(&ask(&e, "GET", "/", "10.0.0.1", &[])))
            .collect();
        assert_eq!(got, [Some(0), Some(0), Some(500), Some(1000)]);
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
        assert_eq!(d.retry_after(), 1);
        let outcome = &d.rules()[0];
        assert!(!outcome.allowed && !outcome.committed);
        // Four spent before it; its own token reads as unspent.
        assert_eq!(outcome.tokens, 6 * MICRO);
        let paced = d.checked().unwrap().paced.as_deref().unwrap();
        assert_eq!(paced.refund_ops().len(), 1);
        assert_eq!(paced.refund_ops()[0].delta, -(MICRO as i64));
    }
}
