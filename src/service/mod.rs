//! The running gateway, independent of Pingora: [`Gateway`] (in `gateway`: its state and its
//! own methods, the one request path shared by the reverse proxy and the decision service,
//! Envoy's `ShouldRateLimit`, putting a bundle in force, `/readyz`) and its components, each a
//! type of its own in its own file: `reload` ([`Reload`]: the watched files and the network
//! data they give, by [`Trigger`]), `source_state` ([`FollowState`]: what the policy-store
//! follower of `follow` knows), `tokens` ([`Tokens`]: LLM reservations held and settled),
//! `penalties` ([`Penalties`]: response charges settled, penalty boxes counted),
//! `debug_sessions` ([`DebugSessionDesk`]: Fairvisor's debug sessions) and `candidate`
//! ([`CandidateShadow`]: the candidate bundle decided in shadow after every live decision).
//! `debug_sessions` ([`DebugSessionDesk`]: Fairvisor's debug sessions), `candidate`
//! ([`CandidateShadow`]: the candidate bundle decided in shadow after every live decision) and
//! `pacing` ([`Pacer`]: the requests a `delay` rule makes wait, and their tokens), `usage`
//! ([`usage::UsageDesk`]: budget spend noted for `GET /v1/usage`) and `webhooks`
//! ([`webhooks::Webhooks`]: `notify_at` shares claimed once for the fleet and delivered).
//!
//! Beside them: `answer` (what a front end acts on), `described` (a request another gateway
//! describes), `envoy_rls` (a `ShouldRateLimit` call's store calls and answer), `logging` (the
//! subscriber, the redacting bridge for Pingora's records, the `RATE_LIMIT` lines), `state_key`
//! (the state dir's own keys: masked values' fingerprints, reservation signing), `loaded` (the
//! bundle in force as `/readyz` reports it, watched files' signatures) and `shadow` (the
//! candidate in force and its counters). Files import downwards only: the components know
//! nothing of the gateway, `gateway` holds them, and `follow` drives a gateway from above. A
//! child names the sibling that defines what it uses, never this file.

mod answer;
mod candidate;
mod debug_sessions;
mod described;
mod envoy_rls;
pub mod follow;
mod gateway;
mod loaded;
mod logging;
mod overrides;
mod pacing;
mod penalties;
mod reload;
mod shadow;
mod source_state;
pub mod state_key;
mod tokens;
pub mod usage;
pub mod webhooks;

pub use answer::{Answer, Verdict};
pub use candidate::{CandidateShadow, CandidateSummary, MAX_CANDIDATE_PENDING};
pub use debug_sessions::{DebugLogin, DebugSessionDesk};
pub use described::{Described, DescribedBody, HttpHeaders, X_FORWARDED_FOR, X_REAL_IP};
pub use envoy_rls::{RlsFailure, RlsReply};
pub use gateway::{Gateway, StartError};
pub use loaded::LoadedPolicy;
pub use logging::init_logging;
pub use overrides::{OverrideChange, OverrideError, Overrides, REFRESH_EVERY};
pub use pacing::{Pace, Pacer, Waited, DRAIN_SERVE_WITHIN};
pub use penalties::Penalties;
pub use reload::{NetworkLoadError, Reload, Trigger};
pub use source_state::FollowState;
pub use tokens::Tokens;
