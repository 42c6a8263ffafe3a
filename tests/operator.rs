//! The operator endpoints through the real binary: the admin token (403 off, 401 wrong, never
//! logged), `GET`/`DELETE /v1/buckets/{bucket}`, `POST /v1/explain`, `/v1/top` and `/status` on
//! the embedded store and a state dir (Redis and PostgreSQL in their own test files), hostile
//! input to each, the status page rendered by headless Chromium, the shipped alerting rules
//! checked by `promtool`, and the dashboard's metrics exported by the binary.

use crate::support;

use std::process::Command;
use support::{
    assert_operator_endpoints, json_of, operator, request, Gateway, ADMIN_TOKEN, OPERATOR_POLICY,
};

fn with_token(extra: &[&str]) -> Gateway {
    Gateway::start_with_env(
        "127.0.0.1",
        Some(OPERATOR_POLICY),
        None,
        extra,
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    )
}

#[test]
fn operator_endpoints_on_the_embedded_store() {
    let gw = with_token(&[]);
    assert_operator_endpoints(&gw);
}

#[test]
fn operator_endpoints_on_a_state_dir() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let gw = with_token(&["--state-dir", state.to_str().unwrap()]);
    assert_operator_endpoints(&gw);
}

const OPERATOR_PATHS: [(&str, &str); 5] = [
    ("GET", "/v1/top"),
    ("GET", "/status"),
    ("GET", "/v1/buckets/tb:per-ip:10.0.0.1"),
    ("DELETE", "/v1/buckets/tb:per-ip:10.0.0.1"),
    ("POST", "/v1/explain"),
];

#[test]
fn without_a_token_configured_the_endpoints_are_off() {
    let gw = Gateway::start(Some(OPERATOR_POLICY), None, &[]);
    for (method, path) in OPERATOR_PATHS {
        let r = request(
            gw.admin,
            method,
            path,
            &[("Authorization", &format!("Bearer {ADMIN_TOKEN}"))],
        );
        assert_eq!(r.status, 403, "{method} {path}");
        assert!(r.body.contains("--admin-token"), "{}", r.body);
    }
    // What was there before stays open.
    assert_eq!(gw.admin("GET", "/livez", &[]).status, 200);
    assert_eq!(gw.admin("GET", "/readyz", &[]).status, 200);
    assert_eq!(gw.admin("GET", "/metrics", &[]).status, 200);
}

#[test]
fn a_missing_or_wrong_token_gets_401_and_is_never_logged() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, format!("{ADMIN_TOKEN}\n")).unwrap();
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(OPERATOR_POLICY),
        None,
        &["--admin-token-file", file.to_str().unwrap()],
        &[("RUST_LOG", "debug")],
    );
    let wrong = format!("Bearer {ADMIN_TOKEN}x");
    let prefix = format!("Bearer {}", &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]);
    let basic = format!("Basic {ADMIN_TOKEN}");
    let bare = ADMIN_TOKEN.to_string();
    let huge = format!("Bearer {}", "a".repeat(6000));
    let mut refused = 0.0;
    for (method, path) in OPERATOR_PATHS {
        for header in [
            None,
            Some(&wrong),
            Some(&prefix),
            Some(&basic),
            Some(&bare),
            Some(&huge),
        ] {
            let headers: Vec<(&str, &str)> = header
                .iter()
                .map(|h| ("Authorization", h.as_str()))
                .collect();
            let r = request(gw.admin, method, path, &headers);
            assert_eq!(r.status, 401, "{method} {path} with {header:?}");
            assert_eq!(
                r.header("www-authenticate"),
                Some("Bearer realm=\"tollgate admin\"")
            );
            assert!(!r.body.contains(ADMIN_TOKEN));
            refused += 1.0;
        }
        // The right token, in any case of the scheme.
        let r = request(
            gw.admin,
            method,
            path,
            &[("Authorization", &format!("bearer {ADMIN_TOKEN}"))],
        );
        assert_ne!(r.status, 401, "{method} {path}");
        assert_ne!(r.status, 403, "{method} {path}");
    }
    assert_eq!(gw.metric("tollgate_admin_unauthorized_total"), refused);
    let log = gw.log_text();
    assert!(
        !log.contains(ADMIN_TOKEN),
        "the admin token reached the log"
    );
    assert!(!gw.metrics().contains(ADMIN_TOKEN));
}

#[test]
fn a_short_token_or_an_unreadable_file_stops_start_up_without_showing_it() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, OPERATOR_POLICY).unwrap();
    let stderr = support::refused_start(&policy, &["--admin-token", "hunter2"]);
    assert!(
        stderr.contains("--admin-token: the token must be at least 16 characters"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    let missing = support::refused_start(&policy, &["--admin-token-file", "/nonexistent/token"]);
    assert!(missing.contains("--admin-token-file /nonexistent/token: cannot read it"));
}

#[test]
fn hostile_bucket_names_and_queries_get_clear_errors() {
    let gw = with_token(&[]);
    let cases: Vec<(String, u16)> = vec![
        ("/v1/buckets".into(), 400),
        ("/v1/buckets/".into(), 400),
        ("/v1/buckets/%zz".into(), 400),
        ("/v1/buckets/tb:per-ip:%FF%FE".into(), 400),
        ("/v1/buckets/tb:nope:1".into(), 404),
        ("/v1/buckets/..%2F..%2Fstatus".into(), 404),
        ("/v1/buckets/by-hash/xyz".into(), 400),
        (format!("/v1/buckets/by-hash/{}", "0".repeat(32)), 404),
        (format!("/v1/buckets/by-hash/{}", "f".repeat(33)), 400),
        (format!("/v1/buckets/tb:per-ip:{}", "a".repeat(13_000)), 414),
        // A name within the bound but with no entry: a full bucket.
        (format!("/v1/buckets/tb:per-ip:{}", "%00".repeat(100)), 404),
        ("/v1/top?n=0".into(), 400),
        ("/v1/top?n=abc".into(), 400),
        ("/v1/top?n=1001".into(), 400),
        ("/v1/top?n=-1".into(), 400),
    ];
    for (path, status) in &cases {
        let r = operator(&gw, "GET", path);
        assert_eq!(r.status, *status, "GET {path}: {}", r.body);
        if r.status != 404 || path.contains("tb:nope") {
            assert!(json_of(&r)["error"].is_string(), "{path}: {}", r.body);
        }
    }
    // The same checks guard DELETE: nothing is reset on a bad name.
    assert_eq!(operator(&gw, "DELETE", "/v1/buckets/%zz").status, 400);
    assert_eq!(operator(&gw, "DELETE", "/v1/buckets/tb:nope:1").status, 404);
    // Wrong methods.
    for (method, path, allow) in [
        ("PUT", "/v1/buckets/tb:per-ip:1", "GET, DELETE"),
        ("GET", "/v1/explain", "POST"),
        ("POST", "/v1/top", "GET"),
        ("DELETE", "/status", "GET"),
    ] {
        let r = operator(&gw, method, path);
        assert_eq!(r.status, 405, "{method} {path}");
        assert_eq!(r.header("allow"), Some(allow));
    }
    // Explain with a malformed description still answers, refusing as the engine would.
    let r = request(
        gw.admin,
        "POST",
        "/v1/explain",
        &[
            ("Authorization", &format!("Bearer {ADMIN_TOKEN}")),
            ("X-Original-URI", "/api/%2e%2e/%2fx"),
            ("X-Forwarded-For", "not-an-address"),
        ],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(json_of(&r)["spent"], false);
    // Nothing above made or changed a bucket.
    assert_eq!(gw.metric("tollgate_store_entries"), 0.0);
    assert_eq!(gw.admin("GET", "/livez", &[]).status, 200);
}

#[test]
fn a_missing_policy_file_stops_start_up_unless_told_to_wait() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let stderr = support::refused_start(&missing, &["--listen", "127.0.0.1:0"]);
    assert!(
        stderr.contains(&format!("--policy {}: no such file", missing.display())),
        "{stderr}"
    );
    assert!(stderr.contains("--wait-for-policy"), "{stderr}");
    // Pingora's own start-up lines are debug-level now: an error is not lost among them.
    assert!(!stderr.contains("Bootstrap"), "{stderr}");

    // With --wait-for-policy: today's behaviour, not ready until the file appears.
    let gw = Gateway::start(None, None, &["--wait-for-policy"]);
    assert_eq!(gw.admin("GET", "/readyz", &[]).status, 503);
    let log = gw.log_text();
    assert!(
        !log.lines()
            .any(|l| l.contains("INFO") && l.contains("pingora")),
        "Pingora start-up chatter at info level:\n{log}"
    );
}

/// Makes a few refusals so the page has something to show.
fn some_refusals(gw: &Gateway) {
    for _ in 0..5 {
        support::api_decision(gw, "10.0.0.9");
    }
}

#[test]
fn the_status_page_answers_with_the_token_and_signs_in_without_it() {
    let gw = with_token(&[]);
    some_refusals(&gw);
    let page = operator(&gw, "GET", "/status");
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(page.header("cache-control"), Some("no-store"));
    let body = &page.body;
    assert!(body.contains("<td id=\"bundle-version\">7</td>"), "{body}");
    assert!(body.contains("<td>api</td><td>enforce</td>"), "{body}");
    assert!(body.contains("<code>tb:per-ip:10.0.0.9</code>"), "{body}");
    assert!(
        body.contains("<td>2</td><td>0</td><td>0</td>"),
        "refused twice: {body}"
    );
    assert!(
        body.contains("data-reset=\"/v1/buckets/tb:per-ip:10.0.0.9\""),
        "{body}"
    );
    assert!(!body.contains(support::API_KEY));
    assert!(!body.contains("src=\"http"), "no external assets");
    let signin = gw.admin("GET", "/status", &[]);
    assert_eq!(signin.status, 401);
    assert!(signin.body.contains("id=\"signin\""));
    assert!(
        !signin.body.contains("tb:per-ip"),
        "no data without the token"
    );
}

/// Debian's Chromium, headless, as the project's scripts install it.
fn chromium() -> Option<&'static str> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

fn chromium_command(profile: &std::path::Path) -> Command {
    let mut cmd = Command::new(chromium().expect("chromium (scripts/install-deps.sh installs it)"));
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--virtual-time-budget=10000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    cmd
}

/// The page in a real browser: Chromium opens `/status#token=...` (the fragment never reaches
/// the server), the sign-in script fetches the page with the token and shows it; the rendered
/// DOM has the bundle, the store and the limited bucket with its reset button. With
/// `TOLLGATE_STATUS_SCREENSHOT=path` it also saves the screenshot the manual shows (docs/src/images/status.png).
#[test]
fn headless_chromium_renders_the_status_page_with_the_token() {
    let gw = with_token(&[]);
    some_refusals(&gw);
    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{}/status#token={ADMIN_TOKEN}", gw.admin);
    let out = chromium_command(profile.path())
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("data-page=\"status\""),
        "not signed in; chromium said:\n{}\n{dom}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dom.contains("<td id=\"bundle-version\">7</td>"), "{dom}");
    assert!(dom.contains("<code>tb:per-ip:10.0.0.9</code>"), "{dom}");
    assert!(
        dom.contains("data-reset=\"/v1/buckets/tb:per-ip:10.0.0.9\""),
        "{dom}"
    );
    assert!(dom.contains("id=\"store-status\" class=\"ok\""), "{dom}");
    // The token travelled in the fragment only: nothing logged it.
    assert!(!gw.log_text().contains(ADMIN_TOKEN));
    // A wrong token stays on the sign-in page, with the refusal shown.
    let profile = tempfile::tempdir().unwrap();
    let out = chromium_command(profile.path())
        .arg("--dump-dom")
        .arg(format!(
            "http://{}/status#token=wrong-token-0123456789",
            gw.admin
        ))
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(dom.contains("data-page=\"signin\""), "{dom}");
    assert!(dom.contains("The admin token was refused (401)."), "{dom}");

    if let Ok(path) = std::env::var("TOLLGATE_STATUS_SCREENSHOT") {
        let profile = tempfile::tempdir().unwrap();
        let status = chromium_command(profile.path())
            .arg("--window-size=1100,1250")
            .arg(format!("--screenshot={path}"))
            .arg(&url)
            .status()
            .expect("run chromium");
        assert!(status.success());
    }
}

/// The shipped alerting rules pass their `promtool test rules` cases (monitoring/alerts.test.yml:
/// exact alerts, labels and annotations at given times).
#[test]
fn shipped_alert_rules_pass_their_promtool_tests() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("promtool")
        .arg("test")
        .arg("rules")
        .arg("alerts.test.yml")
        .current_dir(root.join("monitoring"))
        .output()
        .expect("promtool (scripts/install-deps.sh installs Debian's prometheus)");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    assert!(said.contains("SUCCESS"), "{said}");
    // Every alert of the rules file has a case.
    let rules = std::fs::read_to_string(root.join("monitoring/alerts.yml")).unwrap();
    let cases = std::fs::read_to_string(root.join("monitoring/alerts.test.yml")).unwrap();
    let tested: Vec<&str> = [
        "TollgateStoreClockSkew",
        "TollgateStoreLocalMode",
        "TollgateStoreWritebackFailing",
        "TollgateFleetUndercounted",
        "TollgateLocalModeRefusing",
    ]
    .into_iter()
    .filter(|name| {
        rules.contains(&format!("alert: {name}\n"))
            && cases.contains(&format!("alertname: {name}\n"))
    })
    .collect();
    assert_eq!(tested.len(), 5, "{tested:?}");
}

/// The shipped alerting rules pass `promtool check rules`, and every metric the dashboard and
/// the rules query is in the binary's metric table (for some store: a shared store's gauges
/// are not defined for the embedded one).
#[test]
fn shipped_monitoring_checks_out_against_the_binary() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = root.join("monitoring/alerts.yml");
    let out = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .expect("promtool (scripts/install-deps.sh installs Debian's prometheus)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("SUCCESS"));

    // What the binary can export: its metric table, for every store.
    let exported: std::collections::BTreeSet<&str> = tollgate::telemetry::metrics::METRICS
        .iter()
        .map(|m| m.name)
        .collect();
    assert!(exported.contains("tollgate_decisions_total"));
    let mut queried = std::collections::BTreeSet::new();
    for file in ["monitoring/grafana-dashboard.json", "monitoring/alerts.yml"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("tollgate_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            queried.insert(name);
        }
    }
    let base = |name: &str| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name)
            .to_string()
    };
    let missing: Vec<&String> = queried
        .iter()
        .filter(|q| !exported.contains(q.as_str()) && !exported.contains(base(q).as_str()))
        .collect();
    assert!(queried.len() >= 10, "the dashboard queries {queried:?}");
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\nexported: {exported:?}"
    );
}
