//! `ip:country`, `ip:asn`, `ip:type` and `ip:tor` through the real binary: trusted headers
//! through the decision service and the proxy (believed from `--trusted-proxy` peers only, the
//! nearest hop's value when repeated), the `--asn-type-map` and `--tor-exits` files, in limit
//! keys, `match` and kill switches, reloaded on SIGHUP with a bad file keeping the last good
//! one, an emptied or much smaller file refused at reload (unless `--network-allow-shrink`),
//! and a bad file at start-up refused.

use crate::support;

use std::time::Duration;
use support::{request, Gateway, Upstream};

const MAP: &str = "# test map\ndefault unknown;\n72 business;\nAS16509 hosting;\n";

fn files(dir: &std::path::Path, tor: &str) -> (String, String) {
    let map = dir.join("asn_type.map");
    let exits = dir.join("tor_exits.txt");
    std::fs::write(&map, MAP).unwrap();
    std::fs::write(&exits, tor).unwrap();
    (
        map.to_str().unwrap().to_string(),
        exits.to_str().unwrap().to_string(),
    )
}

/// The decision service's caller (the tests, on 127.0.0.1) named as a trusted proxy: its network
/// headers are believed.
const TRUSTED: [&str; 2] = ["--trusted-proxy", "127.0.0.1/32"];

/// One rule of burst 1 keyed on `key`, plus a kill switch on Tor exits.
fn policy(key: &str) -> String {
    format!(
        r#"{{"bundle_version": 1, "policies": [{{"id": "geo", "spec": {{"rules": [
            {{"name": "by-net", "limit_keys": ["{key}"], "algorithm": "token_bucket",
              "algorithm_config": {{"rps": 0.001, "burst": 1}}}}]}}}}],
           "kill_switches": [{{"scope_key": "ip:tor", "scope_value": "true", "reason": "tor"}}]}}"#
    )
}

fn decide(gw: &Gateway, ip: &str, headers: &[(&str, &str)]) -> (u16, Option<String>) {
    let mut all = vec![("X-Original-URI", "/x"), ("X-Forwarded-For", ip)];
    all.extend_from_slice(headers);
    let r = request(gw.admin, "POST", "/v1/decision", &all);
    (r.status, r.header("X-Tollgate-Reason").map(str::to_string))
}

#[test]
fn countries_from_the_decision_services_caller_key_buckets() {
    let gw = Gateway::start(Some(&policy("ip:country")), None, &TRUSTED);
    let de = [("X-Country-Code", "de")];
    assert_eq!(decide(&gw, "10.0.0.1", &de).0, 200);
    // Another client of the same country shares the bucket (the header is upper-cased).
    assert_eq!(decide(&gw, "10.0.0.2", &[("X-Country-Code", "DE")]).0, 429);
    assert_eq!(decide(&gw, "10.0.0.3", &[("X-Country-Code", "FR")]).0, 200);
}

#[test]
fn asn_types_come_from_the_map_and_tor_exits_from_the_list() {
    let dir = tempfile::tempdir().unwrap();
    let (map, exits) = files(dir.path(), "198.51.100.7\n203.0.113.0/24\n");
    let gw = Gateway::start(
        Some(&policy("ip:type")),
        None,
        &[
            &TRUSTED[..],
            &["--asn-type-map", &map, "--tor-exits", &exits],
        ]
        .concat(),
    );
    // AS72 is business, AS16509 hosting, an unlisted ASN unknown: three buckets.
    assert_eq!(decide(&gw, "10.0.0.1", &[("X-ASN", "72")]).0, 200);
    assert_eq!(decide(&gw, "10.0.0.2", &[("X-ASN", "72")]).0, 429);
    assert_eq!(decide(&gw, "10.0.0.3", &[("X-ASN", "16509")]).0, 200);
    assert_eq!(decide(&gw, "10.0.0.4", &[("X-ASN", "64500")]).0, 200);
    assert_eq!(decide(&gw, "10.0.0.5", &[("X-ASN", "64501")]).0, 429);
    // Tor exits hit the kill switch, whatever their ASN; the list beats a header saying no.
    for ip in ["198.51.100.7", "203.0.113.9"] {
        let (status, reason) = decide(&gw, ip, &[("X-ASN", "1"), ("X-Tor-Exit", "0")]);
        assert_eq!(
            (status, reason.as_deref()),
            (429, Some("kill_switch")),
            "{ip}"
        );
    }

    // SIGHUP rereads the files; a bad one keeps the last good data and says which line.
    std::fs::write(dir.path().join("tor_exits.txt"), "192.0.2.50\n").unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_until(Duration::from_secs(10), || {
        decide(&gw, "192.0.2.50", &[("X-ASN", "2")]).1.as_deref() == Some("kill_switch")
    });
    assert_ne!(
        decide(&gw, "198.51.100.7", &[("X-ASN", "3")]).1.as_deref(),
        Some("kill_switch"),
        "no longer listed"
    );
    std::fs::write(
        dir.path().join("tor_exits.txt"),
        "192.0.2.50\nnot-an-address\n",
    )
    .unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_for_log(&format!(
        "--tor-exits {exits}: line 2: 'not-an-address' is not an IP address or network"
    ));
    assert_eq!(
        decide(&gw, "192.0.2.50", &[("X-ASN", "4")]).1.as_deref(),
        Some("kill_switch"),
        "the last good list stays in force"
    );

    // A network line cut short (`198.51.100.0/24` → `/2`) has host bits set: masked, it would
    // list a quarter of IPv4. Refused naming the file and line; the last good list stays.
    std::fs::write(
        dir.path().join("tor_exits.txt"),
        "192.0.2.50\n203.0.113.0/24\n198.51.100.0/2\n",
    )
    .unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_for_log(&format!(
        "--tor-exits {exits}: line 3: '198.51.100.0/2' has host bits set past its /2 prefix"
    ));
    for (ip, listed) in [
        ("192.0.2.50", true),
        ("203.0.113.9", false),
        ("192.0.0.1", false),
        ("198.51.100.7", false),
    ] {
        assert_eq!(
            decide(&gw, ip, &[("X-ASN", "5")]).1.as_deref() == Some("kill_switch"),
            listed,
            "{ip}"
        );
    }
}

#[test]
fn the_proxy_believes_network_headers_from_trusted_proxies_only() {
    let upstream = Upstream::start();
    // Only German clients are limited (match), to 1.
    let limited = r#"{"bundle_version": 1, "policies": [{"id": "geo", "spec": {"rules": [
        {"name": "de-only", "limit_keys": [], "match": {"ip:country": "DE"}, "algorithm": "token_bucket",
         "algorithm_config": {"rps": 0.001, "burst": 1}}]}}]}"#;
    let direct = Gateway::start(Some(limited), Some(upstream.addr), &[]);
    for _ in 0..3 {
        assert_eq!(
            direct.get("/", &[("X-Country-Code", "DE")]).status,
            200,
            "a client's own header is not believed"
        );
    }
    let behind = Gateway::start(
        Some(limited),
        Some(upstream.addr),
        &["--trusted-proxy", "127.0.0.1/32"],
    );
    let de = [
        ("X-Country-Code", "DE"),
        ("X-Forwarded-For", "198.51.100.1"),
    ];
    assert_eq!(behind.get("/", &de).status, 200);
    assert_eq!(behind.get("/", &de).status, 429);
    assert_eq!(
        behind
            .get(
                "/",
                &[
                    ("X-Country-Code", "FR"),
                    ("X-Forwarded-For", "198.51.100.2")
                ]
            )
            .status,
        200
    );
}

#[test]
fn a_bad_network_file_at_start_up_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let policy_file = dir.path().join("policy.json");
    std::fs::write(&policy_file, policy("ip:type")).unwrap();
    let map = dir.path().join("bad.map");
    std::fs::write(&map, "72 business;\nseventy-two hosting;\n").unwrap();
    let stderr = support::refused_start(&policy_file, &["--asn-type-map", map.to_str().unwrap()]);
    assert!(
        stderr.contains(&format!(
            "--asn-type-map {}: line 2: the ASN must be a number",
            map.display()
        )),
        "{stderr}"
    );
}

#[test]
fn maxmind_databases_answer_before_the_headers_and_reload() {
    use support::{mmdb, GeoRecord};
    let dir = tempfile::tempdir().unwrap();
    let country = dir.path().join("country.mmdb");
    let asn = dir.path().join("asn.mmdb");
    std::fs::write(
        &country,
        mmdb(
            "GeoLite2-Country",
            &[
                ("81.2.69.0/24", GeoRecord::Country("DE")),
                ("175.16.199.0/24", GeoRecord::Country("CN")),
            ],
        ),
    )
    .unwrap();
    std::fs::write(
        &asn,
        mmdb(
            "GeoLite2-ASN",
            &[("1.2.3.0/24", GeoRecord::Asn(72, "Example Networks"))],
        ),
    )
    .unwrap();
    let (map, _) = files(dir.path(), "");
    let dbs = format!("{},{}", country.display(), asn.display());
    let by_country = Gateway::start(
        Some(&policy("ip:country")),
        None,
        &[&TRUSTED[..], &["--geoip-db", &dbs]].concat(),
    );
    // The database's DE outranks the header's FR; two DE clients share a bucket.
    assert_eq!(
        decide(&by_country, "81.2.69.1", &[("X-Country-Code", "FR")]).0,
        200
    );
    assert_eq!(decide(&by_country, "81.2.69.200", &[]).0, 429);
    assert_eq!(decide(&by_country, "175.16.199.9", &[]).0, 200);
    // An address the database does not know falls back to the trusted header.
    assert_eq!(
        decide(&by_country, "10.9.9.9", &[("X-Country-Code", "FR")]).0,
        200
    );
    assert_eq!(
        decide(&by_country, "10.9.9.8", &[("X-Country-Code", "FR")]).0,
        429
    );

    let by_type = Gateway::start(
        Some(&policy("ip:type")),
        None,
        &[&TRUSTED[..], &["--geoip-db", &dbs, "--asn-type-map", &map]].concat(),
    );
    // 1.2.3.4 is AS72 by the database: business, the bucket X-ASN: 72 reaches elsewhere.
    assert_eq!(decide(&by_type, "1.2.3.4", &[]).0, 200);
    assert_eq!(decide(&by_type, "10.0.0.1", &[("X-ASN", "72")]).0, 429);

    // SIGHUP rereads the database; a corrupt one is refused at load (never met by a request)
    // and the last good one stays.
    std::fs::write(
        &country,
        mmdb(
            "GeoLite2-Country",
            &[("81.2.69.0/24", GeoRecord::Country("AT"))],
        ),
    )
    .unwrap();
    by_country.signal(libc::SIGHUP);
    by_country.wait_for_log("network data loaded trigger=\"sighup\"");
    assert_eq!(
        decide(&by_country, "81.2.69.1", &[]).0,
        200,
        "now AT, a fresh bucket"
    );
    let mut corrupt = mmdb(
        "GeoLite2-Country",
        &[("81.2.69.0/24", GeoRecord::Country("DE"))],
    );
    // The data section's string claims more bytes than the file has.
    let at = corrupt.windows(2).position(|w| w == b"DE").unwrap() - 1;
    corrupt[at] = (2 << 5) | 28;
    std::fs::write(&country, &corrupt).unwrap();
    by_country.signal(libc::SIGHUP);
    by_country.wait_for_log(&format!("--geoip-db {}:", country.display()));
    assert_eq!(decide(&by_country, "81.2.69.2", &[]).0, 429, "still AT");
    assert_eq!(by_country.admin("GET", "/livez", &[]).status, 200);
}

/// Issue 35: the decision service trusted any caller's network headers. Now only a caller in
/// `--trusted-proxy` is believed; anyone else's `X-Tor-Exit`/`X-Country-Code` say nothing.
#[test]
fn the_decision_service_believes_network_headers_from_trusted_callers_only() {
    let untrusted = Gateway::start(Some(&policy("ip:country")), None, &[]);
    // Not believed: the descriptor is missing, the rule skipped (its `on_missing`), the Tor
    // kill switch not met.
    for _ in 0..3 {
        assert_eq!(
            decide(&untrusted, "10.0.0.1", &[("X-Country-Code", "DE")]),
            (200, None)
        );
    }
    assert_eq!(
        decide(&untrusted, "10.0.0.1", &[("X-Tor-Exit", "1")]),
        (200, None)
    );
    // The same caller named with --trusted-proxy: believed.
    let trusted = Gateway::start(Some(&policy("ip:country")), None, &TRUSTED);
    assert_eq!(
        decide(&trusted, "10.0.0.1", &[("X-Country-Code", "DE")]).0,
        200
    );
    assert_eq!(
        decide(&trusted, "10.0.0.1", &[("X-Country-Code", "DE")]),
        (429, Some("token_bucket_exceeded".to_string()))
    );
    assert_eq!(
        decide(&trusted, "10.0.0.1", &[("X-Tor-Exit", "1")]),
        (429, Some("kill_switch".to_string()))
    );
}

/// Issue 35: with a client's `X-Tor-Exit: 0` and the trusted proxy's `X-Tor-Exit: 1`, the
/// first (the client's) value won and the Tor kill switch was evaded. The nearest hop's value
/// (the last) now counts, on separate lines or joined with commas.
#[test]
fn repeated_network_headers_take_the_value_the_nearest_trusted_hop_added() {
    let gw = Gateway::start(Some(&policy("ip:country")), None, &TRUSTED);
    for tor in [
        &[("X-Tor-Exit", "0"), ("X-Tor-Exit", "1")][..],
        &[("X-Tor-Exit", "false, true")][..],
        &[("X-Tor-Exit", "no"), ("X-Tor-Exit", "0,1")][..],
    ] {
        assert_eq!(
            decide(&gw, "10.0.0.1", tor),
            (429, Some("kill_switch".to_string())),
            "{tor:?}"
        );
    }
    // The trusted hop says no: the client's `1` before it does not count either.
    assert_eq!(
        decide(
            &gw,
            "10.0.0.1",
            &[
                ("X-Tor-Exit", "1"),
                ("X-Tor-Exit", "0"),
                ("X-Country-Code", "NL")
            ]
        )
        .0,
        200
    );
    // Countries: the client's FR first, the proxy's DE last: DE's bucket (burst 1).
    let fr_then_de = [("X-Country-Code", "FR"), ("X-Country-Code", "DE")];
    assert_eq!(decide(&gw, "10.0.0.2", &fr_then_de).0, 200);
    assert_eq!(decide(&gw, "10.0.0.3", &fr_then_de).0, 429);
    assert_eq!(
        decide(&gw, "10.0.0.4", &[("X-Country-Code", "US, FR")]).0,
        200,
        "FR's own bucket"
    );
    assert_eq!(decide(&gw, "10.0.0.5", &[("X-Country-Code", "FR")]).0, 429);
}

/// Kill switches on Tor exits and on hosting ASNs.
const TOR_AND_HOSTING: &str = r#"{"bundle_version": 1, "policies": [],
    "kill_switches": [{"scope_key": "ip:tor", "scope_value": "true", "reason": "tor"},
                      {"scope_key": "ip:type", "scope_value": "hosting", "reason": "hosting"}]}"#;

/// Issue 35: the Tor list and the ASN map emptied at reload (a rewrite caught half-way) were
/// loaded with 0 entries, logged at INFO, and both kill switches silently stopped applying.
/// Now the data in force stays (ERROR log naming the file and the counts, a metric) unless the
/// operator runs with `--network-allow-shrink`.
#[test]
fn network_files_emptied_at_reload_keep_the_kill_switches_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let (map, exits) = files(
        dir.path(),
        "198.51.100.7
203.0.113.0/24
",
    );
    let flags = [
        "--trusted-proxy",
        "127.0.0.1/32",
        "--asn-type-map",
        &map,
        "--tor-exits",
        &exits,
        "--policy-poll-secs",
        "0",
    ];
    let refused = |gw: &Gateway, ip: &str, headers: &[(&str, &str)]| {
        decide(gw, ip, headers) == (429, Some("kill_switch".to_string()))
    };
    let gw = Gateway::start(Some(TOR_AND_HOSTING), None, &flags);
    assert!(refused(&gw, "198.51.100.7", &[]));
    assert!(refused(&gw, "10.0.0.1", &[("X-ASN", "16509")]));
    assert_eq!(decide(&gw, "10.0.0.1", &[("X-ASN", "72")]).0, 200);

    std::fs::write(&map, "").unwrap();
    std::fs::write(&exits, "").unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_for_log("network data loaded trigger=\"sighup\"");
    let log = gw.log_text();
    for (flag, path, in_force) in [("--asn-type-map", &map, 2), ("--tor-exits", &exits, 2)] {
        let line = log
            .lines()
            .find(|l| l.contains(&format!("{flag} reload rejected")))
            .unwrap_or_else(|| panic!("no rejection of {flag}:\n{log}"));
        assert!(line.contains("ERROR"), "{line}");
        assert!(line.contains(&format!("file={path}")), "{line}");
        assert!(
            line.contains(&format!("entries_in_force={in_force} entries_read=0")),
            "{line}"
        );
    }
    assert!(refused(&gw, "198.51.100.7", &[]), "the Tor list in force");
    assert!(refused(&gw, "203.0.113.9", &[]));
    assert!(refused(&gw, "10.0.0.1", &[("X-ASN", "16509")]), "the map");
    for file in ["tor_exits", "asn_type_map"] {
        assert_eq!(
            gw.metric(&format!(
                "tollgate_network_reloads_rejected_total{{file=\"{file}\"}}"
            )),
            1.0,
            "{file}"
        );
    }
    assert_eq!(
        gw.metric("tollgate_network_reloads_rejected_total{file=\"geoip_db\"}"),
        0.0
    );
    // A list that lost fewer than half its entries is a list that changed: taken.
    std::fs::write(
        &exits,
        "198.51.100.7
",
    )
    .unwrap();
    gw.signal(libc::SIGHUP);
    gw.wait_until(Duration::from_secs(10), || {
        decide(&gw, "203.0.113.9", &[]).0 == 200
    });
    assert!(refused(&gw, "198.51.100.7", &[]));

    // Forced: the operator says an empty file is meant.
    let (map, exits) = files(
        dir.path(),
        "198.51.100.7
203.0.113.0/24
",
    );
    let forced = Gateway::start(
        Some(TOR_AND_HOSTING),
        None,
        &[&flags[..], &["--network-allow-shrink"]].concat(),
    );
    assert!(refused(&forced, "198.51.100.7", &[]));
    std::fs::write(&map, "").unwrap();
    std::fs::write(&exits, "").unwrap();
    forced.signal(libc::SIGHUP);
    forced.wait_for_log("network data loaded trigger=\"sighup\"");
    assert!(!forced.log_text().contains("reload rejected"));
    assert_eq!(decide(&forced, "198.51.100.7", &[]), (200, None));
    assert_eq!(
        decide(&forced, "10.0.0.1", &[("X-ASN", "16509")]),
        (200, None)
    );
    assert_eq!(
        forced.metric("tollgate_network_reloads_rejected_total{file=\"tor_exits\"}"),
        0.0
    );
}

/// The reload guard for `--geoip-db`: a database rewritten with a small part of its networks
/// (its search tree far smaller) is refused at reload and the one in force keeps answering;
/// one of about the same size is taken.
#[test]
fn a_geoip_database_that_shrank_at_reload_keeps_the_one_in_force() {
    use support::{mmdb, GeoRecord};
    let dir = tempfile::tempdir().unwrap();
    let country = dir.path().join("country.mmdb");
    let networks: Vec<String> = (1..=64).map(|i| format!("{i}.0.0.0/24")).collect();
    let db = |code: &'static str, count: usize| {
        let records: Vec<(&str, GeoRecord<'_>)> = networks[..count]
            .iter()
            .map(|n| (n.as_str(), GeoRecord::Country(code)))
            .collect();
        mmdb("GeoLite2-Country", &records)
    };
    std::fs::write(&country, db("DE", 64)).unwrap();
    let by_country = Gateway::start(
        Some(&policy("ip:country")),
        None,
        &[
            "--geoip-db",
            country.to_str().unwrap(),
            "--policy-poll-secs",
            "0",
        ],
    );
    assert_eq!(decide(&by_country, "1.0.0.1", &[]).0, 200);
    assert_eq!(decide(&by_country, "2.0.0.1", &[]).0, 429, "DE's bucket");
    // Rewritten with 2 of its 64 networks, now AT: refused, DE stays.
    std::fs::write(&country, db("AT", 2)).unwrap();
    by_country.signal(libc::SIGHUP);
    by_country.wait_for_log("--geoip-db reload rejected");
    assert!(by_country
        .log_text()
        .contains(&format!("file={}", country.display())));
    assert_eq!(decide(&by_country, "1.0.0.2", &[]).0, 429, "still DE");
    assert_eq!(
        by_country.metric("tollgate_network_reloads_rejected_total{file=\"geoip_db\"}"),
        1.0
    );
    // The same networks, now AT: taken.
    std::fs::write(&country, db("AT", 64)).unwrap();
    by_country.signal(libc::SIGHUP);
    by_country.wait_until(Duration::from_secs(10), || {
        decide(&by_country, "3.0.0.1", &[]).0 == 200
    });
    assert_eq!(decide(&by_country, "4.0.0.1", &[]).0, 429, "AT's bucket");
}
