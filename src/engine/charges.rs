//! What an allowed request owes once its response is known ([`ResponseCharges`], detached
//! from the bundle like a [`crate::engine::Reservation`]): for each bucket of a rule that reads
//! the response, what was reserved before the upstream and how the response prices it. Settling
//! gives the store's adjustments and the penalty boxes' counted events ([`Settlement`]); a
//! decision's refusals give the counted events of rules that count refusals
//! ([`Decision::penalty_counts`]).

use crate::engine::decision::{Checked, Decision};
use crate::limits::limiter::Quota;
use crate::limits::response::{penalty_keys, response_cost};
use crate::policy::rule::{AfterResponse, CostLimits, CostSource, CountWhen, Penalty, Rule};
use crate::request::descriptor::HeaderLookup;
use crate::store::{AdjustOp, BucketKey, Group};
use smallvec::SmallVec;
use std::sync::Arc;

/// The buckets an allowed request owes a charge on, settled by its response.
#[derive(Debug, Clone, Default)]
pub struct ResponseCharges {
    pub ops: SmallVec<[ChargeOp; 1]>,
}

/// One bucket of [`ResponseCharges`].
#[derive(Debug, Clone)]
pub struct ChargeOp {
    pub key: BucketKey,
    pub quota: Quota,
    pub window_id: Option<u64>,
    /// Micro-tokens spent before the upstream (0 for `count_when`).
    pub reserved: u64,
    /// Micro-tokens a counted response is charged when the cost is not the response's.
    pub cost: u64,
    /// The rule's `count_when` and `penalty` (shared with the bundle: no copy per request).
    pub after: Option<Arc<AfterResponse>>,
    /// A response-priced cost: the header and its bounds.
    pub priced: Option<(String, CostLimits)>,
    /// The rule's penalty box, when a counted response counts toward it.
    pub penalty: Option<PenaltyCount>,
}

impl ChargeOp {
    /// `None`: every response is charged.
    pub fn count_when(&self) -> Option<&CountWhen> {
        self.after.as_deref().and_then(|a| a.count_when.as_ref())
    }
}

/// One counted event for a key's penalty box: where its sliding log and its block live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PenaltyCount {
    pub count: BucketKey,
    pub block: BucketKey,
    pub penalty: Penalty,
    pub group: Group,
}

impl PenaltyCount {
    /// The counted event of `rule`'s box for bucket `key` (`None`: the rule has no box).
    pub fn of(rule: &Rule, key: BucketKey) -> Option<PenaltyCount> {
        let penalty = rule.after_response.as_deref()?.penalty?;
        let (count, block) = penalty_keys(key);
        Some(PenaltyCount {
            count,
            block,
            penalty,
            group: crate::engine::planning::group_of(rule.mode),
        })
    }
}

/// What one response settles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settlement {
    /// Each bucket's charge minus its reservation (only the ones that move).
    pub adjust: SmallVec<[AdjustOp; 1]>,
    /// Penalty boxes a charged `count_when` response counts toward.
    pub counted: SmallVec<[PenaltyCount; 1]>,
    /// Micro-tokens charged in all (after the reservations), for logs and `simulate`.
    pub charged: u64,
}

impl ResponseCharges {
    /// What a response with `status` and `headers` settles: a `count_when` bucket is charged
    /// the request's cost when the response matches (nothing otherwise); a response-priced one
    /// is settled from its reservation to the header's price.
    pub fn settle(&self, status: u16, headers: &dyn HeaderLookup) -> Settlement {
        let mut out = Settlement::default();
        for op in &self.ops {
            let when = op.count_when();
            let matched = when.is_none_or(|when| when.matches(status, headers));
            let due = match (&op.priced, matched) {
                (_, false) => 0,
                (Some((name, limits)), true) => {
                    response_cost(headers, name, limits, op.quota.burst())
                }
                (None, true) => op.cost,
            };
            out.charged = out.charged.saturating_add(due);
            let delta = (due.min(i64::MAX as u64) as i64)
                .saturating_sub(op.reserved.min(i64::MAX as u64) as i64);
            if delta != 0 {
                out.adjust.push(AdjustOp {
                    key: op.key,
                    quota: op.quota,
                    window_id: op.window_id,
                    delta,
                });
            }
            if let (true, true, Some(count)) = (matched, when.is_some(), op.penalty) {
                out.counted.push(count);
            }
        }
        out
    }
}

impl<'b> Decision<'b> {
    /// What an allowed request owes its rules that read the response (`None`: no such rule
    /// spent, or the store failed and nothing was checked).
    pub fn response_charges(&self) -> Option<ResponseCharges> {
        let Decision::Allow(checked) = self else {
            return None;
        };
        if checked.owed.is_empty() {
            return None;
        }
        charges_of(checked)
    }

    /// The penalty boxes this decision's refusals count toward: each rule with a `penalty`
    /// and no `count_when` (which counts responses instead) whose bucket refused the request.
    pub fn penalty_counts(&self) -> SmallVec<[PenaltyCount; 1]> {
        self.rules()
            .iter()
            .filter(|o| !o.allowed)
            .filter(|o| {
                o.rule
                    .after_response
                    .as_deref()
                    .is_some_and(|a| a.penalty.is_some() && a.count_when.is_none())
            })
            .filter_map(|o| PenaltyCount::of(o.rule, o.key))
            .collect()
    }
}

/// [`Decision::response_charges`] of an allowed request's rules (kept out of line).
#[inline(never)]
fn charges_of(checked: &Checked<'_>) -> Option<ResponseCharges> {
    let mut charges = ResponseCharges::default();
    for owed in &checked.owed {
        let Some(outcome) = checked.rules.get(owed.outcome) else {
            continue;
        };
        if !outcome.committed || outcome.fail_open {
            continue;
        }
        let rule = outcome.rule;
        let after = rule.after_response.clone();
        let counted = after.as_deref().is_some_and(|a| a.count_when.is_some());
        charges.ops.push(ChargeOp {
            key: owed.key,
            quota: owed.quota,
            window_id: owed.window_id,
            reserved: owed.reserved,
            cost: owed.cost,
            penalty: counted.then(|| PenaltyCount::of(rule, owed.key)).flatten(),
            after,
            priced: match &rule.cost {
                CostSource::Response { name, limits } => Some((name.clone(), *limits)),
                _ => None,
            },
        });
    }
    (!charges.ops.is_empty()).then_some(charges)
}

/// What counting one event did to its box.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// The event was marked (or the log was full already).
    Marked,
    /// The event was the `after`-th: the key is in the box.
    Blocked,
}

/// Counts penalty events on the embedded store, on this thread (the gateway's embedded path
/// and `simulate`): each event a mark in its key's log; the `after`-th puts the key in the box
/// for `block_for` and clears the log.
pub fn count_in_memory(
    store: &crate::store::MemoryStore,
    now_us: u64,
    counts: &[PenaltyCount],
) -> SmallVec<[Counted; 1]> {
    use crate::limits::response::{block_lease, count_mark, trips};
    use crate::store::lease::{next_lease_id, LeaseResults};
    let leases = store.leases();
    let mut taken = LeaseResults::new();
    counts
        .iter()
        .map(|count| {
            let mark = count_mark(count.count, &count.penalty, count.group);
            leases.acquire(now_us, next_lease_id(), &[mark], &mut taken);
            let tripped = taken
                .first()
                .is_some_and(|r| trips(&count.penalty, r.committed, r.in_flight));
            if !tripped {
                return Counted::Marked;
            }
            let block = block_lease(count.block, &count.penalty, count.group);
            leases.acquire(now_us, next_lease_id(), &[block], &mut taken);
            leases.forget(&[count.count]);
            Counted::Blocked
        })
        .collect()
}
