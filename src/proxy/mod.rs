//! Pingora glue: the only module that names Pingora types. It builds the server — the reverse
//! proxy ([`gateway`]), the admin listener ([`admin`]) and background tasks (reload, sweep) — and
//! runs it until SIGTERM/SIGINT, then drains; or, on SIGQUIT, hands its listening sockets over
//! to the process started with `--upgrade` ([`crate::proxy::handover`]), then drains once the new
//! process says it serves. The new process takes the sockets it is handed into Pingora's
//! bootstrap through a private relay socket of its own. Every other listening socket is bound by
//! [`bind`] before Pingora starts, so start-up either serves on all of them or exits 1.

pub mod bind;
pub mod grpc;
pub mod handover;

pub mod admin;
pub mod conn;
pub mod forward;
pub mod gateway;
pub mod grpc_call;
pub mod grpc_health;
pub mod own_response;
pub mod protocol;
pub mod queue;
pub mod upstreams;

use crate::config::cli::{RunArgs, EXIT_INVALID, EXIT_OK};
use crate::config::Config;
use crate::service::{init_logging, Gateway, Trigger};
use async_trait::async_trait;
use pingora::apps::HttpServerOptions;
use pingora::listeners::tls::TlsSettings;
use pingora::listeners::{L4BufferSettings, ListenerConfig, DEFAULT_L4_WRITE_BUFFER_SIZE};
use pingora::server::configuration::ServerConf;
use pingora::server::{
    RunArgs as PingoraRunArgs, Server, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch,
};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Idle upstream connections kept per proxy.
const UPSTREAM_KEEPALIVE_POOL: usize = 256;

/// Most connections the admin listener holds at once (gateways calling the decision service
/// keep pools of a few hundred at most).
const ADMIN_MAX_CONNECTIONS: usize = 4096;

/// Why `tollgate run` cannot start. Each names what it is about: the flag, file or listener.
/// [`run`] reports it, once.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The flags do not make a valid configuration.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigErrors),
    /// The gateway cannot be built from the configuration (its JWT keys, its store).
    #[error(transparent)]
    Gateway(#[from] crate::service::StartError),
    /// The `OTEL_*` environment asks for traces in a way that cannot work.
    #[error(transparent)]
    Traces(#[from] crate::telemetry::traces::TelemetryError),
    /// `--policy` names no file (and `--wait-for-policy` is not given).
    #[error("--policy {}: no such file (start with --wait-for-policy to run unlimited until it appears)", .0.display())]
    NoPolicyFile(PathBuf),
    /// The policy file puts nothing in force.
    #[error(transparent)]
    EmptyPolicy(crate::policy::PolicyError),
    /// `--policy-verify-key` cannot be read or holds no Ed25519 public key.
    #[error("--policy-verify-key {0}")]
    VerifyKey(crate::fleet::envelope::KeyError),
    /// The runtime of the policy store's first read cannot start.
    #[error("--policy-store: cannot start its first read: {0}")]
    FirstRead(std::io::Error),
    /// `--policy-store` cannot be opened.
    #[error("--policy-store: {0}")]
    PolicyStore(crate::fleet::source::SourceError),
    /// `--upgrade` without a policy in force: the running gateway keeps its listeners.
    #[error(
        "--upgrade: the policy does not load, so the running gateway keeps its listeners: {0}"
    )]
    UpgradeWithoutPolicy(NotInForce),
    /// Whoever can write the upgrade socket's directory could take the listening sockets.
    #[error("--upgrade-sock {}: its directory is not trusted: {reason}", .sock.display())]
    UntrustedSocketDir {
        sock: PathBuf,
        reason: crate::store::fs_trust::Untrusted,
    },
    /// The upgrade's relay socket cannot be made.
    #[error(transparent)]
    Relay(#[from] RelayError),
    /// `--tls-cert` / `--tls-key`: a pair that cannot be used.
    #[error("--tls-cert/--tls-key: {0}")]
    Certificates(crate::config::tls::CertError),
    /// The HTTPS listener's settings cannot be made.
    #[error("TLS listener {addr}: {source}")]
    TlsListener {
        addr: String,
        source: Box<pingora::Error>,
    },
    /// `--routes`: the gateway file cannot be used.
    #[error("--routes: {0}")]
    Routes(crate::config::routes::RoutesError),
    /// An upstream group cannot be built.
    #[error(transparent)]
    Upstreams(#[from] upstreams::UpstreamsError),
    /// The gRPC listener cannot start.
    #[error(transparent)]
    Grpc(#[from] grpc::GrpcStartError),
    /// `--upgrade`: the running gateway did not hand its listeners over.
    #[error("{0}")]
    Handover(handover::HandoverError),
    /// A listening address cannot be bound.
    #[error(transparent)]
    Bind(#[from] bind::BindError),
}

impl StartupError {
    /// The log's ERROR line: the message, with the step of an upgrade it failed in.
    pub fn log_line(&self) -> String {
        match self {
            StartupError::Handover(e) => format!("upgrade: {e}"),
            e => e.to_string(),
        }
    }

    /// The process's exit code: every start-up error is an invalid invocation or setting.
    pub fn exit_code(&self) -> u8 {
        EXIT_INVALID
    }
}

/// Why no policy is in force at start-up: refused on an upgrade (a plain start answers 503
/// from the decision service until a valid bundle appears).
#[derive(Debug, thiserror::Error)]
pub enum NotInForce {
    #[error(transparent)]
    Policy(crate::policy::PolicyError),
    #[error("--policy-store {url}: no bundle could be put in force (none published, none kept in --state-dir, or the store unreachable)")]
    NoBundle { url: String },
}

/// `tollgate run`: starts, then serves until stopped. The one place a start-up error is
/// reported (the log's ERROR line, then `tollgate: ...` on stderr) and its exit code chosen.
pub fn run(args: RunArgs) -> u8 {
    match start(args) {
        Ok(running) => running.serve(),
        Err(e) => {
            tracing::error!("{}", e.log_line());
            eprintln!("tollgate: {e}");
            e.exit_code()
        }
    }
}

/// A gateway ready to serve: every listener bound or handed over, Pingora bootstrapped.
pub struct Running {
    server: Server,
    gateway: Arc<Gateway>,
    shutdown: DrainOnSignal,
}

impl Running {
    /// Serves until SIGTERM or SIGINT (or a hand-over on SIGQUIT), then drains; the exit code.
    pub fn serve(self) -> u8 {
        self.server.run(PingoraRunArgs {
            shutdown_signal: Box::new(self.shutdown),
        });
        if let Some(telemetry) = self.gateway.telemetry() {
            // The spans still queued, within a bound: a collector that is down delays the exit
            // by at most this.
            telemetry.shutdown(Duration::from_secs(2));
        }
        crate::telemetry::log_line::flush();
        tracing::info!("tollgate stopped");
        EXIT_OK
    }
}

/// `tollgate run` up to serving, step by step: the gateway, its policy, the upgrade's
/// sockets, certificates, routes, the services, then every listener (taken over from the
/// running gateway on `--upgrade`, else bound here) before Pingora starts.
///
/// # Errors
/// The first step that fails ([`StartupError`], naming its flag, file or listener).
pub fn start(args: RunArgs) -> Result<Running, StartupError> {
    ignore_sighup_until_ready();
    init_logging(args.log_format);
    let (config, gateway) = build_gateway(&args)?;
    let verify_key = load_policy(&config, &gateway)?;
    let relay = prepare_upgrade(&config)?;
    let certificates = load_certificates(&config)?;
    let mut server = new_server(&config, relay.as_ref());
    let upstreams = load_upstreams(&config)?;
    let mut listeners = Listeners::default();
    if let Some(upstreams) = &upstreams {
        let proxy = ProxyParts {
            config: &config,
            gateway: &gateway,
            upstreams,
            certificates: certificates.as_ref(),
        };
        proxy.add_to(&mut server, &mut listeners)?;
    }
    let admin = add_admin(&mut server, &config, &gateway);
    if let Some(grpc) = &config.grpc {
        add_grpc(&mut server, &mut listeners, grpc, &config, &gateway)?;
    }
    add_background(
        &mut server,
        &config,
        &gateway,
        verify_key,
        certificates,
        upstreams,
    );
    // The admin listener last: `/readyz` cannot be reached before every other one is bound.
    listeners.add(admin, &config.admin_listen, "--admin-listen");
    let (handed_over, confirmation) = take_over(relay.as_ref(), &config, &gateway)?;
    let prebound = bind_the_rest(&listeners, &handed_over, &config)?;
    let listen_table = add_listen_table(&mut server, listeners, prebound, confirmation);
    server.bootstrap();
    drop(relay);
    Ok(Running {
        server,
        shutdown: DrainOnSignal {
            upgrade_sock: config.upgrade_sock.clone(),
            listen_table,
            gateway: Arc::clone(&gateway),
        },
        gateway,
    })
}

/// The configuration and the gateway built from it, with traces when the `OTEL_*`
/// environment asks for them; warns of flags that weaken it.
fn build_gateway(args: &RunArgs) -> Result<(Config, Arc<Gateway>), StartupError> {
    let config = Config::from_args(args)?;
    let gateway = Arc::new(Gateway::new(config.clone())?);
    if let Some(telemetry) = crate::telemetry::traces::Telemetry::from_env(
        gateway.config.trace_context,
        gateway.metrics.trace_spans_dropped(),
    )? {
        gateway.set_telemetry(telemetry);
    }
    if config.bucket_idle_given {
        tracing::warn!(
            "--bucket-idle-secs is ignored: a bucket that still holds state is never dropped for being idle (only full-again ones are)"
        );
    }
    if gateway.verifier.unverified() {
        tracing::warn!(
            "--jwt-unverified: JWT claims are used WITHOUT checking signatures. Anyone can forge \
             jwt: descriptors unless a layer in front of tollgate verifies every token."
        );
    }
    Ok((config, gateway))
}

/// Puts the policy in force: the file, or under `--policy-store` the bundle kept in
/// `--state-dir` and the store's newest. Returns `--policy-verify-key`, for the follower.
fn load_policy(
    config: &Config,
    gateway: &Arc<Gateway>,
) -> Result<Option<Arc<crate::fleet::envelope::VerifyKey>>, StartupError> {
    // A policy file that does not exist is most likely a typo: starting would proxy everything
    // unlimited. `--wait-for-policy` is for orchestrators that mount the file later.
    if config.policy_store.is_none() && !config.wait_for_policy && !config.policy.exists() {
        return Err(StartupError::NoPolicyFile(config.policy.clone()));
    }
    // An invalid policy is not fatal at a plain start: decisions answer 503 until a valid
    // bundle appears (the file watcher picks it up). An upgrade is different: the running
    // gateway enforces a bundle, and taking its listeners without one would switch limits off,
    // so the new process stops here and the old one keeps serving.
    let loaded = gateway.load_policy(Trigger::Startup);
    // A policy file that puts nothing in force would proxy everything unlimited (every policy
    // skipped by --skip-invalid-policies, an empty bundle): stop, unless the operator means it.
    let loaded = match loaded {
        Err(e @ crate::policy::PolicyError::Empty { .. }) => {
            return Err(StartupError::EmptyPolicy(e))
        }
        loaded => loaded,
    };
    let verify_key = start_following(gateway)?;
    let loaded = match (&config.policy_store, loaded) {
        (Some(store), Ok(())) if gateway.loaded.load().is_none() => Err(NotInForce::NoBundle {
            url: crate::fleet::source::display_url(&store.url),
        }),
        (_, loaded) => loaded.map_err(NotInForce::Policy),
    };
    match loaded {
        Err(e) if config.upgrade => Err(StartupError::UpgradeWithoutPolicy(e)),
        _ => Ok(verify_key),
    }
}

/// Checks the upgrade socket's directory and, with `--upgrade`, makes the relay the sockets
/// handed over reach Pingora's bootstrap through.
fn prepare_upgrade(config: &Config) -> Result<Option<Relay>, StartupError> {
    // Whoever can put a socket where the upgrade socket goes is handed the listening sockets
    // (or hands over their own): only a directory no other user can write is accepted.
    // (Checked when it matters or could: an upgrade, or a directory that exists. A state dir
    // that is unusable leaves its default socket unchecked here; SIGQUIT then fails to hand over
    // and the gateway keeps serving.)
    if let Some(sock) = config.upgrade_sock.as_ref().filter(|sock| {
        config.upgrade
            || sock
                .parent()
                .is_some_and(|dir| dir.as_os_str().is_empty() || dir.is_dir())
    }) {
        crate::proxy::handover::check_socket_dir(sock, crate::store::fs_trust::effective_uid())
            .map_err(|reason| StartupError::UntrustedSocketDir {
                sock: sock.clone(),
                reason,
            })?;
    }
    // The upgrade's relay: the sockets the old process hands over (checked by `handover`)
    // reach Pingora's bootstrap through a socket in a directory of this process's own.
    match config.upgrade_sock.as_deref().filter(|_| config.upgrade) {
        None => Ok(None),
        Some(sock) => Ok(Some(Relay::make(sock)?)),
    }
}

/// The edge listener's certificates: a bad one is a start-up error naming the file.
fn load_certificates(
    config: &Config,
) -> Result<Option<Arc<crate::config::tls::Certificates>>, StartupError> {
    let Some(tls) = &config.tls else {
        return Ok(None);
    };
    let certs = crate::config::tls::Certificates::load(tls.pairs.clone())
        .map_err(StartupError::Certificates)?;
    tracing::info!(names = ?certs.current().names, "TLS certificates loaded");
    Ok(Some(certs))
}

/// Pingora's server, with options built here: Pingora must not parse our argv (its own flags
/// clash with ours).
fn new_server(config: &Config, relay: Option<&Relay>) -> Server {
    let conf = ServerConf {
        threads: config.threads.get(),
        // Only the relay: the old process's side of a hand-over is `handover::send`, never
        // Pingora's (which checks nobody's credentials).
        upgrade_sock: relay.map_or_else(String::new, |relay| relay.sock.display().to_string()),
        work_stealing: false,
        upstream_keepalive_pool_size: UPSTREAM_KEEPALIVE_POOL,
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(10),
        ..ServerConf::default()
    };
    let options = pingora::server::configuration::Opt {
        upgrade: config.upgrade,
        ..Default::default()
    };
    let server = Server::new_with_opt_and_conf(options, conf);
    // Pingora's own timer keeps every timeout it registers until its deadline, even when the
    // read it guarded finished long before: with the 60 s upstream read timeout, one per read,
    // that was measured at 6-8 % of a proxied request's CPU. Tokio's timer cancels on drop;
    // timeouts of 10 s and more (the read and idle timeouts) go to it, the short ones stay.
    pingora::prelude::fast_timeout::set_fast_timeout_to_tokio_threshold(Some(
        std::time::Duration::from_secs(10),
    ));
    server
}

/// Upstream groups and routes: the gateway file, or `--upstream` as one default group; none
/// (no reverse proxy) without either.
fn load_upstreams(config: &Config) -> Result<Option<SharedUpstreams>, StartupError> {
    let table = match &config.routes {
        Some(file) => crate::config::routes::load_file(file).map_err(StartupError::Routes)?,
        None if config.upstreams.is_empty() => return Ok(None),
        None => crate::config::routes::RouteTable::single(
            crate::config::routes::GroupSpec::from_flag(config.upstreams.clone()),
        ),
    };
    let built = upstreams::Upstreams::build(table)?;
    Ok(Some(Arc::new(arc_swap::ArcSwap::from_pointee(built))))
}

/// The upstream groups in force, swapped whole on reload.
type SharedUpstreams = Arc<arc_swap::ArcSwap<upstreams::Upstreams>>;

/// Every address this process listens on, with the flag that asked for it (bound by
/// `bind::bind_all`, or taken over, before Pingora starts; an upgrade confirms only when all of
/// them are in Pingora's table), and the services that take a socket from the table: each
/// starts only once the table holds the sockets bound here.
#[derive(Default)]
struct Listeners {
    wanted: Vec<bind::Wanted>,
    services: Vec<pingora::services::ServiceHandle>,
}

impl Listeners {
    fn want(&mut self, addr: &str, flag: &'static str) {
        self.wanted.push(bind::Wanted {
            addr: addr.to_string(),
            flag,
        });
    }

    /// A service listening on `addr` alone.
    fn add(&mut self, service: pingora::services::ServiceHandle, addr: &str, flag: &'static str) {
        self.want(addr, flag);
        self.services.push(service);
    }
}

/// What the reverse proxy's service is made of.
struct ProxyParts<'a> {
    config: &'a Config,
    gateway: &'a Arc<Gateway>,
    upstreams: &'a SharedUpstreams,
    certificates: Option<&'a Arc<crate::config::tls::Certificates>>,
}

impl ProxyParts<'_> {
    /// The reverse proxy, behind the connection guard, on `--listen` and (with certificates)
    /// HTTPS on `--listen-tls` or in place of `--listen`.
    fn add_to(&self, server: &mut Server, listeners: &mut Listeners) -> Result<(), StartupError> {
        let config = self.config;
        let nofile = conn::raise_nofile_limit();
        let limits = self.limits(nofile);
        let proxy = gateway::Proxy::new(Arc::clone(self.gateway), Arc::clone(self.upstreams));
        let mut app = pingora::proxy::http_proxy(&server.configuration, proxy);
        // HTTP/2: h2c with prior knowledge when asked; an idle HTTP/2 connection is closed
        // after the keep-alive timeout, as an idle HTTP/1.1 one is by the connection guard.
        let mut options = HttpServerOptions::default();
        options.h2c = config.h2c;
        options.h2_idle_timeout = Some(config.keepalive_timeout);
        app.server_options = Some(options);
        let mut svc = Service::new(
            "tollgate proxy".to_string(),
            conn::Guarded::new(app, limits.clone()),
        );
        let tls_on_listen = config.tls.as_ref().is_some_and(|t| t.listen.is_none());
        if !tls_on_listen {
            svc.add_listener(listener(&config.listen));
            listeners.want(&config.listen, "--listen");
        }
        if let (Some(tls), Some(certs)) = (&config.tls, self.certificates) {
            let addr = tls.listen.as_deref().unwrap_or(&config.listen);
            // Paths unused: the resolver picks a pair per handshake from the set in force.
            let mut settings =
                TlsSettings::intermediate("", "").map_err(|source| StartupError::TlsListener {
                    addr: addr.to_string(),
                    source,
                })?;
            settings.set_cert_resolver(certs.resolver());
            // ALPN: h2 first, then http/1.1.
            settings.enable_h2();
            svc.add_listener(listener(addr).tls(settings));
            let flag = if tls.listen.is_some() {
                "--listen-tls"
            } else {
                "--listen"
            };
            listeners.want(addr, flag);
            tracing::info!(listen_tls = %addr, "HTTPS listener (HTTP/2 and HTTP/1.1 by ALPN)");
        }
        svc.threads = Some(config.threads.get());
        listeners.services.push(server.add_service(svc));
        tracing::info!(
            listen = %config.listen,
            groups = ?self.upstreams.load().groups.iter().map(|g| g.spec.name.clone()).collect::<Vec<_>>(),
            max_connections = limits.max_connections,
            open_files = nofile,
            "reverse proxy"
        );
        Ok(())
    }

    /// The proxy's connection guard: its cap (from the open-files limit unless
    /// `--max-connections`), header timeout and per-client cap.
    fn limits(&self, nofile: u64) -> conn::Limits {
        let config = self.config;
        conn::Limits {
            max_connections: config.max_connections.map_or_else(
                || conn::default_max_connections(nofile, UPSTREAM_KEEPALIVE_POOL),
                std::num::NonZeroUsize::get,
            ),
            header_timeout: config.header_timeout,
            h2c: config.h2c,
            per_client: config.max_connections_per_ip.map(|max| {
                conn::PerClient::new(
                    max.get(),
                    config.ipv6_prefix,
                    config.trusted_proxies.clone(),
                    &config.reason_header,
                    self.gateway.metrics.connections_refused("per_ip"),
                )
            }),
        }
    }
}

/// A proxy listener on `addr`: a 4 KiB read buffer per connection instead of Pingora's
/// 64 KiB, so an idle connection costs a fraction of the memory (reads larger than the buffer
/// bypass it anyway).
fn listener(addr: &str) -> ListenerConfig {
    ListenerConfig::tcp(addr.to_string())
        .l4_buffer(L4BufferSettings::new(4096, DEFAULT_L4_WRITE_BUFFER_SIZE))
}

/// The admin listener (decision service, health, metrics). It gets the same guard as the
/// proxy: a slow or silent client must not hold its sockets (it is what `/livez` answers on).
/// Its cap is separate from the proxy's, so a full proxy never starves it.
fn add_admin(
    server: &mut Server,
    config: &Config,
    gateway: &Arc<Gateway>,
) -> pingora::services::ServiceHandle {
    let admin_limits = conn::Limits {
        max_connections: config
            .max_connections
            .map_or(
                conn::DEFAULT_MAX_CONNECTIONS_CEILING,
                std::num::NonZeroUsize::get,
            )
            .min(ADMIN_MAX_CONNECTIONS),
        header_timeout: config.header_timeout,
        h2c: false,
        per_client: None,
    };
    let mut admin = Service::new(
        "tollgate admin".to_string(),
        conn::Guarded::new(admin::Admin::new(Arc::clone(gateway)), admin_limits),
    );
    admin.add_tcp(&config.admin_listen);
    // Decisions (nginx auth_request, Envoy ext_authz) use every worker, like the proxy.
    admin.threads = Some(config.threads.get());
    let handle = server.add_service(admin);
    tracing::info!(admin_listen = %config.admin_listen, "admin listener (decision service, health, metrics)");
    handle
}

/// Envoy's gRPC services on `--grpc-listen`: the server starts on its own runtime now (a bad
/// certificate stops start-up) and takes its socket from the table once Pingora runs.
fn add_grpc(
    server: &mut Server,
    listeners: &mut Listeners,
    grpc: &crate::config::GrpcConfig,
    config: &Config,
    gateway: &Arc<Gateway>,
) -> Result<(), StartupError> {
    let (deliver, delivered) = tokio::sync::oneshot::channel();
    let running = crate::proxy::grpc::GrpcServer::start(
        Arc::clone(gateway),
        grpc,
        config.threads.get(),
        delivered,
    )?;
    let key = grpc.listen.to_string();
    let handle = server.add_service(GrpcListener {
        key: key.clone(),
        deliver: Some(deliver),
        server: Some(running),
    });
    listeners.add(handle, &key, "--grpc-listen");
    Ok(())
}

/// Reloads, sweeps and the policy store's follower; the upstream groups' health checks.
fn add_background(
    server: &mut Server,
    config: &Config,
    gateway: &Arc<Gateway>,
    verify_key: Option<Arc<crate::fleet::envelope::VerifyKey>>,
    certificates: Option<Arc<crate::config::tls::Certificates>>,
    upstreams: Option<SharedUpstreams>,
) {
    server.add_service(background_service(
        "tollgate housekeeping",
        Housekeeping {
            gateway: Arc::clone(gateway),
            verify_key,
            certificates,
            upstreams: upstreams.clone(),
            routes_seen: parking_lot::Mutex::new(
                config.routes.as_deref().and_then(crate::config::file_hash),
            ),
        },
    ));
    server.add_service(background_service(
        "tollgate usage and webhooks",
        UsageAndWebhooks {
            gateway: Arc::clone(gateway),
        },
    ));
    if let Some(upstreams) = upstreams {
        server.add_service(background_service(
            "tollgate upstream health",
            HealthChecks { upstreams },
        ));
    }
}

/// With `--upgrade`, last, once nothing else can fail: waits (up to a minute) for the running
/// process, sent SIGQUIT, to hand its listening sockets over, and passes them to Pingora's
/// bootstrap. Returns the addresses handed over and what confirms the upgrade to the old
/// process.
fn take_over(
    relay: Option<&Relay>,
    config: &Config,
    gateway: &Gateway,
) -> Result<(Vec<String>, Option<crate::proxy::handover::Confirmation>), StartupError> {
    let (Some(relay), Some(sock)) = (relay, &config.upgrade_sock) else {
        return Ok((Vec::new(), None));
    };
    tracing::info!(upgrade_sock = %sock.display(), "upgrade: waiting for the running gateway's listeners (send it SIGQUIT)");
    let metrics = &gateway.metrics;
    let (listeners, confirm) = crate::proxy::handover::receive(
        sock,
        crate::store::fs_trust::effective_uid(),
        crate::proxy::handover::RECEIVE_WAIT,
        |refused| {
            tracing::error!("upgrade: {refused}");
            metrics.handover_failed(refused.reason());
        },
    )
    .map_err(|e| {
        metrics.handover_failed(e.reason());
        StartupError::Handover(e)
    })?;
    tracing::info!(
        listeners = ?listeners.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>(),
        "upgrade: the running gateway handed its listeners over"
    );
    let handed_over: Vec<String> = listeners.iter().map(|(name, _)| name.clone()).collect();
    relay.pass_on(listeners);
    Ok((handed_over, Some(confirm)))
}

/// Binds every listener not handed over, before Pingora starts (see `bind`): one that cannot
/// be bound stops start-up here, with one line naming it. (On an upgrade, the old process is
/// not told this one serves, so it keeps serving.)
fn bind_the_rest(
    listeners: &Listeners,
    handed_over: &[String],
    config: &Config,
) -> Result<Vec<(String, std::os::fd::OwnedFd)>, StartupError> {
    let to_bind: Vec<bind::Wanted> = listeners
        .wanted
        .iter()
        .filter(|w| !handed_over.contains(&w.addr))
        .cloned()
        .collect();
    let prebound = bind::bind_all(
        &to_bind,
        bind::Retry::from_flag(config.bind_retry),
        std::thread::sleep,
    )?;
    for w in &to_bind {
        tracing::info!(flag = w.flag, addr = %w.addr, "listening");
    }
    Ok(prebound)
}

/// The table of listening sockets: the bound ones go in before any listening service starts;
/// kept for handing them over on SIGQUIT. On an upgrade, the old process is told this one
/// serves once every listener is in it.
fn add_listen_table(
    server: &mut Server,
    listeners: Listeners,
    prebound: Vec<(String, std::os::fd::OwnedFd)>,
    confirmation: Option<crate::proxy::handover::Confirmation>,
) -> Arc<std::sync::OnceLock<pingora::server::ListenFds>> {
    let listen_table = Arc::new(std::sync::OnceLock::new());
    let table_handle = server.add_service(ListenTable {
        table: Arc::clone(&listen_table),
        prebound,
    });
    for handle in &listeners.services {
        handle.add_dependency(&table_handle);
    }
    if let Some(confirmation) = confirmation {
        server.add_service(background_service(
            "tollgate upgrade confirmation",
            ConfirmUpgrade {
                confirmation: parking_lot::Mutex::new(Some(confirmation)),
                listen_addrs: listeners.wanted.into_iter().map(|w| w.addr).collect(),
                listen_table: Arc::clone(&listen_table),
            },
        ));
    }
    listen_table
}

/// SIGHUP's default action kills the process. The reload handler is installed only once the
/// server runs, so ignore SIGHUP until then: a config-management tool that signals right after
/// start must not take the gateway down. (The tokio handler installed later replaces this.)
fn ignore_sighup_until_ready() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code and is
    // async-signal-safe; it runs before any other thread of ours exists.
    unsafe {
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        // SIGQUIT's default action dumps core; until the server runs there are no listeners
        // to hand over, so an early one is ignored too.
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
}

/// SIGTERM and SIGINT both drain gracefully: listeners close, in-flight requests finish.
/// SIGQUIT hands the listening sockets to the process started with `--upgrade` and drains the
/// same way once that process says it serves; when no such process takes them (none waits,
/// a stranger answers, or it never confirms), this one keeps serving: an upgrade never turns
/// into an outage.
struct DrainOnSignal {
    /// Where the new process waits; `None`: SIGQUIT cannot hand anything over.
    upgrade_sock: Option<std::path::PathBuf>,
    /// The listening sockets (Pingora's table, filled as the services bind).
    listen_table: Arc<std::sync::OnceLock<pingora::server::ListenFds>>,
    gateway: Arc<Gateway>,
}

impl DrainOnSignal {
    /// A drain starts: requests waiting for their turn under `delay` rules are served within
    /// the drain or refused now (their tokens given back), never dropped when it ends.
    fn draining(&self) -> ShutdownSignal {
        self.gateway.pacer.drain();
        ShutdownSignal::GracefulTerminate
    }

    /// Hands the listening sockets over; `true` when the new process took them and serves.
    async fn hand_over(&self) -> bool {
        let Some(sock) = self.upgrade_sock.clone() else {
            tracing::error!("SIGQUIT: no upgrade socket (--upgrade-sock or --state-dir) to hand the listeners over through; still serving (SIGTERM stops the gateway)");
            self.gateway.metrics.handover_failed("no_socket");
            return false;
        };
        let listeners: Vec<(String, std::os::fd::RawFd)> = match self.listen_table.get() {
            Some(table) => {
                let (names, fds) = table.lock().serialize();
                names.into_iter().zip(fds).collect()
            }
            None => Vec::new(),
        };
        tracing::info!(upgrade_sock = %sock.display(), "SIGQUIT: handing the listeners over to the new gateway");
        let sent = tokio::task::spawn_blocking(move || {
            crate::proxy::handover::send(
                &sock,
                &listeners,
                crate::store::fs_trust::effective_uid(),
                crate::proxy::handover::CONNECT_WAIT,
                crate::proxy::handover::CONFIRM_WAIT,
            )
        })
        .await;
        match sent {
            Ok(Ok(())) => {
                tracing::info!("upgrade: the new gateway serves; draining");
                true
            }
            Ok(Err(e)) => {
                self.gateway.metrics.handover_failed(e.reason());
                tracing::error!("upgrade failed, still serving: {e}");
                false
            }
            Err(e) => {
                self.gateway.metrics.handover_failed("io");
                tracing::error!("upgrade failed, still serving: {e}");
                false
            }
        }
    }
}

#[async_trait]
impl ShutdownSignalWatch for DrainOnSignal {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int), Ok(mut quit)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::quit()),
        ) else {
            tracing::error!("cannot install signal handlers; shutting down");
            return ShutdownSignal::FastShutdown;
        };
        loop {
            tokio::select! {
                _ = term.recv() => {
                    tracing::info!("SIGTERM: draining");
                    return self.draining();
                }
                _ = int.recv() => {
                    tracing::info!("SIGINT: draining");
                    return self.draining();
                }
                _ = quit.recv() => {
                    // The new process has the sockets and serves: this one stops accepting
                    // and drains (no Pingora upgrade step: the hand-over is done). A stop asked
                    // for meanwhile is not kept waiting for the hand-over.
                    let hand_over = self.hand_over();
                    tokio::pin!(hand_over);
                    tokio::select! {
                        served = &mut hand_over => if served {
                            return self.draining();
                        },
                        _ = term.recv() => {
                            tracing::info!("SIGTERM during the hand-over: draining");
                            return self.draining();
                        }
                        _ = int.recv() => {
                            tracing::info!("SIGINT during the hand-over: draining");
                            return self.draining();
                        }
                    }
                }
            }
        }
    }
}

/// Puts the sockets `bind` bound into Pingora's table of listening sockets (every service is
/// handed the table at start), then lets the listening services start (they depend on this one
/// and find their sockets there); keeps the table for the hand-over on SIGQUIT.
struct ListenTable {
    table: Arc<std::sync::OnceLock<pingora::server::ListenFds>>,
    prebound: Vec<(String, std::os::fd::OwnedFd)>,
}

#[async_trait]
impl pingora::services::ServiceWithDependents for ListenTable {
    async fn start_service(
        &mut self,
        fds: Option<pingora::server::ListenFds>,
        mut shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
        ready: pingora::services::ServiceReadyNotifier,
    ) {
        use std::os::fd::IntoRawFd;
        if let Some(fds) = fds {
            {
                let mut table = fds.lock();
                for (addr, fd) in self.prebound.drain(..) {
                    // Never twice: an address already there (handed over) keeps that socket.
                    if table.get(&addr).is_none() {
                        // The listening service that takes it owns it from then on.
                        table.add(addr, fd.into_raw_fd());
                    }
                }
            }
            let _ = self.table.set(fds);
        }
        ready.notify_ready();
        let _ = shutdown.changed().await;
    }

    fn name(&self) -> &str {
        "tollgate listen table"
    }

    fn threads(&self) -> Option<usize> {
        Some(1)
    }
}

/// How long the new process of an upgrade waits for all its listeners to be in place.
const LISTENERS_WAIT: Duration = Duration::from_secs(10);

/// Tells the old process of an upgrade that this one serves, once every listener is in place
/// (taken over, or bound anew). When one is not (an address added by this upgrade is taken),
/// or the old process gave up waiting, this process stops: it must never serve beside the old
/// one, nor take over without all its listeners.
struct ConfirmUpgrade {
    confirmation: parking_lot::Mutex<Option<crate::proxy::handover::Confirmation>>,
    listen_addrs: Vec<String>,
    listen_table: Arc<std::sync::OnceLock<pingora::server::ListenFds>>,
}

impl ConfirmUpgrade {
    /// The listeners not yet in Pingora's table.
    fn missing(&self) -> Vec<&str> {
        let Some(table) = self.listen_table.get() else {
            return self.listen_addrs.iter().map(String::as_str).collect();
        };
        let table = table.lock();
        self.listen_addrs
            .iter()
            .filter(|addr| table.get(addr).is_none())
            .map(String::as_str)
            .collect()
    }
}

#[async_trait]
impl BackgroundService for ConfirmUpgrade {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let start = tokio::time::Instant::now();
        loop {
            let missing = self.missing();
            if missing.is_empty() {
                break;
            }
            if start.elapsed() >= LISTENERS_WAIT {
                tracing::error!(
                    missing = ?missing,
                    "upgrade: not every listener is in place after {LISTENERS_WAIT:?}; not confirming, stopping (the old gateway keeps serving)"
                );
                crate::telemetry::log_line::flush();
                std::process::exit(i32::from(EXIT_INVALID));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let Some(confirmation) = self.confirmation.lock().take() else {
            return;
        };
        match confirmation.confirm() {
            Ok(()) => tracing::info!("upgrade: serving; the old gateway drains"),
            Err(e) => {
                tracing::error!("upgrade: the old gateway stopped waiting for this one ({e}) and keeps serving; stopping");
                crate::telemetry::log_line::flush();
                std::process::exit(i32::from(EXIT_INVALID));
            }
        }
    }
}

/// Why the upgrade's relay cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("--upgrade-sock {}: the upgrade needs a socket beside it at {} ({bytes} bytes, more than the 107 a Unix socket path holds): use a shorter path", .upgrade_sock.display(), .sock.display())]
    TooLong {
        upgrade_sock: PathBuf,
        sock: PathBuf,
        bytes: usize,
    },
    #[error("--upgrade-sock: cannot make {}: {source}", .dir.display())]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// The upgrade's relay into Pingora's bootstrap: a directory only this process's user can
/// enter, beside the upgrade socket, holding the socket Pingora takes the listeners from.
struct Relay {
    dir: std::path::PathBuf,
    sock: std::path::PathBuf,
}

impl Relay {
    fn make(upgrade_sock: &std::path::Path) -> Result<Relay, RelayError> {
        let dir = crate::proxy::handover::socket_dir(upgrade_sock)
            .join(format!(".tollgate-relay-{}", std::process::id()));
        // A Unix socket's path holds at most 107 bytes; Pingora's bootstrap cannot take one
        // longer, so say so now, before anything is handed over.
        let sock = dir.join("s");
        let bytes = sock.as_os_str().len();
        if bytes > 107 {
            return Err(RelayError::TooLong {
                upgrade_sock: upgrade_sock.to_path_buf(),
                sock,
                bytes,
            });
        }
        // A leftover of an earlier process with this pid.
        let _ = std::fs::remove_dir_all(&dir);
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .map_err(|source| RelayError::Dir {
                dir: dir.clone(),
                source,
            })?;
        Ok(Relay { dir, sock })
    }

    /// Passes the sockets the old process handed over to Pingora's bootstrap, which waits on
    /// the relay socket (a thread: the bootstrap blocks this one).
    fn pass_on(&self, listeners: Vec<(String, std::os::fd::OwnedFd)>) {
        let sock = self.sock.clone();
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let raw: Vec<(String, std::os::fd::RawFd)> = listeners
                .iter()
                .map(|(name, fd)| (name.clone(), fd.as_raw_fd()))
                .collect();
            if let Err(e) = crate::proxy::handover::relay(
                &sock,
                &raw,
                crate::store::fs_trust::effective_uid(),
                crate::proxy::handover::CONNECT_WAIT,
            ) {
                tracing::error!("upgrade: {e}");
            }
            drop(listeners);
        });
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The gRPC listener's place among Pingora's services: it takes its socket from the table of
/// listening sockets (bound at start-up by [`bind`], or handed over by an upgrade, by address
/// like Pingora's own listeners), so the next upgrade hands it on; it gives the socket to the
/// gRPC server (its own runtime) and drains that when the server shuts down.
struct GrpcListener {
    key: String,
    deliver: Option<tokio::sync::oneshot::Sender<std::net::TcpListener>>,
    server: Option<crate::proxy::grpc::GrpcServer>,
}

#[async_trait]
impl pingora::services::Service for GrpcListener {
    async fn start_service(
        &mut self,
        fds: Option<pingora::server::ListenFds>,
        mut shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        use std::os::fd::FromRawFd;
        match fds.and_then(|fds| fds.lock().get(&self.key).copied()) {
            Some(fd) => {
                // SAFETY: the descriptor is this address's listening socket, bound at start-up
                // or handed over, put in the table for this service alone (it starts after the
                // table is filled); nothing else in this process owns it.
                let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
                let _ = listener.set_nonblocking(true);
                if let Some(deliver) = self.deliver.take() {
                    let _ = deliver.send(listener);
                }
            }
            // Cannot happen: start-up stops when the address cannot be bound.
            None => {
                tracing::error!(grpc_listen = %self.key, "gRPC listener: no socket in the table")
            }
        }
        let _ = shutdown.changed().await;
        if let Some(server) = self.server.take() {
            // Joining the gRPC runtime's thread blocks: not on this runtime's worker.
            let _ = tokio::task::spawn_blocking(move || server.shutdown()).await;
        }
    }

    fn name(&self) -> &str {
        "tollgate grpc"
    }

    fn threads(&self) -> Option<usize> {
        Some(1)
    }

    /// Claims its socket, so Pingora does not close it as unclaimed after an upgrade.
    fn listen_addresses(&self) -> Option<Vec<String>> {
        Some(vec![self.key.clone()])
    }
}

/// Under `--policy-store`: reads the verify key, puts in force the bundle kept in `--state-dir`,
/// then reads the store once (bounded by [`crate::service::follow::SOURCE_TIMEOUT`]) so that a gateway starts with the
/// newest published bundle when the store answers. Returns the key for the follower.
fn start_following(
    gateway: &Arc<Gateway>,
) -> Result<Option<Arc<crate::fleet::envelope::VerifyKey>>, StartupError> {
    let Some(store) = &gateway.config.policy_store else {
        return Ok(None);
    };
    let key = match &store.verify_key {
        Some(path) => Some(Arc::new(
            crate::fleet::envelope::VerifyKey::from_pem_file(path)
                .map_err(StartupError::VerifyKey)?,
        )),
        None => {
            // Config refuses this without --allow-unsigned-bundles.
            tracing::warn!(
                url = %crate::fleet::source::display_url(&store.url),
                "--allow-unsigned-bundles: following the policy store without --policy-verify-key: any bundle in it is put in force, unsigned, from anyone who can write to the store"
            );
            None
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StartupError::FirstRead)?;
    let timeout = crate::service::follow::SOURCE_TIMEOUT;
    runtime.block_on(async {
        // A source of its own: its connections belong to this short-lived runtime.
        let source =
            crate::fleet::source::open(&store.url, timeout).map_err(StartupError::PolicyStore)?;
        let follower =
            crate::service::follow::Follower::new(Arc::clone(gateway), source, key.clone());
        follower.load_kept();
        // Each call has its deadline; this bounds the whole first read as well.
        let _ = tokio::time::timeout(timeout * 2, follower.poll_once(Trigger::Startup)).await;
        Ok::<(), StartupError>(())
    })?;
    Ok(key)
}

/// Reload on SIGHUP and on policy-file (and certificate-file) change; periodic bucket sweep.
struct Housekeeping {
    gateway: Arc<Gateway>,
    /// `--policy-verify-key`, read at start-up.
    verify_key: Option<Arc<crate::fleet::envelope::VerifyKey>>,
    certificates: Option<Arc<crate::config::tls::Certificates>>,
    upstreams: Option<Arc<arc_swap::ArcSwap<upstreams::Upstreams>>>,
    /// The gateway file's signature at the last look.
    routes_seen: parking_lot::Mutex<Option<u64>>,
}

impl Housekeeping {
    /// Reloads the gateway file: a valid one replaces the groups and routes (requests in flight
    /// keep the group they were routed to); an invalid one is logged and the set in force stays.
    fn reload_routes(&self, trigger: &str) {
        let (Some(file), Some(upstreams)) = (&self.gateway.config.routes, &self.upstreams) else {
            return;
        };
        *self.routes_seen.lock() = crate::config::file_hash(file);
        // Read and compiled once; unchanged (a SIGHUP for the certificates or the policy), the
        // groups stay, and with them what the health checks know.
        let rejected = |e: &dyn std::fmt::Display| {
            tracing::error!(
                trigger,
                "routes reload rejected, keeping the routes in force: {e}"
            );
        };
        let table = match crate::config::routes::load_file(file) {
            Ok(table) if table == upstreams.load().table => return,
            Ok(table) => table,
            Err(e) => return rejected(&e),
        };
        match upstreams::Upstreams::build(table) {
            Ok(built) => {
                let names: Vec<String> = built.groups.iter().map(|g| g.spec.name.clone()).collect();
                upstreams.store(Arc::new(built));
                tracing::info!(trigger, groups = ?names, "routes loaded");
            }
            Err(e) => rejected(&e),
        }
    }

    fn reload_routes_if_changed(&self) {
        let Some(file) = &self.gateway.config.routes else {
            return;
        };
        if *self.routes_seen.lock() != crate::config::file_hash(file) {
            self.reload_routes("file_change");
        }
    }
}

/// Active health checks of every upstream group, each at its own interval.
struct HealthChecks {
    upstreams: Arc<arc_swap::ArcSwap<upstreams::Upstreams>>,
}

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {
                    // Each group's check in a task of its own: a slow group never delays
                    // another's.
                    let current = self.upstreams.load_full();
                    for group in current.groups.iter().filter(|g| g.claim_health_check()) {
                        let group = Arc::clone(group);
                        tokio::spawn(async move { group.run_health_check().await });
                    }
                }
            }
        }
    }
}

/// The usage ledger's notes sent to a shared store; threshold webhooks claimed, delivered, and
/// taken over from a gateway that stopped before delivering.
struct UsageAndWebhooks {
    gateway: Arc<Gateway>,
}

#[async_trait]
impl BackgroundService for UsageAndWebhooks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let gateway = &self.gateway;
        let webhooks = gateway.webhooks.enabled();
        let mut flush = tokio::time::interval(crate::service::usage::FLUSH_EVERY);
        let mut due = tokio::time::interval(crate::service::webhooks::DUE_EVERY);
        flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        due.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => {
                    gateway.usage.flush(&gateway.store, &gateway.metrics).await;
                    return;
                }
                _ = flush.tick() => gateway.usage.flush(&gateway.store, &gateway.metrics).await,
                () = gateway.webhooks.queued(), if webhooks => gateway.webhooks.claim_queued().await,
                _ = due.tick(), if webhooks => gateway.webhooks.resume_due().await,
            }
        }
    }
}

#[async_trait]
impl BackgroundService for Housekeeping {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!("cannot listen for SIGHUP (reload by file change only): {e}");
                None
            }
        };
        // A shared store connects in the background: the gateway serves (failing open) meanwhile.
        self.gateway.store.connect_in_background();
        if let Some(store) = &self.gateway.config.policy_store {
            match crate::fleet::source::open(&store.url, crate::service::follow::SOURCE_TIMEOUT) {
                Ok(source) => {
                    let poll = if source.kind() == "http" {
                        self.gateway
                            .config
                            .policy_poll
                            .unwrap_or(crate::service::follow::STORE_POLL)
                    } else {
                        crate::service::follow::STORE_POLL
                    };
                    let follower = crate::service::follow::Follower::new(
                        Arc::clone(&self.gateway),
                        source,
                        self.verify_key.clone(),
                    );
                    let mut stop = shutdown.clone();
                    tokio::spawn(follower.run(poll, async move {
                        let _ = stop.changed().await;
                    }));
                }
                Err(e) => tracing::error!("--policy-store: {e}"),
            }
        }
        let poll = self
            .gateway
            .config
            .policy_poll
            .unwrap_or(Duration::from_secs(3600));
        let mut poll_tick = tokio::time::interval(poll);
        let mut sweep_tick = tokio::time::interval(self.gateway.config.sweep_interval);
        poll_tick.tick().await;
        sweep_tick.tick().await;
        // A shared store's presence and local mode (see `store::local`): first once the store
        // has had a second to connect.
        let mut presence_tick = tokio::time::interval_at(
            tokio::time::Instant::now() + Duration::from_secs(1),
            crate::store::local::PRESENCE_EVERY,
        );
        presence_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let shared_store = self.gateway.store.local().is_some();
        // The runtime override table: a shared store's changes read, expired overrides dropped.
        let mut overrides_tick = tokio::time::interval(crate::service::REFRESH_EVERY);
        overrides_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = overrides_tick.tick() => {
                    self.gateway.refresh_overrides().await;
                }
                _ = presence_tick.tick(), if shared_store => {
                    self.gateway.store.heartbeat().await;
                }
                _ = shutdown.changed() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    let _ = self.gateway.load_policy(Trigger::Sighup);
                    self.gateway.reload_admin_tokens();
                    if let Err(e) = self.gateway.audit.reopen() {
                        tracing::error!("{e}; audit lines keep going to the file open before");
                    }
                    if let Some(certs) = &self.certificates {
                        let _ = certs.reload("sighup");
                    }
                    self.reload_routes("sighup");
                }
                _ = poll_tick.tick(), if self.gateway.config.policy_poll.is_some() => {
                    self.gateway.reload_if_changed();
                    if let Some(certs) = &self.certificates {
                        certs.reload_if_changed();
                    }
                    self.reload_routes_if_changed();
                }
                _ = sweep_tick.tick() => {
                    let removed = self.gateway.sweep().await;
                    tracing::debug!(removed, "bucket sweep");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_up_error_names_its_flag_and_exits_invalid() {
        let e = StartupError::NoPolicyFile(PathBuf::from("/etc/tollgate/p.json"));
        assert_eq!(
            e.to_string(),
            "--policy /etc/tollgate/p.json: no such file (start with --wait-for-policy to run unlimited until it appears)"
        );
        assert_eq!(e.log_line(), e.to_string());
        assert_eq!(e.exit_code(), EXIT_INVALID);
        let e = StartupError::UpgradeWithoutPolicy(NotInForce::NoBundle {
            url: "redis://store:6379/".to_string(),
        });
        assert_eq!(
            e.to_string(),
            "--upgrade: the policy does not load, so the running gateway keeps its listeners: --policy-store redis://store:6379/: no bundle could be put in force (none published, none kept in --state-dir, or the store unreachable)"
        );
    }

    #[test]
    fn a_failed_hand_over_is_logged_as_the_upgrade_step_it_is() {
        let e = StartupError::Handover(handover::HandoverError::NoTaker {
            path: PathBuf::from("/run/tollgate/upgrade.sock"),
            wait: Duration::from_secs(60),
        });
        assert!(
            e.to_string()
                .starts_with("--upgrade-sock /run/tollgate/upgrade.sock: "),
            "{e}"
        );
        assert_eq!(e.log_line(), format!("upgrade: {e}"));
    }

    #[test]
    fn a_relay_path_too_long_for_a_unix_socket_is_refused_before_anything_is_made() {
        let dir = format!("/{}", "d".repeat(100));
        let sock = PathBuf::from(format!("{dir}/upgrade.sock"));
        let Err(e) = Relay::make(&sock) else {
            panic!("a relay beside {} was made", sock.display());
        };
        let relay = format!("{dir}/.tollgate-relay-{}/s", std::process::id());
        assert_eq!(
            StartupError::from(e).to_string(),
            format!(
                "--upgrade-sock {}: the upgrade needs a socket beside it at {relay} ({} bytes, more than the 107 a Unix socket path holds): use a shorter path",
                sock.display(),
                relay.len()
            )
        );
        assert!(!std::path::Path::new(&dir).exists());
    }
}
