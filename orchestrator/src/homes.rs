//! A shard's view of where the stack's lanes live (`paceline_shared::homes`), pure: read
//! before the run's first receive and every second after. A lane moved away is handed
//! over (its jobs sent on to its new shard, its pace saved for it); a lane moved here
//! takes no job until the shard it left can no longer call for it; and no lane is
//! dispatched once the last read that landed is too old to count on, so that a shard
//! which cannot learn of a move has stopped before the lane's new shard starts.

use std::time::Duration;

use paceline_shared::homes::LaneHomes;
use paceline_shared::keys::Shard;
use paceline_shared::lane::LaneId;
use paceline_shared::shares::CLOCK_SKEW;
use paceline_shared::time::UnixMillis;

/// A shard reads the lanes' homes this often.
pub(crate) const READ_EVERY: Duration = Duration::from_secs(1);

/// How long a read of the homes is counted on, from when it was sent: a shard whose
/// reads fail this long dispatches nothing until one lands.
pub(crate) const VALID_FOR: Duration = Duration::from_secs(5);

/// The lanes' homes as this shard's run knows them.
#[derive(Debug)]
pub(crate) struct HomesRun {
    shard: Shard,
    homes: LaneHomes,
    /// Until when the homes as read may be counted on.
    valid_until: UnixMillis,
    /// How long after its move a lane that came here waits: by then every run of the
    /// shard it left has learned of the move (or stopped dispatching), and each of its
    /// calls decided before has gone.
    settle: Duration,
}

impl HomesRun {
    /// Shard `shard`'s view, from `homes` as read by a request sent at `sent_at`; its
    /// calls are decided `ahead` of their slots.
    pub fn new(shard: Shard, homes: LaneHomes, sent_at: UnixMillis, ahead: Duration) -> Self {
        Self { shard, homes, valid_until: sent_at.plus(VALID_FOR), settle: VALID_FOR + ahead + CLOCK_SKEW }
    }

    /// The shard lane `lane` lives on.
    pub fn home_of(&self, lane: &LaneId) -> usize {
        self.homes.home_of(lane, self.shard.of)
    }

    /// Whether lane `lane` lives on this shard.
    pub fn owns(&self, lane: &LaneId) -> bool {
        self.home_of(lane) == self.shard.index
    }

    /// Until when lane `lane`, moved here, takes no job: the shard it left may still
    /// call for it before then.
    pub fn arriving_until(&self, lane: &LaneId, now: UnixMillis) -> Option<UnixMillis> {
        self.homes.arriving(lane, self.shard.of, now, self.settle).filter(|_| self.owns(lane))
    }

    /// Takes up `homes`, read by a request sent at `sent_at`: the lanes whose home
    /// changed, with their new shard.
    pub fn read(&mut self, homes: LaneHomes, sent_at: UnixMillis) -> Vec<(LaneId, usize)> {
        let changed = homes.changed_since(&self.homes, self.shard.of);
        self.homes = homes;
        self.valid_until = self.valid_until.max(sent_at.plus(VALID_FOR));
        changed
    }

    /// Until when the homes as read may be counted on.
    pub fn valid_until(&self) -> UnixMillis {
        self.valid_until
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane_on(shard: usize, of: usize) -> LaneId {
        (0..).map(|n| LaneId::parse(&format!("tenant{n}")).unwrap()).find(|lane| lane.shard(of) == shard).unwrap()
    }

    #[test]
    fn a_lane_moved_here_waits_for_every_run_of_the_shard_it_left_to_know_and_its_calls_to_go() {
        let (here, ahead) = (Shard { index: 1, of: 2 }, Duration::from_millis(400));
        let lane = lane_on(0, 2);
        let mut run = HomesRun::new(here, LaneHomes::default(), UnixMillis(0), ahead);
        assert!(!run.owns(&lane));
        let moved = LaneHomes::default().with_move(&lane, 1, 2, UnixMillis(10_000)).unwrap();
        assert_eq!(run.read(moved, UnixMillis(10_500)), vec![(lane.clone(), 1)]);
        assert!(run.owns(&lane));
        // The shard it left counts on a read sent before the move for 5 s; its calls go
        // up to 400 ms after their decision; the clocks differ by up to 250 ms.
        assert_eq!(run.arriving_until(&lane, UnixMillis(10_500)), Some(UnixMillis(15_650)));
        assert_eq!(run.arriving_until(&lane, UnixMillis(15_650)), None);
        assert_eq!(run.valid_until(), UnixMillis(15_500));
    }

    #[test]
    fn a_lane_moved_away_is_not_arriving_here_and_an_old_read_landing_late_keeps_the_validity() {
        let here = Shard { index: 0, of: 2 };
        let lane = lane_on(0, 2);
        let mut run = HomesRun::new(here, LaneHomes::default(), UnixMillis(0), Duration::ZERO);
        let moved = LaneHomes::default().with_move(&lane, 1, 2, UnixMillis(1_000)).unwrap();
        assert_eq!(run.read(moved.clone(), UnixMillis(2_000)), vec![(lane.clone(), 1)]);
        assert_eq!((run.owns(&lane), run.home_of(&lane), run.arriving_until(&lane, UnixMillis(2_000))), (false, 1, None));
        run.read(moved, UnixMillis(1_500));
        assert_eq!(run.valid_until(), UnixMillis(7_000));
    }
}
