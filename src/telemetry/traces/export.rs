//! The export of finished spans, off the request path: a bounded queue the request threads push
//! records into, and a one-thread runtime of its own that takes batches from it, encodes each
//! batch once (`otlp`) and sends it to the collector, over gRPC (a unary `TraceService/Export`
//! call on tonic with a codec that passes the bytes through) or HTTP/protobuf (`POST` on a kept
//! hyper connection). Glue: it names tonic's and hyper's types, as the other network glue does.
//!
//! A batch is tried once: a failed export drops it (counted in `tollgate_trace_spans_dropped_total`)
//! and the export backs off (1 s, doubling to 16 s while the collector stays unreachable). While
//! it backs off the request path records nothing ([`Exporter::accepting`] is false: sampled spans
//! are counted as dropped at their start), so a collector that is down costs next to nothing;
//! when the back-off ends, a TCP connection to the collector is tried before recording resumes.

// A queued request's records stay in the box they were recorded in: moving the box moves a
// pointer, where moving the records would copy several hundred bytes each (clippy's `vec_box`
// assumes the opposite).
#![allow(clippy::vec_box)]

use super::otlp::Encoder;
use super::settings::{without_endpoints, EnvSettings, Protocol, TelemetryError};
use super::span::{Finished, SpanRecord};
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The collector's gRPC method (opentelemetry/proto/collector/trace/v1/trace_service.proto).
const GRPC_EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(16);

/// Where and how batches go (`OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`, the resource).
#[derive(Debug, Clone)]
pub struct Config {
    pub protocol: Protocol,
    pub endpoint: http::Uri,
    pub headers: http::HeaderMap,
    /// One export's limit: the smaller of `OTEL_EXPORTER_OTLP(_TRACES)_TIMEOUT` (10 s) and
    /// `OTEL_BSP_EXPORT_TIMEOUT` (30 s).
    pub timeout: Duration,
    pub schedule_delay: Duration,
    pub batch_size: usize,
    pub queue_size: usize,
    pub resource: Vec<(String, String)>,
}

/// A number of milliseconds from a variable; the default when unset or unreadable (as the SDKs).
fn millis(value: Option<String>, default: u64) -> Duration {
    Duration::from_millis(
        value
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(default),
    )
}

/// `%XX` escapes decoded (the headers variable's values are URL-encoded).
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `key=value,key=value` headers; a pair that is not a valid header is skipped (its name, never
/// its value, is logged).
fn headers(value: Option<String>, into: &mut http::HeaderMap) {
    let Some(value) = value else { return };
    for pair in value.split(',').filter(|p| !p.trim().is_empty()) {
        let Some((name, value)) = pair.split_once('=') else {
            tracing::warn!("traces: OTEL_EXPORTER_OTLP_HEADERS: an entry without `=` is skipped");
            continue;
        };
        let name = name.trim();
        match (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(percent_decoded(value.trim()).as_str()),
        ) {
            (Ok(name), Ok(value)) => {
                into.insert(name, value);
            }
            _ => tracing::warn!(
                header = %crate::telemetry::log_line::value(name),
                "traces: OTEL_EXPORTER_OTLP_HEADERS: not a valid header, skipped"
            ),
        }
    }
}

impl Config {
    /// # Errors
    /// An endpoint that is not an `http://` or `https://` URL, or compression asked for.
    pub fn read(
        settings: &EnvSettings,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, TelemetryError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if let Some(compression) = set("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION")
            .or_else(|| set("OTEL_EXPORTER_OTLP_COMPRESSION"))
            .filter(|c| c.trim() != "none")
        {
            return Err(TelemetryError::Exporter(format!(
                "compression {:?} is not built in (OTEL_EXPORTER_OTLP_COMPRESSION)",
                compression.trim()
            )));
        }
        let endpoint = match (
            set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            set("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(traces), _) => traces.trim().to_string(),
            (None, Some(base)) => match settings.protocol {
                Protocol::Grpc => base.trim().to_string(),
                Protocol::HttpProtobuf => {
                    format!("{}/v1/traces", base.trim().trim_end_matches('/'))
                }
            },
            // The specification's defaults (tracing is only on with an endpoint set, but a
            // caller may start it from settings of its own).
            (None, None) => match settings.protocol {
                Protocol::Grpc => "http://localhost:4317".to_string(),
                Protocol::HttpProtobuf => "http://localhost:4318/v1/traces".to_string(),
            },
        };
        let invalid = |why: &str| {
            TelemetryError::Exporter(without_endpoints(
                &format!("invalid endpoint {endpoint}: {why}"),
                &var,
            ))
        };
        let uri: http::Uri = endpoint.parse().map_err(|_| invalid("not a URL"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(invalid("not an http:// or https:// URL with a host"));
        }
        if settings.protocol == Protocol::Grpc && uri.scheme_str() == Some("https") {
            return Err(invalid(
                "OTLP over gRPC is built without TLS here; use http/protobuf for an https:// collector, or a plain http:// gRPC endpoint",
            ));
        }
        let mut header_map = http::HeaderMap::new();
        headers(set("OTEL_EXPORTER_OTLP_HEADERS"), &mut header_map);
        headers(set("OTEL_EXPORTER_OTLP_TRACES_HEADERS"), &mut header_map);
        let otlp_timeout = millis(
            set("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT").or_else(|| set("OTEL_EXPORTER_OTLP_TIMEOUT")),
            10_000,
        );
        let export_timeout = millis(set("OTEL_BSP_EXPORT_TIMEOUT"), 30_000);
        let batch_size = set("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or(512)
            .min(settings.max_queue_size);
        Ok(Config {
            protocol: settings.protocol,
            endpoint: uri,
            headers: header_map,
            timeout: otlp_timeout
                .min(export_timeout)
                .max(Duration::from_millis(1)),
            schedule_delay: millis(set("OTEL_BSP_SCHEDULE_DELAY"), 5_000)
                .max(Duration::from_millis(1)),
            batch_size,
            queue_size: settings.max_queue_size,
            resource: resource(&var),
        })
    }
}

/// The resource's attributes: `OTEL_RESOURCE_ATTRIBUTES` (`key=value`, comma-separated, a
/// later key winning), what wrote the spans, and `service.name` (`OTEL_SERVICE_NAME`, else the
/// attributes', else `tollgate`).
pub fn resource(var: &impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    let mut attributes: Vec<(String, String)> = Vec::new();
    let mut put = |key: &str, value: &str| match attributes.iter_mut().find(|(k, _)| k == key) {
        Some(kept) => kept.1 = value.to_string(),
        None => attributes.push((key.to_string(), value.to_string())),
    };
    put("service.name", "tollgate");
    put("telemetry.sdk.name", "tollgate");
    put("telemetry.sdk.language", "rust");
    put("telemetry.sdk.version", env!("CARGO_PKG_VERSION"));
    if let Some(list) = var("OTEL_RESOURCE_ATTRIBUTES") {
        for entry in list.split_terminator(',') {
            if let Some((key, value)) = entry.split_once('=') {
                put(key.trim(), value.trim());
            }
        }
    }
    if let Some(name) = var("OTEL_SERVICE_NAME").filter(|n| !n.trim().is_empty()) {
        put("service.name", name.trim());
    }
    attributes
}

/// Finished records waiting for export, at most `capacity` spans; and the boxes of records
/// already exported, handed back for later requests to reuse (at most `batch_size` of them).
pub struct Queue {
    waiting: parking_lot::Mutex<Waiting>,
    capacity: usize,
    batch_size: usize,
    /// Exported boxes, cleared ([`Finished::clear`]): a request takes one rather than
    /// allocating, and in a steady state the export thread frees none of the request threads'
    /// memory.
    spare: parking_lot::Mutex<Vec<Box<Finished>>>,
    /// Wakes the export when a batch is full.
    wake: tokio::sync::Notify,
    dropped: prometheus::IntCounter,
}

/// The queue's contents: requests' records, and how many spans they hold.
#[derive(Default)]
struct Waiting {
    records: Vec<Box<Finished>>,
    spans: usize,
}

impl Queue {
    /// A box for a request's records, holding `server`: an exported one when there is one.
    pub fn record(&self, server: SpanRecord) -> Box<Finished> {
        let spare = self.spare.lock().pop();
        match spare {
            Some(mut finished) => {
                finished.server = server;
                finished
            }
            None => Box::new(Finished::new(server)),
        }
    }

    /// Takes the exported boxes of `batch` back for reuse (as many as there is room for; the
    /// rest are freed); `batch` is left empty.
    fn recycle(&self, batch: &mut Vec<Box<Finished>>) {
        for finished in batch.iter_mut() {
            finished.clear();
        }
        let mut spare = self.spare.lock();
        let kept = batch.len().min(self.batch_size.saturating_sub(spare.len()));
        spare.extend(batch.drain(..kept));
        drop(spare);
        // Freed here, outside the lock.
        batch.clear();
    }

    /// A request's finished records; dropped and counted when they do not fit.
    pub fn push(&self, finished: Box<Finished>) {
        let spans = finished.spans();
        let mut waiting = self.waiting.lock();
        let before = waiting.spans;
        if before + spans > self.capacity {
            drop(waiting);
            // Freed here, outside the lock.
            drop(finished);
            self.dropped.inc_by(spans as u64);
            return;
        }
        waiting.records.push(finished);
        waiting.spans = before + spans;
        let batch_full = before < self.batch_size && before + spans >= self.batch_size;
        drop(waiting);
        if batch_full {
            self.wake.notify_one();
        }
    }

    /// Moves the oldest records, up to a batch of spans (at least one record), into `into`
    /// (empty); returns the spans moved and the spans left.
    fn take(&self, into: &mut Vec<Box<Finished>>) -> (usize, usize) {
        let mut waiting = self.waiting.lock();
        if waiting.spans <= self.batch_size {
            std::mem::swap(&mut waiting.records, into);
            let taken = std::mem::take(&mut waiting.spans);
            return (taken, 0);
        }
        let mut taken = 0;
        let mut count = 0;
        for finished in &waiting.records {
            if count > 0 && taken + finished.spans() > self.batch_size {
                break;
            }
            taken += finished.spans();
            count += 1;
        }
        into.extend(waiting.records.drain(..count));
        waiting.spans -= taken;
        (taken, waiting.spans)
    }
}

/// The running export: the queue, whether it takes spans, and the way to stop it.
pub struct Exporter {
    queue: Arc<Queue>,
    accepting: Arc<AtomicBool>,
    stop: parking_lot::Mutex<Option<tokio::sync::oneshot::Sender<Stop>>>,
}

/// Asks the export to send what is queued by `deadline`, then to say so and end.
struct Stop {
    deadline: Instant,
    done: std::sync::mpsc::SyncSender<()>,
}

impl Exporter {
    /// Starts the export thread and its runtime.
    ///
    /// # Errors
    /// The runtime or its thread cannot start, or the TLS setup for an `https` endpoint fails.
    pub fn start(
        config: Config,
        dropped: prometheus::IntCounter,
    ) -> Result<Exporter, TelemetryError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(TelemetryError::Runtime)?;
        let transport = {
            // tonic's channel is made in the runtime that drives it.
            let _entered = runtime.enter();
            Transport::new(&config)?
        };
        let queue = Arc::new(Queue {
            waiting: parking_lot::Mutex::new(Waiting {
                records: Vec::with_capacity(config.batch_size),
                spans: 0,
            }),
            capacity: config.queue_size,
            batch_size: config.batch_size,
            wake: tokio::sync::Notify::new(),
            spare: parking_lot::Mutex::new(Vec::new()),
            dropped,
        });
        let accepting = Arc::new(AtomicBool::new(true));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let worker = Worker {
            queue: Arc::clone(&queue),
            accepting: Arc::clone(&accepting),
            encoder: Encoder::new(&config.resource),
            scratch: Arc::new(parking_lot::Mutex::new(Some(Vec::new()))),
            transport,
            config,
            backoff: FIRST_BACKOFF,
            resume_at: None,
        };
        std::thread::Builder::new()
            .name("tollgate-otlp".to_string())
            .spawn(move || runtime.block_on(worker.run(stopped)))
            .map_err(TelemetryError::Runtime)?;
        Ok(Exporter {
            queue,
            accepting,
            stop: parking_lot::Mutex::new(Some(stop)),
        })
    }

    /// Whether a sampled span is worth recording now (false while the export backs off).
    pub fn accepting(&self) -> bool {
        self.accepting.load(Ordering::Relaxed)
    }

    pub fn queue(&self) -> Arc<Queue> {
        Arc::clone(&self.queue)
    }

    /// Counts sampled spans that will not be exported.
    pub fn dropped(&self, spans: u64) {
        self.queue.dropped.inc_by(spans);
    }

    /// Sends what is queued (one try, within `timeout`) and stops the export thread.
    pub fn shutdown(&self, timeout: Duration) {
        let Some(stop) = self.stop.lock().take() else {
            return;
        };
        let (done, finished) = std::sync::mpsc::sync_channel(1);
        let stop_message = Stop {
            deadline: Instant::now() + timeout,
            done,
        };
        if stop.send(stop_message).is_ok() {
            let _ = finished.recv_timeout(timeout + Duration::from_millis(100));
        }
    }
}

/// The export thread's side.
struct Worker {
    queue: Arc<Queue>,
    accepting: Arc<AtomicBool>,
    encoder: Encoder,
    /// The encoder's scratch space for a batch, while the transport does not hold it.
    scratch: Arc<parking_lot::Mutex<Option<Vec<u8>>>>,
    transport: Transport,
    config: Config,
    backoff: Duration,
    /// Backing off until then (recording off).
    resume_at: Option<tokio::time::Instant>,
}

impl Worker {
    async fn run(mut self, mut stop: tokio::sync::oneshot::Receiver<Stop>) {
        let mut batch = Vec::with_capacity(self.config.batch_size);
        loop {
            let wake_at = self
                .resume_at
                .unwrap_or_else(|| tokio::time::Instant::now() + self.config.schedule_delay);
            tokio::select! {
                stopping = &mut stop => {
                    if let Ok(stopping) = stopping {
                        self.flush(stopping.deadline, &mut batch).await;
                        let _ = stopping.done.send(());
                    }
                    return;
                }
                () = self.queue.wake.notified() => {}
                () = tokio::time::sleep_until(wake_at) => {}
            }
            if let Some(resume_at) = self.resume_at {
                if tokio::time::Instant::now() >= resume_at {
                    self.probe().await;
                }
            }
            loop {
                let (spans, left) = self.queue.take(&mut batch);
                if batch.is_empty() {
                    break;
                }
                self.export(&mut batch, spans, self.config.timeout).await;
                if left < self.config.batch_size {
                    break;
                }
            }
        }
    }

    /// Sends one batch of `spans` spans (or drops it while backing off); `batch` is left empty.
    async fn export(&mut self, batch: &mut Vec<Box<Finished>>, spans: usize, timeout: Duration) {
        let spans = spans as u64;
        if self.resume_at.is_some() {
            self.queue.dropped.inc_by(spans);
            batch.clear();
            return;
        }
        // The last batch's body comes back when the transport drops it (after sending it);
        // one it still holds is left to it.
        let mut scratch = self.scratch.lock().take().unwrap_or_default();
        let range = self
            .encoder
            .encode_range(batch.iter().map(|f| &**f), &mut scratch);
        let body = Bytes::from_owner(Lent {
            buf: scratch,
            range,
            home: Arc::clone(&self.scratch),
        });
        self.queue.recycle(batch);
        let sent = tokio::time::timeout(timeout, self.transport.send(body))
            .await
            .unwrap_or_else(|_| Err(ExportError::NoAnswer(timeout)));
        match sent {
            Ok(()) => self.backoff = FIRST_BACKOFF,
            Err(e) => {
                self.queue.dropped.inc_by(spans);
                self.back_off(&e);
            }
        }
    }

    fn back_off(&mut self, error: &ExportError) {
        // The collector's and the transport's words: never the export headers.
        if self.backoff == FIRST_BACKOFF {
            tracing::warn!(
                "traces: export failed, spans dropped; recording pauses {} s: {error}",
                self.backoff.as_secs()
            );
        } else {
            tracing::debug!(
                "traces: export still failing; recording pauses {} s: {error}",
                self.backoff.as_secs()
            );
        }
        self.accepting.store(false, Ordering::Relaxed);
        self.resume_at = Some(tokio::time::Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    /// The back-off is over: recording resumes when the collector takes connections again.
    async fn probe(&mut self) {
        match tokio::time::timeout(self.config.timeout, self.transport.reachable()).await {
            Ok(Ok(())) => {
                self.resume_at = None;
                self.accepting.store(true, Ordering::Relaxed);
            }
            Ok(Err(e)) => self.back_off(&e),
            Err(_) => self.back_off(&ExportError::ConnectTimeout),
        }
    }

    /// At shutdown: what is queued, in batches, until `deadline`.
    async fn flush(&mut self, deadline: Instant, batch: &mut Vec<Box<Finished>>) {
        loop {
            let (spans, _) = self.queue.take(batch);
            if batch.is_empty() {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.queue.dropped.inc_by(spans as u64);
                batch.clear();
                continue;
            }
            self.export(batch, spans, left.min(self.config.timeout))
                .await;
        }
    }
}

/// An encoded batch lent to the transport as its body, without a copy: the scratch space it
/// was written in goes back to the worker when the transport drops it.
struct Lent {
    buf: Vec<u8>,
    range: std::ops::Range<usize>,
    home: Arc<parking_lot::Mutex<Option<Vec<u8>>>>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        *self.home.lock() = Some(std::mem::take(&mut self.buf));
    }
}

/// How a batch reaches the collector.
enum Transport {
    Grpc(Grpc),
    Http(Http),
}

impl Transport {
    fn new(config: &Config) -> Result<Transport, TelemetryError> {
        let host = crate::request::authority::unbracket(config.endpoint.host().unwrap_or_default())
            .to_string();
        let https = config.endpoint.scheme_str() == Some("https");
        let port = config
            .endpoint
            .port_u16()
            .unwrap_or(if https { 443 } else { 80 });
        Ok(match config.protocol {
            Protocol::Grpc => {
                let endpoint = tonic::transport::Endpoint::from(config.endpoint.clone())
                    .connect_timeout(config.timeout)
                    .timeout(config.timeout);
                Transport::Grpc(Grpc {
                    channel: endpoint.connect_lazy(),
                    metadata: tonic::metadata::MetadataMap::from_headers(config.headers.clone()),
                    timeout: config.timeout,
                    host,
                    port,
                })
            }
            Protocol::HttpProtobuf => Transport::Http(Http {
                target: config
                    .endpoint
                    .path_and_query()
                    .map_or_else(|| "/".to_string(), |p| p.as_str().to_string()),
                authority: config
                    .endpoint
                    .authority()
                    .map(|a| {
                        a.as_str()
                            .rsplit('@')
                            .next()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .unwrap_or_default(),
                tls: https
                    .then(crate::config::tls_client::with_system_roots)
                    .transpose()
                    .map_err(|e| TelemetryError::Exporter(format!("TLS: {e}")))?,
                headers: config.headers.clone(),
                host,
                port,
                sender: None,
            }),
        })
    }

    async fn send(&mut self, body: Bytes) -> Result<(), ExportError> {
        match self {
            Transport::Grpc(grpc) => grpc.send(body).await,
            Transport::Http(http) => http.send(body).await,
        }
    }

    /// Whether the collector takes a TCP connection.
    async fn reachable(&self) -> Result<(), ExportError> {
        let (host, port) = match self {
            Transport::Grpc(g) => (g.host.as_str(), g.port),
            Transport::Http(h) => (h.host.as_str(), h.port),
        };
        tokio::net::TcpStream::connect((host, port))
            .await
            .map(drop)
            .map_err(ExportError::Connect)
    }
}

/// Why an export, or the probe after a back-off, failed: the collector's and the transport's
/// words (never the export headers).
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error("connecting: {0}")]
    Connect(std::io::Error),
    #[error("connecting timed out")]
    ConnectTimeout,
    #[error("no answer within {} ms", .0.as_millis())]
    NoAnswer(Duration),
    #[error("server name: {0}")]
    ServerName(rustls::pki_types::InvalidDnsNameError),
    #[error("TLS: {0}")]
    Tls(std::io::Error),
    #[error("HTTP: {0}")]
    Http(hyper::Error),
    #[error("request: {0}")]
    Request(http::Error),
    #[error("reading the answer: {0}")]
    Answer(Box<dyn std::error::Error + Send + Sync>),
    #[error("the collector answered {0}")]
    Status(http::StatusCode),
    #[error("gRPC: {0}")]
    GrpcChannel(tonic::transport::Error),
    #[error("gRPC {:?}: {}", .0.code(), .0.message())]
    Grpc(Box<tonic::Status>),
}

/// OTLP over gRPC: `TraceService/Export` on a channel that reconnects by itself.
struct Grpc {
    channel: tonic::transport::Channel,
    metadata: tonic::metadata::MetadataMap,
    timeout: Duration,
    host: String,
    port: u16,
}

impl Grpc {
    async fn send(&mut self, body: Bytes) -> Result<(), ExportError> {
        let mut client = tonic::client::Grpc::new(self.channel.clone());
        client.ready().await.map_err(ExportError::GrpcChannel)?;
        let mut request = tonic::Request::new(body);
        *request.metadata_mut() = self.metadata.clone();
        request.set_timeout(self.timeout);
        client
            .unary::<Bytes, (), _>(
                request,
                http::uri::PathAndQuery::from_static(GRPC_EXPORT),
                PassThrough,
            )
            .await
            .map(drop)
            .map_err(|status| ExportError::Grpc(Box::new(status)))
    }
}

/// A codec for bytes already encoded (the request) and an answer that is not read (the
/// `ExportTraceServiceResponse`: its partial-success counts are not acted on).
#[derive(Clone, Copy)]
struct PassThrough;

impl tonic::codec::Codec for PassThrough {
    type Encode = Bytes;
    type Decode = ();
    type Encoder = PassThrough;
    type Decoder = PassThrough;

    fn encoder(&mut self) -> PassThrough {
        PassThrough
    }

    fn decoder(&mut self) -> PassThrough {
        PassThrough
    }
}

impl tonic::codec::Encoder for PassThrough {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put(dst, item);
        Ok(())
    }
}

impl tonic::codec::Decoder for PassThrough {
    type Item = ();
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<()>, tonic::Status> {
        let remaining = bytes::Buf::remaining(src);
        bytes::Buf::advance(src, remaining);
        Ok(Some(()))
    }
}

/// OTLP over HTTP/protobuf: `POST` with `Content-Type: application/x-protobuf` on one kept
/// HTTP/1.1 connection (made again after an error).
struct Http {
    target: String,
    authority: String,
    tls: Option<tokio_rustls::TlsConnector>,
    headers: http::HeaderMap,
    host: String,
    port: u16,
    sender: Option<hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>>,
}

trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Stream for T {}

impl Http {
    async fn connect(
        &self,
    ) -> Result<hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>, ExportError>
    {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(ExportError::Connect)?;
        let _ = tcp.set_nodelay(true);
        let stream: Box<dyn Stream> = match &self.tls {
            None => Box::new(tcp),
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(ExportError::ServerName)?;
                Box::new(tls.connect(name, tcp).await.map_err(ExportError::Tls)?)
            }
        };
        let (sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(ExportError::Http)?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    async fn send(&mut self, body: Bytes) -> Result<(), ExportError> {
        use http_body_util::BodyExt as _;
        let mut sender = match self.sender.take() {
            Some(sender) if !sender.is_closed() => sender,
            _ => self.connect().await?,
        };
        sender.ready().await.map_err(ExportError::Http)?;
        let mut request = http::Request::post(self.target.as_str())
            .header(http::header::HOST, self.authority.as_str())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .header(
                http::header::USER_AGENT,
                concat!("tollgate/", env!("CARGO_PKG_VERSION")),
            )
            .body(http_body_util::Full::new(body))
            .map_err(ExportError::Request)?;
        for (name, value) in &self.headers {
            request.headers_mut().insert(name, value.clone());
        }
        let response = sender
            .send_request(request)
            .await
            .map_err(ExportError::Http)?;
        let status = response.status();
        // Read to its end (at most 64 KiB), so the connection can carry the next export.
        http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await
            .map_err(ExportError::Answer)?;
        if !status.is_success() {
            return Err(ExportError::Status(status));
        }
        self.sender = Some(sender);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::traces::span::Kind;

    fn queue(capacity: usize, batch_size: usize) -> Queue {
        Queue {
            waiting: parking_lot::Mutex::new(Waiting::default()),
            capacity,
            batch_size,
            wake: tokio::sync::Notify::new(),
            spare: parking_lot::Mutex::new(Vec::new()),
            dropped: prometheus::IntCounter::new("dropped", "dropped").unwrap(),
        }
    }

    fn server(span_id: u8) -> SpanRecord {
        SpanRecord::new(Kind::Server, "GET", [1; 16], [span_id; 8], [0; 8], None)
    }

    #[test]
    fn exported_boxes_are_reused_cleared_and_only_up_to_a_batch_of_them() {
        let queue = queue(16, 2);
        let mut boxes = Vec::new();
        for span_id in 1..=3 {
            let mut finished = queue.record(server(span_id));
            finished.server.url_path = finished.put("/v1/orders");
            finished.client = Some(server(9));
            queue.push(finished);
        }
        // Requests of two spans each: a batch of two spans holds one of them.
        let mut batch = Vec::new();
        for left in [4, 2, 0] {
            assert_eq!(queue.take(&mut batch), (2, left));
            boxes.push(std::ptr::from_ref::<Finished>(&*batch[0]));
            queue.recycle(&mut batch);
            assert!(batch.is_empty());
        }
        // Three exported, two kept (the batch size), the newest last: taken first.
        assert_eq!(queue.spare.lock().len(), 2);
        let reused = queue.record(server(4));
        assert_eq!(std::ptr::from_ref::<Finished>(&*reused), boxes[1]);
        assert_eq!((reused.spans(), reused.text.as_str()), (1, ""));
        let second = queue.record(server(5));
        assert_eq!(std::ptr::from_ref::<Finished>(&*second), boxes[0]);
        // None left: the next request gets a new box.
        assert!(queue.spare.lock().is_empty());
    }

    #[test]
    fn header_values_are_url_decoded_and_bad_pairs_skipped() {
        let mut map = http::HeaderMap::new();
        headers(
            Some("authorization=Basic%20abc%3D, x-scope-orgid = edge ,novalue,bad name=1".into()),
            &mut map,
        );
        assert_eq!(map.len(), 2);
        assert_eq!(map["authorization"], "Basic abc=");
        assert_eq!(map["x-scope-orgid"], "edge");
        assert_eq!(percent_decoded("100%"), "100%");
        assert_eq!(percent_decoded("%zz%41"), "%zzA");
    }

    #[test]
    fn the_resource_names_the_service_once() {
        let var = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let named = resource(&var(&[
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "service.name=a, deployment.environment = prod",
            ),
            ("OTEL_SERVICE_NAME", "b"),
        ]));
        assert_eq!(named[0], ("service.name".to_string(), "b".to_string()));
        assert!(named.contains(&("deployment.environment".to_string(), "prod".to_string())));
        assert_eq!(named.iter().filter(|(k, _)| k == "service.name").count(), 1);
        let default = resource(&var(&[]));
        assert_eq!(
            default[0],
            ("service.name".to_string(), "tollgate".to_string())
        );
    }

    fn settings(protocol: Protocol) -> EnvSettings {
        EnvSettings {
            protocol,
            max_queue_size: 100,
            default_service_name: true,
        }
    }

    #[test]
    fn endpoints_batches_and_timeouts_come_from_the_standard_variables() {
        let env = |pairs: Vec<(&'static str, &'static str)>| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let http = Config::read(
            &settings(Protocol::HttpProtobuf),
            env(vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
                ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1000"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000"),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ]),
        )
        .unwrap();
        assert_eq!(http.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(http.batch_size, 100);
        assert_eq!(http.timeout, Duration::from_millis(2000));
        assert_eq!(http.schedule_delay, Duration::from_millis(100));
        let grpc = Config::read(
            &settings(Protocol::Grpc),
            env(vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
                ("OTEL_BSP_EXPORT_TIMEOUT", "500"),
            ]),
        )
        .unwrap();
        assert_eq!(grpc.endpoint, "http://traces:4317/");
        assert_eq!(grpc.timeout, Duration::from_millis(500));
        assert_eq!(grpc.batch_size, 100);
        let secret = Config::read(
            &settings(Protocol::Grpc),
            env(vec![(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "ftp://u:s3cret@collector",
            )]),
        )
        .unwrap_err()
        .to_string();
        assert!(!secret.contains("s3cret"), "{secret}");
        let grpc_tls = Config::read(
            &settings(Protocol::Grpc),
            env(vec![(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "https://collector:4317",
            )]),
        )
        .unwrap_err()
        .to_string();
        assert!(grpc_tls.contains("built without TLS"), "{grpc_tls}");
        assert!(Config::read(
            &settings(Protocol::Grpc),
            env(vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
                ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ]),
        )
        .is_err());
    }
}
