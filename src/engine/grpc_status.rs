//! How a refusal reads to a gRPC client: the status code each refusal maps to, its
//! `grpc-message`, and the `grpc-status-details-bin` value, a `google.rpc.Status` carrying
//! `google.rpc.RetryInfo` (the refusal's `Retry-After`) and `google.rpc.QuotaFailure` (the
//! rule that refused). The messages are the published `google/rpc/status.proto` and
//! `error_details.proto` shapes, written with prost. Pure: no I/O.

use crate::engine::Reason;
use base64::Engine as _;
use prost::Message;

/// The gRPC status codes a gateway answer may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcCode {
    Ok = 0,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

impl GrpcCode {
    /// The number in `grpc-status`.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// The code's name, as gRPC's documentation and OpenTelemetry spell it.
    pub fn name(self) -> &'static str {
        match self {
            GrpcCode::Ok => "OK",
            GrpcCode::Unknown => "UNKNOWN",
            GrpcCode::InvalidArgument => "INVALID_ARGUMENT",
            GrpcCode::DeadlineExceeded => "DEADLINE_EXCEEDED",
            GrpcCode::PermissionDenied => "PERMISSION_DENIED",
            GrpcCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
            GrpcCode::Unimplemented => "UNIMPLEMENTED",
            GrpcCode::Internal => "INTERNAL",
            GrpcCode::Unavailable => "UNAVAILABLE",
            GrpcCode::Unauthenticated => "UNAUTHENTICATED",
        }
    }

    /// The code for a gateway answer of HTTP `status` (what a gRPC client would make of it
    /// had it been a plain HTTP answer, except 429, which means exhausted, not unavailable).
    pub fn of_status(status: u16) -> GrpcCode {
        match status {
            200 => GrpcCode::Ok,
            400 => GrpcCode::InvalidArgument,
            401 => GrpcCode::Unauthenticated,
            403 => GrpcCode::PermissionDenied,
            404 => GrpcCode::Unimplemented,
            413 | 429 | 431 => GrpcCode::ResourceExhausted,
            502 | 503 => GrpcCode::Unavailable,
            504 => GrpcCode::DeadlineExceeded,
            500 => GrpcCode::Internal,
            _ => GrpcCode::Unknown,
        }
    }

    /// The code a refusal for `reason` gets: a spent limit is `RESOURCE_EXHAUSTED`; a kill
    /// switch `PERMISSION_DENIED` (an operator's refusal, not a condition that a retry cures);
    /// a closed store `UNAVAILABLE`; a missing credential `UNAUTHENTICATED`; a malformed
    /// request `INVALID_ARGUMENT`. Any other reason follows its HTTP status.
    pub fn of_reason(reason: Reason) -> GrpcCode {
        match reason {
            Reason::KillSwitch => GrpcCode::PermissionDenied,
            Reason::StoreUnavailable => GrpcCode::Unavailable,
            Reason::MissingDescriptor => GrpcCode::Unauthenticated,
            other => GrpcCode::of_status(other.status()),
        }
    }
}

/// `google.rpc.Status`.
#[derive(Clone, PartialEq, Message)]
pub struct RpcStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, Message)]
pub struct Any {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `google.rpc.RetryInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    pub retry_delay: Option<Duration>,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, Message)]
pub struct Duration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// `google.rpc.QuotaFailure`.
#[derive(Clone, PartialEq, Message)]
pub struct QuotaFailure {
    #[prost(message, repeated, tag = "1")]
    pub violations: Vec<QuotaViolation>,
}

/// `google.rpc.QuotaFailure.Violation`.
#[derive(Clone, PartialEq, Message)]
pub struct QuotaViolation {
    #[prost(string, tag = "1")]
    pub subject: String,
    #[prost(string, tag = "2")]
    pub description: String,
}

pub const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";
pub const QUOTA_FAILURE_TYPE: &str = "type.googleapis.com/google.rpc.QuotaFailure";

/// What a gRPC refusal says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcRefusal {
    pub code: GrpcCode,
    /// `grpc-message` before percent-encoding.
    pub message: String,
    /// Seconds until a retry may succeed (the refusal's `Retry-After`).
    pub retry_after_secs: Option<u64>,
    /// The rule that refused, named in a `QuotaFailure` violation.
    pub rule: Option<String>,
}

impl GrpcRefusal {
    /// The `google.rpc.Status` of this refusal, protobuf-encoded: `RetryInfo` when a retry
    /// delay is known, `QuotaFailure` when a rule refused.
    pub fn status_proto(&self) -> Vec<u8> {
        let mut details = Vec::new();
        if let Some(secs) = self.retry_after_secs {
            let info = RetryInfo {
                retry_delay: Some(Duration {
                    seconds: i64::try_from(secs).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
            };
            details.push(Any {
                type_url: RETRY_INFO_TYPE.to_string(),
                value: info.encode_to_vec(),
            });
        }
        if let Some(rule) = &self.rule {
            let failure = QuotaFailure {
                violations: vec![QuotaViolation {
                    subject: format!("rule:{rule}"),
                    description: self.message.clone(),
                }],
            };
            details.push(Any {
                type_url: QUOTA_FAILURE_TYPE.to_string(),
                value: failure.encode_to_vec(),
            });
        }
        RpcStatus {
            code: i32::from(self.code.number()),
            message: self.message.clone(),
            details,
        }
        .encode_to_vec()
    }

    /// The `grpc-status-details-bin` header value: the status, base64 without padding (as
    /// gRPC writes binary headers).
    pub fn details_bin(&self) -> String {
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(self.status_proto())
    }

    /// The `grpc-message` header value: percent-encoded as gRPC's wire format asks (every
    /// byte outside printable ASCII, and `%`).
    pub fn message_header(&self) -> String {
        percent_encode_message(&self.message)
    }
}

/// Percent-encodes a `grpc-message` (bytes outside 0x20..=0x7E, and `%`).
pub fn percent_encode_message(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The `grpc-message` of a refusal: the first line of its HTTP body for text bodies, the
/// reason's name for JSON ones.
pub fn message_of(body: Option<&str>, reason: Option<Reason>) -> String {
    match body {
        Some(text) if !text.starts_with('{') => text.lines().next().unwrap_or("").to_string(),
        _ => reason.map_or_else(
            || "Too Many Requests".to_string(),
            |r| r.as_str().to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_their_codes() {
        assert_eq!(
            GrpcCode::of_reason(Reason::TokenBucketExceeded),
            GrpcCode::ResourceExhausted
        );
        assert_eq!(GrpcCode::of_reason(Reason::TokenBucketExceeded).number(), 8);
        assert_eq!(
            GrpcCode::of_reason(Reason::BudgetExceeded),
            GrpcCode::ResourceExhausted
        );
        assert_eq!(
            GrpcCode::of_reason(Reason::KillSwitch),
            GrpcCode::PermissionDenied
        );
        assert_eq!(
            GrpcCode::of_reason(Reason::StoreUnavailable),
            GrpcCode::Unavailable
        );
        assert_eq!(
            GrpcCode::of_reason(Reason::MissingDescriptor),
            GrpcCode::Unauthenticated
        );
        assert_eq!(
            GrpcCode::of_reason(Reason::EncodedSlash),
            GrpcCode::InvalidArgument
        );
        assert_eq!(GrpcCode::of_status(413), GrpcCode::ResourceExhausted);
        assert_eq!(GrpcCode::of_status(404), GrpcCode::Unimplemented);
        assert_eq!(GrpcCode::of_status(504), GrpcCode::DeadlineExceeded);
    }

    /// The details decode as the published messages, with the delay and the rule.
    #[test]
    fn details_carry_retry_info_and_quota_failure() {
        let refusal = GrpcRefusal {
            code: GrpcCode::ResourceExhausted,
            message: "Too Many Requests".into(),
            retry_after_secs: Some(7),
            rule: Some("per-method".into()),
        };
        let bin = refusal.details_bin();
        assert!(!bin.ends_with('='));
        let bytes = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(bin)
            .unwrap();
        let status = RpcStatus::decode(bytes.as_slice()).unwrap();
        assert_eq!(status.code, 8);
        assert_eq!(status.message, "Too Many Requests");
        assert_eq!(status.details.len(), 2);
        assert_eq!(status.details[0].type_url, RETRY_INFO_TYPE);
        let info = RetryInfo::decode(status.details[0].value.as_slice()).unwrap();
        assert_eq!(
            info.retry_delay,
            Some(Duration {
                seconds: 7,
                nanos: 0
            })
        );
        assert_eq!(status.details[1].type_url, QUOTA_FAILURE_TYPE);
        let failure = QuotaFailure::decode(status.details[1].value.as_slice()).unwrap();
        assert_eq!(failure.violations[0].subject, "rule:per-method");
        // Without a delay or a rule, neither detail.
        let bare = GrpcRefusal {
            code: GrpcCode::InvalidArgument,
            message: "bad".into(),
            retry_after_secs: None,
            rule: None,
        };
        let status = RpcStatus::decode(bare.status_proto().as_slice()).unwrap();
        assert_eq!((status.code, status.details.len()), (3, 0));
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode_message("a b%c\né"), "a b%25c%0A%C3%A9");
        assert_eq!(
            message_of(Some("Too Many Requests: x\nmore"), None),
            "Too Many Requests: x"
        );
        assert_eq!(
            message_of(Some("{\"error\":1}"), Some(Reason::TpmExceeded)),
            "tpm_exceeded"
        );
    }
}
