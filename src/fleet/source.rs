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

mod http;
mod postgres;
mod redis;

use super::envelope::Envelope;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How many previous live envelopes a store keeps for rollback.
pub const HISTORY_KEPT: usize = 20;

/// What a read of the source found: the raw envelopes (the follower parses, verifies and
/// compiles them, so that one bad slot is reported and counted, never fatal).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slots {
    pub live: Option<Vec<u8>>,
    pub candidate: Option<Vec<u8>>,
}

/// One gateway's heartbeat (JSON in the store), as `tollgate fleet` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// `--gateway-id` (default: host name and listen port).
    pub id: String,
    pub live_version: Option<u64>,
    pub live_hash: Option<String>,
    pub candidate_version: Option<u64>,
    pub candidate_hash: Option<String>,
    /// Unix seconds.
    pub at: i64,
    /// Requests the candidate would have refused since it was loaded here, by `policy/rule`.
    #[serde(default)]
    pub candidate_refusals: std::collections::BTreeMap<String, u64>,
    /// `following`, `unreachable`, or `starting`.
    pub source_state: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The store did not answer, answered an error, or timed out (message redacted).
    #[error("policy store unavailable: {0}")]
    Unavailable(String),
    /// An HTTP(S) source is read-only.
    #[error("{0}")]
    ReadOnly(String),
    /// The URL names no supported source.
    #[error("{0}")]
    BadUrl(String),
    /// The store changed under a read-modify-write (another publisher was quicker): nothing
    /// was written.
    #[error("{0}")]
    Conflict(String),
}

/// A policy store a gateway follows and `tollgate publish` writes.
#[async_trait::async_trait]
pub trait PolicySource: Send + Sync {
    /// The URL with any password masked, for logs, `/readyz` and metrics.
    fn display_url(&self) -> String;

    /// `redis`, `redis-cluster`, `postgres`, `http` (the `source` label of
    /// `tollgate_bundle_info`).
    fn kind(&self) -> &'static str;

    /// Both slots, as stored. An HTTP source has only a live slot (its body); it sends the
    /// previous `ETag` in `If-None-Match` and, on `304 Not Modified`, returns the body it
    /// kept, so a caller sees the same bytes.
    async fn read(&self) -> Result<Slots, SourceError>;

    /// Waits until the source announces a change or `at_most` passes (HTTP: just waits).
    /// Returns early with `false` when the notification channel is down (the caller polls).
    async fn changed(&self, at_most: Duration) -> bool;

    /// Stores `envelope` in its slot, and for the live slot pushes the previous live envelope
    /// onto the history; records the version as issued; announces it.
    async fn write(&self, envelope: &Envelope) -> Result<(), SourceError>;

    /// Promote: stores `envelope` (sealed for the live slot from the candidate) as live, pushing
    /// the live envelope onto the history, and removes the candidate, in one step; records the
    /// version; announces it.
    ///
    /// # Errors
    /// [`SourceError::Conflict`] when the candidate is no longer `candidate` (the bytes
    /// [`PolicySource::read`] returned): a newer one is never removed unseen.
    async fn promote(&self, envelope: &Envelope, candidate: &[u8]) -> Result<(), SourceError>;

    /// Removes the candidate slot and announces it.
    async fn clear_candidate(&self) -> Result<(), SourceError>;

    /// Previous live envelopes, newest first.
    async fn history(&self) -> Result<Vec<Vec<u8>>, SourceError>;

    /// Rollback: removes `head` (the history's first entry, as [`PolicySource::history`]
    /// returned it) from the history and stores `envelope` (sealed from it for the live slot)
    /// as live, without pushing the live envelope onto the history; records the version;
    /// announces it.
    ///
    /// # Errors
    /// [`SourceError::Conflict`] when the history's head is no longer `head`.
    async fn roll_back(&self, envelope: &Envelope, head: &[u8]) -> Result<(), SourceError>;

    /// The highest version the store has issued (0 when none or wiped).
    async fn highest_version(&self) -> Result<u64, SourceError>;

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<(), SourceError>;

    async fn gateways(&self) -> Result<Vec<Heartbeat>, SourceError>;
}

/// A policy-store URL as logs, errors and `/readyz` show it: the password masked, and the query
/// (which may carry a token) never shown.
pub fn display_url(url: &str) -> String {
    match url.split_once('?') {
        Some((base, _)) => format!("{}?***", crate::redact::url(base)),
        None => crate::redact::url(url).into_owned(),
    }
}

/// Opens the source a URL names: `redis://`, `rediss://` (when the Redis client is built with
/// TLS; this build's is not, and says so), `redis+cluster://`, `postgres://`,
/// `postgresql://`, `http://`, `https://`; `timeout` bounds each call. Nothing is connected yet:
/// the first call connects.
///
/// # Errors
/// The URL names no supported source or cannot be parsed.
pub fn open(url: &str, timeout: Duration) -> Result<std::sync::Arc<dyn PolicySource>, SourceError> {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("redis://")
        || lower.starts_with("rediss://")
        || lower.starts_with("redis+cluster://")
    {
        return Ok(std::sync::Arc::new(redis::RedisSource::new(url, timeout)?));
    }
    if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
        return Ok(std::sync::Arc::new(postgres::PostgresSource::new(
            url, timeout,
        )?));
    }
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Ok(std::sync::Arc::new(http::HttpSource::new(url, timeout)?));
    }
    Err(SourceError::BadUrl(format!(
        "{}: not a policy store (redis://, rediss://, redis+cluster://, postgres://, \
         postgresql://, http:// or https://)",
        crate::redact::url(url)
    )))
}

/// Parses a stored heartbeat; `None` for one that is not (another version's, or damaged).
fn parse_heartbeat(bytes: &[u8]) -> Option<Heartbeat> {
    serde_json::from_slice(bytes).ok()
}

/// A backend's change notifications as seen by [`PolicySource::changed`]: how many arrived
/// and whether the channel is up. A notification that arrives between two calls is not lost:
/// the next call returns `true` at once.
struct Feed {
    state: tokio::sync::watch::Sender<FeedState>,
    /// The count the last `changed()` returned on.
    seen: parking_lot::Mutex<u64>,
    /// One reconnect at a time.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Debug, Clone, Copy, Default)]
struct FeedState {
    count: u64,
    up: bool,
}

impl Feed {
    fn new() -> Feed {
        Feed {
            state: tokio::sync::watch::Sender::new(FeedState::default()),
            seen: parking_lot::Mutex::new(0),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn is_up(&self) -> bool {
        self.state.borrow().up
    }

    fn notified(&self) {
        self.state.send_modify(|s| s.count += 1);
    }

    fn set_up(&self, up: bool) {
        self.state.send_modify(|s| s.up = up);
    }

    /// `true` once a notification arrives (or has arrived since the last call); `false` at
    /// `at_most` or when the channel goes down.
    async fn wait(&self, at_most: Duration) -> bool {
        let mut rx = self.state.subscribe();
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            let now = *rx.borrow_and_update();
            {
                let mut seen = self.seen.lock();
                if now.count > *seen {
                    *seen = now.count;
                    return true;
                }
            }
            if !now.up {
                return false;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn unknown_schemes_are_refused_with_the_password_masked() {
        let Err(SourceError::BadUrl(e)) = open("ftp://u:secret@h/x", Duration::from_secs(1)) else {
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
            let source = open(url, Duration::from_secs(1)).unwrap();
            assert_eq!(source.kind(), kind);
            assert_eq!(source.display_url(), shown);
        }
    }
}
