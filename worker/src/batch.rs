//! A batch: many jobs' calls carried by one worker invocation. Each call waits for its
//! own slot and the calls overlap in one execution instead of taking one execution each;
//! each settles alone, exactly as a payload of one job would (its outcome record,
//! re-queue, back-off, dead letter, circuit and cool-down signals). An entry that cannot
//! be read is dead-lettered alone with its reason and the others are called.
//!
//! One DynamoDB write per job. A lone job's call record is claimed, then marked done; a
//! batch's calls are claimed only (by the batch, just before each slot), and the batch's
//! own record says which of them settled: one delivery claims the batch, saves its
//! progress each time another 50 calls settled, and marks it done at the end. So:
//! - a repeated delivery of a done batch does nothing, and one that comes while another
//!   runs it fails, for Lambda to retry later, as a lone job's does;
//! - a delivery that takes over from one that stopped (a crash, a timeout, a write that
//!   failed) skips the calls that settled, calls those never claimed whose slots are
//!   still ahead (the others go back on the queue without a call), and dead-letters the
//!   few claimed since the last save with reason `call_in_doubt`: they may have been
//!   made, and no call is made twice;
//! - a job another payload holds (handed off twice after a lost answer from Lambda) is
//!   left to that payload.
//!
//! A batch has no function result of its own to carry the jobs' outcome records, so each
//! goes to the results sink (on AWS, the results queue) once its call settled.

use std::collections::BTreeSet;
use std::hash::{BuildHasher as _, Hasher as _};
use std::sync::Mutex;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt as _};
use paceline_shared::job::{DeadLetterCause, DeadLetterReason, Job, JobId, UnreadableCall, WorkerPayload};
use paceline_shared::outcome::{Answer, OutcomeRecord, OutcomeTimes};
use paceline_shared::ports::{batch_record_key, call_record_key, BatchClaim, BatchProgress, CallClaim, PortError, PortResult};
use paceline_shared::time::UnixMillis;
use tracing::{info, warn};

use crate::{Attempted, CallRecordEnd, JobCall, Worker, WorkerStats, CALL_RECORD_KEEP};

/// How often a running batch looks whether to save which of its calls settled.
pub const BATCH_PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// A batch saves its progress once this many more of its calls settled: a delivery that
/// stops leaves at most these in doubt, beside those in flight, and the saves cost at most
/// one write per this many jobs.
pub const SAVE_AFTER_SETTLED: usize = 50;

/// A batch's call claims its record this long before its slot: the claim's write never
/// delays the call, and a crash leaves few claims whose call was not made.
const CLAIM_LEAD: Duration = Duration::from_millis(50);

/// Where a batch's run stands, shared by its calls.
struct Run {
    progress: Mutex<BatchProgress>,
    /// Calls settled by earlier deliveries.
    settled_before: BTreeSet<u32>,
    /// The batch's id: the holder of its calls' claims, the same in every delivery.
    id: String,
}

impl Run {
    fn settled(&self, index: u32) {
        self.progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner).settled.insert(index);
    }

    fn progress(&self) -> BatchProgress {
        self.progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// A name no other delivery of the batch has: its id, the time and a random number.
fn delivery_name(batch: &str, now: UnixMillis) -> String {
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    format!("{batch}@{}#{random:016x}", now.0)
}

impl Worker {
    /// Runs batch `id` (`payload`): claims it, runs its calls at their slots, saves its
    /// progress, sends each job's outcome record to the results sink.
    pub(crate) async fn run_batch(&self, id: &str, payload: &WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        let mut calls = payload.batch_calls();
        if let [Ok(_)] = calls.as_slice() {
            // A batch of one is a lone job's payload: its call record marked done after
            // the call, as two writes cost no more than a claim and a batch record.
            let Some(Ok(lone)) = calls.pop() else { unreachable!() };
            let record = Box::pin(self.handle_one(lone)).await?;
            return self.send_results(record.into_iter().collect()).await;
        }
        let now = self.clock.now();
        let last_slot = calls.iter().flatten().filter_map(|call| match call {
            WorkerPayload::Job { slot: Some(slot), .. } => Some(slot.call_by),
            _ => None,
        });
        // The claim outlasts the batch's last possible call.
        let runs_until = last_slot.max().unwrap_or(now).max(now).plus(self.claim_for);
        let (key, delivery) = (batch_record_key(id), delivery_name(id, now));
        let before = match self.store.claim_batch(&key, &delivery, now, runs_until).await? {
            BatchClaim::Done => {
                info!(batch = %id, "a repeated delivery of a batch already done: nothing to do");
                self.stats.repeats_skipped.fetch_add(payload.job_count() as u64, std::sync::atomic::Ordering::Relaxed);
                return Ok(None);
            }
            BatchClaim::Running => return Err(PortError::Transient(format!("another delivery of batch {id} runs it"))),
            BatchClaim::Taken { before } => before,
        };
        if let Some(before) = &before {
            warn!(batch = %id, settled = before.settled.len(), "taking over a batch whose earlier delivery stopped");
        }
        let settled_before = before.map(|b| b.settled).unwrap_or_default();
        let run = Run { progress: Mutex::new(BatchProgress { settled: settled_before.clone(), done: false }), settled_before, id: id.to_owned() };
        let running: FuturesUnordered<_> =
            calls.into_iter().enumerate().map(|(index, call)| self.batch_call(u32::try_from(index).unwrap_or(u32::MAX), call, &run)).collect();
        // The calls and the saves of their progress run side by side in this task: a save
        // never holds a call back from its slot, and the saving stops as the calls end (a
        // save under way finishes first: none lands after the last).
        let ended = tokio::sync::Notify::new();
        let calls_ended = async {
            let ended_calls: Vec<PortResult<Option<OutcomeRecord>>> = running.collect().await;
            ended.notify_one();
            ended_calls
        };
        let saving = async {
            let mut saved = run.progress().settled.len();
            loop {
                tokio::select! {
                    biased;
                    () = ended.notified() => return,
                    () = self.clock.sleep_until(self.clock.now().plus(BATCH_PROGRESS_EVERY)) => {}
                }
                let progress = run.progress();
                if progress.settled.len() >= saved + SAVE_AFTER_SETTLED {
                    self.save_progress(&key, &delivery, &progress, runs_until).await;
                    saved = progress.settled.len();
                }
            }
        };
        let (ended_calls, ()) = tokio::join!(calls_ended, saving);
        let (mut failed, mut records) = (None::<PortError>, Vec::new());
        for ended in ended_calls {
            match ended {
                Ok(record) => records.extend(record),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        let mut progress = run.progress();
        progress.done = failed.is_none();
        // Every call is over: a delivery that failed frees the batch at once for Lambda's
        // retry, which takes over from this progress.
        let now = self.clock.now();
        let keep = if progress.done { now.plus(CALL_RECORD_KEEP) } else { now };
        if let Err(e) = self.store.save_batch(&key, &delivery, &progress, keep).await {
            failed.get_or_insert(e);
        }
        info!(batch = %id, calls = payload.job_count(), settled = progress.settled.len(), done = progress.done, "batch ended");
        let sent = self.send_results(records).await;
        failed.map_or(sent, Err)
    }

    /// Sends a batch's outcome records to the results sink, if there is one.
    async fn send_results(&self, records: Vec<OutcomeRecord>) -> PortResult<Option<OutcomeRecord>> {
        match &self.batch_results {
            Some(results) if !records.is_empty() => results.record_outcomes(&records).await?,
            None if !records.is_empty() => warn!(records = records.len(), "a batch's outcome records have nowhere to go: set PACELINE_RESULTS_QUEUE_URL"),
            _ => {}
        }
        Ok(None)
    }

    /// Saves a batch's progress; a failure is only logged (the next save, or the last,
    /// says as much).
    async fn save_progress(&self, key: &str, delivery: &str, progress: &BatchProgress, runs_until: UnixMillis) {
        if let Err(e) = self.store.save_batch(key, delivery, progress, runs_until).await {
            warn!(error = %e, batch_record = key, "could not save the batch's progress");
        }
    }

    /// Runs call `index` of the batch: skips it if an earlier delivery settled it,
    /// dead-letters it if it is no job's payload or its call is in doubt, and otherwise
    /// claims it just before its slot, calls and settles it.
    async fn batch_call(&self, index: u32, call: Result<WorkerPayload, UnreadableCall>, run: &Run) -> PortResult<Option<OutcomeRecord>> {
        if run.settled_before.contains(&index) {
            return Ok(None);
        }
        let ended = match call {
            Err(unreadable) => self.dead_letter_unreadable(&run.id, index, unreadable).await.map(|()| None),
            Ok(WorkerPayload::Job { job, attempt, circuit_epoch, slot, trip, dispatched_at, report_limits }) => {
                if let Some(slot) = slot {
                    self.clock.sleep_until(slot.not_before.minus(CLAIM_LEAD)).await;
                }
                let record = call_record_key(job.id.as_str(), attempt);
                let now = self.clock.now();
                let claimed = match self.store.claim_call(&record, &run.id, now, now.plus(CALL_RECORD_KEEP)).await {
                    Ok(claimed) => claimed,
                    Err(e) => {
                        // No claim, no call: the job goes again rather than failing its batch.
                        warn!(error = %e, job_id = %job.id, "could not claim the call; the job goes back on the queue without a call");
                        self.requeue_unattempted(&job, attempt, std::time::Duration::ZERO).await?;
                        run.settled(index);
                        return Ok(None);
                    }
                };
                match claimed {
                    CallClaim::Taken => {
                        let call = JobCall { attempt, circuit_epoch, trip, report_limits, record: Some(record), dispatched_at, slotted: dispatched_at };
                        self.call_in_slot(&job, call, slot, run.id.clone(), CallRecordEnd::LeaveClaimed).await
                    }
                    CallClaim::Done | CallClaim::Calling => {
                        WorkerStats::bump(&self.stats.repeats_skipped);
                        info!(job_id = %job.id, attempt, batch = %run.id, "another payload holds this attempt's call: not calling");
                        Ok(None)
                    }
                    CallClaim::ClaimedBefore => self.dead_letter_in_doubt(&job, attempt, &run.id).await,
                }
            }
            Ok(_) => unreachable!("a batch's calls are job payloads (see WorkerPayload::batch_calls)"),
        };
        if ended.is_ok() {
            run.settled(index);
        }
        ended
    }

    /// An earlier delivery of batch `batch` claimed this call and stopped before saying
    /// it settled: the job goes to the DLQ rather than risk a second call.
    async fn dead_letter_in_doubt(&self, job: &Job, attempt: u32, batch: &str) -> PortResult<Option<OutcomeRecord>> {
        let detail = format!(
            "an earlier delivery of batch {batch} claimed this call and stopped before it recorded the answer: the call may have been made \
             (check the API before a redrive, which calls it again)"
        );
        let attempted = Attempted { calls: attempt, answer: Answer::default(), times: OutcomeTimes { enqueued: job.enqueued_at, ..OutcomeTimes::default() } };
        self.dead_letter(job, attempt, DeadLetterCause::CallInDoubt, detail, &attempted).await
    }

    /// Dead-letters entry `index` of batch `batch`, which is no job's payload.
    async fn dead_letter_unreadable(&self, batch: &str, index: u32, unreadable: UnreadableCall) -> PortResult<()> {
        let entry = &unreadable.entry;
        let body = entry.get("job").and_then(serde_json::Value::as_str).map_or_else(|| entry.to_string(), str::to_owned);
        let message_id = JobId::named_in(&body).map_or_else(|| format!("{batch}#{index}"), |id| id.as_str().to_owned());
        let attempt = entry.get("attempt").and_then(serde_json::Value::as_u64).and_then(|a| u32::try_from(a).ok()).unwrap_or(0);
        let detail = format!("entry {index} of batch {batch} is not a job's payload: {}", unreadable.problem);
        warn!(%message_id, %detail, "dead-lettered");
        let reason = DeadLetterReason { cause: DeadLetterCause::Malformed, detail, outcome: None };
        self.queue.dead_letter(&message_id, &body, attempt, &reason).await?;
        WorkerStats::bump(&self.stats.dead_lettered);
        Ok(())
    }
}
