//! ghz-style load for the gRPC rate-limit service: `CONCURRENCY` calls in flight on one HTTP/2
//! connection (as one Envoy worker keeps one), for `SECONDS`, each `ShouldRateLimit` with one
//! `remote_address` descriptor (1 024 addresses in turn). Prints calls/s, latency percentiles,
//! and, given the server's PID, the server's CPU µs per call from /proc/PID/stat.
//!
//! cargo run --profile perf --example rls_load -- 127.0.0.1:8081 16 10 [PID]
//! (benches/grpc.sh runs it against a pinned tollgate.)

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::time::{Duration, Instant};

#[path = "common/load_report.rs"]
mod load_report;
use load_report::cpu_ticks;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let addr = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "127.0.0.1:8081".into());
    let concurrency: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(16);
    let seconds: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(10);
    let pid = args.get(4).cloned();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .expect("address")
            .connect()
            .await
            .expect("connect");
        let request = |i: usize| RateLimitRequest {
            domain: "bench".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "remote_address".into(),
                    value: format!("10.0.{}.{}", (i >> 8) & 3, i & 255),
                }],
                ..RateLimitDescriptor::default()
            }],
            hits_addend: 0,
        };
        // Warm-up.
        let mut client = RateLimitServiceClient::new(channel.clone());
        for i in 0..1000 {
            client.should_rate_limit(request(i)).await.expect("call");
        }
        let before = pid.as_deref().and_then(cpu_ticks);
        let started = Instant::now();
        let deadline = started + Duration::from_secs(seconds);
        let tasks: Vec<_> = (0..concurrency)
            .map(|t| {
                let mut client = RateLimitServiceClient::new(channel.clone());
                tokio::spawn(async move {
                    let mut latencies = Vec::with_capacity(1 << 16);
                    let mut i = t * 7919;
                    while Instant::now() < deadline {
                        let sent = Instant::now();
                        client.should_rate_limit(request(i)).await.expect("call");
                        latencies.push(sent.elapsed().as_nanos() as u64);
                        i += 1;
                    }
                    latencies
                })
            })
            .collect();
        let mut all = Vec::new();
        for task in tasks {
            all.extend(task.await.expect("task"));
        }
        let elapsed = started.elapsed().as_secs_f64();
        let after = pid.as_deref().and_then(cpu_ticks);
        load_report::print(all, elapsed, (before, after), "server");
    });
}
