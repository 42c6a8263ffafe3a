//! Upstream groups as Pingora load balancers (`pingora-load-balancing`): a [`GroupSpec`]
//! becomes a round-robin or consistent-hash balancer over its servers, one prepared
//! [`HttpPeer`] per server (HTTPS with SNI and verification against the group's CA file or the
//! system roots, connect and read timeouts), active HTTP health checks with thresholds, and
//! what a failed connection does ([`Group::connect_failed`]):
//!
//! - **retries**: nothing was sent, so a request whose connection failed is tried again — on
//!   another server when the group has one, else on the same — up to [`MAX_CONNECT_TRIES`]
//!   attempts, within the group's retry budget (retries in a second at most a fifth of the
//!   requests, and at least [`MIN_RETRIES_PER_SECOND`]), so retries cannot multiply an outage;
//! - **passive ejection** (Envoy's outlier detection): a server is skipped for one
//!   health-check interval (10 s without checks) after [`EJECT_AFTER_DOWN`] consecutive
//!   failures that prove it down (refused, unreachable, reset, TLS) or [`EJECT_AFTER_TIMEOUTS`]
//!   consecutive connect timeouts (a timeout may only be a full accept queue), and never when
//!   that would leave the group without a server to try; a group whose servers are all ejected
//!   still tries them (Envoy's panic mode) rather than answering 502 at once.
//!
//! The whole set is swapped on reload ([`Upstreams`] behind an `ArcSwap`): a request holds the
//! group it was routed to, so nothing in flight is dropped.

use crate::config::routes::{Balance, GroupSpec, HealthProtocol, RouteTable};
use parking_lot::Mutex;
use pingora::lb::health_check::HttpHealthCheck;
use pingora::lb::selection::{Consistent, RoundRobin};
use pingora::lb::LoadBalancer;
use pingora::prelude::HttpPeer;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Why an upstream group cannot be built. Each names the group.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamsError {
    /// Its balancer cannot be made from its servers.
    #[error("upstream group {group:?}: {source}")]
    Balancer {
        group: String,
        source: std::io::Error,
    },
    /// Its health check's request cannot be made.
    #[error("upstream group {group:?}: health check: {source}")]
    HealthCheck {
        group: String,
        source: Box<pingora::Error>,
    },
}

/// The groups and the routes of one gateway file (or of `--upstream`).
pub struct Upstreams {
    pub table: RouteTable,
    pub groups: Vec<Arc<Group>>,
}

impl Upstreams {
    /// Builds every group's balancer and peers.
    ///
    /// # Errors
    /// A group whose balancer cannot be built (names the group).
    pub fn build(table: RouteTable) -> Result<Upstreams, UpstreamsError> {
        let groups = table
            .groups
            .iter()
            .map(|spec| Group::build(spec.clone()).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Upstreams { table, groups })
    }

    /// The group for a request.
    pub fn route(&self, host: Option<&str>, path: &str) -> Option<&Arc<Group>> {
        self.table.pick(host, path).and_then(|i| self.groups.get(i))
    }

    /// The group for a request and the header rules of the route that chose it.
    pub fn route_with_rules(
        &self,
        host: Option<&str>,
        path: &str,
    ) -> Option<(
        &Arc<Group>,
        Option<&Arc<crate::request::forwarding::RouteHeaders>>,
    )> {
        let (group, rules) = self.table.pick_route(host, path)?;
        self.groups.get(group).map(|g| (g, rules))
    }
}

enum Balancer {
    RoundRobin(LoadBalancer<RoundRobin>),
    ClientHash(LoadBalancer<Consistent>),
}

impl Balancer {
    /// Round-robin or consistent hashing over the group's servers.
    fn build(spec: &GroupSpec) -> Result<Balancer, UpstreamsError> {
        let addrs: Vec<String> = spec.servers.iter().map(ToString::to_string).collect();
        let fail = |source| UpstreamsError::Balancer {
            group: spec.name.clone(),
            source,
        };
        Ok(match spec.balance {
            Balance::RoundRobin => {
                Balancer::RoundRobin(LoadBalancer::try_from_iter(addrs.iter()).map_err(fail)?)
            }
            Balance::ClientHash => {
                Balancer::ClientHash(LoadBalancer::try_from_iter(addrs.iter()).map_err(fail)?)
            }
        })
    }
}

/// What every peer of a group shares: TLS and its name, the CA, the pool key and timeouts.
struct Peers<'a> {
    spec: &'a GroupSpec,
    ca: Option<Arc<[pingora::utils::tls::WrappedX509]>>,
    group_key: u64,
}

impl<'a> Peers<'a> {
    fn of(spec: &'a GroupSpec) -> Peers<'a> {
        let ca = spec.tls.as_ref().and_then(|tls| {
            (!tls.ca_der.is_empty()).then(|| {
                let certs: Vec<pingora::utils::tls::WrappedX509> = tls
                    .ca_der
                    .iter()
                    .map(|der| {
                        pingora::utils::tls::WrappedX509::new(
                            der.clone(),
                            pingora::utils::tls::parse_x509,
                        )
                    })
                    .collect();
                Arc::<[pingora::utils::tls::WrappedX509]>::from(certs)
            })
        });
        // Pooled connections are shared only within a group: Pingora's reuse key covers the
        // address and SNI but not the CA, so without this a connection verified by one group's
        // CA could serve a group that trusts another (or only the system's roots).
        let group_key = {
            let mut h = twox_hash::XxHash64::with_seed(0x67726f7570);
            use std::hash::Hasher;
            h.write(spec.name.as_bytes());
            if let Some(tls) = &spec.tls {
                h.write(tls.sni.as_bytes());
                for der in &tls.ca_der {
                    h.write(der);
                }
            }
            h.finish()
        };
        Peers {
            spec,
            ca,
            group_key,
        }
    }

    /// The prepared peer for `addr`.
    fn peer(&self, addr: SocketAddr) -> HttpPeer {
        let spec = self.spec;
        let (tls, sni) = match &spec.tls {
            Some(t) => (true, t.sni.clone()),
            None => (false, String::new()),
        };
        let mut peer = HttpPeer::new(addr, tls, sni);
        peer.group_key = self.group_key;
        peer.options.connection_timeout = Some(spec.connect_timeout);
        peer.options.read_timeout = Some(spec.read_timeout);
        peer.options.idle_timeout = spec.idle_timeout;
        if spec.protocol.is_http2() {
            // HTTP/2 only: ALPN `h2` over TLS; in cleartext, prior knowledge (Pingora speaks
            // h2c to a plain peer whose lowest version is 2). Each connection carries up to
            // this many streams at once before another is opened.
            peer.options.set_http_version(2, 2);
            peer.options.max_h2_streams = H2_STREAMS_PER_CONNECTION;
        }
        if let Some(ca) = &self.ca {
            peer.options.ca = Some(Arc::clone(ca));
        }
        peer
    }
}

/// Streams one HTTP/2 connection to a server carries at once (Pingora's default is 1): 100, the
/// lowest `SETTINGS_MAX_CONCURRENT_STREAMS` RFC 9113 asks servers to allow. A request beyond
/// it opens another connection.
pub const H2_STREAMS_PER_CONNECTION: usize = 100;

/// The group's active health check: over the group's protocol, an HTTP `GET path` or a gRPC
/// health check ([`super::grpc_health`]).
fn health_check(
    spec: &GroupSpec,
    peers: &Peers<'_>,
    path: &str,
    hc: &crate::config::routes::HealthCheckSpec,
) -> Result<Box<dyn pingora::lb::health_check::HealthCheck + Send + Sync>, UpstreamsError> {
    let mut template = peers.peer(SocketAddr::from(([0, 0, 0, 0], 1)));
    template.options.connection_timeout = Some(hc.timeout);
    template.options.read_timeout = Some(hc.timeout);
    match spec.health {
        HealthProtocol::Grpc => Ok(Box::new(super::grpc_health::GrpcHealthCheck::new(
            template,
            authority(spec),
            path,
            hc,
        ))),
        HealthProtocol::Http => http_health_check(spec, template, path, hc),
    }
}

/// What a health check sends as `Host` (`:authority`): the group's TLS name, or `localhost`.
fn authority(spec: &GroupSpec) -> String {
    spec.tls
        .as_ref()
        .map_or_else(|| "localhost".to_string(), |t| t.sni.clone())
}

/// `GET path` with the group's TLS name (or `localhost`) as `Host`, within its own timeout.
fn http_health_check(
    spec: &GroupSpec,
    template: HttpPeer,
    path: &str,
    hc: &crate::config::routes::HealthCheckSpec,
) -> Result<Box<dyn pingora::lb::health_check::HealthCheck + Send + Sync>, UpstreamsError> {
    let host = authority(spec);
    let mut check = HttpHealthCheck::new(&host, spec.tls.is_some());
    check.consecutive_success = hc.healthy_threshold;
    check.consecutive_failure = hc.unhealthy_threshold;
    check.peer_template = template;
    let fail = |source| UpstreamsError::HealthCheck {
        group: spec.name.clone(),
        source,
    };
    let mut req =
        pingora::http::RequestHeader::build("GET", path.as_bytes(), None).map_err(fail)?;
    req.append_header("Host", host.as_str()).map_err(fail)?;
    check.req = req;
    Ok(Box::new(check))
}

/// One server of a group, with what selection reads on every request: atomics only.
struct Server {
    addr: SocketAddr,
    /// Prepared once (cloned per request: no resolving, no parsing).
    peer: HttpPeer,
    /// The health checks' verdict, copied after each round.
    healthy: AtomicBool,
    /// Skipped until this many ms after the group was built (0: not ejected).
    ejected_until_ms: AtomicU64,
    /// Connect failures since the last connection that worked: refused, unreachable, reset or
    /// TLS, and timeouts.
    failures_down: AtomicU32,
    failures_timeout: AtomicU32,
    /// The group's `max_connections` for this server, if it has one.
    slots: Option<Arc<super::queue::Slots>>,
}

/// Most connection attempts per request.
pub const MAX_CONNECT_TRIES: usize = 3;
/// Consecutive refused, unreachable, reset or TLS failures that eject a server.
pub const EJECT_AFTER_DOWN: u32 = 3;
/// Consecutive connect timeouts that eject a server.
pub const EJECT_AFTER_TIMEOUTS: u32 = 5;
/// Retries a group may make in any second, whatever its traffic.
pub const MIN_RETRIES_PER_SECOND: u64 = 10;

/// Why a connection to a server failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectFailure {
    Refused,
    TimedOut,
    Unreachable,
    Reset,
    Tls,
    Other,
}

impl ConnectFailure {
    /// The label in logs and in `tollgate_upstream_connect_failures_total{kind}`.
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectFailure::Refused => "refused",
            ConnectFailure::TimedOut => "timeout",
            ConnectFailure::Unreachable => "unreachable",
            ConnectFailure::Reset => "reset",
            ConnectFailure::Tls => "tls",
            ConnectFailure::Other => "other",
        }
    }

    pub const ALL: [ConnectFailure; 6] = [
        ConnectFailure::Refused,
        ConnectFailure::TimedOut,
        ConnectFailure::Unreachable,
        ConnectFailure::Reset,
        ConnectFailure::Tls,
        ConnectFailure::Other,
    ];

    /// Pingora's error type of a failed connect.
    pub fn of(etype: &pingora::ErrorType) -> ConnectFailure {
        use pingora::ErrorType as E;
        match etype {
            E::ConnectRefused => ConnectFailure::Refused,
            E::ConnectTimedout => ConnectFailure::TimedOut,
            E::ConnectNoRoute => ConnectFailure::Unreachable,
            E::TLSHandshakeFailure
            | E::TLSHandshakeTimedout
            | E::InvalidCert
            | E::HandshakeError
            | E::TLSWantX509Lookup => ConnectFailure::Tls,
            E::ConnectionClosed | E::ReadError | E::WriteError => ConnectFailure::Reset,
            _ => ConnectFailure::Other,
        }
    }

    /// A failed connect, by its error type and, where Pingora files it under a plain
    /// `ConnectError`, by the system error underneath (a reset during connect is one).
    pub fn of_error(e: &pingora::Error) -> ConnectFailure {
        let kind = ConnectFailure::of(e.etype());
        if kind != ConnectFailure::Other {
            return kind;
        }
        let mut cause: Option<&(dyn std::error::Error + 'static)> = e
            .cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static));
        while let Some(c) = cause {
            if let Some(io) = c.downcast_ref::<std::io::Error>() {
                use std::io::ErrorKind as K;
                if matches!(
                    io.kind(),
                    K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe
                ) {
                    return ConnectFailure::Reset;
                }
            }
            cause = c.source();
        }
        kind
    }
}

/// What [`Group::connect_failed`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureOutcome {
    /// The server was ejected now.
    pub ejected: bool,
    /// The request may try again.
    pub retry: bool,
}

/// Requests and retries of the current second.
#[derive(Default)]
struct RetryBudget {
    second: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

/// One upstream group, ready to serve.
pub struct Group {
    pub spec: GroupSpec,
    /// The group's name, shared with the traces' CLIENT spans (`tollgate.upstream_group`)
    /// rather than copied into each.
    pub name: Arc<str>,
    /// Pingora's balancer: the health checks and their thresholds, and the Ketama ring.
    balancer: Balancer,
    servers: Vec<Server>,
    /// Round-robin position.
    next: AtomicUsize,
    built: Instant,
    /// When the next active health check is due.
    next_check: Mutex<Instant>,
    budget: RetryBudget,
}

impl Group {
    /// The group's balancer, its servers' prepared peers and its health check.
    fn build(spec: GroupSpec) -> Result<Group, UpstreamsError> {
        let mut balancer = Balancer::build(&spec)?;
        let peers = Peers::of(&spec);
        if let Some((path, hc)) = &spec.health_check {
            let check = health_check(&spec, &peers, path, hc)?;
            match &mut balancer {
                Balancer::RoundRobin(lb) => lb.set_health_check(check),
                Balancer::ClientHash(lb) => lb.set_health_check(check),
            }
        }
        let servers = spec
            .servers
            .iter()
            .map(|addr| Server {
                addr: *addr,
                peer: peers.peer(*addr),
                healthy: AtomicBool::new(true),
                ejected_until_ms: AtomicU64::new(0),
                failures_down: AtomicU32::new(0),
                failures_timeout: AtomicU32::new(0),
                slots: spec.max_connections.map(|max| {
                    Arc::new(super::queue::Slots::new(
                        max,
                        spec.max_connections_per_client,
                    ))
                }),
            })
            .collect();
        Ok(Group {
            name: Arc::from(spec.name.as_str()),
            balancer,
            servers,
            next: AtomicUsize::new(0),
            built: Instant::now(),
            next_check: Mutex::new(Instant::now()),
            budget: RetryBudget::default(),
            spec,
        })
    }

    fn now_ms(&self) -> u64 {
        self.built.elapsed().as_millis() as u64
    }

    fn server(&self, addr: SocketAddr) -> Option<&Server> {
        self.servers.iter().find(|s| s.addr == addr)
    }

    /// Whether `server` may take a request now (`ignore_ejection`: a last resort when every
    /// healthy server has been ejected).
    fn available(&self, server: &Server, now_ms: u64, ignore_ejection: bool) -> bool {
        server.healthy.load(Ordering::Relaxed)
            && (ignore_ejection || server.ejected_until_ms.load(Ordering::Relaxed) <= now_ms)
    }

    /// A healthy server that is not ejected, and its peer. When every healthy server has been
    /// ejected, one of them anyway (a restarted server is found at once, not after the
    /// ejection); `None` when the health checks find every server down. Round-robin reads only
    /// atomics; client hashing walks Pingora's Ketama ring.
    pub fn select(
        &self,
        client_ip: Option<std::net::IpAddr>,
        avoid: Option<SocketAddr>,
    ) -> Option<(SocketAddr, Box<HttpPeer>)> {
        let now_ms = self.now_ms();
        if avoid.is_none() {
            self.count_request(now_ms);
        }
        // A retry goes to another server when there is one to take it.
        let other = |s: &Server| avoid != Some(s.addr);
        for (ignore_ejection, avoiding) in [(false, true), (false, false), (true, false)] {
            let usable =
                |s: &Server| self.available(s, now_ms, ignore_ejection) && (!avoiding || other(s));
            let found = match &self.balancer {
                Balancer::ClientHash(lb) => {
                    let key = match client_ip.map(crate::request::descriptor::canonical_ip) {
                        Some(std::net::IpAddr::V4(v4)) => v4.octets().to_vec(),
                        Some(std::net::IpAddr::V6(v6)) => v6.octets().to_vec(),
                        None => Vec::new(),
                    };
                    // Ketama puts 160 points per server on its ring: enough steps to visit
                    // every server.
                    let tries = self.servers.len().max(1) * 256;
                    lb.select_with(&key, tries, |backend, _| {
                        backend
                            .addr
                            .as_inet()
                            .and_then(|addr| self.server(*addr))
                            .is_some_and(usable)
                    })
                    .and_then(|b| b.addr.as_inet().and_then(|a| self.server(*a)))
                }
                // One server: no turn to take (the shared counter is not touched).
                Balancer::RoundRobin(_) if self.servers.len() == 1 => {
                    self.servers.first().filter(|s| usable(s))
                }
                Balancer::RoundRobin(_) => {
                    let n = self.servers.len();
                    let start = self.next.fetch_add(1, Ordering::Relaxed);
                    (0..n)
                        .map(|i| &self.servers[(start + i) % n])
                        .find(|s| usable(s))
                }
            };
            if let Some(server) = found {
                // Cloned straight into the box Pingora takes (a peer is a few hundred bytes).
                return Some((server.addr, Box::new(server.peer.clone())));
            }
        }
        None
    }

    /// The slots of `addr` when the group caps requests in flight per server.
    pub fn slots(&self, addr: SocketAddr) -> Option<&Arc<super::queue::Slots>> {
        self.server(addr).and_then(|s| s.slots.as_ref())
    }

    /// A connection to `addr` worked: its run of failures ends.
    pub fn connected(&self, addr: SocketAddr) {
        if let Some(server) = self.server(addr) {
            // Read first: most connections follow a success, and a plain load keeps the
            // cache line shared.
            if server.failures_down.load(Ordering::Relaxed) != 0 {
                server.failures_down.store(0, Ordering::Relaxed);
            }
            if server.failures_timeout.load(Ordering::Relaxed) != 0 {
                server.failures_timeout.store(0, Ordering::Relaxed);
            }
        }
    }

    /// A connection to `addr` failed (attempt `tries` of the request): counts it, ejects the
    /// server when its run of failures proves it down and another server can take its share,
    /// and says whether the request may try again (attempts and the retry budget left).
    pub fn connect_failed(
        &self,
        addr: SocketAddr,
        kind: ConnectFailure,
        tries: usize,
    ) -> FailureOutcome {
        let now_ms = self.now_ms();
        let mut ejected = false;
        if let Some(server) = self.server(addr) {
            let (run, limit) = match kind {
                ConnectFailure::TimedOut => (&server.failures_timeout, EJECT_AFTER_TIMEOUTS),
                // A local failure (no socket, no port to bind) says nothing about the server.
                ConnectFailure::Other => (&server.failures_down, u32::MAX),
                _ => (&server.failures_down, EJECT_AFTER_DOWN),
            };
            let failures = match kind {
                ConnectFailure::Other => run.load(Ordering::Relaxed),
                _ => run.fetch_add(1, Ordering::Relaxed) + 1,
            };
            let others_left = self
                .servers
                .iter()
                .any(|s| s.addr != addr && self.available(s, now_ms, false));
            if failures >= limit && others_left {
                let until = now_ms + self.spec.ejection().as_millis() as u64;
                ejected = server.ejected_until_ms.swap(until, Ordering::Relaxed) <= now_ms;
                run.store(0, Ordering::Relaxed);
            }
        }
        let retry = tries < MAX_CONNECT_TRIES && self.take_retry(now_ms);
        FailureOutcome { ejected, retry }
    }

    /// The budget's second, starting a new one when `now_ms` is past it.
    fn budget_second(&self, now_ms: u64) {
        let second = now_ms / 1000;
        let budget = &self.budget;
        let current = budget.second.load(Ordering::Relaxed);
        if current != second
            && budget
                .second
                .compare_exchange(current, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            budget.requests.store(0, Ordering::Relaxed);
            budget.retries.store(0, Ordering::Relaxed);
        }
    }

    fn count_request(&self, now_ms: u64) {
        self.budget_second(now_ms);
        self.budget.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one retry from this second's budget: at most a fifth of the second's requests,
    /// and at least [`MIN_RETRIES_PER_SECOND`].
    fn take_retry(&self, now_ms: u64) -> bool {
        self.budget_second(now_ms);
        let allowed =
            (self.budget.requests.load(Ordering::Relaxed) / 5).max(MIN_RETRIES_PER_SECOND);
        self.budget
            .retries
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                (r < allowed).then_some(r + 1)
            })
            .is_ok()
    }

    /// Whether an active health check is due now (and claims it: the next one is an interval
    /// later, so a slow check never runs twice at once).
    pub fn claim_health_check(&self) -> bool {
        let Some((_, hc)) = &self.spec.health_check else {
            return false;
        };
        let mut next = self.next_check.lock();
        let now = Instant::now();
        if now < *next {
            return false;
        }
        // A check may take up to its timeout: the next starts no sooner than that.
        *next = now + hc.interval.max(hc.timeout);
        true
    }

    /// Checks every server once (in parallel), feeding the thresholds.
    pub async fn run_health_check(&self) {
        let backends = match &self.balancer {
            Balancer::RoundRobin(lb) => lb.backends(),
            Balancer::ClientHash(lb) => lb.backends(),
        };
        backends.run_health_check(true).await;
        for backend in backends.get_backend().iter() {
            if let Some(server) = backend.addr.as_inet().and_then(|a| self.server(*a)) {
                let ready = backends.ready(backend);
                server.healthy.store(ready, Ordering::Relaxed);
                // A check that finds an ejected server up brings it back at once.
                if ready {
                    server.ejected_until_ms.store(0, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::ErrorType as E;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn group(ports: &[u16]) -> Group {
        Group::build(GroupSpec::from_flag(
            ports.iter().map(|p| addr(*p)).collect(),
        ))
        .expect("a group")
    }

    #[test]
    fn connect_failures_are_named_by_what_happened() {
        let io = |kind: std::io::ErrorKind| {
            pingora::Error::because(E::ConnectError, "connect", std::io::Error::from(kind))
        };
        let of = |e: Box<pingora::Error>| ConnectFailure::of_error(&e);
        assert_eq!(
            of(pingora::Error::new(E::ConnectRefused)),
            ConnectFailure::Refused
        );
        assert_eq!(
            of(pingora::Error::new(E::ConnectTimedout)),
            ConnectFailure::TimedOut
        );
        assert_eq!(
            of(pingora::Error::new(E::TLSHandshakeFailure)),
            ConnectFailure::Tls
        );
        assert_eq!(
            of(io(std::io::ErrorKind::ConnectionReset)),
            ConnectFailure::Reset
        );
        assert_eq!(of(io(std::io::ErrorKind::AddrInUse)), ConnectFailure::Other);
        assert_eq!(
            of(pingora::Error::new(E::ConnectNoRoute)),
            ConnectFailure::Unreachable
        );
    }

    /// Retries in a second: at least 10, else a fifth of the second's requests; and never more
    /// than 3 attempts for one request.
    #[test]
    fn retries_are_budgeted() {
        let g = group(&[1]);
        let outcomes: Vec<bool> = (0..11)
            .map(|_| g.connect_failed(addr(1), ConnectFailure::Refused, 1).retry)
            .collect();
        assert_eq!(outcomes.iter().filter(|r| **r).count(), 10);
        assert!(!outcomes[10]);
        // 100 requests this second: 20 retries in all, 10 more.
        for _ in 0..100 {
            g.select(None, None);
        }
        let more = (0..20)
            .filter(|_| g.connect_failed(addr(1), ConnectFailure::Refused, 1).retry)
            .count();
        assert_eq!(more, 10);
        // Whatever the budget, a third failed attempt is the last.
        let g = group(&[1]);
        assert!(!g.connect_failed(addr(1), ConnectFailure::Refused, 3).retry);
    }

    /// A group of one server offers it to every request and to a retry that would rather
    /// avoid it, and offers nothing once the health checks find it down.
    #[test]
    fn a_single_server_is_offered_while_healthy() {
        let g = group(&[1]);
        assert_eq!(g.select(None, None).map(|s| s.0), Some(addr(1)));
        assert_eq!(g.select(None, Some(addr(1))).map(|s| s.0), Some(addr(1)));
        let (_, peer) = g.select(None, None).unwrap();
        assert_eq!(peer._address.to_string(), addr(1).to_string());
        g.servers[0].healthy.store(false, Ordering::Relaxed);
        assert!(g.select(None, None).is_none());
    }

    /// Consecutive failures eject a server while another can take its share; the last one is
    /// never ejected, a group's only server not even by timeouts; and a group whose servers are
    /// all ejected still tries them (no 502 without an attempt).
    #[test]
    fn ejection_never_empties_a_group() {
        let g = group(&[1, 2]);
        let ejected = |g: &Group, port, kind| g.connect_failed(addr(port), kind, 1).ejected;
        assert!(!ejected(&g, 1, ConnectFailure::Refused));
        assert!(!ejected(&g, 1, ConnectFailure::Refused));
        assert!(ejected(&g, 1, ConnectFailure::Refused));
        // Only 2 is offered now, whichever the round-robin turn.
        for _ in 0..4 {
            assert_eq!(g.select(None, None).map(|s| s.0), Some(addr(2)));
        }
        // 2 is the last one standing: never ejected.
        for _ in 0..6 {
            assert!(!ejected(&g, 2, ConnectFailure::Refused));
        }
        // Timeouts eject after 5 in a row, and a success in between starts the run again.
        let g = group(&[1, 2]);
        for _ in 0..4 {
            assert!(!ejected(&g, 1, ConnectFailure::TimedOut));
        }
        g.connected(addr(1));
        for _ in 0..4 {
            assert!(!ejected(&g, 1, ConnectFailure::TimedOut));
        }
        assert!(ejected(&g, 1, ConnectFailure::TimedOut));
        // A single server is never ejected by timeouts either.
        let g = group(&[1]);
        for _ in 0..20 {
            assert!(!ejected(&g, 1, ConnectFailure::TimedOut));
        }
        assert_eq!(g.select(None, None).map(|s| s.0), Some(addr(1)));
        // Every server ejected (as a race of two failing servers can leave them): both are
        // still tried.
        let g = group(&[1, 2]);
        for s in &g.servers {
            s.ejected_until_ms.store(u64::MAX, Ordering::Relaxed);
        }
        let picked: std::collections::BTreeSet<SocketAddr> = (0..4)
            .filter_map(|_| g.select(None, None).map(|s| s.0))
            .collect();
        assert_eq!(picked.len(), 2);
    }
}
