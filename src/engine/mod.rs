//! The decision engine, pure: a bundle, the request's facts and the wall-clock time give a
//! [`Plan`]; the plan and the store's answer give a [`Decision`]. No store, no clock, no I/O
//! inside: the caller owns the store call (synchronous for the embedded store, awaited for a
//! shared one).
//!
//! What every rule shares lives here: kill switches, selecting policies and rules (scanned or
//! through the bundle's index), bucket keys, `on_missing`, repeated headers, and finishing
//! (all-or-nothing per commit group, shadow beside enforce, failing open). What a rule's kind
//! adds is planned by its module under [`crate::limits`], through `limits::plan` (a
//! policy's guards through `limits::guards::plan`, before its rules).
//!
//! The calls go down only: this file calls the kinds, and the kinds read only what sits below
//! both, the planning vocabulary (`planning.rs`: the bucket key writer, the plan being built) and
//! the outcome and refusal types (`decision.rs`); none of them calls back into this file.
//!
//! A [`Decision`] (`decision.rs`) borrows the bundle it was made with and carries everything
//! headers, metrics and logs need (rule and policy names, quotas, the kill switch that fired);
//! with the request's view beside it ([`Decided`]) none of them calls back into the engine.

pub mod compat;
pub mod grpc_status;
pub mod headers;
pub mod pacing;
pub mod reservation_token;
pub mod rls;
pub mod simulate;

pub mod candidate;
pub mod charges;
pub(crate) mod decision;
pub(crate) mod planning;
pub use decision::*;

use crate::limits::budget_window::Action;
use crate::limits::limiter::{Quota, US_PER_SEC};
pub use crate::limits::llm::llm_reservation;
use crate::limits::token_bucket::planned_bucket;
pub use crate::limits::token_bucket::{cost_of, Cost};
use crate::policy::index::VERIFIED;
use crate::policy::{
    Bundle, CostSource, Guard, LoopAction, Mode, OnMissing, Policy, Rule, RuleKind,
};
use crate::request::descriptor::{Descriptor, RequestFacts};
use crate::store::lease::{next_lease_id, LeaseOp, LeaseResults};
use crate::store::{BucketKey, BucketOp, MemoryStore, OpResults, StoreError};
use planning::{write_bucket, PlanContext, Planning, KEY_BUFFER};
use smallvec::SmallVec;
use std::ops::ControlFlow;

/// `Retry-After` base for a kill switch without `expires_at`: it lasts until an operator lifts
/// it, so clients are told to come back in a minute rather than hammer.
pub const KILL_SWITCH_RETRY_SECS: u64 = 60;

/// Engine settings that are not part of the policy bundle.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Prefix length IPv6 clients are reduced to for `ip:address` (default 64).
    pub ipv6_prefix: u8,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { ipv6_prefix: 64 }
    }
}

/// A decision before the store has answered.
// Lives for a few microseconds on the stack; boxing the larger variant would put an allocation
// on the embedded store's hot path.
#[allow(clippy::large_enum_variant)]
pub enum Plan<'b> {
    /// Decided without the store (no policy, kill switch, missing descriptor, no rule).
    Done(Decision<'b>),
    /// Needs these bucket operations; give the store's answer to [`finish`].
    Store(Pending<'b>),
}

/// The bucket operations of a request, and the rule outcomes they will fill in.
pub struct Pending<'b> {
    pub ops: SmallVec<[BucketOp; 4]>,
    /// Concurrency slots to take first (see [`Pending::admit`]), one per slot outcome.
    pub leases: SmallVec<[LeaseOp; 1]>,
    checked: Box<Checked<'b>>,
}

impl<'b> Pending<'b> {
    /// One enforced bucket for `rule` (Envoy's descriptor override when no rule applies).
    pub fn single(bundle: &'b Bundle, rule: &'b Rule, key: BucketKey, quota: Quota) -> Self {
        let mut checked = Checked::new(bundle);
        let cost = match rule.cost {
            CostSource::Fixed(cost) if cost <= quota.burst() => Cost::Fits(cost),
            _ => Cost::Exceeds,
        };
        let (op, outcome) = planned_bucket(rule, key, quota, cost, None);
        checked.rules.push(outcome);
        let mut ops = SmallVec::new();
        ops.push(op);
        Pending {
            ops,
            leases: SmallVec::new(),
            checked,
        }
    }

    /// Fills in the concurrency slots from the store's answer, before any bucket is touched: a
    /// request refused for concurrency spends no tokens. A store failure fails open (no slot is
    /// held, the slots are not reported).
    ///
    /// # Errors
    /// The refusal, when an enforced slot is taken.
    // The refusal is returned once per refused request; boxing it would allocate on a path
    // that is meant to be cheapest under attack.
    #[allow(clippy::result_large_err)]
    pub fn admit(
        mut self,
        lease_id: u64,
        answer: Result<&LeaseResults, StoreError>,
    ) -> Result<Self, Decision<'b>> {
        self.checked.lease_id = lease_id;
        let results = match answer {
            Ok(results) => results,
            Err(_) => {
                self.checked.slots.clear();
                self.checked.store_error = true;
                return Ok(self);
            }
        };
        let mut refused: Option<(&'b Rule, Reason, u64)> = None;
        let mut loop_stage = None;
        for (slot, r) in self.checked.slots.iter_mut().zip(results.iter()) {
            slot.away = r.away;
            if r.away == Some(crate::policy::OnStoreError::Closed)
                && slot.rule.mode == Mode::Enforce
            {
                slot.allowed = false;
                refused.get_or_insert((
                    slot.rule,
                    Reason::StoreUnavailable,
                    crate::store::local::CLOSED_RETRY_SECS,
                ));
                continue;
            }
            // A breaker's open state and a penalty block are read, never taken: in force while
            // they have a lease.
            slot.allowed = match slot.rule.guard() {
                Some(Guard::Breaker(_)) => r.in_flight == 0,
                None if slot.is_penalty() => r.in_flight == 0,
                _ => r.allowed,
            };
            slot.committed = r.committed;
            slot.in_flight = r.in_flight;
            slot.frees_in_us = r.frees_in_us;
            if slot.allowed || slot.rule.mode == Mode::Shadow {
                continue;
            }
            let retry_after = match slot.rule.guard() {
                Some(Guard::Loop(detection)) => match detection.action {
                    LoopAction::Reject => crate::limits::limiter::ceil_secs(r.frees_in_us).max(1),
                    LoopAction::Warn => {
                        loop_stage = stronger(loop_stage, Some(Action::Warn));
                        continue;
                    }
                    LoopAction::Throttle => {
                        let delay_ms = detection.throttle_ms();
                        loop_stage = stronger(loop_stage, Some(Action::Throttle { delay_ms }));
                        continue;
                    }
                },
                // An open breaker without automatic reset lasts until the bundle changes:
                // clients are told to come back in a minute, as for a kill switch.
                Some(Guard::Breaker(breaker)) if breaker.reset_us.is_none() => {
                    KILL_SWITCH_RETRY_SECS
                }
                Some(Guard::Breaker(_)) => crate::limits::limiter::ceil_secs(r.frees_in_us).max(1),
                None if slot.is_penalty() => {
                    crate::limits::limiter::ceil_secs(r.frees_in_us).max(1)
                }
                None => 1,
            };
            refused.get_or_insert((slot.rule, slot.reason(), retry_after));
        }
        self.checked.loop_stage = loop_stage;
        let Some((rule, reason, retry_after)) = refused else {
            return Ok(self);
        };
        // Nothing is spent: the bucket outcomes are dropped rather than shown unchecked.
        self.checked.rules.clear();
        Err(Decision::Refuse(Refusal {
            reason,
            retry_after,
            retry_by_deadline: false,
            // Names the full rule in logs and the access log.
            cause: Cause::Rule(rule),
            checked: Some(self.checked),
        }))
    }

    /// Envoy's `hits_addend`: every bucket of the request costs `hits` times its rule's cost.
    /// A cost the quota can never hold is refused as `cost_exceeds_limit`, as a stated cost
    /// would be.
    pub fn scale_costs(&mut self, hits: u64) {
        for (op, outcome) in self.ops.iter_mut().zip(self.checked.rules.iter_mut()) {
            let cost = if outcome.cost_exceeds {
                u64::MAX
            } else {
                op.cost.saturating_mul(hits)
            };
            outcome.cost_exceeds = cost > op.quota.burst();
            op.cost = if outcome.cost_exceeds {
                op.quota.burst().saturating_add(1)
            } else {
                cost
            };
        }
    }

    /// Counts op `index` under `quota` (a bucket several Envoy descriptors reach with
    /// different quotas is checked under the strictest of them).
    pub fn set_quota(&mut self, index: usize, quota: Quota) {
        if let (Some(op), Some(outcome)) =
            (self.ops.get_mut(index), self.checked.rules.get_mut(index))
        {
            op.quota = quota;
            outcome.quota = quota;
            if op.cost > quota.burst() {
                outcome.cost_exceeds = true;
                op.cost = quota.burst().saturating_add(1);
            }
        }
    }
}

/// One decision for several planned requests that were checked together (the descriptors of
/// an Envoy `ShouldRateLimit` call): every rule outcome once (a bucket two of them share
/// appears once), refused when any of them was, for the longest wait.
pub fn merge<'b>(bundle: &'b Bundle, decisions: &[Decision<'b>]) -> Decision<'b> {
    let mut checked = Checked::new(bundle);
    let mut refusal: Option<&Refusal<'b>> = None;
    for decision in decisions {
        if let Some(c) = decision.checked() {
            for outcome in &c.rules {
                if !checked.rules.iter().any(|o| o.key == outcome.key) {
                    checked.rules.push(outcome.clone());
                }
            }
            checked.store_error |= c.store_error;
            checked.stage = stronger(checked.stage, c.stage);
            if checked.shadow_missing.is_none() {
                checked.shadow_missing = c.shadow_missing;
            }
        }
        if let Decision::Refuse(r) = decision {
            let longer = refusal.is_none_or(|best| r.retry_after > best.retry_after);
            if longer {
                refusal = Some(r);
            }
        }
    }
    match refusal {
        None => Decision::Allow(checked),
        Some(r) => Decision::Refuse(Refusal {
            reason: r.reason,
            retry_after: r.retry_after,
            retry_by_deadline: r.retry_by_deadline,
            cause: r.cause,
            checked: Some(checked),
        }),
    }
}

/// Everything up to the store call: kill switches and budget windows (at wall-clock `unix_us`), matching policies
/// and rules, bucket keys and costs.
pub fn plan<'b>(
    bundle: &'b Bundle,
    facts: &RequestFacts<'_>,
    unix_us: u64,
    config: EngineConfig,
) -> Plan<'b> {
    plan_with(bundle, facts, unix_us, config, Selection::Indexed)
}

/// How [`plan_with`] finds the policies, rules and kill switches that apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// Through the bundle's index where a list is longer than [`SCAN_UP_TO`] entries, trying
    /// each in turn where it is not (what the gateway does).
    Indexed,
    /// Through the index whatever the size (what the index is tested with).
    IndexedAlways,
    /// Every entry tried in turn: the reference the index is tested against.
    Scan,
}

/// Lists this short (a bundle's policies or kill switches, a policy's rules) are tried in turn:
/// that costs no more than an index lookup and keeps small bundles on the plainest path.
pub const SCAN_UP_TO: usize = 8;

impl Selection {
    fn indexes(self, entries: usize) -> bool {
        match self {
            Selection::Indexed => entries > SCAN_UP_TO,
            Selection::IndexedAlways => true,
            Selection::Scan => false,
        }
    }
}

/// [`plan`], choosing how candidates are found: both ways give the same plan (the index only
/// narrows what the same predicates are tried on, in the same order).
pub fn plan_with<'b>(
    bundle: &'b Bundle,
    facts: &RequestFacts<'_>,
    unix_us: u64,
    config: EngineConfig,
    selection: Selection,
) -> Plan<'b> {
    plan_reusing(
        bundle,
        facts,
        unix_us,
        config,
        selection,
        |_| false,
        |_| false,
    )
}

/// [`plan_with`], asking `reused` about every rule that applies before building its key: a
/// rule it answers `true` for is left out of the plan (a candidate bundle's rule whose verdict
/// the live decision already gave, see [`candidate`]); and leaving out every policy (by index)
/// `skipped` answers `true` for (a candidate's policy whose every verdict the live decision
/// gave). Monomorphised, so the live path's `|_| false` costs nothing.
pub(crate) fn plan_reusing<'b>(
    bundle: &'b Bundle,
    facts: &RequestFacts<'_>,
    unix_us: u64,
    config: EngineConfig,
    selection: Selection,
    mut reused: impl FnMut(&'b Rule) -> bool,
    skipped: impl Fn(usize) -> bool,
) -> Plan<'b> {
    let prefix = config.ipv6_prefix;
    let unix_secs = (unix_us / US_PER_SEC).min(i64::MAX as u64) as i64;
    let bundle = bundle.in_force(unix_secs);
    if let Some(refusal) = kill_switch_refusal(bundle, facts, unix_secs, prefix, selection) {
        return Plan::Done(Decision::Refuse(refusal));
    }
    // Applicable rules become outcomes right away; the store fills in the verdicts.
    let mut walk = Walk::new(PlanContext {
        bundle,
        unix_us,
        ipv6_prefix: prefix,
    });
    let mut selected = crate::policy::index::Candidates::new();
    if selection.indexes(bundle.policies.len()) {
        bundle.index.policies(facts, &mut selected);
    } else {
        selected.extend(0..bundle.policies.len() as u32);
    }
    let mut rule_candidates = crate::policy::index::Candidates::new();
    for &policy_index in &selected {
        let policy_index = policy_index as usize;
        if skipped(policy_index) {
            continue;
        }
        let policy = &bundle.policies[policy_index];
        if !policy.selector.matches(facts) {
            continue;
        }
        // A policy's guards come first; Envoy descriptors have no request to fingerprint or
        // spend to measure, so they only apply to HTTP requests.
        if facts.envoy.is_none()
            && !facts.grpc_message
            && walk.guards(policy, facts, &mut reused).is_break()
        {
            break;
        }
        let rules = (policy_index, selection, &mut rule_candidates);
        if walk.rules(policy, rules, facts, &mut reused).is_break() {
            break;
        }
    }
    walk.into_plan()
}

/// The kill switch that stops this request, as a refusal: one on a header the request repeats
/// (a switch on a header must see the same value the upstream will), or one whose scope value
/// the request has. Only switches in force on this route count (an expired one must not turn
/// repeats into 400s), and none while a runtime override lifts them all.
#[inline]
fn kill_switch_refusal<'b>(
    bundle: &'b Bundle,
    facts: &RequestFacts<'_>,
    unix_secs: i64,
    prefix: u8,
    selection: Selection,
) -> Option<Refusal<'b>> {
    if bundle.kill_switches.is_empty() || bundle.kill_switch_override_active(unix_secs) {
        return None;
    }
    let mut candidates = crate::policy::index::Candidates::new();
    let indexed = selection.indexes(bundle.kill_switches.len());
    let repeated = if indexed {
        bundle
            .index
            .kill_switches_on_repeated_headers(facts, &mut candidates);
        candidates
            .iter()
            .map(|&i| &bundle.kill_switches[i as usize])
            .find(|ks| ks.in_force(facts, unix_secs))
    } else {
        bundle.kill_switches.iter().find(|ks| {
            matches!(&*ks.scope, Descriptor::Header(h) if facts.headers.repeats_any() && facts.headers.is_repeated(h))
                && ks.in_force(facts, unix_secs)
        })
    };
    if let Some(ks) = repeated {
        return Some(Refusal {
            reason: Reason::DuplicateHeader,
            retry_after: 0,
            retry_by_deadline: false,
            cause: Cause::KillSwitch(ks),
            checked: None,
        });
    }
    let hit = if indexed {
        bundle.index.kill_switches(facts, prefix, &mut candidates);
        candidates
            .iter()
            .map(|&i| &bundle.kill_switches[i as usize])
            .find(|ks| ks.hits(facts, unix_secs, prefix))
    } else {
        bundle
            .kill_switches
            .iter()
            .find(|ks| ks.hits(facts, unix_secs, prefix))
    }?;
    let wait = hit
        .expires_at
        .map_or(KILL_SWITCH_RETRY_SECS, |at| (at - unix_secs).max(1) as u64);
    Some(Refusal {
        reason: Reason::KillSwitch,
        retry_after: wait,
        retry_by_deadline: false,
        cause: Cause::KillSwitch(hit),
        checked: None,
    })
}

/// One request's walk through the policies that select it: the plan being built, and what
/// refuses it before the store (a rule reading a header the request repeats, a rule with
/// `on_missing: reject` whose descriptor is missing).
struct Walk<'b> {
    context: PlanContext<'b>,
    planning: Planning<'b>,
    /// Rules with `on_missing: reject` whose descriptor is missing, enforced and shadow.
    missing_enforce: Option<&'b Rule>,
    missing_shadow: Option<&'b Rule>,
    /// A rule reading a header the request repeats: it ends the walk.
    repeated: Option<&'b Rule>,
}

impl<'b> Walk<'b> {
    #[inline]
    fn new(context: PlanContext<'b>) -> Self {
        Walk {
            context,
            planning: Planning::new(context.bundle),
            missing_enforce: None,
            missing_shadow: None,
            repeated: None,
        }
    }

    /// Stops the walk at a rule reading a header the request repeats.
    #[inline]
    fn stops_at(&mut self, rule: &'b Rule, facts: &RequestFacts<'_>) -> ControlFlow<()> {
        if repeats_header(rule, facts) {
            self.repeated = Some(rule);
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    /// Plans a policy's `loop_detection` and `circuit_breaker` rules.
    #[inline]
    fn guards(
        &mut self,
        policy: &Policy,
        facts: &RequestFacts<'_>,
        reused: &mut impl FnMut(&'b Rule) -> bool,
    ) -> ControlFlow<()> {
        let bundle = self.context.bundle;
        for rule in [policy.loop_detection, policy.circuit_breaker]
            .into_iter()
            .flatten()
            .map(|i| &bundle.rules[i])
        {
            self.stops_at(rule, facts)?;
            if reused(rule) {
                continue;
            }
            crate::limits::guards::plan(rule, facts, self.context, &mut self.planning);
        }
        ControlFlow::Continue(())
    }

    /// Plans a policy's rules whose `match` the request satisfies (candidates from the index
    /// when the policy is long enough, else every rule), then its `fallback_limit` when no
    /// conditional rule matched.
    #[inline]
    fn rules(
        &mut self,
        policy: &Policy,
        (policy_index, selection, candidates): (
            usize,
            Selection,
            &mut crate::policy::index::Candidates,
        ),
        facts: &RequestFacts<'_>,
        reused: &mut impl FnMut(&'b Rule) -> bool,
    ) -> ControlFlow<()> {
        let bundle = self.context.bundle;
        let prefix = self.context.ipv6_prefix;
        let scanned = !selection.indexes(policy.rules.len())
            || bundle
                .index
                .rules(&bundle.rules, policy_index, facts, prefix, candidates)
                .is_none();
        if scanned {
            candidates.clear();
            candidates.extend(policy.rules.clone().map(|i| i as u32));
        }
        let mut matched_conditional = false;
        for &candidate in candidates.iter() {
            let rule = &bundle.rules[(candidate & !VERIFIED) as usize];
            self.stops_at(rule, facts)?;
            if !rule.conditions.is_empty() {
                if !conditions_hold(rule, candidate, facts, prefix) {
                    continue;
                }
                matched_conditional = true;
            }
            self.consider(rule, facts, reused);
        }
        if let Some(fallback) = policy.fallback {
            let rule = &bundle.rules[fallback];
            self.stops_at(rule, facts)?;
            if !matched_conditional && rule.conditions.iter().all(|c| c.matches(facts, prefix)) {
                self.consider(rule, facts, reused);
            }
        }
        ControlFlow::Continue(())
    }

    /// Plans an applicable rule by its kind, unless its verdict is `reused`; a rule whose
    /// descriptor is missing is skipped, or noted when it rejects such requests.
    #[inline]
    fn consider(
        &mut self,
        rule: &'b Rule,
        facts: &RequestFacts<'_>,
        reused: &mut impl FnMut(&'b Rule) -> bool,
    ) {
        // A gRPC request message is counted by the rules that count messages, and only by
        // them (the call itself was counted by the others when it began).
        if facts.grpc_message && !rule.counts_grpc_messages() {
            return;
        }
        if reused(rule) {
            return;
        }
        let prefix = self.context.ipv6_prefix;
        // The key is built in a per-thread buffer: hashed, matched against overrides, and
        // never stored.
        let found =
            KEY_BUFFER.with(|buffer| {
                let mut bucket = buffer.borrow_mut();
                write_bucket(rule, facts, prefix, &mut bucket).then(|| {
                    let key = &bucket[rule.key_prefix.len()..];
                    // An override set at runtime beats the bundle's own quotas for its key.
                    let quota = match self.context.bundle.key_quotas.get(
                        rule.index,
                        key,
                        self.context.unix_us,
                    ) {
                        Some(quota) => quota,
                        None => rule.quota_for_request(key, facts),
                    };
                    (BucketKey::of(&bucket), quota)
                })
            });
        match found {
            Some(bucket) => {
                crate::limits::plan((rule, bucket), facts, self.context, &mut self.planning);
            }
            None if rule.on_missing == OnMissing::Reject => {
                let slot = match rule.mode {
                    Mode::Enforce => &mut self.missing_enforce,
                    Mode::Shadow => &mut self.missing_shadow,
                };
                slot.get_or_insert(rule);
            }
            None => {}
        }
    }

    /// The plan: refused before the store (a repeated header, a missing descriptor an
    /// enforced rule rejects, an LLM request too large), decided (nothing to count), or the
    /// store operations to run.
    #[inline]
    fn into_plan(self) -> Plan<'b> {
        let Planning {
            mut checked,
            ops,
            leases,
            refused: llm_refused,
        } = self.planning;
        checked.shadow_missing = self.missing_shadow;
        let refused = self
            .repeated
            .map(|rule| (Reason::DuplicateHeader, rule))
            .or(self
                .missing_enforce
                .map(|rule| (Reason::MissingDescriptor, rule)))
            .or(llm_refused.map(|(rule, reason)| (reason, rule)));
        if let Some((reason, rule)) = refused {
            return Plan::Done(Decision::Refuse(Refusal {
                reason,
                retry_after: 0,
                retry_by_deadline: false,
                cause: Cause::Rule(rule),
                checked: None,
            }));
        }
        if ops.is_empty() && leases.is_empty() {
            return Plan::Done(Decision::Allow(checked));
        }
        Plan::Store(Pending {
            ops,
            leases,
            checked,
        })
    }
}

/// Whether a conditional rule's `match` holds for the request (the condition the index
/// compared for a `VERIFIED` candidate is not asked again).
#[inline]
fn conditions_hold(rule: &Rule, candidate: u32, facts: &RequestFacts<'_>, prefix: u8) -> bool {
    let compared = (candidate & VERIFIED != 0)
        .then(|| crate::policy::index::indexed_condition(rule).map(|(k, _)| k))
        .flatten();
    rule.conditions
        .iter()
        .enumerate()
        .all(|(k, c)| Some(k) == compared || c.matches(facts, prefix))
}

/// Completes a planned decision with the store's answer (one result per op, in order). Ops a
/// shared store's local mode decided carry their rule's `on_store_error` ([`OpResult::away`]:
/// an enforced `closed` one refuses with 503 `store_unavailable`); a store error that no local
/// mode answered fails open: the request is allowed, nothing was spent anywhere.
///
/// [`OpResult::away`]: crate::store::OpResult::away
pub fn finish<'b>(pending: Pending<'b>, answer: Result<&OpResults, StoreError>) -> Decision<'b> {
    let mut checked = pending.checked;
    let results = match answer {
        Ok(results) => results,
        Err(_) => {
            checked.rules.clear();
            checked.store_error = true;
            return Decision::Allow(checked);
        }
    };
    let filled = fill_outcomes(&mut checked, results);
    if let Some(rule) = filled.store_closed {
        return Decision::Refuse(Refusal {
            reason: Reason::StoreUnavailable,
            retry_after: crate::store::local::CLOSED_RETRY_SECS,
            retry_by_deadline: false,
            cause: Cause::Rule(rule),
            checked: Some(checked),
        });
    }
    if filled.never_admissible {
        return Decision::Refuse(Refusal {
            reason: Reason::CostExceedsLimit,
            retry_after: 0,
            retry_by_deadline: false,
            cause: Cause::Buckets,
            checked: Some(checked),
        });
    }
    if filled.rejected {
        return Decision::Refuse(refused_by_buckets(checked));
    }
    for outcome in &checked.rules {
        if let (Some(budget), Mode::Enforce, true) =
            (outcome.rule.budget(), outcome.rule.mode, outcome.committed)
        {
            let stage = budget.stage_for(outcome.quota.burst(), outcome.tokens);
            checked.stage = stronger(checked.stage, stage);
        }
    }
    Decision::Allow(checked)
}

/// [`finish`] for a front end that can hold a request until its turn (the proxy, the decision
/// service, ext_authz): under a bundle with `delay` rules, an admitted request carries its wait
/// ([`pacing`]). Envoy's rate-limit service has no answer that waits and finishes without it:
/// there a `delay` rule admits what its bucket holds at once, as nginx's `nodelay` does.
#[inline]
pub fn finish_paced<'b>(
    pending: Pending<'b>,
    answer: Result<&OpResults, StoreError>,
) -> Decision<'b> {
    match answer {
        Ok(results) if pending.checked.bundle.paces => {
            let ops = pending.ops.clone();
            match finish(pending, Ok(results)) {
                Decision::Allow(checked) => pacing::paced(checked, &ops, results),
                refused => refused,
            }
        }
        answer => finish(pending, answer),
    }
}

/// What the store's answer said of a request's enforced rules.
struct Filled<'b> {
    /// An enforced rule refused.
    rejected: bool,
    /// An enforced rule refused a cost it can never hold.
    never_admissible: bool,
    /// The first enforced rule whose `on_store_error: closed` refuses while the store is away.
    store_closed: Option<&'b Rule>,
}

/// Fills each rule outcome in from its op's result: verdict, tokens left, when to retry and
/// when the bucket is full again.
#[inline]
fn fill_outcomes<'b>(checked: &mut Checked<'b>, results: &OpResults) -> Filled<'b> {
    let mut filled = Filled {
        rejected: false,
        never_admissible: false,
        store_closed: None,
    };
    for (outcome, r) in checked.rules.iter_mut().zip(results.iter()) {
        let v = r.verdict;
        outcome.away = r.away;
        // Decided without the store: counted as a store error, as a failed call always was.
        checked.store_error |= r.away.is_some();
        if r.away == Some(crate::policy::OnStoreError::Closed) && outcome.rule.mode == Mode::Enforce
        {
            filled.store_closed.get_or_insert(outcome.rule);
        }
        if outcome.rule.mode == Mode::Enforce && !v.allowed {
            filled.rejected = true;
            filled.never_admissible |= outcome.cost_exceeds;
        }
        outcome.allowed = v.allowed;
        outcome.committed = r.committed;
        outcome.fail_open = r.fail_open;
        // A cost that can never fit has no time to wait for.
        outcome.retry_after = if outcome.cost_exceeds {
            0
        } else if outcome.budget_ends_in_us > 0 && !v.allowed {
            // Never past the window's end: whole seconds rounded down (at least 1).
            (outcome.budget_ends_in_us / US_PER_SEC).max(1)
        } else {
            v.retry_after_secs
        };
        outcome.tokens = if r.committed {
            v.remaining
        } else {
            v.available
        };
        outcome.reset = match outcome.budget_ends_in_us {
            ends if ends > 0 && outcome.tokens < outcome.quota.burst() => ends / US_PER_SEC,
            ends if ends > 0 => 0,
            _ if r.committed => v.reset_secs(),
            // Nothing spent: report the bucket as it stands.
            _ => crate::limits::limiter::ceil_secs(
                outcome
                    .quota
                    .time_to_gain_us(outcome.quota.burst().saturating_sub(v.available)),
            ),
        };
    }
    filled
}

/// The refusal of a request an enforced bucket refused: a tripped breaker's (it alone refused)
/// for as long as it stays open, else the longest wait's, a budget's (its window's end) or a
/// bucket's, with that rule's reason.
#[inline]
fn refused_by_buckets(checked: Box<Checked<'_>>) -> Refusal<'_> {
    let tripped = checked
        .rules
        .iter()
        .find_map(|r| match r.rule.kind {
            RuleKind::Guard(Guard::Breaker(breaker))
                if r.rule.mode == Mode::Enforce && !r.allowed =>
            {
                Some((r.rule, breaker))
            }
            _ => None,
        })
        .filter(|_| !checked.refused_beside_breakers());
    if let Some((rule, breaker)) = tripped {
        return Refusal {
            reason: Reason::CircuitBreakerOpen,
            retry_after: breaker
                .reset_us
                .map_or(KILL_SWITCH_RETRY_SECS, |us| us / US_PER_SEC),
            retry_by_deadline: false,
            cause: Cause::Rule(rule),
            checked: Some(checked),
        };
    }
    // (A breaker refusing beside another rule has not tripped: it does not speak.)
    let longest = checked
        .rules
        .iter()
        .filter(|r| {
            r.rule.mode == Mode::Enforce && !r.allowed && !matches!(r.rule.kind, RuleKind::Guard(_))
        })
        .max_by_key(|r| (r.retry_after, r.budget_ends_in_us > 0));
    let (retry_after, budget, llm) = longest.map_or((1, false, None), |r| {
        (r.retry_after, r.budget_ends_in_us > 0, r.rule.llm())
    });
    let spend = longest.is_some_and(|r| r.rule.spend().is_some());
    Refusal {
        reason: match (llm, budget) {
            _ if spend => Reason::SpendExceeded,
            (Some(l), _) if matches!(l.part, crate::policy::LlmPart::Minute) => Reason::TpmExceeded,
            (Some(_), _) => Reason::TpdExceeded,
            (None, true) => Reason::BudgetExceeded,
            (None, false) => Reason::TokenBucketExceeded,
        },
        retry_after,
        retry_by_deadline: budget,
        cause: Cause::Buckets,
        checked: Some(checked),
    }
}

/// The stronger of two budget stages: a throttle over a warning, the longer throttle of two.
fn stronger(a: Option<Action>, b: Option<Action>) -> Option<Action> {
    let rank = |s: &Option<Action>| match s {
        None | Some(Action::Reject) => 0,
        Some(Action::Warn) => 1,
        Some(Action::Throttle { delay_ms }) => 2 + *delay_ms,
    };
    if rank(&b) > rank(&a) {
        b
    } else {
        a
    }
}

/// Decides against an embedded store now, synchronously: leases first (concurrency slots,
/// loop marks, breaker states), then buckets; a tripped breaker is opened; a refused request's
/// leases are given back. The slots an allowed request holds are under its
/// [`Checked::lease_id`].
pub fn decide_local<'b>(
    bundle: &'b Bundle,
    facts: &RequestFacts<'_>,
    store: &MemoryStore,
    now_us: u64,
    unix_us: u64,
    config: EngineConfig,
) -> Decision<'b> {
    let pending = match plan(bundle, facts, unix_us, config) {
        Plan::Done(decision) => return decision,
        Plan::Store(pending) => pending,
    };
    if !pending.leases.is_empty() {
        return decide_with_leases(pending, store, now_us);
    }
    let mut results = OpResults::new();
    let answer = store.apply(now_us, &pending.ops, &mut results);
    finish_paced(pending, answer.map(|()| &results))
}

/// [`decide_local`] for a request with leases to take (kept out of line: most requests have
/// none, and the plain path stays as small as it was).
#[inline(never)]
fn decide_with_leases<'b>(pending: Pending<'b>, store: &MemoryStore, now_us: u64) -> Decision<'b> {
    let leases = store.leases();
    let mut taken = LeaseResults::new();
    let id = next_lease_id();
    leases.acquire(now_us, id, &pending.leases, &mut taken);
    let decision = match pending.admit(id, Ok(&taken)) {
        Err(refused) => refused,
        Ok(pending) => {
            let mut results = OpResults::new();
            let answer = store.apply(now_us, &pending.ops, &mut results);
            finish_paced(pending, answer.map(|()| &results))
        }
    };
    // A breaker always reads its open state, so trips only come from this path.
    for (trip, _) in decision.breaker_trips() {
        leases.acquire(now_us, next_lease_id(), &[trip], &mut taken);
    }
    if let (false, Some(checked)) = (decision.is_allowed(), decision.checked()) {
        leases.release(checked.lease_id, &checked.taken_leases());
    }
    decision
}

/// The readable bucket name (`tb:<rule>:<key>`) of `rule` for this request, and where the
/// composite key starts in it; `None` when the rule has no bucket for this request (a
/// descriptor is missing and the rule does not share one).
pub fn bucket_name(
    rule: &Rule,
    facts: &RequestFacts<'_>,
    config: EngineConfig,
) -> Option<(String, usize)> {
    let mut bucket = String::new();
    write_bucket(rule, facts, config.ipv6_prefix, &mut bucket)
        .then_some((bucket, rule.key_prefix.len()))
}

/// Whether a rule reads a header that the request sent on more than one line.
fn repeats_header(rule: &Rule, facts: &RequestFacts<'_>) -> bool {
    !rule.header_names.is_empty()
        && facts.headers.repeats_any()
        && rule
            .header_names
            .iter()
            .any(|name| facts.headers.is_repeated(name))
}

#[cfg(test)]
pub(crate) mod tests;
