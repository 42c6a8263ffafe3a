//! HTTPS and HTTP/2 at the edge against the real binary: curl over TLS with HTTP/2 and
//! HTTP/1.1 (limits and RateLimit headers on each), SNI choosing among certificates,
//! certificate rotation without a restart (and a bad pair never replacing a good one), h2c,
//! 100 concurrent streams on one HTTP/2 connection counted exactly, and access-log lines.
//! Certificates: `tests/fixtures/tls` (a test CA and leaves it signed).

use crate::support;

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use support::{free_port, h2c_burst, Gateway, Upstream};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

fn fixture_str(name: &str) -> String {
    fixture(name).display().to_string()
}

/// A gateway with a cleartext `--listen` (`gw.proxy`) and a TLS listener (returned).
fn tls_gateway(
    policy: &str,
    upstream: &Upstream,
    pairs: &[(&str, &str)],
    extra: &[&str],
) -> (Gateway, SocketAddr) {
    let tls: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut args: Vec<String> = vec!["--listen-tls".into(), tls.to_string()];
    for (cert, key) in pairs {
        args.extend([
            "--tls-cert".into(),
            cert.to_string(),
            "--tls-key".into(),
            key.to_string(),
        ]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = Gateway::start(Some(policy), Some(upstream.addr), &args);
    gw.wait_until(Duration::from_secs(20), || TcpStream::connect(tls).is_ok());
    (gw, tls)
}

/// What curl saw: HTTP version, status, and the response headers (lower-case names).
struct CurlResponse {
    version: String,
    status: u16,
    headers: Vec<(String, String)>,
}

impl CurlResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `curl` to `https://<name>:<port>/<path>` resolved to `addr`, trusting the test CA.
fn curl(http: &str, name: &str, addr: SocketAddr, path: &str) -> CurlResponse {
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-D",
            "-",
            "-w",
            "%{http_version} %{http_code}",
            http,
        ])
        .arg("--cacert")
        .arg(fixture("ca.pem"))
        .arg("--resolve")
        .arg(format!("{name}:{}:{}", addr.port(), addr.ip()))
        .arg(format!("https://{name}:{}{path}", addr.port()))
        .output()
        .expect("curl is not installed: run `bash scripts/test.sh`");
    assert!(
        out.status.success(),
        "curl {http} {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, tail) = text.rsplit_once('\n').unwrap_or(("", &text));
    let mut parts = tail.split_whitespace();
    let version = parts.next().unwrap_or("").to_string();
    let status = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    CurlResponse {
        version,
        status,
        headers,
    }
}

const PER_IP: &str = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
    "algorithm_config": {"rps": 0.001, "burst": 3}}]}"#;

#[test]
fn https_with_http2_and_http1_carries_limits_and_headers() {
    let upstream = Upstream::start();
    let (_gw, tls) = tls_gateway(
        PER_IP,
        &upstream,
        &[(&fixture_str("api.pem"), &fixture_str("api.key"))],
        &[],
    );
    let first = curl("--http2", "api.example.com", tls, "/v1/orders");
    assert_eq!((first.version.as_str(), first.status), ("2", 200));
    assert_eq!(
        first.header("ratelimit-policy"),
        Some("\"per-ip\";q=3;w=3000")
    );
    assert_eq!(first.header("ratelimit-remaining"), Some("2"));
    let second = curl("--http1.1", "api.example.com", tls, "/v1/orders");
    assert_eq!((second.version.as_str(), second.status), ("1.1", 200));
    assert_eq!(second.header("ratelimit-remaining"), Some("1"));
    assert_eq!(curl("--http2", "localhost", tls, "/").status, 200);
    for http in ["--http2", "--http1.1"] {
        let refused = curl(http, "api.example.com", tls, "/v1/orders");
        assert_eq!(refused.status, 429, "{http}");
        assert_eq!(
            refused.header("x-tollgate-reason"),
            Some("token_bucket_exceeded")
        );
        assert_eq!(refused.header("ratelimit"), Some("\"per-ip\";r=0;t=1000"));
        assert!(refused.header("retry-after").is_some());
    }
    assert_eq!(upstream.hits(), 3);
}

/// The certificate the listener serves for `sni`, as PEM (openssl s_client).
fn served_certificate(addr: SocketAddr, sni: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {addr} -servername {sni} </dev/null 2>/dev/null | openssl x509"
        ))
        .output()
        .expect("openssl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn pem(name: &str) -> String {
    std::fs::read_to_string(fixture(name)).unwrap()
}

#[test]
fn sni_picks_the_certificate_by_its_names() {
    let upstream = Upstream::start();
    let (_gw, tls) = tls_gateway(
        PER_IP,
        &upstream,
        &[
            (&fixture_str("api.pem"), &fixture_str("api.key")),
            (&fixture_str("wildcard.pem"), &fixture_str("wildcard.key")),
        ],
        &[],
    );
    assert_eq!(
        served_certificate(tls, "shop.example.org"),
        pem("wildcard.pem")
    );
    assert_eq!(served_certificate(tls, "api.example.com"), pem("api.pem"));
    // No certificate names it: the first pair is the default.
    assert_eq!(
        served_certificate(tls, "unknown.example.net"),
        pem("api.pem")
    );
    // And curl, verifying the name, is happy with each.
    assert_eq!(curl("--http2", "shop.example.org", tls, "/").status, 200);
    assert_eq!(curl("--http2", "api.example.com", tls, "/").status, 200);
}

#[test]
fn certificates_rotate_without_a_restart_and_a_bad_pair_never_replaces_a_good_one() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("site.pem");
    let key = dir.path().join("site.key");
    std::fs::copy(fixture("api.pem"), &cert).unwrap();
    std::fs::copy(fixture("api.key"), &key).unwrap();
    let (gw, tls) = tls_gateway(
        PER_IP,
        &upstream,
        &[(&cert.display().to_string(), &key.display().to_string())],
        &["--policy-poll-secs", "1"],
    );
    assert_eq!(served_certificate(tls, "localhost"), pem("api.pem"));
    // Half a rotation (the new key, the old certificate): refused, the old pair stays.
    std::fs::copy(fixture("other.key"), &key).unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_until(Duration::from_secs(10), || {
        gw.log_text().contains("TLS certificate reload rejected")
    });
    assert!(gw
        .log_text()
        .contains("this key does not belong to the certificate in"));
    assert_eq!(served_certificate(tls, "localhost"), pem("api.pem"));
    assert_eq!(curl("--http2", "localhost", tls, "/").status, 200);
    // The certificate follows: picked up from the file change, no signal, no restart.
    std::fs::copy(fixture("other.pem"), &cert).unwrap();
    gw.wait_until(Duration::from_secs(10), || {
        served_certificate(tls, "localhost") == pem("other.pem")
    });
    assert_eq!(curl("--http1.1", "localhost", tls, "/").status, 200);
}

#[test]
fn an_unusable_certificate_stops_start_up_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, PER_IP).unwrap();
    let port = free_port().to_string();
    let admin = format!("127.0.0.1:{}", free_port());
    for (cert, key, expected) in [
        (
            "api.pem",
            "other.key",
            "other.key: this key does not belong to the certificate in",
        ),
        (
            "api.key",
            "api.key",
            "api.key: no PEM certificate in the file",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["run", "--policy"])
            .arg(&policy)
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--upstream",
                "127.0.0.1:9",
                "--admin-listen",
                &admin,
            ])
            .args([
                "--tls-cert",
                &fixture_str(cert),
                "--tls-key",
                &fixture_str(key),
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{err}");
    }
    // Pairs must pair up.
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--tls-cert", &fixture_str("api.pem")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--tls-cert given 1 time(s) and --tls-key 0 time(s)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hundred_streams_on_one_connection_are_one_hundred_requests() {
    let upstream = Upstream::start();
    let policy = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
        "algorithm_config": {"rps": 0.001, "burst": 30}}]}"#;
    let gw = Gateway::start(Some(policy), Some(upstream.addr), &["--h2c"]);
    let statuses = h2c_burst(gw.proxy, 100, &[]).await;
    assert_eq!(statuses.len(), 100);
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        30,
        "{statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 70);
    assert_eq!(upstream.hits(), 30);
    // HTTP/1.1 still works on the same listener.
    assert_eq!(gw.get("/", &[]).status, 429);
}

#[test]
fn h2c_is_opt_in() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(PER_IP), Some(upstream.addr), &[]);
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version}",
            "--max-time",
            "5",
            "--http2-prior-knowledge",
        ])
        .arg(format!("http://{}/", gw.proxy))
        .output()
        .unwrap();
    // Without --h2c the preface is not HTTP/1.1: curl gets no HTTP/2 answer.
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let gw = Gateway::start(Some(PER_IP), Some(upstream.addr), &["--h2c"]);
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
            "--http2-prior-knowledge",
        ])
        .arg(format!("http://{}/", gw.proxy))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "2 200");
}

#[test]
fn access_log_lines_parse_and_carry_the_verdict() {
    let upstream = Upstream::start();
    let policy = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
        "algorithm_config": {"rps": 0.001, "burst": 1}}]}"#;
    let (gw, tls) = tls_gateway(
        policy,
        &upstream,
        &[(&fixture_str("api.pem"), &fixture_str("api.key"))],
        &["--access-log", "json"],
    );
    let allowed = curl("--http2", "api.example.com", tls, "/v1/a?token=sekrit");
    assert_eq!(allowed.status, 200);
    let id = allowed
        .header("x-request-id")
        .expect("a generated request id")
        .to_string();
    let refused = support::request(
        gw.proxy,
        "GET",
        "/v1/b",
        &[
            ("X-Request-Id", "req-77"),
            ("Referer", "https://shop.test/reset?token=abc"),
        ],
    );
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-request-id"), Some("req-77"));
    gw.wait_until(Duration::from_secs(5), || {
        gw.stdout_text().lines().count() == 2
    });
    let lines: Vec<serde_json::Value> = gw
        .stdout_text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let allowed = &lines[0];
    assert_eq!(allowed["protocol"], "HTTP/2");
    assert_eq!(allowed["status"], 200);
    assert_eq!(allowed["verdict"], "allow");
    assert_eq!(allowed["path"], "/v1/a?token=***");
    assert_eq!(allowed["host"], format!("api.example.com:{}", tls.port()));
    assert_eq!(allowed["upstream"], upstream.addr.to_string());
    assert_eq!(allowed["client_ip"], "127.0.0.1");
    assert_eq!(allowed["request_id"].as_str(), Some(id.as_str()));
    assert_eq!(id.len(), 32);
    assert!(allowed["upstream_time"].as_f64().is_some());
    let refused = &lines[1];
    assert_eq!(refused["protocol"], "HTTP/1.1");
    assert_eq!(refused["status"], 429);
    assert_eq!(refused["verdict"], "token_bucket_exceeded");
    assert_eq!(refused["rule"], "per-ip");
    assert_eq!(refused["request_id"], "req-77");
    assert_eq!(refused["upstream"], serde_json::Value::Null);
    assert_eq!(refused["bytes"], 17);
    assert_eq!(refused["referer"], "https://shop.test/reset?token=***");
}

/// A TLS client offering only `h2` that completes the handshake and then says nothing.
async fn silent_h2_over_tls(
    addr: SocketAddr,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut std::fs::read(fixture("ca.pem")).unwrap().as_slice()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("api.example.com").unwrap();
    let tls = connector.connect(name, tcp).await.expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    tls
}

/// Reads until the server closes the connection; panics if it is still open after `limit`.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(mut stream: S, limit: Duration) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection is still open after {limit:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_http2_connections_are_cut_at_the_header_deadline() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start();
    let (gw, tls) = tls_gateway(
        PER_IP,
        &upstream,
        &[(&fixture_str("api.pem"), &fixture_str("api.key"))],
        &["--h2c", "--header-timeout-secs", "1"],
    );
    // HTTP/2 negotiated by ALPN, then silence.
    let started = std::time::Instant::now();
    closed_within(silent_h2_over_tls(tls).await, Duration::from_secs(5)).await;
    assert!(started.elapsed() >= Duration::from_millis(900));
    // The h2c preface, then silence.
    let mut h2c = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    h2c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    closed_within(h2c, Duration::from_secs(5)).await;
    // Half an HTTP/1.1 header on the h2c listener: the header deadline still applies.
    let mut h1 = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    h1.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    closed_within(h1, Duration::from_secs(5)).await;
    // A connection that does send a request is served.
    assert_eq!(curl("--http2", "api.example.com", tls, "/").status, 200);
}
