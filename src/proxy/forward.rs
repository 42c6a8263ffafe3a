//! The forwarding headers on a proxied request and a route's header rules, applied to Pingora's
//! headers (what they are and how rules compile: [`crate::request::forwarding`]).
//!
//! Towards the upstream, by default: `X-Forwarded-Proto` (`http` or `https`, as the client
//! connected), `X-Forwarded-Host` (the host the client asked for) and `X-Forwarded-Port` (the
//! port it connected to); with `"forwarded": true` in the gateway file, an RFC 7239 `Forwarded`
//! element too. What a client sent under these names is kept only when it comes from a
//! `--trusted-proxy` (the proxy in front said it); from anyone else it is replaced, and an
//! incoming `Forwarded` is dropped, so an application never reads a scheme or host a client
//! made up. Then the route's `request_headers` rules; its `response_headers` rules apply to
//! the upstream's response.

use crate::request::forwarding::{forwarded_element, HeaderRules, RouteHeaders, Variables};
use http::HeaderValue;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::Session;
use pingora::Result;
use std::net::IpAddr;
use std::sync::Arc;

// Parsed once, each with the spelling it has on an HTTP/1 wire (lower case, as HTTP/2 and Envoy
// send every name), and inserted through the carried pingora-http's `insert_header_parsed`:
// Pingora's `insert_header` would parse the name and copy it to the heap on every request.
static X_FORWARDED_FOR: (&http::HeaderName, &str) =
    (&crate::service::X_FORWARDED_FOR, "X-Forwarded-For");
static X_FORWARDED_PROTO: (http::HeaderName, &str) = (
    http::HeaderName::from_static("x-forwarded-proto"),
    "x-forwarded-proto",
);
static X_FORWARDED_HOST: (http::HeaderName, &str) = (
    http::HeaderName::from_static("x-forwarded-host"),
    "x-forwarded-host",
);
static X_FORWARDED_PORT: (http::HeaderName, &str) = (
    http::HeaderName::from_static("x-forwarded-port"),
    "x-forwarded-port",
);
static FORWARDED: &str = "Forwarded";

/// What the forwarding headers take from the connection alone, made once per connection (each
/// header value is then a reference-count increment, not a format, an allocation and a check).
#[derive(Clone, Default)]
pub struct ConnectionValues {
    /// The TCP peer as text: `X-Forwarded-For`'s last hop (and all of it when the client sent
    /// none).
    pub peer: Option<HeaderValue>,
    /// `X-Forwarded-Port`: the port the client connected to.
    pub port: Option<HeaderValue>,
    /// The client connected over TLS.
    pub tls: bool,
}

impl ConnectionValues {
    /// Worked out from the session (on a connection's first request).
    pub fn of(session: &Session, peer: Option<IpAddr>) -> ConnectionValues {
        let peer = peer.and_then(|ip| {
            let mut text = String::with_capacity(39);
            crate::telemetry::log_line::push_ip(
                &mut text,
                crate::request::descriptor::canonical_ip(ip),
            );
            HeaderValue::from_str(&text).ok()
        });
        let port = session
            .server_addr()
            .and_then(|a| a.as_inet())
            .map(|local| HeaderValue::from(local.port()));
        let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
        ConnectionValues { peer, port, tls }
    }
}

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

/// What the client's request header already holds that the forwarding headers depend on.
struct Sent {
    /// The first `Host` line.
    host: Option<HeaderValue>,
    /// An `X-Forwarded-For` line.
    forwarded_for: bool,
    /// A `Forwarded` line.
    forwarded: bool,
    /// An `X-Forwarded-Proto`, `-Host` or `-Port` line (or, past [`WALK_AT_MOST`] headers,
    /// perhaps one: not looked up).
    forwarding: bool,
}

/// Headers up to which one walk over a request's lines is cheaper than three lookups by name
/// (each hashes its name).
const WALK_AT_MOST: usize = 12;

impl Sent {
    fn of(req: &RequestHeader) -> Sent {
        let headers = &req.headers;
        if headers.len() > WALK_AT_MOST {
            return Sent {
                host: host_of(req),
                forwarded_for: headers.contains_key(X_FORWARDED_FOR.0),
                forwarded: headers.contains_key(http::header::FORWARDED),
                forwarding: true,
            };
        }
        let mut sent = Sent {
            host: None,
            forwarded_for: false,
            forwarded: false,
            forwarding: false,
        };
        for (name, value) in headers {
            if name == http::header::HOST {
                if sent.host.is_none() {
                    sent.host = Some(value.clone());
                }
            } else if name == X_FORWARDED_FOR.0 {
                sent.forwarded_for = true;
            } else if name == http::header::FORWARDED {
                sent.forwarded = true;
            } else if name == X_FORWARDED_PROTO.0
                || name == X_FORWARDED_HOST.0
                || name == X_FORWARDED_PORT.0
            {
                sent.forwarding = true;
            }
        }
        if let Some(authority) = req.uri.authority() {
            sent.host = HeaderValue::from_str(authority.as_str()).ok();
        }
        sent
    }
}

/// `X-Forwarded-For` towards the upstream: every line the client side sent, folded into one
/// (byte for byte: a line that is not text must not make the chain disappear), then `peer`,
/// as nginx's `$proxy_add_x_forwarded_for` does.
fn forwarded_for_upstream(headers: &http::HeaderMap, peer: IpAddr) -> Vec<u8> {
    let mut value = Vec::with_capacity(64);
    for line in headers.get_all(&crate::service::X_FORWARDED_FOR) {
        value.extend_from_slice(line.as_bytes());
        value.extend_from_slice(b", ");
    }
    let mut peer_text = String::with_capacity(39);
    crate::telemetry::log_line::push_ip(&mut peer_text, peer);
    value.extend_from_slice(peer_text.as_bytes());
    value
}

/// Sets the forwarding headers (`X-Forwarded-For`, `-Proto`, `-Host`, `-Port`, and `Forwarded`
/// when asked for) on the client's request header, which Pingora copies for each attempt to
/// reach an upstream. `peer`: the TCP peer. `lines`: the request goes to its upstream over
/// HTTP/1 with no `request_headers` rule to read or change these headers, so when the client
/// sent none of them they may go as header lines after the client's own (the carried
/// pingora-http's `append_h1_lines`: no header map work, the same bytes on the wire).
pub fn to_request(
    conn: &ConnectionValues,
    req: &mut RequestHeader,
    fwd: &Forwarding,
    peer: Option<IpAddr>,
    lines: bool,
) -> Result<()> {
    let sent = Sent::of(req);
    let proto = if conn.tls { "https" } else { "http" };
    if lines && !sent.forwarded_for && !sent.forwarding && (peer.is_none() || conn.peer.is_some()) {
        let mut buf = Vec::with_capacity(128);
        let mut line = |wire: &str, value: &[u8]| {
            buf.extend_from_slice(wire.as_bytes());
            buf.extend_from_slice(b": ");
            buf.extend_from_slice(value);
            buf.extend_from_slice(b"\r\n");
        };
        if let (Some(_), Some(text)) = (peer, &conn.peer) {
            line(X_FORWARDED_FOR.1, text.as_bytes());
        }
        line(X_FORWARDED_PROTO.1, proto.as_bytes());
        if let Some(host) = &sent.host {
            line(X_FORWARDED_HOST.1, host.as_bytes());
        }
        if let Some(port) = &conn.port {
            line(X_FORWARDED_PORT.1, port.as_bytes());
        }
        req.append_h1_lines(buf);
        return forwarded_to_request(req, fwd, peer, sent, proto);
    }
    // Append the hop we saw (the TCP peer) to the chain; every earlier line is folded into
    // one. Without a chain, the peer's text made once for the connection is the value.
    if let Some(peer) = peer.map(crate::request::descriptor::canonical_ip) {
        match &conn.peer {
            Some(text) if !sent.forwarded_for => {
                req.insert_header_parsed(X_FORWARDED_FOR.0, X_FORWARDED_FOR.1, text.clone());
            }
            _ => {
                let value = forwarded_for_upstream(&req.headers, peer);
                req.insert_header("X-Forwarded-For", value)?;
            }
        }
    }
    let keep = |req: &RequestHeader, name: &http::HeaderName| {
        fwd.peer_trusted && req.headers.contains_key(name)
    };
    let (name, wire) = &X_FORWARDED_PROTO;
    if !keep(req, name) {
        req.insert_header_parsed(name, wire, HeaderValue::from_static(proto));
    }
    let (name, wire) = &X_FORWARDED_HOST;
    if !keep(req, name) {
        match &sent.host {
            Some(host) => req.insert_header_parsed(name, wire, host.clone()),
            None => {
                req.remove_header(name);
            }
        }
    }
    let (name, wire) = &X_FORWARDED_PORT;
    if !keep(req, name) {
        match &conn.port {
            Some(port) => req.insert_header_parsed(name, wire, port.clone()),
            None => {
                req.remove_header(name);
            }
        }
    }
    forwarded_to_request(req, fwd, peer, sent, proto)
}

/// `Forwarded` towards the upstream, when the gateway file asks for it; a client's dropped.
fn forwarded_to_request(
    req: &mut RequestHeader,
    fwd: &Forwarding,
    peer: Option<IpAddr>,
    sent: Sent,
    proto: &str,
) -> Result<()> {
    if fwd.forwarded {
        let host = sent.host.as_ref().and_then(|h| h.to_str().ok());
        let element = forwarded_element(peer, host, proto);
        let mut value = Vec::with_capacity(element.len() + 64);
        if fwd.peer_trusted {
            for line in req.headers.get_all(FORWARDED) {
                value.extend_from_slice(line.as_bytes());
                value.extend_from_slice(b", ");
            }
        }
        value.extend_from_slice(element.as_bytes());
        req.insert_header(FORWARDED, value)?;
    } else if !fwd.peer_trusted && sent.forwarded {
        req.remove_header(&http::header::FORWARDED);
    }
    Ok(())
}

/// Applies the route's `request_headers` rules to the request to the upstream (after the
/// forwarding headers, so a rule may replace or remove them). `client`: what `${client_addr}`
/// stands for; `access_id`: the access log's request ID.
pub fn apply_request_rules(
    session: &Session,
    req: &mut RequestHeader,
    fwd: &Forwarding,
    client: Option<IpAddr>,
    access_id: Option<&str>,
) -> Result<()> {
    let Some(rules) = fwd.rules.as_deref().filter(|r| !r.request.is_empty()) else {
        return Ok(());
    };
    let host = host_of(session.req_header());
    let vars = Variables {
        client_addr: client,
        request_id: access_id.or(fwd.request_id.as_deref()),
        host: host.as_ref().and_then(|h| h.to_str().ok()),
    };
    apply_to_request(req, &rules.request, &vars)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A short header is walked once, a long one looked up by name: both read the same
    /// `Host`, `X-Forwarded-For` and `Forwarded` (a client's `Forwarded` dropped, its chain
    /// extended).
    #[test]
    fn short_and_long_headers_are_read_alike() {
        let conn = ConnectionValues {
            peer: Some(HeaderValue::from_static("203.0.113.7")),
            port: Some(HeaderValue::from_static("80")),
            tls: false,
        };
        let peer: IpAddr = "203.0.113.7".parse().unwrap();
        for (padding, lines) in [
            (0, false),
            (0, true),
            (WALK_AT_MOST, false),
            (WALK_AT_MOST, true),
        ] {
            let mut req = RequestHeader::build("GET", b"/", None).unwrap();
            req.append_header("Host", "a.example").unwrap();
            req.append_header("Host", "b.example").unwrap();
            req.append_header("X-Forwarded-For", "198.51.100.1")
                .unwrap();
            req.append_header("Forwarded", "for=x").unwrap();
            for i in 0..padding {
                req.append_header(format!("x-pad-{i}"), "1").unwrap();
            }
            // A client's chain is extended in the map, lines or not.
            to_request(&conn, &mut req, &Forwarding::default(), Some(peer), lines).unwrap();
            assert!(req.h1_lines().is_empty());
            let value = |name: &str| {
                req.headers
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_string())
            };
            assert_eq!(
                value("x-forwarded-host").as_deref(),
                Some("a.example"),
                "{padding}"
            );
            assert_eq!(
                value("x-forwarded-for").as_deref(),
                Some("198.51.100.1, 203.0.113.7"),
                "{padding}"
            );
            assert_eq!(value("forwarded"), None, "{padding}");
        }
    }

    /// The forwarding headers go out as they always did on an HTTP/1 wire, each once, whether a
    /// client's copies were there or not (the carried pingora-http's `insert_header_parsed`
    /// keeps the name map and the value map in step, as `insert_header` does).
    #[test]
    fn forwarding_headers_reach_the_wire_with_their_spelling() {
        let mut req = RequestHeader::build("GET", b"/v1/orders", None).unwrap();
        req.insert_header("Host", "api.example.com").unwrap();
        req.insert_header("X-Forwarded-Proto", "gopher").unwrap();
        let conn = ConnectionValues {
            peer: Some(HeaderValue::from_static("203.0.113.7")),
            port: Some(HeaderValue::from_static("8443")),
            tls: true,
        };
        let peer: IpAddr = "203.0.113.7".parse().unwrap();
        // A client's `X-Forwarded-Proto` is replaced in the map, lines or not.
        to_request(&conn, &mut req, &Forwarding::default(), Some(peer), true).unwrap();
        assert!(req.h1_lines().is_empty());
        let mut wire = Vec::new();
        req.header_to_h1_wire(&mut wire);
        assert_eq!(
            String::from_utf8(wire).unwrap(),
            "Host: api.example.com\r\n\
             x-forwarded-proto: https\r\n\
             X-Forwarded-For: 203.0.113.7\r\n\
             x-forwarded-host: api.example.com\r\n\
             x-forwarded-port: 8443\r\n"
        );
    }

    /// A request that sent none of the forwarding headers gets them as lines, with the bytes
    /// the map would have written, and a `Forwarded` asked for after them.
    #[test]
    fn forwarding_lines_are_the_bytes_the_map_writes() {
        let peer: IpAddr = "2001:db8::7".parse().unwrap();
        for (tls, host, port, forwarded) in [
            (false, Some("api.example"), Some("8080"), false),
            (true, None, Some("443"), true),
            (false, Some("a"), None, true),
        ] {
            let conn = ConnectionValues {
                peer: Some(HeaderValue::from_static("2001:db8::7")),
                port: port.map(HeaderValue::from_static),
                tls,
            };
            let fwd = Forwarding {
                forwarded,
                ..Forwarding::default()
            };
            let wire = |lines: bool| {
                let mut req = RequestHeader::build("GET", b"/v1/orders", None).unwrap();
                req.append_header("User-Agent", "t/1").unwrap();
                if let Some(host) = host {
                    req.insert_header("Host", host).unwrap();
                }
                to_request(&conn, &mut req, &fwd, Some(peer), lines).unwrap();
                assert_eq!(req.h1_lines().is_empty(), !lines);
                let mut wire = Vec::new();
                req.header_to_h1_wire(&mut wire);
                String::from_utf8(wire).unwrap()
            };
            let from_map = wire(false);
            assert_eq!(wire(true), from_map);
            let proto = if tls { "https" } else { "http" };
            assert!(
                from_map.contains(&format!(
                    "X-Forwarded-For: 2001:db8::7\r\nx-forwarded-proto: {proto}\r\n"
                )),
                "{from_map}"
            );
            assert_eq!(
                from_map.contains("Forwarded: for="),
                forwarded,
                "{from_map}"
            );
        }
    }
}
