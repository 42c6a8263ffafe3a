//! What a store is asked and answers: a bucket's key, the operations of one request (grouped
//! for all-or-nothing commit) and their results, the store's errors and statistics. Every
//! backend ([`super::memory`], [`super::redis`], [`super::postgres`]) speaks this vocabulary.

use crate::limits::limiter::{check_window, BucketState, Quota, Verdict, Window};
pub use crate::policy::rule::OnStoreError;
use smallvec::SmallVec;

/// A bucket's identity: the 128-bit xxHash3 of its full key (`tb:<rule>:<key>`). 128 bits make
/// an accidental collision between two live keys negligible (≈ n²/2¹²⁹), and keep entries small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketKey {
    pub hi: u64,
    pub lo: u64,
}

impl BucketKey {
    /// The key of a full bucket name.
    #[inline]
    pub fn of(full_key: &str) -> Self {
        let h = twox_hash::XxHash3_128::oneshot(full_key.as_bytes());
        BucketKey {
            hi: (h >> 64) as u64,
            lo: h as u64,
        }
    }
}

impl std::hash::Hash for BucketKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Already a high-quality hash: hand one half to the map as is.
        state.write_u64(self.lo);
    }
}

/// Which commit group an operation belongs to: enforced rules and shadow rules are committed
/// independently (a shadow would-reject never blocks enforced spending, and vice versa).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Enforce,
    Shadow,
}

/// One bucket check within a request.
#[derive(Debug, Clone, Copy)]
pub struct BucketOp {
    pub key: BucketKey,
    pub quota: Quota,
    /// Cost in micro-tokens.
    pub cost: u64,
    pub group: Group,
    /// `Some` for a `cost_based` budget: the bucket holds `quota.burst()` per window and never
    /// refills inside one (see [`crate::limits::limiter::check_window`]).
    pub window: Option<Window>,
    /// What the op's rule does while a shared store is away (`None`: the gateway's default).
    pub on_store_error: Option<OnStoreError>,
    /// A probe (a `count_when` rule): allowed when the bucket holds `cost`, and spends
    /// nothing; the response's charge is settled later ([`AdjustOp`]).
    pub probe: bool,
}

impl BucketOp {
    /// This op's verdict on a bucket state at `now_us` (the store's time base).
    pub fn check(&self, state: Option<BucketState>, now_us: u64) -> Verdict {
        let verdict = match self.window {
            Some(window) => check_window(state, self.quota.burst(), window, self.cost),
            None => crate::limits::limiter::check(state, &self.quota, now_us, self.cost),
        };
        if self.probe {
            spend_nothing(verdict, &self.quota, self.window, now_us)
        } else {
            verdict
        }
    }

    /// Micro-tokens the op spends when committed (a probe's `cost` is only checked).
    #[inline]
    pub fn spent(&self) -> u64 {
        if self.probe {
            0
        } else {
            self.cost
        }
    }
}

/// A probe's verdict: as checked, but an allowed one leaves the bucket as it found it
/// (refilled to now), full again when it would have been without the request.
#[cold]
fn spend_nothing(
    mut verdict: Verdict,
    quota: &Quota,
    window: Option<Window>,
    now_us: u64,
) -> Verdict {
    if !verdict.allowed {
        return verdict;
    }
    verdict.remaining = verdict.available;
    verdict.next.tokens = verdict.available;
    verdict.full_in_us = match window {
        Some(w) if verdict.available < quota.burst() => w.ends_in_us,
        Some(_) => 0,
        None => verdict
            .next
            .last_us
            .saturating_sub(now_us)
            .saturating_add(quota.time_to_gain_us(quota.burst() - verdict.available)),
    };
    verdict
}

/// Settles one reservation on a bucket (`token_bucket_llm`): `delta` more micro-tokens charged,
/// or refunded when negative (see [`crate::limits::limiter::settle`] and
/// [`crate::limits::limiter::settle_window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdjustOp {
    pub key: BucketKey,
    pub quota: Quota,
    /// `Some(window id)` for a budget: only that window's spend moves.
    pub window_id: Option<u64>,
    pub delta: i64,
}

impl AdjustOp {
    /// The state to store, or `None` when there is nothing to change (a budget bucket that
    /// counts another window, or none).
    pub fn settle(&self, state: Option<BucketState>, now_us: u64) -> Option<BucketState> {
        match self.window_id {
            Some(id) => {
                crate::limits::limiter::settle_window(state, self.quota.burst(), id, self.delta)
            }
            None => Some(crate::limits::limiter::settle(
                state,
                &self.quota,
                now_us,
                self.delta,
            )),
        }
    }

    /// Microseconds until a settled state is full again (a budget: one period at most).
    pub fn full_in_us(&self, next: BucketState, now_us: u64) -> u64 {
        match self.window_id {
            Some(_) => self.quota.period_us(),
            None => next.last_us.saturating_sub(now_us).saturating_add(
                self.quota
                    .time_to_gain_us(self.quota.burst().saturating_sub(next.tokens)),
            ),
        }
    }
}

/// The answer for one [`BucketOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpResult {
    pub verdict: Verdict,
    /// The group was committed (every op of the group allowed) and this bucket was spent.
    pub committed: bool,
    /// The bucket could not be stored (store full): the request was allowed without tracking.
    pub fail_open: bool,
    /// `Some` when a shared store did not answer and the op was decided by its rule's
    /// `on_store_error` instead: from this gateway's share (`Local`), admitted unspent
    /// (`Open`) or refused (`Closed`).
    pub away: Option<OnStoreError>,
}

/// Results, one per op, in op order.
pub type OpResults = SmallVec<[OpResult; 4]>;

/// A store failure (networked stores); the engine fails open on it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// Gauges and counters a store exposes for `/metrics`: read from counters, never by walking
/// the map (a scrape must not take every shard lock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Buckets held (the embedded store only; a shared store's size is the server's business).
    pub entries: Option<u64>,
    /// Buckets dropped: evicted by the embedded store, deleted by the PostgreSQL sweep.
    pub evictions: u64,
    /// The embedded store's drops by kind, and its evictions for room by what they gave away.
    pub evicted: EvictionStats,
    /// Requests allowed untracked because the embedded store had no room: a new key with no
    /// entry to evict (none since a new key in a full store evicts one), or a concurrency slot
    /// or breaker state its lease table could not hold.
    pub fail_open: u64,
    /// Loop-detection marks held by the embedded store (`None`: not kept apart, or a shared
    /// store).
    pub loop_marks: Option<u64>,
    /// Loop marks forgotten for room (each one identical request a loop count missed).
    pub loop_marks_evicted: u64,
    /// With `--state-dir`: whether the tables are in process memory instead, because the state
    /// file could not be made or mapped (`None` without a state dir).
    pub state_fallback: Option<bool>,
    /// A shared store's local mode (`None` for the embedded store).
    pub local: Option<LocalStats>,
    /// A shared store: the gateway's wall clock minus the store's clock, in µs, at the last
    /// measurement (each sweep; positive when the gateway is ahead). `None` for the embedded
    /// store, and before a shared store's first measurement.
    pub clock_skew_us: Option<i64>,
}

/// A shared store's local mode, for `/metrics`, `/readyz` and the status page.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LocalStats {
    /// Requests are decided locally now.
    pub local_mode: bool,
    /// N: gateways present when the store was last reached.
    pub gateways: u64,
    /// Write-backs applied, duplicate, failed (running totals).
    pub write_backs: [u64; 3],
    /// Buckets with local spend not yet charged.
    pub pending: u64,
    /// Wall-clock µs local mode began, while in it.
    pub since_us: Option<u64>,
}

/// Upper bounds (micro-tokens) of the buckets of the histogram of what evictions for room gave
/// away: nothing, half a token, 1, 2, 5, 10, 100 and 1 000 tokens.
pub const FORGIVEN_BOUNDS_MICRO: [u64; 8] = [
    0,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
];

/// The embedded store's dropped entries: running totals (see `memory`'s module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvictionStats {
    /// Entries dropped full again (sweep, purge, or a sampled entry that had refilled): they
    /// gave nothing away.
    pub full_again: u64,
    /// Token buckets still refilling, evicted for room.
    pub token_bucket: u64,
    /// Budgets with spend in their window, evicted for room.
    pub budget: u64,
    /// Entries an older build wrote to the state file (their spend not kept), evicted for room
    /// while not full again: only when every sampled entry was one. Not in the histogram.
    pub unknown_spend: u64,
    /// Evictions for room that gave away at most each of [`FORGIVEN_BOUNDS_MICRO`]
    /// (cumulative, as Prometheus buckets).
    pub forgiven_le: [u64; FORGIVEN_BOUNDS_MICRO.len()],
    /// Evictions for room, all of them.
    pub forgiven_count: u64,
    /// Micro-tokens they gave away, in all.
    pub forgiven_sum_micro: u64,
}
