//! Every integration test, in one test binary (`cargo test --test integration`): each file
//! beside this one is a module of it, and `support/` is compiled once for all of them. One binary
//! instead of one per file links the crate once, which keeps the debug `target/` and the CI run
//! small. `cargo test --test integration gateway::` runs one file's tests.
//!
//! Tests may unwrap and expect: a panic is how a test fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

mod admin_scopes;
mod admitted_bytes;
mod audit;
mod candidate;
mod cli;
mod compat;
mod deploy;
mod docs;
mod edge;
mod envoy;
mod failover;
mod fleet;
mod gateway;
mod grpc;
mod grpc_proxy;
mod hostile;
mod http_defaults;
mod jwt;
mod layers;
mod limits;
mod llm;
mod llm_spend;
mod log_values;
mod network;
mod nginx;
mod operator;
mod outage;
mod overrides;
mod pacing;
mod policy_store;
mod postgres;
mod redis;
mod refusal_bytes;
mod response_rules;
mod routes;
mod skew;
mod startup;
mod state;
mod status_and_masks;
mod telemetry;
mod tls;
mod upstream;
mod usage;
mod vendor;
mod walkthroughs;
mod webhooks;
