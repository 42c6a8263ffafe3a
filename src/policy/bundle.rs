//! A compiled policy bundle ([`Bundle`]): its policies, rules and kill switches with the index
//! that finds them, its runtime overrides, and what a load reports about it.

use super::error::FieldError;
use super::index;
use super::rule::{Guard, KillSwitch, LlmLimit, LlmPart, Policy, Rule, RuleKind};
use crate::request::descriptor::RequestFacts;

/// What every key of a candidate bundle starts with ([`super::CompileOptions::candidate`]).
pub const CANDIDATE_PREFIX: &str = "candidate:";

/// A compiled policy bundle.
#[derive(Debug)]
pub struct Bundle {
    /// `bundle_version` as written (`"0"` for the bare `{"rules": [...]}` form).
    pub version: String,
    /// `expires_at` (Unix seconds): a bundle past it is refused at load.
    pub expires_at: Option<i64>,
    /// Hex xxHash3-64 of the source bytes: tells two loads of the same file apart from a change.
    pub hash: String,
    /// Lower-case hex SHA-256 of the source bytes: the bundle's hash a fleet compares
    /// (`/readyz` `bundle_hash`, `tollgate_bundle_info`, a published envelope's `sha256`).
    pub sha256: String,
    pub policies: Vec<Policy>,
    /// Every rule of every policy (fallbacks included), indexed by [`Policy::rules`].
    pub rules: Vec<Rule>,
    pub kill_switches: Vec<KillSwitch>,
    /// Non-fatal findings (e.g. `burst` below `tokens_per_second`).
    pub warnings: Vec<FieldError>,
    /// The rules holding state for long ([`super::key_origin::long_lived`]: budgets, slow buckets),
    /// each with the JSON path of its `limit_keys`, for [`Bundle::made_up_key_warnings`].
    pub long_lived_keys: Vec<(usize, Box<str>)>,
    /// The rule an Envoy descriptor's own `limit` override is counted under when no rule of
    /// the bundle applies to the descriptor (envoyproxy/ratelimit honours such overrides too).
    pub envoy_override: Rule,
    /// `global_shadow`, when enabled: every policy runs in shadow until it expires.
    pub global_shadow: Option<RuntimeOverride>,
    /// `kill_switch_override`, when enabled: kill switches are skipped until it expires.
    pub kill_switch_override: Option<RuntimeOverride>,
    /// The same bundle with every policy in shadow (built when `global_shadow` is enabled):
    /// while the override is in force, requests are decided on it, so shadow counting, headers
    /// and metrics are exactly those of shadow policies.
    pub shadow_twin: Option<Box<Bundle>>,
    /// Policies left out by `--skip-invalid-policies`, with their errors.
    pub skipped: Vec<SkippedPolicy>,
    /// A policy has `loop_detection`: front ends hash request bodies for its fingerprints.
    pub fingerprints_bodies: bool,
    /// A rule or kill switch reads the client's network (`ip:country`, `ip:asn`, `ip:type`,
    /// `ip:tor`): the gateway resolves it per request only then.
    pub uses_network: bool,
    /// A policy has a `token_bucket_llm` rule: front ends read the bodies of the requests it
    /// selects ([`Bundle::meters_tokens`]).
    pub meters_tokens: bool,
    /// A rule counts gRPC request messages (`grpc:message`): the proxy then decides each
    /// message of a gRPC call's request stream.
    pub counts_grpc_messages: bool,
    /// A rule has a `delay` (paces bursts): the engine works out each admitted request's wait.
    pub paces: bool,
    /// Policies, rules and kill switches by what selects them ([`index`]).
    pub index: index::BundleIndex,
    /// The `tiktoken` encodings its rules count prompts in (a set of
    /// [`crate::request::llm::TokenEncoding::bit`]s): front ends count those too.
    pub tiktoken: u8,
    /// `llm_prices`: what each model's tokens cost (`llm_spend` rules).
    pub llm_prices: Option<std::sync::Arc<crate::limits::prices::PriceTable>>,
    /// The per-key overrides set at runtime, compiled against this bundle (shared with its
    /// all-shadow twin, whose rules have the same indexes); the gateway fills it in.
    pub key_quotas: std::sync::Arc<super::key_overrides::KeyQuotas>,
}

/// Gives the memory a bundle's parse used (its JSON tree, the source text) back to the operating
/// system: the allocator keeps freed pages for reuse, and a bundle of 10 000 policies parses
/// through about 50 MB that would otherwise stay resident until the next reload. Called after
/// a load, off the request path.
pub fn release_parse_memory() {
    // SAFETY: mi_collect only walks and frees this thread's and abandoned heaps' free pages.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// A runtime override block (`global_shadow`, `kill_switch_override`), as Fairvisor defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeOverride {
    pub reason: String,
    /// Unix seconds; in force while `now < expires_at`.
    pub expires_at: i64,
}

impl RuntimeOverride {
    pub fn active(&self, unix_secs: i64) -> bool {
        unix_secs < self.expires_at
    }
}

/// A policy `--skip-invalid-policies` left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedPolicy {
    /// `policies[i]`.
    pub path: String,
    /// Its `id`, if it had a readable one.
    pub id: String,
    pub errors: Vec<FieldError>,
}

impl Bundle {
    /// An empty bundle: allows everything.
    pub fn empty() -> Self {
        Bundle {
            version: "0".to_string(),
            expires_at: None,
            hash: String::new(),
            sha256: String::new(),
            policies: Vec::new(),
            rules: Vec::new(),
            kill_switches: Vec::new(),
            warnings: Vec::new(),
            long_lived_keys: Vec::new(),
            envoy_override: Rule::envoy_override(),
            global_shadow: None,
            kill_switch_override: None,
            shadow_twin: None,
            skipped: Vec::new(),
            fingerprints_bodies: false,
            uses_network: false,
            meters_tokens: false,
            counts_grpc_messages: false,
            paces: false,
            index: index::BundleIndex::default(),
            tiktoken: 0,
            llm_prices: None,
            key_quotas: std::sync::Arc::default(),
        }
    }

    /// Names every key of this bundle under `candidate:` (once), so that decided as a candidate
    /// beside the bundle in force it never touches that bundle's buckets
    /// ([`super::CompileOptions::candidate`] compiles it so).
    pub fn make_candidate(&mut self) {
        if self.is_candidate() {
            return;
        }
        let twin = self.shadow_twin.iter_mut().flat_map(|t| t.rules.iter_mut());
        for rule in self.rules.iter_mut().chain(twin) {
            rule.key_prefix.insert_str(0, CANDIDATE_PREFIX);
        }
        if let Some(twin) = self.shadow_twin.as_mut() {
            twin.envoy_override
                .key_prefix
                .insert_str(0, CANDIDATE_PREFIX);
        }
        self.envoy_override
            .key_prefix
            .insert_str(0, CANDIDATE_PREFIX);
    }

    /// Whether its keys are a candidate's ([`Bundle::make_candidate`]).
    pub fn is_candidate(&self) -> bool {
        self.envoy_override.key_prefix.starts_with(CANDIDATE_PREFIX)
    }

    /// The bundle requests are decided on at `unix_secs`: this one, or its all-shadow twin
    /// while `global_shadow` is in force.
    pub fn in_force(&self, unix_secs: i64) -> &Bundle {
        match (&self.global_shadow, &self.shadow_twin) {
            (Some(o), Some(twin)) if o.active(unix_secs) => twin,
            _ => self,
        }
    }

    /// Whether `global_shadow` is in force at `unix_secs`.
    pub fn global_shadow_active(&self, unix_secs: i64) -> bool {
        self.global_shadow
            .as_ref()
            .is_some_and(|o| o.active(unix_secs))
    }

    /// Whether kill switches are skipped at `unix_secs`.
    pub fn kill_switch_override_active(&self, unix_secs: i64) -> bool {
        self.kill_switch_override
            .as_ref()
            .is_some_and(|o| o.active(unix_secs))
    }

    /// Refuses a bundle whose `expires_at`, or an enabled runtime override's, has passed at
    /// `unix_secs` (Fairvisor refuses both at load too).
    ///
    /// # Errors
    /// What expired, and when.
    pub fn check_current(&self, unix_secs: i64) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut check = |path: &str, at: Option<i64>| {
            if let Some(at) = at.filter(|at| *at <= unix_secs) {
                errors.push(FieldError {
                    path: path.to_string(),
                    message: format!(
                        "{} has passed: this bundle is expired (issue a new one, or remove expires_at)",
                        humantime::format_rfc3339_seconds(
                            std::time::UNIX_EPOCH
                                + std::time::Duration::from_secs(at.max(0) as u64)
                        )
                    ),
                });
            }
        };
        check("expires_at", self.expires_at);
        check(
            "global_shadow.expires_at",
            self.global_shadow.as_ref().map(|o| o.expires_at),
        );
        check(
            "kill_switch_override.expires_at",
            self.kill_switch_override.as_ref().map(|o| o.expires_at),
        );
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// Whether a policy with a `token_bucket_llm` rule selects this request: its body must be
    /// read (and its response metered) before it is decided.
    pub fn meters_tokens_for(&self, facts: &RequestFacts<'_>) -> bool {
        self.meters_tokens
            && self
                .policies
                .iter()
                .any(|p| p.meters_tokens && p.selector.matches(facts))
    }

    /// Whether an enforced `token_bucket_llm` rule may apply to this request at `unix_secs`
    /// (under `global_shadow`, none is).
    pub fn enforces_tokens_for(&self, facts: &RequestFacts<'_>, unix_secs: i64) -> bool {
        self.in_force(unix_secs)
            .policies
            .iter()
            .any(|p| p.enforces_tokens && p.selector.matches(facts))
    }

    /// Whether any enforced `token_bucket_llm` rule is in force at `unix_secs`.
    pub fn enforces_tokens(&self, unix_secs: i64) -> bool {
        self.in_force(unix_secs)
            .policies
            .iter()
            .any(|p| p.enforces_tokens)
    }

    /// Rules holding state a restart of a gateway on process memory would reset, each with
    /// what it holds: budgets (LLM day windows included), circuit breakers, loop detection.
    pub fn state_a_restart_resets(&self) -> Vec<(&str, &'static str)> {
        self.rules
            .iter()
            .filter_map(|rule| {
                let what = match &rule.kind {
                    RuleKind::Budget(_)
                    | RuleKind::Spend(_)
                    | RuleKind::Llm(LlmLimit {
                        part: LlmPart::Day(_),
                        ..
                    }) => "budget",
                    RuleKind::Guard(Guard::Breaker(_)) => "circuit breaker",
                    RuleKind::Guard(Guard::Loop(_)) => "loop marks",
                    RuleKind::TokenBucket
                        if rule
                            .after_response
                            .as_deref()
                            .is_some_and(|a| a.penalty.is_some()) =>
                    {
                        "penalty box"
                    }
                    RuleKind::TokenBucket | RuleKind::Concurrency(_) | RuleKind::Llm(_) => {
                        return None
                    }
                };
                Some((&*rule.name, what))
            })
            .collect()
    }

    /// The warning for [`Bundle::state_a_restart_resets`] when no state dir or shared store
    /// keeps that state (`None` when the bundle holds none).
    pub fn restart_warning(&self) -> Option<String> {
        let rules = self.state_a_restart_resets();
        if rules.is_empty() {
            return None;
        }
        let listed: Vec<String> = rules
            .iter()
            .map(|(name, what)| format!("{name} ({what})"))
            .collect();
        Some(format!(
            "{} hold state that a restart resets with the embedded store in process memory: run with --state-dir DIR (or a shared --store) to keep it",
            listed.join(", ")
        ))
    }

    /// No policy and no kill switch: the bundle limits nothing (an empty bundle, or one whose
    /// every policy `--skip-invalid-policies` left out).
    pub fn enforces_nothing(&self) -> bool {
        self.policies.is_empty() && self.kill_switches.is_empty()
    }

    /// How many rules the bundle's author wrote: each policy's `rules` and `fallback_limit`.
    /// [`Bundle::rules`] holds more: a `token_bucket_llm` rule's `tokens_per_day` budget is a
    /// rule of its own, and so is what `loop_detection` or `circuit_breaker` compiled to.
    pub fn written_rule_count(&self) -> usize {
        self.rules
            .iter()
            .filter(|rule| match &rule.kind {
                RuleKind::Guard(_) => false,
                RuleKind::Llm(llm) => matches!(llm.part, LlmPart::Minute),
                RuleKind::TokenBucket
                | RuleKind::Budget(_)
                | RuleKind::Concurrency(_)
                | RuleKind::Spend(_) => true,
            })
            .count()
    }

    /// Looks up a rule by name.
    pub fn rule(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| &*r.name == name)
    }
}
