//! Limit kinds beyond the token bucket, through the real binary: `cost_based` budgets (proxy and
//! decision service), loop detection and circuit breakers, runtime overrides, and Fairvisor
//! bundles (skipped policies, expiry).

use crate::support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use support::{request_with_body, Gateway, Upstream};

/// The example bundle with loop detection and a circuit breaker.
const AGENT_GUARDS: &str = include_str!("../policies/agent-guards.json");

/// A weekly budget of 5 with a warning at 40 % and a 300 ms throttle from 60 %.
const WEEKLY_BUDGET: &str = r#"{"bundle_version": "2026-11-22.1", "issued_at": "2026-11-22T00:00:00Z",
  "defaults": {"default_cost": 1},
  "policies": [{"id": "agents", "spec": {"selector": {"pathPrefix": "/v1/"}, "rules": [
    {"name": "weekly", "limit_keys": ["header:x_api_key"], "algorithm": "cost_based",
     "algorithm_config": {"budget": 5, "period": "7d", "cost_key": "fixed",
       "staged_actions": [{"threshold_percent": 40, "action": "warn"},
                          {"threshold_percent": 60, "action": "throttle", "delay_ms": 300},
                          {"threshold_percent": 100, "action": "reject"}]}}]}}]}"#;

/// Seconds from now to the end of the current week (Sunday 00:00 UTC).
fn secs_to_week_end() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let origin = 3 * 86_400;
    let week = 7 * 86_400;
    week - (now - origin) % week
}

#[test]
fn a_budget_warns_throttles_then_refuses_until_its_window_ends() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(WEEKLY_BUDGET), Some(upstream.addr), &[]);
    let key = [("X-Api-Key", "agent-1")];
    let r = gw.get("/v1/run", &key);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.header("RateLimit-Policy"),
        Some("\"weekly\";q=5;w=604800")
    );
    assert_eq!(r.header("RateLimit-Remaining"), Some("4"));
    assert_eq!(r.header("X-Tollgate-Warning"), None);
    let r = gw.get("/v1/run", &key);
    assert_eq!(r.header("X-Tollgate-Warning"), Some("budget_warn"));
    for remaining in ["2", "1", "0"] {
        let started = Instant::now();
        let r = gw.get("/v1/run", &key);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.header("X-Tollgate-Warning"), Some("budget_throttle"));
        assert_eq!(r.header("RateLimit-Remaining"), Some(remaining));
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "a throttled request waits its delay before going upstream"
        );
    }
    let before = secs_to_week_end();
    let r = gw.get("/v1/run", &key);
    let after = secs_to_week_end();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("budget_exceeded"));
    let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
    // Jittered toward earlier only: never past the week's end.
    assert!(
        retry <= before && retry >= after.div_ceil(2) - 1,
        "{retry} not within [{}, {before}]",
        after / 2
    );
    assert_eq!(
        upstream.hits(),
        5,
        "the refused request never reached upstream"
    );
    // Another key has its own budget.
    assert_eq!(gw.get("/v1/run", &[("X-Api-Key", "agent-2")]).status, 200);
    assert_eq!(
        gw.metric(
            "tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"agents\",reason=\"budget_exceeded\",rule=\"weekly\"}"
        ),
        1.0
    );
}

#[test]
fn the_decision_service_answers_budgets_the_same_way() {
    let gw = Gateway::start(Some(WEEKLY_BUDGET), None, &[]);
    let ask = || {
        gw.admin(
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/run"),
                ("X-Api-Key", "svc"),
            ],
        )
    };
    let statuses: Vec<u16> = (0..6).map(|_| ask().status).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
    let r = ask();
    assert_eq!(r.header("X-Tollgate-Reason"), Some("budget_exceeded"));
    assert_eq!(r.header("RateLimit-Remaining"), Some("0"));
}

#[test]
fn repeated_requests_are_caught_by_body_and_reach_the_upstream_unchanged() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(AGENT_GUARDS), Some(upstream.addr), &[]);
    let key = [
        ("X-Api-Key", "agent-7"),
        ("Content-Type", "application/json"),
    ];
    let post =
        |body: &str| request_with_body(gw.proxy, "POST", "/v1/agent/run", &key, body.as_bytes());
    for body in [r#"{"task": "a"}"#, r#"{"task": "b"}"#, r#"{"task": "a"}"#] {
        let r = post(body);
        assert_eq!(r.status, 200, "{r:?}");
        // The body was read to fingerprint it and still reached the upstream byte for byte.
        assert!(r.body.ends_with(&format!(" body={body}")), "{r:?}");
    }
    let started = Instant::now();
    let r = post(r#"{"task": "a"}"#);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("X-Tollgate-Reason"), Some("loop_detected"));
    // Until the first identical request leaves the 60 s window, jittered up to half again.
    let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
    let waited = started.elapsed().as_secs() + 2;
    assert!((60 - waited.min(60)..=90).contains(&retry), "{retry}");
    assert_eq!(upstream.hits(), 3, "the loop never reached the upstream");
    // Another key sending the same body is not in a loop.
    let r = request_with_body(
        gw.proxy,
        "POST",
        "/v1/agent/run",
        &[("X-Api-Key", "agent-8")],
        br#"{"task": "a"}"#,
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        gw.metric(
            "tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"agent-runs\",reason=\"loop_detected\",rule=\"loop_detection\"}"
        ),
        1.0
    );
    // A loop that only warns lets the request through, and still counts it against the key.
    let search = |q: &str| gw.get(&format!("/v1/search?{q}"), &[("X-Api-Key", "agent-7")]);
    assert_eq!(search("q=x&page=2").header("X-Tollgate-Warning"), None);
    assert_eq!(search("page=2&q=x").header("X-Tollgate-Warning"), None);
    let r = search("q=x&page=2");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("X-Tollgate-Warning"), Some("loop_warn"));
    assert_eq!(r.header("RateLimit-Remaining"), Some("37"));
}

#[test]
fn bodies_too_large_or_cut_short_are_never_lost_or_fatal() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(AGENT_GUARDS), Some(upstream.addr), &[]);
    // One byte over what is fingerprinted: streamed to the upstream unread, byte for byte.
    let big = "x".repeat(64 * 1024 + 1);
    let r = request_with_body(
        gw.proxy,
        "POST",
        "/v1/agent/run",
        &[("X-Api-Key", "big")],
        big.as_bytes(),
    );
    assert_eq!(r.status, 200);
    assert!(
        r.body.ends_with(&format!(" body={big}")),
        "{} bytes back",
        r.body.len()
    );
    // A client that declares 10 bytes, sends 3 and hangs up: no answer is owed, nothing breaks.
    let cut = b"POST /v1/agent/run HTTP/1.1\r\nHost: api.example.com\r\nX-Api-Key: cut\r\nContent-Length: 10\r\n\r\nabc";
    {
        let mut stream = std::net::TcpStream::connect(gw.proxy).unwrap();
        std::io::Write::write_all(&mut stream, cut).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut sink = Vec::new();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = std::io::Read::read_to_end(&mut stream, &mut sink);
    }
    // A Content-Length that is not a number is refused by the HTTP parser, not by us.
    let garbage = support::raw_exchange(
        gw.proxy,
        b"POST /v1/agent/run HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: ten\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(
        !garbage.is_empty() && garbage.iter().all(|r| r.status == 400),
        "{garbage:?}"
    );
    // The gateway still serves, and neither broken request left a loop mark behind.
    for _ in 0..2 {
        let r = request_with_body(
            gw.proxy,
            "POST",
            "/v1/agent/run",
            &[("X-Api-Key", "cut")],
            b"abc",
        );
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert_eq!(upstream.hits(), 3);
}

#[test]
fn a_runaway_spender_trips_the_breaker_and_is_locked_out() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(AGENT_GUARDS), Some(upstream.addr), &[]);
    let spend = |n: u32, cost: &str| {
        request_with_body(
            gw.proxy,
            "POST",
            &format!("/v1/agent/run?step={n}"),
            &[("X-Api-Key", "agent-9"), ("X-Cost", cost)],
            b"{}",
        )
    };
    assert_eq!(spend(1, "30").status, 200);
    // 60 within a minute is over the breaker's 50: this request trips it and is refused.
    let r = spend(2, "30");
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("X-Tollgate-Reason"), Some("circuit_breaker_open"));
    let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
    assert!((60..=90).contains(&retry), "{retry}");
    // Open: even a cheap request is refused, with the time left until it closes.
    let r = spend(3, "1");
    assert_eq!(r.header("X-Tollgate-Reason"), Some("circuit_breaker_open"));
    let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
    assert!((55..=90).contains(&retry), "{retry}");
    // Another key is not affected.
    let r = request_with_body(
        gw.proxy,
        "POST",
        "/v1/agent/run",
        &[("X-Api-Key", "agent-10"), ("X-Cost", "30")],
        b"{}",
    );
    assert_eq!(r.status, 200);
    assert_eq!(upstream.hits(), 2);
    assert_eq!(
        gw.metric("tollgate_circuit_breaker_trips_total{mode=\"enforce\",policy=\"agent-runs\"}"),
        1.0
    );
    let log = std::fs::read_to_string(&gw.log).unwrap();
    assert!(
        log.contains("CIRCUIT_BREAKER_OPEN") && log.contains("ERROR"),
        "an alerting breaker logs its trip at error level"
    );
}

#[test]
fn the_decision_service_fingerprints_the_bodies_it_is_sent() {
    let gw = Gateway::start(Some(AGENT_GUARDS), None, &[]);
    let ask = |body: &str| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/agent/run"),
                ("X-Api-Key", "svc"),
            ],
            body.as_bytes(),
        )
    };
    let statuses: Vec<u16> = ["one", "two", "one", "two", "one"]
        .iter()
        .map(|b| ask(b).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 429]);
    assert_eq!(
        ask("one").header("X-Tollgate-Reason"),
        Some("loop_detected")
    );
    assert_eq!(ask("three").status, 200);
}

#[test]
fn global_shadow_is_shown_and_switches_off_by_itself() {
    let soon = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 8;
    let expires = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(soon));
    let policy = format!(
        r#"{{"bundle_version": 9,
        "global_shadow": {{"enabled": true, "reason": "incident 42", "expires_at": "{expires}"}},
        "policies": [{{"id": "p", "spec": {{"rules": [
          {{"name": "tiny", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
            "algorithm_config": {{"rps": 0.001, "burst": 1}}}}]}}}}]}}"#
    );
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(&policy), Some(upstream.addr), &[]);
    let ready = gw.admin("GET", "/readyz", &[]);
    let body: serde_json::Value = serde_json::from_str(&ready.body).unwrap();
    assert_eq!(body["policy_version"], 9);
    assert_eq!(
        body["runtime_overrides"]["global_shadow"],
        serde_json::json!({"active": true, "reason": "incident 42", "expires_at": expires.to_string()})
    );
    assert_eq!(
        gw.metric("tollgate_runtime_override_active{override=\"global_shadow\"}"),
        1.0
    );
    // In shadow: nothing is refused, the would-be refusals are counted.
    for _ in 0..3 {
        assert_eq!(gw.get("/", &[]).status, 200);
    }
    assert_eq!(
        gw.metric("tollgate_shadow_would_reject_total{policy=\"p\",rule=\"tiny\"}"),
        2.0
    );
    // At expires_at the policy enforces again, with no reload.
    gw.wait_until(Duration::from_secs(10), || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            >= soon
    });
    assert_eq!(gw.get("/", &[]).status, 200);
    assert_eq!(gw.get("/", &[]).status, 429);
    assert_eq!(
        gw.metric("tollgate_runtime_override_active{override=\"global_shadow\"}"),
        0.0
    );
}

const ONE_BAD_POLICY: &str = r#"{"bundle_version": 1, "policies": [
  {"id": "broken", "spec": {"rules": [{"name": "x", "limit_keys": ["ip:address"], "algorithm": "sliding_log",
                                       "algorithm_config": {"rps": 1, "burst": 1}}]}},
  {"id": "per-ip", "spec": {"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                                       "algorithm_config": {"rps": 0.001, "burst": 1}}]}}]}"#;

#[test]
fn skip_invalid_policies_loads_the_rest_and_says_so() {
    // By default one bad policy refuses the bundle: no policy, decisions answer 503.
    let strict = Gateway::start(Some(ONE_BAD_POLICY), None, &[]);
    assert_eq!(strict.admin("GET", "/readyz", &[]).status, 503);
    assert!(strict
        .log_text()
        .contains("policies[0].spec.rules[0].algorithm: unknown algorithm 'sliding_log'"));
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(ONE_BAD_POLICY),
        Some(upstream.addr),
        &["--skip-invalid-policies"],
    );
    let ready = gw.admin("GET", "/readyz", &[]);
    assert_eq!(ready.status, 200);
    let body: serde_json::Value = serde_json::from_str(&ready.body).unwrap();
    assert_eq!(body["skipped_policies"][0]["id"], "broken");
    assert_eq!(body["skipped_policies"][0]["path"], "policies[0]");
    assert_eq!(gw.metric("tollgate_policies_skipped"), 1.0);
    assert!(gw
        .log_text()
        .contains("policy skipped (--skip-invalid-policies)"));
    assert_eq!(gw.get("/", &[]).status, 200);
    assert_eq!(gw.get("/", &[]).status, 429);
}

/// Every policy of the bundle invalid.
const ALL_BAD_POLICIES: &str = r#"{"bundle_version": 1, "policies": [
  {"id": "broken", "spec": {"rules": [{"name": "x", "limit_keys": ["ip:address"], "algorithm": "sliding_log",
                                       "algorithm_config": {"rps": 1, "burst": 1}}]}}]}"#;

/// A policy file that puts nothing in force (every policy skipped, or none listed) would proxy
/// everything unlimited: start-up stops with exit code 1 naming the file and why, unless
/// `--allow-empty-policy`.
#[test]
fn a_policy_file_enforcing_nothing_stops_start_up_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let skipped = dir.path().join("skipped.json");
    std::fs::write(&skipped, ALL_BAD_POLICIES).unwrap();
    let stderr = support::refused_start(
        &skipped,
        &["--listen", "127.0.0.1:0", "--skip-invalid-policies"],
    );
    assert!(
        stderr.contains(&format!(
            "tollgate: {}: no policy and no kill switch to enforce (all 1 of its policies were left out by --skip-invalid-policies): every request would be proxied unlimited; fix the file, or run with --allow-empty-policy if that is meant",
            skipped.display()
        )),
        "{stderr}"
    );
    let empty = dir.path().join("empty.json");
    std::fs::write(&empty, r#"{"bundle_version": 1, "policies": []}"#).unwrap();
    let stderr = support::refused_start(&empty, &["--listen", "127.0.0.1:0"]);
    assert!(
        stderr.contains(&format!(
            "tollgate: {}: no policy and no kill switch to enforce (the bundle lists none)",
            empty.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("decisions answer 503"), "{stderr}");

    // Told so, the gateway starts on it and proxies.
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(ALL_BAD_POLICIES),
        Some(upstream.addr),
        &["--skip-invalid-policies", "--allow-empty-policy"],
    );
    assert_eq!(gw.admin("GET", "/readyz", &[]).status, 200);
    assert_eq!(gw.get("/", &[]).status, 200);
    assert_eq!(gw.get("/", &[]).status, 200);
}

/// A reload to a file that puts nothing in force is refused: the last good bundle stays in
/// force (still limiting), the reload is counted as failed and logged at error level.
#[test]
fn a_reload_to_a_policy_enforcing_nothing_keeps_the_last_good_one() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(ONE_BAD_POLICY),
        Some(upstream.addr),
        &["--skip-invalid-policies", "--policy-poll-secs", "1"],
    );
    assert_eq!(gw.get("/", &[]).status, 200);
    gw.write_policy(&ALL_BAD_POLICIES.replace("\"bundle_version\": 1", "\"bundle_version\": 2"));
    gw.wait_for_log("policy reload rejected, keeping bundle_version 1");
    assert!(
        gw.log_text()
            .contains("no policy and no kill switch to enforce (all 1 of its policies were left out by --skip-invalid-policies)"),
        "{}",
        gw.log_text()
    );
    assert_eq!(
        gw.metric("tollgate_policy_reloads_total{result=\"failure\"}"),
        1.0
    );
    let ready: serde_json::Value =
        serde_json::from_str(&gw.admin("GET", "/readyz", &[]).body).unwrap();
    assert_eq!(ready["policy_version"], 1);
    // The per-ip rule of bundle 1 still limits: its one token is spent.
    assert_eq!(gw.get("/", &[]).status, 429);
}

#[test]
fn an_expired_bundle_is_refused_with_a_clear_error() {
    let expired = r#"{"bundle_version": 1, "expires_at": "2020-01-01T00:00:00Z", "policies": []}"#;
    // An empty bundle is accepted below only because the test says so.
    let gw = Gateway::start(Some(expired), None, &["--allow-empty-policy"]);
    assert_eq!(gw.admin("GET", "/readyz", &[]).status, 503);
    assert!(
        gw.log_text()
            .contains("expires_at: 2020-01-01T00:00:00Z has passed: this bundle is expired"),
        "{}",
        gw.log_text()
    );
    // A later good bundle loads over it.
    gw.write_policy(r#"{"bundle_version": 2, "policies": []}"#);
    gw.wait_until(Duration::from_secs(10), || {
        gw.admin("GET", "/readyz", &[]).status == 200
    });
}

#[tokio::test]
async fn budget_windows_and_leases_on_the_embedded_store() {
    let store = tollgate::store::Store::memory(
        tollgate::store::MemoryStoreConfig::default(),
        std::sync::Arc::new(tollgate::limits::clock::SystemClock::new()),
    );
    support::assert_budget_windows(&store, "memory").await;
    support::assert_settlements(&store, "memory").await;
    support::assert_leases(&store, "memory").await;
}

/// An upstream that answers `/hold` only when told to (one answer per `release`), closes `/die`
/// without answering, and answers anything else at once. Counts requests seen.
struct HoldingUpstream {
    addr: std::net::SocketAddr,
    release: std::sync::mpsc::Sender<()>,
    seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl HoldingUpstream {
    fn start() -> HoldingUpstream {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = std::sync::Arc::new(std::sync::Mutex::new(gate));
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let gate = gate.clone();
                let counter = counter.clone();
                std::thread::spawn(move || loop {
                    let mut buf = [0u8; 4096];
                    let mut got = Vec::new();
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    counter.fetch_add(1, Ordering::SeqCst);
                    let head = String::from_utf8_lossy(&got).to_string();
                    if head.starts_with("GET /die") {
                        return;
                    }
                    if head.starts_with("GET /hold") {
                        let _ = gate.lock().unwrap().recv_timeout(Duration::from_secs(20));
                    }
                    let body = "upstream ok\n";
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if stream.write_all(reply.as_bytes()).is_err() {
                        return;
                    }
                });
            }
        });
        HoldingUpstream {
            addr,
            release,
            seen,
        }
    }

    fn seen(&self) -> usize {
        self.seen.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Seed 004's profile limits in one policy: 15 r/s with a burst of 30, and 7 requests in flight,
/// per profile (here: per API key).
const PROFILE_LIMITS: &str = r#"{"bundle_version": 1, "policies": [{"id": "profile", "spec": {"rules": [
  {"name": "profile-rate", "limit_keys": ["header:x-profile"], "on_missing": "reject", "algorithm": "token_bucket",
   "algorithm_config": {"rps": 15, "burst": 30}},
  {"name": "profile-connections", "limit_keys": ["header:x-profile"], "on_missing": "reject", "algorithm": "concurrency",
   "algorithm_config": {"max_in_flight": 2, "lease_ttl_seconds": 60}}]}}]}"#;

fn get_in_thread(
    gw: &Gateway,
    path: &'static str,
    profile: &'static str,
) -> std::thread::JoinHandle<u16> {
    let addr = gw.proxy;
    std::thread::spawn(move || {
        support::request(addr, "GET", path, &[("X-Profile", profile)]).status
    })
}

#[test]
fn concurrency_slots_are_held_until_the_response_is_done() {
    let upstream = HoldingUpstream::start();
    // Nothing refills during the test, so the token count shows what was spent.
    let slow = PROFILE_LIMITS.replace("\"rps\": 15", "\"rps\": 0.001");
    let gw = Gateway::start(Some(&slow), Some(upstream.addr), &[]);
    let first = get_in_thread(&gw, "/hold", "p1");
    let second = get_in_thread(&gw, "/hold", "p1");
    gw.wait_until(Duration::from_secs(10), || upstream.seen() == 2);
    // Both slots are taken: refused at once, and no token spent on it.
    let r = gw.get("/fast", &[("X-Profile", "p1")]);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("X-Tollgate-Reason"), Some("concurrency_exceeded"));
    assert_eq!(
        r.header("Retry-After").map(|v| v == "1" || v == "2"),
        Some(true)
    );
    // Another profile has its own slots.
    assert_eq!(gw.get("/fast", &[("X-Profile", "p2")]).status, 200);
    upstream.release.send(()).unwrap();
    upstream.release.send(()).unwrap();
    assert_eq!((first.join().unwrap(), second.join().unwrap()), (200, 200));
    // Both answered: both slots are back.
    let ok = gw.get("/fast", &[("X-Profile", "p1")]);
    assert_eq!(ok.status, 200, "{ok:?}");
    // 2 held + 1 fast: the refused request never spent a token (30 - 3 = 27 left).
    assert_eq!(ok.header("RateLimit-Remaining"), Some("27"));
    assert_eq!(
        gw.metric("tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"profile\",reason=\"concurrency_exceeded\",rule=\"profile-connections\"}"),
        1.0
    );
}

#[test]
fn a_client_that_goes_away_or_a_failing_upstream_gives_its_slot_back() {
    use std::io::Write;
    let upstream = HoldingUpstream::start();
    let one_slot = PROFILE_LIMITS.replace("\"max_in_flight\": 2", "\"max_in_flight\": 1");
    let gw = Gateway::start(Some(&one_slot), Some(upstream.addr), &[]);
    // The upstream fails (closes without answering): 502, and the slot is free again.
    let r = gw.get("/die", &[("X-Profile", "p")]);
    assert_eq!(r.status, 502);
    assert_eq!(gw.get("/fast", &[("X-Profile", "p")]).status, 200);
    // A client sends a request and goes away while the upstream still works on it.
    let mut client = std::net::TcpStream::connect(gw.proxy).unwrap();
    client
        .write_all(b"GET /hold HTTP/1.1\r\nHost: x\r\nX-Profile: p\r\n\r\n")
        .unwrap();
    let seen = upstream.seen();
    gw.wait_until(Duration::from_secs(10), || upstream.seen() > seen);
    assert_eq!(gw.get("/fast", &[("X-Profile", "p")]).status, 429);
    drop(client);
    upstream.release.send(()).unwrap();
    // The response finds nobody to go to; the request ends and its slot is given back.
    gw.wait_until(Duration::from_secs(10), || {
        gw.get("/fast", &[("X-Profile", "p")]).status == 200
    });
}

#[test]
fn the_decision_service_hands_out_leases_to_give_back() {
    let policy = r#"{"rules": [{"name": "jobs", "limit_keys": ["header:x-tenant"], "on_missing": "shared",
        "algorithm": "concurrency", "algorithm_config": {"max_in_flight": 1, "lease_ttl_seconds": 2}}]}"#;
    let gw = Gateway::start(Some(policy), None, &[]);
    let ask = || {
        gw.admin(
            "POST",
            "/v1/decision",
            &[("X-Original-URI", "/jobs"), ("X-Tenant", "t1")],
        )
    };
    let r = ask();
    assert_eq!(r.status, 200);
    let token = r.header("X-Tollgate-Lease").unwrap().to_string();
    assert_eq!(r.header("X-Tollgate-Lease-Ttl"), Some("2"));
    let refused = ask();
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("X-Tollgate-Lease"), None);
    // Given back early: the slot is free at once.
    let released = gw.admin("POST", "/v1/release", &[("X-Tollgate-Lease", &token)]);
    assert_eq!(released.status, 204);
    assert_eq!(
        gw.admin("POST", "/v1/release", &[("X-Tollgate-Lease", "nonsense")])
            .status,
        400
    );
    assert_eq!(ask().status, 200);
    // Never given back: free after the lease's 2 s.
    assert_eq!(ask().status, 429);
    let started = Instant::now();
    gw.wait_until(Duration::from_secs(10), || ask().status == 200);
    assert!(started.elapsed() >= Duration::from_millis(1500));
}

#[test]
fn a_request_refused_by_a_bucket_holds_no_slot() {
    let policy = r#"{"rules": [
        {"name": "one-at-a-time", "limit_keys": ["header:x-tenant"], "on_missing": "shared",
         "algorithm": "concurrency", "algorithm_config": {"max_in_flight": 1}},
        {"name": "one-token", "limit_keys": ["header:x-tenant"], "on_missing": "shared",
         "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 1}}]}"#;
    let gw = Gateway::start(Some(policy), None, &[]);
    let ask = || {
        gw.admin(
            "POST",
            "/v1/decision",
            &[("X-Original-URI", "/jobs"), ("X-Tenant", "t1")],
        )
    };
    let first = ask();
    assert_eq!(first.status, 200);
    let token = first.header("X-Tollgate-Lease").unwrap().to_string();
    assert_eq!(
        gw.admin("POST", "/v1/release", &[("X-Tollgate-Lease", &token)])
            .status,
        204
    );
    // Out of tokens: refused by the bucket, twice. Had the first refusal kept its slot, the
    // second would be refused for concurrency instead.
    for _ in 0..2 {
        let r = ask();
        assert_eq!(r.status, 429);
        assert_eq!(r.header("X-Tollgate-Reason"), Some("token_bucket_exceeded"));
        assert_eq!(r.header("X-Tollgate-Lease"), None);
    }
}

/// The status line of what the proxy says first on a fresh connection that sent nothing yet
/// but a request line (the 429 of a refused connection is written at accept).
fn first_status(stream: &mut std::net::TcpStream) -> Option<u16> {
    use std::io::{Read, Write};
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = stream.write_all(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut buf = [0u8; 512];
    let n = stream.read(&mut buf).ok()?;
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    head.split(' ').nth(1)?.parse().ok()
}

/// `n` connections to the proxy, each served one request (so each is surely accepted), held open.
fn open_served_connections(gw: &Gateway, n: usize) -> Vec<std::net::TcpStream> {
    let mut held: Vec<std::net::TcpStream> = (0..n)
        .map(|_| std::net::TcpStream::connect(gw.proxy).unwrap())
        .collect();
    for stream in &mut held {
        assert_eq!(first_status(stream), Some(200));
    }
    held
}

#[test]
fn connections_are_capped_per_client_address() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(r#"{"rules": []}"#),
        Some(upstream.addr),
        &["--max-connections-per-ip", "2"],
    );
    let mut held = open_served_connections(&gw, 2);
    let mut third = std::net::TcpStream::connect(gw.proxy).unwrap();
    let refused = {
        use std::io::Read;
        third
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut text = String::new();
        let _ = third.read_to_string(&mut text);
        text
    };
    assert!(refused.starts_with("HTTP/1.1 429 "), "{refused}");
    assert!(
        refused.contains("X-Tollgate-Reason: connection_limit"),
        "{refused}"
    );
    assert_eq!(
        gw.metric("tollgate_connections_refused_total{cap=\"per_ip\"}"),
        1.0
    );
    // One closes: a new connection is accepted again.
    held.pop();
    gw.wait_until(Duration::from_secs(10), || {
        let mut s = std::net::TcpStream::connect(gw.proxy).unwrap();
        first_status(&mut s) == Some(200)
    });
}

#[test]
fn trusted_proxies_are_not_capped_per_address() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(r#"{"rules": []}"#),
        Some(upstream.addr),
        &[
            "--max-connections-per-ip",
            "1",
            "--trusted-proxy",
            "127.0.0.1/32",
        ],
    );
    open_served_connections(&gw, 3);
}
