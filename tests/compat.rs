//! `--compat fairvisor` through the real binary, as Fairvisor Edge's own end-to-end suite checks
//! it (the tests are ours): the reason header hidden unless a debug session is open, the debug
//! session round trip and its verbose headers, the warning header's name, the `fairvisor_*`
//! metrics, unverified tokens with a header segment that is not JSON, and nothing of this
//! without the switch.

mod support;

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
