//! The reverse proxy: `request_filter` builds [`RequestFacts`] and asks the gateway; a refusal is
//! answered here and never reaches the upstream; an allowed request is proxied round-robin and
//! the rate-limit headers are added to the upstream's response.

use super::grpc_call::{Gate, GrpcCall};
use super::own_response::X_REQUEST_ID;
use super::upstreams::{Group, Upstreams};
use crate::engine::headers::{HeaderLines, HeaderList};
use crate::engine::Reason;
use crate::request::descriptor::RequestFacts;
use crate::service::{Answer, Gateway, HttpHeaders};
use crate::telemetry::access_log::{self, AccessLogFormat, AccessRecord};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::modules::http::HttpModules;
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::{Error, Result};
use std::net::IpAddr;
use std::ops::ControlFlow;
use std::sync::Arc;

/// Every server of the request's upstream group is down (or ejected): a 502 with a clear body,
/// at once.
const NO_HEALTHY_UPSTREAM: pingora::ErrorType = pingora::ErrorType::Custom("no healthy upstream");

/// A streamed completion passed its rule's `streaming` cap: the proxying ends here (dropping the
/// upstream connection, so the model stops generating) and `fail_to_proxy` ends the response
/// to the client with the closing events. An outcome, not a failure: never logged as an error.
const STREAM_STOPPED: pingora::ErrorType =
    pingora::ErrorType::Custom("stream stopped past max_completion_tokens");

/// The chosen server stayed at its `max_connections` for the group's whole queue timeout: a 503
/// with `Retry-After`. An outcome counted in the metrics, not logged per request.
const QUEUE_TIMED_OUT: pingora::ErrorType =
    pingora::ErrorType::Custom("upstream server queue timed out");

/// The client went away while its request waited in a server's queue: nothing was sent
/// upstream and nobody is left to answer. Counted, not logged per request.
const CLIENT_GONE_WHILE_QUEUED: pingora::ErrorType =
    pingora::ErrorType::Custom("client went away while queued");

/// The client went away while its request waited for its turn under a `delay` rule: its tokens
/// were given back, nothing was sent upstream. Counted, not logged per request.
const CLIENT_GONE_WHILE_PACED: pingora::ErrorType =
    pingora::ErrorType::Custom("client went away while paced");

/// How often a waiting HTTP/1 request looks whether its client closed the connection (an
/// HTTP/2 stream's reset wakes its waiter at once).
const CLIENT_GONE_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// How often a request waiting for its turn under a `delay` rule looks whether its HTTP/1
/// client closed the connection: less often than a queued request, since up to
/// `--max-delayed-requests` (10 000) may wait at once (each look is a wake-up and a syscall);
/// a leaver's token comes back within this.
pub(super) const PACED_GONE_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// Resolves once the client of `session` has gone: its HTTP/2 stream was reset or closed, or
/// its HTTP/1 connection reads end-of-file or an error (as nginx's broken-connection check
/// does). Pending for as long as the client is there.
async fn client_gone(session: &mut Session) {
    client_gone_within(session, CLIENT_GONE_POLL).await;
}

/// [`client_gone`], an HTTP/1 connection looked at every `poll`.
async fn client_gone_within(session: &mut Session, poll: std::time::Duration) {
    let downstream = session.as_downstream_mut();
    if let Some(idle) = downstream.watch_h2_stream_close() {
        let _ = idle.await;
        return;
    }
    let fd = downstream
        .stream()
        .map(|s| pingora::protocols::UniqueID::id(s.as_ref()));
    match fd {
        Some(fd) if fd > 0 => super::conn::gone(fd, poll).await,
        _ => std::future::pending().await,
    }
}

/// The client's chunked request body is malformed (a bad chunk size, a chunk not ended by
/// CRLF, a bad end of trailers): Pingora's `InvalidChunk`/`InvalidTrailerEnd` (defined in its
/// crate-private `protocols::http::v1::body`). Answered 400, as nginx does, when no response
/// has started.
const INVALID_CHUNK: pingora::ErrorType = pingora::ErrorType::Custom("InvalidChunk");
const INVALID_TRAILER_END: pingora::ErrorType = pingora::ErrorType::Custom("InvalidTrailerEnd");

/// A gRPC call's request message was refused (`grpc:message` rules): nothing more of the call
/// goes upstream, and `fail_to_proxy` ends it with `RESOURCE_EXHAUSTED` in its trailers. An
/// outcome, not a failure: never logged as an error.
const GRPC_CALL_CUT: pingora::ErrorType =
    pingora::ErrorType::Custom("gRPC call cut at a refused request message");

/// Per-request state.
#[derive(Default)]
pub struct RequestCtx {
    /// Headers to add to the upstream's response (or to the gateway's own refusal, until it
    /// is written).
    add_headers: HeaderList,
    /// An admitted request's decision headers as HTTP/1 lines (an HTTP/1 client): written
    /// after the upstream's headers as they are, without a header map's work.
    add_lines: Option<HeaderLines>,
    /// The TCP peer, appended to `X-Forwarded-For` towards the upstream.
    peer: Option<IpAddr>,
    /// What the access-log line needs (only with `--access-log`: no cost otherwise).
    access: Option<Box<AccessCtx>>,
    /// The upstream group the request was routed to, and the server chosen in it.
    group: Option<Arc<Group>>,
    server: Option<std::net::SocketAddr>,
    /// Connection attempts so far (a refused connection is retried on another server).
    connect_tries: usize,
    /// The client address as resolved for limiting (the `client_hash` balancing key).
    client_ip: Option<IpAddr>,
    /// Concurrency slots held until the response is done (given back in `logging`, which runs
    /// once per request whatever happened: sent, client gone, upstream failed or timed out).
    lease: Option<crate::store::lease::Lease>,
    /// A request body larger than Pingora's 64 KiB retry buffer, read whole before deciding:
    /// Pingora replays only its last piece, and `request_body_filter` sends this instead.
    forward_body: Option<Bytes>,
    /// `forward_body` is the body with its `model` rewritten (an `llm_spend` fallback): its
    /// length replaces the client's `Content-Length`.
    model_rewritten: bool,
    /// An LLM reservation and the meter reading its response's usage (settled in `logging`).
    metering: Option<Box<Metering>>,
    /// What rules reading the response are owed (`count_when`, a response-priced cost):
    /// settled in `response_filter` from the upstream's status and headers, before the client
    /// has the response; in `logging` from what was written, when no upstream answered.
    charges: Option<Box<crate::engine::charges::ResponseCharges>>,
    /// The slot held at a server of a group with `max_connections` (given back in `logging`,
    /// or when a retry moves to another server).
    slot: Option<super::queue::Slot>,
    /// Forwarding headers and the route's header rules.
    forwarding: super::forward::Forwarding,
    /// The request's spans, when traces are on (ended in `logging`).
    trace: Option<Box<crate::telemetry::traces::RequestSpan>>,
    /// The gRPC call the request is, if it is one.
    grpc: Option<Box<GrpcCall>>,
    /// A request paced by a `delay` rule: its place in line until its turn comes (boxed: a
    /// rare field should not widen what every request builds and Pingora moves).
    pace: Option<Box<crate::service::Pace>>,
}

/// A `token_bucket_llm` reservation waiting for its response's usage.
struct Metering {
    reservation: crate::engine::Reservation,
    /// Made when the response header arrives.
    meter: Option<crate::request::llm_encoding::BodyMeter>,
    status: u16,
    /// The request went to the upstream (the model may have read the prompt).
    sent: bool,
    /// A successful streamed response its rules may stop (`streaming`).
    stop: Option<Box<StreamStop>>,
}

/// What stopping a stream needs. Pingora hands the client's side its response in batches and
/// drops a batch whose filter fails, so the bytes given to Pingora but not yet written to the
/// client are kept until written (`body_bytes_sent` says how far it got), with the response
/// header: stopping writes whatever of them the client has not had, then the closing events.
struct StreamStop {
    cap: crate::request::llm::StreamCap,
    /// The response header as sent (after `response_filter`). From an `http1` group it is
    /// already in the form Pingora writes; from an `h2`/`h2c` group (untested with stream
    /// caps) it would first need Pingora's HTTP/1.1 conversion.
    header: Option<ResponseHeader>,
    /// Body pieces passed on, oldest first, from body byte `unsent_from` on, not yet known
    /// to be written to the client.
    unsent: std::collections::VecDeque<Bytes>,
    unsent_from: usize,
    /// Set when the stream is stopped: the rest of the response to write.
    tail: Option<Bytes>,
}

impl StreamStop {
    /// Forgets the pieces the client has been sent (`sent` body bytes).
    fn written(&mut self, sent: usize) {
        while let Some(front) = self.unsent.front_mut() {
            let end = self.unsent_from + front.len();
            if end <= sent {
                self.unsent_from = end;
                self.unsent.pop_front();
            } else {
                if sent > self.unsent_from {
                    *front = front.slice(sent - self.unsent_from..);
                    self.unsent_from = sent;
                }
                break;
            }
        }
    }
}

impl Metering {
    /// The tokens to settle on, the prompt tokens the upstream reported, and how they were
    /// known: the response's `usage`; else, once the request went to the upstream, the prompt
    /// estimate plus the completion text seen — a stream cut short by the client or the
    /// upstream, or stopped here, is charged what it streamed, and a request that got no
    /// answer at all (timed out, reset, client gone first) its prompt, which the model read;
    /// nothing (all refunded) for an error status or a request that never left.
    fn used(&self) -> (u64, Option<u64>, &'static str) {
        let prompt = self.reservation.prompt_tokens();
        match &self.meter {
            // A 2xx body that could not be decoded: what it used is unknown, so the reservation
            // stays charged as reserved (never the prompt alone).
            Some(body) if !body.readable() && (200..300).contains(&self.status) => {
                (self.reservation.tokens(), None, "undecodable")
            }
            Some(body) => match body.meter().usage() {
                Some(usage) => (usage.total_tokens, Some(usage.prompt_tokens), "usage"),
                None if (200..300).contains(&self.status) => {
                    let meter = body.meter();
                    let source = if meter.stopped { "stopped" } else { "estimate" };
                    (
                        prompt.saturating_add(meter.completion_estimate()),
                        None,
                        source,
                    )
                }
                None => (0, None, "unused"),
            },
            None if self.sent => (prompt, None, "estimate"),
            None => (0, None, "unused"),
        }
    }

    /// What the call cost by price, for the `llm_spend` budgets, read as [`Metering::used`]
    /// reads the tokens: the response's usage (cached and cache-write tokens apart); else the
    /// prompt estimate and the completion text seen; the whole reservation for a 2xx body that
    /// could not be decoded; nothing for an error status or a request that never left.
    fn spent(&self) -> crate::engine::Spent {
        use crate::engine::Spent;
        use crate::request::llm::BilledTokens;
        let prompt = self.reservation.prompt_tokens();
        let ok = (200..300).contains(&self.status);
        match &self.meter {
            Some(body) if !body.readable() && ok => Spent::AsReserved,
            Some(body) => match body.meter().usage() {
                Some(usage) => Spent::Tokens(usage.priced()),
                None if ok => Spent::Tokens(BilledTokens {
                    input: prompt,
                    output: body.meter().completion_estimate(),
                    ..BilledTokens::default()
                }),
                None => Spent::Tokens(BilledTokens::default()),
            },
            None if self.sent => Spent::Tokens(BilledTokens {
                input: prompt,
                ..BilledTokens::default()
            }),
            None => Spent::Tokens(BilledTokens::default()),
        }
    }
}

/// One request's access-log facts, gathered along the way.
struct AccessCtx {
    started: std::time::Instant,
    unix_ms: i64,
    request_id: String,
    /// Generated here: passed upstream (a client's own ID already travels with its request).
    generated_id: bool,
    client_ip: Option<IpAddr>,
    verdict: &'static str,
    rule: Option<String>,
    upstream: Option<std::net::SocketAddr>,
    upstream_started: Option<std::time::Instant>,
    upstream_secs: Option<f64>,
    /// How long a paced request waited for its turn.
    paced_wait_secs: Option<f64>,
}

/// The model that answered, when an `llm_spend` fallback replaced the one the client named.
static X_TOLLGATE_MODEL: http::HeaderName = http::HeaderName::from_static("x-tollgate-model");

/// The proxy service.
pub struct Proxy {
    gateway: Arc<Gateway>,
    /// Upstream groups and routes, swapped whole on reload.
    upstreams: Arc<ArcSwap<Upstreams>>,
    /// Whether a refusal over HTTP/1 is written from its header lines
    /// ([`super::own_response::lines_fit`]): the reason and warning headers' names allow it.
    refusal_lines: bool,
}

impl Proxy {
    pub fn new(gateway: Arc<Gateway>, upstreams: Arc<ArcSwap<Upstreams>>) -> Self {
        let refusal_lines = super::own_response::lines_fit(&gateway.header_config);
        Proxy {
            gateway,
            upstreams,
            refusal_lines,
        }
    }
}

/// The request's `X-Request-Id` for a response the gateway writes itself (with access logs).
fn request_id_header(ctx: &RequestCtx) -> HeaderList {
    let mut headers = HeaderList::new();
    if let Some(id) = ctx
        .access
        .as_deref()
        .and_then(|a| http::HeaderValue::from_str(&a.request_id).ok())
    {
        headers.push((X_REQUEST_ID.clone(), id));
    }
    headers
}

/// `network.protocol.version` of the client's request.
fn protocol_version(session: &Session) -> &'static str {
    if session.is_http2() {
        "2"
    } else if session.req_header().version == http::Version::HTTP_10 {
        "1.0"
    } else {
        "1.1"
    }
}

/// For an HTTP/2 stream, the key its connection is registered under (its socket digest).
fn http2_key(session: &Session) -> Option<usize> {
    if !session.is_http2() {
        return None;
    }
    session
        .digest()
        .and_then(|d| d.socket_digest.as_ref())
        .map(|digest| Arc::as_ptr(digest) as usize)
}

/// Writes a complete response from the gateway itself, with `Content-Length`, so header and
/// body leave in one write and the connection stays open. Over HTTP/1 its header block is
/// rendered straight to bytes ([`super::own_response`]); otherwise it is built from `http` parts
/// with names parsed once (Pingora's `insert_header` would parse and allocate each custom name
/// again).
async fn respond(
    session: &mut Session,
    status: u16,
    headers: HeaderList,
    body: &'static str,
) -> Result<()> {
    let status =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    if let pingora::protocols::http::ServerSession::H1(_) = session.as_downstream_mut() {
        if let Some(head) = super::own_response::render_head(status, &headers, body.len()) {
            return respond_rendered(session, status.as_u16(), head, body).await;
        }
    }
    let (mut parts, ()) = http::Response::new(()).into_parts();
    parts.status = status;
    parts.headers.reserve(headers.len() + 2);
    for (name, value) in headers {
        parts.headers.append(name, value);
    }
    if !parts.headers.contains_key(http::header::CONTENT_TYPE) {
        parts.headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
    }
    parts.headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(body.len()),
    );
    session
        .write_response_header(Box::new(ResponseHeader::from(parts)), false)
        .await?;
    session
        .write_response_body(Some(Bytes::from_static(body.as_bytes())), true)
        .await
}

/// Writes a response over HTTP/1 from its rendered status and header lines
/// ([`super::own_response`]) and its body.
async fn respond_rendered(
    session: &mut Session,
    status: u16,
    head: Vec<u8>,
    body: &'static str,
) -> Result<()> {
    let pingora::protocols::http::ServerSession::H1(h1) = session.as_downstream_mut() else {
        return Err(Error::explain(
            pingora::ErrorType::InternalError,
            "a rendered header block is for HTTP/1 only",
        ));
    };
    let status =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    // Only the status is kept as the response written (the access log's, the trace's).
    let written = ResponseHeader::build_no_case(status, Some(0))?;
    h1.write_response_header_prerendered(Box::new(written), &head, body.len())
        .await?;
    session
        .write_response_body(Some(Bytes::from_static(body.as_bytes())), true)
        .await
}

/// Writes a gRPC call's trailers-only answer: over HTTP/2, one header block that ends the stream.
/// (Pingora's `write_response_header` leaves an HTTP/2 stream open whatever it is told, and
/// ends it later with an empty DATA frame: gRPC's C core, behind grpcio and others, then waits
/// for trailers and reports `UNKNOWN` instead of the status.) Over HTTP/1.1 (gRPC-Web) the
/// header carries `Content-Length: 0`.
async fn write_trailers_only(session: &mut Session, answer: ResponseHeader) -> Result<()> {
    if let pingora::protocols::http::ServerSession::H2(h2) = session.as_downstream_mut() {
        return h2.write_response_header(Box::new(answer), true);
    }
    session.write_response_header(Box::new(answer), true).await
}

/// [`respond`], or for a gRPC call its trailers-only gRPC answer.
async fn respond_to(
    session: &mut Session,
    ctx: &mut RequestCtx,
    status: u16,
    headers: HeaderList,
    body: &'static str,
) -> Result<()> {
    match ctx.grpc.as_deref_mut() {
        Some(call) => {
            let answer = call.own_answer(status, headers, Some(body));
            write_trailers_only(session, answer).await
        }
        None => respond(session, status, headers, body).await,
    }
}

impl Proxy {
    /// Answers a request whose header block passed `--max-request-header-bytes` or
    /// `--max-request-headers` with 431 (counted by limit); it never reaches the limiter.
    async fn refuse_header_block(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        limit: crate::config::HeaderLimit,
    ) -> Result<()> {
        self.gateway.metrics.request_headers_refused(limit.as_str());
        if let Some(access) = ctx.access.as_deref_mut() {
            access.verdict = "request_header_too_large";
        }
        super::protocol::keep_connection_for_small_body(
            session,
            self.gateway.config.header_timeout,
        );
        respond_to(
            session,
            ctx,
            431,
            request_id_header(ctx),
            super::protocol::HEADER_TOO_LARGE,
        )
        .await
    }

    /// What a finished request holds, each given back or settled exactly once (`take`): its
    /// concurrency lease, the charges no upstream answer settled, its LLM reservation.
    async fn give_back(&self, session: &Session, ctx: &mut RequestCtx) {
        if let Some(lease) = ctx.lease.take() {
            self.gateway.release(&lease).await;
        }
        // No upstream answered (the gateway's own 502 or 504): settled on what was written.
        if let Some(charges) = ctx.charges.take() {
            let status = session.response_written().map_or(0, |r| r.status.as_u16());
            let settlement = charges.settle(status, &Vec::<(String, String)>::new());
            self.settle(settlement).await;
        }
        // Settled exactly once, whatever happened to the response.
        if let Some(metering) = ctx.metering.take() {
            if let Some((reason, encoding)) = metering.meter.as_ref().and_then(|m| m.undecodable())
            {
                self.gateway
                    .metrics
                    .llm_undecodable(encoding, reason.as_str());
                tracing::warn!(
                    // The upstream's `Content-Encoding`: escaped like every value of a line.
                    encoding = %crate::telemetry::log_line::value(encoding),
                    reason = reason.as_str(),
                    "LLM response body could not be decoded: the reservation stays charged as reserved"
                );
            }
            let (used, reported_prompt, source) = metering.used();
            let spent = metering.spent();
            self.gateway
                .tokens
                .settle(
                    &metering.reservation,
                    (used, spent),
                    reported_prompt,
                    source,
                )
                .await;
        }
    }

    /// A refusal whose headers the decision wrote as HTTP/1 lines, on an HTTP/1 connection:
    /// its status, rendered head and body, ready for [`respond_rendered`]; any other reply is
    /// given back for [`Proxy::answer`]. (Synchronous, so the future that writes a flood's
    /// refusal is only `respond_rendered`'s.)
    fn rendered_refusal(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        reply: Reply,
    ) -> std::result::Result<(u16, Vec<u8>, &'static str), Reply> {
        let h1 = matches!(
            session.as_downstream(),
            pingora::protocols::http::ServerSession::H1(_)
        );
        let (status, body, content_type, lines) = match reply {
            Reply::Refusal {
                status,
                body,
                content_type,
                lines: Some(lines),
            } if h1 => (status, body, content_type, lines),
            other => return Err(other),
        };
        // The list [`Reply::refusal`] left is not written: the lines are.
        ctx.add_headers.clear();
        let request_id = ctx.access.as_deref().and_then(echoed_request_id);
        let body = body.unwrap_or("Too Many Requests");
        let head = super::own_response::render_lines_head(
            status,
            &lines,
            request_id.map(|id| (&X_REQUEST_ID, id)),
            content_type,
            body.len(),
        );
        super::protocol::keep_connection_for_small_body(
            session,
            self.gateway.config.header_timeout,
        );
        Ok((status, head, body))
    }

    /// Writes the gateway's own answer to a request it does not forward (a refusal or a 404),
    /// with the request's ID; a small unread body is drained so the connection stays open.
    async fn write_refusal(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        response: crate::engine::headers::Response,
        content_type: &'static str,
    ) -> Result<()> {
        let mut response = response;
        // An HTTP/1 refusal with lines was written by [`Proxy::rendered_refusal`]; lines that
        // reach here go out as a list.
        if let Some(lines) = response.lines.take() {
            response.headers = lines.into_list();
        }
        let mut headers = response.headers;
        if let Some(access) = ctx.access.as_deref() {
            if let Ok(id) = http::HeaderValue::from_str(&access.request_id) {
                headers.push((X_REQUEST_ID.clone(), id));
            }
        }
        if let Some(call) = ctx.grpc.as_deref_mut() {
            super::protocol::keep_connection_for_small_body(
                session,
                self.gateway.config.header_timeout,
            );
            let answer = call.own_answer(response.status, headers, response.body);
            return write_trailers_only(session, answer).await;
        }
        headers.push((
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        ));
        super::protocol::keep_connection_for_small_body(
            session,
            self.gateway.config.header_timeout,
        );
        respond(
            session,
            response.status,
            headers,
            response.body.unwrap_or("Too Many Requests"),
        )
        .await
    }

    /// Answers a request whose method, target or Host is malformed
    /// ([`crate::request::syntax`]) with 400 `malformed_request`, counted and logged like any
    /// refusal; nothing is matched and nothing reaches the upstream.
    async fn refuse_malformed(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        malformed: crate::request::syntax::Malformed,
    ) -> Result<()> {
        let req = session.req_header();
        let client_ip =
            self.gateway
                .client_ip_with(ctx.peer, ctx.forwarding.peer_trusted, &req.headers);
        if let Some(access) = ctx.access.as_deref_mut() {
            access.client_ip = client_ip;
            access.verdict = Reason::MalformedRequest.as_str();
        }
        tracing::debug!(client = ?client_ip, "malformed request refused: {malformed}");
        let (host, _) = super::protocol::host_and_target(req);
        let response =
            self.gateway
                .refuse_early(Reason::MalformedRequest, client_ip, host, req.uri.path());
        self.write_refusal(session, ctx, response, TEXT).await
    }

    /// The request's access-log line, from what the request gathered and what was sent.
    fn write_access_log(
        &self,
        session: &Session,
        access: &AccessCtx,
        trace_id: Option<&str>,
        grpc_status: Option<Option<u16>>,
    ) {
        let req = session.req_header();
        let header =
            |name: http::header::HeaderName| req.headers.get(name).and_then(|v| v.to_str().ok());
        let host = req
            .uri
            .authority()
            .map(|a| a.as_str())
            .or_else(|| header(http::header::HOST));
        let target = req
            .uri
            .path_and_query()
            .map_or_else(|| req.uri.path(), |pq| pq.as_str());
        let protocol = if session.is_http2() {
            "HTTP/2"
        } else if req.version == http::Version::HTTP_10 {
            "HTTP/1.0"
        } else {
            "HTTP/1.1"
        };
        let record = AccessRecord {
            unix_ms: access.unix_ms,
            client_ip: access.client_ip,
            method: req.method.as_str(),
            host,
            target,
            protocol,
            status: session.response_written().map_or(0, |r| r.status.as_u16()),
            bytes: session.body_bytes_sent(),
            referer: header(http::header::REFERER),
            user_agent: header(http::header::USER_AGENT),
            upstream: access.upstream,
            upstream_secs: access.upstream_secs,
            total_secs: access.started.elapsed().as_secs_f64(),
            verdict: access.verdict,
            rule: access.rule.as_deref(),
            paced_wait_secs: access.paced_wait_secs,
            request_id: &access.request_id,
            rpc: grpc_status.and_then(|status| {
                let (service, method) = crate::request::grpc::service_and_method(req.uri.path())?;
                Some((service, method, status))
            }),
            trace_id,
        };
        access_log::write(access_log::format(&record, self.gateway.config.access_log));
    }
}

impl RequestCtx {
    /// The admitted answer's header `lines` go through the header map after all: as a list,
    /// ahead of the headers added since.
    fn put_lines_first(&mut self, lines: HeaderLines) {
        let mut headers = lines.into_list();
        headers.extend(std::mem::take(&mut self.add_headers));
        self.add_headers = headers;
    }
}

/// What the gateway answers itself when a stage of the request path ends the request
/// ([`Proxy::answer`] writes it).
enum Reply {
    /// The header block passed `--max-request-header-bytes` or `--max-request-headers`: 431.
    HeaderBlock(crate::config::HeaderLimit),
    /// The method, target or Host is malformed: 400 `malformed_request`.
    Malformed(crate::request::syntax::Malformed),
    /// The body the decision needs could not be read: the status and its JSON body.
    BodyUnread(u16, &'static str),
    /// A refusal (the decision's, an encoded slash's, or no route's 404). Its headers wait in
    /// [`RequestCtx::add_headers`], which lives on the heap: a refusal is not copied around
    /// with them.
    Refusal {
        status: u16,
        body: Option<&'static str>,
        content_type: &'static str,
        /// Its headers as the HTTP/1 lines to send, when the decision wrote them so.
        lines: Option<crate::engine::headers::HeaderLines>,
    },
    /// The client went away while its request waited for its turn: nobody to answer.
    ClientGone,
}

impl Reply {
    /// The refusal `response`, its headers put in `ctx` until it is written.
    fn refusal(
        response: Box<crate::engine::headers::Response>,
        content_type: &'static str,
        ctx: &mut RequestCtx,
    ) -> Reply {
        ctx.add_headers = response.headers;
        Reply::Refusal {
            status: response.status,
            body: response.body,
            content_type,
            lines: response.lines,
        }
    }
}

/// What the body stage read for the decision.
#[derive(Default)]
struct BodyFacts {
    /// The body's fingerprint (`loop_detection`).
    hash: Option<u64>,
    /// What an LLM request's body asks for (`token_bucket_llm`, `llm_spend`).
    llm: Option<crate::request::llm::LlmRequest>,
    /// The body itself, when read whole for an LLM rule (an `llm_spend` fallback rewrites its
    /// `model`).
    whole: Option<Bytes>,
    /// The upstream group the request's route sends it to (`llm:provider`), looked up for an
    /// LLM request only.
    provider: Option<Arc<str>>,
}

// === The request path's stages ===
//
// Each stage is a method that either lets the request go on (`Continue`) or ends it with the
// gateway's own answer (`Break`). Nothing here allocates on the way through; the stages that
// wait (the body, a shared store, a throttle) box their futures, which stay out of the hook's.

impl Proxy {
    /// The request path, in order: header limits → peer → syntax → trace → body → facts →
    /// decide → verdict → route. `Continue`: the request goes to its upstream group.
    async fn admit(&self, session: &mut Session, ctx: &mut RequestCtx) -> ControlFlow<Reply> {
        self.grpc_call(session, ctx);
        self.header_limits(session)?;
        self.peer(session, ctx);
        Self::syntax(session)?;
        self.trace(session, ctx);
        let mut body = self.body(session, ctx).await?;
        let req = session.req_header();
        let headers = HttpHeaders(&req.headers);
        let facts = self.facts(req, &headers, ctx)?;
        if body.llm.is_some() {
            body.provider = self
                .upstreams
                .load()
                .route(facts.host_name(), &facts.path)
                .map(|group| Arc::clone(&group.name));
        }
        let claims = self.gateway.claims(&headers);
        let facts = Self::describe(facts, claims.as_deref(), &body, ctx);
        let lines = self.refusal_lines && ctx.grpc.is_none() && !session.is_http2();
        let mut answer = self.decide(&facts, lines, ctx).await;
        let model = answer.model.take();
        Self::verdict(answer, ctx)?;
        if let Some(model) = model {
            Self::rewrite_model(&body, &model, ctx);
        }
        self.route(req, &facts, ctx)?;
        if ctx.pace.is_some() {
            Box::pin(self.wait_turn(session, ctx)).await?;
        }
        ControlFlow::Continue(())
    }

    /// A paced request waits for its turn here, while its client is there: one that leaves
    /// gives its tokens back (dropping its place does), one whose turn comes after a
    /// shutdown's drain is refused 429 with `Retry-After`.
    async fn wait_turn(&self, session: &mut Session, ctx: &mut RequestCtx) -> ControlFlow<Reply> {
        let Some(pace) = ctx.pace.take() else {
            return ControlFlow::Continue(());
        };
        let waited = {
            let wait = (*pace).wait();
            tokio::pin!(wait);
            tokio::select! {
                waited = &mut wait => Some(waited),
                () = client_gone_within(session, PACED_GONE_POLL) => None,
            }
        };
        match waited {
            Some(crate::service::Waited::Served(waited)) => {
                let waited_us = waited.as_micros().min(u128::from(u64::MAX)) as u64;
                if let Some(trace) = ctx.trace.as_deref_mut() {
                    trace.paced(waited_us);
                }
                if let Some(access) = ctx.access.as_deref_mut() {
                    access.paced_wait_secs = Some(waited.as_secs_f64());
                }
                ControlFlow::Continue(())
            }
            Some(crate::service::Waited::Drained { retry_after }) => {
                // Its tokens (an LLM reservation's with them) were given back.
                ctx.metering = None;
                if let Some(access) = ctx.access.as_deref_mut() {
                    access.verdict = Reason::TokenBucketExceeded.as_str();
                }
                let response = self.gateway.drained_response(retry_after);
                ControlFlow::Break(Reply::refusal(Box::new(response), TEXT, ctx))
            }
            None => {
                ctx.metering = None;
                ControlFlow::Break(Reply::ClientGone)
            }
        }
    }

    /// Whether the request is a gRPC call: a POST with gRPC's content type (other requests
    /// pay one comparison of their method).
    fn grpc_call(&self, session: &Session, ctx: &mut RequestCtx) {
        let req = session.req_header();
        if req.method == http::Method::POST {
            ctx.grpc = GrpcCall::of(req, !session.is_http2(), || {
                self.gateway.counts_grpc_messages()
            });
        }
    }

    /// Sends an admitted request to the `llm_spend` fallback model it was admitted with: the
    /// body's `model` replaced (forwarded instead of the body read), and `X-Tollgate-Model`
    /// on the response telling the client which model answered.
    fn rewrite_model(body: &BodyFacts, model: &str, ctx: &mut RequestCtx) {
        let rewritten = body
            .whole
            .as_deref()
            .and_then(|whole| serde_json::from_slice::<serde_json::Value>(whole).ok())
            .and_then(|mut json| {
                *json.as_object_mut()?.get_mut("model")? = serde_json::Value::from(model);
                serde_json::to_vec(&json).ok()
            });
        if let Some(rewritten) = rewritten {
            ctx.forward_body = Some(Bytes::from(rewritten));
            ctx.model_rewritten = true;
        }
        if let Ok(value) = http::HeaderValue::from_str(model) {
            ctx.add_headers.push((X_TOLLGATE_MODEL.clone(), value));
        }
    }

    /// The gateway's own header limits, before anything reads the headers (or counts the
    /// request against a limit).
    fn header_limits(&self, session: &Session) -> ControlFlow<Reply> {
        match super::protocol::limit_passed(self.gateway.config.header_limits, session) {
            Some(limit) => ControlFlow::Break(Reply::HeaderBlock(limit)),
            None => ControlFlow::Continue(()),
        }
    }

    /// The peer and its trusted-proxy verdict, worked out once per connection.
    fn peer(&self, session: &Session, ctx: &mut RequestCtx) {
        let (peer, peer_trusted) = super::conn::peer(|| {
            let peer = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|sa| sa.ip());
            let trusted = peer
                .map(crate::request::descriptor::canonical_ip)
                .is_some_and(|ip| self.gateway.is_trusted_proxy(ip));
            (peer, trusted)
        });
        ctx.peer = peer;
        ctx.forwarding.peer_trusted = peer_trusted;
    }

    /// A method, target or Host an upstream could read differently from the match the
    /// decision makes.
    fn syntax(session: &Session) -> ControlFlow<Reply> {
        match super::protocol::well_formed(session.req_header()) {
            Ok(()) => ControlFlow::Continue(()),
            Err(malformed) => ControlFlow::Break(Reply::Malformed(malformed)),
        }
    }

    /// The request's spans, when traces are on.
    fn trace(&self, session: &Session, ctx: &mut RequestCtx) {
        if let Some(telemetry) = self.gateway.telemetry() {
            let req = session.req_header();
            let (host, _) = super::protocol::host_and_target(req);
            ctx.trace = Some(Box::new(telemetry.http_request(
                &req.headers,
                ctx.forwarding.peer_trusted,
                req.method.as_str(),
                req.uri.path(),
                host,
                protocol_version(session),
            )));
            if let (Some(trace), Some(_)) = (ctx.trace.as_deref_mut(), ctx.grpc.as_deref()) {
                if let Some((service, method)) =
                    crate::request::grpc::service_and_method(req.uri.path())
                {
                    trace.grpc_call(service, method);
                }
            }
        }
    }

    /// The body, when the decision needs it: read whole (bounded) for a `token_bucket_llm`
    /// rule that may apply, read and hashed when small for `loop_detection` fingerprints, else
    /// left to stream to the upstream.
    async fn body(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> ControlFlow<Reply, BodyFacts> {
        if self.reads_whole_body(session.req_header()) {
            let read = Box::pin(read_whole_body(
                session,
                self.gateway.config.max_body_bytes.get(),
            ));
            return match read.await {
                Ok(body) => {
                    let hash = crate::request::descriptor::body_hash(&body);
                    let llm = crate::request::llm::LlmRequest::parse_with(
                        &body,
                        self.gateway.tiktoken_encodings(),
                    );
                    if body.len() > RETRY_BUFFER_BYTES {
                        ctx.forward_body = Some(body.clone());
                    }
                    ControlFlow::Continue(BodyFacts {
                        hash,
                        llm: Some(llm),
                        whole: Some(body),
                        provider: None,
                    })
                }
                Err((status, message)) => ControlFlow::Break(Reply::BodyUnread(status, message)),
            };
        }
        if self.gateway.fingerprints_bodies() {
            let read = Box::pin(read_small_body(session));
            return ControlFlow::Continue(BodyFacts {
                hash: read.await,
                ..BodyFacts::default()
            });
        }
        ControlFlow::Continue(BodyFacts::default())
    }

    /// Whether a `token_bucket_llm` rule needs the whole body before deciding. With shadow
    /// rules alone, a body that could be refused (too large, or chunked) is not read: shadow
    /// mode refuses nothing, and the shadow rules count it without its prompt. (Asked of facts
    /// made for this question alone, only when such rules are in force: the body is read
    /// through the session those facts borrow from, so the decision's own facts, with the
    /// client's address and the body, are made after the read.)
    fn reads_whole_body(&self, req: &RequestHeader) -> bool {
        if !self.gateway.meters_tokens() {
            return false;
        }
        let headers = HttpHeaders(&req.headers);
        self.new_facts(req, &headers, None).is_ok_and(|facts| {
            self.gateway.meters_tokens_for(&facts)
                && (self.gateway.enforces_tokens_for(&facts)
                    || super::protocol::declared_length(req)
                        .is_some_and(|n| n <= self.gateway.config.max_body_bytes.get()))
        })
    }

    /// The request's facts, with the client's address as resolved for limiting; a path with
    /// an encoded slash the gateway refuses (`--encoded-slashes`) ends the request here.
    fn facts<'a>(
        &self,
        req: &'a RequestHeader,
        headers: &'a HttpHeaders<'a>,
        ctx: &mut RequestCtx,
    ) -> ControlFlow<Reply, RequestFacts<'a>> {
        let client_ip =
            self.gateway
                .client_ip_with(ctx.peer, ctx.forwarding.peer_trusted, &req.headers);
        ctx.client_ip = client_ip;
        match self.new_facts(req, headers, client_ip) {
            Ok(facts) => ControlFlow::Continue(facts),
            Err(_) => {
                let (host, _) = super::protocol::host_and_target(req);
                if let Some(access) = ctx.access.as_deref_mut() {
                    access.client_ip = client_ip;
                    access.verdict = Reason::EncodedSlash.as_str();
                }
                let response = self.gateway.refuse_early(
                    Reason::EncodedSlash,
                    client_ip,
                    host,
                    req.uri.path(),
                );
                ControlFlow::Break(Reply::refusal(Box::new(response), TEXT, ctx))
            }
        }
    }

    /// The one place the proxy makes a request's facts: its method, target and `Host`, the
    /// path normalised as `--encoded-slashes` says.
    fn new_facts<'a>(
        &self,
        req: &'a RequestHeader,
        headers: &'a HttpHeaders<'a>,
        client_ip: Option<IpAddr>,
    ) -> std::result::Result<RequestFacts<'a>, crate::request::descriptor::EncodedSlashError> {
        let (host, target) = super::protocol::host_and_target(req);
        RequestFacts::new(
            req.method.as_str(),
            target,
            host,
            client_ip,
            headers,
            self.gateway.config.encoded_slashes,
        )
    }

    /// The facts with what the earlier stages learned: the verified JWT's claims, the body,
    /// the peer's trust and the trace.
    fn describe<'a>(
        facts: RequestFacts<'a>,
        claims: Option<&'a crate::request::descriptor::Claims>,
        body: &'a BodyFacts,
        ctx: &RequestCtx,
    ) -> RequestFacts<'a> {
        let mut facts = facts
            .with_claims(claims)
            .with_body_hash(body.hash)
            .with_llm(body.llm.as_ref())
            .with_trusted_peer(ctx.forwarding.peer_trusted)
            .with_trace(ctx.trace.as_deref().map(|t| t.facts()));
        // Set in place, for LLM requests only: every other request's facts move no further.
        if body.llm.is_some() {
            facts.llm_provider = body.provider.as_deref();
            facts.model_rewritable = body.whole.is_some();
        }
        facts
    }

    /// The decision, noted in the trace and the access log. The in-memory store decides
    /// without a future. Otherwise boxed: inline, the decision's future (stores, leases) would
    /// grow this hook's future, which Pingora moves into a box on every request, past what a
    /// copy does cheaply (measured: +10 % instructions per request); so is a throttled
    /// answer's wait.
    async fn decide(&self, facts: &RequestFacts<'_>, lines: bool, ctx: &mut RequestCtx) -> Answer {
        let answer = match self.gateway.decide_in_memory_as(facts, lines) {
            Some(answer) if answer.throttle_ms == 0 => answer,
            Some(answer) => Box::pin(Gateway::throttled(answer)).await,
            None => Box::pin(self.gateway.decide_unwaited(facts)).await,
        };
        if let Some(trace) = ctx.trace.as_deref_mut() {
            if let Some(ip) = ctx.client_ip {
                trace.client(ip);
            }
            if let Some(summary) = answer.summary.as_deref() {
                trace.decided(summary);
            }
        }
        if let Some(access) = ctx.access.as_deref_mut() {
            access.client_ip = ctx.client_ip;
            access.verdict = answer.verdict.as_str();
            access.rule = answer.verdict.rule().map(str::to_string);
        }
        answer
    }

    /// Applies what a response settled, in a future of its own: the store calls' state stays
    /// out of the filters' futures, which every request builds, charged or not.
    fn settle(
        &self,
        settlement: crate::engine::charges::Settlement,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move { self.gateway.penalties.apply(&settlement).await })
    }

    /// A refusal ends the request here. An allowed request (or any, with no policy loaded: the
    /// proxy fails open, where the decision service answers 503) keeps its lease, its LLM
    /// reservation and the headers for its response.
    fn verdict(answer: Answer, ctx: &mut RequestCtx) -> ControlFlow<Reply> {
        ctx.pace = answer.pace;
        if !answer.verdict.forwards() {
            if let Some(call) = ctx.grpc.as_deref_mut() {
                call.refused = answer
                    .verdict
                    .reason()
                    .map(|r| (r, answer.verdict.rule().map(str::to_string)));
            }
            // OpenAI-style JSON for the LLM reasons, text otherwise.
            let content_type = answer.verdict.reason().map_or(TEXT, |r| r.content_type());
            return ControlFlow::Break(Reply::refusal(answer.response, content_type, ctx));
        }
        ctx.lease = answer.lease;
        ctx.charges = answer.charges;
        ctx.metering = answer.reservation.map(|reservation| {
            Box::new(Metering {
                reservation: *reservation,
                meter: None,
                status: 0,
                sent: false,
                stop: None,
            })
        });
        let response = answer.response;
        ctx.add_headers = response.headers;
        ctx.add_lines = response.lines;
        ControlFlow::Continue(())
    }

    /// The upstream group for the request's host and path, with the route's header rules; no
    /// route: 404.
    fn route(
        &self,
        req: &RequestHeader,
        facts: &RequestFacts<'_>,
        ctx: &mut RequestCtx,
    ) -> ControlFlow<Reply> {
        let upstreams = self.upstreams.load();
        let Some((group, rules)) = upstreams.route_with_rules(facts.host_name(), &facts.path)
        else {
            // The allowed answer's headers, already in `ctx`, go with the 404 (as a list: the
            // 404's writer adds its own).
            if let Some(lines) = ctx.add_lines.take() {
                ctx.put_lines_first(lines);
            }
            return ControlFlow::Break(Reply::Refusal {
                status: 404,
                body: Some("Not Found: no route for this host and path\n"),
                content_type: TEXT,
                lines: None,
            });
        };
        ctx.group = Some(Arc::clone(group));
        ctx.forwarding.forwarded = upstreams.table.forwarded;
        if let Some(trace) = ctx.trace.as_deref_mut() {
            if let Some(route) = upstreams
                .table
                .matched_prefix(facts.host_name(), &facts.path)
            {
                trace.route(route);
            }
        }
        if let Some(rules) = rules {
            if rules.uses_request_id() && ctx.access.is_none() {
                ctx.forwarding.request_id = Some(
                    req.headers
                        .get(&X_REQUEST_ID)
                        .and_then(|v| access_log::acceptable_request_id(v.as_bytes()))
                        .map_or_else(access_log::new_request_id, str::to_string),
                );
            }
            ctx.forwarding.rules = Some(Arc::clone(rules));
        }
        ControlFlow::Continue(())
    }

    /// The admitted request goes on: its upstream continues its trace, and a client waiting
    /// for `100 Continue` gets it now.
    async fn forward(session: &mut Session, ctx: &mut RequestCtx) -> Result<()> {
        if let Some(trace) = ctx.trace.as_deref_mut() {
            // Written into the client's request header, parsed with room for added headers,
            // rather than into Pingora's copy of it for the upstream, which has none: a header
            // added there grows both of its maps (about 1 300 instructions a request).
            write_trace_context(trace, session.req_header_mut());
        }
        if super::protocol::expects_continue(session.req_header()) {
            let answer = Box::pin(super::protocol::continue_if_expected(session));
            answer.await?;
        }
        Ok(())
    }

    /// Writes the answer a stage ended the request with.
    async fn answer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        reply: Reply,
    ) -> Result<()> {
        match reply {
            Reply::HeaderBlock(limit) => self.refuse_header_block(session, ctx, limit).await,
            Reply::Malformed(malformed) => self.refuse_malformed(session, ctx, malformed).await,
            Reply::BodyUnread(status, message) => {
                let mut headers = request_id_header(ctx);
                if ctx.grpc.is_none() {
                    headers.push((
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    ));
                }
                respond_to(session, ctx, status, headers, message).await
            }
            Reply::Refusal {
                status,
                body,
                content_type,
                lines,
            } => {
                let response = crate::engine::headers::Response {
                    status,
                    headers: std::mem::take(&mut ctx.add_headers),
                    body,
                    lines,
                };
                self.write_refusal(session, ctx, response, content_type)
                    .await
            }
            Reply::ClientGone => Err(Error::explain(
                CLIENT_GONE_WHILE_PACED,
                "the client went away while its request waited for its turn under a delay rule",
            )),
        }
    }
}

impl Proxy {
    /// A gRPC call is over: counted by method and status, its status on its trace; the status
    /// for its log line. Out of line: HTTP requests only test that they are not a call.
    #[inline(never)]
    fn grpc_call_done(
        &self,
        session: &Session,
        call: &GrpcCall,
        trace: Option<&mut crate::telemetry::traces::RequestSpan>,
    ) -> Option<u16> {
        let status = call.status_number();
        if let Some((service, method)) =
            crate::request::grpc::service_and_method(session.req_header().uri.path())
        {
            self.gateway
                .metrics
                .proxied_grpc_call(service, method, status);
        }
        if let (Some(trace), Some(code)) = (trace, status) {
            trace.grpc_status(code);
        }
        status
    }

    /// Passes a piece of a gRPC call's request body through its message gate: each message
    /// that begins in it is decided (`grpc:message` rules) before any of its bytes go on. At
    /// the first refused one, the messages before it go on and the request stream to the
    /// upstream ends there (`END_STREAM`: at once, or with the next piece when some of this
    /// piece's messages go on first), so the upstream reads exactly the admitted messages, each
    /// once, and answers; nothing more of the client's stream goes on, and the upstream's
    /// final status is replaced by the refusal's (`response_trailer_filter`). When the client
    /// ends its side after that, the call ends (`fail_to_proxy`).
    async fn gate_messages(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let client_ip = ctx.client_ip;
        let Some(call) = ctx.grpc.as_deref_mut() else {
            return Ok(());
        };
        let Some(gate) = call.gate.as_mut() else {
            return Ok(());
        };
        if gate.cut {
            if !gate.closed {
                // The request stream to the upstream ends here.
                gate.closed = true;
                *body = None;
                return Ok(());
            }
            if end_of_stream {
                return Err(call_cut());
            }
            *body = Some(Bytes::new());
            return Ok(());
        }
        let piece = body.take().unwrap_or_default();
        let req = session.req_header();
        let gateway = &*self.gateway;
        let out = gate
            .pass(&piece, end_of_stream, || {
                message_refusal(gateway, req, client_ip)
            })
            .await;
        match out {
            Gate::Pass(pass) => {
                *body = (!pass.is_empty() || !end_of_stream).then_some(pass);
            }
            Gate::Cut(pass, refusal) => {
                tracing::debug!(
                    reason = refusal.reason.as_str(),
                    "gRPC request message refused: the call is cut"
                );
                call.cut = Some(refusal);
                // An empty piece with the end flag, or none, ends the upstream's stream.
                gate.closed = pass.is_empty() || end_of_stream;
                *body = (!pass.is_empty()).then_some(pass);
            }
        }
        Ok(())
    }
}

/// The error that ends a cut gRPC call when its client ends its side. Filed as the client's
/// side's, so that Pingora stops at once (resetting the upstream's stream if it is still
/// answering) rather than write a second end of stream to the upstream.
fn call_cut() -> Box<Error> {
    Error::explain(GRPC_CALL_CUT, "a request message was refused").into_down()
}

/// The decision on one request message of a gRPC call: `None` when it may go upstream.
async fn message_refusal(
    gateway: &Gateway,
    req: &RequestHeader,
    client_ip: Option<IpAddr>,
) -> Option<Box<super::grpc_call::CutRefusal>> {
    let headers = HttpHeaders(&req.headers);
    let (host, target) = super::protocol::host_and_target(req);
    let facts = RequestFacts::new(
        req.method.as_str(),
        target,
        host,
        client_ip,
        &headers,
        gateway.config.encoded_slashes,
    )
    .ok()?;
    let claims = gateway.claims(&headers);
    let facts = facts.with_claims(claims.as_deref()).with_grpc_message();
    let answer = match gateway.decide_in_memory(&facts) {
        Some(answer) if answer.throttle_ms == 0 => answer,
        Some(answer) => Box::pin(Gateway::throttled(answer)).await,
        None => Box::pin(gateway.decide(&facts)).await,
    };
    if let Some(lease) = &answer.lease {
        gateway.release(lease).await;
    }
    match answer.verdict {
        crate::service::Verdict::Refused { reason, rule } => {
            Some(Box::new(super::grpc_call::CutRefusal {
                reason,
                rule,
                headers: answer.response.headers,
                body: answer.response.body,
            }))
        }
        _ => None,
    }
}

/// Ends a gRPC call cut at a refused request message whose upstream has not ended it yet:
/// `RESOURCE_EXHAUSTED` (with the refusal's delay and rule) in the trailers when the response
/// has begun, else a trailers-only answer.
async fn finish_cut_call(session: &mut Session, ctx: &mut RequestCtx) -> FailToProxy {
    let fail = FailToProxy {
        error_code: 200,
        can_reuse_downstream: false,
    };
    let Some(call) = ctx.grpc.as_deref_mut() else {
        return fail;
    };
    // Already ended in the upstream's trailers.
    let Some(cut) = call.cut.take() else {
        return fail;
    };
    let started = session
        .as_downstream()
        .response_written()
        .is_some_and(|h| !h.status.is_informational());
    let mut trailers = http::HeaderMap::new();
    call.end_cut(*cut, &mut trailers);
    if let Some(access) = ctx.access.as_deref_mut() {
        note_cut(access, call);
    }
    if !started {
        let answer = call.own_answer_with(trailers);
        let _ = write_trailers_only(session, answer).await;
    } else if call.is_http1() {
        let frame = GrpcCall::web_trailer_frame(&trailers);
        let _ = session.write_response_body(Some(frame), true).await;
    } else {
        let _ = session
            .as_downstream_mut()
            .write_response_trailers(trailers)
            .await;
    }
    fail
}

/// A gRPC call's response header: its status noted when the upstream answered trailers-only,
/// and a cut call so answered ends with the refusal's status instead. Out of line: HTTP
/// requests only test that they are not a call.
#[inline(never)]
fn grpc_response_header(
    upstream_response: &mut ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let Some(call) = ctx.grpc.as_deref_mut() else {
        return Ok(());
    };
    call.upstream_ended(&upstream_response.headers);
    if !upstream_response
        .headers
        .contains_key(&super::grpc_call::GRPC_STATUS)
    {
        return Ok(());
    }
    if let Some(cut) = call.cut.take() {
        let mut fields = http::HeaderMap::new();
        call.end_cut(*cut, &mut fields);
        upstream_response.remove_header(&super::grpc_call::GRPC_MESSAGE);
        upstream_response.remove_header(&super::grpc_call::GRPC_STATUS_DETAILS);
        for (name, value) in fields {
            if let Some(name) = name {
                upstream_response.insert_header(name, value)?;
            }
        }
        if let Some(access) = ctx.access.as_deref_mut() {
            note_cut(access, call);
        }
    }
    Ok(())
}

/// Whether the request is a gRPC call cut at a refused message: how it ends is an outcome.
fn call_was_cut(ctx: &RequestCtx) -> bool {
    ctx.grpc
        .as_deref()
        .and_then(|c| c.gate.as_ref())
        .is_some_and(|g| g.cut)
}

/// The access log's verdict and rule of a call cut at a refused message.
fn note_cut(access: &mut AccessCtx, call: &GrpcCall) {
    if let Some((reason, rule)) = &call.refused {
        access.verdict = reason.as_str();
        access.rule = rule.clone();
    }
}

#[async_trait]
impl ProxyHttp for Proxy {
    // Boxed: the context lives in Pingora's per-request future, which Pingora moves (copies
    // whole) on every request; inline, its ~750 bytes cost ~2 400 instructions of copying per
    // request (benches/instructions.sh), against one allocation.
    type CTX = Box<RequestCtx>;

    fn new_ctx(&self) -> Self::CTX {
        Box::default()
    }

    /// No downstream modules: Pingora's default adds a disabled compression module whose
    /// context is built, and whose filters run, on every request.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    async fn early_request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<()> {
        // Requests pipelined behind this one are answered in order (Pingora drops them
        // otherwise); the flag carries over to the connection's next requests.
        session.set_pipelining_enabled(true);
        // A client that stops reading its response is cut off after the send timeout (Pingora
        // would wait for it forever), so it cannot hold an upstream slot.
        session
            .as_downstream_mut()
            .set_write_timeout(Some(self.gateway.config.send_timeout));
        super::conn::request_started(http2_key(session));
        if self.gateway.config.access_log != AccessLogFormat::Off {
            let sent = session
                .req_header()
                .headers
                .get(&X_REQUEST_ID)
                .and_then(|v| access_log::acceptable_request_id(v.as_bytes()))
                .map(str::to_string);
            let generated_id = sent.is_none();
            ctx.access = Some(Box::new(AccessCtx {
                started: std::time::Instant::now(),
                unix_ms: crate::limits::clock::wall_unix_ms(),
                request_id: sent.unwrap_or_else(access_log::new_request_id),
                generated_id,
                client_ip: None,
                verdict: "allow",
                rule: None,
                upstream: None,
                upstream_started: None,
                upstream_secs: None,
                paced_wait_secs: None,
            }));
        }
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        // The stages ([`Proxy::admit`]) either let the request go on to its upstream or end it
        // with what the gateway answers itself.
        match self.admit(session, ctx).await {
            ControlFlow::Continue(()) => {
                Self::forward(session, ctx).await?;
                Ok(false)
            }
            ControlFlow::Break(reply) => {
                // A flood's refusal (HTTP/1, its header lines written by the decision) is
                // written from here: its one future is smaller than the stages', so this
                // hook's future does not grow. Rare paths are awaited boxed, and bound first:
                // inline (or as a temporary of the awaiting statement) their futures would
                // grow this hook's future, which Pingora moves whole into a box on every
                // request, by kilobytes.
                match self.rendered_refusal(session, ctx, reply) {
                    Ok((status, head, body)) => {
                        respond_rendered(session, status, head, body).await?
                    }
                    Err(reply) => {
                        let answer = Box::pin(self.answer(session, ctx, reply));
                        answer.await?;
                    }
                }
                Ok(true)
            }
        }
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if ctx.grpc.as_deref().is_some_and(|c| c.gate.is_some()) {
            let gated = Box::pin(self.gate_messages(session, body, end_of_stream, ctx));
            return gated.await;
        }
        // The body was read whole before deciding, past what Pingora's retry buffer replays:
        // the upstream gets all of it, byte for byte (again on a retry to another server).
        if let (Some(whole), true) = (&ctx.forward_body, end_of_stream) {
            *body = Some(whole.clone());
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<Option<std::time::Duration>> {
        // Read as it passes, never held back: a stream reaches the client chunk by chunk.
        let Some(metering) = ctx.metering.as_deref_mut() else {
            return Ok(None);
        };
        let Some(meter) = metering.meter.as_mut() else {
            return Ok(None);
        };
        if let Some(chunk) = body.as_ref() {
            match metering.stop.as_deref_mut() {
                None => {
                    meter.feed(chunk);
                }
                Some(stop) => {
                    stop.written(session.body_bytes_sent());
                    if let Some(at) = meter.feed(chunk) {
                        let prompt = metering.reservation.prompt_tokens();
                        let closing = stop.cap.closing_events(meter.meter(), prompt);
                        let unsent: usize = stop.unsent.iter().map(Bytes::len).sum();
                        let mut tail = Vec::with_capacity(unsent + at + closing.len());
                        for piece in stop.unsent.drain(..) {
                            tail.extend_from_slice(&piece);
                        }
                        tail.extend_from_slice(&chunk[..at]);
                        tail.extend_from_slice(closing.as_bytes());
                        stop.tail = Some(Bytes::from(tail));
                        tracing::info!(
                            completion_tokens = meter.meter().completion_estimate(),
                            max_completion_tokens = stop.cap.max_completion_tokens,
                            "LLM_STREAM_STOPPED"
                        );
                        return Err(Error::explain(
                            STREAM_STOPPED,
                            "the completion passed max_completion_tokens",
                        ));
                    }
                    stop.unsent.push_back(chunk.clone());
                }
            }
        }
        if end_of_stream {
            meter.finish();
        }
        Ok(None)
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut Self::CTX,
    ) -> Result<Box<HttpPeer>> {
        // The forwarding headers go on the client's request header itself, once: Pingora copies
        // it for every attempt, and it has room for them (a copy made first would grow).
        if let (0, Some(group)) = (ctx.connect_tries, ctx.group.as_ref()) {
            let (peer, forwarding) = (ctx.peer, &ctx.forwarding);
            // Over HTTP/1, with no request rule to see them, they may go as header lines.
            let lines = !group.spec.protocol.is_http2()
                && forwarding
                    .rules
                    .as_deref()
                    .is_none_or(|r| r.request.is_empty());
            super::conn::with_forwarding_values(
                session,
                |session| super::forward::ConnectionValues::of(session, peer),
                |session, conn| {
                    let req = session.req_header_mut();
                    super::forward::to_request(conn, req, forwarding, peer, lines)
                },
            )?;
        }
        // A retry gives back the slot it held at the server that failed first.
        ctx.slot = None;
        let telemetry = self.gateway.telemetry();
        let Some(group) = ctx.group.as_ref() else {
            return Err(Error::explain(NO_HEALTHY_UPSTREAM, "no upstream group"));
        };
        // Consistent hashing keys on the client address as resolved for limiting (behind a
        // trusted proxy, the real client).
        // A retry (after a failed connection) goes to another server when there is one.
        let failed = ctx.server.filter(|_| ctx.connect_tries > 0);
        let Some((addr, peer)) = group.select(ctx.client_ip, failed) else {
            return Err(Error::explain(
                NO_HEALTHY_UPSTREAM,
                "every server of the upstream group is down",
            ));
        };
        // The per-server cap: wait in line for a slot (none when the group has no cap), within
        // the client's share, and only while the client is still there.
        // The wait is boxed, and only for a capped group: inline, its future would grow this
        // hook's, which Pingora moves whole into a box on every request.
        let slot = match group.slots(addr) {
            None => None,
            Some(slots) => {
                let acquiring = Box::pin(slots.acquire(
                    // One client: an IPv6 client's whole /64 (`--ipv6-prefix`), as it is
                    // to the limits, so rotating addresses buys no more slots.
                    ctx.client_ip.or(ctx.peer).map(|ip| {
                        crate::request::descriptor::client_net(ip, self.gateway.config.ipv6_prefix)
                    }),
                    group.spec.queue_timeout,
                    || self.gateway.metrics.upstream_queue(&group.spec.name),
                    client_gone(session),
                ));
                match acquiring.await {
                    Ok(slot) => Some(slot),
                    Err(super::queue::QueueError::TimedOut) => {
                        return Err(Error::explain(
                            QUEUE_TIMED_OUT,
                            "the upstream server stayed at max_connections for queue_timeout_ms",
                        ))
                    }
                    Err(super::queue::QueueError::ClientGone) => {
                        return Err(Error::explain(
                            CLIENT_GONE_WHILE_QUEUED,
                            "the client went away while its request waited for an upstream slot",
                        ))
                    }
                }
            }
        };
        ctx.slot = slot;
        ctx.server = Some(addr);
        ctx.connect_tries += 1;
        if let (Some(trace), Some(telemetry)) = (ctx.trace.as_deref_mut(), telemetry) {
            if ctx.connect_tries == 1 {
                trace.upstream_started(telemetry, &group.name, addr);
            } else if trace.upstream_recorded() {
                trace.upstream_event(crate::telemetry::traces::UpstreamEvent::Retry {
                    server: addr,
                    attempt: ctx.connect_tries,
                });
            }
        }
        if let Some(access) = ctx.access.as_deref_mut() {
            access.upstream = Some(addr);
            access.upstream_started = Some(std::time::Instant::now());
        }
        Ok(peer)
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Self::CTX,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // Nothing was sent yet, so trying again is always safe: on another server when the
        // group has one, else on the same (see `upstreams` for the budget and ejection rules).
        if let (Some(group), Some(addr)) = (ctx.group.as_ref(), ctx.server) {
            let kind = super::upstreams::ConnectFailure::of_error(&e);
            let outcome = group.connect_failed(addr, kind, ctx.connect_tries);
            e.set_retry(outcome.retry);
            self.gateway.metrics.upstream_connect_failed(
                &group.spec.name,
                kind.as_str(),
                outcome.retry,
                outcome.ejected,
            );
            tracing::warn!(
                group = %crate::telemetry::log_line::value(&group.spec.name),
                server = %addr,
                kind = kind.as_str(),
                attempt = ctx.connect_tries,
                retry = outcome.retry,
                "upstream connection failed: {}",
                e.etype().as_str()
            );
            if let Some(trace) = ctx.trace.as_deref_mut().filter(|t| t.upstream_recorded()) {
                trace.upstream_event(crate::telemetry::traces::UpstreamEvent::ConnectFailed {
                    server: addr,
                    attempt: ctx.connect_tries,
                    failure: kind.as_str(),
                });
                if outcome.ejected {
                    trace.upstream_event(crate::telemetry::traces::UpstreamEvent::Ejection {
                        server: addr,
                        attempt: ctx.connect_tries,
                    });
                }
            }
            if outcome.ejected {
                tracing::warn!(group = %crate::telemetry::log_line::value(&group.spec.name), server = %addr, "upstream server ejected after consecutive connection failures");
            }
        }
        e
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        _peer: &HttpPeer,
        _fd: std::os::unix::io::RawFd,
        _digest: Option<&pingora::protocols::Digest>,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        // Only a new connection proves the server takes connections (a pooled one was made
        // earlier, and could hide a server whose new connections now fail).
        if let (Some(group), Some(addr), false) = (ctx.group.as_ref(), ctx.server, reused) {
            group.connected(addr);
        }
        if let (Some(trace), Some(addr)) = (
            ctx.trace.as_deref_mut().filter(|t| t.upstream_recorded()),
            ctx.server,
        ) {
            trace.upstream_event(crate::telemetry::traces::UpstreamEvent::Connect {
                server: addr,
                attempt: ctx.connect_tries,
                reused,
            });
        }
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        if let Some(access) = ctx.access.as_deref() {
            if access.generated_id {
                if let Ok(id) = http::HeaderValue::from_str(&access.request_id) {
                    upstream_request.insert_header_parsed(&X_REQUEST_ID, "X-Request-Id", id);
                }
            }
        }
        // gRPC servers expect `TE: trailers`, which Pingora strips as hop-by-hop.
        if ctx.grpc.is_some()
            && ctx
                .group
                .as_ref()
                .is_some_and(|g| g.spec.protocol.is_http2())
        {
            upstream_request.insert_header(http::header::TE, "trailers")?;
        }
        // Only HTTP/1.0 may come without `Host` (Pingora's HTTP/2 side makes one from the
        // authority): a version check spares every other request a header lookup.
        let client_version = session.req_header().version;
        if let (Some(server), http::Version::HTTP_10) = (ctx.server, client_version) {
            let tls_name = ctx
                .group
                .as_ref()
                .and_then(|g| g.spec.tls.as_ref())
                .map(|t| t.sni.as_str());
            super::protocol::host_for_upstream(upstream_request, tls_name, server)?;
        }
        if let (true, Some(body)) = (ctx.model_rewritten, &ctx.forward_body) {
            if upstream_request
                .headers
                .contains_key(http::header::CONTENT_LENGTH)
            {
                upstream_request.insert_header(http::header::CONTENT_LENGTH, body.len())?;
            }
        }
        super::forward::apply_request_rules(
            session,
            upstream_request,
            &ctx.forwarding,
            ctx.client_ip.or(ctx.peer),
            ctx.access.as_deref().map(|a| a.request_id.as_str()),
        )?;
        if let Some(trace) = ctx.trace.as_deref_mut() {
            // The route's rules ran after the trace's context was written: where they name its
            // headers, the context is written again, so that the upstream always continues
            // this trace (never a rule's value, nor two `traceparent` lines).
            let rules = ctx.forwarding.rules.as_deref().map(|r| &r.request);
            if rules.is_some_and(|r| {
                r.names(&crate::telemetry::traces::TRACEPARENT.0)
                    || r.names(&crate::telemetry::traces::TRACESTATE.0)
            }) {
                write_trace_context(trace, upstream_request);
            }
        }
        if let Some(metering) = ctx.metering.as_deref_mut() {
            // The response's usage must be readable as it passes: uncompressed (SDKs ask
            // for gzip and br by default).
            upstream_request.insert_header(http::header::ACCEPT_ENCODING, "identity")?;
            metering.sent = true;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        // A 1xx (103 Early Hints, 100 Continue) passes as it came: the limit headers, the meter
        // and the access-log facts belong to the final response that follows it.
        if upstream_response.status.is_informational() {
            return Ok(());
        }
        super::protocol::frame_for_client(session, upstream_response);
        if ctx.grpc.is_some() {
            grpc_response_header(upstream_response, ctx)?;
        }
        if let Some(trace) = ctx.trace.as_deref_mut() {
            trace.upstream_responded(upstream_response.status.as_u16());
        }
        // `take`: settled exactly once, before the client can send its next attempt.
        if let Some(charges) = ctx.charges.take() {
            let settlement = charges.settle(
                upstream_response.status.as_u16(),
                &crate::service::HttpHeaders(&upstream_response.headers),
            );
            self.settle(settlement).await;
        }
        if let Some(metering) = ctx.metering.as_deref_mut() {
            let content_type = upstream_response
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            metering.status = upstream_response.status.as_u16();
            // Asked for identity, some upstreams (and CDNs) compress anyway: read through it.
            let encoding = upstream_response
                .headers
                .get(http::header::CONTENT_ENCODING)
                .and_then(|v| v.to_str().ok());
            let encoded = crate::request::llm_encoding::coding(encoding).is_some();
            // A body framed by Content-Length cannot end early: it streams whole; an encoded
            // one does not split where its text does.
            let cap = metering.reservation.stream_cap().filter(|_| {
                upstream_response.status.is_success()
                    && !encoded
                    && upstream_response
                        .headers
                        .get(http::header::CONTENT_LENGTH)
                        .is_none()
            });
            let meter = crate::request::llm::ResponseMeter::new(
                content_type,
                self.gateway.config.max_body_bytes.get(),
            )
            .with_cap(cap.map(|c| c.limit()));
            metering.stop = cap.filter(|_| meter.capped()).map(|cap| {
                Box::new(StreamStop {
                    cap,
                    header: None,
                    unsent: std::collections::VecDeque::new(),
                    unsent_from: 0,
                    tail: None,
                })
            });
            metering.meter = Some(crate::request::llm_encoding::BodyMeter::new(
                meter,
                encoding,
                self.gateway.config.max_body_bytes.get(),
            ));
        }
        if let Some(access) = ctx.access.as_deref_mut() {
            access.upstream_secs = access.upstream_started.map(|at| at.elapsed().as_secs_f64());
            match ctx.add_lines.as_mut() {
                Some(lines) => {
                    if let Some(id) = echoed_request_id(access) {
                        lines.push_bytes(&X_REQUEST_ID, id);
                    }
                }
                None => {
                    if let Ok(id) = http::HeaderValue::from_str(&access.request_id) {
                        ctx.add_headers.push((X_REQUEST_ID.clone(), id));
                    }
                }
            }
        }
        if let Some(lines) = ctx.add_lines.take() {
            let rules = ctx.forwarding.rules.as_deref();
            let config = &self.gateway.header_config;
            // A name compare per upstream header, where looking each line's name up in the
            // upstream's map would hash it.
            let ours = |name: &http::HeaderName| {
                crate::engine::headers::may_be_admitted_header(name, config)
                    || *name == X_REQUEST_ID
            };
            if rules.is_none_or(|r| r.response.is_empty())
                && !upstream_response.headers.keys().any(ours)
            {
                // Written after the upstream's headers as they are, through the carried
                // pingora-http's `append_h1_lines_canonical`: no header map work for them.
                upstream_response.append_h1_lines_canonical(lines.into_bytes());
            } else {
                // The route's response rules may read or change them, or the upstream sent a
                // header of the same name (ours replaces it): into the map.
                ctx.put_lines_first(lines);
            }
        }
        if !ctx.add_headers.is_empty() {
            // Straight into the upstream's header map (names parsed once, nothing parsed or
            // allocated again) through the carried pingora-http's `insert_headers_canonical`:
            // the upstream's header names then go out in canonical form (well-known names
            // Title-Case, others lower-case), as Envoy sends them; its reason phrase is kept.
            upstream_response.insert_headers_canonical(std::mem::take(&mut ctx.add_headers));
        }
        if let Some(rules) = ctx
            .forwarding
            .rules
            .as_deref()
            .filter(|r| !r.response.is_empty())
        {
            let (host, _) = super::protocol::host_and_target(session.req_header());
            let vars = crate::request::forwarding::Variables {
                client_addr: ctx.client_ip.or(ctx.peer),
                request_id: ctx
                    .access
                    .as_deref()
                    .map(|a| a.request_id.as_str())
                    .or(ctx.forwarding.request_id.as_deref()),
                host,
            };
            super::forward::to_client(upstream_response, &rules.response, &vars)?;
        }
        if let Some(stop) = ctx.metering.as_mut().and_then(|m| m.stop.as_mut()) {
            stop.header = Some(upstream_response.clone());
        }
        Ok(())
    }

    async fn response_trailer_filter(
        &self,
        _session: &mut Session,
        upstream_trailers: &mut http::HeaderMap,
        ctx: &mut Self::CTX,
    ) -> Result<Option<Bytes>> {
        // Relayed as they came; a gRPC call's status is noted for its log line and metrics. A
        // call cut at a refused message ends with the refusal's status instead.
        if let Some(call) = ctx.grpc.as_deref_mut() {
            call.upstream_ended(upstream_trailers);
            if let Some(cut) = call.cut.take() {
                call.end_cut(*cut, upstream_trailers);
                if let Some(access) = ctx.access.as_deref_mut() {
                    note_cut(access, call);
                }
            }
        }
        Ok(None)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Self::CTX) {
        // The response is done: the connection may now idle until its next request, and the
        // server's slot (with `max_connections`) goes to the next in line.
        ctx.slot = None;
        super::conn::request_done(http2_key(session), self.gateway.config.keepalive_timeout);
        // What is given back or settled awaits the store: boxed, and only when there is any,
        // so this hook's future (moved whole into a box on every request) stays small.
        if ctx.lease.is_some() || ctx.charges.is_some() || ctx.metering.is_some() {
            let settled = Box::pin(self.give_back(session, ctx));
            settled.await;
        }
        let mut trace = ctx.trace.take();
        let grpc_status = ctx
            .grpc
            .as_deref()
            .map(|call| self.grpc_call_done(session, call, trace.as_deref_mut()));
        if let Some(access) = ctx.access.take() {
            let trace_id = trace.as_ref().map(|t| t.trace_id());
            self.write_access_log(session, &access, trace_id.as_deref(), grpc_status);
        }
        if let Some(trace) = trace {
            let status = session.response_written().map_or(0, |r| r.status.as_u16());
            trace.finish(status, e.map(|e| e.etype().as_str()));
        }
    }

    fn suppress_error_log(&self, _session: &Session, ctx: &Self::CTX, e: &Error) -> bool {
        if call_was_cut(ctx) {
            return true;
        }
        // A client's malformed chunked body is the client's error, answered 400: not logged
        // per request (a client could fill the log with them).
        *e.etype() == STREAM_STOPPED
            || *e.etype() == GRPC_CALL_CUT
            || *e.etype() == QUEUE_TIMED_OUT
            || *e.etype() == CLIENT_GONE_WHILE_QUEUED
            || *e.etype() == CLIENT_GONE_WHILE_PACED
            || *e.etype() == INVALID_CHUNK
            || *e.etype() == INVALID_TRAILER_END
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Self::CTX,
    ) -> FailToProxy {
        if *e.etype() == STREAM_STOPPED {
            return finish_stopped_stream(session, ctx).await;
        }
        // A cut call ends with the refusal's status, whatever ended the proxying (the cut
        // itself, or the client resetting its side once it read the status).
        if *e.etype() == GRPC_CALL_CUT || call_was_cut(ctx) {
            let end = Box::pin(finish_cut_call(session, ctx));
            return end.await;
        }
        // A 1xx (100 Continue, 103 Early Hints) is not the response: the error page still goes.
        let final_written = session
            .as_downstream()
            .response_written()
            .is_some_and(|h| !h.status.is_informational() || h.status.as_u16() == 101);
        let error_code = match failure_page(e, ctx, final_written) {
            FailurePage::Closed(code) => code,
            FailurePage::Own {
                status,
                headers,
                body,
            } => {
                let _ = respond(session, status, headers, body).await;
                status
            }
            FailurePage::Pingora(code) => {
                let _ = session.respond_error(code).await;
                code
            }
        };
        FailToProxy {
            error_code,
            can_reuse_downstream: false,
        }
    }
}

/// What the client gets when proxying fails (the connection is closed after it either way).
/// Returned once, never stored: its page's headers stay inline.
#[allow(clippy::large_enum_variant)]
enum FailurePage {
    /// Nothing more: nobody is left to answer, or the response is already under way. The
    /// status is the one logged.
    Closed(u16),
    /// The gateway's own page.
    Own {
        status: u16,
        headers: HeaderList,
        body: &'static str,
    },
    /// Pingora's error page for the status.
    Pingora(u16),
}

/// The page for a failure `e`, when the final response header was (`final_written`) or was not
/// yet written; warns of the upstream's failures.
fn failure_page(e: &Error, ctx: &RequestCtx, final_written: bool) -> FailurePage {
    if *e.etype() == CLIENT_GONE_WHILE_QUEUED || *e.etype() == CLIENT_GONE_WHILE_PACED {
        // Nobody to answer: logged as nginx's 499 (client closed request).
        return FailurePage::Closed(499);
    }
    let code = match e.etype() {
        pingora::ErrorType::HTTPStatus(code) => *code,
        // The upstream took the request and did not answer within its read timeout: a
        // gateway timeout (nginx's and Envoy's answer too), not an unavailable upstream.
        pingora::ErrorType::ReadTimedout if e.esource() == &pingora::ErrorSource::Upstream => 504,
        _ => match e.esource() {
            pingora::ErrorSource::Upstream => 502,
            pingora::ErrorSource::Downstream => 0,
            _ => 500,
        },
    };
    if final_written {
        // The response is already under way: an error page now would be read as the rest
        // of its body. The connection is closed instead, so the client sees the body end
        // short of its length (or an HTTP/2 stream reset) and knows it is incomplete.
        // Pingora's error text may quote the upstream's or the client's bytes.
        tracing::warn!(error = %crate::telemetry::log_line::value(&e.to_string()), "upstream failed mid-response: the client connection is closed");
        return FailurePage::Closed(code);
    }
    let own = |status, headers, body| FailurePage::Own {
        status,
        headers,
        body,
    };
    if (*e.etype() == INVALID_CHUNK || *e.etype() == INVALID_TRAILER_END)
        && e.esource() == &pingora::ErrorSource::Downstream
    {
        // The client's own framing error: no upstream is at fault, nothing to warn about.
        return own(
            400,
            request_id_header(ctx),
            "Bad Request: the request body's chunked framing is invalid\n",
        );
    }
    if *e.etype() == QUEUE_TIMED_OUT {
        let mut headers = request_id_header(ctx);
        headers.push((
            http::header::RETRY_AFTER,
            http::HeaderValue::from(super::queue::RETRY_AFTER_SECS),
        ));
        return own(
            503,
            headers,
            "Service Unavailable: the upstream server is at its connection limit\n",
        );
    }
    if *e.etype() == NO_HEALTHY_UPSTREAM {
        let group = ctx.group.as_ref().map_or("", |g| g.spec.name.as_str());
        tracing::warn!(group, "no healthy server in the upstream group");
        return own(
            502,
            request_id_header(ctx),
            "Bad Gateway: no healthy server in this route's upstream group\n",
        );
    }
    let (what, body) = match code {
        0 => return FailurePage::Closed(0),
        504 => (
            "upstream timed out",
            "Gateway Timeout: the upstream did not answer in time\n",
        ),
        502 => (
            "upstream unavailable",
            "Bad Gateway: the upstream is unavailable\n",
        ),
        _ => return FailurePage::Pingora(code),
    };
    tracing::warn!(error = %crate::telemetry::log_line::value(&e.to_string()), "{what}");
    own(code, request_id_header(ctx), body)
}

/// Ends a stopped stream: the header if Pingora had not written it yet, the body bytes the
/// client has not had, the closing events, and the end of the body (a complete response: the
/// last chunk on HTTP/1.1, END_STREAM on HTTP/2). The connection is then closed.
async fn finish_stopped_stream(session: &mut Session, ctx: &mut RequestCtx) -> FailToProxy {
    let status = ctx.metering.as_ref().map_or(200, |m| m.status);
    if let Some(stop) = ctx.metering.as_mut().and_then(|m| m.stop.as_mut()) {
        let header = stop.header.take();
        if let (Some(tail), Some(header)) = (stop.tail.take(), header) {
            // A 1xx (100 Continue, 103 Early Hints) written before does not count: the final
            // header may be in the batch that was dropped.
            let header_written = session
                .response_written()
                .is_some_and(|h| !h.status.is_informational());
            let header_ok = header_written
                || session
                    .write_response_header(Box::new(header), false)
                    .await
                    .is_ok();
            if header_ok {
                let _ = session.write_response_body(Some(tail), true).await;
            }
        }
    }
    FailToProxy {
        error_code: status,
        can_reuse_downstream: false,
    }
}

const TEXT: &str = "text/plain; charset=utf-8";

/// The request ID as a response echoes it: only when `HeaderValue::from_str` would take it
/// (visible ASCII, space and tab), on every path, lines or list.
fn echoed_request_id(access: &AccessCtx) -> Option<&[u8]> {
    let id = access.request_id.as_bytes();
    id.iter()
        .all(|&b| (0x20..0x7f).contains(&b) || b == b'\t')
        .then_some(id)
}

/// Pingora's retry buffer: a body up to this size read before deciding is replayed to the
/// upstream by Pingora itself.
const RETRY_BUFFER_BYTES: usize = 64 * 1024;

/// Largest request body read before deciding for `loop_detection` fingerprints alone (larger
/// ones stream and have no hash).
const FINGERPRINTED_BODY_BYTES: usize = RETRY_BUFFER_BYTES;

/// The upstream continues this trace: the client's own context (kept or not) is replaced in
/// `req` by the upstream call's.
fn write_trace_context(trace: &mut crate::telemetry::traces::RequestSpan, req: &mut RequestHeader) {
    req.remove_header(&crate::telemetry::traces::TRACESTATE.0);
    trace.inject_upstream(&mut |name, wire, value| {
        req.insert_header_parsed(name, wire, value);
    });
}

/// Reads a whole request body of at most `limit` bytes before deciding, so that Pingora can
/// still send it upstream: its retry buffer (64 KiB) is switched on for the last 64 KiB of a
/// body of known length, and `request_body_filter` puts the whole body in place of that tail.
/// A chunked body over 64 KiB cannot be replayed (its end is only known once read), so it is
/// refused with 411; one over `limit`, with 413 (a declared one before any byte is read).
///
/// # Errors
/// The status and JSON body to answer with.
async fn read_whole_body(
    session: &mut Session,
    limit: usize,
) -> std::result::Result<Bytes, (u16, &'static str)> {
    let declared = super::protocol::declared_length(session.req_header());
    if declared.is_some_and(|n| n > limit) {
        return Err((413, crate::request::llm::BODY_TOO_LARGE));
    }
    if session.is_body_empty() {
        return Ok(Bytes::new());
    }
    // The decision needs the body: a client waiting for `100 Continue` gets it first.
    if super::protocol::expects_continue(session.req_header()) {
        let answer = Box::pin(super::protocol::continue_if_expected(session));
        if answer.await.is_err() {
            return Err((400, BODY_BROKEN));
        }
    }
    let mut body = bytes::BytesMut::with_capacity(declared.unwrap_or(0));
    loop {
        if declared.is_none_or(|n| n.saturating_sub(body.len()) <= RETRY_BUFFER_BYTES) {
            session.enable_retry_buffering();
        }
        match session.read_request_body().await {
            Ok(Some(chunk)) if body.len() + chunk.len() <= limit => body.extend_from_slice(&chunk),
            Ok(Some(_)) => return Err((413, crate::request::llm::BODY_TOO_LARGE)),
            Ok(None) => break,
            Err(_) => return Err((400, BODY_BROKEN)),
        }
    }
    if body.len() > RETRY_BUFFER_BYTES && session.get_retry_buffer().is_none() {
        return Err((411, crate::request::llm::LENGTH_REQUIRED));
    }
    Ok(body.freeze())
}

/// The 400 body for a request body that broke off before its end.
const BODY_BROKEN: &str = r#"{"error":{"message":"The request body ended before its declared length.","type":"invalid_request_error","param":null,"code":"incomplete_body"}}"#;

/// Reads and hashes a request body that declares a `Content-Length` of at most
/// [`FINGERPRINTED_BODY_BYTES`], keeping it in Pingora's retry buffer so the upstream still
/// receives it. Other bodies (chunked, larger, none) are left to stream and have no hash.
async fn read_small_body(session: &mut Session) -> Option<u64> {
    let length = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())?;
    if length == 0 || length > FINGERPRINTED_BODY_BYTES {
        return None;
    }
    // The decision needs the body: a client waiting for `100 Continue` gets it first.
    if super::protocol::expects_continue(session.req_header()) {
        let answer = Box::pin(super::protocol::continue_if_expected(session));
        answer.await.ok()?;
    }
    session.enable_retry_buffering();
    let mut hasher = crate::request::descriptor::BodyHasher::default();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => hasher.update(&chunk),
            Ok(None) => break,
            // A client that fails mid-body gets no fingerprint; the proxy reports the error
            // when it reads on.
            Err(_) => return None,
        }
    }
    hasher.finish()
}
