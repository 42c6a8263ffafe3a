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
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
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
    fn new(registry: &Registry, defined: &mut Vec<String>) -> PolicySourceMetrics {
        let bundle_info = must(IntGaugeVec::new(
            Opts::new(
                "tollgate_bundle_info",
                "The bundle in force (value 1): its version (published, or its own bundle_version), SHA-256 and source (file, state_dir, redis, redis-cluster, postgres, http)",
            ),
            &["version", "hash", "source"],
        ));
        let rejected = must(IntCounterVec::new(
            Opts::new(
                "tollgate_policy_source_rejected_total",
                "Published bundles --policy-store did not put in force (the last good one kept), by slot and reason",
            ),
            &["slot", "reason"],
        ));
        let up = must(IntGauge::new(
            "tollgate_policy_source_up",
            "1 while the --policy-store answers, 0 while it is unreachable",
        ));
        let expiry = must(IntGauge::new(
            "tollgate_bundle_expiry_timestamp_seconds",
            "When the live bundle in force from --policy-store expires (Unix seconds; 0 without an expiry): alert when it is less than a week away",
        ));
        defined.extend(names_of(&bundle_info));
        defined.extend(names_of(&rejected));
        defined.extend(names_of(&up));
        defined.extend(names_of(&expiry));
        must(registry.register(Box::new(bundle_info.clone())));
        must(registry.register(Box::new(rejected.clone())));
        must(registry.register(Box::new(up.clone())));
        must(registry.register(Box::new(expiry.clone())));
        PolicySourceMetrics {
            bundle_info,
            rejected,
            up,
            expiry,
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
    decisions: IntCounterVec,
    /// `tollgate_requests_total` resolved once per (action, reason): a labelled lookup hashes the labels and
    /// takes the vector's read lock, shared by every core, on each request.
    request_counters: [IntCounter; 2 + Reason::ALL.len()],
    shadow_would_reject: IntCounterVec,
    latency: Histogram,
    /// Registered only for a store that reports them (`None` otherwise: a fleet's shared store
    /// has no local entries to count, and must not show a gauge stuck at 0).
    store_entries: Option<IntGauge>,
    store_evictions: Option<IntCounter>,
    /// The embedded store's drops by kind (`full_again`, `token_bucket`, `budget`,
    /// `unknown_spend`), and its
    /// evictions for room by what they gave away.
    store_evictions_by_kind: Option<IntCounterVec>,
    store_forgiven: Option<ForgivenHistogram>,
    store_fail_open: Option<IntCounter>,
    /// Loop marks held by the embedded store, and forgotten for room.
    loop_marks: Option<IntGauge>,
    loop_marks_evicted: Option<IntCounter>,
    state_dir_fallback: Option<IntGauge>,
    /// A shared store's local mode (`None` for the embedded store).
    local: Option<LocalMetrics>,
    /// A shared store's clock skew (absent before its first measurement).
    store_clock_skew: Option<ClockSkewGauge>,
    store_errors: IntCounter,
    reloads: IntCounterVec,
    /// Network-file reloads refused by the shrink guard, by file (`tor_exits`...).
    network_reloads_rejected: IntCounterVec,
    policy_info: IntGaugeVec,
    /// `tollgate_bundle_info` and the `--policy-store` follower's counters.
    pub policy_source: PolicySourceMetrics,
    runtime_overrides: IntGaugeVec,
    policies_skipped: IntGauge,
    connections_refused: IntCounterVec,
    /// Requests refused with 431 by the proxy's header limits, by limit (`bytes`, `lines`).
    request_headers_refused: IntCounterVec,
    breaker_trips: IntCounterVec,
    /// `token_bucket_llm`: tokens reserved, really used, refunded and charged past the
    /// reservation, by policy and rule; settlements by how the usage was known; prompt estimates
    /// over the prompt tokens the response reported.
    llm_tokens: [IntCounterVec; 4],
    llm_settlements: IntCounterVec,
    llm_estimate_ratio: Histogram,
    jwt_valid: IntCounter,
    jwt_invalid: IntCounterVec,
    grpc_calls: IntCounterVec,
    /// Upstream connection failures by group and kind, retries and ejections by group.
    upstream_connect_failures: IntCounterVec,
    upstream_retries: IntCounterVec,
    upstream_ejections: IntCounterVec,
    /// The per-server connection cap's queue, by group.
    upstream_queue_waiting: IntGaugeVec,
    upstream_queue_waits: prometheus::HistogramVec,
    upstream_queue_timeouts: IntCounterVec,
    upstream_queue_abandoned: IntCounterVec,
    llm_undecodable: IntCounterVec,
    /// Operator actions: bucket resets by the store's answer (`reset`: it held state, `full`:
    /// nothing to reset), admin requests refused for their token.
    admin_resets: IntCounterVec,
    handover_failures: IntCounterVec,
    admin_refused: IntCounter,
    /// `POST /v1/debug/session` refusals by reason (`no_secret`, `wrong_secret`, `throttled`).
    debug_session_failures: IntCounterVec,
    /// Per-request log lines (access log, RATE_LIMIT) dropped because their reader fell behind.
    log_lines_dropped: IntCounter,
    /// Sampled spans not exported: a full queue, a failed batch, a back-off (`src/telemetry/`).
    trace_spans_dropped: IntCounter,
    per_rule: ArcSwapOption<BundleCounters>,
    /// The candidate bundle decided in shadow (`src/service/candidate.rs`): what it would
    /// refuse by policy and rule, the requests it decided, the decisions skipped, and its
    /// version and hash while one is set.
    pub(crate) candidate: CandidateMetrics,
    /// The name of every metric family registered, series or not.
    defined: Vec<String>,
    /// Serialises `render` so two scrapes cannot both advance the store counters.
    render_lock: parking_lot::Mutex<()>,
}

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

fn must<T>(r: prometheus::Result<T>) -> T {
    // Metric definitions are fixed at compile time; a failure here is a programming error
    // caught by the unit test below, never user input.
    r.expect("static metric definition")
}

impl Metrics {
    /// The counter of spans a full export queue dropped (handed to the telemetry's processor).
    pub fn trace_spans_dropped(&self) -> prometheus::IntCounter {
        self.trace_spans_dropped.clone()
    }

    /// Metrics for a gateway whose store is of `store_kind` (`memory`, `state_dir`, `redis`,
    /// `postgres`: [`crate::store::Store::kind`]).
    pub fn new(store_kind: &str) -> Self {
        let registry = Registry::new();
        let mut defined = Vec::new();
        let decisions = must(IntCounterVec::new(
            Opts::new("tollgate_decisions_total", "Rule evaluations by outcome"),
            &["policy", "rule", "action", "reason", "mode"],
        ));
        let requests = must(IntCounterVec::new(
            Opts::new(
                "tollgate_requests_total",
                "Requests decided, by overall action and reason",
            ),
            &["action", "reason"],
        ));
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
        ]
        .map(|(action, reason)| requests.with_label_values(&[action, reason]));
        let shadow_would_reject = must(IntCounterVec::new(
            Opts::new(
                "tollgate_shadow_would_reject_total",
                "Shadow-mode rules that would have rejected",
            ),
            &["policy", "rule"],
        ));
        let latency = must(Histogram::with_opts(
            HistogramOpts::new(
                "tollgate_decision_duration_seconds",
                "Time to decide one request",
            )
            .buckets(vec![
                1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 2.5e-2,
            ]),
        ));
        let embedded = matches!(store_kind, "memory" | "state_dir");
        let store_entries = embedded.then(|| {
            must(IntGauge::new(
                "tollgate_store_entries",
                "Buckets held by the embedded store",
            ))
        });
        let store_evictions = (embedded || store_kind == "postgres").then(|| {
            must(IntCounter::new(
                "tollgate_store_evictions_total",
                "Buckets dropped by the store (full again: indistinguishable from fresh)",
            ))
        });
        let store_evictions_by_kind = embedded.then(|| {
            let vec = must(IntCounterVec::new(
                Opts::new(
                    "tollgate_store_evictions_by_kind_total",
                    "Buckets dropped by the embedded store, by kind: full_again (gave nothing away), token_bucket and budget (evicted for room while holding spend), unknown_spend (written by an older build, spend not kept)",
                ),
                &["kind"],
            ));
            for kind in EVICTION_KINDS {
                vec.with_label_values(&[kind]);
            }
            vec
        });
        let store_forgiven = embedded.then(ForgivenHistogram::new);
        let store_fail_open = embedded.then(|| {
            must(IntCounter::new(
                "tollgate_store_fail_open_total",
                "Requests allowed untracked because the embedded store had no room: a new key with nothing to evict (stays 0: a full store evicts), or a concurrency slot or breaker its lease table could not hold",
            ))
        });
        let loop_marks = embedded.then(|| {
            must(IntGauge::new(
                "tollgate_store_loop_marks",
                "Loop-detection marks held by the embedded store (at most --max-loop-marks)",
            ))
        });
        let loop_marks_evicted = embedded.then(|| {
            must(IntCounter::new(
                "tollgate_store_loop_marks_evicted_total",
                "Loop-detection marks forgotten for room at --max-loop-marks (each one identical request a loop count missed)",
            ))
        });
        let state_dir_fallback = embedded.then(|| {
            must(IntGauge::new(
                "tollgate_state_dir_fallback",
                "1 when --state-dir was given but the buckets are in process memory (the state file could not be made or mapped)",
            ))
        });
        let store_clock_skew = matches!(store_kind, "redis" | "postgres").then(ClockSkewGauge::new);
        let store_info = must(IntGaugeVec::new(
            Opts::new("tollgate_store_info", "The store in use (value 1)"),
            &["kind"],
        ));
        store_info.with_label_values(&[store_kind]).set(1);
        let store_errors = must(IntCounter::new(
            "tollgate_store_errors_total",
            "Requests allowed because the store failed (fail-open)",
        ));
        let admin_resets = must(IntCounterVec::new(
            Opts::new(
                "tollgate_admin_resets_total",
                "Buckets reset by an operator (DELETE /v1/buckets), by whether the store held state for them",
            ),
            &["result"],
        ));
        for result in ["reset", "full"] {
            admin_resets.with_label_values(&[result]);
        }
        let handover_failures = must(IntCounterVec::new(
            Opts::new(
                "tollgate_upgrade_handover_failures_total",
                "Zero-downtime upgrade hand-overs that did not happen, by reason (no_taker, stranger, unconfirmed, nothing_received, malformed, untrusted_dir, no_socket, io); the old process keeps serving",
            ),
            &["reason"],
        ));
        for reason in [
            "no_taker",
            "stranger",
            "unconfirmed",
            "nothing_received",
            "malformed",
            "untrusted_dir",
            "no_socket",
            "io",
        ] {
            handover_failures.with_label_values(&[reason]);
        }
        let log_lines_dropped = must(IntCounter::new(
            "tollgate_log_lines_dropped_total",
            "Access-log and RATE_LIMIT lines dropped because standard output or error was not read fast enough",
        ));
        let trace_spans_dropped = must(IntCounter::new(
            "tollgate_trace_spans_dropped_total",
            "Sampled trace spans not exported: the OTLP export queue (OTEL_BSP_MAX_QUEUE_SIZE) was full, their batch failed, or the export was backing off from a failing collector",
        ));
        let admin_refused = must(IntCounter::new(
            "tollgate_admin_unauthorized_total",
            "Operator endpoint requests refused for a missing or wrong admin token",
        ));
        let debug_session_failures = must(IntCounterVec::new(
            Opts::new(
                "tollgate_debug_session_failures_total",
                "Debug-session logins refused: no secret, a wrong one, or a client throttled after too many",
            ),
            &["reason"],
        ));
        for failure in crate::engine::compat::Failure::ALL {
            debug_session_failures.with_label_values(&[failure.as_str()]);
        }
        let reloads = must(IntCounterVec::new(
            Opts::new("tollgate_policy_reloads_total", "Policy loads by result"),
            &["result"],
        ));
        let network_reloads_rejected = must(IntCounterVec::new(
            Opts::new(
                "tollgate_network_reloads_rejected_total",
                "Network-file reloads refused because the file came back empty or with fewer than half the entries in force (the data in force kept), by file (geoip_db, asn_type_map, tor_exits)",
            ),
            &["file"],
        ));
        for file in crate::request::network::NetworkFile::METRIC_LABELS {
            network_reloads_rejected.with_label_values(&[file]);
        }
        let policy_info = must(IntGaugeVec::new(
            Opts::new(
                "tollgate_policy_info",
                "The policy bundle in force (value 1)",
            ),
            &["version", "hash"],
        ));
        let policy_source = PolicySourceMetrics::new(&registry, &mut defined);
        let runtime_overrides = must(IntGaugeVec::new(
            Opts::new(
                "tollgate_runtime_override_active",
                "Runtime overrides of the bundle in force: 1 while active (global_shadow, kill_switch_override)",
            ),
            &["override"],
        ));
        for name in ["global_shadow", "kill_switch_override"] {
            runtime_overrides.with_label_values(&[name]);
        }
        let connections_refused = must(IntCounterVec::new(
            Opts::new(
                "tollgate_connections_refused_total",
                "Client connections refused at accept, by cap (per_ip)",
            ),
            &["cap"],
        ));
        connections_refused.with_label_values(&["per_ip"]);
        let request_headers_refused = must(IntCounterVec::new(
            Opts::new(
                "tollgate_request_headers_refused_total",
                "Requests refused with 431 for a header block over --max-request-header-bytes (bytes) or --max-request-headers (lines)",
            ),
            &["limit"],
        ));
        for limit in ["bytes", "lines"] {
            request_headers_refused.with_label_values(&[limit]);
        }
        let breaker_trips = must(IntCounterVec::new(
            Opts::new(
                "tollgate_circuit_breaker_trips_total",
                "Circuit breakers opened by a request's spend, by policy and mode",
            ),
            &["policy", "mode"],
        ));
        let llm_tokens = [
            (
                "reserved",
                "Tokens reserved by token_bucket_llm rules before the upstream answered",
            ),
            (
                "used",
                "Tokens the upstream's responses really used, as settled",
            ),
            (
                "refunded",
                "Reserved tokens given back because the response used fewer",
            ),
            (
                "overrun",
                "Tokens charged beyond the reservation because the response used more",
            ),
        ]
        .map(|(kind, help)| {
            must(IntCounterVec::new(
                Opts::new(format!("tollgate_llm_tokens_{kind}_total"), help),
                &["policy", "rule"],
            ))
        });
        let llm_settlements = must(IntCounterVec::new(
            Opts::new(
                "tollgate_llm_settlements_total",
                "LLM reservations settled, by where the usage came from (usage: the response's usage object; estimate: counted from the text streamed; stopped: a stream stopped past max_completion_tokens, counted from the text let through; unused: nothing came back, all refunded; report: POST /v1/usage; expired: never reported, kept as reserved)",
            ),
            &["source"],
        ));
        for source in [
            "usage", "estimate", "stopped", "unused", "report", "expired",
        ] {
            llm_settlements.with_label_values(&[source]);
        }
        let llm_estimate_ratio = must(Histogram::with_opts(
            HistogramOpts::new(
                "tollgate_llm_prompt_estimate_ratio",
                "Prompt token estimates divided by the prompt tokens the upstream reported (1 = exact)",
            )
            .buckets(vec![0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0]),
        ));
        let policies_skipped = must(IntGauge::new(
            "tollgate_policies_skipped",
            "Policies of the bundle in force left out by --skip-invalid-policies",
        ));
        let jwt_valid = must(IntCounter::new(
            "tollgate_jwt_valid_total",
            "Requests with a verified JWT",
        ));
        let jwt_invalid = must(IntCounterVec::new(
            Opts::new(
                "tollgate_jwt_invalid_total",
                "Requests whose JWT was refused, by reason",
            ),
            &["reason"],
        ));
        for reason in crate::request::auth::InvalidToken::ALL {
            jwt_invalid.with_label_values(&[reason.as_str()]);
        }
        let upstream_connect_failures = must(IntCounterVec::new(
            Opts::new(
                "tollgate_upstream_connect_failures_total",
                "Failed connections to upstream servers, by group and kind (refused, timeout, unreachable, reset, tls, other)",
            ),
            &["group", "kind"],
        ));
        let upstream_retries = must(IntCounterVec::new(
            Opts::new(
                "tollgate_upstream_retries_total",
                "Requests tried again after a failed connection, by group",
            ),
            &["group"],
        ));
        let upstream_ejections = must(IntCounterVec::new(
            Opts::new(
                "tollgate_upstream_ejections_total",
                "Servers taken out of their group after consecutive connection failures",
            ),
            &["group"],
        ));
        let upstream_queue_waiting = must(IntGaugeVec::new(
            Opts::new(
                "tollgate_upstream_queue_waiting",
                "Requests waiting now for a free slot of an upstream server at its max_connections, by group",
            ),
            &["group"],
        ));
        let upstream_queue_waits = must(prometheus::HistogramVec::new(
            HistogramOpts::new(
                "tollgate_upstream_queue_wait_seconds",
                "How long requests that had to wait for a free upstream slot waited, by group",
            )
            .buckets(vec![0.001, 0.005, 0.025, 0.1, 0.25, 1.0, 2.5, 10.0, 60.0]),
            &["group"],
        ));
        let upstream_queue_timeouts = must(IntCounterVec::new(
            Opts::new(
                "tollgate_upstream_queue_timeouts_total",
                "Requests answered 503 after waiting queue_timeout_ms for a free upstream slot, by group",
            ),
            &["group"],
        ));
        let upstream_queue_abandoned = must(IntCounterVec::new(
            Opts::new(
                "tollgate_upstream_queue_abandoned_total",
                "Requests that left the upstream queue because their client went away, never sent upstream, by group",
            ),
            &["group"],
        ));
        for c in [
            Box::new(upstream_queue_waiting.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(upstream_queue_waits.clone()),
            Box::new(upstream_queue_timeouts.clone()),
            Box::new(upstream_queue_abandoned.clone()),
        ] {
            defined.extend(c.desc().iter().map(|d| d.fq_name.clone()));
            must(registry.register(c));
        }
        let llm_undecodable = must(IntCounterVec::new(
            Opts::new(
                "tollgate_llm_undecodable_responses_total",
                "LLM responses whose Content-Encoding could not be decoded to read their usage (settled as reserved), by encoding and reason",
            ),
            &["encoding", "reason"],
        ));
        for c in [
            &upstream_connect_failures,
            &upstream_retries,
            &upstream_ejections,
            &llm_undecodable,
        ] {
            defined.extend(names_of(c));
            must(registry.register(Box::new(c.clone())));
        }
        let grpc_calls = must(IntCounterVec::new(
            Opts::new(
                "tollgate_grpc_calls_total",
                "gRPC calls from Envoy, by service (ratelimit, authz) and answer",
            ),
            &["service", "code"],
        ));
        for (service, codes) in GRPC_CODES {
            for code in *codes {
                grpc_calls.with_label_values(&[service, code]);
            }
        }
        let candidate = CandidateMetrics::new();
        for c in [
            Box::new(grpc_calls.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(jwt_valid.clone()),
            Box::new(jwt_invalid.clone()),
            Box::new(decisions.clone()),
            Box::new(requests.clone()),
            Box::new(shadow_would_reject.clone()),
            Box::new(latency.clone()),
            Box::new(store_info),
            Box::new(store_errors.clone()),
            Box::new(reloads.clone()),
            Box::new(network_reloads_rejected.clone()),
            Box::new(admin_resets.clone()),
            Box::new(handover_failures.clone()),
            Box::new(admin_refused.clone()),
            Box::new(debug_session_failures.clone()),
            Box::new(log_lines_dropped.clone()),
            Box::new(trace_spans_dropped.clone()),
            Box::new(policy_info.clone()),
            Box::new(runtime_overrides.clone()),
            Box::new(policies_skipped.clone()),
            Box::new(connections_refused.clone()),
            Box::new(request_headers_refused.clone()),
            Box::new(breaker_trips.clone()),
            Box::new(llm_tokens[0].clone()),
            Box::new(llm_tokens[1].clone()),
            Box::new(llm_tokens[2].clone()),
            Box::new(llm_tokens[3].clone()),
            Box::new(llm_settlements.clone()),
            Box::new(llm_estimate_ratio.clone()),
            Box::new(candidate.would_refuse.clone()),
            Box::new(candidate.decisions.clone()),
            Box::new(candidate.skipped.clone()),
            Box::new(candidate.info.clone()),
        ] {
            defined.extend(names_of(c.as_ref()));
            must(registry.register(c));
        }
        for c in [
            store_entries
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            store_evictions
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            store_evictions_by_kind
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            store_forgiven
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            store_fail_open
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            loop_marks
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            loop_marks_evicted
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            state_dir_fallback
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
            store_clock_skew
                .clone()
                .map(|c| Box::new(c) as Box<dyn prometheus::core::Collector>),
        ]
        .into_iter()
        .flatten()
        {
            defined.extend(names_of(c.as_ref()));
            must(registry.register(c));
        }
        let local = (!embedded).then(|| LocalMetrics::new(&registry, &mut defined));
        Metrics {
            registry,
            defined,
            decisions,
            request_counters,
            shadow_would_reject,
            latency,
            store_entries,
            store_evictions,
            store_evictions_by_kind,
            store_forgiven,
            store_fail_open,
            loop_marks,
            loop_marks_evicted,
            state_dir_fallback,
            local,
            store_clock_skew,
            store_errors,
            reloads,
            network_reloads_rejected,
            admin_resets,
            handover_failures,
            admin_refused,
            debug_session_failures,
            log_lines_dropped,
            trace_spans_dropped,
            policy_info,
            policy_source,
            runtime_overrides,
            policies_skipped,
            connections_refused,
            request_headers_refused,
            breaker_trips,
            llm_tokens,
            llm_settlements,
            llm_estimate_ratio,
            jwt_valid,
            jwt_invalid,
            grpc_calls,
            upstream_connect_failures,
            upstream_retries,
            upstream_ejections,
            upstream_queue_waiting,
            upstream_queue_waits,
            upstream_queue_timeouts,
            upstream_queue_abandoned,
            llm_undecodable,
            per_rule: ArcSwapOption::empty(),
            candidate,
            render_lock: parking_lot::Mutex::new(()),
        }
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
        self.policy_info.reset();
        self.policy_info
            .with_label_values(&[&bundle.version.to_string(), &bundle.hash])
            .set(1);
    }

    fn rule_counters(&self, rule: &crate::policy::Rule) -> RuleCounters {
        let policy = rule.policy_id.as_str();
        let name = rule.name.as_str();
        let c = |action: &str, reason: &str, mode: &str| {
            self.decisions
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
            shadow_would_reject_total: self.shadow_would_reject.with_label_values(&[policy, name]),
        }
    }

    /// Counts a token check (nothing for requests without a token).
    pub fn token(&self, outcome: Result<(), crate::request::auth::InvalidToken>) {
        match outcome {
            Ok(()) => self.jwt_valid.inc(),
            Err(reason) => self.jwt_invalid.with_label_values(&[reason.as_str()]).inc(),
        }
    }

    /// Counts a failed upstream connection (and whether the request tries again, and whether the
    /// server was ejected). Group names come from the gateway file: a bounded set.
    pub fn upstream_connect_failed(&self, group: &str, kind: &str, retried: bool, ejected: bool) {
        self.upstream_connect_failures
            .with_label_values(&[group, kind])
            .inc();
        if retried {
            self.upstream_retries.with_label_values(&[group]).inc();
        }
        if ejected {
            self.upstream_ejections.with_label_values(&[group]).inc();
        }
    }

    /// The queue metrics of an upstream group (looked up only when a request has to wait).
    pub fn upstream_queue(&self, group: &str) -> QueueMetrics {
        QueueMetrics {
            waiting: self.upstream_queue_waiting.with_label_values(&[group]),
            waits: self.upstream_queue_waits.with_label_values(&[group]),
            timeouts: self.upstream_queue_timeouts.with_label_values(&[group]),
            abandoned: self.upstream_queue_abandoned.with_label_values(&[group]),
        }
    }

    /// Counts an LLM response that could not be decoded. The encoding label is bounded: the
    /// decoded ones by name, anything else as `other`.
    pub fn llm_undecodable(&self, encoding: &str, reason: &str) {
        let encoding = match encoding {
            "gzip" | "deflate" | "br" | "zstd" => encoding,
            _ => "other",
        };
        self.llm_undecodable
            .with_label_values(&[encoding, reason])
            .inc();
    }

    /// Counts one gRPC call: `service` and `code` from [`GRPC_CODES`].
    pub fn grpc_call(&self, service: &str, code: &str) {
        self.grpc_calls.with_label_values(&[service, code]).inc();
    }

    /// Every metric family this gateway exports (a labelled family appears in `/metrics` once
    /// it has a series): what the shipped dashboard and alerts may query.
    pub fn defined_names(&self) -> &[String] {
        &self.defined
    }

    /// Counts an operator's bucket reset.
    pub fn admin_reset(&self, held_state: bool) {
        self.admin_resets
            .with_label_values(&[if held_state { "reset" } else { "full" }])
            .inc();
    }

    /// Counts a zero-downtime upgrade hand-over that did not happen, by its reason.
    pub fn handover_failed(&self, reason: &str) {
        self.handover_failures.with_label_values(&[reason]).inc();
    }

    /// Counts an operator endpoint request refused for its token.
    pub fn admin_unauthorized(&self) {
        self.admin_refused.inc();
    }

    /// Counts a debug-session login refused.
    pub fn debug_session_failure(&self, failure: crate::engine::compat::Failure) {
        self.debug_session_failures
            .with_label_values(&[failure.as_str()])
            .inc();
    }

    pub fn reload(&self, ok: bool) {
        self.reloads
            .with_label_values(&[if ok { "success" } else { "failure" }])
            .inc();
    }

    /// Counts a network-file reload refused by the shrink guard (`file`: its metric label).
    pub fn network_reload_rejected(&self, file: &str) {
        self.network_reloads_rejected
            .with_label_values(&[file])
            .inc();
    }

    /// Records one decision and how long it took.
    pub fn record(&self, decision: &Decision<'_>, seconds: f64) {
        self.latency.observe(seconds);
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
            self.store_errors.inc();
        }
        if let Some(local) = &self.local {
            local.record(checked);
        }
        if let Some(rule) = checked.shadow_missing {
            self.decisions
                .with_label_values(&[
                    &rule.policy_id,
                    &rule.name,
                    "would_reject",
                    "missing_descriptor",
                    "shadow",
                ])
                .inc();
            self.shadow_would_reject
                .with_label_values(&[&rule.policy_id, &rule.name])
                .inc();
        }
        let table = self.per_rule.load();
        for slot in &checked.slots {
            // Concurrency rules and guards are counted by label (they are few, and not per
            // token). A loop that only warns or throttles is counted as such.
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
            let (policy, name) = (&slot.rule.policy_id, &slot.rule.name);
            self.decisions
                .with_label_values(&[policy, name, action, reason, slot.rule.mode.as_str()])
                .inc();
            if action == "would_reject" {
                self.shadow_would_reject
                    .with_label_values(&[policy, name])
                    .inc();
            }
        }
        let table = table.as_ref().and_then(|t| t.of(checked.bundle));
        let allowed = decision.is_allowed();
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
                self.decisions
                    .with_label_values(&[
                        &rule.policy_id,
                        &rule.name,
                        action,
                        reason,
                        rule.mode.as_str(),
                    ])
                    .inc();
                if action == "would_reject" {
                    self.shadow_would_reject
                        .with_label_values(&[&rule.policy_id, &rule.name])
                        .inc();
                }
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
        self.breaker_trips
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
        self.llm_settlements.with_label_values(&[source]).inc();
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
            self.llm_estimate_ratio
                .observe(rule.prompt_tokens as f64 / actual as f64);
        }
    }

    /// A request refused with 431 for its header block (`limit`: `bytes` or `lines`).
    pub fn request_headers_refused(&self, limit: &str) {
        self.request_headers_refused
            .with_label_values(&[limit])
            .inc();
    }

    /// The counter of connections refused by `cap` (the proxy's connection guard counts them).
    pub fn connections_refused(&self, cap: &str) -> IntCounter {
        self.connections_refused.with_label_values(&[cap])
    }

    /// Sets the gauges that follow the bundle in force and the time: runtime overrides active
    /// at `unix_secs`, policies skipped.
    pub fn bundle_state(&self, bundle: Option<&Bundle>, unix_secs: i64) {
        let active = |on: bool| i64::from(on);
        self.runtime_overrides
            .with_label_values(&["global_shadow"])
            .set(active(
                bundle.is_some_and(|b| b.global_shadow_active(unix_secs)),
            ));
        self.runtime_overrides
            .with_label_values(&["kill_switch_override"])
            .set(active(
                bundle.is_some_and(|b| b.kill_switch_override_active(unix_secs)),
            ));
        self.policies_skipped
            .set(bundle.map_or(0, |b| b.skipped.len() as i64));
    }

    /// Prometheus text, with store gauges refreshed from `stats`.
    pub fn render(&self, stats: StoreStats) -> String {
        let _serialised = self.render_lock.lock();
        if let (Some(gauge), Some(entries)) = (&self.store_entries, stats.entries) {
            gauge.set(entries as i64);
        }
        // The store keeps the running totals; counters only move forward to meet them.
        if let Some(counter) = &self.store_evictions {
            advance_to(counter, stats.evictions);
        }
        if let Some(by_kind) = &self.store_evictions_by_kind {
            let e = stats.evicted;
            for (kind, total) in
                EVICTION_KINDS
                    .iter()
                    .zip([e.full_again, e.token_bucket, e.budget, e.unknown_spend])
            {
                advance_to(&by_kind.with_label_values(&[kind]), total);
            }
        }
        if let Some(histogram) = &self.store_forgiven {
            *histogram.latest.lock() = stats.evicted;
        }
        if let Some(counter) = &self.store_fail_open {
            advance_to(counter, stats.fail_open);
        }
        if let (Some(gauge), Some(held)) = (&self.loop_marks, stats.loop_marks) {
            gauge.set(held as i64);
        }
        if let Some(counter) = &self.loop_marks_evicted {
            advance_to(counter, stats.loop_marks_evicted);
        }
        advance_to(
            &self.log_lines_dropped,
            crate::telemetry::log_line::DROPPED.load(std::sync::atomic::Ordering::Relaxed),
        );
        if let Some(gauge) = &self.state_dir_fallback {
            gauge.set(i64::from(stats.state_fallback == Some(true)));
        }
        if let (Some(metrics), Some(local)) = (&self.local, stats.local) {
            metrics.render(local);
        }
        if let Some(gauge) = &self.store_clock_skew {
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
    fn new(registry: &Registry, defined: &mut Vec<String>) -> LocalMetrics {
        let mode = must(IntGauge::new(
            "tollgate_store_local_mode",
            "1 while this gateway decides from its own memory because the shared store does not answer",
        ));
        let gateways = must(IntGauge::new(
            "tollgate_fleet_gateways",
            "Gateways present in the shared store when it was last reached (N: local mode gives each 1/N of every limit)",
        ));
        let decisions = must(IntCounterVec::new(
            Opts::new(
                "tollgate_store_local_decisions_total",
                "Rule checks decided without the shared store, by the rule's on_store_error outcome (allowed, rejected, closed, open)",
            ),
            &["policy", "rule", "outcome"],
        ));
        let write_backs = must(IntCounterVec::new(
            Opts::new(
                "tollgate_store_writebacks_total",
                "Local spend charged to the shared store once it answered again: applied, duplicate (already charged), failed (sending a batch failed; it is sent again)",
            ),
            &["outcome"],
        ));
        let pending = must(IntGauge::new(
            "tollgate_store_writeback_pending",
            "Buckets with local spend not yet charged to the shared store",
        ));
        for c in [
            Box::new(mode.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(gateways.clone()),
            Box::new(decisions.clone()),
            Box::new(write_backs.clone()),
            Box::new(pending.clone()),
        ] {
            defined.extend(names_of(c.as_ref()));
            must(registry.register(c));
        }
        for outcome in ["applied", "duplicate", "failed"] {
            write_backs.with_label_values(&[outcome]);
        }
        LocalMetrics {
            mode,
            gateways,
            decisions,
            write_backs,
            pending,
        }
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
        for (outcome, total) in ["applied", "duplicate", "failed"]
            .into_iter()
            .zip(local.write_backs)
        {
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
    fn new() -> CandidateMetrics {
        CandidateMetrics {
            would_refuse: must(IntCounterVec::new(
                Opts::new(
                    "tollgate_candidate_would_refuse_total",
                    "Requests the candidate bundle would have refused, by policy and rule (kill switches under policy kill_switch), since it was set",
                ),
                &["policy", "rule"],
            )),
            decisions: must(IntCounter::new(
                "tollgate_candidate_decisions_total",
                "Requests also decided under the candidate bundle since it was set",
            )),
            skipped: must(IntCounter::new(
                "tollgate_candidate_skipped_total",
                "Requests not decided under the candidate bundle: too many of its shared-store calls outstanding",
            )),
            info: must(IntGaugeVec::new(
                Opts::new(
                    "tollgate_candidate_info",
                    "The candidate bundle decided in shadow (value 1 while one is set)",
                ),
                &["version", "hash"],
            )),
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
    const NAME: &'static str = "tollgate_store_eviction_forgiven_tokens";

    fn new() -> Self {
        ForgivenHistogram {
            desc: must(prometheus::core::Desc::new(
                Self::NAME.to_string(),
                "Evictions for room (a new key in a full store), by the tokens the evicted entry still had spent".to_string(),
                Vec::new(),
                std::collections::HashMap::new(),
            )),
            latest: Arc::default(),
        }
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
        family.set_name(Self::NAME.to_string());
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
    const NAME: &'static str = "tollgate_store_clock_skew_seconds";

    fn new() -> Self {
        ClockSkewGauge {
            desc: must(prometheus::core::Desc::new(
                Self::NAME.to_string(),
                "The gateway's wall clock minus the shared store's clock (Redis TIME, PostgreSQL clock_timestamp()), in seconds, measured at every sweep; positive when the gateway is ahead".to_string(),
                Vec::new(),
                std::collections::HashMap::new(),
            )),
            latest: Arc::default(),
        }
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
        family.set_name(Self::NAME.to_string());
        family.set_help(self.desc.help.clone());
        family.set_field_type(proto::MetricType::GAUGE);
        family.mut_metric().push(metric);
        vec![family]
    }
}

fn names_of(collector: &dyn prometheus::core::Collector) -> Vec<String> {
    collector.desc().iter().map(|d| d.fq_name.clone()).collect()
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

impl Default for Metrics {
    /// Metrics for the embedded store.
    fn default() -> Self {
        Self::new("memory")
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
        let metrics = Metrics::new("memory");
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
            .defined_names()
            .contains(&name.to_string()));
        for kind in ["redis", "postgres"] {
            let metrics = Metrics::new(kind);
            assert!(metrics.defined_names().contains(&name.to_string()));
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
}
