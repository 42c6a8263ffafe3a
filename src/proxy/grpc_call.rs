//! gRPC calls through the reverse proxy. A request whose content type is gRPC's (also `+proto`,
//! `+json`, gRPC-Web) is a call ([`GrpcCall`]):
//!
//! - the gateway's own answers to it (refusals, no route, a body or header block too large)
//!   are gRPC answers, trailers-only: HTTP 200 and one header block ending the stream with
//!   `grpc-status`, `grpc-message` and `grpc-status-details-bin` (a `google.rpc.Status` with
//!   `RetryInfo` and `QuotaFailure`, [`crate::engine::grpc_status`]), so that clients read a
//!   spent limit as `RESOURCE_EXHAUSTED` and wait as told instead of retrying at once;
//! - the status the upstream ends the call with is read from its trailers, or from a
//!   trailers-only header, for the access log, the metrics and the trace;
//! - when the bundle counts messages (`grpc:message`), each request message is decided as its
//!   prefix arrives ([`MessageGate`]): messages before the first refused one go upstream
//!   exactly once, it and everything after it never do, and the call ends with
//!   `RESOURCE_EXHAUSTED` in its trailers.

use crate::engine::grpc_status::{message_of, GrpcCode, GrpcRefusal};
use crate::engine::headers::HeaderList;
use crate::engine::Reason;
use crate::request::grpc::{MessageStarts, Step};
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};

pub static GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
pub static GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");
pub static GRPC_STATUS_DETAILS: http::HeaderName =
    http::HeaderName::from_static("grpc-status-details-bin");

/// A gRPC call in flight.
pub struct GrpcCall {
    /// The request's content type, which the gateway's own answers carry back.
    content_type: http::HeaderValue,
    /// The client speaks HTTP/1.1 (gRPC-Web): an own answer needs `Content-Length: 0`.
    http1: bool,
    /// Why the gateway refused it, and the rule that did.
    pub refused: Option<(Reason, Option<String>)>,
    /// The per-message gate, when the bundle counts messages.
    pub gate: Option<MessageGate>,
    /// The refusal of a request message that cut the call, until the call is ended.
    pub cut: Option<Box<CutRefusal>>,
    /// The call's final status: the upstream's, or the gateway's own.
    pub status: Option<GrpcCode>,
    /// The status number as the upstream wrote it (any code, also ones the gateway never
    /// writes itself).
    pub upstream_status: Option<u16>,
}

impl GrpcCall {
    /// The call `req` is, if its content type is gRPC's; with a gate when messages are counted
    /// (asked only of a call).
    pub fn of(
        req: &RequestHeader,
        http1: bool,
        counts_messages: impl FnOnce() -> bool,
    ) -> Option<Box<GrpcCall>> {
        let content_type = req.headers.get(http::header::CONTENT_TYPE)?;
        if !crate::request::grpc::is_grpc_content_type(content_type.as_bytes()) {
            return None;
        }
        Some(Box::new(GrpcCall {
            content_type: content_type.clone(),
            http1,
            refused: None,
            gate: counts_messages().then(MessageGate::default),
            cut: None,
            status: None,
            upstream_status: None,
        }))
    }

    /// The gateway's own answer of HTTP `status` (with `headers` and the HTTP `body` it would
    /// have had) as a trailers-only gRPC answer.
    pub fn own_answer(
        &mut self,
        status: u16,
        headers: HeaderList,
        body: Option<&str>,
    ) -> ResponseHeader {
        let refusal = self.refusal(status, &headers, body);
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.headers.reserve(headers.len() + 4);
        for (name, value) in headers {
            parts.headers.append(name, value);
        }
        parts
            .headers
            .insert(http::header::CONTENT_TYPE, self.content_type.clone());
        write_status(&mut parts.headers, &refusal);
        if self.http1 {
            parts
                .headers
                .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(0));
        }
        ResponseHeader::from(parts)
    }

    /// What the gateway's answer of HTTP `status` says to a gRPC client.
    fn refusal(&mut self, status: u16, headers: &HeaderList, body: Option<&str>) -> GrpcRefusal {
        let reason = self.refused.as_ref().map(|(reason, _)| *reason);
        let code = reason.map_or_else(|| GrpcCode::of_status(status), GrpcCode::of_reason);
        self.status = Some(code);
        let retry_after_secs = headers
            .iter()
            .find(|(name, _)| name == http::header::RETRY_AFTER)
            .and_then(|(_, v)| v.to_str().ok()?.trim().parse().ok());
        GrpcRefusal {
            code,
            message: message_of(body, reason),
            retry_after_secs,
            rule: self.refused.as_ref().and_then(|(_, rule)| rule.clone()),
        }
    }

    /// Ends a call cut by the refused message `cut`: its status, message and details go in
    /// `trailers` (the upstream's, replacing its own status, or new ones).
    pub fn end_cut(&mut self, cut: CutRefusal, trailers: &mut http::HeaderMap) {
        self.refused = Some((cut.reason, cut.rule));
        let refusal = self.refusal(429, &cut.headers, cut.body);
        trailers.remove(&GRPC_STATUS_DETAILS);
        trailers.remove(&GRPC_MESSAGE);
        write_status(trailers, &refusal);
    }

    /// A trailers-only answer carrying `trailers` (a call cut before any response).
    pub fn own_answer_with(&self, trailers: http::HeaderMap) -> ResponseHeader {
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.headers = trailers;
        parts
            .headers
            .insert(http::header::CONTENT_TYPE, self.content_type.clone());
        if self.http1 {
            parts
                .headers
                .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(0));
        }
        ResponseHeader::from(parts)
    }

    /// The trailers of a cut call as gRPC-Web writes them over HTTP/1.1: a body frame flagged
    /// 0x80 holding `name:value` lines.
    pub fn web_trailer_frame(trailers: &http::HeaderMap) -> Bytes {
        let mut text = Vec::new();
        for (name, value) in trailers {
            text.extend_from_slice(name.as_str().as_bytes());
            text.push(b':');
            text.extend_from_slice(value.as_bytes());
            text.extend_from_slice(b"\r\n");
        }
        let mut frame = Vec::with_capacity(5 + text.len());
        frame.push(0x80);
        frame.extend_from_slice(&u32::try_from(text.len()).unwrap_or(u32::MAX).to_be_bytes());
        frame.extend_from_slice(&text);
        Bytes::from(frame)
    }

    /// Whether the client speaks gRPC-Web over HTTP/1.1 (trailers travel in the body).
    pub fn is_http1(&self) -> bool {
        self.http1
    }

    /// Notes the status the upstream ended the call with (from `headers`: its trailers, or a
    /// trailers-only header).
    pub fn upstream_ended(&mut self, headers: &http::HeaderMap) {
        if let Some(n) = headers
            .get(&GRPC_STATUS)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u16>().ok())
        {
            self.upstream_status = Some(n);
        }
    }

    /// The call's final status number: the gateway's own when it answered, else the
    /// upstream's.
    pub fn status_number(&self) -> Option<u16> {
        self.status
            .map(|c| u16::from(c.number()))
            .or(self.upstream_status)
    }
}

/// For the decision service: a refusal of a described gRPC call keeps its HTTP status (its
/// callers read any 2xx as "forward it") and carries, for the gateway in front to answer the
/// client with, `grpc-status`, `grpc-message` and `grpc-status-details-bin`, as the proxy's own
/// trailers-only answer would.
pub fn add_refusal_fields(
    headers: &mut HeaderList,
    status: u16,
    reason: Reason,
    rule: Option<&str>,
    body: Option<&str>,
) {
    let mut call = GrpcCall {
        content_type: http::HeaderValue::from_static("application/grpc"),
        http1: false,
        refused: Some((reason, rule.map(str::to_string))),
        gate: None,
        cut: None,
        status: None,
        upstream_status: None,
    };
    let refusal = call.refusal(status, headers, body);
    let mut fields = http::HeaderMap::with_capacity(3);
    write_status(&mut fields, &refusal);
    for (name, value) in fields {
        if let Some(name) = name {
            headers.push((name, value));
        }
    }
}

/// The decision that refused a request message: what ends the call.
pub struct CutRefusal {
    pub reason: Reason,
    pub rule: Option<String>,
    /// The refusal's headers (`Retry-After`, the rate-limit headers).
    pub headers: HeaderList,
    pub body: Option<&'static str>,
}

/// `grpc-status`, `grpc-message` and `grpc-status-details-bin` of `refusal`.
fn write_status(headers: &mut http::HeaderMap, refusal: &GrpcRefusal) {
    headers.insert(
        GRPC_STATUS.clone(),
        http::HeaderValue::from(u16::from(refusal.code.number())),
    );
    if let Ok(v) = http::HeaderValue::from_str(&refusal.message_header()) {
        headers.insert(GRPC_MESSAGE.clone(), v);
    }
    if let Ok(v) = http::HeaderValue::from_str(&refusal.details_bin()) {
        headers.insert(GRPC_STATUS_DETAILS.clone(), v);
    }
}

/// Decides a call's request messages as they arrive.
#[derive(Default)]
pub struct MessageGate {
    starts: MessageStarts,
    /// A message was refused: nothing more goes upstream.
    pub cut: bool,
    /// The request stream to the upstream was ended after the cut.
    pub closed: bool,
}

/// What to do with a piece of the request body.
pub enum Gate<R> {
    /// Pass on this (all the piece's messages were admitted; a cut prefix may be held back).
    Pass(Bytes),
    /// Pass on this (the messages before the refused one), then end the call: the refusal.
    Cut(Bytes, R),
}

impl MessageGate {
    /// Passes `piece` through the gate, asking `refuse` about each message that begins in it
    /// (in order; `None`: the message may go upstream, else why not). At the end of the body,
    /// bytes held back from a cut prefix go on as they are (the upstream reads a truncated
    /// message as the client sent it).
    pub async fn pass<R, F, Fut>(
        &mut self,
        piece: &[u8],
        end_of_body: bool,
        mut refuse: F,
    ) -> Gate<R>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<R>>,
    {
        let data = Bytes::from(self.starts.join(piece));
        let mut at = 0;
        loop {
            match self.starts.step(&data, &mut at) {
                Step::Message { start } => {
                    if let Some(refusal) = refuse().await {
                        self.cut = true;
                        return Gate::Cut(data.slice(..start), refusal);
                    }
                }
                Step::End { pass_to } => {
                    let pass_to = if end_of_body { data.len() } else { pass_to };
                    if end_of_body {
                        let _ = self.starts.join(&[]);
                    }
                    return Gate::Pass(data.slice(..pass_to));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;
    use prost::Message as _;

    fn call(content_type: &str, http1: bool) -> Box<GrpcCall> {
        let mut req = RequestHeader::build("POST", b"/pkg.Svc/Do", None).unwrap();
        req.insert_header("content-type", content_type).unwrap();
        GrpcCall::of(&req, http1, || true).unwrap()
    }

    #[test]
    fn only_grpc_content_types_are_calls() {
        let mut req = RequestHeader::build("POST", b"/pkg.Svc/Do", None).unwrap();
        req.insert_header("content-type", "application/json")
            .unwrap();
        assert!(GrpcCall::of(&req, false, || false).is_none());
        assert!(call("application/grpc+proto", false).gate.is_some());
    }

    /// A refusal by a rule: 200, `grpc-status: 8`, the details with the delay and the rule,
    /// the rate-limit headers kept; gRPC-Web over HTTP/1.1 gets `Content-Length: 0`.
    #[test]
    fn a_refusal_is_a_trailers_only_answer() {
        let mut c = call("application/grpc", false);
        c.refused = Some((Reason::TokenBucketExceeded, Some("per-method".into())));
        let mut headers = HeaderList::new();
        headers.push((
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("3"),
        ));
        let answer = c.own_answer(429, headers, Some("Too Many Requests"));
        assert_eq!(answer.status, 200);
        assert_eq!(answer.headers["grpc-status"], "8");
        assert_eq!(answer.headers["grpc-message"], "Too Many Requests");
        assert_eq!(answer.headers["retry-after"], "3");
        assert_eq!(answer.headers["content-type"], "application/grpc");
        assert!(answer.headers.get("content-length").is_none());
        let bin = answer.headers["grpc-status-details-bin"].to_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(bin)
            .unwrap();
        let status = crate::engine::grpc_status::RpcStatus::decode(bytes.as_slice()).unwrap();
        assert_eq!(status.code, 8);
        assert_eq!(status.details.len(), 2);
        assert_eq!(c.status_number(), Some(8));
        // No route, for gRPC-Web over HTTP/1.1.
        let mut web = call("application/grpc-web+proto", true);
        let answer = web.own_answer(404, HeaderList::new(), Some("Not Found: no route"));
        assert_eq!(answer.headers["grpc-status"], "12");
        assert_eq!(answer.headers["content-length"], "0");
        assert_eq!(answer.headers["content-type"], "application/grpc-web+proto");
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Two messages admitted, the third refused: the first two pass exactly once, nothing of
    /// the third does, whatever the pieces.
    #[tokio::test]
    async fn the_gate_cuts_at_the_first_refused_message() {
        let body: Vec<u8> = [frame(b"one"), frame(b"two"), frame(b"three")].concat();
        for size in 1..=body.len() {
            let mut gate = MessageGate::default();
            let mut asked = 0;
            let mut passed = Vec::new();
            for piece in body.chunks(size) {
                let out = gate
                    .pass(piece, false, || {
                        asked += 1;
                        let refused = (asked > 2).then_some(asked);
                        async move { refused }
                    })
                    .await;
                match out {
                    Gate::Pass(b) => passed.extend_from_slice(&b),
                    Gate::Cut(b, refusal) => {
                        assert_eq!(refusal, 3);
                        passed.extend_from_slice(&b);
                        break;
                    }
                }
            }
            assert!(gate.cut, "pieces of {size}");
            assert_eq!(asked, 3);
            assert_eq!(passed, [frame(b"one"), frame(b"two")].concat(), "{size}");
        }
    }
}
