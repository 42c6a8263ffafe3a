//! gRPC glue for Envoy (the only module that names tonic and Envoy protobuf types): the
//! `RateLimitService` v3 (`ShouldRateLimit`) and `Authorization` v3 (`Check`) on one listener,
//! with `grpc.health.v1`, on their own multi-threaded runtime of `--threads` workers. Requests
//! are translated into [`RlsRequest`] / [`RequestFacts`](crate::request::descriptor::RequestFacts) and answered by the [`Gateway`]; this
//! module only converts.

use crate::config::GrpcConfig;
use crate::engine::headers::HeaderList;
use crate::engine::rls::{self, LimitOverride, RlsDescriptor, RlsRequest};
use crate::service::{Gateway, RlsFailure};
use envoy_types::pb::envoy::config::core::v3::{
    address, HeaderValue as PbHeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, RateLimitUnit};
use envoy_types::pb::envoy::service::auth::v3::attribute_context::HttpRequest;
use envoy_types::pb::envoy::service::auth::v3::authorization_server::{
    Authorization, AuthorizationServer,
};
use envoy_types::pb::envoy::service::auth::v3::{
    check_response, CheckRequest, CheckResponse, DeniedHttpResponse, OkHttpResponse,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit as PbUnit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Most concurrent connections the gRPC listener holds (an Envoy worker keeps one or a few);
/// further ones wait in the kernel's accept queue until one closes.
pub const MAX_CONNECTIONS: usize = 4096;
/// Most calls in flight on one HTTP/2 connection (hyper's default when unset; tonic lifts it).
const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// A call taking longer than this is answered `CANCELLED`: a slow store never pins a stream.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// gRPC status codes used in `CheckResponse.status` (google.rpc.Code).
const RPC_OK: i32 = 0;
const RPC_INVALID_ARGUMENT: i32 = 3;
const RPC_RESOURCE_EXHAUSTED: i32 = 8;
const RPC_UNAUTHENTICATED: i32 = 16;

/// Why the gRPC listener cannot start.
#[derive(Debug, thiserror::Error)]
pub enum GrpcStartError {
    #[error("{flag} {path}: cannot read: {source}")]
    Read {
        flag: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("--grpc-tls-cert/--grpc-tls-key: {}: no PEM certificate in the file", .file.display())]
    NoCertificate { file: std::path::PathBuf },
    #[error("--grpc-tls-cert/--grpc-tls-key: {}: no PEM private key in the file", .file.display())]
    NoKey { file: std::path::PathBuf },
    #[error("--grpc-tls-cert/--grpc-tls-key: {}: unusable private key: {source}", .file.display())]
    BadKey {
        file: std::path::PathBuf,
        source: std::io::Error,
    },
    /// The pair as tonic refused it, with the whole chain of causes.
    #[error("--grpc-tls-cert/--grpc-tls-key: {} and {}: {causes}", .cert.display(), .key.display())]
    Refused {
        cert: std::path::PathBuf,
        key: std::path::PathBuf,
        causes: String,
    },
    #[error("gRPC runtime: {0}")]
    Runtime(std::io::Error),
}

/// The running gRPC listener; [`GrpcServer::shutdown`] drains it.
pub struct GrpcServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GrpcServer {
    /// Serves on a runtime of `threads` workers in its own thread, on the listener `listener`
    /// delivers: bound by [`crate::proxy::bind`] at start-up, or handed over by the process this one upgrades
    /// (a bad certificate stops start-up either way).
    ///
    /// # Errors
    /// The certificate or key cannot be read or used, or the runtime cannot start.
    pub fn start(
        gateway: Arc<Gateway>,
        config: &GrpcConfig,
        threads: usize,
        listener: tokio::sync::oneshot::Receiver<std::net::TcpListener>,
    ) -> Result<Self, GrpcStartError> {
        let tls = match &config.tls {
            None => None,
            Some((cert, key)) => Some(tls_config(cert, key)?),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("tollgate-grpc")
            .enable_all()
            .build()
            .map_err(GrpcStartError::Runtime)?;
        // Checked before the thread starts, so a TLS configuration tonic refuses fails start-up.
        let mut builder = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            .concurrency_limit_per_connection(MAX_STREAMS_PER_CONNECTION as usize)
            .timeout(CALL_TIMEOUT)
            .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)));
        if let (Some(tls), Some((cert, key))) = (tls, &config.tls) {
            builder = builder.tls_config(tls).map_err(|e| {
                let mut causes = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(cause) = source {
                    causes.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                GrpcStartError::Refused {
                    cert: cert.clone(),
                    key: key.clone(),
                    causes,
                }
            })?;
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let store_errors_fail_open = config.store_errors_fail_open;
        let listen = config.listen;
        let thread = std::thread::Builder::new()
            .name("tollgate-grpc".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = listener.await else {
                        return;
                    };
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!("gRPC listener {listen}: {e}");
                            return;
                        }
                    };
                    let incoming = capped_incoming(listener, MAX_CONNECTIONS);
                    let (health, health_service) = tonic_health::server::health_reporter();
                    health
                        .set_serving::<RateLimitServiceServer<RateLimiter>>()
                        .await;
                    health
                        .set_serving::<AuthorizationServer<Authorizer>>()
                        .await;
                    let router = builder
                        .add_service(health_service)
                        .add_service(RateLimitServiceServer::new(RateLimiter {
                            gateway: Arc::clone(&gateway),
                            store_errors_fail_open,
                        }))
                        .add_service(AuthorizationServer::new(Authorizer { gateway }));
                    let result = router
                        .serve_with_incoming_shutdown(incoming, async {
                            let _ = stopped.await;
                        })
                        .await;
                    if let Err(e) = result {
                        tracing::error!("gRPC listener {listen} stopped: {e}");
                    }
                });
            })
            .map_err(GrpcStartError::Runtime)?;
        tracing::info!(grpc_listen = %config.listen, tls = config.tls.is_some(), threads,
            "gRPC listener (Envoy RateLimitService, ext_authz, health)");
        Ok(GrpcServer {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops accepting, lets in-flight calls finish, and waits for the runtime to end.
    pub fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepted connections, at most `cap` open at once: the next accept waits for a permit, so
/// connections beyond the cap queue in the kernel instead of costing memory here.
fn capped_incoming(
    listener: tokio::net::TcpListener,
    cap: usize,
) -> impl futures::Stream<Item = std::io::Result<CappedStream>> {
    let permits = Arc::new(tokio::sync::Semaphore::new(cap));
    futures::stream::unfold((listener, permits), |(listener, permits)| async move {
        let permit = Arc::clone(&permits).acquire_owned().await.ok()?;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let capped = CappedStream {
                        stream,
                        _permit: permit,
                    };
                    return Some((Ok(capped), (listener, permits)));
                }
                // Out of file descriptors, or a connection reset before accept: wait a moment
                // and go on; the listener itself stays up.
                Err(e) => {
                    tracing::debug!("gRPC accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    })
}

/// A client connection holding one of the listener's connection permits until it closes.
struct CappedStream {
    stream: tokio::net::TcpStream,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl tonic::transport::server::Connected for CappedStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl tokio::io::AsyncRead for CappedStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for CappedStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

fn tls_config(
    cert: &Path,
    key: &Path,
) -> Result<tonic::transport::ServerTlsConfig, GrpcStartError> {
    let read = |flag: &'static str, path: &Path| {
        std::fs::read(path).map_err(|source| GrpcStartError::Read {
            flag,
            path: path.display().to_string(),
            source,
        })
    };
    let cert_pem = read("--grpc-tls-cert", cert)?;
    let key_pem = read("--grpc-tls-key", key)?;
    if !String::from_utf8_lossy(&cert_pem).contains("-----BEGIN CERTIFICATE-----") {
        return Err(GrpcStartError::NoCertificate {
            file: cert.to_path_buf(),
        });
    }
    match crate::config::pem::private_key(&key_pem) {
        Ok(_) => {}
        Err(crate::config::pem::PemKeyError::NoKey) => {
            return Err(GrpcStartError::NoKey {
                file: key.to_path_buf(),
            })
        }
        Err(crate::config::pem::PemKeyError::NotPem(source)) => {
            return Err(GrpcStartError::BadKey {
                file: key.to_path_buf(),
                source,
            })
        }
    }
    let identity = tonic::transport::Identity::from_pem(cert_pem, key_pem);
    Ok(tonic::transport::ServerTlsConfig::new().identity(identity))
}

/// `envoy.service.ratelimit.v3.RateLimitService`.
struct RateLimiter {
    gateway: Arc<Gateway>,
    store_errors_fail_open: bool,
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let mut trace = self.gateway.telemetry().map(|telemetry| {
            let trusted = self
                .gateway
                .believes_network_headers(request.remote_addr().map(|a| a.ip()));
            telemetry.grpc_call(
                &Metadata(request.metadata()),
                None,
                trusted,
                "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                "envoy.service.ratelimit.v3.RateLimitService",
                "ShouldRateLimit",
            )
        });
        let answered = self.rate_limit(request, trace.as_mut()).await;
        if let Some(trace) = trace {
            match &answered {
                Ok(_) => trace.finish_rpc(0, ""),
                Err(status) => trace.finish_rpc(status.code() as i32, status.message()),
            }
        }
        answered
    }
}

/// Reads trace context from a gRPC call's metadata.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl crate::telemetry::traces::HeaderSource for Metadata<'_> {
    fn header(&self, name: &http::HeaderName) -> Option<&str> {
        self.0.get(name.as_str()).and_then(|v| v.to_str().ok())
    }
}

impl RateLimiter {
    async fn rate_limit(
        &self,
        request: Request<RateLimitRequest>,
        trace: Option<&mut crate::telemetry::traces::RequestSpan>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let request = rls_request(request.into_inner());
        let metrics = &self.gateway.metrics;
        let reply = self
            .gateway
            .should_rate_limit(&request, self.store_errors_fail_open)
            .await
            .map_err(|e| match e {
                RlsFailure::Invalid(e) => {
                    metrics.grpc_call("ratelimit", "invalid_argument");
                    Status::invalid_argument(e.to_string())
                }
                RlsFailure::NoPolicy => {
                    metrics.grpc_call("ratelimit", "unavailable");
                    Status::unavailable("no policy loaded")
                }
                RlsFailure::StoreUnavailable => {
                    metrics.grpc_call("ratelimit", "unavailable");
                    Status::unavailable("the rate-limit store is unavailable")
                }
            })?;
        metrics.grpc_call(
            "ratelimit",
            if reply.over_limit { "over_limit" } else { "ok" },
        );
        if let Some(trace) = trace {
            let limited = reply.statuses.iter().filter(|s| s.current_limit.is_some());
            let named = reply
                .statuses
                .iter()
                .find(|s| s.over_limit && s.current_limit.is_some())
                .or_else(|| limited.clone().min_by_key(|s| s.limit_remaining));
            trace.rls_answered(
                reply.over_limit,
                named
                    .and_then(|s| s.current_limit.as_ref())
                    .map(|l| l.name.as_str()),
                limited.map(|s| u64::from(s.limit_remaining)).min(),
            );
        }
        let statuses = reply
            .statuses
            .iter()
            .map(|s| DescriptorStatus {
                code: if s.over_limit {
                    Code::OverLimit
                } else {
                    Code::Ok
                } as i32,
                current_limit: s.current_limit.as_ref().map(|l| RateLimit {
                    name: l.name.clone(),
                    requests_per_unit: l.requests_per_unit,
                    unit: pb_unit(l.unit) as i32,
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: Some(PbDuration {
                    seconds: i64::try_from(s.duration_until_reset).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
                quota: None,
            })
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: if reply.over_limit {
                Code::OverLimit
            } else {
                Code::Ok
            } as i32,
            statuses,
            response_headers_to_add: header_values(&reply.response.headers),
            ..RateLimitResponse::default()
        }))
    }
}

/// The protobuf request as [`RlsRequest`].
fn rls_request(request: RateLimitRequest) -> RlsRequest {
    RlsRequest {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors: request
            .descriptors
            .into_iter()
            .map(|d: RateLimitDescriptor| RlsDescriptor {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                limit: d.limit.map(|l| LimitOverride {
                    requests_per_unit: l.requests_per_unit,
                    unit: unit_of(l.unit),
                }),
                hits_addend: d.hits_addend.map(|h| h.value),
                negative_hits: d.is_negative_hits,
            })
            .collect(),
    }
}

fn unit_of(unit: i32) -> Option<rls::Unit> {
    Some(match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Second => rls::Unit::Second,
        RateLimitUnit::Minute => rls::Unit::Minute,
        RateLimitUnit::Hour => rls::Unit::Hour,
        RateLimitUnit::Day => rls::Unit::Day,
        RateLimitUnit::Month => rls::Unit::Month,
        RateLimitUnit::Year => rls::Unit::Year,
        RateLimitUnit::Unknown => return None,
    })
}

fn pb_unit(unit: rls::Unit) -> PbUnit {
    match unit {
        rls::Unit::Second => PbUnit::Second,
        rls::Unit::Minute => PbUnit::Minute,
        rls::Unit::Hour => PbUnit::Hour,
        rls::Unit::Day => PbUnit::Day,
        rls::Unit::Week => PbUnit::Week,
        rls::Unit::Month => PbUnit::Month,
        rls::Unit::Year => PbUnit::Year,
    }
}

fn header_values(headers: &HeaderList) -> Vec<PbHeaderValue> {
    headers
        .iter()
        .map(|(name, value)| PbHeaderValue {
            key: name.as_str().to_string(),
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
            ..PbHeaderValue::default()
        })
        .collect()
}

fn header_options(headers: &HeaderList) -> Vec<HeaderValueOption> {
    header_values(headers)
        .into_iter()
        .map(|header| HeaderValueOption {
            header: Some(header),
            ..HeaderValueOption::default()
        })
        .collect()
}

/// The header carrying an LLM reservation's token to the upstream (ext_authz) or the caller
/// (the decision service), for `POST /v1/usage`.
pub const RESERVATION_HEADER: &str = "x-tollgate-reservation";
/// The tokens that reservation holds.
pub const RESERVED_TOKENS_HEADER: &str = "x-tollgate-reserved-tokens";

/// `envoy.service.auth.v3.Authorization`.
struct Authorizer {
    gateway: Arc<Gateway>,
}

#[tonic::async_trait]
impl Authorization for Authorizer {
    async fn check(
        &self,
        request: Request<CheckRequest>,
    ) -> Result<Response<CheckResponse>, Status> {
        let mut trace = None;
        let answered = self.authorize(request, &mut trace).await;
        if let Some(trace) = trace {
            match &answered {
                Ok(_) => trace.finish_rpc(0, ""),
                Err(status) => trace.finish_rpc(status.code() as i32, status.message()),
            }
        }
        answered
    }
}

impl Authorizer {
    /// `Check`: the described request read from the call, its trace started, decided, and the
    /// answer turned into Envoy's; `trace` gets the call's span once the described request is
    /// known.
    async fn authorize(
        &self,
        request: Request<CheckRequest>,
        trace: &mut Option<crate::telemetry::traces::RequestSpan>,
    ) -> Result<Response<CheckResponse>, Status> {
        let call = self.read_call(request)?;
        let http = &call.http;
        let host = (!http.host.is_empty()).then_some(http.host.as_str());
        let target = if http.path.is_empty() {
            "/"
        } else {
            http.path.as_str()
        };
        // The peer is the client unless it is a trusted proxy, as on the proxy listener.
        let client_ip = self.gateway.client_ip(call.peer, &call.headers, false);
        *trace = self.start_trace(&call, host, target, client_ip);
        // `token_bucket_llm`: the body Envoy sends (`with_request_body`) is the prompt.
        let llm = self.gateway.meters_tokens().then(|| {
            crate::request::llm::LlmRequest::parse_with(
                call.body(),
                self.gateway.tiktoken_encodings(),
            )
        });
        let mut answer = self
            .gateway
            .decide_described(&crate::service::Described {
                method: &http.method,
                target,
                host,
                client_ip,
                headers: &call.headers,
                body: crate::service::DescribedBody {
                    // With `with_request_body`, loop detection fingerprints the body.
                    hash: crate::request::descriptor::body_hash(call.body()),
                    llm: llm.as_ref(),
                },
                network_trusted: call.network_trusted,
                trace: trace.as_ref().map(|t| t.facts()),
            })
            .await;
        if let (Some(trace), Some(summary)) = (trace.as_mut(), answer.summary.as_deref()) {
            trace.decided(summary);
        }
        let upstream_headers = self.reservation_headers(&mut answer);
        self.check_response(answer, upstream_headers)
            .map(Response::new)
    }

    /// The HTTP request a call describes, with its headers as a map; a call without one, or
    /// whose host or path holds control characters, is refused `INVALID_ARGUMENT`.
    fn read_call(&self, request: Request<CheckRequest>) -> Result<CheckCall, Status> {
        // The gRPC connection's peer (Envoy itself): its network headers are believed only
        // when the operator named it with --trusted-proxy.
        let network_trusted = self
            .gateway
            .believes_network_headers(request.remote_addr().map(|a| a.ip()));
        // Envoy's own context (its ext_authz span) travels in the call's metadata.
        let metadata = self.gateway.telemetry().map(|_| request.metadata().clone());
        let attributes = request.into_inner().attributes.unwrap_or_default();
        let peer = attributes
            .source
            .and_then(|s| s.address)
            .and_then(|a| a.address)
            .and_then(|a| match a {
                address::Address::SocketAddress(s) => s.address.parse::<IpAddr>().ok(),
                _ => None,
            });
        let http = attributes.request.and_then(|r| r.http).ok_or_else(|| {
            self.gateway.metrics.grpc_call("authz", "invalid_argument");
            Status::invalid_argument("attributes.request.http is missing")
        })?;
        let headers = header_map(&http);
        // These are logged with a refusal: no control characters (no forged log lines).
        if http.host.chars().any(char::is_control) || http.path.chars().any(char::is_control) {
            self.gateway.metrics.grpc_call("authz", "invalid_argument");
            return Err(Status::invalid_argument(
                "attributes.request.http: control characters in host or path",
            ));
        }
        Ok(CheckCall {
            network_trusted,
            metadata,
            peer,
            http,
            headers,
        })
    }

    /// The call's span, when traces are on: Envoy's context, else the described request's own
    /// `traceparent`.
    fn start_trace(
        &self,
        call: &CheckCall,
        host: Option<&str>,
        target: &str,
        client_ip: Option<IpAddr>,
    ) -> Option<crate::telemetry::traces::RequestSpan> {
        let (Some(telemetry), Some(metadata)) = (self.gateway.telemetry(), &call.metadata) else {
            return None;
        };
        let mut span = telemetry.grpc_call(
            &Metadata(metadata),
            Some(&call.headers),
            call.network_trusted,
            "envoy.service.auth.v3.Authorization/Check",
            "envoy.service.auth.v3.Authorization",
            "Check",
        );
        span.described(
            &call.http.method,
            crate::request::descriptor::split_uri(target).0,
            host,
        );
        if let Some(ip) = client_ip {
            span.client(ip);
        }
        Some(span)
    }

    /// The reservation's token and tokens, for the upstream, which reports the usage on
    /// `POST /v1/usage` (or the reservation stays charged as reserved).
    fn reservation_headers(&self, answer: &mut crate::service::Answer) -> Vec<HeaderValueOption> {
        let mut upstream_headers = Vec::new();
        let Some(reservation) = answer.reservation.take() else {
            return upstream_headers;
        };
        let tokens = reservation.tokens();
        if let Some(token) = self.gateway.tokens.hold(*reservation) {
            for (key, value) in [
                (RESERVATION_HEADER, token),
                (RESERVED_TOKENS_HEADER, tokens.to_string()),
            ] {
                upstream_headers.push(HeaderValueOption {
                    header: Some(PbHeaderValue {
                        key: key.to_string(),
                        value,
                        ..Default::default()
                    }),
                    ..HeaderValueOption::default()
                });
            }
        }
        upstream_headers
    }

    /// Envoy's answer (counted): OK with the headers for the upstream and the client, or
    /// denied with the refusal's status, headers and body; `UNAVAILABLE` with no policy loaded.
    fn check_response(
        &self,
        answer: crate::service::Answer,
        upstream_headers: Vec<HeaderValueOption>,
    ) -> Result<CheckResponse, Status> {
        if answer.verdict == crate::service::Verdict::NoPolicy {
            self.gateway.metrics.grpc_call("authz", "unavailable");
            return Err(Status::unavailable("no policy loaded"));
        }
        let allowed = answer.verdict.forwards();
        self.gateway
            .metrics
            .grpc_call("authz", if allowed { "ok" } else { "denied" });
        let response = answer.response;
        if allowed {
            return Ok(CheckResponse {
                status: Some(RpcStatus {
                    code: RPC_OK,
                    ..RpcStatus::default()
                }),
                http_response: Some(check_response::HttpResponse::OkResponse(OkHttpResponse {
                    headers: upstream_headers,
                    response_headers_to_add: header_options(&response.headers),
                    ..OkHttpResponse::default()
                })),
                ..CheckResponse::default()
            });
        }
        let code = match response.status {
            429 => RPC_RESOURCE_EXHAUSTED,
            401 => RPC_UNAUTHENTICATED,
            _ => RPC_INVALID_ARGUMENT,
        };
        Ok(CheckResponse {
            status: Some(RpcStatus {
                code,
                message: response.body.unwrap_or("").to_string(),
                ..RpcStatus::default()
            }),
            http_response: Some(check_response::HttpResponse::DeniedResponse(
                DeniedHttpResponse {
                    status: Some(HttpStatus {
                        code: i32::from(response.status),
                    }),
                    headers: header_options(&response.headers),
                    body: response.body.unwrap_or("").to_string(),
                },
            )),
            ..CheckResponse::default()
        })
    }
}

/// What a `Check` call describes, read from its message.
struct CheckCall {
    /// The call's peer is a `--trusted-proxy`: the described request's network headers are
    /// believed.
    network_trusted: bool,
    /// The call's metadata, when traces are on (Envoy's trace context).
    metadata: Option<tonic::metadata::MetadataMap>,
    /// The described request's client, as Envoy saw it.
    peer: Option<IpAddr>,
    http: HttpRequest,
    headers: http::HeaderMap,
}

impl CheckCall {
    /// The body Envoy sends with `with_request_body`: bytes in `raw_body`, else text in `body`.
    fn body(&self) -> &[u8] {
        if self.http.raw_body.is_empty() {
            self.http.body.as_bytes()
        } else {
            &self.http.raw_body
        }
    }
}

/// The described request's headers (both of Envoy's forms) as a map. Pseudo-headers
/// (`:path`...) are not headers; the request line comes from the message's own fields.
fn header_map(http: &HttpRequest) -> http::HeaderMap {
    let mut headers = http::HeaderMap::with_capacity(http.headers.len());
    let mut add = |name: &str, value: &[u8]| {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_bytes(value),
        ) {
            headers.append(name, value);
        }
    };
    for (name, value) in &http.headers {
        add(name, value.as_bytes());
    }
    if let Some(map) = &http.header_map {
        for h in &map.headers {
            let value = if h.raw_value.is_empty() {
                h.value.as_bytes()
            } else {
                &h.raw_value
            };
            add(&h.key, value);
        }
    }
    headers
}
