//! Request descriptors: what a rule can key on or match against (SPEC §3), and how the values
//! of a request become one composite bucket key.
//!
//! [`RequestFacts`] borrows everything from the caller (the proxy's request header, the decision
//! service's `X-Original-*` headers, or a `simulate` line), so building facts allocates nothing.

pub(crate) mod header_lookup;
pub(crate) mod ip;

pub use header_lookup::HeaderLookup;
pub use ip::{canonical_ip, client_net, ip_key, mask_v6, push_ip_key, IpNet};

use std::borrow::Cow;
use std::net::IpAddr;

/// Claims of a verified token: a JSON object.
pub type Claims = serde_json::Map<String, serde_json::Value>;

/// Everything the engine may look at in one request.
pub struct RequestFacts<'a> {
    pub method: &'a str,
    /// Path without the query string, normalised ([`normalize_path`]): selectors, routes and
    /// the `path` descriptor only ever see this form.
    pub path: Cow<'a, str>,
    /// Raw query string (after `?`), if any.
    pub query: Option<&'a str>,
    /// Host as sent (may carry a port).
    pub host: Option<&'a str>,
    pub client_ip: Option<IpAddr>,
    pub headers: &'a (dyn HeaderLookup + Sync),
    /// Claims of a verified JWT, if one was presented and verified.
    pub claims: Option<&'a Claims>,
    /// The Envoy rate-limit descriptor these facts stand for (gRPC `ShouldRateLimit`), if any.
    pub envoy: Option<EnvoyDescriptor<'a>>,
    /// xxHash3-64 of the request body, when the front end read it (for `loop_detection`).
    pub body_hash: Option<u64>,
    /// What an LLM request body asks for, when the front end read it (`token_bucket_llm`).
    pub llm: Option<&'a crate::request::llm::LlmRequest>,
    /// The model the request is decided for instead of the one it names: an `llm_spend`
    /// rule's fallback, which the request is rewritten to.
    pub model_override: Option<&'a str>,
    /// The upstream group the request's route sends it to (`llm:provider`), when known.
    pub llm_provider: Option<&'a str>,
    /// The front end can rewrite the body's `model` (the proxy, holding the body it read): an
    /// `llm_spend` rule's fallback model is tried only then.
    pub model_rewritable: bool,
    /// The request (or the decision-service call describing it) came from a `--trusted-proxy`
    /// peer: its network headers (`X-Country-Code`...) may be believed.
    pub trusted_peer: bool,
    /// The client's network (`ip:country`, `ip:asn`, `ip:type`, `ip:tor`), when the bundle in
    /// force reads it ([`crate::request::network`]).
    pub network: Option<&'a crate::request::network::NetworkFacts>,
    /// The trace this request is part of, when tracing is on (for the `RATE_LIMIT` line's
    /// `trace_id`, and to summarise a sampled request's decision for its span).
    pub trace: Option<TraceFacts>,
    /// These facts stand for one request message of a gRPC call, not for the call: only the
    /// rules reading `grpc:message` apply ([`Descriptor::reads_grpc_messages`]).
    pub grpc_message: bool,
}

/// A request's trace as the core sees it: plain data (the spans live in the telemetry glue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceFacts {
    pub trace_id: [u8; 16],
    /// The request's spans are recorded and exported.
    pub sampled: bool,
}

impl TraceFacts {
    /// The trace id as 32 lower-case hex digits (W3C `traceparent`'s form).
    pub fn trace_id_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(32);
        for byte in self.trace_id {
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        out
    }
}

/// One descriptor of an Envoy `ShouldRateLimit` call: its request's `domain` and its
/// `{key, value}` entries in order. Each entry is the descriptor `descriptor:<key>`.
#[derive(Debug, Clone, Copy)]
pub struct EnvoyDescriptor<'a> {
    pub domain: &'a str,
    pub entries: &'a Vec<(String, String)>,
}

impl<'a> EnvoyDescriptor<'a> {
    /// The value of the first entry named `key` (Envoy keys are case-sensitive).
    pub fn entry(&self, key: &str) -> Option<&'a str> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The entry keys in order, joined with `,` (the `descriptor_keys` descriptor): lets a rule
    /// apply to one descriptor shape only, as envoyproxy/ratelimit's tree lookup does.
    pub fn keys(&self) -> String {
        let mut out = String::new();
        for (i, (key, _)) in self.entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(key);
        }
        out
    }
}

impl<'a> RequestFacts<'a> {
    /// The one way to build facts: splits the request target (`/path?query`) and normalises
    /// the path, so no front end can forget to.
    ///
    /// # Errors
    /// [`EncodedSlashError`] when the path has an encoded slash and `slashes` refuses them.
    pub fn new(
        method: &'a str,
        target: &'a str,
        host: Option<&'a str>,
        client_ip: Option<IpAddr>,
        headers: &'a (dyn HeaderLookup + Sync),
        slashes: EncodedSlashes,
    ) -> Result<Self, EncodedSlashError> {
        let (path, query) = split_uri(target);
        let path = normalize_request_path(path, slashes)?;
        Ok(Self::from_parts(
            method, path, query, host, client_ip, headers,
        ))
    }

    /// Facts with encoded slashes decoded (tests, benchmarks).
    pub fn from_uri(
        method: &'a str,
        uri: &'a str,
        host: Option<&'a str>,
        client_ip: Option<IpAddr>,
        headers: &'a (dyn HeaderLookup + Sync),
    ) -> Self {
        let (path, query) = split_uri(uri);
        Self::from_parts(
            method,
            normalize_path(path),
            query,
            host,
            client_ip,
            headers,
        )
    }

    fn from_parts(
        method: &'a str,
        path: Cow<'a, str>,
        query: Option<&'a str>,
        host: Option<&'a str>,
        client_ip: Option<IpAddr>,
        headers: &'a (dyn HeaderLookup + Sync),
    ) -> Self {
        RequestFacts {
            method,
            path,
            query,
            host,
            client_ip,
            headers,
            claims: None,
            envoy: None,
            body_hash: None,
            llm: None,
            model_override: None,
            llm_provider: None,
            model_rewritable: false,
            trusted_peer: false,
            network: None,
            trace: None,
            grpc_message: false,
        }
    }

    /// Facts for one descriptor of an Envoy `ShouldRateLimit` call. The entries are also the
    /// request's headers (so `header:<name>` reads an entry Envoy's `request_headers` action
    /// named after its header), and the well-known keys fill in the rest: `remote_address` is
    /// the client address, `masked_remote_address` (`10.1.2.0/24`) its network address,
    /// `method`, `path` and `host` the request line; absent, the method is empty and the path
    /// `/`.
    pub fn for_envoy(descriptor: EnvoyDescriptor<'a>) -> Self {
        let client_ip = descriptor
            .entry("remote_address")
            .and_then(|v| v.trim().parse::<IpAddr>().ok())
            .or_else(|| {
                descriptor
                    .entry("masked_remote_address")
                    .and_then(IpNet::parse)
                    .map(|net| net.addr())
            })
            .map(canonical_ip);
        let target = descriptor.entry("path").unwrap_or("/");
        let (path, query) = split_uri(target);
        let mut facts = Self::from_parts(
            descriptor.entry("method").unwrap_or(""),
            normalize_path(path),
            query,
            descriptor.entry("host"),
            client_ip,
            descriptor.entries,
        );
        facts.envoy = Some(descriptor);
        facts
    }

    /// The same facts with verified JWT claims.
    pub fn with_claims(mut self, claims: Option<&'a Claims>) -> Self {
        self.claims = claims;
        self
    }

    /// The same facts with the request body's hash ([`body_hash`]).
    pub fn with_body_hash(mut self, hash: Option<u64>) -> Self {
        self.body_hash = hash;
        self
    }

    pub fn with_llm(mut self, llm: Option<&'a crate::request::llm::LlmRequest>) -> Self {
        self.llm = llm;
        self
    }

    /// The same facts, sent to upstream group `provider` (`llm:provider`).
    pub fn with_llm_provider(mut self, provider: Option<&'a str>) -> Self {
        self.llm_provider = provider;
        self
    }

    /// The same facts, from a front end that can rewrite the body's `model` (or not).
    pub fn with_model_rewritable(mut self, rewritable: bool) -> Self {
        self.model_rewritable = rewritable;
        self
    }

    /// The model an `llm_spend` fallback may replace: the body's `model`, when the front end
    /// can rewrite it (a model named in the path, or a body another gateway holds, cannot be).
    pub fn replaceable_model(&self) -> Option<&'a str> {
        if !self.model_rewritable {
            return None;
        }
        self.llm.and_then(|l| l.model.as_deref())
    }

    /// The model the request names (`llm:model`): a fallback it is rewritten to, else its
    /// body's `model`, else Gemini's model in the path.
    pub fn llm_model(&self) -> Option<Cow<'a, str>> {
        let named = self
            .model_override
            .or_else(|| self.llm.and_then(|l| l.model.as_deref()));
        if let Some(model) = named {
            return Some(Cow::Borrowed(model));
        }
        match &self.path {
            Cow::Borrowed(path) => crate::request::llm::gemini_model(path).map(Cow::Borrowed),
            Cow::Owned(path) => {
                crate::request::llm::gemini_model(path).map(|m| Cow::Owned(m.to_string()))
            }
        }
    }

    /// The same facts, from a trusted peer or not (see [`RequestFacts::trusted_peer`]).
    pub fn with_trusted_peer(mut self, trusted: bool) -> Self {
        self.trusted_peer = trusted;
        self
    }

    /// The same facts, part of a trace (see [`RequestFacts::trace`]).
    pub fn with_trace(mut self, trace: Option<TraceFacts>) -> Self {
        self.trace = trace;
        self
    }

    /// These facts for one request message of their gRPC call (`grpc:message`).
    pub fn with_grpc_message(mut self) -> Self {
        self.grpc_message = true;
        self
    }

    /// A copy of these facts with the client's network facts.
    pub fn with_network<'n>(
        &'n self,
        network: &'n crate::request::network::NetworkFacts,
    ) -> RequestFacts<'n> {
        RequestFacts {
            network: Some(network),
            ..self.reborrowed()
        }
    }

    /// A copy of these facts decided as if the request named `model` (an `llm_spend` rule's
    /// fallback, which the request is then rewritten to).
    pub fn for_model<'n>(&'n self, model: &'n str) -> RequestFacts<'n> {
        RequestFacts {
            model_override: Some(model),
            ..self.reborrowed()
        }
    }

    /// The same facts, borrowing these (the path included).
    fn reborrowed(&self) -> RequestFacts<'_> {
        RequestFacts {
            method: self.method,
            path: Cow::Borrowed(&self.path),
            query: self.query,
            host: self.host,
            client_ip: self.client_ip,
            headers: self.headers,
            claims: self.claims,
            envoy: self.envoy,
            body_hash: self.body_hash,
            llm: self.llm,
            model_override: self.model_override,
            llm_provider: self.llm_provider,
            model_rewritable: self.model_rewritable,
            trusted_peer: self.trusted_peer,
            network: self.network,
            trace: self.trace,
            grpc_message: self.grpc_message,
        }
    }

    /// Appends what makes two requests identical for `loop_detection`: method, path, the query
    /// parameters sorted (by decoded name, then value, so order and encoding do not matter and
    /// a repeated parameter counts every value), and the body hash (`-` when no body was read).
    pub fn write_fingerprint(&self, out: &mut String) {
        // Every field escaped and `|`-separated: the body hash is always the last one, so no two
        // different requests write the same text.
        push_key_part(out, false, self.method);
        push_key_part(out, false, &self.path);
        if let Some(query) = self.query {
            let mut params: smallvec::SmallVec<[(Cow<'_, str>, Cow<'_, str>); 8]> = query
                .split('&')
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect();
            params.sort_unstable();
            for (k, v) in &params {
                push_key_part(out, false, k);
                push_key_part(out, false, v);
            }
        }
        out.push('|');
        match self.body_hash {
            Some(h) => {
                use std::fmt::Write;
                let _ = write!(out, "{h:016x}");
            }
            None => out.push('-'),
        }
    }

    /// The host without port, as sent (callers compare case-insensitively).
    /// The host without port or trailing dot (`api.example.com.:443` → `api.example.com`).
    pub fn host_name(&self) -> Option<&'a str> {
        self.host.map(|h| {
            let name = strip_port(h);
            name.strip_suffix('.').unwrap_or(name)
        })
    }

    /// Whether the request is a gRPC call: its content type is gRPC's (or gRPC-Web's).
    pub fn is_grpc(&self) -> bool {
        self.headers
            .header_bytes("content-type")
            .is_some_and(crate::request::grpc::is_grpc_content_type)
    }

    /// The first value of query parameter `name`, percent-decoded.
    pub fn query_param(&self, name: &str) -> Option<Cow<'a, str>> {
        let query = self.query?;
        for pair in query.split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if percent_decode(key) == name {
                return Some(percent_decode(value));
            }
        }
        None
    }

    /// The string value of a JWT claim; dotted names walk nested objects (`org.id`). Numbers and
    /// booleans give their JSON text, so `42` and `"42"` compare equal.
    pub fn claim(&self, name: &str) -> Option<Cow<'a, str>> {
        let claims = self.claims?;
        let value = claims.get(name).or_else(|| {
            let mut parts = name.split('.');
            let mut current = claims.get(parts.next()?)?;
            for part in parts {
                current = current.as_object()?.get(part)?;
            }
            Some(current)
        })?;
        match value {
            serde_json::Value::String(s) => Some(Cow::Borrowed(s.as_str())),
            serde_json::Value::Number(n) => Some(Cow::Owned(n.to_string())),
            serde_json::Value::Bool(b) => Some(Cow::Borrowed(if *b { "true" } else { "false" })),
            _ => None,
        }
    }
}

/// Splits `/path?query` into path and query (the query without `?`). A fragment is dropped.
/// One byte search finds the first `?` or `#` (the path ends there); only a query looks
/// further, for its own end. (Every request splits its target: two `split_once` searches
/// cost twice the instructions.)
pub fn split_uri(uri: &str) -> (&str, Option<&str>) {
    let bytes = uri.as_bytes();
    match memchr::memchr2(b'?', b'#', bytes) {
        Some(end) if bytes[end] == b'?' => {
            let query = &uri[end + 1..];
            let query = memchr::memchr(b'#', query.as_bytes()).map_or(query, |hash| &query[..hash]);
            (&uri[..end], Some(query))
        }
        Some(hash) => (&uri[..hash], None),
        None => (uri, None),
    }
}

/// What a request path's encoded slashes (`%2F`, and `%5C` for `\\`) mean for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncodedSlashes {
    /// Decoded before matching, so `/api%2Fllm` matches like `/api/llm` (many upstreams,
    /// nginx among them, route it there). The request is forwarded unchanged.
    #[default]
    Decode,
    /// Refused with 400: for APIs where an encoded slash is never legitimate.
    Reject,
}

/// A path carries `%2F` or `%5C` and the gateway runs with [`EncodedSlashes::Reject`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request path contains an encoded slash (%2F or %5C)")]
pub struct EncodedSlashError;

/// Whether `path` contains `%2F` or `%5C` (either case).
pub fn has_encoded_slash(path: &str) -> bool {
    path.as_bytes().windows(3).any(|w| {
        w[0] == b'%'
            && ((w[1] == b'2' && (w[2] | 0x20) == b'f') || (w[1] == b'5' && (w[2] | 0x20) == b'c'))
    })
}

/// [`normalize_path`] under an [`EncodedSlashes`] choice.
///
/// # Errors
/// [`EncodedSlashError`] when `mode` is `Reject` and the path has `%2F` or `%5C`.
pub fn normalize_request_path(
    path: &str,
    mode: EncodedSlashes,
) -> Result<Cow<'_, str>, EncodedSlashError> {
    normalize_until_stable(path, mode == EncodedSlashes::Reject)
}

/// Applies [`normalize_once`] until nothing changes (a pass can reveal a new escape:
/// `%2%46` decodes to `%2F`, which the next pass turns into `/`). Every change shortens the
/// path, so this ends; eight passes cover any real input. With `reject_encoded_slashes`, an
/// encoded slash at any pass is refused.
fn normalize_until_stable(
    path: &str,
    reject_encoded_slashes: bool,
) -> Result<Cow<'_, str>, EncodedSlashError> {
    let mut current = Cow::Borrowed(path);
    for _ in 0..8 {
        if reject_encoded_slashes && has_encoded_slash(&current) {
            return Err(EncodedSlashError);
        }
        let next = match normalize_once(&current) {
            Cow::Borrowed(_) => return Ok(current),
            Cow::Owned(next) => next,
        };
        if next == *current {
            return Ok(current);
        }
        current = Cow::Owned(next);
    }
    Ok(current)
}

/// The path as the upstream will most likely route it, for matching selectors, routes and the
/// `path` descriptor (the one place the match path is made: [`RequestFacts::new`] and every
/// front end go through it): path parameters cut from each segment (`/a;p=1/b` → `/a/b`,
/// `/orders;jsessionid=0123` → `/orders`, as servlet containers do before routing), then
/// percent-escapes of unreserved characters and of `/` and `\` decoded (`/%61pi` → `/api`,
/// `/api%2Fllm` → `/api/llm`), `\` read as `/` (as Windows servers and many frameworks do),
/// repeated slashes merged, `.` and `..` segments resolved (never above the root; `..;x` is
/// `..` once its parameter is cut, as Tomcat reads it). Without this, `//api/x`, `/api%2Fx`,
/// `/v1/./inference` or `/api;x` would walk past a `pathPrefix` or a kill switch's `route`.
///
/// A parameter is cut at the raw `;` only, up to the next raw `/`: an encoded `%3B` is data
/// (servlet containers split parameters before decoding, so `/api%3Bx` names a resource
/// `api;x`, never `/api`), and stays escaped. Paths that need nothing are returned as they
/// are, without allocating.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    match normalize_until_stable(path, false) {
        Ok(normal) => normal,
        // Unreachable: nothing is refused without `reject_encoded_slashes`.
        Err(_) => Cow::Borrowed(path),
    }
}

/// Whether a normalisation pass could change `path`: a `%`, `\\` or `;`, or a `/` followed by `/`,
/// `.` (ending the path or followed by `/`) or `..` (likewise). One pass over the bytes: seven
/// substring searches cost more than the rest of a request's facts.
fn needs_normalizing(path: &str) -> bool {
    let b = path.as_bytes();
    let ends_segment = |at: usize| matches!(b.get(at), None | Some(b'/'));
    b.iter().enumerate().any(|(i, &c)| match c {
        b'%' | b'\\' | b';' => true,
        b'/' => match b.get(i + 1) {
            Some(b'/') => true,
            Some(b'.') => {
                ends_segment(i + 2) || (b.get(i + 2) == Some(&b'.') && ends_segment(i + 3))
            }
            _ => false,
        },
        _ => false,
    })
}

/// Where a path parameter (`bytes` starts at its `;`) ends: at the next `/`, `\\`, `%2F` or
/// `%5C`, the separators [`normalize_once`] reads.
fn parameter_end(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len()).find(|&k| match bytes[k] {
        b'/' | b'\\' => true,
        b'%' => {
            bytes.len() >= k + 3
                && ((bytes[k + 1] == b'2' && bytes[k + 2] | 0x20 == b'f')
                    || (bytes[k + 1] == b'5' && bytes[k + 2] | 0x20 == b'c'))
        }
        _ => false,
    })
}

/// One normalisation pass (see [`normalize_path`]).
fn normalize_once(path: &str) -> Cow<'_, str> {
    if !needs_normalizing(path) {
        return Cow::Borrowed(path);
    }
    // Decode unreserved characters and both slashes; anything else (`%25`, `%3F`...) keeps its
    // escape, so normalising twice changes nothing.
    let bytes = path.as_bytes();
    let mut decoded = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b';' {
            // A path parameter: dropped up to the segment's end (the next `/`, `\`, `%2F` or
            // `%5C`: never over a separator this normaliser reads). On a `.` or `..` segment
            // it is kept as written, so the cut never makes a dot segment: servers for which
            // `;` is data read such a path under the segments before it, and so does matching
            // (the proxy and the decision service refuse these targets with 400 anyway).
            let end = parameter_end(&bytes[i..]).map_or(bytes.len(), |end| i + end);
            let segment = decoded.rsplit('/').next().unwrap_or("");
            if matches!(segment, "." | "..") {
                decoded.push_str(&path[i..end]);
            }
            i = end;
            continue;
        }
        if bytes[i] == b'\\' {
            decoded.push('/');
            i += 1;
            continue;
        }
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let c = (h * 16 + l) as u8;
                if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                    decoded.push(c as char);
                    i += 3;
                    continue;
                }
                if c == b'/' || c == b'\\' {
                    decoded.push('/');
                    i += 3;
                    continue;
                }
            }
        }
        // Push the whole UTF-8 character starting here.
        let ch_len = path[i..].chars().next().map_or(1, char::len_utf8);
        decoded.push_str(&path[i..i + ch_len]);
        i += ch_len;
    }
    let trailing_slash =
        decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Cow::Owned(out)
}

pub use crate::request::authority::strip_port;

/// Decodes `%XX` escapes and `+` (as space); invalid escapes are kept as written.
pub fn percent_decode(input: &str) -> Cow<'_, str> {
    if !input.bytes().any(|b| b == b'%' || b == b'+') {
        return Cow::Borrowed(input);
    }
    let bytes = input.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// The request header a `header:<name>` descriptor (or cost source) reads: lower case, and `_`
/// read as `-`, so `header:x_api_key` reads `X-Api-Key` (Fairvisor treats the two alike, and
/// nginx drops header names with underscores by default, so no real header is lost).
pub fn header_name(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            '_' => '-',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

/// A descriptor kind, parsed from its policy spelling.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Descriptor {
    /// `ip:address` (prefix = None: the engine's IPv6 default) or `ip:address/N` (IPv6 prefix).
    Ip {
        v6_prefix: Option<u8>,
    },
    /// `header:<name>`, stored lower-case.
    Header(String),
    /// `query:<name>`.
    Query(String),
    /// `jwt:<claim>` (dotted for nested claims).
    Jwt(String),
    Method,
    Path,
    Host,
    /// `descriptor:<key>`: an entry of an Envoy rate-limit descriptor (case-sensitive key).
    Entry(String),
    /// `domain`: the Envoy rate-limit request's domain (compared like a host: any case).
    Domain,
    /// `descriptor_keys`: an Envoy descriptor's entry keys in order, joined with `,`.
    EntryKeys,
    /// `ip:country`, `ip:asn`, `ip:type`, `ip:tor`: the client's network ([`crate::request::network`]).
    Network(NetworkKey),
    /// `grpc:service`, `grpc:method`: a gRPC call's `package.Service` and `Method`, from its
    /// path `/package.Service/Method` ([`crate::request::grpc`]); absent on other requests.
    Grpc(GrpcPart),
    /// `llm:model`: the model an LLM request names ([`RequestFacts::llm_model`]).
    LlmModel,
    /// `llm:provider`: the upstream group the request's route sends it to.
    LlmProvider,
}

/// Which part of a gRPC call's path a `Descriptor::Grpc` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrpcPart {
    Service,
    Method,
    /// `grpc:message`: `package.Service/Method`, present only when the facts stand for one
    /// request message of the call: a rule reading it counts messages, not calls.
    Message,
}

/// Which network fact a `Descriptor::Network` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NetworkKey {
    Country,
    Asn,
    Type,
    Tor,
}

/// Why a descriptor string is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    #[error("unknown descriptor '{0}' (expected ip:address, ip:country, ip:asn, ip:type, ip:tor, header:<name>, query:<name>, jwt:<claim>, method, path, host, grpc:service, grpc:method, grpc:message, descriptor:<key>, domain, descriptor_keys, llm:model or llm:provider)")]
    Unknown(String),
    #[error("descriptor '{0}' needs a name after the colon")]
    EmptyName(String),
    #[error("descriptor '{0}': IPv6 prefix must be a number from 1 to 128")]
    BadPrefix(String),
}

impl Descriptor {
    /// Parses `ip:address`, `ip:address/48`, `header:x-api-key`, `query:k`, `jwt:plan`,
    /// `method`, `path` or `host`.
    ///
    /// # Errors
    /// An unknown kind, an empty name or a bad prefix length.
    pub fn parse(text: &str) -> Result<Self, DescriptorError> {
        let named = |prefix: &str| -> Result<Option<String>, DescriptorError> {
            match text.strip_prefix(prefix) {
                None => Ok(None),
                Some("") => Err(DescriptorError::EmptyName(text.to_string())),
                Some(name) => Ok(Some(name.to_string())),
            }
        };
        match text {
            "ip:address" => return Ok(Descriptor::Ip { v6_prefix: None }),
            "method" => return Ok(Descriptor::Method),
            "path" => return Ok(Descriptor::Path),
            "host" => return Ok(Descriptor::Host),
            "domain" => return Ok(Descriptor::Domain),
            "descriptor_keys" => return Ok(Descriptor::EntryKeys),
            "ip:country" => return Ok(Descriptor::Network(NetworkKey::Country)),
            "ip:asn" => return Ok(Descriptor::Network(NetworkKey::Asn)),
            "ip:type" => return Ok(Descriptor::Network(NetworkKey::Type)),
            "ip:tor" => return Ok(Descriptor::Network(NetworkKey::Tor)),
            "grpc:service" => return Ok(Descriptor::Grpc(GrpcPart::Service)),
            "grpc:method" => return Ok(Descriptor::Grpc(GrpcPart::Method)),
            "grpc:message" => return Ok(Descriptor::Grpc(GrpcPart::Message)),
            "llm:model" => return Ok(Descriptor::LlmModel),
            "llm:provider" => return Ok(Descriptor::LlmProvider),
            _ => {}
        }
        if let Some(bits) = text.strip_prefix("ip:address/") {
            return match bits.parse::<u8>() {
                Ok(n) if (1..=128).contains(&n) => Ok(Descriptor::Ip { v6_prefix: Some(n) }),
                _ => Err(DescriptorError::BadPrefix(text.to_string())),
            };
        }
        if let Some(name) = named("header:")? {
            return Ok(Descriptor::Header(header_name(&name)));
        }
        if let Some(name) = named("query:")? {
            return Ok(Descriptor::Query(name));
        }
        if let Some(name) = named("jwt:")? {
            return Ok(Descriptor::Jwt(name));
        }
        if let Some(name) = named("descriptor:")? {
            return Ok(Descriptor::Entry(name));
        }
        Err(DescriptorError::Unknown(text.to_string()))
    }

    /// Whether this is `grpc:message`: a rule reading it counts a gRPC call's request
    /// messages, and only them.
    pub fn reads_grpc_messages(&self) -> bool {
        matches!(self, Descriptor::Grpc(GrpcPart::Message))
    }

    /// This descriptor's value for a request, or `None` when the request does not carry it.
    /// `default_v6_prefix` applies to `ip:address` without an explicit `/N`.
    pub fn value<'a>(
        &self,
        facts: &RequestFacts<'a>,
        default_v6_prefix: u8,
    ) -> Option<Cow<'a, str>> {
        match self {
            Descriptor::Ip { v6_prefix } => facts
                .client_ip
                .map(|ip| Cow::Owned(ip_key(ip, v6_prefix.unwrap_or(default_v6_prefix)))),
            Descriptor::Header(name) => facts.headers.header_text(name),
            Descriptor::Query(name) => facts.query_param(name),
            Descriptor::Jwt(claim) => facts.claim(claim),
            Descriptor::Method => Some(Cow::Borrowed(facts.method)),
            Descriptor::Path => Some(facts.path.clone()),
            Descriptor::Host => facts
                .host_name()
                .map(|h| Cow::Owned(h.to_ascii_lowercase())),
            Descriptor::Entry(key) => facts.envoy?.entry(key).map(Cow::Borrowed),
            Descriptor::Domain => facts
                .envoy
                .map(|e| Cow::Owned(e.domain.to_ascii_lowercase())),
            Descriptor::EntryKeys => facts.envoy.map(|e| Cow::Owned(e.keys())),
            Descriptor::LlmModel => facts.llm_model(),
            Descriptor::LlmProvider => facts.llm_provider.map(Cow::Borrowed),
            Descriptor::Network(key) => {
                let network = facts.network?;
                match key {
                    NetworkKey::Country => network.country.as_deref().map(Cow::Borrowed),
                    NetworkKey::Asn => network.asn.as_deref().map(Cow::Borrowed),
                    NetworkKey::Type => network.asn_type.as_deref().map(Cow::Borrowed),
                    NetworkKey::Tor => network.tor.map(Cow::Borrowed),
                }
            }
            Descriptor::Grpc(part) => {
                if (*part == GrpcPart::Message && !facts.grpc_message) || !facts.is_grpc() {
                    return None;
                }
                // `service/method` without its leading `/`, or one of its parts.
                let pick = |path: &'a str| -> Option<&'a str> {
                    let (service, method) = crate::request::grpc::service_and_method(path)?;
                    Some(match part {
                        GrpcPart::Service => service,
                        GrpcPart::Method => method,
                        GrpcPart::Message => &path[1..],
                    })
                };
                match &facts.path {
                    Cow::Borrowed(path) => pick(path).map(Cow::Borrowed),
                    Cow::Owned(path) => {
                        let (service, method) = crate::request::grpc::service_and_method(path)?;
                        Some(Cow::Owned(match part {
                            GrpcPart::Service => service.to_string(),
                            GrpcPart::Method => method.to_string(),
                            GrpcPart::Message => format!("{service}/{method}"),
                        }))
                    }
                }
            }
        }
    }
}

impl std::fmt::Display for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Descriptor::Ip { v6_prefix: None } => f.write_str("ip:address"),
            Descriptor::Ip { v6_prefix: Some(n) } => write!(f, "ip:address/{n}"),
            Descriptor::Header(name) => write!(f, "header:{name}"),
            Descriptor::Query(name) => write!(f, "query:{name}"),
            Descriptor::Jwt(name) => write!(f, "jwt:{name}"),
            Descriptor::Method => f.write_str("method"),
            Descriptor::Path => f.write_str("path"),
            Descriptor::Host => f.write_str("host"),
            Descriptor::Entry(key) => write!(f, "descriptor:{key}"),
            Descriptor::Domain => f.write_str("domain"),
            Descriptor::EntryKeys => f.write_str("descriptor_keys"),
            Descriptor::Network(NetworkKey::Country) => f.write_str("ip:country"),
            Descriptor::Network(NetworkKey::Asn) => f.write_str("ip:asn"),
            Descriptor::Network(NetworkKey::Type) => f.write_str("ip:type"),
            Descriptor::Network(NetworkKey::Tor) => f.write_str("ip:tor"),
            Descriptor::Grpc(GrpcPart::Service) => f.write_str("grpc:service"),
            Descriptor::Grpc(GrpcPart::Method) => f.write_str("grpc:method"),
            Descriptor::Grpc(GrpcPart::Message) => f.write_str("grpc:message"),
            Descriptor::LlmModel => f.write_str("llm:model"),
            Descriptor::LlmProvider => f.write_str("llm:provider"),
        }
    }
}

/// Builds composite keys. Parts are joined with `|`, and `\` and `|` inside a part are escaped
/// with `\`, so two different part lists can never produce the same key, while a single plain
/// part (an IP, an API key) stays readable and equal to itself (Boulder-style override IDs).
pub fn push_key_part(key: &mut String, first: bool, part: &str) {
    if !first {
        key.push('|');
    }
    if part.bytes().any(|b| b == b'|' || b == b'\\') {
        for c in part.chars() {
            if c == '|' || c == '\\' {
                key.push('\\');
            }
            key.push(c);
        }
    } else {
        key.push_str(part);
    }
}

/// Hashes a request body as it streams by, for `loop_detection` fingerprints: xxHash3-64, the
/// same value as [`body_hash`] of the whole body. An empty body has no hash.
#[derive(Default)]
pub struct BodyHasher {
    hasher: twox_hash::XxHash3_64,
    bytes: u64,
}

impl BodyHasher {
    pub fn update(&mut self, chunk: &[u8]) {
        use std::hash::Hasher;
        self.hasher.write(chunk);
        self.bytes += chunk.len() as u64;
    }

    /// The hash, `None` for an empty body.
    pub fn finish(&self) -> Option<u64> {
        use std::hash::Hasher;
        (self.bytes > 0).then(|| self.hasher.finish())
    }
}

/// The hash a whole request body is fingerprinted by (`None` when empty).
pub fn body_hash(body: &[u8]) -> Option<u64> {
    (!body.is_empty()).then(|| twox_hash::XxHash3_64::oneshot(body))
}

/// Joins parts into one composite key (see [`push_key_part`]).
pub fn composite_key<'p>(parts: impl IntoIterator<Item = &'p str>) -> String {
    let mut key = String::new();
    for (i, part) in parts.into_iter().enumerate() {
        push_key_part(&mut key, i == 0, part);
    }
    key
}

#[cfg(test)]
mod tests;
