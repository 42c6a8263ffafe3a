//! Request targets, methods and hosts an upstream reads differently from the gateway, sent as an
//! attacker sends them, to the real binary and, for comparison, to a plain nginx: path
//! parameters (`/smuggled;x`) cannot walk past a kill switch (HTTP/1.1 and HTTP/2), a method
//! rule cannot be skipped with `post`, malformed request lines and Hosts are refused with 400
//! as nginx refuses them (each deliberate difference named in its row), and a chunked body
//! with a bad chunk size is answered 400, as nginx answers it.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;
use support::{free_port, raw_exchange, Gateway, Upstream};

/// A kill switch on everything under `/smuggled` of `api.example.com`, one on the host
/// `blocked.example`, and a `POST`-only policy on `/orders` admitting one request.
const POLICY: &str = r#"{"bundle_version": 1,
  "policies": [{"id": "writes", "spec": {"selector": {"pathPrefix": "/orders", "methods": ["POST"]}, "rules": [
    {"name": "one-write", "limit_keys": [], "algorithm": "token_bucket",
     "algorithm_config": {"rps": 0.001, "burst": 1}}]}}],
  "kill_switches": [
    {"scope_key": "host", "scope_value": "api.example.com", "route": "/smuggled", "reason": "incident 9"},
    {"scope_key": "host", "scope_value": "blocked.example", "reason": "blocked host"}]}"#;

/// A plain nginx answering 200 to everything it accepts.
struct Nginx {
    child: Child,
    addr: SocketAddr,
    _prefix: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM lets the master stop its workers; SIGKILL would orphan them.
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

fn start_nginx(gw: &Gateway) -> Nginx {
    let binary = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("nginx is not installed: run `bash scripts/test.sh` (it installs nginx-light)");
    let prefix = tempfile::tempdir().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let p = prefix.path().display().to_string();
    // SAFETY: geteuid(2) reads the process's credentials; it has no preconditions.
    let user = if unsafe { libc::geteuid() } == 0 {
        "user root;"
    } else {
        ""
    };
    let conf = format!(
        "{user}\nworker_processes 1;\nerror_log {p}/error.log;\npid {p}/nginx.pid;\n\
         events {{ worker_connections 64; }}\n\
         http {{ access_log off; client_body_temp_path {p}/body; proxy_temp_path {p}/proxy;\n\
         fastcgi_temp_path {p}/fcgi; uwsgi_temp_path {p}/uwsgi; scgi_temp_path {p}/scgi;\n\
         server {{ listen {addr}; location / {{ return 200 \"nginx ok\\n\"; }} }} }}\n"
    );
    let conf_path = prefix.path().join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let child = Command::new(binary)
        .args(["-p", &p, "-c", &conf_path.display().to_string()])
        .args(["-g", "daemon off;"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start nginx");
    let nginx = Nginx {
        child,
        addr,
        _prefix: prefix,
    };
    gw.wait_until(Duration::from_secs(15), || {
        support::try_request(addr, "GET", "/", &[]).is_ok()
    });
    nginx
}

/// What a server did with one raw request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Answered 400.
    Refused,
    /// Answered anything else.
    Served,
}

fn send(addr: SocketAddr, raw: &[u8]) -> (Seen, u16) {
    let responses = raw_exchange(addr, raw, Duration::from_secs(10));
    let status = responses.first().map_or(0, |r| r.status);
    assert_ne!(status, 0, "no response from {addr} to {raw:?}");
    let seen = if status == 400 {
        Seen::Refused
    } else {
        Seen::Served
    };
    (seen, status)
}

/// Each request (request line, then header lines) with what nginx and tollgate do with it.
/// Where they differ, tollgate is the stricter (or the RFC's reading), and the row says why.
const ROWS: &[(&str, Seen, Seen, &str)] = {
    use Seen::{Refused as R, Served as S};
    &[
        ("GET /x HTTP/1.1\r\nHost: ok.example", S, S, ""),
        ("M-SEARCH /x HTTP/1.1\r\nHost: ok.example", S, S, ""),
        ("MY_METHOD /x HTTP/1.1\r\nHost: ok.example", S, S, ""),
        ("get /x HTTP/1.1\r\nHost: ok.example", R, R, ""),
        ("GeT /x HTTP/1.1\r\nHost: ok.example", R, R, ""),
        ("GET1 /x HTTP/1.1\r\nHost: ok.example", R, R, ""),
        ("GET smuggled HTTP/1.1\r\nHost: ok.example", R, R, ""),
        ("GET * HTTP/1.1\r\nHost: ok.example", R, R, ""),
        (
            "OPTIONS * HTTP/1.1\r\nHost: ok.example",
            R,
            S,
            "RFC 9112 §3.2.4 asterisk-form, forwarded as sent",
        ),
        (
            "GET http://ok.example/x HTTP/1.1\r\nHost: ok.example",
            S,
            S,
            "",
        ),
        (
            "GET https://ok.example/x HTTP/1.1\r\nHost: ok.example",
            S,
            S,
            "",
        ),
        ("GET /a /x HTTP/1.1\r\nHost: ok.example", R, R, ""),
        (
            "GET  /x HTTP/1.1\r\nHost: ok.example",
            S,
            R,
            "nginx skips the second space; Pingora rewrote the target as %20/x",
        ),
        (
            "GET /x  HTTP/1.1\r\nHost: ok.example",
            S,
            R,
            "nginx skips the second space; Pingora rewrote the target as /x%20",
        ),
        ("GET\t/x HTTP/1.1\r\nHost: ok.example", R, R, ""),
        ("GET /x HTTP/1.1\r\nHost: blocked.example/x", R, R, ""),
        ("GET /x HTTP/1.1\r\nHost: blocked.example x", R, R, ""),
        (
            "GET /x HTTP/1.1\r\nHost: blocked.example,ok.example",
            S,
            R,
            "not host[:port]: a list an upstream may read either name from",
        ),
        (
            "GET /x HTTP/1.1\r\nHost: blocked.example\\x",
            S,
            R,
            "not host[:port]",
        ),
        (
            "GET /x HTTP/1.1\r\nHost: ok.example:abc",
            S,
            R,
            "a port is digits",
        ),
        ("GET /x HTTP/1.1\r\nHost: blocked..example", R, R, ""),
        ("GET /x HTTP/1.1\r\nHost: ", R, R, ""),
        ("GET /x HTTP/1.1\r\nX-No-Host: 1", R, R, ""),
        ("GET /x HTTP/1.0\r\nX-No-Host: 1", S, S, ""),
        ("GET /x HTTP/1.1\r\nHost: ok.example:8080", S, S, ""),
        ("GET /x HTTP/1.1\r\nHost: [::1]:8080", S, S, ""),
        ("GET /x HTTP/1.1\r\nHost: a_b.example.", S, S, ""),
    ]
};

#[test]
fn malformed_requests_are_refused_as_nginx_refuses_them() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &[]);
    let nginx = start_nginx(&gw);
    let mut differences = 0;
    for (request, at_nginx, at_tollgate, why) in ROWS {
        let raw = format!("{request}\r\nConnection: close\r\n\r\n");
        let (nginx_seen, nginx_status) = send(nginx.addr, raw.as_bytes());
        assert_eq!(nginx_seen, *at_nginx, "nginx, {request:?}: {nginx_status}");
        let hits = upstream.hits();
        let (seen, status) = send(gw.proxy, raw.as_bytes());
        assert_eq!(seen, *at_tollgate, "tollgate, {request:?}: {status}");
        if seen == Seen::Refused {
            assert_eq!(upstream.hits(), hits, "{request:?} was forwarded");
        }
        if at_nginx != at_tollgate {
            assert!(!why.is_empty(), "{request:?}: a difference needs a reason");
            differences += 1;
        }
    }
    assert_eq!(differences, 6);
    // The refusals tollgate makes itself are counted under their reason (the rest are refused
    // by the HTTP parser before any hook: `GET /a /x`, tabs, an empty target).
    assert_eq!(
        gw.metric("tollgate_requests_total{action=\"reject\",reason=\"malformed_request\"}"),
        13.0
    );
}

/// `;` path parameters are cut from each segment before matching, as a servlet container
/// routes: a kill switch on `/smuggled` refuses `/smuggled;x` and `/smuggled;jsessionid=0123`,
/// and `/a;p=1/smuggled`, while the upstream gets the target as sent.
#[test]
fn path_parameters_never_walk_past_a_kill_switch() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &["--h2c"]);
    for path in [
        "/smuggled",
        "/smuggled;x",
        "/smuggled;jsessionid=0123",
        "/smuggled;x/inner",
        "/;x/smuggled",
        "/smuggled;a=1;b=2/",
    ] {
        let r = gw.get(path, &[]);
        assert_eq!(r.status, 429, "{path}: {r:?}");
        assert_eq!(r.header("X-Tollgate-Reason"), Some("kill_switch"), "{path}");
        // The decision service (nginx auth_request, Envoy ext_authz) agrees.
        let d = gw.admin("POST", "/v1/decision", &[("X-Original-URI", path)]);
        assert_eq!(d.status, 429, "decision service, {path}");
    }
    // A parameter on a dot segment, or over an escaped separator, reads as two places (a
    // servlet container climbs, every other server does not): refused by both, 400.
    for path in [
        "/public/..;x/smuggled",
        "/smuggled/%2e%2e;/x",
        "/pub;x%2F..%2Fsmuggled",
    ] {
        let r = gw.get(path, &[]);
        assert_eq!(r.status, 400, "{path}: {r:?}");
        assert_eq!(
            r.header("X-Tollgate-Reason"),
            Some("malformed_request"),
            "{path}"
        );
        let d = gw.admin("POST", "/v1/decision", &[("X-Original-URI", path)]);
        assert_eq!(d.status, 400, "decision service, {path}");
    }
    assert_eq!(upstream.hits(), 0);
    // An encoded `;` is data: `/smuggled%3Bx` names another resource, and is served.
    assert_eq!(gw.get("/smuggled%3Bx", &[]).status, 200);
    assert_eq!(gw.get("/smuggledx;y", &[]).status, 200);
    assert_eq!(upstream.hits(), 2);

    // HTTP/2 (h2c) the same.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let statuses = rt.block_on(h2c(
        gw.proxy,
        &[
            ("GET", "/smuggled;x", "api.example.com"),
            ("GET", "/smuggled;jsessionid=0123", "api.example.com"),
            ("GET", "/other;x", "api.example.com"),
            ("get", "/other", "api.example.com"),
            ("GET", "/other", "blocked.example,ok.example"),
            ("GET", "/other", "blocked.example"),
        ],
    ));
    assert_eq!(statuses, [429, 429, 200, 400, 400, 429]);
    assert_eq!(upstream.hits(), 3);
}

/// A `"methods": ["POST"]` rule cannot be skipped with `post`: a method that is not an
/// upper-case token is refused before any matching, never forwarded.
#[test]
fn a_method_rule_is_not_skipped_by_spelling_the_method_in_lower_case() {
    let upstream = Upstream::start();
    let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &[]);
    let post = |method: &str| {
        let raw = format!(
            "{method} /orders HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        raw_exchange(gw.proxy, raw.as_bytes(), Duration::from_secs(10))
            .first()
            .map_or(0, |r| r.status)
    };
    assert_eq!(post("POST"), 200);
    assert_eq!(post("POST"), 429, "the rule's one request is spent");
    for spelling in ["post", "Post", "pOST"] {
        assert_eq!(post(spelling), 400, "{spelling}");
    }
    assert_eq!(upstream.hits(), 1);
    let r = raw_exchange(
        gw.proxy,
        b"post /orders HTTP/1.1\r\nHost: api.example.com\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    );
    assert_eq!(r[0].header("X-Tollgate-Reason"), Some("malformed_request"));
    // A host kill switch cannot be dodged with a Host an upstream reads a host out of.
    for host in [
        "blocked.example/x",
        "blocked.example x",
        "blocked.example,ok.example",
        "blocked.example:abc",
    ] {
        let r = gw.get("/x", &[("Host", host)]);
        assert_eq!(r.status, 400, "{host}");
    }
    assert_eq!(gw.get("/x", &[("Host", "blocked.example")]).status, 429);
    assert_eq!(
        gw.get("/x", &[("Host", "BLOCKED.example.:8080")]).status,
        429
    );
    assert_eq!(upstream.hits(), 1);
}

/// A chunked request body with a bad chunk size (or a chunk longer than it said) is answered
/// 400, as nginx answers it (it used to close the connection without an answer). The upstream
/// reads the request and waits for its body, as an application server does.
#[test]
fn a_bad_chunk_size_is_answered_400_as_nginx_does() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let waiting = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut &conn, &mut std::io::sink());
            });
        }
    });
    let gw = Gateway::start(Some(POLICY), Some(waiting), &[]);
    let nginx = start_nginx(&gw);
    for body in [
        "zz\r\nabc\r\n0\r\n\r\n",
        "3\r\nabcdef\r\n0\r\n\r\n",
        "-1\r\n",
    ] {
        let raw = format!(
            "POST /upload HTTP/1.1\r\nHost: api.example.com\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
        );
        assert_eq!(
            send(nginx.addr, raw.as_bytes()),
            (Seen::Refused, 400),
            "nginx, {body:?}"
        );
        let r = raw_exchange(gw.proxy, raw.as_bytes(), Duration::from_secs(10));
        assert_eq!(r.len(), 1, "{body:?}: {r:?}");
        assert_eq!(r[0].status, 400, "{body:?}");
        assert!(r[0].body.contains("chunked framing is invalid"), "{r:?}");
    }
}

/// HTTP/2 requests over cleartext (h2c) with the given method, path and `:authority`; their
/// statuses in order.
async fn h2c(addr: SocketAddr, requests: &[(&str, &str, &str)]) -> Vec<u16> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2c handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await.unwrap();
    let mut statuses = Vec::new();
    for (method, path, authority) in requests {
        let request = http::Request::builder()
            .method(http::Method::from_bytes(method.as_bytes()).unwrap())
            .uri(format!("http://{authority}{path}"))
            .body(())
            .unwrap();
        let (response, _) = client.send_request(request, true).expect("send");
        statuses.push(response.await.expect("response").status().as_u16());
        client = client.ready().await.unwrap();
    }
    statuses
}
