//! What the gateway tells its operators: Prometheus metrics (`metrics`), the access log and
//! the text and JSON log lines (`access_log`, `log_line`, `log_value`), the audit trail of
//! operator writes (`audit`), OpenTelemetry traces (`traces`), and the masking that keeps
//! secrets out of all of them (`redact`).

pub mod access_log;
pub mod audit;
pub mod log_line;
pub mod log_value;
pub mod metrics;
pub mod redact;
pub mod traces;
