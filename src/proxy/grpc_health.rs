//! The gRPC health check of a group with `"health": "grpc"`: a unary
//! `grpc.health.v1.Health/Check` call over the group's own HTTP/2 (h2c or TLS with ALPN `h2`),
//! asking about the check's `service` (empty: the server as a whole). A server passes when the
//! call ends with `grpc-status: 0` and the answer says `SERVING`; anything else (another status,
//! `NOT_SERVING`, `SERVICE_UNKNOWN`, no answer within the check's timeout) fails it.

use crate::config::routes::HealthCheckSpec;
use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::lb::health_check::HealthCheck;
use pingora::lb::Backend;
use pingora::prelude::HttpPeer;
use pingora::{Error, ErrorType, OrErr, Result};
use prost::Message;

/// The health service's method path.
pub const HEALTH_CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

/// A failed gRPC health check.
const GRPC_HEALTH_FAILED: ErrorType = ErrorType::Custom("grpc health check failed");

/// A gRPC health check with the group's thresholds.
pub struct GrpcHealthCheck {
    peer_template: HttpPeer,
    authority: String,
    /// The request message, framed once.
    body: Bytes,
    healthy_threshold: usize,
    unhealthy_threshold: usize,
    connector: Connector,
}

impl GrpcHealthCheck {
    /// A check of `service` on the servers of a group whose peers `peer_template` describes.
    pub fn new(
        peer_template: HttpPeer,
        authority: String,
        service: &str,
        spec: &HealthCheckSpec,
    ) -> GrpcHealthCheck {
        let request = tonic_health::pb::HealthCheckRequest {
            service: service.to_string(),
        };
        let message = request.encode_to_vec();
        let mut body = BytesMut::with_capacity(5 + message.len());
        body.put_u8(0);
        body.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
        body.put_slice(&message);
        GrpcHealthCheck {
            peer_template,
            authority,
            body: body.freeze(),
            healthy_threshold: spec.healthy_threshold,
            unhealthy_threshold: spec.unhealthy_threshold,
            connector: Connector::new(None),
        }
    }

    fn request(&self) -> Result<RequestHeader> {
        let mut req = RequestHeader::build("POST", HEALTH_CHECK_PATH.as_bytes(), None)?;
        let scheme = if self.peer_template.is_tls() {
            "https"
        } else {
            "http"
        };
        let uri = format!("{scheme}://{}{HEALTH_CHECK_PATH}", self.authority);
        req.set_uri(
            uri.parse::<http::Uri>()
                .or_err(ErrorType::InvalidHTTPHeader, "health check authority")?,
        );
        req.insert_header(http::header::CONTENT_TYPE, "application/grpc")?;
        req.insert_header(http::header::TE, "trailers")?;
        Ok(req)
    }
}

/// The serving status in a framed `HealthCheckResponse` body.
fn serving_status(body: &[u8]) -> Option<i32> {
    let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
    if body.first() != Some(&0) {
        return None;
    }
    let message = body.get(5..5 + len)?;
    tonic_health::pb::HealthCheckResponse::decode(message)
        .ok()
        .map(|r| r.status)
}

#[async_trait]
impl HealthCheck for GrpcHealthCheck {
    fn health_threshold(&self, success: bool) -> usize {
        if success {
            self.healthy_threshold
        } else {
            self.unhealthy_threshold
        }
    }

    async fn check(&self, target: &Backend) -> Result<()> {
        let mut peer = self.peer_template.clone();
        peer._address = target.addr.clone();
        let (mut session, _) = self.connector.get_http_session(&peer).await?;
        session.set_write_timeout(peer.options.read_timeout);
        session.set_read_timeout(peer.options.read_timeout);
        session
            .write_request_header(Box::new(self.request()?))
            .await?;
        session.write_request_body(self.body.clone(), true).await?;
        session.finish_request_body().await?;
        session.read_response_header().await?;
        let status = session.response_header().map(|r| r.status.as_u16());
        if status != Some(200) {
            return Error::e_explain(GRPC_HEALTH_FAILED, format!("HTTP status {status:?}"));
        }
        let mut body = Vec::new();
        while let Some(piece) = session.read_response_body().await? {
            body.extend_from_slice(&piece);
        }
        // A trailers-only answer carries its status in the header; otherwise in the trailers.
        let header_status = session
            .response_header()
            .and_then(|r| r.headers.get("grpc-status"))
            .map(|v| v.as_bytes().to_vec());
        let grpc_status = match header_status {
            Some(v) => Some(v),
            None => match &mut session {
                pingora::protocols::http::client::HttpSession::H2(h2) => h2
                    .read_trailers()
                    .await?
                    .and_then(|t| t.get("grpc-status").map(|v| v.as_bytes().to_vec())),
                _ => None,
            },
        };
        if grpc_status.as_deref() != Some(b"0") {
            return Error::e_explain(
                GRPC_HEALTH_FAILED,
                format!(
                    "grpc-status {:?}",
                    grpc_status.map(|s| String::from_utf8_lossy(&s).into_owned())
                ),
            );
        }
        // SERVING is 1 in grpc.health.v1.
        match serving_status(&body) {
            Some(1) => Ok(()),
            other => Error::e_explain(GRPC_HEALTH_FAILED, format!("serving status {other:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_status_reads_a_framed_answer() {
        let answer = tonic_health::pb::HealthCheckResponse { status: 1 }.encode_to_vec();
        let mut framed = vec![0];
        framed.extend_from_slice(&(answer.len() as u32).to_be_bytes());
        framed.extend_from_slice(&answer);
        assert_eq!(serving_status(&framed), Some(1));
        let not = tonic_health::pb::HealthCheckResponse { status: 2 }.encode_to_vec();
        let mut framed = vec![0];
        framed.extend_from_slice(&(not.len() as u32).to_be_bytes());
        framed.extend_from_slice(&not);
        assert_eq!(serving_status(&framed), Some(2));
        assert_eq!(serving_status(&[0, 0, 0]), None);
        assert_eq!(serving_status(&[1, 0, 0, 0, 0]), None);
    }
}
