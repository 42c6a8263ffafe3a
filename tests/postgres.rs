//! The shared PostgreSQL store against a real server (Debian's `postgresql`, installed by
//! `scripts/install-deps.sh`), started here as the non-root `postgres` user on a free port.

use crate::support;

use std::process::Command;
use std::time::{Duration, Instant};
use support::servers::{pg_bin, PgServer};
use support::{
    assert_all_or_nothing, assert_seed_vectors, count_admitted, shared_store, start_fleet, Upstream,
};
use tollgate::limits::limiter::US_PER_SEC;

/// Seed 004 and all-or-nothing on PostgreSQL: the same answers as the embedded store.
#[tokio::test]
async fn seed_004_and_all_or_nothing_on_postgres() {
    let pg = PgServer::start();
    let store = shared_store(&pg.url()).await;
    assert_seed_vectors(&store, "tb:seed004:pg").await;
    assert_all_or_nothing(&store, "pg").await;
    support::assert_budget_windows(&store, "pg").await;
    support::assert_settlements(&store, "pg").await;
    support::assert_leases(&store, "pg").await;
    let base = 1_800_000_000 * US_PER_SEC;
    // Full-again rows are deleted by the sweep; the others stay.
    let deleted = store.sweep_at(base + 3_600 * US_PER_SEC).await;
    assert!(deleted >= 2, "{deleted}");
}

/// Two gateways on one PostgreSQL enforce one limit together; with PostgreSQL stopped they keep
/// answering within their deadline from their own memory (local mode: the drained limit stays
/// drained), and PostgreSQL decides again once it is back.
#[test]
fn two_gateways_share_one_limit_on_postgres_and_survive_its_death() {
    let mut pg = PgServer::start();
    let upstream = Upstream::start();
    let policy = r#"{"rules": [
        {"name": "fleet", "limit_keys": [], "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 200}},
        {"name": "per-client", "limit_keys": ["header:x-client"], "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 2}}]}"#;
    let gateways = start_fleet(
        policy,
        upstream.addr,
        &pg.url(),
        "1000",
        Duration::from_secs(20),
    );
    let addrs: Vec<_> = gateways.iter().map(|g| g.proxy).collect();
    let total = count_admitted(&addrs, 4, 80, |t, i| format!("t{t}-{i}"));
    // Nothing refills during the test: exactly the burst, no tolerance.
    assert_eq!(total, 200, "320 requests over two gateways, limit 200");
    for gw in &gateways {
        assert_eq!(
            gw.metric("tollgate_store_errors_total"),
            0.0,
            "{}",
            gw.log_text()
        );
    }

    pg.stop();
    let gw = &gateways[0];
    for i in 0..10 {
        let started = Instant::now();
        let r = gw.get("/", &[("X-Client", &format!("down-{i}"))]);
        // Local mode: the fleet's bucket is still known drained (the last state PostgreSQL
        // returned), so it stays refused, from the gateway's own memory.
        assert_eq!(
            r.status, 429,
            "the drained fleet limit holds while PostgreSQL is down"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "bounded latency: {:?}",
            started.elapsed()
        );
    }
    let ready = gw.admin("GET", "/readyz", &[]).body;
    assert!(ready.contains("\"store_status\":\"degraded\""), "{ready}");
    assert!(ready.contains("\"store_mode\":\"local\""), "{ready}");
    pg.run();
    // Back: the fleet bucket is still spent (state lives in the table), so requests are refused.
    gw.wait_until(Duration::from_secs(30), || {
        gw.get("/", &[("X-Client", "after")]).status == 429
            && gw
                .admin("GET", "/readyz", &[])
                .body
                .contains("\"store_mode\":\"shared\"")
    });
    assert!(gw
        .admin("GET", "/readyz", &[])
        .body
        .contains("\"store_status\":\"ok\""));
}

/// Loop detection and circuit breakers shared by a fleet on PostgreSQL.
#[test]
fn loop_marks_and_breakers_are_shared_on_postgres() {
    let pg = PgServer::start();
    support::assert_guards_across_a_fleet(&pg.url());
}

/// Envoy's rate-limit protocol on a fleet sharing PostgreSQL ([`support::assert_grpc_fleet_exact`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_rate_limit_calls_are_exact_and_all_or_nothing_on_postgres() {
    let pg = PgServer::start();
    support::assert_grpc_fleet_exact(&pg.url()).await;
}

/// `POST /v1/usage` on one gateway of a PostgreSQL fleet moves the budget the other one reads.
#[test]
fn llm_usage_is_reconciled_across_a_postgres_fleet() {
    let pg = PgServer::start();
    support::assert_usage_reconciled_across_a_fleet(&pg.url());
}

/// The operator endpoints on a PostgreSQL fleet ([`support::assert_operator_endpoints_across_a_fleet`]).
#[test]
fn operator_endpoints_on_postgres() {
    let pg = PgServer::start();
    support::assert_operator_endpoints_across_a_fleet(&pg.url());
}

/// Batching: requests that arrive while a statement is in flight share the next one, each
/// still all-or-nothing and exact; a request the server refuses (here: a cost whose refill time
/// overflows a bigint) fails alone, and the others of its batch are answered exactly.
#[tokio::test]
async fn a_failing_request_fails_alone_in_its_batch() {
    use tollgate::limits::limiter::{Quota, MICRO, US_PER_SEC};
    use tollgate::store::{Group, OpResults};
    let pg = PgServer::start();
    let store = shared_store(&pg.url()).await;
    let quota = Quota::new(5 * MICRO, MICRO, 3_600 * US_PER_SEC).unwrap();
    let op = support::bucket_op("tb:batched:k", quota, Group::Enforce);
    let mut poison = support::bucket_op(
        "tb:poison:k",
        Quota::new(i64::MAX as u64, 1, 1_000_000_000).unwrap(),
        Group::Enforce,
    );
    poison.cost = i64::MAX as u64;
    let now = 1_800_000_000 * US_PER_SEC;
    // Eleven requests at once on one thread: the first leaves alone, the rest (the poisoned
    // one among them) wait for it and go together.
    let calls = (0..12).map(|i| {
        let store = &store;
        let ops = if i == 3 { [poison] } else { [op] };
        async move {
            let mut results = OpResults::new();
            let answer = store.apply(now, &ops, &mut results).await;
            answer.map(|()| results[0].verdict.allowed)
        }
    });
    let answers = futures::future::join_all(calls).await;
    assert!(answers[3].is_err(), "the poisoned request fails (open)");
    let allowed = answers
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, a)| *a.as_ref().expect("the others are answered"))
        .filter(|allowed| *allowed)
        .count();
    assert_eq!(allowed, 5, "{answers:?}");
}

/// Rows of `table` on `pg`.
fn rows(pg: &PgServer, table: &str) -> u64 {
    sql_number(pg, &format!("SELECT count(*) FROM {table}"))
}

/// The number one SQL query answers on `pg`.
fn sql_number(pg: &PgServer, query: &str) -> u64 {
    let out = Command::new(pg_bin("psql"))
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port.to_string(),
            "-U",
            "tollgate",
        ])
        .args(["-d", "postgres", "-tAc", query])
        .output()
        .expect("psql");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("psql: {}", String::from_utf8_lossy(&out.stderr)))
}

/// Issue 42 on PostgreSQL: PostgreSQL never evicts, so a flood of made-up keys never switches
/// limiting off: the table grows by one row per made-up bucket, a new client is limited
/// exactly, a tenant's spent budget stays spent, and the sweep deletes each row once its bucket
/// is full again (a budget's at its window's end).
#[tokio::test]
async fn a_key_flood_on_postgres_grows_the_table_until_the_sweep_deletes_it() {
    use tollgate::limits::limiter::{Quota, Window, MICRO};
    use tollgate::store::{BucketOp, Group, OpResults};
    let pg = PgServer::start();
    let store = shared_store(&pg.url()).await;
    // Per client address: burst 10, one token back every 100 s. Per API key: a budget of 20 in
    // a window ending an hour from `base`.
    let per_ip = Quota::new(10 * MICRO, MICRO, 100 * US_PER_SEC).unwrap();
    let budget = Quota::new(20 * MICRO, 20 * MICRO, 86_400 * US_PER_SEC).unwrap();
    let base = 1_800_000_000 * US_PER_SEC;
    let window = |now: u64| Window {
        id: 1_799_996_400,
        ends_in_us: base + 3_600 * US_PER_SEC - now,
    };
    let ip_op = |ip: &str| support::bucket_op(&format!("tb:per-ip:{ip}"), per_ip, Group::Enforce);
    let budget_op = |key: &str, cost: u64, now: u64| BucketOp {
        cost: cost * MICRO,
        window: Some(window(now)),
        ..support::bucket_op(&format!("cb:monthly:{key}"), budget, Group::Enforce)
    };
    let call = |ops: Vec<BucketOp>, now: u64| {
        let store = &store;
        async move {
            let mut r = OpResults::new();
            store.apply(now, &ops, &mut r).await.expect("store answers");
            r[0].verdict.allowed && r.iter().all(|o| o.committed)
        }
    };
    assert!(call(vec![budget_op("tenant", 14, base)], base).await);

    const FLOOD: usize = 20_000;
    let started = Instant::now();
    for chunk in (0..FLOOD).collect::<Vec<_>>().chunks(500) {
        let now = base + US_PER_SEC;
        let calls = chunk.iter().map(|i| {
            call(
                vec![
                    ip_op(&format!("10.0.{i}")),
                    budget_op(&format!("made-up-{i}"), 1, now),
                ],
                now,
            )
        });
        let allowed = futures::future::join_all(calls).await;
        assert!(allowed.iter().all(|a| *a), "every made-up client is new");
    }
    let elapsed = started.elapsed();
    let after_flood = rows(&pg, "tollgate_buckets");
    let table_bytes = sql_number(&pg, "SELECT pg_total_relation_size('tollgate_buckets')");
    assert_eq!(
        after_flood,
        2 * FLOOD as u64 + 1,
        "a row per made-up bucket"
    );

    let now = base + 2 * US_PER_SEC;
    let mut newcomer = Vec::new();
    for _ in 0..11 {
        newcomer.push(call(vec![ip_op("192.0.2.77")], now).await);
    }
    let mut expected = vec![true; 10];
    expected.push(false);
    assert_eq!(newcomer, expected, "burst 10: exactly 10 admitted");
    assert!(call(vec![budget_op("tenant", 6, now)], now).await);
    assert!(
        !call(vec![budget_op("tenant", 1, now)], now).await,
        "14 + 6 of 20: spent"
    );

    // 200 s on, every made-up address has its token back: the sweep deletes those rows; the
    // budgets, the newcomer's address (10 tokens: 1 000 s) and the tenant stay.
    let refilled = store.sweep_at(base + 200 * US_PER_SEC).await;
    let after_refill = rows(&pg, "tollgate_buckets");
    assert_eq!((refilled, after_refill), (FLOOD as u64, FLOOD as u64 + 2));
    // Once the window has ended, nothing is left.
    let ended = store.sweep_at(base + 3_601 * US_PER_SEC).await;
    assert_eq!(
        (ended, rows(&pg, "tollgate_buckets")),
        (FLOOD as u64 + 2, 0)
    );
    eprintln!(
        "postgres flood: {FLOOD} made-up clients ({} buckets) in {elapsed:?}; rows {after_flood} after the flood ({table_bytes} bytes with the index), {after_refill} after the sweep at +200 s, 0 after the window",
        2 * FLOOD
    );
}
