//! The embedded store's loop-detection marks: one per admitted request under `loop_detection`,
//! under the request's fingerprint, for the loop's window. Distinct requests leave distinct
//! marks, so any client can make many of them: they live in a table of their own, bounded by
//! `--max-loop-marks`, apart from concurrency slots and breakers (which never lose room to
//! them).
//!
//! An open-addressing table (linear probing, every mark of a key in the probe run from the
//! key's home slot, removals shifting later entries back) of 32-byte slots (key, lease id,
//! expiry) at most 3/4 full, under one lock word, in a [`SideTable`]: process memory, or with
//! `--state-dir` the file `DIR/loop-marks.state` (marks outlive a restart, as the state file's
//! breakers do). When it holds `--max-loop-marks` marks, expired ones are swept (at most once a
//! second), and if none has expired the mark expiring soonest among [`EVICTION_SAMPLES`]
//! sampled is forgotten: a forgotten mark is one identical request the loop count misses, never
//! a request let through or refused for want of room.

use super::ops::BucketKey;
use super::side_table::SideTable;
use std::sync::atomic::{AtomicU64, Ordering};

/// `--max-loop-marks`' default.
pub const DEFAULT_MAX_LOOP_MARKS: usize = 100_000;
/// Marks compared by each eviction for room.
pub const EVICTION_SAMPLES: usize = 5;
/// The file's name in the state dir.
pub const FILE_NAME: &str = "loop-marks.state";
const MAGIC: [u8; 8] = *b"TGMARKS\x01";

/// Header words.
const LOCK: usize = 0;
const LIVE: usize = 1;
const LAST_SWEEP: usize = 2;
const EVICTED: usize = 3;
const SAMPLER: usize = 4;

/// Words per slot: key high, key low, lease id, expiry (µs).
const SLOT_WORDS: usize = 4;

/// Slots for `max` marks: at most 3/4 full, a power of two, at least 64.
fn capacity_for(max: usize) -> usize {
    (max.max(1) * 4).div_ceil(3).next_power_of_two().max(64)
}

/// The marks table.
pub struct Marks {
    table: SideTable,
    max: usize,
    capacity: usize,
}

/// A mark's key as stored: never all zeros (an empty slot).
fn stored(key: &BucketKey) -> (u64, u64) {
    match (key.hi, key.lo) {
        (0, 0) => (0, 1),
        k => k,
    }
}

impl Marks {
    /// A table for `max` marks in process memory; `None` without address space for it.
    pub fn in_memory(max: usize) -> Option<Marks> {
        let capacity = capacity_for(max);
        let table =
            SideTable::anonymous([max as u64, capacity as u64], capacity * SLOT_WORDS).ok()?;
        Some(Marks {
            table,
            max: max.max(1),
            capacity,
        })
    }

    /// The table in `DIR/loop-marks.state` (made again, empty, when it was made for another
    /// `--max-loop-marks`); in process memory when that file cannot be used (logged).
    /// `sole_owner`: no other process uses it, so a lock a crashed one left is cleared.
    pub fn in_dir(dir: &std::path::Path, max: usize, sole_owner: bool) -> Option<Marks> {
        let capacity = capacity_for(max);
        match SideTable::in_dir(
            dir,
            FILE_NAME,
            MAGIC,
            [max as u64, capacity as u64],
            capacity * SLOT_WORDS,
            sole_owner,
        ) {
            Ok((table, _created)) => {
                let marks = Marks {
                    table,
                    max: max.max(1),
                    capacity,
                };
                if sole_owner {
                    marks.recover();
                }
                Some(marks)
            }
            Err(e) => {
                tracing::error!(
                    "state dir: loop marks kept in process memory only (a restart forgets them): {e}"
                );
                Self::in_memory(max)
            }
        }
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        self.table.word(i)
    }

    fn slot(&self, i: usize) -> &[AtomicU64] {
        let at = (i & (self.capacity - 1)) * SLOT_WORDS;
        &self.table.body()[at..at + SLOT_WORDS]
    }

    fn key_at(&self, i: usize) -> (u64, u64) {
        let slot = self.slot(i);
        (
            slot[0].load(Ordering::Relaxed),
            slot[1].load(Ordering::Relaxed),
        )
    }

    fn expires_at(&self, i: usize) -> u64 {
        self.slot(i)[3].load(Ordering::Relaxed)
    }

    fn home(&self, key: (u64, u64)) -> usize {
        (key.1 as usize) & (self.capacity - 1)
    }

    /// The lock word, held while the table is read or changed.
    pub fn lock(&self) -> super::state_file::WordGuard<'_> {
        super::state_file::lock(self.word(LOCK))
    }

    /// After a restart: the lock and the count rebuilt from the slots.
    fn recover(&self) {
        self.word(LOCK).store(0, Ordering::Relaxed);
        let live = (0..self.capacity)
            .filter(|&i| self.key_at(i) != (0, 0))
            .count();
        self.word(LIVE).store(live as u64, Ordering::Relaxed);
    }

    /// Marks held now (live or expired but not swept yet).
    pub fn held(&self) -> u64 {
        self.word(LIVE).load(Ordering::Relaxed)
    }

    /// Marks forgotten for room so far.
    pub fn evicted(&self) -> u64 {
        self.word(EVICTED).load(Ordering::Relaxed)
    }

    /// Live marks of `key` at `now_us`, and µs until the earliest of them expires (the lock
    /// held).
    pub fn count(&self, key: &BucketKey, now_us: u64) -> (u32, u64) {
        let key = stored(key);
        let (mut count, mut earliest) = (0u32, u64::MAX);
        for i in (self.home(key)..).take(self.capacity) {
            let k = self.key_at(i);
            if k == (0, 0) {
                break;
            }
            let expires = self.expires_at(i);
            if k == key && expires > now_us {
                count += 1;
                earliest = earliest.min(expires - now_us);
            }
        }
        (count, if count > 0 { earliest } else { 0 })
    }

    /// Stores a mark (the lock held), making room first when the table holds its bound.
    pub fn insert(&self, key: &BucketKey, id: u64, expires: u64, now_us: u64) {
        if self.held() as usize >= self.max {
            self.make_room(now_us);
        }
        let key = stored(key);
        let mut i = self.home(key);
        while self.key_at(i) != (0, 0) {
            i += 1;
        }
        let slot = self.slot(i);
        slot[2].store(id, Ordering::Relaxed);
        slot[3].store(expires, Ordering::Relaxed);
        slot[1].store(key.1, Ordering::Relaxed);
        slot[0].store(key.0, Ordering::Relaxed);
        self.word(LIVE).fetch_add(1, Ordering::Relaxed);
    }

    /// Room for one mark: expired marks swept (at most once a second, so a flood cannot turn
    /// every request into a scan), else the soonest-expiring of the sampled marks forgotten.
    fn make_room(&self, now_us: u64) {
        let last = self.word(LAST_SWEEP).load(Ordering::Relaxed);
        if last == 0 || now_us.saturating_sub(last) >= 1_000_000 {
            self.word(LAST_SWEEP)
                .store(now_us.max(1), Ordering::Relaxed);
            self.sweep_locked(now_us);
            if (self.held() as usize) < self.max {
                return;
            }
        }
        let mut best: Option<(usize, u64)> = None;
        for _ in 0..EVICTION_SAMPLES {
            let start = self.next_random() as usize;
            for step in 0..self.capacity {
                let i = (start + step) & (self.capacity - 1);
                if self.key_at(i) != (0, 0) {
                    let expires = self.expires_at(i);
                    if best.is_none_or(|(_, e)| expires < e) {
                        best = Some((i, expires));
                    }
                    break;
                }
            }
        }
        if let Some((i, _)) = best {
            self.remove_at(i);
            self.sub_live(1);
            self.word(EVICTED).fetch_add(1, Ordering::Relaxed);
        }
    }

    /// SplitMix64 over the sampler word (the lock held).
    fn next_random(&self) -> u64 {
        let state = self
            .word(SAMPLER)
            .load(Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.word(SAMPLER).store(state, Ordering::Relaxed);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn sub_live(&self, n: u64) {
        let live = self.held();
        self.word(LIVE)
            .store(live.saturating_sub(n), Ordering::Relaxed);
    }

    /// Removes mark `id` of each of `keys` (a refused request's; the lock held).
    pub fn release(&self, id: u64, keys: &[BucketKey]) {
        for key in keys {
            let key = stored(key);
            for i in (self.home(key)..).take(self.capacity) {
                let k = self.key_at(i);
                if k == (0, 0) {
                    break;
                }
                if k == key && self.slot(i)[2].load(Ordering::Relaxed) == id {
                    self.remove_at(i);
                    self.sub_live(1);
                    break;
                }
            }
        }
    }

    /// Drops expired marks (the lock held); returns how many went.
    pub fn sweep_locked(&self, now_us: u64) -> u64 {
        self.remove_where(|_, expires| expires <= now_us)
    }

    /// Drops every mark of `keys` (an operator's reset; the lock held).
    pub fn forget(&self, keys: &[BucketKey]) -> u64 {
        let keys: smallvec::SmallVec<[(u64, u64); 2]> = keys.iter().map(stored).collect();
        self.remove_where(|k, _| keys.contains(&k))
    }

    fn remove_where(&self, remove: impl Fn((u64, u64), u64) -> bool) -> u64 {
        let mut removed = 0;
        let mut i = 0;
        while i < self.capacity {
            let k = self.key_at(i);
            if k != (0, 0) && remove(k, self.expires_at(i)) {
                // The entry shifted into `i` (if any) is examined next.
                self.remove_at(i);
                removed += 1;
            } else {
                i += 1;
            }
        }
        self.sub_live(removed);
        removed
    }

    /// Empties slot `i`, moving later entries of its run back where their home allows.
    fn remove_at(&self, i: usize) {
        let mask = self.capacity - 1;
        let mut hole = i & mask;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            if j == hole {
                break;
            }
            let k = self.key_at(j);
            if k == (0, 0) {
                break;
            }
            if super::probe::stays(self.home(k), hole, j) {
                continue;
            }
            let (from, to) = (self.slot(j), self.slot(hole));
            for w in 0..SLOT_WORDS {
                to[w].store(from[w].load(Ordering::Relaxed), Ordering::Relaxed);
            }
            hole = j;
        }
        for word in self.slot(hole) {
            word.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_hold_their_bound_and_forget_the_soonest_expiring() {
        let marks = Marks::in_memory(100).unwrap();
        let _lock = marks.lock();
        let loop_key = BucketKey::of("lp:p:loop");
        for id in 0..5 {
            marks.insert(&loop_key, id, 1_000_000_000, 0);
        }
        // 1 000 distinct requests, each expiring sooner than the loop's marks.
        for i in 0..1000u64 {
            marks.insert(
                &BucketKey::of(&format!("lp:p:{i}")),
                100 + i,
                500_000_000,
                1,
            );
            assert!(marks.held() <= 100);
        }
        assert_eq!(marks.held(), 100);
        assert_eq!(marks.evicted(), 905);
        // Sampled evictions preferred the flood's sooner-expiring marks: the loop kept most.
        assert!(
            marks.count(&loop_key, 1).0 >= 3,
            "{:?}",
            marks.count(&loop_key, 1)
        );
        // Expired marks are swept first, and given-back ones go.
        marks.insert(&loop_key, 9, 2_000_000_000, 600_000_000);
        assert_eq!(marks.count(&loop_key, 600_000_000).0, marks.held() as u32);
        marks.release(9, &[loop_key]);
        assert_eq!(marks.count(&loop_key, 600_000_000).0, marks.held() as u32);
        let held = marks.held();
        assert_eq!(marks.forget(&[loop_key]), held);
        assert_eq!(marks.held(), 0);
    }
}
