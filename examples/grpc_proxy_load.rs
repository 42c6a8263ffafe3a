//! Unary gRPC load through a proxy, for the fair comparison of gRPC proxying
//! (`benches/grpc-proxy.sh`): `serve ADDR` runs the echo server of the proxy's gRPC tests
//! (`tests/support/grpc_echo.rs`, tonic); `load ADDR CONCURRENCY SECONDS [PID]` keeps
//! `CONCURRENCY` unary `Say` calls in flight on one HTTP/2 (h2c) connection for `SECONDS`, then
//! prints calls/s, latency percentiles and, given the proxy's PID, its CPU µs per call from
//! /proc/PID/stat (`common/load_report.rs`).
//!
//! cargo run --profile perf --example grpc_proxy_load -- serve 127.0.0.1:50051
//! cargo run --profile perf --example grpc_proxy_load -- load 127.0.0.1:8080 16 10 PID

// A measuring tool: a panic is how it reports a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/support/grpc_echo.rs"]
#[allow(dead_code)]
mod grpc_echo;

#[path = "common/load_report.rs"]
mod load_report;

use grpc_echo::{EchoClient, EchoServer};
use load_report::cpu_ticks;
use std::time::{Duration, Instant};

async fn load(addr: std::net::SocketAddr, concurrency: usize, seconds: u64, pid: Option<String>) {
    let client = EchoClient::h2c(addr).await;
    // Warm-up.
    let mut warm = client.clone();
    for _ in 0..1000 {
        warm.say("warm").await.expect("call");
    }
    let before = pid.as_deref().and_then(cpu_ticks);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(1 << 16);
                while Instant::now() < deadline {
                    let sent = Instant::now();
                    client.say("ping").await.expect("call");
                    latencies.push(sent.elapsed().as_nanos() as u64);
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
    load_report::print(all, elapsed, (before, after), "proxy");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let addr = args
        .get(2)
        .and_then(|a| a.parse().ok())
        .expect("an address");
    match args.get(1).map(String::as_str) {
        Some("serve") => runtime.block_on(async move {
            EchoServer::default().serve(addr, None, true).await;
            std::future::pending::<()>().await;
        }),
        Some("load") => {
            let concurrency = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(16);
            let seconds = args.get(4).and_then(|a| a.parse().ok()).unwrap_or(10);
            runtime.block_on(load(addr, concurrency, seconds, args.get(5).cloned()));
        }
        _ => panic!("usage: grpc_proxy_load serve ADDR | load ADDR CONCURRENCY SECONDS [PID]"),
    }
}
