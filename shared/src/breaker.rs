//! The circuit breaker as a pure state machine with epochs.
//!
//! Workers open the circuit when the API fails (5xx, timeout, connection error); while it
//! is open the orchestrator dispatches no jobs and sends a health check every interval; a
//! healthy check closes it. Every transition bumps the epoch and is only valid from the
//! epoch its writer saw, so a stale writer (a worker dispatched before the outage, a slow
//! probe from an earlier open period) cannot undo a newer state. The store applies the
//! result with a compare-and-swap on the epoch.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::time::UnixMillis;

/// Whether jobs may flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitStatus {
    Closed,
    Open,
}

impl std::fmt::Display for CircuitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Closed => "closed",
            Self::Open => "open",
        })
    }
}

/// The circuit as stored: status, epoch, and since when and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Circuit {
    pub status: CircuitStatus,
    pub epoch: u64,
    pub since: UnixMillis,
    pub reason: String,
}

/// Why a transition was not made. None of these is an error for the caller: the state
/// it wanted is already there, or a newer one is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the circuit is already {0}")]
    Already(CircuitStatus),
    #[error("stale: the writer saw epoch {seen}, the circuit is at epoch {current}")]
    Stale { seen: u64, current: u64 },
}

impl Default for Circuit {
    fn default() -> Self {
        Self { status: CircuitStatus::Closed, epoch: 0, since: UnixMillis(0), reason: String::new() }
    }
}

impl Circuit {
    /// True while jobs may be dispatched.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.status == CircuitStatus::Closed
    }

    fn transition(&self, to: CircuitStatus, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        if self.status == to {
            return Err(Refusal::Already(to));
        }
        if seen_epoch != self.epoch {
            return Err(Refusal::Stale { seen: seen_epoch, current: self.epoch });
        }
        Ok(Self { status: to, epoch: self.epoch + 1, since: now, reason: reason.to_owned() })
    }

    /// Opens the circuit because of a failure observed by a writer that saw `seen_epoch`.
    ///
    /// # Errors
    /// [`Refusal`] when it is open already or the writer is stale.
    pub fn open(&self, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        self.transition(CircuitStatus::Open, seen_epoch, reason, now)
    }

    /// Closes the circuit after a healthy check sent while it was open at `seen_epoch`.
    ///
    /// # Errors
    /// [`Refusal`] when it is closed already or the check is stale.
    pub fn close(&self, seen_epoch: u64, reason: &str, now: UnixMillis) -> Result<Self, Refusal> {
        self.transition(CircuitStatus::Closed, seen_epoch, reason, now)
    }

    /// While open: when the next health check is due, given the last one sent in this
    /// open period (if any). The first goes one interval after opening, so a provider
    /// that just fell over gets a moment. `None` while closed.
    #[must_use]
    pub fn next_health_check(&self, last_sent: Option<UnixMillis>, interval: Duration) -> Option<UnixMillis> {
        if self.is_closed() {
            return None;
        }
        let after = last_sent.filter(|t| *t >= self.since).unwrap_or(self.since);
        Some(after.plus(interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_opens_and_a_healthy_check_closes_with_epochs() {
        let closed = Circuit::default();
        let open = closed.open(0, "HTTP 503", UnixMillis(1_000)).unwrap();
        assert_eq!((open.status, open.epoch, open.since), (CircuitStatus::Open, 1, UnixMillis(1_000)));
        let closed_again = open.close(1, "health check ok", UnixMillis(4_000)).unwrap();
        assert_eq!((closed_again.status, closed_again.epoch), (CircuitStatus::Closed, 2));
    }

    #[test]
    fn stale_writers_cannot_undo_newer_state() {
        let open = Circuit::default().open(0, "timeout", UnixMillis(1)).unwrap();
        let closed = open.close(1, "ok", UnixMillis(2)).unwrap();
        // A worker dispatched at epoch 0 fails late: the circuit has moved on.
        assert_eq!(closed.open(0, "late failure", UnixMillis(3)), Err(Refusal::Stale { seen: 0, current: 2 }));
        // A probe from the first open period answers after a reopen.
        let reopened = closed.open(2, "HTTP 500", UnixMillis(4)).unwrap();
        assert_eq!(reopened.close(1, "old probe", UnixMillis(5)), Err(Refusal::Stale { seen: 1, current: 3 }));
        assert_eq!(reopened.open(3, "again", UnixMillis(6)), Err(Refusal::Already(CircuitStatus::Open)));
    }

    #[test]
    fn health_checks_follow_the_interval_from_opening() {
        let interval = Duration::from_secs(5);
        assert_eq!(Circuit::default().next_health_check(None, interval), None);
        let open = Circuit::default().open(0, "x", UnixMillis(10_000)).unwrap();
        assert_eq!(open.next_health_check(None, interval), Some(UnixMillis(15_000)));
        assert_eq!(open.next_health_check(Some(UnixMillis(15_200)), interval), Some(UnixMillis(20_200)));
        // A check sent in an earlier open period does not count.
        assert_eq!(open.next_health_check(Some(UnixMillis(9_000)), interval), Some(UnixMillis(15_000)));
    }
}
