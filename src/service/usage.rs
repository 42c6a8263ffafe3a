//! What a decision tells the usage ledger and the threshold webhooks: each budget bucket a
//! request spent (cost budgets, LLM day and spend rules), its key by name, its window and its
//! spend after the charge as the store answered it. The embedded store records the note at
//! once; for a shared store the notes wait here (the largest spend per key) for the next flush
//! ([`UsageDesk::flush`], every [`FLUSH_EVERY`]), so a request never waits for a second store
//! call. A crossing of a rule's `notify_at` threshold goes to [`super::webhooks::Webhooks`].

use super::webhooks::{Crossing, Webhooks};
use crate::engine::{Decided, EngineConfig, RuleOutcome};
use crate::store::records::UsageNote;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::redact::FingerprintKey;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Duration;

/// How often notes for a shared store are sent.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// Distinct keys waiting for a flush at most; notes beyond are dropped (and counted).
pub const MAX_WAITING_NOTES: usize = 10_000;

/// `(prefix, window id, key)` → (spend, keep until).
type Waiting = HashMap<(String, u64, String), (u64, u64)>;

/// The notes waiting for a shared store.
#[derive(Debug, Default)]
pub struct UsageDesk {
    waiting: Mutex<Waiting>,
}

/// A budget bucket's window, from the µs left in it when it was spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpentWindow {
    /// Unix seconds.
    pub start: u64,
    pub end: u64,
}

/// The window a budget outcome counted in: the one ending `ends_in_us` after `unix_us` (the
/// wall clock read a moment after the decision: a window's end is a whole second, so reading
/// it back to the second before is exact unless the decision took a second).
pub fn spent_window(outcome: &RuleOutcome<'_>, unix_us: u64) -> Option<SpentWindow> {
    let budget = outcome.rule.budget()?;
    let end = unix_us.saturating_add(outcome.budget_ends_in_us) / 1_000_000;
    let (start, end) = budget.zone.bounds(budget.period, end.saturating_sub(1));
    Some(SpentWindow { start, end })
}

/// What [`UsageDesk::note`] needs besides the decision.
pub(crate) struct NoteContext<'a> {
    pub(crate) clock: &'a dyn crate::limits::clock::Clock,
    pub(crate) engine: EngineConfig,
    pub(crate) store: &'a Store,
    pub(crate) webhooks: &'a Webhooks,
    pub(crate) fingerprints: &'a FingerprintKey,
    pub(crate) metrics: &'a Metrics,
}

impl UsageDesk {
    /// Notes every budget bucket `decided` spent. Requests under no budget rule return after
    /// one look at each outcome.
    #[inline]
    pub(crate) fn note(&self, decided: &Decided<'_>, context: &NoteContext<'_>) {
        let Some(checked) = decided.decision.checked() else {
            return;
        };
        for outcome in &checked.rules {
            if outcome.budget_ends_in_us > 0 && outcome.committed {
                self.note_budget(decided, outcome, context);
            }
        }
    }

    #[cold]
    fn note_budget(
        &self,
        decided: &Decided<'_>,
        outcome: &RuleOutcome<'_>,
        context: &NoteContext<'_>,
    ) {
        // Decided away from the shared store (its outage), or untracked: not the fleet's count.
        if outcome.away.is_some() || outcome.fail_open {
            return;
        }
        let (Some(facts), Some(window)) = (
            decided.request.facts,
            spent_window(outcome, context.clock.unix_us()),
        ) else {
            return;
        };
        let Some((name, prefix_len)) =
            crate::engine::bucket_name(outcome.rule, facts, context.engine)
        else {
            return;
        };
        let limit = outcome.quota.burst();
        let spent = limit.saturating_sub(outcome.tokens);
        let note = UsageNote {
            prefix: outcome.rule.key_prefix.clone(),
            window_id: window.start.max(1),
            keep_until_us: (2 * window.end - window.start).saturating_mul(1_000_000),
            key: name[prefix_len..].to_string(),
            spent,
        };
        if context.webhooks.enabled() {
            crossings(outcome, &note, window, &name, context);
        }
        match context.store.note_usage_now(std::slice::from_ref(&note)) {
            Some(dropped) => context.metrics.usage_notes_dropped(dropped),
            None => self.wait(note, context.metrics),
        }
    }

    fn wait(&self, note: UsageNote, metrics: &Metrics) {
        let mut waiting = self.waiting.lock();
        let full = waiting.len() >= MAX_WAITING_NOTES;
        let id = (note.prefix, note.window_id, note.key);
        match waiting.get_mut(&id) {
            Some((spent, _)) => *spent = (*spent).max(note.spent),
            None if !full => {
                waiting.insert(id, (note.spent, note.keep_until_us));
            }
            None => metrics.usage_notes_dropped(1),
        }
    }

    /// Sends the waiting notes to a shared store; those it did not take are counted dropped
    /// (the key's next charge records a spend at least as large).
    pub async fn flush(&self, store: &Store, metrics: &Metrics) {
        let waiting = std::mem::take(&mut *self.waiting.lock());
        if waiting.is_empty() {
            return;
        }
        let notes: Vec<UsageNote> = waiting
            .into_iter()
            .map(
                |((prefix, window_id, key), (spent, keep_until_us))| UsageNote {
                    prefix,
                    window_id,
                    keep_until_us,
                    key,
                    spent,
                },
            )
            .collect();
        match store.note_usage(&notes).await {
            Ok(dropped) => metrics.usage_notes_dropped(dropped),
            Err(e) => {
                metrics.usage_notes_dropped(notes.len() as u64);
                tracing::warn!("usage notes not recorded: {e}");
            }
        }
    }
}

/// The `notify_at` thresholds this spend has reached, handed to the webhooks (which send each
/// once per key, threshold and window).
fn crossings(
    outcome: &RuleOutcome<'_>,
    note: &UsageNote,
    window: SpentWindow,
    name: &str,
    context: &NoteContext<'_>,
) {
    let Some(budget) = outcome.rule.budget() else {
        return;
    };
    let limit = outcome.quota.burst();
    let mut shown = None;
    for &share in &budget.notify_at {
        if (note.spent as f64) < share * limit as f64 {
            break;
        }
        let key = shown.get_or_insert_with(|| {
            crate::operator::shown_name(outcome.rule, name, context.fingerprints)
                [outcome.rule.key_prefix.len()..]
                .to_string()
        });
        // The mark names the raw bucket (never shown): every gateway of the fleet, whatever its
        // fingerprint key, makes the same one.
        let mark = twox_hash::XxHash3_128::oneshot(
            format!(
                "{}\0{}\0{name}\0{}\0{share}",
                outcome.rule.policy_id, outcome.rule.name, window.start
            )
            .as_bytes(),
        );
        context.webhooks.crossed(Crossing {
            mark: format!("{mark:032x}"),
            policy: outcome.rule.policy_id.clone(),
            rule: outcome.rule.name.clone(),
            key: key.clone(),
            window_start: window.start,
            window_end: window.end,
            threshold: share,
            spent: note.spent,
            limit,
        });
    }
}
