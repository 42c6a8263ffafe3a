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

fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

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
        all.sort_unstable();
        let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)] as f64 / 1e3;
        print!(
            "calls {} calls/s {:.0} p50 {:.0} µs p99 {:.0} µs p99.9 {:.0} µs",
            all.len(),
            all.len() as f64 / elapsed,
            pct(0.50),
            pct(0.99),
            pct(0.999)
        );
        if let (Some(b), Some(a)) = (before, after) {
            // SAFETY: sysconf has no preconditions.
            let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
            let cpu_s = (a - b) as f64 / hz;
            print!(
                " server CPU µs/call {:.2} server cores busy {:.2}",
                cpu_s * 1e6 / all.len() as f64,
                cpu_s / elapsed
            );
        }
        println!();
    });
}
