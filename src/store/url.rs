//! A shared store's URL, read once: its scheme says which backend it names (Redis, Redis
//! Cluster, Redis Sentinel, PostgreSQL), and a `redis+sentinel://` URL's parts are read here
//! too ([`SentinelTarget`]). The configuration edge parses `--store` (and the policy store's
//! URL) into a [`StoreUrl`]; everything below matches on it instead of on URL prefixes.

/// A store shared by a fleet of gateways (`--store` other than `memory`).
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Redis(RedisUrl),
    /// `postgres://` or `postgresql://`.
    Postgres(String),
}

/// A Redis deployment's URL.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisUrl {
    /// `redis://HOST:PORT[/DB]` or `rediss://...`: one server.
    Single(String),
    /// `redis+cluster://HOST:PORT[,HOST:PORT...]`: a Redis Cluster, found from its seed nodes.
    Cluster {
        url: String,
        /// Each seed node as `redis://HOST:PORT`, in the URL's order.
        nodes: Vec<String>,
    },
    /// `redis+sentinel://[USER:PASS@]HOST:PORT[,HOST:PORT...]/SERVICE[?db=N]`: the master of a
    /// service watched by Redis Sentinel.
    Sentinel { url: String, target: SentinelTarget },
}

/// A URL that names no shared store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreUrlError {
    /// The scheme is none of the stores'.
    #[error("not a shared store's URL (redis://, rediss://, redis+cluster://, redis+sentinel:// or postgres://)")]
    UnknownScheme,
    /// A `redis+sentinel://` URL that cannot be used.
    #[error(transparent)]
    Sentinel(#[from] SentinelUrlError),
}

impl StoreUrl {
    /// Reads a store URL's scheme (in any case; the URL is kept with its scheme in lower
    /// case): `redis://`, `rediss://`, `redis+cluster://`, `redis+sentinel://`, `postgres://`
    /// or `postgresql://`.
    ///
    /// # Errors
    /// Another scheme, or a `redis+sentinel://` URL missing a part.
    pub fn parse(url: &str) -> Result<StoreUrl, StoreUrlError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(StoreUrlError::UnknownScheme);
        };
        let scheme = scheme.to_ascii_lowercase();
        let url = format!("{scheme}://{rest}");
        Ok(match scheme.as_str() {
            "redis" | "rediss" => StoreUrl::Redis(RedisUrl::Single(url)),
            "redis+cluster" => StoreUrl::Redis(RedisUrl::Cluster {
                nodes: rest
                    .split(',')
                    .filter(|n| !n.trim().is_empty())
                    .map(|n| format!("redis://{}", n.trim()))
                    .collect(),
                url,
            }),
            "redis+sentinel" => StoreUrl::Redis(RedisUrl::Sentinel {
                target: SentinelTarget::parse(&url)?,
                url,
            }),
            "postgres" | "postgresql" => StoreUrl::Postgres(url),
            _ => return Err(StoreUrlError::UnknownScheme),
        })
    }

    /// The URL as given (its scheme in lower case).
    pub fn as_str(&self) -> &str {
        match self {
            StoreUrl::Redis(redis) => redis.as_str(),
            StoreUrl::Postgres(url) => url,
        }
    }
}

impl RedisUrl {
    /// The URL as given (its scheme in lower case).
    pub fn as_str(&self) -> &str {
        match self {
            RedisUrl::Single(url)
            | RedisUrl::Cluster { url, .. }
            | RedisUrl::Sentinel { url, .. } => url,
        }
    }
}

/// A `redis+sentinel://` URL that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SentinelUrlError {
    #[error("names no sentinel (expected redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE)")]
    NoSentinel,
    /// The sentinel address at this position (from 1) is not `HOST:PORT`. Its text is not
    /// repeated: a password holding an unencoded `/` or `@` ends up in it.
    #[error("sentinel address {0} (counting from 1) is not HOST:PORT")]
    BadAddress(usize),
    #[error("names no service (expected redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE)")]
    NoService,
    #[error("unknown parameter {0:?} (only db=N is understood)")]
    UnknownParameter(String),
    #[error("db {0:?} is not a database number")]
    BadDb(String),
    #[error("credentials are not usable: {0}")]
    BadCredentials(String),
}

/// Where a `redis+sentinel://` URL points: the sentinels to ask, the service they watch, and
/// how to log in to the master they name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelTarget {
    /// Sentinels, in the URL's order (`HOST`, `PORT`).
    pub sentinels: Vec<(String, u16)>,
    /// The master's name in the sentinels' configuration.
    pub service: String,
    /// Database number on the master.
    pub db: i64,
    pub username: Option<String>,
    pub password: Option<String>,
}

impl SentinelTarget {
    /// Parses `redis+sentinel://[USER:PASS@]HOST:PORT[,HOST:PORT...]/SERVICE[?db=N]`. The
    /// credentials (percent-encoded, as in a `redis://` URL) are the master's; the sentinels
    /// are asked without them unless they demand them.
    ///
    /// # Errors
    /// A part is missing or malformed (the error never repeats the credentials).
    pub fn parse(url: &str) -> Result<SentinelTarget, SentinelUrlError> {
        let rest = url
            .get(.."redis+sentinel://".len())
            .filter(|p| p.eq_ignore_ascii_case("redis+sentinel://"))
            .map_or(url, |_| &url["redis+sentinel://".len()..]);
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hosts) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        let mut sentinels = Vec::new();
        for (position, host) in hosts
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .enumerate()
        {
            let bad = || SentinelUrlError::BadAddress(position + 1);
            let (name, port) = crate::request::authority::split_host_port(host).ok_or_else(bad)?;
            let port: u16 = port.parse().map_err(|_| bad())?;
            if name.is_empty() || port == 0 {
                return Err(bad());
            }
            sentinels.push((name.to_string(), port));
        }
        if sentinels.is_empty() {
            return Err(SentinelUrlError::NoSentinel);
        }
        let (service, query) = path.split_once('?').unwrap_or((path, ""));
        let service = service.trim_end_matches('/');
        if service.is_empty() || service.contains('/') {
            return Err(SentinelUrlError::NoService);
        }
        let mut db = 0;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("db", value)) => {
                    db = value
                        .parse::<i64>()
                        .ok()
                        .filter(|n| *n >= 0)
                        .ok_or_else(|| SentinelUrlError::BadDb(value.to_string()))?;
                }
                _ => {
                    let name = pair.split_once('=').map_or(pair, |(name, _)| name);
                    return Err(SentinelUrlError::UnknownParameter(name.to_string()));
                }
            }
        }
        // The redis crate decodes the credentials as it does a `redis://` URL's.
        let (username, password) = match userinfo {
            None => (None, None),
            Some(userinfo) => {
                use redis::IntoConnectionInfo;
                let info = format!("redis://{userinfo}@localhost/")
                    .into_connection_info()
                    .map_err(|e| {
                        SentinelUrlError::BadCredentials(
                            crate::telemetry::redact::text(&e.to_string()).into_owned(),
                        )
                    })?;
                (info.redis.username, info.redis.password)
            }
        };
        Ok(SentinelTarget {
            sentinels,
            service: service.to_string(),
            db,
            username,
            password,
        })
    }

    /// How to reach `host:port` with this URL's credentials (and database, for the master).
    pub(super) fn node(
        &self,
        host: &str,
        port: u16,
        credentials: bool,
        db: i64,
    ) -> redis::ConnectionInfo {
        redis::ConnectionInfo {
            addr: redis::ConnectionAddr::Tcp(host.to_string(), port),
            redis: redis::RedisConnectionInfo {
                db,
                username: self.username.clone().filter(|_| credentials),
                password: self.password.clone().filter(|_| credentials),
                ..Default::default()
            },
        }
    }
}

impl std::str::FromStr for StoreUrl {
    type Err = StoreUrlError;

    fn from_str(url: &str) -> Result<StoreUrl, StoreUrlError> {
        StoreUrl::parse(url)
    }
}

// The URLs may carry passwords: `Debug` (a `Config` printed whole, say) shows them masked.
impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StoreUrl({})",
            crate::telemetry::redact::url(self.as_str())
        )
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RedisUrl({})",
            crate::telemetry::redact::url(self.as_str())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_scheme_names_its_backend() {
        let single = |u: &str| StoreUrl::Redis(RedisUrl::Single(u.to_string()));
        assert_eq!(
            StoreUrl::parse("redis://h:1/2"),
            Ok(single("redis://h:1/2"))
        );
        assert_eq!(StoreUrl::parse("rediss://h:1"), Ok(single("rediss://h:1")));
        assert_eq!(StoreUrl::parse("REDIS://h:1"), Ok(single("redis://h:1")));
        assert_eq!(
            StoreUrl::parse("redis+cluster://a:1, b:2,,"),
            Ok(StoreUrl::Redis(RedisUrl::Cluster {
                url: "redis+cluster://a:1, b:2,,".to_string(),
                nodes: vec!["redis://a:1".to_string(), "redis://b:2".to_string()],
            }))
        );
        let Ok(StoreUrl::Redis(RedisUrl::Sentinel { target, .. })) =
            StoreUrl::parse("redis+sentinel://s:26379/cache")
        else {
            panic!("a sentinel URL");
        };
        assert_eq!(target.service, "cache");
        for pg in ["postgres://u@h/db", "postgresql://u@h/db"] {
            assert_eq!(StoreUrl::parse(pg), Ok(StoreUrl::Postgres(pg.to_string())));
        }
    }

    #[test]
    fn other_urls_are_refused() {
        for url in ["memory", "ftp://h/x", "redis:/h:1", "", "http://h/"] {
            assert_eq!(
                StoreUrl::parse(url),
                Err(StoreUrlError::UnknownScheme),
                "{url}"
            );
        }
        assert_eq!(
            StoreUrl::parse("redis+sentinel://s:1"),
            Err(StoreUrlError::Sentinel(SentinelUrlError::NoService))
        );
    }

    #[test]
    fn debug_masks_the_password() {
        let url = StoreUrl::parse("redis://:hunter2@h:1").unwrap();
        let shown = format!("{url:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn sentinel_urls_name_sentinels_service_db_and_credentials() {
        let t = SentinelTarget::parse(
            "redis+sentinel://app:p%40ss@10.0.0.1:26379, 10.0.0.2:26380,[::1]:26381/cache?db=3",
        )
        .unwrap();
        assert_eq!(
            t,
            SentinelTarget {
                sentinels: vec![
                    ("10.0.0.1".into(), 26379),
                    ("10.0.0.2".into(), 26380),
                    ("::1".into(), 26381)
                ],
                service: "cache".into(),
                db: 3,
                username: Some("app".into()),
                password: Some("p@ss".into()),
            }
        );
        let bare = SentinelTarget::parse("redis+sentinel://s:26379/mymaster").unwrap();
        assert_eq!((bare.db, bare.username, bare.password), (0, None, None));
        let only_password = SentinelTarget::parse("redis+sentinel://:pw@s:1/m/").unwrap();
        assert_eq!(
            (only_password.username, only_password.password.as_deref()),
            (None, Some("pw"))
        );
        // The master gets the credentials and the database; a sentinel is asked with neither
        // unless it demands them.
        let master = t.node("10.0.0.9", 6379, true, t.db);
        assert_eq!(
            (master.redis.db, master.redis.password.as_deref()),
            (3, Some("p@ss"))
        );
        assert_eq!(t.node("10.0.0.1", 26379, false, 0).redis.password, None);
    }

    #[test]
    fn bad_sentinel_urls_are_refused_without_echoing_secrets() {
        let err = |url: &str| SentinelTarget::parse(url).unwrap_err();
        assert_eq!(err("redis+sentinel:///m"), SentinelUrlError::NoSentinel);
        assert_eq!(err("redis+sentinel://:pw@/m"), SentinelUrlError::NoSentinel);
        assert_eq!(err("redis+sentinel://s:1"), SentinelUrlError::NoService);
        assert_eq!(err("redis+sentinel://s:1/"), SentinelUrlError::NoService);
        assert_eq!(err("redis+sentinel://s:1/a/b"), SentinelUrlError::NoService);
        assert_eq!(err("redis+sentinel://s/m"), SentinelUrlError::BadAddress(1));
        assert_eq!(
            err("redis+sentinel://s:0/m"),
            SentinelUrlError::BadAddress(1)
        );
        assert_eq!(
            err("redis+sentinel://s:99999/m"),
            SentinelUrlError::BadAddress(1)
        );
        // A password with an unencoded `/` reads as a host: its text is not repeated.
        let e = err("redis+sentinel://app:hunt/er2@s:1/m");
        assert_eq!(e, SentinelUrlError::BadAddress(1));
        assert!(!e.to_string().contains("hunt"), "{e}");
        assert_eq!(
            err("redis+sentinel://s:1/m?db=x"),
            SentinelUrlError::BadDb("x".into())
        );
        assert_eq!(
            err("redis+sentinel://s:1/m?db=-1"),
            SentinelUrlError::BadDb("-1".into())
        );
        assert_eq!(
            err("redis+sentinel://s:1/m?password=secret"),
            SentinelUrlError::UnknownParameter("password".into())
        );
        for e in [
            err("redis+sentinel://u:secret@s/m"),
            err("redis+sentinel://u:secret@s:1/m?password=secret"),
        ] {
            assert!(!e.to_string().contains("secret"), "{e}");
        }
        // What the gateway logs of such a URL.
        assert_eq!(
            crate::telemetry::redact::url("redis+sentinel://app:secret@a:1,b:2/cache"),
            "redis+sentinel://app:***@a:1,b:2/cache"
        );
    }
}
