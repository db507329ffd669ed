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

/// What a job's answer is taken to take before any was seen: the mark is first read
/// that long after the job's slot.
const FIRST_GUESS: Duration = Duration::from_millis(50);
/// An open job's mark is first read half its lane's usual time after its slot, then an
/// eighth of that time apart, within these bounds: a job is seen settled about a
/// sixteenth of the usual time after it was, and a slow API's jobs cost few reads.
const QUICKEST_READ: Duration = Duration::from_millis(2);
const SLOWEST_READ: Duration = Duration::from_secs(1);

/// An ordered lane's gate: where the lane stands, and how long its jobs usually take from
/// their slot until their worker settles them (learnt from the marks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OrderGate {
    state: GateState,
    settle_time: Option<Duration>,
}

/// Where an ordered lane stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum GateState {
    /// The mark was not read yet this run: nothing goes before it is (an earlier run's
    /// job may still be under way).
    Unread,
    /// The last job is settled: the next may go.
    Free,
    /// Job `job_id`'s `attempt` went to a worker for its slot `slot` and is not settled:
    /// nothing goes. `reads` re-reads found it so; the lane has waited since
    /// `waiting_since`.
    Open { job_id: String, attempt: u32, slot: UnixMillis, reads: u32, waiting_since: UnixMillis },
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
    /// A gate whose mark was not read yet.
    pub fn unread() -> Self {
        Self { state: GateState::Unread, settle_time: None }
    }

    /// A read of the mark at `now` found `mark`. A mark of another job than the one the
    /// gate holds open is older than its hand-off (that write had not landed): it
    /// changes nothing.
    pub fn on_read(&mut self, mark: Option<OrderMark>, now: UnixMillis) {
        let found = |mark: OrderMark| match mark.state {
            OrderState::Settled { .. } => GateState::Free,
            OrderState::Retrying { at } => GateState::Retry { job_id: mark.job_id, at, waiting_since: now },
            OrderState::Open { .. } => GateState::Open { job_id: mark.job_id, attempt: mark.attempt, slot: now, reads: 0, waiting_since: now },
        };
        match &mut self.state {
            GateState::Unread => self.state = mark.map_or(GateState::Free, found),
            GateState::Open { job_id, attempt, slot, reads, .. } => match mark {
                Some(mark) if mark.names(job_id, *attempt) && !matches!(mark.state, OrderState::Open { .. }) => {
                    if let OrderState::Settled { at } = mark.state {
                        let took = at.since(*slot);
                        // An exponential average (weight 1/8), as TCP smooths round-trip times.
                        self.settle_time = Some(self.settle_time.map_or(took, |usual| (usual * 7 + took) / 8));
                    }
                    self.state = found(mark);
                }
                _ => *reads += 1,
            },
            GateState::Free | GateState::Retry { .. } => {}
        }
    }

    /// Job `job_id`'s `attempt` was handed off at `now` for its slot `slot`.
    pub fn opened(&mut self, job_id: &str, attempt: u32, slot: UnixMillis, now: UnixMillis) {
        self.state = GateState::Open { job_id: job_id.to_owned(), attempt, slot: slot.max(now), reads: 0, waiting_since: now };
    }

    /// The hand-off was refused: the job is the front one again, the next to go.
    pub fn handed_back(&mut self) {
        self.state = GateState::Free;
    }

    /// When the mark is to be read next, counting from `now` (`None`: no read needed):
    /// an open job's first read half the usual time after its slot, then an eighth of
    /// the usual time apart.
    pub fn read_at(&self, now: UnixMillis) -> Option<UnixMillis> {
        let usual = self.settle_time.unwrap_or(FIRST_GUESS);
        match &self.state {
            GateState::Unread => Some(now),
            GateState::Open { slot, reads: 0, .. } => Some(slot.plus(usual / 2).max(now.plus(QUICKEST_READ))),
            GateState::Open { .. } => Some(now.plus((usual / 8).clamp(QUICKEST_READ, SLOWEST_READ))),
            GateState::Free | GateState::Retry { .. } => None,
        }
    }

    /// The retry the gate waits for, if it does, and when it is due.
    pub fn awaited_retry(&self) -> Option<(&str, UnixMillis)> {
        match &self.state {
            GateState::Retry { job_id, at, .. } => Some((job_id, *at)),
            _ => None,
        }
    }

    /// What the lane may do at `now`; `retry_in_hand`: whether the awaited retry's job is
    /// the front one in hand (the lane puts it there). A wait longer than
    /// [`GIVE_UP_AFTER`] ends with a warning: the lane goes on.
    pub fn step(&mut self, retry_in_hand: bool, now: UnixMillis) -> GateStep {
        match &self.state {
            GateState::Free => GateStep::Go,
            GateState::Unread => GateStep::WaitForRead,
            GateState::Open { job_id, attempt, waiting_since, .. } => {
                if now.since(*waiting_since) < GIVE_UP_AFTER {
                    return GateStep::WaitForRead;
                }
                warn!(job_id = %job_id, attempt = *attempt, "an ordered lane's job was never settled (its worker gave up: see the worker's DLQ); the lane goes on without it");
                self.state = GateState::Free;
                GateStep::Go
            }
            GateState::Retry { job_id, at, waiting_since } => {
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
                self.state = GateState::Free;
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

    fn free() -> OrderGate {
        let mut gate = OrderGate::unread();
        gate.on_read(None, T0);
        gate
    }

    fn mark(job: &str, attempt: u32, state: OrderState) -> Option<OrderMark> {
        Some(OrderMark { job_id: job.into(), attempt, state })
    }

    #[test]
    fn nothing_goes_before_the_mark_is_read_and_an_earlier_run_s_open_job_holds_the_lane() {
        let mut gate = OrderGate::unread();
        assert_eq!(gate.step(false, at(0)), GateStep::WaitForRead);
        assert_eq!(gate.read_at(at(0)), Some(at(0)));
        gate.on_read(mark("a", 0, OrderState::Open { since: UnixMillis(1) }), at(1));
        assert_eq!(gate.step(false, at(2)), GateStep::WaitForRead, "the last run's job is under way");
        gate.on_read(mark("a", 0, OrderState::Settled { at: T0 }), at(3));
        assert_eq!(gate.step(false, at(3)), GateStep::Go);

        let mut first_run = OrderGate::unread();
        first_run.on_read(None, at(0));
        assert_eq!(first_run.step(false, at(0)), GateStep::Go, "no mark: nothing was ever handed off");
    }

    #[test]
    fn an_open_job_holds_the_lane_until_its_own_mark_says_it_is_settled_and_a_stale_mark_changes_nothing() {
        let mut gate = free();
        gate.opened("b", 0, at(0), at(0));
        gate.on_read(mark("a", 0, OrderState::Settled { at: T0 }), at(5));
        assert_eq!(gate.step(false, at(5)), GateStep::WaitForRead, "the mark of the job before: the hand-off's write had not landed");
        gate.on_read(mark("b", 0, OrderState::Open { since: at(0) }), at(10));
        assert_eq!(gate.step(false, at(10)), GateStep::WaitForRead);
        gate.on_read(mark("b", 1, OrderState::Settled { at: T0 }), at(15));
        assert_eq!(gate.step(false, at(15)), GateStep::WaitForRead, "another attempt's mark is not this one's");
        gate.on_read(mark("b", 0, OrderState::Settled { at: T0 }), at(20));
        assert_eq!(gate.step(false, at(20)), GateStep::Go);
    }

    #[test]
    fn a_re_queued_job_goes_next_once_in_hand_and_not_before_its_back_off() {
        let mut gate = free();
        gate.opened("b", 0, at(0), at(0));
        gate.on_read(mark("b", 0, OrderState::Retrying { at: at(500) }), at(40));
        assert_eq!(gate.awaited_retry(), Some(("b", at(500))));
        assert_eq!(gate.step(true, at(100)), GateStep::WaitUntil(at(500)), "its back-off holds the lane's later jobs too");
        assert_eq!(gate.step(false, at(500)), GateStep::WaitForRetry, "later jobs in hand wait for it");
        assert_eq!(gate.step(true, at(501)), GateStep::Go);
        gate.opened("b", 1, at(500), at(500));
        assert_eq!(gate.awaited_retry(), None);
    }

    #[test]
    fn an_open_job_is_first_read_half_its_usual_time_after_its_slot_then_an_eighth_of_it_apart() {
        let mut gate = free();
        gate.opened("a", 0, at(100), at(60));
        assert_eq!(gate.read_at(at(60)), Some(at(125)), "the first guess: answers take 50 ms");
        gate.on_read(mark("a", 0, OrderState::Open { since: at(60) }), at(125));
        assert_eq!(gate.read_at(at(125)), Some(at(131)), "then an eighth of that apart");
        gate.on_read(mark("a", 0, OrderState::Settled { at: at(420) }), at(440));
        // Its worker settled it 320 ms after its slot (when the read saw it does not
        // count): the next job's reads follow that.
        gate.opened("b", 0, at(500), at(500));
        assert_eq!(gate.read_at(at(500)), Some(at(660)));
        gate.on_read(mark("b", 0, OrderState::Open { since: at(500) }), at(660));
        assert_eq!(gate.read_at(at(660)), Some(at(700)));
    }

    #[test]
    fn a_lane_goes_on_after_waiting_too_long_for_a_job_that_is_never_settled_or_a_retry_that_never_comes() {
        let mut open = free();
        open.opened("b", 0, at(0), at(0));
        let limit = u64::try_from(GIVE_UP_AFTER.as_millis()).unwrap();
        assert_eq!(open.step(false, at(limit - 1)), GateStep::WaitForRead);
        assert_eq!(open.step(false, at(limit)), GateStep::Go);
        let mut retry = free();
        retry.opened("c", 0, at(0), at(0));
        retry.on_read(mark("c", 0, OrderState::Retrying { at: at(10) }), at(20));
        assert_eq!(retry.step(false, at(20 + limit - 1)), GateStep::WaitForRetry);
        assert_eq!(retry.step(false, at(20 + limit)), GateStep::Go);
    }
}
