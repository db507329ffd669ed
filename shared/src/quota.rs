//! Quota tiers (`10/s`, `500/min`, `100000/day`, `2000000/month`) parsed once into types
//! that cannot be wrong, with the window arithmetic every other module relies on.
//!
//! Short tiers are *rolling*: no window of that length, wherever it starts, may hold more
//! than the limit. Day and month tiers are *calendar* tiers: the provider resets them at
//! midnight / the first of the month in a time zone (UTC unless configured), so they are
//! counters per calendar window.
//!
//! A rolling tier may say how the provider counts it, after the rate:
//! - `2/s burst=40`: a bucket that holds 40 units and refills at 2 per second (token or
//!   leaky bucket): up to 40 calls at once, then 2 per second;
//! - `1000/h smooth`: spread evenly (one call every 3.6 s) even though a shorter tier
//!   would allow faster, for providers that want a steady pace.
//!
//! Without either, the shortest rolling tier spaces calls evenly and longer ones are
//! sliding windows that a backlog may fill at the shortest tier's pace (see the pacer).

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

/// How calls may be spread within a rolling tier (calendar tiers are always `Window`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Spread {
    /// A sliding window: any window of the tier's length holds at most the limit. The
    /// shortest rolling tier is spaced evenly besides (see the pacer).
    #[default]
    Window,
    /// Evenly spaced, one unit every `period / limit` (`smooth`).
    Smooth,
    /// A bucket that holds this many units and refills at the tier's rate (`burst=N`).
    Burst(u64),
}

/// One quota tier: at most `limit` units per `period`, spread as `spread` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tier {
    pub limit: u64,
    pub period: Period,
    pub spread: Spread,
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
    #[error("period `{0}` is longer than a year (a calendar tier, `/month`, counts longer use)")]
    PeriodTooLong(String),
    #[error("unknown option `{0}` (a rolling tier takes `burst=N` or `smooth`, for example \"2/s burst=40\")")]
    Option(String),
    #[error("`{0}` applies to rolling tiers only (day and month tiers are counters per calendar window)")]
    CalendarOption(String),
    #[error("a tier is either `smooth` or has a `burst`, not both")]
    SmoothAndBurst,
}

impl FromStr for Tier {
    type Err = TierParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (limit, rest) = text.split_once('/').ok_or_else(|| TierParseError::Shape(text.to_owned()))?;
        let limit = limit.trim();
        let limit: u64 = limit.parse().ok().filter(|l| *l > 0).ok_or_else(|| TierParseError::Limit(limit.to_owned()))?;
        let mut words = rest.split_whitespace();
        let period = parse_period(words.next().unwrap_or(""))?;
        let mut spread = Spread::Window;
        for option in words {
            let next = match option.split_once('=') {
                None if option == "smooth" => Spread::Smooth,
                Some(("burst", units)) => Spread::Burst(units.parse().ok().filter(|b| *b > 0).ok_or_else(|| TierParseError::Option(option.to_owned()))?),
                _ => return Err(TierParseError::Option(option.to_owned())),
            };
            if matches!(period, Period::Day | Period::Month) {
                return Err(TierParseError::CalendarOption(option.to_owned()));
            }
            spread = match (spread, next) {
                (Spread::Window, next) => next,
                (Spread::Smooth, Spread::Smooth) => Spread::Smooth,
                (Spread::Burst(_), Spread::Burst(units)) => Spread::Burst(units),
                _ => return Err(TierParseError::SmoothAndBurst),
            };
        }
        Ok(Self { limit, period, spread })
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
            Ok(d) if d > crate::time::LONGEST_SETTING => Err(TierParseError::PeriodTooLong(other.to_owned())),
            Ok(d) if d >= Duration::from_millis(1) => Ok(Period::Rolling(d)),
            _ => Err(TierParseError::Period(other.to_owned())),
        },
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_rate(f)?;
        match self.spread {
            Spread::Window => Ok(()),
            Spread::Smooth => write!(f, " smooth"),
            Spread::Burst(units) => write!(f, " burst={units}"),
        }
    }
}

impl Tier {
    /// The rate alone (`10/s`), without the spread options.
    fn fmt_rate(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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

    /// The most units one job may weigh: the limit, or the bucket of a `burst` tier.
    #[must_use]
    pub fn max_cost(&self) -> u64 {
        match self.spread {
            Spread::Burst(units) => units,
            Spread::Window | Spread::Smooth => self.limit,
        }
    }

    /// The most units one window of the tier's length may hold: its limit, or for a
    /// bucket its burst plus one window's refill.
    #[must_use]
    pub fn max_in_one_window(&self) -> u64 {
        match self.spread {
            Spread::Burst(units) => units + self.limit,
            Spread::Window | Spread::Smooth => self.limit,
        }
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

/// How reports word a tier's use, given its share: "2.5% of the day used" for a day or
/// month tier, "achieved rate 99.0% of the tier's" for a rolling one (whose busiest
/// window is reported apart, as a count of its limit).
#[must_use]
pub fn describe_use(tier: &str, calendar: bool, share: f64) -> String {
    let percent = share * 100.0;
    match (calendar, tier.ends_with("/month")) {
        (true, true) => format!("{percent:.1}% of the month used"),
        (true, false) => format!("{percent:.1}% of the day used"),
        (false, _) => format!("achieved rate {percent:.1}% of the tier's"),
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
    /// Index of the shortest rolling tier, which spaces calls evenly.
    spacing: Option<usize>,
    /// Each gap between calls at least the spacing tier's interval, rounded up to the
    /// millisecond, so that a strict bucket at the provider's rate never sees two calls
    /// too close (`true`, a lane's own quota); or the spacing's schedule kept exactly on
    /// average, a gap a millisecond shorter where the interval is not a whole number of
    /// them (`false`, a shard's share: its calls interleave with the other shards' anyway,
    /// and rounding each gap up would cost a 990/s share half its calls).
    strict_gaps: bool,
    /// The most calls in flight at the API at once, across all workers.
    max_in_flight: Option<u32>,
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
        let spacing = tiers.iter().enumerate().filter_map(|(i, t)| match t.period {
            Period::Rolling(d) => Some((d, i)),
            Period::Day | Period::Month => None,
        });
        let spacing = spacing.min().map(|(_, i)| i);
        Ok(Self { tiers, zone, safety_margin, spacing, strict_gaps: true, max_in_flight: None })
    }

    /// Shard `index`'s share of this quota when `shards` shards divide it: each rolling
    /// tier's limit (and a `burst` tier's bucket) split as evenly as whole units allow,
    /// the first shards taking one unit more, so the shares add up to the whole and no
    /// window of any tier holds more than its limit across the shards. A day or month
    /// tier stays whole: the shards reserve its units from one counter in the store
    /// ([`StackDocuments::reserve_shared`](crate::ports::StackDocuments::reserve_shared)),
    /// which never passes it, so a busy shard can spend what an idle one does not.
    ///
    /// # Errors
    /// A rolling tier too small for every shard to have a unit of it, named.
    pub fn share(&self, index: usize, shards: usize) -> Result<Self, String> {
        let shards = shards.max(1) as u64;
        let part = |whole: u64| whole / shards + u64::from((index as u64) < whole % shards);
        let mut tiers = Vec::with_capacity(self.tiers.len());
        for tier in &self.tiers {
            if tier.is_calendar() {
                tiers.push(*tier);
                continue;
            }
            if tier.limit < shards {
                return Err(format!("tier {tier} cannot be divided among {shards} shards: each needs at least one unit of it"));
            }
            let spread = match tier.spread {
                Spread::Burst(bucket) if bucket < shards => {
                    return Err(format!("tier {tier} cannot be divided among {shards} shards: each needs at least one unit of its burst"));
                }
                Spread::Burst(bucket) => Spread::Burst(part(bucket)),
                other => other,
            };
            tiers.push(Tier { limit: part(tier.limit), spread, ..*tier });
        }
        Ok(Self { tiers, ..self.clone() })
    }

    /// The same quota with `tiers` in place of its own, period for period (a shard's share
    /// of it: see `shares::quota_of_parts`).
    ///
    /// # Panics
    /// Tiers that are not this quota's periods in its order.
    #[must_use]
    pub fn with_tiers(&self, tiers: Vec<Tier>) -> Self {
        assert!(tiers.iter().map(|t| t.period).eq(self.tiers.iter().map(|t| t.period)), "the same periods in the same order");
        Self { tiers, ..self.clone() }
    }

    /// A quota of no tiers: it admits every call. The shared quota of lanes that are
    /// different APIs with nothing in common (a config with `[lanes]` and no `[quota]`).
    #[must_use]
    pub fn unlimited(zone: Tz, safety_margin: Duration) -> Self {
        Self { tiers: Vec::new(), zone, safety_margin, spacing: None, strict_gaps: true, max_in_flight: None }
    }

    /// The same quota with at most `max_in_flight` calls in flight at once (`None`: no
    /// cap). Each call then holds one of that many slots in the state store.
    #[must_use]
    pub fn with_max_in_flight(self, max_in_flight: Option<u32>) -> Self {
        Self { max_in_flight, ..self }
    }

    /// The same quota with its windows widened by `safety_margin` instead
    /// (`simulate --safety-margin`), its cap of calls in flight kept.
    ///
    /// # Errors
    /// The [`QuotaError`] of a margin its tiers do not fit.
    pub fn with_safety_margin(&self, safety_margin: Duration) -> Result<Self, QuotaError> {
        let quota = if self.tiers.is_empty() { Self::unlimited(self.zone, safety_margin) } else { Self::new(self.tiers.clone(), self.zone, safety_margin)? };
        Ok(quota.with_max_in_flight(self.max_in_flight))
    }

    /// The most calls in flight at the API at once, if capped.
    #[must_use]
    pub fn max_in_flight(&self) -> Option<u32> {
        self.max_in_flight
    }

    /// The shortest rolling tier: it spaces calls evenly (unless it has a `burst`), and
    /// longer tiers without options are sliding windows filled at its pace.
    #[must_use]
    pub fn spacing_tier(&self) -> Option<usize> {
        self.spacing
    }

    /// Whether every gap between calls is at least the spacing tier's interval (see the
    /// field).
    #[must_use]
    pub fn strict_gaps(&self) -> bool {
        self.strict_gaps
    }

    /// The same quota keeping its spacing's schedule on average, not each gap (a shard's
    /// share of a shared quota).
    #[must_use]
    pub fn with_gaps_on_average(self) -> Self {
        Self { strict_gaps: false, ..self }
    }

    /// The first tier a job of `cost` units can never fit in (over its whole limit, or
    /// its bucket for a `burst` tier), if one.
    #[must_use]
    pub fn tier_too_small_for(&self, cost: u64) -> Option<&Tier> {
        self.tiers.iter().find(|tier| cost > tier.max_cost())
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

    /// The pace of a backlog while every window has room, in units per second: the
    /// slowest evenly spaced tier (the shortest rolling tier, `smooth` and `burst` tiers
    /// at their rate). Infinite when every tier is a calendar one.
    #[must_use]
    pub fn pace_per_second(&self) -> f64 {
        let spaced = |(i, t): &(usize, &Tier)| !t.is_calendar() && (self.spacing == Some(*i) || t.spread != Spread::Window);
        self.tiers.iter().enumerate().filter(spaced).map(|(_, t)| t.rate_per_second()).fold(f64::INFINITY, f64::min)
    }

    /// The long-run rate of a backlog in units per second: the slowest rolling tier's
    /// limit over its window (a `500/min` beside a `10/s` holds it to 8.3/s). Infinite
    /// when every tier is a calendar one.
    #[must_use]
    pub fn sustained_per_second(&self) -> f64 {
        self.tiers.iter().filter(|t| !t.is_calendar()).map(Tier::rate_per_second).fold(f64::INFINITY, f64::min)
    }

    /// About how long `units` take from `now`: the pace, the windows a longer rolling
    /// tier fills and must wait out, and the resets each calendar tier must wait for
    /// given what it used in its current window (`calendar_used`, by tier index; rolling
    /// tiers' entries are ignored). An estimate for `paceline status`, not a promise.
    #[must_use]
    pub fn drain_estimate(&self, units: u64, calendar_used: &[u64], now: UnixMillis) -> Duration {
        let pace = self.pace_per_second();
        let mut seconds = if pace.is_finite() { units as f64 / pace } else { 0.0 };
        for tier in self.tiers.iter().filter(|t| !t.is_calendar()) {
            let windows_waited = units.saturating_sub(1) / tier.limit;
            seconds = seconds.max(windows_waited as f64 * tier.nominal_window().as_secs_f64());
        }
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

    /// Another margin keeps the quota's tiers, zone and cap of calls in flight
    /// (`simulate --safety-margin` rebuilt the quota from its tiers and dropped the cap),
    /// and an unlimited quota stays unlimited.
    #[test]
    fn a_quota_given_another_margin_keeps_its_tiers_and_its_cap_of_calls_in_flight() {
        let quota = Quota::new(vec![tier("10/s"), tier("1000/day")], chrono_tz::Europe::Paris, Duration::from_millis(10)).unwrap().with_max_in_flight(Some(5));
        let wider = quota.with_safety_margin(Duration::from_millis(100)).unwrap();
        assert_eq!((wider.tiers(), wider.zone(), wider.max_in_flight()), (quota.tiers(), quota.zone(), Some(5)));
        assert_eq!(wider.safety_margin(), Duration::from_millis(100));
        let unlimited = Quota::unlimited(chrono_tz::UTC, Duration::ZERO).with_safety_margin(Duration::from_millis(20)).unwrap();
        assert!(unlimited.tiers().is_empty() && unlimited.safety_margin() == Duration::from_millis(20));
    }

    /// Shards' shares of a rolling tier add up to its whole limit (and bucket), none
    /// empty; a rolling tier smaller than the shards is refused, named; a day or month
    /// tier stays whole in every share (the shards reserve it from one counter).
    #[test]
    fn shards_shares_of_a_quota_add_up_to_each_rolling_tier_and_a_tier_too_small_is_refused() {
        let quota = Quota::new(vec![tier("10/s burst=7"), tier("1000/min"), tier("100003/day")], chrono_tz::UTC, Duration::from_millis(10)).unwrap();
        let shares: Vec<Quota> = (0..4).map(|index| quota.share(index, 4).unwrap()).collect();
        for (index, whole) in quota.tiers().iter().enumerate().filter(|(_, tier)| !tier.is_calendar()) {
            let limits: Vec<u64> = shares.iter().map(|share| share.tiers()[index].limit).collect();
            assert_eq!(limits.iter().sum::<u64>(), whole.limit, "{whole}: {limits:?}");
            assert!(limits.iter().all(|limit| limit * 4 >= whole.limit - 3), "{whole}: {limits:?}");
        }
        assert!(shares.iter().all(|share| share.tiers()[2] == quota.tiers()[2]), "the day tier whole in every share");
        assert!(Quota::new(vec![tier("3/day")], chrono_tz::UTC, Duration::ZERO).unwrap().share(3, 4).is_ok(), "a day tier of fewer units than shards");
        let buckets: Vec<u64> = shares
            .iter()
            .map(|share| match share.tiers()[0].spread {
                Spread::Burst(bucket) => bucket,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(buckets, [2, 2, 2, 1]);
        assert_eq!(shares[0].safety_margin(), quota.safety_margin());
        assert_eq!(quota.share(0, 1).unwrap(), quota);
        let error = Quota::new(vec![tier("3/s")], chrono_tz::UTC, Duration::ZERO).unwrap().share(0, 4).unwrap_err();
        assert!(error.contains("3/s") && error.contains("4 shards"), "{error}");
    }

    #[test]
    fn drain_estimate_takes_the_pace_the_windows_and_the_calendar_resets() {
        let quota = Quota::new(vec![tier("10/s"), tier("500/min"), tier("1000/day")], chrono_tz::UTC, Duration::ZERO).unwrap();
        let noon = UnixMillis(1_795_348_800_000); // 2026-11-22T12:00:00Z
                                                  // 300 units go at 10/s within one minute's 500: 30 s; the day tier has room.
        assert_eq!(quota.drain_estimate(300, &[0, 0, 0], noon), Duration::from_secs(30));
        // 2,100 units fill four minutes' windows (210 s at 10/s would be too fast) and
        // go on in the fifth.
        let no_day = Quota::new(vec![tier("10/s"), tier("500/min")], chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(no_day.drain_estimate(2_100, &[0, 0], noon), Duration::from_secs(240));
        // The day tier has 100 left: the rest waits for midnight (12 h), then one day is enough.
        assert_eq!(quota.drain_estimate(300, &[0, 0, 900], noon), Duration::from_secs(12 * 3600));
        // 2100 more than is left needs midnight plus two more days.
        assert_eq!(quota.drain_estimate(2200, &[0, 0, 900], noon), Duration::from_secs(12 * 3600 + 2 * 86_400));
    }

    #[test]
    fn parses_units_and_durations() {
        assert_eq!(tier("10/s"), Tier { limit: 10, period: Period::Rolling(Duration::from_secs(1)), spread: Spread::Window });
        assert_eq!(tier("500 / min").period, Period::Rolling(Duration::from_secs(60)));
        assert_eq!(tier("3/250ms").period, Period::Rolling(Duration::from_millis(250)));
        assert_eq!(tier("100000/day").period, Period::Day);
        assert_eq!(tier("2000000/month").period, Period::Month);
        assert_eq!(tier("7/5s").to_string(), "7/5s");
        assert_eq!(tier("500/minute").to_string(), "500/min");
    }

    #[test]
    fn parses_spread_options_and_prints_them_back() {
        assert_eq!(tier("2/s burst=40").spread, Spread::Burst(40));
        assert_eq!(tier("1000 / h  smooth").spread, Spread::Smooth);
        for text in ["2/s burst=40", "1000/h smooth", "7/5s burst=3", "10/s"] {
            assert_eq!(tier(text).to_string(), text);
        }
        assert_eq!("2/s burst=0".parse::<Tier>(), Err(TierParseError::Option("burst=0".into())));
        assert_eq!("2/s bursty".parse::<Tier>(), Err(TierParseError::Option("bursty".into())));
        assert_eq!("2/s smooth burst=4".parse::<Tier>(), Err(TierParseError::SmoothAndBurst));
        assert_eq!("20/day smooth".parse::<Tier>(), Err(TierParseError::CalendarOption("smooth".into())));
    }

    #[test]
    fn the_shortest_rolling_tier_spaces_calls() {
        let q = Quota::new(vec![tier("1000/h"), tier("100/day"), tier("10/s"), tier("200/min")], chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(q.spacing_tier(), Some(2));
        let calendar_only = Quota::new(vec![tier("100/day")], chrono_tz::UTC, Duration::ZERO).unwrap();
        assert_eq!(calendar_only.spacing_tier(), None);
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
