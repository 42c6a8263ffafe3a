//! `concurrency`: in-flight caps. Compiles `max_in_flight` and `lease_ttl_seconds` and plans a
//! request's slot; the slots themselves are leases of the store ([`crate::store::lease`]).

use crate::engine::decision::SlotOutcome;
use crate::engine::planning::{group_of, Planning};
use crate::limits::limiter::US_PER_SEC;
use crate::policy::compile::compiler::Compiler;
use crate::policy::json::join;
use crate::policy::rule::{Concurrency, Rule};
use crate::store::lease::LeaseOp;
use crate::store::BucketKey;
use serde_json::{Map, Value};

/// How long a concurrency slot is held at most when nobody gives it back.
const DEFAULT_LEASE_TTL_SECS: u64 = 300;

/// The fields of a `concurrency` rule's `algorithm_config`.
pub(crate) const CONCURRENCY_FIELDS: &[&str] = &["max_in_flight", "lease_ttl_seconds"];

impl Compiler {
    /// A `concurrency` rule: `max_in_flight` (a whole number from 1 to 1 000 000) and
    /// `lease_ttl_seconds` (how long a slot may be held at most; 1 s to 1 day, default 300).
    pub(crate) fn concurrency(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<Concurrency> {
        let max = match config.get("max_in_flight") {
            Some(v) => match v.as_u64() {
                Some(n @ 1..=1_000_000) => Some(n as u32),
                _ => {
                    self.error(
                        &join(path, "max_in_flight"),
                        "must be a whole number from 1 to 1000000",
                    );
                    None
                }
            },
            None => {
                self.error(&join(path, "max_in_flight"), "is required");
                None
            }
        };
        let ttl = match config.get("lease_ttl_seconds") {
            None => Some(DEFAULT_LEASE_TTL_SECS),
            Some(v) => match v.as_u64() {
                Some(n @ 1..=86_400) => Some(n),
                _ => {
                    self.error(
                        &join(path, "lease_ttl_seconds"),
                        "must be a whole number of seconds from 1 to 86400",
                    );
                    None
                }
            },
        };
        Some(Concurrency {
            max_in_flight: max?,
            lease_ttl_us: ttl? * US_PER_SEC,
        })
    }
}

/// Plans a slot: a lease on the key, held until the request is done (given back then, or by
/// its TTL if the gateway never says).
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    c: Concurrency,
    key: BucketKey,
    planning: &mut Planning<'b>,
) {
    planning.leases.push(LeaseOp {
        key,
        max: c.max_in_flight,
        group: group_of(rule.mode),
        ttl_us: c.lease_ttl_us,
        soft: false,
        held: true,
        mark: false,
        on_store_error: rule.on_store_error,
    });
    planning.checked.slots.push(SlotOutcome::new(rule, key));
}

#[cfg(test)]
mod tests {
    use crate::engine::tests::{ask, engine};
    use crate::engine::{Outcome, Reason};
    use crate::policy::compile::tests::errors_of;
    use serde_json::{json, Value};

    fn slots(config: Value) -> Value {
        json!({"rules": [{"name": "conns", "limit_keys": ["ip:address"], "algorithm": "concurrency",
                          "algorithm_config": config}]})
    }

    #[test]
    fn concurrency_fields_are_checked() {
        for (config, error) in [
            (json!({}), "rules[0].algorithm_config.max_in_flight: is required"),
            (
                json!({"max_in_flight": 0}),
                "rules[0].algorithm_config.max_in_flight: must be a whole number from 1 to 1000000",
            ),
            (
                json!({"max_in_flight": 2.5}),
                "rules[0].algorithm_config.max_in_flight: must be a whole number from 1 to 1000000",
            ),
            (
                json!({"max_in_flight": 2, "lease_ttl_seconds": 86_401}),
                "rules[0].algorithm_config.lease_ttl_seconds: must be a whole number of seconds from 1 to 86400",
            ),
            (
                json!({"max_in_flight": 2, "burst": 5}),
                "rules[0].algorithm_config.burst: unknown field (expected one of: max_in_flight, lease_ttl_seconds)",
            ),
        ] {
            assert_eq!(errors_of(slots(config)), [error]);
        }
    }

    /// A slot is a lease held until the request gives it back: two in flight, the third
    /// refused, and one given back lets the next in. Another client has its own slots.
    #[test]
    fn slots_are_held_until_given_back() {
        let (e, _clock) = engine(slots(json!({"max_in_flight": 2, "lease_ttl_seconds": 30})));
        let first = ask(&e, "GET", "/", "10.0.0.1", &[]);
        let second = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(first.outcome(), Outcome::Allow);
        assert_eq!(second.outcome(), Outcome::Allow);
        let held = first.checked().unwrap();
        assert_eq!(held.held_leases().len(), 1);
        assert_eq!(held.slots[0].in_flight, 0);
        assert_eq!(second.checked().unwrap().slots[0].in_flight, 1);
        let third = ask(&e, "GET", "/", "10.0.0.1", &[]);
        assert_eq!(
            third.outcome(),
            Outcome::Reject(Reason::ConcurrencyExceeded)
        );
        assert_eq!(third.status(), 429);
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.2", &[]).outcome(),
            Outcome::Allow
        );
        e.store.leases().release(held.lease_id, &held.held_leases());
        assert_eq!(
            ask(&e, "GET", "/", "10.0.0.1", &[]).outcome(),
            Outcome::Allow
        );
    }
}
