//! `--compat fairvisor`: answering as Fairvisor Edge does where tollgate differs on purpose.
//! The reason header is `X-Fairvisor-Reason` and is shown only to a debug session (a signed
//! `fv_dbg` cookie from `POST /v1/debug/session` with `X-Fairvisor-Debug-Secret`), which also
//! gets Fairvisor's verbose `X-Fairvisor-Debug-*` headers; the warning header is
//! `X-Fairvisor-Warning`; `/metrics` adds Fairvisor's `fairvisor_*` families beside tollgate's;
//! with `--jwt-unverified`, a token whose header segment is not JSON still gives its payload's
//! claims (the last is in [`crate::auth`]).
//!
//! Pure: the caller passes the time, the headers and the decision.

use crate::engine::{Decision, RefusedBy};
use crate::headers::HeaderList;
use crate::policy::Bundle;
use base64::Engine as _;
use http::{HeaderName, HeaderValue};
use std::fmt::Write as _;

/// `--compat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compat {
    #[default]
    Off,
    Fairvisor,
}

/// Fairvisor's header names.
pub const REASON_HEADER: &str = "X-Fairvisor-Reason";
pub static WARNING_HEADER: HeaderName = HeaderName::from_static("x-fairvisor-warning");
pub const SECRET_HEADER: &str = "x-fairvisor-debug-secret";
/// The debug session cookie, and how long a session lasts (Fairvisor's 15 minutes).
pub const COOKIE: &str = "fv_dbg";
pub const SESSION_SECS: u64 = 900;

/// `--debug-session-secret`: signs and checks debug-session cookies; never shown.
pub struct DebugSessions {
    key: ring::hmac::Key,
    secret_digest: [u8; 32],
}

impl std::fmt::Debug for DebugSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DebugSessions(<redacted>)")
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

impl DebugSessions {
    pub fn new(secret: &[u8]) -> Self {
        DebugSessions {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
            secret_digest: sha256(secret),
        }
    }

    /// Whether `provided` is the secret (digests compared in constant time).
    pub fn secret_matches(&self, provided: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(sha256(provided)[..].ct_eq(&self.secret_digest[..]))
    }

    fn sign(&self, payload: &str) -> String {
        let tag = ring::hmac::sign(&self.key, payload.as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tag.as_ref())
    }

    /// The `Set-Cookie` value that opens a session until `now + SESSION_SECS`.
    pub fn open(&self, unix_secs: u64) -> String {
        let expires = unix_secs + SESSION_SECS;
        format!(
            "{COOKIE}={expires}.{}; Path=/; Max-Age={SESSION_SECS}; HttpOnly; Secure; SameSite=Strict",
            self.sign(&expires.to_string())
        )
    }

    /// Whether a `Cookie` header carries a session that is signed and not expired.
    pub fn is_open(&self, cookie_header: Option<&str>, unix_secs: u64) -> bool {
        let Some(token) = cookie_header.and_then(|header| {
            header.split(';').find_map(|part| {
                let (name, value) = part.split_once('=')?;
                (name.trim() == COOKIE).then(|| value.trim())
            })
        }) else {
            return false;
        };
        let Some((expires, signature)) = token.split_once('.') else {
            return false;
        };
        let Ok(expires_at) = expires.parse::<u64>() else {
            return false;
        };
        if expires_at <= unix_secs {
            return false;
        }
        let Ok(tag) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(signature) else {
            return false;
        };
        ring::hmac::verify(&self.key, expires.as_bytes(), &tag).is_ok()
    }
}

/// The `Set-Cookie` value that ends a session.
pub const CLOSE_COOKIE: &str = "fv_dbg=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict";

/// What Fairvisor calls the decision: `reject`, `throttle` or `allow`.
fn action(decision: &Decision<'_>) -> &'static str {
    match decision {
        Decision::Refuse(_) => "reject",
        _ if decision.checked().is_some_and(|c| c.throttle_ms() > 0) => "throttle",
        _ => "allow",
    }
}

/// The policy and rule a decision names: the refusing rule, else the first rule that applied.
fn policy_and_rule<'d>(decision: &'d Decision<'_>) -> (&'d str, &'d str, &'static str) {
    let rule = match decision.refused_by() {
        Some(RefusedBy::Rule(rule)) => Some(rule),
        Some(RefusedBy::KillSwitch(_)) => return ("kill_switch", "", "enforce"),
        Some(RefusedBy::Request) => None,
        None => decision.rules().first().map(|r| r.rule),
    };
    rule.map_or(("", "", "enforce"), |r| {
        (r.policy_id.as_str(), r.name.as_str(), r.mode.as_str())
    })
}

/// Fairvisor's response headers for this decision: without a debug session the reason header
/// goes; with one, the verbose headers join it.
pub fn finish_headers(
    headers: &mut HeaderList,
    decision: &Decision<'_>,
    reason_header: &HeaderName,
    debug_session: bool,
) {
    if !debug_session {
        headers.retain(|(name, _)| name != reason_header);
        return;
    }
    let (policy, rule, mode) = policy_and_rule(decision);
    let reason = match decision {
        Decision::Refuse(refusal) => refusal.reason.as_str(),
        _ => "",
    };
    let action = action(decision);
    for (name, value) in [
        ("x-fairvisor-decision", action),
        ("x-fairvisor-mode", mode),
        ("x-fairvisor-debug-decision", action),
        ("x-fairvisor-debug-mode", mode),
        ("x-fairvisor-debug-reason", reason),
        ("x-fairvisor-debug-policy", policy),
        ("x-fairvisor-debug-rule", rule),
    ] {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.push((HeaderName::from_static(name), value));
        }
    }
}

/// The samples of metric `name` in Prometheus text: each one's label text and value.
fn samples<'t>(text: &'t str, name: &'t str) -> impl Iterator<Item = (&'t str, f64)> + 't {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        Some((labels, value.trim().parse::<f64>().ok()?))
    })
}

/// The `fairvisor_*` families a Fairvisor dashboard queries, from tollgate's own metrics text:
/// decisions by action and policy, the decision latency histogram, LLM tokens, loop refusals,
/// runtime overrides and the bundle; families tollgate has no counterpart for (the SaaS
/// connection, per-request remaining tokens) are exported at 0 so every name exists.
pub fn fairvisor_metrics(tollgate: &str, bundle: Option<&Bundle>, unix_secs: i64) -> String {
    let mut out = String::with_capacity(4096);
    let label = |labels: &str, key: &str| -> String {
        labels
            .split("\",")
            .find_map(|pair| {
                let (k, v) = pair.split_once("=\"")?;
                (k.trim_start_matches(',') == key).then(|| v.trim_end_matches('"').to_string())
            })
            .unwrap_or_default()
    };
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };

    family(
        &mut out,
        "fairvisor_decisions_total",
        "counter",
        "Decisions by action and policy (tollgate_decisions_total)",
    );
    let mut decisions: std::collections::BTreeMap<(String, String), f64> = Default::default();
    for (labels, value) in samples(tollgate, "tollgate_decisions_total") {
        let action = match label(labels, "action").as_str() {
            "allow" => "allow",
            "reject" => "reject",
            "would_reject" => "shadow_reject",
            _ => continue,
        }
        .to_string();
        *decisions
            .entry((action, label(labels, "policy")))
            .or_default() += value;
    }
    for ((action, policy), value) in &decisions {
        let _ = writeln!(
            out,
            "fairvisor_decisions_total{{action=\"{action}\",policy_id=\"{policy}\"}} {value}"
        );
    }

    family(
        &mut out,
        "fairvisor_decision_duration_seconds",
        "histogram",
        "Decision latency (tollgate_decision_duration_seconds)",
    );
    for line in tollgate.lines() {
        if let Some(rest) = line.strip_prefix("tollgate_decision_duration_seconds") {
            let _ = writeln!(out, "fairvisor_decision_duration_seconds{rest}");
        }
    }

    let sum = |name: &str| samples(tollgate, name).map(|(_, v)| v).sum::<f64>();
    let loops: f64 = samples(tollgate, "tollgate_decisions_total")
        .filter(|(labels, _)| label(labels, "reason") == "loop_detected")
        .map(|(_, v)| v)
        .sum();
    let active = |name: &str| {
        samples(tollgate, "tollgate_runtime_override_active")
            .filter(|(labels, _)| label(labels, "override") == name)
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    let in_force = bundle.map(|b| b.in_force(unix_secs));
    let kill_switches = in_force.map_or(0, |b| b.kill_switches.len());
    let shadow_policies = in_force.map_or(0, |b| {
        b.policies
            .iter()
            .filter(|p| p.mode == crate::policy::Mode::Shadow)
            .count()
    });
    for (name, kind, help, value) in [
        (
            "fairvisor_ratelimit_remaining",
            "gauge",
            "Not tracked by tollgate (see the RateLimit headers)",
            0.0,
        ),
        (
            "fairvisor_tokens_consumed_total",
            "counter",
            "LLM tokens used (tollgate_llm_tokens_used_total)",
            sum("tollgate_llm_tokens_used_total"),
        ),
        (
            "fairvisor_tokens_remaining",
            "gauge",
            "Not tracked by tollgate (GET /v1/buckets shows a bucket)",
            0.0,
        ),
        (
            "fairvisor_token_estimation_accuracy_ratio",
            "gauge",
            "Not tracked as a gauge (tollgate_llm_prompt_estimate_ratio)",
            0.0,
        ),
        (
            "fairvisor_token_reservation_unused_total",
            "counter",
            "LLM tokens refunded (tollgate_llm_tokens_refunded_total)",
            sum("tollgate_llm_tokens_refunded_total"),
        ),
        (
            "fairvisor_loop_detected_total",
            "counter",
            "Requests refused as loops",
            loops,
        ),
        (
            "fairvisor_circuit_state",
            "gauge",
            "Breaker trips (tollgate_circuit_breaker_trips_total)",
            sum("tollgate_circuit_breaker_trips_total"),
        ),
        (
            "fairvisor_kill_switch_active",
            "gauge",
            "Kill switches in the bundle in force",
            kill_switches as f64,
        ),
        (
            "fairvisor_shadow_mode_active",
            "gauge",
            "Policies in shadow mode",
            shadow_policies as f64,
        ),
        (
            "fairvisor_global_shadow_active",
            "gauge",
            "global_shadow in force",
            active("global_shadow"),
        ),
        (
            "fairvisor_kill_switch_override_active",
            "gauge",
            "kill_switch_override in force",
            active("kill_switch_override"),
        ),
        (
            "fairvisor_saas_reachable",
            "gauge",
            "tollgate has no SaaS connection",
            0.0,
        ),
        (
            "fairvisor_saas_calls_total",
            "counter",
            "tollgate has no SaaS connection",
            0.0,
        ),
        (
            "fairvisor_events_sent_total",
            "counter",
            "tollgate has no SaaS connection",
            0.0,
        ),
    ] {
        family(&mut out, name, kind, help);
        let _ = writeln!(out, "{name} {value}");
    }
    family(
        &mut out,
        "fairvisor_config_info",
        "gauge",
        "The bundle in force (value 1)",
    );
    if let Some(b) = bundle {
        let _ = writeln!(
            out,
            "fairvisor_config_info{{version=\"{}\",hash=\"{}\"}} 1",
            b.version.replace(['"', '\\', '\n'], "_"),
            b.hash
        );
    }
    family(
        &mut out,
        "fairvisor_build_info",
        "gauge",
        "The gateway's build (value 1)",
    );
    let _ = writeln!(
        out,
        "fairvisor_build_info{{version=\"{}\",implementation=\"tollgate\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_signed_expire_and_refuse_forgeries() {
        let sessions = DebugSessions::new(b"e2e-debug-secret");
        assert!(sessions.secret_matches(b"e2e-debug-secret"));
        assert!(!sessions.secret_matches(b"e2e-debug-secreT"));
        let set = sessions.open(1_000);
        assert!(set.starts_with("fv_dbg=1900."), "{set}");
        assert!(set.ends_with("; Path=/; Max-Age=900; HttpOnly; Secure; SameSite=Strict"));
        let cookie = set.split(';').next().unwrap().to_string();
        assert!(sessions.is_open(Some(&cookie), 1_899));
        assert!(sessions.is_open(Some(&format!("a=b; {cookie}; c=d")), 1_000));
        assert!(!sessions.is_open(Some(&cookie), 1_900), "expired");
        let forged = cookie.replace("1900.", "9999.");
        assert!(!sessions.is_open(Some(&forged), 1_000));
        let other = DebugSessions::new(b"another secret").open(1_000);
        assert!(!sessions.is_open(Some(other.split(';').next().unwrap()), 1_000));
        assert!(!sessions.is_open(None, 1_000));
        assert!(!sessions.is_open(Some("fv_dbg=garbage"), 1_000));
        assert_eq!(format!("{sessions:?}"), "DebugSessions(<redacted>)");
    }

    #[test]
    fn every_fairvisor_family_is_exported_from_tollgates_text() {
        let text = "tollgate_decisions_total{action=\"reject\",mode=\"enforce\",policy=\"p\",reason=\"loop_detected\",rule=\"r\"} 2\n\
                    tollgate_decisions_total{action=\"allow\",mode=\"enforce\",policy=\"p\",reason=\"\",rule=\"r\"} 5\n\
                    tollgate_decision_duration_seconds_count 7\n";
        let out = fairvisor_metrics(text, None, 0);
        assert!(
            out.contains("fairvisor_decisions_total{action=\"reject\",policy_id=\"p\"} 2\n"),
            "{out}"
        );
        assert!(out.contains("fairvisor_decisions_total{action=\"allow\",policy_id=\"p\"} 5\n"));
        assert!(out.contains("fairvisor_decision_duration_seconds_count 7\n"));
        assert!(out.contains("fairvisor_loop_detected_total 2\n"));
        for name in [
            "fairvisor_ratelimit_remaining",
            "fairvisor_tokens_consumed_total",
            "fairvisor_tokens_remaining",
            "fairvisor_token_estimation_accuracy_ratio",
            "fairvisor_token_reservation_unused_total",
            "fairvisor_circuit_state",
            "fairvisor_kill_switch_active",
            "fairvisor_shadow_mode_active",
            "fairvisor_global_shadow_active",
            "fairvisor_kill_switch_override_active",
            "fairvisor_saas_reachable",
            "fairvisor_saas_calls_total",
            "fairvisor_events_sent_total",
            "fairvisor_config_info",
            "fairvisor_build_info",
        ] {
            assert!(out.contains(&format!("# TYPE {name} ")), "{name}");
        }
    }
}
