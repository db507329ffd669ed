//! Order within a lane (`ordering = "fifo"`): the lane's jobs are called in the order
//! they were enqueued, and a job that must be retried is called before any later job of
//! its lane. An ordered lane has at most one job handed off and not yet settled; the
//! [`OrderMark`] in the lane's state says which, and what came of it, so that a run, the
//! next run after it, and the worker that settles the job all agree on it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::lane::LaneId;
use crate::time::UnixMillis;

/// The name of an ordered lane's mark in its state.
pub const ORDER_MARK: &str = "order_mark";

/// What the message group of an ordered job's retry ends with on a FIFO queue: a group
/// of its own (no lane id can hold a `~`), so that the lane's later jobs, held by the
/// orchestrator while their group waits, never hold the retry back.
pub const RETRY_GROUP_SUFFIX: &str = "~retry";

/// The message group of a job of `lane` on SQS: the lane's, or its retries' (`ahead`).
#[must_use]
pub fn message_group(lane: &LaneId, ahead: bool) -> String {
    if ahead {
        format!("{lane}{RETRY_GROUP_SUFFIX}")
    } else {
        lane.to_string()
    }
}

/// Whether `group` is one of `lane`'s message groups.
#[must_use]
pub fn is_group_of(group: &str, lane: &LaneId) -> bool {
    group.strip_suffix(RETRY_GROUP_SUFFIX).unwrap_or(group) == lane.as_str()
}

/// How a lane's jobs are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobOrder {
    /// The queue's order, roughly: several calls of the lane run at once, and a retry
    /// goes behind the jobs enqueued before it came back.
    #[default]
    None,
    /// Enqueue order, retries first: one call of the lane at a time.
    Fifo,
}

impl JobOrder {
    /// Whether jobs are called strictly in order.
    #[must_use]
    pub fn is_ordered(self) -> bool {
        self == Self::Fifo
    }
}

impl std::str::FromStr for JobOrder {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "" | "none" => Ok(Self::None),
            "fifo" => Ok(Self::Fifo),
            other => Err(format!("`{other}` is not an ordering (\"fifo\", or \"none\", the default)")),
        }
    }
}

/// Which lanes of a stack are ordered: the default (`[lanes] ordering`, or `[quota]
/// ordering` for a stack of one lane) and the lanes named with their own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaneOrdering {
    pub default: JobOrder,
    pub named: BTreeMap<LaneId, JobOrder>,
}

impl LaneOrdering {
    /// How `lane`'s jobs are ordered.
    #[must_use]
    pub fn of(&self, lane: &LaneId) -> JobOrder {
        self.named.get(lane).copied().unwrap_or(self.default)
    }

    /// Whether any lane is ordered.
    #[must_use]
    pub fn any(&self) -> bool {
        self.default.is_ordered() || self.named.values().any(|order| order.is_ordered())
    }
}

/// The job an ordered lane handed off last, and what came of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderMark {
    pub job_id: String,
    pub attempt: u32,
    pub state: OrderState,
}

/// Where an ordered lane's last job stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum OrderState {
    /// Handed off at `since`, not settled yet: the lane's next job waits.
    Open { since: UnixMillis },
    /// Re-queued ahead of the lane's later jobs, to be called again no sooner than `at`
    /// (its back-off): the lane's next call is this job's.
    Retrying { at: UnixMillis },
    /// Done (succeeded or dead-lettered) at `at`: the lane's next job may go.
    Settled { at: UnixMillis },
}

impl OrderMark {
    /// The mark of job `job_id`'s `attempt`, handed off at `since`.
    #[must_use]
    pub fn open(job_id: &str, attempt: u32, since: UnixMillis) -> Self {
        Self { job_id: job_id.to_owned(), attempt, state: OrderState::Open { since } }
    }

    /// Whether this mark is of job `job_id`'s `attempt`.
    #[must_use]
    pub fn names(&self, job_id: &str, attempt: u32) -> bool {
        self.job_id == job_id && self.attempt == attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ordering_is_read_from_its_name_and_a_wrong_one_is_named() {
        assert_eq!("fifo".parse::<JobOrder>(), Ok(JobOrder::Fifo));
        assert_eq!("none".parse::<JobOrder>(), Ok(JobOrder::None));
        assert!("FIFO-ish".parse::<JobOrder>().unwrap_err().contains("`FIFO-ish` is not an ordering"));
    }

    #[test]
    fn a_mark_keeps_its_state_across_the_store() {
        for state in [OrderState::Open { since: UnixMillis(5) }, OrderState::Retrying { at: UnixMillis(9) }, OrderState::Settled { at: UnixMillis(11) }] {
            let mark = OrderMark { job_id: "j-1".into(), attempt: 2, state };
            assert_eq!(serde_json::from_str::<OrderMark>(&serde_json::to_string(&mark).unwrap()).unwrap(), mark);
        }
    }
}
