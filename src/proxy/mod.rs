//! Pingora glue: the only module that names Pingora types. It builds the server — the reverse
//! proxy ([`gateway`]), the admin listener ([`admin`]) and background tasks (reload, sweep) — and
//! runs it until SIGTERM/SIGINT, then drains; or, on SIGQUIT, hands its listening sockets over
//! to the process started with `--upgrade` (Pingora's zero-downtime upgrade), then drains.

pub mod admin;
pub mod conn;
pub mod gateway;
pub mod upstreams;

use crate::cli::{RunArgs, EXIT_INVALID, EXIT_OK};
use crate::config::Config;
use crate::service::{init_logging, Gateway};
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
use std::sync::Arc;
use std::time::Duration;

/// Idle upstream connections kept per proxy.
const UPSTREAM_KEEPALIVE_POOL: usize = 256;

/// Most connections the admin listener holds at once (gateways calling the decision service
/// keep pools of a few hundred at most).
const ADMIN_MAX_CONNECTIONS: usize = 4096;

/// `tollgate run`: returns the process exit code.
pub fn run(args: RunArgs) -> u8 {
    ignore_sighup_until_ready();
    init_logging(args.log_format);
    let config = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("tollgate: {e}");
            return EXIT_INVALID;
        }
    };
    let gateway = match Gateway::new(config.clone()) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("tollgate: {e}");
            return EXIT_INVALID;
        }
    };
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
    // A policy file that does not exist is most likely a typo: starting would proxy everything
    // unlimited. `--wait-for-policy` is for orchestrators that mount the file later.
    if !config.wait_for_policy && !config.policy.exists() {
        let e = format!(
            "--policy {}: no such file (start with --wait-for-policy to run unlimited until it appears)",
            config.policy.display()
        );
        tracing::error!("{e}");
        eprintln!("tollgate: {e}");
        return EXIT_INVALID;
    }
    // An invalid policy is not fatal: decisions answer 503 until a valid bundle appears (the
    // file watcher picks it up).
    let _ = gateway.load_policy("startup");

    if let Some(sock) = config.upgrade_sock.as_ref().filter(|sock| {
        config.upgrade
            && !sock
                .parent()
                .is_some_and(|dir| dir.as_os_str().is_empty() || dir.is_dir())
    }) {
        let e = format!(
            "--upgrade-sock {}: its directory does not exist",
            sock.display()
        );
        tracing::error!("{e}");
        eprintln!("tollgate: {e}");
        return EXIT_INVALID;
    }
    let conf = ServerConf {
        threads: config.threads,
        // Without one, SIGQUIT drains instead (`DrainOnSignal`), so Pingora never uses this.
        upgrade_sock: config
            .upgrade_sock
            .as_ref()
            .map_or_else(String::new, |sock| sock.display().to_string()),
        work_stealing: false,
        upstream_keepalive_pool_size: UPSTREAM_KEEPALIVE_POOL,
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(10),
        ..ServerConf::default()
    };
    // Certificates first: a bad one is a start-up error naming the file.
    let certificates = match &config.tls {
        None => None,
        Some(tls) => match crate::tls::Certificates::load(tls.pairs.clone()) {
            Ok(certs) => {
                tracing::info!(names = ?certs.current().names, "TLS certificates loaded");
                Some(certs)
            }
            Err(e) => {
                tracing::error!("--tls-cert/--tls-key: {e}");
                eprintln!("tollgate: --tls-cert/--tls-key: {e}");
                return EXIT_INVALID;
            }
        },
    };
    // Options built here: Pingora must not parse our argv (its own flags clash with ours).
    let options = pingora::server::configuration::Opt {
        upgrade: config.upgrade,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(options, conf);

    // Upstream groups and routes: the gateway file, or `--upstream` as one default group.
    let route_table = match &config.routes {
        Some(file) => match crate::routes::load_file(file) {
            Ok(table) => Some(table),
            Err(e) => {
                tracing::error!("--routes: {e}");
                eprintln!("tollgate: --routes: {e}");
                return EXIT_INVALID;
            }
        },
        None if config.upstreams.is_empty() => None,
        None => Some(crate::routes::RouteTable::single(
            crate::routes::GroupSpec::from_flag(config.upstreams.clone()),
        )),
    };
    let upstreams = match route_table.map(upstreams::Upstreams::build) {
        None => None,
        Some(Ok(built)) => Some(Arc::new(arc_swap::ArcSwap::from_pointee(built))),
        Some(Err(e)) => {
            tracing::error!("{e}");
            eprintln!("tollgate: {e}");
            return EXIT_INVALID;
        }
    };

    if let Some(upstreams) = &upstreams {
        let nofile = conn::raise_nofile_limit();
        let limits = conn::Limits {
            max_connections: config
                .max_connections
                .unwrap_or_else(|| conn::default_max_connections(nofile, UPSTREAM_KEEPALIVE_POOL)),
            header_timeout: config.header_timeout,
            h2c: config.h2c,
            per_client: config.max_connections_per_ip.map(|max| {
                conn::PerClient::new(
                    max,
                    config.ipv6_prefix,
                    config.trusted_proxies.clone(),
                    &config.reason_header,
                    gateway.metrics.connections_refused("per_ip"),
                )
            }),
        };
        let proxy = gateway::Proxy::new(Arc::clone(&gateway), Arc::clone(upstreams));
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
        // A 4 KiB read buffer per connection instead of Pingora's 64 KiB: an idle connection
        // costs a fraction of the memory, and reads larger than the buffer bypass it anyway.
        let listener = |addr: &str| {
            ListenerConfig::tcp(addr.to_string())
                .l4_buffer(L4BufferSettings::new(4096, DEFAULT_L4_WRITE_BUFFER_SIZE))
        };
        let tls_on_listen = config.tls.as_ref().is_some_and(|t| t.listen.is_none());
        if !tls_on_listen {
            svc.add_listener(listener(&config.listen));
        }
        if let (Some(tls), Some(certs)) = (&config.tls, &certificates) {
            let addr = tls.listen.as_deref().unwrap_or(&config.listen);
            // Paths unused: the resolver picks a pair per handshake from the set in force.
            let mut settings = match TlsSettings::intermediate("", "") {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("TLS listener {addr}: {e}");
                    return EXIT_INVALID;
                }
            };
            settings.set_cert_resolver(certs.resolver());
            // ALPN: h2 first, then http/1.1.
            settings.enable_h2();
            svc.add_listener(listener(addr).tls(settings));
            tracing::info!(listen_tls = %addr, "HTTPS listener (HTTP/2 and HTTP/1.1 by ALPN)");
        }
        svc.threads = Some(config.threads);
        server.add_service(svc);
        tracing::info!(
            listen = %config.listen,
            groups = ?upstreams.load().groups.iter().map(|g| g.spec.name.clone()).collect::<Vec<_>>(),
            max_connections = limits.max_connections,
            open_files = nofile,
            "reverse proxy listening"
        );
    }

    // The admin listener gets the same guard: a slow or silent client must not hold its
    // sockets (it is what `/livez` answers on). Its cap is separate from the proxy's, so a
    // full proxy never starves it.
    let admin_limits = conn::Limits {
        max_connections: config
            .max_connections
            .unwrap_or(conn::DEFAULT_MAX_CONNECTIONS_CEILING)
            .min(ADMIN_MAX_CONNECTIONS),
        header_timeout: config.header_timeout,
        h2c: false,
        per_client: None,
    };
    let mut admin = Service::new(
        "tollgate admin".to_string(),
        conn::Guarded::new(admin::Admin::new(Arc::clone(&gateway)), admin_limits),
    );
    admin.add_tcp(&config.admin_listen);
    // Decisions (nginx auth_request, Envoy ext_authz) use every worker, like the proxy.
    admin.threads = Some(config.threads);
    server.add_service(admin);
    tracing::info!(admin_listen = %config.admin_listen, "admin listener (decision service, health, metrics)");

    if let Some(grpc) = &config.grpc {
        // Bound now (a bad address stops start-up), unless an upgrade takes the running
        // process's socket over.
        let bound = if config.upgrade {
            None
        } else {
            match crate::grpc::bind(grpc) {
                Ok(listener) => Some(listener),
                Err(e) => {
                    tracing::error!("{e}");
                    eprintln!("tollgate: {e}");
                    return EXIT_INVALID;
                }
            }
        };
        let (deliver, delivered) = tokio::sync::oneshot::channel();
        match crate::grpc::GrpcServer::start(Arc::clone(&gateway), grpc, config.threads, delivered)
        {
            Ok(running) => {
                server.add_service(GrpcListener {
                    key: grpc.listen.to_string(),
                    bound,
                    deliver: Some(deliver),
                    server: Some(running),
                });
            }
            Err(e) => {
                tracing::error!("{e}");
                eprintln!("tollgate: {e}");
                return EXIT_INVALID;
            }
        }
    }

    server.add_service(background_service(
        "tollgate housekeeping",
        Housekeeping {
            gateway: Arc::clone(&gateway),
            certificates,
            upstreams: upstreams.clone(),
            routes_seen: parking_lot::Mutex::new(
                config.routes.as_deref().and_then(crate::config::file_hash),
            ),
        },
    ));
    if let Some(upstreams) = upstreams {
        server.add_service(background_service(
            "tollgate upstream health",
            HealthChecks { upstreams },
        ));
    }

    // Last, once nothing else can fail: with --upgrade this waits (up to about 6 s) for the
    // running process, sent SIGQUIT, to hand its listening sockets over.
    if config.upgrade {
        let sock = config
            .upgrade_sock
            .as_deref()
            .unwrap_or(std::path::Path::new(""));
        tracing::info!(upgrade_sock = %sock.display(), "upgrade: waiting for the running gateway's listeners (send it SIGQUIT)");
    }
    server.bootstrap();
    server.run(PingoraRunArgs {
        shutdown_signal: Box::new(DrainOnSignal {
            can_hand_over: config.upgrade_sock.is_some(),
        }),
    });
    crate::log_line::flush();
    tracing::info!("tollgate stopped");
    EXIT_OK
}

/// A request body's declared `Content-Length`, when it has one (the proxy and the decision
/// service bound the bodies they read by it before reading).
fn declared_length(req: &pingora::http::RequestHeader) -> Option<usize> {
    req.headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
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
/// SIGQUIT first hands the listening sockets to the process started with `--upgrade`, then
/// drains the same way.
struct DrainOnSignal {
    /// An upgrade socket is configured: SIGQUIT hands the listeners over through it.
    can_hand_over: bool,
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
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: draining"),
            _ = int.recv() => tracing::info!("SIGINT: draining"),
            _ = quit.recv() => {
                if !self.can_hand_over {
                    tracing::warn!("SIGQUIT: no upgrade socket (--upgrade-sock or --state-dir): draining without handing the listeners over");
                    return ShutdownSignal::GracefulTerminate;
                }
                tracing::info!("SIGQUIT: handing the listeners over to the new gateway, then draining");
                return ShutdownSignal::GracefulUpgrade;
            }
        }
        ShutdownSignal::GracefulTerminate
    }
}

/// The gRPC listener's place among Pingora's services: it finds its socket in the table of
/// listening sockets an upgrade hands over (by address, like Pingora's own listeners) or puts the
/// one bound at start-up there so the next upgrade hands it on; it gives the socket to the gRPC
/// server (its own runtime) and drains that when the server shuts down.
struct GrpcListener {
    key: String,
    bound: Option<std::net::TcpListener>,
    deliver: Option<tokio::sync::oneshot::Sender<std::net::TcpListener>>,
    server: Option<crate::grpc::GrpcServer>,
}

#[async_trait]
impl pingora::services::Service for GrpcListener {
    async fn start_service(
        &mut self,
        fds: Option<pingora::server::ListenFds>,
        mut shutdown: ShutdownWatch,
        _listeners_per_fd: usize,
    ) {
        use std::os::fd::{AsRawFd, FromRawFd};
        let inherited = fds
            .as_ref()
            .and_then(|fds| fds.lock().get(&self.key).copied());
        let listener = match (inherited, self.bound.take()) {
            (Some(fd), _) => {
                tracing::info!(grpc_listen = %self.key, "gRPC listener taken over from the previous gateway");
                // SAFETY: the descriptor came over the upgrade socket as this address's listening
                // socket, and nothing else in this process owns it.
                let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
                let _ = listener.set_nonblocking(true);
                Some(listener)
            }
            (None, Some(bound)) => Some(bound),
            // An upgrade from a gateway that had no gRPC listener: bind now.
            (None, None) => match std::net::TcpListener::bind(&self.key) {
                Ok(l) => {
                    let _ = l.set_nonblocking(true);
                    Some(l)
                }
                Err(e) => {
                    tracing::error!(grpc_listen = %self.key, "gRPC listener: cannot bind: {e}");
                    None
                }
            },
        };
        if let Some(listener) = listener {
            if let (Some(fds), None) = (&fds, inherited) {
                fds.lock().add(self.key.clone(), listener.as_raw_fd());
            }
            if let Some(deliver) = self.deliver.take() {
                let _ = deliver.send(listener);
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

/// Reload on SIGHUP and on policy-file (and certificate-file) change; periodic bucket sweep.
struct Housekeeping {
    gateway: Arc<Gateway>,
    certificates: Option<Arc<crate::tls::Certificates>>,
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
        let loaded = crate::routes::load_file(file).map_err(|e| e.to_string());
        if loaded
            .as_ref()
            .is_ok_and(|table| *table == upstreams.load().table)
        {
            return;
        }
        match loaded.and_then(upstreams::Upstreams::build) {
            Ok(built) => {
                let names: Vec<String> = built.groups.iter().map(|g| g.spec.name.clone()).collect();
                upstreams.store(Arc::new(built));
                tracing::info!(trigger, groups = ?names, "routes loaded");
            }
            Err(e) => tracing::error!(
                trigger,
                "routes reload rejected, keeping the routes in force: {e}"
            ),
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
        let poll = self
            .gateway
            .config
            .policy_poll
            .unwrap_or(Duration::from_secs(3600));
        let mut poll_tick = tokio::time::interval(poll);
        let mut sweep_tick = tokio::time::interval(self.gateway.config.sweep_interval);
        poll_tick.tick().await;
        sweep_tick.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    let _ = self.gateway.load_policy("sighup");
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
