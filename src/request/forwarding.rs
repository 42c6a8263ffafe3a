//! What the gateway tells an upstream about a forwarded request beyond the request itself, and
//! what a route rewrites: RFC 7239 `Forwarded` elements, and a route's header rules
//! (`request_headers` / `response_headers` in the gateway file, each with `remove`, `set` and
//! `add`) whose values are literal text or one named variable (`${client_addr}`,
//! `${request_id}`, `${host}`). Compiled from the gateway file's JSON here, once; the proxy glue
//! applies them per request. Pure: no sockets, no Pingora.

use crate::policy::json::{self, join};
use crate::policy::FieldError;
use http::{HeaderName, HeaderValue};
use serde_json::Value;
use std::net::IpAddr;

/// A rule's value: literal text, or a variable resolved per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleValue {
    Literal(HeaderValue),
    /// The client address as resolved for limiting (behind a trusted proxy, the real client).
    ClientAddr,
    /// The request's ID: the client's acceptable `X-Request-Id`, else one generated here (the
    /// same one the access log and the upstream see).
    RequestId,
    /// The host the client asked for (`Host`, or an absolute target's authority), as sent.
    Host,
}

/// The variables a value may name, exactly as written in the gateway file.
pub const VARIABLES: [(&str, RuleValue); 3] = [
    ("${client_addr}", RuleValue::ClientAddr),
    ("${request_id}", RuleValue::RequestId),
    ("${host}", RuleValue::Host),
];

/// Headers a rule may not touch: they frame the message or belong to one hop, and rewriting
/// them would desynchronise the connection or smuggle a request.
const FRAMING: [&str; 7] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
];

/// One direction's rules, applied in this order: `remove`, then `set` (replacing every line of
/// the name), then `add` (one more line).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeaderRules {
    pub remove: Vec<HeaderName>,
    pub set: Vec<(HeaderName, RuleValue)>,
    pub add: Vec<(HeaderName, RuleValue)>,
}

impl HeaderRules {
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.set.is_empty() && self.add.is_empty()
    }

    /// Whether a rule (remove, set or add) names `name`.
    pub fn names(&self, name: &HeaderName) -> bool {
        self.remove.contains(name) || self.set.iter().chain(&self.add).any(|(n, _)| n == name)
    }

    /// Whether a value names `${request_id}` (so the request needs one).
    pub fn uses_request_id(&self) -> bool {
        self.set
            .iter()
            .chain(&self.add)
            .any(|(_, v)| *v == RuleValue::RequestId)
    }
}

/// A route's rules, towards the upstream and towards the client.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RouteHeaders {
    pub request: HeaderRules,
    pub response: HeaderRules,
}

impl RouteHeaders {
    pub fn uses_request_id(&self) -> bool {
        self.request.uses_request_id() || self.response.uses_request_id()
    }
}

/// One request's variable values.
#[derive(Debug, Clone, Copy, Default)]
pub struct Variables<'a> {
    pub client_addr: Option<IpAddr>,
    pub request_id: Option<&'a str>,
    pub host: Option<&'a str>,
}

impl RuleValue {
    /// The header value for this request; `None` when the variable has no value (no client
    /// address, no host): the header is then left alone.
    pub fn resolve(&self, vars: &Variables<'_>) -> Option<HeaderValue> {
        match self {
            RuleValue::Literal(v) => Some(v.clone()),
            RuleValue::ClientAddr => vars.client_addr.and_then(|ip| {
                HeaderValue::from_str(&crate::request::descriptor::canonical_ip(ip).to_string())
                    .ok()
            }),
            RuleValue::RequestId => vars
                .request_id
                .and_then(|id| HeaderValue::from_str(id).ok()),
            RuleValue::Host => vars.host.and_then(|h| HeaderValue::from_str(h).ok()),
        }
    }
}

/// Compiles one direction's rules (`{"set": {..}, "add": {..}, "remove": [..]}`) at `path`,
/// reporting every error there.
pub fn compile_rules(errors: &mut Vec<FieldError>, v: &Value, path: &str) -> HeaderRules {
    let mut rules = HeaderRules::default();
    let Some(map) = json::object(errors, v, path, &["set", "add", "remove"]) else {
        return rules;
    };
    if let Some(list) = map.get("remove") {
        let p = join(path, "remove");
        match list.as_array() {
            Some(list) => {
                for (i, name) in list.iter().enumerate() {
                    let p = format!("{p}[{i}]");
                    if let Some(name) = json::non_empty_string(errors, name, &p) {
                        if let Some(name) = header_name(errors, name, &p) {
                            rules.remove.push(name);
                        }
                    }
                }
            }
            None => json::error(errors, &p, "must be an array of header names"),
        }
    }
    for (field, out) in [("set", &mut rules.set), ("add", &mut rules.add)] {
        let Some(entries) = map.get(field) else {
            continue;
        };
        let p = join(path, field);
        let Some(entries) = entries.as_object() else {
            json::error(
                errors,
                &p,
                "must be an object of header names to values (text, or ${client_addr}, ${request_id}, ${host})",
            );
            continue;
        };
        for (name, value) in entries {
            let p = join(&p, name);
            let parsed_name = header_name(errors, name, &p);
            let parsed_value = match value.as_str() {
                Some(text) => rule_value(errors, text, &p),
                None => {
                    json::error(errors, &p, "must be a string");
                    None
                }
            };
            if let (Some(n), Some(v)) = (parsed_name, parsed_value) {
                out.push((n, v));
            }
        }
    }
    rules
}

fn header_name(errors: &mut Vec<FieldError>, name: &str, path: &str) -> Option<HeaderName> {
    match HeaderName::from_bytes(name.as_bytes()) {
        Ok(n) if FRAMING.contains(&n.as_str()) => {
            json::error(
                errors,
                path,
                format!(
                    "{name:?} frames the message or belongs to one hop: it cannot be rewritten"
                ),
            );
            None
        }
        Ok(n) => Some(n),
        Err(_) => {
            json::error(errors, path, format!("{name:?} is not a valid header name"));
            None
        }
    }
}

fn rule_value(errors: &mut Vec<FieldError>, text: &str, path: &str) -> Option<RuleValue> {
    if let Some((_, v)) = VARIABLES.iter().find(|(name, _)| *name == text) {
        return Some(v.clone());
    }
    if text.contains("${") {
        json::error(
            errors,
            path,
            format!("{text:?}: a value is literal text or exactly one of ${{client_addr}}, ${{request_id}}, ${{host}}"),
        );
        return None;
    }
    match HeaderValue::from_str(text) {
        Ok(v) => Some(RuleValue::Literal(v)),
        Err(_) => {
            json::error(
                errors,
                path,
                format!("{text:?} is not a valid header value (control characters)"),
            );
            None
        }
    }
}

/// One RFC 7239 `Forwarded` element for the hop this gateway saw: `for` the client's address
/// (an IPv6 one bracketed and quoted), `host` as the client sent it (quoted when it is not a
/// token, as any `host:port` is), `proto` the scheme it used.
pub fn forwarded_element(client: Option<IpAddr>, host: Option<&str>, proto: &str) -> String {
    let mut out = String::with_capacity(64);
    out.push_str("for=");
    match client.map(crate::request::descriptor::canonical_ip) {
        Some(IpAddr::V4(v4)) => out.push_str(&v4.to_string()),
        Some(IpAddr::V6(v6)) => {
            out.push_str("\"[");
            out.push_str(&v6.to_string());
            out.push_str("]\"");
        }
        None => out.push_str("unknown"),
    }
    if let Some(host) = host.filter(|h| h.bytes().all(|b| b.is_ascii_graphic() && b != b'"')) {
        out.push_str(";host=");
        if host.bytes().all(is_token_byte) {
            out.push_str(host);
        } else {
            out.push('"');
            out.push_str(host);
            out.push('"');
        }
    }
    out.push_str(";proto=");
    out.push_str(proto);
    out
}

/// RFC 9110 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compile(v: Value) -> (HeaderRules, Vec<String>) {
        let mut errors = Vec::new();
        let rules = compile_rules(&mut errors, &v, "routes[0].request_headers");
        (rules, errors.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn values_are_literal_or_one_named_variable() {
        let (rules, errors) = compile(json!({
            "set": {"X-Env": "prod", "X-Client": "${client_addr}", "X-Host": "${host}"},
            "add": {"X-Trace": "${request_id}"},
            "remove": ["X-Debug"]
        }));
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(rules.remove, vec![HeaderName::from_static("x-debug")]);
        assert_eq!(
            rules.set,
            vec![
                (HeaderName::from_static("x-client"), RuleValue::ClientAddr),
                (
                    HeaderName::from_static("x-env"),
                    RuleValue::Literal(HeaderValue::from_static("prod"))
                ),
                (HeaderName::from_static("x-host"), RuleValue::Host),
            ]
        );
        assert!(rules.uses_request_id());
        let vars = Variables {
            client_addr: Some("::ffff:192.0.2.7".parse().unwrap()),
            request_id: Some("abc"),
            host: Some("api.example.com:8443"),
        };
        assert_eq!(
            RuleValue::ClientAddr.resolve(&vars).unwrap(),
            HeaderValue::from_static("192.0.2.7")
        );
        assert_eq!(
            RuleValue::Host.resolve(&vars).unwrap(),
            HeaderValue::from_static("api.example.com:8443")
        );
        assert_eq!(RuleValue::Host.resolve(&Variables::default()), None);
    }

    #[test]
    fn every_mistake_is_reported_with_its_path() {
        let (_, errors) = compile(json!({
            "set": {"Content-Length": "5", "X-A": "${client_ip}", "bad name": "x", "X-B": 3},
            "add": {"X-C": "line\nbreak"},
            "remove": "X-D",
            "replace": {}
        }));
        assert_eq!(
            errors,
            vec![
                "routes[0].request_headers.replace: unknown field (expected one of: set, add, remove)",
                "routes[0].request_headers.remove: must be an array of header names",
                "routes[0].request_headers.set.Content-Length: \"Content-Length\" frames the message or belongs to one hop: it cannot be rewritten",
                "routes[0].request_headers.set.X-A: \"${client_ip}\": a value is literal text or exactly one of ${client_addr}, ${request_id}, ${host}",
                "routes[0].request_headers.set.X-B: must be a string",
                "routes[0].request_headers.set.bad name: \"bad name\" is not a valid header name",
                "routes[0].request_headers.add.X-C: \"line\\nbreak\" is not a valid header value (control characters)",
            ]
        );
    }

    #[test]
    fn forwarded_elements_follow_rfc_7239() {
        assert_eq!(
            forwarded_element(
                Some("192.0.2.60".parse().unwrap()),
                Some("example.com"),
                "http"
            ),
            "for=192.0.2.60;host=example.com;proto=http"
        );
        assert_eq!(
            forwarded_element(
                Some("2001:db8::1".parse().unwrap()),
                Some("example.com:8443"),
                "https"
            ),
            "for=\"[2001:db8::1]\";host=\"example.com:8443\";proto=https"
        );
        assert_eq!(
            forwarded_element(None, None, "http"),
            "for=unknown;proto=http"
        );
    }
}
