//! The gateway's response charges and penalty boxes ([`Penalties`]): what rules that read the
//! response are charged once it is known (`count_when`, a response-priced cost), and the
//! counted events of rules with a `penalty` (their refusals, or their charged responses), each
//! a mark in the key's sliding log; the mark that makes `after` puts the key in the box for
//! `block_for` and clears the log. Every step is one atomic store call, so a fleet sharing
//! a store counts and blocks as one gateway would.

#[cfg(doc)]
use crate::engine::charges::ResponseCharges;
use crate::engine::charges::{count_in_memory, Counted, PenaltyCount, Settlement};
use crate::limits::response::{block_lease, count_mark, trips};
use crate::store::lease::{next_lease_id, LeaseResults};
use crate::store::Store;
use std::sync::Arc;

/// The log target of the `PENALTY_BLOCK` line (the request path's).
const LOG_TARGET: &str = "tollgate::service";

/// The gateway's component settling response charges and counting penalty boxes.
pub struct Penalties {
    store: Arc<Store>,
}

impl Penalties {
    pub(super) fn new(store: Arc<Store>) -> Self {
        Penalties { store }
    }

    /// Applies what a response settled ([`ResponseCharges::settle`]): the buckets' charges
    /// (one atomic call), then the penalty boxes its counted events count toward. A store that
    /// does not answer leaves the reservations as they were, and nothing counted.
    pub async fn apply(&self, settlement: &Settlement) {
        let now_us = self.store.now_us();
        if self.store.adjust(now_us, &settlement.adjust).await.is_ok()
            && !settlement.counted.is_empty()
            && !self.count_now(&settlement.counted)
        {
            self.count(&settlement.counted).await;
        }
    }

    /// Counts one event for each box: its mark, and the block when it is the `after`-th.
    pub async fn count(&self, counts: &[PenaltyCount]) {
        for count in counts {
            let now_us = self.store.now_us();
            let mut taken = LeaseResults::new();
            let mark = count_mark(count.count, &count.penalty, count.group);
            if self
                .store
                .acquire(now_us, next_lease_id(), &[mark], &mut taken)
                .await
                .is_err()
            {
                continue;
            }
            let Some(result) = taken.first().copied() else {
                continue;
            };
            if !trips(&count.penalty, result.committed, result.in_flight) {
                continue;
            }
            let block = block_lease(count.block, &count.penalty, count.group);
            let opened = self
                .store
                .acquire(now_us, next_lease_id(), &[block], &mut taken)
                .await;
            // The log starts again: the key's next `after` events (once the block is over)
            // are what trips it again.
            let _ = self.store.forget(&[], &[count.count]).await;
            if opened.is_ok() {
                log_block(count);
            }
        }
    }

    /// [`Penalties::count`] on the embedded store, on this thread. `false` with a shared store
    /// (nothing done: await `count`).
    pub fn count_now(&self, counts: &[PenaltyCount]) -> bool {
        let crate::store::Backend::Memory(memory) = self.store.backend() else {
            return false;
        };
        let counted = count_in_memory(memory, self.store.now_us(), counts);
        for (count, counted) in counts.iter().zip(counted) {
            if counted == Counted::Blocked {
                log_block(count);
            }
        }
        true
    }
}

/// The `PENALTY_BLOCK` line: a key was put in a rule's penalty box (the key itself is not
/// logged: it may be a credential).
fn log_block(count: &PenaltyCount) {
    tracing::warn!(
        target: LOG_TARGET,
        shadow = count.group == crate::store::Group::Shadow,
        block_secs = count.penalty.block_for_us / crate::limits::limiter::US_PER_SEC,
        after = count.penalty.after,
        "PENALTY_BLOCK"
    );
}
