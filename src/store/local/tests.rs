//! Local mode's maths: the share, where a bucket starts, the bound over an outage, the modes,
//! and the journal.

use super::*;
use crate::limits::limiter::{MICRO, US_PER_SEC};

const T0: u64 = 1_800_000_000 * US_PER_SEC;

fn config(journal: Option<PathBuf>) -> LocalConfig {
    LocalConfig {
        default_mode: OnStoreError::Local,
        max_buckets: std::num::NonZeroUsize::new(1000).unwrap(),
        gateway_id: "gw-a".into(),
        journal,
    }
}

/// 20 tokens, 2 a second.
fn quota() -> Quota {
    Quota::new(20 * MICRO, 2 * MICRO, US_PER_SEC).unwrap()
}

fn op(key: &str, mode: Option<OnStoreError>) -> BucketOp {
    BucketOp {
        key: BucketKey::of(key),
        quota: quota(),
        cost: MICRO,
        group: Group::Enforce,
        window: None,
        on_store_error: mode,
        probe: false,
    }
}

/// How many of `n` requests at `now` the local mode admits.
fn admitted(local: &LocalMode, op: &BucketOp, now_us: u64, n: usize) -> usize {
    (0..n)
        .filter(|_| {
            let mut results = OpResults::new();
            local.decide(now_us, std::slice::from_ref(op), &mut results);
            results[0].verdict.allowed
        })
        .count()
}

#[test]
fn a_share_divides_burst_and_rate_and_never_falls_below_one_request() {
    let share = share_quota(&quota(), 3, MICRO);
    assert_eq!(share.burst(), 6_666_666);
    // 2 tokens a second over three gateways: 2 per 3 seconds.
    assert_eq!(
        (share.refill(), share.period_us()),
        (2 * MICRO, 3 * US_PER_SEC)
    );
    let one = Quota::new(MICRO, MICRO, US_PER_SEC).unwrap();
    assert_eq!(share_quota(&one, 3, MICRO).burst(), MICRO);
    assert_eq!(share_quota(&quota(), 1, MICRO), quota());
    assert_eq!(share_slots(10, 3), 3);
    assert_eq!(share_slots(2, 3), 1);
    assert_eq!(share_slots(0, 3), 0);
}

#[test]
fn a_bucket_never_seen_starts_from_a_full_share() {
    let local = LocalMode::new(config(None));
    local.set_gateways(2);
    assert_eq!(admitted(&local, &op("k", None), T0, 15), 10);
}

/// The store said the key was drained; over 10 s at five times its rate, one gateway of three
/// admits its share of the refill: 2/3 a second, 6 in 10 s (6.67 rounded down), never more.
#[test]
fn a_drained_bucket_starts_drained_and_refills_its_share_only() {
    let local = LocalMode::new(config(None));
    local.set_gateways(3);
    let o = op("drained", None);
    // The store's last answer: committed, nothing left.
    let drained = OpResult {
        verdict: Verdict {
            allowed: true,
            available: MICRO,
            remaining: 0,
            next: BucketState {
                tokens: 0,
                last_us: T0,
            },
            retry_after_secs: 0,
            full_in_us: 10 * US_PER_SEC,
        },
        committed: true,
        fail_open: false,
        away: None,
    };
    let answered: OpResults = smallvec::smallvec![drained];
    local.remember(T0, &[o], &answered);
    let mut total = 0;
    for tenth in 1..=100u64 {
        // 10 requests a second (5x the rate), one every 100 ms.
        total += admitted(&local, &o, T0 + tenth * US_PER_SEC / 10, 1);
    }
    assert_eq!(total, 6);
}

#[test]
fn a_seen_bucket_starts_from_its_share_of_what_the_store_held() {
    let local = LocalMode::new(config(None));
    local.set_gateways(2);
    let o = op("half", None);
    // The store held 12 tokens after this request: a share of 6.
    let answered: OpResults = smallvec::smallvec![OpResult {
        verdict: Verdict {
            allowed: true,
            available: 13 * MICRO,
            remaining: 12 * MICRO,
            next: BucketState {
                tokens: 12 * MICRO,
                last_us: T0,
            },
            retry_after_secs: 0,
            full_in_us: 0,
        },
        committed: true,
        fail_open: false,
        away: None,
    }];
    local.remember(T0, &[o], &answered);
    assert_eq!(admitted(&local, &o, T0, 10), 6);
}

#[test]
fn open_admits_unspent_and_closed_refuses_without_spending_the_others() {
    let local = LocalMode::new(config(None));
    let mut results = OpResults::new();
    local.decide(T0, &[op("o", Some(OnStoreError::Open))], &mut results);
    assert!(results[0].verdict.allowed);
    assert!(results[0].fail_open);
    assert_eq!(results[0].away, Some(OnStoreError::Open));
    assert_eq!(local.pending_charges(), 0);

    let ops = [op("c", Some(OnStoreError::Closed)), op("l", None)];
    local.decide(T0, &ops, &mut results);
    assert!(!results[0].verdict.allowed);
    assert_eq!(results[0].away, Some(OnStoreError::Closed));
    assert_eq!(results[0].verdict.retry_after_secs, CLOSED_RETRY_SECS);
    assert!(!results[1].committed);
    assert_eq!(local.peek(&BucketKey::of("l")), None);
    assert_eq!(local.pending_charges(), 0);
}

#[test]
fn local_spend_is_journaled_sent_once_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    let local = LocalMode::new(config(Some(path.clone())));
    let o = op("spent", None);
    assert_eq!(admitted(&local, &o, T0, 3), 3);
    local.persist();
    drop(local);

    // Restarted: the spend is still owed, and sent as one batch under one id.
    let local = LocalMode::new(config(Some(path.clone())));
    assert_eq!(local.pending_charges(), 1);
    let batch = local.batch_to_send(T0 + 1).unwrap();
    assert_eq!(batch.id, format!("gw-a:{}", T0 + 1));
    assert_eq!(batch.charges.len(), 1);
    assert_eq!(batch.charges[0].delta, 3 * MICRO as i64);
    assert_eq!(batch.charges[0].burst, 20 * MICRO);
    // Not confirmed (a crash mid-send): the same batch, same id, again.
    drop(local);
    let local = LocalMode::new(config(Some(path.clone())));
    assert_eq!(local.batch_to_send(T0 + 2), Some(batch.clone()));
    local.batch_sent(
        &batch.id,
        WriteBackOutcome {
            applied: 1,
            duplicate: 0,
        },
    );
    assert_eq!(local.batch_to_send(T0 + 3), None);
    assert_eq!(local.stats().write_backs, [1, 0, 0]);
    drop(local);
    assert_eq!(LocalMode::new(config(Some(path))).pending_charges(), 0);
}

#[test]
fn entering_and_leaving_local_mode_is_reported_once() {
    let local = LocalMode::new(config(None));
    assert!(local.enter(T0, "redis://:secret@127.0.0.1:6379", "timeout"));
    assert!(!local.enter(T0 + 1, "redis://127.0.0.1:6379", "timeout"));
    assert!(local.is_local());
    assert_eq!(local.local_since_us(), Some(T0));
    // The first try at the store comes after the first wait, and only one caller gets it.
    assert!(!local.probe_due(T0 + PROBE_FIRST_US - 1));
    assert!(local.probe_due(T0 + PROBE_FIRST_US));
    assert!(!local.probe_due(T0 + PROBE_FIRST_US));
    local.leave(
        T0 + US_PER_SEC,
        "redis://127.0.0.1:6379",
        WriteBackOutcome::default(),
    );
    assert!(!local.is_local());
    assert_eq!(local.local_since_us(), None);
}

/// A budget (a window, no refill) the store says is 12 spent of 20 gives each of two gateways
/// 4 for the rest of the window, even when the mirror had no entry of that window yet.
#[test]
fn a_budget_starts_from_its_share_of_what_is_left_in_its_window() {
    use crate::limits::limiter::Window;
    let local = LocalMode::new(config(None));
    local.set_gateways(2);
    let o = BucketOp {
        window: Some(Window {
            id: 1_800_000_000,
            ends_in_us: 3_600 * US_PER_SEC,
        }),
        ..op("budget", None)
    };
    let answered: OpResults = smallvec::smallvec![OpResult {
        verdict: Verdict {
            allowed: true,
            available: 9 * MICRO,
            remaining: 8 * MICRO,
            next: BucketState {
                tokens: 8 * MICRO,
                last_us: 1_800_000_000,
            },
            retry_after_secs: 0,
            full_in_us: 0,
        },
        committed: true,
        fail_open: false,
        away: None,
    }];
    local.remember(T0, &[o], &answered);
    assert_eq!(admitted(&local, &o, T0 + 10 * US_PER_SEC, 10), 4);
}

#[test]
fn n_is_kept_in_the_journal_for_a_restart_during_an_outage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(JOURNAL_FILE);
    let local = LocalMode::new(config(Some(path.clone())));
    local.set_gateways(3);
    local.persist();
    drop(local);
    assert_eq!(LocalMode::new(config(Some(path))).gateways(), 3);
}
