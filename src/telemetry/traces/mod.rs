//! OpenTelemetry traces, recorded by tollgate itself: the standard `OTEL_*` variables read at
//! start, W3C trace context in and out, the sampling decision, and the spans of a request (a
//! SERVER span per proxied request or decision call, a CLIENT span per upstream call) kept as
//! plain records (`span::SpanRecord`) with a fixed field per attribute. The records are
//! encoded straight to OTLP protobuf (`otlp`) and exported off the request path (`export`).
//! The core sees a trace only as [`TraceFacts`] (an id and a recorded flag) and hands back a
//! [`DecisionSummary`].
//!
//! Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set: then
//! [`Telemetry::from_env`] returns `None`, nothing here runs, and a request does no span work.
//! An unsampled request costs two random ids and the `traceparent` sent upstream: no record,
//! no attribute, no allocation of its own.
//!
//! Never in the way: a finished record goes into a bounded queue (a full queue drops it and
//! counts it in `tollgate_trace_spans_dropped_total`); a runtime of its own, on its own thread,
//! takes batches from the queue, encodes and sends them, so a down, slow or refusing collector
//! never blocks a request. The export headers (`OTEL_EXPORTER_OTLP_HEADERS`, often an API key)
//! are sent and never logged.

mod export;
mod otlp;
mod sampling;
mod settings;
mod span;
mod summary;

use crate::request::descriptor::TraceFacts;
use sampling::{new_span_id, new_trace_id};
pub use sampling::{HeaderSource, Parent, Root, Sampler, TRACEPARENT, TRACESTATE};
pub use settings::{EnvSettings, Protocol, TelemetryError, TraceContextTrust};
pub use span::UpstreamEvent;
use span::{unix_nanos, Finished, Kind, SpanRecord};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
pub use summary::DecisionSummary;

/// Tracing as started: the sampler, the trust in callers' context, and the export.
pub struct Telemetry {
    sampler: Sampler,
    trust: TraceContextTrust,
    export: export::Exporter,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("sampler", &self.sampler)
            .field("trust", &self.trust)
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Starts tracing when the environment asks for it; `Ok(None)` when it does not.
    /// `dropped` counts the spans that were not exported (a full queue, a failed export).
    ///
    /// # Errors
    /// A setting that cannot be used, or an export runtime that cannot start.
    pub fn from_env(
        trust: TraceContextTrust,
        dropped: prometheus::IntCounter,
    ) -> Result<Option<Telemetry>, TelemetryError> {
        let Some(settings) = EnvSettings::read(|name| std::env::var(name).ok())? else {
            return Ok(None);
        };
        Telemetry::start(&settings, trust, dropped).map(Some)
    }

    fn start(
        settings: &EnvSettings,
        trust: TraceContextTrust,
        dropped: prometheus::IntCounter,
    ) -> Result<Telemetry, TelemetryError> {
        let var = |name: &str| std::env::var(name).ok();
        let sampler = Sampler::from_env(
            var("OTEL_TRACES_SAMPLER").as_deref(),
            var("OTEL_TRACES_SAMPLER_ARG").as_deref(),
        );
        let config = export::Config::read(settings, var)?;
        let export = export::Exporter::start(config, dropped)?;
        // The endpoint may carry credentials and the headers do: neither is logged.
        tracing::info!(
            protocol = settings.protocol.as_str(),
            max_queue_size = settings.max_queue_size,
            sampler = ?sampler,
            trace_context = ?trust,
            "traces: OTLP export on"
        );
        Ok(Telemetry {
            sampler,
            trust,
            export,
        })
    }

    /// The context a request continues: its `traceparent`/`tracestate` when `--trace-context`
    /// lets this peer's count, else none (a new trace).
    pub fn parent(&self, headers: &dyn HeaderSource, peer_trusted: bool) -> Option<Parent> {
        let honoured = match self.trust {
            TraceContextTrust::Accept => true,
            TraceContextTrust::Trusted => peer_trusted,
            TraceContextTrust::Ignore => false,
        };
        if !honoured {
            return None;
        }
        Parent::read(headers)
    }

    /// Starts a SERVER span (a proxied request, a decision-service, ext_authz or rate-limit
    /// service call) under `parent`: sampled or not here, once. A sampled span gets a record
    /// while the export takes spans (not while it backs off from a failing collector: then the
    /// span is counted as dropped and nothing is recorded).
    fn server_span(&self, name: &'static str, parent: Option<Parent>) -> RequestSpan {
        let trace_id = parent.as_ref().map_or_else(new_trace_id, |p| p.trace_id);
        let span_id = new_span_id();
        let sampled = self.sampler.sampled(&trace_id, parent.as_ref());
        let (parent_span_id, trace_state) = match parent {
            Some(p) => (p.span_id, p.trace_state),
            None => ([0; 8], None),
        };
        let record = (sampled && self.export.accepting()).then(|| {
            let queue = self.export.queue();
            let finished = queue.record(SpanRecord::new(
                Kind::Server,
                name,
                trace_id,
                span_id,
                parent_span_id,
                trace_state.clone(),
            ));
            (finished, queue)
        });
        if sampled && record.is_none() {
            self.export.dropped(1);
        }
        RequestSpan {
            trace_id,
            span_id,
            sampled,
            trace_state,
            record,
            client_span_id: None,
            upstream_status: None,
            method: name,
        }
    }

    /// Starts a proxied request's SERVER span, continuing its trace context as
    /// `--trace-context` allows.
    pub fn http_request(
        &self,
        headers: &http::HeaderMap,
        peer_trusted: bool,
        method: &str,
        path: &str,
        host: Option<&str>,
        protocol_version: &'static str,
    ) -> RequestSpan {
        let parent = self.parent(headers, peer_trusted);
        let mut span = self.server_span(method_name(method), parent);
        if let Some(request) = span.recorded() {
            let path = request.put(path);
            let host = host.and_then(|h| request.put(crate::request::descriptor::strip_port(h)));
            let record = &mut request.server;
            record.method = Some(method_name_or_other(method));
            record.url_path = path;
            record.server_address = host;
            record.protocol_version = Some(protocol_version);
        }
        span
    }

    /// Starts the SERVER span of a decision-service call (`/v1/decision`: nginx's
    /// `auth_request`, Envoy's HTTP ext_authz); the described request's attributes follow
    /// ([`RequestSpan::described`]).
    pub fn decision_call(
        &self,
        headers: &http::HeaderMap,
        peer_trusted: bool,
        method: &str,
    ) -> RequestSpan {
        let parent = self.parent(headers, peer_trusted);
        let name = match method_name(method) {
            "GET" => "GET /v1/decision",
            "POST" => "POST /v1/decision",
            _ => "HTTP /v1/decision",
        };
        let mut span = self.server_span(name, parent);
        if let Some(request) = span.recorded() {
            request.server.route = request.put("/v1/decision");
        }
        span.method = "HTTP";
        span
    }

    /// Starts the SERVER span of a gRPC call from Envoy (`service`/`method`), continuing the
    /// context in the call's metadata, else in `fallback` (ext_authz: the described request's
    /// headers), as `--trace-context` allows for the calling peer.
    pub fn grpc_call(
        &self,
        metadata: &dyn HeaderSource,
        fallback: Option<&dyn HeaderSource>,
        peer_trusted: bool,
        name: &'static str,
        service: &'static str,
        method: &'static str,
    ) -> RequestSpan {
        let parent = self
            .parent(metadata, peer_trusted)
            .or_else(|| fallback.and_then(|f| self.parent(f, peer_trusted)));
        let mut span = self.server_span(name, parent);
        if let Some(record) = span.server() {
            record.rpc = Some((service, method));
        }
        span.method = "HTTP";
        span
    }

    /// Exports what is queued and stops, within `timeout` (a collector that is down does not
    /// hold the gateway's exit longer).
    pub fn shutdown(&self, timeout: Duration) {
        self.export.shutdown(timeout);
    }
}

/// Each byte's two lower-case hex digits.
const HEX_PAIRS: [[u8; 2]; 256] = {
    let digits = b"0123456789abcdef";
    let mut table = [[0; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = [digits[byte >> 4], digits[byte & 0xf]];
        byte += 1;
    }
    table
};

/// W3C `traceparent` (version 00): `00-{trace id}-{span id}-{flags}`, always 55 bytes (only
/// the sampled bit among the flags). Written on every proxied request, so a byte's two digits
/// come from a table.
fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> [u8; 55] {
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    for (i, byte) in trace_id.iter().enumerate() {
        out[3 + 2 * i..5 + 2 * i].copy_from_slice(&HEX_PAIRS[usize::from(*byte)]);
    }
    // The span id starts after the trace id's 32 digits and a dash.
    for (i, byte) in span_id.iter().enumerate() {
        out[36 + 2 * i..38 + 2 * i].copy_from_slice(&HEX_PAIRS[usize::from(*byte)]);
    }
    if sampled {
        out[54] = b'1';
    }
    out
}

/// A request's SERVER span and, once the request goes upstream, its CLIENT span: the ids and
/// sampling decision every request has, and the records only a recorded one has.
pub struct RequestSpan {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    sampled: bool,
    trace_state: Option<Arc<str>>,
    /// A sampled request's records (one box, reused from an earlier request when the export
    /// has handed one back) and the queue they end into, while the export takes spans.
    record: Option<(Box<Finished>, Arc<export::Queue>)>,
    /// A recorded request's CLIENT span id, chosen when the context for the upstream is
    /// written (which may come before the CLIENT span starts).
    client_span_id: Option<[u8; 8]>,
    /// The status the upstream answered with.
    upstream_status: Option<u16>,
    /// The request's method as a span name allows it (`GET`, ..., `HTTP`).
    method: &'static str,
}

impl RequestSpan {
    fn recorded(&mut self) -> Option<&mut Finished> {
        self.record.as_mut().map(|(r, _)| &mut **r)
    }

    fn server(&mut self) -> Option<&mut SpanRecord> {
        self.recorded().map(|r| &mut r.server)
    }

    /// The trace as the core sees it (the `RATE_LIMIT` line's `trace_id`, whether to summarise
    /// the decision: only for a span that is recorded).
    pub fn facts(&self) -> TraceFacts {
        TraceFacts {
            trace_id: self.trace_id,
            sampled: self.record.is_some(),
        }
    }

    /// The trace id as 32 lower-case hex digits (the access log's `trace_id`).
    pub fn trace_id(&self) -> String {
        self.facts().trace_id_hex()
    }

    /// `client.address`: the client as resolved for limiting (behind a trusted proxy, the
    /// address it forwarded).
    pub fn client(&mut self, ip: IpAddr) {
        if let Some(record) = self.server() {
            record.client_address = Some(ip);
        }
    }

    /// `rpc.system`, `rpc.service` and `rpc.method` of a proxied gRPC call.
    pub fn grpc_call(&mut self, service: &str, method: &str) {
        if let Some(request) = self.recorded() {
            if let (Some(service), Some(method)) = (request.put(service), request.put(method)) {
                request.server.proxied_rpc = Some((service, method));
            }
        }
    }

    /// `rpc.grpc.status_code` of a proxied gRPC call: the status it ended with.
    pub fn grpc_status(&mut self, code: u16) {
        if let Some(request) = self.recorded() {
            request.server.grpc_status = Some(i32::from(code));
        }
    }

    /// `http.route`: the matched route's path prefix; the span is renamed `METHOD route`.
    pub fn route(&mut self, route: &str) {
        if let Some(request) = self.recorded() {
            request.server.route = request.put(route);
            request.server.name_has_route = true;
        }
    }

    /// The HTTP attributes of the request a decision call describes (ext_authz's original
    /// request): method, path, host.
    pub fn described(&mut self, method: &str, path: &str, host: Option<&str>) {
        if let Some(request) = self.recorded() {
            request.server.method = Some(method_name_or_other(method));
            request.server.url_path = request.put(path);
            if let Some(host) = host.map(crate::request::descriptor::strip_port) {
                request.server.server_address = request.put(host);
            }
        }
    }

    /// A rate-limit service answer: `tollgate.decision` (`refuse` when over the limit), the
    /// rule over the limit (else the tightest), and the fewest requests left.
    pub fn rls_answered(&mut self, over_limit: bool, rule: Option<&str>, remaining: Option<u64>) {
        if let Some(request) = self.recorded() {
            if let Some(rule) = rule {
                request.server.rule = request.put(rule);
            }
            let record = &mut request.server;
            record.decision = Some(if over_limit { "refuse" } else { "allow" });
            if over_limit {
                record.reason = Some("over_limit");
            }
            if let Some(remaining) = remaining {
                record.remaining = Some(i64::try_from(remaining).unwrap_or(i64::MAX));
            }
        }
    }

    /// Ends a gRPC call's span with its status code (0: OK); an error status when it is not OK.
    pub fn finish_rpc(mut self, code: i32, message: &str) {
        if let Some(request) = self.recorded() {
            request.server.grpc_status = Some(code);
            if code != 0 {
                request.server.error = request.put(message);
            }
        }
        self.end();
    }

    /// The upstream answered with `status`.
    pub fn upstream_responded(&mut self, status: u16) {
        self.upstream_status = Some(status);
    }

    /// The decision's attributes: `tollgate.decision`, `tollgate.policy`, `tollgate.rule`,
    /// `tollgate.reason`, `tollgate.remaining`.
    pub fn decided(&mut self, summary: &DecisionSummary) {
        if let Some(request) = self.recorded() {
            if let Some(policy) = &summary.policy {
                request.server.policy = request.put(policy);
            }
            if let Some(rule) = &summary.rule {
                request.server.rule = request.put(rule);
            }
            let record = &mut request.server;
            record.decision = Some(summary.decision);
            if let Some(reason) = summary.reason {
                record.reason = Some(reason);
            }
            if let Some(remaining) = summary.remaining {
                record.remaining = Some(i64::try_from(remaining).unwrap_or(i64::MAX));
            }
        }
    }

    /// `tollgate.paced_wait_ms`: how long the request waited for its turn under a token-bucket
    /// rule's `delay`.
    pub fn paced(&mut self, waited_us: u64) {
        if let Some(record) = self.server() {
            record.paced_wait_ms = Some(i64::try_from(waited_us / 1_000).unwrap_or(i64::MAX));
        }
    }

    /// Starts the CLIENT span of the upstream call (once per request: a retry is an event on
    /// it). `server` is the server first chosen.
    pub fn upstream_started(
        &mut self,
        telemetry: &Telemetry,
        group: &Arc<str>,
        server: std::net::SocketAddr,
    ) {
        // An unsampled request gets no CLIENT span: the upstream continues the SERVER span's
        // context (its `sampled` flag off), and nothing else would read the span. A sampled one
        // not recorded (the export backing off) counts its CLIENT span as dropped.
        let Some((recorded, _)) = self.record.as_mut() else {
            if self.sampled {
                telemetry.export.dropped(1);
            }
            return;
        };
        if recorded.client.is_some() {
            return;
        }
        let span_id = *self.client_span_id.get_or_insert_with(new_span_id);
        let mut client = SpanRecord::new(
            Kind::Client,
            self.method,
            self.trace_id,
            span_id,
            self.span_id,
            self.trace_state.clone(),
        );
        client.method = Some(method_or_other(self.method));
        client.upstream_group = Some(Arc::clone(group));
        client.upstream = Some(server);
        recorded.client = Some(client);
    }

    /// The upstream call is recorded (worth telling its events).
    pub fn upstream_recorded(&self) -> bool {
        self.record
            .as_ref()
            .is_some_and(|(r, _)| r.client.is_some())
    }

    /// An event on the upstream call (`connect`, `retry`, `ejection`, `connect_failed`).
    pub fn upstream_event(&mut self, event: UpstreamEvent) {
        if let Some(client) = self.record.as_mut().and_then(|(r, _)| r.client.as_mut()) {
            client.events.push((unix_nanos(), event));
        }
    }

    /// The headers that carry the trace to the upstream: a recorded request's CLIENT span's
    /// context (its id chosen here when the span has not started yet), else the SERVER span's.
    pub fn inject_upstream(
        &mut self,
        set: &mut dyn FnMut(&'static http::HeaderName, &'static str, http::HeaderValue),
    ) {
        let span_id = if self.record.is_some() {
            *self.client_span_id.get_or_insert_with(new_span_id)
        } else {
            self.span_id
        };
        let parent = traceparent(&self.trace_id, &span_id, self.sampled);
        // Hex digits and dashes: always a valid value.
        if let Ok(value) = http::HeaderValue::from_bytes(&parent) {
            set(&TRACEPARENT.0, TRACEPARENT.1, value);
        }
        // Read from a header value, checked member by member: valid too.
        if let Some(Ok(value)) = self.trace_state.as_deref().map(http::HeaderValue::from_str) {
            set(&TRACESTATE.0, TRACESTATE.1, value);
        }
    }

    /// Ends both spans with the response's status (0: none was sent) and the error that ended
    /// the request, if one did (Pingora's error kind: never request data). A 5xx, or no
    /// response, marks a span as an error, as the HTTP conventions say.
    pub fn finish(mut self, status: u16, error: Option<&str>) {
        let upstream_status = self.upstream_status;
        let Some(request) = self.recorded() else {
            return;
        };
        if request.client.is_some() {
            let (code, client_error) = match upstream_status {
                Some(code) => (Some(code), (code >= 500).then_some("")),
                None => (None, Some(error.unwrap_or("no response"))),
            };
            let client_error = client_error.and_then(|e| request.put(e));
            if let Some(client) = request.client.as_mut() {
                client.status_code = code;
                client.error = client_error;
            }
        }
        if status >= 500 || (status == 0 && error.is_some()) {
            request.server.error = request.put(error.unwrap_or_default());
        }
        if status > 0 {
            request.server.status_code = Some(status);
        }
        self.end();
    }

    /// Hands the records to the export queue.
    fn end(self) {
        let Some((mut finished, queue)) = self.record else {
            return;
        };
        let now = unix_nanos();
        finished.server.end = now;
        if let Some(client) = &mut finished.client {
            client.end = now;
        }
        queue.push(finished);
    }
}

/// The span name of an HTTP request: its method, or `HTTP` for one outside the well-known set
/// (the conventions' rule: a name never holds request-chosen text).
pub fn method_name(method: &str) -> &'static str {
    match method {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        "OPTIONS" => "OPTIONS",
        "TRACE" => "TRACE",
        "PATCH" => "PATCH",
        _ => "HTTP",
    }
}

/// `http.request.method`: a well-known method, else `_OTHER` (the conventions' rule).
fn method_name_or_other(method: &str) -> &'static str {
    method_or_other(method_name(method))
}

fn method_or_other(name: &'static str) -> &'static str {
    match name {
        "HTTP" => "_OTHER",
        known => known,
    }
}

#[cfg(test)]
mod tests {
    use super::sampling::*;
    use super::settings::*;
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn an_exporter_error_never_shows_an_endpoints_password() {
        let endpoint = "http://user:s3cret@collector:43 17";
        let var =
            |name: &str| (name == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| endpoint.to_string());
        let shown = without_endpoints(&format!("invalid URI {endpoint}/v1/traces"), var);
        assert!(!shown.contains("s3cret"), "{shown}");
        assert_eq!(
            shown,
            format!(
                "invalid URI {}/v1/traces",
                crate::telemetry::redact::url(endpoint)
            )
        );
        assert_eq!(without_endpoints("timed out", var), "timed out");
    }

    #[test]
    fn off_unless_an_endpoint_is_set_and_not_disabled() {
        assert_eq!(EnvSettings::read(env(&[])).unwrap(), None);
        assert_eq!(
            EnvSettings::read(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])).unwrap(),
            None
        );
        assert_eq!(
            EnvSettings::read(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                ("OTEL_SDK_DISABLED", "TRUE"),
            ]))
            .unwrap(),
            None
        );
        assert_eq!(
            EnvSettings::read(env(&[
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://127.0.0.1:4318/v1/traces"
                ),
                ("OTEL_TRACES_EXPORTER", "none"),
            ]))
            .unwrap(),
            None
        );
        let on = EnvSettings::read(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://127.0.0.1:4318/v1/traces",
        )]))
        .unwrap()
        .unwrap();
        assert_eq!(
            on,
            EnvSettings {
                protocol: Protocol::HttpProtobuf,
                max_queue_size: 2048,
                default_service_name: true,
            }
        );
    }

    #[test]
    fn protocol_queue_and_service_name_come_from_the_standard_variables() {
        let s = EnvSettings::read(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "16"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "deployment.environment=prod, service.name=edge",
            ),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.protocol, Protocol::Grpc);
        assert_eq!(s.max_queue_size, 16);
        assert!(!s.default_service_name);
        let named = EnvSettings::read(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
            ("OTEL_SERVICE_NAME", "edge"),
        ]))
        .unwrap()
        .unwrap();
        assert!(!named.default_service_name);
        assert!(matches!(
            EnvSettings::read(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ])),
            Err(TelemetryError::Protocol(p)) if p == "http/json"
        ));
        assert!(matches!(
            EnvSettings::read(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_BSP_MAX_QUEUE_SIZE", "0"),
            ])),
            Err(TelemetryError::QueueSize(_))
        ));
    }

    #[test]
    fn trace_context_is_continued_only_from_the_peers_the_operator_allows() {
        let settings = EnvSettings {
            protocol: Protocol::HttpProtobuf,
            max_queue_size: 4,
            default_service_name: true,
        };
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        );
        let continued = |trust: TraceContextTrust, peer_trusted: bool| {
            let counter = prometheus::IntCounter::new("d", "d").unwrap();
            let telemetry = Telemetry::start(&settings, trust, counter).unwrap();
            let id = telemetry.parent(&headers, peer_trusted).map(|parent| {
                TraceFacts {
                    trace_id: parent.trace_id,
                    sampled: parent.sampled,
                }
                .trace_id_hex()
            });
            telemetry.shutdown(Duration::from_millis(100));
            id
        };
        let client = Some("4bf92f3577b34da6a3ce929d0e0e4736".to_string());
        assert_eq!(continued(TraceContextTrust::Accept, false), client);
        assert_eq!(continued(TraceContextTrust::Trusted, true), client);
        assert_eq!(continued(TraceContextTrust::Trusted, false), None);
        assert_eq!(continued(TraceContextTrust::Ignore, true), None);
    }

    #[test]
    fn traceparent_is_written_as_the_w3c_propagator_writes_it() {
        let trace_id = 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736_u128.to_be_bytes();
        let span_id = 0x00f0_67aa_0ba9_02b7_u64.to_be_bytes();
        assert_eq!(
            &traceparent(&trace_id, &span_id, true),
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(
            &traceparent(&trace_id, &span_id, false),
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        );
    }

    struct Headers(&'static [(&'static str, &'static str)]);

    impl HeaderSource for Headers {
        fn header(&self, name: &http::HeaderName) -> Option<&str> {
            self.0
                .iter()
                .find(|(k, _)| *k == name.as_str())
                .map(|(_, v)| *v)
        }
    }

    #[test]
    fn traceparent_and_tracestate_are_read_by_the_w3c_rules() {
        let read = |parent: &'static str, state: Option<&'static str>| {
            let pairs: &'static [(&'static str, &'static str)] = match state {
                None => Box::leak(Box::new([("traceparent", parent)])),
                Some(state) => {
                    Box::leak(Box::new([("traceparent", parent), ("tracestate", state)]))
                }
            };
            Parent::read(&Headers(pairs))
        };
        let ok = read(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("vendor=1,other@sys=x"),
        )
        .unwrap();
        assert!(ok.sampled);
        assert_eq!(ok.span_id, 0x00f0_67aa_0ba9_02b7_u64.to_be_bytes());
        assert_eq!(ok.trace_state.as_deref(), Some("vendor=1,other@sys=x"));
        let unsampled = read(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            Some("Vendor=1"),
        )
        .unwrap();
        assert!(!unsampled.sampled);
        // An invalid tracestate is dropped whole; the trace goes on.
        assert_eq!(unsampled.trace_state, None);
        // A later version may add fields; version 00 may not. Upper-case hex, all-zero ids,
        // version ff and unknown flags of version 00 are refused.
        assert!(read(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            None
        )
        .is_some());
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "garbage",
            // Fields of the wrong length, or a sign `from_str_radix` would take.
            "00-1-1-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(read(bad, None), None, "{bad}");
        }
        // White space around tracestate members is allowed; `k==v` is not a member.
        let spaced = read(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("vendor=1 ,\tother@sys=x"),
        )
        .unwrap();
        assert_eq!(spaced.trace_state.as_deref(), Some("vendor=1,other@sys=x"));
        let doubled = read(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("k==v"),
        )
        .unwrap();
        assert_eq!(doubled.trace_state, None);
    }

    /// A client's `tracestate` is cut as W3C Trace Context cuts a list: the first 32 members
    /// at most, then long members (over 128 bytes) and then members from the end dropped until
    /// the rest is at most 512 bytes. A 60 KB header keeps 512 bytes or less.
    #[test]
    fn tracestate_is_bounded_to_32_members_and_512_bytes() {
        const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let state_of = |state: String| {
            let pairs: &'static [(&'static str, &'static str)] = Box::leak(Box::new([
                ("traceparent", PARENT),
                ("tracestate", Box::leak(state.into_boxed_str())),
            ]));
            Parent::read(&Headers(pairs))
                .unwrap()
                .trace_state
                .map(|s| s.to_string())
        };
        // 40 short members: the first 32 are kept, in order.
        let forty: Vec<String> = (0..40).map(|i| format!("k{i}=v")).collect();
        let kept = state_of(forty.join(",")).unwrap();
        assert_eq!(kept, forty[..32].join(","));
        // A 60 KB header of 240-byte members: two fit in 512 bytes (483 with the comma).
        let value = "x".repeat(240);
        let huge: Vec<String> = (0..250).map(|i| format!("m{i:03}={value}")).collect();
        let huge = huge.join(",");
        assert!(huge.len() > 60_000);
        let kept = state_of(huge).unwrap();
        assert_eq!(kept, format!("m000={value},m001={value}"));
        assert!(kept.len() <= 512);
        // Long members go before short ones, whatever their place.
        let long = format!("long={}", "y".repeat(200));
        let mut mixed: Vec<String> = (0..20)
            .map(|i| format!("s{i:02}={}", "z".repeat(20)))
            .collect();
        mixed.insert(1, long.clone());
        mixed.insert(5, long.clone());
        let kept = state_of(mixed.join(",")).unwrap();
        assert!(!kept.contains("long="), "{kept}");
        assert_eq!(
            kept.split(',').count(),
            20,
            "the 20 short members fit: {kept}"
        );
        assert_eq!(kept.len(), 20 * 25 - 1);
        // Then from the end: 30 members of 24 bytes keep the first 20 (21 × 25 − 1 = 524 is
        // over, 20 × 25 − 1 = 499 fits).
        let thirty: Vec<String> = (0..30)
            .map(|i| format!("t{i:02}={}", "w".repeat(20)))
            .collect();
        assert_eq!(state_of(thirty.join(",")).unwrap(), thirty[..20].join(","));
        // Exactly 512 bytes stays whole.
        let exact = format!("a={}", "b".repeat(254)) + "," + &format!("c={}", "d".repeat(253));
        assert_eq!(exact.len(), 512);
        assert_eq!(state_of(exact.clone()).unwrap(), exact);
        // An invalid member among the first 32 still drops the header whole; past the 32nd it
        // is never read.
        assert_eq!(state_of(format!("{},Bad=1", forty[..10].join(","))), None);
        assert_eq!(
            state_of(format!("{},Bad=1", forty.join(","))).unwrap(),
            forty[..32].join(",")
        );
    }

    #[test]
    fn samplers_decide_as_the_sdks_do() {
        let low = |last: u8| {
            let mut id = [0u8; 16];
            id[15] = last;
            id
        };
        let mut high = [0u8; 16];
        high[8] = 0xff;
        let ratio = Sampler::from_env(Some("traceidratio"), Some("0.5"));
        assert_eq!(ratio, Sampler::TraceIdRatio(0.5));
        assert!(ratio.sampled(&low(2), None));
        assert!(!ratio.sampled(&high, None));
        let parent = |sampled| Parent {
            trace_id: high,
            span_id: [1; 8],
            sampled,
            trace_state: None,
        };
        let based = Sampler::from_env(Some("parentbased_traceidratio"), Some("0.01"));
        assert!(based.sampled(&high, Some(&parent(true))));
        assert!(!based.sampled(&low(2), Some(&parent(false))));
        assert!(based.sampled(&low(2), None));
        assert!(!based.sampled(&high, None));
        assert_eq!(
            Sampler::from_env(None, None),
            Sampler::ParentBased(Root::AlwaysOn)
        );
        assert_eq!(
            Sampler::from_env(Some("xray"), None),
            Sampler::ParentBased(Root::AlwaysOn)
        );
        assert_eq!(
            Sampler::from_env(Some("traceidratio"), Some("x")),
            Sampler::TraceIdRatio(1.0)
        );
        assert!(!Sampler::from_env(Some("always_off"), None).sampled(&low(1), Some(&parent(true))));
        assert!(Sampler::from_env(Some("always_on"), None).sampled(&high, Some(&parent(false))));
        assert!(!Sampler::TraceIdRatio(0.0).sampled(&low(0), None));
    }

    #[test]
    fn ids_are_random_and_never_zero() {
        let a = new_trace_id();
        let b = new_trace_id();
        assert_ne!(a, b);
        assert_ne!(a, [0; 16]);
        assert_ne!(new_span_id(), new_span_id());
    }

    #[test]
    fn span_names_and_methods_never_carry_request_text() {
        assert_eq!(method_name("GET"), "GET");
        assert_eq!(method_name("BREW"), "HTTP");
        assert_eq!(method_name_or_other("BREW"), "_OTHER");
        assert_eq!(method_name_or_other("PATCH"), "PATCH");
    }
}
