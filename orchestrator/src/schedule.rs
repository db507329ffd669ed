//! Which lane's job takes the next shared slot: start-time fair queuing (Goyal, Vin and
//! Cheng, 1996), pure. Each lane has a finish tag in virtual time; the lane with jobs
//! ready whose start tag (`max(its finish tag, the system's virtual time)`) is lowest
//! goes first, and a dispatch of `cost` moves its finish tag on by `cost / weight`. A
//! lane that had nothing to send starts at the system's virtual time, so an idle lane
//! banks no credit; a lane its own tiers, circuit or cool-down hold is passed over and
//! what it cannot use goes to the others at once (work-conserving).

/// The lanes' tags in virtual time.
#[derive(Debug, Default)]
pub(crate) struct Scheduler {
    /// The start tag of the last job dispatched.
    system: f64,
    finish: Vec<f64>,
    weight: Vec<f64>,
}

impl Scheduler {
    /// A new lane of `weight` (over 0): its index, the next one.
    pub fn add_lane(&mut self, weight: f64) -> usize {
        self.finish.push(self.system);
        self.weight.push(weight);
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

    /// `lanes` in the order they are served: lowest start tag first, then by index.
    pub fn order(&self, mut lanes: Vec<usize>) -> Vec<usize> {
        lanes.sort_by(|a, b| self.start_tag(*a).total_cmp(&self.start_tag(*b)).then(a.cmp(b)));
        lanes
    }

    /// `lane` dispatched a job of `cost`.
    pub fn charge(&mut self, lane: usize, cost: u64) {
        let start = self.start_tag(lane);
        self.system = start;
        self.finish[lane] = start + cost as f64 / self.weight[lane];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Serves `rounds` jobs of cost 1 among lanes that always have jobs ready.
    fn serve(scheduler: &mut Scheduler, lanes: usize, rounds: usize) -> Vec<u64> {
        let mut served = vec![0; lanes];
        for _ in 0..rounds {
            let next = scheduler.order((0..lanes).collect())[0];
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
        for _ in 0..100 {
            scheduler.charge(busy, 1);
        }
        let late = scheduler.add_lane(1.0);
        // From here the two alternate: the newcomer does not get 100 in a row.
        let served = serve(&mut scheduler, 2, 10);
        assert_eq!(served[late], 5, "{served:?}");
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
