//! The embedded store: a bounded, sharded concurrent map (ahash-free by design: keys are
//! already 128-bit hashes, so the map's hasher just passes one half through).
//!
//! Each entry is 40 bytes (16-byte key, 24-byte slot) plus the map's control byte.
//!
//! What it loses, on purpose and nothing else:
//! - entries whose bucket is full again: they are indistinguishable from absent ones (a new
//!   bucket starts full), so dropping them loses nothing. They are evicted first.
//! - entries idle longer than `idle_timeout` (default 300 s) that are not full yet, only under
//!   memory pressure: by the sweep when the store is above 3/4 of its bound, and when a full
//!   store has nothing full-again to drop. A drained bucket of a long quota (300 per 180 min)
//!   is otherwise kept until it is full again.
//! - when a shard is full and nothing in it is full-again or idle, a *new* key is not stored:
//!   its request is allowed (fail-open) and counted. Live buckets are never evicted, so a flood
//!   of fresh keys cannot reset anyone's limit.

use super::{BucketKey, BucketOp, Group, OpResult, OpResults, StoreError, StoreStats};
use crate::limiter::{self, BucketState, US_PER_SEC};
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Limits of the embedded store.
#[derive(Debug, Clone, Copy)]
pub struct MemoryStoreConfig {
    /// Most entries ever held (memory bound).
    pub max_buckets: usize,
    /// Entries untouched for longer than this are dropped (microseconds).
    pub idle_timeout_us: u64,
    /// Minimum spacing of on-demand purges of a full shard (microseconds), so a flood of new
    /// keys against a full store cannot turn every request into a shard scan.
    pub purge_interval_us: u64,
}

impl Default for MemoryStoreConfig {
    fn default() -> Self {
        MemoryStoreConfig {
            max_buckets: 1_000_000,
            idle_timeout_us: 300 * 1_000_000,
            purge_interval_us: 1_000_000,
        }
    }
}

/// What is kept per bucket. The two housekeeping times are whole seconds (`u32`, 136 years
/// of uptime), so the slot stays 24 bytes.
#[derive(Debug, Clone, Copy)]
struct Slot {
    tokens: u64,
    last_us: u64,
    /// When the bucket is full again (as of the last write), rounded up to a second: after
    /// that it can be dropped.
    full_at_s: u32,
    /// The last request that touched the bucket, refused ones included: "idle" is measured
    /// from here, so a drained client that keeps hammering is never idle (it would otherwise
    /// be evicted under memory pressure and handed a fresh, full bucket).
    seen_s: u32,
}

impl Slot {
    fn is_full_at(&self, now_us: u64) -> bool {
        u64::from(self.full_at_s) * US_PER_SEC <= now_us
    }

    fn idle_for_us(&self, now_us: u64) -> u64 {
        now_us.saturating_sub(u64::from(self.seen_s) * US_PER_SEC)
    }

    fn touch(&mut self, now_us: u64) {
        self.seen_s = self.seen_s.max(secs_u32(now_us));
    }
}

/// Whole seconds of `us`, rounded down, saturating.
fn secs_u32(us: u64) -> u32 {
    u32::try_from(us / US_PER_SEC).unwrap_or(u32::MAX)
}

/// Passes a [`BucketKey`]'s pre-hashed half straight through.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not used by BucketKey; fold anything else in rather than ignore it.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Map = HashMap<BucketKey, Slot, BuildHasherDefault<PassThrough>>;

struct ShardState {
    map: Map,
    last_purge_us: Option<u64>,
}

/// One shard on its own cache line, so two cores locking neighbours do not false-share.
#[repr(align(64))]
struct Shard(Mutex<ShardState>);

/// The embedded bounded store.
pub struct MemoryStore {
    shards: Box<[Shard]>,
    shard_mask: u64,
    config: MemoryStoreConfig,
    /// Live entries across all shards. Touched only by inserts and removals (not by updates of
    /// existing buckets), so it is not a per-request contention point; it makes the bound exact
    /// however unevenly keys fall into shards.
    len: AtomicUsize,
    evictions: AtomicU64,
    fail_open: AtomicU64,
}

impl MemoryStore {
    pub fn new(config: MemoryStoreConfig) -> Self {
        let max = config.max_buckets.max(1);
        // Up to 1 024 shards (about 256 entries each when full). Two cores hitting random keys
        // each take a shard lock whose cache line the other core may hold; many small shards
        // keep that ping-pong rare (measured: 64 shards scaled 1.19x from 1 to 2 threads, 1 024
        // shards 1.42x, see README). Tiny stores keep a few shards.
        let shards = (max / 256).next_power_of_two().clamp(1, 1024);
        MemoryStore {
            shards: (0..shards)
                .map(|_| {
                    Shard(Mutex::new(ShardState {
                        map: Map::default(),
                        last_purge_us: None,
                    }))
                })
                .collect(),
            shard_mask: shards as u64 - 1,
            config,
            len: AtomicUsize::new(0),
            evictions: AtomicU64::new(0),
            fail_open: AtomicU64::new(0),
        }
    }

    fn shard_of(&self, key: &BucketKey) -> usize {
        (key.hi & self.shard_mask) as usize
    }

    /// Total bytes the maps hold for their slots (for the memory-per-key benchmark).
    pub fn allocated_bytes(&self) -> usize {
        let per_slot = std::mem::size_of::<(BucketKey, Slot)>() + 1;
        self.shards
            .iter()
            .map(|s| s.0.lock().map.capacity() * per_slot)
            .sum()
    }

    /// Reads a bucket's stored state (tests and diagnostics).
    pub fn peek(&self, key: &BucketKey) -> Option<BucketState> {
        let shard = self.shards[self.shard_of(key)].0.lock();
        shard.map.get(key).map(|s| BucketState {
            tokens: s.tokens,
            last_us: s.last_us,
        })
    }

    /// Removes full-again entries, then idle ones if none were full. Returns how many went.
    fn purge(&self, shard: &mut ShardState, now_us: u64) -> usize {
        let before = shard.map.len();
        shard.map.retain(|_, slot| !slot.is_full_at(now_us));
        if shard.map.len() == before {
            let idle = self.config.idle_timeout_us;
            shard.map.retain(|_, slot| slot.idle_for_us(now_us) <= idle);
        }
        shard.last_purge_us = Some(now_us);
        let removed = before - shard.map.len();
        self.len.fetch_sub(removed, Ordering::Relaxed);
        self.evictions.fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Reserves room for one new entry; false when the store is at its bound.
    fn reserve(&self) -> bool {
        self.len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.config.max_buckets).then_some(n + 1)
            })
            .is_ok()
    }

    /// Writes one committed bucket; returns false when it could not be stored.
    fn store(&self, shard: &mut ShardState, op: &BucketOp, result: &OpResult, now_us: u64) -> bool {
        let slot = slot_of(result, now_us);
        if let Some(existing) = shard.map.get_mut(&op.key) {
            *existing = slot;
            return true;
        }
        self.insert(shard, op.key, slot, now_us)
    }

    /// Inserts a new entry within the bound: when the store is full, first purges this shard
    /// (full-again entries, else idle ones; at most once per `purge_interval`), else refuses.
    fn insert(&self, shard: &mut ShardState, key: BucketKey, slot: Slot, now_us: u64) -> bool {
        if !self.reserve() {
            let may_purge = shard
                .last_purge_us
                .is_none_or(|at| now_us.saturating_sub(at) >= self.config.purge_interval_us);
            if !may_purge || self.purge(shard, now_us) == 0 || !self.reserve() {
                return false;
            }
        }
        shard.map.insert(key, slot);
        true
    }
}

/// The slot to keep after a committed verdict.
fn slot_of(result: &OpResult, now_us: u64) -> Slot {
    Slot {
        tokens: result.verdict.next.tokens,
        last_us: result.verdict.next.last_us,
        full_at_s: u32::try_from(
            now_us
                .saturating_add(result.verdict.full_in_us)
                .div_ceil(US_PER_SEC),
        )
        .unwrap_or(u32::MAX),
        seen_s: secs_u32(now_us),
    }
}

impl MemoryStore {
    /// One bucket: one shard lock, one hash probe for an existing bucket (the common case).
    fn apply_one(&self, now_us: u64, op: &BucketOp) -> OpResult {
        let mut shard = self.shards[self.shard_of(&op.key)].0.lock();
        if let Some(slot) = shard.map.get_mut(&op.key) {
            let state = BucketState {
                tokens: slot.tokens,
                last_us: slot.last_us,
            };
            let verdict = limiter::check(Some(state), &op.quota, now_us, op.cost);
            let result = OpResult {
                verdict,
                committed: verdict.allowed,
                fail_open: false,
            };
            if verdict.allowed {
                *slot = slot_of(&result, now_us);
            } else {
                slot.touch(now_us);
            }
            return result;
        }
        let mut result = OpResult {
            verdict: limiter::check(None, &op.quota, now_us, op.cost),
            committed: false,
            fail_open: false,
        };
        if result.verdict.allowed {
            if self.insert(&mut shard, op.key, slot_of(&result, now_us), now_us) {
                result.committed = true;
            } else {
                result.fail_open = true;
                self.fail_open.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }
}

impl MemoryStore {
    /// Checks every op at `now_us` and commits each group whose ops all allow. `results` is
    /// cleared and receives one entry per op, in op order (a caller-owned buffer: results are
    /// not moved around on the hot path).
    ///
    /// # Errors
    /// Never today (the embedded store always answers); the signature matches the shared
    /// stores'.
    pub fn apply(
        &self,
        now_us: u64,
        ops: &[BucketOp],
        results: &mut OpResults,
    ) -> Result<(), StoreError> {
        results.clear();
        if let [op] = ops {
            results.push(self.apply_one(now_us, op));
            return Ok(());
        }
        // Lock every shard the request touches, in index order (no deadlock between requests).
        let mut wanted: SmallVec<[usize; 4]> =
            ops.iter().map(|op| self.shard_of(&op.key)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let mut guards: SmallVec<[(usize, MutexGuard<'_, ShardState>); 4]> = wanted
            .iter()
            .map(|&i| (i, self.shards[i].0.lock()))
            .collect();
        let slot_of = |guards: &SmallVec<[(usize, MutexGuard<'_, ShardState>); 4]>, idx: usize| {
            guards.iter().position(|(i, _)| *i == idx).unwrap_or(0)
        };

        results.extend(ops.iter().map(|op| {
            let g = &guards[slot_of(&guards, self.shard_of(&op.key))].1;
            let state = g.map.get(&op.key).map(|s| BucketState {
                tokens: s.tokens,
                last_us: s.last_us,
            });
            OpResult {
                verdict: limiter::check(state, &op.quota, now_us, op.cost),
                committed: false,
                fail_open: false,
            }
        }));

        let group_allows = |group: Group, results: &OpResults| {
            ops.iter()
                .zip(results.iter())
                .filter(|(op, _)| op.group == group)
                .all(|(_, r)| r.verdict.allowed)
        };
        let enforce_allows = group_allows(Group::Enforce, results);
        for group in [Group::Enforce, Group::Shadow] {
            // A refused request spends nothing anywhere, shadow buckets included: shadow
            // counts then describe the traffic that would really have reached the upstream.
            if !enforce_allows || !group_allows(group, results) {
                continue;
            }
            for (op, result) in ops.iter().zip(results.iter_mut()) {
                if op.group != group {
                    continue;
                }
                let at = slot_of(&guards, self.shard_of(&op.key));
                if self.store(&mut guards[at].1, op, result, now_us) {
                    result.committed = true;
                } else {
                    result.fail_open = true;
                    self.fail_open.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Buckets of a refused request were still asked about: they are not idle.
        for (op, result) in ops.iter().zip(results.iter()) {
            if result.committed {
                continue;
            }
            let at = slot_of(&guards, self.shard_of(&op.key));
            if let Some(slot) = guards[at].1.map.get_mut(&op.key) {
                slot.touch(now_us);
            }
        }
        Ok(())
    }

    /// Counters only: a scrape never takes a shard lock.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            entries: Some(self.len.load(Ordering::Relaxed) as u64),
            evictions: self.evictions.load(Ordering::Relaxed),
            fail_open: self.fail_open.load(Ordering::Relaxed),
        }
    }

    /// Drops buckets that are full again, and idle ones when memory is short; returns how many.
    pub fn sweep(&self, now_us: u64) -> u64 {
        let idle = self.config.idle_timeout_us;
        // Idle buckets that are not full yet still hold state (a drained client of a 300 per
        // 180 min quota must not come back to a full bucket after 5 idle minutes); they go only
        // when memory is short: above 3/4 of the bound.
        let pressed = self.len.load(Ordering::Relaxed) >= self.config.max_buckets / 4 * 3;
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            let mut s = shard.0.lock();
            let before = s.map.len();
            s.map.retain(|_, slot| {
                let full = slot.is_full_at(now_us);
                let idle = slot.idle_for_us(now_us) > idle;
                !(full || (pressed && idle))
            });
            removed += (before - s.map.len()) as u64;
        }
        self.len.fetch_sub(removed as usize, Ordering::Relaxed);
        self.evictions.fetch_add(removed, Ordering::Relaxed);
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Quota, MICRO, US_PER_SEC};

    /// `apply` returning its results, for tests.
    fn run(store: &MemoryStore, now: u64, ops: &[BucketOp]) -> OpResults {
        let mut results = OpResults::new();
        store.apply(now, ops, &mut results).unwrap();
        results
    }
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    fn quota(rate: u64, burst: u64) -> Quota {
        Quota::new(burst * MICRO, rate * MICRO, US_PER_SEC).unwrap()
    }

    fn op(key: &str, q: Quota, group: Group) -> BucketOp {
        BucketOp {
            key: BucketKey::of(key),
            quota: q,
            cost: MICRO,
            group,
        }
    }

    fn small(max: usize) -> MemoryStore {
        MemoryStore::new(MemoryStoreConfig {
            max_buckets: max,
            idle_timeout_us: 300 * US_PER_SEC,
            purge_interval_us: 0,
        })
    }

    #[test]
    fn a_rejecting_rule_spends_nothing_anywhere() {
        let store = small(100);
        let loose = op("tb:loose:a", quota(1, 10), Group::Enforce);
        let tight = op("tb:tight:a", quota(1, 1), Group::Enforce);
        let r = run(&store, 0, &[loose, tight]);
        assert!(r.iter().all(|r| r.verdict.allowed && r.committed));
        // The tight bucket is empty now: the next request is rejected by it...
        let r = run(&store, 0, &[loose, tight]);
        assert!(r[0].verdict.allowed && !r[1].verdict.allowed);
        assert!(!r[0].committed);
        // ...and the loose bucket still holds 9 tokens, not 8.
        assert_eq!(store.peek(&loose.key).unwrap().tokens, 9 * MICRO);
    }

    #[test]
    fn shadow_and_enforce_groups_commit_independently() {
        let store = small(100);
        let enforce = op("tb:e:a", quota(1, 5), Group::Enforce);
        let shadow = op("shadow:tb:s:a", quota(1, 1), Group::Shadow);
        run(&store, 0, &[enforce, shadow]);
        let r = run(&store, 0, &[enforce, shadow]);
        assert!(
            r[0].committed,
            "a shadow would-reject must not block enforcement"
        );
        assert!(!r[1].verdict.allowed);
        assert_eq!(store.peek(&enforce.key).unwrap().tokens, 3 * MICRO);
    }

    #[test]
    fn full_store_evicts_full_buckets_first_then_fails_open() {
        let store = small(2);
        let q = quota(1, 2);
        // Two keys, both drained by one token; at t=0 neither is full.
        run(&store, 0, &[op("tb:r:a", q, Group::Enforce)]);
        run(&store, 0, &[op("tb:r:b", q, Group::Enforce)]);
        // A third key cannot be stored: allowed, not committed, counted.
        let r = run(&store, 0, &[op("tb:r:c", q, Group::Enforce)]);
        assert!(r[0].verdict.allowed && r[0].fail_open && !r[0].committed);
        assert_eq!(store.stats().fail_open, 1);
        assert_eq!(store.stats().entries, Some(2));
        // After 1 s both are full again: they are evicted and the new key is stored.
        let r = run(&store, US_PER_SEC, &[op("tb:r:c", q, Group::Enforce)]);
        assert!(r[0].committed);
        assert_eq!(store.stats().evictions, 2);
        assert_eq!(store.stats().entries, Some(1));
    }

    #[test]
    fn sweep_drops_full_buckets_and_keeps_idle_unfull_ones() {
        let store = small(100);
        let fast = quota(1, 2);
        let slow = Quota::new(300 * MICRO, MICRO, 3_600 * US_PER_SEC).unwrap();
        run(&store, 0, &[op("tb:fast:a", fast, Group::Enforce)]);
        run(&store, 0, &[op("tb:slow:a", slow, Group::Enforce)]);
        assert_eq!(store.sweep(500_000), 0);
        // At 2 s the fast bucket is full again; the slow one is not and not idle.
        assert_eq!(store.sweep(2 * US_PER_SEC), 1);
        assert!(store.peek(&BucketKey::of("tb:slow:a")).is_some());
        // Past the idle timeout it stays (not full, no memory pressure)...
        assert_eq!(store.sweep(301 * US_PER_SEC), 0);
        // ...until it is full again (one token per hour).
        assert_eq!(store.sweep(3_600 * US_PER_SEC), 1);
        assert_eq!(store.stats().entries, Some(0));
    }

    #[test]
    fn under_memory_pressure_the_sweep_drops_idle_buckets() {
        let store = small(4);
        let slow = Quota::new(300 * MICRO, MICRO, 3_600 * US_PER_SEC).unwrap();
        for k in ["a", "b", "c"] {
            run(
                &store,
                0,
                &[op(&format!("tb:slow:{k}"), slow, Group::Enforce)],
            );
        }
        run(
            &store,
            290 * US_PER_SEC,
            &[op("tb:slow:d", slow, Group::Enforce)],
        );
        // 4 of 4 held: above 3/4. a, b, c idle for 301 s go; d (idle 11 s) stays.
        assert_eq!(store.sweep(301 * US_PER_SEC), 3);
        assert!(store.peek(&BucketKey::of("tb:slow:d")).is_some());
    }

    /// Issue 13, attack 7: a drained client that keeps hammering is not idle. Refusals
    /// refresh the bucket's activity, so memory pressure never hands it a fresh bucket.
    #[test]
    fn refusals_keep_a_drained_bucket_from_being_idle() {
        let store = MemoryStore::new(MemoryStoreConfig {
            max_buckets: 4,
            idle_timeout_us: 5 * US_PER_SEC,
            purge_interval_us: 0,
        });
        let slow = Quota::new(20 * MICRO, MICRO, 3_600 * US_PER_SEC).unwrap();
        let hammer = op("tb:slow:hammer", slow, Group::Enforce);
        for _ in 0..20 {
            assert!(run(&store, 0, &[hammer])[0].committed);
        }
        // Drained: refused once a second for 6 s (past the 5 s idle timeout).
        for second in 1..=6 {
            assert!(
                !run(&store, second * US_PER_SEC, &[hammer])[0]
                    .verdict
                    .allowed
            );
        }
        // Fill the store to the bound (3 more keys) and press it: the sweep and a new key
        // that needs room both look for idle buckets.
        for k in ["a", "b", "c"] {
            run(
                &store,
                0,
                &[op(&format!("tb:slow:{k}"), slow, Group::Enforce)],
            );
        }
        assert_eq!(store.sweep(6 * US_PER_SEC + 1), 3);
        let state = store
            .peek(&hammer.key)
            .expect("the hammering client's bucket is kept");
        assert_eq!(state.tokens, 0);
        // Still refused: no fresh bucket.
        assert!(
            !run(&store, 6 * US_PER_SEC + 2, &[hammer])[0]
                .verdict
                .allowed
        );
        // Through a multi-bucket request too.
        let other = op("tb:other:hammer", quota(1, 100), Group::Enforce);
        for second in 7..=12 {
            let r = run(&store, second * US_PER_SEC, &[other, hammer]);
            assert!(!r[1].verdict.allowed && !r[0].committed);
        }
        assert_eq!(store.sweep(12 * US_PER_SEC + 1), 0);
        assert!(store.peek(&hammer.key).is_some());
    }

    #[test]
    fn memory_is_bounded() {
        let store = MemoryStore::new(MemoryStoreConfig {
            max_buckets: 5_000,
            ..MemoryStoreConfig::default()
        });
        let q = quota(1, 100);
        for i in 0..20_000 {
            run(&store, 0, &[op(&format!("tb:r:{i}"), q, Group::Enforce)]);
        }
        let stats = store.stats();
        // The bound is exact, however keys fall into shards.
        assert_eq!(stats.entries, Some(5_000), "{stats:?}");
        assert_eq!(stats.fail_open, 15_000);
        let held: usize = store.shards.iter().map(|s| s.0.lock().map.len()).sum();
        assert_eq!(held, 5_000);
    }

    /// Two threads hammering one key together admit exactly what the maths allows: with a
    /// frozen clock, exactly `burst`.
    #[test]
    fn concurrent_hammering_admits_exactly_the_burst() {
        let store = Arc::new(small(1000));
        let admitted = Arc::new(AtomicUsize::new(0));
        let q = quota(1, 1000);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = Arc::clone(&store);
                let admitted = Arc::clone(&admitted);
                std::thread::spawn(move || {
                    for _ in 0..2_000 {
                        let tight = op("tb:hot:k", q, Group::Enforce);
                        let r = run(&store, 5, &[tight]);
                        if r[0].committed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(admitted.load(Ordering::Relaxed), 1000);
        assert_eq!(store.peek(&BucketKey::of("tb:hot:k")).unwrap().tokens, 0);
    }

    #[test]
    fn entries_stay_small() {
        assert_eq!(std::mem::size_of::<(BucketKey, Slot)>(), 40);
    }
}
