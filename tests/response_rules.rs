//! Rules that count what the response says, through the real binary: `count_when` (failed
//! logins counted, successful ones never), a response-priced cost (`response_header:<name>`)
//! settled exactly, clamped at `max_cost` and defaulted when the header is missing, and the
//! penalty box: a block shared by two gateways on Redis, kept through a restart with
//! `--state-dir`, and lifted within a second of its end.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::origin::{response, Origin, OriginRequest};
use support::servers::{PgServer, RedisServer};
use support::{json_of, request, start_fleet, Gateway, HttpResponse, ADMIN_TOKEN};

/// A fake login and GraphQL origin: `/login?ok` answers 200, any other `/login` 401;
/// `/graphql?c=N` answers 200 with `X-Complexity: N` (`/graphql` alone: no header).
fn login_and_graphql() -> Origin {
    Origin::start(|request: &OriginRequest| {
        let target = request.target.as_str();
        let (status, extra) = if let Some(c) = target.strip_prefix("/graphql?c=") {
            ("200 OK", format!("X-Complexity: {c}\r\n"))
        } else if target.starts_with("/graphql") || target == "/login?ok" {
            ("200 OK", String::new())
        } else {
            ("401 Unauthorized", String::new())
        };
        response(status, &extra, b"ok")
    })
}

/// At most 5 failed logins per client per 10 minutes; with `penalty` (and room for 10),
/// 3 failures within a minute block the client for `block_secs`.
fn login_policy(penalty_block_secs: Option<u64>) -> String {
    let burst = if penalty_block_secs.is_some() { 10 } else { 5 };
    let penalty = penalty_block_secs.map_or(String::new(), |secs| {
        format!(r#", "penalty": {{"after": 3, "within": "1m", "block_for": "{secs}s"}}"#)
    });
    format!(
        r#"{{"bundle_version": 1, "policies": [{{"id": "login", "spec": {{
          "selector": {{"pathPrefix": "/login"}}, "rules": [
          {{"name": "failed-logins", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
           "algorithm_config": {{"count": {burst}, "period": "10m", "burst": {burst},
             "count_when": {{"status": [401, 403]}}{penalty}}}}}]}}}}]}}"#
    )
}

fn post(addr: SocketAddr, target: &str) -> HttpResponse {
    request(addr, "POST", target, &[("Content-Length", "0")])
}

fn reason(r: &HttpResponse) -> Option<&str> {
    r.header("X-Tollgate-Reason")
}

fn bucket(gw: &Gateway, name: &str) -> serde_json::Value {
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    json_of(&request(
        gw.admin,
        "GET",
        &format!("/v1/buckets/{name}"),
        &[("Authorization", &bearer)],
    ))
}

/// Successes through `gateways` in turn are never counted, failures are, and the sixth
/// attempt after 5 failures is refused before the origin.
fn assert_failures_counted(gateways: &[&Gateway], origin: &Origin) {
    for i in 0..200 {
        let r = post(gateways[i % gateways.len()].proxy, "/login?ok");
        assert_eq!(r.status, 200, "success {i}: {r:?}");
    }
    for i in 0..5 {
        let r = post(gateways[i % gateways.len()].proxy, "/login");
        assert_eq!(r.status, 401, "failure {i}: {r:?}");
    }
    for gw in gateways {
        let r = post(gw.proxy, "/login?ok");
        assert_eq!(r.status, 429, "{r:?}");
        assert_eq!(reason(&r), Some("token_bucket_exceeded"));
        // One failure forgiven every 2 minutes (and the jitter's half of it at most).
        let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
        assert!((120..=180).contains(&retry), "{retry}");
    }
    assert_eq!(origin.hits(), 205);
}

#[test]
fn failures_are_counted_and_successes_never_on_the_embedded_store() {
    let origin = login_and_graphql();
    let policy = login_policy(None);
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&policy),
        Some(origin.addr),
        &[],
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    assert_failures_counted(&[&gw], &origin);
    // Empty, but for what refilled since (a token every 2 minutes).
    let state = bucket(&gw, "tb:failed-logins:127.0.0.1");
    assert!(state["tokens"].as_f64().unwrap() < 0.01, "{state}");
}

/// Two gateways sharing the store at `store_url` count as one.
fn assert_failures_counted_on_a_fleet(store_url: &str) {
    let origin = login_and_graphql();
    let policy = login_policy(None);
    let fleet = start_fleet(
        &policy,
        origin.addr,
        store_url,
        "1000",
        Duration::from_secs(20),
    );
    assert_failures_counted(&[&fleet[0], &fleet[1]], &origin);
}

#[test]
fn failures_are_counted_across_two_gateways_on_redis() {
    let redis = RedisServer::start();
    assert_failures_counted_on_a_fleet(&redis.url());
}

/// The probe and the charge on PostgreSQL: the same counts as on the embedded store.
#[test]
fn failures_are_counted_across_two_gateways_on_postgres() {
    let pg = PgServer::start();
    assert_failures_counted_on_a_fleet(&pg.url());
}

/// Three failures through alternating gateways put the client in the box on both: 429
/// `penalty`, its `Retry-After` counting down, the origin not asked.
fn trip_the_box(gateways: &[&Gateway], origin: &Origin, block_secs: u64) -> Instant {
    for i in 0..3 {
        let r = post(gateways[i % gateways.len()].proxy, "/login");
        assert_eq!(r.status, 401, "failure {i}: {r:?}");
    }
    let tripped = Instant::now();
    let hits = origin.hits();
    for gw in gateways {
        let r = post(gw.proxy, "/login?ok");
        assert_eq!(r.status, 429, "{r:?}");
        assert_eq!(reason(&r), Some("penalty"));
        let retry: u64 = r.header("Retry-After").unwrap().parse().unwrap();
        assert!(retry <= block_secs && retry + 2 >= block_secs, "{retry}");
    }
    assert_eq!(origin.hits(), hits);
    tripped
}

/// The block ends within a second of its time: refused until just before, admitted from just
/// after.
fn assert_lifted_on_time(gw: &Gateway, tripped: Instant, block_secs: u64) {
    let block = Duration::from_secs(block_secs);
    std::thread::sleep(
        (tripped + block - Duration::from_millis(700)).saturating_duration_since(Instant::now()),
    );
    let r = post(gw.proxy, "/login?ok");
    assert_eq!(reason(&r), Some("penalty"), "{r:?}");
    assert_eq!(r.header("Retry-After"), Some("1"));
    std::thread::sleep(
        (tripped + block + Duration::from_millis(1000)).saturating_duration_since(Instant::now()),
    );
    let r = post(gw.proxy, "/login?ok");
    assert_eq!(r.status, 200, "{r:?}");
}

#[test]
fn the_penalty_box_holds_on_two_gateways_on_redis_and_ends_on_time() {
    let redis = RedisServer::start();
    let origin = login_and_graphql();
    let policy = login_policy(Some(6));
    let fleet = start_fleet(
        &policy,
        origin.addr,
        &redis.url(),
        "1000",
        Duration::from_secs(20),
    );
    let tripped = trip_the_box(&[&fleet[0], &fleet[1]], &origin, 6);
    assert_lifted_on_time(&fleet[1], tripped, 6);
    assert!(
        fleet[0].log_text().contains("PENALTY_BLOCK")
            || fleet[1].log_text().contains("PENALTY_BLOCK")
    );
}

#[test]
fn the_penalty_box_survives_a_restart_with_a_state_dir_and_an_operator_lifts_it() {
    let origin = login_and_graphql();
    let policy = login_policy(Some(8));
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().to_str().unwrap().to_string();
    let env = [("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)];
    let start = || {
        Gateway::start_with_env(
            "127.0.0.1",
            Some(&policy),
            Some(origin.addr),
            &["--state-dir", &dir],
            &env,
        )
    };
    let mut first = start();
    let tripped = trip_the_box(&[&first], &origin, 8);
    let shown = bucket(&first, "tb:failed-logins:127.0.0.1");
    assert_eq!(
        shown["penalty"]["blocked"],
        serde_json::json!(true),
        "{shown}"
    );
    assert_eq!(shown["penalty"]["after"], serde_json::json!(3), "{shown}");
    first.signal(libc::SIGTERM);
    assert!(first.wait_exit(Duration::from_secs(20)));
    let second = start();
    let r = post(second.proxy, "/login?ok");
    assert_eq!(reason(&r), Some("penalty"), "{r:?}");
    assert_lifted_on_time(&second, tripped, 8);
    // Tripped again, and lifted by the operator's reset.
    let _ = trip_the_box(&[&second], &origin, 8);
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let reset = request(
        second.admin,
        "DELETE",
        "/v1/buckets/tb:failed-logins:127.0.0.1",
        &[("Authorization", &bearer)],
    );
    assert_eq!(reset.status, 204, "{reset:?}");
    assert_eq!(post(second.proxy, "/login?ok").status, 200);
}

#[test]
fn a_response_header_cost_is_settled_exactly_clamped_and_defaulted() {
    let origin = login_and_graphql();
    let policy = r#"{"bundle_version": 1, "policies": [{"id": "gql", "spec": {"rules": [
      {"name": "complexity", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
       "algorithm_config": {"count": 1000, "period": "1h", "burst": 1000,
         "cost_source": "response_header:X-Complexity", "default_cost": 5, "max_cost": 100}}]}}]}"#;
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(policy),
        Some(origin.addr),
        &[],
        &[("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    let tokens = || {
        bucket(&gw, "tb:complexity:127.0.0.1")["tokens"]
            .as_f64()
            .unwrap()
    };
    // 42 charged; 250 clamped at 100; no header and a garbled one: the default, 5.
    let mut left = 1000.0;
    for (target, charged) in [
        ("/graphql?c=42", 42.0),
        ("/graphql?c=250", 100.0),
        ("/graphql", 5.0),
        ("/graphql?c=many", 5.0),
    ] {
        let r = post(gw.proxy, target);
        assert_eq!(r.status, 200, "{r:?}");
        // The reservation of the default before the origin answered.
        assert_eq!(
            r.header("RateLimit-Remaining").map(str::to_string),
            Some(format!("{}", left as u64 - 5))
        );
        left -= charged;
        // A tenth of a token refills every 3.6 s: within one, exact.
        let now = tokens();
        assert!((now - left).abs() < 0.1, "{target}: {now} != {left}");
    }
    assert_eq!(origin.hits(), 4);
}
