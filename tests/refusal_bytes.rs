//! A refusal's exact bytes, pinned: the status line, every header in its order and spelling, the
//! body, the `RATE_LIMIT` line (text and JSON) and the refusal's metric series, through the real
//! binary. Only what time moves is normalised (the `Date` value and the seconds still to wait,
//! each checked for its form and range), so any other change to how a refusal is written fails.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use support::{Gateway, Upstream};

/// One token, refilled in a million seconds: the first request is allowed, every later one
/// refused.
const DENY: &str = r#"{"rules": [{"name": "deny", "limit_keys": ["ip:address"],
  "algorithm": "token_bucket", "algorithm_config": {"rps": 0.000001, "burst": 1}}]}"#;

/// Reads one `Content-Length`-framed response from `stream`, bytes as sent.
pub(crate) fn read_response(stream: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map_or(0, |v| v.trim().parse().unwrap());
            if raw.len() >= end + 4 + length {
                raw.truncate(end + 4 + length);
                return raw;
            }
        }
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed mid-response: {raw:?}");
        raw.extend_from_slice(&buf[..n]);
    }
}

/// Sends `request` on `stream` and returns its response's bytes.
fn exchange(stream: &mut TcpStream, request: &str) -> String {
    stream.write_all(request.as_bytes()).unwrap();
    String::from_utf8(read_response(stream)).unwrap()
}

/// Replaces the value after `prefix` (up to the line's end) with `<name>`, returning the value.
pub(crate) fn take_value(text: &mut String, prefix: &str, name: &str) -> String {
    let start = text
        .find(prefix)
        .unwrap_or_else(|| panic!("{prefix} in {text}"))
        + prefix.len();
    let end = start + text[start..].find("\r\n").unwrap();
    let value = text[start..end].to_string();
    text.replace_range(start..end, &format!("<{name}>"));
    value
}

/// The refusal with its time-dependent values checked and replaced by placeholders.
fn normalised(mut response: String) -> String {
    let date = take_value(&mut response, "\r\nDate: ", "date");
    // An IMF-fixdate: `Sat, 28 Nov 2026 18:35:33 GMT`.
    assert_eq!(date.len(), 29, "{date}");
    assert!(
        date.ends_with(" GMT") && date.as_bytes()[3] == b',',
        "{date}"
    );
    // The seconds until the token is back: a million, less the seconds the test took.
    let t: u64 = take_value(&mut response, "\r\nratelimit: \"deny\";r=0;t=", "t")
        .parse()
        .unwrap();
    assert!((999_900..=1_000_000).contains(&t), "{t}");
    let reset: u64 = take_value(&mut response, "\r\nratelimit-reset: ", "t")
        .parse()
        .unwrap();
    assert_eq!(reset, t);
    // Retry-After: the wait with this client's jitter, within [t, 1.5 t].
    let retry: u64 = take_value(&mut response, "\r\nretry-after: ", "retry")
        .parse()
        .unwrap();
    assert!(retry >= t && retry <= t + t.div_ceil(2), "{retry} for {t}");
    response
}

/// The refusal as tollgate writes it today, but for the connection's header.
fn expected(request_id: Option<&str>, connection: &str) -> String {
    let id = request_id.map_or(String::new(), |id| format!("x-request-id: {id}\r\n"));
    format!(
        "HTTP/1.1 429 Too Many Requests\r\n\
         ratelimit-policy: \"deny\";q=1;w=1000000\r\n\
         ratelimit: \"deny\";r=0;t=<t>\r\n\
         ratelimit-limit: 1\r\n\
         ratelimit-remaining: 0\r\n\
         ratelimit-reset: <t>\r\n\
         retry-after: <retry>\r\n\
         x-tollgate-reason: token_bucket_exceeded\r\n\
         {id}\
         Content-Type: text/plain; charset=utf-8\r\n\
         Content-Length: 17\r\n\
         Date: <date>\r\n\
         Connection: {connection}\r\n\
         \r\n\
         Too Many Requests"
    )
}

const GET: &str = "GET /v1/x HTTP/1.1\r\nHost: a\r\n";

#[test]
fn a_refusal_is_written_byte_for_byte_as_pinned() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(DENY), Some(upstream.addr), &[]);
    let mut stream = TcpStream::connect(gw.proxy).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let allowed = exchange(&mut stream, &format!("{GET}\r\n"));
    assert!(allowed.starts_with("HTTP/1.1 200 "), "{allowed}");
    // Twice on one kept-alive connection: the second refusal is written like the first.
    for _ in 0..2 {
        let refused = exchange(&mut stream, &format!("{GET}\r\n"));
        assert_eq!(normalised(refused), expected(None, "keep-alive"));
    }
    // An X-Request-Id is not echoed with the access log off.
    let refused = exchange(&mut stream, &format!("{GET}X-Request-Id: abc\r\n\r\n"));
    assert_eq!(normalised(refused), expected(None, "keep-alive"));
    let refused = exchange(&mut stream, &format!("{GET}Connection: close\r\n\r\n"));
    assert_eq!(normalised(refused), expected(None, "close"));
    // An HTTP/1.0 client's refusal closes its connection.
    let mut old = TcpStream::connect(gw.proxy).unwrap();
    old.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let refused = exchange(&mut old, "GET /v1/x HTTP/1.0\r\nHost: a\r\n\r\n");
    assert_eq!(normalised(refused), expected(None, "close"));

    // The RATE_LIMIT line of each refusal, after its timestamp.
    gw.wait_until(Duration::from_secs(5), || {
        gw.log_text().matches("RATE_LIMIT").count() == 5
    });
    let line = "  INFO tollgate::service: RATE_LIMIT client_ip=127.0.0.1 host=a path=/v1/x \
                status=429 policy=policy rule=deny reason=token_bucket_exceeded mode=enforce";
    let lines: Vec<String> = gw
        .log_text()
        .lines()
        .filter(|l| l.contains("RATE_LIMIT"))
        .map(|l| l[l.find(' ').unwrap()..].to_string())
        .collect();
    assert_eq!(lines, vec![line.to_string(); 5]);

    // The refusal's metric series, exactly.
    let series: Vec<String> = gw
        .metrics()
        .lines()
        .filter(|l| {
            l.starts_with("tollgate_decisions_total{")
                || l.starts_with("tollgate_requests_total{")
                || l.starts_with("tollgate_decision_duration_seconds_count")
        })
        .filter(|l| !l.ends_with(" 0"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        series,
        [
            "tollgate_decision_duration_seconds_count 6",
            "tollgate_decisions_total{action=\"allow\",mode=\"enforce\",policy=\"policy\",reason=\"\",rule=\"deny\"} 1",
            "tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"policy\",reason=\"token_bucket_exceeded\",rule=\"deny\"} 5",
            "tollgate_requests_total{action=\"allow\",reason=\"\"} 1",
            "tollgate_requests_total{action=\"reject\",reason=\"token_bucket_exceeded\"} 5",
        ]
    );
}

#[test]
fn a_refusal_with_access_log_and_json_lines_is_written_as_pinned() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(DENY),
        Some(upstream.addr),
        &["--access-log", "json", "--log-format", "json"],
    );
    let mut stream = TcpStream::connect(gw.proxy).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let allowed = exchange(&mut stream, &format!("{GET}X-Request-Id: first\r\n\r\n"));
    assert!(allowed.starts_with("HTTP/1.1 200 "), "{allowed}");
    let refused = exchange(&mut stream, &format!("{GET}X-Request-Id: req-42\r\n\r\n"));
    assert_eq!(normalised(refused), expected(Some("req-42"), "keep-alive"));

    gw.wait_for_log("RATE_LIMIT");
    let line = gw
        .log_text()
        .lines()
        .find(|l| l.contains("RATE_LIMIT"))
        .unwrap()
        .to_string();
    // Everything after the timestamp, as written.
    let rest = &line[line.find(",\"level\"").unwrap()..];
    assert_eq!(
        rest,
        ",\"level\":\"INFO\",\"message\":\"RATE_LIMIT\",\"client_ip\":\"127.0.0.1\",\
         \"host\":\"a\",\"path\":\"/v1/x\",\"status\":429,\"policy\":\"policy\",\"rule\":\"deny\",\
         \"reason\":\"token_bucket_exceeded\",\"mode\":\"enforce\",\"target\":\"tollgate::service\"}"
    );
    // The refusal's access-log line, but for its time and duration.
    gw.wait_until(Duration::from_secs(5), || {
        gw.stdout_text().contains("req-42")
    });
    let access = gw
        .stdout_text()
        .lines()
        .find(|l| l.contains("req-42"))
        .unwrap()
        .to_string();
    let rest = &access[access.find(",\"client_ip\"").unwrap()..];
    let (before, after) = rest.split_once(",\"request_time\":").unwrap();
    let after = &after[after.find(',').unwrap()..];
    assert_eq!(
        format!("{before}{after}"),
        ",\"client_ip\":\"127.0.0.1\",\"method\":\"GET\",\"host\":\"a\",\"path\":\"/v1/x\",\
         \"protocol\":\"HTTP/1.1\",\"status\":429,\"bytes\":17,\"referer\":null,\"user_agent\":null,\
         \"upstream\":null,\"upstream_time\":null,\"verdict\":\"token_bucket_exceeded\",\
         \"rule\":\"deny\",\"request_id\":\"req-42\"}"
    );
}
