//! The small records a store keeps beside its buckets for budget rules: the usage ledger (each
//! key's spend in a window, by its readable name, for `GET /v1/usage`) and the threshold
//! webhooks' claims and outbox (a set-if-absent mark per key, threshold and window, and the
//! deliveries not yet confirmed). This file holds their vocabulary and the embedded store's
//! in-process copy; Redis keeps them in its own keys ([`super::redis`]), PostgreSQL in tables
//! ([`super::postgres`]). Times here are wall-clock Unix microseconds: a window ends at the same
//! instant on every gateway.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};

/// One key's spend seen in a budget window: the store keeps the largest seen per key (spend
/// only grows inside a window, so the largest is the latest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageNote {
    /// The rule's key prefix (`cb:<rule>:`): the ledger's section.
    pub prefix: String,
    /// The window's id (its start second).
    pub window_id: u64,
    /// When the record may go: one window after its window ends (so `previous` still finds
    /// it), wall-clock Unix µs.
    pub keep_until_us: u64,
    /// The key as `/v1/buckets` names it after the rule.
    pub key: String,
    /// Micro-units spent in the window after the charge.
    pub spent: u64,
}

/// A delivery waiting in the outbox: its mark and the exact body to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub mark: String,
    pub body: String,
}

/// Keys the embedded ledger keeps per rule and window; a key beyond them is not recorded (and
/// counted): a bound on what clients making up keys can make the gateway hold.
pub const MAX_USAGE_KEYS: usize = 100_000;
/// Keys Redis records per rule and window. The ledger's hash is kept a window longer than the
/// buckets (for `window=previous`), so under `maxmemory` with `volatile-ttl` Redis evicts
/// buckets before it: a ledger grown by a flood of made-up keys would crowd out the buckets
/// that enforce limits. Bounded, it takes at most about a megabyte per rule and window.
pub const MAX_SHARED_USAGE_KEYS: usize = 10_000;
/// Claims the embedded store keeps (expired ones are dropped first).
pub const MAX_CLAIMS: usize = 100_000;

/// The embedded store's ledger, claims and outbox, in process memory.
#[derive(Debug, Default)]
pub struct MemoryRecords {
    usage: Mutex<Usage>,
    claims: Mutex<Claims>,
}

/// One rule's windows: window id → (keep until, key → spent).
type Windows = BTreeMap<u64, (u64, HashMap<String, u64>)>;

#[derive(Debug, Default)]
struct Usage {
    /// prefix → its windows.
    sections: HashMap<String, Windows>,
}

#[derive(Debug, Default)]
struct Claims {
    /// mark → expiry (µs).
    marks: HashMap<String, u64>,
    /// mark → (lease until µs, body).
    pending: HashMap<String, (u64, String)>,
}

impl MemoryRecords {
    /// Records each note (the largest spend per key wins). A rule keeps its two latest windows.
    /// Returns how many notes found no room.
    pub fn note_usage(&self, notes: &[UsageNote]) -> u64 {
        let mut usage = self.usage.lock();
        let mut dropped = 0;
        for note in notes {
            let windows = usage.sections.entry(note.prefix.clone()).or_default();
            let (keep, keys) = windows
                .entry(note.window_id)
                .or_insert_with(|| (note.keep_until_us, HashMap::new()));
            *keep = (*keep).max(note.keep_until_us);
            let full = keys.len() >= MAX_USAGE_KEYS;
            let recorded = match keys.get_mut(&note.key) {
                Some(spent) => {
                    *spent = (*spent).max(note.spent);
                    true
                }
                None if !full => {
                    keys.insert(note.key.clone(), note.spent);
                    true
                }
                None => false,
            };
            while windows.len() > 2 {
                windows.pop_first();
            }
            if !recorded {
                dropped += 1;
            }
        }
        dropped
    }

    /// Every key's spend recorded for `prefix` in window `window_id`, by key.
    pub fn usage_rows(&self, prefix: &str, window_id: u64) -> Vec<(String, u64)> {
        let usage = self.usage.lock();
        let mut rows: Vec<(String, u64)> = usage
            .sections
            .get(prefix)
            .and_then(|windows| windows.get(&window_id))
            .map(|(_, keys)| keys.iter().map(|(k, s)| (k.clone(), *s)).collect())
            .unwrap_or_default();
        rows.sort();
        rows
    }

    /// Drops the windows kept past their time.
    pub fn sweep(&self, now_us: u64) {
        let mut usage = self.usage.lock();
        for windows in usage.sections.values_mut() {
            windows.retain(|_, (keep, _)| *keep > now_us);
        }
        usage.sections.retain(|_, windows| !windows.is_empty());
        drop(usage);
        let mut claims = self.claims.lock();
        claims.marks.retain(|_, expires| *expires > now_us);
    }

    /// Sets `mark` if absent (until `expires_us`) and puts `body` in the outbox leased until
    /// `lease_until_us`; false when the mark was already set (or no room is left for it).
    pub fn claim(
        &self,
        mark: &str,
        body: &str,
        now_us: u64,
        lease_until_us: u64,
        expires_us: u64,
    ) -> bool {
        let mut claims = self.claims.lock();
        if claims.marks.get(mark).is_some_and(|e| *e > now_us) {
            return false;
        }
        if claims.marks.len() >= MAX_CLAIMS {
            claims.marks.retain(|_, expires| *expires > now_us);
            if claims.marks.len() >= MAX_CLAIMS {
                return false;
            }
        }
        claims.marks.insert(mark.to_string(), expires_us);
        claims
            .pending
            .insert(mark.to_string(), (lease_until_us, body.to_string()));
        true
    }

    /// The deliveries whose lease ran out by `now_us` (at most `max`), each leased again until
    /// `lease_until_us`.
    pub fn take_due(&self, now_us: u64, lease_until_us: u64, max: usize) -> Vec<Pending> {
        let mut claims = self.claims.lock();
        let mut due = Vec::new();
        for (mark, (lease, body)) in claims.pending.iter_mut() {
            if due.len() >= max {
                break;
            }
            if *lease <= now_us {
                *lease = lease_until_us;
                due.push(Pending {
                    mark: mark.clone(),
                    body: body.clone(),
                });
            }
        }
        due
    }

    /// Takes a delivery out of the outbox (sent, or given up); its mark stays.
    pub fn settle(&self, mark: &str) {
        self.claims.lock().pending.remove(mark);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(window_id: u64, key: &str, spent: u64) -> UsageNote {
        UsageNote {
            prefix: "cb:r:".into(),
            window_id,
            keep_until_us: 1_000,
            key: key.into(),
            spent,
        }
    }

    #[test]
    fn the_ledger_keeps_the_largest_spend_per_key_and_two_windows_per_rule() {
        let r = MemoryRecords::default();
        r.note_usage(&[note(10, "b", 5), note(10, "a", 7), note(10, "b", 3)]);
        assert_eq!(
            r.usage_rows("cb:r:", 10),
            [("a".into(), 7), ("b".into(), 5)]
        );
        r.note_usage(&[note(20, "a", 1), note(30, "a", 2)]);
        assert!(r.usage_rows("cb:r:", 10).is_empty());
        assert_eq!(r.usage_rows("cb:r:", 20), [("a".into(), 1)]);
        assert_eq!(r.usage_rows("cb:r:", 30), [("a".into(), 2)]);
        assert!(r.usage_rows("cb:other:", 30).is_empty());
        r.sweep(1_000);
        assert!(r.usage_rows("cb:r:", 30).is_empty());
    }

    #[test]
    fn a_mark_is_claimed_once_and_its_delivery_leased_until_settled() {
        let r = MemoryRecords::default();
        assert!(r.claim("m", "{}", 0, 100, 1_000));
        assert!(!r.claim("m", "{\"x\":1}", 50, 150, 1_000));
        // Leased by its claimer until 100.
        assert!(r.take_due(99, 200, 10).is_empty());
        let due = r.take_due(100, 200, 10);
        assert_eq!(
            due,
            [Pending {
                mark: "m".into(),
                body: "{}".into()
            }]
        );
        assert!(r.take_due(150, 300, 10).is_empty());
        r.settle("m");
        assert!(r.take_due(1_000, 2_000, 10).is_empty());
        // The mark outlives the delivery until it expires.
        assert!(!r.claim("m", "{}", 999, 2_000, 3_000));
        r.sweep(1_000);
        assert!(r.claim("m", "{}", 1_000, 2_000, 3_000));
    }
}
