//! One module per limit kind: each compiles its own wire fields (as `impl Compiler` blocks
//! beside `policy::compile`, which keeps what every rule shares: selectors, `match`,
//! keys, modes, kill switches) and, where its planning differs from a plain bucket, plans a
//! request under it for the engine ([`crate::engine`] keeps what is common: selection, kill
//! switches, all-or-nothing commit, shadow).
//!
//! - [`token_bucket`]: bucket shapes and request costs, shared by every bucketed kind;
//! - [`budget`]: `cost_based` budgets and their stages;
//! - [`concurrency`]: in-flight caps;
//! - [`llm`]: `token_bucket_llm` token budgets (compile and plan);
//! - [`guards`]: loop detection and circuit breakers (compile and plan).

pub mod budget;
pub mod concurrency;
pub mod guards;
pub mod llm;
pub mod token_bucket;
