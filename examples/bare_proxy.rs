//! A bare Pingora reverse proxy built exactly like tollgate (same Pingora features, mimalloc,
//! one thread, no work stealing, the same listener buffers, same profile), with no hooks but
//! `upstream_peer`: the load harness's floor for what Pingora itself costs per request. With
//! `--refuse` it answers every request itself with a 429 carrying the same five headers as
//! tollgate's refusals, built the same way: the floor for the refusal path.
//!
//! `cargo run --profile perf --example bare_proxy -- LISTEN UPSTREAM [--refuse]`

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

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
    refuse: bool,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    async fn request_filter(
        &self,
        session: &mut Session,
        _ctx: &mut Self::CTX,
    ) -> pingora::Result<bool> {
        if !self.refuse {
            return Ok(false);
        }
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.status = http::StatusCode::TOO_MANY_REQUESTS;
        for (name, value) in [
            ("ratelimit-policy", "\"deny\";q=1;w=1000000"),
            ("ratelimit", "\"deny\";r=0;t=1000000"),
            ("ratelimit-limit", "1"),
            ("ratelimit-remaining", "0"),
            ("ratelimit-reset", "1000000"),
            ("retry-after", "1000000"),
            ("x-tollgate-reason", "token_bucket_exceeded"),
            ("content-type", "text/plain; charset=utf-8"),
            ("content-length", "17"),
        ] {
            parts.headers.insert(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        session
            .write_response_header(Box::new(pingora::http::ResponseHeader::from(parts)), false)
            .await?;
        session
            .write_response_body(Some(bytes::Bytes::from_static(b"Too Many Requests")), true)
            .await?;
        Ok(true)
    }

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
        eprintln!("usage: bare_proxy LISTEN UPSTREAM [--refuse]");
        std::process::exit(2);
    };
    let refuse = args.next().as_deref() == Some("--refuse");
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
            refuse,
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
