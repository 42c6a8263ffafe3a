//! Envoy's RateLimitService on the gateway ([`super::Gateway::should_rate_limit`]): a
//! `ShouldRateLimit` call's descriptors planned by [`crate::engine::rls`], one store call (after
//! a peek when a descriptor only checks: [`StoreRun`]), the merged decision counted, logged and
//! turned into headers; what the call is answered with ([`RlsReply`]) or why not ([`RlsFailure`]).

use crate::engine::headers::Response;
use crate::engine::rls::{DescriptorStatus, RlsError, RlsPlan, StoreAnswer};
use crate::store::{OpResults, Store};

/// The answer to a `ShouldRateLimit` call.
#[derive(Debug)]
pub struct RlsReply {
    pub over_limit: bool,
    /// One per descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// The headers (`RateLimit`..., `Retry-After` when over the limit), status and body the
    /// client should get.
    pub response: Response,
}

/// Why a `ShouldRateLimit` call gets no answer.
#[derive(Debug, thiserror::Error)]
pub enum RlsFailure {
    #[error("{0}")]
    Invalid(RlsError),
    #[error("no policy loaded")]
    NoPolicy,
    #[error("the rate-limit store is unavailable")]
    StoreUnavailable,
}

/// Which store calls ran for a planned call: none (no ops), the peek only, the peek then the
/// spend, the spend alone, or one that failed.
enum Ran {
    Nothing,
    PeekOnly,
    PeekThenSpend,
    Spend,
    Failed,
}

/// The store calls of a planned `ShouldRateLimit` call and what they answered.
pub(super) struct StoreRun {
    peek: OpResults,
    results: OpResults,
    ran: Ran,
}

impl StoreRun {
    /// Runs `plan`'s store calls: a peek first when a descriptor only checks, then the spend
    /// unless the peek refused the call or nothing spends.
    pub(super) async fn run(store: &Store, plan: &RlsPlan<'_>, now_us: u64) -> StoreRun {
        let mut peek = OpResults::new();
        let mut results = OpResults::new();
        let ran = if plan.ops().is_empty() {
            Ran::Nothing
        } else if plan.needs_peek() {
            match store.apply(now_us, &plan.peek_ops(), &mut peek).await {
                Err(_) => Ran::Failed,
                Ok(()) if plan.refused_by_peek(&peek) || plan.spends_nothing() => Ran::PeekOnly,
                Ok(()) => match store.apply(now_us, plan.ops(), &mut results).await {
                    Ok(()) => Ran::PeekThenSpend,
                    Err(_) => Ran::Failed,
                },
            }
        } else {
            match store.apply(now_us, plan.ops(), &mut results).await {
                Ok(()) => Ran::Spend,
                Err(_) => Ran::Failed,
            }
        };
        StoreRun { peek, results, ran }
    }

    /// Whether a store call failed.
    pub(super) fn failed(&self) -> bool {
        matches!(self.ran, Ran::Failed)
    }

    /// What the store answered, for [`RlsPlan::finish`].
    pub(super) fn answer(&self) -> StoreAnswer<'_> {
        match self.ran {
            Ran::Failed => StoreAnswer::Failed,
            Ran::PeekOnly => StoreAnswer::PeekOnly(&self.peek),
            Ran::PeekThenSpend => StoreAnswer::Spent {
                peek: Some(&self.peek),
                results: &self.results,
            },
            Ran::Nothing | Ran::Spend => StoreAnswer::Spent {
                peek: None,
                results: &self.results,
            },
        }
    }
}
