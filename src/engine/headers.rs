//! The one place that turns a decision ([`Decided`]) into HTTP (SPEC §5): `RateLimit-Policy`,
//! `RateLimit` (one item per enforced rule), the legacy `RateLimit-Limit/Remaining/Reset` trio
//! for the most restrictive rule, and on refusal the status, body, reason header and
//! `Retry-After` with deterministic per-identity jitter.

use crate::engine::{Decided, Decision, Reason, RequestView, RuleOutcome};
use crate::policy::Mode;
use bytes::{BufMut, BytesMut};
use http::{HeaderName, HeaderValue};
use smallvec::SmallVec;
use std::net::IpAddr;

/// Default name of the reason header.
pub const DEFAULT_REASON_HEADER: &str = "X-Tollgate-Reason";

/// The `Retry-After` jitter's identity: the request's verified JWT `sub`, client address and
/// path, hashed. The same identity always gets the same offset.
///
/// The bytes hashed are `sub`, 0, the address's octets, 0, the path: gathered on the stack and
/// hashed in one call (the streaming hasher, fed piece by piece, gives the same value for about
/// twice the instructions).
fn jitter_hash(request: &RequestView<'_>) -> u64 {
    let mut identity: SmallVec<[u8; 192]> = SmallVec::new();
    identity.extend_from_slice(request.sub.unwrap_or("").as_bytes());
    identity.push(0);
    match request.client_ip {
        Some(IpAddr::V4(v4)) => identity.extend_from_slice(&v4.octets()),
        Some(IpAddr::V6(v6)) => identity.extend_from_slice(&v6.octets()),
        None => {}
    }
    identity.push(0);
    identity.extend_from_slice(request.path.as_bytes());
    twox_hash::XxHash64::oneshot(JITTER_SEED, &identity)
}

const JITTER_SEED: u64 = 0x746f_6c6c_6761_7465;

/// `Retry-After` for a base wait `b`: uniform over `[b, ceil(1.5 b)]`, chosen by the identity's
/// hash. Never shorter than `b`.
pub fn retry_after_with_jitter(b: u64, request: &RequestView<'_>) -> u64 {
    let high = b.saturating_add(b.div_ceil(2));
    let span = high - b + 1;
    b + jitter_hash(request) % span
}

/// `Retry-After` for a wait `b` that ends at a deadline (a budget window's end): uniform over
/// `[ceil(b / 2), b]`, so a spent budget's clients come back spread out, never after the window
/// has renewed.
pub fn retry_after_before_deadline(b: u64, request: &RequestView<'_>) -> u64 {
    let low = b.div_ceil(2);
    let span = b - low + 1;
    (low + jitter_hash(request) % span).max(1)
}

/// Headers for a response, in order: names parsed once at start-up, values slices of one
/// shared buffer (one allocation for all of them).
pub type HeaderList = SmallVec<[(HeaderName, HeaderValue); 7]>;

pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
pub static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
pub static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
/// Sent when an enforced budget crossed a warn or throttle stage (`budget_warn`,
/// `budget_throttle`), as Fairvisor's `X-Fairvisor-Warning`.
pub static WARNING: HeaderName = HeaderName::from_static("x-tollgate-warning");

/// How a header name is written for people (`simulate` output): the IETF spelling of ours.
pub fn display_name<'a>(name: &'a HeaderName, config: &'a HeaderConfig) -> &'a str {
    match name.as_str() {
        "ratelimit-policy" => "RateLimit-Policy",
        "ratelimit" => "RateLimit",
        "ratelimit-limit" => "RateLimit-Limit",
        "ratelimit-remaining" => "RateLimit-Remaining",
        "ratelimit-reset" => "RateLimit-Reset",
        "retry-after" => "Retry-After",
        "x-tollgate-warning" => "X-Tollgate-Warning",
        "x-fairvisor-warning" => "X-Fairvisor-Warning",
        _ if *name == config.reason_header => config.reason_header_display,
        other => other,
    }
}

/// Where [`build`] writes a response's headers, one at a time, in order.
trait Sink {
    /// The buffer a value is written into.
    type Buf: BufMut;
    fn push(&mut self, name: &HeaderName, write: impl FnOnce(&mut Self::Buf));

    fn number(&mut self, name: &HeaderName, n: u64) {
        self.push(name, |buf| {
            buf.put_slice(itoa::Buffer::new().format(n).as_bytes())
        });
    }

    /// A text value, checked (the tests write values that are not header-safe through it).
    #[cfg(test)]
    fn text(&mut self, name: &HeaderName, text: &str) {
        self.push(name, |buf| buf.put_slice(text.as_bytes()));
    }

    /// [`Sink::push`] for a value built only of header-safe parts: what the policy's load
    /// serialised (a rule's structured-field name and `RateLimit-Policy` item, printable ASCII
    /// by construction), digits and tollgate's own words. A sink may skip the check.
    fn push_safe(&mut self, name: &HeaderName, write: impl FnOnce(&mut Self::Buf)) {
        self.push(name, write);
    }
}

/// Collects header values in one buffer, then hands out slices of it.
struct Values {
    buf: BytesMut,
    spans: SmallVec<[(HeaderName, usize, usize); 7]>,
}

impl Sink for Values {
    type Buf = BytesMut;

    fn push(&mut self, name: &HeaderName, write: impl FnOnce(&mut BytesMut)) {
        // Allocated with the first value: a response without headers allocates nothing.
        if self.buf.capacity() == 0 {
            self.buf.reserve(192);
        }
        let start = self.buf.len();
        write(&mut self.buf);
        self.spans.push((name.clone(), start, self.buf.len()));
    }
}

impl Values {
    fn new() -> Self {
        Values {
            buf: BytesMut::new(),
            spans: SmallVec::new(),
        }
    }

    fn finish(self) -> HeaderList {
        if self.spans.is_empty() {
            return HeaderList::new();
        }
        let bytes = self.buf.freeze();
        // Every value is built from header-safe text; checked here once for the whole buffer
        // (the per-value check costs more than building the values). Should a byte not be
        // allowed in a header, each value is checked and a bad one dropped, never sent.
        if all_header_value_bytes(&bytes) {
            return self
                .spans
                .into_iter()
                .map(|(name, start, end)| {
                    // SAFETY: every byte of the buffer was checked above.
                    let value = unsafe {
                        HeaderValue::from_maybe_shared_unchecked(bytes.slice(start..end))
                    };
                    (name, value)
                })
                .collect();
        }
        self.spans
            .into_iter()
            .filter_map(|(name, start, end)| {
                HeaderValue::from_maybe_shared(bytes.slice(start..end))
                    .ok()
                    .map(|value| (name, value))
            })
            .collect()
    }
}

/// A refusal's headers written once as HTTP/1 header lines (`name: value` and CRLF each, the
/// name as `http` spells it), in the order [`build`] gives them: the fixed text of each rule
/// (its `RateLimit-Policy` item and quoted name, serialised when the policy loaded) and the
/// header names copied, only the numbers formatted. A front end writing HTTP/1 sends them as
/// they are ([`HeaderLines::as_bytes`]); any other turns them back into a list
/// ([`HeaderLines::into_list`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderLines {
    buf: Vec<u8>,
}

impl Sink for HeaderLines {
    type Buf = Vec<u8>;

    fn push(&mut self, name: &HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
        let line = self.buf.len();
        let start = self.start_line(name);
        write(&mut self.buf);
        // A value that is not header-safe is dropped, never sent (as from a list).
        if !all_header_value_bytes(&self.buf[start..]) {
            self.buf.truncate(line);
            return;
        }
        self.buf.extend_from_slice(b"\r\n");
    }

    fn push_safe(&mut self, name: &HeaderName, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.start_line(name);
        write(&mut self.buf);
        debug_assert!(all_header_value_bytes(&self.buf[start..]));
        self.buf.extend_from_slice(b"\r\n");
    }

    /// Digits need no check.
    fn number(&mut self, name: &HeaderName, n: u64) {
        self.start_line(name);
        self.buf
            .extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        self.buf.extend_from_slice(b"\r\n");
    }
}

impl HeaderLines {
    /// Writes `name: `; returns where the value starts.
    fn start_line(&mut self, name: &HeaderName) -> usize {
        self.buf.extend_from_slice(name.as_str().as_bytes());
        self.buf.extend_from_slice(b": ");
        self.buf.len()
    }

    /// The lines of a list's headers, in its order.
    #[cfg(test)]
    pub fn from_list(list: &HeaderList) -> Self {
        let mut lines = HeaderLines::default();
        for (name, value) in list {
            lines.push(name, |buf| buf.extend_from_slice(value.as_bytes()));
        }
        lines
    }

    /// The lines, each ending in CRLF.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The lines, each ending in CRLF, to hand on.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// Appends a line, unless `value` holds a byte a header value may not.
    pub fn push_bytes(&mut self, name: &HeaderName, value: &[u8]) {
        self.push(name, |buf| buf.extend_from_slice(value));
    }

    /// The same headers as a list, in order.
    pub fn into_list(self) -> HeaderList {
        self.buf
            .split(|&b| b == b'\n')
            .filter_map(|line| {
                let line = line.strip_suffix(b"\r")?;
                let colon = line.iter().position(|&b| b == b':')?;
                let name = HeaderName::from_bytes(&line[..colon]).ok()?;
                let value = HeaderValue::from_bytes(line[colon + 1..].strip_prefix(b" ")?).ok()?;
                Some((name, value))
            })
            .collect()
    }
}

/// A byte `http` accepts in a header value: visible ASCII, space, tab and obs-text (what
/// `HeaderValue::from_bytes` checks).
fn is_header_value_byte(b: u8) -> bool {
    (b >= 0x20 && b != 0x7f) || b == b'\t'
}

/// Whether every byte is one [`is_header_value_byte`] accepts, eight at a time: a word with no
/// byte below 0x20 and none equal to 0x7f passes whole (the classic "has a byte less than n" and
/// "has a zero byte" word tests, exact as yes/no answers); only a word that might not is looked
/// at byte by byte (a tab is allowed).
fn all_header_value_bytes(bytes: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let mut words = bytes.chunks_exact(8);
    let words_pass = words.by_ref().all(|word| {
        let mut eight = [0u8; 8];
        eight.copy_from_slice(word);
        let x = u64::from_le_bytes(eight);
        let below_space = x.wrapping_sub(ONES * 0x20) & !x & HIGHS;
        let del = x ^ (ONES * 0x7f);
        let has_del = del.wrapping_sub(ONES) & !del & HIGHS;
        (below_space | has_del) == 0 || word.iter().all(|&b| is_header_value_byte(b))
    });
    words_pass && words.remainder().iter().all(|&b| is_header_value_byte(b))
}

/// Everything a front end needs to answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Headers to add (to the upstream response on allow, to the refusal otherwise).
    pub headers: HeaderList,
    /// Body of a refusal; `None` on allow.
    pub body: Option<&'static str>,
    /// A refusal's headers as HTTP/1 lines, for a front end that asked for them
    /// ([`build_lines`]); `headers` is then empty.
    pub lines: Option<HeaderLines>,
}

/// Response settings.
#[derive(Debug, Clone)]
pub struct HeaderConfig {
    /// Name of the reason header (default `X-Tollgate-Reason`).
    pub reason_header: HeaderName,
    /// The same name as the operator wrote it.
    pub reason_header_display: &'static str,
    /// Name of the warning header (`X-Tollgate-Warning`; `X-Fairvisor-Warning` under
    /// `--compat fairvisor`).
    pub warning_header: HeaderName,
}

impl HeaderConfig {
    /// Settings with a reason header named `name`.
    ///
    /// # Errors
    /// `name` is not a valid header name.
    pub fn new(name: &'static str) -> Result<Self, http::header::InvalidHeaderName> {
        Ok(HeaderConfig {
            reason_header: HeaderName::from_bytes(name.as_bytes())?,
            reason_header_display: name,
            warning_header: WARNING.clone(),
        })
    }
}

impl Default for HeaderConfig {
    fn default() -> Self {
        HeaderConfig {
            reason_header: HeaderName::from_static("x-tollgate-reason"),
            reason_header_display: DEFAULT_REASON_HEADER,
            warning_header: WARNING.clone(),
        }
    }
}

fn remaining(rule: &RuleOutcome<'_>) -> u64 {
    rule.tokens / rule.rule.header_unit()
}

/// Builds the response for a decision.
pub fn build(decided: &Decided<'_>, config: &HeaderConfig) -> Response {
    let mut values = Values::new();
    let (status, body) = write(decided, config, &mut values);
    Response {
        status,
        headers: values.finish(),
        body,
        lines: None,
    }
}

/// [`build`] for a front end that writes HTTP/1 itself: the headers of a refusal, and of an
/// admission that has any, come as [`HeaderLines`], the bytes it sends. Any other response
/// comes as a list, and so does a kill switch's refusal that also reports a rule (its
/// `RateLimit-Remaining` and `RateLimit-Reset` appear twice, and a header map would send the
/// two values together).
pub fn build_lines(decided: &Decided<'_>, config: &HeaderConfig) -> Response {
    let decision = &decided.decision;
    match decision {
        Decision::Refuse(refusal)
            if refusal.reason == Reason::KillSwitch && shown(decision).next().is_some() =>
        {
            return build(decided, config);
        }
        Decision::Refuse(_) => {}
        Decision::Allow(checked)
            if shown(decision).next().is_some() || checked.warning().is_some() => {}
        // Nothing to write: the (empty) list, without allocating.
        _ => return build(decided, config),
    }
    let mut lines = HeaderLines {
        buf: Vec::with_capacity(256),
    };
    let (status, body) = write(decided, config, &mut lines);
    Response {
        status,
        headers: HeaderList::new(),
        body,
        lines: Some(lines),
    }
}

/// Whether `name` may be one of the headers [`write`] gives an admitted request (the
/// `RateLimit` family and the warning header): a front end that writes an admission's lines
/// after an upstream's headers sends the upstream's of such a name no more.
pub fn may_be_admitted_header(name: &HeaderName, config: &HeaderConfig) -> bool {
    name.as_str().starts_with("ratelimit") || *name == config.warning_header
}

/// The enforced rules that tracked a bucket; shadow rules add nothing to the client response.
fn shown<'a, 'r>(decision: &'a Decision<'r>) -> impl Iterator<Item = &'a RuleOutcome<'r>> + 'a {
    decision
        .rules()
        .iter()
        .filter(|r| r.rule.mode == Mode::Enforce && !r.fail_open)
}

/// Writes a decision's headers into `values`, in order; its status and body.
fn write<S: Sink>(
    decided: &Decided<'_>,
    config: &HeaderConfig,
    values: &mut S,
) -> (u16, Option<&'static str>) {
    let decision = &decided.decision;
    let shown = || shown(decision);
    let refusal = match decision {
        Decision::Refuse(r) => Some(r),
        _ => None,
    };

    if shown().next().is_some() {
        values.push_safe(&RATELIMIT_POLICY, |buf| {
            for (i, rule) in shown().enumerate() {
                if i > 0 {
                    buf.put_slice(b", ");
                }
                // q is the burst of the quota actually applied (a per-ID override may differ
                // from the rule's default, whose item was serialised at policy load).
                if rule.quota == rule.rule.quota {
                    buf.put_slice(rule.rule.policy_item.as_bytes());
                } else {
                    let mut itoa = itoa::Buffer::new();
                    buf.put_slice(rule.rule.sf_name.as_bytes());
                    buf.put_slice(b";q=");
                    buf.put_slice(
                        itoa.format(rule.quota.burst() / rule.rule.header_unit())
                            .as_bytes(),
                    );
                    buf.put_slice(b";w=");
                    buf.put_slice(itoa.format(rule.quota.window_secs()).as_bytes());
                }
            }
        });
        values.push_safe(&RATELIMIT, |buf| {
            let mut itoa = itoa::Buffer::new();
            for (i, rule) in shown().enumerate() {
                // A cost that can never fit has no wait: `t` says when the bucket is full.
                let t = if rule.allowed || rule.cost_exceeds {
                    rule.reset
                } else {
                    rule.retry_after
                };
                if i > 0 {
                    buf.put_slice(b", ");
                }
                buf.put_slice(rule.rule.sf_name.as_bytes());
                buf.put_slice(b";r=");
                buf.put_slice(itoa.format(remaining(rule)).as_bytes());
                buf.put_slice(b";t=");
                buf.put_slice(itoa.format(t).as_bytes());
            }
        });

        // Legacy trio: the refusing rule, or the one with the fewest tokens left.
        let legacy = if refusal.is_some() {
            decision.rejecting_rule().or_else(|| shown().next())
        } else {
            shown().min_by(|a, b| remaining(a).cmp(&remaining(b)).then(b.reset.cmp(&a.reset)))
        };
        if let Some(rule) = legacy {
            values.number(
                &RATELIMIT_LIMIT,
                rule.quota.burst() / rule.rule.header_unit(),
            );
            if rule.cost_exceeds {
                values.number(&RATELIMIT_REMAINING, remaining(rule));
                values.number(&RATELIMIT_RESET, rule.reset);
            } else if let Some(r) = refusal {
                values.number(&RATELIMIT_REMAINING, 0);
                values.number(&RATELIMIT_RESET, r.retry_after.max(1));
            } else {
                values.number(&RATELIMIT_REMAINING, remaining(rule));
                values.number(&RATELIMIT_RESET, rule.reset);
            }
        }
    }

    if let Some(warning) = decision.checked().and_then(|c| c.warning()) {
        values.push_safe(&config.warning_header, |buf| {
            buf.put_slice(warning.as_bytes())
        });
    }
    let Some(refusal) = refusal else {
        return (200, None);
    };
    // A kill switch has no bucket, but its refusal still says when to come back.
    if refusal.reason == Reason::KillSwitch {
        values.number(&RATELIMIT_REMAINING, 0);
        values.number(&RATELIMIT_RESET, refusal.retry_after.max(1));
    }
    if refusal.retry_after > 0 {
        // A penalty block ends at a known instant for one key: its wait counts down to it,
        // exactly.
        let wait = if refusal.reason == Reason::Penalty {
            refusal.retry_after
        } else if refusal.retry_by_deadline {
            retry_after_before_deadline(refusal.retry_after, &decided.request)
        } else {
            retry_after_with_jitter(refusal.retry_after, &decided.request)
        };
        values.number(&http::header::RETRY_AFTER, wait);
    }
    values.push_safe(&config.reason_header, |buf| {
        buf.put_slice(refusal.reason.as_str().as_bytes())
    });
    (refusal.reason.status(), Some(refusal.reason.body()))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The jitter's identity hashes to what the streaming hasher, fed piece by piece, gave:
        /// a client's `Retry-After` does not change with this release.
        #[test]
        fn jitter_hash_is_the_streaming_hash(sub in proptest::option::of("[a-z0-9]{0,40}"), v6 in proptest::prelude::any::<bool>(), ip in proptest::prelude::any::<u128>(), path in "/[a-z/%0-9]{0,300}") {
            use std::hash::Hasher;
            let client_ip = Some(if v6 { IpAddr::V6(ip.into()) } else { IpAddr::V4((ip as u32).into()) });
            let request = RequestView { client_ip, sub: sub.as_deref(), path: &path, ..RequestView::default() };
            let mut h = twox_hash::XxHash64::with_seed(JITTER_SEED);
            h.write(sub.as_deref().unwrap_or("").as_bytes());
            h.write_u8(0);
            match client_ip {
                Some(IpAddr::V4(v4)) => h.write(&v4.octets()),
                Some(IpAddr::V6(v6)) => h.write(&v6.octets()),
                None => {}
            }
            h.write_u8(0);
            h.write(path.as_bytes());
            proptest::prop_assert_eq!(jitter_hash(&request), h.finish());
        }

        /// The word-at-a-time check answers as the byte-by-byte one.
        #[test]
        fn header_bytes_are_checked_as_one_by_one(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40)) {
            proptest::prop_assert_eq!(
                all_header_value_bytes(&bytes),
                bytes.iter().all(|&b| is_header_value_byte(b))
            );
        }

        /// Mostly header-safe text with a rare bad byte, where a word test could go wrong.
        #[test]
        fn header_bytes_near_the_edges(bytes in proptest::collection::vec(proptest::sample::select(vec![0x00u8, 0x09, 0x0a, 0x1f, 0x20, 0x21, 0x7e, 0x7f, 0x80, 0xff, b'a']), 0..40)) {
            proptest::prop_assert_eq!(
                all_header_value_bytes(&bytes),
                bytes.iter().all(|&b| is_header_value_byte(b))
            );
        }
    }

    /// Values are checked once for the whole buffer; a value that is not header-safe is
    /// dropped and the others kept, as when each was checked alone.
    #[test]
    fn a_value_that_is_not_header_safe_is_dropped() {
        let mut values = Values::new();
        values.number(&RATELIMIT_REMAINING, 7);
        values.text(&RATELIMIT_POLICY, "\"r\";q=5;w=1");
        let list = values.finish();
        assert_eq!(list.len(), 2);
        assert_eq!(list[1].1.as_bytes(), b"\"r\";q=5;w=1");
        let mut values = Values::new();
        values.number(&RATELIMIT_REMAINING, 7);
        values.text(&RATELIMIT_POLICY, "bad\nvalue");
        values.text(&RATELIMIT, "tab\tand \u{e9}");
        let list = values.finish();
        let names: Vec<&str> = list.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["ratelimit-remaining", "ratelimit"]);
        assert_eq!(list[1].1.as_bytes(), "tab\tand \u{e9}".as_bytes());
    }
    use crate::engine::{decide_local, EngineConfig};
    use crate::policy::{compile_bundle, push_sf_string};
    use crate::request::descriptor::RequestFacts;
    use crate::store::{MemoryStore, MemoryStoreConfig};
    use serde_json::json;

    /// A bundle and an embedded store at time 0.
    struct Local<'a>(&'a crate::policy::Bundle, &'a MemoryStore);

    impl<'a> Local<'a> {
        fn decide(&self, facts: &RequestFacts<'_>) -> Decision<'a> {
            decide_local(self.0, facts, self.1, 0, 0, EngineConfig::default())
        }
    }

    fn get<'a>(r: &'a Response, name: &str) -> Option<&'a str> {
        r.headers
            .iter()
            .find(|(n, _)| n.as_str().eq_ignore_ascii_case(name))
            .and_then(|(_, v)| v.to_str().ok())
    }

    #[test]
    fn jitter_is_deterministic_bounded_and_spread() {
        for b in [1u64, 2, 3, 10, 61] {
            let high = (1.5 * b as f64).ceil() as u64;
            let mut seen = std::collections::HashSet::new();
            for i in 0..200u8 {
                let id = RequestView {
                    client_ip: Some(IpAddr::from([10, 0, 0, i])),
                    path: "/x",
                    ..RequestView::default()
                };
                let v = retry_after_with_jitter(b, &id);
                assert!((b..=high).contains(&v), "b={b} v={v}");
                assert_eq!(
                    v,
                    retry_after_with_jitter(b, &id),
                    "same identity, same value"
                );
                seen.insert(v);
            }
            assert_eq!(
                seen.len() as u64,
                high - b + 1,
                "b={b}: every value in range is used"
            );
        }
        let a = RequestView {
            sub: Some("alice"),
            path: "/x",
            ..RequestView::default()
        };
        let c = RequestView {
            sub: Some("carol"),
            path: "/x",
            ..RequestView::default()
        };
        assert_ne!(jitter_hash(&a), jitter_hash(&c));
    }

    /// A request for `/a` from `ip`.
    fn view_of(ip: IpAddr) -> RequestView<'static> {
        RequestView {
            client_ip: Some(ip),
            path: "/a",
            ..RequestView::default()
        }
    }

    /// A per-IP rule of `rps` and `burst` beside a global one of 100 and 1 000.
    fn per_ip_and_global(rps: u64, burst: u64) -> crate::policy::Bundle {
        compile_bundle(&json!({"rules": [
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": rps, "burst": burst}},
            {"name": "global", "limit_keys": [], "algorithm": "token_bucket", "algorithm_config": {"rps": 100, "burst": 1000}}
        ]}), "t").unwrap()
    }

    #[test]
    fn headers_for_allow_and_reject() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let bundle = per_ip_and_global(10, 15);
        let e = Local(&bundle, &store);
        let headers: Vec<(String, String)> = Vec::new();
        let ip: IpAddr = "203.0.113.7".parse().unwrap();
        let facts = RequestFacts::from_uri("GET", "/a", None, Some(ip), &headers);
        let request = view_of(ip);
        let cfg = HeaderConfig::default();
        let decided = Decided {
            decision: e.decide(&facts),
            request,
        };
        let r = build(&decided, &cfg);
        assert_eq!(r.status, 200);
        assert_eq!(
            get(&r, "RateLimit-Policy"),
            Some("\"per-ip\";q=15;w=2, \"global\";q=1000;w=10")
        );
        assert_eq!(
            get(&r, "RateLimit"),
            Some("\"per-ip\";r=14;t=1, \"global\";r=999;t=1")
        );
        assert_eq!(get(&r, "RateLimit-Limit"), Some("15"));
        assert_eq!(get(&r, "RateLimit-Remaining"), Some("14"));
        assert_eq!(get(&r, "RateLimit-Reset"), Some("1"));
        assert_eq!(get(&r, "Retry-After"), None);
        for _ in 0..14 {
            e.decide(&facts);
        }
        let decided = Decided {
            decision: e.decide(&facts),
            request,
        };
        let r = build(&decided, &cfg);
        assert_eq!(r.status, 429);
        assert_eq!(r.body, Some("Too Many Requests"));
        assert_eq!(get(&r, "RateLimit-Remaining"), Some("0"));
        assert_eq!(get(&r, "RateLimit-Reset"), Some("1"));
        assert_eq!(get(&r, "RateLimit-Limit"), Some("15"));
        assert_eq!(
            get(&r, "RateLimit"),
            Some("\"per-ip\";r=0;t=1, \"global\";r=985;t=1")
        );
        assert_eq!(get(&r, "X-Tollgate-Reason"), Some("token_bucket_exceeded"));
        let retry: u64 = get(&r, "Retry-After").unwrap().parse().unwrap();
        assert!((1..=2).contains(&retry));
    }

    /// The list written out as lines, `name: value` and CRLF each.
    fn written(list: &HeaderList) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in list {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    /// A refusal's lines are its list written out, and read back they are the list; so are an
    /// admission's, whose names are all ones [`may_be_admitted_header`] knows; a kill switch's
    /// refusal (no rule reported) comes as lines.
    #[test]
    fn a_refusal_as_lines_is_its_list_written_out() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let bundle = per_ip_and_global(1, 2);
        let e = Local(&bundle, &store);
        let headers: Vec<(String, String)> = Vec::new();
        let ip: IpAddr = "203.0.113.9".parse().unwrap();
        let facts = RequestFacts::from_uri("GET", "/a", None, Some(ip), &headers);
        let request = view_of(ip);
        let cfg = HeaderConfig::default();
        let decided = Decided {
            decision: e.decide(&facts),
            request,
        };
        let allowed_list = build(&decided, &cfg);
        assert_eq!(allowed_list.headers.len(), 5);
        let allowed = build_lines(&decided, &cfg);
        assert_eq!(allowed.status, 200);
        assert!(allowed.headers.is_empty());
        let allowed_lines = allowed.lines.unwrap();
        assert_eq!(
            String::from_utf8_lossy(allowed_lines.as_bytes()),
            String::from_utf8_lossy(&written(&allowed_list.headers))
        );
        assert_eq!(allowed_lines.into_list(), allowed_list.headers);
        assert!(allowed_list
            .headers
            .iter()
            .all(|(name, _)| may_be_admitted_header(name, &cfg)));
        assert!(may_be_admitted_header(&cfg.warning_header, &cfg));
        assert!(!may_be_admitted_header(&http::header::RETRY_AFTER, &cfg));
        assert!(!may_be_admitted_header(&cfg.reason_header, &cfg));
        e.decide(&facts);
        let decided = Decided {
            decision: e.decide(&facts),
            request,
        };
        let list = build(&decided, &cfg);
        let lines = build_lines(&decided, &cfg);
        assert_eq!((lines.status, lines.body), (429, Some("Too Many Requests")));
        assert!(lines.headers.is_empty());
        let written_lines = lines.lines.unwrap();
        assert_eq!(
            String::from_utf8_lossy(written_lines.as_bytes()),
            String::from_utf8_lossy(&written(&list.headers))
        );
        assert_eq!(list.headers.len(), 7);
        assert_eq!(written_lines.into_list(), list.headers);

        let killed = compile_bundle(&json!({"rules": [
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 2}}
        ], "kill_switches": [{"scope_key": "ip:address", "scope_value": "203.0.113.9"}]}), "t").unwrap();
        let decided = Decided {
            decision: Local(&killed, &store).decide(&facts),
            request,
        };
        let list = build(&decided, &cfg);
        assert_eq!(get(&list, "X-Tollgate-Reason"), Some("kill_switch"));
        // A kill switch decides before any rule is checked: no rule is reported, each header
        // comes once, and the refusal comes as its lines.
        let remaining = list
            .headers
            .iter()
            .filter(|(name, _)| *name == RATELIMIT_REMAINING)
            .count();
        assert_eq!(remaining, 1);
        let response = build_lines(&decided, &cfg);
        assert_eq!(response.status, 429);
        assert!(response.headers.is_empty());
        let lines = response.lines.unwrap();
        assert_eq!(lines.as_bytes(), written(&list.headers).as_slice());
    }

    /// A value that is not header-safe is left out of the lines, as out of a list.
    #[test]
    fn a_line_whose_value_is_not_header_safe_is_dropped() {
        let mut lines = HeaderLines::default();
        lines.number(&RATELIMIT_REMAINING, 7);
        lines.text(&RATELIMIT_POLICY, "bad\nvalue");
        lines.text(&RATELIMIT, "tab\tand \u{e9}");
        assert_eq!(
            lines.as_bytes(),
            "ratelimit-remaining: 7\r\nratelimit: tab\tand \u{e9}\r\n".as_bytes()
        );
        let list = lines.into_list();
        let names: Vec<&str> = list.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["ratelimit-remaining", "ratelimit"]);
        assert_eq!(list[1].1.as_bytes(), "tab\tand \u{e9}".as_bytes());
    }

    #[test]
    fn names_are_escaped() {
        let mut out = String::new();
        push_sf_string(&mut out, "a\"b\\c\nd");
        assert_eq!(out, "\"a\\\"b\\\\cd\"");
    }

    #[test]
    fn an_override_reports_its_own_burst() {
        let store = MemoryStore::new(MemoryStoreConfig::default());
        let bundle = compile_bundle(&json!({"rules": [
            {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
             "algorithm_config": {"rps": 1, "burst": 10, "overrides": [{"ids": ["10.0.0.5"], "burst": 50, "rps": 5}]}}
        ]}), "t").unwrap();
        let e = Local(&bundle, &store);
        let headers: Vec<(String, String)> = Vec::new();
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let facts = RequestFacts::from_uri("GET", "/", None, Some(ip), &headers);
        let decided = Decided {
            decision: e.decide(&facts),
            request: RequestView::default(),
        };
        let r = build(&decided, &HeaderConfig::default());
        assert_eq!(get(&r, "RateLimit-Policy"), Some("\"per-ip\";q=50;w=10"));
        assert_eq!(get(&r, "RateLimit-Limit"), Some("50"));
        assert_eq!(get(&r, "RateLimit-Remaining"), Some("49"));
    }
}
