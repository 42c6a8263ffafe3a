//! A live OTLP/HTTP trace receiver for the load harness (`benches/load.sh`, targets
//! `tg-1-otel*`): accepts `POST /v1/traces` with protobuf bodies, decodes each with the official
//! definitions (`opentelemetry-proto`), counts the spans and answers `200`. It does the work a
//! collector's receiver does, so the gateway's exporter meets a real peer.
//!
//! Usage: `cargo run --release --example otlp_sink -- 127.0.0.1:4318` (prints the spans received
//! every 5 s on standard error).

use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use prost::Message as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:4318".to_string());
    let listener = TcpListener::bind(&addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    let spans = Arc::new(AtomicU64::new(0));
    let report = Arc::clone(&spans);
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(5));
        eprintln!("otlp_sink: {} spans", report.load(Ordering::Relaxed));
    });
    for conn in listener.incoming().flatten() {
        let spans = Arc::clone(&spans);
        std::thread::spawn(move || {
            let Ok(read_half) = conn.try_clone() else {
                return;
            };
            let mut reader = BufReader::new(read_half);
            let mut writer = conn;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let mut length = 0usize;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 {
                        return;
                    }
                    let header = header.trim_end();
                    if header.is_empty() {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':') {
                        if name.eq_ignore_ascii_case("content-length") {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                let status = match ExportTraceServiceRequest::decode(body.as_slice()) {
                    Ok(request) => {
                        let n: usize = request
                            .resource_spans
                            .iter()
                            .flat_map(|r| &r.scope_spans)
                            .map(|s| s.spans.len())
                            .sum();
                        spans.fetch_add(n as u64, Ordering::Relaxed);
                        "200 OK"
                    }
                    Err(_) => "400 Bad Request",
                };
                let reply = ExportTraceServiceResponse {
                    partial_success: None,
                }
                .encode_to_vec();
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\n\r\n",
                    reply.len()
                );
                if writer.write_all(head.as_bytes()).is_err() || writer.write_all(&reply).is_err() {
                    return;
                }
            }
        });
    }
}
