//! The gateway's state: one value holding the configuration, the store, the metrics, the bundle
//! in force and everything the request path, reloads, the policy-store follower, the candidate
//! in shadow and the decision service's reservations keep. Its behaviour is written beside it:
//! the request path in [`super`], the rest in the sibling file of each concern.

use super::loaded::{FileSignature, LoadedPolicy};
use super::shadow::Candidate;
use super::source_state::SourceState;
use crate::config::Config;
use crate::engine::headers::HeaderConfig;
use crate::engine::{EngineConfig, Reservation};
use crate::limits::clock::Clock;
use crate::policy::Bundle;
use crate::request::auth::Verifier;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use std::sync::Arc;

/// The gateway.
pub struct Gateway {
    pub metrics: Metrics,
    pub config: Config,
    pub header_config: HeaderConfig,
    pub verifier: Verifier,
    /// Where buckets live: the embedded store, or one shared with other gateways (shared with
    /// the candidate bundle's store calls, which run apart from the request on a shared store).
    pub store: Arc<Store>,
    pub(crate) engine_config: EngineConfig,
    /// Wall-clock time for kill-switch expiry (the store keeps its own time base).
    pub(crate) clock: Arc<dyn Clock>,
    /// The bundle in force.
    pub(crate) policy: ArcSwapOption<Bundle>,
    pub(crate) loaded: ArcSwapOption<LoadedPolicy>,
    /// The buckets limited most over the last minute (`/v1/top`, the status page).
    pub(crate) top: Mutex<crate::operator::top::TopSketch>,
    /// `--asn-type-map` and `--tor-exits` in force, and the files' signatures last read.
    pub(super) network: arc_swap::ArcSwap<crate::request::network::NetworkData>,
    pub(super) network_watch: Mutex<Vec<Option<FileSignature>>>,
    /// Signature of the file last looked at, and the hash of the last rejected content (so a
    /// broken file is reported once, not at every poll).
    pub(super) watch: Mutex<(Option<FileSignature>, Option<String>)>,
    /// LLM reservations the decision service handed out, by token, until `POST /v1/usage`
    /// settles them or they expire (wall-clock µs).
    pub(super) held: Mutex<ahash::AHashMap<String, (u64, Reservation)>>,
    /// With `--reservation-secret`: reservations travel in tokens signed with this key
    /// ([`crate::engine::reservation_token`]) instead of being held here.
    pub(super) reservation_key: Option<ring::hmac::Key>,
    /// `--debug-session-secret` under `--compat fairvisor`: the sessions open and the failed
    /// attempts by client.
    pub(super) debug_sessions: Option<parking_lot::RwLock<crate::engine::compat::DebugSessions>>,
    /// The key of masked values' fingerprints (`/v1/top`, the status page, explain).
    pub(crate) fingerprint_key: crate::telemetry::redact::FingerprintKey,
    /// OpenTelemetry traces, when the `OTEL_*` environment asks for them (set once at start).
    pub(super) telemetry: std::sync::OnceLock<crate::telemetry::traces::Telemetry>,
    /// `--policy-store`: what the follower knows ([`super::follow`]).
    pub(crate) source_state: Mutex<SourceState>,
    /// The candidate bundle decided in shadow ([`Gateway::set_candidate`]), whether one is set
    /// (the request path's only look without one), and its shared-store calls outstanding.
    pub(super) candidate: ArcSwapOption<Candidate>,
    pub(super) candidate_on: std::sync::atomic::AtomicBool,
    pub(super) candidate_pending: Arc<std::sync::atomic::AtomicUsize>,
}
