//! What the environment asks of tracing: the standard `OTEL_*` variables this gateway reads
//! at start (protocol, queue size, service name), `--trace-context`'s trust in callers'
//! context, and the errors a setting that cannot be used is reported with (an endpoint quoted
//! in one has its password masked).

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
    /// resource says `tollgate`.
    pub default_service_name: bool,
}

/// The export queue when `OTEL_BSP_MAX_QUEUE_SIZE` is unset (the specification's).
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

/// The exporter's error as it may be shown: an endpoint it quotes (an invalid URL is quoted
/// whole) with any password in it masked, as every store URL is (`var`: the environment).
pub(super) fn without_endpoints(message: &str, var: impl Fn(&str) -> Option<String>) -> String {
    let mut message = message.to_string();
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ] {
        if let Some(endpoint) = var(name).filter(|e| !e.is_empty()) {
            message = message.replace(&endpoint, &crate::telemetry::redact::url(&endpoint));
        }
    }
    message
}
