//! The shared store changing under traffic, against real servers on loopback: a Redis Sentinel
//! failover, a master killed and back as a replica, a former master turning read-only, a Redis Cluster resharded, and a cluster node
//! killed and replaced. In every case no request gets a 5xx, and once the store answers again a
//! limit is exact again. What is admitted while the store is away is not asserted here.

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use support::servers::{RedisCluster, RedisSentinels, RedisServer};
use support::{try_request, Gateway, Upstream};

/// Per client: a burst of 5 that refills nothing during a test.
const POLICY: &str = r#"{"rules": [{"name": "per-client", "limit_keys": ["header:x-client"],
    "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 5}}]}"#;
const BURST: usize = 5;

/// A gateway (two worker threads, so per-thread connections are exercised) on `store`, once
/// its store answers. The deadline is long: a debug build on a busy machine must not time out
/// the calls whose exactness is asserted.
fn gateway(store: &str, upstream: &Upstream) -> Gateway {
    let store = format!("--store={store}");
    let gw = Gateway::start(
        Some(POLICY),
        Some(upstream.addr),
        &[
            store.as_str(),
            "--store-timeout-ms",
            "2000",
            "--threads",
            "2",
        ],
    );
    wait_answering(&gw);
    gw
}

/// Waits until the store answers the gateway: `/readyz` says so and fresh clients' requests
/// carry the store's numbers on both worker threads (several in a row).
fn wait_answering(gw: &Gateway) {
    let mut probe = 0u32;
    gw.wait_until(Duration::from_secs(30), || {
        // The store answering and deciding again (not local mode, whose share for a lone
        // gateway would give the same numbers).
        let body = gw.admin("GET", "/readyz", &[]).body;
        let ready =
            body.contains("\"store_status\":\"ok\"") && body.contains("\"store_mode\":\"shared\"");
        ready
            && (0..4).all(|_| {
                probe += 1;
                let client = format!("probe-{probe}");
                gw.get("/", &[("X-Client", &client)])
                    .header("RateLimit-Remaining")
                    == Some("4")
            })
    });
}

/// `client`'s next `n` statuses.
fn statuses(gw: &Gateway, client: &str, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| gw.get("/", &[("X-Client", client)]).status)
        .collect()
}

/// Exactly the burst for a new client, then refusals.
fn assert_exact(gw: &Gateway, client: &str) {
    let mut expected = vec![200; BURST];
    expected.extend([429; 3]);
    assert_eq!(
        statuses(gw, client, BURST + 3),
        expected,
        "{client}; gateway log:\n{}",
        gw.log_text()
    );
}

/// Requests sent from two threads, each as a new client, 5 ms apart, until stopped (at most
/// `MAX_REQUESTS` each).
struct Traffic {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Seen>>,
}

#[derive(Debug, Default)]
struct Seen {
    sent: usize,
    server_errors: Vec<u16>,
    transport_errors: Vec<String>,
    slowest: Duration,
}

const MAX_REQUESTS: usize = 4000;

impl Traffic {
    fn start(addr: SocketAddr, name: &'static str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..2)
            .map(|t| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut seen = Seen::default();
                    while !stop.load(Ordering::Relaxed) && seen.sent < MAX_REQUESTS {
                        let client = format!("{name}-{t}-{}", seen.sent);
                        let started = Instant::now();
                        match try_request(addr, "GET", "/", &[("X-Client", &client)]) {
                            Ok(r) if r.status >= 500 => seen.server_errors.push(r.status),
                            Ok(_) => {}
                            Err(e) => seen.transport_errors.push(e.to_string()),
                        }
                        seen.slowest = seen.slowest.max(started.elapsed());
                        seen.sent += 1;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    seen
                })
            })
            .collect();
        Traffic { stop, threads }
    }

    /// Stops the traffic; asserts that it saw no 5xx and no broken exchange.
    fn stop(self, what: &str) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        let mut sent = 0;
        let mut slowest = Duration::ZERO;
        for thread in self.threads {
            let seen = thread.join().expect("traffic thread");
            assert!(
                seen.server_errors.is_empty() && seen.transport_errors.is_empty(),
                "{what}: 5xx {:?}, broken {:?}",
                seen.server_errors,
                seen.transport_errors
            );
            sent += seen.sent;
            slowest = slowest.max(seen.slowest);
        }
        // Reported, not asserted (no timed assertions): a failed call costs at most the
        // store deadline.
        eprintln!("{what}: {sent} requests, no 5xx, slowest {slowest:?}");
        sent
    }
}

/// Polls `ready` every 50 ms for at most `limit`.
fn wait(limit: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reported, not asserted: how many calls failed while the store changed.
/// Prints the store errors of the traffic, and checks each was decided locally (local mode
/// in between: no request waited for a failed store, none was let through uncounted).
fn report_errors(gw: &Gateway, what: &str) {
    let errors = gw.metric("tollgate_store_errors_total");
    let local = gw.metric_sum("tollgate_store_local_decisions_total", &[]);
    eprintln!("{what}: {errors} store errors, {local} rule checks decided locally");
    assert!(
        local >= errors,
        "{what}: {errors} store errors, {local} local checks"
    );
}

fn dbsize(server: &RedisServer) -> u64 {
    server.cli(&["dbsize"]).trim().parse().unwrap_or(0)
}

/// `SENTINEL FAILOVER` while requests flow: none gets a 5xx, the gateway moves to the new
/// master (asked of the sentinels), and a new client gets exactly its burst there.
#[test]
fn a_sentinel_failover_under_traffic_keeps_limits_exact() {
    let group = RedisSentinels::start();
    let upstream = Upstream::start();
    let gw = gateway(&group.url(), &upstream);
    assert_exact(&gw, "before");
    let old = group.master().port;
    let new = group.replica().port;

    let traffic = Traffic::start(gw.proxy, "during");
    std::thread::sleep(Duration::from_millis(300));
    group.failover();
    wait_answering(&gw);
    let sent = traffic.stop("sentinel failover");
    report_errors(&gw, "sentinel failover");
    assert!(sent > 0);

    assert_eq!(group.master().port, new);
    assert_exact(&gw, "after");
    // The buckets spent after the failover live on the new master (and reach the former one,
    // its replica now, by replication).
    assert!(group.server(new).cli(&["role"]).starts_with("master"));
    assert!(group.server(old).cli(&["role"]).starts_with("slave"));
    let log = gw.log_text();
    let masters = log
        .lines()
        .filter(|l| l.contains("connected to the service's master"))
        .collect::<Vec<_>>();
    assert!(
        masters.iter().any(|l| l.contains(&format!(":{old}")))
            && masters.iter().any(|l| l.contains(&format!(":{new}"))),
        "{log}"
    );
}

/// The master killed: the sentinels promote its replica (after 1 s without an answer) and the
/// gateway follows; the former master restarted in its place comes back as a master of its own
/// until the sentinels turn it into a replica. No 5xx throughout, exact after each step.
#[test]
fn a_killed_master_is_replaced_by_its_replica_and_rejoins_as_one() {
    let mut group = RedisSentinels::start();
    let upstream = Upstream::start();
    let gw = gateway(&group.url(), &upstream);
    assert_exact(&gw, "before");
    let (old, new) = (group.master().port, group.replica().port);

    let traffic = Traffic::start(gw.proxy, "during");
    std::thread::sleep(Duration::from_millis(300));
    let index = group.data.iter().position(|d| d.port == old).unwrap();
    group.data[index].kill();
    group.wait(
        Duration::from_secs(30),
        "the sentinels promoting the replica",
        |g| (0..3).all(|i| g.master_port(i) == Some(new)),
    );
    wait_answering(&gw);
    assert_exact(&gw, "after-kill");

    group.data[index].restart();
    group.wait(
        Duration::from_secs(40),
        "the former master rejoining as a replica",
        |g| {
            g.server(old)
                .cli(&["info", "replication"])
                .contains("master_link_status:up")
        },
    );
    wait_answering(&gw);
    traffic.stop("master killed, then back as a replica");
    report_errors(&gw, "master killed, then back as a replica");
    assert_exact(&gw, "after-rejoin");
    assert!(group.server(new).cli(&["role"]).starts_with("master"));
}

/// The server the gateway writes to turns into a replica while its connection stays open (no
/// sentinel closed it): the first `READONLY` reply makes the gateway give that connection up
/// and ask the sentinels, which name the new master; it never keeps writing to the replica.
#[test]
fn a_former_master_turned_read_only_is_left_for_the_new_master() {
    let group = RedisSentinels::start();
    let upstream = Upstream::start();
    let gw = gateway(&group.url(), &upstream);
    assert_exact(&gw, "before");
    let (old, new) = (group.master().port, group.replica().port);

    // A switch-over by hand: the replica promoted, the master demoted (REPLICAOF leaves its
    // clients connected), and the sentinels told.
    assert!(group
        .server(new)
        .cli(&["replicaof", "no", "one"])
        .contains("OK"));
    assert!(group
        .server(old)
        .cli(&["replicaof", "127.0.0.1", &new.to_string()])
        .contains("OK"));
    for sentinel in &group.sentinels {
        assert!(sentinel
            .cli(&["sentinel", "remove", RedisSentinels::SERVICE])
            .contains("OK"));
        assert!(sentinel
            .cli(&[
                "sentinel",
                "monitor",
                RedisSentinels::SERVICE,
                "127.0.0.1",
                &new.to_string(),
                "2"
            ])
            .contains("OK"));
    }
    assert!(group
        .server(old)
        .cli(&["set", "probe", "1"])
        .contains("READONLY"));

    let traffic = Traffic::start(gw.proxy, "during");
    wait_answering(&gw);
    traffic.stop("master turned read-only");
    report_errors(&gw, "master turned read-only");
    assert_exact(&gw, "after");
    let log = gw.log_text();
    assert!(
        log.contains("Redis connection given up: the server is a read-only replica now"),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("connected to the service's master")
                && l.contains(&format!(":{new}"))),
        "{log}"
    );
}

/// `redis-cli --cluster reshard` moves every slot of one node, with its keys, to another while
/// requests flow (ASK and MOVED redirections): no 5xx, and buckets spent before the move keep
/// exactly what they had left.
#[test]
fn a_cluster_resharded_under_traffic_keeps_limits_exact() {
    let cluster = RedisCluster::start();
    let upstream = Upstream::start();
    let gw = gateway(&cluster.url(), &upstream);
    let clients: Vec<String> = (0..40).map(|i| format!("spent-{i}")).collect();
    for client in &clients {
        assert_eq!(statuses(&gw, client, 2), [200, 200]);
    }
    assert!(
        dbsize(&cluster.nodes[0]) > 0,
        "some spent buckets live on the node that is emptied"
    );

    let traffic = Traffic::start(gw.proxy, "during");
    std::thread::sleep(Duration::from_millis(300));
    cluster.reshard(0, 1, 5461);
    wait(Duration::from_secs(30), "the cluster agreeing", || {
        cluster.converged()
    });
    wait_answering(&gw);
    traffic.stop("cluster reshard");
    report_errors(&gw, "cluster reshard");

    assert_eq!(dbsize(&cluster.nodes[0]), 0, "every key moved");
    for client in &clients {
        assert_eq!(
            statuses(&gw, client, 5),
            [200, 200, 200, 429, 429],
            "{client}: 3 left after the move; gateway log:\n{}",
            gw.log_text()
        );
    }
    assert_exact(&gw, "after");
}

/// A cluster node killed (its slots answer `CLUSTERDOWN` once the others see it fail), then
/// replaced by a new process on its port with its cluster configuration: no 5xx meanwhile, and
/// exact again on every node afterwards.
#[test]
fn a_cluster_node_killed_and_replaced_keeps_limits_exact_after() {
    let mut cluster = RedisCluster::start();
    let upstream = Upstream::start();
    let gw = gateway(&cluster.url(), &upstream);
    assert_exact(&gw, "before");

    let traffic = Traffic::start(gw.proxy, "during");
    cluster.nodes[0].kill();
    wait(
        Duration::from_secs(20),
        "the others seeing the cluster down",
        || {
            cluster.nodes[1]
                .cli(&["cluster", "info"])
                .contains("cluster_state:fail")
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    cluster.nodes[0].restart();
    wait(Duration::from_secs(30), "the cluster agreeing", || {
        cluster.converged()
    });
    wait_answering(&gw);
    traffic.stop("cluster node killed and replaced");
    report_errors(&gw, "cluster node killed and replaced");

    // Enough new clients that some land on the replaced node.
    for i in 0..20 {
        assert_exact(&gw, &format!("after-{i}"));
    }
    assert!(
        dbsize(&cluster.nodes[0]) > 0,
        "the replaced node holds buckets"
    );
}

/// A `redis+sentinel://` URL that names no service is refused at start-up, its password kept
/// out of the message.
#[test]
fn a_sentinel_url_without_a_service_is_refused_without_its_password() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, POLICY).unwrap();
    let stderr = support::refused_start(
        &policy,
        &[
            "--store",
            "redis+sentinel://app:hunter2@127.0.0.1:26379",
            "--listen",
            "127.0.0.1:0",
        ],
    );
    assert!(stderr.contains("--store"), "{stderr}");
    assert!(stderr.contains("names no service"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}
