//! Leases: a key holds at most `max` live leases, each with an expiry. A `concurrency` rule's
//! slot is a lease taken when a request is admitted and given back when it is done; one nobody
//! gives back (a gateway that died, a decision-service caller that never released) ends at its
//! expiry, so no slot is pinned forever. Taking is all-or-nothing per [`Group`], like bucket ops.
//!
//! The same sets, never given back, are a sliding log: `loop_detection` marks each admitted
//! request under its fingerprint for the window, and a circuit breaker's open state is one lease
//! that lives until the breaker closes. A *soft* op never blocks its group (a loop that only
//! warns), and a soft op with `max` 0 takes nothing and only reads the key (is the breaker open,
//! and until when).
//!
//! This module holds the types and the embedded store's lease table, in process memory or in
//! the state file (`--state-dir`); loop marks sit beside it in their own bounded table
//! ([`super::marks`]). Redis and PostgreSQL keep theirs server-side (see their modules).

use super::marks::Marks;
use super::ops::{BucketKey, Group};
use ahash::AHashMap;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The slots one admitted request holds, to give back when it is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub keys: SmallVec<[BucketKey; 2]>,
    /// Seconds after which the store frees the slots by itself.
    pub ttl_secs: u64,
}

impl Lease {
    /// The decision service's lease token: the id, then each key, in hex, dot-separated. Only
    /// the holder knows the random id, so a token names nothing another client can release.
    pub fn token(&self) -> String {
        let mut out = format!("{:016x}", self.id);
        for key in &self.keys {
            out.push_str(&format!(".{:016x}{:016x}", key.hi, key.lo));
        }
        out
    }

    /// Parses [`Lease::token`] (at most 16 keys).
    pub fn from_token(token: &str) -> Option<Lease> {
        let mut parts = token.trim().split('.');
        let id = u64::from_str_radix(parts.next()?, 16).ok()?;
        let mut keys = SmallVec::new();
        for part in parts {
            if part.len() != 32 || keys.len() >= 16 {
                return None;
            }
            keys.push(BucketKey {
                hi: u64::from_str_radix(&part[..16], 16).ok()?,
                lo: u64::from_str_radix(&part[16..], 16).ok()?,
            });
        }
        (!keys.is_empty()).then_some(Lease {
            id,
            keys,
            ttl_secs: 0,
        })
    }
}

/// One slot to take within a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseOp {
    pub key: BucketKey,
    /// Live leases allowed on the key.
    pub max: u32,
    pub group: Group,
    /// How long the lease lives unless given back (µs).
    pub ttl_us: u64,
    /// Never blocks its group: taken when its group is taken and it has room, left out (and
    /// reported not allowed) otherwise.
    pub soft: bool,
    /// Held by a request in flight and given back when it is done (a concurrency slot): a
    /// restart does not carry it over (its connection died with the process). Loop marks,
    /// breaker states and settlement marks are not held: they outlive the process in a state
    /// dir.
    pub held: bool,
    /// A loop-detection mark: the embedded store keeps it in its own bounded table
    /// ([`super::marks`]), where room is made by forgetting the soonest-expiring mark, so marks
    /// never take a concurrency slot's or a breaker's room.
    pub mark: bool,
    /// What the slot's rule does while a shared store is away (`None`: the gateway's
    /// default).
    pub on_store_error: Option<super::ops::OnStoreError>,
}

/// The answer for one [`LeaseOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseResult {
    /// A slot was free.
    pub allowed: bool,
    /// Live leases on the key before this request.
    pub in_flight: u32,
    /// The group was taken (every op of the group had a slot) and this lease is held.
    pub committed: bool,
    /// When the key was full: µs until its earliest live lease expires (the first slot to free
    /// by itself). 0 when the key had room.
    pub frees_in_us: u64,
    /// `Some` when a shared store did not answer and the slot was judged by its rule's
    /// `on_store_error` instead (see [`crate::store::OpResult::away`]).
    pub away: Option<super::ops::OnStoreError>,
}

/// What a store read on one key before judging: live leases, and µs until the earliest of
/// them expires (only needed, and only read, when the key is full).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Live {
    pub count: u32,
    pub frees_in_us: u64,
}

impl Live {
    /// From a shared store's reply for one key: `[count, frees_in_us]` (out-of-range values
    /// clamped).
    pub fn from_reply(pair: &[i64]) -> Live {
        let value = |i: usize| pair.get(i).copied().unwrap_or(0);
        Live {
            count: value(0).clamp(0, i64::from(u32::MAX)) as u32,
            frees_in_us: value(1).max(0) as u64,
        }
    }
}

/// Results, one per op, in op order.
pub type LeaseResults = SmallVec<[LeaseResult; 2]>;

/// Lease ids: unique within the process, and random enough across a fleet (a per-process random
/// prefix) that two gateways never hold the same id on a shared key.
pub fn next_lease_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let prefix = *PREFIX.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = ahash::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish() & 0xffff_ffff_0000_0000
    });
    // The low 32 bits count; the prefix keeps processes apart. Never 0.
    prefix | (COUNTER.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff).max(1)
}

/// Decides which groups of `ops` are taken, from each key's live leases: the enforced group if
/// every (non-soft) enforced op has a free slot, the shadow group if that holds and so do its
/// own ops. A soft op is taken with its group when it has room.
pub fn judge(ops: &[LeaseOp], live: &[Live], results: &mut LeaseResults) -> (bool, bool) {
    let ok = |group: Group| {
        ops.iter()
            .zip(live)
            .filter(|(op, _)| op.group == group && !op.soft)
            .all(|(op, l)| l.count < op.max)
    };
    let enforce = ok(Group::Enforce);
    let shadow = enforce && ok(Group::Shadow);
    results.clear();
    for (op, l) in ops.iter().zip(live) {
        let allowed = l.count < op.max;
        let group_taken = match op.group {
            Group::Enforce => enforce,
            Group::Shadow => shadow,
        };
        results.push(LeaseResult {
            allowed,
            in_flight: l.count,
            committed: group_taken && (allowed || !op.soft),
            frees_in_us: if allowed { 0 } else { l.frees_in_us },
            away: None,
        });
    }
    (enforce, shadow)
}

/// The embedded store's leases: in process memory, or in the state file. Times handed in are
/// shifted by `time_offset_us` (see [`super::MemoryStore::time_offset_us`]).
#[derive(Default)]
pub struct MemoryLeases {
    table: LeaseBacking,
    time_offset_us: u64,
    /// Loop marks, in their own bounded table (`None`: in `table`, as the leases of a store
    /// built without a bound, in tests).
    marks: Option<Box<Marks>>,
    /// Leases not stored for want of room (a slot or a breaker not enforced): counted in the
    /// store's fail-open total.
    fail_open: AtomicU64,
}

enum LeaseBacking {
    /// One mutex: only requests under a lease rule come here, twice each, for a few hundred
    /// nanoseconds.
    Heap(Mutex<LeaseTable>),
    File(MappedLeases),
}

impl Default for LeaseBacking {
    fn default() -> Self {
        LeaseBacking::Heap(Mutex::default())
    }
}

/// Key → its live leases as (lease id, expiry µs).
type LeaseTable = AHashMap<BucketKey, SmallVec<[(u64, u64); 4]>>;

/// The loop marks' own table could not be allocated: said once, loudly, since marks then share
/// the lease table (as before they had a table of their own) and can take its room.
fn marks_unavailable(max_marks: usize) {
    tracing::error!(
        max_loop_marks = max_marks,
        "loop marks: their own table could not be allocated; marks share the lease table with concurrency slots and breakers (lower --max-loop-marks)"
    );
}

impl MemoryLeases {
    /// The lease table of a state file; `sole_owner` drops the concurrency slots a previous
    /// process left (and the lock it may have died holding).
    pub fn in_state_file(
        file: &Arc<super::state_file::StateFile>,
        sole_owner: bool,
        time_offset_us: u64,
        max_marks: usize,
    ) -> Self {
        let leases = MappedLeases::new(Arc::clone(file));
        if sole_owner {
            leases.recover();
        }
        let marks = match file.path().parent() {
            Some(dir) => Marks::in_dir(dir, max_marks, sole_owner),
            None => Marks::in_memory(max_marks),
        }
        .map(Box::new);
        if marks.is_none() {
            marks_unavailable(max_marks);
        }
        MemoryLeases {
            table: LeaseBacking::File(leases),
            time_offset_us,
            marks,
            fail_open: AtomicU64::new(0),
        }
    }

    /// Leases in process memory, loop marks bounded to `max_marks`.
    pub fn bounded(max_marks: usize) -> Self {
        let marks = Marks::in_memory(max_marks).map(Box::new);
        if marks.is_none() {
            marks_unavailable(max_marks);
        }
        MemoryLeases {
            marks,
            ..MemoryLeases::default()
        }
    }

    /// Leases not stored for want of room so far.
    pub fn fail_open(&self) -> u64 {
        self.fail_open.load(Ordering::Relaxed)
    }

    /// Loop marks held, and forgotten for room so far (`None`: marks are not kept apart).
    pub fn marks_stats(&self) -> Option<(u64, u64)> {
        self.marks.as_ref().map(|m| (m.held(), m.evicted()))
    }

    /// The marks table, when `op` is a mark and marks are kept apart.
    fn marks_of(&self, op: &LeaseOp) -> Option<&Marks> {
        self.marks.as_deref().filter(|_| op.mark)
    }

    /// Takes a lease `id` on every op's key whose group is admitted, at `now_us`.
    pub fn acquire(&self, now_us: u64, id: u64, ops: &[LeaseOp], results: &mut LeaseResults) {
        let now_us = now_us.saturating_add(self.time_offset_us);
        // The main table's lock, then the marks' (the order every caller keeps).
        let mut heap = match &self.table {
            LeaseBacking::File(file) => {
                let _lock = super::state_file::lock(&file.file.header().lease_lock);
                let _marks = self.lock_marks(ops);
                let mut live: SmallVec<[Live; 2]> = SmallVec::new();
                for op in ops {
                    let main = file.count(MappedLeases::stored(&op.key), now_us);
                    live.push(self.with_marks(op, main, now_us));
                }
                judge(ops, &live, results);
                for (op, result) in ops.iter().zip(results.iter_mut()) {
                    if !result.committed {
                        continue;
                    }
                    let expires = now_us.saturating_add(op.ttl_us);
                    if let Some(marks) = self.marks_of(op) {
                        marks.insert(&op.key, id, expires, now_us);
                    } else if !file.insert(
                        MappedLeases::stored(&op.key),
                        id,
                        expires.min(HELD - 1) | if op.held { HELD } else { 0 },
                        now_us,
                    ) {
                        // No room: the lease is not held, and says so (a settlement mark that
                        // could not be stored refuses the settlement rather than allowing a
                        // second one; a slot not stored is not enforced).
                        result.committed = false;
                        let n = self.fail_open.fetch_add(1, Ordering::Relaxed) + 1;
                        if n.is_power_of_two() {
                            tracing::warn!(
                                leases_not_stored = n,
                                "state dir: the lease table is full; a concurrency slot or breaker was not stored (counted in tollgate_store_fail_open_total)"
                            );
                        }
                    }
                }
                return;
            }
            LeaseBacking::Heap(table) => table.lock(),
        };
        let _marks = self.lock_marks(ops);
        let mut live: SmallVec<[Live; 2]> = SmallVec::new();
        for op in ops {
            let main = heap.get_mut(&op.key).map_or(Live::default(), |leases| {
                leases.retain(|(_, expires)| *expires > now_us);
                let count = leases.len() as u32;
                Live {
                    count,
                    frees_in_us: if count >= op.max || op.mark {
                        leases
                            .iter()
                            .map(|(_, expires)| expires - now_us)
                            .min()
                            .unwrap_or(0)
                    } else {
                        0
                    },
                }
            });
            live.push(self.with_marks(op, main, now_us));
        }
        judge(ops, &live, results);
        for (op, result) in ops.iter().zip(results.iter()) {
            if result.committed {
                let expires = now_us.saturating_add(op.ttl_us);
                match self.marks_of(op) {
                    Some(marks) => marks.insert(&op.key, id, expires, now_us),
                    None => heap.entry(op.key).or_default().push((id, expires)),
                }
            }
        }
    }

    /// The marks' lock, when any of `ops` is a mark kept apart.
    fn lock_marks(&self, ops: &[LeaseOp]) -> Option<super::state_file::WordGuard<'_>> {
        self.marks
            .as_deref()
            .filter(|_| ops.iter().any(|op| op.mark))
            .map(Marks::lock)
    }

    /// `main` (what the lease table holds of `op`'s key) with its marks added, for a mark kept
    /// apart (the marks' lock held). Marks an older build left in the lease table still count.
    fn with_marks(&self, op: &LeaseOp, main: Live, now_us: u64) -> Live {
        let Some(marks) = self.marks_of(op) else {
            return main;
        };
        let (count, frees_in_us) = marks.count(&op.key, now_us);
        combine(main, Live { count, frees_in_us })
    }

    /// Gives lease `id` back on `keys` (a lease already gone, expired or given back, is left
    /// alone: giving back twice frees one slot, once).
    pub fn release(&self, id: u64, keys: &[BucketKey]) {
        match &self.table {
            LeaseBacking::File(file) => file.release(id, keys),
            LeaseBacking::Heap(table) => {
                let mut table = table.lock();
                for key in keys {
                    if let Some(leases) = table.get_mut(key) {
                        leases.retain(|(lease, _)| *lease != id);
                        if leases.is_empty() {
                            table.remove(key);
                        }
                    }
                }
            }
        }
        if let Some(marks) = &self.marks {
            let _lock = marks.lock();
            marks.release(id, keys);
        }
    }

    /// Drops expired leases and empty keys; returns how many leases expired.
    pub fn sweep(&self, now_us: u64) -> u64 {
        let now_us = now_us.saturating_add(self.time_offset_us);
        let marks = self.marks.as_ref().map_or(0, |marks| {
            let _lock = marks.lock();
            marks.sweep_locked(now_us)
        });
        let mut table = match &self.table {
            LeaseBacking::File(file) => return file.sweep(now_us) + marks,
            LeaseBacking::Heap(table) => table.lock(),
        };
        let mut expired = marks;
        table.retain(|_, leases| {
            let before = leases.len();
            leases.retain(|(_, expires)| *expires > now_us);
            expired += (before - leases.len()) as u64;
            !leases.is_empty()
        });
        expired
    }

    /// What the marks table holds of `key` (0 when marks are not kept apart).
    fn marks_live(&self, key: &BucketKey, now_us: u64) -> Live {
        self.marks.as_ref().map_or(Live::default(), |marks| {
            let _lock = marks.lock();
            let (count, frees_in_us) = marks.count(key, now_us);
            Live { count, frees_in_us }
        })
    }

    /// Live leases on `key` at `now_us`, and µs until the earliest of them ends (what
    /// [`judge`] reads), without taking any.
    pub fn live(&self, key: &BucketKey, now_us: u64) -> Live {
        let now_us = now_us.saturating_add(self.time_offset_us);
        let marks = self.marks_live(key, now_us);
        let table = match &self.table {
            LeaseBacking::File(file) => {
                let _lock = super::state_file::lock(&file.file.header().lease_lock);
                return combine(file.count(MappedLeases::stored(key), now_us), marks);
            }
            LeaseBacking::Heap(table) => table.lock(),
        };
        let mut live = Live::default();
        if let Some(leases) = table.get(key) {
            for (_, expires) in leases.iter().filter(|(_, e)| *e > now_us) {
                live.count += 1;
                let left = expires - now_us;
                if live.count == 1 || left < live.frees_in_us {
                    live.frees_in_us = left;
                }
            }
        }
        combine(live, marks)
    }

    /// Drops every lease on `keys` (an operator's reset: the slots are free, the marks gone);
    /// returns how many went.
    pub fn forget(&self, keys: &[BucketKey]) -> u64 {
        let marks = self.marks.as_ref().map_or(0, |marks| {
            let _lock = marks.lock();
            marks.forget(keys)
        });
        let mut table = match &self.table {
            LeaseBacking::File(file) => {
                let _lock = super::state_file::lock(&file.file.header().lease_lock);
                let stored: SmallVec<[(u64, u64); 2]> =
                    keys.iter().map(MappedLeases::stored).collect();
                return file.remove_where(|k, _| stored.contains(&k)) + marks;
            }
            LeaseBacking::Heap(table) => table.lock(),
        };
        marks
            + keys
                .iter()
                .filter_map(|key| table.remove(key))
                .map(|leases| leases.len() as u64)
                .sum::<u64>()
    }

    /// Live leases on `key` at `now_us` (tests and metrics).
    pub fn in_flight(&self, key: &BucketKey, now_us: u64) -> u32 {
        let now_us = now_us.saturating_add(self.time_offset_us);
        let marks = self.marks_live(key, now_us).count;
        let table = match &self.table {
            LeaseBacking::File(file) => return file.in_flight(key, now_us) + marks,
            LeaseBacking::Heap(table) => table.lock(),
        };
        marks
            + table.get(key).map_or(0, |leases| {
                leases.iter().filter(|(_, e)| *e > now_us).count() as u32
            })
    }
}

/// Two tables' live leases of one key as one: counts added, the earliest end kept.
fn combine(a: Live, b: Live) -> Live {
    let frees_in_us = match (a.count, b.count) {
        (0, _) => b.frees_in_us,
        (_, 0) => a.frees_in_us,
        _ => a.frees_in_us.min(b.frees_in_us),
    };
    Live {
        count: a.count + b.count,
        frees_in_us,
    }
}

/// Bytes of one lease slot in the state file.
pub const MAPPED_SLOT_BYTES: usize = std::mem::size_of::<LeaseSlot>();

/// One lease in the state file. All zeros is an empty slot (a zero key is stored as `(0, 1)`).
#[repr(C)]
struct LeaseSlot {
    hi: AtomicU64,
    lo: AtomicU64,
    id: AtomicU64,
    /// Expiry µs, with [`HELD`] for a lease given back when its request is done.
    expires: AtomicU64,
}

const HELD: u64 = 1 << 63;

/// The state file's lease table: open addressing with linear probing, every lease of a key in
/// the probe run from the key's home slot, removals shifting later entries back (no
/// tombstones), all under one lock word in the file header (shared by the processes of an
/// upgrade). Bounded: at 3/4 full, expired leases are swept; a lease that still finds no room
/// is not recorded (its request fails open, as a full bucket store does).
struct MappedLeases {
    file: Arc<super::state_file::StateFile>,
}

impl MappedLeases {
    fn new(file: Arc<super::state_file::StateFile>) -> Self {
        MappedLeases { file }
    }

    fn slots(&self) -> &[LeaseSlot] {
        let g = self.file.geometry();
        // SAFETY: the geometry's lease region lies within the mapping, 64-byte aligned, and
        // lease slots are atomics, valid for any bytes.
        unsafe {
            self.file
                .region::<LeaseSlot>(g.leases_offset(), g.lease_capacity)
        }
    }

    fn live(&self) -> &AtomicU64 {
        &self.file.header().lease_live
    }

    fn stored(key: &BucketKey) -> (u64, u64) {
        match (key.hi, key.lo) {
            (0, 0) => (0, 1),
            k => k,
        }
    }

    fn key_at(slot: &LeaseSlot) -> (u64, u64) {
        (
            slot.hi.load(Ordering::Relaxed),
            slot.lo.load(Ordering::Relaxed),
        )
    }

    /// After a restart: the lock and the count rebuilt, held leases (concurrency slots)
    /// dropped.
    fn recover(&self) {
        self.file.header().lease_lock.store(0, Ordering::Relaxed);
        let slots = self.slots();
        let mut live = 0;
        for slot in slots {
            live += u64::from(Self::key_at(slot) != (0, 0));
        }
        self.live().store(live, Ordering::Relaxed);
        let _lock = super::state_file::lock(&self.file.header().lease_lock);
        self.remove_where(|_, expires| expires & HELD != 0);
    }

    /// Live leases of `key` at `now_us`, and µs until the earliest of them expires.
    fn count(&self, key: (u64, u64), now_us: u64) -> Live {
        let slots = self.slots();
        let mask = slots.len() - 1;
        let mut i = (key.1 as usize) & mask;
        let mut live = Live::default();
        let mut earliest = u64::MAX;
        for _ in 0..slots.len() {
            let slot = &slots[i];
            let k = Self::key_at(slot);
            if k == (0, 0) {
                break;
            }
            let expires = slot.expires.load(Ordering::Relaxed) & !HELD;
            if k == key && expires > now_us {
                live.count += 1;
                earliest = earliest.min(expires - now_us);
            }
            i = (i + 1) & mask;
        }
        live.frees_in_us = if live.count > 0 { earliest } else { 0 };
        live
    }

    /// Stores one lease (the lock held); false when there is no room.
    fn insert(&self, key: (u64, u64), id: u64, expires: u64, now_us: u64) -> bool {
        let slots = self.slots();
        if self.live().load(Ordering::Relaxed) as usize * 4 >= slots.len() * 3 {
            self.remove_where(|_, e| e & !HELD <= now_us);
            if self.live().load(Ordering::Relaxed) as usize * 4 >= slots.len() * 3 {
                return false;
            }
        }
        let mask = slots.len() - 1;
        let mut i = (key.1 as usize) & mask;
        while Self::key_at(&slots[i]) != (0, 0) {
            i = (i + 1) & mask;
        }
        let slot = &slots[i];
        slot.id.store(id, Ordering::Relaxed);
        slot.expires.store(expires, Ordering::Relaxed);
        slot.lo.store(key.1, Ordering::Relaxed);
        slot.hi.store(key.0, Ordering::Relaxed);
        self.live().fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Removes every lease for which `remove(key, expires word)` holds (the lock held),
    /// shifting later entries back so every probe run stays unbroken. Returns how many went.
    fn remove_where(&self, remove: impl Fn((u64, u64), u64) -> bool) -> u64 {
        let slots = self.slots();
        let mask = slots.len() - 1;
        let mut removed = 0;
        let mut i = 0;
        while i < slots.len() {
            let k = Self::key_at(&slots[i]);
            if k != (0, 0) && remove(k, slots[i].expires.load(Ordering::Relaxed)) {
                self.remove_at(i, mask);
                removed += 1;
            } else {
                i += 1;
            }
        }
        let live = self.live().load(Ordering::Relaxed);
        self.live()
            .store(live.saturating_sub(removed), Ordering::Relaxed);
        removed
    }

    /// Empties slot `i`, moving later entries of its run back where their home allows.
    fn remove_at(&self, i: usize, mask: usize) {
        let slots = self.slots();
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            if j == hole {
                break;
            }
            let k = Self::key_at(&slots[j]);
            if k == (0, 0) {
                break;
            }
            if super::probe::stays((k.1 as usize) & mask, hole, j) {
                continue;
            }
            let (from, to) = (&slots[j], &slots[hole]);
            to.id
                .store(from.id.load(Ordering::Relaxed), Ordering::Relaxed);
            to.expires
                .store(from.expires.load(Ordering::Relaxed), Ordering::Relaxed);
            to.lo.store(k.1, Ordering::Relaxed);
            to.hi.store(k.0, Ordering::Relaxed);
            hole = j;
        }
        let last = &slots[hole];
        for word in [&last.hi, &last.lo, &last.id, &last.expires] {
            word.store(0, Ordering::Relaxed);
        }
    }

    fn release(&self, id: u64, keys: &[BucketKey]) {
        let _lock = super::state_file::lock(&self.file.header().lease_lock);
        let slots = self.slots();
        let mask = slots.len() - 1;
        for key in keys {
            let key = Self::stored(key);
            let mut i = (key.1 as usize) & mask;
            for _ in 0..slots.len() {
                let k = Self::key_at(&slots[i]);
                if k == (0, 0) {
                    break;
                }
                if k == key && slots[i].id.load(Ordering::Relaxed) == id {
                    self.remove_at(i, mask);
                    let live = self.live().load(Ordering::Relaxed);
                    self.live().store(live.saturating_sub(1), Ordering::Relaxed);
                    break;
                }
                i = (i + 1) & mask;
            }
        }
    }

    fn sweep(&self, now_us: u64) -> u64 {
        let _lock = super::state_file::lock(&self.file.header().lease_lock);
        self.remove_where(|_, expires| expires & !HELD <= now_us)
    }

    fn in_flight(&self, key: &BucketKey, now_us: u64) -> u32 {
        let _lock = super::state_file::lock(&self.file.header().lease_lock);
        self.count(Self::stored(key), now_us).count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(key: &str, max: u32, group: Group) -> LeaseOp {
        LeaseOp {
            key: BucketKey::of(key),
            max,
            group,
            ttl_us: 10_000_000,
            soft: false,
            held: true,
            mark: false,
            on_store_error: None,
        }
    }

    #[test]
    fn slots_are_taken_all_or_nothing_and_given_back_once() {
        let leases = MemoryLeases::default();
        let mut r = LeaseResults::new();
        let wide = op("cc:wide:k", 3, Group::Enforce);
        let narrow = op("cc:narrow:k", 1, Group::Enforce);
        leases.acquire(0, 1, &[wide, narrow], &mut r);
        assert!(r.iter().all(|r| r.allowed && r.committed));
        // The narrow slot is taken: the request holds neither.
        leases.acquire(0, 2, &[wide, narrow], &mut r);
        assert_eq!((r[0].allowed, r[0].committed), (true, false));
        assert_eq!((r[1].allowed, r[1].in_flight), (false, 1));
        assert_eq!(leases.in_flight(&wide.key, 0), 1);
        // Given back twice: one slot freed, once.
        leases.release(1, &[wide.key, narrow.key]);
        leases.release(1, &[wide.key, narrow.key]);
        assert_eq!(leases.in_flight(&wide.key, 0), 0);
        leases.acquire(0, 3, &[wide, narrow], &mut r);
        assert!(r[1].committed);
        leases.acquire(0, 4, &[wide], &mut r);
        leases.release(99, &[wide.key]);
        assert_eq!(leases.in_flight(&wide.key, 0), 2);
    }

    #[test]
    fn leases_nobody_gives_back_expire() {
        let leases = MemoryLeases::default();
        let mut r = LeaseResults::new();
        let one = op("cc:one:k", 1, Group::Enforce);
        leases.acquire(0, 1, &[one], &mut r);
        leases.acquire(9_999_999, 2, &[one], &mut r);
        assert!(!r[0].allowed);
        leases.acquire(10_000_000, 3, &[one], &mut r);
        assert!(r[0].committed);
        assert_eq!(leases.sweep(20_000_000), 1);
        assert_eq!(leases.in_flight(&one.key, 0), 0);
    }

    #[test]
    fn shadow_slots_never_block_enforced_ones() {
        let leases = MemoryLeases::default();
        let mut r = LeaseResults::new();
        let enforced = op("cc:e:k", 5, Group::Enforce);
        let shadow = op("shadow:cc:s:k", 1, Group::Shadow);
        leases.acquire(0, 1, &[enforced, shadow], &mut r);
        leases.acquire(0, 2, &[enforced, shadow], &mut r);
        assert_eq!(
            (r[0].committed, r[1].allowed, r[1].committed),
            (true, false, false)
        );
        assert_eq!(leases.in_flight(&enforced.key, 0), 2);
    }

    #[test]
    fn soft_ops_never_block_and_peeks_read_when_the_key_frees() {
        let leases = MemoryLeases::default();
        let mut r = LeaseResults::new();
        let slot = op("cc:s:k", 5, Group::Enforce);
        let mark = LeaseOp {
            soft: true,
            ..op("lp:p:k", 1, Group::Enforce)
        };
        let peek = LeaseOp { max: 0, ..mark };
        leases.acquire(1_000, 1, &[slot, mark], &mut r);
        assert_eq!((r[1].allowed, r[1].committed), (true, true));
        // The mark is full: the request still takes its slot, and learns when the mark frees.
        leases.acquire(4_000, 2, &[slot, mark], &mut r);
        assert_eq!(
            (r[0].committed, r[1].allowed, r[1].committed),
            (true, false, false)
        );
        assert_eq!(r[1].frees_in_us, 10_001_000 - 4_000);
        assert_eq!(leases.in_flight(&mark.key, 4_000), 1);
        // A peek takes nothing, and reports the same.
        leases.acquire(5_000, 3, &[peek], &mut r);
        assert_eq!(
            (
                r[0].allowed,
                r[0].committed,
                r[0].in_flight,
                r[0].frees_in_us
            ),
            (false, false, 1, 10_001_000 - 5_000)
        );
        assert_eq!(leases.in_flight(&mark.key, 5_000), 1);
        // A soft op of a refused group is not taken either.
        let full = op("cc:full:k", 1, Group::Enforce);
        let fresh = LeaseOp {
            soft: true,
            ..op("lp:p:other", 3, Group::Enforce)
        };
        leases.acquire(0, 4, &[full], &mut r);
        leases.acquire(0, 5, &[full, fresh], &mut r);
        assert_eq!((r[1].allowed, r[1].committed), (true, false));
        assert_eq!(leases.in_flight(&fresh.key, 0), 0);
    }

    #[test]
    fn tokens_round_trip_and_refuse_garbage() {
        let lease = Lease {
            id: 0xdead_beef_0000_0001,
            keys: smallvec::smallvec![BucketKey::of("cc:a:1"), BucketKey::of("cc:b:1")],
            ttl_secs: 300,
        };
        let back = Lease::from_token(&lease.token()).unwrap();
        assert_eq!((back.id, back.keys), (lease.id, lease.keys));
        for bad in [
            "",
            "xyz",
            "00000000000000ff",
            "00000000000000ff.1234",
            "ff.zz",
        ] {
            assert_eq!(Lease::from_token(bad), None, "{bad}");
        }
    }

    #[test]
    fn lease_ids_are_distinct() {
        let a = next_lease_id();
        let b = next_lease_id();
        assert_ne!(a, b);
        assert_ne!(a & 0xffff_ffff, 0);
    }
}
