//! Start-up either serves or fails, against the real binary: each listener kind (the proxy's
//! `--listen`, HTTPS on `--listen` and on `--listen-tls`, `--admin-listen`, `--grpc-listen`)
//! whose port is already taken stops start-up with exit code 1 and one ERROR line naming the
//! flag, the address and the system's reason, with no panic; `--bind-retry` waits instead,
//! serves once the port is free, and `/readyz` cannot be reached while it waits.

use crate::support;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{free_port, one_rule, request, try_request, Upstream};

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
        .display()
        .to_string()
}

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// A `tollgate run` child writing its standard error to a file.
struct Run {
    child: Child,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

impl Run {
    /// Starts `tollgate run --policy P --threads 1 ARGS...`.
    fn spawn(args: &[String]) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("policy.json");
        std::fs::write(&policy, one_rule("per-ip", r#"["ip:address"]"#, 1.0, 100.0)).unwrap();
        let log = dir.path().join("stderr.log");
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("run")
            .arg("--policy")
            .arg(&policy)
            .args(["--threads", "1"])
            .args(args)
            .env_remove("RUST_LOG")
            .env_remove("RUST_BACKTRACE")
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        Run {
            child,
            _dir: dir,
            log,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit code, waiting at most `limit` (the process is killed past it, and the test
    /// fails).
    fn exit_code(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!("still running after {limit:?}; stderr:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls `ready` every 50 ms until it holds; fails after `limit` with the stderr.
    fn wait_until(&self, limit: Duration, mut ready: impl FnMut() -> bool) {
        let start = Instant::now();
        while !ready() {
            assert!(
                start.elapsed() < limit,
                "not within {limit:?}; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// Takes `taken`'s port first, starts the gateway with `args`, and checks it stops at once:
/// exit code 1, exactly one ERROR line (naming `flag` and the address, and that it is in use),
/// and no panic or backtrace.
fn assert_refused(flag: &str, taken: SocketAddr, args: &[String]) {
    let blocker = TcpListener::bind(taken).unwrap();
    let mut run = Run::spawn(args);
    // Bounded: it stops before serving anything (Pingora's own retries took 30 s).
    assert_eq!(
        run.exit_code(Duration::from_secs(20)),
        Some(1),
        "{}",
        run.stderr()
    );
    let stderr = run.stderr();
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].ends_with(&format!(
            "ERROR tollgate::proxy: {flag} {taken}: cannot listen: Address already in use (os error 98)"
        )),
        "{stderr}"
    );
    // The same line once more for whoever reads the terminal, without the log prefix.
    assert!(
        stderr.lines().any(|l| l
            == format!(
                "tollgate: {flag} {taken}: cannot listen: Address already in use (os error 98)"
            )),
        "{stderr}"
    );
    for never in [
        "panicked",
        "backtrace",
        "will try again",
        // The line each bound listener gets once every listener is bound: never written.
        "listening flag=",
    ] {
        assert!(!stderr.contains(never), "{never:?} in:\n{stderr}");
    }
    drop(blocker);
}

#[test]
fn a_proxy_listener_in_use_stops_start_up() {
    let upstream = Upstream::start();
    let (proxy, admin) = (loopback(), loopback());
    assert_refused(
        "--listen",
        proxy,
        &strings(&[
            "--listen",
            &proxy.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--upstream",
            &upstream.addr.to_string(),
        ]),
    );
}

#[test]
fn an_https_listener_in_use_stops_start_up() {
    let upstream = Upstream::start();
    let (proxy, tls, admin) = (loopback(), loopback(), loopback());
    let (cert, key) = (fixture("api.pem"), fixture("api.key"));
    // A TLS listener beside the cleartext one.
    assert_refused(
        "--listen-tls",
        tls,
        &strings(&[
            "--listen",
            &proxy.to_string(),
            "--listen-tls",
            &tls.to_string(),
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--admin-listen",
            &admin.to_string(),
            "--upstream",
            &upstream.addr.to_string(),
        ]),
    );
    // HTTPS on --listen itself.
    assert_refused(
        "--listen",
        proxy,
        &strings(&[
            "--listen",
            &proxy.to_string(),
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--admin-listen",
            &admin.to_string(),
            "--upstream",
            &upstream.addr.to_string(),
        ]),
    );
}

#[test]
fn an_admin_listener_in_use_stops_start_up() {
    let upstream = Upstream::start();
    let (proxy, admin) = (loopback(), loopback());
    // With a proxy in front of an upstream, and as a decision service alone.
    assert_refused(
        "--admin-listen",
        admin,
        &strings(&[
            "--listen",
            &proxy.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--upstream",
            &upstream.addr.to_string(),
        ]),
    );
    assert_refused(
        "--admin-listen",
        admin,
        &strings(&["--admin-listen", &admin.to_string()]),
    );
}

#[test]
fn a_grpc_listener_in_use_stops_start_up() {
    let (grpc, admin) = (loopback(), loopback());
    assert_refused(
        "--grpc-listen",
        grpc,
        &strings(&[
            "--admin-listen",
            &admin.to_string(),
            "--grpc-listen",
            &grpc.to_string(),
        ]),
    );
}

/// `--bind-retry` keeps today's wait: the address in use is tried again once a second (a WARN
/// line each time); meanwhile the admin listener (bound last) is not even open, so `/readyz`
/// is not 200; once the port is free the gateway binds it, says ready and proxies.
#[test]
fn bind_retry_waits_for_the_port_and_then_serves() {
    let upstream = Upstream::start();
    let (proxy, admin) = (loopback(), loopback());
    let blocker = TcpListener::bind(proxy).unwrap();
    let run = Run::spawn(&strings(&[
        "--listen",
        &proxy.to_string(),
        "--admin-listen",
        &admin.to_string(),
        "--upstream",
        &upstream.addr.to_string(),
        "--bind-retry",
    ]));
    let retrying = format!(
        "WARN tollgate::proxy::bind: --listen {proxy}: in use, will try again in 1s (--bind-retry, try 1 of 30)"
    );
    run.wait_until(Duration::from_secs(20), || run.stderr().contains(&retrying));
    // Waiting: the admin listener is not bound yet, so nothing answers /readyz.
    let early = try_request(admin, "GET", "/readyz", &[]);
    assert!(
        early.is_err(),
        "/readyz answered while --listen was not bound: {:?}",
        early.map(|r| r.status)
    );
    drop(blocker);
    run.wait_until(Duration::from_secs(20), || {
        try_request(admin, "GET", "/readyz", &[]).is_ok_and(|r| r.status == 200)
    });
    let served = request(proxy, "GET", "/hello", &[]);
    assert_eq!(served.status, 200, "{}", run.stderr());
    assert!(served.body.starts_with("upstream ok"), "{}", served.body);
    assert_eq!(upstream.hits(), 1);
    let stderr = run.stderr();
    assert!(!stderr.contains(" ERROR "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
