//! Local mode: how a gateway keeps deciding while the shared store its fleet counts in
//! (Redis, PostgreSQL) does not answer in time. It owns the switch between shared and local
//! decisions, the mirror (an embedded [`MemoryStore`] holding this gateway's share of every
//! bucket it has touched), the fleet size N the share is cut by, and the write-back journal:
//! what was spent locally, charged to the store once it answers again.
//!
//! The share of a quota is its burst and its rate divided by N, the gateways alive when the
//! store was last reached. A bucket starts from the last state the store returned to this
//! gateway (its tokens divided by N), a bucket never seen from a full share. Over an outage
//! of T seconds the fleet therefore admits at most what the store last held, plus rate × T,
//! plus one request per gateway: a share is never smaller than one request's cost, so a
//! burst smaller than N requests still lets each gateway through once.
//!
//! Each rule picks what happens instead with `on_store_error`: `local` (the above), `open`
//! (admitted, nothing spent) or `closed` (refused with 503).

use super::lease::{LeaseOp, LeaseResult, LeaseResults};
use super::memory::{MemoryStore, MemoryStoreConfig};
use super::ops::{AdjustOp, BucketKey, BucketOp, Group, OnStoreError, OpResult, OpResults};
use crate::limits::limiter::{self, BucketState, Quota, Verdict};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// How long a gateway's presence in the store lasts unless renewed (it is renewed every
/// [`PRESENCE_EVERY`]): a stopped gateway stops counting in N within this time.
pub const PRESENCE_TTL: std::time::Duration = std::time::Duration::from_secs(10);
/// How often a gateway renews its presence and re-reads N, and, in local mode without
/// traffic, tries the store again.
pub const PRESENCE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// Marks of applied write-backs live this long in the store: a journal replayed within it
/// (a gateway restarted before it could forget a batch) is not charged twice.
pub const WRITE_BACK_MARK_TTL: std::time::Duration = std::time::Duration::from_secs(7 * 86_400);
/// The journal's file in a state dir.
pub const JOURNAL_FILE: &str = "writeback.json";
/// Retry-After (seconds) of a request refused because its rule is `closed` and the store is
/// away.
pub const CLOSED_RETRY_SECS: u64 = 1;

/// Write-backs in a row that may fail, on a store that takes this gateway's presence, before
/// the store decides again anyway (the charges stay in the journal and are sent again).
pub const WRITE_BACK_TRIES: u32 = 5;

/// First and longest wait between two tries at reaching the store again (doubling, with full
/// jitter: a fleet that lost its store together does not come back in step).
const PROBE_FIRST_US: u64 = 100_000;
const PROBE_LONGEST_US: u64 = 2_000_000;

/// Local mode's settings.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// The mode of rules that do not say (`--on-store-error`).
    pub default_mode: OnStoreError,
    /// Most buckets the mirror holds (`--local-max-buckets`).
    pub max_buckets: std::num::NonZeroUsize,
    /// This gateway's name in the store's presence set.
    pub gateway_id: String,
    /// Where the journal is kept (`--state-dir`), if anywhere.
    pub journal: Option<PathBuf>,
}

/// One bucket's spend made locally, to be charged to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    pub hi: u64,
    pub lo: u64,
    pub burst: u64,
    pub refill: u64,
    pub period_us: u64,
    /// A budget's window: only that window's spend moves.
    pub window_id: Option<u64>,
    /// Micro-tokens (negative: refunded by a settlement).
    pub delta: i64,
}

impl Charge {
    /// The store operation that charges it.
    pub fn adjust_op(&self) -> Option<AdjustOp> {
        Some(AdjustOp {
            key: BucketKey {
                hi: self.hi,
                lo: self.lo,
            },
            quota: Quota::new(self.burst, self.refill, self.period_us).ok()?,
            window_id: self.window_id,
            delta: self.delta,
        })
    }
}

/// Charges sent together under one id: the store applies each at most once (it keeps a mark
/// of the id beside each bucket), so a batch sent again after a crash or a lost answer is not
/// charged twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub id: String,
    pub charges: Vec<Charge>,
}

/// The journal as kept in its file.
#[derive(Debug, Default, Serialize, Deserialize)]
struct JournalFile {
    /// A batch being sent (its id fixed): sent again as is until the store confirms it.
    sending: Option<Batch>,
    /// Spend not yet in a batch.
    open: Vec<Charge>,
    /// N when last written: a gateway restarted while the store is away starts from it, not
    /// from a whole limit of its own.
    #[serde(default)]
    gateways: u64,
}

#[derive(Default)]
struct Journal {
    sending: Option<Batch>,
    /// N, as last written.
    gateways: u64,
    open: HashMap<(u128, u64), Charge>,
    /// Changed since last written to its file.
    dirty: bool,
    /// Spend not journaled because the journal was full.
    dropped: u64,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct LocalCounters {
    pub write_backs_applied: AtomicU64,
    pub write_backs_duplicate: AtomicU64,
    pub write_backs_failed: AtomicU64,
}

/// What a write-back did: charges applied, and charges the store had already applied
/// (a batch sent again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteBackOutcome {
    pub applied: u64,
    pub duplicate: u64,
}

/// Local mode's state (see the module doc).
pub struct LocalMode {
    config: LocalConfig,
    mirror: MemoryStore,
    /// N: gateways alive when the store was last reached (at least 1).
    gateways: AtomicU64,
    local: AtomicBool,
    /// Wall-clock µs local mode began (0: not in it).
    since_us: AtomicU64,
    /// Store time (µs) before which nobody tries to reach the store again.
    next_probe_us: AtomicU64,
    /// Tries in a row that failed (the backoff's exponent).
    failed_probes: AtomicU32,
    /// When local mode's ERROR line was last written (µs, 0: never).
    last_error_log_us: AtomicU64,
    /// This stretch of local mode was logged at error level (so its end is logged too).
    episode_logged: AtomicBool,
    /// When local mode last ended (µs, 0: never).
    last_leave_us: AtomicU64,
    /// Write-backs in a row that failed while the store took this gateway's presence.
    write_back_failures: AtomicU32,
    journal: Mutex<Journal>,
    /// Held while the journal's file is written.
    writing: Mutex<()>,
    pub counters: LocalCounters,
}

/// A quota's share among `n` gateways: burst and rate divided by `n`, the burst never below
/// `cost` (capped at the whole burst), so each gateway can admit one request.
pub fn share_quota(quota: &Quota, n: u64, cost: u64) -> Quota {
    if n <= 1 {
        return *quota;
    }
    let burst = (quota.burst() / n).max(cost.min(quota.burst())).max(1);
    // rate / n, exactly: the same refill over n times the period.
    let shared = match quota.period_us().checked_mul(n) {
        Some(period) => Quota::new(burst, quota.refill(), period),
        None => Quota::new(burst, (quota.refill() / n).max(1), quota.period_us()),
    };
    shared.unwrap_or(*quota)
}

/// A concurrency limit's share: `max / n`, at least 1 (0 stays 0: a breaker's open state).
fn share_slots(max: u32, n: u64) -> u32 {
    if max == 0 || n <= 1 {
        return max;
    }
    ((u64::from(max) / n).max(1)).min(u64::from(max)) as u32
}

fn key128(key: &BucketKey) -> u128 {
    (u128::from(key.hi) << 64) | u128::from(key.lo)
}

/// A verdict that admits without spending (`open`).
fn open_verdict(op: &BucketOp) -> Verdict {
    Verdict {
        allowed: true,
        available: op.quota.burst(),
        remaining: op.quota.burst(),
        next: BucketState {
            tokens: op.quota.burst(),
            last_us: 0,
        },
        retry_after_secs: 0,
        full_in_us: 0,
    }
}

/// A verdict that refuses because the store is away (`closed`).
fn closed_verdict() -> Verdict {
    Verdict {
        allowed: false,
        available: 0,
        remaining: 0,
        next: BucketState {
            tokens: 0,
            last_us: 0,
        },
        retry_after_secs: CLOSED_RETRY_SECS,
        full_in_us: 0,
    }
}

impl LocalMode {
    /// Local mode, off; the journal a previous run left in `config.journal` is read back (its
    /// spend is charged once the store answers).
    pub fn new(config: LocalConfig) -> LocalMode {
        let mirror = MemoryStore::new(MemoryStoreConfig {
            max_buckets: config.max_buckets.get(),
            ..MemoryStoreConfig::default()
        });
        let mut journal = Journal::default();
        if let Some(path) = &config.journal {
            match std::fs::read(path) {
                Ok(bytes) => match serde_json::from_slice::<JournalFile>(&bytes) {
                    Ok(file) => {
                        let pending =
                            file.open.len() + file.sending.as_ref().map_or(0, |b| b.charges.len());
                        if pending > 0 {
                            tracing::info!(
                                file = %path.display(),
                                charges = pending,
                                "write-back journal: spend made while the store was away, charged once it answers"
                            );
                        }
                        journal.sending = file.sending;
                        journal.gateways = file.gateways;
                        for charge in file.open {
                            journal.open.insert(
                                (
                                    u128::from(charge.hi) << 64 | u128::from(charge.lo),
                                    charge.window_id.unwrap_or(0),
                                ),
                                charge,
                            );
                        }
                    }
                    Err(e) => tracing::error!(
                        file = %path.display(),
                        "write-back journal unreadable, its spend is not charged: {e}"
                    ),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::error!(
                    file = %path.display(),
                    "write-back journal unreadable, its spend is not charged: {e}"
                ),
            }
        }
        let gateways = journal.gateways.max(1);
        LocalMode {
            config,
            mirror,
            gateways: AtomicU64::new(gateways),
            local: AtomicBool::new(false),
            since_us: AtomicU64::new(0),
            next_probe_us: AtomicU64::new(0),
            failed_probes: AtomicU32::new(0),
            last_error_log_us: AtomicU64::new(0),
            episode_logged: AtomicBool::new(false),
            last_leave_us: AtomicU64::new(0),
            write_back_failures: AtomicU32::new(0),
            journal: Mutex::new(journal),
            writing: Mutex::new(()),
            counters: LocalCounters::default(),
        }
    }

    pub fn config(&self) -> &LocalConfig {
        &self.config
    }

    /// N: the gateways alive when the store was last reached.
    pub fn gateways(&self) -> u64 {
        self.gateways.load(Ordering::Relaxed).max(1)
    }

    /// Sets N (read from the store's presence set).
    pub fn set_gateways(&self, n: u64) {
        let n = n.max(1);
        if self.gateways.swap(n, Ordering::Relaxed) != n && self.config.journal.is_some() {
            let mut journal = self.journal.lock();
            journal.gateways = n;
            journal.dirty = true;
        }
    }

    /// Whether requests are decided locally now.
    pub fn is_local(&self) -> bool {
        self.local.load(Ordering::Relaxed)
    }

    /// Wall-clock µs local mode began, while in it.
    pub fn local_since_us(&self) -> Option<u64> {
        match self.since_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(us),
        }
    }

    fn mode_of(&self, mode: Option<OnStoreError>) -> OnStoreError {
        mode.unwrap_or(self.config.default_mode)
    }

    /// The store did not answer: local mode begins (logged once, at error level). Returns
    /// whether it began now.
    pub fn enter(&self, now_us: u64, store: &str, what: &str) -> bool {
        if self.local.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.since_us.store(now_us.max(1), Ordering::Relaxed);
        // Back within 10 s of leaving (a store that flaps): the tries keep their backoff.
        let left = self.last_leave_us.load(Ordering::Relaxed);
        if left == 0 || now_us.saturating_sub(left) >= 10 * limiter::US_PER_SEC {
            self.failed_probes.store(0, Ordering::Relaxed);
        }
        self.write_back_failures.store(0, Ordering::Relaxed);
        self.next_probe_us
            .store(now_us.saturating_add(PROBE_FIRST_US), Ordering::Relaxed);
        // A store that answers a ping but refuses writes (full) could flap: one ERROR line
        // every 10 s at most.
        let last = self.last_error_log_us.load(Ordering::Relaxed);
        if last != 0 && now_us.saturating_sub(last) < 10 * limiter::US_PER_SEC {
            tracing::debug!("shared store not answering again: local mode");
            self.episode_logged.store(false, Ordering::Relaxed);
            return true;
        }
        self.last_error_log_us
            .store(now_us.max(1), Ordering::Relaxed);
        self.episode_logged.store(true, Ordering::Relaxed);
        tracing::error!(
            store = %crate::telemetry::redact::url(store),
            gateways = self.gateways(),
            "shared store not answering ({}): local mode, each gateway decides from its own memory with 1/{} of every limit until the store answers",
            crate::telemetry::redact::text(what),
            self.gateways()
        );
        true
    }

    /// The store answers again and what was spent meanwhile is charged: local mode ends
    /// (logged at info level).
    pub fn leave(&self, now_us: u64, store: &str, written_back: WriteBackOutcome) {
        if !self.local.swap(false, Ordering::AcqRel) {
            return;
        }
        let since = self.since_us.swap(0, Ordering::Relaxed);
        self.last_leave_us.store(now_us.max(1), Ordering::Relaxed);
        let lasted_ms = now_us.saturating_sub(since) / 1000;
        if !self.episode_logged.swap(false, Ordering::Relaxed) {
            tracing::debug!(lasted_ms, "shared store answering again: local mode ended");
            return;
        }
        tracing::info!(
            store = %crate::telemetry::redact::url(store),
            lasted_ms,
            charged = written_back.applied,
            already_charged = written_back.duplicate,
            "shared store answering again: local mode ended, local spend charged to the store"
        );
    }

    /// Whether it is time to try the store again (one caller at a time wins a due try).
    pub fn probe_due(&self, now_us: u64) -> bool {
        let due = self.next_probe_us.load(Ordering::Relaxed);
        if now_us < due {
            return false;
        }
        // Whoever moves the time on makes the try; the others decide locally.
        let failed = self.failed_probes.load(Ordering::Relaxed).min(16);
        let ceiling = (PROBE_FIRST_US << failed).min(PROBE_LONGEST_US);
        let wait = PROBE_FIRST_US / 2 + jitter(now_us) % ceiling.max(1);
        self.next_probe_us
            .compare_exchange(
                due,
                now_us.saturating_add(wait),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// A try at the store failed: the next one waits longer.
    pub fn probe_failed(&self) {
        self.failed_probes.fetch_add(1, Ordering::Relaxed);
    }

    /// A write-back failed while the store answered otherwise; true once that has happened
    /// [`WRITE_BACK_TRIES`] times in a row (the store then decides again, the charges kept).
    pub fn write_back_stuck(&self) -> bool {
        self.write_back_failures.fetch_add(1, Ordering::Relaxed) + 1 >= WRITE_BACK_TRIES
    }

    /// Records what the store just answered (the healthy path): each bucket's share of its
    /// state, where local mode would start from.
    pub fn remember(&self, now_us: u64, ops: &[BucketOp], results: &OpResults) {
        let n = self.gateways();
        for (op, r) in ops.iter().zip(results.iter()) {
            if r.fail_open || r.away.is_some() || op.cost > op.quota.burst() {
                continue;
            }
            let share = share_quota(&op.quota, n, op.cost);
            let fleet_tokens = if r.committed {
                r.verdict.remaining
            } else {
                r.verdict.available
            };
            let target = (fleet_tokens / n).min(share.burst());
            let stored = self.mirror.peek(&op.key);
            let now_share = match op.window {
                Some(w) => stored
                    .filter(|s| s.last_us == w.id)
                    .map_or(share.burst(), |s| s.tokens.min(share.burst())),
                None => limiter::available(stored, &share, now_us),
            };
            if now_share == target {
                continue;
            }
            let delta = now_share as i64 - target as i64;
            if let (Some(window), true) = (op.window, delta > 0) {
                if stored.filter(|s| s.last_us == window.id).is_none() {
                    // No entry of this window to settle: spend the difference from a full
                    // share, which makes one.
                    let mut spent = OpResults::new();
                    let _ = self.mirror.apply(
                        now_us,
                        &[BucketOp {
                            quota: share,
                            cost: delta as u64,
                            group: Group::Enforce,
                            ..*op
                        }],
                        &mut spent,
                    );
                    continue;
                }
            }
            self.mirror.adjust(
                now_us,
                &[AdjustOp {
                    key: op.key,
                    quota: share,
                    window_id: op.window.map(|w| w.id),
                    delta,
                }],
            );
        }
    }

    /// Decides `ops` without the store: each by its rule's `on_store_error`.
    pub fn decide(&self, now_us: u64, ops: &[BucketOp], results: &mut OpResults) {
        let n = self.gateways();
        results.clear();
        let closed_enforced = ops.iter().any(|op| {
            op.group == Group::Enforce && self.mode_of(op.on_store_error) == OnStoreError::Closed
        });
        let mut shares: SmallVec<[BucketOp; 4]> = SmallVec::new();
        let mut at: SmallVec<[usize; 4]> = SmallVec::new();
        for (i, op) in ops.iter().enumerate() {
            let mode = self.mode_of(op.on_store_error);
            let result = match mode {
                OnStoreError::Open => OpResult {
                    verdict: open_verdict(op),
                    committed: false,
                    fail_open: true,
                    away: Some(OnStoreError::Open),
                },
                OnStoreError::Closed => OpResult {
                    verdict: closed_verdict(),
                    committed: false,
                    fail_open: false,
                    away: Some(OnStoreError::Closed),
                },
                OnStoreError::Local => {
                    let share = BucketOp {
                        quota: share_quota(&op.quota, n, op.cost),
                        ..*op
                    };
                    if !closed_enforced {
                        shares.push(share);
                        at.push(i);
                    }
                    // Looked at, not spent (replaced below unless the request is refused as
                    // closed).
                    OpResult {
                        verdict: share.check(self.mirror.peek(&op.key), now_us),
                        committed: false,
                        fail_open: false,
                        away: Some(OnStoreError::Local),
                    }
                }
            };
            results.push(result);
        }
        if shares.is_empty() {
            return;
        }
        let mut decided = OpResults::new();
        if self.mirror.apply(now_us, &shares, &mut decided).is_err() {
            return;
        }
        let mut journal = self.journal.lock();
        for (&i, r) in at.iter().zip(decided.iter()) {
            results[i] = OpResult {
                away: Some(OnStoreError::Local),
                ..*r
            };
            if r.committed && !r.fail_open {
                let op = &ops[i];
                self.journal_charge(
                    &mut journal,
                    op.key,
                    &op.quota,
                    op.window.map(|w| w.id),
                    op.spent() as i64,
                );
            }
        }
    }

    /// Settles reservations without the store: on this gateway's shares, and journaled.
    pub fn adjust(&self, now_us: u64, ops: &[AdjustOp]) {
        let n = self.gateways();
        let mut journal = self.journal.lock();
        for op in ops {
            let share = share_quota(&op.quota, n, 0);
            self.mirror.adjust(
                now_us,
                &[AdjustOp {
                    quota: share,
                    ..*op
                }],
            );
            self.journal_charge(&mut journal, op.key, &op.quota, op.window_id, op.delta);
        }
    }

    fn journal_charge(
        &self,
        journal: &mut Journal,
        key: BucketKey,
        quota: &Quota,
        window_id: Option<u64>,
        delta: i64,
    ) {
        if delta == 0 {
            return;
        }
        let slot = (key128(&key), window_id.unwrap_or(0));
        let room = journal.open.len() < self.config.max_buckets.get();
        match journal.open.get_mut(&slot) {
            Some(charge) => charge.delta = charge.delta.saturating_add(delta),
            None if room => {
                journal.open.insert(
                    slot,
                    Charge {
                        hi: key.hi,
                        lo: key.lo,
                        burst: quota.burst(),
                        refill: quota.refill(),
                        period_us: quota.period_us(),
                        window_id,
                        delta,
                    },
                );
            }
            None => {
                journal.dropped = journal.dropped.saturating_add(1);
                if journal.dropped.is_power_of_two() {
                    tracing::warn!(
                        dropped = journal.dropped,
                        "write-back journal full (--local-max-buckets): spend on further buckets is not charged to the store"
                    );
                }
                return;
            }
        }
        journal.dirty = true;
    }

    /// Takes concurrency slots, loop marks and breaker states without the store: `local`
    /// slots from this gateway's share of the limit, `open` ones admitted untaken, `closed`
    /// ones refused.
    pub fn acquire(&self, now_us: u64, id: u64, ops: &[LeaseOp], results: &mut LeaseResults) {
        let n = self.gateways();
        results.clear();
        let closed_enforced = ops.iter().any(|op| {
            op.group == Group::Enforce && self.mode_of(op.on_store_error) == OnStoreError::Closed
        });
        let mut shares: SmallVec<[LeaseOp; 2]> = SmallVec::new();
        let mut at: SmallVec<[usize; 2]> = SmallVec::new();
        for (i, op) in ops.iter().enumerate() {
            let mode = self.mode_of(op.on_store_error);
            let allowed = match mode {
                OnStoreError::Open => true,
                OnStoreError::Closed => false,
                OnStoreError::Local => {
                    if !closed_enforced {
                        shares.push(LeaseOp {
                            max: share_slots(op.max, n),
                            ..*op
                        });
                        at.push(i);
                    }
                    true
                }
            };
            results.push(LeaseResult {
                allowed,
                in_flight: 0,
                committed: false,
                frees_in_us: 0,
                away: Some(mode),
            });
        }
        if shares.is_empty() {
            return;
        }
        let mut taken = LeaseResults::new();
        self.mirror
            .leases()
            .acquire(now_us, id, &shares, &mut taken);
        for (&i, r) in at.iter().zip(taken.iter()) {
            results[i] = LeaseResult {
                away: Some(OnStoreError::Local),
                ..*r
            };
        }
    }

    /// Forgets this gateway's shares of `keys` (an operator reset them in the store).
    pub fn forget(&self, keys: &[BucketKey]) {
        for key in keys {
            self.mirror.remove(key);
        }
        let mut journal = self.journal.lock();
        let before = journal.open.len();
        journal
            .open
            .retain(|(k, _), _| !keys.iter().any(|key| key128(key) == *k));
        if journal.open.len() != before {
            journal.dirty = true;
        }
    }

    /// Gives back slots taken locally (a no-op for slots the store holds).
    pub fn release(&self, id: u64, keys: &[BucketKey]) {
        self.mirror.leases().release(id, keys);
    }

    /// The batch to send now: the one being sent, or the open spend as a new batch under a
    /// new id (written to the journal's file first, so a crash mid-send sends it again under
    /// the same id). `None`: nothing to charge.
    pub fn batch_to_send(&self, now_us: u64) -> Option<Batch> {
        let (batch, snapshot) = {
            let mut journal = self.journal.lock();
            if journal.sending.is_none() && !journal.open.is_empty() {
                let charges: Vec<Charge> = journal.open.drain().map(|(_, c)| c).collect();
                journal.sending = Some(Batch {
                    id: format!("{}:{now_us}", self.config.gateway_id),
                    charges,
                });
                journal.dirty = true;
            }
            (journal.sending.clone(), self.snapshot(&mut journal))
        };
        self.write_snapshot(snapshot);
        batch
    }

    /// The store confirmed batch `id`.
    pub fn batch_sent(&self, id: &str, outcome: WriteBackOutcome) {
        self.write_back_failures.store(0, Ordering::Relaxed);
        let mut journal = self.journal.lock();
        if journal.sending.as_ref().is_some_and(|b| b.id == id) {
            journal.sending = None;
            journal.dirty = true;
        }
        self.counters
            .write_backs_applied
            .fetch_add(outcome.applied, Ordering::Relaxed);
        self.counters
            .write_backs_duplicate
            .fetch_add(outcome.duplicate, Ordering::Relaxed);
        let snapshot = self.snapshot(&mut journal);
        drop(journal);
        self.write_snapshot(snapshot);
    }

    /// Sending a batch failed (it is sent again later).
    pub fn batch_failed(&self) {
        self.counters
            .write_backs_failed
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Charges waiting to be sent.
    pub fn pending_charges(&self) -> usize {
        let journal = self.journal.lock();
        journal.open.len() + journal.sending.as_ref().map_or(0, |b| b.charges.len())
    }

    /// Writes the journal to its file if it changed (the presence tick, and around every
    /// batch): a crash loses at most the spend of one tick.
    pub fn persist(&self) {
        let snapshot = self.snapshot(&mut self.journal.lock());
        self.write_snapshot(snapshot);
    }

    /// The journal's file contents if it changed since last written (taken under its lock;
    /// written outside it, so local decisions never wait on the disk).
    fn snapshot(&self, journal: &mut Journal) -> Option<Vec<u8>> {
        self.config.journal.as_ref()?;
        if !journal.dirty {
            return None;
        }
        journal.dirty = false;
        let file = JournalFile {
            sending: journal.sending.clone(),
            open: journal.open.values().copied().collect(),
            gateways: journal.gateways,
        };
        serde_json::to_vec(&file).ok()
    }

    fn write_snapshot(&self, snapshot: Option<Vec<u8>>) {
        let (Some(path), Some(bytes)) = (&self.config.journal, snapshot) else {
            return;
        };
        // One writer at a time.
        let _writing = self.writing.lock();
        let written = (|| {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = written {
            // Written again at the next change or tick.
            self.journal.lock().dirty = true;
            tracing::error!(
                file = %path.display(),
                "write-back journal not written (a restart now would forget local spend): {e}"
            );
        }
    }

    /// What `/metrics`, `/readyz` and the status page show.
    pub fn stats(&self) -> super::ops::LocalStats {
        super::ops::LocalStats {
            local_mode: self.is_local(),
            gateways: self.gateways(),
            write_backs: [
                self.counters.write_backs_applied.load(Ordering::Relaxed),
                self.counters.write_backs_duplicate.load(Ordering::Relaxed),
                self.counters.write_backs_failed.load(Ordering::Relaxed),
            ],
            pending: self.pending_charges() as u64,
            since_us: self.local_since_us(),
        }
    }

    /// The mirror's sweep (full-again buckets, expired slots).
    pub fn sweep(&self, now_us: u64) -> u64 {
        self.mirror.sweep(now_us) + self.mirror.leases().sweep(now_us)
    }

    /// The mirror's current share of a bucket (tests, `/v1/buckets` while local).
    pub fn peek(&self, key: &BucketKey) -> Option<BucketState> {
        self.mirror.peek(key)
    }
}

/// Cheap randomness for the probe's jitter: the time, mixed (no two gateways, nor two
/// tries, draw in step).
fn jitter(now_us: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    thread_local! {
        static STATE: std::collections::hash_map::RandomState = std::collections::hash_map::RandomState::new();
    }
    STATE.with(|s| {
        let mut h = s.build_hasher();
        h.write_u64(now_us);
        h.finish()
    })
}

#[cfg(test)]
mod tests;
