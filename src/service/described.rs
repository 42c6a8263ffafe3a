//! An original request another gateway describes (the decision service's `X-Original-*`
//! headers, Envoy's ext_authz) and the `http` headers the engine reads it through.

use crate::request::descriptor::HeaderLookup;
use std::net::IpAddr;

/// `X-Forwarded-For` and `X-Real-IP`, parsed once (a name given as a string is parsed at every
/// lookup).
pub static X_FORWARDED_FOR: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");
pub static X_REAL_IP: http::HeaderName = http::HeaderName::from_static("x-real-ip");

/// Headers of an `http` request, for the engine.
pub struct HttpHeaders<'a>(pub &'a http::HeaderMap);

impl HeaderLookup for HttpHeaders<'_> {
    fn header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.0.get(lower_name).map(http::HeaderValue::as_bytes)
    }

    fn last_header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
        self.0
            .get_all(lower_name)
            .iter()
            .next_back()
            .map(http::HeaderValue::as_bytes)
    }

    fn is_repeated(&self, lower_name: &str) -> bool {
        self.0.get_all(lower_name).iter().nth(1).is_some()
    }

    fn repeats_any(&self) -> bool {
        // Every extra line of a name is one more value than there are names.
        self.0.len() != self.0.keys_len()
    }
}

/// An original request another gateway describes (the decision service's `X-Original-*`
/// headers, Envoy's ext_authz), as the engine is asked about it.
#[derive(Clone, Copy)]
pub struct Described<'a> {
    pub method: &'a str,
    /// Path and query.
    pub target: &'a str,
    pub host: Option<&'a str>,
    pub client_ip: Option<IpAddr>,
    pub headers: &'a http::HeaderMap,
    pub body: DescribedBody<'a>,
    /// Whether its network headers (`X-Country-Code`, `X-ASN`, `X-ASN-Type`, `X-Tor-Exit`)
    /// are believed: the caller is a `--trusted-proxy` peer ([`crate::service::Gateway::believes_network_headers`]),
    /// or an operator asks `/v1/explain`.
    pub network_trusted: bool,
    /// The trace of the call that describes it, when tracing is on.
    pub trace: Option<crate::request::descriptor::TraceFacts>,
}

/// What a described request's body contributes: its fingerprint (for `body_hash`
/// descriptors) and, when a `token_bucket_llm` rule meters it, the parsed prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct DescribedBody<'a> {
    pub hash: Option<u64>,
    pub llm: Option<&'a crate::request::llm::LlmRequest>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_map_repeating_a_name_says_so() {
        let mut map = http::HeaderMap::new();
        map.insert("x-tier", http::HeaderValue::from_static("a"));
        map.insert("x-api-key", http::HeaderValue::from_static("k"));
        assert!(!HttpHeaders(&map).repeats_any());
        map.append("x-tier", http::HeaderValue::from_static("b"));
        assert!(HttpHeaders(&map).repeats_any());
        assert!(HttpHeaders(&map).is_repeated("x-tier"));
        assert!(!HttpHeaders(&map).is_repeated("x-api-key"));
    }
}
