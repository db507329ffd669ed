//! The worker: calls the configured API for a job (or a health check), classifies the
//! outcome, and does what it calls for: done; cool down and re-queue; count a failure,
//! open the circuit if failures passed the payload's [`TripRule`], and re-queue the job
//! after a jittered back-off; or dead-letter. The same code runs in Lambda, in `paceline run` and in
//! `paceline simulate` (there against a simulated API). A Lambda worker's payload may
//! carry a batch of jobs ([`batch`]): each is called at its own slot, the calls overlap in
//! one execution, and each settles as a lone job's would.
//!
//! Each attempt of a job calls the API at most once however often its payload is
//! delivered: the worker claims the attempt's call record first (the job id is the
//! idempotency key); a repeated delivery finds it done (and does nothing) or calling (and
//! fails, so Lambda retries it later, when the record says done or its claim expired).
//! A batch's calls are claimed and not marked done: the batch's own record says which
//! settled (see `batch.rs`). Lambda workers always claim; an in-process worker (whose invoker delivers each
//! hand-off once) claims when its payloads come ahead of their slot, where the claim's
//! write cannot delay the call.
//!
//! A job that ends (succeeded, or dead-lettered) gets an outcome record (`[outcomes]`):
//! the worker returns it (a Lambda worker's function result, which the async `OnSuccess`
//! destination delivers), writes it to the outcome sink where there is one (the embedded
//! store) before marking the call done, and a dead letter carries it too.
//!
//! A payload dispatched ahead of its slot ([`CallSlot`]) waits for the slot, and skips
//! the call (re-queueing the job) when it started too late to make it. Under a cap on
//! calls in flight (`quota.max_in_flight`), each call holds one of the cap's slots in the
//! state store; a worker that finds none free re-queues its job without calling.

pub mod batch;
pub mod classify;
pub mod http;
#[cfg(feature = "lambda")]
pub mod lambda;
pub mod lanes;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use paceline_shared::breaker::{retry_delay, Circuit, Refusal, TripRule};
use paceline_shared::calls_coming::calls_coming;
use paceline_shared::config::RetryConfig;
use paceline_shared::job::{ApiRequest, CallSlot, DeadLetterCause, DeadLetterReason, Job, WorkerPayload};
use paceline_shared::order::OrderState;
use paceline_shared::outcome::{Answer, Ending, OutcomeRecord, OutcomeSettings, OutcomeTimes};
use paceline_shared::pacer::{MissedSlot, MissedSlots};
use paceline_shared::ports::{
    call_record_key, CallClaim, JobQueue, OutcomeSink, OutgoingMessage, PortError, PortResult, StateStore, WorkerHandler, CALL_SLOTS_FULL_KEY,
};
use paceline_shared::retry;
use paceline_shared::time::{Clock, UnixMillis};
use serde::Serialize;
use tracing::{info, warn};

pub use classify::{classify, failure_label, provider_reading, CallResult, CappedBody, Outcome};

/// A job that found every call slot held comes back within this long (a random share).
const CALL_SLOT_RETRY: std::time::Duration = std::time::Duration::from_secs(1);
pub use http::{ApiClient, ApiError};

/// What the workers did, for summaries and progress bars.
#[derive(Debug, Default, Serialize)]
pub struct WorkerStats {
    pub succeeded: AtomicU64,
    pub requeued: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub rate_limited: AtomicU64,
    pub outages_seen: AtomicU64,
    pub health_checks_ok: AtomicU64,
    pub health_checks_failed: AtomicU64,
    pub circuit_opened: AtomicU64,
    pub circuit_closed: AtomicU64,
    /// Payloads whose worker started after their slot's `call_by`: no call was made.
    pub missed_slots: AtomicU64,
    /// Jobs re-queued without a call because every call slot (`max_in_flight`) was held.
    pub call_slots_full: AtomicU64,
    /// A batch's jobs re-queued without a call because the worker had opened the circuit
    /// since they were handed off.
    pub held_by_circuit: AtomicU64,
    /// Repeated deliveries of an attempt already called: no second call was made.
    pub repeats_skipped: AtomicU64,
    /// Jobs' calls made (health checks apart), how long they took in all, and how long
    /// after their pacer slots they went out in all.
    pub calls: AtomicU64,
    pub call_millis: AtomicU64,
    pub slot_lag_millis: AtomicU64,
}

/// A copy of what [`WorkerStats`] counts, to tell what one invocation did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerCounts {
    pub succeeded: u64,
    pub requeued: u64,
    pub dead_lettered: u64,
    pub rate_limited: u64,
    pub api_failures: u64,
    pub missed_slots: u64,
    pub calls: u64,
    pub call_millis: u64,
    pub slot_lag_millis: u64,
}

impl WorkerCounts {
    /// What was counted since `earlier`.
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            succeeded: self.succeeded - earlier.succeeded,
            requeued: self.requeued - earlier.requeued,
            dead_lettered: self.dead_lettered - earlier.dead_lettered,
            rate_limited: self.rate_limited - earlier.rate_limited,
            api_failures: self.api_failures - earlier.api_failures,
            missed_slots: self.missed_slots - earlier.missed_slots,
            calls: self.calls - earlier.calls,
            call_millis: self.call_millis - earlier.call_millis,
            slot_lag_millis: self.slot_lag_millis - earlier.slot_lag_millis,
        }
    }
}

impl WorkerStats {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn add(counter: &AtomicU64, amount: std::time::Duration) {
        counter.fetch_add(u64::try_from(amount.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The counts now.
    #[must_use]
    pub fn counts(&self) -> WorkerCounts {
        WorkerCounts {
            succeeded: Self::get(&self.succeeded),
            requeued: Self::get(&self.requeued),
            dead_lettered: Self::get(&self.dead_lettered),
            rate_limited: Self::get(&self.rate_limited),
            api_failures: Self::get(&self.outages_seen),
            missed_slots: Self::get(&self.missed_slots),
            calls: Self::get(&self.calls),
            call_millis: Self::get(&self.call_millis),
            slot_lag_millis: Self::get(&self.slot_lag_millis),
        }
    }

    /// Reads a counter.
    #[must_use]
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The third-party API as the worker calls it: [`ApiClient`] over HTTP, or a simulated
/// provider.
#[async_trait]
pub trait Api: Send + Sync {
    /// Sends one request, for job `job_id` (none for a health check); transport failures
    /// come back as [`CallResult`] values.
    ///
    /// # Errors
    /// [`ApiError::OffApi`] when the request is not for this API (nothing is sent).
    async fn call(&self, request: &ApiRequest, job_id: Option<&str>) -> Result<CallResult, ApiError>;
}

#[async_trait]
impl Api for ApiClient {
    async fn call(&self, request: &ApiRequest, job_id: Option<&str>) -> Result<CallResult, ApiError> {
        ApiClient::call(self, request, job_id).await
    }
}

/// How long something a call holds (a call slot, a claim on its call record) lasts for a
/// call timing out after `api_timeout`: that and a margin, so that a crashed worker's hold
/// frees itself soon after the call could have ended.
fn held_past(api_timeout: std::time::Duration) -> std::time::Duration {
    api_timeout + std::time::Duration::from_secs(5)
}

/// A cap on calls in flight: this many slots, each held for at most `hold_for` (the
/// API's timeout and a margin: a crashed worker's slot frees itself then).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallSlots {
    pub capacity: u32,
    pub hold_for: std::time::Duration,
}

impl CallSlots {
    /// The cap of `quota.max_in_flight` (none without one), for calls timing out after
    /// `api_timeout`.
    #[must_use]
    pub fn for_api(max_in_flight: Option<u32>, api_timeout: std::time::Duration) -> Option<Self> {
        max_in_flight.map(|capacity| Self { capacity, hold_for: held_past(api_timeout) })
    }
}

/// What a job's payload says about its call, besides the job, and its call record.
#[derive(Clone, Debug)]
struct JobCall {
    attempt: u32,
    circuit_epoch: u64,
    trip: Option<TripRule>,
    report_limits: bool,
    /// The call record claimed (none where this payload claims none).
    record: Option<String>,
    dispatched_at: UnixMillis,
    /// The pacer slot of the call (the dispatch time, for a payload sent at its slot).
    slotted: UnixMillis,
}

/// What a job's attempt came to, for its outcome record.
struct Attempted<'a> {
    /// Calls made for the job so far, this one included.
    calls: u32,
    answer: Answer<'a>,
    times: OutcomeTimes,
}

/// A job's answered call, as settling it needs it.
struct Answered<'a> {
    attempt: u32,
    circuit_epoch: u64,
    trip: Option<TripRule>,
    called_at: UnixMillis,
    /// The failure's label for dead letters (`http_503`, `timeout`...).
    failure: String,
    attempted: Attempted<'a>,
}

/// Writing what an answer calls for is retried this long while the store is busy (see
/// [`retry::while_busy`]). Past it the payload fails and is run again (Lambda's retry,
/// or the embedded invoker's re-queue): the call may repeat then, at least once being
/// all that is left.
const SETTLE_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// Who claims a call record: one delivery of `attempt` of `job`, handed off at
/// `dispatched_at` (Lambda's retry of the same event is the same holder).
pub(crate) fn call_holder(job: &Job, attempt: u32, dispatched_at: UnixMillis) -> String {
    format!("{}#{attempt}#{}", job.id.as_str(), dispatched_at.0)
}

/// A call record is kept this long after its answer: a repeated delivery within it does
/// not call again.
pub(crate) const CALL_RECORD_KEEP: std::time::Duration = std::time::Duration::from_secs(86_400);

/// A call slot held for one call (none without a cap), and who holds it.
struct HeldSlot {
    index: Option<u32>,
    holder: String,
}

/// The worker's dependencies, built once.
pub struct Worker {
    api: Arc<dyn Api>,
    queue: Arc<dyn JobQueue>,
    store: Arc<dyn StateStore>,
    /// Where a 429's cool-down is written too, when it cools every lane of the stack
    /// (`[lanes] on_429 = "stack"`).
    stack_cool_down: Option<Arc<dyn StateStore>>,
    clock: Arc<dyn Clock>,
    retry: RetryConfig,
    health_check: ApiRequest,
    stats: Arc<WorkerStats>,
    call_slots: Option<CallSlots>,
    /// A claim on a call record lasts this long past the call's slot (the API's timeout
    /// and a margin): a worker that crashed mid-call leaves a claim that expires.
    claim_for: std::time::Duration,
    /// Which payloads claim their call record first.
    call_records: CallRecords,
    outcomes: OutcomeSettings,
    /// Where outcome records are kept besides the function result (the embedded store).
    outcome_sink: Option<Arc<dyn OutcomeSink>>,
    /// Where a batch's outcome records go, a batch having no function result to carry
    /// them (on AWS, the results queue).
    batch_results: Option<Arc<dyn OutcomeSink>>,
    /// The latest circuit epoch this worker opened: a batch's job handed off under an
    /// earlier epoch does not call into the outage (see `batch.rs`).
    opened_circuit: AtomicU64,
    /// How long writing what an answer calls for is retried (see [`SETTLE_RETRY_FOR`]).
    settle_retry_for: std::time::Duration,
    /// Where a slot this worker made no call at is reported, when the orchestrator runs
    /// in this process and can give it back to its pacer.
    missed_slots: Option<Arc<MissedSlots>>,
}

/// What becomes of a call record once its call settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CallRecordEnd {
    /// Marked done: a lone job's payload (a repeated delivery then finds it done).
    MarkDone,
    /// Left claimed: a batch's call, whose batch record says it settled (one write per
    /// job instead of two).
    LeaveClaimed,
}

/// Which payloads claim their call record before calling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallRecords {
    /// Every payload: deliveries may repeat (Lambda's async events, re-sent hand-offs).
    Always,
    /// Payloads handed off ahead of their slot, where the claim cannot delay the call (an
    /// in-process invoker delivers each hand-off once).
    AheadOfSlot,
}

impl Worker {
    /// A worker calling `api`, re-queueing to `queue`, writing circuit and cool-down to
    /// `store`, with `health_check` as the request a health check makes.
    #[must_use]
    pub fn new(
        api: Arc<dyn Api>,
        queue: Arc<dyn JobQueue>,
        store: Arc<dyn StateStore>,
        clock: Arc<dyn Clock>,
        retry: RetryConfig,
        health_check: ApiRequest,
    ) -> Self {
        Self {
            api,
            queue,
            store,
            stack_cool_down: None,
            clock,
            retry,
            health_check,
            stats: Arc::default(),
            call_slots: None,
            claim_for: held_past(std::time::Duration::from_secs(30)),
            call_records: CallRecords::Always,
            outcomes: OutcomeSettings::default(),
            outcome_sink: None,
            batch_results: None,
            opened_circuit: AtomicU64::new(0),
            settle_retry_for: SETTLE_RETRY_FOR,
            missed_slots: None,
        }
    }

    /// The same worker recording outcomes as `settings` say, into `sink` too if given.
    #[must_use]
    pub fn with_outcomes(self, settings: OutcomeSettings, sink: Option<Arc<dyn OutcomeSink>>) -> Self {
        Self { outcomes: settings, outcome_sink: sink, ..self }
    }

    /// The same worker sending the outcome records of a batch's jobs to `results`.
    #[must_use]
    pub fn with_batch_results(self, results: Arc<dyn OutcomeSink>) -> Self {
        Self { batch_results: Some(results), ..self }
    }

    /// The same worker claiming call records for `which` payloads.
    #[must_use]
    pub fn with_call_records(self, which: CallRecords) -> Self {
        Self { call_records: which, ..self }
    }

    /// The same worker for an API whose calls time out after `timeout` (how long a claim
    /// on a call lasts past its slot: the timeout and 5 s).
    #[must_use]
    pub fn with_api_timeout(self, timeout: std::time::Duration) -> Self {
        Self { claim_for: held_past(timeout), ..self }
    }

    /// The same worker holding one of `call_slots` for each call.
    #[must_use]
    pub fn with_call_slots(self, call_slots: Option<CallSlots>) -> Self {
        Self { call_slots, ..self }
    }

    /// The same worker reporting the slots it makes no call at to `missed` (shared with
    /// an orchestrator in this process, which gives them back to its pacer).
    #[must_use]
    pub fn with_missed_slots(self, missed: Arc<MissedSlots>) -> Self {
        Self { missed_slots: Some(missed), ..self }
    }

    /// The same worker cooling every lane of the stack on a 429: the cool-down goes to
    /// `stack` (the stack's state) as well as to its lane's.
    #[must_use]
    pub fn with_stack_cool_down(self, stack: Arc<dyn StateStore>) -> Self {
        Self { stack_cool_down: Some(stack), ..self }
    }

    /// What this worker counted.
    #[must_use]
    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// The same worker counting its outcomes into `stats` (shared with a progress view).
    #[must_use]
    pub fn with_stats(self, stats: Arc<WorkerStats>) -> Self {
        Self { stats, ..self }
    }

    #[tracing::instrument(skip_all, fields(job_id = %job.id, attempt = call.attempt))]
    async fn run_job(&self, job: &Job, call: JobCall, held: HeldSlot) -> PortResult<Option<OutcomeRecord>> {
        let record = call.record.clone();
        let settled = self.call_and_settle(job, call, held).await;
        // Done only once what the answer calls for is written (its outcome record too):
        // if that failed, Lambda retries the event and, the claim expired, the job calls
        // again rather than being lost.
        if let (Ok(_), Some(record)) = (&settled, &record) {
            if let Err(e) = self.store.finish_call(record, self.clock.now().plus(CALL_RECORD_KEEP)).await {
                // The claim then expires: a repeated delivery after that may call again.
                warn!(error = %e, "could not mark the call done");
            }
        }
        settled
    }

    /// Calls the API for the job and does what the answer calls for.
    async fn call_and_settle(&self, job: &Job, call: JobCall, held: HeldSlot) -> PortResult<Option<OutcomeRecord>> {
        let JobCall { attempt, circuit_epoch, trip, report_limits, dispatched_at, slotted, .. } = call;
        let mut times = OutcomeTimes { enqueued: job.enqueued_at, dispatched: Some(dispatched_at), slotted: Some(slotted), called: None, answered: None };
        let called_at = self.clock.now();
        let result = self.api.call(&job.request, Some(job.id.as_str())).await;
        self.release_call_slot(held).await;
        let result = match result {
            Ok(result) => result,
            Err(e) => {
                // A request that cannot be built or sent is the job's fault, never the
                // API's: nothing was sent, the circuit is untouched.
                let nothing_sent = Attempted { calls: attempt, answer: Answer::default(), times };
                return self.dead_letter(job, attempt, DeadLetterCause::Malformed, e.to_string(), &nothing_sent).await;
            }
        };
        self.record_provider_reading(&result, called_at, report_limits).await;
        let now = self.clock.now();
        (times.called, times.answered) = (Some(called_at), Some(now));
        WorkerStats::bump(&self.stats.calls);
        WorkerStats::add(&self.stats.call_millis, now.since(called_at));
        WorkerStats::add(&self.stats.slot_lag_millis, called_at.since(slotted));
        let attempted = Attempted { calls: attempt + 1, answer: answer_of(&result), times };
        let outcome = classify(&result, now, &self.retry);
        match &outcome {
            Outcome::Success { status } => {
                WorkerStats::bump(&self.stats.succeeded);
                info!(status, "succeeded");
            }
            Outcome::RateLimited { until } => {
                WorkerStats::bump(&self.stats.rate_limited);
                warn!(cool_down_until = %until, "rate limited by the API; cooling down");
            }
            Outcome::Outage { .. } => WorkerStats::bump(&self.stats.outages_seen),
            Outcome::Rejected { .. } => {}
        }
        // The call is made: what its answer calls for is written even through a store
        // that is busy for a while (another process holding SQLite's lock), since a
        // payload that failed now would run again and call the API a second time.
        let answered = Answered { attempt, circuit_epoch, trip, called_at, failure: failure_label(&result), attempted };
        let give_up_at = Some(now.plus(self.settle_retry_for));
        retry::while_busy(self.clock.as_ref(), give_up_at, "could not write what the answer calls for", || self.settle(job, &outcome, &answered)).await
    }

    /// Does what `outcome`, the answer to the job's call, calls for: keep its outcome;
    /// cool down and re-queue; count a failure and re-queue (opening the circuit past the
    /// threshold); or dead-letter.
    async fn settle(&self, job: &Job, outcome: &Outcome, answered: &Answered<'_>) -> PortResult<Option<OutcomeRecord>> {
        let Answered { attempt, circuit_epoch, trip, called_at, ref failure, ref attempted } = *answered;
        let failure = failure.clone();
        match outcome {
            Outcome::Success { .. } => {
                let record = self.keep_outcome(job, Ending::Succeeded, attempted, None).await?;
                self.mark_order(job, attempt, OrderState::Settled { at: self.clock.now() }).await?;
                Ok(record)
            }
            Outcome::RateLimited { until } => {
                self.store.extend_cool_down(*until).await?;
                if let Some(stack) = &self.stack_cool_down {
                    stack.extend_cool_down(*until).await?;
                }
                self.retry_after_429(job, attempt, failure, attempted).await
            }
            Outcome::Outage { reason } => {
                if self.failure_trips(trip, called_at).await? {
                    warn!(%reason, "failures passed the threshold; opening the circuit");
                    self.transition_circuit(|c, now| c.open(circuit_epoch, reason, now)).await?;
                } else {
                    info!(%reason, "API failure under the threshold; this job alone is retried");
                }
                let delay = retry_delay(job.id.as_str(), attempt + 1, self.retry.backoff_base, self.retry.backoff_max);
                self.retry_after_failure(job, attempt, reason, failure, delay, attempted).await
            }
            Outcome::Rejected { status } => {
                self.dead_letter(job, attempt, DeadLetterCause::Rejected { status: *status }, format!("the API answered HTTP {status}"), attempted).await
            }
        }
    }

    /// The outcome record of `job` ending as `ending`, if the lane and the job want one
    /// (`reason`: why it went to the DLQ or failed).
    fn outcome(&self, job: &Job, ending: Ending, attempted: &Attempted<'_>, reason: Option<String>) -> Option<OutcomeRecord> {
        if !self.outcomes.records(job, ending) {
            return None;
        }
        let record = OutcomeRecord::new(job, ending, attempted.calls, &attempted.answer, &self.outcomes.headers, attempted.times.clone());
        Some(match reason {
            Some(reason) => record.because(reason),
            None => record,
        })
    }

    /// Writes `job`'s outcome (if it gets one) to the sink, and returns it.
    async fn keep_outcome(&self, job: &Job, ending: Ending, attempted: &Attempted<'_>, reason: Option<String>) -> PortResult<Option<OutcomeRecord>> {
        let record = self.outcome(job, ending, attempted, reason);
        self.sink(record).await
    }

    async fn sink(&self, record: Option<OutcomeRecord>) -> PortResult<Option<OutcomeRecord>> {
        if let (Some(sink), Some(record)) = (&self.outcome_sink, &record) {
            sink.record_outcome(record).await?;
        }
        Ok(record)
    }

    async fn run_health_check(&self, circuit_epoch: u64, held: HeldSlot) -> PortResult<()> {
        let result = self.api.call(&self.health_check, None).await.unwrap_or(CallResult::Connect("health check is off the API".into()));
        self.release_call_slot(held).await;
        match classify(&result, self.clock.now(), &self.retry) {
            Outcome::Success { status } => {
                WorkerStats::bump(&self.stats.health_checks_ok);
                info!(status, circuit_epoch, "health check ok; half-opening the circuit");
                self.transition_circuit(|c, now| c.half_open(circuit_epoch, "health check ok", now)).await
            }
            other => {
                WorkerStats::bump(&self.stats.health_checks_failed);
                info!(outcome = ?other, circuit_epoch, "health check failed; the circuit stays open");
                Ok(())
            }
        }
    }

    /// Applies a circuit transition with compare-and-swap; a lost race re-reads and
    /// decides again. A refusal (already there, stale writer) is not an error.
    async fn transition_circuit(&self, transition: impl Fn(&Circuit, UnixMillis) -> Result<Circuit, Refusal>) -> PortResult<()> {
        for _ in 0..3 {
            let current = self.store.circuit().await?;
            let next = match transition(&current, self.clock.now()) {
                Ok(next) => next,
                Err(refusal) => {
                    info!(%refusal, "circuit unchanged");
                    return Ok(());
                }
            };
            match self.store.swap_circuit(current.epoch, &next).await {
                Ok(()) => {
                    if next.status == paceline_shared::breaker::CircuitStatus::Open {
                        self.opened_circuit.fetch_max(next.epoch, Ordering::Relaxed);
                    }
                    let counter = if next.is_closed() { &self.stats.circuit_closed } else { &self.stats.circuit_opened };
                    WorkerStats::bump(counter);
                    info!(status = %next.status, epoch = next.epoch, reason = %next.reason, "circuit changed");
                    return Ok(());
                }
                Err(PortError::Conflict(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(PortError::Transient("circuit kept changing under us".into()))
    }

    /// Under a cap on calls in flight, a payload dispatched ahead of its pacer slot
    /// takes its call slot this long before it, so that the store's latency never
    /// delays the call past its pacer slot.
    const CALL_SLOT_LEAD: std::time::Duration = std::time::Duration::from_millis(50);

    /// Takes a call slot for `holder` before the call: a `HeldSlot` of none without a cap,
    /// `None` when every slot is held (the payload's pacer slot, if any, is waited for up
    /// to `CALL_SLOT_LEAD` first).
    async fn take_call_slot(&self, holder: String, slot: Option<CallSlot>) -> PortResult<Option<HeldSlot>> {
        let Some(slots) = self.call_slots else { return Ok(Some(HeldSlot { index: None, holder })) };
        if let Some(slot) = slot {
            self.clock.sleep_until(slot.not_before.minus(Self::CALL_SLOT_LEAD)).await;
        }
        let now = self.clock.now();
        let taken = self.store.take_call_slot(slots.capacity, &holder, now, now.plus(slots.hold_for)).await?;
        Ok(taken.map(|index| HeldSlot { index: Some(index), holder }))
    }

    /// Gives a call slot back. A failure is only logged: the slot frees itself at its
    /// expiry, and failing the payload would make Lambda call again.
    async fn release_call_slot(&self, held: HeldSlot) {
        if let Some(index) = held.index {
            if let Err(e) = self.store.release_call_slot(index, &held.holder).await {
                warn!(error = %e, index, "could not give the call slot back; it frees itself at its expiry");
            }
        }
    }

    /// Every call slot was held: the job goes back on the queue without a call, and the
    /// store counts it (the orchestrator's model of the slots learns from it).
    async fn turned_away(&self, job: &Job, attempt: u32) -> PortResult<Option<OutcomeRecord>> {
        WorkerStats::bump(&self.stats.call_slots_full);
        info!(job_id = %job.id, "every call slot is held; the job goes back on the queue without a call");
        self.store.add_usage(&[(CALL_SLOTS_FULL_KEY.to_owned(), 1)]).await?;
        let delay = retry_delay(job.id.as_str(), 0, CALL_SLOT_RETRY, CALL_SLOT_RETRY);
        self.requeue_unattempted(job, attempt, delay).await?;
        Ok(None)
    }

    /// Records what the answer's rate-limit headers say (if anything) when the
    /// orchestrator asked for it, or on a 429. A failure is only logged: the reading is
    /// advice, and the next one comes soon.
    async fn record_provider_reading(&self, result: &CallResult, called_at: UnixMillis, asked: bool) {
        let CallResult::Response { status, headers, .. } = result else { return };
        if !asked && *status != 429 {
            return;
        }
        // Its reset capped as every cool-down is: no reading stalls the lane for longer.
        let Some(reading) = provider_reading(headers, called_at).map(|r| r.with_reset_capped(self.retry.max_cool_down)) else { return };
        if let Err(e) = self.store.record_provider_reading(&reading).await {
            warn!(error = %e, "could not record the provider's rate-limit reading");
        }
    }

    /// Counts a failed call made at `called_at` in its bucket and says whether the
    /// failures of that bucket and the one before reach the rule's threshold. A payload
    /// without a rule (written before rules existed) trips at once.
    async fn failure_trips(&self, trip: Option<TripRule>, called_at: UnixMillis) -> PortResult<bool> {
        let Some(rule) = trip else { return Ok(true) };
        let keys = rule.bucket_keys(called_at);
        self.store.add_usage(&[(keys[0].clone(), 1)]).await?;
        let failed: u64 = self.store.load_usage(&keys).await?.iter().sum();
        Ok(rule.trips(failed))
    }

    /// Re-queues the job with one more attempt after `delay`, or dead-letters it if that
    /// was its `retry.max_attempts`th failed call (429s are not failures).
    async fn retry_after_failure(
        &self,
        job: &Job,
        attempt: u32,
        reason: &str,
        failure: String,
        delay: std::time::Duration,
        attempted: &Attempted<'_>,
    ) -> PortResult<Option<OutcomeRecord>> {
        let failed = (attempt + 1).saturating_sub(job.rate_limited);
        if failed >= self.retry.max_attempts {
            let answered_429 = match job.rate_limited {
                0 => String::new(),
                n => format!(" (and {n} answered 429)"),
            };
            let detail = format!("gave up after {failed} failed calls{answered_429}; last: {reason}");
            let cause = DeadLetterCause::AttemptsExhausted { last_failure: Some(failure) };
            return self.dead_letter(job, attempt, cause, detail, attempted).await;
        }
        self.requeue_called(job, attempt, delay, reason, attempted).await
    }

    /// Re-queues a job the API answered 429 ("not now": its attempts toward
    /// `retry.max_attempts` are untouched), or dead-letters it at `retry.max_rate_limited`
    /// such answers. The cool-down holds the whole lane, so it may go as soon as it ends.
    async fn retry_after_429(&self, job: &Job, attempt: u32, failure: String, attempted: &Attempted<'_>) -> PortResult<Option<OutcomeRecord>> {
        let job = Job { rate_limited: job.rate_limited + 1, ..job.clone() };
        if job.rate_limited >= self.retry.max_rate_limited {
            let detail = format!(
                "gave up after the API answered 429 to {} calls (retry.max_rate_limited): the configured quota is likely above the API's",
                job.rate_limited
            );
            let cause = DeadLetterCause::AttemptsExhausted { last_failure: Some(failure) };
            return self.dead_letter(&job, attempt, cause, detail, attempted).await;
        }
        self.requeue_called(&job, attempt, std::time::Duration::ZERO, "HTTP 429", attempted).await
    }

    /// Puts a job whose call was made back on the queue as its next attempt, after `delay`.
    async fn requeue_called(
        &self,
        job: &Job,
        attempt: u32,
        delay: std::time::Duration,
        reason: &str,
        attempted: &Attempted<'_>,
    ) -> PortResult<Option<OutcomeRecord>> {
        self.send_back(job, attempt, attempt + 1, delay).await?;
        self.keep_outcome(job, Ending::Retrying, attempted, Some(format!("retrying after {reason}"))).await
    }

    /// The call record a payload for `attempt` of `job` with `slot` claims, if any.
    fn call_record(&self, job: &Job, attempt: u32, slot: Option<CallSlot>) -> Option<String> {
        let claims = match self.call_records {
            CallRecords::Always => true,
            CallRecords::AheadOfSlot => slot.is_some(),
        };
        claims.then(|| call_record_key(job.id.as_str(), attempt))
    }

    /// Claims the call of `attempt` of `job` (record `record`) for `holder`, until the
    /// slot's last moment and the API's timeout. `false` when this delivery repeats one
    /// whose call is done (nothing more to do).
    ///
    /// # Errors
    /// `Transient` when another delivery is calling (or crashed while calling and its
    /// claim has not expired): retried later, it finds the call done or the claim free.
    async fn claim_call(&self, record: &str, holder: &str, slot: Option<CallSlot>, job: &Job, attempt: u32) -> PortResult<bool> {
        let now = self.clock.now();
        let until = slot.map_or(now, |slot| slot.call_by.max(now)).plus(self.claim_for);
        match self.store.claim_call(record, holder, now, until).await? {
            CallClaim::Taken => Ok(true),
            CallClaim::Done => {
                WorkerStats::bump(&self.stats.repeats_skipped);
                info!(job_id = %job.id, attempt, "a repeated delivery of an attempt already called: not calling again");
                Ok(false)
            }
            CallClaim::Calling | CallClaim::ClaimedBefore => {
                Err(PortError::Transient(format!("another delivery of job {} attempt {attempt} is calling the API", job.id)))
            }
        }
    }

    /// Gives up `holder`'s claim on `record` (if it took one): no call was made.
    async fn release_call(&self, record: Option<&str>, holder: &str) -> PortResult<()> {
        match record {
            Some(record) => self.store.release_call(record, holder).await,
            None => Ok(()),
        }
    }

    /// Takes a call slot, waits for the job's pacer slot and calls, then does what the
    /// answer calls for; the call record `call.record` (claimed by `holder`) is marked
    /// done after or not as `end` says. A job that finds every call slot held, or whose
    /// pacer slot passed, goes back on the queue without a call (its claim given up).
    async fn call_in_slot(&self, job: &Job, call: JobCall, slot: Option<CallSlot>, holder: String, end: CallRecordEnd) -> PortResult<Option<OutcomeRecord>> {
        let Some(held) = self.take_call_slot(holder.clone(), slot).await? else {
            self.release_call(call.record.as_deref(), &holder).await?;
            return self.turned_away(job, call.attempt).await;
        };
        if let Err(late) = self.wait_for_slot(slot).await {
            if let (Some(missed), Some(slot)) = (&self.missed_slots, slot) {
                missed.push(MissedSlot {
                    slot: slot.not_before,
                    arrival: slot.not_before.plus(job.request.upload_allowance()),
                    cost: job.cost,
                    lane: job.lane.clone(),
                });
            }
            self.release_call_slot(held).await;
            self.release_call(call.record.as_deref(), &holder).await?;
            let Some(again) = job.clone().after_late_start(late) else {
                // Its workers start later than the most lead a stack takes: put back, it
                // would miss its slot for ever.
                let DeadLetterReason { cause, detail, .. } = DeadLetterReason::late_start(job, late);
                let times =
                    OutcomeTimes { enqueued: job.enqueued_at, dispatched: Some(call.dispatched_at), slotted: Some(call.slotted), called: None, answered: None };
                let nothing_called = Attempted { calls: call.attempt.saturating_sub(1), answer: Answer::default(), times };
                return self.dead_letter(job, call.attempt, cause, detail, &nothing_called).await;
            };
            // Handed off earlier next time, and every job with it (see `Job::late_start_ms`).
            self.requeue_unattempted(&again, call.attempt, std::time::Duration::ZERO).await?;
            return Ok(None);
        }
        if end == CallRecordEnd::LeaveClaimed && call.circuit_epoch < self.opened_circuit.load(Ordering::Relaxed) {
            // Handed off before this worker opened the circuit: no call into the outage.
            WorkerStats::bump(&self.stats.held_by_circuit);
            self.release_call_slot(held).await;
            self.release_call(call.record.as_deref(), &holder).await?;
            self.requeue_unattempted(job, call.attempt, std::time::Duration::ZERO).await?;
            return Ok(None);
        }
        let call = JobCall { slotted: slot.map_or(call.dispatched_at, |slot| slot.not_before), ..call };
        match end {
            CallRecordEnd::MarkDone => self.run_job(job, call, held).await,
            CallRecordEnd::LeaveClaimed => self.call_and_settle(job, call, held).await,
        }
    }

    /// Waits for the payload's slot, if it has one. `Err(late)` when the slot was missed
    /// by `late`.
    async fn wait_for_slot(&self, slot: Option<CallSlot>) -> Result<(), std::time::Duration> {
        let Some(slot) = slot else { return Ok(()) };
        let coming = calls_coming().waiting_for(slot.not_before);
        self.clock.sleep_until(slot.not_before).await;
        drop(coming);
        let now = self.clock.now();
        if now > slot.call_by {
            WorkerStats::bump(&self.stats.missed_slots);
            warn!(late_ms = now.since(slot.call_by).as_millis(), "started after its slot; not calling");
            return Err(now.since(slot.call_by));
        }
        Ok(())
    }

    /// Puts a job that made no call back on the queue after `delay`; the attempt does not
    /// count.
    async fn requeue_unattempted(&self, job: &Job, attempt: u32, delay: std::time::Duration) -> PortResult<()> {
        self.send_back(job, attempt, attempt, delay).await
    }

    /// Puts `job`, handed off as `dispatched`, back on the queue as `attempt` after
    /// `delay`. An ordered lane's job goes ahead of the lane's later jobs, and the lane's
    /// order mark then says it is coming back, and when.
    async fn send_back(&self, job: &Job, dispatched: u32, attempt: u32, delay: std::time::Duration) -> PortResult<()> {
        let message = OutgoingMessage { ahead: job.ordered, ..OutgoingMessage::again(job.to_json(), attempt, delay) };
        self.queue.send(&[message]).await?;
        WorkerStats::bump(&self.stats.requeued);
        self.mark_order(job, dispatched, OrderState::Retrying { at: self.clock.now().plus(delay) }).await
    }

    /// Sets the order mark of an ordered lane's job handed off as `attempt` (nothing
    /// for a job of a lane without ordering): its lane's next call waits for this.
    async fn mark_order(&self, job: &Job, attempt: u32, state: OrderState) -> PortResult<()> {
        if job.ordered && !self.store.settle_order(job.id.as_str(), attempt, state).await? {
            info!(job_id = %job.id, attempt, "the lane's order mark names another attempt: this one was settled before");
        }
        Ok(())
    }

    /// Moves the job to the DLQ with its reason and its outcome record, which it returns.
    async fn dead_letter(
        &self,
        job: &Job,
        attempt: u32,
        cause: DeadLetterCause,
        detail: String,
        attempted: &Attempted<'_>,
    ) -> PortResult<Option<OutcomeRecord>> {
        warn!(cause = %cause.label(), %detail, "dead-lettered");
        let mut reason = DeadLetterReason { cause, detail, outcome: None };
        let record = self.outcome(job, Ending::DeadLettered, attempted, Some(OutcomeRecord::dead_letter_reason(&reason)));
        reason.outcome = record.clone().map(Box::new);
        self.queue.dead_letter(job.id.as_str(), &job.to_json(), attempt, &reason).await?;
        WorkerStats::bump(&self.stats.dead_lettered);
        let record = self.sink(record).await?;
        self.mark_order(job, attempt, OrderState::Settled { at: self.clock.now() }).await?;
        Ok(record)
    }
}

#[async_trait]
impl WorkerHandler for Worker {
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        match payload {
            WorkerPayload::Batch { ref id, .. } => self.run_batch(id, &payload).await,
            one => self.handle_one(one).await,
        }
    }
}

impl Worker {
    /// Runs a job's or a health check's payload.
    async fn handle_one(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        match payload {
            WorkerPayload::Job { job, attempt, circuit_epoch, slot, trip, dispatched_at, report_limits } => {
                let holder = call_holder(&job, attempt, dispatched_at);
                let record = self.call_record(&job, attempt, slot);
                if let Some(record) = &record {
                    if !self.claim_call(record, &holder, slot, &job, attempt).await? {
                        return Ok(None);
                    }
                }
                let call = JobCall { attempt, circuit_epoch, trip, report_limits, record, dispatched_at, slotted: dispatched_at };
                self.call_in_slot(&job, call, slot, holder, CallRecordEnd::MarkDone).await
            }
            WorkerPayload::HealthCheck { circuit_epoch, slot, sent_at, .. } => {
                // A health check that is missed or finds no call slot is simply not made:
                // the orchestrator sends another.
                let holder = format!("health-check#{circuit_epoch}#{}", sent_at.0);
                let Some(held) = self.take_call_slot(holder, slot).await? else {
                    info!("every call slot is held; no health check this time");
                    return Ok(None);
                };
                if self.wait_for_slot(slot).await.is_ok() {
                    self.run_health_check(circuit_epoch, held).await?;
                } else {
                    self.release_call_slot(held).await;
                }
                Ok(None)
            }
            WorkerPayload::Batch { .. } => Err(PortError::Fatal("a batch inside a batch".into())),
        }
    }
}

/// The answer as an outcome record sees it (no answer for a timeout or a dead
/// connection).
fn answer_of(result: &CallResult) -> Answer<'_> {
    match result {
        CallResult::Response { status, headers, body } => Answer { status: Some(*status), headers, body: Some(body) },
        CallResult::Timeout | CallResult::Connect(_) => Answer::default(),
    }
}

#[cfg(test)]
mod tests;
