//! Real store servers for integration tests: `redis-server` (one node or a three-node
//! cluster) and PostgreSQL (as the non-root `postgres` user), on free loopback ports, installed by
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
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run `bash scripts/test.sh` (it installs it)");
        let server = RedisServer {
            child: Some(child),
            port,
            _dir: dir,
        };
        let start = Instant::now();
        while !server.pong() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
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
