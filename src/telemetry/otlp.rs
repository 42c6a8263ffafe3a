//! OTLP/protobuf written by hand from [`SpanRecord`]s: one `ExportTraceServiceRequest` per
//! batch, its resource and instrumentation scope written once (precomputed at start), each span
//! written field by field. Field numbers are those of `opentelemetry/proto/trace/v1/trace.proto`,
//! `common/v1/common.proto` and `resource/v1/resource.proto`; the unit tests decode the output
//! with the official generated types.

use super::span::{Kind, SpanRecord, UpstreamEvent};
use prost::encoding::{encode_varint, encoded_len_varint};
use std::fmt::Write as _;

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

/// A varint, without going through `BufMut` for the one-byte values most of ours are.
#[inline]
fn varint(out: &mut Vec<u8>, value: u64) {
    if value < 0x80 {
        out.push(value as u8);
    } else {
        encode_varint(value, out);
    }
}

#[inline]
fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
    varint(out, field << 3 | wire);
}

/// An IP address as text: IPv4 (nearly every address here) by hand, IPv6 through `Display`.
fn ip_text(ip: std::net::IpAddr, text: &mut String) {
    text.clear();
    match ip {
        std::net::IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    text.push('.');
                }
                if octet >= 100 {
                    text.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    text.push(char::from(b'0' + octet / 10 % 10));
                }
                text.push(char::from(b'0' + octet % 10));
            }
        }
        std::net::IpAddr::V6(v6) => {
            let _ = write!(text, "{v6}");
        }
    }
}

#[inline]
fn bytes_field(out: &mut Vec<u8>, field: u64, value: &[u8]) {
    key(out, field, LEN);
    varint(out, value.len() as u64);
    out.extend_from_slice(value);
}

/// A length-delimited message `field` whose body `body` writes: the body goes after room for
/// the longest length prefix, which is then written and the body moved up against it.
fn nested(out: &mut Vec<u8>, field: u64, body: impl FnOnce(&mut Vec<u8>)) {
    const ROOM: usize = 10;
    key(out, field, LEN);
    let start = out.len();
    out.extend_from_slice(&[0; ROOM]);
    body(out);
    let len = out.len() - start - ROOM;
    let n = encoded_len_varint(len as u64);
    let mut prefix = [0u8; ROOM];
    encode_varint(len as u64, &mut &mut prefix[..]);
    out.copy_within(start + ROOM.., start + n);
    out.truncate(out.len() - (ROOM - n));
    out[start..start + n].copy_from_slice(&prefix[..n]);
}

/// The value of a `KeyValue` (an `AnyValue`).
enum Value<'a> {
    Str(&'a str),
    Int(i64),
    Bool(bool),
}

/// A `KeyValue` as field `field` (a span's, an event's, a resource's attributes).
fn attribute(out: &mut Vec<u8>, field: u64, name: &str, value: Value<'_>) {
    let any_len = match value {
        Value::Str(s) => 1 + encoded_len_varint(s.len() as u64) + s.len(),
        Value::Int(n) => 1 + encoded_len_varint(n as u64),
        Value::Bool(_) => 2,
    };
    let kv_len = 1
        + encoded_len_varint(name.len() as u64)
        + name.len()
        + 1
        + encoded_len_varint(any_len as u64)
        + any_len;
    out.reserve(kv_len + 4);
    key(out, field, LEN);
    varint(out, kv_len as u64);
    bytes_field(out, 1, name.as_bytes());
    key(out, 2, LEN);
    varint(out, any_len as u64);
    match value {
        Value::Str(s) => bytes_field(out, 1, s.as_bytes()),
        Value::Bool(b) => {
            key(out, 2, VARINT);
            out.push(u8::from(b));
        }
        Value::Int(n) => {
            key(out, 3, VARINT);
            varint(out, n as u64);
        }
    }
}

/// Writes batches for one resource and scope.
pub struct Encoder {
    /// `ResourceSpans.resource` and the start of nothing else: written before each batch's
    /// scope spans.
    resource: Vec<u8>,
    /// `ScopeSpans.scope`.
    scope: Vec<u8>,
    /// Addresses as text.
    text: String,
}

impl Encoder {
    /// `resource`: the resource's attributes, in order.
    pub fn new(resource: &[(String, String)]) -> Encoder {
        let mut resource_field = Vec::new();
        nested(&mut resource_field, 1, |out| {
            for (name, value) in resource {
                attribute(out, 1, name, Value::Str(value));
            }
        });
        let mut scope = Vec::new();
        nested(&mut scope, 1, |out| bytes_field(out, 1, b"tollgate"));
        Encoder {
            resource: resource_field,
            scope,
            text: String::new(),
        }
    }

    /// An `ExportTraceServiceRequest` of `spans`, into `out` (cleared first). The spans are
    /// written first, into `spans_buf`; the enclosing messages' lengths then follow from it,
    /// so the batch is copied once rather than moved up at each level.
    pub fn encode(&mut self, spans: &[SpanRecord], spans_buf: &mut Vec<u8>, out: &mut Vec<u8>) {
        out.clear();
        spans_buf.clear();
        for span in spans {
            // ScopeSpans.spans
            nested(spans_buf, 2, |out| write_span(out, span, &mut self.text));
        }
        let len = |n: usize| n + 1 + encoded_len_varint(n as u64);
        let scope_spans = self.scope.len() + spans_buf.len();
        let resource_spans = self.resource.len() + len(scope_spans);
        out.reserve(len(resource_spans));
        // ExportTraceServiceRequest.resource_spans
        key(out, 1, LEN);
        varint(out, resource_spans as u64);
        out.extend_from_slice(&self.resource);
        // ResourceSpans.scope_spans
        key(out, 2, LEN);
        varint(out, scope_spans as u64);
        out.extend_from_slice(&self.scope);
        out.extend_from_slice(spans_buf);
    }
}

fn write_span(out: &mut Vec<u8>, span: &SpanRecord, text: &mut String) {
    bytes_field(out, 1, &span.trace_id);
    bytes_field(out, 2, &span.span_id);
    if let Some(state) = &span.trace_state {
        bytes_field(out, 3, state.as_bytes());
    }
    let has_parent = span.parent_span_id != [0; 8];
    if has_parent {
        bytes_field(out, 4, &span.parent_span_id);
    }
    match (&span.route, span.name_has_route) {
        (Some(route), true) => {
            key(out, 5, LEN);
            encode_varint((span.name.len() + 1 + route.len()) as u64, out);
            out.extend_from_slice(span.name.as_bytes());
            out.push(b' ');
            out.extend_from_slice(route.as_bytes());
        }
        _ => bytes_field(out, 5, span.name.as_bytes()),
    }
    key(out, 6, VARINT);
    out.push(match span.kind {
        Kind::Server => 2,
        Kind::Client => 3,
    });
    key(out, 7, FIXED64);
    out.extend_from_slice(&span.start.to_le_bytes());
    key(out, 8, FIXED64);
    out.extend_from_slice(&span.end.to_le_bytes());
    write_attributes(out, span, text);
    for (time, event) in &span.events {
        nested(out, 11, |out| write_event(out, *time, event, text));
    }
    // Status: message (2) and code (3: 2 is ERROR); unset when there was no error.
    nested(out, 15, |out| {
        if let Some(message) = &span.error {
            if !message.is_empty() {
                bytes_field(out, 2, message.as_bytes());
            }
            key(out, 3, VARINT);
            out.push(2);
        }
    });
    // Flags: the sampled bit, and "the parent's remoteness is known" (0x100), remote (0x200)
    // when there is a parent: a SERVER span's comes from a caller, a CLIENT span's is the
    // SERVER span, handed over as a context.
    let flags: u32 = 0x101 | if has_parent { 0x200 } else { 0 };
    key(out, 16, FIXED32);
    out.extend_from_slice(&flags.to_le_bytes());
}

fn write_attributes(out: &mut Vec<u8>, span: &SpanRecord, text: &mut String) {
    const A: u64 = 9;
    if let Some(method) = span.method {
        attribute(out, A, "http.request.method", Value::Str(method));
    }
    if let Some(path) = &span.url_path {
        attribute(out, A, "url.path", Value::Str(path));
    }
    if let Some(route) = &span.route {
        attribute(out, A, "http.route", Value::Str(route));
    }
    if let Some(host) = &span.server_address {
        attribute(out, A, "server.address", Value::Str(host));
    }
    if let Some(version) = span.protocol_version {
        attribute(out, A, "network.protocol.version", Value::Str(version));
    }
    if let Some((service, method)) = span.rpc {
        attribute(out, A, "rpc.system", Value::Str("grpc"));
        attribute(out, A, "rpc.service", Value::Str(service));
        attribute(out, A, "rpc.method", Value::Str(method));
    }
    if let Some(group) = &span.upstream_group {
        attribute(out, A, "tollgate.upstream_group", Value::Str(group));
    }
    if let Some(server) = span.upstream {
        ip_text(server.ip(), text);
        attribute(out, A, "server.address", Value::Str(text));
        attribute(out, A, "server.port", Value::Int(i64::from(server.port())));
    }
    if let Some(ip) = span.client_address {
        ip_text(ip, text);
        attribute(out, A, "client.address", Value::Str(text));
    }
    if let Some(decision) = span.decision {
        attribute(out, A, "tollgate.decision", Value::Str(decision));
    }
    if let Some(policy) = &span.policy {
        attribute(out, A, "tollgate.policy", Value::Str(policy));
    }
    if let Some(rule) = &span.rule {
        attribute(out, A, "tollgate.rule", Value::Str(rule));
    }
    if let Some(reason) = span.reason {
        attribute(out, A, "tollgate.reason", Value::Str(reason));
    }
    if let Some(remaining) = span.remaining {
        attribute(out, A, "tollgate.remaining", Value::Int(remaining));
    }
    if let Some(code) = span.grpc_status {
        attribute(out, A, "rpc.grpc.status_code", Value::Int(i64::from(code)));
    }
    if let Some(code) = span.status_code {
        attribute(
            out,
            A,
            "http.response.status_code",
            Value::Int(i64::from(code)),
        );
    }
}

fn write_event(out: &mut Vec<u8>, time: u64, event: &UpstreamEvent, text: &mut String) {
    key(out, 1, FIXED64);
    out.extend_from_slice(&time.to_le_bytes());
    bytes_field(out, 2, event.name().as_bytes());
    let (server, attempt) = event.server();
    ip_text(server.ip(), text);
    attribute(out, 3, "server.address", Value::Str(text));
    attribute(out, 3, "server.port", Value::Int(i64::from(server.port())));
    attribute(
        out,
        3,
        "tollgate.attempt",
        Value::Int(i64::try_from(attempt).unwrap_or(i64::MAX)),
    );
    match *event {
        UpstreamEvent::Connect { reused, .. } => {
            attribute(out, 3, "tollgate.connection_reused", Value::Bool(reused));
        }
        UpstreamEvent::ConnectFailed { failure, .. } => {
            attribute(out, 3, "tollgate.connect_failure", Value::Str(failure));
        }
        UpstreamEvent::Retry { .. } | UpstreamEvent::Ejection { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
    use opentelemetry_proto::tonic::common::v1::KeyValue;
    use prost::Message as _;
    use std::sync::Arc;

    fn find(attributes: &[KeyValue], name: &str) -> Option<Any> {
        attributes
            .iter()
            .find(|kv| kv.key == name)
            .and_then(|kv| kv.value.clone())
            .and_then(|v| v.value)
    }

    fn server_span() -> SpanRecord {
        let mut span = SpanRecord::new(
            Kind::Server,
            "GET",
            [0x4b; 16],
            [7; 8],
            [9; 8],
            Some(Arc::from("vendor=1")),
        );
        span.start = 1_700_000_000_000_000_001;
        span.end = 1_700_000_000_000_500_000;
        span.name_has_route = true;
        span.route = Some("/v1".into());
        span.method = Some("GET");
        span.url_path = Some("/v1/orders".to_string());
        span.server_address = Some("api.example.com".to_string());
        span.protocol_version = Some("1.1");
        span.client_address = Some("2001:db8::1".parse().unwrap());
        span.status_code = Some(503);
        span.error = Some("upstream".to_string());
        span.decision = Some("allow");
        span.policy = Some("p".to_string());
        span.rule = Some("per-ip".to_string());
        span.remaining = Some(-1);
        span
    }

    #[test]
    fn a_batch_decodes_with_the_official_definitions() {
        let mut client = SpanRecord::new(Kind::Client, "GET", [0x4b; 16], [8; 8], [7; 8], None);
        client.end = 5;
        client.upstream = Some("127.0.0.1:8080".parse().unwrap());
        client.upstream_group = Some("api".to_string());
        client.events.push((
            3,
            UpstreamEvent::ConnectFailed {
                server: "127.0.0.1:8080".parse().unwrap(),
                attempt: 1,
                failure: "refused",
            },
        ));
        client.events.push((
            4,
            UpstreamEvent::Connect {
                server: "[::1]:81".parse().unwrap(),
                attempt: 2,
                reused: true,
            },
        ));
        let mut root = SpanRecord::new(
            Kind::Server,
            "POST /v1/decision",
            [1; 16],
            [2; 8],
            [0; 8],
            None,
        );
        root.rpc = Some(("svc", "Check"));
        root.grpc_status = Some(0);
        let mut encoder = Encoder::new(&[
            ("service.name".to_string(), "edge".to_string()),
            ("deployment.environment".to_string(), "prod".to_string()),
        ]);
        let mut body = Vec::new();
        encoder.encode(&[server_span(), client, root], &mut Vec::new(), &mut body);
        let request = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
        assert_eq!(request.resource_spans.len(), 1);
        let resource = request.resource_spans[0].resource.clone().unwrap();
        assert_eq!(
            find(&resource.attributes, "service.name"),
            Some(Any::StringValue("edge".into()))
        );
        assert_eq!(resource.attributes.len(), 2);
        let scope = &request.resource_spans[0].scope_spans[0];
        assert_eq!(scope.scope.as_ref().unwrap().name, "tollgate");
        let spans = &scope.spans;
        assert_eq!(spans.len(), 3);

        let server = &spans[0];
        assert_eq!(server.trace_id, vec![0x4b; 16]);
        assert_eq!(server.span_id, vec![7; 8]);
        assert_eq!(server.parent_span_id, vec![9; 8]);
        assert_eq!(server.trace_state, "vendor=1");
        assert_eq!(server.name, "GET /v1");
        assert_eq!(server.kind, 2);
        assert_eq!(server.start_time_unix_nano, 1_700_000_000_000_000_001);
        assert_eq!(server.end_time_unix_nano, 1_700_000_000_000_500_000);
        assert_eq!(server.flags, 0x301);
        let status = server.status.clone().unwrap();
        assert_eq!((status.code, status.message.as_str()), (2, "upstream"));
        let a = &server.attributes;
        assert_eq!(
            find(a, "http.request.method"),
            Some(Any::StringValue("GET".into()))
        );
        assert_eq!(
            find(a, "url.path"),
            Some(Any::StringValue("/v1/orders".into()))
        );
        assert_eq!(find(a, "http.route"), Some(Any::StringValue("/v1".into())));
        assert_eq!(
            find(a, "server.address"),
            Some(Any::StringValue("api.example.com".into()))
        );
        assert_eq!(
            find(a, "network.protocol.version"),
            Some(Any::StringValue("1.1".into()))
        );
        assert_eq!(
            find(a, "client.address"),
            Some(Any::StringValue("2001:db8::1".into()))
        );
        assert_eq!(
            find(a, "http.response.status_code"),
            Some(Any::IntValue(503))
        );
        assert_eq!(
            find(a, "tollgate.decision"),
            Some(Any::StringValue("allow".into()))
        );
        assert_eq!(
            find(a, "tollgate.policy"),
            Some(Any::StringValue("p".into()))
        );
        assert_eq!(
            find(a, "tollgate.rule"),
            Some(Any::StringValue("per-ip".into()))
        );
        assert_eq!(find(a, "tollgate.remaining"), Some(Any::IntValue(-1)));
        assert_eq!(a.len(), 11);

        let client = &spans[1];
        assert_eq!(client.kind, 3);
        assert_eq!(client.name, "GET");
        assert_eq!(client.flags, 0x301);
        assert_eq!(client.status.clone().unwrap().code, 0);
        assert_eq!(
            find(&client.attributes, "server.port"),
            Some(Any::IntValue(8080))
        );
        assert_eq!(
            find(&client.attributes, "tollgate.upstream_group"),
            Some(Any::StringValue("api".into()))
        );
        let events: Vec<(&str, u64)> = client
            .events
            .iter()
            .map(|e| (e.name.as_str(), e.time_unix_nano))
            .collect();
        assert_eq!(events, vec![("connect_failed", 3), ("connect", 4)]);
        assert_eq!(
            find(&client.events[0].attributes, "tollgate.connect_failure"),
            Some(Any::StringValue("refused".into()))
        );
        assert_eq!(
            find(&client.events[1].attributes, "server.address"),
            Some(Any::StringValue("::1".into()))
        );
        assert_eq!(
            find(&client.events[1].attributes, "tollgate.connection_reused"),
            Some(Any::BoolValue(true))
        );
        assert_eq!(
            find(&client.events[1].attributes, "tollgate.attempt"),
            Some(Any::IntValue(2))
        );

        let root = &spans[2];
        assert!(root.parent_span_id.is_empty());
        assert_eq!(root.flags, 0x101);
        assert_eq!(root.name, "POST /v1/decision");
        assert_eq!(
            find(&root.attributes, "rpc.system"),
            Some(Any::StringValue("grpc".into()))
        );
        assert_eq!(
            find(&root.attributes, "rpc.grpc.status_code"),
            Some(Any::IntValue(0))
        );
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        let mut text = String::new();
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "203.0.113.255",
            "10.20.100.9",
            "::1",
            "2001:db8::7",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            ip_text(ip, &mut text);
            assert_eq!(text, ip.to_string());
        }
    }

    #[test]
    fn a_long_span_gets_a_long_length_prefix() {
        let mut span = server_span();
        span.url_path = Some("/x".repeat(10_000));
        let mut body = Vec::new();
        Encoder::new(&[]).encode(&[span.clone(), span], &mut Vec::new(), &mut body);
        let request = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
        let spans = &request.resource_spans[0].scope_spans[0].spans;
        assert_eq!(spans.len(), 2);
        assert_eq!(
            find(&spans[1].attributes, "url.path"),
            Some(Any::StringValue("/x".repeat(10_000)))
        );
    }
}
