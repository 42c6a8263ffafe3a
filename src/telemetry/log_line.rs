//! Per-request log lines, off the request path: lines are appended to a memory buffer that a
//! writer thread empties onto standard output (access log) or standard error (`RATE_LIMIT`)
//! every 20 ms, sooner past 64 KiB, in one `write` per batch, as nginx's
//! `access_log ... buffer= flush=` does: a request never waits on I/O nor wakes a thread per
//! line. When the reader of an output has stopped reading and 4 MiB are waiting, lines are
//! dropped and counted (a warning at each power of two). [`flush`] empties both at shutdown.
//!
//! The `RATE_LIMIT` line every refusal writes is formatted here too, without `tracing`'s
//! formatter (about 12 000 instructions a line with its timestamp: a quarter of a refusal's
//! cost): the same fields, in the same text or JSON shape as the rest of the log.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

/// Bytes of lines waiting for a writer thread, at most (then lines are dropped, counted).
const BUFFER_LIMIT: usize = 4 << 20;
/// A writer wakes early once this much is waiting.
const FLUSH_AT: usize = 64 << 10;
/// Longest a line waits before it is written.
const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// Lines dropped because a writer fell behind (a stalled reader of its output).
pub static DROPPED: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Stdout,
    Stderr,
}

struct Pending {
    output: Output,
    lines: parking_lot::Mutex<Vec<u8>>,
    wake: parking_lot::Condvar,
    /// Held from taking a batch to writing it, by the writer thread and by [`flush`]: batches
    /// reach the output in order, and a flush never returns while a batch is in the writer's
    /// hands.
    writing: parking_lot::Mutex<()>,
}

impl Pending {
    fn write_out(&self, batch: &[u8]) {
        // A closed pipe drops lines; logging never fails a request.
        let _ = match self.output {
            Output::Stdout => std::io::stdout().lock().write_all(batch),
            Output::Stderr => std::io::stderr().lock().write_all(batch),
        };
    }

    fn take(&self) -> Vec<u8> {
        std::mem::replace(&mut *self.lines.lock(), Vec::with_capacity(FLUSH_AT))
    }
}

fn pending(output: Output) -> &'static Pending {
    static STDOUT: OnceLock<&'static Pending> = OnceLock::new();
    static STDERR: OnceLock<&'static Pending> = OnceLock::new();
    let cell = match output {
        Output::Stdout => &STDOUT,
        Output::Stderr => &STDERR,
    };
    cell.get_or_init(|| {
        // Lives as long as the process, like its writer thread.
        let pending: &'static Pending = Box::leak(Box::new(Pending {
            output,
            lines: parking_lot::Mutex::new(Vec::with_capacity(FLUSH_AT)),
            wake: parking_lot::Condvar::new(),
            writing: parking_lot::Mutex::new(()),
        }));
        let spawned = std::thread::Builder::new()
            .name("tollgate-log-writer".into())
            .spawn(move || loop {
                {
                    let mut lines = pending.lines.lock();
                    if lines.len() < FLUSH_AT {
                        pending.wake.wait_for(&mut lines, FLUSH_EVERY);
                    }
                }
                let _writing = pending.writing.lock();
                let batch = pending.take();
                if !batch.is_empty() {
                    pending.write_out(&batch);
                }
            });
        if let Err(e) = spawned {
            tracing::error!("log writer thread: {e}");
        }
        pending
    })
}

fn append(output: Output, line: &[u8]) {
    if line.is_empty() {
        return;
    }
    let pending = pending(output);
    let mut lines = pending.lines.lock();
    if lines.len() + line.len() > BUFFER_LIMIT {
        drop(lines);
        let dropped = DROPPED.fetch_add(1, Ordering::Relaxed);
        if dropped.is_power_of_two() {
            tracing::warn!(
                dropped = dropped + 1,
                "log lines dropped: the log's reader is not reading fast enough"
            );
        }
        return;
    }
    lines.extend_from_slice(line);
    if lines.len() >= FLUSH_AT {
        pending.wake.notify_one();
    }
}

/// Queues a line for standard output.
pub fn stdout(line: &[u8]) {
    append(Output::Stdout, line);
}

/// Queues a line for standard error.
pub fn stderr(line: &[u8]) {
    append(Output::Stderr, line);
}

/// Writes out whatever is waiting (at shutdown: lines queued just before exit are not lost).
pub fn flush() {
    for output in [Output::Stdout, Output::Stderr] {
        let pending = pending(output);
        let _writing = pending.writing.lock();
        let batch = pending.take();
        if !batch.is_empty() {
            pending.write_out(&batch);
        }
    }
}

/// The log's format, as `init_logging` set it: 0 text, 1 JSON.
static FORMAT: AtomicU8 = AtomicU8::new(0);

/// Lines formatted here follow the rest of the log's format.
pub fn set_json(json: bool) {
    FORMAT.store(u8::from(json), Ordering::Relaxed);
}

/// Whether lines are JSON (`--log-format json`).
fn json() -> bool {
    FORMAT.load(Ordering::Relaxed) == 1
}

/// A value for a `tracing` field (written with `%`) that a client, an upstream or a policy file
/// could have chosen: in text lines escaped by [`crate::telemetry::log_value`] and quoted when it holds a
/// space (a value can neither end its line nor forge another field), in JSON lines as it is
/// (the JSON encoder escapes it, and a reader gets the value back exactly).
pub fn value(text: &str) -> Value<'_> {
    Value { text, field: true }
}

/// Like [`value`], for a line's message (escaped, never quoted).
pub fn message(text: &str) -> Value<'_> {
    Value { text, field: false }
}

/// See [`value`].
#[derive(Debug, Clone, Copy)]
pub struct Value<'a> {
    text: &'a str,
    field: bool,
}

impl std::fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if json() {
            f.write_str(self.text)
        } else if self.field {
            crate::telemetry::log_value::write_field(f, self.text)
        } else {
            crate::telemetry::log_value::write_escaped(f, self.text)
        }
    }
}

/// The fields of one `RATE_LIMIT` line.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit<'a> {
    /// The client's address as [`push_ip`] writes it, or `-`: written as it is.
    pub client_ip: &'a str,
    pub host: &'a str,
    pub path: &'a str,
    pub status: u16,
    pub policy: &'a str,
    pub rule: &'a str,
    /// Tollgate's own words (a `Reason` or a `Mode`, never request data): written as they are.
    pub reason: &'static str,
    pub mode: &'static str,
    /// A kill switch's reason (`detail=`), when it has one.
    pub detail: Option<&'a str>,
    /// The request's trace id (32 hex digits), when tracing is on: written last.
    pub trace_id: Option<&'a str>,
}

/// The target the line names, as `tracing` would (the module that decides).
const TARGET: &str = "tollgate::service";

impl RateLimit<'_> {
    /// The whole line, newline included: `tracing`'s text layout
    /// (`<time>  INFO tollgate::service: RATE_LIMIT client_ip=... mode=enforce`, every value
    /// escaped by [`crate::telemetry::log_value`]) or its JSON one (values JSON-escaped).
    /// Written piece by piece (no `format!` machinery): this runs once per refusal.
    pub fn format(&self, unix_us: i64, json: bool) -> String {
        let mut line = String::with_capacity(224 + self.path.len());
        self.format_into(&mut line, unix_us, json);
        line
    }

    /// [`RateLimit::format`] appended to `line` (a buffer reused from line to line).
    fn format_into(&self, line: &mut String, unix_us: i64, json: bool) {
        let mut number = itoa::Buffer::new();
        if json {
            line.push_str("{\"timestamp\":\"");
            push_rfc3339_us(line, unix_us);
            line.push_str("\",\"level\":\"INFO\",\"message\":\"RATE_LIMIT\"");
            let j = json_field;
            j(line, "client_ip", Some(self.client_ip));
            j(line, "host", Some(self.host));
            j(line, "path", Some(self.path));
            line.push_str(",\"status\":");
            line.push_str(number.format(self.status));
            j(line, "policy", Some(self.policy));
            j(line, "rule", Some(self.rule));
            j(line, "reason", Some(self.reason));
            j(line, "mode", Some(self.mode));
            if let Some(detail) = self.detail {
                j(line, "detail", Some(detail));
            }
            if let Some(trace_id) = self.trace_id {
                j(line, "trace_id", Some(trace_id));
            }
            line.push_str(",\"target\":\"");
            line.push_str(TARGET);
            line.push_str("\"}\n");
        } else {
            push_rfc3339_us(line, unix_us);
            line.push_str("  INFO ");
            line.push_str(TARGET);
            line.push_str(": RATE_LIMIT");
            // What a client or a policy chose is escaped; the address, the status and
            // tollgate's own words cannot hold anything to escape (and this runs per refusal).
            line.push_str(" client_ip=");
            line.push_str(self.client_ip);
            for (name, value) in [(" host=", self.host), (" path=", self.path)] {
                line.push_str(name);
                crate::telemetry::log_value::push_field(line, value);
            }
            line.push_str(" status=");
            line.push_str(number.format(self.status));
            for (name, value) in [(" policy=", self.policy), (" rule=", self.rule)] {
                line.push_str(name);
                crate::telemetry::log_value::push_field(line, value);
            }
            line.push_str(" reason=");
            line.push_str(self.reason);
            line.push_str(" mode=");
            line.push_str(self.mode);
            if let Some(detail) = self.detail {
                line.push_str(" detail=");
                crate::telemetry::log_value::push_field(line, detail);
            }
            if let Some(trace_id) = self.trace_id {
                // Hex digits of tollgate's own formatting: nothing to escape.
                line.push_str(" trace_id=");
                line.push_str(trace_id);
            }
            line.push('\n');
        }
    }

    /// Queues the line for standard error, in the log's format, stamped `unix_us` (wall-clock
    /// microseconds; [`unix_us_now`] for the current time): a decision that read the wall clock
    /// passes its own reading, so the clock is not read again.
    pub fn write_at(&self, unix_us: i64) {
        // Formatted into this thread's buffer, kept from line to line: nothing allocated.
        thread_local! {
            static LINE: std::cell::RefCell<String> =
                const { std::cell::RefCell::new(String::new()) };
        }
        LINE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut line) => {
                line.clear();
                self.format_into(&mut line, unix_us, json());
                stderr(line.as_bytes());
            }
            Err(_) => stderr(self.format(unix_us, json()).as_bytes()),
        });
    }
}

/// The wall clock in Unix microseconds, as a log line's time (0 before 1970).
pub fn unix_us_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros().min(i64::MAX as u128) as i64)
}

/// `2026-11-22T10:33:26.123456Z`, as `tracing` writes times. The date and time of day are
/// formatted once per second per thread; the microseconds are six digits pushed in place.
pub(crate) fn push_rfc3339_us(out: &mut String, unix_us: i64) {
    thread_local! {
        static SECOND: std::cell::RefCell<(i64, String)> =
            const { std::cell::RefCell::new((i64::MIN, String::new())) };
    }
    let secs = unix_us.div_euclid(1_000_000);
    let micros = unix_us.rem_euclid(1_000_000);
    SECOND.with(|cell| {
        let mut second = cell.borrow_mut();
        if second.0 != secs {
            let (y, mo, d, h, mi, s, _) = split_time(secs * 1000);
            second.1.clear();
            let _ = write!(second.1, "{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}");
            second.0 = secs;
        }
        out.push_str(&second.1);
    });
    out.push('.');
    let mut digits = [b'0'; 6];
    let mut rest = micros;
    for digit in digits.iter_mut().rev() {
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    // Pushed one by one: a UTF-8 check of six digits costs more than the pushes.
    for digit in digits {
        out.push(char::from(digit));
    }
    out.push('Z');
}

/// A client address as text, without the formatting machinery for the common IPv4 case.
pub fn push_ip(out: &mut String, ip: std::net::IpAddr) {
    out.push_str(IpText::new().of(ip));
}

/// A client address written as text on the stack (an IPv6 address takes at most 45 bytes):
/// a line that names it allocates nothing for it.
pub struct IpText {
    buf: [u8; 45],
    len: usize,
}

impl Default for IpText {
    fn default() -> Self {
        Self::new()
    }
}

impl IpText {
    pub fn new() -> Self {
        IpText {
            buf: [0; 45],
            len: 0,
        }
    }

    /// `ip` as text.
    pub fn of(&mut self, ip: std::net::IpAddr) -> &str {
        self.len = 0;
        match ip {
            std::net::IpAddr::V4(v4) => {
                for (i, &octet) in v4.octets().iter().enumerate() {
                    if i > 0 {
                        self.push(b'.');
                    }
                    if octet >= 100 {
                        self.push(b'0' + octet / 100);
                    }
                    if octet >= 10 {
                        self.push(b'0' + octet / 10 % 10);
                    }
                    self.push(b'0' + octet % 10);
                }
            }
            std::net::IpAddr::V6(v6) => {
                let _ = write!(self, "{v6}");
            }
        }
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("-")
    }

    fn push(&mut self, byte: u8) {
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = byte;
            self.len += 1;
        }
    }
}

impl std::fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        let slot = self.buf.get_mut(self.len..end).ok_or(std::fmt::Error)?;
        slot.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// `,"name":"value"` (JSON-escaped) or `,"name":null`.
pub(crate) fn json_field(line: &mut String, name: &str, value: Option<&str>) {
    let _ = write!(line, ",\"{name}\":");
    let Some(value) = value else {
        line.push_str("null");
        return;
    };
    line.push('"');
    for c in value.chars() {
        match c {
            '"' => line.push_str("\\\""),
            '\\' => line.push_str("\\\\"),
            '\n' => line.push_str("\\n"),
            '\r' => line.push_str("\\r"),
            '\t' => line.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(line, "\\u{:04x}", c as u32);
            }
            c => line.push(c),
        }
    }
    line.push('"');
}

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

pub(crate) fn split_time(unix_ms: i64) -> (i64, u32, u32, i64, i64, i64, i64) {
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let (y, mo, d) = civil(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    (y, mo, d, sod / 3600, sod % 3600 / 60, sod % 60, ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Addresses are written as `Display` writes them.
        #[test]
        fn addresses_are_written_as_displayed(bits in proptest::prelude::any::<u32>(), v6 in proptest::prelude::any::<u128>()) {
            for ip in [
                std::net::IpAddr::V4(std::net::Ipv4Addr::from(bits)),
                std::net::IpAddr::V6(std::net::Ipv6Addr::from(v6)),
            ] {
                let mut out = String::from("x=");
                push_ip(&mut out, ip);
                proptest::prop_assert_eq!(out, format!("x={ip}"));
            }
        }
    }

    fn line() -> RateLimit<'static> {
        RateLimit {
            client_ip: "203.0.113.50",
            host: "api.example.com",
            path: "/w",
            status: 429,
            policy: "p",
            rule: "per-ip",
            reason: "token_bucket_exceeded",
            mode: "enforce",
            detail: None,
            trace_id: None,
        }
    }

    #[test]
    fn a_traced_refusal_names_its_trace_last() {
        let traced = RateLimit {
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
            ..line()
        };
        assert!(traced
            .format(0, false)
            .ends_with(" mode=enforce trace_id=4bf92f3577b34da6a3ce929d0e0e4736\n"));
        let v: serde_json::Value = serde_json::from_str(traced.format(0, true).trim_end()).unwrap();
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    }

    #[test]
    fn text_lines_look_like_the_rest_of_the_log() {
        assert_eq!(
            line().format(1_795_000_000_123_456, false),
            "2026-11-18T11:06:40.123456Z  INFO tollgate::service: RATE_LIMIT client_ip=203.0.113.50 host=api.example.com path=/w status=429 policy=p rule=per-ip reason=token_bucket_exceeded mode=enforce\n"
        );
        let killed = RateLimit {
            detail: Some("abuse"),
            ..line()
        };
        assert!(killed
            .format(0, false)
            .ends_with(" mode=enforce detail=abuse\n"));
    }

    #[test]
    fn text_lines_escape_every_value() {
        let hostile = RateLimit {
            host: "h\r\nforged",
            path: "/w\x1b[31m",
            policy: "p\"q",
            rule: "r\\s",
            detail: Some("line\nbreak"),
            ..line()
        };
        assert_eq!(
            hostile.format(1_795_000_000_123_456, false),
            "2026-11-18T11:06:40.123456Z  INFO tollgate::service: RATE_LIMIT client_ip=203.0.113.50 host=h\\x0D\\x0Aforged path=/w\\x1B[31m status=429 policy=p\\x22q rule=r\\x5Cs reason=token_bucket_exceeded mode=enforce detail=line\\x0Abreak\n"
        );
    }

    #[test]
    fn tracing_values_are_escaped_in_text_lines() {
        // The lib's tests never switch the log to JSON: text is in force.
        assert_eq!(value("a\r\nb\u{1b}").to_string(), "a\\x0D\\x0Ab\\x1B");
        assert_eq!(value("plain").to_string(), "plain");
    }

    #[test]
    fn addresses_read_as_the_standard_library_writes_them() {
        for ip in [
            "203.0.113.7",
            "0.0.0.0",
            "255.255.255.255",
            "2001:db8::1",
            "::1",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            let mut out = String::new();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string());
        }
    }

    #[test]
    fn json_lines_parse_with_the_same_fields() {
        let text = RateLimit {
            path: "/a\"b\n",
            ..line()
        }
        .format(1_795_000_000_123_456, true);
        assert!(text.ends_with("}\n"));
        let v: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(v["timestamp"], "2026-11-18T11:06:40.123456Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "RATE_LIMIT");
        assert_eq!(v["status"], 429);
        assert_eq!(v["path"], "/a\"b\n");
        assert_eq!(v["mode"], "enforce");
        assert_eq!(v["target"], "tollgate::service");
        assert!(v.get("detail").is_none());
    }
}
