//! Pacing a burst (`delay` on a token-bucket rule): which of the requests a bucket admits go
//! through at once and how long each of the others waits for its token, compiled from
//! `algorithm_config.delay` (`immediate`, `max_wait_ms`).
//!
//! The schedule is nginx `limit_req`'s. A request spends its token when it is decided, as any
//! admitted request does: the bucket reserves the token it will be served on, so a waiting
//! request is never refused afterwards and never counted twice. Of a full bucket of `burst`
//! tokens, the first `immediate` go at once; a request that leaves the bucket below
//! `burst - immediate` waits until the refill brings it back to that level, which is when the
//! requests before it have all had their turn at the rule's rate. With nginx's `rate=R
//! burst=B delay=D`, `excess` is what the bucket lacks of being full, less the request being
//! decided: tollgate's `burst = B + 1` and `immediate = D + 1` give nginx's wait,
//! `(excess - D) / R`, to the microsecond (nginx counts whole milliseconds).

use crate::limits::limiter::{Quota, MICRO};
use crate::policy::compile::compiler::{Compiler, Shape};
use crate::policy::json::{join, type_name};
pub use crate::policy::rule::Pacing;
use serde_json::{Map, Value};

/// The fields of `algorithm_config.delay`.
pub(crate) const DELAY_FIELDS: &[&str] = &["immediate", "max_wait_ms"];

/// Longest `max_wait_ms` a rule may state: one hour (a request held longer is a hung request).
pub const MAX_WAIT_MS: u64 = 3_600_000;

impl Pacing {
    /// Microseconds a request waits that left `remaining` micro-tokens in a bucket of `quota`
    /// (0: it goes at once): the refill time back up to `burst - immediate`.
    #[inline]
    pub fn wait_us(&self, quota: &Quota, remaining: u64) -> u64 {
        let level = quota.burst().saturating_sub(self.immediate);
        if remaining >= level {
            return 0;
        }
        quota.time_to_gain_us(level - remaining)
    }

    /// The longest wait this rule allows under `quota` (an override's quota has its own
    /// default).
    pub fn max_wait_us(&self, quota: &Quota) -> u64 {
        self.max_wait_us
            .unwrap_or_else(|| quota.time_to_gain_us(quota.burst()))
    }
}

impl Compiler {
    /// `algorithm_config.delay` of a token-bucket rule whose bucket is `shape` (`None` when
    /// absent or wrong; errors recorded at their paths).
    pub(crate) fn pacing(
        &mut self,
        config: &Map<String, Value>,
        path: &str,
        shape: Option<&Shape>,
    ) -> Option<Pacing> {
        let v = config.get("delay")?;
        let path = join(path, "delay");
        let map = self.object(v, &path, DELAY_FIELDS)?;
        let immediate = match map.get("immediate") {
            None => Some(1),
            Some(v) => match v.as_u64() {
                Some(n) if n <= 1_000_000_000 => Some(n),
                _ => {
                    self.error(
                        &join(&path, "immediate"),
                        format!(
                            "must be a whole number of requests from 0 to the burst, found {}",
                            json_shape(v)
                        ),
                    );
                    None
                }
            },
        };
        let max_wait_ms = match map.get("max_wait_ms") {
            None => Some(None),
            Some(v) => match v.as_u64() {
                Some(n) if (1..=MAX_WAIT_MS).contains(&n) => Some(Some(n)),
                _ => {
                    self.error(
                        &join(&path, "max_wait_ms"),
                        format!("must be a whole number from 1 to {MAX_WAIT_MS}"),
                    );
                    None
                }
            },
        };
        let (immediate, max_wait_ms) = (immediate?, max_wait_ms?);
        if let Some(shape) = shape {
            if immediate as f64 > shape.burst {
                self.error(
                    &join(&path, "immediate"),
                    format!(
                        "{immediate} is above the burst {}: at most the burst goes through at once",
                        shape.burst
                    ),
                );
                return None;
            }
            if immediate as f64 == shape.burst {
                self.warn(
                    &join(&path, "immediate"),
                    "equals the burst: no request ever waits (nginx's nodelay); remove delay, or lower immediate to pace",
                );
            }
        }
        Some(Pacing {
            immediate: immediate.saturating_mul(MICRO),
            max_wait_us: max_wait_ms.map(|ms| ms * 1_000),
        })
    }
}

/// A JSON value as an error message names it: a number as written, else its type.
fn json_shape(v: &Value) -> String {
    match v {
        Value::Number(n) => n.to_string(),
        other => type_name(other).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::limiter::{check, tokens_to_micro, US_PER_SEC};
    use crate::policy::compile::compile_bundle;
    use crate::policy::compile::tests::{errors_of, rule};
    use serde_json::json;

    fn quota(rate: f64, burst: f64) -> Quota {
        Quota::new(tokens_to_micro(burst), tokens_to_micro(rate), US_PER_SEC).unwrap()
    }

    /// nginx's own example: `rate=1r/s burst=5` without nodelay is burst 6, immediate 1 here.
    /// Seven requests at once: the first at once, the next five one second apart, the seventh
    /// refused.
    #[test]
    fn a_burst_waits_its_turn_at_the_rate() {
        let q = quota(1.0, 6.0);
        let p = Pacing {
            immediate: MICRO,
            max_wait_us: None,
        };
        let mut state = None;
        let mut waits = Vec::new();
        for _ in 0..7 {
            let v = check(state, &q, 0, MICRO);
            if v.allowed {
                state = Some(v.next);
                waits.push(Some(p.wait_us(&q, v.remaining)));
            } else {
                waits.push(None);
            }
        }
        let s = |n: u64| Some(n * US_PER_SEC);
        assert_eq!(waits, [s(0), s(1), s(2), s(3), s(4), s(5), None]);
        assert_eq!(p.max_wait_us(&q), 6 * US_PER_SEC);
    }

    /// nginx's `burst=12 delay=8` at 5 r/s: 9 at once, then 200 ms apart, the 14th refused.
    #[test]
    fn the_first_immediate_go_at_once() {
        let q = quota(5.0, 13.0);
        let p = Pacing {
            immediate: 9 * MICRO,
            max_wait_us: None,
        };
        let mut state = None;
        let mut waits = Vec::new();
        for _ in 0..14 {
            let v = check(state, &q, 0, MICRO);
            if v.allowed {
                state = Some(v.next);
                waits.push(Some(p.wait_us(&q, v.remaining) / 1_000));
            } else {
                waits.push(None);
            }
        }
        let mut want = vec![Some(0); 9];
        want.extend([Some(200), Some(400), Some(600), Some(800), None]);
        assert_eq!(waits, want);
        // Half a second later, 2.5 tokens are back: the next waits behind the four still
        // waiting, less the time gone.
        let v = check(state, &q, US_PER_SEC / 2, MICRO);
        assert!(v.allowed);
        assert_eq!(p.wait_us(&q, v.remaining), 500_000);
    }

    #[test]
    fn delay_compiles_with_defaults_and_is_checked() {
        let b = compile_bundle(&rule(json!({"rps": 2, "burst": 10, "delay": {}})), "x").unwrap();
        assert_eq!(
            b.rules[0].pacing,
            Some(Pacing {
                immediate: MICRO,
                max_wait_us: None
            })
        );
        assert!(b.paces);
        let b = compile_bundle(
            &rule(json!({"rps": 2, "burst": 10, "delay": {"immediate": 0, "max_wait_ms": 1500}})),
            "x",
        )
        .unwrap();
        assert_eq!(
            b.rules[0].pacing,
            Some(Pacing {
                immediate: 0,
                max_wait_us: Some(1_500_000)
            })
        );
        let b = compile_bundle(&rule(json!({"rps": 2, "burst": 10})), "x").unwrap();
        assert_eq!(b.rules[0].pacing, None);
        assert!(!b.paces);
        assert_eq!(
            errors_of(rule(json!({"rps": 2, "burst": 10, "delay": {"immediate": 11}}))),
            ["rules[0].algorithm_config.delay.immediate: 11 is above the burst 10: at most the burst goes through at once"]
        );
        assert_eq!(
            errors_of(rule(json!({"rps": 2, "burst": 10, "delay": {"immediate": 1.5, "max_wait_ms": 0, "after": 1}}))),
            [
                "rules[0].algorithm_config.delay.after: unknown field (expected one of: immediate, max_wait_ms)",
                "rules[0].algorithm_config.delay.immediate: must be a whole number of requests from 0 to the burst, found 1.5",
                "rules[0].algorithm_config.delay.max_wait_ms: must be a whole number from 1 to 3600000",
            ]
        );
        assert_eq!(
            errors_of(rule(json!({"rps": 2, "burst": 10, "delay": true}))),
            ["rules[0].algorithm_config.delay: must be an object, found a boolean"]
        );
    }
}
