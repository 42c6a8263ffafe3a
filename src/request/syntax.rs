//! What a request's method, target and `Host` must look like before anything matches on them:
//! the shapes an upstream could read differently from the gateway are refused (400) at the
//! edge, as nginx refuses them, instead of being matched one way and routed another.
//!
//! - **Method**: upper-case letters, `_` and `-` only (nginx's rule). `get` or `GeT` would
//!   pass a selector or kill switch written for `GET` and still be served as a GET by many
//!   frameworks, which compare methods without case.
//! - **Target**: origin-form (starts with `/`), absolute-form (`scheme://authority...`, which
//!   HTTP/1.1 lets a client send to any server), or `*` for `OPTIONS`. `GET smuggled` is
//!   matched as `/` but served by some frameworks as `/smuggled`.
//! - **Host** (and HTTP/2's `:authority`): `host[:port]`, where host is a DNS-style name
//!   (letters, digits, `-`, `_`, `~`, dots between non-empty labels, one trailing dot) or a
//!   bracketed IPv6 literal, and port at most five digits. `blocked.example/x`,
//!   `blocked.example x` or `blocked.example,ok.example` would otherwise match no host rule
//!   while an upstream reads a host out of them. An HTTP/1.1 request without any `Host` is
//!   refused too (RFC 9112 §3.2 asks for a 400).
//!
//! - **Path parameters** (`;`): matching cuts them from each segment, as servlet containers
//!   do. A parameter on an empty, `.` or `..` segment (`/admin/..;/x`, `/admin/%2e%2e;/x`), or
//!   one that runs over an encoded or backslash separator (`/pub;x%2F..%2Fadmin`), is refused:
//!   a servlet container and every other server (nginx, Envoy, Go... for which `;` is data)
//!   read such a path as two different places, so no one match path can stand for both.
//!
//! Pure: the proxy hands in the request line's pieces and its `Host` values.

/// Why a request is refused before it is matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("the method is not an upper-case token")]
    Method,
    #[error(
        "the request target does not start with `/` (nor is it absolute-form, or `*` for OPTIONS)"
    )]
    Target,
    #[error("the Host is not host[:port]")]
    Host,
    #[error("an HTTP/1.1 request without a Host")]
    MissingHost,
}

/// A method nginx would take: one or more of `A`–`Z`, `_` and `-`.
pub fn method_ok(method: &[u8]) -> bool {
    !method.is_empty()
        && method
            .iter()
            .all(|&b| b.is_ascii_uppercase() || b == b'_' || b == b'-')
}

/// A request target in origin-form (`/...`), absolute-form (`scheme://...`, the scheme a
/// letter then letters, digits, `+`, `-` or `.`; its authority is checked by the caller's
/// HTTP layer against `Host`), or `*` with `OPTIONS`.
pub fn target_ok(method: &[u8], target: &[u8]) -> bool {
    match target.first() {
        Some(b'/') => path_parameters_ok(target),
        Some(b'*') => target.len() == 1 && method == b"OPTIONS",
        Some(first) if first.is_ascii_alphabetic() => {
            let Some(colon) = memchr::memchr(b':', target) else {
                return false;
            };
            target[1..colon]
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
                && target[colon..].starts_with(b"://")
        }
        _ => false,
    }
}

/// Whether every `;` path parameter of `target` (origin-form, query and all) can be cut the
/// same way by every reader: not on a `.` or `..` segment (escaped dots included), not on an
/// empty segment when a dot segment follows (`/admin/;/..`: cut, the climb leaves `/admin`),
/// and not running over a `\\`, `%2F` or `%5C` (which some servers read as a separator).
pub fn path_parameters_ok(target: &[u8]) -> bool {
    // One scan for the first `?` or `;`: a path without a `;` before its query (nearly every
    // one) is done.
    let first = match memchr::memchr2(b'?', b';', target) {
        Some(at) if target[at] == b';' => at,
        _ => return true,
    };
    let path = match memchr::memchr(b'?', &target[first..]) {
        Some(end) => &target[..first + end],
        None => target,
    };
    parameters_ok_in(path)
}

/// [`path_parameters_ok`] on the path alone (the target before its `?`).
fn parameters_ok_in(path: &[u8]) -> bool {
    let escaped_separator = |at: &[u8]| {
        at.len() >= 3
            && at[0] == b'%'
            && ((at[1] == b'2' && at[2] | 0x20 == b'f') || (at[1] == b'5' && at[2] | 0x20 == b'c'))
    };
    let mut segment_start = 0;
    let mut empty_segment_parameter = false;
    let mut i = 0;
    while i < path.len() {
        match path[i] {
            b'/' | b'\\' => {
                if empty_segment_parameter
                    && i > segment_start
                    && dot_or_empty(&path[segment_start..i])
                {
                    return false;
                }
                segment_start = i + 1;
                i += 1;
            }
            b'%' if escaped_separator(&path[i..]) => {
                segment_start = i + 3;
                i += 3;
            }
            b';' => {
                let segment = &path[segment_start..i];
                if segment.is_empty() {
                    empty_segment_parameter = true;
                } else if dot_or_empty(segment) {
                    return false;
                }
                // The parameter runs to the next raw `/`: it must not swallow a separator
                // another server would see.
                let end = memchr::memchr(b'/', &path[i..]).map_or(path.len(), |e| i + e);
                let parameter = &path[i..end];
                if parameter.contains(&b'\\')
                    || (0..parameter.len()).any(|k| escaped_separator(&parameter[k..]))
                {
                    return false;
                }
                i = end;
            }
            _ => i += 1,
        }
    }
    // A last segment that is a dot segment, after a parameter on an empty one.
    !(empty_segment_parameter && segment_start < path.len() && dot_or_empty(&path[segment_start..]))
}

/// An empty segment, or one that is `.` or `..` once `%2e` is read as a dot.
fn dot_or_empty(segment: &[u8]) -> bool {
    let mut dots = 0;
    let mut i = 0;
    while i < segment.len() {
        if segment[i] == b'.' {
            i += 1;
        } else if segment.len() >= i + 3
            && segment[i] == b'%'
            && segment[i + 1] == b'2'
            && segment[i + 2] | 0x20 == b'e'
        {
            i += 3;
        } else {
            return false;
        }
        dots += 1;
    }
    dots <= 2
}

/// A `Host` (or `:authority`) value of the form `host[:port]` (see the module's opening for
/// the characters a host may have). Empty is not a host.
pub fn host_ok(value: &[u8]) -> bool {
    let port = if value.first() == Some(&b'[') {
        let Some(end) = memchr::memchr(b']', value) else {
            return false;
        };
        let literal = &value[1..end];
        if literal.is_empty()
            || !literal
                .iter()
                .all(|&b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return false;
        }
        match &value[end + 1..] {
            [] => return true,
            [b':', port @ ..] => port,
            _ => return false,
        }
    } else {
        // The name is read up to the first `:` in the same pass that checks it.
        match name_len(value) {
            Some(end) if end == value.len() => return true,
            Some(end) => &value[end + 1..],
            None => return false,
        }
    };
    port.len() <= 5 && port.iter().all(u8::is_ascii_digit)
}

/// The bytes a name's labels may have: letters, digits, `-`, `_` and `~`.
const NAME_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'~';
        b += 1;
    }
    table
};

/// The length of the DNS-style name `value` starts with, up to its first `:` or its end, or
/// `None` when that is no such name: labels of letters, digits, `-`, `_` and `~`, none empty,
/// with at most one trailing dot. One pass with a table lookup per byte (this runs on every
/// request).
fn name_len(value: &[u8]) -> Option<usize> {
    // `true` at the start too: a leading dot is an empty first label.
    let mut after_dot = true;
    // The name's last byte was a dot (one trailing dot is allowed).
    let mut dot_last = false;
    let mut end = value.len();
    for (i, &b) in value.iter().enumerate() {
        if b == b'.' {
            if after_dot {
                return None;
            }
            after_dot = true;
            dot_last = true;
        } else if NAME_BYTES[usize::from(b)] {
            after_dot = false;
            dot_last = false;
        } else if b == b':' {
            end = i;
            break;
        } else {
            return None;
        }
    }
    (!after_dot || dot_last).then_some(end)
}

/// A request's line and `Host` as the proxy has them.
#[derive(Debug, Clone, Copy)]
pub struct RequestLine<'a> {
    pub method: &'a [u8],
    /// The target as sent (absolute-form kept whole).
    pub target: &'a [u8],
    /// An HTTP/1.1 request (which must carry a `Host`, RFC 9112 §3.2).
    pub http11: bool,
    /// The target's (HTTP/2 `:authority`'s) authority, when the HTTP layer split one out.
    pub authority: Option<&'a [u8]>,
}

/// Checks a request line and its `Host` values (every `Host` line sent).
///
/// # Errors
/// The first of [`Malformed`] the request is.
pub fn check<'h>(
    line: RequestLine<'_>,
    hosts: impl IntoIterator<Item = &'h [u8]>,
) -> Result<(), Malformed> {
    if !method_ok(line.method) {
        return Err(Malformed::Method);
    }
    if !target_ok(line.method, line.target) {
        return Err(Malformed::Target);
    }
    if line.authority.is_some_and(|a| !host_ok(a)) {
        return Err(Malformed::Host);
    }
    let mut any_host = false;
    for host in hosts {
        if !host_ok(host) {
            return Err(Malformed::Host);
        }
        any_host = true;
    }
    let absolute = line.target.first().is_some_and(u8::is_ascii_alphabetic);
    if line.http11 && !any_host && line.authority.is_none() && !absolute {
        return Err(Malformed::MissingHost);
    }
    Ok(())
}

#[cfg(test)]
mod path_parameter_tests {
    use super::*;

    /// Every string up to `len` bytes over `alphabet`.
    fn all_strings(alphabet: &[u8], len: usize) -> Vec<Vec<u8>> {
        let mut out = vec![Vec::new()];
        let mut last = vec![Vec::new()];
        for _ in 0..len {
            let next: Vec<Vec<u8>> = last
                .iter()
                .flat_map(|s: &Vec<u8>| {
                    alphabet.iter().map(move |&b| {
                        let mut t = s.clone();
                        t.push(b);
                        t
                    })
                })
                .collect();
            out.extend(next.iter().cloned());
            last = next;
        }
        out
    }

    /// The two-scan reading (`?` first, then `;` in the path) the one-scan reading replaced.
    fn two_scans(target: &[u8]) -> bool {
        let path = match memchr::memchr(b'?', target) {
            Some(end) => &target[..end],
            None => target,
        };
        memchr::memchr(b';', path).is_none() || parameters_ok_in(path)
    }

    /// The name check as a separate split at `:` then a pass over the name.
    fn split_then_check(value: &[u8]) -> bool {
        if value.first() == Some(&b'[') {
            return host_ok(value);
        }
        let (name, port) = match memchr::memchr(b':', value) {
            Some(colon) => (&value[..colon], &value[colon + 1..]),
            None => (value, &b""[..]),
        };
        let name = name.strip_suffix(b".").unwrap_or(name);
        let labels_ok = !name.is_empty()
            && name
                .split(|&b| b == b'.')
                .all(|l| !l.is_empty() && l.iter().all(|&b| NAME_BYTES[usize::from(b)]));
        labels_ok && port.len() <= 5 && port.iter().all(u8::is_ascii_digit)
    }

    /// The one-pass readings agree with the straightforward ones on every short input.
    #[test]
    fn one_pass_checks_read_as_the_straightforward_ones() {
        for target in all_strings(b"/;?.a%2F\\", 6) {
            assert_eq!(
                path_parameters_ok(&target),
                two_scans(&target),
                "{:?}",
                String::from_utf8_lossy(&target)
            );
        }
        for host in all_strings(b"a.:1-/ _", 6) {
            assert_eq!(
                host_ok(&host),
                split_then_check(&host),
                "{:?}",
                String::from_utf8_lossy(&host)
            );
        }
    }

    /// Parameters that every reader cuts alike pass; those on a dot or empty segment, or over
    /// an encoded or backslash separator, are refused.
    #[test]
    fn ambiguous_path_parameters_are_refused() {
        for fine in [
            "/smuggled;jsessionid=0123",
            "/a;p=1/b",
            "/x?q=;..",
            "/plain",
            "/a/b;c=d/e;f",
            "/;x/smuggled",
        ] {
            assert!(path_parameters_ok(fine.as_bytes()), "{fine}");
            assert!(target_ok(b"GET", fine.as_bytes()), "{fine}");
        }
        for bad in [
            "/admin/..;/x",
            "/admin/%2e%2e;/x",
            "/admin/%2E.;x/y",
            "/admin/;/..",
            "/admin/.;x",
            "/admin/;/../x",
            "/pub;x%2F..%2Fadmin",
            "/pub;x%5c..",
            "/pub;\\..\\admin",
            "/admin%2F..;/x",
        ] {
            assert!(!path_parameters_ok(bad.as_bytes()), "{bad}");
            assert!(!target_ok(b"GET", bad.as_bytes()), "{bad}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(method: &'a str, target: &'a str) -> RequestLine<'a> {
        RequestLine {
            method: method.as_bytes(),
            target: target.as_bytes(),
            http11: true,
            authority: None,
        }
    }

    #[test]
    fn methods_are_upper_case_tokens_as_nginx_reads_them() {
        for ok in ["GET", "POST", "M-SEARCH", "MY_METHOD", "PROPFIND"] {
            assert!(method_ok(ok.as_bytes()), "{ok}");
        }
        for bad in ["get", "GeT", "post", "GET1", "GE T", "", "G\u{e9}T", "GET/"] {
            assert!(!method_ok(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn targets_start_with_a_slash_or_are_absolute_or_an_options_star() {
        for (method, ok) in [
            ("GET", "/"),
            ("GET", "/smuggled;x"),
            ("GET", "http://api.example.com/x"),
            ("GET", "https://api.example.com"),
            ("GET", "foo+bar.v1-x://a/x"),
            ("OPTIONS", "*"),
        ] {
            assert!(target_ok(method.as_bytes(), ok.as_bytes()), "{method} {ok}");
        }
        for (method, bad) in [
            ("GET", "smuggled"),
            ("GET", "smuggled/x"),
            ("GET", "*"),
            ("OPTIONS", "*x"),
            ("GET", "%2Fsmuggled"),
            ("GET", "?a=1"),
            ("GET", ""),
            ("GET", "1http://a/x"),
            ("GET", "http:/a/x"),
            ("GET", "ht_tp://a/x"),
            ("CONNECT", "api.example.com:443"),
        ] {
            assert!(
                !target_ok(method.as_bytes(), bad.as_bytes()),
                "{method} {bad}"
            );
        }
    }

    #[test]
    fn hosts_are_host_and_optional_port() {
        for ok in [
            "api.example.com",
            "API.Example.com.",
            "api.example.com:8080",
            "api.example.com:",
            "a_b.example",
            "localhost",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:8080",
            "[2001:db8::7]:443",
            "[::ffff:192.0.2.1]",
            "xn--bcher-kva.example",
        ] {
            assert!(host_ok(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "",
            ".",
            "blocked.example/x",
            "blocked.example x",
            "blocked.example,ok.example",
            "blocked.example\\x",
            "blocked..example",
            ".blocked.example",
            "blocked.example:abc",
            "blocked.example:80:81",
            "blocked.example:123456",
            "user@blocked.example",
            "blocked.example;x",
            "blocked%2Eexample",
            "[::1",
            "[]",
            "[::1]x",
            "[::1]:8x",
            "[fe80::1%25eth0]",
            "bl\u{f6}cked.example",
        ] {
            assert!(!host_ok(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn check_reports_the_first_problem() {
        let hosts = |h: &'static [&'static str]| h.iter().map(|h| h.as_bytes());
        assert_eq!(check(line("GET", "/x"), hosts(&["a.example"])), Ok(()));
        assert_eq!(
            check(line("get", "x"), hosts(&["a b"])),
            Err(Malformed::Method)
        );
        assert_eq!(
            check(line("GET", "x"), hosts(&["a b"])),
            Err(Malformed::Target)
        );
        assert_eq!(
            check(line("GET", "/x"), hosts(&["ok.example", "a b"])),
            Err(Malformed::Host)
        );
        assert_eq!(
            check(line("GET", "/x"), hosts(&[])),
            Err(Malformed::MissingHost)
        );
        // An absolute-form target names its host; HTTP/1.0 needs none.
        assert_eq!(check(line("GET", "http://a.example/x"), hosts(&[])), Ok(()));
        let http10 = RequestLine {
            http11: false,
            ..line("GET", "/x")
        };
        assert_eq!(check(http10, hosts(&[])), Ok(()));
        // HTTP/2's :authority is a Host, and is checked as one.
        let h2 = |authority: &'static str| RequestLine {
            authority: Some(authority.as_bytes()),
            http11: false,
            ..line("GET", "/x")
        };
        assert_eq!(check(h2("a.example:443"), hosts(&[])), Ok(()));
        assert_eq!(
            check(h2("a.example,b.example"), hosts(&[])),
            Err(Malformed::Host)
        );
    }

    proptest::proptest! {
        /// The checks never panic on any bytes.
        #[test]
        fn checks_are_total(
            method in proptest::collection::vec(proptest::num::u8::ANY, 0..8),
            target in proptest::collection::vec(proptest::num::u8::ANY, 0..24),
            host in proptest::collection::vec(proptest::num::u8::ANY, 0..24),
        ) {
            let line = RequestLine { method: &method, target: &target, http11: true, authority: Some(&host) };
            let _ = check(line, [host.as_slice()]);
        }

        /// Every name made of valid labels, with any port of up to five digits, is a host.
        #[test]
        fn names_with_ports_are_hosts(
            labels in proptest::collection::vec("[a-zA-Z0-9_~-]{1,8}", 1..5),
            port in proptest::option::of("[0-9]{0,5}"),
        ) {
            let mut host = labels.join(".");
            if let Some(port) = port {
                host.push(':');
                host.push_str(&port);
            }
            proptest::prop_assert!(host_ok(host.as_bytes()), "{}", host);
        }
    }
}
