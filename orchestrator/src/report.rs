//! What a run did: counts, live progress for a progress bar, and per-tier figures
//! (units, busiest window, the achieved rate's share while there was work to pace, and
//! the tier that set the pace).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use paceline_shared::adaptive::EffectiveRate;
use paceline_shared::check::WindowPeak;
use paceline_shared::pacer::Hold;
use paceline_shared::quota::{Period, Quota, Spread, Tier};
use paceline_shared::time::UnixMillis;
use serde::Serialize;

/// Counters the loop bumps as it goes, readable from another task (progress bars).
#[derive(Debug, Default)]
pub struct Progress {
    pub dispatched: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub health_checks: AtomicU64,
    pub circuit_open: AtomicBool,
}

impl Progress {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why the run ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The deadline (minus its margin) came.
    Deadline,
    /// `drain` was asked and nothing is left to do.
    Drained,
    /// Another orchestrator took the lease: dispatching stopped at once.
    LeaseLost,
    /// The operator asked it to stop.
    Stopped,
}

/// One tier's figures for the run.
#[derive(Clone, Debug, Serialize)]
pub struct TierReport {
    pub tier: Tier,
    /// Units dispatched in the run (jobs and health checks).
    pub units: u64,
    /// Most units in any single window of the tier (rolling tiers) or in the run
    /// (calendar tiers): the busiest window's fill is `peak_window` of the tier's limit.
    pub peak_window: u64,
    /// Rolling tiers: the units dispatched in the paced stretch (from the first dispatch
    /// that waited for the pacer to the last) as a share of the most the tier admits in
    /// a stretch that long (one unit per interval for an evenly spaced tier, its limit
    /// for each window begun for a sliding window): at most 100% unless the tier was
    /// broken (a minute tier filled at the second tier's pace for 10 s is 100%,
    /// not "600%"). Calendar tiers: the share of the current day or month used.
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub utilization: f64,
}

/// The run's summary.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub started_at: UnixMillis,
    pub ended_at: UnixMillis,
    pub stop: StopReason,
    pub dispatched: u64,
    pub health_checks: u64,
    pub dead_lettered: u64,
    /// Jobs of lanes that live on another shard, sent on to that shard's queue.
    pub forwarded: u64,
    /// Messages received but not dispatched, made visible again: a lane's surplus for
    /// later, what was in hand at the end.
    pub released: u64,
    /// A lane's surplus sent again with a delay (and the received messages deleted):
    /// the queue had no room to hide it in flight.
    pub sent_again: u64,
    /// The paced stretch: from the first dispatch that waited for the pacer to the last.
    pub paced_ms: u64,
    /// The tier that held jobs back longest: the one that set the pace (none when
    /// nothing waited for a tier).
    pub paced_by: Option<Tier>,
    /// The slowest the provider's answers made the lane go, and why (none: never below
    /// the configured pace).
    pub slowest_rate: Option<EffectiveRate>,
    pub tiers: Vec<TierReport>,
    /// The longest a job handed off in the run had waited since it was first enqueued
    /// (to its slot): the backlog's age as the run found it.
    pub longest_wait_ms: u64,
    /// Slots handed off whose worker started too late to call (a busy machine), given
    /// back to the pacer: the tiers' figures count calls, not these.
    pub slots_given_back: u64,
    /// With `[lanes]`: each lane that had jobs, most calls first (the tiers above are then
    /// the shared ones).
    pub lanes: Vec<LaneReport>,
    /// With `[lanes]`: how evenly by weight the lanes contending for the shared quota
    /// divided it (none when no window had two of them).
    pub fairness: Option<Fairness>,
}

/// Jain's fairness index of a run (see `fairness`).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Fairness {
    /// The mean of the windows' indexes: 1 is an even division by weight.
    pub jain_index: f64,
    /// How many windows (of `FAIRNESS_WINDOW`) had at least two lanes contending.
    pub windows: usize,
}

/// One lane's part of a run.
#[derive(Clone, Debug, Serialize)]
pub struct LaneReport {
    pub lane: String,
    pub weight: f64,
    pub dispatched: u64,
    /// The longest a job of this lane waited since it was first enqueued (to its slot).
    pub longest_wait_ms: u64,
    /// The lane's own tiers.
    pub tiers: Vec<TierReport>,
}

impl RunReport {
    /// The report of a run that started at `at` and has done nothing yet.
    pub(crate) fn starting_at(at: UnixMillis) -> Self {
        Self {
            started_at: at,
            ended_at: at,
            stop: StopReason::Deadline,
            dispatched: 0,
            health_checks: 0,
            dead_lettered: 0,
            forwarded: 0,
            released: 0,
            sent_again: 0,
            paced_ms: 0,
            paced_by: None,
            slowest_rate: None,
            tiers: Vec::new(),
            longest_wait_ms: 0,
            slots_given_back: 0,
            lanes: Vec::new(),
            fairness: None,
        }
    }
}

/// Accumulates the per-tier figures during a run.
pub(crate) struct TierMeter {
    peaks: Vec<WindowPeak>,
    units: Vec<u64>,
    /// Units dispatched so far, all tiers alike.
    dispatched_units: u64,
    /// The paced stretch: from the first dispatch that waited for the pacer (and the
    /// units dispatched before it) to the last one (and the units dispatched by then).
    first_paced: Option<(UnixMillis, u64)>,
    last_paced: Option<(UnixMillis, u64)>,
    /// Per tier, the time jobs waited because of it.
    held_ms: Vec<u64>,
    /// Units of slots given back (no call made) within the paced stretch.
    given_back_paced: u64,
}

impl TierMeter {
    pub(crate) fn new(quota: &Quota) -> Self {
        Self {
            peaks: quota
                .tiers()
                .iter()
                .map(|t| {
                    WindowPeak::new(match t.period {
                        Period::Rolling(d) => d,
                        Period::Day | Period::Month => Duration::MAX,
                    })
                })
                .collect(),
            units: vec![0; quota.tiers().len()],
            dispatched_units: 0,
            first_paced: None,
            last_paced: None,
            held_ms: vec![0; quota.tiers().len()],
            given_back_paced: 0,
        }
    }

    /// Takes back the dispatch of `cost` units at `slot` whose worker made no call: the
    /// figures count calls, never slots.
    pub(crate) fn give_back(&mut self, slot: UnixMillis, cost: u64) {
        for (peak, units) in self.peaks.iter_mut().zip(&mut self.units) {
            peak.remove(slot, cost);
            *units = units.saturating_sub(cost);
        }
        if let (Some((from, _)), Some((to, _))) = (self.first_paced, self.last_paced) {
            if (from..=to).contains(&slot) {
                self.given_back_paced += cost;
            }
        }
    }

    /// Records a dispatch at `at` that waited `paced` for the pacer, last held by `held`.
    pub(crate) fn record(&mut self, at: UnixMillis, cost: u64, paced: Duration, held: Option<Hold>) {
        let before = self.dispatched_units;
        self.dispatched_units += cost;
        if !paced.is_zero() {
            self.first_paced.get_or_insert((at, before));
            self.last_paced = Some((at, self.dispatched_units));
            if let Some(Hold::Tier(index)) = held {
                self.held_ms[index] += u64::try_from(paced.as_millis()).unwrap_or(u64::MAX);
            }
        }
        for (peak, units) in self.peaks.iter_mut().zip(&mut self.units) {
            peak.push(at, cost);
            *units += cost;
        }
    }

    /// How long jobs waited for the pacer in all (the paced stretch, end to end).
    pub(crate) fn paced_for(&self) -> Duration {
        match (self.first_paced, self.last_paced) {
            (Some((from, _)), Some((to, _))) => to.since(from),
            _ => Duration::ZERO,
        }
    }

    /// The tier that held jobs back longest.
    pub(crate) fn paced_by(&self) -> Option<usize> {
        let (index, held) = self.held_ms.iter().enumerate().max_by_key(|(i, held)| (**held, std::cmp::Reverse(*i)))?;
        (*held > 0).then_some(index)
    }

    /// A rolling tier's share of the paced stretch: the units dispatched in it against
    /// the most the tier admits in a stretch that long, so that no run keeping the tier
    /// shows over 100% (see [`most_admitted`]).
    fn paced_share(&self, tier: &Tier, evenly_spaced: bool) -> f64 {
        let (Some((from, units_before)), Some((to, units_by_end))) = (self.first_paced, self.last_paced) else { return 0.0 };
        let most = most_admitted(tier, evenly_spaced, to.since(from));
        (units_by_end - units_before).saturating_sub(self.given_back_paced) as f64 / most as f64
    }

    pub(crate) fn report(&self, quota: &Quota, calendar_used: &[u64]) -> Vec<TierReport> {
        quota
            .tiers()
            .iter()
            .enumerate()
            .map(|(i, tier)| {
                let evenly_spaced = tier.spread == Spread::Smooth || (tier.spread == Spread::Window && quota.spacing_tier() == Some(i));
                let utilization = if tier.is_calendar() {
                    calendar_used.get(i).copied().unwrap_or(0) as f64 / tier.limit as f64
                } else {
                    self.paced_share(tier, evenly_spaced)
                };
                TierReport { tier: *tier, units: self.units[i], peak_window: self.peaks[i].peak(), utilization }
            })
            .collect()
    }
}

/// The most units rolling `tier` admits from one instant to another `stretch` later, both
/// included: its limit for each window begun as a sliding window; one unit every
/// `window / limit` (and one at the start) for an evenly spaced tier, which also keeps
/// the window's rule; a `burst=N` bucket's N at the start, then its rate.
fn most_admitted(tier: &Tier, evenly_spaced: bool, stretch: Duration) -> u64 {
    let window_ms = u128::from(u64::try_from(tier.nominal_window().as_millis()).unwrap_or(u64::MAX).max(1));
    let stretch_ms = stretch.as_millis();
    let saturating = |n: u128| u64::try_from(n).unwrap_or(u64::MAX);
    let by_window = tier.limit.saturating_mul(saturating(stretch_ms / window_ms + 1));
    let spaced = saturating(stretch_ms * u128::from(tier.limit) / window_ms);
    match tier.spread {
        Spread::Burst(bucket) => bucket.saturating_add(spaced),
        _ if evenly_spaced => spaced.saturating_add(1).min(by_window),
        _ => by_window,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 200 calls at 20/s with a 25 ms margin span 10.2 s: counted against 20 for each of
    /// the 11 seconds begun, the summary said 90.9% of a tier the pacer spaced evenly.
    #[test]
    fn an_evenly_spaced_tier_admits_one_call_per_interval_a_sliding_window_its_limit_per_window_begun() {
        let tier = |text: &str| text.parse::<Tier>().unwrap();
        let ms = Duration::from_millis;
        assert_eq!(most_admitted(&tier("20/s"), true, ms(10_198)), 203 + 1);
        assert_eq!(most_admitted(&tier("20/s"), false, ms(10_198)), 220);
        assert_eq!(most_admitted(&tier("50/10s"), false, ms(24_800)), 150);
        assert_eq!(most_admitted(&tier("1/s"), true, ms(4_000)), 5);
        assert_eq!(most_admitted(&tier("10/s"), true, ms(0)), 1);
        assert_eq!(most_admitted(&tier("2/s burst=40"), false, ms(1_000)), 42);
    }
}
