//! A batch: many jobs' calls carried by one worker invocation. Each call runs on a task
//! of its own and waits for its own slot, so the calls overlap in one execution instead
//! of taking one execution each; each settles alone, exactly as a payload of one job
//! would (its call record, outcome record, re-queue, back-off, dead letter, circuit and
//! cool-down signals). An entry that cannot be read is dead-lettered alone with its
//! reason and the others are called.
//!
//! A batch has no function result of its own to carry the jobs' outcome records, so each
//! record goes to the results sink one by one (on AWS, the results queue). When any call
//! could not write what its answer called for, the batch fails once every call is over:
//! Lambda runs it again, and the calls already made find their call records and are not
//! made twice.

use std::sync::Arc;

use async_trait::async_trait;
use paceline_shared::job::{DeadLetterCause, DeadLetterReason, JobId, UnreadableCall, WorkerPayload};
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::ports::{JobQueue, OutcomeSink, PortError, PortResult, WorkerHandler};
use tokio::task::JoinSet;
use tracing::{info, warn};

/// Runs batches through a handler of one job's payload; other payloads go straight to it.
pub struct Batches {
    calls: Arc<dyn WorkerHandler>,
    /// Where an unreadable entry is dead-lettered.
    queue: Arc<dyn JobQueue>,
    /// Where each job's outcome record goes (none: records are not kept beyond the
    /// worker's own sink).
    results: Option<Arc<dyn OutcomeSink>>,
}

impl Batches {
    /// Batches whose calls `calls` runs, dead-lettering unreadable entries to `queue`.
    #[must_use]
    pub fn new(calls: Arc<dyn WorkerHandler>, queue: Arc<dyn JobQueue>) -> Self {
        Self { calls, queue, results: None }
    }

    /// The same, sending each job's outcome record to `results`.
    #[must_use]
    pub fn with_results(self, results: Arc<dyn OutcomeSink>) -> Self {
        Self { results: Some(results), ..self }
    }

    /// Dead-letters entry `index` of batch `batch`, which is no job's payload.
    async fn dead_letter(&self, batch: &str, index: usize, unreadable: UnreadableCall) -> PortResult<()> {
        let entry = &unreadable.entry;
        let body = entry.get("job").and_then(serde_json::Value::as_str).map_or_else(|| entry.to_string(), str::to_owned);
        let message_id = JobId::named_in(&body).map_or_else(|| format!("{batch}#{index}"), |id| id.as_str().to_owned());
        let attempt = entry.get("attempt").and_then(serde_json::Value::as_u64).and_then(|a| u32::try_from(a).ok()).unwrap_or(0);
        let detail = format!("entry {index} of batch {batch} is not a job's payload: {}", unreadable.problem);
        warn!(%message_id, %detail, "dead-lettered");
        let reason = DeadLetterReason { cause: DeadLetterCause::Malformed, detail, outcome: None };
        self.queue.dead_letter(&message_id, &body, attempt, &reason).await
    }
}

#[async_trait]
impl WorkerHandler for Batches {
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        let WorkerPayload::Batch { id, .. } = &payload else { return self.calls.handle(payload).await };
        let mut running = JoinSet::new();
        let mut failed: Option<PortError> = None;
        for (index, call) in payload.batch_calls().into_iter().enumerate() {
            match call {
                Ok(call) => {
                    let calls = self.calls.clone();
                    running.spawn(async move { calls.handle(call).await });
                }
                Err(unreadable) => {
                    if let Err(e) = self.dead_letter(id, index, unreadable).await {
                        failed.get_or_insert(e);
                    }
                }
            }
        }
        let mut records = Vec::new();
        while let Some(done) = running.join_next().await {
            match done {
                Ok(Ok(record)) => records.extend(record),
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(PortError::Transient(format!("a call of batch {id} did not finish: {e}")));
                }
            }
        }
        if let Some(results) = &self.results {
            for record in &records {
                if let Err(e) = results.record_outcome(record).await {
                    failed.get_or_insert(e);
                }
            }
        }
        info!(batch = %id, calls = payload.job_count(), records = records.len(), failed = failed.is_some(), "batch done");
        failed.map_or(Ok(None), Err)
    }
}
