//! The orchestrator's drain loop: take the lease, hydrate quota and circuit state,
//! receive jobs in batches, dead-letter what is malformed, wait for the pacer's slot,
//! hand each job to a worker, and write usage back, until the deadline or, in drain
//! mode, until nothing is left. The same loop runs in Lambda and in `paceline run`.
//!
//! All waiting happens here, on the [`Clock`] port, so tests drive it under paused tokio
//! time and assert exact dispatch instants.
//!
//! Calendar tiers (day, month) are crash-safe by construction: units are reserved in
//! the store with an atomic add *before* they are spent, a block at a time, and the
//! unspent part is given back at a clean stop. A crash then leaves the counter over
//! what was spent, never under it: the tier is under-used, never over-used.
//!
//! The lease is valid, as this process sees it, until `lease_ttl` less a fifth after
//! the renewal that set it was sent (the fifth covers clock drift between processes and
//! a write that lands late). While renewals fail, dispatch goes on only until then.
//!
//! With `dispatch_ahead` set, the pacer is asked about the instant `now + dispatch_ahead`
//! (the slot) instead of `now`; the job goes out with that slot in its payload and the
//! worker calls at the slot, so the worker's start-up delay no longer moves the call.

#[cfg(feature = "lambda")]
pub mod lambda;
mod report;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use paceline_shared::breaker::Circuit;
use paceline_shared::config::{CircuitConfig, OrchestratorConfig};
use paceline_shared::job::{CallSlot, DeadLetterCause, DeadLetterReason, Job, WorkerPayload};
use paceline_shared::pacer::{Decision, Hold, PacerState};
use paceline_shared::ports::{load_calendar_usage, Invoker, JobQueue, Lease, PacerSnapshot, PortError, QueuedMessage, StateStore};
use paceline_shared::quota::Quota;
use paceline_shared::time::{Clock, UnixMillis, COARSE_WAKE_SLACK};
use tracing::{debug, info, warn};

use report::TierMeter;
pub use report::{Progress, RunReport, StopReason, TierReport};

/// Longest long poll (SQS allows 20 s).
const MAX_POLL: Duration = Duration::from_secs(20);
/// First and longest pause after a throttled or failed invoke.
const INVOKE_BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(5));
/// Messages one receive returns at most (SQS batch size).
const RECEIVE_BATCH: usize = 10;
/// Prefetch receives under way at once at most: with 10 ms per receive, enough for
/// 4,000 jobs/s.
const MAX_RECEIVES_IN_FLIGHT: usize = 4;
/// After a prefetch found nothing (or failed), the next waits this long: an idle queue
/// is not polled in a loop.
const PREFETCH_PAUSE: Duration = Duration::from_secs(1);
/// Receipts deleted in one call at most (SQS batch size).
const DELETE_BATCH: usize = 10;
/// Hand-offs awaiting their answer at once at most. Invokes are pipelined so that the
/// invoke's own latency never delays the next slot: pacing is about frequency.
const MAX_INVOKES_IN_FLIGHT: usize = 256;

/// How long before the next scheduled kick a run stops dispatching (time to settle its
/// last hand-offs, flush and give the lease up).
pub const HANDOVER: Duration = Duration::from_millis(250);

/// The upload rate a call's body is assumed to leave at: a call is paced on its arrival
/// at the provider, not on its send, so the pacer counts a large body's call that much
/// after its slot (1 MiB: 105 ms; measured on loopback: 5 to 83 ms late) and the next
/// call keeps its distance from the arrival.
const UPLOAD_BYTES_PER_SECOND: u64 = 10_000_000;

/// How much later than its slot a job's call may arrive because of its body's size.
fn upload_allowance(job: &Job) -> Duration {
    let bytes = job.request.body.as_ref().map_or(0, |body| body.len() as u64);
    Duration::from_millis(bytes * 1_000 / UPLOAD_BYTES_PER_SECOND)
}

/// Units reserved at a time when no rolling tier sets a pace.
const RESERVATION_WITHOUT_PACE: u64 = 10;

/// The part of the lease's time-to-live this process does not count on (clock drift,
/// a renewal that lands late): the lease is taken as lost a fifth of the TTL early.
fn lease_valid_for(ttl: Duration) -> Duration {
    ttl - ttl / 5
}

/// The deadline to give a run kicked by a schedule for `tick` (every `every`), so that
/// it stops dispatching `HANDOVER` before the last kick due before `deadline` (less the
/// margin). That kick then finds the function free (reserved concurrency 1) instead of
/// being throttled and retried seconds later: back-to-back runs, no idle gap. `deadline`
/// itself when no kick falls inside the run.
#[must_use]
pub fn handover_deadline(deadline: UnixMillis, tick: UnixMillis, every: Duration, margin: Duration) -> UnixMillis {
    let every_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1);
    let kicks = deadline.minus(margin).0.saturating_sub(tick.0) / every_ms;
    if kicks == 0 {
        return deadline;
    }
    let last_kick = UnixMillis(tick.0 + kicks * every_ms);
    last_kick.minus(HANDOVER).plus(margin).min(deadline)
}

/// Why a run could not go on.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("another orchestrator holds the lease: {0}")]
    LeaseHeld(String),
    #[error(transparent)]
    Port(#[from] PortError),
}

/// The settings the loop needs.
#[derive(Clone, Debug)]
pub struct Settings {
    pub quota: Quota,
    pub orchestrator: OrchestratorConfig,
    pub circuit: CircuitConfig,
}

/// One run's options.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Who takes the lease (shown to operators).
    pub holder: String,
    /// Hard end of the run (Lambda's deadline); dispatching stops a margin before.
    pub deadline: UnixMillis,
    /// End as soon as the queue is empty and nothing is in flight.
    pub drain: bool,
    /// Ends the run early (Ctrl-C) when it turns `true`.
    pub stop: Option<tokio::sync::watch::Receiver<bool>>,
}

/// The drain loop's dependencies, built once (in Lambda, at cold start).
pub struct Orchestrator {
    pub queue: Arc<dyn JobQueue>,
    pub store: Arc<dyn StateStore>,
    pub invoker: Arc<dyn Invoker>,
    pub clock: Arc<dyn Clock>,
    pub settings: Settings,
    pub progress: Arc<Progress>,
}

/// A message taken off the queue, with when it came into hand.
#[derive(Clone)]
struct InHand {
    message: QueuedMessage,
    since: UnixMillis,
}

/// Work the loop does not wait for, as it comes back.
enum Done {
    /// A hand-off was answered.
    Handed { in_hand: InHand, result: Result<(), PortError> },
    /// A prefetch receive returned, after `took`.
    Received { result: Result<Vec<QueuedMessage>, PortError>, took: Duration },
    /// A delete batch went (or failed, giving its receipts back).
    Deleted(Result<(), (PortError, Vec<String>)>),
}

/// The mutable state of one run.
struct Run<'a> {
    o: &'a Orchestrator,
    opts: &'a RunOptions,
    lease: Lease,
    pacer: PacerState,
    circuit: Circuit,
    buffer: VecDeque<InHand>,
    pending_deletes: Vec<String>,
    /// Calendar units reserved in the store and not yet spent, by usage key.
    reserved: BTreeMap<String, u64>,
    /// Messages to dead-letter whose reason came back from a hand-off (a payload over the
    /// invoker's size limit).
    to_dead_letter: VecDeque<(QueuedMessage, String)>,
    /// The hold this lane set itself (after an unclean stop); the provider's cool-down is
    /// added to it on every refresh, never saved with the pacer.
    own_hold: UnixMillis,
    /// Until when the lease is ours as this process sees it: no hand-off after this.
    lease_valid_until: UnixMillis,
    last_health_check: Option<UnixMillis>,
    last_dispatch: Option<UnixMillis>,
    next_renew: UnixMillis,
    next_refresh: UnixMillis,
    next_flush: UnixMillis,
    stop_at: UnixMillis,
    meter: TierMeter,
    exhausted_logged_until: UnixMillis,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    /// Hand-offs, prefetch receives and deletes under way, so that none of their
    /// latencies delays the next slot: pacing is about frequency.
    background: tokio::task::JoinSet<Done>,
    invokes_in_flight: usize,
    receives_in_flight: usize,
    /// How long a receive takes, smoothed: the prefetch keeps that much work in hand.
    receive_latency: Duration,
    /// No prefetch before this (after one found the queue empty or failed).
    next_prefetch: UnixMillis,
    deletes_in_flight: usize,
    /// After a refused hand-off: no dispatch before this, and how many in a row failed.
    invoke_hold_until: UnixMillis,
    invoke_failures: u32,
    /// A fatal error a hand-off answered with: the run ends.
    fatal: Option<PortError>,
    report: RunReport,
}

impl Orchestrator {
    /// Runs the drain loop once.
    ///
    /// # Errors
    /// [`RunError::LeaseHeld`] when another orchestrator runs this lane;
    /// [`RunError::Port`] on a fatal adapter error (after releasing what it held).
    #[tracing::instrument(skip_all, fields(holder = %opts.holder))]
    pub async fn run(&self, opts: &RunOptions) -> Result<RunReport, RunError> {
        let started = self.clock.now();
        let cfg = &self.settings.orchestrator;
        let lease = match self.store.acquire_lease(&opts.holder, cfg.lease_ttl, started).await {
            Ok(lease) => lease,
            Err(PortError::Conflict(why)) => return Err(RunError::LeaseHeld(why)),
            Err(e) => return Err(e.into()),
        };
        info!(epoch = lease.epoch, "lease taken");
        let mut run = Run {
            o: self,
            opts,
            pacer: PacerState::new(&self.settings.quota),
            circuit: Circuit::default(),
            buffer: VecDeque::new(),
            pending_deletes: Vec::new(),
            reserved: BTreeMap::new(),
            to_dead_letter: VecDeque::new(),
            own_hold: UnixMillis(0),
            lease_valid_until: started.plus(lease_valid_for(cfg.lease_ttl)),
            last_health_check: None,
            last_dispatch: None,
            next_renew: started.plus(cfg.lease_ttl / 3),
            next_refresh: started.plus(cfg.state_refresh),
            next_flush: started.plus(cfg.flush_interval),
            stop_at: opts.deadline.minus(cfg.deadline_margin),
            meter: TierMeter::new(&self.settings.quota),
            exhausted_logged_until: UnixMillis(0),
            stop: opts.stop.clone(),
            background: tokio::task::JoinSet::new(),
            invokes_in_flight: 0,
            receives_in_flight: 0,
            receive_latency: Duration::ZERO,
            next_prefetch: UnixMillis(0),
            deletes_in_flight: 0,
            invoke_hold_until: UnixMillis(0),
            invoke_failures: 0,
            fatal: None,
            report: RunReport {
                started_at: started,
                ended_at: started,
                stop: StopReason::Deadline,
                dispatched: 0,
                health_checks: 0,
                dead_lettered: 0,
                released: 0,
                paced_ms: 0,
                tiers: Vec::new(),
            },
            lease,
        };
        let outcome = match run.hydrate().await {
            Ok(()) => run.drain().await,
            Err(e) => Err(e),
        };
        let finished = run.finish(outcome.as_ref().err()).await;
        outcome.and(finished).map(|()| run.report)
    }
}

impl Run<'_> {
    fn quota(&self) -> &Quota {
        &self.o.settings.quota
    }

    /// How far ahead of its slot a job is handed off.
    fn lead(&self) -> Duration {
        self.o.settings.orchestrator.dispatch_ahead
    }

    /// The pacer slot a hand-off made at `now` takes.
    fn slot_at(&self, now: UnixMillis) -> UnixMillis {
        now.plus(self.lead())
    }

    /// Decides the slot of a job handed off at `now`. Dispatching ahead, a slot up to
    /// [`COARSE_WAKE_SLACK`] after `now + lead` is taken at once (handed off that much
    /// earlier), so the loop wakes coarsely, without a precise timer, and a late wake-up
    /// still never pushes a slot back. Dispatching at the slot, the slot is `now`.
    fn decide(&self, cost: u64, now: UnixMillis) -> (UnixMillis, Decision) {
        let slot = self.slot_at(now);
        match self.quota().decide(&self.pacer, cost, slot) {
            Decision::WaitUntil { at, .. } if !self.lead().is_zero() && at <= slot.plus(COARSE_WAKE_SLACK) => (at, self.quota().decide(&self.pacer, cost, at)),
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
        (!self.lead().is_zero()).then(|| CallSlot { not_before: slot, call_by: slot.plus(self.quota().safety_margin / 2) })
    }

    async fn hydrate(&mut self) -> Result<(), RunError> {
        let now = self.o.clock.now();
        if let Some(snapshot) = self.o.store.load_pacer().await? {
            self.pacer = PacerState::restored(self.quota(), &snapshot.state);
            // A hold left by an earlier run is at most one window of the longest tier
            // (older versions saved the provider's cool-down in it: never past that).
            self.pacer.hold_until = self.pacer.hold_until.min(now.plus(self.quota().longest_window()));
            if !snapshot.at_exit {
                warn!("the last run did not stop cleanly: holding dispatch for one window of the longest tier");
                self.pacer.hold_after_unclean_stop(&self.o.settings.quota, now);
            }
        }
        self.own_hold = self.pacer.hold_until;
        let used = load_calendar_usage(self.o.store.as_ref(), self.quota(), now).await?;
        let quota = &self.o.settings.quota;
        for (index, tier) in quota.tiers.iter().enumerate() {
            if tier.is_calendar() {
                self.pacer.set_calendar_used(quota, index, used[index], now);
            }
        }
        // From here until a clean exit, the stored snapshot says "a run is under way",
        // so a crash at any point is recognised by the next run.
        self.flush(false).await?;
        self.refresh_shared_state().await
    }

    async fn refresh_shared_state(&mut self) -> Result<(), RunError> {
        let circuit = self.o.store.circuit().await?;
        if circuit.status != self.circuit.status || circuit.epoch != self.circuit.epoch {
            info!(status = %circuit.status, epoch = circuit.epoch, reason = %circuit.reason, "circuit");
            self.o.progress.circuit_open.store(!circuit.is_closed(), std::sync::atomic::Ordering::Relaxed);
        }
        self.circuit = circuit;
        let cool_down = self.o.store.cool_down().await?;
        // Not `max` with the last value: an operator may have cleared the cool-down.
        self.pacer.hold_until = self.own_hold.max(cool_down);
        self.next_refresh = self.o.clock.now().plus(self.o.settings.orchestrator.state_refresh);
        Ok(())
    }

    /// The next moment housekeeping is due: the loop never sleeps past it.
    fn next_wake(&self) -> UnixMillis {
        self.next_renew.min(self.next_refresh).min(self.next_flush).min(self.stop_at).min(self.lease_valid_until)
    }

    /// Sleeps until `t` or the next housekeeping, whichever is first; wakes early for a
    /// stop request or finished background work (which it settles).
    async fn sleep_until(&mut self, t: UnixMillis) {
        let (wake, precise) = (t.min(self.next_wake()), self.lead().is_zero());
        // Biased: the same events always resolve the same way, so simulations repeat.
        let done = tokio::select! {
            biased;
            () = stop_requested(&mut self.stop) => None,
            Some(done) = self.background.join_next(), if !self.background.is_empty() => Some(done),
            () = sleep_for_slot(self.o.clock.as_ref(), wake, precise) => None,
        };
        if let Some(done) = done {
            self.settle(done);
        }
    }

    /// Acts on finished background work.
    fn settle(&mut self, done: Result<Done, tokio::task::JoinError>) {
        match done {
            Ok(Done::Handed { in_hand, result }) => {
                self.invokes_in_flight -= 1;
                self.settle_hand_off(in_hand, result);
            }
            Ok(Done::Received { result, took }) => {
                self.receives_in_flight -= 1;
                // An exponential average (weight 1/8), as TCP smooths round-trip times.
                self.receive_latency = if self.receive_latency.is_zero() { took } else { (self.receive_latency * 7 + took) / 8 };
                if !result.as_ref().is_ok_and(|received| !received.is_empty()) {
                    self.next_prefetch = self.o.clock.now().plus(PREFETCH_PAUSE);
                }
                match result {
                    Ok(received) => {
                        let since = self.o.clock.now();
                        self.buffer.extend(received.into_iter().map(|message| InHand { message, since }));
                    }
                    Err(e) if e.is_retryable() => warn!(error = %e, "prefetch receive failed; receiving again when needed"),
                    Err(e) => self.fatal = Some(e),
                }
            }
            Ok(Done::Deleted(result)) => {
                self.deletes_in_flight -= 1;
                match result {
                    Ok(()) => {}
                    Err((e, receipts)) if e.is_retryable() => {
                        warn!(error = %e, "delete failed; trying again with the next batch");
                        self.pending_deletes.extend(receipts);
                    }
                    Err((e, _)) => self.fatal = Some(e),
                }
            }
            Err(e) => self.fatal = Some(PortError::Fatal(format!("a background task failed: {e}"))),
        }
    }

    /// Acts on a hand-off's answer: delete the message, or put it back in hand and hold
    /// dispatch for a backoff, or end the run on a fatal error.
    fn settle_hand_off(&mut self, in_hand: InHand, result: Result<(), PortError>) {
        match result {
            Err(PortError::TooLarge(why)) => {
                // The slot stays spent; the job cannot be handed off as it is.
                self.to_dead_letter.push_back((in_hand.message, why));
            }
            Ok(()) => {
                self.invoke_failures = 0;
                self.pending_deletes.push(in_hand.message.receipt);
                self.report.dispatched += 1;
                Progress::bump(&self.o.progress.dispatched);
            }
            Err(e) => {
                // The slot stays spent: a refused or timed-out invoke may still have run.
                if e.is_retryable() {
                    self.invoke_failures += 1;
                    let backoff = INVOKE_BACKOFF.0.saturating_mul(1 << self.invoke_failures.min(16).saturating_sub(1)).min(INVOKE_BACKOFF.1);
                    self.invoke_hold_until = self.o.clock.now().plus(backoff);
                    warn!(error = %e, backoff_ms = backoff.as_millis(), message_id = %in_hand.message.message_id, "hand-off refused; the job goes again after a backoff");
                } else {
                    self.fatal = Some(e);
                }
                self.buffer.push_front(in_hand);
            }
        }
    }

    /// Settles all background work already finished, without waiting.
    fn settle_answered(&mut self) {
        while let Some(done) = self.background.try_join_next() {
            self.settle(done);
        }
    }

    /// Sends a batch of deletes without waiting for it.
    fn delete_in_background(&mut self) {
        let receipts: Vec<String> = self.pending_deletes.drain(..self.pending_deletes.len().min(DELETE_BATCH)).collect();
        let queue = self.o.queue.clone();
        self.deletes_in_flight += 1;
        self.background.spawn(async move { Done::Deleted(queue.delete(&receipts).await.map_err(|e| (e, receipts))) });
    }

    /// Receives the next batches in the background while the ones in hand are paced, so
    /// the queue's latency never leaves a slot unused: enough receives under way for what
    /// the pace uses meanwhile. No more than the quota can use before the visibility
    /// timeout; a short poll (the loop long-polls when it runs dry).
    fn prefetch(&mut self, now: UnixMillis) {
        if self.receives_in_flight >= MAX_RECEIVES_IN_FLIGHT || now < self.next_prefetch {
            return;
        }
        let coming = self.buffer.len() + RECEIVE_BATCH * self.receives_in_flight;
        if coming >= self.prefetch_target() {
            return;
        }
        let capacity = self.quota().capacity_until(&self.pacer, self.slot_at(now), self.receive_horizon(now), coming + RECEIVE_BATCH).saturating_sub(coming);
        if capacity == 0 {
            return;
        }
        let (queue, clock, visibility) = (self.o.queue.clone(), self.o.clock.clone(), self.o.settings.orchestrator.visibility_timeout);
        self.receives_in_flight += 1;
        self.background.spawn(async move {
            let started = clock.now();
            let result = queue.receive(capacity, Duration::ZERO, visibility).await;
            Done::Received { result, took: clock.now().since(started) }
        });
    }

    /// Jobs to have in hand or on their way: what the pace uses during two receives, and
    /// at least one batch.
    fn prefetch_target(&self) -> usize {
        let meanwhile = self.quota().rolling_rate_per_second() * (self.receive_latency * 2).as_secs_f64();
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
        let visibility = self.o.settings.orchestrator.visibility_timeout;
        now.plus(visibility).minus(visibility / 5).min(self.stop_at).plus(self.lead())
    }

    fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(|stop| *stop.borrow())
    }

    async fn drain(&mut self) -> Result<(), RunError> {
        loop {
            let now = self.o.clock.now();
            if now >= self.stop_at {
                self.report.stop = StopReason::Deadline;
                return Ok(());
            }
            if self.stop_requested() {
                self.report.stop = StopReason::Stopped;
                return Ok(());
            }
            self.settle_answered();
            if let Some(e) = self.fatal.take() {
                return Err(e.into());
            }
            while let Some((message, why)) = self.to_dead_letter.pop_front() {
                self.dead_letter(&message, DeadLetterCause::Malformed, format!("the worker payload is over the invoker's limit: {why}")).await?;
            }
            if now >= self.next_renew {
                let ttl = self.o.settings.orchestrator.lease_ttl;
                match self.o.store.renew_lease(&self.lease, ttl, now).await {
                    Ok(lease) => {
                        self.lease = lease;
                        self.next_renew = now.plus(ttl / 3);
                        self.lease_valid_until = now.plus(lease_valid_for(ttl));
                    }
                    Err(PortError::Conflict(why)) => {
                        warn!(%why, "lease lost: dispatching stops now");
                        self.report.stop = StopReason::LeaseLost;
                        return Ok(());
                    }
                    Err(e) if e.is_retryable() => self.next_renew = now.plus(Duration::from_secs(1)),
                    Err(e) => return Err(e.into()),
                }
            }
            if now >= self.next_refresh {
                if let Err(e) = self.refresh_shared_state().await {
                    passing(e)?;
                    self.next_refresh = now.plus(Duration::from_secs(1));
                }
            }
            if now >= self.next_flush {
                if let Err(e) = self.flush(false).await {
                    passing(e)?;
                    self.next_flush = now.plus(Duration::from_secs(1));
                }
            }
            // Housekeeping may have waited on the store: decide on the time it is now, so a
            // slot is never committed earlier than its hand-off happens.
            let now = self.o.clock.now();
            if now >= self.lease_valid_until {
                warn!(valid_until = %self.lease_valid_until, "lease renewals failed until the lease ran out: dispatching stops now");
                self.report.stop = StopReason::LeaseLost;
                return Ok(());
            }
            if !self.circuit.is_closed() {
                self.while_open(now).await?;
                continue;
            }
            if !self.buffer.is_empty() {
                self.prefetch(now);
            } else if self.receives_in_flight > 0 {
                let stop_at = self.stop_at;
                self.sleep_until(stop_at).await;
                continue;
            }
            let Some(in_hand) = self.buffer.front() else {
                if self.fill_buffer(now).await? {
                    self.report.stop = StopReason::Drained;
                    return Ok(());
                }
                continue;
            };
            let (message, since) = (in_hand.message.clone(), in_hand.since);
            if now < self.invoke_hold_until {
                let until = self.invoke_hold_until;
                self.sleep_until(until).await;
                continue;
            }
            if self.invokes_in_flight >= MAX_INVOKES_IN_FLIGHT {
                let stop_at = self.stop_at;
                self.sleep_until(stop_at).await;
                continue;
            }
            let job = match Job::parse(&message.body) {
                Ok(job) => job,
                Err(e) => {
                    self.dead_letter(&message, DeadLetterCause::Malformed, e.to_string()).await?;
                    continue;
                }
            };
            let (slot, decision) = self.decide(job.cost, now);
            match decision {
                Decision::Never { tier } => {
                    let detail = format!("cost {} exceeds the whole {tier} tier", job.cost);
                    self.dead_letter(&message, DeadLetterCause::NeverFits, detail).await?;
                }
                Decision::WaitUntil { at, by } => {
                    self.log_exhausted(at, by);
                    self.sleep_until(self.hand_off_time(at, now)).await;
                }
                Decision::Allow => {
                    let needed = self.reservations_needed(job.cost, slot);
                    if !needed.is_empty() {
                        // The store write took time: decide again on the time it is now.
                        self.reserve(needed).await?;
                        continue;
                    }
                    let paced = slot.since(self.last_dispatch.unwrap_or(since).max(since));
                    self.commit(job.cost, slot, upload_allowance(&job), paced);
                    debug!(job_id = %job.id, attempt = message.attempt, cost = job.cost, "dispatching");
                    let (attempt, circuit_epoch, slot) = (message.attempt, self.circuit.epoch, self.call_slot(slot));
                    let payload = WorkerPayload::Job { job, attempt, circuit_epoch, dispatched_at: now, slot };
                    let in_hand = self.buffer.pop_front().expect("the message in hand");
                    let invoker = self.o.invoker.clone();
                    self.invokes_in_flight += 1;
                    self.background.spawn(async move {
                        let result = invoker.invoke(&payload, Some(&in_hand.message.receipt)).await;
                        Done::Handed { result, in_hand }
                    });
                    if self.pending_deletes.len() >= DELETE_BATCH {
                        self.delete_in_background();
                    }
                }
            }
        }
    }

    fn log_exhausted(&mut self, at: UnixMillis, by: Hold) {
        if let Hold::Tier(i) = by {
            let tier = self.o.settings.quota.tiers[i];
            if tier.is_calendar() && at > self.exhausted_logged_until {
                warn!(tier = %tier, resets_at = %at, "quota exhausted: no dispatch until it resets");
                self.exhausted_logged_until = at;
            }
        }
    }

    /// Calendar units to reserve before `cost` units may be spent at `slot`: for each
    /// calendar tier whose reservation does not cover them, a block of what the pace
    /// uses in a flush interval, no more than the tier has left and no less than needed.
    fn reservations_needed(&self, cost: u64, slot: UnixMillis) -> Vec<(String, u64)> {
        let quota = &self.o.settings.quota;
        let mut needed = Vec::new();
        for (index, tier) in quota.tiers.iter().enumerate().filter(|(_, t)| t.is_calendar()) {
            let key = tier.usage_key(quota.zone, slot);
            let have = self.reserved.get(&key).copied().unwrap_or(0);
            if have >= cost {
                continue; // the common case, on every dispatch: no work beyond the lookup
            }
            let rate = quota.rolling_rate_per_second();
            let block =
                if rate.is_finite() { (rate * self.o.settings.orchestrator.flush_interval.as_secs_f64()).ceil() as u64 } else { RESERVATION_WITHOUT_PACE };
            let left = tier.limit.saturating_sub(self.pacer.usage(quota, slot)[index]).saturating_sub(have);
            needed.push((key, block.min(left).max(cost - have)));
        }
        needed
    }

    /// Reserves calendar units in the store (an atomic add) before they are spent. A
    /// passing fault waits a second: nothing is dispatched meanwhile.
    async fn reserve(&mut self, needed: Vec<(String, u64)>) -> Result<(), RunError> {
        let deltas: Vec<(String, i64)> = needed.iter().map(|(key, units)| (key.clone(), i64::try_from(*units).unwrap_or(i64::MAX))).collect();
        match self.o.store.add_usage(&deltas).await {
            Ok(()) => {
                for (key, units) in needed {
                    *self.reserved.entry(key).or_default() += units;
                }
                Ok(())
            }
            Err(e) if e.is_retryable() => {
                warn!(error = %e, "could not reserve calendar units; trying again shortly");
                let resume = self.o.clock.now().plus(Duration::from_secs(1));
                self.sleep_until(resume).await;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Gives back the reserved units this run did not spend.
    async fn return_unspent(&mut self) -> Result<(), RunError> {
        let unspent: Vec<(String, i64)> = std::mem::take(&mut self.reserved)
            .into_iter()
            .filter(|(_, units)| *units > 0)
            .map(|(key, units)| (key, -i64::try_from(units).unwrap_or(i64::MAX)))
            .collect();
        if unspent.is_empty() {
            return Ok(());
        }
        self.o.store.add_usage(&unspent).await.map_err(RunError::from)
    }

    /// Spends `cost` units at `now`, counted by rolling tiers as arriving up to `upload`
    /// later (a large body), so that the next call keeps its distance from the arrival.
    fn commit(&mut self, cost: u64, now: UnixMillis, upload: Duration, paced: Duration) {
        let quota = &self.o.settings.quota;
        self.pacer.commit(quota, cost, now.plus(upload));
        for tier in quota.tiers.iter().filter(|t| t.is_calendar()) {
            if let Some(reserved) = self.reserved.get_mut(&tier.usage_key(quota.zone, now)) {
                *reserved = reserved.saturating_sub(cost);
            }
        }
        self.meter.record(now, cost, paced);
        self.last_dispatch = Some(now);
    }

    /// Hands a health check off, retrying throttling and passing faults with backoff
    /// until the run must stop. `false` when it stopped trying.
    async fn invoke_health_check(&mut self, payload: &WorkerPayload) -> Result<bool, RunError> {
        let mut pause = INVOKE_BACKOFF.0;
        loop {
            match self.o.invoker.invoke(payload, None).await {
                Ok(()) => return Ok(true),
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, pause_ms = pause.as_millis(), "invoke refused; retrying");
                    let resume = self.o.clock.now().plus(pause);
                    if resume >= self.stop_at || self.stop_requested() {
                        let stop_at = self.stop_at;
                        self.sleep_until(stop_at).await;
                        return Ok(false);
                    }
                    self.sleep_until(resume).await;
                    pause = (pause * 2).min(INVOKE_BACKOFF.1);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Receives the next batch: no more than the quota can use before the visibility
    /// timeout. Returns `true` when draining and nothing is left anywhere.
    async fn fill_buffer(&mut self, now: UnixMillis) -> Result<bool, RunError> {
        let (slot, decision) = self.decide(1, now);
        let capacity = self.quota().capacity_until(&self.pacer, slot, self.receive_horizon(now), RECEIVE_BATCH);
        if capacity == 0 {
            if let Decision::WaitUntil { at, by } = decision {
                self.log_exhausted(at, by);
                self.sleep_until(self.hand_off_time(at, now)).await;
            }
            return Ok(false);
        }
        let poll = if self.opts.drain { Duration::from_millis(500) } else { MAX_POLL };
        let until_wake = self.next_wake().since(now);
        let wait = poll.min(until_wake);
        let received = match self.o.queue.receive(capacity, wait, self.o.settings.orchestrator.visibility_timeout).await {
            Ok(received) => received,
            Err(e) if e.is_retryable() => {
                warn!(error = %e, "receive failed; retrying");
                self.sleep_until(now.plus(Duration::from_secs(1))).await;
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        if received.is_empty() {
            if !self.opts.drain {
                return Ok(false);
            }
            // Our own answered hand-offs still count as in flight until deleted.
            self.settle_answered();
            self.flush_deletes().await?;
            return self.nothing_left().await;
        }
        let since = self.o.clock.now();
        self.buffer.extend(received.into_iter().map(|message| InHand { message, since }));
        Ok(false)
    }

    async fn nothing_left(&self) -> Result<bool, RunError> {
        if self.invokes_in_flight > 0 || self.receives_in_flight > 0 || self.deletes_in_flight > 0 || self.o.invoker.in_flight() > 0 {
            return Ok(false);
        }
        let depth = self.o.queue.depth().await?;
        Ok(depth.visible == 0 && depth.not_visible == 0)
    }

    /// While the circuit is open: hold no messages, send a health check when due.
    async fn while_open(&mut self, now: UnixMillis) -> Result<(), RunError> {
        self.release_buffer().await?;
        let interval = self.o.settings.circuit.health_check_interval;
        let due = self.circuit.next_health_check(self.last_health_check, interval).unwrap_or(now);
        if now < due {
            self.sleep_until(due).await;
            return Ok(());
        }
        let slot = self.slot_at(now);
        let needed = self.reservations_needed(1, slot);
        match self.quota().decide(&self.pacer, 1, slot) {
            Decision::Allow if !needed.is_empty() => self.reserve(needed).await?,
            Decision::Allow => {
                let payload = WorkerPayload::HealthCheck { circuit_epoch: self.circuit.epoch, sent_at: now, slot: self.call_slot(slot) };
                if self.invoke_health_check(&payload).await? {
                    self.commit(1, slot, Duration::ZERO, Duration::ZERO);
                    self.last_health_check = Some(now);
                    self.report.health_checks += 1;
                    Progress::bump(&self.o.progress.health_checks);
                    info!(epoch = self.circuit.epoch, "health check sent");
                }
            }
            Decision::WaitUntil { at, .. } => self.sleep_until(at.minus(self.lead())).await,
            Decision::Never { .. } => unreachable!("a 1-unit health check fits every tier"),
        }
        Ok(())
    }

    async fn dead_letter(&mut self, message: &QueuedMessage, cause: DeadLetterCause, detail: String) -> Result<(), RunError> {
        warn!(message_id = %message.message_id, cause = %cause.label(), %detail, "dead-lettered");
        let reason = DeadLetterReason { cause, detail };
        match self.o.queue.dead_letter(&message.message_id, &message.body, message.attempt, &reason).await {
            Ok(()) => self.pending_deletes.push(message.receipt.clone()),
            Err(PortError::TooLarge(why)) => {
                // The DLQ cannot take it with its reason: leave it hidden on the queue,
                // whose redrive policy moves it to the DLQ after its last receive.
                warn!(message_id = %message.message_id, %why, "too large to dead-letter with a reason; the queue's redrive policy will move it");
                self.buffer.retain(|held| held.message.receipt != message.receipt);
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        self.buffer.retain(|held| held.message.receipt != message.receipt);
        self.report.dead_lettered += 1;
        Progress::bump(&self.o.progress.dead_lettered);
        Ok(())
    }

    async fn flush_deletes(&mut self) -> Result<(), RunError> {
        for batch in self.pending_deletes.chunks(DELETE_BATCH) {
            self.o.queue.delete(batch).await?;
        }
        self.pending_deletes.clear();
        Ok(())
    }

    async fn release_buffer(&mut self) -> Result<(), RunError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let receipts: Vec<String> = self.buffer.drain(..).map(|h| h.message.receipt).collect();
        for batch in receipts.chunks(DELETE_BATCH) {
            self.o.queue.release(batch).await?;
        }
        self.report.released += receipts.len() as u64;
        Ok(())
    }

    /// Writes deletes and (while the lease is ours) the pacer snapshot,
    /// marked final only at the end of the run.
    async fn flush(&mut self, at_exit: bool) -> Result<(), RunError> {
        self.flush_deletes().await?;
        let mut state = self.pacer.clone();
        state.hold_until = self.own_hold;
        let snapshot = PacerSnapshot { state, at_exit };
        match self.o.store.save_pacer(&self.lease, &snapshot).await {
            // A lost lease: the new holder's snapshot wins.
            Ok(()) | Err(PortError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
        self.next_flush = self.o.clock.now().plus(self.o.settings.orchestrator.flush_interval);
        Ok(())
    }

    /// Ends the run: release what is in hand, write everything back, give up the lease.
    /// Runs after errors too, so a failing run leaves no message hidden for long.
    async fn finish(&mut self, failed: Option<&RunError>) -> Result<(), RunError> {
        if let Some(e) = failed {
            warn!(error = %e, "run failed; releasing what it held");
        }
        while let Some(done) = self.background.join_next().await {
            self.settle(done);
        }
        let released = self.release_buffer().await;
        let returned = self.return_unspent().await;
        let flushed = self.flush(true).await;
        let lease = self.o.store.release_lease(&self.lease).await.map_err(RunError::from);
        let now = self.o.clock.now();
        let calendar_used = self.pacer.usage(self.quota(), now);
        self.report.tiers = self.meter.report(self.quota(), &calendar_used);
        self.report.paced_ms = self.meter.paced_ms;
        self.report.ended_at = now;
        info!(dispatched = self.report.dispatched, dead_lettered = self.report.dead_lettered, stop = ?self.report.stop, "run ended");
        released.and(returned).and(flushed).and(lease)
    }
}

#[cfg(test)]
mod tests;

/// Lets a passing fault (throttling, a blip) through with a warning, so the loop tries
/// again a second later instead of ending the run; anything else stays an error.
fn passing(e: RunError) -> Result<(), RunError> {
    match e {
        RunError::Port(e) if e.is_retryable() => {
            warn!(error = %e, "state store unavailable; trying again shortly");
            Ok(())
        }
        other => Err(other),
    }
}

/// Dispatching at the slot needs a precise wake-up; dispatching ahead, a coarse one
/// does (see [`Run::decide`]).
async fn sleep_for_slot(clock: &dyn Clock, wake: UnixMillis, precise: bool) {
    if precise {
        clock.sleep_until(wake).await;
    } else {
        clock.sleep_until_coarse(wake).await;
    }
}

/// Resolves when a stop is requested; never without a stop channel.
async fn stop_requested(stop: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    match stop {
        Some(stop) => {
            if stop.wait_for(|stopped| *stopped).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}
