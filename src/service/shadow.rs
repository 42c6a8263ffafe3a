//! The candidate bundle in force in the gateway ([`super::candidate`] sets and decides it): the
//! compiled candidate and its would-refuse counters, shared by its successive comparisons.

use crate::engine::candidate::{CandidateBundle, Refuser};
use crate::telemetry::metrics::CandidateMetrics;
use prometheus::IntCounter;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

/// The candidate in force, with its counters.
pub(crate) struct Candidate {
    pub(crate) bundle: CandidateBundle,
    /// Shared by this candidate's successive comparisons to the live bundle (a reload of the
    /// live bundle keeps the candidate's counts).
    pub(super) counters: Arc<Counters>,
}

/// A candidate's would-refuse counters, resolved on first use (a candidate of 10 000 rules that
/// mostly refuse nothing exports no 10 000 zero series).
pub(super) struct Counters {
    pub(super) metrics: CandidateMetrics,
    pub(super) rules: Vec<OnceLock<IntCounter>>,
    pub(super) kill_switches: Vec<OnceLock<IntCounter>>,
    /// Unix seconds the candidate was set at.
    pub(super) set_at: i64,
}

impl Candidate {
    pub(super) fn count(&self, refused: &[Refuser]) {
        let counters = &*self.counters;
        counters.metrics.decisions.inc();
        let bundle = self.bundle.bundle();
        for refuser in refused {
            let counter = match *refuser {
                Refuser::Rule(i) => bundle.rules.get(i as usize).and_then(|rule| {
                    counters.rules.get(i as usize).map(|lazy| {
                        lazy.get_or_init(|| {
                            counters
                                .metrics
                                .would_refuse
                                .with_label_values(&[&rule.policy_id, &rule.name])
                        })
                    })
                }),
                Refuser::KillSwitch(i) => counters.kill_switches.get(i as usize).map(|lazy| {
                    lazy.get_or_init(|| {
                        counters
                            .metrics
                            .would_refuse
                            .with_label_values(&["kill_switch", &format!("kill_switches[{i}]")])
                    })
                }),
            };
            if let Some(counter) = counter {
                counter.inc();
            }
        }
    }

    pub(super) fn refusals(&self) -> BTreeMap<String, u64> {
        let counters = &*self.counters;
        let bundle = self.bundle.bundle();
        let rules = counters
            .rules
            .iter()
            .zip(&bundle.rules)
            .filter_map(|(lazy, rule)| {
                lazy.get()
                    .map(|c| (format!("{}/{}", rule.policy_id, rule.name), c.get()))
            });
        let kill_switches = counters
            .kill_switches
            .iter()
            .enumerate()
            .filter_map(|(i, lazy)| {
                lazy.get()
                    .map(|c| (format!("kill_switch/kill_switches[{i}]"), c.get()))
            });
        rules.chain(kill_switches).collect()
    }
}
