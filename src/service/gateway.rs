//! The gateway: [`Gateway`], the state it holds, and its own methods: the one request path
//! shared by the reverse proxy and the decision service ([`Gateway::decide`] plans with the
//! pure engine, asks the store (synchronously for the embedded store, awaited in place for a
//! shared one), finishes, and answers: counts, logs and builds the response from the
//! [`Decided`] alone), Envoy's `ShouldRateLimit`, putting a bundle in force (the policy file
//! at start-up, on SIGHUP and when it changes; the policy store's through [`super::follow`]),
//! `/readyz`, and the questions about the bundle in force. Its components are each a type in a
//! sibling file, below this one.

use super::answer::{held_lease, Answer, Verdict};
use super::candidate::CandidateShadow;
use super::debug_sessions::DebugSessionDesk;
use super::described::{Described, HttpHeaders, X_FORWARDED_FOR, X_REAL_IP};
use super::envoy_rls::{self, RlsFailure, RlsReply};
use super::loaded::{signature, LoadedPolicy};
use super::logging::log_decision;
use super::overrides::Overrides;
use super::pacing::{Pace, Pacer, Waited};
use super::penalties::Penalties;
use super::reload::{NetworkLoadError, Reload, Trigger};
use super::source_state::FollowState;
use super::state_key;
use super::tokens::Tokens;
use crate::config::{Config, StoreKind};
use crate::engine::headers::{self, HeaderConfig, Response};
use crate::engine::rls::{self, RlsRequest};
use crate::engine::{self, Decided, Decision, EngineConfig, Plan, Reason, RefusedBy, RequestView};
use crate::limits::clock::{wall_unix_secs, Clock, SystemClock};
use crate::policy::{Bundle, PolicyError};
use crate::request::auth::{AuthError, TokenOutcome, Verifier};
use crate::request::client_addr::{self, ForwardingHeaders};
use crate::request::descriptor::{Claims, HeaderLookup, RequestFacts};
use crate::store::lease::{next_lease_id, Lease, LeaseResults};
use crate::store::{Backend, MemoryStoreConfig, OpResults, Store, StoreError};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::traces::DecisionSummary;
use arc_swap::{ArcSwap, ArcSwapOption};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

/// What pacing a decision gave: the request's place in line (with the rule that paced it), or
/// what a refusal after the store's answer must give back.
struct PaceStep {
    place: Option<(Pace, Option<String>)>,
    refund: SmallVec<[crate::store::AdjustOp; 2]>,
    /// The slots a request refused here had taken: `(lease id, keys)`.
    leases: Option<(u64, SmallVec<[crate::store::BucketKey; 2]>)>,
}

impl PaceStep {
    /// Puts the place in line in the answer.
    fn place_in(self, answer: &mut Answer) {
        if let Some((pace, rule)) = self.place {
            answer.pace = Some(Box::new(pace));
            answer.paced_by = rule;
        }
    }
}

/// The log targets these lines had before `Gateway` had a file of its own (the request path's
/// lines were `tollgate::service`'s, putting a bundle in force was `tollgate::service::reload`'s).
/// Users filter and alert on targets (`RUST_LOG=tollgate::service::reload=warn`), so moving the
/// code does not rename them.
const SERVICE_LOG_TARGET: &str = "tollgate::service";
const RELOAD_LOG_TARGET: &str = "tollgate::service::reload";

/// Why a gateway cannot be built from a valid configuration.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Jwt(#[from] AuthError),
    #[error("--store: {0}")]
    Store(StoreError),
    #[error("--reason-header: not a valid HTTP header name")]
    ReasonHeader,
    #[error(transparent)]
    State(#[from] crate::store::state_file::StateError),
    #[error(transparent)]
    Network(#[from] NetworkLoadError),
    #[error("{0}")]
    FingerprintKey(#[from] state_key::KeyFileError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error(transparent)]
    Audit(#[from] crate::telemetry::audit::AuditError),
}

/// The gateway: one value holding the configuration, the store, the metrics, the bundle in
/// force, and its components, each in its own file: [`Reload`] (the watched files and the
/// network data they give: `reload`), [`FollowState`] (what the policy-store follower knows:
/// `source_state`), [`Tokens`] (LLM reservations: `tokens`), [`Penalties`] (response charges
/// and penalty boxes: `penalties`), [`DebugSessionDesk`] (Fairvisor's
/// debug sessions: `debug_sessions`) and [`CandidateShadow`] (the candidate bundle in shadow:
/// `candidate`).
/// Its own methods, below, are the request path and the questions about the bundle in force.
/// The operator's endpoints ([`crate::operator`]) read it; they add nothing to it.
pub struct Gateway {
    pub metrics: Arc<Metrics>,
    pub config: Config,
    pub header_config: HeaderConfig,
    pub verifier: Verifier,
    /// Where buckets live: the embedded store, or one shared with other gateways (shared with
    /// the candidate bundle's store calls, which run apart from the request on a shared store).
    pub store: Arc<Store>,
    pub(crate) engine_config: EngineConfig,
    /// Wall-clock time for kill-switch expiry (the store keeps its own time base).
    pub(crate) clock: Arc<dyn Clock>,
    /// The bundle in force.
    pub(crate) policy: ArcSwapOption<Bundle>,
    pub(crate) loaded: ArcSwapOption<LoadedPolicy>,
    /// The buckets limited most over the last minute (`/v1/top`, the status page).
    pub(crate) top: Mutex<crate::operator::top::TopSketch>,
    /// The key of masked values' fingerprints (`/v1/top`, the status page, explain).
    pub(crate) fingerprint_key: crate::telemetry::redact::FingerprintKey,
    /// OpenTelemetry traces, when the `OTEL_*` environment asks for them (set once at start).
    telemetry: std::sync::OnceLock<crate::telemetry::traces::Telemetry>,
    /// The network data in force and the watched files' signatures.
    pub reload: Reload,
    /// `--policy-store`: what the follower ([`super::follow`]) knows.
    pub follow: FollowState,
    /// LLM reservations held until their usage is reported.
    pub tokens: Tokens,
    /// Response charges and penalty boxes.
    pub penalties: Penalties,
    /// `--debug-session-secret` under `--compat fairvisor`.
    pub debug_sessions: DebugSessionDesk,
    /// The candidate bundle decided in shadow.
    pub candidate: CandidateShadow,
    /// The requests `delay` rules make wait.
    pub pacer: Pacer,
    /// The per-key overrides set at runtime (`/v1/overrides`).
    pub overrides: Overrides,
    /// Budget spend noted for the usage ledger (`GET /v1/usage`).
    pub usage: super::usage::UsageDesk,
    /// `notify_at` crossings claimed and delivered.
    pub webhooks: Arc<super::webhooks::Webhooks>,
    /// Operator writes, one line each (`--audit-log`, or the `tollgate::audit` log target).
    pub audit: crate::telemetry::audit::AuditTrail,
    /// The operator tokens in force: `--admin-token`'s and `--admin-tokens-file`'s, the file
    /// read again on SIGHUP ([`Gateway::reload_admin_tokens`]).
    pub admin_tokens: ArcSwap<crate::operator::AdminTokens>,
}

impl Gateway {
    /// # Errors
    /// A configured JWT key file cannot be loaded, or the store URL is unusable.
    pub fn new(config: Config) -> Result<Self, StartError> {
        Self::with_clock(config, Arc::new(SystemClock::new()))
    }

    /// # Errors
    /// A configured JWT key file cannot be loaded, or the store URL is unusable.
    pub fn with_clock(config: Config, clock: Arc<dyn Clock>) -> Result<Self, StartError> {
        let verifier = Verifier::new(config.jwt.clone())?;
        // One store: under `--store redis://` no embedded store is built, swept or reported.
        let store = match &config.store {
            StoreKind::Memory => {
                let memory = MemoryStoreConfig {
                    max_buckets: config.max_buckets.get(),
                    max_loop_marks: config.max_loop_marks.get(),
                    ..MemoryStoreConfig::default()
                };
                match &config.state_dir {
                    Some(state) => Store::memory_in_state_dir(memory, state, Arc::clone(&clock))?,
                    None => Store::memory(memory, Arc::clone(&clock)),
                }
            }
            StoreKind::Shared(url) => Store::open(url, config.store_timeout, Arc::clone(&clock))
                .map_err(StartError::Store)?
                .with_local(config.local.clone()),
        };
        // Leaked once at start-up: the display name lives as long as the process.
        let reason_header: &'static str = Box::leak(config.reason_header.clone().into_boxed_str());
        let mut header_config =
            HeaderConfig::new(reason_header).map_err(|_| StartError::ReasonHeader)?;
        if config.compat == crate::engine::compat::Compat::Fairvisor {
            header_config.warning_header = crate::engine::compat::WARNING_HEADER.clone();
        }
        let metrics = Arc::new(Metrics::new(store.kind())?);
        metrics.admin_tokens(config.admin_tokens.ids());
        let audit = crate::telemetry::audit::AuditTrail::open(
            config.audit_log.as_deref(),
            Arc::clone(&clock),
        )?;
        let store = Arc::new(store);
        let engine_config = EngineConfig {
            ipv6_prefix: config.ipv6_prefix,
        };
        let gateway = Gateway {
            header_config,
            verifier,
            engine_config,
            policy: ArcSwapOption::empty(),
            loaded: ArcSwapOption::empty(),
            top: Mutex::new(crate::operator::top::TopSketch::default()),
            telemetry: std::sync::OnceLock::new(),
            reload: Reload::new(),
            follow: FollowState::new(config.policy_store.is_some(), Arc::clone(&clock)),
            tokens: Tokens::new(
                &config,
                Arc::clone(&store),
                Arc::clone(&clock),
                Arc::clone(&metrics),
            ),
            penalties: Penalties::new(Arc::clone(&store)),
            debug_sessions: DebugSessionDesk::new(
                &config,
                Arc::clone(&clock),
                Arc::clone(&metrics),
            )?,
            fingerprint_key: state_key::fingerprint_key(
                config.state_dir.as_ref().map(|s| s.dir.as_path()),
            )?,
            candidate: CandidateShadow::new(
                metrics.candidate.clone(),
                Arc::clone(&store),
                Arc::clone(&clock),
                engine_config,
            ),
            pacer: Pacer::new(
                config.max_delayed_requests,
                Arc::clone(&store),
                Arc::clone(&metrics),
            ),
            overrides: Overrides::new(
                config
                    .state_dir
                    .as_ref()
                    .map(|s| s.dir.join(super::overrides::FILE_NAME)),
            ),
            usage: super::usage::UsageDesk::default(),
            webhooks: Arc::new(super::webhooks::Webhooks::new(
                config.webhook.clone(),
                Arc::clone(&store),
                Arc::clone(&clock),
                Arc::clone(&metrics),
            )),
            audit,
            admin_tokens: ArcSwap::from_pointee(config.admin_tokens.clone()),
            metrics,
            store,
            clock,
            config,
        };
        gateway
            .reload
            .load_network(&gateway.config, &gateway.metrics, Trigger::Startup)?;
        Ok(gateway)
    }

    /// SIGHUP: reads `--admin-tokens-file` again. A file that cannot be read, is not
    /// owner-only or holds a wrong list is refused (an ERROR line naming it and why) and the
    /// tokens in force stay.
    pub fn reload_admin_tokens(&self) {
        let Some(path) = &self.config.admin_tokens_file else {
            return;
        };
        match crate::operator::AdminTokens::read_file(path, self.config.admin_token.as_ref()) {
            Ok(tokens) => {
                self.metrics.admin_tokens(tokens.ids());
                let count = tokens.ids().count();
                self.admin_tokens.store(Arc::new(tokens));
                tracing::info!(file = %path.display(), tokens = count, "admin tokens reloaded");
            }
            Err(e) => tracing::error!(
                "--admin-tokens-file {}: {e}; the tokens in force stay",
                path.display()
            ),
        }
    }

    /// Sets the candidate bundle decided in shadow beside the bundle in force, replaces it, or
    /// clears it (`None`): see [`CandidateShadow`].
    pub fn set_candidate(&self, candidate: Option<Bundle>) {
        self.candidate.set(candidate, self.policy.load_full());
    }

    /// Tracing, when it is on (`None`: no span work anywhere).
    pub fn telemetry(&self) -> Option<&crate::telemetry::traces::Telemetry> {
        self.telemetry.get()
    }

    /// Switches tracing on (once, at start).
    pub fn set_telemetry(&self, telemetry: crate::telemetry::traces::Telemetry) {
        let _ = self.telemetry.set(telemetry);
    }

    /// The client's network facts, when the bundle in force reads them.
    pub(crate) fn network_facts(
        &self,
        facts: &RequestFacts<'_>,
    ) -> Option<crate::request::network::NetworkFacts> {
        let uses = self
            .policy
            .load()
            .as_deref()
            .is_some_and(|b| b.uses_network)
            || (self.candidate.is_set() && self.candidate.uses_network());
        uses.then(|| {
            self.reload
                .network
                .load()
                .resolve(facts.client_ip, facts.headers, facts.trusted_peer)
        })
    }

    /// The verified claims of the request's JWT, if it carries a valid one. Invalid tokens are
    /// counted by reason and logged at debug level without their contents.
    pub fn claims(&self, headers: &dyn HeaderLookup) -> Option<Arc<Claims>> {
        if !self.verifier.enabled() {
            return None;
        }
        match self.verifier.check(headers) {
            TokenOutcome::Absent => None,
            TokenOutcome::Valid(claims) => {
                self.metrics.token(Ok(()));
                Some(claims)
            }
            TokenOutcome::Invalid(reason) => {
                self.metrics.token(Err(reason));
                tracing::debug!(
                    target: SERVICE_LOG_TARGET,
                    reason = reason.as_str(),
                    "JWT refused; jwt: descriptors are missing"
                );
                None
            }
        }
    }

    /// The client address of a request from `peer` ([`client_addr::resolve`]): the peer, or
    /// what `X-Forwarded-For` / `X-Real-IP` say when the peer is a `--trusted-proxy`. The
    /// decision service passes `caller_is_gateway`: its caller describes the client by role.
    pub fn client_ip(
        &self,
        peer: Option<IpAddr>,
        headers: &http::HeaderMap,
        caller_is_gateway: bool,
    ) -> Option<IpAddr> {
        let caller = peer.map(crate::request::descriptor::canonical_ip);
        let peer_trusted = caller.is_some_and(|ip| self.is_trusted_proxy(ip));
        self.client_ip_with(peer, peer_trusted || caller_is_gateway, headers)
    }

    /// Whether the bundle in force has `delay` rules (a decision may wait for its turn).
    pub fn paces(&self) -> bool {
        self.policy.load().as_deref().is_some_and(|b| b.paces)
    }

    /// Whether the bundle in force fingerprints request bodies (`loop_detection`): front ends
    /// then hash the bodies they can read before deciding.
    pub fn fingerprints_bodies(&self) -> bool {
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.fingerprints_bodies)
    }

    /// Whether the bundle in force counts gRPC request messages (`grpc:message`): the proxy
    /// then decides each message of a gRPC call's request stream.
    pub fn counts_grpc_messages(&self) -> bool {
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.counts_grpc_messages)
    }

    /// Whether the network headers of a decision-service call from `caller` (the TCP peer of
    /// the HTTP call, the gRPC connection's peer) are believed: only from a `--trusted-proxy`
    /// network, as on the proxy listener. A caller is not trusted for being a gateway.
    pub fn believes_network_headers(&self, caller: Option<IpAddr>) -> bool {
        caller.is_some_and(|ip| self.is_trusted_proxy(crate::request::descriptor::canonical_ip(ip)))
    }

    /// Whether `ip` is inside a `--trusted-proxy` network.
    pub fn is_trusted_proxy(&self, ip: IpAddr) -> bool {
        client_addr::in_any(&self.config.trusted_proxies, ip)
    }

    /// [`Gateway::client_ip`] with the peer's verdict already known (the proxy keeps it per
    /// connection).
    pub fn client_ip_with(
        &self,
        peer: Option<IpAddr>,
        peer_trusted: bool,
        headers: &http::HeaderMap,
    ) -> Option<IpAddr> {
        let caller = peer.map(crate::request::descriptor::canonical_ip);
        // A peer not trusted is the client whatever its headers say: they are not looked up
        // (two header-map lookups per request, for nothing, when no proxy is trusted).
        if !peer_trusted {
            return caller;
        }
        client_addr::resolve(
            peer,
            ForwardingHeaders {
                forwarded_for: headers
                    .get_all(&X_FORWARDED_FOR)
                    .iter()
                    .map(http::HeaderValue::as_bytes),
                real_ip: headers.get(&X_REAL_IP).map(http::HeaderValue::as_bytes),
            },
            |ip| {
                if Some(ip) == caller {
                    peer_trusted
                } else {
                    self.is_trusted_proxy(ip)
                }
            },
        )
    }

    /// Answers a request refused before the engine could look at it (its path has an encoded
    /// slash under `--encoded-slashes reject`): counted and logged like any refusal.
    pub fn refuse_early(
        &self,
        reason: Reason,
        client_ip: Option<IpAddr>,
        host: Option<&str>,
        raw_path: &str,
    ) -> Response {
        let decided = Decided {
            decision: Decision::refused(reason),
            request: RequestView {
                client_ip,
                host: host.map(crate::request::descriptor::strip_port),
                path: raw_path,
                ..RequestView::default()
            },
        };
        *self.answer(&decided, Instant::now(), None, false).response
    }

    /// Decides one request: plan, store, finish, count, log, respond. The embedded store answers
    /// on this thread without suspending; a shared store is awaited here, with the bundle held
    /// as an `Arc` (an `arc_swap` guard must not live across a network call). A request a
    /// `delay` rule paces is answered when its turn comes.
    pub async fn decide(&self, facts: &RequestFacts<'_>) -> Answer {
        let answer = self.decide_unwaited(facts).await;
        self.paced(answer).await
    }

    /// [`Gateway::decide`] for a front end that waits a paced answer's turn itself (the
    /// proxy, which notices its client leaving): the answer keeps its [`Answer::pace`].
    pub async fn decide_unwaited(&self, facts: &RequestFacts<'_>) -> Answer {
        let network = self.network_facts(facts);
        let with_network;
        let facts = match &network {
            Some(network) => {
                with_network = facts.with_network(network);
                &with_network
            }
            None => facts,
        };
        let answer = self.decide_now(facts).await;
        Self::throttled(answer).await
    }

    /// A paced answer waits for its turn here (the decision service, ext_authz); one whose
    /// turn comes after a shutdown's drain is refused instead, its tokens given back.
    pub async fn paced(&self, mut answer: Answer) -> Answer {
        let Some(pace) = answer.pace.take() else {
            return answer;
        };
        match pace.wait().await {
            Waited::Served(waited) => {
                answer.waited_us = waited.as_micros().min(u128::from(u64::MAX)) as u64;
                answer
            }
            Waited::Drained { retry_after } => self.drained(answer, retry_after).await,
        }
    }

    /// The refusal of a paced request whose turn came after a shutdown's drain: 429 with
    /// `Retry-After`, by the rule that paced it.
    async fn drained(&self, answer: Answer, retry_after: u64) -> Answer {
        if let Some(lease) = &answer.lease {
            self.release(lease).await;
        }
        let reason = Reason::TokenBucketExceeded;
        Answer {
            verdict: Verdict::Refused {
                reason,
                rule: answer.paced_by,
            },
            throttle_ms: 0,
            pace: None,
            waited_us: 0,
            paced_by: None,
            lease: None,
            // Its tokens, the reservation's with them, were given back.
            reservation: None,
            // Nothing was spent for the response to settle.
            charges: None,
            model: None,
            response: Box::new(self.drained_response(retry_after)),
            summary: answer.summary,
        }
    }

    /// The response to a paced request whose turn comes after a shutdown's drain: 429
    /// `token_bucket_exceeded`, with the time its turn would have come as `Retry-After`.
    pub fn drained_response(&self, retry_after: u64) -> Response {
        let reason = Reason::TokenBucketExceeded;
        let mut headers = crate::engine::headers::HeaderList::new();
        if let Ok(v) = http::HeaderValue::from_str(&retry_after.to_string()) {
            headers.push((http::header::RETRY_AFTER, v));
        }
        headers.push((
            self.header_config.reason_header.clone(),
            http::HeaderValue::from_static(reason.as_str()),
        ));
        tracing::info!(target: SERVICE_LOG_TARGET, retry_after, "paced request refused: the gateway is shutting down and its turn comes after the drain");
        Response {
            status: reason.status(),
            headers,
            body: Some(reason.body()),
            lines: None,
        }
    }

    /// [`Gateway::decide`] without a future, when the store is in memory (it decides without
    /// waiting): the proxy's per-request path, which would otherwise box the whole decision
    /// future. `None` with another store: call [`Gateway::decide`]. An answer with
    /// `throttle_ms` still owes its wait: [`Gateway::throttled`].
    pub fn decide_in_memory(&self, facts: &RequestFacts<'_>) -> Option<Answer> {
        self.decide_in_memory_as(facts, false)
    }

    /// [`Gateway::decide_in_memory`] for a front end that writes HTTP/1 itself when `lines`:
    /// a refusal's headers then come as the lines it sends ([`headers::build_lines`]).
    pub fn decide_in_memory_as(&self, facts: &RequestFacts<'_>, lines: bool) -> Option<Answer> {
        if !matches!(self.store.backend(), Backend::Memory(_)) {
            return None;
        }
        let network = self.network_facts(facts);
        let with_network;
        let facts = match &network {
            Some(network) => {
                with_network = facts.with_network(network);
                &with_network
            }
            None => facts,
        };
        self.decide_locally(facts, lines)
    }

    /// A budget's throttle stage: the request goes on, later (Fairvisor sleeps too).
    pub async fn throttled(answer: Answer) -> Answer {
        if answer.throttle_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(answer.throttle_ms)).await;
        }
        answer
    }

    /// The in-memory store's decision (synchronous); `None` with another store.
    fn decide_locally(&self, facts: &RequestFacts<'_>, lines: bool) -> Option<Answer> {
        let Backend::Memory(memory) = self.store.backend() else {
            return None;
        };
        let started = Instant::now();
        let guard = self.policy.load();
        let Some(bundle) = guard.as_deref() else {
            let decided = Decided {
                decision: Decision::NoPolicy,
                request: RequestView::of(facts),
            };
            return Some(self.answer(&decided, started, None, lines));
        };
        // The clocks only once there is a policy to decide with.
        let unix_us = self.clock.unix_us();
        // The latency's start doubles as the bucket maths' now: one reading of the clock.
        let now_us = self.store.now_us_at(started);
        let decide = |facts: &RequestFacts<'_>| {
            engine::decide_local(bundle, facts, memory, now_us, unix_us, self.engine_config)
        };
        // A spend budget that refused may admit the request on its cheaper fallback model.
        let fallback_facts;
        let decision = decide(facts);
        let (mut decision, facts, model) = match decision.spend_fallback(facts.replaceable_model())
        {
            Some(model) => {
                fallback_facts = facts.for_model(model);
                match decide(&fallback_facts) {
                    retry @ Decision::Allow(_) => (retry, &fallback_facts, Some(model)),
                    _ => (decision, facts, None),
                }
            }
            None => (decision, facts, None),
        };
        let counts = decision.penalty_counts();
        if !counts.is_empty() {
            self.penalties.count_now(&counts);
        }
        let step = self.pace(&mut decision);
        if let Some(step) = &step {
            memory.adjust(now_us, &step.refund);
            if let Some((id, keys)) = &step.leases {
                memory.leases().release(*id, keys);
            }
        }
        let decided = Decided {
            decision,
            request: RequestView::of(facts),
        };
        let mut answer = self.answer(&decided, started, Some(unix_us), lines);
        if let Some(step) = step {
            step.place_in(&mut answer);
        }
        answer.model = model.map(Box::from);
        if self.candidate.is_set() {
            self.candidate
                .after_local(&decided.decision, facts, memory, now_us, unix_us);
        }
        Some(answer)
    }

    async fn decide_now(&self, facts: &RequestFacts<'_>) -> Answer {
        if let Some(answer) = self.decide_locally(facts, false) {
            return answer;
        }
        let started = Instant::now();
        let unix_us = self.clock.unix_us();
        let Some(bundle) = self.policy.load_full() else {
            let decided = Decided {
                decision: Decision::NoPolicy,
                request: RequestView::of(facts),
            };
            return self.answer(&decided, started, Some(unix_us), false);
        };
        let fallback_facts;
        let decision = self.decide_shared(&bundle, facts, unix_us).await;
        let (mut decision, facts, model) = match decision.spend_fallback(facts.replaceable_model())
        {
            Some(model) => {
                fallback_facts = facts.for_model(model);
                match self.decide_shared(&bundle, &fallback_facts, unix_us).await {
                    retry @ Decision::Allow(_) => (retry, &fallback_facts, Some(model)),
                    _ => (decision, facts, None),
                }
            }
            None => (decision, facts, None),
        };
        let step = self.pace(&mut decision);
        if let Some(step) = &step {
            let _ = self.store.adjust(self.store.now_us(), &step.refund).await;
            if let Some((id, keys)) = &step.leases {
                self.store.release(*id, keys).await;
            }
        }
        let decided = Decided {
            decision,
            request: RequestView::of(facts),
        };
        // Not the reading made before the store's round trip: the lines are stamped when
        // written, as before, and a network call makes the clock worth reading again.
        let mut answer = self.answer(&decided, started, None, false);
        if let Some(step) = step {
            step.place_in(&mut answer);
        }
        answer.model = model.map(Box::from);
        if self.candidate.is_set() {
            self.candidate
                .after_shared(&decided.decision, facts, unix_us);
        }
        answer
    }

    /// One decision against a shared store: leases, then buckets, then the breakers it
    /// tripped; a refused request's leases are given back.
    async fn decide_shared<'b>(
        &self,
        bundle: &'b crate::policy::Bundle,
        facts: &RequestFacts<'_>,
        unix_us: u64,
    ) -> Decision<'b> {
        match engine::plan(bundle, facts, unix_us, self.engine_config) {
            Plan::Done(decision) => decision,
            Plan::Store(pending) => {
                let now_us = self.store.now_us();
                // Leases first: a request refused for a slot, a loop or an open breaker spends
                // no tokens.
                let pending = if pending.leases.is_empty() {
                    Ok(pending)
                } else {
                    let id = next_lease_id();
                    let mut taken = LeaseResults::new();
                    let answer = self
                        .store
                        .acquire(now_us, id, &pending.leases, &mut taken)
                        .await;
                    pending.admit(id, answer.map(|()| &taken))
                };
                let decision = match pending {
                    Err(refused) => refused,
                    Ok(pending) => {
                        let mut results = OpResults::new();
                        let answer = self.store.apply(now_us, &pending.ops, &mut results).await;
                        engine::finish_paced(pending, answer.map(|()| &results))
                    }
                };
                for (trip, _) in decision.breaker_trips() {
                    let mut taken = LeaseResults::new();
                    // Best effort: a store that cannot open it leaves the breaker closed
                    // (failing open, as every store failure does).
                    let _ = self
                        .store
                        .acquire(now_us, next_lease_id(), &[trip], &mut taken)
                        .await;
                }
                if let (false, Some(checked)) = (decision.is_allowed(), decision.checked()) {
                    self.store
                        .release(checked.lease_id, &checked.taken_leases())
                        .await;
                }
                let counts = decision.penalty_counts();
                if !counts.is_empty() {
                    // Boxed: its store calls' state stays out of every decision's future.
                    Box::pin(self.penalties.count(&counts)).await;
                }
                decision
            }
        }
    }

    /// A paced decision (a `delay` rule made it wait): its place in line; or, when
    /// `--max-delayed-requests` already wait (or a shutdown's drain ends before its turn), its
    /// refusal instead. What a refusal spent (tokens, slots) comes back in the step for the
    /// caller to give back, as does the spend of one refused for a wait past `max_wait_ms`.
    #[inline]
    fn pace(&self, decision: &mut Decision<'_>) -> Option<Box<PaceStep>> {
        if decision.checked().is_none_or(|c| c.paced.is_none()) {
            return None;
        }
        self.pace_slow(decision)
    }

    #[inline(never)]
    fn pace_slow(&self, decision: &mut Decision<'_>) -> Option<Box<PaceStep>> {
        let checked = decision.checked()?;
        let paced = checked.paced.as_deref()?;
        let refund = paced.refund_ops();
        if !decision.is_allowed() {
            return Some(Box::new(PaceStep {
                place: None,
                refund,
                leases: None,
            }));
        }
        let rule = checked.rules.get(paced.rule).map(|o| o.rule.name.clone());
        if let Some(place) = self.pacer.place(paced) {
            return Some(Box::new(PaceStep {
                place: Some((place, rule)),
                refund: SmallVec::new(),
                leases: None,
            }));
        }
        let wait_us = paced.wait_us;
        let taken = checked.taken_leases();
        let leases = (!taken.is_empty()).then_some((checked.lease_id, taken));
        match std::mem::replace(decision, Decision::NoPolicy) {
            Decision::Allow(checked) => *decision = engine::pacing::refuse(checked, wait_us),
            other => *decision = other,
        }
        Some(Box::new(PaceStep {
            place: None,
            refund,
            leases,
        }))
    }

    /// Under `--compat fairvisor`: the reason header only for a debug session, which also gets
    /// Fairvisor's verbose headers (on every decision the engine was asked for, a no-policy
    /// one included, whichever the store).
    fn compat_headers(&self, response: &mut Response, decided: &Decided<'_>) {
        // A request refused before the engine (no facts) keeps its reason header, as it always
        // has: it carries no cookie to open a debug session with.
        let Some(facts) = decided.request.facts else {
            return;
        };
        if self.config.compat != crate::engine::compat::Compat::Fairvisor {
            return;
        }
        let cookie = facts.headers.header("cookie");
        crate::engine::compat::finish_headers(
            &mut response.headers,
            &decided.decision,
            &self.header_config.reason_header,
            self.debug_sessions.is_open(cookie),
        );
    }

    /// Logs and counts the circuit breakers a decision tripped (at error level for a breaker
    /// with `alert: true`, so log-based alerting catches it).
    fn breakers_tripped(&self, decision: &Decision<'_>) {
        for (trip, rule) in decision.breaker_trips() {
            self.metrics.breaker_tripped(rule);
            let open_secs = trip.ttl_us / crate::limits::limiter::US_PER_SEC;
            let alert = matches!(rule.guard(), Some(crate::policy::Guard::Breaker(b)) if b.alert);
            // Names from the policy file: escaped like every value of a line.
            let value = crate::telemetry::log_line::value;
            if alert {
                tracing::error!(target: SERVICE_LOG_TARGET, policy = %value(&rule.policy_id), rule = %value(&rule.name), mode = %rule.mode.as_str(), open_secs, "CIRCUIT_BREAKER_OPEN");
            } else {
                tracing::warn!(target: SERVICE_LOG_TARGET, policy = %value(&rule.policy_id), rule = %value(&rule.name), mode = %rule.mode.as_str(), open_secs, "CIRCUIT_BREAKER_OPEN");
            }
        }
    }

    /// Gives back the concurrency slots a request held, once it is done (the proxy, when the
    /// response has been sent or the request failed; the decision service, on `/v1/release`).
    pub async fn release(&self, lease: &Lease) {
        self.store.release(lease.id, &lease.keys).await;
    }

    /// The way back up, written from the decision and its request alone: breakers tripped,
    /// the operator's list of limited clients, metrics, headers (and Fairvisor's under
    /// `--compat fairvisor`), the `RATE_LIMIT` line, and what the front end acts on. With
    /// `lines`, a refusal's headers come as HTTP/1 lines (not under `--compat fairvisor`, whose
    /// headers are finished on the list).
    /// `started` is when the decision began (its latency is measured from it); `wall_us` the
    /// wall-clock time (Unix µs) it read, if it read one, reused for the operator's list of
    /// limited clients and the `RATE_LIMIT` line instead of reading the clock again.
    fn answer(
        &self,
        decided: &Decided<'_>,
        started: Instant,
        wall_us: Option<u64>,
        lines: bool,
    ) -> Answer {
        let decision = &decided.decision;
        self.breakers_tripped(decision);
        crate::operator::limited::note_limited(
            &self.top,
            decided,
            &*self.clock,
            wall_us,
            self.engine_config,
            &self.fingerprint_key,
        );
        self.usage.note(
            decided,
            &super::usage::NoteContext {
                clock: &*self.clock,
                engine: self.engine_config,
                store: &self.store,
                webhooks: &self.webhooks,
                fingerprints: &self.fingerprint_key,
                metrics: &self.metrics,
            },
        );
        self.metrics
            .record(decision, started.elapsed().as_secs_f64());
        let mut response =
            if lines && self.config.compat != crate::engine::compat::Compat::Fairvisor {
                headers::build_lines(decided, &self.header_config)
            } else {
                headers::build(decided, &self.header_config)
            };
        log_decision(decided, response.status, wall_us);
        self.compat_headers(&mut response, decided);
        Answer {
            verdict: match decision {
                Decision::Allow(_) => Verdict::Allowed,
                Decision::NoPolicy => Verdict::NoPolicy,
                Decision::Refuse(refusal) => Verdict::Refused {
                    reason: refusal.reason,
                    rule: match decision.refused_by() {
                        Some(RefusedBy::Rule(rule)) => Some(rule.name.clone()),
                        _ => None,
                    },
                },
            },
            throttle_ms: decision.checked().map_or(0, |c| c.throttle_ms()),
            pace: None,
            waited_us: 0,
            paced_by: None,
            lease: held_lease(decision),
            reservation: decision.reservation().map(Box::new),
            model: None,
            charges: decision.response_charges().map(Box::new),
            // Only for a request whose span is recorded: nothing is built otherwise.
            summary: decided
                .request
                .facts
                .and_then(|f| f.trace)
                .filter(|t| t.sampled)
                .map(|_| Box::new(DecisionSummary::of(decision))),
            response: Box::new(response),
        }
    }

    /// Decides an original request described by another gateway (the decision service, Envoy's
    /// ext_authz): facts from the method, target and host, JWT claims from the headers, and a
    /// path with an encoded slash under `--encoded-slashes reject` refused before the engine.
    pub async fn decide_described(&self, described: &Described<'_>) -> Answer {
        // A path whose `;` parameters servers read as different places is refused here too, as
        // the proxy refuses it: no one match path stands for both readings.
        if !crate::request::syntax::path_parameters_ok(described.target.as_bytes()) {
            return self.refused_described(described, Reason::MalformedRequest);
        }
        let lookup = HttpHeaders(described.headers);
        let claims = self.claims(&lookup);
        match self.described_facts(described, &lookup, claims.as_deref()) {
            Ok(facts) => self.decide(&facts).await,
            Err(_) => self.refused_described(described, Reason::EncodedSlash),
        }
    }

    /// A described request refused before any matching, for `reason`.
    fn refused_described(&self, described: &Described<'_>, reason: Reason) -> Answer {
        let (path, _) = crate::request::descriptor::split_uri(described.target);
        Answer {
            verdict: Verdict::Refused { reason, rule: None },
            throttle_ms: 0,
            pace: None,
            waited_us: 0,
            paced_by: None,
            lease: None,
            reservation: None,
            model: None,
            charges: None,
            summary: described
                .trace
                .filter(|t| t.sampled)
                .map(|_| Box::new(DecisionSummary::refused(reason))),
            response: Box::new(self.refuse_early(
                reason,
                described.client_ip,
                described.host,
                path,
            )),
        }
    }

    /// The facts of a described request, with its verified claims.
    ///
    /// # Errors
    /// Its path has an encoded slash and `--encoded-slashes reject` is set.
    pub(crate) fn described_facts<'a>(
        &self,
        described: &'a Described<'a>,
        lookup: &'a HttpHeaders<'a>,
        claims: Option<&'a Claims>,
    ) -> Result<RequestFacts<'a>, crate::request::descriptor::EncodedSlashError> {
        Ok(RequestFacts::new(
            described.method,
            described.target,
            described.host,
            described.client_ip,
            lookup,
            self.config.encoded_slashes,
        )?
        .with_claims(claims)
        .with_body_hash(described.body.hash)
        .with_llm(described.body.llm)
        // Its network headers are believed only from a caller the operator named.
        .with_trusted_peer(described.network_trusted)
        .with_trace(described.trace))
    }

    /// Drops buckets that no longer matter (see [`Store::sweep`]) and LLM reservations nobody
    /// reported in time.
    pub async fn sweep(&self) -> u64 {
        self.tokens.expire();
        self.store.sweep().await
    }

    pub fn metrics_text(&self) -> String {
        let bundle = self.policy.load();
        self.metrics
            .bundle_state(bundle.as_deref(), self.clock.unix_secs());
        let mut text = self.metrics.render(self.store.stats());
        if self.config.compat == crate::engine::compat::Compat::Fairvisor {
            let fairvisor = crate::engine::compat::fairvisor_metrics(
                &text,
                bundle.as_deref(),
                self.clock.unix_secs(),
            );
            text.push_str(&fairvisor);
        }
        text
    }

    /// The `tiktoken` encodings the bundle in force counts prompts in (see
    /// [`crate::request::llm::LlmRequest::parse_with`]).
    pub fn tiktoken_encodings(&self) -> u8 {
        self.policy.load().as_deref().map_or(0, |b| b.tiktoken)
    }

    /// Whether the bundle in force has a `token_bucket_llm` rule (the decision service then
    /// reads request bodies, bounded by `--max-body-bytes`).
    pub fn meters_tokens(&self) -> bool {
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.meters_tokens)
    }

    /// Whether a `token_bucket_llm` rule of the bundle in force may apply to this request:
    /// front ends then read its body (bounded by `--max-body-bytes`) before deciding, and meter
    /// its response.
    pub fn meters_tokens_for(&self, facts: &RequestFacts<'_>) -> bool {
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.meters_tokens_for(facts))
    }

    /// Whether an enforced `token_bucket_llm` rule may apply to this request: a body too large
    /// to read is then refused (413); with shadow rules alone it goes through unread.
    pub fn enforces_tokens_for(&self, facts: &RequestFacts<'_>) -> bool {
        let now = self.clock.unix_secs();
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.enforces_tokens_for(facts, now))
    }

    /// Whether any enforced `token_bucket_llm` rule is in force (the decision service's
    /// coarser question: it reads the body before it knows the request).
    pub fn enforces_tokens(&self) -> bool {
        let now = self.clock.unix_secs();
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.enforces_tokens(now))
    }

    /// Answers an Envoy `ShouldRateLimit` call ([`crate::engine::rls`]): every descriptor's buckets in
    /// one store call (after a peek when a descriptor only checks), one status per
    /// descriptor, the merged decision counted, logged and turned into headers. A store that
    /// does not answer leaves each rule to its `on_store_error` (counted), unless
    /// `store_errors_fail_open` is false: then the call is answered `UNAVAILABLE`, for Envoy's
    /// own `failure_mode_deny` to decide.
    ///
    /// # Errors
    /// A malformed call, no policy loaded, or (when not failing open) a store failure.
    pub async fn should_rate_limit(
        &self,
        request: &RlsRequest,
        store_errors_fail_open: bool,
    ) -> Result<RlsReply, RlsFailure> {
        let started = Instant::now();
        let Some(bundle) = self.policy.load_full() else {
            return Err(RlsFailure::NoPolicy);
        };
        let unix_us = self.clock.unix_us();
        let plan = rls::plan(&bundle, request, unix_us, self.engine_config)
            .map_err(RlsFailure::Invalid)?;
        let now_us = self.store.now_us();
        let ran = envoy_rls::StoreRun::run(&self.store, &plan, now_us).await;
        let outcome = plan.finish(ran.answer(), now_us);
        // Decided without the store (its call failed, or a rule's `on_store_error` decided).
        let store_failed = ran.failed() || outcome.decision.store_error();
        if self.candidate.is_set() {
            self.candidate.after_rls(request, unix_us);
        }
        self.metrics
            .record(&outcome.decision, started.elapsed().as_secs_f64());
        if store_failed && !store_errors_fail_open {
            return Err(RlsFailure::StoreUnavailable);
        }
        let client_ip = request.descriptors.iter().find_map(|d| {
            d.entries
                .iter()
                .find(|(k, _)| k == "remote_address")
                .and_then(|(_, v)| v.parse::<IpAddr>().ok())
        });
        let over_limit = outcome.over_limit();
        let decided = Decided {
            decision: outcome.decision,
            request: RequestView {
                client_ip,
                host: Some(&request.domain),
                path: "/",
                ..RequestView::default()
            },
        };
        let response = headers::build(&decided, &self.header_config);
        // Stamped when written: the store's round trip came after the decision's reading.
        log_decision(&decided, response.status, None);
        Ok(RlsReply {
            over_limit,
            statuses: outcome.statuses,
            response,
        })
    }

    /// Loads the policy file now (start-up and SIGHUP). An invalid file leaves the bundle in
    /// force untouched; the error names the file and every problem.
    ///
    /// # Errors
    /// The file could not be read, parsed or validated.
    pub fn load_policy(&self, trigger: Trigger) -> Result<(), PolicyError> {
        if trigger != Trigger::Startup {
            let _ = self
                .reload
                .load_network(&self.config, &self.metrics, trigger);
        }
        if let Err(e) = self.verifier.reload_jwks() {
            tracing::error!(
                target: RELOAD_LOG_TARGET,
                trigger = trigger.as_str(),
                "JWKS reload failed, keeping the previous keys: {e}"
            );
        }
        if self.config.policy_store.is_some() {
            // The bundle comes from the policy store, which the follower watches.
            return Ok(());
        }
        let path = &self.config.policy;
        let sig = signature(path);
        let options = crate::policy::CompileOptions {
            skip_invalid_policies: self.config.skip_invalid_policies,
            ..Default::default()
        };
        // A file that puts nothing in force would switch every limit off: refused like an
        // invalid one (at start-up the gateway stops; at a reload the bundle in force stays).
        let loaded =
            crate::policy::load_current(path, options, self.clock.unix_secs()).and_then(|bundle| {
                if bundle.enforces_nothing() && !self.config.allow_empty_policy {
                    Err(PolicyError::Empty {
                        file: path.clone(),
                        skipped: bundle.skipped.len(),
                    })
                } else {
                    Ok(bundle)
                }
            });
        match loaded {
            Ok(bundle) => {
                let (version, hash) = (bundle.version.clone(), bundle.hash.clone());
                let in_memory = matches!(self.config.store, StoreKind::Memory)
                    && self.store.stats().state_fallback != Some(false);
                if let Some(warning) = bundle.restart_warning().filter(|_| in_memory) {
                    tracing::warn!(target: RELOAD_LOG_TARGET, policy_file = %path.display(), "{warning}");
                }
                let trust = crate::policy::key_origin::KeyTrust {
                    jwt_claims_verified: !self.verifier.unverified(),
                    default_v6_prefix: self.config.ipv6_prefix,
                };
                for warning in bundle.made_up_key_warnings(&trust) {
                    tracing::warn!(target: RELOAD_LOG_TARGET, policy_file = %path.display(), "policy warning: {warning}");
                }
                self.install(bundle, None, "file");
                crate::policy::release_parse_memory();
                self.reload.policy_loaded(sig);
                self.metrics.reload(true);
                tracing::info!(target: RELOAD_LOG_TARGET, policy_file = %path.display(), version = %version, hash = %hash, trigger = trigger.as_str(), "policy loaded");
                Ok(())
            }
            Err(e) => {
                crate::policy::release_parse_memory();
                self.metrics.reload(false);
                let kept = self.loaded.load().as_ref().map(|p| p.version.clone());
                match kept {
                    Some(v) => tracing::error!(
                        target: RELOAD_LOG_TARGET,
                        trigger = trigger.as_str(),
                        "policy reload rejected, keeping bundle_version {v}: {e}"
                    ),
                    // Start-up stops on it, and says why.
                    None if trigger == Trigger::Startup
                        && matches!(e, PolicyError::Empty { .. }) => {}
                    None => tracing::error!(
                        target: RELOAD_LOG_TARGET,
                        trigger = trigger.as_str(),
                        "no valid policy loaded (decisions answer 503): {e}"
                    ),
                }
                self.reload.policy_rejected(path, sig);
                Err(e)
            }
        }
    }

    /// Reloads when the policy file changed since it was last looked at (polling), and the
    /// JWKS file when it changed on its own (key rotation).
    pub fn reload_if_changed(&self) {
        match self.verifier.reload_jwks_if_changed() {
            Some(Ok(())) => {
                tracing::info!(target: RELOAD_LOG_TARGET, "JWKS file changed: keys reloaded")
            }
            Some(Err(e)) => {
                tracing::error!(target: RELOAD_LOG_TARGET, "JWKS reload failed, keeping the previous keys: {e}")
            }
            None => {}
        }
        if self.reload.network_changed(&self.config) {
            let _ = self
                .reload
                .load_network(&self.config, &self.metrics, Trigger::FileChange);
        }
        if self.config.policy_store.is_none()
            && self
                .reload
                .policy_changed(&self.config.policy, &self.loaded)
        {
            let _ = self.load_policy(Trigger::FileChange);
        }
    }

    /// Puts `bundle` in force (from the policy file, or version `published` of the policy
    /// store), logging its warnings and skipped policies.
    pub(super) fn install(&self, bundle: Bundle, published: Option<u64>, source: &'static str) {
        let info = LoadedPolicy {
            version: bundle.version.clone(),
            hash: bundle.hash.clone(),
            loaded_at: wall_unix_secs(),
            sha256: bundle.sha256.clone(),
            published,
            source,
        };
        for warning in &bundle.warnings {
            match published {
                Some(version) => {
                    tracing::warn!(target: RELOAD_LOG_TARGET, version, "policy warning: {warning}")
                }
                None => {
                    tracing::warn!(target: RELOAD_LOG_TARGET, policy_file = %self.config.policy.display(), "policy warning: {warning}")
                }
            }
        }
        for skipped in &bundle.skipped {
            for error in &skipped.errors {
                tracing::error!(target: RELOAD_LOG_TARGET, policy_file = %self.config.policy.display(), policy = %skipped.path, id = %skipped.id, "policy skipped (--skip-invalid-policies): {error}");
            }
        }
        for (name, o) in [
            ("global_shadow", &bundle.global_shadow),
            ("kill_switch_override", &bundle.kill_switch_override),
        ] {
            if let Some(o) = o {
                tracing::warn!(target: RELOAD_LOG_TARGET, reason = %o.reason, expires_at = o.expires_at, "runtime override {name} enabled in the bundle");
            }
        }
        // Buckets live in the store, not in the bundle: they survive the swap, and a lowered
        // burst caps their tokens on the next request.
        let bundle = Arc::new(bundle);
        self.metrics.on_install(&bundle);
        self.metrics
            .policy_source
            .bundle(&info.bundle_version(), &info.sha256, source);
        // The runtime overrides are compiled against the new bundle before it is in force.
        self.overrides
            .install_with(&bundle, || self.policy.store(Some(Arc::clone(&bundle))));
        self.loaded.store(Some(Arc::new(info)));
        self.candidate.follow_live(self.policy.load_full());
    }

    /// The periodic step of the runtime override table ([`Overrides::refresh`]): a change is
    /// put in force on the bundle in force.
    pub async fn refresh_overrides(&self) {
        if self
            .overrides
            .refresh(&self.store, self.clock.unix_us())
            .await
        {
            if let Some(bundle) = self.policy.load_full() {
                self.overrides.changed(&bundle);
            }
        }
    }

    /// The runtime overrides of the bundle in force, and whether each is active now.
    pub(crate) fn runtime_overrides(&self) -> serde_json::Value {
        let now = self.clock.unix_secs();
        let guard = self.policy.load();
        let Some(bundle) = guard.as_deref() else {
            return serde_json::json!({});
        };
        let show = |o: &Option<crate::policy::RuntimeOverride>| match o {
            Some(o) => serde_json::json!({
                "active": o.active(now),
                "reason": o.reason,
                "expires_at": humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_secs(o.expires_at.max(0) as u64)
                ).to_string(),
            }),
            None => serde_json::json!({"active": false}),
        };
        serde_json::json!({
            "global_shadow": show(&bundle.global_shadow),
            "kill_switch_override": show(&bundle.kill_switch_override),
        })
    }

    /// `/readyz`: status code and JSON body.
    pub fn readiness(&self) -> (u16, String) {
        match self.loaded.load().as_ref() {
            Some(p) => (
                200,
                self.with_fleet_size(serde_json::json!({
                    "status": "ready",
                    // Written as a number when it is one (Fairvisor bundles may use any text).
                    "policy_version": p.version.parse::<u64>().map_or_else(
                        |_| serde_json::Value::String(p.version.clone()),
                        serde_json::Value::from,
                    ),
                    "skipped_policies": self.policy.load().as_deref().map_or_else(Vec::new, |b| {
                        b.skipped.iter().map(|s| serde_json::json!({"path": s.path, "id": s.id, "errors": s.errors.iter().map(ToString::to_string).collect::<Vec<_>>()})).collect()
                    }),
                    "runtime_overrides": self.runtime_overrides(),
                    "policy_hash": p.hash,
                    "bundle_version": p.published.map_or_else(
                        || p.version.parse::<u64>().map_or_else(
                            |_| serde_json::Value::String(p.version.clone()),
                            serde_json::Value::from,
                        ),
                        serde_json::Value::from,
                    ),
                    "bundle_hash": p.sha256,
                    "bundle_source": p.source,
                    "policy_source": self.follow.policy_source_json(),
                    "loaded_at": p.loaded_at,
                    "store": self.store.kind(),
                    // A degraded store fails open; it does not make the gateway unready.
                    "store_status": if self.store.degraded() { "degraded" } else { "ok" },
                    "store_mode": self.store_mode_json(),
                }))
                .to_string(),
            ),
            None => {
                let mut body =
                    serde_json::json!({"status": "not_ready", "reason": "no_policy_loaded"});
                if self.store.local().is_some() {
                    body["store_mode"] = self.store_mode_json();
                    body = self.with_fleet_size(body);
                }
                let source = self.follow.policy_source_json();
                if !source.is_null() {
                    body["policy_source"] = source;
                }
                (503, body.to_string())
            }
        }
    }

    /// `body` with `fleet_gateways` (N) when the store is shared.
    fn with_fleet_size(&self, mut body: serde_json::Value) -> serde_json::Value {
        if let Some(local) = self.store.local() {
            body["fleet_gateways"] = local.gateways().into();
        }
        body
    }

    /// `store_mode` in `/readyz`: `shared` (the store decides), `local` (this gateway decides
    /// from its share while the store does not answer), or `embedded` (no shared store).
    fn store_mode_json(&self) -> serde_json::Value {
        match self.store.local() {
            None => "embedded".into(),
            Some(local) if local.is_local() => "local".into(),
            Some(_) => "shared".into(),
        }
    }
}
