//! Real store servers for integration tests: `redis-server` (one node, a three-node cluster, or
//! a master and a replica watched by three sentinels) and PostgreSQL (as the non-root `postgres` user), on free loopback ports, installed by
//! `scripts/install-deps.sh`, stopped when dropped.

use super::{free_cluster_port, free_port};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    pub child: Option<Child>,
    pub port: u16,
    pub _dir: tempfile::TempDir,
    /// The arguments it was started with (a restart in place reuses them).
    args: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> RedisServer {
        Self::spawn(port, &[])
    }

    /// `redis-server` on `port` with `extra` arguments, answering PING.
    pub fn spawn(port: u16, extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        .iter()
        .chain(extra)
        .map(|a| a.to_string())
        .collect();
        args.push("--dir".into());
        args.push(dir.path().display().to_string());
        Self::run(port, dir, args)
    }

    /// `redis-server` with `args`, answering PING.
    fn run(port: u16, dir: tempfile::TempDir, args: Vec<String>) -> RedisServer {
        let mut server = RedisServer {
            child: None,
            port,
            _dir: dir,
            args,
        };
        server.restart();
        server
    }

    /// Starts the server again (killed first if it runs), on its port, with its arguments and
    /// its directory (a cluster node keeps its `nodes.conf`, a sentinel its configuration).
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run `bash scripts/test.sh` (it installs it)");
        self.child = Some(child);
        let start = Instant::now();
        while !self.pong() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis-server --sentinel` on `port`, watching the master on `master_port` as `service`
    /// (quorum 2, a master unanswering for 1 s is down).
    pub fn sentinel(port: u16, service: &str, master_port: u16) -> RedisServer {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {service} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {service} 1000\n\
                 sentinel failover-timeout {service} 10000\n\
                 sentinel parallel-syncs {service} 1\n",
                dir = dir.path().display()
            ),
        )
        .unwrap();
        let args = vec![conf.display().to_string(), "--sentinel".to_string()];
        Self::run(port, dir, args)
    }

    pub fn pong(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// `redis-cli` against this server; its standard output.
    pub fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A three-node Redis Cluster (no replicas) on free loopback ports.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::spawn(
                    free_cluster_port(),
                    &["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"],
                )
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            created.status.success(),
            "{}",
            String::from_utf8_lossy(&created.stdout)
        );
        let start = Instant::now();
        loop {
            let ready = nodes.iter().all(|n| {
                Command::new("redis-cli")
                    .args(["-p", &n.port.to_string(), "cluster", "info"])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok"))
            });
            if ready {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "cluster did not converge"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        RedisCluster { nodes }
    }

    /// `redis-cli --cluster reshard`: moves `slots` hash slots, with their keys, from node
    /// `from` to node `to`; panics with its output when it fails.
    pub fn reshard(&self, from: usize, to: usize, slots: u32) {
        let id = |i: usize| self.nodes[i].cli(&["cluster", "myid"]).trim().to_string();
        let done = Command::new("redis-cli")
            .args(["--cluster", "reshard"])
            .arg(format!("127.0.0.1:{}", self.nodes[0].port))
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .args(["--cluster-pipeline", "100"])
            .output()
            .expect("redis-cli");
        assert!(
            done.status.success(),
            "{}{}",
            String::from_utf8_lossy(&done.stdout),
            String::from_utf8_lossy(&done.stderr)
        );
    }

    /// Whether every running node says `cluster_state:ok` and agrees on one slot map.
    pub fn converged(&self) -> bool {
        let maps: Vec<String> = self
            .nodes
            .iter()
            .map(|n| {
                let info = n.cli(&["cluster", "info"]);
                if !info.contains("cluster_state:ok") {
                    return String::new();
                }
                let mut shards: Vec<String> = n
                    .cli(&["cluster", "nodes"])
                    .lines()
                    .filter(|l| l.contains("master") && !l.contains("fail"))
                    .map(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        format!(
                            "{} {}",
                            f.get(1).unwrap_or(&""),
                            f[8.min(f.len())..].join(" ")
                        )
                    })
                    .collect();
                shards.sort();
                shards.join("\n")
            })
            .collect();
        !maps[0].is_empty() && maps.iter().all(|m| *m == maps[0])
    }

    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn pg_bin(name: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed: run `bash scripts/test.sh` (it installs it)")
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().expect("PostgreSQL server binaries")
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A command run as the `postgres` user when we are root (PostgreSQL refuses to run as root).
pub fn as_postgres(program: PathBuf) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

pub struct PgServer {
    pub child: Option<Child>,
    pub port: u16,
    pub dir: tempfile::TempDir,
}

impl PgServer {
    pub fn start() -> PgServer {
        let dir = tempfile::tempdir().unwrap();
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let data = dir.path().join("data");
        let init = as_postgres(pg_bin("initdb"))
            .args(["-U", "tollgate", "--auth=trust", "-E", "UTF8", "-D"])
            .arg(&data)
            .output()
            .expect("initdb");
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let mut server = PgServer {
            child: None,
            port: free_port(),
            dir,
        };
        server.run();
        server
    }

    pub fn run(&mut self) {
        let data = self.dir.path().join("data");
        let child = as_postgres(pg_bin("postgres"))
            .arg("-D")
            .arg(&data)
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
            ])
            .arg("-k")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres");
        self.child = Some(child);
        let start = Instant::now();
        loop {
            let ready = Command::new(pg_bin("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .output()
                .is_ok_and(|o| o.status.success());
            if ready {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "postgres did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://tollgate@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs one SQL statement with `psql`; panics with its error when it fails.
    pub fn sql(&self, statement: &str) {
        let done = Command::new(pg_bin("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "tollgate",
            ])
            .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", statement])
            .output()
            .expect("psql");
        assert!(
            done.status.success(),
            "{}",
            String::from_utf8_lossy(&done.stderr)
        );
    }

    /// Stops the server at once: SIGINT (fast shutdown) to the postmaster itself, whose pid is
    /// the first line of `postmaster.pid` (`runuser` does not forward signals).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid_file = self.dir.path().join("data").join("postmaster.pid");
            let pid = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
            // SAFETY: kill(2) on the server we started.
            unsafe {
                match pid {
                    Some(pid) => libc::kill(pid, libc::SIGINT),
                    None => libc::kill(child.id() as i32, libc::SIGKILL),
                };
            }
            let _ = child.wait();
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A master and one replica watched by three sentinels (quorum 2) as service `tollgate`.
pub struct RedisSentinels {
    /// The two data servers; which one is the master changes with a failover.
    pub data: Vec<RedisServer>,
    pub sentinels: Vec<RedisServer>,
}

impl RedisSentinels {
    pub const SERVICE: &'static str = "tollgate";

    /// Starts them; returns once the replica is in sync and every sentinel knows it (a failover
    /// needs a replica to promote).
    pub fn start() -> RedisSentinels {
        let master = RedisServer::start();
        let replica = RedisServer::spawn(
            super::free_port(),
            &["--replicaof", "127.0.0.1", &master.port.to_string()],
        );
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::sentinel(super::free_port(), Self::SERVICE, master.port))
            .collect();
        let group = RedisSentinels {
            data: vec![master, replica],
            sentinels,
        };
        group.wait(
            Duration::from_secs(30),
            "the replica in sync, known to every sentinel",
            |g| {
                g.data[1]
                    .cli(&["info", "replication"])
                    .contains("master_link_status:up")
                    && g.sentinels.iter().all(|s| {
                        s.cli(&["sentinel", "replicas", Self::SERVICE])
                            .lines()
                            .any(|l| l.trim() == g.data[1].port.to_string())
                            && s.cli(&["sentinel", "sentinels", Self::SERVICE])
                                .lines()
                                .filter(|l| l.trim() == "runid")
                                .count()
                                == 2
                    })
            },
        );
        group
    }

    /// `redis+sentinel://` naming the three sentinels.
    pub fn url(&self) -> String {
        let sentinels: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{}", sentinels.join(","), Self::SERVICE)
    }

    /// The master's port as sentinel `i` names it.
    pub fn master_port(&self, i: usize) -> Option<u16> {
        self.sentinels[i]
            .cli(&["sentinel", "get-master-addr-by-name", Self::SERVICE])
            .lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
    }

    /// The data server that is master now (per the first sentinel).
    pub fn master(&self) -> &RedisServer {
        let port = self.master_port(0).expect("a master");
        self.data
            .iter()
            .find(|d| d.port == port)
            .expect("a known server")
    }

    /// The other data server.
    pub fn replica(&self) -> &RedisServer {
        let port = self.master_port(0).expect("a master");
        self.data
            .iter()
            .find(|d| d.port != port)
            .expect("a known server")
    }

    /// `SENTINEL FAILOVER`, then waits until every sentinel names the former replica, which
    /// says it is a master, and the former master replicates from it.
    pub fn failover(&self) {
        let (old, new) = (self.master().port, self.replica().port);
        let answer = self.sentinels[0].cli(&["sentinel", "failover", Self::SERVICE]);
        assert!(answer.contains("OK"), "SENTINEL FAILOVER: {answer}");
        self.wait(Duration::from_secs(30), "the failover", |g| {
            (0..3).all(|i| g.master_port(i) == Some(new))
                && g.server(new).cli(&["role"]).starts_with("master")
                && g.server(old)
                    .cli(&["info", "replication"])
                    .contains("master_link_status:up")
        });
    }

    pub fn server(&self, port: u16) -> &RedisServer {
        self.data
            .iter()
            .find(|d| d.port == port)
            .expect("a known server")
    }

    /// Polls `ready` every 50 ms; panics after `limit`, naming `what`.
    pub fn wait(&self, limit: Duration, what: &str, ready: impl Fn(&RedisSentinels) -> bool) {
        let start = Instant::now();
        while !ready(self) {
            assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
