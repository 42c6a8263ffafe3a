//! The embedded store: a bounded map of buckets, read and updated without a shard lock.
//!
//! Each shard is an open-addressing table (linear probing) of 40-byte slots: a 16-byte key,
//! micro-tokens, the last refill, and one word holding a per-bucket lock bit and two
//! whole-second housekeeping times. Tables start small and double as keys arrive, so memory
//! follows the live buckets (about 84 bytes each at 1 M keys, measured as process RSS).
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
//!   room first, then take the buckets' locks (in address order) and commit all-or-nothing;
//!   single-bucket updates never wait for a mutex while holding a bucket lock, so nothing can
//!   deadlock.
//!
//! What it loses, on purpose and nothing else:
//! - entries whose bucket is full again: they are indistinguishable from absent ones (a new
//!   bucket starts full), so dropping them loses nothing. They are evicted first.
//!   A budget is full again when its window ends, so a spent budget is never dropped before.
//! - when the store is full and nothing in the key's shard is full-again (or that shard was
//!   purged less than `purge_interval` ago), a *new* key is not stored: its request is allowed
//!   (fail-open) and counted. Entries that are not full yet are never evicted, however long they
//!   sit idle, so a flood of fresh keys cannot reset anyone's limit or budget.
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

use super::state_file::{self, Geometry, StateFile, WordGuard};
use super::{BucketKey, BucketOp, Group, OpResult, OpResults, StoreError, StoreStats};
use crate::limiter::{BucketState, US_PER_SEC};
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
}

impl Default for MemoryStoreConfig {
    fn default() -> Self {
        MemoryStoreConfig {
            max_buckets: 1_000_000,
            purge_interval_us: 1_000_000,
        }
    }
}

/// The `meta` word: bit 63 is the bucket's lock; bit 62 marks a slot whose entry was copied
/// into a grown table (probes that meet it retry there); bits 32..62 the second (since the
/// time base's origin) the bucket is full again, rounded up; bits 0..32 the second a request
/// last touched it, refused ones included.
const LOCKED: u64 = 1 << 63;
const MOVED: u64 = 1 << 62;
const FULL_AT_MAX: u64 = (1 << 30) - 1;

fn pack_meta(full_at_s: u64, seen_s: u64) -> u64 {
    (full_at_s.min(FULL_AT_MAX) << 32) | seen_s.min(u64::from(u32::MAX))
}

fn meta_full_at_s(meta: u64) -> u64 {
    (meta & !(LOCKED | MOVED)) >> 32
}

fn meta_seen_s(meta: u64) -> u64 {
    meta & u64::from(u32::MAX)
}

/// Whether the entry is full again at `now_us`: indistinguishable from an absent one (a new
/// bucket starts full), so dropping it loses nothing.
fn full_again(meta: u64, now_us: u64) -> bool {
    meta_full_at_s(meta) * US_PER_SEC <= now_us
}

/// The meta word after a refusal: the bucket was asked about now.
fn touched(meta: u64, now_us: u64) -> u64 {
    let seen = meta_seen_s(meta).max(now_us / US_PER_SEC);
    pack_meta(meta_full_at_s(meta), seen)
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
    fn commit(&self, result: &OpResult, now_us: u64) -> u64 {
        self.tokens
            .store(result.verdict.next.tokens, Ordering::Relaxed);
        self.last_us
            .store(result.verdict.next.last_us, Ordering::Relaxed);
        let full_at_s = now_us
            .saturating_add(result.verdict.full_in_us)
            .div_ceil(US_PER_SEC);
        pack_meta(full_at_s, now_us / US_PER_SEC)
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

/// Whether `home` lies cyclically in `(hole, j]`: the entry at `j` must then stay after the
/// hole (moving it before its home would hide it from probes).
pub(super) fn stays(home: usize, hole: usize, j: usize) -> bool {
    if hole <= j {
        hole < home && home <= j
    } else {
        hole < home || home <= j
    }
}

/// A shard's structure, shared by every process using the state file: its lock (see
/// [`state_file::lock`]), live entries and last purge. One cache line each.
#[repr(C, align(64))]
struct ShardHead {
    lock: AtomicU64,
    live: AtomicU64,
    /// µs of the last on-demand purge; `NEVER_PURGED` for none.
    last_purge_us: AtomicU64,
}

const NEVER_PURGED: u64 = u64::MAX;

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
    fail_open: AtomicU64,
    /// Leases (concurrency slots, loop marks, breaker states), beside the buckets.
    leases: super::lease::MemoryLeases,
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
            .map(|_| ShardHead {
                lock: AtomicU64::new(0),
                live: AtomicU64::new(0),
                last_purge_us: AtomicU64::new(NEVER_PURGED),
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
            super::lease::MemoryLeases::default(),
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
            for (shard, head) in shards.iter().zip(heads) {
                let guard = &epoch::pin();
                let mut live = 0u64;
                for slot in Self::table(shard, guard).slots() {
                    let meta = slot.meta.load(Ordering::Relaxed) & !(LOCKED | MOVED);
                    slot.meta.store(meta, Ordering::Relaxed);
                    live += u64::from(!is_empty(slot.key()));
                }
                head.lock.store(0, Ordering::Relaxed);
                head.live.store(live, Ordering::Relaxed);
                head.last_purge_us.store(NEVER_PURGED, Ordering::Relaxed);
                total += live;
            }
            file.header().len.store(total, Ordering::Relaxed);
        }
        let leases = super::lease::MemoryLeases::in_state_file(&file, sole_owner, time_offset_us);
        Self::assemble(config, shards, Region::File(file), leases, time_offset_us)
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
        time_offset_us: u64,
    ) -> Self {
        MemoryStore {
            shard_mask: shards.len() as u64 - 1,
            shards,
            config,
            region,
            time_offset_us,
            evictions: AtomicU64::new(0),
            fail_open: AtomicU64::new(0),
            leases,
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

    /// Inserts a new entry with `result`'s state, within the bound (the shard's mutex is held,
    /// the key is known absent). When the store is full, first purges this shard (full-again
    /// entries, else idle ones; at most once per `purge_interval`), else refuses. `grow`:
    /// whether the table may grow now (not while the caller holds bucket locks in it).
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        key: (u64, u64),
        result: &OpResult,
        now_us: u64,
        grow: bool,
        guard: &Guard,
    ) -> bool {
        if !self.reserve() {
            let may_purge = grow && state.may_purge(now_us, self.config.purge_interval_us);
            if !may_purge || self.purge(shard, state, now_us, guard) == 0 || !self.reserve() {
                return false;
            }
        }
        let table = if grow {
            self.make_room(shard, state, 1, guard)
        } else {
            Self::table(shard, guard)
        };
        let Some(i) = table.free_slot(key) else {
            // The shard is full of live keys (only with a very uneven spread): refuse.
            self.len().fetch_sub(1, Ordering::Relaxed);
            return false;
        };
        let slot = table.slot(i);
        // Only stale probes can hold an empty slot's lock, briefly.
        slot.lock();
        let meta = slot.commit(result, now_us);
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
        evict: impl Fn(u64) -> bool,
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
            if !is_empty(slot.key()) && evict(meta) {
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
        removed
    }

    /// Removes the shard's full-again entries (the only ones indistinguishable from absent).
    /// Returns how many went.
    fn purge(
        &self,
        shard: &Shard,
        state: &mut ShardState<'_>,
        now_us: u64,
        guard: &Guard,
    ) -> usize {
        state.head.last_purge_us.store(now_us, Ordering::Relaxed);
        self.evict_where(shard, state, guard, |meta| full_again(meta, now_us))
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
                };
                let meta = if verdict.allowed {
                    slot.commit(&result, now_us)
                } else {
                    touched(meta, now_us)
                };
                slot.unlock(meta);
                return result;
            }
            let mut result = OpResult {
                verdict: op.check(None, now_us),
                committed: false,
                fail_open: false,
            };
            if !result.verdict.allowed {
                // A cost above the burst: refused whatever the bucket holds.
                return result;
            }
            let mut state = self.structure(shard);
            if Self::table(shard, guard).find(key).is_some() {
                // Inserted meanwhile, or missed while an entry moved: update it instead.
                continue;
            }
            if self.insert(shard, &mut state, key, &result, now_us, true, guard) {
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
    pub fn adjust(&self, now_us: u64, ops: &[super::AdjustOp]) {
        let now_us = now_us.saturating_add(self.time_offset_us);
        let guard = &epoch::pin();
        let settled = |op: &super::AdjustOp, next: BucketState| OpResult {
            verdict: crate::limiter::Verdict {
                allowed: true,
                available: next.tokens,
                remaining: next.tokens,
                next,
                retry_after_secs: 0,
                full_in_us: op.full_in_us(next, now_us),
            },
            committed: true,
            fail_open: false,
        };
        for op in ops {
            let shard = self.shard_of(&op.key);
            let key = stored(&op.key);
            loop {
                if let Some((slot, meta)) = self.lock_existing(shard, key, guard) {
                    let meta = match op.settle(Some(slot.state()), now_us) {
                        Some(next) => slot.commit(&settled(op, next), now_us),
                        None => meta,
                    };
                    slot.unlock(meta);
                    break;
                }
                let Some(next) = op.settle(None, now_us) else {
                    break;
                };
                if next.tokens >= op.quota.burst() {
                    break;
                }
                let mut state = self.structure(shard);
                if Self::table(shard, guard).find(key).is_some() {
                    continue;
                }
                if !self.insert(
                    shard,
                    &mut state,
                    key,
                    &settled(op, next),
                    now_us,
                    true,
                    guard,
                ) {
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
        let guard = &epoch::pin();
        // Several buckets, all-or-nothing: the shards' mutexes in index order (no new key can
        // appear, no entry can move, no table can grow meanwhile)...
        let mut wanted: SmallVec<[usize; 4]> =
            ops.iter().map(|op| self.shard_index(&op.key)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let mut guards: SmallVec<[(usize, ShardState<'_>); 4]> = wanted
            .iter()
            .map(|&i| (i, self.structure(&self.shards[i])))
            .collect();
        // ...room for the request's new keys, before any bucket lock is taken: a purge when the
        // store is at its bound (as for one bucket), and a bigger table when needed...
        for (index, state) in guards.iter_mut() {
            let shard = &self.shards[*index];
            let table = Self::table(shard, guard);
            let missing = ops
                .iter()
                .filter(|op| {
                    self.shard_index(&op.key) == *index && table.find(stored(&op.key)).is_none()
                })
                .count();
            if missing == 0 {
                continue;
            }
            let at_bound =
                self.len().load(Ordering::Relaxed) as usize + missing > self.config.max_buckets;
            let may_purge = state.may_purge(now_us, self.config.purge_interval_us);
            if at_bound && may_purge {
                self.purge(shard, state, now_us, guard);
            }
            self.make_room(shard, state, missing, guard);
        }
        // ...then each existing bucket's lock, in address order.
        let mut located: SmallVec<[Option<&Slot>; 4]> = ops
            .iter()
            .map(|op| {
                let table = Self::table(self.shard_of(&op.key), guard);
                table.find(stored(&op.key)).map(|i| table.slot(i))
            })
            .collect();
        let mut order: SmallVec<[&Slot; 4]> = located.iter().flatten().copied().collect();
        order.sort_unstable_by_key(|s| *s as *const Slot as usize);
        order.dedup_by_key(|s| *s as *const Slot as usize);
        let mut metas: SmallVec<[(&Slot, u64); 4]> = order.iter().map(|s| (*s, s.lock())).collect();
        let meta_of = |metas: &SmallVec<[(&Slot, u64); 4]>, slot: &Slot| {
            metas
                .iter()
                .position(|(s, _)| std::ptr::eq(*s, slot))
                .unwrap_or(0)
        };

        // Verdicts; a key that appears twice sees its first op's state (as before).
        results.extend(ops.iter().zip(located.iter()).map(|(op, slot)| OpResult {
            verdict: op.check(slot.map(Slot::state), now_us),
            committed: false,
            fail_open: false,
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
            for ((op, result), slot) in ops.iter().zip(results.iter_mut()).zip(located.iter_mut()) {
                if op.group != group {
                    continue;
                }
                match *slot {
                    Some(slot) => {
                        let m = meta_of(&metas, slot);
                        metas[m].1 = slot.commit(result, now_us);
                        result.committed = true;
                    }
                    None => {
                        let index = self.shard_index(&op.key);
                        let shard = &self.shards[index];
                        let key = stored(&op.key);
                        let table = Self::table(shard, guard);
                        if let Some(i) = table.find(key) {
                            // Inserted by an earlier op of this request (the same key twice).
                            // Safe out of order: this shard's mutex is ours, and single-bucket
                            // updaters never wait while holding a lock.
                            let existing = table.slot(i);
                            existing.lock();
                            let meta = existing.commit(result, now_us);
                            existing.unlock(meta);
                            result.committed = true;
                            continue;
                        }
                        let g = guards.iter().position(|(i, _)| *i == index).unwrap_or(0);
                        if self.insert(shard, &mut guards[g].1, key, result, now_us, false, guard) {
                            result.committed = true;
                        } else {
                            result.fail_open = true;
                            self.fail_open.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        // Buckets of a refused request were still asked about: they are not idle.
        for (slot, meta) in metas.iter_mut() {
            let committed = results
                .iter()
                .zip(located.iter())
                .any(|(r, s)| r.committed && s.is_some_and(|s| std::ptr::eq(s, *slot)));
            if !committed {
                *meta = touched(*meta, now_us);
            }
        }
        for (slot, meta) in metas {
            slot.unlock(meta);
        }
        drop(guards);
        Ok(())
    }

    /// Counters only: a scrape never takes a lock.
    /// The leases kept beside the buckets.
    pub fn leases(&self) -> &super::lease::MemoryLeases {
        &self.leases
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            entries: Some(self.len().load(Ordering::Relaxed)),
            evictions: self.evictions.load(Ordering::Relaxed),
            fail_open: self.fail_open.load(Ordering::Relaxed),
            state_fallback: None,
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
            removed +=
                self.evict_where(shard, &mut state, guard, |meta| full_again(meta, now_us)) as u64;
        }
        removed
    }
}

#[cfg(test)]
mod tests;
