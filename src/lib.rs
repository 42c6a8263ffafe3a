//! tollgate: an edge API gateway that enforces rate limits, quotas and kill switches written as
//! versioned JSON policy bundles.
//!
//! Layers, bottom up (a module uses only its own layer or lower ones):
//!
//! ```text
//! L4  proxy/                       Pingora glue: reverse proxy, upstream groups (balancers,
//!                                  health checks), connection guard, admin/decision listener,
//!                                  server and background tasks (the only Pingora code)
//!     grpc                         tonic glue: Envoy's RateLimitService and ext_authz (the only
//!                                  gRPC server code)
//! L3  cli, config, simulate,       flags → Config; commands; the running gateway: one
//!     service, import, routes,     `Gateway::decide` for the proxy, the decision service and
//!     tls, access_log, telemetry   ext_authz; envoyproxy/ratelimit import; the gateway file;
//!                                  edge certificates (rustls only); access-log lines;
//!                                  OpenTelemetry traces (own span records, OTLP by hand,
//!                                  exported over a tonic or hyper client)
//! L2  engine, limits, rls,         pure engine: bundle + facts + time → plan (each limit
//!     headers, metrics, auth       kind plans its rules in its `limits` module); plan + store
//!                                  answer → Decision (an enum carrying names and quotas);
//!                                  Decided (decision + request) → HTTP headers; counters; JWT
//! L1  store, fs_trust              one `Store`: embedded (synchronous) or Redis / PostgreSQL
//!                                  (awaited), with its own time base, stats and sweep; who
//!                                  may write the state dir and the upgrade socket's directory
//! L0  clock, policy, descriptor,   pure core: no network, no async (the policy loader reads
//!     limiter, budget,             its file) — time, compiled bundles, request facts and
//!     client_addr, redact,         keys, token-bucket and window maths, budget windows and
//!     log_value, forwarding        stages, the client address, redaction, the escaping of
//!                                  values in text log lines, forwarding headers and a
//!                                  route's header rules
//! ```
//!
//! One exception, on purpose: a limit kind's module under `limits` holds both halves of its
//! kind, the compiling half (an `impl` of `policy`'s compiler, L0 code that only reads JSON)
//! and the planning half (L2), so that a kind is found, and added, in one file.
//!
//! A request goes `proxy` → `RequestFacts::new` → `Gateway::decide` → `engine::plan` →
//! `Store` → `engine::finish` → `Gateway::answer` (`headers::build` / `Metrics::record` / the
//! log line / the top list, all from one `Decided`) → back to `proxy`, each step reading only
//! what the previous one handed it.

pub mod access_log;
pub mod auth;
pub mod budget;
pub mod cli;
pub mod client_addr;
pub mod clock;
pub mod compat;
pub mod config;
pub mod descriptor;
pub mod engine;
pub mod fleet;
pub mod forwarding;
pub mod fs_trust;
pub mod grpc;
pub mod handover;
pub mod headers;
pub mod import;
pub mod limiter;
pub mod limits;
pub mod llm;
pub mod llm_encoding;
pub mod log_line;
pub mod log_value;
pub mod metrics;
pub mod network;
pub mod operator;
pub mod policy;
pub mod proxy;
pub mod redact;
pub mod reservation_token;
pub mod rls;
pub mod routes;
pub mod service;
pub mod simulate;
pub mod store;
pub mod telemetry;
pub mod tls;
