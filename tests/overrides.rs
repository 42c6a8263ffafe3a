//! Per-key overrides set at runtime (`PUT/GET/DELETE /v1/overrides`), through the real binary:
//! across two gateways on Redis (applied on the other within 1 s), through restarts (Redis, and
//! the embedded store with `--state-dir`), through a reload (kept; orphaned when the rule goes),
//! deleted (the bundle's quota again), and refused with the bundle's error paths.

use crate::support;

use std::time::{Duration, Instant};
use support::servers::RedisServer;
use support::{json_of, request_with_body, Gateway, ADMIN_TOKEN};

const POLICY: &str = r#"{"bundle_version": 1, "policies": [{"id": "api", "spec": {"rules": [
  {"name": "per-tenant", "limit_keys": ["header:x-tenant"], "algorithm": "token_bucket",
   "algorithm_config": {"count": 2, "period": "1h", "burst": 2}}]}}]}"#;

/// The same rule in a new bundle version.
const POLICY_V2: &str = r#"{"bundle_version": 2, "policies": [{"id": "api", "spec": {"rules": [
  {"name": "per-tenant", "limit_keys": ["header:x-tenant"], "algorithm": "token_bucket",
   "algorithm_config": {"count": 2, "period": "1h", "burst": 2}}]}}]}"#;

/// The rule renamed: overrides of `per-tenant` are orphaned.
const POLICY_V3: &str = r#"{"bundle_version": 3, "policies": [{"id": "api", "spec": {"rules": [
  {"name": "per-customer", "limit_keys": ["header:x-tenant"], "algorithm": "token_bucket",
   "algorithm_config": {"count": 2, "period": "1h", "burst": 2}}]}}]}"#;

fn bearer() -> String {
    format!("Bearer {ADMIN_TOKEN}")
}

fn put(gw: &Gateway, body: &str) -> support::HttpResponse {
    request_with_body(
        gw.admin,
        "PUT",
        "/v1/overrides",
        &[
            ("Authorization", &bearer()),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    )
}

fn listed(gw: &Gateway) -> serde_json::Value {
    json_of(&support::operator(gw, "GET", "/v1/overrides"))
}

/// Whether `key` is listed, and orphaned.
fn listed_key(gw: &Gateway, key: &str) -> Option<bool> {
    listed(gw)["overrides"]
        .as_array()?
        .iter()
        .find(|o| o["key"] == key)
        .and_then(|o| o["orphaned"].as_bool())
}

/// A decision for tenant `tenant`: its status and `RateLimit` header.
fn decide(gw: &Gateway, tenant: &str) -> (u16, String) {
    let r = support::request(
        gw.admin,
        "POST",
        "/v1/decision",
        &[("X-Original-URI", "/api/x"), ("X-Tenant", tenant)],
    );
    let ratelimit = r.header("RateLimit").unwrap_or("").to_string();
    (r.status, ratelimit)
}

/// `n` decisions for `tenant`: how many were admitted, and the last one's `RateLimit-Policy`.
fn admitted(gw: &Gateway, tenant: &str, n: usize) -> (usize, String) {
    admitted_with(gw, &[("X-Original-URI", "/api/x"), ("X-Tenant", tenant)], n)
}

/// `n` decisions described by `headers`: how many were admitted, and the last one's
/// `RateLimit-Policy`.
fn admitted_with(gw: &Gateway, headers: &[(&str, &str)], n: usize) -> (usize, String) {
    let mut policy = String::new();
    let mut count = 0;
    for _ in 0..n {
        let r = support::request(gw.admin, "POST", "/v1/decision", headers);
        count += usize::from(r.status == 200);
        policy = r.header("RateLimit-Policy").unwrap_or("").to_string();
    }
    (count, policy)
}

/// Polls `gw`'s list until `key` is listed (`present`) or gone, failing after 1 s: how long a
/// change made on another gateway of the fleet may take.
fn within_a_second(gw: &Gateway, key: &str, present: bool) {
    let started = Instant::now();
    while listed_key(gw, key).is_some() != present {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the other gateway did not see the change to {key} within 1 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn token_flag() -> String {
    format!("--admin-token={ADMIN_TOKEN}")
}

#[test]
fn overrides_reach_a_fleet_on_redis_within_a_second_and_outlive_restarts_and_reloads() {
    let redis = RedisServer::start();
    let upstream = support::Upstream::start();
    let token = token_flag();
    let [a, b] = support::start_fleet_with(
        POLICY,
        upstream.addr,
        &redis.url(),
        "1000",
        Duration::from_secs(20),
        &[token.as_str()],
    );
    let body = r#"{"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 5}"#;
    let r = put(&a, body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        json_of(&r),
        serde_json::json!({"override": {"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 5},
                           "replaced": null})
    );
    // Gateway B reads the table within 1 s, and enforces it from then on.
    within_a_second(&b, "acme", true);
    assert_eq!(decide(&b, "acme").1, "\"per-tenant\";r=4;t=1800");
    assert_eq!(
        admitted(&b, "acme", 10),
        (4, "\"per-tenant\";q=5;w=9000".into())
    );
    // Another tenant keeps the bundle's burst of 2.
    assert_eq!(
        admitted(&b, "globex", 5),
        (2, "\"per-tenant\";q=2;w=3600".into())
    );

    // A restart of B reads the table back from the store.
    assert_eq!(
        put(
            &a,
            r#"{"policy": "api", "rule": "per-tenant", "key": "initech", "burst": 3}"#
        )
        .status,
        200
    );
    let flags = [format!("--store={}", redis.url()), token.clone()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    drop(b);
    let b = Gateway::start(Some(POLICY), Some(upstream.addr), &flags);
    b.wait_until(Duration::from_secs(10), || {
        listed_key(&b, "initech") == Some(false)
    });
    assert_eq!(
        admitted(&b, "initech", 6),
        (3, "\"per-tenant\";q=3;w=5400".into())
    );

    // A reload keeps the overrides; one removing the rule leaves them orphaned.
    assert_eq!(
        put(
            &a,
            r#"{"policy": "api", "rule": "per-tenant", "key": "hooli", "burst": 4}"#
        )
        .status,
        200
    );
    support::write_atomically(&a.policy, POLICY_V2);
    a.signal(libc::SIGHUP);
    a.wait_until(Duration::from_secs(5), || {
        a.admin("GET", "/readyz", &[])
            .body
            .contains("\"policy_version\":2")
    });
    assert_eq!(listed_key(&a, "hooli"), Some(false));
    assert_eq!(
        admitted(&a, "hooli", 6),
        (4, "\"per-tenant\";q=4;w=7200".into())
    );
    support::write_atomically(&a.policy, POLICY_V3);
    a.signal(libc::SIGHUP);
    a.wait_until(Duration::from_secs(5), || {
        a.admin("GET", "/readyz", &[])
            .body
            .contains("\"policy_version\":3")
    });
    assert_eq!(listed_key(&a, "hooli"), Some(true));
    assert_eq!(listed(&a)["overrides"].as_array().map(Vec::len), Some(3));
    let status = support::operator(&a, "GET", "/status").body;
    assert!(status.contains("orphaned"), "{status}");

    // DELETE on B: the bundle's quota applies on A again within 1 s.
    assert_eq!(
        put(
            &b,
            r#"{"policy": "api", "rule": "per-tenant", "key": "umbrella", "burst": 6}"#
        )
        .status,
        200
    );
    let r = support::operator(
        &b,
        "DELETE",
        "/v1/overrides?policy=api&rule=per-tenant&key=umbrella",
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        json_of(&r),
        serde_json::json!({"deleted": {"policy": "api", "rule": "per-tenant", "key": "umbrella", "burst": 6}})
    );
    within_a_second(&a, "umbrella", false);
    assert_eq!(
        support::operator(
            &b,
            "DELETE",
            "/v1/overrides?policy=api&rule=per-tenant&key=umbrella"
        )
        .status,
        404
    );
}

#[test]
fn the_state_dir_keeps_overrides_through_a_restart() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().to_str().unwrap().to_string();
    let token = token_flag();
    let flags = ["--state-dir", dir.as_str(), token.as_str()];
    let gw = Gateway::start(Some(POLICY), None, &flags);
    let body = r#"{"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 4,
                   "expires_at": "2100-01-01T00:00:00Z"}"#;
    assert_eq!(put(&gw, body).status, 200);
    let file = state.path().join("overrides.json");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    drop(gw);
    let gw = Gateway::start(Some(POLICY), None, &flags);
    assert_eq!(
        listed(&gw),
        serde_json::json!({"overrides": [{"policy": "api", "rule": "per-tenant", "key": "acme",
            "burst": 4, "expires_at": "2100-01-01T00:00:00Z", "orphaned": false}]})
    );
    assert_eq!(
        admitted(&gw, "acme", 6),
        (4, "\"per-tenant\";q=4;w=7200".into())
    );
    // DELETE: the bundle's burst of 2 caps the bucket again (it holds none now).
    assert_eq!(
        support::operator(
            &gw,
            "DELETE",
            "/v1/overrides?policy=api&rule=per-tenant&key=acme"
        )
        .status,
        200
    );
    assert_eq!(admitted(&gw, "fresh", 3).0, 2);
    drop(gw);
    let gw = Gateway::start(Some(POLICY), None, &flags);
    assert_eq!(listed(&gw), serde_json::json!({"overrides": []}));
}

#[test]
fn invalid_overrides_are_refused_with_the_bundles_error_paths() {
    let token = token_flag();
    let gw = Gateway::start(Some(POLICY), None, &[token.as_str()]);
    let refused = |body: &str| {
        let r = put(&gw, body);
        (r.status, json_of(&r))
    };
    assert_eq!(
        refused(r#"{"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 0.5}"#),
        (
            400,
            serde_json::json!({"error": "invalid override", "errors": ["burst: must be >= 1"]})
        )
    );
    assert_eq!(
        refused(r#"{"policy": "api", "rule": "per-tenant", "key": "acme", "count": 3, "rps": 1}"#),
        (
            400,
            serde_json::json!({"error": "invalid override",
                "errors": ["count: set either tokens_per_second/rps or count + period, not both"]})
        )
    );
    assert_eq!(
        refused(
            r#"{"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 3, "budget": 9}"#
        ),
        (
            400,
            serde_json::json!({"error": "invalid override",
                "errors": ["budget: unknown field (expected one of: policy, rule, key, expires_at, tokens_per_second, rps, burst, count, period)"]})
        )
    );
    assert_eq!(
        refused(r#"{"rule": "per-tenant", "key": "acme", "burst": 3, "expires_at": "soon"}"#),
        (
            400,
            serde_json::json!({"error": "invalid override",
                "errors": ["policy: is required", "expires_at: must be an RFC 3339 UTC time such as 2030-01-01T00:00:00Z"]})
        )
    );
    assert_eq!(
        refused(r#"{"policy": "api", "rule": "per-ip", "key": "acme", "burst": 3}"#),
        (
            404,
            serde_json::json!({"error": "no rule \"per-ip\" in policy \"api\" of the bundle in force"})
        )
    );
    assert_eq!(refused("not json").0, 400);
    assert_eq!(listed(&gw), serde_json::json!({"overrides": []}));
    assert_eq!(
        support::operator(&gw, "DELETE", "/v1/overrides?policy=api&rule=per-tenant").status,
        400
    );
    // Without the token: nothing is read or written.
    assert_eq!(
        support::request(gw.admin, "GET", "/v1/overrides", &[]).status,
        401
    );
    assert_eq!(support::operator(&gw, "POST", "/v1/overrides").status, 405);
}

/// The same on PostgreSQL: the table lives in the store, and the other gateway applies a PUT
/// within 1 s.
#[test]
fn overrides_reach_a_fleet_on_postgres_within_a_second() {
    let pg = support::servers::PgServer::start();
    let upstream = support::Upstream::start();
    let token = token_flag();
    let [a, b] = support::start_fleet_with(
        POLICY,
        upstream.addr,
        &pg.url(),
        "1000",
        Duration::from_secs(30),
        &[token.as_str()],
    );
    let body = r#"{"policy": "api", "rule": "per-tenant", "key": "acme", "burst": 5}"#;
    assert_eq!(put(&a, body).status, 200);
    within_a_second(&b, "acme", true);
    assert_eq!(
        admitted(&b, "acme", 10),
        (5, "\"per-tenant\";q=5;w=9000".into())
    );
    assert_eq!(
        support::operator(
            &b,
            "DELETE",
            "/v1/overrides?policy=api&rule=per-tenant&key=acme"
        )
        .status,
        200
    );
    within_a_second(&a, "acme", false);
}

/// `burst_from` through the real binary: a token signed here states the burst; the rule's
/// `max_burst` bounds it; a forged token (or none) gets the rule's own burst.
#[test]
fn burst_from_reads_the_burst_of_a_verified_token() {
    use jsonwebtoken::{encode, EncodingKey, Header};
    const PLAN: &str = r#"{"bundle_version": 1, "policies": [{"id": "api", "spec": {"rules": [
      {"name": "per-user", "limit_keys": ["jwt:sub"], "on_missing": "shared", "algorithm": "token_bucket",
       "algorithm_config": {"count": 1, "period": "1h", "burst": 2,
                            "burst_from": "jwt:limits.burst", "max_burst": 6}}]}}]}"#;
    let gw = Gateway::start(Some(PLAN), None, &["--jwt-secret", "plan-secret"]);
    let token = |secret: &str, sub: &str, burst: serde_json::Value| {
        let claims = serde_json::json!({"sub": sub, "limits": {"burst": burst},
                                        "exp": jsonwebtoken::get_current_timestamp() + 600});
        let jwt = encode(
            &Header::default(),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap();
        format!("Bearer {jwt}")
    };
    let admitted = |authorization: &str| {
        admitted_with(
            &gw,
            &[("X-Original-URI", "/"), ("Authorization", authorization)],
            10,
        )
    };
    assert_eq!(
        admitted(&token("plan-secret", "alice", 4.into())),
        (4, "\"per-user\";q=4;w=14400".into())
    );
    assert_eq!(
        admitted(&token("plan-secret", "bob", 1000.into())),
        (6, "\"per-user\";q=6;w=21600".into())
    );
    assert_eq!(
        admitted(&token("plan-secret", "carol", "many".into())),
        (2, "\"per-user\";q=2;w=7200".into())
    );
    // Signed with another key: no verified claims, the shared bucket of the rule's own burst.
    assert_eq!(
        admitted(&token("forged", "mallory", 1000.into())),
        (2, "\"per-user\";q=2;w=7200".into())
    );
}
