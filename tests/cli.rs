//! `tollgate validate`, `tollgate simulate` and `tollgate import` as a user runs them.

use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn tollgate(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tollgate");
    let mut input = child.stdin.take().expect("stdin");
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).expect("write stdin");
    }
    drop(input);
    let out = child.wait_with_output().expect("tollgate output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// One JSON value per output line.
fn json_lines(out: &str) -> Vec<Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Seed 004 (Coinbase) worked table, replayed through the real binary: statuses and exact
/// token counts.
#[test]
fn simulate_replays_the_seed_004_table_exactly() {
    let (code, out, err) = tollgate(
        &[
            "simulate",
            "--policy",
            "policies/coinbase-worked-example.json",
            "--requests",
            "examples/coinbase-worked-example-requests.jsonl",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let lines = json_lines(&out);
    let expected = [
        (200, 2.0),
        (200, 1.3),
        (200, 0.4),
        (429, 0.5),
        (429, 0.9),
        (200, 0.3),
        (200, 2.0),
    ];
    assert_eq!(lines.len(), expected.len());
    for (line, (status, tokens)) in lines.iter().zip(expected) {
        assert_eq!(line["status"], status, "{line}");
        let rule = &line["rules"][0];
        assert_eq!(rule["tokens"].as_f64(), Some(tokens), "{line}");
        assert_eq!(rule["rule"], "worked-example");
        assert_eq!(rule["policy"], "coinbase-worked-example");
        assert_eq!(rule["key"], "203.0.113.7");
        assert_eq!(rule["bucket"], "tb:worked-example:203.0.113.7");
        assert_eq!(rule["allowed"], status == 200);
    }
    // retry_after = ceil((1 - 0.5) / 1) = 1 and ceil((1 - 0.9) / 1) = 1.
    assert_eq!(lines[3]["rules"][0]["retry_after"], 1);
    assert_eq!(
        lines[3]["headers"]["X-Tollgate-Reason"],
        "token_bucket_exceeded"
    );
    assert_eq!(lines[3]["headers"]["RateLimit-Reset"], "1");
    assert_eq!(
        lines[0]["headers"]["RateLimit-Policy"],
        "\"worked-example\";q=3;w=3"
    );
    assert_eq!(
        lines[1]["headers"]["RateLimit"],
        "\"worked-example\";r=1;t=2"
    );
}

/// Seed 000 (Boulder) through stdin: 20 per second, burst 20; the 21st request inside 50 ms is
/// refused; an override doubles the rate for listed IPs.
#[test]
fn simulate_boulder_defaults_and_overrides_from_stdin() {
    let mut input = String::new();
    for i in 0..21 {
        input.push_str(&format!("{{\"t\": {}, \"method\": \"POST\", \"path\": \"/acme/new-reg\", \"ip\": \"172.23.45.22\"}}\n", i as f64 * 0.002));
    }
    input.push_str(
        "{\"t\": 0.1, \"method\": \"POST\", \"path\": \"/acme/new-reg\", \"ip\": \"10.0.0.5\"}\n",
    );
    let (code, out, err) = tollgate(
        &["simulate", "--policy", "policies/boulder.json"],
        Some(&input),
    );
    assert_eq!(code, 0, "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines[0]["rules"][0]["tokens"].as_f64(), Some(19.0));
    assert!(lines[..20].iter().all(|l| l["status"] == 200));
    assert_eq!(lines[20]["status"], 429);
    assert_eq!(lines[21]["status"], 200);
}

#[test]
fn simulate_reports_bad_lines_and_exits_non_zero() {
    let (code, out, err) = tollgate(
        &[
            "simulate",
            "--policy",
            "policies/axum-per-ip.json",
            "--requests",
            "-",
        ],
        Some("{\"t\": 0.1}\n{\"t\": -1}\n{\"bogus\": 1, \"t\": 0}\n"),
    );
    assert_eq!(code, 1);
    assert!(err.contains("2 request line(s)"), "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(lines[1]["line"], 2);
    assert!(lines[2]["error"]
        .as_str()
        .unwrap()
        .contains("unknown field `bogus`"));
}

#[test]
fn validate_accepts_every_shipped_policy() {
    let mut files: Vec<String> =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("policies"))
            .unwrap()
            .map(|e| e.unwrap().path().display().to_string())
            .collect();
    files.sort();
    assert!(files.len() >= 5);
    let mut args = vec!["validate"];
    args.extend(files.iter().map(String::as_str));
    let (code, out, err) = tollgate(&args, None);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains(": ok (")).count(),
        files.len()
    );
}

/// `validate` counts the rules as written: three `token_bucket_llm` rules (each with a
/// `tokens_per_day` budget the gateway keeps as a rule of its own) and a fallback are 4 rules,
/// not 7.
#[test]
fn validate_counts_the_rules_as_written() {
    let (code, out, err) = tollgate(&["validate", "policies/llm-tiers.json"], None);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(
            "policies/llm-tiers.json: ok (bundle_version 1, 1 policies, 4 rules, 0 kill switches, hash "
        ),
        "{out}"
    );
}

/// Issue 21: a bundle holding state a restart resets is warned about unless a state dir or a
/// shared store keeps it.
#[test]
fn validate_warns_about_state_a_restart_resets() {
    let warning = "  warning: 5m-cost-window (budget), org-month (budget) hold state that a restart resets with the embedded store in process memory: run with --state-dir DIR (or a shared --store) to keep it";
    let file = "policies/fairvisor-budgets.json";
    let (code, out, _) = tollgate(&["validate", file], None);
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l == warning), "{out}");
    for flags in [
        ["--state-dir", "/var/lib/tollgate"],
        ["--store", "redis://127.0.0.1:6379"],
    ] {
        let (code, out, _) = tollgate(&["validate", flags[0], flags[1], file], None);
        assert_eq!(code, 0);
        assert!(!out.contains("restart resets"), "{flags:?}: {out}");
    }
    // A bundle of token buckets only holds nothing a restart could hand back unfairly.
    let (_, out, _) = tollgate(&["validate", "policies/axum-per-ip.json"], None);
    assert!(!out.contains("restart resets"), "{out}");
}

/// Issue 42: a budget keyed on a header any client can make up is warned about at its JSON
/// path (validation still passes); the same budget on a verified JWT claim is not.
#[test]
fn validate_warns_about_budgets_on_keys_a_client_makes_up() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = |budget_key: &str| {
        format!(
            r#"{{"bundle_version": 1, "policies": [{{"id": "api", "spec": {{"rules": [
            {{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {{"rps": 5, "burst": 10}}}},
            {{"name": "per-key", "limit_keys": ["header:x-api-key"], "on_missing": "shared", "algorithm": "token_bucket", "algorithm_config": {{"rps": 50, "burst": 100}}}},
            {{"name": "monthly", "limit_keys": ["{budget_key}"], "on_missing": "shared", "algorithm": "cost_based", "algorithm_config": {{"budget": 20, "period": "1M", "staged_actions": [{{"threshold_percent": 100, "action": "reject"}}]}}}}
        ]}}}}]}}"#
        )
    };
    let made_up = dir.path().join("made-up.json");
    std::fs::write(&made_up, bundle("header:x-api-key")).unwrap();
    let (code, out, err) = tollgate(
        &[
            "validate",
            "--state-dir",
            "/var/lib/tollgate",
            made_up.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{out}{err}");
    let warning = "  warning: policies[0].spec.rules[2].limit_keys: rule 'monthly' (a budget) is keyed on header:x-api-key, which any client can make up: every new value starts a fresh count and takes a store entry, so one client can spread its use over as many entries as it likes, and a flood of made-up values fills the store; key it on a verified JWT claim (jwt:sub, jwt:org_id...) instead";
    let warnings: Vec<&str> = out.lines().filter(|l| l.contains("warning:")).collect();
    assert_eq!(warnings, [warning], "{out}");

    let verified = dir.path().join("verified.json");
    std::fs::write(&verified, bundle("jwt:sub")).unwrap();
    let (code, out, err) = tollgate(
        &[
            "validate",
            "--state-dir",
            "/var/lib/tollgate",
            verified.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("verified.json: ok ("), "{out}");
    assert!(!out.contains("warning:"), "{out}");
}

#[test]
fn validate_lists_every_error_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r#"{"bundle_version": 1, "policies": [{"id": "p", "spec": {"rules": [
            {"name": "r", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 10, "burst": 0}},
            {"name": "r", "limit_keys": ["cookie:x"], "algorithm": "sliding_window", "algorithm_config": {"rps": 1, "burst": 1}}
        ]}}]}"#,
    )
    .unwrap();
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{\"rules\": [").unwrap();
    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/axum-per-ip.json");
    let (code, out, err) = tollgate(
        &[
            "validate",
            good.to_str().unwrap(),
            bad.to_str().unwrap(),
            broken.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 1);
    assert!(out.contains("axum-per-ip.json: ok"));
    for expected in [
        "4 error(s)",
        "policies[0].spec.rules[0].algorithm_config.burst: must be > 0",
        "policies[0].spec.rules[1].name: duplicate rule name 'r'",
        "policies[0].spec.rules[1].limit_keys[0]: unknown descriptor 'cookie:x'",
        "policies[0].spec.rules[1].algorithm: unknown algorithm 'sliding_window' (supported: token_bucket, cost_based, concurrency, token_bucket_llm, llm_spend)",
        "broken.json: not valid JSON at line 1, column 11",
    ] {
        assert!(err.contains(expected), "{expected:?} missing from:\n{err}");
    }
    let (code, _, err) = tollgate(&["validate", "/does/not/exist.json"], None);
    assert_eq!(code, 1);
    assert!(err.contains("/does/not/exist.json: cannot read"), "{err}");
}

/// Tier policies replay with the claims a verified token would carry.
#[test]
fn simulate_replays_jwt_tiers_from_claims() {
    let mut input = String::new();
    for _ in 0..3 {
        input.push_str(r#"{"t": 0.0, "path": "/v1/chat", "ip": "198.51.100.1", "claims": {"sub": "u1", "plan": "pro", "org": {"id": "o1"}}}"#);
        input.push('\n');
    }
    input.push_str(r#"{"t": 0.0, "path": "/v1/chat", "ip": "198.51.100.1"}"#);
    input.push('\n');
    let (code, out, err) = tollgate(
        &["simulate", "--policy", "policies/jwt-tiers.json"],
        Some(&input),
    );
    assert_eq!(code, 0, "{err}");
    let lines = json_lines(&out);
    let rules = |i: usize| -> Vec<String> {
        lines[i]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "{}={}",
                    r["rule"].as_str().unwrap(),
                    r["key"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(rules(0), vec!["plan-pro=u1", "org-ceiling=o1"]);
    assert_eq!(lines[2]["rules"][0]["tokens"].as_f64(), Some(197.0));
    // Without a token: the per-IP fallback; the org ceiling is skipped (no jwt:org.id).
    assert_eq!(rules(3), vec!["no-matching-tier=198.51.100.1"]);
}

/// `tollgate import envoy-ratelimit`: a bundle that validates on stdout, what it could not map
/// exactly on stderr; a broken or missing file is a clear error.
#[test]
fn import_envoy_ratelimit_prints_a_valid_bundle_and_its_notes() {
    let (code, out, err) = tollgate(
        &[
            "import",
            "envoy-ratelimit",
            "examples/envoy/ratelimit-config.yaml",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let bundle: Value = serde_json::from_str(&out).expect("JSON bundle");
    let ids: Vec<&str> = bundle["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["edge.api_key", "edge", "edge-shadow"]);
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        ["not mapped exactly: descriptors[3]: shadow_mode differs from its wildcard sibling descriptors[1]: its limit runs in the shadow policy, and a rule of 1000000000 per second keeps the wildcard's limit off it"]
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.json");
    std::fs::write(&file, &out).unwrap();
    let (code, out, err) = tollgate(&["validate", file.to_str().unwrap()], None);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("ok (bundle_version 1, 3 policies, 5 rules"),
        "{out}"
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "domain: edge\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 3}\n").unwrap();
    let (code, out, err) = tollgate(&["import", "envoy-ratelimit", bad.to_str().unwrap()], None);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(
        err.contains("bad.yaml: not an envoyproxy/ratelimit configuration"),
        "{err}"
    );
    assert!(err.contains("unknown field `burst`"), "{err}");
    let (code, _, err) = tollgate(&["import", "envoy-ratelimit", "/nonexistent.yaml"], None);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent.yaml: cannot read"), "{err}");
}

/// `simulate` replays a conversation log against the LLM tier policy: each request reserves
/// its prompt estimate plus its completion, and is then charged the usage the log records.
#[test]
fn simulate_replays_a_conversation_log_with_real_usage() {
    let (code, out, err) = tollgate(
        &[
            "simulate",
            "--policy",
            "policies/llm-tiers.json",
            "--requests",
            "examples/llm-conversation.jsonl",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let seen: Vec<String> = json_lines(&out)
        .iter()
        .map(|l| {
            let day = l["rules"]
                .as_array()
                .and_then(|rules| {
                    rules
                        .iter()
                        .find(|r| r["rule"].as_str().is_some_and(|n| n.ends_with(":tpd")))
                })
                .map_or(Value::Null, |r| r["tokens"].clone());
            format!(
                "{} {} reserved={} used={} day_left={}",
                l["status"],
                l["reason"].as_str().unwrap_or("-"),
                l["reserved"],
                l["settled"]["used"],
                day
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            // Free tier, 26 prompt tokens + 1 000: 95 used, the day moves by 95 only.
            "200 - reserved=1026 used=95 day_left=8974.0",
            "200 - reserved=1058 used=702 day_left=8847.0",
            // max_tokens 3 000 reserves max_completion_tokens (1 000); 2 890 used is charged.
            "200 - reserved=1015 used=2890 day_left=8188.0",
            // The minute bucket is in debt: refused before the model, nothing spent.
            "429 tpm_exceeded reserved=null used=null day_left=6313.0",
            "429 tpm_exceeded reserved=null used=null day_left=6313.0",
            "200 - reserved=1003 used=760 day_left=5310.0",
            // Pro tier, Responses API shape, no max tokens: the default 1 000 is reserved.
            "200 - reserved=1008 used=26 day_left=1998992.0",
            // No verified token: the fallback per-IP limit, nothing metered.
            "200 - reserved=null used=null day_left=null",
        ]
    );
}

#[test]
fn a_short_reservation_secret_stops_start_up_without_being_echoed() {
    let (code, _out, err) = tollgate(
        &[
            "run",
            "--policy",
            "policies/llm-tiers.json",
            "--reservation-secret",
            "hunter2-too-short",
        ],
        None,
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--reservation-secret: must be at least 32 bytes"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    // Long enough, but with the embedded store each gateway would mark its own settlements.
    let (code, _out, err) = tollgate(
        &[
            "run",
            "--policy",
            "policies/llm-tiers.json",
            "--reservation-secret",
            "0123456789abcdef0123456789abcdef",
        ],
        None,
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--reservation-secret: needs a shared --store"),
        "{err}"
    );
    assert!(!err.contains("0123456789abcdef"), "{err}");
}
