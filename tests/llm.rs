//! LLM token budgets end to end: a real `tollgate run` in front of a small fake
//! OpenAI-compatible upstream started here (JSON and streamed responses with `usage`, and a
//! stream the upstream cuts short), and the decision service's reserve / `POST /v1/usage`.
//!
//! The daily budget (`tokens_per_day`) never refills within a test, so its `RateLimit` item
//! shows exactly what each request was charged.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use support::{request_with_body, Gateway, HttpResponse};

/// 5 000 tokens a UTC day per API key; the minute bucket is wide enough not to matter.
const POLICY: &str = r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
    "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 100000,
    "tokens_per_day": 5000, "max_prompt_tokens": 1000, "max_tokens_per_request": 4000,
    "default_max_completion": 500}}]}"#;

/// "one two three" is 4 prompt tokens (3 words × 4/3); with `max_tokens: 800`, 804 reserved.
const CHAT: &str = r#"{"model": "m", "max_tokens": 800, "messages": [{"role": "user", "content": "one two three"}]}"#;
const STREAM_CHAT: &str = r#"{"model": "m", "max_tokens": 800, "stream": true, "messages": [{"role": "user", "content": "one two three"}]}"#;

/// What the fake model reports using: 300 tokens, whatever was asked.
const USAGE: &str = r#"{"prompt_tokens": 100, "completion_tokens": 200, "total_tokens": 300}"#;

/// A fake OpenAI-compatible upstream. `POST /v1/chat/completions` answers JSON with `usage`,
/// or, for `"stream": true`, server-sent events: a first delta at once, then (after the test
/// opens the gate) a second delta and a final chunk with `usage`. `/v1/cut/...` streams two
/// deltas and drops the connection.
struct FakeOpenAi {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
    gate: Arc<(Mutex<bool>, Condvar)>,
    /// Set when the gate opened and the stream's rest is about to be written (before it is:
    /// a client that has read the rest always sees it set).
    stream_finished: Arc<AtomicBool>,
    long: Arc<LongStream>,
    /// The `Accept-Encoding` of every request, in order ("" when absent).
    encodings: Arc<Mutex<Vec<String>>>,
}

/// What the upstream saw of its `/v1/long/...` streams: deltas written, and whether the
/// gateway dropped the connection before the last one.
#[derive(Default)]
struct LongStream {
    deltas_written: AtomicUsize,
    aborted: AtomicBool,
}

/// The deltas a `/v1/long/...` stream has (every one "w w w ": 3 words, 4 tokens).
const LONG_DELTAS: usize = 400;

impl FakeOpenAi {
    fn start() -> FakeOpenAi {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake upstream");
        let upstream = FakeOpenAi {
            addr: listener.local_addr().expect("addr"),
            hits: Arc::default(),
            bodies: Arc::default(),
            gate: Arc::new((Mutex::new(false), Condvar::new())),
            stream_finished: Arc::default(),
            long: Arc::default(),
            encodings: Arc::default(),
        };
        let shared = (
            Arc::clone(&upstream.hits),
            Arc::clone(&upstream.bodies),
            Arc::clone(&upstream.gate),
            Arc::clone(&upstream.stream_finished),
            Arc::clone(&upstream.long),
            Arc::clone(&upstream.encodings),
        );
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let (hits, bodies, gate, finished, long, encodings) = shared;
                    serve(conn, &hits, &bodies, &gate, &finished, &long, &encodings);
                });
            }
        });
        upstream
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn open_gate(&self) {
        let (open, wake) = &*self.gate;
        *open.lock().unwrap() = true;
        wake.notify_all();
    }
}

fn serve(
    conn: TcpStream,
    hits: &AtomicUsize,
    bodies: &Mutex<Vec<Vec<u8>>>,
    gate: &(Mutex<bool>, Condvar),
    stream_finished: &AtomicBool,
    long: &LongStream,
    encodings: &Mutex<Vec<String>>,
) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut out = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let (mut length, mut chunked, mut encoding) = (0usize, false, String::new());
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
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
            if name.eq_ignore_ascii_case("transfer-encoding") && value.contains("chunked") {
                chunked = true;
            }
            if name.eq_ignore_ascii_case("accept-encoding") {
                encoding = value.trim().to_string();
            }
        }
        let body = if chunked {
            let mut body = Vec::new();
            loop {
                let mut size = String::new();
                if reader.read_line(&mut size).unwrap_or(0) == 0 {
                    return;
                }
                let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
                let mut piece = vec![0u8; size + 2];
                if reader.read_exact(&mut piece).is_err() {
                    return;
                }
                if size == 0 {
                    break body;
                }
                body.extend_from_slice(&piece[..size]);
            }
        } else {
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            body
        };
        let streamed = String::from_utf8_lossy(&body).contains(r#""stream": true"#);
        bodies.lock().unwrap().push(body);
        encodings.lock().unwrap().push(encoding);
        if request_line.contains(" /v1/silent/") {
            // Reads the request, then hangs up without a word.
            hits.fetch_add(1, Ordering::SeqCst);
            let _ = out.shutdown(std::net::Shutdown::Both);
            return;
        }
        hits.fetch_add(1, Ordering::SeqCst);
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
        let event = |json: &str| {
            let data = format!("data: {json}\n\n");
            format!("{:x}\r\n{data}\r\n", data.len())
        };
        let delta = || {
            event(
                r#"{"id": "chatcmpl-7", "created": 1764000000, "model": "m-large", "choices": [{"index": 0, "delta": {"content": "w w w "}}]}"#,
            )
        };
        if request_line.contains(" /v1/long/") {
            // A model that goes on and on: a delta every 5 ms (2 s in all), until the
            // connection is dropped.
            if out.write_all(head.as_bytes()).is_err() {
                return;
            }
            for _ in 0..LONG_DELTAS {
                if out.write_all(delta().as_bytes()).is_err() || out.flush().is_err() {
                    long.aborted.store(true, Ordering::SeqCst);
                    return;
                }
                long.deltas_written.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = out.write_all(format!("{}0\r\n\r\n", event("[DONE]")).as_bytes());
            return;
        }
        if request_line.contains(" /v1/burst/") || request_line.contains(" /v1/early/") {
            // The header and 40 deltas in one write: the gateway gets them in one piece;
            // `/v1/early/` puts a 103 Early Hints before them.
            let early = if request_line.contains(" /v1/early/") {
                "HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
            } else {
                ""
            };
            let all = format!(
                "{early}{head}{}{}0\r\n\r\n",
                delta().repeat(40),
                event("[DONE]")
            );
            let _ = out.write_all(all.as_bytes());
            return;
        }
        if request_line.contains(" /v1/cut/") {
            // Two deltas ("one two three " and "four five six": 6 words, 8 tokens), then
            // the connection drops without the final chunk.
            let _ = out.write_all(head.as_bytes());
            let _ = out.write_all(
                event(r#"{"choices": [{"delta": {"content": "one two three "}}]}"#).as_bytes(),
            );
            let _ = out.write_all(
                event(r#"{"choices": [{"delta": {"content": "four five six"}}]}"#).as_bytes(),
            );
            let _ = out.flush();
            std::thread::sleep(Duration::from_millis(100));
            let _ = out.shutdown(std::net::Shutdown::Both);
            return;
        }
        let written = if streamed {
            let first = event(r#"{"choices": [{"delta": {"content": "Hel"}}]}"#);
            let ok = out.write_all(head.as_bytes()).is_ok()
                && out.write_all(first.as_bytes()).is_ok()
                && out.flush().is_ok();
            // The rest waits until the client has seen the first delta (bounded).
            let (open, wake) = gate;
            let guard = open.lock().unwrap();
            let (mut guard, _) = wake
                .wait_timeout_while(guard, Duration::from_secs(10), |open| !*open)
                .unwrap();
            *guard = false;
            drop(guard);
            let rest = format!(
                "{}{}{}0\r\n\r\n",
                event(r#"{"choices": [{"delta": {"content": "lo"}}]}"#),
                event(&format!(r#"{{"choices": [], "usage": {USAGE}}}"#)),
                event("[DONE]"),
            );
            // Set before the rest is written, never after: once written, the client can read
            // it (and look at this flag) before this thread runs again.
            stream_finished.store(true, Ordering::SeqCst);
            ok && out.write_all(rest.as_bytes()).is_ok()
        } else {
            let json = format!(
                r#"{{"id": "c1", "object": "chat.completion", "choices": [{{"message": {{"role": "assistant", "content": "Hello"}}}}], "usage": {USAGE}}}"#
            );
            out.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
                    json.len()
                )
                .as_bytes(),
            )
            .is_ok()
        };
        if !written {
            return;
        }
    }
}

/// The remaining tokens of the `RateLimit` item named `name`.
fn remaining(r: &HttpResponse, name: &str) -> u64 {
    let header = r.header("ratelimit").unwrap_or_default();
    header
        .split(',')
        .map(str::trim)
        .find(|item| item.starts_with(&format!("\"{name}\";")))
        .and_then(|item| {
            item.split(';')
                .find_map(|p| p.strip_prefix("r="))
                .and_then(|r| r.parse().ok())
        })
        .unwrap_or_else(|| panic!("no RateLimit item {name:?} in {header:?} ({r:?})"))
}

fn chat(gw: &Gateway, path: &str, tenant: &str, body: &str) -> HttpResponse {
    request_with_body(
        gw.proxy,
        "POST",
        path,
        &[("X-Api-Key", tenant), ("Content-Type", "application/json")],
        body.as_bytes(),
    )
}

const SETTLED_BY_USAGE: &str = "tollgate_llm_settlements_total{source=\"usage\"}";
const SETTLED_BY_ESTIMATE: &str = "tollgate_llm_settlements_total{source=\"estimate\"}";

/// Settlement runs once the response is done: waits until `series` reaches `count`.
fn wait_settled(gw: &Gateway, series: &str, count: u32) {
    gw.wait_until(Duration::from_secs(10), || {
        gw.metric(series) == f64::from(count)
    });
}

#[test]
fn the_proxy_charges_what_the_model_used_and_refuses_before_the_upstream() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &[]);
    // Asking for 800 but using 300: each request moves the day budget by exactly 300, so 14
    // requests fit in 5 000 (an 800-token charge would have allowed 6).
    let mut before = None;
    for n in 0..14u64 {
        let r = chat(&gw, "/v1/chat/completions", "tenant-a", CHAT);
        assert_eq!(r.status, 200, "request {n}: {r:?}");
        assert!(r.body.contains(r#""total_tokens": 300"#), "{}", r.body);
        // Seen at decision time: 804 reserved on top of the 300 × n already charged.
        let left = remaining(&r, "chat:tpd");
        assert_eq!(left, 5000 - 300 * n - 804, "request {n}");
        if let Some(before) = before {
            assert_eq!(before - left, 300);
        }
        before = Some(left);
        wait_settled(&gw, SETTLED_BY_USAGE, n as u32 + 1);
    }
    assert_eq!(upstream.hits(), 14);
    // 800 left, 804 to reserve: refused here, OpenAI-shaped, and the model never sees it.
    let r = chat(&gw, "/v1/chat/completions", "tenant-a", CHAT);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-tollgate-reason"), Some("tpd_exceeded"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let error: serde_json::Value = serde_json::from_str(&r.body).expect("JSON error body");
    assert_eq!(error["error"]["type"], "rate_limit_exceeded");
    assert_eq!(error["error"]["code"], "tpd_exceeded");
    assert_eq!(upstream.hits(), 14);
    // A request asking for less still fits: 4 + 700 reserved.
    let small = CHAT.replace("800", "700");
    let r = chat(&gw, "/v1/chat/completions", "tenant-a", &small);
    assert_eq!(r.status, 200);
    assert_eq!(remaining(&r, "chat:tpd"), 800 - 704);
    assert_eq!(upstream.hits(), 15);
    // The body reached the model byte for byte.
    assert_eq!(upstream.bodies.lock().unwrap()[0], CHAT.as_bytes());
    // A prompt over max_prompt_tokens (1 500 words: 2 000 tokens) is refused before anything.
    let long = format!(
        r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "word ".repeat(1500)
    );
    let r = chat(&gw, "/v1/chat/completions", "tenant-b", &long);
    assert_eq!(r.status, 429);
    assert_eq!(
        r.header("x-tollgate-reason"),
        Some("prompt_tokens_exceeded")
    );
    assert_eq!(upstream.hits(), 15);
    // Another tenant has its own day.
    let r = chat(&gw, "/v1/chat/completions", "tenant-b", CHAT);
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 804);
    wait_settled(&gw, SETTLED_BY_USAGE, 16);
    // Counters: 16 settled by usage, 16 × 300 used; refunds 504 each (and 404 once).
    assert_eq!(
        gw.metric("tollgate_llm_tokens_used_total{policy=\"policy\",rule=\"chat\"}"),
        4800.0,
        "{}",
        gw.metrics()
    );
    assert_eq!(
        gw.metric("tollgate_llm_tokens_refunded_total{policy=\"policy\",rule=\"chat\"}"),
        15.0 * 504.0 + 404.0
    );
    assert_eq!(
        gw.metric("tollgate_requests_total{action=\"reject\",reason=\"tpd_exceeded\"}"),
        1.0,
        "{}",
        gw.metrics()
    );
    // Estimate accuracy: 16 observations (prompt estimate 4 against 100 reported).
    assert_eq!(gw.metric("tollgate_llm_prompt_estimate_ratio_count"), 16.0);
}

#[test]
fn streams_reach_the_client_as_they_come_and_are_charged_their_final_usage() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &[]);
    let mut conn = TcpStream::connect(gw.proxy).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: api.example.com\r\nX-Api-Key: tenant-s\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{STREAM_CHAT}",
        STREAM_CHAT.len()
    )
    .expect("send");
    // The first delta arrives while the upstream is still holding the rest back.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("Hel") {
        let n = conn
            .read(&mut buf)
            .expect("first delta before the upstream finishes");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(!upstream.stream_finished.load(Ordering::SeqCst));
    let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    assert!(head.contains("\"chat:tpd\";r=4196"), "{head}");
    upstream.open_gate();
    conn.read_to_end(&mut seen).expect("rest of the stream");
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(upstream.stream_finished.load(Ordering::SeqCst));
    // The final chunk's usage (300) is what the day was charged.
    wait_settled(&gw, SETTLED_BY_USAGE, 1);
    let r = chat(&gw, "/v1/chat/completions", "tenant-s", CHAT);
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 300 - 804);
    wait_settled(&gw, SETTLED_BY_USAGE, 2);

    // Cut short by the upstream after two deltas: charged the prompt estimate (4) and the
    // text streamed (6 words: 8 tokens), the rest of the reservation refunded.
    let r = support::try_request_with_body(
        gw.proxy,
        "POST",
        "/v1/cut/chat/completions",
        &[("X-Api-Key", "tenant-c")],
        STREAM_CHAT.as_bytes(),
    );
    if let Ok(r) = &r {
        assert_eq!(r.status, 200);
    }
    wait_settled(&gw, SETTLED_BY_ESTIMATE, 1);
    let r = chat(&gw, "/v1/chat/completions", "tenant-c", CHAT);
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 12 - 804);
}

/// Stops streams past `max_completion_tokens` (20) + `buffer_tokens` (10).
const CAPPED_POLICY: &str = r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
    "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 100000,
    "tokens_per_day": 5000, "max_completion_tokens": 20,
    "streaming": {"enforce_mid_stream": true, "buffer_tokens": 10}}}]}"#;

/// A whole HTTP/1.1 response read raw until the server closes (with `Connection: close`).
fn raw_post(gw: &Gateway, path: &str, tenant: &str, body: &str) -> String {
    let mut conn = TcpStream::connect(gw.proxy).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        conn,
        "POST {path} HTTP/1.1\r\nHost: api.example.com\r\nX-Api-Key: {tenant}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).expect("the whole response");
    String::from_utf8_lossy(&raw).into_owned()
}

/// What a client gets of a stream stopped after 8 deltas of 4 tokens (32, past 20 + 10): a
/// last chunk like a model's at its max_tokens, `[DONE]`, and the end of the body.
const CLOSING: &str = "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\",\"index\":0}],\"created\":1764000000,\"id\":\"chatcmpl-7\",\"model\":\"m-large\",\"object\":\"chat.completion.chunk\",\"usage\":{\"completion_tokens\":32,\"prompt_tokens\":4,\"total_tokens\":36}}\n\ndata: [DONE]\n\n";

/// Checks a raw HTTP/1.1 response (from its final header on) is a complete 200 carrying
/// `limit_item`, with 8 deltas then [`CLOSING`].
fn assert_stopped(raw: &str, limit_item: &str) {
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert!(raw.to_ascii_lowercase().contains(limit_item), "{raw}");
    // The last chunk of a chunked body: the response is complete, not cut off.
    assert!(raw.ends_with("\r\n0\r\n\r\n"), "{raw}");
    let body = &support::split_responses(raw.as_bytes())[0].body;
    assert_eq!(body.matches("\"content\": \"w w w \"").count(), 8, "{body}");
    assert!(body.ends_with(CLOSING), "{body}");
}

const STOPPED: &str = "tollgate_llm_settlements_total{source=\"stopped\"}";

#[test]
fn a_stream_past_max_completion_tokens_is_stopped_and_charged_what_it_streamed() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(Some(CAPPED_POLICY), Some(upstream.addr), &[]);
    // A delta every 5 ms: the gateway reads them one by one.
    let raw = raw_post(&gw, "/v1/long/chat/completions", "tenant-l", STREAM_CHAT);
    assert_stopped(&raw, "\"chat:tpd\";r=4976");
    // The upstream connection was dropped: the model stopped well before its 400 deltas.
    gw.wait_until(Duration::from_secs(10), || {
        upstream.long.aborted.load(Ordering::SeqCst)
    });
    assert!(upstream.long.deltas_written.load(Ordering::SeqCst) < LONG_DELTAS);
    // Charged what was let through: prompt 4 + completion 32 (24 were reserved: the
    // completion is capped at 20), whatever the client asked for.
    wait_settled(&gw, STOPPED, 1);
    let r = chat(&gw, "/v1/chat/completions", "tenant-l", CHAT);
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 36 - 24);

    // Header and deltas reaching the gateway in one piece are stopped the same way.
    let raw = raw_post(&gw, "/v1/burst/chat/completions", "tenant-b", STREAM_CHAT);
    assert_stopped(&raw, "\"chat:tpd\";r=4976");
    wait_settled(&gw, STOPPED, 2);

    // After a 103 Early Hints the final header still goes out (with the limit headers),
    // then the stopped stream.
    let raw = raw_post(&gw, "/v1/early/chat/completions", "tenant-e", STREAM_CHAT);
    assert!(raw.starts_with("HTTP/1.1 103"), "{raw}");
    let (early, rest) = raw.split_once("\r\n\r\n").expect("103 head");
    assert!(!early.to_ascii_lowercase().contains("ratelimit"), "{early}");
    assert_stopped(rest, "\"chat:tpd\";r=4976");
    wait_settled(&gw, STOPPED, 3);

    // A JSON answer is whole before it is read: never stopped, charged its usage (300).
    let r = chat(&gw, "/v1/chat/completions", "tenant-j", CHAT);
    assert_eq!(r.status, 200);
    assert!(r.body.contains("\"usage\""), "{r:?}");
    // (The first usage settlement was tenant-l's request above.)
    wait_settled(&gw, SETTLED_BY_USAGE, 2);
    let r = chat(&gw, "/v1/chat/completions", "tenant-j", CHAT);
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 300 - 24);
}

#[test]
fn a_stopped_stream_ends_cleanly_over_http2() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(Some(CAPPED_POLICY), Some(upstream.addr), &["--h2c"]);
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "--http2-prior-knowledge",
            "-H",
            "X-Api-Key: tenant-h2",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            STREAM_CHAT,
            "-w",
            "|%{http_version} %{http_code}",
        ])
        .arg(format!("http://{}/v1/long/chat/completions", gw.proxy))
        .output()
        .expect("curl is not installed: run `bash scripts/test.sh`");
    // curl exits non-zero on a reset or unfinished HTTP/2 stream: this one ended with
    // END_STREAM after the closing events.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (body, version) = stdout.rsplit_once('|').expect("write-out");
    assert_eq!(version, "2 200");
    assert_eq!(body.matches("\"content\": \"w w w \"").count(), 8, "{body}");
    assert!(
        body.ends_with("\"usage\":{\"completion_tokens\":32,\"prompt_tokens\":4,\"total_tokens\":36}}\n\ndata: [DONE]\n\n"),
        "{body}"
    );
    gw.wait_until(Duration::from_secs(10), || {
        upstream.long.aborted.load(Ordering::SeqCst)
    });
    wait_settled(&gw, STOPPED, 1);
}

#[test]
fn usage_is_read_uncompressed_and_a_request_never_answered_pays_its_prompt() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(Some(POLICY), Some(upstream.addr), &[]);
    // SDKs ask for gzip and br: the upstream is asked for an uncompressed answer, whose usage
    // (300) is what the day is charged.
    let r = request_with_body(
        gw.proxy,
        "POST",
        "/v1/chat/completions",
        &[
            ("X-Api-Key", "tenant-z"),
            ("Accept-Encoding", "gzip, deflate, br"),
        ],
        CHAT.as_bytes(),
    );
    assert_eq!(r.status, 200);
    assert_eq!(upstream.encodings.lock().unwrap().as_slice(), ["identity"]);
    wait_settled(&gw, SETTLED_BY_USAGE, 1);
    // Requests no token_bucket_llm rule applies to keep their own Accept-Encoding.
    let plain = Gateway::start(None, Some(upstream.addr), &["--wait-for-policy"]);
    let r = request_with_body(
        plain.proxy,
        "POST",
        "/v1/chat/completions",
        &[("Accept-Encoding", "gzip")],
        CHAT.as_bytes(),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        upstream
            .encodings
            .lock()
            .unwrap()
            .last()
            .map(String::as_str),
        Some("gzip")
    );

    // The upstream read the request and hung up: the model read the prompt (4), so that
    // much is charged; the 800 of completion reserved are refunded.
    let r = chat(&gw, "/v1/silent/chat/completions", "tenant-q", CHAT);
    assert_eq!(r.status, 502, "{r:?}");
    wait_settled(&gw, SETTLED_BY_ESTIMATE, 1);
    let r = chat(&gw, "/v1/chat/completions", "tenant-q", CHAT);
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 4 - 804);
}

/// The same rule in shadow mode, with bodies read up to 1 KiB.
const SHADOW_POLICY: &str = r#"{"bundle_version": 1, "policies": [{"id": "trial", "spec": {"mode": "shadow",
    "rules": [{"name": "chat", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket_llm",
    "algorithm_config": {"tokens_per_minute": 100000, "tokens_per_day": 5000}}]}}]}"#;

#[test]
fn shadow_rules_never_refuse_a_body_for_its_size() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(
        Some(SHADOW_POLICY),
        Some(upstream.addr),
        &["--max-body-bytes", "1024"],
    );
    let big = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "word ".repeat(400)
    );
    // Too large to read, and chunked past 64 KiB: enforced, 413 and 411; in shadow mode
    // both reach the upstream whole.
    let r = chat(&gw, "/v1/chat/completions", "tenant-s", &big);
    assert_eq!(r.status, 200, "{r:?}");
    let chunked_body = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "word ".repeat(20_000)
    );
    let mut conn = TcpStream::connect(gw.proxy).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.example.com\r\n\
        X-Api-Key: tenant-s\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        .to_vec();
    for piece in chunked_body.as_bytes().chunks(8192) {
        raw.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        raw.extend_from_slice(piece);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    conn.write_all(&raw).expect("send");
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).expect("answer");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let bodies = upstream.bodies.lock().unwrap();
    assert_eq!(bodies.len(), 2);
    assert_eq!(bodies[0], big.as_bytes());
    assert_eq!(bodies[1], chunked_body.as_bytes());
    drop(bodies);
    // The decision service answers too, without the prompt.
    let r = request_with_body(
        gw.admin,
        "POST",
        "/v1/decision",
        &[
            ("X-Original-Method", "POST"),
            ("X-Original-URI", "/v1/chat/completions"),
            ("X-Api-Key", "tenant-s"),
        ],
        big.as_bytes(),
    );
    assert_eq!(r.status, 200, "{r:?}");

    // Enforced, the same requests are refused before the upstream.
    let enforced = Gateway::start(
        Some(&SHADOW_POLICY.replace(r#""mode": "shadow","#, "")),
        Some(upstream.addr),
        &["--max-body-bytes", "1024"],
    );
    let r = chat(&enforced, "/v1/chat/completions", "tenant-s", &big);
    assert_eq!(r.status, 413, "{r:?}");
    let r = request_with_body(
        enforced.admin,
        "POST",
        "/v1/decision",
        &[
            ("X-Original-URI", "/v1/chat/completions"),
            ("X-Api-Key", "tenant-s"),
        ],
        big.as_bytes(),
    );
    assert_eq!(r.status, 413, "{r:?}");
    assert_eq!(upstream.hits(), 2);
}

#[test]
fn bodies_are_bounded_and_forwarded_unchanged() {
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(
        Some(POLICY),
        Some(upstream.addr),
        &["--max-body-bytes", "200000"],
    );
    // Over 64 KiB (Pingora's retry buffer) yet within the bound: read whole, decided, and
    // replayed to the model byte for byte. The padding is no prompt: "hi" is 2 tokens (one word × 4/3, rounded up).
    let padding = "x".repeat(100_000);
    let big = format!(
        r#"{{"max_tokens": 10, "metadata": {{"note": "{padding}"}}, "messages": [{{"role": "user", "content": "hi"}}]}}"#
    );
    let r = chat(&gw, "/v1/chat/completions", "tenant-big", &big);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(remaining(&r, "chat:tpd"), 5000 - 12);
    assert_eq!(upstream.bodies.lock().unwrap()[0], big.as_bytes());
    // Over the bound: 413 with a JSON error, never read whole, never forwarded.
    let huge = format!(r#"{{"note": "{}"}}"#, "x".repeat(250_000));
    let r = chat(&gw, "/v1/chat/completions", "tenant-big", &huge);
    assert_eq!(r.status, 413);
    let error: serde_json::Value = serde_json::from_str(&r.body).expect("JSON error body");
    assert_eq!(error["error"]["code"], "request_too_large");
    assert_eq!(upstream.hits(), 1);
    // The gateway is still serving.
    let r = chat(&gw, "/v1/chat/completions", "tenant-big", CHAT);
    assert_eq!(r.status, 200);
}

#[test]
fn the_decision_service_reserves_and_post_v1_usage_reconciles() {
    let gw = Gateway::start(Some(POLICY), None, &[]);
    let decide = |tenant: &str| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/chat/completions"),
                ("X-Api-Key", tenant),
            ],
            CHAT.as_bytes(),
        )
    };
    let usage = |body: &str| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/usage",
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
    };
    let mut before = None;
    for n in 0..14u64 {
        let r = decide("tenant-d");
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.header("x-tollgate-reserved-tokens"), Some("804"));
        let left = remaining(&r, "chat:tpd");
        assert_eq!(left, 5000 - 300 * n - 804);
        if let Some(before) = before {
            assert_eq!(before - left, 300);
        }
        before = Some(left);
        let token = r
            .header("x-tollgate-reservation")
            .expect("reservation")
            .to_string();
        assert_eq!(token.len(), 32);
        // The upstream's own usage object, as the model returned it.
        let settled = usage(&format!(
            r#"{{"reservation": "{token}", "usage": {USAGE}}}"#
        ));
        assert_eq!(settled.status, 200, "{settled:?}");
        let settled: serde_json::Value = serde_json::from_str(&settled.body).expect("JSON");
        assert_eq!(
            settled,
            serde_json::json!({"reserved": 804, "used": 300, "refunded": 504, "charged_over": 0})
        );
        // Reported once: a second report finds nothing.
        let again = usage(&format!(
            r#"{{"reservation": "{token}", "total_tokens": 300}}"#
        ));
        assert_eq!(again.status, 404);
    }
    let r = decide("tenant-d");
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-tollgate-reason"), Some("tpd_exceeded"));
    assert_eq!(r.header("x-tollgate-reservation"), None);
    // An overrun is charged: 804 reserved, 1 000 used.
    let r = decide("tenant-e");
    let token = r
        .header("x-tollgate-reservation")
        .expect("reservation")
        .to_string();
    let settled = usage(&format!(
        r#"{{"reservation": "{token}", "total_tokens": 1000}}"#
    ));
    let settled: serde_json::Value = serde_json::from_str(&settled.body).expect("JSON");
    assert_eq!(settled["charged_over"], 196);
    assert_eq!(
        remaining(&decide("tenant-e"), "chat:tpd"),
        5000 - 1000 - 804
    );
    // Bad reports are named, not guessed at.
    assert_eq!(usage("not json").status, 400);
    assert_eq!(usage(r#"{"total_tokens": 5}"#).status, 400);
    assert_eq!(
        usage(r#"{"reservation": "0123456789abcdef0123456789abcdef", "total_tokens": 5}"#).status,
        404
    );
    assert_eq!(
        gw.metric(SETTLED_BY_USAGE.replace("usage", "report").as_str()),
        15.0
    );
}

/// Issue 27: a prompt hidden anywhere the model reads it is counted before the request runs.
/// The issue's table, through the proxy and through the decision service: the same text, too
/// long for `max_prompt_tokens`, in every place an API shape puts text is refused
/// `prompt_tokens_exceeded` before the upstream; a short one is admitted with a reservation
/// that is the `simple_word` estimate of that text (plus the field names a schema counts), and
/// the default completion.
#[test]
fn every_place_a_prompt_hides_is_counted_before_the_upstream() {
    let policy = r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
        "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 10000000,
        "burst_tokens": 10000000, "max_prompt_tokens": 2000, "default_max_completion": 100}}]}"#;
    let upstream = FakeOpenAi::start();
    let gw = Gateway::start(Some(policy), Some(upstream.addr), &[]);
    // Where the text goes, and the body that puts it there.
    type Shape = (&'static str, fn(&str) -> String);
    let shapes: [Shape; 21] = [
        ("tools[].function.description", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools":[{{"type":"function","function":{{"name":"f","description":"{t}","parameters":{{"type":"object"}}}}}}]}}"#
            )
        }),
        ("functions[].description", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"functions":[{{"name":"f","description":"{t}"}}]}}"#
            )
        }),
        ("tool_calls[].function.arguments", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"assistant","tool_calls":[{{"id":"c1","type":"function","function":{{"name":"f","arguments":"{t}"}}}}]}}]}}"#
            )
        }),
        ("response_format.json_schema.schema", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"response_format":{{"type":"json_schema","json_schema":{{"name":"s","schema":{{"description":"{t}"}}}}}}}}"#
            )
        }),
        ("Gemini contents[].parts[].text", |t| {
            format!(r#"{{"contents":[{{"role":"user","parts":[{{"text":"{t}"}}]}}]}}"#)
        }),
        ("a message's name", |t| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","name":"{t}","content":"hi"}}]}}"#)
        }),
        ("messages[].content", |t| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{t}"}}]}}"#)
        }),
        ("Responses instructions", |t| {
            format!(r#"{{"model":"m","instructions":"{t}","input":"hi"}}"#)
        }),
        ("Responses input[].content[].text", |t| {
            format!(
                r#"{{"model":"m","input":[{{"role":"user","content":[{{"type":"input_text","text":"{t}"}}]}}]}}"#
            )
        }),
        ("Responses text.format.schema", |t| {
            format!(
                r#"{{"model":"m","input":"hi","text":{{"format":{{"type":"json_schema","name":"s","schema":{{"description":"{t}"}}}}}}}}"#
            )
        }),
        ("Responses tools[].description", |t| {
            format!(
                r#"{{"model":"m","input":"hi","tools":[{{"type":"function","name":"f","description":"{t}","parameters":{{"type":"object"}}}}]}}"#
            )
        }),
        ("Anthropic system blocks", |t| {
            format!(
                r#"{{"model":"m","system":[{{"type":"text","text":"{t}"}}],"messages":[{{"role":"user","content":"hi"}}]}}"#
            )
        }),
        ("Anthropic nested tool_result", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t1","content":[{{"type":"text","text":"{t}"}}]}}]}}]}}"#
            )
        }),
        ("Anthropic tool_use input (under a metadata key)", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"assistant","content":[{{"type":"tool_use","id":"t1","name":"f","input":{{"metadata":"{t}"}}}}]}}]}}"#
            )
        }),
        ("Anthropic tools[].input_schema", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools":[{{"name":"f","input_schema":{{"type":"object","description":"{t}"}}}}]}}"#
            )
        }),
        ("Gemini systemInstruction", |t| {
            format!(
                r#"{{"systemInstruction":{{"parts":[{{"text":"{t}"}}]}},"contents":[{{"role":"user","parts":[{{"text":"hi"}}]}}]}}"#
            )
        }),
        ("Gemini tools[].functionDeclarations", |t| {
            format!(
                r#"{{"contents":[{{"role":"user","parts":[{{"text":"hi"}}]}}],"tools":[{{"functionDeclarations":[{{"name":"f","description":"{t}"}}]}}]}}"#
            )
        }),
        ("Gemini functionCall.args", |t| {
            format!(
                r#"{{"contents":[{{"role":"model","parts":[{{"functionCall":{{"name":"f","args":{{"q":"{t}"}}}}}}]}}]}}"#
            )
        }),
        ("Gemini functionResponse.response", |t| {
            format!(
                r#"{{"contents":[{{"role":"user","parts":[{{"functionResponse":{{"name":"f","response":{{"status":"{t}"}}}}}}]}}]}}"#
            )
        }),
        ("an unknown field", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"some_future_field":{{"deep":["{t}"]}}}}"#
            )
        }),
        ("an OpenAI file part's file_data", |t| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"file","file":{{"file_data":"{t}"}}}}]}}]}}"#
            )
        }),
    ];
    let long = "lorem ipsum dolor sit amet ".repeat(6000); // 30 000 words: 40 000 tokens
    let short = "lorem ipsum dolor sit amet ".repeat(60); // 300 words: 400 tokens
                                                          // The decision service asked about a chat request of `key` with `body`.
    let decide = |key: &str, body: &str| {
        request_with_body(
            gw.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-Method", "POST"),
                ("X-Original-URI", "/v1/chat/completions"),
                ("X-Api-Key", key),
            ],
            body.as_bytes(),
        )
    };
    for (i, (place, body)) in shapes.iter().enumerate() {
        let key = format!("tenant-{i}");
        let r = chat(&gw, "/v1/chat/completions", &key, &body(&long));
        assert_eq!(
            (r.status, r.header("x-tollgate-reason")),
            (429, Some("prompt_tokens_exceeded")),
            "proxy, {place}"
        );
        let decided = decide(&key, &body(&long));
        assert_eq!(
            (decided.status, decided.header("x-tollgate-reason")),
            (429, Some("prompt_tokens_exceeded")),
            "decision service, {place}"
        );
        let decided = decide(&key, &body(&short));
        assert_eq!(decided.status, 200, "{place}");
        let reserved: u64 = decided
            .header("x-tollgate-reserved-tokens")
            .and_then(|v| v.parse().ok())
            .expect("reserved tokens");
        // 400 for the text, 100 for the completion, and the few words around it ("hi", a
        // function's name, a schema's field names): within 10 % of the text's own estimate.
        let prompt = reserved - 100;
        assert!((400..=440).contains(&prompt), "{place}: {prompt}");
    }
    assert_eq!(upstream.hits(), 0, "no long prompt reached the model");
}

/// An upstream that answers every request with `body` under `Content-Encoding: encoding`,
/// whatever the request asked for.
fn encoding_upstream(encoding: &'static str, body: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let body = Arc::new(body);
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let body = Arc::clone(&body);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut writer = conn;
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut request = vec![0u8; length];
                    if reader.read_exact(&mut request).is_err() {
                        return;
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: {encoding}\r\nContent-Length: {}\r\n\r\n",
                        body.len()
                    );
                    if writer
                        .write_all(head.as_bytes())
                        .and_then(|()| writer.write_all(&body))
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Issue 27: an upstream that compresses its answer although it was asked for identity still
/// has its `usage` read: gzip, deflate, br and zstd each settle on the 5 010 tokens the model
/// reports (the client gets the compressed bytes as sent). An encoding that cannot be decoded,
/// and a decompression bomb, leave the reservation charged as reserved, counted by reason.
#[test]
fn compressed_answers_settle_on_their_usage() {
    use std::io::Write as _;
    let policy = r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"],
        "algorithm": "token_bucket_llm", "algorithm_config": {"tokens_per_minute": 10000000,
        "burst_tokens": 10000000, "tokens_per_day": 100000}}]}"#;
    let answer = br#"{"id":"c","choices":[{"message":{"role":"assistant","content":"long"}}],"usage":{"prompt_tokens":10,"completion_tokens":5000,"total_tokens":5010}}"#;
    let gzip = |data: &[u8]| {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    };
    let deflate = {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(answer).unwrap();
        e.finish().unwrap()
    };
    let br = {
        let mut out = Vec::new();
        let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
        w.write_all(answer).unwrap();
        drop(w);
        out
    };
    let zstd = zstd::stream::encode_all(&answer[..], 3).unwrap();
    let bomb = gzip(&vec![b' '; 40 << 20]);
    let cases: [(&'static str, Vec<u8>, u64, &str); 6] = [
        ("gzip", gzip(answer), 5010, "usage"),
        ("deflate", deflate, 5010, "usage"),
        ("br", br, 5010, "usage"),
        ("zstd", zstd, 5010, "usage"),
        ("compress", answer.to_vec(), 804, "undecodable"),
        ("gzip", bomb, 804, "undecodable"),
    ];
    for (i, (encoding, body, charged, source)) in cases.into_iter().enumerate() {
        let sent = body.clone();
        let upstream = encoding_upstream(encoding, body);
        // A response limit of 1 MiB: the bomb decodes to 40 MiB, past 16 × the limit.
        let gw = Gateway::start(
            Some(policy),
            Some(upstream),
            &["--max-body-bytes", "1048576"],
        );
        let r = chat(&gw, "/v1/chat/completions", "tenant", CHAT);
        assert_eq!(r.status, 200, "{encoding}");
        assert_eq!(r.header("content-encoding"), Some(encoding));
        if i < 5 {
            assert_eq!(
                r.body.as_bytes(),
                String::from_utf8_lossy(&sent).as_bytes(),
                "{encoding}: the bytes as sent"
            );
        }
        wait_settled(
            &gw,
            &format!("tollgate_llm_settlements_total{{source=\"{source}\"}}"),
            1,
        );
        if source == "undecodable" {
            let reason = if i == 4 {
                "unknown_encoding"
            } else {
                "too_large"
            };
            let series = format!(
                "tollgate_llm_undecodable_responses_total{{encoding=\"{}\",reason=\"{reason}\"}}",
                if i == 4 { "other" } else { "gzip" }
            );
            assert_eq!(gw.metric(&series), 1.0, "{series}\n{}", gw.metrics());
        }
        let next = chat(&gw, "/v1/chat/completions", "tenant", CHAT);
        assert_eq!(
            remaining(&next, "chat:tpd"),
            100_000 - charged - 804,
            "{encoding} (case {i}) charged {charged}"
        );
    }
}
