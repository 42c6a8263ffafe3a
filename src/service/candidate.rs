//! The gateway's candidate component ([`CandidateShadow`]): the candidate bundle in shadow,
//! set, replaced and cleared by whoever follows the policy store ([`crate::service::Gateway::set_candidate`]),
//! decided after every live decision of the proxy, the decision service, ext_authz and Envoy's
//! RLS, and counted (`tollgate_candidate_*` in `/metrics`, the status page,
//! [`CandidateShadow::refusals`] for heartbeats). It never changes an answer, a header, a log
//! line, the live metrics or the top list.
//!
//! With the embedded store the candidate is decided on the request's thread, synchronously,
//! right after the live decision ([`crate::engine::candidate::decide_candidate_local`]). With a
//! shared store the candidate is planned there (pure) and its store calls go to a task of
//! their own: the request never waits for them. At most [`MAX_CANDIDATE_PENDING`] such calls
//! are outstanding; past that a request is not decided under the candidate, and counted in
//! `tollgate_candidate_skipped_total`.

use super::shadow::{Candidate, Counters};
use crate::engine::candidate::{decide_candidate_local, plan_candidate, CandidateBundle, Refusers};
use crate::engine::rls::{self, RlsRequest, StoreAnswer};
use crate::engine::{Decision, EngineConfig};
use crate::limits::clock::Clock;
use crate::policy::Bundle;
use crate::request::descriptor::RequestFacts;
use crate::store::lease::{next_lease_id, LeaseResults};
use crate::store::{Backend, OpResults, Store};
use crate::telemetry::metrics::CandidateMetrics;
use arc_swap::ArcSwapOption;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;

/// Most candidate store calls a shared store may have outstanding at once.
pub const MAX_CANDIDATE_PENDING: usize = 1024;

/// What the status page and `/readyz` show of the candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateSummary {
    pub version: String,
    pub hash: String,
    /// Unix seconds it was set at.
    pub set_at: i64,
    /// Requests decided under it since.
    pub decisions: u64,
    /// Requests not decided under it (too many shared-store calls outstanding).
    pub skipped: u64,
    /// Its rules that read their verdict from the live decision (unchanged from the live
    /// bundle), and its rules.
    pub shared_rules: usize,
    pub rules: usize,
    /// What it would have refused, by `policy/rule`.
    pub refusals: BTreeMap<String, u64>,
}

/// The hash a candidate is shown under: the SHA-256 of its text, as a published bundle is
/// known everywhere else (`tollgate fleet`, `/readyz`), or its internal hash when it was not
/// compiled from text.
fn shown_hash(bundle: &Bundle) -> &str {
    if bundle.sha256.is_empty() {
        &bundle.hash
    } else {
        &bundle.sha256
    }
}

/// Gives a slot back when a shared store's candidate call ends, however it ends.
struct PendingSlot(Arc<AtomicUsize>);

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The gateway's candidate component: the candidate in force (if any), whether one is set
/// (the request path's only look without one), its shared-store calls outstanding, and the
/// store, clock and counters it decides and counts with.
pub struct CandidateShadow {
    current: ArcSwapOption<Candidate>,
    on: AtomicBool,
    pending: Arc<AtomicUsize>,
    metrics: CandidateMetrics,
    store: Arc<Store>,
    clock: Arc<dyn Clock>,
    engine_config: EngineConfig,
}

impl CandidateShadow {
    /// No candidate, deciding (once one is set) on `store` with `engine_config`, counted in
    /// `metrics`.
    pub(super) fn new(
        metrics: CandidateMetrics,
        store: Arc<Store>,
        clock: Arc<dyn Clock>,
        engine_config: EngineConfig,
    ) -> CandidateShadow {
        CandidateShadow {
            current: ArcSwapOption::empty(),
            on: AtomicBool::new(false),
            pending: Arc::default(),
            metrics,
            store,
            clock,
            engine_config,
        }
    }

    /// Sets the candidate bundle decided in shadow beside `live` (the bundle in force), replaces
    /// it, or clears it (`None`). Its keys are named under `candidate:` (as
    /// [`crate::policy::CompileOptions::candidate`] compiles them; a bundle compiled without it
    /// is renamed here), so its buckets are its own. Its counts start from zero each time.
    pub(super) fn set(&self, candidate: Option<Bundle>, live: Option<Arc<Bundle>>) {
        let Some(mut bundle) = candidate else {
            self.on.store(false, Ordering::Release);
            self.current.store(None);
            self.metrics.set(None);
            return;
        };
        bundle.make_candidate();
        self.metrics
            .set(Some((&bundle.version, shown_hash(&bundle))));
        let counters = Arc::new(Counters {
            metrics: self.metrics.clone(),
            rules: bundle.rules.iter().map(|_| OnceLock::new()).collect(),
            kill_switches: bundle
                .kill_switches
                .iter()
                .map(|_| OnceLock::new())
                .collect(),
            set_at: self.clock.unix_secs(),
        });
        let bundle = CandidateBundle::new(Arc::new(bundle), live);
        self.current
            .store(Some(Arc::new(Candidate { bundle, counters })));
        self.on.store(true, Ordering::Release);
    }

    /// Compares the candidate to `live`, the bundle just installed (which of its rules read
    /// their verdict from the live decision); its counts go on.
    pub(super) fn follow_live(&self, live: Option<Arc<Bundle>>) {
        let Some(current) = self.current.load_full() else {
            return;
        };
        let bundle = current.bundle.beside(live);
        self.current.store(Some(Arc::new(Candidate {
            bundle,
            counters: Arc::clone(&current.counters),
        })));
    }

    /// What the candidate would have refused since it was set, by `policy/rule` (kill
    /// switches as `kill_switch/kill_switches[i]`); empty without a candidate.
    pub fn refusals(&self) -> BTreeMap<String, u64> {
        self.current
            .load()
            .as_deref()
            .map(Candidate::refusals)
            .unwrap_or_default()
    }

    /// The candidate's version and hash, while one is set.
    pub fn info(&self) -> Option<(String, String)> {
        self.current.load().as_deref().map(|c| {
            let bundle = c.bundle.bundle();
            (bundle.version.clone(), shown_hash(bundle).to_string())
        })
    }

    /// The candidate, its counts and what it would have refused, while one is set.
    pub fn summary(&self) -> Option<CandidateSummary> {
        let guard = self.current.load();
        let candidate = guard.as_deref()?;
        let bundle = candidate.bundle.bundle();
        Some(CandidateSummary {
            version: bundle.version.clone(),
            hash: shown_hash(bundle).to_string(),
            set_at: candidate.counters.set_at,
            decisions: candidate.counters.metrics.decisions.get(),
            skipped: candidate.counters.metrics.skipped.get(),
            shared_rules: candidate.bundle.shared_rules(),
            rules: bundle.rules.len(),
            refusals: candidate.refusals(),
        })
    }

    /// Whether the candidate reads the client's network (`ip:country`...): the request's
    /// network facts are then resolved even when the bundle in force reads none.
    pub(crate) fn uses_network(&self) -> bool {
        self.current
            .load()
            .as_deref()
            .is_some_and(|c| c.bundle.bundle().uses_network)
    }

    /// Whether a candidate is set (one atomic load: the request path's only cost without one).
    #[inline]
    pub(crate) fn is_set(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    /// After a live decision on the embedded store: the same request under the candidate, now.
    pub(super) fn after_local(
        &self,
        live: &Decision<'_>,
        facts: &RequestFacts<'_>,
        memory: &crate::store::MemoryStore,
        now_us: u64,
        unix_us: u64,
    ) {
        let guard = self.current.load();
        let Some(candidate) = guard.as_deref() else {
            return;
        };
        let refused = decide_candidate_local(
            &candidate.bundle,
            live,
            facts,
            memory,
            now_us,
            unix_us,
            self.engine_config,
        );
        candidate.count(&refused);
    }

    /// A bound on a shared store's outstanding candidate calls: a slot, or `None` (the request
    /// is skipped, and counted).
    fn slot(&self) -> Option<(PendingSlot, tokio::runtime::Handle)> {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let taken = self.pending.fetch_add(1, Ordering::AcqRel);
        let slot = PendingSlot(Arc::clone(&self.pending));
        match runtime {
            Some(runtime) if taken < MAX_CANDIDATE_PENDING => Some((slot, runtime)),
            _ => {
                self.metrics.skipped.inc();
                None
            }
        }
    }

    /// After a live decision on a shared store: the request planned under the candidate now
    /// (pure), and its store calls sent to a task of their own.
    pub(super) fn after_shared(&self, live: &Decision<'_>, facts: &RequestFacts<'_>, unix_us: u64) {
        let Some(candidate) = self.current.load_full() else {
            return;
        };
        let mut probe = plan_candidate(&candidate.bundle, live, facts, unix_us, self.engine_config);
        if probe.ops.is_empty() && probe.leases.is_empty() {
            candidate.count(probe.refused());
            return;
        }
        let Some((slot, runtime)) = self.slot() else {
            return;
        };
        let store = Arc::clone(&self.store);
        runtime.spawn(async move {
            let _slot = slot;
            let bundle = &**candidate.bundle.bundle();
            let now_us = store.now_us();
            let mut results = OpResults::new();
            if probe.leases.is_empty() {
                let answer = store.apply(now_us, &probe.ops, &mut results).await;
                probe.finish(bundle, answer.ok().map(|()| &results));
            } else {
                let id = next_lease_id();
                let mut taken = LeaseResults::new();
                let acquired = store
                    .acquire(now_us, id, &probe.leases, &mut taken)
                    .await
                    .is_ok();
                if probe.admit(bundle, acquired.then_some(&taken)) && !probe.ops.is_empty() {
                    let answer = store.apply(now_us, &probe.ops, &mut results).await;
                    probe.finish(bundle, answer.ok().map(|()| &results));
                }
                if acquired {
                    store.release(id, &probe.to_release(&taken)).await;
                }
            }
            candidate.count(probe.refused());
        });
    }

    /// After an Envoy `ShouldRateLimit` call: the same call under the candidate (its own
    /// buckets, never a peek: what it would refuse is what it counts), synchronously on the
    /// embedded store, in a task of its own on a shared one.
    pub(super) fn after_rls(&self, request: &RlsRequest, unix_us: u64) {
        let Some(candidate) = self.current.load_full() else {
            return;
        };
        let config = self.engine_config;
        if let Backend::Memory(_) = self.store.backend() {
            let refused = rls_refusals(&candidate, &self.store, request, unix_us, config);
            // The embedded store answers without suspending: the future is ready at once.
            if let Some(refused) = futures::FutureExt::now_or_never(refused) {
                candidate.count(&refused);
            }
            return;
        }
        let Some((slot, runtime)) = self.slot() else {
            return;
        };
        let store = Arc::clone(&self.store);
        let request = request.clone();
        runtime.spawn(async move {
            let _slot = slot;
            let refused = rls_refusals(&candidate, &store, &request, unix_us, config).await;
            candidate.count(&refused);
        });
    }
}

/// An Envoy call decided under the candidate: its refusals (none when it is malformed for the
/// candidate too, or the store failed).
async fn rls_refusals(
    candidate: &Candidate,
    store: &Store,
    request: &RlsRequest,
    unix_us: u64,
    config: EngineConfig,
) -> Refusers {
    let bundle = &**candidate.bundle.bundle();
    let Ok(plan) = rls::plan(bundle, request, unix_us, config) else {
        return Refusers::new();
    };
    let now_us = store.now_us();
    let mut peek = OpResults::new();
    let mut results = OpResults::new();
    // As the live call does: a peek first when a descriptor only checks or was refused before
    // the store, then the spend unless the peek refused the call.
    let ran = if plan.ops().is_empty() {
        Some(false)
    } else if plan.needs_peek() {
        match store.apply(now_us, &plan.peek_ops(), &mut peek).await {
            Err(_) => None,
            Ok(()) if plan.refused_by_peek(&peek) || plan.spends_nothing() => Some(true),
            Ok(()) => store
                .apply(now_us, plan.ops(), &mut results)
                .await
                .ok()
                .map(|()| false),
        }
    } else {
        store
            .apply(now_us, plan.ops(), &mut results)
            .await
            .ok()
            .map(|()| false)
    };
    let peeked = plan.needs_peek().then_some(&peek);
    let answer = match ran {
        None => StoreAnswer::Failed,
        Some(true) => StoreAnswer::PeekOnly(&peek),
        Some(false) => StoreAnswer::Spent {
            peek: peeked,
            results: &results,
        },
    };
    crate::engine::candidate::refusers_of(bundle, &plan.finish(answer, now_us).decision)
}

#[cfg(test)]
mod tests;
