//! One lane's half of a run, pure: its pacer, circuit, ramp, adaptive rate, spacing,
//! calendar reservations, call slots, the jobs it holds and its own timers. A lane
//! answers what it would do next at `now` ([`LaneMachine::next_dispatch`],
//! [`LaneMachine::next_health_check`]) and takes what came of it; the stack
//! (`stack.rs`) owns it, with the lease, the receives and the deletes, and never looks
//! inside. A lane never knows whether another lane exists.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::time::Duration;

use paceline_shared::adaptive::{AdaptiveRate, EffectiveRate, ProviderReading, RateReason};
use paceline_shared::breaker::{self, Circuit, CircuitStatus, TripRule};
use paceline_shared::config::LaneChange;
use paceline_shared::job::{CallSlot, DeadLetterCause, DeadLetterReason, Job, WorkerPayload};
use paceline_shared::lane::LaneId;
use paceline_shared::order::OrderMark;
use paceline_shared::pacer::{Decision, Hold, MissedSlot, PacerState};
use paceline_shared::ports::{PacerSnapshot, PortError, PortResult, QueuedMessage};
use paceline_shared::quota::Quota;
use paceline_shared::time::{UnixMillis, COARSE_WAKE_SLACK};
use tracing::{debug, info, warn};

use crate::handover::LastRun;
use crate::late_starts::with_late_starts;
use crate::order_gate::{GateStep, OrderGate};
use crate::report::TierMeter;
use crate::report::TierReport;
use crate::reservations::{Reservation, Reservations};
use crate::settings::{RunError, Settings};
use crate::timers::{passing, timer_kind, Backoff, TimerTable};

/// Dispatching ahead, the slots that fall within this much after the next one are
/// handed off on the same wake-up: each worker waits for its own slot, so a hand-off a
/// few milliseconds earlier costs no precision, and at 1,000 jobs/s the loop wakes
/// about once per 6 jobs instead of once per job or two (the wake-up, not the decision,
/// is most of an in-process job's CPU).
const HAND_OFF_BATCH: Duration = Duration::from_millis(5);
/// Retries of a store call that met a passing fault.
pub(crate) const PORT_BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
/// The circuit is re-read at most this often (see `LaneMachine::refresh_interval`).
const FASTEST_REFRESH: Duration = Duration::from_millis(200);

/// How often a lane in a stack of many lanes saves its pacer snapshot mid-run, at most
/// (the shared quota's goes at every flush). A snapshot written mid-run is never
/// trusted as a clean stop's (the crash rule holds a window whatever it says), so a
/// thousand lanes need not write theirs every flush: that was a write for every three
/// jobs at 200/s over 1,000 lanes.
const MANY_LANES_SNAPSHOT_EVERY: Duration = Duration::from_secs(30);

/// When a re-read due `at` goes: then, or in a stack of many lanes at the next instant
/// on a [`FASTEST_REFRESH`] grid, so that the lanes due about together are read
/// together, in a request or a few (`ScopedStores::lanes_signals`).
fn on_refresh_grid(settings: &Settings, at: UnixMillis) -> UnixMillis {
    on_grid(settings, at, FASTEST_REFRESH)
}

/// A lane of many that comes back from idle is read before it dispatches at the next
/// instant on a grid this fine: the lanes that come back about together are read in a
/// request, where each was read alone (at 10,000 calls/s over 1,000 lanes, 140 reads a
/// second of two lanes each). No coarser: on a 50 ms grid the lanes back from idle on a
/// standard queue waited for it, and the shared tier was 96.1% used, not 97.6%.
const READ_BEFORE_DISPATCH_GRID: Duration = Duration::from_millis(10);

/// `at`, or in a stack of many lanes the next instant on a `grid` from the epoch.
fn on_grid(settings: &Settings, at: UnixMillis, grid: Duration) -> UnixMillis {
    if settings.lanes.is_none() {
        return at;
    }
    let grid = u64::try_from(grid.as_millis()).unwrap_or(u64::MAX);
    UnixMillis(at.0.div_ceil(grid) * grid)
}
/// The orchestrator asks one call's worker this often to record the provider's
/// rate-limit headers (a write to the store each time).
const PROVIDER_READING_EVERY: Duration = Duration::from_secs(1);

timer_kind! {
    /// A lane's own deadlines.
    pub(crate) enum LaneTimer {
        /// The next re-read of the circuit and the provider's cool-down.
        Refresh,
        /// No reservation (so no dispatch that needs one) before this, after one failed.
        Reserve,
        /// The next health check, while the circuit is open.
        HealthCheck,
        /// The next read of an ordered lane's mark.
        OrderRead,
    }
}

/// A message taken off the queue, parsed once, with when it came into hand.
pub(crate) struct InHand {
    message: QueuedMessage,
    job: Result<Job, String>,
    since: UnixMillis,
    /// Until when the queue keeps its message hidden: the receive's visibility timeout,
    /// or the last extension of it.
    hidden_until: UnixMillis,
}

/// Whether `held` is job `job_id`'s message.
fn held_is(held: &InHand, job_id: &str) -> bool {
    held.job.as_ref().is_ok_and(|job| job.id.as_str() == job_id)
}

/// A message being handed off (its job travels in the payload), with when it came into
/// hand and until when it is hidden: what goes back in hand if the hand-off is refused.
pub(crate) struct HandOff {
    pub message: QueuedMessage,
    since: UnixMillis,
    hidden_until: UnixMillis,
    /// The lane's place in its stack.
    pub lane: usize,
    /// The slot and cost it took (what the stack's shared quota commits too).
    pub slot: UnixMillis,
    pub cost: u64,
}

/// How much further than the hand-off's own lead a lane's slot may be while the shared
/// quota binds or other lanes are being read: room for the hand-off itself to go out
/// late, and for the batch it joins to gather 100 ms of calls.
const HAND_OFF_SLACK: Duration = Duration::from_millis(100);
/// The same at a run's start, while many lanes are still being read: the lanes read
/// first take the shared quota's schedule, which goes in order, no further out than
/// this, since the lanes read a few milliseconds later start where they left it. With
/// 100 ms, the few lanes read first had the shared tier's first 100 ms to themselves (at
/// 10,000 calls/s over 1,000 lanes, 1.1% of its first 10 s). Batches gather 25 ms of
/// calls meanwhile; at 10 ms, on a standard queue, which hands the light lanes' first
/// jobs out late, they took up to 860 of Lambda's 1,000 executions at once.
const READING_LANES_SLACK: Duration = Duration::from_millis(25);

/// How far out the slot of a hand-off decided now may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// The lane's whole lead, its batch window's included ([`Lane::latest_slot`]).
    WholeLead,
    /// The hand-off's own lead (and [`HAND_OFF_SLACK`]), near the first slot a lane
    /// read now could take: while other lanes with jobs are still being read, a lane read
    /// first would otherwise take its slots to its whole lead, and the shared quota's
    /// schedule, which goes in order, would start the others after them. So too while
    /// the lanes in hand could use more than the shared quota. A slot the shared quota
    /// puts further out (`not_before`) is still taken.
    HandOffLead,
    /// The same with [`READING_LANES_SLACK`], at a run's start while many lanes are
    /// still being read (see `StackMachine::for_many_lanes`).
    BesideLanesBeingRead,
}

/// What a lane would do next.
pub(crate) enum LaneStep {
    /// Nothing before this instant (its slot, its spacing, a call slot, a health check).
    WaitUntil(UnixMillis),
    /// Reserve these calendar units before the next call spends them.
    Reserve(Vec<Reservation>),
    /// Reserve these calendar units of the quota the stack's lanes share first.
    ReserveShared(Vec<Reservation>),
    /// Move this message to the jobs DLQ with its reason; its job where it parsed.
    DeadLetter(QueuedMessage, DeadLetterReason, Option<Box<Job>>),
    /// Hand this job to a worker.
    Dispatch(HandOff, WorkerPayload),
    /// Hand this health check to a worker.
    HealthCheck(WorkerPayload),
}

/// The quota a stack's lanes share, as a lane's dispatch sees it: a job whose slot needs
/// day or month units of it not yet reserved in the store waits for that reservation.
#[derive(Clone, Copy)]
pub(crate) struct SharedCalendar<'s> {
    pub quota: &'s Quota,
    pub pacer: &'s PacerState,
    pub reserved: &'s Reservations,
}

/// A ramp from a share of the pace up to all of it (see `breaker::ramp_fraction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ramp {
    started: UnixMillis,
}

/// What a refresh reads: the circuit, the provider's cool-down and latest rate-limit
/// reading, and, under a cap on calls in flight, how many call slots are held.
pub(crate) struct SharedState {
    pub circuit: Circuit,
    pub cool_down: UnixMillis,
    pub provider_reading: Option<ProviderReading>,
    pub call_slots: Option<CallSlotsRead>,
    /// With `[lanes]`: an operator's change of the lane's settings to take up.
    pub retune: Option<Retune>,
}

/// An operator's change of a lane's settings, read with its shared state when it
/// differs from the one in force: the lane's settings under it, and the store's counts
/// of the calendar tiers of its quota.
pub(crate) struct Retune {
    pub change: Option<LaneChange>,
    pub quota: Quota,
    pub weight: f64,
    pub calendar_used: Vec<u64>,
}

/// The call slots as read: how many are held, and how many calls so far were not made
/// because none was free.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallSlotsRead {
    pub in_use: u32,
    pub full_so_far: u64,
}

/// The orchestrator's model of the calls in flight under `quota.max_in_flight`: each
/// call handed off holds a call slot from its pacer slot for about `hold` (the API's
/// answer time). The model says when a slot frees, so the next job can be handed off
/// ahead of it. Every re-read of the slots corrects it: the calls turned away since
/// (workers that found every slot held re-queue their job without a call) are taken out,
/// and `hold` is moved just enough that the calls the model has running are the ones the
/// read saw held (the `in_use`-th latest call still running, the next one done). The
/// workers' own slots are the guarantee: one that finds none free makes no call.
#[derive(Debug)]
struct CallSlotModel {
    /// Pacer slots of the calls handed off, oldest first (the last minute's).
    slots: VecDeque<UnixMillis>,
    hold: Duration,
    /// Calls not made for want of a slot, as last read (`None` before the first read).
    full_so_far: Option<u64>,
}

impl CallSlotModel {
    /// The answer time assumed before any re-read.
    const FIRST_HOLD: Duration = Duration::from_secs(1);
    /// The model forgets calls handed off longer ago than this.
    const MEMORY: Duration = Duration::from_secs(60);

    /// A re-read at `now` found `read`.
    fn saw(&mut self, read: CallSlotsRead, now: UnixMillis) {
        let turned_away = self.full_so_far.map_or(0, |before| read.full_so_far.saturating_sub(before));
        self.full_so_far = Some(read.full_so_far);
        for _ in 0..turned_away {
            // The latest calls that started went away without a slot.
            match self.slots.iter().rposition(|slot| *slot <= now) {
                Some(index) => drop(self.slots.remove(index)),
                None => break,
            }
        }
        while self.slots.front().is_some_and(|slot| slot.plus(Self::MEMORY) < now) {
            self.slots.pop_front();
        }
        let started: Vec<Duration> = self.slots.iter().rev().filter(|slot| **slot <= now).map(|slot| now.since(*slot)).collect();
        let held = usize::try_from(read.in_use).unwrap_or(usize::MAX);
        // The `held`-th latest call still runs: the hold is longer than its age...
        if let Some(running) = held.checked_sub(1).and_then(|k| started.get(k)) {
            self.hold = self.hold.max(*running + Duration::from_millis(1));
        }
        // ...and the next one is done: the hold is no longer than its age.
        if let Some(done) = started.get(held) {
            self.hold = self.hold.min((*done).max(Duration::from_millis(1)));
        }
    }

    /// With `capacity` slots: `None` if a call may start at `slot`, or when the model
    /// expects one to free.
    fn full_until(&self, capacity: u32, slot: UnixMillis) -> Option<UnixMillis> {
        let running = || self.slots.iter().filter(|s| s.plus(self.hold) > slot);
        let over = running().count().checked_sub(usize::try_from(capacity).unwrap_or(usize::MAX))?;
        running().nth(over).map(|oldest| oldest.plus(self.hold))
    }
}

impl Default for CallSlotModel {
    fn default() -> Self {
        Self { slots: VecDeque::new(), hold: Self::FIRST_HOLD, full_so_far: None }
    }
}

/// What a lane adds to the run's report.
#[derive(Debug, Default)]
pub(crate) struct LaneFigures {
    /// The longest a job waited from enqueue to its slot.
    pub longest_wait_ms: u64,
    /// The slowest the provider's answers made the lane go.
    pub slowest_rate: Option<EffectiveRate>,
    /// Slots given back because their worker made no call.
    pub slots_given_back: u64,
}

/// One lane's state in a run, and the decisions it makes.
pub(crate) struct LaneMachine<'a> {
    settings: &'a Settings,
    /// The lane's id and its place in the stack.
    id: LaneId,
    index: usize,
    /// The lane's own quota: the config's, or an operator's change of it.
    quota: Cow<'a, Quota>,
    /// An operator's change of the lane's settings in force (`paceline lanes set`).
    change: Option<LaneChange>,
    /// The pace its share of a shared quota allows, calls a second (unbounded alone).
    shared_pace: f64,
    /// A re-read was skipped while it had no jobs: it is made when jobs come in.
    refresh_skipped_while_idle: bool,
    /// Its state is read again before it dispatches (it had nothing to send while an
    /// operator may have held it): the read goes in the background with many lanes.
    read_before_dispatch: bool,
    pacer: PacerState,
    /// The hold this lane set itself (after an unclean stop); the provider's cool-down is
    /// added to it on every refresh, never saved with the pacer.
    own_hold: UnixMillis,
    circuit: Circuit,
    buffer: VecDeque<InHand>,
    /// Calendar units reserved in the store and not yet spent.
    reserved: Reservations,
    timers: TimerTable<LaneTimer, { LaneTimer::COUNT }>,
    refresh_backoff: Backoff,
    reserve_backoff: Backoff,
    /// A health check is being handed off.
    health_check_in_flight: bool,
    last_health_check: Option<UnixMillis>,
    last_dispatch: Option<UnixMillis>,
    /// It dispatched since its pacer snapshot was last taken to be saved, and when that
    /// was (in a stack of many lanes: see [`MANY_LANES_SNAPSHOT_EVERY`]).
    unsaved: bool,
    saved_at: UnixMillis,
    /// What last held the job in hand back (for the report's pace-setting tier).
    last_hold: Option<Hold>,
    /// Jobs flow at a ramping share of the pace (half-open, or a first run's warm-up).
    ramp: Option<Ramp>,
    /// How fast the provider's answers say the lane may go, below the configured pace.
    adaptive: AdaptiveRate,
    /// The adaptive rate as of the last refresh (saved with the pacer, for `status`).
    effective_rate: Option<EffectiveRate>,
    /// The cool-down as last read (`None` before the first read): a later one means a 429.
    cool_down_seen: Option<UnixMillis>,
    /// The last read found a provider reading in the store (one gone since was cleared).
    reading_seen: bool,
    /// The slot of the last call whose worker was asked for the provider's headers.
    reading_asked_for: Option<UnixMillis>,
    /// While jobs go at a share of the pace (a ramp, an adaptive rate), no job is handed
    /// off for a slot before this: `spaced_exact_ms` rounded up.
    spaced_until: UnixMillis,
    spaced_exact_ms: f64,
    /// A swap of the circuit is under way.
    swapping_circuit: bool,
    call_slots: CallSlotModel,
    /// An ordered lane's gate (`None` for a lane without ordering).
    order: Option<OrderGate>,
    /// How much earlier than configured its jobs are handed off: what workers that
    /// started late showed the stack lately (see `late_starts`).
    late_start_lead: Duration,
    order_read_backoff: Backoff,
    exhausted_logged_until: UnixMillis,
    meter: TierMeter,
    pub figures: LaneFigures,
}

impl<'a> LaneMachine<'a> {
    /// The state at the start of a run at `started` of lane `id`, the stack's `index`-th,
    /// under `quota`.
    pub fn new(settings: &'a Settings, id: LaneId, index: usize, quota: &'a Quota, started: UnixMillis) -> Self {
        let mut timers = TimerTable::default();
        timers.set(LaneTimer::Refresh, on_refresh_grid(settings, started.plus(settings.orchestrator.state_refresh)));
        let order = settings.ordering_of(&id).is_ordered().then(OrderGate::unread);
        if order.is_some() {
            timers.set(LaneTimer::OrderRead, started);
        }
        Self {
            settings,
            id,
            index,
            quota: Cow::Borrowed(quota),
            change: None,
            shared_pace: f64::INFINITY,
            refresh_skipped_while_idle: false,
            read_before_dispatch: false,
            pacer: PacerState::new(quota),
            own_hold: UnixMillis(0),
            circuit: Circuit::default(),
            buffer: VecDeque::new(),
            reserved: Reservations::default(),
            timers,
            refresh_backoff: PORT_BACKOFF,
            reserve_backoff: PORT_BACKOFF,
            health_check_in_flight: false,
            last_health_check: None,
            last_dispatch: None,
            unsaved: false,
            saved_at: UnixMillis(0),
            last_hold: None,
            ramp: None,
            adaptive: AdaptiveRate::new(quota, started),
            effective_rate: None,
            cool_down_seen: None,
            reading_seen: false,
            reading_asked_for: None,
            spaced_until: UnixMillis(0),
            spaced_exact_ms: 0.0,
            swapping_circuit: false,
            call_slots: CallSlotModel::default(),
            order,
            late_start_lead: Duration::ZERO,
            order_read_backoff: PORT_BACKOFF,
            exhausted_logged_until: UnixMillis(0),
            meter: TierMeter::new(quota),
            figures: LaneFigures::default(),
        }
    }

    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// An operator's change of the lane's settings in force.
    pub fn change(&self) -> Option<&LaneChange> {
        self.change.as_ref()
    }

    /// Takes up an operator's change of the lane's settings at `now`. Tiers the change
    /// keeps continue where they were; a calendar tier that is new starts from its count
    /// in the store; a rolling tier that is new holds the lane until nothing the old
    /// tiers let through can share its window.
    pub fn retune(&mut self, retune: Retune, now: UnixMillis) {
        let Retune { change, quota, calendar_used, .. } = retune;
        self.change = change;
        if quota.tiers() == self.quota.tiers() {
            self.quota = Cow::Owned(quota); // the cap on calls in flight, if anything
            return;
        }
        let tiers: Vec<String> = quota.tiers().iter().map(ToString::to_string).collect();
        info!(lane = %self.id, tiers = %tiers.join(", "), max_in_flight = ?quota.max_in_flight(), "the lane's settings changed");
        let mut pacer = PacerState::restored(&quota, &self.pacer);
        let used_before = self.pacer.usage(&self.quota, now);
        for (index, tier) in quota.tiers().iter().enumerate().filter(|(_, tier)| tier.is_calendar()) {
            let same = self.quota.tiers().iter().position(|old| old == tier);
            let used = same.map_or(calendar_used[index], |old| used_before[old]);
            pacer.set_calendar_used(&quota, index, used, now);
        }
        let rolling_tier_is_new = quota.tiers().iter().any(|tier| !tier.is_calendar() && !self.quota.tiers().contains(tier));
        if rolling_tier_is_new {
            pacer.hold_after_unclean_stop(&quota, now.max(self.last_dispatch.unwrap_or_default()));
            self.own_hold = self.own_hold.max(pacer.hold_until());
        }
        self.pacer = pacer;
        self.adaptive = AdaptiveRate::new(&quota, now);
        self.meter = TierMeter::new(&quota);
        self.quota = Cow::Owned(quota);
    }

    pub fn id(&self) -> &LaneId {
        &self.id
    }

    /// Its index in the stack's lanes.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The cost of the job at the front, if it parsed.
    pub fn head_cost(&self) -> Option<u64> {
        self.buffer.front().and_then(|front| front.job.as_ref().ok()).map(|job| job.cost)
    }

    /// The slot a hand-off made at `now` takes at the earliest (before spacing).
    pub fn earliest_slot(&self, now: UnixMillis) -> UnixMillis {
        self.slot_at(now)
    }

    /// The first slot the job in front may take at `now` (before spacing): sooner than
    /// [`Self::earliest_slot`] where the stack has a backlog in sight (`batch_ready`: a
    /// batch window's worth of jobs in hand, or full receives; see [`Self::decide`]).
    pub fn first_job_slot(&self, now: UnixMillis, batch_ready: bool) -> UnixMillis {
        if batch_ready {
            now.plus(self.hand_off_lead())
        } else {
            self.slot_at(now)
        }
    }

    /// The last slot a hand-off made at `now` may take.
    pub fn latest_slot(&self, now: UnixMillis) -> UnixMillis {
        self.slot_at(now).plus(self.taken_early())
    }

    /// How far ahead of its slot a job is handed off (zero: at the slot).
    fn lead(&self) -> Duration {
        // An ordered lane's one job at a time is decided when the one before settles: it
        // waits for no batch to gather.
        if self.order.is_some() {
            self.hand_off_lead()
        } else {
            with_late_starts(self.settings.dispatch_ahead(), self.late_start_lead)
        }
    }

    /// How far ahead of its slot a job reaches its worker at the least (zero: at the slot).
    fn hand_off_lead(&self) -> Duration {
        with_late_starts(self.settings.hand_off_lead(), self.late_start_lead)
    }

    /// Hands its jobs off `lead` earlier than configured, from the next decision on.
    pub fn set_late_start_lead(&mut self, lead: Duration) {
        self.late_start_lead = lead;
    }

    pub fn circuit(&self) -> &Circuit {
        &self.circuit
    }

    /// The lane's timers, for the stack's timeout.
    pub fn next_timeout(&self) -> Option<UnixMillis> {
        self.timers.next_timeout()
    }

    /// Whether a re-read of the lane's shared state is due at `now` (the timer stops
    /// until the read comes back).
    pub fn refresh_due(&mut self, now: UnixMillis) -> bool {
        let due = self.timers.is_expired(LaneTimer::Refresh, now);
        if due {
            self.timers.stop(LaneTimer::Refresh);
        }
        due
    }

    /// Whether a read of an ordered lane's mark is due at `now` (the timer stops until
    /// the read comes back).
    pub fn order_read_due(&mut self, now: UnixMillis) -> bool {
        let due = self.timers.is_expired(LaneTimer::OrderRead, now);
        if due {
            self.timers.stop(LaneTimer::OrderRead);
        }
        due
    }

    /// A read of the lane's order mark came back at `now`.
    ///
    /// # Errors
    /// A fatal port error.
    pub fn on_order_read(&mut self, read: PortResult<Option<OrderMark>>, now: UnixMillis) -> Result<(), RunError> {
        let Some(gate) = &mut self.order else { return Ok(()) };
        match read {
            Ok(mark) => {
                self.order_read_backoff.succeeded();
                gate.on_read(mark, now);
                if let Some(at) = gate.read_at(now) {
                    self.timers.set(LaneTimer::OrderRead, at);
                }
                self.bring_retry_forward();
                Ok(())
            }
            Err(e) => self.retry_later(e, LaneTimer::OrderRead, now, "could not read the lane's order mark"),
        }
    }

    /// Whether the lane is ordered and waits at `now` for its retry's message, which is
    /// not in hand and due: the stack receives for it whatever the lane holds.
    pub fn awaits_retry(&self, now: UnixMillis) -> bool {
        let due = |(job_id, at): (&str, UnixMillis)| at <= now && !self.buffer.iter().any(|held| held_is(held, job_id));
        self.order.as_ref().and_then(OrderGate::awaited_retry).is_some_and(due)
    }

    /// Puts the retry an ordered lane waits for at the front of the hand, if it is in
    /// hand; whether it is.
    fn bring_retry_forward(&mut self) -> bool {
        let Some((job_id, _)) = self.order.as_ref().and_then(OrderGate::awaited_retry) else { return false };
        let Some(index) = self.buffer.iter().position(|held| held_is(held, job_id)) else { return false };
        if let Some(held) = self.buffer.remove(index) {
            self.buffer.push_front(held);
        }
        true
    }

    /// What an ordered lane's gate lets it do at `now`: `None` to go on with the front
    /// job, or what to wait for.
    fn order_wait(&mut self, now: UnixMillis) -> Option<LaneStep> {
        self.order.as_ref()?;
        let retry_in_hand = self.bring_retry_forward();
        let gate = self.order.as_mut()?;
        match gate.step(retry_in_hand, now) {
            GateStep::Go => None,
            GateStep::WaitUntil(at) => Some(LaneStep::WaitUntil(self.hand_off_time(at, now))),
            // Until the next read (none due: one is under way, and its answer wakes the loop).
            GateStep::WaitForRead => {
                Some(LaneStep::WaitUntil(self.timers.get(LaneTimer::OrderRead).unwrap_or(UnixMillis(u64::MAX)).max(now.plus(Duration::from_millis(1)))))
            }
            // A receive wakes the loop.
            GateStep::WaitForRetry => Some(LaneStep::WaitUntil(UnixMillis(u64::MAX))),
        }
    }

    /// A reservation hold that is over at `now` is stopped: nothing to wake for.
    pub fn expire_holds(&mut self, now: UnixMillis) {
        if self.timers.is_expired(LaneTimer::Reserve, now) {
            self.timers.stop(LaneTimer::Reserve);
        }
    }

    /// Until when no dispatch may go after a failed reservation, if that hold is in force.
    pub fn held_until(&self, now: UnixMillis) -> Option<UnixMillis> {
        self.timers.get(LaneTimer::Reserve).filter(|at| *at > now)
    }

    pub fn has_jobs_in_hand(&self) -> bool {
        !self.buffer.is_empty()
    }

    pub fn jobs_in_hand(&self) -> usize {
        self.buffer.len()
    }

    pub fn health_check_in_flight(&self) -> bool {
        self.health_check_in_flight
    }

    /// The jobs' pace in units per second at the configured rates.
    pub fn pace_per_second(&self) -> f64 {
        self.quota.pace_per_second()
    }

    /// Starts from what the last run left (its snapshot, as judged) and the calendar
    /// usage in the store.
    pub fn hydrate(&mut self, last_run: LastRun, calendar_used: &[u64], now: UnixMillis) {
        let quota = &*self.quota;
        if last_run == LastRun::None && self.settings.circuit.warm_up {
            info!("the lane's first run: warming up from a share of the pace");
            self.ramp = Some(Ramp { started: now });
        }
        let (snapshot, unclean) = last_run.into_start();
        if let Some(snapshot) = snapshot {
            if let Some(last) = &snapshot.effective_rate {
                self.adaptive.resume(last);
            }
            self.pacer = PacerState::restored(quota, &snapshot.state);
            // The last run's calls go on until its last slot: readings of them are not
            // other clients' use.
            if let Some(last) = self.pacer.last_slot() {
                self.adaptive.known_from(last.plus(Duration::from_millis(1)));
            }
            // A hold left by an earlier run is at most one window of the longest tier
            // (older versions saved the provider's cool-down in it: never past that).
            self.pacer.set_hold_until(self.pacer.hold_until().min(now.plus(self.pacer.longest_window(quota))));
        }
        if unclean {
            self.pacer.hold_after_unclean_stop(quota, now.plus(self.settings.unclean_stop_overhang()));
        }
        self.own_hold = self.pacer.hold_until();
        for (index, tier) in quota.tiers().iter().enumerate() {
            if tier.is_calendar() {
                self.pacer.set_calendar_used(quota, index, calendar_used[index], now);
            }
        }
    }

    /// The pacer snapshot to save at `now`: this lane's own hold, not the provider's
    /// cool-down.
    pub fn snapshot(&self, at_exit: bool, now: UnixMillis) -> PacerSnapshot {
        let mut state = self.pacer.clone();
        state.set_hold_until(self.own_hold);
        PacerSnapshot { state, at_exit, effective_rate: self.effective_rate.clone(), saved_at: Some(now) }
    }

    /// Applies a fresh read of the circuit, the provider's cool-down and reading, and the
    /// call slots.
    pub fn apply_shared_state(&mut self, shared: SharedState, now: UnixMillis) {
        self.refresh_backoff.succeeded();
        self.read_before_dispatch = false;
        let SharedState { circuit, cool_down, provider_reading, call_slots, retune: _ } = shared;
        if let Some(read) = call_slots {
            self.call_slots.saw(read, now);
        }
        self.adapt_rate(provider_reading, cool_down, now);
        if circuit.status != self.circuit.status || circuit.epoch != self.circuit.epoch {
            info!(status = %circuit.status, epoch = circuit.epoch, reason = %circuit.reason, "circuit");
        }
        self.set_circuit(circuit, now);
        // Not `max` with the last value: an operator may have cleared the cool-down.
        self.pacer.set_hold_until(self.own_hold.max(cool_down));
        self.timers.set(LaneTimer::Refresh, on_refresh_grid(self.settings, now.plus(self.refresh_interval())));
    }

    /// A refresh failed: it is tried again after a back-off.
    ///
    /// # Errors
    /// A fatal port error.
    pub fn on_refresh_failed(&mut self, e: PortError, now: UnixMillis) -> Result<(), RunError> {
        // As before it went idle: the read is tried again, jobs go meanwhile.
        self.read_before_dispatch = false;
        self.retry_later(e, LaneTimer::Refresh, now, "could not re-read the circuit")
    }

    /// Feeds the adaptive rate what the provider said: its latest reading, and a 429
    /// when the cool-down moved later since the last read (a worker met one).
    ///
    /// An operator's clear (`paceline circuit close`, `paceline rate reset`) forgets the
    /// stored reading and ends the cool-down: a reading gone, or a cool-down earlier than
    /// the one seen, makes the lane forget what readings and 429s said and go at the
    /// configured pace again.
    fn adapt_rate(&mut self, reading: Option<ProviderReading>, cool_down: UnixMillis, now: UnixMillis) {
        let cleared = self.cool_down_seen.is_some_and(|seen| cool_down < seen) || (reading.is_none() && self.reading_seen);
        // A margin an earlier run learned from a 429 whose cool-down is no longer stored:
        // an operator cleared it between the runs.
        if self.cool_down_seen.is_none() && cool_down == UnixMillis(0) {
            self.pacer.forget_jitter(&self.quota);
        }
        if cleared {
            info!("the provider's readings and cool-down were cleared: the configured pace again");
            self.adaptive.forget_readings();
            self.pacer.forget_jitter(&self.quota);
            self.spaced_until = UnixMillis(0);
        }
        self.reading_seen = reading.is_some();
        if let Some(reading) = reading {
            let usage = self.pacer.usage(&self.quota, reading.at);
            self.adaptive.on_reading(&reading, |tier| usage.get(tier).copied().unwrap_or(0));
        }
        // A lone 429 is jitter at a window's edge: the provider saw two calls closer
        // together than they were sent, so the windows' margin grows. More 429s are
        // someone else's calls: the adaptive rate cuts, the margin stays.
        if self.cool_down_seen.is_some_and(|seen| cool_down > seen) && self.adaptive.on_rate_limited(now) {
            if let Some(margin) = self.pacer.learn_jitter(&self.quota) {
                info!(safety_margin_ms = margin.as_millis(), "a lone 429: the provider saw calls closer than they were sent; widening the windows' margin");
            }
        }
        self.cool_down_seen = Some(cool_down);
        let rate = self.adaptive.rate(now);
        let (share_before, reason_before) = self.effective_rate.as_ref().map_or((1.0, &RateReason::Configured), |r| (r.share(), &r.reason));
        if std::mem::discriminant(reason_before) != std::mem::discriminant(&rate.reason) || (share_before - rate.share()).abs() > 0.1 {
            info!(per_second = rate.per_second, configured = rate.configured_per_second, reason = %rate.reason, "effective rate");
        }
        if rate.share() < 1.0 && self.figures.slowest_rate.as_ref().is_none_or(|slowest| rate.per_second < slowest.per_second) {
            self.figures.slowest_rate = Some(rate.clone());
        }
        self.effective_rate = Some(rate);
    }

    /// How long until the circuit is re-read: `state_refresh`, or, while jobs are in
    /// hand at a pace that would send more than the breaker's `minimum_calls` in that
    /// time, the time those calls take (at least [`FASTEST_REFRESH`]): a circuit a worker
    /// opened stops dispatch before many more calls go. The pace is the lane's share of
    /// a shared quota where that is less than its own: a thousand lanes of 100/s under a
    /// shared 10,000/s were each read five times a second, going at 10/s.
    fn refresh_interval(&self) -> Duration {
        let base = self.settings.orchestrator.state_refresh;
        let pace = self.dispatch_pace(self.last_dispatch.unwrap_or_default());
        if self.buffer.is_empty() || self.circuit.status == CircuitStatus::Open || !pace.is_finite() || pace <= 0.0 {
            return base;
        }
        if self.quota.max_in_flight().is_some() {
            // Freed call slots are seen as soon as a re-read allows.
            return FASTEST_REFRESH.min(base);
        }
        Duration::from_secs_f64(self.settings.circuit.minimum_calls as f64 / pace).clamp(FASTEST_REFRESH.min(base), base)
    }

    /// Takes `circuit` as the current state: health checks while open, a ramp while
    /// half-open.
    fn set_circuit(&mut self, circuit: Circuit, now: UnixMillis) {
        let cfg = &self.settings.circuit;
        match circuit.next_health_check(self.health_check_from(&circuit, now), cfg.health_check_interval, cfg.max_break) {
            Some(due) => self.timers.set(LaneTimer::HealthCheck, due),
            None => self.timers.stop(LaneTimer::HealthCheck),
        }
        match circuit.status {
            CircuitStatus::HalfOpen if self.ramp.is_none_or(|ramp| ramp.started < circuit.since) => {
                self.ramp = Some(Ramp { started: circuit.since });
            }
            CircuitStatus::Open => self.ramp = None,
            _ => {}
        }
        self.circuit = circuit;
    }

    /// From when the next health check of `circuit`'s schedule may go: after the last one
    /// this run sent in its open period, or (none sent yet) from `now`.
    fn health_check_from(&self, circuit: &Circuit, now: UnixMillis) -> UnixMillis {
        self.last_health_check.filter(|sent| *sent >= circuit.since).map_or(now, |sent| sent.plus(Duration::from_millis(1)))
    }

    /// The share of the pace a ramp allows at `now` (1 without a ramp).
    fn ramp_share(&self, now: UnixMillis) -> f64 {
        let cfg = &self.settings.circuit;
        self.ramp.map_or(1.0, |ramp| breaker::ramp_fraction(now.since(ramp.started), cfg.ramp_start, cfg.ramp_step))
    }

    /// The share of the pace jobs may use at `now`: below 1 while a ramp is under way or
    /// the provider's answers call for less.
    fn pace_share(&self, now: UnixMillis) -> f64 {
        self.ramp_share(now) * self.adaptive.rate(now).share()
    }

    /// A ramp that reached the full pace ends; a half-open circuit then closes: the swap
    /// to write, if one is due (`(expected_epoch, next)`).
    pub fn end_finished_ramp(&mut self, now: UnixMillis) -> Option<(u64, Circuit)> {
        if self.ramp.is_none() || self.ramp_share(now) < 1.0 {
            return None;
        }
        if self.circuit.status != CircuitStatus::HalfOpen {
            self.ramp = None;
            return None;
        }
        if self.swapping_circuit {
            return None;
        }
        let next = self.circuit.close(self.circuit.epoch, "the ramp reached the full pace", now).ok()?;
        self.swapping_circuit = true;
        Some((self.circuit.epoch, next))
    }

    /// A swap of the circuit came back.
    ///
    /// # Errors
    /// A fatal port error.
    pub fn on_circuit_swapped(&mut self, next: Circuit, result: PortResult<()>, now: UnixMillis) -> Result<(), RunError> {
        self.swapping_circuit = false;
        match result {
            Ok(()) => {
                info!(status = %next.status, epoch = next.epoch, reason = %next.reason, "circuit");
                self.ramp = None;
                self.set_circuit(next, now);
                Ok(())
            }
            // Someone else moved it (a worker tripped it again): read it anew.
            Err(PortError::Conflict(_)) => {
                self.timers.set(LaneTimer::Refresh, now);
                Ok(())
            }
            Err(e) => self.retry_later(e, LaneTimer::Refresh, now, "could not close the circuit"),
        }
    }

    /// Whether the front message did not parse.
    pub fn front_is_malformed(&self) -> bool {
        self.buffer.front().is_some_and(|front| front.job.is_err())
    }

    /// The front message, if it did not parse: to the DLQ as malformed.
    pub fn take_malformed(&mut self) -> Option<LaneStep> {
        let why = self.buffer.front()?.job.as_ref().err()?.clone();
        let in_hand = self.pop_in_hand();
        Some(LaneStep::DeadLetter(in_hand.message, DeadLetterReason { cause: DeadLetterCause::Malformed, detail: why, outcome: None }, None))
    }

    /// The front job's next step at `now` (the front job parsed: see
    /// [`Self::take_malformed`]): wait for its spacing, a call slot or its pacer slot,
    /// reserve calendar units, dead-letter it if it can never fit, or hand it off.
    /// `not_before`: no slot before it (what the stack's shared quota allows; 0 with
    /// none); `shared`: that quota, whose day and month units are reserved too;
    /// `start_early`: a schedule that fell behind starts again at the first slot allowed,
    /// not the whole lead out (see [`Self::decide`]); `reach`: how far out its slot may be.
    pub fn next_dispatch(&mut self, now: UnixMillis, not_before: UnixMillis, shared: Option<SharedCalendar<'_>>, start_early: bool, reach: Reach) -> LaneStep {
        if self.read_before_dispatch {
            // Woken by the read's answer.
            return LaneStep::WaitUntil(now.plus(self.settings.orchestrator.state_refresh));
        }
        if self.spaced_until > self.slot_at(now).plus(self.taken_early()) {
            return LaneStep::WaitUntil(self.hand_off_time(self.spaced_until, now));
        }
        if let Some(frees) = self.call_slots_full_until(self.slot_at(now)) {
            return LaneStep::WaitUntil(self.hand_off_time(frees, now));
        }
        if let Some(wait) = self.order_wait(now) {
            return wait;
        }
        let job = self.buffer.front().and_then(|front| front.job.as_ref().ok()).expect("a parsed job in hand");
        let cost = job.cost;
        // A large payload takes a while to hand off: it is handed off that much earlier,
        // so the hand-off's own work never eats the margin its worker has to start.
        let extra_lead = if self.lead().is_zero() { Duration::ZERO } else { job.request.hand_off_allowance() };
        let (slot, decision) = self.decide(cost, now.plus(extra_lead), not_before, start_early);
        let slack = match reach {
            Reach::WholeLead => None,
            Reach::HandOffLead => Some(HAND_OFF_SLACK),
            Reach::BesideLanesBeingRead => Some(READING_LANES_SLACK),
        };
        if let Some(slack) = slack.filter(|_| matches!(decision, Decision::Allow) && !self.lead().is_zero()) {
            let reach_ahead = extra_lead + self.hand_off_lead() + slack;
            if slot > now.plus(reach_ahead).max(not_before) {
                // Taken once it is that near.
                return LaneStep::WaitUntil(slot.minus(reach_ahead).max(now.plus(Duration::from_millis(1))));
            }
        }
        match decision {
            Decision::Never { tier } => {
                let in_hand = self.pop_in_hand();
                let detail = format!("cost {cost} exceeds the whole {tier} tier");
                let job = in_hand.job.ok().map(Box::new);
                LaneStep::DeadLetter(in_hand.message, DeadLetterReason { cause: DeadLetterCause::NeverFits, detail, outcome: None }, job)
            }
            Decision::WaitUntil { at, by } => {
                self.note_hold(at, by);
                LaneStep::WaitUntil(self.hand_off_time(at.minus(extra_lead), now))
            }
            Decision::Allow => {
                if let Some(step) = self.reserve_first(cost, slot, shared) {
                    return step;
                }
                let InHand { message, job, since, hidden_until } = self.pop_in_hand();
                let mut job = job.expect("parsed: checked above");
                let enqueued = *job.enqueued_at.get_or_insert(message.enqueued_at);
                self.figures.longest_wait_ms = self.figures.longest_wait_ms.max(slot.since(enqueued).as_millis() as u64);
                let paced = slot.since(self.last_dispatch.unwrap_or(since).max(since));
                self.commit(cost, slot, job.request.upload_allowance(), paced);
                debug!(job_id = %job.id, attempt = message.attempt, cost, "dispatching");
                job.ordered = self.order.is_some();
                if let Some(gate) = &mut self.order {
                    // The next job waits for this one's mark, read when its answer usually comes.
                    gate.opened(job.id.as_str(), message.attempt, slot, now);
                    self.timers.set(LaneTimer::OrderRead, gate.read_at(now).unwrap_or(slot));
                }
                let trip = Some(self.trip_rule(slot));
                self.space_by_share(cost, slot);
                self.note_call_pending(slot);
                self.adaptive.record_call(slot, cost);
                let payload = WorkerPayload::Job {
                    job,
                    attempt: message.attempt,
                    circuit_epoch: self.circuit.epoch,
                    dispatched_at: now,
                    slot: self.call_slot(slot),
                    trip,
                    report_limits: self.ask_for_reading(slot),
                };
                LaneStep::Dispatch(HandOff { message, since, hidden_until, lane: self.index, slot, cost }, payload)
            }
        }
    }

    /// While the circuit is open: the health check's next step at `now`: wait until it is
    /// due or its slot comes, reserve calendar units for it, or send it.
    /// `shared`: the quota the stack's lanes share, whose day and month units are
    /// reserved first (the health check spends one of them).
    pub fn next_health_check(&mut self, now: UnixMillis, shared: Option<SharedCalendar<'_>>) -> LaneStep {
        // An operator's hold: no health check until an operator closes the circuit, which
        // the next re-read sees.
        if self.circuit.held {
            return LaneStep::WaitUntil(now.plus(self.refresh_interval()));
        }
        if let Some(due) = self.timers.get(LaneTimer::HealthCheck) {
            if now < due {
                return LaneStep::WaitUntil(due);
            }
            self.timers.stop(LaneTimer::HealthCheck); // due until one goes: nothing to wake for
        }
        let slot = self.slot_at(now);
        match self.quota.decide(&self.pacer, 1, slot) {
            Decision::Allow => {
                if let Some(step) = self.reserve_first(1, slot, shared) {
                    return step;
                }
                // The slot is spent whatever the answer: a refused invoke may still have run.
                self.commit(1, slot, Duration::ZERO, Duration::ZERO);
                self.last_health_check = Some(now);
                self.note_call_pending(slot);
                self.health_check_in_flight = true;
                LaneStep::HealthCheck(WorkerPayload::HealthCheck {
                    circuit_epoch: self.circuit.epoch,
                    sent_at: now,
                    slot: self.call_slot(slot),
                    lane: self.id.clone(),
                })
            }
            Decision::WaitUntil { at, .. } => LaneStep::WaitUntil(at.minus(self.lead()).max(now.plus(Duration::from_millis(1)))),
            Decision::Never { .. } => unreachable!("a 1-unit health check fits every tier"),
        }
    }

    /// A health check's hand-off came back at `now`: accepted (`true`), the next is
    /// scheduled an interval on.
    pub fn on_health_check_handed_off(&mut self, accepted: bool, now: UnixMillis) {
        self.health_check_in_flight = false;
        if accepted {
            info!(epoch = self.circuit.epoch, "health check sent");
            let cfg = &self.settings.circuit;
            if let Some(due) = self.circuit.next_health_check(self.health_check_from(&self.circuit, now), cfg.health_check_interval, cfg.max_break) {
                self.timers.set(LaneTimer::HealthCheck, due);
            }
        }
    }

    /// Under a cap on calls in flight: until when the modelled calls fill it at `slot`.
    fn call_slots_full_until(&self, slot: UnixMillis) -> Option<UnixMillis> {
        self.call_slots.full_until(self.quota.max_in_flight()?, slot)
    }

    /// Under a cap on calls in flight: a call handed off for `slot` will hold a call slot.
    fn note_call_pending(&mut self, slot: UnixMillis) {
        if self.quota.max_in_flight().is_some() {
            self.call_slots.slots.push_back(slot);
        }
    }

    /// When failures open the circuit, at the pace jobs go at `slot`.
    fn trip_rule(&self, slot: UnixMillis) -> TripRule {
        TripRule::at_pace(&self.settings.circuit.trip_settings(), self.dispatch_pace(slot))
    }

    /// The pace jobs go at `at`: the lane's own (in a ramp, or cut to the provider's
    /// budget), or its share of the stack's shared quota where that is less.
    fn dispatch_pace(&self, at: UnixMillis) -> f64 {
        (self.quota.pace_per_second() * self.pace_share(at)).min(self.shared_pace)
    }

    /// The pace the lane's share of the stack's shared quota allows: the circuit's
    /// failure rate looks at as many recent calls at that pace as alone at its own.
    pub fn set_shared_pace(&mut self, per_second: f64) {
        self.shared_pace = per_second;
    }

    /// At a share of the pace, the next job waits the pace's interval divided by it. The
    /// spacing is kept to the fraction of a millisecond and rounded up to the slot
    /// (truncated, 67/s went at 71/s; rounded up each time, at 66.7/s).
    ///
    /// A provider's budget (a share down to 0, nothing left until its reset) spaces no
    /// further than the reset: the rate is recomputed from there, so a share of 0 pauses
    /// the lane until the reset instead of for good.
    fn space_by_share(&mut self, cost: u64, slot: UnixMillis) {
        let share = self.pace_share(slot);
        let pace = self.quota.pace_per_second();
        if pace.is_finite() && share < 1.0 {
            let on_time = slot <= self.spaced_until;
            let from = if on_time { self.spaced_exact_ms } else { slot.0 as f64 };
            let mut next = from + cost as f64 * 1000.0 / (pace * share);
            if let RateReason::ProviderBudget { resets_at, .. } = self.adaptive.rate(slot).reason {
                next = next.min(resets_at.0.max(slot.0) as f64);
            }
            self.spaced_exact_ms = next;
            self.spaced_until = UnixMillis(next.ceil() as u64);
        }
    }

    /// Whether the call at `slot` should record the provider's rate-limit headers: one
    /// every [`PROVIDER_READING_EVERY`].
    fn ask_for_reading(&mut self, slot: UnixMillis) -> bool {
        let due = self.reading_asked_for.is_none_or(|asked| slot >= asked.plus(PROVIDER_READING_EVERY));
        if due {
            self.reading_asked_for = Some(slot);
        }
        due
    }

    /// With nothing in hand at `now`: how many jobs to receive (at most `max`), so that
    /// no more come in than the pacer can let go before `horizon`; or, when none could
    /// go, until when there is no point in receiving (`None`: nothing to wait for).
    pub fn receive_room(&mut self, now: UnixMillis, horizon: UnixMillis, max: usize) -> Result<usize, Option<UnixMillis>> {
        let (slot, decision) = self.decide(1, now, UnixMillis(0), false);
        let room = self.quota.capacity_until(&self.pacer, slot, horizon, max);
        if room > 0 {
            return Ok(room);
        }
        match decision {
            Decision::WaitUntil { at, by } => {
                self.note_hold(at, by);
                Err(Some(self.hand_off_time(at, now)))
            }
            _ => Err(None),
        }
    }

    /// How many unit-cost jobs the pacer lets go from `now`'s slot until `horizon`
    /// (capped at `max`): a prefetch receives no more than that.
    pub fn capacity_until(&self, now: UnixMillis, horizon: UnixMillis, max: usize) -> usize {
        self.quota.capacity_until(&self.pacer, self.slot_at(now), horizon, max)
    }

    /// How long from `now` until the lane's tiers or holds let its next call go (zero
    /// when one may go now).
    pub fn held_for(&self, now: UnixMillis) -> Duration {
        self.quota.held_for(&self.pacer, self.slot_at(now))
    }

    /// About what [`Self::capacity_until`] says, in O(tiers) (see `Quota::room_estimate`).
    pub fn room_estimate(&self, now: UnixMillis, horizon: UnixMillis, max: usize) -> usize {
        self.quota.room_estimate(&self.pacer, self.slot_at(now), horizon, max)
    }

    /// Takes received messages into hand at `now`, parsed once; with jobs in hand the
    /// circuit is re-read as often as their pace needs. Returns the longest a worker
    /// started late for one of them before.
    pub fn take_in(&mut self, received: Vec<QueuedMessage>, now: UnixMillis) -> Duration {
        let hidden_until = now.plus(self.settings.orchestrator.visibility_timeout);
        let taken = self.buffer.len();
        self.buffer.extend(received.into_iter().map(|message| InHand {
            job: Job::parse(&message.body).map_err(|e| e.to_string()),
            message,
            since: now,
            hidden_until,
        }));
        let late_start_ms = self.buffer.range(taken..).filter_map(|in_hand| in_hand.job.as_ref().ok()).map(|job| job.late_start_ms).max();
        let sooner = on_refresh_grid(self.settings, now.plus(self.refresh_interval()));
        if self.refresh_skipped_while_idle {
            // Its state may have changed while it had nothing to send: read it first.
            self.refresh_skipped_while_idle = false;
            self.read_before_dispatch = true;
            self.timers.set(LaneTimer::Refresh, on_grid(self.settings, now, READ_BEFORE_DISPATCH_GRID));
        } else if self.timers.get(LaneTimer::Refresh).is_some_and(|due| due > sooner) {
            self.timers.set(LaneTimer::Refresh, sooner);
        }
        Duration::from_millis(late_start_ms.unwrap_or(0))
    }

    /// A re-read came due while the lane had nothing to send (in a stack of many lanes):
    /// it is skipped, and made as soon as jobs come in.
    pub fn skip_refresh_while_idle(&mut self) {
        self.refresh_skipped_while_idle = true;
    }

    /// Whether its snapshot is to be saved at `now`: it dispatched since the last was
    /// taken (or a save failed), at most once a [`MANY_LANES_SNAPSHOT_EVERY`].
    pub fn take_unsaved(&mut self, now: UnixMillis) -> bool {
        if !self.unsaved || now < self.saved_at.plus(MANY_LANES_SNAPSHOT_EVERY) {
            return false;
        }
        (self.unsaved, self.saved_at) = (false, now);
        true
    }

    /// A save of its snapshot failed: the next flush saves it again.
    pub fn mark_unsaved(&mut self) {
        (self.unsaved, self.saved_at) = (true, UnixMillis(0));
    }

    /// A refused hand-off's job goes back in hand, first.
    pub fn hand_back(&mut self, hand_off: HandOff, job: Job) {
        if let Some(gate) = &mut self.order {
            gate.handed_back();
        }
        self.buffer.push_front(InHand { message: hand_off.message, job: Ok(job), since: hand_off.since, hidden_until: hand_off.hidden_until });
    }

    /// The jobs in hand whose message the queue keeps hidden no later than `by` stay
    /// hidden for another visibility timeout from `now`: their receipts, for the queue
    /// to extend. A lane keeps what its share lets it dispatch before the timeout, but
    /// its share shrinks as other lanes get jobs; without this, a message it still held
    /// would come back and be received (and handed off) twice.
    pub fn extend_hidden(&mut self, by: UnixMillis, now: UnixMillis) -> Vec<String> {
        let until = now.plus(self.settings.orchestrator.visibility_timeout);
        let expiring = self.buffer.iter_mut().filter(|in_hand| in_hand.hidden_until <= by);
        expiring
            .map(|in_hand| {
                in_hand.hidden_until = until;
                in_hand.message.receipt.clone()
            })
            .collect()
    }

    /// How many jobs from the front of the hand together take no more than `units` of
    /// the lane's pace: what a stack of many lanes lets a lane keep. A job takes its cost
    /// as its tiers pack it (under 3/s, jobs of 2 go one a second: each takes 3), a
    /// message that did not parse one.
    pub fn jobs_within(&self, units: usize) -> usize {
        let packed = |cost: u64| {
            let rolling = self.quota.tiers().iter().filter(|tier| !tier.is_calendar() && cost <= tier.limit);
            rolling.map(|tier| tier.limit as f64 / (tier.limit / cost) as f64).fold(cost as f64, f64::max)
        };
        let mut total = 0.0;
        self.buffer
            .iter()
            .take_while(|held| {
                total += held.job.as_ref().map_or(1.0, |job| packed(job.cost.max(1)));
                total <= units as f64
            })
            .count()
    }

    /// Gives up the messages in hand past the first `keep` (to be made visible again
    /// later), in their order.
    pub fn release_past(&mut self, keep: usize) -> Vec<QueuedMessage> {
        self.buffer.drain(keep.min(self.buffer.len())..).map(|held| held.message).collect()
    }

    /// Gives up every message in hand (to be made visible again): their receipts.
    pub fn release_all(&mut self) -> Vec<String> {
        std::mem::take(&mut self.buffer).into_iter().map(|held| held.message.receipt).collect()
    }

    /// Takes the front message out of hand; the buffer's memory goes with the last one
    /// (a stack of many lanes keeps thousands of idle lanes).
    fn pop_in_hand(&mut self) -> InHand {
        let in_hand = self.buffer.pop_front().expect("the message in hand");
        if self.buffer.is_empty() {
            self.buffer = VecDeque::new();
        }
        in_hand
    }

    /// Calendar units were reserved (or not).
    ///
    /// # Errors
    /// A fatal port error.
    pub fn on_reserved(&mut self, needed: Vec<Reservation>, result: PortResult<()>, now: UnixMillis) -> Result<(), RunError> {
        match result {
            Ok(()) => {
                self.reserve_backoff.succeeded();
                needed.into_iter().for_each(|reservation| self.reserved.add(reservation.key, reservation.units));
                Ok(())
            }
            Err(e) => self.retry_later(e, LaneTimer::Reserve, now, "could not reserve calendar units; nothing is dispatched meanwhile"),
        }
    }

    /// A passing fault arms `timer` for the next try after its back-off; anything else
    /// ends the run.
    fn retry_later(&mut self, e: PortError, timer: LaneTimer, now: UnixMillis, what: &str) -> Result<(), RunError> {
        passing(e, what)?;
        let backoff = match timer {
            LaneTimer::Refresh => &mut self.refresh_backoff,
            LaneTimer::Reserve => &mut self.reserve_backoff,
            LaneTimer::OrderRead => &mut self.order_read_backoff,
            LaneTimer::HealthCheck => unreachable!("{timer:?} is not a retry"),
        };
        self.timers.set(timer, now.plus(backoff.failed()));
        Ok(())
    }

    /// The pacer slot a hand-off made at `now` takes.
    fn slot_at(&self, now: UnixMillis) -> UnixMillis {
        now.plus(self.lead())
    }

    /// How far after `now + lead` a slot may be and still be taken at `now`. Dispatching
    /// ahead: [`COARSE_WAKE_SLACK`], so the loop wakes coarsely, without a precise timer,
    /// and a late wake-up never pushes a slot back, plus [`HAND_OFF_BATCH`], so one
    /// wake-up hands off several slots. Dispatching at the slot: the slack alone (a
    /// share's spacing may put the slot that much after `now`).
    fn taken_early(&self) -> Duration {
        if self.lead().is_zero() {
            COARSE_WAKE_SLACK
        } else {
            COARSE_WAKE_SLACK + HAND_OFF_BATCH
        }
    }

    /// Decides the slot of a job handed off at `now`. Dispatching ahead, a slot up to
    /// [`Self::taken_early`] after `now + lead` is taken at once (handed off that much
    /// earlier). Dispatching at the slot, the slot is `now` (or the share's spacing, up to
    /// the slack later).
    ///
    /// Dispatching ahead, a schedule decided ahead (this run's, or the last run's, which
    /// a new run continues) whose next slot lies between the hand-off's own lead and
    /// `now + lead` keeps that slot: the slots between are taken, not skipped. A schedule
    /// that fell behind (nothing to hand off for a while) starts again at the first slot
    /// allowed (the hand-off's own lead, or `not_before`) with `start_early`, else at
    /// `now + lead`. The stack starts early where a backlog is in sight (a batch
    /// window's worth of jobs in hand, or receives coming back full: a backlog that
    /// comes to an idle stack goes the window sooner, its first batches at once, full),
    /// and jobs coming one at a time go the whole lead out,
    /// gathering in a batch; in a stack of many lanes `not_before` says where.
    fn decide(&self, cost: u64, now: UnixMillis, not_before: UnixMillis, start_early: bool) -> (UnixMillis, Decision) {
        // Never before the spacing of a share of the pace (the loop woke within the slack).
        let slot = self.slot_at(now).max(self.spaced_until).max(not_before);
        let latest = self.slot_at(now).plus(self.taken_early());
        if self.lead().is_zero() {
            return (slot, self.quota.decide(&self.pacer, cost, slot));
        }
        let earliest = now.plus(self.hand_off_lead()).max(self.spaced_until).max(not_before);
        let decision = match self.quota.decide(&self.pacer, cost, earliest) {
            Decision::Allow if start_early => return (earliest, Decision::Allow),
            Decision::Allow => self.quota.decide(&self.pacer, cost, slot),
            continued => continued,
        };
        match decision {
            Decision::WaitUntil { at, .. } if at <= latest => (at, self.quota.decide(&self.pacer, cost, at)),
            decision => (slot, decision),
        }
    }

    /// When to wake, at `now`, to hand off a job whose slot is `at`: never `now` itself, so
    /// a wait always lets time pass.
    pub fn hand_off_time(&self, at: UnixMillis, now: UnixMillis) -> UnixMillis {
        let wake = if self.lead().is_zero() { at } else { at.minus(self.lead()).minus(COARSE_WAKE_SLACK) };
        wake.max(now.plus(Duration::from_millis(1)))
    }

    /// The slot as the worker gets it: none when dispatching at the slot. Half the safety
    /// margin may go to a late start, the other half to network jitter.
    fn call_slot(&self, slot: UnixMillis) -> Option<CallSlot> {
        (!self.lead().is_zero()).then(|| CallSlot { not_before: slot, call_by: slot.plus(self.quota.safety_margin() / 2) })
    }

    /// The pacer holds the job in hand until `at` because of `by`: the report counts the
    /// wait against `by`, and an exhausted calendar tier is logged once per reset.
    fn note_hold(&mut self, at: UnixMillis, by: Hold) {
        self.last_hold = Some(by);
        if let Hold::Tier(i) = by {
            let tier = self.quota.tiers()[i];
            if tier.is_calendar() && at > self.exhausted_logged_until {
                warn!(tier = %tier, resets_at = %at, "quota exhausted: no dispatch until it resets");
                self.exhausted_logged_until = at;
            }
        }
    }

    /// The reservation to make before `cost` units go at `slot`, if any: the lane's own
    /// calendar units first, then the shared quota's.
    fn reserve_first(&self, cost: u64, slot: UnixMillis, shared: Option<SharedCalendar<'_>>) -> Option<LaneStep> {
        let block_for = self.settings.orchestrator.flush_interval;
        let own = self.reserved.needed(&self.quota, &self.pacer, cost, slot, block_for);
        if !own.is_empty() {
            return Some(LaneStep::Reserve(own));
        }
        let shared = shared?;
        let shared = shared.reserved.needed(shared.quota, shared.pacer, cost, slot, block_for);
        (!shared.is_empty()).then_some(LaneStep::ReserveShared(shared))
    }

    /// Spends `cost` units at `now`, counted by rolling tiers as arriving up to `upload`
    /// later (a large body), so that the next call keeps its distance from the arrival.
    fn commit(&mut self, cost: u64, now: UnixMillis, upload: Duration, paced: Duration) {
        let quota = &*self.quota;
        self.pacer.commit(quota, cost, now.plus(upload));
        self.reserved.spend(quota, cost, now);
        self.meter.record(now, cost, paced, self.last_hold.take());
        self.last_dispatch = Some(now);
        self.unsaved = true;
    }

    /// Gives back a slot whose worker made no call: to the pacer (the pace takes it up
    /// again), to the calendar units reserved, and to the report's figures.
    pub fn give_back(&mut self, missed: MissedSlot) {
        let quota = &*self.quota;
        self.pacer.give_back(quota, missed.arrival, missed.cost);
        self.reserved.give_back(quota, missed.cost, missed.slot);
        self.meter.give_back(missed.slot, missed.cost);
        self.figures.slots_given_back += 1;
    }

    /// What is left to settle at the end: the messages still in hand, and the reserved
    /// units not spent (as negative deltas).
    pub fn leftovers(&mut self) -> (Vec<String>, Vec<(String, i64)>) {
        let in_hand = self.release_all();
        let unspent = self.reserved.take_unspent();
        (in_hand, unspent)
    }

    /// The lane's tier figures at `now`: each tier's report, how long the pacer held
    /// jobs, and the tier that held them longest.
    pub fn tier_figures(&self, now: UnixMillis) -> (Vec<TierReport>, Duration, Option<paceline_shared::quota::Tier>) {
        let calendar_used = self.pacer.usage(&self.quota, now);
        (self.meter.report(&self.quota, &calendar_used), self.meter.paced_for(), self.meter.paced_by().map(|i| self.quota.tiers()[i]))
    }
}
