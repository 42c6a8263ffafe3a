//! The sampling decision and the ids it reads: the samplers `OTEL_TRACES_SAMPLER` names, a
//! caller's W3C `traceparent`/`tracestate` parsed into a [`Parent`], and random trace and span
//! ids.

use std::sync::Arc;

/// The W3C trace-context headers, parsed once, with their spelling on an HTTP/1 wire.
pub static TRACEPARENT: (http::HeaderName, &str) =
    (http::HeaderName::from_static("traceparent"), "traceparent");
pub static TRACESTATE: (http::HeaderName, &str) =
    (http::HeaderName::from_static("tracestate"), "tracestate");

/// How the gateway samples (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`), with the
/// SDKs' meaning of each value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    AlwaysOn,
    AlwaysOff,
    /// A trace is sampled when the lower 63 bits of its id fall below `ratio × 2^63` (every
    /// service sampling by trace id agrees on the same traces).
    TraceIdRatio(f64),
    /// A continued trace keeps its parent's decision; a new one asks the root sampler.
    ParentBased(Root),
}

/// The root sampler of a parent-based one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
}

impl Sampler {
    /// The sampler the variables name. The default, and the answer to a name this build does
    /// not implement (`jaeger_remote`, `xray`...), is `parentbased_always_on`; a `*traceidratio`
    /// without a readable ratio samples everything (as the SDKs do, with a warning).
    pub fn from_env(name: Option<&str>, arg: Option<&str>) -> Sampler {
        let ratio = || match arg.and_then(|a| a.trim().parse::<f64>().ok()) {
            Some(ratio) => ratio,
            None => {
                tracing::warn!("traces: OTEL_TRACES_SAMPLER_ARG is missing or not a number: sampling every trace");
                1.0
            }
        };
        match name.map(str::trim) {
            None | Some("") | Some("parentbased_always_on") => Sampler::ParentBased(Root::AlwaysOn),
            Some("always_on") => Sampler::AlwaysOn,
            Some("always_off") => Sampler::AlwaysOff,
            Some("traceidratio") => Sampler::TraceIdRatio(ratio()),
            Some("parentbased_always_off") => Sampler::ParentBased(Root::AlwaysOff),
            Some("parentbased_traceidratio") => Sampler::ParentBased(Root::TraceIdRatio(ratio())),
            Some(other) => {
                tracing::warn!(
                    sampler = %crate::telemetry::log_line::value(other),
                    "traces: OTEL_TRACES_SAMPLER is not one this build has: parentbased_always_on"
                );
                Sampler::ParentBased(Root::AlwaysOn)
            }
        }
    }

    /// Whether a span of `trace_id` is sampled, under `parent` (a continued trace) or none.
    pub fn sampled(self, trace_id: &[u8; 16], parent: Option<&Parent>) -> bool {
        match self {
            Sampler::AlwaysOn => true,
            Sampler::AlwaysOff => false,
            Sampler::TraceIdRatio(ratio) => by_trace_id(ratio, trace_id),
            Sampler::ParentBased(root) => match (parent, root) {
                (Some(parent), _) => parent.sampled,
                (None, Root::AlwaysOn) => true,
                (None, Root::AlwaysOff) => false,
                (None, Root::TraceIdRatio(ratio)) => by_trace_id(ratio, trace_id),
            },
        }
    }
}

/// The trace-id ratio rule the OpenTelemetry SDKs share: the id's last 8 bytes, shifted right
/// by one, against `ratio × 2^63`.
fn by_trace_id(ratio: f64, trace_id: &[u8; 16]) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    // `as` saturates: a negative or NaN ratio samples nothing.
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    (u64::from_be_bytes(low) >> 1) < bound
}

/// The context a request continues: a valid W3C `traceparent` (and its `tracestate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
    /// The `tracestate` as it goes on (empty or invalid: none).
    pub trace_state: Option<Arc<str>>,
}

impl Parent {
    /// Reads `traceparent`/`tracestate` by the W3C propagator's rules: version `00` with
    /// exactly four fields (a later version may have more), lower-case hex ids that are not all
    /// zero, flags of which only `sampled` is kept. An invalid `tracestate` is dropped whole.
    pub fn read(headers: &dyn HeaderSource) -> Option<Parent> {
        let value = headers.header(&TRACEPARENT.0)?.trim();
        let mut parts = value.split_terminator('-');
        let (version_text, trace, span, flags_text) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let more = parts.next().is_some();
        let version = u8::from_str_radix(version_text, 16).ok()?;
        if version == 0xff || (version == 0 && more) {
            return None;
        }
        // Exactly 2, 32, 16 and 2 lower-case hex digits (no sign, no shorter field).
        let hex = |field: &str, len: usize| {
            field.len() == len
                && field
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if !hex(version_text, 2) || !hex(trace, 32) || !hex(span, 16) || !hex(flags_text, 2) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?.to_be_bytes();
        let span_id = u64::from_str_radix(span, 16).ok()?.to_be_bytes();
        let flags = u8::from_str_radix(flags_text, 16).ok()?;
        if (version == 0 && flags > 2) || trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        let trace_state = headers
            .header(&TRACESTATE.0)
            .and_then(trace_state)
            .map(Arc::from);
        Some(Parent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
            trace_state,
        })
    }
}

/// Most `tracestate` members passed on (W3C Trace Context: a list has at most 32).
pub const TRACE_STATE_MEMBERS: usize = 32;

/// Most bytes of `tracestate` passed on (W3C Trace Context asks a vendor to propagate at least
/// 512 characters of the combined header, and says how to cut a longer one).
pub const TRACE_STATE_BYTES: usize = 512;

/// Members longer than this go first when a `tracestate` must be cut (W3C Trace Context).
const LONG_MEMBER_BYTES: usize = 128;

/// A `tracestate` as it is passed on: its `key=value` members joined by commas, or `None`
/// when it is empty or any member read is invalid (a key of lower-case letters, digits and
/// `_-*/`, optionally `tenant@system`, up to 256 characters; a value without `,` or `=`).
///
/// Bounded as W3C Trace Context cuts a list: only the first [`TRACE_STATE_MEMBERS`] members
/// are read (the rest are dropped unread), and when those come to more than
/// [`TRACE_STATE_BYTES`] bytes joined, members over 128 bytes are dropped first, then members
/// from the end, until the rest fits. A client's 60 KB header costs at most 512 bytes per
/// trace held (and one pass over the first 32 members).
fn trace_state(header: &str) -> Option<String> {
    let mut members: smallvec::SmallVec<[&str; TRACE_STATE_MEMBERS]> = smallvec::SmallVec::new();
    for member in header.split_terminator(',') {
        // Optional white space around a member (`a=1, b=2`); an empty member is skipped.
        let member = member.trim_matches([' ', '\t']);
        if member.is_empty() {
            continue;
        }
        if members.len() == TRACE_STATE_MEMBERS {
            break;
        }
        let (key, value) = member.split_once('=')?;
        if !trace_state_key(key) || value.len() > 256 || value.contains('=') {
            return None;
        }
        members.push(member);
    }
    let joined = |members: &[&str]| {
        members
            .iter()
            .map(|m| m.len() + 1)
            .sum::<usize>()
            .saturating_sub(1)
    };
    let mut size = joined(&members);
    // Long members go first, the last of them first; then members from the end.
    while size > TRACE_STATE_BYTES {
        let Some(at) = members.iter().rposition(|m| m.len() > LONG_MEMBER_BYTES) else {
            break;
        };
        members.remove(at);
        size = joined(&members);
    }
    while size > TRACE_STATE_BYTES {
        members.pop();
        size = joined(&members);
    }
    (!members.is_empty()).then(|| members.join(","))
}

fn trace_state_key(key: &str) -> bool {
    let bytes = key.as_bytes();
    if bytes.is_empty() || bytes.len() > 256 {
        return false;
    }
    let allowed = |b: u8| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'*' | b'/')
    };
    if !(bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit()) {
        return false;
    }
    match key.split_once('@') {
        None => bytes.iter().all(|&b| allowed(b)),
        Some((tenant, system)) => {
            // A system id of at most 14 characters, starting with a letter or digit.
            tenant.bytes().all(allowed)
                && !system.is_empty()
                && system.len() <= 14
                && system.bytes().all(allowed)
                && system
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        }
    }
}

/// Random trace and span ids: a per-thread wyrand generator seeded from the system's random
/// source (ids must be unpredictable enough to be unique, and trace-id ratio sampling reads
/// their bits; they guard nothing).
fn random_u64() -> u64 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new(seed());
    }
    STATE.with(|state| {
        let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
        state.set(s);
        let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
        ((t >> 64) as u64) ^ (t as u64)
    })
}

fn seed() -> u64 {
    let mut bytes = [0u8; 8];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).is_err() {
        // No system randomness: the clock and the thread, still distinct per thread.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let here = &bytes as *const _ as u64;
        return now ^ here.rotate_left(32);
    }
    u64::from_le_bytes(bytes)
}

pub(super) fn new_trace_id() -> [u8; 16] {
    loop {
        let id = (u128::from(random_u64()) << 64 | u128::from(random_u64())).to_be_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

pub(super) fn new_span_id() -> [u8; 8] {
    loop {
        let id = random_u64();
        if id != 0 {
            return id.to_be_bytes();
        }
    }
}

/// Where a request's headers are read from (Pingora's, tonic's metadata, a described request's).
pub trait HeaderSource {
    fn header(&self, name: &http::HeaderName) -> Option<&str>;
}

impl HeaderSource for http::HeaderMap {
    fn header(&self, name: &http::HeaderName) -> Option<&str> {
        self.get(name).and_then(|v| v.to_str().ok())
    }
}
