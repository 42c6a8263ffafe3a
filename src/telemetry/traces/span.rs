//! A finished span as tollgate keeps it until export: one field per attribute the gateway's
//! spans can carry (a span is one of a few known shapes), strings only where the value is the
//! request's own, addresses kept as addresses and written out as text by the encoder on the
//! export thread. The upstream call's events are a small inline list.

use smallvec::SmallVec;
use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// Now, in nanoseconds since the Unix epoch (a span's start and end, as OTLP has them).
pub(super) fn unix_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The span kinds the gateway makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Server,
    Client,
}

/// An event on the upstream call's CLIENT span; each carries the server tried
/// (`server.address`, `server.port`) and the attempt's number (`tollgate.attempt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamEvent {
    /// A connection to the server is ready (`tollgate.connection_reused`: one from the pool).
    Connect {
        server: SocketAddr,
        attempt: usize,
        reused: bool,
    },
    /// A connection attempt failed (`tollgate.connect_failure`: `refused`, `timeout`...).
    ConnectFailed {
        server: SocketAddr,
        attempt: usize,
        failure: &'static str,
    },
    /// The request goes to the next server after a failed connection.
    Retry { server: SocketAddr, attempt: usize },
    /// The server was taken out of rotation after consecutive failures.
    Ejection { server: SocketAddr, attempt: usize },
}

impl UpstreamEvent {
    pub fn name(&self) -> &'static str {
        match self {
            UpstreamEvent::Connect { .. } => "connect",
            UpstreamEvent::ConnectFailed { .. } => "connect_failed",
            UpstreamEvent::Retry { .. } => "retry",
            UpstreamEvent::Ejection { .. } => "ejection",
        }
    }

    pub fn server(&self) -> (SocketAddr, usize) {
        match *self {
            UpstreamEvent::Connect {
                server, attempt, ..
            }
            | UpstreamEvent::ConnectFailed {
                server, attempt, ..
            }
            | UpstreamEvent::Retry { server, attempt }
            | UpstreamEvent::Ejection { server, attempt } => (server, attempt),
        }
    }
}

/// One span, recorded.
#[derive(Debug, Clone)]
pub struct SpanRecord {
    pub kind: Kind,
    /// The span's name; with `name_has_route`, followed by a space and `route`.
    pub name: &'static str,
    pub name_has_route: bool,
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// All zero: a root span.
    pub parent_span_id: [u8; 8],
    pub trace_state: Option<Arc<str>>,
    /// Unix nanoseconds.
    pub start: u64,
    pub end: u64,
    /// Status error, with its description (empty: none); `None`: status unset.
    pub error: Option<String>,
    /// `http.request.method`
    pub method: Option<&'static str>,
    /// `url.path`
    pub url_path: Option<String>,
    /// `http.route`
    pub route: Option<Cow<'static, str>>,
    /// `server.address` of a SERVER span (the `Host`)
    pub server_address: Option<String>,
    /// `network.protocol.version`
    pub protocol_version: Option<&'static str>,
    /// `client.address`
    pub client_address: Option<IpAddr>,
    /// `rpc.system` (`grpc`), `rpc.service`, `rpc.method`
    pub rpc: Option<(&'static str, &'static str)>,
    /// `rpc.grpc.status_code`
    pub grpc_status: Option<i32>,
    /// `http.response.status_code`
    pub status_code: Option<u16>,
    /// `tollgate.decision`, `.policy`, `.rule`, `.reason`, `.remaining`
    pub decision: Option<&'static str>,
    pub policy: Option<String>,
    pub rule: Option<String>,
    pub reason: Option<&'static str>,
    pub remaining: Option<i64>,
    /// A CLIENT span's `tollgate.upstream_group`
    pub upstream_group: Option<Arc<str>>,
    /// A CLIENT span's `server.address` and `server.port` (the server first chosen)
    pub upstream: Option<SocketAddr>,
    /// A CLIENT span's events, with their Unix-nanosecond times: one inline (the connect of a
    /// request that needed no retry), so that a record stays under 512 bytes and a request's
    /// two fit the allocator's small-object size classes (at most 1 KiB).
    pub events: SmallVec<[(u64, UpstreamEvent); 1]>,
}

impl SpanRecord {
    /// A span starting now.
    pub fn new(
        kind: Kind,
        name: &'static str,
        trace_id: [u8; 16],
        span_id: [u8; 8],
        parent_span_id: [u8; 8],
        trace_state: Option<Arc<str>>,
    ) -> SpanRecord {
        SpanRecord {
            kind,
            name,
            name_has_route: false,
            trace_id,
            span_id,
            parent_span_id,
            trace_state,
            start: unix_nanos(),
            end: 0,
            error: None,
            method: None,
            url_path: None,
            route: None,
            server_address: None,
            protocol_version: None,
            client_address: None,
            rpc: None,
            grpc_status: None,
            status_code: None,
            decision: None,
            policy: None,
            rule: None,
            reason: None,
            remaining: None,
            upstream_group: None,
            upstream: None,
            events: SmallVec::new(),
        }
    }
}

/// A request's records as they travel to the export, in the one allocation made when the
/// request was sampled: its SERVER span and, when it went upstream, its CLIENT span. The queue
/// and the encoder move the box, never the records (each is several hundred bytes).
#[derive(Debug, Clone)]
pub struct Finished {
    pub server: SpanRecord,
    pub client: Option<SpanRecord>,
}

impl Finished {
    /// How many spans it holds (the queue's and a batch's sizes count spans).
    pub fn spans(&self) -> usize {
        1 + usize::from(self.client.is_some())
    }

    /// Its spans in the order they ended: the CLIENT span before its SERVER span.
    pub fn in_order(&self) -> impl Iterator<Item = &SpanRecord> + Clone {
        self.client.iter().chain(std::iter::once(&self.server))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_request_s_records_fit_one_small_allocation() {
        assert!(std::mem::size_of::<super::SpanRecord>() <= 512);
        assert!(std::mem::size_of::<super::Finished>() <= 1024);
    }
}
