//! Every key a state store keeps, rendered in one place. A lane's state (pacer, circuit,
//! cool-down, provider reading, usage counters, call records, call slots) is kept under
//! its lane's scope; the default lane's keys are the ones a stack of one lane always had,
//! so a store written before lanes reads the same. The stack's own state (the shared
//! quota's pacer and counters) has a scope no lane id can spell (`#` is not allowed in
//! one); the lease is the stack's and never scoped.

use std::fmt;

use crate::lane::LaneId;

/// The name of a lane's settings as an operator changed them (`paceline lanes set`).
pub const LANE_CHANGE: &str = "lane_settings";

/// Whose state a key holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StoreScope {
    /// One lane's state.
    Lane(LaneId),
    /// What the whole stack shares: the shared quota's pacer and counters.
    Stack,
}

impl StoreScope {
    /// The default lane's scope: the keys of a stack without lanes.
    #[must_use]
    pub fn default_lane() -> Self {
        Self::Lane(LaneId::default_lane())
    }

    /// What this scope's keys start with: nothing for the default lane, `lane#ID#` for
    /// another lane, `stack#` for the stack.
    #[must_use]
    pub fn prefix(&self) -> String {
        match self {
            Self::Lane(lane) if lane.is_default() => String::new(),
            Self::Lane(lane) => format!("lane#{lane}#"),
            Self::Stack => "stack#".to_owned(),
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
    }
}
