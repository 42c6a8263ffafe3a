//! Token-bucket maths: a pure function from (bucket state, quota, now, cost) to a verdict and the
//! state to store. No I/O, no clock reads, no locking: stores apply it atomically.
//!
//! Amounts are fixed-point integers — tokens in micro-tokens (1e-6 token) and time in
//! microseconds — so every store (embedded map, Redis Lua, PostgreSQL) computes bit-identical
//! answers and the seed tables come out exactly (`1.3`, not `1.2999999999999998`).
//!
//! Semantics (SPEC §4): continuous lazy refill, a new bucket starts full, allow iff
//! `tokens >= cost`, a rejected request changes nothing, time going backwards adds nothing.

/// Micro-tokens per token.
pub const MICRO: u64 = 1_000_000;
/// Microseconds per second.
pub const US_PER_SEC: u64 = 1_000_000;

/// Seed 004 (Coinbase) worked example, burst 3 and 1 token per second, a new bucket at t = 0:
/// `(request time in seconds, allowed, tokens left after the request)`. The exact test vector
/// every store must reproduce.
pub const SEED_004_TABLE: [(f64, bool, f64); 7] = [
    (0.5, true, 2.0),
    (0.8, true, 1.3),
    (0.9, true, 0.4),
    (1.0, false, 0.5),
    (1.4, false, 0.9),
    (1.8, true, 0.3),
    (5.0, true, 2.0),
];

/// A validated bucket shape: capacity and refill rate. Built only through [`Quota::new`], so a
/// zero burst or zero rate cannot exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    /// Capacity in micro-tokens (≥ 1).
    burst: u64,
    /// Micro-tokens added per `period_us` (≥ 1).
    refill: u64,
    /// Refill period in microseconds (≥ 1).
    period_us: u64,
}

/// Why a quota could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error("burst must be at least 0.000001 tokens")]
    ZeroBurst,
    #[error("rate must be at least 0.000001 tokens per period")]
    ZeroRate,
    #[error("period must be at least 1 microsecond")]
    ZeroPeriod,
}

impl Quota {
    /// `burst` micro-tokens of capacity, refilled by `refill` micro-tokens every `period_us`.
    ///
    /// # Errors
    /// Any of the three being zero.
    pub fn new(burst: u64, refill: u64, period_us: u64) -> Result<Self, QuotaError> {
        if burst == 0 {
            return Err(QuotaError::ZeroBurst);
        }
        if refill == 0 {
            return Err(QuotaError::ZeroRate);
        }
        if period_us == 0 {
            return Err(QuotaError::ZeroPeriod);
        }
        Ok(Quota {
            burst,
            refill,
            period_us,
        })
    }

    /// Capacity in micro-tokens.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Micro-tokens added per period.
    pub fn refill(&self) -> u64 {
        self.refill
    }

    /// Refill period in microseconds.
    pub fn period_us(&self) -> u64 {
        self.period_us
    }

    /// Tokens per second, for display.
    pub fn rate_per_sec(&self) -> f64 {
        (self.refill as f64 / MICRO as f64) / (self.period_us as f64 / US_PER_SEC as f64)
    }

    /// Micro-tokens gained over `elapsed_us` (floored; saturates instead of overflowing).
    pub fn gained(&self, elapsed_us: u64) -> u64 {
        // 64-bit fast path: a 128-bit division is a slow library call.
        if let Some(product) = elapsed_us.checked_mul(self.refill) {
            return product / self.period_us;
        }
        let micro = elapsed_us as u128 * self.refill as u128 / self.period_us as u128;
        micro.min(u64::MAX as u128) as u64
    }

    /// Microseconds needed to gain `micro` micro-tokens (rounded up).
    pub fn time_to_gain_us(&self, micro: u64) -> u64 {
        if let Some(product) = micro.checked_mul(self.period_us) {
            return product.div_ceil(self.refill);
        }
        let num = micro as u128 * self.period_us as u128;
        let us = num.div_ceil(self.refill as u128);
        us.min(u64::MAX as u128) as u64
    }

    /// Microseconds of refill `micro` micro-tokens are worth (rounded down).
    pub fn refund_time_us(&self, micro: u64) -> u64 {
        let us = micro as u128 * self.period_us as u128 / self.refill as u128;
        us.min(u64::MAX as u128) as u64
    }

    /// Whole seconds to refill from empty (`w` in `RateLimit-Policy`), at least 1.
    pub fn window_secs(&self) -> u64 {
        ceil_secs(self.time_to_gain_us(self.burst)).max(1)
    }
}

/// What a store keeps per bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    /// Micro-tokens at `last_us`.
    pub tokens: u64,
    /// Monotonic time of the last refill (microseconds).
    pub last_us: u64,
}

/// The outcome of one bucket check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    /// Micro-tokens after the refill, before spending.
    pub available: u64,
    /// Micro-tokens left: `available - cost` when allowed, `available` when rejected.
    pub remaining: u64,
    /// The state to store if the request is committed (meaningful only when allowed).
    pub next: BucketState,
    /// Whole seconds until `cost` would be affordable (0 when allowed, otherwise ≥ 1).
    pub retry_after_secs: u64,
    /// Microseconds until the bucket is full again after this verdict.
    pub full_in_us: u64,
}

impl Verdict {
    /// Whole seconds until the bucket is full again (`t` in `RateLimit`).
    pub fn reset_secs(&self) -> u64 {
        ceil_secs(self.full_in_us)
    }
}

/// Tokens in the bucket at `now_us`: `min(burst, tokens + max(0, now - last) * rate)`; an absent
/// bucket is full. A clock that went backwards refills nothing.
pub fn available(state: Option<BucketState>, quota: &Quota, now_us: u64) -> u64 {
    match state {
        None => quota.burst,
        Some(s) => {
            // A lowered burst (after a reload) caps what the bucket held.
            let held = s.tokens.min(quota.burst);
            let elapsed = now_us.saturating_sub(s.last_us);
            held.saturating_add(quota.gained(elapsed)).min(quota.burst)
        }
    }
}

/// Checks a request of `cost` micro-tokens against a bucket at `now_us`.
pub fn check(state: Option<BucketState>, quota: &Quota, now_us: u64, cost: u64) -> Verdict {
    let avail = available(state, quota, now_us);
    // Never move `last` backwards: a request stamped earlier than the stored refill time must
    // not make the next request refill the same interval twice.
    let last_us = state.map_or(now_us, |s| s.last_us.max(now_us));
    if avail >= cost {
        let remaining = avail - cost;
        Verdict {
            allowed: true,
            available: avail,
            remaining,
            next: BucketState {
                tokens: remaining,
                last_us,
            },
            retry_after_secs: 0,
            full_in_us: (last_us - now_us)
                .saturating_add(quota.time_to_gain_us(quota.burst - remaining)),
        }
    } else {
        // A bucket in debt (see [`settle`]) refills nothing until its refill time: that wait
        // comes first.
        let debt_us = last_us - now_us;
        let wait_us = debt_us.saturating_add(quota.time_to_gain_us(cost - avail));
        Verdict {
            allowed: false,
            available: avail,
            remaining: avail,
            next: BucketState {
                tokens: avail,
                last_us,
            },
            retry_after_secs: ceil_secs(wait_us).max(1),
            full_in_us: debt_us.saturating_add(quota.time_to_gain_us(quota.burst - avail)),
        }
    }
}

/// Settles a reservation on a token bucket at `now_us`: `delta` more micro-tokens are charged
/// (negative: refunded). A refund fills the bucket up to its burst at most. A charge the bucket
/// cannot cover puts it in debt rather than losing it: the bucket holds nothing and its refill
/// time moves past now by the time the shortfall takes to refill, so it refills nothing until
/// then. A later refund pays the debt back first. An absent bucket is full.
pub fn settle(state: Option<BucketState>, quota: &Quota, now_us: u64, delta: i64) -> BucketState {
    let held = state.map_or(quota.burst, |s| s.tokens.min(quota.burst));
    let last_us = state.map_or(now_us, |s| s.last_us);
    let amount = delta.unsigned_abs();
    if last_us > now_us && held == 0 {
        // In debt until `last_us`.
        let debt_us = last_us - now_us;
        if delta >= 0 {
            return BucketState {
                tokens: 0,
                last_us: last_us.saturating_add(quota.time_to_gain_us(amount)),
            };
        }
        // A refund buys back refill time (rounded down: never more than it is worth).
        let bought_us = quota.refund_time_us(amount);
        if bought_us <= debt_us {
            return BucketState {
                tokens: 0,
                last_us: last_us - bought_us,
            };
        }
        let left = amount - quota.gained(debt_us).min(amount);
        return BucketState {
            tokens: left.min(quota.burst),
            last_us: now_us,
        };
    }
    let avail = available(state, quota, now_us);
    let last_us = last_us.max(now_us);
    if delta < 0 {
        return BucketState {
            tokens: avail.saturating_add(amount).min(quota.burst),
            last_us,
        };
    }
    if avail >= amount {
        return BucketState {
            tokens: avail - amount,
            last_us,
        };
    }
    BucketState {
        tokens: 0,
        last_us: last_us.saturating_add(quota.time_to_gain_us(amount - avail)),
    }
}

/// Settles a reservation on a budget window (`window_id`): the spend moves by `delta`, between
/// nothing left and the whole budget. A bucket counting another window (the reservation's
/// window has ended) is left as it is.
pub fn settle_window(
    state: Option<BucketState>,
    budget: u64,
    window_id: u64,
    delta: i64,
) -> Option<BucketState> {
    let s = state.filter(|s| s.last_us == window_id)?;
    let held = s.tokens.min(budget);
    let tokens = if delta < 0 {
        held.saturating_add(delta.unsigned_abs()).min(budget)
    } else {
        held.saturating_sub(delta.unsigned_abs())
    };
    Some(BucketState {
        tokens,
        last_us: window_id,
    })
}

/// A fixed budget window (`cost_based` rules): its identity, the Unix second it starts at, and
/// how long it still runs. A bucket's stored `last_us` holds the id of the window it counts, so a
/// bucket from an earlier window reads as full whatever the store's time base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Unix seconds of the window's start (never 0 for a real window).
    pub id: u64,
    /// Microseconds until the window ends (at least 1).
    pub ends_in_us: u64,
}

/// Checks a request of `cost` against a budget of `budget` micro-tokens in `window`: what the
/// bucket holds if it counts this window, the whole budget otherwise. Nothing refills inside a
/// window; a refused request changes nothing.
pub fn check_window(state: Option<BucketState>, budget: u64, window: Window, cost: u64) -> Verdict {
    let avail = match state {
        Some(s) if s.last_us == window.id => s.tokens.min(budget),
        _ => budget,
    };
    let full_in = |left: u64| if left < budget { window.ends_in_us } else { 0 };
    if avail >= cost {
        let remaining = avail - cost;
        Verdict {
            allowed: true,
            available: avail,
            remaining,
            next: BucketState {
                tokens: remaining,
                last_us: window.id,
            },
            retry_after_secs: 0,
            full_in_us: full_in(remaining),
        }
    } else {
        Verdict {
            allowed: false,
            available: avail,
            remaining: avail,
            next: BucketState {
                tokens: avail,
                last_us: window.id,
            },
            retry_after_secs: ceil_secs(window.ends_in_us).max(1),
            full_in_us: full_in(avail),
        }
    }
}

/// Microseconds rounded up to whole seconds.
pub fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(US_PER_SEC)
}

/// Converts a token amount (as written in policies and cost headers) to micro-tokens, rounding
/// to the nearest micro-token; non-finite or negative amounts give 0, huge ones saturate.
pub fn tokens_to_micro(tokens: f64) -> u64 {
    if !tokens.is_finite() || tokens <= 0.0 {
        return 0;
    }
    (tokens * MICRO as f64).round() as u64
}

/// Micro-tokens as a token amount, for display.
pub fn micro_to_tokens(micro: u64) -> f64 {
    micro as f64 / MICRO as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tokens_per_sec(rate: f64, burst: f64) -> Quota {
        Quota::new(tokens_to_micro(burst), tokens_to_micro(rate), US_PER_SEC).unwrap()
    }

    fn secs(s: f64) -> u64 {
        crate::limits::clock::secs_to_us(s)
    }

    /// Seed 004 (Coinbase): burst 3, rate 1; the worked table, statuses and token counts exact.
    #[test]
    fn seed_004_worked_table_is_exact() {
        let quota = tokens_per_sec(1.0, 3.0);
        let mut state = None;
        for (t, allowed, tokens) in SEED_004_TABLE {
            let v = check(state, &quota, secs(t), MICRO);
            assert_eq!(v.allowed, allowed, "status at t={t}");
            assert_eq!(micro_to_tokens(v.remaining), tokens, "tokens at t={t}");
            if v.allowed {
                state = Some(v.next);
            }
        }
    }

    /// Seed 000 (Boulder): burst 20, 20 per 1 s. The first request leaves 19; the 21st inside
    /// 50 ms is rejected; one request every 50 ms is sustained forever.
    #[test]
    fn seed_000_boulder_example() {
        let quota = Quota::new(20 * MICRO, 20 * MICRO, US_PER_SEC).unwrap();
        let first = check(None, &quota, 0, MICRO);
        assert!(first.allowed);
        assert_eq!(first.remaining, 19 * MICRO);
        // "will reset to full in 50ms"
        assert_eq!(first.full_in_us, 50_000);
        let mut state = Some(first.next);
        // 19 more requests inside 50 ms (every 2 ms) are allowed, the 21st is rejected.
        for i in 1..20u64 {
            let v = check(state, &quota, i * 2_000, MICRO);
            assert!(v.allowed, "request {} at {} µs", i + 1, i * 2_000);
            state = Some(v.next);
        }
        let twenty_first = check(state, &quota, 45_000, MICRO);
        assert!(!twenty_first.allowed);
        assert_eq!(twenty_first.retry_after_secs, 1);
        // From an empty bucket, one request per 50 ms is sustained.
        let mut now = 45_000;
        for _ in 0..1_000 {
            now += 50_000;
            let v = check(state, &quota, now, MICRO);
            assert!(v.allowed, "sustained request at {now} µs");
            state = Some(v.next);
        }
        // ... and a request 1 ms after one of them is not.
        assert!(!check(state, &quota, now + 1_000, MICRO).allowed);
    }

    /// Seed 001: retry_after = ceil((cost - tokens) / rate), at least 1.
    #[test]
    fn retry_after_formula() {
        let quota = tokens_per_sec(2.0, 10.0);
        let drained = Some(BucketState {
            tokens: 0,
            last_us: 0,
        });
        // cost 5 from 0 tokens at 2 t/s: 2.5 s → 3.
        assert_eq!(check(drained, &quota, 0, 5 * MICRO).retry_after_secs, 3);
        // cost 1 from 0.5 tokens: 0.25 s → at least 1.
        let half = Some(BucketState {
            tokens: MICRO / 2,
            last_us: 0,
        });
        assert_eq!(check(half, &quota, 0, MICRO).retry_after_secs, 1);
        // cost 4 at 2 t/s from 0: exactly 2 s.
        assert_eq!(check(drained, &quota, 0, 4 * MICRO).retry_after_secs, 2);
    }

    #[test]
    fn backward_clock_adds_nothing_and_keeps_last() {
        let quota = tokens_per_sec(1.0, 3.0);
        let state = Some(BucketState {
            tokens: MICRO,
            last_us: secs(10.0),
        });
        let v = check(state, &quota, secs(4.0), MICRO);
        assert!(v.allowed);
        assert_eq!(v.remaining, 0);
        assert_eq!(v.next.last_us, secs(10.0));
        // Back at 10.5 s, only half a token has been earned since the stored refill time.
        let again = check(Some(v.next), &quota, secs(10.5), MICRO);
        assert!(!again.allowed);
        assert_eq!(again.available, MICRO / 2);
    }

    #[test]
    fn lowered_burst_caps_existing_tokens() {
        let quota = tokens_per_sec(1.0, 5.0);
        let state = Some(BucketState {
            tokens: 9 * MICRO,
            last_us: 0,
        });
        assert_eq!(available(state, &quota, 0), 5 * MICRO);
    }

    #[test]
    fn windows_never_refill_inside_and_reset_at_the_next() {
        let w1 = Window {
            id: 1_800_000_000,
            ends_in_us: 90 * US_PER_SEC,
        };
        let budget = 10 * MICRO;
        let v = check_window(None, budget, w1, 4 * MICRO);
        assert!(v.allowed);
        assert_eq!((v.remaining, v.next.last_us), (6 * MICRO, w1.id));
        assert_eq!(v.full_in_us, 90 * US_PER_SEC);
        let v = check_window(Some(v.next), budget, w1, 7 * MICRO);
        assert!(!v.allowed);
        assert_eq!((v.available, v.retry_after_secs), (6 * MICRO, 90));
        let v = check_window(Some(v.next), budget, w1, 6 * MICRO);
        assert_eq!((v.allowed, v.remaining), (true, 0));
        // The next window starts from the whole budget, whatever was left.
        let w2 = Window {
            id: w1.id + 300,
            ends_in_us: 300 * US_PER_SEC,
        };
        let v = check_window(Some(v.next), budget, w2, MICRO);
        assert_eq!((v.allowed, v.remaining), (true, 9 * MICRO));
        // A lowered budget caps what the bucket held.
        let v = check_window(Some(v.next), 5 * MICRO, w2, 0);
        assert_eq!(v.available, 5 * MICRO);
    }

    #[test]
    fn quota_rejects_zeros_and_reports_window() {
        assert_eq!(Quota::new(0, 1, 1), Err(QuotaError::ZeroBurst));
        assert_eq!(Quota::new(1, 0, 1), Err(QuotaError::ZeroRate));
        assert_eq!(Quota::new(1, 1, 0), Err(QuotaError::ZeroPeriod));
        assert_eq!(tokens_per_sec(10.0, 15.0).window_secs(), 2);
        assert_eq!(tokens_per_sec(1.0, 3.0).window_secs(), 3);
        // Boulder 300 per 180 m: 10 800 s to refill 300 from empty.
        let slow = Quota::new(300 * MICRO, 300 * MICRO, 180 * 60 * US_PER_SEC).unwrap();
        assert_eq!(slow.window_secs(), 10_800);
    }

    #[test]
    fn extreme_values_saturate_instead_of_panicking() {
        let quota = Quota::new(u64::MAX, u64::MAX, 1).unwrap();
        let v = check(
            Some(BucketState {
                tokens: 0,
                last_us: 0,
            }),
            &quota,
            u64::MAX,
            u64::MAX,
        );
        assert!(v.allowed);
        let tiny = Quota::new(1, 1, u64::MAX).unwrap();
        let v = check(None, &tiny, 0, u64::MAX);
        assert!(!v.allowed);
        assert!(v.retry_after_secs >= 1);
    }

    fn arb_quota() -> impl Strategy<Value = Quota> {
        (1u64..=1_000, 1u64..=1_000).prop_map(|(burst, rate)| {
            Quota::new(burst * MICRO / 10, rate * MICRO / 10, US_PER_SEC).unwrap()
        })
    }

    #[test]
    fn settling_refunds_charges_and_carries_debt() {
        // 1 000 tokens of burst, 100 per second.
        let q = tokens_per_sec(100.0, 1000.0);
        let t = |tokens: f64| tokens_to_micro(tokens);
        let reserved = check(None, &q, 0, t(800.0));
        assert_eq!(reserved.remaining, t(200.0));
        // 300 really used: 500 back.
        let s = settle(Some(reserved.next), &q, 0, -(t(500.0) as i64));
        assert_eq!(
            s,
            BucketState {
                tokens: t(700.0),
                last_us: 0
            }
        );
        // A refund never fills past the burst; an absent bucket is full.
        assert_eq!(settle(Some(s), &q, 0, -(t(900.0) as i64)).tokens, t(1000.0));
        assert_eq!(
            settle(None, &q, 5, -1),
            BucketState {
                tokens: t(1000.0),
                last_us: 5
            }
        );
        // 4 900 more than reserved: 4 200 of debt, 42 s of refill.
        let debt = settle(Some(s), &q, 0, t(4900.0) as i64);
        assert_eq!(
            debt,
            BucketState {
                tokens: 0,
                last_us: secs(42.0)
            }
        );
        let at41 = check(Some(debt), &q, secs(41.0), t(1.0));
        assert!(!at41.allowed);
        assert_eq!((at41.available, at41.retry_after_secs), (0, 2));
        assert_eq!(
            check(Some(debt), &q, secs(42.0), t(1.0)).retry_after_secs,
            1
        );
        assert_eq!(available(Some(debt), &q, secs(43.0)), t(100.0));
        // More charges deepen it; refunds pay it back first.
        assert_eq!(
            settle(Some(debt), &q, 0, t(100.0) as i64).last_us,
            secs(43.0)
        );
        assert_eq!(
            settle(Some(debt), &q, 0, -(t(1200.0) as i64)).last_us,
            secs(30.0)
        );
        assert_eq!(
            settle(Some(debt), &q, secs(2.0), -(t(5000.0) as i64)),
            BucketState {
                tokens: t(1000.0),
                last_us: secs(2.0)
            }
        );
        assert_eq!(
            settle(Some(debt), &q, 0, -(t(4500.0) as i64)),
            BucketState {
                tokens: t(300.0),
                last_us: 0
            }
        );
    }

    #[test]
    fn settling_a_window_stays_inside_it() {
        let w = Window {
            id: 86_400,
            ends_in_us: 1,
        };
        let spent = check_window(None, 1000, w, 800).next;
        assert_eq!(
            settle_window(Some(spent), 1000, 86_400, -500).map(|s| s.tokens),
            Some(700)
        );
        assert_eq!(
            settle_window(Some(spent), 1000, 86_400, 900).map(|s| s.tokens),
            Some(0)
        );
        assert_eq!(
            settle_window(Some(spent), 1000, 86_400, -5000).map(|s| s.tokens),
            Some(1000)
        );
        // The reservation's day is over: the new day's bucket is not touched.
        assert_eq!(settle_window(Some(spent), 1000, 0, -500), None);
        assert_eq!(settle_window(None, 1000, 86_400, -500), None);
    }

    proptest! {
        /// A charge then the same refund leave the bucket as it was (whole µs per µtoken, so no
        /// rounding), in debt or not.
        #[test]
        fn a_charge_and_its_refund_cancel_out(
            burst in 1u64..1_000_000_000, us_per in 1u64..1_000, held in 0u64..1_000_000_000,
            charge in 0u64..5_000_000_000, now in 0u64..1_000_000_000,
        ) {
            let q = Quota::new(burst, 1, us_per).unwrap();
            let state = BucketState { tokens: held.min(burst), last_us: now };
            let charged = settle(Some(state), &q, now, charge as i64);
            let back = settle(Some(charged), &q, now, -(charge as i64));
            prop_assert_eq!(available(Some(back), &q, now), held.min(burst));
            prop_assert!(back.last_us <= now);
        }
    }

    proptest! {
        /// Tokens stay within [0, burst] whatever the request times and costs.
        #[test]
        fn tokens_stay_within_bounds(
            quota in arb_quota(),
            steps in prop::collection::vec((0u64..3_000_000, 1u64..5_000_000), 1..200),
        ) {
            let mut state = None;
            let mut now = 0u64;
            for (dt, cost) in steps {
                now += dt;
                let v = check(state, &quota, now, cost);
                prop_assert!(v.available <= quota.burst());
                prop_assert!(v.remaining <= quota.burst());
                if v.allowed {
                    prop_assert_eq!(v.remaining, v.available - cost);
                    state = Some(v.next);
                }
            }
        }

        /// Over any interval T, a key admits at most `burst + rate * T` of cost.
        #[test]
        fn admitted_cost_is_bounded_by_burst_plus_rate_times_t(
            quota in arb_quota(),
            steps in prop::collection::vec((0u64..500_000, 1u64..3_000_000), 1..300),
        ) {
            let mut state = None;
            let mut now = 0u64;
            let mut admitted: Vec<(u64, u64)> = Vec::new();
            for (dt, cost) in steps {
                now += dt;
                let v = check(state, &quota, now, cost);
                if v.allowed {
                    state = Some(v.next);
                    admitted.push((now, cost));
                }
            }
            // Every window [admitted[i].0, admitted[j].0].
            for i in 0..admitted.len() {
                let mut sum: u128 = 0;
                for j in i..admitted.len() {
                    sum += admitted[j].1 as u128;
                    let t = admitted[j].0 - admitted[i].0;
                    let bound = quota.burst() as u128
                        + t as u128 * quota.refill() as u128 / quota.period_us() as u128;
                    prop_assert!(sum <= bound, "admitted {} > bound {} over {} µs", sum, bound, t);
                }
            }
        }

        /// A rejected request changes no bucket: the state a store keeps is untouched, and the
        /// next request sees exactly what it would have seen without the rejected one.
        #[test]
        fn rejected_request_changes_nothing(
            quota in arb_quota(),
            tokens in 0u64..100_000_000,
            last in 0u64..10_000_000,
            dt in 0u64..10_000_000,
            dt2 in 0u64..10_000_000,
            cost in 1u64..200_000_000,
        ) {
            let state = Some(BucketState { tokens: tokens.min(quota.burst()), last_us: last });
            let v = check(state, &quota, last + dt, cost);
            if !v.allowed {
                // The store keeps `state`; a later check is the same as if nothing happened.
                let later = check(state, &quota, last + dt + dt2, 1);
                let direct = available(state, &quota, last + dt + dt2);
                prop_assert_eq!(later.available, direct);
                prop_assert!(v.retry_after_secs >= 1);
            }
        }
    }
}
