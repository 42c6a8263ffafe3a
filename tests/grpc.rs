//! The gRPC listener spoken to by a real gRPC client (tonic, Envoy's own protobuf types):
//! `ShouldRateLimit` edge cases (all-or-nothing across descriptors, `hits_addend`, checks,
//! overrides, invalid calls, store failures), `Check` (ext_authz) and `grpc.health.v1`.

use crate::support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use envoy_types::pb::envoy::service::auth::v3::check_response;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{rate_limit::Unit, Code};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use std::net::SocketAddr;
use support::{free_port, Gateway};
use tonic::transport::Channel;

const POLICY: &str = r#"{
  "bundle_version": 1,
  "policies": [{
    "id": "edge",
    "spec": {
      "selector": { "domains": ["edge"] },
      "rules": [
        { "name": "per-ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket",
          "algorithm_config": { "tokens_per_second": 1, "burst": 3 } },
        { "name": "per-key", "limit_keys": ["descriptor:api_key"],
          "match": { "descriptor:generic_key": "keys" }, "algorithm": "token_bucket",
          "algorithm_config": { "count": 2, "period": "1m", "burst": 2 } }
      ]
    }
  }]
}"#;

fn start(extra: &[&str]) -> (Gateway, SocketAddr) {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let listen = grpc.to_string();
    let mut args = vec!["--grpc-listen", listen.as_str()];
    args.extend_from_slice(extra);
    let gw = Gateway::start(Some(POLICY), None, &args);
    (gw, grpc)
}

async fn client(addr: SocketAddr) -> RateLimitServiceClient<Channel> {
    for _ in 0..100 {
        if let Ok(c) = RateLimitServiceClient::connect(format!("http://{addr}")).await {
            return c;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("gRPC listener {addr} never answered");
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn call(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(c: &mut RateLimitServiceClient<Channel>, r: RateLimitRequest) -> RateLimitResponse {
    c.should_rate_limit(r)
        .await
        .expect("ShouldRateLimit")
        .into_inner()
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

fn ip(addr: &str) -> RateLimitDescriptor {
    descriptor(&[("remote_address", addr)])
}

/// (code, remaining) per descriptor.
fn codes(r: &RateLimitResponse) -> Vec<(i32, u32)> {
    r.statuses
        .iter()
        .map(|s| (s.code, s.limit_remaining))
        .collect()
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_passes_then_over_limit_with_statuses_and_headers() {
    let (gw, addr) = start(&[]);
    let mut c = client(addr).await;
    for left in [2u32, 1, 0] {
        let r = ask(&mut c, call("edge", vec![ip("203.0.113.7")])).await;
        assert_eq!(r.overall_code, OK);
        assert_eq!(codes(&r), vec![(OK, left)]);
        let limit = r.statuses[0].current_limit.as_ref().expect("current_limit");
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("per-ip", 1, Unit::Second as i32)
        );
        assert_eq!(header(&r, "ratelimit-policy"), Some("\"per-ip\";q=3;w=3"));
        assert_eq!(
            header(&r, "ratelimit"),
            Some(format!("\"per-ip\";r={left};t={}", 3 - left).as_str())
        );
        assert_eq!(header(&r, "retry-after"), None);
    }
    let r = ask(&mut c, call("edge", vec![ip("203.0.113.7")])).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(codes(&r), vec![(OVER, 0)]);
    assert_eq!(
        r.statuses[0]
            .duration_until_reset
            .as_ref()
            .map(|d| d.seconds),
        Some(1)
    );
    assert_eq!(header(&r, "ratelimit"), Some("\"per-ip\";r=0;t=1"));
    assert_eq!(header(&r, "ratelimit-remaining"), Some("0"));
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry), "Retry-After {retry}");
    assert_eq!(
        header(&r, "x-tollgate-reason"),
        Some("token_bucket_exceeded")
    );
    assert_eq!(
        gw.metric("tollgate_grpc_calls_total{code=\"ok\",service=\"ratelimit\"}"),
        3.0
    );
    assert_eq!(
        gw.metric("tollgate_grpc_calls_total{code=\"over_limit\",service=\"ratelimit\"}"),
        1.0
    );
    // Another client, and another domain, are untouched.
    let r = ask(&mut c, call("edge", vec![ip("203.0.113.8")])).await;
    assert_eq!(codes(&r), vec![(OK, 2)]);
    let r = ask(&mut c, call("other", vec![ip("203.0.113.7")])).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses.len(), 1);
    assert_eq!(r.statuses[0].current_limit, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_are_all_or_nothing() {
    let (_gw, addr) = start(&[]);
    let mut c = client(addr).await;
    let both = || {
        call(
            "edge",
            vec![
                ip("198.51.100.1"),
                descriptor(&[("generic_key", "keys"), ("api_key", "k1")]),
            ],
        )
    };
    assert_eq!(codes(&ask(&mut c, both()).await), vec![(OK, 2), (OK, 1)]);
    assert_eq!(codes(&ask(&mut c, both()).await), vec![(OK, 1), (OK, 0)]);
    // The key's bucket is empty: the whole call is over the limit, the address's bucket is
    // reported as it stands (one token) and is not spent.
    let r = ask(&mut c, both()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(codes(&r), vec![(OK, 1), (OVER, 0)]);
    let limit = r.statuses[1].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit, limit.unit),
        ("per-key", 2, Unit::Minute as i32)
    );
    assert_eq!(
        r.statuses[1].duration_until_reset.as_ref().unwrap().seconds,
        30
    );
    let r = ask(&mut c, call("edge", vec![ip("198.51.100.1")])).await;
    assert_eq!(codes(&r), vec![(OK, 0)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_spends_and_zero_only_checks() {
    let (_gw, addr) = start(&[]);
    let mut c = client(addr).await;
    // Request-level hits_addend 2: two tokens.
    let mut r = call("edge", vec![ip("192.0.2.1")]);
    r.hits_addend = 2;
    assert_eq!(codes(&ask(&mut c, r).await), vec![(OK, 1)]);
    // A descriptor's own hits_addend wins; 0 checks without spending, however often.
    for _ in 0..3 {
        let mut d = ip("192.0.2.1");
        d.hits_addend = Some(UInt64Value { value: 0 });
        let mut r = call("edge", vec![d]);
        r.hits_addend = 3;
        assert_eq!(codes(&ask(&mut c, r).await), vec![(OK, 1)]);
    }
    let mut d = ip("192.0.2.1");
    d.hits_addend = Some(UInt64Value { value: 1 });
    let mut r = call("edge", vec![d]);
    r.hits_addend = 3;
    assert_eq!(codes(&ask(&mut c, r).await), vec![(OK, 0)]);
    // Empty now: a check is over the limit, and a check over the limit spends nothing on
    // the call's other descriptors either.
    let mut check = ip("192.0.2.1");
    check.hits_addend = Some(UInt64Value { value: 0 });
    let key = descriptor(&[("generic_key", "keys"), ("api_key", "k9")]);
    let r = ask(&mut c, call("edge", vec![check, key.clone()])).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(codes(&r), vec![(OVER, 0), (OK, 2)]);
    let r = ask(&mut c, call("edge", vec![key])).await;
    assert_eq!(codes(&r), vec![(OK, 1)]);
    // A check and a spend on one bucket: the check is judged on the bucket before the spend.
    let mut check = ip("192.0.2.3");
    check.hits_addend = Some(UInt64Value { value: 0 });
    let r = ask(&mut c, call("edge", vec![check.clone(), ip("192.0.2.3")])).await;
    assert_eq!(codes(&r), vec![(OK, 3), (OK, 2)]);
    // Only checks: nothing spent, however often.
    for _ in 0..3 {
        let r = ask(&mut c, call("edge", vec![check.clone(), check.clone()])).await;
        assert_eq!(codes(&r), vec![(OK, 2), (OK, 2)]);
    }
    // More hits than the burst can ever hold: over the limit, nothing to wait for.
    let mut r = call("edge", vec![ip("192.0.2.2")]);
    r.hits_addend = 4;
    let r = ask(&mut c, r).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(header(&r, "x-tollgate-reason"), Some("cost_exceeds_limit"));
    assert_eq!(header(&r, "retry-after"), None);
    let r = ask(&mut c, call("edge", vec![ip("192.0.2.2")])).await;
    assert_eq!(codes(&r), vec![(OK, 2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_limit_overrides_are_honoured() {
    let (_gw, addr) = start(&[]);
    let mut c = client(addr).await;
    let with_limit = |entries: &[(&str, &str)], rpu: u32, unit: Unit| {
        let mut d = descriptor(entries);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: rpu,
            unit: unit as i32,
        });
        d
    };
    // The override replaces the rules for its descriptor (one limit per descriptor, as in
    // envoyproxy/ratelimit): 5 per hour under the descriptor itself...
    for left in [4u32, 3, 2, 1, 0] {
        let d = with_limit(&[("remote_address", "192.0.2.50")], 5, Unit::Hour);
        let r = ask(&mut c, call("edge", vec![d])).await;
        assert_eq!(codes(&r), vec![(OK, left)]);
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("envoy-limit-override", 5, Unit::Hour as i32)
        );
    }
    let d = with_limit(&[("remote_address", "192.0.2.50")], 5, Unit::Hour);
    let r = ask(&mut c, call("edge", vec![d])).await;
    assert_eq!(codes(&r), vec![(OVER, 0)]);
    assert_eq!(
        r.statuses[0].duration_until_reset.as_ref().unwrap().seconds,
        720
    );
    // ...and the rule's own bucket (3 per client) was never touched.
    assert_eq!(
        codes(&ask(&mut c, call("edge", vec![ip("192.0.2.50")])).await),
        vec![(OK, 2)]
    );
    // Two descriptors reaching one bucket with different overrides: the stricter counts for
    // both, and the bucket is charged once with both hits.
    let pair = || {
        vec![
            with_limit(&[("remote_address", "192.0.2.60")], 10, Unit::Minute),
            with_limit(&[("remote_address", "192.0.2.60")], 2, Unit::Minute),
        ]
    };
    let r = ask(&mut c, call("edge", pair())).await;
    assert_eq!(codes(&r), vec![(OK, 0), (OK, 0)]);
    for status in &r.statuses {
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (2, Unit::Minute as i32)
        );
    }
    assert_eq!(ask(&mut c, call("edge", pair())).await.overall_code, OVER);
    // No rule applies: counted under the descriptor itself, as envoyproxy/ratelimit does.
    for left in [1u32, 0] {
        let d = with_limit(&[("tenant", "t1"), ("route", "/x")], 2, Unit::Minute);
        let r = ask(&mut c, call("edge", vec![d])).await;
        assert_eq!(codes(&r), vec![(OK, left)]);
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("envoy-limit-override", 2, Unit::Minute as i32)
        );
    }
    let d = with_limit(&[("tenant", "t1"), ("route", "/x")], 2, Unit::Minute);
    assert_eq!(
        codes(&ask(&mut c, call("edge", vec![d])).await),
        vec![(OVER, 0)]
    );
    let d = with_limit(&[("tenant", "t2"), ("route", "/x")], 2, Unit::Minute);
    assert_eq!(
        codes(&ask(&mut c, call("edge", vec![d])).await),
        vec![(OK, 1)]
    );
    // An override tollgate cannot count is refused, not ignored.
    let d = with_limit(&[("tenant", "t3")], 0, Unit::Minute);
    let e = c
        .should_rate_limit(call("edge", vec![d]))
        .await
        .expect_err("zero requests per unit");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_calls_are_invalid_arguments() {
    let (_gw, addr) = start(&[]);
    let mut c = client(addr).await;
    let e = c
        .should_rate_limit(call("", vec![ip("192.0.2.1")]))
        .await
        .expect_err("empty domain");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(e.message(), "domain must not be empty");
    let e = c
        .should_rate_limit(call("edge", vec![]))
        .await
        .expect_err("no descriptors");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // Bounded work per call: at most 64 descriptors of at most 32 entries.
    let e = c
        .should_rate_limit(call("edge", vec![ip("192.0.2.1"); 65]))
        .await
        .expect_err("too many descriptors");
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::InvalidArgument,
            "65 descriptors: at most 64 per call"
        )
    );
    let wide: Vec<(String, String)> = (0..33)
        .map(|i| (format!("k{i}"), "v".to_string()))
        .collect();
    let wide: Vec<(&str, &str)> = wide.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let e = c
        .should_rate_limit(call("edge", vec![ip("192.0.2.1"), descriptor(&wide)]))
        .await
        .expect_err("too many entries");
    assert_eq!(
        e.message(),
        "descriptors[1]: 33 entries: at most 32 per descriptor"
    );
    // 64 descriptors sharing one bucket: one op, charged 64 times over (burst 3: refused),
    // and nothing spent.
    let r = ask(&mut c, call("edge", vec![ip("192.0.2.9"); 64])).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(r.statuses.len(), 64);
    assert_eq!(
        codes(&ask(&mut c, call("edge", vec![ip("192.0.2.9")])).await),
        vec![(OK, 2)]
    );
    // Oversized domains, keys and values are refused: they would become bucket keys and log
    // lines.
    let e = c
        .should_rate_limit(call("edge\nforged line", vec![ip("192.0.2.1")]))
        .await
        .expect_err("control character in the domain");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let long = "x".repeat(4097);
    let e = c
        .should_rate_limit(call(
            "edge",
            vec![descriptor(&[("api_key", long.as_str())])],
        ))
        .await
        .expect_err("oversized value");
    assert_eq!(
        e.message(),
        "descriptors[0].entries[0]: keys are at most 256 bytes and values at most 4096"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_failures_fail_open_or_answer_unavailable() {
    let dead_store = format!("redis://127.0.0.1:{}", free_port());
    // `open`: admitted uncounted while the store is away (local mode is tested in outage.rs).
    let (gw, addr) = start(&["--store", &dead_store, "--on-store-error", "open"]);
    let mut c = client(addr).await;
    for _ in 0..5 {
        let r = ask(&mut c, call("edge", vec![ip("192.0.2.1")])).await;
        assert_eq!(r.overall_code, OK);
    }
    assert!(
        gw.metric("tollgate_store_errors_total") >= 5.0,
        "{}",
        gw.metrics()
    );
    drop(gw);
    let (_gw, addr) = start(&["--store", &dead_store, "--grpc-store-errors", "unavailable"]);
    let mut c = client(addr).await;
    let e = c
        .should_rate_limit(call("edge", vec![ip("192.0.2.1")]))
        .await
        .expect_err("store down");
    assert_eq!(e.code(), tonic::Code::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_authz_check_allows_then_denies_with_429_and_headers() {
    let policy = support::one_rule("per-ip", r#"["ip:address"]"#, 1.0, 2.0);
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let _gw = Gateway::start(Some(&policy), None, &["--grpc-listen", &grpc.to_string()]);
    let mut c = None;
    for _ in 0..100 {
        if let Ok(client) = AuthorizationClient::connect(format!("http://{grpc}")).await {
            c = Some(client);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut c = c.expect("ext_authz listener");
    // A spoofed X-Forwarded-For from an untrusted peer buys nothing: the peer is the client.
    let spoof = [("x-forwarded-for", "10.9.9.9")];
    for left in ["1", "0"] {
        let r = c
            .check(support::ext_authz::check_request(
                "203.0.113.9",
                "/api/x?y=1",
                &spoof,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status.as_ref().map(|s| s.code), Some(0));
        let Some(check_response::HttpResponse::OkResponse(ok)) = r.http_response else {
            panic!("expected an OK response: {r:?}");
        };
        let get = |name: &str| {
            ok.response_headers_to_add
                .iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == name)
                .map(|h| h.value.clone())
        };
        assert_eq!(get("ratelimit-remaining").as_deref(), Some(left));
        assert_eq!(
            get("ratelimit-policy").as_deref(),
            Some("\"per-ip\";q=2;w=2")
        );
    }
    let r = c
        .check(support::ext_authz::check_request(
            "203.0.113.9",
            "/api/x",
            &spoof,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status.as_ref().map(|s| s.code), Some(8));
    let Some(check_response::HttpResponse::DeniedResponse(denied)) = r.http_response else {
        panic!("expected a denied response");
    };
    assert_eq!(denied.status.map(|s| s.code), Some(429));
    assert_eq!(denied.body, "Too Many Requests");
    let get = |name: &str| {
        denied
            .headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == name)
            .map(|h| h.value.clone())
    };
    assert_eq!(
        get("x-tollgate-reason").as_deref(),
        Some("token_bucket_exceeded")
    );
    assert_eq!(get("ratelimit").as_deref(), Some("\"per-ip\";r=0;t=1"));
    assert!(get("retry-after").is_some());
    // Another peer is another client.
    let r = c
        .check(support::ext_authz::check_request(
            "203.0.113.10",
            "/api/x",
            &spoof,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status.as_ref().map(|s| s.code), Some(0));
}

/// Issue 35: ext_authz believed the network headers of any caller. Now only when the gRPC
/// connection's peer (Envoy) is in `--trusted-proxy`; Envoy's header map joins repeated lines
/// with `,`, and the last item (the nearest hop's) counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_authz_believes_network_headers_only_from_a_trusted_caller() {
    let policy = r#"{"bundle_version": 1, "policies": [],
        "kill_switches": [{"scope_key": "ip:tor", "scope_value": "true", "reason": "tor"}]}"#;
    let mut codes = Vec::new();
    for extra in [&[][..], &["--trusted-proxy", "127.0.0.1/32"][..]] {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let listen = grpc.to_string();
        let args = [&["--grpc-listen", listen.as_str()][..], extra].concat();
        let _gw = Gateway::start(Some(policy), None, &args);
        let mut c = None;
        for _ in 0..100 {
            if let Ok(client) = AuthorizationClient::connect(format!("http://{grpc}")).await {
                c = Some(client);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let mut c = c.expect("ext_authz listener");
        for tor in ["1", "0,1", "1,0"] {
            let r = c
                .check(support::ext_authz::check_request(
                    "203.0.113.9",
                    "/x",
                    &[("x-tor-exit", tor)],
                ))
                .await
                .unwrap()
                .into_inner();
            codes.push(r.status.map(|s| s.code));
        }
    }
    // Untrusted: OK three times. Trusted: the kill switch (RESOURCE_EXHAUSTED), unless the
    // nearest hop said 0.
    assert_eq!(
        codes,
        [Some(0), Some(0), Some(0), Some(8), Some(8), Some(0)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_reports_serving() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let (_gw, addr) = start(&[]);
    let _ = client(addr).await;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in [
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
        "envoy.service.auth.v3.Authorization",
    ] {
        let r = health
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, 1, "{service:?} is SERVING");
    }
}

/// A CA and a server certificate for `localhost` / 127.0.0.1 it signed (openssl CLI).
fn make_certs(dir: &std::path::Path) -> (Vec<u8>, std::path::PathBuf, std::path::PathBuf) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    run(&[
        &["req", "-x509"][..],
        &ec,
        &[
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=tollgate test CA",
        ],
    ]
    .concat());
    run(&[
        &["req"][..],
        &ec,
        &[
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    ]
    .concat());
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    (
        std::fs::read(dir.join("ca.pem")).unwrap(),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_serves_grpc_and_refuses_cleartext() {
    use tonic::transport::{Certificate, ClientTlsConfig};
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(certs.path());
    let (_gw, addr) = start(&[
        "--grpc-tls-cert",
        cert.to_str().unwrap(),
        "--grpc-tls-key",
        key.to_str().unwrap(),
    ]);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    let channel = Channel::from_shared(format!("https://localhost:{}", addr.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("TLS connection");
    let mut c = RateLimitServiceClient::new(channel);
    for left in [2u32, 1, 0] {
        assert_eq!(
            codes(&ask(&mut c, call("edge", vec![ip("203.0.113.7")])).await),
            vec![(OK, left)]
        );
    }
    assert_eq!(
        ask(&mut c, call("edge", vec![ip("203.0.113.7")]))
            .await
            .overall_code,
        OVER
    );
    // h2c to a TLS listener gets no answer.
    let mut plain = RateLimitServiceClient::new(
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy(),
    );
    assert!(plain
        .should_rate_limit(call("edge", vec![ip("203.0.113.7")]))
        .await
        .is_err());
}

#[test]
fn unusable_tls_files_stop_start_up_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("p.json");
    std::fs::write(&policy, POLICY).unwrap();
    let not_pem = dir.path().join("cert.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let (_, cert, _) = make_certs(dir.path());
    let other = tempfile::tempdir().unwrap();
    let (_, _, other_key) = make_certs(other.path());
    for (cert, key, expected) in [
        (
            cert.to_str().unwrap(),
            other_key.to_str().unwrap(),
            "server.key: transport error: keys may not be consistent: KeyMismatch",
        ),
        (
            not_pem.to_str().unwrap(),
            not_pem.to_str().unwrap(),
            "cert.pem: no PEM certificate in the file",
        ),
        (
            "/nonexistent/cert.pem",
            "/nonexistent/key.pem",
            "--grpc-tls-cert /nonexistent/cert.pem: cannot read",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([
                "run",
                "--policy",
                policy.to_str().unwrap(),
                "--admin-listen",
                &admin,
            ])
            .args([
                "--grpc-listen",
                &listen,
                "--grpc-tls-cert",
                cert,
                "--grpc-tls-key",
                key,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{err}");
    }
}
