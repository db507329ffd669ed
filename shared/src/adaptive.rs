//! The adaptive rate: how much of the configured pace the lane may use when the
//! provider's answers show that others spend the same quota. Pure: the provider's
//! readings (its rate-limit headers), its 429s and our own calls come in with their
//! instants; the effective rate and the reason for it come out. It never goes above the
//! pace of the configured tiers.
//!
//! - **Shared quota.** A reading of a tier we pace, with a window of at most
//!   [`SHARED_WINDOW_MAX`]: the provider counted `limit - remaining` units in the window
//!   ending at the reading; ours in that window are known, the rest are other clients'.
//!   Their use, smoothed over readings and taken [`OTHERS_MARGIN`] higher than read, is
//!   what we leave them. Alone on the quota, the lane keeps its full pace.
//! - **Provider budget.** Any other reading (a longer window, a calendar quota, a quota
//!   the configuration does not name): when less remains than we would spend before the
//!   reset, what remains is spread evenly until the reset.
//! - **Back-off.** Our pacing never exceeds the configured tiers, so repeated 429s mean
//!   the provider counts calls we do not see: the rate is cut to [`CUT`] of itself (at
//!   most once per [`CUT_SPACING`]) and grows back by [`RECOVERY_PER_SECOND`] of the pace
//!   each second (AIMD). A lone 429 (none in the [`LONE_429_MEMORY`] before it) is
//!   jitter at a window's edge (a call made on its slot that reached the provider a few
//!   milliseconds late), not a foreign client: it cuts nothing, so the pace is whole
//!   again once the cool-down it asked for is over, and a window of the longest tier
//!   later the sliding windows no longer remember it.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::quota::{Period, Quota, Tier};
use crate::time::UnixMillis;

/// Other clients' use is taken this share higher than read: it varies between readings.
pub const OTHERS_MARGIN: f64 = 0.1;
/// The share of a provider's budget the lane spends (the rest absorbs others' calls).
pub const HEADROOM: f64 = 0.95;
/// After a 429 the rate drops to this share of itself.
pub const CUT: f64 = 0.7;
/// After a cut, the rate grows back by this share of the pace per second.
pub const RECOVERY_PER_SECOND: f64 = 0.05;
/// A shared-quota estimate or a back-off never takes the rate below this share of the
/// pace: calls keep going, and their answers keep telling how much the others use. (A
/// provider's budget can: going faster would spend what it says is not there.)
pub const FLOOR: f64 = 0.02;
/// Windows up to this long are shared-quota estimates; longer ones are budgets.
pub const SHARED_WINDOW_MAX: Duration = Duration::from_secs(60);
/// A shared-quota estimate no reading has renewed for this long lapses.
pub const READING_LIFETIME: Duration = Duration::from_secs(30);
/// Cuts after 429s are at least this far apart: the 429s of calls already on their way
/// when the rate was cut are not new news.
pub const CUT_SPACING: Duration = Duration::from_secs(2);
/// A 429 with none in this long before it is taken for jitter, not a cause to cut.
pub const LONE_429_MEMORY: Duration = Duration::from_secs(60);
/// Others' use up to this share of the limit (and at least a unit) is taken for the
/// calls on their way when the provider counted, not for other clients.
const NOISE: f64 = 0.02;
/// Each new reading moves the estimate of the others' use this share of the way.
const SMOOTHING: f64 = 0.5;

/// What a provider's rate-limit headers said about one quota, as of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderReading {
    /// The quota's units per window.
    pub limit: u64,
    /// Units left in the current window, the reading call's own already counted.
    pub remaining: u64,
    /// The window's length, where the provider names it (`RateLimit-Policy`'s `w`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ms: Option<u64>,
    /// When the provider says the quota resets.
    pub resets_at: UnixMillis,
    /// When the call that read it was made.
    pub at: UnixMillis,
}

impl ProviderReading {
    /// The reading with its reset at most `max` after the call, as every cool-down is
    /// capped (`retry.max_cool_down`): a reset years ahead (an epoch in the wrong unit, a
    /// bogus date) or a day-long window with nothing left would otherwise hold the lane
    /// at a rate of 0 with no call going out to bring a fresh reading.
    #[must_use]
    pub fn with_reset_capped(mut self, max: Duration) -> Self {
        self.resets_at = self.resets_at.min(self.at.plus(max));
        self
    }
}

/// Why the effective rate is what it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RateReason {
    /// The configured tiers' pace: nothing says to go slower.
    Configured,
    /// Other clients use about `others` of the provider's `limit` per window (below 0
    /// when readings err low).
    SharedQuota { limit: u64, window_ms: u64, others: f64 },
    /// The provider says `remaining` units are left until `resets_at`.
    ProviderBudget { remaining: u64, resets_at: UnixMillis },
    /// A 429 our pacing cannot explain came at `since`: cut, now growing back.
    BackingOff { since: UnixMillis },
}

impl fmt::Display for RateReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Configured => write!(f, "the configured tiers"),
            Self::SharedQuota { limit, window_ms, others } => {
                let others = others.max(0.0);
                write!(f, "other clients use about {others:.0} of the provider's {limit} per {}", humantime::format_duration(Duration::from_millis(*window_ms)))
            }
            Self::ProviderBudget { remaining, resets_at } => write!(f, "the provider has {remaining} left until {}", resets_at.to_rfc3339()),
            Self::BackingOff { since } => write!(f, "backing off after a 429 at {} (the provider counts calls we do not see)", since.to_rfc3339()),
        }
    }
}

/// The rate the lane goes at, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EffectiveRate {
    /// Units per second (infinite when no tier spaces calls and nothing slows them).
    pub per_second: f64,
    /// The configured tiers' pace.
    pub configured_per_second: f64,
    pub reason: RateReason,
    pub at: UnixMillis,
}

impl EffectiveRate {
    /// The share of the configured pace (1 at the full pace).
    #[must_use]
    pub fn share(&self) -> f64 {
        if self.per_second >= self.configured_per_second {
            1.0
        } else {
            self.per_second / self.configured_per_second
        }
    }
}

/// Our own calls at the provider, in 10 ms buckets, for the last [`OurCalls::MEMORY`].
#[derive(Clone, Debug, Default)]
struct OurCalls {
    buckets: VecDeque<(u64, u64)>,
}

impl OurCalls {
    const BUCKET_MS: u64 = 10;
    /// The longest shared window and the time a reading takes to come back.
    const MEMORY: Duration = Duration::from_secs(90);

    fn record(&mut self, slot: UnixMillis, units: u64) {
        let bucket = slot.0 - slot.0 % Self::BUCKET_MS;
        let forget_before = slot.minus(Self::MEMORY).0;
        while self.buckets.front().is_some_and(|(start, _)| *start < forget_before) {
            self.buckets.pop_front();
        }
        match self.buckets.back_mut() {
            Some((last, count)) if *last == bucket => *count += units,
            // Slots are handed off in order; one out of order joins the latest bucket.
            Some((last, count)) if *last > bucket => *count += units,
            _ => self.buckets.push_back((bucket, units)),
        }
    }

    /// Units in buckets starting in `(from, to]`.
    fn between(&self, from: UnixMillis, to: UnixMillis) -> u64 {
        self.buckets.iter().rev().skip_while(|(start, _)| *start > to.0).take_while(|(start, _)| *start > from.0).map(|(_, units)| units).sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Shared {
    limit: u64,
    window_ms: u64,
    others: f64,
    at: UnixMillis,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Budget {
    reading: ProviderReading,
    /// Our units with slots after the reading.
    spent_since: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Backoff {
    rate: f64,
    at: UnixMillis,
}

/// The adaptive rate of one lane (see the module's documentation).
#[derive(Clone, Debug)]
pub struct AdaptiveRate {
    pace: f64,
    tiers: Vec<Tier>,
    ours: OurCalls,
    shared: Option<Shared>,
    budget: Option<Budget>,
    backoff: Option<Backoff>,
    /// The last 429, for telling a lone one from a run of them.
    last_rate_limited: Option<UnixMillis>,
    last_reading: UnixMillis,
    /// Our calls are known from this instant (the run's start): a reading whose window
    /// begins earlier cannot tell ours from others'.
    known_since: UnixMillis,
}

impl AdaptiveRate {
    /// At the full pace of `quota`, nothing read yet; our calls are recorded from
    /// `known_since` on.
    #[must_use]
    pub fn new(quota: &Quota, known_since: UnixMillis) -> Self {
        Self {
            pace: quota.pace_per_second(),
            tiers: quota.tiers().to_vec(),
            ours: OurCalls::default(),
            shared: None,
            budget: None,
            backoff: None,
            last_rate_limited: None,
            last_reading: UnixMillis(0),
            known_since,
        }
    }

    /// Our calls are known only from `at` on: the calls an earlier run decided go until
    /// then (up to its dispatch-ahead after it stopped), unseen by this one, so a reading
    /// whose window begins before `at` cannot tell ours from others'.
    pub fn known_from(&mut self, at: UnixMillis) {
        self.known_since = self.known_since.max(at);
    }

    /// Carries on from the rate an earlier run last had (a shared-quota estimate or a
    /// back-off, while still fresh), so a new run does not start by overrunning others.
    pub fn resume(&mut self, last: &EffectiveRate) {
        match last.reason {
            RateReason::SharedQuota { limit, window_ms, others } => self.shared = Some(Shared { limit, window_ms, others, at: last.at }),
            RateReason::BackingOff { .. } => self.backoff = Some(Backoff { rate: last.per_second, at: last.at }),
            RateReason::Configured | RateReason::ProviderBudget { .. } => {}
        }
    }

    fn floor(&self) -> f64 {
        if self.pace.is_finite() {
            self.pace * FLOOR
        } else {
            1.0
        }
    }

    /// We handed off `units` for a call at `slot`.
    pub fn record_call(&mut self, slot: UnixMillis, units: u64) {
        self.ours.record(slot, units);
        if let Some(budget) = self.budget.as_mut().filter(|b| slot > b.reading.at) {
            budget.spent_since += units;
        }
    }

    /// The tier `reading` is about: a configured tier with its limit (and its window,
    /// where the reading names one).
    fn tier_of(&self, reading: &ProviderReading) -> Option<(usize, &Tier)> {
        self.tiers
            .iter()
            .enumerate()
            .find(|(_, tier)| tier.limit == reading.limit && reading.window_ms.is_none_or(|w| u128::from(w) == tier.nominal_window().as_millis()))
    }

    /// Takes in a reading. `our_usage(tier)` is what our pacer holds in that configured
    /// tier's window at the reading (used for windows longer than the shared ones).
    /// Readings older than one already taken are ignored.
    pub fn on_reading(&mut self, reading: &ProviderReading, our_usage: impl Fn(usize) -> u64) {
        if reading.at <= self.last_reading {
            return;
        }
        self.last_reading = reading.at;
        let used_by_all = reading.limit.saturating_sub(reading.remaining);
        match self.tier_of(reading) {
            Some((_, tier)) if matches!(tier.period, Period::Rolling(w) if w <= SHARED_WINDOW_MAX) => {
                let window = tier.nominal_window();
                if reading.at.minus(window) < self.known_since {
                    return;
                }
                let ours = self.ours.between(reading.at.minus(window), reading.at);
                // Not clamped: calls on their way make single readings err either side,
                // and the smoothing evens them out.
                let sample = used_by_all as f64 - ours as f64;
                let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
                let others = match self.shared {
                    Some(s) if s.limit == reading.limit && s.window_ms == window_ms && reading.at < s.at.plus(READING_LIFETIME) => {
                        s.others + SMOOTHING * (sample - s.others)
                    }
                    _ => sample,
                };
                self.shared = Some(Shared { limit: reading.limit, window_ms, others, at: reading.at });
            }
            Some((index, _)) => {
                // Our pacer keeps this window itself; only what others took calls for care.
                let others = used_by_all.saturating_sub(our_usage(index));
                let tolerance = (reading.limit / 100).max(1);
                self.budget = (others > tolerance).then_some(Budget { reading: *reading, spent_since: 0 });
            }
            None => {
                let until_reset = reading.resets_at.since(reading.at).as_secs_f64();
                let short = (reading.remaining as f64) < self.pace * until_reset;
                self.budget = short.then_some(Budget { reading: *reading, spent_since: 0 });
            }
        }
    }

    /// Forgets every reading and back-off (an operator's `paceline circuit close` or
    /// `paceline rate reset`): the configured pace again, until new answers say otherwise.
    pub fn forget_readings(&mut self) {
        self.shared = None;
        self.budget = None;
        self.backoff = None;
        self.last_rate_limited = None;
    }

    /// The provider answered 429 at `now`: a lone one is jitter, more cut the rate.
    /// Returns whether it was taken for jitter (the pacer's margin may then grow).
    pub fn on_rate_limited(&mut self, now: UnixMillis) -> bool {
        let lone = self.last_rate_limited.is_none_or(|last| now >= last.plus(LONE_429_MEMORY));
        self.last_rate_limited = Some(now);
        if lone {
            return true;
        }
        if self.backoff.is_some_and(|b| now < b.at.plus(CUT_SPACING)) {
            return false;
        }
        let current = self.rate(now).per_second;
        let rate = if current.is_finite() { (current * CUT).max(self.floor()) } else { current };
        self.backoff = Some(Backoff { rate, at: now });
        false
    }

    /// The rate at `now`, and why.
    #[must_use]
    pub fn rate(&self, now: UnixMillis) -> EffectiveRate {
        let mut best = (self.pace, RateReason::Configured);
        let mut consider = |rate: f64, reason: RateReason| {
            if rate < best.0 {
                best = (rate, reason);
            }
        };
        let noise = |s: &Shared| (s.limit as f64 * NOISE).max(1.0);
        if let Some(s) = self.shared.filter(|s| now < s.at.plus(READING_LIFETIME) && s.others > noise(s)) {
            let left = (s.limit as f64 - s.others.max(0.0) * (1.0 + OTHERS_MARGIN)).max(0.0);
            let rate = (left * 1000.0 / s.window_ms.max(1) as f64).max(self.floor());
            consider(rate, RateReason::SharedQuota { limit: s.limit, window_ms: s.window_ms, others: s.others });
        }
        if let Some(b) = self.budget.filter(|b| now < b.reading.resets_at) {
            let left = b.reading.remaining.saturating_sub(b.spent_since) as f64;
            let seconds = b.reading.resets_at.since(now).as_secs_f64().max(0.001);
            consider(HEADROOM * left / seconds, RateReason::ProviderBudget { remaining: b.reading.remaining, resets_at: b.reading.resets_at });
        }
        if let Some(b) = self.backoff {
            let grown = b.rate + RECOVERY_PER_SECOND * self.pace * now.since(b.at).as_secs_f64();
            consider(grown, RateReason::BackingOff { since: b.at });
        }
        let (per_second, reason) = best;
        EffectiveRate { per_second, configured_per_second: self.pace, reason, at: now }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::chrono_tz;

    const T0: UnixMillis = UnixMillis(1_800_000_000_000);

    fn at(ms: u64) -> UnixMillis {
        UnixMillis(T0.0 + ms)
    }

    fn quota(tiers: &[&str]) -> Quota {
        Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::ZERO).unwrap()
    }

    /// Calls at `per_second` from `from_ms` to `to_ms`.
    fn calls(rate: &mut AdaptiveRate, per_second: u64, from_ms: u64, to_ms: u64) {
        let gap = 1000 / per_second;
        let mut t = from_ms;
        while t < to_ms {
            rate.record_call(at(t), 1);
            t += gap;
        }
    }

    fn reading(limit: u64, remaining: u64, window_ms: Option<u64>, reset_ms: u64, at_ms: u64) -> ProviderReading {
        ProviderReading { limit, remaining, window_ms, resets_at: at(at_ms + reset_ms), at: at(at_ms) }
    }

    fn no_usage(_: usize) -> u64 {
        0
    }

    #[test]
    fn with_nothing_read_the_rate_is_the_configured_pace() {
        let rate = AdaptiveRate::new(&quota(&["100/s", "1000/h"]), T0).rate(at(0));
        assert_eq!((rate.per_second, rate.share(), rate.reason), (100.0, 1.0, RateReason::Configured));
    }

    #[test]
    fn others_using_a_third_of_a_shared_window_leave_us_the_rest_less_headroom() {
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), T0);
        calls(&mut rate, 50, 0, 2_000);
        // In the second ending at 2 s the provider counted 80: our 50 and 30 of others'.
        rate.on_reading(&reading(100, 20, Some(1_000), 1_000, 1_999), no_usage);
        let now = rate.rate(at(2_000));
        assert!((now.per_second - (100.0 - 1.1 * 30.0)).abs() < 1e-9, "{now:?}");
        assert_eq!(now.reason, RateReason::SharedQuota { limit: 100, window_ms: 1_000, others: 30.0 });
        // The next reading says they use 10: the estimate moves halfway.
        calls(&mut rate, 50, 2_000, 3_000);
        rate.on_reading(&reading(100, 40, Some(1_000), 1_000, 2_999), no_usage);
        assert!((rate.rate(at(3_000)).per_second - (100.0 - 1.1 * 20.0)).abs() < 1e-9);
        // An older reading arriving late changes nothing.
        rate.on_reading(&reading(100, 0, Some(1_000), 1_000, 2_500), no_usage);
        assert!((rate.rate(at(3_000)).per_second - (100.0 - 1.1 * 20.0)).abs() < 1e-9);
        // Without new readings the estimate lapses after READING_LIFETIME.
        assert_eq!(rate.rate(at(2_999).plus(READING_LIFETIME)).reason, RateReason::Configured);
    }

    #[test]
    fn a_reading_without_a_window_matches_the_tier_with_its_limit() {
        let mut rate = AdaptiveRate::new(&quota(&["10/s", "500/min"]), T0);
        calls(&mut rate, 5, 0, 60_001);
        // 500 per minute: we made 300 in the minute to the reading, the provider counted 450.
        rate.on_reading(&reading(500, 50, None, 30_000, 60_000), no_usage);
        let now = rate.rate(at(60_001));
        assert_eq!(now.reason, RateReason::SharedQuota { limit: 500, window_ms: 60_000, others: 150.0 });
        assert!((now.per_second - (500.0 - 1.1 * 150.0) / 60.0).abs() < 1e-9);
    }

    #[test]
    fn a_new_run_ignores_readings_of_calls_it_does_not_know_and_resumes_the_last_estimate() {
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), at(10_000));
        // The last run's calls filled the window the reading covers: not others' use.
        rate.on_reading(&reading(100, 0, Some(1_000), 1_000, 10_500), no_usage);
        assert_eq!(rate.rate(at(10_500)).reason, RateReason::Configured);
        // The last run's estimate, 5 s old, holds until it lapses.
        let last = EffectiveRate {
            per_second: 67.0,
            configured_per_second: 100.0,
            reason: RateReason::SharedQuota { limit: 100, window_ms: 1_000, others: 30.0 },
            at: at(5_000),
        };
        rate.resume(&last);
        assert!((rate.rate(at(10_500)).per_second - 67.0).abs() < 1e-9);
        assert_eq!(rate.rate(at(5_000).plus(READING_LIFETIME)).reason, RateReason::Configured);
    }

    #[test]
    fn alone_on_the_quota_the_lane_keeps_its_full_pace() {
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), T0);
        calls(&mut rate, 100, 0, 4_000);
        // Calls on their way make readings err either side of what we sent.
        rate.on_reading(&reading(100, 3, Some(1_000), 1_000, 1_999), no_usage);
        rate.on_reading(&reading(100, 0, Some(1_000), 1_000, 2_999), no_usage);
        rate.on_reading(&reading(100, 0, Some(1_000), 1_000, 2_999), no_usage);
        let now = rate.rate(at(3_000));
        assert_eq!((now.per_second, now.share()), (100.0, 1.0), "{now:?}");
        // Two units over what we sent (2% of the limit) is noise as well; three are not.
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), T0);
        rate.on_reading(&reading(100, 98, Some(1_000), 1_000, 1_000), no_usage);
        assert_eq!(rate.rate(at(1_000)).per_second, 100.0);
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), T0);
        rate.on_reading(&reading(100, 97, Some(1_000), 1_000, 1_000), no_usage);
        assert!(rate.rate(at(1_000)).per_second < 100.0);
    }

    #[test]
    fn a_provider_quota_we_do_not_configure_is_spread_until_its_reset() {
        let mut rate = AdaptiveRate::new(&quota(&["10/s"]), T0);
        // 5000 per hour at the provider, 100 left, 1000 s to go: 10/s would spend them in 10 s.
        rate.on_reading(&reading(5_000, 100, Some(3_600_000), 1_000_000, 0), no_usage);
        let now = rate.rate(at(0));
        assert!((now.per_second - 0.95 * 0.1).abs() < 1e-9, "{now:?}");
        assert_eq!(now.reason, RateReason::ProviderBudget { remaining: 100, resets_at: at(1_000_000) });
        // Calls after the reading come out of what is left.
        calls(&mut rate, 1, 1, 50_001);
        assert!((rate.rate(at(500_000)).per_second - 0.95 * 50.0 / 500.0).abs() < 1e-9);
        // After the reset the budget is over.
        assert_eq!(rate.rate(at(1_000_000)).reason, RateReason::Configured);
        // Plenty left: no slowing down.
        rate.on_reading(&reading(5_000, 4_000, Some(3_600_000), 100_000, 1_000_001), no_usage);
        assert_eq!(rate.rate(at(1_000_002)).reason, RateReason::Configured);
    }

    #[test]
    fn a_long_configured_window_slows_only_for_what_others_took() {
        let mut rate = AdaptiveRate::new(&quota(&["10/s", "1000/h"]), T0);
        // We hold 600 of the hour; the provider says 400 remain: nobody else used any.
        rate.on_reading(&reading(1_000, 400, Some(3_600_000), 3_000_000, 0), |tier| if tier == 1 { 600 } else { 0 });
        assert_eq!(rate.rate(at(1)).reason, RateReason::Configured, "a burst under the hour stays a burst");
        // 200 remain: others took 200 of it. What is left is spread until the reset.
        rate.on_reading(&reading(1_000, 200, Some(3_600_000), 2_000_000, 1), |tier| if tier == 1 { 600 } else { 0 });
        assert!((rate.rate(at(1)).per_second - 0.95 * 200.0 / 2_000.0).abs() < 1e-6);
    }

    #[test]
    fn a_429_after_another_cuts_the_rate_which_then_grows_back_additively_never_past_the_pace() {
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), T0);
        rate.on_rate_limited(T0.minus(std::time::Duration::from_millis(500)));
        rate.on_rate_limited(at(0));
        assert!((rate.rate(at(0)).per_second - 70.0).abs() < 1e-9);
        assert_eq!(rate.rate(at(0)).reason, RateReason::BackingOff { since: at(0) });
        // More 429s of calls already on their way: no second cut.
        rate.on_rate_limited(at(1_999));
        assert!((rate.rate(at(1_000)).per_second - 75.0).abs() < 1e-9, "5 a second back");
        // A new one after CUT_SPACING cuts from where the rate has grown to.
        rate.on_rate_limited(at(2_000));
        assert!((rate.rate(at(2_000)).per_second - 0.7 * 80.0).abs() < 1e-9);
        // Grown back past the pace: the configured pace again.
        assert_eq!(rate.rate(at(12_000)).per_second, 100.0);
        assert_eq!(rate.rate(at(12_000)).reason, RateReason::Configured);
    }

    /// Under `10/s + 50/10s`, one 429 for a call made on its slot (it reached a strict
    /// sliding-window API 11 ms late) cut the rate to 70%, and the sliding windows
    /// carried that slow stretch into every later one: 30.2 s for a 25 s drain.
    #[test]
    fn a_lone_429_is_jitter_and_cuts_nothing_while_one_soon_after_another_cuts() {
        let mut rate = AdaptiveRate::new(&quota(&["10/s", "50/10s"]), T0);
        assert!(rate.on_rate_limited(at(5_000)), "taken for jitter");
        assert_eq!(rate.rate(at(5_000)).reason, RateReason::Configured, "a lone 429 cut the pace");
        assert!(rate.on_rate_limited(at(5_000 + 61_000)));
        assert_eq!(rate.rate(at(66_000)).reason, RateReason::Configured, "a minute apart, each is lone");
        assert!(!rate.on_rate_limited(at(66_500)), "not jitter: someone else's calls");
        assert_eq!(rate.rate(at(66_500)).reason, RateReason::BackingOff { since: at(66_500) }, "sustained refusals still cut");
        rate.forget_readings();
        assert!(rate.on_rate_limited(at(67_000)));
        assert_eq!(rate.rate(at(67_000)).reason, RateReason::Configured, "an operator's reset forgets the 429s too");
    }

    #[test]
    fn a_reading_whose_reset_is_years_ahead_holds_the_lane_no_longer_than_the_cap() {
        // X-RateLimit-Limit: 7, Remaining: 0, Reset: 9999999999 (the year 2286), on a
        // quota the config does not name: a rate of 0 until the reset.
        let far = ProviderReading { limit: 7, remaining: 0, window_ms: None, resets_at: UnixMillis(9_999_999_999_000), at: at(0) };
        let mut rate = AdaptiveRate::new(&quota(&["10/s"]), T0);
        rate.on_reading(&far.with_reset_capped(Duration::from_secs(5)), no_usage);
        assert_eq!(rate.rate(at(4_999)).per_second, 0.0);
        assert_eq!(rate.rate(at(4_999)).reason, RateReason::ProviderBudget { remaining: 0, resets_at: at(5_000) });
        assert_eq!(rate.rate(at(5_000)).reason, RateReason::Configured, "probing resumes at the cap");
        // A reset within the cap is kept as the provider said it.
        let near = ProviderReading { resets_at: at(2_000), ..far };
        assert_eq!(near.with_reset_capped(Duration::from_secs(5)).resets_at, at(2_000));
    }

    #[test]
    fn forgetting_the_readings_restores_the_configured_pace() {
        let mut rate = AdaptiveRate::new(&quota(&["10/s"]), T0);
        rate.on_reading(&reading(7, 0, None, 3_600_000, 0), no_usage);
        rate.on_rate_limited(at(1));
        assert_eq!(rate.rate(at(10)).per_second, 0.0);
        rate.forget_readings();
        assert_eq!(rate.rate(at(10)).reason, RateReason::Configured);
        // An older reading arriving after the reset changes nothing.
        rate.on_reading(&reading(7, 0, None, 3_600_000, 0), no_usage);
        assert_eq!(rate.rate(at(10)).reason, RateReason::Configured);
    }

    #[test]
    fn the_rate_never_drops_below_the_floor() {
        // Others use everything: calls still go at the floor, and their answers tell
        // when room comes back.
        let mut rate = AdaptiveRate::new(&quota(&["100/s"]), T0);
        rate.on_reading(&reading(100, 0, Some(1_000), 1_000, 1_010), no_usage);
        assert!((rate.rate(at(1_011)).per_second - 2.0).abs() < 1e-9);
    }

    #[test]
    fn the_reason_reads_as_a_sentence() {
        let reason = RateReason::SharedQuota { limit: 100, window_ms: 1_000, others: 29.6 };
        assert_eq!(reason.to_string(), "other clients use about 30 of the provider's 100 per 1s");
    }
}
