//! The recording of every limited request into the top sketch (`/v1/top`, the status page),
//! from the request path, and the addresses its entries give for a reset.

use super::top::{Event, Label, TopSketch};
use crate::engine::{Decided, EngineConfig};
use crate::limits::clock::Clock;
use crate::policy::Mode;
use crate::telemetry::redact::FingerprintKey;
use parking_lot::Mutex;

/// Encodes a bucket name for a path segment (everything but unreserved characters and `:`).
pub fn encode_path(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Where a masked bucket is addressed: by the hash `/v1/top` shows.
pub(super) const BY_HASH: &str = "by-hash/";

/// Counts a decided request in the top sketch: the buckets that refused it (or would
/// have, in shadow), and an enforced budget that warned or throttled it. Allowed requests
/// without a stage or shadow refusal return at once; a bucket's name is built only when it
/// enters the sketch. `wall_us` is the decision's own wall-clock reading (Unix µs), when it made
/// one: its second is the event's.
pub(crate) fn note_limited(
    top: &Mutex<TopSketch>,
    decided: &Decided<'_>,
    clock: &dyn Clock,
    wall_us: Option<u64>,
    config: EngineConfig,
    fingerprint_key: &FingerprintKey,
) {
    let decision = &decided.decision;
    let Some(checked) = decision.checked() else {
        return;
    };
    let refused = !decision.is_allowed();
    if !refused && checked.stage.is_none() && decision.shadow_rejections().next().is_none() {
        return;
    }
    // The second of the decision's own wall-clock reading when it made one.
    let unix_secs = wall_us.map_or_else(|| clock.unix_secs().max(0) as u64, |us| us / 1_000_000);
    let mut top = top.lock();
    let mut note = |rule: &crate::policy::Rule, key: &crate::store::BucketKey, event| {
        let key = super::buckets::key_u128(key);
        top.record(key, event, unix_secs, || {
            // Only a request refused before the engine lacks facts, and it has no
            // buckets; were one to reach here, its rule alone would name it.
            let name = decided
                .request
                .facts
                .and_then(|facts| crate::engine::bucket_name(rule, facts, config))
                .map(|(name, _)| name)
                .unwrap_or_else(|| rule.key_prefix.clone());
            let shown = super::buckets::shown_name(rule, &name, fingerprint_key).into_owned();
            // A loop's marks are per request fingerprint: nothing to reset by name.
            let reset_path = if super::buckets::Kind::of(rule) == super::buckets::Kind::Loop {
                String::new()
            } else if shown == name {
                format!("/v1/buckets/{}", encode_path(&name))
            } else {
                format!("/v1/buckets/{BY_HASH}{key:032x}")
            };
            Label {
                bucket: shown,
                name,
                rule: rule.name.clone(),
                policy: rule.policy_id.clone(),
                mode: rule.mode.as_str(),
                reset_path,
            }
        });
    };
    for outcome in &checked.rules {
        if !outcome.allowed && (refused || outcome.rule.mode == Mode::Shadow) {
            note(outcome.rule, &outcome.key, Event::Refused);
        } else if let (Some(budget), true, Mode::Enforce) =
            (outcome.rule.budget(), outcome.committed, outcome.rule.mode)
        {
            match budget.stage_for(outcome.quota.burst(), outcome.tokens) {
                Some(crate::limits::budget_window::Action::Warn) => {
                    note(outcome.rule, &outcome.key, Event::Warned)
                }
                Some(crate::limits::budget_window::Action::Throttle { .. }) => {
                    note(outcome.rule, &outcome.key, Event::Throttled)
                }
                _ => {}
            }
        }
    }
    for slot in &checked.slots {
        if !slot.allowed {
            note(slot.rule, &slot.key, Event::Refused);
        }
    }
}
