//! Routes and upstream groups against real servers on loopback: routing by host and path,
//! health checks moving traffic off a killed server (no client errors) and back when it
//! returns, a 502 with a clear body when a whole group is down, HTTPS upstreams verified against
//! a CA file (and refused when untrusted), gateway-file errors and reloads.

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::{free_port, Gateway, Upstream};

/// An HTTP/1.1 server answering `200 <name>` (and `/healthz`), that can be stopped and
/// started again on the same port.
struct Server {
    name: &'static str,
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    /// The listener and the connections still open: [`Server::kill`] waits for both to go.
    alive: Arc<AtomicUsize>,
}

impl Server {
    fn start(name: &'static str) -> Server {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let server = Server {
            name,
            addr,
            hits: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            alive: Arc::new(AtomicUsize::new(0)),
        };
        server.run();
        server
    }

    fn run(&self) {
        self.stop.store(false, Ordering::SeqCst);
        let listener = TcpListener::bind(self.addr).expect("bind test server");
        listener.set_nonblocking(true).unwrap();
        let (name, hits, stop) = (self.name, Arc::clone(&self.hits), Arc::clone(&self.stop));
        let alive = Arc::clone(&self.alive);
        // Counted before `run` returns, so a `kill` right after waits for this listener too.
        alive.fetch_add(1, Ordering::SeqCst);
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (hits, stop, alive) =
                            (Arc::clone(&hits), Arc::clone(&stop), Arc::clone(&alive));
                        alive.fetch_add(1, Ordering::SeqCst);
                        std::thread::spawn(move || {
                            serve(conn, name, &hits, &stop);
                            alive.fetch_sub(1, Ordering::SeqCst);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            // Connections are refused from now on.
            drop(listener);
            alive.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// Stops accepting and closes every connection: returns once the listener and every
    /// connection are closed (panics after 5 s).
    fn kill(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let start = std::time::Instant::now();
        while self.alive.load(Ordering::SeqCst) > 0 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "server {} still has its listener or a connection open",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

fn serve(conn: TcpStream, name: &str, hits: &AtomicUsize, stop: &AtomicBool) {
    let _ = conn.set_read_timeout(Some(Duration::from_millis(50)));
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut writer = conn;
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(_) => {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                continue;
            }
        }
        let health = line.starts_with("GET /healthz");
        loop {
            let mut header = String::new();
            match reader.read_line(&mut header) {
                Ok(0) => return,
                Ok(_) if header.trim().is_empty() => break,
                Ok(_) => {}
                Err(_) if stop.load(Ordering::SeqCst) => return,
                Err(_) => {}
            }
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if !health {
            hits.fetch_add(1, Ordering::SeqCst);
        }
        let body = if health { "ok" } else { name };
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if writer.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

const OPEN: &str = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
    "algorithm_config": {"rps": 1000, "burst": 1000}}]}"#;

fn gateway_with_routes(routes: &str) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.json");
    std::fs::write(&file, routes).unwrap();
    let gw = Gateway::start(
        Some(OPEN),
        None,
        &[
            "--routes",
            file.to_str().unwrap(),
            "--policy-poll-secs",
            "1",
        ],
    );
    gw.wait_until(Duration::from_secs(20), || {
        TcpStream::connect(gw.proxy).is_ok()
    });
    // Keep the file's directory alive with the gateway.
    std::mem::forget(dir);
    gw
}

fn get(gw: &Gateway, host: &str, path: &str) -> (u16, String) {
    let r = support::request(gw.proxy, "GET", path, &[("Host", host)]);
    (r.status, r.body)
}

#[test]
fn routes_pick_groups_by_host_and_path() {
    let (api, v2, web, other) = (
        Server::start("api"),
        Server::start("v2"),
        Server::start("web"),
        Server::start("other"),
    );
    let gw = gateway_with_routes(&format!(
        r#"{{"upstreams": {{
              "api": {{"servers": ["{}"]}}, "v2": {{"servers": ["{}"]}},
              "web": {{"servers": ["{}"]}}, "other": {{"servers": ["{}"]}} }},
            "routes": [
              {{"host": "api.example.com", "upstream": "api"}},
              {{"host": "api.example.com", "path_prefix": "/v2", "upstream": "v2"}},
              {{"host": "*.example.com", "upstream": "web"}} ],
            "default_upstream": "other"}}"#,
        api.addr, v2.addr, web.addr, other.addr
    ));
    assert_eq!(
        get(&gw, "api.example.com", "/v1/orders"),
        (200, "api".into())
    );
    assert_eq!(
        get(&gw, "api.example.com:8443", "/v2/orders"),
        (200, "v2".into())
    );
    // Segment-wise, and after normalisation (as the limiter sees paths).
    assert_eq!(get(&gw, "api.example.com", "/v2x"), (200, "api".into()));
    assert_eq!(
        get(&gw, "api.example.com", "/x/../v2/y"),
        (200, "v2".into())
    );
    assert_eq!(get(&gw, "shop.example.com", "/"), (200, "web".into()));
    assert_eq!(get(&gw, "elsewhere.test", "/"), (200, "other".into()));
    assert_eq!(
        (api.hits(), v2.hits(), web.hits(), other.hits()),
        (2, 2, 1, 1)
    );
}

#[test]
fn a_killed_server_loses_its_traffic_without_client_errors_and_gets_it_back() {
    let (a, b) = (Server::start("a"), Server::start("b"));
    let gw = gateway_with_routes(&format!(
        r#"{{"upstreams": {{"pool": {{"servers": ["{}", "{}"],
              "health_check": {{"path": "/healthz", "interval_ms": 200, "timeout_ms": 200,
                                "healthy_threshold": 1, "unhealthy_threshold": 1}} }} }},
            "default_upstream": "pool"}}"#,
        a.addr, b.addr
    ));
    for _ in 0..10 {
        assert_eq!(get(&gw, "x", "/").0, 200);
    }
    assert_eq!((a.hits(), b.hits()), (5, 5));
    b.kill();
    // From the very first request after the kill: no client error (a refused connection is
    // retried on the other server, and the dead one is ejected).
    for i in 0..20 {
        let (status, body) = get(&gw, "x", "/");
        assert_eq!(
            (status, body.as_str()),
            (200, "a"),
            "request {i} after the kill"
        );
    }
    assert_eq!(b.hits(), 5);
    // Back: the health check finds it within an interval or two.
    b.run();
    gw.wait_until(Duration::from_secs(10), || get(&gw, "x", "/").1 == "b");
    // Both servers kill: a clear 502, at once.
    a.kill();
    b.kill();
    // Once the health checks have ejected both...
    gw.wait_until(Duration::from_secs(10), || {
        get(&gw, "x", "/")
            .1
            .starts_with("Bad Gateway: no healthy server")
    });
    // ...the next request is answered at once.
    let started = std::time::Instant::now();
    let (status, body) = get(&gw, "x", "/");
    assert_eq!(status, 502);
    assert_eq!(
        body,
        "Bad Gateway: no healthy server in this route's upstream group\n"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn https_upstreams_are_verified_against_the_ca_file() {
    // The HTTPS upstream: a second tollgate terminating TLS with the test certificate in front
    // of a plain upstream.
    let origin = Upstream::start();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    let cert = fixtures.join("api.pem");
    let key = fixtures.join("api.key");
    let tls_front = Gateway::start(
        Some(OPEN),
        Some(origin.addr),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let routes = format!(
        r#"{{"upstreams": {{
              "trusted": {{"servers": ["{front}"], "tls": {{"sni": "api.example.com", "ca_file": "{ca}"}}}},
              "wrong-name": {{"servers": ["{front}"], "tls": {{"sni": "www.example.net", "ca_file": "{ca}"}}}},
              "system-roots": {{"servers": ["{front}"], "tls": {{"sni": "api.example.com"}}}} }},
            "routes": [
              {{"path_prefix": "/trusted", "upstream": "trusted"}},
              {{"path_prefix": "/wrong-name", "upstream": "wrong-name"}},
              {{"path_prefix": "/system-roots", "upstream": "system-roots"}} ]}}"#,
        front = tls_front.proxy,
        ca = fixtures.join("ca.pem").display()
    );
    let gw = gateway_with_routes(&routes);
    let (status, body) = get(&gw, "x", "/trusted/a");
    assert_eq!(status, 200);
    assert!(body.starts_with("upstream ok"), "{body}");
    // A certificate for another name, or a CA the system does not trust: refused.
    assert_eq!(get(&gw, "x", "/wrong-name/a").0, 502);
    assert_eq!(get(&gw, "x", "/system-roots/a").0, 502);
    assert_eq!(origin.hits(), 1);
}

#[test]
fn a_bad_gateway_file_never_replaces_a_good_one() {
    let (a, b) = (Server::start("a"), Server::start("b"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.json");
    let routes = |server: SocketAddr| {
        format!(
            r#"{{"upstreams": {{"only": {{"servers": ["{server}"]}}}}, "default_upstream": "only"}}"#
        )
    };
    std::fs::write(&file, routes(a.addr)).unwrap();
    let gw = Gateway::start(
        Some(OPEN),
        None,
        &[
            "--routes",
            file.to_str().unwrap(),
            "--policy-poll-secs",
            "1",
        ],
    );
    gw.wait_until(Duration::from_secs(20), || {
        TcpStream::connect(gw.proxy).is_ok()
    });
    assert_eq!(get(&gw, "x", "/").1, "a");
    support::write_atomically(
        &file,
        r#"{"upstreams": {"only": {"servers": []}}, "default_upstream": "only"}"#,
    );
    gw.wait_until(Duration::from_secs(10), || {
        gw.log_text().contains("routes reload rejected")
    });
    assert!(gw
        .log_text()
        .contains("upstreams.only.servers: must be a non-empty array of HOST:PORT"));
    assert_eq!(get(&gw, "x", "/").1, "a");
    // A good file: picked up without a restart (and on SIGHUP as well).
    support::write_atomically(&file, &routes(b.addr));
    gw.wait_until(Duration::from_secs(10), || get(&gw, "x", "/").1 == "b");
}

#[test]
fn gateway_files_are_validated_with_every_error_and_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.json");
    std::fs::write(
        &file,
        r#"{"upstreams": {"api": {"servers": ["127.0.0.1:1"], "balance": "fastest"}},
            "routes": [{"upstream": "nope"}]}"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["validate", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("upstreams.api.balance: must be \"round_robin\" or \"client_hash\""),
        "{err}"
    );
    assert!(
        err.contains("routes[0].upstream: no upstream group named \"nope\""),
        "{err}"
    );
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, OPEN).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "run",
            "--policy",
            policy.to_str().unwrap(),
            "--routes",
            file.to_str().unwrap(),
        ])
        .args([
            "--admin-listen",
            &format!("127.0.0.1:{}", free_port()),
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("routes[0].upstream: no upstream group named \"nope\""));
    // And a good one validates.
    std::fs::write(
        &file,
        r#"{"upstreams": {"api": {"servers": ["127.0.0.1:1"]}}, "default_upstream": "api"}"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["validate", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout)
        .contains("ok (gateway file: 1 upstream groups, 0 routes"));
}

#[test]
fn without_health_checks_a_refused_connection_ejects_the_server_and_retries_elsewhere() {
    let (a, b) = (Server::start("a"), Server::start("b"));
    let gw = gateway_with_routes(&format!(
        r#"{{"upstreams": {{"pool": {{"servers": ["{}", "{}"]}}}}, "default_upstream": "pool"}}"#,
        a.addr, b.addr
    ));
    for _ in 0..4 {
        assert_eq!(get(&gw, "x", "/").0, 200);
    }
    assert_eq!((a.hits(), b.hits()), (2, 2));
    b.kill();
    for i in 0..10 {
        assert_eq!(
            get(&gw, "x", "/"),
            (200, "a".to_string()),
            "request {i} after the kill"
        );
    }
    assert!(gw
        .log_text()
        .contains("upstream server ejected after consecutive connection failures"));
    assert_eq!(a.hits(), 12);
}

#[test]
fn client_hash_keeps_each_client_on_one_server_and_spreads_clients() {
    let (a, b) = (Server::start("a"), Server::start("b"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.json");
    std::fs::write(
        &file,
        format!(
            r#"{{"upstreams": {{"pool": {{"servers": ["{}", "{}"], "balance": "client_hash"}}}},
                "default_upstream": "pool"}}"#,
            a.addr, b.addr
        ),
    )
    .unwrap();
    let gw = Gateway::start(
        Some(OPEN),
        None,
        &[
            "--routes",
            file.to_str().unwrap(),
            "--trusted-proxy",
            "127.0.0.1/32",
        ],
    );
    gw.wait_until(Duration::from_secs(20), || {
        TcpStream::connect(gw.proxy).is_ok()
    });
    // The key is the client address as resolved for limiting (behind the trusted proxy).
    let server_of =
        |client: &str| support::request(gw.proxy, "GET", "/", &[("X-Forwarded-For", client)]).body;
    let mut used = std::collections::BTreeSet::new();
    for i in 0..40 {
        let client = format!("203.0.113.{i}");
        let first = server_of(&client);
        for _ in 0..3 {
            assert_eq!(server_of(&client), first, "client {client} moved");
        }
        used.insert(first);
    }
    assert_eq!(used.len(), 2, "40 clients all on one server");
}

/// An upstream answering every request with the request's header lines as it received them
/// (`name: value`, one a line, names lower-cased), plus `X-Upstream-Secret: 1` and
/// `X-Upstream-Kept: 1` on the response.
fn header_echo() -> SocketAddr {
    support::origin::Origin::start(|request: &support::origin::OriginRequest| {
        let body: String = request
            .headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}\n"))
            .collect();
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Upstream-Secret: 1\r\nX-Upstream-Kept: 1\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    })
    .addr
}

/// The values of one header the upstream received (from [`header_echo`]'s body).
fn received<'a>(body: &'a str, name: &str) -> Vec<&'a str> {
    body.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(n, _)| *n == name)
        .map(|(_, v)| v)
        .collect()
}

/// By default the upstream is told the scheme, host and port the client used; what a client
/// claims under those names (and any `Forwarded` it sends) is replaced unless the client is a
/// `--trusted-proxy`, whose values are kept.
#[test]
fn forwarding_headers_are_added_and_kept_only_from_trusted_proxies() {
    let echo = header_echo();
    let spoofed = [
        ("Host", "shop.example.com"),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "admin.internal"),
        ("X-Forwarded-Port", "443"),
        ("Forwarded", "for=10.9.9.9;proto=https"),
    ];
    let gw = Gateway::start(Some(OPEN), Some(echo), &[]);
    let r = support::request(gw.proxy, "GET", "/v1/x", &spoofed);
    assert_eq!(r.status, 200);
    let port = gw.proxy.port().to_string();
    assert_eq!(
        received(&r.body, "x-forwarded-proto"),
        vec!["http"],
        "{}",
        r.body
    );
    assert_eq!(
        received(&r.body, "x-forwarded-host"),
        vec!["shop.example.com"]
    );
    assert_eq!(received(&r.body, "x-forwarded-port"), vec![port.as_str()]);
    assert!(received(&r.body, "forwarded").is_empty(), "{}", r.body);
    drop(gw);

    let gw = Gateway::start(Some(OPEN), Some(echo), &["--trusted-proxy", "127.0.0.0/8"]);
    let r = support::request(gw.proxy, "GET", "/v1/x", &spoofed);
    assert_eq!(
        received(&r.body, "x-forwarded-proto"),
        vec!["https"],
        "{}",
        r.body
    );
    assert_eq!(
        received(&r.body, "x-forwarded-host"),
        vec!["admin.internal"]
    );
    assert_eq!(received(&r.body, "x-forwarded-port"), vec!["443"]);
    assert_eq!(
        received(&r.body, "forwarded"),
        vec!["for=10.9.9.9;proto=https"]
    );
    // Without them, the trusted proxy's request gets the gateway's own.
    let port = gw.proxy.port().to_string();
    let r = support::request(gw.proxy, "GET", "/v1/x", &[]);
    assert_eq!(received(&r.body, "x-forwarded-proto"), vec!["http"]);
    assert_eq!(
        received(&r.body, "x-forwarded-host"),
        vec!["api.example.com"]
    );
    assert_eq!(received(&r.body, "x-forwarded-port"), vec![port.as_str()]);
}

/// A route's `request_headers` and `response_headers` rules (`set`, `add`, `remove`, with the
/// `${client_addr}`, `${request_id}` and `${host}` variables), and RFC 7239 `Forwarded` with
/// `"forwarded": true`: a trusted proxy's element is kept and ours appended; an untrusted
/// client's is replaced.
#[test]
fn route_header_rules_and_forwarded_apply_per_route() {
    let echo = header_echo();
    let routes = format!(
        r#"{{"upstreams": {{"echo": {{"servers": ["{echo}"]}}}},
            "forwarded": true,
            "routes": [
              {{"path_prefix": "/rules", "upstream": "echo",
                "request_headers": {{
                  "set": {{"X-Env": "prod", "X-Client": "${{client_addr}}", "X-Host": "${{host}}"}},
                  "add": {{"X-Trace": "${{request_id}}", "X-Env": "canary"}},
                  "remove": ["X-Debug"]}},
                "response_headers": {{
                  "set": {{"X-Served-By": "tollgate"}},
                  "add": {{"X-Request-Echo": "${{request_id}}"}},
                  "remove": ["X-Upstream-Secret"]}}}},
              {{"path_prefix": "/plain", "upstream": "echo"}}
            ]}}"#
    );
    let gw = gateway_with_routes(&routes);
    let sent = [
        ("X-Debug", "1"),
        ("X-Env", "dev"),
        ("X-Request-Id", "req-42"),
        ("Forwarded", "for=10.9.9.9"),
    ];
    let r = support::request(gw.proxy, "GET", "/rules/a", &sent);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        received(&r.body, "x-env"),
        vec!["prod", "canary"],
        "{}",
        r.body
    );
    assert_eq!(received(&r.body, "x-client"), vec!["127.0.0.1"]);
    assert_eq!(received(&r.body, "x-host"), vec!["api.example.com"]);
    assert_eq!(received(&r.body, "x-trace"), vec!["req-42"]);
    assert!(received(&r.body, "x-debug").is_empty());
    // Not a trusted proxy: its Forwarded is replaced by the gateway's element.
    assert_eq!(
        received(&r.body, "forwarded"),
        vec!["for=127.0.0.1;host=api.example.com;proto=http"]
    );
    assert_eq!(r.header("X-Served-By"), Some("tollgate"));
    assert_eq!(r.header("X-Request-Echo"), Some("req-42"));
    assert_eq!(r.header("X-Upstream-Secret"), None);
    assert_eq!(r.header("X-Upstream-Kept"), Some("1"));
    // Another route: no rules, the headers pass as sent.
    let r = support::request(gw.proxy, "GET", "/plain/a", &sent);
    assert_eq!(received(&r.body, "x-env"), vec!["dev"]);
    assert_eq!(received(&r.body, "x-debug"), vec!["1"]);
    assert_eq!(r.header("X-Upstream-Secret"), Some("1"));
    assert_eq!(r.header("X-Served-By"), None);
}

/// The same with the client a trusted proxy: the chain it sent is kept, the gateway's element
/// appended.
#[test]
fn a_trusted_proxys_forwarded_chain_is_extended() {
    let echo = header_echo();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.json");
    std::fs::write(
        &file,
        format!(
            r#"{{"upstreams": {{"echo": {{"servers": ["{echo}"]}}}}, "forwarded": true, "default_upstream": "echo"}}"#
        ),
    )
    .unwrap();
    let gw = Gateway::start(
        Some(OPEN),
        None,
        &[
            "--routes",
            file.to_str().unwrap(),
            "--trusted-proxy",
            "127.0.0.0/8",
        ],
    );
    gw.wait_until(Duration::from_secs(20), || {
        TcpStream::connect(gw.proxy).is_ok()
    });
    let r = support::request(
        gw.proxy,
        "GET",
        "/x",
        &[
            ("Host", "api.example.com:8443"),
            ("Forwarded", "for=198.51.100.7;proto=https"),
        ],
    );
    assert_eq!(
        received(&r.body, "forwarded"),
        vec![
            "for=198.51.100.7;proto=https, for=127.0.0.1;host=\"api.example.com:8443\";proto=http"
        ],
        "{}",
        r.body
    );
}
