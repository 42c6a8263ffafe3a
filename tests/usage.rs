//! `GET /v1/usage` against the real binary: a mixed workload (several keys, weighted costs,
//! some refused) whose admitted costs the test sums from the responses, and the export's rows
//! summing to exactly that, on the embedded store and on two gateways sharing Redis.

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use support::servers::RedisServer;
use support::{operator, start_fleet_with, Gateway, Upstream, ADMIN_TOKEN, API_KEY};

/// A monthly cost budget per tenant (costs from `X-Cost`), one per API key (masked in the
/// export), and a token bucket (no spend to export).
const POLICY: &str = r#"{"bundle_version": 1, "policies": [{"id": "tenants", "spec": {"rules": [
  {"name": "monthly", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
   "algorithm_config": {"budget": 40, "period": "1M", "cost_key": "header:x-cost", "default_cost": 1,
     "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
  {"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "cost_based",
   "algorithm_config": {"budget": 1000, "period": "1d", "cost_key": "fixed", "fixed_cost": 1,
     "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
  {"name": "rate", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
   "algorithm_config": {"rps": 100000, "burst": 100000}}]}}]}"#;

/// The workload: tenant and cost of each request.
fn workload() -> Vec<(String, u64)> {
    (0..90u64)
        .map(|i| (format!("tenant-{}", i % 4), 1 + (i * 7) % 5))
        .collect()
}

/// Sends one request; the cost admitted (0 when refused).
fn send(gw: &Gateway, tenant: &str, cost: u64) -> u64 {
    let cost_text = cost.to_string();
    let response = gw.get(
        "/",
        &[
            ("X-Tenant", tenant),
            ("X-Cost", &cost_text),
            ("X-Api-Key", API_KEY),
        ],
    );
    match response.status {
        200 => cost,
        429 => 0,
        other => panic!("unexpected status {other}: {}", response.body),
    }
}

/// The export's rows as key → (spent, limit), and their window.
fn rows(gw: &Gateway, query: &str) -> (BTreeMap<String, (f64, f64)>, Option<String>) {
    let response = operator(gw, "GET", &format!("/v1/usage?{query}"));
    assert_eq!(response.status, 200, "{}", response.body);
    assert_eq!(response.header("content-type"), Some("application/json"));
    let list: Vec<serde_json::Value> = serde_json::from_str(&response.body).unwrap();
    let mut window = None;
    let mut out = BTreeMap::new();
    for row in list {
        window = Some(row["window"].as_str().unwrap().to_string());
        out.insert(
            row["key"].as_str().unwrap().to_string(),
            (
                row["spent"].as_f64().unwrap(),
                row["limit"].as_f64().unwrap(),
            ),
        );
    }
    (out, window)
}

/// The first instant of this UTC month, as the export writes it.
fn this_month() -> String {
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    format!("{}-01T00:00:00Z", &now[..7])
}

fn admitted_by_tenant(admitted: &[(String, u64)]) -> BTreeMap<String, u64> {
    let mut by = BTreeMap::new();
    for (tenant, cost) in admitted {
        *by.entry(tenant.clone()).or_insert(0) += cost;
    }
    by
}

fn assert_reconciled(gw: &Gateway, admitted: &[(String, u64)]) {
    let expected = admitted_by_tenant(admitted);
    let (rows, window) = rows(gw, "policy=tenants&rule=monthly");
    assert_eq!(window.as_deref(), Some(this_month().as_str()));
    let exported: BTreeMap<String, u64> = rows
        .iter()
        .map(|(k, (spent, limit))| {
            assert_eq!(*limit, 40.0);
            (k.clone(), *spent as u64)
        })
        .collect();
    assert_eq!(exported, expected);
    let total: f64 = rows.values().map(|(s, _)| s).sum();
    assert_eq!(total, admitted.iter().map(|(_, c)| *c).sum::<u64>() as f64);
}

#[test]
fn usage_reconciles_exactly_on_the_embedded_store() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        Some(POLICY),
        Some(upstream.addr),
        &["--admin-token", ADMIN_TOKEN],
    );
    let mut admitted = Vec::new();
    let mut refused = 0;
    for (tenant, cost) in workload() {
        match send(&gw, &tenant, cost) {
            0 => refused += 1,
            spent => admitted.push((tenant, spent)),
        }
    }
    assert!(refused > 0, "the workload must hit the budget");
    assert_reconciled(&gw, &admitted);

    // CSV: the same rows, a header line first.
    let csv = operator(
        &gw,
        "GET",
        "/v1/usage?policy=tenants&rule=monthly&format=csv",
    );
    assert_eq!(csv.status, 200);
    assert_eq!(csv.header("content-type"), Some("text/csv; charset=utf-8"));
    let lines: Vec<&str> = csv.body.lines().collect();
    assert_eq!(lines[0], "key,window,spent,limit");
    let month = this_month();
    let by = admitted_by_tenant(&admitted);
    let expected: Vec<String> = by
        .iter()
        .map(|(tenant, spent)| format!("{tenant},{month},{spent}.0,40.0"))
        .collect();
    assert_eq!(
        lines[1..],
        expected.iter().map(String::as_str).collect::<Vec<_>>()[..]
    );

    // The API key's rule: one row, its key masked as the status page masks it.
    let (keys, _) = rows(&gw, "policy=tenants&rule=per-key&window=current");
    assert_eq!(keys.len(), 1);
    let (key, (spent, limit)) = keys.iter().next().unwrap();
    assert!(!key.contains(API_KEY), "{key}");
    assert!(key.starts_with("sk-l…#"), "{key}");
    // Refused requests spent nothing on it either (all or nothing).
    assert_eq!((*spent, *limit), (admitted.len() as f64, 1000.0));

    // The previous month: nothing spent in it.
    let (previous, _) = rows(&gw, "policy=tenants&rule=monthly&window=previous");
    assert!(previous.is_empty());

    // What is refused, and how.
    let status = |q: &str| operator(&gw, "GET", &format!("/v1/usage?{q}")).status;
    assert_eq!(status("policy=tenants"), 400);
    assert_eq!(status("policy=tenants&rule=monthly&window=last"), 400);
    assert_eq!(status("policy=tenants&rule=monthly&format=xml"), 400);
    assert_eq!(status("policy=tenants&rule=rate"), 400);
    assert_eq!(status("policy=tenants&rule=nope"), 404);
    assert_eq!(
        gw.admin("GET", "/v1/usage?policy=tenants&rule=monthly", &[])
            .status,
        401
    );
    // `POST /v1/usage` is still the decision service's usage report, not the export.
    let report = gw.admin("POST", "/v1/usage", &[]);
    assert_ne!(report.status, 401);
    assert!(!report.body.starts_with('['), "{}", report.body);
}

#[test]
fn usage_reconciles_exactly_across_two_gateways_on_redis() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let fleet = start_fleet_with(
        POLICY,
        upstream.addr,
        &redis.url(),
        "500",
        Duration::from_secs(10),
        &["--admin-token", ADMIN_TOKEN],
    );
    // Both gateways at once, each with its share of the workload.
    let work = workload();
    let admitted: Vec<(String, u64)> = std::thread::scope(|s| {
        let halves: Vec<_> = fleet
            .iter()
            .enumerate()
            .map(|(g, gw)| {
                let mine: Vec<(String, u64)> = work
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % 2 == g)
                    .map(|(_, w)| w.clone())
                    .collect();
                s.spawn(move || {
                    mine.into_iter()
                        .map(|(tenant, cost)| {
                            let spent = send(gw, &tenant, cost);
                            (tenant, spent)
                        })
                        .filter(|(_, spent)| *spent > 0)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        halves.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let total: u64 = admitted.iter().map(|(_, c)| c).sum();
    assert!(
        total < work.iter().map(|(_, c)| c).sum::<u64>(),
        "some refused"
    );
    // The gateways send their notes every 100 ms: both export the same rows once they have.
    let deadline = Instant::now() + Duration::from_secs(5);
    let expected = admitted_by_tenant(&admitted);
    for gw in &fleet {
        while rows(gw, "policy=tenants&rule=monthly").0.len() < expected.len() {
            assert!(Instant::now() < deadline, "notes not recorded");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_reconciled(gw, &admitted);
    }
}
