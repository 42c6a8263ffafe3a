//! Log lines cannot be forged: a client's key carrying CR, LF and ESC (percent-encoded in the
//! query, decoded into its bucket's name), a `Host` carrying a TAB (refused as malformed), sent
//! through every kind of line the real binary writes — the `RATE_LIMIT` refusal, the access
//! log, Pingora's error line for a failed upstream, and the `ADMIN_RESET` line once an operator
//! resets that client's bucket — give exactly one line each, with every value escaped
//! (`\xHH`) in text lines and carried back exactly in JSON lines.

use crate::support;

use support::{request, Gateway, ADMIN_TOKEN};

/// One request per 1000 s per `?user=`, one at once.
const POLICY: &str = r#"{"rules": [{"name": "per-user", "limit_keys": ["query:user"],
    "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 1}}]}"#;

/// The key, as the client sends it and as the gateway decodes it.
const TARGET: &str = "/w?user=evil%0D%0A%1B%5B31mFORGED%20INFO%20line";
const KEY: &str = "evil\r\n\u{1b}[31mFORGED INFO line";
/// How a text line shows the key.
/// In a `key=value` field the space keeps it quoted: `FORGED INFO` cannot become fields.
const KEY_ESCAPED: &str = r"evil\x0D\x0A\x1B[31mFORGED INFO line";

/// The refused request's `Host`: a TAB (all a `Host` the gateway reads as text can carry; one
/// with a C1 control is not text, and shows as `-`). Not `host[:port]`, it is refused (400
/// `malformed_request`) before the limiter or the upstream, and its refusal is logged with the
/// `Host` as sent, escaped. (Such a `Host` no longer reaches Pingora's own error line for a
/// failed upstream, which quoted it.)
const HOST: &str = "api.example.com\tFORGED";
const HOST_ESCAPED: &str = r"api.example.com\x09FORGED";
/// The allowed request's.
const GOOD_HOST: &str = "api.example.com";

/// A gateway in front of an upstream that refuses connections (the first request fails with
/// 502: Pingora's error line), with the access log and an admin token.
fn gateway(format: &str) -> Gateway {
    let dead = format!("127.0.0.1:{}", support::free_port());
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(POLICY),
        None,
        &[
            "--upstream",
            &dead,
            "--access-log",
            format,
            "--log-format",
            format,
        ],
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    gw.wait_until(std::time::Duration::from_secs(20), || {
        std::net::TcpStream::connect(gw.proxy).is_ok()
    });
    gw
}

/// The three requests: allowed (502, the upstream is down), refused (400, its `Host` is
/// malformed), then the bucket reset by the operator (204).
fn send_the_key(gw: &Gateway) {
    let first = request(gw.proxy, "GET", TARGET, &[("Host", GOOD_HOST)]);
    assert_eq!(first.status, 502, "{first:?}\n{}", gw.log_text());
    let refused = request(gw.proxy, "GET", TARGET, &[("Host", HOST)]);
    assert_eq!(refused.status, 400, "{refused:?}");
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let reset = request(
        gw.admin,
        "DELETE",
        "/v1/buckets/tb:per-user:evil%0D%0A%1B%5B31mFORGED%20INFO%20line",
        &[("Authorization", &bearer)],
    );
    assert_eq!(reset.status, 204, "{reset:?}");
    gw.wait_for_log("ADMIN_RESET");
    // The `RATE_LIMIT` line comes from a writer thread of its own: not ordered with the others.
    gw.wait_for_log("RATE_LIMIT");
    gw.wait_until(std::time::Duration::from_secs(5), || {
        gw.stdout_text().lines().count() == 2
    });
}

/// The lines of `text` holding `needle`: exactly one expected.
fn the_line<'t>(text: &'t str, needle: &str) -> &'t str {
    let found: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
    assert_eq!(found.len(), 1, "lines with {needle:?}:\n{text}");
    found[0]
}

/// No byte of `text` is a control character but the line ends.
fn assert_no_controls(text: &str) {
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "a control character reached the log:\n{text:?}"
    );
}

#[test]
fn a_key_with_cr_lf_and_esc_gives_one_escaped_line_of_each_kind() {
    let gw = gateway("text");
    send_the_key(&gw);
    let log = gw.log_text();
    let access = gw.stdout_text();
    // Not one forged line: every line of the log starts with its timestamp.
    assert_no_controls(&log);
    assert_no_controls(&access);
    assert!(
        log.lines().all(|l| l.starts_with("20")),
        "a line without a timestamp:\n{log}"
    );
    assert_eq!(
        the_line(&log, "ADMIN_RESET").split_once("ADMIN_RESET").unwrap().1,
        format!(
            " bucket=\"tb:per-user:{KEY_ESCAPED}\" policy=policy rule=per-user who=127.0.0.1 held_state=true"
        )
    );
    assert_eq!(
        the_line(&log, "RATE_LIMIT").split_once("RATE_LIMIT").unwrap().1,
        format!(
            " client_ip=127.0.0.1 host={HOST_ESCAPED} path=/w status=400 policy= rule= reason=malformed_request mode=enforce"
        )
    );
    // Pingora's own error line for the failed upstream (after its retries, logged at warn
    // with the same text) quotes the request's `Host`.
    let failed = the_line(&log, "status: 502");
    assert!(
        failed.ends_with(&format!(
            "GET {TARGET}, Host: {GOOD_HOST} origin=\"pingora_proxy\""
        )),
        "{failed}"
    );
    // The access log: one line per request, the `Host` escaped (the first one's is not a
    // visible-ASCII header value: not read).
    let first = the_line(&access, " 502 ");
    assert!(
        first.contains(&format!("\"GET {TARGET} HTTP/1.1\" 502 ")),
        "{first}"
    );
    assert!(first.contains(&format!(" host={GOOD_HOST} ")), "{first}");
    let refused = the_line(&access, " 400 ");
    assert!(
        refused.contains(&format!(
            " host={HOST_ESCAPED} upstream=- upstream_time=- request_time="
        )),
        "{refused}"
    );
    assert!(
        refused.contains(" verdict=malformed_request rule=- request_id="),
        "{refused}"
    );
}

#[test]
fn json_lines_carry_the_key_back_exactly() {
    let gw = gateway("json");
    send_the_key(&gw);
    let log = gw.log_text();
    let access = gw.stdout_text();
    let parse = |line: &str| -> serde_json::Value {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON line ({e}): {line:?}"))
    };
    // Every line is one JSON object: nothing forged between them.
    for line in log.lines().chain(access.lines()) {
        parse(line);
    }
    let reset = parse(the_line(&log, "ADMIN_RESET"));
    assert_eq!(reset["bucket"], format!("tb:per-user:{KEY}"));
    assert_eq!(reset["who"], "127.0.0.1");
    let refusal = parse(the_line(&log, "RATE_LIMIT"));
    assert_eq!(refusal["host"], HOST);
    assert_eq!(refusal["path"], "/w");
    let failed = parse(the_line(&log, "status: 502"));
    let message = failed["message"].as_str().unwrap_or_default();
    assert!(
        message.ends_with(&format!("GET {TARGET}, Host: {GOOD_HOST}")),
        "{message:?}"
    );
    let refused = parse(the_line(&access, "\"status\":400"));
    assert_eq!(refused["host"], HOST);
    assert_eq!(refused["path"], TARGET);
}
