//! How evenly a stack of many lanes divides the shared quota by weight: Jain's fairness
//! index, `(Σx)² / (n·Σx²)` over each lane's calls per unit of weight, taken in windows
//! of [`FAIRNESS_WINDOW`] among the lanes that contended for the shared quota the whole
//! window: backlogged when it started (jobs in hand, or more than it could use given
//! back to the queue), and never held by their own tiers, circuit or cool-down. 1 is an
//! even division; one lane taking it all, `1/n`. Pure.

use std::time::Duration;

use paceline_shared::time::UnixMillis;

/// The length of each window the index is taken over.
pub const FAIRNESS_WINDOW: Duration = Duration::from_secs(10);

/// Jain's fairness index of `shares` (1 when there are none, or all are zero).
#[must_use]
pub fn jain_index(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (shares.len() as f64 * squares)
}

/// Each lane's share of the shared quota in the current window, and the index of every
/// window so far.
#[derive(Debug, Default)]
pub(crate) struct FairnessMeter {
    started: Option<UnixMillis>,
    /// Per lane: calls per unit of weight in this window.
    served: Vec<f64>,
    /// Per lane: backlogged when the window started, and never held by itself since.
    contending: Vec<bool>,
    /// Per lane: gave jobs back to the queue in this window (it has more than it holds).
    gave_back: Vec<bool>,
    indexes: Vec<f64>,
}

impl FairnessMeter {
    /// A lane joined the stack: it contends from the next window.
    pub fn add_lane(&mut self) {
        self.served.push(0.0);
        self.contending.push(false);
        self.gave_back.push(false);
    }

    /// Lane `lane` dispatched `cost` units, at `weight`.
    pub fn served(&mut self, lane: usize, cost: u64, weight: f64) {
        self.served[lane] += cost as f64 / weight;
    }

    /// Lane `lane` gave jobs back to the queue: it is backlogged, whatever it holds.
    pub fn gave_back(&mut self, lane: usize) {
        self.gave_back[lane] = true;
    }

    /// Lane `lane` had jobs and was held by its own tiers, circuit or cool-down: it
    /// did not contend for the shared quota in this window.
    pub fn held_by_itself(&mut self, lane: usize) {
        self.contending[lane] = false;
    }

    /// At `now`, closes the window if it is over and starts the next (`in_hand` says
    /// which lanes hold jobs).
    pub fn tick(&mut self, now: UnixMillis, in_hand: impl Fn(usize) -> bool) {
        let Some(started) = self.started else {
            self.start(now, in_hand);
            return;
        };
        if now < started.plus(FAIRNESS_WINDOW) {
            return;
        }
        let shares: Vec<f64> = (0..self.served.len()).filter(|lane| self.contending[*lane]).map(|lane| self.served[lane]).collect();

        if shares.len() >= 2 && shares.iter().any(|share| *share > 0.0) {
            self.indexes.push(jain_index(&shares));
        }
        self.start(now, in_hand);
    }

    fn start(&mut self, now: UnixMillis, in_hand: impl Fn(usize) -> bool) {
        self.started = Some(now);
        for lane in 0..self.served.len() {
            self.served[lane] = 0.0;
            self.contending[lane] = in_hand(lane) || self.gave_back[lane];
            self.gave_back[lane] = false;
        }
    }

    /// The mean index over the windows in which at least two lanes contended and
    /// something was served, and how many.
    pub fn mean(&self) -> Option<(f64, usize)> {
        (!self.indexes.is_empty()).then(|| (self.indexes.iter().sum::<f64>() / self.indexes.len() as f64, self.indexes.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_even_division_is_one_and_one_lane_taking_everything_is_one_over_n() {
        assert!((jain_index(&[3.0, 3.0, 3.0]) - 1.0).abs() < 1e-12);
        assert!((jain_index(&[9.0, 0.0, 0.0]) - 1.0 / 3.0).abs() < 1e-12);
        assert!((jain_index(&[2.0, 1.0]) - 0.9).abs() < 1e-12);
        assert!((jain_index(&[]) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn only_lanes_that_contended_the_whole_window_count_and_calls_count_per_unit_of_weight() {
        let at = |s: u64| UnixMillis(s * 1_000);
        let mut meter = FairnessMeter::default();
        for _ in 0..3 {
            meter.add_lane();
        }
        meter.tick(at(0), |lane| lane < 2);
        meter.gave_back(2);
        meter.tick(at(1), |_| false);
        meter.tick(at(10), |lane| lane < 2);
        // Lane 0 has weight 3 and three times the calls of lane 1: an even division.
        meter.served(0, 30, 3.0);
        meter.served(1, 10, 1.0);
        // Lane 2 was held by its own tier: it does not count, however little it got.
        meter.served(2, 1, 1.0);
        meter.held_by_itself(2);
        meter.tick(at(15), |_| true);
        assert_eq!(meter.mean(), None, "the window is not over, and the first served none");
        meter.tick(at(20), |_| true);
        let (index, windows) = meter.mean().unwrap();
        assert!((index - 1.0).abs() < 1e-12 && windows == 1, "{index} over {windows}");
        // A window where lane 1 got nothing though it contended.
        meter.served(0, 30, 3.0);
        meter.tick(at(30), |_| false);
        let (index, windows) = meter.mean().unwrap();
        assert_eq!(windows, 2, "a lane that ran dry by the end of a window still counts: it was backlogged");
        assert!((index - (1.0 + 1.0 / 3.0) / 2.0).abs() < 1e-9, "{index}: lanes 0, 1 and 2 contended, one got it all");
    }
}
