//! Where a fleet's bundles live: the [`PolicySource`] trait and its backends (Redis, Redis
//! Cluster, PostgreSQL, and a read-only HTTP(S) URL).
//!
//! Redis keys (one hash tag, so a Redis Cluster keeps them in one slot):
//! `{tollgate-bundle}:live`, `{tollgate-bundle}:candidate` (envelope JSON),
//! `{tollgate-bundle}:history` (a list of previous live envelopes, newest first, 20 kept),
//! `{tollgate-bundle}:version` (the highest version issued), `{tollgate-bundle}:gateways` (a
//! hash: gateway id → heartbeat JSON); every change is announced by `PUBLISH
//! tollgate-bundle <version>`.
//!
//! PostgreSQL tables: `tollgate_bundle(slot text primary key, version bigint, envelope text)`,
//! `tollgate_bundle_history(version bigint primary key, envelope text)`,
//! `tollgate_gateways(id text primary key, heartbeat text, seen_at bigint)`; every change is
//! announced by `NOTIFY tollgate_bundle, '<version>'`.

use super::envelope::{Envelope, Slot};
use serde::{Deserialize, Serialize};
use std::time::Duration;

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

    /// Removes the candidate slot (after a promote) and announces it.
    async fn clear_candidate(&self) -> Result<(), SourceError>;

    /// Previous live envelopes, newest first.
    async fn history(&self) -> Result<Vec<Vec<u8>>, SourceError>;

    /// The highest version the store has issued (0 when none or wiped).
    async fn highest_version(&self) -> Result<u64, SourceError>;

    async fn heartbeat(&self, beat: &Heartbeat) -> Result<(), SourceError>;

    async fn gateways(&self) -> Result<Vec<Heartbeat>, SourceError>;
}

/// Opens the source a URL names: `redis://`, `rediss://`, `redis+cluster://`, `postgres://`,
/// `postgresql://`, `http://`, `https://`; `timeout` bounds each call.
///
/// # Errors
/// The URL names no supported source or cannot be parsed.
pub fn open(url: &str, timeout: Duration) -> Result<std::sync::Arc<dyn PolicySource>, SourceError> {
    let _ = (url, timeout, Slot::Live);
    unimplemented!("interface: implemented by the fleet-store work")
}
