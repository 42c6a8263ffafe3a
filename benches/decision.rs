//! One decision through the engine (embedded store, manual clock): 1 rule keyed by IP, and 5
//! rules (IP, API key, path, global, shadow). Distinct client IPs rotate so buckets stay warm
//! but not all on one key. Also Envoy's rate-limit call, JWT verification, and an LLM
//! reservation settled. The `*_state_dir` variants keep the store in a state file
//! (`--state-dir`), to show what surviving restarts costs.

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Same allocator as the shipped binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};

/// The integration tests' helpers (their MaxMind database writer).
#[allow(unused_imports)]
#[path = "../tests/support/mod.rs"]
mod support;
use std::net::{IpAddr, Ipv4Addr};
use tollgate::engine::{decide_local, EngineConfig};
use tollgate::limits::clock::{Clock, ManualClock};
use tollgate::policy::{parse_bundle, Bundle};
use tollgate::request::descriptor::RequestFacts;
use tollgate::store::{MemoryStore, MemoryStoreConfig};

/// A bundle held the way the gateway holds it (behind an `arc_swap`), an embedded store and a
/// manual clock.
fn engine(bundle: &str) -> (arc_swap::ArcSwap<Bundle>, MemoryStore, ManualClock) {
    let bundle = parse_bundle(bundle.as_bytes(), "bench").expect("bench bundle");
    (
        arc_swap::ArcSwap::from_pointee(bundle),
        MemoryStore::new(MemoryStoreConfig::default()),
        ManualClock::new(0),
    )
}

/// The same store kept in a state file under a temporary directory (kept alive by the caller).
fn in_state_dir() -> (MemoryStore, tempfile::TempDir) {
    use tollgate::store::state_file;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = MemoryStoreConfig::default();
    // A fresh file: the wall clock it is opened at judges nothing.
    let opened = state_file::open(dir.path(), MemoryStore::geometry(&config, true), true, 0)
        .expect("state file");
    (
        MemoryStore::in_state_file(config, std::sync::Arc::new(opened.file), true, 0),
        dir,
    )
}

/// One decision as the gateway makes it (the bundle loaded from its `arc_swap`): allowed?
fn decide(
    policy: &arc_swap::ArcSwap<Bundle>,
    store: &MemoryStore,
    clock: &ManualClock,
    facts: &RequestFacts<'_>,
) -> bool {
    let bundle = policy.load();
    let allowed = decide_local(
        &bundle,
        black_box(facts),
        store,
        clock.now_us(),
        clock.unix_us(),
        EngineConfig::default(),
    )
    .is_allowed();
    allowed
}

const ONE_RULE: &str = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
    "algorithm_config": {"rps": 1000000, "burst": 1000000}}]}"#;

const FIVE_RULES: &str = r#"{"bundle_version": 1, "policies": [
  {"id": "a", "spec": {"rules": [
    {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}},
    {"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}},
    {"name": "per-key-path", "limit_keys": ["header:x-api-key", "path"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}},
    {"name": "global", "limit_keys": [], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000000, "burst": 1000000000}}]}},
  {"id": "s", "spec": {"mode": "shadow", "rules": [
    {"name": "shadow-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}}]}}]}"#;

fn bench(c: &mut Criterion) {
    let headers: Vec<(String, String)> = vec![
        ("host".into(), "api.example.com".into()),
        ("x-api-key".into(), "key-123456".into()),
        ("user-agent".into(), "bench".into()),
    ];
    let ips: Vec<IpAddr> = (0..1024u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))
        .collect();
    let mut group = c.benchmark_group("decision");
    for (name, bundle, state_dir) in [
        ("1_rule_ip", ONE_RULE, false),
        ("5_rules", FIVE_RULES, false),
        ("1_rule_ip_state_dir", ONE_RULE, true),
        ("5_rules_state_dir", FIVE_RULES, true),
    ] {
        let (policy, mut store, clock) = engine(bundle);
        let _dir = state_dir.then(|| {
            let (persistent, dir) = in_state_dir();
            store = persistent;
            dir
        });
        let mut i = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                clock.advance_us(1);
                // Built as the glue hands them over (path already normalised), so the figure
                // is the engine's and the store's alone.
                let facts = RequestFacts {
                    method: "GET",
                    path: std::borrow::Cow::Borrowed("/v1/orders"),
                    query: Some("limit=10"),
                    host: Some("api.example.com"),
                    client_ip: Some(ips[i & 1023]),
                    headers: &headers,
                    claims: None,
                    envoy: None,
                    body_hash: None,
                    llm: None,
                    model_override: None,
                    llm_provider: None,
                    model_rewritable: false,
                    trusted_peer: false,
                    network: None,
                    trace: None,
                    grpc_message: false,
                };
                black_box(decide(&policy, &store, &clock, &facts))
            })
        });
    }
    group.finish();
}

/// A `token_bucket_llm` request end to end without the network: a 1 KiB chat body parsed and
/// its prompt estimated, the reservation planned on the minute bucket and the day budget, then
/// settled on 300 tokens really used (two store adjustments).
fn llm(c: &mut Criterion) {
    let (policy, store, clock) = engine(
        r#"{"rules": [{"name": "chat", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket_llm",
            "algorithm_config": {"tokens_per_minute": 1000000000, "tokens_per_day": 1000000000}}]}"#,
    );
    let text =
        "Summarise the quarterly report for the board in three short bullet points. ".repeat(12);
    let body = format!(
        r#"{{"model": "gpt-4o-mini", "max_tokens": 800, "messages": [{{"role": "system", "content": "You are concise."}}, {{"role": "user", "content": "{text}"}}]}}"#
    );
    let keys: Vec<Vec<(String, String)>> = (0..1024)
        .map(|i| vec![("x-api-key".to_string(), format!("tenant-{i}"))])
        .collect();
    // One decision on a chat body: its reservation, detached from the bundle.
    let reserve = |prompt: &tollgate::request::llm::LlmRequest, headers: &Vec<(String, String)>| {
        let facts = RequestFacts {
            method: "POST",
            path: std::borrow::Cow::Borrowed("/v1/chat/completions"),
            query: None,
            host: Some("api.example.com"),
            client_ip: None,
            headers,
            claims: None,
            envoy: None,
            body_hash: None,
            llm: Some(prompt),
            model_override: None,
            llm_provider: None,
            model_rewritable: false,
            trusted_peer: false,
            network: None,
            trace: None,
            grpc_message: false,
        };
        let bundle = policy.load();
        let decision = decide_local(
            &bundle,
            &facts,
            &store,
            clock.now_us(),
            clock.unix_us(),
            EngineConfig::default(),
        );
        decision.reservation()
    };
    let mut i = 0usize;
    c.bench_function("llm/reserve_and_settle", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            clock.advance_us(1);
            let prompt = tollgate::request::llm::LlmRequest::parse(black_box(body.as_bytes()));
            let reservation = reserve(&prompt, &keys[i & 1023]);
            if let Some(reservation) = &reservation {
                store.adjust(clock.now_us(), &reservation.adjustments(300));
            }
            black_box(reservation.is_some())
        })
    });
    // With --reservation-secret, the decision service signs each reservation into its token
    // and `POST /v1/usage` verifies it: one of each.
    let prompt = tollgate::request::llm::LlmRequest::parse(body.as_bytes());
    let reservation = reserve(&prompt, &keys[0]).expect("a reservation");
    let key = tollgate::engine::reservation_token::key(b"0123456789abcdef0123456789abcdef");
    c.bench_function("llm/signed_token_roundtrip", |b| {
        b.iter(|| {
            let token = tollgate::engine::reservation_token::encode(
                &key,
                7,
                1_800_000_000_000_000,
                black_box(&reservation),
            );
            black_box(tollgate::engine::reservation_token::decode(&key, &token))
        })
    });
}

/// An `llm_spend` request end to end without the network: a 1 KiB chat body parsed (its model
/// and prompt), the reservation priced at the model's prices and taken from the key's budget for
/// the period (a UTC day, or a New York day: the zone's calendar), then settled on the usage's
/// tokens by price (one store adjustment).
fn llm_spend(c: &mut Criterion) {
    let text =
        "Summarise the quarterly report for the board in three short bullet points. ".repeat(12);
    let body = format!(
        r#"{{"model": "gpt-4o-mini", "max_tokens": 800, "messages": [{{"role": "system", "content": "You are concise."}}, {{"role": "user", "content": "{text}"}}]}}"#
    );
    let keys: Vec<Vec<(String, String)>> = (0..1024)
        .map(|i| vec![("x-team".to_string(), format!("team-{i}"))])
        .collect();
    let used = tollgate::engine::Spent::Tokens(tollgate::request::llm::BilledTokens {
        input: 100,
        cached: 60,
        cache_write: 0,
        output: 300,
    });
    for (name, zone) in [
        ("llm/spend_reserve_and_settle", "UTC"),
        ("llm/spend_reserve_and_settle_new_york", "America/New_York"),
    ] {
        let (policy, store, clock) = engine(&format!(
            r#"{{"bundle_version": 1, "llm_prices": {{"currency": "USD", "models": {{
                "gpt-4o-mini": {{"input_per_mtok": 0.15, "cached_input_per_mtok": 0.075, "output_per_mtok": 0.6}},
                "claude-*": {{"input_per_mtok": 3, "output_per_mtok": 15}}}}}},
              "policies": [{{"id": "teams", "spec": {{"rules": [{{"name": "team-day",
                "limit_keys": ["header:x-team"], "on_missing": "reject", "algorithm": "llm_spend",
                "algorithm_config": {{"budget": 1000000, "period": "1d", "timezone": "{zone}"}}}}]}}}}]}}"#
        ));
        let mut i = 0usize;
        c.bench_function(name, |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                clock.advance_us(1);
                let prompt = tollgate::request::llm::LlmRequest::parse(black_box(body.as_bytes()));
                let facts = RequestFacts::from_uri(
                    "POST",
                    "/v1/chat/completions",
                    Some("api.example.com"),
                    None,
                    &keys[i & 1023],
                )
                .with_llm(Some(&prompt));
                let bundle = policy.load();
                let decision = decide_local(
                    &bundle,
                    &facts,
                    &store,
                    clock.now_us(),
                    clock.unix_us(),
                    EngineConfig::default(),
                );
                let reservation = decision.reservation();
                if let Some(reservation) = &reservation {
                    store.adjust(clock.now_us(), &reservation.spend_adjustments(used));
                }
                black_box(reservation.is_some())
            })
        });
    }
}

/// Metering a streamed answer as it passes the proxy: 200 SSE delta events (a 1 000-word
/// completion) and a final usage chunk, fed in 16 network reads, without and with a
/// `streaming` cap (one the stream never reaches, so both read every byte).
fn llm_stream(c: &mut Criterion) {
    use tollgate::request::llm::ResponseMeter;
    let mut stream: String = (0..200)
        .map(|i| {
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"gpt-4o-mini\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" word{i} and four more\"}}}}]}}\n\n"
            )
        })
        .collect();
    stream.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":1300,\"total_tokens\":1340}}\n\ndata: [DONE]\n\n");
    let reads: Vec<&[u8]> = stream.as_bytes().chunks(stream.len() / 16 + 1).collect();
    for (name, cap) in [
        ("llm/meter_stream", None),
        ("llm/meter_stream_capped", Some(100_000)),
    ] {
        c.bench_function(name, |b| {
            b.iter(|| {
                let mut meter = ResponseMeter::new("text/event-stream", 1 << 20).with_cap(cap);
                for read in &reads {
                    black_box(meter.feed(black_box(read)));
                }
                black_box(meter.usage())
            })
        });
    }
}

/// One `ShouldRateLimit` call through the engine (no gRPC): Envoy's two common descriptors,
/// `[remote_address]` and `[generic_key, api_key]`, planned, applied in one embedded-store
/// call and turned into statuses.
fn rls(c: &mut Criterion) {
    use tollgate::engine::rls::{plan, RlsDescriptor, RlsRequest};
    use tollgate::store::OpResults;
    const BUNDLE: &str = r#"{"bundle_version": 1, "policies": [{"id": "edge", "spec": {"selector": {"domains": ["edge"]}, "rules": [
      {"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}},
      {"name": "per-key", "limit_keys": ["descriptor:api_key"], "match": {"descriptor:generic_key": "keys"}, "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}}]}}]}"#;
    let (policy, store, clock) = engine(BUNDLE);
    let requests: Vec<RlsRequest> = (0..1024u32)
        .map(|i| RlsRequest {
            domain: "edge".into(),
            descriptors: vec![
                RlsDescriptor {
                    entries: vec![(
                        "remote_address".into(),
                        Ipv4Addr::from(0x0a00_0000 + i).to_string(),
                    )],
                    ..RlsDescriptor::default()
                },
                RlsDescriptor {
                    entries: vec![
                        ("generic_key".into(), "keys".into()),
                        ("api_key".into(), format!("key-{}", i % 64)),
                    ],
                    ..RlsDescriptor::default()
                },
            ],
            hits_addend: 0,
        })
        .collect();
    let mut i = 0usize;
    c.bench_function("rls/2_descriptors", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            clock.advance_us(1);
            let bundle = policy.load();
            let now = clock.now_us();
            let plan = plan(
                &bundle,
                black_box(&requests[i & 1023]),
                clock.unix_us(),
                EngineConfig::default(),
            )
            .expect("valid call");
            let mut results = OpResults::new();
            store
                .apply(now, plan.ops(), &mut results)
                .expect("embedded store");
            let answer = tollgate::engine::rls::StoreAnswer::Spent {
                peek: None,
                results: &results,
            };
            let outcome = plan.finish(answer, now);
            black_box(outcome.statuses.len())
        })
    });
}

/// Token verification, which runs before the decision when JWT keys are configured.
fn jwt(c: &mut Criterion) {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    use tollgate::request::auth::{JwtConfig, TokenOutcome, Verifier};
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt");
    let read = |name: &str| std::fs::read(fixtures.join(name)).expect("fixture");
    let claims = serde_json::json!({"sub": "bench", "plan": "pro", "exp": jsonwebtoken::get_current_timestamp() + 3600});
    let verifier = Verifier::new(JwtConfig {
        secret: Some("bench-secret".into()),
        public_keys: vec![
            fixtures.join("rsa-public.pem"),
            fixtures.join("ec-public.pem"),
        ],
        ..JwtConfig::default()
    })
    .expect("verifier");
    let tokens = [
        (
            "jwt_hs256",
            encode(
                &Header::new(Algorithm::HS256),
                &claims,
                &EncodingKey::from_secret(b"bench-secret"),
            ),
        ),
        (
            "jwt_rs256",
            encode(
                &Header::new(Algorithm::RS256),
                &claims,
                &EncodingKey::from_rsa_pem(&read("rsa-private.pem")).expect("rsa"),
            ),
        ),
        (
            "jwt_es256",
            encode(
                &Header::new(Algorithm::ES256),
                &claims,
                &EncodingKey::from_ec_pem(&read("ec-private.pem")).expect("ec"),
            ),
        ),
    ];
    let mut group = c.benchmark_group("verify");
    for (name, token) in tokens {
        let token = token.expect("token");
        assert!(matches!(verifier.verify(&token), TokenOutcome::Valid(_)));
        group.bench_function(name, |b| {
            b.iter(|| black_box(verifier.verify(black_box(&token))))
        });
    }
    group.finish();
}

/// Bundles of `n` entries for `decision/scale/<kind>/<n>`: one-rule policies selected by path
/// prefix or by host, rules of one policy tiered by `match`, or kill switches on an API key.
/// The request always selects the first entry (and is never stopped), so only the bundle grows.
fn scale_bundle(kind: &str, n: usize) -> String {
    let rule = |name: &str, extra: &str| {
        format!(
            r#"{{"name": "{name}", "limit_keys": ["ip:address"], {extra} "algorithm": "token_bucket", "algorithm_config": {{"rps": 1000000, "burst": 1000000}}}}"#
        )
    };
    let list = |item: &dyn Fn(usize) -> String| (0..n).map(item).collect::<Vec<_>>().join(",");
    match kind {
        "paths" => format!(
            r#"{{"bundle_version": 1, "policies": [{}]}}"#,
            list(&|i| format!(
                r#"{{"id": "p{i}", "spec": {{"selector": {{"pathPrefix": "/p{i}"}}, "rules": [{}]}}}}"#,
                rule(&format!("r{i}"), "")
            ))
        ),
        "hosts" => format!(
            r#"{{"bundle_version": 1, "policies": [{}]}}"#,
            list(&|i| format!(
                r#"{{"id": "h{i}", "spec": {{"selector": {{"hosts": ["h{i}.example.com"]}}, "rules": [{}]}}}}"#,
                rule(&format!("r{i}"), "")
            ))
        ),
        "tiers" => format!(
            r#"{{"bundle_version": 1, "policies": [{{"id": "tiers", "spec": {{"rules": [{}]}}}}]}}"#,
            list(&|i| rule(
                &format!("t{i}"),
                &format!(r#""match": {{"header:x-tier": "t{i}"}},"#)
            ))
        ),
        _ => format!(
            r#"{{"bundle_version": 1, "kill_switches": [{}], "policies": [{{"id": "p", "spec": {{"rules": [{}]}}}}]}}"#,
            list(&|i| format!(
                r#"{{"scope_key": "header:x-api-key", "scope_value": "blocked-{i}", "reason": "abuse"}}"#
            )),
            rule("per-ip", "")
        ),
    }
}

/// Issue 28: a decision's cost as the bundle grows (the engine with the embedded store; the
/// request selects the first entry), and what compiling the largest bundle costs.
fn scale(c: &mut Criterion) {
    let headers: Vec<(String, String)> = vec![
        ("x-api-key".into(), "bench-key".into()),
        ("x-tier".into(), "t0".into()),
    ];
    let mut group = c.benchmark_group("decision/scale");
    for (kind, sizes) in [
        ("paths", &[1, 1_000, 10_000, 100_000][..]),
        ("hosts", &[1, 1_000, 10_000, 100_000][..]),
        ("tiers", &[1, 1_000, 10_000, 100_000][..]),
        ("kill_switches", &[1, 1_000, 10_000, 100_000][..]),
    ] {
        for &n in sizes {
            let (policy, store, clock) = engine(&scale_bundle(kind, n));
            let (host, path) = match kind {
                "paths" => ("api.example.com", "/p0/orders"),
                "hosts" => ("h0.example.com", "/v1/orders"),
                _ => ("api.example.com", "/v1/orders"),
            };
            let mut i = 0u32;
            group.bench_function(format!("{kind}/{n}"), |b| {
                b.iter(|| {
                    i = i.wrapping_add(1);
                    clock.advance_us(1);
                    let facts = RequestFacts {
                        method: "GET",
                        path: std::borrow::Cow::Borrowed(path),
                        query: None,
                        host: Some(host),
                        client_ip: Some(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (i & 1023)))),
                        headers: &headers,
                        claims: None,
                        envoy: None,
                        body_hash: None,
                        llm: None,
                        model_override: None,
                        llm_provider: None,
                        model_rewritable: false,
                        trusted_peer: false,
                        network: None,
                        trace: None,
                        grpc_message: false,
                    };
                    let allowed = decide(&policy, &store, &clock, &facts);
                    assert!(allowed);
                    black_box(allowed)
                })
            });
        }
    }
    group.finish();
    let mut compile = c.benchmark_group("bundle/compile");
    compile.sample_size(10);
    for (kind, n) in [("kill_switches", 100_000), ("paths", 10_000)] {
        let text = scale_bundle(kind, n);
        compile.bench_function(format!("{kind}/{n}"), |b| {
            b.iter(|| black_box(parse_bundle(text.as_bytes(), "bench").expect("bundle")))
        });
    }
    compile.finish();
}

/// The committed sample prompts (`benches/prompts/`): English, code, CJK, JSON.
const SAMPLE_PROMPTS: [(&str, &str); 4] = [
    ("english", include_str!("prompts/english.txt")),
    ("code", include_str!("prompts/code.txt")),
    ("cjk", include_str!("prompts/cjk.txt")),
    ("json", include_str!("prompts/json.txt")),
];

/// Issue 27: what each prompt estimator costs per request body (one chat message holding a
/// sample prompt, read whole), by sample; criterion reports the throughput in bytes.
fn estimators(c: &mut Criterion) {
    use tollgate::request::llm::{LlmRequest, TokenEncoding};
    let mut group = c.benchmark_group("estimator");
    for (name, text) in SAMPLE_PROMPTS {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]})
                .to_string();
        group.throughput(criterion::Throughput::Bytes(body.len() as u64));
        group.bench_function(format!("simple_word/{name}"), |b| {
            b.iter(|| black_box(LlmRequest::parse(black_box(body.as_bytes()))))
        });
        for (label, encoding) in [
            ("tiktoken_o200k", TokenEncoding::O200kBase),
            ("tiktoken_cl100k", TokenEncoding::Cl100kBase),
        ] {
            // Built once, before measuring (the gateway builds each encoding once too).
            encoding.count("warm");
            group.bench_function(format!("{label}/{name}"), |b| {
                b.iter(|| {
                    black_box(LlmRequest::parse_with(
                        black_box(body.as_bytes()),
                        encoding.bit(),
                    ))
                })
            });
        }
    }
    group.finish();
}

/// `ip:country`/`ip:asn`/`ip:type`/`ip:tor`: one request's network facts from trusted
/// headers, a 100 000-entry ASN map and 10 000 Tor exits (9 000 addresses, 1 000 networks),
/// and with Country and ASN databases answering first.
fn network(c: &mut Criterion) {
    use tollgate::request::network::NetworkData;
    let map: String = (1..=100_000)
        .map(|asn| format!("{asn} {};\n", ["isp", "hosting", "business"][asn % 3]))
        .collect();
    let exits: String = (0..9_000u32)
        .map(|i| format!("{}\n", std::net::Ipv4Addr::from(0x0a00_0000 + i * 7)))
        .chain(
            (0..1_000u32)
                .map(|i| format!("{}/24\n", std::net::Ipv4Addr::from(0xc000_0000 + (i << 8)))),
        )
        .collect();
    let mut headers = http::HeaderMap::new();
    headers.insert("x-country-code", "de".parse().unwrap());
    headers.insert("x-asn", "16509".parse().unwrap());
    let lookup = tollgate::service::HttpHeaders(&headers);
    // Country and ASN databases of 4 096 /24 networks each, as `--geoip-db` reads them.
    let networks: Vec<String> = (0..4_096u32)
        .map(|i| format!("{}/24", std::net::Ipv4Addr::from(0x2000_0000 + (i << 8))))
        .collect();
    let countries: Vec<(&str, support::GeoRecord<'_>)> = networks
        .iter()
        .map(|n| (n.as_str(), support::GeoRecord::Country("DE")))
        .collect();
    let asns: Vec<(&str, support::GeoRecord<'_>)> = networks
        .iter()
        .map(|n| (n.as_str(), support::GeoRecord::Asn(16509, "Example")))
        .collect();
    let geo = vec![
        tollgate::request::network::GeoDb::parse(support::mmdb("GeoLite2-Country", &countries))
            .expect("country db"),
        tollgate::request::network::GeoDb::parse(support::mmdb("GeoLite2-ASN", &asns))
            .expect("asn db"),
    ];
    let with_dbs = NetworkData::with_geo(Some(&map), Some(&exits), geo).expect("network data");
    let listed: std::net::IpAddr = "32.0.5.7".parse().unwrap();
    c.bench_function("network/resolve_geoip", |b| {
        b.iter(|| black_box(with_dbs.resolve(Some(black_box(listed)), &lookup, true)))
    });
    let data = NetworkData::parse(Some(&map), Some(&exits)).expect("network data");
    let ip: std::net::IpAddr = "203.0.113.7".parse().unwrap();
    c.bench_function("network/resolve", |b| {
        b.iter(|| black_box(data.resolve(Some(black_box(ip)), &lookup, true)))
    });
}

/// Issue 37: a decision with a candidate bundle decided in shadow beside the live one, the
/// same size: none, one rule changed (the one the request reaches; for the 1 000 policies also
/// one it does not reach), every rule changed. The 5-rule bundle of `decision/5_rules`, and
/// 1 000 one-rule policies selected by path.
fn candidate(c: &mut Criterion) {
    const PER_KEY: &str = r#"{"name": "per-key", "limit_keys": ["header:x-api-key"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1000000, "burst": 1000000}}"#;
    assert!(FIVE_RULES.contains(PER_KEY));
    use tollgate::engine::candidate::{decide_candidate_local, CandidateBundle};
    use tollgate::policy::{parse_bundle_with, CompileOptions};
    let headers: Vec<(String, String)> = vec![
        ("host".into(), "api.example.com".into()),
        ("x-api-key".into(), "key-123456".into()),
        ("user-agent".into(), "bench".into()),
    ];
    let paths = scale_bundle("paths", 1_000);
    let every = |text: &str| text.replace(r#""burst": 1000000"#, r#""burst": 999999"#);
    let cases: [(&str, String, &str, Option<String>); 7] = [
        ("5_rules/none", FIVE_RULES.to_string(), "/v1/orders", None),
        (
            "5_rules/one_changed",
            FIVE_RULES.to_string(),
            "/v1/orders",
            Some(FIVE_RULES.replace(PER_KEY, &PER_KEY.replace("1000000}", "999999}"))),
        ),
        (
            "5_rules/every_changed",
            FIVE_RULES.to_string(),
            "/v1/orders",
            Some(every(FIVE_RULES)),
        ),
        ("paths_1000/none", paths.clone(), "/p0/orders", None),
        (
            "paths_1000/one_changed",
            paths.clone(),
            "/p0/orders",
            Some(paths.replacen(r#""burst": 1000000"#, r#""burst": 999999"#, 1)),
        ),
        (
            "paths_1000/one_changed_elsewhere",
            paths.clone(),
            "/p0/orders",
            Some(
                paths
                    .rsplit_once(r#""burst": 1000000"#)
                    .map(|(a, b)| format!(r#"{a}"burst": 999999{b}"#))
                    .expect("a rule"),
            ),
        ),
        (
            "paths_1000/every_changed",
            paths.clone(),
            "/p0/orders",
            Some(every(&paths)),
        ),
    ];
    let options = CompileOptions {
        candidate: true,
        ..CompileOptions::default()
    };
    let mut group = c.benchmark_group("decision/candidate");
    for (name, live, path, candidate) in cases {
        let (policy, store, clock) = engine(&live);
        let candidate = candidate.map(|text| {
            let bundle = parse_bundle_with(text.as_bytes(), "bench", options).expect("candidate");
            CandidateBundle::new(std::sync::Arc::new(bundle), Some(policy.load_full()))
        });
        if let Some(candidate) = &candidate {
            let changed = candidate.bundle().rules.len() - candidate.shared_rules();
            eprintln!(
                "{name}: {changed} rules of {} changed",
                candidate.bundle().rules.len()
            );
        }
        let mut i = 0u32;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                clock.advance_us(1);
                let facts = RequestFacts {
                    method: "GET",
                    path: std::borrow::Cow::Borrowed(path),
                    query: Some("limit=10"),
                    host: Some("api.example.com"),
                    client_ip: Some(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (i & 1023)))),
                    headers: &headers,
                    claims: None,
                    envoy: None,
                    body_hash: None,
                    llm: None,
                    model_override: None,
                    llm_provider: None,
                    model_rewritable: false,
                    trusted_peer: false,
                    network: None,
                    trace: None,
                    grpc_message: false,
                };
                let bundle = policy.load();
                let (now_us, unix_us) = (clock.now_us(), clock.unix_us());
                let config = EngineConfig::default();
                let live =
                    decide_local(&bundle, black_box(&facts), &store, now_us, unix_us, config);
                if let Some(candidate) = &candidate {
                    let refused = decide_candidate_local(
                        candidate, &live, &facts, &store, now_us, unix_us, config,
                    );
                    black_box(refused);
                }
                black_box(live.is_allowed())
            })
        });
    }
    group.finish();
}

/// A request's facts as the proxy builds them from its request line and `Host` (target split,
/// path normalised): a plain target, one the normalisation rewrites, and one with path
/// parameters; and the request line's shape check that comes first.
fn facts(c: &mut Criterion) {
    let headers: Vec<(String, String)> = vec![("host".into(), "api.example.com".into())];
    let mut group = c.benchmark_group("request/facts");
    for (name, target) in [
        ("plain", "/v1/orders/1234?limit=10"),
        ("normalised", "/v1//orders/./1234?limit=10"),
        (
            "path_parameters",
            "/v1/orders;jsessionid=0123/1234?limit=10",
        ),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let facts = RequestFacts::new(
                    black_box("GET"),
                    black_box(target),
                    Some(black_box("api.example.com")),
                    None,
                    &headers,
                    tollgate::request::descriptor::EncodedSlashes::Decode,
                );
                black_box(facts.map(|f| f.path.len()).unwrap_or(0))
            })
        });
    }
    group.finish();
    // The request line's and Host's shape, checked before the facts are built.
    use tollgate::request::syntax::{check, RequestLine};
    c.bench_function("request/syntax", |b| {
        b.iter(|| {
            let line = RequestLine {
                method: black_box(b"GET"),
                target: black_box(b"/v1/orders/1234?limit=10"),
                http11: true,
                authority: None,
            };
            black_box(check(line, [black_box(&b"api.example.com"[..])]))
        })
    });
}

/// A rule counted after the response (`count_when`, with and without a penalty box) against
/// the same rule counted before it: one decision, then (for the counted rules) the response
/// settled, every other response a 401 that is charged. The penalty box's window (1 ms of the
/// manual clock, about 2 of its client's failures apart) keeps its log at one mark: the cost of
/// reading the block and counting an event, never of a block.
fn response(c: &mut Criterion) {
    let rule = |extra: &str| {
        format!(
            r#"{{"rules": [{{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
            "algorithm_config": {{"rps": 1000000, "burst": 1000000{extra}}}}}]}}"#
        )
    };
    let headers: Vec<(String, String)> = vec![("host".into(), "api.example.com".into())];
    let none: Vec<(String, String)> = Vec::new();
    let ips: Vec<IpAddr> = (0..1024u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))
        .collect();
    let mut group = c.benchmark_group("decision/response");
    for (name, bundle) in [
        ("plain", rule("")),
        (
            "count_when",
            rule(r#", "count_when": {"status": [401, 403]}"#),
        ),
        (
            "count_when_penalty",
            rule(
                r#", "count_when": {"status": [401, 403]}, "penalty": {"after": 5, "within": "1ms", "block_for": "1s"}"#,
            ),
        ),
    ] {
        let (policy, store, clock) = engine(&bundle);
        let mut i = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                clock.advance_us(1);
                let facts = RequestFacts {
                    method: "POST",
                    path: std::borrow::Cow::Borrowed("/login"),
                    query: None,
                    host: Some("api.example.com"),
                    client_ip: Some(ips[i & 1023]),
                    headers: &headers,
                    claims: None,
                    envoy: None,
                    body_hash: None,
                    llm: None,
                    model_override: None,
                    llm_provider: None,
                    model_rewritable: false,
                    trusted_peer: false,
                    network: None,
                    trace: None,
                    grpc_message: false,
                };
                let bundle = policy.load();
                let now = clock.now_us();
                let decision = decide_local(
                    &bundle,
                    black_box(&facts),
                    &store,
                    now,
                    clock.unix_us(),
                    EngineConfig::default(),
                );
                if let Some(charges) = decision.response_charges() {
                    let status = if i & 1 == 0 { 401 } else { 200 };
                    let settled = charges.settle(status, &none);
                    store.adjust(now, &settled.adjust);
                    tollgate::engine::charges::count_in_memory(&store, now, &settled.counted);
                }
                black_box(decision.is_allowed())
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches, bench, rls, jwt, llm, llm_spend, llm_stream, scale, estimators, network, candidate,
    facts, response
);
criterion_main!(benches);
