//! Prometheus metrics with bounded labels only (policy, rule, action, reason, mode, result):
//! never raw paths, keys or addresses.
//!
//! Per-rule counters are resolved once per installed bundle ([`Metrics::on_install`]) so the
//! hot path increments a pre-built counter instead of hashing five label values per request.

use crate::engine::{Decision, Outcome, Reason};
use crate::policy::{Bundle, Mode};
use crate::store::StoreStats;
use arc_swap::ArcSwapOption;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::sync::Arc;

/// Counters of one rule in the installed bundle.
struct RuleCounters {
    allow: IntCounter,
    reject: IntCounter,
    /// Refused because the stated cost could never fit.
    reject_cost: IntCounter,
    shadow_allow: IntCounter,
    /// Allowed by this rule, but another rule refused the request: nothing was spent.
    refunded: IntCounter,
    shadow_would_reject: IntCounter,
    shadow_would_reject_total: IntCounter,
}

/// One rule's counters, made on its first decision: a bundle of 10 000 rules that mostly see
/// no traffic does not hold (or export) 70 000 zero series.
type LazyCounters = std::sync::OnceLock<RuleCounters>;

struct BundleCounters {
    /// Identity of the bundle these were built for (its `Arc` address).
    bundle: usize,
    rules: Vec<LazyCounters>,
    /// The same for the bundle's `global_shadow` twin (its address inside the bundle).
    twin: Option<(usize, Vec<LazyCounters>)>,
}

impl BundleCounters {
    /// The counters of the bundle a decision was made with, if it is the one installed.
    fn of(&self, bundle: &Bundle) -> Option<&[LazyCounters]> {
        let address = bundle as *const Bundle as usize;
        if address == self.bundle {
            return Some(&self.rules);
        }
        self.twin
            .as_ref()
            .filter(|(twin, _)| *twin == address)
            .map(|(_, rules)| rules.as_slice())
    }
}

/// An upstream group's queue metrics (the per-server connection cap).
#[derive(Clone)]
pub struct QueueMetrics {
    /// Requests waiting now.
    pub waiting: IntGauge,
    /// How long each request that had to wait waited (seconds).
    pub waits: Histogram,
    /// Requests answered 503 after waiting the whole queue timeout.
    pub timeouts: IntCounter,
    /// Requests whose client went away while they waited: never sent upstream.
    pub abandoned: IntCounter,
}

/// All gateway metrics.
/// The bundle in force and where it came from, and the policy-store follower's refusals.
#[derive(Clone)]
pub struct PolicySourceMetrics {
    bundle_info: IntGaugeVec,
    rejected: IntCounterVec,
    up: IntGauge,
    expiry: IntGauge,
}

impl PolicySourceMetrics {
    fn of(families: &Families) -> PolicySourceMetrics {
        PolicySourceMetrics {
            bundle_info: families.bundle_info.clone(),
            rejected: families.policy_source_rejected.clone(),
            up: families.policy_source_up.clone(),
            expiry: families.bundle_expiry.clone(),
        }
    }

    /// The expiry of the live bundle now in force (Unix seconds), `None` for none.
    pub fn set_expiry(&self, expires_at: Option<i64>) {
        self.expiry.set(expires_at.unwrap_or(0));
    }

    /// The bundle now in force.
    pub fn bundle(&self, version: &str, sha256: &str, source: &str) {
        self.bundle_info.reset();
        self.bundle_info
            .with_label_values(&[version, sha256, source])
            .set(1);
    }

    /// A published bundle refused (`slot`: live or candidate; `reason`: the refusal's label).
    pub fn rejected(&self, slot: &str, reason: &str) {
        self.rejected.with_label_values(&[slot, reason]).inc();
    }

    pub fn set_up(&self, up: bool) {
        self.up.set(i64::from(up));
    }
}

pub struct Metrics {
    registry: Registry,
    /// Every family of [`METRICS`] this gateway defines.
    families: Families,
    /// `tollgate_requests_total` resolved once per (action, reason): a labelled lookup hashes the labels and
    /// takes the vector's read lock, shared by every core, on each request.
    request_counters: [IntCounter; 2 + Reason::ALL.len()],
    /// `token_bucket_llm`: tokens reserved, really used, refunded and charged past the
    /// reservation, by policy and rule.
    llm_tokens: [IntCounterVec; 4],
    /// `tollgate_bundle_info` and the `--policy-store` follower's counters.
    pub policy_source: PolicySourceMetrics,
    /// A shared store's local mode (`None` for the embedded store).
    local: Option<LocalMetrics>,
    per_rule: ArcSwapOption<BundleCounters>,
    /// The candidate bundle decided in shadow (`src/service/candidate.rs`): what it would
    /// refuse by policy and rule, the requests it decided, the decisions skipped, and its
    /// version and hash while one is set.
    pub(crate) candidate: CandidateMetrics,
    /// The name of every metric family registered, series or not.
    defined: Vec<&'static str>,
    /// Serialises `render` so two scrapes cannot both advance the store counters.
    render_lock: parking_lot::Mutex<()>,
    /// The `service/method` pairs `tollgate_proxied_grpc_calls_total` names (at most
    /// [`MAX_GRPC_METHOD_LABELS`]): a client choosing paths cannot grow the label set.
    grpc_methods: parking_lot::Mutex<ahash::AHashSet<Box<str>>>,
}

/// The most `service/method` pairs `tollgate_proxied_grpc_calls_total` names; calls of any
/// other are counted as `other`.
pub const MAX_GRPC_METHOD_LABELS: usize = 100;

/// What a metric family holds, as `# TYPE` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Which gateways define a family, by their store ([`crate::store::Store::kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every gateway.
    All,
    /// The embedded store (`memory`, `state_dir`).
    Embedded,
    /// The embedded store and PostgreSQL (the stores that report evictions).
    EmbeddedOrPostgres,
    /// A shared store (its local mode).
    Shared,
    /// A shared store whose clock the gateway measures (`redis`, `postgres`).
    MeasuredClock,
}

impl Scope {
    /// Whether a gateway whose store is of `store_kind` defines the family.
    pub fn includes(self, store_kind: &str) -> bool {
        let embedded = matches!(store_kind, "memory" | "state_dir");
        match self {
            Scope::All => true,
            Scope::Embedded => embedded,
            Scope::EmbeddedOrPostgres => embedded || store_kind == "postgres",
            Scope::Shared => !embedded,
            Scope::MeasuredClock => matches!(store_kind, "redis" | "postgres"),
        }
    }
}

/// One metric family: a row of [`METRICS`].
#[derive(Debug, Clone, Copy)]
pub struct MetricSpec {
    pub name: &'static str,
    pub help: &'static str,
    pub labels: &'static [&'static str],
    pub kind: MetricKind,
    pub scope: Scope,
    /// A histogram's bucket bounds (empty otherwise, and for a histogram whose buckets the
    /// store hands over).
    pub buckets: &'static [f64],
}

/// Declares the metric table: [`METRICS`] (what `/metrics` can show: name, help, labels, kind,
/// and which gateways define it) and, from the same rows, `Families`, one field per row,
/// registered in the table's order by `Families::new`. A row is
/// `field: Type = Kind Scope "name" [labels] "help" [buckets];`; a row of a scope other than
/// `All` has an `Option` field (`None` for a store that does not define it).
macro_rules! metric_table {
    ($($field:ident: $ty:ty = $kind:ident $scope:ident $name:literal [$($label:literal),*] $help:literal [$($bucket:expr),*];)*) => {
        /// Every metric family a gateway may define, in registration order: the table
        /// `/metrics`, the shipped dashboard and the alerting rules are checked against.
        pub const METRICS: &[MetricSpec] = &[$(MetricSpec {
            name: $name,
            help: $help,
            labels: &[$($label),*],
            kind: MetricKind::$kind,
            scope: Scope::$scope,
            buckets: &[$($bucket),*],
        }),*];

        /// The registered families, one field per row of [`METRICS`].
        struct Families {
            $($field: $ty,)*
        }

        impl Families {
            /// Every row that a gateway with a store of `store_kind` defines, registered in
            /// `registry`, in the table's order; their names pushed to `defined`.
            fn new(
                registry: &Registry,
                store_kind: &str,
                defined: &mut Vec<&'static str>,
            ) -> prometheus::Result<Families> {
                let mut rows = METRICS.iter();
                Ok(Families {
                    $($field: Row::register(rows.next(), registry, store_kind, defined)?,)*
                })
            }
        }
    };
}

metric_table! {
    decisions: IntCounterVec = Counter All "tollgate_decisions_total"
        ["policy", "rule", "action", "reason", "mode"] "Rule evaluations by outcome" [];
    requests: IntCounterVec = Counter All "tollgate_requests_total"
        ["action", "reason"] "Requests decided, by overall action and reason" [];
    shadow_would_reject: IntCounterVec = Counter All "tollgate_shadow_would_reject_total"
        ["policy", "rule"] "Shadow-mode rules that would have rejected" [];
    latency: Histogram = Histogram All "tollgate_decision_duration_seconds"
        [] "Time to decide one request"
        [1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 2.5e-2];
    store_entries: Option<IntGauge> = Gauge Embedded "tollgate_store_entries"
        [] "Buckets held by the embedded store" [];
    store_evictions: Option<IntCounter> = Counter EmbeddedOrPostgres "tollgate_store_evictions_total"
        [] "Buckets dropped by the store (full again: indistinguishable from fresh)" [];
    store_evictions_by_kind: Option<IntCounterVec> = Counter Embedded "tollgate_store_evictions_by_kind_total"
        ["kind"] "Buckets dropped by the embedded store, by kind: full_again (gave nothing away), token_bucket and budget (evicted for room while holding spend), unknown_spend (written by an older build, spend not kept)" [];
    store_forgiven: Option<ForgivenHistogram> = Histogram Embedded "tollgate_store_eviction_forgiven_tokens"
        [] "Evictions for room (a new key in a full store), by the tokens the evicted entry still had spent" [];
    store_fail_open: Option<IntCounter> = Counter Embedded "tollgate_store_fail_open_total"
        [] "Requests allowed untracked because the embedded store had no room: a new key with nothing to evict (stays 0: a full store evicts), or a concurrency slot or breaker its lease table could not hold" [];
    loop_marks: Option<IntGauge> = Gauge Embedded "tollgate_store_loop_marks"
        [] "Loop-detection marks held by the embedded store (at most --max-loop-marks)" [];
    loop_marks_evicted: Option<IntCounter> = Counter Embedded "tollgate_store_loop_marks_evicted_total"
        [] "Loop-detection marks forgotten for room at --max-loop-marks (each one identical request a loop count missed)" [];
    state_dir_fallback: Option<IntGauge> = Gauge Embedded "tollgate_state_dir_fallback"
        [] "1 when --state-dir was given but the buckets are in process memory (the state file could not be made or mapped)" [];
    store_clock_skew: Option<ClockSkewGauge> = Gauge MeasuredClock "tollgate_store_clock_skew_seconds"
        [] "The gateway's wall clock minus the shared store's clock (Redis TIME, PostgreSQL clock_timestamp()), in seconds, measured at every sweep; positive when the gateway is ahead" [];
    store_info: IntGaugeVec = Gauge All "tollgate_store_info"
        ["kind"] "The store in use (value 1)" [];
    store_errors: IntCounter = Counter All "tollgate_store_errors_total"
        [] "Requests allowed because the store failed (fail-open)" [];
    admin_resets: IntCounterVec = Counter All "tollgate_admin_resets_total"
        ["result"] "Buckets reset by an operator (DELETE /v1/buckets), by whether the store held state for them" [];
    handover_failures: IntCounterVec = Counter All "tollgate_upgrade_handover_failures_total"
        ["reason"] "Zero-downtime upgrade hand-overs that did not happen, by reason (no_taker, stranger, unconfirmed, nothing_received, malformed, untrusted_dir, no_socket, io); the old process keeps serving" [];
    log_lines_dropped: IntCounter = Counter All "tollgate_log_lines_dropped_total"
        [] "Access-log and RATE_LIMIT lines dropped because standard output or error was not read fast enough" [];
    trace_spans_dropped: IntCounter = Counter All "tollgate_trace_spans_dropped_total"
        [] "Sampled trace spans not exported: the OTLP export queue (OTEL_BSP_MAX_QUEUE_SIZE) was full, their batch failed, or the export was backing off from a failing collector" [];
    admin_refused: IntCounter = Counter All "tollgate_admin_unauthorized_total"
        [] "Operator endpoint requests refused for a missing or wrong admin token" [];
    webhook_deliveries: IntCounterVec = Counter All "tollgate_webhook_deliveries_total"
        ["outcome"] "Threshold webhook attempts by outcome (delivered: the receiver answered 2xx; failed: an attempt that did not, retried with backoff; gave_up: a delivery dropped after its last attempt; dropped: a crossing not claimed because the queue or the store could not take it)" [];
    usage_notes_dropped: IntCounter = Counter All "tollgate_usage_notes_dropped_total"
        [] "Budget spend not recorded in the usage ledger (GET /v1/usage): the shared store did not answer, or the queue or the embedded ledger was full" [];
    admin_forbidden: IntCounterVec = Counter All "tollgate_admin_forbidden_total"
        ["token"] "Operator endpoint requests refused 403 because the token's scopes do not cover the endpoint, by token id (--admin-tokens-file)" [];
    debug_session_failures: IntCounterVec = Counter All "tollgate_debug_session_failures_total"
        ["reason"] "Debug-session logins refused: no secret, a wrong one, or a client throttled after too many" [];
    reloads: IntCounterVec = Counter All "tollgate_policy_reloads_total"
        ["result"] "Policy loads by result" [];
    network_reloads_rejected: IntCounterVec = Counter All "tollgate_network_reloads_rejected_total"
        ["file"] "Network-file reloads refused because the file came back empty or with fewer than half the entries in force (the data in force kept), by file (geoip_db, asn_type_map, tor_exits)" [];
    policy_info: IntGaugeVec = Gauge All "tollgate_policy_info"
        ["version", "hash"] "The policy bundle in force (value 1)" [];
    bundle_info: IntGaugeVec = Gauge All "tollgate_bundle_info"
        ["version", "hash", "source"] "The bundle in force (value 1): its version (published, or its own bundle_version), SHA-256 and source (file, state_dir, redis, redis-cluster, postgres, http)" [];
    policy_source_rejected: IntCounterVec = Counter All "tollgate_policy_source_rejected_total"
        ["slot", "reason"] "Published bundles --policy-store did not put in force (the last good one kept), by slot and reason" [];
    policy_source_up: IntGauge = Gauge All "tollgate_policy_source_up"
        [] "1 while the --policy-store answers, 0 while it is unreachable" [];
    bundle_expiry: IntGauge = Gauge All "tollgate_bundle_expiry_timestamp_seconds"
        [] "When the live bundle in force from --policy-store expires (Unix seconds; 0 without an expiry): alert when it is less than a week away" [];
    runtime_overrides: IntGaugeVec = Gauge All "tollgate_runtime_override_active"
        ["override"] "Runtime overrides of the bundle in force: 1 while active (global_shadow, kill_switch_override)" [];
    connections_refused: IntCounterVec = Counter All "tollgate_connections_refused_total"
        ["cap"] "Client connections refused at accept, by cap (per_ip)" [];
    request_headers_refused: IntCounterVec = Counter All "tollgate_request_headers_refused_total"
        ["limit"] "Requests refused with 431 for a header block over --max-request-header-bytes (bytes) or --max-request-headers (lines)" [];
    breaker_trips: IntCounterVec = Counter All "tollgate_circuit_breaker_trips_total"
        ["policy", "mode"] "Circuit breakers opened by a request's spend, by policy and mode" [];
    llm_tokens_reserved: IntCounterVec = Counter All "tollgate_llm_tokens_reserved_total"
        ["policy", "rule"] "Tokens reserved by token_bucket_llm rules before the upstream answered" [];
    llm_tokens_used: IntCounterVec = Counter All "tollgate_llm_tokens_used_total"
        ["policy", "rule"] "Tokens the upstream's responses really used, as settled" [];
    llm_tokens_refunded: IntCounterVec = Counter All "tollgate_llm_tokens_refunded_total"
        ["policy", "rule"] "Reserved tokens given back because the response used fewer" [];
    llm_tokens_overrun: IntCounterVec = Counter All "tollgate_llm_tokens_overrun_total"
        ["policy", "rule"] "Tokens charged beyond the reservation because the response used more" [];
    llm_spend: IntCounterVec = Counter All "tollgate_llm_spend_total"
        ["policy", "rule", "model"] "Money llm_spend rules charged once settled, in millionths of the price table's currency, by the price table entry that priced the model (other: the unknown_model price)" [];
    llm_settlements: IntCounterVec = Counter All "tollgate_llm_settlements_total"
        ["source"] "LLM reservations settled, by where the usage came from (usage: the response's usage object; estimate: counted from the text streamed; stopped: a stream stopped past max_completion_tokens, counted from the text let through; unused: nothing came back, all refunded; report: POST /v1/usage; expired: never reported, kept as reserved)" [];
    llm_estimate_ratio: Histogram = Histogram All "tollgate_llm_prompt_estimate_ratio"
        [] "Prompt token estimates divided by the prompt tokens the upstream reported (1 = exact)"
        [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0];
    policies_skipped: IntGauge = Gauge All "tollgate_policies_skipped"
        [] "Policies of the bundle in force left out by --skip-invalid-policies" [];
    jwt_valid: IntCounter = Counter All "tollgate_jwt_valid_total"
        [] "Requests with a verified JWT" [];
    jwt_invalid: IntCounterVec = Counter All "tollgate_jwt_invalid_total"
        ["reason"] "Requests whose JWT was refused, by reason" [];
    upstream_connect_failures: IntCounterVec = Counter All "tollgate_upstream_connect_failures_total"
        ["group", "kind"] "Failed connections to upstream servers, by group and kind (refused, timeout, unreachable, reset, tls, other)" [];
    upstream_retries: IntCounterVec = Counter All "tollgate_upstream_retries_total"
        ["group"] "Requests tried again after a failed connection, by group" [];
    upstream_ejections: IntCounterVec = Counter All "tollgate_upstream_ejections_total"
        ["group"] "Servers taken out of their group after consecutive connection failures" [];
    paced_waiting: IntGauge = Gauge All "tollgate_paced_waiting"
        [] "Requests waiting now for their turn under a token-bucket rule's delay (at most --max-delayed-requests)" [];
    paced_waits: Histogram = Histogram All "tollgate_paced_wait_seconds"
        [] "How long requests paced by a token-bucket rule's delay waited before going on (served ones only)"
        [0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];
    paced: IntCounterVec = Counter All "tollgate_paced_requests_total"
        ["outcome"] "Requests a token-bucket rule's delay made wait, by outcome (served: went on after its wait; client_gone: the client left while waiting, its tokens given back; drained: refused at shutdown, its tokens given back; full: refused because --max-delayed-requests were already waiting)" [];
    upstream_queue_waiting: IntGaugeVec = Gauge All "tollgate_upstream_queue_waiting"
        ["group"] "Requests waiting now for a free slot of an upstream server at its max_connections, by group" [];
    upstream_queue_waits: HistogramVec = Histogram All "tollgate_upstream_queue_wait_seconds"
        ["group"] "How long requests that had to wait for a free upstream slot waited, by group"
        [0.001, 0.005, 0.025, 0.1, 0.25, 1.0, 2.5, 10.0, 60.0];
    upstream_queue_timeouts: IntCounterVec = Counter All "tollgate_upstream_queue_timeouts_total"
        ["group"] "Requests answered 503 after waiting queue_timeout_ms for a free upstream slot, by group" [];
    upstream_queue_abandoned: IntCounterVec = Counter All "tollgate_upstream_queue_abandoned_total"
        ["group"] "Requests that left the upstream queue because their client went away, never sent upstream, by group" [];
    llm_undecodable: IntCounterVec = Counter All "tollgate_llm_undecodable_responses_total"
        ["encoding", "reason"] "LLM responses whose Content-Encoding could not be decoded to read their usage (settled as reserved), by encoding and reason" [];
    proxied_grpc_calls: IntCounterVec = Counter All "tollgate_proxied_grpc_calls_total"
        ["rpc_service", "rpc_method", "rpc_grpc_status_code"] "gRPC calls through the reverse proxy, by service, method (the first 100 service and method pairs seen, later ones as other) and the status code they ended with (none: no status)" [];
    grpc_calls: IntCounterVec = Counter All "tollgate_grpc_calls_total"
        ["service", "code"] "gRPC calls from Envoy, by service (ratelimit, authz) and answer" [];
    candidate_would_refuse: IntCounterVec = Counter All "tollgate_candidate_would_refuse_total"
        ["policy", "rule"] "Requests the candidate bundle would have refused, by policy and rule (kill switches under policy kill_switch), since it was set" [];
    candidate_decisions: IntCounter = Counter All "tollgate_candidate_decisions_total"
        [] "Requests also decided under the candidate bundle since it was set" [];
    candidate_skipped: IntCounter = Counter All "tollgate_candidate_skipped_total"
        [] "Requests not decided under the candidate bundle: too many of its shared-store calls outstanding" [];
    candidate_info: IntGaugeVec = Gauge All "tollgate_candidate_info"
        ["version", "hash"] "The candidate bundle decided in shadow (value 1 while one is set)" [];
    local_mode: Option<IntGauge> = Gauge Shared "tollgate_store_local_mode"
        [] "1 while this gateway decides from its own memory because the shared store does not answer" [];
    fleet_gateways: Option<IntGauge> = Gauge Shared "tollgate_fleet_gateways"
        [] "Gateways present in the shared store when it was last reached (N: local mode gives each 1/N of every limit)" [];
    local_decisions: Option<IntCounterVec> = Counter Shared "tollgate_store_local_decisions_total"
        ["policy", "rule", "outcome"] "Rule checks decided without the shared store, by the rule's on_store_error outcome (allowed, rejected, closed, open)" [];
    write_backs: Option<IntCounterVec> = Counter Shared "tollgate_store_writebacks_total"
        ["outcome"] "Local spend charged to the shared store once it answered again: applied, duplicate (already charged), failed (sending a batch failed; it is sent again)" [];
    write_back_pending: Option<IntGauge> = Gauge Shared "tollgate_store_writeback_pending"
        [] "Buckets with local spend not yet charged to the shared store" [];
}

/// A family built from its row.
trait Family: prometheus::core::Collector + Clone + Sized + 'static {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self>;
}

impl Family for IntCounter {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        IntCounter::new(spec.name, spec.help)
    }
}

impl Family for IntGauge {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        IntGauge::new(spec.name, spec.help)
    }
}

impl Family for IntCounterVec {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        IntCounterVec::new(Opts::new(spec.name, spec.help), spec.labels)
    }
}

impl Family for IntGaugeVec {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        IntGaugeVec::new(Opts::new(spec.name, spec.help), spec.labels)
    }
}

impl Family for Histogram {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        Histogram::with_opts(
            HistogramOpts::new(spec.name, spec.help).buckets(spec.buckets.to_vec()),
        )
    }
}

impl Family for HistogramVec {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        HistogramVec::new(
            HistogramOpts::new(spec.name, spec.help).buckets(spec.buckets.to_vec()),
            spec.labels,
        )
    }
}

impl Family for ForgivenHistogram {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        ForgivenHistogram::new(spec)
    }
}

impl Family for ClockSkewGauge {
    fn of(spec: &MetricSpec) -> prometheus::Result<Self> {
        ClockSkewGauge::new(spec)
    }
}

/// A field of `Families`: a family (every gateway defines it) or an optional one (`None` for
/// a store outside its row's [`Scope`]).
trait Row: Sized {
    fn register(
        spec: Option<&MetricSpec>,
        registry: &Registry,
        store_kind: &str,
        defined: &mut Vec<&'static str>,
    ) -> prometheus::Result<Self>;
}

/// Builds `spec`'s family and registers it.
fn register<F: Family>(
    spec: Option<&MetricSpec>,
    registry: &Registry,
    defined: &mut Vec<&'static str>,
) -> prometheus::Result<F> {
    // One row per field, by construction of `metric_table!`.
    let spec = spec.ok_or_else(|| prometheus::Error::Msg("a field without its row".into()))?;
    let family = F::of(spec)?;
    registry.register(Box::new(family.clone()))?;
    defined.push(spec.name);
    Ok(family)
}

macro_rules! rows {
    ($($family:ty),*) => {$(
        impl Row for $family {
            fn register(
                spec: Option<&MetricSpec>,
                registry: &Registry,
                _: &str,
                defined: &mut Vec<&'static str>,
            ) -> prometheus::Result<Self> {
                register(spec, registry, defined)
            }
        }

        impl Row for Option<$family> {
            fn register(
                spec: Option<&MetricSpec>,
                registry: &Registry,
                store_kind: &str,
                defined: &mut Vec<&'static str>,
            ) -> prometheus::Result<Self> {
                match spec {
                    Some(row) if !row.scope.includes(store_kind) => Ok(None),
                    _ => register(spec, registry, defined).map(Some),
                }
            }
        }
    )*};
}

rows!(
    IntCounter,
    IntGauge,
    IntCounterVec,
    IntGaugeVec,
    Histogram,
    HistogramVec,
    ForgivenHistogram,
    ClockSkewGauge
);

impl Families {
    /// The series every gateway shows from the start (each label value a family is known to
    /// take, at zero), and the store in use.
    fn start_series(&self, store_kind: &str) {
        self.store_info.with_label_values(&[store_kind]).set(1);
        let start = |family: &IntCounterVec, values: &[&str]| {
            for value in values {
                family.with_label_values(&[value]);
            }
        };
        if let Some(by_kind) = &self.store_evictions_by_kind {
            start(by_kind, &EVICTION_KINDS);
        }
        start(&self.admin_resets, &["reset", "full"]);
        start(
            &self.handover_failures,
            &[
                "no_taker",
                "stranger",
                "unconfirmed",
                "nothing_received",
                "malformed",
                "untrusted_dir",
                "no_socket",
                "io",
            ],
        );
        for failure in crate::engine::compat::Failure::ALL {
            self.debug_session_failures
                .with_label_values(&[failure.as_str()]);
        }
        start(
            &self.network_reloads_rejected,
            &crate::request::network::NetworkFile::METRIC_LABELS,
        );
        for name in ["global_shadow", "kill_switch_override"] {
            self.runtime_overrides.with_label_values(&[name]);
        }
        start(&self.connections_refused, &["per_ip"]);
        start(&self.request_headers_refused, &["bytes", "lines"]);
        start(
            &self.llm_settlements,
            &[
                "usage", "estimate", "stopped", "unused", "report", "expired",
            ],
        );
        for reason in crate::request::auth::InvalidToken::ALL {
            self.jwt_invalid.with_label_values(&[reason.as_str()]);
        }
        for (service, codes) in GRPC_CODES {
            for code in *codes {
                self.grpc_calls.with_label_values(&[service, code]);
            }
        }
        if let Some(write_backs) = &self.write_backs {
            start(write_backs, &WRITE_BACK_OUTCOMES);
        }
    }
}

/// The `outcome` label values of `tollgate_store_writebacks_total`.
const WRITE_BACK_OUTCOMES: [&str; 3] = ["applied", "duplicate", "failed"];

/// The label values of `tollgate_grpc_calls_total`, created at start so every series exists.
pub const GRPC_CODES: &[(&str, &[&str])] = &[
    (
        "ratelimit",
        &["ok", "over_limit", "invalid_argument", "unavailable"],
    ),
    (
        "authz",
        &["ok", "denied", "invalid_argument", "unavailable"],
    ),
];

impl Metrics {
    /// The counter of spans a full export queue dropped (handed to the telemetry's processor).
    pub fn trace_spans_dropped(&self) -> prometheus::IntCounter {
        self.families.trace_spans_dropped.clone()
    }

    /// Metrics for a gateway whose store is of `store_kind` (`memory`, `state_dir`, `redis`,
    /// `postgres`: [`crate::store::Store::kind`]): the rows of [`METRICS`] it defines.
    ///
    /// # Errors
    /// A row the registry refuses (a name or label that is not Prometheus's, a name twice): a
    /// mistake in the table, which the unit tests catch.
    pub fn new(store_kind: &str) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let mut defined = Vec::new();
        let families = Families::new(&registry, store_kind, &mut defined)?;
        families.start_series(store_kind);
        let requests = &families.requests;
        let request_counters = [
            ("allow", ""),
            ("allow", "no_policy"),
            ("reject", Reason::ALL[0].as_str()),
            ("reject", Reason::ALL[1].as_str()),
            ("reject", Reason::ALL[2].as_str()),
            ("reject", Reason::ALL[3].as_str()),
            ("reject", Reason::ALL[4].as_str()),
            ("reject", Reason::ALL[5].as_str()),
            ("reject", Reason::ALL[6].as_str()),
            ("reject", Reason::ALL[7].as_str()),
            ("reject", Reason::ALL[8].as_str()),
            ("reject", Reason::ALL[9].as_str()),
            ("reject", Reason::ALL[10].as_str()),
            ("reject", Reason::ALL[11].as_str()),
            ("reject", Reason::ALL[12].as_str()),
            ("reject", Reason::ALL[13].as_str()),
            ("reject", Reason::ALL[14].as_str()),
            ("reject", Reason::ALL[15].as_str()),
            ("reject", Reason::ALL[16].as_str()),
            ("reject", Reason::ALL[17].as_str()),
            ("reject", Reason::ALL[18].as_str()),
        ]
        .map(|(action, reason)| requests.with_label_values(&[action, reason]));
        Ok(Metrics {
            llm_tokens: [
                families.llm_tokens_reserved.clone(),
                families.llm_tokens_used.clone(),
                families.llm_tokens_refunded.clone(),
                families.llm_tokens_overrun.clone(),
            ],
            policy_source: PolicySourceMetrics::of(&families),
            local: LocalMetrics::of(&families),
            candidate: CandidateMetrics::of(&families),
            request_counters,
            registry,
            families,
            defined,
            per_rule: ArcSwapOption::empty(),
            grpc_methods: parking_lot::Mutex::default(),
            render_lock: parking_lot::Mutex::new(()),
        })
    }

    /// Resolves per-rule counters for a newly installed bundle and updates the info gauge.
    pub fn on_install(&self, bundle: &Arc<Bundle>) {
        self.per_rule.store(Some(Arc::new(BundleCounters {
            bundle: Arc::as_ptr(bundle) as usize,
            rules: bundle.rules.iter().map(|_| LazyCounters::new()).collect(),
            twin: bundle.shadow_twin.as_deref().map(|twin| {
                (
                    twin as *const Bundle as usize,
                    twin.rules.iter().map(|_| LazyCounters::new()).collect(),
                )
            }),
        })));
        self.families.policy_info.reset();
        self.families
            .policy_info
            .with_label_values(&[&bundle.version.to_string(), &bundle.hash])
            .set(1);
    }

    fn rule_counters(&self, rule: &crate::policy::Rule) -> RuleCounters {
        let policy = rule.policy_id.as_str();
        let name = rule.name.as_str();
        let c = |action: &str, reason: &str, mode: &str| {
            self.families
                .decisions
                .with_label_values(&[policy, name, action, reason, mode])
        };
        let exceeded = exceeded_reason(rule);
        RuleCounters {
            allow: c("allow", "", "enforce"),
            reject: c("reject", exceeded, "enforce"),
            reject_cost: c("reject", "cost_exceeds_limit", "enforce"),
            shadow_allow: c("allow", "", "shadow"),
            refunded: c("refunded", "", "enforce"),
            shadow_would_reject: c("would_reject", exceeded, "shadow"),
            shadow_would_reject_total: self
                .families
                .shadow_would_reject
                .with_label_values(&[policy, name]),
        }
    }

    /// Counts a token check (nothing for requests without a token).
    pub fn token(&self, outcome: Result<(), crate::request::auth::InvalidToken>) {
        match outcome {
            Ok(()) => self.families.jwt_valid.inc(),
            Err(reason) => self
                .families
                .jwt_invalid
                .with_label_values(&[reason.as_str()])
                .inc(),
        }
    }

    /// Counts a failed upstream connection (and whether the request tries again, and whether the
    /// server was ejected). Group names come from the gateway file: a bounded set.
    pub fn upstream_connect_failed(&self, group: &str, kind: &str, retried: bool, ejected: bool) {
        self.families
            .upstream_connect_failures
            .with_label_values(&[group, kind])
            .inc();
        if retried {
            self.families
                .upstream_retries
                .with_label_values(&[group])
                .inc();
        }
        if ejected {
            self.families
                .upstream_ejections
                .with_label_values(&[group])
                .inc();
        }
    }

    /// The queue metrics of an upstream group (looked up only when a request has to wait).
    pub fn upstream_queue(&self, group: &str) -> QueueMetrics {
        QueueMetrics {
            waiting: self
                .families
                .upstream_queue_waiting
                .with_label_values(&[group]),
            waits: self
                .families
                .upstream_queue_waits
                .with_label_values(&[group]),
            timeouts: self
                .families
                .upstream_queue_timeouts
                .with_label_values(&[group]),
            abandoned: self
                .families
                .upstream_queue_abandoned
                .with_label_values(&[group]),
        }
    }

    /// Counts an LLM response that could not be decoded. The encoding label is bounded: the
    /// decoded ones by name, anything else as `other`.
    pub fn llm_undecodable(&self, encoding: &str, reason: &str) {
        let encoding = match encoding {
            "gzip" | "deflate" | "br" | "zstd" => encoding,
            _ => "other",
        };
        self.families
            .llm_undecodable
            .with_label_values(&[encoding, reason])
            .inc();
    }

    /// Counts one gRPC call: `service` and `code` from [`GRPC_CODES`].
    pub fn grpc_call(&self, service: &str, code: &str) {
        self.families
            .grpc_calls
            .with_label_values(&[service, code])
            .inc();
    }

    /// A gRPC call through the proxy ended with `status` (`None`: without one). The service
    /// and method are labels while fewer than [`MAX_GRPC_METHOD_LABELS`] pairs were seen.
    pub fn proxied_grpc_call(&self, service: &str, method: &str, status: Option<u16>) {
        const CODES: [&str; 17] = [
            "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
            "16",
        ];
        let code = match status {
            Some(n) => CODES.get(usize::from(n)).copied().unwrap_or("other"),
            None => "none",
        };
        let named = {
            let key = format!("{service}/{method}");
            let mut seen = self.grpc_methods.lock();
            seen.contains(key.as_str())
                || (seen.len() < MAX_GRPC_METHOD_LABELS && seen.insert(key.into_boxed_str()))
        };
        let (service, method) = if named {
            (service, method)
        } else {
            ("other", "other")
        };
        self.families
            .proxied_grpc_calls
            .with_label_values(&[service, method, code])
            .inc();
    }

    /// Every metric family this gateway exports (a labelled family appears in `/metrics` once
    /// it has a series): what the shipped dashboard and alerts may query.
    pub fn defined_names(&self) -> &[&'static str] {
        &self.defined
    }

    /// Counts an operator's bucket reset.
    pub fn admin_reset(&self, held_state: bool) {
        self.families
            .admin_resets
            .with_label_values(&[if held_state { "reset" } else { "full" }])
            .inc();
    }

    /// Counts a zero-downtime upgrade hand-over that did not happen, by its reason.
    pub fn handover_failed(&self, reason: &str) {
        self.families
            .handover_failures
            .with_label_values(&[reason])
            .inc();
    }

    /// Counts an operator endpoint request refused for its token.
    pub fn admin_unauthorized(&self) {
        self.families.admin_refused.inc();
    }

    /// One threshold webhook attempt or crossing, by outcome (`delivered`, `failed`,
    /// `gave_up`, `dropped`).
    pub fn webhook(&self, outcome: &'static str) {
        self.families
            .webhook_deliveries
            .with_label_values(&[outcome])
            .inc();
    }

    /// Usage notes not recorded.
    pub fn usage_notes_dropped(&self, n: u64) {
        self.families.usage_notes_dropped.inc_by(n);
    }

    /// Shows the 403 count of each configured token id from the start (at zero).
    pub fn admin_tokens(&self, ids: impl Iterator<Item = impl AsRef<str>>) {
        for id in ids {
            self.families
                .admin_forbidden
                .with_label_values(&[id.as_ref()]);
        }
    }

    /// Counts an operator request refused 403: the token `id` does not hold the scope.
    pub fn admin_forbidden(&self, id: &str) {
        self.families.admin_forbidden.with_label_values(&[id]).inc();
    }

    /// Counts a debug-session login refused.
    pub fn debug_session_failure(&self, failure: crate::engine::compat::Failure) {
        self.families
            .debug_session_failures
            .with_label_values(&[failure.as_str()])
            .inc();
    }

    pub fn reload(&self, ok: bool) {
        self.families
            .reloads
            .with_label_values(&[if ok { "success" } else { "failure" }])
            .inc();
    }

    /// Counts a network-file reload refused by the shrink guard (`file`: its metric label).
    pub fn network_reload_rejected(&self, file: &str) {
        self.families
            .network_reloads_rejected
            .with_label_values(&[file])
            .inc();
    }

    /// Records one decision and how long it took.
    pub fn record(&self, decision: &Decision<'_>, seconds: f64) {
        self.families.latency.observe(seconds);
        let index = match decision.outcome() {
            Outcome::Allow => 0,
            Outcome::NoPolicy => 1,
            Outcome::Reject(reason) => {
                2 + Reason::ALL.iter().position(|r| *r == reason).unwrap_or(0)
            }
        };
        self.request_counters[index].inc();
        let Some(checked) = decision.checked() else {
            return;
        };
        if checked.store_error {
            self.families.store_errors.inc();
        }
        if let Some(local) = &self.local {
            local.record(checked);
        }
        if let Some(rule) = checked.shadow_missing {
            self.labelled(
                rule,
                "would_reject",
                "missing_descriptor",
                Mode::Shadow.as_str(),
            );
        }
        let table = self.per_rule.load();
        self.record_slots(decision, checked);
        let table = table.as_ref().and_then(|t| t.of(checked.bundle));
        self.record_rules(checked, table, decision.is_allowed());
    }

    /// One rule's decision counted under labels (`tollgate_decisions_total`, and
    /// `tollgate_shadow_would_reject_total` for a shadow rule's refusal).
    fn labelled(&self, rule: &crate::policy::Rule, action: &str, reason: &str, mode: &str) {
        let (policy, name) = (&rule.policy_id, &rule.name);
        self.families
            .decisions
            .with_label_values(&[policy, name, action, reason, mode])
            .inc();
        if action == "would_reject" {
            self.families
                .shadow_would_reject
                .with_label_values(&[policy, name])
                .inc();
        }
    }

    /// Concurrency rules and guards, counted by label (they are few, and not per token). A
    /// loop that only warns or throttles is counted as such.
    fn record_slots(&self, decision: &Decision<'_>, checked: &crate::engine::Checked<'_>) {
        for slot in &checked.slots {
            let soft = match slot.rule.guard() {
                Some(crate::policy::Guard::Loop(d)) => match d.action {
                    crate::policy::LoopAction::Warn => Some("warn"),
                    crate::policy::LoopAction::Throttle => Some("throttle"),
                    crate::policy::LoopAction::Reject => None,
                },
                _ => None,
            };
            let (action, reason) = match (slot.rule.mode, slot.allowed, soft) {
                (Mode::Enforce, true, _) if decision.is_allowed() => ("allow", ""),
                (Mode::Enforce, true, _) => ("refunded", ""),
                (Mode::Enforce, false, Some(action)) => (action, slot.reason().as_str()),
                (Mode::Enforce, false, None) => ("reject", slot.reason().as_str()),
                (Mode::Shadow, true, _) => ("allow", ""),
                (Mode::Shadow, false, _) => ("would_reject", slot.reason().as_str()),
            };
            self.labelled(slot.rule, action, reason, slot.rule.mode.as_str());
        }
    }

    /// Token-bucket and budget rules, on the counters resolved for the bundle in force
    /// (`table`); under labels when a reload raced the request.
    fn record_rules(
        &self,
        checked: &crate::engine::Checked<'_>,
        table: Option<&[LazyCounters]>,
        allowed: bool,
    ) {
        for outcome in &checked.rules {
            let rule = outcome.rule;
            let counters = table
                .and_then(|t| t.get(rule.index))
                .map(|lazy| lazy.get_or_init(|| self.rule_counters(rule)));
            let Some(counters) = counters else {
                // A reload raced this request: count it under labels.
                let (action, reason) = match (rule.mode, outcome.allowed) {
                    (_, true) => ("allow", ""),
                    (Mode::Enforce, false) if outcome.cost_exceeds => {
                        ("reject", "cost_exceeds_limit")
                    }
                    (Mode::Enforce, false) => ("reject", exceeded_reason(rule)),
                    (Mode::Shadow, false) => ("would_reject", exceeded_reason(rule)),
                };
                self.labelled(rule, action, reason, rule.mode.as_str());
                continue;
            };
            match (rule.mode, outcome.allowed) {
                (Mode::Enforce, true) if allowed => counters.allow.inc(),
                // Allowed by this rule, but another rule refused the request.
                (Mode::Enforce, true) => counters.refunded.inc(),
                (Mode::Enforce, false) if outcome.cost_exceeds => counters.reject_cost.inc(),
                (Mode::Enforce, false) => counters.reject.inc(),
                (Mode::Shadow, true) => counters.shadow_allow.inc(),
                (Mode::Shadow, false) => {
                    counters.shadow_would_reject.inc();
                    counters.shadow_would_reject_total.inc();
                }
            }
        }
    }

    /// Counts a circuit breaker tripped by a request (`rule` is the breaker's).
    pub fn breaker_tripped(&self, rule: &crate::policy::Rule) {
        self.families
            .breaker_trips
            .with_label_values(&[&rule.policy_id, rule.mode.as_str()])
            .inc();
    }

    /// Counts an LLM reservation settled: what each rule reserved, what was used, the
    /// difference refunded or charged, how the usage was known, and (when the upstream reported
    /// prompt tokens) how close the prompt estimate was.
    pub fn llm_settled(
        &self,
        reservation: &crate::engine::Reservation,
        used: u64,
        reported_prompt: Option<u64>,
        source: &str,
    ) {
        self.families
            .llm_settlements
            .with_label_values(&[source])
            .inc();
        for rule in &reservation.rules {
            let labels = [rule.policy.as_str(), rule.rule.as_str()];
            let [reserved, used_total, refunded, overrun] = &self.llm_tokens;
            reserved.with_label_values(&labels).inc_by(rule.tokens);
            used_total.with_label_values(&labels).inc_by(used);
            refunded
                .with_label_values(&labels)
                .inc_by(rule.tokens.saturating_sub(used));
            overrun
                .with_label_values(&labels)
                .inc_by(used.saturating_sub(rule.tokens));
        }
        if let (Some(actual), Some(rule)) = (
            reported_prompt.filter(|p| *p > 0),
            reservation.rules.first(),
        ) {
            self.families
                .llm_estimate_ratio
                .observe(rule.prompt_tokens as f64 / actual as f64);
        }
    }

    /// A paced request starts waiting (`true`) or stops (`false`).
    pub fn paced_waiting(&self, started: bool) {
        if started {
            self.families.paced_waiting.inc();
        } else {
            self.families.paced_waiting.dec();
        }
    }

    /// How a paced request's wait ended (`served`, `client_gone`, `drained`, `full`), and
    /// for a served one how long it waited.
    pub fn paced(&self, outcome: &'static str, waited: Option<std::time::Duration>) {
        self.families.paced.with_label_values(&[outcome]).inc();
        if let Some(waited) = waited {
            self.families.paced_waits.observe(waited.as_secs_f64());
        }
    }

    /// What `llm_spend` budgets were charged once a reservation settled (in millionths).
    pub fn llm_spent(
        &self,
        reservation: &crate::engine::Reservation,
        settled: &[crate::engine::decision::SpendSettled],
    ) {
        for (op, settled) in reservation.spend.iter().zip(settled) {
            self.families
                .llm_spend
                .with_label_values(&[op.policy.as_str(), op.rule.as_str(), op.model.as_str()])
                .inc_by(settled.charged);
        }
    }

    /// A request refused with 431 for its header block (`limit`: `bytes` or `lines`).
    pub fn request_headers_refused(&self, limit: &str) {
        self.families
            .request_headers_refused
            .with_label_values(&[limit])
            .inc();
    }

    /// The counter of connections refused by `cap` (the proxy's connection guard counts them).
    pub fn connections_refused(&self, cap: &str) -> IntCounter {
        self.families.connections_refused.with_label_values(&[cap])
    }

    /// Sets the gauges that follow the bundle in force and the time: runtime overrides active
    /// at `unix_secs`, policies skipped.
    pub fn bundle_state(&self, bundle: Option<&Bundle>, unix_secs: i64) {
        let active = |on: bool| i64::from(on);
        self.families
            .runtime_overrides
            .with_label_values(&["global_shadow"])
            .set(active(
                bundle.is_some_and(|b| b.global_shadow_active(unix_secs)),
            ));
        self.families
            .runtime_overrides
            .with_label_values(&["kill_switch_override"])
            .set(active(
                bundle.is_some_and(|b| b.kill_switch_override_active(unix_secs)),
            ));
        self.families
            .policies_skipped
            .set(bundle.map_or(0, |b| b.skipped.len() as i64));
    }

    /// Prometheus text, with store gauges refreshed from `stats`.
    pub fn render(&self, stats: StoreStats) -> String {
        let _serialised = self.render_lock.lock();
        if let (Some(gauge), Some(entries)) = (&self.families.store_entries, stats.entries) {
            gauge.set(entries as i64);
        }
        // The store keeps the running totals; counters only move forward to meet them.
        if let Some(counter) = &self.families.store_evictions {
            advance_to(counter, stats.evictions);
        }
        if let Some(by_kind) = &self.families.store_evictions_by_kind {
            let e = stats.evicted;
            for (kind, total) in
                EVICTION_KINDS
                    .iter()
                    .zip([e.full_again, e.token_bucket, e.budget, e.unknown_spend])
            {
                advance_to(&by_kind.with_label_values(&[kind]), total);
            }
        }
        if let Some(histogram) = &self.families.store_forgiven {
            *histogram.latest.lock() = stats.evicted;
        }
        if let Some(counter) = &self.families.store_fail_open {
            advance_to(counter, stats.fail_open);
        }
        if let (Some(gauge), Some(held)) = (&self.families.loop_marks, stats.loop_marks) {
            gauge.set(held as i64);
        }
        if let Some(counter) = &self.families.loop_marks_evicted {
            advance_to(counter, stats.loop_marks_evicted);
        }
        advance_to(
            &self.families.log_lines_dropped,
            crate::telemetry::log_line::DROPPED.load(std::sync::atomic::Ordering::Relaxed),
        );
        if let Some(gauge) = &self.families.state_dir_fallback {
            gauge.set(i64::from(stats.state_fallback == Some(true)));
        }
        if let (Some(metrics), Some(local)) = (&self.local, stats.local) {
            metrics.render(local);
        }
        if let Some(gauge) = &self.families.store_clock_skew {
            *gauge.latest.lock() = stats.clock_skew_us;
        }
        let mut buf = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .is_err()
        {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// A shared store's local mode (see [`crate::store::local`]): whether this gateway decides
/// locally now, N, the decisions made so by rule and outcome, and the write-backs.
struct LocalMetrics {
    mode: IntGauge,
    gateways: IntGauge,
    decisions: IntCounterVec,
    write_backs: IntCounterVec,
    pending: IntGauge,
}

impl LocalMetrics {
    /// The local mode's families, when the store is a shared one.
    fn of(families: &Families) -> Option<LocalMetrics> {
        Some(LocalMetrics {
            mode: families.local_mode.clone()?,
            gateways: families.fleet_gateways.clone()?,
            decisions: families.local_decisions.clone()?,
            write_backs: families.write_backs.clone()?,
            pending: families.write_back_pending.clone()?,
        })
    }

    /// Counts a decision's rule checks made without the store.
    fn record(&self, checked: &crate::engine::Checked<'_>) {
        use crate::policy::OnStoreError;
        for outcome in &checked.rules {
            let Some(away) = outcome.away else {
                continue;
            };
            let label = match away {
                OnStoreError::Local if outcome.allowed => "allowed",
                OnStoreError::Local => "rejected",
                OnStoreError::Open => "open",
                OnStoreError::Closed => "closed",
            };
            self.decisions
                .with_label_values(&[&outcome.rule.policy_id, &outcome.rule.name, label])
                .inc();
        }
    }

    fn render(&self, local: crate::store::LocalStats) {
        self.mode.set(i64::from(local.local_mode));
        self.gateways.set(local.gateways as i64);
        self.pending.set(local.pending as i64);
        for (outcome, total) in WRITE_BACK_OUTCOMES.into_iter().zip(local.write_backs) {
            advance_to(&self.write_backs.with_label_values(&[outcome]), total);
        }
    }
}

/// The candidate bundle's metrics. Cloned handles share their series: a candidate's own
/// counters live with it, and a shared store's candidate calls count from their tasks.
#[derive(Clone)]
pub(crate) struct CandidateMetrics {
    /// `tollgate_candidate_would_refuse_total{policy,rule}`.
    pub(crate) would_refuse: IntCounterVec,
    /// `tollgate_candidate_decisions_total`: requests decided under the candidate.
    pub(crate) decisions: IntCounter,
    /// `tollgate_candidate_skipped_total`: requests not decided under the candidate because too
    /// many of its shared-store calls were outstanding (or no runtime could run one).
    pub(crate) skipped: IntCounter,
    /// `tollgate_candidate_info{version,hash}`: 1 while a candidate is set.
    pub(crate) info: IntGaugeVec,
}

impl CandidateMetrics {
    fn of(families: &Families) -> CandidateMetrics {
        CandidateMetrics {
            would_refuse: families.candidate_would_refuse.clone(),
            decisions: families.candidate_decisions.clone(),
            skipped: families.candidate_skipped.clone(),
            info: families.candidate_info.clone(),
        }
    }

    /// A new candidate (or none): its counts start from zero.
    pub(crate) fn set(&self, candidate: Option<(&str, &str)>) {
        self.would_refuse.reset();
        self.decisions.reset();
        self.skipped.reset();
        self.info.reset();
        if let Some((version, hash)) = candidate {
            self.info.with_label_values(&[version, hash]).set(1);
        }
    }
}

/// The `kind` label values of `tollgate_store_evictions_by_kind_total`.
const EVICTION_KINDS: [&str; 4] = ["full_again", "token_bucket", "budget", "unknown_spend"];

/// `tollgate_store_eviction_forgiven_tokens`: the embedded store's evictions for room by the
/// tokens the evicted entry still had spent (what its next request gets back). The store keeps
/// the running counts; each scrape shows the latest it handed to [`Metrics::render`].
#[derive(Clone)]
struct ForgivenHistogram {
    desc: prometheus::core::Desc,
    latest: Arc<parking_lot::Mutex<crate::store::EvictionStats>>,
}

impl ForgivenHistogram {
    fn new(spec: &MetricSpec) -> prometheus::Result<Self> {
        Ok(ForgivenHistogram {
            desc: prometheus::core::Desc::new(
                spec.name.to_string(),
                spec.help.to_string(),
                Vec::new(),
                std::collections::HashMap::new(),
            )?,
            latest: Arc::default(),
        })
    }
}

impl prometheus::core::Collector for ForgivenHistogram {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        use prometheus::proto;
        let stats = *self.latest.lock();
        let micro = crate::limits::limiter::MICRO as f64;
        let buckets = crate::store::FORGIVEN_BOUNDS_MICRO
            .iter()
            .zip(stats.forgiven_le)
            .map(|(&bound, count)| {
                let mut b = proto::Bucket::default();
                b.set_upper_bound(bound as f64 / micro);
                b.set_cumulative_count(count);
                b
            })
            .collect();
        let mut histogram = proto::Histogram::default();
        histogram.set_sample_count(stats.forgiven_count);
        histogram.set_sample_sum(stats.forgiven_sum_micro as f64 / micro);
        histogram.set_bucket(buckets);
        let mut metric = proto::Metric::default();
        metric.set_histogram(histogram);
        let mut family = proto::MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(proto::MetricType::HISTOGRAM);
        family.mut_metric().push(metric);
        vec![family]
    }
}

/// `tollgate_store_clock_skew_seconds`: the gateway's wall clock minus the shared store's, as
/// last measured ([`StoreStats::clock_skew_us`]). No series until a first measurement: a 0
/// would claim clocks in step that nobody compared.
#[derive(Clone)]
struct ClockSkewGauge {
    desc: prometheus::core::Desc,
    latest: Arc<parking_lot::Mutex<Option<i64>>>,
}

impl ClockSkewGauge {
    fn new(spec: &MetricSpec) -> prometheus::Result<Self> {
        Ok(ClockSkewGauge {
            desc: prometheus::core::Desc::new(
                spec.name.to_string(),
                spec.help.to_string(),
                Vec::new(),
                std::collections::HashMap::new(),
            )?,
            latest: Arc::default(),
        })
    }
}

impl prometheus::core::Collector for ClockSkewGauge {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        use prometheus::proto;
        let Some(skew_us) = *self.latest.lock() else {
            return Vec::new();
        };
        let mut gauge = proto::Gauge::default();
        gauge.set_value(skew_us as f64 / 1e6);
        let mut metric = proto::Metric::default();
        metric.set_gauge(gauge);
        let mut family = proto::MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(proto::MetricType::GAUGE);
        family.mut_metric().push(metric);
        vec![family]
    }
}

/// The `reason` label of a rule refusing for want of tokens: its budget or its bucket.
fn exceeded_reason(rule: &crate::policy::Rule) -> &'static str {
    if matches!(rule.guard(), Some(crate::policy::Guard::Breaker(_))) {
        Reason::CircuitBreakerOpen.as_str()
    } else if rule.budget().is_some() {
        Reason::BudgetExceeded.as_str()
    } else {
        Reason::TokenBucketExceeded.as_str()
    }
}

fn advance_to(counter: &IntCounter, total: u64) {
    let seen = counter.get();
    if total > seen {
        counter.inc_by(total - seen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{decide_local, EngineConfig};
    use crate::policy::compile_bundle;
    use crate::request::descriptor::RequestFacts;
    use crate::store::{MemoryStore, MemoryStoreConfig};
    use serde_json::json;

    #[test]
    fn counters_move_with_decisions() {
        let metrics = Metrics::new("memory").unwrap();
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let bundle = Arc::new(compile_bundle(&json!({"bundle_version": 7, "policies": [
            {"id": "p", "spec": {"rules": [{"name": "r", "limit_keys": [], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}]}},
            {"id": "s", "spec": {"mode": "shadow", "rules": [{"name": "sh", "limit_keys": [], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}]}}
        ]}), "x").unwrap());
        metrics.on_install(&bundle);
        let headers: Vec<(String, String)> = Vec::new();
        let facts = RequestFacts::from_uri("GET", "/", None, None, &headers);
        for _ in 0..3 {
            let decision = decide_local(&bundle, &facts, &store, 0, 0, EngineConfig::default());
            metrics.record(&decision, 1e-6);
        }
        let text = metrics.render(store.stats());
        for line in [
            "tollgate_decisions_total{action=\"allow\",mode=\"enforce\",policy=\"p\",reason=\"\",rule=\"r\"} 1",
            "tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"p\",reason=\"token_bucket_exceeded\",rule=\"r\"} 2",
            "tollgate_shadow_would_reject_total{policy=\"s\",rule=\"sh\"} 2",
            "tollgate_decisions_total{action=\"would_reject\",mode=\"shadow\",policy=\"s\",reason=\"token_bucket_exceeded\",rule=\"sh\"} 2",
            "tollgate_requests_total{action=\"reject\",reason=\"token_bucket_exceeded\"} 2",
            "tollgate_decision_duration_seconds_count 3",
            "tollgate_store_entries 2",
            "tollgate_store_evictions_by_kind_total{kind=\"budget\"} 0",
            "tollgate_store_evictions_by_kind_total{kind=\"unknown_spend\"} 0",
            "tollgate_store_eviction_forgiven_tokens_bucket{le=\"1\"} 0",
            "tollgate_store_eviction_forgiven_tokens_count 0",
            "tollgate_store_fail_open_total 0",
            "tollgate_policy_info{hash=\"\",version=\"7\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        assert!(
            !text.contains("tollgate_store_clock_skew_seconds"),
            "{text}"
        );
    }

    /// The clock skew gauge: a shared store's only, absent until measured, then in seconds
    /// with its sign (and it stays at the last measurement the store reports).
    #[test]
    fn clock_skew_shows_once_measured_in_seconds() {
        let name = "tollgate_store_clock_skew_seconds";
        assert!(!Metrics::new("memory")
            .unwrap()
            .defined_names()
            .contains(&name));
        for kind in ["redis", "postgres"] {
            let metrics = Metrics::new(kind).unwrap();
            assert!(metrics.defined_names().contains(&name));
            assert!(!metrics.render(StoreStats::default()).contains(name));
            let at = |skew_us| StoreStats {
                clock_skew_us: Some(skew_us),
                ..StoreStats::default()
            };
            let text = metrics.render(at(3_000_250));
            assert!(
                text.contains("\ntollgate_store_clock_skew_seconds 3.00025\n"),
                "{text}"
            );
            assert!(
                text.contains("# TYPE tollgate_store_clock_skew_seconds gauge"),
                "{text}"
            );
            let text = metrics.render(at(-1_500_000));
            assert!(
                text.contains("\ntollgate_store_clock_skew_seconds -1.5\n"),
                "{text}"
            );
        }
    }

    /// The table is what is registered: for each store, exactly its rows, in its order, and
    /// every family `/metrics` shows is one of them (with the help and type of its row).
    #[test]
    fn every_store_registers_exactly_its_rows_of_the_table() {
        for kind in ["memory", "state_dir", "redis", "postgres"] {
            let metrics = Metrics::new(kind).unwrap();
            let rows: Vec<&str> = METRICS
                .iter()
                .filter(|m| m.scope.includes(kind))
                .map(|m| m.name)
                .collect();
            assert_eq!(metrics.defined_names(), rows.as_slice(), "{kind}");
            let text = metrics.render(StoreStats {
                clock_skew_us: Some(1),
                ..StoreStats::default()
            });
            for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
                let mut words = line.split_whitespace().skip(2);
                let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                    panic!("{line}");
                };
                let row = METRICS.iter().find(|m| m.name == name);
                let Some(row) = row else {
                    panic!("{name} is not in the table");
                };
                let expected = match row.kind {
                    MetricKind::Counter => "counter",
                    MetricKind::Gauge => "gauge",
                    MetricKind::Histogram => "histogram",
                };
                assert_eq!(kind, expected, "{name}");
                assert!(
                    text.contains(&format!("# HELP {name} {}\n", row.help)),
                    "{name}"
                );
            }
        }
        let names: std::collections::BTreeSet<&str> = METRICS.iter().map(|m| m.name).collect();
        assert_eq!(names.len(), METRICS.len(), "a name twice");
    }
}
