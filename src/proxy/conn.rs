//! Connection guard for the proxy and admin listeners (each with its own cap): a cap on
//! concurrent client connections, a total deadline for a new connection's first request
//! headers, and a deadline for the next request's headers on a kept-alive connection.
//!
//! Pingora 0.9 times each socket read separately (60 s), so a client trickling one byte a
//! second keeps its connection forever, and a kept-alive HTTP/1.1 connection waits for its next
//! request forever. [`Guarded`] wraps the app: every connection runs inside a
//! [`DeadlineClock`] armed at accept (header timeout), disarmed once a request's header is
//! parsed ([`header_parsed`]: the proxy's `early_request_filter`, the admin's handler), and
//! re-armed when a response is done ([`response_done`]: the proxy's `logging`, the admin's
//! handler; keep-alive timeout). When it fires, the connection's task is
//! dropped, which closes the socket. A request being proxied is never cut off by it.
//!
//! Connections beyond the cap get a `503` and are closed at once, so the gateway never runs
//! out of file descriptors: the admin listener (`/livez`) keeps answering.

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

tokio::task_local! {
    static CONNECTION: Arc<Connection>;
}

/// What a connection keeps across its keep-alive requests.
pub struct Connection {
    clock: DeadlineClock,
    /// The peer address and whether it is a trusted proxy, worked out once per connection.
    peer: std::sync::OnceLock<(Option<std::net::IpAddr>, bool)>,
    /// The forwarding headers' values that depend on the connection alone.
    forwarding: std::sync::OnceLock<super::forward::ConnectionValues>,
    /// Requests being served (HTTP/2 streams run side by side): the idle deadline is armed
    /// only when the last one is done.
    active: AtomicUsize,
}

/// HTTP/2 connections by the address of their socket digest, which Pingora shares with every
/// stream's session: the streams run in tasks of their own, outside the connection's
/// task-local scope, and find their connection here.
static HTTP2_CONNECTIONS: std::sync::LazyLock<
    parking_lot::Mutex<ahash::AHashMap<usize, Arc<Connection>>>,
> = std::sync::LazyLock::new(|| parking_lot::Mutex::new(ahash::AHashMap::new()));

/// Removes an HTTP/2 connection from [`HTTP2_CONNECTIONS`] when its future ends, however.
struct Http2Registration(usize);

impl Drop for Http2Registration {
    fn drop(&mut self) {
        HTTP2_CONNECTIONS.lock().remove(&self.0);
    }
}

/// The connection a request belongs to: the task-local one (HTTP/1.x), or for an HTTP/2
/// stream the one registered under its socket digest.
fn with_connection(http2_key: Option<usize>, f: impl FnOnce(&Connection)) {
    match http2_key {
        Some(key) => {
            let found = HTTP2_CONNECTIONS.lock().get(&key).cloned();
            if let Some(connection) = found {
                f(&connection);
            }
        }
        None => {
            let _ = CONNECTION.try_with(|c| f(c));
        }
    }
}

/// A request's header has been read: no deadline while it is served.
pub fn request_started(http2_key: Option<usize>) {
    with_connection(http2_key, |c| {
        c.active.fetch_add(1, Ordering::Relaxed);
        c.clock.disarm();
    });
}

/// A request is done: when no other request of the connection is in flight, the next one
/// must arrive within `idle`.
pub fn request_done(http2_key: Option<usize>, idle: Duration) {
    with_connection(http2_key, |c| {
        let before = c
            .active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            })
            .unwrap_or(0);
        if before <= 1 {
            c.clock.arm(idle);
        }
    });
}

/// The connection's peer and trusted-proxy verdict, computed by `work_out` on its first
/// request and kept for the next ones (outside a guarded connection, computed every time).
pub fn peer(
    work_out: impl FnOnce() -> (Option<std::net::IpAddr>, bool),
) -> (Option<std::net::IpAddr>, bool) {
    let mut work_out = Some(work_out);
    CONNECTION
        .try_with(|c| {
            *c.peer
                .get_or_init(|| work_out.take().map_or((None, false), |f| f()))
        })
        .unwrap_or_else(|_| work_out.take().map_or((None, false), |f| f()))
}

/// Runs `use_values` with the forwarding headers' per-connection values, made by `work_out` on
/// the connection's first request and kept for the next ones (outside a guarded connection,
/// made every time).
pub fn with_forwarding_values<S, R>(
    state: &mut S,
    work_out: impl FnOnce(&S) -> super::forward::ConnectionValues,
    use_values: impl FnOnce(&mut S, &super::forward::ConnectionValues) -> R,
) -> R {
    match CONNECTION.try_with(Arc::clone) {
        Ok(connection) => {
            let values = connection.forwarding.get_or_init(|| work_out(state));
            use_values(state, values)
        }
        Err(_) => {
            let values = work_out(state);
            use_values(state, &values)
        }
    }
}

/// One connection's deadline, in milliseconds since accept (0 = disarmed).
pub struct DeadlineClock {
    start: Instant,
    deadline_ms: AtomicU64,
    armed: Notify,
}

impl DeadlineClock {
    fn new() -> Self {
        DeadlineClock {
            start: Instant::now(),
            deadline_ms: AtomicU64::new(0),
            armed: Notify::new(),
        }
    }

    /// The connection must produce a complete request header within `after`.
    fn arm(&self, after: Duration) {
        let at = (self.start.elapsed() + after).as_millis() as u64 + 1;
        if self.deadline_ms.swap(at, Ordering::Relaxed) == 0 {
            self.armed.notify_one();
        }
    }

    /// A request is being served: no deadline until its response is done. No wake-up needed:
    /// the waiter notices at its next timer tick.
    fn disarm(&self) {
        self.deadline_ms.store(0, Ordering::Relaxed);
    }

    /// Resolves when the deadline in force passes.
    async fn expired(&self) {
        loop {
            let at = self.deadline_ms.load(Ordering::Relaxed);
            if at == 0 {
                self.armed.notified().await;
                continue;
            }
            tokio::time::sleep_until(self.start + Duration::from_millis(at)).await;
            if self.deadline_ms.load(Ordering::Relaxed) == at {
                return;
            }
        }
    }
}

/// A connection's future raced against its deadline: `Ready(Some)` with the connection's
/// result, `Ready(None)` when the deadline passes first. The deadline's future is polled only
/// when its own timer or notification woke the task (it is given a waker of its own that
/// notes the wake-up), not each time the connection's I/O does: a request wakes the task
/// several times, and each poll of a timer costs a waker registration.
struct Watched<S, E> {
    serve: std::pin::Pin<Box<S>>,
    expiry: std::pin::Pin<Box<E>>,
    woken: Arc<ExpiryWaker>,
    waker: std::task::Waker,
}

/// Notes that the deadline's future was woken, and wakes the connection's task.
struct ExpiryWaker {
    woken: std::sync::atomic::AtomicBool,
    task: futures::task::AtomicWaker,
}

impl std::task::Wake for ExpiryWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<S, E> Watched<S, E> {
    fn new(serve: S, expiry: E) -> Self {
        let woken = Arc::new(ExpiryWaker {
            // Polled once at the start, to arm its timer.
            woken: std::sync::atomic::AtomicBool::new(true),
            task: futures::task::AtomicWaker::new(),
        });
        let waker = std::task::Waker::from(Arc::clone(&woken));
        Watched {
            serve: Box::pin(serve),
            expiry: Box::pin(expiry),
            woken,
            waker,
        }
    }
}

impl<S, E, T> std::future::Future for Watched<S, E>
where
    S: std::future::Future<Output = Option<T>>,
    E: std::future::Future<Output = ()>,
{
    type Output = Option<T>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        if let std::task::Poll::Ready(done) = self.serve.as_mut().poll(cx) {
            return std::task::Poll::Ready(done);
        }
        self.woken.task.register(cx.waker());
        if self.woken.woken.swap(false, Ordering::Acquire) {
            let this = &mut *self;
            let mut expiry_cx = std::task::Context::from_waker(&this.waker);
            if this.expiry.as_mut().poll(&mut expiry_cx).is_ready() {
                return std::task::Poll::Ready(None);
            }
        }
        std::task::Poll::Pending
    }
}

/// Called once a request's header has been read (HTTP/1.x): the header deadline no longer
/// applies.
pub fn header_parsed() {
    request_started(None);
}

/// Called when a response is done (HTTP/1.x): the next request must arrive within `idle`.
pub fn response_done(idle: Duration) {
    request_done(None, idle);
}

/// Connection limits of the proxy listener.
#[derive(Clone)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    /// The app accepts HTTP/2 with prior knowledge on cleartext connections.
    pub h2c: bool,
    /// `--max-connections-per-ip`, shared by every listener of the proxy.
    pub per_client: Option<Arc<PerClient>>,
}

/// Open connections per client address, capped (`--max-connections-per-ip`, as nginx's
/// `limit_conn`). The TCP peer is the client: a `--trusted-proxy` peer carries many clients
/// and is not counted. IPv6 peers count per network (`--ipv6-prefix`), like their buckets.
pub struct PerClient {
    max: usize,
    ipv6_prefix: u8,
    trusted: Vec<crate::request::descriptor::IpNet>,
    open: parking_lot::Mutex<ahash::AHashMap<std::net::IpAddr, usize>>,
    refused: prometheus::IntCounter,
    /// The whole refusal, built once (its reason header name is configurable).
    busy: Vec<u8>,
}

impl PerClient {
    pub fn new(
        max: usize,
        ipv6_prefix: u8,
        trusted: Vec<crate::request::descriptor::IpNet>,
        reason_header: &str,
        refused: prometheus::IntCounter,
    ) -> Arc<Self> {
        let body = "Too Many Requests: too many connections from your address\r\n";
        let busy = format!(
            "HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nRetry-After: 1\r\n{reason_header}: connection_limit\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes();
        Arc::new(PerClient {
            max,
            ipv6_prefix,
            trusted,
            open: parking_lot::Mutex::new(ahash::AHashMap::new()),
            refused,
            busy,
        })
    }

    /// Counts a new connection from `peer`: `Ok(None)` when it is not counted (a trusted
    /// proxy), `Err(())` when the address already holds its cap.
    fn enter(self: &Arc<Self>, peer: std::net::IpAddr) -> Result<Option<ClientSlot>, ()> {
        let peer = crate::request::descriptor::canonical_ip(peer);
        if crate::request::client_addr::in_any(&self.trusted, peer) {
            return Ok(None);
        }
        let key = crate::request::descriptor::client_net(peer, self.ipv6_prefix);
        let mut open = self.open.lock();
        let count = open.entry(key).or_insert(0);
        if *count >= self.max {
            if *count == 0 {
                open.remove(&key);
            }
            self.refused.inc();
            return Err(());
        }
        *count += 1;
        Ok(Some(ClientSlot {
            owner: Arc::clone(self),
            key,
        }))
    }

    /// Connections open from `ip`'s address or network (tests).
    pub fn open(&self, ip: std::net::IpAddr) -> usize {
        self.open.lock().get(&ip).copied().unwrap_or(0)
    }
}

/// One counted connection; given back when the connection ends, however it ends.
struct ClientSlot {
    owner: Arc<PerClient>,
    key: std::net::IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.owner.open.lock();
        if let Some(count) = open.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// A [`ServerApp`] wrapping another with [`Limits`].
pub struct Guarded<A> {
    inner: Arc<A>,
    slots: Arc<Semaphore>,
    limits: Limits,
}

impl<A> Guarded<A> {
    pub fn new(inner: A, limits: Limits) -> Self {
        Guarded {
            inner: Arc::new(inner),
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
        }
    }
}

const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 52\r\nConnection: close\r\n\r\nService Unavailable: too many connections, retry.\r\n";

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Guarded<A> {
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        // The peer is looked up only when connections are capped per address.
        let capped = self.limits.per_client.as_ref().and_then(|per_client| {
            let peer = stream.get_socket_digest()?.peer_addr()?.as_inet()?.ip();
            Some((per_client, peer))
        });
        let _client_slot = match capped {
            Some((per_client, ip)) => match per_client.enter(ip) {
                Ok(slot) => slot,
                Err(()) => {
                    let busy = per_client.busy.clone();
                    let _ = tokio::time::timeout(Duration::from_millis(200), async {
                        let _ = stream.write_all(&busy).await;
                        let _ = stream.flush().await;
                    })
                    .await;
                    return None;
                }
            },
            None => None,
        };
        let Ok(_slot) = Arc::clone(&self.slots).try_acquire_owned() else {
            // Best effort and bounded: the socket is closed right after.
            let _ = tokio::time::timeout(Duration::from_millis(200), async {
                let _ = stream.write_all(BUSY).await;
                let _ = stream.flush().await;
            })
            .await;
            return None;
        };
        let connection = Arc::new(Connection {
            clock: DeadlineClock::new(),
            peer: std::sync::OnceLock::new(),
            forwarding: std::sync::OnceLock::new(),
            active: AtomicUsize::new(0),
        });
        connection.clock.arm(self.limits.header_timeout);
        let registered = Arc::clone(&connection);
        let h2c = self.limits.h2c;
        let serve = CONNECTION.scope(Arc::clone(&connection), async move {
            // HTTP/2 (ALPN, or the h2c preface, peeked under the header deadline): the streams
            // find this connection through its socket digest, so the header deadline holds
            // until the first stream's header and the idle deadline after the last stream.
            let _registration = if is_http2(&mut stream, h2c).await {
                stream.get_socket_digest().map(|digest| {
                    let key = Arc::as_ptr(&digest) as usize;
                    HTTP2_CONNECTIONS.lock().insert(key, registered);
                    Http2Registration(key)
                })
            } else {
                None
            };
            ServerApp::process_new(&self.inner, stream, shutdown).await
        });
        // Dropping the connection's future closes its socket.
        Watched::new(serve, connection.clock.expired()).await
    }

    async fn cleanup(&self) {
        // The proxy app wakes its keep-alive waiters here on shutdown.
        self.inner.cleanup().await;
    }
}

/// Whether a new connection speaks HTTP/2: negotiated by ALPN on TLS, or (with h2c) starting
/// with the HTTP/2 preface on cleartext.
async fn is_http2(stream: &mut Stream, h2c: bool) -> bool {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    if matches!(
        stream.selected_alpn_proto(),
        Some(pingora::protocols::ALPN::H2)
    ) {
        return true;
    }
    if !h2c || stream.get_ssl_digest().is_some() {
        return false;
    }
    let mut buf = [0u8; PREFACE.len()];
    matches!(stream.try_peek(&mut buf).await, Ok(true)) && buf == PREFACE
}

/// Resolves once the client of the connection on `fd` has gone ([`peer_closed`], looked at
/// every `every`); pending for as long as it is there.
pub async fn gone(fd: i32, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if peer_closed(fd) {
            return;
        }
    }
}

/// Whether the client of the connection on `fd` has gone: end-of-file (or an error such as a
/// reset) is readable without blocking. A peek: nothing is consumed, so a pipelined request or
/// a body still arriving is left for its reader.
pub fn peer_closed(fd: i32) -> bool {
    let mut byte = [0u8; 1];
    // SAFETY: recv(2) with MSG_PEEK | MSG_DONTWAIT on the fd of a connection whose request is
    // being served (so it stays open meanwhile), into a live one-byte buffer.
    let read = unsafe {
        libc::recv(
            fd,
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match read {
        0 => true,
        n if n > 0 => false,
        _ => !matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EAGAIN | libc::EINTR)
        ),
    }
}

/// Raises the soft open-file limit to the hard limit, and returns the soft limit in force.
pub fn raise_nofile_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
        limit.rlim_cur
    }
}

/// Most connections held by default, whatever the open-file limit: at about 29 KB per idle
/// connection (measured), 50 000 of them stay under 1.5 GB.
pub const DEFAULT_MAX_CONNECTIONS_CEILING: usize = 50_000;

/// The default connection cap for an open-file limit: every proxied request may also hold an
/// upstream socket, and the upstream pool, the listeners, the admin side and the store need
/// their own, so half of what is left after a reserve; never above
/// [`DEFAULT_MAX_CONNECTIONS_CEILING`].
pub fn default_max_connections(nofile: u64, upstream_pool: usize) -> usize {
    let reserve = upstream_pool as u64 + 256;
    (nofile.saturating_sub(reserve) / 2).clamp(64, DEFAULT_MAX_CONNECTIONS_CEILING as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_clients_share_their_network_and_slots_come_back() {
        let counter = prometheus::IntCounter::new("t", "t").unwrap();
        let per = PerClient::new(2, 64, Vec::new(), "X-Tollgate-Reason", counter.clone());
        let a: std::net::IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: std::net::IpAddr = "2001:db8:1:2::2".parse().unwrap();
        let other: std::net::IpAddr = "2001:db8:1:3::1".parse().unwrap();
        let first = per.enter(a).unwrap();
        let second = per.enter(b).unwrap();
        assert!(per.enter(a).is_err());
        assert_eq!(counter.get(), 1);
        assert!(per.enter(other).unwrap().is_some());
        drop(first);
        let net: std::net::IpAddr = "2001:db8:1:2::".parse().unwrap();
        assert_eq!(per.open(net), 1);
        drop(second);
        assert_eq!(per.open(net), 0);
        // IPv4-mapped IPv6 is the IPv4 client.
        let v4 = per.enter("::ffff:10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(per.open("10.0.0.1".parse().unwrap()), 1);
        drop(v4);
    }

    #[test]
    fn the_connection_cap_leaves_room_below_the_fd_limit() {
        assert_eq!(default_max_connections(1024, 256), 256);
        assert_eq!(default_max_connections(65_536, 256), 32_512);
        // Never below a usable floor, never above the memory ceiling.
        assert_eq!(default_max_connections(256, 256), 64);
        assert_eq!(default_max_connections(1_048_576, 256), 50_000);
    }

    /// The connection's own result when it ends first; `None` once its deadline passes, which
    /// the deadline's own wake-ups (re-armed, timer) drive while the connection sleeps.
    #[tokio::test(start_paused = true)]
    async fn a_watched_connection_ends_at_its_deadline_or_with_its_result() {
        let done = Watched::new(async { Some(7) }, std::future::pending::<()>()).await;
        assert_eq!(done, Some(7));
        let clock = Arc::new(DeadlineClock::new());
        clock.arm(Duration::from_secs(10));
        let watched = {
            let clock = Arc::clone(&clock);
            tokio::spawn(async move {
                Watched::new(std::future::pending::<Option<u8>>(), clock.expired()).await
            })
        };
        serve_then_idle(&clock, &watched).await;
        assert_eq!(watched.await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_fires_only_while_armed() {
        let clock = Arc::new(DeadlineClock::new());
        clock.arm(Duration::from_secs(10));
        let waiter = {
            let clock = Arc::clone(&clock);
            tokio::spawn(async move { clock.expired().await })
        };
        serve_then_idle(&clock, &waiter).await;
    }

    /// The timeline both deadline tests drive, `clock` armed for 10 s when it starts: at 5 s a
    /// request is being served (disarmed: no deadline, however long it takes), at 105 s the
    /// response is done (armed again, 3 s of idle); `waiter` must end at 108 s, not before.
    async fn serve_then_idle<T>(clock: &DeadlineClock, waiter: &tokio::task::JoinHandle<T>) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        clock.disarm();
        tokio::time::sleep(Duration::from_secs(100)).await;
        assert!(!waiter.is_finished());
        // Armed again (its notification wakes the waiter): 3 s from now.
        clock.arm(Duration::from_secs(3));
        tokio::time::sleep(Duration::from_millis(2_900)).await;
        assert!(!waiter.is_finished());
        tokio::time::sleep(Duration::from_millis(200)).await;
        tokio::task::yield_now().await;
        assert!(waiter.is_finished());
    }
}
