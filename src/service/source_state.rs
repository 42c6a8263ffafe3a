//! What the policy-store follower ([`super::follow`]) knows and keeps in the gateway, for
//! `/readyz`, `/status` and the heartbeat: the store, whether it answers, the bundles in force
//! from it, and the last refusal.

use crate::fleet::envelope::Slot;
use parking_lot::Mutex;

/// The last refusal, as `/readyz` shows it.
#[derive(Debug, Clone)]
pub(super) struct RefusalRecord {
    pub(super) at: i64,
    pub(super) slot: Slot,
    pub(super) version: Option<u64>,
    /// The refused envelope's SHA-256, when it had one.
    pub(super) hash: Option<String>,
    pub(super) reason: &'static str,
    pub(super) message: String,
}

/// What the follower knows, for `/readyz`, `/status` and the heartbeat.
#[derive(Debug, Default)]
pub(crate) struct SourceState {
    /// The store's URL, password masked, and its kind.
    pub(super) url: String,
    pub(super) kind: &'static str,
    /// `None` before the first read; then whether the last read answered.
    pub(super) reachable: Option<bool>,
    pub(super) unreachable_since: Option<i64>,
    pub(super) last_error: Option<String>,
    pub(super) last_refusal: Option<RefusalRecord>,
    /// The last refusal from each slot (live, candidate), for the heartbeat and the standing.
    pub(super) refused: [Option<RefusalRecord>; 2],
    /// Refusals since start (a change is heartbeaten at once).
    pub(super) refusals: u64,
    /// What the store's live and candidate slots held at the last read (`None`: empty).
    pub(super) store_slots: [Option<crate::fleet::standing::SlotId>; 2],
    /// The live and candidate bundles in force from the store: version and SHA-256.
    pub(super) live: Option<(u64, String)>,
    pub(super) candidate: Option<(u64, String)>,
    /// When the live and candidate bundles in force expire (Unix seconds; `None`: an envelope
    /// from before expiries, taken without a verify key).
    pub(super) live_expires_at: Option<i64>,
    pub(super) candidate_expires_at: Option<i64>,
    /// The highest candidate version withdrawn: a candidate at or below it is refused.
    pub(super) candidate_withdrawn: Option<u64>,
    /// The last expiry warning logged: the live version and its stage (1 within a week, 2
    /// expired), so each is logged once.
    pub(super) expiry_warned: Option<(u64, u8)>,
    /// Hashes of the raw slots last looked at (live, candidate): an unchanged slot is not
    /// parsed again, and a refused one is reported once.
    pub(super) seen: [Option<u64>; 2],
    /// A slot refused as from the future is looked at again from this time (Unix seconds):
    /// this gateway's clock may have been behind, and time may make the version believable.
    pub(super) future_recheck_at: [Option<i64>; 2],
    /// The store had no live bundle at the last read (logged once).
    pub(super) empty_reported: bool,
}

/// The state kept per gateway, built with it.
pub(crate) fn new_state() -> Mutex<SourceState> {
    Mutex::new(SourceState::default())
}
