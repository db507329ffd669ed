//! A stack of many lanes hands every job to one handler, which finds the job's lane its
//! own worker: its API client (the lane's headers, its base URL), its state in the store
//! (circuit, cool-down, call records and slots), its cap on calls in flight. Each lane's
//! worker is built the first time a payload of the lane comes, and kept. A lane whose
//! worker cannot be built (its key's environment variable is not set) has its jobs
//! dead-lettered with reason `credentials`, never called without the key, and no other
//! lane is touched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use paceline_shared::job::{DeadLetterCause, DeadLetterReason, WorkerPayload};
use paceline_shared::lane::LaneId;
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::ports::{JobQueue, PortResult, WorkerHandler};
use tracing::warn;

use crate::Worker;

/// Builds lane `id`'s worker, or says why it cannot (never with a secret in it).
pub type BuildLaneWorker = dyn Fn(&LaneId) -> Result<Worker, String> + Send + Sync;

/// Each lane's worker, built on first use.
pub struct LaneWorkers {
    build: Box<BuildLaneWorker>,
    workers: Mutex<HashMap<LaneId, Arc<Worker>>>,
    /// Where a job whose lane has no worker goes, with its reason.
    queue: Arc<dyn JobQueue>,
}

impl LaneWorkers {
    #[must_use]
    pub fn new(build: Box<BuildLaneWorker>, queue: Arc<dyn JobQueue>) -> Self {
        Self { build, workers: Mutex::new(HashMap::new()), queue }
    }

    /// Lane `lane`'s worker, built now if this is its first payload.
    fn worker(&self, lane: &LaneId) -> Result<Arc<Worker>, String> {
        let mut workers = self.workers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(worker) = workers.get(lane) {
            return Ok(worker.clone());
        }
        let worker = Arc::new((self.build)(lane)?);
        workers.insert(lane.clone(), worker.clone());
        Ok(worker)
    }
}

impl LaneWorkers {
    /// Runs each lane's share of batch `id` on that lane's worker, all at once; entries
    /// that name no lane (they cannot be read) go to the default lane's, which
    /// dead-letters them.
    async fn split_by_lane(&self, id: &str, payload: &WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        let mut shares: HashMap<LaneId, Vec<serde_json::Value>> = HashMap::new();
        for call in payload.batch_calls() {
            let (lane, entry) = match call {
                Ok(call) => {
                    let lane = match &call {
                        WorkerPayload::Job { job, .. } => job.lane.clone(),
                        _ => LaneId::default(),
                    };
                    (lane, serde_json::to_value(&call).unwrap_or_default())
                }
                Err(unreadable) => (LaneId::default(), unreadable.entry),
            };
            shares.entry(lane).or_default().push(entry);
        }
        let runs: futures_util::stream::FuturesUnordered<_> = shares
            .into_iter()
            .map(|(lane, calls)| async move { self.on_lane(&lane, WorkerPayload::Batch { id: format!("{id}/{lane}"), calls }).await })
            .collect();
        let ended: Vec<PortResult<Option<OutcomeRecord>>> = futures_util::StreamExt::collect(runs).await;
        ended.into_iter().find(Result::is_err).unwrap_or(Ok(None))
    }

    /// Runs `payload` (a job, a health check, or a batch of one lane's jobs) on lane
    /// `lane`'s worker, or dead-letters its jobs with reason `credentials` when the lane
    /// has none.
    async fn on_lane(&self, lane: &LaneId, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        let why = match self.worker(lane) {
            Ok(worker) => return worker.handle(payload).await,
            Err(why) => why,
        };
        warn!(%lane, %why, "the lane has no worker: its jobs are dead-lettered");
        for call in payload.batch_calls().into_iter().flatten() {
            if let WorkerPayload::Job { job, attempt, .. } = call {
                let reason = DeadLetterReason { cause: DeadLetterCause::Credentials, detail: format!("lane {lane}: {why}"), outcome: None };
                self.queue.dead_letter(job.id.as_str(), &job.to_json(), attempt, &reason).await?;
            }
        }
        Ok(None)
    }
}

#[async_trait]
impl WorkerHandler for LaneWorkers {
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        let lane = match &payload {
            WorkerPayload::Job { job, .. } => job.lane.clone(),
            WorkerPayload::HealthCheck { lane, .. } => lane.clone(),
            // A lane's worker keeps its own batch records: each lane's share goes to it.
            WorkerPayload::Batch { id, .. } => return self.split_by_lane(id, &payload).await,
        };
        self.on_lane(&lane, payload).await
    }
}
