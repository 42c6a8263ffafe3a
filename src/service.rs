//! The running gateway's state, independent of Pingora: the engine and its store, metrics, the
//! policy file and its reloads, and the request-level steps shared by the reverse proxy and the
//! decision service (client address, decide, log, count, build the response).

use crate::auth::{AuthError, TokenOutcome, Verifier};
use crate::cli::LogFormat;
use crate::client_addr::{self, ForwardingHeaders};
use crate::clock::{wall_unix_secs, Clock, SystemClock};
use crate::config::{Config, StoreKind};
use crate::descriptor::{Claims, HeaderLookup, RequestFacts};
use crate::engine::{Decision, Engine, EngineConfig, Outcome, Plan};
use crate::headers::{self, HeaderConfig, JitterIdentity, Response};
use crate::metrics::Metrics;
use crate::policy::{load_file, Bundle, Mode, PolicyError};
use crate::store::{
    BucketOp, MemoryStore, MemoryStoreConfig, OpResults, SharedStore, Store, StoreError,
};
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// What `/readyz` reports about the bundle in force.
#[derive(Debug, Clone)]
pub struct LoadedPolicy {
    pub version: u64,
    pub hash: String,
    /// Unix seconds.
    pub loaded_at: i64,
}

/// Cheap change detection for the policy file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileSignature {
    modified: Option<SystemTime>,
    len: u64,
}

fn signature(path: &Path) -> Option<FileSignature> {
    let meta = std::fs::metadata(path).ok()?;
    Some(FileSignature {
        modified: meta.modified().ok(),
        len: meta.len(),
    })
}

/// Why a gateway cannot be built from a valid configuration.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Jwt(#[from] AuthError),
    #[error("--store: {0}")]
    Store(StoreError),
}

/// Headers of an `http` request, for the engine.
pub struct HttpHeaders<'a>(pub &'a http::HeaderMap);

impl HeaderLookup for HttpHeaders<'_> {
    fn header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.0.get(lower_name).map(http::HeaderValue::as_bytes)
    }

    fn is_repeated(&self, lower_name: &str) -> bool {
        self.0.get_all(lower_name).iter().nth(1).is_some()
    }
}

/// The gateway.
pub struct Gateway {
    pub engine: Engine<MemoryStore>,
    pub metrics: Metrics,
    pub config: Config,
    pub header_config: HeaderConfig,
    pub verifier: Verifier,
    /// A store shared with other gateways; `None` = the engine's embedded store.
    pub remote: Option<Arc<SharedStore>>,
    loaded: ArcSwapOption<LoadedPolicy>,
    /// Signature of the file last looked at, and the hash of the last rejected content (so a
    /// broken file is reported once, not at every poll).
    watch: Mutex<(Option<FileSignature>, Option<String>)>,
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
        let remote = match &config.store {
            StoreKind::Memory => None,
            StoreKind::Shared(url) => Some(Arc::new(
                SharedStore::open(url, config.store_timeout).map_err(StartError::Store)?,
            )),
        };
        let store = MemoryStore::new(MemoryStoreConfig {
            max_buckets: config.max_buckets,
            idle_timeout_us: config.bucket_idle.as_micros().min(u64::MAX as u128) as u64,
            ..MemoryStoreConfig::default()
        });
        let engine = Engine::new(
            store,
            clock,
            EngineConfig {
                ipv6_prefix: config.ipv6_prefix,
            },
        );
        // Leaked once at start-up: response headers carry `&'static str` names.
        let reason_header: &'static str = Box::leak(config.reason_header.clone().into_boxed_str());
        Ok(Gateway {
            engine,
            metrics: Metrics::new(),
            header_config: HeaderConfig { reason_header },
            verifier,
            remote,
            config,
            loaded: ArcSwapOption::empty(),
            watch: Mutex::new((None, None)),
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

    fn install(&self, bundle: Bundle) {
        let info = LoadedPolicy {
            version: bundle.version,
            hash: bundle.hash.clone(),
            loaded_at: wall_unix_secs(),
        };
        for warning in &bundle.warnings {
            tracing::warn!(policy_file = %self.config.policy.display(), "policy warning: {warning}");
        }
        self.engine.install(bundle);
        if let Some(installed) = self.engine.bundle() {
            self.metrics.on_install(&installed);
        }
        self.loaded.store(Some(Arc::new(info)));
    }

    /// Loads the policy file now (start-up and SIGHUP). An invalid file leaves the bundle in
    /// force untouched; the error names the file and every problem.
    ///
    /// # Errors
    /// The file could not be read, parsed or validated.
    pub fn load_policy(&self, trigger: &str) -> Result<(), PolicyError> {
        if let Err(e) = self.verifier.reload_jwks() {
            tracing::error!(
                trigger,
                "JWKS reload failed, keeping the previous keys: {e}"
            );
        }
        let path = &self.config.policy;
        let sig = signature(path);
        match load_file(path) {
            Ok(bundle) => {
                let (version, hash) = (bundle.version, bundle.hash.clone());
                self.install(bundle);
                *self.watch.lock() = (sig, None);
                self.metrics.reload(true);
                tracing::info!(policy_file = %path.display(), version, hash = %hash, trigger, "policy loaded");
                Ok(())
            }
            Err(e) => {
                self.metrics.reload(false);
                let kept = self.loaded.load().as_ref().map(|p| p.version);
                match kept {
                    Some(v) => tracing::error!(
                        trigger,
                        "policy reload rejected, keeping bundle_version {v}: {e}"
                    ),
                    None => tracing::error!(
                        trigger,
                        "no valid policy loaded (decisions answer 503): {e}"
                    ),
                }
                let mut watch = self.watch.lock();
                watch.0 = sig;
                watch.1 = std::fs::read(path)
                    .ok()
                    .map(|b| format!("{:016x}", twox_hash::XxHash3_64::oneshot(&b)));
                Err(e)
            }
        }
    }

    /// Reloads when the policy file changed since it was last looked at (polling), and the
    /// JWKS file when it changed on its own (key rotation).
    pub fn reload_if_changed(&self) {
        match self.verifier.reload_jwks_if_changed() {
            Some(Ok(())) => tracing::info!("JWKS file changed: keys reloaded"),
            Some(Err(e)) => {
                tracing::error!("JWKS reload failed, keeping the previous keys: {e}")
            }
            None => {}
        }
        self.reload_policy_if_changed();
    }

    fn reload_policy_if_changed(&self) {
        let sig = signature(&self.config.policy);
        {
            let watch = self.watch.lock();
            if watch.0 == sig {
                return;
            }
        }
        // Same content as the bundle in force or the last rejected file: remember and move on.
        if let Ok(bytes) = std::fs::read(&self.config.policy) {
            let hash = format!("{:016x}", twox_hash::XxHash3_64::oneshot(&bytes));
            let current = self.loaded.load().as_ref().map(|p| p.hash.clone());
            let mut watch = self.watch.lock();
            if current.as_deref() == Some(hash.as_str())
                || watch.1.as_deref() == Some(hash.as_str())
            {
                watch.0 = sig;
                return;
            }
        }
        let _ = self.load_policy("file_change");
    }

    /// `/readyz`: status code and JSON body.
    pub fn readiness(&self) -> (u16, String) {
        match self.loaded.load().as_ref() {
            Some(p) => (
                200,
                serde_json::json!({
                    "status": "ready",
                    "policy_version": p.version,
                    "policy_hash": p.hash,
                    "loaded_at": p.loaded_at,
                    "store": self.remote.as_ref().map_or("memory", |r| r.kind()),
                    // A degraded store fails open; it does not make the gateway unready.
                    "store_status": if self.remote.as_ref().is_some_and(|r| r.degraded()) { "degraded" } else { "ok" },
                })
                .to_string(),
            ),
            None => (
                503,
                serde_json::json!({"status": "not_ready", "reason": "no_policy_loaded"})
                    .to_string(),
            ),
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
        let trusted = &self.config.trusted_proxies;
        let caller = peer.map(crate::descriptor::canonical_ip);
        client_addr::resolve(
            peer,
            ForwardingHeaders {
                forwarded_for: headers
                    .get_all("x-forwarded-for")
                    .iter()
                    .map(http::HeaderValue::as_bytes),
                real_ip: headers.get("x-real-ip").map(http::HeaderValue::as_bytes),
            },
            |ip| (caller_is_gateway && Some(ip) == caller) || client_addr::in_any(trusted, ip),
        )
    }

    /// Answers a request refused before the engine could look at it (its path has an encoded
    /// slash under `--encoded-slashes reject`): counted and logged like any refusal.
    pub fn refuse_early(
        &self,
        reason: crate::engine::Reason,
        client_ip: Option<IpAddr>,
        host: Option<&str>,
        raw_path: &str,
    ) -> Response {
        let view = RequestView {
            client_ip,
            host: host.map(crate::descriptor::strip_port),
            path: raw_path,
            sub: None,
        };
        self.respond(Decision::refused(reason), &view, Instant::now())
            .1
    }

    /// Decides a request, records metrics, logs refusals, and builds the response. With a
    /// networked store the answer may need a store call: [`Step::Remote`], finished by
    /// [`Gateway::complete`] (the request's borrowed facts are not needed any more).
    pub fn begin(&self, facts: &RequestFacts<'_>) -> Step {
        let started = Instant::now();
        let view = RequestView::of(facts);
        let Some(remote) = &self.remote else {
            let decision = self.engine.decide(facts);
            return Step::Ready(self.respond(decision, &view, started));
        };
        match self.engine.plan(facts) {
            Plan::Done(decision) => Step::Ready(self.respond(decision, &view, started)),
            Plan::Store(decision, ops) => Step::Remote(Box::new(Pending {
                remote: Arc::clone(remote),
                decision,
                ops,
                summary: view.to_owned(),
                started,
            })),
        }
    }

    /// Finishes a decision that needs the networked store.
    pub async fn complete(&self, pending: Box<Pending>) -> (Decision, Response) {
        let Pending {
            remote,
            decision,
            ops,
            summary,
            started,
        } = *pending;
        let mut results = OpResults::new();
        let now = self.engine.clock().unix_us();
        let answer: Result<(), StoreError> = remote.apply(now, &ops, &mut results).await;
        if answer.is_err() && !remote.connected() {
            remote.connect_in_background();
        }
        let decision = self.engine.finish(decision, answer.map(|()| &results));
        self.respond(decision, &summary.view(), started)
    }

    fn respond(
        &self,
        decision: Decision,
        view: &RequestView<'_>,
        started: Instant,
    ) -> (Decision, Response) {
        self.metrics
            .record(&decision, started.elapsed().as_secs_f64());
        let identity = JitterIdentity {
            sub: view.sub,
            ip: view.client_ip,
            path: view.path,
        };
        let response = headers::build(&decision, &identity, &self.header_config);
        log_decision(&decision, view, response.status);
        (decision, response)
    }

    /// Drops buckets that are full again or idle.
    pub fn sweep(&self) -> u64 {
        self.engine.sweep()
    }

    pub fn metrics_text(&self) -> String {
        self.metrics.render(self.engine.store().stats())
    }
}

/// One `RATE_LIMIT` line per refusal, and per shadow would-refusal (with `mode=shadow`).
/// Nothing for allowed requests.
fn log_decision(decision: &Decision, facts: &RequestView<'_>, status: u16) {
    let client_ip = facts
        .client_ip
        .map_or_else(|| "-".to_string(), |ip| ip.to_string());
    let host = facts.host.unwrap_or("-");
    if let Outcome::Reject(reason) = decision.outcome {
        let (policy, rule) = match (
            decision.rejecting_rule(),
            decision.missing_rule,
            decision.kill_switch,
        ) {
            (Some(r), _, _) => decision.names(r),
            (None, Some(index), _) => decision
                .bundle()
                .and_then(|b| {
                    b.rules.get(index).map(|r| {
                        (
                            b.policies.get(r.policy).map_or("", |p| p.id.as_str()),
                            r.name.as_str(),
                        )
                    })
                })
                .unwrap_or(("", "")),
            (None, None, Some(_)) => ("kill_switch", ""),
            _ => ("", ""),
        };
        let detail = decision
            .kill_switch
            .and_then(|i| decision.bundle()?.kill_switches.get(i))
            .map_or("", |ks| ks.reason.as_str());
        let reason = reason.as_str();
        if detail.is_empty() {
            tracing::info!(client_ip = %client_ip, host = %host, path = %facts.path, status,
                policy = %policy, rule = %rule, reason = %reason, mode = %"enforce", "RATE_LIMIT");
        } else {
            tracing::info!(client_ip = %client_ip, host = %host, path = %facts.path, status,
                policy = %policy, rule = %rule, reason = %reason, mode = %"enforce", detail = %detail, "RATE_LIMIT");
        }
    }
    if let Some(index) = decision.shadow_missing_rule {
        if let Some(rule) = decision.bundle().and_then(|b| b.rules.get(index)) {
            let policy = decision
                .bundle()
                .and_then(|b| b.policies.get(rule.policy))
                .map_or("", |p| p.id.as_str());
            tracing::info!(client_ip = %client_ip, host = %host, path = %facts.path, status = 401u16,
                policy = %policy, rule = %rule.name, reason = %"missing_descriptor", mode = %"shadow", "RATE_LIMIT");
        }
    }
    for shadow in decision.shadow_rejections() {
        let (policy, rule) = decision.names(shadow);
        tracing::info!(
            client_ip = %client_ip,
            host = %host,
            path = %facts.path,
            status = 429u16,
            policy = %policy,
            rule = %rule,
            reason = %"token_bucket_exceeded",
            mode = %Mode::Shadow.as_str(),
            "RATE_LIMIT"
        );
    }
}

/// What the answer needs to know about a request (jitter identity, log fields).
pub struct RequestView<'a> {
    pub client_ip: Option<IpAddr>,
    pub host: Option<&'a str>,
    pub path: &'a str,
    pub sub: Option<&'a str>,
}

impl<'a> RequestView<'a> {
    fn of(facts: &'a RequestFacts<'a>) -> Self {
        RequestView {
            client_ip: facts.client_ip,
            host: facts.host_name(),
            path: &facts.path,
            sub: facts
                .claims
                .and_then(|c| c.get("sub"))
                .and_then(|s| s.as_str()),
        }
    }

    fn to_owned(&self) -> RequestSummary {
        RequestSummary {
            client_ip: self.client_ip,
            host: self.host.map(str::to_string),
            path: self.path.to_string(),
            sub: self.sub.map(str::to_string),
        }
    }
}

/// [`RequestView`] owned, to outlive the request's borrowed headers across a store call.
pub struct RequestSummary {
    client_ip: Option<IpAddr>,
    host: Option<String>,
    path: String,
    sub: Option<String>,
}

impl RequestSummary {
    fn view(&self) -> RequestView<'_> {
        RequestView {
            client_ip: self.client_ip,
            host: self.host.as_deref(),
            path: &self.path,
            sub: self.sub.as_deref(),
        }
    }
}

/// The first step of answering a request.
// `Ready` is the embedded store's hot path: boxing it would allocate per request.
#[allow(clippy::large_enum_variant)]
pub enum Step {
    Ready((Decision, Response)),
    /// Boxed: this path pays a network round trip anyway.
    Remote(Box<Pending>),
    /// Refused before the engine (a malformed request).
    Refused(Response),
}

/// A decision waiting for the networked store.
pub struct Pending {
    remote: Arc<SharedStore>,
    decision: Decision,
    ops: SmallVec<[BucketOp; 4]>,
    summary: RequestSummary,
    started: Instant,
}

/// Installs the tracing subscriber (text or JSON) and bridges Pingora's `log` records into it
/// through the redactor (Pingora's debug records print whole request headers).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let max_level = filter.max_level_hint();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if let Err(e) = result {
        eprintln!("tollgate: logging already initialised: {e}");
        return;
    }
    if log::set_logger(&REDACTING_LOG).is_ok() {
        use tracing_subscriber::filter::LevelFilter;
        log::set_max_level(match max_level {
            Some(LevelFilter::OFF) => log::LevelFilter::Off,
            Some(LevelFilter::ERROR) => log::LevelFilter::Error,
            Some(LevelFilter::WARN) => log::LevelFilter::Warn,
            Some(LevelFilter::INFO) => log::LevelFilter::Info,
            Some(LevelFilter::DEBUG) => log::LevelFilter::Debug,
            _ => log::LevelFilter::Trace,
        });
    }
}

/// Re-emits `log` records (Pingora's) as tracing events under the target `pingora`, with their
/// text through [`crate::redact::text`].
struct RedactingLog;

static REDACTING_LOG: RedactingLog = RedactingLog;

impl log::Log for RedactingLog {
    fn enabled(&self, _metadata: &log::Metadata<'_>) -> bool {
        // `log::max_level` already filters; the tracing filter decides the rest.
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let text = record.args().to_string();
        let message = crate::redact::text(&text);
        let origin = record.target();
        match record.level() {
            log::Level::Error => tracing::error!(target: "pingora", origin, "{message}"),
            log::Level::Warn => tracing::warn!(target: "pingora", origin, "{message}"),
            log::Level::Info => tracing::info!(target: "pingora", origin, "{message}"),
            log::Level::Debug => tracing::debug!(target: "pingora", origin, "{message}"),
            log::Level::Trace => tracing::trace!(target: "pingora", origin, "{message}"),
        }
    }

    fn flush(&self) {}
}
