//! `--compat fairvisor` through the real binary, as Fairvisor Edge's own end-to-end suite checks
//! it (the tests are ours): the reason header hidden unless a debug session is open, the debug
//! session round trip and its verbose headers, the warning header's name, the `fairvisor_*`
//! metrics, unverified tokens with a header segment that is not JSON, and nothing of this
//! without the switch. Beyond Fairvisor: debug sessions as strong as the admin token (a secret
//! of 16 characters or more, or its file; failed logins counted and throttled per client;
//! cookies nobody can make offline; logout ending the session).

use crate::support;

use base64::Engine as _;
use support::{request, Gateway, HttpResponse};

const SECRET: &str = "e2e-debug-secret";

/// Fairvisor's e2e bundle shape: a burst of 2 per `X-E2E-Key`, a budget that warns at half.
const POLICY: &str = r#"{"bundle_version": 1, "policies": [
  {"id": "e2e-policy", "spec": {"selector": {"pathPrefix": "/api"}, "rules": [
    {"name": "e2e-rule", "limit_keys": ["header:x-e2e-key"], "algorithm": "token_bucket",
     "algorithm_config": {"tokens_per_second": 0.001, "burst": 2}}]}},
  {"id": "budgets", "spec": {"selector": {"pathPrefix": "/budget"}, "rules": [
    {"name": "monthly", "limit_keys": ["jwt:sub"], "algorithm": "cost_based",
     "algorithm_config": {"budget": 4, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
       "staged_actions": [{"threshold_percent": 50, "action": "warn"}, {"threshold_percent": 100, "action": "reject"}]}}]}}]}"#;

fn compat(extra: &[&str]) -> Gateway {
    let mut flags = vec!["--compat", "fairvisor"];
    flags.extend_from_slice(extra);
    Gateway::start(Some(POLICY), None, &flags)
}

/// Decisions for `/api/v1/chat` with `key` until a 429 (at most 10).
fn exhaust(gw: &Gateway, key: &str, cookie: Option<&str>) -> HttpResponse {
    let mut headers = vec![("X-Original-URI", "/api/v1/chat"), ("X-E2E-Key", key)];
    if let Some(c) = cookie {
        headers.push(("Cookie", c));
    }
    for _ in 0..10 {
        let r = request(gw.admin, "POST", "/v1/decision", &headers);
        if r.status == 429 {
            return r;
        }
    }
    panic!("no 429 after 10 requests");
}

#[test]
fn the_reason_header_is_hidden_without_a_debug_session() {
    let gw = compat(&["--debug-session-secret", SECRET]);
    let r = exhaust(&gw, "no-debug", None);
    for hidden in [
        "X-Fairvisor-Reason",
        "X-Tollgate-Reason",
        "X-Fairvisor-Policy",
        "X-Fairvisor-Rule",
        "X-Fairvisor-Decision",
    ] {
        assert_eq!(r.header(hidden), None, "{hidden}: {r:?}");
    }
    for shown in [
        "Retry-After",
        "RateLimit",
        "RateLimit-Limit",
        "RateLimit-Remaining",
        "RateLimit-Reset",
    ] {
        assert!(r.header(shown).is_some(), "{shown}: {r:?}");
    }
    let ratelimit = r.header("RateLimit").unwrap();
    assert!(
        ratelimit.contains(";r=") && ratelimit.contains(";t="),
        "{ratelimit}"
    );
}

#[test]
fn a_debug_session_shows_the_verbose_headers_until_logout() {
    let gw = compat(&["--debug-session-secret", SECRET]);
    let wrong = request(
        gw.admin,
        "POST",
        "/v1/debug/session",
        &[("X-Fairvisor-Debug-Secret", "not-the-secret")],
    );
    assert_eq!(wrong.status, 403);
    assert_eq!(wrong.body, r#"{"error":"debug_secret_invalid"}"#);
    assert_eq!(
        request(gw.admin, "POST", "/v1/debug/session", &[]).status,
        403
    );
    assert_eq!(
        request(gw.admin, "GET", "/v1/debug/session", &[]).status,
        405
    );

    let login = request(
        gw.admin,
        "POST",
        "/v1/debug/session",
        &[("X-Fairvisor-Debug-Secret", SECRET)],
    );
    assert_eq!(login.status, 204);
    let set_cookie = login.header("Set-Cookie").expect("a session cookie");
    assert!(set_cookie.starts_with("fv_dbg="), "{set_cookie}");
    assert!(set_cookie.contains("Max-Age=900; HttpOnly; Secure; SameSite=Strict"));
    let cookie = set_cookie.split(';').next().unwrap();

    let r = exhaust(&gw, "with-debug", Some(cookie));
    assert_eq!(r.header("X-Fairvisor-Debug-Policy"), Some("e2e-policy"));
    assert_eq!(r.header("X-Fairvisor-Debug-Rule"), Some("e2e-rule"));
    assert_eq!(r.header("X-Fairvisor-Debug-Decision"), Some("reject"));
    assert_eq!(r.header("X-Fairvisor-Debug-Mode"), Some("enforce"));
    assert_eq!(
        r.header("X-Fairvisor-Debug-Reason"),
        Some("token_bucket_exceeded")
    );
    assert_eq!(
        r.header("X-Fairvisor-Reason"),
        Some("token_bucket_exceeded")
    );
    // A forged cookie opens nothing.
    let forged = format!("{}x", cookie);
    let r = exhaust(&gw, "forged", Some(&forged));
    assert_eq!(r.header("X-Fairvisor-Reason"), None);

    let logout = request(gw.admin, "POST", "/v1/debug/logout", &[("Cookie", cookie)]);
    assert_eq!(logout.status, 204);
    assert_eq!(
        logout.header("Set-Cookie"),
        Some("fv_dbg=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict")
    );
    assert!(
        !gw.log_text().contains(SECRET),
        "the secret reached the log"
    );
}

#[test]
fn debug_sessions_are_off_without_their_secret_or_the_switch() {
    let gw = compat(&[]);
    let r = request(
        gw.admin,
        "POST",
        "/v1/debug/session",
        &[("X-Fairvisor-Debug-Secret", SECRET)],
    );
    assert_eq!(r.status, 404);
    let plain = Gateway::start(Some(POLICY), None, &[]);
    assert_eq!(
        request(plain.admin, "POST", "/v1/debug/session", &[]).status,
        404
    );
    // Without the switch: tollgate's own names, the reason always shown, no fairvisor_ metrics.
    let r = exhaust(&plain, "plain", None);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("token_bucket_exceeded"));
    assert!(!plain.metrics().contains("fairvisor_"));
    // A debug secret without the switch is a start-up error.
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, POLICY).unwrap();
    let stderr = support::refused_start(&policy, &["--debug-session-secret", SECRET]);
    assert!(
        stderr.contains("--debug-session-secret: needs --compat fairvisor"),
        "{stderr}"
    );
    assert!(!stderr.contains(SECRET));
}

/// A token as Fairvisor's suite builds one: `x.<payload>.y`, the header segment not JSON.
fn loose_token(sub: &str) -> String {
    let payload =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!(r#"{{"sub":"{sub}"}}"#));
    format!("Bearer x.{payload}.y")
}

#[test]
fn warnings_metrics_and_loose_tokens_speak_fairvisor() {
    let gw = compat(&["--jwt-unverified"]);
    let budget = |sub: &str| {
        let token = loose_token(sub);
        request(
            gw.admin,
            "POST",
            "/v1/decision",
            &[("X-Original-URI", "/budget/x"), ("Authorization", &token)],
        )
    };
    // 4 per subject, a warning from half spent; each subject has its own budget.
    assert_eq!(budget("user-a").header("X-Fairvisor-Warning"), None);
    let warned = budget("user-a");
    assert_eq!(warned.status, 200);
    assert_eq!(warned.header("X-Fairvisor-Warning"), Some("budget_warn"));
    assert_eq!(warned.header("X-Tollgate-Warning"), None);
    assert_eq!(budget("user-b").header("X-Fairvisor-Warning"), None);

    let metrics = gw.metrics();
    for name in [
        "fairvisor_decisions_total",
        "fairvisor_decision_duration_seconds",
        "fairvisor_ratelimit_remaining",
        "fairvisor_tokens_consumed_total",
        "fairvisor_tokens_remaining",
        "fairvisor_token_estimation_accuracy_ratio",
        "fairvisor_token_reservation_unused_total",
        "fairvisor_loop_detected_total",
        "fairvisor_circuit_state",
        "fairvisor_kill_switch_active",
        "fairvisor_shadow_mode_active",
        "fairvisor_global_shadow_active",
        "fairvisor_kill_switch_override_active",
        "fairvisor_saas_reachable",
        "fairvisor_saas_calls_total",
        "fairvisor_events_sent_total",
        "fairvisor_config_info",
        "fairvisor_build_info",
    ] {
        assert!(metrics.contains(name), "{name} missing");
    }
    assert!(
        metrics.contains("fairvisor_decisions_total{action=\"allow\",policy_id=\"budgets\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_decisions_total"),
        "tollgate's own stay"
    );

    // Without the switch, such a token is no token: the budget's key is missing (skip: the
    // rule does not apply, so no warning ever comes).
    let plain = Gateway::start(Some(POLICY), None, &["--jwt-unverified"]);
    let token = loose_token("user-a");
    for _ in 0..3 {
        let r = request(
            plain.admin,
            "POST",
            "/v1/decision",
            &[("X-Original-URI", "/budget/x"), ("Authorization", &token)],
        );
        assert_eq!(r.header("X-Tollgate-Warning"), None);
    }
}

/// Runs `tollgate run --compat fairvisor EXTRA...` on a free admin port and waits at most 10 s
/// for it to stop: its exit code and standard error, or `None` when it started (it is then
/// killed).
fn start_outcome(extra: &[&str]) -> Option<(i32, String)> {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, POLICY).unwrap();
    let stderr_path = dir.path().join("stderr");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("run")
        .arg("--policy")
        .arg(&policy)
        .args([
            "--admin-listen",
            &format!("127.0.0.1:{}", support::free_port()),
        ])
        .args(["--compat", "fairvisor"])
        .args(extra)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("spawn tollgate");
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_secs(10) {
        if let Some(status) = child.try_wait().unwrap() {
            let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            return Some((status.code().unwrap_or(-1), stderr));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Issue 35: `--debug-session-secret ""` or one character started, and an empty
/// `X-Fairvisor-Debug-Secret` then opened a session.
#[test]
fn a_short_or_empty_debug_secret_stops_start_up_without_showing_it() {
    const FIFTEEN: &str = "fifteen-chars-1";
    for secret in ["", "x", FIFTEEN] {
        let outcome = start_outcome(&["--debug-session-secret", secret]);
        let (code, stderr) = outcome.unwrap_or_else(|| panic!("{secret:?}: it started"));
        assert_eq!(code, 1, "{secret:?}: {stderr}");
        assert!(
            stderr.contains("--debug-session-secret: the secret must be at least 16 characters"),
            "{secret:?}: {stderr}"
        );
        assert!(!stderr.contains(FIFTEEN), "the secret was shown: {stderr}");
    }
    // The same rule for the file; its one trailing newline is not part of the secret.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("debug-secret");
    for content in ["", "\n", "fifteen-chars-1\n", "fifteen-chars-1\r\n"] {
        std::fs::write(&file, content).unwrap();
        let outcome = start_outcome(&["--debug-session-secret-file", file.to_str().unwrap()]);
        let (code, stderr) = outcome.unwrap_or_else(|| panic!("{content:?}: it started"));
        assert_eq!(code, 1, "{content:?}: {stderr}");
        let expected = format!(
            "--debug-session-secret-file {}: the secret must be at least 16 characters",
            file.display()
        );
        assert!(stderr.contains(&expected), "{content:?}: {stderr}");
        assert!(!stderr.contains(FIFTEEN), "the secret was shown: {stderr}");
    }
    // A secret that could not travel in the header.
    let (code, stderr) = start_outcome(&["--debug-session-secret", "sixteen chars ok"]).unwrap();
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("--debug-session-secret: the secret must be printable ASCII"));
    // The flag and the file are one or the other.
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let (code, stderr) = start_outcome(&[
        "--debug-session-secret",
        SECRET,
        "--debug-session-secret-file",
        file.to_str().unwrap(),
    ])
    .expect("both flags started");
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
    assert!(!stderr.contains(SECRET), "the secret was shown: {stderr}");
}

#[test]
fn a_debug_secret_file_opens_sessions_without_its_newline() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("debug-secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let gw = compat(&["--debug-session-secret-file", file.to_str().unwrap()]);
    let login = request(
        gw.admin,
        "POST",
        "/v1/debug/session",
        &[("X-Fairvisor-Debug-Secret", SECRET)],
    );
    assert_eq!(login.status, 204, "{login:?}");
    let cookie = login
        .header("Set-Cookie")
        .unwrap()
        .split(';')
        .next()
        .unwrap();
    let r = exhaust(&gw, "from-file", Some(cookie));
    assert_eq!(
        r.header("X-Fairvisor-Reason"),
        Some("token_bucket_exceeded")
    );
    // A secret file without the switch is refused like the flag.
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, POLICY).unwrap();
    let stderr = support::refused_start(
        &policy,
        &["--debug-session-secret-file", file.to_str().unwrap()],
    );
    assert!(
        stderr.contains("--debug-session-secret-file: needs --compat fairvisor"),
        "{stderr}"
    );
}

fn login(gw: &Gateway, headers: &[(&str, &str)]) -> HttpResponse {
    request(gw.admin, "POST", "/v1/debug/session", headers)
}

/// Issue 35: an empty `X-Fairvisor-Debug-Secret` counted as nothing, and no client was ever
/// limited in how many secrets it tried.
#[test]
fn failed_logins_are_counted_and_throttle_their_client() {
    // The admin listener's peer is trusted to name the client in X-Forwarded-For.
    let gw = compat(&[
        "--debug-session-secret",
        SECRET,
        "--trusted-proxy",
        "127.0.0.1/32",
    ]);
    let failures = |reason: &str| {
        gw.metric(&format!(
            "tollgate_debug_session_failures_total{{reason=\"{reason}\"}}"
        ))
    };
    let a = ("X-Forwarded-For", "203.0.113.1");
    let empty = login(&gw, &[a, ("X-Fairvisor-Debug-Secret", "")]);
    assert_eq!(empty.status, 403);
    assert_eq!(empty.body, r#"{"error":"debug_secret_invalid"}"#);
    assert_eq!(empty.header("Set-Cookie"), None);
    assert_eq!(login(&gw, &[a]).status, 403);
    assert_eq!(failures("no_secret"), 2.0);
    for _ in 0..3 {
        let wrong = login(
            &gw,
            &[a, ("X-Fairvisor-Debug-Secret", "not-the-secret-0000")],
        );
        assert_eq!(wrong.status, 403);
    }
    assert_eq!(failures("wrong_secret"), 3.0);
    // Five failures in five minutes: even the right secret is not looked at.
    let throttled = login(&gw, &[a, ("X-Fairvisor-Debug-Secret", SECRET)]);
    assert_eq!(throttled.status, 429, "{throttled:?}");
    assert_eq!(throttled.body, r#"{"error":"too_many_attempts"}"#);
    assert_eq!(throttled.header("Set-Cookie"), None);
    let retry_after: u64 = throttled
        .header("Retry-After")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((280..=300).contains(&retry_after), "{retry_after}");
    assert_eq!(failures("throttled"), 1.0);
    assert_eq!(
        failures("wrong_secret"),
        3.0,
        "a throttled attempt is no guess"
    );
    // Another client is not affected.
    let b = login(
        &gw,
        &[
            ("X-Forwarded-For", "203.0.113.2"),
            ("X-Fairvisor-Debug-Secret", SECRET),
        ],
    );
    assert_eq!(b.status, 204, "{b:?}");
    let log = gw.log_text();
    assert!(
        log.contains("too many failed attempts") && log.contains("203.0.113.1"),
        "{log}"
    );
    assert!(!log.contains(SECRET), "the secret reached the log");

    // Without a trusted proxy, X-Forwarded-For is the client's own word: rotating it changes
    // nothing, the peer is the client.
    let direct = compat(&["--debug-session-secret", SECRET]);
    for i in 0..5 {
        let xff = format!("198.51.100.{i}");
        let wrong = login(
            &direct,
            &[
                ("X-Forwarded-For", &xff),
                ("X-Fairvisor-Debug-Secret", "not-the-secret-0000"),
            ],
        );
        assert_eq!(wrong.status, 403);
    }
    let rotated = login(
        &direct,
        &[
            ("X-Forwarded-For", "198.51.100.99"),
            ("X-Fairvisor-Debug-Secret", SECRET),
        ],
    );
    assert_eq!(rotated.status, 429, "{rotated:?}");
}

fn open_session(gw: &Gateway) -> String {
    let login = login(gw, &[("X-Fairvisor-Debug-Secret", SECRET)]);
    assert_eq!(login.status, 204, "{login:?}");
    login
        .header("Set-Cookie")
        .expect("a session cookie")
        .split(';')
        .next()
        .unwrap()
        .to_string()
}

/// Issue 35: a cookie captured before logout still opened a session after it.
#[test]
fn logout_ends_the_session_of_a_captured_cookie() {
    let gw = compat(&["--debug-session-secret", SECRET]);
    let captured = open_session(&gw);
    let other = open_session(&gw);
    assert_ne!(captured, other);
    let r = exhaust(&gw, "before-logout", Some(&captured));
    assert_eq!(
        r.header("X-Fairvisor-Reason"),
        Some("token_bucket_exceeded")
    );
    let logout = request(
        gw.admin,
        "POST",
        "/v1/debug/logout",
        &[("Cookie", &captured)],
    );
    assert_eq!(logout.status, 204);
    assert_eq!(
        logout.header("Set-Cookie"),
        Some("fv_dbg=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict")
    );
    let r = exhaust(&gw, "after-logout", Some(&captured));
    assert_eq!(r.header("X-Fairvisor-Reason"), None, "{r:?}");
    assert_eq!(r.header("X-Fairvisor-Debug-Policy"), None);
    // Only that session ended.
    let r = exhaust(&gw, "the-other-session", Some(&other));
    assert_eq!(r.header("X-Fairvisor-Debug-Rule"), Some("e2e-rule"));
}

fn hmac_b64(key: &[u8], payload: &str) -> String {
    let tag = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key),
        payload.as_bytes(),
    );
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tag.as_ref())
}

/// Issue 35: the cookie was the secret's HMAC of its expiry, so anyone could make one offline
/// (with an empty secret, anyone at all).
#[test]
fn debug_cookies_cannot_be_made_offline() {
    let gw = compat(&["--debug-session-secret", SECRET]);
    let expires = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let real = open_session(&gw);
    let (_, value) = real.split_once('=').unwrap();
    let mut parts = value.split('.');
    let (real_expires, real_id) = (parts.next().unwrap(), parts.next().unwrap());
    let id = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([0x5au8; 16]);
    let made = [
        // The old form, signed with the secret and with an empty key.
        format!(
            "fv_dbg={expires}.{}",
            hmac_b64(SECRET.as_bytes(), &expires.to_string())
        ),
        format!("fv_dbg={expires}.{}", hmac_b64(b"", &expires.to_string())),
        // Today's form, for an id never opened and for a real session's id, signed with the
        // secret.
        format!(
            "fv_dbg={expires}.{id}.{}",
            hmac_b64(SECRET.as_bytes(), &format!("{expires}.{id}"))
        ),
        format!(
            "fv_dbg={real_expires}.{real_id}.{}",
            hmac_b64(SECRET.as_bytes(), &format!("{real_expires}.{real_id}"))
        ),
        // A real session's cookie with a later expiry.
        real.replacen(real_expires, &(expires + 10_000).to_string(), 1),
    ];
    for (i, cookie) in made.iter().enumerate() {
        let r = exhaust(&gw, &format!("made-{i}"), Some(cookie));
        assert_eq!(r.header("X-Fairvisor-Reason"), None, "{cookie}: {r:?}");
    }
    let r = exhaust(&gw, "real", Some(&real));
    assert_eq!(
        r.header("X-Fairvisor-Reason"),
        Some("token_bucket_exceeded")
    );
}
