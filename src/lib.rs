//! tollgate: an edge API gateway that enforces rate limits, quotas and kill switches written as
//! versioned JSON policy bundles.
//!
//! The source is one folder per concept. Layers, bottom up: a folder's files use files of their
//! own layer or lower ones (the one exception, on purpose: a limit kind's compile half, which
//! `policy/compile` calls, lives with its plan half in `limits/`), and no files import each
//! other around a circle. `scripts/import-circles.py` reads the map below (folder → layer) and
//! counts the imports: it fails on a circle and on an import that climbs a layer, save the
//! exceptions it lists with their reasons; `tests/layers.rs` runs it.
//!
//! ```text
//! request/    L0     what a request is: its facts and descriptors, the client's address
//!                    behind trusted proxies, network facts (CIDR lists, ASN, country), the
//!                    forwarding headers, JWT claims (auth), an LLM request's tokens
//! policy/     L0     the bundle: JSON → compiled rules (each kind's compile half lives with
//!                    its kind in limits/), the index, loading, the envoyproxy/ratelimit import
//! limits/     L0-L2  time (clock), token-bucket and window maths (limiter), budget windows,
//!                    and one module per limit kind: its compile half (L0, reads JSON) and its
//!                    plan half (L2), so that a kind is found, and added, in one file
//! store/      L1     one `Store`: embedded (synchronous) or Redis / PostgreSQL (awaited), with
//!                    its own time base, stats and sweep; state files; who may write the state
//!                    dir and the upgrade socket's directory (fs_trust)
//! engine/     L2     bundle + facts + time → plan (planning vocabulary below the kinds); plan +
//!                    store answer → Decision; Decided → HTTP headers; the rate-limit service's
//!                    mapping; reservation tokens; Fairvisor compatibility; `simulate`
//! telemetry/  L0-L3  metrics, the access log and log lines (values escaped, secrets redacted),
//!                    the audit trail of operator writes, OpenTelemetry traces (own span
//!                    records, OTLP by hand)
//! config/     L3     flags (cli) → Config, resolved in one place (resolve) with typed
//!                    errors naming their flags; edge certificates (tls); the route file
//! service/    L3     the running gateway: `Gateway` and its one `decide` for the proxy, the
//!                    decision service and ext_authz; its components (reload, follow state,
//!                    tokens, debug sessions, candidate), each a type of its own
//! operator/   L3     the operator endpoints' work: admin token, scoped tokens and the scope
//!                    each endpoint needs, buckets, status, top list
//! fleet/      L3     publish, promote, rollback; policy sources and signed envelopes
//! proxy/      L4     Pingora and tonic glue (the only code naming them): reverse proxy,
//!                    upstream groups, connection guard, admin listener, Envoy's gRPC services
//!                    (grpc), every listener bound before start (bind), listener handover
//!                    on upgrade (handover)
//! ```
//!
//! A request goes `proxy` → `RequestFacts::new` → `Gateway::decide` → `engine::plan` →
//! `Store` → `engine::finish` → `Gateway::answer` (`headers::build` / `Metrics::record` / the
//! log line / the top list, all from one `Decided`) → back to `proxy`, each step reading only
//! what the previous one handed it.

pub mod config;
pub mod engine;
pub mod fleet;
pub mod limits;
pub mod operator;
pub mod policy;
pub mod proxy;
pub mod request;
pub mod service;
pub mod store;
pub mod telemetry;
