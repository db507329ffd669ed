//! Quota tiers (`10/s`, `500/min`, `100000/day`, `2000000/month`) parsed once into types
//! that cannot be wrong, with the window arithmetic every other module relies on.
//!
//! Short tiers are *rolling*: no window of that length, wherever it starts, may hold more
//! than the limit. Day and month tiers are *calendar* tiers: the provider resets them at
//! midnight / the first of the month in a time zone (UTC unless configured), so they are
//! counters per calendar window.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{Datelike, NaiveDate, TimeZone};
pub use chrono_tz::{self, Tz};
use serde::{Deserialize, Serialize};

use crate::time::UnixMillis;

/// How a tier's window is laid out in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Period {
    /// Any window of this length (at least 1 ms) holds at most `limit` units.
    Rolling(Duration),
    /// Each calendar day in the quota's time zone holds at most `limit` units.
    Day,
    /// Each calendar month in the quota's time zone holds at most `limit` units.
    Month,
}

/// One quota tier: at most `limit` units per `period`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tier {
    pub limit: u64,
    pub period: Period,
}

/// Why a tier did not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierParseError {
    #[error("`{0}` is not LIMIT/PERIOD (for example 10/s, 500/min, 100000/day, 3/5s)")]
    Shape(String),
    #[error("limit `{0}` is not a positive whole number")]
    Limit(String),
    #[error("unknown period `{0}` (use s, min, h, day, month or a duration such as 250ms, 5s, 2h)")]
    Period(String),
}

impl FromStr for Tier {
    type Err = TierParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (limit, period) = text.split_once('/').ok_or_else(|| TierParseError::Shape(text.to_owned()))?;
        let limit = limit.trim();
        let limit: u64 = limit.parse().ok().filter(|l| *l > 0).ok_or_else(|| TierParseError::Limit(limit.to_owned()))?;
        let period = parse_period(period.trim())?;
        Ok(Self { limit, period })
    }
}

fn parse_period(text: &str) -> Result<Period, TierParseError> {
    let rolling = |secs: u64| Ok(Period::Rolling(Duration::from_secs(secs)));
    match text {
        "s" | "sec" | "second" => rolling(1),
        "m" | "min" | "minute" => rolling(60),
        "h" | "hr" | "hour" => rolling(3_600),
        "d" | "day" => Ok(Period::Day),
        "mo" | "month" => Ok(Period::Month),
        other => match humantime::parse_duration(other) {
            Ok(d) if d >= Duration::from_millis(1) => Ok(Period::Rolling(d)),
            _ => Err(TierParseError::Period(other.to_owned())),
        },
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.period {
            Period::Rolling(d) if d == Duration::from_secs(1) => write!(f, "{}/s", self.limit),
            Period::Rolling(d) if d == Duration::from_secs(60) => write!(f, "{}/min", self.limit),
            Period::Rolling(d) if d == Duration::from_secs(3_600) => write!(f, "{}/h", self.limit),
            Period::Rolling(d) => write!(f, "{}/{}", self.limit, humantime::format_duration(d)),
            Period::Day => write!(f, "{}/day", self.limit),
            Period::Month => write!(f, "{}/month", self.limit),
        }
    }
}

impl Serialize for Tier {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Tier {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl Tier {
    /// Nominal window length, for rates and reports (a month counts as 30 days).
    #[must_use]
    pub fn nominal_window(&self) -> Duration {
        match self.period {
            Period::Rolling(d) => d,
            Period::Day => Duration::from_secs(86_400),
            Period::Month => Duration::from_secs(30 * 86_400),
        }
    }

    /// The tier's rate in units per second.
    #[must_use]
    pub fn rate_per_second(&self) -> f64 {
        self.limit as f64 / self.nominal_window().as_secs_f64()
    }

    /// True for day and month tiers.
    #[must_use]
    pub fn is_calendar(&self) -> bool {
        matches!(self.period, Period::Day | Period::Month)
    }

    /// The state-store key counting this calendar tier's usage in the window holding `now`.
    #[must_use]
    pub fn usage_key(&self, zone: Tz, now: UnixMillis) -> String {
        format!("usage#{self}#{}", self.window_at(zone, now).0 .0)
    }

    /// For a calendar tier, the `[start, end)` of the calendar window holding `now`.
    /// For a rolling tier, the window of its length ending just after `now`.
    #[must_use]
    pub fn window_at(&self, zone: Tz, now: UnixMillis) -> (UnixMillis, UnixMillis) {
        match self.period {
            Period::Rolling(d) => (now.minus(d).plus(Duration::from_millis(1)), now.plus(Duration::from_millis(1))),
            Period::Day | Period::Month => calendar_window(self.period, zone, now),
        }
    }
}

fn calendar_window(period: Period, zone: Tz, now: UnixMillis) -> (UnixMillis, UnixMillis) {
    let utc = i64::try_from(now.0).ok().and_then(chrono::DateTime::from_timestamp_millis).unwrap_or_default();
    let local = utc.with_timezone(&zone).date_naive();
    let (start, end) = match period {
        Period::Month => {
            let first = local.with_day(1).unwrap_or(local);
            let next =
                if first.month() == 12 { NaiveDate::from_ymd_opt(first.year() + 1, 1, 1) } else { NaiveDate::from_ymd_opt(first.year(), first.month() + 1, 1) };
            (first, next.unwrap_or(first))
        }
        _ => (local, local.succ_opt().unwrap_or(local)),
    };
    (local_midnight(zone, start), local_midnight(zone, end))
}

/// The first instant of `date` in `zone` (midnight, or the first valid time after a DST gap).
fn local_midnight(zone: Tz, date: NaiveDate) -> UnixMillis {
    let mut naive = date.and_hms_opt(0, 0, 0).unwrap_or_default();
    for _ in 0..4 {
        if let Some(t) = zone.from_local_datetime(&naive).earliest() {
            return UnixMillis(u64::try_from(t.timestamp_millis()).unwrap_or(0));
        }
        naive += chrono::Duration::minutes(30);
    }
    UnixMillis(u64::try_from(naive.and_utc().timestamp_millis()).unwrap_or(0))
}

/// A lane's whole quota: every tier, the time zone of its calendar resets, and the
/// safety margin added to rolling windows to absorb network jitter.
#[derive(Clone, Debug, PartialEq)]
pub struct Quota {
    tiers: Vec<Tier>,
    zone: Tz,
    safety_margin: Duration,
}

/// Why a quota is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuotaError {
    #[error("no tiers: give at least one, for example tiers = [\"10/s\"]")]
    Empty,
    #[error("tier {0} is given twice")]
    Duplicate(Tier),
}

impl Quota {
    /// Builds a quota, refusing an empty or repeated tier list.
    ///
    /// # Errors
    /// [`QuotaError`] naming the problem.
    pub fn new(tiers: Vec<Tier>, zone: Tz, safety_margin: Duration) -> Result<Self, QuotaError> {
        if tiers.is_empty() {
            return Err(QuotaError::Empty);
        }
        for (i, t) in tiers.iter().enumerate() {
            if tiers[..i].iter().any(|u| u.period == t.period) {
                return Err(QuotaError::Duplicate(*t));
            }
        }
        Ok(Self { tiers, zone, safety_margin })
    }

    /// Every tier, in the order given.
    #[must_use]
    pub fn tiers(&self) -> &[Tier] {
        &self.tiers
    }

    /// The time zone calendar tiers reset in.
    #[must_use]
    pub fn zone(&self) -> Tz {
        self.zone
    }

    /// Added to each rolling window, to absorb network jitter.
    #[must_use]
    pub fn safety_margin(&self) -> Duration {
        self.safety_margin
    }

    /// The tier whose rate is lowest: the one that binds a steady backlog.
    #[must_use]
    pub fn binding_tier(&self) -> &Tier {
        self.tiers.iter().min_by(|a, b| a.rate_per_second().total_cmp(&b.rate_per_second())).unwrap_or(&self.tiers[0])
    }

    /// The steady rate the rolling tiers allow, in units per second: the pace of a backlog
    /// while the calendar tiers have room. Infinite when every tier is a calendar one.
    #[must_use]
    pub fn rolling_rate_per_second(&self) -> f64 {
        self.tiers.iter().filter(|t| !t.is_calendar()).map(Tier::rate_per_second).fold(f64::INFINITY, f64::min)
    }

    /// About how long `units` take from `now`: the rolling tiers' steady rate, and the
    /// resets each calendar tier must wait for given what it used in its current window
    /// (`calendar_used`, by tier index; rolling tiers' entries are ignored). An estimate
    /// for `paceline status`, not a promise.
    #[must_use]
    pub fn drain_estimate(&self, units: u64, calendar_used: &[u64], now: UnixMillis) -> Duration {
        let rolling_rate = self.rolling_rate_per_second();
        let mut seconds = if rolling_rate.is_finite() { units as f64 / rolling_rate } else { 0.0 };
        for (tier, used) in self.tiers.iter().zip(calendar_used).filter(|(t, _)| t.is_calendar()) {
            let left = tier.limit.saturating_sub(*used);
            if units > left {
                let (_, reset) = tier.window_at(self.zone, now);
                let windows_after_reset = (units - left).div_ceil(tier.limit.max(1));
                let wait = reset.since(now) + tier.nominal_window() * u32::try_from(windows_after_reset - 1).unwrap_or(u32::MAX);
                seconds = seconds.max(wait.as_secs_f64());
            }
        }
        Duration::from_secs_f64(seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(s: &str) -> Tier {
        s.parse().unwrap()
    }

    #[test]
    fn drain_estimate_takes_the_slowest_rate_and_waits_for_calendar_resets() {
        let quota = Quota::new(vec![tier("10/s"), tier("500/min"), tier("1000/day")], chrono_tz::UTC, Duration::ZERO).unwrap();
        let noon = UnixMillis(1_795_348_800_000); // 2026-11-22T12:00:00Z
                                                  // 500/min binds: 300 units take 36 s; the day tier has room.
        assert_eq!(quota.drain_estimate(300, &[0, 0, 0], noon), Duration::from_secs(36));
        // The day tier has 100 left: the rest waits for midnight (12 h), then one day is enough.
        assert_eq!(quota.drain_estimate(300, &[0, 0, 900], noon), Duration::from_secs(12 * 3600));
        // 2100 more than is left needs midnight plus two more days.
        assert_eq!(quota.drain_estimate(2200, &[0, 0, 900], noon), Duration::from_secs(12 * 3600 + 2 * 86_400));
    }

    #[test]
    fn parses_units_and_durations() {
        assert_eq!(tier("10/s"), Tier { limit: 10, period: Period::Rolling(Duration::from_secs(1)) });
        assert_eq!(tier("500 / min").period, Period::Rolling(Duration::from_secs(60)));
        assert_eq!(tier("3/250ms").period, Period::Rolling(Duration::from_millis(250)));
        assert_eq!(tier("100000/day").period, Period::Day);
        assert_eq!(tier("2000000/month").period, Period::Month);
        assert_eq!(tier("7/5s").to_string(), "7/5s");
        assert_eq!(tier("500/minute").to_string(), "500/min");
    }

    #[test]
    fn refuses_bad_tiers_with_a_reason() {
        assert_eq!("10".parse::<Tier>(), Err(TierParseError::Shape("10".into())));
        assert_eq!("0/s".parse::<Tier>(), Err(TierParseError::Limit("0".into())));
        assert_eq!("ten/s".parse::<Tier>(), Err(TierParseError::Limit("ten".into())));
        assert_eq!("10/fortnight".parse::<Tier>(), Err(TierParseError::Period("fortnight".into())));
    }

    #[test]
    fn day_window_follows_the_time_zone() {
        // 2026-03-08 is the US spring-forward day: it lasts 23 hours in New York.
        let noon_utc = UnixMillis(1_772_971_200_000); // 2026-03-08T12:00:00Z
        let (start, end) = tier("1/day").window_at(chrono_tz::America::New_York, noon_utc);
        assert_eq!(start.to_rfc3339(), "2026-03-08T05:00:00.000Z");
        assert_eq!(end.to_rfc3339(), "2026-03-09T04:00:00.000Z");
        let (start, end) = tier("1/day").window_at(chrono_tz::UTC, noon_utc);
        assert_eq!((start.to_rfc3339(), end.to_rfc3339()), ("2026-03-08T00:00:00.000Z".into(), "2026-03-09T00:00:00.000Z".into()));
    }

    #[test]
    fn month_window_rolls_over_the_year() {
        let dec = UnixMillis(1_796_000_000_000); // 2026-11-28
        let (start, end) = tier("1/month").window_at(chrono_tz::Asia::Tokyo, dec);
        assert_eq!(start.to_rfc3339(), "2026-10-31T15:00:00.000Z");
        assert_eq!(end.to_rfc3339(), "2026-11-30T15:00:00.000Z");
        let (_, end) = tier("1/month").window_at(chrono_tz::UTC, UnixMillis(1_798_000_000_000)); // 2026-12-23
        assert_eq!(end.to_rfc3339(), "2027-01-01T00:00:00.000Z");
    }

    #[test]
    fn quota_refuses_empty_and_duplicate_tiers() {
        assert_eq!(Quota::new(vec![], chrono_tz::UTC, Duration::ZERO), Err(QuotaError::Empty));
        assert!(matches!(Quota::new(vec![tier("1/s"), tier("2/s")], chrono_tz::UTC, Duration::ZERO), Err(QuotaError::Duplicate(_))));
        let q = Quota::new(vec![tier("10/s"), tier("500/min")], chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(q.binding_tier().to_string(), "500/min");
    }
}
