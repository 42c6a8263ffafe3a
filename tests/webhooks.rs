//! Threshold webhooks against the real binary: a local receiver records every POST; the test
//! checks each signature with the secret, that each (key, threshold, window) arrives exactly
//! once from two gateways sharing Redis with one of them restarted in between, and that a
//! receiver failing its first attempts gets the same delivery again, the failures counted.

use crate::support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::origin::{response, Origin, OriginRequest};
use support::servers::RedisServer;
use support::{Gateway, Upstream, API_KEY};

const SECRET: &str = "webhook-secret-0123456789abcdef";

/// One POST received: its headers (names lowercased) and body.
#[derive(Debug, Clone)]
struct Received {
    headers: BTreeMap<String, String>,
    body: String,
}

/// A receiver on a loopback port (the scripted origin): records every request, answers 500 to
/// its first `fail_first`, 200 after.
struct Receiver {
    origin: Origin,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start(fail_first: usize) -> Receiver {
        let got = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&got);
        let origin = Origin::start(move |request: &OriginRequest| {
            let mut got = record.lock().unwrap();
            got.push(Received {
                headers: request.headers.iter().cloned().collect(),
                body: String::from_utf8(request.body.clone()).unwrap(),
            });
            let status = if got.len() <= fail_first {
                "500 Internal Server Error"
            } else {
                "200 OK"
            };
            response(status, "", b"")
        });
        Receiver { origin, got }
    }

    fn received(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }

    /// Waits until `n` requests arrived (at most `limit`).
    fn wait_for(&self, n: usize, limit: Duration) -> Vec<Received> {
        let start = Instant::now();
        while self.received().len() < n {
            assert!(
                start.elapsed() < limit,
                "{} of {n} webhooks within {limit:?}: {:?}",
                self.received().len(),
                self.received()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.received()
    }
}

/// HMAC-SHA256 of the body under the secret, as the header carries it.
fn expected_signature(body: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET.as_bytes());
    let tag = ring::hmac::sign(&key, body.as_bytes());
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

fn policy(keys: &str, budget: u64, notify_at: &str) -> String {
    format!(
        r#"{{"bundle_version": 1, "policies": [{{"id": "tenants", "spec": {{"rules": [
  {{"name": "monthly", "limit_keys": ["{keys}"], "algorithm": "cost_based",
   "algorithm_config": {{"budget": {budget}, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
     "notify_at": {notify_at},
     "staged_actions": [{{"threshold_percent": 100, "action": "reject"}}]}}}}]}}}}]}}"#
    )
}

/// The webhook flags, with the secret in a file of the test's.
fn flags(dir: &tempfile::TempDir, receiver: &Receiver) -> Vec<String> {
    let secret = dir.path().join("webhook.secret");
    // Its first line is the key (as the admin token file's).
    std::fs::write(&secret, format!("{SECRET}\nnot part of the key\n")).unwrap();
    vec![
        "--webhook-url".into(),
        format!("http://{}/hooks/tollgate", receiver.origin.addr),
        "--webhook-secret-file".into(),
        secret.display().to_string(),
    ]
}

/// Checks a delivery's signature and returns its body as JSON.
fn verified(received: &Received) -> serde_json::Value {
    assert_eq!(
        received.headers.get("x-tollgate-signature"),
        Some(&expected_signature(&received.body)),
        "{received:?}"
    );
    assert_eq!(
        received.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
    serde_json::from_str(&received.body).unwrap()
}

fn this_month() -> String {
    let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    format!("{}-01T00:00:00Z", &now[..7])
}

#[test]
fn webhooks_go_once_per_key_threshold_and_window_across_a_fleet_and_a_restart() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let receiver = Receiver::start(0);
    let dir = tempfile::tempdir().unwrap();
    let mut flags = flags(&dir, &receiver);
    flags.extend(["--store".into(), redis.url()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let policy = policy("header:x-tenant", 10, "[0.5, 0.8, 1.0]");
    let start = || {
        let gw = Gateway::start(Some(&policy), Some(upstream.addr), &flags);
        gw.wait_until(Duration::from_secs(10), || {
            gw.admin("GET", "/readyz", &[])
                .body
                .contains("\"store_status\":\"ok\"")
        });
        gw
    };
    let mut fleet = [start(), start()];
    let tenants = ["t1", "t2"];
    // Both gateways at once: 3 requests each per tenant, 6 spent, 0.5 crossed.
    let send = |fleet: &[Gateway; 2], per_gateway: usize| -> usize {
        std::thread::scope(|s| {
            let handles: Vec<_> = fleet
                .iter()
                .map(|gw| {
                    s.spawn(move || {
                        let mut ok = 0;
                        for _ in 0..per_gateway {
                            for tenant in tenants {
                                if gw.get("/", &[("X-Tenant", tenant)]).status == 200 {
                                    ok += 1;
                                }
                            }
                        }
                        ok
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        })
    };
    assert_eq!(send(&fleet, 3), 12);
    receiver.wait_for(2, Duration::from_secs(10));
    // One gateway restarts (its memory of what it queued gone); the store still knows.
    fleet[1] = start();
    // 4 more each: 10 spent (0.8 and 1.0 crossed), then refusals.
    assert_eq!(send(&fleet, 3), 8);
    receiver.wait_for(6, Duration::from_secs(10));
    // Time for any duplicate to arrive.
    std::thread::sleep(Duration::from_secs(2));
    let got = receiver.received();
    let mut seen = BTreeMap::new();
    for received in &got {
        let body = verified(received);
        assert_eq!(body["policy"], "tenants");
        assert_eq!(body["rule"], "monthly");
        assert_eq!(body["window"], this_month().as_str());
        assert_eq!(body["limit"], 10.0);
        let threshold = body["threshold"].as_f64().unwrap();
        // The spend that crossed it: at least the threshold's share.
        assert!(
            body["spent"].as_f64().unwrap() >= threshold * 10.0,
            "{body}"
        );
        let id = (
            body["key"].as_str().unwrap().to_string(),
            threshold.to_string(),
        );
        assert_eq!(
            received.headers.get("x-tollgate-delivery"),
            body["id"].as_str().map(str::to_string).as_ref()
        );
        *seen.entry(id).or_insert(0) += 1;
    }
    let expected: BTreeMap<(String, String), i32> = tenants
        .iter()
        .flat_map(|t| {
            ["0.5", "0.8", "1"]
                .into_iter()
                .map(move |s| ((t.to_string(), s.to_string()), 1))
        })
        .collect();
    assert_eq!(seen, expected, "{got:?}");
    let delivered: f64 = fleet
        .iter()
        .map(|gw| gw.metric("tollgate_webhook_deliveries_total{outcome=\"delivered\"}"))
        .sum();
    // The restarted gateway's counters began again: at most the 6 in all.
    assert!(delivered <= 6.0);
}

#[test]
fn a_failing_receiver_gets_the_same_signed_delivery_again_and_failures_are_counted() {
    let upstream = Upstream::start();
    let receiver = Receiver::start(2);
    let dir = tempfile::tempdir().unwrap();
    let flags = flags(&dir, &receiver);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // Keyed by the API key: the body carries it masked.
    let gw = Gateway::start(
        Some(&policy("header:x-api-key", 2, "[1.0]")),
        Some(upstream.addr),
        &flags,
    );
    for _ in 0..2 {
        assert_eq!(gw.get("/", &[("X-Api-Key", API_KEY)]).status, 200);
    }
    assert_eq!(gw.get("/", &[("X-Api-Key", API_KEY)]).status, 429);
    // Two failures, waits of 0.5 s then 1 s, then delivered.
    let got = receiver.wait_for(3, Duration::from_secs(10));
    assert!(got.iter().all(|r| r.body == got[0].body), "{got:?}");
    let body = verified(&got[2]);
    assert_eq!(body["threshold"], 1.0);
    assert_eq!(body["spent"], 2.0);
    let key = body["key"].as_str().unwrap();
    assert!(key.starts_with("sk-l…#") && !key.contains(API_KEY), "{key}");
    assert!(!got[0].body.contains(API_KEY));
    gw.wait_until(Duration::from_secs(5), || {
        gw.metric("tollgate_webhook_deliveries_total{outcome=\"delivered\"}") == 1.0
    });
    assert_eq!(
        gw.metric("tollgate_webhook_deliveries_total{outcome=\"failed\"}"),
        2.0
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(receiver.received().len(), 3);
}

#[test]
fn webhook_flags_go_together_and_take_only_http_urls_and_long_keys() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, policy_text()).unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, "too-short\n").unwrap();
    let run = |extra: &[&str]| support::refused_start(&policy, extra);
    assert!(run(&["--webhook-url", "http://127.0.0.1:9/x"])
        .contains("--webhook-url: needs --webhook-secret-file"));
    let short_text = short.display().to_string();
    let out = run(&[
        "--webhook-url",
        "ftp://user:pw@example.com/x",
        "--webhook-secret-file",
        &short_text,
    ]);
    assert!(out.contains("--webhook-url ftp://"), "{out}");
    assert!(!out.contains(":pw@"), "{out}");
    assert!(
        out.contains(&format!(
            "--webhook-secret-file {short_text}: the key must be at least 16 bytes"
        )),
        "{out}"
    );
}

fn policy_text() -> String {
    policy("header:x-tenant", 10, "[0.5]")
}

/// The records every store keeps for usage and webhooks: the largest spend per key, sections
/// apart by rule and window; a mark claimed once; a delivery leased to its claimer, taken over
/// once the lease ran out, gone once settled.
async fn assert_records(store: &tollgate::store::Store) {
    use tollgate::store::records::{Pending, UsageNote};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let note = |window_id, key: &str, spent| UsageNote {
        prefix: "cb:records:".into(),
        window_id,
        keep_until_us: now + 60_000_000,
        key: key.into(),
        spent,
    };
    store
        .note_usage(&[note(7, "b", 5), note(7, "a", 3), note(8, "a", 9)])
        .await
        .unwrap();
    store.note_usage(&[note(7, "b", 4)]).await.unwrap();
    assert_eq!(
        store.usage_rows("cb:records:", 7).await.unwrap(),
        [("a".to_string(), 3), ("b".to_string(), 5)]
    );
    assert_eq!(
        store.usage_rows("cb:records:", 8).await.unwrap(),
        [("a".to_string(), 9)]
    );
    assert!(store.usage_rows("cb:other:", 7).await.unwrap().is_empty());

    let expires = now + 60_000_000;
    // Claimed with a lease already run out: as if its claimer had stopped.
    assert!(store
        .claim("m1", "{\"a\":1}", now - 1, expires)
        .await
        .unwrap());
    assert!(!store
        .claim("m1", "{\"a\":2}", now + 1_000_000, expires)
        .await
        .unwrap());
    assert!(store
        .claim("m2", "{}", now + 60_000_000, expires)
        .await
        .unwrap());
    let due = store.take_due(now + 60_000_000, 10).await.unwrap();
    assert_eq!(
        due,
        [Pending {
            mark: "m1".into(),
            body: "{\"a\":1}".into()
        }]
    );
    // Leased again by the taker: nothing due now.
    assert!(store
        .take_due(now + 60_000_000, 10)
        .await
        .unwrap()
        .is_empty());
    store.settle_delivery("m1").await.unwrap();
    store.settle_delivery("m2").await.unwrap();
    assert!(!store.claim("m1", "{}", now, expires).await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn records_on_every_store() {
    let embedded = tollgate::store::Store::memory(
        tollgate::store::MemoryStoreConfig::default(),
        Arc::new(tollgate::limits::clock::SystemClock::new()),
    );
    assert_records(&embedded).await;
    let redis = RedisServer::start();
    assert_records(&support::shared_store(&redis.url()).await).await;
    let pg = support::servers::PgServer::start();
    assert_records(&support::shared_store(&pg.url()).await).await;
    // On a cluster: a usage section is one key; a claim, the outbox and its bodies share a
    // hash tag, so each script's keys sit on one node.
    let cluster = support::servers::RedisCluster::start();
    assert_records(&support::shared_store(&cluster.url()).await).await;
}
