//! Every key a state store keeps, rendered in one place. A lane's state (pacer, circuit,
//! cool-down, provider reading, usage counters, call records, call slots) is kept under
//! its lane's scope; the default lane's keys are the ones a stack of one lane always had,
//! so a store written before lanes reads the same. The stack's own state (the shared
//! quota's pacer and counters) has a scope no lane id can spell (`#` is not allowed in
//! one); the lease is the stack's and never scoped. A stack of several shards keeps each
//! shard's lease and share of the shared quota apart ([`Shard`]); shard 0's are the keys
//! of a stack of one shard.

use std::fmt;

use crate::lane::LaneId;

/// The name of a lane's settings as an operator changed them (`paceline lanes set`).
pub const LANE_CHANGE: &str = "lane_settings";

/// Whose state a key holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StoreScope {
    /// One lane's state.
    Lane(LaneId),
    /// What the whole stack shares: the shared quota's pacer and counters (shard 0's
    /// share of them in a stack of shards), and a stack-wide cool-down.
    Stack,
    /// Shard `N`'s share of the shared quota (its pacer and counters), for shards 1 and up.
    Shard(usize),
}

impl StoreScope {
    /// The default lane's scope: the keys of a stack without lanes.
    #[must_use]
    pub fn default_lane() -> Self {
        Self::Lane(LaneId::default_lane())
    }

    /// What this scope's keys start with: nothing for the default lane, `lane#ID#` for
    /// another lane, `stack#` for the stack, `shard#N#` for shard N.
    #[must_use]
    pub fn prefix(&self) -> String {
        match self {
            Self::Lane(lane) if lane.is_default() => String::new(),
            Self::Lane(lane) => format!("lane#{lane}#"),
            Self::Stack => "stack#".to_owned(),
            Self::Shard(index) => format!("shard#{index}#"),
        }
    }

    /// `name` (`pacer`, `circuit`, a usage or call record key) in this scope.
    #[must_use]
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix())
    }

    /// The name under this scope of a key it holds (the key without its prefix).
    #[must_use]
    pub fn name_of<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(self.prefix().as_str())
    }
}

impl fmt::Display for StoreScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Lane(lane) => write!(f, "lane {lane}"),
            Self::Stack => f.write_str("the stack"),
            Self::Shard(index) => write!(f, "shard {index}"),
        }
    }
}

/// Which of a stack's shards an orchestrator runs: each shard has its own jobs queue,
/// orchestrator, lease and share of the shared quota, and the lanes that live on it
/// (whose [`LaneId::shard`] is its index, unless an operator moved them:
/// [`LaneHomes`](crate::homes::LaneHomes)). A stack of one shard is shard 0 of 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub of: usize,
}

impl Shard {
    /// The one shard of a stack that has no others.
    pub const WHOLE: Self = Self { index: 0, of: 1 };

    /// Where this shard's share of the shared quota is kept.
    #[must_use]
    pub fn scope(&self) -> StoreScope {
        match self.index {
            0 => StoreScope::Stack,
            index => StoreScope::Shard(index),
        }
    }

    /// The key of this shard's lease: `lease` for shard 0, as a stack of one shard has it.
    #[must_use]
    pub fn lease_key(&self) -> String {
        match self.index {
            0 => "lease".to_owned(),
            index => StoreScope::Shard(index).key("lease"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_lane_keeps_the_keys_of_a_stack_without_lanes_and_other_scopes_cannot_collide() {
        assert_eq!(StoreScope::default_lane().key("pacer"), "pacer");
        assert_eq!(StoreScope::default_lane().key("call#j1#1"), "call#j1#1");
        let acme = StoreScope::Lane(LaneId::parse("acme").unwrap());
        assert_eq!(acme.key("circuit"), "lane#acme#circuit");
        assert_eq!(acme.name_of("lane#acme#failures#1000#3"), Some("failures#1000#3"));
        assert_eq!(acme.name_of("lane#acmex#circuit"), None, "another lane's key is not acme's");
        assert_eq!(StoreScope::Stack.key("pacer"), "stack#pacer");
        // No lane id holds `#`, so no lane's prefix is another's or the stack's.
        assert!(LaneId::parse("stack#").is_err() && LaneId::parse("a#b").is_err());
        assert_eq!(StoreScope::Shard(2).key("pacer"), "shard#2#pacer");
    }

    /// Shard 0 keeps the keys of a stack of one shard, so adding shards leaves a deployed
    /// stack's state where it was; the others' are their own.
    #[test]
    fn shard_zero_keeps_a_stack_s_keys_and_the_others_have_their_own() {
        let third = Shard { index: 2, of: 4 };
        assert_eq!((Shard::WHOLE.scope(), Shard::WHOLE.lease_key()), (StoreScope::Stack, "lease".to_owned()));
        assert_eq!((third.scope(), third.lease_key()), (StoreScope::Shard(2), "shard#2#lease".to_owned()));
    }
}
