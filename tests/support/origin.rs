//! A scripted HTTP/1.1 origin on 127.0.0.1: it reads each request of a keep-alive connection
//! (request line, headers, a `Content-Length` body), counts it, and writes whatever bytes the
//! test's `answer` function returns for it. The fake upstreams of the tests (the counting
//! upstream, a fake model, a login form) are this loop with different answers.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One request as the origin read it.
pub struct OriginRequest {
    /// The request line without its line end: `GET /x HTTP/1.1`.
    pub line: String,
    /// The request target: `/x`.
    pub target: String,
    /// Header names lower-cased, values trimmed, in the order sent (bytes that are not UTF-8,
    /// legal as obs-text, read lossily).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl OriginRequest {
    /// The first value of a header (`name` lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The answer function: a whole HTTP/1.1 response's bytes for one request.
pub type Answer = dyn Fn(&OriginRequest) -> Vec<u8> + Send + Sync;

/// A running scripted origin (it lives as long as the test process).
pub struct Origin {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl Origin {
    pub fn start(answer: impl Fn(&OriginRequest) -> Vec<u8> + Send + Sync + 'static) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind origin");
        let addr = listener.local_addr().expect("origin addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&hits);
        let answer: Arc<Answer> = Arc::new(answer);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let counter = Arc::clone(&counter);
                let answer = Arc::clone(&answer);
                std::thread::spawn(move || serve(conn, &counter, answer.as_ref()));
            }
        });
        Origin { addr, hits }
    }

    /// Requests read so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// A response with a `Content-Length`: `status` is the status line's tail (`200 OK`), `headers`
/// whole lines each ending in `\r\n`.
pub fn response(status: &str, headers: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn serve(conn: TcpStream, hits: &AtomicUsize, answer: &Answer) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut writer = conn;
    while let Some(request) = read_request(&mut reader) {
        hits.fetch_add(1, Ordering::SeqCst);
        if writer.write_all(&answer(&request)).is_err() {
            return;
        }
    }
}

/// The next request of the connection, or `None` once it closes or breaks off.
fn read_request(reader: &mut impl BufRead) -> Option<OriginRequest> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let line = line.trim_end().to_string();
    let target = line.split(' ').nth(1).unwrap_or("/").to_string();
    let mut headers = Vec::new();
    loop {
        let mut raw = Vec::new();
        if reader.read_until(b'\n', &mut raw).unwrap_or(0) == 0 {
            return None;
        }
        let header = String::from_utf8_lossy(&raw).trim_end().to_string();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
    }
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0usize);
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(OriginRequest {
        line,
        target,
        headers,
        body,
    })
}
