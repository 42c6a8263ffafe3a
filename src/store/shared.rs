//! What the stores shared by a fleet ([`super::redis`], [`super::postgres`]) have in common: a
//! bucket's name there, the reduced refill rate, turning replies into outcomes, health (degraded
//! or not), one connection per thread, reconnecting with backoff ([`Backoff`]), and the
//! operator's calls with their deadline.

use super::ops::{BucketKey, BucketOp, Group, OpResult, OpResults, StoreError};
use crate::limits::limiter::{BucketState, Quota};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// Turns a shared store's answer (each bucket's tokens at `now_us`, or minus its µs of debt, and
/// whether the enforced and shadow groups passed) into results, with the embedded store's maths
/// for the details.
pub(crate) fn outcomes_from(
    now_us: u64,
    ops: &[BucketOp],
    enforce_ok: bool,
    shadow_ok: bool,
    available: &[i64],
    results: &mut OpResults,
) {
    results.clear();
    for (op, &tokens) in ops.iter().zip(available) {
        let state = Some(match (op.window, tokens) {
            (Some(w), _) => BucketState {
                tokens: tokens.max(0) as u64,
                last_us: w.id,
            },
            // In debt: empty, refilling from `now + debt`.
            (None, debt) if debt < 0 => BucketState {
                tokens: 0,
                last_us: now_us.saturating_add(debt.unsigned_abs()),
            },
            (None, _) => BucketState {
                tokens: tokens as u64,
                last_us: now_us,
            },
        });
        let verdict = op.check(state, now_us);
        let committed = match op.group {
            Group::Enforce => enforce_ok,
            Group::Shadow => enforce_ok && shadow_ok,
        };
        results.push(OpResult {
            verdict,
            committed,
            fail_open: false,
            away: None,
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
            let store = crate::telemetry::redact::url(store);
            let what = crate::telemetry::redact::text(what);
            tracing::error!(store = %store, errors, "shared store not answering: {what}");
            *last = Some(std::time::Instant::now());
        }
    }

    pub(crate) fn ok(&self, store: &str) {
        if self
            .degraded
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::info!(store = %crate::telemetry::redact::url(store), "shared store answering again");
        }
    }
}

thread_local! {
    /// Each worker thread's own connection to each shared store: a request's call is written,
    /// and its answer read, by a task on the thread that waits for it. Through one connection
    /// shared by the process, every request handed its call to the connection's thread and was
    /// woken back from it: two cross-thread wake-ups and context switches per request, the
    /// largest part of a shared store's CPU cost (Redis: 49.5 against 34.9 µs per request on
    /// the fair harness). Concurrent requests of one thread still share their round trips: a
    /// connection writes whatever calls are queued when it writes.
    static THREAD_CONNS: std::cell::RefCell<Vec<ThreadConn>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One thread's connection to one store, or the attempt at making it.
struct ThreadConn {
    store: u64,
    conn: Option<Arc<dyn std::any::Any + Send + Sync>>,
    connecting: bool,
    next_attempt: std::time::Instant,
    /// Failed attempts since the last success: the next one waits [`Backoff::delay`].
    backoff: Backoff,
}

/// Reconnection schedule: after `failures` failed attempts in a row, the next attempt waits a
/// random time between zero and `min(BACKOFF_CAP, BACKOFF_BASE × 2^failures)` ("full jitter"):
/// gateways that lost their store at the same instant (a restart, a failover) spread their
/// attempts instead of arriving together, and a store that stays away is asked at most about
/// once per [`BACKOFF_CAP`] by each connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Backoff {
    failures: u32,
}

/// The ceiling of the first wait.
pub(crate) const BACKOFF_BASE: Duration = Duration::from_millis(100);
/// The largest ceiling of a wait.
pub(crate) const BACKOFF_CAP: Duration = Duration::from_secs(5);

impl Backoff {
    /// The ceiling of the next wait: [`BACKOFF_BASE`] doubled per failure, at most
    /// [`BACKOFF_CAP`].
    pub(crate) fn ceiling(&self) -> Duration {
        let doubled = BACKOFF_BASE
            .as_millis()
            .saturating_mul(1u128 << self.failures.min(32));
        Duration::from_millis(doubled.min(BACKOFF_CAP.as_millis()) as u64)
    }

    /// The wait before the next attempt, drawn by `random(n)`, a uniform integer in `0..=n`
    /// (milliseconds): injected, so tests fix it.
    pub(crate) fn delay(&self, random: impl FnOnce(u64) -> u64) -> Duration {
        let ceiling = self.ceiling().as_millis() as u64;
        Duration::from_millis(random(ceiling).min(ceiling))
    }

    /// An attempt failed: the next wait's ceiling doubles.
    pub(crate) fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
    }

    /// An attempt succeeded: the next loss starts from the first ceiling again.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
    }
}

/// A uniform integer in `0..=n` for [`Backoff::delay`]: jitter, not secrets (std's per-process
/// random hash keys, stirred by a counter).
pub(crate) fn jitter(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWS.fetch_add(1, Ordering::Relaxed));
    match n.checked_add(1) {
        Some(range) => hasher.finish() % range,
        None => hasher.finish(),
    }
}

/// A new shared store's identity in [`THREAD_CONNS`].
pub(crate) fn next_store_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The connection a request's call goes on: this thread's own to store `store` once it has
/// one, `shared` until then. On a current-thread runtime (Pingora's workers), the first call
/// starts making this thread's connection with `connect` (after a failure, again once the
/// thread's [`Backoff`] delay has passed); elsewhere `shared` is used.
pub(crate) fn thread_conn<T, F>(store: u64, shared: Arc<T>, connect: impl FnOnce() -> F) -> Arc<T>
where
    T: Send + Sync + 'static,
    F: std::future::Future<Output = Option<T>> + Send + 'static,
{
    thread_conn_checked(store, shared, |_| true, connect)
}

/// [`thread_conn`], where a thread's connection that `current` rejects (it belongs to a
/// connection the store has since given up, e.g. to a former master) is dropped and another
/// made, keeping the thread's backoff.
pub(crate) fn thread_conn_checked<T, F>(
    store: u64,
    shared: Arc<T>,
    current: impl Fn(&T) -> bool,
    connect: impl FnOnce() -> F,
) -> Arc<T>
where
    T: Send + Sync + 'static,
    F: std::future::Future<Output = Option<T>> + Send + 'static,
{
    let on_own_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    if !on_own_thread {
        return shared;
    }
    THREAD_CONNS.with(|cell| {
        let mut conns = cell.borrow_mut();
        let now = std::time::Instant::now();
        let i = match conns.iter().position(|c| c.store == store) {
            Some(i) => i,
            None => {
                conns.push(ThreadConn {
                    store,
                    conn: None,
                    connecting: false,
                    next_attempt: now,
                    backoff: Backoff::default(),
                });
                conns.len() - 1
            }
        };
        let entry = &mut conns[i];
        if let Some(conn) = entry.conn.clone().and_then(|c| c.downcast::<T>().ok()) {
            if current(&conn) {
                return conn;
            }
            entry.conn = None;
        }
        if !entry.connecting && now >= entry.next_attempt {
            entry.connecting = true;
            let made = connect();
            // A current-thread runtime runs this task, and the connection's driver, here.
            tokio::spawn(async move {
                let made = made
                    .await
                    .map(|c| Arc::new(c) as Arc<dyn std::any::Any + Send + Sync>);
                THREAD_CONNS.with(|cell| {
                    if let Some(c) = cell.borrow_mut().iter_mut().find(|c| c.store == store) {
                        c.connecting = false;
                        if made.is_some() {
                            c.backoff.succeeded();
                            c.next_attempt = std::time::Instant::now();
                        } else {
                            c.next_attempt = std::time::Instant::now() + c.backoff.delay(jitter);
                            c.backoff.failed();
                        }
                        c.conn = made;
                    }
                });
            });
        }
        shared
    })
}

/// Drops this thread's connection to store `store` (it was lost): the next call makes another.
pub(crate) fn forget_thread_conn(store: u64) {
    let _ = THREAD_CONNS.try_with(|cell| {
        if let Ok(mut conns) = cell.try_borrow_mut() {
            conns.retain(|c| c.store != store);
        }
    });
}

/// Deadline of one operator read or reset (`/v1/buckets`, `/v1/explain`) on a shared store:
/// longer than a decision's `--store-timeout-ms`, since nobody's request waits on it.
pub(crate) const OPERATOR_TIMEOUT: Duration = Duration::from_secs(2);

/// An operator's read or reset, bounded by [`OPERATOR_TIMEOUT`]; the store's error text
/// redacted.
pub(crate) async fn operator_call<T, E: std::fmt::Display>(
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(OPERATOR_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(StoreError::Unavailable(
            crate::telemetry::redact::text(&e.to_string()).into_owned(),
        )),
        Err(_) => Err(StoreError::Unavailable(format!(
            "no answer within {OPERATOR_TIMEOUT:?}"
        ))),
    }
}

/// An op's cost as the shared stores' scripts take it: negative for a probe (checked at its
/// size, nothing spent).
pub(crate) fn signed_cost(op: &super::ops::BucketOp) -> i64 {
    let cost = op.cost.min(i64::MAX as u64) as i64;
    if op.probe {
        -cost
    } else {
        cost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schedule with the random draw pinned at its top and at zero: ceilings of 100, 200,
    /// 400 ms... doubling up to 5 s and staying there; a success starts it again.
    #[test]
    fn reconnects_back_off_exponentially_with_full_jitter() {
        let mut backoff = Backoff::default();
        let mut top = Vec::new();
        for _ in 0..10 {
            top.push(backoff.delay(|n| n).as_millis() as u64);
            assert_eq!(
                backoff.delay(|_| 0),
                Duration::ZERO,
                "full jitter reaches zero"
            );
            backoff.failed();
        }
        assert_eq!(
            top,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]
        );
        // A draw is uniform over 0..=ceiling, and one out of range is clamped.
        assert_eq!(backoff.delay(|n| n / 2), Duration::from_millis(2500));
        assert_eq!(backoff.delay(|_| u64::MAX), Duration::from_secs(5));
        // Thousands of failures never overflow.
        for _ in 0..10_000 {
            backoff.failed();
        }
        assert_eq!(backoff.ceiling(), BACKOFF_CAP);
        backoff.succeeded();
        assert_eq!(backoff, Backoff::default());
        assert_eq!(backoff.delay(|n| n), Duration::from_millis(100));
    }

    /// The real jitter stays within its range and is not constant.
    #[test]
    fn jitter_draws_within_its_range() {
        let draws: Vec<u64> = (0..200).map(|_| jitter(100)).collect();
        assert!(draws.iter().all(|&d| d <= 100));
        assert!(draws.iter().any(|&d| d != draws[0]));
        assert_eq!(jitter(0), 0);
        let _ = jitter(u64::MAX);
    }
}
