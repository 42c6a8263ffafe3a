//! An admitted request's exact bytes, pinned on both sides of the gateway: the request head the
//! upstream reads (request line, every header in its order and spelling, the forwarding headers
//! included) and the response head the client reads (the upstream's headers, the `RateLimit`
//! headers, `X-Request-Id`), through the real binary. Only what varies from run to run is
//! normalised: the gateway's port (`X-Forwarded-Port`), a generated request ID (checked for its
//! form) and the seconds left in the window (checked for their range).

use crate::refusal_bytes::{read_response, take_value};
use crate::support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::Gateway;

/// A thousand tokens per client address, refilled in a thousand million seconds: every request
/// of these tests is admitted, and the count left moves by one a request.
const ALLOW: &str = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"],
  "algorithm": "token_bucket", "algorithm_config": {"rps": 0.000001, "burst": 1000}}]}"#;

/// No rule: admitted without `RateLimit` headers.
const NONE: &str = r#"{"rules": []}"#;

/// What the upstream answers to every request.
const UPSTREAM_RESPONSE: &str = "HTTP/1.1 200 OK\r\n\
    Content-Type: text/plain\r\n\
    X-Upstream: yes\r\n\
    Cache-Control: no-store\r\n\
    Content-Length: 2\r\n\
    \r\n\
    ok";

/// An HTTP/1.1 upstream that records each request head as it arrived, bytes as sent.
fn recording_upstream() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    recording_upstream_answering(UPSTREAM_RESPONSE)
}

/// [`recording_upstream`], answering every request with `answer`.
fn recording_upstream_answering(answer: &'static str) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&heads);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let seen = Arc::clone(&seen);
            std::thread::spawn(move || {
                let mut raw = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&raw[..end + 4]).into_owned();
                        raw.drain(..end + 4);
                        seen.lock().unwrap().push(head);
                        if conn.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => raw.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    (addr, heads)
}

/// Sends `request` on `stream`; returns the head the upstream read for it and the response.
fn exchange(stream: &mut TcpStream, heads: &Mutex<Vec<String>>, request: &str) -> (String, String) {
    let before = heads.lock().unwrap().len();
    stream.write_all(request.as_bytes()).unwrap();
    let response = String::from_utf8(read_response(stream)).unwrap();
    let head = heads.lock().unwrap()[before..].join("");
    (head, response)
}

/// The response with its `Date` and the seconds until a token is back checked and replaced by
/// placeholders: `spent` tokens take a million seconds each to come back.
fn normalised_response(mut response: String, spent: u64) -> String {
    let date = take_value(&mut response, "\r\nDate: ", "date");
    // An IMF-fixdate: `Sat, 28 Nov 2026 18:35:33 GMT`.
    assert_eq!(date.len(), 29, "{date}");
    assert!(
        date.ends_with(" GMT") && date.as_bytes()[3] == b',',
        "{date}"
    );
    if response.contains(";t=") {
        let t: u64 = take_value(&mut response, ";t=", "t").parse().unwrap();
        let full = spent * 1_000_000;
        assert!(
            (full.saturating_sub(100)..=full).contains(&t),
            "{t} for {spent}"
        );
        let reset: u64 = take_value(&mut response, "\r\nratelimit-reset: ", "t")
            .parse()
            .unwrap();
        assert_eq!(reset, t);
    }
    response
}

/// The upstream's response as the client gets it: the upstream's headers (names in canonical
/// form), then `added` (whole lines), then `Date` and `Connection`.
fn expected_response(added: &str, connection: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\n\
         Content-Type: text/plain\r\n\
         x-upstream: yes\r\n\
         Cache-Control: no-store\r\n\
         Content-Length: 2\r\n\
         {added}\
         Date: <date>\r\n\
         Connection: {connection}\r\n\
         \r\n\
         ok"
    )
}

/// The `RateLimit` headers of rule `per-ip` with `remaining` tokens left.
fn limit_headers(remaining: u64) -> String {
    format!(
        "ratelimit-policy: \"per-ip\";q=1000;w=1000000000\r\n\
         ratelimit: \"per-ip\";r={remaining};t=<t>\r\n\
         ratelimit-limit: 1000\r\n\
         ratelimit-remaining: {remaining}\r\n\
         ratelimit-reset: <t>\r\n"
    )
}

fn gateway_and_upstream(
    policy: Option<&str>,
    extra: &[&str],
) -> (Gateway, SocketAddr, Arc<Mutex<Vec<String>>>) {
    let (upstream, heads) = recording_upstream();
    let gw = Gateway::start(policy, Some(upstream), extra);
    (gw, upstream, heads)
}

fn connect(gw: &Gateway) -> TcpStream {
    let stream = TcpStream::connect(gw.proxy).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

#[test]
fn an_admitted_request_is_forwarded_and_answered_byte_for_byte_as_pinned() {
    let (gw, upstream, heads) = gateway_and_upstream(Some(ALLOW), &[]);
    let port = gw.proxy.port();
    let forwarded = |head: String| {
        head.replace(
            &format!("x-forwarded-port: {port}\r\n"),
            "x-forwarded-port: <port>\r\n",
        )
    };
    let mut stream = connect(&gw);
    // Twice on one kept-alive connection: the second is forwarded and answered like the first
    // but for the count.
    for remaining in [999, 998] {
        let (head, response) = exchange(
            &mut stream,
            &heads,
            "GET /v1/x?a=1 HTTP/1.1\r\nHost: api.example\r\nUser-Agent: t/1\r\nAccept: */*\r\n\r\n",
        );
        assert_eq!(
            forwarded(head),
            "GET /v1/x?a=1 HTTP/1.1\r\n\
             Host: api.example\r\n\
             User-Agent: t/1\r\n\
             Accept: */*\r\n\
             X-Forwarded-For: 127.0.0.1\r\n\
             x-forwarded-proto: http\r\n\
             x-forwarded-host: api.example\r\n\
             x-forwarded-port: <port>\r\n\
             \r\n"
        );
        assert_eq!(
            normalised_response(response, 1000 - remaining),
            expected_response(&limit_headers(remaining), "keep-alive")
        );
    }
    // A client's own forwarding headers (it is no trusted proxy): its chain is extended, the
    // others replaced, `Forwarded` dropped.
    let (head, response) = exchange(
        &mut stream,
        &heads,
        "GET /v1/y HTTP/1.1\r\nHost: api.example\r\nX-Forwarded-For: 198.51.100.1\r\n\
         X-Forwarded-Proto: gopher\r\nX-Forwarded-Host: evil\r\nForwarded: for=x\r\n\r\n",
    );
    assert_eq!(
        forwarded(head),
        "GET /v1/y HTTP/1.1\r\n\
         Host: api.example\r\n\
         X-Forwarded-For: 198.51.100.1, 127.0.0.1\r\n\
         x-forwarded-proto: http\r\n\
         x-forwarded-host: api.example\r\n\
         x-forwarded-port: <port>\r\n\
         \r\n"
    );
    assert_eq!(
        normalised_response(response, 3),
        expected_response(&limit_headers(997), "keep-alive")
    );
    // An HTTP/1.0 client without `Host`: the upstream gets its own address as one, last, and
    // the request goes out as HTTP/1.1.
    let mut old = connect(&gw);
    let (head, response) = exchange(&mut old, &heads, "GET /v1/z HTTP/1.0\r\n\r\n");
    assert_eq!(
        forwarded(head),
        format!(
            "GET /v1/z HTTP/1.1\r\n\
             X-Forwarded-For: 127.0.0.1\r\n\
             x-forwarded-proto: http\r\n\
             x-forwarded-port: <port>\r\n\
             Host: {upstream}\r\n\
             \r\n"
        )
    );
    assert_eq!(
        normalised_response(response, 4),
        expected_response(&limit_headers(996), "close")
    );
}

#[test]
fn an_admitted_request_with_the_access_log_carries_its_request_id_both_ways() {
    let (gw, _, heads) = gateway_and_upstream(Some(NONE), &["--access-log", "json"]);
    let port = gw.proxy.port();
    let mut stream = connect(&gw);
    let (head, response) = exchange(
        &mut stream,
        &heads,
        "GET /v1/x HTTP/1.1\r\nHost: a\r\nX-Request-Id: req-7\r\n\r\n",
    );
    assert_eq!(
        head,
        format!(
            "GET /v1/x HTTP/1.1\r\n\
             Host: a\r\n\
             X-Request-Id: req-7\r\n\
             X-Forwarded-For: 127.0.0.1\r\n\
             x-forwarded-proto: http\r\n\
             x-forwarded-host: a\r\n\
             x-forwarded-port: {port}\r\n\
             \r\n"
        )
    );
    assert_eq!(
        normalised_response(response, 0),
        expected_response("x-request-id: req-7\r\n", "keep-alive")
    );
    // Without one, the gateway makes one, sends it upstream and echoes it.
    let (mut head, mut response) =
        exchange(&mut stream, &heads, "GET /v1/x HTTP/1.1\r\nHost: a\r\n\r\n");
    let sent = take_value(&mut head, "X-Request-Id: ", "id");
    let echoed = take_value(&mut response, "x-request-id: ", "id");
    assert_eq!(sent, echoed);
    assert!(
        sent.len() >= 16 && sent.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'),
        "{sent}"
    );
    assert_eq!(
        head,
        format!(
            "GET /v1/x HTTP/1.1\r\n\
             Host: a\r\n\
             X-Forwarded-For: 127.0.0.1\r\n\
             x-forwarded-proto: http\r\n\
             x-forwarded-host: a\r\n\
             x-forwarded-port: {port}\r\n\
             X-Request-Id: <id>\r\n\
             \r\n"
        )
    );
    assert_eq!(
        normalised_response(response, 0),
        expected_response("x-request-id: <id>\r\n", "keep-alive")
    );
}

#[test]
fn an_upstreams_own_ratelimit_and_request_id_headers_are_replaced_by_the_gateways() {
    // The upstream sends headers of the names the gateway adds, in any case: the client gets
    // the gateway's values once, after the upstream's other headers.
    let (upstream, heads) = recording_upstream_answering(
        "HTTP/1.1 200 OK\r\n\
         Content-Type: text/plain\r\n\
         RateLimit: \"upstream\";r=5;t=1\r\n\
         X-Upstream: yes\r\n\
         X-Request-Id: upstream-id\r\n\
         Cache-Control: no-store\r\n\
         Content-Length: 2\r\n\
         \r\n\
         ok",
    );
    let gw = Gateway::start(Some(ALLOW), Some(upstream), &["--access-log", "json"]);
    let mut stream = connect(&gw);
    let (_, response) = exchange(
        &mut stream,
        &heads,
        "GET /v1/x HTTP/1.1\r\nHost: a\r\nX-Request-Id: req-8\r\n\r\n",
    );
    assert_eq!(
        normalised_response(response, 1),
        "HTTP/1.1 200 OK\r\n\
         Content-Type: text/plain\r\n\
         ratelimit: \"per-ip\";r=999;t=<t>\r\n\
         x-upstream: yes\r\n\
         x-request-id: req-8\r\n\
         Cache-Control: no-store\r\n\
         Content-Length: 2\r\n\
         ratelimit-policy: \"per-ip\";q=1000;w=1000000000\r\n\
         ratelimit-limit: 1000\r\n\
         ratelimit-remaining: 999\r\n\
         ratelimit-reset: <t>\r\n\
         Date: <date>\r\n\
         Connection: keep-alive\r\n\
         \r\n\
         ok"
    );
    // With no name in common, the same headers follow the upstream's, as pinned above.
    let (gw, _, heads) = gateway_and_upstream(Some(ALLOW), &["--access-log", "json"]);
    let mut stream = connect(&gw);
    let (_, response) = exchange(
        &mut stream,
        &heads,
        "GET /v1/x HTTP/1.1\r\nHost: a\r\nX-Request-Id: req-9\r\n\r\n",
    );
    assert_eq!(
        normalised_response(response, 1),
        expected_response(
            &format!("{}x-request-id: req-9\r\n", limit_headers(999)),
            "keep-alive"
        )
    );
}
