//! Rules that count what the response says. A counting rule (token bucket, `cost_based`) may
//! add, in its `algorithm_config`:
//!
//! - `count_when`: the request is checked against its cost before the upstream without
//!   spending it (a *probe*), and charged once the response matches (its status, a header);
//! - a response-priced cost, `cost_source: "response_header:<name>"`: `default_cost` is
//!   reserved before the request and settled to the header's value (within `min_cost` and
//!   `max_cost`) after it;
//! - `penalty`: a key that gathers `after` counted events (refusals by the rule, or responses
//!   its `count_when` charged) within `within` is refused for `block_for`.
//!
//! This file compiles those fields, plans a request's part under them (the probe, what is
//! owed on the response, the penalty block's read), prices a response, and names the penalty
//! box's store keys. Charging uses the store's settlement ([`crate::store::AdjustOp`]), the
//! penalty box its leases (a sliding log of counted events, and one lease for the block),
//! so both are atomic on every store and shared by a fleet.

use crate::engine::decision::{Owed, SlotOutcome};
use crate::engine::planning::{group_of, Planning};
use crate::limits::limiter::{tokens_to_micro, Quota};
use crate::policy::compile::compiler::Compiler;
use crate::policy::json::join;
use crate::policy::rule::{
    AfterResponse, CostLimits, CostSource, CountWhen, Penalty, Rule, StatusSet,
};
use crate::request::descriptor::HeaderLookup;
use crate::store::lease::LeaseOp;
use crate::store::{BucketKey, Group};
use serde_json::{Map, Value};

/// The most counted events a `penalty` may wait for (each one is a mark the store keeps for
/// `within`).
pub const MAX_PENALTY_AFTER: u64 = 1000;

/// The fields of a `count_when` block.
const COUNT_WHEN_FIELDS: &[&str] = &["status", "response_header"];

/// The fields of a `penalty` block.
const PENALTY_FIELDS: &[&str] = &["after", "within", "block_for"];

impl Compiler {
    /// A counting rule's `count_when` and `penalty` (`None` when neither is written, or after
    /// an error, which is recorded at its path).
    pub(crate) fn after_response(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
    ) -> Option<std::sync::Arc<AfterResponse>> {
        let count_when = config
            .get("count_when")
            .and_then(|v| self.count_when(v, &join(path, "count_when")));
        let penalty = config
            .get("penalty")
            .and_then(|v| self.penalty(v, &join(path, "penalty")));
        (count_when.is_some() || penalty.is_some()).then(|| {
            std::sync::Arc::new(AfterResponse {
                count_when,
                penalty,
            })
        })
    }

    /// `count_when`: `status` (a list of statuses, one status, or a class such as `"5xx"`)
    /// and `response_header` (a header the response carries); at least one of them.
    fn count_when(&mut self, v: &Value, path: &str) -> Option<CountWhen> {
        let map = self.object(v, path, COUNT_WHEN_FIELDS)?;
        if map.is_empty() {
            self.error(path, "must name a status or a response_header");
            return None;
        }
        let status = match map.get("status") {
            None => Some(None),
            Some(v) => self.status_set(v, &join(path, "status")).map(Some),
        };
        let header = match map.get("response_header") {
            None => Some(None),
            Some(v) => self
                .non_empty_string(v, &join(path, "response_header"))
                .map(|name| Some(crate::request::descriptor::header_name(name))),
        };
        Some(CountWhen {
            status: status?,
            header: header?,
        })
    }

    /// A `count_when` status: `[401, 403]`, `401`, or `"4xx"`.
    fn status_set(&mut self, v: &Value, path: &str) -> Option<StatusSet> {
        const EXPECTED: &str =
            "must be a status (100 to 599), a list of statuses such as [401, 403], or a class such as \"5xx\"";
        let status = |v: &Value| {
            v.as_u64()
                .filter(|n| (100..=599).contains(n))
                .map(|n| n as u16)
        };
        let set = match v {
            Value::String(text) => match text.as_bytes() {
                [class @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => {
                    Some(StatusSet::Class(u16::from(class - b'0')))
                }
                _ => None,
            },
            Value::Array(items) if !items.is_empty() => items
                .iter()
                .map(status)
                .collect::<Option<Vec<u16>>>()
                .map(StatusSet::List),
            other => status(other).map(|s| StatusSet::List(vec![s])),
        };
        if set.is_none() {
            self.error(path, EXPECTED);
        }
        set
    }

    /// `penalty`: `after` (1 to [`MAX_PENALTY_AFTER`]), `within` and `block_for` (durations),
    /// all required.
    fn penalty(&mut self, v: &Value, path: &str) -> Option<Penalty> {
        let map = self.object(v, path, PENALTY_FIELDS)?;
        for field in PENALTY_FIELDS {
            if !map.contains_key(*field) {
                self.error(&join(path, field), "is required");
            }
        }
        let after = self.whole(map, path, "after", 1..=MAX_PENALTY_AFTER, false);
        let within = map
            .get("within")
            .and_then(|v| self.period(v, &join(path, "within")));
        let block_for = map
            .get("block_for")
            .and_then(|v| self.period(v, &join(path, "block_for")));
        Some(Penalty {
            after: u32::try_from(after?).ok()?,
            within_us: within?,
            block_for_us: block_for?,
        })
    }
}

/// A response-priced cost: the header's value in micro-tokens, raised to `min_cost` and
/// clamped at `max_cost` (and the bucket's burst); `default_cost` when the header is missing,
/// not a number, not finite or not positive.
pub fn response_cost(
    headers: &dyn HeaderLookup,
    name: &str,
    limits: &CostLimits,
    burst: u64,
) -> u64 {
    let ceiling = limits.max.map_or(burst, |max| max.min(burst));
    headers
        .header_text(name)
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|tokens| tokens.is_finite() && *tokens > 0.0)
        .map_or(limits.default, |tokens| {
            tokens_to_micro(tokens).max(limits.min)
        })
        .min(ceiling)
}

/// The penalty box's two store keys for a bucket: the sliding log of counted events and the
/// block. Derived from the bucket's own key, so every gateway (and the operator's endpoints)
/// names the same ones.
pub fn penalty_keys(bucket: BucketKey) -> (BucketKey, BucketKey) {
    let derive = |tag: u8| {
        let mut bytes = [0u8; 17];
        bytes[..8].copy_from_slice(&bucket.hi.to_le_bytes());
        bytes[8..16].copy_from_slice(&bucket.lo.to_le_bytes());
        bytes[16] = tag;
        let h = twox_hash::XxHash3_128::oneshot(&bytes);
        BucketKey {
            hi: (h >> 64) as u64,
            lo: h as u64,
        }
    };
    (derive(b'c'), derive(b'b'))
}

/// The lease op that reads whether a bucket's key is in the penalty box (it takes nothing).
pub fn block_read(block: BucketKey, group: Group) -> LeaseOp {
    LeaseOp {
        key: block,
        max: 0,
        group,
        ttl_us: 0,
        soft: true,
        held: false,
        mark: false,
        on_store_error: None,
    }
}

/// One counted event for a bucket's penalty box: its mark in the sliding log.
pub fn count_mark(count: BucketKey, penalty: &Penalty, group: Group) -> LeaseOp {
    LeaseOp {
        key: count,
        max: penalty.after,
        group,
        ttl_us: penalty.within_us,
        soft: false,
        held: false,
        mark: true,
        on_store_error: None,
    }
}

/// The block a tripped penalty box puts on its key.
pub fn block_lease(block: BucketKey, penalty: &Penalty, group: Group) -> LeaseOp {
    LeaseOp {
        key: block,
        max: 1,
        group,
        ttl_us: penalty.block_for_us,
        soft: false,
        held: false,
        mark: false,
        on_store_error: None,
    }
}

/// Whether a counted event trips the box: its mark was taken, and it is the `after`-th live
/// one (`before` were live). Taking marks is atomic, so exactly one event of a fleet trips it.
pub fn trips(penalty: &Penalty, taken: bool, before: u32) -> bool {
    taken && before.saturating_add(1) >= penalty.after
}

/// Plans what a rule reading the response adds for this request's bucket (`op_index`: its
/// bucket op, already planned): the penalty block's read (a lease, read before any bucket),
/// and, for `count_when` or a response-priced cost, what is owed once the response is known.
/// A `count_when` bucket op becomes a probe: checked against the cost, nothing spent.
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    (key, quota, window_id): (BucketKey, Quota, Option<u64>),
    op_index: usize,
    planning: &mut Planning<'b>,
) {
    let after = rule.after_response.as_deref();
    if after.is_some_and(|a| a.penalty.is_some()) {
        let (_, block) = penalty_keys(key);
        planning.leases.push(block_read(block, group_of(rule.mode)));
        planning.checked.slots.push(SlotOutcome::new(rule, block));
    }
    let counted = after.is_some_and(|a| a.count_when.is_some());
    let priced = matches!(rule.cost, CostSource::Response { .. });
    if !(counted || priced) {
        return;
    }
    let Some(op) = planning.ops.get_mut(op_index) else {
        return;
    };
    if op.cost > quota.burst() {
        // Never admissible: refused whatever the response, nothing to owe.
        return;
    }
    let cost = op.cost;
    op.probe = counted;
    planning.checked.owed.push(Owed {
        outcome: op_index,
        key,
        quota,
        window_id,
        reserved: if counted { 0 } else { cost },
        cost,
        group: op.group,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::{MICRO, US_PER_SEC};
    use crate::policy::compile::compile_bundle;
    use crate::policy::compile::tests::{errors_of, rule};
    use serde_json::json;

    #[test]
    fn count_when_and_penalty_compile() {
        let b = compile_bundle(
            &rule(json!({"count": 5, "period": "10m", "burst": 5,
                "count_when": {"status": [401, 403], "response_header": "X-Login-Failed"},
                "penalty": {"after": 5, "within": "10m", "block_for": "15m"}})),
            "x",
        )
        .unwrap();
        let after = b.rules[0].after_response.as_deref().unwrap();
        assert_eq!(
            after.count_when,
            Some(CountWhen {
                status: Some(StatusSet::List(vec![401, 403])),
                header: Some("x-login-failed".into()),
            })
        );
        assert_eq!(
            after.penalty,
            Some(Penalty {
                after: 5,
                within_us: 600 * US_PER_SEC,
                block_for_us: 900 * US_PER_SEC,
            })
        );
        let b = compile_bundle(
            &rule(json!({"rps": 1, "burst": 5, "count_when": {"status": "5xx"}})),
            "x",
        )
        .unwrap();
        let when = b.rules[0]
            .after_response
            .as_deref()
            .unwrap()
            .count_when
            .clone();
        assert_eq!(when.and_then(|w| w.status), Some(StatusSet::Class(5)));
        // A plain rule has no part read from the response.
        let b = compile_bundle(&rule(json!({"rps": 1, "burst": 5})), "x").unwrap();
        assert!(b.rules[0].after_response.is_none());
    }

    #[test]
    fn count_when_and_penalty_errors_name_their_fields() {
        assert_eq!(
            errors_of(rule(json!({"rps": 1, "burst": 5,
                "count_when": {"status": "6xx"},
                "penalty": {"after": 0, "within": "soon"}}))),
            [
                "rules[0].algorithm_config.count_when.status: must be a status (100 to 599), a list of statuses such as [401, 403], or a class such as \"5xx\"",
                "rules[0].algorithm_config.penalty.block_for: is required",
                "rules[0].algorithm_config.penalty.after: must be a whole number from 1 to 1000",
                "rules[0].algorithm_config.penalty.within: not a duration like \"1s\", \"180m\" or \"1h\": expected number at 0",
            ]
        );
        assert_eq!(
            errors_of(rule(json!({"rps": 1, "burst": 5, "count_when": {}}))),
            ["rules[0].algorithm_config.count_when: must name a status or a response_header"]
        );
        assert_eq!(
            errors_of(rule(json!({"rps": 1, "burst": 5, "count_when": {"status": [200, 700]}}))),
            ["rules[0].algorithm_config.count_when.status: must be a status (100 to 599), a list of statuses such as [401, 403], or a class such as \"5xx\""]
        );
    }

    #[test]
    fn response_costs_are_bounded_and_default_when_missing() {
        let b = compile_bundle(
            &rule(
                json!({"rps": 1, "burst": 100, "cost_source": "response_header:X-Complexity",
                "default_cost": 2, "max_cost": 50}),
            ),
            "x",
        )
        .unwrap();
        let CostSource::Response { name, limits } = &b.rules[0].cost else {
            panic!("{:?}", b.rules[0].cost);
        };
        assert_eq!(name, "x-complexity");
        // The response header is no request header the rule limits on.
        assert!(b.rules[0].header_names.is_empty());
        let burst = 100 * MICRO;
        let priced = |value: Option<&str>| {
            let headers: Vec<(String, String)> = value
                .map(|v| vec![("X-Complexity".to_string(), v.to_string())])
                .unwrap_or_default();
            response_cost(&headers, name, limits, burst)
        };
        assert_eq!(priced(Some("17")), 17 * MICRO);
        assert_eq!(priced(Some(" 2.5 ")), 2_500_000);
        assert_eq!(priced(Some("900")), 50 * MICRO);
        for garbled in [
            None,
            Some(""),
            Some("lots"),
            Some("-3"),
            Some("NaN"),
            Some("0"),
        ] {
            assert_eq!(priced(garbled), 2 * MICRO, "{garbled:?}");
        }
    }

    #[test]
    fn status_sets_and_headers_match() {
        let when = CountWhen {
            status: Some(StatusSet::Class(4)),
            header: Some("x-login-failed".into()),
        };
        let with: Vec<(String, String)> = vec![("X-Login-Failed".into(), "1".into())];
        let without: Vec<(String, String)> = Vec::new();
        assert!(when.matches(401, &with));
        assert!(!when.matches(401, &without));
        assert!(!when.matches(500, &with));
        let any_status = CountWhen {
            status: None,
            header: Some("x-login-failed".into()),
        };
        assert!(any_status.matches(200, &with));
        assert!(StatusSet::List(vec![401, 403]).contains(403));
        assert!(!StatusSet::List(vec![401, 403]).contains(404));
    }

    #[test]
    fn the_box_trips_on_the_after_th_event_and_keys_are_apart() {
        let p = Penalty {
            after: 5,
            within_us: 1,
            block_for_us: 1,
        };
        assert!(!trips(&p, true, 3));
        assert!(trips(&p, true, 4));
        assert!(!trips(&p, false, 5));
        let bucket = BucketKey::of("tb:login:10.0.0.1");
        let (count, block) = penalty_keys(bucket);
        assert_ne!(count, block);
        assert_ne!(count, bucket);
        assert_eq!(penalty_keys(bucket), (count, block));
        assert_ne!(penalty_keys(BucketKey::of("tb:login:10.0.0.2")).1, block);
    }

    // The engine's view: requests decided under these rules, responses settled.
    mod decided {
        use crate::engine::charges::{count_in_memory, Counted};
        use crate::engine::tests::*;
        use crate::engine::*;
        use crate::limits::clock::Clock;
        use crate::limits::limiter::MICRO;
        use serde_json::json;

        fn login(
            config: serde_json::Value,
            mode: &str,
        ) -> (TestEngine, crate::limits::clock::ManualClock) {
            engine(
                json!({"bundle_version": 1, "policies": [{"id": "p", "spec": {"mode": mode,
                "rules": [{"name": "login", "limit_keys": ["ip:address"],
                           "algorithm": "token_bucket", "algorithm_config": config}]}}]}),
            )
        }

        /// One login attempt answered `status`: the decision, then the response settled.
        fn attempt(e: &TestEngine, status: u16) -> Decision<'static> {
            let d = ask(e, "POST", "/login", "10.0.0.1", &[]);
            let now = e.clock.now_us();
            count_in_memory(&e.store, now, &d.penalty_counts());
            if let Some(charges) = d.response_charges() {
                let none: Vec<(String, String)> = Vec::new();
                let settled = charges.settle(status, &none);
                e.store.adjust(now, &settled.adjust);
                count_in_memory(&e.store, now, &settled.counted);
            }
            d
        }

        #[test]
        fn only_matching_responses_are_counted_and_an_empty_bucket_refuses_before() {
            // 5 failures per 10 minutes.
            let (e, clock) = login(
                json!({"count": 5, "period": "10m", "burst": 5, "count_when": {"status": [401, 403]}}),
                "enforce",
            );
            for _ in 0..1000 {
                let d = attempt(&e, 200);
                assert!(d.is_allowed());
                // Checked at its cost, nothing spent.
                assert_eq!(d.rules()[0].tokens, 5 * MICRO);
            }
            for left in (0..5).rev() {
                assert!(attempt(&e, 401).is_allowed());
                assert_eq!(
                    ask(&e, "GET", "/", "10.0.0.1", &[]).rules()[0].tokens,
                    left * MICRO
                );
            }
            let d = attempt(&e, 200);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
            // One token every 2 minutes.
            assert_eq!(d.retry_after(), 120);
            clock.set_secs(120.0);
            assert!(attempt(&e, 200).is_allowed());
        }

        #[test]
        fn the_penalty_box_blocks_for_its_time_and_leaves_the_bucket_alone() {
            let (e, clock) = login(
                json!({"count": 100, "period": "10m", "burst": 100, "count_when": {"status": "4xx"},
                       "penalty": {"after": 5, "within": "10m", "block_for": "15m"}}),
                "enforce",
            );
            for _ in 0..4 {
                assert!(attempt(&e, 401).is_allowed());
            }
            // Successes count toward nothing.
            assert!(attempt(&e, 200).is_allowed());
            clock.set_secs(10.0);
            // The fifth failure trips the box.
            let d = attempt(&e, 401);
            assert!(d.is_allowed());
            let d = attempt(&e, 200);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::Penalty));
            assert_eq!(d.status(), 429);
            assert_eq!(d.retry_after(), 900);
            // The block counts down, and the bucket is not touched meanwhile.
            clock.set_secs(10.0 + 600.5);
            let d = attempt(&e, 401);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::Penalty));
            assert_eq!(d.retry_after(), 300);
            assert!(d.rules().is_empty());
            clock.set_secs(10.0 + 899.0);
            assert_eq!(attempt(&e, 200).retry_after(), 1);
            clock.set_secs(10.0 + 900.0);
            let d = attempt(&e, 200);
            assert!(d.is_allowed());
            // 5 failures spent before the block, refilled since: full again.
            assert_eq!(d.rules()[0].tokens, 100 * MICRO);
        }

        #[test]
        fn refusals_count_toward_the_box_of_a_rule_without_count_when() {
            let (e, clock) = login(
                json!({"rps": 1, "burst": 1, "penalty": {"after": 3, "within": "1m", "block_for": "30s"}}),
                "enforce",
            );
            assert!(attempt(&e, 200).is_allowed());
            for _ in 0..2 {
                let d = attempt(&e, 200);
                assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
            }
            let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::TokenBucketExceeded));
            assert_eq!(
                count_in_memory(&e.store, e.clock.now_us(), &d.penalty_counts()).as_slice(),
                [Counted::Blocked]
            );
            clock.set_secs(5.0);
            let d = attempt(&e, 200);
            assert_eq!(d.outcome(), Outcome::Reject(Reason::Penalty));
            assert_eq!(d.retry_after(), 30 - 5);
            clock.set_secs(30.0);
            assert!(attempt(&e, 200).is_allowed());
        }

        #[test]
        fn shadow_rules_record_but_never_refuse() {
            let (e, _clock) = login(
                json!({"count": 2, "period": "10m", "burst": 2, "count_when": {"status": [401]},
                       "penalty": {"after": 2, "within": "10m", "block_for": "15m"}}),
                "shadow",
            );
            for _ in 0..5 {
                assert!(attempt(&e, 401).is_allowed());
            }
            let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
            assert!(d.is_allowed());
            // The box would block: reported on its slot.
            let slot = &d.checked().unwrap().slots[0];
            assert!(!slot.allowed);
            assert_eq!(slot.reason(), Reason::Penalty);
        }

        #[test]
        fn a_response_priced_cost_reserves_its_default_and_settles_to_the_header() {
            let (e, _clock) = engine(
                json!({"rules": [{"name": "graphql", "limit_keys": ["ip:address"],
                "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 100,
                "cost_source": "response_header:X-Complexity", "default_cost": 2, "max_cost": 30}}]}),
            );
            // Reserved 2 before; settled exactly, clamped at max_cost, 2 when missing or garbled.
            let mut left = 100 * MICRO;
            for (value, charged) in [
                (Some("17"), 17),
                (Some("500"), 30),
                (None, 2),
                (Some("a lot"), 2),
            ] {
                let d = ask(&e, "POST", "/graphql", "10.0.0.1", &[]);
                assert_eq!(d.rules()[0].tokens, left - 2 * MICRO);
                let headers: Vec<(String, String)> = value
                    .map(|v| vec![("X-Complexity".to_string(), v.to_string())])
                    .unwrap_or_default();
                let settled = d.response_charges().unwrap().settle(200, &headers);
                assert_eq!(settled.charged, charged * MICRO);
                e.store.adjust(e.clock.now_us(), &settled.adjust);
                left -= charged * MICRO;
                assert_eq!(e.store.peek(&d.rules()[0].key).unwrap().tokens, left);
            }
        }
    }
}
