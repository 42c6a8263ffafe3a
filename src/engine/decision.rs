//! What the engine decided: a [`Decision`] (no policy, allowed with the rules it was checked
//! against, or refused with its [`Reason`] and [`Cause`]), each rule's and slot's outcome, and
//! the `token_bucket_llm` reservations an allowed request carries away. It borrows the bundle
//! it was made with and carries everything its consumers need (names, quotas, the kill switch
//! that fired).

use crate::limits::budget_window::Action;
use crate::limits::limiter::{micro_to_tokens, Quota};
use crate::policy::bundle::Bundle;
use crate::policy::rule::{Guard, KillSwitch, Mode, Rule, RuleKind};
use crate::request::descriptor::RequestFacts;
use crate::store::lease::LeaseOp;
use crate::store::{BucketKey, Group};
use smallvec::SmallVec;
use std::net::IpAddr;

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
    /// The method, the request target or the `Host` is not of a shape every upstream reads
    /// the same way ([`crate::request::syntax`]).
    MalformedRequest,
    /// A `token_bucket_llm` rule's tokens-per-minute bucket cannot hold the reservation now.
    TpmExceeded,
    /// A `token_bucket_llm` rule's `tokens_per_day` is spent for this UTC day.
    TpdExceeded,
    /// The prompt is estimated above the rule's `max_prompt_tokens`.
    PromptTokensExceeded,
    /// The reservation (prompt and completion) is above `max_tokens_per_request`, or above
    /// what the rule's budgets can ever hold.
    MaxTokensPerRequestExceeded,
    /// A rule with `on_store_error: closed` could not be checked: the shared store did not
    /// answer.
    StoreUnavailable,
    /// An `llm_spend` rule's budget for this period cannot hold the call's reservation (its
    /// label is `budget_exceeded`, as a `cost_based` budget's; its body OpenAI's error shape).
    SpendExceeded,
    /// An `llm_spend` rule found the request's model in no entry of the price table, which
    /// refuses unknown models.
    UnknownModel,
    /// The key is in a rule's penalty box: it gathered the rule's `penalty.after` counted
    /// events within `penalty.within`, and stays refused until `block_for` has passed.
    Penalty,
}

impl Reason {
    /// Every reason, for pre-resolved metric counters.
    pub const ALL: [Reason; 19] = [
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
        Reason::MalformedRequest,
        Reason::TpmExceeded,
        Reason::TpdExceeded,
        Reason::PromptTokensExceeded,
        Reason::MaxTokensPerRequestExceeded,
        Reason::StoreUnavailable,
        Reason::SpendExceeded,
        Reason::UnknownModel,
        Reason::Penalty,
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
            Reason::MalformedRequest => "malformed_request",
            Reason::TpmExceeded => "tpm_exceeded",
            Reason::TpdExceeded => "tpd_exceeded",
            Reason::PromptTokensExceeded => "prompt_tokens_exceeded",
            Reason::MaxTokensPerRequestExceeded => "max_tokens_per_request_exceeded",
            Reason::StoreUnavailable => "store_unavailable",
            Reason::SpendExceeded => "budget_exceeded",
            Reason::UnknownModel => "unknown_model",
            Reason::Penalty => "penalty",
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
            | Reason::MaxTokensPerRequestExceeded
            | Reason::SpendExceeded
            | Reason::UnknownModel => 429,
            Reason::Penalty => 429,
            Reason::MissingDescriptor => 401,
            Reason::DuplicateHeader | Reason::EncodedSlash | Reason::MalformedRequest => 400,
            Reason::StoreUnavailable => 503,
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
            Reason::MalformedRequest => {
                "Bad Request: the method must be an upper-case token, the target start with /, and the Host be host[:port]"
            }
            Reason::Penalty => {
                "Too Many Requests: this client is blocked for a while after too many counted attempts; retry after the time in the Retry-After header"
            }
            Reason::StoreUnavailable => {
                "Service Unavailable: the rate-limit store is not answering and this limit admits nothing without it; retry shortly"
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
            Reason::SpendExceeded => {
                r#"{"error":{"message":"The spending budget for this period cannot cover this request. It renews at the time in the Retry-After header.","type":"rate_limit_exceeded","param":null,"code":"budget_exceeded"}}"#
            }
            Reason::UnknownModel => {
                r#"{"error":{"message":"This gateway has no price for the model this request names, and refuses models it cannot price.","type":"invalid_request_error","param":"model","code":"unknown_model"}}"#
            }
        }
    }

    /// The media type of [`Reason::body`]: JSON for the LLM reasons, text otherwise.
    pub fn content_type(self) -> &'static str {
        match self {
            Reason::TpmExceeded
            | Reason::TpdExceeded
            | Reason::PromptTokensExceeded
            | Reason::MaxTokensPerRequestExceeded
            | Reason::SpendExceeded
            | Reason::UnknownModel => "application/json",
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
    /// rebuilt on demand by [`crate::engine::bucket_name`], so the hot path allocates no string).
    pub key: BucketKey,
    /// The quota applied (the rule's, or a per-ID override).
    pub quota: Quota,
    pub allowed: bool,
    /// Tokens were spent from this bucket.
    pub committed: bool,
    /// The store could not hold the bucket: allowed untracked.
    pub fail_open: bool,
    /// `Some` when the shared store did not answer and the rule's `on_store_error` decided
    /// instead (`Local`: from this gateway's share).
    pub away: Option<crate::policy::rule::OnStoreError>,
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
///
/// Always boxed (`Checked::new`): at about 500 bytes (four rule outcomes inline) it was
/// copied whole each time the plan, the store's answer and the decision passed it on, about
/// 500 instructions of `memcpy` and a hundred data-cache write misses a request; one
/// allocation costs less.
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
    /// What rules reading the response (`count_when`, a response-priced cost) are owed once
    /// it is known (empty, without allocating, for every other request).
    pub owed: Vec<Owed>,
    /// A paced request's wait and spent tokens (`delay` rules; `None`, without allocating, for
    /// every other request). On a refusal: the tokens to give back.
    pub paced: Option<Box<Paced>>,
}

/// One bucket of a rule that reads the response ([`crate::limits::response`]): what was
/// reserved before the upstream, and the request's cost a matching response is charged.
#[derive(Debug, Clone, Copy)]
pub struct Owed {
    /// Index of its outcome in [`Checked::rules`].
    pub outcome: usize,
    pub key: BucketKey,
    pub quota: Quota,
    /// The window id, for a `cost_based` budget.
    pub window_id: Option<u64>,
    /// Micro-tokens spent before the upstream: 0 for `count_when` (a probe), `default_cost`
    /// for a response-priced cost.
    pub reserved: u64,
    /// Micro-tokens the request costs (the probe's, or the reservation's).
    pub cost: u64,
    pub group: Group,
}

/// A paced request's wait (a `delay` rule, see [`crate::engine::pacing`]), and the tokens it holds meanwhile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paced {
    /// Microseconds to wait before going on: the longest of its paced rules' waits.
    pub wait_us: u64,
    /// Index (in [`Checked::rules`]) of the rule with that wait.
    pub rule: usize,
    /// Every enforced bucket the request spent on, with the index of its outcome: refunded
    /// together when the request is refused after all or its client goes away while waiting
    /// (all or nothing, as it was spent).
    pub refund: SmallVec<[(usize, crate::store::AdjustOp); 2]>,
}

impl Paced {
    /// The store operations giving the tokens back.
    pub fn refund_ops(&self) -> SmallVec<[crate::store::AdjustOp; 2]> {
        self.refund.iter().map(|(_, op)| *op).collect()
    }
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
    /// For an `llm_spend` rule: the money reserved (`cost`, in millionths) is for this model's
    /// prices.
    pub spend: Option<SpendPrice>,
}

/// The prices an `llm_spend` reservation was made at: the model's, with its label in the price
/// table (bounded metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpendPrice {
    pub price: crate::limits::prices::Price,
    pub label: crate::limits::prices::PriceLabel,
}

/// What a call really used, for settling `llm_spend` reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spent {
    /// Not known (a body that could not be read, a reservation nobody settled): the
    /// reservation stays charged whole.
    AsReserved,
    /// These tokens, at the reservation's prices (an error status or a request that never
    /// left: none).
    Tokens(crate::request::llm::BilledTokens),
}

/// One `llm_spend` budget of a [`Reservation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpendOp {
    pub key: BucketKey,
    pub quota: Quota,
    pub window_id: u64,
    /// Millionths reserved.
    pub cost: u64,
    pub price: SpendPrice,
    pub policy: String,
    pub rule: String,
    /// The priced model's label (the price table entry's pattern, or `other`).
    pub model: String,
    pub mode: Mode,
}

/// What one `llm_spend` budget was charged once settled, in millionths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SpendSettled {
    pub reserved: u64,
    pub charged: u64,
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
    /// `Some` when the shared store did not answer and the rule's `on_store_error` decided.
    pub away: Option<crate::policy::rule::OnStoreError>,
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
            away: None,
        }
    }

    /// A penalty box's block, read before the rule's bucket.
    pub fn is_penalty(&self) -> bool {
        matches!(self.rule.kind, RuleKind::TokenBucket | RuleKind::Budget(_))
    }

    /// The reason this slot refuses (or would, in shadow).
    pub fn reason(&self) -> Reason {
        match self.rule.guard() {
            Some(Guard::Loop(_)) => Reason::LoopDetected,
            Some(Guard::Breaker(_)) => Reason::CircuitBreakerOpen,
            None if self.is_penalty() => Reason::Penalty,
            None => Reason::ConcurrencyExceeded,
        }
    }
}

impl<'b> Checked<'b> {
    pub(crate) fn new(bundle: &'b Bundle) -> Box<Self> {
        Box::new(Checked {
            bundle,
            rules: SmallVec::new(),
            shadow_missing: None,
            store_error: false,
            stage: None,
            loop_stage: None,
            slots: Vec::new(),
            lease_id: 0,
            reserved: Vec::new(),
            owed: Vec::new(),
            paced: None,
        })
    }

    /// The concurrency slots this request holds, to give back when it is done.
    pub fn held_leases(&self) -> SmallVec<[BucketKey; 2]> {
        self.slots
            .iter()
            .filter(|s| s.committed && matches!(s.rule.kind, RuleKind::Concurrency(_)))
            .map(|s| s.key)
            .collect()
    }

    /// An enforced rule other than a circuit breaker refused: a breaker refusing beside it has
    /// not tripped (the request would spend nothing anyway).
    pub fn refused_beside_breakers(&self) -> bool {
        self.rules.iter().any(|o| {
            o.rule.mode == Mode::Enforce
                && !o.allowed
                && !matches!(o.rule.kind, RuleKind::Guard(Guard::Breaker(_)))
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
        let budget = budget_warning(self.stage);
        let looped = loop_warning(self.loop_stage);
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

/// The warning header's word for an enforced budget's stage (Fairvisor's
/// `X-Fairvisor-Warning` values).
fn budget_warning(stage: Option<Action>) -> Option<&'static str> {
    match stage {
        Some(Action::Warn) => Some("budget_warn"),
        Some(Action::Throttle { .. }) => Some("budget_throttle"),
        _ => None,
    }
}

/// The warning header's word for what an enforced `loop_detection` with action `warn` or
/// `throttle` found.
fn loop_warning(stage: Option<Action>) -> Option<&'static str> {
    match stage {
        Some(Action::Warn) => Some("loop_warn"),
        Some(Action::Throttle { .. }) => Some("loop_throttle"),
        _ => None,
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
    /// Every `llm_spend` budget reserved on (committed). A `Vec`: empty, it allocates nothing
    /// and keeps every answer small (answers are moved on every request).
    pub spend: Vec<SpendOp>,
    /// The prompt estimate, in tokens, when no `token_bucket_llm` rule reserved (an
    /// `llm_spend` rule alone).
    pub spend_prompt_tokens: u64,
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
    pub stream_cap: Option<crate::request::llm::StreamCap>,
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
    /// (`used` counts at most [`crate::request::llm::MAX_TOKENS`]).
    pub fn settled(&self, used: u64) -> Settled {
        let used = used.min(crate::request::llm::MAX_TOKENS);
        let reserved = self.tokens();
        Settled {
            reserved,
            used,
            refunded: reserved.saturating_sub(used),
            charged_over: used.saturating_sub(reserved),
        }
    }

    /// The cap a streamed response is stopped at: the tightest of its enforced rules'.
    pub fn stream_cap(&self) -> Option<crate::request::llm::StreamCap> {
        crate::request::llm::StreamCap::tightest(self.rules.iter().filter_map(|r| r.stream_cap))
    }

    /// The prompt estimate the reservation was made on.
    pub fn prompt_tokens(&self) -> u64 {
        self.rules
            .first()
            .map_or(self.spend_prompt_tokens, |r| r.prompt_tokens)
    }

    /// What each `llm_spend` budget is charged once the call used `spent` (a cost past the
    /// reservation is charged too: the budget then admits nothing more until it renews).
    pub fn spend_settled(&self, spent: Spent) -> SmallVec<[SpendSettled; 1]> {
        self.spend
            .iter()
            .map(|op| SpendSettled {
                reserved: op.cost,
                charged: match spent {
                    Spent::AsReserved => op.cost,
                    Spent::Tokens(tokens) => op.price.price.cost(&tokens),
                },
            })
            .collect()
    }

    /// The settlement of the `llm_spend` budgets once the call used `spent`: each moves by
    /// its charge minus its reservation.
    pub fn spend_adjustments(&self, spent: Spent) -> SmallVec<[crate::store::AdjustOp; 1]> {
        self.spend
            .iter()
            .zip(self.spend_settled(spent))
            .map(|(op, settled)| crate::store::AdjustOp {
                key: op.key,
                quota: op.quota,
                window_id: Some(op.window_id),
                delta: (settled.charged.min(i64::MAX as u64) as i64)
                    .saturating_sub(settled.reserved.min(i64::MAX as u64) as i64),
            })
            .filter(|op| op.delta != 0)
            .collect()
    }

    /// The tokens reserved (the largest reservation of its rules).
    pub fn tokens(&self) -> u64 {
        self.rules.iter().map(|r| r.tokens).max().unwrap_or(0)
    }

    /// The settlement once `used` tokens (at most [`crate::request::llm::MAX_TOKENS`]) were really
    /// used: each bucket moves by `used` minus what it reserved (a refund when negative).
    pub fn adjustments(&self, used: u64) -> SmallVec<[crate::store::AdjustOp; 2]> {
        let used = used
            .min(crate::request::llm::MAX_TOKENS)
            .saturating_mul(crate::limits::limiter::MICRO)
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

/// Who refused a request ([`Decision::refused_by`]).
#[derive(Debug, Clone, Copy)]
pub enum RefusedBy<'b> {
    Rule(&'b Rule),
    KillSwitch(&'b KillSwitch),
    /// The request itself (an encoded slash), before any policy.
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
    pub checked: Option<Box<Checked<'b>>>,
}

/// The request a decision was made for, as its consumers name it: the client's address, the
/// host (without its port) and the path, the verified JWT `sub` (with the address and path,
/// the `Retry-After` jitter's identity), and the facts the engine decided on (absent for a
/// request refused before it, and for an Envoy descriptor call), from which the operator's
/// list of limited clients names their buckets.
#[derive(Clone, Copy, Default)]
pub struct RequestView<'r> {
    pub client_ip: Option<IpAddr>,
    pub host: Option<&'r str>,
    pub path: &'r str,
    pub sub: Option<&'r str>,
    pub facts: Option<&'r RequestFacts<'r>>,
}

impl<'r> RequestView<'r> {
    /// The view of a request the engine decides on.
    pub fn of(facts: &'r RequestFacts<'r>) -> Self {
        RequestView {
            client_ip: facts.client_ip,
            host: facts.host_name(),
            path: &facts.path,
            sub: facts
                .claims
                .and_then(|c| c.get("sub"))
                .and_then(|s| s.as_str()),
            facts: Some(facts),
        }
    }
}

/// A decision with the request it was made for: the response's headers, the `RATE_LIMIT` log
/// line, the metrics, the operator's list of limited clients and the access log's verdict are
/// each written from this alone, on the way back up.
pub struct Decided<'d> {
    pub decision: Decision<'d>,
    pub request: RequestView<'d>,
}

/// The engine's answer for one request.
#[derive(Debug, Clone)]
pub enum Decision<'b> {
    /// No valid bundle is loaded.
    NoPolicy,
    Allow(Box<Checked<'b>>),
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
            Decision::Refuse(r) => r.checked.as_deref(),
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

    /// Who refused the request: the rule whose buckets refused with the longest wait (or whose
    /// descriptor was missing or header repeated), a kill switch, or the request itself.
    pub fn refused_by(&self) -> Option<RefusedBy<'b>> {
        let Decision::Refuse(refusal) = self else {
            return None;
        };
        Some(match refusal.cause {
            Cause::Buckets => self
                .rejecting_rule()
                .map_or(RefusedBy::Request, |r| RefusedBy::Rule(r.rule)),
            Cause::Rule(rule) => RefusedBy::Rule(rule),
            Cause::KillSwitch(ks) => RefusedBy::KillSwitch(ks),
            Cause::Request => RefusedBy::Request,
        })
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
            let RuleKind::Guard(Guard::Breaker(breaker)) = outcome.rule.kind else {
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
                        mark: false,
                        on_store_error: None,
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
            if let Some(price) = r.spend {
                reservation.spend_prompt_tokens = r.prompt_tokens;
                reservation.spend.push(SpendOp {
                    key: r.key,
                    quota: r.quota,
                    window_id: r.window_id.unwrap_or(1),
                    cost: r.cost,
                    price,
                    policy: outcome.rule.policy_id.clone(),
                    rule: outcome.rule.name.clone(),
                    model: checked
                        .bundle
                        .llm_prices
                        .as_deref()
                        .map_or("other", |t| t.label(price.label))
                        .to_string(),
                    mode: outcome.rule.mode,
                });
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
                    tokens: r.cost / crate::limits::limiter::MICRO,
                    prompt_tokens: r.prompt_tokens,
                    stream_cap: outcome
                        .rule
                        .llm()
                        .and_then(|l| l.stream_cap)
                        .filter(|_| outcome.rule.mode == Mode::Enforce),
                });
            }
        }
        (!reservation.ops.is_empty() || !reservation.spend.is_empty()).then_some(reservation)
    }

    /// The model a request refused by an `llm_spend` budget may go to instead: the refusing
    /// rule's `on_exhausted.fallback_model`, when the request names a model the front end can
    /// replace (`named`) and not that one already.
    pub fn spend_fallback(&self, named: Option<&str>) -> Option<&'b str> {
        named?;
        let Decision::Refuse(refusal) = self else {
            return None;
        };
        if !matches!(
            refusal.reason,
            Reason::SpendExceeded | Reason::CostExceedsLimit
        ) {
            return None;
        }
        let fallback = self
            .rejecting_rule()?
            .rule
            .spend()?
            .fallback_model
            .as_deref()?;
        (named != Some(fallback)).then_some(fallback)
    }

    /// Shadow rules that would have refused.
    pub fn shadow_rejections(&self) -> impl Iterator<Item = &RuleOutcome<'b>> {
        self.rules()
            .iter()
            .filter(|r| r.rule.mode == Mode::Shadow && !r.allowed)
    }
}
