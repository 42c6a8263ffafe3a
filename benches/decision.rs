//! One decision through the engine (embedded store, manual clock): 1 rule keyed by IP, and 5
//! rules (IP, API key, path, global, shadow). Distinct client IPs rotate so buckets stay warm
//! but not all on one key.

// Same allocator as the shipped binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use tollgate::clock::ManualClock;
use tollgate::descriptor::RequestFacts;
use tollgate::engine::{Engine, EngineConfig};
use tollgate::policy::parse_bundle;
use tollgate::store::{MemoryStore, MemoryStoreConfig};

fn engine(bundle: &str) -> (Engine<MemoryStore>, ManualClock) {
    let clock = ManualClock::new(0);
    let e = Engine::new(
        MemoryStore::new(MemoryStoreConfig::default()),
        Arc::new(clock.clone()),
        EngineConfig::default(),
    );
    e.install(parse_bundle(bundle.as_bytes(), "bench").expect("bench bundle"));
    (e, clock)
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
    for (name, bundle) in [("1_rule_ip", ONE_RULE), ("5_rules", FIVE_RULES)] {
        let (e, clock) = engine(bundle);
        let mut i = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                clock.advance_us(1);
                let facts = RequestFacts {
                    method: "GET",
                    path: "/v1/orders",
                    query: Some("limit=10"),
                    host: Some("api.example.com"),
                    client_ip: Some(ips[i & 1023]),
                    headers: &headers,
                    claims: None,
                };
                black_box(e.decide(black_box(&facts)))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
