//! Gateways following a policy store (`tollgate run --policy-store`) against real
//! `redis-server` and PostgreSQL, with bundles published by the real `tollgate publish`,
//! `promote` and `rollback`: propagation to a fleet, a candidate decided in shadow on every
//! gateway, and every kind of bad input (a bundle enforcing nothing included) leaving the last
//! good bundle in force.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use support::servers::{PgServer, RedisServer};
use support::{json_of, Gateway, Upstream};

const LIVE: &str = r#"{"bundle_version": 1, "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "mode": "enforce", "rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"tokens_per_second": 0.001, "burst": 10}}]}}]}"#;

fn with_burst(burst: u32) -> String {
    LIVE.replace("\"burst\": 10", &format!("\"burst\": {burst}"))
}

fn tollgate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .expect("run tollgate")
}

/// `tollgate publish` of `policy` (text); returns the version it printed.
fn publish(dir: &Path, store: &str, policy: &str, extra: &[&str]) -> u64 {
    let file = dir.join(format!("bundle-{}.json", policy.len()));
    std::fs::write(&file, policy).expect("write bundle");
    let mut args = vec![
        "publish",
        file.to_str().expect("utf-8 path"),
        "--store",
        store,
    ];
    args.extend_from_slice(extra);
    version_of(&tollgate(&args))
}

fn version_of(out: &std::process::Output) -> u64 {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a version on stdout")
}

fn follower(store: &str, id: &str, upstream: &Upstream, extra: &[&str]) -> Gateway {
    let mut flags = vec![
        "--policy-store",
        store,
        "--store",
        store,
        "--gateway-id",
        id,
        "--store-timeout-ms",
        "200",
        "--log-format",
        "json",
    ];
    flags.extend_from_slice(extra);
    Gateway::start(None, Some(upstream.addr), &flags)
}

fn readyz(gw: &Gateway) -> serde_json::Value {
    json_of(&gw.admin("GET", "/readyz", &[]))
}

fn wait_version(gw: &Gateway, version: u64) {
    gw.wait_until(Duration::from_secs(5), || {
        readyz(gw)["bundle_version"].as_u64() == Some(version)
    });
}

/// Unix milliseconds of the `policy loaded` line for `version` in a JSON log.
fn loaded_at_ms(gw: &Gateway, version: u64) -> Option<u64> {
    gw.log_text().lines().find_map(|line| {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        (v["message"] == "policy loaded" && v["version"].as_u64() == Some(version)).then_some(())?;
        let ts = v["timestamp"].as_str()?;
        let t = humantime::parse_rfc3339(ts).ok()?;
        Some(t.duration_since(UNIX_EPOCH).ok()?.as_millis() as u64)
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Ten gateways follow one store; each publication is served by all of them. Prints the
/// publish-to-serve times (from the instant `publish` chose the version to each gateway's
/// `policy loaded` line).
fn ten_gateways_serve_each_publication(store: &str, label: &str) {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let first = publish(dir.path(), store, LIVE, &[]);
    let fleet: Vec<Gateway> = (0..10)
        .map(|i| follower(store, &format!("edge-{i}"), &upstream, &[]))
        .collect();
    for gw in &fleet {
        wait_version(gw, first);
    }
    let mut delays = Vec::new();
    for round in 0..10u32 {
        let started = now_ms();
        let published = publish(dir.path(), store, &with_burst(11 + round), &[]);
        // A version taken from the clock is the instant `publish` chose it, just before its
        // write: the start of publish-to-serve.
        let origin = if published >= started && published <= now_ms() {
            published
        } else {
            started
        };
        for gw in &fleet {
            // The line is written just after the bundle is in force.
            gw.wait_until(Duration::from_secs(5), || {
                loaded_at_ms(gw, published).is_some()
            });
            let at = loaded_at_ms(gw, published).expect("a policy loaded line");
            delays.push(at.saturating_sub(origin));
        }
    }
    delays.sort_unstable();
    println!(
        "{label}: publish-to-serve over {} (gateway, publication) pairs: p50 {} ms, p99 {} ms, max {} ms",
        delays.len(),
        percentile(&delays, 0.5),
        percentile(&delays, 0.99),
        delays[delays.len() - 1]
    );
    // Every gateway lists itself in the store.
    let fleet_json = tollgate(&["fleet", "--store", store, "--json"]);
    let listed: serde_json::Value =
        serde_json::from_slice(&fleet_json.stdout).expect("fleet --json");
    let ids: std::collections::BTreeSet<String> = listed["gateways"]
        .as_array()
        .expect("gateways")
        .iter()
        .filter_map(|g| g["id"].as_str().map(str::to_string))
        .collect();
    assert_eq!(ids.len(), 10, "{listed}");
}

#[test]
fn ten_gateways_on_redis_serve_each_publication() {
    let redis = RedisServer::start();
    ten_gateways_serve_each_publication(&redis.url(), "Redis");
}

#[test]
fn ten_gateways_on_postgres_serve_each_publication() {
    let pg = PgServer::start();
    ten_gateways_serve_each_publication(&pg.url(), "PostgreSQL");
}

/// Publish → candidate in shadow on both gateways (answers unchanged, would-be refusals
/// counted) → promote (the candidate's limit enforced everywhere) → rollback.
#[test]
fn a_candidate_runs_in_shadow_across_the_fleet_then_promote_and_rollback() {
    let redis = RedisServer::start();
    let store = redis.url();
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let live = publish(dir.path(), &store, LIVE, &[]);
    let fleet = [
        follower(&store, "edge-a", &upstream, &[]),
        follower(&store, "edge-b", &upstream, &[]),
    ];
    let candidate = publish(dir.path(), &store, &with_burst(4), &["--candidate"]);
    assert!(candidate > live);
    for gw in &fleet {
        gw.wait_until(Duration::from_secs(5), || {
            readyz(gw)["policy_source"]["candidate"]["version"].as_u64() == Some(candidate)
        });
        assert_eq!(readyz(gw)["bundle_version"], live);
    }
    // Five requests from one client on each gateway: the live burst of 10 admits all ten;
    // the candidate's burst of 4 (its own buckets, shared by the fleet) would refuse six.
    let mut statuses = Vec::new();
    for gw in &fleet {
        for _ in 0..5 {
            statuses.push(gw.get("/", &[]).status);
        }
    }
    assert_eq!(statuses, vec![200; 10]);
    let would_refuse = || -> f64 {
        fleet
            .iter()
            .map(|gw| {
                gw.metric("tollgate_candidate_would_refuse_total{policy=\"api\",rule=\"per-ip\"}")
            })
            .sum()
    };
    fleet[0].wait_until(Duration::from_secs(5), || would_refuse() >= 6.0);
    assert_eq!(would_refuse(), 6.0);
    let info = format!(
        "tollgate_candidate_info{{hash=\"{}\",version=\"{candidate}\"}}",
        sha256_hex(with_burst(4).as_bytes())
    );
    assert_eq!(fleet[1].metric(&info), 1.0);
    // Promote: the candidate is live everywhere, with a new version; from now on its rule
    // spends the live rule's bucket, which the ten requests emptied.
    let promoted = version_of(&tollgate(&["promote", "--store", &store]));
    assert!(promoted > candidate);
    for gw in &fleet {
        // One read of the store puts the live bundle in force, then withdraws the candidate.
        gw.wait_until(Duration::from_secs(5), || {
            let ready = readyz(gw);
            ready["bundle_version"].as_u64() == Some(promoted)
                && ready["policy_source"]["candidate"].is_null()
        });
        assert_eq!(
            readyz(gw)["bundle_hash"],
            sha256_hex(with_burst(4).as_bytes())
        );
        assert_eq!(
            readyz(gw)["policy_source"]["candidate"],
            serde_json::Value::Null
        );
    }
    assert_eq!(fleet[0].get("/", &[]).status, 429);
    // Rollback: the previous live bundle again, as a new version.
    let rolled = version_of(&tollgate(&["rollback", "--store", &store]));
    assert!(rolled > promoted);
    for gw in &fleet {
        wait_version(gw, rolled);
        assert_eq!(readyz(gw)["bundle_hash"], sha256_hex(LIVE.as_bytes()));
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    tollgate::policy::sha256_hex(bytes)
}

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .status()
        .expect("openssl");
    assert!(status.success(), "openssl {args:?}");
}

/// Every way a bad bundle can reach the store leaves the last good one in force, with an ERROR
/// line naming the reason and a count; the gateway keeps answering.
#[test]
fn bad_bundles_in_the_store_are_refused_and_the_last_good_one_kept() {
    let redis = RedisServer::start();
    let store = redis.url();
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("tempdir");
    openssl(
        dir.path(),
        &["genpkey", "-algorithm", "ed25519", "-out", "sign.pem"],
    );
    openssl(
        dir.path(),
        &["pkey", "-in", "sign.pem", "-pubout", "-out", "verify.pem"],
    );
    openssl(
        dir.path(),
        &["genpkey", "-algorithm", "ed25519", "-out", "other.pem"],
    );
    let sign = dir.path().join("sign.pem");
    let other = dir.path().join("other.pem");
    let verify = dir.path().join("verify.pem");
    let good = publish(
        dir.path(),
        &store,
        LIVE,
        &["--sign-key", sign.to_str().expect("path")],
    );
    let kept_envelope = redis.cli(&["GET", "{tollgate-bundle}:live"]);
    let gw = follower(
        &store,
        "edge-a",
        &upstream,
        &[
            "--policy-verify-key",
            verify.to_str().expect("path"),
            "--policy-store-max-bytes",
            "4096",
        ],
    );
    wait_version(&gw, good);
    let refused = |reason: &str| {
        gw.metric(&format!(
            "tollgate_policy_source_rejected_total{{reason=\"{reason}\",slot=\"live\"}}"
        ))
    };
    let expect_refusal = |reason: &str| {
        // Counted first, then logged, then shown in `/readyz`: wait for the count and
        // `/readyz`, then for the line.
        gw.wait_until(Duration::from_secs(5), || {
            refused(reason) == 1.0
                && readyz(&gw)["policy_source"]["last_refusal"]["reason"] == reason
        });
        gw.wait_for_log(&format!("\"reason\":\"{reason}\""));
        let ready = readyz(&gw);
        assert_eq!(ready["bundle_version"], good, "{ready}");
        assert_eq!(ready["policy_source"]["last_refusal"]["reason"], reason);
        assert!(
            gw.log_text().contains(&format!("\"reason\":\"{reason}\"")),
            "{}",
            gw.log_text()
        );
        assert_eq!(gw.get("/", &[]).status, 200);
    };
    // Unsigned (the publisher has to insist: the live bundle is signed).
    publish(dir.path(), &store, &with_burst(20), &["--allow-unsigned"]);
    expect_refusal("unsigned");
    // Signed by another key.
    publish(
        dir.path(),
        &store,
        &with_burst(21),
        &["--sign-key", other.to_str().expect("path")],
    );
    expect_refusal("bad_signature");
    // Invalid, slipped in by other means (correctly framed and signed is impossible without
    // the key: this one is just not an envelope).
    redis.cli(&["SET", "{tollgate-bundle}:live", "{\"rules\":[]}"]);
    redis.cli(&["PUBLISH", "tollgate-bundle", "0"]);
    expect_refusal("malformed");
    // Too large.
    let big = format!("{}{}", with_burst(22), " ".repeat(5000));
    publish(
        dir.path(),
        &store,
        &big,
        &["--sign-key", sign.to_str().expect("path")],
    );
    expect_refusal("too_large");
    // Valid and signed, but putting nothing in force: it would switch every limit off.
    publish(
        dir.path(),
        &store,
        r#"{"bundle_version": 2, "policies": []}"#,
        &["--sign-key", sign.to_str().expect("path")],
    );
    expect_refusal("invalid_bundle");
    assert!(
        gw.log_text()
            .contains("no policy and no kill switch to enforce (the bundle lists none)"),
        "{}",
        gw.log_text()
    );
    // An older version replayed: the first envelope, put back.
    let newer = publish(
        dir.path(),
        &store,
        &with_burst(23),
        &["--sign-key", sign.to_str().expect("path")],
    );
    wait_version(&gw, newer);
    redis.cli(&["SET", "{tollgate-bundle}:live", &kept_envelope]);
    redis.cli(&["PUBLISH", "tollgate-bundle", "0"]);
    gw.wait_until(Duration::from_secs(5), || refused("older_version") == 1.0);
    assert_eq!(readyz(&gw)["bundle_version"], newer);
    // A wiped store unloads nothing.
    redis.cli(&["FLUSHALL"]);
    gw.wait_for_log(&format!(
        "the policy store has no live bundle: keeping bundle_version {newer}"
    ));
    assert_eq!(readyz(&gw)["bundle_version"], newer);
    assert_eq!(gw.get("/", &[]).status, 200);
}

/// A store that stops answering (SIGSTOP) leaves the bundle in force and says so; a gateway
/// restarted while the store is down starts from the bundle kept in its state dir.
#[test]
fn a_store_that_hangs_or_dies_keeps_the_bundle_and_a_restart_uses_the_kept_one() {
    let mut redis = RedisServer::start();
    let store = redis.url();
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let version = publish(dir.path(), &store, LIVE, &[]);
    let state_flag = state.to_str().expect("path").to_string();
    let gw = follower(&store, "edge-a", &upstream, &["--state-dir", &state_flag]);
    wait_version(&gw, version);
    let pid = redis.child.as_ref().expect("running").id() as i32;
    // SAFETY: kill(2) on the redis-server this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    // Unreachable once a read outlives its 2 s deadline.
    gw.wait_until(Duration::from_secs(10), || {
        readyz(&gw)["policy_source"]["state"] == "unreachable"
    });
    assert_eq!(readyz(&gw)["bundle_version"], version);
    assert_eq!(gw.metric("tollgate_policy_source_up"), 0.0);
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    gw.wait_until(Duration::from_secs(5), || {
        readyz(&gw)["policy_source"]["state"] == "following"
    });
    drop(gw);
    redis.kill();
    let restarted = follower(&store, "edge-a", &upstream, &["--state-dir", &state_flag]);
    let ready = readyz(&restarted);
    assert_eq!(ready["status"], "ready");
    assert_eq!(ready["bundle_version"], version);
    assert_eq!(ready["bundle_source"], "state_dir");
    assert_eq!(ready["policy_source"]["state"], "unreachable");
    assert_eq!(restarted.get("/", &[]).status, 200);
}

/// An http(s):// source: polled with `If-None-Match`, a new body served, and a connection
/// that drops mid-body leaves the bundle in force.
#[test]
fn an_http_source_is_polled_with_etags_and_a_dropped_read_keeps_the_bundle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let envelope = |policy: &str, out: &str| {
        let file = dir.path().join(format!("{out}.json"));
        std::fs::write(&file, policy).expect("write");
        let envelope = dir.path().join(format!("{out}.envelope"));
        let result = tollgate(&[
            "publish",
            file.to_str().expect("path"),
            "--out",
            envelope.to_str().expect("path"),
        ]);
        (
            version_of(&result),
            std::fs::read(&envelope).expect("envelope"),
        )
    };
    let (first, first_body) = envelope(LIVE, "one");
    let served = Arc::new(Mutex::new((first_body, "\"v1\"".to_string())));
    let drop_next = Arc::new(AtomicBool::new(false));
    let conditional = Arc::new(Mutex::new(Vec::new()));
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    {
        let served = Arc::clone(&served);
        let drop_next = Arc::clone(&drop_next);
        let conditional = Arc::clone(&conditional);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut reader = BufReader::new(stream);
                let mut if_none_match = None;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line
                        .to_ascii_lowercase()
                        .strip_prefix("if-none-match:")
                        .map(|v| v.trim().to_string())
                    {
                        if_none_match = Some(v);
                    }
                }
                let (body, etag) = served.lock().expect("lock").clone();
                conditional
                    .lock()
                    .expect("lock")
                    .push(if_none_match.clone());
                let mut stream = reader.into_inner();
                if drop_next.swap(false, Ordering::SeqCst) {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nETag: \"v9\"\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&body[..body.len() / 2]);
                    continue;
                }
                if if_none_match.as_deref() == Some(etag.as_str()) {
                    let _ =
                        stream.write_all(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n");
                    continue;
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nETag: {etag}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body);
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest);
            }
        });
    }
    let upstream = Upstream::start();
    let url = format!("http://{addr}/bundle");
    let gw = Gateway::start(
        None,
        Some(upstream.addr),
        &["--policy-store", &url, "--policy-poll-secs", "1"],
    );
    wait_version(&gw, first);
    gw.wait_until(Duration::from_secs(5), || {
        conditional
            .lock()
            .expect("lock")
            .iter()
            .any(|v| v.as_deref() == Some("\"v1\""))
    });
    drop_next.store(true, Ordering::SeqCst);
    gw.wait_until(Duration::from_secs(5), || {
        readyz(&gw)["policy_source"]["state"] == "unreachable"
    });
    assert_eq!(readyz(&gw)["bundle_version"], first);
    let (second, second_body) = envelope(&with_burst(30), "two");
    *served.lock().expect("lock") = (second_body, "\"v2\"".to_string());
    wait_version(&gw, second);
    assert_eq!(readyz(&gw)["bundle_source"], "http");
    assert_eq!(readyz(&gw)["policy_source"]["state"], "following");
}

/// PostgreSQL: a publication reaches a gateway by `LISTEN/NOTIFY`, and a candidate's
/// would-be refusals reach `tollgate fleet` through the heartbeat.
#[test]
fn postgres_carries_publications_candidates_and_heartbeats() {
    let pg = PgServer::start();
    let store = pg.url();
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let live = publish(dir.path(), &store, LIVE, &[]);
    let gw = follower(&store, "edge-pg", &upstream, &[]);
    wait_version(&gw, live);
    let candidate = publish(dir.path(), &store, &with_burst(2), &["--candidate"]);
    gw.wait_until(Duration::from_secs(5), || {
        readyz(&gw)["policy_source"]["candidate"]["version"].as_u64() == Some(candidate)
    });
    for _ in 0..5 {
        assert_eq!(gw.get("/", &[]).status, 200);
    }
    let started = Instant::now();
    let listed = loop {
        let out = tollgate(&["fleet", "--store", &store, "--json"]);
        let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let refusals = listed["gateways"][0]["candidate_refusals"]["api/per-ip"].as_u64();
        if refusals == Some(3) || started.elapsed() > Duration::from_secs(12) {
            break listed;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let beat = &listed["gateways"][0];
    assert_eq!(beat["id"], "edge-pg", "{listed}");
    assert_eq!(beat["live_version"], live);
    assert_eq!(beat["candidate_version"], candidate);
    assert_eq!(beat["candidate_refusals"]["api/per-ip"], 3);
    assert_eq!(beat["source_state"], "following");
}
