//! One bundle for a fleet: `tollgate publish`, `promote`, `rollback` and `fleet` (the real
//! binary) against real `redis-server` (one server and a three-node cluster) and PostgreSQL,
//! checked through the policy-source trait the gateways read with; the HTTP(S) source against
//! a small local server honouring `ETag`. Keys are made by the real `openssl`.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::free_port;
use support::servers::{PgServer, RedisCluster, RedisServer};
use tollgate::fleet::envelope::{sha256_hex, Envelope, Slot, VerifyKey, DEFAULT_MAX_BYTES};
use tollgate::fleet::source::{self, Heartbeat, PolicySource, SourceError};

// ---------------------------------------------------------------------------------------------
// Helpers

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The version a successful publish/promote/rollback printed: one number on one line.
    fn version(&self) -> u64 {
        assert_eq!(self.code, 0, "stderr: {}", self.stderr);
        assert!(
            self.stdout.ends_with('\n') && self.stdout.lines().count() == 1,
            "one line on stdout: {:?}",
            self.stdout
        );
        self.stdout.trim().parse().expect("a number on stdout")
    }
}

fn tollgate(args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run tollgate");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn bundle(id: &str, rate: u32) -> String {
    format!(
        r#"{{"bundle_version": 1, "policies": [{{"id": "{id}", "spec": {{"rules": [
            {{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
              "algorithm_config": {{"tokens_per_second": {rate}, "burst": {rate}}}}}]}}}}]}}"#
    )
}

/// An Ed25519 key pair made by `openssl`: (private PEM, public PEM).
fn openssl_pair(dir: &Path, name: &str) -> (String, String) {
    let private = dir.join(format!("{name}.pem"));
    let public = dir.join(format!("{name}.pub.pem"));
    assert!(Command::new("openssl")
        .args(["genpkey", "-algorithm", "ed25519", "-out"])
        .arg(&private)
        .status()
        .expect("openssl")
        .success());
    assert!(Command::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(&private)
        .arg("-out")
        .arg(&public)
        .status()
        .expect("openssl")
        .success());
    (private.display().to_string(), public.display().to_string())
}

fn write_file(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn open(url: &str) -> Arc<dyn PolicySource> {
    source::open(&url.parse().unwrap(), Duration::from_secs(5)).unwrap()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn now_secs() -> i64 {
    (now_ms() / 1000) as i64
}

fn stored(rt: &tokio::runtime::Runtime, store: &dyn PolicySource, slot: Slot) -> Option<Envelope> {
    let slots = rt.block_on(store.read()).unwrap();
    let bytes = match slot {
        Slot::Live => slots.live,
        Slot::Candidate => slots.candidate,
    }?;
    Some(Envelope::parse(&bytes, slot, DEFAULT_MAX_BYTES).expect("a stored envelope parses"))
}

fn beat(id: &str, live: Option<&Envelope>, candidate: Option<&Envelope>, at: i64) -> Heartbeat {
    Heartbeat {
        id: id.to_string(),
        live_version: live.map(|e| e.version),
        live_hash: live.map(|e| e.sha256.clone()),
        candidate_version: candidate.map(|e| e.version),
        candidate_hash: candidate.map(|e| e.sha256.clone()),
        at,
        candidate_refusals: [("api/per-ip".to_string(), 2), ("api/burst".to_string(), 3)]
            .into_iter()
            .collect(),
        source_state: "following".to_string(),
        refusals: Vec::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// The scenario every writable store passes

/// Publish (signed, verified through the trait), an invalid bundle refused with nothing
/// stored, a candidate, promote, two rollbacks and a third with nothing left, a wiped store
/// (versions still grow, from the clock, then from a heartbeat above the clock), and
/// `changed()` woken by a write.
fn assert_publish_promote_rollback(url: &str, wipe: &dyn Fn()) {
    let dir = tempfile::tempdir().unwrap();
    let (sign, verify) = openssl_pair(dir.path(), "fleet");
    let verify = VerifyKey::from_pem_file(Path::new(&verify)).unwrap();
    let (a_text, b_text, c_text) = (bundle("api", 10), bundle("api", 20), bundle("api", 30));
    let a = write_file(dir.path(), "a.json", &a_text);
    let b = write_file(dir.path(), "b.json", &b_text);
    let c = write_file(dir.path(), "c.json", &c_text);
    let rt = runtime();
    let store = open(url);

    // The subscription is made by the first call (which times out: nothing was written).
    assert!(!rt.block_on(store.changed(Duration::from_millis(200))));
    let before = now_ms();
    let va = tollgate(&["publish", &a, "--store", url, "--sign-key", &sign]).version();
    assert!(va >= before, "{va} is derived from the clock ({before})");
    assert!(
        rt.block_on(store.changed(Duration::from_secs(5))),
        "a publish wakes changed() on {url}"
    );
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    assert_eq!(live.version, va);
    assert_eq!(live.policy, a_text);
    assert_eq!(live.sha256, sha256_hex(a_text.as_bytes()));
    assert_eq!(live.verify(Some(&verify)), Ok(()));
    assert_eq!(rt.block_on(store.highest_version()).unwrap(), va);

    // An invalid bundle: exit 1, the JSON path on stderr, nothing stored.
    let slots_before = rt.block_on(store.read()).unwrap();
    let bad = write_file(
        dir.path(),
        "bad.json",
        r#"{"bundle_version": 1, "policies": [{"id": "api", "rules": []}]}"#,
    );
    let refused = tollgate(&["publish", &bad, "--store", url, "--sign-key", &sign]);
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    assert!(refused.stdout.is_empty());
    assert!(
        refused.stderr.contains("policies[0].rules: unknown field"),
        "{}",
        refused.stderr
    );
    assert!(refused.stderr.contains("policies[0].spec: is required"));
    assert_eq!(rt.block_on(store.read()).unwrap(), slots_before);
    assert_eq!(rt.block_on(store.highest_version()).unwrap(), va);

    // A candidate, then promote: a new version, re-signed for the live slot.
    let vb = tollgate(&[
        "publish",
        &b,
        "--store",
        url,
        "--sign-key",
        &sign,
        "--candidate",
    ])
    .version();
    assert!(vb > va);
    let candidate = stored(&rt, store.as_ref(), Slot::Candidate).unwrap();
    assert_eq!(
        (candidate.version, candidate.policy.as_str()),
        (vb, b_text.as_str())
    );
    assert_eq!(candidate.verify(Some(&verify)), Ok(()));
    assert_eq!(stored(&rt, store.as_ref(), Slot::Live).unwrap().version, va);

    // A promote or rollback sealed from a candidate or history head that has changed since
    // it was read writes nothing.
    let stale = Envelope::seal(
        b_text.clone(),
        Slot::Live,
        vb + 1,
        now_secs(),
        Some(now_secs() + 86_400),
        None,
    );
    assert!(matches!(
        rt.block_on(store.promote(&stale, b"an older candidate")),
        Err(SourceError::Conflict(_))
    ));
    assert!(matches!(
        rt.block_on(store.roll_back(&stale, b"an older live bundle")),
        Err(SourceError::Conflict(_))
    ));
    assert_eq!(stored(&rt, store.as_ref(), Slot::Live).unwrap().version, va);
    assert_eq!(
        stored(&rt, store.as_ref(), Slot::Candidate)
            .unwrap()
            .version,
        vb
    );

    let vp = tollgate(&["promote", "--store", url, "--sign-key", &sign]).version();
    assert!(vp > vb);
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    assert_eq!(live.version, vp);
    assert_eq!(live.sha256, sha256_hex(b_text.as_bytes()));
    assert_eq!(live.verify(Some(&verify)), Ok(()));
    assert!(stored(&rt, store.as_ref(), Slot::Candidate).is_none());
    let again = tollgate(&["promote", "--store", url, "--sign-key", &sign]);
    assert_eq!(again.code, 1);
    assert!(
        again.stderr.contains("no candidate to promote"),
        "{}",
        again.stderr
    );
    assert!(again.stdout.is_empty());

    // C live: history is [B as promoted, A].
    let vc = tollgate(&["publish", &c, "--store", url, "--sign-key", &sign]).version();
    assert!(vc > vp);
    let history: Vec<u64> = rt
        .block_on(store.history())
        .unwrap()
        .iter()
        .map(|h| {
            Envelope::parse(h, Slot::Live, DEFAULT_MAX_BYTES)
                .unwrap()
                .version
        })
        .collect();
    assert_eq!(history, vec![vp, va]);

    // Two rollbacks go back two bundles (B, then A), each a new version; a third finds none.
    let vr1 = tollgate(&["rollback", "--store", url, "--sign-key", &sign]).version();
    assert!(vr1 > vc);
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    assert_eq!((live.version, live.policy.as_str()), (vr1, b_text.as_str()));
    assert_eq!(live.verify(Some(&verify)), Ok(()));
    let vr2 = tollgate(&["rollback", "--store", url, "--sign-key", &sign]).version();
    assert!(vr2 > vr1);
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    assert_eq!((live.version, live.policy.as_str()), (vr2, a_text.as_str()));
    assert_eq!(live.sha256, sha256_hex(a_text.as_bytes()));
    assert!(rt.block_on(store.history()).unwrap().is_empty());
    let none = tollgate(&["rollback", "--store", url, "--sign-key", &sign]);
    assert_eq!(none.code, 1);
    assert!(
        none.stderr
            .contains("no previous live bundle to roll back to"),
        "{}",
        none.stderr
    );
    assert_eq!(
        stored(&rt, store.as_ref(), Slot::Live).unwrap().version,
        vr2
    );

    // A publisher that chose its version before another published a newer one writes nothing
    // (the fleet would refuse its bundle as older).
    let late = Envelope::seal(
        bundle("api", 7),
        Slot::Live,
        vr2 - 1,
        now_secs(),
        Some(now_secs() + 86_400),
        None,
    );
    assert!(matches!(
        rt.block_on(store.write(&late)),
        Err(SourceError::Conflict(_))
    ));
    assert_eq!(
        stored(&rt, store.as_ref(), Slot::Live).unwrap().version,
        vr2
    );

    // A wiped store (bundles, version and heartbeats gone): the clock keeps versions growing.
    // The source in use reads the wiped store as empty at once (PostgreSQL: its tables are
    // made again), never as an error.
    wipe();
    assert_eq!(rt.block_on(store.read()).unwrap(), source::Slots::default());
    assert_eq!(rt.block_on(store.highest_version()).unwrap(), 0);
    let vw = tollgate(&["publish", &a, "--store", url, "--sign-key", &sign]).version();
    assert!(vw > vr2, "{vw} after a wipe is above {vr2}");

    // Wiped again, with a gateway reporting a version above the clock (an hour, within the
    // day believed): the next is above it. One reporting a version beyond the day is not
    // believed (a forged heartbeat would push every version out of reach).
    wipe();
    let ahead = now_ms() + 3_600_000;
    let mut report = beat("edge-ahead", None, None, now_secs());
    report.live_version = Some(ahead);
    rt.block_on(store.heartbeat(&report)).unwrap();
    let mut forged = beat("edge-forged", None, None, now_secs());
    forged.live_version = Some(now_ms() + 2 * 86_400_000);
    rt.block_on(store.heartbeat(&forged)).unwrap();
    let vh = tollgate(&["publish", &a, "--store", url, "--sign-key", &sign]).version();
    assert_eq!(vh, ahead + 1);
}

#[test]
fn publish_promote_rollback_on_redis() {
    let redis = RedisServer::start();
    assert_publish_promote_rollback(&redis.url(), &|| {
        assert!(redis.cli(&["FLUSHALL"]).contains("OK"));
    });
}

#[test]
fn publish_promote_rollback_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    assert_publish_promote_rollback(&cluster.url(), &|| {
        for node in &cluster.nodes {
            assert!(node.cli(&["FLUSHALL"]).contains("OK"));
        }
    });
}

#[test]
fn publish_promote_rollback_on_postgres() {
    let pg = PgServer::start();
    assert_publish_promote_rollback(&pg.url(), &|| {
        pg.sql("DROP TABLE tollgate_bundle, tollgate_bundle_history, tollgate_gateways");
    });
}

// ---------------------------------------------------------------------------------------------
// Signing rules

/// Unsigned over signed, another key, an unsigned candidate slipped into the store: refused
/// (exit 2) with the store unchanged; `--allow-unsigned` is the one way to drop signing.
#[test]
fn signing_rules_protect_a_signed_fleet() {
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let (sign, verify) = openssl_pair(dir.path(), "one");
    let (other, _) = openssl_pair(dir.path(), "two");
    let verify = VerifyKey::from_pem_file(Path::new(&verify)).unwrap();
    let a = write_file(dir.path(), "a.json", &bundle("api", 10));
    let b = write_file(dir.path(), "b.json", &bundle("api", 20));
    let rt = runtime();
    let store = open(&url);

    let va = tollgate(&["publish", &a, "--store", &url, "--sign-key", &sign]).version();

    // Unsigned over a signed live bundle.
    let unsigned = tollgate(&["publish", &b, "--store", &url]);
    assert_eq!(unsigned.code, 2);
    assert!(
        unsigned.stderr.contains(&format!(
            "the live bundle (version {va}) is signed and no --sign-key was given"
        )),
        "{}",
        unsigned.stderr
    );
    assert_eq!(stored(&rt, store.as_ref(), Slot::Live).unwrap().version, va);

    // A signed candidate promoted without the key, or with another key: refused.
    let vb = tollgate(&[
        "publish",
        &b,
        "--store",
        &url,
        "--sign-key",
        &sign,
        "--candidate",
    ])
    .version();
    let keyless = tollgate(&["promote", "--store", &url]);
    assert_eq!(keyless.code, 2);
    assert!(keyless.stderr.contains(&format!(
        "the candidate (version {vb}) is signed and no --sign-key was given"
    )));
    let wrong = tollgate(&["promote", "--store", &url, "--sign-key", &other]);
    assert_eq!(wrong.code, 2);
    assert!(
        wrong.stderr.contains(&format!(
            "the candidate (version {vb}) does not verify with --sign-key"
        )),
        "{}",
        wrong.stderr
    );
    assert_eq!(stored(&rt, store.as_ref(), Slot::Live).unwrap().version, va);

    // An unsigned candidate written by other means is never re-signed by promote.
    let slipped = Envelope::seal(
        bundle("api", 1000),
        Slot::Candidate,
        vb + 1,
        now_secs(),
        Some(now_secs() + 86_400),
        None,
    );
    rt.block_on(store.write(&slipped)).unwrap();
    let laundered = tollgate(&["promote", "--store", &url, "--sign-key", &sign]);
    assert_eq!(laundered.code, 2);
    assert!(
        laundered
            .stderr
            .contains("does not verify with --sign-key (bundle is unsigned"),
        "{}",
        laundered.stderr
    );
    assert_eq!(stored(&rt, store.as_ref(), Slot::Live).unwrap().version, va);

    // A key file that is no Ed25519 private key: exit 2, the file named, nothing stored.
    let ec = dir.path().join("ec.pem");
    assert!(Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out"
        ])
        .arg(&ec)
        .status()
        .unwrap()
        .success());
    let ec = ec.display().to_string();
    let bad_key = tollgate(&["publish", &b, "--store", &url, "--sign-key", &ec]);
    assert_eq!(bad_key.code, 2);
    assert!(bad_key.stderr.starts_with(&ec), "{}", bad_key.stderr);
    assert_eq!(stored(&rt, store.as_ref(), Slot::Live).unwrap().version, va);

    // Dropping signing on purpose.
    let vu = tollgate(&["publish", &b, "--store", &url, "--allow-unsigned"]).version();
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    assert_eq!(live.version, vu);
    assert!(live.signature.is_none());
    assert_eq!(live.verify(Some(&verify)).unwrap_err().reason(), "unsigned");
}

// ---------------------------------------------------------------------------------------------
// tollgate fleet

#[test]
fn fleet_shows_one_line_per_gateway_and_json() {
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let a = write_file(dir.path(), "a.json", &bundle("api", 10));
    let b = write_file(dir.path(), "b.json", &bundle("api", 20));
    let rt = runtime();
    let store = open(&url);

    let empty = tollgate(&["fleet", "--store", &url]);
    assert_eq!(empty.code, 0, "{}", empty.stderr);
    assert_eq!(
        empty.stdout,
        format!(
            "store: {url}\nlive: none\ncandidate: none\nGATEWAY  LIVE  HASH  CANDIDATE  SEEN  \
             WOULD-REFUSE  STATE\n(no gateway has sent a heartbeat)\n"
        )
    );

    tollgate(&["publish", &a, "--store", &url]).version();
    tollgate(&["publish", &b, "--store", &url, "--candidate"]).version();
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    let candidate = stored(&rt, store.as_ref(), Slot::Candidate).unwrap();
    let hour_ago = now_secs() - 3600;
    rt.block_on(store.heartbeat(&beat("edge-1", Some(&live), Some(&candidate), hour_ago)))
        .unwrap();
    rt.block_on(store.heartbeat(&beat("edge-2", Some(&live), None, hour_ago)))
        .unwrap();

    let shown = tollgate(&["fleet", "--store", &url]);
    assert_eq!(shown.code, 0, "{}", shown.stderr);
    let (lv, lh) = (live.version, &live.sha256[..12]);
    let (cv, ch) = (candidate.version, &candidate.sha256[..12]);
    let until = |e: &Envelope| {
        humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + Duration::from_secs(e.expires_at.expect("an expiry") as u64),
        )
        .to_string()
    };
    let (lu, cu) = (until(&live), until(&candidate));
    assert_eq!(
        shown.stdout,
        format!(
            "store: {url}\n\
             live: {lv} (hash {lh}, unsigned, valid until {lu})\n\
             candidate: {cv} (hash {ch}, unsigned, valid until {cu})\n\
             GATEWAY  LIVE           HASH          CANDIDATE      SEEN    WOULD-REFUSE  STATE\n\
             edge-1   {lv}  {lh}  {cv}  1h ago  5             following\n\
             edge-2   {lv}  {lh}  -              1h ago  -             following\n"
        )
    );

    let json = tollgate(&["fleet", "--store", &url, "--json"]);
    assert_eq!(json.code, 0, "{}", json.stderr);
    let doc: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(doc["store"], url.as_str());
    assert_eq!(doc["live"]["version"], lv);
    assert_eq!(doc["live"]["hash"], live.sha256.as_str());
    assert_eq!(doc["candidate"]["version"], cv);
    assert_eq!(doc["candidate"]["hash"], candidate.sha256.as_str());
    let gateways = doc["gateways"].as_array().unwrap();
    assert_eq!(gateways.len(), 2);
    assert_eq!(gateways[0]["id"], "edge-1");
    assert_eq!(gateways[0]["candidate_version"], cv);
    assert_eq!(gateways[0]["candidate_refusals"]["api/per-ip"], 2);
    assert_eq!(gateways[0]["at"], hour_ago);
    assert_eq!(gateways[0]["suspect"], serde_json::Value::Null);
    assert_eq!(
        doc["live"]["expires_at"],
        live.expires_at.expect("an expiry")
    );
    assert_eq!(gateways[1]["id"], "edge-2");
    assert_eq!(gateways[1]["candidate_version"], serde_json::Value::Null);
    assert_eq!(doc["present_gateways"], serde_json::json!([]));

    // Gateways sharing their buckets in this store: N, and who (an expired entry not counted).
    let until_us = ((now_secs() + 60) * 1_000_000).to_string();
    redis.cli(&[
        "ZADD",
        "tollgate:{presence}:gateways",
        &until_us,
        "edge-2",
        &until_us,
        "edge-1",
        "1",
        "gone",
    ]);
    let shown = tollgate(&["fleet", "--store", &url]);
    assert!(
        shown.stdout.ends_with(
            "following\nsharing the buckets here: 2 gateway(s) present (N): edge-1, edge-2\n"
        ),
        "{}",
        shown.stdout
    );
    let json = tollgate(&["fleet", "--store", &url, "--json"]);
    let doc: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(
        doc["present_gateways"],
        serde_json::json!(["edge-1", "edge-2"])
    );

    // A store that does not answer: exit 2, nothing on stdout.
    let port = free_port();
    let down = tollgate(&[
        "fleet",
        "--store",
        &format!("redis://127.0.0.1:{port}"),
        "--timeout-ms",
        "500",
    ]);
    assert_eq!(down.code, 2);
    assert!(down.stdout.is_empty());
    assert!(
        down.stderr.contains("policy store unavailable"),
        "{}",
        down.stderr
    );
}

/// `tollgate fleet` tells the truth about a refused bundle: a gateway holding a verify key
/// refuses an unsigned publish and keeps the signed bundle in force; the fleet table shows it
/// `refused (unsigned)` (not `following`), a gateway on an older version for another reason
/// `behind`, and the command exits 1 while any gateway is off the live version; `--json`,
/// the gateway's `/readyz` and its `/status` page say the same. A signed publish the gateway
/// takes puts it back on the live version.
#[test]
fn fleet_shows_a_refused_bundle_and_exits_non_zero() {
    use support::{json_of, operator, Gateway, Upstream, ADMIN_TOKEN};
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let (sign, verify) = openssl_pair(dir.path(), "fleet");
    let signed = write_file(dir.path(), "signed.json", &bundle("api", 10));
    let unsigned = write_file(dir.path(), "unsigned.json", &bundle("api", 20));
    let upstream = Upstream::start();
    let rt = runtime();
    let store = open(&url);

    let v1 = tollgate(&["publish", &signed, "--store", &url, "--sign-key", &sign]).version();
    let gw = Gateway::start(
        None,
        Some(upstream.addr),
        &[
            "--policy-store",
            &url,
            "--gateway-id",
            "edge-a",
            "--policy-verify-key",
            &verify,
            "--admin-token",
            ADMIN_TOKEN,
        ],
    );
    let readyz = || json_of(&gw.admin("GET", "/readyz", &[]));
    gw.wait_until(Duration::from_secs(10), || {
        readyz()["bundle_version"].as_u64() == Some(v1)
    });
    // A gateway that stopped at an older version (its heartbeat written as it would).
    let first = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    let mut old = beat("edge-old", Some(&first), None, now_secs());
    old.live_version = Some(v1 - 1);
    rt.block_on(store.heartbeat(&old)).unwrap();
    // And one not heard from for two minutes (a replaced pod): shown, but not counted in the
    // exit code's "not on the live version".
    let mut gone = beat("edge-gone", Some(&first), None, now_secs() - 120);
    gone.live_version = Some(v1 - 1);
    rt.block_on(store.heartbeat(&gone)).unwrap();

    // Unsigned, on purpose: the gateway holds a verify key and refuses it.
    let v2 = tollgate(&["publish", &unsigned, "--store", &url, "--allow-unsigned"]).version();
    gw.wait_until(Duration::from_secs(10), || {
        readyz()["policy_source"]["last_refusal"]["version"].as_u64() == Some(v2)
    });
    assert_eq!(readyz()["bundle_version"], v1);
    assert_eq!(readyz()["policy_source"]["standing"], "refused (unsigned)");
    // Its heartbeat carries the refusal (written at once, not at the next 5 s beat).
    let mut shown = tollgate(&["fleet", "--store", &url]);
    let start = Instant::now();
    while !shown.stdout.contains("refused (unsigned)") {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}",
            shown.stdout
        );
        std::thread::sleep(Duration::from_millis(100));
        shown = tollgate(&["fleet", "--store", &url]);
    }
    assert_eq!(shown.code, 1, "{}", shown.stderr);
    assert_eq!(
        shown.stderr,
        format!("2 of 2 gateway(s) not on the live version {v2}\n")
    );
    assert!(shown.stdout.contains("\nedge-gone "), "{}", shown.stdout);
    let state = |stdout: &str, id: &str| -> String {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("no line for {id}: {stdout}"));
        let header = stdout.lines().find(|l| l.starts_with("GATEWAY")).unwrap();
        line[header.find("STATE").unwrap()..].to_string()
    };
    assert_eq!(state(&shown.stdout, "edge-a"), "refused (unsigned)");
    assert_eq!(state(&shown.stdout, "edge-old"), "behind");
    assert!(
        shown.stdout.contains(&format!("live: {v2} (hash ")),
        "{}",
        shown.stdout
    );

    let json = tollgate(&["fleet", "--store", &url, "--json"]);
    assert_eq!(json.code, 1, "{}", json.stderr);
    let doc: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(doc["all_on_live"], false);
    let gateway = |id: &str| {
        doc["gateways"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no {id} in {doc}"))
    };
    let edge_a = gateway("edge-a");
    assert_eq!(edge_a["standing"], "refused (unsigned)");
    assert_eq!(edge_a["on_live"], false);
    assert_eq!(edge_a["live_version"], v1);
    assert_eq!(edge_a["refusals"][0]["slot"], "live");
    assert_eq!(edge_a["refusals"][0]["version"], v2);
    assert_eq!(edge_a["refusals"][0]["reason"], "unsigned");
    assert_eq!(gateway("edge-old")["standing"], "behind");

    // The gateway's own status page says the same.
    let page = operator(&gw, "GET", "/status");
    assert_eq!(page.status, 200);
    assert!(
        page.body
            .contains("<td id=\"policy-source-state\" class=\"bad\">refused (unsigned)</td>"),
        "{}",
        page.body
    );

    // Signed again: the gateway takes it; only the stopped one is off the live version.
    let v3 = tollgate(&["publish", &signed, "--store", &url, "--sign-key", &sign]).version();
    gw.wait_until(Duration::from_secs(10), || {
        readyz()["bundle_version"].as_u64() == Some(v3)
    });
    assert_eq!(readyz()["policy_source"]["standing"], "following");
    let mut shown = tollgate(&["fleet", "--store", &url]);
    let start = Instant::now();
    while state(&shown.stdout, "edge-a") != "following" {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}",
            shown.stdout
        );
        std::thread::sleep(Duration::from_millis(100));
        shown = tollgate(&["fleet", "--store", &url]);
    }
    assert_eq!(shown.code, 1);
    assert_eq!(
        shown.stderr,
        format!("1 of 2 gateway(s) not on the live version {v3}\n")
    );
    assert_eq!(state(&shown.stdout, "edge-old"), "behind");
    drop(gw);
}

// ---------------------------------------------------------------------------------------------
// The HTTP(S) source

/// A file server for one path, answering `304` to a matching `If-None-Match`; records each
/// request's `If-None-Match` and the status answered.
struct StaticServer {
    port: u16,
    seen: Arc<Mutex<Vec<Exchange>>>,
}

/// A request's `If-None-Match` and the status answered.
type Exchange = (Option<String>, u16);

impl StaticServer {
    fn start(file: PathBuf, etag: &'static str) -> StaticServer {
        let listener = TcpListener::bind(("127.0.0.1", free_port())).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        std::thread::spawn(move || {
            for stream in listener.incoming().take(16) {
                let Ok(stream) = stream else { continue };
                Self::answer(stream, &file, etag, &record);
            }
        });
        StaticServer { port, seen }
    }

    fn answer(mut stream: TcpStream, file: &Path, etag: &str, record: &Mutex<Vec<Exchange>>) {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut if_none_match = None;
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("if-none-match") {
                    if_none_match = Some(value.trim().to_string());
                }
            }
            line.clear();
        }
        let status = if if_none_match.as_deref() == Some(etag) {
            304
        } else {
            200
        };
        record.lock().unwrap().push((if_none_match, status));
        let response = if status == 304 {
            format!("HTTP/1.1 304 Not Modified\r\nETag: {etag}\r\nConnection: close\r\n\r\n")
                .into_bytes()
        } else {
            let mut body = Vec::new();
            std::fs::File::open(file)
                .unwrap()
                .read_to_end(&mut body)
                .unwrap();
            let mut r = format!(
                "HTTP/1.1 200 OK\r\nETag: {etag}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .into_bytes();
            r.extend(body);
            r
        };
        let _ = stream.write_all(&response);
    }
}

/// `publish --out` writes an envelope a static server serves; the HTTP source reads it, sends
/// the ETag back in `If-None-Match`, gets 304 and returns the same bytes; it is read-only.
#[test]
fn the_http_source_reads_a_published_file_with_etags() {
    let dir = tempfile::tempdir().unwrap();
    let (sign, verify) = openssl_pair(dir.path(), "http");
    let verify = VerifyKey::from_pem_file(Path::new(&verify)).unwrap();
    let a_text = bundle("api", 10);
    let a = write_file(dir.path(), "a.json", &a_text);
    let out = dir.path().join("www").join("bundle.json");
    std::fs::create_dir(dir.path().join("www")).unwrap();
    let out_arg = out.display().to_string();
    let v1 = tollgate(&["publish", &a, "--out", &out_arg, "--sign-key", &sign]).version();
    let v2 = tollgate(&["publish", &a, "--out", &out_arg, "--sign-key", &sign]).version();
    assert!(v2 > v1, "a file's version grows past its own");
    let written = std::fs::read(&out).unwrap();

    let server = StaticServer::start(out.clone(), "\"e-1\"");
    let url = format!("http://127.0.0.1:{}/www/bundle.json", server.port);
    let rt = runtime();
    let store = open(&url);
    assert_eq!(store.kind(), "http");
    let first = rt.block_on(store.read()).unwrap();
    assert_eq!(first.live.as_deref(), Some(written.as_slice()));
    assert_eq!(first.candidate, None);
    let second = rt.block_on(store.read()).unwrap();
    assert_eq!(second, first, "a 304 returns the kept body");
    assert_eq!(
        *server.seen.lock().unwrap(),
        vec![(None, 200), (Some("\"e-1\"".to_string()), 304)]
    );
    let envelope = Envelope::parse(&written, Slot::Live, DEFAULT_MAX_BYTES).unwrap();
    assert_eq!(
        (envelope.version, envelope.policy.as_str()),
        (v2, a_text.as_str())
    );
    assert_eq!(envelope.verify(Some(&verify)), Ok(()));

    assert!(matches!(
        rt.block_on(store.write(&envelope)),
        Err(SourceError::ReadOnly(_))
    ));
    let refused = tollgate(&["publish", &a, "--store", &url]);
    assert_eq!(refused.code, 2);
    assert!(refused.stderr.contains("read-only"), "{}", refused.stderr);

    // A server that is gone: unavailable, bounded by the timeout.
    drop(server);
    let closed = source::open(
        &format!("http://127.0.0.1:{}/x", free_port())
            .parse()
            .unwrap(),
        Duration::from_secs(2),
    )
    .unwrap();
    assert!(matches!(
        rt.block_on(closed.read()),
        Err(SourceError::Unavailable(_))
    ));
}

/// Over HTTPS: a server whose certificate no trusted authority signed is refused (the source
/// is unavailable); with the test CA trusted through `SSL_CERT_FILE`, the envelope is read. It
/// sets that variable, so it runs in a process of its own.
#[test]
fn the_https_source_verifies_the_server() {
    if !support::in_own_process("fleet::the_https_source_verifies_the_server") {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    let certs: Vec<_> =
        rustls_pemfile::certs(&mut std::fs::read(root.join("api.pem")).unwrap().as_slice())
            .collect::<Result<_, _>>()
            .unwrap();
    let key =
        rustls_pemfile::private_key(&mut std::fs::read(root.join("api.key")).unwrap().as_slice())
            .unwrap()
            .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let body = Envelope::seal(
        bundle("api", 10),
        Slot::Live,
        7,
        now_secs(),
        Some(now_secs() + 86_400),
        None,
    )
    .to_json();
    let rt = runtime();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(("127.0.0.1", free_port())))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = body.clone();
    rt.spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let Ok(mut tls) = acceptor.accept(tcp).await else {
                continue;
            };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && tls.read(&mut byte).await.is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{served}",
                served.len()
            );
            let _ = tls.write_all(response.as_bytes()).await;
            let _ = tls.shutdown().await;
        }
    });
    let url = format!("https://localhost:{port}/bundle.json");

    std::env::remove_var("SSL_CERT_FILE");
    let untrusted = open(&url);
    match rt.block_on(untrusted.read()) {
        Err(SourceError::Unavailable(e)) => assert!(e.contains("TLS"), "{e}"),
        other => panic!("an unknown authority is refused: {other:?}"),
    }

    std::env::set_var("SSL_CERT_FILE", root.join("ca.pem"));
    let trusted = open(&url);
    std::env::remove_var("SSL_CERT_FILE");
    let slots = rt.block_on(trusted.read()).unwrap();
    assert_eq!(slots.live.as_deref(), Some(body.as_bytes()));
}

/// `changed()` returns `false` soon after its notification channel drops (the caller polls
/// meanwhile), subscribes again on the next call, and is woken by the next publish.
fn assert_changed_reconnects(url: &str, drop_listener: &dyn Fn()) {
    let dir = tempfile::tempdir().unwrap();
    let a = write_file(dir.path(), "a.json", &bundle("api", 10));
    let rt = runtime();
    let store = open(url);
    assert!(!rt.block_on(store.changed(Duration::from_millis(200))));
    drop_listener();
    let start = Instant::now();
    assert!(!rt.block_on(store.changed(Duration::from_secs(60))));
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "a dropped channel ends the wait instead of running out the minute"
    );
    assert!(!rt.block_on(store.changed(Duration::from_millis(200))));
    tollgate(&["publish", &a, "--store", url]).version();
    assert!(rt.block_on(store.changed(Duration::from_secs(5))));
}

#[test]
fn changed_reconnects_on_redis() {
    let redis = RedisServer::start();
    assert_changed_reconnects(&redis.url(), &|| {
        let killed = redis.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
        assert_eq!(killed.trim(), "1", "one subscriber");
    });
}

#[test]
fn changed_reconnects_on_postgres() {
    let pg = PgServer::start();
    assert_changed_reconnects(&pg.url(), &|| {
        pg.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE query = 'LISTEN tollgate_bundle'",
        );
    });
}

/// The highest version is compared as a decimal string in Redis's Lua (whose numbers are
/// doubles): a lower write never lowers it, and one a millisecond above is newer. A record
/// above the store's clock plus a day (2^60 here, or 20 digits) is not believed: it blocks no
/// write, and the next write replaces it.
#[test]
fn versions_compare_exactly_and_a_record_from_the_future_is_not_believed_on_redis() {
    let redis = RedisServer::start();
    let rt = runtime();
    let store = open(&redis.url());
    let base = now_ms();
    let write = |version: u64| {
        let envelope = Envelope::seal(
            bundle("api", 10),
            Slot::Candidate,
            version,
            0,
            Some(now_secs() + 86_400),
            None,
        );
        rt.block_on(store.write(&envelope))
    };
    write(base).unwrap();
    write(base + 1).unwrap();
    // At or below the highest issued: another publisher was first; nothing is written.
    for stale in [base + 1, base, 99] {
        assert!(
            matches!(write(stale), Err(SourceError::Conflict(_))),
            "{stale}"
        );
    }
    assert_eq!(rt.block_on(store.highest_version()).unwrap(), base + 1);
    for forged in [(1u64 << 60).to_string(), "99999999999999999999".to_string()] {
        redis.cli(&["SET", "{tollgate-bundle}:version", &forged]);
        let v = now_ms() + 10;
        write(v).unwrap();
        assert_eq!(rt.block_on(store.highest_version()).unwrap(), v, "{forged}");
    }
    let dir = tempfile::tempdir().unwrap();
    let a = write_file(dir.path(), "a.json", &bundle("api", 10));
    let issued = rt.block_on(store.highest_version()).unwrap();
    let next = tollgate(&["publish", &a, "--store", &redis.url()]).version();
    assert!(next > issued, "{next} {issued}");
    assert!(next <= now_ms() + 1000, "{next}");
}

/// A bundle with no policy and no kill switch publishes (a gateway run with
/// `--allow-empty-policy` takes it), but the publisher is warned that every other gateway will
/// refuse it.
#[test]
fn publishing_a_bundle_that_enforces_nothing_warns() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write_file(
        dir.path(),
        "empty.json",
        r#"{"bundle_version": 1, "policies": []}"#,
    );
    let out = dir.path().join("envelope.json");
    let out_arg = out.display().to_string();
    let run = tollgate(&["publish", &empty, "--out", &out_arg, "--allow-unsigned"]);
    run.version();
    assert_eq!(
        run.stderr.lines().next(),
        Some(
            format!(
                "{empty}: warning: no policy and no kill switch in force: a gateway refuses this bundle unless run with --allow-empty-policy"
            )
            .as_str()
        ),
        "{}",
        run.stderr
    );
    let full = write_file(dir.path(), "full.json", &bundle("api", 5));
    let run = tollgate(&["publish", &full, "--out", &out_arg, "--allow-unsigned"]);
    run.version();
    assert!(
        !run.stderr.contains("no policy and no kill switch"),
        "{}",
        run.stderr
    );
}

/// PostgreSQL: a forged version record (2^63 - 1, the most a `bigint` holds) and a heartbeat
/// from the future block nothing; `refresh` seals the live bundle again without touching the
/// history; `repair` sets the record back and removes the heartbeat; a slot above the
/// gateway's limit is reported by its size, not read.
#[test]
fn a_forged_record_blocks_nothing_and_refresh_and_repair_work_on_postgres() {
    let pg = PgServer::start();
    let url = pg.url();
    let rt = runtime();
    let store = open(&url);
    let dir = tempfile::tempdir().unwrap();
    let (sign, _) = openssl_pair(dir.path(), "sign");
    let a = write_file(dir.path(), "a.json", &bundle("api", 10));
    let b = write_file(dir.path(), "b.json", &bundle("api", 20));
    let first = tollgate(&["publish", &a, "--store", &url, "--sign-key", &sign]).version();
    pg.sql("UPDATE tollgate_bundle SET version = 9223372036854775807 WHERE slot = 'issued'");
    let mut forged = beat("forged", None, None, now_secs() + 7_200);
    forged.live_version = Some(9_223_372_036_854_775_806);
    rt.block_on(store.heartbeat(&forged)).unwrap();
    let run = tollgate(&["publish", &b, "--store", &url, "--sign-key", &sign]);
    let second = run.version();
    assert!(second > first && second <= now_ms(), "{second}");
    assert!(
        run.stderr
            .contains("warning: version 9223372036854775807 in the version record"),
        "{}",
        run.stderr
    );
    assert_eq!(rt.block_on(store.highest_version()).unwrap(), second);
    // Refresh: a new version and expiry for the same bundle; the history keeps `a` alone.
    let run = tollgate(&[
        "refresh",
        "--store",
        &url,
        "--sign-key",
        &sign,
        "--valid-for",
        "2d",
    ]);
    let refreshed = run.version();
    assert!(refreshed > second);
    let live = stored(&rt, store.as_ref(), Slot::Live).unwrap();
    assert_eq!(live.version, refreshed);
    assert_eq!(live.sha256, sha256_hex(bundle("api", 20).as_bytes()));
    let expires_at = live.expires_at.expect("an expiry");
    assert!(
        (expires_at - (now_secs() + 2 * 86_400)).abs() < 60,
        "{expires_at}"
    );
    assert_eq!(rt.block_on(store.history()).unwrap().len(), 1);
    // Repair: the record poisoned again, the heartbeat from the future removed.
    pg.sql("UPDATE tollgate_bundle SET version = 9223372036854775807 WHERE slot = 'issued'");
    let run = tollgate(&["repair", "--store", &url]);
    assert_eq!(run.version(), refreshed, "{}", run.stderr);
    assert_eq!(rt.block_on(store.highest_version()).unwrap(), refreshed);
    let ids: Vec<String> = rt
        .block_on(store.gateways())
        .unwrap()
        .into_iter()
        .map(|b| b.id)
        .collect();
    assert!(!ids.contains(&"forged".to_string()), "{ids:?}");
    // The size first: a slot above the limit is reported by its size.
    let bounded = rt.block_on(store.read_bounded(100)).unwrap();
    let size = live.to_json().len() as u64;
    assert_eq!(bounded.live, Some(source::Bounded::TooLarge(size)));
    let whole = rt.block_on(store.read_bounded(DEFAULT_MAX_BYTES)).unwrap();
    assert_eq!(
        whole.live,
        Some(source::Bounded::Bytes(live.to_json().into_bytes()))
    );
}
