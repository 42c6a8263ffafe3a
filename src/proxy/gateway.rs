//! The reverse proxy: `request_filter` builds [`RequestFacts`] and asks the gateway; a refusal is
//! answered here and never reaches the upstream; an allowed request is proxied round-robin and
//! the rate-limit headers are added to the upstream's response.

use crate::descriptor::{normalize_path, RequestFacts};
use crate::headers::HeaderList;
use crate::service::{Gateway, HttpHeaders, Step};
use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
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

/// Every `X-Forwarded-For` line, joined: a proxy may add its own line rather than append to
/// the client's, and reading only the first line would let the client pick its address.
pub(crate) fn forwarded_for(headers: &http::HeaderMap) -> Option<std::borrow::Cow<'_, str>> {
    let mut lines = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok());
    let first = lines.next()?;
    match lines.next() {
        None => Some(std::borrow::Cow::Borrowed(first)),
        Some(second) => {
            let mut joined = format!("{first}, {second}");
            for line in lines {
                joined.push_str(", ");
                joined.push_str(line);
            }
            Some(std::borrow::Cow::Owned(joined))
        }
    }
}

/// Writes a complete response from the gateway itself.
async fn respond(
    session: &mut Session,
    status: u16,
    headers: &HeaderList,
    body: &'static str,
) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(headers.len() + 2))?;
    for (name, value) in headers {
        resp.insert_header(*name, value.as_str())?;
    }
    resp.insert_header("Content-Type", "text/plain; charset=utf-8")?;
    resp.insert_header("Content-Length", body.len().to_string())?;
    session.write_response_header(Box::new(resp), false).await?;
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

    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|sa| sa.ip());
        // Decide synchronously; nothing borrowed from the request lives across an await.
        let step = {
            let req = session.req_header();
            let headers = HttpHeaders(&req.headers);
            let forwarded = forwarded_for(&req.headers);
            let client_ip = self.gateway.client_ip(peer, forwarded.as_deref());
            ctx.peer = peer;
            let host = req
                .headers
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
                .or_else(|| req.uri.authority().map(|a| a.as_str()));
            let claims = self.gateway.claims(&headers);
            let path = normalize_path(req.uri.path());
            let facts = RequestFacts {
                method: req.method.as_str(),
                path: &path,
                query: req.uri.query(),
                host,
                client_ip,
                headers: &headers,
                claims: claims.as_deref(),
            };
            self.gateway.begin(&facts)
        };
        // With a shared store, the store call happens here, after the borrowed facts are gone.
        let (decision, response) = match step {
            Step::Ready(answer) => answer,
            Step::Remote(pending) => self.gateway.complete(pending).await,
        };
        let allowed = decision.is_allowed();
        drop(decision);
        if allowed {
            // No policy loaded: the proxy fails open (the decision service answers 503).
            ctx.add_headers = response.headers;
            return Ok(false);
        }
        respond(
            session,
            response.status,
            &response.headers,
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
            let value = match forwarded_for(&upstream_request.headers) {
                Some(chain) => format!("{chain}, {peer}"),
                None => peer.to_string(),
            };
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
        for (name, value) in std::mem::take(&mut ctx.add_headers) {
            upstream_response.insert_header(name, value)?;
        }
        Ok(())
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
                &HeaderList::new(),
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
