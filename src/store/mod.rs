//! Bucket stores: where token-bucket state lives. A store applies the pure limiter maths
//! ([`crate::limiter::check`]) to every bucket of one request atomically, with all-or-nothing
//! commit per [`Group`]: either every bucket of the group is spent, or none is.
//!
//! The embedded [`MemoryStore`] is the default; networked stores share the same contract.

pub mod memory;
pub mod postgres;
pub mod redis;

pub use self::postgres::PostgresStore;
pub use self::redis::{RedisConfig, RedisStore};
pub use memory::{MemoryStore, MemoryStoreConfig};

use crate::limiter::{Quota, Verdict};
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
}

/// The answer for one [`BucketOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpResult {
    pub verdict: Verdict,
    /// The group was committed (every op of the group allowed) and this bucket was spent.
    pub committed: bool,
    /// The bucket could not be stored (store full): the request was allowed without tracking.
    pub fail_open: bool,
}

/// Results, one per op, in op order.
pub type OpResults = SmallVec<[OpResult; 4]>;

/// A store failure (networked stores); the engine fails open on it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// Gauges and counters a store exposes for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub entries: u64,
    pub evictions: u64,
    pub fail_open: u64,
}

/// A synchronous bucket store.
pub trait Store: Send + Sync {
    /// Checks every op at `now_us` and commits each group whose ops all allow. `results` is
    /// cleared and receives one entry per op, in op order (a caller-owned buffer: results are
    /// not moved around on the hot path).
    ///
    /// # Errors
    /// The store could not answer; nothing was spent.
    fn apply(
        &self,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError>;

    /// Current gauges and counters.
    fn stats(&self) -> StoreStats;

    /// Drops entries that no longer matter (full again, or idle); returns how many.
    fn sweep(&self, now_us: u64) -> u64;
}

/// The name of a bucket in a shared store: its 128-bit hash, with its own Redis hash tag.
pub(crate) fn shared_key(key: &BucketKey) -> String {
    format!("tollgate:{{{:016x}{:016x}}}", key.hi, key.lo)
}

/// A quota's rate reduced to lowest terms (µtokens per µs): small numbers keep a shared store's
/// arithmetic exact (Lua doubles) and cheap (SQL numeric).
pub(crate) fn reduced_rate(q: &Quota) -> (u64, u64) {
    fn gcd(mut a: u64, mut b: u64) -> u64 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a.max(1)
    }
    let g = gcd(q.refill(), q.period_us());
    (q.refill() / g, q.period_us() / g)
}

/// Turns a shared store's answer (each bucket's tokens at `now_us`, and whether the enforced and
/// shadow groups passed) into results, with the embedded store's maths for the details.
pub(crate) fn outcomes_from(
    now_us: u64,
    ops: &[BucketOp],
    enforce_ok: bool,
    shadow_ok: bool,
    available: &[u64],
    results: &mut OpResults,
) {
    results.clear();
    for (op, &tokens) in ops.iter().zip(available) {
        let state = Some(crate::limiter::BucketState {
            tokens,
            last_us: now_us,
        });
        let verdict = crate::limiter::check(state, &op.quota, now_us, op.cost);
        let committed = match op.group {
            Group::Enforce => enforce_ok,
            Group::Shadow => enforce_ok && shadow_ok,
        };
        results.push(OpResult {
            verdict,
            committed,
            fail_open: false,
        });
    }
}

/// Health of a networked store: failures counted, logged once per burst, recovery logged.
#[derive(Default)]
pub(crate) struct Health {
    degraded: std::sync::atomic::AtomicBool,
    errors: std::sync::atomic::AtomicU64,
    last_log: parking_lot::Mutex<Option<std::time::Instant>>,
}

impl Health {
    pub(crate) fn degraded(&self) -> bool {
        self.degraded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts a failure; logs the first of a burst, then at most one line every 10 s.
    pub(crate) fn failed(&self, store: &str, what: &str) {
        use std::sync::atomic::Ordering;
        let errors = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
        let was_degraded = self.degraded.swap(true, Ordering::Relaxed);
        let mut last = self.last_log.lock();
        if !was_degraded || last.is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(10))
        {
            let store = crate::redact::url(store);
            let what = crate::redact::text(what);
            tracing::error!(store = %store, errors, "shared store failing open: {what}");
            *last = Some(std::time::Instant::now());
        }
    }

    pub(crate) fn ok(&self, store: &str) {
        if self
            .degraded
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::info!(store = %crate::redact::url(store), "shared store answering again");
        }
    }
}

/// A store shared by several gateways.
pub enum SharedStore {
    Redis(std::sync::Arc<RedisStore>),
    Postgres(std::sync::Arc<PostgresStore>),
}

impl SharedStore {
    /// `redis://`, `redis+cluster://`, `postgres://` or `postgresql://` URLs.
    ///
    /// # Errors
    /// The URL is not usable.
    pub fn open(url: &str, timeout: std::time::Duration) -> Result<Self, StoreError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(SharedStore::Postgres(PostgresStore::new(
                url.to_string(),
                timeout,
            )?))
        } else {
            Ok(SharedStore::Redis(RedisStore::new(RedisConfig {
                url: url.to_string(),
                timeout,
            })?))
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            SharedStore::Redis(_) => "redis",
            SharedStore::Postgres(_) => "postgres",
        }
    }

    pub fn connect_in_background(&self) {
        match self {
            SharedStore::Redis(s) => s.connect_in_background(),
            SharedStore::Postgres(s) => s.connect_in_background(),
        }
    }

    pub fn connected(&self) -> bool {
        match self {
            SharedStore::Redis(s) => s.connected(),
            SharedStore::Postgres(s) => s.connected(),
        }
    }

    pub fn degraded(&self) -> bool {
        match self {
            SharedStore::Redis(s) => s.degraded(),
            SharedStore::Postgres(s) => s.degraded(),
        }
    }

    /// # Errors
    /// The store could not answer in time; nothing was spent.
    pub async fn apply(
        &self,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError> {
        match self {
            SharedStore::Redis(s) => s.apply(now_us, ops, results).await,
            SharedStore::Postgres(s) => s.apply(now_us, ops, results).await,
        }
    }

    /// Periodic clean-up (PostgreSQL deletes full-again rows; Redis keys expire by themselves).
    pub async fn sweep(&self, now_us: u64) -> u64 {
        match self {
            SharedStore::Redis(s) => {
                // Redis expires its own keys; the tick keeps the clock offset fresh.
                s.refresh_time_offset().await;
                0
            }
            SharedStore::Postgres(s) => s.sweep(now_us).await,
        }
    }
}
