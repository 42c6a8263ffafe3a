//! A live OTLP/HTTP trace receiver for the load harness (`benches/load.sh`, targets
//! `tg-1-otel*`): accepts `POST /v1/traces` with protobuf bodies, counts the spans of each by
//! walking the protobuf framing (`ExportTraceServiceRequest.resource_spans` →
//! `ResourceSpans.scope_spans` → `ScopeSpans.spans`), decodes one batch in N in full with the
//! official definitions (`opentelemetry-proto`) and checks it holds as many spans, and answers
//! `200` (`400` for a body that does not parse). The gateway's exporter meets a real peer.
//!
//! Why not decode every batch: the harness has two cores, and the receiver shares core 0 with
//! wrk and the upstream. Work on core 0 makes the proxy on core 1 slower per request (a busy
//! loop taking 10 % of core 0 adds about 6 % to an untraced tollgate's CPU per request), so a
//! receiver that decodes everything would charge the collector's cost to the gateway.
//!
//! Usage: `cargo run --release --example otlp_sink -- 127.0.0.1:4318 [--decode-every N] [--print]`
//! (N = 1: every batch decoded in full; default 1). It prints the spans received every 5 s on
//! standard error. With `--print` (every batch then decoded) it is also a collector to try
//! traces with: each span on a line of standard output, its service, kind, name, trace and span
//! ids, status, attributes and event names (the manual's observability page runs it so).

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::encoding::decode_varint;
use prost::Message as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Calls `each` with the body of every length-delimited field numbered `tag` in a message's
/// bytes, skipping the other fields; `None` when the bytes are not a protobuf message.
fn each_message(mut buf: &[u8], tag: u64, each: &mut dyn FnMut(&[u8]) -> Option<()>) -> Option<()> {
    while !buf.is_empty() {
        let key = decode_varint(&mut buf).ok()?;
        match key & 7 {
            0 => {
                decode_varint(&mut buf).ok()?;
            }
            1 => buf = buf.get(8..)?,
            5 => buf = buf.get(4..)?,
            2 => {
                let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                let body = buf.get(..len)?;
                if key >> 3 == tag {
                    each(body)?;
                }
                buf = &buf[len..];
            }
            _ => return None,
        }
    }
    Some(())
}

/// The spans in an `ExportTraceServiceRequest`, counted from its framing alone.
fn count_spans(body: &[u8]) -> Option<usize> {
    let mut spans = 0;
    each_message(body, 1, &mut |resource_spans| {
        each_message(resource_spans, 2, &mut |scope_spans| {
            each_message(scope_spans, 2, &mut |_| {
                spans += 1;
                Some(())
            })
        })
    })?;
    Some(spans)
}

/// The spans in a batch decoded in full with the official definitions.
fn decoded_spans(body: &[u8]) -> Option<usize> {
    let request = ExportTraceServiceRequest::decode(body).ok()?;
    Some(
        request
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum(),
    )
}

/// An attribute's value as text: strings as they are, arrays and maps in brackets.
fn value_text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        None => String::new(),
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BytesValue(b)) => hex(b),
        Some(any_value::Value::ArrayValue(a)) => format!(
            "[{}]",
            a.values
                .iter()
                .map(|v| value_text(Some(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Some(any_value::Value::KvlistValue(l)) => format!("{{{}}}", attributes_text(&l.values)),
    }
}

fn attributes_text(attributes: &[KeyValue]) -> String {
    attributes
        .iter()
        .map(|kv| format!("{}={}", kv.key, value_text(kv.value.as_ref())))
        .collect::<Vec<_>>()
        .join(" ")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One line for a span: `SERVICE KIND NAME trace=… span=… [parent=…] status=… attributes
/// [events=a,b]`.
fn span_line(service: &str, span: &Span) -> String {
    let kind = match span.kind {
        1 => "INTERNAL",
        2 => "SERVER",
        3 => "CLIENT",
        4 => "PRODUCER",
        5 => "CONSUMER",
        _ => "UNSPECIFIED",
    };
    let status = match span.status.as_ref().map_or(0, |s| s.code) {
        1 => "ok",
        2 => "error",
        _ => "unset",
    };
    let mut line = format!(
        "{service} {kind} {:?} trace={} span={}",
        span.name,
        hex(&span.trace_id),
        hex(&span.span_id)
    );
    if !span.parent_span_id.is_empty() {
        line.push_str(&format!(" parent={}", hex(&span.parent_span_id)));
    }
    line.push_str(&format!(" status={status}"));
    if !span.attributes.is_empty() {
        line.push(' ');
        line.push_str(&attributes_text(&span.attributes));
    }
    if !span.events.is_empty() {
        let names: Vec<&str> = span.events.iter().map(|e| e.name.as_str()).collect();
        line.push_str(&format!(" events={}", names.join(",")));
    }
    line
}

/// The lines `--print` writes for a batch: one per span, in order.
fn batch_lines(request: &ExportTraceServiceRequest) -> Vec<String> {
    let mut lines = Vec::new();
    for resource_spans in &request.resource_spans {
        let service = resource_spans
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
            .map_or_else(|| "?".to_string(), |kv| value_text(kv.value.as_ref()));
        for scope_spans in &resource_spans.scope_spans {
            for span in &scope_spans.spans {
                lines.push(span_line(&service, span));
            }
        }
    }
    lines
}

fn main() {
    const USAGE: &str = "usage: otlp_sink ADDR [--decode-every N] [--print]";
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:4318".to_string());
    let mut decode_every: u64 = 1;
    let mut print = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--decode-every" => {
                let n = args.next().unwrap_or_default();
                decode_every = match n.parse() {
                    Ok(n) if n > 0 => n,
                    _ => panic!("--decode-every takes a positive whole number, not {n:?}"),
                };
            }
            "--print" => print = true,
            other => panic!("{USAGE}; not {other:?}"),
        }
    }
    if print {
        decode_every = 1;
    }
    let batches = Arc::new(AtomicU64::new(0));
    let listener = TcpListener::bind(&addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    eprintln!("otlp_sink: OTLP/HTTP traces on http://{addr}/v1/traces");
    let spans = Arc::new(AtomicU64::new(0));
    let report = Arc::clone(&spans);
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(5));
        eprintln!("otlp_sink: {} spans", report.load(Ordering::Relaxed));
    });
    for conn in listener.incoming().flatten() {
        let spans = Arc::clone(&spans);
        let batches = Arc::clone(&batches);
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
                let in_full = batches.fetch_add(1, Ordering::Relaxed) % decode_every == 0;
                if print {
                    if let Ok(request) = ExportTraceServiceRequest::decode(&body[..]) {
                        let out = std::io::stdout();
                        let mut out = out.lock();
                        for line in batch_lines(&request) {
                            let _ = writeln!(out, "{line}");
                        }
                        let _ = out.flush();
                    }
                }
                let status = match (count_spans(&body), in_full.then(|| decoded_spans(&body))) {
                    (Some(n), None) => {
                        spans.fetch_add(n as u64, Ordering::Relaxed);
                        "200 OK"
                    }
                    (Some(n), Some(Some(decoded))) if decoded == n => {
                        spans.fetch_add(n as u64, Ordering::Relaxed);
                        "200 OK"
                    }
                    (Some(n), Some(Some(decoded))) => {
                        eprintln!("otlp_sink: {n} spans in the framing, {decoded} decoded");
                        "400 Bad Request"
                    }
                    _ => {
                        eprintln!("otlp_sink: a batch that does not decode ({length} bytes)");
                        "400 Bad Request"
                    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

    fn scope(spans: usize) -> ScopeSpans {
        ScopeSpans {
            spans: (0..spans)
                .map(|i| Span {
                    name: format!("span {i}"),
                    trace_id: vec![1; 16],
                    start_time_unix_nano: 1_700_000_000_000_000_000,
                    ..Span::default()
                })
                .collect(),
            schema_url: "https://opentelemetry.io/schemas/1.26.0".to_string(),
            ..ScopeSpans::default()
        }
    }

    #[test]
    fn spans_are_counted_from_the_framing_as_the_full_decode_counts_them() {
        let request = ExportTraceServiceRequest {
            resource_spans: vec![
                ResourceSpans {
                    resource: Some(Resource::default()),
                    scope_spans: vec![scope(3), scope(0)],
                    schema_url: "x".to_string(),
                },
                ResourceSpans {
                    resource: None,
                    scope_spans: vec![scope(2)],
                    schema_url: String::new(),
                },
            ],
        };
        let body = request.encode_to_vec();
        assert_eq!(count_spans(&body), Some(5));
        assert_eq!(decoded_spans(&body), Some(5));
        assert_eq!(count_spans(&[]), Some(0));
        // Cut short, or an invalid wire type: not a message.
        assert_eq!(count_spans(&body[..body.len() - 1]), None);
        assert_eq!(count_spans(&[0x0f]), None);
    }

    #[test]
    fn print_writes_one_line_per_span_with_its_attributes() {
        use opentelemetry_proto::tonic::trace::v1::{span::Event, Status};
        let text = |key: &str, value: &str| KeyValue {
            key: key.to_string(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(value.to_string())),
            }),
        };
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource {
                    attributes: vec![text("service.name", "edge")],
                    ..Resource::default()
                }),
                scope_spans: vec![ScopeSpans {
                    spans: vec![Span {
                        name: "GET".to_string(),
                        kind: 2,
                        trace_id: vec![0xab; 16],
                        span_id: vec![0x01; 8],
                        status: Some(Status {
                            code: 2,
                            ..Status::default()
                        }),
                        attributes: vec![
                            text("tollgate.decision", "refuse"),
                            KeyValue {
                                key: "http.response.status_code".to_string(),
                                value: Some(AnyValue {
                                    value: Some(any_value::Value::IntValue(429)),
                                }),
                            },
                        ],
                        events: vec![Event {
                            name: "connect".to_string(),
                            ..Event::default()
                        }],
                        ..Span::default()
                    }],
                    ..ScopeSpans::default()
                }],
                schema_url: String::new(),
            }],
        };
        assert_eq!(
            batch_lines(&request),
            [format!(
                "edge SERVER \"GET\" trace={} span=0101010101010101 status=error \
                 tollgate.decision=refuse http.response.status_code=429 events=connect",
                "ab".repeat(16)
            )]
        );
    }
}
