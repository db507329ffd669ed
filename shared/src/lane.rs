//! Lane ids: a lane is one quota's worth of work in a stack (a tenant calling with its
//! own key, or one API). A job names its lane; a stack with one lane has only
//! [`LaneId::default_lane`], as governor's unkeyed limiter is its keyed one with a unit key.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a lane id is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaneIdError {
    #[error("lane id is empty: give 1 to {MAX_LEN} characters of A-Za-z0-9._:-")]
    Empty,
    #[error("lane id is {0} characters long, over the {MAX_LEN} allowed")]
    TooLong(usize),
    #[error("lane id {id:?} has {found:?}: only A-Za-z0-9._:- are allowed")]
    Character { id: String, found: char },
    #[error("lane id {0:?} is the name of a [lanes] setting, so it cannot name a lane")]
    Reserved(String),
}

/// The longest lane id, in characters.
pub const MAX_LEN: usize = 64;

/// The names of the `[lanes]` table's own settings: a lane cannot take one of them,
/// since `[lanes.NAME]` would be read as the setting.
pub const RESERVED: &[&str] = &["tiers", "weight", "max_in_flight", "headers", "base_url", "on_429", "ordering"];

/// A lane's id: 1 to 64 characters of `A-Za-z0-9._:-`, not a `[lanes]` setting's name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LaneId(String);

impl LaneId {
    /// The lane of a job that names none, and the only lane of a stack without `[lanes]`.
    pub const DEFAULT_NAME: &'static str = "default";

    /// Which of `shards` shards the lane lives on (0 with one shard): the 64-bit FNV-1a
    /// hash of its id, modulo `shards`. The same on every machine and in every version,
    /// so a producer in any language can compute it.
    #[must_use]
    pub fn shard(&self, shards: usize) -> usize {
        const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let hash = self.0.bytes().fold(OFFSET, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(PRIME));
        usize::try_from(hash % shards.max(1) as u64).unwrap_or(0)
    }

    /// The default lane.
    #[must_use]
    pub fn default_lane() -> Self {
        Self(Self::DEFAULT_NAME.to_owned())
    }

    /// Parses a lane id.
    ///
    /// # Errors
    /// [`LaneIdError`] naming what is wrong.
    pub fn parse(text: &str) -> Result<Self, LaneIdError> {
        if text.is_empty() {
            return Err(LaneIdError::Empty);
        }
        let length = text.chars().count();
        if length > MAX_LEN {
            return Err(LaneIdError::TooLong(length));
        }
        if let Some(found) = text.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))) {
            return Err(LaneIdError::Character { id: text.chars().take(MAX_LEN).collect(), found });
        }
        if RESERVED.contains(&text) {
            return Err(LaneIdError::Reserved(text.to_owned()));
        }
        Ok(Self(text.to_owned()))
    }

    /// The lane a message's JSON names, whether or not the rest of it is a valid job
    /// (the default lane when it names none or a bad one): a dead letter is listed
    /// under the lane its job was for.
    #[must_use]
    pub fn named_in(body: &str) -> Self {
        let value: Option<serde_json::Value> = serde_json::from_str(body).ok();
        value.as_ref().and_then(|v| v.get("lane")?.as_str()).and_then(|text| Self::parse(text).ok()).unwrap_or_default()
    }

    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    #[must_use]
    pub fn is_default(&self) -> bool {
        self.0 == Self::DEFAULT_NAME
    }
}

impl Default for LaneId {
    fn default() -> Self {
        Self::default_lane()
    }
}

impl TryFrom<String> for LaneId {
    type Error = LaneIdError;

    fn try_from(text: String) -> Result<Self, LaneIdError> {
        Self::parse(&text)
    }
}

impl From<LaneId> for String {
    fn from(lane: LaneId) -> String {
        lane.0
    }
}

impl std::str::FromStr for LaneId {
    type Err = LaneIdError;

    fn from_str(text: &str) -> Result<Self, LaneIdError> {
        Self::parse(text)
    }
}

impl fmt::Display for LaneId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shard is FNV-1a's, as a producer elsewhere computes it: its published test
    /// vector for "a" (0xaf63dc4c8601ec8c), and lanes spread over every shard.
    #[test]
    fn a_lane_s_shard_is_the_fnv_1a_hash_of_its_id_spread_over_the_shards() {
        let a = LaneId::parse("a").unwrap();
        assert_eq!(a.shard(1 << 16), 0xec8c);
        assert_eq!(a.shard(1), 0);
        let mut per_shard = [0_u32; 4];
        for n in 0..4_000 {
            per_shard[LaneId::parse(&format!("t{n:04}")).unwrap().shard(4)] += 1;
        }
        assert!(per_shard.iter().all(|count| (900..=1_100).contains(count)), "{per_shard:?}");
    }

    #[test]
    fn a_lane_id_is_1_to_64_characters_of_a_small_alphabet_and_not_a_setting_s_name() {
        for good in ["acme", "tenant-42", "eu.shop_7:live", "default", &"x".repeat(64)] {
            assert_eq!(LaneId::parse(good).map(|lane| lane.to_string()), Ok(good.to_owned()));
        }
        assert_eq!(LaneId::parse(""), Err(LaneIdError::Empty));
        assert_eq!(LaneId::parse(&"x".repeat(65)), Err(LaneIdError::TooLong(65)));
        assert_eq!(LaneId::parse("ac me"), Err(LaneIdError::Character { id: "ac me".into(), found: ' ' }));
        assert_eq!(LaneId::parse("é"), Err(LaneIdError::Character { id: "é".into(), found: 'é' }));
        assert_eq!(LaneId::parse("weight"), Err(LaneIdError::Reserved("weight".into())));
        assert_eq!(LaneId::parse("a/b").unwrap_err().to_string(), "lane id \"a/b\" has '/': only A-Za-z0-9._:- are allowed");
    }

    #[test]
    fn a_lane_id_reads_and_writes_as_a_json_string_and_is_checked_when_read() {
        let lane: LaneId = serde_json::from_str("\"acme\"").unwrap();
        assert_eq!(serde_json::to_string(&lane).unwrap(), "\"acme\"");
        assert!(serde_json::from_str::<LaneId>("\"no spaces\"").is_err());
        assert!(LaneId::default().is_default());
    }

    #[test]
    fn the_lane_a_message_names_is_read_even_from_a_bad_job_and_is_default_otherwise() {
        assert_eq!(LaneId::named_in(r#"{"lane":"acme","request":1}"#).as_str(), "acme");
        assert!(LaneId::named_in(r#"{"id":"x"}"#).is_default());
        assert!(LaneId::named_in(r#"{"lane":"a b"}"#).is_default());
        assert!(LaneId::named_in("not json").is_default());
    }
}
