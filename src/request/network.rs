//! What the client's network is: its country, its autonomous system (ASN) and the ASN's type
//! (`isp`, `hosting`, `business`...), and whether it is a Tor exit — the `ip:country`,
//! `ip:asn`, `ip:type` and `ip:tor` descriptors, as Fairvisor Edge names them.
//!
//! The facts come from the trusted headers a proxy in front of tollgate sets (`X-Country-Code`,
//! `X-ASN`, `X-ASN-Type`, `X-Tor-Exit`), read only when the request (or the decision-service
//! call describing it) came from a `--trusted-proxy` peer, and then as the nearest hop set them
//! (the last value); from the `--asn-type-map` file (nginx `map` format, `72 business;`;
//! `unknown` for an ASN it does not list), and from the `--tor-exits` list (one address or CIDR
//! per line, or nginx `geo` lines `1.2.3.4 1;`).
//!
//! Also here: the reload guard ([`NetworkData::guard_shrink`]), which keeps a file's data in
//! force when a reload brings back an empty or much smaller file. Pure: the files are read by
//! the caller (`service::reload`) and parsed and judged here.

use crate::request::descriptor::header_lookup::HeaderLookup;
use crate::request::descriptor::ip::{canonical_ip, IpNet};
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
    match canonical_ip(ip) {
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
        let ip = canonical_ip(ip);
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

/// A `--geoip-db` file that is not a sound MaxMind-format database (the reader's own words).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct GeoDbError(#[from] maxminddb::MaxMindDbError);

impl std::fmt::Debug for GeoDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GeoDb({})", self.reader.metadata().database_type)
    }
}

impl GeoDb {
    /// # Errors
    /// The bytes are not a sound MaxMind-format database.
    pub fn parse(bytes: Vec<u8>) -> Result<GeoDb, GeoDbError> {
        let reader = maxminddb::Reader::from_source(bytes)?;
        reader.verify()?;
        let asn = reader
            .metadata()
            .database_type
            .to_ascii_lowercase()
            .contains("asn");
        Ok(GeoDb { reader, asn })
    }

    /// The size the reload guard compares: the nodes of its search tree (an empty or cut-down
    /// database has far fewer).
    fn entries(&self) -> usize {
        usize::try_from(self.reader.metadata().node_count).unwrap_or(usize::MAX)
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

/// A network file that could not be read: which one, and its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {error}", file.flag())]
pub struct NetworkFileError {
    pub file: NetworkFile,
    pub error: LineError,
}

/// One of the network files, as the reload guard names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkFile {
    /// The `--geoip-db` database at this place in the list.
    GeoIpDb(usize),
    AsnTypeMap,
    TorExits,
}

impl NetworkFile {
    /// Its flag, for log lines.
    pub fn flag(self) -> &'static str {
        match self {
            NetworkFile::GeoIpDb(_) => "--geoip-db",
            NetworkFile::AsnTypeMap => "--asn-type-map",
            NetworkFile::TorExits => "--tor-exits",
        }
    }

    /// The `file` label of `tollgate_network_reloads_rejected_total` (a bounded set: no paths).
    pub fn metric_label(self) -> &'static str {
        match self {
            NetworkFile::GeoIpDb(_) => "geoip_db",
            NetworkFile::AsnTypeMap => "asn_type_map",
            NetworkFile::TorExits => "tor_exits",
        }
    }

    /// Every label value, so each series exists from the start.
    pub const METRIC_LABELS: [&'static str; 3] = ["geoip_db", "asn_type_map", "tor_exits"];
}

/// A file whose reload [`NetworkData::guard_shrink`] refused: its entries in force and in the
/// file read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShrinkRefused {
    pub file: NetworkFile,
    pub in_force: usize,
    pub loaded: usize,
}

/// Whether a reload that brings a file from `in_force` entries to `loaded` is refused: it
/// comes back empty, or with fewer than half the entries in force. A file that had none may
/// come back with any number; one that grows or loses less than half is taken as it is.
pub fn shrink_refused(in_force: usize, loaded: usize) -> bool {
    in_force > 0 && loaded.saturating_mul(2) < in_force
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
            let net = IpNet::parse(target).ok_or_else(bad)?;
            if net.host_bits_set() {
                return Err(LineError {
                    line: i + 1,
                    message: format!(
                        "'{target}' has host bits set past its /{} prefix (as written it would \
                         list {}): write the network's own address, or the address alone",
                        net.prefix(),
                        net.canonical()
                    ),
                });
            }
            exits.add_network(net);
        } else {
            let ip: IpAddr = target.parse().map_err(|_| bad())?;
            exits.addresses.insert(canonical_ip(ip));
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

/// A network header's value as the nearest hop set it: its last line, and within that line its
/// last comma-separated item. A proxy that appends its value to a client's copy, or that joins
/// repeated lines with `,` (Envoy's ext_authz header map), leaves its own value last; none of
/// these headers' values contains a comma. Empty: no value.
fn nearest_value(headers: &dyn HeaderLookup, name: &str) -> Option<String> {
    let line = String::from_utf8_lossy(headers.last_header_bytes(name)?);
    let value = line.rsplit(',').next().unwrap_or("").trim();
    (!value.is_empty()).then(|| value.to_string())
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
    /// A line of either file that cannot be read, with the file it is in.
    pub fn parse(
        asn_type_map: Option<&str>,
        tor_exits: Option<&str>,
    ) -> Result<Self, NetworkFileError> {
        Self::with_geo(asn_type_map, tor_exits, Vec::new())
    }

    /// [`NetworkData::parse`] with `--geoip-db` databases.
    ///
    /// # Errors
    /// A line of either text file that cannot be read, with the file it is in.
    pub fn with_geo(
        asn_type_map: Option<&str>,
        tor_exits: Option<&str>,
        geo: Vec<GeoDb>,
    ) -> Result<Self, NetworkFileError> {
        let (asn_types, default_type) = match asn_type_map {
            Some(text) => {
                let (map, default) =
                    parse_asn_type_map(text).map_err(|error| NetworkFileError {
                        file: NetworkFile::AsnTypeMap,
                        error,
                    })?;
                (Some(map), default)
            }
            None => (None, "unknown".into()),
        };
        let tor_exits = tor_exits
            .map(parse_tor_exits)
            .transpose()
            .map_err(|error| NetworkFileError {
                file: NetworkFile::TorExits,
                error,
            })?;
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

    /// The entries of each file given, as the reload guard counts them: ASNs listed, Tor exits
    /// (addresses and networks) listed, and each database's search-tree nodes (by its place in
    /// `--geoip-db`).
    pub fn entries(&self) -> Vec<(NetworkFile, usize)> {
        let mut counts: Vec<(NetworkFile, usize)> = self
            .geo
            .iter()
            .enumerate()
            .map(|(i, db)| (NetworkFile::GeoIpDb(i), db.entries()))
            .collect();
        if let Some(map) = &self.asn_types {
            counts.push((NetworkFile::AsnTypeMap, map.len()));
        }
        if let Some(exits) = &self.tor_exits {
            counts.push((NetworkFile::TorExits, exits.len()));
        }
        counts
    }

    /// This data (just read at a reload), with each file that came back empty or with fewer
    /// than half the entries of `in_force` ([`shrink_refused`]) replaced by the data in force,
    /// unless `allow_shrink` (`--network-allow-shrink`). Returns the data to install and the
    /// files refused, with their counts: a half-written Tor list or ASN map must not switch a
    /// kill switch off.
    pub fn guard_shrink(
        mut self,
        in_force: &NetworkData,
        allow_shrink: bool,
    ) -> (NetworkData, Vec<ShrinkRefused>) {
        let mut refused = Vec::new();
        if allow_shrink {
            return (self, refused);
        }
        let mut judge = |file: NetworkFile, in_force: usize, loaded: usize| {
            let keep = shrink_refused(in_force, loaded);
            if keep {
                refused.push(ShrinkRefused {
                    file,
                    in_force,
                    loaded,
                });
            }
            keep
        };
        for (i, db) in self.geo.iter_mut().enumerate() {
            if let Some(old) = in_force.geo.get(i) {
                if judge(NetworkFile::GeoIpDb(i), old.entries(), db.entries()) {
                    *db = std::sync::Arc::clone(old);
                }
            }
        }
        if let (Some(old), Some(new)) = (&in_force.asn_types, &self.asn_types) {
            if judge(NetworkFile::AsnTypeMap, old.len(), new.len()) {
                self.asn_types = Some(old.clone());
                self.default_type = in_force.default_type.clone();
            }
        }
        if let (Some(old), Some(new)) = (&in_force.tor_exits, &self.tor_exits) {
            if judge(NetworkFile::TorExits, old.len(), new.len()) {
                self.tor_exits = Some(old.clone());
            }
        }
        (self, refused)
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
        let header = |name: &str| trusted.then(|| nearest_value(headers, name)).flatten();
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

        fn last_header_bytes(&self, lower_name: &str) -> Option<&[u8]> {
            self.0
                .iter()
                .rfind(|(n, _)| *n == lower_name)
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
        // A network with host bits set is refused, naming its line, whatever the family; a
        // network written with its own address, and a /0, are taken.
        for (text, line) in [
            ("198.51.100.7\n198.51.100.0/2\n", 2),
            ("# cut\n\n10.0.0.1/8\n", 3),
            ("2001:db8::1/64\n", 1),
            ("203.0.113.0/24 1;\n203.0.113.128/24 1;\n", 2),
        ] {
            let err = parse_tor_exits(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}");
            assert!(err.message.contains("host bits set"), "{err}");
        }
        let err = NetworkData::parse(None, Some("192.0.2.0/24\n198.51.100.0/2\n")).unwrap_err();
        assert_eq!(err.file, NetworkFile::TorExits);
        assert_eq!(
            err.to_string(),
            "--tor-exits: line 2: '198.51.100.0/2' has host bits set past its /2 prefix (as \
             written it would list 192.0.0.0/2): write the network's own address, or the \
             address alone"
        );
        let taken = parse_tor_exits(
            "198.51.100.0/24\n192.0.0.0/2\n0.0.0.0/0\n2001:db8::/32\n10.0.0.1/32\n",
        );
        assert_eq!(taken.map(|t| t.len()), Ok(5));
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

    #[test]
    fn repeated_network_headers_take_the_nearest_hops_value() {
        let bare = NetworkData::default();
        let ip = Some("10.0.0.1".parse().unwrap());
        // The client's line first, the trusted proxy's appended after it.
        let lines = Headers(vec![
            ("x-tor-exit", "0"),
            ("x-country-code", "FR"),
            ("x-tor-exit", "1"),
            ("x-country-code", "de"),
        ]);
        let facts = bare.resolve(ip, &lines, true);
        assert_eq!(facts.tor, Some("true"));
        assert_eq!(facts.country.as_deref(), Some("DE"));
        // One line, joined with commas (a proxy appending, Envoy's header map): the last item.
        let joined = Headers(vec![
            ("x-tor-exit", "0, 1"),
            ("x-asn", "AS1,AS16509"),
            ("x-asn-type", "isp ,hosting"),
        ]);
        let facts = bare.resolve(ip, &joined, true);
        assert_eq!(facts.tor, Some("true"));
        assert_eq!(facts.asn.as_deref(), Some("AS16509"));
        assert_eq!(facts.asn_type.as_deref(), Some("hosting"));
        // A trailing comma leaves the nearest hop's value empty: no value, not the client's.
        let empty_last = Headers(vec![("x-country-code", "FR,")]);
        assert_eq!(bare.resolve(ip, &empty_last, true).country, None);
        // Untrusted: none of it.
        assert_eq!(bare.resolve(ip, &lines, false), NetworkFacts::default());
    }

    #[test]
    fn a_file_refused_at_reload_is_one_emptied_or_losing_more_than_half() {
        for (in_force, loaded, refused) in [
            (0, 0, false),
            (0, 5, false),
            (1, 0, true),
            (10, 0, true),
            (10, 4, true),
            (10, 5, false),
            (11, 5, true),
            (11, 6, false),
            (10, 10, false),
            (10, 1_000, false),
            (usize::MAX, usize::MAX, false),
        ] {
            assert_eq!(
                shrink_refused(in_force, loaded),
                refused,
                "{in_force} -> {loaded}"
            );
        }
    }

    #[test]
    fn the_reload_guard_keeps_the_data_in_force_file_by_file() {
        let in_force = NetworkData::parse(
            Some(MAP),
            Some(
                "198.51.100.7
203.0.113.0/24
",
            ),
        )
        .unwrap();
        let tor = Some("198.51.100.7".parse().unwrap());
        let no_headers = Headers(vec![]);
        let asn72 = Headers(vec![("x-asn", "72")]);
        // Both files emptied (a rewrite caught half-way): both kept, both reported.
        let emptied = NetworkData::parse(Some(""), Some("")).unwrap();
        let (kept, refused) = emptied.guard_shrink(&in_force, false);
        assert_eq!(
            refused,
            vec![
                ShrinkRefused {
                    file: NetworkFile::AsnTypeMap,
                    in_force: 2,
                    loaded: 0
                },
                ShrinkRefused {
                    file: NetworkFile::TorExits,
                    in_force: 2,
                    loaded: 0
                },
            ]
        );
        assert_eq!(kept.resolve(tor, &no_headers, false).tor, Some("true"));
        assert_eq!(
            kept.resolve(None, &asn72, true).asn_type.as_deref(),
            Some("business")
        );
        assert_eq!(kept.sizes(), (2, 2));
        // Forced: taken as it is.
        let (forced, refused) = NetworkData::parse(Some(""), Some(""))
            .unwrap()
            .guard_shrink(&in_force, true);
        assert!(refused.is_empty());
        assert_eq!(forced.sizes(), (0, 0));
        assert_eq!(forced.resolve(tor, &no_headers, false).tor, Some("false"));
        // One file shrinking past the threshold does not hold the other back.
        let (mixed, refused) = NetworkData::parse(
            Some(
                "72 hosting;
",
            ),
            Some(""),
        )
        .unwrap()
        .guard_shrink(&in_force, false);
        assert_eq!(
            refused,
            vec![ShrinkRefused {
                file: NetworkFile::TorExits,
                in_force: 2,
                loaded: 0
            }]
        );
        assert_eq!(
            mixed.resolve(None, &asn72, true).asn_type.as_deref(),
            Some("hosting"),
            "1 of 2 entries is not fewer than half: taken"
        );
        assert_eq!(mixed.resolve(tor, &no_headers, false).tor, Some("true"));
        // Nothing in force (start-up): anything is taken.
        let (first, refused) = NetworkData::parse(Some(""), Some(""))
            .unwrap()
            .guard_shrink(&NetworkData::default(), false);
        assert!(refused.is_empty());
        assert_eq!(first.sizes(), (0, 0));
        assert_eq!(
            first.entries(),
            vec![(NetworkFile::AsnTypeMap, 0), (NetworkFile::TorExits, 0)]
        );
    }
}
