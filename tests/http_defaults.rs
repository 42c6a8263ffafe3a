//! The proxy's HTTP defaults against the real binary, each beside what nginx and Envoy do
//! (the manual's "At the edge" table): HTTP/1.0 clients (no `Transfer-Encoding` towards them, a
//! `Host` for the upstream when they sent none), the gateway's own request-header limits (431),
//! the upstream read timeout and streams, `Expect: 100-continue`, and a refused request's small
//! body read and discarded so its connection stays open.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{one_rule, Gateway};

/// Every request an upstream saw: its request line and header lines (names lower-cased),
/// then ` body=<body>`.
type Seen = Arc<Mutex<Vec<String>>>;

/// An HTTP/1.1 upstream that records each request and answers by path:
/// `/chunked`: `hello world` in two chunks; `/stream`: six server-sent events 200 ms apart
/// (chunked); `/stall`: two events, then silence for 3 s; anything else: `200 ok`.
struct Recording {
    addr: SocketAddr,
    seen: Seen,
}

impl Recording {
    fn start() -> Recording {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Seen = Arc::default();
        let record = Arc::clone(&seen);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let record = Arc::clone(&record);
                std::thread::spawn(move || serve(conn, &record));
            }
        });
        Recording { addr, seen }
    }

    fn requests(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve(conn: TcpStream, seen: &Mutex<Vec<String>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut writer = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut head = vec![request_line.trim_end().to_string()];
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap_or((line, ""));
            let name = name.trim().to_ascii_lowercase();
            if name == "content-length" {
                length = value.trim().parse().unwrap_or(0);
            }
            head.push(format!("{name}: {}", value.trim()));
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        head.push(format!("body={}", String::from_utf8_lossy(&body)));
        let path = head[0].split_whitespace().nth(1).unwrap_or("").to_string();
        seen.lock().unwrap().push(head.join("\n"));
        let chunked = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
        let event = |n: usize| {
            let data = format!("data: {n}\n\n");
            format!("{:x}\r\n{data}\r\n", data.len())
        };
        let sent = match path.as_str() {
            "/chunked" => writer.write_all(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            ),
            "/stream" | "/stall" => {
                let mut result = writer.write_all(chunked);
                let events = if path == "/stream" { 6 } else { 2 };
                for n in 0..events {
                    if result.is_ok() {
                        result = writer.write_all(event(n).as_bytes());
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
                if path == "/stall" {
                    std::thread::sleep(Duration::from_secs(3));
                    return;
                }
                result.and_then(|()| writer.write_all(b"0\r\n\r\n"))
            }
            _ => writer.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Allows every request (a bucket nobody empties).
fn allow_all() -> String {
    one_rule("per-ip", r#"["ip:address"]"#, 1000.0, 1000.0)
}

/// One request per client address, ever (within a test): the first is admitted, then 429s.
fn one_then_refused() -> String {
    one_rule("once", r#"["ip:address"]"#, 0.000001, 1.0)
}

/// Connects with a read timeout.
fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream
}

/// Reads until the server closes the connection (or the read timeout passes).
fn read_all(stream: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    raw
}

/// Whether the server closes the connection (nothing more to read) within 3 s.
fn closed(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut buf = [0u8; 64];
    matches!(stream.read(&mut buf), Ok(0))
        || matches!(stream.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
}

/// Reads one response header block (up to the blank line) and then `Content-Length` body
/// bytes; returns the header text and the body.
fn read_response(stream: &mut TcpStream) -> (String, String) {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => raw.push(byte[0]),
            other => panic!(
                "no complete response header ({other:?}): {:?}",
                String::from_utf8_lossy(&raw)
            ),
        }
    }
    let head = String::from_utf8_lossy(&raw).into_owned();
    let length: usize = header_of(&head, "content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).unwrap();
    (head, String::from_utf8_lossy(&body).into_owned())
}

/// A header's value in a response header block (any case).
fn header_of(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

fn status_of(head: &str) -> u16 {
    head.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// An HTTP/1.0 client never gets `Transfer-Encoding` (RFC 9112 §6.1): the upstream's chunked
/// answer reaches it de-chunked, delimited by the connection's close. An HTTP/1.1 client of
/// the same upstream still gets it chunked, on a connection that stays open.
#[test]
fn an_http10_client_gets_the_body_without_chunked_framing() {
    let upstream = Recording::start();
    let gw = Gateway::start(Some(&allow_all()), Some(upstream.addr), &[]);
    let mut stream = connect(gw.proxy);
    stream
        .write_all(b"GET /chunked HTTP/1.0\r\nHost: api.example.com\r\n\r\n")
        .unwrap();
    let raw = String::from_utf8_lossy(&read_all(&mut stream)).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response");
    assert_eq!(status_of(head), 200, "{raw}");
    assert_eq!(header_of(head, "transfer-encoding"), None, "{raw}");
    assert_eq!(header_of(head, "connection").as_deref(), Some("close"));
    assert_eq!(body, "hello world");

    // Keep-alive asked for: the body is still close-delimited, and the header says so.
    let mut stream = connect(gw.proxy);
    stream
        .write_all(
            b"GET /chunked HTTP/1.0\r\nHost: api.example.com\r\nConnection: keep-alive\r\n\r\n",
        )
        .unwrap();
    let raw = String::from_utf8_lossy(&read_all(&mut stream)).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response");
    assert_eq!(header_of(head, "transfer-encoding"), None, "{raw}");
    assert_eq!(header_of(head, "connection").as_deref(), Some("close"));
    assert_eq!(body, "hello world");

    // HTTP/1.1 is untouched.
    let mut stream = connect(gw.proxy);
    stream
        .write_all(b"GET /chunked HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !raw.ends_with(b"0\r\n\r\n") {
        let n = stream.read(&mut buf).expect("the chunked response");
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buf[..n]);
    }
    let raw = String::from_utf8_lossy(&raw).into_owned();
    assert_eq!(
        header_of(&raw, "transfer-encoding").as_deref(),
        Some("chunked"),
        "{raw}"
    );
}

/// An HTTP/1.0 request without `Host` reaches the upstream with one: the server as the gateway
/// addresses it (nginx's `$proxy_host`). A `Host` the client sent is passed as it is.
#[test]
fn an_http10_request_without_host_gets_one_for_the_upstream() {
    let upstream = Recording::start();
    let gw = Gateway::start(Some(&allow_all()), Some(upstream.addr), &[]);
    let mut stream = connect(gw.proxy);
    stream.write_all(b"GET /plain HTTP/1.0\r\n\r\n").unwrap();
    let raw = String::from_utf8_lossy(&read_all(&mut stream)).into_owned();
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    let mut stream = connect(gw.proxy);
    stream
        .write_all(b"GET /plain HTTP/1.0\r\nHost: shop.example.com\r\n\r\n")
        .unwrap();
    let raw = String::from_utf8_lossy(&read_all(&mut stream)).into_owned();
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");

    let seen = upstream.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let hosts: Vec<Vec<&str>> = seen
        .iter()
        .map(|r| r.lines().filter(|l| l.starts_with("host:")).collect())
        .collect();
    assert_eq!(
        hosts,
        vec![
            vec![format!("host: {}", upstream.addr).as_str()],
            vec!["host: shop.example.com"]
        ]
    );
}

/// A raw request: `Host` and `lines - 1` more header lines, the `Cookie` (if any) among them,
/// then `Connection: close` (counted in `lines`).
fn request_with_lines(lines: usize, cookie: usize) -> Vec<u8> {
    let mut req = String::from("GET /plain HTTP/1.1\r\nHost: api.example.com\r\n");
    if cookie > 0 {
        req.push_str(&format!("Cookie: session={}\r\n", "c".repeat(cookie)));
    }
    let fixed = 2 + usize::from(cookie > 0);
    for i in 0..lines.saturating_sub(fixed) {
        req.push_str(&format!("X-Line-{i}: {i}\r\n"));
    }
    req.push_str("Connection: close\r\n\r\n");
    req.into_bytes()
}

fn exchange(addr: SocketAddr, bytes: &[u8]) -> (String, String) {
    let mut stream = connect(addr);
    stream.write_all(bytes).unwrap();
    read_response(&mut stream)
}

/// The gateway's own header limits: 64 KiB for the whole block and 100 lines by default (a
/// 16 KiB cookie passes), 431 with a short body past either, counted by limit; the upstream
/// never sees a refused request. `--max-request-header-bytes` moves the byte limit.
#[test]
fn header_blocks_over_the_limits_get_431() {
    let upstream = Recording::start();
    let gw = Gateway::start(Some(&allow_all()), Some(upstream.addr), &[]);
    let refused = |limit: &str| {
        gw.metric(&format!(
            "tollgate_request_headers_refused_total{{limit=\"{limit}\"}}"
        ))
    };
    // A 16 KiB cookie: through.
    let (head, body) = exchange(gw.proxy, &request_with_lines(3, 16 * 1024));
    assert_eq!((status_of(&head), body.as_str()), (200, "ok"), "{head}");
    // 100 KiB of headers: 431.
    let (head, body) = exchange(gw.proxy, &request_with_lines(3, 100 * 1024));
    assert_eq!(
        (status_of(&head), body.as_str()),
        (
            431,
            "Request Header Fields Too Large: the request's header block is over the gateway's limit\n"
        ),
        "{head}"
    );
    // 100 lines pass, 101 do not.
    let (head, _) = exchange(gw.proxy, &request_with_lines(100, 0));
    assert_eq!(status_of(&head), 200, "{head}");
    let (head, _) = exchange(gw.proxy, &request_with_lines(101, 0));
    assert_eq!(status_of(&head), 431, "{head}");
    assert_eq!((refused("bytes"), refused("lines")), (1.0, 1.0));
    assert_eq!(upstream.requests().len(), 2);

    // A smaller limit of the operator's.
    let upstream = Recording::start();
    let gw = Gateway::start(
        Some(&allow_all()),
        Some(upstream.addr),
        &["--max-request-header-bytes", "8192"],
    );
    let (head, _) = exchange(gw.proxy, &request_with_lines(3, 4 * 1024));
    assert_eq!(status_of(&head), 200, "{head}");
    let (head, _) = exchange(gw.proxy, &request_with_lines(3, 10 * 1024));
    assert_eq!(status_of(&head), 431, "{head}");
    assert_eq!(upstream.requests().len(), 1);
}

fn gateway_with_group(policy: &str, group: &str) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.json");
    std::fs::write(
        &routes,
        format!(r#"{{"upstreams": {{"api": {group}}}, "default_upstream": "api"}}"#),
    )
    .unwrap();
    let gw = Gateway::start(Some(policy), None, &["--routes", routes.to_str().unwrap()]);
    gw.wait_until(Duration::from_secs(20), || {
        TcpStream::connect(gw.proxy).is_ok()
    });
    (gw, dir)
}

/// The read timeout is per read: each event of a stream starts it again, so a stream that
/// keeps sending outlives it (six events 200 ms apart under a 500 ms timeout); one that falls
/// silent is cut after it, the client keeping the events it had.
#[test]
fn each_event_of_a_stream_starts_the_read_timeout_again() {
    let upstream = Recording::start();
    let (gw, _dir) = gateway_with_group(
        &allow_all(),
        &format!(
            r#"{{"servers": ["{}"], "read_timeout_ms": 500}}"#,
            upstream.addr
        ),
    );
    let r = support::request(gw.proxy, "GET", "/stream", &[]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body,
        "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\ndata: 5\n\n"
    );

    let mut stream = connect(gw.proxy);
    stream
        .write_all(b"GET /stall HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
        .unwrap();
    let started = Instant::now();
    let raw = String::from_utf8_lossy(&read_all(&mut stream)).into_owned();
    // Closed by the gateway (the upstream stays silent for 3 s), before the last chunk.
    assert!(started.elapsed() < Duration::from_millis(2500), "{raw}");
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert!(
        raw.contains("data: 0\n\n") && raw.contains("data: 1\n\n"),
        "{raw}"
    );
    assert!(!raw.ends_with("0\r\n\r\n"), "{raw}");
}

/// `Expect: 100-continue`: an admitted request gets `100 Continue` from the gateway (the
/// upstream here, like many, ignores `Expect` and waits for the body), then its response; the
/// upstream gets the request without `Expect`. A refused one gets its 429 at once, with no
/// 100, and the upstream nothing.
#[test]
fn expect_100_continue_is_answered_by_the_gateway() {
    let upstream = Recording::start();
    let gw = Gateway::start(Some(&one_then_refused()), Some(upstream.addr), &[]);
    let mut stream = connect(gw.proxy);
    stream
        .write_all(b"POST /plain HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    // The body is held back until the 100 comes (the read timeout fails the test otherwise).
    let (head, body) = read_response(&mut stream);
    assert_eq!((status_of(&head), body.as_str()), (100, ""), "{head}");
    stream.write_all(b"hello").unwrap();
    let (head, body) = read_response(&mut stream);
    assert_eq!((status_of(&head), body.as_str()), (200, "ok"), "{head}");
    let seen = upstream.requests();
    assert_eq!(seen.len(), 1);
    assert!(!seen[0].contains("expect:"), "{}", seen[0]);
    assert!(seen[0].ends_with("body=hello"), "{}", seen[0]);

    // Refused: the 429 comes without a 100 and without the body being sent.
    let mut stream = connect(gw.proxy);
    stream
        .write_all(b"POST /plain HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    let raw = String::from_utf8_lossy(&read_all(&mut stream)).into_owned();
    assert!(raw.starts_with("HTTP/1.1 429 "), "{raw}");
    assert!(!raw.contains("100 Continue"), "{raw}");
    assert_eq!(upstream.requests().len(), 1);
}

/// A refused request with a small body (Content-Length up to 64 KiB) has the body read and
/// discarded and keeps its connection for the next request, as nginx does; a larger or chunked
/// one is answered and the connection closed, as before.
#[test]
fn a_refused_small_body_keeps_its_connection() {
    let upstream = Recording::start();
    let gw = Gateway::start(Some(&one_then_refused()), Some(upstream.addr), &[]);
    let (head, _) = exchange(
        gw.proxy,
        b"GET /plain HTTP/1.1\r\nHost: api.example.com\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status_of(&head), 200);

    let mut stream = connect(gw.proxy);
    let body = "b".repeat(1000);
    stream
        .write_all(
            format!(
                "POST /plain HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: 1000\r\n\r\n{body}"
            )
            .as_bytes(),
        )
        .unwrap();
    let (head, _) = read_response(&mut stream);
    assert_eq!(status_of(&head), 429, "{head}");
    assert_eq!(
        header_of(&head, "connection").as_deref(),
        Some("keep-alive")
    );
    // The same connection serves the next request.
    stream
        .write_all(b"GET /plain HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
        .unwrap();
    let (head, _) = read_response(&mut stream);
    assert_eq!(status_of(&head), 429, "{head}");
    assert_eq!(
        header_of(&head, "connection").as_deref(),
        Some("keep-alive")
    );

    // 64 KiB exactly is still read and discarded.
    let body = "b".repeat(64 * 1024);
    stream
        .write_all(
            format!(
                "POST /plain HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap();
    let (head, _) = read_response(&mut stream);
    assert_eq!(
        (status_of(&head), header_of(&head, "connection").as_deref()),
        (429, Some("keep-alive")),
        "{head}"
    );

    // Larger, or chunked: answered at once, and the connection closes.
    for framing in ["Content-Length: 65537", "Transfer-Encoding: chunked"] {
        let mut stream = connect(gw.proxy);
        stream
            .write_all(
                format!("POST /plain HTTP/1.1\r\nHost: api.example.com\r\n{framing}\r\n\r\n")
                    .as_bytes(),
            )
            .unwrap();
        let (head, _) = read_response(&mut stream);
        assert_eq!(
            (status_of(&head), header_of(&head, "connection").as_deref()),
            (429, Some("close")),
            "{framing}: {head}"
        );
        assert!(closed(&mut stream), "{framing}: the connection stays open");
    }
    assert_eq!(upstream.requests().len(), 1);
}
