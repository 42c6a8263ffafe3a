//! A bare Pingora reverse proxy built exactly like tollgate (same Pingora features, mimalloc,
//! one thread, no work stealing, the same listener buffers, same profile), with no hooks but
//! `upstream_peer`: the load harness's floor for what Pingora itself costs per request.
//!
//! `cargo run --profile perf --example bare_proxy -- LISTEN UPSTREAM`

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use async_trait::async_trait;
use pingora::prelude::HttpPeer;
use pingora::proxy::{ProxyHttp, Session};
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use std::net::SocketAddr;

struct Bare {
    peer: HttpPeer,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut Self::CTX,
    ) -> pingora::Result<Box<HttpPeer>> {
        Ok(Box::new(self.peer.clone()))
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_proxy LISTEN UPSTREAM");
        std::process::exit(2);
    };
    let Ok(upstream) = upstream.parse::<SocketAddr>() else {
        eprintln!("bare_proxy: UPSTREAM must be IP:PORT");
        std::process::exit(2);
    };
    let conf = ServerConf {
        threads: 1,
        work_stealing: false,
        upstream_keepalive_pool_size: 256,
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut svc = pingora::proxy::http_proxy_service(
        &server.configuration,
        Bare {
            peer: HttpPeer::new(upstream, false, String::new()),
        },
    );
    svc.add_listener(pingora::listeners::ListenerConfig::tcp(listen).l4_buffer(
        pingora::listeners::L4BufferSettings::new(
            4096,
            pingora::listeners::DEFAULT_L4_WRITE_BUFFER_SIZE,
        ),
    ));
    server.add_service(svc);
    server.run_forever();
}
