//! A stack of many lanes hands every job to one handler, which finds the job's lane its
//! own worker: its API client (the lane's headers, its base URL), its state in the store
//! (circuit, cool-down, call records and slots), its cap on calls in flight. Each lane's
//! worker is built the first time a payload of the lane comes, and kept (on Lambda, for
//! a while: its keys are read again from Secrets Manager after it). A lane whose worker
//! cannot be built (its key cannot be read) has its jobs dead-lettered with reason
//! `credentials`, never called without the key, and no other lane is touched; each such
//! job's call record is claimed and marked done as a call's is, so a job delivered twice
//! is dead-lettered once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use paceline_shared::config::{ApiConfig, CoolDownScope, LanesConfig, RetryConfig};
use paceline_shared::job::Job;
use paceline_shared::job::{DeadLetterCause, DeadLetterReason, WorkerPayload};
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::ports::{call_record_key, CallClaim, JobQueue, PortError, PortResult, ScopedStores, WorkerHandler};
use paceline_shared::time::{Clock, UnixMillis};
use tracing::{info, warn};

use crate::{call_holder, ApiClient, CallSlots, Worker, WorkerStats, CALL_RECORD_KEEP};

/// A lane's worker being built: the worker, or why it cannot be (never with a secret in it).
pub type LaneWorkerBuild = BoxFuture<'static, Result<Worker, String>>;

/// Builds lane `id`'s worker.
pub type BuildLaneWorker = dyn Fn(LaneId) -> LaneWorkerBuild + Send + Sync;

/// How soon a lane whose worker could not be built is tried again (its jobs meanwhile
/// are dead-lettered as `credentials`): a secret created after the first job is found
/// within this, and a lane without one costs Secrets Manager a read this often at most.
pub const RETRY_FAILED_BUILD: Duration = Duration::from_secs(30);

/// What every lane's worker of a stack is built from: the lanes' settings, the stack's
/// API, its queue and stores, the retry rules and one count of what all lanes did.
#[derive(Clone)]
pub struct LaneStack {
    pub lanes: LanesConfig,
    /// The stack's `[api]`: a lane's headers and base URL go over it.
    pub api: ApiConfig,
    /// The most of an answer's body an outcome record keeps.
    pub body_cap: usize,
    pub retry: RetryConfig,
    pub queue: Arc<dyn JobQueue>,
    /// In a stack of shards, each shard's jobs queue by index: a lane's jobs go back to
    /// its shard's (empty: all go to `queue`).
    pub shard_queues: Vec<Arc<dyn JobQueue>>,
    pub stores: Arc<dyn ScopedStores>,
    pub clock: Arc<dyn Clock>,
    pub stats: Arc<WorkerStats>,
}

impl LaneStack {
    /// Lane `lane`'s worker, its keys read from `env`: its API, its state in its own
    /// scope, its cap on calls in flight, and with `on_429 = "stack"` a 429 cooling every
    /// lane down.
    ///
    /// # Errors
    /// The header whose key `env` does not hold, or an API client that cannot be built.
    pub fn worker(&self, lane: &LaneId, env: &dyn Fn(&str) -> Option<String>) -> Result<Worker, String> {
        let settings = self.lanes.lane(lane);
        let api = settings.api_for(lane, &self.api, env).map_err(|e| e.to_string())?;
        let client = ApiClient::new(&api).map_err(|e| e.to_string())?.keeping_bodies(self.body_cap);
        let store = self.stores.scoped(&StoreScope::Lane(lane.clone()));
        let worker = Worker::new(Arc::new(client), self.queue_of(lane), store, self.clock.clone(), self.retry, api.health_check.clone());
        let worker = match self.lanes.on_429 {
            CoolDownScope::Stack => worker.with_stack_cool_down(self.stores.scoped(&StoreScope::Stack)),
            CoolDownScope::Lane => worker,
        };
        Ok(worker.with_stats(self.stats.clone()).with_call_slots(CallSlots::for_api(settings.quota.max_in_flight(), api.timeout)).with_api_timeout(api.timeout))
    }

    /// Where lane `lane`'s jobs go back to: its shard's queue (by the hash of its id; a
    /// lane moved off that shard has its jobs sent on from there, as any job that comes
    /// to a shard its lane has left), or the stack's one queue.
    fn queue_of(&self, lane: &LaneId) -> Arc<dyn JobQueue> {
        match self.shard_queues.len() {
            0 => self.queue.clone(),
            shards => self.shard_queues[lane.shard(shards)].clone(),
        }
    }
}

/// A lane's worker as last built: the worker or why there is none, and when.
struct Built {
    worker: Result<Arc<Worker>, String>,
    at: UnixMillis,
}

/// How long a job of a lane without a worker holds its call record's claim while it is
/// dead-lettered.
const DEAD_LETTER_CLAIM: Duration = Duration::from_secs(30);

/// Each lane's worker, built on first use.
pub struct LaneWorkers {
    build: Box<BuildLaneWorker>,
    workers: Mutex<HashMap<LaneId, Built>>,
    /// Where a job whose lane has no worker goes, with its reason.
    queue: Arc<dyn JobQueue>,
    /// Each lane's state: the call records of the jobs dead-lettered for want of a worker.
    stores: Arc<dyn ScopedStores>,
    clock: Arc<dyn Clock>,
    /// How long a built worker is kept (`None`: for good).
    keep_for: Option<Duration>,
}

impl LaneWorkers {
    #[must_use]
    pub fn new(build: Box<BuildLaneWorker>, queue: Arc<dyn JobQueue>, stores: Arc<dyn ScopedStores>, clock: Arc<dyn Clock>) -> Self {
        Self { build, workers: Mutex::new(HashMap::new()), queue, stores, clock, keep_for: None }
    }

    /// The same, building a lane's worker again once it is `keep_for` old (its keys read
    /// anew); a lane whose build failed is tried again after [`RETRY_FAILED_BUILD`] (or
    /// `keep_for`, if shorter).
    #[must_use]
    pub fn rebuilt_after(self, keep_for: Duration) -> Self {
        Self { keep_for: Some(keep_for), ..self }
    }

    /// Lane `lane`'s worker, built now if this is its first payload or the last build
    /// is too old.
    async fn worker(&self, lane: &LaneId) -> Result<Arc<Worker>, String> {
        {
            let workers = self.workers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(built) = workers.get(lane).filter(|built| self.still_good(built)) {
                return built.worker.clone();
            }
        }
        // Two payloads of a new lane at once may both build it: the later one is kept.
        let at = self.keep_for.map_or_else(UnixMillis::default, |_| self.clock.now());
        let worker = (self.build)(lane.clone()).await.map(Arc::new);
        let mut workers = self.workers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        workers.insert(lane.clone(), Built { worker: worker.clone(), at });
        worker
    }

    /// Whether `built` serves now: a worker within its keep, a failure within
    /// [`RETRY_FAILED_BUILD`]; without a keep, a worker for good and a failure never.
    fn still_good(&self, built: &Built) -> bool {
        let Some(keep_for) = self.keep_for else { return built.worker.is_ok() };
        let keep = if built.worker.is_ok() { keep_for } else { RETRY_FAILED_BUILD.min(keep_for) };
        self.clock.now().since(built.at) < keep
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
        let why = match self.worker(lane).await {
            Ok(worker) => return worker.handle(payload).await,
            Err(why) => why,
        };
        warn!(%lane, %why, "the lane has no worker: its jobs are dead-lettered");
        for call in payload.batch_calls().into_iter().flatten() {
            if let WorkerPayload::Job { job, attempt, dispatched_at, .. } = call {
                let reason = DeadLetterReason { cause: DeadLetterCause::Credentials, detail: format!("lane {lane}: {why}"), outcome: None };
                self.dead_letter_once(lane, &job, attempt, dispatched_at, &reason).await?;
            }
        }
        Ok(None)
    }

    /// Dead-letters `attempt` of `job` unless a delivery before this one did: the
    /// attempt's call record (in the lane's state) is claimed first and marked done after,
    /// as a call's is, so that `dlq redrive` (which forgets it) sends the job again.
    ///
    /// # Errors
    /// `Transient` while another delivery of the attempt holds its claim (retried later,
    /// it finds the record done).
    async fn dead_letter_once(&self, lane: &LaneId, job: &Job, attempt: u32, dispatched_at: UnixMillis, reason: &DeadLetterReason) -> PortResult<()> {
        let store = self.stores.scoped(&StoreScope::Lane(lane.clone()));
        let record = call_record_key(job.id.as_str(), attempt);
        let holder = call_holder(job, attempt, dispatched_at);
        let now = self.clock.now();
        match store.claim_call(&record, &holder, now, now.plus(DEAD_LETTER_CLAIM)).await? {
            CallClaim::Taken => {}
            CallClaim::Done => {
                info!(job_id = %job.id, attempt, "a repeated delivery of an attempt already dead-lettered: not again");
                return Ok(());
            }
            CallClaim::Calling | CallClaim::ClaimedBefore => {
                return Err(PortError::Transient(format!("another delivery of job {} attempt {attempt} is settling it", job.id)));
            }
        }
        self.queue.dead_letter(job.id.as_str(), &job.to_json(), attempt, reason).await?;
        store.finish_call(&record, self.clock.now().plus(CALL_RECORD_KEEP)).await
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
