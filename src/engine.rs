//! The decision engine, pure: a bundle, the request's facts and the wall-clock time give a
//! [`Plan`] (kill switches, matching policies and rules, bucket keys and costs); the plan and
//! the store's answer give a [`Decision`]. No store, no clock, no I/O inside: the caller owns
//! the store call (synchronous for the embedded store, awaited for a shared one).
//!
//! A [`Decision`] borrows the bundle it was made with and carries everything headers, metrics
//! and logs need (rule and policy names, quotas, the kill switch that fired), so none of them
//! calls back into the engine.

use crate::budget::Action;
use crate::descriptor::{push_ip_key, push_key_part, Descriptor, RequestFacts};
use crate::limiter::{micro_to_tokens, tokens_to_micro, Quota, Window, US_PER_SEC};
use crate::limits::guards::{plan_guard, GuardPlan};
pub use crate::limits::llm::llm_reservation;
use crate::limits::llm::{plan_llm, LlmPlan};
use crate::policy::index::VERIFIED;
use crate::policy::{Bundle, CostSource, Guard, KillSwitch, LoopAction, Mode, OnMissing, Rule};
use crate::store::lease::{next_lease_id, LeaseOp, LeaseResults};
use crate::store::{BucketKey, BucketOp, Group, MemoryStore, OpResults, StoreError};
use smallvec::SmallVec;

/// `Retry-After` base for a kill switch without `expires_at`: it lasts until an operator lifts
/// it, so clients are told to come back in a minute rather than hammer.
pub const KILL_SWITCH_RETRY_SECS: u64 = 60;

thread_local! {
    /// Reused by every decision on this thread to build bucket names without allocating.
    pub(crate) static KEY_BUFFER: std::cell::RefCell<String> = std::cell::RefCell::new(String::with_capacity(128));
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
    /// A `cost_based` budget is spent for this window.
    BudgetExceeded,
    /// A `concurrency` rule's slots are all taken.
    ConcurrencyExceeded,
    /// `loop_detection` (action `reject`): too many identical requests within its window.
    LoopDetected,
    /// A `circuit_breaker` is open: the spend rate went over its threshold.
    CircuitBreakerOpen,
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
    /// A `token_bucket_llm` rule's tokens-per-minute bucket cannot hold the reservation now.
    TpmExceeded,
    /// A `token_bucket_llm` rule's `tokens_per_day` is spent for this UTC day.
    TpdExceeded,
    /// The prompt is estimated above the rule's `max_prompt_tokens`.
    PromptTokensExceeded,
    /// The reservation (prompt and completion) is above `max_tokens_per_request`, or above
    /// what the rule's budgets can ever hold.
    MaxTokensPerRequestExceeded,
}

impl Reason {
    /// Every reason, for pre-resolved metric counters.
    pub const ALL: [Reason; 14] = [
        Reason::TokenBucketExceeded,
        Reason::BudgetExceeded,
        Reason::ConcurrencyExceeded,
        Reason::LoopDetected,
        Reason::CircuitBreakerOpen,
        Reason::KillSwitch,
        Reason::MissingDescriptor,
        Reason::CostExceedsLimit,
        Reason::DuplicateHeader,
        Reason::EncodedSlash,
        Reason::TpmExceeded,
        Reason::TpdExceeded,
        Reason::PromptTokensExceeded,
        Reason::MaxTokensPerRequestExceeded,
    ];

    /// The value of the reason header and of the `reason` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TokenBucketExceeded => "token_bucket_exceeded",
            Reason::BudgetExceeded => "budget_exceeded",
            Reason::ConcurrencyExceeded => "concurrency_exceeded",
            Reason::LoopDetected => "loop_detected",
            Reason::CircuitBreakerOpen => "circuit_breaker_open",
            Reason::KillSwitch => "kill_switch",
            Reason::MissingDescriptor => "missing_descriptor",
            Reason::CostExceedsLimit => "cost_exceeds_limit",
            Reason::DuplicateHeader => "duplicate_header",
            Reason::EncodedSlash => "encoded_slash",
            Reason::TpmExceeded => "tpm_exceeded",
            Reason::TpdExceeded => "tpd_exceeded",
            Reason::PromptTokensExceeded => "prompt_tokens_exceeded",
            Reason::MaxTokensPerRequestExceeded => "max_tokens_per_request_exceeded",
        }
    }

    /// The HTTP status a refusal for this reason gets.
    pub fn status(self) -> u16 {
        match self {
            Reason::TokenBucketExceeded
            | Reason::BudgetExceeded
            | Reason::ConcurrencyExceeded
            | Reason::LoopDetected
            | Reason::CircuitBreakerOpen
            | Reason::KillSwitch
            | Reason::CostExceedsLimit
            | Reason::TpmExceeded
            | Reason::TpdExceeded
            | Reason::PromptTokensExceeded
            | Reason::MaxTokensPerRequestExceeded => 429,
            Reason::MissingDescriptor => 401,
            Reason::DuplicateHeader | Reason::EncodedSlash => 400,
        }
    }

    /// The body of a refusal for this reason.
    pub fn body(self) -> &'static str {
        match self {
            Reason::TokenBucketExceeded | Reason::KillSwitch => "Too Many Requests",
            Reason::ConcurrencyExceeded => {
                "Too Many Requests: too many requests of yours are in progress; retry when one has finished"
            }
            Reason::LoopDetected => {
                "Too Many Requests: the same request was repeated too often; this looks like a retry loop"
            }
            Reason::CircuitBreakerOpen => {
                "Too Many Requests: spending went over its limit and the circuit breaker is open; it closes after its reset time"
            }
            Reason::BudgetExceeded => {
                "Too Many Requests: the budget for this period is spent; it renews when the period ends"
            }
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
            // OpenAI's error shape, so SDKs report it and back off as from the API itself.
            Reason::TpmExceeded => {
                r#"{"error":{"message":"Rate limit reached: tokens per minute. Retry after the time in the Retry-After header.","type":"rate_limit_exceeded","param":null,"code":"tpm_exceeded"}}"#
            }
            Reason::TpdExceeded => {
                r#"{"error":{"message":"Rate limit reached: tokens per day. The budget renews at 00:00 UTC.","type":"rate_limit_exceeded","param":null,"code":"tpd_exceeded"}}"#
            }
            Reason::PromptTokensExceeded => {
                r#"{"error":{"message":"The prompt is longer than this API key may send in one request.","type":"rate_limit_exceeded","param":"messages","code":"prompt_tokens_exceeded"}}"#
            }
            Reason::MaxTokensPerRequestExceeded => {
                r#"{"error":{"message":"The prompt and max_tokens together ask for more tokens than one request may use; lower max_tokens or shorten the prompt.","type":"rate_limit_exceeded","param":"max_tokens","code":"max_tokens_per_request_exceeded"}}"#
            }
        }
    }

    /// The media type of [`Reason::body`]: JSON for the LLM reasons, text otherwise.
    pub fn content_type(self) -> &'static str {
        match self {
            Reason::TpmExceeded
            | Reason::TpdExceeded
            | Reason::PromptTokensExceeded
            | Reason::MaxTokensPerRequestExceeded => "application/json",
            _ => "text/plain; charset=utf-8",
        }
    }
}

/// The overall answer, without details (tests, simulate, metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Allow,
    Reject(Reason),
    /// No valid bundle is loaded: the decision service answers 503, the proxy fails open.
    NoPolicy,
}

/// What happened to one applicable rule.
#[derive(Debug, Clone)]
pub struct RuleOutcome<'b> {
    /// The rule (its name, policy, mode, cost source...).
    pub rule: &'b Rule,
    /// The bucket's identity in the store (hash of `tb:<rule>:<key>`; the readable name is
    /// rebuilt on demand by [`bucket_name`], so the hot path allocates no string).
    pub key: BucketKey,
    /// The quota applied (the rule's, or a per-ID override).
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
    /// Seconds until the cost is affordable (0 when allowed or never affordable).
    pub retry_after: u64,
    /// Seconds until the bucket is full (for a budget: until its window ends, 0 when unused).
    pub reset: u64,
    /// For a `cost_based` rule, the µs left in the window counted; 0 for a token bucket (a
    /// real window always has at least 1 µs left). One word, not the whole window: outcomes
    /// are copied on every decision.
    pub budget_ends_in_us: u64,
}

impl RuleOutcome<'_> {
    pub fn mode(&self) -> Mode {
        self.rule.mode
    }

    /// `(policy id, rule name)`.
    pub fn names(&self) -> (&str, &str) {
        (&self.rule.policy_id, &self.rule.name)
    }

    /// Tokens left as a number.
    pub fn tokens_f64(&self) -> f64 {
        micro_to_tokens(self.tokens)
    }
}

/// The rules a request was checked against.
#[derive(Debug, Clone)]
pub struct Checked<'b> {
    /// The bundle the decision was made with (for metrics tables built per bundle).
    pub bundle: &'b Bundle,
    /// Every applicable rule, enforced and shadow, in policy order.
    pub rules: SmallVec<[RuleOutcome<'b>; 4]>,
    /// A shadow rule that would have refused the request for a missing descriptor.
    pub shadow_missing: Option<&'b Rule>,
    /// The store failed and the request was allowed without limiting.
    pub store_error: bool,
    /// The strongest budget stage an enforced budget reached (throttle over warn, the longer
    /// delay first); shadow budgets never throttle or warn the client.
    pub stage: Option<Action>,
    /// What an enforced `loop_detection` with action `warn` or `throttle` found (a loop whose
    /// action is `reject` refuses instead).
    pub loop_stage: Option<Action>,
    /// Applicable `concurrency` rules, enforced and shadow, in policy order.
    /// A `Vec`: empty (no allocation) for the requests without one, and it keeps the
    /// decision small for every other request.
    pub slots: Vec<SlotOutcome<'b>>,
    /// The id the slots' leases were taken under (0: none taken).
    pub lease_id: u64,
    /// The reservations of `token_bucket_llm` rules (empty, without allocating, for every
    /// other request): settled by the response's usage.
    pub reserved: Vec<Reserved>,
}

/// One bucket a `token_bucket_llm` rule reserved tokens on.
#[derive(Debug, Clone, Copy)]
pub struct Reserved {
    /// Index of its outcome in [`Checked::rules`].
    pub outcome: usize,
    pub key: BucketKey,
    pub quota: Quota,
    /// The UTC day's window id, for a `tokens_per_day` budget.
    pub window_id: Option<u64>,
    /// Micro-tokens reserved: the prompt estimate and the completion allowed.
    pub cost: u64,
    pub group: Group,
    /// The prompt estimate, in tokens.
    pub prompt_tokens: u64,
}

/// What happened to one applicable `concurrency` rule, `loop_detection` mark or circuit
/// breaker (its open state).
#[derive(Debug, Clone)]
pub struct SlotOutcome<'b> {
    pub rule: &'b Rule,
    /// The lease set's identity in the store (hash of `cc:<rule>:<key>`, of `lp:<policy>:<key>`
    /// and the fingerprint, or of `br:<policy>:<key>|open`).
    pub key: BucketKey,
    /// A slot was free; for a loop, fewer identical requests than the threshold; for a
    /// breaker, it is closed.
    pub allowed: bool,
    /// The request holds a lease on this key (a slot to give back when it is done; a loop mark
    /// that lives out its window).
    pub committed: bool,
    /// Live leases on the key before this request (requests in flight, identical requests in
    /// the window, 1 for an open breaker).
    pub in_flight: u32,
    /// When not allowed: µs until the key's earliest lease ends (the next identical request
    /// admitted, the breaker closing).
    pub frees_in_us: u64,
}

impl<'b> SlotOutcome<'b> {
    pub(crate) fn new(rule: &'b Rule, key: BucketKey) -> Self {
        SlotOutcome {
            rule,
            key,
            allowed: true,
            committed: false,
            in_flight: 0,
            frees_in_us: 0,
        }
    }

    /// The reason this slot refuses (or would, in shadow).
    pub fn reason(&self) -> Reason {
        match self.rule.guard {
            Some(Guard::Loop(_)) => Reason::LoopDetected,
            Some(Guard::Breaker(_)) => Reason::CircuitBreakerOpen,
            None => Reason::ConcurrencyExceeded,
        }
    }
}

impl<'b> Checked<'b> {
    fn new(bundle: &'b Bundle) -> Self {
        Checked {
            bundle,
            rules: SmallVec::new(),
            shadow_missing: None,
            store_error: false,
            stage: None,
            loop_stage: None,
            slots: Vec::new(),
            lease_id: 0,
            reserved: Vec::new(),
        }
    }

    /// The concurrency slots this request holds, to give back when it is done.
    pub fn held_leases(&self) -> SmallVec<[BucketKey; 2]> {
        self.slots
            .iter()
            .filter(|s| s.committed && s.rule.concurrency.is_some())
            .map(|s| s.key)
            .collect()
    }

    /// An enforced rule other than a circuit breaker refused: a breaker refusing beside it has
    /// not tripped (the request would spend nothing anyway).
    pub fn refused_beside_breakers(&self) -> bool {
        self.rules.iter().any(|o| {
            o.rule.mode == Mode::Enforce
                && !o.allowed
                && !matches!(o.rule.guard, Some(Guard::Breaker(_)))
        })
    }

    /// Every lease this request took (slots and loop marks): all given back when it is refused.
    pub fn taken_leases(&self) -> SmallVec<[BucketKey; 2]> {
        self.slots
            .iter()
            .filter(|s| s.committed)
            .map(|s| s.key)
            .collect()
    }

    /// The delay a throttle stage (a budget's or a loop's) asks for before the request goes on
    /// (0: none); the longer of the two.
    pub fn throttle_ms(&self) -> u64 {
        let delay = |stage: Option<Action>| match stage {
            Some(Action::Throttle { delay_ms }) => delay_ms,
            _ => 0,
        };
        delay(self.stage).max(delay(self.loop_stage))
    }

    /// The warning header's value: a loop stage (`loop_warn` / `loop_throttle`), a budget stage
    /// (`budget_warn` / `budget_throttle`, as Fairvisor's `X-Fairvisor-Warning`), or both.
    pub fn warning(&self) -> Option<&'static str> {
        let budget = match self.stage {
            Some(Action::Warn) => Some("budget_warn"),
            Some(Action::Throttle { .. }) => Some("budget_throttle"),
            _ => None,
        };
        let looped = match self.loop_stage {
            Some(Action::Warn) => Some("loop_warn"),
            Some(Action::Throttle { .. }) => Some("loop_throttle"),
            _ => None,
        };
        match (looped, budget) {
            (None, b) => b,
            (l, None) => l,
            (Some("loop_warn"), Some("budget_warn")) => Some("loop_warn, budget_warn"),
            (Some("loop_warn"), Some(_)) => Some("loop_warn, budget_throttle"),
            (Some(_), Some("budget_warn")) => Some("loop_throttle, budget_warn"),
            (Some(_), Some(_)) => Some("loop_throttle, budget_throttle"),
        }
    }
}

/// An allowed request's `token_bucket_llm` reservations, detached from the bundle: what to
/// settle once the response's usage is known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reservation {
    /// Every bucket reserved on (committed).
    pub ops: SmallVec<[ReservedOp; 2]>,
    /// Each minute rule reserved on, for metrics.
    pub rules: SmallVec<[ReservedRule; 1]>,
}

/// One bucket of a [`Reservation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservedOp {
    pub key: BucketKey,
    pub quota: Quota,
    pub window_id: Option<u64>,
    /// Micro-tokens reserved.
    pub cost: u64,
}

/// A minute rule of a [`Reservation`] (metric labels are the policy and rule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedRule {
    pub policy: String,
    pub rule: String,
    pub mode: Mode,
    /// Tokens reserved.
    pub tokens: u64,
    /// The prompt estimate, in tokens.
    pub prompt_tokens: u64,
    /// The rule's `streaming` cap, when it stops streams (never on a shadow rule: shadow mode
    /// changes no response).
    pub stream_cap: Option<crate::llm::StreamCap>,
}

/// What settling a reservation did, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Settled {
    pub reserved: u64,
    pub used: u64,
    pub refunded: u64,
    pub charged_over: u64,
}

impl Reservation {
    /// What settling on `used` tokens does: the unused part refunded, an overrun charged
    /// (`used` counts at most [`crate::llm::MAX_TOKENS`]).
    pub fn settled(&self, used: u64) -> Settled {
        let used = used.min(crate::llm::MAX_TOKENS);
        let reserved = self.tokens();
        Settled {
            reserved,
            used,
            refunded: reserved.saturating_sub(used),
            charged_over: used.saturating_sub(reserved),
        }
    }

    /// The cap a streamed response is stopped at: the tightest of its enforced rules'.
    pub fn stream_cap(&self) -> Option<crate::llm::StreamCap> {
        crate::llm::StreamCap::tightest(self.rules.iter().filter_map(|r| r.stream_cap))
    }

    /// The prompt estimate the reservation was made on.
    pub fn prompt_tokens(&self) -> u64 {
        self.rules.first().map_or(0, |r| r.prompt_tokens)
    }

    /// The tokens reserved (the largest reservation of its rules).
    pub fn tokens(&self) -> u64 {
        self.rules.iter().map(|r| r.tokens).max().unwrap_or(0)
    }

    /// The settlement once `used` tokens (at most [`crate::llm::MAX_TOKENS`]) were really
    /// used: each bucket moves by `used` minus what it reserved (a refund when negative).
    pub fn adjustments(&self, used: u64) -> SmallVec<[crate::store::AdjustOp; 2]> {
        let used = used
            .min(crate::llm::MAX_TOKENS)
            .saturating_mul(crate::limiter::MICRO)
            .min(i64::MAX as u64) as i64;
        self.ops
            .iter()
            .map(|op| crate::store::AdjustOp {
                key: op.key,
                quota: op.quota,
                window_id: op.window_id,
                delta: used.saturating_sub(op.cost.min(i64::MAX as u64) as i64),
            })
            .filter(|op| op.delta != 0)
            .collect()
    }
}

/// What refused a request, beyond the buckets.
#[derive(Debug, Clone, Copy)]
pub enum Cause<'b> {
    /// One or more enforced buckets (see the rule outcomes).
    Buckets,
    KillSwitch(&'b KillSwitch),
    /// The rule whose descriptor was missing, or whose header was repeated.
    Rule(&'b Rule),
    /// The request itself, before any policy (an encoded slash).
    Request,
}

/// A refusal.
#[derive(Debug, Clone)]
pub struct Refusal<'b> {
    pub reason: Reason,
    /// `B`, the seconds the client must wait (before jitter); 0 = nothing to wait for.
    pub retry_after: u64,
    /// `retry_after` is a budget window's end: jitter may only bring it earlier, never later.
    pub retry_by_deadline: bool,
    pub cause: Cause<'b>,
    /// The rules checked (empty unless the buckets refused).
    pub checked: Option<Checked<'b>>,
}

/// The engine's answer for one request.
#[derive(Debug, Clone)]
pub enum Decision<'b> {
    /// No valid bundle is loaded.
    NoPolicy,
    Allow(Checked<'b>),
    Refuse(Refusal<'b>),
}

impl<'b> Decision<'b> {
    /// A refusal decided before any policy was looked at (a malformed request).
    pub fn refused(reason: Reason) -> Self {
        Decision::Refuse(Refusal {
            reason,
            retry_after: 0,
            retry_by_deadline: false,
            cause: Cause::Request,
            checked: None,
        })
    }

    pub fn outcome(&self) -> Outcome {
        match self {
            Decision::NoPolicy => Outcome::NoPolicy,
            Decision::Allow(_) => Outcome::Allow,
            Decision::Refuse(r) => Outcome::Reject(r.reason),
        }
    }

    pub fn is_allowed(&self) -> bool {
        !matches!(self, Decision::Refuse(_))
    }

    /// The HTTP status: 200 allow (and no policy, for the proxy), 429/401/400 refuse.
    pub fn status(&self) -> u16 {
        match self {
            Decision::NoPolicy | Decision::Allow(_) => 200,
            Decision::Refuse(r) => r.reason.status(),
        }
    }

    /// The rules checked, if any.
    pub fn checked(&self) -> Option<&Checked<'b>> {
        match self {
            Decision::NoPolicy => None,
            Decision::Allow(c) => Some(c),
            Decision::Refuse(r) => r.checked.as_ref(),
        }
    }

    /// Every applicable rule's outcome (empty when none was checked).
    pub fn rules(&self) -> &[RuleOutcome<'b>] {
        self.checked().map_or(&[], |c| c.rules.as_slice())
    }

    /// For a refusal, the seconds to wait before jitter (0: none).
    pub fn retry_after(&self) -> u64 {
        match self {
            Decision::Refuse(r) => r.retry_after,
            _ => 0,
        }
    }

    /// The store failed and the request was allowed without limiting.
    pub fn store_error(&self) -> bool {
        self.checked().is_some_and(|c| c.store_error)
    }

    /// The enforced rule that refused the request with the longest wait (a never-admissible
    /// cost first).
    pub fn rejecting_rule(&self) -> Option<&RuleOutcome<'b>> {
        self.rules()
            .iter()
            .filter(|r| r.rule.mode == Mode::Enforce && !r.allowed)
            .max_by_key(|r| (r.cost_exceeds, r.retry_after))
    }

    /// The circuit breakers this request tripped, each as the lease that opens it, with its
    /// rule; the caller takes them after the decision. A breaker trips when its spend bucket
    /// refused a request no other enforced rule refused: a request refused anyway spends
    /// nothing, so it cannot run the spend rate up.
    pub fn breaker_trips(&self) -> SmallVec<[(LeaseOp, &'b Rule); 1]> {
        let mut trips = SmallVec::new();
        let Some(checked) = self.checked() else {
            return trips;
        };
        if checked.refused_beside_breakers() {
            return trips;
        }
        for outcome in checked.rules.iter().filter(|o| !o.allowed) {
            let Some(Guard::Breaker(breaker)) = outcome.rule.guard else {
                continue;
            };
            let open = checked
                .slots
                .iter()
                .find(|s| std::ptr::eq(s.rule, outcome.rule) && s.allowed);
            if let Some(open) = open {
                trips.push((
                    LeaseOp {
                        key: open.key,
                        max: 1,
                        group: Group::Enforce,
                        ttl_us: breaker.open_us(),
                        soft: false,
                        held: false,
                    },
                    outcome.rule,
                ));
            }
        }
        trips
    }

    /// The reservations an allowed request holds on `token_bucket_llm` rules (`None`: none,
    /// or the store failed and nothing was spent).
    pub fn reservation(&self) -> Option<Reservation> {
        let Decision::Allow(checked) = self else {
            return None;
        };
        let mut reservation = Reservation::default();
        for r in &checked.reserved {
            let Some(outcome) = checked.rules.get(r.outcome) else {
                continue;
            };
            if !outcome.committed || outcome.fail_open {
                continue;
            }
            reservation.ops.push(ReservedOp {
                key: r.key,
                quota: r.quota,
                window_id: r.window_id,
                cost: r.cost,
            });
            if r.window_id.is_none() {
                reservation.rules.push(ReservedRule {
                    policy: outcome.rule.policy_id.clone(),
                    rule: outcome.rule.name.clone(),
                    mode: outcome.rule.mode,
                    tokens: r.cost / crate::limiter::MICRO,
                    prompt_tokens: r.prompt_tokens,
                    stream_cap: outcome
                        .rule
                        .llm
                        .and_then(|l| l.stream_cap)
                        .filter(|_| outcome.rule.mode == crate::policy::Mode::Enforce),
                });
            }
        }
        (!reservation.ops.is_empty()).then_some(reservation)
    }

    /// Shadow rules that would have refused.
    pub fn shadow_rejections(&self) -> impl Iterator<Item = &RuleOutcome<'b>> {
        self.rules()
            .iter()
            .filter(|r| r.rule.mode == Mode::Shadow && !r.allowed)
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
    checked: Checked<'b>,
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
            // A breaker's open state is read, never taken: open while it has a lease.
            slot.allowed = match slot.rule.guard {
                Some(Guard::Breaker(_)) => r.in_flight == 0,
                _ => r.allowed,
            };
            slot.committed = r.committed;
            slot.in_flight = r.in_flight;
            slot.frees_in_us = r.frees_in_us;
            if slot.allowed || slot.rule.mode == Mode::Shadow {
                continue;
            }
            let retry_after = match slot.rule.guard {
                Some(Guard::Loop(detection)) => match detection.action {
                    LoopAction::Reject => crate::limiter::ceil_secs(r.frees_in_us).max(1),
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
                Some(Guard::Breaker(_)) => crate::limiter::ceil_secs(r.frees_in_us).max(1),
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
    let prefix = config.ipv6_prefix;
    let unix_secs = (unix_us / US_PER_SEC).min(i64::MAX as u64) as i64;
    let bundle = bundle.in_force(unix_secs);
    let mut candidates = crate::policy::index::Candidates::new();
    if !bundle.kill_switches.is_empty() && !bundle.kill_switch_override_active(unix_secs) {
        // A kill switch on a header must see the same value the upstream will (only switches
        // in force on this route: an expired one must not turn repeats into 400s).
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
            return Plan::Done(Decision::Refuse(Refusal {
                reason: Reason::DuplicateHeader,
                retry_after: 0,
                retry_by_deadline: false,
                cause: Cause::KillSwitch(ks),
                checked: None,
            }));
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
        };
        if let Some(ks) = hit {
            let wait = ks
                .expires_at
                .map_or(KILL_SWITCH_RETRY_SECS, |at| (at - unix_secs).max(1) as u64);
            return Plan::Done(Decision::Refuse(Refusal {
                reason: Reason::KillSwitch,
                retry_after: wait,
                retry_by_deadline: false,
                cause: Cause::KillSwitch(ks),
                checked: None,
            }));
        }
    }

    // Applicable rules become outcomes right away; the store fills in the verdicts.
    let mut checked = Checked::new(bundle);
    let mut ops: SmallVec<[BucketOp; 4]> = SmallVec::new();
    let mut leases: SmallVec<[LeaseOp; 1]> = SmallVec::new();
    let mut slots: Vec<SlotOutcome<'b>> = Vec::new();
    // Rules with `on_missing: reject` whose descriptor is missing, enforced and shadow.
    let mut missing_enforce: Option<&'b Rule> = None;
    let mut missing_shadow: Option<&'b Rule> = None;
    // A rule reading a header the request repeats.
    let mut repeated: Option<&'b Rule> = None;
    // An enforced `token_bucket_llm` rule the request is too large for.
    let mut llm_refused: Option<(&'b Rule, Reason)> = None;
    let mut reserved: Vec<Reserved> = Vec::new();
    let mut selected = crate::policy::index::Candidates::new();
    if selection.indexes(bundle.policies.len()) {
        bundle.index.policies(facts, &mut selected);
    } else {
        selected.extend(0..bundle.policies.len() as u32);
    }
    let mut rule_candidates = crate::policy::index::Candidates::new();
    'policies: for &policy_index in &selected {
        let policy = &bundle.policies[policy_index as usize];
        if !policy.selector.matches(facts) {
            continue;
        }
        // A policy's guards come first; Envoy descriptors have no request to fingerprint or
        // spend to measure, so they only apply to HTTP requests.
        if facts.envoy.is_none() {
            for rule in [policy.loop_detection, policy.circuit_breaker]
                .into_iter()
                .flatten()
                .map(|i| &bundle.rules[i])
            {
                if repeats_header(rule, facts) {
                    repeated = Some(rule);
                    break 'policies;
                }
                plan_guard(
                    bundle,
                    rule,
                    facts,
                    prefix,
                    &mut GuardPlan {
                        leases: &mut leases,
                        slots: &mut slots,
                        ops: &mut ops,
                        outcomes: &mut checked.rules,
                    },
                );
            }
        }
        let mut matched_conditional = false;
        let mut consider = |rule: &'b Rule,
                            outcomes: &mut SmallVec<[RuleOutcome<'b>; 4]>,
                            ops: &mut SmallVec<[BucketOp; 4]>| {
            // The key is built in a per-thread buffer: hashed, matched against overrides, and
            // never stored.
            let found = KEY_BUFFER.with(|buffer| {
                let mut bucket = buffer.borrow_mut();
                write_bucket(rule, facts, prefix, &mut bucket).then(|| {
                    let quota = *rule.quota_for(&bucket[rule.key_prefix.len()..]);
                    (BucketKey::of(&bucket), quota)
                })
            });
            match found {
                Some((key, quota)) if rule.llm.is_some() => {
                    plan_llm(
                        bundle,
                        rule,
                        (key, quota),
                        (facts, unix_us, prefix),
                        &mut LlmPlan {
                            ops,
                            outcomes,
                            reserved: &mut reserved,
                            refused: &mut llm_refused,
                        },
                    );
                }
                Some((key, _)) if rule.concurrency.is_some() => {
                    if let Some(c) = rule.concurrency {
                        leases.push(LeaseOp {
                            key,
                            max: c.max_in_flight,
                            group: group_of(rule.mode),
                            ttl_us: c.lease_ttl_us,
                            soft: false,
                            held: true,
                        });
                        slots.push(SlotOutcome::new(rule, key));
                    }
                }
                Some((key, quota)) => {
                    let cost = cost_of(&rule.cost, facts, &quota);
                    let window = rule.budget.as_ref().map(|b| b.period.window(unix_us));
                    let (op, outcome) = planned_bucket(rule, key, quota, cost, window);
                    ops.push(op);
                    outcomes.push(outcome);
                }
                None if rule.on_missing == OnMissing::Reject => {
                    let slot = match rule.mode {
                        Mode::Enforce => &mut missing_enforce,
                        Mode::Shadow => &mut missing_shadow,
                    };
                    slot.get_or_insert(rule);
                }
                None => {}
            }
        };
        let scanned = !selection.indexes(policy.rules.len())
            || bundle
                .index
                .rules(
                    &bundle.rules,
                    policy_index as usize,
                    facts,
                    prefix,
                    &mut rule_candidates,
                )
                .is_none();
        if scanned {
            rule_candidates.clear();
            rule_candidates.extend(policy.rules.clone().map(|i| i as u32));
        }
        for &candidate in &rule_candidates {
            let rule = &bundle.rules[(candidate & !VERIFIED) as usize];
            if repeats_header(rule, facts) {
                repeated = Some(rule);
                break 'policies;
            }
            if !rule.conditions.is_empty() {
                // The condition the index compared is not asked again.
                let compared = (candidate & VERIFIED != 0)
                    .then(|| crate::policy::index::indexed_condition(rule).map(|(k, _)| k))
                    .flatten();
                if !rule
                    .conditions
                    .iter()
                    .enumerate()
                    .all(|(k, c)| Some(k) == compared || c.matches(facts, prefix))
                {
                    continue;
                }
                matched_conditional = true;
            }
            consider(rule, &mut checked.rules, &mut ops);
        }
        if let Some(fallback) = policy.fallback {
            let rule = &bundle.rules[fallback];
            if repeats_header(rule, facts) {
                repeated = Some(rule);
                break 'policies;
            }
            if !matched_conditional && rule.conditions.iter().all(|c| c.matches(facts, prefix)) {
                consider(rule, &mut checked.rules, &mut ops);
            }
        }
    }
    checked.shadow_missing = missing_shadow;

    let refuse_for = |reason: Reason, rule: &'b Rule| {
        Plan::Done(Decision::Refuse(Refusal {
            reason,
            retry_after: 0,
            retry_by_deadline: false,
            cause: Cause::Rule(rule),
            checked: None,
        }))
    };
    if let Some(rule) = repeated {
        return refuse_for(Reason::DuplicateHeader, rule);
    }
    if let Some(rule) = missing_enforce {
        return refuse_for(Reason::MissingDescriptor, rule);
    }
    if let Some((rule, reason)) = llm_refused {
        return refuse_for(reason, rule);
    }
    checked.slots = slots;
    checked.reserved = reserved;
    if ops.is_empty() && leases.is_empty() {
        return Plan::Done(Decision::Allow(checked));
    }
    Plan::Store(Pending {
        ops,
        leases,
        checked,
    })
}

/// The commit group of a rule's operations.
pub(crate) fn group_of(mode: Mode) -> Group {
    match mode {
        Mode::Enforce => Group::Enforce,
        Mode::Shadow => Group::Shadow,
    }
}

/// A rule's bucket for the store and the outcome the store's answer fills in. A cost that
/// can never fit is sent as one micro-token more than the bucket can hold: the store refuses
/// it whatever its state, and spends nothing anywhere.
pub(crate) fn planned_bucket(
    rule: &Rule,
    key: BucketKey,
    quota: Quota,
    cost: Cost,
    window: Option<Window>,
) -> (BucketOp, RuleOutcome<'_>) {
    let (cost, cost_exceeds) = match cost {
        Cost::Fits(cost) => (cost, false),
        Cost::Exceeds => (quota.burst().saturating_add(1), true),
    };
    let op = BucketOp {
        key,
        quota,
        cost,
        group: group_of(rule.mode),
        window,
    };
    let outcome = RuleOutcome {
        rule,
        key,
        quota,
        allowed: true,
        committed: false,
        fail_open: false,
        cost_exceeds,
        tokens: 0,
        retry_after: 0,
        reset: 0,
        budget_ends_in_us: window.map_or(0, |w| w.ends_in_us),
    };
    (op, outcome)
}

/// Completes a planned decision with the store's answer (one result per op, in order). A
/// store error fails open: the request is allowed, nothing was spent anywhere.
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
    let mut rejected = false;
    let mut never_admissible = false;
    for (outcome, r) in checked.rules.iter_mut().zip(results.iter()) {
        let v = r.verdict;
        if outcome.rule.mode == Mode::Enforce && !v.allowed {
            rejected = true;
            never_admissible |= outcome.cost_exceeds;
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
            _ => crate::limiter::ceil_secs(
                outcome
                    .quota
                    .time_to_gain_us(outcome.quota.burst().saturating_sub(v.available)),
            ),
        };
    }
    if never_admissible {
        return Decision::Refuse(Refusal {
            reason: Reason::CostExceedsLimit,
            retry_after: 0,
            retry_by_deadline: false,
            cause: Cause::Buckets,
            checked: Some(checked),
        });
    }
    if rejected {
        // A breaker tripped (it alone refused) refuses for as long as it stays open.
        let tripped = checked
            .rules
            .iter()
            .find_map(|r| match r.rule.guard {
                Some(Guard::Breaker(breaker)) if r.rule.mode == Mode::Enforce && !r.allowed => {
                    Some((r.rule, breaker))
                }
                _ => None,
            })
            .filter(|_| !checked.refused_beside_breakers());
        if let Some((rule, breaker)) = tripped {
            return Decision::Refuse(Refusal {
                reason: Reason::CircuitBreakerOpen,
                retry_after: breaker
                    .reset_us
                    .map_or(KILL_SWITCH_RETRY_SECS, |us| us / US_PER_SEC),
                retry_by_deadline: false,
                cause: Cause::Rule(rule),
                checked: Some(checked),
            });
        }
        // The longest wait decides: a budget's (its window's end) or a bucket's.
        // (A breaker refusing beside another rule has not tripped: it does not speak.)
        let longest = checked
            .rules
            .iter()
            .filter(|r| r.rule.mode == Mode::Enforce && !r.allowed && r.rule.guard.is_none())
            .max_by_key(|r| (r.retry_after, r.budget_ends_in_us > 0));
        let (retry_after, budget, llm) = longest.map_or((1, false, None), |r| {
            (r.retry_after, r.budget_ends_in_us > 0, r.rule.llm)
        });
        return Decision::Refuse(Refusal {
            reason: match (llm, budget) {
                (Some(l), _) if l.part == crate::policy::LlmPart::Minute => Reason::TpmExceeded,
                (Some(_), _) => Reason::TpdExceeded,
                (None, true) => Reason::BudgetExceeded,
                (None, false) => Reason::TokenBucketExceeded,
            },
            retry_after,
            retry_by_deadline: budget,
            cause: Cause::Buckets,
            checked: Some(checked),
        });
    }
    for outcome in &checked.rules {
        if let (Some(budget), Mode::Enforce, true) =
            (&outcome.rule.budget, outcome.rule.mode, outcome.committed)
        {
            let stage = budget.stage_for(outcome.quota.burst(), outcome.tokens);
            checked.stage = stronger(checked.stage, stage);
        }
    }
    Decision::Allow(checked)
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
    finish(pending, answer.map(|()| &results))
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
            finish(pending, answer.map(|()| &results))
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

/// Writes `rule`'s bucket name for this request into `bucket` (cleared first); false when a
/// descriptor is missing and the rule does not share a bucket for that case.
pub(crate) fn write_bucket(
    rule: &Rule,
    facts: &RequestFacts<'_>,
    default_v6_prefix: u8,
    bucket: &mut String,
) -> bool {
    bucket.clear();
    bucket.push_str(&rule.key_prefix);
    for (i, descriptor) in rule.limit_keys.iter().enumerate() {
        // The client address needs no escaping: write it straight into the key.
        if let (Descriptor::Ip { v6_prefix }, Some(ip)) = (descriptor, facts.client_ip) {
            if i > 0 {
                bucket.push('|');
            }
            push_ip_key(bucket, ip, v6_prefix.unwrap_or(default_v6_prefix));
            continue;
        }
        match descriptor.value(facts, default_v6_prefix) {
            Some(value) => push_key_part(bucket, i == 0, &value),
            None => match rule.on_missing {
                // `\0` cannot come out of `push_key_part` (it only escapes `|` and `\`), so the
                // shared "missing" bucket never collides with a real value.
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

/// Whether a rule reads a header that the request sent on more than one line.
fn repeats_header(rule: &Rule, facts: &RequestFacts<'_>) -> bool {
    !rule.header_names.is_empty()
        && facts.headers.repeats_any()
        && rule
            .header_names
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
pub(crate) mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use crate::limiter::MICRO;
    use crate::policy::compile_bundle;
    use crate::store::{MemoryStore, MemoryStoreConfig};
    use serde_json::json;
    use std::cell::Cell;

    /// A bundle (leaked: tests only), an embedded store and a manual clock, decided the way the
    /// gateway does.
    pub(crate) struct TestEngine {
        pub(crate) bundle: Cell<Option<&'static Bundle>>,
        pub(crate) store: MemoryStore,
        pub(crate) clock: ManualClock,
    }

    impl TestEngine {
        pub(crate) fn install(&self, bundle: Bundle) {
            self.bundle.set(Some(Box::leak(Box::new(bundle))));
        }

        pub(crate) fn decide(&self, facts: &RequestFacts<'_>) -> Decision<'static> {
            match self.bundle.get() {
                None => Decision::NoPolicy,
                Some(bundle) => decide_local(
                    bundle,
                    facts,
                    &self.store,
                    self.clock.now_us(),
                    self.clock.unix_us(),
                    EngineConfig::default(),
                ),
            }
        }
    }

    pub(crate) fn empty_engine(wall_origin: i64) -> TestEngine {
        TestEngine {
            bundle: Cell::new(None),
            store: MemoryStore::new(MemoryStoreConfig::default()),
            clock: ManualClock::new(wall_origin),
        }
    }

    pub(crate) fn engine(bundle: serde_json::Value) -> (TestEngine, ManualClock) {
        let e = empty_engine(1_800_000_000);
        e.install(compile_bundle(&bundle, "test").unwrap());
        let clock = e.clock.clone();
        (e, clock)
    }

    pub(crate) fn ask(
        e: &TestEngine,
        method: &str,
        uri: &str,
        ip: &str,
        headers: &[(&str, &str)],
    ) -> Decision<'static> {
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
    pub(crate) fn bucket(
        d: &Decision<'_>,
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
        bucket_name(d.rules()[index].rule, &facts, EngineConfig::default())
            .unwrap()
            .0
    }

    pub(crate) fn tb(
        name: &str,
        keys: serde_json::Value,
        rps: f64,
        burst: f64,
    ) -> serde_json::Value {
        json!({"name": name, "limit_keys": keys, "algorithm": "token_bucket",
               "algorithm_config": {"rps": rps, "burst": burst}})
    }

    #[test]
    fn no_bundle_means_no_policy() {
        let e = empty_engine(0);
        let headers: Vec<(String, String)> = Vec::new();
        let d = e.decide(&RequestFacts::from_uri("GET", "/", None, None, &headers));
        assert_eq!(d.outcome(), Outcome::NoPolicy);
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
        assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
        assert_eq!(d.rules().len(), 2);
        // The wide rule was refunded: 8 left, not 7.
        assert_eq!(d.rules()[0].tokens, 8 * MICRO);
        assert!(!d.rules()[0].committed);
        assert_eq!(d.retry_after(), 1);
        // A path outside /fills only meets the wide rule.
        let d = ask(&e, "GET", "/fillsx", "10.0.0.1", &[]);
        assert!(d.is_allowed());
        assert_eq!(d.rules().len(), 1);
        assert_eq!(d.rules()[0].tokens, 7 * MICRO);
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
        assert_eq!(bucket(&d, 0, "10.0.0.1", &[]), "shadow:tb:per-ip:10.0.0.1");
        assert_eq!(d.rules()[0].key, BucketKey::of("shadow:tb:per-ip:10.0.0.1"));
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
        assert_eq!(d.rules().len(), 1);
        assert_eq!(d.rules()[0].names(), ("tiers", "enterprise"));
        let d = ask(&e, "GET", "/", "10.9.9.9", &[("x-api-key", "k1")]);
        assert_eq!(d.rules()[0].names().1, "office");
        let d = ask(
            &e,
            "GET",
            "/",
            "192.0.2.1",
            &[("x-api-key", "k2"), ("x-plan", "free")],
        );
        assert_eq!(d.rules()[0].names().1, "free");
        assert_eq!(
            bucket(&d, 0, "192.0.2.1", &[("x-api-key", "k2")]),
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
        assert_eq!(d.rules().len(), 1);
        assert_eq!(bucket(&d, 0, "10.0.0.1", &[]), "tb:shared:\\0");
        assert_eq!(d.rules()[0].key, BucketKey::of("tb:shared:\\0"));
        // Every key-less request shares that one bucket.
        assert!(!ask(&e, "GET", "/", "10.0.0.2", &[]).is_allowed());
        let mut reject = tb("need-key", json!(["header:x-api-key"]), 1.0, 1.0);
        reject["on_missing"] = json!("reject");
        let (e, _) = engine(json!({"rules": [reject]}));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::MissingDescriptor));
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
        assert_eq!(d.outcome(), Outcome::Reject(Reason::KillSwitch));
        assert_eq!(d.retry_after(), 10);
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

    pub(crate) fn budget(
        name: &str,
        budget: f64,
        period: &str,
        stages: serde_json::Value,
    ) -> serde_json::Value {
        json!({"name": name, "limit_keys": ["header:x-api-key"], "on_missing": "shared",
               "algorithm": "cost_based",
               "algorithm_config": {"budget": budget, "period": period, "cost_key": "header:x_cost",
                                    "staged_actions": stages}})
    }

    pub(crate) fn ask_llm(
        e: &TestEngine,
        body: &str,
        headers: &[(&str, &str)],
    ) -> Decision<'static> {
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let llm = crate::llm::LlmRequest::parse(body.as_bytes());
        let facts = RequestFacts::from_uri(
            "POST",
            "/v1/chat/completions",
            Some("api.example.com"),
            Some("10.0.0.1".parse().unwrap()),
            &headers,
        )
        .with_llm(Some(&llm));
        e.decide(&facts)
    }

    pub(crate) fn guarded(
        loop_detection: serde_json::Value,
        circuit_breaker: serde_json::Value,
        rules: serde_json::Value,
    ) -> serde_json::Value {
        json!({"bundle_version": 1, "policies": [{"id": "agents", "spec": {
            "rules": rules, "loop_detection": loop_detection, "circuit_breaker": circuit_breaker}}]})
    }

    pub(crate) fn reason_of(d: &Decision<'_>) -> Option<&'static str> {
        match d {
            Decision::Refuse(r) => Some(r.reason.as_str()),
            _ => None,
        }
    }

    #[test]
    fn global_shadow_and_kill_switch_override_expire_by_themselves() {
        // Both end 10 s after the clock's wall origin (2027-01-15T08:00:00Z).
        let (e, clock) = engine(json!({"bundle_version": 1,
            "global_shadow": {"enabled": true, "reason": "incident 7", "expires_at": "2027-01-15T08:00:10Z"},
            "kill_switch_override": {"enabled": true, "reason": "incident 7", "expires_at": "2027-01-15T08:00:05Z"},
            "kill_switches": [{"scope_key": "ip:address", "scope_value": "10.0.0.9"}],
            "policies": [{"id": "p", "spec": {"rules": [tb("per-ip", json!(["ip:address"]), 1.0, 1.0)]}}]}));
        assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert!(d.is_allowed());
        assert_eq!(d.shadow_rejections().count(), 1);
        assert_eq!(bucket(&d, 0, "10.0.0.1", &[]), "shadow:tb:per-ip:10.0.0.1");
        assert!(ask(&e, "GET", "/", "10.0.0.9", &[]).is_allowed());
        clock.set_secs(5.0);
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.9", &[]).outcome(),
            Outcome::Reject(Reason::KillSwitch)
        );
        // At 10 s the policy enforces again, on its own (never spent) bucket.
        clock.set_secs(10.0);
        assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
        let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
    }

    #[test]
    fn variable_cost_from_header_and_query_with_fallback() {
        let (e, _) = engine(json!({"rules": [
            {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 10, "cost_source": "header:x-weight", "default_cost": 2}}
        ]}));
        let d = ask(&e, "GET", "/", "10.0.0.1", &[("X-Weight", "5")]);
        assert_eq!(d.rules()[0].tokens, 5 * MICRO);
        for (i, bad) in ["", "abc", "-3", "0", "NaN", "inf"].into_iter().enumerate() {
            let ip = format!("10.0.1.{i}");
            let before = ask(&e, "GET", "/", &ip, &[]).rules()[0].tokens;
            let after = ask(&e, "GET", "/", &ip, &[("X-Weight", bad)]).rules()[0].tokens;
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
            ask(&e, "GET", "/x?cost=2.5", "10.0.0.1", &[]).rules()[0].tokens,
            7_500_000
        );
        assert_eq!(
            ask(&e, "GET", "/x", "10.0.0.1", &[]).rules()[0].tokens,
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
            ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
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
            ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
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
        assert_eq!(d.rules()[0].quota.refill(), 40 * MICRO);
        let d = ask(&e, "POST", "/new-reg", "10.0.0.9", &[]);
        assert_eq!(d.rules()[0].quota.refill(), 20 * MICRO);
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
        assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
        assert_eq!(d.status(), 429);
        assert_eq!(d.retry_after(), 0);
        assert_eq!(d.rules()[0].tokens, 20 * MICRO);
        let r = build(&d, &JitterIdentity::default(), &HeaderConfig::default());
        assert!(
            r.headers.iter().all(|(n, _)| n != "retry-after"),
            "{:?}",
            r.headers
        );
        let get = |name: &str| {
            r.headers
                .iter()
                .find(|(n, _)| n.as_str().eq_ignore_ascii_case(name))
                .and_then(|(_, v)| v.to_str().ok())
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
            ask(&e, "GET", "/?w=0.1", "10.0.0.3", &[]).rules()[0].tokens,
            99_500_000
        );
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.3", &[]).rules()[0].tokens,
            94_500_000
        );
        let d = ask(&e, "GET", "/?w=10.5", "10.0.0.3", &[]);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
        assert_eq!(d.rules()[0].tokens, 94_500_000);
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
        assert_eq!(d.outcome(), Outcome::Reject(Reason::CostExceedsLimit));
        assert!(d.rules().iter().all(|r| !r.committed));
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
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
        assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
        assert_eq!(d.status(), 400);
        assert_eq!(d.rules().len(), 0, "nothing checked, nothing spent");
        let d = ask(
            &e,
            "GET",
            "/",
            "10.0.0.1",
            &[("X-Weight", "1"), ("X-Weight", "90")],
        );
        assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
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
        assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
        // Not on a switch's route, or past its expiry: repeats are the upstream's business.
        let (e, _) = engine(json!({"bundle_version": 1, "policies": [],
            "kill_switches": [{"scope_key": "header:x-tenant-id", "scope_value": "t-1", "route": "/llm"},
                              {"scope_key": "header:x-org", "scope_value": "o", "expires_at": "2020-01-01T00:00:00Z"}]}));
        let twice = [
            ("X-Tenant-Id", "a"),
            ("X-Tenant-Id", "b"),
            ("X-Org", "a"),
            ("X-Org", "b"),
        ];
        assert!(ask(&e, "GET", "/other", "10.0.0.1", &twice).is_allowed());
        let d = ask(&e, "GET", "/llm/x", "10.0.0.1", &twice);
        assert_eq!(d.outcome(), Outcome::Reject(Reason::DuplicateHeader));
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
            assert_eq!(d.outcome(), Outcome::Reject(Reason::KillSwitch), "{path}");
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
            assert_eq!(e.decide(&facts).rules().len(), 1, "{host}");
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
        assert_eq!(d.rules()[0].quota.burst(), 40 * MICRO);
        let d = ask(&e, "GET", "/", "2001:db8:2::1", &[]);
        assert_eq!(d.rules()[0].quota.burst(), 2 * MICRO);
    }

    /// A plan, written out in full (every op, lease, outcome and refusal, with the rules they
    /// name), for comparing two ways of planning.
    fn digest(plan: &Plan<'_>) -> String {
        match plan {
            Plan::Done(d) => format!("done {d:?}"),
            Plan::Store(p) => format!("store {:?} {:?} {:?}", p.ops, p.leases, p.checked),
        }
    }

    mod differential {
        use super::*;
        use proptest::prelude::*;

        const HOSTS: &[&str] = &["a.example", "B.example", "c.example:8443"];
        const PREFIXES: &[&str] = &["/", "/api", "/api/v1", "/x", "/api//v1"];
        const EXACT: &[&str] = &["/api", "/api/v1/x", "/"];
        const METHODS: &[&str] = &["GET", "post", "DELETE"];
        const TIERS: &[&str] = &["gold", "silver", "bronze"];
        const KEYS: &[&str] = &["k1", "k2", "k|3"];
        const NETS: &[&str] = &[
            "10.0.0.0/8",
            "10.1.2.3",
            "2001:db8::/32",
            "192.0.2.0/24",
            "::ffff:10.0.0.1",
        ];

        fn selector() -> impl Strategy<Value = serde_json::Value> {
            (
                proptest::option::of(proptest::sample::subsequence(HOSTS, 1..3)),
                proptest::option::of(proptest::sample::select(PREFIXES)),
                proptest::option::of(proptest::sample::select(EXACT)),
                proptest::option::of(proptest::sample::subsequence(METHODS, 1..3)),
            )
                .prop_map(|(hosts, prefix, exact, methods)| {
                    let mut s = serde_json::Map::new();
                    if let Some(h) = hosts {
                        s.insert("hosts".into(), json!(h));
                    }
                    if let Some(p) = prefix {
                        s.insert("pathPrefix".into(), json!(p));
                    }
                    if let Some(e) = exact {
                        s.insert("pathExact".into(), json!(e));
                    }
                    if let Some(m) = methods {
                        s.insert("methods".into(), json!(m));
                    }
                    serde_json::Value::Object(s)
                })
        }

        fn condition() -> impl Strategy<Value = Option<serde_json::Value>> {
            prop_oneof![
                Just(None),
                proptest::sample::select(TIERS).prop_map(|t| Some(json!({"header:x-tier": t}))),
                proptest::sample::select(TIERS)
                    .prop_map(|t| Some(json!({"header:x-tier": t, "method": "GET"}))),
                proptest::sample::select(NETS).prop_map(|n| Some(json!({"ip:address": n}))),
                proptest::sample::select(HOSTS).prop_map(|h| Some(json!({"host": h}))),
                proptest::sample::select(KEYS).prop_map(|k| Some(json!({"query:k": k}))),
            ]
        }

        fn rule(name: String) -> impl Strategy<Value = serde_json::Value> {
            (condition(), proptest::sample::select(&["ip:address", "header:x-api-key", "header:x-tier"][..]), 1u32..4)
                .prop_map(move |(cond, key, burst)| {
                    let mut r = json!({"name": name, "limit_keys": [key], "algorithm": "token_bucket",
                        "algorithm_config": {"rps": 1, "burst": burst}});
                    if let Some(c) = cond {
                        r["match"] = c;
                    }
                    r
                })
        }

        fn policy(p: usize) -> impl Strategy<Value = serde_json::Value> {
            (
                selector(),
                proptest::collection::vec(0u8..1, 0..5),
                any::<bool>(),
                any::<bool>(),
            )
                .prop_flat_map(move |(selector, rules, fallback, shadow)| {
                    let rules: Vec<_> = (0..rules.len())
                        .map(|r| rule(format!("p{p}r{r}")))
                        .collect();
                    (
                        Just(selector),
                        rules,
                        Just(fallback),
                        Just(shadow),
                        rule(format!("p{p}fb")),
                    )
                })
                .prop_map(move |(selector, rules, fallback, shadow, fb)| {
                    let mut spec = json!({"selector": selector, "rules": rules});
                    if fallback {
                        spec["fallback_limit"] = fb;
                    }
                    if shadow {
                        spec["mode"] = json!("shadow");
                    }
                    json!({"id": format!("p{p}"), "spec": spec})
                })
        }

        fn kill_switch() -> impl Strategy<Value = serde_json::Value> {
            (
                prop_oneof![
                    proptest::sample::select(KEYS).prop_map(|k| ("header:x-api-key", k)),
                    proptest::sample::select(NETS).prop_map(|n| ("ip:address", n)),
                    proptest::sample::select(&["not-an-address", "10.0.0.0/99"][..])
                        .prop_map(|v| ("ip:address", v)),
                    proptest::sample::select(EXACT).prop_map(|p| ("path", p)),
                    proptest::sample::select(TIERS).prop_map(|t| ("header:x-tier", t)),
                ],
                proptest::option::of(proptest::sample::select(PREFIXES)),
                any::<bool>(),
            )
                .prop_map(|((scope, value), route, expired)| {
                    let mut ks = json!({"scope_key": scope, "scope_value": value, "reason": "r"});
                    if let Some(r) = route {
                        ks["route"] = json!(r);
                    }
                    // The clock's wall origin is 2027-01-15T08:00:00Z.
                    ks["expires_at"] = json!(if expired {
                        "2027-01-15T07:00:00Z"
                    } else {
                        "2027-02-01T00:00:00Z"
                    });
                    ks
                })
        }

        fn bundle() -> impl Strategy<Value = serde_json::Value> {
            (1usize..7, proptest::collection::vec(kill_switch(), 0..5)).prop_flat_map(
                |(n, switches)| {
                    let policies: Vec<_> = (0..n).map(policy).collect();
                    (policies, Just(switches)).prop_map(|(policies, switches)| {
                    json!({"bundle_version": 1, "policies": policies, "kill_switches": switches})
                })
                },
            )
        }

        #[derive(Debug, Clone)]
        struct Request {
            method: &'static str,
            uri: String,
            host: Option<&'static str>,
            ip: Option<&'static str>,
            headers: Vec<(String, String)>,
        }

        fn request() -> impl Strategy<Value = Request> {
            (
                proptest::sample::select(&["GET", "POST", "get", "DELETE", "PUT"][..]),
                proptest::sample::select(
                    &[
                        "/",
                        "/api",
                        "/api/v1",
                        "/api/v1/x",
                        "/apix",
                        "/x/y",
                        "/api//v1/z",
                        "api",
                        "/API",
                    ][..],
                ),
                proptest::option::of(proptest::sample::select(KEYS)),
                proptest::option::of(proptest::sample::select(
                    &[
                        "a.example",
                        "A.EXAMPLE",
                        "b.example:443",
                        "c.example",
                        "c.example.",
                        "z.example",
                    ][..],
                )),
                proptest::option::of(proptest::sample::select(
                    &[
                        "10.1.2.3",
                        "10.0.0.1",
                        "192.0.2.77",
                        "2001:db8::1",
                        "::ffff:10.0.0.1",
                        "203.0.113.9",
                    ][..],
                )),
                proptest::collection::vec(
                    (
                        proptest::sample::select(&["x-tier", "x-api-key", "X-Tier"][..]),
                        proptest::sample::select(&["gold", "silver", "k1", "k2", "k|3"][..]),
                    ),
                    0..4,
                ),
            )
                .prop_map(|(method, path, k, host, ip, headers)| Request {
                    method,
                    uri: match k {
                        Some(k) => format!("{path}?k={k}"),
                        None => path.to_string(),
                    },
                    host,
                    ip,
                    headers: headers
                        .into_iter()
                        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_string()))
                        .collect(),
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(400))]

            /// Issue 28: the indexed selection plans exactly what trying every policy, rule and
            /// kill switch in turn plans, on random bundles and requests.
            #[test]
            fn indexed_selection_plans_what_a_scan_plans(
                bundle in bundle(),
                requests in proptest::collection::vec(request(), 1..12),
            ) {
                let compiled = compile_bundle(&bundle, "test").unwrap();
                let clock = ManualClock::new(1_800_000_000);
                for r in &requests {
                    let facts = RequestFacts::from_uri(
                        r.method,
                        &r.uri,
                        r.host,
                        r.ip.map(|ip| ip.parse().unwrap()),
                        &r.headers,
                    );
                    let config = EngineConfig::default();
                    let indexed = plan_with(&compiled, &facts, clock.unix_us(), config, Selection::IndexedAlways);
                    let scanned = plan_with(&compiled, &facts, clock.unix_us(), config, Selection::Scan);
                    prop_assert_eq!(digest(&indexed), digest(&scanned), "request {:?}", r);
                }
            }
        }
    }
}
