//! Policy bundles: the validated, compiled form the engine runs on.
//!
//! `load` reads and parses bundle files, `compile` turns JSON into these structs once; nothing downstream re-checks a value. The
//! runtime never sees JSON: rates are [`Quota`](crate::limits::limiter::Quota)s, descriptors are parsed, names are unique.

pub mod import;

pub(crate) mod bundle;
pub(crate) mod compile;
pub(crate) mod error;
pub mod index;
pub(crate) mod json;
pub mod key_origin;
pub mod key_overrides;
mod load;
pub(crate) mod rule;

pub use bundle::{release_parse_memory, Bundle, RuntimeOverride, SkippedPolicy};
pub use compile::key_override::{
    compile_key_override, key_quota_table, read_key_override, rule_of, OverrideRefused,
};
pub use compile::{compile_bundle, compile_bundle_with, CompileOptions};
pub use error::{FieldError, PolicyError};
pub use load::{
    load_current, load_file, load_file_with, parse_bundle, parse_bundle_with, sha256_hex,
};
pub use rule::{
    path_has_prefix, push_sf_string, Breaker, Concurrency, CostLimits, CostSource, Guard,
    KillSwitch, LlmLimit, LlmPart, LoopAction, LoopDetection, MatchCondition, MatchValue, Mode,
    OnMissing, OnStoreError, Policy, Rule, RuleKind, Selector, ENVOY_OVERRIDE_RULE,
};
