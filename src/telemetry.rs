//! OpenTelemetry traces: the SDK set up from the standard `OTEL_*` variables, OTLP export over
//! gRPC or HTTP/protobuf off the request path, W3C trace context in and out, and the spans of a
//! request (a SERVER span per proxied request or decision call, a CLIENT span per upstream
//! call). Glue: the only module naming `opentelemetry` types; the core below sees a trace only
//! as [`TraceFacts`] (an id and a sampled flag) and hands back a [`DecisionSummary`].
//!
//! Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set: then
//! [`Telemetry::from_env`] returns `None`, nothing here runs, and a request does no span work.
//!
//! Never in the way: a span ends into a bounded queue (`DropCounting`: a full queue drops the
//! span and counts it in `tollgate_trace_spans_dropped_total`), the batch processor's thread
//! takes batches from it, and the export itself runs on a runtime of its own (`ExportRuntime`),
//! so a down, slow or refusing collector never blocks a request. The export headers
//! (`OTEL_EXPORTER_OTLP_HEADERS`, often an API key) are handed to the exporter and never logged.

use crate::descriptor::TraceFacts;
use crate::service::DecisionSummary;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use opentelemetry_sdk::Resource;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `--trace-context`: whose W3C `traceparent`/`tracestate` a request continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TraceContextTrust {
    /// Any client's (the W3C default: a trace goes on through the gateway).
    #[default]
    Accept,
    /// Only a `--trusted-proxy` peer's: anyone else's request starts a new trace (an untrusted
    /// client can then neither join a trace nor force sampling with its `sampled` flag).
    Trusted,
    /// Nobody's: every request starts a new trace.
    Ignore,
}

/// The OTLP transport (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

impl Protocol {
    /// The protocol a variable's value names; the specification's default is `http/protobuf`.
    ///
    /// # Errors
    /// A value other than `grpc` or `http/protobuf` (`http/json` is not built in).
    pub fn parse(value: Option<&str>) -> Result<Protocol, TelemetryError> {
        match value.map(str::trim) {
            None | Some("") | Some("http/protobuf") => Ok(Protocol::HttpProtobuf),
            Some("grpc") => Ok(Protocol::Grpc),
            Some(other) => Err(TelemetryError::Protocol(other.to_string())),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::HttpProtobuf => "http/protobuf",
        }
    }
}

/// Why tracing cannot start (a start-up error: the operator asked for traces).
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL: {0:?} is not supported (grpc or http/protobuf)")]
    Protocol(String),
    #[error("OTEL_BSP_MAX_QUEUE_SIZE: {0:?} is not a positive number")]
    QueueSize(String),
    /// The exporter's own error names the endpoint's problem, never the headers' values.
    #[error("OTLP exporter: {0}")]
    Exporter(String),
    #[error("OTLP export runtime: {0}")]
    Runtime(std::io::Error),
}

/// What an environment says about traces (read once at start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvSettings {
    pub protocol: Protocol,
    pub max_queue_size: usize,
    /// Neither `OTEL_SERVICE_NAME` nor `service.name` in `OTEL_RESOURCE_ATTRIBUTES`: the
    /// resource says `tollgate` rather than the SDK's `unknown_service`.
    pub default_service_name: bool,
}

/// The batch processor's queue when `OTEL_BSP_MAX_QUEUE_SIZE` is unset (the specification's).
const DEFAULT_MAX_QUEUE_SIZE: usize = 2048;

impl EnvSettings {
    /// `None`: tracing is off (no OTLP endpoint set, `OTEL_SDK_DISABLED=true`, or
    /// `OTEL_TRACES_EXPORTER=none`).
    ///
    /// # Errors
    /// A protocol or queue size that cannot be used.
    pub fn read(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<EnvSettings>, TelemetryError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
            && set("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
        {
            return Ok(None);
        }
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
            || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"))
        {
            return Ok(None);
        }
        let protocol = Protocol::parse(
            set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                .or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"))
                .as_deref(),
        )?;
        // Read here as the SDK reads it, so the count of dropped spans uses the same bound.
        let max_queue_size = match set("OTEL_BSP_MAX_QUEUE_SIZE") {
            None => DEFAULT_MAX_QUEUE_SIZE,
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => return Err(TelemetryError::QueueSize(v)),
            },
        };
        let default_service_name = set("OTEL_SERVICE_NAME").is_none()
            && !set("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attrs| {
                attrs.split(',').any(|kv| {
                    kv.split('=')
                        .next()
                        .is_some_and(|k| k.trim() == "service.name")
                })
            });
        Ok(Some(EnvSettings {
            protocol,
            max_queue_size,
            default_service_name,
        }))
    }
}

/// Starts tracing for a gateway when the environment asks for it (the proxy's start-up).
///
/// # Errors
/// See [`Telemetry::from_env`].
pub fn start_for(gateway: &crate::service::Gateway) -> Result<(), TelemetryError> {
    if let Some(telemetry) = Telemetry::from_env(
        gateway.config.trace_context,
        gateway.metrics.trace_spans_dropped(),
    )? {
        gateway.set_telemetry(telemetry);
    }
    Ok(())
}

/// The running SDK: tracer, propagator and the export machinery.
pub struct Telemetry {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    propagator: TraceContextPropagator,
    trust: TraceContextTrust,
    /// Kept alive (and stopped last) for the exporter's connections.
    runtime: ExportRuntime,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("trust", &self.trust)
            .finish_non_exhaustive()
    }
}

/// The exporter's error as it may be shown: an endpoint it quotes (an invalid URL is quoted
/// whole) with any password in it masked, as every store URL is (`var`: the environment).
fn without_endpoints(message: &str, var: impl Fn(&str) -> Option<String>) -> String {
    let mut message = message.to_string();
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ] {
        if let Some(endpoint) = var(name).filter(|e| !e.is_empty()) {
            message = message.replace(&endpoint, &crate::redact::url(&endpoint));
        }
    }
    message
}

impl Telemetry {
    /// Starts tracing when the environment asks for it; `Ok(None)` when it does not.
    /// `dropped` counts the spans a full export queue turned away.
    ///
    /// # Errors
    /// A setting that cannot be used, or an exporter that cannot be built.
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
        let runtime = ExportRuntime::start().map_err(TelemetryError::Runtime)?;
        let pending = Arc::new(AtomicUsize::new(0));
        // Built inside the export runtime: tonic's channel spawns its worker there.
        let exporter = {
            let _entered = runtime.handle.enter();
            let builder = opentelemetry_otlp::SpanExporter::builder();
            match settings.protocol {
                Protocol::Grpc => {
                    use opentelemetry_otlp::WithExportConfig as _;
                    builder
                        .with_tonic()
                        .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                        .build()
                }
                Protocol::HttpProtobuf => {
                    use opentelemetry_otlp::WithExportConfig as _;
                    builder
                        .with_http()
                        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                        .build()
                }
            }
            .map_err(|e| {
                TelemetryError::Exporter(without_endpoints(&e.to_string(), |name| {
                    std::env::var(name).ok()
                }))
            })?
        };
        let exporter = OnExportRuntime {
            inner: Arc::new(tokio::sync::Mutex::new(exporter)),
            handle: runtime.handle.clone(),
            pending: Arc::clone(&pending),
        };
        // `OTEL_BSP_*` are read by the builder's defaults; the queue size is set explicitly to
        // the value `DropCounting` bounds by (the same variable, read the same way).
        let config = BatchConfigBuilder::default()
            .with_max_queue_size(settings.max_queue_size)
            .build();
        let processor = DropCounting {
            inner: BatchSpanProcessor::new(exporter, config),
            pending,
            capacity: settings.max_queue_size,
            dropped,
        };
        // `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` are read by the default resource;
        // `OTEL_TRACES_SAMPLER(_ARG)` by the default sampler.
        let mut resource = Resource::builder();
        if settings.default_service_name {
            resource = resource.with_service_name("tollgate");
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("tollgate");
        // The endpoint may carry credentials and the headers do: neither is logged.
        tracing::info!(
            protocol = settings.protocol.as_str(),
            max_queue_size = settings.max_queue_size,
            trace_context = ?trust,
            "traces: OTLP export on"
        );
        Ok(Telemetry {
            tracer,
            provider,
            propagator: TraceContextPropagator::new(),
            trust,
            runtime,
        })
    }

    /// The context a request continues: its `traceparent`/`tracestate` when `--trace-context`
    /// lets this peer's count, else none (a new trace).
    pub fn parent(&self, headers: &dyn HeaderSource, peer_trusted: bool) -> Context {
        let honoured = match self.trust {
            TraceContextTrust::Accept => true,
            TraceContextTrust::Trusted => peer_trusted,
            TraceContextTrust::Ignore => false,
        };
        if !honoured || headers.header("traceparent").is_none() {
            return Context::new();
        }
        self.propagator.extract(&Extract(headers))
    }

    /// Starts a SERVER span (a proxied request, a decision-service, ext_authz or rate-limit
    /// service call) under `parent`.
    /// The attributes are built only for a span that is recorded: an unsampled request
    /// allocates none of them.
    pub fn server_span(
        &self,
        name: &'static str,
        parent: &Context,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> RequestSpan {
        let mut span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(&self.tracer, parent);
        if span.is_recording() {
            for attribute in attributes() {
                span.set_attribute(attribute);
            }
        }
        RequestSpan {
            span,
            client: None,
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
        self.server_span(method_name(method), &parent, || {
            http_server_attributes(method, path, host, protocol_version)
        })
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
        let mut span = self.server_span(name, &parent, || {
            vec![KeyValue::new("http.route", "/v1/decision")]
        });
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
        let mut parent = self.parent(metadata, peer_trusted);
        if !parent.has_active_span() {
            if let Some(fallback) = fallback {
                parent = self.parent(fallback, peer_trusted);
            }
        }
        let mut span = self.server_span(name, &parent, || {
            vec![
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", service),
                KeyValue::new("rpc.method", method),
            ]
        });
        span.method = "HTTP";
        span
    }

    /// Writes `traceparent` (and `tracestate`) for `context` through `set`.
    /// Written by hand rather than through the propagator: its `format!` of the ids cost about
    /// 5 000 instructions per request, this a few hundred (the same bytes; a unit test checks
    /// them against the propagator's).
    fn inject(&self, context: &SpanContext, set: &mut dyn FnMut(&'static str, String)) {
        if !context.is_valid() {
            return;
        }
        set("traceparent", traceparent(context));
        let state = context.trace_state().header();
        if !state.is_empty() {
            set("tracestate", state);
        }
    }

    /// Exports what is queued and stops, within `timeout` (a collector that is down does not
    /// hold the gateway's exit longer).
    pub fn shutdown(&self, timeout: Duration) {
        if let Err(e) = self.provider.shutdown_with_timeout(timeout) {
            tracing::warn!("traces: shutting the exporter down: {e}");
        }
        self.runtime.stop();
    }
}

/// Where a request's headers are read from (Pingora's, tonic's metadata, a described request's).
pub trait HeaderSource {
    fn header(&self, name: &str) -> Option<&str>;
}

impl HeaderSource for http::HeaderMap {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| v.to_str().ok())
    }
}

struct Extract<'a>(&'a dyn HeaderSource);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.header(key)
    }

    fn keys(&self) -> Vec<&str> {
        // Only the trace-context propagator reads through this, and it asks by name.
        Vec::new()
    }
}

/// W3C `traceparent` (version 00) of a span context: `00-<trace id>-<span id>-<flags>`.
fn traceparent(context: &SpanContext) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(55);
    out.extend_from_slice(b"00-");
    let hex = |bytes: &[u8], out: &mut Vec<u8>| {
        for byte in bytes {
            out.push(HEX[usize::from(byte >> 4)]);
            out.push(HEX[usize::from(byte & 0xf)]);
        }
    };
    hex(&context.trace_id().to_bytes(), &mut out);
    out.push(b'-');
    hex(&context.span_id().to_bytes(), &mut out);
    out.push(b'-');
    // Only the sampled bit is defined in version 00.
    let flags = context.trace_flags() & opentelemetry::trace::TraceFlags::SAMPLED;
    hex(&[flags.to_u8()], &mut out);
    // Hex digits and dashes only.
    String::from_utf8(out).unwrap_or_default()
}

/// A request's SERVER span and, once the request goes upstream, its CLIENT span.
pub struct RequestSpan {
    span: opentelemetry_sdk::trace::Span,
    client: Option<opentelemetry_sdk::trace::Span>,
    /// The status the upstream answered with.
    upstream_status: Option<u16>,
    /// The request's method as a span name allows it (`GET`, ..., `HTTP`).
    method: &'static str,
}

impl RequestSpan {
    /// The trace as the core sees it (the `RATE_LIMIT` line's `trace_id`, whether to summarise
    /// the decision).
    pub fn facts(&self) -> TraceFacts {
        let context = self.span.span_context();
        TraceFacts {
            trace_id: context.trace_id().to_bytes(),
            sampled: context.is_sampled(),
        }
    }

    /// The trace id as 32 lower-case hex digits (the access log's `trace_id`).
    pub fn trace_id(&self) -> String {
        self.span.span_context().trace_id().to_string()
    }

    pub fn set(&mut self, attribute: KeyValue) {
        self.span.set_attribute(attribute);
    }

    /// `client.address`: the client as resolved for limiting (behind a trusted proxy, the
    /// address it forwarded).
    pub fn client(&mut self, ip: IpAddr) {
        if self.span.is_recording() {
            self.span.set_attribute(client_address(ip));
        }
    }

    /// `http.route`: the matched route's path prefix; the span is renamed `METHOD route`.
    pub fn route(&mut self, route: &str) {
        if self.span.is_recording() {
            self.span
                .set_attribute(KeyValue::new("http.route", route.to_string()));
            self.span.update_name(format!("{} {route}", self.method));
        }
    }

    /// The HTTP attributes of the request a decision call describes (ext_authz's original
    /// request): method, path, host.
    pub fn described(&mut self, method: &str, path: &str, host: Option<&str>) {
        if !self.span.is_recording() {
            return;
        }
        self.span.set_attribute(KeyValue::new(
            "http.request.method",
            method_name_or_other(method),
        ));
        self.span
            .set_attribute(KeyValue::new("url.path", path.to_string()));
        if let Some(host) = host.map(crate::descriptor::strip_port) {
            self.span
                .set_attribute(KeyValue::new("server.address", host.to_string()));
        }
    }

    /// A rate-limit service answer: `tollgate.decision` (`refuse` when over the limit), the
    /// rule over the limit (else the tightest), and the fewest requests left.
    pub fn rls_answered(&mut self, over_limit: bool, rule: Option<&str>, remaining: Option<u64>) {
        if !self.span.is_recording() {
            return;
        }
        self.span.set_attribute(KeyValue::new(
            "tollgate.decision",
            if over_limit { "refuse" } else { "allow" },
        ));
        if over_limit {
            self.span
                .set_attribute(KeyValue::new("tollgate.reason", "over_limit"));
        }
        if let Some(rule) = rule {
            self.span
                .set_attribute(KeyValue::new("tollgate.rule", rule.to_string()));
        }
        if let Some(remaining) = remaining {
            self.span.set_attribute(KeyValue::new(
                "tollgate.remaining",
                i64::try_from(remaining).unwrap_or(i64::MAX),
            ));
        }
    }

    /// Ends a gRPC call's span with its status code (0: OK); an error status when it is not OK.
    pub fn finish_rpc(mut self, code: i32, message: &str) {
        if !self.span.is_recording() {
            self.span.end();
            return;
        }
        self.span
            .set_attribute(KeyValue::new("rpc.grpc.status_code", i64::from(code)));
        if code != 0 {
            self.span.set_status(Status::error(message.to_string()));
        }
        self.span.end();
    }

    /// The upstream answered with `status`.
    pub fn upstream_responded(&mut self, status: u16) {
        self.upstream_status = Some(status);
    }

    /// The decision's attributes: `tollgate.decision`, `tollgate.policy`, `tollgate.rule`,
    /// `tollgate.reason`, `tollgate.remaining`.
    pub fn decided(&mut self, summary: &DecisionSummary) {
        if !self.span.is_recording() {
            return;
        }
        self.span
            .set_attribute(KeyValue::new("tollgate.decision", summary.decision));
        if let Some(policy) = &summary.policy {
            self.span
                .set_attribute(KeyValue::new("tollgate.policy", policy.clone()));
        }
        if let Some(rule) = &summary.rule {
            self.span
                .set_attribute(KeyValue::new("tollgate.rule", rule.clone()));
        }
        if let Some(reason) = summary.reason {
            self.span
                .set_attribute(KeyValue::new("tollgate.reason", reason));
        }
        if let Some(remaining) = summary.remaining {
            self.span.set_attribute(KeyValue::new(
                "tollgate.remaining",
                i64::try_from(remaining).unwrap_or(i64::MAX),
            ));
        }
    }

    /// Starts the CLIENT span of the upstream call (once per request: a retry is an event on
    /// it). `server` is the server first chosen.
    pub fn upstream_started(
        &mut self,
        telemetry: &Telemetry,
        group: &str,
        server: std::net::SocketAddr,
    ) {
        // An unsampled request gets no CLIENT span: the upstream continues the SERVER span's
        // context (its `sampled` flag off), and nothing else would read the span.
        if self.client.is_some() || !self.span.is_recording() {
            return;
        }
        let parent = Context::new().with_remote_span_context(self.span.span_context().clone());
        let span = telemetry
            .tracer
            .span_builder(self.method)
            .with_kind(SpanKind::Client)
            .with_attributes(vec![
                KeyValue::new("http.request.method", method_or_other(self.method)),
                KeyValue::new("tollgate.upstream_group", group.to_string()),
                KeyValue::new("server.address", server.ip().to_string()),
                KeyValue::new("server.port", i64::from(server.port())),
            ])
            .start_with_context(&telemetry.tracer, &parent);
        self.client = Some(span);
    }

    /// The upstream call is recorded (worth building an event's attributes for).
    pub fn upstream_recorded(&self) -> bool {
        self.client.as_ref().is_some_and(|c| c.is_recording())
    }

    /// An event on the upstream call (`connect`, `retry`, `ejection`, `connect_failed`).
    pub fn upstream_event(&mut self, name: &'static str, attributes: Vec<KeyValue>) {
        if let Some(client) = self.client.as_mut().filter(|c| c.is_recording()) {
            client.add_event(name, attributes);
        }
    }

    /// Sets an attribute of the upstream call's span.
    pub fn upstream_set(&mut self, attribute: KeyValue) {
        if let Some(client) = self.client.as_mut() {
            client.set_attribute(attribute);
        }
    }

    /// The headers that carry the trace to the upstream: the CLIENT span's context (the SERVER
    /// span's before one exists).
    pub fn inject_upstream(
        &self,
        telemetry: &Telemetry,
        set: &mut dyn FnMut(&'static str, String),
    ) {
        let context = self
            .client
            .as_ref()
            .map_or_else(|| self.span.span_context(), |c| c.span_context());
        telemetry.inject(context, set);
    }

    /// Ends both spans with the response's status (0: none was sent) and the error that ended
    /// the request, if one did (Pingora's error kind: never request data). A 5xx, or no
    /// response, marks a span as an error, as the HTTP conventions say.
    pub fn finish(mut self, status: u16, error: Option<&str>) {
        if let Some(mut client) = self.client.take() {
            match self.upstream_status {
                Some(code) => {
                    client
                        .set_attribute(KeyValue::new("http.response.status_code", i64::from(code)));
                    if code >= 500 {
                        client.set_status(Status::error(String::new()));
                    }
                }
                None => {
                    client.set_status(Status::error(error.unwrap_or("no response").to_string()))
                }
            }
            client.end();
        }
        if !self.span.is_recording() {
            self.span.end();
            return;
        }
        if status > 0 {
            self.span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
        }
        if status >= 500 || (status == 0 && error.is_some()) {
            self.span
                .set_status(Status::error(error.unwrap_or_default().to_string()));
        }
        self.span.end();
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

/// The HTTP conventions' attributes known when a request arrives.
pub fn http_server_attributes(
    method: &str,
    path: &str,
    host: Option<&str>,
    protocol_version: &'static str,
) -> Vec<KeyValue> {
    let mut attributes = Vec::with_capacity(8);
    attributes.push(KeyValue::new(
        "http.request.method",
        method_name_or_other(method),
    ));
    attributes.push(KeyValue::new("url.path", path.to_string()));
    if let Some(host) = host.map(crate::descriptor::strip_port) {
        attributes.push(KeyValue::new("server.address", host.to_string()));
    }
    attributes.push(KeyValue::new("network.protocol.version", protocol_version));
    attributes
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

/// The attributes of an upstream event: the server tried and the attempt's number.
pub fn server_attributes(server: std::net::SocketAddr, attempt: usize) -> Vec<KeyValue> {
    vec![
        KeyValue::new("server.address", server.ip().to_string()),
        KeyValue::new("server.port", i64::from(server.port())),
        KeyValue::new(
            "tollgate.attempt",
            i64::try_from(attempt).unwrap_or(i64::MAX),
        ),
    ]
}

/// One attribute (for the glue that names no `opentelemetry` type of its own).
pub fn attribute(key: &'static str, value: impl Into<opentelemetry::Value>) -> KeyValue {
    KeyValue::new(key, value)
}

/// `client.address`.
pub fn client_address(ip: IpAddr) -> KeyValue {
    KeyValue::new("client.address", ip.to_string())
}

/// Bounds the spans waiting for export and counts the ones a full queue turns away. Every
/// span it lets through is accounted for until the exporter takes it (`pending`), so the batch
/// processor's own queue (the same size) never fills and every drop happens, and is counted,
/// here.
#[derive(Debug)]
struct DropCounting {
    inner: BatchSpanProcessor,
    pending: Arc<AtomicUsize>,
    capacity: usize,
    dropped: prometheus::IntCounter,
}

impl SpanProcessor for DropCounting {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.pending.fetch_add(1, Ordering::Relaxed) >= self.capacity {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, run on the export runtime: the batch processor's thread hands it a batch
/// and waits; the connection work (tonic's channel, hyper's client) happens on the runtime,
/// never on a request's.
#[derive(Debug)]
struct OnExportRuntime<E> {
    inner: Arc<tokio::sync::Mutex<E>>,
    handle: tokio::runtime::Handle,
    pending: Arc<AtomicUsize>,
}

impl<E: SpanExporter + 'static> SpanExporter for OnExportRuntime<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        // Out of the queue: room for as many new spans.
        self.pending.fetch_sub(batch.len(), Ordering::Relaxed);
        let inner = Arc::clone(&self.inner);
        let task = self.handle.spawn(async move {
            let exporter = inner.lock().await;
            exporter.export(batch).await
        });
        async move {
            task.await
                .unwrap_or_else(|e| Err(OTelSdkError::InternalFailure(e.to_string())))
        }
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        match self.inner.try_lock() {
            Ok(mut exporter) => exporter.shutdown_with_timeout(timeout),
            // An export still running: it ends with its own timeout.
            Err(_) => Ok(()),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called on the batch processor's thread (no runtime there), before any export.
        match self.inner.try_lock() {
            Ok(mut exporter) => exporter.set_resource(resource),
            Err(_) => self.inner.blocking_lock().set_resource(resource),
        }
    }
}

/// A one-thread runtime of the exporter's own.
struct ExportRuntime {
    handle: tokio::runtime::Handle,
    stop: parking_lot::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl ExportRuntime {
    fn start() -> std::io::Result<ExportRuntime> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("tollgate-otlp".to_string())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok(ExportRuntime {
            handle,
            stop: parking_lot::Mutex::new(Some(stop)),
        })
    }

    fn stop(&self) {
        if let Some(stop) = self.stop.lock().take() {
            let _ = stop.send(());
        }
    }
}

#[cfg(test)]
mod tests {
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
            format!("invalid URI {}/v1/traces", crate::redact::url(endpoint))
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
            let cx = telemetry.parent(&headers, peer_trusted);
            let id = cx
                .has_active_span()
                .then(|| cx.span().span_context().trace_id().to_string());
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
        use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};
        for (flags, state) in [
            (TraceFlags::SAMPLED, "vendor=1,other=x"),
            (TraceFlags::default(), ""),
        ] {
            let context = SpanContext::new(
                TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
                SpanId::from_hex("00f067aa0ba902b7").unwrap(),
                flags,
                true,
                TraceState::from_key_value(
                    state
                        .split(',')
                        .filter(|kv| !kv.is_empty())
                        .filter_map(|kv| kv.split_once('=')),
                )
                .unwrap(),
            );
            let mut expected = std::collections::HashMap::new();
            TraceContextPropagator::new().inject_context(
                &Context::new().with_remote_span_context(context.clone()),
                &mut expected,
            );
            assert_eq!(Some(&traceparent(&context)), expected.get("traceparent"));
            assert_eq!(
                &context.trace_state().header(),
                expected.get("tracestate").unwrap()
            );
        }
    }

    #[test]
    fn span_names_and_methods_never_carry_request_text() {
        assert_eq!(method_name("GET"), "GET");
        assert_eq!(method_name("BREW"), "HTTP");
        assert_eq!(method_name_or_other("BREW"), "_OTHER");
        assert_eq!(method_name_or_other("PATCH"), "PATCH");
    }
}
