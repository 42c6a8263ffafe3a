//! tollgate: an edge API gateway that enforces rate limits, quotas and kill switches written as
//! versioned JSON policy bundles.
//!
//! Layers, bottom up (a module uses only its own layer or lower ones):
//!
//! ```text
//! L3  cli, simulate                config and commands
//! L2  engine, headers              policies + store + clock → Decision → HTTP headers
//! L1  store                        bucket state (embedded bounded map; the first I/O layer)
//! L0  clock, policy, descriptor,   pure core: no I/O, no async
//!     limiter, client_addr, redact
//! ```

pub mod auth;
pub mod cli;
pub mod client_addr;
pub mod clock;
pub mod config;
pub mod descriptor;
pub mod engine;
pub mod headers;
pub mod limiter;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod redact;
pub mod service;
pub mod simulate;
pub mod store;
