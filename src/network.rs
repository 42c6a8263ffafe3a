//! What the client's network is: its country, its autonomous system (ASN) and the ASN's type
//! (`isp`, `hosting`, `business`...), and whether it is a Tor exit — the `ip:country`,
//! `ip:asn`, `ip:type` and `ip:tor` descriptors, as Fairvisor Edge names them.
//!
//! The facts come from the trusted headers a proxy in front of tollgate sets (`X-Country-Code`,
//! `X-ASN`, `X-ASN-Type`, `X-Tor-Exit`), read only when the request came through a
//! `--trusted-proxy` (or is described by a gateway calling the decision service), from the
//! `--asn-type-map` file (nginx `map` format, `72 business;`; `unknown` for an ASN it does not
//! list), and from the `--tor-exits` list (one address or CIDR per line, or nginx `geo` lines
//! `1.2.3.4 1;`). Pure: the files are read by the caller and parsed here.

use crate::descriptor::{HeaderLookup, IpNet};
use std::net::IpAddr;

/// The `--geoip-db`, `--asn-type-map` and `--tor-exits` contents in force.
#[derive(Debug, Default, Clone)]
pub struct NetworkData {
    /// MaxMind-format databases: a country (or city) one and an ASN one.
    geo: Vec<std::sync::Arc<GeoDb>>,
    /// ASN → its type; `None` without `--asn-type-map`.
    asn_types: Option<ahash::AHashMap<u32, Box<str>>>,
    /// The map's `default` (Fairvisor's files say `default unknown;`).
    default_type: Box<str>,
    /// Tor exits: single addresses, and networks; `None` without `--tor-exits`.
    tor_exits: Option<TorExits>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct TorExits {
    addresses: ahash::AHashSet<IpAddr>,
    /// Networks by family and prefix length, as masked addresses: one hash probe per length
    /// listed, whatever the number of networks.
    networks: Vec<(bool, u8, ahash::AHashSet<u128>)>,
}

/// `ip` masked to `prefix` bits, with its family (`true`: IPv4).
fn masked(ip: IpAddr, prefix: u8) -> (bool, u128) {
    match crate::descriptor::canonical_ip(ip) {
        IpAddr::V4(v4) => {
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix.min(32)))
            };
            (true, u128::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix.min(128)))
            };
            (false, u128::from(v6) & mask)
        }
    }
}

impl TorExits {
    fn add_network(&mut self, net: IpNet) {
        let (v4, bits) = masked(net.addr(), net.prefix());
        match self
            .networks
            .iter_mut()
            .find(|(f, p, _)| *f == v4 && *p == net.prefix())
        {
            Some((_, _, set)) => {
                set.insert(bits);
            }
            None => {
                let mut set = ahash::AHashSet::new();
                set.insert(bits);
                self.networks.push((v4, net.prefix(), set));
            }
        }
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let ip = crate::descriptor::canonical_ip(ip);
        self.addresses.contains(&ip)
            || self.networks.iter().any(|(v4, prefix, set)| {
                *v4 == ip.is_ipv4() && set.contains(&masked(ip, *prefix).1)
            })
    }

    fn len(&self) -> usize {
        self.addresses.len() + self.networks.iter().map(|(_, _, s)| s.len()).sum::<usize>()
    }
}

/// A `--geoip-db` file: a MaxMind-format database (GeoLite2/GeoIP2 Country or City, GeoLite2
/// ASN, DB-IP lite), read whole into memory and verified whole at load, so a corrupt file is
/// refused then rather than met by a request.
pub struct GeoDb {
    reader: maxminddb::Reader<Vec<u8>>,
    /// An ASN database (its `database_type` names ASN); otherwise a country one.
    asn: bool,
}

impl std::fmt::Debug for GeoDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GeoDb({})", self.reader.metadata().database_type)
    }
}

impl GeoDb {
    /// # Errors
    /// The bytes are not a sound MaxMind-format database.
    pub fn parse(bytes: Vec<u8>) -> Result<GeoDb, String> {
        let reader = maxminddb::Reader::from_source(bytes).map_err(|e| e.to_string())?;
        reader.verify().map_err(|e| e.to_string())?;
        let asn = reader
            .metadata()
            .database_type
            .to_ascii_lowercase()
            .contains("asn");
        Ok(GeoDb { reader, asn })
    }

    fn country(&self, ip: IpAddr) -> Option<String> {
        let record: maxminddb::geoip2::Country<'_> =
            self.reader.lookup(ip).ok()?.decode().ok()??;
        record
            .country
            .iso_code
            .or(record.registered_country.iso_code)
            .map(str::to_ascii_uppercase)
    }

    fn asn(&self, ip: IpAddr) -> Option<String> {
        let record: maxminddb::geoip2::Asn<'_> = self.reader.lookup(ip).ok()?.decode().ok()??;
        record.autonomous_system_number.map(|n| n.to_string())
    }
}

/// A line of a network file that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct LineError {
    pub line: usize,
    pub message: String,
}

/// One request's network facts.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct NetworkFacts {
    pub country: Option<String>,
    pub asn: Option<String>,
    pub asn_type: Option<String>,
    /// `"true"` or `"false"`.
    pub tor: Option<&'static str>,
}

/// Trusted headers, as Fairvisor reads them.
pub const COUNTRY_HEADER: &str = "x-country-code";
pub const ASN_HEADER: &str = "x-asn";
pub const ASN_TYPE_HEADER: &str = "x-asn-type";
pub const TOR_HEADER: &str = "x-tor-exit";

/// ASN → type, and the map's default.
type AsnTypes = (ahash::AHashMap<u32, Box<str>>, Box<str>);

/// Parses an nginx `map` body: `<asn> <type>;` lines, `default <type>;`, `#` comments, and
/// (ignored) a `map ... {` opening and `}` closing line.
///
/// # Errors
/// The first line that is none of these, with its number.
pub fn parse_asn_type_map(text: &str) -> Result<AsnTypes, LineError> {
    let mut map = ahash::AHashMap::new();
    let mut default: Box<str> = "unknown".into();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line == "}" || (line.starts_with("map ") && line.ends_with('{')) {
            continue;
        }
        let bad = |message: &str| LineError {
            line: i + 1,
            message: message.to_string(),
        };
        let body = line
            .strip_suffix(';')
            .ok_or_else(|| bad("expected `<asn> <type>;`"))?;
        let mut parts = body.split_whitespace();
        let (Some(key), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("expected `<asn> <type>;`"));
        };
        if key == "default" {
            default = value.into();
            continue;
        }
        let asn = asn_number(key)
            .ok_or_else(|| bad("the ASN must be a number (`AS` before it is allowed)"))?;
        map.insert(asn, value.into());
    }
    Ok((map, default))
}

/// Parses a Tor exit list: one address or CIDR per line, or nginx `geo` lines
/// (`1.2.3.4 1;`, a value of `0` leaves the address out; `default` ignored); `#` comments.
///
/// # Errors
/// The first line that is none of these, with its number.
fn parse_tor_exits(text: &str) -> Result<TorExits, LineError> {
    let mut exits = TorExits::default();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let line = line.trim_end_matches(';').trim();
        let mut parts = line.split_whitespace();
        let (Some(target), value) = (parts.next(), parts.next()) else {
            continue;
        };
        if target == "default" || value == Some("0") {
            continue;
        }
        let bad = || LineError {
            line: i + 1,
            message: format!("'{target}' is not an IP address or network"),
        };
        if target.contains('/') {
            exits.add_network(IpNet::parse(target).ok_or_else(bad)?);
        } else {
            let ip: IpAddr = target.parse().map_err(|_| bad())?;
            exits.addresses.insert(crate::descriptor::canonical_ip(ip));
        }
    }
    Ok(exits)
}

/// `72`, `AS72` or `as72`.
fn asn_number(text: &str) -> Option<u32> {
    let digits = text
        .strip_prefix("AS")
        .or_else(|| text.strip_prefix("as"))
        .unwrap_or(text);
    digits.parse().ok()
}

fn boolish(text: &str) -> Option<&'static str> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some("true"),
        "0" | "false" | "no" | "off" => Some("false"),
        _ => None,
    }
}

impl NetworkData {
    /// From the files' texts (`None`: the flag is not given).
    ///
    /// # Errors
    /// A line of either file that cannot be read, naming the file's flag.
    pub fn parse(asn_type_map: Option<&str>, tor_exits: Option<&str>) -> Result<Self, String> {
        Self::with_geo(asn_type_map, tor_exits, Vec::new())
    }

    /// [`NetworkData::parse`] with `--geoip-db` databases.
    ///
    /// # Errors
    /// A line of either text file that cannot be read, naming the file's flag.
    pub fn with_geo(
        asn_type_map: Option<&str>,
        tor_exits: Option<&str>,
        geo: Vec<GeoDb>,
    ) -> Result<Self, String> {
        let (asn_types, default_type) = match asn_type_map {
            Some(text) => {
                let (map, default) =
                    parse_asn_type_map(text).map_err(|e| format!("--asn-type-map: {e}"))?;
                (Some(map), default)
            }
            None => (None, "unknown".into()),
        };
        let tor_exits = tor_exits
            .map(parse_tor_exits)
            .transpose()
            .map_err(|e| format!("--tor-exits: {e}"))?;
        Ok(NetworkData {
            geo: geo.into_iter().map(std::sync::Arc::new).collect(),
            asn_types,
            default_type,
            tor_exits,
        })
    }

    /// ASN types listed, and Tor exits listed (for the log line at load).
    pub fn sizes(&self) -> (usize, usize) {
        (
            self.asn_types.as_ref().map_or(0, |m| m.len()),
            self.tor_exits.as_ref().map_or(0, TorExits::len),
        )
    }

    fn is_tor_exit(&self, ip: IpAddr) -> Option<bool> {
        Some(self.tor_exits.as_ref()?.contains(ip))
    }

    /// The request's network facts: the trusted headers when `trusted`, the ASN type from the
    /// map (an ASN it does not list is its `default`, `unknown`), Tor from the exit list.
    pub fn resolve(
        &self,
        client_ip: Option<IpAddr>,
        headers: &dyn HeaderLookup,
        trusted: bool,
    ) -> NetworkFacts {
        let header = |name: &str| {
            trusted
                .then(|| headers.header_text(name))
                .flatten()
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        // A database answers first (as nginx's GeoIP2 variables do for Fairvisor); the
        // trusted headers for what it does not know.
        let from_db = |asn: bool| {
            let ip = client_ip?;
            self.geo.iter().filter(|db| db.asn == asn).find_map(|db| {
                if asn {
                    db.asn(ip)
                } else {
                    db.country(ip)
                }
            })
        };
        let country =
            from_db(false).or_else(|| header(COUNTRY_HEADER).map(|c| c.to_ascii_uppercase()));
        let asn = from_db(true).or_else(|| header(ASN_HEADER));
        let asn_type = match (&self.asn_types, asn.as_deref().and_then(asn_number)) {
            (Some(map), Some(number)) => Some(
                map.get(&number)
                    .map_or_else(|| self.default_type.to_string(), |t| t.to_string()),
            ),
            _ => header(ASN_TYPE_HEADER),
        };
        let tor = client_ip
            .and_then(|ip| self.is_tor_exit(ip))
            .map(|exit| if exit { "true" } else { "false" })
            .or_else(|| header(TOR_HEADER).as_deref().and_then(boolish));
        NetworkFacts {
            country,
            asn,
            asn_type,
            tor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Headers(Vec<(&'static str, &'static str)>);

    impl HeaderLookup for Headers {
        fn header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
            self.0
                .iter()
                .find(|(n, _)| *n == lower_name)
                .map(|(_, v)| v.as_bytes())
        }

        fn is_repeated(&self, _lower_name: &str) -> bool {
            false
        }
    }

    const MAP: &str = "# generated\nmap $asn $fairvisor_asn_type {\ndefault unknown;\n72 business;\nAS16509 hosting;\n}\n";

    #[test]
    fn asn_type_maps_read_nginx_format_and_name_bad_lines() {
        let (map, default) = parse_asn_type_map(MAP).unwrap();
        assert_eq!(map.get(&72).map(|t| &**t), Some("business"));
        assert_eq!(map.get(&16509).map(|t| &**t), Some("hosting"));
        assert_eq!(&*default, "unknown");
        let err = parse_asn_type_map("72 business;\nseventy two;\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(
            parse_asn_type_map("72 business\n").is_err(),
            "the ; is required"
        );
    }

    #[test]
    fn tor_lists_take_addresses_networks_and_geo_lines() {
        let exits = parse_tor_exits("# exits\n198.51.100.7\n203.0.113.0/24\n192.0.2.1 1;\n192.0.2.2 0;\ndefault 0;\n2001:db8::7\n").unwrap();
        let data = NetworkData {
            tor_exits: Some(exits),
            ..NetworkData::default()
        };
        let tor = |ip: &str| data.is_tor_exit(ip.parse().unwrap());
        assert_eq!(tor("198.51.100.7"), Some(true));
        assert_eq!(tor("::ffff:198.51.100.7"), Some(true));
        assert_eq!(tor("203.0.113.200"), Some(true));
        assert_eq!(tor("192.0.2.1"), Some(true));
        assert_eq!(tor("192.0.2.2"), Some(false));
        assert_eq!(tor("2001:db8::7"), Some(true));
        assert_eq!(tor("10.0.0.1"), Some(false));
        assert_eq!(parse_tor_exits("ok\n").unwrap_err().line, 1);
    }

    #[test]
    fn trusted_headers_are_read_only_when_trusted() {
        let data = NetworkData::parse(Some(MAP), Some("198.51.100.7\n")).unwrap();
        let headers = Headers(vec![
            ("x-country-code", "de"),
            ("x-asn", "AS72"),
            ("x-asn-type", "isp"),
            ("x-tor-exit", "1"),
        ]);
        let ip = Some("10.0.0.1".parse().unwrap());
        let trusted = data.resolve(ip, &headers, true);
        assert_eq!(trusted.country.as_deref(), Some("DE"));
        assert_eq!(trusted.asn.as_deref(), Some("AS72"));
        // The map wins over the header; the list over the header.
        assert_eq!(trusted.asn_type.as_deref(), Some("business"));
        assert_eq!(trusted.tor, Some("false"));
        let untrusted = data.resolve(ip, &headers, false);
        assert_eq!(untrusted.country, None);
        assert_eq!(untrusted.asn, None);
        assert_eq!(untrusted.asn_type, None);
        assert_eq!(untrusted.tor, Some("false"));
        // Without files: the headers alone.
        let bare = NetworkData::default().resolve(ip, &headers, true);
        assert_eq!(bare.asn_type.as_deref(), Some("isp"));
        assert_eq!(bare.tor, Some("true"));
        // An ASN the map does not list is its default.
        let other = Headers(vec![("x-asn", "64500")]);
        assert_eq!(
            data.resolve(ip, &other, true).asn_type.as_deref(),
            Some("unknown")
        );
    }
}
