//! Scoped operator tokens through the real binary (`--admin-tokens-file`): each scope allowed
//! and refused with 403, the refusals counted by token id, `token_sha256` entries,
//! `--admin-token` beside the file with every scope, the decision service's `POST /v1/usage`
//! untouched, tokens never in the log, and a file others may read or write refused at start-up.

use crate::support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use support::{api_decision, refused_start, request, Gateway, ADMIN_TOKEN, OPERATOR_POLICY};

/// Scopes `read` and `reset`.
pub const OPS_TOKEN: &str = "ops-token-5d1c8e0a7b3f4a69";
/// Scope `read`, given in the file as its SHA-256.
pub const READER_TOKEN: &str = "reader-token-93ab17c4e2d8f605";
/// Scope `usage`.
pub const USAGE_TOKEN: &str = "usage-token-0f6e2a9c4b7d1e83";
/// Scope `debug`.
pub const DEBUG_TOKEN: &str = "debug-token-7a2e5c9b1f4d8e06";

/// Writes the test tokens file into `dir`, owner-only, and returns its path.
pub fn tokens_file(dir: &Path) -> PathBuf {
    let path = dir.join("admin-tokens.json");
    let reader_sha256 = tollgate::policy::sha256_hex(READER_TOKEN.as_bytes());
    let text = format!(
        r#"[
  {{"id": "ops", "scopes": ["read", "reset"], "token": "{OPS_TOKEN}"}},
  {{"id": "reader", "scopes": ["read"], "token_sha256": "{reader_sha256}"}},
  {{"id": "billing", "scopes": ["usage"], "token": "{USAGE_TOKEN}"}},
  {{"id": "debugger", "scopes": ["debug"], "token": "{DEBUG_TOKEN}"}}
]"#
    );
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// An operator request with `token`.
pub fn with_token(gw: &Gateway, token: &str, method: &str, target: &str) -> u16 {
    let bearer = format!("Bearer {token}");
    request(gw.admin, method, target, &[("Authorization", &bearer)]).status
}

fn forbidden(gw: &Gateway, id: &str) -> f64 {
    gw.metric(&format!("tollgate_admin_forbidden_total{{token=\"{id}\"}}"))
}

#[test]
fn each_scope_is_enforced_and_refusals_are_counted_by_token_id() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens_file(dir.path());
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(OPERATOR_POLICY),
        None,
        &["--admin-tokens-file", tokens.to_str().unwrap()],
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN), ("RUST_LOG", "debug")],
    );
    for i in 0..3 {
        assert_eq!(api_decision(&gw, "10.0.0.1").status, 200, "request {i}");
    }
    let bucket = "/v1/buckets/tb:per-ip:10.0.0.1";
    // Every configured id shows from the start, at zero.
    for id in ["admin-token", "ops", "reader", "billing", "debugger"] {
        assert!(
            gw.metrics().contains(&format!(
                "tollgate_admin_forbidden_total{{token=\"{id}\"}} 0"
            )),
            "{id}"
        );
    }
    // read: every GET and explain; the token_sha256 entry works like a token.
    for token in [READER_TOKEN, OPS_TOKEN, ADMIN_TOKEN] {
        assert_eq!(with_token(&gw, token, "GET", "/v1/top"), 200);
        assert_eq!(with_token(&gw, token, "GET", "/status"), 200);
        assert_eq!(with_token(&gw, token, "GET", bucket), 200);
        assert_eq!(with_token(&gw, token, "POST", "/v1/explain"), 200);
    }
    // reset: refused to the reader (403, with why), allowed to ops and to --admin-token.
    let bearer = format!("Bearer {READER_TOKEN}");
    let refused = request(gw.admin, "DELETE", bucket, &[("Authorization", &bearer)]);
    assert_eq!(refused.status, 403);
    assert_eq!(
        refused.body,
        r#"{"error":"the token \"reader\" does not hold the scope \"reset\" this endpoint needs"}"#
    );
    assert_eq!(with_token(&gw, OPS_TOKEN, "DELETE", bucket), 204);
    assert_eq!(with_token(&gw, ADMIN_TOKEN, "DELETE", bucket), 204);
    // Tokens holding neither read nor reset are refused both.
    for token in [USAGE_TOKEN, DEBUG_TOKEN] {
        for (method, path) in [
            ("GET", "/v1/top"),
            ("GET", "/status"),
            ("POST", "/v1/explain"),
            ("DELETE", bucket),
        ] {
            assert_eq!(with_token(&gw, token, method, path), 403, "{method} {path}");
        }
    }
    // An unknown token is 401 as before, counted apart.
    assert_eq!(
        with_token(&gw, "not-a-configured-token-123", "GET", "/v1/top"),
        401
    );
    assert_eq!(forbidden(&gw, "reader"), 1.0);
    assert_eq!(forbidden(&gw, "billing"), 4.0);
    assert_eq!(forbidden(&gw, "debugger"), 4.0);
    assert_eq!(forbidden(&gw, "ops"), 0.0);
    assert_eq!(forbidden(&gw, "admin-token"), 0.0);
    assert_eq!(gw.metric("tollgate_admin_unauthorized_total"), 1.0);
    // The decision service's usage report needs no token, as before.
    let usage = request(gw.admin, "POST", "/v1/usage", &[]);
    assert_eq!(usage.status, 400, "{}", usage.body);
    let log = gw.log_text();
    for token in [
        OPS_TOKEN,
        READER_TOKEN,
        USAGE_TOKEN,
        DEBUG_TOKEN,
        ADMIN_TOKEN,
    ] {
        assert!(!log.contains(token), "a token reached the log");
    }
}

#[test]
fn sighup_reads_the_tokens_file_again_and_a_bad_one_keeps_the_tokens_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens_file(dir.path());
    let gw = Gateway::start(
        Some(OPERATOR_POLICY),
        None,
        &["--admin-tokens-file", tokens.to_str().unwrap()],
    );
    assert_eq!(with_token(&gw, READER_TOKEN, "GET", "/v1/top"), 200);
    assert_eq!(with_token(&gw, USAGE_TOKEN, "GET", "/v1/top"), 403);
    // The reader is gone, billing may read too, a new token appears.
    let rotated = "rotated-token-4c8e1a7f0b2d9e35";
    std::fs::write(
        &tokens,
        format!(
            r#"[{{"id": "billing", "scopes": ["usage", "read"], "token": "{USAGE_TOKEN}"}},
               {{"id": "rotated", "scopes": ["read"], "token": "{rotated}"}}]"#
        ),
    )
    .unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_until(std::time::Duration::from_secs(5), || {
        with_token(&gw, rotated, "GET", "/v1/top") == 200
    });
    assert_eq!(with_token(&gw, USAGE_TOKEN, "GET", "/v1/top"), 200);
    assert_eq!(with_token(&gw, READER_TOKEN, "GET", "/v1/top"), 401);
    assert!(gw
        .metrics()
        .contains("tollgate_admin_forbidden_total{token=\"rotated\"} 0"));
    // A file others may write is refused: the tokens in force stay.
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o666)).unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_for_log("the tokens in force stay");
    assert!(gw.log_text().contains(&format!(
        "--admin-tokens-file {}: its group or others may read or write it (mode 0666); it must be owner-only (chmod 600); the tokens in force stay",
        tokens.display()
    )));
    assert_eq!(with_token(&gw, rotated, "GET", "/v1/top"), 200);
    assert!(!gw.log_text().contains(rotated));
}

#[test]
fn a_tokens_file_others_may_read_or_write_or_a_wrong_entry_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, OPERATOR_POLICY).unwrap();
    let tokens = tokens_file(dir.path());
    let path = tokens.to_str().unwrap();
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o660)).unwrap();
    let stderr = refused_start(&policy, &["--admin-tokens-file", path]);
    assert!(
        stderr.contains(&format!(
            "--admin-tokens-file {path}: its group or others may read or write it (mode 0660); it must be owner-only (chmod 600)"
        )),
        "{stderr}"
    );
    std::fs::write(
        &tokens,
        format!(r#"[{{"id": "ops", "scopes": ["read", "admin"], "token": "{OPS_TOKEN}"}}]"#),
    )
    .unwrap();
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
    let stderr = refused_start(&policy, &["--admin-tokens-file", path]);
    assert!(
        stderr.contains(&format!(
            r#"--admin-tokens-file {path}: $[0].scopes[1]: "admin" is not a scope (expected one of read, reset, overrides, usage, debug)"#
        )),
        "{stderr}"
    );
    assert!(!stderr.contains(OPS_TOKEN));
}
