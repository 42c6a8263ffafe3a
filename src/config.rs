//! Resolves `tollgate run` flags (already merged with `TOLLGATE_*` variables by clap) into one
//! validated [`Config`]: addresses parsed, CIDRs parsed, names checked. Every problem is
//! reported at once, before anything listens.

use crate::auth::{parse_algorithm, JwtConfig, TokenSource};
use crate::cli::{LogFormat, RunArgs};
use crate::descriptor::IpNet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

/// Everything `run` needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub policy: PathBuf,
    pub listen: String,
    pub upstreams: Vec<SocketAddr>,
    pub admin_listen: String,
    pub threads: usize,
    pub max_buckets: usize,
    pub bucket_idle: Duration,
    pub sweep_interval: Duration,
    pub trusted_proxies: Vec<IpNet>,
    pub ipv6_prefix: u8,
    pub reason_header: String,
    pub log_format: LogFormat,
    pub policy_poll: Option<Duration>,
    pub jwt: JwtConfig,
    pub store: StoreKind,
    /// Deadline of one networked-store call.
    pub store_timeout: Duration,
}

/// Where buckets live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    /// The embedded bounded map (default).
    Memory,
    /// A store shared by every gateway of a fleet (Redis, Redis Cluster, PostgreSQL URL).
    Shared(String),
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
        if args.sweep_interval_secs == 0 {
            errors.push("--sweep-interval-secs 0: must be at least 1".to_string());
        }
        let store = match args.store.as_str() {
            "memory" => StoreKind::Memory,
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
                    "--store {other:?}: expected \"memory\", redis://HOST:PORT[/DB], redis+cluster://HOST:PORT[,HOST:PORT...] or postgres://USER@HOST:PORT/DB"
                ));
                StoreKind::Memory
            }
        };
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
        let source = match (&args.jwt_header, &args.jwt_cookie) {
            (Some(h), _) => TokenSource::Header(h.to_ascii_lowercase()),
            (None, Some(c)) => TokenSource::Cookie(c.clone()),
            (None, None) => TokenSource::Bearer,
        };
        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        Ok(Config {
            policy: args.policy.clone(),
            listen: args.listen.clone(),
            upstreams,
            admin_listen: args.admin_listen.clone(),
            threads: args.threads,
            max_buckets: args.max_buckets,
            bucket_idle: Duration::from_secs(args.bucket_idle_secs),
            sweep_interval: Duration::from_secs(args.sweep_interval_secs),
            trusted_proxies,
            ipv6_prefix: args.ipv6_prefix,
            reason_header: args.reason_header.clone(),
            log_format: args.log_format,
            policy_poll: (args.policy_poll_secs > 0)
                .then(|| Duration::from_secs(args.policy_poll_secs)),
            store,
            store_timeout: Duration::from_millis(args.store_timeout_ms),
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
            },
        })
    }
}

/// The client address for a request arriving from `peer`: the peer itself, unless it is a
/// trusted proxy, in which case the rightmost `X-Forwarded-For` hop that is not a trusted proxy
/// (see [`forwarded_client`]).
pub fn client_ip(
    peer: Option<std::net::IpAddr>,
    forwarded_for: Option<&str>,
    trusted: &[IpNet],
) -> Option<std::net::IpAddr> {
    let peer = peer.map(crate::descriptor::canonical_ip)?;
    if !trusted.iter().any(|net| net.contains(peer)) {
        return Some(peer);
    }
    Some(match forwarded_for {
        Some(header) => forwarded_client(
            header,
            |ip| trusted.iter().any(|net| net.contains(ip)),
            peer,
        ),
        None => peer,
    })
}

/// Walks an `X-Forwarded-For` chain sent by a trusted hop: the rightmost address that is not
/// a trusted proxy, the leftmost when all are, `fallback` when the last hop is unparseable.
/// An unparseable hop stops the walk: everything to its left was written by someone we cannot
/// vouch for.
pub fn forwarded_client(
    header: &str,
    trusted: impl Fn(std::net::IpAddr) -> bool,
    fallback: std::net::IpAddr,
) -> std::net::IpAddr {
    let mut candidate = fallback;
    for hop in header.rsplit(',') {
        let Some(ip) = parse_hop(hop.trim()) else {
            break;
        };
        candidate = ip;
        if !trusted(ip) {
            break;
        }
    }
    candidate
}

/// One `X-Forwarded-For` entry: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `[2001:db8::1]:80`.
fn parse_hop(hop: &str) -> Option<std::net::IpAddr> {
    if let Ok(ip) = hop.parse::<std::net::IpAddr>() {
        return Some(crate::descriptor::canonical_ip(ip));
    }
    hop.parse::<SocketAddr>()
        .ok()
        .map(|sa| crate::descriptor::canonical_ip(sa.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_for_is_used_only_from_trusted_peers() {
        let trusted = vec![IpNet::parse("10.0.0.0/8").unwrap()];
        let ip = |s: &str| Some(s.parse().unwrap());
        // Untrusted peer: its XFF is ignored.
        assert_eq!(
            client_ip(ip("203.0.113.9"), Some("1.1.1.1"), &trusted),
            ip("203.0.113.9")
        );
        // Trusted peer: the rightmost untrusted hop, not the spoofable leftmost one.
        assert_eq!(
            client_ip(
                ip("10.0.0.1"),
                Some("6.6.6.6, 198.51.100.4, 10.0.0.7"),
                &trusted
            ),
            ip("198.51.100.4")
        );
        assert_eq!(client_ip(ip("10.0.0.1"), None, &trusted), ip("10.0.0.1"));
        assert_eq!(
            client_ip(ip("10.0.0.1"), Some("10.0.0.3, 10.0.0.2"), &trusted),
            ip("10.0.0.3")
        );
        assert_eq!(
            client_ip(ip("10.0.0.1"), Some("garbage, 10.0.0.2"), &trusted),
            ip("10.0.0.2")
        );
        assert_eq!(
            client_ip(ip("10.0.0.1"), Some("[2001:db8::5]:443"), &trusted),
            ip("2001:db8::5")
        );
        assert_eq!(
            client_ip(ip("::ffff:10.0.0.1"), Some("192.0.2.1"), &trusted),
            ip("192.0.2.1")
        );
    }
}
