//! Logging: the tracing subscriber (text or JSON), Pingora's `log` records bridged into it
//! through the redactor and the log-value escaping, and the `RATE_LIMIT` lines of a decision.

use crate::config::cli::LogFormat;
use crate::engine::{Decided, Decision, Reason, RefusedBy};
use crate::policy::Mode;

/// One `RATE_LIMIT` line per refusal, and per shadow would-refusal (with `mode=shadow`).
/// Nothing for allowed requests.
///
/// `wall_us` is the wall-clock time (Unix µs) the decision read, if it read one: the lines are
/// stamped with it rather than with another reading of the clock.
pub(super) fn log_decision(decided: &Decided<'_>, status: u16, wall_us: Option<u64>) {
    let (decision, request) = (&decided.decision, &decided.request);
    let shadow_missing = decision.checked().and_then(|c| c.shadow_missing);
    if decision.is_allowed()
        && shadow_missing.is_none()
        && decision.shadow_rejections().next().is_none()
    {
        // The common case: nothing to say, and nothing formatted.
        return;
    }
    // `RUST_LOG` decides, as for every other line (the callsite's interest is cached).
    if !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let at = wall_us.map_or_else(crate::telemetry::log_line::unix_us_now, |us| {
        us.min(i64::MAX as u64) as i64
    });
    // The address written on the stack: nothing allocated for the line.
    let mut ip_text = crate::telemetry::log_line::IpText::new();
    let client_ip = match request.client_ip {
        Some(ip) => ip_text.of(ip),
        None => "-",
    };
    let trace_id = request
        .facts
        .and_then(|f| f.trace)
        .map(|t| t.trace_id_hex());
    let line = crate::telemetry::log_line::RateLimit {
        client_ip,
        host: request.host.unwrap_or("-"),
        path: request.path,
        status,
        policy: "",
        rule: "",
        reason: "",
        mode: "enforce",
        detail: None,
        trace_id: trace_id.as_deref(),
    };
    if let (Decision::Refuse(refusal), Some(by)) = (decision, decision.refused_by()) {
        let (policy, rule, detail) = match by {
            RefusedBy::Rule(rule) => (rule.policy_id.as_str(), rule.name.as_str(), ""),
            RefusedBy::KillSwitch(ks) => ("kill_switch", "", ks.reason.as_ref()),
            RefusedBy::Request => ("", "", ""),
        };
        crate::telemetry::log_line::RateLimit {
            policy,
            rule,
            reason: refusal.reason.as_str(),
            detail: (!detail.is_empty()).then_some(detail),
            ..line
        }
        .write_at(at);
    }
    if let Some(rule) = shadow_missing {
        crate::telemetry::log_line::RateLimit {
            status: 401,
            policy: &rule.policy_id,
            rule: &rule.name,
            reason: "missing_descriptor",
            mode: "shadow",
            ..line
        }
        .write_at(at);
    }
    for shadow in decision.shadow_rejections() {
        let reason = if shadow.cost_exceeds {
            Reason::CostExceedsLimit
        } else {
            Reason::TokenBucketExceeded
        };
        crate::telemetry::log_line::RateLimit {
            status: 429,
            policy: &shadow.rule.policy_id,
            rule: &shadow.rule.name,
            reason: reason.as_str(),
            mode: Mode::Shadow.as_str(),
            ..line
        }
        .write_at(at);
    }
}

/// Installs the tracing subscriber (text or JSON) and bridges Pingora's `log` records into it
/// through the redactor (Pingora's debug records print whole request headers).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let max_level = filter.max_level_hint();
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    crate::telemetry::log_line::set_json(format == LogFormat::Json);
    let result = match format {
        // Text lines to a file, a pipe or journald go through the line net: one event, one
        // line. (On a terminal the colours are control sequences of the formatter's own.)
        LogFormat::Text if !ansi => builder.with_writer(|| LineNet).try_init(),
        LogFormat::Text => builder.with_writer(std::io::stderr).try_init(),
        LogFormat::Json => builder
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .try_init(),
    };
    if let Err(e) = result {
        eprintln!("tollgate: logging already initialised: {e}");
        return;
    }
    if log::set_logger(&REDACTING_LOG).is_ok() {
        use tracing_subscriber::filter::LevelFilter;
        log::set_max_level(match max_level {
            Some(LevelFilter::OFF) => log::LevelFilter::Off,
            Some(LevelFilter::ERROR) => log::LevelFilter::Error,
            Some(LevelFilter::WARN) => log::LevelFilter::Warn,
            Some(LevelFilter::INFO) => log::LevelFilter::Info,
            Some(LevelFilter::DEBUG) => log::LevelFilter::Debug,
            _ => log::LevelFilter::Trace,
        });
    }
}

/// Standard error behind [`crate::telemetry::log_value::escape_line_controls`]: the formatter writes one
/// whole event per `write_all`, so every line is checked whole.
struct LineNet;

impl std::io::Write for LineNet {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        std::io::Write::write_all(
            &mut std::io::stderr().lock(),
            &crate::telemetry::log_value::escape_line_controls(buf),
        )
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::Write::flush(&mut std::io::stderr())
    }
}

/// Pingora's bootstrap, at an upgrade, waiting for the listeners on the relay socket: it binds
/// the socket and looks for the relay's connection at once, before the relay (which can only
/// connect once the socket exists) is there, so every hand-over has at least one such record,
/// which Pingora logs at error level. It is the hand-over proceeding, shown at debug level; a
/// hand-over that fails says so at error level (the relay's `upgrade: ...` line, and Pingora's
/// `Bootstrap failed on error: ... exiting.` once its retries run out).
fn is_handover_wait(origin: &str, text: &str) -> bool {
    origin == "pingora_core::server::transfer_fd" && text.starts_with("No incoming socket transfer")
}

/// Re-emits `log` records (Pingora's) as tracing events under the target `pingora`, with their
/// text through [`crate::telemetry::redact::text`], then escaped ([`crate::telemetry::log_line::message`]).
struct RedactingLog;

static REDACTING_LOG: RedactingLog = RedactingLog;

impl log::Log for RedactingLog {
    fn enabled(&self, _metadata: &log::Metadata<'_>) -> bool {
        // `log::max_level` already filters; the tracing filter decides the rest.
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        // Info records are shown at debug level (below): not formatted at all unless debug is on.
        if record.level() == log::Level::Info
            && !tracing::enabled!(target: "pingora", tracing::Level::DEBUG)
        {
            return;
        }
        let text = record.args().to_string();
        let redacted = crate::telemetry::redact::text(&text);
        // Pingora's messages carry request lines and header values (a `Host` may hold any
        // byte but CR and LF, a C1 control included): escaped like every value of a line.
        let message = crate::telemetry::log_line::message(&redacted);
        let origin = record.target();
        match record.level() {
            log::Level::Error if is_handover_wait(origin, &text) => {
                tracing::debug!(target: "pingora", origin, "{message}")
            }
            log::Level::Error => tracing::error!(target: "pingora", origin, "{message}"),
            log::Level::Warn => tracing::warn!(target: "pingora", origin, "{message}"),
            // Pingora's own start-up and shutdown chatter: debug, so a start-up error is not
            // lost among ten lines of it.
            log::Level::Info => tracing::debug!(target: "pingora", origin, "{message}"),
            log::Level::Debug => tracing::debug!(target: "pingora", origin, "{message}"),
            log::Level::Trace => tracing::trace!(target: "pingora", origin, "{message}"),
        }
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::is_handover_wait;

    #[test]
    fn only_the_hand_over_wait_is_not_an_error() {
        assert!(is_handover_wait(
            "pingora_core::server::transfer_fd",
            "No incoming socket transfer, sleep 1s and try again"
        ));
        assert!(!is_handover_wait(
            "pingora_core::server::transfer_fd",
            "Error accepting socket transfer: EBADF"
        ));
        assert!(!is_handover_wait(
            "pingora_core::server",
            "No incoming socket transfer, sleep 1s and try again"
        ));
    }
}
