//! Where one gateway stands against the bundles its policy store holds now: serving the live
//! one, `behind` it, or having `refused (<reason>)` it (or the candidate). `tollgate fleet`
//! computes it from the store's slots and each gateway's heartbeat; a gateway computes the same
//! for its own `/readyz` and `/status` from the slots it last read. Pure: no I/O.
//!
//! A gateway that refused a bundle keeps the one in force, so it serves an older version and,
//! without this, looked like any gateway following the store. The refusal it reports (per slot,
//! with the refused envelope's version and SHA-256) is matched against what the slot holds now:
//! a refusal of a bundle since replaced says nothing about the current one.

use crate::fleet::source::SlotRefusal;
use std::fmt;

/// What a slot of the store holds: its envelope's version and SHA-256, read leniently (a
/// malformed envelope may have neither).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotId {
    pub version: Option<u64>,
    pub hash: Option<String>,
}

impl SlotId {
    /// The identity of a slot's raw bytes: the `version` and `sha256` fields when present.
    pub fn of(bytes: &[u8]) -> SlotId {
        #[derive(serde::Deserialize)]
        struct Fields {
            version: Option<u64>,
            sha256: Option<String>,
        }
        match serde_json::from_slice::<Fields>(bytes) {
            Ok(f) => SlotId {
                version: f.version,
                hash: f.sha256,
            },
            Err(_) => SlotId::default(),
        }
    }

    /// Whether `refusal` was of this bundle: the same version (or neither has one) and, when
    /// both name one, the same hash.
    fn refused_by(&self, refusal: &SlotRefusal) -> bool {
        refusal.version == self.version
            && match (&refusal.hash, &self.hash) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }
}

/// Where a gateway stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// It refused the bundle the store holds now in `slot` (`live` first) for `reason`.
    Refused { slot: String, reason: String },
    /// It serves an older live version than the store's (or none), not because it refused the
    /// current one (it has not read it yet, cannot reach the store, is stuck...).
    Behind,
    /// It serves a newer live version than the store's (the store was rolled back by hand or
    /// wiped and not yet read again).
    Ahead,
    /// It serves the store's live version (or the store has none): its follower's own state,
    /// `following`, `unreachable` or `starting`.
    Current(String),
}

impl Standing {
    /// Where a gateway serving live version `serving`, that reported `refusals` and whose
    /// follower is in `source_state`, stands against a store holding `live` and `candidate`.
    pub fn of(
        live: Option<&SlotId>,
        candidate: Option<&SlotId>,
        serving: Option<u64>,
        refusals: &[SlotRefusal],
        source_state: &str,
    ) -> Standing {
        let refused = |slot: &str, held: Option<&SlotId>| {
            let held = held?;
            refusals
                .iter()
                .find(|r| r.slot == slot && held.refused_by(r))
                .map(|r| Standing::Refused {
                    slot: slot.to_string(),
                    reason: r.reason.clone(),
                })
        };
        if let Some(standing) = refused("live", live) {
            return standing;
        }
        if let Some(store) = live.and_then(|l| l.version) {
            match serving {
                Some(v) if v > store => return Standing::Ahead,
                Some(v) if v == store => {}
                _ => return Standing::Behind,
            }
        }
        refused("candidate", candidate)
            .unwrap_or_else(|| Standing::Current(source_state.to_string()))
    }

    /// Whether a gateway serving `serving` is on the store's live version (`true` when the
    /// store has none to be on).
    pub fn on_live(live: Option<&SlotId>, serving: Option<u64>) -> bool {
        live.and_then(|l| l.version)
            .is_none_or(|store| serving == Some(store))
    }

    /// Whether this is anything but serving the current bundles as the follower reports.
    pub fn is_trouble(&self) -> bool {
        !matches!(self, Standing::Current(s) if s == "following")
    }
}

impl fmt::Display for Standing {
    /// `refused (unsigned)`, `behind`, `ahead`, `following`...
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Standing::Refused { reason, .. } => write!(f, "refused ({reason})"),
            Standing::Behind => f.write_str("behind"),
            Standing::Ahead => f.write_str("ahead"),
            Standing::Current(state) => f.write_str(state),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(version: u64, hash: &str) -> SlotId {
        SlotId {
            version: Some(version),
            hash: Some(hash.to_string()),
        }
    }

    fn refusal(slot: &str, version: Option<u64>, hash: Option<&str>, reason: &str) -> SlotRefusal {
        SlotRefusal {
            slot: slot.to_string(),
            version,
            hash: hash.map(str::to_string),
            reason: reason.to_string(),
        }
    }

    #[test]
    fn a_slot_id_is_read_leniently() {
        assert_eq!(
            SlotId::of(br#"{"version": 7, "sha256": "ab", "policy": "{}"}"#),
            id(7, "ab")
        );
        assert_eq!(SlotId::of(br#"{"rules": []}"#), SlotId::default());
        assert_eq!(SlotId::of(b"not json"), SlotId::default());
    }

    #[test]
    fn a_refusal_of_the_current_live_bundle_says_so() {
        let live = id(9, "new");
        let standing = Standing::of(
            Some(&live),
            None,
            Some(8),
            &[refusal("live", Some(9), Some("new"), "unsigned")],
            "following",
        );
        assert_eq!(standing.to_string(), "refused (unsigned)");
        assert!(standing.is_trouble());
        assert!(!Standing::on_live(Some(&live), Some(8)));
    }

    #[test]
    fn a_refusal_of_a_replaced_bundle_is_not_the_current_ones() {
        let live = id(10, "newer");
        let old = [refusal("live", Some(9), Some("new"), "unsigned")];
        // Since put in force: on live.
        assert_eq!(
            Standing::of(Some(&live), None, Some(10), &old, "following").to_string(),
            "following"
        );
        // Not yet read: behind, not refused.
        assert_eq!(
            Standing::of(Some(&live), None, Some(8), &old, "following"),
            Standing::Behind
        );
        // The same version under another hash is another bundle.
        let same_version = [refusal("live", Some(10), Some("other"), "bad_signature")];
        assert_eq!(
            Standing::of(Some(&live), None, Some(8), &same_version, "following"),
            Standing::Behind
        );
    }

    #[test]
    fn behind_ahead_and_current() {
        let live = id(10, "h");
        assert_eq!(
            Standing::of(Some(&live), None, None, &[], "starting"),
            Standing::Behind
        );
        assert_eq!(
            Standing::of(Some(&live), None, Some(11), &[], "following"),
            Standing::Ahead
        );
        let current = Standing::of(Some(&live), None, Some(10), &[], "unreachable");
        assert_eq!(current.to_string(), "unreachable");
        assert!(current.is_trouble());
        // A store with no live bundle: nothing to be behind.
        assert_eq!(
            Standing::of(None, None, Some(3), &[], "following").to_string(),
            "following"
        );
        assert!(Standing::on_live(None, Some(3)));
        assert!(Standing::on_live(Some(&live), Some(10)));
    }

    #[test]
    fn a_refused_candidate_shows_on_a_gateway_serving_live() {
        let (live, candidate) = (id(10, "h"), id(11, "c"));
        let standing = Standing::of(
            Some(&live),
            Some(&candidate),
            Some(10),
            &[refusal("candidate", Some(11), Some("c"), "invalid_bundle")],
            "following",
        );
        assert_eq!(
            standing,
            Standing::Refused {
                slot: "candidate".into(),
                reason: "invalid_bundle".into()
            }
        );
        assert!(Standing::on_live(Some(&live), Some(10)));
        // The live refusal comes first.
        let both = [
            refusal("candidate", Some(11), Some("c"), "invalid_bundle"),
            refusal("live", Some(10), None, "unsigned"),
        ];
        assert_eq!(
            Standing::of(Some(&live), Some(&candidate), Some(9), &both, "following").to_string(),
            "refused (unsigned)"
        );
    }

    #[test]
    fn a_malformed_slot_matches_a_refusal_without_identity() {
        let malformed = SlotId::default();
        assert_eq!(
            Standing::of(
                Some(&malformed),
                None,
                Some(5),
                &[refusal("live", None, None, "malformed")],
                "following"
            )
            .to_string(),
            "refused (malformed)"
        );
    }
}
