//! The per-server connection cap of an upstream group (`max_connections`) and its queue
//! (`queue_timeout_ms`): a server takes at most that many requests at once; the others wait for
//! a slot in arrival order (tokio's semaphore is fair: first come, first served) and are answered
//! 503 with `Retry-After` when none frees up within the queue timeout. A slot is held from the
//! choice of the server until the response is done, so the server never sees more requests, nor
//! (with connection reuse) more connections, than its cap.

pub use crate::telemetry::metrics::QueueMetrics;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// One server's slots.
pub struct Slots {
    semaphore: Arc<Semaphore>,
}

/// Seconds a client is told to wait (`Retry-After`) when the queue timed out: the queue moves as
/// responses finish, so a short pause is enough to find a slot.
pub const RETRY_AFTER_SECS: u64 = 1;

/// A request could not get a slot within the queue timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueTimedOut;

impl Slots {
    pub fn new(max: usize) -> Slots {
        Slots {
            semaphore: Arc::new(Semaphore::new(max)),
        }
    }

    /// A slot: at once when one is free, else after waiting in line at most `timeout`. The
    /// group's metrics are looked up only when the request has to wait.
    ///
    /// # Errors
    /// No slot freed up within `timeout` (counted).
    pub async fn acquire(
        &self,
        timeout: Duration,
        metrics: impl FnOnce() -> QueueMetrics,
    ) -> Result<OwnedSemaphorePermit, QueueTimedOut> {
        // No waiter ahead and a slot free: no queue, no timer, no metric.
        if let Ok(permit) = Arc::clone(&self.semaphore).try_acquire_owned() {
            return Ok(permit);
        }
        let metrics = metrics();
        let waiting = Waiting::count(&metrics.waiting);
        let started = std::time::Instant::now();
        let waited =
            tokio::time::timeout(timeout, Arc::clone(&self.semaphore).acquire_owned()).await;
        drop(waiting);
        match waited {
            Ok(Ok(permit)) => {
                metrics.waits.observe(started.elapsed().as_secs_f64());
                Ok(permit)
            }
            // Timed out (the semaphore is never closed).
            _ => {
                metrics.timeouts.inc();
                Err(QueueTimedOut)
            }
        }
    }
}

/// One request counted in the queue-length gauge while it waits: uncounted when it stops
/// waiting, also when its client goes away and Pingora drops the waiting request.
struct Waiting<'a>(&'a prometheus::IntGauge);

impl<'a> Waiting<'a> {
    fn count(gauge: &'a prometheus::IntGauge) -> Self {
        gauge.inc();
        Waiting(gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> QueueMetrics {
        QueueMetrics {
            waiting: prometheus::IntGauge::new("w", "w").unwrap(),
            waits: prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("h", "h"))
                .unwrap(),
            timeouts: prometheus::IntCounter::new("t", "t").unwrap(),
        }
    }

    /// Two slots: the third request waits, is served in arrival order once a slot frees, and a
    /// request that waits past the timeout is counted and refused.
    #[tokio::test(start_paused = true)]
    async fn waiters_are_served_first_come_first_served_or_time_out() {
        let slots = Arc::new(Slots::new(2));
        let m = metrics();
        let a = slots
            .acquire(Duration::from_secs(1), || m.clone())
            .await
            .unwrap();
        let b = slots
            .acquire(Duration::from_secs(1), || m.clone())
            .await
            .unwrap();
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..2 {
            let (slots, m, order) = (Arc::clone(&slots), m.clone(), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let got = slots.acquire(Duration::from_secs(5), || m.clone()).await;
                order.lock().push(i);
                // Hold it a moment so the second waiter needs the next free slot.
                tokio::time::sleep(Duration::from_millis(10)).await;
                got.is_ok()
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(m.waiting.get(), 2);
        drop(a);
        for w in waiters {
            assert!(w.await.unwrap());
        }
        assert_eq!(*order.lock(), vec![0, 1]);
        assert_eq!(m.waits.get_sample_count(), 2);
        assert_eq!(m.waiting.get(), 0);
        drop(b);
        // Both slots held: a request waits its whole timeout, then is refused.
        let _c = slots
            .acquire(Duration::from_secs(1), || m.clone())
            .await
            .unwrap();
        let _d = slots
            .acquire(Duration::from_secs(1), || m.clone())
            .await
            .unwrap();
        assert_eq!(
            slots
                .acquire(Duration::from_millis(200), || m.clone())
                .await
                .err(),
            Some(QueueTimedOut)
        );
        assert_eq!(m.timeouts.get(), 1);
        assert_eq!(m.waiting.get(), 0);
    }

    /// A waiting request whose client went away (Pingora drops its future) leaves the
    /// queue-length gauge as it found it.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_while_waiting_is_no_longer_counted() {
        let slots = Arc::new(Slots::new(1));
        let m = metrics();
        let _held = slots
            .acquire(Duration::from_secs(1), || m.clone())
            .await
            .unwrap();
        let waiter = {
            let (slots, m) = (Arc::clone(&slots), m.clone());
            tokio::spawn(async move { slots.acquire(Duration::from_secs(5), || m).await.is_ok() })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert_eq!(m.waiting.get(), 0);
        assert_eq!(m.timeouts.get(), 0);
    }
}
