//! The embedded store: a bounded map of buckets, read and updated without a shard lock.
//!
//! Each shard is an open-addressing table (linear probing) of 40-byte slots: a 16-byte key,
//! micro-tokens, the last refill, and one word holding a per-bucket lock bit, the whole second
//! the bucket is full again and what it had spent at its last commit. Tables start small and
//! double as keys arrive, so memory follows the live buckets (about 84 bytes each at 1 M keys,
//! measured as process RSS).
//!
//! - **Hot path, existing bucket**: a lock-free probe (atomic loads of keys in the shard's
//!   current table, under an epoch guard), then the bucket's own lock bit, the limiter maths,
//!   the write, the unlock. Two cores updating different buckets share no lock, so the store
//!   scales with cores.
//! - **Structure** (new keys, growth, eviction, sweep) changes under the shard's mutex.
//!   Deletion shifts later entries back (no tombstones), each move under both slots' locks;
//!   growth copies every slot under its lock into a doubled table, marks the old slot moved,
//!   publishes the new table, and frees the old one once no probe can still be reading it
//!   (crossbeam's epochs). A probe that races a move or a growth retries; every miss is checked
//!   again under the mutex before anything is inserted, so a key is never duplicated and no
//!   update is lost. Requests with several buckets take their shards' mutexes (in order), make
//!   room first (evictions included), then take the buckets' locks (in address order) and
//!   commit all-or-nothing; single-bucket updates never wait for a mutex while holding a bucket
//!   lock, so nothing can deadlock.
//!
//! What it loses, on purpose and nothing else:
//! - entries whose bucket is full again: they are indistinguishable from absent ones (a new
//!   bucket starts full), so dropping them loses nothing. The sweep drops them, and so does a
//!   purge of the key's shard when the store is full (at most once per `purge_interval`).
//!   A budget is full again when its window ends, so a spent budget is never dropped before.
//! - when a new key needs an entry and the store is at its bound (or the key's shard is 3/4
//!   full at its largest), the entry that costs least to forget: `choose_victim` reads
//!   [`EVICTION_SAMPLES`] entries, the next one after each of as many pseudo-random positions
//!   of the shard, and evicts the one whose loss gives away least (`giveaway`: a budget's spend
//!   until its window ends, a token bucket's spend shrinking linearly to nothing as it refills;
//!   ranked in whole units, the least recently used first among equals: `victim_rank`). An
//!   evicted entry gives away at most what the cheapest of the sampled entries held, rounded up
//!   to a unit; a flood of made-up keys, whose entries hold one request's spend each, evicts its
//!   own entries, not a tenant's spent budget nor a client early in its burst. Neither the purge
//!   nor the eviction removes a key of the request making room. A new key is never let through
//!   untracked for want of room (`fail_open` counts it if it ever is, which only a table
//!   without a free slot could cause); a zero-cost look at an absent key needs no entry and
//!   takes none. Concurrency slots and breakers are in the lease table, which this never
//!   touches.
//! - nothing of what an evicted entry held: its spend and full-again second go into the record
//!   of evicted spend (`evicted`, a count-min sketch of fixed size), and a key the store does
//!   not hold starts from what the record keeps for it, never from less. So no flood, whatever
//!   its shape, gives an entry's owner anything back; a key never evicted starts charged only
//!   when all its cells hold other keys' live records (the sketch's false refusals).
//!
//! With a state dir ([`MemoryStore::in_state_file`]) the tables are not grown but made at their
//! largest size in the state file, and the shard heads and the entry count live there too; the
//! locks are lock words in the file ([`state_file::lock`]), so two processes sharing the file
//! during an upgrade update it as one.
//!
//! Why this file is about 1 200 lines: the slot layout, the probe, the moves of deletion and
//! growth, and the multi-bucket commit are one lock protocol, and its correctness argument (who
//! may touch a slot while which lock is held, when a table may be freed) has to be read in one
//! place; split up, each half would be safe only because of the other. Its tests are beside it
//! in `tests.rs`.

use super::ops::{
    BucketKey, BucketOp, EvictionStats, Group, OpResult, OpResults, StoreError, StoreStats,
    FORGIVEN_BOUNDS_MICRO,
};
use super::probe::stays;

mod evicted;
use super::state_file::{self, Geometry, StateFile, WordGuard};
use crate::limits::limiter::{BucketState, US_PER_SEC};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Limits of the embedded store.
#[derive(Debug, Clone, Copy)]
pub struct MemoryStoreConfig {
    /// Most entries ever held (memory bound).
    pub max_buckets: usize,
    /// Minimum spacing of on-demand purges of a full shard (microseconds), so a flood of new
    /// keys against a full store cannot turn every request into a shard scan.
    pub purge_interval_us: u64,
    /// Most loop-detection marks held at once (`--max-loop-marks`): their own table, apart
    /// from concurrency slots and breakers.
    pub max_loop_marks: usize,
}

impl Default for MemoryStoreConfig {
    fn default() -> Self {
        MemoryStoreConfig {
            max_buckets: 1_000_000,
            purge_interval_us: 1_000_000,
            max_loop_marks: super::marks::DEFAULT_MAX_LOOP_MARKS,
        }
    }
}

/// The `meta` word: bit 63 is the bucket's lock; bit 62 marks a slot whose entry was copied
/// into a grown table (probes that meet it retry there); bits 32..62 the second (since the
/// time base's origin) the bucket is full again, rounded up; bit 31 set for a budget (its spend
/// stays until that second), clear for a token bucket (its spend refills linearly until then);
/// bit 30 ([`SPEND_KNOWN`]) set by every commit of this build; bits 0..30 the micro-tokens it
/// had spent at its last commit ([`encode_spent`]): what forgetting it would give away, read by
/// the eviction's sampling ([`giveaway`]).
///
/// Builds before this one kept the second a request last touched the bucket in bits 0..32,
/// in state files too ([`state_file::SLOT_FORMAT_SPEND`]). Such a second (since 2020) stays
/// below 2^30 until 2054, the end of the file's time base, so bit 30 tells the two apart slot
/// by slot, even while an older process of an upgrade still writes the file: a slot without
/// it holds a spend this build does not know ([`giveaway`] ranks it above every known one).
const LOCKED: u64 = 1 << 63;
const MOVED: u64 = 1 << 62;
const FULL_AT_MAX: u64 = (1 << 30) - 1;
const BUDGET: u64 = 1 << 31;
const SPEND_KNOWN: u64 = 1 << 30;
const SPENT_MASK: u64 = SPEND_KNOWN - 1;
/// What [`giveaway`] says of an entry whose spend is not known: more than any known spend.
pub(super) const UNKNOWN_SPEND: u64 = u64::MAX;

fn pack_meta(full_at_s: u64, spend: Spend) -> u64 {
    (full_at_s.min(FULL_AT_MAX) << 32)
        | if spend.budget { BUDGET } else { 0 }
        | SPEND_KNOWN
        | encode_spent(spend.micro)
}

fn meta_full_at_s(meta: u64) -> u64 {
    (meta & !(LOCKED | MOVED)) >> 32
}

/// A slot written by an older build (see [`SPEND_KNOWN`]) as this build keeps it: its
/// full-again second, its spend unknown (never decaying).
fn legacy_as_unknown(meta: u64) -> u64 {
    meta & !(SPEND_KNOWN | BUDGET | SPENT_MASK)
}

/// Bits of the kept spend's mantissa.
const SPENT_MANTISSA: u32 = 25;

/// Micro-tokens in 30 bits, a small float: a 25-bit mantissa and a 5-bit exponent, exact up to
/// 2^25 (33 tokens), then within 2^-24 of the amount (rounded down), saturating at about
/// 7 · 10^10 tokens. Monotonic, so encoded amounts compare as the amounts do.
fn encode_spent(micro: u64) -> u64 {
    let bits = u64::BITS - micro.leading_zeros();
    if bits <= SPENT_MANTISSA {
        return micro;
    }
    let exp = u64::from(bits - SPENT_MANTISSA);
    if exp > 31 {
        return SPENT_MASK;
    }
    (exp << SPENT_MANTISSA) | ((micro >> exp) & ((1 << SPENT_MANTISSA) - 1))
}

/// The amount [`encode_spent`] kept.
fn decode_spent(encoded: u64) -> u64 {
    let encoded = encoded & SPENT_MASK;
    let exp = encoded >> SPENT_MANTISSA;
    (encoded & ((1 << SPENT_MANTISSA) - 1)) << exp
}

/// What a committed state holds back from a fresh bucket (which starts full): the micro-tokens
/// spent (burst minus what it holds), and whether they stay spent until the full-again second
/// (a budget's window) or refill linearly until then (a token bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Spend {
    pub micro: u64,
    pub budget: bool,
}

impl Spend {
    /// The spend of a state a bucket of capacity `burst` will hold.
    pub(super) fn of(burst: u64, next: BucketState, budget: bool) -> Spend {
        Spend {
            micro: burst.saturating_sub(next.tokens),
            budget,
        }
    }
}

/// Whether the entry is full again at `now_us`: indistinguishable from an absent one (a new
/// bucket starts full), so dropping it loses nothing.
fn full_again(meta: u64, now_us: u64) -> bool {
    meta_full_at_s(meta) * US_PER_SEC <= now_us
}

/// Micro-tokens forgetting an entry gives away at `now_us` (its next request would find a full
/// bucket instead): nothing once it is full again; a budget's spend until its window ends; a
/// token bucket's spend at its last commit, shrinking linearly to nothing at its full-again
/// time, which is how a token bucket refills (exact but for the rounding of that time up to
/// its second). `last_us` is the bucket's last refill time.
/// [`UNKNOWN_SPEND`] for an entry an older build wrote ([`SPEND_KNOWN`] clear) until it is full
/// again.
fn giveaway(meta: u64, last_us: u64, now_us: u64) -> u64 {
    if full_again(meta, now_us) {
        return 0;
    }
    if meta & SPEND_KNOWN == 0 {
        return UNKNOWN_SPEND;
    }
    let spent = decode_spent(meta);
    if meta & BUDGET != 0 {
        return spent;
    }
    let full_at_us = meta_full_at_s(meta) * US_PER_SEC;
    let span = full_at_us.saturating_sub(last_us);
    if now_us <= last_us || span == 0 {
        // In debt (refilling nothing until `last_us`), or a clock behind the bucket's.
        return spent;
    }
    // In floating point: an estimate to rank entries by, and a 128-bit division is a slow
    // library call on the eviction's path.
    (spent as f64 * ((full_at_us - now_us) as f64 / span as f64)) as u64
}

/// What the record of evicted spend keeps of an entry evicted at `now_us`: its spend at its
/// last commit, rounded up past the slot's encoding (which rounds down), or `None` (not known,
/// or a token bucket in debt, which stays empty past its spend's refill).
fn kept_spend(meta: u64, last_us: u64, now_us: u64) -> Option<u64> {
    if meta & SPEND_KNOWN == 0 || (meta & BUDGET == 0 && last_us > now_us) {
        return None;
    }
    let encoded = meta & SPENT_MASK;
    let exp = encoded >> SPENT_MANTISSA;
    Some(decode_spent(encoded) + (1u64 << exp) - 1)
}

/// How [`choose_victim`] orders entries that hold spend, the least first: by the whole units
/// forgetting them gives away (`cost`, from [`giveaway`], rounded up: entries apart only by a
/// fraction of a unit refilled since tie), then by age: a token bucket refilled (committed)
/// longer ago before a more recent one, so a client in the middle of its requests is not the
/// one evicted while equally cheap stale entries are sampled. A budget keeps no time of its last
/// request and counts as the oldest of its units; entries of unknown spend come last, the one
/// full again soonest first.
fn victim_rank(meta: u64, last_us: u64, cost: u64) -> (u64, u64) {
    if cost == UNKNOWN_SPEND {
        (u64::MAX, meta_full_at_s(meta))
    } else if meta & BUDGET != 0 {
        (cost.div_ceil(crate::limits::limiter::MICRO), 0)
    } else {
        (cost.div_ceil(crate::limits::limiter::MICRO), last_us)
    }
}

/// One bucket. All zeros is an empty slot (a real key of zero is stored as `(0, 1)`).
#[repr(C)]
struct Slot {
    hi: AtomicU64,
    lo: AtomicU64,
    meta: AtomicU64,
    tokens: AtomicU64,
    last_us: AtomicU64,
}

/// The key as stored: never all zeros.
fn stored(key: &BucketKey) -> (u64, u64) {
    match (key.hi, key.lo) {
        (0, 0) => (0, 1),
        k => k,
    }
}

fn is_empty(key: (u64, u64)) -> bool {
    key == (0, 0)
}

impl Slot {
    fn key(&self) -> (u64, u64) {
        let hi = self.hi.load(Ordering::Acquire);
        (hi, self.lo.load(Ordering::Acquire))
    }

    /// Takes the bucket's lock; returns the meta word without the lock bit (the moved bit
    /// included).
    fn lock(&self) -> u64 {
        loop {
            let meta = self.meta.load(Ordering::Relaxed);
            if meta & LOCKED == 0
                && self
                    .meta
                    .compare_exchange_weak(
                        meta,
                        meta | LOCKED,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                return meta;
            }
            std::hint::spin_loop();
        }
    }

    /// Releases the lock, storing `meta` (without the lock bit).
    fn unlock(&self, meta: u64) {
        self.meta.store(meta & !LOCKED, Ordering::Release);
    }

    /// State under the lock.
    fn state(&self) -> BucketState {
        BucketState {
            tokens: self.tokens.load(Ordering::Relaxed),
            last_us: self.last_us.load(Ordering::Relaxed),
        }
    }

    /// Writes a committed verdict's state (under the lock) and returns the new meta word.
    fn commit(&self, result: &OpResult, spend: Spend, now_us: u64) -> u64 {
        self.tokens
            .store(result.verdict.next.tokens, Ordering::Relaxed);
        self.last_us
            .store(result.verdict.next.last_us, Ordering::Relaxed);
        let full_at_s = now_us
            .saturating_add(result.verdict.full_in_us)
            .div_ceil(US_PER_SEC);
        pack_meta(full_at_s, spend)
    }

    /// Copies another slot's state (both locked).
    fn copy_state(&self, from: &Slot) {
        self.tokens
            .store(from.tokens.load(Ordering::Relaxed), Ordering::Relaxed);
        self.last_us
            .store(from.last_us.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Writes `key` (under the lock): low half first, so a probe never sees a whole key
    /// before it is complete.
    fn set_key(&self, key: (u64, u64)) {
        self.lo.store(key.1, Ordering::Release);
        self.hi.store(key.0, Ordering::Release);
    }
}

/// Where a table's slots live.
enum Backing {
    /// Small tables: the allocator.
    Heap(Box<[Slot]>),
    /// Tables of a few pages and more: their own anonymous mapping, so the memory of a table
    /// replaced by growth goes back to the operating system at once (an allocator would keep
    /// it: measured, that doubled the bytes per bucket).
    Mapped { ptr: *mut Slot, len: usize },
    /// A shard's slots in the state file (`--state-dir`): owned by the store's
    /// [`StateFile`], never grown, never unmapped by the table.
    File { ptr: *const Slot, len: usize },
}

/// Slot bytes from which a table gets its own mapping.
const MAPPED_FROM_BYTES: usize = 4096;

/// One shard's open-addressing table.
struct Table {
    backing: Backing,
    mask: usize,
}

// SAFETY: the mapped slots are owned by the table (freed only in its `Drop`) and are all
// atomics, so sharing and sending the table is as safe as for a `Box<[Slot]>`.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl Drop for Table {
    fn drop(&mut self) {
        if let Backing::Mapped { ptr, len } = self.backing {
            // SAFETY: `ptr`/`len` describe the mapping made in `Table::new`, used by no one
            // else any more (the table is being dropped).
            unsafe {
                libc::munmap(ptr.cast(), len * std::mem::size_of::<Slot>());
            }
        }
    }
}

fn empty_slot() -> Slot {
    Slot {
        hi: AtomicU64::new(0),
        lo: AtomicU64::new(0),
        meta: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
        last_us: AtomicU64::new(0),
    }
}

impl Table {
    /// `capacity` (a power of two) empty slots.
    fn new(capacity: usize) -> Table {
        let bytes = capacity * std::mem::size_of::<Slot>();
        let backing = if bytes >= MAPPED_FROM_BYTES {
            // SAFETY: a fresh private anonymous mapping of `bytes`, zero-filled by the kernel;
            // all-zero bytes are valid `Slot`s (five `AtomicU64`s of 0).
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                // Out of address space: fall back to the allocator (which aborts if it must).
                Backing::Heap((0..capacity).map(|_| empty_slot()).collect())
            } else {
                Backing::Mapped {
                    ptr: ptr.cast(),
                    len: capacity,
                }
            }
        } else {
            Backing::Heap((0..capacity).map(|_| empty_slot()).collect())
        };
        Table {
            backing,
            mask: capacity - 1,
        }
    }

    /// A table over slots of the state file.
    fn in_file(slots: &[Slot]) -> Table {
        Table {
            backing: Backing::File {
                ptr: slots.as_ptr(),
                len: slots.len(),
            },
            mask: slots.len() - 1,
        }
    }

    fn slots(&self) -> &[Slot] {
        match &self.backing {
            Backing::Heap(slots) => slots,
            // SAFETY: the mapping holds `len` initialised slots for as long as `self` lives.
            Backing::Mapped { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            // SAFETY: the state file outlives the tables (the store drops them first).
            Backing::File { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    fn slot(&self, i: usize) -> &Slot {
        &self.slots()[i & self.mask]
    }

    fn home(&self, key: (u64, u64)) -> usize {
        (key.1 as usize) & self.mask
    }

    /// Lock-free probe: the index of `key`, if seen.
    fn find(&self, key: (u64, u64)) -> Option<usize> {
        let mut i = self.home(key);
        for _ in 0..self.capacity() {
            let k = self.slot(i).key();
            if k == key {
                return Some(i);
            }
            if is_empty(k) {
                return None;
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// The first empty slot of `key`'s probe run.
    fn free_slot(&self, key: (u64, u64)) -> Option<usize> {
        let mut i = self.home(key);
        for _ in 0..self.capacity() {
            if is_empty(self.slot(i).key()) {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
        None
    }
}

impl BucketOp {
    /// What a state this op commits holds back from a fresh bucket.
    fn spend(&self, verdict: crate::limits::limiter::Verdict) -> Spend {
        Spend::of(self.quota.burst(), verdict.next, self.window.is_some())
    }
}

/// What a settled state holds back from a fresh bucket.
fn adjust_spend(op: &super::ops::AdjustOp, next: BucketState) -> Spend {
    Spend::of(op.quota.burst(), next, op.window_id.is_some())
}

/// A shard's structure, shared by every process using the state file: its lock (see
/// [`state_file::lock`]), live entries and last purge. One cache line each.
#[repr(C, align(64))]
struct ShardHead {
    lock: AtomicU64,
    live: AtomicU64,
    /// µs of the last on-demand purge; `NEVER_PURGED` for none.
    last_purge_us: AtomicU64,
    /// The eviction sampler's state (a SplitMix64 sequence), advanced under the shard's lock.
    sampler: AtomicU64,
}

const NEVER_PURGED: u64 = u64::MAX;

/// The structure locks a request holding several buckets takes, in shard index order: the
/// shard's index, its lock, and the rooms taken in it for keys not stored yet.
type LockedShards<'s> = SmallVec<[(usize, ShardState<'s>, usize); 4]>;

/// The bucket locks a request holding several buckets takes: each op's slot (`None`: not
/// stored yet), and every distinct slot locked, in address order, with its meta word.
struct LockedBuckets<'g> {
    located: SmallVec<[Option<&'g Slot>; 4]>,
    metas: SmallVec<[(&'g Slot, u64); 4]>,
}

impl<'g> LockedBuckets<'g> {
    /// Locks each existing bucket of the ops, in address order (the shards' structure locks
    /// are held: no entry can move meanwhile).
    #[inline]
    fn lock(store: &MemoryStore, ops: &[BucketOp], guard: &'g Guard) -> Self {
        let located: SmallVec<[Option<&Slot>; 4]> = ops
            .iter()
            .map(|op| {
                let table = MemoryStore::table(store.shard_of(&op.key), guard);
                table.find(stored(&op.key)).map(|i| table.slot(i))
            })
            .collect();
        let mut order: SmallVec<[&Slot; 4]> = located.iter().flatten().copied().collect();
        order.sort_unstable_by_key(|s| *s as *const Slot as usize);
        order.dedup_by_key(|s| *s as *const Slot as usize);
        let metas = order.iter().map(|s| (*s, s.lock())).collect();
        LockedBuckets { located, metas }
    }

    /// Lets every bucket go, with the meta word its commit left.
    #[inline]
    fn unlock(self) {
        for (slot, meta) in self.metas {
            slot.unlock(meta);
        }
    }
}

/// Where `slot`'s meta word is kept among the locked buckets'.
#[inline]
fn meta_of(metas: &[(&Slot, u64)], slot: &Slot) -> usize {
    metas
        .iter()
        .position(|(s, _)| std::ptr::eq(*s, slot))
        .unwrap_or(0)
}

/// Whether every op of `group` is allowed.
#[inline]
fn group_allows(ops: &[BucketOp], results: &OpResults, group: Group) -> bool {
    ops.iter()
        .zip(results.iter())
        .filter(|(op, _)| op.group == group)
        .all(|(_, r)| r.verdict.allowed)
}

/// A shard's structure, locked (inserts, growth and deletions happen under it).
struct ShardState<'a> {
    head: &'a ShardHead,
    _lock: StructureLock<'a>,
}

/// In process memory, a shard's structure is behind a mutex (fair: a sweep is never starved by
/// a flood of inserts); in a state file, behind the head's lock word, which the other process
/// of an upgrade sees too.
enum StructureLock<'a> {
    Mutex {
        _held: parking_lot::MutexGuard<'a, ()>,
    },
    Word {
        _held: WordGuard<'a>,
    },
}

impl ShardState<'_> {
    fn live(&self) -> usize {
        self.head.live.load(Ordering::Relaxed) as usize
    }

    fn add_live(&mut self, n: usize) {
        self.head.live.fetch_add(n as u64, Ordering::Relaxed);
    }

    fn sub_live(&mut self, n: usize) {
        let live = self.head.live.load(Ordering::Relaxed);
        self.head
            .live
            .store(live.saturating_sub(n as u64), Ordering::Relaxed);
    }

    fn last_purge_us(&self) -> Option<u64> {
        Some(self.head.last_purge_us.load(Ordering::Relaxed)).filter(|&t| t != NEVER_PURGED)
    }

    fn may_purge(&self, now_us: u64, interval_us: u64) -> bool {
        self.last_purge_us()
            .is_none_or(|at| now_us.saturating_sub(at) >= interval_us)
    }

    /// The next pseudo-random word of the shard's sampler (SplitMix64: cheap, and every seed,
    /// zero included, gives a full-period sequence).
    fn next_random(&mut self) -> u64 {
        let state = self
            .head
            .sampler
            .load(Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.head.sampler.store(state, Ordering::Relaxed);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Entries each eviction for room compares (as Redis does by default): the evicted one gives
/// away at most what the cheapest of them held. Measured with 8, an eviction cost about a
/// third more than storing a key in a store with room; each sample is a cache miss.
pub const EVICTION_SAMPLES: usize = 5;

/// The entry to evict among [`EVICTION_SAMPLES`] distinct live entries of `table`: from each of
/// `starts`, the first live slot at or after it not sampled yet and not in `exclude` (the
/// request's own keys). Not the next entries after one position: keys made from similar values
/// (consecutive client addresses) can sit next to each other, and a flood then evicted runs of
/// drained clients' entries, each 8 in a row (measured through the binary). Returns its index
/// and what forgetting it gives away ([`giveaway`]): the least ranked ([`victim_rank`]) of the
/// sampled (the first full-again one ends the search). Each walk costs about 1 / load slot
/// reads (a table at the bound is at least 3/8 full); a walk that meets no new entry in a whole
/// pass ends the sampling. The shard's lock is held, so keys do not move (bucket states may
/// change meanwhile: the reads are estimates).
fn choose_victim(
    table: &Table,
    starts: impl IntoIterator<Item = usize>,
    now_us: u64,
    exclude: &[(u64, u64)],
) -> Option<(usize, u64)> {
    let mut sampled: SmallVec<[usize; EVICTION_SAMPLES]> = SmallVec::new();
    let mut best: Option<(usize, u64, (u64, u64))> = None;
    'starts: for start in starts.into_iter().take(EVICTION_SAMPLES) {
        let mut i = start & table.mask;
        for _ in 0..table.capacity() {
            let slot = table.slot(i);
            let key = slot.key();
            if !is_empty(key) && !sampled.contains(&i) && !exclude.contains(&key) {
                sampled.push(i);
                let meta = slot.meta.load(Ordering::Relaxed);
                let last_us = slot.last_us.load(Ordering::Relaxed);
                let cost = giveaway(meta, last_us, now_us);
                if cost == 0 {
                    return Some((i, 0));
                }
                let rank = victim_rank(meta, last_us, cost);
                if best.is_none_or(|(_, _, least)| rank < least) {
                    best = Some((i, cost, rank));
                }
                continue 'starts;
            }
            i = (i + 1) & table.mask;
        }
        // A whole pass found nothing not sampled yet.
        break;
    }
    best.map(|(i, cost, _)| (i, cost))
}

/// One shard: its current table (its structure lives in its [`ShardHead`]).
#[repr(align(64))]
struct Shard {
    table: Atomic<Table>,
    index: usize,
    /// The table never grows past this many slots.
    max_capacity: usize,
}

/// Where the shards' heads and the entry count live: the heap, or the state file shared with
/// the other process of an upgrade.
enum Region {
    Heap {
        len: AtomicU64,
        heads: Box<[ShardHead]>,
        structure: Box<[parking_lot::Mutex<()>]>,
    },
    File(Arc<StateFile>),
}

/// The running totals behind [`EvictionStats`]; the histogram's buckets are kept apart
/// (made cumulative when read).
#[derive(Default)]
struct EvictionCounters {
    full_again: AtomicU64,
    token_bucket: AtomicU64,
    budget: AtomicU64,
    unknown_spend: AtomicU64,
    /// Evictions for room whose forgiven amount fell in each bound's interval, and above the
    /// last.
    forgiven: [AtomicU64; FORGIVEN_BOUNDS_MICRO.len() + 1],
    forgiven_sum_micro: AtomicU64,
}

impl EvictionCounters {
    /// One entry evicted for room, which had `forgiven` micro-tokens spent.
    fn for_room(&self, forgiven: u64, budget: bool) {
        if forgiven == UNKNOWN_SPEND {
            // Not in the histogram: what it gave away is not known.
            self.unknown_spend.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let kind = match (forgiven, budget) {
            (0, _) => &self.full_again,
            (_, true) => &self.budget,
            (_, false) => &self.token_bucket,
        };
        kind.fetch_add(1, Ordering::Relaxed);
        let at = FORGIVEN_BOUNDS_MICRO
            .iter()
            .position(|&bound| forgiven <= bound)
            .unwrap_or(FORGIVEN_BOUNDS_MICRO.len());
        self.forgiven[at].fetch_add(1, Ordering::Relaxed);
        self.forgiven_sum_micro
            .fetch_add(forgiven, Ordering::Relaxed);
    }

    fn stats(&self) -> EvictionStats {
        let mut forgiven_le = [0; FORGIVEN_BOUNDS_MICRO.len()];
        let mut running = 0;
        for (le, n) in forgiven_le.iter_mut().zip(&self.forgiven) {
            running += n.load(Ordering::Relaxed);
            *le = running;
        }
        EvictionStats {
            full_again: self.full_again.load(Ordering::Relaxed),
            token_bucket: self.token_bucket.load(Ordering::Relaxed),
            budget: self.budget.load(Ordering::Relaxed),
            unknown_spend: self.unknown_spend.load(Ordering::Relaxed),
            forgiven_le,
            forgiven_count: self
                .forgiven
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .sum(),
            forgiven_sum_micro: self.forgiven_sum_micro.load(Ordering::Relaxed),
        }
    }
}

/// Tables start at this many slots.
const INITIAL_CAPACITY: usize = 8;

/// How long a bucket lock must stay held, unchanged, to count as left by a dead process.
const STUCK_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// The embedded bounded store.
pub struct MemoryStore {
    shards: Box<[Shard]>,
    shard_mask: u64,
    config: MemoryStoreConfig,
    /// The heads and the live-entry count (across all shards: the bound is exact however
    /// unevenly keys fall; touched only by inserts and removals, not by updates).
    region: Region,
    /// Added to every time handed in: 0 in process memory; with a state dir, turns the
    /// caller's monotonic µs into µs since [`state_file::EPOCH_US`] on the wall clock, the only
    /// time that means the same after a restart.
    time_offset_us: u64,
    evictions: AtomicU64,
    /// Drops by kind and evictions for room by what they gave away (see [`EvictionStats`]).
    evicted: Box<EvictionCounters>,
    fail_open: AtomicU64,
    /// Leases (concurrency slots, loop marks, breaker states), beside the buckets.
    leases: Box<super::lease::MemoryLeases>,
    /// What entries evicted for room still held, for their keys to start from when they come
    /// back (`None`: no address space for it; evictions then forget).
    record: Option<Box<evicted::EvictedRecord>>,
}

impl Drop for MemoryStore {
    fn drop(&mut self) {
        for shard in self.shards.iter() {
            // SAFETY: `&mut self`: no probe can hold a reference into the current tables any
            // more (replaced tables were handed to the epoch collector when they were replaced).
            unsafe {
                let table =
                    shard
                        .table
                        .swap(Shared::null(), Ordering::AcqRel, epoch::unprotected());
                if !table.is_null() {
                    drop(table.into_owned());
                }
            }
        }
    }
}

impl MemoryStore {
    /// The store in process memory.
    pub fn new(config: MemoryStoreConfig) -> Self {
        let geometry = Self::geometry(&config, false);
        let heads = (0..geometry.shard_count)
            .map(|index| ShardHead {
                lock: AtomicU64::new(0),
                live: AtomicU64::new(0),
                last_purge_us: AtomicU64::new(NEVER_PURGED),
                sampler: AtomicU64::new(index as u64),
            })
            .collect();
        let shards = (0..geometry.shard_count)
            .map(|index| Shard {
                table: Atomic::new(Table::new(INITIAL_CAPACITY)),
                index,
                max_capacity: geometry.shard_capacity,
            })
            .collect();
        Self::assemble(
            config,
            shards,
            Region::Heap {
                len: AtomicU64::new(0),
                heads,
                structure: (0..geometry.shard_count)
                    .map(|_| parking_lot::Mutex::new(()))
                    .collect(),
            },
            super::lease::MemoryLeases::bounded(config.max_loop_marks),
            evicted::EvictedRecord::in_memory(),
            0,
        )
    }

    /// The regions a store of `config` needs: up to 1 024 shards (new keys and evictions in
    /// different shards never contend), each with room for four times its fair share in process
    /// memory (keys never spread that unevenly) or twice in a state file (whose tables never
    /// grow: allocated once, on disk), and as many lease slots as buckets.
    pub fn geometry(config: &MemoryStoreConfig, in_file: bool) -> Geometry {
        let max = config.max_buckets.max(1);
        let shard_count = (max / 256).next_power_of_two().clamp(1, 1024);
        let room = if in_file { 2 } else { 4 };
        Geometry {
            shard_count,
            shard_capacity: (max.div_ceil(shard_count) * room)
                .next_power_of_two()
                .max(INITIAL_CAPACITY),
            slot_bytes: std::mem::size_of::<Slot>(),
            lease_capacity: max.next_power_of_two().max(64),
            lease_slot_bytes: super::lease::MAPPED_SLOT_BYTES,
        }
    }

    /// The store in a state file ([`state_file::open`]). `sole_owner`: no other process uses
    /// the file (not an upgrade's handover), so locks a crashed process left are cleared,
    /// counts rebuilt from the slots and concurrency slots dropped. `time_offset_us`: see
    /// [`MemoryStore::time_offset_us`].
    pub fn in_state_file(
        config: MemoryStoreConfig,
        file: Arc<StateFile>,
        sole_owner: bool,
        time_offset_us: u64,
    ) -> Self {
        let geometry = file.geometry();
        // SAFETY: the geometry's regions lie within the mapping, 64-byte aligned; heads, slots
        // and lease slots are atomics, valid for any bytes.
        let (heads, slots) = unsafe {
            (
                file.region::<ShardHead>(geometry.heads_offset(), geometry.shard_count),
                file.region::<Slot>(
                    geometry.slots_offset(),
                    geometry.shard_count * geometry.shard_capacity,
                ),
            )
        };
        let shards: Box<[Shard]> = slots
            .chunks(geometry.shard_capacity)
            .enumerate()
            .map(|(index, slots)| Shard {
                table: Atomic::new(Table::in_file(slots)),
                index,
                max_capacity: geometry.shard_capacity,
            })
            .collect();
        if sole_owner {
            let mut total = 0u64;
            let mut migrated = 0u64;
            for (shard, head) in shards.iter().zip(heads) {
                let guard = &epoch::pin();
                let mut live = 0u64;
                for slot in Self::table(shard, guard).slots() {
                    let mut meta = slot.meta.load(Ordering::Relaxed) & !(LOCKED | MOVED);
                    let occupied = !is_empty(slot.key());
                    if occupied && meta & SPEND_KNOWN == 0 && legacy_as_unknown(meta) != meta {
                        // Written by an older build: its low half is a time, not a spend.
                        meta = legacy_as_unknown(meta);
                        migrated += 1;
                    }
                    slot.meta.store(meta, Ordering::Relaxed);
                    live += u64::from(occupied);
                }
                head.lock.store(0, Ordering::Relaxed);
                head.live.store(live, Ordering::Relaxed);
                head.last_purge_us.store(NEVER_PURGED, Ordering::Relaxed);
                total += live;
            }
            file.header().len.store(total, Ordering::Relaxed);
            file.header()
                .slot_format
                .store(state_file::SLOT_FORMAT_SPEND, Ordering::Relaxed);
            if migrated > 0 {
                tracing::info!(
                    entries = migrated,
                    "state file: entries an older build wrote are kept with their spend unknown (never evicted while entries of known spend can be) until their next request"
                );
            }
        }
        let leases = super::lease::MemoryLeases::in_state_file(
            &file,
            sole_owner,
            time_offset_us,
            config.max_loop_marks,
        );
        let dir = file.path().parent().map(std::path::Path::to_path_buf);
        let record = match dir {
            Some(dir) => evicted::EvictedRecord::in_dir(&dir, sole_owner),
            None => evicted::EvictedRecord::in_memory(),
        };
        Self::assemble(
            config,
            shards,
            Region::File(file),
            leases,
            record,
            time_offset_us,
        )
    }

    /// After an upgrade's old process has exited (this one holds the directory's lock now): a
    /// bucket lock it died holding would stall every request for that bucket. A bucket's lock is
    /// held for a few hundred nanoseconds, never across I/O: one still held, unchanged, after
    /// `STUCK_LOCK_WAIT` was left by the dead process, and is released. (Shard and lease lock
    /// words name their holder's pid and are taken over by [`state_file::lock`].)
    pub fn release_stuck_locks(file: &StateFile) -> usize {
        let g = file.geometry();
        // SAFETY: as in `in_state_file`.
        let slots =
            unsafe { file.region::<Slot>(g.slots_offset(), g.shard_count * g.shard_capacity) };
        let held: Vec<(usize, u64)> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let meta = s.meta.load(Ordering::Relaxed);
                (meta & LOCKED != 0).then_some((i, meta))
            })
            .collect();
        if held.is_empty() {
            return 0;
        }
        std::thread::sleep(STUCK_LOCK_WAIT);
        held.iter()
            .filter(|(i, meta)| {
                slots[*i]
                    .meta
                    .compare_exchange(*meta, meta & !LOCKED, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .count()
    }

    fn assemble(
        config: MemoryStoreConfig,
        shards: Box<[Shard]>,
        region: Region,
        leases: super::lease::MemoryLeases,
        record: Option<evicted::EvictedRecord>,
        time_offset_us: u64,
    ) -> Self {
        MemoryStore {
            shard_mask: shards.len() as u64 - 1,
            shards,
            config,
            region,
            time_offset_us,
            evictions: AtomicU64::new(0),
            evicted: Box::default(),
            fail_open: AtomicU64::new(0),
            leases: Box::new(leases),
            record: record.map(Box::new),
        }
    }

    /// Whether the tables live in a state file.
    pub fn persistent(&self) -> bool {
        matches!(self.region, Region::File(_))
    }

    /// What is added to every time handed to this store (0 in process memory).
    pub fn time_offset_us(&self) -> u64 {
        self.time_offset_us
    }

    fn len(&self) -> &AtomicU64 {
        match &self.region {
            Region::Heap { len, .. } => len,
            Region::File(file) => &file.header().len,
        }
    }

    fn head(&self, index: usize) -> &ShardHead {
        match &self.region {
            Region::Heap { heads, .. } => &heads[index],
            Region::File(file) => {
                let g = file.geometry();
                // SAFETY: as in `in_state_file`.
                unsafe { &file.region::<ShardHead>(g.heads_offset(), g.shard_count)[index] }
            }
        }
    }

    /// Locks a shard's structure.
    fn structure(&self, shard: &Shard) -> ShardState<'_> {
        let head = self.head(shard.index);
        let lock = match &self.region {
            Region::Heap { structure, .. } => StructureLock::Mutex {
                _held: structure[shard.index].lock(),
            },
            Region::File(_) => StructureLock::Word {
                _held: state_file::lock(&head.lock),
            },
        };
        ShardState { head, _lock: lock }
    }

    fn shard_of(&self, key: &BucketKey) -> &Shard {
        &self.shards[(key.hi & self.shard_mask) as usize]
    }

    fn shard_index(&self, key: &BucketKey) -> usize {
        (key.hi & self.shard_mask) as usize
    }

    /// The shard's current table.
    fn table<'g>(shard: &Shard, guard: &'g Guard) -> &'g Table {
        // SAFETY: a shard's table pointer is set at construction and only ever replaced by
        // another live table (`grow`), which hands the old one to `defer_destroy`: it is freed
        // only once every guard pinned before the swap — this one included — is gone. It is
        // nulled only in `drop`, which has exclusive access.
        unsafe { shard.table.load(Ordering::Acquire, guard).deref() }
    }

    /// Bytes held by the tables (for the memory benchmark).
    pub fn allocated_bytes(&self) -> usize {
        let guard = &epoch::pin();
        self.shards
            .iter()
            .map(|s| Self::table(s, guard).capacity() * std::mem::size_of::<Slot>())
            .sum()
    }

    /// The slot holding `key`, locked, with its meta word; `None` when the key is absent (a
    /// probe that raced a move or a growth retries).
    fn lock_existing<'g>(
        &self,
        shard: &Shard,
        key: (u64, u64),
        guard: &'g Guard,
    ) -> Option<(&'g Slot, u64)> {
        loop {
            let table = Self::table(shard, guard);
            let slot = table.slot(table.find(key)?);
            let meta = slot.lock();
            if meta & MOVED == 0 && slot.key() == key {
                return Some((slot, meta));
            }
            // Copied into a grown table, moved or removed since the probe: look again.
            slot.unlock(meta);
            std::hint::spin_loop();
        }
    }

    /// The state a key the store does not hold starts from: what the record of evicted spend
    /// keeps for it, or `None` (a full bucket).
    fn absent_state(&self, key: (u64, u64), op: &BucketOp, now_us: u64) -> Option<BucketState> {
        self.record
            .as_ref()?
            .restore(key, &op.quota, op.window.map(|w| w.id), now_us)
    }

    /// Reads a bucket's stored state (tests and diagnostics).
    pub fn peek(&self, key: &BucketKey) -> Option<BucketState> {
        let guard = &epoch::pin();
        let (slot, meta) = self.lock_existing(self.shard_of(key), stored(key), guard)?;
        let state = slot.state();
        slot.unlock(meta);
        Some(state)
    }

    /// Removes a bucket, wherever it is (an operator's reset: the bucket is full again, a
    /// budget unspent); false when the store holds no entry for it.
    pub fn remove(&self, key: &BucketKey) -> bool {
        let shard = self.shard_of(key);
        let stored_key = stored(key);
        let guard = &epoch::pin();
        // The shard's mutex first: removal shifts entries, which only it may do.
        // With it held the table neither grows nor moves entries.
        let mut state = self.structure(shard);
        let table = Self::table(shard, guard);
        if let Some(record) = &self.record {
            record.forget(stored_key);
        }
        let Some(i) = table.find(stored_key) else {
            return false;
        };
        let slot = table.slot(i);
        let meta = slot.lock();
        if slot.key() != stored_key {
            slot.unlock(meta);
            return false;
        }
        Self::remove_at(table, i);
        state.sub_live(1);
        let _ = self
            .len()
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            });
        true
    }

    /// Reserves room for one new entry; false when the store is at its bound.
    fn reserve(&self) -> bool {
        self.len()
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.config.max_buckets as u64).then_some(n + 1)
            })
            .is_ok()
    }

    /// Doubles the shard's table when `extra` more entries would fill it past 3/4 (the shard's
    /// mutex is held). Returns the table to insert into.
    fn make_room<'g>(
        &self,
        shard: &Shard,
        state: &ShardState<'_>,
        extra: usize,
        guard: &'g Guard,
    ) -> &'g Table {
        let table = Self::table(shard, guard);
        let mut capacity = table.capacity();
        while (state.live() + extra) * 4 > capacity * 3 && capacity < shard.max_capacity {
            capacity *= 2;
        }
        if capacity == table.capacity() {
            return table;
        }
        let grown = Table::new(capacity);
        for slot in table.slots().iter() {
            let meta = slot.lock();
            let key = slot.key();
            if !is_empty(key) {
                if let Some(i) = grown.free_slot(key) {
                    let target = grown.slot(i);
                    target.copy_state(slot);
                    target.meta.store(meta & !MOVED, Ordering::Relaxed);
                    target.set_key(key);
                }
            }
            // Probes that meet this slot from now on retry in the grown table.
            slot.unlock(meta | MOVED);
        }
        let old = shard.table.swap(Owned::new(grown), Ordering::AcqRel, guard);
        // SAFETY: `old` is no longer reachable from the shard; probes pinned before the swap
        // may still read it, and the collector frees it only after they have all unpinned.
        unsafe { guard.defer_destroy(old) };
        Self::table(shard, guard)
    }

    /// Whether `shard` is at its own bound: its table at its largest and `extra` more entries
    /// would fill it past 3/4 (linear probing slows down beyond that).
    fn shard_full(shard: &Shard, state: &ShardState<'_>, extra: usize, guard: &Guard) -> bool {
        let capacity = Self::table(shard, guard).capacity();
        capacity >= shard.max_capacity && (state.live() + extra) * 4 > capacity * 3
    }

    /// Room for one more entry in `shard`, of which `pending` are already taken by entries not
    /// inserted yet (the shard's lock is held, and no bucket lock in it). Within the bound when
    /// there is room; else the shard's full-again entries are purged (at most once per
    /// `purge_interval`); else one sampled entry of the shard is evicted ([`choose_victim`]),
    /// its room passing to the new entry. Neither ever removes one of `exclude` (the request's
    /// own keys, which it is about to update). A store at its bound whose
    /// key's shard holds nothing to evict lets that shard hold one entry past the bound (its
    /// table already has the slots: no memory is added). False only when the shard is at its
    /// own bound and holds nothing evictable (all its entries are in `exclude`).
    #[allow(clippy::too_many_arguments)]
    fn take_room(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        pending: usize,
        now_us: u64,
        exclude: &[(u64, u64)],
        guard: &Guard,
    ) -> bool {
        if !Self::shard_full(shard, state, pending + 1, guard) && self.reserve() {
            return true;
        }
        if state.may_purge(now_us, self.config.purge_interval_us)
            && self.purge(shard, state, now_us, exclude, guard) > 0
            && !Self::shard_full(shard, state, pending + 1, guard)
            && self.reserve()
        {
            return true;
        }
        if self.evict_sampled(shard, state, now_us, exclude, guard) {
            return true;
        }
        if Self::shard_full(shard, state, pending + 1, guard) {
            return false;
        }
        self.len().fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Evicts the cheapest of [`EVICTION_SAMPLES`] entries of `shard` sampled at pseudo-random
    /// positions, keeping its place in the bound (the caller inserts in its stead). False when
    /// the shard holds no entry outside `exclude`.
    fn evict_sampled(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        now_us: u64,
        exclude: &[(u64, u64)],
        guard: &Guard,
    ) -> bool {
        let table = Self::table(shard, guard);
        let mut starts = [0usize; EVICTION_SAMPLES];
        for start in starts.iter_mut() {
            *start = state.next_random() as usize;
        }
        // The samples' cache misses, all at once: loads with no branch between them overlap,
        // where the walks (each branching on what it read) would take them one after another.
        let mut warm = 0u64;
        for &start in &starts {
            warm ^= table.slot(start).meta.load(Ordering::Relaxed);
        }
        std::hint::black_box(warm);
        let Some((i, _)) = choose_victim(table, starts, now_us, exclude) else {
            return false;
        };
        let slot = table.slot(i);
        let meta = slot.lock();
        // What it gives away as it goes (its bucket may have been updated since it was sampled).
        let last_us = slot.last_us.load(Ordering::Relaxed);
        let forgiven = giveaway(meta, last_us, now_us);
        if forgiven > 0 {
            if let Some(record) = &self.record {
                record.record(
                    slot.key(),
                    meta_full_at_s(meta),
                    kept_spend(meta, last_us, now_us),
                    now_us,
                );
            }
        }
        Self::remove_at(table, i);
        state.sub_live(1);
        self.evictions.fetch_add(1, Ordering::Relaxed);
        self.evicted.for_room(forgiven, meta & BUDGET != 0);
        true
    }

    /// Inserts a new entry with `result`'s state (the shard's lock is held, the key is known
    /// absent, its room taken by [`MemoryStore::take_room`]). `grow`: whether the table may
    /// grow now (not while the caller holds bucket locks in it). False only if the table has
    /// no free slot, which the shard's bound rules out; the room is given back.
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        key: (u64, u64),
        result: &OpResult,
        spend: Spend,
        now_us: u64,
        grow: bool,
        guard: &Guard,
    ) -> bool {
        let table = if grow {
            self.make_room(shard, state, 1, guard)
        } else {
            Self::table(shard, guard)
        };
        let Some(i) = table.free_slot(key) else {
            self.len().fetch_sub(1, Ordering::Relaxed);
            return false;
        };
        let slot = table.slot(i);
        // Only stale probes can hold an empty slot's lock, briefly.
        slot.lock();
        let meta = slot.commit(result, spend, now_us);
        slot.set_key(key);
        slot.unlock(meta);
        state.add_live(1);
        true
    }

    /// Removes the entry at `i` (locked), shifting later entries of its probe run back so no
    /// probe ever stops early. The shard's mutex is held.
    fn remove_at(table: &Table, i: usize) {
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & table.mask;
            if j == hole {
                break;
            }
            let next = table.slot(j);
            let meta = next.lock();
            let key = next.key();
            if is_empty(key) {
                next.unlock(meta);
                break;
            }
            if stays(table.home(key), hole, j) {
                next.unlock(meta);
                continue;
            }
            // Copy `j` into the hole, publish it there, and make `j` the hole (still locked).
            let target = table.slot(hole);
            target.copy_state(next);
            target.set_key(key);
            target.unlock(meta);
            hole = j;
        }
        let last = table.slot(hole);
        last.set_key((0, 0));
        last.tokens.store(0, Ordering::Relaxed);
        last.last_us.store(0, Ordering::Relaxed);
        last.unlock(0);
    }

    /// Drops entries of one shard for which `evict(meta)` holds; returns how many went. The
    /// shard's mutex is held.
    fn evict_where(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        guard: &Guard,
        evict: impl Fn((u64, u64), u64) -> bool,
    ) -> usize {
        let table = Self::table(shard, guard);
        let mut removed = 0;
        let mut i = 0;
        while i < table.capacity() {
            let slot = table.slot(i);
            if is_empty(slot.key()) {
                i += 1;
                continue;
            }
            let meta = slot.lock();
            let key = slot.key();
            if !is_empty(key) && evict(key, meta) {
                // The entry shifted into `i` (if any) is examined next.
                Self::remove_at(table, i);
                removed += 1;
            } else {
                slot.unlock(meta);
                i += 1;
            }
        }
        state.sub_live(removed);
        let len = self.len();
        let _ = len.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            Some(n.saturating_sub(removed as u64))
        });
        self.evictions.fetch_add(removed as u64, Ordering::Relaxed);
        self.evicted
            .full_again
            .fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Removes the shard's full-again entries (the only ones indistinguishable from absent),
    /// but for `exclude` (the request's own: it is about to update them, and would find them
    /// gone with no room left for them). Returns how many went.
    fn purge(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        now_us: u64,
        exclude: &[(u64, u64)],
        guard: &Guard,
    ) -> usize {
        state.head.last_purge_us.store(now_us, Ordering::Relaxed);
        self.evict_where(shard, state, guard, |key, meta| {
            full_again(meta, now_us) && !exclude.contains(&key)
        })
    }

    /// One bucket: a lock-free probe and the bucket's own lock (the common case); the shard's
    /// mutex only to insert a new key.
    fn apply_one(&self, now_us: u64, op: &BucketOp) -> OpResult {
        let shard = self.shard_of(&op.key);
        let key = stored(&op.key);
        let guard = &epoch::pin();
        loop {
            if let Some((slot, meta)) = self.lock_existing(shard, key, guard) {
                let verdict = op.check(Some(slot.state()), now_us);
                let result = OpResult {
                    verdict,
                    committed: verdict.allowed,
                    fail_open: false,
                    away: None,
                };
                let meta = if verdict.allowed {
                    slot.commit(&result, op.spend(verdict), now_us)
                } else {
                    meta
                };
                slot.unlock(meta);
                return result;
            }
            let mut result = OpResult {
                verdict: op.check(self.absent_state(key, op, now_us), now_us),
                committed: false,
                fail_open: false,
                away: None,
            };
            if !result.verdict.allowed {
                // A cost above the burst, or what the key held when it was evicted.
                return result;
            }
            let spend = op.spend(result.verdict);
            if spend.micro == 0 || op.spent() == 0 {
                // Nothing spent (a zero-cost look): the bucket it was answered from (full, or
                // as the record of evicted spend keeps it) needs no entry, and storing one
                // would only take another's room.
                result.committed = true;
                return result;
            }
            let mut state = self.structure(shard);
            if Self::table(shard, guard).find(key).is_some() {
                // Inserted meanwhile, or missed while an entry moved: update it instead.
                continue;
            }
            if self.take_room(shard, &mut state, 0, now_us, &[], guard)
                && self.insert(shard, &mut state, key, &result, spend, now_us, true, guard)
            {
                result.committed = true;
            } else {
                result.fail_open = true;
                self.fail_open.fetch_add(1, Ordering::Relaxed);
            }
            return result;
        }
    }

    /// Settles reservations, each op on its bucket under the bucket's lock. A bucket that is
    /// gone (full again, swept) is full: a refund leaves it so, a charge stores it again.
    pub fn adjust(&self, now_us: u64, ops: &[super::ops::AdjustOp]) {
        let now_us = now_us.saturating_add(self.time_offset_us);
        let guard = &epoch::pin();
        let settled = |op: &super::ops::AdjustOp, next: BucketState| OpResult {
            verdict: crate::limits::limiter::Verdict {
                allowed: true,
                available: next.tokens,
                remaining: next.tokens,
                next,
                retry_after_secs: 0,
                full_in_us: op.full_in_us(next, now_us),
            },
            committed: true,
            fail_open: false,
            away: None,
        };
        for op in ops {
            let shard = self.shard_of(&op.key);
            let key = stored(&op.key);
            loop {
                if let Some((slot, meta)) = self.lock_existing(shard, key, guard) {
                    let meta = match op.settle(Some(slot.state()), now_us) {
                        Some(next) => {
                            slot.commit(&settled(op, next), adjust_spend(op, next), now_us)
                        }
                        None => meta,
                    };
                    slot.unlock(meta);
                    break;
                }
                let restored = self
                    .record
                    .as_ref()
                    .and_then(|r| r.restore(key, &op.quota, op.window_id, now_us));
                let Some(next) = op.settle(restored, now_us) else {
                    break;
                };
                if next.tokens >= op.quota.burst() {
                    break;
                }
                let mut state = self.structure(shard);
                if Self::table(shard, guard).find(key).is_some() {
                    continue;
                }
                let stored = self.take_room(shard, &mut state, 0, now_us, &[], guard)
                    && self.insert(
                        shard,
                        &mut state,
                        key,
                        &settled(op, next),
                        adjust_spend(op, next),
                        now_us,
                        true,
                        guard,
                    );
                if !stored {
                    self.fail_open.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
        }
    }

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
        let now_us = now_us.saturating_add(self.time_offset_us);
        results.clear();
        if let [op] = ops {
            results.push(self.apply_one(now_us, op));
            return Ok(());
        }
        self.apply_together(now_us, ops, results);
        Ok(())
    }

    /// Several buckets, all-or-nothing: the shards' mutexes in index order (no new key can
    /// appear, no entry can move, no table can grow meanwhile), room for the request's new
    /// keys, then each existing bucket's lock in address order; the verdicts; each group
    /// committed when it and the enforced group allow; the locks let go and the rooms not used
    /// given back.
    #[inline]
    fn apply_together(&self, now_us: u64, ops: &[BucketOp], results: &mut OpResults) {
        let guard = &epoch::pin();
        let mut shards = self.lock_shards(ops);
        self.reserve_rooms(&mut shards, ops, now_us, guard);
        let mut buckets = LockedBuckets::lock(self, ops, guard);
        // Verdicts; a key that appears twice sees its first op's state (as before).
        results.extend(ops.iter().zip(buckets.located.iter()).map(|(op, slot)| {
            let state = match slot {
                Some(slot) => Some(slot.state()),
                None => self.absent_state(stored(&op.key), op, now_us),
            };
            OpResult {
                verdict: op.check(state, now_us),
                committed: false,
                fail_open: false,
                away: None,
            }
        }));
        let enforce_allows = group_allows(ops, results, Group::Enforce);
        for group in [Group::Enforce, Group::Shadow] {
            // A refused request spends nothing anywhere, shadow buckets included: shadow
            // counts then describe the traffic that would really have reached the upstream.
            if !enforce_allows || !group_allows(ops, results, group) {
                continue;
            }
            let work = (group, ops, &mut *results);
            self.commit_group(work, &mut buckets, &mut shards, now_us, guard);
        }
        buckets.unlock();
        // Rooms a refused request did not use go back to the bound.
        let unused: usize = shards.iter().map(|(_, _, rooms)| rooms).sum();
        if unused > 0 {
            let _ = self
                .len()
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(unused as u64))
                });
        }
        drop(shards);
    }

    /// The structure locks of every shard the ops fall in, in index order, each with no room
    /// taken yet.
    #[inline]
    fn lock_shards(&self, ops: &[BucketOp]) -> LockedShards<'_> {
        let mut wanted: SmallVec<[usize; 4]> =
            ops.iter().map(|op| self.shard_index(&op.key)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        wanted
            .iter()
            .map(|&i| (i, self.structure(&self.shards[i]), 0))
            .collect()
    }

    /// Room for the request's new keys, before any bucket lock is taken (an eviction moves
    /// entries): taken within the bound, by a purge or by an eviction, never one of the
    /// request's own buckets; then a bigger table when needed.
    #[inline]
    fn reserve_rooms(
        &self,
        shards: &mut LockedShards<'_>,
        ops: &[BucketOp],
        now_us: u64,
        guard: &Guard,
    ) {
        for (index, state, rooms) in shards.iter_mut() {
            let shard = &self.shards[*index];
            let table = Self::table(shard, guard);
            let mut missing: SmallVec<[(u64, u64); 4]> = SmallVec::new();
            for op in ops {
                let key = stored(&op.key);
                // A zero-cost op leaves an absent bucket full: it needs no entry.
                if op.spent() > 0
                    && self.shard_index(&op.key) == *index
                    && !missing.contains(&key)
                    && table.find(key).is_none()
                {
                    missing.push(key);
                }
            }
            if missing.is_empty() {
                continue;
            }
            let own: SmallVec<[(u64, u64); 4]> = ops.iter().map(|op| stored(&op.key)).collect();
            for _ in 0..missing.len() {
                if self.take_room(shard, state, *rooms, now_us, &own, guard) {
                    *rooms += 1;
                }
            }
            self.make_room(shard, state, *rooms, guard);
        }
    }

    /// Commits the ops of one group: spends from each locked bucket, and stores the buckets
    /// not held yet in the rooms taken for them (or fails open without one).
    #[inline]
    fn commit_group(
        &self,
        (group, ops, results): (Group, &[BucketOp], &mut OpResults),
        buckets: &mut LockedBuckets<'_>,
        shards: &mut LockedShards<'_>,
        now_us: u64,
        guard: &Guard,
    ) {
        let LockedBuckets { located, metas } = buckets;
        for ((op, result), slot) in ops.iter().zip(results.iter_mut()).zip(located.iter()) {
            if op.group != group {
                continue;
            }
            match *slot {
                Some(slot) => {
                    let m = meta_of(metas, slot);
                    metas[m].1 = slot.commit(result, op.spend(result.verdict), now_us);
                    result.committed = true;
                }
                None => self.commit_absent(op, result, shards, now_us, guard),
            }
        }
    }

    /// Commits an op whose bucket was not held when the locks were taken.
    #[inline]
    fn commit_absent(
        &self,
        op: &BucketOp,
        result: &mut OpResult,
        shards: &mut LockedShards<'_>,
        now_us: u64,
        guard: &Guard,
    ) {
        let spend = op.spend(result.verdict);
        if spend.micro == 0 || op.spent() == 0 {
            // Answered from a full bucket and leaving it full (or from the record of evicted
            // spend, which keeps it): no entry.
            result.committed = true;
            return;
        }
        let index = self.shard_index(&op.key);
        let shard = &self.shards[index];
        let key = stored(&op.key);
        let table = Self::table(shard, guard);
        if let Some(i) = table.find(key) {
            // Inserted by an earlier op of this request (the same key twice). Safe out of
            // order: this shard's mutex is ours, and single-bucket updaters never wait while
            // holding a lock.
            let existing = table.slot(i);
            existing.lock();
            let meta = existing.commit(result, spend, now_us);
            existing.unlock(meta);
            result.committed = true;
            return;
        }
        let g = shards.iter().position(|(i, ..)| *i == index).unwrap_or(0);
        let (_, state, rooms) = &mut shards[g];
        let had_room = *rooms > 0;
        *rooms = rooms.saturating_sub(1);
        if had_room && self.insert(shard, state, key, result, spend, now_us, false, guard) {
            result.committed = true;
        } else {
            result.fail_open = true;
            self.fail_open.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The leases kept beside the buckets.
    pub fn leases(&self) -> &super::lease::MemoryLeases {
        &self.leases
    }

    /// Counters only: a scrape never takes a lock.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            entries: Some(self.len().load(Ordering::Relaxed)),
            evictions: self.evictions.load(Ordering::Relaxed),
            evicted: self.evicted.stats(),
            fail_open: self.fail_open.load(Ordering::Relaxed) + self.leases.fail_open(),
            state_fallback: None,
            local: None,
            loop_marks: self.leases.marks_stats().map(|(held, _)| held),
            loop_marks_evicted: self.leases.marks_stats().map_or(0, |(_, evicted)| evicted),
            clock_skew_us: None,
        }
    }

    /// Drops buckets that are full again; returns how many. Nothing else is ever dropped: a
    /// bucket that is not full yet (a drained client of a 300 per 180 min quota, a budget with
    /// spend in its window) holds state a fresh bucket would not, however long it sits idle.
    pub fn sweep(&self, now_us: u64) -> u64 {
        let now_us = now_us.saturating_add(self.time_offset_us);
        if let Region::File(file) = &self.region {
            file.header().time_hwm.fetch_max(now_us, Ordering::Relaxed);
        }
        let guard = &epoch::pin();
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            let mut state = self.structure(shard);
            removed += self
                .evict_where(shard, &mut state, guard, |_, meta| full_again(meta, now_us))
                as u64;
        }
        removed
    }
}

#[cfg(test)]
mod tests;
