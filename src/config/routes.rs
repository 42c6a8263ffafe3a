//! The gateway file (`--routes FILE`, JSON): named upstream groups and the routes that pick
//! one by host and path. Compiled and validated here once (every error with its JSON path, as
//! for policies); [`RouteTable::pick`] is the per-request lookup. Pure: no sockets, no Pingora
//! (the glue in `proxy::upstreams` turns a [`GroupSpec`] into load balancers and peers).
//!
//! ```json
//! {
//!   "upstreams": {
//!     "api": { "servers": ["10.0.0.1:8080", "10.0.0.2:8080"], "balance": "round_robin",
//!              "connect_timeout_ms": 5000, "read_timeout_ms": 30000, "idle_timeout_ms": 60000,
//!              "tls": { "sni": "api.internal", "ca_file": "/etc/tollgate/ca.pem" },
//!              "health_check": { "path": "/healthz", "interval_ms": 2000,
//!                                "healthy_threshold": 2, "unhealthy_threshold": 2 },
//!              "max_connections": 64, "queue_timeout_ms": 10000 },
//!     "rpc": { "servers": ["10.0.0.5:50051"], "protocol": "h2c", "health": "grpc",
//!              "health_check": { "interval_ms": 2000 } }
//!   },
//!   "routes": [ { "host": "api.example.com", "path_prefix": "/v1", "upstream": "api",
//!                 "request_headers": { "set": { "X-Client-Ip": "${client_addr}" } },
//!                 "response_headers": { "remove": ["Server"] } },
//!               { "host": "*.example.com", "upstream": "api" } ],
//!   "default_upstream": "api",
//!   "forwarded": true
//! }
//! ```

use crate::policy::json::{self, join};
use crate::policy::{path_has_prefix, FieldError};
use crate::request::forwarding::RouteHeaders;
use serde_json::{Map, Value};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How a group spreads requests over its healthy servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    RoundRobin,
    /// Consistent hashing (Ketama) on the client address: a client keeps its server while it is
    /// healthy, and only the clients of a server that leaves move.
    ClientHash,
}

/// What a group speaks to its servers (`"protocol"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamProtocol {
    /// HTTP/1.1, one request at a time per connection (the default); with `tls`, HTTPS.
    #[default]
    Http1,
    /// HTTP/2 over TLS, negotiated by ALPN `h2` (needs `tls`): streams multiplexed over pooled
    /// connections, trailers relayed (what gRPC needs).
    H2,
    /// HTTP/2 in cleartext with prior knowledge (no `tls`).
    H2c,
}

impl UpstreamProtocol {
    /// The value in the gateway file.
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamProtocol::Http1 => "http1",
            UpstreamProtocol::H2 => "h2",
            UpstreamProtocol::H2c => "h2c",
        }
    }

    /// HTTP/2 to the servers.
    pub fn is_http2(self) -> bool {
        !matches!(self, UpstreamProtocol::Http1)
    }
}

/// What a group's active health check asks (`"health"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HealthProtocol {
    /// `GET path` must answer 200 (the default).
    #[default]
    Http,
    /// The gRPC health protocol: `grpc.health.v1.Health/Check` must answer `SERVING`; the
    /// check's `service` names the service asked about (empty: the server as a whole).
    Grpc,
}

/// HTTPS to a group's servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTls {
    /// Server name sent (SNI) and verified in the server's certificate.
    pub sni: String,
    /// PEM CA certificates to verify against; `None`: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// The CA file's certificates (DER), read at load.
    pub ca_der: Vec<Vec<u8>>,
}

/// Active HTTP health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthCheckSpec {
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes that bring a server back.
    pub healthy_threshold: usize,
    /// Consecutive failures that take a server out.
    pub unhealthy_threshold: usize,
}

/// One upstream group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    pub name: String,
    pub servers: Vec<SocketAddr>,
    pub balance: Balance,
    pub connect_timeout: Duration,
    /// Longest wait for each read from a server (the response header, then every piece of the
    /// body: each event of a stream starts it again); past it, 504. Default
    /// [`DEFAULT_READ_TIMEOUT`], as nginx's `proxy_read_timeout`.
    pub read_timeout: Duration,
    pub tls: Option<UpstreamTls>,
    /// `GET <path>` must answer 200.
    pub health_check: Option<(String, HealthCheckSpec)>,
    /// HTTP/1.1, h2 (TLS, ALPN) or h2c (cleartext, prior knowledge) to the servers.
    pub protocol: UpstreamProtocol,
    /// Whether `health_check` is an HTTP `GET` or a gRPC health check (then its string is the
    /// gRPC service name asked about, empty for the whole server).
    pub health: HealthProtocol,
    /// How long an idle kept-alive connection to one of the group's servers stays in the pool;
    /// `None`: until the server closes it or the pool (shared by every group, least recently
    /// used first out) needs its place.
    pub idle_timeout: Option<Duration>,
    /// Requests in flight to each server of the group at most (`max_connections`); `None`: no
    /// cap. Requests beyond it wait, first come first served, up to `queue_timeout`.
    pub max_connections: Option<usize>,
    /// Of those, the most one client address holds at once (`max_connections_per_client`;
    /// by default one less than `max_connections`, at least 1), so that one client, say a slow
    /// reader of large answers, can never hold every slot of a server.
    pub max_connections_per_client: usize,
    /// How long a request waits for a free slot before it is answered 503 (`queue_timeout_ms`).
    pub queue_timeout: Duration,
}

/// A client's share of a server's `max_connections` when the group does not set
/// `max_connections_per_client`: all but one slot, so another client always finds one.
pub fn default_share_per_client(max_connections: usize) -> usize {
    max_connections.saturating_sub(1).max(1)
}

/// How long a request waits for a server's free slot by default (`queue_timeout_ms`).
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(10);

impl GroupSpec {
    /// The single group behind `--upstream` (round-robin, no active checks).
    pub fn from_flag(servers: Vec<SocketAddr>) -> GroupSpec {
        GroupSpec {
            name: "default".into(),
            servers,
            balance: Balance::RoundRobin,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            tls: None,
            health_check: None,
            protocol: UpstreamProtocol::Http1,
            health: HealthProtocol::Http,
            idle_timeout: None,
            max_connections: None,
            max_connections_per_client: 1,
            queue_timeout: DEFAULT_QUEUE_TIMEOUT,
        }
    }

    /// How long a server that refused a connection stays out before it is tried again: one
    /// health-check interval (the check brings it back sooner when it is up), or 10 s.
    pub fn ejection(&self) -> Duration {
        self.health_check
            .as_ref()
            .map_or(Duration::from_secs(10), |(_, hc)| hc.interval)
    }
}

/// Longer than TCP's first two SYN retransmissions (sent after 1 s and 3 s): a SYN that a busy
/// server's full accept queue dropped is sent again and answered, instead of failing the
/// request (Envoy's and HAProxy's usual 5 s).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the gateway waits for each read from an upstream server by default (nginx's
/// `proxy_read_timeout`): an upstream that takes a request and falls silent costs the client a
/// 504 after a minute, never an endless wait.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// A host pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    Any,
    /// Lower-case, without port.
    Exact(String),
    /// `*.example.com` stored as `.example.com`: any name ending with it (one label or more).
    Suffix(String),
}

/// One route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    host: HostPattern,
    /// Segment-wise, without a trailing `/` (`/` matches everything).
    path_prefix: String,
    /// Index into [`RouteTable::groups`].
    pub group: usize,
    /// The route's `request_headers` and `response_headers` rules, if any.
    pub headers: Option<std::sync::Arc<RouteHeaders>>,
}

/// The compiled gateway file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable {
    pub groups: Vec<GroupSpec>,
    /// Most specific first: exact host, then wildcard (longer suffix first), then any host;
    /// within each, longer path prefix first; then file order.
    routes: Vec<Route>,
    /// Group for requests no route matches.
    pub default: Option<usize>,
    /// `"forwarded": true`: an RFC 7239 `Forwarded` header towards the upstreams.
    pub forwarded: bool,
}

impl RouteTable {
    /// One group, every request to it (`--upstream`).
    pub fn single(group: GroupSpec) -> RouteTable {
        RouteTable {
            groups: vec![group],
            routes: Vec::new(),
            default: Some(0),
            forwarded: false,
        }
    }

    /// How many routes the file has.
    pub fn route_count(&self) -> usize {
        self.routes.len()
    }

    /// The group for a request: `host` without port (any case), `path` normalised.
    pub fn pick(&self, host: Option<&str>, path: &str) -> Option<usize> {
        self.pick_route(host, path).map(|(group, _)| group)
    }

    /// The group for a request and the header rules of the route that chose it (none for the
    /// default upstream).
    pub fn pick_route(
        &self,
        host: Option<&str>,
        path: &str,
    ) -> Option<(usize, Option<&std::sync::Arc<RouteHeaders>>)> {
        self.matching(host, path)
            .map(|r| (r.group, r.headers.as_ref()))
            .or(self.default.map(|group| (group, None)))
    }

    /// The path prefix of the route a request matches (a trace's `http.route`): `None` when
    /// only the default group takes it.
    pub fn matched_prefix(&self, host: Option<&str>, path: &str) -> Option<&str> {
        self.matching(host, path).map(|r| r.path_prefix.as_str())
    }

    fn matching(&self, host: Option<&str>, path: &str) -> Option<&Route> {
        let host = host.map(|h| h.trim_end_matches('.'));
        self.routes.iter().find(|r| {
            let host_ok = match (&r.host, host) {
                (HostPattern::Any, _) => true,
                (HostPattern::Exact(name), Some(h)) => h.eq_ignore_ascii_case(name),
                (HostPattern::Suffix(suffix), Some(h)) => {
                    h.len() > suffix.len()
                        && h.is_char_boundary(h.len() - suffix.len())
                        && h[h.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
                }
                _ => false,
            };
            host_ok && path_has_prefix(path, &r.path_prefix)
        })
    }
}

/// Why a gateway file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: not valid JSON: {source}")]
    Json {
        file: String,
        source: serde_json::Error,
    },
    #[error("{file}: {} error(s):\n{}", .errors.len(), .errors.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        file: String,
        errors: Vec<FieldError>,
    },
}

/// Whether a JSON document is a gateway file rather than a policy bundle (for `validate`).
pub fn is_gateway_file(root: &Value) -> bool {
    root.get("upstreams").is_some() && root.get("policies").is_none()
}

/// Reads and compiles a gateway file; relative `ca_file` paths are relative to it.
///
/// # Errors
/// The file cannot be read, is not JSON, or has errors (all of them, with their paths).
pub fn load_file(path: &Path) -> Result<RouteTable, RoutesError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| RoutesError::Io {
        file: file.clone(),
        source,
    })?;
    let root: Value = serde_json::from_slice(&bytes).map_err(|source| RoutesError::Json {
        file: file.clone(),
        source,
    })?;
    compile(&root, path.parent()).map_err(|errors| RoutesError::Invalid { file, errors })
}

/// Compiles a parsed gateway file.
///
/// # Errors
/// Every problem, each with its JSON path.
pub fn compile(root: &Value, base_dir: Option<&Path>) -> Result<RouteTable, Vec<FieldError>> {
    let mut c = Compiler {
        errors: Vec::new(),
        base_dir,
    };
    let table = c.table(root);
    if c.errors.is_empty() {
        table.ok_or_else(Vec::new)
    } else {
        Err(c.errors)
    }
}

struct Compiler<'a> {
    errors: Vec<FieldError>,
    base_dir: Option<&'a Path>,
}

impl Compiler<'_> {
    fn error(&mut self, path: &str, message: impl Into<String>) {
        json::error(&mut self.errors, path, message);
    }

    fn object<'v>(
        &mut self,
        v: &'v Value,
        path: &str,
        allowed: &[&str],
    ) -> Option<&'v Map<String, Value>> {
        json::object(&mut self.errors, v, path, allowed)
    }

    fn string<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v str> {
        json::non_empty_string(&mut self.errors, v, path)
    }

    fn millis(
        &mut self,
        map: &Map<String, Value>,
        path: &str,
        field: &str,
        default: Duration,
    ) -> Duration {
        match map.get(field) {
            None => default,
            Some(v) => match v.as_u64() {
                Some(ms) if (1..=3_600_000).contains(&ms) => Duration::from_millis(ms),
                _ => {
                    self.error(
                        &join(path, field),
                        "must be a whole number of milliseconds from 1 to 3600000",
                    );
                    default
                }
            },
        }
    }

    fn count(&mut self, map: &Map<String, Value>, path: &str, field: &str) -> usize {
        match map.get(field) {
            None => 1,
            Some(v) => match v.as_u64() {
                Some(n) if (1..=100).contains(&n) => n as usize,
                _ => {
                    self.error(&join(path, field), "must be a whole number from 1 to 100");
                    1
                }
            },
        }
    }

    fn table(&mut self, root: &Value) -> Option<RouteTable> {
        let map = self.object(
            root,
            "",
            &["upstreams", "routes", "default_upstream", "forwarded"],
        )?;
        let mut groups = Vec::new();
        match map.get("upstreams").and_then(Value::as_object) {
            Some(upstreams) if !upstreams.is_empty() => {
                for (name, spec) in upstreams {
                    if let Some(group) = self.group(name, spec, &join("upstreams", name)) {
                        groups.push(group);
                    }
                }
            }
            _ => self.error(
                "upstreams",
                "must be an object naming at least one upstream group",
            ),
        }
        let index_of = |name: &str| groups.iter().position(|g| g.name == name);
        let mut routes = Vec::new();
        if let Some(list) = map.get("routes") {
            match list.as_array() {
                Some(list) => {
                    for (i, v) in list.iter().enumerate() {
                        let path = format!("routes[{i}]");
                        if let Some(route) = self.route(v, &path, &index_of) {
                            routes.push(route);
                        }
                    }
                }
                None => self.error("routes", "must be an array"),
            }
        }
        let default = match map.get("default_upstream") {
            None => None,
            Some(v) => self.string(v, "default_upstream").and_then(|name| {
                let found = index_of(name);
                if found.is_none() {
                    self.error(
                        "default_upstream",
                        format!("no upstream group named {name:?}"),
                    );
                }
                found
            }),
        };
        let routes_given = map
            .get("routes")
            .and_then(Value::as_array)
            .is_some_and(|l| !l.is_empty());
        if !routes_given && map.get("default_upstream").is_none() && !groups.is_empty() {
            self.error(
                "routes",
                "no route and no default_upstream: no request could be proxied",
            );
        }
        // Most specific first; a stable sort keeps file order among equals.
        let specificity = |r: &Route| -> (u8, usize, usize) {
            let (rank, host_len) = match &r.host {
                HostPattern::Exact(h) => (0, h.len()),
                HostPattern::Suffix(s) => (1, s.len()),
                HostPattern::Any => (2, 0),
            };
            (
                rank,
                usize::MAX - host_len,
                usize::MAX - r.path_prefix.len(),
            )
        };
        routes.sort_by_key(specificity);
        let forwarded = match map.get("forwarded") {
            None => false,
            Some(Value::Bool(on)) => *on,
            Some(_) => {
                self.error("forwarded", "must be true or false");
                false
            }
        };
        Some(RouteTable {
            groups,
            routes,
            default,
            forwarded,
        })
    }

    fn group(&mut self, name: &str, v: &Value, path: &str) -> Option<GroupSpec> {
        let map = self.object(
            v,
            path,
            &[
                "servers",
                "balance",
                "connect_timeout_ms",
                "read_timeout_ms",
                "idle_timeout_ms",
                "tls",
                "health_check",
                "protocol",
                "health",
                "max_connections",
                "max_connections_per_client",
                "queue_timeout_ms",
            ],
        )?;
        let mut servers = Vec::new();
        match map.get("servers").and_then(Value::as_array) {
            Some(list) if !list.is_empty() => {
                for (i, s) in list.iter().enumerate() {
                    let p = format!("{}[{i}]", join(path, "servers"));
                    if let Some(text) = self.string(s, &p) {
                        match text.to_socket_addrs().map(|mut a| a.next()) {
                            Ok(Some(addr)) => servers.push(addr),
                            _ => self.error(&p, format!("{text:?} is not a resolvable HOST:PORT")),
                        }
                    }
                }
            }
            _ => self.error(
                &join(path, "servers"),
                "must be a non-empty array of HOST:PORT",
            ),
        }
        let balance = match map.get("balance").map(|v| v.as_str()) {
            None | Some(Some("round_robin")) => Balance::RoundRobin,
            Some(Some("client_hash")) => Balance::ClientHash,
            _ => {
                self.error(
                    &join(path, "balance"),
                    "must be \"round_robin\" or \"client_hash\"",
                );
                Balance::RoundRobin
            }
        };
        let connect_timeout = self.millis(map, path, "connect_timeout_ms", DEFAULT_CONNECT_TIMEOUT);
        let read_timeout = self.millis(map, path, "read_timeout_ms", DEFAULT_READ_TIMEOUT);
        let idle_timeout = map
            .contains_key("idle_timeout_ms")
            .then(|| self.millis(map, path, "idle_timeout_ms", Duration::from_secs(60)));
        let tls = map.get("tls").and_then(|v| self.tls(v, &join(path, "tls")));
        let protocol = self.protocol(map, path, tls.is_some());
        let health = match map.get("health").map(|v| v.as_str()) {
            None | Some(Some("http")) => HealthProtocol::Http,
            Some(Some("grpc")) => {
                if !protocol.is_http2() {
                    self.error(
                        &join(path, "health"),
                        "\"grpc\" needs \"protocol\": \"h2\" or \"h2c\" (gRPC is HTTP/2)",
                    );
                }
                HealthProtocol::Grpc
            }
            _ => {
                self.error(&join(path, "health"), "must be \"http\" or \"grpc\"");
                HealthProtocol::Http
            }
        };
        let health_check = map
            .get("health_check")
            .and_then(|v| self.health_check(v, &join(path, "health_check"), health));
        // `"health": "grpc"` alone checks at the defaults.
        let health_check = match (health, health_check, map.contains_key("health_check")) {
            (HealthProtocol::Grpc, None, false) => self.health_check(
                &Value::Object(Map::new()),
                &join(path, "health_check"),
                health,
            ),
            (_, check, _) => check,
        };
        // The per-server cap and its queue.
        let max_connections = match map.get("max_connections") {
            None => None,
            Some(v) => match v.as_u64() {
                Some(n) if (1..=100_000).contains(&n) => Some(n as usize),
                _ => {
                    self.error(
                        &join(path, "max_connections"),
                        "must be a whole number from 1 to 100000 (requests in flight to each server)",
                    );
                    None
                }
            },
        };
        let max_connections_per_client =
            match (map.get("max_connections_per_client"), max_connections) {
                (None, max) => default_share_per_client(max.unwrap_or(1)),
                (Some(v), Some(max)) => match v.as_u64() {
                    Some(n) if n >= 1 && n as usize <= max => n as usize,
                    _ => {
                        self.error(
                            &join(path, "max_connections_per_client"),
                            format!("must be a whole number from 1 to max_connections ({max})"),
                        );
                        default_share_per_client(max)
                    }
                },
                (Some(_), None) => {
                    self.error(
                        &join(path, "max_connections_per_client"),
                        "needs max_connections: it is a share of that cap",
                    );
                    1
                }
            };
        let queue_timeout = self.millis(map, path, "queue_timeout_ms", DEFAULT_QUEUE_TIMEOUT);
        if map.contains_key("queue_timeout_ms") && !map.contains_key("max_connections") {
            self.error(
                &join(path, "queue_timeout_ms"),
                "needs max_connections: without a cap nothing waits",
            );
        }
        Some(GroupSpec {
            max_connections,
            max_connections_per_client,
            queue_timeout,
            name: name.to_string(),
            servers,
            balance,
            connect_timeout,
            read_timeout,
            tls,
            health_check,
            protocol,
            health,
            idle_timeout,
        })
    }

    /// The group's `"protocol"`: `h2` needs `tls`, `h2c` excludes it.
    fn protocol(&mut self, map: &Map<String, Value>, path: &str, tls: bool) -> UpstreamProtocol {
        let p = join(path, "protocol");
        match map.get("protocol").map(|v| v.as_str()) {
            None | Some(Some("http1")) => UpstreamProtocol::Http1,
            Some(Some("h2")) => {
                if !tls {
                    self.error(
                        &p,
                        "\"h2\" is HTTP/2 over TLS: it needs \"tls\" (cleartext HTTP/2 is \"h2c\")",
                    );
                }
                UpstreamProtocol::H2
            }
            Some(Some("h2c")) => {
                if tls {
                    self.error(&p, "\"h2c\" is cleartext HTTP/2: with \"tls\", use \"h2\"");
                }
                UpstreamProtocol::H2c
            }
            _ => {
                self.error(&p, "must be \"http1\", \"h2\" or \"h2c\"");
                UpstreamProtocol::Http1
            }
        }
    }

    fn tls(&mut self, v: &Value, path: &str) -> Option<UpstreamTls> {
        let map = self.object(v, path, &["sni", "ca_file"])?;
        let sni = match map.get("sni") {
            Some(v) => self.string(v, &join(path, "sni"))?.to_string(),
            None => {
                self.error(
                    &join(path, "sni"),
                    "is required: the name to verify in the server's certificate",
                );
                return None;
            }
        };
        let mut ca_der = Vec::new();
        let ca_file = match map.get("ca_file") {
            None => None,
            Some(v) => {
                let p = join(path, "ca_file");
                let text = self.string(v, &p)?;
                let file = match self.base_dir {
                    Some(dir) if Path::new(text).is_relative() => dir.join(text),
                    _ => PathBuf::from(text),
                };
                match std::fs::read(&file) {
                    Err(e) => {
                        self.error(&p, format!("{}: cannot read: {e}", file.display()));
                        return None;
                    }
                    Ok(pem) => {
                        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
                            match cert {
                                Ok(der) => ca_der.push(der.to_vec()),
                                Err(e) => {
                                    self.error(&p, format!("{}: {e}", file.display()));
                                    return None;
                                }
                            }
                        }
                        if ca_der.is_empty() {
                            self.error(
                                &p,
                                format!("{}: no PEM certificate in the file", file.display()),
                            );
                            return None;
                        }
                    }
                }
                Some(file)
            }
        };
        Some(UpstreamTls {
            sni,
            ca_file,
            ca_der,
        })
    }

    /// An HTTP check's `path`, or a gRPC check's `service`, and the timing.
    fn health_check(
        &mut self,
        v: &Value,
        path: &str,
        health: HealthProtocol,
    ) -> Option<(String, HealthCheckSpec)> {
        let what = match health {
            HealthProtocol::Http => "path",
            HealthProtocol::Grpc => "service",
        };
        let map = self.object(
            v,
            path,
            &[
                what,
                "interval_ms",
                "timeout_ms",
                "healthy_threshold",
                "unhealthy_threshold",
            ],
        )?;
        let check_path = match (health, map.get(what)) {
            (HealthProtocol::Grpc, None) => String::new(),
            (HealthProtocol::Grpc, Some(v)) => match v.as_str() {
                Some(service) => service.to_string(),
                None => {
                    self.error(&join(path, what), "must be a string (a gRPC service name)");
                    return None;
                }
            },
            (HealthProtocol::Http, None) => "/".to_string(),
            (HealthProtocol::Http, Some(v)) => {
                let p = self.string(v, &join(path, "path"))?;
                if !p.starts_with('/') {
                    self.error(&join(path, "path"), "must start with '/'");
                    return None;
                }
                p.to_string()
            }
        };
        let interval = self.millis(map, path, "interval_ms", Duration::from_secs(5));
        let timeout = self.millis(map, path, "timeout_ms", Duration::from_secs(1));
        Some((
            check_path,
            HealthCheckSpec {
                interval,
                timeout,
                healthy_threshold: self.count(map, path, "healthy_threshold"),
                unhealthy_threshold: self.count(map, path, "unhealthy_threshold"),
            },
        ))
    }

    fn route(
        &mut self,
        v: &Value,
        path: &str,
        index_of: &dyn Fn(&str) -> Option<usize>,
    ) -> Option<Route> {
        let map = self.object(
            v,
            path,
            &[
                "host",
                "path_prefix",
                "upstream",
                "request_headers",
                "response_headers",
            ],
        )?;
        let host = match map.get("host") {
            None => HostPattern::Any,
            Some(v) => {
                let text = self.string(v, &join(path, "host"))?;
                let name = crate::request::descriptor::strip_port(text).to_ascii_lowercase();
                match name.strip_prefix("*.") {
                    Some(rest) if !rest.is_empty() && !rest.contains('*') => {
                        HostPattern::Suffix(format!(".{rest}"))
                    }
                    _ if name.contains('*') => {
                        self.error(
                            &join(path, "host"),
                            "a wildcard is only allowed as the first label (\"*.example.com\")",
                        );
                        return None;
                    }
                    _ => HostPattern::Exact(name),
                }
            }
        };
        let path_prefix = match map.get("path_prefix") {
            None => "/".to_string(),
            Some(v) => {
                let p = self.string(v, &join(path, "path_prefix"))?;
                if !p.starts_with('/') {
                    self.error(&join(path, "path_prefix"), "must start with '/'");
                    return None;
                }
                let trimmed = p.trim_end_matches('/');
                if trimmed.is_empty() {
                    "/".to_string()
                } else {
                    trimmed.to_string()
                }
            }
        };
        let group = match map.get("upstream") {
            None => {
                self.error(
                    &join(path, "upstream"),
                    "is required: the upstream group to send to",
                );
                return None;
            }
            Some(v) => {
                let name = self.string(v, &join(path, "upstream"))?;
                match index_of(name) {
                    Some(i) => i,
                    None => {
                        self.error(
                            &join(path, "upstream"),
                            format!("no upstream group named {name:?}"),
                        );
                        return None;
                    }
                }
            }
        };
        let mut headers = RouteHeaders::default();
        for (field, rules) in [
            ("request_headers", &mut headers.request),
            ("response_headers", &mut headers.response),
        ] {
            if let Some(v) = map.get(field) {
                *rules = crate::request::forwarding::compile_rules(
                    &mut self.errors,
                    v,
                    &join(path, field),
                );
            }
        }
        let headers = (!headers.request.is_empty() || !headers.response.is_empty())
            .then(|| std::sync::Arc::new(headers));
        Some(Route {
            host,
            path_prefix,
            group,
            headers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn table(v: Value) -> RouteTable {
        compile(&v, None).unwrap_or_else(|e| panic!("{e:?}"))
    }

    fn errors(v: Value) -> Vec<String> {
        compile(&v, None)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// `protocol` and `health`: the defaults, h2c, gRPC health (checked at the defaults when
    /// `health_check` is absent, with its `service`), and each mistake named at its path.
    #[test]
    fn groups_speak_http1_h2_or_h2c() {
        let t = table(json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"]}},
                             "default_upstream": "a"}));
        assert_eq!(t.groups[0].protocol, UpstreamProtocol::Http1);
        assert_eq!(t.groups[0].health, HealthProtocol::Http);
        let t = table(json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"],
                             "protocol": "h2c", "health": "grpc"}}, "default_upstream": "a"}));
        assert_eq!(t.groups[0].protocol, UpstreamProtocol::H2c);
        assert_eq!(t.groups[0].health, HealthProtocol::Grpc);
        let (service, hc) = t.groups[0].health_check.clone().unwrap();
        assert_eq!(
            (service.as_str(), hc.interval),
            ("", Duration::from_secs(5))
        );
        let t = table(json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"],
                             "protocol": "h2c", "health": "grpc",
                             "health_check": {"service": "echo.v1.Echo", "interval_ms": 100}}},
                             "default_upstream": "a"}));
        let (service, hc) = t.groups[0].health_check.clone().unwrap();
        assert_eq!(
            (service.as_str(), hc.interval),
            ("echo.v1.Echo", Duration::from_millis(100))
        );
        assert_eq!(
            errors(json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"], "protocol": "h2"}},
                          "default_upstream": "a"})),
            ["upstreams.a.protocol: \"h2\" is HTTP/2 over TLS: it needs \"tls\" (cleartext HTTP/2 is \"h2c\")"]
        );
        assert_eq!(
            errors(
                json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"], "protocol": "h3"}},
                          "default_upstream": "a"})
            ),
            ["upstreams.a.protocol: must be \"http1\", \"h2\" or \"h2c\""]
        );
        assert_eq!(
            errors(json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"], "health": "grpc"}},
                          "default_upstream": "a"})),
            ["upstreams.a.health: \"grpc\" needs \"protocol\": \"h2\" or \"h2c\" (gRPC is HTTP/2)"]
        );
        // A gRPC check names a service, not a path.
        assert_eq!(
            errors(
                json!({"upstreams": {"a": {"servers": ["127.0.0.1:1"], "protocol": "h2c",
                          "health": "grpc", "health_check": {"path": "/healthz"}}},
                          "default_upstream": "a"})
            )
            .len(),
            1
        );
    }

    #[test]
    fn the_most_specific_route_wins() {
        let t = table(json!({
            "upstreams": {
                "api": {"servers": ["127.0.0.1:1"]},
                "v2": {"servers": ["127.0.0.1:2"]},
                "wild": {"servers": ["127.0.0.1:3"]},
                "static": {"servers": ["127.0.0.1:4"]},
                "fallback": {"servers": ["127.0.0.1:5"]}
            },
            "routes": [
                {"path_prefix": "/static", "upstream": "static"},
                {"host": "*.example.com", "upstream": "wild"},
                {"host": "api.example.com", "upstream": "api"},
                {"host": "api.example.com", "path_prefix": "/v2/", "upstream": "v2"}
            ],
            "default_upstream": "fallback"
        }));
        let name =
            |host: Option<&str>, path: &str| t.pick(host, path).map(|g| t.groups[g].name.as_str());
        assert_eq!(name(Some("api.example.com"), "/v2/orders"), Some("v2"));
        assert_eq!(name(Some("API.example.com."), "/v2"), Some("v2"));
        // Segment-wise: /v2x is not under /v2.
        assert_eq!(name(Some("api.example.com"), "/v2x"), Some("api"));
        assert_eq!(name(Some("api.example.com"), "/static/x"), Some("api"));
        assert_eq!(name(Some("shop.example.com"), "/x"), Some("wild"));
        assert_eq!(name(Some("a.b.example.com"), "/x"), Some("wild"));
        assert_eq!(name(Some("example.com"), "/static/app.js"), Some("static"));
        assert_eq!(name(Some("other.test"), "/x"), Some("fallback"));
        assert_eq!(name(None, "/x"), Some("fallback"));
    }

    /// A client's share of a server's slots: all but one by default (at least 1), or as set
    /// within 1..=max_connections; set without a cap, or out of range, it is an error.
    #[test]
    fn the_share_per_client_defaults_to_all_slots_but_one() {
        let share = |group: Value| {
            table(json!({"upstreams": {"api": group}, "default_upstream": "api"})).groups[0]
                .max_connections_per_client
        };
        assert_eq!(
            share(json!({"servers": ["127.0.0.1:1"], "max_connections": 4})),
            3
        );
        assert_eq!(
            share(json!({"servers": ["127.0.0.1:1"], "max_connections": 1})),
            1
        );
        assert_eq!(
            share(json!({"servers": ["127.0.0.1:1"], "max_connections": 4,
                         "max_connections_per_client": 4})),
            4
        );
        let e = errors(json!({"upstreams": {
            "a": {"servers": ["127.0.0.1:1"], "max_connections": 4, "max_connections_per_client": 5},
            "b": {"servers": ["127.0.0.1:1"], "max_connections_per_client": 1},
            "c": {"servers": ["127.0.0.1:1"], "max_connections": 2, "max_connections_per_client": 0}
        }, "default_upstream": "a"}));
        assert_eq!(
            e,
            vec![
                "upstreams.a.max_connections_per_client: must be a whole number from 1 to max_connections (4)",
                "upstreams.b.max_connections_per_client: needs max_connections: it is a share of that cap",
                "upstreams.c.max_connections_per_client: must be a whole number from 1 to max_connections (2)",
            ]
        );
    }

    #[test]
    fn every_error_is_reported_with_its_path() {
        let e = errors(json!({
            "upstreams": {
                "api": {"servers": [], "balance": "fastest", "connect_timeout_ms": 0,
                        "health_check": {"path": "healthz", "interval_ms": "1s"}},
                "tls": {"servers": ["127.0.0.1:1"], "tls": {"ca_file": "/nonexistent/ca.pem"}}
            },
            "routes": [
                {"host": "a.*.com", "upstream": "api"},
                {"upstream": "missing"},
                {"path_prefix": "x", "upstream": "api", "weight": 2}
            ],
            "default_upstream": "nope",
            "extra": 1
        }));
        assert_eq!(
            e,
            vec![
                "extra: unknown field (expected one of: upstreams, routes, default_upstream, forwarded)",
                "upstreams.api.servers: must be a non-empty array of HOST:PORT",
                "upstreams.api.balance: must be \"round_robin\" or \"client_hash\"",
                "upstreams.api.connect_timeout_ms: must be a whole number of milliseconds from 1 to 3600000",
                "upstreams.api.health_check.path: must start with '/'",
                "upstreams.tls.tls.sni: is required: the name to verify in the server's certificate",
                "routes[0].host: a wildcard is only allowed as the first label (\"*.example.com\")",
                "routes[1].upstream: no upstream group named \"missing\"",
                "routes[2].weight: unknown field (expected one of: host, path_prefix, upstream, request_headers, response_headers)",
                "routes[2].path_prefix: must start with '/'",
                "default_upstream: no upstream group named \"nope\"",
            ]
        );
    }

    /// An upstream that falls silent costs a 504 after 60 s unless its group says otherwise
    /// (`read_timeout_ms`), for a gateway-file group and for `--upstream` alike.
    #[test]
    fn the_read_timeout_is_60_s_unless_the_group_sets_one() {
        let t = table(json!({
            "upstreams": {
                "plain": {"servers": ["127.0.0.1:1"]},
                "llm": {"servers": ["127.0.0.1:2"], "read_timeout_ms": 300000}
            },
            "default_upstream": "plain"
        }));
        let timeout = |name: &str| {
            t.groups
                .iter()
                .find(|g| g.name == name)
                .map(|g| g.read_timeout)
        };
        assert_eq!(timeout("plain"), Some(Duration::from_secs(60)));
        assert_eq!(timeout("llm"), Some(Duration::from_secs(300)));
        let flag = GroupSpec::from_flag(vec!["127.0.0.1:1".parse().unwrap()]);
        assert_eq!(flag.read_timeout, Duration::from_secs(60));
    }

    #[test]
    fn a_file_without_any_way_to_proxy_is_refused() {
        let e = errors(json!({"upstreams": {"api": {"servers": ["127.0.0.1:1"]}}}));
        assert_eq!(
            e,
            vec!["routes: no route and no default_upstream: no request could be proxied"]
        );
    }

    #[test]
    fn tls_reads_its_ca_file() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
        let t = compile(
            &json!({"upstreams": {"secure": {"servers": ["127.0.0.1:443"],
                "tls": {"sni": "api.example.com", "ca_file": "ca.pem"},
                "health_check": {"path": "/healthz", "interval_ms": 500, "unhealthy_threshold": 3}}},
                "default_upstream": "secure"}),
            Some(&dir),
        )
        .unwrap();
        let g = &t.groups[0];
        let tls = g.tls.as_ref().unwrap();
        assert_eq!(tls.sni, "api.example.com");
        assert_eq!(tls.ca_der.len(), 1);
        let (path, hc) = g.health_check.as_ref().unwrap();
        assert_eq!(path, "/healthz");
        assert_eq!(
            (hc.interval, hc.healthy_threshold, hc.unhealthy_threshold),
            (Duration::from_millis(500), 1, 3)
        );
        assert_eq!(g.ejection(), Duration::from_millis(500));
    }
}
