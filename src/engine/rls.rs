//! Envoy's rate-limit service semantics (`envoy.service.ratelimit.v3.RateLimitService`) on the
//! pure engine, without gRPC types: a [`RlsRequest`] (domain, descriptors, `hits_addend`)
//! becomes one plan per descriptor, every bucket of every descriptor goes to the store in one
//! call (all-or-nothing, a bucket two descriptors share counted once with both costs), and the
//! answer becomes one [`DescriptorStatus`] per descriptor, in order, plus one merged
//! [`Decision`] for the headers, metrics and log line.
//!
//! A descriptor whose `hits_addend` is 0 (or negative, which tollgate does not refund) is a
//! check: it spends nothing and is over the limit when one hit would not fit. Such a request is
//! peeked first (every bucket at cost 0) and spent only when every check passes.

use crate::engine::{self, Decision, EngineConfig, Pending, Plan};
use crate::limits::limiter::{BucketState, Quota, MICRO, US_PER_SEC};
use crate::policy::{Bundle, Mode};
use crate::request::descriptor::{EnvoyDescriptor, RequestFacts};
use crate::store::{BucketKey, BucketOp, Group, OpResult, OpResults, StoreError};
use smallvec::SmallVec;

/// Most descriptors one call may carry (Envoy sends a handful; each costs store work, and the
/// shared-bucket merge is quadratic).
pub const MAX_DESCRIPTORS: usize = 64;

/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 32;

/// Longest domain, entry key and entry value a call may carry (bytes): they become bucket keys,
/// and the domain is logged.
pub const MAX_DOMAIN: usize = 255;
pub const MAX_KEY: usize = 256;
pub const MAX_VALUE: usize = 4096;

/// Largest `requests_per_unit` an override may ask for (tollgate's amounts stay ≤ 1e9 tokens).
pub const MAX_OVERRIDE_REQUESTS: u32 = 1_000_000_000;

/// Envoy's `RateLimitResponse.RateLimit.Unit` (and `RateLimitUnit` of overrides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    /// 30 days, as envoyproxy/ratelimit counts it.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Smallest first.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    pub fn secs(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// The spelling of envoyproxy/ratelimit's YAML (`second`, `minute`...).
    pub fn parse(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.as_str().eq_ignore_ascii_case(name))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

/// A descriptor's own limit (`RateLimitDescriptor.limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u32,
    /// `None`: a unit the request named that tollgate does not know (refused).
    pub unit: Option<Unit>,
}

/// One `RateLimitDescriptor`.
#[derive(Debug, Clone, Default)]
pub struct RlsDescriptor {
    pub entries: Vec<(String, String)>,
    pub limit: Option<LimitOverride>,
    /// The descriptor's own `hits_addend`, when set (0 = check without spending).
    pub hits_addend: Option<u64>,
    /// `is_negative_hits`: a refund tollgate does not make; the descriptor is only checked.
    pub negative_hits: bool,
}

/// One `ShouldRateLimit` call.
#[derive(Debug, Clone, Default)]
pub struct RlsRequest {
    pub domain: String,
    pub descriptors: Vec<RlsDescriptor>,
    /// The request's `hits_addend` (0 means 1).
    pub hits_addend: u32,
}

/// A request Envoy should not have sent (gRPC `INVALID_ARGUMENT`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RlsError {
    #[error("domain must not be empty")]
    EmptyDomain,
    #[error("descriptors must not be empty")]
    NoDescriptors,
    #[error("{0} descriptors: at most 64 per call")]
    TooManyDescriptors(usize),
    #[error("descriptors[{0}]: {1} entries: at most 32 per descriptor")]
    TooManyEntries(usize, usize),
    #[error("domain: at most 255 bytes and no control characters")]
    BadDomain,
    #[error("descriptors[{0}].entries[{1}]: keys are at most 256 bytes and values at most 4096")]
    EntryTooLong(usize, usize),
    #[error("descriptors[{0}].limit: requests_per_unit must be between 1 and 1000000000")]
    OverrideAmount(usize),
    #[error("descriptors[{0}].limit: unknown unit")]
    OverrideUnit(usize),
}

/// `current_limit` of a descriptor status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentLimit {
    /// The rule's name.
    pub name: String,
    pub requests_per_unit: u32,
    pub unit: Unit,
}

/// One `DescriptorStatus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorStatus {
    pub over_limit: bool,
    /// The most restrictive enforced rule applied to the descriptor; `None` when none did.
    pub current_limit: Option<CurrentLimit>,
    /// Whole requests (tokens) left in that rule's bucket.
    pub limit_remaining: u32,
    /// Seconds until the bucket is full (allowed) or until the hit fits (over the limit).
    pub duration_until_reset: u64,
}

/// A token bucket's refill rate as `requests_per_unit` per [`Unit`]: the unit in which the
/// rate equals the burst when there is one (an imported `60 per minute` is `60 per MINUTE`, not
/// `1 per SECOND`), else the smallest unit in which the rate is a whole number of requests,
/// else the largest unit that fits a `u32`, rounded (at least 1 per year; at most
/// `u32::MAX` per second).
pub fn rate_in_units(quota: &Quota) -> (u32, Unit) {
    // requests per unit = refill (µtokens) × unit (µs) / (period (µs) × 10⁶ µtokens)
    let per_unit = |unit: Unit| -> (u128, u128) {
        let num = u128::from(quota.refill()) * u128::from(unit.secs() * US_PER_SEC);
        let den = u128::from(quota.period_us()) * u128::from(MICRO);
        (num, den)
    };
    let whole = |unit: Unit| -> Option<u32> {
        let (num, den) = per_unit(unit);
        (num % den == 0 && num / den >= 1)
            .then(|| u32::try_from(num / den).ok())
            .flatten()
    };
    let burst = u128::from(quota.burst());
    if burst % u128::from(MICRO) == 0 {
        let burst_requests = burst / u128::from(MICRO);
        let matching = Unit::ALL
            .into_iter()
            .find(|&u| whole(u).is_some_and(|n| u128::from(n) == burst_requests));
        if let Some(unit) = matching {
            return (whole(unit).unwrap_or(1), unit);
        }
    }
    if let Some(unit) = Unit::ALL.into_iter().find(|&u| whole(u).is_some()) {
        return (whole(unit).unwrap_or(1), unit);
    }
    let mut best = None;
    for unit in Unit::ALL {
        let (num, den) = per_unit(unit);
        let rounded = (num + den / 2) / den;
        match u32::try_from(rounded) {
            Ok(n) if n >= 1 => best = Some((n, unit)),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    best.unwrap_or_else(|| {
        // Faster than u32::MAX a second, or slower than one a year.
        if quota.refill() >= quota.period_us() {
            (u32::MAX, Unit::Second)
        } else {
            (1, Unit::Year)
        }
    })
}

/// The stricter of two quotas for one bucket: the smaller burst, then the slower refill.
fn stricter(a: Quota, b: Quota) -> Quota {
    if a.burst() != b.burst() {
        return if a.burst() < b.burst() { a } else { b };
    }
    let rate_a = u128::from(a.refill()) * u128::from(b.period_us());
    let rate_b = u128::from(b.refill()) * u128::from(a.period_us());
    if rate_a <= rate_b {
        a
    } else {
        b
    }
}

/// What one descriptor became before the store call.
// One per descriptor in a Vec that lives for one call; boxing would add an allocation each.
#[allow(clippy::large_enum_variant)]
enum Planned<'b> {
    /// Decided without the store (no rule applies, kill switch, missing descriptor...).
    Done(Decision<'b>),
    Store {
        pending: Pending<'b>,
        /// Index in [`RlsPlan::ops`] of each of the pending's ops.
        slots: SmallVec<[usize; 4]>,
        /// A check: spends nothing, over when one hit would not fit.
        check_only: bool,
    },
}

/// A `ShouldRateLimit` call planned against one bundle.
pub struct RlsPlan<'b> {
    bundle: &'b Bundle,
    descriptors: Vec<Planned<'b>>,
    /// Every bucket of the call once, with the sum of what its descriptors spend.
    ops: SmallVec<[BucketOp; 4]>,
}

/// The call's answer.
pub struct RlsOutcome<'b> {
    pub statuses: Vec<DescriptorStatus>,
    /// Every descriptor's rules in one decision (headers, metrics, the log line).
    pub decision: Decision<'b>,
}

impl RlsOutcome<'_> {
    pub fn over_limit(&self) -> bool {
        !self.decision.is_allowed()
    }
}

/// Plans every descriptor of `request`.
///
/// # Errors
/// An empty domain or descriptor list, or an override tollgate cannot count.
pub fn plan<'b>(
    bundle: &'b Bundle,
    request: &RlsRequest,
    unix_us: u64,
    config: EngineConfig,
) -> Result<RlsPlan<'b>, RlsError> {
    if request.domain.is_empty() {
        return Err(RlsError::EmptyDomain);
    }
    if request.domain.len() > MAX_DOMAIN || request.domain.chars().any(char::is_control) {
        return Err(RlsError::BadDomain);
    }
    if request.descriptors.is_empty() {
        return Err(RlsError::NoDescriptors);
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(RlsError::TooManyDescriptors(request.descriptors.len()));
    }
    if let Some((i, d)) = request
        .descriptors
        .iter()
        .enumerate()
        .find(|(_, d)| d.entries.len() > MAX_ENTRIES)
    {
        return Err(RlsError::TooManyEntries(i, d.entries.len()));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if let Some(j) = d
            .entries
            .iter()
            .position(|(k, v)| k.len() > MAX_KEY || v.len() > MAX_VALUE)
        {
            return Err(RlsError::EntryTooLong(i, j));
        }
    }
    let request_hits = u64::from(request.hits_addend.max(1));
    let mut planned = Vec::with_capacity(request.descriptors.len());
    let mut ops: SmallVec<[BucketOp; 4]> = SmallVec::new();
    for (index, descriptor) in request.descriptors.iter().enumerate() {
        let quota = match descriptor.limit {
            None => None,
            Some(o) => Some(override_quota(index, o)?),
        };
        let envoy = EnvoyDescriptor {
            domain: &request.domain,
            entries: &descriptor.entries,
        };
        let facts = RequestFacts::for_envoy(envoy);
        let check_only = descriptor.negative_hits || descriptor.hits_addend == Some(0);
        let hits = if check_only {
            1
        } else {
            descriptor.hits_addend.unwrap_or(request_hits)
        };
        let mut pending = match (engine::plan(bundle, &facts, unix_us, config), quota) {
            // A kill switch or a missing required descriptor refuses whatever the override.
            (Plan::Done(decision @ Decision::Refuse(_)), _) => {
                planned.push(Planned::Done(decision));
                continue;
            }
            // A descriptor's own limit replaces the rules for it, as in envoyproxy/ratelimit
            // (one limit per descriptor): counted under the whole descriptor, always enforced,
            // never changing a bucket other descriptors share.
            (_, Some(quota)) => Pending::single(
                bundle,
                &bundle.envoy_override,
                override_key(&facts, &bundle.envoy_override.key_prefix),
                quota,
            ),
            (Plan::Store(pending), None) => pending,
            (Plan::Done(decision), None) => {
                planned.push(Planned::Done(decision));
                continue;
            }
        };
        pending.scale_costs(hits);
        let mut slots = SmallVec::new();
        for op in &pending.ops {
            let spend = if check_only { 0 } else { op.cost };
            let slot = match ops.iter().position(|o| o.key == op.key) {
                Some(i) => {
                    ops[i].cost = ops[i].cost.saturating_add(spend);
                    ops[i].quota = stricter(ops[i].quota, op.quota);
                    i
                }
                None => {
                    ops.push(BucketOp { cost: spend, ..*op });
                    ops.len() - 1
                }
            };
            slots.push(slot);
        }
        planned.push(Planned::Store {
            pending,
            slots,
            check_only,
        });
    }
    // A bucket reached with different quotas is counted under the strictest by everyone.
    for d in &mut planned {
        if let Planned::Store { pending, slots, .. } = d {
            for (k, &slot) in slots.iter().enumerate() {
                if pending.ops[k].quota != ops[slot].quota {
                    pending.set_quota(k, ops[slot].quota);
                }
            }
        }
    }
    Ok(RlsPlan {
        bundle,
        descriptors: planned,
        ops,
    })
}

fn override_quota(index: usize, o: LimitOverride) -> Result<Quota, RlsError> {
    let unit = o.unit.ok_or(RlsError::OverrideUnit(index))?;
    if o.requests_per_unit == 0 || o.requests_per_unit > MAX_OVERRIDE_REQUESTS {
        return Err(RlsError::OverrideAmount(index));
    }
    let amount = u64::from(o.requests_per_unit) * MICRO;
    Quota::new(amount, amount, unit.secs() * US_PER_SEC)
        .map_err(|_| RlsError::OverrideAmount(index))
}

/// The bucket of an override no rule applies to: the domain and every entry, in order.
fn override_key(facts: &RequestFacts<'_>, key_prefix: &str) -> BucketKey {
    let mut name = key_prefix.to_string();
    if let Some(envoy) = facts.envoy {
        crate::request::descriptor::push_key_part(
            &mut name,
            true,
            &envoy.domain.to_ascii_lowercase(),
        );
        for (key, value) in envoy.entries {
            crate::request::descriptor::push_key_part(&mut name, false, key);
            crate::request::descriptor::push_key_part(&mut name, false, value);
        }
    }
    BucketKey::of(&name)
}

impl<'b> RlsPlan<'b> {
    /// Every bucket of the call, each once, with what the call spends on it.
    pub fn ops(&self) -> &[BucketOp] {
        &self.ops
    }

    /// The call must be peeked before anything is spent: a descriptor is only a check, or was
    /// refused before the store (then nothing is spent, and the peek reports the buckets).
    pub fn needs_peek(&self) -> bool {
        self.descriptors.iter().any(|d| match d {
            Planned::Done(decision) => !decision.is_allowed(),
            Planned::Store { check_only, .. } => *check_only,
        })
    }

    /// The ops of the peek: the same buckets, nothing spent.
    pub fn peek_ops(&self) -> SmallVec<[BucketOp; 4]> {
        self.ops
            .iter()
            .map(|op| BucketOp { cost: 0, ..*op })
            .collect()
    }

    /// After the peek: whether the call is over the limit already (a descriptor refused before
    /// the store, or a check that fails). Then nothing is spent: finish with the peek.
    pub fn refused_by_peek(&self, peek: &OpResults) -> bool {
        let refused_before = self
            .descriptors
            .iter()
            .any(|d| matches!(d, Planned::Done(decision) if !decision.is_allowed()));
        let check_over = self.descriptors.iter().any(|d| match d {
            Planned::Store {
                pending,
                slots,
                check_only: true,
            } => pending.ops.iter().zip(slots).any(|(op, &slot)| {
                op.group == Group::Enforce
                    && peek
                        .get(slot)
                        .is_some_and(|r| r.verdict.available < op.cost)
            }),
            _ => false,
        });
        refused_before || check_over
    }

    /// Whether the call spends nothing at all (only checks, or nothing but zero costs): after
    /// a peek that passes, no second store call is needed.
    pub fn spends_nothing(&self) -> bool {
        self.ops.iter().all(|op| op.cost == 0)
    }

    /// The answer from what the store said (see [`StoreAnswer`]). A store error fails open:
    /// every descriptor allowed, counted as a store error.
    pub fn finish(self, answer: StoreAnswer<'_>, now_us: u64) -> RlsOutcome<'b> {
        let mut decisions = Vec::with_capacity(self.descriptors.len());
        let mut statuses = Vec::with_capacity(self.descriptors.len());
        for planned in self.descriptors {
            let decision = match planned {
                Planned::Done(decision) => decision,
                Planned::Store {
                    pending,
                    slots,
                    check_only,
                } => {
                    // Checks are judged on the peek (what let the call go on); everything is
                    // judged on the peek when nothing was spent.
                    let (results, as_it_stands) = match answer {
                        StoreAnswer::Failed => {
                            let error = StoreError::Unavailable("rate-limit call".into());
                            let decision = engine::finish(pending, Err(error));
                            statuses.push(status_of(&decision));
                            decisions.push(decision);
                            continue;
                        }
                        StoreAnswer::PeekOnly(peek) => (peek, true),
                        StoreAnswer::Spent { peek, results } if check_only => {
                            (peek.unwrap_or(results), true)
                        }
                        StoreAnswer::Spent { results, .. } => (results, false),
                    };
                    let own: OpResults = pending
                        .ops
                        .iter()
                        .zip(&slots)
                        .map(|(op, &slot)| {
                            let result = results.get(slot).copied().unwrap_or(OpResult {
                                verdict: BucketOp { cost: 0, ..*op }.check(None, now_us),
                                committed: false,
                                fail_open: true,
                                away: None,
                            });
                            if as_it_stands {
                                as_check(result, op, now_us)
                            } else {
                                result
                            }
                        })
                        .collect();
                    engine::finish(pending, Ok(&own))
                }
            };
            statuses.push(status_of(&decision));
            decisions.push(decision);
        }
        let decision = engine::merge(self.bundle, &decisions);
        RlsOutcome { statuses, decision }
    }
}

/// What the store said about a planned call.
#[derive(Clone, Copy)]
pub enum StoreAnswer<'r> {
    /// Only the peek ran (the call was refused by it, or spends nothing): nothing was spent.
    PeekOnly(&'r OpResults),
    /// The call's ops were applied; `peek` when a peek ran first (checks are judged on it).
    Spent {
        peek: Option<&'r OpResults>,
        results: &'r OpResults,
    },
    /// The store failed: fail open.
    Failed,
}

/// A result seen as a check of `op.cost` against the bucket as it stands, nothing spent.
fn as_check(result: OpResult, op: &BucketOp, now_us: u64) -> OpResult {
    let state = BucketState {
        tokens: result.verdict.available,
        last_us: op.window.map_or(now_us, |w| w.id),
    };
    OpResult {
        verdict: op.check(Some(state), now_us),
        committed: false,
        fail_open: result.fail_open,
        away: result.away,
    }
}

/// A descriptor's status from its own decision: the refusing rule, or the enforced rule with
/// the fewest whole tokens left.
fn status_of(decision: &Decision<'_>) -> DescriptorStatus {
    let shown = || {
        decision
            .rules()
            .iter()
            .filter(|r| r.rule.mode == Mode::Enforce && !r.fail_open)
    };
    let rule = if decision.is_allowed() {
        shown().min_by(|a, b| a.tokens.cmp(&b.tokens).then(b.reset.cmp(&a.reset)))
    } else {
        decision.rejecting_rule()
    };
    let over_limit = !decision.is_allowed();
    match rule {
        None => DescriptorStatus {
            over_limit,
            current_limit: None,
            limit_remaining: 0,
            // A kill switch (or a missing descriptor) still says when to come back.
            duration_until_reset: decision.retry_after(),
        },
        Some(r) => {
            let (requests_per_unit, unit) = rate_in_units(&r.quota);
            let whole = r.tokens / MICRO;
            let wait = if r.allowed || r.cost_exceeds {
                r.reset
            } else {
                r.retry_after
            };
            DescriptorStatus {
                over_limit,
                current_limit: Some(CurrentLimit {
                    name: r.rule.name.clone(),
                    requests_per_unit,
                    unit,
                }),
                limit_remaining: if r.allowed {
                    u32::try_from(whole).unwrap_or(u32::MAX)
                } else {
                    0
                },
                duration_until_reset: wait,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::compile_bundle;
    use crate::store::{MemoryStore, MemoryStoreConfig};
    use serde_json::json;

    fn quota(burst: u64, refill: u64, period_us: u64) -> Quota {
        Quota::new(burst * MICRO, refill, period_us).unwrap()
    }

    #[test]
    fn rates_are_expressed_in_the_smallest_exact_unit() {
        assert_eq!(
            rate_in_units(&quota(20, 10 * MICRO, US_PER_SEC)),
            (10, Unit::Second)
        );
        assert_eq!(
            rate_in_units(&quota(1, MICRO / 2, US_PER_SEC)),
            (30, Unit::Minute)
        );
        assert_eq!(
            rate_in_units(&quota(1, MICRO, 3_600 * US_PER_SEC)),
            (1, Unit::Hour)
        );
        assert_eq!(
            rate_in_units(&quota(5, 5 * MICRO, 86_400 * US_PER_SEC)),
            (5, Unit::Day)
        );
        // 1 per 7 s is whole only per week.
        assert_eq!(
            rate_in_units(&quota(1, MICRO, 7 * US_PER_SEC)),
            (86_400, Unit::Week)
        );
        // 1 per 11 s is whole in no unit: the year, rounded (31 536 000 / 11 = 2 866 909.09).
        assert_eq!(
            rate_in_units(&quota(1, MICRO, 11 * US_PER_SEC)),
            (2_866_909, Unit::Year)
        );
        // The unit in which the rate equals the burst wins: an imported "60 per minute".
        assert_eq!(
            rate_in_units(&quota(60, MICRO, US_PER_SEC)),
            (60, Unit::Minute)
        );
        assert_eq!(
            rate_in_units(&quota(3600, MICRO, US_PER_SEC)),
            (3600, Unit::Hour)
        );
        // Slower than one a year: shown as one a year.
        assert_eq!(
            rate_in_units(&quota(1, 1, 366 * 86_400 * US_PER_SEC)),
            (1, Unit::Year)
        );
        // Fractions of a token per period.
        assert_eq!(
            rate_in_units(&quota(1, 1_500_000, US_PER_SEC)),
            (90, Unit::Minute)
        );
    }

    fn descriptor(entries: &[(&str, &str)]) -> RlsDescriptor {
        RlsDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..RlsDescriptor::default()
        }
    }

    /// Statuses of one single-descriptor call against `store` at time 0 (no peek needed).
    fn statuses(bundle: &Bundle, store: &MemoryStore, d: RlsDescriptor) -> Vec<DescriptorStatus> {
        let request = RlsRequest {
            domain: "edge".into(),
            descriptors: vec![d],
            hits_addend: 0,
        };
        statuses_of(bundle, store, request)
    }

    fn statuses_of(
        bundle: &Bundle,
        store: &MemoryStore,
        request: RlsRequest,
    ) -> Vec<DescriptorStatus> {
        let plan = plan(bundle, &request, 0, EngineConfig::default()).unwrap();
        let mut results = OpResults::new();
        store.apply(0, plan.ops(), &mut results).unwrap();
        plan.finish(
            StoreAnswer::Spent {
                peek: None,
                results: &results,
            },
            0,
        )
        .statuses
    }

    #[test]
    fn envoy_actions_map_onto_tollgates_descriptors() {
        let bundle = compile_bundle(
            &json!({"rules": [
                {"name": "by-header", "limit_keys": ["header:x-api-key"], "on_missing": "shared",
                 "match": {"descriptor_keys": "x-api-key"},
                 "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}},
                {"name": "by-network", "limit_keys": ["ip:address"],
                 "match": {"ip:address": "10.1.0.0/16", "domain": "EDGE"},
                 "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 2}}
            ]}),
            "t",
        )
        .unwrap();
        let store = MemoryStore::new(MemoryStoreConfig::default());
        // request_headers with descriptor_key = the header's name reads as header:<name>.
        let key = || descriptor(&[("x-api-key", "k1")]);
        assert!(!statuses(&bundle, &store, key())[0].over_limit);
        let over = &statuses(&bundle, &store, key())[0];
        assert!(over.over_limit);
        assert_eq!(over.current_limit.as_ref().unwrap().name, "by-header");
        // masked_remote_address: the network's address is the client address.
        let masked = || descriptor(&[("masked_remote_address", "10.1.2.0/24")]);
        assert_eq!(statuses(&bundle, &store, masked())[0].limit_remaining, 1);
        assert_eq!(statuses(&bundle, &store, masked())[0].limit_remaining, 0);
        assert!(statuses(&bundle, &store, masked())[0].over_limit);
        let other = descriptor(&[("remote_address", "10.1.9.9")]);
        assert_eq!(statuses(&bundle, &store, other)[0].limit_remaining, 1);
        let outside = descriptor(&[("remote_address", "10.2.0.1")]);
        assert_eq!(statuses(&bundle, &store, outside)[0].current_limit, None);
    }

    #[test]
    fn a_bucket_two_descriptors_share_is_charged_once_with_both_costs() {
        let bundle = compile_bundle(
            &json!({"rules": [{"name": "global", "limit_keys": [], "algorithm": "token_bucket",
                               "algorithm_config": {"rps": 1, "burst": 3}}]}),
            "t",
        )
        .unwrap();
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let call = || RlsRequest {
            domain: "edge".into(),
            descriptors: vec![descriptor(&[("a", "1")]), descriptor(&[("b", "2")])],
            hits_addend: 0,
        };
        let run = || {
            let plan = plan(&bundle, &call(), 0, EngineConfig::default()).unwrap();
            assert_eq!(plan.ops().len(), 1);
            assert_eq!(plan.ops()[0].cost, 2 * MICRO);
            let mut results = OpResults::new();
            store.apply(0, plan.ops(), &mut results).unwrap();
            plan.finish(
                StoreAnswer::Spent {
                    peek: None,
                    results: &results,
                },
                0,
            )
        };
        let first = run();
        assert!(!first.over_limit());
        assert_eq!(first.statuses[0].limit_remaining, 1);
        assert_eq!(first.statuses[1].limit_remaining, 1);
        // Two more do not fit in the one token left: both over, nothing spent.
        let second = run();
        assert!(second.over_limit());
        assert!(second.statuses.iter().all(|s| s.over_limit));
        let single = RlsRequest {
            domain: "edge".into(),
            descriptors: vec![descriptor(&[("a", "1")])],
            hits_addend: 0,
        };
        assert_eq!(statuses_of(&bundle, &store, single)[0].limit_remaining, 0);
    }
}
