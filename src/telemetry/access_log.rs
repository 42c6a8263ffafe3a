//! Access logs: one line per proxied request (allowed or refused), nginx-combined-like text or
//! JSON, queued for standard output ([`crate::telemetry::log_line`]: written in batches, off the request
//! path); and request IDs (`X-Request-Id`
//! kept when the client sent a sane one, generated otherwise). Off by default: nothing here
//! runs on the hot path unless `--access-log` asks for it.
//!
//! Secrets never reach a line: the target goes through [`crate::telemetry::redact::text`] (credential-like
//! query parameters and JWT-shaped tokens masked), and client-controlled text is escaped
//! ([`crate::telemetry::log_value`] in text lines, JSON's own escapes in JSON lines).

use crate::telemetry::log_line::{json_field, split_time};
use crate::telemetry::log_value::Escaped;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};

/// `--access-log`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccessLogFormat {
    #[default]
    Off,
    /// nginx "combined" plus `key=value` fields.
    Text,
    /// One JSON object per line.
    Json,
}

/// Everything one line says.
#[derive(Debug, Clone)]
pub struct AccessRecord<'a> {
    /// Wall-clock time the request arrived, in milliseconds since the Unix epoch.
    pub unix_ms: i64,
    pub client_ip: Option<IpAddr>,
    pub method: &'a str,
    pub host: Option<&'a str>,
    /// Path and query as sent (redacted when written).
    pub target: &'a str,
    /// `HTTP/1.1`, `HTTP/2`...
    pub protocol: &'a str,
    pub status: u16,
    /// Response body bytes sent to the client.
    pub bytes: usize,
    pub referer: Option<&'a str>,
    pub user_agent: Option<&'a str>,
    /// The upstream server that answered, if the request was proxied.
    pub upstream: Option<SocketAddr>,
    /// Seconds from choosing the upstream to its response header.
    pub upstream_secs: Option<f64>,
    /// Seconds from the request header to the end of the response.
    pub total_secs: f64,
    /// `allow`, `no_policy`, or the refusal reason (`token_bucket_exceeded`...).
    pub verdict: &'a str,
    /// The rule that refused the request.
    pub rule: Option<&'a str>,
    /// Seconds the request waited for its turn under a token-bucket rule's `delay` (`None`:
    /// it was not paced; the field is then left out).
    pub paced_wait_secs: Option<f64>,
    pub request_id: &'a str,
    /// A gRPC call's `rpc.service`, `rpc.method` and `rpc.grpc.status_code` (the status it
    /// ended with, when it ended with one): written after the request ID, only for calls.
    pub rpc: Option<(&'a str, &'a str, Option<u16>)>,
    /// The request's trace id (32 hex digits), when tracing is on: written last.
    pub trace_id: Option<&'a str>,
}

/// Formats one line (with its newline).
pub fn format(record: &AccessRecord<'_>, format: AccessLogFormat) -> String {
    let target = crate::telemetry::redact::text(record.target);
    // A referer carries other sites' query strings (reset tokens...); an absolute-form target
    // may carry `user:password@` in its authority.
    let referer = record.referer.map(crate::telemetry::redact::text);
    let referer = referer.as_deref();
    let host = record
        .host
        .map(|h| h.rsplit_once('@').map_or(h, |(_, host)| host));
    match format {
        AccessLogFormat::Off => String::new(),
        AccessLogFormat::Json => {
            // Written by hand in a fixed field order: a `serde_json::Value` map costs an
            // allocation per field and a sort per line.
            let mut line = String::with_capacity(320);
            line.push_str("{\"time\":\"");
            push_rfc3339_ms(&mut line, record.unix_ms);
            line.push_str("\",\"client_ip\":");
            match record.client_ip {
                Some(ip) => {
                    let _ = write!(line, "\"{ip}\"");
                }
                None => line.push_str("null"),
            }
            json_field(&mut line, "method", Some(record.method));
            json_field(&mut line, "host", host);
            json_field(&mut line, "path", Some(&target));
            json_field(&mut line, "protocol", Some(record.protocol));
            let _ = write!(
                line,
                ",\"status\":{},\"bytes\":{}",
                record.status, record.bytes
            );
            json_field(&mut line, "referer", referer);
            json_field(&mut line, "user_agent", record.user_agent);
            line.push_str(",\"upstream\":");
            match record.upstream {
                Some(addr) => {
                    let _ = write!(line, "\"{addr}\"");
                }
                None => line.push_str("null"),
            }
            line.push_str(",\"upstream_time\":");
            match record.upstream_secs {
                Some(secs) => {
                    let _ = write!(line, "{}", round_ms(secs));
                }
                None => line.push_str("null"),
            }
            let _ = write!(line, ",\"request_time\":{}", round_ms(record.total_secs));
            json_field(&mut line, "verdict", Some(record.verdict));
            json_field(&mut line, "rule", record.rule);
            if let Some(secs) = record.paced_wait_secs {
                let _ = write!(line, ",\"paced_wait\":{}", round_ms(secs));
            }
            json_field(&mut line, "request_id", Some(record.request_id));
            if let Some((service, method, status)) = record.rpc {
                json_field(&mut line, "rpc.service", Some(service));
                json_field(&mut line, "rpc.method", Some(method));
                line.push_str(",\"rpc.grpc.status_code\":");
                match status {
                    Some(code) => {
                        let _ = write!(line, "{code}");
                    }
                    None => line.push_str("null"),
                }
            }
            if let Some(trace_id) = record.trace_id {
                json_field(&mut line, "trace_id", Some(trace_id));
            }
            line.push_str("}\n");
            line
        }
        AccessLogFormat::Text => {
            let mut line = String::with_capacity(256);
            // Client-, upstream- and policy-chosen text through the one escaping point: a value
            // can neither end its quoted field nor forge a line.
            fn dash(v: Option<&str>) -> Escaped<'_> {
                Escaped(v.unwrap_or("-"))
            }
            let _ = write!(
                line,
                "{} - - [{}] \"{} {} {}\" {} {} \"{}\" \"{}\"",
                record
                    .client_ip
                    .map_or_else(|| "-".to_string(), |ip| ip.to_string()),
                nginx_time(record.unix_ms),
                Escaped(record.method),
                Escaped(&target),
                record.protocol,
                record.status,
                record.bytes,
                dash(referer),
                dash(record.user_agent),
            );
            let _ = write!(
                line,
                " host={} upstream={} upstream_time={} request_time={:.3} verdict={} rule={}",
                dash(host),
                record
                    .upstream
                    .map_or_else(|| "-".to_string(), |a| a.to_string()),
                record
                    .upstream_secs
                    .map_or_else(|| "-".to_string(), |s| format!("{s:.3}")),
                record.total_secs,
                Escaped(record.verdict),
                dash(record.rule),
            );
            if let Some((service, method, status)) = record.rpc {
                let _ = write!(
                    line,
                    " rpc.service={} rpc.method={} rpc.grpc.status_code={}",
                    Escaped(service),
                    Escaped(method),
                    status.map_or_else(|| "-".to_string(), |c| c.to_string()),
                );
            }
            if let Some(secs) = record.paced_wait_secs {
                let _ = write!(line, " paced_wait={secs:.3}");
            }
            let _ = write!(line, " request_id={}", Escaped(record.request_id));
            if let Some(trace_id) = record.trace_id {
                let _ = write!(line, " trace_id={}", Escaped(trace_id));
            }
            line.push('\n');
            line
        }
    }
}

/// Queues a formatted line for standard output (see [`crate::telemetry::log_line`]): a request never
/// waits on I/O.
pub fn write(line: String) {
    crate::telemetry::log_line::stdout(line.as_bytes());
}

fn round_ms(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

/// `2026-11-22T10:33:26.123Z`.
pub fn rfc3339_ms(unix_ms: i64) -> String {
    let mut out = String::with_capacity(24);
    push_rfc3339_ms(&mut out, unix_ms);
    out
}

fn push_rfc3339_ms(out: &mut String, unix_ms: i64) {
    let (y, mo, d, h, mi, s, ms) = split_time(unix_ms);
    let _ = write!(out, "{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{ms:03}Z");
}

/// nginx's `$time_local` in UTC: `22/Nov/2026:10:33:26 +0000`.
pub fn nginx_time(unix_ms: i64) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (y, mo, d, h, mi, s, _) = split_time(unix_ms);
    let month = MONTHS[(mo as usize).saturating_sub(1).min(11)];
    format!("{d:02}/{month}/{y:04}:{h:02}:{mi:02}:{s:02} +0000")
}

/// A request ID the client sent that is safe to keep and log: 1 to 128 characters of
/// `A-Z a-z 0-9 - _ . :` (anything else is replaced by a generated one).
pub fn acceptable_request_id(value: &[u8]) -> Option<&str> {
    let ok = !value.is_empty()
        && value.len() <= 128
        && value
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        std::str::from_utf8(value).ok()
    } else {
        None
    }
}

/// A new request ID: 32 hex digits, a per-process random half and a counter, unique within
/// the process and, with overwhelming likelihood, across a fleet.
pub fn new_request_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static PROCESS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let process = *PROCESS.get_or_init(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let seed = format!("{now}:{}", std::process::id());
        twox_hash::XxHash64::oneshot(0x7265_7175_6573_7469, seed.as_bytes())
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{process:016x}{n:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> AccessRecord<'static> {
        AccessRecord {
            unix_ms: 1_795_343_606_123,
            client_ip: Some("203.0.113.7".parse().unwrap()),
            method: "GET",
            host: Some("api.example.com"),
            target: "/v1/orders?limit=10&api_key=sekrit",
            protocol: "HTTP/2",
            status: 429,
            bytes: 17,
            referer: Some("https://shop.test/reset?token=abc"),
            user_agent: Some("curl/8 \"x\"\nforged"),
            upstream: None,
            upstream_secs: None,
            total_secs: 0.000_42,
            verdict: "token_bucket_exceeded",
            rule: Some("per-ip"),
            request_id: "abc-123",
            rpc: None,
            trace_id: None,
            paced_wait_secs: None,
        }
    }

    #[test]
    fn a_paced_request_states_its_wait() {
        let paced = AccessRecord {
            status: 200,
            verdict: "allow",
            rule: Some("paced"),
            paced_wait_secs: Some(0.2504),
            ..record()
        };
        let text = format(&paced, AccessLogFormat::Text);
        assert!(
            text.ends_with(" verdict=allow rule=paced paced_wait=0.250 request_id=abc-123\n"),
            "{text}"
        );
        let v: serde_json::Value =
            serde_json::from_str(format(&paced, AccessLogFormat::Json).trim_end()).unwrap();
        assert_eq!(v["paced_wait"], 0.25);
        assert!(!format(&record(), AccessLogFormat::Json).contains("paced_wait"));
        assert!(!format(&record(), AccessLogFormat::Text).contains("paced_wait"));
    }

    #[test]
    fn a_traced_request_names_its_trace_last() {
        let traced = AccessRecord {
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
            ..record()
        };
        let text = format(&traced, AccessLogFormat::Text);
        assert!(text.ends_with(" request_id=abc-123 trace_id=4bf92f3577b34da6a3ce929d0e0e4736\n"));
        let json = format(&traced, AccessLogFormat::Json);
        let v: serde_json::Value = serde_json::from_str(json.trim_end()).unwrap();
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(!format(&record(), AccessLogFormat::Text).contains("trace_id"));
    }

    #[test]
    fn text_lines_are_combined_like_escaped_and_redacted() {
        let line = format(&record(), AccessLogFormat::Text);
        assert_eq!(
            line,
            "203.0.113.7 - - [22/Nov/2026:10:33:26 +0000] \"GET /v1/orders?limit=10&api_key=*** HTTP/2\" 429 17 \"https://shop.test/reset?token=***\" \"curl/8 \\x22x\\x22\\x0Aforged\" host=api.example.com upstream=- upstream_time=- request_time=0.000 verdict=token_bucket_exceeded rule=per-ip request_id=abc-123\n"
        );
    }

    #[test]
    fn json_lines_parse_and_carry_the_verdict() {
        let mut r = record();
        r.status = 200;
        r.verdict = "allow";
        r.rule = None;
        r.upstream = Some("127.0.0.1:3000".parse().unwrap());
        r.upstream_secs = Some(0.0123);
        let line = format(&r, AccessLogFormat::Json);
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["time"], "2026-11-22T10:33:26.123Z");
        assert_eq!(v["path"], "/v1/orders?limit=10&api_key=***");
        assert_eq!(v["status"], 200);
        assert_eq!(v["verdict"], "allow");
        assert_eq!(v["rule"], serde_json::Value::Null);
        assert_eq!(v["upstream"], "127.0.0.1:3000");
        assert_eq!(v["upstream_time"], 0.012);
        assert_eq!(v["user_agent"], "curl/8 \"x\"\nforged");
    }

    proptest::proptest! {
        /// Whatever a client sends, a JSON line parses and carries it back unchanged.
        #[test]
        fn json_lines_always_parse(agent in ".*", target in ".*", host in ".*") {
            let mut r = record();
            r.user_agent = Some(&agent);
            r.target = &target;
            r.host = Some(&host);
            let line = format(&r, AccessLogFormat::Json);
            proptest::prop_assert_eq!(line.matches('\n').count(), 1);
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            proptest::prop_assert_eq!(v["user_agent"].as_str(), Some(agent.as_str()));
            let shown = host.rsplit_once('@').map_or(host.as_str(), |(_, h)| h);
            proptest::prop_assert_eq!(v["host"].as_str(), Some(shown));
            proptest::prop_assert_eq!(v["path"].as_str(), Some(&*crate::telemetry::redact::text(&target)));
        }

        /// A text line is one line, whatever the client sends.
        #[test]
        fn text_lines_are_one_line(agent in ".*", target in ".*") {
            let mut r = record();
            r.user_agent = Some(&agent);
            r.target = &target;
            let line = format(&r, AccessLogFormat::Text);
            proptest::prop_assert_eq!(line.matches('\n').count(), 1);
            proptest::prop_assert!(line.ends_with('\n'));
        }
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(nginx_time(1_709_164_800_999), "29/Feb/2024:00:00:00 +0000");
    }

    #[test]
    fn request_ids_are_kept_only_when_sane_and_generated_unique() {
        assert_eq!(acceptable_request_id(b"req-42:a.b_c"), Some("req-42:a.b_c"));
        assert_eq!(acceptable_request_id(b""), None);
        assert_eq!(acceptable_request_id(b"has space"), None);
        assert_eq!(acceptable_request_id(b"line\nbreak"), None);
        assert_eq!(acceptable_request_id(&[b'a'; 129]), None);
        let a = new_request_id();
        let b = new_request_id();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert_eq!(a[..16], b[..16]);
    }
}
