//! The record of evicted spend: what an entry evicted for room still held, kept in a fixed-size
//! count-min sketch, so that the key, when it comes back, starts from at least that instead of
//! from a full bucket. Eviction can then be steered by nobody: whichever entry a flood makes
//! the store forget, its owner gets nothing back.
//!
//! [`ROWS`] rows of [`WIDTH`] cells; a key has one cell in each row (from its 128-bit hash,
//! mixed with a per-table random seed). A cell holds one *record*: the second (in the store's
//! time base) from which it says nothing any more, and an amount of micro-tokens spent (a small
//! float, rounded up; all ones for "everything": a spend not known). An eviction merges its
//! entry's record into each of the key's cells: a cell whose record has ended takes the new one;
//! a live one takes the later end and the larger spend, so every cell holds at least what every
//! key merged into it held, until that key's record ends. A key that finds a live record in all
//! of its cells starts from the least of them ([`EvictedRecord::restore`]):
//!
//! - a token bucket is full again at most at the end of each record, and holds at most the
//!   record's spend now (it spent that at its last update, and has refilled since): it starts
//!   full at the earliest of those times, with the key's own quota;
//! - a budget holds the record's spend until the record ends (its window's end).
//!
//! So a key never starts with more than it held when it was evicted (never under-counts). What
//! it costs: a key never evicted whose every cell holds another key's live record starts
//! charged with the least of them (a false refusal). With `r` live records (evicted entries not
//! full again yet) that happens with a chance of at most `(r / WIDTH)^ROWS`.

use crate::limits::limiter::{BucketState, Quota, US_PER_SEC};
use crate::store::side_table::SideTable;
use std::sync::atomic::{AtomicU64, Ordering};

/// Rows of the sketch (cells per key).
pub const ROWS: usize = 4;
/// Cells per row.
pub const WIDTH: usize = 1 << 19;

/// The spend code meaning "everything": not known, bounded only by the record's end.
const EVERYTHING: u32 = u32::MAX;

/// Header words: the hashing seed, and the latest second any record ends (once it has passed,
/// no record is live, and a lookup reads nothing else).
const SEED_WORD: usize = 0;
const LIVE_UNTIL_WORD: usize = 1;

/// The file's name in the state dir.
pub const FILE_NAME: &str = "evicted.state";
const MAGIC: [u8; 8] = *b"TGEVICT\x01";

/// Bits of the spend code's mantissa.
const MANTISSA: u32 = 27;

/// Micro-tokens as a 32-bit code, rounded **up** (a 27-bit mantissa and a 5-bit exponent):
/// exact up to 2^27 micro-tokens (134 tokens), then at most 2^-26 above the amount. Monotonic.
fn encode_up(micro: u64) -> u32 {
    if micro < 1 << MANTISSA {
        return micro as u32;
    }
    let bits = u64::BITS - micro.leading_zeros();
    let mut exp = bits - MANTISSA;
    // The leading bit and the mantissa, rounded up: from 2^27 to 2^28.
    let mut scaled = micro.div_ceil(1 << (exp - 1));
    if scaled == 1 << (MANTISSA + 1) {
        exp += 1;
        scaled = 1 << MANTISSA;
    }
    if exp > 31 {
        return EVERYTHING;
    }
    (exp << MANTISSA) | (scaled - (1 << MANTISSA)) as u32
}

/// The amount [`encode_up`] kept (`None`: everything).
fn decode(code: u32) -> Option<u64> {
    if code == EVERYTHING {
        return None;
    }
    let exp = code >> MANTISSA;
    let mantissa = u64::from(code & ((1 << MANTISSA) - 1));
    if exp == 0 {
        Some(mantissa)
    } else {
        // Normalised: the leading bit is implicit.
        Some((mantissa | (1 << MANTISSA)) << (exp - 1))
    }
}

/// A cell: the record's end (whole seconds, rounded up) and its spend code. 0: empty.
fn pack(until_s: u64, code: u32) -> u64 {
    (until_s.min(u64::from(u32::MAX)) << 32) | u64::from(code)
}

fn until_us(cell: u64) -> u64 {
    (cell >> 32) * US_PER_SEC
}

fn code(cell: u64) -> u32 {
    cell as u32
}

/// Whether the cell holds a record still live at `now_us`.
fn live(cell: u64, now_us: u64) -> bool {
    until_us(cell) > now_us
}

/// One record merged into a cell at `now_us` (see the module doc).
fn merge(cell: u64, record: u64, now_us: u64) -> u64 {
    if !live(cell, now_us) {
        return record;
    }
    let spend = code(cell).max(code(record));
    pack((cell >> 32).max(record >> 32), spend)
}

/// The sketch, in process memory or in the state dir.
pub struct EvictedRecord {
    table: SideTable,
    seed: u64,
}

impl EvictedRecord {
    /// An empty record in process memory; `None` without address space for it (the store then
    /// evicts as builds before it did, forgetting what the evicted entry held).
    pub fn in_memory() -> Option<EvictedRecord> {
        let table = SideTable::anonymous([ROWS as u64, WIDTH as u64], ROWS * WIDTH).ok()?;
        Some(Self::seeded(table))
    }

    /// The record in `DIR/evicted.state`, kept across restarts and shared during an upgrade;
    /// one that cannot be made or mapped is kept in process memory instead (logged).
    pub fn in_dir(dir: &std::path::Path, sole_owner: bool) -> Option<EvictedRecord> {
        match SideTable::in_dir(
            dir,
            FILE_NAME,
            MAGIC,
            [ROWS as u64, WIDTH as u64],
            ROWS * WIDTH,
            sole_owner,
        ) {
            Ok((table, _created)) => Some(Self::seeded(table)),
            Err(e) => {
                tracing::error!(
                    "state dir: the record of evicted spend is kept in process memory only (a restart forgets it): {e}"
                );
                Self::in_memory()
            }
        }
    }

    fn seeded(table: SideTable) -> EvictedRecord {
        let word = table.word(SEED_WORD);
        if word.load(Ordering::Relaxed) == 0 {
            let fresh = ahash::RandomState::new().hash_one(std::process::id()) | 1;
            let _ = word.compare_exchange(0, fresh, Ordering::Relaxed, Ordering::Relaxed);
        }
        let seed = word.load(Ordering::Relaxed);
        EvictedRecord { table, seed }
    }

    /// The key's cell in each row.
    fn cells(&self, key: (u64, u64)) -> [&AtomicU64; ROWS] {
        let mix = |v: u64| {
            let mut z = v.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let x = mix(key.1 ^ self.seed);
        let y = mix(key.0 ^ self.seed.rotate_left(29));
        let mask = (WIDTH - 1) as u64;
        let body = self.table.body();
        let at = |row: usize, i: u64| &body[row * WIDTH + (i & mask) as usize];
        [at(0, x), at(1, x >> 21), at(2, x >> 42), at(3, y)]
    }

    /// Records what an entry evicted at `now_us` held: `spent` micro-tokens (`None`: not known)
    /// until `until_s` (the whole second it is full again), at the latest.
    pub fn record(&self, key: (u64, u64), until_s: u64, spent: Option<u64>, now_us: u64) {
        if until_s * US_PER_SEC <= now_us {
            return;
        }
        let record = pack(until_s, spent.map_or(EVERYTHING, encode_up));
        let cells = self.cells(key);
        // Plain loads first, none depending on another, so their cache misses overlap; then a
        // compare-and-swap only where the merge changes the cell (each one is a full barrier).
        let seen = cells.map(|cell| cell.load(Ordering::Relaxed));
        for (cell, mut current) in cells.into_iter().zip(seen) {
            loop {
                let merged = merge(current, record, now_us);
                if merged == current {
                    break;
                }
                match cell.compare_exchange_weak(
                    current,
                    merged,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => current = now,
                }
            }
        }
        let live_until = self.table.word(LIVE_UNTIL_WORD);
        if live_until.load(Ordering::Relaxed) < until_s {
            live_until.fetch_max(until_s, Ordering::Relaxed);
        }
    }

    /// The key's cells' records live at `now_us`: `None` when any cell holds none (the key
    /// was not evicted with spend, or its record has ended).
    fn live_records(&self, key: (u64, u64), now_us: u64) -> Option<[u64; ROWS]> {
        // No record live anywhere (the common case: a store with room): one load.
        if self.table.word(LIVE_UNTIL_WORD).load(Ordering::Relaxed) * US_PER_SEC <= now_us {
            return None;
        }
        // All four loads before any test, so their cache misses overlap.
        let records = self.cells(key).map(|cell| cell.load(Ordering::Relaxed));
        records
            .iter()
            .all(|&record| live(record, now_us))
            .then_some(records)
    }

    /// The state an absent key starts from at `now_us`: `None` (a full bucket) unless every
    /// cell of the key holds a live record; else the least those records allow. `quota` is the
    /// key's own; `window`, a budget's current window id.
    pub fn restore(
        &self,
        key: (u64, u64),
        quota: &Quota,
        window: Option<u64>,
        now_us: u64,
    ) -> Option<BucketState> {
        let records = self.live_records(key, now_us)?;
        let burst = quota.burst();
        match window {
            Some(window) => {
                let spent = records
                    .iter()
                    .map(|&r| decode(code(r)).unwrap_or(burst).min(burst))
                    .min()
                    .unwrap_or(0);
                (spent > 0).then_some(BucketState {
                    tokens: burst - spent,
                    last_us: window,
                })
            }
            None => {
                // The earliest time any record lets the bucket be full again: the least of the
                // records' ends and of their amounts refilled from now (refill time grows with
                // the amount, so the least amount is the one to refill: one division).
                let end = records.iter().map(|&r| until_us(r)).min().unwrap_or(now_us);
                let least = records.iter().filter_map(|&r| decode(code(r))).min();
                let full_at = match least {
                    Some(spent) => end.min(now_us.saturating_add(quota.time_to_gain_us(spent))),
                    None => end,
                };
                if full_at <= now_us {
                    return None;
                }
                let need_us = full_at - now_us;
                let refill_all = quota.time_to_gain_us(burst);
                if need_us >= refill_all {
                    // Empty, and refilling nothing before `full_at - refill_all` (a bucket that
                    // was in debt).
                    return Some(BucketState {
                        tokens: 0,
                        last_us: full_at - refill_all,
                    });
                }
                // What `need_us` of refill is worth, rounded up (64-bit when it fits: a 128-bit
                // division is a slow library call).
                let spent = match need_us.checked_mul(quota.refill()) {
                    Some(product) => product.div_ceil(quota.period_us()),
                    None => (u128::from(need_us) * u128::from(quota.refill()))
                        .div_ceil(u128::from(quota.period_us()))
                        .min(u128::from(burst)) as u64,
                }
                .min(burst);
                Some(BucketState {
                    tokens: burst - spent,
                    last_us: now_us,
                })
            }
        }
    }

    /// Forgets the key's record (an operator's reset): its first row's cell is emptied, which
    /// is enough for the key to start full. A key sharing that cell loses its record too.
    pub fn forget(&self, key: (u64, u64)) {
        self.cells(key)[0].store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::MICRO;

    #[test]
    fn spend_codes_round_up_and_keep_order() {
        for micro in [
            0u64,
            1,
            10 * MICRO,
            (1 << 27) - 1,
            1 << 27,
            (1 << 27) + 1,
            123_456_789_012,
            u64::from(u32::MAX) * 1000 + 7,
        ] {
            let back = decode(encode_up(micro)).unwrap();
            assert!(back >= micro, "{micro} came back as {back}");
            assert!(back - micro <= micro >> 26, "{micro}: {back}");
        }
        let codes: Vec<u32> = (0..2000u64).map(|i| encode_up(i * i * i * 997)).collect();
        assert!(codes.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(decode(encode_up(u64::MAX)), None, "saturates at everything");
    }

    fn quota_per_min(n: u64) -> Quota {
        Quota::new(n * MICRO, n * MICRO, 60 * US_PER_SEC).unwrap()
    }

    #[test]
    fn a_recorded_key_starts_from_what_it_held_and_others_start_full() {
        let record = EvictedRecord::in_memory().unwrap();
        let quota = quota_per_min(10);
        let key = (11, 22);
        // Drained at t = 0 (10 tokens spent, full again at 60 s), evicted at t = 1 s.
        record.record(key, 60, Some(10 * MICRO), US_PER_SEC);
        let at_30 = record.restore(key, &quota, None, 30 * US_PER_SEC).unwrap();
        assert_eq!(at_30.tokens, 5 * MICRO, "refilled as the bucket would have");
        assert_eq!(record.restore(key, &quota, None, 60 * US_PER_SEC), None);
        assert_eq!(
            record.restore((12, 22), &quota, None, 30 * US_PER_SEC),
            None
        );
        // A budget: its spend until the window ends.
        let budget = (33, 44);
        record.record(budget, 3600, Some(7 * MICRO), US_PER_SEC);
        let state = record
            .restore(budget, &quota, Some(1_000), 2 * US_PER_SEC)
            .unwrap();
        assert_eq!((state.tokens, state.last_us), (3 * MICRO, 1_000));
        assert_eq!(
            record.restore(budget, &quota, Some(1_000), 3600 * US_PER_SEC),
            None
        );
        // A spend not known: the bucket is full at the record's end, no sooner.
        let unknown = (55, 66);
        record.record(unknown, 90, None, 0);
        let state = record.restore(unknown, &quota, None, 0).unwrap();
        assert_eq!(state.tokens, 0);
        assert_eq!(state.last_us, 30 * US_PER_SEC, "in debt until 30 s");
        record.forget(unknown);
        assert_eq!(record.restore(unknown, &quota, None, 0), None);
    }

    #[test]
    fn merged_records_never_undercount_any_of_their_keys() {
        let record = EvictedRecord::in_memory().unwrap();
        let quota = quota_per_min(10);
        // Many keys, so cells are shared: every key still starts from at least its own.
        for k in 0..(WIDTH as u64 / 2) {
            record.record((k, k * 7), 60 + k % 20, Some((k % 10 + 1) * MICRO), 0);
        }
        for k in (0..(WIDTH as u64 / 2)).step_by(997) {
            let state = record.restore((k, k * 7), &quota, None, 0).unwrap();
            assert!(state.tokens <= 10 * MICRO - (k % 10 + 1) * MICRO, "key {k}");
        }
    }

    #[test]
    fn a_record_that_has_ended_is_replaced_not_merged() {
        // A table of its own: in a full one, the key's cells may all be shared with records
        // still running (the seed is random), which is the merge the test above is about.
        let record = EvictedRecord::in_memory().unwrap();
        let quota = quota_per_min(10);
        record.record((1, 7), 61, Some(5 * MICRO), 0);
        record.record((1, 7), 100, Some(MICRO), 70 * US_PER_SEC);
        let state = record
            .restore((1, 7), &quota, None, 70 * US_PER_SEC)
            .unwrap();
        assert!(state.tokens >= 8 * MICRO, "{state:?}");
    }
}
