//! Time sources. The engine never reads the system clock directly: it asks a [`Clock`], so tests
//! and `tollgate simulate` drive time by hand and never sleep.
//!
//! Two readings are offered: a monotonic one in integer microseconds (all bucket maths) and a
//! wall-clock one in Unix seconds (only for kill-switch `expires_at`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of time for the engine.
pub trait Clock: Send + Sync {
    /// Monotonic microseconds since an arbitrary origin fixed for the clock's lifetime.
    fn now_us(&self) -> u64;
    /// Wall-clock Unix time in seconds (used for kill-switch expiry only).
    fn unix_secs(&self) -> i64;
    /// Wall-clock Unix time in microseconds: the time base of a store shared by several
    /// gateways (their monotonic clocks have different origins).
    fn unix_us(&self) -> u64;
    /// [`Clock::now_us`] at `at`, a reading of `Instant::now()` the caller already holds: a
    /// decision that reads the monotonic clock for its latency reuses that reading instead of
    /// reading the clock again. A clock not driven by the system's (the tests' manual clock)
    /// ignores `at` and gives its own time.
    fn now_us_at(&self, at: Instant) -> u64 {
        let _ = at;
        self.now_us()
    }
}

/// The real clock: `Instant` for the monotonic reading, `SystemTime` for the wall clock.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        // An Instant difference below u64::MAX µs (584 000 years) cannot overflow.
        self.origin.elapsed().as_micros() as u64
    }

    fn unix_secs(&self) -> i64 {
        wall_unix_secs()
    }

    fn unix_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    }

    fn now_us_at(&self, at: Instant) -> u64 {
        // `now_us` is `origin.elapsed()`: the same subtraction, at the caller's instant.
        at.saturating_duration_since(self.origin).as_micros() as u64
    }
}

/// `unix_secs` as an RFC 3339 UTC time to the second (`2026-11-28T06:00:00Z`); `None` past
/// what `SystemTime` or the format can hold (after year 9999), so a time anyone wrote can be
/// shown without a panic.
pub fn rfc3339_seconds(unix_secs: u64) -> Option<String> {
    use std::fmt::Write;
    let at = UNIX_EPOCH.checked_add(std::time::Duration::from_secs(unix_secs))?;
    let mut text = String::new();
    write!(text, "{}", humantime::format_rfc3339_seconds(at)).ok()?;
    Some(text)
}

/// The current wall-clock time in Unix seconds (0 if the system clock is before 1970).
pub fn wall_unix_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Milliseconds since the Unix epoch, from the wall clock (access-log timestamps).
pub fn wall_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A clock moved by hand. Cloning shares the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now_us: Arc<AtomicU64>,
    wall_origin: i64,
}

impl ManualClock {
    /// A manual clock at monotonic time 0 whose wall clock starts at `wall_origin` Unix seconds.
    pub fn new(wall_origin: i64) -> Self {
        ManualClock {
            now_us: Arc::new(AtomicU64::new(0)),
            wall_origin,
        }
    }

    /// Sets the monotonic time (microseconds since the clock's origin). Moving backwards is
    /// allowed on purpose: the limiter must survive it.
    pub fn set_us(&self, us: u64) {
        self.now_us.store(us, Ordering::SeqCst);
    }

    /// Moves the clock forward by `us` microseconds.
    pub fn advance_us(&self, us: u64) {
        self.now_us.fetch_add(us, Ordering::SeqCst);
    }

    /// Sets the time from seconds (as written in the seed tables), rounded to the microsecond.
    pub fn set_secs(&self, secs: f64) {
        self.set_us(secs_to_us(secs));
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.now_us.load(Ordering::SeqCst)
    }

    fn unix_secs(&self) -> i64 {
        self.wall_origin + (self.now_us() / 1_000_000) as i64
    }

    fn unix_us(&self) -> u64 {
        (self.wall_origin.max(0) as u64)
            .saturating_mul(1_000_000)
            .saturating_add(self.now_us())
    }
}

/// Converts seconds to microseconds, rounding to the nearest microsecond; negative and
/// non-finite inputs become 0, huge ones saturate.
pub fn secs_to_us(secs: f64) -> u64 {
    if !secs.is_finite() || secs <= 0.0 {
        return 0;
    }
    // `as` saturates on overflow.
    (secs * 1e6).round() as u64
}

#[cfg(test)]
mod tests {

    /// Times up to year 9999 are written; later ones (an envelope may say anything) are not,
    /// and nothing panics.
    #[test]
    fn rfc3339_seconds_writes_what_it_can_and_never_panics() {
        assert_eq!(
            rfc3339_seconds(1_766_592_000).as_deref(),
            Some("2025-12-24T16:00:00Z")
        );
        assert_eq!(
            rfc3339_seconds(253_402_300_799).as_deref(),
            Some("9999-12-31T23:59:59Z")
        );
        assert_eq!(rfc3339_seconds(253_402_300_800), None);
        assert_eq!(rfc3339_seconds(u64::MAX), None);
    }
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(1_700_000_000);
        assert_eq!(clock.now_us(), 0);
        clock.set_secs(0.8);
        assert_eq!(clock.now_us(), 800_000);
        clock.advance_us(200_000);
        assert_eq!(clock.now_us(), 1_000_000);
        assert_eq!(clock.unix_secs(), 1_700_000_001);
        let shared = clock.clone();
        shared.set_us(5);
        assert_eq!(clock.now_us(), 5);
    }

    #[test]
    fn secs_to_us_rounds_and_saturates() {
        assert_eq!(secs_to_us(0.5), 500_000);
        assert_eq!(secs_to_us(-1.0), 0);
        assert_eq!(secs_to_us(f64::NAN), 0);
        assert_eq!(secs_to_us(1e300), u64::MAX);
    }

    #[test]
    fn system_clock_is_monotonic() {
        let clock = SystemClock::new();
        let a = clock.now_us();
        let b = clock.now_us();
        assert!(b >= a);
        assert!(clock.unix_secs() > 1_600_000_000);
    }

    /// A reading the caller already holds gives the time `now_us` would have given then: between
    /// the readings taken just before and just after it. An instant before the clock's origin
    /// is 0, and the manual clock ignores the instant.
    #[test]
    fn now_us_at_reuses_a_reading_of_the_clock() {
        let before_origin = Instant::now();
        let clock = SystemClock::new();
        let a = clock.now_us();
        let at = Instant::now();
        let b = clock.now_us();
        let reused = clock.now_us_at(at);
        assert!(a <= reused && reused <= b, "{a} <= {reused} <= {b}");
        assert_eq!(clock.now_us_at(before_origin), 0);
        assert_eq!(
            clock.now_us_at(clock.origin + std::time::Duration::from_micros(1_234_567)),
            1_234_567
        );

        let manual = ManualClock::new(1_700_000_000);
        manual.set_us(42);
        assert_eq!(manual.now_us_at(Instant::now()), 42);
    }
}
