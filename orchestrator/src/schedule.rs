//! Which lane's job takes the next shared slot: start-time fair queuing (Goyal, Vin and
//! Cheng, 1996), pure. Each lane has a finish tag in virtual time; the lane with jobs
//! ready whose start tag (`max(its finish tag, the system's virtual time)`) is lowest
//! goes first, and a dispatch of `cost` moves its finish tag on by `cost / weight`. A
//! lane that had nothing to send starts at the system's virtual time, so an idle lane
//! banks no credit; a lane its own tiers, circuit or cool-down hold is passed over and
//! what it cannot use goes to the others at once (work-conserving).
//!
//! The lanes with a job ready are kept in order of their start tag, and the lanes that
//! wait for a time of their own (their tiers, a cool-down) in a heap of deadlines, so a
//! decision costs O(log lanes), not a scan: a lane is looked at when it is first in
//! line or its wait is over. The lane first in line goes first even when the shared
//! quota would take a smaller job of a lane behind it sooner: otherwise a lane of large
//! jobs could wait for ever behind lanes of small ones.

use std::collections::BTreeSet;

use paceline_shared::time::UnixMillis;

use crate::timers::LaneDeadlines;

/// The lanes' tags in virtual time, and which lanes are ready, waiting or idle.
#[derive(Debug, Default)]
pub(crate) struct Scheduler {
    /// The start tag of the last job dispatched.
    system: f64,
    finish: Vec<f64>,
    weight: Vec<f64>,
    /// The lanes with a job ready, by finish tag (never below `system` while ready:
    /// their start tag), then index.
    ready: BTreeSet<(u64, usize)>,
    in_ready: Vec<bool>,
    /// The lanes with jobs that wait for a time of their own, by when.
    waiting: LaneDeadlines,
}

/// A finish tag as a key that sorts as the tag does (tags are never negative).
fn tag_key(tag: f64) -> u64 {
    tag.to_bits()
}

impl Scheduler {
    /// A new lane of `weight` (over 0), idle: its index, the next one.
    pub fn add_lane(&mut self, weight: f64) -> usize {
        self.finish.push(self.system);
        self.weight.push(weight);
        self.in_ready.push(false);
        self.finish.len() - 1
    }

    pub fn weight(&self, lane: usize) -> f64 {
        self.weight[lane]
    }

    /// `lane`'s weight from its next dispatch on (an operator changed it).
    pub fn set_weight(&mut self, lane: usize, weight: f64) {
        self.weight[lane] = weight;
    }

    /// Where `lane` would start its next job in virtual time.
    pub fn start_tag(&self, lane: usize) -> f64 {
        self.finish[lane].max(self.system)
    }

    /// `lane` has a job that may be ready: it joins the line at its start tag (a lane
    /// that was idle or waiting banks no credit), or keeps its place if in line.
    pub fn ready(&mut self, lane: usize) {
        self.waiting.set(lane, None);
        if !self.in_ready[lane] {
            self.finish[lane] = self.start_tag(lane);
            self.ready.insert((tag_key(self.finish[lane]), lane));
            self.in_ready[lane] = true;
        }
    }

    /// `lane` waits until `until` (its own tiers, a cool-down): out of line until then.
    pub fn wait(&mut self, lane: usize, until: UnixMillis) {
        self.leave_line(lane);
        self.waiting.set(lane, Some(until));
    }

    /// `lane` has nothing to send (no jobs, an open circuit): out of line, not waiting.
    pub fn idle(&mut self, lane: usize) {
        self.leave_line(lane);
        self.waiting.set(lane, None);
    }

    fn leave_line(&mut self, lane: usize) {
        if self.in_ready[lane] {
            self.ready.remove(&(tag_key(self.finish[lane]), lane));
            self.in_ready[lane] = false;
        }
    }

    /// Whether `lane` waits for a time of its own.
    pub fn is_waiting(&self, lane: usize) -> bool {
        self.waiting.get(lane).is_some()
    }

    /// The lanes whose wait is over at `now` join the line.
    pub fn wake_due(&mut self, now: UnixMillis) {
        while let Some(lane) = self.waiting.pop_due(now) {
            self.ready(lane);
        }
    }

    /// Every waiting lane joins the line now: the waits were counted from a reach that
    /// has since widened.
    pub fn wake_all(&mut self) {
        self.wake_due(UnixMillis(u64::MAX));
    }

    /// The lane first in line: the lowest start tag, then the lowest index.
    pub fn first(&self) -> Option<usize> {
        self.ready.first().map(|(_, lane)| *lane)
    }

    /// When the next waiting lane's wait is over.
    pub fn next_wake(&mut self) -> Option<UnixMillis> {
        self.waiting.next()
    }

    /// `lane` dispatched a job of `cost`; in line, it moves back by `cost / weight`.
    pub fn charge(&mut self, lane: usize, cost: u64) {
        let in_line = self.in_ready[lane];
        self.leave_line(lane);
        let start = self.start_tag(lane);
        self.system = start;
        self.finish[lane] = start + cost as f64 / self.weight[lane];
        if in_line {
            self.ready.insert((tag_key(self.finish[lane]), lane));
            self.in_ready[lane] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Serves `rounds` jobs of cost 1 among lanes that always have jobs ready.
    fn serve(scheduler: &mut Scheduler, lanes: usize, rounds: usize) -> Vec<u64> {
        let mut served = vec![0; lanes];
        for lane in 0..lanes {
            scheduler.ready(lane);
        }
        for _ in 0..rounds {
            let next = scheduler.first().expect("lanes in line");
            scheduler.charge(next, 1);
            served[next] += 1;
        }
        served
    }

    #[test]
    fn weights_three_to_one_give_three_calls_to_one() {
        let mut scheduler = Scheduler::default();
        scheduler.add_lane(3.0);
        scheduler.add_lane(1.0);
        assert_eq!(serve(&mut scheduler, 2, 400), vec![300, 100]);
    }

    #[test]
    fn a_lane_that_was_idle_banks_no_credit() {
        let mut scheduler = Scheduler::default();
        let busy = scheduler.add_lane(1.0);
        scheduler.ready(busy);
        for _ in 0..100 {
            scheduler.charge(busy, 1);
        }
        let late = scheduler.add_lane(1.0);
        // From here the two alternate: the newcomer does not get 100 in a row.
        let served = serve(&mut scheduler, 2, 10);
        assert_eq!(served[late], 5, "{served:?}");
    }

    #[test]
    fn a_waiting_lane_rejoins_the_line_when_its_wait_is_over_without_credit_for_the_wait() {
        let at = |ms: u64| UnixMillis(ms);
        let mut scheduler = Scheduler::default();
        let (a, b) = (scheduler.add_lane(1.0), scheduler.add_lane(1.0));
        scheduler.ready(a);
        scheduler.ready(b);
        scheduler.wait(b, at(500));
        assert_eq!(scheduler.next_wake(), Some(at(500)));
        for _ in 0..10 {
            assert_eq!(scheduler.first(), Some(a), "b waits: a has the line to itself");
            scheduler.charge(a, 1);
        }
        scheduler.wake_due(at(499));
        assert_eq!(scheduler.first(), Some(a));
        scheduler.wake_due(at(500));
        assert_eq!(scheduler.next_wake(), None);
        let served = serve(&mut scheduler, 2, 10);
        assert_eq!(served, vec![5, 5], "b starts where a is, not ten jobs behind it");
        scheduler.idle(a);
        assert_eq!(scheduler.first(), Some(b));
        scheduler.idle(b);
        assert_eq!(scheduler.first(), None);
    }

    proptest! {
        /// Among lanes that always have jobs, the calls of any two lanes, each divided by
        /// its weight, never differ by more than one job of each (start-time fair
        /// queuing's bound: `|W_i/w_i - W_j/w_j| <= 1/w_i + 1/w_j` for unit costs).
        #[test]
        fn backlogged_lanes_get_their_weighted_share_within_one_job_each(weights in prop::collection::vec(1u32..=5, 1..12), rounds in 1usize..500) {
            let mut scheduler = Scheduler::default();
            for weight in &weights {
                scheduler.add_lane(f64::from(*weight));
            }
            let served = serve(&mut scheduler, weights.len(), rounds);
            for (i, wi) in weights.iter().map(|w| f64::from(*w)).enumerate() {
                for (j, wj) in weights.iter().map(|w| f64::from(*w)).enumerate() {
                    let gap = (served[i] as f64 / wi - served[j] as f64 / wj).abs();
                    prop_assert!(gap <= 1.0 / wi + 1.0 / wj + 1e-9, "lanes {i} and {j} (weights {wi}, {wj}) got {} and {} of {rounds}", served[i], served[j]);
                }
            }
        }
    }
}
