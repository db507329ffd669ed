//! The drain loop's named deadlines in tables (quinn-proto's `TimerTable` is the
//! model: one for the stack, one for each lane), the lanes' deadlines in a heap (which
//! lane's has come, without a scan of the lanes), and the one back-off every retry in
//! the loop uses.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::marker::PhantomData;
use std::time::Duration;

use paceline_shared::ports::PortError;
use paceline_shared::time::UnixMillis;
use tracing::warn;

use crate::settings::RunError;

/// Declares a kind of timer: a fieldless enum whose variants index a [`TimerTable`],
/// with `COUNT`, the number of its variants (the table's size), derived from the list.
macro_rules! timer_kind {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($(#[$variant_meta:meta])* $variant:ident,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis enum $name {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $name {
            pub(crate) const COUNT: usize = [$($name::$variant),+].len();
        }

        impl From<$name> for usize {
            fn from(timer: $name) -> usize {
                timer as usize
            }
        }
    };
}
pub(crate) use timer_kind;

timer_kind! {
    /// The stack's deadlines (each lane keeps its own: see `lane::LaneTimer`).
    pub(crate) enum Timer {
        /// The lease's next renewal (a third of its TTL after the last, sooner after a failure).
        Renew,
        /// Until when the lease is ours as this process sees it: no hand-off at or after it.
        LeaseExpiry,
        /// The next write of the pacer snapshot (and of the deletes waiting).
        Flush,
        /// No receive before this (after a receive failed).
        Receive,
        /// No prefetch before this (after one found the queue empty): an idle queue is not
        /// polled in a loop. A long poll, when nothing is in hand, does not wait for it.
        Prefetch,
        /// No look for an ordered lane's retry before this (after one did not find it).
        RetryProbe,
        /// No hand-off before this (after the invoker refused one).
        InvokeHold,
        /// The run stops dispatching: its deadline less the margin.
        Stop,
        /// The run starts its relay, the next run ([`crate::handover::RELAY_LEAD`] before
        /// it stops).
        Relay,
        /// The next look for jobs in hand whose visibility timeout comes near, to extend
        /// it (a stack of many lanes).
        Extend,
        /// The shard's next report to the share book (a stack of shards whose shares move).
        ShareReport,
        /// Until when the shard may use the parts it holds: the lease's validity after its
        /// last report that landed.
        ShareValid,
        /// The shard's next read of where the stack's lanes live (a stack of shards).
        HomesRead,
    }
}

/// When each timer of a kind `T` (an enum of `N` variants) fires, if it is armed.
#[derive(Clone, Debug)]
pub(crate) struct TimerTable<T, const N: usize> {
    at: [Option<UnixMillis>; N],
    kind: PhantomData<T>,
}

impl<T, const N: usize> Default for TimerTable<T, N> {
    fn default() -> Self {
        Self { at: [None; N], kind: PhantomData }
    }
}

impl<T: Into<usize>, const N: usize> TimerTable<T, N> {
    pub fn set(&mut self, timer: T, at: UnixMillis) {
        self.at[timer.into()] = Some(at);
    }

    pub fn stop(&mut self, timer: T) {
        self.at[timer.into()] = None;
    }

    pub fn get(&self, timer: T) -> Option<UnixMillis> {
        self.at[timer.into()]
    }

    /// Whether `timer` is armed and its instant has come.
    pub fn is_expired(&self, timer: T, now: UnixMillis) -> bool {
        self.get(timer).is_some_and(|at| at <= now)
    }

    /// Whether `timer` is armed for later than `now` (a hold still in force).
    pub fn is_pending(&self, timer: T, now: UnixMillis) -> bool {
        self.get(timer).is_some_and(|at| at > now)
    }

    /// The earliest armed timer's instant: the loop never sleeps past it.
    pub fn next_timeout(&self) -> Option<UnixMillis> {
        self.at.iter().flatten().copied().min()
    }
}

/// One deadline per lane, in a heap: which lanes' deadlines have come is known in
/// O(log lanes), not by a scan. Moving a deadline leaves its old entry behind, dropped
/// when it comes to the top; the heap is rebuilt when such entries outnumber the live.
#[derive(Debug, Default)]
pub(crate) struct LaneDeadlines {
    heap: BinaryHeap<Reverse<(UnixMillis, usize)>>,
    at: Vec<Option<UnixMillis>>,
    live: usize,
}

impl LaneDeadlines {
    /// Lane `lane`'s deadline is `at` from now on (`None`: it has none).
    pub fn set(&mut self, lane: usize, at: Option<UnixMillis>) {
        if lane >= self.at.len() {
            self.at.resize(lane + 1, None);
        }
        if self.at[lane] == at {
            return;
        }
        match (self.at[lane].is_some(), at.is_some()) {
            (false, true) => self.live += 1,
            (true, false) => self.live -= 1,
            _ => {}
        }
        self.at[lane] = at;
        if let Some(at) = at {
            self.heap.push(Reverse((at, lane)));
            if self.heap.len() > 2 * self.live + 64 {
                self.heap = self.at.iter().enumerate().filter_map(|(lane, at)| at.map(|at| Reverse((at, lane)))).collect();
            }
        }
    }

    pub fn get(&self, lane: usize) -> Option<UnixMillis> {
        self.at.get(lane).copied().flatten()
    }

    /// A lane whose deadline is at or before `now`, its deadline cleared; `None` when
    /// no lane's has come.
    pub fn pop_due(&mut self, now: UnixMillis) -> Option<usize> {
        self.drop_moved();
        let Reverse((at, lane)) = *self.heap.peek()?;
        if at > now {
            return None;
        }
        self.heap.pop();
        self.set(lane, None);
        Some(lane)
    }

    /// The earliest deadline.
    pub fn next(&mut self) -> Option<UnixMillis> {
        self.drop_moved();
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Drops the entries at the top that a lane's deadline moved away from.
    fn drop_moved(&mut self) {
        while let Some(Reverse((at, lane))) = self.heap.peek().copied() {
            if self.at[lane] == Some(at) {
                return;
            }
            self.heap.pop();
        }
    }
}

/// Lets a passing fault (throttling, a blip) through with a warning; anything else is
/// the run's error.
pub(crate) fn passing(e: PortError, what: &str) -> Result<(), RunError> {
    if e.is_retryable() {
        warn!(error = %e, "{what}; trying again shortly");
        Ok(())
    } else {
        Err(e.into())
    }
}

/// Exponential back-off between retries of one thing: `first`, doubling up to `max`,
/// back to `first` after a success.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max, failures: 0 }
    }

    /// Counts a failure and returns the pause before the next try.
    pub fn failed(&mut self) -> Duration {
        let pause = self.first.saturating_mul(1 << self.failures.min(16)).min(self.max);
        self.failures = self.failures.saturating_add(1);
        pause
    }

    pub fn succeeded(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_timeout_is_the_earliest_armed_timer() {
        let mut timers = TimerTable::<Timer, { Timer::COUNT }>::default();
        assert_eq!(timers.next_timeout(), None);
        timers.set(Timer::Stop, UnixMillis(9_000));
        timers.set(Timer::Flush, UnixMillis(5_000));
        timers.set(Timer::InvokeHold, UnixMillis(7_000));
        assert_eq!(timers.next_timeout(), Some(UnixMillis(5_000)));
        timers.stop(Timer::Flush);
        assert_eq!(timers.next_timeout(), Some(UnixMillis(7_000)));
        assert!(timers.is_expired(Timer::InvokeHold, UnixMillis(7_000)) && !timers.is_pending(Timer::InvokeHold, UnixMillis(7_000)));
        assert!(timers.is_pending(Timer::Stop, UnixMillis(7_000)) && !timers.is_expired(Timer::Renew, UnixMillis(u64::MAX)));
    }

    #[test]
    fn lanes_come_due_in_deadline_order_and_a_moved_deadline_counts_where_it_moved() {
        let mut deadlines = LaneDeadlines::default();
        deadlines.set(0, Some(UnixMillis(300)));
        deadlines.set(1, Some(UnixMillis(100)));
        deadlines.set(2, Some(UnixMillis(200)));
        deadlines.set(1, Some(UnixMillis(400)));
        deadlines.set(2, None);
        assert_eq!(deadlines.next(), Some(UnixMillis(300)));
        assert_eq!(deadlines.pop_due(UnixMillis(299)), None);
        assert_eq!(deadlines.pop_due(UnixMillis(1_000)), Some(0));
        assert_eq!(deadlines.get(0), None, "a lane that came due has no deadline until it is set again");
        assert_eq!(deadlines.pop_due(UnixMillis(1_000)), Some(1));
        assert_eq!(deadlines.pop_due(UnixMillis(1_000)), None);
        assert_eq!(deadlines.next(), None);
    }

    #[test]
    fn a_deadline_moved_again_and_again_does_not_grow_the_heap_without_bound() {
        let mut deadlines = LaneDeadlines::default();
        for step in 0..10_000u64 {
            deadlines.set(usize::try_from(step % 3).unwrap(), Some(UnixMillis(1_000_000 - step)));
        }
        assert!(deadlines.heap.len() <= 2 * 3 + 64 + 1, "{} entries for 3 lanes", deadlines.heap.len());
        assert_eq!(deadlines.next(), Some(UnixMillis(1_000_000 - 9_999)));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over_after_a_success() {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(300));
        let pauses: Vec<u128> = (0..5).map(|_| backoff.failed().as_millis()).collect();
        assert_eq!(pauses, vec![50, 100, 200, 300, 300]);
        backoff.succeeded();
        assert_eq!(backoff.failed(), Duration::from_millis(50));
    }
}
