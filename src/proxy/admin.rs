//! The admin listener: `POST /v1/decision` (nginx `auth_request`, or any gateway describing the
//! original request in `X-Original-Method/URI/Host`), `/v1/decision/<original path>` for Envoy
//! `ext_authz` (method and path are the original ones), `POST /v1/release` (concurrency slots),
//! `POST /v1/usage` (an LLM reservation's real usage), `/livez`, `/readyz`, `/metrics`, and the
//! operator endpoints behind `--admin-token` or `--admin-tokens-file`, each needing its scope
//! (`/v1/buckets/{bucket}`, `POST /v1/explain`, `/v1/top`, `/status`, `/v1/overrides`,
//! `GET /v1/usage`; see [`crate::operator`]).

use crate::engine::headers::HeaderList;
use crate::service::{Answer, Gateway};
use crate::store::lease::Lease;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use std::sync::Arc;

pub struct Admin {
    gateway: Arc<Gateway>,
}

impl Admin {
    pub fn new(gateway: Arc<Gateway>) -> Self {
        Admin { gateway }
    }
}

fn reply(
    status: u16,
    content_type: &'static str,
    headers: HeaderList,
    body: impl Into<Vec<u8>>,
) -> Response<Vec<u8>> {
    reply_with(status, content_type, headers, body.into())
}

fn reply_with(
    status: u16,
    content_type: &'static str,
    headers: HeaderList,
    body: Vec<u8>,
) -> Response<Vec<u8>> {
    let mut response = Response::new(Vec::new());
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let map = response.headers_mut();
    map.reserve(headers.len() + 2);
    map.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    map.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(body.len()),
    );
    for (name, value) in headers {
        map.append(name, value);
    }
    *response.body_mut() = body;
    response
}

fn allow(methods: &'static str) -> HeaderList {
    smallvec::smallvec![(http::header::ALLOW, http::HeaderValue::from_static(methods))]
}

const TEXT: &str = "text/plain; charset=utf-8";
const JSON: &str = "application/json";

fn no_policy() -> Response<Vec<u8>> {
    reply(
        503,
        TEXT,
        HeaderList::new(),
        "Service Unavailable: no policy loaded\n",
    )
}

/// The lease token of a decision that took concurrency slots.
static LEASE_HEADER: http::HeaderName = http::HeaderName::from_static("x-tollgate-lease");
/// Seconds after which the slots free themselves.
static LEASE_TTL_HEADER: http::HeaderName = http::HeaderName::from_static("x-tollgate-lease-ttl");
/// An LLM reservation's token, for `/v1/usage`, and the tokens it holds.
static RESERVATION_HEADER: http::HeaderName =
    http::HeaderName::from_static(crate::proxy::grpc::RESERVATION_HEADER);
static RESERVED_TOKENS_HEADER: http::HeaderName =
    http::HeaderName::from_static(crate::proxy::grpc::RESERVED_TOKENS_HEADER);

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        // The header is in: no deadline while this request is answered; the connection may
        // then idle until its next one, as on the proxy listener.
        super::conn::header_parsed();
        let response = self.answer(session).await;
        super::conn::response_done(self.gateway.config.keepalive_timeout);
        response
    }
}

impl Admin {
    /// One request: an operator endpoint, a decision whose body an LLM rule reads (or a usage
    /// report), or anything else with its body read past (and fingerprinted when a policy
    /// asks).
    async fn answer(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        // Requests pipelined behind this one are answered in order.
        session.set_pipelining_enabled(true);
        if let Some(route) = OperatorRoute::of(session.req_header().uri.path()) {
            return self.operator(session, route).await;
        }
        // `GET /v1/usage` is the usage export; `POST /v1/usage` stays the decision service's
        // LLM usage report.
        if session.req_header().uri.path() == "/v1/usage"
            && session.req_header().method == http::Method::GET
        {
            return self.operator(session, OperatorRoute::Usage).await;
        }
        // `token_bucket_llm` rules read the original body (Envoy's HTTP ext_authz sends it with
        // `with_request_body`; other callers may POST it), bounded; `/v1/usage` is a report.
        let path = session.req_header().uri.path();
        let usage = path == "/v1/usage";
        let metered = self.gateway.meters_tokens()
            && (path.starts_with("/v1/decision/")
                || (path == "/v1/decision" && session.req_header().method == http::Method::POST));
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|sa| sa.ip());
        if metered || usage {
            return self.answer_with_body(session, peer, usage).await;
        }
        let body_hash = self.read_past_body(session).await;
        // Under a bundle that paces, a decision may wait for its turn: a caller that hangs up
        // meanwhile (its own timeout, its client gone) gives the request's tokens back.
        let fd = session
            .stream()
            .map(|s| pingora::protocols::UniqueID::id(s.as_ref()))
            .filter(|fd| *fd > 0 && self.gateway.paces());
        let answer = self.route(session.req_header(), peer, body_hash);
        let Some(fd) = fd else {
            return answer.await;
        };
        tokio::pin!(answer);
        tokio::select! {
            response = &mut answer => response,
            () = super::conn::gone(fd, super::gateway::PACED_GONE_POLL) => {
                reply(499, TEXT, HeaderList::new(), "Client Closed Request\n")
            }
        }
    }

    /// A usage report, or a decision an LLM rule needs the body of: the body read whole,
    /// bounded by `--max-body-bytes`.
    async fn answer_with_body(
        &self,
        session: &mut ServerSession,
        peer: Option<std::net::IpAddr>,
        usage: bool,
    ) -> Response<Vec<u8>> {
        let Some(body) = read_bounded(session, self.gateway.config.max_body_bytes.get()).await
        else {
            if usage || self.gateway.enforces_tokens() {
                return reply(
                    413,
                    JSON,
                    HeaderList::new(),
                    crate::request::llm::BODY_TOO_LARGE,
                );
            }
            // Shadow rules alone refuse nothing: the rest is read past (not kept) and
            // the decision made without the prompt.
            let _ = session.drain_request_body().await;
            return self.decision(session.req_header(), peer, None, None).await;
        };
        if usage {
            return self.usage(session, &body).await;
        }
        let body_hash = crate::request::descriptor::body_hash(&body);
        let llm =
            crate::request::llm::LlmRequest::parse_with(&body, self.gateway.tiktoken_encodings());
        self.decision(session.req_header(), peer, body_hash, Some(&llm))
            .await
    }

    /// Reads any body so the connection can be reused; hashed when a policy fingerprints
    /// bodies (Envoy's HTTP ext_authz sends the original body with `with_request_body`).
    async fn read_past_body(&self, session: &mut ServerSession) -> Option<u64> {
        if self.gateway.fingerprints_bodies() {
            let mut hasher = crate::request::descriptor::BodyHasher::default();
            while let Ok(Some(chunk)) = session.read_request_body().await {
                hasher.update(&chunk);
            }
            hasher.finish()
        } else {
            let _ = session.drain_request_body().await;
            None
        }
    }

    /// The endpoint for the request's method and path (its body already read).
    async fn route(
        &self,
        req: &pingora::http::RequestHeader,
        peer: Option<std::net::IpAddr>,
        body_hash: Option<u64>,
    ) -> Response<Vec<u8>> {
        let method = req.method.as_str();
        let path = req.uri.path();
        match path {
            "/livez" | "/readyz" | "/metrics" if method != "GET" && method != "HEAD" => {
                reply(405, TEXT, allow("GET, HEAD"), "Method Not Allowed\n")
            }
            "/livez" => reply(200, TEXT, HeaderList::new(), "ok"),
            "/readyz" => {
                let (status, body) = self.gateway.readiness();
                reply(status, "application/json", HeaderList::new(), body)
            }
            "/metrics" => reply(
                200,
                "text/plain; version=0.0.4",
                HeaderList::new(),
                self.gateway.metrics_text(),
            ),
            "/v1/decision" if method != "POST" => {
                reply(405, TEXT, allow("POST"), "Method Not Allowed: use POST\n")
            }
            "/v1/release" if method != "POST" => {
                reply(405, TEXT, allow("POST"), "Method Not Allowed: use POST\n")
            }
            "/v1/release" => self.release(req).await,
            "/v1/usage" => reply(405, TEXT, allow("POST"), "Method Not Allowed: use POST\n"),
            "/v1/debug/session" | "/v1/debug/logout" => self.debug_session(req, path, peer),
            _ if path == "/v1/decision" || path.starts_with("/v1/decision/") => {
                self.decision(req, peer, body_hash, None).await
            }
            _ => reply(404, TEXT, HeaderList::new(), "Not Found\n"),
        }
    }

    /// `POST /v1/release`: gives back the concurrency slots of the lease its header names.
    async fn release(&self, req: &pingora::http::RequestHeader) -> Response<Vec<u8>> {
        let token = req
            .headers
            .get(&LEASE_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(Lease::from_token);
        match token {
            Some(lease) => {
                self.gateway.release(&lease).await;
                reply(204, TEXT, HeaderList::new(), "")
            }
            None => reply(
                400,
                TEXT,
                HeaderList::new(),
                "Bad Request: send the X-Tollgate-Lease header of the decision to release\n",
            ),
        }
    }
}

impl Admin {
    /// `POST /v1/debug/session` and `POST /v1/debug/logout` (`--compat fairvisor` with
    /// `--debug-session-secret`; 404 otherwise, as Fairvisor answers). A client with too many
    /// failed logins gets 429 with `Retry-After`; logout ends the session its cookie names. With
    /// `--admin-tokens-file` a login also needs a token holding `debug`; a session opened is
    /// recorded in the audit trail.
    fn debug_session(
        &self,
        req: &pingora::http::RequestHeader,
        path: &str,
        peer: Option<std::net::IpAddr>,
    ) -> Response<Vec<u8>> {
        use crate::service::DebugLogin;
        if !self.gateway.debug_sessions.on() {
            return reply(404, TEXT, HeaderList::new(), "Not Found\n");
        }
        if req.method != http::Method::POST {
            return reply(405, TEXT, allow("POST"), "Method Not Allowed: use POST\n");
        }
        let set_cookie = |value: &str| match http::HeaderValue::from_str(value) {
            Ok(value) => reply(
                204,
                TEXT,
                smallvec::smallvec![(http::header::SET_COOKIE, value)],
                "",
            ),
            Err(_) => reply(500, TEXT, HeaderList::new(), "Internal Server Error\n"),
        };
        if path == "/v1/debug/logout" {
            let cookie = req
                .headers
                .get(http::header::COOKIE)
                .and_then(|v| v.to_str().ok());
            self.gateway.debug_sessions.logout(cookie);
            return set_cookie(crate::engine::compat::CLOSE_COOKIE);
        }
        // With --admin-tokens-file, opening a session also needs a token holding `debug`.
        let mut token_id = None;
        if self.gateway.config.admin_tokens_file.is_some() {
            use crate::operator::endpoints::{self, Access, Reply};
            let authorization = req
                .headers
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes());
            let scope = crate::operator::Scope::Debug;
            match endpoints::admin_access(&self.gateway, authorization, scope) {
                Access::Granted(id) => token_id = Some(id),
                Access::Forbidden(id) => return operator_reply(Reply::forbidden(&id, scope)),
                Access::Unauthorized | Access::NotEnabled => {
                    return operator_reply(Reply::unauthorized(false))
                }
            }
        }
        let client = self.gateway.client_ip(peer, &req.headers, false);
        match self.gateway.debug_sessions.login(client, &req.headers) {
            DebugLogin::Opened(cookie) => {
                let expires_at = self.gateway.clock.unix_secs().max(0) as u64
                    + crate::engine::compat::SESSION_SECS;
                let caller = crate::telemetry::audit::Caller { token_id, client };
                self.gateway.audit.record(
                    &caller,
                    crate::telemetry::audit::Action::DebugOpen,
                    "debug_session",
                    &serde_json::Value::Null,
                    &serde_json::json!({
                        "expires_at": crate::limits::clock::rfc3339_seconds(expires_at)
                    }),
                );
                set_cookie(&cookie)
            }
            DebugLogin::Refused => reply(
                403,
                JSON,
                HeaderList::new(),
                "{\"error\":\"debug_secret_invalid\"}",
            ),
            DebugLogin::Throttled { retry_after_secs } => reply(
                429,
                JSON,
                smallvec::smallvec![(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from(retry_after_secs)
                )],
                "{\"error\":\"too_many_attempts\"}",
            ),
            DebugLogin::Off => reply(404, TEXT, HeaderList::new(), "Not Found\n"),
        }
    }
}

/// Reads a request body of at most `limit` bytes; `None` when it is larger (nothing more is
/// read) or breaks off.
async fn read_bounded(session: &mut ServerSession, limit: usize) -> Option<Vec<u8>> {
    let declared = super::protocol::declared_length(session.req_header());
    if declared.is_some_and(|n| n > limit) {
        return None;
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0));
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) if body.len() + chunk.len() <= limit => body.extend_from_slice(&chunk),
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) => return Some(body),
        }
    }
}

impl Admin {
    /// A decision: its headers, its refusal body, and what the caller must give back later
    /// (concurrency slots on `/v1/release`, an LLM reservation's usage on `/v1/usage`).
    async fn decision(
        &self,
        req: &pingora::http::RequestHeader,
        peer: Option<std::net::IpAddr>,
        body_hash: Option<u64>,
        llm: Option<&crate::request::llm::LlmRequest>,
    ) -> Response<Vec<u8>> {
        let Some(telemetry) = self.gateway.telemetry() else {
            return self.decision_traced(req, peer, body_hash, llm, None).await;
        };
        // The caller's context (nginx's subrequest and Envoy's HTTP ext_authz pass the
        // client's headers on), as `--trace-context` allows for the calling peer.
        let trusted = peer
            .map(crate::request::descriptor::canonical_ip)
            .is_some_and(|ip| self.gateway.is_trusted_proxy(ip));
        let mut trace = telemetry.decision_call(&req.headers, trusted, req.method.as_str());
        let response = self
            .decision_traced(req, peer, body_hash, llm, Some(&mut trace))
            .await;
        trace.finish(response.status().as_u16(), None);
        response
    }

    async fn decision_traced(
        &self,
        req: &pingora::http::RequestHeader,
        peer: Option<std::net::IpAddr>,
        body_hash: Option<u64>,
        llm: Option<&crate::request::llm::LlmRequest>,
        trace: Option<&mut crate::telemetry::traces::RequestSpan>,
    ) -> Response<Vec<u8>> {
        let answer = self.decide(req, peer, body_hash, llm, trace).await;
        if answer.verdict == crate::service::Verdict::NoPolicy {
            return no_policy();
        }
        let mut response = answer.response;
        // A described gRPC call's refusal also says what its client should read.
        if let Some(reason) = answer.verdict.reason() {
            let grpc = req
                .headers
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|v| crate::request::grpc::is_grpc_content_type(v.as_bytes()));
            if grpc {
                super::grpc_call::add_refusal_fields(
                    &mut response.headers,
                    response.status,
                    reason,
                    answer.verdict.rule(),
                    response.body,
                );
            }
        }
        // Concurrency slots: the caller gives them back on /v1/release when the
        // request is done, or they free themselves after the TTL.
        if let Some(lease) = &answer.lease {
            for (name, value) in [
                (&LEASE_HEADER, lease.token()),
                (&LEASE_TTL_HEADER, lease.ttl_secs.to_string()),
            ] {
                if let Ok(value) = http::HeaderValue::from_str(&value) {
                    response.headers.push((name.clone(), value));
                }
            }
        }
        // LLM tokens: the caller reports the usage on /v1/usage, or the reservation stays
        // charged as reserved after --reservation-ttl-secs.
        if let Some(reservation) = answer.reservation {
            let tokens = reservation.tokens();
            if let Some(token) = self.gateway.tokens.hold(*reservation) {
                for (name, value) in [
                    (&RESERVATION_HEADER, token),
                    (&RESERVED_TOKENS_HEADER, tokens.to_string()),
                ] {
                    if let Ok(value) = http::HeaderValue::from_str(&value) {
                        response.headers.push((name.clone(), value));
                    }
                }
            }
        }
        // An allowed decision has an empty body: nginx's auth_request never reads the
        // subrequest's body, and reuses the connection to tollgate only when there is
        // none (with "OK" every decision cost a new TCP connection).
        let body = response.body.unwrap_or("");
        let content_type = answer.verdict.reason().map_or(TEXT, |r| r.content_type());
        reply(response.status, content_type, response.headers, body)
    }

    /// `POST /v1/usage`: settles a reservation with the tokens really used. The reservation is
    /// the body's `reservation` (or the `X-Tollgate-Reservation` header); the usage is
    /// `total_tokens`, or OpenAI's `usage` object (top level or under `usage`).
    async fn usage(&self, session: &ServerSession, body: &[u8]) -> Response<Vec<u8>> {
        if session.req_header().method != http::Method::POST {
            return reply(405, TEXT, allow("POST"), "Method Not Allowed: use POST\n");
        }
        let bad = |what: &str| {
            reply(
                400,
                TEXT,
                HeaderList::new(),
                format!("Bad Request: {what}\n"),
            )
        };
        let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
            return bad("the body must be JSON: {\"reservation\": \"...\", \"total_tokens\": N} or an OpenAI usage object");
        };
        let token = json
            .get("reservation")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .or_else(|| {
                session
                    .req_header()
                    .headers
                    .get(&RESERVATION_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            });
        let Some(token) = token else {
            return bad(
                "name the reservation (\"reservation\" or the X-Tollgate-Reservation header)",
            );
        };
        let Some(usage) = crate::request::llm::reported_usage(&json) else {
            return bad(
                "report the tokens used: \"total_tokens\", or prompt_tokens and completion_tokens",
            );
        };
        match self
            .gateway
            .tokens
            .report_usage(
                &token,
                (
                    usage.total_tokens,
                    crate::engine::Spent::Tokens(usage.priced()),
                ),
                Some(usage.prompt_tokens).filter(|p| *p > 0),
            )
            .await
        {
            Some(settled) => reply(
                200,
                JSON,
                HeaderList::new(),
                serde_json::to_vec(&settled).unwrap_or_default(),
            ),
            None => reply(
                404,
                TEXT,
                HeaderList::new(),
                "Not Found: no such reservation (already settled, expired, or never made)\n",
            ),
        }
    }

    async fn decide(
        &self,
        req: &pingora::http::RequestHeader,
        peer: Option<std::net::IpAddr>,
        body_hash: Option<u64>,
        llm: Option<&crate::request::llm::LlmRequest>,
        mut trace: Option<&mut crate::telemetry::traces::RequestSpan>,
    ) -> Answer {
        let original = Original::of(req, "/v1/decision", req.method.as_str());
        // The caller is a gateway by role: the client is described by X-Forwarded-For (or,
        // without it, X-Real-IP), rightmost hop that is not a trusted proxy or the caller.
        let client_ip = self.gateway.client_ip(peer, &req.headers, true);
        if let Some(trace) = trace.as_deref_mut() {
            let (path, _) = crate::request::descriptor::split_uri(original.uri);
            trace.described(original.method, path, original.host);
            if let Some(ip) = client_ip {
                trace.client(ip);
            }
        }
        let body = crate::service::DescribedBody {
            hash: body_hash,
            llm,
        };
        // Its network headers only when the operator named the caller (--trusted-proxy).
        let network_trusted = self.gateway.believes_network_headers(peer);
        let mut described = original.described(client_ip, &req.headers, body, network_trusted);
        described.trace = trace.as_deref().map(|t| t.facts());
        let answer = self.gateway.decide_described(&described).await;
        if let (Some(trace), Some(summary)) = (trace, answer.summary.as_deref()) {
            trace.decided(summary);
        }
        answer
    }
}

/// The original request a caller describes: `X-Original-Method/URI/Host`, or Envoy ext_authz's
/// form (the original path after the endpoint's own, with `envoy_method`).
struct Original<'r> {
    method: &'r str,
    uri: &'r str,
    host: Option<&'r str>,
}

impl<'r> Original<'r> {
    fn described(
        &self,
        client_ip: Option<std::net::IpAddr>,
        headers: &'r http::HeaderMap,
        body: crate::service::DescribedBody<'r>,
        network_trusted: bool,
    ) -> crate::service::Described<'r> {
        crate::service::Described {
            method: self.method,
            target: self.uri,
            host: self.host,
            client_ip,
            headers,
            body,
            network_trusted,
            trace: None,
        }
    }

    fn of(req: &'r pingora::http::RequestHeader, endpoint: &str, envoy_method: &'r str) -> Self {
        let h = &req.headers;
        let get = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
        // Envoy ext_authz (HTTP) sends the original method and `path_prefix + original path`.
        let envoy_uri = req
            .uri
            .path_and_query()
            .and_then(|pq| pq.as_str().strip_prefix(endpoint))
            .filter(|rest| rest.starts_with('/'));
        Original {
            method: get("x-original-method").unwrap_or(match envoy_uri {
                Some(_) => envoy_method,
                None => "GET",
            }),
            uri: get("x-original-uri").or(envoy_uri).unwrap_or("/"),
            host: get("x-original-host").or_else(|| get("host")),
        }
    }
}

/// An operator endpoint (behind `--admin-token`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OperatorRoute {
    Buckets,
    Explain,
    Top,
    Status,
    Overrides,
    /// `GET /v1/usage` (routed by its method too: `POST /v1/usage` is a usage report).
    Usage,
}

impl OperatorRoute {
    fn of(path: &str) -> Option<Self> {
        match path {
            "/v1/top" => Some(OperatorRoute::Top),
            "/status" => Some(OperatorRoute::Status),
            "/v1/overrides" => Some(OperatorRoute::Overrides),
            "/v1/explain" => Some(OperatorRoute::Explain),
            p if p.starts_with("/v1/explain/") => Some(OperatorRoute::Explain),
            p if p == "/v1/buckets" || p.starts_with("/v1/buckets/") => {
                Some(OperatorRoute::Buckets)
            }
            _ => None,
        }
    }

    /// The methods it answers.
    fn allowed(self) -> &'static str {
        match self {
            OperatorRoute::Buckets => "GET, DELETE",
            OperatorRoute::Explain => "POST",
            OperatorRoute::Top | OperatorRoute::Status | OperatorRoute::Usage => "GET",
            OperatorRoute::Overrides => "GET, PUT, DELETE",
        }
    }
}

/// Operator answers are never cached (they show live state, and the status page is behind a
/// token).
static NO_STORE: http::HeaderValue = http::HeaderValue::from_static("no-store");
static BEARER_CHALLENGE: http::HeaderValue =
    http::HeaderValue::from_static("Bearer realm=\"tollgate admin\"");

fn operator_reply(reply: crate::operator::endpoints::Reply) -> Response<Vec<u8>> {
    let mut headers: HeaderList =
        smallvec::smallvec![(http::header::CACHE_CONTROL, NO_STORE.clone())];
    if reply.status == 401 {
        headers.push((http::header::WWW_AUTHENTICATE, BEARER_CHALLENGE.clone()));
    }
    // The status page and its sign-in document: no framing, no referrer, only their own script.
    if reply.content_type.starts_with("text/html") {
        for (name, value) in crate::operator::status::page_headers() {
            if let Ok(value) = http::HeaderValue::from_str(value) {
                headers.push((http::HeaderName::from_static(name), value));
            }
        }
    }
    reply_with(reply.status, reply.content_type, headers, reply.body)
}

impl Admin {
    /// An operator endpoint: the token first (nothing is read or looked up without it), then
    /// the method, then the endpoint.
    async fn operator(
        &self,
        session: &mut ServerSession,
        route: OperatorRoute,
    ) -> Response<Vec<u8>> {
        use crate::operator::endpoints::{self, Access, Reply};
        let req = session.req_header();
        let authorization = req
            .headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        // Every operator route has a scope; a method it does not answer reads (then 405).
        let scope = crate::operator::scope_of(req.method.as_str(), req.uri.path())
            .unwrap_or(crate::operator::Scope::Read);
        let token_id = match endpoints::admin_access(&self.gateway, authorization, scope) {
            Access::Granted(id) => id,
            denied => {
                let _ = session.drain_request_body().await;
                return operator_reply(match denied {
                    Access::NotEnabled => Reply::not_enabled(),
                    Access::Forbidden(id) => Reply::forbidden(&id, scope),
                    _ => Reply::unauthorized(route == OperatorRoute::Status),
                });
            }
        };
        let req = session.req_header();
        let method = req.method.clone();
        let allowed = route.allowed();
        if !allowed.split(", ").any(|m| m == method.as_str()) {
            let _ = session.drain_request_body().await;
            return reply(405, TEXT, allow(allowed), "Method Not Allowed\n");
        }
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|sa| sa.ip());
        match route {
            OperatorRoute::Top => {
                let _ = session.drain_request_body().await;
                operator_reply(endpoints::top_reply(
                    &self.gateway,
                    session.req_header().uri.query(),
                ))
            }
            OperatorRoute::Status => {
                let _ = session.drain_request_body().await;
                operator_reply(endpoints::status_reply(&self.gateway))
            }
            OperatorRoute::Usage => {
                let _ = session.drain_request_body().await;
                let query = session.req_header().uri.query();
                operator_reply(crate::operator::usage::usage_reply(&self.gateway, query).await)
            }
            OperatorRoute::Buckets => {
                let _ = session.drain_request_body().await;
                let rest = session
                    .req_header()
                    .uri
                    .path()
                    .strip_prefix("/v1/buckets")
                    .map_or("", |r| r.trim_start_matches('/'))
                    .to_string();
                let caller = crate::telemetry::audit::Caller {
                    token_id: Some(token_id),
                    client: peer,
                };
                operator_reply(if method == http::Method::DELETE {
                    endpoints::reset_bucket(&self.gateway, &rest, &caller).await
                } else {
                    endpoints::inspect_bucket(&self.gateway, &rest).await
                })
            }
            OperatorRoute::Overrides => {
                let caller = crate::telemetry::audit::Caller {
                    token_id: Some(token_id),
                    client: peer,
                };
                self.overrides(session, &method, &caller).await
            }
            OperatorRoute::Explain => {
                // The body as /v1/decision reads it: a prompt for `token_bucket_llm` rules, a
                // fingerprint for `loop_detection`.
                let body = read_bounded(session, self.gateway.config.max_body_bytes.get()).await;
                let Some(body) = body else {
                    return reply(
                        413,
                        JSON,
                        HeaderList::new(),
                        crate::request::llm::BODY_TOO_LARGE,
                    );
                };
                let req = session.req_header();
                let body_hash = if self.gateway.fingerprints_bodies() {
                    crate::request::descriptor::body_hash(&body)
                } else {
                    None
                };
                let llm = self.gateway.meters_tokens().then(|| {
                    crate::request::llm::LlmRequest::parse_with(
                        &body,
                        self.gateway.tiktoken_encodings(),
                    )
                });
                let original = Original::of(req, "/v1/explain", "GET");
                let client_ip = self.gateway.client_ip(peer, &req.headers, true);
                let body = crate::service::DescribedBody {
                    hash: body_hash,
                    llm: llm.as_ref(),
                };
                // The operator (holding the admin token) describes the request whole, its
                // network headers included: explain answers for the client so described.
                let described = original.described(client_ip, &req.headers, body, true);
                operator_reply(endpoints::explain_described(&self.gateway, &described).await)
            }
        }
    }
}

impl Admin {
    /// `/v1/overrides`: `GET` lists, `PUT` sets one from the body (bounded by
    /// `--max-body-bytes`), `DELETE` removes the one its query names.
    async fn overrides(
        &self,
        session: &mut ServerSession,
        method: &http::Method,
        caller: &crate::telemetry::audit::Caller,
    ) -> Response<Vec<u8>> {
        use crate::operator::endpoints;
        if *method == http::Method::PUT {
            let Some(body) = read_bounded(session, self.gateway.config.max_body_bytes.get()).await
            else {
                return reply(
                    413,
                    TEXT,
                    HeaderList::new(),
                    "Payload Too Large: see --max-body-bytes\n",
                );
            };
            let (answer, _change) = endpoints::put_override(&self.gateway, &body, caller).await;
            return operator_reply(answer);
        }
        let _ = session.drain_request_body().await;
        if *method == http::Method::DELETE {
            let query = session.req_header().uri.query();
            let (answer, _change) = endpoints::delete_override(&self.gateway, query, caller).await;
            return operator_reply(answer);
        }
        operator_reply(endpoints::list_overrides(&self.gateway))
    }
}
