//! The decision engine: kill switches first, then every matching policy and rule, one store
//! call with all-or-nothing commit, and a [`Decision`] that carries everything the response
//! headers, logs and metrics need.

use crate::clock::Clock;
use crate::descriptor::{push_ip_key, push_key_part, Descriptor, RequestFacts};
use crate::limiter::{micro_to_tokens, tokens_to_micro, Quota};
use crate::policy::{Bundle, CostSource, Mode, OnMissing, Rule};
use crate::store::{BucketKey, BucketOp, Group, OpResults, Store, StoreError};
use arc_swap::{ArcSwapOption, Guard};
use smallvec::SmallVec;
use std::sync::Arc;

/// `Retry-After` base for a kill switch without `expires_at`: it lasts until an operator lifts
/// it, so clients are told to come back in a minute rather than hammer.
pub const KILL_SWITCH_RETRY_SECS: u64 = 60;

thread_local! {
    /// Reused by every decision on this thread to build bucket names without allocating.
    static KEY_BUFFER: std::cell::RefCell<String> = std::cell::RefCell::new(String::with_capacity(128));
}

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

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    TokenBucketExceeded,
    KillSwitch,
    /// A rule with `on_missing: reject` found its descriptor missing.
    MissingDescriptor,
    /// The request's stated cost is above the rule's `max_cost` or its bucket's burst: it
    /// could never be admitted, so no `Retry-After` is promised.
    CostExceedsLimit,
    /// A header a rule limits on (or reads its cost from) arrived on more than one line.
    DuplicateHeader,
    /// The path has `%2F` / `%5C` and the gateway refuses encoded slashes.
    EncodedSlash,
}

impl Reason {
    /// Every reason, for pre-resolved metric counters.
    pub const ALL: [Reason; 6] = [
        Reason::TokenBucketExceeded,
        Reason::KillSwitch,
        Reason::MissingDescriptor,
        Reason::CostExceedsLimit,
        Reason::DuplicateHeader,
        Reason::EncodedSlash,
    ];

    /// The value of the reason header and of the `reason` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TokenBucketExceeded => "token_bucket_exceeded",
            Reason::KillSwitch => "kill_switch",
            Reason::MissingDescriptor => "missing_descriptor",
            Reason::CostExceedsLimit => "cost_exceeds_limit",
            Reason::DuplicateHeader => "duplicate_header",
            Reason::EncodedSlash => "encoded_slash",
        }
    }

    /// The HTTP status a refusal for this reason gets.
    pub fn status(self) -> u16 {
        match self {
            Reason::TokenBucketExceeded | Reason::KillSwitch | Reason::CostExceedsLimit => 429,
            Reason::MissingDescriptor => 401,
            Reason::DuplicateHeader | Reason::EncodedSlash => 400,
        }
    }

    /// The body of a refusal for this reason.
    pub fn body(self) -> &'static str {
        match self {
            Reason::TokenBucketExceeded | Reason::KillSwitch => "Too Many Requests",
            Reason::CostExceedsLimit => {
                "Too Many Requests: this request's cost exceeds what the rate limit can ever admit"
            }
            Reason::MissingDescriptor => {
                "Unauthorized: this request lacks the credential or key a rate-limit rule requires"
            }
            Reason::DuplicateHeader => {
                "Bad Request: a header this gateway limits on was sent more than once"
            }
            Reason::EncodedSlash => {
                "Bad Request: encoded slashes (%2F, %5C) are not accepted in the path"
            }
        }
    }
}

/// The overall answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Allow,
    Reject(Reason),
    /// No valid bundle is loaded: the decision service answers 503, the proxy fails open.
    NoPolicy,
}

/// What happened to one applicable rule.
#[derive(Debug, Clone)]
pub struct RuleOutcome {
    /// Index into [`Bundle::rules`].
    pub rule: usize,
    pub mode: Mode,
    /// The bucket's identity in the store (hash of `tb:<rule>:<key>`; the readable name is
    /// rebuilt on demand by [`Engine::bucket_name`], so the hot path allocates no string).
    pub key: BucketKey,
    pub quota: Quota,
    pub allowed: bool,
    /// Tokens were spent from this bucket.
    pub committed: bool,
    /// The store could not hold the bucket: allowed untracked.
    pub fail_open: bool,
    /// The stated cost is above `max_cost` or the burst: refused, and never admissible.
    pub cost_exceeds: bool,
    /// Micro-tokens left (after spending when committed, before otherwise).
    pub tokens: u64,
    /// Seconds until the cost is affordable (0 when allowed).
    pub retry_after: u64,
    /// Seconds until the bucket is full.
    pub reset: u64,
}

impl RuleOutcome {
    /// Tokens left as a number.
    pub fn tokens_f64(&self) -> f64 {
        micro_to_tokens(self.tokens)
    }
}

/// The bundle a decision was made with. An `arc_swap` guard, not an `Arc` clone: taking and
/// dropping a shared refcount on every request costs ~25 ns and bounces a cache line between
/// cores. Keep decisions short-lived (the guard pins the bundle until dropped).
pub type BundleGuard = Guard<Option<Arc<Bundle>>>;

/// The engine's answer for one request.
#[derive(Debug)]
pub struct Decision {
    pub outcome: Outcome,
    /// The bundle the decision was made with (names for headers, logs and metrics).
    pub bundle: Option<BundleGuard>,
    /// Every applicable rule, enforced and shadow, in policy order.
    pub rules: SmallVec<[RuleOutcome; 4]>,
    /// For a rejection: `B`, the seconds the client must wait (before jitter); 0 if unknown.
    pub retry_after: u64,
    /// The kill switch that fired, as an index into [`Bundle::kill_switches`].
    pub kill_switch: Option<usize>,
    /// The rule whose missing descriptor caused a 401, or whose header was repeated (400).
    pub missing_rule: Option<usize>,
    /// A shadow rule that would have refused the request for a missing descriptor.
    pub shadow_missing_rule: Option<usize>,
    /// The store failed and the request was allowed without limiting.
    pub store_error: bool,
}

impl Decision {
    fn new(outcome: Outcome, bundle: Option<BundleGuard>) -> Self {
        Decision {
            outcome,
            bundle,
            rules: SmallVec::new(),
            retry_after: 0,
            kill_switch: None,
            missing_rule: None,
            shadow_missing_rule: None,
            store_error: false,
        }
    }

    /// A refusal decided before any policy was looked at (a malformed request).
    pub fn refused(reason: Reason) -> Self {
        Decision::new(Outcome::Reject(reason), None)
    }

    pub fn is_allowed(&self) -> bool {
        !matches!(self.outcome, Outcome::Reject(_))
    }

    /// The HTTP status: 200 allow (and no policy, for the proxy), 429/401 reject.
    pub fn status(&self) -> u16 {
        match self.outcome {
            Outcome::Allow | Outcome::NoPolicy => 200,
            Outcome::Reject(reason) => reason.status(),
        }
    }

    /// The rule definition of an outcome.
    /// The bundle in force for this decision.
    pub fn bundle(&self) -> Option<&Bundle> {
        self.bundle.as_ref().and_then(|g| g.as_deref())
    }

    pub fn rule_def(&self, outcome: &RuleOutcome) -> Option<&Rule> {
        self.bundle()?.rules.get(outcome.rule)
    }

    /// `(policy id, rule name)` of an outcome.
    pub fn names(&self, outcome: &RuleOutcome) -> (&str, &str) {
        match self.bundle() {
            Some(b) => match b.rules.get(outcome.rule) {
                Some(rule) => (
                    b.policies.get(rule.policy).map_or("", |p| p.id.as_str()),
                    rule.name.as_str(),
                ),
                None => ("", ""),
            },
            None => ("", ""),
        }
    }

    /// The enforced rule that rejected the request with the longest wait.
    pub fn rejecting_rule(&self) -> Option<&RuleOutcome> {
        self.rules
            .iter()
            .filter(|r| r.mode == Mode::Enforce && !r.allowed)
            .max_by_key(|r| (r.cost_exceeds, r.retry_after))
    }

    /// Shadow rules that would have rejected.
    pub fn shadow_rejections(&self) -> impl Iterator<Item = &RuleOutcome> {
        self.rules
            .iter()
            .filter(|r| r.mode == Mode::Shadow && !r.allowed)
    }
}

/// A decision before the store has answered.
// Lives for a few microseconds on the stack; boxing the larger variant would put an allocation
// on the embedded store's hot path.
#[allow(clippy::large_enum_variant)]
pub enum Plan {
    /// Decided without the store (no policy, kill switch, missing descriptor, no rule).
    Done(Decision),
    /// Needs these bucket operations; give the answer to [`Engine::finish`].
    Store(Decision, SmallVec<[BucketOp; 4]>),
}

/// The decision engine: a hot-swappable bundle, a store and a clock.
pub struct Engine<S: Store> {
    bundle: ArcSwapOption<Bundle>,
    store: S,
    clock: Arc<dyn Clock>,
    config: EngineConfig,
}

impl<S: Store> Engine<S> {
    pub fn new(store: S, clock: Arc<dyn Clock>, config: EngineConfig) -> Self {
        Engine {
            bundle: ArcSwapOption::empty(),
            store,
            clock,
            config,
        }
    }

    /// Installs a bundle (initial load or reload). Buckets are untouched: they survive reloads,
    /// and a lowered burst caps their tokens on the next request.
    pub fn install(&self, bundle: Bundle) {
        self.bundle.store(Some(Arc::new(bundle)));
    }

    /// The bundle in force, if any.
    pub fn bundle(&self) -> Option<Arc<Bundle>> {
        self.bundle.load_full()
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Decides one request against the engine's own (synchronous) store.
    pub fn decide(&self, facts: &RequestFacts<'_>) -> Decision {
        match self.plan(facts) {
            Plan::Done(decision) => decision,
            Plan::Store(decision, ops) => {
                let mut results = OpResults::new();
                let answer = self.store.apply(self.clock.now_us(), &ops, &mut results);
                self.finish(decision, answer.map(|()| &results))
            }
        }
    }

    /// Everything up to the store call: kill switches, matching policies and rules, bucket keys
    /// and costs. The plan owns what it needs, so a networked store can be awaited before
    /// [`Engine::finish`].
    pub fn plan(&self, facts: &RequestFacts<'_>) -> Plan {
        let guard = self.bundle.load();
        let Some(bundle) = guard.as_deref() else {
            return Plan::Done(Decision::new(Outcome::NoPolicy, None));
        };
        let prefix = self.config.ipv6_prefix;

        if !bundle.kill_switches.is_empty() {
            // A kill switch on a header must see the same value the upstream will.
            let repeated = bundle.kill_switches.iter().any(
                |ks| matches!(&ks.scope, Descriptor::Header(h) if facts.headers.is_repeated(h)),
            );
            if repeated {
                return Plan::Done(Decision::new(
                    Outcome::Reject(Reason::DuplicateHeader),
                    Some(guard),
                ));
            }
            let unix = self.clock.unix_secs();
            let hit = bundle
                .kill_switches
                .iter()
                .enumerate()
                .find(|(_, ks)| ks.hits(facts, unix, prefix))
                .map(|(i, ks)| {
                    let wait = ks
                        .expires_at
                        .map_or(KILL_SWITCH_RETRY_SECS, |at| (at - unix).max(1) as u64);
                    (i, wait)
                });
            if let Some((i, retry_after)) = hit {
                let mut d = Decision::new(Outcome::Reject(Reason::KillSwitch), Some(guard));
                d.kill_switch = Some(i);
                d.retry_after = retry_after;
                return Plan::Done(d);
            }
        }

        // Applicable rules become outcomes right away; the store fills in the verdicts.
        let mut decision = Decision::new(Outcome::Allow, None);
        let mut ops: SmallVec<[BucketOp; 4]> = SmallVec::new();
        // Rules with `on_missing: reject` whose descriptor is missing, enforced and shadow.
        let mut missing_enforce: Option<usize> = None;
        let mut missing_shadow: Option<usize> = None;
        // A rule reading a header the request repeats.
        let mut repeated: Option<usize> = None;
        'policies: for policy in bundle.policies.iter() {
            if !policy.selector.matches(facts) {
                continue;
            }
            let mut matched_conditional = false;
            let mut consider = |index: usize,
                                outcomes: &mut SmallVec<[RuleOutcome; 4]>,
                                ops: &mut SmallVec<[BucketOp; 4]>| {
                let rule = &bundle.rules[index];
                // The key is built in a per-thread buffer: hashed, matched against overrides,
                // and never stored.
                let found = KEY_BUFFER.with(|buffer| {
                    let mut bucket = buffer.borrow_mut();
                    self.write_bucket(rule, facts, &mut bucket).then(|| {
                        let quota = *rule.quota_for(&bucket[rule.key_prefix.len()..]);
                        (BucketKey::of(&bucket), quota)
                    })
                });
                match found {
                    Some((key, quota)) => {
                        let (cost, cost_exceeds) = match cost_of(&rule.cost, facts, &quota) {
                            Cost::Fits(cost) => (cost, false),
                            // One micro-token more than the bucket can ever hold: the store
                            // refuses it whatever its state, and spends nothing anywhere.
                            Cost::Exceeds => (quota.burst().saturating_add(1), true),
                        };
                        ops.push(BucketOp {
                            key,
                            quota,
                            cost,
                            group: match rule.mode {
                                Mode::Enforce => Group::Enforce,
                                Mode::Shadow => Group::Shadow,
                            },
                        });
                        outcomes.push(RuleOutcome {
                            rule: index,
                            mode: rule.mode,
                            key,
                            quota,
                            allowed: true,
                            committed: false,
                            fail_open: false,
                            cost_exceeds,
                            tokens: 0,
                            retry_after: 0,
                            reset: 0,
                        });
                    }
                    None if rule.on_missing == OnMissing::Reject => {
                        let slot = match rule.mode {
                            Mode::Enforce => &mut missing_enforce,
                            Mode::Shadow => &mut missing_shadow,
                        };
                        slot.get_or_insert(index);
                    }
                    None => {}
                }
            };
            for index in policy.rules.clone() {
                let rule = &bundle.rules[index];
                if repeats_header(rule, facts) {
                    repeated = Some(index);
                    break 'policies;
                }
                if !rule.conditions.is_empty() {
                    if !rule.conditions.iter().all(|c| c.matches(facts, prefix)) {
                        continue;
                    }
                    matched_conditional = true;
                }
                consider(index, &mut decision.rules, &mut ops);
            }
            if let Some(fallback) = policy.fallback {
                let rule = &bundle.rules[fallback];
                if repeats_header(rule, facts) {
                    repeated = Some(fallback);
                    break 'policies;
                }
                if !matched_conditional && rule.conditions.iter().all(|c| c.matches(facts, prefix))
                {
                    consider(fallback, &mut decision.rules, &mut ops);
                }
            }
        }
        decision.bundle = Some(guard);
        decision.shadow_missing_rule = missing_shadow;

        if let Some(rule) = repeated {
            decision.rules.clear();
            decision.outcome = Outcome::Reject(Reason::DuplicateHeader);
            decision.missing_rule = Some(rule);
            return Plan::Done(decision);
        }

        if let Some(rule) = missing_enforce {
            decision.rules.clear();
            decision.outcome = Outcome::Reject(Reason::MissingDescriptor);
            decision.missing_rule = Some(rule);
            return Plan::Done(decision);
        }
        if ops.is_empty() {
            return Plan::Done(decision);
        }
        Plan::Store(decision, ops)
    }

    /// Completes a planned decision with the store's answer (one result per op, in order).
    /// A store error fails open: the request is allowed, nothing was spent anywhere.
    pub fn finish(
        &self,
        mut decision: Decision,
        answer: Result<&OpResults, StoreError>,
    ) -> Decision {
        let results = match answer {
            Ok(results) => results,
            Err(_) => {
                decision.rules.clear();
                decision.store_error = true;
                return decision;
            }
        };
        let mut rejected = false;
        let mut never_admissible = false;
        for (outcome, r) in decision.rules.iter_mut().zip(results.iter()) {
            let v = r.verdict;
            if outcome.mode == Mode::Enforce && !v.allowed {
                rejected = true;
                never_admissible |= outcome.cost_exceeds;
            }
            outcome.allowed = v.allowed;
            outcome.committed = r.committed;
            outcome.fail_open = r.fail_open;
            // A cost that can never fit has no time to wait for.
            outcome.retry_after = if outcome.cost_exceeds {
                0
            } else {
                v.retry_after_secs
            };
            if r.committed {
                outcome.tokens = v.remaining;
                outcome.reset = v.reset_secs();
            } else {
                // Nothing spent: report the bucket as it stands.
                outcome.tokens = v.available;
                outcome.reset = crate::limiter::ceil_secs(
                    outcome
                        .quota
                        .time_to_gain_us(outcome.quota.burst() - v.available),
                );
            }
        }
        if never_admissible {
            decision.outcome = Outcome::Reject(Reason::CostExceedsLimit);
            decision.retry_after = 0;
        } else if rejected {
            decision.outcome = Outcome::Reject(Reason::TokenBucketExceeded);
            decision.retry_after = decision
                .rules
                .iter()
                .filter(|r| r.mode == Mode::Enforce && !r.allowed)
                .map(|r| r.retry_after)
                .max()
                .unwrap_or(1);
        }
        decision
    }

    /// The readable bucket name (`tb:<rule>:<key>`) of rule `rule` (an index into the bundle's
    /// rules) for this request, and where the composite key starts in it; `None` when the rule
    /// has no bucket for this request (a descriptor is missing and the rule does not share one).
    pub fn bucket_name(&self, rule: usize, facts: &RequestFacts<'_>) -> Option<(String, usize)> {
        let bundle = self.bundle.load();
        let rule = bundle.as_deref()?.rules.get(rule)?;
        let mut bucket = String::new();
        let key_start = rule.key_prefix.len();
        self.write_bucket(rule, facts, &mut bucket)
            .then_some((bucket, key_start))
    }

    /// Writes `rule`'s bucket name for this request into `bucket` (cleared first); false when a
    /// descriptor is missing and the rule does not share a bucket for that case.
    fn write_bucket(&self, rule: &Rule, facts: &RequestFacts<'_>, bucket: &mut String) -> bool {
        bucket.clear();
        bucket.push_str(&rule.key_prefix);
        for (i, descriptor) in rule.limit_keys.iter().enumerate() {
            // The client address needs no escaping: write it straight into the key.
            if let (Descriptor::Ip { v6_prefix }, Some(ip)) = (descriptor, facts.client_ip) {
                if i > 0 {
                    bucket.push('|');
                }
                push_ip_key(bucket, ip, v6_prefix.unwrap_or(self.config.ipv6_prefix));
                continue;
            }
            match descriptor.value(facts, self.config.ipv6_prefix) {
                Some(value) => push_key_part(bucket, i == 0, &value),
                None => match rule.on_missing {
                    // `\0` cannot come out of `push_key_part` (it only escapes `|` and `\`), so
                    // the shared "missing" bucket never collides with a real value.
                    OnMissing::Shared => {
                        if i > 0 {
                            bucket.push('|');
                        }
                        bucket.push_str("\\0");
                    }
                    OnMissing::Skip | OnMissing::Reject => return false,
                },
            }
        }
        true
    }

    /// Drops buckets that no longer matter; the gateway calls this periodically.
    pub fn sweep(&self) -> u64 {
        self.store.sweep(self.clock.now_us())
    }
}

/// Whether a rule reads a header that the request sent on more than one line.
fn repeats_header(rule: &Rule, facts: &RequestFacts<'_>) -> bool {
    rule.header_names
        .iter()
        .any(|name| facts.headers.is_repeated(name))
}

/// A request's cost under one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// Micro-tokens to spend.
    Fits(u64),
    /// Above the rule's `max_cost` or the bucket's burst: refused, never admissible.
    Exceeds,
}

/// The cost of this request under `source` and the applied `quota`. A stated cost that is
/// absent, empty, not a number, not finite or not positive gives the default; one below
/// `min_cost` is raised to it (the client may raise its price, never lower it).
pub fn cost_of(source: &CostSource, facts: &RequestFacts<'_>, quota: &Quota) -> Cost {
    let (raw, limits) = match source {
        CostSource::Fixed(cost) => {
            return if *cost > quota.burst() {
                Cost::Exceeds
            } else {
                Cost::Fits(*cost)
            };
        }
        CostSource::Header { name, limits } => (facts.headers.header_text(name), limits),
        CostSource::Query { name, limits } => (facts.query_param(name), limits),
    };
    let cost = raw
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|tokens| tokens.is_finite() && *tokens > 0.0)
        .map_or(limits.default, |tokens| {
            tokens_to_micro(tokens).max(limits.min)
        });
    let ceiling = limits
        .max
        .map_or(quota.burst(), |max| max.min(quota.burst()));
    if cost > ceiling {
        Cost::Exceeds
    } else {
        Cost::Fits(cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::MICRO;
    use crate::policy::compile_bundle;
    use crate::store::{MemoryStore, MemoryStoreConfig};
    use serde_json::json;

    fn engine(bundle: serde_json::Value) -> (Engine<MemoryStore>, ManualClock) {
        let clock = ManualClock::new(1_800_000_000);
        let e = Engine::new(
            MemoryStore::new(MemoryStoreConfig::default()),
            Arc::new(clock.clone()),
            EngineConfig::default(),
        );
        e.install(compile_bundle(&bundle, "test").unwrap());
        (e, clock)
    }

    fn ask(
        e: &Engine<MemoryStore>,
        method: &str,
        uri: &str,
        ip: &str,
        headers: &[(&str, &str)],
    ) -> Decision {
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let facts = RequestFacts::from_uri(
            method,
            uri,
            Some("api.example.com"),
            Some(ip.parse().unwrap()),
            &headers,
        );
        e.decide(&facts)
    }

    /// The readable bucket name the request's `index`-th applicable rule used.
    fn bucket(
        e: &Engine<MemoryStore>,
        d: &Decision,
        index: usize,
        ip: &str,
        headers: &[(&str, &str)],
    ) -> String {
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let facts = RequestFacts::from_uri(
            "GET",
            "/",
            Some("api.example.com"),
            Some(ip.parse().unwrap()),
            &headers,
        );
        e.bucket_name(d.rules[index].rule, &facts).unwrap().0
    }

    fn tb(name: &str, keys: serde_json::Value, rps: f64, burst: f64) -> serde_json::Value {
        json!({"name": name, "limit_keys": keys, "algorithm": "token_bucket",
               "algorithm_config": {"rps": rps, "burst": burst}})
    }

    #[test]
    fn no_bundle_means_no_policy() {
        let e = Engine::new(
            MemoryStore::new(MemoryStoreConfig::default()),
            Arc::new(ManualClock::new(0)),
            EngineConfig::default(),
        );
        let headers: Vec<(String, String)> = Vec::new();
        let d = e.decide(&RequestFacts::from_uri("GET", "/", None, None, &headers));
        assert_eq!(d.outcome, Outcome::NoPolicy);
    }

    #[test]
    fn all_or_nothing_across_policies() {
        let (e, _) = engine(json!({"bundle_version": 1, "policies": [
            {"id": "a", "spec": {"rules": [tb("wide", json!(["ip:address"]), 1.0, 10.0)]}},
            {"id": "b", "spec": {"selector": {"pathPrefix": "/fills"}, "rules": [tb("fills", json!(["ip:address"]), 1.0, 2.0)]}}
        ]}));
        for _ in 0..2 {
            assert!(ask(&e, "GET", "/fills", "10.0.0.1", &[]).is_allowed());
        }
        let d = ask(&e, "GET", "/fills", "10.0.0.1", &[]);
        assert_eq!(d.outcome, Outcome::Reject(Reason::TokenBucketExceeded));
        assert_eq!(d.rules.len(), 2);
        // The wide rule was refunded: 8 left, not 7.
        assert_eq!(d.rules[0].tokens, 8 * MICRO);
        assert!(!d.rules[0].committed);
        assert_eq!(d.retry_after, 1);
        // A path outside /fills only meets the wide rule.
        let d = ask(&e, "GET", "/fillsx", "10.0.0.1", &[]);
        assert!(d.is_allowed());
        assert_eq!(d.rules.len(), 1);
        assert_eq!(d.rules[0].tokens, 7 * MICRO);
    }

    #[test]
    fn shadow_never_rejects_and_uses_its_own_buckets() {
        let (e, _) = engine(json!({"bundle_version": 1, "policies": [
            {"id": "s", "spec": {"mode": "shadow", "rules": [tb("per-ip", json!(["ip:address"]), 1.0, 1.0)]}}
        ]}));
        assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert!(d.is_allowed());
        assert_eq!(d.shadow_rejections().count(), 1);
        assert_eq!(
            bucket(&e, &d, 0, "10.0.0.1", &[]),
            "shadow:tb:per-ip:10.0.0.1"
        );
        assert_eq!(d.rules[0].key, BucketKey::of("shadow:tb:per-ip:10.0.0.1"));
    }

    #[test]
    fn tiers_match_and_fallback() {
        let (e, _) = engine(
            json!({"bundle_version": 1, "policies": [{"id": "tiers", "spec": {
                "rules": [
                    {"name": "enterprise", "limit_keys": ["header:x-api-key"], "match": {"header:x-plan": "enterprise"},
                     "algorithm": "token_bucket", "algorithm_config": {"rps": 100, "burst": 200}},
                    {"name": "office", "limit_keys": ["ip:address"], "match": {"ip:address": "10.0.0.0/8"},
                     "algorithm": "token_bucket", "algorithm_config": {"rps": 100, "burst": 50}}
                ],
                "fallback_limit": tb("free", json!(["header:x-api-key"]), 1.0, 2.0)
            }}]}),
        );
        let d = ask(
            &e,
            "GET",
            "/",
            "192.0.2.1",
            &[("x-api-key", "k1"), ("x-plan", "enterprise")],
        );
        assert_eq!(d.rules.len(), 1);
        assert_eq!(d.names(&d.rules[0]), ("tiers", "enterprise"));
        let d = ask(&e, "GET", "/", "10.9.9.9", &[("x-api-key", "k1")]);
        assert_eq!(d.names(&d.rules[0]).1, "office");
        let d = ask(
            &e,
            "GET",
            "/",
            "192.0.2.1",
            &[("x-api-key", "k2"), ("x-plan", "free")],
        );
        assert_eq!(d.names(&d.rules[0]).1, "free");
        assert_eq!(
            bucket(&e, &d, 0, "192.0.2.1", &[("x-api-key", "k2")]),
            "tb:free:k2"
        );
    }

    #[test]
    fn missing_descriptors_skip_share_or_reject() {
        let mut shared = tb("shared", json!(["header:x-api-key"]), 1.0, 1.0);
        shared["on_missing"] = json!("shared");
        let (e, _) =
            engine(json!({"rules": [tb("skip", json!(["header:x-user"]), 1.0, 1.0), shared]}));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(d.rules.len(), 1);
        assert_eq!(bucket(&e, &d, 0, "10.0.0.1", &[]), "tb:shared:\\0");
        assert_eq!(d.rules[0].key, BucketKey::of("tb:shared:\\0"));
        // Every key-less request shares that one bucket.
        assert!(!ask(&e, "GET", "/", "10.0.0.2", &[]).is_allowed());
        let mut reject = tb("need-key", json!(["header:x-api-key"]), 1.0, 1.0);
        reject["on_missing"] = json!("reject");
        let (e, _) = engine(json!({"rules": [reject]}));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(d.outcome, Outcome::Reject(Reason::MissingDescriptor));
        assert_eq!(d.status(), 401);
        assert!(ask(&e, "GET", "/", "10.0.0.1", &[("X-Api-Key", "k")]).is_allowed());
    }

    #[test]
    fn kill_switch_wins_and_expires() {
        let (e, clock) = engine(json!({"bundle_version": 1, "policies": [],
            "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "tenant-42", "route": "/v1/inference",
                               "reason": "incident 123", "expires_at": "2027-01-15T08:00:10Z"}]}));
        // ManualClock wall origin 1_800_000_000 = 2027-01-15T08:00:00Z.
        let d = ask(
            &e,
            "POST",
            "/v1/inference/run",
            "10.0.0.1",
            &[("X-Tenant-Id", "tenant-42")],
        );
        assert_eq!(d.outcome, Outcome::Reject(Reason::KillSwitch));
        assert_eq!(d.retry_after, 10);
        assert!(ask(
            &e,
            "POST",
            "/v1/other",
            "10.0.0.1",
            &[("X-Tenant-Id", "tenant-42")]
        )
        .is_allowed());
        assert!(ask(
            &e,
            "POST",
            "/v1/inference",
            "10.0.0.1",
            &[("X-Tenant-Id", "tenant-7")]
        )
        .is_allowed());
        clock.set_secs(10.0);
        assert!(ask(
            &e,
            "POST",
            "/v1/inference",
            "10.0.0.1",
            &[("X-Tenant-Id", "tenant-42")]
        )
        .is_allowed());
    }

    #[test]
    fn variable_cost_from_header_and_query_with_fallback() {
        let (e, _) = engine(json!({"rules": [
            {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 10, "cost_source": "header:x-weight", "default_cost": 2}}
        ]}));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[("X-Weight", "5")]);
        assert_eq!(d.rules[0].tokens, 5 * MICRO);
        for (i, bad) in ["", "abc", "-3", "0", "NaN", "inf"].into_iter().enumerate() {
            let ip = format!("10.0.1.{i}");
            let before = ask(&e, "GET", "/", &ip, &[]).rules[0].tokens;
            let after = ask(&e, "GET", "/", &ip, &[("X-Weight", bad)]).rules[0].tokens;
            assert_eq!(
                before - after,
                2 * MICRO,
                "cost header {bad:?} must fall back to default_cost"
            );
        }
        let (e, _) = engine(json!({"rules": [
            {"name": "q", "limit_keys": [], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 10, "cost_source": "query:cost"}}
        ]}));
        assert_eq!(
            ask(&e, "GET", "/x?cost=2.5", "10.0.0.1", &[]).rules[0].tokens,
            7_500_000
        );
        assert_eq!(
            ask(&e, "GET", "/x", "10.0.0.1", &[]).rules[0].tokens,
            6_500_000
        );
    }

    #[test]
    fn buckets_survive_reload_and_lowered_burst_caps() {
        let (e, _) = engine(json!({"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 10.0)]}));
        ask(&e, "GET", "/", "10.0.0.1", &[]);
        ask(&e, "GET", "/", "10.0.0.1", &[]);
        // Unchanged rule: state kept exactly.
        e.install(
            compile_bundle(
                &json!({"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 10.0)]}),
                "t",
            )
            .unwrap(),
        );
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.1", &[]).rules[0].tokens,
            7 * MICRO
        );
        // Lowered burst: 7 tokens capped to 3, then one spent.
        e.install(
            compile_bundle(
                &json!({"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 3.0)]}),
                "t",
            )
            .unwrap(),
        );
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.1", &[]).rules[0].tokens,
            2 * MICRO
        );
    }

    #[test]
    fn boulder_overrides_apply_per_id() {
        let (e, _) = engine(
            json!({"rules": [{"name": "NewRegistrationsPerIPAddress", "limit_keys": ["ip:address"],
            "algorithm": "token_bucket", "algorithm_config": {"burst": 20, "count": 20, "period": "1s",
            "overrides": [{"ids": ["10.0.0.2", "10.0.0.5"], "burst": 20, "count": 40, "period": "1s"}]}}]}),
        );
        let d = ask(&e, "POST", "/new-reg", "10.0.0.5", &[]);
        assert_eq!(d.rules[0].quota.refill(), 40 * MICRO);
        let d = ask(&e, "POST", "/new-reg", "10.0.0.9", &[]);
        assert_eq!(d.rules[0].quota.refill(), 20 * MICRO);
    }

    /// Issue 13, attack 2: a client stating a tiny cost used to pass 2 000 of 2 000 requests
    /// through a burst of 20; a cost above the burst got `Retry-After: 204065720593`.
    #[test]
    fn the_client_cannot_pick_its_own_price() {
        use crate::headers::{build, HeaderConfig, JitterIdentity};
        let (e, _) = engine(json!({"rules": [
            {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 20, "cost_source": "header:x-request-weight"}}
        ]}));
        let admitted = (0..2_000)
            .filter(|_| {
                ask(
                    &e,
                    "GET",
                    "/",
                    "10.0.0.1",
                    &[("X-Request-Weight", "0.000001")],
                )
                .is_allowed()
            })
            .count();
        assert_eq!(admitted, 20);

        // Above the burst: refused without a Retry-After, nothing spent.
        let d = ask(&e, "GET", "/", "10.0.0.2", &[("X-Request-Weight", "21")]);
        assert_eq!(d.outcome, Outcome::Reject(Reason::CostExceedsLimit));
        assert_eq!(d.status(), 429);
        assert_eq!(d.retry_after, 0);
        assert_eq!(d.rules[0].tokens, 20 * MICRO);
        let r = build(&d, &JitterIdentity::default(), &HeaderConfig::default());
        assert!(
            r.headers.iter().all(|(n, _)| *n != "Retry-After"),
            "{:?}",
            r.headers
        );
        let get = |name: &str| {
            r.headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("X-Tollgate-Reason"), Some("cost_exceeds_limit"));
        assert_eq!(get("RateLimit"), Some("\"weighted\";r=20;t=0"));
        assert_eq!(get("RateLimit-Remaining"), Some("20"));
        // Exactly the burst still fits.
        assert!(ask(&e, "GET", "/", "10.0.0.2", &[("X-Request-Weight", "20")]).is_allowed());

        // An explicit max_cost below the burst, and min_cost below the default.
        let (e, _) = engine(json!({"rules": [
            {"name": "w", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 100, "cost_source": "query:w",
                                  "default_cost": 5, "min_cost": 0.5, "max_cost": 10}}
        ]}));
        assert_eq!(
            ask(&e, "GET", "/?w=0.1", "10.0.0.3", &[]).rules[0].tokens,
            99_500_000
        );
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.3", &[]).rules[0].tokens,
            94_500_000
        );
        let d = ask(&e, "GET", "/?w=10.5", "10.0.0.3", &[]);
        assert_eq!(d.outcome, Outcome::Reject(Reason::CostExceedsLimit));
        assert_eq!(d.rules[0].tokens, 94_500_000);
    }

    /// All-or-nothing: a cost that can never fit under one rule spends nothing under another.
    #[test]
    fn a_never_admissible_cost_spends_nothing_anywhere() {
        let (e, _) = engine(json!({"rules": [
            tb("plain", json!(["ip:address"]), 1.0, 50.0),
            {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 5, "cost_source": "header:x-w"}}
        ]}));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[("X-W", "6")]);
        assert_eq!(d.outcome, Outcome::Reject(Reason::CostExceedsLimit));
        assert!(d.rules.iter().all(|r| !r.committed));
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.1", &[]).rules[0].tokens,
            49 * MICRO
        );
    }

    /// Issue 13, attack 11: with two `X-Api-Key` lines tollgate limited the first while many
    /// frameworks authenticate the last.
    #[test]
    fn repeated_limit_key_headers_are_refused() {
        let (e, _) = engine(json!({"rules": [
            tb("per-key", json!(["header:x-api-key"]), 1.0, 5.0),
            {"name": "weighted", "limit_keys": [], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 100, "cost_source": "header:x-weight"}}
        ]}));
        let d = ask(
            &e,
            "GET",
            "/",
            "10.0.0.1",
            &[("X-Api-Key", "a"), ("x-api-key", "b")],
        );
        assert_eq!(d.outcome, Outcome::Reject(Reason::DuplicateHeader));
        assert_eq!(d.status(), 400);
        assert_eq!(d.rules.len(), 0, "nothing checked, nothing spent");
        let d = ask(
            &e,
            "GET",
            "/",
            "10.0.0.1",
            &[("X-Weight", "1"), ("X-Weight", "90")],
        );
        assert_eq!(d.outcome, Outcome::Reject(Reason::DuplicateHeader));
        // Repeating a header no rule reads is fine.
        assert!(ask(
            &e,
            "GET",
            "/",
            "10.0.0.1",
            &[("Accept", "a"), ("Accept", "b")]
        )
        .is_allowed());

        // A kill switch on a header sees the same value the upstream does.
        let (e, _) = engine(json!({"bundle_version": 1, "policies": [],
            "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "t-1"}]}));
        let d = ask(
            &e,
            "GET",
            "/",
            "10.0.0.1",
            &[("X-Tenant-Id", "t-2"), ("X-Tenant-Id", "t-1")],
        );
        assert_eq!(d.outcome, Outcome::Reject(Reason::DuplicateHeader));
    }

    /// Issue 13, attack 1: encoded slashes walked past kill switches (8 of 38 spellings).
    #[test]
    fn no_spelling_of_a_killed_route_gets_through() {
        let (e, _) = engine(json!({"bundle_version": 1, "policies": [],
            "kill_switches": [{"scope_key": "method", "scope_value": "GET", "route": "/api/llm"}]}));
        let spellings = [
            "/api/llm",
            "/api/llm/",
            "/api/llm/x",
            "/api/llm?q=1",
            "//api/llm",
            "/api//llm",
            "/./api/llm",
            "/api/./llm",
            "/x/../api/llm",
            "/api/x/../llm",
            "/%61pi/llm",
            "/api/%6c%6c%6d",
            "/api/%2e/llm",
            "/api/x/%2e%2e/llm",
            "/api/x/%2E%2E/llm",
            "/api%2Fllm",
            "/api%2fllm",
            "/%2Fapi/llm",
            "/%2fapi%2fllm",
            "/api/llm%2F",
            "/api/llm%2Fx",
            "/api/x%2F..%2Fllm",
            "/api/x%2F%2E%2E%2Fllm",
            "/api%2F%2Fllm",
            "/api%5Cllm",
            "/api%5cllm",
            "/api\\llm",
            "/%5Capi%5Cllm",
            "/api/x%5C..%5Cllm",
            "/api/llm%5C",
            "/api\\x\\..\\llm",
            "/%2F%2Fapi/llm",
            "/api/llm/.",
            "/api/llm/x/..",
            "/api/llm#frag",
            "/api/./x/../llm",
            "/a/../api/llm",
            "/api%2F./llm",
        ];
        assert_eq!(spellings.len(), 38);
        for path in spellings {
            let d = ask(&e, "GET", path, "10.0.0.1", &[]);
            assert_eq!(d.outcome, Outcome::Reject(Reason::KillSwitch), "{path}");
        }
        for path in ["/api/llmx", "/api", "/api%252Fllm", "/apillm", "/api/ll"] {
            assert!(ask(&e, "GET", path, "10.0.0.1", &[]).is_allowed(), "{path}");
        }
    }

    /// Issue 13, attack 6: `Host: api.example.com:abc` skipped host selectors.
    #[test]
    fn a_host_with_a_bad_port_still_matches_its_selector() {
        let (e, _) = engine(
            json!({"bundle_version": 1, "policies": [{"id": "api", "spec": {
            "selector": {"hosts": ["api.example.com"]},
            "rules": [tb("per-ip", json!(["ip:address"]), 1.0, 1.0)]}}]}),
        );
        let headers: Vec<(String, String)> = Vec::new();
        for host in [
            "api.example.com:abc",
            "API.example.com:",
            "api.example.com:443",
            "api.example.com.:x",
        ] {
            let facts = RequestFacts::from_uri(
                "GET",
                "/",
                Some(host),
                Some("10.9.0.1".parse().unwrap()),
                &headers,
            );
            assert_eq!(e.decide(&facts).rules.len(), 1, "{host}");
        }
    }

    /// Issue 13, attack 12, end to end: the /48 override reaches a client of that network.
    #[test]
    fn ipv6_network_overrides_reach_their_clients() {
        let (e, _) = engine(
            json!({"rules": [{"name": "per-ip", "limit_keys": ["ip:address"],
            "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 2,
            "overrides": [{"ids": ["2001:db8:1::/48"], "burst": 40}]}}]}),
        );
        let d = ask(&e, "GET", "/", "2001:db8:1:7::99", &[]);
        assert_eq!(d.rules[0].quota.burst(), 40 * MICRO);
        let d = ask(&e, "GET", "/", "2001:db8:2::1", &[]);
        assert_eq!(d.rules[0].quota.burst(), 2 * MICRO);
    }
}
