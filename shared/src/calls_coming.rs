//! The calls this process's workers are waiting to make, by slot, so that work which
//! holds the core inside the kernel for milliseconds (a WAL checkpoint's `fsync`, a send
//! of a hundred jobs to the embedded store) goes between them, not over them.
//!
//! A kernel that never preempts itself (`PREEMPT_NONE`, as many servers' and virtual
//! machines' are) lets no thread take the core from a thread inside a system call, so a
//! worker that wakes for its slot then waits for the call to end, whatever its priority
//! ([`crate::priority`]). On one core, `paceline serve` taking 40,000 jobs a second made
//! one call in fifty 2 to 5 ms late that way (perf showed the checkpoint's `ext4`
//! writeback and the inserts' writes ahead of the waiting worker). Such work now looks
//! here first and, where a call is coming within its room, waits until just after it:
//! for a bounded time, so it is slowed, never stopped, by lanes that leave no room.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::time::{system_now, Clock, UnixMillis};

/// The room a WAL checkpoint needs before the next call: its `fsync` held the core for
/// 3 to 5 ms.
pub const CHECKPOINT_ROOM: Duration = Duration::from_millis(7);
/// The most a checkpoint waits for its room (it runs every 200 ms).
pub const CHECKPOINT_WAIT: Duration = Duration::from_millis(50);
/// The room a send of jobs to the embedded store needs before the next call: a
/// transaction of 100 inserts holds the store for about 2 ms.
pub const SEND_ROOM: Duration = Duration::from_millis(5);
/// The most a send waits for its room: at a pace that leaves none (a call every
/// millisecond), each hundred jobs go at most this much later.
pub const SEND_WAIT: Duration = Duration::from_millis(10);

/// The slots of the calls waiting to be made, and how many calls at each.
#[derive(Debug, Default)]
pub struct CallsComing {
    slots: Mutex<BTreeMap<UnixMillis, u32>>,
}

/// One call marked as coming, until it is dropped (made, given up or cancelled).
#[must_use = "the call is coming only while this is held"]
pub struct ComingCall<'a> {
    calls: &'a CallsComing,
    slot: UnixMillis,
}

impl Drop for ComingCall<'_> {
    fn drop(&mut self) {
        let mut slots = self.calls.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = slots.get_mut(&self.slot) {
            *count -= 1;
            if *count == 0 {
                slots.remove(&self.slot);
            }
        }
    }
}

impl CallsComing {
    #[must_use]
    pub const fn new() -> Self {
        Self { slots: Mutex::new(BTreeMap::new()) }
    }

    /// Marks a call at `slot` as coming while the returned guard is held.
    pub fn waiting_for(&self, slot: UnixMillis) -> ComingCall<'_> {
        *self.slots.lock().unwrap_or_else(PoisonError::into_inner).entry(slot).or_insert(0) += 1;
        ComingCall { calls: self, slot }
    }

    /// At `now`, whether work needing `room` would run over a coming call: the instant
    /// just after the first such call (when to look again), or `None` where there is
    /// room. Calls whose slot has passed are late already; they hold nothing up.
    #[must_use]
    pub fn in_the_way(&self, now: UnixMillis, room: Duration) -> Option<UnixMillis> {
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let (first, _) = slots.range(now..).next()?;
        (*first < now.plus(room)).then(|| first.plus(Duration::from_millis(1)))
    }

    /// At `now`, until when work needing `room`, which gives up waiting at `give_up`,
    /// waits before it looks again; `None`: it goes now.
    fn wait_until(&self, now: UnixMillis, room: Duration, give_up: UnixMillis) -> Option<UnixMillis> {
        if now >= give_up {
            return None;
        }
        self.in_the_way(now, room).map(|after| after.min(give_up))
    }

    /// Blocks the calling thread until `room` is clear of coming calls, at most `most`.
    pub fn wait_for_room_blocking(&self, room: Duration, most: Duration) {
        let give_up = system_now().plus(most);
        while let Some(until) = self.wait_until(system_now(), room, give_up) {
            std::thread::sleep(until.since(system_now()));
        }
    }

    /// Waits on `clock` until `room` is clear of coming calls, at most `most`.
    pub async fn wait_for_room(&self, clock: &dyn Clock, room: Duration, most: Duration) {
        let give_up = clock.now().plus(most);
        while let Some(until) = self.wait_until(clock.now(), room, give_up) {
            clock.sleep_until(until).await;
        }
    }
}

/// This process's coming calls: its workers mark theirs, its heavy writes make room.
#[must_use]
pub fn calls_coming() -> &'static CallsComing {
    static CALLS: CallsComing = CallsComing::new();
    &CALLS
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMillis = UnixMillis(1_000_000);

    #[test]
    fn work_that_would_run_over_a_coming_call_looks_again_just_after_it() {
        let calls = CallsComing::new();
        let _first = calls.waiting_for(NOW.plus(Duration::from_millis(3)));
        let _second = calls.waiting_for(NOW.plus(Duration::from_millis(9)));
        assert_eq!(calls.in_the_way(NOW, SEND_ROOM), Some(NOW.plus(Duration::from_millis(4))));
        // Just after the first, the second is 5 ms off: room for a send, not a checkpoint.
        let after_first = NOW.plus(Duration::from_millis(4));
        assert_eq!(calls.in_the_way(after_first, SEND_ROOM), None);
        assert_eq!(calls.in_the_way(after_first, CHECKPOINT_ROOM), Some(NOW.plus(Duration::from_millis(10))));
    }

    #[test]
    fn a_call_made_or_given_up_no_longer_holds_anything_and_a_late_one_never_did() {
        let calls = CallsComing::new();
        let late = calls.waiting_for(NOW.minus(Duration::from_millis(1)));
        assert_eq!(calls.in_the_way(NOW, CHECKPOINT_ROOM), None, "its slot passed: it is late already");
        let twice = [calls.waiting_for(NOW.plus(Duration::from_millis(2))), calls.waiting_for(NOW.plus(Duration::from_millis(2)))];
        let [one, other] = twice;
        drop(one);
        assert!(calls.in_the_way(NOW, SEND_ROOM).is_some(), "the other call at that slot is still coming");
        drop(other);
        drop(late);
        assert_eq!(calls.in_the_way(NOW, CHECKPOINT_ROOM), None);
        assert!(calls.slots.lock().unwrap().is_empty(), "nothing left behind");
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_for_room_ends_after_the_call_in_the_way_or_after_its_most() {
        let clock = crate::time::TokioClock::new();
        let calls = CallsComing::new();
        let start = clock.now();
        let _call = calls.waiting_for(start.plus(Duration::from_millis(2)));
        calls.wait_for_room(&clock, SEND_ROOM, SEND_WAIT).await;
        assert_eq!(clock.now(), start.plus(Duration::from_millis(3)), "just after the call");
        // Calls every millisecond leave no room: the wait gives up after its most.
        let every_ms: Vec<_> = (0..40).map(|ms| calls.waiting_for(clock.now().plus(Duration::from_millis(ms)))).collect();
        let before = clock.now();
        calls.wait_for_room(&clock, SEND_ROOM, SEND_WAIT).await;
        assert_eq!(clock.now(), before.plus(SEND_WAIT));
        drop(every_ms);
    }
}
