//! A candidate bundle decided in shadow beside the live one: which of its rules would refuse a
//! request the live bundle has just decided. Pure like the rest of the engine: the caller owns
//! the store calls ([`decide_candidate_local`] makes them on the embedded store).
//!
//! A candidate is usually the live bundle with a few rules changed. A candidate rule whose
//! definition equals a live rule's ([`Rule::definition`]: same policy id, selector and mode,
//! same name and JSON) counts the same requests on the same keys, so its verdict is read from
//! the live decision: only changed and new rules are planned, keyed under `candidate:` (their
//! own buckets) and sent to the store. A rule the live decision has no verdict for (the live
//! request was refused before its buckets, or the rule only applies under the candidate, as a
//! fallback whose siblings changed) is planned on its own buckets too. A policy of the candidate
//! that is the live one unchanged (every rule shared) is not even planned when the live
//! decision reached its buckets: every verdict it has is in that decision.
//!
//! What the candidate does with the store: its buckets are spent like the live ones (its own
//! enforced buckets all-or-nothing among themselves); its concurrency slots are taken and given
//! back at once (a candidate never holds a slot across the response, so a changed or new
//! concurrency rule counts only the requests decided at the same instant, while an unchanged
//! one reads the live verdict); LLM rules charge the request-time estimate and are never
//! settled; its circuit breakers count the requests that would trip them, and never open.

use super::decision::{Cause, Decision};
use super::{plan_reusing, EngineConfig, Plan, Selection};
use crate::policy::{Bundle, Guard, KillSwitch, LoopAction, Mode, Rule};
use crate::request::descriptor::RequestFacts;
use crate::store::lease::{next_lease_id, LeaseOp, LeaseResults};
use crate::store::{BucketKey, BucketOp, MemoryStore, OpResults};
use smallvec::SmallVec;
use std::sync::Arc;

/// What would refuse a request under the candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refuser {
    /// A rule: its index in the candidate's [`Bundle::rules`].
    Rule(u32),
    /// A kill switch: its index in the candidate's [`Bundle::kill_switches`].
    KillSwitch(u32),
}

/// The refusals of one request under the candidate (none: it would be allowed).
pub type Refusers = SmallVec<[Refuser; 2]>;

/// A candidate bundle, with the rules it shares with the live bundle it was compared to.
#[derive(Debug)]
pub struct CandidateBundle {
    bundle: Arc<Bundle>,
    /// The live bundle `shared` was computed against (held, so that its address names it for
    /// as long as this lives).
    live: Option<Arc<Bundle>>,
    /// By candidate rule index: the live rule with the same definition.
    shared: Vec<Option<u32>>,
    /// By candidate policy index: the policy is the live one unchanged (every rule shared, as
    /// many rules as the live policy of its id, no guard), so a live decision that reached its
    /// buckets gave every verdict it has.
    unchanged: Vec<bool>,
    /// By live rule index: the candidate rule of an unchanged policy it is.
    from_live: Vec<Option<u32>>,
}

impl CandidateBundle {
    /// `bundle` (compiled with [`crate::policy::CompileOptions::candidate`]) beside `live`.
    /// Under a `global_shadow` override (either bundle's) nothing is shared: every rule of the
    /// candidate is decided on its own buckets.
    pub fn new(bundle: Arc<Bundle>, live: Option<Arc<Bundle>>) -> CandidateBundle {
        let shared = match &live {
            Some(live) if live.global_shadow.is_none() && bundle.global_shadow.is_none() => {
                let by_name: ahash::AHashMap<(&str, &str), &Rule> = live
                    .rules
                    .iter()
                    .filter(|r| r.definition != 0)
                    .map(|r| ((r.policy_id.as_str(), r.name.as_str()), r))
                    .collect();
                bundle
                    .rules
                    .iter()
                    .map(|r| {
                        by_name
                            .get(&(r.policy_id.as_str(), r.name.as_str()))
                            .filter(|l| r.definition != 0 && l.definition == r.definition)
                            .map(|l| l.index as u32)
                    })
                    .collect()
            }
            _ => vec![None; bundle.rules.len()],
        };
        let (unchanged, from_live) = unchanged_policies(&bundle, live.as_deref(), &shared);
        CandidateBundle {
            bundle,
            live,
            shared,
            unchanged,
            from_live,
        }
    }

    /// The same candidate beside another live bundle (after a reload).
    pub fn beside(&self, live: Option<Arc<Bundle>>) -> CandidateBundle {
        CandidateBundle::new(Arc::clone(&self.bundle), live)
    }

    pub fn bundle(&self) -> &Arc<Bundle> {
        &self.bundle
    }

    /// How many of its rules read their verdict from the live decision.
    pub fn shared_rules(&self) -> usize {
        self.shared.iter().filter(|s| s.is_some()).count()
    }

    /// How many of its policies are the live ones unchanged.
    pub fn unchanged_policies(&self) -> usize {
        self.unchanged.iter().filter(|u| **u).count()
    }

    /// Whether candidate rule `index` reads its verdict from the live decision.
    pub fn is_shared(&self, index: usize) -> bool {
        self.shared.get(index).is_some_and(Option::is_some)
    }
}

/// The policies of `bundle` that are `live`'s unchanged, and the candidate rule of each live
/// rule of theirs.
fn unchanged_policies(
    bundle: &Bundle,
    live: Option<&Bundle>,
    shared: &[Option<u32>],
) -> (Vec<bool>, Vec<Option<u32>>) {
    let Some(live) = live else {
        return (vec![false; bundle.policies.len()], Vec::new());
    };
    // How many rules each policy compiled to (regular, fallback, guards, `tokens_per_day`).
    let counts = |b: &Bundle| {
        let mut counts = vec![0usize; b.policies.len()];
        for rule in &b.rules {
            if let Some(count) = counts.get_mut(rule.policy) {
                *count += 1;
            }
        }
        counts
    };
    let live_policies: ahash::AHashMap<&str, usize> = live
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| (p.id.as_str(), i))
        .collect();
    // By candidate policy: the live policy of its id.
    let twin: Vec<Option<usize>> = bundle
        .policies
        .iter()
        .map(|p| live_policies.get(p.id.as_str()).copied())
        .collect();
    let (ours, theirs) = (counts(bundle), counts(live));
    let mut unchanged: Vec<bool> = twin
        .iter()
        .zip(&ours)
        .map(|(twin, count)| twin.is_some_and(|t| theirs.get(t) == Some(count)))
        .collect();
    for rule in &bundle.rules {
        let same = shared[rule.index].is_some_and(|l| {
            Some(live.rules[l as usize].policy) == twin.get(rule.policy).copied().flatten()
        });
        if let (false, Some(u)) = (same, unchanged.get_mut(rule.policy)) {
            *u = false;
        }
    }
    let mut from_live = vec![None; live.rules.len()];
    for rule in &bundle.rules {
        if let (Some(true), Some(l)) = (unchanged.get(rule.policy), shared[rule.index]) {
            from_live[l as usize] = Some(rule.index as u32);
        }
    }
    (unchanged, from_live)
}

/// A loop detection that only warns or throttles: a slot it cannot take refuses nothing.
fn soft(rule: &Rule) -> bool {
    matches!(rule.guard(), Some(Guard::Loop(d)) if d.action != LoopAction::Reject)
}

/// What a request needs from the store under the candidate, owned (a shared store's call runs
/// apart from the request), and the refusals known before it.
#[derive(Debug, Default)]
pub struct Probe {
    pub ops: SmallVec<[BucketOp; 4]>,
    /// The candidate rule of each op.
    op_rules: SmallVec<[u32; 4]>,
    pub leases: SmallVec<[LeaseOp; 1]>,
    /// The candidate rule of each lease.
    lease_rules: SmallVec<[u32; 1]>,
    refused: Refusers,
}

/// Plans a request under the candidate, after the live bundle decided it (`live`): the
/// candidate's rules that share a live rule's definition take that rule's verdict, the others
/// are planned on the candidate's own keys.
pub fn plan_candidate(
    candidate: &CandidateBundle,
    live: &Decision<'_>,
    facts: &RequestFacts<'_>,
    unix_us: u64,
    config: EngineConfig,
) -> Probe {
    // Verdicts are read only from a decision made with the bundle the candidate was compared
    // to (a reload may have raced this request).
    let verdicts = live.checked().filter(|c| {
        candidate
            .live
            .as_deref()
            .is_some_and(|l| std::ptr::eq(l, c.bundle))
    });
    // A live decision that reached its buckets (allowed, or refused by them) holds a verdict
    // for every rule of the live bundle that applied: the candidate's unchanged policies are
    // then read from it whole, without being planned again.
    let complete = verdicts.filter(|c| match live {
        Decision::Allow(_) => !c.store_error,
        Decision::Refuse(refusal) => matches!(refusal.cause, Cause::Buckets),
        Decision::NoPolicy => false,
    });
    let mut refused = Refusers::new();
    let reused = |rule: &Rule| {
        let (Some(checked), Some(Some(live_index))) = (verdicts, candidate.shared.get(rule.index))
        else {
            return false;
        };
        let live_index = *live_index as usize;
        let mut found = false;
        let mut allowed = true;
        for outcome in checked.rules.iter().filter(|o| o.rule.index == live_index) {
            found = true;
            allowed &= outcome.allowed;
        }
        for slot in checked.slots.iter().filter(|s| s.rule.index == live_index) {
            found = true;
            allowed &= slot.allowed || soft(slot.rule);
        }
        if found && !allowed && rule.mode == Mode::Enforce {
            refused.push(Refuser::Rule(rule.index as u32));
        }
        found
    };
    let plan = plan_reusing(
        &candidate.bundle,
        facts,
        unix_us,
        config,
        Selection::Indexed,
        reused,
        |policy| complete.is_some() && candidate.unchanged.get(policy) == Some(&true),
    );
    let from_unchanged = |refused: &mut Refusers| {
        let Some(checked) = complete else {
            return;
        };
        let of = |rule: &Rule| candidate.from_live.get(rule.index).copied().flatten();
        for outcome in &checked.rules {
            if let (Some(index), Mode::Enforce, false) =
                (of(outcome.rule), outcome.rule.mode, outcome.allowed)
            {
                refused.push(Refuser::Rule(index));
            }
        }
        for slot in &checked.slots {
            if let (Some(index), Mode::Enforce, false) = (
                of(slot.rule),
                slot.rule.mode,
                slot.allowed || soft(slot.rule),
            ) {
                refused.push(Refuser::Rule(index));
            }
        }
    };
    match plan {
        Plan::Done(Decision::Refuse(refusal)) => {
            // Refused before any bucket: that cause alone, as a decision would say it.
            refused.clear();
            match refusal.cause {
                Cause::Rule(rule) => refused.push(Refuser::Rule(rule.index as u32)),
                Cause::KillSwitch(ks) => {
                    refused
                        .extend(kill_switch_index(&candidate.bundle, ks).map(Refuser::KillSwitch));
                }
                Cause::Buckets | Cause::Request => {}
            }
            Probe {
                refused,
                ..Probe::default()
            }
        }
        Plan::Done(_) => {
            from_unchanged(&mut refused);
            Probe {
                refused,
                ..Probe::default()
            }
        }
        Plan::Store(pending) => {
            from_unchanged(&mut refused);
            Probe {
                op_rules: pending
                    .checked
                    .rules
                    .iter()
                    .map(|o| o.rule.index as u32)
                    .collect(),
                lease_rules: pending
                    .checked
                    .slots
                    .iter()
                    .map(|s| s.rule.index as u32)
                    .collect(),
                ops: pending.ops,
                leases: pending.leases,
                refused,
            }
        }
    }
}

/// Where kill switch `ks` (of `bundle`, or of its `global_shadow` twin, whose list is the
/// same) is in the bundle's list.
fn kill_switch_index(bundle: &Bundle, ks: &KillSwitch) -> Option<u32> {
    let position = |b: &Bundle| b.kill_switches.iter().position(|k| std::ptr::eq(k, ks));
    position(bundle)
        .or_else(|| bundle.shadow_twin.as_deref().and_then(position))
        .map(|i| i as u32)
}

/// The refusals of a finished decision made with `bundle` (the Envoy calls a candidate
/// decides): the rule or kill switch that refused it before its buckets, or every enforced
/// rule whose bucket refused.
pub fn refusers_of(bundle: &Bundle, decision: &Decision<'_>) -> Refusers {
    let mut refused = Refusers::new();
    let Decision::Refuse(refusal) = decision else {
        return refused;
    };
    match refusal.cause {
        Cause::Rule(rule) if rule.index != usize::MAX => {
            refused.push(Refuser::Rule(rule.index as u32));
        }
        Cause::KillSwitch(ks) => {
            refused.extend(kill_switch_index(bundle, ks).map(Refuser::KillSwitch))
        }
        Cause::Buckets => {
            let checked = decision
                .checked()
                .map(|c| c.rules.as_slice())
                .unwrap_or_default();
            refused.extend(
                checked
                    .iter()
                    .filter(|o| {
                        o.rule.mode == Mode::Enforce && !o.allowed && o.rule.index != usize::MAX
                    })
                    .map(|o| Refuser::Rule(o.rule.index as u32)),
            );
        }
        Cause::Rule(_) | Cause::Request => {}
    }
    refused
}

impl Probe {
    /// The refusals found so far.
    pub fn refused(&self) -> &Refusers {
        &self.refused
    }

    /// Takes the refusals.
    pub fn into_refused(self) -> Refusers {
        self.refused
    }

    /// Judges the candidate's slots from the store's answer (`None`: the store failed, which
    /// fails open). Returns whether the buckets are still to be checked (no enforced slot
    /// refused: a request refused for a slot spends no tokens).
    pub fn admit(&mut self, bundle: &Bundle, answer: Option<&LeaseResults>) -> bool {
        let Some(results) = answer else {
            return true;
        };
        let mut go_on = true;
        for (&index, r) in self.lease_rules.iter().zip(results.iter()) {
            let Some(rule) = bundle.rules.get(index as usize) else {
                continue;
            };
            let allowed = match rule.guard() {
                // A breaker's open state is read: open while it has a lease.
                Some(Guard::Breaker(_)) => r.in_flight == 0,
                _ => r.allowed,
            };
            if !allowed && rule.mode == Mode::Enforce && !soft(rule) {
                self.refused.push(Refuser::Rule(index));
                go_on = false;
            }
        }
        go_on
    }

    /// Judges the candidate's buckets from the store's answer (`None`: the store failed, which
    /// fails open).
    pub fn finish(&mut self, bundle: &Bundle, answer: Option<&OpResults>) {
        let Some(results) = answer else {
            return;
        };
        for (&index, r) in self.op_rules.iter().zip(results.iter()) {
            let enforced = bundle
                .rules
                .get(index as usize)
                .is_some_and(|rule| rule.mode == Mode::Enforce);
            if enforced && !r.verdict.allowed {
                self.refused.push(Refuser::Rule(index));
            }
        }
    }

    /// The leases to give back once the request is judged: every concurrency slot it took
    /// (the candidate holds none across the response), and everything when it would be
    /// refused (as a refused request gives back its loop marks too).
    pub fn to_release(&self, taken: &LeaseResults) -> SmallVec<[BucketKey; 2]> {
        let refused = !self.refused.is_empty();
        self.leases
            .iter()
            .zip(taken.iter())
            .filter(|(op, r)| r.committed && (refused || op.held))
            .map(|(op, _)| op.key)
            .collect()
    }
}

/// Decides a request under the candidate on the embedded store now, after the live decision
/// `live`: the candidate's refusals.
pub fn decide_candidate_local(
    candidate: &CandidateBundle,
    live: &Decision<'_>,
    facts: &RequestFacts<'_>,
    store: &MemoryStore,
    now_us: u64,
    unix_us: u64,
    config: EngineConfig,
) -> Refusers {
    let mut probe = plan_candidate(candidate, live, facts, unix_us, config);
    let bundle = &*candidate.bundle;
    let apply = |probe: &mut Probe| {
        if !probe.ops.is_empty() {
            let mut results = OpResults::new();
            let answer = store.apply(now_us, &probe.ops, &mut results);
            probe.finish(bundle, answer.ok().map(|()| &results));
        }
    };
    if probe.leases.is_empty() {
        apply(&mut probe);
        return probe.into_refused();
    }
    let leases = store.leases();
    let id = next_lease_id();
    let mut taken = LeaseResults::new();
    leases.acquire(now_us, id, &probe.leases, &mut taken);
    if probe.admit(bundle, Some(&taken)) {
        apply(&mut probe);
    }
    leases.release(id, &probe.to_release(&taken));
    probe.into_refused()
}

#[cfg(test)]
mod tests;
