//! The wire bytes of a response the gateway answers itself over HTTP/1 (a refusal, a 404, a
//! 431...): its status line and header lines rendered straight from the header list, exactly as
//! Pingora serializes the same response from a header map, without building that map (two maps
//! with Pingora's case-preserving names) or serializing it again. Pingora then adds `Date` and
//! `Connection` as it does to every response (`write_response_header_prerendered`, the carried
//! patch `0006` in `vendor/`).

use crate::engine::headers::{self, HeaderConfig, HeaderLines, HeaderList};
use http::{header, HeaderName, StatusCode};

/// The default `Content-Type` of the gateway's own answers.
pub const DEFAULT_CONTENT_TYPE: &[u8] = b"text/plain; charset=utf-8";

/// How Pingora spells a header name on the HTTP/1 wire when the response carries no
/// case-preserved names (as the gateway's own answers don't): a handful of standard names
/// title-cased, every other name as `http` stores it (lower case).
fn wire_name(name: &HeaderName) -> &str {
    match *name {
        header::ACCEPT_RANGES => "Accept-Ranges",
        header::AGE => "Age",
        header::CACHE_CONTROL => "Cache-Control",
        header::CONNECTION => "Connection",
        header::CONTENT_TYPE => "Content-Type",
        header::CONTENT_ENCODING => "Content-Encoding",
        header::CONTENT_LENGTH => "Content-Length",
        header::DATE => "Date",
        header::TRANSFER_ENCODING => "Transfer-Encoding",
        header::HOST => "Host",
        header::SERVER => "Server",
        header::SET_COOKIE => "Set-Cookie",
        _ => name.as_str(),
    }
}

/// The names a refusal written from [`HeaderLines`] carries besides its reason and warning
/// headers: the decision's own and what [`render_lines_head`] adds.
static REFUSAL_NAMES: [&HeaderName; 9] = [
    &headers::RATELIMIT_POLICY,
    &headers::RATELIMIT,
    &headers::RATELIMIT_LIMIT,
    &headers::RATELIMIT_REMAINING,
    &headers::RATELIMIT_RESET,
    &header::RETRY_AFTER,
    &header::CONTENT_TYPE,
    &header::CONTENT_LENGTH,
    &X_REQUEST_ID,
];

/// The request's ID header on the gateway's own answers.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Whether refusals can be written from their [`HeaderLines`] with the same bytes as from a
/// list: the reason and warning headers are spelled on the wire as `http` stores them, and no
/// name of a refusal appears twice (a header map would write the two values together).
pub fn lines_fit(config: &HeaderConfig) -> bool {
    let own =
        |name: &HeaderName| wire_name(name) == name.as_str() && !REFUSAL_NAMES.contains(&name);
    own(&config.reason_header)
        && own(&config.warning_header)
        && config.reason_header != config.warning_header
}

/// `HTTP/1.1 429 Too Many Requests` and CRLF (no reason phrase for a status without one).
fn status_line(buf: &mut Vec<u8>, status: StatusCode) {
    buf.extend_from_slice(b"HTTP/1.1 ");
    buf.extend_from_slice(status.as_str().as_bytes());
    buf.push(b' ');
    if let Some(reason) = status.canonical_reason() {
        buf.extend_from_slice(reason.as_bytes());
    }
    buf.extend_from_slice(b"\r\n");
}

fn line(buf: &mut Vec<u8>, name: &str, value: &[u8]) {
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b": ");
    buf.extend_from_slice(value);
    buf.extend_from_slice(b"\r\n");
}

/// The status line and header lines (without the blank line that ends the block) of a
/// response with `headers` in order, `Content-Type` added when the list has none, and
/// `Content-Length: content_length` last. Headers of one name are written together at the place
/// of the first, as a header map iterates them. `None` when the list carries its own
/// `Content-Length` (the caller then writes the response the general way).
pub fn render_head(
    status: StatusCode,
    headers: &HeaderList,
    content_length: usize,
) -> Option<Vec<u8>> {
    if headers
        .iter()
        .any(|(name, _)| *name == header::CONTENT_LENGTH)
    {
        return None;
    }
    // `Vec`'s copies inline; `BytesMut::put_slice` is a call per piece (40 a refusal).
    let mut buf = Vec::with_capacity(320);
    status_line(&mut buf, status);
    let mut has_content_type = false;
    for (i, (name, value)) in headers.iter().enumerate() {
        // A later value of a name already written went out with the first.
        if headers[..i].iter().any(|(earlier, _)| earlier == name) {
            continue;
        }
        has_content_type |= *name == header::CONTENT_TYPE;
        let spelled = wire_name(name);
        line(&mut buf, spelled, value.as_bytes());
        for (_, later) in headers[i + 1..].iter().filter(|(n, _)| n == name) {
            line(&mut buf, spelled, later.as_bytes());
        }
    }
    if !has_content_type {
        line(&mut buf, "Content-Type", DEFAULT_CONTENT_TYPE);
    }
    line(
        &mut buf,
        "Content-Length",
        itoa::Buffer::new().format(content_length).as_bytes(),
    );
    Some(buf)
}

/// [`render_head`] for a refusal whose headers were written as lines ([`HeaderLines`]): the
/// status line, the lines as they are, then the request's ID when given, `Content-Type` and
/// `Content-Length`. The same bytes as [`render_head`] gives for the same headers as a list,
/// when [`lines_fit`] holds.
pub fn render_lines_head(
    status: u16,
    lines: &HeaderLines,
    request_id: Option<(&HeaderName, &[u8])>,
    content_type: &str,
    content_length: usize,
) -> Vec<u8> {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let lines = lines.as_bytes();
    let mut buf = Vec::with_capacity(lines.len() + 160);
    status_line(&mut buf, status);
    buf.extend_from_slice(lines);
    if let Some((name, id)) = request_id {
        line(&mut buf, wire_name(name), id);
    }
    line(&mut buf, "Content-Type", content_type.as_bytes());
    line(
        &mut buf,
        "Content-Length",
        itoa::Buffer::new().format(content_length).as_bytes(),
    );
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use http::HeaderValue;
    use pingora::http::ResponseHeader;

    /// What Pingora writes for the same response built the general way (`respond`'s map).
    fn pingora_head(status: StatusCode, headers: &HeaderList, content_length: usize) -> Vec<u8> {
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.status = status;
        for (name, value) in headers.clone() {
            parts.headers.append(name, value);
        }
        if !parts.headers.contains_key(header::CONTENT_TYPE) {
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
        }
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(content_length));
        let response = ResponseHeader::from(parts);
        let mut buf = BytesMut::new();
        let reason = response.get_reason_phrase().unwrap_or("");
        buf.put_slice(format!("HTTP/1.1 {} {reason}\r\n", response.status.as_str()).as_bytes());
        response.header_to_h1_wire(&mut buf);
        buf.to_vec()
    }

    /// The decision's headers of a refusal by a rule named `deny`.
    const DENY_REFUSAL: [(&str, &str); 7] = [
        ("ratelimit-policy", "\"deny\";q=1;w=1000000"),
        ("ratelimit", "\"deny\";r=0;t=1000000"),
        ("ratelimit-limit", "1"),
        ("ratelimit-remaining", "0"),
        ("ratelimit-reset", "1000000"),
        ("retry-after", "1372291"),
        ("x-tollgate-reason", "token_bucket_exceeded"),
    ];

    fn list(items: &[(&'static str, &'static str)]) -> HeaderList {
        items
            .iter()
            .map(|(n, v)| (HeaderName::from_static(n), HeaderValue::from_static(v)))
            .collect()
    }

    #[test]
    fn renders_what_pingora_writes_for_the_same_response() {
        let cases = [
            (
                StatusCode::TOO_MANY_REQUESTS,
                list(
                    &[
                        &DENY_REFUSAL[..],
                        &[
                            ("x-request-id", "req-42"),
                            ("content-type", "text/plain; charset=utf-8"),
                        ],
                    ]
                    .concat(),
                ),
                17,
            ),
            // No Content-Type: the default is added; names of Pingora's title-cased set.
            (
                StatusCode::NOT_FOUND,
                list(&[("cache-control", "no-store"), ("server", "x"), ("age", "1")]),
                9,
            ),
            // Values of one name written together where the name first appears.
            (
                StatusCode::SERVICE_UNAVAILABLE,
                list(&[
                    ("x-a", "1"),
                    ("set-cookie", "a=1"),
                    ("x-b", "2"),
                    ("x-a", "3"),
                    ("set-cookie", "b=2"),
                    ("content-type", "application/json"),
                ]),
                0,
            ),
            // A status without a canonical reason phrase.
            (StatusCode::from_u16(599).unwrap(), list(&[]), 3),
        ];
        for (status, headers, length) in cases {
            let ours = render_head(status, &headers, length).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&ours),
                String::from_utf8_lossy(&pingora_head(status, &headers, length)),
                "{status}"
            );
        }
    }

    /// A refusal written from its lines is byte for byte the refusal written from its list,
    /// with and without the request's ID.
    #[test]
    fn lines_render_as_their_list_does() {
        let decision = list(&DENY_REFUSAL);
        let lines = HeaderLines::from_list(&decision);
        for id in [None, Some("req-42")] {
            let mut headers = decision.clone();
            if let Some(id) = id {
                headers.push((X_REQUEST_ID.clone(), HeaderValue::from_static(id)));
            }
            headers.push((
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ));
            let ours = render_lines_head(
                429,
                &lines,
                id.map(|id| (&X_REQUEST_ID, id.as_bytes())),
                "application/json",
                17,
            );
            assert_eq!(
                String::from_utf8_lossy(&ours),
                String::from_utf8_lossy(&pingora_head(StatusCode::TOO_MANY_REQUESTS, &headers, 17))
            );
        }
    }

    /// Lines are used only with reason and warning headers spelled as stored and not already
    /// among a refusal's names.
    #[test]
    fn lines_fit_only_names_written_as_they_are() {
        assert!(lines_fit(&HeaderConfig::default()));
        assert!(lines_fit(&HeaderConfig::new("X-Why").unwrap()));
        for name in [
            "Server",
            "Retry-After",
            "x-request-id",
            "Content-Type",
            "RateLimit",
            "x-tollgate-warning",
        ] {
            assert!(!lines_fit(&HeaderConfig::new(name).unwrap()), "{name}");
        }
    }

    #[test]
    fn a_list_with_its_own_content_length_is_left_to_pingora() {
        let headers = list(&[("content-length", "3")]);
        assert!(render_head(StatusCode::OK, &headers, 3).is_none());
    }
}
