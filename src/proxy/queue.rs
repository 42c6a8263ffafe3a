//! The per-server connection cap of an upstream group (`max_connections`) and its queue
//! (`queue_timeout_ms`): a server takes at most that many requests at once; the others wait for
//! a slot in arrival order (tokio's semaphore is fair: first come, first served) and are answered
//! 503 with `Retry-After` when none frees up within the queue timeout. A slot is held from the
//! choice of the server until the response is done, so the server never sees more requests, nor
//! (with connection reuse) more connections, than its cap.
//!
//! One client address holds at most its share of a server's slots
//! (`max_connections_per_client`): its requests beyond the share wait for one of its own to
//! finish, behind nobody else, so a client that holds its answers back (a slow reader, bounded
//! by the send timeout) cannot take every slot. A request whose client went away while it
//! waited leaves the queue at once and is never sent.

pub use crate::telemetry::metrics::QueueMetrics;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// One server's slots, and each client's share of them.
pub struct Slots {
    semaphore: Arc<Semaphore>,
    max: usize,
    share: usize,
    /// The clients holding or waiting for a slot, each with its share. An entry goes when its
    /// client holds and awaits nothing, so the map is never larger than the requests at hand.
    clients: parking_lot::Mutex<ahash::AHashMap<IpAddr, Arc<Semaphore>>>,
}

/// Seconds a client is told to wait (`Retry-After`) when the queue timed out: the queue moves as
/// responses finish, so a short pause is enough to find a slot.
pub const RETRY_AFTER_SECS: u64 = 1;

/// Why a request got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueError {
    /// No slot freed up within the queue timeout.
    TimedOut,
    /// The client went away while the request waited: nothing is sent upstream.
    ClientGone,
}

/// A slot held at a server (and, with a client address, one of that client's share): given
/// back when dropped.
pub struct Slot {
    _server: OwnedSemaphorePermit,
    client: Option<ClientShare>,
}

/// One of a client's share, held with its server slot.
struct ClientShare {
    permit: Option<OwnedSemaphorePermit>,
    ip: IpAddr,
    slots: Arc<Slots>,
}

impl Drop for ClientShare {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.slots.forget_idle(self.ip);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The client's share first: its entry may go once nothing of it is held.
        drop(self.client.take());
    }
}

/// A reference to a client's share while a request asks for it: when it goes, the client's
/// entry goes too if nothing else holds or awaits any of the share.
struct ShareRef<'a> {
    slots: &'a Slots,
    ip: IpAddr,
    semaphore: Option<Arc<Semaphore>>,
}

impl ShareRef<'_> {
    fn semaphore(&self) -> Option<&Arc<Semaphore>> {
        self.semaphore.as_ref()
    }
}

impl Drop for ShareRef<'_> {
    fn drop(&mut self) {
        drop(self.semaphore.take());
        self.slots.forget_idle(self.ip);
    }
}

impl Slots {
    /// `max` requests at once, at most `share` of them from one client address.
    pub fn new(max: usize, share: usize) -> Slots {
        Slots {
            semaphore: Arc::new(Semaphore::new(max)),
            max,
            share: share.clamp(1, max.max(1)),
            clients: parking_lot::Mutex::new(ahash::AHashMap::new()),
        }
    }

    /// A slot: at once when one is free (and `client` is within its share), else after waiting
    /// in line at most `timeout`, or until `client_gone` resolves. The group's metrics are
    /// looked up only when the request has to wait.
    ///
    /// # Errors
    /// No slot freed up within `timeout` (counted), or the client went away (counted).
    pub async fn acquire(
        self: &Arc<Self>,
        client: Option<IpAddr>,
        timeout: Duration,
        metrics: impl FnOnce() -> QueueMetrics,
        client_gone: impl Future<Output = ()>,
    ) -> Result<Slot, QueueError> {
        // The client's own share, then the server's slot; no waiter ahead and both free: no
        // queue, no timer, no metric.
        // A share of the whole cap limits nothing: no client is tracked.
        let client = client.filter(|_| self.share < self.max);
        // Held for the whole call, also when the request is dropped while it waits (its client
        // went away and Pingora dropped its future): the entry goes with the last reference.
        let share = client.map(|ip| ShareRef {
            slots: self,
            ip,
            semaphore: Some(self.share_of(ip)),
        });
        let fast_share = match share.as_ref().and_then(ShareRef::semaphore) {
            None => Some(None),
            Some(sem) => Arc::clone(sem).try_acquire_owned().ok().map(Some),
        };
        if let Some(share_permit) = fast_share {
            if let Ok(server) = Arc::clone(&self.semaphore).try_acquire_owned() {
                return Ok(self.slot(server, client, share_permit));
            }
            // The share is given back (and taken again in line below).
            drop(share_permit);
        }
        let metrics = metrics();
        let waiting = Waiting::count(&metrics.waiting);
        let started = std::time::Instant::now();
        let in_line = async {
            let share_permit = match share.as_ref().and_then(ShareRef::semaphore) {
                None => None,
                Some(sem) => Some(Arc::clone(sem).acquire_owned().await.ok()?),
            };
            let server = Arc::clone(&self.semaphore).acquire_owned().await.ok()?;
            Some((server, share_permit))
        };
        let waited = tokio::select! {
            // Biased: a slot that is there is taken, even if the client left the same moment.
            biased;
            got = tokio::time::timeout(timeout, in_line) => got.map_err(|_| QueueError::TimedOut),
            () = client_gone => Err(QueueError::ClientGone),
        };
        drop(waiting);
        match waited {
            Ok(Some((server, share_permit))) => {
                metrics.waits.observe(started.elapsed().as_secs_f64());
                Ok(self.slot(server, client, share_permit))
            }
            // The semaphores are never closed.
            Ok(None) | Err(QueueError::TimedOut) => {
                metrics.timeouts.inc();
                Err(QueueError::TimedOut)
            }
            Err(QueueError::ClientGone) => {
                metrics.abandoned.inc();
                Err(QueueError::ClientGone)
            }
        }
    }

    fn slot(
        self: &Arc<Self>,
        server: OwnedSemaphorePermit,
        client: Option<IpAddr>,
        share_permit: Option<OwnedSemaphorePermit>,
    ) -> Slot {
        Slot {
            _server: server,
            client: client.map(|ip| ClientShare {
                permit: share_permit,
                ip,
                slots: Arc::clone(self),
            }),
        }
    }

    /// The share of `ip`, made when it has none.
    fn share_of(&self, ip: IpAddr) -> Arc<Semaphore> {
        Arc::clone(
            self.clients
                .lock()
                .entry(ip)
                .or_insert_with(|| Arc::new(Semaphore::new(self.share))),
        )
    }

    /// Drops the entry of `ip` when nobody holds or awaits any of its share (the map's own
    /// reference is the only one left).
    fn forget_idle(&self, ip: IpAddr) {
        let mut clients = self.clients.lock();
        if clients
            .get(&ip)
            .is_some_and(|sem| Arc::strong_count(sem) == 1)
        {
            clients.remove(&ip);
        }
    }

    /// Client addresses with an entry now (held or awaited shares).
    #[cfg(test)]
    fn clients_tracked(&self) -> usize {
        self.clients.lock().len()
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
            abandoned: prometheus::IntCounter::new("a", "a").unwrap(),
        }
    }

    /// A client that never leaves.
    fn stays() -> std::future::Pending<()> {
        std::future::pending()
    }

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([192, 0, 2, last]))
    }

    /// Two slots: the third request waits, is served in arrival order once a slot frees, and a
    /// request that waits past the timeout is counted and refused.
    #[tokio::test(start_paused = true)]
    async fn waiters_are_served_first_come_first_served_or_time_out() {
        let slots = Arc::new(Slots::new(2, 2));
        let m = metrics();
        let a = slots
            .acquire(None, Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let b = slots
            .acquire(None, Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..2 {
            let (slots, m, order) = (Arc::clone(&slots), m.clone(), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let got = slots
                    .acquire(None, Duration::from_secs(5), || m.clone(), stays())
                    .await;
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
            .acquire(None, Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let _d = slots
            .acquire(None, Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        assert_eq!(
            slots
                .acquire(None, Duration::from_millis(200), || m.clone(), stays())
                .await
                .err(),
            Some(QueueError::TimedOut)
        );
        assert_eq!(m.timeouts.get(), 1);
        assert_eq!(m.waiting.get(), 0);
    }

    /// Three slots, a share of two: a client's third request waits for one of its own to
    /// finish although a slot is free, which another client takes at once; the first client's
    /// entry goes once nothing of its share is held or awaited.
    #[tokio::test(start_paused = true)]
    async fn one_client_holds_at_most_its_share_and_others_find_a_slot() {
        let slots = Arc::new(Slots::new(3, 2));
        let m = metrics();
        let a1 = slots
            .acquire(ip(1), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let _a2 = slots
            .acquire(ip(1), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let third = {
            let (slots, m) = (Arc::clone(&slots), m.clone());
            tokio::spawn(async move {
                slots
                    .acquire(ip(1), Duration::from_secs(5), || m, stays())
                    .await
                    .is_ok()
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1, "client 1's third request waits");
        // Client 2 takes the free slot without waiting.
        let b = slots
            .acquire(ip(2), Duration::from_millis(1), || m.clone(), stays())
            .await
            .unwrap();
        assert_eq!(m.waits.get_sample_count(), 0);
        assert_eq!(slots.clients_tracked(), 2);
        // Client 2 done: a server slot is free but client 1 is still at its share.
        drop(b);
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        assert_eq!(slots.clients_tracked(), 1);
        drop(a1);
        assert!(third.await.unwrap());
        assert_eq!(m.waiting.get(), 0);
        assert_eq!(m.waits.get_sample_count(), 1);
        assert_eq!(m.timeouts.get(), 0);
    }

    /// Every slot given back: no client entry is left behind, whether the requests were
    /// served, timed out or abandoned.
    #[tokio::test(start_paused = true)]
    async fn client_entries_go_when_their_requests_are_done() {
        let slots = Arc::new(Slots::new(2, 1));
        let m = metrics();
        let held = slots
            .acquire(ip(1), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let also_held = slots
            .acquire(ip(4), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        assert_eq!(
            slots
                .acquire(ip(2), Duration::from_millis(50), || m.clone(), stays())
                .await
                .err(),
            Some(QueueError::TimedOut)
        );
        assert_eq!(
            slots
                .acquire(ip(3), Duration::from_secs(5), || m.clone(), async {})
                .await
                .err(),
            Some(QueueError::ClientGone)
        );
        assert_eq!(slots.clients_tracked(), 2);
        drop(held);
        drop(also_held);
        assert_eq!(slots.clients_tracked(), 0);
    }

    /// A share of the whole cap limits nothing: no client is tracked at all.
    #[tokio::test(start_paused = true)]
    async fn a_share_of_the_whole_cap_tracks_no_client() {
        let slots = Arc::new(Slots::new(2, 2));
        let m = metrics();
        let _a = slots
            .acquire(ip(1), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let _b = slots
            .acquire(ip(1), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        assert_eq!(slots.clients_tracked(), 0);
    }

    /// A waiting request whose client goes away leaves the queue at once, counted, and does
    /// not hold up the request behind it.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_client_leaves_gives_up_its_place() {
        let slots = Arc::new(Slots::new(1, 1));
        let m = metrics();
        let held = slots
            .acquire(ip(1), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
        let leaving = {
            let (slots, m) = (Arc::clone(&slots), m.clone());
            tokio::spawn(async move {
                slots
                    .acquire(ip(2), Duration::from_secs(5), || m, async {
                        let _ = gone_rx.await;
                    })
                    .await
                    .err()
            })
        };
        tokio::task::yield_now().await;
        let staying = {
            let (slots, m) = (Arc::clone(&slots), m.clone());
            tokio::spawn(async move {
                slots
                    .acquire(ip(3), Duration::from_secs(5), || m, stays())
                    .await
                    .is_ok()
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 2);
        drop(gone_tx);
        assert_eq!(leaving.await.unwrap(), Some(QueueError::ClientGone));
        assert_eq!(m.abandoned.get(), 1);
        assert_eq!(m.waiting.get(), 1);
        drop(held);
        assert!(staying.await.unwrap());
        assert_eq!(m.timeouts.get(), 0);
        assert_eq!(m.waiting.get(), 0);
    }

    /// A waiting request whose client went away (Pingora drops its future) leaves the
    /// queue-length gauge as it found it.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_while_waiting_is_no_longer_counted() {
        let slots = Arc::new(Slots::new(2, 1));
        let m = metrics();
        let _held = slots
            .acquire(ip(5), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let _also_held = slots
            .acquire(ip(6), Duration::from_secs(1), || m.clone(), stays())
            .await
            .unwrap();
        let waiter = {
            let (slots, m) = (Arc::clone(&slots), m.clone());
            tokio::spawn(async move {
                slots
                    .acquire(ip(2), Duration::from_secs(5), || m, stays())
                    .await
                    .is_ok()
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        assert_eq!(slots.clients_tracked(), 3);
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert_eq!(m.waiting.get(), 0);
        assert_eq!(m.timeouts.get(), 0);
        // The dropped waiter's client is forgotten; the two holding slots are not.
        assert_eq!(slots.clients_tracked(), 2);
    }
}
