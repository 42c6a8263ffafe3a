//! Envoy's RateLimitService on the gateway: a `ShouldRateLimit` call's descriptors planned by
//! [`crate::engine::rls`], one store call (after a peek when a descriptor only checks), the merged
//! decision counted, logged and turned into headers.

use super::gateway::Gateway;
use super::logging::log_decision;
use crate::engine::headers::{self, Response};
use crate::engine::rls::{self, DescriptorStatus, RlsError, RlsRequest, StoreAnswer};
use crate::engine::{Decided, RequestView};
use crate::store::OpResults;
use std::net::IpAddr;
use std::time::Instant;

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

impl Gateway {
    /// Answers an Envoy `ShouldRateLimit` call ([`crate::engine::rls`]): every descriptor's buckets in
    /// one store call (after a peek when a descriptor only checks), one status per
    /// descriptor, the merged decision counted, logged and turned into headers. A store that
    /// does not answer leaves each rule to its `on_store_error` (counted), unless
    /// `store_errors_fail_open` is false: then the call is answered `UNAVAILABLE`, for Envoy's
    /// own `failure_mode_deny` to decide.
    ///
    /// # Errors
    /// A malformed call, no policy loaded, or (when not failing open) a store failure.
    pub async fn should_rate_limit(
        &self,
        request: &RlsRequest,
        store_errors_fail_open: bool,
    ) -> Result<RlsReply, RlsFailure> {
        let started = Instant::now();
        let Some(bundle) = self.policy.load_full() else {
            return Err(RlsFailure::NoPolicy);
        };
        let unix_us = self.clock.unix_us();
        let plan = rls::plan(&bundle, request, unix_us, self.engine_config)
            .map_err(RlsFailure::Invalid)?;
        let now_us = self.store.now_us();
        let mut peek = OpResults::new();
        let mut results = OpResults::new();
        // Which store calls ran: none (no ops), the peek only, the peek then the spend, the
        // spend alone, or one that failed.
        enum Ran {
            Nothing,
            PeekOnly,
            PeekThenSpend,
            Spend,
            Failed,
        }
        let ran = if plan.ops().is_empty() {
            Ran::Nothing
        } else if plan.needs_peek() {
            match self.store.apply(now_us, &plan.peek_ops(), &mut peek).await {
                Err(_) => Ran::Failed,
                Ok(()) if plan.refused_by_peek(&peek) || plan.spends_nothing() => Ran::PeekOnly,
                Ok(()) => match self.store.apply(now_us, plan.ops(), &mut results).await {
                    Ok(()) => Ran::PeekThenSpend,
                    Err(_) => Ran::Failed,
                },
            }
        } else {
            match self.store.apply(now_us, plan.ops(), &mut results).await {
                Ok(()) => Ran::Spend,
                Err(_) => Ran::Failed,
            }
        };
        let call_failed = matches!(ran, Ran::Failed);
        let answer = match ran {
            Ran::Failed => StoreAnswer::Failed,
            Ran::PeekOnly => StoreAnswer::PeekOnly(&peek),
            Ran::PeekThenSpend => StoreAnswer::Spent {
                peek: Some(&peek),
                results: &results,
            },
            Ran::Nothing | Ran::Spend => StoreAnswer::Spent {
                peek: None,
                results: &results,
            },
        };
        let outcome = plan.finish(answer, now_us);
        // Decided without the store (its call failed, or a rule's `on_store_error` decided).
        let store_failed = call_failed || outcome.decision.store_error();
        if self.has_candidate() {
            self.candidate_rls(request, unix_us);
        }
        self.metrics
            .record(&outcome.decision, started.elapsed().as_secs_f64());
        if store_failed && !store_errors_fail_open {
            return Err(RlsFailure::StoreUnavailable);
        }
        let client_ip = request.descriptors.iter().find_map(|d| {
            d.entries
                .iter()
                .find(|(k, _)| k == "remote_address")
                .and_then(|(_, v)| v.parse::<IpAddr>().ok())
        });
        let over_limit = outcome.over_limit();
        let decided = Decided {
            decision: outcome.decision,
            request: RequestView {
                client_ip,
                host: Some(&request.domain),
                path: "/",
                ..RequestView::default()
            },
        };
        let response = headers::build(&decided, &self.header_config);
        log_decision(&decided, response.status);
        Ok(RlsReply {
            over_limit,
            statuses: outcome.statuses,
            response,
        })
    }
}
