//! Verified identity end to end: real tokens signed in the test (HS256, RS256, ES256, JWKS),
//! through the real binary's proxy and decision service.

use crate::support;

use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;
use std::path::PathBuf;
use support::{request, Gateway, Upstream};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/jwt")
        .join(name)
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

fn claims(sub: &str, plan: &str) -> serde_json::Value {
    json!({"sub": sub, "plan": plan, "exp": now() + 600})
}

fn sign(
    alg: Algorithm,
    key: &EncodingKey,
    kid: Option<&str>,
    claims: &serde_json::Value,
) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_string);
    encode(&header, claims, key).unwrap()
}

fn hs(secret: &str, claims: &serde_json::Value) -> String {
    sign(
        Algorithm::HS256,
        &EncodingKey::from_secret(secret.as_bytes()),
        None,
        claims,
    )
}

fn ec_key() -> EncodingKey {
    EncodingKey::from_ec_pem(&std::fs::read(fixture("ec-private.pem")).unwrap()).unwrap()
}

fn rsa_key(name: &str) -> EncodingKey {
    EncodingKey::from_rsa_pem(&std::fs::read(fixture(name)).unwrap()).unwrap()
}

/// Enterprise: burst 3 per subject. Anyone else: the fallback, burst 1 per IP.
const TIERS: &str = r#"{"bundle_version": 1, "policies": [{"id": "plans", "spec": {
    "rules": [{"name": "enterprise", "limit_keys": ["jwt:sub"], "match": {"jwt:plan": "enterprise"},
               "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 3}}],
    "fallback_limit": {"name": "no-matching-tier", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
                       "algorithm_config": {"rps": 0.001, "burst": 1}}}}]}"#;

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// The rule that answered, from `RateLimit-Policy`.
fn rule_of(r: &support::HttpResponse) -> String {
    r.header("RateLimit-Policy")
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim_matches('"')
        .to_string()
}

#[test]
fn hs256_tiers_apply_and_forgeries_buy_nothing() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(TIERS),
        Some(upstream.addr),
        &["--jwt-secret", "tier-secret"],
    );
    let alice = bearer(&hs("tier-secret", &claims("alice", "enterprise")));
    for remaining in ["2", "1", "0"] {
        let r = gw.get("/", &[("Authorization", &alice)]);
        assert_eq!(r.status, 200);
        assert_eq!(rule_of(&r), "enterprise");
        assert_eq!(r.header("RateLimit-Remaining"), Some(remaining));
    }
    assert_eq!(gw.get("/", &[("Authorization", &alice)]).status, 429);
    // Another enterprise subject has its own bucket.
    let bob = bearer(&hs("tier-secret", &claims("bob", "enterprise")));
    assert_eq!(gw.get("/", &[("Authorization", &bob)]).status, 200);

    // Forgeries all land in the no-matching-tier fallback (burst 1, shared by this IP).
    let wrong_key = bearer(&hs("not-the-secret", &claims("mallory", "enterprise")));
    let r = gw.get("/", &[("Authorization", &wrong_key)]);
    assert_eq!((r.status, rule_of(&r).as_str()), (200, "no-matching-tier"));
    let good = hs("tier-secret", &claims("mallory", "free"));
    let parts: Vec<&str> = good.split('.').collect();
    let upgraded = hs("x", &claims("mallory", "enterprise"));
    let altered = bearer(&format!(
        "{}.{}.{}",
        parts[0],
        upgraded.split('.').nth(1).unwrap(),
        parts[2]
    ));
    let none = {
        use base64::Engine as _;
        let b = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        bearer(&format!(
            "{}.{}.",
            b(br#"{"alg":"none","typ":"JWT"}"#),
            b(claims("mallory", "enterprise").to_string().as_bytes())
        ))
    };
    let expired = bearer(&hs(
        "tier-secret",
        &json!({"sub": "carol", "plan": "enterprise", "exp": now() - 3600}),
    ));
    for forged in [&altered, &none, &expired, &wrong_key] {
        let r = gw.get("/", &[("Authorization", forged)]);
        assert_eq!(
            r.status, 429,
            "a forged or expired token must not buy the enterprise tier"
        );
        assert_eq!(rule_of(&r), "no-matching-tier");
    }
    // A genuine token whose plan no rule names lands there too: the rule's name says no tier
    // matched, not that the token was bad.
    let unknown_plan = bearer(&hs("tier-secret", &claims("dave", "platinum")));
    let r = gw.get("/", &[("Authorization", &unknown_plan)]);
    assert_eq!((r.status, rule_of(&r).as_str()), (429, "no-matching-tier"));
    assert_eq!(
        gw.metric("tollgate_jwt_invalid_total{reason=\"bad_signature\"}"),
        3.0
    );
    assert_eq!(
        gw.metric("tollgate_jwt_invalid_total{reason=\"malformed\"}"),
        1.0
    );
    assert_eq!(
        gw.metric("tollgate_jwt_invalid_total{reason=\"expired\"}"),
        1.0
    );
    // Five tier tokens and the unknown plan's: valid, and counted apart from the bad ones.
    assert_eq!(gw.metric("tollgate_jwt_valid_total"), 6.0);
    // Never a 500, whatever the token bytes; and no token contents in the logs.
    for junk in [
        "Bearer",
        "Bearer ....",
        "Bearer e30.e30.e30",
        "Bearer a.b",
        "Basic abc",
        "Bearer \u{e9}t\u{e9}",
    ] {
        let r = gw.get("/", &[("Authorization", junk)]);
        assert!(
            r.status == 200 || r.status == 429,
            "{junk:?} gave {}",
            r.status
        );
    }
    // Bytes HTTP forbids in a header value are refused by the HTTP parser itself.
    assert_eq!(
        gw.get("/", &[("Authorization", "Bearer \u{7f}x")]).status,
        400
    );
    assert_eq!(gw.admin("GET", "/livez", &[]).status, 200);
    assert!(
        !gw.log_text().contains(parts[1]),
        "token contents must not be logged"
    );
}

#[test]
fn rs256_es256_and_jwks_keys_verify() {
    let upstream = Upstream::start();
    let rsa_pub = fixture("rsa-public.pem");
    let ec_pub = fixture("ec-public.pem");
    let jwks = fixture("jwks.json");
    let gw = Gateway::start(
        Some(TIERS),
        Some(upstream.addr),
        &[
            "--jwt-public-key",
            rsa_pub.to_str().unwrap(),
            "--jwt-public-key",
            ec_pub.to_str().unwrap(),
            "--jwt-jwks",
            jwks.to_str().unwrap(),
        ],
    );
    let rs = bearer(&sign(
        Algorithm::RS256,
        &rsa_key("rsa-private.pem"),
        None,
        &claims("rs", "enterprise"),
    ));
    let ps = bearer(&sign(
        Algorithm::PS256,
        &rsa_key("rsa-private.pem"),
        None,
        &claims("ps", "enterprise"),
    ));
    let ec_key = ec_key();
    let es = bearer(&sign(
        Algorithm::ES256,
        &ec_key,
        None,
        &claims("es", "enterprise"),
    ));
    let by_kid = bearer(&sign(
        Algorithm::RS256,
        &rsa_key("rsa-private.pem"),
        Some("rsa-1"),
        &claims("kid", "enterprise"),
    ));
    for token in [&rs, &ps, &es, &by_kid] {
        let r = gw.get("/", &[("Authorization", token)]);
        assert_eq!((r.status, rule_of(&r).as_str()), (200, "enterprise"));
    }
    // Signed by a key nobody trusts; and an unknown kid.
    let untrusted = bearer(&sign(
        Algorithm::RS256,
        &rsa_key("rsa-other-private.pem"),
        None,
        &claims("x", "enterprise"),
    ));
    let unknown_kid = bearer(&sign(
        Algorithm::RS256,
        &rsa_key("rsa-other-private.pem"),
        Some("rsa-9"),
        &claims("y", "enterprise"),
    ));
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &untrusted)])),
        "no-matching-tier"
    );
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &unknown_kid)])),
        "no-matching-tier"
    );
    // An HS256 token signed with the RSA public key as secret (algorithm confusion) is refused:
    // no HMAC key is configured, so HS256 is not even allowed.
    let confused = bearer(&hs(
        &std::fs::read_to_string(&rsa_pub).unwrap(),
        &claims("z", "enterprise"),
    ));
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &confused)])),
        "no-matching-tier"
    );
    assert_eq!(
        gw.metric("tollgate_jwt_invalid_total{reason=\"algorithm_not_allowed\"}"),
        1.0
    );
}

#[test]
fn proxy_and_decision_service_agree_and_share_buckets() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(TIERS),
        Some(upstream.addr),
        &["--jwt-secret", "s", "--jwt-cookie", "session"],
    );
    let token = hs("s", &claims("dana", "enterprise"));
    let cookie = format!("theme=dark; session={token}");
    let via_proxy = gw.get("/", &[("Cookie", &cookie)]);
    assert_eq!(
        (via_proxy.status, rule_of(&via_proxy).as_str()),
        (200, "enterprise")
    );
    let via_service = gw.admin(
        "POST",
        "/v1/decision",
        &[("X-Original-URI", "/"), ("Cookie", &cookie)],
    );
    assert_eq!(via_service.status, 200);
    assert_eq!(rule_of(&via_service), "enterprise");
    assert_eq!(
        via_service.header("RateLimit-Remaining"),
        Some("1"),
        "one bucket for both entry points"
    );
    assert_eq!(gw.get("/", &[("Cookie", &cookie)]).status, 200);
    assert_eq!(
        gw.admin(
            "POST",
            "/v1/decision",
            &[("X-Original-URI", "/"), ("Cookie", &cookie)]
        )
        .status,
        429
    );
    // The same token as a Bearer header is ignored when the cookie is the configured source.
    let r = request(gw.proxy, "GET", "/", &[("Authorization", &bearer(&token))]);
    assert_eq!(rule_of(&r), "no-matching-tier");
}

#[test]
fn unverified_mode_trusts_claims_but_not_expiry() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(TIERS), Some(upstream.addr), &["--jwt-unverified"]);
    assert!(gw
        .log_text()
        .contains("--jwt-unverified: JWT claims are used WITHOUT checking signatures"));
    let unsigned_by_us = bearer(&hs("anything", &claims("erin", "enterprise")));
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &unsigned_by_us)])),
        "enterprise"
    );
    let expired = bearer(&hs(
        "anything",
        &json!({"sub": "erin", "plan": "enterprise", "exp": now() - 3600}),
    ));
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &expired)])),
        "no-matching-tier"
    );
}

#[test]
fn required_claims_reject_with_401_when_missing() {
    let upstream = Upstream::start();
    let policy = r#"{"rules": [{"name": "per-user", "limit_keys": ["jwt:sub"], "on_missing": "reject",
        "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 10}}]}"#;
    let gw = Gateway::start(
        Some(policy),
        Some(upstream.addr),
        &[
            "--jwt-secret",
            "s",
            "--jwt-issuer",
            "https://id.example.com",
        ],
    );
    let r = gw.get("/", &[]);
    assert_eq!(r.status, 401);
    assert!(r.body.starts_with("Unauthorized"), "{}", r.body);
    assert_eq!(r.header("X-Tollgate-Reason"), Some("missing_descriptor"));
    let wrong_issuer = bearer(&hs(
        "s",
        &json!({"sub": "f", "iss": "https://other", "exp": now() + 60}),
    ));
    assert_eq!(gw.get("/", &[("Authorization", &wrong_issuer)]).status, 401);
    let ok = bearer(&hs(
        "s",
        &json!({"sub": "f", "iss": "https://id.example.com", "exp": now() + 60}),
    ));
    assert_eq!(gw.get("/", &[("Authorization", &ok)]).status, 200);
    assert_eq!(upstream.hits(), 1);
}

#[test]
fn jwks_is_reloaded_with_the_policy() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, r#"{"keys": []}"#).unwrap();
    let gw = Gateway::start(
        Some(TIERS),
        Some(upstream.addr),
        &[
            "--jwt-jwks",
            jwks.to_str().unwrap(),
            "--jwt-algorithms",
            "RS256",
        ],
    );
    let token = bearer(&sign(
        Algorithm::RS256,
        &rsa_key("rsa-private.pem"),
        Some("rsa-1"),
        &claims("gus", "enterprise"),
    ));
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &token)])),
        "no-matching-tier"
    );
    assert_eq!(
        gw.metric("tollgate_jwt_invalid_total{reason=\"unknown_kid\"}"),
        1.0
    );
    // The key is published; a policy reload (SIGHUP) picks it up.
    std::fs::copy(fixture("jwks.json"), &jwks).unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_until(std::time::Duration::from_secs(10), || {
        gw.metric("tollgate_policy_reloads_total{result=\"success\"}") == 2.0
    });
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &token)])),
        "enterprise"
    );
    // A broken JWKS file keeps the previous keys.
    std::fs::write(&jwks, "not json").unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_until(std::time::Duration::from_secs(10), || {
        gw.log_text().contains("JWKS reload failed")
    });
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &token)])),
        "enterprise"
    );
}

/// Issue 13, attack 10: a JWKS that gains an EC key kept refusing ES256 tokens
/// (`algorithm_not_allowed`: the allow-list was fixed at start), and a JWKS empty at start kept
/// JWT off until restart. Keys and allowed algorithms now change together, and a changed JWKS
/// file is picked up by the file watcher without any policy change.
#[test]
fn rotated_jwks_keys_take_effect_with_their_algorithms() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, r#"{"keys": []}"#).unwrap();
    let gw = Gateway::start(
        Some(TIERS),
        Some(upstream.addr),
        &[
            "--jwt-jwks",
            jwks.to_str().unwrap(),
            "--policy-poll-secs",
            "1",
        ],
    );
    let ec_key = ec_key();
    let es = bearer(&sign(
        Algorithm::ES256,
        &ec_key,
        Some("ec-1"),
        &claims("es", "enterprise"),
    ));
    let rs = bearer(&sign(
        Algorithm::RS256,
        &rsa_key("rsa-private.pem"),
        Some("rsa-1"),
        &claims("rs", "enterprise"),
    ));
    // Empty at start: tokens are looked at (and refused), not ignored.
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &es)])),
        "no-matching-tier"
    );
    assert_eq!(
        gw.metric("tollgate_jwt_invalid_total{reason=\"algorithm_not_allowed\"}"),
        1.0
    );
    // An RSA key appears (file change only).
    std::fs::copy(fixture("jwks.json"), &jwks).unwrap();
    gw.wait_until(std::time::Duration::from_secs(10), || {
        rule_of(&gw.get("/", &[("Authorization", &rs)])) == "enterprise"
    });
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &es)])),
        "no-matching-tier"
    );
    // Rotation adds an EC key: ES256 is allowed with it.
    std::fs::copy(fixture("jwks-rsa-ec.json"), &jwks).unwrap();
    gw.wait_until(std::time::Duration::from_secs(10), || {
        rule_of(&gw.get("/", &[("Authorization", &es)])) == "enterprise"
    });
    assert_eq!(
        rule_of(&gw.get("/", &[("Authorization", &rs)])),
        "enterprise"
    );
    assert!(gw.log_text().contains("JWKS file changed: keys reloaded"));
    // The policy was never reloaded.
    assert_eq!(
        gw.metric("tollgate_policy_reloads_total{result=\"success\"}"),
        1.0
    );
}
