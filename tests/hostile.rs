//! Issue 13's attacks, replayed from the outside against the real binary: each test sends what
//! an attacker sent and asserts what the gateway does now.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use support::{one_rule, raw_exchange, request, Gateway, Upstream};

const SLOW: f64 = 0.001;

const API: &str = r#"{"bundle_version": 1,
  "policies": [{"id": "api", "spec": {"selector": {"hosts": ["api.example.com"]}, "rules": [
    {"name": "per-key", "limit_keys": ["header:x-api-key"], "on_missing": "shared", "algorithm": "token_bucket",
     "algorithm_config": {"rps": 0.001, "burst": 1000}},
    {"name": "weighted", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
     "algorithm_config": {"rps": 0.001, "burst": 20, "cost_source": "header:x-request-weight"}}]}}],
  "kill_switches": [{"scope_key": "method", "scope_value": "GET", "route": "/api/llm", "reason": "incident 7"}]}"#;

/// The spellings that used to reach a killed `/api/llm` (8 of 38 tried), and a few more.
const ENCODED_SPELLINGS: [&str; 10] = [
    "/api%2Fllm",
    "/%2Fapi/llm",
    "/api/llm%2F",
    "/api/x%2F..%2Fllm",
    "/api%2fllm",
    "/%2fapi%2fllm",
    "/api%5Cllm",
    "/api/x%5C..%5Cllm",
    "/api%2F%2Fllm",
    "/api/llm%2Fv1",
];

#[test]
fn encoded_slashes_never_reach_a_killed_route() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(API), Some(upstream.addr), &[]);
    for path in ENCODED_SPELLINGS {
        let r = gw.get(path, &[]);
        assert_eq!(r.status, 429, "{path}: {r:?}");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("kill_switch"), "{path}");
        // The decision service (nginx auth_request, Envoy ext_authz) agrees.
        let d = gw.admin("POST", "/v1/decision", &[("X-Original-URI", path)]);
        assert_eq!(d.status, 429, "decision service, {path}");
    }
    assert_eq!(upstream.hits(), 0);
    assert_eq!(gw.get("/api/other", &[]).status, 200);

    // `--encoded-slashes reject`: 400, counted and logged like any refusal.
    let strict = Gateway::start(
        Some(API),
        Some(upstream.addr),
        &["--encoded-slashes", "reject"],
    );
    for path in ["/api%2Fllm", "/v1%2fusers", "/x%5Cy"] {
        let r = strict.get(path, &[]);
        assert_eq!(r.status, 400, "{path}");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("encoded_slash"));
        let d = strict.admin("POST", "/v1/decision", &[("X-Original-URI", path)]);
        assert_eq!(d.status, 400);
    }
    assert_eq!(strict.get("/v1/users", &[]).status, 200);
    assert_eq!(
        strict.metric("tollgate_requests_total{action=\"reject\",reason=\"encoded_slash\"}"),
        6.0
    );
}

#[test]
fn the_client_cannot_pick_its_own_price() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(API), Some(upstream.addr), &[]);
    let admitted = (0..200)
        .filter(|_| gw.get("/v1/x", &[("X-Request-Weight", "0.000001")]).status == 200)
        .count();
    assert_eq!(admitted, 20, "a tiny stated cost is raised to the default");
    // A cost above the burst can never fit: refused without a Retry-After to wait for.
    let fresh = Gateway::start(Some(API), Some(upstream.addr), &[]);
    let r = fresh.get("/v1/x", &[("X-Request-Weight", "21")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("cost_exceeds_limit"));
    assert_eq!(r.header("Retry-After"), None);
    assert_eq!(r.header("RateLimit-Remaining"), Some("20"));
    assert_eq!(
        fresh.get("/v1/x", &[("X-Request-Weight", "20")]).status,
        200
    );
}

#[test]
fn a_host_with_a_bad_port_is_refused_and_repeated_key_headers_are_refused() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(API), Some(upstream.addr), &[]);
    // A port that is not a number is not `host[:port]`: refused before any matching, so it
    // cannot dodge the host selector (tests/edge.rs compares every such case with nginx).
    let r = gw.get("/v1/x", &[("Host", "api.example.com:abc")]);
    assert_eq!(r.status, 400);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("malformed_request"));
    assert_eq!(upstream.hits(), 0);
    // A port that is one is ignored by the selector.
    let r = gw.get("/v1/x", &[("Host", "api.example.com:8443")]);
    assert_eq!(r.status, 200);
    assert!(
        r.header("RateLimit-Policy")
            .is_some_and(|p| p.contains("\"weighted\"")),
        "{r:?}"
    );
    // An absolute-form target disagreeing with Host cannot pick the selector the upstream does
    // not route by: Pingora refuses it (400) before any hook runs.
    let hits = upstream.hits();
    let absolute = raw_exchange(
        gw.proxy,
        b"GET http://api.example.com/v1/x HTTP/1.1\r\nHost: other.example.com\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert_eq!(absolute[0].status, 400, "{absolute:?}");
    assert_eq!(upstream.hits(), hits);
    let r = gw.get("/v1/x", &[("X-Api-Key", "cheap"), ("X-Api-Key", "victim")]);
    assert_eq!(r.status, 400);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("duplicate_header"));
    assert_eq!(upstream.hits(), hits, "never forwarded");
    let d = gw.admin(
        "POST",
        "/v1/decision",
        &[
            ("X-Original-URI", "/v1/x"),
            ("X-Api-Key", "a"),
            ("X-Api-Key", "b"),
        ],
    );
    assert_eq!(d.status, 400);
}

/// One raw request with arbitrary header bytes.
fn raw_get(path: &str, extra: &[u8]) -> Vec<u8> {
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: api.example.com\r\n").into_bytes();
    req.extend_from_slice(extra);
    req.extend_from_slice(b"Connection: close\r\n\r\n");
    req
}

#[test]
fn one_bad_byte_in_x_forwarded_for_does_not_throw_the_chain_away() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 2.0)),
        Some(upstream.addr),
        &["--trusted-proxy", "127.0.0.1"],
    );
    let limit = Duration::from_secs(5);
    let bad = raw_get("/", b"X-Forwarded-For: 1.2.3.4\x80zz, 198.51.100.4\r\n");
    let statuses: Vec<u16> = (0..3)
        .map(|_| raw_exchange(gw.proxy, &bad, limit)[0].status)
        .collect();
    assert_eq!(statuses, [200, 200, 429], "the client keeps its own bucket");
    // The trusted proxy's own bucket (no X-Forwarded-For) was not spent by them.
    assert_eq!(gw.get("/", &[]).status, 200);
    assert_eq!(
        gw.get("/", &[("X-Forwarded-For", "198.51.100.5")]).status,
        200
    );

    // Decision service: a broken X-Forwarded-For no longer falls back to a client-chosen
    // X-Real-IP (that gave a fresh bucket on every try: 50 of 50).
    let admitted = (0..50)
        .filter(|i| {
            let mut req = format!(
                "POST /v1/decision HTTP/1.1\r\nHost: t\r\nX-Original-URI: /\r\nX-Real-IP: 10.9.{}.{}\r\n",
                i / 200,
                i % 200
            )
            .into_bytes();
            req.extend_from_slice(b"X-Forwarded-For: 203.0.113.9\xff, 198.51.100.77\r\n");
            req.extend_from_slice(b"Content-Length: 0\r\nConnection: close\r\n\r\n");
            raw_exchange(gw.admin, &req, limit)[0].status == 200
        })
        .count();
    assert_eq!(admitted, 2);
}

#[test]
fn pipelined_requests_are_all_answered_in_order() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 20.0)),
        Some(upstream.addr),
        &[],
    );
    let one = b"GET /p HTTP/1.1\r\nHost: api.example.com\r\n\r\n";
    let mut batch: Vec<u8> = one.repeat(49);
    batch.extend_from_slice(
        b"GET /p HTTP/1.1\r\nHost: api.example.com\r\nConnection: close\r\n\r\n",
    );
    let responses = raw_exchange(gw.proxy, &batch, Duration::from_secs(20));
    let statuses: Vec<u16> = responses.iter().map(|r| r.status).collect();
    let mut expected = vec![200u16; 20];
    expected.extend([429u16; 30]);
    assert_eq!(statuses, expected);
    assert_eq!(upstream.hits(), 20);
    // Remaining counts down in order: the answers are not shuffled.
    let remaining: Vec<&str> = responses[..20]
        .iter()
        .map(|r| r.header("RateLimit-Remaining").unwrap_or(""))
        .collect();
    let counted: Vec<String> = (0..20).rev().map(|n: u32| n.to_string()).collect();
    assert_eq!(remaining, counted);

    // The admin listener too.
    let mut batch = b"GET /livez HTTP/1.1\r\nHost: a\r\n\r\n".repeat(9);
    batch.extend_from_slice(b"GET /livez HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    let responses = raw_exchange(gw.admin, &batch, Duration::from_secs(20));
    assert_eq!(responses.len(), 10);
    assert!(responses.iter().all(|r| r.status == 200 && r.body == "ok"));
}

/// Reads until the server closes the connection; `None` when `limit` passes first.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .ok()?;
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        match stream.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

#[test]
fn idle_and_trickling_connections_are_cut_off_and_capped() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 1000.0, 1000.0)),
        Some(upstream.addr),
        &[
            // 2 s: the eight silent connections must outlast the ninth's refusal.
            "--header-timeout-secs",
            "2",
            "--keepalive-timeout-secs",
            "1",
            "--max-connections",
            "8",
        ],
    );
    // Eight silent connections fill the cap...
    let mut idle: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(gw.proxy).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // ...the ninth is refused cleanly...
    let refused = raw_exchange(
        gw.proxy,
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
        Duration::from_secs(5),
    );
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].status, 503);
    assert!(refused[0].body.contains("too many connections"));
    // ...while the admin listener still answers.
    assert_eq!(gw.admin("GET", "/livez", &[]).status, 200);
    // Silent connections are cut at the header deadline (2 s), not never.
    for conn in &mut idle {
        let closed = closed_within(conn, Duration::from_secs(5));
        assert!(closed.is_some(), "an idle connection was never closed");
    }
    // Room again.
    assert_eq!(gw.get("/", &[]).status, 200);

    // The admin listener is guarded the same way: a silent connection does not stay.
    let mut silent_admin = TcpStream::connect(gw.admin).expect("connect admin");
    assert!(
        closed_within(&mut silent_admin, Duration::from_secs(5)).is_some(),
        "an idle admin connection was never closed"
    );
    assert_eq!(gw.admin("GET", "/livez", &[]).status, 200);

    // A trickler sending one byte every 100 ms is cut at the deadline, however steady.
    let mut trickler = TcpStream::connect(gw.proxy).expect("connect");
    trickler
        .set_write_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let start = Instant::now();
    let header = b"GET / HTTP/1.1\r\nHost: api.example.com\r\nX-Padding: ".to_vec();
    let mut cut = false;
    for i in 0..60 {
        let byte = header.get(i).copied().unwrap_or(b'a');
        if trickler.write_all(&[byte]).is_err() {
            cut = true;
            break;
        }
        trickler
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut buf = [0u8; 16];
        if matches!(trickler.read(&mut buf), Ok(0)) {
            cut = true;
            break;
        }
    }
    let took = start.elapsed();
    assert!(cut, "a trickling client kept its connection for {took:?}");
    assert!(took < Duration::from_secs(4), "cut after {took:?}");

    // A kept-alive connection idles at most the keep-alive timeout after its response.
    let mut kept = TcpStream::connect(gw.proxy).expect("connect");
    kept.write_all(b"GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
        .unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 4096];
    let n = kept.read(&mut buf).unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let closed = closed_within(&mut kept, Duration::from_secs(5));
    assert!(
        closed.is_some(),
        "an idle keep-alive connection was never closed"
    );
}

/// Issue 13, attack 9: the Redis password at connect, at start-up errors and on failure
/// bursts; full JWTs and API keys at `RUST_LOG=debug`.
#[test]
fn secrets_never_reach_the_logs() {
    let upstream = Upstream::start();
    let closed = support::free_port();
    let store = format!("redis://:hunter2pw@127.0.0.1:{closed}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(API),
        Some(upstream.addr),
        &["--store", &store, "--jwt-secret", "s3cr3t-hmac"],
        &[("RUST_LOG", "debug")],
    );
    let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJtYWxsb3J5In0.c2lnbmF0dXJl";
    for _ in 0..3 {
        let r = gw.get(
            "/v1/x",
            &[
                ("X-Api-Key", "SECRET-API-KEY-123"),
                ("Authorization", &format!("Bearer {jwt}")),
                ("Cookie", "session=COOKIE-SECRET"),
            ],
        );
        assert_eq!(r.status, 200, "fails open while Redis is down");
        gw.admin(
            "POST",
            "/v1/decision",
            &[
                ("X-Api-Key", "SECRET-API-KEY-123"),
                ("Authorization", &format!("Bearer {jwt}")),
            ],
        );
    }
    gw.wait_until(Duration::from_secs(10), || {
        gw.log_text().contains("shared store not answering")
    });
    let log = gw.log_text();
    assert!(
        log.contains("Sending header to upstream"),
        "debug logging is on"
    );
    for secret in [
        "hunter2pw",
        "SECRET-API-KEY-123",
        "eyJhbGciOiJIUzI1NiJ9",
        "COOKIE-SECRET",
        "s3cr3t-hmac",
    ] {
        assert!(!log.contains(secret), "{secret} leaked:\n{log}");
    }
    assert!(log.contains("redis://:***@127.0.0.1"));

    // A start-up error naming the URL: redacted too.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "run",
            "--policy",
            "/nonexistent.json",
            "--store",
            "redis://:hunter2pw@exa mple:1",
        ])
        .output()
        .expect("run");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(!text.contains("hunter2pw"), "{text}");
}

#[test]
fn a_plain_request_still_works_on_a_pipelined_keepalive_connection() {
    // Sanity for the connection guard: two requests on one connection, sent apart.
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 5.0)),
        Some(upstream.addr),
        &[],
    );
    let mut conn = TcpStream::connect(gw.proxy).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for remaining in ["4", "3"] {
        conn.write_all(b"GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
            .unwrap();
        let mut buf = vec![0u8; 8192];
        let n = conn.read(&mut buf).unwrap();
        let r = &support::split_responses(&buf[..n])[0];
        assert_eq!(r.status, 200);
        assert_eq!(r.header("RateLimit-Remaining"), Some(remaining));
    }
    assert_eq!(
        request(gw.proxy, "GET", "/", &[]).header("RateLimit-Remaining"),
        Some("2")
    );
}

/// Issue 50's eviction gaming, its worst rows: a drained real key (10 an hour, so nothing
/// refills during the test; or a day budget of 10) while made-up keys, each drained by one
/// request stating `x-cost: 10`, turn a store of 100 over 20 times. The store evicts entries as
/// spent as the real key's, the real key's among them, but the record of evicted spend gives
/// it back nothing: exactly 10 admitted, in process memory and with `--state-dir`.
#[test]
fn drained_made_up_keys_never_reset_the_real_keys_limit() {
    const POLICY: &str = r#"{"bundle_version": 1, "policies": [
      {"id": "tb", "spec": {"selector": {"pathPrefix": "/tb"}, "rules": [
        {"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket",
         "algorithm_config": {"count": 10, "period": "1h", "burst": 10, "cost_source": "header:x-cost"}}]}},
      {"id": "budget", "spec": {"selector": {"pathPrefix": "/budget"}, "rules": [
        {"name": "per-tenant", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
         "algorithm_config": {"budget": 10, "period": "1d", "cost_key": "header:x-cost", "default_cost": 1,
           "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}}]}}]}"#;
    let upstream = Upstream::start();
    for state_dir in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let mut flags = vec!["--max-buckets".to_string(), "100".to_string()];
        if state_dir {
            flags.push("--state-dir".to_string());
            flags.push(state.display().to_string());
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &flags);
        for (path, header) in [("/tb", "x-api-key"), ("/budget", "x-tenant")] {
            let real = || gw.get(path, &[(header, "real"), ("x-cost", "1")]).status == 200;
            let mut admitted = (0..12).filter(|_| real()).count();
            assert_eq!(admitted, 10, "{path}: the real key's own drain");
            for i in 0..2000 {
                let fake = format!("fake{i}");
                let r = gw.get(path, &[(header, fake.as_str()), ("x-cost", "10")]);
                assert_eq!(r.status, 200, "{path}: made-up key {i}");
                if i % 100 == 99 {
                    admitted += (0..3).filter(|_| real()).count();
                }
            }
            assert_eq!(admitted, 10, "{path}, state dir {state_dir}");
        }
        let evicted = gw.metric("tollgate_store_evictions_by_kind_total{kind=\"token_bucket\"}")
            + gw.metric("tollgate_store_evictions_by_kind_total{kind=\"budget\"}");
        assert!(
            evicted >= 3800.0,
            "state dir {state_dir}: {evicted} evictions"
        );
        // Each of them held 10 units (kept in the record), which the histogram shows.
        let held_ten = gw.metric("tollgate_store_eviction_forgiven_tokens_count")
            - gw.metric("tollgate_store_eviction_forgiven_tokens_bucket{le=\"5\"}");
        assert!(held_ten >= 3800.0, "state dir {state_dir}: {held_ten}");
        assert_eq!(gw.metric("tollgate_store_fail_open_total"), 0.0);
        if state_dir {
            assert!(state.join("evicted.state").is_file());
        }
    }
}

/// Issue 50's full lease table: with `--state-dir` and `--max-buckets 1000`, 1 500 distinct
/// requests under loop detection (against `--max-loop-marks 1000`, so 500 marks are
/// forgotten for room). Concurrency slots never lose room to them: `max_in_flight 1` admits
/// exactly 1 of 3 at once, for each tenant; and 12 identical requests against a threshold of 10
/// are caught (the 10th identical one is the loop: 9 admitted, 3 refused). Nothing fails open.
/// With and without a state dir.
#[test]
fn loop_marks_never_take_a_concurrency_slots_room() {
    const POLICY: &str = r#"{"bundle_version": 1, "policies": [
      {"id": "loops", "spec": {"selector": {"pathPrefix": "/l"}, "rules": [
        {"name": "per-user", "limit_keys": ["header:x-user"], "algorithm": "token_bucket",
         "algorithm_config": {"rps": 1000, "burst": 100000}}],
       "loop_detection": {"enabled": true, "window_seconds": 3600, "threshold_identical_requests": 10,
                          "action": "reject"}}},
      {"id": "jobs", "spec": {"selector": {"pathPrefix": "/jobs"}, "rules": [
        {"name": "one-at-a-time", "limit_keys": ["header:x-tenant"], "algorithm": "concurrency",
         "algorithm_config": {"max_in_flight": 1, "lease_ttl_seconds": 60}}]}}]}"#;
    let upstream = Upstream::start();
    for state_dir in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let mut flags = vec![
            "--max-buckets".to_string(),
            "1000".to_string(),
            "--max-loop-marks".to_string(),
            "1000".to_string(),
        ];
        if state_dir {
            flags.push("--state-dir".to_string());
            flags.push(state.display().to_string());
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &flags);
        for i in 0..1500 {
            let r = gw.get(&format!("/l/{i}"), &[("x-user", "u")]);
            assert_eq!(r.status, 200, "distinct request {i}");
        }
        assert_eq!(gw.metric("tollgate_store_loop_marks"), 1000.0);
        assert_eq!(gw.metric("tollgate_store_loop_marks_evicted_total"), 500.0);
        for tenant in ["t1", "t2"] {
            let statuses: Vec<u16> = (0..3)
                .map(|_| {
                    gw.admin(
                        "POST",
                        "/v1/decision",
                        &[("X-Original-URI", "/jobs"), ("X-Tenant", tenant)],
                    )
                    .status
                })
                .collect();
            assert_eq!(statuses, [200, 429, 429], "state dir {state_dir}, {tenant}");
        }
        let same: Vec<u16> = (0..12)
            .map(|_| gw.get("/l/same", &[("x-user", "u")]).status)
            .collect();
        let mut expected = vec![200u16; 9];
        expected.extend([429u16; 3]);
        assert_eq!(same, expected, "state dir {state_dir}");
        assert_eq!(gw.metric("tollgate_store_fail_open_total"), 0.0);
        if state_dir {
            assert!(state.join("loop-marks.state").is_file());
        }
    }
}
