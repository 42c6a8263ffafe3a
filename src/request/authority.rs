//! An authority (`host[:port]`, of a `Host` header or a URL): the one place that takes a host
//! apart from its port and from the brackets of an IPv6 literal.

use std::net::Ipv6Addr;

/// The host name of a `Host` value: `example.com:8080` → `example.com`; `[::1]:8080` →
/// `[::1]`; a bare IPv6 literal as is. Whatever follows the first `:` of a name is dropped,
/// valid port or not: `api.example.com:abc` is still `api.example.com` to matching, as it is to
/// the upstreams that serve it.
#[inline]
pub fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    // One colon (the usual `name:port`) needs no address parse; an unbracketed IPv6 address
    // has several. Two `memchr` scans instead of counting every byte and splitting again
    // (this runs on every request).
    let bytes = host.as_bytes();
    match memchr::memchr(b':', bytes) {
        None => host,
        Some(first) if memchr::memchr(b':', &bytes[first + 1..]).is_none() => &host[..first],
        Some(_) if host.parse::<Ipv6Addr>().is_ok() => host,
        Some(first) => &host[..first],
    }
}

/// A host without the brackets of an IPv6 literal, as a resolver or a TLS name wants it:
/// `[::1]` → `::1`; anything else as is.
pub fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// `host:port` split at its last colon, the host unbracketed: `[::1]:26379` → (`::1`,
/// `26379`), `redis:26379` → (`redis`, `26379`); `None` without a colon. The port is not
/// checked.
pub fn split_host_port(authority: &str) -> Option<(&str, &str)> {
    let (host, port) = authority.rsplit_once(':')?;
    Some((unbracket(host), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_stripped_from_names_and_bracketed_literals_only() {
        assert_eq!(strip_port("api.example.com:8080"), "api.example.com");
        assert_eq!(strip_port("api.example.com:abc"), "api.example.com");
        assert_eq!(strip_port("api.example.com"), "api.example.com");
        assert_eq!(strip_port("[::1]:8080"), "[::1]");
        assert_eq!(strip_port("[::1"), "[::1");
        assert_eq!(strip_port("2001:db8::1"), "2001:db8::1");
        assert_eq!(strip_port("a:b:c"), "a");
    }

    #[test]
    fn brackets_go_only_in_pairs() {
        assert_eq!(unbracket("[::1]"), "::1");
        assert_eq!(unbracket("[::1"), "[::1");
        assert_eq!(unbracket("example.com"), "example.com");
    }

    #[test]
    fn host_and_port_split_at_the_last_colon() {
        assert_eq!(split_host_port("[::1]:26379"), Some(("::1", "26379")));
        assert_eq!(split_host_port("redis:26379"), Some(("redis", "26379")));
        assert_eq!(split_host_port("redis:"), Some(("redis", "")));
        assert_eq!(split_host_port("redis"), None);
    }
}
