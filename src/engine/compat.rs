//! `--compat fairvisor`: answering as Fairvisor Edge does where tollgate differs on purpose.
//! The reason header is `X-Fairvisor-Reason` and is shown only to a debug session (an `fv_dbg`
//! cookie from `POST /v1/debug/session` with `X-Fairvisor-Debug-Secret`, see
//! [`DebugSessions`]: failed attempts throttled per client, logout ending it), which also
//! gets Fairvisor's verbose `X-Fairvisor-Debug-*` headers; the warning header is
//! `X-Fairvisor-Warning`; `/metrics` adds Fairvisor's `fairvisor_*` families beside tollgate's;
//! with `--jwt-unverified`, a token whose header segment is not JSON still gives its payload's
//! claims (the last is in [`crate::request::auth`]).
//!
//! Pure: the caller passes the time, the headers, the decision and the random bytes a session
//! needs.

use crate::engine::headers::HeaderList;
use crate::engine::{Decision, RefusedBy};
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

/// The shortest debug-session secret taken: the admin token's rule, since a session reads what
/// the operator endpoints would tell.
pub const MIN_SECRET_CHARS: usize = 16;
/// Failed attempts (no secret, or a wrong one) a client may make in [`ATTEMPT_WINDOW_SECS`];
/// past them its attempts answer 429 until the window ends, the secret not even compared.
pub const MAX_FAILED_ATTEMPTS: u32 = 5;
/// The window failed attempts are counted in, from a client's first failure.
pub const ATTEMPT_WINDOW_SECS: u64 = 300;
/// Clients whose failures are remembered at once. When every entry is still in its window, a
/// client not among them is throttled too (failing closed: a flood of addresses locks debug
/// logins, never opens them).
pub const MAX_TRACKED_CLIENTS: usize = 4096;
/// Sessions open at once; opening one more ends the one closest to its expiry.
pub const MAX_OPEN_SESSIONS: usize = 1024;
/// Random bytes naming a session (its cookie carries them, signed).
pub const SESSION_ID_BYTES: usize = 16;

/// Why a debug-session secret is refused at start-up (the secret itself is never shown).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("must be at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 16`)")]
    TooShort,
    #[error("must be printable ASCII without spaces (it travels in the X-Fairvisor-Debug-Secret header)")]
    NotPrintable,
}

/// `--debug-session-secret` (or its file): kept as its SHA-256 digest only, compared in
/// constant time; never shown.
#[derive(Clone)]
pub struct DebugSecret {
    digest: [u8; 32],
}

impl std::fmt::Debug for DebugSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DebugSecret(<redacted>)")
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

impl DebugSecret {
    /// # Errors
    /// The secret is shorter than [`MIN_SECRET_CHARS`], or could not travel in a header.
    pub fn new(secret: &str) -> Result<Self, SecretError> {
        if secret.chars().count() < MIN_SECRET_CHARS {
            return Err(SecretError::TooShort);
        }
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SecretError::NotPrintable);
        }
        Ok(DebugSecret {
            digest: sha256(secret.as_bytes()),
        })
    }

    /// Whether `provided` is the secret (digests compared in constant time). An empty value
    /// never is.
    pub fn matches(&self, provided: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        !provided.is_empty() && bool::from(sha256(provided)[..].ct_eq(&self.digest[..]))
    }
}

/// Why a login was refused (the label of `tollgate_debug_session_failures_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No `X-Fairvisor-Debug-Secret`, or an empty one.
    NoSecret,
    WrongSecret,
    /// Too many failures from this client: refused without looking at the secret.
    Throttled,
}

impl Failure {
    pub const ALL: [Failure; 3] = [Failure::NoSecret, Failure::WrongSecret, Failure::Throttled];

    pub fn as_str(self) -> &'static str {
        match self {
            Failure::NoSecret => "no_secret",
            Failure::WrongSecret => "wrong_secret",
            Failure::Throttled => "throttled",
        }
    }
}

/// The answer to `POST /v1/debug/session`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Login {
    /// The `Set-Cookie` value of the new session.
    Opened(String),
    /// 403; `now_throttled` when this failure was the client's last allowed one.
    Refused {
        failure: Failure,
        now_throttled: bool,
    },
    /// 429 with `Retry-After`.
    Throttled { retry_after_secs: u64 },
}

/// A client's failed attempts in its current window.
#[derive(Debug, Clone, Copy)]
struct Attempts {
    window_start: u64,
    failures: u32,
}

impl Attempts {
    fn window_end(&self) -> u64 {
        self.window_start.saturating_add(ATTEMPT_WINDOW_SECS)
    }
}

/// Debug sessions (`--debug-session-secret`): the secret, the sessions open, and the failed
/// attempts per client.
///
/// A session is a random id the gateway registers when the secret is shown; its cookie carries
/// the id and expiry signed with a key of this process (not derived from the secret), so no one
/// can make a cookie offline, and logout removes the id: a cookie captured before it opens
/// nothing after. A session lives in the process that opened it (a restart ends it).
pub struct DebugSessions {
    secret: DebugSecret,
    cookie_key: ring::hmac::Key,
    /// Open sessions: id → expiry (Unix seconds).
    open: std::collections::HashMap<[u8; SESSION_ID_BYTES], u64>,
    /// Failed attempts by client (its address, IPv6 reduced to the configured prefix).
    attempts: std::collections::HashMap<std::net::IpAddr, Attempts>,
}

impl std::fmt::Debug for DebugSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DebugSessions(<redacted>)")
    }
}

impl DebugSessions {
    /// `cookie_key`: random bytes of this process (the caller draws them) that sign cookies.
    pub fn new(secret: DebugSecret, cookie_key: &[u8]) -> Self {
        DebugSessions {
            secret,
            cookie_key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, cookie_key),
            open: std::collections::HashMap::new(),
            attempts: std::collections::HashMap::new(),
        }
    }

    /// `POST /v1/debug/session` from `client` showing `provided` at `unix_secs`; `id` is the
    /// new session's random id (the caller draws it). A throttled client is answered before
    /// the secret is looked at.
    pub fn login(
        &mut self,
        client: std::net::IpAddr,
        provided: Option<&[u8]>,
        unix_secs: u64,
        id: [u8; SESSION_ID_BYTES],
    ) -> Login {
        if let Some(retry_after_secs) = self.throttled(client, unix_secs) {
            return Login::Throttled { retry_after_secs };
        }
        let provided = provided.filter(|p| !p.is_empty());
        let failure = match provided {
            None => Some(Failure::NoSecret),
            Some(p) if !self.secret.matches(p) => Some(Failure::WrongSecret),
            Some(_) => None,
        };
        if let Some(failure) = failure {
            let now_throttled = self.fail(client, unix_secs);
            return Login::Refused {
                failure,
                now_throttled,
            };
        }
        self.attempts.remove(&client);
        self.open.retain(|_, expires| *expires > unix_secs);
        if self.open.len() >= MAX_OPEN_SESSIONS {
            if let Some(oldest) = self
                .open
                .iter()
                .min_by_key(|(_, expires)| **expires)
                .map(|(id, _)| *id)
            {
                self.open.remove(&oldest);
            }
        }
        let expires = unix_secs + SESSION_SECS;
        self.open.insert(id, expires);
        let payload = format!(
            "{expires}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(id)
        );
        Login::Opened(format!(
            "{COOKIE}={payload}.{}; Path=/; Max-Age={SESSION_SECS}; HttpOnly; Secure; SameSite=Strict",
            self.sign(&payload)
        ))
    }

    /// Seconds until `client` may try again, when it may not now.
    fn throttled(&mut self, client: std::net::IpAddr, unix_secs: u64) -> Option<u64> {
        if let Some(attempts) = self.attempts.get(&client) {
            let end = attempts.window_end();
            return (attempts.failures >= MAX_FAILED_ATTEMPTS && unix_secs < end)
                .then(|| end - unix_secs);
        }
        if self.attempts.len() < MAX_TRACKED_CLIENTS {
            return None;
        }
        self.attempts.retain(|_, a| a.window_end() > unix_secs);
        if self.attempts.len() < MAX_TRACKED_CLIENTS {
            return None;
        }
        // Full of live windows: a new client waits until the first of them ends.
        self.attempts
            .values()
            .map(|a| a.window_end().saturating_sub(unix_secs).max(1))
            .min()
    }

    /// Counts a failure; whether it was the client's last allowed one.
    fn fail(&mut self, client: std::net::IpAddr, unix_secs: u64) -> bool {
        let attempts = self.attempts.entry(client).or_insert(Attempts {
            window_start: unix_secs,
            failures: 0,
        });
        if unix_secs >= attempts.window_end() {
            *attempts = Attempts {
                window_start: unix_secs,
                failures: 0,
            };
        }
        attempts.failures += 1;
        attempts.failures == MAX_FAILED_ATTEMPTS
    }

    fn sign(&self, payload: &str) -> String {
        let tag = ring::hmac::sign(&self.cookie_key, payload.as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tag.as_ref())
    }

    /// The ids of the `fv_dbg` cookies of a `Cookie` header that are signed by this process and
    /// not expired (whether still open or not).
    fn signed_ids<'h>(
        &'h self,
        cookie_header: Option<&'h str>,
        unix_secs: u64,
    ) -> impl Iterator<Item = [u8; SESSION_ID_BYTES]> + 'h {
        cookie_header
            .into_iter()
            .flat_map(|header| header.split(';'))
            .filter_map(move |part| {
                let (name, value) = part.split_once('=')?;
                if name.trim() != COOKIE {
                    return None;
                }
                let (payload, signature) = value.trim().rsplit_once('.')?;
                let (expires, id) = payload.split_once('.')?;
                if expires.parse::<u64>().ok()? <= unix_secs {
                    return None;
                }
                let tag = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(signature)
                    .ok()?;
                ring::hmac::verify(&self.cookie_key, payload.as_bytes(), &tag).ok()?;
                let id = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(id)
                    .ok()?;
                id.try_into().ok()
            })
    }

    /// Whether a `Cookie` header carries a session that is open: signed here, not expired, not
    /// ended by logout.
    pub fn is_open(&self, cookie_header: Option<&str>, unix_secs: u64) -> bool {
        self.signed_ids(cookie_header, unix_secs).any(|id| {
            self.open
                .get(&id)
                .is_some_and(|expires| *expires > unix_secs)
        })
    }

    /// `POST /v1/debug/logout`: ends the sessions the `Cookie` header carries. Returns how many
    /// were open.
    pub fn logout(&mut self, cookie_header: Option<&str>, unix_secs: u64) -> usize {
        let ids: Vec<_> = self.signed_ids(cookie_header, unix_secs).collect();
        ids.iter()
            .filter(|id| self.open.remove(*id).is_some())
            .count()
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

/// The total of sample values, from +0: `Iterator::sum` over `f64` starts at −0 (IEEE 754's
/// neutral element of addition), so an empty family would total −0 and print as `-0`.
fn total(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |sum, v| sum + v)
}

/// A sample's value as the exposition format writes it; −0 is written `0`.
struct SampleValue(f64);

impl std::fmt::Display for SampleValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == 0.0 {
            f.write_str("0")
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// The `fairvisor_*` families a Fairvisor dashboard queries, from tollgate's own metrics text:
/// decisions by action and policy, the decision latency histogram, LLM tokens, loop refusals,
/// runtime overrides and the bundle; families tollgate has no counterpart for (the SaaS
/// connection, per-request remaining tokens) are exported at 0 so every name exists.
pub fn fairvisor_metrics(tollgate: &str, bundle: Option<&Bundle>, unix_secs: i64) -> String {
    let mut out = String::with_capacity(4096);
    decisions_family(&mut out, tollgate);
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
    for (name, kind, help, value) in single_samples(tollgate, bundle, unix_secs) {
        family(&mut out, name, kind, help);
        let _ = writeln!(out, "{name} {}", SampleValue(value));
    }
    info_families(&mut out, bundle);
    out
}

/// A family's `# HELP` and `# TYPE` lines.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The value of label `key` in a sample's label text (empty when it has none).
fn label(labels: &str, key: &str) -> String {
    labels
        .split("\",")
        .find_map(|pair| {
            let (k, v) = pair.split_once("=\"")?;
            (k.trim_start_matches(',') == key).then(|| v.trim_end_matches('"').to_string())
        })
        .unwrap_or_default()
}

/// `fairvisor_decisions_total` by action and policy, summed from `tollgate_decisions_total`.
fn decisions_family(out: &mut String, tollgate: &str) {
    family(
        out,
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
            "fairvisor_decisions_total{{action=\"{action}\",policy_id=\"{policy}\"}} {}",
            SampleValue(*value)
        );
    }
}

/// The families of one unlabelled sample each: name, type, help and value.
fn single_samples(
    tollgate: &str,
    bundle: Option<&Bundle>,
    unix_secs: i64,
) -> [(&'static str, &'static str, &'static str, f64); 14] {
    let sum = |name: &str| total(samples(tollgate, name).map(|(_, v)| v));
    let loops = total(
        samples(tollgate, "tollgate_decisions_total")
            .filter(|(labels, _)| label(labels, "reason") == "loop_detected")
            .map(|(_, v)| v),
    );
    let active = |name: &str| {
        total(
            samples(tollgate, "tollgate_runtime_override_active")
                .filter(|(labels, _)| label(labels, "override") == name)
                .map(|(_, v)| v),
        )
    };
    let in_force = bundle.map(|b| b.in_force(unix_secs));
    let kill_switches = in_force.map_or(0, |b| b.kill_switches.len());
    let shadow_policies = in_force.map_or(0, |b| {
        b.policies
            .iter()
            .filter(|p| p.mode == crate::policy::Mode::Shadow)
            .count()
    });
    [
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
    ]
}

/// `fairvisor_config_info` (the bundle in force, if any) and `fairvisor_build_info`.
fn info_families(out: &mut String, bundle: Option<&Bundle>) {
    family(
        out,
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
        out,
        "fairvisor_build_info",
        "gauge",
        "The gateway's build (value 1)",
    );
    let _ = writeln!(
        out,
        "fairvisor_build_info{{version=\"{}\",implementation=\"tollgate\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "e2e-debug-secret";
    const KEY: [u8; 32] = [7; 32];

    fn sessions() -> DebugSessions {
        DebugSessions::new(DebugSecret::new(SECRET).unwrap(), &KEY)
    }

    fn client(last: u8) -> std::net::IpAddr {
        std::net::IpAddr::from([10, 0, 0, last])
    }

    fn cookie_of(login: Login) -> String {
        match login {
            Login::Opened(set) => set.split(';').next().unwrap().to_string(),
            other => panic!("not opened: {other:?}"),
        }
    }

    #[test]
    fn secrets_must_be_as_strong_as_the_admin_token() {
        assert_eq!(DebugSecret::new("").unwrap_err(), SecretError::TooShort);
        assert_eq!(DebugSecret::new("x").unwrap_err(), SecretError::TooShort);
        assert_eq!(
            DebugSecret::new(&"a".repeat(15)).unwrap_err(),
            SecretError::TooShort
        );
        assert_eq!(
            DebugSecret::new("sixteen chars ok").unwrap_err(),
            SecretError::NotPrintable
        );
        let secret = DebugSecret::new(SECRET).unwrap();
        assert!(secret.matches(SECRET.as_bytes()));
        assert!(!secret.matches(b"e2e-debug-secreT"));
        assert!(!secret.matches(b""));
        assert_eq!(format!("{secret:?}"), "DebugSecret(<redacted>)");
        assert_eq!(format!("{:?}", sessions()), "DebugSessions(<redacted>)");
    }

    #[test]
    fn sessions_are_signed_expire_and_refuse_forgeries() {
        let mut sessions = sessions();
        let set = match sessions.login(client(1), Some(SECRET.as_bytes()), 1_000, [1; 16]) {
            Login::Opened(set) => set,
            other => panic!("{other:?}"),
        };
        assert!(
            set.starts_with("fv_dbg=1900.AQEBAQEBAQEBAQEBAQEBAQ."),
            "{set}"
        );
        assert!(set.ends_with("; Path=/; Max-Age=900; HttpOnly; Secure; SameSite=Strict"));
        let cookie = set.split(';').next().unwrap().to_string();
        assert!(sessions.is_open(Some(&cookie), 1_899));
        assert!(sessions.is_open(Some(&format!("a=b; {cookie}; c=d")), 1_000));
        assert!(!sessions.is_open(Some(&cookie), 1_900), "expired");
        let forged = cookie.replace("1900.", "9999.");
        assert!(!sessions.is_open(Some(&forged), 1_000));
        // Signed with the secret (as a cookie made offline would be): nothing.
        let payload = "1900.AQEBAQEBAQEBAQEBAQEBAQ";
        let with_secret = ring::hmac::sign(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET.as_bytes()),
            payload.as_bytes(),
        );
        let offline = format!(
            "fv_dbg={payload}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(with_secret.as_ref())
        );
        assert!(!sessions.is_open(Some(&offline), 1_000));
        // Another process's cookie (another key), even for a registered id: nothing.
        let mut other = DebugSessions::new(DebugSecret::new(SECRET).unwrap(), &[8; 32]);
        let foreign = cookie_of(other.login(client(1), Some(SECRET.as_bytes()), 1_000, [1; 16]));
        assert_ne!(foreign, cookie);
        assert!(!sessions.is_open(Some(&foreign), 1_000));
        assert!(!sessions.is_open(None, 1_000));
        assert!(!sessions.is_open(Some("fv_dbg=garbage"), 1_000));
        assert!(!sessions.is_open(Some("fv_dbg=1900.AQ.x"), 1_000));
    }

    #[test]
    fn logout_ends_the_session_its_cookie_names_and_no_other() {
        let mut sessions = sessions();
        let a = cookie_of(sessions.login(client(1), Some(SECRET.as_bytes()), 1_000, [1; 16]));
        let b = cookie_of(sessions.login(client(1), Some(SECRET.as_bytes()), 1_000, [2; 16]));
        assert_eq!(sessions.logout(Some(&a), 1_010), 1);
        assert!(
            !sessions.is_open(Some(&a), 1_010),
            "a captured cookie after logout"
        );
        assert!(sessions.is_open(Some(&b), 1_010));
        assert_eq!(sessions.logout(Some(&a), 1_020), 0, "already ended");
        assert_eq!(sessions.logout(Some("fv_dbg=junk"), 1_020), 0);
        assert_eq!(sessions.logout(None, 1_020), 0);
    }

    #[test]
    fn open_sessions_are_bounded_and_the_oldest_goes_first() {
        let mut sessions = sessions();
        let id = |i: usize| {
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&(i as u64).to_le_bytes());
            id
        };
        let first = cookie_of(sessions.login(client(1), Some(SECRET.as_bytes()), 1_000, id(0)));
        for i in 1..MAX_OPEN_SESSIONS {
            let _ = sessions.login(client(1), Some(SECRET.as_bytes()), 1_001, id(i));
        }
        assert_eq!(sessions.open.len(), MAX_OPEN_SESSIONS);
        assert!(sessions.is_open(Some(&first), 1_002));
        let last = cookie_of(sessions.login(
            client(1),
            Some(SECRET.as_bytes()),
            1_002,
            id(MAX_OPEN_SESSIONS),
        ));
        assert_eq!(sessions.open.len(), MAX_OPEN_SESSIONS);
        assert!(!sessions.is_open(Some(&first), 1_002), "the oldest ended");
        assert!(sessions.is_open(Some(&last), 1_002));
    }

    #[test]
    fn failed_attempts_throttle_their_client_for_the_rest_of_the_window() {
        let mut sessions = sessions();
        let right = Some(SECRET.as_bytes());
        assert_eq!(
            sessions.login(client(1), Some(b""), 1_000, [1; 16]),
            Login::Refused {
                failure: Failure::NoSecret,
                now_throttled: false
            }
        );
        assert_eq!(
            sessions.login(client(1), None, 1_001, [1; 16]),
            Login::Refused {
                failure: Failure::NoSecret,
                now_throttled: false
            }
        );
        for t in 1_002..1_004 {
            assert!(matches!(
                sessions.login(client(1), Some(b"wrong"), t, [1; 16]),
                Login::Refused {
                    failure: Failure::WrongSecret,
                    now_throttled: false
                }
            ));
        }
        assert_eq!(
            sessions.login(client(1), Some(b"wrong"), 1_004, [1; 16]),
            Login::Refused {
                failure: Failure::WrongSecret,
                now_throttled: true
            }
        );
        // The window started at 1 000: until 1 300 even the right secret is not looked at.
        assert_eq!(
            sessions.login(client(1), right, 1_010, [1; 16]),
            Login::Throttled {
                retry_after_secs: 290
            }
        );
        assert_eq!(
            sessions.login(client(1), right, 1_299, [1; 16]),
            Login::Throttled {
                retry_after_secs: 1
            }
        );
        // Another client is not affected.
        assert!(matches!(
            sessions.login(client(2), right, 1_010, [2; 16]),
            Login::Opened(_)
        ));
        // After the window: a fresh count, and a success forgets the failures.
        assert!(matches!(
            sessions.login(client(1), Some(b"wrong"), 1_300, [1; 16]),
            Login::Refused {
                failure: Failure::WrongSecret,
                now_throttled: false
            }
        ));
        assert!(matches!(
            sessions.login(client(1), right, 1_301, [3; 16]),
            Login::Opened(_)
        ));
        assert!(!sessions.attempts.contains_key(&client(1)));
    }

    #[test]
    fn a_full_table_of_failing_clients_throttles_newcomers_until_a_window_ends() {
        let mut sessions = sessions();
        for i in 0..MAX_TRACKED_CLIENTS as u32 {
            let ip = std::net::IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            let _ = sessions.login(ip, Some(b"wrong"), 1_000 + u64::from(i % 2), [0; 16]);
        }
        let newcomer = std::net::IpAddr::from([192, 0, 2, 1]);
        assert_eq!(
            sessions.login(newcomer, Some(SECRET.as_bytes()), 1_100, [0; 16]),
            Login::Throttled {
                retry_after_secs: 200
            }
        );
        // Once the first windows end, their entries go and the newcomer is heard.
        assert!(matches!(
            sessions.login(newcomer, Some(SECRET.as_bytes()), 1_300, [0; 16]),
            Login::Opened(_)
        ));
        assert_eq!(sessions.attempts.len(), MAX_TRACKED_CLIENTS / 2);
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

    /// Families with no tollgate sample to sum (no LLM tokens, no loop refusal, no breaker
    /// trip yet) print `0`, never `-0` (an empty `f64` sum is −0).
    #[test]
    fn families_with_nothing_to_sum_print_0_not_minus_0() {
        let out = fairvisor_metrics("", None, 0);
        for name in [
            "fairvisor_tokens_consumed_total",
            "fairvisor_token_reservation_unused_total",
            "fairvisor_loop_detected_total",
            "fairvisor_circuit_state",
            "fairvisor_global_shadow_active",
            "fairvisor_kill_switch_override_active",
        ] {
            assert!(out.contains(&format!("\n{name} 0\n")), "{name}: {out}");
        }
        assert!(!out.contains(" -0"), "{out}");
        assert_eq!(SampleValue(-0.0).to_string(), "0");
        assert_eq!(SampleValue(2.5).to_string(), "2.5");
        assert_eq!(SampleValue(-1.0).to_string(), "-1");
    }
}
