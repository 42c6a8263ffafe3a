//! The embedded store's tests: bucket maths through the store, growth and eviction under
//! load, the lock-free probe against concurrent moves, and the state file.

use super::*;
use crate::limits::limiter::{Quota, MICRO, US_PER_SEC};

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
        window: None,
        on_store_error: None,
        probe: false,
    }
}

fn small(max: usize) -> MemoryStore {
    MemoryStore::new(MemoryStoreConfig {
        max_buckets: max,
        purge_interval_us: 0,
        ..MemoryStoreConfig::default()
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

/// A full store makes room for a new key: full-again entries are purged first; else the entry
/// whose loss gives away least is evicted (here: a bucket missing 1 token rather than one
/// missing 2). Nothing fails open.
#[test]
fn full_store_evicts_full_buckets_first_then_the_cheapest() {
    let store = small(2);
    let q = quota(1, 2);
    run(&store, 0, &[op("tb:r:a", q, Group::Enforce)]);
    run(&store, 0, &[op("tb:r:b", q, Group::Enforce)]);
    run(&store, 0, &[op("tb:r:b", q, Group::Enforce)]);
    // A third key is stored in a's place: a held 1 token spent, b 2.
    let r = run(&store, 0, &[op("tb:r:c", q, Group::Enforce)]);
    assert!(r[0].verdict.allowed && r[0].committed && !r[0].fail_open);
    assert!(store.peek(&BucketKey::of("tb:r:a")).is_none());
    assert_eq!(store.peek(&BucketKey::of("tb:r:b")).unwrap().tokens, 0);
    let stats = store.stats();
    assert_eq!(
        (stats.fail_open, stats.evictions, stats.entries),
        (0, 1, Some(2))
    );
    assert_eq!(stats.evicted.token_bucket, 1);
    assert_eq!(stats.evicted.forgiven_sum_micro, MICRO);
    // After 2 s b and c are full again: purged, and the new key is stored.
    let r = run(&store, 2 * US_PER_SEC, &[op("tb:r:d", q, Group::Enforce)]);
    assert!(r[0].committed);
    let stats = store.stats();
    assert_eq!((stats.evictions, stats.entries), (3, Some(1)));
    assert_eq!(stats.evicted.full_again, 2);
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

/// A flood of fresh keys against a full store never evicts a budget or bucket holding more
/// spend than the flood's own entries, however long it has been idle: each new key takes the
/// place of the cheapest sampled entry (the flood's, one token each), and nothing fails open.
#[test]
fn a_full_store_of_idle_unfull_buckets_evicts_the_cheapest_for_new_keys() {
    let store = small(4);
    // One token a month: a spent token takes 30 days to come back.
    let slow = Quota::new(300 * MICRO, MICRO, 30 * 86_400 * US_PER_SEC).unwrap();
    for k in ["a", "b", "c"] {
        run(
            &store,
            0,
            &[op(&format!("tb:slow:{k}"), slow, Group::Enforce)],
        );
    }
    // A monthly budget of 10 with 7 spent, its window ending in 20 days.
    let budget = BucketOp {
        key: BucketKey::of("tb:budget:tenant"),
        quota: Quota::new(10 * MICRO, 10 * MICRO, 30 * 86_400 * US_PER_SEC).unwrap(),
        cost: 7 * MICRO,
        group: Group::Enforce,
        window: Some(crate::limits::limiter::Window {
            id: 42,
            ends_in_us: 20 * 86_400 * US_PER_SEC,
        }),
        on_store_error: None,
        probe: false,
    };
    assert!(run(&store, 0, &[budget])[0].committed);
    // A week later, under a flood: nothing is full again, nothing is swept...
    let week = 7 * 86_400 * US_PER_SEC;
    assert_eq!(store.sweep(week), 0);
    for k in 0..50 {
        let r = run(
            &store,
            week,
            &[op(&format!("tb:slow:new{k}"), slow, Group::Enforce)],
        );
        assert!(r[0].verdict.allowed && r[0].committed && !r[0].fail_open);
    }
    // ...each new key took the place of a one-token entry.
    let stats = store.stats();
    assert_eq!(
        (stats.fail_open, stats.evictions, stats.entries),
        (0, 50, Some(4))
    );
    assert_eq!(stats.evicted.token_bucket, 50);
    assert_eq!(stats.evicted.budget, 0);
    assert_eq!(
        stats.evicted.forgiven_le[2], 50,
        "each gave away a token at most"
    );
    // The budget still holds its 3: a request for 4 is refused.
    let four = BucketOp {
        cost: 4 * MICRO,
        window: Some(crate::limits::limiter::Window {
            id: 42,
            ends_in_us: 13 * 86_400 * US_PER_SEC,
        }),
        ..budget
    };
    let r = run(&store, week, &[four]);
    assert!(!r[0].verdict.allowed);
    assert_eq!(r[0].verdict.available, 3 * MICRO);
    // Once its window has ended it is full again, and the sweep drops it.
    assert_eq!(store.sweep(20 * 86_400 * US_PER_SEC), 1);
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
    // Every key past the bound took an evicted entry's place.
    assert_eq!((stats.fail_open, stats.evictions), (0, 15_000));
    let guard = &epoch::pin();
    let held: usize = store
        .shards
        .iter()
        .map(|s| {
            MemoryStore::table(s, guard)
                .slots()
                .iter()
                .filter(|slot| !is_empty(slot.key()))
                .count()
        })
        .sum();
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
    assert_eq!(std::mem::size_of::<Slot>(), 40);
}

/// Lock-free probes racing inserts and backward-shift deletions lose nothing: 4 threads
/// drain 32 buckets (exactly their burst each) while another inserts throw-away buckets
/// and a third sweeps them out again and again, moving entries under the probes' feet.
#[test]
fn updates_stay_exact_while_entries_move() {
    let store = Arc::new(MemoryStore::new(MemoryStoreConfig {
        max_buckets: 500,
        purge_interval_us: 0,
        ..MemoryStoreConfig::default()
    }));
    assert_eq!(
        store.shards.len(),
        1,
        "one shard: every operation meets the others"
    );
    let slow = Quota::new(50 * MICRO, MICRO, 3_600 * US_PER_SEC).unwrap();
    // Full again 1 µs after a spend: evictable by a sweep at 100 s.
    let fast = Quota::new(MICRO, 1_000_000_000 * MICRO, US_PER_SEC).unwrap();
    let now = 10 * US_PER_SEC;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let admitted: Arc<Vec<AtomicUsize>> = Arc::new((0..32).map(|_| AtomicUsize::new(0)).collect());
    // Hammer until the sweeper has moved plenty of entries (bounded).
    let removed = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for t in 0..4 {
        let (store, admitted, removed) = (
            Arc::clone(&store),
            Arc::clone(&admitted),
            Arc::clone(&removed),
        );
        threads.push(std::thread::spawn(move || {
            let mut round = 0;
            while round < 200 || (removed.load(Ordering::Relaxed) < 5_000 && round < 200_000) {
                round += 1;
                for k in 0..32 {
                    let key = (k + t * 7 + round) % 32;
                    let r = run(
                        &store,
                        now,
                        &[op(&format!("tb:a:{key}"), slow, Group::Enforce)],
                    );
                    if r[0].committed {
                        admitted[key].fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    let churn = {
        let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                run(
                    &store,
                    now,
                    &[op(&format!("tb:b:{i}"), fast, Group::Enforce)],
                );
                i += 1;
            }
        })
    };
    let sweeper = {
        let (store, stop, removed) = (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&removed));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                removed.fetch_add(store.sweep(100 * US_PER_SEC), Ordering::Relaxed);
            }
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    sweeper.join().unwrap();
    assert!(
        removed.load(Ordering::Relaxed) >= 5_000,
        "the sweeper moved entries"
    );
    for (key, n) in admitted.iter().enumerate() {
        assert_eq!(n.load(Ordering::Relaxed), 50, "bucket {key}");
        let state = store.peek(&BucketKey::of(&format!("tb:a:{key}"))).unwrap();
        assert_eq!(state.tokens, 0);
    }
    // Every key once, and the count exact.
    let guard = &epoch::pin();
    let keys: Vec<(u64, u64)> = MemoryStore::table(&store.shards[0], guard)
        .slots()
        .iter()
        .map(Slot::key)
        .filter(|k| !is_empty(*k))
        .collect();
    let unique: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(unique.len(), keys.len(), "a key is never stored twice");
    assert_eq!(store.stats().entries, Some(keys.len() as u64));
}

/// Tables grow under updates: 4 threads drain 300 new buckets (burst 20 each, clock
/// frozen) in a store whose single shard starts at 8 slots, so it doubles six times while
/// other threads are probing and updating. Every bucket admits exactly its burst.
#[test]
fn growth_under_load_loses_nothing() {
    let store = Arc::new(small(400));
    let q = quota(1, 20);
    let admitted: Arc<Vec<AtomicUsize>> = Arc::new((0..300).map(|_| AtomicUsize::new(0)).collect());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (store, admitted) = (Arc::clone(&store), Arc::clone(&admitted));
            std::thread::spawn(move || {
                for round in 0..40 {
                    for k in 0..300 {
                        let key = (k * 7 + t * 13 + round) % 300;
                        let r = run(&store, 5, &[op(&format!("tb:g:{key}"), q, Group::Enforce)]);
                        if r[0].committed {
                            admitted[key].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for (key, n) in admitted.iter().enumerate() {
        assert_eq!(n.load(Ordering::Relaxed), 20, "bucket {key}");
    }
    assert_eq!(store.stats().entries, Some(300));
    assert!(store.allocated_bytes() >= 512 * 40, "the table grew");
}

/// A request with several buckets makes room in a full store as a single-bucket one does,
/// but never by evicting one of its own buckets: here the cheapest entry is the request's own
/// `a`, so `b` goes; `a` continues.
#[test]
fn a_full_store_makes_room_for_multi_bucket_requests_too() {
    let store = small(3);
    let q = quota(1, 4);
    run(&store, 0, &[op("tb:r:a", q, Group::Enforce)]);
    for _ in 0..2 {
        run(&store, 0, &[op("tb:r:b", q, Group::Enforce)]);
    }
    for _ in 0..3 {
        run(&store, 0, &[op("tb:r:c", q, Group::Enforce)]);
    }
    let pair = [
        op("tb:r:a", q, Group::Enforce),
        op("tb:y:new", q, Group::Enforce),
    ];
    let r = run(&store, 0, &pair);
    assert!(r.iter().all(|r| r.committed && !r.fail_open), "{r:?}");
    assert_eq!(r[0].verdict.remaining, 2 * MICRO, "a continued");
    assert!(store.peek(&BucketKey::of("tb:r:b")).is_none());
    assert!(store.peek(&BucketKey::of("tb:r:c")).is_some());
    let stats = store.stats();
    assert_eq!(
        (stats.fail_open, stats.evictions, stats.entries),
        (0, 1, Some(3))
    );
    // A refused request gives the room it took back: the bound stays exact.
    let heavy = BucketOp {
        cost: 3 * MICRO,
        ..op("tb:r:c", q, Group::Enforce)
    };
    let r = run(&store, 0, &[heavy, op("tb:z:new", q, Group::Enforce)]);
    assert!(!r[0].verdict.allowed && !r[1].committed);
    assert_eq!(store.stats().entries, Some(2));
}

/// Two mappings of one state file: what two processes of an upgrade share.
fn mapped(dir: &std::path::Path, config: MemoryStoreConfig, sole_owner: bool) -> MemoryStore {
    let opened = state_file::open(
        dir,
        MemoryStore::geometry(&config, true),
        sole_owner,
        crate::limits::clock::wall_unix_secs().max(0) as u64 * 1_000_000,
    )
    .unwrap();
    MemoryStore::in_state_file(config, Arc::new(opened.file), sole_owner, 0)
}

/// A reopened state file continues every bucket and budget exactly; held leases
/// (concurrency slots) are dropped by a sole owner, loop marks and breakers kept.
#[test]
fn a_reopened_state_file_continues_where_it_was() {
    use super::super::lease::{LeaseOp, LeaseResults};
    let dir = tempfile::tempdir().unwrap();
    let config = MemoryStoreConfig {
        max_buckets: 1000,
        purge_interval_us: 0,
        ..MemoryStoreConfig::default()
    };
    let q = quota(1, 10);
    let a = op("tb:r:a", q, Group::Enforce);
    let slot = LeaseOp {
        key: BucketKey::of("cc:c:a"),
        max: 1,
        group: Group::Enforce,
        ttl_us: 60 * US_PER_SEC,
        soft: false,
        held: true,
        mark: false,
        on_store_error: None,
    };
    let mark = LeaseOp {
        key: BucketKey::of("lp:l:a"),
        held: false,
        mark: true,
        ..slot
    };
    {
        let store = mapped(dir.path(), config, true);
        for _ in 0..7 {
            assert!(run(&store, 0, &[a])[0].committed);
        }
        let mut r = LeaseResults::new();
        store.leases().acquire(0, 1, &[slot, mark], &mut r);
        assert!(r.iter().all(|r| r.committed));
    }
    let store = mapped(dir.path(), config, true);
    assert_eq!(store.stats().entries, Some(1));
    assert_eq!(store.peek(&a.key).unwrap().tokens, 3 * MICRO);
    let r = run(&store, 0, &[a, a, a, a]);
    assert_eq!(r[0].verdict.available, 3 * MICRO);
    assert_eq!(
        store.leases().in_flight(&slot.key, 0),
        0,
        "slots not carried over"
    );
    assert_eq!(
        store.leases().in_flight(&mark.key, 0),
        1,
        "marks carried over"
    );
    // Not the sole owner (an upgrade): the slots of the running process stay.
    let mut r = LeaseResults::new();
    store.leases().acquire(0, 2, &[slot], &mut r);
    let other = mapped(dir.path(), config, false);
    assert_eq!(other.leases().in_flight(&slot.key, 0), 1);
    other.leases().acquire(0, 3, &[slot], &mut r);
    assert!(!r[0].allowed, "the slot is held through the other mapping");
    store.leases().release(2, &[slot.key]);
    assert_eq!(other.leases().in_flight(&slot.key, 0), 0);
}

/// A bucket lock left held by a process that died during an upgrade is released once this
/// process owns the directory, and the bucket is usable again.
#[test]
fn bucket_locks_a_dead_process_left_are_released() {
    let dir = tempfile::tempdir().unwrap();
    let config = MemoryStoreConfig {
        max_buckets: 100,
        purge_interval_us: 0,
        ..MemoryStoreConfig::default()
    };
    let store = mapped(dir.path(), config, true);
    let a = op("tb:r:a", quota(1, 10), Group::Enforce);
    assert!(run(&store, 0, &[a])[0].committed);
    let Region::File(file) = &store.region else {
        unreachable!("a mapped store")
    };
    let g = file.geometry();
    // SAFETY: the mapped store's own slot region.
    let slots = unsafe { file.region::<Slot>(g.slots_offset(), g.shard_count * g.shard_capacity) };
    let slot = slots.iter().find(|s| !is_empty(s.key())).unwrap();
    slot.lock();
    assert_eq!(MemoryStore::release_stuck_locks(file), 1);
    assert_eq!(MemoryStore::release_stuck_locks(file), 0);
    let r = run(&store, 0, &[a]);
    assert!(r[0].committed);
    assert_eq!(store.peek(&a.key).unwrap().tokens, 8 * MICRO);
}

/// Two mappings of one file (two processes during an upgrade) hammered from four threads
/// each: every bucket admits exactly its burst, inserts included, and the entry count is
/// exact.
#[test]
fn two_mappings_of_one_state_file_admit_exactly_the_burst() {
    let dir = tempfile::tempdir().unwrap();
    let config = MemoryStoreConfig {
        max_buckets: 256,
        purge_interval_us: 0,
        ..MemoryStoreConfig::default()
    };
    let first = Arc::new(mapped(dir.path(), config, true));
    let second = Arc::new(mapped(dir.path(), config, false));
    let q = Quota::new(25 * MICRO, MICRO, 3_600 * US_PER_SEC).unwrap();
    let admitted: Arc<Vec<AtomicU64>> = Arc::new((0..40).map(|_| AtomicU64::new(0)).collect());
    std::thread::scope(|scope| {
        for t in 0..8 {
            let store = if t % 2 == 0 { &first } else { &second };
            let admitted = Arc::clone(&admitted);
            scope.spawn(move || {
                for round in 0..60 {
                    for k in 0..40 {
                        let key = (k + t + round) % 40;
                        // Pairs: all-or-nothing across two buckets, through both mappings.
                        let ops = [
                            op(&format!("tb:p:{key}"), q, Group::Enforce),
                            op(&format!("tb:q:{key}"), q, Group::Enforce),
                        ];
                        let r = run(store, 0, if round % 3 == 0 { &ops[..1] } else { &ops });
                        if r[0].committed {
                            admitted[key].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    for (key, n) in admitted.iter().enumerate() {
        assert_eq!(n.load(Ordering::Relaxed), 25, "bucket {key}");
    }
    assert_eq!(first.stats().entries, Some(80));
    assert_eq!(second.stats().entries, Some(80));
}

proptest::proptest! {
    /// The spend kept in the meta word is monotonic and within 2^-24 of the amount, below.
    #[test]
    fn kept_spend_is_close_and_ordered(a in proptest::num::u64::ANY, b in proptest::num::u64::ANY) {
        let (lo, hi) = (a.min(b), a.max(b));
        proptest::prop_assert!(encode_spent(lo) <= encode_spent(hi));
        let kept = decode_spent(encode_spent(hi));
        proptest::prop_assert!(encode_spent(hi) <= SPENT_MASK);
        if hi < 1 << 56 {
            proptest::prop_assert!(kept <= hi && hi - kept <= hi >> 24, "{hi} kept as {kept}");
        }
    }
}

#[test]
fn kept_spend_is_exact_for_small_amounts() {
    for micro in [0, 1, MICRO, 33 * MICRO, (1 << 25) - 1, 1 << 25] {
        assert_eq!(decode_spent(encode_spent(micro)), micro);
    }
}

/// What forgetting an entry gives away: a token bucket's spend shrinks as it refills (to
/// nothing at its full-again second), a budget's stays until its window ends.
#[test]
fn giveaway_follows_refill_for_buckets_and_stays_for_budgets() {
    let s = US_PER_SEC;
    // 4 tokens spent at 10 s, full again at 14 s.
    let bucket = pack_meta(
        14,
        Spend {
            micro: 4 * MICRO,
            budget: false,
        },
    );
    assert_eq!(giveaway(bucket, 10 * s, 10 * s), 4 * MICRO);
    assert_eq!(giveaway(bucket, 10 * s, 11 * s), 3 * MICRO);
    assert_eq!(giveaway(bucket, 10 * s, 13 * s), MICRO);
    assert_eq!(giveaway(bucket, 10 * s, 14 * s), 0);
    // In debt until 12 s: all of it until then.
    assert_eq!(giveaway(bucket, 12 * s, 11 * s), 4 * MICRO);
    // 7 spent of a budget whose window ends at 100 s.
    let budget = pack_meta(
        100,
        Spend {
            micro: 7 * MICRO,
            budget: true,
        },
    );
    assert_eq!(giveaway(budget, 42, 10 * s), 7 * MICRO);
    assert_eq!(giveaway(budget, 42, 99 * s), 7 * MICRO);
    assert_eq!(giveaway(budget, 42, 100 * s), 0);
    // The lock and moved bits do not count.
    assert_eq!(giveaway(budget | LOCKED | MOVED, 42, 99 * s), 7 * MICRO);
}

/// The sampling, with its positions given: from each start, the next live entry not sampled
/// yet; the cheapest of those found goes, never an excluded one; a full-again entry at once.
#[test]
fn the_victim_is_the_cheapest_of_the_sampled_entries() {
    let store = small(16);
    let q = quota(1, 10);
    // Key k spends k + 1 tokens (all at 0, monthly refill would be the same: spend ranks).
    let keys: Vec<BucketKey> = (0..6)
        .map(|k| BucketKey::of(&format!("tb:s:{k}")))
        .collect();
    for (k, key) in keys.iter().enumerate() {
        let spend = BucketOp {
            cost: (k as u64 + 1) * MICRO,
            ..op("x", q, Group::Enforce)
        };
        run(&store, 0, &[BucketOp { key: *key, ..spend }]);
    }
    let guard = &epoch::pin();
    let table = MemoryStore::table(&store.shards[0], guard);
    let index_of = |key: &BucketKey| table.find(stored(key)).unwrap();
    let at = |k: usize| index_of(&keys[k]);
    // Sampling exactly where keys 3, 5 and 1 sit: key 1 (2 tokens) goes.
    let (i, cost) = choose_victim(table, [at(3), at(5), at(1)], 0, &[]).unwrap();
    assert_eq!((i, cost), (at(1), 2 * MICRO));
    // Key 1 excluded (the request's own): never it; the third walk goes on to another entry,
    // so at most key 3's 4 tokens are given away.
    let (i, cost) = choose_victim(table, [at(3), at(5), at(1)], 0, &[stored(&keys[1])]).unwrap();
    assert_ne!(i, at(1));
    assert!(cost <= 4 * MICRO && cost != 2 * MICRO, "{cost}");
    // Two starts on one entry sample two distinct entries: the second walks on.
    let (_, cost) = choose_victim(table, [at(5), at(5)], 0, &[]).unwrap();
    assert!(cost < 6 * MICRO, "a second entry was sampled");
    // As many starts as samples on one entry, key 5 excluded: the five others are all sampled,
    // and key 0 (1 token) goes.
    let (i, cost) =
        choose_victim(table, [at(4); EVICTION_SAMPLES], 0, &[stored(&keys[5])]).unwrap();
    assert_eq!((i, cost), (at(0), MICRO));
    // At 10 s everything is full again: the first sampled goes, giving nothing away.
    assert_eq!(
        choose_victim(table, [at(2)], 10 * US_PER_SEC, &[]),
        Some((at(2), 0))
    );
    // Nothing to sample.
    let all: Vec<(u64, u64)> = keys.iter().map(stored).collect();
    assert_eq!(choose_victim(table, [0, 1, 2], 0, &all), None);
}

/// An attacker's flood of made-up keys (each a one-unit monthly budget entry and a one-token
/// bucket) through a store of 200: a tenant's heavily spent budget is never the one evicted,
/// a new client is limited exactly (burst 10: 10 admitted, then refused) during the flood and
/// after it, and nothing fails open. In process memory and in a state file.
#[test]
fn a_key_flood_evicts_the_flood_and_limits_new_clients_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = MemoryStoreConfig {
        max_buckets: 200,
        purge_interval_us: 1_000_000,
        ..MemoryStoreConfig::default()
    };
    for store in [MemoryStore::new(config), mapped(dir.path(), config, true)] {
        let month = 30 * 86_400 * US_PER_SEC;
        let window = crate::limits::limiter::Window {
            id: 1_700_000_000,
            ends_in_us: month,
        };
        let budget = |who: &str, cost: u64| BucketOp {
            key: BucketKey::of(&format!("tb:budget:{who}")),
            quota: Quota::new(20 * MICRO, 20 * MICRO, month).unwrap(),
            cost: cost * MICRO,
            group: Group::Enforce,
            window: Some(window),
            on_store_error: None,
            probe: false,
        };
        // Burst 10, one token a minute.
        let per_ip = Quota::new(10 * MICRO, MICRO, 60 * US_PER_SEC).unwrap();
        assert!(run(&store, 0, &[budget("tenant", 14)])[0].committed);
        // Every request a microsecond after the one before.
        let clock = std::cell::Cell::new(US_PER_SEC);
        let tick = || {
            clock.set(clock.get() + 1);
            clock.get()
        };
        let flood = |store: &MemoryStore, n: usize, from: usize| {
            for k in from..from + n {
                let r = run(
                    store,
                    tick(),
                    &[
                        op(&format!("tb:ip:attacker{k}"), per_ip, Group::Enforce),
                        budget(&format!("attacker{k}"), 1),
                    ],
                );
                assert!(r.iter().all(|r| r.committed && !r.fail_open));
            }
        };
        for round in 0..10 {
            flood(&store, 500, round * 500);
            // A new client amid the flood: exactly its burst.
            let client = op(&format!("tb:ip:client{round}"), per_ip, Group::Enforce);
            let admitted = (0..11)
                .filter(|i| {
                    if i % 3 == 0 {
                        flood(&store, 20, 100_000 + round * 1000 + *i * 20);
                    }
                    run(&store, tick(), &[client])[0].committed
                })
                .count();
            assert_eq!(admitted, 10, "round {round}");
            clock.set(clock.get() + US_PER_SEC);
        }
        let now = clock.get();
        let stats = store.stats();
        assert_eq!(stats.fail_open, 0);
        assert_eq!(stats.entries, Some(200));
        assert_eq!(
            stats.evicted.budget + stats.evicted.token_bucket,
            stats.evictions - stats.evicted.full_again
        );
        // No eviction gave away more than a token.
        assert_eq!(stats.evicted.forgiven_le[2], stats.evicted.forgiven_count);
        assert!(stats.evicted.forgiven_count > 10_000, "{stats:?}");
        // The tenant's budget kept its 14 spent: 6 left.
        let r = run(&store, now, &[budget("tenant", 7)]);
        assert!(!r[0].verdict.allowed);
        assert_eq!(r[0].verdict.available, 6 * MICRO);
    }
}

/// A request over several buckets in a full store keeps its own buckets, full again or not:
/// the purge that makes room for its new keys removes only others' full-again entries, so
/// each of its buckets is found or has a room, and nothing fails open.
#[test]
fn a_multi_bucket_request_never_purges_its_own_buckets() {
    let store = small(3);
    let q = quota(1, 2);
    for key in ["tb:r:a", "tb:r:b", "tb:r:c"] {
        run(&store, 0, &[op(key, q, Group::Enforce)]);
    }
    // At 1 s all three are full again; the request needs a and two new keys.
    let r = run(
        &store,
        US_PER_SEC,
        &[
            op("tb:r:a", q, Group::Enforce),
            op("tb:x:new", q, Group::Enforce),
            op("tb:y:new", q, Group::Enforce),
        ],
    );
    assert!(
        r.iter()
            .all(|r| r.verdict.allowed && r.committed && !r.fail_open),
        "{r:?}"
    );
    assert!(r.iter().all(|r| r.verdict.remaining == MICRO), "{r:?}");
    for kept in ["tb:r:a", "tb:x:new", "tb:y:new"] {
        assert_eq!(store.peek(&BucketKey::of(kept)).unwrap().tokens, MICRO);
    }
    assert!(store.peek(&BucketKey::of("tb:r:b")).is_none());
    assert!(store.peek(&BucketKey::of("tb:r:c")).is_none());
    let stats = store.stats();
    assert_eq!(
        (stats.fail_open, stats.evictions, stats.entries),
        (0, 2, Some(3))
    );
    assert_eq!(stats.evicted.full_again, 2);
}

/// A zero-cost look at a key the store does not hold is answered from a full bucket and
/// stores nothing: in a full store it evicts nothing, alone or beside a charged bucket.
#[test]
fn a_zero_cost_look_at_an_absent_key_evicts_nothing() {
    let store = small(2);
    let q = quota(1, 2);
    run(&store, 0, &[op("tb:r:a", q, Group::Enforce)]);
    run(&store, 0, &[op("tb:r:b", q, Group::Enforce)]);
    let look = BucketOp {
        cost: 0,
        ..op("tb:r:look", q, Group::Enforce)
    };
    let r = run(&store, 0, &[look]);
    assert!(r[0].verdict.allowed && r[0].committed && !r[0].fail_open);
    assert_eq!(r[0].verdict.remaining, 2 * MICRO);
    let r = run(&store, 0, &[look, op("tb:r:a", q, Group::Enforce)]);
    assert!(
        r.iter()
            .all(|r| r.verdict.allowed && r.committed && !r.fail_open),
        "{r:?}"
    );
    assert_eq!(r[0].verdict.remaining, 2 * MICRO);
    assert_eq!(r[1].verdict.remaining, 0);
    assert!(store.peek(&look.key).is_none());
    assert_eq!(store.peek(&BucketKey::of("tb:r:b")).unwrap().tokens, MICRO);
    let stats = store.stats();
    assert_eq!(
        (stats.evictions, stats.fail_open, stats.entries),
        (0, 0, Some(2))
    );
    assert_eq!(stats.evicted, EvictionStats::default());
}

/// Entries that give away the same whole units rank by age: the token bucket refilled longest
/// ago goes before a client's that refills faster but was used just now, and a budget (which
/// keeps no time of its last request) before either. Cheaper units still go first, and an
/// entry of unknown spend last.
#[test]
fn equally_cheap_entries_go_least_recently_used_first() {
    let store = small(16);
    let s = US_PER_SEC;
    // A stale flood entry: one token of a bucket refilling a token per 1 000 s, spent at 1 s.
    let stale = Quota::new(10 * MICRO, MICRO, 1_000 * s).unwrap();
    // A client's: one token of a bucket refilling a token per 10 s, spent at 5 s.
    let quick = Quota::new(10 * MICRO, MICRO, 10 * s).unwrap();
    let month = 30 * 86_400 * s;
    run(&store, s, &[op("tb:ip:stale", stale, Group::Enforce)]);
    run(&store, 5 * s, &[op("tb:ip:client", quick, Group::Enforce)]);
    let budget = BucketOp {
        key: BucketKey::of("tb:budget:flood"),
        quota: Quota::new(20 * MICRO, 20 * MICRO, month).unwrap(),
        cost: MICRO,
        group: Group::Enforce,
        window: Some(crate::limits::limiter::Window {
            id: 1_700_000_000,
            ends_in_us: month,
        }),
        on_store_error: None,
        probe: false,
    };
    run(&store, 5 * s, &[budget]);
    let guard = &epoch::pin();
    let table = MemoryStore::table(&store.shards[0], guard);
    let at = |key: &str| table.find(stored(&BucketKey::of(key))).unwrap();
    let now = 6 * s;
    // At 6 s the client's entry holds 0.9 token, the stale one 0.995, the budget 1: a ranking
    // by micro-tokens alone evicted the client.
    let (i, cost) =
        choose_victim(table, [at("tb:ip:client"), at("tb:ip:stale")], now, &[]).unwrap();
    assert_eq!(i, at("tb:ip:stale"));
    assert!(cost > 990_000 && cost < MICRO, "{cost}");
    let (i, _) = choose_victim(
        table,
        [at("tb:ip:client"), at("tb:ip:stale"), at("tb:budget:flood")],
        now,
        &[],
    )
    .unwrap();
    assert_eq!(i, at("tb:budget:flood"));
    // Two tokens spent rank above one, however old.
    run(&store, 5 * s, &[op("tb:ip:stale", stale, Group::Enforce)]);
    let (i, _) = choose_victim(table, [at("tb:ip:stale"), at("tb:ip:client")], now, &[]).unwrap();
    assert_eq!(i, at("tb:ip:client"));
    // An entry an older build wrote (spend unknown) ranks above every known spend.
    let slot = table.slot(at("tb:ip:client"));
    let meta = slot.meta.load(Ordering::Relaxed);
    slot.meta.store(legacy_as_unknown(meta), Ordering::Relaxed);
    let (i, _) = choose_victim(table, [at("tb:ip:client"), at("tb:ip:stale")], now, &[]).unwrap();
    assert_eq!(i, at("tb:ip:stale"));
    assert_eq!(
        choose_victim(
            table,
            [at("tb:ip:client")],
            now,
            &[at_key("tb:ip:stale"), at_key("tb:budget:flood")]
        ),
        Some((at("tb:ip:client"), UNKNOWN_SPEND))
    );
}

fn at_key(key: &str) -> (u64, u64) {
    stored(&BucketKey::of(key))
}

/// A state file an older build wrote keeps, in each slot's low half, the second the bucket was
/// last touched, not its spend. Opened by this build, shared with the older process (its slots
/// not rewritten) and then as the sole owner (migrated: spend unknown until the next
/// request), it never lets a flood evict the tenant's drained budget: entries of unknown spend
/// rank above the flood's. Read as a spend, that second (5) made the budget look the cheapest
/// entry of the store.
#[test]
fn an_older_builds_state_file_keeps_its_drained_budget_through_a_flood() {
    let dir = tempfile::tempdir().unwrap();
    let config = MemoryStoreConfig {
        max_buckets: 64,
        purge_interval_us: 1_000_000,
        ..MemoryStoreConfig::default()
    };
    let s = US_PER_SEC;
    let month = 30 * 86_400 * s;
    let budget = |cost: u64| BucketOp {
        key: BucketKey::of("tb:budget:tenant"),
        quota: Quota::new(20 * MICRO, 20 * MICRO, month).unwrap(),
        cost: cost * MICRO,
        group: Group::Enforce,
        window: Some(crate::limits::limiter::Window {
            id: 1_700_000_000,
            ends_in_us: month,
        }),
        on_store_error: None,
        probe: false,
    };
    let per_ip = Quota::new(10 * MICRO, MICRO, 60 * s).unwrap();
    {
        // What the older build left at 5 s: the tenant's budget drained and 40 clients'
        // buckets, each slot's low half the second it was last touched, no slot format.
        let store = mapped(dir.path(), config, true);
        assert!(run(&store, 5 * s, &[budget(20)])[0].committed);
        for k in 0..40 {
            run(
                &store,
                5 * s,
                &[op(&format!("tb:ip:old{k}"), per_ip, Group::Enforce)],
            );
        }
        let guard = &epoch::pin();
        for slot in MemoryStore::table(&store.shards[0], guard).slots() {
            if !is_empty(slot.key()) {
                let meta = slot.meta.load(Ordering::Relaxed);
                slot.meta
                    .store((meta_full_at_s(meta) << 32) | 5, Ordering::Relaxed);
            }
        }
        let Region::File(file) = &store.region else {
            panic!("a state file")
        };
        file.header().slot_format.store(0, Ordering::Relaxed);
    }
    let drained = |store: &MemoryStore, now: u64| {
        let r = run(store, now, &[budget(1)]);
        assert!(!r[0].verdict.allowed, "the budget was reset: {r:?}");
        assert_eq!(r[0].verdict.available, 0);
        let stats = store.stats();
        assert_eq!((stats.evicted.budget, stats.fail_open), (0, 0), "{stats:?}");
    };
    let flood = |store: &MemoryStore, now: u64, from: usize| {
        for k in from..from + 300 {
            let r = run(
                store,
                now + k as u64,
                &[op(&format!("tb:ip:new{k}"), per_ip, Group::Enforce)],
            );
            assert!(r[0].committed && !r[0].fail_open);
        }
    };
    // Shared with the older process: its slots are left as they are, and read as unknown.
    let shared = mapped(dir.path(), config, false);
    flood(&shared, 6 * s, 0);
    drained(&shared, 7 * s);
    let Region::File(file) = &shared.region else {
        panic!("a state file")
    };
    assert_eq!(file.header().slot_format.load(Ordering::Relaxed), 0);
    drop(shared);
    // The sole owner: the older slots are migrated and the file marked.
    let sole = mapped(dir.path(), config, true);
    let Region::File(file) = &sole.region else {
        panic!("a state file")
    };
    assert_eq!(
        file.header().slot_format.load(Ordering::Relaxed),
        state_file::SLOT_FORMAT_SPEND
    );
    let guard = &epoch::pin();
    let table = MemoryStore::table(&sole.shards[0], guard);
    let tenant = table.slot(table.find(at_key("tb:budget:tenant")).unwrap());
    let meta = tenant.meta.load(Ordering::Relaxed);
    assert_eq!(
        meta & !(LOCKED | MOVED),
        legacy_as_unknown(meta),
        "migrated"
    );
    assert_eq!(giveaway(meta, 0, 8 * s), UNKNOWN_SPEND);
    flood(&sole, 8 * s, 1_000);
    drained(&sole, 9 * s);
    assert_eq!(sole.stats().entries, Some(64));
}

/// A flood shape of the eviction-gaming table: requests per made-up key, each one's cost,
/// whether the rule is a budget, whether each request also carries a per-address bucket, and
/// how long the real key pauses between its drains.
#[derive(Debug, Clone, Copy)]
struct Flood {
    per_key: u64,
    cost: u64,
    budget: bool,
    beside_ip: bool,
    pause_s: u64,
}

/// One minute of the table at small scale: the attacker's real key (10 a minute, burst 10; or a
/// budget of 10) drains (12 tries at once), pauses `pause_s` and drains again, while made-up
/// keys of the same rule arrive at 1 500 a second against a store of 1 000. Returns how many of
/// the real key's requests were admitted.
fn replay(store: &MemoryStore, flood: Flood) -> usize {
    let minute = Quota::new(10 * MICRO, 10 * MICRO, 60 * US_PER_SEC).unwrap();
    let day = 86_400 * US_PER_SEC;
    let rule = |who: &str, cost: u64, now: u64| BucketOp {
        key: BucketKey::of(&format!("tb:rule:{who}")),
        quota: minute,
        cost: cost * MICRO,
        group: Group::Enforce,
        window: flood.budget.then_some(crate::limits::limiter::Window {
            id: 1_000,
            ends_in_us: day - now,
        }),
        on_store_error: None,
        probe: false,
    };
    let request = |who: &str, cost: u64, now: u64| -> bool {
        let own = rule(who, cost, now);
        let results = if flood.beside_ip {
            let ip = op(&format!("tb:per-ip:{who}"), minute, Group::Enforce);
            run(store, now, &[own, ip])
        } else {
            run(store, now, &[own])
        };
        results.iter().all(|r| r.committed && !r.fail_open)
    };
    let tick_us = 10_000;
    let (mut admitted, mut fake, mut sent) = (0, 0u64, 0u64);
    for t in 0..6_000u64 {
        let now = t * tick_us;
        if now % (flood.pause_s * US_PER_SEC) == 0 {
            admitted += (0..12).filter(|_| request("real", 1, now)).count();
        }
        for _ in 0..15 {
            request(&format!("fake{fake}"), flood.cost, now);
            sent += 1;
            if sent == flood.per_key {
                (fake, sent) = (fake + 1, 0);
            }
        }
    }
    admitted
}

/// The eviction-gaming table, every row: whatever the made-up keys spend, the real key is
/// admitted at most its limit in the minute (20 for the bucket: its burst and a minute's
/// refill; 10 for the budget), plus 10 %. Before the record of evicted spend the same replay
/// admitted up to 5 times the limit. In process memory and in a state file.
#[test]
fn no_flood_shape_resets_the_real_keys_limit() {
    let rows = [
        (1, 1, false, false, 5),
        (10, 1, false, false, 5),
        (1, 10, false, false, 5),
        (1, 10, false, false, 1),
        (10, 1, true, false, 5),
        (1, 10, true, false, 5),
        (1, 10, true, false, 1),
        (10, 1, true, true, 5),
    ];
    let config = MemoryStoreConfig {
        max_buckets: 1000,
        ..MemoryStoreConfig::default()
    };
    for (per_key, cost, budget, beside_ip, pause_s) in rows {
        let flood = Flood {
            per_key,
            cost,
            budget,
            beside_ip,
            pause_s,
        };
        let limit = if budget { 10 } else { 20 };
        let dir = tempfile::tempdir().unwrap();
        for store in [MemoryStore::new(config), mapped(dir.path(), config, true)] {
            let admitted = replay(&store, flood);
            let stats = store.stats();
            eprintln!(
                "{flood:?} state file {}: {admitted} admitted (limit {limit}), {} evictions",
                store.persistent(),
                stats.evictions
            );
            assert!(
                admitted * 10 <= limit * 11,
                "{flood:?}: {admitted} admitted, limit {limit}"
            );
            assert!(admitted >= limit / 2, "{flood:?}: only {admitted} admitted");
            assert!(stats.evictions > 5_000, "{flood:?}: {stats:?}");
            assert_eq!(stats.fail_open, 0);
        }
    }
}

/// A key evicted drained comes back drained: it starts from what it held, refilled since as
/// its bucket would have been, not full; a budget keeps its spend until its window ends. A key
/// never evicted starts full. The record survives reopening the state file.
#[test]
fn an_evicted_key_starts_from_what_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let config = MemoryStoreConfig {
        max_buckets: 4,
        purge_interval_us: 1_000_000,
        ..MemoryStoreConfig::default()
    };
    let minute = Quota::new(10 * MICRO, 10 * MICRO, 60 * US_PER_SEC).unwrap();
    let victim = BucketOp {
        cost: 10 * MICRO,
        ..op("tb:r:victim", minute, Group::Enforce)
    };
    for persistent in [false, true] {
        let store = if persistent {
            mapped(dir.path(), config, true)
        } else {
            MemoryStore::new(config)
        };
        assert!(run(&store, 0, &[victim])[0].committed);
        // Four drained keys evict it (it is the oldest of equal units).
        for k in 0..4 {
            let fake = BucketOp {
                cost: 10 * MICRO,
                ..op(&format!("tb:r:fake{k}"), minute, Group::Enforce)
            };
            assert!(run(&store, US_PER_SEC, &[fake])[0].committed);
        }
        assert!(store.peek(&victim.key).is_none(), "evicted");
        if persistent {
            drop(store);
            let store = mapped(dir.path(), config, true);
            // 30 s after it drained: 5 tokens back, as if it had never been evicted.
            let one = op("tb:r:victim", minute, Group::Enforce);
            let r = run(&store, 30 * US_PER_SEC, &[one]);
            assert_eq!(r[0].verdict.available, 5 * MICRO, "after a restart");
            continue;
        }
        let one = op("tb:r:victim", minute, Group::Enforce);
        let r = run(&store, 30 * US_PER_SEC, &[one]);
        assert_eq!(r[0].verdict.available, 5 * MICRO);
        // A key never seen starts full.
        let fresh = op("tb:r:fresh", minute, Group::Enforce);
        assert_eq!(
            run(&store, 30 * US_PER_SEC, &[fresh])[0].verdict.available,
            10 * MICRO
        );
        // An operator's reset forgets the record too: the key starts full.
        assert!(store.remove(&victim.key));
        let r = run(&store, 30 * US_PER_SEC, &[one]);
        assert_eq!(r[0].verdict.available, 10 * MICRO);
    }
}
