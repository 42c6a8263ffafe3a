//! The real `tollgate run` binary in front of a real upstream, over loopback HTTP.

use crate::support;

use std::time::Duration;
use support::{one_rule, request, Gateway, Upstream};

/// A rate so slow that nothing refills during a test: results do not depend on timing.
const SLOW: f64 = 0.001;

#[test]
fn burst_then_429_with_every_header_and_upstream_never_sees_rejections() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 3.0)),
        Some(upstream.addr),
        &[],
    );
    for expected_remaining in [2, 1, 0] {
        let r = gw.get("/items?x=1", &[]);
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.body.starts_with("upstream ok"));
        assert_eq!(
            r.header("X-Upstream"),
            Some("yes"),
            "the upstream's own headers pass through"
        );
        assert_eq!(r.header("RateLimit-Policy"), Some("\"per-ip\";q=3;w=3000"));
        assert_eq!(r.header("RateLimit-Limit"), Some("3"));
        assert_eq!(
            r.header("RateLimit-Remaining").map(str::to_string),
            Some(expected_remaining.to_string())
        );
        assert!(r
            .header("RateLimit")
            .unwrap()
            .starts_with(&format!("\"per-ip\";r={expected_remaining};t=")));
        assert_eq!(r.header("Retry-After"), None);
    }
    assert_eq!(upstream.hits(), 3);
    for _ in 0..5 {
        let r = gw.get("/items", &[]);
        assert_eq!(r.status, 429);
        assert_eq!(r.body, "Too Many Requests");
        assert_eq!(r.header("RateLimit-Remaining"), Some("0"));
        assert_eq!(r.header("RateLimit-Limit"), Some("3"));
        // 1 token at 0.001/s: 1000 s, Retry-After within [1000, 1500].
        assert_eq!(r.header("RateLimit-Reset"), Some("1000"));
        assert_eq!(r.header("RateLimit"), Some("\"per-ip\";r=0;t=1000"));
        let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
        assert!((1000..=1500).contains(&retry), "Retry-After {retry}");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("token_bucket_exceeded"));
    }
    assert_eq!(
        upstream.hits(),
        3,
        "rejected requests must never reach the upstream"
    );
    // Same client, same jitter.
    let a = gw
        .get("/items", &[])
        .header("Retry-After")
        .map(str::to_string);
    let b = gw
        .get("/items", &[])
        .header("Retry-After")
        .map(str::to_string);
    assert_eq!(a, b);
    // RATE_LIMIT lines are written in batches, within 20 ms of the refusal.
    gw.wait_until(Duration::from_secs(5), || {
        gw.log_text().contains("RATE_LIMIT")
    });
    let log = gw.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("RATE_LIMIT"))
        .expect("a RATE_LIMIT log line");
    for field in [
        "client_ip=127.0.0.1",
        "host=api.example.com",
        "path=/items",
        "status=429",
        "policy=policy",
        "rule=per-ip",
        "reason=token_bucket_exceeded",
    ] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
    assert!(
        !log.contains("path=/items?x=1"),
        "allowed requests are not logged"
    );
}

#[test]
fn shadow_mode_never_rejects_and_adds_no_headers() {
    let upstream = Upstream::start();
    let policy = format!(
        r#"{{"bundle_version": 2, "policies": [{{"id": "trial", "spec": {{"mode": "shadow", "rules": [
            {{"name": "shadow-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
              "algorithm_config": {{"rps": {SLOW}, "burst": 2}}}}]}}}}]}}"#
    );
    let gw = Gateway::start(Some(&policy), Some(upstream.addr), &[]);
    for _ in 0..6 {
        let r = gw.get("/", &[]);
        assert_eq!(r.status, 200);
        assert!(r.header("RateLimit").is_none() && r.header("RateLimit-Limit").is_none());
    }
    assert_eq!(upstream.hits(), 6);
    assert_eq!(
        gw.metric("tollgate_shadow_would_reject_total{policy=\"trial\",rule=\"shadow-ip\"}"),
        4.0
    );
    let shadow_lines = || {
        gw.log_text()
            .lines()
            .filter(|l| l.contains("RATE_LIMIT") && l.contains("mode=shadow"))
            .count()
    };
    gw.wait_until(Duration::from_secs(5), || shadow_lines() >= 4);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(shadow_lines(), 4);
}

#[test]
fn decision_service_statuses_and_headers() {
    let policy = r#"{"bundle_version": 5, "policies": [{"id": "svc", "spec": {"selector": {"pathPrefix": "/api"}, "rules": [
        {"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket",
         "algorithm_config": {"rps": 0.001, "burst": 2, "cost_source": "query:cost"}}]}}]}"#;
    let gw = Gateway::start(Some(policy), None, &[]);
    let ask = |uri: &str, key: &str| {
        gw.admin(
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "GET"),
                ("X-Original-URI", uri),
                ("X-Original-Host", "api.example.com"),
                ("X-Api-Key", key),
            ],
        )
    };
    let r = ask("/api/a", "k1");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("RateLimit-Remaining"), Some("1"));
    // Cost read from the original URI's query: 2 > 1 left.
    let r = ask("/api/a?cost=2", "k1");
    assert_eq!(r.status, 429);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("token_bucket_exceeded"));
    assert!(r.header("Retry-After").is_some());
    assert_eq!(ask("/api/a", "k1").status, 200);
    assert_eq!(ask("/api/a", "k1").status, 429);
    // Another key, and a path outside the selector.
    assert_eq!(ask("/api/a", "k2").status, 200);
    assert_eq!(ask("/other", "k1").status, 200);
    // Envoy ext_authz form: original method and path after the prefix.
    let r = gw.admin("GET", "/v1/decision/api/b", &[("X-Api-Key", "k1")]);
    assert_eq!(r.status, 429);
    assert_eq!(gw.admin("GET", "/v1/decision", &[]).status, 405);
    assert_eq!(
        gw.admin("GET", "/v1/decision", &[]).header("Allow"),
        Some("POST")
    );
    assert_eq!(gw.admin("GET", "/nope", &[]).status, 404);
    assert_eq!(gw.admin("GET", "/livez", &[]).body, "ok");
    let ready = gw.admin("GET", "/readyz", &[]);
    assert_eq!(ready.status, 200);
    let v: serde_json::Value = serde_json::from_str(&ready.body).unwrap();
    assert_eq!(v["status"], "ready");
    assert_eq!(v["policy_version"], 5);
    assert_eq!(v["policy_hash"].as_str().unwrap().len(), 16);
    // Counters moved.
    assert_eq!(gw.metric("tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"svc\",reason=\"token_bucket_exceeded\",rule=\"per-key\"}"), 3.0);
    assert_eq!(
        gw.metric("tollgate_requests_total{action=\"allow\",reason=\"\"}"),
        4.0
    );
    assert!(gw.metric("tollgate_decision_duration_seconds_count") >= 7.0);
    assert_eq!(gw.metric("tollgate_store_entries"), 2.0);
}

#[test]
fn no_policy_means_503_until_a_valid_file_appears() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        None,
        Some(upstream.addr),
        &["--policy-poll-secs", "1", "--wait-for-policy"],
    );
    assert_eq!(gw.admin("POST", "/v1/decision", &[]).status, 503);
    let ready = gw.admin("GET", "/readyz", &[]);
    assert_eq!(ready.status, 503);
    assert_eq!(
        ready.body,
        r#"{"reason":"no_policy_loaded","status":"not_ready"}"#
    );
    // The proxy fails open meanwhile.
    assert_eq!(gw.get("/", &[]).status, 200);
    gw.write_policy(&one_rule("late", "[]", SLOW, 1.0));
    gw.wait_until(Duration::from_secs(15), || {
        gw.admin("GET", "/readyz", &[]).status == 200
    });
    assert_eq!(gw.admin("POST", "/v1/decision", &[]).status, 200);
    assert_eq!(gw.admin("POST", "/v1/decision", &[]).status, 429);
}

#[test]
fn forwarded_for_is_trusted_only_from_trusted_proxies() {
    let upstream = Upstream::start();
    let policy = one_rule("per-ip", r#"["ip:address"]"#, SLOW, 1.0);
    // Untrusted peer: X-Forwarded-For is ignored, every request is 127.0.0.1.
    let gw = Gateway::start(Some(&policy), Some(upstream.addr), &[]);
    assert_eq!(
        gw.get("/", &[("X-Forwarded-For", "198.51.100.1")]).status,
        200
    );
    assert_eq!(
        gw.get("/", &[("X-Forwarded-For", "198.51.100.2")]).status,
        429
    );
    drop(gw);
    // Trusted loopback proxy: the rightmost untrusted hop is the client.
    let gw = Gateway::start(
        Some(&policy),
        Some(upstream.addr),
        &["--trusted-proxy", "127.0.0.0/8"],
    );
    let r = gw.get("/", &[("X-Forwarded-For", "6.6.6.6, 198.51.100.1")]);
    assert_eq!(r.status, 200);
    // The upstream sees the chain with the hop we saw (the TCP peer) appended.
    assert!(
        r.body
            .contains("x-forwarded-for=6.6.6.6, 198.51.100.1, 127.0.0.1"),
        "{}",
        r.body
    );
    // A spoofed leftmost hop does not buy a fresh bucket.
    assert_eq!(
        gw.get("/", &[("X-Forwarded-For", "7.7.7.7, 198.51.100.1")])
            .status,
        429
    );
    // A proxy that adds its own line rather than appending: all lines form one chain, the
    // client's own line first, so the client still cannot choose its address.
    let r = gw.get(
        "/",
        &[
            ("X-Forwarded-For", "8.8.8.8"),
            ("X-Forwarded-For", "198.51.100.1"),
        ],
    );
    assert_eq!(
        r.status, 429,
        "two lines are one chain: the client is 198.51.100.1"
    );
    assert_eq!(
        gw.get("/", &[("X-Forwarded-For", "198.51.100.2")]).status,
        200
    );
    gw.wait_for_log("client_ip=198.51.100.1");
}

#[test]
fn ipv6_clients_share_their_64() {
    let upstream = Upstream::start();
    let policy = one_rule("per-ip", r#"["ip:address"]"#, SLOW, 2.0);
    let gw = Gateway::start_on(
        "::1",
        Some(&policy),
        Some(upstream.addr),
        &["--trusted-proxy", "::1/128"],
    );
    let from = |xff: &str| request(gw.proxy, "GET", "/", &[("X-Forwarded-For", xff)]).status;
    assert_eq!(from("2001:db8:1:2::a"), 200);
    assert_eq!(from("2001:db8:1:2:ffff::b"), 200);
    assert_eq!(from("2001:db8:1:2::c"), 429, "same /64, same bucket");
    assert_eq!(from("2001:db8:1:3::a"), 200, "another /64");
    // Direct from ::1 (no header): its own /64 bucket.
    let direct = request(gw.proxy, "GET", "/", &[]);
    assert_eq!(direct.status, 200);
    gw.wait_for_log("client_ip=2001:db8:1:2::c");
}

#[test]
fn reload_valid_and_invalid_files_keeps_buckets() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 5.0)),
        Some(upstream.addr),
        &["--policy-poll-secs", "0"],
    );
    for _ in 0..3 {
        assert_eq!(gw.get("/", &[]).status, 200);
    }
    let hash_before = gw.admin("GET", "/readyz", &[]).body;
    // Invalid file + SIGHUP: error logged, failure counted, old bundle stays.
    gw.write_policy(r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:adress"], "algorithm": "token_bucket", "algorithm_config": {"rps": 0, "burst": 5}}]}"#);
    gw.signal(libc::SIGHUP);
    gw.wait_until(Duration::from_secs(10), || {
        gw.metric("tollgate_policy_reloads_total{result=\"failure\"}") == 1.0
    });
    // The failure is counted before its line is written.
    gw.wait_for_log("policy reload rejected");
    let log = gw.log_text();
    assert!(log.contains("policy reload rejected"), "{log}");
    assert!(
        log.contains("rules[0].limit_keys[0]: unknown descriptor 'ip:adress'"),
        "{log}"
    );
    assert!(
        log.contains("rules[0].algorithm_config.rps: must be > 0"),
        "{log}"
    );
    assert_eq!(gw.admin("GET", "/readyz", &[]).body, hash_before);
    let r = gw.get("/", &[]);
    assert_eq!(
        r.header("RateLimit-Remaining"),
        Some("1"),
        "buckets and bundle unchanged"
    );
    // Valid file with a lowered burst: state survives and is capped (1 left, burst now 3 → 1).
    gw.write_policy(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 3.0));
    gw.signal(libc::SIGHUP);
    // The bundle is put in force before the reload is counted: wait for the count.
    gw.wait_until(Duration::from_secs(10), || {
        gw.metric("tollgate_policy_reloads_total{result=\"success\"}") == 2.0
    });
    assert_ne!(gw.admin("GET", "/readyz", &[]).body, hash_before);
    let r = gw.get("/", &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("RateLimit-Remaining"), Some("0"));
    assert_eq!(r.header("RateLimit-Limit"), Some("3"));
    assert_eq!(gw.get("/", &[]).status, 429);
    assert_eq!(
        gw.metric("tollgate_policy_reloads_total{result=\"success\"}"),
        2.0
    );
}

#[test]
fn policy_file_changes_are_picked_up_without_a_signal() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("a", "[]", SLOW, 1.0)),
        Some(upstream.addr),
        &["--policy-poll-secs", "1"],
    );
    assert_eq!(gw.get("/", &[]).status, 200);
    assert_eq!(gw.get("/", &[]).status, 429);
    gw.write_policy(&one_rule("b", "[]", SLOW, 10.0));
    gw.wait_until(Duration::from_secs(15), || gw.get("/", &[]).status == 200);
    assert_eq!(
        gw.get("/", &[]).header("RateLimit-Policy"),
        Some("\"b\";q=10;w=10000")
    );
}

#[test]
fn upstream_down_gives_502_and_the_gateway_keeps_serving() {
    let dead = support::free_port();
    let addr = format!("127.0.0.1:{dead}").parse().unwrap();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 100.0)),
        Some(addr),
        &[],
    );
    for _ in 0..3 {
        let r = gw.get("/", &[]);
        assert_eq!(r.status, 502);
        assert!(r.body.contains("upstream is unavailable"), "{}", r.body);
    }
    assert_eq!(gw.admin("GET", "/livez", &[]).status, 200);
}

#[test]
fn sigterm_drains_in_flight_requests() {
    let upstream = Upstream::start();
    let mut gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 100.0)),
        Some(upstream.addr),
        &[],
    );
    let proxy = gw.proxy;
    // The upstream answers 400 ms after it has the request: SIGTERM arrives mid-request, and
    // the answer comes well within the 1 s grace period.
    let in_flight = std::thread::spawn(move || request(proxy, "GET", "/slow400", &[]));
    // Wait until the upstream has the request, then ask the gateway to stop.
    gw.wait_until(Duration::from_secs(10), || upstream.hits() == 1);
    gw.signal(libc::SIGTERM);
    let r = in_flight.join().unwrap();
    assert_eq!(r.status, 200, "the in-flight request finishes");
    assert!(r.body.starts_with("upstream ok"));
    assert!(gw.wait_exit(Duration::from_secs(20)), "clean exit");
    assert!(gw.log_text().contains("SIGTERM: draining"));
}

#[test]
fn json_logs_are_machine_readable() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 1.0)),
        Some(upstream.addr),
        &["--log-format", "json"],
    );
    gw.get("/a", &[]);
    gw.get("/a", &[]);
    gw.wait_until(Duration::from_secs(5), || {
        gw.log_text().contains("RATE_LIMIT")
    });
    let log = gw.log_text();
    let line = log.lines().find(|l| l.contains("RATE_LIMIT")).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["message"], "RATE_LIMIT");
    assert_eq!(v["client_ip"], "127.0.0.1");
    assert_eq!(v["status"], 429);
    assert_eq!(v["rule"], "per-ip");
    assert_eq!(v["reason"], "token_bucket_exceeded");
}

#[test]
fn environment_variables_configure_the_gateway() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, SLOW, 1.0)),
        Some(upstream.addr),
        &["--reason-header", "X-Why"],
    );
    gw.get("/", &[]);
    assert_eq!(
        gw.get("/", &[]).header("X-Why"),
        Some("token_bucket_exceeded")
    );
    // Bad flags are refused with every problem named, before anything listens.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "run",
            "--policy",
            "/nonexistent.json",
            "--listen",
            "nowhere",
            "--trusted-proxy",
            "10.0.0.0/99",
        ])
        .env("TOLLGATE_ADMIN_LISTEN", "also-bad")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for part in [
        "--listen \"nowhere\"",
        "--admin-listen \"also-bad\"",
        "--trusted-proxy \"10.0.0.0/99\"",
    ] {
        assert!(err.contains(part), "{part} missing from {err}");
    }
}

#[test]
fn other_spellings_of_a_path_do_not_escape_selectors_or_kill_switches() {
    let upstream = Upstream::start();
    let policy = format!(
        r#"{{"bundle_version": 1, "policies": [{{"id": "api", "spec": {{"selector": {{"pathPrefix": "/api"}}, "rules": [
            {{"name": "api-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {{"rps": {SLOW}, "burst": 1}}}}]}}}}],
           "kill_switches": [{{"scope_key": "host", "scope_value": "API.example.com", "route": "/v1/inference", "reason": "incident"}}]}}"#
    );
    let gw = Gateway::start(Some(&policy), Some(upstream.addr), &[]);
    assert_eq!(gw.get("/api/x", &[]).status, 200);
    for spelling in ["//api/x", "/%61pi/x", "/static/../api/x", "/./api/x"] {
        assert_eq!(
            gw.get(spelling, &[]).status,
            429,
            "{spelling} must meet the /api limit"
        );
    }
    assert_eq!(gw.get("/apix", &[]).status, 200);
    // Kill switch: host compared without case or trailing dot, route after normalisation.
    for spelling in ["/v1/inference", "/v1//inference/run", "/v1/./inference"] {
        let r = gw.get(spelling, &[("Host", "api.example.com.")]);
        assert_eq!(r.status, 429, "{spelling}");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("kill_switch"));
        assert_eq!(r.header("RateLimit-Remaining"), Some("0"));
        assert_eq!(r.header("RateLimit-Reset"), Some("60"));
        let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
        assert!((60..=90).contains(&retry));
    }
    assert_eq!(
        gw.get("/v1/inference", &[("Host", "other.example.com")])
            .status,
        200
    );
}
