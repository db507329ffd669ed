//! The ports the orchestrator and worker talk through: the job queue (with its DLQ), the
//! state store (lease, quota usage, pacer snapshot, circuit, cool-down) and the invoker;
//! and the dead-letter queues as the operator commands read them.
//! Adapters: `adapters::embedded` (SQLite, for `paceline run` and tests), the AWS
//! adapters (SQS, DynamoDB, Lambda) and the simulator's; `adapters::memory` has test
//! doubles (feature `test-util`).
//!
//! The rules every adapter keeps are on each trait and its methods below; the suites in
//! `testing::contract` check them against every adapter (the AWS ones on moto).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::adaptive::{EffectiveRate, ProviderReading};
use crate::breaker::Circuit;
use crate::config::LaneChange;
use crate::dlq::{DeadLetterRecord, DlqSource};
use crate::job::{DeadLetterReason, WorkerPayload};
use crate::keys::StoreScope;
use crate::lane::LaneId;
use crate::order::{OrderMark, OrderState};
use crate::outcome::OutcomeRecord;
use crate::pacer::PacerState;
use crate::quota::Quota;
use crate::time::UnixMillis;

/// What went wrong in an adapter, by what the caller can do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    /// A conditional write lost: someone else changed the item first. Re-read and decide.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The service asked us to slow down. Retry later with backoff.
    #[error("throttled: {0}")]
    Throttled(String),
    /// A passing fault (network, 5xx). Retry.
    #[error("transient: {0}")]
    Transient(String),
    /// Retrying will not help (missing resource, permissions, bad configuration).
    #[error("{0}")]
    Fatal(String),
    /// This one request is over the service's size limit: the job's fault, not the
    /// lane's. Dead-letter the job; the run goes on.
    #[error("too large: {0}")]
    TooLarge(String),
    /// A stored item cannot be read (corrupt, or written in a shape this version does
    /// not know): what it held is lost, and the caller falls back to what is safe
    /// without it.
    #[error("unreadable: {0}")]
    Unreadable(String),
}

impl PortError {
    /// Whether retrying the same call may succeed.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Throttled(_) | Self::Transient(_))
    }
}

pub type PortResult<T> = Result<T, PortError>;

/// A message received from the jobs queue, invisible to others until released,
/// deleted, or its visibility timeout passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuedMessage {
    pub message_id: String,
    /// The handle for `delete` and `release`, valid for this receive only.
    pub receipt: String,
    pub body: String,
    /// How many times the job was tried before (carried across re-queues).
    pub attempt: u32,
    /// When this message was put on the queue (a re-queue's is the re-queue's).
    pub enqueued_at: UnixMillis,
    /// The message group the queue keeps it in (SQS's MessageGroupId: the lane its
    /// producer named), if the queue has groups. The body's lane is the truth.
    pub group: Option<String>,
}

/// A received message to make visible again `after` this long (`Duration::ZERO`: now).
/// One release carries messages with different times (SQS changes ten in a request).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisibleAgain {
    pub receipt: String,
    pub after: Duration,
}

impl VisibleAgain {
    /// Each of `receipts`, visible again `after` this long.
    pub fn all(receipts: impl IntoIterator<Item = String>, after: Duration) -> Vec<Self> {
        receipts.into_iter().map(|receipt| Self { receipt, after }).collect()
    }
}

/// A message to put on the queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutgoingMessage {
    pub body: String,
    pub attempt: u32,
    pub delay: Duration,
    /// A FIFO queue's deduplication id: the job id for a producer's send (a repeated send
    /// within SQS's five minutes is dropped); `None` for Paceline's own re-queues and
    /// redrives, which get a fresh one each (repeated deliveries are caught by call
    /// records, and a re-queue must never be taken for its job's first send).
    pub dedup_id: Option<String>,
    /// Received ahead of the jobs already waiting: an ordered lane's retry (see
    /// `order`), which is called before any later job of its lane.
    pub ahead: bool,
}

impl OutgoingMessage {
    /// A job's first send: attempt 0, no delay, no deduplication id.
    #[must_use]
    pub fn fresh(body: impl Into<String>) -> Self {
        Self::again(body, 0, Duration::ZERO)
    }

    /// A job's send for its `attempt`, visible after `delay`.
    #[must_use]
    pub fn again(body: impl Into<String>, attempt: u32, delay: Duration) -> Self {
        Self { body: body.into(), attempt, delay, dedup_id: None, ahead: false }
    }
}

/// How many messages are where.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueDepth {
    /// Ready to be received.
    pub visible: u64,
    /// Received and not yet deleted or released, or delayed.
    pub not_visible: u64,
    /// In the jobs dead-letter queue.
    pub dead: u64,
}

/// A dead-lettered message as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub message_id: String,
    pub body: String,
    pub attempt: u32,
    pub reason: DeadLetterReason,
    pub dead_at: UnixMillis,
}

/// The jobs queue and its dead-letter queue. Every adapter: carries a message's attempt
/// count; hides a received message until it is deleted, released or its visibility
/// timeout passes (then it comes back); ignores unknown receipts; returns at most `max`;
/// counts dead letters apart from the queue.
#[async_trait]
pub trait JobQueue: Send + Sync {
    /// Receives up to `max` messages (at most 10), waiting up to `wait` for the first,
    /// and hides them for `visibility`.
    ///
    /// # Errors
    /// `Throttled`/`Transient` when the queue service is unavailable; `Fatal` when the
    /// queue does not exist or may not be read.
    async fn receive(&self, max: usize, wait: Duration, visibility: Duration) -> PortResult<Vec<QueuedMessage>>;

    /// Deletes received messages for good. Unknown or expired receipts are ignored.
    ///
    /// # Errors
    /// As for `receive`; a message not deleted comes back after its visibility timeout.
    async fn delete(&self, receipts: &[String]) -> PortResult<()>;

    /// Makes received messages visible again, each after its own time.
    ///
    /// # Errors
    /// As for `receive`; a message not released comes back after its visibility timeout.
    async fn release(&self, messages: &[VisibleAgain]) -> PortResult<()>;

    /// Puts messages on the queue (at most [`JobQueue::most_per_send`] at a time). All
    /// or nothing is not promised: the error lists nothing, so callers resend the whole
    /// batch (jobs carry ids).
    ///
    /// # Errors
    /// As for `receive`.
    async fn send(&self, messages: &[OutgoingMessage]) -> PortResult<()>;

    /// The most messages one `send` should carry: SQS's batch of 10, unless the queue
    /// takes more in one go (the embedded store, in one transaction).
    fn most_per_send(&self) -> usize {
        10
    }

    /// Moves a message's body to the dead-letter queue with its reason.
    ///
    /// # Errors
    /// As for `receive`; the caller must not delete the original unless this succeeded.
    async fn dead_letter(&self, message_id: &str, body: &str, attempt: u32, reason: &DeadLetterReason) -> PortResult<()>;

    /// Whether the queue hands out the messages of quiet message groups (lanes) before
    /// those of a group with many in flight, as an SQS fair queue does: a receive then
    /// finds a light lane's jobs behind a heavy lane's backlog.
    fn serves_groups_fairly(&self) -> bool {
        false
    }

    /// Counts messages by where they are.
    ///
    /// # Errors
    /// As for `receive`.
    async fn depth(&self) -> PortResult<QueueDepth>;
}

/// The dead-letter queues as an operator sees them (`paceline dlq`): read page by page,
/// remove, and redrive onto the jobs queue. Every adapter keeps, with each dead letter,
/// the job's body, its attempt count, the reason (cause label and detail) and when it
/// died (SQS: the message attributes `cause`, `detail`, `reason`, `attempt`,
/// `original_message_id`, `dead_at`); a redrive resets attempts unless asked not to.
#[async_trait]
pub trait DeadLetterQueues: JobQueue {
    /// The DLQs this backend has: always `Jobs`; `Worker` where the worker has its own.
    fn sources(&self) -> Vec<DlqSource>;

    /// Up to `max` (at most 10) dead letters of `source` not yet returned to this reader.
    /// The embedded store pages by `after` (the handle of the last record seen); SQS hides
    /// what it returns from every reader for `hold` instead (and may, rarely, return a
    /// record again once the hold is over). Empty once there are no more.
    ///
    /// # Errors
    /// As for [`JobQueue::receive`]; `Fatal` for a DLQ this backend does not have.
    async fn page(&self, source: DlqSource, after: Option<&str>, max: usize, hold: Duration) -> PortResult<Vec<DeadLetterRecord>>;

    /// Makes records hidden by `page` visible to other readers again.
    ///
    /// # Errors
    /// As for [`JobQueue::release`]; a record not unhidden comes back when its hold ends.
    async fn unhide(&self, source: DlqSource, handles: &[String]) -> PortResult<()>;

    /// Deletes records for good.
    ///
    /// # Errors
    /// As for [`JobQueue::delete`].
    async fn remove(&self, source: DlqSource, handles: &[String]) -> PortResult<()>;

    /// Writes a dead letter back to `source` (what is left of a worker batch's message
    /// once some of its jobs were redriven or purged).
    ///
    /// # Errors
    /// As for `send`; `Fatal` where the backend keeps no such messages.
    async fn put_back(&self, source: DlqSource, body: &str) -> PortResult<()> {
        let _ = body;
        Err(PortError::Fatal(format!("this backend writes nothing back to the {source} DLQ")))
    }

    /// Removes `records` of `source` for good: a worker batch's message goes once all of
    /// its jobs are among them, and otherwise what is left of it is written back first.
    ///
    /// # Errors
    /// As for [`Self::remove`] and [`Self::put_back`].
    async fn remove_records(&self, source: DlqSource, records: &[DeadLetterRecord]) -> PortResult<()> {
        let mut taken: std::collections::BTreeMap<&str, (std::collections::BTreeSet<u32>, Option<&DeadLetterRecord>)> = std::collections::BTreeMap::new();
        for record in records.iter().filter(|r| r.source == source) {
            let entry = taken.entry(record.handle.as_str()).or_default();
            if let Some(batch) = &record.batch {
                entry.0.insert(batch.index);
                entry.1 = Some(record);
            }
        }
        for (taken_jobs, batch_record) in taken.values() {
            let Some(record) = batch_record else { continue };
            if let Some(rest) = crate::dlq::rest_of_batch(&record.raw, taken_jobs) {
                self.put_back(source, &rest).await?;
            }
        }
        let handles: Vec<String> = taken.keys().map(|h| (*h).to_owned()).collect();
        if handles.is_empty() {
            return Ok(());
        }
        self.remove(source, &handles).await
    }

    /// How many dead letters `source` holds.
    ///
    /// # Errors
    /// As for [`JobQueue::depth`].
    async fn count(&self, source: DlqSource) -> PortResult<u64>;

    /// Puts each record's job back on the jobs queue (attempts reset to 0 unless
    /// `keep_attempts`), then removes the records: a record leaves its DLQ only after its
    /// copy is enqueued. By default at least once: a crash between the two steps leaves
    /// both copies; the embedded store does it in one transaction.
    ///
    /// # Errors
    /// `Fatal` when a record holds no job; otherwise as for `send` and `remove` (nothing
    /// removed that was not enqueued).
    async fn redrive(&self, records: &[DeadLetterRecord], keep_attempts: bool) -> PortResult<()> {
        let messages = redrive_messages(records, keep_attempts)?;
        self.send(&messages).await?;
        for source in [DlqSource::Jobs, DlqSource::Worker] {
            self.remove_records(source, records).await?;
        }
        Ok(())
    }
}

/// The jobs-queue messages a redrive of `records` sends.
///
/// # Errors
/// `Fatal` naming the first record that holds no job.
pub fn redrive_messages(records: &[DeadLetterRecord], keep_attempts: bool) -> PortResult<Vec<OutgoingMessage>> {
    records
        .iter()
        .map(|r| match &r.job_body {
            Some(body) if keep_attempts => Ok(OutgoingMessage::again(body.clone(), r.attempt, Duration::ZERO)),
            Some(body) => Ok(OutgoingMessage::fresh(without_rate_limited_count(body))),
            None => Err(PortError::Fatal(format!("dead letter {} ({}) holds no job to redrive", r.message_id, r.cause))),
        })
        .collect()
}

/// A job body whose count of 429 answers starts again, as its attempts do in a redrive
/// that resets them (any other body as it is).
fn without_rate_limited_count(body: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut job)) if job.contains_key("rate_limited") => {
            job.remove("rate_limited");
            serde_json::Value::Object(job).to_string()
        }
        _ => body.to_owned(),
    }
}

/// The pacer state a run leaves for the next.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PacerSnapshot {
    pub state: PacerState,
    /// Written by a run that ended cleanly. A snapshot written mid-run (or none after
    /// one) means that run may have dispatched more than it says.
    pub at_exit: bool,
    /// The adaptive rate when it was written: for `paceline status`, and the next run
    /// carries on from it while it is fresh.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_rate: Option<EffectiveRate>,
    /// When it was written (none from versions before it was kept): a snapshot older
    /// than the longest window is not trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_at: Option<UnixMillis>,
}

/// A held lease: one pacer per lane. The epoch grows with every new holder, so writes
/// conditioned on it fence out a holder that lost the lease without knowing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub holder: String,
    pub epoch: u64,
    pub expires_at: UnixMillis,
}

/// What the orchestrator re-reads while jobs flow: the circuit, the provider's
/// cool-down and the latest reading of the provider's rate-limit headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaneSignals {
    pub circuit: Circuit,
    pub cool_down: UnixMillis,
    pub provider_reading: Option<ProviderReading>,
}

/// What a stack reads of a lane before the lane's first job goes: its last pacer
/// snapshot (an unreadable one is the lane's own error, judged as a missing one is), its
/// signals and an operator's change of its settings.
#[derive(Debug)]
pub struct LaneFirstRead {
    pub pacer: PortResult<Option<PacerSnapshot>>,
    pub signals: LaneSignals,
    pub change: Option<LaneChange>,
}

/// What a worker found when it claimed the call of one attempt of a job
/// ([`StateStore::claim_call`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallClaim {
    /// No one called for this attempt yet: the claimant calls.
    Taken,
    /// Another delivery is calling, or was until it crashed (its claim has not expired).
    Calling,
    /// Another delivery called and has its answer.
    Done,
    /// The claimant itself holds it, from an earlier delivery of the same payload that
    /// has not finished (it runs still, or stopped without saying how far it got).
    ClaimedBefore,
}

/// The key of the progress record of worker batch `batch_id` (see
/// [`StateStore::claim_batch`]).
#[must_use]
pub fn batch_record_key(batch_id: &str) -> String {
    format!("call#batch#{batch_id}")
}

/// How far the deliveries of a worker batch got: which of its calls (by index) settled,
/// and whether every one did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchProgress {
    pub settled: std::collections::BTreeSet<u32>,
    pub done: bool,
}

impl BatchProgress {
    /// The settled calls as a bitmap in hex (a thousand calls in 250 characters: one
    /// DynamoDB write unit).
    #[must_use]
    pub fn settled_bits(&self) -> String {
        let Some(last) = self.settled.last() else { return String::new() };
        let mut nibbles = vec![0_u8; *last as usize / 4 + 1];
        for index in &self.settled {
            nibbles[*index as usize / 4] |= 1 << (index % 4);
        }
        nibbles.iter().map(|n| char::from_digit(u32::from(*n), 16).unwrap_or('0')).collect()
    }

    /// Reads [`Self::settled_bits`] back; `None` for text that is not such a bitmap.
    #[must_use]
    pub fn from_bits(bits: &str, done: bool) -> Option<Self> {
        let mut settled = std::collections::BTreeSet::new();
        for (at, digit) in bits.chars().enumerate() {
            let nibble = digit.to_digit(16)?;
            for bit in 0..4 {
                if nibble & (1 << bit) != 0 {
                    settled.insert(u32::try_from(at * 4).ok()? + bit);
                }
            }
        }
        Some(Self { settled, done })
    }
}

/// What a delivery of a worker batch found when it claimed the batch
/// ([`StateStore::claim_batch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchClaim {
    /// The claimant runs the batch: from the start, or from where an earlier delivery
    /// that stopped (a crash, a timeout, a write that failed) last said it was.
    Taken { before: Option<BatchProgress> },
    /// Another delivery runs it (its claim has not expired).
    Running,
    /// A delivery settled every call of it.
    Done,
}

/// The key of the call record of `attempt` of job `job_id`: the job id is the
/// idempotency key.
#[must_use]
pub fn call_record_key(job_id: &str, attempt: u32) -> String {
    format!("call#{job_id}#{attempt}")
}

/// Lease, quota usage, pacer snapshot, circuit, cool-down, the provider's latest
/// rate-limit reading, and a record of each attempt's call.
///
/// The lease rules every adapter keeps (each check and write is one atomic step):
/// - an unexpired lease is never taken, by its own holder neither (a holder name is one
///   run's; a second process with the same name must not share it);
/// - an expired or released lease is taken, with an epoch higher than every epoch
///   before (the fencing token never repeats, releases included);
/// - a holder renews its lease while the epoch and holder are unchanged, after its
///   expiry too (no one took it meanwhile, so no one else dispatched); the orchestrator
///   itself stops dispatching at its local view of the expiry, a fifth of the TTL early
///   for clock drift;
/// - a lost or released lease is neither renewed nor saved under; giving up a lease that
///   is no longer ours changes nothing.
#[async_trait]
pub trait StateStore: Send + Sync {
    /// Takes the lease if it is free, expired or released.
    ///
    /// # Errors
    /// `Conflict` naming the current holder when it is held; others as for any call.
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease>;

    /// Extends a lease to `now + ttl` while it is still `lease` (same epoch and holder).
    ///
    /// # Errors
    /// `Conflict` when the lease was lost (taken by another, or released).
    async fn renew_lease(&self, lease: &Lease, ttl: Duration, now: UnixMillis) -> PortResult<Lease>;

    /// Gives the lease up (no-op if it is no longer ours).
    ///
    /// # Errors
    /// Transport errors only.
    async fn release_lease(&self, lease: &Lease) -> PortResult<()>;

    /// The current lease, if any, expired or not (`None` once released).
    ///
    /// # Errors
    /// Transport errors only.
    async fn lease(&self) -> PortResult<Option<Lease>>;

    /// Units used under each usage key (0 for unknown keys), in the order given.
    ///
    /// # Errors
    /// Transport errors only.
    async fn load_usage(&self, keys: &[String]) -> PortResult<Vec<u64>>;

    /// Atomically adds each delta to its key, so concurrent writers never under-count.
    /// The orchestrator reserves calendar units with a positive delta *before* it spends
    /// them and gives the unspent part back with a negative one at a clean stop: a crash
    /// then leaves the counter over what was spent, never under it.
    ///
    /// # Errors
    /// Transport errors only; on error nothing or some keys were added (retry the rest).
    async fn add_usage(&self, deltas: &[(String, i64)]) -> PortResult<()>;

    /// The pacer snapshot the last run left.
    ///
    /// # Errors
    /// Transport errors only.
    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>>;

    /// Saves the pacer snapshot, only while `lease` is still the current lease.
    ///
    /// # Errors
    /// `Conflict` when the lease was lost.
    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()>;

    /// The circuit (closed at epoch 0 if never written).
    ///
    /// # Errors
    /// Transport errors only.
    async fn circuit(&self) -> PortResult<Circuit>;

    /// Writes `next` only if the stored circuit is still at `expected_epoch`.
    ///
    /// # Errors
    /// `Conflict` when it is not.
    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()>;

    /// The circuit, the cool-down and the provider's reading together, as the
    /// orchestrator re-reads them while jobs flow: one request where the store can batch.
    ///
    /// # Errors
    /// Transport errors only.
    async fn shared_state(&self) -> PortResult<LaneSignals> {
        Ok(LaneSignals { circuit: self.circuit().await?, cool_down: self.cool_down().await?, provider_reading: self.provider_reading().await? })
    }

    /// The latest reading a worker recorded of the provider's rate-limit headers.
    ///
    /// # Errors
    /// Transport errors only.
    async fn provider_reading(&self) -> PortResult<Option<ProviderReading>>;

    /// Records `reading` unless one of a later call is already there.
    ///
    /// # Errors
    /// Transport errors only.
    async fn record_provider_reading(&self, reading: &ProviderReading) -> PortResult<()>;

    /// Until when the provider asked us to hold off (0 if never).
    ///
    /// # Errors
    /// Transport errors only.
    async fn cool_down(&self) -> PortResult<UnixMillis>;

    /// Extends the cool-down to `until` (never shortens it).
    ///
    /// # Errors
    /// Transport errors only.
    async fn extend_cool_down(&self, until: UnixMillis) -> PortResult<()>;

    /// Ends any cool-down now and forgets the provider's latest reading (an operator's
    /// `paceline circuit close` or `paceline rate reset`): the orchestrator then forgets
    /// what readings and 429s said and goes at the configured pace.
    ///
    /// # Errors
    /// Transport errors only.
    async fn clear_cool_down(&self) -> PortResult<()>;

    /// Claims the call of record `key` (see [`call_record_key`]) for `holder` until
    /// `expires_at`, in one atomic step: taken when there is no record, or a claim that
    /// expired (its claimant crashed mid-call: the call may repeat, at least once is all
    /// that can be promised where the answer is unknown).
    ///
    /// # Errors
    /// Transport errors only.
    async fn claim_call(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<CallClaim>;

    /// Marks record `key` done (the call was answered), kept until `keep_until`.
    ///
    /// # Errors
    /// Transport errors only.
    async fn finish_call(&self, key: &str, keep_until: UnixMillis) -> PortResult<()>;

    /// Drops `holder`'s claim on record `key` when no call was made after all (a missed
    /// slot, no free call slot): the job goes back on the queue with the same attempt.
    ///
    /// # Errors
    /// Transport errors only.
    async fn release_call(&self, key: &str, holder: &str) -> PortResult<()>;

    /// Claims worker batch `key` (see [`batch_record_key`]) for `holder`, one delivery of
    /// it, until `expires_at`, in one atomic step: taken when there is no record, or the
    /// claim of an earlier delivery expired (it stopped; its progress comes back with
    /// the claim).
    ///
    /// # Errors
    /// Transport errors only.
    async fn claim_batch(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<BatchClaim>;

    /// Saves how far `holder`'s delivery of batch `key` got, its claim now lasting until
    /// `expires_at` (a done batch's record is kept that long). A delivery whose claim was
    /// taken over saves nothing.
    ///
    /// # Errors
    /// `Conflict` when another delivery holds the batch; transport errors.
    async fn save_batch(&self, key: &str, holder: &str, progress: &BatchProgress, expires_at: UnixMillis) -> PortResult<()>;

    /// Deletes record `key` whatever its state: a redrive gives a job its attempts again.
    ///
    /// # Errors
    /// Transport errors only.
    async fn forget_call(&self, key: &str) -> PortResult<()>;

    /// Takes one of `capacity` call slots (`quota.max_in_flight`) for `holder` until
    /// `expires_at`, in one atomic step per slot. A slot is free when no one holds it
    /// or its holder's expiry passed, so a crashed worker's slot frees itself. `None`
    /// when every slot is taken.
    ///
    /// # Errors
    /// Transport errors only.
    async fn take_call_slot(&self, capacity: u32, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<Option<u32>>;

    /// Gives call slot `index` back (nothing happens unless `holder` still holds it).
    ///
    /// # Errors
    /// Transport errors only.
    async fn release_call_slot(&self, index: u32, holder: &str) -> PortResult<()>;

    /// How many of `capacity` call slots are held at `now`.
    ///
    /// # Errors
    /// Transport errors only.
    async fn call_slots_in_use(&self, capacity: u32, now: UnixMillis) -> PortResult<u32>;

    /// An operator's change to this scope's lane settings (`paceline lanes set`); `None`
    /// when the config's settings stand. A backend that keeps none has none.
    ///
    /// # Errors
    /// Transport errors, or a stored change that no longer reads.
    async fn lane_change(&self) -> PortResult<Option<LaneChange>> {
        Ok(None)
    }

    /// Keeps `change` as this scope's lane settings over the config's (`None` forgets
    /// it: the config's settings again).
    ///
    /// # Errors
    /// Transport errors; a backend that keeps no lane settings refuses.
    async fn set_lane_change(&self, change: Option<&LaneChange>) -> PortResult<()> {
        let _ = change;
        Err(PortError::Fatal("this backend keeps no lane settings yet: lanes run on the embedded store".into()))
    }

    /// Every lane other than the default one with state of its own in this store
    /// (whatever this store's scope), by id.
    ///
    /// # Errors
    /// Transport errors only.
    async fn lanes_with_state(&self) -> PortResult<Vec<LaneId>> {
        Ok(Vec::new())
    }

    /// This scope's [`OrderMark`] (an ordered lane's last job handed off and what came of
    /// it); `None` before its first ordered job.
    ///
    /// # Errors
    /// Transport errors, or a stored mark that no longer reads.
    async fn order_mark(&self) -> PortResult<Option<OrderMark>> {
        Ok(None)
    }

    /// Keeps `mark` as this scope's, whatever was there: the orchestrator writes the
    /// mark of the job it is about to hand off (under its lease, so no one else does).
    ///
    /// # Errors
    /// Transport errors; a backend that keeps no order refuses.
    async fn open_order(&self, mark: &OrderMark) -> PortResult<()> {
        let _ = mark;
        Err(PortError::Fatal("this backend keeps no order mark: ordered lanes need the embedded store or DynamoDB".into()))
    }

    /// Sets the state of this scope's mark to `state` if the mark is still that of job
    /// `job_id`'s `attempt`, in one atomic step (a repeated delivery of an attempt long
    /// settled changes nothing); whether it did.
    ///
    /// # Errors
    /// Transport errors; a backend that keeps no order refuses.
    async fn settle_order(&self, job_id: &str, attempt: u32, state: OrderState) -> PortResult<bool> {
        let _ = (job_id, attempt, state);
        Err(PortError::Fatal("this backend keeps no order mark: ordered lanes need the embedded store or DynamoDB".into()))
    }
}

/// The small documents the shards of a stack share, each one item of the stack (never
/// scoped) holding its JSON and its version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StackDocument {
    /// The book that divides the shared quota's rolling tiers among the shards
    /// ([`ShareBook`](crate::shares::ShareBook)).
    ShareBook,
    /// The lanes an operator moved to another shard
    /// ([`LaneHomes`](crate::homes::LaneHomes)).
    LaneHomes,
}

impl StackDocument {
    /// Its key in the store.
    #[must_use]
    pub fn key(self) -> &'static str {
        match self {
            Self::ShareBook => "share_book",
            Self::LaneHomes => "lane_homes",
        }
    }
}

/// Where a stack of shards keeps its [`StackDocument`]s, each written only over the
/// version read, and the counters from which its shards reserve the shared quota's day
/// and month units.
#[async_trait]
pub trait StackDocuments: Send + Sync {
    /// The document's JSON and its version, read consistently; `None` before any was
    /// written.
    async fn document(&self, document: StackDocument) -> PortResult<Option<(String, u64)>>;

    /// Writes `json` as the document's next version if the stored one is still
    /// `expected` (`None`: none stored yet); `Ok(false)` when another wrote first.
    async fn put_document(&self, document: StackDocument, json: &str, expected: Option<u64>) -> PortResult<bool>;

    /// What the stack-wide counters of the shared quota's day and month tiers hold, by
    /// usage key (0 for one never written), read consistently. Shard 0's counters in the
    /// stack's scope are these: a stack of one shard kept the same.
    ///
    /// # Errors
    /// Transport errors.
    async fn shared_counts(&self, keys: &[String]) -> PortResult<Vec<u64>>;

    /// Adds up to `wanted` units to the stack-wide counter `key` without ever taking it
    /// past `limit`, so that the shards reserving from it together never pass the tier:
    /// the units added (fewer than `wanted` where the other shards hold the rest, 0 at
    /// the limit), and the count they left.
    ///
    /// # Errors
    /// Transport errors (nothing was added), or a counter too contended to reserve from.
    async fn reserve_shared(&self, key: &str, wanted: u64, limit: u64) -> PortResult<SharedReservation>;

    /// Takes `units` reserved and not spent back off the stack-wide counter `key`.
    ///
    /// # Errors
    /// Transport errors (nothing was taken off: the counter stays over what was spent).
    async fn return_shared(&self, key: &str, units: u64) -> PortResult<()>;
}

/// What a reservation from a stack-wide counter got ([`StackDocuments::reserve_shared`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedReservation {
    /// The units added for the shard that asked.
    pub units: u64,
    /// The counter after them: every shard's reservations, spent or not.
    pub count: u64,
}

/// Document `document` as a `T`, and its version.
///
/// # Errors
/// Transport errors; [`PortError::Unreadable`] for a document that does not parse.
pub async fn read_document<T: serde::de::DeserializeOwned>(store: &dyn StackDocuments, document: StackDocument) -> PortResult<Option<(T, u64)>> {
    let Some((json, version)) = store.document(document).await? else { return Ok(None) };
    let value = serde_json::from_str(&json).map_err(|e| PortError::Unreadable(format!("stored {}: {e}", document.key())))?;
    Ok(Some((value, version)))
}

/// Writes `value` as document `document`'s next version over `expected` (see
/// [`StackDocuments::put_document`]).
///
/// # Errors
/// Transport errors.
pub async fn write_document<T: Serialize + Sync>(store: &dyn StackDocuments, document: StackDocument, value: &T, expected: Option<u64>) -> PortResult<bool> {
    let json = serde_json::to_string(value).map_err(|e| PortError::Fatal(e.to_string()))?;
    store.put_document(document, &json, expected).await
}

/// [`StackDocuments`] in memory: for tests, and the simulator's store.
#[derive(Debug, Default)]
pub struct MemoryDocuments {
    documents: std::sync::Mutex<std::collections::BTreeMap<StackDocument, (String, u64)>>,
    counters: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl MemoryDocuments {
    fn documents(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<StackDocument, (String, u64)>> {
        self.documents.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn counters(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, u64>> {
        self.counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl StackDocuments for MemoryDocuments {
    async fn document(&self, document: StackDocument) -> PortResult<Option<(String, u64)>> {
        Ok(self.documents().get(&document).cloned())
    }

    async fn put_document(&self, document: StackDocument, json: &str, expected: Option<u64>) -> PortResult<bool> {
        let mut documents = self.documents();
        if documents.get(&document).map(|(_, version)| *version) != expected {
            return Ok(false);
        }
        documents.insert(document, (json.to_owned(), expected.map_or(1, |v| v + 1)));
        Ok(true)
    }

    async fn shared_counts(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        let counters = self.counters();
        Ok(keys.iter().map(|key| counters.get(key).copied().unwrap_or(0)).collect())
    }

    async fn reserve_shared(&self, key: &str, wanted: u64, limit: u64) -> PortResult<SharedReservation> {
        let mut counters = self.counters();
        let used = counters.entry(key.to_owned()).or_default();
        let units = wanted.min(limit.saturating_sub(*used));
        *used += units;
        Ok(SharedReservation { units, count: *used })
    }

    async fn return_shared(&self, key: &str, units: u64) -> PortResult<()> {
        let mut counters = self.counters();
        let used = counters.entry(key.to_owned()).or_default();
        *used = used.saturating_sub(units);
        Ok(())
    }
}

/// A state store for each scope (a lane's state, the stack's), all in one backend: a
/// stack of many lanes needs one.
#[async_trait]
pub trait ScopedStores: Send + Sync {
    fn scoped(&self, scope: &StoreScope) -> Arc<dyn StateStore>;

    /// What the orchestrator re-reads of each of `lanes` (its signals, an operator's
    /// change of its settings), in their order, in as few requests as the backend
    /// allows: a stack re-reads every lane with jobs in hand each `state_refresh`.
    ///
    /// # Errors
    /// As [`StateStore::shared_state`] and [`StateStore::lane_change`], for all of them.
    async fn lanes_signals(&self, lanes: &[LaneId]) -> PortResult<Vec<(LaneSignals, Option<LaneChange>)>> {
        let mut read = Vec::with_capacity(lanes.len());
        for lane in lanes {
            let store = self.scoped(&StoreScope::Lane(lane.clone()));
            read.push((store.shared_state().await?, store.lane_change().await?));
        }
        Ok(read)
    }

    /// What a stack reads of each of `lanes` before its first job goes, in their order,
    /// in as few requests as the backend allows: a run of a stack of 1,000 lanes reads
    /// each lane that has jobs once, as they come.
    ///
    /// # Errors
    /// As [`StateStore::shared_state`] and [`StateStore::lane_change`], for all of them
    /// (a pacer snapshot that cannot be read is its lane's, in [`LaneFirstRead::pacer`]).
    async fn lanes_first_reads(&self, lanes: &[LaneId]) -> PortResult<Vec<LaneFirstRead>> {
        let mut read = Vec::with_capacity(lanes.len());
        for lane in lanes {
            let store = self.scoped(&StoreScope::Lane(lane.clone()));
            let pacer = store.load_pacer().await;
            read.push(LaneFirstRead { pacer, signals: store.shared_state().await?, change: store.lane_change().await? });
        }
        Ok(read)
    }

    /// Saves each scope's pacer snapshot while `lease` is held, in as few requests as
    /// the backend allows (a stack of 1,000 lanes saves 1,000 at a run's end, and the
    /// next run trusts them only if they are fresh), stopping at the first error.
    ///
    /// # Errors
    /// As [`StateStore::save_pacer`].
    async fn save_pacers(&self, lease: &Lease, snapshots: &[(StoreScope, PacerSnapshot)]) -> PortResult<()> {
        for (scope, snapshot) in snapshots {
            self.scoped(scope).save_pacer(lease, snapshot).await?;
        }
        Ok(())
    }
}

/// The most pacer snapshots one DynamoDB transaction saves beside the lease's condition
/// check (a transaction takes 100 items): the adapter's batches, and the simulator's.
pub const PACERS_A_TRANSACTION: usize = 99;

/// Forgets the call records of attempts 0 to `up_to` of job `job_id`, before a redrive
/// puts it back on the queue: its attempts count from 0 again (or go on from `up_to`),
/// and their records would make the worker skip its calls.
///
/// # Errors
/// The store's.
pub async fn forget_calls(store: &dyn StateStore, job_id: &str, up_to: u32) -> PortResult<()> {
    for attempt in 0..=up_to {
        store.forget_call(&call_record_key(job_id, attempt)).await?;
    }
    Ok(())
}

/// The usage counter of calls not made because every call slot was held: workers add
/// to it, the orchestrator reads how it grew (its model of the slots was too eager).
pub const CALL_SLOTS_FULL_KEY: &str = "call_slots#full";

/// Where a store that tries call slots one at a time starts for `holder`: spread over
/// the slots, so that concurrent workers seldom try the same one first.
#[must_use]
pub fn slot_probe_start(holder: &str, capacity: u32) -> u32 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    holder.hash(&mut hasher);
    u32::try_from(hasher.finish() % u64::from(capacity.max(1))).unwrap_or(0)
}

/// What each tier of `quota` has used in its calendar window holding `now`, by tier
/// index, read in one call (0 for rolling tiers: they are paced in memory).
///
/// # Errors
/// The store's.
pub async fn load_calendar_usage(store: &dyn StateStore, quota: &Quota, now: UnixMillis) -> PortResult<Vec<u64>> {
    Ok(by_tier(quota, store.load_usage(&calendar_keys(quota, now)).await?))
}

/// What each tier of the shared quota `quota` has used in its calendar window holding
/// `now`, by tier index, as the stack-wide counters a stack's shards reserve from hold
/// it (0 for rolling tiers).
///
/// # Errors
/// The store's.
pub async fn load_shared_calendar_usage(documents: &dyn StackDocuments, quota: &Quota, now: UnixMillis) -> PortResult<Vec<u64>> {
    Ok(by_tier(quota, documents.shared_counts(&calendar_keys(quota, now)).await?))
}

/// The counters' keys of `quota`'s calendar tiers at `now`, in the tiers' order.
fn calendar_keys(quota: &Quota, now: UnixMillis) -> Vec<String> {
    quota.tiers().iter().filter(|tier| tier.is_calendar()).map(|tier| tier.usage_key(quota.zone(), now)).collect()
}

/// `counts` of `quota`'s calendar tiers (in their order) by tier index, 0 for the others.
fn by_tier(quota: &Quota, counts: Vec<u64>) -> Vec<u64> {
    let mut counts = counts.into_iter();
    quota.tiers().iter().map(|tier| if tier.is_calendar() { counts.next().unwrap_or(0) } else { 0 }).collect()
}

/// Hands a payload to a worker without waiting for it to run (Lambda's `Event` invoke).
#[async_trait]
pub trait Invoker: Send + Sync {
    /// Returns once the payload is durably handed off. `from_receipt` is the jobs-queue
    /// receipt of the message the payload comes from: an invoker that shares a store
    /// with the queue deletes that message in the same transaction that records the
    /// hand-off, so a crash never leaves both the message and the hand-off to run again.
    /// Others ignore it (the orchestrator deletes the message after the hand-off).
    ///
    /// # Errors
    /// `Throttled` (retry with backoff), `Transient` (retry), `Fatal` (stop dispatching);
    /// `TooLarge` when the payload is over what the invoker takes (the job's fault).
    async fn invoke(&self, payload: &WorkerPayload, from_receipt: Option<&str>) -> PortResult<()>;

    /// Invocations handed off whose worker has not finished, where the invoker can know
    /// (in-process); 0 where it cannot (Lambda owns them once accepted).
    fn in_flight(&self) -> usize {
        0
    }

    /// Sends at once what the invoker gathered to send later (the run is ending: its
    /// last hand-offs must not hold it up).
    async fn flush(&self) {}

    /// The orchestrator's pace changed to `per_second` (a shard's share of the shared
    /// quota moved, or the lanes with jobs in hand go slower than it at their own
    /// paces): an invoker that spreads its batches over workers by pace follows it.
    /// Others ignore it.
    fn pace_changed(&self, _per_second: f64) {}

    /// The orchestrator hands jobs off `extra` earlier than configured from now on
    /// (workers started after their slots lately): an invoker that holds a job until the
    /// hand-off's lead before its slot sends it that much earlier. Others ignore it.
    fn lead_changed(&self, _extra: Duration) {}

    /// How many hand-offs the drain loop may have awaiting their answer at once: enough
    /// that an invoke's own latency never delays the next slot (an invoker that gathers
    /// hand-offs into batches holds a batch's worth awaiting).
    fn pipeline(&self) -> usize {
        DEFAULT_PIPELINE
    }
}

/// Hand-offs awaiting their answer at once at most, for an invoker that sends each alone.
pub const DEFAULT_PIPELINE: usize = 256;

/// Runs one payload: what an in-process invoker calls.
#[async_trait]
pub trait WorkerHandler: Send + Sync {
    /// Handles the payload to the end (API call, classification, follow-up writes).
    ///
    /// # Errors
    /// A follow-up write (re-queue, DLQ, circuit) failed: the payload must be retried
    /// (Lambda retries the event; the embedded invoker re-queues the job).
    /// Returns the job's outcome record when it ended with one.
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>>;
}

/// Keeps outcome records where a producer reads them (the embedded store; on AWS the
/// record is the worker's function result instead).
#[async_trait]
pub trait OutcomeSink: Send + Sync {
    /// Keeps the record, replacing one for the same job, outcome and attempts (a
    /// repeated write is harmless).
    ///
    /// # Errors
    /// When it cannot be written: the worker fails the payload, which is retried.
    async fn record_outcome(&self, record: &OutcomeRecord) -> PortResult<()>;

    /// Keeps each of `records` (a batch's): one request per record unless the sink can
    /// do better.
    ///
    /// # Errors
    /// As [`OutcomeSink::record_outcome`]; the records before the failure may be kept.
    async fn record_outcomes(&self, records: &[OutcomeRecord]) -> PortResult<()> {
        for record in records {
            self.record_outcome(record).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_documents_keep_the_shared_counters_contract() {
        crate::testing::contract::shared_counters(Arc::new(MemoryDocuments::default()), None).await;
    }

    #[test]
    fn a_redrive_that_resets_attempts_resets_the_count_of_429s_too_and_one_that_keeps_them_keeps_it() {
        let body = r#"{"id":"j","request":{"method":"GET","path":"/x"},"rate_limited":40}"#;
        let record = crate::dlq::jobs_record("h".into(), "m".into(), body.into(), 44, "attempts_exhausted:http_503".into(), String::new(), UnixMillis(0));
        let reset = redrive_messages(std::slice::from_ref(&record), false).unwrap();
        let job = crate::job::Job::parse(&reset[0].body).unwrap();
        assert_eq!((reset[0].attempt, job.rate_limited, job.id.as_str()), (0, 0, "j"));
        let kept = redrive_messages(&[record], true).unwrap();
        assert_eq!((kept[0].attempt, kept[0].body.as_str()), (44, body));
    }
}
