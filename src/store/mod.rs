//! Bucket stores: where token-bucket state lives. A store applies the pure limiter maths
//! ([`crate::limiter::check`]) to every bucket of one request atomically, with all-or-nothing
//! commit per [`Group`]: either every bucket of the group is spent, or none is.
//!
//! The embedded [`MemoryStore`] is the default; networked stores share the same contract.

pub mod memory;
pub mod redis;

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
