//! The running gateway's state, independent of Pingora: the bundle in force, the store, metrics,
//! the policy file and its reloads, and the one request path shared by the reverse proxy and
//! the decision service: [`Gateway::decide`] plans with the pure engine, asks the store
//! (synchronously for the embedded store, awaited in place for a shared one), finishes, counts,
//! logs and builds the response.

use crate::auth::{AuthError, TokenOutcome, Verifier};
use crate::cli::LogFormat;
use crate::client_addr::{self, ForwardingHeaders};
use crate::clock::{wall_unix_secs, Clock, SystemClock};
use crate::config::{Config, StoreKind};
use crate::descriptor::{Claims, HeaderLookup, RequestFacts};
use crate::engine::{
    self, Decided, Decision, EngineConfig, Plan, Reason, RefusedBy, RequestView, Reservation,
    Settled,
};
use crate::headers::{self, HeaderConfig, Response};
use crate::metrics::Metrics;
use crate::policy::{Bundle, Mode, PolicyError};
use crate::rls::{self, DescriptorStatus, RlsError, RlsRequest, StoreAnswer};
use crate::store::lease::{next_lease_id, Lease, LeaseResults};
use crate::store::{Backend, MemoryStoreConfig, OpResults, Store, StoreError};
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// What `/readyz` reports about the bundle in force.
#[derive(Debug, Clone)]
pub struct LoadedPolicy {
    pub version: String,
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
    #[error("--reason-header: not a valid HTTP header name")]
    ReasonHeader,
    #[error(transparent)]
    State(#[from] crate::store::state_file::StateError),
    #[error("{0}")]
    Network(String),
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

    fn is_repeated(&self, lower_name: &str) -> bool {
        self.0.get_all(lower_name).iter().nth(1).is_some()
    }

    fn repeats_any(&self) -> bool {
        // Every extra line of a name is one more value than there are names.
        self.0.len() != self.0.keys_len()
    }
}

/// The gateway.
pub struct Gateway {
    pub metrics: Metrics,
    pub config: Config,
    pub header_config: HeaderConfig,
    pub verifier: Verifier,
    /// Where buckets live: the embedded store, or one shared with other gateways.
    pub store: Store,
    pub(crate) engine_config: EngineConfig,
    /// Wall-clock time for kill-switch expiry (the store keeps its own time base).
    pub(crate) clock: Arc<dyn Clock>,
    /// The bundle in force.
    pub(crate) policy: ArcSwapOption<Bundle>,
    pub(crate) loaded: ArcSwapOption<LoadedPolicy>,
    /// The buckets limited most over the last minute (`/v1/top`, the status page).
    pub(crate) top: Mutex<crate::operator::top::TopSketch>,
    /// `--asn-type-map` and `--tor-exits` in force, and the files' signatures last read.
    network: arc_swap::ArcSwap<crate::network::NetworkData>,
    network_watch: Mutex<Vec<Option<FileSignature>>>,
    /// Signature of the file last looked at, and the hash of the last rejected content (so a
    /// broken file is reported once, not at every poll).
    watch: Mutex<(Option<FileSignature>, Option<String>)>,
    /// LLM reservations the decision service handed out, by token, until `POST /v1/usage`
    /// settles them or they expire (wall-clock µs).
    held: Mutex<ahash::AHashMap<String, (u64, Reservation)>>,
    /// With `--reservation-secret`: reservations travel in tokens signed with this key
    /// ([`crate::reservation_token`]) instead of being held here.
    reservation_key: Option<ring::hmac::Key>,
}

/// The state dir's own reservation-signing key (`DIR/reservation.key`, 32 random bytes, made
/// on first use, readable by the owner only). `None` (reservations held in memory, logged) when
/// it cannot be read or made.
fn state_reservation_key(dir: &std::path::Path) -> Option<ring::hmac::Key> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("reservation.key");
    let secret = match std::fs::read(&path) {
        Ok(secret) if secret.len() >= 32 => secret,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut secret = vec![0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret).ok()?;
            // Written whole under another name, then linked into place: a crash never leaves
            // half a key, and a key another process made meanwhile is not replaced.
            let fresh = dir.join(format!("reservation.key.{}", std::process::id()));
            let written = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&fresh)
                .and_then(|mut f| f.write_all(&secret).and_then(|()| f.sync_all()))
                .and_then(|()| std::fs::hard_link(&fresh, &path));
            let _ = std::fs::remove_file(&fresh);
            match written {
                Ok(()) => secret,
                // Made by the other process of an upgrade first: use that one.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    std::fs::read(&path).ok().filter(|s| s.len() >= 32)?
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), "state dir: cannot write the reservation key, LLM reservations of the decision service will not survive a restart: {e}");
                    return None;
                }
            }
        }
        _ => {
            // Unreadable or too short: never replaced (reservations signed with it would all
            // turn invalid); reservations are held in memory instead.
            tracing::error!(path = %path.display(), "state dir: the reservation key cannot be read; LLM reservations of the decision service will not survive a restart");
            return None;
        }
    };
    Some(crate::reservation_token::key(&secret))
}

/// How long past its expiry a signed reservation stays marked settled: gateways whose clocks
/// disagree by up to this much still find the mark.
const SETTLED_MARK_SLACK_US: u64 = 3_600 * 1_000_000;

/// Most LLM reservations the decision service keeps waiting for their usage; past it, a new
/// one is not kept and stays charged as reserved.
const MAX_HELD_RESERVATIONS: usize = 100_000;

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
                    max_buckets: config.max_buckets,
                    ..MemoryStoreConfig::default()
                };
                match &config.state_dir {
                    Some(state) => Store::memory_in_state_dir(memory, state, Arc::clone(&clock))?,
                    None => Store::memory(memory, Arc::clone(&clock)),
                }
            }
            StoreKind::Shared(url) => Store::open(url, config.store_timeout, Arc::clone(&clock))
                .map_err(StartError::Store)?,
        };
        // Leaked once at start-up: the display name lives as long as the process.
        let reason_header: &'static str = Box::leak(config.reason_header.clone().into_boxed_str());
        let mut header_config =
            HeaderConfig::new(reason_header).map_err(|_| StartError::ReasonHeader)?;
        if config.compat == crate::compat::Compat::Fairvisor {
            header_config.warning_header = crate::compat::WARNING_HEADER.clone();
        }
        let gateway = Gateway {
            metrics: Metrics::new(store.kind()),
            header_config,
            verifier,
            store,
            engine_config: EngineConfig {
                ipv6_prefix: config.ipv6_prefix,
            },
            clock,
            policy: ArcSwapOption::empty(),
            loaded: ArcSwapOption::empty(),
            top: Mutex::new(crate::operator::top::TopSketch::default()),
            network: arc_swap::ArcSwap::from_pointee(crate::network::NetworkData::default()),
            network_watch: Mutex::new(Vec::new()),
            watch: Mutex::new((None, None)),
            held: Mutex::new(ahash::AHashMap::new()),
            reservation_key: match (&config.reservation_secret, &config.state_dir) {
                (Some(secret), _) => Some(crate::reservation_token::key(&secret.0)),
                // With a state dir, the decision service's reservations travel signed (with
                // the directory's own key) so that a restart can still settle them.
                (None, Some(state)) if matches!(config.store, StoreKind::Memory) => {
                    state_reservation_key(&state.dir)
                }
                (None, _) => None,
            },
            config,
        };
        gateway
            .load_network("startup")
            .map_err(StartError::Network)?;
        Ok(gateway)
    }

    /// Reads `--asn-type-map` and `--tor-exits` (when given) into the data `ip:type` and
    /// `ip:tor` read. A file that cannot be read or parsed keeps the data in force.
    ///
    /// # Errors
    /// The file and line that could not be read.
    pub fn load_network(&self, trigger: &str) -> Result<(), String> {
        let files = self.network_files();
        if files.is_empty() {
            return Ok(());
        }
        let signatures: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
        let read_text = |path: &Option<std::path::PathBuf>, flag: &str| {
            path.as_ref()
                .map(|p| {
                    std::fs::read_to_string(p)
                        .map_err(|e| format!("{flag} {}: cannot read it: {e}", p.display()))
                })
                .transpose()
        };
        let loaded = (|| {
            let map = read_text(&self.config.asn_type_map, "--asn-type-map")?;
            let tor = read_text(&self.config.tor_exits, "--tor-exits")?;
            let mut geo = Vec::new();
            for path in &self.config.geoip_db {
                let bytes = std::fs::read(path)
                    .map_err(|e| format!("--geoip-db {}: cannot read it: {e}", path.display()))?;
                geo.push(
                    crate::network::GeoDb::parse(bytes)
                        .map_err(|e| format!("--geoip-db {}: {e}", path.display()))?,
                );
            }
            crate::network::NetworkData::with_geo(map.as_deref(), tor.as_deref(), geo)
        })();
        *self.network_watch.lock() = signatures;
        match loaded {
            Ok(data) => {
                let (types, exits) = data.sizes();
                tracing::info!(
                    trigger,
                    asn_types = types,
                    tor_exits = exits,
                    geoip_dbs = self.config.geoip_db.len(),
                    "network data loaded"
                );
                self.network.store(Arc::new(data));
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    trigger,
                    "network data not reloaded, keeping the previous: {e}"
                );
                Err(e)
            }
        }
    }

    /// The files the network data is read from, in a fixed order.
    fn network_files(&self) -> Vec<&std::path::Path> {
        self.config
            .geoip_db
            .iter()
            .map(|p| p.as_path())
            .chain(self.config.asn_type_map.as_deref())
            .chain(self.config.tor_exits.as_deref())
            .collect()
    }

    /// The client's network facts, when the bundle in force reads them.
    pub(crate) fn network_facts(
        &self,
        facts: &RequestFacts<'_>,
    ) -> Option<crate::network::NetworkFacts> {
        let uses = self
            .policy
            .load()
            .as_deref()
            .is_some_and(|b| b.uses_network);
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

    fn install(&self, bundle: Bundle) {
        let info = LoadedPolicy {
            version: bundle.version.clone(),
            hash: bundle.hash.clone(),
            loaded_at: wall_unix_secs(),
        };
        for warning in &bundle.warnings {
            tracing::warn!(policy_file = %self.config.policy.display(), "policy warning: {warning}");
        }
        for skipped in &bundle.skipped {
            for error in &skipped.errors {
                tracing::error!(policy_file = %self.config.policy.display(), policy = %skipped.path, id = %skipped.id, "policy skipped (--skip-invalid-policies): {error}");
            }
        }
        for (name, o) in [
            ("global_shadow", &bundle.global_shadow),
            ("kill_switch_override", &bundle.kill_switch_override),
        ] {
            if let Some(o) = o {
                tracing::warn!(reason = %o.reason, expires_at = o.expires_at, "runtime override {name} enabled in the bundle");
            }
        }
        // Buckets live in the store, not in the bundle: they survive the swap, and a lowered
        // burst caps their tokens on the next request.
        let bundle = Arc::new(bundle);
        self.metrics.on_install(&bundle);
        self.policy.store(Some(bundle));
        self.loaded.store(Some(Arc::new(info)));
    }

    /// Loads the policy file now (start-up and SIGHUP). An invalid file leaves the bundle in
    /// force untouched; the error names the file and every problem.
    ///
    /// # Errors
    /// The file could not be read, parsed or validated.
    pub fn load_policy(&self, trigger: &str) -> Result<(), PolicyError> {
        if trigger != "startup" {
            let _ = self.load_network(trigger);
        }
        if let Err(e) = self.verifier.reload_jwks() {
            tracing::error!(
                trigger,
                "JWKS reload failed, keeping the previous keys: {e}"
            );
        }
        let path = &self.config.policy;
        let sig = signature(path);
        let options = crate::policy::CompileOptions {
            skip_invalid_policies: self.config.skip_invalid_policies,
        };
        match crate::policy::load_current(path, options, self.clock.unix_secs()) {
            Ok(bundle) => {
                let (version, hash) = (bundle.version.clone(), bundle.hash.clone());
                let in_memory = matches!(self.config.store, StoreKind::Memory)
                    && self.store.stats().state_fallback != Some(false);
                if let Some(warning) = bundle.restart_warning().filter(|_| in_memory) {
                    tracing::warn!(policy_file = %path.display(), "{warning}");
                }
                self.install(bundle);
                crate::policy::release_parse_memory();
                *self.watch.lock() = (sig, None);
                self.metrics.reload(true);
                tracing::info!(policy_file = %path.display(), version = %version, hash = %hash, trigger, "policy loaded");
                Ok(())
            }
            Err(e) => {
                crate::policy::release_parse_memory();
                self.metrics.reload(false);
                let kept = self.loaded.load().as_ref().map(|p| p.version.clone());
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
        let files = self.network_files();
        if !files.is_empty() {
            let now: Vec<Option<FileSignature>> = files.iter().map(|p| signature(p)).collect();
            if *self.network_watch.lock() != now {
                let _ = self.load_network("file_change");
            }
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
                serde_json::json!({
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
                    "loaded_at": p.loaded_at,
                    "store": self.store.kind(),
                    // A degraded store fails open; it does not make the gateway unready.
                    "store_status": if self.store.degraded() { "degraded" } else { "ok" },
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
        let caller = peer.map(crate::descriptor::canonical_ip);
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

    /// The `tiktoken` encodings the bundle in force counts prompts in (see
    /// [`crate::llm::LlmRequest::parse_with`]).
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

    /// Settles an LLM reservation once `used` tokens are known: every bucket it reserved on
    /// moves by the difference (refund or further charge), counted under `source`. A store
    /// failure leaves the reservation charged as reserved (logged by the store).
    pub async fn settle(
        &self,
        reservation: &Reservation,
        used: u64,
        reported_prompt: Option<u64>,
        source: &str,
    ) -> Settled {
        // A usage past any policy's reach (a hostile report) counts as the largest one.
        let used = used.min(crate::llm::MAX_TOKENS);
        let reported_prompt = reported_prompt.map(|p| p.min(crate::llm::MAX_TOKENS));
        let adjustments = reservation.adjustments(used);
        let _ = self.store.adjust(self.store.now_us(), &adjustments).await;
        self.metrics
            .llm_settled(reservation, used, reported_prompt, source);
        reservation.settled(used)
    }

    /// Keeps a decision's reservation for `POST /v1/usage` and returns its token: with
    /// `--reservation-secret`, the reservation signed into the token itself (any gateway of
    /// the fleet settles it); else 32 random hex digits naming it here. Either way only the
    /// caller that got it can settle it. `None` when too many are held here (it then stays
    /// charged as reserved).
    pub fn hold_reservation(&self, reservation: Reservation) -> Option<String> {
        let mut bytes = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).ok()?;
        let expires = self.clock.unix_us().saturating_add(
            self.config
                .reservation_ttl
                .as_micros()
                .min(u64::MAX as u128) as u64,
        );
        if let Some(key) = &self.reservation_key {
            let mut id = [0u8; 8];
            id.copy_from_slice(&bytes[..8]);
            let token = crate::reservation_token::encode(
                key,
                u64::from_le_bytes(id),
                expires,
                &reservation,
            );
            // One that could never be read back is not handed out (it stays charged as
            // reserved, like a reservation too many to hold).
            if token.len() > crate::reservation_token::MAX_TOKEN_LEN {
                tracing::warn!(
                    len = token.len(),
                    "LLM reservation too large for a signed token; kept as reserved"
                );
                return None;
            }
            return Some(token);
        }
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut held = self.held.lock();
        if held.len() >= MAX_HELD_RESERVATIONS {
            return None;
        }
        held.insert(token.clone(), (expires, reservation));
        Some(token)
    }

    /// Settles a reservation with the usage its caller reports; `None` when the token is
    /// unknown, forged, already settled or expired (or, for a signed token, when the store
    /// that marks it settled cannot answer: it then stays charged as reserved).
    pub async fn report_usage(
        &self,
        token: &str,
        used: u64,
        reported_prompt: Option<u64>,
    ) -> Option<Settled> {
        let now = self.clock.unix_us();
        let token = token.trim();
        if crate::reservation_token::is_signed(token) {
            let verified = crate::reservation_token::decode(self.reservation_key.as_ref()?, token)?;
            if verified.expires_us <= now {
                return None;
            }
            if !self
                .mark_settled(verified.id, verified.expires_us - now)
                .await
            {
                return None;
            }
            return Some(
                self.settle(&verified.reservation, used, reported_prompt, "report")
                    .await,
            );
        }
        let (expires, reservation) = self.held.lock().remove(token)?;
        if expires <= now {
            self.metrics
                .llm_settled(&reservation, reservation.tokens(), None, "expired");
            return None;
        }
        Some(
            self.settle(&reservation, used, reported_prompt, "report")
                .await,
        )
    }

    /// Marks signed reservation `id` settled for the `ttl_us` it can still be reported in (and
    /// an hour more, for gateways whose clocks disagree): a lease on the shared store,
    /// so only the first report anywhere settles it. `false` when it already was, or the
    /// store cannot answer.
    async fn mark_settled(&self, id: u64, ttl_us: u64) -> bool {
        let op = crate::store::lease::LeaseOp {
            key: crate::store::BucketKey::of(&format!("rsv:{id:016x}")),
            max: 1,
            group: crate::store::Group::Enforce,
            ttl_us: ttl_us.saturating_add(SETTLED_MARK_SLACK_US),
            soft: false,
            held: false,
        };
        let mut results = crate::store::lease::LeaseResults::new();
        // A fresh lease id: a second report, even from this gateway, finds the key full.
        let lease_id = crate::store::lease::next_lease_id();
        self.store
            .acquire(self.store.now_us(), lease_id, &[op], &mut results)
            .await
            .is_ok()
            && results.first().is_some_and(|r| r.allowed && r.committed)
    }

    /// Drops the held reservations whose time is up: they stay charged as reserved.
    fn expire_reservations(&self) {
        let now = self.clock.unix_us();
        let mut expired = Vec::new();
        self.held.lock().retain(|_, (expires, reservation)| {
            let keep = *expires > now;
            if !keep {
                expired.push(std::mem::take(reservation));
            }
            keep
        });
        for reservation in expired {
            self.metrics
                .llm_settled(&reservation, reservation.tokens(), None, "expired");
        }
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
        let caller = peer.map(crate::descriptor::canonical_ip);
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
                host: host.map(crate::descriptor::strip_port),
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
        // A budget's throttle stage: the request goes on, later (Fairvisor sleeps too).
        if answer.throttle_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(answer.throttle_ms)).await;
        }
        answer
    }

    async fn decide_now(&self, facts: &RequestFacts<'_>) -> Answer {
        let started = Instant::now();
        let unix_us = self.clock.unix_us();
        if let Backend::Memory(memory) = self.store.backend() {
            let guard = self.policy.load();
            let decision = match guard.as_deref() {
                None => Decision::NoPolicy,
                Some(bundle) => engine::decide_local(
                    bundle,
                    facts,
                    memory,
                    self.store.now_us(),
                    unix_us,
                    self.engine_config,
                ),
            };
            let decided = Decided {
                decision,
                request: RequestView::of(facts),
            };
            return self.answer(&decided, started);
        }
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
        self.answer(&decided, started)
    }

    /// Under `--compat fairvisor`: the reason header only for a debug session, which also gets
    /// Fairvisor's verbose headers.
    fn compat_headers(&self, response: &mut Response, decided: &Decided<'_>) {
        // A request refused before the engine (no facts) keeps its reason header, as it always
        // has: it carries no cookie to open a debug session with.
        let Some(facts) = decided.request.facts else {
            return;
        };
        if self.config.compat != crate::compat::Compat::Fairvisor {
            return;
        }
        let cookie = facts.headers.header("cookie");
        crate::compat::finish_headers(
            &mut response.headers,
            &decided.decision,
            &self.header_config.reason_header,
            self.debug_session_open(cookie),
        );
    }

    /// Whether a `Cookie` header opens a debug session (`--compat fairvisor` with
    /// `--debug-session-secret`).
    pub fn debug_session_open(&self, cookie: Option<&str>) -> bool {
        self.config
            .debug_sessions
            .as_ref()
            .is_some_and(|d| d.is_open(cookie, self.clock.unix_secs().max(0) as u64))
    }

    /// `POST /v1/debug/session`: the `Set-Cookie` value of a new debug session, `Err(404)`
    /// when debug sessions are off, `Err(403)` for a wrong secret.
    pub fn open_debug_session(&self, secret: Option<&[u8]>) -> Result<String, u16> {
        let sessions = self.config.debug_sessions.as_ref().ok_or(404u16)?;
        match secret {
            Some(s) if sessions.secret_matches(s) => {
                Ok(sessions.open(self.clock.unix_secs().max(0) as u64))
            }
            _ => Err(403),
        }
    }

    /// Logs and counts the circuit breakers a decision tripped (at error level for a breaker
    /// with `alert: true`, so log-based alerting catches it).
    fn breakers_tripped(&self, decision: &Decision<'_>) {
        for (trip, rule) in decision.breaker_trips() {
            self.metrics.breaker_tripped(rule);
            let open_secs = trip.ttl_us / crate::limiter::US_PER_SEC;
            let alert = matches!(rule.guard, Some(crate::policy::Guard::Breaker(b)) if b.alert);
            if alert {
                tracing::error!(policy = %rule.policy_id, rule = %rule.name, mode = %rule.mode.as_str(), open_secs, "CIRCUIT_BREAKER_OPEN");
            } else {
                tracing::warn!(policy = %rule.policy_id, rule = %rule.name, mode = %rule.mode.as_str(), open_secs, "CIRCUIT_BREAKER_OPEN");
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
            verdict: decision.verdict(),
            response,
        }
    }

    /// Decides an original request described by another gateway (the decision service, Envoy's
    /// ext_authz): facts from the method, target and host, JWT claims from the headers, and a
    /// path with an encoded slash under `--encoded-slashes reject` refused before the engine.
    pub async fn decide_described(&self, described: &Described<'_>) -> Answer {
        let lookup = HttpHeaders(described.headers);
        let claims = self.claims(&lookup);
        match self.described_facts(described, &lookup, claims.as_deref()) {
            Ok(facts) => self.decide(&facts).await,
            Err(_) => {
                let (path, _) = crate::descriptor::split_uri(described.target);
                Answer {
                    allowed: false,
                    throttle_ms: 0,
                    lease: None,
                    reservation: None,
                    no_policy: false,
                    reason: Some(Reason::EncodedSlash),
                    rule: None,
                    verdict: Reason::EncodedSlash.as_str(),
                    response: self.refuse_early(
                        Reason::EncodedSlash,
                        described.client_ip,
                        described.host,
                        path,
                    ),
                }
            }
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
    ) -> Result<RequestFacts<'a>, crate::descriptor::EncodedSlashError> {
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
        // The caller is a gateway by role: its network headers are believed.
        .with_trusted_peer(true))
    }

    /// Answers an Envoy `ShouldRateLimit` call ([`crate::rls`]): every descriptor's buckets in
    /// one store call (after a peek when a descriptor only checks), one status per
    /// descriptor, the merged decision counted, logged and turned into headers. A store failure
    /// fails open (every descriptor OK, counted) unless `store_errors_fail_open` is false.
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
        let mut peek = OpResults::new();
        let mut results = OpResults::new();
        // Which store calls ran: none (no ops), the peek only, the peek then the spend, the
        // spend alone, or one that failed.
        enum Ran {
            Nothing,
            PeekOnly,
            PeekThenSpend,
            Spend,
            Failed,
        }
        let ran = if plan.ops().is_empty() {
            Ran::Nothing
        } else if plan.needs_peek() {
            match self.store.apply(now_us, &plan.peek_ops(), &mut peek).await {
                Err(_) => Ran::Failed,
                Ok(()) if plan.refused_by_peek(&peek) || plan.spends_nothing() => Ran::PeekOnly,
                Ok(()) => match self.store.apply(now_us, plan.ops(), &mut results).await {
                    Ok(()) => Ran::PeekThenSpend,
                    Err(_) => Ran::Failed,
                },
            }
        } else {
            match self.store.apply(now_us, plan.ops(), &mut results).await {
                Ok(()) => Ran::Spend,
                Err(_) => Ran::Failed,
            }
        };
        let store_failed = matches!(ran, Ran::Failed);
        let answer = match ran {
            Ran::Failed => StoreAnswer::Failed,
            Ran::PeekOnly => StoreAnswer::PeekOnly(&peek),
            Ran::PeekThenSpend => StoreAnswer::Spent {
                peek: Some(&peek),
                results: &results,
            },
            Ran::Nothing | Ran::Spend => StoreAnswer::Spent {
                peek: None,
                results: &results,
            },
        };
        let outcome = plan.finish(answer, now_us);
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
        log_decision(&decided, response.status);
        Ok(RlsReply {
            over_limit,
            statuses: outcome.statuses,
            response,
        })
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
        if self.config.compat == crate::compat::Compat::Fairvisor {
            let fairvisor =
                crate::compat::fairvisor_metrics(&text, bundle.as_deref(), self.clock.unix_secs());
            text.push_str(&fairvisor);
        }
        text
    }
}

/// The answer to a `ShouldRateLimit` call.
#[derive(Debug)]
pub struct RlsReply {
    pub over_limit: bool,
    /// One per descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// The headers (`RateLimit`..., `Retry-After` when over the limit), status and body the
    /// client should get.
    pub response: Response,
}

/// Why a `ShouldRateLimit` call gets no answer.
#[derive(Debug, thiserror::Error)]
pub enum RlsFailure {
    #[error("{0}")]
    Invalid(RlsError),
    #[error("no policy loaded")]
    NoPolicy,
    #[error("the rate-limit store is unavailable")]
    StoreUnavailable,
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
}

/// What a described request's body contributes: its fingerprint (for `body_hash`
/// descriptors) and, when a `token_bucket_llm` rule meters it, the parsed prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct DescribedBody<'a> {
    pub hash: Option<u64>,
    pub llm: Option<&'a crate::llm::LlmRequest>,
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
    /// The access log's verdict: `allow`, `no_policy`, or the refusal's reason.
    pub verdict: &'static str,
    /// Status, headers and body of a refusal; headers to add upstream on allow.
    pub response: Response,
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
        ttl_secs: ttl_us / crate::limiter::US_PER_SEC,
    })
}

/// One `RATE_LIMIT` line per refusal, and per shadow would-refusal (with `mode=shadow`).
/// Nothing for allowed requests.
fn log_decision(decided: &Decided<'_>, status: u16) {
    let (decision, request) = (&decided.decision, &decided.request);
    let shadow_missing = decision.checked().and_then(|c| c.shadow_missing);
    if decision.is_allowed()
        && shadow_missing.is_none()
        && decision.shadow_rejections().next().is_none()
    {
        // The common case: nothing to say, and nothing formatted.
        return;
    }
    // `RUST_LOG` decides, as for every other line (the callsite's interest is cached).
    if !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let mut ip_text = String::new();
    let client_ip = match request.client_ip {
        Some(ip) => {
            crate::log_line::push_ip(&mut ip_text, ip);
            ip_text.as_str()
        }
        None => "-",
    };
    let line = crate::log_line::RateLimit {
        client_ip,
        host: request.host.unwrap_or("-"),
        path: request.path,
        status,
        policy: "",
        rule: "",
        reason: "",
        mode: "enforce",
        detail: None,
    };
    if let (Decision::Refuse(refusal), Some(by)) = (decision, decision.refused_by()) {
        let (policy, rule, detail) = match by {
            RefusedBy::Rule(rule) => (rule.policy_id.as_str(), rule.name.as_str(), ""),
            RefusedBy::KillSwitch(ks) => ("kill_switch", "", ks.reason.as_ref()),
            RefusedBy::Request => ("", "", ""),
        };
        crate::log_line::RateLimit {
            policy,
            rule,
            reason: refusal.reason.as_str(),
            detail: (!detail.is_empty()).then_some(detail),
            ..line
        }
        .write();
    }
    if let Some(rule) = shadow_missing {
        crate::log_line::RateLimit {
            status: 401,
            policy: &rule.policy_id,
            rule: &rule.name,
            reason: "missing_descriptor",
            mode: "shadow",
            ..line
        }
        .write();
    }
    for shadow in decision.shadow_rejections() {
        let reason = if shadow.cost_exceeds {
            Reason::CostExceedsLimit
        } else {
            Reason::TokenBucketExceeded
        };
        crate::log_line::RateLimit {
            status: 429,
            policy: &shadow.rule.policy_id,
            rule: &shadow.rule.name,
            reason: reason.as_str(),
            mode: Mode::Shadow.as_str(),
            ..line
        }
        .write();
    }
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
    crate::log_line::set_json(format == LogFormat::Json);
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
        // Info records are shown at debug level (below): not formatted at all unless debug is on.
        if record.level() == log::Level::Info
            && !tracing::enabled!(target: "pingora", tracing::Level::DEBUG)
        {
            return;
        }
        let text = record.args().to_string();
        let message = crate::redact::text(&text);
        let origin = record.target();
        match record.level() {
            log::Level::Error => tracing::error!(target: "pingora", origin, "{message}"),
            log::Level::Warn => tracing::warn!(target: "pingora", origin, "{message}"),
            // Pingora's own start-up and shutdown chatter: debug, so a start-up error is not
            // lost among ten lines of it.
            log::Level::Info => tracing::debug!(target: "pingora", origin, "{message}"),
            log::Level::Debug => tracing::debug!(target: "pingora", origin, "{message}"),
            log::Level::Trace => tracing::trace!(target: "pingora", origin, "{message}"),
        }
    }

    fn flush(&self) {}
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
