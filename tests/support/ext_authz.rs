//! Envoy ext_authz requests for the gRPC tests: what Envoy sends for a described request.

use envoy_types::pb::envoy::config::core::v3::{address, Address, SocketAddress};
use envoy_types::pb::envoy::service::auth::v3::attribute_context::{
    HttpRequest, Peer, Request as AttrRequest,
};
use envoy_types::pb::envoy::service::auth::v3::{AttributeContext, CheckRequest};

/// An ext_authz `Check` for `GET path` from `peer`, with the described request's headers.
pub fn check_request(peer: &str, path: &str, headers: &[(&str, &str)]) -> CheckRequest {
    CheckRequest {
        attributes: Some(AttributeContext {
            source: Some(Peer {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: peer.to_string(),
                        ..SocketAddress::default()
                    })),
                }),
                ..Peer::default()
            }),
            request: Some(AttrRequest {
                http: Some(HttpRequest {
                    method: "GET".into(),
                    path: path.into(),
                    host: "api.example.com".into(),
                    headers: headers
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    ..HttpRequest::default()
                }),
                ..AttrRequest::default()
            }),
            ..AttributeContext::default()
        }),
    }
}
