//! Which shard each lane lives on: where its id's hash puts it ([`LaneId::shard`]),
//! unless an operator moved it (`paceline lanes move`). The moves are one small document
//! of the stack that every shard's run reads, as producers' `paceline enqueue` does.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::lane::LaneId;
use crate::time::UnixMillis;

/// The lanes an operator moved off the shard their hash puts them on, for one layout of
/// shards: a change of the stack's `Shards` forgets them (each lane goes by its hash).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneHomes {
    /// How many shards the stack had when the lanes were moved.
    pub shards: usize,
    /// Each moved lane's shard, and when it was moved there.
    pub moved: BTreeMap<LaneId, Move>,
}

/// Where a lane was moved, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub shard: usize,
    pub at: UnixMillis,
}

/// Why a lane cannot be moved where it was asked to go.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveProblem {
    #[error("this stack has one shard: a lane has nowhere to move (deploy with Shards of 2 or more)")]
    OneShard,
    #[error("shard {to} does not exist: this stack's shards are 0 to {}", .shards - 1)]
    NoSuchShard { to: usize, shards: usize },
    #[error("lane {lane} lives on shard {to} already")]
    AlreadyThere { lane: LaneId, to: usize },
}

impl LaneHomes {
    /// The shard lane `lane` lives on in a stack of `shards` shards.
    #[must_use]
    pub fn home_of(&self, lane: &LaneId, shards: usize) -> usize {
        self.current(shards).and_then(|moved| moved.get(lane)).map_or_else(|| lane.shard(shards), |moved| moved.shard)
    }

    /// When lane `lane` was last moved, in a stack of `shards` shards.
    #[must_use]
    pub fn moved_at(&self, lane: &LaneId, shards: usize) -> Option<UnixMillis> {
        self.current(shards).and_then(|moved| moved.get(lane)).map(|moved| moved.at)
    }

    /// These homes with lane `lane` moved to shard `to` at `now`, in a stack of `shards`
    /// shards (moved back to its hash's shard, it is no longer named).
    ///
    /// # Errors
    /// A stack of one shard, a shard that does not exist, or the lane's own shard.
    pub fn with_move(&self, lane: &LaneId, to: usize, shards: usize, now: UnixMillis) -> Result<Self, MoveProblem> {
        if shards <= 1 {
            return Err(MoveProblem::OneShard);
        }
        if to >= shards {
            return Err(MoveProblem::NoSuchShard { to, shards });
        }
        if self.home_of(lane, shards) == to {
            return Err(MoveProblem::AlreadyThere { lane: lane.clone(), to });
        }
        let mut moved = self.current(shards).cloned().unwrap_or_default();
        // A lane moved back to its hash's shard keeps its entry: the time of the move
        // holds its new shard back until the one it left has handed its pace over.
        moved.insert(lane.clone(), Move { shard: to, at: now });
        Ok(Self { shards, moved })
    }

    /// The lanes whose home changed between `before` and these homes, with their new
    /// shard, in a stack of `shards` shards.
    #[must_use]
    pub fn changed_since(&self, before: &Self, shards: usize) -> Vec<(LaneId, usize)> {
        let lanes: std::collections::BTreeSet<&LaneId> = self.current(shards).into_iter().chain(before.current(shards)).flat_map(BTreeMap::keys).collect();
        lanes
            .into_iter()
            .filter(|lane| self.home_of(lane, shards) != before.home_of(lane, shards))
            .map(|lane| (lane.clone(), self.home_of(lane, shards)))
            .collect()
    }

    /// Whether lane `lane` came to its shard less than `settle` ago at `now`: the shard
    /// it left may not have handed its pace over yet.
    #[must_use]
    pub fn arriving(&self, lane: &LaneId, shards: usize, now: UnixMillis, settle: Duration) -> Option<UnixMillis> {
        self.moved_at(lane, shards).map(|at| at.plus(settle)).filter(|settled| *settled > now)
    }

    fn current(&self, shards: usize) -> Option<&BTreeMap<LaneId, Move>> {
        (self.shards == shards).then_some(&self.moved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(id: &str) -> LaneId {
        LaneId::parse(id).unwrap()
    }

    #[test]
    fn a_lane_lives_where_its_hash_puts_it_until_moved_and_a_new_layout_forgets_the_moves() {
        let acme = lane("acme");
        let hashed = acme.shard(4);
        let to = (hashed + 1) % 4;
        let homes = LaneHomes::default().with_move(&acme, to, 4, UnixMillis(1_000)).unwrap();
        assert_eq!((homes.home_of(&acme, 4), homes.moved_at(&acme, 4)), (to, Some(UnixMillis(1_000))));
        assert_eq!(homes.home_of(&lane("other"), 4), lane("other").shard(4));
        assert_eq!(homes.home_of(&acme, 3), acme.shard(3), "moves are of one layout of shards");
        assert_eq!(homes.moved_at(&acme, 3), None);
    }

    #[test]
    fn a_move_is_refused_with_one_shard_to_a_shard_that_does_not_exist_or_where_the_lane_is() {
        let acme = lane("acme");
        let home = acme.shard(2);
        assert_eq!(LaneHomes::default().with_move(&acme, 0, 1, UnixMillis(0)), Err(MoveProblem::OneShard));
        let err = LaneHomes::default().with_move(&acme, 2, 2, UnixMillis(0)).unwrap_err();
        assert_eq!(err.to_string(), "shard 2 does not exist: this stack's shards are 0 to 1");
        assert_eq!(LaneHomes::default().with_move(&acme, home, 2, UnixMillis(0)), Err(MoveProblem::AlreadyThere { lane: acme, to: home }));
    }

    #[test]
    fn the_lanes_whose_home_changed_are_named_with_their_new_shard_back_moves_included() {
        let (acme, beta) = (lane("acme"), lane("beta"));
        let away = (acme.shard(2) + 1) % 2;
        let first = LaneHomes::default().with_move(&acme, away, 2, UnixMillis(1)).unwrap();
        assert_eq!(first.changed_since(&LaneHomes::default(), 2), vec![(acme.clone(), away)]);
        let back = first.with_move(&acme, acme.shard(2), 2, UnixMillis(2)).unwrap();
        assert_eq!(back.changed_since(&first, 2), vec![(acme.clone(), acme.shard(2))]);
        assert_eq!(back.changed_since(&back, 2), vec![]);
        assert!(first.with_move(&beta, beta.shard(2), 2, UnixMillis(3)).is_err());
    }

    #[test]
    fn a_lane_is_arriving_until_its_move_has_settled() {
        let acme = lane("acme");
        let homes = LaneHomes::default().with_move(&acme, (acme.shard(2) + 1) % 2, 2, UnixMillis(10_000)).unwrap();
        let settle = Duration::from_secs(3);
        assert_eq!(homes.arriving(&acme, 2, UnixMillis(12_999), settle), Some(UnixMillis(13_000)));
        assert_eq!(homes.arriving(&acme, 2, UnixMillis(13_000), settle), None);
        assert_eq!(homes.arriving(&lane("other"), 2, UnixMillis(10_000), settle), None);
    }
}
