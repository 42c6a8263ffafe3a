//! State that survives (`--state-dir`), through the real binary: a budget and a token bucket
//! across `kill -9` and SIGTERM restarts, one owner per directory, bad state files moved aside,
//! a state dir that cannot be used falling back to process memory, a key flood against a spent
//! budget, and a zero-downtime upgrade (`--upgrade`, SIGQUIT) under a client that never stops.

use crate::support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{free_port, try_request, Upstream};

/// A monthly budget of 10 per tenant, and 5 per client address per 10 minutes.
const POLICY: &str = r#"{"bundle_version": "2026-11-25.1", "issued_at": "2026-11-25T00:00:00Z",
  "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "rules": [
    {"name": "monthly", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
     "algorithm_config": {"budget": 10, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
       "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
    {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
     "algorithm_config": {"tokens_per_second": 0.01, "burst": 5}}]}}]}"#;

/// One gateway process on fixed ports and a fixed state dir, so a restart finds both again.
struct Node {
    child: Option<Child>,
    proxy: SocketAddr,
    admin: SocketAddr,
    log: PathBuf,
}

struct Setup {
    dir: tempfile::TempDir,
    proxy: SocketAddr,
    admin: SocketAddr,
    upstream: Upstream,
}

impl Setup {
    fn new(policy: &str) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("policy.json"), policy).unwrap();
        Setup {
            proxy: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            admin: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            dir,
            upstream: Upstream::start(),
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Spawns `tollgate run` with the state dir and `extra` flags; `log` names its log file.
    fn spawn(&self, log: &str, extra: &[&str]) -> Node {
        self.spawn_with(log, extra, true)
    }

    /// [`Setup::spawn`], with or without the state dir.
    fn spawn_with(&self, log: &str, extra: &[&str], state_dir: bool) -> Node {
        self.spawn_limited(log, extra, state_dir, None)
    }

    /// [`Setup::spawn_with`], the process's address space limited to `address_space` bytes
    /// (`RLIMIT_AS`) when given.
    fn spawn_limited(
        &self,
        log: &str,
        extra: &[&str],
        state_dir: bool,
        address_space: Option<u64>,
    ) -> Node {
        let log = self.dir.path().join(log);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        if let Some(bytes) = address_space {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit(2) only, between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let limit = libc::rlimit {
                        rlim_cur: bytes,
                        rlim_max: bytes,
                    };
                    if libc::setrlimit(libc::RLIMIT_AS, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        cmd.arg("run");
        if state_dir {
            cmd.arg("--state-dir").arg(self.state());
        }
        let child = cmd
            .arg("--policy")
            .arg(self.dir.path().join("policy.json"))
            .args(["--listen", &self.proxy.to_string()])
            .args(["--admin-listen", &self.admin.to_string()])
            .args(["--upstream", &self.upstream.addr.to_string()])
            .args(["--threads", "1"])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        Node {
            child: Some(child),
            proxy: self.proxy,
            admin: self.admin,
            log,
        }
    }

    fn start(&self, log: &str, extra: &[&str]) -> Node {
        let node = self.spawn(log, extra);
        node.wait_ready();
        node
    }

    /// Waits until `new`, started with `--upgrade`, listens on the upgrade socket; its path.
    fn wait_for_upgrade_sock(&self, new: &Node) -> PathBuf {
        let sock = self.state().join("upgrade.sock");
        let start = Instant::now();
        while !sock.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{}",
                new.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        sock
    }

    /// Upgrades `old` to a new process started with `--upgrade` and `extra` (its log
    /// `new.log`): the new one waits on the upgrade socket, the old one hands its listeners
    /// over on SIGQUIT and exits 0; the new one is ready when this returns.
    fn upgrade(&self, old: &mut Node, extra: &[&str]) -> Node {
        let mut args = vec!["--upgrade"];
        args.extend(extra);
        let new = self.spawn("new.log", &args);
        self.wait_for_upgrade_sock(&new);
        Setup::hand_over(old, &new);
        new
    }

    /// Sends `old` SIGQUIT: it hands its listeners to `new` (waiting on the upgrade socket) and
    /// exits 0; `new` is ready when this returns.
    fn hand_over(old: &mut Node, new: &Node) {
        old.signal(libc::SIGQUIT);
        assert_eq!(
            old.wait_exit(Duration::from_secs(40)),
            Some(0),
            "{}",
            old.log_text()
        );
        new.wait_ready();
    }
}

impl Node {
    fn wait_ready(&self) {
        let start = Instant::now();
        while !try_request(self.admin, "GET", "/readyz", &[]).is_ok_and(|r| r.status == 200)
            || TcpStream::connect(self.proxy).is_err()
        {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "not ready; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// Waits for the process to exit; its exit code.
    fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return status.code();
            }
            assert!(start.elapsed() < limit, "did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.wait_exit(Duration::from_secs(10));
    }

    /// Statuses of `n` requests of tenant `tenant` from client address `ip` (a trusted
    /// proxy's `X-Forwarded-For`).
    fn statuses(&self, n: usize, tenant: &str, ip: &str) -> Vec<u16> {
        (0..n)
            .map(|_| {
                support::request(
                    self.proxy,
                    "GET",
                    "/v1/x",
                    &[("x-tenant", tenant), ("x-forwarded-for", ip)],
                )
                .status
            })
            .collect()
    }

    /// `/readyz`'s `store`: the store in use.
    fn readyz_store(&self) -> String {
        let ready = support::request(self.admin, "GET", "/readyz", &[]);
        let body: serde_json::Value = serde_json::from_str(&ready.body).unwrap();
        body["store"].as_str().unwrap_or_default().to_string()
    }

    fn metric(&self, series: &str) -> f64 {
        support::request(self.admin, "GET", "/metrics", &[])
            .body
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(-1.0)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

const TRUST: [&str; 2] = ["--trusted-proxy", "127.0.0.1/32"];

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}

/// The issue's first case: 7 of a budget of 10 spent, then `kill -9` and a restart: exactly 3
/// more are admitted. The same after SIGTERM; the token bucket continues too.
#[test]
fn budgets_and_buckets_survive_kill_9_and_sigterm() {
    let setup = Setup::new(POLICY);
    let mut node = setup.start("first.log", &TRUST);
    // Seven clients spend one each of tenant a's budget; client 10.0.0.1 spends 3 of its 5.
    for i in 0..4 {
        assert_eq!(node.statuses(1, "a", &format!("10.0.1.{i}")), [200]);
    }
    assert_eq!(node.statuses(3, "a", "10.0.0.1"), [200, 200, 200]);
    node.kill9();

    let mut node = setup.start("second.log", &TRUST);
    assert!(
        node.log_text().contains("state dir: buckets, budgets"),
        "{}",
        node.log_text()
    );
    // Client 10.0.0.1 has 2 left: one spends tenant a's 8th unit, one the 9th.
    assert_eq!(node.statuses(3, "a", "10.0.0.1"), [200, 200, 429]);
    assert_eq!(node.statuses(1, "a", "10.0.2.1"), [200]);
    // The budget is spent: 10 of 10.
    assert_eq!(node.statuses(2, "a", "10.0.2.2"), [429, 429]);
    node.signal(libc::SIGTERM);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(0));

    let node = setup.start("third.log", &TRUST);
    assert_eq!(node.statuses(1, "a", "10.0.3.1"), [429]);
    assert_eq!(node.statuses(1, "a", "10.0.0.1"), [429]);
    // Another tenant still has its whole budget.
    assert_eq!(count(&node.statuses(4, "b", "10.0.4.1"), 200), 4);
    assert_eq!(node.metric("tollgate_state_dir_fallback"), 0.0);
    // The store in use is named for what it is: the embedded store in the state dir's file.
    assert_eq!(node.readyz_store(), "state_dir");
    assert_eq!(node.metric("tollgate_store_info{kind=\"state_dir\"}"), 1.0);
}

/// A second gateway on a state dir a running one holds exits 1 naming the directory.
#[test]
fn a_second_gateway_on_a_held_state_dir_exits_1() {
    let setup = Setup::new(POLICY);
    let _first = setup.start("first.log", &[]);
    let mut second = setup.spawn("second.log", &[]);
    assert_eq!(second.wait_exit(Duration::from_secs(20)), Some(1));
    let log = second.log_text();
    assert!(
        log.contains(&format!(
            "--state-dir {}: held by a running gateway (pid ",
            setup.state().display()
        )),
        "{log}"
    );
}

/// Garbage, a truncated file and a file of another layout version are each moved aside (kept,
/// timestamped), logged at error level with the reason, and the gateway starts empty.
#[test]
fn bad_state_files_are_moved_aside_and_the_gateway_starts_empty() {
    let cases: [(Vec<u8>, &str); 3] = [
        (
            b"not a state file at all, just text".repeat(200),
            "bad magic",
        ),
        (b"TGSTATE\x01".to_vec(), "truncated"),
        (
            {
                let mut v = b"TGSTATE\x01".to_vec();
                v.extend_from_slice(&7u64.to_le_bytes());
                v.resize(8192, 0);
                v
            },
            "layout version 7 (this build reads 1)",
        ),
    ];
    for (bytes, reason) in cases {
        let setup = Setup::new(POLICY);
        std::fs::create_dir_all(setup.state()).unwrap();
        std::fs::write(setup.state().join("buckets.state"), &bytes).unwrap();
        let node = setup.start("gw.log", &TRUST);
        let log = node.log_text();
        assert!(log.contains("ERROR"), "{log}");
        assert!(log.contains(reason), "{reason}: {log}");
        let aside: Vec<PathBuf> = std::fs::read_dir(setup.state())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().contains("buckets.state.bad-"))
            .collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
        assert_eq!(std::fs::read(&aside[0]).unwrap(), bytes);
        // Empty, working, and persistent again.
        assert_eq!(count(&node.statuses(10, "a", "10.0.0.9"), 200), 5);
        assert_eq!(node.metric("tollgate_state_dir_fallback"), 0.0);
    }
}

/// A state dir that cannot be used (here a file where the directory should be; a full disk is
/// below) leaves the buckets in process memory: an error line, the fallback metric at 1, and
/// limits still enforced.
#[test]
fn an_unusable_state_dir_falls_back_to_process_memory() {
    let setup = Setup::new(POLICY);
    std::fs::write(setup.state(), b"a file, not a directory").unwrap();
    let node = setup.start("gw.log", &TRUST);
    let log = node.log_text();
    assert!(
        log.contains("state dir unusable, buckets kept in process memory only"),
        "{log}"
    );
    assert_eq!(node.metric("tollgate_state_dir_fallback"), 1.0);
    // The buckets are in process memory, and `/readyz` says so.
    assert_eq!(node.readyz_store(), "memory");
    assert_eq!(
        node.statuses(6, "a", "10.0.0.1"),
        [200, 200, 200, 200, 200, 429]
    );
}

/// A failed `mmap`: the gateway's address space limited to what it uses without a state dir
/// plus 400 MB, where the state file for 10 million buckets needs a 1.9 GB mapping.
#[test]
fn a_failed_mmap_falls_back_to_process_memory() {
    let setup = Setup::new(POLICY);
    let flags = [TRUST[0], TRUST[1], "--max-buckets", "10000000"];
    // The address space the same gateway takes without a state dir, once it serves.
    let without = setup.spawn_with("without.log", &flags, false);
    without.wait_ready();
    let status = std::fs::read_to_string(format!("/proc/{}/status", without.pid())).unwrap();
    let vm_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize");
    drop(without);
    let node = setup.spawn_limited("gw.log", &flags, true, Some(vm_kb * 1024 + 400_000_000));
    node.wait_ready();
    let log = node.log_text();
    assert!(
        log.contains("ERROR")
            && log.contains("state dir unusable, buckets kept in process memory only")
            && log.contains("cannot map the state file"),
        "{log}"
    );
    assert_eq!(node.metric("tollgate_state_dir_fallback"), 1.0);
    assert_eq!(
        node.statuses(6, "a", "10.0.0.1"),
        [200, 200, 200, 200, 200, 429]
    );
}

/// A full disk: a tmpfs too small for the state file. Needs CAP_SYS_ADMIN for the mount (CI
/// has it, and there a failed mount fails the test); elsewhere the test says so and checks
/// nothing.
#[test]
fn a_full_disk_falls_back_to_process_memory() {
    let setup = Setup::new(POLICY);
    std::fs::create_dir_all(setup.state()).unwrap();
    let mounted = Command::new("mount")
        // Owner-only (a tmpfs is world-writable by default, which a state dir may not be).
        .args(["-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs"])
        .arg(setup.state())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // Where mounting is allowed (CAP_SYS_ADMIN, as CI has), a failed mount is a failure.
    let may_mount = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 21) != 0);
    assert!(
        mounted || !may_mount,
        "could not mount a tmpfs with CAP_SYS_ADMIN"
    );
    if !mounted {
        eprintln!(
            "a_full_disk_falls_back_to_process_memory: cannot mount a tmpfs (no CAP_SYS_ADMIN): skipped"
        );
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(setup.state());
    let node = setup.start("gw.log", &TRUST);
    let log = node.log_text();
    assert!(
        log.contains("cannot allocate the state file on disk"),
        "{log}"
    );
    assert_eq!(node.metric("tollgate_state_dir_fallback"), 1.0);
    assert_eq!(
        node.statuses(6, "a", "10.0.0.1"),
        [200, 200, 200, 200, 200, 429]
    );
    assert!(!setup.state().join("buckets.state").exists());
}

/// Without a state dir, a bundle holding state a restart resets says so at start-up (once, at
/// warning level, naming the rules); with one, it does not.
#[test]
fn start_up_warns_about_state_a_restart_resets() {
    let setup = Setup::new(POLICY);
    let node = setup.spawn_with("memory.log", &TRUST, false);
    node.wait_ready();
    let log = node.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("hold state that a restart resets"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains("WARN")
            && warnings[0].contains("monthly")
            && warnings[0].contains("--state-dir DIR"),
        "{log}"
    );
    drop(node);
    let node = setup.start("state.log", &TRUST);
    assert!(
        !node.log_text().contains("hold state that a restart resets"),
        "{}",
        node.log_text()
    );
}

/// A tripped circuit breaker and a loop mark (the shipped agent-guards policy) survive
/// `kill -9`: after the restart the breaker is still open and the repeated body is still a
/// loop.
#[test]
fn breakers_and_loop_marks_survive_kill_9() {
    let setup = Setup::new(include_str!("../policies/agent-guards.json"));
    let post = |node: &Node, key: &str, cost: &str, body: &str| {
        let r = support::request_with_body(
            node.proxy,
            "POST",
            "/v1/agent/run",
            &[("X-Api-Key", key), ("X-Cost", cost)],
            body.as_bytes(),
        );
        (r.status, r.header("x-tollgate-reason").map(str::to_string))
    };
    let mut node = setup.start("gw1.log", &[]);
    // Two identical bodies pass; a third would be a loop.
    assert_eq!(post(&node, "looper", "1", r#"{"task": "a"}"#).0, 200);
    assert_eq!(post(&node, "looper", "1", r#"{"task": "a"}"#).0, 200);
    // 60 within a minute trips the breaker (50).
    assert_eq!(post(&node, "spender", "30", "{}").0, 200);
    assert_eq!(
        post(&node, "spender", "30", "{}"),
        (429, Some("circuit_breaker_open".to_string()))
    );
    node.kill9();
    let node = setup.start("gw2.log", &[]);
    assert_eq!(
        post(&node, "looper", "1", r#"{"task": "a"}"#),
        (429, Some("loop_detected".to_string()))
    );
    assert_eq!(
        post(&node, "spender", "1", "{}"),
        (429, Some("circuit_breaker_open".to_string()))
    );
    // Other keys are untouched.
    assert_eq!(post(&node, "other", "1", r#"{"task": "a"}"#).0, 200);
}

/// An LLM reservation the decision service handed out before a `kill -9` is settled after the
/// restart: its token still verifies (signed with the state dir's key), the day budget is
/// charged the reported usage, not the reservation.
#[test]
fn a_pending_llm_reservation_settles_after_kill_9() {
    let setup = Setup::new(
        r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
        "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 100000,
        "tokens_per_day": 5000, "default_max_completion": 500}}]}"#,
    );
    // "one two three" is 4 prompt tokens; with max_tokens 800, 804 reserved.
    let chat = r#"{"model": "m", "max_tokens": 800, "messages": [{"role": "user", "content": "one two three"}]}"#;
    let decide = |node: &Node| {
        support::request_with_body(
            node.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/chat/completions"),
                ("X-Api-Key", "tenant"),
            ],
            chat.as_bytes(),
        )
    };
    // The day budget left, from the RateLimit header's `chat:tpd` item.
    let day_left = |r: &support::HttpResponse| -> u64 {
        let header = r.header("ratelimit").unwrap_or_default();
        header
            .split(',')
            .map(str::trim)
            .find(|item| item.starts_with("\"chat:tpd\";"))
            .and_then(|item| item.split(';').find_map(|p| p.strip_prefix("r=")))
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("no chat:tpd item in {header:?}"))
    };
    let mut node = setup.start("gw1.log", &[]);
    let r = decide(&node);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-tollgate-reserved-tokens"), Some("804"));
    assert_eq!(day_left(&r), 5000 - 804);
    let token = r
        .header("x-tollgate-reservation")
        .expect("a reservation")
        .to_string();
    node.kill9();
    let node = setup.start("gw2.log", &[]);
    let settled = support::request_with_body(
        node.admin,
        "POST",
        "/v1/usage",
        &[("Content-Type", "application/json")],
        format!(r#"{{"reservation": "{token}", "total_tokens": 100}}"#).as_bytes(),
    );
    assert_eq!(settled.status, 200, "{settled:?}");
    // 100 used: 704 of the 804 handed back, then the next 804 reserved.
    assert_eq!(day_left(&decide(&node)), 5000 - 100 - 804);
}

/// The issue's key flood: a spent monthly budget, idle past the old idle timeout, then 3 000
/// fresh client addresses against a store of 1 000: the budget is never evicted (the flood's
/// own one-unit entries are), so not one more request of that tenant is admitted. With and
/// without a state dir.
#[test]
fn a_key_flood_never_resets_a_spent_budget() {
    for state_dir in [true, false] {
        let policy = r#"{"bundle_version": "2026-11-25.1", "issued_at": "2026-11-25T00:00:00Z", "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "rules": [
            {"name": "monthly", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
             "algorithm_config": {"budget": 10, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
               "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"tokens_per_second": 0.001, "burst": 100}}]}}]}"#;
        let setup = Setup::new(policy);
        let mut flags = vec![
            "--max-buckets",
            "1000",
            "--bucket-idle-secs",
            "1",
            "--sweep-interval-secs",
            "1",
        ];
        flags.extend(TRUST);
        let node = setup.spawn_with("gw.log", &flags, state_dir);
        node.wait_ready();
        let spent = node.statuses(10, "victim", "10.9.9.9");
        assert_eq!(count(&spent, 200), 10, "{spent:?}");
        // Idle for longer than --bucket-idle-secs, and two sweeps.
        std::thread::sleep(Duration::from_millis(2500));
        // The flood: 3 000 fresh addresses, each a new per-ip bucket (and tenant "flood").
        let admitted = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|scope| {
            for t in 0..4 {
                let admitted = Arc::clone(&admitted);
                let proxy = node.proxy;
                scope.spawn(move || {
                    for i in (t..3000).step_by(4) {
                        let ip = format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256);
                        let r = support::request(
                            proxy,
                            "GET",
                            "/v1/x",
                            &[("x-tenant", &format!("t{i}")), ("x-forwarded-for", &ip)],
                        );
                        if r.status == 200 {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(
            admitted.load(Ordering::Relaxed),
            3000,
            "a new key fails open"
        );
        std::thread::sleep(Duration::from_millis(1500));
        // The victim's budget is still spent, whatever address it comes from.
        let after = node.statuses(5, "victim", "10.9.9.8");
        assert_eq!(after, [429, 429, 429, 429, 429], "state dir: {state_dir}");
        // The flood's new keys took the places of its own cheapest entries; none went
        // untracked.
        assert_eq!(node.metric("tollgate_store_fail_open_total"), 0.0);
        assert!(node.metric("tollgate_store_evictions_total") >= 2000.0);
    }
}

/// Keep-alive requests `GET /v1/x` with `headers` from `headers_of(i)` for each `i` of `range`
/// (a connection the server closes is replaced); returns how many were answered 200.
fn flood(
    proxy: SocketAddr,
    range: impl Iterator<Item = usize>,
    headers_of: impl Fn(usize) -> String,
) -> usize {
    let mut admitted = 0;
    let mut conn: Option<TcpStream> = None;
    for i in range {
        for _attempt in 0..3 {
            let mut stream = match conn.take() {
                Some(s) => s,
                None => TcpStream::connect_timeout(&proxy, Duration::from_secs(5)).unwrap(),
            };
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let req = format!(
                "GET /v1/x HTTP/1.1\r\nHost: api.example.com\r\n{}\r\n",
                headers_of(i)
            );
            if stream.write_all(req.as_bytes()).is_err() {
                continue;
            }
            if let Ok(Some((status, close))) = read_response(&mut stream) {
                admitted += usize::from(status == 200);
                if !close {
                    conn = Some(stream);
                }
                break;
            }
        }
    }
    admitted
}

/// The issue's key flood, made to fill the store many times over: 16 000 requests from fresh
/// client addresses (every fourth with a fresh tenant too, a one-unit budget entry) against
/// `--max-buckets 2000`. Throughout the flood and after it each new client is limited to
/// exactly its burst of 10 (ten 200s, then 429); a tenant with 14 of its 20 spent keeps them
/// spent, evictions give back one token each (but for the rare one whose 5 samples were all expensive), and no request goes untracked for want of
/// room. In process memory and with a state dir.
#[test]
fn a_key_flood_leaves_new_clients_limited_exactly() {
    let policy = r#"{"bundle_version": "2026-11-25.1", "issued_at": "2026-11-25T00:00:00Z", "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "rules": [
        {"name": "monthly", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
         "algorithm_config": {"budget": 20, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
           "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}},
        {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
         "algorithm_config": {"tokens_per_second": 0.001, "burst": 10}}]}}]}"#;
    for state_dir in [false, true] {
        let setup = Setup::new(policy);
        let mut flags = vec!["--max-buckets", "2000"];
        flags.extend(TRUST);
        let node = setup.spawn_with("gw.log", &flags, state_dir);
        node.wait_ready();
        // The tenant spends 14 of its 20, from two addresses.
        let mut spent = node.statuses(7, "tenant", "10.9.9.1");
        spent.extend(node.statuses(7, "tenant", "10.9.9.2"));
        assert_eq!(count(&spent, 200), 14, "{spent:?}");
        let new_client = |n: usize| {
            let ip = format!("10.8.0.{n}");
            flood(node.proxy, 0..11, |_| format!("x-forwarded-for: {ip}\r\n"))
        };
        let (flooded, during) = std::thread::scope(|scope| {
            let floods: Vec<_> = (0..3)
                .map(|t| {
                    let proxy = node.proxy;
                    scope.spawn(move || {
                        flood(proxy, (t..16_000).step_by(3), |i| {
                            let ip =
                                format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256);
                            let tenant = if i % 4 == 0 {
                                format!("x-tenant: flood{i}\r\n")
                            } else {
                                String::new()
                            };
                            format!("x-forwarded-for: {ip}\r\n{tenant}")
                        })
                    })
                })
                .collect();
            // New clients, one after another while the flood runs.
            let mut during = Vec::new();
            while !floods.iter().all(|f| f.is_finished()) && during.len() < 200 {
                during.push(new_client(during.len() + 1));
                std::thread::sleep(Duration::from_millis(20));
            }
            let flooded: usize = floods.into_iter().map(|f| f.join().unwrap()).sum();
            (flooded, during)
        });
        assert_eq!(
            flooded, 16_000,
            "every flood request is admitted and tracked"
        );
        assert!(during.len() >= 5, "clients during the flood: {during:?}");
        // Each limited to exactly its burst: its entry, one token spent after its first request,
        // is never the one evicted while the flood's equally cheap, older entries are sampled.
        assert!(
            during.iter().all(|&n| n == 10),
            "state dir {state_dir}: {during:?}"
        );
        // After the flood: a new client, and the tenant from a fresh address.
        assert_eq!(new_client(250), 10);
        let tenant = node.statuses(7, "tenant", "10.9.9.3");
        assert_eq!(count(&tenant, 200), 6, "state dir {state_dir}: {tenant:?}");
        assert_eq!(tenant[6], 429);
        assert_eq!(node.metric("tollgate_store_fail_open_total"), 0.0);
        assert_eq!(node.metric("tollgate_store_entries"), 2000.0);
        let evicted = node.metric("tollgate_store_evictions_by_kind_total{kind=\"token_bucket\"}")
            + node.metric("tollgate_store_evictions_by_kind_total{kind=\"budget\"}");
        assert!(evicted >= 16_000.0, "{evicted}");
        // An eviction gives back what the cheapest of its 5 sampled entries held: one token
        // (a flood entry) unless all 5 were drained clients or the tenant's. Those are about
        // 200 of the 2000 entries at the flood's end (a tenth, and fewer before), so of ~18 000
        // evictions about 18 000 × 0.1^5 ≈ 0.2 are expected to give back more, and 5 or more
        // happen with a chance of about 3 in a million (Poisson, mean 0.2).
        let forgiven_count = node.metric("tollgate_store_eviction_forgiven_tokens_count");
        let forgave_more = forgiven_count
            - node.metric("tollgate_store_eviction_forgiven_tokens_bucket{le=\"1\"}");
        assert!(
            forgave_more <= 4.0,
            "state dir {state_dir}: {forgave_more} of {forgiven_count} evictions gave back more than one token"
        );
        eprintln!(
            "state dir {state_dir}: {} new clients during the flood, each admitted exactly 10; {evicted} evictions",
            during.len()
        );
    }
}

/// One keep-alive HTTP/1.1 connection that sends `GET /v1/x` again and again; a connection the
/// server closes (`Connection: close`, or closed between requests) is replaced by a new one.
/// Returns (answered 200, answered 429, failed: a request that got no answer or a refused
/// connection).
fn client_loop(proxy: SocketAddr, tenant: &str, stop: &AtomicBool) -> (usize, usize, Vec<String>) {
    let (mut ok, mut limited, mut failed) = (0, 0, Vec::new());
    let mut conn: Option<TcpStream> = None;
    while !stop.load(Ordering::Relaxed) {
        let fresh = conn.is_none();
        let mut stream = match conn.take() {
            Some(s) => s,
            None => match TcpStream::connect_timeout(&proxy, Duration::from_secs(2)) {
                Ok(s) => s,
                Err(e) => {
                    failed.push(format!("connect: {e}"));
                    continue;
                }
            },
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let req = format!(
            "GET /v1/x HTTP/1.1\r\nHost: api.example.com\r\nx-tenant: {tenant}\r\nx-forwarded-for: 10.7.7.7\r\n\r\n"
        );
        match stream.write_all(req.as_bytes()) {
            Ok(()) => {}
            Err(e) if !fresh => {
                // A kept-alive connection the server had closed: retried on a new one, as
                // HTTP clients do (nothing was answered).
                let _ = e;
                continue;
            }
            Err(e) => {
                failed.push(format!("write: {e}"));
                continue;
            }
        }
        match read_response(&mut stream) {
            Ok(Some((status, close))) => {
                match status {
                    200 => ok += 1,
                    429 => limited += 1,
                    other => failed.push(format!("status {other}")),
                }
                if !close {
                    conn = Some(stream);
                }
            }
            // Closed before a byte of the answer on a reused connection: retried.
            Ok(None) if !fresh => {}
            Ok(None) => failed.push("closed without an answer".to_string()),
            Err(e) => failed.push(format!("read: {e}")),
        }
    }
    (ok, limited, failed)
}

/// Reads one response: `None` when the connection closed before any byte; else its status and
/// whether the server closes the connection after it.
fn read_response(stream: &mut TcpStream) -> std::io::Result<Option<(u16, bool)>> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => return Err(std::io::Error::other("closed mid-header")),
            Ok(_) => buf.push(byte[0]),
            Err(e) if buf.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        }
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let status = head[9..12].parse().unwrap_or(0);
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body)?;
    Ok(Some((status, head.contains("connection: close"))))
}

/// The zero-downtime upgrade: while two clients send continuously (one keeping its connection
/// alive, one opening a new connection per request), a second process started with `--upgrade`
/// takes the listeners over and the first, sent SIGQUIT, hands them over and exits. No refused
/// connection, no failed request; both processes decide against the same state, so the budget
/// admits exactly 10 of 10 in all; a tenant drained before the upgrade is still drained after it.
#[test]
fn an_upgrade_under_load_drops_nothing_and_counts_once() {
    let policy = r#"{"bundle_version": "2026-11-25.1", "issued_at": "2026-11-25T00:00:00Z", "policies": [{"id": "api", "spec": {"selector": {"pathPrefix": "/"}, "rules": [
        {"name": "monthly", "limit_keys": ["header:x-tenant"], "algorithm": "cost_based",
         "algorithm_config": {"budget": 10, "period": "1M", "cost_key": "fixed", "fixed_cost": 1,
           "staged_actions": [{"threshold_percent": 100, "action": "reject"}]}}]}}]}"#;
    let setup = Setup::new(policy);
    let mut old = setup.start("old.log", &TRUST);
    // Drained before the upgrade.
    assert_eq!(count(&old.statuses(12, "drained", "10.0.0.1"), 200), 10);
    // The budgeted tenant: 2 spent before.
    assert_eq!(old.statuses(2, "shared", "10.0.0.1"), [200, 200]);

    let stop = Arc::new(AtomicBool::new(false));
    let keepalive = {
        let stop = Arc::clone(&stop);
        let proxy = setup.proxy;
        std::thread::spawn(move || client_loop(proxy, "shared", &stop))
    };
    let fresh_conns = {
        let stop = Arc::clone(&stop);
        let proxy = setup.proxy;
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0usize, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match try_request(proxy, "GET", "/v1/y", &[("x-tenant", "other")]) {
                    Ok(r) if r.status == 200 || r.status == 429 => ok += 1,
                    Ok(r) => failed.push(format!("status {}", r.status)),
                    Err(e) => failed.push(e.to_string()),
                }
            }
            (ok, failed)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let new = setup.upgrade(&mut old, &[TRUST[0], TRUST[1]]);
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (ok, limited, failed) = keepalive.join().unwrap();
    let (fresh_ok, fresh_failed) = fresh_conns.join().unwrap();
    assert!(
        failed.is_empty(),
        "keep-alive client: {failed:?}\nold:\n{}\nnew:\n{}",
        old.log_text(),
        new.log_text()
    );
    assert!(
        fresh_failed.is_empty(),
        "new-connection client: {fresh_failed:?}"
    );
    assert!(fresh_ok > 10, "{fresh_ok}");
    // Exactly the 8 units left were admitted across both processes, the rest refused.
    assert_eq!(ok, 8, "admitted across the handover (limited {limited})");
    assert!(limited > 0);
    assert!(
        new.log_text().contains("upgrade: waiting"),
        "{}",
        new.log_text()
    );
    // A hand-over that goes as it should logs nothing at error level, on either side.
    for (who, log) in [("old", old.log_text()), ("new", new.log_text())] {
        let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
        assert!(errors.is_empty(), "{who}: {errors:?}");
    }
    // Still drained, and the new process owns the directory now.
    assert_eq!(new.statuses(2, "drained", "10.0.0.2"), [429, 429]);
    let mut third = setup.spawn("third.log", &[]);
    assert_eq!(third.wait_exit(Duration::from_secs(20)), Some(1));
    let lock_pid = std::fs::read_to_string(setup.state().join("owner.lock")).unwrap();
    assert_eq!(lock_pid.trim(), new.pid().to_string());
}

/// `curl` over TLS to `api.example.com` resolved to `addr`, trusting the test CA: the status.
fn curl_tls(addr: SocketAddr) -> u16 {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    let out = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(fixtures.join("ca.pem"))
        .arg("--resolve")
        .arg(format!("api.example.com:{}:{}", addr.port(), addr.ip()))
        .arg(format!("https://api.example.com:{}/v1/x", addr.port()))
        .output()
        .expect("curl is not installed: run `bash scripts/test.sh`");
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}

/// The first frame an HTTP/2 server sends after the client's preface: its type (4, SETTINGS).
fn http2_first_frame_type(addr: SocketAddr) -> Option<u8> {
    let mut conn = TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .ok()?;
    let mut head = [0u8; 9];
    conn.read_exact(&mut head).ok()?;
    Some(head[3])
}

/// The TLS and gRPC listeners are handed over too: the new process serves both after the old
/// one has exited, without binding them itself (the old one held them when it started).
#[test]
fn an_upgrade_hands_over_the_tls_and_grpc_listeners() {
    let setup = Setup::new(POLICY);
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    let tls: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let (tls_arg, grpc_arg) = (tls.to_string(), grpc.to_string());
    let (cert, key) = (
        fixtures.join("api.pem").display().to_string(),
        fixtures.join("api.key").display().to_string(),
    );
    let listeners = [
        TRUST[0],
        TRUST[1],
        "--listen-tls",
        &tls_arg,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--grpc-listen",
        &grpc_arg,
    ];
    let mut old = setup.start("old.log", &listeners);
    let start = Instant::now();
    while http2_first_frame_type(grpc).is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{}",
            old.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(curl_tls(tls), 200);
    let new = setup.upgrade(&mut old, &listeners);
    assert_eq!(curl_tls(tls), 200, "{}", new.log_text());
    assert_eq!(http2_first_frame_type(grpc), Some(4), "{}", new.log_text());
    // The per-IP bucket was shared: 2 of its 5 spent, across both processes.
    assert_eq!(
        new.statuses(4, "t", "127.0.0.1"),
        [200, 200, 200, 429],
        "{}",
        new.log_text()
    );
}

/// Issue rows "another local user binds the upgrade socket's path (under /tmp)" and "connects
/// first to the waiting new process": a socket in a directory another user can write to is
/// refused at start-up, naming the path and why; the default socket is owner-only in an
/// owner-only directory, so another user (nobody, through `setpriv`) cannot even connect to the
/// waiting process, and the real hand-over then goes through.
#[test]
fn the_upgrade_socket_trusts_only_this_user() {
    let setup = Setup::new(POLICY);
    let shared = format!("/tmp/tollgate-upgrade-{}.sock", std::process::id());
    let mut node = setup.spawn("shared.log", &["--upgrade-sock", &shared]);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(1));
    let log = node.log_text();
    assert!(
        log.contains(&format!(
            "--upgrade-sock {shared}: its directory is not trusted: /tmp is writable by its group and others (mode 1777); it must be writable by its owner only"
        )),
        "{log}"
    );

    let mut old = setup.start("old.log", &TRUST);
    let new = setup.spawn("new.log", &["--upgrade", TRUST[0], TRUST[1]]);
    let sock = setup.wait_for_upgrade_sock(&new);
    {
        // The socket appears at bind(2) with the umask's mode and is made owner-only right
        // after (its directory already keeps everyone else out): wait for that step.
        use std::os::unix::fs::PermissionsExt;
        let mode = || std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        let start = Instant::now();
        while mode() != 0o600 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(mode(), 0o600);
    }
    let stranger = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["/usr/bin/python3", "-c"])
        .arg(format!(
            "import socket\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect({:?})\n print('connected')\nexcept OSError as e:\n print(type(e).__name__)\n",
            sock.display().to_string()
        ))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&stranger.stdout),
        "PermissionError\n"
    );
    Setup::hand_over(&mut old, &new);
    assert_eq!(count(&new.statuses(6, "a", "10.0.0.1"), 200), 5);
}

/// Issue rows "SIGQUIT with no new process waiting (or one that failed to start)" and "upgrade
/// to a process whose policy file is invalid": the new process exits 1 before asking for the
/// listeners, and the old one, sent SIGQUIT with nobody to hand over to, logs an ERROR, counts
/// it, and keeps serving and enforcing: a tenant refused before is refused after.
#[test]
fn a_failed_upgrade_keeps_the_old_gateway_serving_and_enforcing() {
    let setup = Setup::new(POLICY);
    let old = setup.start("old.log", &TRUST);
    let before = node_statuses(&old, 12);
    assert_eq!(count(&before, 200), 10);
    std::fs::write(setup.dir.path().join("policy.json"), "{\"policies\": [").unwrap();
    let mut new = setup.spawn("new.log", &["--upgrade", TRUST[0], TRUST[1]]);
    assert_eq!(new.wait_exit(Duration::from_secs(20)), Some(1));
    let log = new.log_text();
    assert!(
        log.contains(
            "--upgrade: the policy does not load, so the running gateway keeps its listeners"
        ),
        "{log}"
    );
    assert!(!setup.state().join("upgrade.sock").exists());
    let reached = setup.upstream.hits();
    old.signal(libc::SIGQUIT);
    let start = Instant::now();
    while !old.log_text().contains("upgrade failed, still serving") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}",
            old.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = old.log_text();
    assert!(
        log.contains(&format!(
            "ERROR tollgate::proxy: upgrade failed, still serving: --upgrade-sock {}: no new gateway took the listeners within 10s",
            setup.state().join("upgrade.sock").display()
        )),
        "{log}"
    );
    assert_eq!(
        old.metric("tollgate_upgrade_handover_failures_total{reason=\"no_taker\"}"),
        1.0
    );
    // Still serving, still enforcing: the drained tenant is refused, nothing reaches upstream.
    assert_eq!(node_statuses(&old, 20), [429; 20]);
    assert_eq!(setup.upstream.hits(), reached);
}

/// Statuses of `n` requests of tenant `t` from ten client addresses (so the per-address bucket
/// never refuses first).
fn node_statuses(node: &Node, n: usize) -> Vec<u16> {
    (0..n)
        .flat_map(|i| node.statuses(1, "t", &format!("10.1.0.{}", i % 10 + 1)))
        .collect()
}

/// Issue row "`--state-dir` names a directory another user owns (or one under a shared dir)":
/// refused at start-up (exit 1) with the reason, whether the directory itself belongs to
/// another user, a directory above it does, or one above it is writable by everyone without the
/// sticky bit.
#[test]
fn a_state_dir_another_user_could_touch_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let setup = Setup::new(POLICY);
    let state = setup.state();
    std::fs::create_dir(&state).unwrap();
    std::os::unix::fs::chown(&state, Some(65534), Some(65534)).unwrap();
    let mut node = setup.spawn("owned.log", &TRUST);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(1));
    assert!(
        node.log_text().contains(&format!(
            "--state-dir {}: not trusted: {} is owned by uid 65534, not by this user (uid 0) or root",
            state.display(),
            state.display()
        )),
        "{}",
        node.log_text()
    );
    std::os::unix::fs::chown(&state, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut node = setup.spawn("mode.log", &TRUST);
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(1));
    assert!(
        node.log_text()
            .contains("is writable by its group and others (mode 0777)"),
        "{}",
        node.log_text()
    );
    // Under a directory another user owns: they could rename it away and plant their own.
    let shared = setup.dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&shared, Some(65534), Some(65534)).unwrap();
    let mut node = setup.spawn_with(
        "shared.log",
        &[
            "--state-dir",
            shared.join("state").to_str().unwrap(),
            TRUST[0],
            TRUST[1],
        ],
        false,
    );
    assert_eq!(node.wait_exit(Duration::from_secs(20)), Some(1));
    assert!(
        node.log_text().contains(&format!(
            "{}, above it, is owned by uid 65534, who could replace it",
            shared.display()
        )),
        "{}",
        node.log_text()
    );
}

/// Issue rows "a planted `owner.lock` symlink made the gateway truncate a root-only file" and
/// "a `buckets.state.new` symlink overwrote its target", and "a state file whose header carries
/// a time near 2^64": links are never followed (their targets keep every byte) and the bad file
/// is moved aside with its reason; the gateway serves and enforces.
#[test]
fn symlinks_and_impossible_headers_in_the_state_dir_are_never_believed() {
    let setup = Setup::new(POLICY);
    let precious = setup.dir.path().join("precious");
    std::fs::write(&precious, b"root-only secret\n").unwrap();
    std::fs::create_dir(setup.state()).unwrap();
    std::os::unix::fs::symlink(&precious, setup.state().join("buckets.state.new")).unwrap();
    let node = setup.start("first.log", &TRUST);
    assert_eq!(std::fs::read(&precious).unwrap(), b"root-only secret\n");
    assert_eq!(count(&node.statuses(6, "a", "10.0.0.1"), 200), 5);
    drop(node);

    // The header's latest time near 2^64: moved aside, not trusted to freeze time.
    let file = setup.state().join("buckets.state");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[80..88].copy_from_slice(&(u64::MAX - 7).to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let node = setup.start("second.log", &TRUST);
    let log = node.log_text();
    assert!(
        log.contains("state file unusable (header time 18446744073709551608 µs lies beyond the file's time base (2054)); moved aside"),
        "{log}"
    );
    assert_eq!(count(&node.statuses(6, "a", "10.0.0.1"), 200), 5);
    drop(node);

    // A planted lock-file link: refused, its target untouched; buckets in process memory.
    std::fs::remove_file(setup.state().join("owner.lock")).unwrap();
    std::os::unix::fs::symlink(&precious, setup.state().join("owner.lock")).unwrap();
    let node = setup.start("third.log", &TRUST);
    assert_eq!(std::fs::read(&precious).unwrap(), b"root-only secret\n");
    let log = node.log_text();
    assert!(log.contains("cannot open the lock file"), "{log}");
    assert_eq!(node.metric("tollgate_state_dir_fallback"), 1.0);
}

/// An upgrade whose new process cannot put every listener in place (here a `--grpc-listen`
/// address added by the upgrade, whose port is taken) never confirms: it binds what it was not
/// handed before it starts serving, stops with exit 1 and one ERROR line naming the address,
/// and the old gateway, which had handed its sockets over, keeps serving them.
#[test]
fn an_upgrade_missing_a_listener_never_confirms_and_the_old_gateway_keeps_serving() {
    let setup = Setup::new(POLICY);
    let old = setup.start("old.log", &TRUST);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let grpc = taken.local_addr().unwrap().to_string();
    let mut new = setup.spawn(
        "new.log",
        &["--upgrade", TRUST[0], TRUST[1], "--grpc-listen", &grpc],
    );
    setup.wait_for_upgrade_sock(&new);
    old.signal(libc::SIGQUIT);
    assert_eq!(new.wait_exit(Duration::from_secs(40)), Some(1));
    // It stops as soon as it finds the address taken, with one ERROR line naming it.
    let log = new.log_text();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert_eq!(errors.len(), 1, "{log}");
    assert!(
        errors[0].ends_with(&format!(
            "ERROR tollgate::proxy: --grpc-listen {grpc}: cannot listen: Address already in use (os error 98)"
        )),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    let start = Instant::now();
    while !old.log_text().contains("upgrade failed, still serving") {
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "{}",
            old.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        old.log_text().contains(
            "the new gateway took the listeners but did not confirm that it serves within 30s"
        ),
        "{}",
        old.log_text()
    );
    assert_eq!(
        old.metric("tollgate_upgrade_handover_failures_total{reason=\"unconfirmed\"}"),
        1.0
    );
    // The sockets it handed over are still its own: it serves and enforces on them.
    assert_eq!(count(&old.statuses(6, "a", "10.0.0.1"), 200), 5);
    drop(taken);
}

/// An upgrade that adds a listener the old gateway did not have (a free `--grpc-listen`
/// address) binds it itself beside the sockets it is handed, and serves on all of them once the
/// old process has exited.
#[test]
fn an_upgrade_adding_a_listener_binds_it_and_serves_on_every_one() {
    let setup = Setup::new(POLICY);
    let mut old = setup.start("old.log", &TRUST);
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    assert_eq!(http2_first_frame_type(grpc), None);
    let new = setup.upgrade(
        &mut old,
        &[TRUST[0], TRUST[1], "--grpc-listen", &grpc.to_string()],
    );
    assert_eq!(http2_first_frame_type(grpc), Some(4), "{}", new.log_text());
    assert_eq!(
        count(&new.statuses(6, "a", "10.0.0.1"), 200),
        5,
        "{}",
        new.log_text()
    );
    assert!(
        new.log_text().contains(&format!(
            "INFO tollgate::proxy: listening flag=\"--grpc-listen\" addr={grpc}"
        )),
        "{}",
        new.log_text()
    );
}
