//! The pacer: given the quota, its state and `now`, decide whether a job of some cost
//! may be dispatched now or when it may. Pure: no clock, no I/O, no sleeping.
//!
//! Each rolling tier combines two rules, both exact in integer milliseconds:
//! - GCRA with zero burst tolerance spreads calls evenly (one unit every `window / limit`),
//!   which also satisfies strict leaky-bucket limiters such as nginx's `limit_req`;
//! - a sliding-window log guarantees that no window of the tier's length ever holds more
//!   than its limit even when jobs weigh more than one unit (GCRA alone lets a heavy job
//!   overshoot a window by its extra weight).
//!
//! The window used by both is the tier's length plus the quota's safety margin, so that
//! network jitter between our dispatch and the provider's clock cannot push two calls
//! into one provider window. Calendar tiers (day, month) are counters per window.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::quota::{Period, Quota, Tier};
use crate::time::UnixMillis;

/// What the pacer says about one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Dispatch now, then [`PacerState::commit`].
    Allow,
    /// Not before `at`; `by` says what holds it back.
    WaitUntil { at: UnixMillis, by: Hold },
    /// The job's cost exceeds this tier's whole limit: it can never be dispatched.
    Never { tier: Tier },
}

/// What holds a job back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// The tier at this index of the quota's tier list.
    Tier(usize),
    /// A cool-down the provider asked for (429 with Retry-After and the like).
    CoolDown,
}

/// Units admitted per time bucket, oldest first. Buckets are 1 ms (exact) while the
/// limit is small enough that the log stays small anyway, and `window / 1024` for large
/// limits, which bounds memory; a bucket is treated as if all of it arrived at its last
/// millisecond, so bucketing only ever errs safe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlidingWindowLog {
    window_ms: u64,
    bucket_ms: u64,
    entries: VecDeque<(u64, u64)>,
}

impl SlidingWindowLog {
    /// Limits up to this many units are logged to the millisecond.
    const EXACT_UP_TO: u64 = 4_096;

    /// An empty log for at most `limit` units per `window` (at least 1 ms).
    #[must_use]
    pub fn new(window: Duration, limit: u64) -> Self {
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        let bucket_ms = if limit <= Self::EXACT_UP_TO { 1 } else { (window_ms / 1024).max(1) };
        Self { window_ms, bucket_ms, entries: VecDeque::new() }
    }

    fn expiry(&self, bucket_start: u64) -> u64 {
        bucket_start + self.bucket_ms - 1 + self.window_ms
    }

    /// Units inside the window ending at `now`.
    #[must_use]
    pub fn in_window(&self, now: UnixMillis) -> u64 {
        self.entries.iter().filter(|(b, _)| self.expiry(*b) > now.0).map(|(_, u)| u).sum()
    }

    /// The earliest instant at or after `now` when `cost` more units fit under `limit`;
    /// `None` if `cost` exceeds `limit`.
    #[must_use]
    pub fn ready_at(&self, now: UnixMillis, cost: u64, limit: u64) -> Option<UnixMillis> {
        if cost > limit {
            return None;
        }
        let live = self.entries.iter().filter(|(b, _)| self.expiry(*b) > now.0);
        let mut excess = (live.clone().map(|(_, u)| u).sum::<u64>() + cost).saturating_sub(limit);
        if excess == 0 {
            return Some(now);
        }
        for (bucket, units) in live {
            excess = excess.saturating_sub(*units);
            if excess == 0 {
                return Some(UnixMillis(self.expiry(*bucket)));
            }
        }
        None
    }

    /// Records `cost` units at `now` and forgets what has left the window.
    pub fn record(&mut self, now: UnixMillis, cost: u64) {
        while self.entries.front().is_some_and(|(b, _)| self.expiry(*b) <= now.0) {
            self.entries.pop_front();
        }
        let bucket = now.0 - now.0 % self.bucket_ms;
        match self.entries.back_mut() {
            Some((last, units)) if *last == bucket => *units += cost,
            _ => self.entries.push_back((bucket, cost)),
        }
    }
}

/// State of one rolling tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollingState {
    /// GCRA theoretical arrival time, scaled by the tier's limit to stay exact:
    /// the next unit may go at `ceil(tat_scaled / limit)` ms.
    tat_scaled: u128,
    log: SlidingWindowLog,
}

/// State of one calendar tier: units used in the window starting at `window_start`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalendarState {
    pub window_start: UnixMillis,
    pub used: u64,
}

/// State of one tier, tagged with the tier it belongs to so a stale snapshot from a
/// different configuration is never applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierState {
    pub tier: Tier,
    pub rolling: Option<RollingState>,
    pub calendar: CalendarState,
}

/// Everything the pacer remembers. Serializable, so a run can hand it to the next.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PacerState {
    tiers: Vec<TierState>,
    /// No dispatch before this instant (a provider's cool-down, or this lane's own hold).
    hold_until: UnixMillis,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Quota {
    fn effective_window_ms(&self, tier: &Tier) -> u64 {
        match tier.period {
            Period::Rolling(d) => millis(d).max(1) + millis(self.safety_margin()),
            Period::Day | Period::Month => 0,
        }
    }

    /// One window of the longest rolling tier, safety margin included (zero without
    /// rolling tiers): after it, nothing dispatched before can share a window with what
    /// is dispatched next.
    #[must_use]
    pub fn longest_window(&self) -> Duration {
        Duration::from_millis(self.tiers().iter().map(|t| self.effective_window_ms(t)).max().unwrap_or(0))
    }

    /// Whether a job of `cost` units may go at `now`.
    #[must_use]
    pub fn decide(&self, state: &PacerState, cost: u64, now: UnixMillis) -> Decision {
        let mut ready = now;
        let mut by = None;
        if state.hold_until > ready {
            ready = state.hold_until;
            by = Some(Hold::CoolDown);
        }
        for (index, (tier, tier_state)) in self.tiers().iter().zip(&state.tiers).enumerate() {
            if cost > tier.limit {
                return Decision::Never { tier: *tier };
            }
            let tier_ready = match &tier_state.rolling {
                Some(rolling) => {
                    let gcra = UnixMillis(u64::try_from(rolling.tat_scaled.div_ceil(u128::from(tier.limit))).unwrap_or(u64::MAX));
                    let window = rolling.log.ready_at(now, cost, tier.limit).unwrap_or(UnixMillis(u64::MAX));
                    gcra.max(window)
                }
                None => {
                    let (start, end) = tier.window_at(self.zone(), now);
                    let used = if tier_state.calendar.window_start >= start { tier_state.calendar.used } else { 0 };
                    if used + cost <= tier.limit {
                        now
                    } else {
                        end
                    }
                }
            };
            if tier_ready > ready {
                ready = tier_ready;
                by = Some(Hold::Tier(index));
            }
        }
        match by {
            Some(by) if ready > now => Decision::WaitUntil { at: ready, by },
            _ => Decision::Allow,
        }
    }

    /// How many unit-cost jobs could be dispatched from `now` until `horizon` (capped at
    /// `max`): the orchestrator receives no more than it can hand off in time.
    #[must_use]
    pub fn capacity_until(&self, state: &PacerState, now: UnixMillis, horizon: UnixMillis, max: usize) -> usize {
        let mut state = state.clone();
        let mut t = now;
        for admitted in 0..max {
            match self.decide(&state, 1, t) {
                Decision::Allow => state.commit(self, 1, t),
                Decision::WaitUntil { at, .. } if at < horizon => {
                    t = at;
                    state.commit(self, 1, t);
                }
                _ => return admitted,
            }
        }
        max
    }
}

impl PacerState {
    /// No dispatch before this instant.
    #[must_use]
    pub fn hold_until(&self) -> UnixMillis {
        self.hold_until
    }

    /// Holds dispatch until `at` (a provider's cool-down, a lane's own hold).
    pub fn set_hold_until(&mut self, at: UnixMillis) {
        self.hold_until = at;
    }

    /// A fresh state: nothing used anywhere.
    #[must_use]
    pub fn new(quota: &Quota) -> Self {
        let tiers = quota
            .tiers()
            .iter()
            .map(|tier| TierState {
                tier: *tier,
                rolling: match tier.period {
                    Period::Rolling(_) => {
                        Some(RollingState { tat_scaled: 0, log: SlidingWindowLog::new(Duration::from_millis(quota.effective_window_ms(tier)), tier.limit) })
                    }
                    Period::Day | Period::Month => None,
                },
                calendar: CalendarState::default(),
            })
            .collect();
        Self { tiers, hold_until: UnixMillis(0) }
    }

    /// Takes the rolling-tier state and cool-down from a snapshot of an earlier run,
    /// for the tiers that are still configured the same way (margin included).
    #[must_use]
    pub fn restored(quota: &Quota, snapshot: &PacerState) -> Self {
        let mut state = Self::new(quota);
        for tier_state in &mut state.tiers {
            if let Some(old) = snapshot.tiers.iter().find(|old| old.tier == tier_state.tier) {
                let same_window = match (&old.rolling, &tier_state.rolling) {
                    (Some(a), Some(b)) => a.log.window_ms == b.log.window_ms && a.log.bucket_ms == b.log.bucket_ms,
                    _ => false,
                };
                if same_window {
                    tier_state.rolling.clone_from(&old.rolling);
                }
            }
        }
        state.hold_until = snapshot.hold_until;
        state
    }

    /// After a run that stopped without saving its final state (a crash), its last
    /// dispatches are unknown: hold every dispatch for one full window of the longest
    /// rolling tier, after which nothing it did can share a window with what we do.
    pub fn hold_after_unclean_stop(&mut self, quota: &Quota, now: UnixMillis) {
        self.hold_until = self.hold_until.max(now.plus(quota.longest_window()));
    }

    /// Records a dispatch of `cost` units at `now`. Call only after [`Decision::Allow`].
    pub fn commit(&mut self, quota: &Quota, cost: u64, now: UnixMillis) {
        for (tier, tier_state) in quota.tiers().iter().zip(&mut self.tiers) {
            match &mut tier_state.rolling {
                Some(rolling) => {
                    let limit = u128::from(tier.limit);
                    let step = u128::from(quota.effective_window_ms(tier)) * u128::from(cost);
                    // A dispatch a little after its slot (rounding to the millisecond,
                    // a timer waking late) keeps the schedule, so lateness does not push
                    // every later slot back. "A little" is the safety margin (at least
                    // 1 ms); the window log still guarantees no window overfills.
                    let now_scaled = u128::from(now.0) * limit;
                    let tolerance = u128::from(millis(quota.safety_margin()).max(1)) * limit;
                    let base = if now_scaled < rolling.tat_scaled + tolerance { rolling.tat_scaled } else { now_scaled };
                    rolling.tat_scaled = base + step;
                    rolling.log.record(now, cost);
                }
                None => {
                    let (start, _) = tier.window_at(quota.zone(), now);
                    if tier_state.calendar.window_start < start {
                        tier_state.calendar = CalendarState { window_start: start, used: 0 };
                    }
                    tier_state.calendar.used += cost;
                }
            }
        }
    }

    /// Sets the units already used in the calendar window of tier `index` that holds
    /// `now` (as loaded from the state store).
    pub fn set_calendar_used(&mut self, quota: &Quota, index: usize, used: u64, now: UnixMillis) {
        if let (Some(tier), Some(tier_state)) = (quota.tiers().get(index), self.tiers.get_mut(index)) {
            let (start, _) = tier.window_at(quota.zone(), now);
            tier_state.calendar = CalendarState { window_start: start, used };
        }
    }

    /// Units used in each tier's current window at `now`, in tier order.
    #[must_use]
    pub fn usage(&self, quota: &Quota, now: UnixMillis) -> Vec<u64> {
        quota
            .tiers()
            .iter()
            .zip(&self.tiers)
            .map(|(tier, s)| match &s.rolling {
                Some(rolling) => rolling.log.in_window(now),
                None => {
                    let (start, _) = tier.window_at(quota.zone(), now);
                    if s.calendar.window_start >= start {
                        s.calendar.used
                    } else {
                        0
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::peak_in_any_window;
    use proptest::prelude::*;

    fn quota(tiers: &[&str], margin_ms: u64) -> Quota {
        Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::from_millis(margin_ms)).unwrap()
    }

    /// Dispatches a saturating backlog of `cost`-unit jobs from `start` for `span`,
    /// always at the first instant the pacer allows. Returns the dispatch times.
    fn saturate(q: &Quota, costs: &[u64], start: u64, span: u64) -> Vec<(UnixMillis, u64)> {
        let mut state = PacerState::new(q);
        let mut now = UnixMillis(start);
        let mut sent = Vec::new();
        for cost in costs.iter().cycle() {
            match q.decide(&state, *cost, now) {
                Decision::Allow => {
                    state.commit(q, *cost, now);
                    sent.push((now, *cost));
                }
                Decision::WaitUntil { at, .. } => now = at,
                Decision::Never { .. } => panic!("cost {cost} never fits"),
            }
            if now.0 >= start + span {
                break;
            }
        }
        sent
    }

    #[test]
    fn one_per_second_goes_exactly_every_second() {
        let q = quota(&["1/s"], 0);
        let sent = saturate(&q, &[1], 1_000_000, 5_000);
        let times: Vec<u64> = sent.iter().map(|(t, _)| t.0).collect();
        assert_eq!(times, vec![1_000_000, 1_001_000, 1_002_000, 1_003_000, 1_004_000]);
    }

    #[test]
    fn ten_per_second_is_evenly_spaced_with_the_margin_spread_over_calls() {
        let q = quota(&["10/s"], 10);
        let sent = saturate(&q, &[1], 0, 1_000);
        let times: Vec<u64> = sent.iter().map(|(t, _)| t.0).collect();
        assert_eq!(times, vec![0, 101, 202, 303, 404, 505, 606, 707, 808, 909]);
    }

    #[test]
    fn fractional_intervals_stay_exact_over_a_long_run() {
        // 7 per second: intervals of 142.857... ms must not drift.
        let q = quota(&["7/s"], 0);
        let sent = saturate(&q, &[1], 0, 100_000);
        assert_eq!(sent.len(), 700);
        assert_eq!(sent[7].0, UnixMillis(1_000));
        assert_eq!(sent[699].0, UnixMillis(99_858)); // ceil(699 * 1000 / 7)
    }

    #[test]
    fn late_wake_ups_within_the_margin_do_not_drift_the_schedule() {
        let q = quota(&["20/s"], 10);
        let mut state = PacerState::new(&q);
        let mut sent = Vec::new();
        let mut now = UnixMillis(0);
        while sent.len() < 200 {
            match q.decide(&state, 1, now) {
                Decision::Allow => {
                    state.commit(&q, 1, now);
                    sent.push((now, 1));
                }
                // Every timer fires 3 ms late.
                Decision::WaitUntil { at, .. } => now = at.plus(Duration::from_millis(3)),
                Decision::Never { .. } => unreachable!(),
            }
        }
        // Slots every 50.5 ms: the 200th is due at ceil(199 * 50.5) = 10 050 ms. Without
        // catching up it would go at 199 * 53.5 = 10 646 ms; the window log (exact on
        // actual times) may still add the lateness once per window: 10 windows * 3.5 ms.
        let last = sent.last().unwrap().0 .0;
        assert!((10_053..=10_100).contains(&last), "200th dispatch at {last} ms");
        assert!(peak_in_any_window(&sent, Duration::from_secs(1)) <= 20);
    }

    #[test]
    fn heavy_job_waits_for_the_window_not_just_the_spacing() {
        let q = quota(&["10/s"], 0);
        let mut state = PacerState::new(&q);
        state.commit(&q, 1, UnixMillis(0));
        // GCRA alone would allow a 10-unit job at 100 ms; the window still holds 1 unit.
        assert_eq!(q.decide(&state, 10, UnixMillis(100)), Decision::WaitUntil { at: UnixMillis(1_000), by: Hold::Tier(0) });
        assert_eq!(q.decide(&state, 11, UnixMillis(100)), Decision::Never { tier: "10/s".parse().unwrap() });
    }

    #[test]
    fn calendar_tier_waits_for_midnight_when_exhausted() {
        let q = quota(&["100/s", "3/day"], 0);
        let mut state = PacerState::new(&q);
        let day_start = 1_795_824_000_000; // 2026-11-28T00:00:00Z
        state.set_calendar_used(&q, 1, 2, UnixMillis(day_start + 5_000));
        assert_eq!(q.decide(&state, 1, UnixMillis(day_start + 5_000)), Decision::Allow);
        state.commit(&q, 1, UnixMillis(day_start + 5_000));
        assert_eq!(q.decide(&state, 1, UnixMillis(day_start + 6_000)), Decision::WaitUntil { at: UnixMillis(day_start + 86_400_000), by: Hold::Tier(1) });
        assert_eq!(q.decide(&state, 1, UnixMillis(day_start + 86_400_000)), Decision::Allow);
        assert_eq!(state.usage(&q, UnixMillis(day_start + 5_500)), vec![1, 3]);
    }

    #[test]
    fn cool_down_holds_every_dispatch() {
        let q = quota(&["10/s"], 0);
        let mut state = PacerState::new(&q);
        state.hold_until = UnixMillis(5_000);
        assert_eq!(q.decide(&state, 1, UnixMillis(1_000)), Decision::WaitUntil { at: UnixMillis(5_000), by: Hold::CoolDown });
        assert_eq!(q.decide(&state, 1, UnixMillis(5_000)), Decision::Allow);
    }

    #[test]
    fn capacity_until_counts_what_fits_before_the_horizon() {
        let q = quota(&["1/s"], 0);
        let state = PacerState::new(&q);
        assert_eq!(q.capacity_until(&state, UnixMillis(0), UnixMillis(3_500), 10), 4);
        assert_eq!(q.capacity_until(&state, UnixMillis(0), UnixMillis(60_000), 10), 10);
    }

    #[test]
    fn restored_state_keeps_spacing_across_runs_and_ignores_changed_tiers() {
        let q = quota(&["1/s"], 0);
        let mut state = PacerState::new(&q);
        state.commit(&q, 1, UnixMillis(10_000));
        let snapshot: PacerState = serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        let next_run = PacerState::restored(&q, &snapshot);
        assert_eq!(q.decide(&next_run, 1, UnixMillis(10_400)), Decision::WaitUntil { at: UnixMillis(11_000), by: Hold::Tier(0) });
        let changed = quota(&["2/s"], 0);
        let other = PacerState::restored(&changed, &snapshot);
        assert_eq!(changed.decide(&other, 1, UnixMillis(10_400)), Decision::Allow);
    }

    #[test]
    fn an_unclean_stop_holds_for_the_longest_rolling_window() {
        let q = quota(&["10/s", "100/min", "1000/day"], 10);
        let mut state = PacerState::new(&q);
        state.hold_after_unclean_stop(&q, UnixMillis(5_000));
        assert_eq!(q.decide(&state, 1, UnixMillis(5_000)), Decision::WaitUntil { at: UnixMillis(65_010), by: Hold::CoolDown });
    }

    #[test]
    fn binding_tier_is_used_at_least_99_percent_over_a_long_run() {
        for (tiers, margin) in [(&["10/s", "500/min", "1000000/day"][..], 10), (&["3/s", "1000/h"][..], 10), (&["50/s"][..], 5)] {
            let q = quota(tiers, margin);
            let span = 3_600_000;
            let sent = saturate(&q, &[1], 1_795_824_000_000, span);
            let achieved = sent.len() as f64 / (span as f64 / 1000.0);
            let utilization = achieved / q.binding_tier().rate_per_second();
            assert!(utilization >= 0.99, "{tiers:?}: utilization {utilization:.4}");
            assert!(utilization <= 1.0, "{tiers:?}: over quota {utilization:.4}");
        }
    }

    fn tier_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            (1u64..20, 1u64..3).prop_map(|(l, s)| format!("{l}/{s}s")),
            (1u64..40, 100u64..900).prop_map(|(l, ms)| format!("{l}/{ms}ms")),
            (20u64..200).prop_map(|l| format!("{l}/min")),
            (50u64..400).prop_map(|l| format!("{l}/day")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// No window of any tier, wherever it starts, ever holds more than the limit,
        /// whatever the costs, margin and the (irregular) moments jobs show up.
        #[test]
        fn no_window_of_any_tier_ever_admits_more_than_its_limit(
            tiers in proptest::collection::vec(tier_strategy(), 1..4),
            costs in proptest::collection::vec(1u64..4, 1..20),
            gaps in proptest::collection::vec(0u64..700, 1..50),
            margin in 0u64..20,
            start in 1_795_800_000_000u64..1_795_900_000_000,
        ) {
            let mut unique = tiers.clone();
            unique.sort();
            unique.dedup_by_key(|t| t.split('/').nth(1).map(str::to_owned));
            let Ok(q) = Quota::new(unique.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::from_millis(margin)) else {
                return Ok(());
            };
            let mut state = PacerState::new(&q);
            let mut now = UnixMillis(start);
            let mut sent = Vec::new();
            for (i, gap) in gaps.iter().cycle().take(600).enumerate() {
                let cost = costs[i % costs.len()];
                match q.decide(&state, cost, now) {
                    Decision::Allow => { state.commit(&q, cost, now); sent.push((now, cost)); }
                    Decision::WaitUntil { at, .. } => prop_assert!(at > now),
                    Decision::Never { tier } => prop_assert!(cost > tier.limit),
                }
                now = now.plus(Duration::from_millis(*gap));
            }
            for tier in q.tiers() {
                match tier.period {
                    Period::Rolling(window) => {
                        let peak = peak_in_any_window(&sent, window);
                        prop_assert!(peak <= tier.limit, "{tier}: {peak} in one window");
                    }
                    _ => {
                        let mut per_day = std::collections::BTreeMap::<UnixMillis, u64>::new();
                        for (t, c) in &sent { *per_day.entry(tier.window_at(q.zone(), *t).0).or_default() += c; }
                        prop_assert!(per_day.values().all(|u| *u <= tier.limit), "{tier}: {per_day:?}");
                    }
                }
            }
        }
    }
}
