//! `tollgate run`'s configuration: the flags (clap's [`cli::RunArgs`], already merged with
//! `TOLLGATE_*` variables) are resolved in one place ([`Config::from_args`], in the named
//! steps of `resolve`) into one validated [`Config`]: addresses and CIDRs parsed, counts
//! non-zero by type, the store's URL read once, names checked. Every problem is a
//! [`ConfigError`] naming its flag, and all of them are reported at once ([`ConfigErrors`]),
//! before anything listens.

pub mod cli;
mod error;
pub mod pem;
mod resolve;
pub mod routes;
pub mod tls;
pub mod tls_client;

pub use error::{ConfigError, ConfigErrors, MIN_RESERVATION_SECRET_BYTES};

use crate::config::cli::LogFormat;
use crate::request::auth::JwtConfig;
use crate::request::descriptor::{EncodedSlashes, IpNet};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `--reservation-secret`'s bytes; `Debug` never shows them.
#[derive(Clone)]
pub struct ReservationSecret(pub Vec<u8>);

impl std::fmt::Debug for ReservationSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReservationSecret(<redacted>)")
    }
}

/// `--webhook-url` and `--webhook-secret-file`: where threshold webhooks go and the key that
/// signs them; `Debug` never shows the key.
#[derive(Clone)]
pub struct WebhookConfig {
    /// `https` (true) or `http`.
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// The path and query posted to (`/` at least).
    pub target: String,
    /// HMAC-SHA256 key.
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("tls", &self.tls)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("target", &self.target)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// `tollgate run --policy-store URL`: where the fleet's bundles are published and how this
/// gateway follows them.
#[derive(Debug, Clone)]
pub struct PolicyStoreConfig {
    pub url: crate::fleet::source::SourceUrl,
    /// `--policy-verify-key`: read at start-up (a key that cannot be read stops it).
    pub verify_key: Option<PathBuf>,
    /// `--allow-unsigned-bundles`: without a verify key, put unsigned bundles in force (never
    /// the default: without a key, anyone who can write the store chooses the policy).
    pub allow_unsigned: bool,
    /// `--gateway-id`, or the host name and the `--listen` port.
    pub gateway_id: String,
    /// `--policy-store-max-bytes`.
    pub max_bytes: NonZeroUsize,
    /// `--state-dir`, where the last good bundle is kept for a start with the store down.
    pub bundle_dir: Option<PathBuf>,
}

/// Everything `run` needs, validated: built once from the flags by [`Config::from_args`]
/// (with its steps, in `config/resolve.rs`).
#[derive(Debug, Clone)]
pub struct Config {
    /// `--policy` (empty under `--policy-store`).
    pub policy: PathBuf,
    /// `--policy-store` and its companions: the fleet's published bundle, followed.
    pub policy_store: Option<PolicyStoreConfig>,
    pub listen: String,
    pub upstreams: Vec<SocketAddr>,
    /// The gateway file (`--routes`), instead of `--upstream`.
    pub routes: Option<PathBuf>,
    pub admin_listen: String,
    /// `--bind-retry`: an address in use at start-up is tried again (see `proxy::bind`).
    pub bind_retry: bool,
    pub threads: NonZeroUsize,
    pub max_buckets: NonZeroUsize,
    /// `--max-loop-marks`.
    pub max_loop_marks: NonZeroUsize,
    /// `--max-delayed-requests`: the most requests waiting at once under `delay` rules.
    pub max_delayed_requests: usize,
    pub sweep_interval: Duration,
    /// `--state-dir`: where the embedded store keeps its tables (`None`: process memory).
    pub state_dir: Option<crate::store::StateDirConfig>,
    /// `--upgrade`: take the listeners over from a running gateway.
    pub upgrade: bool,
    /// The socket listeners are handed over through (`None`: SIGQUIT drains without handing
    /// anything over).
    pub upgrade_sock: Option<PathBuf>,
    /// `--bucket-idle-secs` was given (it no longer does anything; start-up says so).
    pub bucket_idle_given: bool,
    pub trusted_proxies: Vec<IpNet>,
    pub ipv6_prefix: u8,
    pub reason_header: String,
    pub log_format: LogFormat,
    pub policy_poll: Option<Duration>,
    pub jwt: JwtConfig,
    pub store: StoreKind,
    /// Deadline of one networked-store call.
    pub store_timeout: Duration,
    /// A shared store's local mode: the default `on_store_error`, the mirror's bound, this
    /// gateway's name and where the write-back journal is kept.
    pub local: crate::store::local::LocalConfig,
    pub encoded_slashes: EncodedSlashes,
    /// Total time a new connection has to send its first request's headers.
    pub header_timeout: Duration,
    /// Time a kept-alive connection has, after a response, to send its next request's headers.
    pub keepalive_timeout: Duration,
    /// Time a response write may wait for the client to read (nginx's `send_timeout`).
    pub send_timeout: Duration,
    /// Largest request body read for `token_bucket_llm` rules (larger: 413).
    pub max_body_bytes: NonZeroUsize,
    /// How long the decision service keeps an unreported LLM reservation.
    pub reservation_ttl: Duration,
    /// `--reservation-secret`: reservations travel in signed tokens any gateway settles.
    pub reservation_secret: Option<ReservationSecret>,
    /// Explicit `--max-connections`; `None` = derived from the open-file limit at start.
    pub max_connections: Option<NonZeroUsize>,
    /// `--max-connections-per-ip`.
    pub max_connections_per_ip: Option<NonZeroUsize>,
    /// `--max-request-header-bytes` and `--max-request-headers`: past either, 431.
    pub header_limits: HeaderLimits,
    /// The gRPC listener for Envoy, if any.
    pub grpc: Option<GrpcConfig>,
    /// HTTPS on the proxy, if any.
    pub tls: Option<TlsConfig>,
    /// HTTP/2 with prior knowledge on the cleartext listener.
    pub h2c: bool,
    /// `--skip-invalid-policies`.
    pub skip_invalid_policies: bool,
    pub access_log: crate::telemetry::access_log::AccessLogFormat,
    /// `--trace-context`: whose W3C trace context a request continues (traces on).
    pub trace_context: crate::telemetry::traces::TraceContextTrust,
    /// `--admin-token` (or its file): the operator endpoints' bearer token.
    pub admin_token: Option<crate::operator::AdminToken>,
    /// Every operator token with its scopes: `--admin-token`'s (id `admin-token`, every scope)
    /// and `--admin-tokens-file`'s, as read at start-up (the gateway's `admin_tokens` holds
    /// those in force after a SIGHUP). Empty: the operator endpoints are off.
    pub admin_tokens: crate::operator::AdminTokens,
    /// `--admin-tokens-file`, read again on SIGHUP.
    pub admin_tokens_file: Option<std::path::PathBuf>,
    /// `--audit-log`: the file the audit trail is appended to (`None`: the log).
    pub audit_log: Option<std::path::PathBuf>,
    /// `--wait-for-policy`: a missing policy file at start-up is not an error.
    pub wait_for_policy: bool,
    /// `--allow-empty-policy`: a policy file that puts nothing in force is loaded anyway.
    pub allow_empty_policy: bool,
    /// `--compat`, and `--debug-session-secret` (or its file): the secret that opens debug
    /// sessions.
    pub compat: crate::engine::compat::Compat,
    pub debug_secret: Option<crate::engine::compat::DebugSecret>,
    /// `--webhook-url` with `--webhook-secret-file`: threshold webhooks (none without).
    pub webhook: Option<WebhookConfig>,
    /// `--geoip-db`, `--asn-type-map` and `--tor-exits` ([`crate::request::network`]).
    pub geoip_db: Vec<PathBuf>,
    pub asn_type_map: Option<PathBuf>,
    pub tor_exits: Option<PathBuf>,
    /// `--network-allow-shrink`: a network file that comes back empty or with fewer than half
    /// its entries at a reload is taken anyway.
    pub network_allow_shrink: bool,
}

/// Pingora's own parser refuses a header block with more lines than this (400) before the
/// gateway sees it: a higher `--max-request-headers` could never apply.
pub const MAX_HEADER_LINES_PARSED: usize = 256;

/// Pingora's own parser refuses a larger header block (400).
pub const MAX_HEADER_BYTES_PARSED: usize = 1_048_575;

/// The request-header limits in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderLimits {
    /// The whole header block, in bytes.
    pub max_bytes: NonZeroUsize,
    /// Header lines.
    pub max_lines: NonZeroUsize,
}

/// The limit a request's header block passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderLimit {
    Bytes,
    Lines,
}

impl HeaderLimit {
    /// The `limit` label of `tollgate_request_headers_refused_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            HeaderLimit::Bytes => "bytes",
            HeaderLimit::Lines => "lines",
        }
    }
}

impl HeaderLimits {
    /// The limit a header block of `bytes` bytes and `lines` lines passes, if any.
    pub fn passed(self, bytes: usize, lines: usize) -> Option<HeaderLimit> {
        if lines > self.max_lines.get() {
            Some(HeaderLimit::Lines)
        } else if bytes > self.max_bytes.get() {
            Some(HeaderLimit::Bytes)
        } else {
            None
        }
    }
}

/// HTTPS on the proxy (`--tls-cert`/`--tls-key`, `--listen-tls`).
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// The TLS listener; `None`: `--listen` itself serves HTTPS (no cleartext listener).
    pub listen: Option<String>,
    /// Certificate/key pairs, the first the default.
    pub pairs: Vec<CertPair>,
}

/// One `--tls-cert` / `--tls-key` pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertPair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The gRPC listener (`--grpc-listen`).
#[derive(Debug, Clone)]
pub struct GrpcConfig {
    pub listen: SocketAddr,
    /// PEM certificate chain and key files: TLS; `None`: h2c.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// A store failure answers OK (fail open) rather than UNAVAILABLE.
    pub store_errors_fail_open: bool,
}

/// Where buckets live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    /// The embedded bounded map (default).
    Memory,
    /// A store shared by every gateway of a fleet (Redis, Redis Cluster, Redis Sentinel,
    /// PostgreSQL), its URL read once.
    Shared(crate::store::StoreUrl),
}

/// A hash of a watched file's content, for change detection (certificates, the gateway file):
/// rotated certificates often keep their length, and a copy within the same clock tick keeps
/// the modification time. `None` when the file cannot be read.
pub fn file_hash(path: &Path) -> Option<u64> {
    let bytes = std::fs::read(path).ok()?;
    Some(twox_hash::XxHash3_64::oneshot(&bytes))
}
