//! The gateway's paced requests ([`Pacer`]): the requests a token-bucket rule's `delay` makes
//! wait, how many may wait at once (`--max-delayed-requests`), each one's hold on its place and
//! on the tokens it reserved ([`Pace`]), and what a shutdown does to them.
//!
//! A waiting request costs this component one [`Pace`] (its refund list inline, an `Arc` and
//! a few words); the front end's own request state around it is the larger part. Its tokens
//! were spent when it was decided: a request that is served keeps them; one whose client goes
//! away (the front end drops the `Pace`, or says so) or that a shutdown refuses gives them back
//! to the store, so the next request in line gets that turn.

use crate::engine::Paced;
use crate::store::{AdjustOp, Store};
use crate::telemetry::metrics::Metrics;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after a shutdown starts the waiting requests may still be served: those whose
/// turn comes later are refused at once (with their tokens given back and a `Retry-After`).
/// Half the proxy's one-second grace period, so that a request served at the end of it still
/// has the other half to reach its upstream before the drain ends.
pub const DRAIN_SERVE_WITHIN: Duration = Duration::from_millis(500);

/// The paced requests of one gateway.
pub struct Pacer {
    inner: Arc<Inner>,
}

struct Inner {
    /// Requests waiting now.
    waiting: AtomicUsize,
    /// `--max-delayed-requests`.
    max: usize,
    /// A shutdown started: waits ending after `drain_until_ms` are cut short and refused.
    draining: AtomicBool,
    /// Milliseconds after `epoch` past which no wait may end once draining.
    drain_until_ms: AtomicU64,
    epoch: Instant,
    /// Wakes the waiting requests when a shutdown starts.
    drain: tokio::sync::Notify,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
}

/// How a paced request's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Its turn came: it goes on (after waiting this long).
    Served(Duration),
    /// A shutdown started and its turn comes after the drain: refused, its tokens given
    /// back; the client may come back in this many seconds.
    Drained { retry_after: u64 },
}

impl Pacer {
    pub(super) fn new(max: usize, store: Arc<Store>, metrics: Arc<Metrics>) -> Pacer {
        Pacer {
            inner: Arc::new(Inner {
                waiting: AtomicUsize::new(0),
                max,
                draining: AtomicBool::new(false),
                drain_until_ms: AtomicU64::new(u64::MAX),
                epoch: Instant::now(),
                drain: tokio::sync::Notify::new(),
                store,
                metrics,
            }),
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Relaxed)
    }

    /// A place to wait for `paced`'s turn; `None` when `--max-delayed-requests` are already
    /// waiting, or the wait would end after a shutdown's drain (the caller refuses it and gives
    /// its tokens back).
    pub(super) fn place(&self, paced: &Paced) -> Option<Pace> {
        let wait = Duration::from_micros(paced.wait_us);
        if self.inner.past_drain(Instant::now() + wait) {
            return None;
        }
        let before = self.inner.waiting.fetch_add(1, Ordering::AcqRel);
        if before >= self.inner.max {
            self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
            self.inner.metrics.paced("full", None);
            return None;
        }
        self.inner.metrics.paced_waiting(true);
        Some(Pace {
            wait,
            refund: paced.refund_ops(),
            inner: Arc::clone(&self.inner),
            settled: false,
        })
    }

    /// A shutdown starts: requests whose turn comes within [`DRAIN_SERVE_WITHIN`] are still
    /// served on time; the others are refused now, their tokens given back.
    pub fn drain(&self) {
        let until = self.inner.epoch.elapsed() + DRAIN_SERVE_WITHIN;
        self.inner
            .drain_until_ms
            .store(until.as_millis() as u64, Ordering::Release);
        self.inner.draining.store(true, Ordering::Release);
        self.inner.drain.notify_waiters();
    }
}

impl Inner {
    /// Whether a wait ending at `end` ends after the drain allows.
    fn past_drain(&self, end: Instant) -> bool {
        if !self.draining.load(Ordering::Acquire) {
            return false;
        }
        let until = self.drain_until_ms.load(Ordering::Acquire);
        end.saturating_duration_since(self.epoch).as_millis() as u64 > until
    }
}

/// One paced request's place in line, holding the tokens it reserved: [`Pace::wait`] for its
/// turn. Dropped before its turn (its client went away and the front end let go of it), it
/// gives the tokens back.
pub struct Pace {
    /// How long it waits, from its decision.
    pub wait: Duration,
    refund: SmallVec<[AdjustOp; 2]>,
    inner: Arc<Inner>,
    /// Served, or its tokens already given back.
    settled: bool,
}

impl std::fmt::Debug for Pace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pace")
            .field("wait", &self.wait)
            .field("settled", &self.settled)
            .finish_non_exhaustive()
    }
}

impl Pace {
    /// Waits for the request's turn (cut short by a shutdown whose drain ends first). Counted
    /// and, when served, its wait observed.
    pub async fn wait(mut self) -> Waited {
        let started = Instant::now();
        let end = started + self.wait;
        let inner = Arc::clone(&self.inner);
        loop {
            let drain = inner.drain.notified();
            tokio::pin!(drain);
            drain.as_mut().enable();
            if inner.past_drain(end) {
                self.give_back_now().await;
                inner.metrics.paced("drained", None);
                let left = end.saturating_duration_since(Instant::now());
                return Waited::Drained {
                    retry_after: crate::limits::limiter::ceil_secs(left.as_micros() as u64).max(1),
                };
            }
            tokio::select! {
                () = tokio::time::sleep_until(end.into()) => break,
                () = &mut drain => {}
            }
        }
        self.settled = true;
        let waited = started.elapsed();
        self.inner.metrics.paced("served", Some(waited));
        Waited::Served(waited)
    }

    async fn give_back_now(&mut self) {
        if self.settled {
            return;
        }
        self.settled = true;
        let _ = self
            .inner
            .store
            .adjust(self.inner.store.now_us(), &self.refund)
            .await;
    }
}

impl Drop for Pace {
    fn drop(&mut self) {
        self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
        self.inner.metrics.paced_waiting(false);
        if self.settled {
            return;
        }
        // Dropped while waiting (its caller's future was dropped: an ext_authz call
        // cancelled): the tokens go back, in a task of their own for a shared store.
        self.inner.metrics.paced("client_gone", None);
        let refund = std::mem::take(&mut self.refund);
        let inner = Arc::clone(&self.inner);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    let _ = inner.store.adjust(inner.store.now_us(), &refund).await;
                });
            }
            Err(_) => {
                tracing::debug!("paced request dropped outside a runtime; its tokens stay spent");
            }
        }
    }
}
