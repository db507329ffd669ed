//! An ordered lane's gate (`ordering = "fifo"`), pure: at most one of the lane's jobs is
//! handed off and not settled, and a job that comes back to be retried goes before any
//! later one. The gate follows the lane's [`OrderMark`] in the store: it opens on a
//! hand-off, and a read of the mark says when the worker settled the job (the next may
//! go) or re-queued it (it goes next, after its back-off).

use std::time::Duration;

use paceline_shared::order::{OrderMark, OrderState};
use paceline_shared::time::UnixMillis;
use tracing::warn;

/// How long a lane waits for a job handed off to be settled, or for a retry to come
/// back, before it goes on without it: its worker died and Lambda gave up on it (the
/// job is in the worker's DLQ), or an operator took the retry off the queue. Longer than
/// any call (a Lambda runs 15 minutes at most).
pub(crate) const GIVE_UP_AFTER: Duration = Duration::from_secs(20 * 60);

/// The first re-read of the mark after a hand-off's slot, doubling while the job stays
/// open up to [`SLOWEST_READ`]: a quick call is seen at once, a slow one costs a read a
/// second.
const FIRST_READ: Duration = Duration::from_millis(5);
const SLOWEST_READ: Duration = Duration::from_secs(1);

/// Where an ordered lane stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum OrderGate {
    /// The mark was not read yet this run: nothing goes before it is (an earlier run's
    /// job may still be under way).
    Unread,
    /// The last job is settled: the next may go.
    Free,
    /// Job `job_id`'s `attempt` went to a worker and is not settled: nothing goes.
    /// `reads` re-reads found it so; the lane has waited since `waiting_since`.
    Open { job_id: String, attempt: u32, reads: u32, waiting_since: UnixMillis },
    /// Job `job_id` comes back to be retried no sooner than `at`: it goes next.
    Retry { job_id: String, at: UnixMillis, waiting_since: UnixMillis },
}

/// What the gate lets the lane do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GateStep {
    /// Hand off the front job.
    Go,
    /// Nothing goes before this: the retry's back-off.
    WaitUntil(UnixMillis),
    /// Nothing goes before the mark is read again.
    WaitForRead,
    /// Nothing goes before the retry's message is received.
    WaitForRetry,
}

impl OrderGate {
    /// A read of the mark at `now` found `mark`. A mark of another job than the one the
    /// gate holds open is older than its hand-off (that write had not landed): it
    /// changes nothing.
    pub fn on_read(&mut self, mark: Option<OrderMark>, now: UnixMillis) {
        let found = |mark: OrderMark| match mark.state {
            OrderState::Settled => Self::Free,
            OrderState::Retrying { at } => Self::Retry { job_id: mark.job_id, at, waiting_since: now },
            OrderState::Open { .. } => Self::Open { job_id: mark.job_id, attempt: mark.attempt, reads: 0, waiting_since: now },
        };
        match self {
            Self::Unread => *self = mark.map_or(Self::Free, found),
            Self::Open { job_id, attempt, reads, .. } => match mark {
                Some(mark) if mark.names(job_id, *attempt) && !matches!(mark.state, OrderState::Open { .. }) => *self = found(mark),
                _ => *reads += 1,
            },
            Self::Free | Self::Retry { .. } => {}
        }
    }

    /// Job `job_id`'s `attempt` was handed off at `now`.
    pub fn opened(&mut self, job_id: &str, attempt: u32, now: UnixMillis) {
        *self = Self::Open { job_id: job_id.to_owned(), attempt, reads: 0, waiting_since: now };
    }

    /// The hand-off was refused: the job is the front one again, the next to go.
    pub fn handed_back(&mut self) {
        *self = Self::Free;
    }

    /// When the mark is to be read next, counting from `now` (`None`: no read needed).
    pub fn read_at(&self, now: UnixMillis) -> Option<UnixMillis> {
        match self {
            Self::Unread => Some(now),
            Self::Open { reads, .. } => Some(now.plus(FIRST_READ.saturating_mul(1 << (*reads).min(16)).min(SLOWEST_READ))),
            Self::Free | Self::Retry { .. } => None,
        }
    }

    /// The retry the gate waits for, if it does, and when it is due.
    pub fn awaited_retry(&self) -> Option<(&str, UnixMillis)> {
        match self {
            Self::Retry { job_id, at, .. } => Some((job_id, *at)),
            _ => None,
        }
    }

    /// What the lane may do at `now`; `retry_in_hand`: whether the awaited retry's job is
    /// the front one in hand (the lane puts it there). A wait longer than
    /// [`GIVE_UP_AFTER`] ends with a warning: the lane goes on.
    pub fn step(&mut self, retry_in_hand: bool, now: UnixMillis) -> GateStep {
        match self {
            Self::Free => GateStep::Go,
            Self::Unread => GateStep::WaitForRead,
            Self::Open { job_id, attempt, waiting_since, .. } => {
                if now.since(*waiting_since) < GIVE_UP_AFTER {
                    return GateStep::WaitForRead;
                }
                warn!(job_id = %job_id, attempt = *attempt, "an ordered lane's job was never settled (its worker gave up: see the worker's DLQ); the lane goes on without it");
                *self = Self::Free;
                GateStep::Go
            }
            Self::Retry { job_id, at, waiting_since } => {
                if now < *at {
                    return GateStep::WaitUntil(*at);
                }
                if retry_in_hand {
                    return GateStep::Go;
                }
                if now.since(*waiting_since) < GIVE_UP_AFTER {
                    return GateStep::WaitForRetry;
                }
                warn!(job_id = %job_id, "an ordered lane's retry never came back (taken off the queue?); the lane goes on without it");
                *self = Self::Free;
                GateStep::Go
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: UnixMillis = UnixMillis(1_800_000_000_000);

    fn at(ms: u64) -> UnixMillis {
        T0.plus(Duration::from_millis(ms))
    }

    fn mark(job: &str, attempt: u32, state: OrderState) -> Option<OrderMark> {
        Some(OrderMark { job_id: job.into(), attempt, state })
    }

    #[test]
    fn nothing_goes_before_the_mark_is_read_and_an_earlier_run_s_open_job_holds_the_lane() {
        let mut gate = OrderGate::Unread;
        assert_eq!(gate.step(false, at(0)), GateStep::WaitForRead);
        assert_eq!(gate.read_at(at(0)), Some(at(0)));
        gate.on_read(mark("a", 0, OrderState::Open { since: UnixMillis(1) }), at(1));
        assert_eq!(gate.step(false, at(2)), GateStep::WaitForRead, "the last run's job is under way");
        gate.on_read(mark("a", 0, OrderState::Settled), at(3));
        assert_eq!(gate.step(false, at(3)), GateStep::Go);

        let mut first_run = OrderGate::Unread;
        first_run.on_read(None, at(0));
        assert_eq!(first_run.step(false, at(0)), GateStep::Go, "no mark: nothing was ever handed off");
    }

    #[test]
    fn an_open_job_holds_the_lane_until_its_own_mark_says_it_is_settled_and_a_stale_mark_changes_nothing() {
        let mut gate = OrderGate::Free;
        gate.opened("b", 0, at(0));
        gate.on_read(mark("a", 0, OrderState::Settled), at(5));
        assert_eq!(gate.step(false, at(5)), GateStep::WaitForRead, "the mark of the job before: the hand-off's write had not landed");
        gate.on_read(mark("b", 0, OrderState::Open { since: at(0) }), at(10));
        assert_eq!(gate.step(false, at(10)), GateStep::WaitForRead);
        gate.on_read(mark("b", 1, OrderState::Settled), at(15));
        assert_eq!(gate.step(false, at(15)), GateStep::WaitForRead, "another attempt's mark is not this one's");
        gate.on_read(mark("b", 0, OrderState::Settled), at(20));
        assert_eq!(gate.step(false, at(20)), GateStep::Go);
    }

    #[test]
    fn a_re_queued_job_goes_next_once_in_hand_and_not_before_its_back_off() {
        let mut gate = OrderGate::Free;
        gate.opened("b", 0, at(0));
        gate.on_read(mark("b", 0, OrderState::Retrying { at: at(500) }), at(40));
        assert_eq!(gate.awaited_retry(), Some(("b", at(500))));
        assert_eq!(gate.step(true, at(100)), GateStep::WaitUntil(at(500)), "its back-off holds the lane's later jobs too");
        assert_eq!(gate.step(false, at(500)), GateStep::WaitForRetry, "later jobs in hand wait for it");
        assert_eq!(gate.step(true, at(501)), GateStep::Go);
        gate.opened("b", 1, at(500));
        assert_eq!(gate.awaited_retry(), None);
    }

    #[test]
    fn reads_of_an_open_job_start_quick_and_slow_down_to_one_a_second() {
        let mut gate = OrderGate::Free;
        gate.opened("b", 0, at(0));
        let mut gaps = Vec::new();
        for n in 0..10 {
            let now = at(n * 1000);
            gaps.push(gate.read_at(now).unwrap().since(now).as_millis());
            gate.on_read(mark("b", 0, OrderState::Open { since: at(0) }), now);
        }
        assert_eq!(gaps, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
    }

    #[test]
    fn a_lane_goes_on_after_waiting_too_long_for_a_job_that_is_never_settled_or_a_retry_that_never_comes() {
        let mut open = OrderGate::Free;
        open.opened("b", 0, at(0));
        let limit = u64::try_from(GIVE_UP_AFTER.as_millis()).unwrap();
        assert_eq!(open.step(false, at(limit - 1)), GateStep::WaitForRead);
        assert_eq!(open.step(false, at(limit)), GateStep::Go);
        let mut retry = OrderGate::Free;
        retry.opened("c", 0, at(0));
        retry.on_read(mark("c", 0, OrderState::Retrying { at: at(10) }), at(20));
        assert_eq!(retry.step(false, at(20 + limit - 1)), GateStep::WaitForRetry);
        assert_eq!(retry.step(false, at(20 + limit)), GateStep::Go);
    }
}
