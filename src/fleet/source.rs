//! Where a fleet's bundles live: the [`PolicySource`] trait and its backends (Redis, Redis
//! Cluster, PostgreSQL, and a read-only HTTP(S) URL).
//!
//! Redis keys (one hash tag, so a Redis Cluster keeps them in one slot):
//! `{tollgate-bundle}:live`, `{tollgate-bundle}:candidate` (envelope JSON),
//! `{tollgate-bundle}:history` (a list of previous live envelopes, newest first, 20 kept),
//! `{tollgate-bundle}:version` (the highest version issued), `{tollgate-bundle}:gateways` (a
//! hash: gateway id → heartbeat JSON); every change is announced by `PUBLISH
//! tollgate-bundle <version>`. A write is one Lua script (the keys share a slot), so the
//! history push, the slot and the version move together.
//!
//! PostgreSQL tables (created when missing): `tollgate_bundle(slot text primary key, version
//! bigint, envelope text)` with the rows `live`, `candidate` and `issued` (the highest version
//! issued; its envelope is empty), `tollgate_bundle_history(version bigint primary key,
//! envelope text)` (20 kept; newest first is highest version first),
//! `tollgate_gateways(id text primary key, heartbeat text, seen_at bigint)`; every change is
//! announced by `NOTIFY tollgate_bundle, '<version>'` in the writing transaction.
//!
//! Promote ([`PolicySource::promote`]) is one step too: the live slot, the history and the
//! candidate's removal move together, and only when the candidate is still the one read.
//!
//! Rollback ([`PolicySource::roll_back`]) takes the history's head off the history and puts
//! the envelope sealed from it in the live slot without pushing the live one: history is an
//! undo stack, so two rollbacks go back two bundles, never back and forth between two.
//!
//! Every call is bounded by the timeout given to [`open`]; a connection that failed is made
//! again by the next call.

mod feed;
mod http;
mod policy_source;
mod postgres;
mod redis;

use crate::store::{RedisUrl, StoreUrl};
pub use policy_source::{
    display_url, Bounded, BoundedSlots, Heartbeat, PolicySource, SlotRefusal, Slots, SourceError,
    HISTORY_KEPT,
};
use std::time::Duration;

/// A policy store's URL, read once from its scheme (in any case).
#[derive(Clone, PartialEq, Eq)]
pub enum SourceUrl {
    /// `redis://`, `rediss://` (when the Redis client is built with TLS; this build's is not,
    /// and says so) or `redis+cluster://`. A `redis+sentinel://` URL is no policy store.
    Redis(RedisUrl),
    /// `postgres://` or `postgresql://`.
    Postgres(String),
    /// `http://` or `https://`: read-only, one envelope served.
    Http(String),
}

impl SourceUrl {
    /// Reads a policy store's URL.
    ///
    /// # Errors
    /// [`SourceError::BadUrl`]: the URL names no supported source (its password masked).
    pub fn parse(url: &str) -> Result<SourceUrl, SourceError> {
        let http = url.split_once("://").is_some_and(|(scheme, _)| {
            matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https")
        });
        match StoreUrl::parse(url) {
            _ if http => Ok(SourceUrl::Http(url.to_string())),
            Ok(StoreUrl::Redis(RedisUrl::Sentinel { .. })) | Err(_) => {
                Err(SourceError::BadUrl(format!(
                    "{}: not a policy store (redis://, rediss://, redis+cluster://, postgres://, \
                 postgresql://, http:// or https://)",
                    crate::telemetry::redact::url(url)
                )))
            }
            Ok(StoreUrl::Redis(redis)) => Ok(SourceUrl::Redis(redis)),
            Ok(StoreUrl::Postgres(url)) => Ok(SourceUrl::Postgres(url)),
        }
    }

    /// The URL as given.
    pub fn as_str(&self) -> &str {
        match self {
            SourceUrl::Redis(url) => url.as_str(),
            SourceUrl::Postgres(url) | SourceUrl::Http(url) => url,
        }
    }
}

impl AsRef<str> for SourceUrl {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::str::FromStr for SourceUrl {
    type Err = SourceError;

    fn from_str(url: &str) -> Result<SourceUrl, SourceError> {
        SourceUrl::parse(url)
    }
}

// The URL may carry a password: `Debug` shows it masked.
impl std::fmt::Debug for SourceUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SourceUrl({})", display_url(self.as_str()))
    }
}

/// Opens the source a URL names; `timeout` bounds each call. Nothing is connected yet: the
/// first call connects.
///
/// # Errors
/// The URL cannot be parsed by its backend.
pub fn open(
    url: &SourceUrl,
    timeout: Duration,
) -> Result<std::sync::Arc<dyn PolicySource>, SourceError> {
    Ok(match url {
        SourceUrl::Redis(url) => std::sync::Arc::new(redis::RedisSource::new(url, timeout)?),
        SourceUrl::Postgres(url) => {
            std::sync::Arc::new(postgres::PostgresSource::new(url, timeout)?)
        }
        SourceUrl::Http(url) => std::sync::Arc::new(http::HttpSource::new(url, timeout)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use feed::Feed;

    #[tokio::test]
    async fn a_notification_between_calls_is_not_lost() {
        let feed = Feed::new();
        assert!(!feed.wait(Duration::from_millis(1)).await, "down");
        feed.set_up(true);
        feed.notified();
        assert!(feed.wait(Duration::from_secs(5)).await);
        assert!(!feed.wait(Duration::from_millis(10)).await, "seen once");
        feed.set_up(false);
        assert!(
            !feed.wait(Duration::from_secs(5)).await,
            "down returns at once"
        );
    }

    #[tokio::test]
    async fn a_flood_of_notifications_turns_the_channel_off_for_a_while() {
        let feed = Feed::new();
        feed.set_up(true);
        for _ in 0..feed::FLOOD_LIMIT {
            assert!(feed.notified());
        }
        assert!(!feed.quiet());
        // Within the same window (FLOOD_LIMIT fast calls take far less than 100 ms).
        assert!(
            !feed.notified(),
            "flooded: the caller drops its subscription"
        );
        assert!(feed.quiet());
        // What arrived is still seen once.
        assert!(feed.wait(Duration::from_millis(1)).await);
    }

    #[test]
    fn unknown_schemes_are_refused_with_the_password_masked() {
        let Err(SourceError::BadUrl(e)) = SourceUrl::parse("ftp://u:secret@h/x") else {
            panic!("ftp is no policy store");
        };
        assert!(!e.contains("secret"), "{e}");
        assert!(e.starts_with("ftp://u:"), "{e}");
    }

    #[test]
    fn display_urls_mask_passwords() {
        for (url, kind, shown) in [
            (
                "redis://:hunter2@127.0.0.1:6379/0",
                "redis",
                "redis://:***@127.0.0.1:6379/0",
            ),
            (
                "redis+cluster://:hunter2@127.0.0.1:7000,:hunter2@127.0.0.1:7001",
                "redis-cluster",
                "redis+cluster://:***@127.0.0.1:7000,:***@127.0.0.1:7001",
            ),
            (
                "postgres://tg:hunter2@127.0.0.1/db",
                "postgres",
                "postgres://tg:***@127.0.0.1/db",
            ),
            (
                "https://u:hunter2@example.com/b.json?token=hunter2",
                "http",
                "https://u:***@example.com/b.json?***",
            ),
        ] {
            let source = open(&url.parse().unwrap(), Duration::from_secs(1)).unwrap();
            assert_eq!(source.kind(), kind);
            assert_eq!(source.display_url(), shown);
        }
    }
}
