//! The audit trail through the real binary: one line per operator write with its exact fields
//! (a reset, a debug session opened, a bundle published, promoted and rolled back on a Redis
//! policy store), `--audit-log` created owner-only and appended to across restarts, the same
//! lines at the `tollgate::audit` log target without it, the status page's recent lines, and
//! no token or raw credential in any of it.

use crate::admin_scopes::{tokens_file, with_token, DEBUG_TOKEN, OPS_TOKEN, READER_TOKEN};
use crate::support;

use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;
use support::servers::RedisServer;
use support::{
    api_decision, json_of, request, Gateway, Upstream, ADMIN_TOKEN, API_KEY, OPERATOR_POLICY,
};

const DEBUG_SECRET: &str = "audit-debug-secret-0123";

fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The fields that do not move with the clock.
fn fields(line: &Value) -> Value {
    json!([
        line["token_id"],
        line["client"],
        line["action"],
        line["target"]
    ])
}

fn is_rfc3339(time: &Value) -> bool {
    time.as_str()
        .is_some_and(|t| humantime::parse_rfc3339(t).is_ok() && t.ends_with('Z'))
}

#[test]
fn every_write_is_one_line_in_an_owner_only_file_appended_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens_file(dir.path());
    let log = dir.path().join("audit.log");
    let flags = [
        "--admin-tokens-file",
        tokens.to_str().unwrap(),
        "--audit-log",
        log.to_str().unwrap(),
    ];
    let env = [("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN), ("RUST_LOG", "debug")];
    let gw = Gateway::start_with_env("127.0.0.1", Some(OPERATOR_POLICY), None, &flags, &env);
    for _ in 0..3 {
        assert_eq!(api_decision(&gw, "10.0.0.1").status, 200);
    }
    let masked = json_of(&with_body(&gw, "GET", "/v1/top?n=10"))["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["rule"] == "monthly")
        .map(|b| b["bucket"].as_str().unwrap().to_string());
    // Reads, refusals and failures write nothing; each reset one line.
    assert_eq!(with_token(&gw, OPS_TOKEN, "GET", "/v1/top"), 200);
    assert_eq!(
        with_token(
            &gw,
            READER_TOKEN,
            "DELETE",
            "/v1/buckets/tb:per-ip:10.0.0.1"
        ),
        403
    );
    assert_eq!(
        with_token(&gw, OPS_TOKEN, "DELETE", "/v1/buckets/tb:nope:x"),
        404
    );
    let budget = format!("/v1/buckets/cb:monthly:{API_KEY}");
    assert_eq!(with_token(&gw, OPS_TOKEN, "DELETE", &budget), 204);
    assert_eq!(
        with_token(&gw, ADMIN_TOKEN, "DELETE", "/v1/buckets/tb:per-ip:10.0.0.1"),
        204
    );
    let lines = audit_lines(&log);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let budget_name = lines[0]["target"].as_str().unwrap().to_string();
    assert!(budget_name.starts_with("cb:monthly:"), "{budget_name}");
    if let Some(masked) = masked {
        assert_eq!(budget_name, masked, "masked as /v1/top shows it");
    }
    assert_eq!(
        fields(&lines[0]),
        json!(["ops", "127.0.0.1", "reset", budget_name])
    );
    assert_eq!(lines[0]["before"]["spent"], 3.0);
    assert_eq!(lines[0]["before"]["budget"], 5.0);
    assert_eq!(lines[0]["before"]["bucket"], budget_name.as_str());
    assert_eq!(lines[0]["after"], Value::Null);
    assert_eq!(
        fields(&lines[1]),
        json!(["admin-token", "127.0.0.1", "reset", "tb:per-ip:10.0.0.1"])
    );
    assert_eq!(lines[1]["before"]["capacity"], 3.0);
    assert!(lines.iter().all(|l| is_rfc3339(&l["time"])));
    let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // The status page lists them, newest first.
    let page = with_body(&gw, "GET", "/status").body;
    let newest = page
        .find("&quot;token_id&quot;:&quot;admin-token&quot;")
        .unwrap();
    let oldest = page.find("&quot;token_id&quot;:&quot;ops&quot;").unwrap();
    assert!(newest < oldest);
    let text = std::fs::read_to_string(&log).unwrap() + &gw.log_text() + &page;
    for secret in [OPS_TOKEN, READER_TOKEN, ADMIN_TOKEN, API_KEY] {
        assert!(
            !text.contains(secret),
            "a secret reached the audit trail or the log"
        );
    }
    drop(gw);

    // Restarted with debug sessions on: the file is appended to; a session needs `debug`.
    let mut again = flags.to_vec();
    again.extend([
        "--compat",
        "fairvisor",
        "--debug-session-secret",
        DEBUG_SECRET,
    ]);
    let gw = Gateway::start_with_env("127.0.0.1", Some(OPERATOR_POLICY), None, &again, &env);
    let login = |token: Option<&str>| {
        let bearer = token.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("X-Fairvisor-Debug-Secret", DEBUG_SECRET)];
        if let Some(b) = &bearer {
            headers.push(("Authorization", b));
        }
        request(gw.admin, "POST", "/v1/debug/session", &headers).status
    };
    assert_eq!(login(None), 401);
    assert_eq!(login(Some(OPS_TOKEN)), 403);
    assert_eq!(login(Some(DEBUG_TOKEN)), 204);
    let lines = audit_lines(&log);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(
        fields(&lines[2]),
        json!(["debugger", "127.0.0.1", "debug.open", "debug_session"])
    );
    assert_eq!(lines[2]["before"], Value::Null);
    assert!(is_rfc3339(&lines[2]["after"]["expires_at"]), "{}", lines[2]);
    assert_eq!(
        gw.metric("tollgate_admin_forbidden_total{token=\"ops\"}"),
        1.0
    );
}

/// An operator request with the admin token (body kept).
fn with_body(gw: &Gateway, method: &str, target: &str) -> support::HttpResponse {
    support::operator(gw, method, target)
}

#[test]
fn without_a_file_the_lines_go_to_the_audit_log_target() {
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(OPERATOR_POLICY),
        None,
        &["--log-format", "json"],
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    assert_eq!(api_decision(&gw, "10.0.0.9").status, 200);
    assert_eq!(
        with_token(&gw, ADMIN_TOKEN, "DELETE", "/v1/buckets/tb:per-ip:10.0.0.9"),
        204
    );
    gw.wait_for_log("tollgate::audit");
    let line = gw
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| l["target"] == "tollgate::audit")
        .unwrap();
    let audit: Value = serde_json::from_str(line["message"].as_str().unwrap()).unwrap();
    assert_eq!(
        fields(&audit),
        json!(["admin-token", "127.0.0.1", "reset", "tb:per-ip:10.0.0.9"])
    );
    assert_eq!(audit["before"]["capacity"], 3.0);
}

/// `override.put` and `override.delete` lines: target `policy/rule/key`, the override before
/// and after, an API key masked in all of them as the status page masks it.
#[test]
fn overrides_set_and_deleted_are_audited_with_credential_keys_masked() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(OPERATOR_POLICY),
        None,
        &["--audit-log", log.to_str().unwrap()],
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let body =
        format!(r#"{{"policy": "api", "rule": "monthly", "key": "{API_KEY}", "budget": 9}}"#);
    let put = support::request_with_body(
        gw.admin,
        "PUT",
        "/v1/overrides",
        &[("Authorization", &bearer)],
        body.as_bytes(),
    );
    assert_eq!(put.status, 200, "{}", put.body);
    let deleted = with_body(
        &gw,
        "DELETE",
        &format!("/v1/overrides?policy=api&rule=monthly&key={API_KEY}"),
    );
    assert_eq!(deleted.status, 200, "{}", deleted.body);
    let lines = audit_lines(&log);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let target = lines[0]["target"].as_str().unwrap().to_string();
    let shown = target.strip_prefix("api/monthly/").unwrap().to_string();
    assert!(shown.starts_with("sk-l\u{2026}#"), "{target}");
    assert_eq!(
        fields(&lines[0]),
        json!(["admin-token", "127.0.0.1", "override.put", target])
    );
    assert_eq!(lines[0]["before"], Value::Null);
    assert_eq!(
        lines[0]["after"],
        json!({"policy": "api", "rule": "monthly", "key": shown, "budget": 9})
    );
    assert_eq!(
        fields(&lines[1]),
        json!(["admin-token", "127.0.0.1", "override.delete", target])
    );
    assert_eq!(lines[1]["before"], lines[0]["after"]);
    assert_eq!(lines[1]["after"], Value::Null);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains(API_KEY),
        "a raw API key reached the audit trail"
    );
}

const LIVE: &str = r#"{"bundle_version": 1, "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "mode": "enforce", "rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"tokens_per_second": 0.001, "burst": 10}}]}}]}"#;

fn tollgate(args: &[&str]) -> u64 {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn publish(dir: &Path, store: &str, burst: u32, extra: &[&str]) -> u64 {
    let file = dir.join(format!("bundle-{burst}.json"));
    std::fs::write(
        &file,
        LIVE.replace("\"burst\": 10", &format!("\"burst\": {burst}")),
    )
    .unwrap();
    let mut args = vec!["publish", file.to_str().unwrap(), "--store", store];
    args.extend_from_slice(extra);
    tollgate(&args)
}

#[test]
fn bundles_published_promoted_and_rolled_back_are_audited() {
    let redis = RedisServer::start();
    let store = redis.url();
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    let first = publish(dir.path(), &store, 10, &[]);
    let gw = Gateway::start(
        None,
        Some(upstream.addr),
        &[
            "--policy-store",
            &store,
            "--store",
            &store,
            "--allow-unsigned-bundles",
            "--audit-log",
            log.to_str().unwrap(),
        ],
    );
    let readyz = || json_of(&gw.admin("GET", "/readyz", &[]));
    let wait = |done: &dyn Fn(&Value) -> bool| {
        gw.wait_until(Duration::from_secs(5), || done(&readyz()));
    };
    wait(&|r| r["bundle_version"].as_u64() == Some(first));
    let second = publish(dir.path(), &store, 8, &[]);
    wait(&|r| r["bundle_version"].as_u64() == Some(second));
    let candidate = publish(dir.path(), &store, 4, &["--candidate"]);
    wait(&|r| r["policy_source"]["candidate"]["version"].as_u64() == Some(candidate));
    let promoted = tollgate(&["promote", "--store", &store]);
    wait(&|r| r["bundle_version"].as_u64() == Some(promoted));
    let rolled = tollgate(&["rollback", "--store", &store]);
    wait(&|r| r["bundle_version"].as_u64() == Some(rolled));
    let hash = |burst: u32| {
        tollgate::policy::sha256_hex(
            LIVE.replace("\"burst\": 10", &format!("\"burst\": {burst}"))
                .as_bytes(),
        )
    };
    let bundle = |version: u64, burst: u32| json!({"version": version, "sha256": hash(burst)});
    let seen: Vec<Value> = audit_lines(&log)
        .iter()
        .map(|l| {
            json!([
                l["token_id"],
                l["client"],
                l["action"],
                l["target"],
                l["before"],
                l["after"]
            ])
        })
        .collect();
    assert_eq!(
        seen,
        [
            json!([
                null,
                null,
                "bundle.publish",
                "live",
                bundle(first, 10),
                bundle(second, 8)
            ]),
            json!([
                null,
                null,
                "bundle.publish",
                "candidate",
                null,
                bundle(candidate, 4)
            ]),
            json!([
                null,
                null,
                "bundle.promote",
                "live",
                bundle(second, 8),
                bundle(promoted, 4)
            ]),
            json!([
                null,
                null,
                "bundle.rollback",
                "live",
                bundle(promoted, 4),
                bundle(rolled, 8)
            ]),
        ]
    );
}
