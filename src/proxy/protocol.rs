//! HTTP duties of the proxy that Pingora 0.9 leaves to the application: the gateway's own
//! request-header limits (431 past them), the request line's and `Host`'s shape
//! ([`well_formed`]: 400 for what an upstream could read differently), the host and target a
//! request is matched by ([`host_and_target`]), `Expect: 100-continue` answered here once a
//! request is admitted (the upstream gets the request without it), HTTP/1.0 clients (never a
//! `Transfer-Encoding` towards them; a `Host` for the upstream when they sent none), and a
//! refused request's small unread body read and discarded so its connection stays open.
//!
//! Each duty is one function the proxy's hooks call; the per-request work on the common path
//! (a request with a `Host`, no `Expect`, admitted) is a few header-map lookups.

use crate::config::{HeaderLimit, HeaderLimits};
use crate::request::syntax::{self, Malformed, RequestLine};
use pingora::http::authority::raw_target_authority;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::Session;
use std::net::SocketAddr;
use std::time::Duration;

/// The body of the gateway's 431.
pub const HEADER_TOO_LARGE: &str =
    "Request Header Fields Too Large: the request's header block is over the gateway's limit\n";

/// Largest unread body of a refused request that is read and discarded so that its connection
/// stays open (nginx does the same); a larger or chunked one closes the connection.
pub const DISCARDED_BODY_BYTES: usize = 64 * 1024;

/// The limit the session's request passed, if any ([`HeaderLimits::passed`]): its header block
/// counted as HTTP/1.1 writes it (request line, `name: value` and line ends), whatever the
/// protocol it came in (HTTP/2 has no such block; on HTTP/1.x, optional spaces around values
/// are not counted). A walk over the header map: cheaper than taking a slice of Pingora's
/// buffer.
pub fn limit_passed(limits: HeaderLimits, session: &Session) -> Option<HeaderLimit> {
    let req = session.req_header();
    limits.passed(http1_size(req), req.headers.len())
}

/// Whether the request's method, target and `Host` (or `:authority`) are of the shapes
/// [`crate::request::syntax`] accepts. Origin-form targets (nearly all) cost a first-byte
/// test; only another form is parsed for its authority.
///
/// # Errors
/// What is wrong with the request.
pub fn well_formed(req: &RequestHeader) -> Result<(), Malformed> {
    let target = req.raw_path();
    let authority = req
        .uri
        .authority()
        .map(|a| a.as_str().as_bytes())
        .or_else(|| {
            (target.first() != Some(&b'/'))
                .then(|| raw_target_authority(target).authority())
                .flatten()
        });
    syntax::check(
        RequestLine {
            method: req.method.as_str().as_bytes(),
            target,
            http11: req.version == http::Version::HTTP_11,
            authority,
        },
        req.headers
            .get_all(http::header::HOST)
            .iter()
            .map(http::HeaderValue::as_bytes),
    )
}

/// The request's host (an HTTP/2 `:authority` first, then the `Host` header, then an
/// absolute-form target's authority, which Pingora has checked equals `Host` when both are
/// sent) and its target as matched (the path and query; for an absolute-form target, the part
/// after its authority).
pub fn host_and_target(req: &RequestHeader) -> (Option<&str>, &str) {
    let host = req
        .uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| {
            req.headers
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
        })
        .or_else(|| {
            raw_target_authority(req.raw_path())
                .authority()
                .and_then(|a| std::str::from_utf8(a).ok())
        });
    let target = req
        .uri
        .path_and_query()
        .map_or_else(|| req.uri.path(), |pq| pq.as_str());
    (host, target)
}

/// A request header's size written as HTTP/1.1: request line, then `name: value\r\n` per line,
/// then the blank line.
fn http1_size(req: &RequestHeader) -> usize {
    let target = req
        .uri
        .path_and_query()
        .map_or_else(|| req.uri.path().len(), |pq| pq.as_str().len());
    let request_line = req.method.as_str().len() + 1 + target + " HTTP/1.1\r\n".len();
    req.headers
        .iter()
        .fold(request_line + 2, |n, (name, value)| {
            n + name.as_str().len() + 2 + value.len() + 2
        })
}

/// A request body's declared `Content-Length`, when it has one (the proxy and the decision
/// service bound the bodies they read by it before reading).
pub fn declared_length(req: &RequestHeader) -> Option<usize> {
    req.headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
}

/// Whether the request carries `Expect: 100-continue` (checked before calling
/// [`continue_if_expected`], whose future is only built, boxed, for the requests that do).
pub fn expects_continue(req: &RequestHeader) -> bool {
    req.headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Answers `Expect: 100-continue` for a request the gateway goes on with (admitted, or whose
/// body a rule needs to decide): the client is told to send its body now instead of waiting its
/// own timer, and the expectation is removed, so the upstream gets the request without it (an
/// upstream that ignores `Expect` would otherwise wait for a body the client holds back). An
/// HTTP/1.0 client is never sent a 1xx (RFC 9110 §15.2); a request without a body gets none.
///
/// # Errors
/// The 100 could not be written to the client.
pub async fn continue_if_expected(session: &mut Session) -> pingora::Result<()> {
    if !expects_continue(session.req_header()) {
        return Ok(());
    }
    let http10 = session.req_header().version == http::Version::HTTP_10;
    if !http10 && !session.is_body_empty() && !session.is_body_done() {
        session.write_continue_response().await?;
    }
    session
        .req_header_mut()
        .remove_header(&http::header::EXPECT);
    Ok(())
}

/// Before the gateway answers a request itself (a refusal, a 404, a 431): an HTTP/1.1 body of
/// declared length up to [`DISCARDED_BODY_BYTES`] that the client is sending is read and
/// discarded after the response, within `drain`, so the connection stays open for its next
/// request. A larger or chunked body, or one still held back for a `100 Continue` the gateway
/// never sends, closes the connection after the response, as Pingora does by default.
pub fn keep_connection_for_small_body(session: &mut Session, drain: Duration) {
    if session.is_http2() {
        return;
    }
    let req = session.req_header();
    // Most refused requests carry no body: one lookup decides.
    match declared_length(req) {
        Some(n) if n > 0 && n <= DISCARDED_BODY_BYTES => {}
        _ => return,
    }
    if req.headers.contains_key(http::header::TRANSFER_ENCODING) || expects_continue(req) {
        return;
    }
    let downstream = session.as_downstream_mut();
    downstream.set_close_on_response_before_downstream_finish(false);
    downstream.set_total_drain_timeout(Some(drain));
}

/// An HTTP/1.0 client cannot read chunked framing (RFC 9112 §6.1): its response goes without
/// `Transfer-Encoding`, the body (decoded by Pingora) delimited by closing the connection.
pub fn frame_for_client(session: &mut Session, response: &mut ResponseHeader) {
    if session.req_header().version != http::Version::HTTP_10
        || !response
            .headers
            .contains_key(http::header::TRANSFER_ENCODING)
    {
        return;
    }
    response.remove_header(&http::header::TRANSFER_ENCODING);
    // Said in the header too (`Connection: close`), not only by the close.
    session.as_downstream_mut().set_keepalive(None);
}

/// The `Host` the upstream gets when the client sent none (an HTTP/1.0 request may omit it, and
/// Pingora sends every request upstream as HTTP/1.1, where a compliant origin answers 400
/// without one): the absolute-form target's authority when it has one, else the server's name
/// as the gateway addresses it, as nginx's `$proxy_host` — the group's TLS name, else the
/// server's address, without the scheme's default port.
///
/// # Errors
/// The value is not a valid header value (never, for these sources).
pub fn host_for_upstream(
    req: &mut RequestHeader,
    tls_name: Option<&str>,
    server: SocketAddr,
) -> pingora::Result<()> {
    if req.headers.contains_key(http::header::HOST) {
        return Ok(());
    }
    let host = proxy_host(req.uri.authority().map(|a| a.as_str()), tls_name, server);
    req.insert_header(http::header::HOST, host)
}

/// See [`host_for_upstream`].
fn proxy_host(authority: Option<&str>, tls_name: Option<&str>, server: SocketAddr) -> String {
    if let Some(authority) = authority {
        return authority.to_string();
    }
    let (name, default_port) = match tls_name {
        Some(name) => (name.to_string(), 443),
        None => match server {
            SocketAddr::V4(v4) => (v4.ip().to_string(), 80),
            SocketAddr::V6(v6) => (format!("[{}]", v6.ip()), 80),
        },
    };
    if server.port() == default_port {
        name
    } else {
        format!("{name}:{}", server.port())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::cli::{DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADER_LINES};

    #[test]
    fn the_line_limit_is_checked_before_the_byte_limit() {
        let limits = HeaderLimits {
            max_bytes: std::num::NonZeroUsize::new(100).unwrap(),
            max_lines: std::num::NonZeroUsize::new(3).unwrap(),
        };
        assert_eq!(limits.passed(100, 3), None);
        assert_eq!(limits.passed(101, 3), Some(HeaderLimit::Bytes));
        assert_eq!(limits.passed(10, 4), Some(HeaderLimit::Lines));
        assert_eq!(limits.passed(1000, 4), Some(HeaderLimit::Lines));
    }

    /// A 16 KiB cookie, with the usual browser headers, is far inside the defaults.
    #[test]
    fn a_16_kib_cookie_passes_the_defaults() {
        let mut req = RequestHeader::build("GET", b"/v1/orders?page=2", None).unwrap();
        req.insert_header("Host", "api.example.com").unwrap();
        req.insert_header("Cookie", "a".repeat(16 * 1024)).unwrap();
        req.insert_header("User-Agent", "Mozilla/5.0").unwrap();
        let size = http1_size(&req);
        assert_eq!(
            size,
            "GET /v1/orders?page=2 HTTP/1.1\r\n".len()
                + "host: api.example.com\r\n".len()
                + "cookie: \r\n".len()
                + 16 * 1024
                + "user-agent: Mozilla/5.0\r\n".len()
                + 2
        );
        let defaults = HeaderLimits {
            max_bytes: std::num::NonZeroUsize::new(DEFAULT_MAX_HEADER_BYTES).unwrap(),
            max_lines: std::num::NonZeroUsize::new(DEFAULT_MAX_HEADER_LINES).unwrap(),
        };
        assert_eq!(defaults.passed(size, req.headers.len()), None);
    }

    #[test]
    fn the_upstream_host_is_the_target_authority_else_the_server_as_addressed() {
        let v4: SocketAddr = "10.0.0.5:8080".parse().unwrap();
        let v4_80: SocketAddr = "10.0.0.5:80".parse().unwrap();
        let v6: SocketAddr = "[2001:db8::1]:8080".parse().unwrap();
        let tls: SocketAddr = "10.0.0.5:443".parse().unwrap();
        assert_eq!(
            proxy_host(Some("example.com:81"), None, v4),
            "example.com:81"
        );
        assert_eq!(proxy_host(None, None, v4), "10.0.0.5:8080");
        assert_eq!(proxy_host(None, None, v4_80), "10.0.0.5");
        assert_eq!(proxy_host(None, None, v6), "[2001:db8::1]:8080");
        assert_eq!(proxy_host(None, Some("api.internal"), tls), "api.internal");
        assert_eq!(
            proxy_host(None, Some("api.internal"), v4),
            "api.internal:8080"
        );
        // A Host the client sent is kept as it is.
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        req.insert_header("Host", "client.example").unwrap();
        host_for_upstream(&mut req, None, v4).unwrap();
        assert_eq!(req.headers["host"], "client.example");
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        host_for_upstream(&mut req, None, v4).unwrap();
        assert_eq!(req.headers["host"], "10.0.0.5:8080");
    }
}
