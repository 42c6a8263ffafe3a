//! `tollgate run`'s raw flags (clap's [`RunArgs`]) resolved into one [`Config`], in named
//! steps: each step checks a group of flags and turns them into typed values (addresses,
//! CIDRs, non-zero counts, the store's URL), recording every problem as a [`ConfigError`];
//! [`resolve`] then assembles the parts, or returns every problem at once. The steps run in
//! the order the flags' problems are reported.

use super::error::{ConfigError, ConfigErrors, MIN_RESERVATION_SECRET_BYTES};
use super::{
    CertPair, Config, GrpcConfig, HeaderLimits, PolicyStoreConfig, ReservationSecret, StoreKind,
    TlsConfig, MAX_HEADER_BYTES_PARSED, MAX_HEADER_LINES_PARSED,
};
use crate::config::cli::{AccessLogArg, CompatArg, EncodedSlashesArg, GrpcStoreErrors, RunArgs};
use crate::engine::compat::{Compat, DebugSecret};
use crate::fleet::source::SourceUrl;
use crate::operator::{AdminToken, AdminTokens};
use crate::request::auth::{parse_algorithm, JwtConfig, TokenSource};
use crate::request::descriptor::{EncodedSlashes, IpNet};
use crate::store::{StoreUrl, StoreUrlError};
use crate::telemetry::access_log::AccessLogFormat;
use std::net::{SocketAddr, ToSocketAddrs};
use std::num::{NonZeroU64, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

/// Most `--threads`.
const MAX_THREADS: usize = 256;

/// Most `--max-loop-marks`.
const MAX_LOOP_MARKS: usize = 1 << 30;

/// Most `--max-delayed-requests`.
const MAX_DELAYED_REQUESTS: usize = 1 << 24;

impl Config {
    /// Validates `tollgate run`'s flags and resolves them into one configuration.
    ///
    /// # Errors
    /// Every invalid flag, each naming the flag and the value.
    pub fn from_args(args: &RunArgs) -> Result<Config, ConfigErrors> {
        resolve(args)
    }
}

/// A webhook URL's parts: https or not, host, port (the scheme's by default), path and query.
fn webhook_target(url: &str) -> Option<(bool, String, u16, String)> {
    let uri: http::Uri = url.parse().ok()?;
    let tls = match uri.scheme_str()? {
        "https" => true,
        "http" => false,
        _ => return None,
    };
    let authority = uri.authority()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    if host.is_empty() {
        return None;
    }
    let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let target = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    Some((tls, host.to_string(), port, target))
}

/// The steps of [`Config::from_args`], each run, then the parts assembled.
fn resolve(args: &RunArgs) -> Result<Config, ConfigErrors> {
    let mut r = Resolver {
        args,
        errors: Vec::new(),
    };
    let gateway_id = gateway_id(args);
    let compat = match args.compat {
        CompatArg::None => Compat::Off,
        CompatArg::Fairvisor => Compat::Fairvisor,
    };
    // Every step runs, in the order their flags' problems are reported.
    let upstreams = r.listeners_and_upstreams();
    let trusted_proxies = r.trusted_proxies();
    let capacity = r.capacity();
    let policy_store = r.policy_store(&gateway_id);
    let upgrade_sock = r.upgrade_sock();
    let sweep_interval = r.secs("sweep-interval-secs", args.sweep_interval_secs);
    let store = r.store();
    let client_limits = r.client_limits();
    // A `--store` that is not understood counts as the embedded one.
    let reservation_secret = r.reservation_secret(!matches!(store, Some(StoreKind::Shared(_))));
    let debug_secret = r.debug_secret(compat);
    let admin_token = r.admin_token();
    let webhook = r.webhook();
    let admin_tokens = admin_token
        .as_ref()
        .and_then(|token| r.admin_tokens(token.as_ref()));
    let connection_caps = r.connection_caps();
    let store_timeout = r.millis("store-timeout-ms", args.store_timeout_ms);
    let reason_header = r.reason_header(compat);
    let jwt = r.jwt(compat);
    let grpc = r.grpc();
    let tls = r.tls();
    let resolved = (|| {
        let (max_connections, max_connections_per_ip) = connection_caps?;
        Some(Resolved {
            upstreams: upstreams?,
            trusted_proxies: trusted_proxies?,
            capacity: capacity?,
            policy_store: policy_store?,
            upgrade_sock,
            sweep_interval: sweep_interval?,
            store: store?,
            client_limits: client_limits?,
            reservation_secret: reservation_secret?,
            compat,
            debug_secret: debug_secret?,
            admin_token: admin_token?,
            webhook: webhook?,
            admin_tokens: admin_tokens?,
            max_connections,
            max_connections_per_ip,
            store_timeout: store_timeout?,
            reason_header: reason_header?,
            jwt: jwt?,
            grpc: grpc?,
            tls: tls?,
            gateway_id,
        })
    })();
    match resolved {
        Some(resolved) if r.errors.is_empty() => Ok(resolved.into_config(args)),
        _ => Err(ConfigErrors(r.errors)),
    }
}

/// The flags read so far, and the problems found.
struct Resolver<'a> {
    args: &'a RunArgs,
    errors: Vec<ConfigError>,
}

/// `--threads`, the embedded store's bounds and the shared store's local mirror's.
struct Capacity {
    threads: NonZeroUsize,
    max_buckets: NonZeroUsize,
    max_loop_marks: NonZeroUsize,
    max_delayed_requests: NonZeroUsize,
    state_sync: Duration,
    local_max_buckets: NonZeroUsize,
}

/// What a client connection may take and how long it may take: timeouts, the largest body
/// read, the header limits, how long a reservation is kept.
struct ClientLimits {
    header_timeout: Duration,
    keepalive_timeout: Duration,
    send_timeout: Duration,
    max_body_bytes: NonZeroUsize,
    header_limits: HeaderLimits,
    reservation_ttl: Duration,
}

/// Every checked part, before it is assembled into a [`Config`].
struct Resolved {
    upstreams: Vec<SocketAddr>,
    trusted_proxies: Vec<IpNet>,
    capacity: Capacity,
    policy_store: Option<PolicyStoreConfig>,
    upgrade_sock: Option<PathBuf>,
    sweep_interval: Duration,
    store: StoreKind,
    client_limits: ClientLimits,
    reservation_secret: Option<ReservationSecret>,
    compat: Compat,
    debug_secret: Option<DebugSecret>,
    admin_token: Option<AdminToken>,
    webhook: Option<crate::config::WebhookConfig>,
    admin_tokens: AdminTokens,
    max_connections: Option<NonZeroUsize>,
    max_connections_per_ip: Option<NonZeroUsize>,
    store_timeout: Duration,
    reason_header: String,
    jwt: JwtConfig,
    grpc: Option<GrpcConfig>,
    tls: Option<TlsConfig>,
    gateway_id: String,
}

impl Resolver<'_> {
    /// Records a problem; `None` stands for the value it spoiled.
    fn fail<T>(&mut self, error: ConfigError) -> Option<T> {
        self.errors.push(error);
        None
    }

    /// A quantity that must be at least 1.
    fn at_least_one(&mut self, flag: &'static str, value: usize) -> Option<NonZeroUsize> {
        NonZeroUsize::new(value).or_else(|| self.fail(ConfigError::Zero { flag }))
    }

    /// A duration in whole units that must be at least one unit.
    fn non_zero(&mut self, flag: &'static str, value: u64) -> Option<NonZeroU64> {
        NonZeroU64::new(value).or_else(|| self.fail(ConfigError::Zero { flag }))
    }

    /// A non-zero number of seconds.
    fn secs(&mut self, flag: &'static str, value: u64) -> Option<Duration> {
        self.non_zero(flag, value)
            .map(|secs| Duration::from_secs(secs.get()))
    }

    /// A non-zero number of milliseconds.
    fn millis(&mut self, flag: &'static str, value: u64) -> Option<Duration> {
        self.non_zero(flag, value)
            .map(|ms| Duration::from_millis(ms.get()))
    }

    /// A count from 1 to `max`.
    fn up_to(&mut self, flag: &'static str, value: usize, max: usize) -> Option<NonZeroUsize> {
        NonZeroUsize::new(value)
            .filter(|n| n.get() <= max)
            .or_else(|| self.fail(ConfigError::OutOfRange { flag, value, max }))
    }

    /// A header limit from 1 to what Pingora's parser takes.
    fn header_limit(
        &mut self,
        flag: &'static str,
        value: usize,
        max: usize,
    ) -> Option<NonZeroUsize> {
        NonZeroUsize::new(value)
            .filter(|n| n.get() <= max)
            .or_else(|| self.fail(ConfigError::HeaderLimit { flag, value, max }))
    }

    /// An `IP:PORT` listener address (`example` shows one in the error).
    fn address(
        &mut self,
        flag: &'static str,
        value: &str,
        example: &'static str,
    ) -> Option<SocketAddr> {
        value.parse::<SocketAddr>().ok().or_else(|| {
            self.fail(ConfigError::Address {
                flag,
                value: value.to_string(),
                example,
            })
        })
    }

    /// `--listen` and `--admin-listen` checked (they stay text: the listeners parse them
    /// again), and `--upstream` resolved once here: resolving per request would block on DNS,
    /// and pingora's HttpPeer panics on an unresolvable address.
    fn listeners_and_upstreams(&mut self) -> Option<Vec<SocketAddr>> {
        const EXAMPLE: &str = "0.0.0.0:8080 or [::]:8080";
        let args = self.args;
        self.address("listen", &args.listen, EXAMPLE);
        self.address("admin-listen", &args.admin_listen, EXAMPLE);
        let mut upstreams = Some(Vec::new());
        for u in &args.upstream {
            match u.to_socket_addrs().map(|mut a| a.next()) {
                Ok(Some(addr)) => upstreams.iter_mut().for_each(|all| all.push(addr)),
                _ => upstreams = self.fail(ConfigError::Upstream(u.clone())),
            }
        }
        upstreams
    }

    /// `--trusted-proxy`: CIDRs or single addresses.
    fn trusted_proxies(&mut self) -> Option<Vec<IpNet>> {
        let args = self.args;
        let mut nets = Some(Vec::new());
        for t in &args.trusted_proxy {
            match IpNet::parse(t) {
                Some(net) => nets.iter_mut().for_each(|all| all.push(net)),
                None => nets = self.fail(ConfigError::TrustedProxy(t.clone())),
            }
        }
        nets
    }

    /// `--threads`, `--max-buckets`, `--max-loop-marks`, `--max-delayed-requests`,
    /// `--state-sync-ms`, `--local-max-buckets`.
    fn capacity(&mut self) -> Option<Capacity> {
        let args = self.args;
        let threads = self.up_to("threads", args.threads, MAX_THREADS);
        let max_buckets = self.at_least_one("max-buckets", args.max_buckets);
        let max_loop_marks = self.up_to("max-loop-marks", args.max_loop_marks, MAX_LOOP_MARKS);
        let max_delayed_requests = self.up_to(
            "max-delayed-requests",
            args.max_delayed_requests,
            MAX_DELAYED_REQUESTS,
        );
        let state_sync = self.millis("state-sync-ms", args.state_sync_ms);
        let local_max_buckets = self.at_least_one("local-max-buckets", args.local_max_buckets);
        Some(Capacity {
            threads: threads?,
            max_buckets: max_buckets?,
            max_loop_marks: max_loop_marks?,
            max_delayed_requests: max_delayed_requests?,
            state_sync: state_sync?,
            local_max_buckets: local_max_buckets?,
        })
    }

    /// `--policy-store` and its companions: `Some(None)` without one.
    fn policy_store(&mut self, gateway_id: &str) -> Option<Option<PolicyStoreConfig>> {
        let args = self.args;
        let url = match args.policy_store.as_deref().map(SourceUrl::parse) {
            None => None,
            Some(Ok(url)) => Some(url),
            Some(Err(_)) => {
                let shown = crate::fleet::source::display_url(args.policy_store.as_deref()?);
                self.fail(ConfigError::PolicyStoreUrl(shown))
            }
        };
        if args.policy_store.is_some()
            && args.policy_verify_key.is_none()
            && !args.allow_unsigned_bundles
        {
            self.errors.push(ConfigError::UnsignedPolicyStore);
        }
        let max_bytes = self.at_least_one("policy-store-max-bytes", args.policy_store_max_bytes)?;
        if args.policy_store.is_some() && url.is_none() {
            return None;
        }
        Some(url.map(|url| PolicyStoreConfig {
            url,
            verify_key: args.policy_verify_key.clone(),
            allow_unsigned: args.allow_unsigned_bundles,
            gateway_id: gateway_id.to_string(),
            max_bytes,
            bundle_dir: args.state_dir.clone(),
        }))
    }

    /// The upgrade socket: `--upgrade-sock`, else `upgrade.sock` in the state dir (owner-only);
    /// none otherwise. Never a default in a shared directory such as /tmp: whoever creates the
    /// socket there first would be handed the listening sockets. `--upgrade` needs one.
    fn upgrade_sock(&mut self) -> Option<PathBuf> {
        let sock = self.args.upgrade_sock.clone().or_else(|| {
            self.args
                .state_dir
                .as_ref()
                .map(|dir| dir.join("upgrade.sock"))
        });
        if self.args.upgrade && sock.is_none() {
            self.errors.push(ConfigError::UpgradeWithoutSocket);
        }
        sock
    }

    /// `--store`: `memory`, or a shared store's URL read once.
    fn store(&mut self) -> Option<StoreKind> {
        let url = match self.args.store.as_str() {
            "memory" => return Some(StoreKind::Memory),
            url => url,
        };
        match StoreUrl::parse(url) {
            Ok(url) => Some(StoreKind::Shared(url)),
            Err(StoreUrlError::Sentinel(error)) => self.fail(ConfigError::SentinelUrl {
                url: crate::telemetry::redact::url(url).into_owned(),
                error,
            }),
            Err(StoreUrlError::UnknownScheme) => self.fail(ConfigError::StoreUrl(
                crate::telemetry::redact::url(url).into_owned(),
            )),
        }
    }

    /// `--header-timeout-secs`, `--keepalive-timeout-secs`, `--send-timeout-secs`,
    /// `--max-body-bytes`, `--max-request-header-bytes`, `--max-request-headers`,
    /// `--reservation-ttl-secs`.
    fn client_limits(&mut self) -> Option<ClientLimits> {
        let args = self.args;
        let header_timeout = self.secs("header-timeout-secs", args.header_timeout_secs);
        let keepalive_timeout = self.secs("keepalive-timeout-secs", args.keepalive_timeout_secs);
        let send_timeout = self.secs("send-timeout-secs", args.send_timeout_secs);
        let max_body_bytes = self.at_least_one("max-body-bytes", args.max_body_bytes);
        let max_bytes = self.header_limit(
            "max-request-header-bytes",
            args.max_request_header_bytes,
            MAX_HEADER_BYTES_PARSED,
        );
        let max_lines = self.header_limit(
            "max-request-headers",
            args.max_request_headers,
            MAX_HEADER_LINES_PARSED,
        );
        let reservation_ttl = self.secs("reservation-ttl-secs", args.reservation_ttl_secs);
        Some(ClientLimits {
            header_timeout: header_timeout?,
            keepalive_timeout: keepalive_timeout?,
            send_timeout: send_timeout?,
            max_body_bytes: max_body_bytes?,
            header_limits: HeaderLimits {
                max_bytes: max_bytes?,
                max_lines: max_lines?,
            },
            reservation_ttl: reservation_ttl?,
        })
    }

    /// `--reservation-secret`: long enough, and settled where the whole fleet sees it.
    fn reservation_secret(&mut self, embedded: bool) -> Option<Option<ReservationSecret>> {
        let Some(secret) = &self.args.reservation_secret else {
            return Some(None);
        };
        let short = secret.len() < MIN_RESERVATION_SECRET_BYTES;
        if short {
            self.errors.push(ConfigError::ShortReservationSecret);
        }
        // The mark that a token was settled lives in the store: in each gateway's own
        // embedded store, a token would settle once per gateway.
        if embedded && self.args.state_dir.is_none() {
            return self.fail(ConfigError::ReservationSecretWithoutSharedStore);
        }
        (!short).then(|| Some(ReservationSecret(secret.as_bytes().to_vec())))
    }

    /// `--debug-session-secret`, or `--debug-session-secret-file`'s content without its
    /// trailing newline; only with `--compat fairvisor`. The secret itself never appears in an
    /// error.
    fn debug_secret(&mut self, compat: Compat) -> Option<Option<DebugSecret>> {
        let args = self.args;
        let (flag, file, text) = match (&args.debug_session_secret, &args.debug_session_secret_file)
        {
            (Some(secret), _) => ("debug-session-secret", None, Some(secret.clone())),
            (None, Some(file)) => {
                let flag = "debug-session-secret-file";
                let text = self.read_file(flag, file).map(|text| {
                    text.strip_suffix('\n')
                        .map_or(text.as_str(), |t| t.strip_suffix('\r').unwrap_or(t))
                        .to_string()
                });
                (flag, Some(file.clone()), text)
            }
            (None, None) => return Some(None),
        };
        let secret = match text.map(|text| DebugSecret::new(&text)) {
            None => None,
            Some(Ok(secret)) => Some(secret),
            Some(Err(error)) => self.fail(ConfigError::DebugSecret { flag, file, error }),
        };
        if compat != Compat::Fairvisor {
            return self.fail(ConfigError::Needs {
                flag,
                needs: "--compat fairvisor",
            });
        }
        secret.map(Some)
    }

    /// `--webhook-url` with `--webhook-secret-file` (each needs the other). Neither the key
    /// nor a password in the URL appears in an error.
    fn webhook(&mut self) -> Option<Option<crate::config::WebhookConfig>> {
        let args = self.args;
        let (url, file) = match (&args.webhook_url, &args.webhook_secret_file) {
            (None, None) => return Some(None),
            (Some(url), Some(file)) => (url, file),
            (Some(_), None) => {
                return self.fail(ConfigError::Needs {
                    flag: "webhook-url",
                    needs: "--webhook-secret-file",
                })
            }
            (None, Some(_)) => {
                return self.fail(ConfigError::Needs {
                    flag: "webhook-secret-file",
                    needs: "--webhook-url",
                })
            }
        };
        let target = webhook_target(url);
        if target.is_none() {
            self.fail::<()>(ConfigError::WebhookUrl(
                crate::telemetry::redact::url(url).into_owned(),
            ));
        }
        let secret = self
            .read_file("webhook-secret-file", file)
            .and_then(|text| {
                // Its first line, as `--admin-token-file`'s.
                let key = text.lines().next().unwrap_or("");
                if key.len() < crate::config::error::MIN_WEBHOOK_SECRET_BYTES {
                    return self.fail(ConfigError::ShortWebhookSecret(file.clone()));
                }
                Some(key.as_bytes().to_vec())
            });
        let (tls, host, port, target) = target?;
        Some(Some(crate::config::WebhookConfig {
            tls,
            host,
            port,
            target,
            secret: secret?,
        }))
    }

    /// `--admin-token` or the first line of `--admin-token-file`. The token itself never
    /// appears in an error.
    fn admin_token(&mut self) -> Option<Option<AdminToken>> {
        let args = self.args;
        let (flag, file, text) = match (&args.admin_token, &args.admin_token_file) {
            (Some(token), _) => ("admin-token", None, token.clone()),
            (None, Some(file)) => {
                let text = self.read_file("admin-token-file", file)?;
                let first = text.lines().next().unwrap_or("").trim().to_string();
                ("admin-token-file", Some(file.clone()), first)
            }
            (None, None) => return Some(None),
        };
        match AdminToken::new(&text) {
            Ok(token) => Some(Some(token)),
            Err(error) => self.fail(ConfigError::AdminToken { flag, file, error }),
        }
    }

    /// `--admin-tokens-file`, owner-only, with `--admin-token`'s entry first; without the
    /// file, `--admin-token` alone (or no token at all). No token appears in an error.
    fn admin_tokens(&mut self, admin_token: Option<&AdminToken>) -> Option<AdminTokens> {
        let Some(path) = &self.args.admin_tokens_file else {
            return Some(
                admin_token.map_or_else(AdminTokens::default, AdminTokens::of_admin_token),
            );
        };
        AdminTokens::read_file(path, admin_token)
            .map_err(|e| ConfigError::AdminTokens {
                path: path.clone(),
                problem: e.to_string(),
            })
            .map_or_else(|e| self.fail(e), Some)
    }

    /// A file a flag names, read whole.
    fn read_file(&mut self, flag: &'static str, path: &std::path::Path) -> Option<String> {
        std::fs::read_to_string(path)
            .map_err(|error| ConfigError::ReadFile {
                flag,
                path: path.to_path_buf(),
                error,
            })
            .map_or_else(|e| self.fail(e), Some)
    }

    /// `--max-connections` and `--max-connections-per-ip`, each optional.
    fn connection_caps(&mut self) -> Option<(Option<NonZeroUsize>, Option<NonZeroUsize>)> {
        let args = self.args;
        let mut cap = |flag, value: Option<usize>| match value {
            None => Some(None),
            Some(n) => self.at_least_one(flag, n).map(Some),
        };
        let total = cap("max-connections", args.max_connections);
        let per_ip = cap("max-connections-per-ip", args.max_connections_per_ip);
        Some((total?, per_ip?))
    }

    /// `--reason-header`: a valid header name; Fairvisor's name under `--compat fairvisor`,
    /// unless the operator chose one.
    fn reason_header(&mut self, compat: Compat) -> Option<String> {
        let name = &self.args.reason_header;
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return self.fail(ConfigError::ReasonHeader(name.clone()));
        }
        Some(
            if compat == Compat::Fairvisor && name == crate::engine::headers::DEFAULT_REASON_HEADER
            {
                crate::engine::compat::REASON_HEADER.to_string()
            } else {
                name.clone()
            },
        )
    }

    /// The `--jwt-*` flags: algorithms parsed, the token's place chosen.
    fn jwt(&mut self, compat: Compat) -> Option<JwtConfig> {
        let args = self.args;
        let mut algorithms = Some(Vec::new());
        for name in &args.jwt_algorithms {
            match parse_algorithm(name) {
                Ok(alg) => algorithms.iter_mut().for_each(|all| all.push(alg)),
                Err(e) => algorithms = self.fail(ConfigError::JwtAlgorithm(e)),
            }
        }
        let source = match (&args.jwt_header, &args.jwt_cookie) {
            (Some(h), _) => TokenSource::Header(h.to_ascii_lowercase()),
            (None, Some(c)) => TokenSource::Cookie(c.clone()),
            (None, None) => TokenSource::Bearer,
        };
        Some(JwtConfig {
            secret: args.jwt_secret.clone(),
            public_keys: args.jwt_public_key.clone(),
            jwks: args.jwt_jwks.clone(),
            algorithms: algorithms?,
            leeway_secs: args.jwt_leeway_secs,
            issuer: args.jwt_issuer.clone(),
            audience: args.jwt_audience.clone(),
            source,
            unverified: args.jwt_unverified,
            payload_only: compat == Compat::Fairvisor,
        })
    }

    /// `--grpc-listen` and its TLS pair: `Some(None)` without a gRPC listener.
    fn grpc(&mut self) -> Option<Option<GrpcConfig>> {
        let args = self.args;
        let Some(listen) = &args.grpc_listen else {
            if args.grpc_tls_cert.is_some() {
                self.errors.push(ConfigError::Needs {
                    flag: "grpc-tls-cert",
                    needs: "--grpc-listen",
                });
            }
            return Some(None);
        };
        let listen = self.address("grpc-listen", listen, "0.0.0.0:8081")?;
        Some(Some(GrpcConfig {
            listen,
            tls: args.grpc_tls_cert.clone().zip(args.grpc_tls_key.clone()),
            store_errors_fail_open: args.grpc_store_errors == GrpcStoreErrors::Allow,
        }))
    }

    /// `--tls-cert`/`--tls-key` pairs and `--listen-tls`: `Some(None)` without HTTPS.
    fn tls(&mut self) -> Option<Option<TlsConfig>> {
        let args = self.args;
        if args.tls_cert.len() != args.tls_key.len() {
            self.errors.push(ConfigError::UnpairedTls {
                certs: args.tls_cert.len(),
                keys: args.tls_key.len(),
            });
        }
        if let Some(addr) = &args.listen_tls {
            self.address("listen-tls", addr, "0.0.0.0:8443 or [::]:443");
            if args.tls_cert.is_empty() {
                self.errors.push(ConfigError::Needs {
                    flag: "listen-tls",
                    needs: "--tls-cert and --tls-key",
                });
            }
        }
        Some((!args.tls_cert.is_empty()).then(|| {
            TlsConfig {
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
            }
        }))
    }
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

impl Resolved {
    /// The checked parts and the flags taken as they are, as one [`Config`].
    fn into_config(self, args: &RunArgs) -> Config {
        let Resolved {
            capacity,
            client_limits: limits,
            store,
            ..
        } = self;
        let embedded = matches!(store, StoreKind::Memory);
        Config {
            policy: args.policy.clone().unwrap_or_default(),
            policy_store: self.policy_store,
            listen: args.listen.clone(),
            upstreams: self.upstreams,
            routes: args.routes.clone(),
            admin_listen: args.admin_listen.clone(),
            bind_retry: args.bind_retry,
            threads: capacity.threads,
            max_buckets: capacity.max_buckets,
            max_loop_marks: capacity.max_loop_marks,
            max_delayed_requests: capacity.max_delayed_requests.get(),
            // With a shared store, the state dir keeps only the last good bundle and the
            // local mode's journal ([`local_mode`]).
            state_dir: args.state_dir.as_ref().filter(|_| embedded).map(|dir| {
                crate::store::StateDirConfig {
                    dir: dir.clone(),
                    sync_every: capacity.state_sync,
                    upgrade: args.upgrade,
                }
            }),
            upgrade: args.upgrade,
            upgrade_sock: self.upgrade_sock,
            bucket_idle_given: args.bucket_idle_secs.is_some(),
            sweep_interval: self.sweep_interval,
            trusted_proxies: self.trusted_proxies,
            ipv6_prefix: args.ipv6_prefix,
            reason_header: self.reason_header,
            log_format: args.log_format,
            policy_poll: (args.policy_poll_secs > 0)
                .then(|| Duration::from_secs(args.policy_poll_secs)),
            store,
            store_timeout: self.store_timeout,
            local: local_mode(args, capacity.local_max_buckets, self.gateway_id, embedded),
            encoded_slashes: match args.encoded_slashes {
                EncodedSlashesArg::Decode => EncodedSlashes::Decode,
                EncodedSlashesArg::Reject => EncodedSlashes::Reject,
            },
            header_timeout: limits.header_timeout,
            keepalive_timeout: limits.keepalive_timeout,
            send_timeout: limits.send_timeout,
            max_body_bytes: limits.max_body_bytes,
            reservation_ttl: limits.reservation_ttl,
            reservation_secret: self.reservation_secret,
            max_connections: self.max_connections,
            max_connections_per_ip: self.max_connections_per_ip,
            header_limits: limits.header_limits,
            grpc: self.grpc,
            tls: self.tls,
            h2c: args.h2c,
            skip_invalid_policies: args.skip_invalid_policies,
            access_log: access_log(args.access_log),
            trace_context: args.trace_context,
            admin_token: self.admin_token,
            webhook: self.webhook,
            admin_tokens: self.admin_tokens,
            admin_tokens_file: args.admin_tokens_file.clone(),
            audit_log: args.audit_log.clone(),
            wait_for_policy: args.wait_for_policy,
            allow_empty_policy: args.allow_empty_policy,
            compat: self.compat,
            debug_secret: self.debug_secret,
            geoip_db: args.geoip_db.clone(),
            asn_type_map: args.asn_type_map.clone(),
            tor_exits: args.tor_exits.clone(),
            network_allow_shrink: args.network_allow_shrink,
            jwt: self.jwt,
        }
    }
}

/// A shared store's local mode: the default `on_store_error`, the mirror's bound, this
/// gateway's name, and the write-back journal in the state dir (with a shared store, the
/// state dir keeps only that and the last good bundle).
fn local_mode(
    args: &RunArgs,
    max_buckets: NonZeroUsize,
    gateway_id: String,
    embedded: bool,
) -> crate::store::local::LocalConfig {
    crate::store::local::LocalConfig {
        default_mode: crate::policy::OnStoreError::parse(&args.on_store_error).unwrap_or_default(),
        max_buckets,
        gateway_id,
        journal: args
            .state_dir
            .as_ref()
            .filter(|_| !embedded)
            .map(|dir| dir.join(crate::store::local::JOURNAL_FILE)),
    }
}

/// `--access-log`.
fn access_log(arg: AccessLogArg) -> AccessLogFormat {
    match arg {
        AccessLogArg::Off => AccessLogFormat::Off,
        AccessLogArg::Text => AccessLogFormat::Text,
        AccessLogArg::Json => AccessLogFormat::Json,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::cli::{Cli, Command};
    use clap::Parser;

    fn run_args(flags: &[&str]) -> Box<RunArgs> {
        let argv = ["tollgate", "run", "--policy", "p.json"]
            .iter()
            .chain(flags)
            .copied();
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(args) => args,
            _ => unreachable!("parsed a run command"),
        }
    }

    fn errors(flags: &[&str]) -> Vec<String> {
        match resolve(&run_args(flags)) {
            Ok(_) => panic!("{flags:?} accepted"),
            Err(ConfigErrors(errors)) => errors.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn the_defaults_resolve() {
        let config = resolve(&run_args(&[])).unwrap();
        assert_eq!(config.threads.get(), 2);
        assert_eq!(config.max_buckets.get(), 1_000_000);
        assert_eq!(config.local.max_buckets.get(), 100_000);
        assert_eq!(config.max_body_bytes.get(), 1024 * 1024);
        assert_eq!(config.header_limits.max_bytes.get(), 64 * 1024);
        assert_eq!(config.header_limits.max_lines.get(), 100);
        assert_eq!(config.store_timeout, Duration::from_millis(5));
        assert_eq!(config.sweep_interval, Duration::from_secs(60));
        assert_eq!(config.max_connections, None);
        assert_eq!(config.store, StoreKind::Memory);
        assert!(config.policy_store.is_none());
    }

    /// Every quantity given as 0 is refused by its own flag, all of them at once, in flag
    /// order.
    #[test]
    fn every_zero_is_named_by_its_flag() {
        let zeros = [
            "--threads",
            "--max-buckets",
            "--max-loop-marks",
            "--max-delayed-requests",
            "--state-sync-ms",
            "--local-max-buckets",
            "--policy-store-max-bytes",
            "--sweep-interval-secs",
            "--header-timeout-secs",
            "--keepalive-timeout-secs",
            "--send-timeout-secs",
            "--max-body-bytes",
            "--max-request-header-bytes",
            "--max-request-headers",
            "--reservation-ttl-secs",
            "--max-connections",
            "--max-connections-per-ip",
            "--store-timeout-ms",
        ];
        let flags: Vec<&str> = zeros.iter().flat_map(|flag| [*flag, "0"]).collect();
        assert_eq!(
            errors(&flags),
            [
                "--threads 0: expected 1 to 256",
                "--max-buckets 0: must be at least 1",
                "--max-loop-marks 0: expected 1 to 1073741824",
                "--max-delayed-requests 0: expected 1 to 16777216",
                "--state-sync-ms 0: must be at least 1",
                "--local-max-buckets 0: must be at least 1",
                "--policy-store-max-bytes 0: must be at least 1",
                "--sweep-interval-secs 0: must be at least 1",
                "--header-timeout-secs 0: must be at least 1",
                "--keepalive-timeout-secs 0: must be at least 1",
                "--send-timeout-secs 0: must be at least 1",
                "--max-body-bytes 0: must be at least 1",
                "--max-request-header-bytes 0: must be from 1 to 1048575 (Pingora's own limit)",
                "--max-request-headers 0: must be from 1 to 256 (Pingora's own limit)",
                "--reservation-ttl-secs 0: must be at least 1",
                "--max-connections 0: must be at least 1",
                "--max-connections-per-ip 0: must be at least 1",
                "--store-timeout-ms 0: must be at least 1",
            ]
        );
        assert_eq!(
            errors(&["--threads", "257", "--max-request-headers", "257"]),
            [
                "--threads 257: expected 1 to 256",
                "--max-request-headers 257: must be from 1 to 256 (Pingora's own limit)",
            ]
        );
    }

    #[test]
    fn the_store_url_is_read_once_into_its_kind() {
        let store = |url: &str| resolve(&run_args(&["--store", url])).map(|c| c.store);
        assert!(matches!(
            store("redis+cluster://a:1,b:2"),
            Ok(StoreKind::Shared(StoreUrl::Redis(crate::store::RedisUrl::Cluster { nodes, .. })))
                if nodes == ["redis://a:1", "redis://b:2"]
        ));
        assert!(matches!(
            store("postgresql://u@h/db"),
            Ok(StoreKind::Shared(StoreUrl::Postgres(_)))
        ));
        assert_eq!(
            errors(&["--store", "ftp://u:hunter2@h/x"]),
            ["--store \"ftp://u:***@h/x\": expected \"memory\", redis://HOST:PORT[/DB], redis+cluster://HOST:PORT[,HOST:PORT...], redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE or postgres://USER@HOST:PORT/DB"]
        );
        assert_eq!(
            errors(&["--store", "redis+sentinel://:hunter2@s:1"]),
            ["--store \"redis+sentinel://:***@s:1\": names no service (expected redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE)"]
        );
        // A store that is not understood counts as the embedded one for the reservation
        // secret's check, as both problems are reported.
        let secret = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            errors(&["--store", "nowhere", "--reservation-secret", secret]).len(),
            2
        );
        assert!(resolve(&run_args(&[
            "--store",
            "redis://h:1",
            "--reservation-secret",
            secret
        ]))
        .is_ok());
    }

    #[test]
    fn the_policy_store_url_is_checked_with_its_password_masked() {
        let follow = |url: &str| {
            let flags = ["--policy-store", url, "--allow-unsigned-bundles"];
            let argv = ["tollgate", "run"].iter().chain(&flags).copied();
            match Cli::try_parse_from(argv).unwrap().command {
                Command::Run(args) => resolve(&args),
                _ => unreachable!("parsed a run command"),
            }
        };
        let config = follow("REDIS+CLUSTER://a:1").unwrap();
        let store = config.policy_store.unwrap();
        assert_eq!(store.url.as_str(), "redis+cluster://a:1");
        assert_eq!(
            store.max_bytes.get(),
            crate::fleet::envelope::DEFAULT_MAX_BYTES
        );
        assert!(matches!(
            follow("https://h/b.json")
                .unwrap()
                .policy_store
                .unwrap()
                .url,
            SourceUrl::Http(_)
        ));
        let Err(ConfigErrors(errors)) = follow("redis+sentinel://:hunter2@s:1/m") else {
            panic!("a sentinel is no policy store");
        };
        assert_eq!(
            errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["--policy-store \"redis+sentinel://:***@s:1/m\": expected redis://, redis+cluster://, postgres:// or an http(s):// URL"]
        );
        assert_eq!(errors[0].flag(), "policy-store");
    }

    #[test]
    fn a_secret_flag_without_its_companion_is_refused_without_showing_it() {
        let secret = "a-debug-secret-of-some-length";
        let shown = errors(&[
            "--debug-session-secret",
            secret,
            "--grpc-tls-cert",
            "c.pem",
            "--grpc-tls-key",
            "k.pem",
        ]);
        assert_eq!(
            shown,
            [
                "--debug-session-secret: needs --compat fairvisor",
                "--grpc-tls-cert: needs --grpc-listen",
            ]
        );
        let short = errors(&["--admin-token", "hunter2"]);
        assert_eq!(short, ["--admin-token: the token must be at least 16 characters (e.g. `openssl rand -hex 32`)"]);
        let missing = errors(&["--debug-session-secret-file", "/nonexistent/secret"]);
        assert_eq!(missing.len(), 2, "{missing:?}");
        assert!(missing[0]
            .starts_with("--debug-session-secret-file /nonexistent/secret: cannot read it: "));
        assert_eq!(
            missing[1],
            "--debug-session-secret-file: needs --compat fairvisor"
        );
    }
}
