//! The running gateway's state, independent of Pingora: the bundle in force, the store, metrics,
//! and the one request path shared by the reverse proxy and the decision service:
//! [`Gateway::decide`] plans with the pure engine, asks the store (synchronously for the
//! embedded store, awaited in place for a shared one), finishes, and answers (counts, logs and
//! builds the response from the [`Decided`] alone).
//!
//! Beside it: `reload` (the policy file, network databases, overrides, readiness), `tokens`
//! (LLM reservations held and settled), `envoy_rls` (Envoy's `ShouldRateLimit`), `logging`
//! (the subscriber, the redacting bridge for Pingora's records, the `RATE_LIMIT` lines),
//! `debug_sessions` (Fairvisor's debug sessions: login, logout, throttling), `state_key` (the
//! state dir's own keys: masked values' fingerprints, reservation signing), `candidate` (the
//! candidate bundle decided in shadow after every live decision). Below them all: `gateway`
//! (the [`Gateway`] value itself) and the state it holds, `loaded` (the bundle in force as
//! `/readyz` reports it, watched files' signatures), `source_state` (what the policy-store
//! follower knows) and `shadow` (the candidate in force and its counters). A child names the
//! sibling that defines what it uses, never this file.

mod candidate;
mod debug_sessions;
mod envoy_rls;
pub mod follow;
mod gateway;
mod loaded;
mod logging;
mod reload;
mod shadow;
mod source_state;
pub mod state_key;
mod tokens;

pub use candidate::{CandidateSummary, MAX_CANDIDATE_PENDING};
pub use debug_sessions::DebugLogin;
pub use envoy_rls::{RlsFailure, RlsReply};
pub use gateway::Gateway;
pub use loaded::LoadedPolicy;
pub use logging::init_logging;
use logging::log_decision;
use tokens::state_reservation_key;

use crate::config::{Config, StoreKind};
use crate::engine::headers::{self, HeaderConfig, Response};
use crate::engine::{
    self, Decided, Decision, EngineConfig, Plan, Reason, RefusedBy, RequestView, Reservation,
};
use crate::limits::clock::{Clock, SystemClock};
use crate::request::auth::{AuthError, TokenOutcome, Verifier};
use crate::request::client_addr::{self, ForwardingHeaders};
use crate::request::descriptor::{Claims, HeaderLookup, RequestFacts};
use crate::store::lease::{next_lease_id, Lease, LeaseResults};
use crate::store::{Backend, MemoryStoreConfig, OpResults, Store, StoreError};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::traces::DecisionSummary;
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

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
    #[error("{0}")]
    Network(String),
    #[error("{0}")]
    FingerprintKey(#[from] state_key::KeyFileError),
}

/// `X-Forwarded-For` and `X-Real-IP`, parsed once (a name given as a string is parsed at every
/// lookup).
pub static X_FORWARDED_FOR: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");
pub static X_REAL_IP: http::HeaderName = http::HeaderName::from_static("x-real-ip");

/// Headers of an `http` request, for the engine.
pub struct HttpHeaders<'a>(pub &'a http::HeaderMap);

impl HeaderLookup for HttpHeaders<'_> {
    fn header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.0.get(lower_name).map(http::HeaderValue::as_bytes)
    }

    fn last_header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.0
            .get_all(lower_name)
            .iter()
            .next_back()
            .map(http::HeaderValue::as_bytes)
    }

    fn is_repeated(&self, lower_name: &str) -> bool {
        self.0.get_all(lower_name).iter().nth(1).is_some()
    }

    fn repeats_any(&self) -> bool {
        // Every extra line of a name is one more value than there are names.
        self.0.len() != self.0.keys_len()
    }
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
        let gateway = Gateway {
            metrics: Metrics::new(store.kind()),
            header_config,
            verifier,
            store: Arc::new(store),
            engine_config: EngineConfig {
                ipv6_prefix: config.ipv6_prefix,
            },
            clock,
            policy: ArcSwapOption::empty(),
            loaded: ArcSwapOption::empty(),
            top: Mutex::new(crate::operator::top::TopSketch::default()),
            network: arc_swap::ArcSwap::from_pointee(
                crate::request::network::NetworkData::default(),
            ),
            network_watch: Mutex::new(Vec::new()),
            watch: Mutex::new((None, None)),
            held: Mutex::new(ahash::AHashMap::new()),
            reservation_key: match (&config.reservation_secret, &config.state_dir) {
                (Some(secret), _) => Some(crate::engine::reservation_token::key(&secret.0)),
                // With a state dir, the decision service's reservations travel signed (with
                // the directory's own key) so that a restart can still settle them.
                (None, Some(state)) if matches!(config.store, StoreKind::Memory) => {
                    state_reservation_key(&state.dir)
                }
                (None, _) => None,
            },
            debug_sessions: match &config.debug_secret {
                Some(secret) => Some(parking_lot::RwLock::new(
                    crate::engine::compat::DebugSessions::new(
                        secret.clone(),
                        &state_key::random_bytes::<32>()?,
                    ),
                )),
                None => None,
            },
            fingerprint_key: state_key::fingerprint_key(
                config.state_dir.as_ref().map(|s| s.dir.as_path()),
            )?,
            telemetry: std::sync::OnceLock::new(),
            source_state: source_state::new_state(),
            candidate: ArcSwapOption::empty(),
            candidate_on: std::sync::atomic::AtomicBool::new(false),
            candidate_pending: Arc::default(),
            config,
        };
        gateway
            .load_network("startup")
            .map_err(StartError::Network)?;
        Ok(gateway)
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
            || (self.has_candidate() && self.candidate_uses_network());
        uses.then(|| {
            self.network
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

    /// Whether the bundle in force fingerprints request bodies (`loop_detection`): front ends
    /// then hash the bodies they can read before deciding.
    pub fn fingerprints_bodies(&self) -> bool {
        self.policy
            .load()
            .as_deref()
            .is_some_and(|b| b.fingerprints_bodies)
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
        self.answer(&decided, Instant::now()).response
    }

    /// Decides one request: plan, store, finish, count, log, respond. The embedded store answers
    /// on this thread without suspending; a shared store is awaited here, with the bundle held
    /// as an `Arc` (an `arc_swap` guard must not live across a network call).
    pub async fn decide(&self, facts: &RequestFacts<'_>) -> Answer {
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

    /// [`Gateway::decide`] without a future, when the store is in memory (it decides without
    /// waiting): the proxy's per-request path, which would otherwise box the whole decision
    /// future. `None` with another store: call [`Gateway::decide`]. An answer with
    /// `throttle_ms` still owes its wait: [`Gateway::throttled`].
    pub fn decide_in_memory(&self, facts: &RequestFacts<'_>) -> Option<Answer> {
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
        self.decide_locally(facts)
    }

    /// A budget's throttle stage: the request goes on, later (Fairvisor sleeps too).
    pub async fn throttled(answer: Answer) -> Answer {
        if answer.throttle_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(answer.throttle_ms)).await;
        }
        answer
    }

    /// The in-memory store's decision (synchronous); `None` with another store.
    fn decide_locally(&self, facts: &RequestFacts<'_>) -> Option<Answer> {
        let Backend::Memory(memory) = self.store.backend() else {
            return None;
        };
        let started = Instant::now();
        let unix_us = self.clock.unix_us();
        let now_us = self.store.now_us();
        let guard = self.policy.load();
        let decision = match guard.as_deref() {
            None => Decision::NoPolicy,
            Some(bundle) => {
                engine::decide_local(bundle, facts, memory, now_us, unix_us, self.engine_config)
            }
        };
        let decided = Decided {
            decision,
            request: RequestView::of(facts),
        };
        let answer = self.answer(&decided, started);
        if self.has_candidate() {
            self.candidate_local(&decided.decision, facts, memory, now_us, unix_us);
        }
        Some(answer)
    }

    async fn decide_now(&self, facts: &RequestFacts<'_>) -> Answer {
        if let Some(answer) = self.decide_locally(facts) {
            return answer;
        }
        let started = Instant::now();
        let unix_us = self.clock.unix_us();
        let Some(bundle) = self.policy.load_full() else {
            let decided = Decided {
                decision: Decision::NoPolicy,
                request: RequestView::of(facts),
            };
            return self.answer(&decided, started);
        };
        let decision = match engine::plan(&bundle, facts, unix_us, self.engine_config) {
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
                        engine::finish(pending, answer.map(|()| &results))
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
                decision
            }
        };
        let decided = Decided {
            decision,
            request: RequestView::of(facts),
        };
        let answer = self.answer(&decided, started);
        if self.has_candidate() {
            self.candidate_shared(&decided.decision, facts, unix_us);
        }
        answer
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
            self.debug_session_open(cookie),
        );
    }

    /// Logs and counts the circuit breakers a decision tripped (at error level for a breaker
    /// with `alert: true`, so log-based alerting catches it).
    fn breakers_tripped(&self, decision: &Decision<'_>) {
        for (trip, rule) in decision.breaker_trips() {
            self.metrics.breaker_tripped(rule);
            let open_secs = trip.ttl_us / crate::limits::limiter::US_PER_SEC;
            let alert = matches!(rule.guard, Some(crate::policy::Guard::Breaker(b)) if b.alert);
            // Names from the policy file: escaped like every value of a line.
            let value = crate::telemetry::log_line::value;
            if alert {
                tracing::error!(policy = %value(&rule.policy_id), rule = %value(&rule.name), mode = %rule.mode.as_str(), open_secs, "CIRCUIT_BREAKER_OPEN");
            } else {
                tracing::warn!(policy = %value(&rule.policy_id), rule = %value(&rule.name), mode = %rule.mode.as_str(), open_secs, "CIRCUIT_BREAKER_OPEN");
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
    /// `--compat fairvisor`), the `RATE_LIMIT` line, and what the front end acts on.
    fn answer(&self, decided: &Decided<'_>, started: Instant) -> Answer {
        let decision = &decided.decision;
        self.breakers_tripped(decision);
        self.note_limited(decided);
        self.metrics
            .record(decision, started.elapsed().as_secs_f64());
        let mut response = headers::build(decided, &self.header_config);
        log_decision(decided, response.status);
        self.compat_headers(&mut response, decided);
        Answer {
            allowed: decision.is_allowed(),
            throttle_ms: decision.checked().map_or(0, |c| c.throttle_ms()),
            lease: held_lease(decision),
            reservation: decision.reservation(),
            no_policy: matches!(decision, Decision::NoPolicy),
            reason: match decision {
                Decision::Refuse(refusal) => Some(refusal.reason),
                _ => None,
            },
            rule: match decision.refused_by() {
                Some(RefusedBy::Rule(rule)) => Some(rule.name.clone()),
                _ => None,
            },
            // Only for a request whose span is recorded: nothing is built otherwise.
            summary: decided
                .request
                .facts
                .and_then(|f| f.trace)
                .filter(|t| t.sampled)
                .map(|_| Box::new(DecisionSummary::of(decision))),
            response,
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
            allowed: false,
            throttle_ms: 0,
            lease: None,
            reservation: None,
            no_policy: false,
            reason: Some(reason),
            rule: None,
            summary: described
                .trace
                .filter(|t| t.sampled)
                .map(|_| Box::new(DecisionSummary::refused(reason))),
            response: self.refuse_early(reason, described.client_ip, described.host, path),
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
        self.expire_reservations();
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
}

/// An original request another gateway describes (the decision service's `X-Original-*`
/// headers, Envoy's ext_authz), as the engine is asked about it.
#[derive(Clone, Copy)]
pub struct Described<'a> {
    pub method: &'a str,
    /// Path and query.
    pub target: &'a str,
    pub host: Option<&'a str>,
    pub client_ip: Option<IpAddr>,
    pub headers: &'a http::HeaderMap,
    pub body: DescribedBody<'a>,
    /// Whether its network headers (`X-Country-Code`, `X-ASN`, `X-ASN-Type`, `X-Tor-Exit`)
    /// are believed: the caller is a `--trusted-proxy` peer ([`Gateway::believes_network_headers`]),
    /// or an operator asks `/v1/explain`.
    pub network_trusted: bool,
    /// The trace of the call that describes it, when tracing is on.
    pub trace: Option<crate::request::descriptor::TraceFacts>,
}

/// What a described request's body contributes: its fingerprint (for `body_hash`
/// descriptors) and, when a `token_bucket_llm` rule meters it, the parsed prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct DescribedBody<'a> {
    pub hash: Option<u64>,
    pub llm: Option<&'a crate::request::llm::LlmRequest>,
}

/// What a front end needs to answer a request.
#[derive(Debug)]
pub struct Answer {
    /// Forward it (allowed, or no policy loaded: the proxy fails open).
    pub allowed: bool,
    /// A budget's throttle stage: milliseconds [`Gateway::decide`] waited before answering.
    pub throttle_ms: u64,
    /// The concurrency slots an allowed request holds: give them back with
    /// [`Gateway::release`] when it is done (they expire otherwise).
    pub lease: Option<Lease>,
    /// The tokens an allowed request reserved on `token_bucket_llm` rules: settle them with
    /// [`Gateway::settle`] once the response's usage is known.
    pub reservation: Option<Reservation>,
    /// No valid bundle is loaded (the decision service answers 503).
    pub no_policy: bool,
    /// Why it was refused.
    pub reason: Option<Reason>,
    /// The rule that refused it (a refusal by buckets or by a rule's missing descriptor).
    pub rule: Option<String>,
    /// Status, headers and body of a refusal; headers to add upstream on allow.
    pub response: Response,
    /// What a trace's span says of the decision (only for a sampled request).
    pub summary: Option<Box<DecisionSummary>>,
}

impl Answer {
    /// The access log's verdict: the refusal's reason, `no_policy` or `allow`.
    pub fn verdict(&self) -> &'static str {
        match self.reason {
            Some(reason) => reason.as_str(),
            None if self.no_policy => "no_policy",
            None => "allow",
        }
    }
}

/// The lease an allowed decision holds: its committed concurrency slots, with the longest of
/// their rules' lease TTLs (a refused decision's leases were given back already).
fn held_lease(decision: &Decision<'_>) -> Option<Lease> {
    let Decision::Allow(checked) = decision else {
        return None;
    };
    let keys = checked.held_leases();
    if keys.is_empty() {
        return None;
    }
    let ttl_us = checked
        .slots
        .iter()
        .filter_map(|s| s.rule.concurrency.map(|c| c.lease_ttl_us))
        .max()
        .unwrap_or(0);
    Some(Lease {
        id: checked.lease_id,
        keys,
        ttl_secs: ttl_us / crate::limits::limiter::US_PER_SEC,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_map_repeating_a_name_says_so() {
        let mut map = http::HeaderMap::new();
        map.insert("x-tier", http::HeaderValue::from_static("a"));
        map.insert("x-api-key", http::HeaderValue::from_static("k"));
        assert!(!HttpHeaders(&map).repeats_any());
        map.append("x-tier", http::HeaderValue::from_static("b"));
        assert!(HttpHeaders(&map).repeats_any());
        assert!(HttpHeaders(&map).is_repeated("x-tier"));
        assert!(!HttpHeaders(&map).is_repeated("x-api-key"));
    }
}
