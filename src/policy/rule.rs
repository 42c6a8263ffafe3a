//! A bundle's compiled parts: policies and their selectors, rules (keys, conditions, costs and
//! each kind's part), guards and kill switches, with the predicates a request is matched by.

use crate::limits::limiter::Quota;
use crate::request::descriptor::{Descriptor, IpNet, RequestFacts};
use ahash::AHashMap;
use std::net::IpAddr;
use std::ops::Range;

/// Enforce or shadow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

/// One policy: a selector, a mode and its rules.
#[derive(Debug)]
pub struct Policy {
    pub id: String,
    pub selector: Selector,
    pub mode: Mode,
    /// Indices into [`Bundle::rules`](crate::policy::Bundle::rules) of the regular rules.
    pub rules: Range<usize>,
    /// Index into [`Bundle::rules`](crate::policy::Bundle::rules) of `fallback_limit`, if any.
    pub fallback: Option<usize>,
    /// Index into [`Bundle::rules`](crate::policy::Bundle::rules) of the rule `loop_detection` compiled to, if enabled.
    pub loop_detection: Option<usize>,
    /// Index into [`Bundle::rules`](crate::policy::Bundle::rules) of the rule `circuit_breaker` compiled to, if enabled.
    pub circuit_breaker: Option<usize>,
    /// The policy has a `token_bucket_llm` rule (regular or fallback).
    pub meters_tokens: bool,
    /// An enforced (not shadow) `token_bucket_llm` rule: a body too large to read is then
    /// refused; with shadow rules alone it is let through unread.
    pub enforces_tokens: bool,
}

/// Which requests a policy applies to.
#[derive(Debug, Default)]
pub struct Selector {
    /// Segment-wise prefix, stored without a trailing `/` (`/` itself matches everything).
    pub path_prefix: Option<String>,
    pub path_exact: Option<String>,
    /// Upper-case methods; `None` = all.
    pub methods: Option<Vec<String>>,
    /// Lower-case host names without port; `None` = all.
    pub hosts: Option<Vec<String>>,
    /// Envoy rate-limit domains (any case); `None` = all. A policy with `domains` applies to
    /// `ShouldRateLimit` calls only.
    pub domains: Option<Vec<String>>,
}

impl Selector {
    #[inline]
    pub fn matches(&self, facts: &RequestFacts<'_>) -> bool {
        if let Some(exact) = &self.path_exact {
            if *facts.path != **exact {
                return false;
            }
        }
        if let Some(prefix) = &self.path_prefix {
            if !path_has_prefix(&facts.path, prefix) {
                return false;
            }
        }
        if let Some(methods) = &self.methods {
            if !methods.iter().any(|m| m.eq_ignore_ascii_case(facts.method)) {
                return false;
            }
        }
        if let Some(hosts) = &self.hosts {
            match facts.host_name() {
                Some(host) if hosts.iter().any(|h| h.eq_ignore_ascii_case(host)) => {}
                _ => return false,
            }
        }
        if let Some(domains) = &self.domains {
            match facts.envoy {
                Some(e) if domains.iter().any(|d| d.eq_ignore_ascii_case(e.domain)) => {}
                _ => return false,
            }
        }
        true
    }
}

/// Segment-wise prefix test: `/api` matches `/api` and `/api/x`, never `/apix`. `prefix` has no
/// trailing slash, except the root `/`, which matches every path.
#[inline]
pub fn path_has_prefix(path: &str, prefix: &str) -> bool {
    if prefix == "/" || prefix.is_empty() {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// What to do when a rule's descriptor is missing from the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMissing {
    /// Skip the rule (fail-open; the default).
    Skip,
    /// All such requests share one bucket (the missing part is keyed as `\0missing`).
    Shared,
    /// Reject the request with 401.
    Reject,
}

/// What a rule does while the shared store it counts in does not answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Each gateway decides from its own memory with its share of the limit (the rate and
    /// burst divided by the gateways alive), and charges the store what it spent once the
    /// store answers again (the default).
    #[default]
    Local,
    /// Admitted, nothing spent (no limit while the store is away).
    Open,
    /// Refused with 503 and `Retry-After`; nothing is forwarded.
    Closed,
}

impl OnStoreError {
    /// The name in a policy and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            OnStoreError::Local => "local",
            OnStoreError::Open => "open",
            OnStoreError::Closed => "closed",
        }
    }

    /// The mode a name stands for.
    pub fn parse(name: &str) -> Option<OnStoreError> {
        match name {
            "local" => Some(OnStoreError::Local),
            "open" => Some(OnStoreError::Open),
            "closed" => Some(OnStoreError::Closed),
            _ => None,
        }
    }
}

/// Where a request's cost comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CostSource {
    /// A fixed cost in micro-tokens.
    Fixed(u64),
    /// A header (lower-case name), read as a number of tokens.
    Header { name: String, limits: CostLimits },
    /// A query parameter, read as a number of tokens.
    Query { name: String, limits: CostLimits },
    /// A header of the upstream's response (lower-case name), read as a number of tokens:
    /// `limits.default` is reserved before the request and settled to the header's value
    /// after it ([`crate::limits::response`]).
    Response { name: String, limits: CostLimits },
}

/// How a cost the client states is bounded (micro-tokens). The client may raise its price,
/// never lower it below `min`; a cost above `max` (or above the bucket's burst, which it
/// could never fit) is refused with `cost_exceeds_limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostLimits {
    /// When the value is absent, empty, not a number, not finite or not positive.
    pub default: u64,
    /// Smaller stated costs are raised to this (default: `default`).
    pub min: u64,
    /// Larger stated costs are refused; `None` = the applied quota's burst.
    pub max: Option<u64>,
}

/// One `match` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchCondition {
    pub descriptor: Descriptor,
    pub expected: MatchValue,
}

/// What a `match` value compares against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchValue {
    /// Equal as strings (header values, claims, query params...).
    Text(String),
    /// For `ip:address`: the client address inside this network (or equal to this address).
    Network(IpNet),
    /// For `llm:model`: a name with `*` standing for any run of characters.
    Pattern(String),
}

impl MatchCondition {
    /// Whether the request satisfies this condition (a missing descriptor never does).
    pub fn matches(&self, facts: &RequestFacts<'_>, default_v6_prefix: u8) -> bool {
        match (&self.expected, &self.descriptor) {
            (MatchValue::Network(net), _) => facts.client_ip.is_some_and(|ip| net.contains(ip)),
            (MatchValue::Pattern(pattern), descriptor) => descriptor
                .value(facts, default_v6_prefix)
                .is_some_and(|v| crate::limits::prices::glob_match(pattern, &v)),
            (MatchValue::Text(expected), Descriptor::Host) => facts
                .host_name()
                .is_some_and(|h| h.eq_ignore_ascii_case(expected)),
            (MatchValue::Text(expected), Descriptor::Domain) => facts
                .envoy
                .is_some_and(|e| e.domain.eq_ignore_ascii_case(expected)),
            (MatchValue::Text(expected), descriptor) => descriptor
                .value(facts, default_v6_prefix)
                .is_some_and(|v| v == expected.as_str()),
        }
    }
}

/// A compiled rule.
#[derive(Debug)]
pub struct Rule {
    /// Position in [`Bundle::rules`](crate::policy::Bundle::rules).
    pub index: usize,
    pub name: String,
    /// Index of the owning policy in [`Bundle::policies`](crate::policy::Bundle::policies).
    pub policy: usize,
    /// The owning policy's id.
    pub policy_id: String,
    pub mode: Mode,
    pub limit_keys: Vec<Descriptor>,
    pub conditions: Vec<MatchCondition>,
    pub quota: Quota,
    pub cost: CostSource,
    /// Per-ID quotas, keyed by composite key value.
    pub overrides: AHashMap<String, Quota>,
    /// For a rule keyed on the client address alone: per-network quotas, most specific first.
    /// A client inside a network gets its quota (see [`Rule::quota_for`]).
    pub ip_overrides: Vec<(IpNet, Quota)>,
    pub on_missing: OnMissing,
    /// What this rule does while a shared store is away; `None`: the gateway's
    /// `--on-store-error`.
    pub on_store_error: Option<OnStoreError>,
    /// `tb:<name>:` or `shadow:tb:<name>:`.
    pub key_prefix: String,
    /// The name as a structured-field string (`"per-ip"`), serialised at load for the
    /// `RateLimit` headers.
    pub sf_name: String,
    /// This rule's `RateLimit-Policy` item for its own quota (`"per-ip";q=15;w=2`).
    pub policy_item: String,
    /// Lower-case names of the request headers this rule reads (limit keys, `match`, cost):
    /// a request repeating one of them is refused rather than limited on a guess.
    pub header_names: Vec<String>,
    /// What kind of limit the rule is, with that kind's part: one kind, fixed by the compiler.
    pub kind: RuleKind,
    /// A `token_bucket` rule's `delay`: a burst is paced instead of refused.
    pub pacing: Option<Pacing>,
    /// Hash of what defines the rule: its JSON, and its policy's id, selector and mode (a
    /// `tokens_per_day` rule shares its minute rule's). Two bundles' rules with the same
    /// policy, name and definition count the same requests on the same keys: a candidate
    /// bundle reads such a rule's verdict from the live decision ([`crate::engine::candidate`]).
    /// 0 for the rules a policy block compiles to (guards), never shared.
    pub definition: u64,
    /// What a counting rule reads from the response: `count_when` and `penalty`
    /// ([`crate::limits::response`]); `None` for every rule without them.
    pub after_response: Option<std::sync::Arc<AfterResponse>>,
    /// A `token_bucket` rule's `burst_from`: the burst read from a verified JWT claim.
    pub burst_from: Option<Box<BurstFrom>>,
}

/// `burst_from: "jwt:<claim>"`: a request's bucket holds the burst its verified JWT claim
/// states, at most `max_burst` (the rule's `max_burst`, else its `burst`); a request without
/// the claim, or with one that is not a number of at least 1, gets the rule's own quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BurstFrom {
    /// The claim's name (dotted for a nested claim: `limits.burst`).
    pub claim: String,
    /// The most a claim may give, in micro-tokens.
    pub max_burst: u64,
}

/// A `token_bucket` rule's `delay`: how a burst is paced instead of refused (its schedule
/// and compile half: [`crate::limits::pacing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// Of a full bucket's requests, how many (in micro-tokens of cost) go through at once.
    pub immediate: u64,
    /// A request that would wait longer is refused (`None`: the time the whole burst takes to
    /// refill, which no admitted request ever waits).
    pub max_wait_us: Option<u64>,
}

/// What kind of limit a rule is, with the part only that kind has. The compiler builds it once;
/// every reader matches on it (the engine to plan, headers and metrics to describe, the
/// operator's endpoints to name a bucket's kind).
#[derive(Debug, Clone, PartialEq)]
pub enum RuleKind {
    /// `token_bucket` (and Envoy's override rule): the quota's bucket, nothing more.
    TokenBucket,
    /// `cost_based`: its window and stages (the budget is `quota.burst()`).
    Budget(crate::limits::budget_window::Budget),
    /// `concurrency`: slots instead of tokens.
    Concurrency(Concurrency),
    /// `token_bucket_llm`: its tokens-per-minute bucket, or the rule counting its
    /// `tokens_per_day` (see [`LlmPart`]).
    Llm(LlmLimit),
    /// The rule a policy's `loop_detection` or `circuit_breaker` compiled to.
    Guard(Guard),
    /// `llm_spend`: a budget in money (the quota's burst, in millionths of the price table's
    /// currency) per calendar period, reserved at the model's prices.
    Spend(SpendLimit),
}

/// An `llm_spend` rule: a request reserves the most its call can cost at its model's prices
/// (the bundle's `llm_prices`) against the budget of the period (`budget`, on the calendar of
/// its time zone), all-or-nothing with its other rules; the response's usage settles it.
#[derive(Debug, Clone, PartialEq)]
pub struct SpendLimit {
    /// The period and its calendar (one reject stage at 100 %).
    pub budget: crate::limits::budget_window::Budget,
    /// `on_exhausted.fallback_model`: the cheaper model a request is sent to when its own
    /// reservation does not fit and the fallback's does.
    pub fallback_model: Option<String>,
    /// The completion reserved is at most this.
    pub max_completion_tokens: Option<u64>,
    /// The completion reserved when the request names no `max_tokens`.
    pub default_max_completion: u64,
    pub estimator: crate::request::llm::Estimator,
}

/// A `token_bucket_llm` rule (Fairvisor's fields). The rule is the tokens-per-minute bucket
/// (`quota`: `burst_tokens`, refilled at `tokens_per_minute`); `tokens_per_day` compiles to a
/// second rule, a one-day UTC budget named `<rule>:tpd`, outside the policy's rule range and
/// always checked with its minute rule, all-or-nothing. A request costs its reservation: the
/// prompt estimate plus the completion it may produce; the response's usage settles it.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmLimit {
    pub part: LlmPart,
    /// On the minute rule: the index of its `tokens_per_day` rule.
    pub day_rule: Option<usize>,
    /// A prompt estimated above this is refused (`prompt_tokens_exceeded`).
    pub max_prompt_tokens: Option<u64>,
    /// A reservation above this is refused (`max_tokens_per_request_exceeded`).
    pub max_tokens_per_request: Option<u64>,
    /// The completion reserved is at most this (a larger `max_tokens` asks for more than the
    /// rule grants).
    pub max_completion_tokens: Option<u64>,
    /// The completion reserved when the request names no `max_tokens`.
    pub default_max_completion: u64,
    pub estimator: crate::request::llm::Estimator,
    /// `streaming`: a streamed completion past `max_completion_tokens` (and the buffer) is
    /// stopped; `None` lets it run and charges the overrun.
    pub stream_cap: Option<crate::request::llm::StreamCap>,
}

/// Which budget of a `token_bucket_llm` rule a rule counts.
#[derive(Debug, Clone, PartialEq)]
pub enum LlmPart {
    /// `tokens_per_minute` (and `burst_tokens`): a token bucket.
    Minute,
    /// `tokens_per_day`: a budget per UTC day (one window, a single reject stage at 100 %).
    Day(crate::limits::budget_window::Budget),
}

/// A policy-level guard, compiled into a rule of its own outside the policy's rule range (so
/// metrics, logs and headers name it like any rule: `loop_detection`, `circuit_breaker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// `loop_detection`: the rule's `limit_keys` are the policy's identity (every limit key of
    /// its rules); a request is identical to another when identity, method, path, sorted query
    /// and body hash agree.
    Loop(LoopDetection),
    /// `circuit_breaker`: the rule's quota is the spend-rate bucket (`threshold` per minute,
    /// burst `threshold`), its cost the policy's first rule's, its `limit_keys` that rule's.
    Breaker(Breaker),
}

/// A compiled `loop_detection` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopDetection {
    pub window_us: u64,
    /// `threshold_identical_requests`: the request that makes this many identical ones within
    /// the window is a loop (at least 2).
    pub threshold: u32,
    pub action: LoopAction,
}

/// What a detected loop does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopAction {
    /// 429 `loop_detected`.
    Reject,
    /// Delays the request (100 ms per identical request, at most 30 s), then lets it go on.
    Throttle,
    /// Lets it go on with `X-Tollgate-Warning: loop_warn`.
    Warn,
}

impl LoopDetection {
    /// The throttle delay: Fairvisor's 100 ms per identical request counted (the threshold,
    /// since counting stops there), at most 30 s.
    pub fn throttle_ms(&self) -> u64 {
        (u64::from(self.threshold) * 100).min(crate::limits::budget_window::MAX_THROTTLE_MS)
    }
}

/// A compiled `circuit_breaker` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    /// How long the breaker stays open; `None` (`auto_reset_after_minutes: 0`) keeps it open
    /// until the bundle changes (at most [`Breaker::MANUAL_OPEN_US`]).
    pub reset_us: Option<u64>,
    /// `alert`: a trip is logged at error level rather than warning.
    pub alert: bool,
}

impl Breaker {
    /// The longest a breaker without automatic reset stays open, so a forgotten one cannot pin
    /// a key in a shared store forever: 30 days.
    pub const MANUAL_OPEN_US: u64 = 30 * 86_400 * crate::limits::limiter::US_PER_SEC;

    /// How long a trip keeps the breaker open.
    pub fn open_us(&self) -> u64 {
        self.reset_us.unwrap_or(Self::MANUAL_OPEN_US)
    }
}

/// What a counting rule (token bucket, `cost_based`) reads from the upstream's response
/// ([`crate::limits::response`] compiles it and settles by it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AfterResponse {
    /// `count_when`: the request is checked against its cost before the upstream, spending
    /// nothing, and charged once its response matches.
    pub count_when: Option<CountWhen>,
    /// `penalty`: the key is blocked once it gathers enough counted events.
    pub penalty: Option<Penalty>,
}

/// Which responses a `count_when` rule charges: every condition given must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountWhen {
    /// `status`: the statuses that count (`None`: any).
    pub status: Option<StatusSet>,
    /// `response_header`: a header (lower-case name) the response must carry, any value.
    pub header: Option<String>,
}

/// A `count_when` status condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatusSet {
    /// These statuses (`[401, 403]`).
    List(Vec<u16>),
    /// A class: `4` for `"4xx"`.
    Class(u16),
}

impl StatusSet {
    /// Whether `status` is in the set.
    pub fn contains(&self, status: u16) -> bool {
        match self {
            StatusSet::List(list) => list.contains(&status),
            StatusSet::Class(class) => status / 100 == *class,
        }
    }
}

impl CountWhen {
    /// Whether a response with `status` and `headers` is counted.
    pub fn matches(
        &self,
        status: u16,
        headers: &dyn crate::request::descriptor::HeaderLookup,
    ) -> bool {
        self.status.as_ref().is_none_or(|s| s.contains(status))
            && self
                .header
                .as_ref()
                .is_none_or(|name| headers.header_bytes(name).is_some())
    }
}

/// A rule's `penalty` box: a key that gathers `after` counted events (refusals by the rule, or
/// responses its `count_when` charged) within `within_us` is refused for `block_for_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Penalty {
    pub after: u32,
    pub within_us: u64,
    pub block_for_us: u64,
}

/// A `concurrency` rule's cap: at most `max_in_flight` requests per key at once. A slot is a
/// lease that ends when the response has been sent (or the decision service's caller gives it
/// back), or at the latest `lease_ttl_us` after it was taken, so a gateway that dies never pins
/// a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    pub max_in_flight: u32,
    pub lease_ttl_us: u64,
}

/// Name of [`Bundle::envoy_override`](crate::policy::Bundle::envoy_override)'s rule; bucket names start `tb:envoy-limit-override:`.
pub const ENVOY_OVERRIDE_RULE: &str = "envoy-limit-override";

impl Rule {
    /// Whether the rule counts a gRPC call's request messages (it reads `grpc:message` in its
    /// `limit_keys` or `match`): such a rule applies to each message, and to nothing else.
    pub fn counts_grpc_messages(&self) -> bool {
        self.limit_keys.iter().any(Descriptor::reads_grpc_messages)
            || self
                .conditions
                .iter()
                .any(|c| c.descriptor.reads_grpc_messages())
    }

    /// The rule behind [`Bundle::envoy_override`](crate::policy::Bundle::envoy_override): enforced, keyed by the whole descriptor (the
    /// caller builds the key), its quota always the descriptor's override. It is outside
    /// [`Bundle::rules`](crate::policy::Bundle::rules) (its `index` is `usize::MAX`), so per-rule metrics skip it.
    pub fn envoy_override() -> Rule {
        let quota = Quota::new(
            crate::limits::limiter::MICRO,
            crate::limits::limiter::MICRO,
            1_000_000,
        )
        .unwrap_or_else(|_| unreachable!("a 1 r/s quota is valid"));
        let mut sf_name = String::new();
        push_sf_string(&mut sf_name, ENVOY_OVERRIDE_RULE);
        Rule {
            index: usize::MAX,
            name: ENVOY_OVERRIDE_RULE.to_string(),
            policy: usize::MAX,
            policy_id: "envoy".to_string(),
            mode: Mode::Enforce,
            limit_keys: vec![Descriptor::Domain, Descriptor::EntryKeys],
            conditions: Vec::new(),
            quota,
            cost: CostSource::Fixed(crate::limits::limiter::MICRO),
            overrides: AHashMap::new(),
            ip_overrides: Vec::new(),
            on_missing: OnMissing::Skip,
            on_store_error: None,
            key_prefix: format!("tb:{ENVOY_OVERRIDE_RULE}:"),
            policy_item: format!("{sf_name};q=1;w=1"),
            sf_name,
            header_names: Vec::new(),
            kind: RuleKind::TokenBucket,
            pacing: None,
            definition: 0,
            after_response: None,
            burst_from: None,
        }
    }

    /// The budget a rule counts against: a `cost_based` rule's, or a `tokens_per_day` rule's
    /// (`None` for every other kind).
    #[inline]
    pub fn budget(&self) -> Option<&crate::limits::budget_window::Budget> {
        match &self.kind {
            RuleKind::Budget(budget)
            | RuleKind::Spend(SpendLimit { budget, .. })
            | RuleKind::Llm(LlmLimit {
                part: LlmPart::Day(budget),
                ..
            }) => Some(budget),
            _ => None,
        }
    }

    /// What one unit of this rule's `RateLimit` items (`q`, `r`) is worth in the quota's
    /// micro-units: a token (a million), or for an `llm_spend` rule a millionth of the
    /// currency (1: money is shown exactly).
    #[inline]
    pub fn header_unit(&self) -> u64 {
        match self.kind {
            RuleKind::Spend(_) => 1,
            _ => crate::limits::limiter::MICRO,
        }
    }

    /// An `llm_spend` rule's part.
    #[inline]
    pub fn spend(&self) -> Option<&SpendLimit> {
        match &self.kind {
            RuleKind::Spend(limit) => Some(limit),
            _ => None,
        }
    }

    /// A `concurrency` rule's cap.
    #[inline]
    pub fn concurrency(&self) -> Option<Concurrency> {
        match self.kind {
            RuleKind::Concurrency(c) => Some(c),
            _ => None,
        }
    }

    /// The guard a policy's `loop_detection` or `circuit_breaker` compiled to.
    #[inline]
    pub fn guard(&self) -> Option<Guard> {
        match self.kind {
            RuleKind::Guard(guard) => Some(guard),
            _ => None,
        }
    }

    /// A `token_bucket_llm` rule's limits (on its minute rule and on its `tokens_per_day` rule).
    #[inline]
    pub fn llm(&self) -> Option<&LlmLimit> {
        match &self.kind {
            RuleKind::Llm(limit) => Some(limit),
            _ => None,
        }
    }

    /// The quota for a composite key under this request: the bundle's override for the key;
    /// else, under `burst_from`, the burst the request's verified claim states (bounded);
    /// else the rule's default.
    #[inline]
    pub fn quota_for_request(&self, key: &str, facts: &RequestFacts<'_>) -> Quota {
        let quota = self.quota_for(key);
        match &self.burst_from {
            // No override of the bundle's names this key.
            Some(from) if std::ptr::eq(quota, &self.quota) => from.quota(*quota, facts),
            _ => *quota,
        }
    }

    /// The quota for a composite key: its override, or the rule's default.
    ///
    /// For a rule keyed on the client address, the key is an IPv4 address or an IPv6 network
    /// (`2001:db8:1:2::/64`), and an override network applies to every key inside it. An
    /// override narrower than the key (a single IPv6 address under `/64` keys) applies to the
    /// key that contains it, so every client sharing a bucket always gets the same quota.
    pub fn quota_for(&self, key: &str) -> &Quota {
        if !self.ip_overrides.is_empty() {
            if let Some(key_net) = IpNet::parse(key) {
                let found = self.ip_overrides.iter().find(|(net, _)| {
                    if net.prefix() <= key_net.prefix() {
                        net.contains(key_net.addr())
                    } else {
                        net.with_prefix(key_net.prefix()).contains(key_net.addr())
                    }
                });
                if let Some((_, quota)) = found {
                    return quota;
                }
            }
        }
        if self.overrides.is_empty() {
            return &self.quota;
        }
        self.overrides.get(key).unwrap_or(&self.quota)
    }
}

impl BurstFrom {
    /// `quota` with the burst the request's claim states, when it states a usable one.
    #[inline(never)]
    fn quota(&self, quota: Quota, facts: &RequestFacts<'_>) -> Quota {
        let claimed = facts
            .claims
            .and_then(|_| facts.claim(&self.claim))
            .and_then(|text| text.parse::<f64>().ok())
            .filter(|burst| burst.is_finite() && *burst >= 1.0);
        let Some(burst) = claimed else {
            return quota;
        };
        let burst = crate::limits::limiter::tokens_to_micro(burst).min(self.max_burst);
        Quota::new(burst, quota.refill(), quota.period_us()).unwrap_or(quota)
    }
}

/// A kill switch: requests whose `scope` descriptor equals `value` (on `route`, if set) are
/// refused with 429 `kill_switch` until `expires_at`.
#[derive(Debug)]
pub struct KillSwitch {
    /// Shared by consecutive switches of the same scope.
    pub scope: std::sync::Arc<Descriptor>,
    pub value: Box<str>,
    /// Segment-wise path prefix, no trailing slash.
    pub route: Option<Box<str>>,
    /// Shared by every switch of the bundle giving the same reason (a block list of 100 000
    /// keys usually gives one).
    pub reason: std::sync::Arc<str>,
    /// Unix seconds; `None` = until removed.
    pub expires_at: Option<i64>,
}

impl KillSwitch {
    /// Whether this switch is in force for this request's route at `unix_secs` (whatever its
    /// scope value).
    pub fn in_force(&self, facts: &RequestFacts<'_>, unix_secs: i64) -> bool {
        self.expires_at.is_none_or(|at| unix_secs < at)
            && self
                .route
                .as_ref()
                .is_none_or(|route| path_has_prefix(&facts.path, route))
    }

    /// Whether this switch stops the request at wall-clock time `unix_secs`.
    pub fn hits(&self, facts: &RequestFacts<'_>, unix_secs: i64, default_v6_prefix: u8) -> bool {
        if !self.in_force(facts, unix_secs) {
            return false;
        }
        match (&*self.scope, facts.client_ip) {
            // An IP scope may be a network: `10.0.0.0/8` stops the whole range.
            (Descriptor::Ip { .. }, Some(ip)) => match IpNet::parse(&self.value) {
                Some(net) => net.contains(ip),
                None => self
                    .scope
                    .value(facts, default_v6_prefix)
                    .is_some_and(|v| *v == *self.value),
            },
            _ => self
                .scope
                .value(facts, default_v6_prefix)
                .is_some_and(|v| *v == *self.value),
        }
    }
}

/// Appends a rule name as a structured-field string (`"name"`): `"` and `\` escaped,
/// non-printable characters dropped (names come from operators, but a header must stay valid
/// whatever they are).
pub fn push_sf_string(out: &mut String, name: &str) {
    out.push('"');
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => {}
        }
    }
    out.push('"');
}

/// Whether an address text is an IP (used to canonicalise override IDs).
pub(crate) fn canonical_id(id: &str) -> String {
    if id.parse::<IpAddr>().is_ok() || id.contains('/') {
        if let Some(net) = IpNet::parse(id) {
            return net.canonical();
        }
    }
    id.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Whatever a rule is called, its structured-field name is printable ASCII: the
        /// `RateLimit` headers copy it (and the items made from it) onto the wire unchecked.
        #[test]
        fn a_structured_field_name_is_printable_ascii(name in "\\PC{0,40}") {
            let mut sf = String::new();
            push_sf_string(&mut sf, &name);
            proptest::prop_assert!(sf.bytes().all(|b| (b' '..=b'~').contains(&b)), "{sf:?}");
        }
    }

    #[test]
    fn path_prefix_is_segment_wise() {
        assert!(path_has_prefix("/api", "/api"));
        assert!(path_has_prefix("/api/x", "/api"));
        assert!(!path_has_prefix("/apix", "/api"));
        assert!(path_has_prefix("/anything", "/"));
        assert!(!path_has_prefix("/ap", "/api"));
    }

    #[test]
    fn override_ids_are_canonical() {
        assert_eq!(canonical_id("2001:0db8:0000::/48"), "2001:db8::/48");
        assert_eq!(canonical_id("10.0.0.2"), "10.0.0.2");
        assert_eq!(canonical_id("12345678"), "12345678");
        assert_eq!(canonical_id("2001:0db8::0001"), "2001:db8::1");
    }
}
