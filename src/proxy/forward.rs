//! The forwarding headers on a proxied request and a route's header rules, applied to Pingora's
//! headers (what they are and how rules compile: [`crate::forwarding`]).
//!
//! Towards the upstream, by default: `X-Forwarded-Proto` (`http` or `https`, as the client
//! connected), `X-Forwarded-Host` (the host the client asked for) and `X-Forwarded-Port` (the
//! port it connected to); with `"forwarded": true` in the gateway file, an RFC 7239 `Forwarded`
//! element too. What a client sent under these names is kept only when it comes from a
//! `--trusted-proxy` (the proxy in front said it); from anyone else it is replaced, and an
//! incoming `Forwarded` is dropped, so an application never reads a scheme or host a client
//! made up. Then the route's `request_headers` rules; its `response_headers` rules apply to
//! the upstream's response.

use crate::forwarding::{forwarded_element, HeaderRules, RouteHeaders, Variables};
use http::HeaderValue;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::Session;
use pingora::Result;
use std::net::IpAddr;
use std::sync::Arc;

static X_FORWARDED_PROTO: &str = "X-Forwarded-Proto";
static X_FORWARDED_HOST: &str = "X-Forwarded-Host";
static X_FORWARDED_PORT: &str = "X-Forwarded-Port";
static FORWARDED: &str = "Forwarded";

/// What one request's forwarding needs, gathered in `request_filter`.
#[derive(Default)]
pub struct Forwarding {
    /// The TCP peer is a `--trusted-proxy`: its forwarding headers are kept.
    pub peer_trusted: bool,
    /// The gateway file asks for `Forwarded`.
    pub forwarded: bool,
    /// The rules of the route that chose the group.
    pub rules: Option<Arc<RouteHeaders>>,
    /// The request ID the rules' `${request_id}` stands for, when no access log made one.
    pub request_id: Option<String>,
}

/// The client's host: an absolute target's authority, else `Host`.
fn host_of(req: &RequestHeader) -> Option<HeaderValue> {
    match req.uri.authority() {
        Some(authority) => HeaderValue::from_str(authority.as_str()).ok(),
        None => req.headers.get(http::header::HOST).cloned(),
    }
}

/// Sets the forwarding headers on the request to the upstream, then applies the route's
/// `request_headers` rules. `peer`: the TCP peer; `client`: the address as resolved for
/// limiting (what `${client_addr}` stands for); `access_id`: the access log's request ID.
pub fn to_upstream(
    session: &Session,
    req: &mut RequestHeader,
    fwd: &Forwarding,
    peer: Option<IpAddr>,
    client: Option<IpAddr>,
    access_id: Option<&str>,
) -> Result<()> {
    let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
    let proto = if tls { "https" } else { "http" };
    let host = host_of(req);
    let keep = |req: &RequestHeader, name: &str| fwd.peer_trusted && req.headers.contains_key(name);
    if !keep(req, X_FORWARDED_PROTO) {
        req.insert_header(X_FORWARDED_PROTO, HeaderValue::from_static(proto))?;
    }
    if !keep(req, X_FORWARDED_HOST) {
        match &host {
            Some(host) => req.insert_header(X_FORWARDED_HOST, host.clone())?,
            None => {
                req.remove_header(X_FORWARDED_HOST);
            }
        }
    }
    if !keep(req, X_FORWARDED_PORT) {
        match session.server_addr().and_then(|a| a.as_inet()) {
            Some(local) => {
                let mut digits = itoa::Buffer::new();
                req.insert_header(
                    X_FORWARDED_PORT,
                    HeaderValue::from_str(digits.format(local.port()))
                        .unwrap_or(HeaderValue::from_static("0")),
                )?;
            }
            None => {
                req.remove_header(X_FORWARDED_PORT);
            }
        }
    }
    if fwd.forwarded {
        let element = forwarded_element(peer, host.as_ref().and_then(|h| h.to_str().ok()), proto);
        let mut value = Vec::with_capacity(element.len() + 64);
        if fwd.peer_trusted {
            for line in req.headers.get_all(FORWARDED) {
                value.extend_from_slice(line.as_bytes());
                value.extend_from_slice(b", ");
            }
        }
        value.extend_from_slice(element.as_bytes());
        req.insert_header(FORWARDED, value)?;
    } else if !fwd.peer_trusted && req.headers.contains_key(FORWARDED) {
        req.remove_header(FORWARDED);
    }
    if let Some(rules) = fwd.rules.as_deref().filter(|r| !r.request.is_empty()) {
        let host_text = host.as_ref().and_then(|h| h.to_str().ok());
        let vars = Variables {
            client_addr: client.or(peer),
            request_id: access_id.or(fwd.request_id.as_deref()),
            host: host_text,
        };
        apply_to_request(req, &rules.request, &vars)?;
    }
    Ok(())
}

fn apply_to_request(req: &mut RequestHeader, rules: &HeaderRules, vars: &Variables) -> Result<()> {
    for name in &rules.remove {
        req.remove_header(name);
    }
    for (name, value) in &rules.set {
        if let Some(v) = value.resolve(vars) {
            req.insert_header(name.clone(), v)?;
        }
    }
    for (name, value) in &rules.add {
        if let Some(v) = value.resolve(vars) {
            req.append_header(name.clone(), v)?;
        }
    }
    Ok(())
}

/// Applies the route's `response_headers` rules to the upstream's response.
pub fn to_client(
    resp: &mut ResponseHeader,
    rules: &HeaderRules,
    vars: &Variables<'_>,
) -> Result<()> {
    for name in &rules.remove {
        resp.remove_header(name);
    }
    for (name, value) in &rules.set {
        if let Some(v) = value.resolve(vars) {
            resp.insert_header(name.clone(), v)?;
        }
    }
    for (name, value) in &rules.add {
        if let Some(v) = value.resolve(vars) {
            resp.append_header(name.clone(), v)?;
        }
    }
    Ok(())
}
