//! Client addresses as keys and networks: the canonical form of an address (IPv4-mapped IPv6
//! as IPv4), its bucket identity (an IPv6 client reduced to its `/prefix`), and [`IpNet`].

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) becomes the IPv4 address; other addresses are unchanged.
#[inline]
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// A client address as one client: IPv4 as is (a mapped IPv6 address as its IPv4), IPv6 cut
/// to its `/v6_prefix` network (a client holds a whole /64 and can rotate through it).
pub fn client_net(ip: IpAddr, v6_prefix: u8) -> IpAddr {
    match canonical_ip(ip) {
        IpAddr::V6(v6) => IpAddr::V6(mask_v6(v6, v6_prefix)),
        v4 => v4,
    }
}

/// The bucket identity of a client address: IPv4 as is; IPv6 reduced to its `/prefix` network,
/// written `2001:db8:1:2::/64` (so it reads like Boulder's `/48` IDs).
pub fn ip_key(ip: IpAddr, v6_prefix: u8) -> String {
    let mut out = String::with_capacity(44);
    push_ip_key(&mut out, ip, v6_prefix);
    out
}

/// Appends [`ip_key`] to `out`. IPv4 (the hot case) is written digit by digit: `fmt`
/// machinery costs more than the rest of a bucket lookup.
#[inline]
pub fn push_ip_key(out: &mut String, ip: IpAddr, v6_prefix: u8) {
    match canonical_ip(ip) {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + (octet / 10) % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        IpAddr::V6(v6) => {
            let prefix = v6_prefix.min(128);
            let _ = write!(out, "{}/{}", mask_v6(v6, prefix), prefix);
        }
    }
}

/// The network address of `v6` under a `/prefix` mask.
pub fn mask_v6(v6: Ipv6Addr, prefix: u8) -> Ipv6Addr {
    let bits = u128::from(v6);
    let mask = if prefix == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(prefix.min(128)))
    };
    Ipv6Addr::from(bits & mask)
}

/// An IP network (`10.0.0.0/8`, `2001:db8::/32`) or a single address, for `match` values and
/// `--trusted-proxy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Parses `addr` or `addr/prefix`; IPv4-mapped IPv6 is treated as IPv4.
    pub fn parse(text: &str) -> Option<IpNet> {
        let (addr_text, prefix_text) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr = canonical_ip(addr_text.trim().parse::<IpAddr>().ok()?);
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix_text {
            Some(p) => p.trim().parse::<u8>().ok().filter(|p| *p <= max)?,
            None => max,
        };
        Some(IpNet { addr, prefix })
    }

    /// The network's address as written (not masked).
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length (32 or 128 for a single address).
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether the address as written has bits set past its prefix (`198.51.100.0/2`): a
    /// network written that way is usually a typo or a cut line, not the network its mask
    /// makes of it (`192.0.0.0/2`, a quarter of IPv4).
    pub fn host_bits_set(&self) -> bool {
        match self.addr {
            IpAddr::V4(v4) => {
                let host = u32::MAX.checked_shr(u32::from(self.prefix)).unwrap_or(0);
                u32::from(v4) & host != 0
            }
            IpAddr::V6(v6) => {
                let host = u128::MAX.checked_shr(u32::from(self.prefix)).unwrap_or(0);
                u128::from(v6) & host != 0
            }
        }
    }

    /// The same address under another prefix length (clamped to the family's maximum).
    pub fn with_prefix(&self, prefix: u8) -> IpNet {
        let max = if self.addr.is_ipv4() { 32 } else { 128 };
        IpNet {
            addr: self.addr,
            prefix: prefix.min(max),
        }
    }

    /// Whether `ip` (IPv4-mapped IPv6 treated as IPv4) is inside this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical_ip(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(self.prefix))
                };
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                mask_v6(net, self.prefix) == mask_v6(ip, self.prefix)
            }
            _ => false,
        }
    }

    /// Canonical text: the masked network and its prefix (`/32` and `/128` print bare).
    pub fn canonical(&self) -> String {
        match self.addr {
            IpAddr::V4(v4) if self.prefix == 32 => v4.to_string(),
            IpAddr::V6(v6) if self.prefix == 128 => v6.to_string(),
            IpAddr::V4(v4) => {
                let masked = if self.prefix == 0 {
                    0
                } else {
                    u32::from(v4) & (u32::MAX << (32 - u32::from(self.prefix)))
                };
                format!("{}/{}", Ipv4Addr::from(masked), self.prefix)
            }
            IpAddr::V6(v6) => format!("{}/{}", mask_v6(v6, self.prefix), self.prefix),
        }
    }
}
