//! Guards for agent traffic: `loop_detection` (identical requests within a sliding window) and
//! `circuit_breaker` (spend rate over a threshold opens it). Compiles their blocks into guard
//! rules and plans a request under them: a loop mark under the request's fingerprint, or the
//! breaker's open-state read and its spend bucket.

use super::token_bucket::{cost_of, planned_bucket, Cost};
use crate::engine::decision::SlotOutcome;
use crate::engine::planning::{group_of, write_bucket, PlanContext, Planning, KEY_BUFFER};
use crate::limits::limiter::{tokens_to_micro, Quota, MICRO, US_PER_SEC};
use crate::policy::compile::compiler::{headers_read, key_prefix, plain_rule, Compiler};
use crate::policy::json::join;
use crate::policy::rule::{
    Breaker, CostSource, Guard, LoopAction, LoopDetection, Mode, OnMissing, Rule, RuleKind,
};
use crate::request::descriptor::Descriptor;
use crate::request::descriptor::RequestFacts;
use crate::store::lease::LeaseOp;
use crate::store::BucketKey;
use serde_json::Value;

impl Compiler {
    /// A policy's `loop_detection` (Fairvisor's fields and checks, which Fairvisor itself never
    /// runs): `enabled`, `window_seconds` (1 s to 1 day), `threshold_identical_requests` (2 to
    /// 1000), `action` (`reject`, `throttle`, `warn`; default `reject`), `similarity` (`exact`).
    /// Returns the index of the rule it compiled to.
    pub(crate) fn loop_detection(
        &mut self,
        v: &Value,
        path: &str,
        policy: usize,
        mode: Mode,
        first_rule: usize,
    ) -> Option<usize> {
        let map = self.object(
            v,
            path,
            &[
                "enabled",
                "window_seconds",
                "threshold_identical_requests",
                "action",
                "similarity",
                "description",
            ],
        )?;
        let enabled = self.enabled(map, path);
        let window = self.whole(map, path, "window_seconds", 1..=86_400, enabled);
        let threshold = self.whole(map, path, "threshold_identical_requests", 2..=1000, enabled);
        let action = match map.get("action").map(Value::as_str) {
            None | Some(Some("reject")) => Some(LoopAction::Reject),
            Some(Some("throttle")) => Some(LoopAction::Throttle),
            Some(Some("warn")) => Some(LoopAction::Warn),
            Some(_) => {
                self.error(
                    &join(path, "action"),
                    "must be one of \"reject\", \"throttle\", \"warn\"",
                );
                None
            }
        };
        match map.get("similarity").map(Value::as_str) {
            None | Some(Some("exact")) => {}
            Some(_) => self.error(&join(path, "similarity"), "must be \"exact\""),
        }
        if !enabled {
            return None;
        }
        let (window, threshold, action) = (window?, threshold?, action?);
        let detection = LoopDetection {
            window_us: window * US_PER_SEC,
            threshold: threshold as u32,
            action,
        };
        // The identity: every limit key of the policy's rules, as Fairvisor fingerprints.
        let mut limit_keys: Vec<Descriptor> = Vec::new();
        for rule in &self.rules[first_rule..] {
            for d in &rule.limit_keys {
                if !limit_keys.contains(d) {
                    limit_keys.push(d.clone());
                }
            }
        }
        let quota = Quota::new(
            u64::from(detection.threshold) * MICRO,
            u64::from(detection.threshold) * MICRO,
            detection.window_us,
        )
        .ok()?;
        let cost = CostSource::Fixed(MICRO);
        self.guard_rule(
            "loop_detection",
            "lp",
            policy,
            mode,
            limit_keys,
            quota,
            cost,
            Guard::Loop(detection),
        )
    }

    /// A policy's `circuit_breaker` (Fairvisor's fields and checks): `enabled`,
    /// `spend_rate_threshold_per_minute` (> 0), `action` (`reject`), `auto_reset_after_minutes`
    /// (0 to 43200; 0, the default, keeps it open until the bundle changes), `alert`. The spend
    /// is the policy's first rule's cost, per that rule's limit keys.
    pub(crate) fn circuit_breaker(
        &mut self,
        v: &Value,
        path: &str,
        policy: usize,
        mode: Mode,
        first_rule: usize,
    ) -> Option<usize> {
        let map = self.object(
            v,
            path,
            &[
                "enabled",
                "spend_rate_threshold_per_minute",
                "action",
                "auto_reset_after_minutes",
                "alert",
                "description",
            ],
        )?;
        let enabled = self.enabled(map, path);
        let threshold_path = join(path, "spend_rate_threshold_per_minute");
        let threshold = match map.get("spend_rate_threshold_per_minute") {
            Some(v) => self.amount(v, &threshold_path),
            None if enabled => {
                self.error(&threshold_path, "is required when enabled is true");
                None
            }
            None => None,
        };
        match map.get("action").map(Value::as_str) {
            None | Some(Some("reject")) => {}
            Some(_) => self.error(&join(path, "action"), "must be \"reject\""),
        }
        let reset_path = join(path, "auto_reset_after_minutes");
        let reset_us = match map.get("auto_reset_after_minutes") {
            None => Some(None),
            Some(v) => match v.as_f64() {
                Some(m) if m.is_finite() && m == 0.0 => Some(None),
                Some(m) if m.is_finite() && m > 0.0 && m <= 43_200.0 => Some(Some(
                    ((m * 60.0 * US_PER_SEC as f64).round() as u64).max(US_PER_SEC),
                )),
                _ => {
                    self.error(&reset_path, "must be a number of minutes from 0 to 43200");
                    None
                }
            },
        };
        let alert = self.flag(map, path, "alert", false).unwrap_or(false);
        if !enabled {
            return None;
        }
        let (threshold, reset_us) = (threshold?, reset_us?);
        let burst = tokens_to_micro(threshold);
        let quota = Quota::new(burst, burst, 60 * US_PER_SEC).ok()?;
        // Fairvisor measures the spend by the first rule; its keys name whose spend it is.
        let first = self.rules.get(first_rule);
        let keyed = self.rules[first_rule..]
            .iter()
            .find(|r| !r.limit_keys.is_empty());
        let limit_keys = keyed.map(|r| r.limit_keys.clone()).unwrap_or_default();
        let cost = first
            .filter(|r| !matches!(r.kind, RuleKind::Concurrency(_)))
            .map_or(CostSource::Fixed(MICRO), |r| r.cost.clone());
        self.guard_rule(
            "circuit_breaker",
            "br",
            policy,
            mode,
            limit_keys,
            quota,
            cost,
            Guard::Breaker(Breaker { reset_us, alert }),
        )
    }

    /// Adds the rule a guard compiles to: named after the guard (with `@<policy id>` when
    /// another policy's guard took the name), keyed under `<kind>:<policy id>:`, sharing one
    /// key among requests that lack a descriptor. Returns its index.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn guard_rule(
        &mut self,
        base: &str,
        kind: &str,
        policy: usize,
        mode: Mode,
        limit_keys: Vec<Descriptor>,
        quota: Quota,
        cost: CostSource,
        guard: Guard,
    ) -> Option<usize> {
        let name = self.unclaimed_name(base);
        self.rule_names.insert(name.clone(), base.to_string());
        let key_prefix = key_prefix(kind, &self.current_policy_id, mode);
        let header_names = headers_read(limit_keys.iter(), &cost);
        let index = self.rules.len();
        self.rules.push(Rule {
            index,
            limit_keys,
            cost,
            on_missing: OnMissing::Shared,
            on_store_error: None,
            key_prefix,
            header_names,
            kind: RuleKind::Guard(guard),
            ..plain_rule(name, policy, mode, quota, quota.window_secs())
        });
        Some(index)
    }
}

/// Plans a guard rule: a loop mark under the request's fingerprint (soft when the loop only
/// warns or throttles), or a breaker's open-state read and its spend bucket.
pub(crate) fn plan<'b>(
    rule: &'b Rule,
    facts: &RequestFacts<'_>,
    context: PlanContext<'b>,
    planning: &mut Planning<'b>,
) {
    let PlanContext {
        bundle,
        ipv6_prefix: prefix,
        ..
    } = context;
    match rule.guard() {
        Some(Guard::Loop(detection)) => {
            let key = KEY_BUFFER.with(|buffer| {
                let mut bucket = buffer.borrow_mut();
                // Guards share one key among requests lacking a descriptor: always written.
                write_bucket(rule, facts, prefix, &mut bucket);
                facts.write_fingerprint(&mut bucket);
                BucketKey::of(&bucket)
            });
            planning.leases.push(LeaseOp {
                key,
                // The request making `threshold` identical ones is the loop: it finds
                // `threshold - 1` marks.
                max: detection.threshold - 1,
                group: group_of(rule.mode),
                ttl_us: detection.window_us,
                soft: detection.action != LoopAction::Reject,
                held: false,
                mark: true,
                on_store_error: None,
            });
            planning.checked.slots.push(SlotOutcome::new(rule, key));
        }
        Some(Guard::Breaker(breaker)) => {
            let (spend, open) = KEY_BUFFER.with(|buffer| {
                let mut bucket = buffer.borrow_mut();
                write_bucket(rule, facts, prefix, &mut bucket);
                let spend = BucketKey::of(&bucket);
                bucket.push_str("|open");
                // Without automatic reset, a changed bundle closes it.
                if breaker.reset_us.is_none() {
                    bucket.push('|');
                    bucket.push_str(&bundle.hash);
                }
                (spend, BucketKey::of(&bucket))
            });
            planning.leases.push(LeaseOp {
                key: open,
                max: 0,
                group: group_of(rule.mode),
                ttl_us: breaker.open_us(),
                soft: true,
                held: false,
                mark: false,
                on_store_error: None,
            });
            planning.checked.slots.push(SlotOutcome::new(rule, open));
            // A spend the whole threshold cannot hold trips the breaker, like any spend over it.
            let cost = match cost_of(&rule.cost, facts, &rule.quota) {
                Cost::Fits(cost) => cost,
                Cost::Exceeds => rule.quota.burst().saturating_add(1),
            };
            let (op, outcome) = planned_bucket(rule, spend, rule.quota, Cost::Fits(cost), None);
            planning.ops.push(op);
            planning.checked.rules.push(outcome);
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::compile::compile_bundle;
    use crate::policy::compile::tests::errors_of;
    use serde_json::json;

    #[test]
    fn loop_detection_and_circuit_breakers_follow_fairvisor_checks() {
        let policy =
            |spec: Value| json!({"bundle_version": 1, "policies": [{"id": "p", "spec": spec}]});
        let errors = errors_of(policy(json!({"rules": [],
            "loop_detection": {"enabled": true, "threshold_identical_requests": 1, "action": "block",
                               "similarity": "fuzzy"},
            "circuit_breaker": {"enabled": "yes", "spend_rate_threshold_per_minute": 0,
                                "action": "warn", "auto_reset_after_minutes": -1, "alert": 1}})));
        assert_eq!(
            errors,
            [
                "policies[0].spec.loop_detection.window_seconds: is required when enabled is true",
                "policies[0].spec.loop_detection.threshold_identical_requests: must be a whole number from 2 to 1000",
                "policies[0].spec.loop_detection.action: must be one of \"reject\", \"throttle\", \"warn\"",
                "policies[0].spec.loop_detection.similarity: must be \"exact\"",
                "policies[0].spec.circuit_breaker.enabled: must be a boolean, found a string",
                "policies[0].spec.circuit_breaker.spend_rate_threshold_per_minute: must be > 0",
                "policies[0].spec.circuit_breaker.action: must be \"reject\"",
                "policies[0].spec.circuit_breaker.auto_reset_after_minutes: must be a number of minutes from 0 to 43200",
                "policies[0].spec.circuit_breaker.alert: must be a boolean, found a number",
            ]
        );
        // Fairvisor's example blocks compile, with defaults, into named rules of their own.
        let tb = json!({"name": "org", "limit_keys": ["jwt:org_id"], "algorithm": "token_bucket",
                        "algorithm_config": {"rps": 10, "burst": 20, "cost_source": "header:x-cost"}});
        let spec = |id: &str| {
            json!({"id": id, "spec": {"rules": [if id == "a" { tb.clone() } else { json!({"name": "ip", "limit_keys": ["ip:address"], "algorithm": "token_bucket", "algorithm_config": {"rps": 1, "burst": 1}}) }],
            "loop_detection": {"enabled": true, "window_seconds": 60, "threshold_identical_requests": 10,
                               "action": "reject", "similarity": "exact"},
            "circuit_breaker": {"enabled": true, "spend_rate_threshold_per_minute": 1000,
                                "action": "reject", "alert": true, "auto_reset_after_minutes": 5}}})
        };
        let b = compile_bundle(
            &json!({"bundle_version": 1, "policies": [spec("a"), spec("b")]}),
            "x",
        )
        .unwrap();
        let names: Vec<&str> = b.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "org",
                "loop_detection",
                "circuit_breaker",
                "ip",
                "loop_detection@b",
                "circuit_breaker@b"
            ]
        );
        let a = &b.policies[0];
        assert_eq!(
            (a.rules.clone(), a.loop_detection, a.circuit_breaker),
            (0..1, Some(1), Some(2))
        );
        assert_eq!(
            b.rules[1].guard(),
            Some(Guard::Loop(LoopDetection {
                window_us: 60 * US_PER_SEC,
                threshold: 10,
                action: LoopAction::Reject
            }))
        );
        assert_eq!(b.rules[1].key_prefix, "lp:a:");
        let breaker = &b.rules[2];
        assert_eq!(
            breaker.guard(),
            Some(Guard::Breaker(Breaker {
                reset_us: Some(300 * US_PER_SEC),
                alert: true
            }))
        );
        // The spend is the first rule's cost, per its keys, over a minute.
        assert_eq!(breaker.limit_keys, b.rules[0].limit_keys);
        assert_eq!(breaker.cost, b.rules[0].cost);
        assert_eq!(
            (breaker.quota.burst(), breaker.quota.window_secs()),
            (1000 * MICRO, 60)
        );
        assert_eq!(breaker.key_prefix, "br:a:");
        assert!(b.fingerprints_bodies);
        // Disabled blocks build nothing, and defaults apply.
        let b = compile_bundle(
            &policy(json!({"rules": [],
            "loop_detection": {"enabled": false},
            "circuit_breaker": {"enabled": true, "spend_rate_threshold_per_minute": 5}})),
            "x",
        )
        .unwrap();
        assert_eq!(b.policies[0].loop_detection, None);
        assert!(!b.fingerprints_bodies);
        assert_eq!(
            b.rules[0].guard(),
            Some(Guard::Breaker(Breaker {
                reset_us: None,
                alert: false
            }))
        );
        assert_eq!(b.rules[0].limit_keys, []);
    }

    // The engine's view: requests decided under this kind's rules.
    mod decided {
        use crate::engine::tests::*;
        use crate::policy::compile_bundle;
        use crate::request::descriptor::RequestFacts;
        use serde_json::json;

        #[test]
        fn identical_requests_over_the_threshold_are_a_loop_within_a_sliding_window() {
            let (e, clock) = engine(guarded(
                json!({"enabled": true, "window_seconds": 60, "threshold_identical_requests": 3}),
                json!({"enabled": false}),
                json!([tb("per-ip", json!(["ip:address"]), 100.0, 100.0)]),
            ));
            let get = |uri: &str, ip: &str| ask(&e, "GET", uri, ip, &[]);
            assert!(get("/search?q=a&page=1", "10.0.0.1").is_allowed());
            clock.set_secs(10.0);
            // Parameter order and encoding do not make a request different.
            assert!(get("/search?page=1&q=%61", "10.0.0.1").is_allowed());
            // The third identical one within 60 s is the loop; it spends nothing.
            clock.set_secs(20.0);
            let d = get("/search?q=a&page=1", "10.0.0.1");
            assert_eq!(reason_of(&d), Some("loop_detected"));
            assert_eq!(d.status(), 429);
            // Retry-After: when the oldest identical request leaves the window (60 s after t=0).
            assert_eq!(d.retry_after(), 40);
            assert_eq!(d.rules().len(), 0);
            // Another value, another client, another path: different requests.
            assert!(get("/search?q=b&page=1", "10.0.0.1").is_allowed());
            assert!(get("/search?q=a&page=1", "10.0.0.2").is_allowed());
            assert!(get("/search/?q=a&page=1&page=2", "10.0.0.1").is_allowed());
            // The window slides: at t=60 the first mark is gone, one more fits.
            clock.set_secs(60.0);
            assert!(get("/search?q=a&page=1", "10.0.0.1").is_allowed());
            let d = get("/search?q=a&page=1", "10.0.0.1");
            assert_eq!(
                (reason_of(&d), d.retry_after()),
                (Some("loop_detected"), 10)
            );
        }

        #[test]
        fn bodies_tell_requests_apart() {
            let (e, _clock) = engine(guarded(
                json!({"enabled": true, "window_seconds": 60, "threshold_identical_requests": 2}),
                json!({"enabled": false}),
                json!([]),
            ));
            let post = |body: &[u8]| {
                let headers: Vec<(String, String)> = Vec::new();
                let facts = RequestFacts::from_uri(
                    "POST",
                    "/v1/chat",
                    None,
                    Some("10.0.0.1".parse().unwrap()),
                    &headers,
                )
                .with_body_hash(crate::request::descriptor::body_hash(body));
                e.decide(&facts)
            };
            assert!(post(b"{\"q\": 1}").is_allowed());
            assert!(post(b"{\"q\": 2}").is_allowed());
            assert_eq!(reason_of(&post(b"{\"q\": 1}")), Some("loop_detected"));
            // Without a body the fingerprint differs from any body's.
            assert!(post(b"").is_allowed());
            assert_eq!(reason_of(&post(b"")), Some("loop_detected"));
        }

        #[test]
        fn a_loop_that_warns_or_throttles_never_skips_the_other_rules() {
            for (action, warning, throttle_ms) in
                [("warn", "loop_warn", 0), ("throttle", "loop_throttle", 300)]
            {
                let (e, _clock) = engine(guarded(
                    json!({"enabled": true, "window_seconds": 60, "threshold_identical_requests": 3,
                           "action": action}),
                    json!({"enabled": false}),
                    json!([tb("per-ip", json!(["ip:address"]), 0.001, 4.0)]),
                ));
                for _ in 0..2 {
                    let d = ask(&e, "GET", "/x", "10.0.0.1", &[]);
                    assert_eq!(d.checked().unwrap().warning(), None);
                }
                // The third and fourth are loops, and still pay the bucket.
                for left in [1.0, 0.0] {
                    let d = ask(&e, "GET", "/x", "10.0.0.1", &[]);
                    assert!(d.is_allowed(), "{action}");
                    let checked = d.checked().unwrap();
                    assert_eq!(checked.warning(), Some(warning));
                    assert_eq!(checked.throttle_ms(), throttle_ms);
                    assert_eq!(d.rules()[0].tokens_f64(), left);
                }
                // The bucket still refuses when it is empty.
                let d = ask(&e, "GET", "/x", "10.0.0.1", &[]);
                assert_eq!(reason_of(&d), Some("token_bucket_exceeded"), "{action}");
            }
        }

        #[test]
        fn a_refused_request_leaves_no_loop_mark() {
            let (e, _clock) = engine(guarded(
                json!({"enabled": true, "window_seconds": 60, "threshold_identical_requests": 2}),
                json!({"enabled": false}),
                json!([tb("per-ip", json!(["ip:address"]), 0.001, 1.0)]),
            ));
            assert!(ask(&e, "GET", "/a", "10.0.0.1", &[]).is_allowed());
            // Refused by the bucket: its mark is given back, so /b is not a repeat after it.
            let d = ask(&e, "GET", "/b", "10.0.0.1", &[]);
            assert_eq!(reason_of(&d), Some("token_bucket_exceeded"));
            let key = d.checked().unwrap().slots[0].key;
            assert_eq!(e.store.leases().in_flight(&key, 0), 0);
        }

        #[test]
        fn a_breaker_trips_on_spend_rate_and_stays_open_until_reset() {
            let (e, clock) = engine(guarded(
                json!({"enabled": false}),
                json!({"enabled": true, "spend_rate_threshold_per_minute": 100,
                       "auto_reset_after_minutes": 5, "alert": true}),
                json!([{"name": "org-budget", "limit_keys": ["header:x-org"], "algorithm": "cost_based",
                        "algorithm_config": {"budget": 100000, "period": "1d", "cost_key": "header:x-cost",
                                             "default_cost": 1, "staged_actions": [
                                                 {"threshold_percent": 100, "action": "reject"}]}}]),
            ));
            let spend = |org: &str, cost: &str| {
                ask(
                    &e,
                    "POST",
                    "/v1/run",
                    "10.0.0.1",
                    &[("x-org", org), ("x-cost", cost)],
                )
            };
            assert!(spend("acme", "60").is_allowed());
            assert!(spend("acme", "40").is_allowed());
            // 100 spent within the minute: the next spend trips the breaker and is refused.
            let d = spend("acme", "1");
            assert_eq!(reason_of(&d), Some("circuit_breaker_open"));
            assert_eq!(d.retry_after(), 300);
            let trips = d.breaker_trips();
            assert_eq!(trips.len(), 1);
            assert_eq!(trips[0].1.name, "circuit_breaker");
            // The budget was not charged for the refused request.
            let budget_left = d
                .rules()
                .iter()
                .find(|r| r.rule.name == "org-budget")
                .unwrap();
            assert_eq!(budget_left.tokens_f64(), 99_900.0);
            // Open: every request of this org is refused, whatever it costs, and spends nothing.
            clock.set_secs(120.0);
            let d = spend("acme", "1");
            assert_eq!(
                (reason_of(&d), d.retry_after()),
                (Some("circuit_breaker_open"), 180)
            );
            assert!(d.breaker_trips().is_empty());
            // Another org is not affected.
            assert!(spend("globex", "1").is_allowed());
            // Closed after 5 minutes, with a refilled spend bucket.
            clock.set_secs(300.0);
            let d = spend("acme", "100");
            assert!(d.is_allowed());
            assert_eq!(
                d.rules()
                    .iter()
                    .find(|r| r.rule.name == "org-budget")
                    .unwrap()
                    .tokens_f64(),
                99_800.0
            );
        }

        #[test]
        fn a_request_refused_by_another_rule_never_trips_the_breaker() {
            let (e, _clock) = engine(guarded(
                json!({"enabled": false}),
                json!({"enabled": true, "spend_rate_threshold_per_minute": 10, "auto_reset_after_minutes": 1}),
                json!([{"name": "per-key", "limit_keys": ["header:x-org"], "algorithm": "token_bucket",
                        "algorithm_config": {"rps": 100, "burst": 20, "cost_source": "header:x-cost",
                                             "max_cost": 15}}]),
            ));
            let spend = |cost: &str| {
                ask(
                    &e,
                    "POST",
                    "/",
                    "10.0.0.1",
                    &[("x-org", "a"), ("x-cost", cost)],
                )
            };
            // 16 is over the breaker's 10 but also over max_cost: refused for its cost, no trip.
            let d = spend("16");
            assert_eq!(reason_of(&d), Some("cost_exceeds_limit"));
            assert!(d.breaker_trips().is_empty());
            assert!(spend("10").is_allowed());
            let d = spend("1");
            assert_eq!(reason_of(&d), Some("circuit_breaker_open"));
            assert_eq!(d.breaker_trips().len(), 1);
        }

        #[test]
        fn a_breaker_without_reset_closes_when_the_bundle_changes() {
            let bundle = guarded(
                json!({"enabled": false}),
                json!({"enabled": true, "spend_rate_threshold_per_minute": 2}),
                json!([tb("per-ip", json!(["ip:address"]), 100.0, 100.0)]),
            );
            let e = empty_engine(1_800_000_000);
            let mut first = compile_bundle(&bundle, "test").unwrap();
            first.hash = "0001".to_string();
            e.install(first);
            for _ in 0..2 {
                assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
            }
            let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
            // Open until the bundle changes: clients come back in a minute, as for a kill switch.
            assert_eq!(
                (reason_of(&d), d.retry_after()),
                (Some("circuit_breaker_open"), 60)
            );
            e.clock.set_secs(3600.0);
            let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
            assert_eq!(
                (reason_of(&d), d.retry_after()),
                (Some("circuit_breaker_open"), 60)
            );
            let mut second = compile_bundle(&bundle, "test").unwrap();
            second.hash = "0002".to_string();
            e.install(second);
            assert!(ask(&e, "GET", "/", "10.0.0.1", &[]).is_allowed());
        }

        #[test]
        fn shadow_guards_only_report() {
            let mut bundle = guarded(
                json!({"enabled": true, "window_seconds": 60, "threshold_identical_requests": 2}),
                json!({"enabled": true, "spend_rate_threshold_per_minute": 2, "auto_reset_after_minutes": 1}),
                json!([tb("per-ip", json!(["ip:address"]), 100.0, 100.0)]),
            );
            bundle["policies"][0]["spec"]["mode"] = json!("shadow");
            let (e, _clock) = engine(bundle);
            let mut seen = Vec::new();
            for _ in 0..4 {
                let d = ask(&e, "GET", "/", "10.0.0.1", &[]);
                assert!(d.is_allowed());
                assert_eq!(d.checked().unwrap().warning(), None);
                let refusing: Vec<String> = d
                    .checked()
                    .unwrap()
                    .slots
                    .iter()
                    .filter(|s| !s.allowed)
                    .map(|s| s.reason().as_str().to_string())
                    .collect();
                seen.push(refusing);
            }
            assert_eq!(
                seen,
                [
                    vec![],
                    vec!["loop_detected".to_string()],
                    vec!["loop_detected".to_string()],
                    vec![
                        "loop_detected".to_string(),
                        "circuit_breaker_open".to_string()
                    ],
                ]
            );
        }
    }
}
