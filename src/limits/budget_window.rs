//! Cost budgets (`"algorithm": "cost_based"`, Fairvisor's field names): a spend budget per fixed
//! UTC window, and the staged actions taken as it fills. Pure: the window for a wall-clock
//! instant, the stage for a usage level. The store counts the spend exactly (see
//! [`crate::limits::limiter::check_window`]); the engine picks the stage after the store answered.

use crate::limits::limiter::{Window, US_PER_SEC};

/// The window a budget counts over. Windows are aligned on UTC, never on the first request: a
/// budget of 1 000 per day is 1 000 between two UTC midnights, the same on every gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// `5m`: `:00`, `:05`, ... of every hour.
    FiveMinutes,
    /// `1h`: every hour on the hour.
    Hour,
    /// `1d`: UTC midnight to midnight.
    Day,
    /// `7d`: Sunday 00:00 UTC to the next (Fairvisor aligns weeks on the epoch plus three days,
    /// a Sunday; tollgate keeps that so migrated budgets reset at the same moment).
    Week,
    /// `1M` / `month`: the calendar month, UTC (28 to 31 days).
    Month,
    /// `1w` (`llm_spend` rules): the ISO week, Monday 00:00 to the next Monday 00:00.
    IsoWeek,
}

const DAY: u64 = 86_400;
/// 1970-01-04, the first Sunday after the epoch.
const WEEK_ORIGIN: u64 = 3 * DAY;
/// 1970-01-05, the first Monday after the epoch.
const ISO_WEEK_ORIGIN: u64 = 4 * DAY;

impl Period {
    /// The period as a policy writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::FiveMinutes => "5m",
            Period::Hour => "1h",
            Period::Day => "1d",
            Period::Week => "7d",
            Period::Month => "1M",
            Period::IsoWeek => "1w",
        }
    }

    /// Parses an `llm_spend` rule's `period`: `1h`, `1d`, `1w` (Monday to Monday) or `1M`.
    pub fn parse_spend(text: &str) -> Option<Period> {
        match text {
            "1h" => Some(Period::Hour),
            "1d" => Some(Period::Day),
            "1w" => Some(Period::IsoWeek),
            "1M" => Some(Period::Month),
            _ => None,
        }
    }

    /// Parses a `period` value: `5m`, `1h`, `1d`, `7d` (as Fairvisor) or `1M` / `month`.
    pub fn parse(text: &str) -> Option<Period> {
        match text {
            "5m" => Some(Period::FiveMinutes),
            "1h" => Some(Period::Hour),
            "1d" => Some(Period::Day),
            "7d" => Some(Period::Week),
            "1M" | "month" => Some(Period::Month),
            _ => None,
        }
    }

    /// The nominal length in seconds, for `w` in `RateLimit-Policy` (a month counts 30 days).
    pub fn nominal_secs(self) -> u64 {
        match self {
            Period::FiveMinutes => 300,
            Period::Hour => 3_600,
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 30 * DAY,
            Period::IsoWeek => 7 * DAY,
        }
    }

    /// `[start, end)` in Unix seconds of the window holding `unix_secs`.
    pub fn bounds(self, unix_secs: u64) -> (u64, u64) {
        let fixed = |len: u64, origin: u64| {
            if unix_secs < origin {
                return (0, origin);
            }
            let start = (unix_secs - origin) / len * len + origin;
            (start, start + len)
        };
        match self {
            Period::FiveMinutes => fixed(300, 0),
            Period::Hour => fixed(3_600, 0),
            Period::Day => fixed(DAY, 0),
            Period::Week => fixed(7 * DAY, WEEK_ORIGIN),
            Period::IsoWeek => fixed(7 * DAY, ISO_WEEK_ORIGIN),
            Period::Month => {
                let (year, month, _) = civil_from_days(unix_secs / DAY);
                let start = days_from_civil(year, month, 1) * DAY;
                let (next_year, next_month) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                (start, days_from_civil(next_year, next_month, 1) * DAY)
            }
        }
    }

    /// The store's view of the window holding `unix_us`: its id (start second, never 0) and
    /// the microseconds left in it.
    pub fn window(self, unix_us: u64) -> Window {
        window_of(self.bounds(unix_us / US_PER_SEC), unix_us)
    }
}

/// The clock a budget's windows follow: UTC, or an IANA time zone (`llm_spend` rules'
/// `timezone`), whose days are 23 or 25 hours long when daylight saving time starts or ends.
#[derive(Debug, Clone, Default)]
pub enum Zone {
    #[default]
    Utc,
    /// A named zone from the IANA database built into the binary (no system files read).
    Named(std::sync::Arc<NamedZone>),
}

/// An IANA time zone with the name it was written as.
#[derive(Debug)]
pub struct NamedZone {
    pub name: String,
    tz: jiff::tz::TimeZone,
}

impl PartialEq for Zone {
    fn eq(&self, other: &Zone) -> bool {
        self.name() == other.name()
    }
}

impl Zone {
    /// The zone an IANA name (`America/New_York`, `UTC`, `Etc/GMT+5`) stands for; `None` when
    /// the database has no such zone.
    pub fn named(name: &str) -> Option<Zone> {
        if name == "UTC" {
            return Some(Zone::Utc);
        }
        let tz = jiff::tz::TimeZone::get(name).ok()?;
        Some(Zone::Named(std::sync::Arc::new(NamedZone {
            name: name.to_string(),
            tz,
        })))
    }

    /// The name as written (`UTC` for the default).
    pub fn name(&self) -> &str {
        match self {
            Zone::Utc => "UTC",
            Zone::Named(zone) => &zone.name,
        }
    }

    /// `[start, end)` in Unix seconds of the `period` holding `unix_secs`, on this zone's
    /// calendar: hours on the local hour, days from local midnight to the next, weeks from
    /// Monday, months from the 1st. A bound the zone cannot place (outside the years the
    /// database covers) falls back to UTC's.
    pub fn bounds(&self, period: Period, unix_secs: u64) -> (u64, u64) {
        match self {
            Zone::Utc => period.bounds(unix_secs),
            Zone::Named(zone) => zoned_bounds(&zone.tz, period, unix_secs)
                .unwrap_or_else(|| period.bounds(unix_secs)),
        }
    }

    /// The store's view of the window holding `unix_us` (see [`Period::window`]).
    pub fn window(&self, period: Period, unix_us: u64) -> Window {
        window_of(self.bounds(period, unix_us / US_PER_SEC), unix_us)
    }
}

/// The store's window for `[start, end)` (Unix seconds) seen at `unix_us`.
fn window_of((start, end): (u64, u64), unix_us: u64) -> Window {
    Window {
        // The window starting at the epoch itself still needs a non-zero id.
        id: start.max(1),
        ends_in_us: end
            .saturating_mul(US_PER_SEC)
            .saturating_sub(unix_us)
            .max(1),
    }
}

/// [`Zone::bounds`] in a named zone.
fn zoned_bounds(tz: &jiff::tz::TimeZone, period: Period, unix_secs: u64) -> Option<(u64, u64)> {
    let second = i64::try_from(unix_secs).ok()?;
    let now = jiff::Timestamp::from_second(second).ok()?;
    let seconds = |date: jiff::civil::Date| -> Option<u64> {
        let start = date.to_zoned(tz.clone()).ok()?;
        u64::try_from(start.timestamp().as_second()).ok()
    };
    let date = now.to_zoned(tz.clone()).date();
    let (first, next) = match period {
        // Local hours start where the offset puts them (a half-hour zone's hours at :30 UTC);
        // every hour is 3 600 s, the hour a clock change repeats or skips included.
        Period::Hour | Period::FiveMinutes => {
            let len: i64 = if period == Period::Hour { 3_600 } else { 300 };
            let offset = i64::from(tz.to_offset(now).seconds());
            let start = second - (second + offset).rem_euclid(len);
            return Some((u64::try_from(start).ok()?, u64::try_from(start + len).ok()?));
        }
        Period::Day => (date, date.tomorrow().ok()?),
        Period::Week | Period::IsoWeek => {
            let back = if period == Period::Week {
                date.weekday().to_sunday_zero_offset()
            } else {
                date.weekday().to_monday_zero_offset()
            };
            let first = date.checked_sub(jiff::Span::new().days(back)).ok()?;
            (first, first.checked_add(jiff::Span::new().days(7)).ok()?)
        }
        Period::Month => {
            let first = date.first_of_month();
            (first, first.checked_add(jiff::Span::new().months(1)).ok()?)
        }
    };
    Some((seconds(first)?, seconds(next)?))
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (H. Hinnant's algorithm,
/// restricted to dates from 1970 on).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days since 1970-01-01 of a date from 1970 on.
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// What a stage does once the budget's usage reaches its threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Allowed, with a warning header.
    Warn,
    /// Allowed after a delay (milliseconds, at most [`MAX_THROTTLE_MS`]), with a warning header.
    Throttle { delay_ms: u64 },
    /// Refused. Fairvisor requires one at 100 %: a request whose cost would take the usage past
    /// the budget is refused and its spend rolled back; a reject stage below 100 % acts on
    /// nothing until the budget is spent (as in Fairvisor).
    Reject,
}

/// The longest throttle delay (Fairvisor caps its sleep at 30 s too).
pub const MAX_THROTTLE_MS: u64 = 30_000;

/// One `staged_actions` entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stage {
    pub threshold_percent: f64,
    pub action: Action,
}

/// A compiled `cost_based` rule's budget-specific parts (the budget itself is the rule's quota
/// burst).
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub period: Period,
    /// Strictly ascending thresholds, ending with a reject at 100.
    pub stages: Vec<Stage>,
    /// The calendar its windows follow (UTC but for `llm_spend` rules with a `timezone`).
    pub zone: Zone,
    /// `notify_at`: the shares of the budget (strictly ascending, each in (0, 1]) whose
    /// crossing sends a webhook; empty for none.
    pub notify_at: Vec<f64>,
}

impl Budget {
    /// The store's view of the window holding `unix_us`, on the budget's calendar.
    pub fn window(&self, unix_us: u64) -> Window {
        self.zone.window(self.period, unix_us)
    }

    /// The warn or throttle stage an allowed request lands in, from the budget left after it:
    /// the highest threshold at or below the usage (a reject stage never applies to an allowed
    /// request).
    pub fn stage_for(&self, budget: u64, left: u64) -> Option<Action> {
        if budget == 0 {
            return None;
        }
        let used = budget.saturating_sub(left) as f64 * 100.0 / budget as f64;
        self.stages
            .iter()
            .rev()
            .filter(|s| s.action != Action::Reject)
            .find(|s| s.threshold_percent <= used)
            .map(|s| s.action)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 2026-11-22T12:34:56Z.
    const T: u64 = 1_795_350_896;

    #[test]
    fn fixed_windows_align_on_utc() {
        assert_eq!(
            Period::FiveMinutes.bounds(T),
            (1_795_350_600, 1_795_350_900)
        );
        assert_eq!(Period::Hour.bounds(T), (1_795_348_800, 1_795_352_400));
        // 2026-11-22T00:00:00Z to 2026-11-23T00:00:00Z.
        assert_eq!(Period::Day.bounds(T), (1_795_305_600, 1_795_392_000));
        // 2026-11-22 is a Sunday: its week starts that midnight.
        assert_eq!(Period::Week.bounds(T), (1_795_305_600, 1_795_910_400));
        assert_eq!(Period::Week.bounds(1_795_305_599).1, 1_795_305_600);
    }

    #[test]
    fn calendar_months_have_their_own_lengths() {
        // November 2026: 30 days from 2026-11-01T00:00:00Z.
        assert_eq!(Period::Month.bounds(T), (1_793_491_200, 1_796_083_200));
        // February 2028 (leap year): 29 days.
        let (s, e) = Period::Month.bounds(1_833_000_000); // 2028-02-01T...
        assert_eq!((s, e - s), (1_832_976_000, 29 * DAY));
        // December rolls into January.
        let (s, e) = Period::Month.bounds(1_798_761_600 - 1); // 2026-12-31T23:59:59Z
        assert_eq!((s, e), (1_796_083_200, 1_798_761_600));
        assert_eq!(Period::Month.bounds(1_798_761_600).0, 1_798_761_600);
    }

    /// Issue 54: calendar windows in an IANA zone, daylight-saving days included.
    #[test]
    fn zoned_windows_follow_the_local_calendar() {
        let ny = Zone::named("America/New_York").unwrap();
        // 2026-03-08 starts daylight saving time in New York: 23 hours.
        let (s, e) = ny.bounds(Period::Day, 1_772_946_000 + 3_600);
        assert_eq!((s, e), (1_772_946_000, 1_773_028_800));
        assert_eq!(e - s, 23 * 3_600);
        // 2026-11-01 ends it: 25 hours.
        let (s, e) = ny.bounds(Period::Day, 1_793_505_600 + 20 * 3_600);
        assert_eq!((s, e), (1_793_505_600, 1_793_595_600));
        assert_eq!(e - s, 25 * 3_600);
        // 2027-01-15T08:00:00Z is 03:00 in New York: its day began at 05:00 UTC.
        let t = 1_800_000_000;
        assert_eq!(ny.bounds(Period::Day, t), (1_799_989_200, 1_800_075_600));
        // Its ISO week began on Monday the 11th, its month on the 1st, both at local midnight.
        assert_eq!(
            ny.bounds(Period::IsoWeek, t),
            (1_799_643_600, 1_800_248_400)
        );
        assert_eq!(ny.bounds(Period::Month, t), (1_798_779_600, 1_801_458_000));
        // The last second of January is still January in New York (February in UTC).
        assert_eq!(ny.bounds(Period::Month, 1_801_458_000 - 1).1, 1_801_458_000);
        assert_eq!(ny.bounds(Period::Month, 1_801_458_000).0, 1_801_458_000);
        // Hours follow the offset: Kolkata (+05:30) is at 13:30, its hour began at 13:00.
        let kolkata = Zone::named("Asia/Kolkata").unwrap();
        assert_eq!(
            kolkata.bounds(Period::Hour, t),
            (1_799_998_200, 1_800_001_800)
        );
        // The store's window: its id the start, counting down to the local midnight.
        let w = ny.window(Period::Day, t * US_PER_SEC);
        assert_eq!((w.id, w.ends_in_us), (1_799_989_200, 75_600 * US_PER_SEC));
        assert_eq!(Zone::named("UTC"), Some(Zone::Utc));
        assert_eq!(Zone::named("Mars/Olympus"), None);
        assert_eq!(Zone::Utc.bounds(Period::Day, t), Period::Day.bounds(t));
        // UTC's ISO weeks start on Monday too.
        assert_eq!(Period::IsoWeek.bounds(t).0, 1_799_625_600);
    }

    #[test]
    fn the_store_window_counts_down_to_its_end() {
        let w = Period::Hour.window(T * US_PER_SEC + 250_000);
        assert_eq!(w.id, 1_795_348_800);
        assert_eq!(w.ends_in_us, (1_795_352_400 - T) * US_PER_SEC - 250_000);
    }

    #[test]
    fn stages_pick_the_highest_threshold_reached() {
        let budget = Budget {
            notify_at: Vec::new(),
            period: Period::Hour,
            stages: vec![
                Stage {
                    threshold_percent: 80.0,
                    action: Action::Warn,
                },
                Stage {
                    threshold_percent: 95.0,
                    action: Action::Throttle { delay_ms: 200 },
                },
                Stage {
                    threshold_percent: 100.0,
                    action: Action::Reject,
                },
            ],
            zone: Zone::Utc,
        };
        assert_eq!(budget.stage_for(100, 21), None);
        assert_eq!(budget.stage_for(100, 20), Some(Action::Warn));
        assert_eq!(
            budget.stage_for(100, 5),
            Some(Action::Throttle { delay_ms: 200 })
        );
        // Spent exactly: allowed, throttled (the reject stage is for the next request).
        assert_eq!(
            budget.stage_for(100, 0),
            Some(Action::Throttle { delay_ms: 200 })
        );
    }

    proptest! {
        #[test]
        fn every_instant_lies_in_its_window(t in 0u64..4_102_444_800) {
            for period in [Period::FiveMinutes, Period::Hour, Period::Day, Period::Week, Period::Month, Period::IsoWeek] {
                let (start, end) = period.bounds(t);
                prop_assert!(start <= t && t < end);
                // The next window starts where this one ends.
                prop_assert_eq!(period.bounds(end).0, end);
                if period == Period::Month {
                    prop_assert!((28 * DAY..=31 * DAY).contains(&(end - start)));
                    let (_, _, day) = civil_from_days(start / DAY);
                    prop_assert_eq!(day, 1);
                }
            }
        }

        #[test]
        fn every_instant_lies_in_its_zoned_window(t in 0u64..4_102_444_800) {
            let zone = Zone::named("America/New_York").unwrap();
            for period in [Period::Hour, Period::Day, Period::IsoWeek, Period::Month] {
                let (start, end) = zone.bounds(period, t);
                prop_assert!(start <= t && t < end);
                prop_assert_eq!(zone.bounds(period, end).0, end);
            }
            let (start, end) = zone.bounds(Period::Day, t);
            prop_assert!([23 * 3_600, 24 * 3_600, 25 * 3_600].contains(&(end - start)));
        }

        #[test]
        fn civil_dates_round_trip(days in 0u64..1_000_000) {
            let (y, m, d) = civil_from_days(days);
            prop_assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
