//! gRPC APIs behind the reverse proxy, with a real gRPC client and server (tonic; the echo
//! service of `support/grpc_echo.rs`): all four call kinds through the proxy to an HTTP/2
//! upstream group, over h2c and over TLS on both sides; trailers relayed; refusals read by the
//! client as `RESOURCE_EXHAUSTED` with `RetryInfo` and `QuotaFailure`; per-method limits
//! (`grpc:method`); per-message limits (`grpc:message`) cutting a stream cleanly, the messages
//! before the cut reaching the upstream exactly once; the gRPC health check.

use crate::support;
use prost::Message;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use support::grpc_echo::{EchoClient, EchoServer};
use support::{free_port, Gateway};
use tonic::Code;

/// Nothing limited that the pass-through tests would reach.
const OPEN_POLICY: &str = r#"{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"],
  "algorithm": "token_bucket", "algorithm_config": {"rps": 1000, "burst": 1000}}]}"#;

/// `Say` 3 calls an hour per method; every method 3 request messages an hour.
const LIMITS: &str = r#"{"rules": [
  {"name": "say-per-method", "limit_keys": ["grpc:service", "grpc:method"],
   "match": {"grpc:method": "Say"},
   "algorithm": "token_bucket", "algorithm_config": {"count": 3, "period": "1h", "burst": 3}},
  {"name": "messages-per-method", "limit_keys": ["grpc:message"],
   "match": {"grpc:method": "Chat"},
   "algorithm": "token_bucket", "algorithm_config": {"count": 3, "period": "1h", "burst": 3}},
  {"name": "collect-messages", "limit_keys": ["grpc:message"],
   "match": {"grpc:method": "Collect"},
   "algorithm": "token_bucket", "algorithm_config": {"count": 4, "period": "1h", "burst": 4}}
]}"#;

fn tls_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(tls_fixture(name)).unwrap()
}

/// A gateway file with one group of `servers` speaking `protocol` (with TLS for h2), every
/// request routed to it.
fn routes(dir: &Path, servers: &[SocketAddr], group: &str) -> PathBuf {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    let text = format!(
        r#"{{"upstreams": {{"rpc": {{"servers": [{}], {group}}}}}, "default_upstream": "rpc"}}"#,
        list.join(", ")
    );
    let path = dir.join("routes.json");
    std::fs::write(&path, text).unwrap();
    path
}

/// An echo server on a free port (TLS with the `api` certificate when `tls`).
async fn echo(tls: bool, serving: bool) -> (EchoServer, SocketAddr) {
    let server = EchoServer::default();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let identity = tls.then(|| (read("api.pem"), read("api.key")));
    server.serve(addr, identity, serving).await;
    (server, addr)
}

/// A gateway in front of an h2c group: the client speaks h2c to it.
fn h2c_gateway(policy: &str, upstream: SocketAddr, dir: &Path) -> Gateway {
    let routes = routes(dir, &[upstream], r#""protocol": "h2c""#);
    Gateway::start(
        Some(policy),
        None,
        &[
            "--routes",
            routes.to_str().unwrap(),
            "--h2c",
            "--access-log",
            "json",
        ],
    )
}

/// Every call kind, with its trailers: unary, a unary call ending in an error status, server
/// streaming (and one ending `ABORTED` after its notes: trailers after data), client streaming
/// and bidirectional.
async fn assert_all_call_kinds(client: &mut EchoClient, server: &EchoServer) {
    assert_eq!(client.say("hello").await.unwrap().text, "hello");
    let failed = client.say("fail").await.unwrap_err();
    assert_eq!(failed.code(), Code::NotFound);
    assert_eq!(failed.message(), "no note called fail");
    let (notes, end) = client.count("tick", 3).await;
    let texts: Vec<&str> = notes.iter().map(|n| n.text.as_str()).collect();
    assert_eq!(texts, ["tick 1", "tick 2", "tick 3"]);
    assert!(end.is_ok(), "{end:?}");
    let (notes, end) = client.count("abort", 2).await;
    assert_eq!(notes.len(), 2);
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(status.message(), "counting aborted");
    let collected = client.collect(&["a", "b", "c"]).await.unwrap();
    assert_eq!((collected.text.as_str(), collected.n), ("a,b,c", 3));
    let (echoed, end) = client.chat(&["x", "y", "z"]).await;
    assert_eq!(echoed, ["x", "y", "z"]);
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(
        server.received(),
        ["hello", "fail", "tick", "abort", "a", "b", "c", "x", "y", "z"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_kind_passes_through_over_h2c() {
    let (server, upstream) = echo(false, true).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = h2c_gateway(OPEN_POLICY, upstream, dir.path());
    let mut client = EchoClient::h2c(gw.proxy).await;
    assert_all_call_kinds(&mut client, &server).await;
    // 100 unary calls at once share the upstream's pooled HTTP/2 connections.
    let calls: Vec<_> = (0..100)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move { c.say(&format!("m{i}")).await.map(|n| n.text) })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), format!("m{i}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_kind_passes_through_over_tls() {
    let (server, upstream) = echo(true, true).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = tls_fixture("ca.pem");
    let group = format!(
        r#""protocol": "h2", "tls": {{"sni": "localhost", "ca_file": "{}"}}"#,
        ca.display()
    );
    let routes = routes(dir.path(), &[upstream], &group);
    let (cert, key) = (tls_fixture("api.pem"), tls_fixture("api.key"));
    let gw = Gateway::start(
        Some(OPEN_POLICY),
        None,
        &[
            "--routes",
            routes.to_str().unwrap(),
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let mut client = EchoClient::tls(gw.proxy, "localhost", &read("ca.pem")).await;
    assert_all_call_kinds(&mut client, &server).await;
}

/// The `google.rpc.Status` of a refused call: its code, its `RetryInfo` delay and the rule its
/// `QuotaFailure` names.
fn details(status: &tonic::Status) -> (i32, Option<i64>, Vec<String>) {
    use tollgate::engine::grpc_status as g;
    let decoded = g::RpcStatus::decode(status.details()).unwrap();
    let mut delay = None;
    let mut subjects = Vec::new();
    for any in &decoded.details {
        match any.type_url.as_str() {
            g::RETRY_INFO_TYPE => {
                delay = g::RetryInfo::decode(any.value.as_slice())
                    .unwrap()
                    .retry_delay
                    .map(|d| d.seconds);
            }
            g::QUOTA_FAILURE_TYPE => subjects.extend(
                g::QuotaFailure::decode(any.value.as_slice())
                    .unwrap()
                    .violations
                    .into_iter()
                    .map(|v| v.subject),
            ),
            other => panic!("unexpected detail {other}"),
        }
    }
    (decoded.code, delay, subjects)
}

/// A per-method limit: the fourth `Say` is refused as `RESOURCE_EXHAUSTED`, its `RetryInfo`
/// the `Retry-After` it carries, its `QuotaFailure` naming the rule; it never reaches the
/// upstream; another method is not limited by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_reads_resource_exhausted_with_its_retry_delay() {
    let (server, upstream) = echo(false, true).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = h2c_gateway(LIMITS, upstream, dir.path());
    let mut client = EchoClient::h2c(gw.proxy).await;
    for i in 0..3 {
        client.say(&format!("s{i}")).await.unwrap();
    }
    let refused = client.say("s3").await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(refused.message(), "Too Many Requests");
    let retry_after: i64 = refused
        .metadata()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1);
    let (code, delay, subjects) = details(&refused);
    assert_eq!(code, 8);
    assert_eq!(delay, Some(retry_after));
    assert_eq!(subjects, ["rule:say-per-method"]);
    // Other methods have their own keys.
    let (notes, end) = client.count("c", 2).await;
    assert_eq!((notes.len(), end.is_ok()), (2, true));
    assert_eq!(server.received(), ["s0", "s1", "s2", "c"]);
    // The refusal counted, by reason; the calls by method and status.
    assert_eq!(
        gw.metric_sum(
            "tollgate_requests_total",
            &["action=\"reject\"", "reason=\"token_bucket_exceeded\""]
        ),
        1.0
    );
    let calls = |method: &str, code: &str| {
        gw.metric_sum(
            "tollgate_proxied_grpc_calls_total",
            &[
                "rpc_service=\"echo.v1.Echo\"",
                &format!("rpc_method=\"{method}\""),
                &format!("rpc_grpc_status_code=\"{code}\""),
            ],
        )
    };
    assert_eq!(
        (calls("Say", "0"), calls("Say", "8"), calls("Count", "0")),
        (3.0, 1.0, 1.0)
    );
    // The access log names the method and the status of each call.
    gw.wait_until(std::time::Duration::from_secs(5), || {
        gw.stdout_text().lines().count() == 5
    });
    let lines: Vec<serde_json::Value> = gw
        .stdout_text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Each line is written when its call ends: found by content, not by position.
    let refused = lines.iter().find(|l| l["verdict"] != "allow").unwrap();
    assert_eq!(refused["status"], 200);
    assert_eq!(refused["verdict"], "token_bucket_exceeded");
    assert_eq!(refused["rule"], "say-per-method");
    assert_eq!(refused["rpc.service"], "echo.v1.Echo");
    assert_eq!(refused["rpc.method"], "Say");
    assert_eq!(refused["rpc.grpc.status_code"], 8);
    let count = lines.iter().find(|l| l["rpc.method"] == "Count").unwrap();
    assert_eq!(count["rpc.grpc.status_code"], 0);
}

/// Per-message limits: a bidirectional call is cut at its fourth request message, with
/// `RESOURCE_EXHAUSTED` and its delay in the trailers after the three echoes; a
/// client-streaming call at its fifth. The messages before the cut reached the upstream once
/// each, in order, and none after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_limits_cut_a_stream_cleanly() {
    let (server, upstream) = echo(false, true).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = h2c_gateway(LIMITS, upstream, dir.path());
    let mut client = EchoClient::h2c(gw.proxy).await;
    let (echoed, end) = client.chat(&["m1", "m2", "m3", "m4", "m5"]).await;
    assert_eq!(echoed, ["m1", "m2", "m3"]);
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    let (code, delay, subjects) = details(&status);
    assert_eq!(code, 8);
    assert!(delay.is_some_and(|d| d >= 1), "{delay:?}");
    assert_eq!(subjects, ["rule:messages-per-method"]);
    assert_eq!(server.received(), ["m1", "m2", "m3"]);
    // The next call finds the bucket spent: refused at its first message, before any reaches
    // the upstream.
    let (echoed, end) = client.chat(&["again"]).await;
    assert!(echoed.is_empty());
    assert_eq!(end.unwrap_err().code(), Code::ResourceExhausted);
    // A client stream of six notes, sent as fast as the client writes them: four go on.
    let refused = client
        .collect(&["c1", "c2", "c3", "c4", "c5", "c6"])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    let received = server.received();
    assert_eq!(received[3..], ["c1", "c2", "c3", "c4"]);
    // Unary and server-streaming calls carry one message each, not counted by these rules.
    assert_eq!(client.say("after").await.unwrap().text, "after");
}

/// `"health": "grpc"`: a server whose health service says `NOT_SERVING` is taken out; every
/// call goes to the serving one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_health_check_takes_a_not_serving_server_out() {
    let (serving, up) = echo(false, true).await;
    let (not_serving, down) = echo(false, false).await;
    let dir = tempfile::tempdir().unwrap();
    let routes = routes(
        dir.path(),
        &[up, down],
        r#""protocol": "h2c", "health": "grpc",
           "health_check": {"interval_ms": 100, "timeout_ms": 1000}"#,
    );
    let gw = Gateway::start(
        Some(OPEN_POLICY),
        None,
        &["--routes", routes.to_str().unwrap(), "--h2c"],
    );
    // Until the first round of checks, both servers take calls (round-robin); once four calls
    // in a row all went to the serving one, the other is out.
    let mut client = EchoClient::h2c(gw.proxy).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let before = not_serving.received().len();
        for i in 0..4 {
            client.say(&format!("w{i}")).await.unwrap();
        }
        if not_serving.received().len() == before {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never taken out");
    }
    let (taken_by_serving, taken_by_other) =
        (serving.received().len(), not_serving.received().len());
    for i in 0..6 {
        client.say(&format!("h{i}")).await.unwrap();
    }
    assert_eq!(serving.received().len(), taken_by_serving + 6);
    assert_eq!(not_serving.received().len(), taken_by_other);
}

/// The decision service, asked about a gRPC call: its refusal stays a 429 (its callers read any
/// 2xx as "forward it") and carries `grpc-status: 8`, `grpc-message` and the details, for the
/// gateway in front to answer its client with.
#[test]
fn the_decision_service_says_what_a_grpc_client_should_read() {
    use base64::Engine as _;
    let gw = Gateway::start(Some(LIMITS), None, &[]);
    let ask = || {
        support::request(
            gw.admin,
            "POST",
            "/v1/decision",
            &[
                ("X-Original-URI", "/echo.v1.Echo/Say"),
                ("X-Original-Method", "POST"),
                ("Content-Type", "application/grpc"),
            ],
        )
    };
    for _ in 0..3 {
        let allowed = ask();
        assert_eq!(allowed.status, 200);
        assert_eq!(allowed.header("grpc-status"), None);
    }
    let refused = ask();
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("grpc-status"), Some("8"));
    assert_eq!(refused.header("grpc-message"), Some("Too Many Requests"));
    let bin = refused.header("grpc-status-details-bin").unwrap();
    let bytes = base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(bin)
        .unwrap();
    let status = tonic::Status::with_details(Code::ResourceExhausted, "", bytes.into());
    let retry_after: i64 = refused.header("retry-after").unwrap().parse().unwrap();
    let (code, delay, subjects) = details(&status);
    assert_eq!((code, delay), (8, Some(retry_after)));
    assert_eq!(subjects, ["rule:say-per-method"]);
}
