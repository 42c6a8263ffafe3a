//! A finished span as tollgate keeps it until export: one field per attribute the gateway's
//! spans can carry (a span is one of a few known shapes), addresses kept as addresses and
//! written out as text by the encoder on the export thread. The request's own text (its path,
//! host, route, the rule's names, an error) sits in one buffer beside the records, which point
//! into it: a box of records the export hands back is reused by a later request with no
//! allocation. The upstream call's events are a small inline list.

use smallvec::SmallVec;
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
    pub error: Option<TextAt>,
    /// `http.request.method`
    pub method: Option<&'static str>,
    /// `url.path`
    pub url_path: Option<TextAt>,
    /// `http.route`
    pub route: Option<TextAt>,
    /// `server.address` of a SERVER span (the `Host`)
    pub server_address: Option<TextAt>,
    /// `network.protocol.version`
    pub protocol_version: Option<&'static str>,
    /// `client.address`
    pub client_address: Option<IpAddr>,
    /// `rpc.system` (`grpc`), `rpc.service`, `rpc.method`
    pub rpc: Option<(&'static str, &'static str)>,
    /// `rpc.grpc.status_code`
    pub grpc_status: Option<i32>,
    /// `rpc.system` (`grpc`), `rpc.service`, `rpc.method` of a gRPC call proxied (its names
    /// come from the request).
    pub proxied_rpc: Option<(TextAt, TextAt)>,
    /// `http.response.status_code`
    pub status_code: Option<u16>,
    /// `tollgate.decision`, `.policy`, `.rule`, `.reason`, `.remaining`
    pub decision: Option<&'static str>,
    pub policy: Option<TextAt>,
    pub rule: Option<TextAt>,
    pub reason: Option<&'static str>,
    pub remaining: Option<i64>,
    /// `tollgate.paced_wait_ms`: how long a paced request waited for its turn.
    pub paced_wait_ms: Option<i64>,
    /// A CLIENT span's `tollgate.upstream_group`
    pub upstream_group: Option<Arc<str>>,
    /// A CLIENT span's `server.address` and `server.port` (the server first chosen)
    pub upstream: Option<SocketAddr>,
    /// A CLIENT span's events, with their Unix-nanosecond times: one inline (the connect of a
    /// request that needed no retry), so that a record stays small.
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
            proxied_rpc: None,
            status_code: None,
            decision: None,
            policy: None,
            rule: None,
            reason: None,
            remaining: None,
            paced_wait_ms: None,
            upstream_group: None,
            upstream: None,
            events: SmallVec::new(),
        }
    }
}

/// Where a piece of a request's own text sits in its records' buffer ([`Finished::text`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextAt {
    start: u32,
    len: u32,
}

impl TextAt {
    pub fn len(self) -> usize {
        self.len as usize
    }

    /// The text, read from `text` (the buffer it was put in).
    pub fn of(self, text: &str) -> &str {
        let start = self.start as usize;
        text.get(start..start + self.len as usize)
            .unwrap_or_default()
    }
}

/// A request's text buffer keeps its room for the next request up to this size (a longer path
/// or error is rare: its buffer is let go).
const TEXT_KEPT: usize = 1024;

/// A request's records as they travel to the export, in one box: its SERVER span, its CLIENT
/// span when it went upstream, and the text they point into. The queue and the encoder move
/// the box, never the records; the export hands the box back to be reused ([`Finished::clear`]).
#[derive(Debug, Clone)]
pub struct Finished {
    pub server: SpanRecord,
    pub client: Option<SpanRecord>,
    /// The request's own text the records' [`TextAt`]s point into.
    pub text: String,
}

impl Finished {
    pub fn new(server: SpanRecord) -> Finished {
        Finished {
            server,
            client: None,
            text: String::new(),
        }
    }

    /// Appends `value` to the text; where it went (`None` past 4 GiB of text: the attribute is
    /// left out).
    pub fn put(&mut self, value: &str) -> Option<TextAt> {
        let start = u32::try_from(self.text.len()).ok()?;
        let len = u32::try_from(value.len()).ok()?;
        start.checked_add(len)?;
        self.text.push_str(value);
        Some(TextAt { start, len })
    }

    /// How many spans it holds (the queue's and a batch's sizes count spans).
    pub fn spans(&self) -> usize {
        1 + usize::from(self.client.is_some())
    }

    /// Its spans in the order they ended: the CLIENT span before its SERVER span.
    pub fn in_order(&self) -> impl Iterator<Item = &SpanRecord> + Clone {
        self.client.iter().chain(std::iter::once(&self.server))
    }

    /// Ready to be reused: no CLIENT span, no text (the buffer's room kept up to
    /// [`TEXT_KEPT`]), and nothing shared still held.
    pub fn clear(&mut self) {
        self.client = None;
        self.server.trace_state = None;
        self.server.upstream_group = None;
        if self.text.capacity() > TEXT_KEPT {
            self.text = String::new();
        } else {
            self.text.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_put_and_read_back_and_a_cleared_box_keeps_a_small_buffer() {
        let mut finished = Finished::new(SpanRecord::new(
            Kind::Server,
            "GET",
            [1; 16],
            [2; 8],
            [0; 8],
            Some(Arc::from("a=1")),
        ));
        let path = finished.put("/v1/orders");
        let empty = finished.put("");
        let host = finished.put("api.example.com");
        assert_eq!(path.map(|t| t.of(&finished.text)), Some("/v1/orders"));
        assert_eq!(
            empty.map(|t| (t.of(&finished.text), t.len())),
            Some(("", 0))
        );
        assert_eq!(host.map(|t| t.of(&finished.text)), Some("api.example.com"));
        let room = finished.text.capacity();
        finished.client = Some(finished.server.clone());
        finished.clear();
        assert_eq!(
            (finished.text.as_str(), finished.text.capacity()),
            ("", room)
        );
        assert_eq!(
            (finished.spans(), finished.server.trace_state.clone()),
            (1, None)
        );
        finished.put(&"p".repeat(TEXT_KEPT + 1));
        finished.clear();
        assert_eq!(finished.text.capacity(), 0);
        // A kept box, its text buffer included, stays under the 2 KiB the manual promises.
        assert!(std::mem::size_of::<Finished>() + TEXT_KEPT < 2048);
    }
}
