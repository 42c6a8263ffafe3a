//! The client address of a request: the TCP peer, or — only when the peer is a trusted proxy —
//! the address its `X-Forwarded-For` chain (or, failing that, `X-Real-IP`) vouches for.
//!
//! Pure: no I/O, no Pingora. The reverse proxy and the decision service both call
//! [`resolve`]; they differ only in which peers they trust (the decision service also trusts
//! its caller, a gateway by role).
//!
//! The chain is read as raw bytes, hop by hop from the right. A hop that is not an address
//! (garbage, or bytes that are not ASCII) ends the walk at the last address parsed: everything
//! to its left was written by someone we cannot vouch for, and everything to its right was
//! written by trusted proxies. So a client cannot throw the chain away with one bad byte (it
//! would land in its proxy's shared bucket), and hops it adds on the left never change the
//! answer.

use crate::request::descriptor::{canonical_ip, IpNet};
use std::net::{IpAddr, SocketAddr};

/// The headers that can name the client, as raw bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardingHeaders<'a, L> {
    /// Every `X-Forwarded-For` line, in the order received (a proxy may add its own line rather
    /// than append to the client's).
    pub forwarded_for: L,
    /// `X-Real-IP`, consulted only when no `X-Forwarded-For` line is present.
    pub real_ip: Option<&'a [u8]>,
}

/// The client address for a request arriving from `peer`.
///
/// - `peer` not trusted: the peer itself (whatever the headers say).
/// - `peer` trusted and `X-Forwarded-For` present: the rightmost hop that is not trusted; the
///   leftmost hop when all are; the last address parsed when a hop is unparseable; the peer
///   when the rightmost hop already is.
/// - `peer` trusted, no `X-Forwarded-For`, `X-Real-IP` an address: that address.
/// - otherwise the peer.
///
/// `None` only without a peer (a Unix socket).
pub fn resolve<'a, L, I>(
    peer: Option<IpAddr>,
    headers: ForwardingHeaders<'a, L>,
    trusted: impl Fn(IpAddr) -> bool,
) -> Option<IpAddr>
where
    L: IntoIterator<Item = &'a [u8], IntoIter = I>,
    I: DoubleEndedIterator<Item = &'a [u8]>,
{
    let peer = canonical_ip(peer?);
    if !trusted(peer) {
        return Some(peer);
    }
    let mut lines = headers.forwarded_for.into_iter().rev().peekable();
    if lines.peek().is_none() {
        return Some(headers.real_ip.and_then(parse_hop).unwrap_or(peer));
    }
    let mut candidate = peer;
    for line in lines {
        for hop in line.rsplit(|&b| b == b',') {
            let Some(ip) = parse_hop(hop) else {
                return Some(candidate);
            };
            candidate = ip;
            if !trusted(ip) {
                return Some(candidate);
            }
        }
    }
    Some(candidate)
}

/// Whether `ip` is inside one of `nets`.
pub fn in_any(nets: &[IpNet], ip: IpAddr) -> bool {
    nets.iter().any(|net| net.contains(ip))
}

/// One hop: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `[2001:db8::1]:80`, with optional
/// surrounding spaces or tabs. Anything else (including non-ASCII bytes) is `None`.
pub fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let hop = hop.trim_ascii();
    // Longest valid form: `[` + 45-char IPv6 + `]:65535`.
    if hop.is_empty() || hop.len() > 53 {
        return None;
    }
    let text = std::str::from_utf8(hop).ok()?;
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(canonical_ip(ip));
    }
    text.parse::<SocketAddr>()
        .ok()
        .map(|sa| canonical_ip(sa.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn trusted_10(ip: IpAddr) -> bool {
        IpNet::parse("10.0.0.0/8").unwrap().contains(ip)
    }

    fn run(peer: &str, xff: &[&[u8]], real_ip: Option<&[u8]>) -> IpAddr {
        resolve(
            Some(ip(peer)),
            ForwardingHeaders {
                forwarded_for: xff.iter().copied(),
                real_ip,
            },
            trusted_10,
        )
        .unwrap()
    }

    #[test]
    fn forwarded_for_is_used_only_from_trusted_peers() {
        assert_eq!(run("203.0.113.9", &[b"1.1.1.1"], None), ip("203.0.113.9"));
        assert_eq!(
            run("10.0.0.1", &[b"6.6.6.6, 198.51.100.4, 10.0.0.7"], None),
            ip("198.51.100.4")
        );
        assert_eq!(run("10.0.0.1", &[], None), ip("10.0.0.1"));
        assert_eq!(
            run("10.0.0.1", &[b"10.0.0.3, 10.0.0.2"], None),
            ip("10.0.0.3")
        );
        assert_eq!(
            run("10.0.0.1", &[b"garbage, 10.0.0.2"], None),
            ip("10.0.0.2")
        );
        assert_eq!(
            run("10.0.0.1", &[b"[2001:db8::5]:443"], None),
            ip("2001:db8::5")
        );
        assert_eq!(
            run("::ffff:10.0.0.1", &[b"192.0.2.1"], None),
            ip("192.0.2.1")
        );
        // Several lines are one chain, the last line rightmost.
        assert_eq!(
            run("10.0.0.1", &[b"6.6.6.6", b"198.51.100.4, 10.0.0.9"], None),
            ip("198.51.100.4")
        );
    }

    /// Issue 13, attack 3: one bad byte on the left used to throw the whole header away
    /// (the client then shared its proxy's bucket, or picked its own X-Real-IP).
    #[test]
    fn a_bad_hop_ends_the_walk_at_the_last_parsed_address() {
        let chain: &[u8] = b"1.2.3.4\x80, 198.51.100.4";
        assert_eq!(run("10.0.0.1", &[chain], None), ip("198.51.100.4"));
        let chain: &[u8] = b"\xff\xfe, 10.0.0.7, 198.51.100.4";
        assert_eq!(run("10.0.0.1", &[chain], None), ip("198.51.100.4"));
        // Bad hop right after trusted hops: the last trusted hop parsed.
        let chain: &[u8] = b"198.51.100.4, x\x00y, 10.0.0.7";
        assert_eq!(run("10.0.0.1", &[chain], None), ip("10.0.0.7"));
        // The rightmost hop already bad: the peer.
        assert_eq!(run("10.0.0.1", &[b"1.2.3.4, nope"], None), ip("10.0.0.1"));
        // An X-Forwarded-For line, even a broken one, means X-Real-IP is never consulted.
        let real: &[u8] = b"7.7.7.7";
        assert_eq!(run("10.0.0.1", &[b"nope\x80"], Some(real)), ip("10.0.0.1"));
    }

    #[test]
    fn real_ip_only_from_trusted_peers_without_forwarded_for() {
        let real: &[u8] = b"198.51.100.4";
        assert_eq!(run("10.0.0.1", &[], Some(real)), ip("198.51.100.4"));
        assert_eq!(run("203.0.113.9", &[], Some(real)), ip("203.0.113.9"));
        let bad: &[u8] = b"not-an-ip";
        assert_eq!(run("10.0.0.1", &[], Some(bad)), ip("10.0.0.1"));
    }

    fn arb_ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            (0u8..4, any::<u8>()).prop_map(|(a, b)| IpAddr::from([10, a, b, 1])),
            any::<[u8; 16]>().prop_map(|o| canonical_ip(IpAddr::from(o))),
        ]
    }

    fn arb_hop() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            4 => arb_ip().prop_map(|ip| ip.to_string().into_bytes()),
            1 => proptest::collection::vec(any::<u8>(), 0..12),
        ]
    }

    proptest! {
        /// Hops added to the left of the chain never change the answer, and the answer is
        /// the peer or an address from the chain.
        #[test]
        fn left_hops_never_change_the_answer(
            peer in arb_ip(),
            chain in proptest::collection::vec(arb_hop(), 0..6),
            prefix in proptest::collection::vec(arb_hop(), 1..4),
        ) {
            let join = |hops: &[Vec<u8>]| hops.join(&b", "[..]);
            let line = join(&chain);
            let lines: Vec<&[u8]> = if chain.is_empty() { vec![] } else { vec![&line] };
            let answer = resolve(Some(peer), ForwardingHeaders { forwarded_for: lines.iter().copied(), real_ip: None }, trusted_10).unwrap();
            let parsed: Vec<IpAddr> = chain.iter().filter_map(|h| parse_hop(h)).collect();
            prop_assert!(answer == canonical_ip(peer) || parsed.contains(&answer));

            // Left hops as part of the same line, and as an earlier line of their own.
            let mut longer = prefix.clone();
            longer.extend(chain.iter().cloned());
            let longer_line = join(&longer);
            let with_prefix = resolve(Some(peer), ForwardingHeaders { forwarded_for: [&longer_line[..]].into_iter(), real_ip: None }, trusted_10).unwrap();
            let prefix_line = join(&prefix);
            let mut two: Vec<&[u8]> = vec![&prefix_line];
            two.extend(lines.iter().copied());
            let as_lines = resolve(Some(peer), ForwardingHeaders { forwarded_for: two.iter().copied(), real_ip: None }, trusted_10).unwrap();
            // Unless the whole original chain was trusted (then the walk continues left).
            let all_trusted = !chain.is_empty() && chain.iter().all(|h| parse_hop(h).is_some_and(trusted_10));
            if !all_trusted && trusted_10(canonical_ip(peer)) && !chain.is_empty() {
                prop_assert_eq!(with_prefix, answer);
                prop_assert_eq!(as_lines, answer);
            }
            if !trusted_10(canonical_ip(peer)) {
                prop_assert_eq!(with_prefix, canonical_ip(peer));
                prop_assert_eq!(answer, canonical_ip(peer));
            }
        }

        #[test]
        fn parse_hop_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_hop(&bytes);
        }
    }
}
