//! A shared store that stops answering (a real `redis-server`, hung with SIGSTOP): local
//! mode keeps every limit within its stated bound, writes back what was spent, keeps the
//! write-back journal across a restart, and the `open` and `closed` modes do what they say.

use crate::support;

use std::time::{Duration, Instant};
use support::servers::RedisServer;
use support::{Gateway, Upstream};

/// 20 tokens, 2 a second, per API key; `on_store_error` left to the gateway's default.
const POLICY: &str = r#"{"rules": [{"name": "per-key", "limit_keys": ["header:x-api-key"],
    "algorithm": "token_bucket", "algorithm_config": {"rps": 2, "burst": 20}}]}"#;

fn hang(redis: &RedisServer) {
    let pid = redis.child.as_ref().map(|c| c.id() as i32).unwrap();
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
}

fn resume(redis: &RedisServer) {
    let pid = redis.child.as_ref().map(|c| c.id() as i32).unwrap();
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid, libc::SIGCONT) };
}

fn readyz(gw: &Gateway) -> serde_json::Value {
    serde_json::from_str(&gw.admin("GET", "/readyz", &[]).body).unwrap()
}

/// `n` gateways on `redis` (50 ms store deadline) that all see the fleet's size.
fn fleet(redis: &RedisServer, upstream: &Upstream, n: usize, extra: &[&str]) -> Vec<Gateway> {
    let store = format!("--store={}", redis.url());
    let mut flags = vec![store.as_str(), "--store-timeout-ms", "50"];
    flags.extend_from_slice(extra);
    let gateways: Vec<Gateway> = (0..n)
        .map(|_| Gateway::start(Some(POLICY), Some(upstream.addr), &flags))
        .collect();
    for gw in &gateways {
        gw.wait_until(Duration::from_secs(20), || {
            let ready = readyz(gw);
            ready["store_status"] == "ok"
                && ready["store_mode"] == "shared"
                && ready["fleet_gateways"] == n as u64
        });
    }
    gateways
}

/// `tollgate_store_local_decisions_total` for one rule and outcome (whatever the policy id).
fn local_decisions(gw: &Gateway, rule: &str, outcome: &str) -> f64 {
    gw.metric_sum(
        "tollgate_store_local_decisions_total",
        &[
            &format!("outcome=\"{outcome}\""),
            &format!("rule=\"{rule}\""),
        ],
    )
}

fn status(gw: &Gateway, key: &str) -> u16 {
    gw.get("/", &[("X-Api-Key", key)]).status
}

/// Three gateways on one Redis, a key drained, then Redis hung while the key sends at five
/// times its rate: the fleet admits at most rate × T + one request per gateway (the last
/// known remaining is 0), and once Redis answers, what was spent is charged: the key does not
/// get a fresh burst.
#[test]
fn a_hung_redis_keeps_a_drained_key_within_the_bound_and_is_charged_after() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let gateways = fleet(&redis, &upstream, 3, &[]);
    let key = "drained";
    // From the key's first request on, the fleet may admit at most its burst, plus the rate
    // times the time since, plus one request per gateway.
    let first = Instant::now();
    let bound =
        |at: Instant| 20 + (2.0 * at.duration_since(first).as_secs_f64()).floor() as u32 + 3;
    let mut drained = 0;
    let mut drained_at = None;
    for i in 0..40 {
        if status(&gateways[i % 3], key) == 429 {
            drained_at = Some(Instant::now());
            break;
        }
        drained += 1;
    }
    assert!(drained_at.is_some(), "the key drains within 40 requests");

    hang(&redis);
    // 10 requests a second (five times the rate) for 6 s, round robin.
    let mut admitted = 0;
    let started = Instant::now();
    for i in 0..60u32 {
        let due = started + Duration::from_millis(100 * u64::from(i));
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        match status(&gateways[i as usize % 3], key) {
            200 => admitted += 1,
            429 => {}
            other => panic!("status {other} during the outage"),
        }
    }
    let outage = started.elapsed().as_secs_f64();
    for gw in &gateways {
        assert_eq!(readyz(gw)["store_mode"], "local", "{}", gw.log_text());
    }
    let limit = bound(Instant::now());
    eprintln!(
        "outage: {drained} admitted before the hang, {admitted} of 60 during {outage:.2} s of it (bound for both: {limit})"
    );
    assert!(
        drained + admitted <= limit,
        "{drained} + {admitted} > {limit}"
    );
    // Each gateway refills 2/3 of a token a second: not closed either.
    assert!(
        admitted >= 6,
        "{admitted} admitted: local mode admitted its share"
    );

    let local_allowed: f64 = gateways
        .iter()
        .map(|gw| local_decisions(gw, "per-key", "allowed"))
        .sum();
    assert_eq!(local_allowed, f64::from(admitted));
    resume(&redis);
    for gw in &gateways {
        gw.wait_until(Duration::from_secs(20), || {
            status(gw, "someone-else");
            readyz(gw)["store_mode"] == "shared"
        });
    }
    // A burst right after: only what refilled since, never a fresh 20.
    let after: u32 = (0..20)
        .map(|i| u32::from(status(&gateways[i % 3], key) == 200))
        .sum();
    let limit = bound(Instant::now());
    let total = drained + admitted + after;
    eprintln!(
        "after: {after} of 20 admitted at once; {total} in all over {:.2} s (bound {limit})",
        first.elapsed().as_secs_f64()
    );
    assert!(total <= limit, "{total} admitted, bound {limit}");
    let applied: f64 = gateways
        .iter()
        .map(|gw| gw.metric("tollgate_store_writebacks_total{outcome=\"applied\"}"))
        .sum();
    assert!(applied >= 3.0, "each gateway charged its spend: {applied}");
    for gw in &gateways {
        let log = gw.log_text();
        assert!(
            log.lines()
                .any(|l| l.contains("ERROR") && l.contains("local mode, each gateway decides")),
            "{log}"
        );
        assert!(
            log.lines()
                .any(|l| l.contains("INFO") && l.contains("local mode ended")),
            "{log}"
        );
    }
}

/// A rule with `on_store_error: closed` refuses with 503 and `Retry-After` while Redis hangs;
/// one with `open` admits untracked; local mode's RateLimit headers count the share.
#[test]
fn closed_refuses_open_admits_and_local_counts_its_share() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let policy = r#"{"rules": [
        {"name": "strict", "limit_keys": ["header:x-strict"], "on_store_error": "closed",
         "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 5}},
        {"name": "loose", "limit_keys": ["header:x-loose"], "on_store_error": "open",
         "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 5}},
        {"name": "per-key", "limit_keys": ["header:x-api-key"],
         "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 4}}]}"#;
    let store = format!("--store={}", redis.url());
    let gw = Gateway::start(
        Some(policy),
        Some(upstream.addr),
        &[store.as_str(), "--store-timeout-ms", "50"],
    );
    gw.wait_until(Duration::from_secs(20), || {
        readyz(&gw)["fleet_gateways"] == 1 && readyz(&gw)["store_status"] == "ok"
    });
    assert_eq!(gw.get("/", &[("X-Strict", "a")]).status, 200);
    let hits = upstream.hits();
    hang(&redis);
    let refused = gw.get("/", &[("X-Strict", "a")]);
    assert_eq!(refused.status, 503, "{}", gw.log_text());
    // 1 s, with the usual per-client jitter (up to half as long again, rounded up).
    assert!(
        matches!(refused.header("Retry-After"), Some("1" | "2")),
        "{:?}",
        refused.header("Retry-After")
    );
    assert!(
        refused.body.contains("rate-limit store is not answering"),
        "{}",
        refused.body
    );
    let loose = gw.get("/", &[("X-Loose", "b")]);
    assert_eq!(loose.status, 200);
    assert_eq!(loose.header("RateLimit-Remaining"), None, "open: untracked");
    let remaining: Vec<Option<String>> = (0..5)
        .map(|_| {
            gw.get("/", &[("X-Api-Key", "new")])
                .header("RateLimit-Remaining")
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        remaining,
        [Some("3"), Some("2"), Some("1"), Some("0"), Some("0")].map(|r| r.map(String::from))
    );
    assert_eq!(
        upstream.hits(),
        hits + 5,
        "the 503 and the 429 were not forwarded"
    );
    assert_eq!(local_decisions(&gw, "strict", "closed"), 1.0);
    assert_eq!(local_decisions(&gw, "loose", "open"), 1.0);
    assert_eq!(local_decisions(&gw, "per-key", "allowed"), 4.0);
    assert_eq!(local_decisions(&gw, "per-key", "rejected"), 1.0);
    assert_eq!(gw.metric("tollgate_store_local_mode"), 1.0);
    resume(&redis);
}

/// Spend made locally is kept in the state dir's journal: a gateway killed during the outage
/// charges it when it is back and the store answers, once.
#[test]
fn local_spend_survives_a_restart_and_is_charged_once() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    let policy = r#"{"rules": [{"name": "per-key", "limit_keys": ["header:x-api-key"],
        "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 20}}]}"#;
    let store = format!("--store={}", redis.url());
    let flags = [
        store.as_str(),
        "--store-timeout-ms",
        "50",
        "--state-dir",
        state_dir.as_str(),
        "--gateway-id",
        "edge-1",
    ];
    let mut gw = Gateway::start(Some(policy), Some(upstream.addr), &flags);
    gw.wait_until(Duration::from_secs(20), || {
        readyz(&gw)["fleet_gateways"] == 1
    });
    hang(&redis);
    for _ in 0..5 {
        assert_eq!(status(&gw, "journaled"), 200);
    }
    let journal = state.path().join("writeback.json");
    gw.wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&journal).is_ok_and(|j| j.contains("\"delta\":5000000"))
    });
    gw.signal(libc::SIGKILL);
    gw.wait_exit(Duration::from_secs(10));
    resume(&redis);

    let gw = Gateway::start(Some(policy), Some(upstream.addr), &flags);
    gw.wait_until(Duration::from_secs(20), || {
        gw.metric("tollgate_store_writebacks_total{outcome=\"applied\"}") == 1.0
    });
    let r = gw.get("/", &[("X-Api-Key", "journaled")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("RateLimit-Remaining"), Some("14"), "20 - 5 - 1");
    assert!(
        gw.log_text().contains("write-back journal"),
        "{}",
        gw.log_text()
    );
    gw.wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&journal)
            .is_ok_and(|j| j.contains("\"open\":[]") && j.contains("\"sending\":null"))
    });
}

/// A Redis that restarts empty learns what the gateways spent while it was away: a budget and
/// a token bucket spent locally are charged to the new, empty server (the budget's window row
/// made again), so neither starts full.
#[test]
fn a_redis_restarted_empty_learns_the_spend_made_while_it_was_away() {
    let mut redis = RedisServer::start();
    let port = redis.port;
    let upstream = Upstream::start();
    let policy = r#"{"rules": [
        {"name": "daily", "limit_keys": ["header:x-api-key"], "algorithm": "cost_based",
         "algorithm_config": {"budget": 20, "period": "1d",
           "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
        {"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket",
         "algorithm_config": {"rps": 0.001, "burst": 30}}]}"#;
    let store = format!("--store={}", redis.url());
    let gw = Gateway::start(
        Some(policy),
        Some(upstream.addr),
        &[store.as_str(), "--store-timeout-ms", "50"],
    );
    gw.wait_until(Duration::from_secs(20), || {
        readyz(&gw)["fleet_gateways"] == 1 && readyz(&gw)["store_status"] == "ok"
    });
    redis.kill();
    for _ in 0..5 {
        assert_eq!(status(&gw, "tenant"), 200);
    }
    assert_eq!(readyz(&gw)["store_mode"], "local");
    let _empty = RedisServer::start_on(port);
    gw.wait_until(Duration::from_secs(20), || {
        readyz(&gw)["store_mode"] == "shared"
    });
    assert_eq!(
        gw.metric("tollgate_store_writebacks_total{outcome=\"applied\"}"),
        2.0,
        "one charge per bucket"
    );
    // The store decides: 20 - 5 - 1 left of the budget (the lowest of the two rules).
    let r = gw.get("/", &[("X-Api-Key", "tenant")]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("RateLimit-Remaining"),
        Some("14"),
        "{}",
        gw.log_text()
    );
}
