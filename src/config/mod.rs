//! Resolves `tollgate run` flags (already merged with `TOLLGATE_*` variables by clap) into one
//! validated [`Config`]: addresses parsed, CIDRs parsed, names checked. Every problem is
//! reported at once, before anything listens.

pub mod cli;
pub mod pem;
pub mod routes;
pub mod tls;
pub mod tls_client;

use crate::config::cli::{AccessLogArg, EncodedSlashesArg, GrpcStoreErrors, LogFormat, RunArgs};
use crate::request::auth::{parse_algorithm, JwtConfig, TokenSource};
use crate::request::descriptor::{EncodedSlashes, IpNet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The shortest `--reservation-secret` taken: 32 bytes, HMAC-SHA256's own key size.
const MIN_RESERVATION_SECRET_BYTES: usize = 32;

/// `--reservation-secret`'s bytes; `Debug` never shows them.
#[derive(Clone)]
pub struct ReservationSecret(pub Vec<u8>);

impl std::fmt::Debug for ReservationSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReservationSecret(<redacted>)")
    }
}

/// `--admin-token` or the first line of `--admin-token-file`. The token itself never appears
/// in an error.
fn admin_token(args: &RunArgs) -> Result<Option<crate::operator::AdminToken>, String> {
    let (text, source) = match (&args.admin_token, &args.admin_token_file) {
        (Some(token), _) => (token.clone(), "--admin-token".to_string()),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).map_err(|e| {
                format!("--admin-token-file {}: cannot read it: {e}", file.display())
            })?;
            let first = text.lines().next().unwrap_or("").trim().to_string();
            (first, format!("--admin-token-file {}", file.display()))
        }
        (None, None) => return Ok(None),
    };
    crate::operator::AdminToken::new(&text)
        .map(Some)
        .map_err(|e| format!("{source}: the token {e}"))
}

/// `--debug-session-secret`, or `--debug-session-secret-file`'s content without its trailing
/// newline. The secret itself never appears in an error.
fn debug_secret(args: &RunArgs) -> Result<Option<crate::engine::compat::DebugSecret>, String> {
    let (text, source) = match (&args.debug_session_secret, &args.debug_session_secret_file) {
        (Some(secret), _) => (secret.clone(), "--debug-session-secret".to_string()),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).map_err(|e| {
                format!(
                    "--debug-session-secret-file {}: cannot read it: {e}",
                    file.display()
                )
            })?;
            let secret = text
                .strip_suffix('\n')
                .map_or(text.as_str(), |t| t.strip_suffix('\r').unwrap_or(t));
            (
                secret.to_string(),
                format!("--debug-session-secret-file {}", file.display()),
            )
        }
        (None, None) => return Ok(None),
    };
    crate::engine::compat::DebugSecret::new(&text)
        .map(Some)
        .map_err(|e| format!("{source}: the secret {e}"))
}

/// `tollgate run --policy-store URL`: where the fleet's bundles are published and how this
/// gateway follows them.
#[derive(Debug, Clone)]
pub struct PolicyStoreConfig {
    pub url: String,
    /// `--policy-verify-key`: read at start-up (a key that cannot be read stops it).
    pub verify_key: Option<PathBuf>,
    /// `--allow-unsigned-bundles`: without a verify key, put unsigned bundles in force (never
    /// the default: without a key, anyone who can write the store chooses the policy).
    pub allow_unsigned: bool,
    /// `--gateway-id`, or the host name and the `--listen` port.
    pub gateway_id: String,
    /// `--policy-store-max-bytes`.
    pub max_bytes: usize,
    /// `--state-dir`, where the last good bundle is kept for a start with the store down.
    pub bundle_dir: Option<PathBuf>,
}

/// The host name (`/proc/sys/kernel/hostname`), or `gateway` when it cannot be read.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "gateway".to_string())
}

/// This gateway's name: `--gateway-id`, or the host name and the `--listen` port.
fn gateway_id(args: &RunArgs) -> String {
    args.gateway_id.clone().unwrap_or_else(|| {
        let port = args
            .listen
            .parse::<SocketAddr>()
            .map_or(0, |addr| addr.port());
        format!("{}:{port}", host_name())
    })
}

/// Everything `run` needs, validated.
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
    pub threads: usize,
    pub max_buckets: usize,
    /// `--max-loop-marks`.
    pub max_loop_marks: usize,
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
    pub max_body_bytes: usize,
    /// How long the decision service keeps an unreported LLM reservation.
    pub reservation_ttl: Duration,
    /// `--reservation-secret`: reservations travel in signed tokens any gateway settles.
    pub reservation_secret: Option<ReservationSecret>,
    /// Explicit `--max-connections`; `None` = derived from the open-file limit at start.
    pub max_connections: Option<usize>,
    /// `--max-connections-per-ip`.
    pub max_connections_per_ip: Option<usize>,
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
    /// `--wait-for-policy`: a missing policy file at start-up is not an error.
    pub wait_for_policy: bool,
    /// `--allow-empty-policy`: a policy file that puts nothing in force is loaded anyway.
    pub allow_empty_policy: bool,
    /// `--compat`, and `--debug-session-secret` (or its file): the secret that opens debug
    /// sessions.
    pub compat: crate::engine::compat::Compat,
    pub debug_secret: Option<crate::engine::compat::DebugSecret>,
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
    pub max_bytes: usize,
    /// Header lines.
    pub max_lines: usize,
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
        if lines > self.max_lines {
            Some(HeaderLimit::Lines)
        } else if bytes > self.max_bytes {
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
    /// A store shared by every gateway of a fleet (Redis, Redis Cluster, PostgreSQL URL).
    Shared(String),
}

/// The upgrade socket: `--upgrade-sock`, else `upgrade.sock` in the state dir (owner-only);
/// none otherwise. Never a default in a shared directory such as /tmp: whoever creates the
/// socket there first would be handed the listening sockets.
fn upgrade_sock(args: &RunArgs) -> Option<PathBuf> {
    args.upgrade_sock
        .clone()
        .or_else(|| args.state_dir.as_ref().map(|dir| dir.join("upgrade.sock")))
}

fn check_tls_addr(errors: &mut Vec<String>, value: &str) {
    if value.parse::<SocketAddr>().is_err() {
        errors.push(format!(
            "--listen-tls {value:?}: expected IP:PORT such as 0.0.0.0:8443 or [::]:443"
        ));
    }
}

/// A hash of a watched file's content, for change detection (certificates, the gateway file):
/// rotated certificates often keep their length, and a copy within the same clock tick keeps
/// the modification time. `None` when the file cannot be read.
pub fn file_hash(path: &Path) -> Option<u64> {
    let bytes = std::fs::read(path).ok()?;
    Some(twox_hash::XxHash3_64::oneshot(&bytes))
}

/// Configuration problems, all of them.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigError(pub Vec<String>);

impl Config {
    /// Validates the flags.
    ///
    /// # Errors
    /// Every invalid flag, each naming the flag and the value.
    pub fn from_args(args: &RunArgs) -> Result<Config, ConfigError> {
        let mut errors = Vec::new();
        let mut check_addr = |flag: &str, value: &str| {
            if value.parse::<SocketAddr>().is_err() {
                errors.push(format!(
                    "--{flag} {value:?}: expected IP:PORT such as 0.0.0.0:8080 or [::]:8080"
                ));
            }
        };
        check_addr("listen", &args.listen);
        check_addr("admin-listen", &args.admin_listen);
        let mut upstreams = Vec::new();
        for u in &args.upstream {
            // Resolved once here: resolving per request would block on DNS, and pingora's
            // HttpPeer panics on an unresolvable address.
            match u.to_socket_addrs().map(|mut a| a.next()) {
                Ok(Some(addr)) => upstreams.push(addr),
                _ => errors.push(format!("--upstream {u:?}: expected a resolvable HOST:PORT")),
            }
        }
        let mut trusted_proxies = Vec::new();
        for t in &args.trusted_proxy {
            match IpNet::parse(t) {
                Some(net) => trusted_proxies.push(net),
                None => errors.push(format!(
                    "--trusted-proxy {t:?}: expected a CIDR such as 10.0.0.0/8 or an address"
                )),
            }
        }
        if args.threads == 0 || args.threads > 256 {
            errors.push(format!("--threads {}: expected 1 to 256", args.threads));
        }
        if args.max_buckets == 0 {
            errors.push("--max-buckets 0: must be at least 1".to_string());
        }
        if args.max_loop_marks == 0 || args.max_loop_marks > 1 << 30 {
            errors.push(format!(
                "--max-loop-marks {}: expected 1 to 1073741824",
                args.max_loop_marks
            ));
        }
        if args.state_sync_ms == 0 {
            errors.push("--state-sync-ms 0: must be at least 1".to_string());
        }
        if args.local_max_buckets == 0 {
            errors.push("--local-max-buckets 0: must be at least 1".to_string());
        }
        let policy_store = args.policy_store.as_ref().map(|url| PolicyStoreConfig {
            url: url.clone(),
            verify_key: args.policy_verify_key.clone(),
            allow_unsigned: args.allow_unsigned_bundles,
            gateway_id: gateway_id(args),
            max_bytes: args.policy_store_max_bytes,
            bundle_dir: args.state_dir.clone(),
        });
        if let Some(url) = &args.policy_store {
            let known = [
                "redis://",
                "rediss://",
                "redis+cluster://",
                "postgres://",
                "postgresql://",
                "http://",
                "https://",
            ];
            if !known.iter().any(|scheme| url.starts_with(scheme)) {
                errors.push(format!(
                    "--policy-store {:?}: expected redis://, redis+cluster://, postgres:// or an http(s):// URL",
                    crate::fleet::source::display_url(url)
                ));
            }
        }
        if args.policy_store.is_some()
            && args.policy_verify_key.is_none()
            && !args.allow_unsigned_bundles
        {
            errors.push(
                "--policy-store: without --policy-verify-key every bundle is taken unsigned, from anyone who can write the store: give --policy-verify-key PEM (the public half of publish's --sign-key), or --allow-unsigned-bundles to accept that"
                    .to_string(),
            );
        }
        if args.policy_store_max_bytes == 0 {
            errors.push("--policy-store-max-bytes 0: must be at least 1".to_string());
        }
        if args.upgrade && upgrade_sock(args).is_none() {
            errors.push(
                "--upgrade: needs --upgrade-sock PATH (in a directory only this user can write) or --state-dir, naming the socket the running gateway hands its listeners over through"
                    .to_string(),
            );
        }
        if args.sweep_interval_secs == 0 {
            errors.push("--sweep-interval-secs 0: must be at least 1".to_string());
        }
        let store = match args.store.as_str() {
            "memory" => StoreKind::Memory,
            url if url.starts_with("redis+sentinel://") => {
                match crate::store::redis::SentinelTarget::parse(url) {
                    Ok(_) => StoreKind::Shared(url.to_string()),
                    Err(e) => {
                        errors.push(format!(
                            "--store {:?}: {e}",
                            crate::telemetry::redact::url(url)
                        ));
                        StoreKind::Memory
                    }
                }
            }
            url if url.starts_with("redis://")
                || url.starts_with("rediss://")
                || url.starts_with("redis+cluster://")
                || url.starts_with("postgres://")
                || url.starts_with("postgresql://") =>
            {
                StoreKind::Shared(url.to_string())
            }
            other => {
                errors.push(format!(
                    "--store {:?}: expected \"memory\", redis://HOST:PORT[/DB], redis+cluster://HOST:PORT[,HOST:PORT...], redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE or postgres://USER@HOST:PORT/DB", crate::telemetry::redact::url(other)
                ));
                StoreKind::Memory
            }
        };
        if args.header_timeout_secs == 0 {
            errors.push("--header-timeout-secs 0: must be at least 1".to_string());
        }
        if args.keepalive_timeout_secs == 0 {
            errors.push("--keepalive-timeout-secs 0: must be at least 1".to_string());
        }
        if args.send_timeout_secs == 0 {
            errors.push("--send-timeout-secs 0: must be at least 1".to_string());
        }
        if args.max_body_bytes == 0 {
            errors.push("--max-body-bytes 0: must be at least 1".to_string());
        }
        if !(1..=MAX_HEADER_BYTES_PARSED).contains(&args.max_request_header_bytes) {
            errors.push(format!(
                "--max-request-header-bytes {}: must be from 1 to {} (Pingora's own limit)",
                args.max_request_header_bytes, MAX_HEADER_BYTES_PARSED
            ));
        }
        if !(1..=MAX_HEADER_LINES_PARSED).contains(&args.max_request_headers) {
            errors.push(format!(
                "--max-request-headers {}: must be from 1 to {} (Pingora's own limit)",
                args.max_request_headers, MAX_HEADER_LINES_PARSED
            ));
        }
        if args.reservation_ttl_secs == 0 {
            errors.push("--reservation-ttl-secs 0: must be at least 1".to_string());
        }
        if args
            .reservation_secret
            .as_ref()
            .is_some_and(|s| s.len() < MIN_RESERVATION_SECRET_BYTES)
        {
            errors.push(format!(
                "--reservation-secret: must be at least {MIN_RESERVATION_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)"
            ));
        }
        if args.reservation_secret.is_some()
            && matches!(store, StoreKind::Memory)
            && args.state_dir.is_none()
        {
            // The mark that a token was settled lives in the store: in each gateway's own
            // embedded store, a token would settle once per gateway.
            errors.push(
                "--reservation-secret: needs a shared --store (redis://... or postgres://...), which marks each reservation settled for the whole fleet, or a --state-dir".to_string(),
            );
        }
        let compat = match args.compat {
            crate::config::cli::CompatArg::None => crate::engine::compat::Compat::Off,
            crate::config::cli::CompatArg::Fairvisor => crate::engine::compat::Compat::Fairvisor,
        };
        let debug_secret = debug_secret(args).unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        if compat != crate::engine::compat::Compat::Fairvisor {
            if args.debug_session_secret.is_some() {
                errors.push("--debug-session-secret: needs --compat fairvisor".to_string());
            } else if args.debug_session_secret_file.is_some() {
                errors.push("--debug-session-secret-file: needs --compat fairvisor".to_string());
            }
        }
        let admin_token = admin_token(args).unwrap_or_else(|e| {
            errors.push(e);
            None
        });
        if args.max_connections == Some(0) {
            errors.push("--max-connections 0: must be at least 1".to_string());
        }
        if args.max_connections_per_ip == Some(0) {
            errors.push("--max-connections-per-ip 0: must be at least 1".to_string());
        }
        if args.store_timeout_ms == 0 {
            errors.push("--store-timeout-ms 0: must be at least 1".to_string());
        }
        if http::HeaderName::from_bytes(args.reason_header.as_bytes()).is_err() {
            errors.push(format!(
                "--reason-header {:?}: not a valid HTTP header name",
                args.reason_header
            ));
        }
        let mut algorithms = Vec::new();
        for name in &args.jwt_algorithms {
            match parse_algorithm(name) {
                Ok(alg) => algorithms.push(alg),
                Err(e) => errors.push(format!("--jwt-algorithms: {e}")),
            }
        }
        let grpc = match &args.grpc_listen {
            None => {
                if args.grpc_tls_cert.is_some() {
                    errors.push("--grpc-tls-cert: needs --grpc-listen".to_string());
                }
                None
            }
            Some(listen) => match listen.parse::<SocketAddr>() {
                Ok(listen) => Some(GrpcConfig {
                    listen,
                    tls: args.grpc_tls_cert.clone().zip(args.grpc_tls_key.clone()),
                    store_errors_fail_open: args.grpc_store_errors == GrpcStoreErrors::Allow,
                }),
                Err(_) => {
                    errors.push(format!(
                        "--grpc-listen {listen:?}: expected IP:PORT such as 0.0.0.0:8081"
                    ));
                    None
                }
            },
        };
        if args.tls_cert.len() != args.tls_key.len() {
            errors.push(format!(
                "--tls-cert given {} time(s) and --tls-key {} time(s): they go in pairs",
                args.tls_cert.len(),
                args.tls_key.len()
            ));
        }
        if let Some(addr) = &args.listen_tls {
            check_tls_addr(&mut errors, addr);
            if args.tls_cert.is_empty() {
                errors.push("--listen-tls: needs --tls-cert and --tls-key".to_string());
            }
        }
        let tls = (!args.tls_cert.is_empty()).then(|| TlsConfig {
            listen: args.listen_tls.clone(),
            pairs: args
                .tls_cert
                .iter()
                .zip(&args.tls_key)
                .map(|(cert, key)| CertPair {
                    cert: cert.clone(),
                    key: key.clone(),
                })
                .collect(),
        });
        let source = match (&args.jwt_header, &args.jwt_cookie) {
            (Some(h), _) => TokenSource::Header(h.to_ascii_lowercase()),
            (None, Some(c)) => TokenSource::Cookie(c.clone()),
            (None, None) => TokenSource::Bearer,
        };
        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        Ok(Config {
            policy: args.policy.clone().unwrap_or_default(),
            policy_store,
            listen: args.listen.clone(),
            upstreams,
            routes: args.routes.clone(),
            admin_listen: args.admin_listen.clone(),
            bind_retry: args.bind_retry,
            threads: args.threads,
            max_buckets: args.max_buckets,
            max_loop_marks: args.max_loop_marks,
            // With a shared store, the state dir keeps only the last good bundle (above).
            state_dir: args
                .state_dir
                .as_ref()
                .filter(|_| matches!(args.store.as_str(), "memory"))
                .map(|dir| crate::store::StateDirConfig {
                    dir: dir.clone(),
                    sync_every: Duration::from_millis(args.state_sync_ms),
                    upgrade: args.upgrade,
                }),
            upgrade: args.upgrade,
            upgrade_sock: upgrade_sock(args),
            bucket_idle_given: args.bucket_idle_secs.is_some(),
            sweep_interval: Duration::from_secs(args.sweep_interval_secs),
            trusted_proxies,
            ipv6_prefix: args.ipv6_prefix,
            // Fairvisor's name, unless the operator chose one.
            reason_header: if compat == crate::engine::compat::Compat::Fairvisor
                && args.reason_header == crate::engine::headers::DEFAULT_REASON_HEADER
            {
                crate::engine::compat::REASON_HEADER.to_string()
            } else {
                args.reason_header.clone()
            },
            log_format: args.log_format,
            policy_poll: (args.policy_poll_secs > 0)
                .then(|| Duration::from_secs(args.policy_poll_secs)),
            store,
            store_timeout: Duration::from_millis(args.store_timeout_ms),
            local: crate::store::local::LocalConfig {
                default_mode: crate::policy::OnStoreError::parse(&args.on_store_error)
                    .unwrap_or_default(),
                max_buckets: args.local_max_buckets,
                gateway_id: gateway_id(args),
                journal: args
                    .state_dir
                    .as_ref()
                    .filter(|_| !matches!(args.store.as_str(), "memory"))
                    .map(|dir| dir.join(crate::store::local::JOURNAL_FILE)),
            },
            encoded_slashes: match args.encoded_slashes {
                EncodedSlashesArg::Decode => EncodedSlashes::Decode,
                EncodedSlashesArg::Reject => EncodedSlashes::Reject,
            },
            header_timeout: Duration::from_secs(args.header_timeout_secs),
            keepalive_timeout: Duration::from_secs(args.keepalive_timeout_secs),
            send_timeout: Duration::from_secs(args.send_timeout_secs),
            max_body_bytes: args.max_body_bytes,
            reservation_ttl: Duration::from_secs(args.reservation_ttl_secs),
            reservation_secret: args
                .reservation_secret
                .as_ref()
                .map(|s| ReservationSecret(s.as_bytes().to_vec())),
            max_connections: args.max_connections,
            max_connections_per_ip: args.max_connections_per_ip,
            header_limits: HeaderLimits {
                max_bytes: args.max_request_header_bytes,
                max_lines: args.max_request_headers,
            },
            grpc,
            tls,
            h2c: args.h2c,
            skip_invalid_policies: args.skip_invalid_policies,
            access_log: match args.access_log {
                AccessLogArg::Off => crate::telemetry::access_log::AccessLogFormat::Off,
                AccessLogArg::Text => crate::telemetry::access_log::AccessLogFormat::Text,
                AccessLogArg::Json => crate::telemetry::access_log::AccessLogFormat::Json,
            },
            trace_context: args.trace_context,
            admin_token,
            wait_for_policy: args.wait_for_policy,
            allow_empty_policy: args.allow_empty_policy,
            compat,
            debug_secret: debug_secret
                .filter(|_| compat == crate::engine::compat::Compat::Fairvisor),
            geoip_db: args.geoip_db.clone(),
            asn_type_map: args.asn_type_map.clone(),
            tor_exits: args.tor_exits.clone(),
            network_allow_shrink: args.network_allow_shrink,
            jwt: JwtConfig {
                secret: args.jwt_secret.clone(),
                public_keys: args.jwt_public_key.clone(),
                jwks: args.jwt_jwks.clone(),
                algorithms,
                leeway_secs: args.jwt_leeway_secs,
                issuer: args.jwt_issuer.clone(),
                audience: args.jwt_audience.clone(),
                source,
                unverified: args.jwt_unverified,
                payload_only: compat == crate::engine::compat::Compat::Fairvisor,
            },
        })
    }
}
