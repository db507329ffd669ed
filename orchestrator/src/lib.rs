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

mod batching;
#[doc(hidden)]
pub mod decision_bench;
mod fairness;
pub mod handover;
mod hidden;
mod homes;
#[cfg(feature = "lambda")]
pub mod lambda;
mod lane;
mod late_starts;
mod many;
mod order_gate;
mod report;
mod reservations;
mod schedule;
mod settings;
mod shares;
mod stack;
mod timers;

use std::sync::Arc;
use std::time::Duration;

use paceline_shared::config::{CoolDownScope, LaneChange, LanesConfig};
use paceline_shared::homes::LaneHomes;
use paceline_shared::job::{DeadLetterReason, Job, JobId};
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::order::OrderMark;
use paceline_shared::outcome::{Answer, Ending, OutcomeRecord, OutcomeSettings, OutcomeTimes};
use paceline_shared::pacer::MissedSlots;
use paceline_shared::ports::{
    load_calendar_usage, load_shared_calendar_usage, read_document, write_document, Invoker, JobQueue, LaneFirstRead, LaneSignals, Lease, OutcomeSink,
    OutgoingMessage, PacerSnapshot, PortError, PortResult, QueuedMessage, ScopedStores, StackDocument, StackDocuments, StateStore, VisibleAgain,
    CALL_SLOTS_FULL_KEY,
};
use paceline_shared::quota::Quota;
use paceline_shared::time::{Clock, UnixMillis};
use tokio::task::{JoinError, JoinSet};
use tracing::{info, warn};

pub use batching::{BatchingInvoker, MAX_BATCH_BYTES};
pub use fairness::{jain_index, FAIRNESS_WINDOW};
use handover::{LastRun, Relay};
use homes::HomesRun;
pub use report::{Fairness, LaneReport, Progress, RunReport, StopReason, TierReport};
use reservations::{Granted, Reservation};
pub use settings::{RunError, Settings};
use stack::{Action, CallSlotsRead, Event, LaneRead, LaneStart, Leftovers, Retune, SharedState, StackMachine, DELETE_BATCH};

/// How long before the next scheduled kick a run stops dispatching (time to settle its
/// last hand-offs, flush and give the lease up).
pub const HANDOVER: Duration = Duration::from_millis(250);

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

/// Where the outcome records of the jobs the orchestrator dead-letters go, and what
/// they keep.
struct KeptOutcomes {
    settings: OutcomeSettings,
    sink: Arc<dyn OutcomeSink>,
}

/// The drain loop's dependencies, built once (in Lambda, at cold start).
pub struct Orchestrator {
    queue: Arc<dyn JobQueue>,
    store: Arc<dyn StateStore>,
    invoker: Arc<dyn Invoker>,
    clock: Arc<dyn Clock>,
    settings: Settings,
    progress: Arc<Progress>,
    outcomes: Option<KeptOutcomes>,
    /// Where workers in this process say which slots they made no call at.
    missed_slots: Option<Arc<MissedSlots>>,
    /// With `[lanes]`: the store of each lane's state and of the stack's.
    scoped_stores: Option<Arc<dyn ScopedStores>>,
    /// Starts the next run before this one stops (on Lambda, the function itself).
    relay: Option<Arc<dyn Relay>>,
    /// The settings' `[lanes]`, for reads in the background.
    lanes: Option<Arc<LanesConfig>>,
    /// In a stack of shards, each shard's jobs queue (by shard index): where a job of a
    /// lane that lives on another shard is sent on.
    shard_queues: Vec<Arc<dyn JobQueue>>,
    /// In a stack of shards: where its documents are kept (the share book, the lanes'
    /// homes).
    documents: Option<Arc<dyn StackDocuments>>,
}

impl Orchestrator {
    #[must_use]
    pub fn new(queue: Arc<dyn JobQueue>, store: Arc<dyn StateStore>, invoker: Arc<dyn Invoker>, clock: Arc<dyn Clock>, settings: Settings) -> Self {
        let lanes = settings.lanes.clone().map(Arc::new);
        Self {
            queue,
            store,
            invoker,
            clock,
            settings,
            progress: Arc::default(),
            outcomes: None,
            missed_slots: None,
            scoped_stores: None,
            relay: None,
            lanes,
            shard_queues: Vec::new(),
            documents: None,
        }
    }

    /// The same orchestrator, in a stack of shards, reading and writing the stack's
    /// documents in `documents`: the share book (where shares move,
    /// [`Settings::share_most`]) and the lanes' homes.
    #[must_use]
    pub fn with_stack_documents(self, documents: Arc<dyn StackDocuments>) -> Self {
        Self { documents: Some(documents), ..self }
    }

    /// The same orchestrator, in a stack of shards, sending a job of a lane that lives
    /// on another shard to that shard's queue (`queues`: each shard's, by index).
    ///
    /// # Errors
    /// Not one queue for each of the settings' shards.
    pub fn with_shard_queues(self, queues: Vec<Arc<dyn JobQueue>>) -> Result<Self, String> {
        if queues.len() != self.settings.shard.of {
            return Err(format!("{} shards' queues for a stack of {} shards", queues.len(), self.settings.shard.of));
        }
        Ok(Self { shard_queues: queues, ..self })
    }

    /// The same orchestrator starting, [`handover::RELAY_LEAD`] before each run stops
    /// (drain runs aside), the next run through `relay`: it waits for the lease and
    /// continues the schedule the moment this run releases it.
    #[must_use]
    pub fn with_relay(self, relay: Arc<dyn Relay>) -> Self {
        Self { relay: Some(relay), ..self }
    }

    /// The same orchestrator keeping each lane's state and the stack's in `stores` (a
    /// stack of many lanes needs it; the lease stays in the main store).
    #[must_use]
    pub fn with_scoped_stores(self, stores: Arc<dyn ScopedStores>) -> Self {
        Self { scoped_stores: Some(stores), ..self }
    }

    /// The store of `scope`'s state: the main store for the default lane of a stack
    /// without lanes.
    fn store_for(&self, scope: &StoreScope) -> Arc<dyn StateStore> {
        match &self.scoped_stores {
            Some(stores) if self.settings.lanes.is_some() => stores.scoped(scope),
            _ => self.store.clone(),
        }
    }

    /// The store of this shard's share of the shared quota: its pacer snapshot, and in a
    /// stack of one shard its day and month counters.
    fn shard_store(&self) -> Arc<dyn StateStore> {
        self.store_for(&self.settings.shard.scope())
    }

    /// The counters a stack of shards reserves the shared quota's day and month units
    /// from, one for the stack; `None` for a stack of one shard, which counts them in its
    /// own scope as it always has.
    fn shared_counters(&self) -> Option<&Arc<dyn StackDocuments>> {
        self.documents.as_ref().filter(|_| self.settings.shard.of > 1)
    }

    /// What the shared quota's day and month tiers have used at `now`, by tier.
    async fn shared_calendar_usage(&self, now: UnixMillis) -> PortResult<Vec<u64>> {
        match self.shared_counters() {
            Some(counters) => load_shared_calendar_usage(counters.as_ref(), &self.settings.quota, now).await,
            None => load_calendar_usage(self.shard_store().as_ref(), &self.settings.quota, now).await,
        }
    }

    /// Reserves `needed` of the shared quota's day and month units: what was granted of
    /// each (in a stack of shards, fewer than asked where the other shards hold the rest).
    async fn reserve_shared(&self, needed: &[Reservation]) -> PortResult<Vec<Granted>> {
        let Some(counters) = self.shared_counters() else {
            self.shard_store().add_usage(&as_deltas(needed)).await?;
            return Ok(needed.iter().map(|reservation| Granted { units: reservation.units, shared_count: None }).collect());
        };
        let mut granted = Vec::with_capacity(needed.len());
        for reservation in needed {
            let reserved = counters.reserve_shared(&reservation.key, reservation.units, reservation.limit).await?;
            granted.push(Granted { units: reserved.units, shared_count: Some(reserved.count) });
        }
        Ok(granted)
    }

    /// Gives back the shared quota's units reserved and not spent (negative deltas).
    async fn return_shared(&self, unspent: &[(String, i64)]) -> PortResult<()> {
        let Some(counters) = self.shared_counters() else { return self.shard_store().add_usage(unspent).await };
        for (key, delta) in unspent {
            counters.return_shared(key, delta.unsigned_abs()).await?;
        }
        Ok(())
    }

    /// The same orchestrator giving back to its pacer the slots its workers (in this
    /// process, sharing `missed`) started too late to call at.
    #[must_use]
    pub fn with_missed_slots(self, missed: Arc<MissedSlots>) -> Self {
        Self { missed_slots: Some(missed), ..self }
    }

    /// The same orchestrator giving the jobs it dead-letters itself (a cost no tier can
    /// hold, a payload over the invoker's limit) an outcome record as the worker gives
    /// its own: kept in `sink` and carried by the dead letter. Without it (on AWS, where
    /// records go to the worker's results destination) they have none.
    #[must_use]
    pub fn with_outcomes(self, settings: OutcomeSettings, sink: Arc<dyn OutcomeSink>) -> Self {
        Self { outcomes: Some(KeptOutcomes { settings, sink }), ..self }
    }

    /// The outcome record of `job`, dead-lettered from `message` for `reason` without a
    /// call, if this orchestrator keeps records and the job gets one.
    /// A malformed job (`job` is `None`) gets one by the id its JSON names, if any.
    fn outcome_of_dead_letter(&self, job: Option<&Job>, message: &QueuedMessage, reason: &DeadLetterReason) -> Option<OutcomeRecord> {
        let kept = self.outcomes.as_ref()?;
        let Some(job) = job else {
            let id = JobId::named_in(&message.body).filter(|_| kept.settings.records_ending(Ending::DeadLettered))?;
            let times = OutcomeTimes { enqueued: Some(message.enqueued_at), ..OutcomeTimes::default() };
            return Some(OutcomeRecord::of_malformed(&id, message.attempt, reason, times));
        };
        if !kept.settings.records(job, Ending::DeadLettered) {
            return None;
        }
        let times = OutcomeTimes { enqueued: Some(job.enqueued_at.unwrap_or(message.enqueued_at)), ..OutcomeTimes::default() };
        let record = OutcomeRecord::new(job, Ending::DeadLettered, message.attempt, &Answer::default(), &kept.settings.headers, times);
        Some(record.because(OutcomeRecord::dead_letter_reason(reason)))
    }

    /// The same orchestrator handing off through `invoker`.
    #[must_use]
    pub fn with_invoker(self, invoker: Arc<dyn Invoker>) -> Self {
        Self { invoker, ..self }
    }

    /// The same orchestrator keeping its state in `store`.
    #[must_use]
    pub fn with_store(self, store: Arc<dyn StateStore>) -> Self {
        Self { store, ..self }
    }

    #[must_use]
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    #[must_use]
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    #[must_use]
    pub fn invoker(&self) -> &Arc<dyn Invoker> {
        &self.invoker
    }

    /// Waits, as `request`'s relay, for the lease to be released (see
    /// [`handover::await_release`]).
    ///
    /// # Errors
    /// A lease read that retrying will not mend.
    pub async fn await_release(&self, request: &handover::RelayRequest, give_up: UnixMillis) -> PortResult<handover::Release> {
        handover::await_release(self.store.as_ref(), self.clock.as_ref(), request, give_up).await
    }

    /// Live counters, readable while a run goes on.
    #[must_use]
    pub fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// Runs the drain loop once.
    ///
    /// # Errors
    /// [`RunError::LeaseHeld`] when another orchestrator runs this lane;
    /// [`RunError::Port`] on a fatal adapter error (after releasing what it held).
    #[tracing::instrument(skip_all, fields(holder = %opts.holder))]
    pub async fn run(&self, opts: &RunOptions) -> Result<RunReport, RunError> {
        if self.settings.lanes.is_some() && self.scoped_stores.is_none() {
            return Err(RunError::Port(PortError::Fatal("[lanes] needs a state store that keeps lanes apart (the embedded one, DynamoDB)".into())));
        }
        if self.settings.shard.of > 1 && self.documents.is_none() {
            return Err(RunError::Port(PortError::Fatal("a stack of shards needs the store of its documents (`with_stack_documents`)".into())));
        }
        // Where the lanes live, known before the first receive: a lane moved away must
        // not be called for here.
        let homes = match (&self.documents, self.settings.shard) {
            (Some(documents), shard) if shard.of > 1 => {
                let sent_at = self.clock.now();
                let read = read_document::<LaneHomes>(documents.as_ref(), StackDocument::LaneHomes).await?;
                Some(HomesRun::new(shard, read.map(|(homes, _)| homes).unwrap_or_default(), sent_at, self.settings.furthest_ahead()))
            }
            _ => None,
        };
        let started = self.clock.now();
        let lease = match self.store.acquire_lease(&opts.holder, self.settings.orchestrator.lease_ttl, started).await {
            Ok(lease) => lease,
            Err(PortError::Conflict(why)) => return Err(RunError::LeaseHeld(why)),
            Err(e) => return Err(e.into()),
        };
        info!(epoch = lease.epoch, "lease taken");
        let mut state = StackMachine::new(&self.settings, &self.progress, lease, started, opts.deadline, opts.drain)
            .with_pipeline(self.invoker.pipeline())
            .on_fair_queue(self.queue.serves_groups_fairly());
        if self.relay.is_some() && !opts.drain {
            state = state.with_relay(started);
        }
        if let Some(homes) = homes {
            state = state.with_homes(homes, started);
        }
        let mut run = Executor {
            o: self,
            state,
            background: JoinSet::new(),
            stop: opts.stop.clone(),
            handed_off_any: false,
            // The pace the invoker was built for (`BatchingInvoker::for_settings`).
            pace_told: Some(self.settings.quota.sustained_per_second()),
            late_start_lead: Duration::ZERO,
        };
        let outcome = match run.hydrate().await {
            Ok(()) => run.drive().await,
            Err(e) => Err(e),
        };
        let finished = run.finish(outcome.as_ref().err()).await;
        outcome.and(finished).map(|()| run.state.report)
    }
}

/// Performs the decision step's actions through the ports: the ones the loop waits for
/// inline, the hand-offs, health checks, receives and deletes in the background, so
/// Units to reserve as the store's deltas.
fn as_deltas(needed: &[Reservation]) -> Vec<(String, i64)> {
    needed.iter().map(|reservation| (reservation.key.clone(), i64::try_from(reservation.units).unwrap_or(i64::MAX))).collect()
}

/// that none of their latencies delays the next slot (pacing is about frequency).
struct Executor<'a> {
    o: &'a Orchestrator,
    state: StackMachine<'a>,
    background: JoinSet<Event>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    /// Whether the run handed a job off yet (its first is logged).
    handed_off_any: bool,
    /// In a stack of many lanes: the pace the invoker was last told of.
    pace_told: Option<f64>,
    /// What late starts added to the lead, as the invoker was last told.
    late_start_lead: Duration,
}

impl Executor<'_> {
    /// Reads where the last run left off: the one lane's state (a stack of many lanes
    /// reads each lane's when it first has jobs), or the shared quota's.
    async fn hydrate(&mut self) -> Result<(), RunError> {
        let earlier_runs = self.state.lease().epoch > 1;
        if self.o.settings.lanes.is_some() {
            let stack = self.o.shard_store();
            let last_run = LastRun::judge(stack.load_pacer().await, self.o.settings.shared_pacer_quota(), earlier_runs, self.o.clock.now())?;
            let calendar_used = self.o.shared_calendar_usage(self.o.clock.now()).await?;
            self.state.hydrate_shared(last_run, &calendar_used, self.o.clock.now());
            let marker = self.state.snapshots(false, self.o.clock.now()).pop().expect("the shared quota's snapshot").1;
            return self.mark_under_way(stack.as_ref(), &marker).await;
        }
        let start = self.read_lane_start(self.o.store.as_ref(), &self.o.settings.quota, earlier_runs).await?;
        let now = self.o.clock.now();
        self.state.only_lane().hydrate(start.last_run, &start.calendar_used, now);
        let marker = self.state.only_lane().snapshot(false, now);
        self.mark_under_way(self.o.store.as_ref(), &marker).await?;
        self.state.apply_shared_state(0, start.shared, self.o.clock.now());
        Ok(())
    }

    /// From here until a clean exit, the stored snapshot says "a run is under way", so a
    /// crash at any point is recognised by the next run.
    async fn mark_under_way(&self, store: &dyn StateStore, snapshot: &paceline_shared::ports::PacerSnapshot) -> Result<(), RunError> {
        match store.save_pacer(self.state.lease(), snapshot).await {
            // Lost already: the first renewal says so and the run stops.
            Ok(()) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// A lane's last snapshot (as judged: `earlier_runs` when a run held the lease
    /// before) and calendar usage in `store`, under `quota`, and its shared state.
    async fn read_lane_start(&self, store: &dyn StateStore, quota: &Quota, earlier_runs: bool) -> PortResult<LaneStart> {
        lane_start(store, quota, earlier_runs, self.stack_cool_down().await?, self.o.clock.as_ref()).await
    }

    /// What a read of lane `index` in the background needs.
    fn lane_to_read(&self, index: usize) -> LaneToRead {
        let (scope, quota) = self.state.lane_scope(index);
        let lane = self.state.lane(index);
        LaneToRead { id: lane.id().clone(), quota: quota.clone(), change: lane.change().cloned(), store: self.o.store_for(&scope) }
    }

    /// With `[lanes]`: lane `index`'s settings as an operator changed them in `store`
    /// (`paceline lanes set`, `remove`), when that differs from what is in force.
    async fn read_retune(&self, index: usize, store: &dyn StateStore) -> PortResult<Option<Retune>> {
        let Some(lanes) = &self.o.lanes else { return Ok(None) };
        retune_of(lanes, &self.lane_to_read(index), store.lane_change().await?, self.o.clock.as_ref()).await
    }

    /// The circuit and cool-down in `store`, and under a cap on calls in flight (in
    /// `quota`) the call slots held.
    async fn read_shared_state(&self, store: &dyn StateStore, quota: &Quota) -> PortResult<SharedState> {
        let signals = store.shared_state().await?;
        let stack_cool_down = self.stack_cool_down().await?;
        shared_state_of(signals, stack_cool_down, store, quota, self.o.clock.as_ref()).await
    }

    /// A 429 that cools every lane (`[lanes] on_429 = "stack"`) is the stack's: its
    /// cool-down then, none otherwise.
    async fn stack_cool_down(&self) -> PortResult<UnixMillis> {
        cool_down_in(self.stack_cooling().as_deref()).await
    }

    /// The store of the stack's cool-down when a 429 cools every lane.
    fn stack_cooling(&self) -> Option<Arc<dyn StateStore>> {
        let stack_wide = self.o.settings.lanes.as_ref().is_some_and(|lanes| lanes.on_429 == CoolDownScope::Stack);
        stack_wide.then(|| self.o.store_for(&StoreScope::Stack))
    }

    /// Asks the decision step what to do, does it, and feeds back what came of it,
    /// until it says stop.
    async fn drive(&mut self) -> Result<(), RunError> {
        loop {
            if self.stop.as_ref().is_some_and(|stop| *stop.borrow()) {
                self.state.on_event(Event::StopRequested, self.o.clock.now())?;
            }
            while let Some(done) = self.background.try_join_next() {
                self.state.on_event(joined(done)?, self.o.clock.now())?;
            }
            if let Some(missed) = self.o.missed_slots.as_ref().map(|slots| slots.take()).filter(|m| !m.is_empty()) {
                self.state.on_event(Event::SlotsMissed(missed), self.o.clock.now())?;
            }
            self.follow_pace();
            let action = self.state.next_action(self.o.clock.now());
            self.follow_late_starts();
            match action {
                Action::Stop => return Ok(()),
                Action::Sleep { until, precise } => self.sleep(until, precise).await?,
                action => self.perform(action).await?,
            }
        }
    }

    /// Tells the invoker the pace the stack hands jobs off at when it moved (its batches'
    /// stripes follow it; see [`StackMachine::hand_off_pace`]).
    fn follow_pace(&mut self) {
        let Some(pace) = self.state.hand_off_pace().filter(|pace| *pace > 0.0) else { return };
        if self.pace_told != Some(pace) {
            self.pace_told = Some(pace);
            self.o.invoker.pace_changed(pace);
        }
    }

    /// Tells the invoker how much earlier than configured jobs are handed off when that
    /// moved (a batch goes that much earlier too).
    fn follow_late_starts(&mut self) {
        let lead = self.state.late_start_lead();
        if self.late_start_lead != lead {
            self.late_start_lead = lead;
            self.o.invoker.lead_changed(lead);
        }
    }

    /// Sleeps until `until`; wakes early for a stop request or finished background work.
    async fn sleep(&mut self, until: UnixMillis, precise: bool) -> Result<(), RunError> {
        let clock = self.o.clock.clone();
        // Biased: the same events always resolve the same way, so simulations repeat.
        let event = tokio::select! {
            biased;
            () = stop_requested(&mut self.stop) => Some(Ok(Event::StopRequested)),
            Some(done) = self.background.join_next(), if !self.background.is_empty() => Some(joined(done)),
            () = sleep_for_slot(clock.as_ref(), until, precise) => None,
        };
        match event {
            Some(event) => self.state.on_event(event?, self.o.clock.now()),
            None => Ok(()),
        }
    }

    async fn perform(&mut self, action: Action) -> Result<(), RunError> {
        let (o, cfg) = (self.o, &self.o.settings.orchestrator);
        let event = match action {
            Action::Renew(lease) => Event::Renewed(o.store.renew_lease(&lease, cfg.lease_ttl, o.clock.now()).await),
            Action::Refresh(lane) => {
                let (scope, quota) = self.state.lane_scope(lane);
                let store = o.store_for(&scope);
                let read = match self.read_shared_state(store.as_ref(), quota).await {
                    Ok(shared) => self.read_retune(lane, store.as_ref()).await.map(|retune| SharedState { retune, ..shared }),
                    Err(e) => Err(e),
                };
                Event::Refreshed(lane, read)
            }
            Action::RefreshLanes(indices) => {
                let stores = o.scoped_stores.clone().expect("a stack of many lanes has its scoped stores");
                let lanes: Vec<(usize, LaneToRead)> = indices.into_iter().map(|index| (index, self.lane_to_read(index))).collect();
                let (stack, clock) = (self.stack_cooling(), o.clock.clone());
                self.background.spawn(async move { Event::LanesRefreshed(refresh_lanes(stores.as_ref(), lanes, stack.as_deref(), clock.as_ref()).await) });
                return Ok(());
            }
            // In the background: a thousand lanes' first reads must not hold the loop.
            Action::HydrateLanes(indices) => {
                let stores = o.scoped_stores.clone().expect("a stack of many lanes has its scoped stores");
                let lanes: Vec<(usize, LaneToRead)> = indices.into_iter().map(|index| (index, self.lane_to_read(index))).collect();
                let (config, lease, stack, clock) = (o.lanes.clone(), self.state.lease().clone(), self.stack_cooling(), o.clock.clone());
                self.background.spawn(async move {
                    Event::LanesHydrated(hydrate_lanes(stores.as_ref(), lanes, config.as_deref(), &lease, stack.as_deref(), clock.as_ref()).await)
                });
                return Ok(());
            }
            Action::ReadOrder(lane) => {
                let store = o.store_for(&self.state.lane_scope(lane).0);
                self.background.spawn(async move { Event::OrderRead(lane, store.order_mark().await) });
                return Ok(());
            }
            Action::SwapCircuit { lane, expected_epoch, next } => {
                let result = o.store_for(&self.state.lane_scope(lane).0).swap_circuit(expected_epoch, &next).await;
                Event::CircuitSwapped(lane, next, result)
            }
            Action::Flush(lease, snapshots) if o.settings.lanes.is_none() => Event::Flushed(save_snapshots(o, &lease, &snapshots).await),
            // Many lanes' snapshots are saved in the background: a thousand writes must
            // not hold the loop (the run's last ones wait for it, see `finish`).
            Action::Flush(lease, snapshots) => {
                let stores = o.scoped_stores.clone().expect("a stack of many lanes has its scoped stores");
                self.background.spawn(async move { Event::Flushed(stores.save_pacers(&lease, &snapshots).await) });
                return Ok(());
            }
            Action::Reserve(lane, needed) => {
                let result = o.store_for(&self.state.lane_scope(lane).0).add_usage(&as_deltas(&needed)).await;
                Event::Reserved(lane, needed, result)
            }
            Action::ReserveShared(needed) => {
                let result = o.reserve_shared(&needed).await;
                Event::SharedReserved(needed, result)
            }
            Action::DeadLetter(message, mut reason, job) => {
                warn!(message_id = %message.message_id, cause = %reason.cause.label(), detail = %reason.detail, "dead-lettered");
                let record = o.outcome_of_dead_letter(job.as_deref(), &message, &reason);
                reason.outcome = record.clone().map(Box::new);
                let result = o.queue.dead_letter(&message.message_id, &message.body, message.attempt, &reason).await;
                if let (Ok(()), Some(record), Some(kept)) = (&result, &record, &o.outcomes) {
                    // The dead letter carries the record: a failed write loses nothing.
                    if let Err(e) = kept.sink.record_outcome(record).await {
                        warn!(error = %e, job_id = %record.job_id, "could not keep the dead-lettered job's outcome record; its dead letter carries it");
                    }
                }
                Event::DeadLettered(message, result)
            }
            Action::Forward(shard, messages) => {
                let sent: Vec<OutgoingMessage> =
                    messages.iter().map(|message| OutgoingMessage::again(message.body.clone(), message.attempt, Duration::ZERO)).collect();
                let result = match o.shard_queues.get(shard) {
                    Some(queue) => queue.send(&sent).await,
                    None => Err(PortError::Fatal(format!(
                        "no queue for shard {shard} of {}: the orchestrator was built without its shards' queues",
                        o.settings.shard.of
                    ))),
                };
                Event::Forwarded(messages, result)
            }
            // Visibility changes go in the background: the loop dispatches meanwhile.
            Action::Release(messages) => {
                let queue = o.queue.clone();
                self.background.spawn(async move {
                    let result = in_batches(&messages, |batch| queue.release(batch)).await;
                    Event::released(&messages, result)
                });
                return Ok(());
            }
            Action::SendAgain(jobs) => {
                let queue = o.queue.clone();
                self.background.spawn(async move {
                    let sent: Vec<OutgoingMessage> =
                        jobs.iter().map(|(message, delay)| OutgoingMessage::again(hidden::body_sent_again(message), message.attempt, *delay)).collect();
                    let result = queue.send(&sent).await;
                    Event::SentAgain(jobs.into_iter().map(|(message, _)| message).collect(), result)
                });
                return Ok(());
            }
            Action::ExtendHidden(receipts) => {
                let (queue, hidden) = (o.queue.clone(), VisibleAgain::all(receipts, cfg.visibility_timeout));
                self.background.spawn(async move { Event::ExtendedHidden(hidden.len(), in_batches(&hidden, |batch| queue.release(batch)).await) });
                return Ok(());
            }
            Action::CheckDrained => Event::DrainChecked(self.nothing_left().await),
            Action::Receive { max, wait, long_poll } => {
                let (queue, clock, visibility) = (o.queue.clone(), o.clock.clone(), cfg.visibility_timeout);
                self.background.spawn(async move {
                    let started = clock.now();
                    let result = queue.receive(max, wait, visibility).await;
                    Event::Received { result, took: clock.now().since(started), long_poll }
                });
                return Ok(());
            }
            Action::Delete(receipts) => {
                let queue = o.queue.clone();
                self.background.spawn(async move {
                    let result = queue.delete(&receipts).await;
                    Event::Deleted(receipts, result)
                });
                return Ok(());
            }
            Action::Dispatch(hand_off, payload) => {
                if !self.handed_off_any {
                    // The hand-over's measure: from the last run's release to this.
                    self.handed_off_any = true;
                    info!(at = %o.clock.now(), slot = %hand_off.slot, "the run's first hand-off");
                }
                let invoker = o.invoker.clone();
                // An ordered lane's mark names the job before its worker can settle it.
                let opens = payload.ordered_job().map(|(job, attempt)| OrderMark::open(job.id.as_str(), attempt, o.clock.now()));
                let marks = opens.map(|mark| (o.store_for(&self.state.lane_scope(hand_off.lane).0), mark));
                self.background.spawn(async move {
                    let opened = match &marks {
                        Some((store, mark)) => store.open_order(mark).await,
                        None => Ok(()),
                    };
                    let result = match opened {
                        Ok(()) => invoker.invoke(&payload, Some(&hand_off.message.receipt)).await,
                        Err(e) => Err(e),
                    };
                    Event::HandedOff(hand_off, Box::new(payload), result)
                });
                return Ok(());
            }
            Action::HealthCheck(lane, payload) => {
                let invoker = o.invoker.clone();
                self.background.spawn(async move { Event::HealthChecked(lane, invoker.invoke(&payload, None).await) });
                return Ok(());
            }
            Action::StartRelay(request) => {
                let relay = o.relay.clone().expect("a relay is asked for only when there is one");
                info!(release_by = %request.release_by, "starting the relay: the next run, to take the lease at its release");
                self.background.spawn(async move { Event::RelayStarted(relay.start_next(&request).await) });
                return Ok(());
            }
            Action::ReadShares => {
                let documents = o.documents.clone().expect("checked when the run started");
                self.background.spawn(async move { Event::SharesRead(read_document(documents.as_ref(), StackDocument::ShareBook).await) });
                return Ok(());
            }
            Action::ReadHomes => {
                let (documents, sent_at) = (o.documents.clone().expect("checked when the run started"), o.clock.now());
                self.background.spawn(async move { Event::HomesRead { result: read_document(documents.as_ref(), StackDocument::LaneHomes).await, sent_at } });
                return Ok(());
            }
            Action::HandOver(lease, lane, snapshot) => {
                let store = o.store_for(&StoreScope::Lane(lane.clone()));
                self.background.spawn(async move { Event::HandedOver(lane, store.save_pacer(&lease, &snapshot).await) });
                return Ok(());
            }
            Action::WriteShares(written, version) => {
                let documents = o.documents.clone().expect("checked when the run started");
                self.background
                    .spawn(async move { Event::SharesWritten(write_document(documents.as_ref(), StackDocument::ShareBook, &written, version).await) });
                return Ok(());
            }
            Action::Sleep { .. } | Action::Stop => unreachable!("the loop sleeps and stops itself"),
        };
        self.state.on_event(event, o.clock.now())
    }

    /// Whether nothing is left on the queue or in the invoker's hands.
    async fn nothing_left(&self) -> PortResult<bool> {
        if self.o.invoker.in_flight() > 0 {
            return Ok(false);
        }
        let depth = self.o.queue.depth().await?;
        Ok(depth.visible == 0 && depth.not_visible == 0)
    }

    /// Ends the run: write the final snapshot and give up the lease at once (dispatching
    /// is over, so the pacer's state is final and the relay continues it), then settle
    /// the background work, send the deletes, release what is in hand, give back unspent
    /// reservations. Runs after errors too, so a failing run leaves no message hidden for
    /// long.
    async fn finish(&mut self, failed: Option<&RunError>) -> Result<(), RunError> {
        if let Some(e) = failed {
            warn!(error = %e, "run failed; releasing what it held");
        }
        let o = self.o;
        let snapshots = self.state.snapshots(true, o.clock.now());
        let flushed = match again_after_passing_faults(o.clock.as_ref(), || save_snapshots(o, self.state.lease(), &snapshots)).await {
            // A lost lease: the new holder's snapshot wins.
            Ok(()) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        };
        let lease = again_after_passing_faults(o.clock.as_ref(), || o.store.release_lease(self.state.lease())).await;
        match &lease {
            Ok(()) => info!(at = %o.clock.now(), "lease released"),
            Err(e) => warn!(error = %e, "could not release the lease: the next run takes it when it expires"),
        }
        // The last hand-offs go now, not when their batch would have: the run ends on time.
        // Their slots are in the snapshot: the next run calls after them.
        o.invoker.flush().await;
        while let Some(done) = self.background.join_next().await {
            if let Err(e) = joined(done).and_then(|event| self.state.on_event(event, o.clock.now())) {
                warn!(error = %e, "while settling the last background work");
            }
        }
        let Leftovers { deletes, in_hand, unspent, shared_unspent } = self.state.leftovers();
        let deleted = in_batches(&deletes, |batch| o.queue.delete(batch)).await;
        let in_hand = VisibleAgain::all(in_hand, Duration::ZERO);
        let released = in_batches(&in_hand, |batch| o.queue.release(batch)).await;
        if released.is_ok() {
            self.state.report.released += in_hand.len() as u64;
        }
        let mut returned = o.return_shared(&shared_unspent).await;
        for (scope, deltas) in &unspent {
            returned = returned.and(o.store_for(scope).add_usage(deltas).await);
        }
        self.leave_share_book().await;
        self.state.close_report(o.clock.now());
        let report = &self.state.report;
        info!(dispatched = report.dispatched, dead_lettered = report.dead_lettered, stop = ?report.stop, "run ended");
        deleted.and(released).and(returned).and(flushed).and(lease).map_err(RunError::from)
    }

    /// A shard whose run ended with nothing left to do (drained, or stopped by its
    /// operator) leaves the share book: its parts go to the other shards once its calls
    /// have gone. A write another shard made first is read again; a failure leaves the
    /// parts to be taken back as a silent shard's are.
    async fn leave_share_book(&self) {
        let (Some(documents), Some(shares)) = (&self.o.documents, self.state.shares()) else { return };
        if !matches!(self.state.stop_reason(), Some(StopReason::Drained | StopReason::Stopped)) {
            return;
        }
        for _ in 0..HAND_OVER_RETRIES {
            let read = match read_document(documents.as_ref(), StackDocument::ShareBook).await {
                Ok(read) => read,
                Err(e) => return warn!(error = %e, "could not read the share book to leave it"),
            };
            let Some((left, version)) = shares.leave(read, self.o.clock.now()) else { return };
            match write_document(documents.as_ref(), StackDocument::ShareBook, &left, Some(version)).await {
                Ok(true) => return info!("left the share book: this shard's parts go to the others"),
                Ok(false) => {}
                Err(e) => return warn!(error = %e, "could not leave the share book"),
            }
        }
        warn!("could not leave the share book: other shards kept writing it");
    }
}

/// Tries `write` again after a passing fault, [`HAND_OVER_RETRIES`] times, 20 ms and
/// then twice as long apart: the relay waits on the final snapshot and the release.
async fn again_after_passing_faults<T, F, Fut>(clock: &dyn Clock, mut write: F) -> PortResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = PortResult<T>>,
{
    let mut pause = Duration::from_millis(20);
    for _ in 0..HAND_OVER_RETRIES {
        match write().await {
            Err(e) if e.is_retryable() => {
                warn!(error = %e, "a hand-over write failed; trying again");
                clock.sleep_until(clock.now().plus(pause)).await;
                pause *= 2;
            }
            done => return done,
        }
    }
    write().await
}

/// Tries again of the final snapshot and the lease release after a passing fault.
const HAND_OVER_RETRIES: usize = 3;

/// Saves each scope's pacer snapshot while `lease` is held (a stack of many lanes, in as
/// few requests as its stores allow), stopping at the first error.
async fn save_snapshots(o: &Orchestrator, lease: &Lease, snapshots: &[(StoreScope, PacerSnapshot)]) -> PortResult<()> {
    if let (Some(stores), Some(_)) = (&o.scoped_stores, &o.settings.lanes) {
        return stores.save_pacers(lease, snapshots).await;
    }
    for (scope, snapshot) in snapshots {
        o.store_for(scope).save_pacer(lease, snapshot).await?;
    }
    Ok(())
}

/// Calls `each` on `items` in SQS-sized batches, stopping at the first error.
async fn in_batches<'a, T, F, Fut>(items: &'a [T], mut each: F) -> PortResult<()>
where
    F: FnMut(&'a [T]) -> Fut,
    Fut: std::future::Future<Output = PortResult<()>>,
{
    for batch in items.chunks(DELETE_BATCH) {
        each(batch).await?;
    }
    Ok(())
}

/// What a read of one lane in the background needs: its id, quota, settings in force
/// and store.
struct LaneToRead {
    id: LaneId,
    quota: Quota,
    change: Option<LaneChange>,
    store: Arc<dyn StateStore>,
}

/// A lane's last snapshot (as judged: `earlier_runs` when a run held the lease before)
/// and calendar usage in `store`, under `quota`, and its shared state.
async fn lane_start(store: &dyn StateStore, quota: &Quota, earlier_runs: bool, stack_cool_down: UnixMillis, clock: &dyn Clock) -> PortResult<LaneStart> {
    let last_run = LastRun::judge(store.load_pacer().await, quota, earlier_runs, clock.now())?;
    let calendar_used = load_calendar_usage(store, quota, clock.now()).await?;
    let shared = shared_state_of(store.shared_state().await?, stack_cool_down, store, quota, clock).await?;
    Ok(LaneStart { last_run, calendar_used, shared })
}

/// The first reads of `lanes` in a stack of many lanes (`config`): what each starts
/// from, an operator's change of its settings, and its snapshot marked as under way, in
/// a few requests for them all (their items read together, their marks saved together)
/// where each lane's own took four. A lane whose read failed is read again later; a
/// read or a save that failed for all fails each.
async fn hydrate_lanes(
    stores: &dyn ScopedStores,
    lanes: Vec<(usize, LaneToRead)>,
    config: Option<&LanesConfig>,
    lease: &Lease,
    stack: Option<&dyn StateStore>,
    clock: &dyn Clock,
) -> Vec<(usize, PortResult<LaneStart>)> {
    let ids = lane_ids(&lanes);
    let (reads, stack_cool_down) = match beside_stack_cool_down(stack, stores.lanes_first_reads(&ids)).await {
        Ok(read) => read,
        Err(e) => return failed_each(lanes, &e),
    };
    // What is left to read is each lane's own (calendar counters, call slots, a changed
    // lane's settings), for most lanes nothing: read for all at once.
    let started =
        futures_util::future::join_all(lanes.iter().zip(reads).map(|((_, lane), read)| first_start(lane, read, config, stack_cool_down, clock))).await;
    let (mut starts, mut marks) = (Vec::with_capacity(lanes.len()), Vec::with_capacity(lanes.len()));
    for ((index, lane), start) in lanes.into_iter().zip(started) {
        if let Ok(start) = &start {
            marks.push((StoreScope::Lane(lane.id.clone()), under_way_mark(&start.last_run, &lane.quota, clock.now())));
        }
        starts.push((index, start));
    }
    match stores.save_pacers(lease, &marks).await {
        // Lost already: the first renewal says so and the run stops.
        Ok(()) | Err(PortError::Conflict(_)) => starts,
        Err(e) => failed_each(starts, &e),
    }
}

/// The ids of lanes read in the background.
fn lane_ids(lanes: &[(usize, LaneToRead)]) -> Vec<LaneId> {
    lanes.iter().map(|(_, lane)| lane.id.clone()).collect()
}

/// What `read` finds, and the stack's cool-down in `stack` (read first).
async fn beside_stack_cool_down<T>(stack: Option<&dyn StateStore>, read: impl std::future::Future<Output = PortResult<T>>) -> PortResult<(T, UnixMillis)> {
    let stack_cool_down = cool_down_in(stack).await?;
    Ok((read.await?, stack_cool_down))
}

/// `e` for each of `lanes` (by their index in the stack), where their read failed
/// together.
fn failed_each<L, T>(lanes: Vec<(usize, L)>, e: &PortError) -> Vec<(usize, PortResult<T>)> {
    lanes.into_iter().map(|(index, _)| (index, Err(e.clone()))).collect()
}

/// What `lane` starts from, as its first read found it (`config`: the stack's lanes).
async fn first_start(
    lane: &LaneToRead,
    read: LaneFirstRead,
    config: Option<&LanesConfig>,
    stack_cool_down: UnixMillis,
    clock: &dyn Clock,
) -> PortResult<LaneStart> {
    let store = lane.store.as_ref();
    let last_run = LastRun::judge(read.pacer, &lane.quota, false, clock.now())?;
    let calendar_used = load_calendar_usage(store, &lane.quota, clock.now()).await?;
    let mut shared = shared_state_of(read.signals, stack_cool_down, store, &lane.quota, clock).await?;
    if let Some(config) = config {
        shared.retune = retune_of(config, lane, read.change, clock).await?;
    }
    Ok(LaneStart { last_run, calendar_used, shared })
}

/// The snapshot that marks a lane's state as under way in this run: its last run's, or
/// a new pacer's (a lane with no snapshot never dispatched: its first run writes one
/// before its first call).
fn under_way_mark(last_run: &LastRun, quota: &Quota, now: UnixMillis) -> PacerSnapshot {
    match last_run {
        LastRun::Clean(last) | LastRun::Unclean { snapshot: Some(last), .. } => PacerSnapshot { at_exit: false, saved_at: Some(now), ..last.clone() },
        LastRun::None | LastRun::Unclean { snapshot: None, .. } => {
            PacerSnapshot { state: paceline_shared::pacer::PacerState::new(quota), at_exit: false, effective_rate: None, saved_at: Some(now) }
        }
    }
}

/// `lane`'s settings under the operator's change `stored` (`paceline lanes set`,
/// `remove`), when that differs from what is in force.
async fn retune_of(lanes: &LanesConfig, lane: &LaneToRead, stored: Option<LaneChange>, clock: &dyn Clock) -> PortResult<Option<Retune>> {
    if stored == lane.change {
        return Ok(None);
    }
    let settings = match lanes.lane_changed(&lane.id, &stored.clone().unwrap_or_default()) {
        Ok(settings) => settings,
        Err(problem) => {
            warn!(lane = %lane.id, %problem, "the lane's settings in the store cannot be used: the ones in force stay");
            return Ok(None);
        }
    };
    let calendar_used = load_calendar_usage(lane.store.as_ref(), &settings.quota, clock.now()).await?;
    Ok(Some(Retune { change: stored, quota: settings.quota, weight: settings.weight, calendar_used }))
}

/// A lane's state from its `signals` (in `store`, under `quota`): cooled down until the
/// stack's cool-down too, and under a cap on calls in flight the call slots held.
async fn shared_state_of(
    signals: LaneSignals,
    stack_cool_down: UnixMillis,
    store: &dyn StateStore,
    quota: &Quota,
    clock: &dyn Clock,
) -> PortResult<SharedState> {
    let call_slots = match quota.max_in_flight() {
        Some(capacity) => {
            let in_use = store.call_slots_in_use(capacity, clock.now()).await?;
            let full = store.load_usage(&[CALL_SLOTS_FULL_KEY.to_owned()]).await?;
            Some(CallSlotsRead { in_use, full_so_far: full.first().copied().unwrap_or(0) })
        }
        None => None,
    };
    let cool_down = signals.cool_down.max(stack_cool_down);
    Ok(SharedState { circuit: signals.circuit, cool_down, provider_reading: signals.provider_reading, call_slots, retune: None })
}

/// The stack's cool-down in `stack` (none without it).
async fn cool_down_in(stack: Option<&dyn StateStore>) -> PortResult<UnixMillis> {
    match stack {
        Some(stack) => stack.cool_down().await,
        None => Ok(UnixMillis(0)),
    }
}

/// Re-reads many lanes' state together ([`Action::RefreshLanes`]), each by its index;
/// `stack`: the store of the stack's cool-down when a 429 cools every lane. An
/// operator's change of a lane's settings is returned, not applied.
async fn refresh_lanes(
    stores: &dyn ScopedStores,
    lanes: Vec<(usize, LaneToRead)>,
    stack: Option<&dyn StateStore>,
    clock: &dyn Clock,
) -> Vec<(usize, LaneRead)> {
    let ids = lane_ids(&lanes);
    let (signals, stack_cool_down) = match beside_stack_cool_down(stack, stores.lanes_signals(&ids)).await {
        Ok(read) => read,
        Err(e) => return failed_each(lanes, &e),
    };
    let mut read = Vec::with_capacity(lanes.len());
    for ((index, lane), (signals, change)) in lanes.into_iter().zip(signals) {
        let shared = shared_state_of(signals, stack_cool_down, lane.store.as_ref(), &lane.quota, clock).await;
        read.push((index, shared.map(|shared| (shared, change))));
    }
    read
}

/// A background task's event; a task that panicked or was cancelled ends the run.
fn joined(done: Result<Event, JoinError>) -> Result<Event, RunError> {
    done.map_err(|e| RunError::Port(PortError::Fatal(format!("a background task failed: {e}"))))
}

#[cfg(test)]
mod tests;

/// Dispatching at the slot needs a precise wake-up; dispatching ahead, a coarse one
/// does (see `LaneMachine::decide` in `lane.rs`).
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
