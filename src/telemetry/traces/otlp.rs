//! OTLP/protobuf written by hand from requests' records ([`Finished`]): one
//! `ExportTraceServiceRequest` per batch, its resource and instrumentation scope written once
//! (precomputed at start), each span written field by field. Field numbers are those of `opentelemetry/proto/trace/v1/trace.proto`,
//! `common/v1/common.proto` and `resource/v1/resource.proto`; the unit tests decode the output
//! with the official generated types.

use super::span::{Finished, Kind, SpanRecord, TextAt, UpstreamEvent};
use prost::encoding::encoded_len_varint;

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

/// An address's text, kept for the next span: most spans of a batch name the same upstream
/// server, and often the same client.
#[derive(Default)]
struct AddressText {
    ip: Option<std::net::IpAddr>,
    text: String,
}

impl AddressText {
    fn of(&mut self, ip: std::net::IpAddr) -> &str {
        if self.ip != Some(ip) {
            // IPv4 (nearly every address here) by hand, IPv6 through `Display`.
            self.text.clear();
            crate::telemetry::log_line::push_ip(&mut self.text, ip);
            self.ip = Some(ip);
        }
        &self.text
    }
}

/// The encoder's address texts: the clients', and the upstream servers'.
#[derive(Default)]
struct Texts {
    client: AddressText,
    server: AddressText,
}

/// The value of a `KeyValue` (an `AnyValue`).
enum Value<'a> {
    Str(&'a str),
    Int(i64),
    Bool(bool),
}

/// A span's bytes written into a slice sized beforehand ([`span_bound`]), so that no write
/// checks a `Vec`'s capacity: about half the instructions of writing through `Vec::push`.
struct Cursor<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Cursor<'_> {
    #[inline(always)]
    fn byte(&mut self, b: u8) {
        self.buf[self.at] = b;
        self.at += 1;
    }

    #[inline(always)]
    fn bytes(&mut self, bytes: &[u8]) {
        self.buf[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
    }

    #[inline(always)]
    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.byte(value as u8 | 0x80);
            value >>= 7;
        }
        self.byte(value as u8);
    }

    /// A field's tag (every field number here is below 16: one byte).
    #[inline(always)]
    fn key(&mut self, field: u64, wire: u64) {
        self.byte((field << 3 | wire) as u8);
    }

    #[inline(always)]
    fn bytes_field(&mut self, field: u64, value: &[u8]) {
        self.key(field, LEN);
        self.varint(value.len() as u64);
        self.bytes(value);
    }

    /// A length-delimited message whose body `body` writes after `room` bytes kept for its
    /// length (one for events and the status, two for a span: what nearly all of them need);
    /// a body of another size is moved to fit its prefix (the bound leaves [`NESTED_SLACK`]
    /// bytes per message for that).
    fn nested(&mut self, field: u64, room: usize, body: impl FnOnce(&mut Self)) {
        self.key(field, LEN);
        let start = self.at;
        self.at += room;
        body(self);
        let len = self.at - start - room;
        let n = encoded_len_varint(len as u64);
        if n != room {
            self.buf.copy_within(start + room..self.at, start + n);
        }
        let end = start + n + len;
        self.at = start;
        self.varint(len as u64);
        self.at = end;
    }

    /// A `KeyValue` as field `field` (a span's or an event's attributes), its name known when
    /// compiling, so that the name is copied as a fixed number of bytes.
    #[inline(always)]
    fn attribute<const N: usize>(&mut self, field: u64, name: &[u8; N], value: Value<'_>) {
        match value {
            Value::Str(s) if N + s.len() + 8 < 0x80 => {
                // Every length one byte (nearly every attribute): two 4-byte heads, the name's
                // fixed copy and the value's.
                let any_len = 2 + s.len();
                let kv_len = 2 + N + 2 + any_len;
                self.head([(field << 3 | LEN) as u8, kv_len as u8, 0x0a, N as u8]);
                self.fixed(name);
                self.head([0x12, any_len as u8, 0x0a, s.len() as u8]);
                self.bytes(s.as_bytes());
            }
            Value::Int(n) if (0..0x20_0000).contains(&n) && N < 0x70 => {
                // A port, a status code, an attempt, a remainder: at most three varint bytes.
                let varint_len = 1 + usize::from(n >= 0x80) + usize::from(n >= 0x4000);
                let any_len = 1 + varint_len;
                let kv_len = 2 + N + 2 + any_len;
                self.head([(field << 3 | LEN) as u8, kv_len as u8, 0x0a, N as u8]);
                self.fixed(name);
                self.fixed(&[0x12, any_len as u8, 0x18]);
                self.varint(n as u64);
            }
            Value::Bool(b) if N < 0x70 => {
                self.head([(field << 3 | LEN) as u8, (2 + N + 4) as u8, 0x0a, N as u8]);
                self.fixed(name);
                self.head([0x12, 2, 0x10, u8::from(b)]);
            }
            _ => self.attribute_of_any_size(field, name, value),
        }
    }

    /// A `KeyValue` of any name and value (the resource's attributes are the operator's).
    fn attribute_of_any_size(&mut self, field: u64, name: &[u8], value: Value<'_>) {
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
        self.key(field, LEN);
        self.varint(kv_len as u64);
        self.bytes_field(1, name);
        self.key(2, LEN);
        self.varint(any_len as u64);
        match value {
            Value::Str(s) => self.bytes_field(1, s.as_bytes()),
            Value::Bool(b) => {
                self.key(2, VARINT);
                self.byte(u8::from(b));
            }
            Value::Int(n) => {
                self.key(3, VARINT);
                self.varint(n as u64);
            }
        }
    }

    /// `N` bytes, `N` known when compiling: a few moves rather than a call to `memcpy`.
    #[inline(always)]
    fn fixed<const N: usize>(&mut self, bytes: &[u8; N]) {
        self.buf[self.at..self.at + N].copy_from_slice(bytes);
        self.at += N;
    }

    /// Four bytes in one store.
    #[inline(always)]
    fn head(&mut self, bytes: [u8; 4]) {
        self.buf[self.at..self.at + 4].copy_from_slice(&bytes);
        self.at += 4;
    }
}

/// Room a nested message may need beyond its one-byte length prefix.
const NESTED_SLACK: usize = 9;
/// The longest attribute name the spans carry.
const LONGEST_NAME: usize = 32;
/// What one attribute costs beyond its name and string value: four tags and four length
/// prefixes of at most 10 bytes each.
const ATTRIBUTE_OVERHEAD: usize = 4 + 4 * 10;
/// The most attributes a span or an event carries.
const MOST_ATTRIBUTES: usize = 20;

/// The most bytes `span` can take, its own length prefix included: the strings it holds, and
/// a generous fixed part for everything of known size.
fn span_bound(span: &SpanRecord) -> usize {
    let text = |t: Option<TextAt>| t.map_or(0, TextAt::len);
    let variable = span.name.len()
        + 2 * text(span.route)
        + span.trace_state.as_deref().map_or(0, str::len)
        + text(span.error)
        + text(span.url_path)
        + text(span.server_address)
        + text(span.policy)
        + text(span.rule)
        + span.upstream_group.as_deref().map_or(0, str::len)
        + span
            .rpc
            .map_or(0, |(service, method)| service.len() + method.len());
    // Each attribute: its name, its overhead, a fixed-size value (static strings and
    // addresses are under 64 bytes).
    let per_attribute = LONGEST_NAME + ATTRIBUTE_OVERHEAD + 64;
    let fixed = 128 + NESTED_SLACK * 4 + MOST_ATTRIBUTES * per_attribute;
    let per_event = 64 + NESTED_SLACK + 5 * per_attribute;
    variable + fixed + span.events.len() * per_event
}

/// What `write` puts into a buffer of `bound` bytes, trimmed to it.
fn written(bound: usize, write: impl FnOnce(&mut Cursor<'_>)) -> Vec<u8> {
    let mut buf = vec![0; bound];
    let mut cursor = Cursor {
        buf: &mut buf,
        at: 0,
    };
    write(&mut cursor);
    let len = cursor.at;
    buf.truncate(len);
    buf
}

/// Writes batches for one resource and scope.
pub struct Encoder {
    /// `ResourceSpans.resource` and the start of nothing else: written before each batch's
    /// scope spans.
    resource: Vec<u8>,
    /// `ScopeSpans.scope`.
    scope: Vec<u8>,
    /// Addresses as text.
    texts: Texts,
}

impl Encoder {
    /// `resource`: the resource's attributes, in order.
    pub fn new(resource: &[(String, String)]) -> Encoder {
        let attributes: usize = resource
            .iter()
            .map(|(name, value)| name.len() + value.len() + ATTRIBUTE_OVERHEAD)
            .sum();
        // Resource.attributes
        let resource = written(11 + NESTED_SLACK + attributes, |c| {
            c.nested(1, 1, |c| {
                for (name, value) in resource {
                    c.attribute_of_any_size(1, name.as_bytes(), Value::Str(value));
                }
            });
        });
        // InstrumentationScope.name
        let scope = written(32, |c| c.nested(1, 1, |c| c.bytes_field(1, b"tollgate")));
        Encoder {
            resource,
            scope,
            texts: Texts::default(),
        }
    }

    /// An `ExportTraceServiceRequest` of `requests`' spans, written into `scratch` and
    /// returned as a slice of it ([`Encoder::encode_range`]).
    #[cfg(test)]
    pub fn encode<'s, 'b, I>(&mut self, requests: I, scratch: &'b mut Vec<u8>) -> &'b [u8]
    where
        I: IntoIterator<Item = &'s Finished>,
        I::IntoIter: Clone,
    {
        let range = self.encode_range(requests, scratch);
        &scratch[range]
    }

    /// An `ExportTraceServiceRequest` of `requests`' spans, written into `scratch`: where it is
    /// in it. The spans are written first, after room kept for what encloses them; the
    /// enclosing messages' lengths then follow from theirs and are written just in front, so
    /// no byte is copied twice. `scratch` is kept between batches: it only ever grows (to the
    /// largest bound seen), so it is zeroed once rather than for every batch.
    pub fn encode_range<'s, I>(
        &mut self,
        requests: I,
        scratch: &mut Vec<u8>,
    ) -> std::ops::Range<usize>
    where
        I: IntoIterator<Item = &'s Finished>,
        I::IntoIter: Clone,
    {
        let requests = requests.into_iter();
        // The two enclosing tags and lengths (at most 11 bytes each), the resource, the scope.
        let head_room = 2 * 11 + self.resource.len() + self.scope.len();
        let bound = head_room
            + requests
                .clone()
                .flat_map(Finished::in_order)
                .map(span_bound)
                .sum::<usize>();
        if scratch.len() < bound {
            scratch.resize(bound, 0);
        }
        let mut cursor = Cursor {
            buf: scratch.as_mut_slice(),
            at: head_room,
        };
        for request in requests {
            for span in request.in_order() {
                // ScopeSpans.spans
                cursor.nested(2, 2, |c| {
                    write_span(c, span, &request.text, &mut self.texts);
                });
            }
        }
        let end = cursor.at;
        let scope_spans = self.scope.len() + (end - head_room);
        let resource_spans =
            self.resource.len() + 1 + encoded_len_varint(scope_spans as u64) + scope_spans;
        let head_len = 1
            + encoded_len_varint(resource_spans as u64)
            + self.resource.len()
            + 1
            + encoded_len_varint(scope_spans as u64)
            + self.scope.len();
        let start = head_room - head_len;
        let mut head = Cursor {
            buf: &mut scratch[start..head_room],
            at: 0,
        };
        // ExportTraceServiceRequest.resource_spans
        head.key(1, LEN);
        head.varint(resource_spans as u64);
        head.bytes(&self.resource);
        // ResourceSpans.scope_spans
        head.key(2, LEN);
        head.varint(scope_spans as u64);
        head.bytes(&self.scope);
        start..end
    }
}

fn write_span(c: &mut Cursor<'_>, span: &SpanRecord, text: &str, texts: &mut Texts) {
    c.key(1, LEN);
    c.byte(16);
    c.fixed(&span.trace_id);
    c.key(2, LEN);
    c.byte(8);
    c.fixed(&span.span_id);
    if let Some(state) = &span.trace_state {
        c.bytes_field(3, state.as_bytes());
    }
    let has_parent = span.parent_span_id != [0; 8];
    if has_parent {
        c.key(4, LEN);
        c.byte(8);
        c.fixed(&span.parent_span_id);
    }
    match (span.route.map(|r| r.of(text)), span.name_has_route) {
        (Some(route), true) => {
            c.key(5, LEN);
            c.varint((span.name.len() + 1 + route.len()) as u64);
            c.bytes(span.name.as_bytes());
            c.byte(b' ');
            c.bytes(route.as_bytes());
        }
        _ => c.bytes_field(5, span.name.as_bytes()),
    }
    c.key(6, VARINT);
    c.byte(match span.kind {
        Kind::Server => 2,
        Kind::Client => 3,
    });
    c.key(7, FIXED64);
    c.fixed(&span.start.to_le_bytes());
    c.key(8, FIXED64);
    c.fixed(&span.end.to_le_bytes());
    write_attributes(c, span, text, texts);
    for (time, event) in &span.events {
        c.nested(11, 1, |c| write_event(c, *time, event, &mut texts.server));
    }
    // Status: message (2) and code (3: 2 is ERROR); unset when there was no error.
    c.nested(15, 1, |c| {
        if let Some(message) = span.error.map(|e| e.of(text)) {
            if !message.is_empty() {
                c.bytes_field(2, message.as_bytes());
            }
            c.key(3, VARINT);
            c.byte(2);
        }
    });
    // Flags: the sampled bit, and "the parent's remoteness is known" (0x100), remote (0x200)
    // when there is a parent: a SERVER span's comes from a caller, a CLIENT span's is the
    // SERVER span, handed over as a context.
    let flags: u32 = 0x101 | if has_parent { 0x200 } else { 0 };
    // (Field 16: its tag takes two bytes.)
    c.varint(16 << 3 | FIXED32);
    c.fixed(&flags.to_le_bytes());
}

fn write_attributes(c: &mut Cursor<'_>, span: &SpanRecord, text: &str, texts: &mut Texts) {
    const A: u64 = 9;
    if let Some(method) = span.method {
        c.attribute(A, b"http.request.method", Value::Str(method));
    }
    if let Some(path) = span.url_path.map(|t| t.of(text)) {
        c.attribute(A, b"url.path", Value::Str(path));
    }
    if let Some(route) = span.route.map(|t| t.of(text)) {
        c.attribute(A, b"http.route", Value::Str(route));
    }
    if let Some(host) = span.server_address.map(|t| t.of(text)) {
        c.attribute(A, b"server.address", Value::Str(host));
    }
    if let Some(version) = span.protocol_version {
        c.attribute(A, b"network.protocol.version", Value::Str(version));
    }
    if let Some((service, method)) = span.rpc {
        c.attribute(A, b"rpc.system", Value::Str("grpc"));
        c.attribute(A, b"rpc.service", Value::Str(service));
        c.attribute(A, b"rpc.method", Value::Str(method));
    }
    if let Some((service, method)) = span.proxied_rpc {
        c.attribute(A, b"rpc.system", Value::Str("grpc"));
        c.attribute(A, b"rpc.service", Value::Str(service.of(text)));
        c.attribute(A, b"rpc.method", Value::Str(method.of(text)));
    }
    if let Some(group) = &span.upstream_group {
        c.attribute(A, b"tollgate.upstream_group", Value::Str(group));
    }
    if let Some(server) = span.upstream {
        c.attribute(
            A,
            b"server.address",
            Value::Str(texts.server.of(server.ip())),
        );
        c.attribute(A, b"server.port", Value::Int(i64::from(server.port())));
    }
    if let Some(ip) = span.client_address {
        c.attribute(A, b"client.address", Value::Str(texts.client.of(ip)));
    }
    if let Some(decision) = span.decision {
        c.attribute(A, b"tollgate.decision", Value::Str(decision));
    }
    if let Some(policy) = span.policy.map(|t| t.of(text)) {
        c.attribute(A, b"tollgate.policy", Value::Str(policy));
    }
    if let Some(rule) = span.rule.map(|t| t.of(text)) {
        c.attribute(A, b"tollgate.rule", Value::Str(rule));
    }
    if let Some(reason) = span.reason {
        c.attribute(A, b"tollgate.reason", Value::Str(reason));
    }
    if let Some(remaining) = span.remaining {
        c.attribute(A, b"tollgate.remaining", Value::Int(remaining));
    }
    if let Some(ms) = span.paced_wait_ms {
        c.attribute(A, b"tollgate.paced_wait_ms", Value::Int(ms));
    }
    if let Some(code) = span.grpc_status {
        c.attribute(A, b"rpc.grpc.status_code", Value::Int(i64::from(code)));
    }
    if let Some(code) = span.status_code {
        c.attribute(A, b"http.response.status_code", Value::Int(i64::from(code)));
    }
}

fn write_event(c: &mut Cursor<'_>, time: u64, event: &UpstreamEvent, text: &mut AddressText) {
    c.key(1, FIXED64);
    c.fixed(&time.to_le_bytes());
    c.bytes_field(2, event.name().as_bytes());
    let (server, attempt) = event.server();
    c.attribute(3, b"server.address", Value::Str(text.of(server.ip())));
    c.attribute(3, b"server.port", Value::Int(i64::from(server.port())));
    c.attribute(
        3,
        b"tollgate.attempt",
        Value::Int(i64::try_from(attempt).unwrap_or(i64::MAX)),
    );
    match *event {
        UpstreamEvent::Connect { reused, .. } => {
            c.attribute(3, b"tollgate.connection_reused", Value::Bool(reused));
        }
        UpstreamEvent::ConnectFailed { failure, .. } => {
            c.attribute(3, b"tollgate.connect_failure", Value::Str(failure));
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

    /// A request whose SERVER span carries every HTTP attribute.
    fn server_span() -> Finished {
        let mut request = Finished::new(SpanRecord::new(
            Kind::Server,
            "GET",
            [0x4b; 16],
            [7; 8],
            [9; 8],
            Some(Arc::from("vendor=1")),
        ));
        let route = request.put("/v1");
        let path = request.put("/v1/orders");
        let host = request.put("api.example.com");
        let error = request.put("upstream");
        let policy = request.put("p");
        let rule = request.put("per-ip");
        let span = &mut request.server;
        span.start = 1_700_000_000_000_000_001;
        span.end = 1_700_000_000_000_500_000;
        span.name_has_route = true;
        span.route = route;
        span.method = Some("GET");
        span.url_path = path;
        span.server_address = host;
        span.protocol_version = Some("1.1");
        span.client_address = Some("2001:db8::1".parse().unwrap());
        span.status_code = Some(503);
        span.error = error;
        span.decision = Some("allow");
        span.policy = policy;
        span.rule = rule;
        span.remaining = Some(-1);
        span.paced_wait_ms = Some(250);
        request
    }

    #[test]
    fn a_batch_decodes_with_the_official_definitions() {
        let mut client = SpanRecord::new(Kind::Client, "GET", [0x4b; 16], [8; 8], [7; 8], None);
        client.end = 5;
        client.upstream = Some("127.0.0.1:8080".parse().unwrap());
        client.upstream_group = Some(Arc::from("api"));
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
        let mut scratch = Vec::new();
        // A proxied request (its CLIENT span ends first) and a gRPC call.
        let mut proxied = server_span();
        proxied.client = Some(client);
        let body = encoder.encode(&[proxied, Finished::new(root)], &mut scratch);
        let request = ExportTraceServiceRequest::decode(body).unwrap();
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

        let server = &spans[1];
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
        assert_eq!(find(a, "tollgate.paced_wait_ms"), Some(Any::IntValue(250)));
        assert_eq!(a.len(), 12);

        let client = &spans[0];
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
    fn spans_of_every_size_decode_and_stay_within_their_bound() {
        // A bare span (its body under 128 bytes: a one-byte length where two were kept), and
        // spans whose strings grow past each length-prefix size, with many events.
        let bare = SpanRecord::new(Kind::Client, "GET", [1; 16], [2; 8], [0; 8], None);
        let mut spans = vec![Finished::new(bare)];
        for len in [0, 100, 127, 128, 200, 16_383, 16_384, 70_000] {
            let mut request = server_span();
            request.server.url_path = request.put(&"p".repeat(len));
            request.server.error = request.put(&"e".repeat(len));
            request.server.trace_state = Some(Arc::from("s".repeat(len)));
            for attempt in 0..6 {
                request.server.events.push((
                    attempt,
                    UpstreamEvent::ConnectFailed {
                        server: "[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535"
                            .parse()
                            .unwrap(),
                        attempt: usize::MAX,
                        failure: "refused",
                    },
                ));
            }
            spans.push(request);
        }
        let bound: usize = spans
            .iter()
            .flat_map(Finished::in_order)
            .map(span_bound)
            .sum();
        let mut scratch = Vec::new();
        let body = Encoder::new(&[]).encode(&spans, &mut scratch).to_vec();
        // The head room: two tags and lengths, an empty resource and the scope's 12 bytes.
        assert_eq!(scratch.len(), bound + 22 + 2 + 12);
        // Scratch already larger than this batch needs: the same bytes.
        let again = Encoder::new(&[]).encode(&spans[..3], &mut scratch).to_vec();
        let fresh = Encoder::new(&[])
            .encode(&spans[..3], &mut Vec::new())
            .to_vec();
        assert_eq!(again, fresh);
        let request = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
        let decoded = &request.resource_spans[0].scope_spans[0].spans;
        assert_eq!(decoded.len(), spans.len());
        assert_eq!(decoded[0].name, "GET");
        assert_eq!(decoded[0].span_id, vec![2; 8]);
        for (span, len) in decoded[1..]
            .iter()
            .zip([0, 100, 127, 128, 200, 16_383, 16_384, 70_000])
        {
            assert_eq!(
                find(&span.attributes, "url.path"),
                Some(Any::StringValue("p".repeat(len)))
            );
            assert_eq!(span.trace_state, "s".repeat(len));
            assert_eq!(span.events.len(), 6);
            assert_eq!(
                find(&span.events[5].attributes, "tollgate.attempt"),
                Some(Any::IntValue(i64::MAX))
            );
            assert_eq!(span.flags, 0x301);
        }
    }

    #[test]
    fn resource_attributes_of_any_length_decode() {
        // The operator's names and values (OTEL_RESOURCE_ATTRIBUTES): lengths past one byte.
        let long_name = "n".repeat(300);
        let resource = [
            (long_name.clone(), "v".repeat(20_000)),
            ("service.name".to_string(), "edge".to_string()),
        ];
        let mut scratch = Vec::new();
        let body = Encoder::new(&resource).encode(&[server_span()], &mut scratch);
        let request = ExportTraceServiceRequest::decode(body).unwrap();
        let attributes = request.resource_spans[0]
            .resource
            .clone()
            .unwrap()
            .attributes;
        assert_eq!(attributes.len(), 2);
        assert_eq!(
            find(&attributes, &long_name),
            Some(Any::StringValue("v".repeat(20_000)))
        );
        assert_eq!(
            find(&attributes, "service.name"),
            Some(Any::StringValue("edge".into()))
        );
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        // One text kept across addresses, each asked twice: the kept text is replaced, never
        // appended to or left stale.
        let mut text = AddressText::default();
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "203.0.113.255",
            "10.20.100.9",
            "::1",
            "2001:db8::7",
            "127.0.0.1",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            assert_eq!(text.of(ip), ip.to_string());
            assert_eq!(text.of(ip), ip.to_string());
        }
    }

    #[test]
    fn a_long_span_gets_a_long_length_prefix() {
        let mut request = server_span();
        request.server.url_path = request.put(&"/x".repeat(10_000));
        let mut scratch = Vec::new();
        let body = Encoder::new(&[]).encode(&[request.clone(), request], &mut scratch);
        let request = ExportTraceServiceRequest::decode(body).unwrap();
        let spans = &request.resource_spans[0].scope_spans[0].spans;
        assert_eq!(spans.len(), 2);
        assert_eq!(
            find(&spans[1].attributes, "url.path"),
            Some(Any::StringValue("/x".repeat(10_000)))
        );
    }

    #[test]
    fn integers_and_booleans_decode_at_every_varint_width() {
        // Each side of the fast path's one-, two- and three-byte varints, and the values it
        // leaves to the general writer (negative, four bytes and more).
        let values = [
            0,
            1,
            0x7f,
            0x80,
            0x3fff,
            0x4000,
            0x1f_ffff,
            0x20_0000,
            -1,
            i64::MAX,
        ];
        let spans: Vec<Finished> = values
            .iter()
            .map(|&n| {
                let mut span = SpanRecord::new(Kind::Client, "GET", [1; 16], [2; 8], [3; 8], None);
                span.remaining = Some(n);
                span.upstream = Some("127.0.0.1:65535".parse().unwrap());
                span.events.push((
                    9,
                    UpstreamEvent::Connect {
                        server: "127.0.0.1:65535".parse().unwrap(),
                        attempt: usize::try_from(n).unwrap_or(0),
                        reused: n % 2 == 1,
                    },
                ));
                Finished::new(span)
            })
            .collect();
        let mut scratch = Vec::new();
        let body = Encoder::new(&[]).encode(&spans, &mut scratch);
        let request = ExportTraceServiceRequest::decode(body).unwrap();
        let decoded = &request.resource_spans[0].scope_spans[0].spans;
        assert_eq!(decoded.len(), values.len());
        for (span, &n) in decoded.iter().zip(&values) {
            assert_eq!(
                find(&span.attributes, "tollgate.remaining"),
                Some(Any::IntValue(n))
            );
            assert_eq!(
                find(&span.attributes, "server.port"),
                Some(Any::IntValue(65535))
            );
            let event = &span.events[0].attributes;
            assert_eq!(
                find(event, "tollgate.attempt"),
                Some(Any::IntValue(n.max(0)))
            );
            assert_eq!(
                find(event, "tollgate.connection_reused"),
                Some(Any::BoolValue(n % 2 == 1))
            );
        }
    }
}
