//! The gateway's follow component ([`FollowState`]): what the policy-store follower
//! ([`super::follow`]) knows and keeps in the gateway, for `/readyz`, `/status` and the
//! heartbeat: the store, whether it answers, the bundles in force from it, and the last
//! refusal.

use crate::fleet::envelope::Slot;
use crate::fleet::source::SlotRefusal;
use crate::fleet::standing::Standing;
use crate::limits::clock::Clock;
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

/// How long before the live bundle in force expires the gateway starts warning (a WARN line,
/// `/readyz` `policy_source.expires_soon`, `tollgate_bundle_expiry_timestamp_seconds`).
pub const EXPIRY_WARNING_SECS: i64 = 7 * 24 * 3600;

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

impl SourceState {
    /// The heartbeat's form of the last refusal from each slot.
    pub(super) fn slot_refusals(&self) -> Vec<SlotRefusal> {
        self.refused
            .iter()
            .flatten()
            .map(|r| SlotRefusal {
                slot: r.slot.as_str().to_string(),
                version: r.version,
                hash: r.hash.clone(),
                reason: r.reason.to_string(),
            })
            .collect()
    }

    /// Where this gateway stands against the slots it last read.
    fn standing(&self) -> Standing {
        Standing::of(
            self.store_slots[0].as_ref(),
            self.store_slots[1].as_ref(),
            self.live.as_ref().map(|(v, _)| *v),
            &self.slot_refusals(),
            self.state_name(),
        )
    }

    /// `starting` (not read yet), `following` or `unreachable`.
    pub(super) fn state_name(&self) -> &'static str {
        match self.reachable {
            None => "starting",
            Some(true) => "following",
            Some(false) => "unreachable",
        }
    }
}

/// The gateway's follow component: whether it follows a policy store (`--policy-store`), and
/// what its follower knows.
pub struct FollowState {
    on: bool,
    state: Mutex<SourceState>,
    clock: Arc<dyn Clock>,
}

impl FollowState {
    /// Nothing known yet; `on` with `--policy-store`.
    pub(super) fn new(on: bool, clock: Arc<dyn Clock>) -> FollowState {
        FollowState {
            on,
            state: Mutex::new(SourceState::default()),
            clock,
        }
    }

    /// What the follower knows, to read or change.
    pub(crate) fn lock(&self) -> MutexGuard<'_, SourceState> {
        self.state.lock()
    }

    /// `/readyz`'s `policy_source`: `null` without `--policy-store`.
    pub(crate) fn policy_source_json(&self) -> serde_json::Value {
        if !self.on {
            return serde_json::Value::Null;
        }
        let state = self.state.lock();
        let show = |b: &Option<(u64, String)>, expires_at: Option<i64>| match b {
            Some((version, hash)) => {
                serde_json::json!({"version": version, "hash": hash, "expires_at": expires_at})
            }
            None => serde_json::Value::Null,
        };
        let expires_soon = state
            .live_expires_at
            .is_some_and(|at| at.saturating_sub(self.clock.unix_secs()) <= EXPIRY_WARNING_SECS);
        serde_json::json!({
            "url": state.url,
            "kind": state.kind,
            "state": state.state_name(),
            "unreachable_since": state.unreachable_since,
            "last_error": state.last_error,
            "live": show(&state.live, state.live_expires_at),
            "candidate": show(&state.candidate, state.candidate_expires_at),
            "expires_soon": expires_soon,
            // Where this gateway stands against what the store holds, as `tollgate fleet`
            // shows it: `following`, `behind`, `refused (<reason>)`...
            "standing": state.standing().to_string(),
            "last_refusal": state.last_refusal.as_ref().map(|r| serde_json::json!({
                "at": r.at,
                "slot": r.slot.as_str(),
                "version": r.version,
                "reason": r.reason,
                "message": r.message,
            })),
        })
    }

    /// The candidate in force from the policy store (version, SHA-256).
    pub fn published_candidate(&self) -> Option<(u64, String)> {
        self.state.lock().candidate.clone()
    }
}
