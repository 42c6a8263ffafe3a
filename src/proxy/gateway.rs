//! The reverse proxy: `request_filter` builds [`RequestFacts`] and asks the gateway; a refusal is
//! answered here and never reaches the upstream; an allowed request is proxied round-robin and
//! the rate-limit headers are added to the upstream's response.

use crate::descriptor::RequestFacts;
use crate::engine::Reason;
use crate::headers::HeaderList;
use crate::service::{Gateway, HttpHeaders};
use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::modules::http::HttpModules;
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::{Error, Result};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Per-request state.
#[derive(Default)]
pub struct RequestCtx {
    /// Headers to add to the upstream's response.
    add_headers: HeaderList,
    /// The TCP peer, appended to `X-Forwarded-For` towards the upstream.
    peer: Option<IpAddr>,
}

/// The proxy service.
pub struct Proxy {
    gateway: Arc<Gateway>,
    /// Prepared once: building a peer per request would re-resolve and may panic.
    peers: Vec<HttpPeer>,
    next: AtomicUsize,
}

impl Proxy {
    pub fn new(gateway: Arc<Gateway>) -> Self {
        let peers = gateway
            .config
            .upstreams
            .iter()
            .map(|addr| HttpPeer::new(*addr, false, String::new()))
            .collect();
        Proxy {
            gateway,
            peers,
            next: AtomicUsize::new(0),
        }
    }
}

/// `X-Forwarded-For` towards the upstream: every line the client side sent, folded into one
/// (byte for byte: a line that is not text must not make the chain disappear), then `peer`,
/// as nginx's `$proxy_add_x_forwarded_for` does.
fn forwarded_for_upstream(headers: &http::HeaderMap, peer: std::net::IpAddr) -> Vec<u8> {
    let mut value = Vec::with_capacity(64);
    for line in headers.get_all("x-forwarded-for") {
        value.extend_from_slice(line.as_bytes());
        value.extend_from_slice(b", ");
    }
    value.extend_from_slice(peer.to_string().as_bytes());
    value
}

/// Writes a complete response from the gateway itself: built from `http` parts with names
/// parsed once (Pingora's `insert_header` would parse and allocate each custom name again), with
/// `Content-Length`, so header and body leave in one write and the connection stays open.
async fn respond(
    session: &mut Session,
    status: u16,
    headers: HeaderList,
    body: &'static str,
) -> Result<()> {
    let (mut parts, ()) = http::Response::new(()).into_parts();
    parts.status =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    parts.headers.reserve(headers.len() + 2);
    for (name, value) in headers {
        parts.headers.append(name, value);
    }
    parts.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    parts.headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(body.len()),
    );
    session
        .write_response_header(Box::new(ResponseHeader::from(parts)), false)
        .await?;
    session
        .write_response_body(Some(Bytes::from_static(body.as_bytes())), true)
        .await
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> Self::CTX {
        RequestCtx::default()
    }

    /// No downstream modules: Pingora's default adds a disabled compression module whose
    /// context is built, and whose filters run, on every request.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    async fn early_request_filter(
        &self,
        session: &mut Session,
        _ctx: &mut Self::CTX,
    ) -> Result<()> {
        // Requests pipelined behind this one are answered in order (Pingora drops them
        // otherwise); the flag carries over to the connection's next requests.
        session.set_pipelining_enabled(true);
        super::conn::header_parsed();
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        // The peer and its trusted-proxy verdict are worked out once per connection.
        let (peer, peer_trusted) = super::conn::peer(|| {
            let peer = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|sa| sa.ip());
            let trusted = peer
                .map(crate::descriptor::canonical_ip)
                .is_some_and(|ip| self.gateway.is_trusted_proxy(ip));
            (peer, trusted)
        });
        ctx.peer = peer;
        let response = {
            let req = session.req_header();
            let headers = HttpHeaders(&req.headers);
            let client_ip = self
                .gateway
                .client_ip_with(peer, peer_trusted, &req.headers);
            // An absolute-form target (`GET http://api.example.com/x`) names the host the
            // upstream routes by; it wins over the Host header (RFC 9112 §3.2.2).
            let host = req.uri.authority().map(|a| a.as_str()).or_else(|| {
                req.headers
                    .get(http::header::HOST)
                    .and_then(|v| v.to_str().ok())
            });
            let target = req
                .uri
                .path_and_query()
                .map_or_else(|| req.uri.path(), |pq| pq.as_str());
            match RequestFacts::new(
                req.method.as_str(),
                target,
                host,
                client_ip,
                &headers,
                self.gateway.config.encoded_slashes,
            ) {
                Ok(facts) => {
                    let claims = self.gateway.claims(&headers);
                    let answer = self
                        .gateway
                        .decide(&facts.with_claims(claims.as_deref()))
                        .await;
                    if answer.allowed {
                        // No policy loaded: the proxy fails open (the decision service
                        // answers 503).
                        ctx.add_headers = answer.response.headers;
                        return Ok(false);
                    }
                    answer.response
                }
                Err(_) => {
                    self.gateway
                        .refuse_early(Reason::EncodedSlash, client_ip, host, req.uri.path())
                }
            }
        };
        respond(
            session,
            response.status,
            response.headers,
            response.body.unwrap_or("Too Many Requests"),
        )
        .await?;
        Ok(true)
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut Self::CTX,
    ) -> Result<Box<HttpPeer>> {
        if self.peers.is_empty() {
            return Err(Error::explain(
                pingora::ErrorType::ConnectNoRoute,
                "no upstream configured",
            ));
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.peers.len();
        Ok(Box::new(self.peers[i].clone()))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        // Append the hop we saw (the TCP peer) to the chain, as nginx's
        // $proxy_add_x_forwarded_for does; every earlier line is folded into one.
        if let Some(peer) = ctx.peer.map(crate::descriptor::canonical_ip) {
            let value = forwarded_for_upstream(&upstream_request.headers, peer);
            upstream_request.insert_header("X-Forwarded-For", value)?;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if ctx.add_headers.is_empty() {
            return Ok(());
        }
        // Rebuilt from its parts: inserting into Pingora's header would parse and allocate
        // every custom name again and keep a second, case-preserving map in step. The
        // upstream's header names go out in canonical form (well-known names Title-Case,
        // others lower-case), as Envoy sends them.
        let custom_reason = upstream_response
            .get_reason_phrase()
            .filter(|r| Some(*r) != upstream_response.status.canonical_reason())
            .map(str::to_string);
        let placeholder = ResponseHeader::build_no_case(200, Some(0))?;
        let mut parts: http::response::Parts =
            std::mem::replace(upstream_response, placeholder).into();
        parts.headers.reserve(ctx.add_headers.len());
        for (name, value) in std::mem::take(&mut ctx.add_headers) {
            parts.headers.insert(name, value);
        }
        *upstream_response = ResponseHeader::from(parts);
        if custom_reason.is_some() {
            upstream_response.set_reason_phrase(custom_reason.as_deref())?;
        }
        Ok(())
    }

    async fn logging(&self, _session: &mut Session, _e: Option<&Error>, _ctx: &mut Self::CTX) {
        // The response is done: the connection may now idle until its next request.
        super::conn::response_done(self.gateway.config.keepalive_timeout);
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        _ctx: &mut Self::CTX,
    ) -> FailToProxy {
        let code = match e.etype() {
            pingora::ErrorType::HTTPStatus(code) => *code,
            _ => match e.esource() {
                pingora::ErrorSource::Upstream => 502,
                pingora::ErrorSource::Downstream => 0,
                _ => 500,
            },
        };
        if code == 502 {
            tracing::warn!(error = %e, "upstream unavailable");
            let _ = respond(
                session,
                502,
                HeaderList::new(),
                "Bad Gateway: the upstream is unavailable\n",
            )
            .await;
        } else if code > 0 {
            let _ = session.respond_error(code).await;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }
}
