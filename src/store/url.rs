//! A shared store's URL, read once: its scheme says which backend it names (Redis, Redis
//! Cluster, Redis Sentinel, PostgreSQL). The configuration edge parses `--store` (and the
//! policy store's URL) into a [`StoreUrl`]; everything below matches on it instead of on URL
//! prefixes.

use super::redis::{SentinelTarget, SentinelUrlError};

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
}
