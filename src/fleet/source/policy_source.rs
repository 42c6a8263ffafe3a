//! The [`PolicySource`] trait every policy store backend implements, what it reads and writes
//! (the slots, the gateways' heartbeats) and its errors.

use crate::fleet::envelope::Envelope;
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

/// One slot as a gateway reads it: its size is asked first, and a slot above the gateway's
/// limit is never read (an envelope of 150 MB costs the gateway nothing but its size).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    Bytes(Vec<u8>),
    /// The slot holds this many bytes, above the limit: not read.
    TooLarge(u64),
}

impl Bounded {
    fn of(bytes: Vec<u8>, max_bytes: usize) -> Bounded {
        if bytes.len() > max_bytes {
            Bounded::TooLarge(bytes.len() as u64)
        } else {
            Bounded::Bytes(bytes)
        }
    }
}

/// Both slots as [`PolicySource::read_bounded`] found them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BoundedSlots {
    pub live: Option<Bounded>,
    pub candidate: Option<Bounded>,
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
    /// The last bundle refused from each slot (at most one per slot), so `tollgate fleet` can
    /// say that a gateway refused what the store holds now. Absent from older gateways.
    #[serde(default)]
    pub refusals: Vec<SlotRefusal>,
}

/// A bundle a gateway refused, as its heartbeat reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRefusal {
    /// `live` or `candidate`.
    pub slot: String,
    /// The refused envelope's version and SHA-256, when it had them.
    pub version: Option<u64>,
    pub hash: Option<String>,
    /// The reason, as `/readyz`'s `last_refusal` and the metric name it (`unsigned`...).
    pub reason: String,
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

    /// Both slots, each only when it holds at most `max_bytes` (its size asked first, in the
    /// same step as the read); a larger one is reported by its size. The default reads whole
    /// (a source that bounds its reads itself, as the HTTP source does).
    async fn read_bounded(&self, max_bytes: usize) -> Result<BoundedSlots, SourceError> {
        let slots = self.read().await?;
        Ok(BoundedSlots {
            live: slots.live.map(|b| Bounded::of(b, max_bytes)),
            candidate: slots.candidate.map(|b| Bounded::of(b, max_bytes)),
        })
    }

    /// The store's own clock, in Unix milliseconds (Redis `TIME`, PostgreSQL
    /// `clock_timestamp()`): what versions above which are not believed are measured against.
    /// The default is this machine's clock.
    async fn clock_ms(&self) -> Result<u64, SourceError> {
        Ok(u64::try_from(crate::limits::clock::wall_unix_ms()).unwrap_or(0))
    }

    /// Refresh: replaces the live envelope by `envelope` (the same bundle sealed again under a
    /// new version and expiry), without pushing it onto the history (which keeps bundles to go
    /// back to, not their refreshes); records the version; announces it.
    ///
    /// # Errors
    /// [`SourceError::Conflict`] when the live envelope is no longer `live`.
    async fn refresh(&self, envelope: &Envelope, live: &[u8]) -> Result<(), SourceError>;

    /// Repair: sets the record of the highest version issued to `issued` (also lower: a
    /// forged record above the clock is replaced) and removes the heartbeats of `gateways`.
    async fn repair(&self, issued: u64, gateways: &[String]) -> Result<(), SourceError>;

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

    /// The gateways present, at `now_us`, in the bucket store at this same URL (the N a
    /// shared store's local mode divides limits by, see [`crate::store::local`]), sorted;
    /// `None` where this kind of store keeps no such list.
    async fn present_gateways(&self, now_us: u64) -> Result<Option<Vec<String>>, SourceError> {
        let _ = now_us;
        Ok(None)
    }
}

/// A policy-store URL as logs, errors and `/readyz` show it: the password masked, and the query
/// (which may carry a token) never shown.
pub fn display_url(url: &(impl AsRef<str> + ?Sized)) -> String {
    let url = url.as_ref();
    match url.split_once('?') {
        Some((base, _)) => format!("{}?***", crate::telemetry::redact::url(base)),
        None => crate::telemetry::redact::url(url).into_owned(),
    }
}

/// Parses a stored heartbeat; `None` for one that is not (another version's, or damaged).
pub(super) fn parse_heartbeat(bytes: &[u8]) -> Option<Heartbeat> {
    serde_json::from_slice(bytes).ok()
}
