//! Descriptor tests: parsing, request facts, path normalisation, keys and networks.

use super::*;
use std::net::Ipv6Addr;

#[test]
fn a_repeated_header_is_seen_in_any_case_and_spelling() {
    let h = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    };
    assert!(!h(&[("X-Tier", "a"), ("X-Api-Key", "k")]).repeats_any());
    assert!(h(&[("X-Tier", "a"), ("x_tier", "b")]).repeats_any());
    assert!(h(&[("a", "1"), ("b", "2"), ("A", "3")]).repeats_any());
    assert!(!h(&[]).repeats_any());
}

// `&dyn HeaderLookup` needs a sized type, so a `Vec`, not a slice.
#[allow(clippy::ptr_arg)]
fn facts<'a>(headers: &'a Vec<(String, String)>, uri: &'a str, ip: &str) -> RequestFacts<'a> {
    RequestFacts::from_uri(
        "GET",
        uri,
        Some("API.Example.com:8443"),
        Some(ip.parse().unwrap()),
        headers,
    )
}

#[test]
fn ipv6_is_reduced_to_its_prefix() {
    let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
    let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
    let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
    assert_eq!(ip_key(a, 64), "2001:db8:1:2::/64");
    assert_eq!(ip_key(a, 64), ip_key(b, 64));
    assert_ne!(ip_key(a, 64), ip_key(c, 64));
    assert_eq!(ip_key(c, 48), "2001:db8:1::/48");
    assert_eq!(ip_key(a, 48), ip_key(c, 48));
}

#[test]
fn ipv4_is_kept_and_mapped_ipv6_is_ipv4() {
    let v4: IpAddr = "203.0.113.7".parse().unwrap();
    let mapped: IpAddr = "::ffff:203.0.113.7".parse().unwrap();
    assert_eq!(ip_key(v4, 64), "203.0.113.7");
    assert_eq!(ip_key(mapped, 64), "203.0.113.7");
    for text in ["0.0.0.0", "10.9.99.100", "255.255.255.255", "1.20.100.7"] {
        assert_eq!(ip_key(text.parse().unwrap(), 64), text);
    }
}

#[test]
fn descriptors_read_the_request() {
    let headers = vec![
        ("X-Api-Key".to_string(), "k-123".to_string()),
        ("X-Weight".to_string(), "5".to_string()),
    ];
    let f = facts(&headers, "/v1/items?user=al%20ice&x=1+2&empty=", "10.1.2.3");
    let v = |d: &str| {
        Descriptor::parse(d)
            .unwrap()
            .value(&f, 64)
            .map(|c| c.into_owned())
    };
    assert_eq!(v("header:x-api-key").as_deref(), Some("k-123"));
    assert_eq!(v("header:X-API-KEY").as_deref(), Some("k-123"));
    assert_eq!(v("header:absent"), None);
    assert_eq!(v("query:user").as_deref(), Some("al ice"));
    assert_eq!(v("query:x").as_deref(), Some("1 2"));
    assert_eq!(v("query:empty").as_deref(), Some(""));
    assert_eq!(v("query:nope"), None);
    assert_eq!(v("ip:address").as_deref(), Some("10.1.2.3"));
    assert_eq!(v("method").as_deref(), Some("GET"));
    assert_eq!(v("path").as_deref(), Some("/v1/items"));
    assert_eq!(v("host").as_deref(), Some("api.example.com"));
    assert_eq!(v("jwt:plan"), None);
}

#[test]
fn claims_compare_as_json_text_and_nest() {
    let claims: Claims = serde_json::from_str(
        r#"{"plan":"pro","tier":42,"beta":true,"org":{"id":"o-1","n":7},"list":[1]}"#,
    )
    .unwrap();
    let headers: Vec<(String, String)> = Vec::new();
    let mut f = facts(&headers, "/", "10.0.0.1");
    f.claims = Some(&claims);
    let v = |d: &str| {
        Descriptor::parse(d)
            .unwrap()
            .value(&f, 64)
            .map(|c| c.into_owned())
    };
    assert_eq!(v("jwt:plan").as_deref(), Some("pro"));
    assert_eq!(v("jwt:tier").as_deref(), Some("42"));
    assert_eq!(v("jwt:beta").as_deref(), Some("true"));
    assert_eq!(v("jwt:org.id").as_deref(), Some("o-1"));
    assert_eq!(v("jwt:org.n").as_deref(), Some("7"));
    assert_eq!(v("jwt:list"), None);
    assert_eq!(v("jwt:org.missing"), None);
}

#[test]
fn descriptor_parse_errors() {
    assert!(matches!(
        Descriptor::parse("ip:adress"),
        Err(DescriptorError::Unknown(_))
    ));
    assert!(matches!(
        Descriptor::parse("header:"),
        Err(DescriptorError::EmptyName(_))
    ));
    assert!(matches!(
        Descriptor::parse("ip:address/0"),
        Err(DescriptorError::BadPrefix(_))
    ));
    assert!(matches!(
        Descriptor::parse("ip:address/129"),
        Err(DescriptorError::BadPrefix(_))
    ));
    assert_eq!(
        Descriptor::parse("ip:address/48").unwrap().to_string(),
        "ip:address/48"
    );
}

#[test]
fn composite_keys_never_collide() {
    assert_eq!(composite_key(["10.0.0.2"]), "10.0.0.2");
    let pairs: [&[&str]; 6] = [
        &["a|b", "c"],
        &["a", "b|c"],
        &["a", "b", "c"],
        &["a\\", "b"],
        &["a\\|b"],
        &["a|", "b"],
    ];
    let keys: Vec<String> = pairs
        .iter()
        .map(|p| composite_key(p.iter().copied()))
        .collect();
    for i in 0..keys.len() {
        for j in i + 1..keys.len() {
            assert_ne!(keys[i], keys[j], "{:?} vs {:?}", pairs[i], pairs[j]);
        }
    }
}

#[test]
fn ip_nets_parse_and_contain() {
    let net = IpNet::parse("10.0.0.0/8").unwrap();
    assert!(net.contains("10.200.1.1".parse().unwrap()));
    assert!(net.contains("::ffff:10.1.1.1".parse().unwrap()));
    assert!(!net.contains("11.0.0.1".parse().unwrap()));
    let v6 = IpNet::parse("2001:0db8:0000::/48").unwrap();
    assert_eq!(v6.canonical(), "2001:db8::/48");
    assert!(v6.contains("2001:db8:0:1::5".parse().unwrap()));
    assert!(IpNet::parse("10.0.0.0/33").is_none());
    assert!(IpNet::parse("nonsense").is_none());
    assert_eq!(IpNet::parse("10.0.0.2").unwrap().canonical(), "10.0.0.2");
}

proptest::proptest! {
    /// The one-pass test for whether a path needs normalising answers as the plain
    /// substring searches it replaces.
    #[test]
    fn needs_normalizing_is_the_substring_test(raw in "[a-z%./;\\\\]{0,12}") {
        let searched = raw.contains("//")
            || raw.contains(';')
            || raw.contains("/./")
            || raw.contains("/../")
            || raw.ends_with("/.")
            || raw.ends_with("/..")
            || raw.contains('%')
            || raw.contains('\\');
        proptest::prop_assert_eq!(needs_normalizing(&raw), searched, "{:?}", raw);
    }

    /// `split_uri` answers as the two `split_once` searches it replaces: the fragment cut
    /// first, then the query.
    #[test]
    fn split_uri_keeps_its_answers(raw in "[a-z/?#=&%\u{e9}]{0,16}") {
        let before_fragment = raw.split_once('#').map_or(raw.as_str(), |(before, _)| before);
        let reference = match before_fragment.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (before_fragment, None),
        };
        proptest::prop_assert_eq!(split_uri(&raw), reference);
    }

    /// `strip_port` answers as the address parse it skips for hosts with one colon.
    #[test]
    fn strip_port_keeps_its_answers(raw in "[a-f0-9:.\\[\\]]{0,16}") {
        let reference = if raw.starts_with('[') {
            match raw.find(']') {
                Some(end) => &raw[..=end],
                None => raw.as_str(),
            }
        } else if raw.parse::<Ipv6Addr>().is_ok() {
            raw.as_str()
        } else {
            raw.split_once(':').map_or(raw.as_str(), |(name, _)| name)
        };
        proptest::prop_assert_eq!(strip_port(&raw), reference);
    }

    /// Normalising never panics, always yields an absolute path without `//`, `/./` or
    /// `/../`, and is idempotent.
    #[test]
    fn normalize_path_is_total_and_idempotent(raw in "/[a-zA-Z0-9%./;=_~\\\\-]{0,40}") {
        let once = normalize_path(&raw).into_owned();
        proptest::prop_assert!(once.starts_with('/'));
        // Parameters are cut from every target the gateway accepts.
        if crate::request::syntax::path_parameters_ok(raw.as_bytes()) {
            proptest::prop_assert!(!once.contains(';'), "{:?} -> {:?}", raw, once);
        }
        proptest::prop_assert!(!once.contains("//") && !once.contains("/./") && !once.contains("/../"));
        let twice = normalize_path(&once).into_owned();
        // Decoding may reveal new `%` sequences only from `%25`, which is not unreserved.
        proptest::prop_assert_eq!(&twice, &once);
    }

    /// Fingerprints never panic on any query, ignore parameter order, and tell a different
    /// parameter list apart (escaping keeps `&`, `=`, `|` and `\\` inside their part).
    #[test]
    fn fingerprints_ignore_order_and_keep_params_apart(
        params in proptest::collection::vec(("[a-z&=|\\\\%]{0,4}", "[a-z&=|\\\\%]{0,4}"), 0..5),
        extra in "[a-z|\\\\]{1,3}",
    ) {
        let headers: Vec<(String, String)> = Vec::new();
        let fingerprint = |query: &str| {
            let uri = format!("/p?{query}");
            let facts = RequestFacts::from_uri("GET", &uri, None, None, &headers);
            let mut out = String::new();
            facts.write_fingerprint(&mut out);
            out
        };
        let encode = |t: &str| t.replace('%', "%25").replace('&', "%26").replace('=', "%3D");
        let pairs: Vec<String> = params.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect();
        let forward = fingerprint(&pairs.join("&"));
        let reversed: Vec<String> = pairs.iter().rev().cloned().collect();
        proptest::prop_assert_eq!(&forward, &fingerprint(&reversed.join("&")));
        let mut more = pairs.clone();
        more.push(format!("{}=", encode(&extra)));
        proptest::prop_assert_ne!(&forward, &fingerprint(&more.join("&")));
    }

    /// A path parameter added to any segment (`;` and text up to that segment's end) never
    /// changes the match path: `/a/b`, `/a;x/b`, `/a/b;jsessionid=1` and `/a;p=1/b;q` are one
    /// path to every selector, route and kill switch, as they are to a servlet container. (For
    /// every target the gateway accepts: one whose parameters servers read as two places,
    /// such as `/.;x`, is refused before matching.)
    #[test]
    fn path_parameters_never_change_the_match_path(
        segments in proptest::collection::vec("[a-zA-Z0-9%._~-]{0,6}", 1..6),
        params in proptest::collection::vec(proptest::option::of("[a-zA-Z0-9%.=;_~-]{0,8}"), 6),
    ) {
        let plain: String = segments.iter().map(|s| format!("/{s}")).collect();
        let with_params: String = segments
            .iter()
            .zip(&params)
            .map(|(s, p)| match p {
                Some(p) => format!("/{s};{p}"),
                None => format!("/{s}"),
            })
            .collect();
        proptest::prop_assume!(crate::request::syntax::path_parameters_ok(with_params.as_bytes()));
        proptest::prop_assert_eq!(normalize_path(&with_params), normalize_path(&plain), "{:?}", with_params);
    }

    #[test]
    fn descriptor_parse_never_panics(text in ".{0,40}") {
        let _ = Descriptor::parse(&text);
        let _ = IpNet::parse(&text);
        let _ = strip_port(&text);
        let _ = percent_decode(&text);
    }
}

#[test]
fn paths_are_normalized_before_matching() {
    for (raw, normal) in [
        ("/api/x", "/api/x"),
        ("//api/x", "/api/x"),
        ("/api//x/", "/api/x/"),
        ("/v1/./inference", "/v1/inference"),
        ("/v1/x/../inference", "/v1/inference"),
        ("/../../etc", "/etc"),
        ("/%61pi/x", "/api/x"),
        ("/a%2Fb", "/a/b"),
        ("/a%5cb", "/a/b"),
        ("/a\\b", "/a/b"),
        ("/a%252Fb", "/a%252Fb"),
        // A pass that reveals a new escape is followed by another.
        ("/a%2%46b", "/a/b"),
        ("/api%2%46llm", "/api/llm"),
        ("/a/.", "/a/"),
        ("/caf\u{e9}//x", "/caf\u{e9}/x"),
        ("/%zz", "/%zz"),
        ("/%", "/%"),
        // Path parameters are cut from each segment, as servlet containers route.
        ("/smuggled;x", "/smuggled"),
        ("/smuggled;jsessionid=0123", "/smuggled"),
        ("/a;p=1/b", "/a/b"),
        ("/a;p=1;q=2/b;", "/a/b"),
        ("/;x/smuggled", "/smuggled"),
        ("/smuggled;x/", "/smuggled/"),
        // A parameter on an empty, `.` or `..` segment is kept: cutting it would make a dot
        // segment that only servlet containers resolve (the proxy and the decision service
        // refuse these targets; matching never climbs for them).
        ("/public/..;x/admin", "/public/..;x/admin"),
        ("/public/.;x/admin", "/public/.;x/admin"),
        ("/admin/%2e%2e;/x", "/admin/..;/x"),
        ("/admin/;/x", "/admin/x"),
        // The parameter ends at any separator this normaliser reads, escaped ones included:
        // it never swallows what another server reads as a slash.
        ("/a;x%2Fb/c", "/a/b/c"),
        ("/pub;x%2F..%2Fadmin", "/admin"),
        ("/pub;x\\..\\admin", "/admin"),
        // An encoded `;` is data, kept escaped.
        ("/smuggled%3Bx", "/smuggled%3Bx"),
        ("/smuggled%3bx", "/smuggled%3bx"),
    ] {
        assert_eq!(normalize_path(raw), normal, "{raw}");
    }
    assert!(matches!(normalize_path("/plain/path"), Cow::Borrowed(_)));
    // Refusal mode sees through a slash revealed by a first pass.
    for raw in ["/a%2Fb", "/a%5cb", "/a%2%46b", "/a%2%66b"] {
        assert_eq!(
            normalize_request_path(raw, EncodedSlashes::Reject),
            Err(EncodedSlashError),
            "{raw}"
        );
    }
    assert_eq!(
        normalize_request_path("/a//b", EncodedSlashes::Reject).as_deref(),
        Ok("/a/b")
    );
}

#[test]
fn hosts_and_uris_split() {
    assert_eq!(strip_port("example.com:8080"), "example.com");
    assert_eq!(strip_port("[::1]:8080"), "[::1]");
    assert_eq!(strip_port("::1"), "::1");
    // Issue 13, attack 6: a port that is not a number does not hide the host.
    assert_eq!(strip_port("api.example.com:abc"), "api.example.com");
    assert_eq!(strip_port("api.example.com:"), "api.example.com");
    assert_eq!(strip_port("api.example.com:80:81"), "api.example.com");
    assert_eq!(strip_port("[::1]junk"), "[::1]");
    let headers: Vec<(String, String)> = Vec::new();
    let f = RequestFacts::from_uri("GET", "/", Some("Api.Example.com.:443"), None, &headers);
    assert_eq!(f.host_name(), Some("Api.Example.com"));
    assert_eq!(split_uri("/a?b=1#frag"), ("/a", Some("b=1")));
    assert_eq!(split_uri("/a"), ("/a", None));
    assert_eq!(percent_decode("%zz%4"), "%zz%4");
}

/// One client for the upstream queue's share: an IPv4 address as is (also when written as a
/// mapped IPv6 address), an IPv6 address as its `/64` (or the prefix given).
#[test]
fn a_client_net_is_an_ipv4_address_or_an_ipv6_network() {
    let net = |ip: &str, prefix| client_net(ip.parse().unwrap(), prefix).to_string();
    assert_eq!(net("192.0.2.7", 64), "192.0.2.7");
    assert_eq!(net("::ffff:192.0.2.7", 64), "192.0.2.7");
    assert_eq!(net("2001:db8:1:2:aaaa::1", 64), "2001:db8:1:2::");
    assert_eq!(net("2001:db8:1:2:bbbb::9", 64), "2001:db8:1:2::");
    assert_eq!(net("2001:db8:1:2:aaaa::1", 128), "2001:db8:1:2:aaaa::1");
    assert_eq!(net("2001:db8:1:2:aaaa::1", 48), "2001:db8:1::");
}

/// `grpc:service` and `grpc:method` read a gRPC call's path; `grpc:message` only facts that
/// stand for one of its messages; none of them a request that is not a gRPC call.
#[test]
fn grpc_descriptors_read_the_call_path() {
    let grpc: Vec<(String, String)> =
        vec![("Content-Type".into(), "application/grpc+proto".into())];
    let json: Vec<(String, String)> = vec![("Content-Type".into(), "application/json".into())];
    let value = |d: &str, facts: &RequestFacts<'_>| {
        Descriptor::parse(d)
            .unwrap()
            .value(facts, 64)
            .map(|v| v.into_owned())
    };
    let call = RequestFacts::from_uri("POST", "/echo.v1.Echo/Say", None, None, &grpc);
    assert_eq!(
        value("grpc:service", &call).as_deref(),
        Some("echo.v1.Echo")
    );
    assert_eq!(value("grpc:method", &call).as_deref(), Some("Say"));
    assert_eq!(value("grpc:message", &call), None);
    let message =
        RequestFacts::from_uri("POST", "/echo.v1.Echo/Say", None, None, &grpc).with_grpc_message();
    assert_eq!(
        value("grpc:message", &message).as_deref(),
        Some("echo.v1.Echo/Say")
    );
    let plain = RequestFacts::from_uri("POST", "/echo.v1.Echo/Say", None, None, &json);
    assert_eq!(value("grpc:method", &plain), None);
    let odd = RequestFacts::from_uri("POST", "/a/b/c", None, None, &grpc);
    assert_eq!(value("grpc:service", &odd), None);
    for d in ["grpc:service", "grpc:method", "grpc:message"] {
        assert_eq!(Descriptor::parse(d).unwrap().to_string(), d);
    }
    assert!(Descriptor::parse("grpc:message")
        .unwrap()
        .reads_grpc_messages());
}
