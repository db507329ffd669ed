//! The drain loop's decision step, pure: [`DrainState::next_action`] says what to do at
//! `now` (renew, refresh, flush, reserve, receive, dead-letter, dispatch, health check,
//! sleep, stop) and [`DrainState::on_event`] takes what came of it. No port is called
//! and no time passes here; the executor in `lib.rs` performs the actions.
//!
//! The circuit's states are what the dispatch decision matches on: closed, jobs flow;
//! open, messages in hand are released and a health check goes every interval.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::Duration;

use paceline_shared::adaptive::{AdaptiveRate, EffectiveRate, ProviderReading, RateReason};
use paceline_shared::breaker::{self, Circuit, CircuitStatus, TripRule};
use paceline_shared::job::{CallSlot, DeadLetterCause, DeadLetterReason, Job, WorkerPayload};
use paceline_shared::pacer::{Decision, Hold, MissedSlot, PacerState};
use paceline_shared::ports::{Lease, PacerSnapshot, PortError, PortResult, QueuedMessage};
use paceline_shared::quota::Quota;
use paceline_shared::time::{UnixMillis, COARSE_WAKE_SLACK};
use tracing::{debug, info, warn};

use crate::report::TierMeter;
use crate::timers::{Backoff, Timer, TimerTable};
use crate::{Progress, RunError, RunReport, Settings, StopReason};

/// Longest long poll (SQS allows 20 s).
const MAX_POLL: Duration = Duration::from_secs(20);
/// A draining run's long poll: short, so it notices soon that nothing is left.
const DRAIN_POLL: Duration = Duration::from_millis(500);
/// Messages one receive returns at most (SQS batch size).
pub(crate) const RECEIVE_BATCH: usize = 10;
/// Prefetch receives under way at once at most: with 10 ms per receive, enough for
/// 4,000 jobs/s.
const MAX_RECEIVES_IN_FLIGHT: usize = 4;
/// After a prefetch found nothing, the next waits this long: an idle queue is not
/// polled in a loop.
const PREFETCH_PAUSE: Duration = Duration::from_secs(1);
/// Receipts deleted in one call at most (SQS batch size).
pub(crate) const DELETE_BATCH: usize = 10;
/// Hand-offs awaiting their answer at once at most. Invokes are pipelined so that the
/// invoke's own latency never delays the next slot: pacing is about frequency.
const MAX_INVOKES_IN_FLIGHT: usize = 256;
/// Dispatching ahead, the slots that fall within this much after the next one are
/// handed off on the same wake-up: each worker waits for its own slot, so a hand-off a
/// few milliseconds earlier costs no precision, and at 1,000 jobs/s the loop wakes
/// about once per 6 jobs instead of once per job or two (the wake-up, not the decision,
/// is most of an in-process job's CPU).
const HAND_OFF_BATCH: Duration = Duration::from_millis(5);
/// Retries of a refused hand-off: quick, since slots are waiting.
const INVOKE_BACKOFF: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
/// Retries of a store or queue call that met a passing fault.
const PORT_BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
/// Lease renewals retry at most a second apart: the lease runs out otherwise.
const RENEW_BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
/// Units reserved at a time when no rolling tier sets a pace.
const RESERVATION_WITHOUT_PACE: u64 = 10;

/// The circuit is re-read at most this often (see `DrainState::refresh_interval`).
const FASTEST_REFRESH: Duration = Duration::from_millis(200);

/// The part of the lease's time-to-live this process does not count on (clock drift,
/// a renewal that lands late): the lease is taken as lost a fifth of the TTL early.
pub(crate) fn lease_valid_for(ttl: Duration) -> Duration {
    ttl - ttl / 5
}

/// A message taken off the queue, parsed once, with when it came into hand.
struct InHand {
    message: QueuedMessage,
    job: Result<Job, String>,
    since: UnixMillis,
}

/// A message being handed off (its job travels in the payload), with when it came into
/// hand: what goes back in hand if the hand-off is refused.
pub(crate) struct HandOff {
    pub message: QueuedMessage,
    since: UnixMillis,
}

/// What the executor is to do next. (Moved once per decision; boxing the hand-off would
/// only add an allocation per job.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum Action {
    /// Renew the lease (await it).
    Renew(Lease),
    /// Re-read the circuit and the provider's cool-down (await it).
    Refresh,
    /// Write this circuit if the stored one is still at `expected_epoch` (await it): the
    /// ramp after a half-open reached the full pace and closes it.
    SwapCircuit { expected_epoch: u64, next: Circuit },
    /// Save the pacer snapshot while the lease is ours (await it).
    Flush(Lease, PacerSnapshot),
    /// Add these calendar units to the store before they are spent (await it).
    Reserve(Vec<(String, u64)>),
    /// Move a message to the jobs DLQ with its reason (await it); its job where it parsed
    /// (for the job's outcome record).
    DeadLetter(QueuedMessage, DeadLetterReason, Option<Box<Job>>),
    /// Make these received messages visible again (await it).
    Release(Vec<String>),
    /// Receive up to `max` messages, waiting up to `wait` for the first (background):
    /// a long poll when the loop ran dry, a prefetch (no wait) while jobs are in hand.
    Receive { max: usize, wait: Duration, long_poll: bool },
    /// Delete these handed-off or dead-lettered messages (background).
    Delete(Vec<String>),
    /// Hand a job to a worker (background).
    Dispatch(HandOff, WorkerPayload),
    /// Hand a health check to a worker (background).
    HealthCheck(WorkerPayload),
    /// Nothing left here: ask whether anything is left anywhere (drain mode; await it).
    CheckDrained,
    /// Wait until `until` or the first event that comes back, whichever is first.
    /// `precise`: at the millisecond (dispatching at the slot) or coarsely.
    Sleep { until: UnixMillis, precise: bool },
    /// Stop dispatching and finish the run (the reason is in the report).
    Stop,
}

/// What came of an action.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Event {
    Renewed(PortResult<Lease>),
    Refreshed(PortResult<SharedState>),
    CircuitSwapped(Circuit, PortResult<()>),
    Flushed(PortResult<()>),
    Reserved(Vec<(String, u64)>, PortResult<()>),
    DeadLettered(QueuedMessage, PortResult<()>),
    Released(usize, PortResult<()>),
    /// A receive returned, after `took`; `long_poll` when it was allowed to wait.
    Received {
        result: PortResult<Vec<QueuedMessage>>,
        took: Duration,
        long_poll: bool,
    },
    Deleted(Vec<String>, PortResult<()>),
    HandedOff(HandOff, WorkerPayload, PortResult<()>),
    HealthChecked(PortResult<()>),
    /// `true` when nothing is left on the queue or in flight anywhere.
    DrainChecked(PortResult<bool>),
    /// Workers in this process started too late for these slots and made no call.
    SlotsMissed(Vec<MissedSlot>),
    /// The operator asked the run to stop.
    StopRequested,
}

/// A ramp from a share of the pace up to all of it (see `breaker::ramp_fraction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ramp {
    started: UnixMillis,
}

/// The orchestrator asks one call's worker this often to record the provider's
/// rate-limit headers (a write to the store each time).
const PROVIDER_READING_EVERY: Duration = Duration::from_secs(1);

/// What a refresh reads: the circuit, the provider's cool-down and latest rate-limit
/// reading, and, under a cap on calls in flight, how many call slots are held.
pub(crate) struct SharedState {
    pub circuit: Circuit,
    pub cool_down: UnixMillis,
    pub provider_reading: Option<ProviderReading>,
    pub call_slots: Option<CallSlotsRead>,
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

/// What is under way in the background.
#[derive(Debug, Default)]
struct InFlight {
    hand_offs: usize,
    receives: usize,
    deletes: usize,
    health_check: bool,
}

impl InFlight {
    fn any(&self) -> bool {
        self.hand_offs > 0 || self.receives > 0 || self.deletes > 0 || self.health_check
    }
}

/// Retries of each kind, backing off independently.
struct Backoffs {
    renew: Backoff,
    refresh: Backoff,
    flush: Backoff,
    receive: Backoff,
    reserve: Backoff,
    invoke: Backoff,
}

/// The state of one run, and the decisions it makes.
pub(crate) struct DrainState<'a> {
    settings: &'a Settings,
    progress: &'a Progress,
    drain: bool,
    lease: Lease,
    /// When the renewal under way was sent: the renewed lease counts from then.
    renew_sent_at: UnixMillis,
    pacer: PacerState,
    /// The hold this lane set itself (after an unclean stop); the provider's cool-down is
    /// added to it on every refresh, never saved with the pacer.
    own_hold: UnixMillis,
    circuit: Circuit,
    buffer: VecDeque<InHand>,
    pending_deletes: Vec<String>,
    /// Messages to dead-letter whose reason came back from a hand-off.
    to_dead_letter: VecDeque<(QueuedMessage, DeadLetterReason, Option<Box<Job>>)>,
    /// Calendar units reserved in the store and not yet spent, by usage key.
    reserved: BTreeMap<String, u64>,
    timers: TimerTable,
    backoffs: Backoffs,
    in_flight: InFlight,
    /// How long a receive takes, smoothed: the prefetch keeps that much work in hand.
    receive_latency: Duration,
    /// Draining: the last long poll found the queue empty.
    queue_seen_empty: bool,
    last_health_check: Option<UnixMillis>,
    last_dispatch: Option<UnixMillis>,
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
    exhausted_logged_until: UnixMillis,
    meter: TierMeter,
    stop: Option<StopReason>,
    pub report: RunReport,
}

impl<'a> DrainState<'a> {
    /// The state of a run that took `lease` at `started`, until `deadline`.
    pub fn new(settings: &'a Settings, progress: &'a Progress, lease: Lease, started: UnixMillis, deadline: UnixMillis, drain: bool) -> Self {
        let cfg = &settings.orchestrator;
        let mut timers = TimerTable::default();
        timers.set(Timer::Renew, started.plus(cfg.lease_ttl / 3));
        timers.set(Timer::LeaseExpiry, started.plus(lease_valid_for(cfg.lease_ttl)));
        timers.set(Timer::Refresh, started.plus(cfg.state_refresh));
        timers.set(Timer::Flush, started.plus(cfg.flush_interval));
        timers.set(Timer::Stop, deadline.minus(cfg.deadline_margin));
        Self {
            settings,
            progress,
            drain,
            lease,
            renew_sent_at: started,
            pacer: PacerState::new(&settings.quota),
            own_hold: UnixMillis(0),
            circuit: Circuit::default(),
            buffer: VecDeque::new(),
            pending_deletes: Vec::new(),
            to_dead_letter: VecDeque::new(),
            reserved: BTreeMap::new(),
            timers,
            backoffs: Backoffs {
                renew: RENEW_BACKOFF,
                refresh: PORT_BACKOFF,
                flush: PORT_BACKOFF,
                receive: PORT_BACKOFF,
                reserve: PORT_BACKOFF,
                invoke: INVOKE_BACKOFF,
            },
            in_flight: InFlight::default(),
            receive_latency: Duration::ZERO,
            queue_seen_empty: false,
            last_health_check: None,
            last_dispatch: None,
            last_hold: None,
            ramp: None,
            adaptive: AdaptiveRate::new(&settings.quota, started),
            effective_rate: None,
            cool_down_seen: None,
            reading_seen: false,
            reading_asked_for: None,
            spaced_until: UnixMillis(0),
            spaced_exact_ms: 0.0,
            swapping_circuit: false,
            call_slots: CallSlotModel::default(),
            exhausted_logged_until: UnixMillis(0),
            meter: TierMeter::new(&settings.quota),
            stop: None,
            report: RunReport::starting_at(started),
        }
    }

    fn quota(&self) -> &'a Quota {
        &self.settings.quota
    }

    /// How far ahead of its slot a job is handed off.
    fn lead(&self) -> Duration {
        self.settings.dispatch_ahead()
    }

    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Starts from the last run's snapshot (if any) and the calendar usage in the store.
    pub fn hydrate(&mut self, snapshot: Option<PacerSnapshot>, calendar_used: &[u64], now: UnixMillis) {
        let quota = self.quota();
        if snapshot.is_none() && self.settings.circuit.warm_up {
            info!("the lane's first run: warming up from a share of the pace");
            self.ramp = Some(Ramp { started: now });
        }
        if let Some(snapshot) = snapshot {
            if let Some(last) = &snapshot.effective_rate {
                self.adaptive.resume(last);
            }
            self.pacer = PacerState::restored(quota, &snapshot.state);
            // A hold left by an earlier run is at most one window of the longest tier
            // (older versions saved the provider's cool-down in it: never past that).
            self.pacer.set_hold_until(self.pacer.hold_until().min(now.plus(self.pacer.longest_window(quota))));
            if !snapshot.at_exit {
                warn!("the last run did not stop cleanly: holding dispatch for one window of the longest tier");
                self.pacer.hold_after_unclean_stop(quota, now);
            }
        }
        self.own_hold = self.pacer.hold_until();
        for (index, tier) in quota.tiers().iter().enumerate() {
            if tier.is_calendar() {
                self.pacer.set_calendar_used(quota, index, calendar_used[index], now);
            }
        }
    }

    /// The pacer snapshot to save: this lane's own hold, not the provider's cool-down.
    pub fn snapshot(&self, at_exit: bool) -> PacerSnapshot {
        let mut state = self.pacer.clone();
        state.set_hold_until(self.own_hold);
        PacerSnapshot { state, at_exit, effective_rate: self.effective_rate.clone() }
    }

    /// Applies a fresh read of the circuit, the provider's cool-down and reading, and the
    /// call slots.
    pub fn apply_shared_state(&mut self, shared: SharedState, now: UnixMillis) {
        let SharedState { circuit, cool_down, provider_reading, call_slots } = shared;
        if let Some(read) = call_slots {
            self.call_slots.saw(read, now);
        }
        self.adapt_rate(provider_reading, cool_down, now);
        if circuit.status != self.circuit.status || circuit.epoch != self.circuit.epoch {
            info!(status = %circuit.status, epoch = circuit.epoch, reason = %circuit.reason, "circuit");
            self.progress.circuit_open.store(!circuit.is_closed(), Ordering::Relaxed);
        }
        self.set_circuit(circuit, now);
        // Not `max` with the last value: an operator may have cleared the cool-down.
        self.pacer.set_hold_until(self.own_hold.max(cool_down));
        self.timers.set(Timer::Refresh, now.plus(self.refresh_interval()));
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
        if cleared {
            info!("the provider's readings and cool-down were cleared: the configured pace again");
            self.adaptive.forget_readings();
            self.pacer.forget_jitter(self.quota());
            self.spaced_until = UnixMillis(0);
        }
        self.reading_seen = reading.is_some();
        if let Some(reading) = reading {
            let usage = self.pacer.usage(self.quota(), reading.at);
            self.adaptive.on_reading(&reading, |tier| usage.get(tier).copied().unwrap_or(0));
        }
        if self.cool_down_seen.is_some_and(|seen| cool_down > seen) {
            self.adaptive.on_rate_limited(now);
            if let Some(margin) = self.pacer.learn_jitter(self.quota()) {
                info!(safety_margin_ms = margin.as_millis(), "a 429: the provider saw calls closer than they were sent; widening the windows' margin");
            }
        }
        self.cool_down_seen = Some(cool_down);
        let rate = self.adaptive.rate(now);
        let (share_before, reason_before) = self.effective_rate.as_ref().map_or((1.0, &RateReason::Configured), |r| (r.share(), &r.reason));
        if std::mem::discriminant(reason_before) != std::mem::discriminant(&rate.reason) || (share_before - rate.share()).abs() > 0.1 {
            info!(per_second = rate.per_second, configured = rate.configured_per_second, reason = %rate.reason, "effective rate");
        }
        if rate.share() < 1.0 && self.report.slowest_rate.as_ref().is_none_or(|slowest| rate.per_second < slowest.per_second) {
            self.report.slowest_rate = Some(rate.clone());
        }
        self.effective_rate = Some(rate);
    }

    /// How long until the circuit is re-read: `state_refresh`, or, while jobs are in
    /// hand at a pace that would send more than the breaker's `minimum_calls` in that
    /// time, the time those calls take (at least [`FASTEST_REFRESH`]): a circuit a worker
    /// opened stops dispatch before many more calls go.
    fn refresh_interval(&self) -> Duration {
        let base = self.settings.orchestrator.state_refresh;
        let pace = self.quota().pace_per_second() * self.pace_share(self.last_dispatch.unwrap_or_default());
        if self.buffer.is_empty() || self.circuit.status == CircuitStatus::Open || !pace.is_finite() || pace <= 0.0 {
            return base;
        }
        if self.quota().max_in_flight().is_some() {
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
            Some(due) => self.timers.set(Timer::HealthCheck, due),
            None => self.timers.stop(Timer::HealthCheck),
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

    /// A ramp that reached the full pace ends; a half-open circuit then closes.
    fn end_finished_ramp(&mut self, now: UnixMillis) -> Option<Action> {
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
        Some(Action::SwapCircuit { expected_epoch: self.circuit.epoch, next })
    }

    /// What to do at `now`.
    pub fn next_action(&mut self, now: UnixMillis) -> Action {
        if self.stop.is_some() {
            return Action::Stop;
        }
        for hold in [Timer::InvokeHold, Timer::Reserve, Timer::Receive, Timer::Prefetch] {
            if self.timers.is_expired(hold, now) {
                self.timers.stop(hold); // over: nothing to wake for
            }
        }
        if self.timers.is_expired(Timer::Stop, now) {
            return self.stop_with(StopReason::Deadline);
        }
        if let Some((message, reason, job)) = self.to_dead_letter.pop_front() {
            return Action::DeadLetter(message, reason, job);
        }
        if self.timers.is_expired(Timer::Renew, now) {
            self.timers.stop(Timer::Renew);
            self.renew_sent_at = now;
            return Action::Renew(self.lease.clone());
        }
        if self.timers.is_expired(Timer::Refresh, now) {
            self.timers.stop(Timer::Refresh);
            return Action::Refresh;
        }
        let flush_due = self.timers.is_expired(Timer::Flush, now);
        if self.pending_deletes.len() >= DELETE_BATCH || (flush_due && !self.pending_deletes.is_empty()) {
            return self.delete_batch();
        }
        if flush_due {
            self.timers.stop(Timer::Flush);
            return Action::Flush(self.lease.clone(), self.snapshot(false));
        }
        if self.timers.is_expired(Timer::LeaseExpiry, now) {
            warn!(valid_until = ?self.timers.get(Timer::LeaseExpiry), "the lease ran out before a renewal came through: dispatching stops now");
            return self.stop_with(StopReason::LeaseLost);
        }
        if let Some(close) = self.end_finished_ramp(now) {
            return close;
        }
        match self.circuit.status {
            CircuitStatus::Closed | CircuitStatus::HalfOpen => self.while_closed(now),
            CircuitStatus::Open => self.while_open(now),
        }
    }

    fn stop_with(&mut self, reason: StopReason) -> Action {
        self.stop = Some(reason);
        Action::Stop
    }

    fn delete_batch(&mut self) -> Action {
        self.in_flight.deletes += 1;
        Action::Delete(self.pending_deletes.drain(..self.pending_deletes.len().min(DELETE_BATCH)).collect())
    }

    /// Until when no hand-off may go (after a refused hand-off or a failed reservation),
    /// if such a hold is in force at `now`.
    fn dispatch_held_until(&self, now: UnixMillis) -> Option<UnixMillis> {
        [Timer::InvokeHold, Timer::Reserve].into_iter().filter_map(|t| self.timers.get(t)).filter(|at| *at > now).max()
    }

    /// Sleeps until `t`, or sooner if a timer fires first.
    fn sleep_until(&self, t: UnixMillis) -> Action {
        let until = self.timers.next_timeout().map_or(t, |timeout| timeout.min(t));
        Action::Sleep { until, precise: self.lead().is_zero() }
    }

    /// Sleeps until something comes back or a timer fires.
    fn await_event(&self) -> Action {
        self.sleep_until(UnixMillis(u64::MAX))
    }

    /// Jobs flow: prefetch, dead-letter what cannot go, wait for the slot, dispatch.
    fn while_closed(&mut self, now: UnixMillis) -> Action {
        if self.buffer.is_empty() {
            return self.when_nothing_in_hand(now);
        }
        if let Some(prefetch) = self.prefetch(now) {
            return prefetch;
        }
        let front = self.buffer.front().expect("the message in hand");
        let job = match &front.job {
            Ok(job) => job,
            Err(why) => {
                let why = why.clone();
                let in_hand = self.buffer.pop_front().expect("the message in hand");
                return Action::DeadLetter(in_hand.message, DeadLetterReason { cause: DeadLetterCause::Malformed, detail: why, outcome: None }, None);
            }
        };
        if let Some(until) = self.dispatch_held_until(now) {
            return self.sleep_until(until);
        }
        if self.in_flight.hand_offs >= MAX_INVOKES_IN_FLIGHT {
            return self.await_event();
        }
        if self.spaced_until > self.slot_at(now).plus(self.taken_early()) {
            return self.sleep_until(self.hand_off_time(self.spaced_until, now));
        }
        if let Some(frees) = self.call_slots_full_until(self.slot_at(now)) {
            return self.sleep_until(self.hand_off_time(frees, now));
        }
        let cost = job.cost;
        // A large payload takes a while to hand off (and a worker that started late for
        // this job before shows how long): it is handed off that much earlier, so the
        // hand-off's own work never eats the margin its worker has to start.
        let extra_lead = if self.lead().is_zero() { Duration::ZERO } else { job.extra_lead() };
        let (slot, decision) = self.decide(cost, now.plus(extra_lead));
        match decision {
            Decision::Never { tier } => {
                let in_hand = self.buffer.pop_front().expect("the message in hand");
                let detail = format!("cost {cost} exceeds the whole {tier} tier");
                let job = in_hand.job.ok().map(Box::new);
                Action::DeadLetter(in_hand.message, DeadLetterReason { cause: DeadLetterCause::NeverFits, detail, outcome: None }, job)
            }
            Decision::WaitUntil { at, by } => {
                self.note_hold(at, by);
                self.sleep_until(self.hand_off_time(at.minus(extra_lead), now))
            }
            Decision::Allow => {
                let needed = self.reservations_needed(cost, slot);
                if !needed.is_empty() {
                    return Action::Reserve(needed);
                }
                let InHand { message, job, since } = self.buffer.pop_front().expect("the message in hand");
                let mut job = job.expect("parsed: checked above");
                let enqueued = *job.enqueued_at.get_or_insert(message.enqueued_at);
                self.report.longest_wait_ms = self.report.longest_wait_ms.max(slot.since(enqueued).as_millis() as u64);
                let paced = slot.since(self.last_dispatch.unwrap_or(since).max(since));
                self.commit(cost, slot, job.request.upload_allowance(), paced);
                debug!(job_id = %job.id, attempt = message.attempt, cost, "dispatching");
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
                self.in_flight.hand_offs += 1;
                Action::Dispatch(HandOff { message, since }, payload)
            }
        }
    }

    /// Under a cap on calls in flight: until when the modelled calls fill it at `slot`.
    fn call_slots_full_until(&self, slot: UnixMillis) -> Option<UnixMillis> {
        self.call_slots.full_until(self.quota().max_in_flight()?, slot)
    }

    /// Under a cap on calls in flight: a call handed off for `slot` will hold a call slot.
    fn note_call_pending(&mut self, slot: UnixMillis) {
        if self.quota().max_in_flight().is_some() {
            self.call_slots.slots.push_back(slot);
        }
    }

    /// When failures open the circuit, at the pace jobs go at `slot`.
    fn trip_rule(&self, slot: UnixMillis) -> TripRule {
        TripRule::at_pace(&self.settings.circuit.trip_settings(), self.quota().pace_per_second() * self.pace_share(slot))
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
        let pace = self.quota().pace_per_second();
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

    /// Nothing in hand: wait for a receive under way, find out whether a draining run is
    /// done, or receive (a long poll) no more than the quota can use before the
    /// visibility timeout.
    fn when_nothing_in_hand(&mut self, now: UnixMillis) -> Action {
        if self.in_flight.receives > 0 {
            return self.await_event();
        }
        if self.drain && self.queue_seen_empty {
            if !self.pending_deletes.is_empty() {
                return self.delete_batch();
            }
            // Our own answered hand-offs still count as in flight until deleted.
            if self.in_flight.any() {
                return self.await_event();
            }
            return Action::CheckDrained;
        }
        if self.timers.is_pending(Timer::Receive, now) {
            return self.sleep_until(self.timers.get(Timer::Receive).expect("a pending timer"));
        }
        let (slot, decision) = self.decide(1, now);
        let max = self.quota().capacity_until(&self.pacer, slot, self.receive_horizon(now), RECEIVE_BATCH);
        if max == 0 {
            return match decision {
                Decision::WaitUntil { at, by } => {
                    self.note_hold(at, by);
                    self.sleep_until(self.hand_off_time(at, now))
                }
                _ => self.await_event(),
            };
        }
        let poll = if self.drain { DRAIN_POLL } else { MAX_POLL };
        let until_timer = self.timers.next_timeout().map_or(poll, |t| t.since(now));
        self.in_flight.receives += 1;
        Action::Receive { max, wait: poll.min(until_timer), long_poll: true }
    }

    /// While the circuit is open: hold no messages, send a health check when due.
    fn while_open(&mut self, now: UnixMillis) -> Action {
        if !self.buffer.is_empty() {
            return Action::Release(self.buffer.drain(..).map(|held| held.message.receipt).collect());
        }
        if self.in_flight.health_check {
            return self.await_event();
        }
        if let Some(until) = self.dispatch_held_until(now) {
            return self.sleep_until(until);
        }
        if let Some(due) = self.timers.get(Timer::HealthCheck) {
            if now < due {
                return self.sleep_until(due);
            }
            self.timers.stop(Timer::HealthCheck); // due until one goes: nothing to wake for
        }
        let slot = self.slot_at(now);
        match self.quota().decide(&self.pacer, 1, slot) {
            Decision::Allow => {
                let needed = self.reservations_needed(1, slot);
                if !needed.is_empty() {
                    return Action::Reserve(needed);
                }
                // The slot is spent whatever the answer: a refused invoke may still have run.
                self.commit(1, slot, Duration::ZERO, Duration::ZERO);
                self.last_health_check = Some(now);
                self.note_call_pending(slot);
                self.in_flight.health_check = true;
                Action::HealthCheck(WorkerPayload::HealthCheck { circuit_epoch: self.circuit.epoch, sent_at: now, slot: self.call_slot(slot) })
            }
            Decision::WaitUntil { at, .. } => self.sleep_until(at.minus(self.lead()).max(now.plus(Duration::from_millis(1)))),
            Decision::Never { .. } => unreachable!("a 1-unit health check fits every tier"),
        }
    }

    /// Takes what came of an action at `now`.
    ///
    /// # Errors
    /// A fatal port error: the run ends (and releases what it holds).
    pub fn on_event(&mut self, event: Event, now: UnixMillis) -> Result<(), RunError> {
        match event {
            Event::Renewed(result) => self.on_renewed(result, now),
            Event::Refreshed(Ok(shared)) => {
                self.backoffs.refresh.succeeded();
                self.apply_shared_state(shared, now);
                Ok(())
            }
            Event::Refreshed(Err(e)) => self.retry_later(e, Timer::Refresh, now, "could not re-read the circuit"),
            Event::CircuitSwapped(next, result) => {
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
                        self.timers.set(Timer::Refresh, now);
                        Ok(())
                    }
                    Err(e) => self.retry_later(e, Timer::Refresh, now, "could not close the circuit"),
                }
            }
            Event::Flushed(Ok(()) | Err(PortError::Conflict(_))) => {
                // A lost lease: the next renewal says so; the new holder's snapshot wins.
                self.backoffs.flush.succeeded();
                self.timers.set(Timer::Flush, now.plus(self.settings.orchestrator.flush_interval));
                Ok(())
            }
            Event::Flushed(Err(e)) => self.retry_later(e, Timer::Flush, now, "could not save the pacer snapshot"),
            Event::Reserved(needed, Ok(())) => {
                self.backoffs.reserve.succeeded();
                for (key, units) in needed {
                    *self.reserved.entry(key).or_default() += units;
                }
                Ok(())
            }
            Event::Reserved(_, Err(e)) => self.retry_later(e, Timer::Reserve, now, "could not reserve calendar units; nothing is dispatched meanwhile"),
            Event::DeadLettered(message, result) => self.on_dead_lettered(message, result),
            Event::Released(count, Ok(())) => {
                self.report.released += count as u64;
                Ok(())
            }
            Event::Released(_, Err(e)) => {
                Self::passing(e, "could not release messages; they come back after their visibility timeout")?;
                Ok(())
            }
            Event::Received { result, took, long_poll } => self.on_received(result, took, long_poll, now),
            Event::Deleted(receipts, result) => {
                self.in_flight.deletes -= 1;
                if let Err(e) = result {
                    Self::passing(e, "delete failed; trying again with the next batch")?;
                    self.pending_deletes.extend(receipts);
                }
                Ok(())
            }
            Event::HandedOff(in_hand, payload, result) => self.on_handed_off(in_hand, payload, result, now),
            Event::HealthChecked(result) => {
                self.in_flight.health_check = false;
                match result {
                    Ok(()) => {
                        self.backoffs.invoke.succeeded();
                        self.report.health_checks += 1;
                        Progress::bump(&self.progress.health_checks);
                        info!(epoch = self.circuit.epoch, "health check sent");
                        let cfg = &self.settings.circuit;
                        if let Some(due) = self.circuit.next_health_check(self.health_check_from(&self.circuit, now), cfg.health_check_interval, cfg.max_break)
                        {
                            self.timers.set(Timer::HealthCheck, due);
                        }
                        Ok(())
                    }
                    Err(e) => self.retry_later(e, Timer::InvokeHold, now, "health check refused; trying again"),
                }
            }
            Event::DrainChecked(Ok(true)) => {
                self.stop = Some(StopReason::Drained);
                Ok(())
            }
            Event::DrainChecked(result) => {
                if let Err(e) = result {
                    Self::passing(e, "could not read the queue's depth")?;
                }
                self.queue_seen_empty = false;
                Ok(())
            }
            Event::SlotsMissed(missed) => {
                for slot in missed {
                    self.give_back(slot);
                }
                Ok(())
            }
            Event::StopRequested => {
                self.stop.get_or_insert(StopReason::Stopped);
                Ok(())
            }
        }
    }

    fn on_renewed(&mut self, result: PortResult<Lease>, now: UnixMillis) -> Result<(), RunError> {
        let ttl = self.settings.orchestrator.lease_ttl;
        match result {
            Ok(lease) => {
                self.backoffs.renew.succeeded();
                self.lease = lease;
                self.timers.set(Timer::Renew, self.renew_sent_at.plus(ttl / 3));
                self.timers.set(Timer::LeaseExpiry, self.renew_sent_at.plus(lease_valid_for(ttl)));
                Ok(())
            }
            Err(PortError::Conflict(why)) => {
                warn!(%why, "lease lost: dispatching stops now");
                self.stop = Some(StopReason::LeaseLost);
                Ok(())
            }
            Err(e) => self.retry_later(e, Timer::Renew, now, "could not renew the lease"),
        }
    }

    fn on_dead_lettered(&mut self, message: QueuedMessage, result: PortResult<()>) -> Result<(), RunError> {
        match result {
            Ok(()) => {
                self.pending_deletes.push(message.receipt);
                self.report.dead_lettered += 1;
                Progress::bump(&self.progress.dead_lettered);
            }
            Err(PortError::TooLarge(why)) => {
                // The DLQ cannot take it with its reason: leave it hidden on the queue,
                // whose redrive policy moves it to the DLQ after its last receive.
                warn!(message_id = %message.message_id, %why, "too large to dead-letter with a reason; the queue's redrive policy will move it");
            }
            Err(e) => {
                // Left hidden: it comes back after its visibility timeout and is tried again.
                Self::passing(e, "could not dead-letter a message; it is tried again when it is visible again")?;
            }
        }
        Ok(())
    }

    fn on_received(&mut self, result: PortResult<Vec<QueuedMessage>>, took: Duration, long_poll: bool, now: UnixMillis) -> Result<(), RunError> {
        self.in_flight.receives -= 1;
        if !long_poll {
            // An exponential average (weight 1/8), as TCP smooths round-trip times.
            self.receive_latency = if self.receive_latency.is_zero() { took } else { (self.receive_latency * 7 + took) / 8 };
        }
        match result {
            Ok(received) if received.is_empty() => {
                if long_poll {
                    self.queue_seen_empty = true;
                } else {
                    self.timers.set(Timer::Prefetch, now.plus(PREFETCH_PAUSE));
                }
            }
            Ok(received) => {
                self.backoffs.receive.succeeded();
                self.queue_seen_empty = false;
                self.buffer.extend(received.into_iter().map(|message| InHand {
                    job: Job::parse(&message.body).map_err(|e| e.to_string()),
                    message,
                    since: now,
                }));
                // Jobs in hand: the circuit is re-read as often as their pace needs.
                let sooner = now.plus(self.refresh_interval());
                if self.timers.get(Timer::Refresh).is_some_and(|due| due > sooner) {
                    self.timers.set(Timer::Refresh, sooner);
                }
            }
            Err(e) => self.retry_later(e, Timer::Receive, now, "receive failed")?,
        }
        Ok(())
    }

    /// Acts on a hand-off's answer: delete the message, dead-letter it (over the
    /// invoker's size limit), or put it back in hand and hold dispatch for a back-off.
    /// A refused hand-off's slot stays spent: it may still have run.
    fn on_handed_off(&mut self, hand_off: HandOff, payload: WorkerPayload, result: PortResult<()>, now: UnixMillis) -> Result<(), RunError> {
        self.in_flight.hand_offs -= 1;
        match result {
            Ok(()) => {
                self.backoffs.invoke.succeeded();
                self.pending_deletes.push(hand_off.message.receipt);
                self.report.dispatched += 1;
                Progress::bump(&self.progress.dispatched);
                Ok(())
            }
            Err(PortError::TooLarge(why)) => {
                let detail = format!("the worker payload is over the invoker's limit: {why}");
                let job = match payload {
                    WorkerPayload::Job { job, .. } => Some(Box::new(job)),
                    WorkerPayload::HealthCheck { .. } => None,
                };
                self.to_dead_letter.push_back((hand_off.message, DeadLetterReason { cause: DeadLetterCause::Malformed, detail, outcome: None }, job));
                Ok(())
            }
            Err(e) => {
                let WorkerPayload::Job { job, .. } = payload else { unreachable!("a hand-off carries a job") };
                warn!(error = %e, message_id = %hand_off.message.message_id, "hand-off refused; the job goes again after a back-off");
                self.buffer.push_front(InHand { message: hand_off.message, job: Ok(job), since: hand_off.since });
                self.retry_later(e, Timer::InvokeHold, now, "hand-off refused")
            }
        }
    }

    /// A passing fault arms `timer` for the next try after its back-off; anything else
    /// ends the run.
    fn retry_later(&mut self, e: PortError, timer: Timer, now: UnixMillis, what: &str) -> Result<(), RunError> {
        Self::passing(e, what)?;
        let backoff = match timer {
            Timer::Renew => &mut self.backoffs.renew,
            Timer::Refresh => &mut self.backoffs.refresh,
            Timer::Flush => &mut self.backoffs.flush,
            Timer::Receive => &mut self.backoffs.receive,
            Timer::Reserve => &mut self.backoffs.reserve,
            Timer::InvokeHold => &mut self.backoffs.invoke,
            Timer::LeaseExpiry | Timer::Prefetch | Timer::HealthCheck | Timer::Stop => unreachable!("{timer:?} is not a retry"),
        };
        self.timers.set(timer, now.plus(backoff.failed()));
        Ok(())
    }

    /// Lets a passing fault (throttling, a blip) through with a warning; anything else is
    /// the run's error.
    fn passing(e: PortError, what: &str) -> Result<(), RunError> {
        if e.is_retryable() {
            warn!(error = %e, "{what}; trying again shortly");
            Ok(())
        } else {
            Err(e.into())
        }
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
    fn decide(&self, cost: u64, now: UnixMillis) -> (UnixMillis, Decision) {
        // Never before the spacing of a share of the pace (the loop woke within the slack).
        let slot = self.slot_at(now).max(self.spaced_until);
        match self.quota().decide(&self.pacer, cost, slot) {
            Decision::WaitUntil { at, .. } if !self.lead().is_zero() && at <= self.slot_at(now).plus(self.taken_early()) => {
                (at, self.quota().decide(&self.pacer, cost, at))
            }
            decision => (slot, decision),
        }
    }

    /// When to wake, at `now`, to hand off a job whose slot is `at`: never `now` itself, so
    /// a wait always lets time pass.
    fn hand_off_time(&self, at: UnixMillis, now: UnixMillis) -> UnixMillis {
        let wake = if self.lead().is_zero() { at } else { at.minus(self.lead()).minus(COARSE_WAKE_SLACK) };
        wake.max(now.plus(Duration::from_millis(1)))
    }

    /// The slot as the worker gets it: none when dispatching at the slot. Half the safety
    /// margin may go to a late start, the other half to network jitter.
    fn call_slot(&self, slot: UnixMillis) -> Option<CallSlot> {
        (!self.lead().is_zero()).then(|| CallSlot { not_before: slot, call_by: slot.plus(self.quota().safety_margin() / 2) })
    }

    /// The pacer holds the job in hand until `at` because of `by`: the report counts the
    /// wait against `by`, and an exhausted calendar tier is logged once per reset.
    fn note_hold(&mut self, at: UnixMillis, by: Hold) {
        self.last_hold = Some(by);
        if let Hold::Tier(i) = by {
            let tier = self.quota().tiers()[i];
            if tier.is_calendar() && at > self.exhausted_logged_until {
                warn!(tier = %tier, resets_at = %at, "quota exhausted: no dispatch until it resets");
                self.exhausted_logged_until = at;
            }
        }
    }

    /// A receive in the background while the jobs in hand are paced, so the queue's
    /// latency never leaves a slot unused: enough receives under way for what the pace
    /// uses meanwhile, no more than the quota can use before the visibility timeout, and
    /// a short poll (the loop long-polls when it runs dry).
    fn prefetch(&mut self, now: UnixMillis) -> Option<Action> {
        if self.in_flight.receives >= MAX_RECEIVES_IN_FLIGHT || self.timers.is_pending(Timer::Receive, now) || self.timers.is_pending(Timer::Prefetch, now) {
            return None;
        }
        let coming = self.buffer.len() + RECEIVE_BATCH * self.in_flight.receives;
        if coming >= self.prefetch_target() {
            return None;
        }
        let capacity = self.quota().capacity_until(&self.pacer, self.slot_at(now), self.receive_horizon(now), coming + RECEIVE_BATCH).saturating_sub(coming);
        if capacity == 0 {
            return None;
        }
        self.in_flight.receives += 1;
        Some(Action::Receive { max: capacity, wait: Duration::ZERO, long_poll: false })
    }

    /// Jobs to have in hand or on their way: what the pace uses during two receives, and
    /// at least one batch.
    fn prefetch_target(&self) -> usize {
        let meanwhile = self.quota().pace_per_second() * (self.receive_latency * 2).as_secs_f64();
        let most = RECEIVE_BATCH * MAX_RECEIVES_IN_FLIGHT;
        if meanwhile >= most as f64 {
            most
        } else {
            (meanwhile.ceil() as usize).max(RECEIVE_BATCH)
        }
    }

    /// Jobs received at `now` must be dispatched by this slot (before their visibility
    /// timeout, with a fifth of it to spare), and no later than the run's end.
    fn receive_horizon(&self, now: UnixMillis) -> UnixMillis {
        let visibility = self.settings.orchestrator.visibility_timeout;
        let stop_at = self.timers.get(Timer::Stop).unwrap_or(UnixMillis(u64::MAX));
        now.plus(visibility).minus(visibility / 5).min(stop_at).plus(self.lead())
    }

    /// Calendar units to reserve before `cost` units may be spent at `slot`: for each
    /// calendar tier whose reservation does not cover them, a block of what the pace
    /// uses in a flush interval, no more than the tier has left and no less than needed.
    fn reservations_needed(&self, cost: u64, slot: UnixMillis) -> Vec<(String, u64)> {
        let quota = self.quota();
        let mut needed = Vec::new();
        for (index, tier) in quota.tiers().iter().enumerate().filter(|(_, t)| t.is_calendar()) {
            let key = tier.usage_key(quota.zone(), slot);
            let have = self.reserved.get(&key).copied().unwrap_or(0);
            if have >= cost {
                continue; // the common case, on every dispatch: no work beyond the lookup
            }
            let rate = quota.pace_per_second();
            let block =
                if rate.is_finite() { (rate * self.settings.orchestrator.flush_interval.as_secs_f64()).ceil() as u64 } else { RESERVATION_WITHOUT_PACE };
            let left = tier.limit.saturating_sub(self.pacer.usage(quota, slot)[index]).saturating_sub(have);
            needed.push((key, block.min(left).max(cost - have)));
        }
        needed
    }

    /// Spends `cost` units at `now`, counted by rolling tiers as arriving up to `upload`
    /// later (a large body), so that the next call keeps its distance from the arrival.
    fn commit(&mut self, cost: u64, now: UnixMillis, upload: Duration, paced: Duration) {
        let quota = self.quota();
        self.pacer.commit(quota, cost, now.plus(upload));
        for tier in quota.tiers().iter().filter(|t| t.is_calendar()) {
            if let Some(reserved) = self.reserved.get_mut(&tier.usage_key(quota.zone(), now)) {
                *reserved = reserved.saturating_sub(cost);
            }
        }
        self.meter.record(now, cost, paced, self.last_hold.take());
        self.last_dispatch = Some(now);
    }

    /// Gives back a slot whose worker made no call: to the pacer (the pace takes it up
    /// again), to the calendar units reserved, and to the report's figures.
    fn give_back(&mut self, missed: MissedSlot) {
        let quota = self.quota();
        self.pacer.give_back(quota, missed.arrival, missed.cost);
        for tier in quota.tiers().iter().filter(|t| t.is_calendar()) {
            if let Some(reserved) = self.reserved.get_mut(&tier.usage_key(quota.zone(), missed.slot)) {
                *reserved += missed.cost;
            }
        }
        self.meter.give_back(missed.slot, missed.cost);
        self.report.slots_given_back += 1;
    }

    /// What is left to settle at the end: deletes not yet sent, messages still in hand,
    /// and the reserved units not spent (as negative deltas).
    pub fn leftovers(&mut self) -> (Vec<String>, Vec<String>, Vec<(String, i64)>) {
        let deletes = std::mem::take(&mut self.pending_deletes);
        let in_hand = self.buffer.drain(..).map(|held| held.message.receipt).collect();
        let unspent = std::mem::take(&mut self.reserved)
            .into_iter()
            .filter(|(_, units)| *units > 0)
            .map(|(key, units)| (key, -i64::try_from(units).unwrap_or(i64::MAX)))
            .collect();
        (deletes, in_hand, unspent)
    }

    /// Closes the report at `now`.
    pub fn close_report(&mut self, now: UnixMillis) {
        let calendar_used = self.pacer.usage(self.quota(), now);
        self.report.tiers = self.meter.report(self.quota(), &calendar_used);
        self.report.paced_ms = u64::try_from(self.meter.paced_for().as_millis()).unwrap_or(u64::MAX);
        self.report.paced_by = self.meter.paced_by().map(|i| self.quota().tiers()[i]);
        self.report.ended_at = now;
        if let Some(reason) = &self.stop {
            self.report.stop = reason.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use paceline_shared::config::{CircuitConfig, OrchestratorConfig, WorkerHost};
    use paceline_shared::quota::chrono_tz;

    const T0: UnixMillis = UnixMillis(1_795_824_000_000);

    fn settings() -> Settings {
        let quota = Quota::new(vec!["5/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
        Settings {
            quota,
            orchestrator: OrchestratorConfig { dispatch_ahead: Some(Duration::ZERO), ..OrchestratorConfig::default() },
            circuit: CircuitConfig { health_check_interval: Duration::from_secs(2), ..CircuitConfig::default() },
            workers: WorkerHost::InProcess,
        }
    }

    /// Asks for the next action at `now` and checks that a sleep lets time pass: a sleep
    /// that ends at or before `now` would spin the loop without ever yielding to the
    /// work it waits for (under paused time, forever).
    fn next(state: &mut DrainState<'_>, now: UnixMillis) -> Action {
        let action = state.next_action(now);
        if let Action::Sleep { until, .. } = action {
            assert!(until > now, "a sleep until {until} at {now} does not let time pass");
        }
        action
    }

    /// The next action at `now` past housekeeping (a flush or refresh due), each answered
    /// at once as done.
    fn next_past_housekeeping(state: &mut DrainState<'_>, now: UnixMillis) -> Action {
        loop {
            match next(state, now) {
                Action::Flush(..) => state.on_event(Event::Flushed(Ok(())), now).unwrap(),
                Action::Refresh => {
                    let shared = SharedState { circuit: state.circuit.clone(), cool_down: UnixMillis(0), provider_reading: None, call_slots: None };
                    state.on_event(Event::Refreshed(Ok(shared)), now).unwrap();
                }
                action => return action,
            }
        }
    }

    #[test]
    fn an_open_circuit_sends_one_health_check_at_a_time_and_every_sleep_lets_time_pass() {
        let (settings, progress) = (settings(), Progress::default());
        let lease = Lease { holder: "test".into(), epoch: 1, expires_at: T0.plus(Duration::from_secs(30)) };
        let mut state = DrainState::new(&settings, &progress, lease, T0, T0.plus(Duration::from_secs(60)), false);
        let open = Circuit::default().open(0, "HTTP 503", T0).unwrap();
        state.apply_shared_state(SharedState { circuit: open, cool_down: UnixMillis(0), provider_reading: None, call_slots: None }, T0);
        assert!(matches!(next(&mut state, T0), Action::Sleep { until, .. } if until == T0.plus(Duration::from_secs(1))), "the refresh comes first");
        let due = T0.plus(Duration::from_secs(2));
        assert!(matches!(next_past_housekeeping(&mut state, due), Action::HealthCheck(_)));
        assert!(matches!(next_past_housekeeping(&mut state, due), Action::Sleep { .. }), "one check at a time");
        let answered = due.plus(Duration::from_millis(20));
        state.on_event(Event::HealthChecked(Ok(())), answered).unwrap();
        assert!(
            matches!(next_past_housekeeping(&mut state, answered), Action::Sleep { until, .. } if until == T0.plus(Duration::from_secs(3))),
            "the next check is an interval later; the next refresh comes first"
        );
    }
}
