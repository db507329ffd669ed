//! `paceline simulate --lanes N --skew zipf:S`: many lanes in one embedded stack under
//! virtual time. A backlog whose jobs fall on N lanes by a Zipf law (a few tenants with
//! most of the work) drains through the real orchestrator on an in-memory embedded store;
//! every call is checked against its lane's tiers and the shared ones, and the report
//! gives the violations, how much of the shared quota was used while the lanes could use
//! it, Jain's fairness index among backlogged lanes and the jobs' waits. The baselines
//! drain the same backlog first-come first-served over one queue (a queue without
//! groups) and by unweighted round robin over the lanes, each call as soon as its
//! lane's tiers and the shared ones allow it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use paceline_orchestrator::{jain_index, BatchingInvoker, Orchestrator, RunOptions, Settings};
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::config::LanesConfig;
use paceline_shared::job::{CallSlot, DeadLetterReason, Job, WorkerPayload};
use paceline_shared::keys::{Shard, StoreScope};
use paceline_shared::lane::LaneId;
use paceline_shared::order::OrderState;
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::pacer::{Decision, PacerState};
use paceline_shared::ports::{Invoker, JobQueue, OutgoingMessage, PortResult, ScopedStores, StateStore, WorkerHandler};
use paceline_shared::quota::{Period, Quota};
use paceline_shared::shares::shard_quota;
use paceline_shared::time::{Clock, TokioClock, UnixMillis};
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};
use rand_pcg::Pcg64Mcg;
use serde::Serialize;

use crate::aws::{SimLambda, SimQueue, SimStore, SimStores, World};
use crate::profile::{LatencyProfile, Sampler, Stream};
use crate::runs::{FunctionTiming, OrchestratorRuns, SimRelay, ORCHESTRATOR_TIMEOUT, SCHEDULE};
use crate::SIM_START;

/// The windows fairness and the shared quota's use are measured over, from the first call.
const WINDOW: Duration = Duration::from_secs(10);

/// One simulation of many lanes.
#[derive(Clone, Debug)]
pub struct LanesPlan {
    pub lanes: usize,
    /// How the jobs fall on the lanes.
    pub skew: Skew,
    pub jobs: usize,
    pub seed: u64,
    /// The stack's settings: the shared quota, and `lanes` with every lane's own.
    pub settings: Settings,
    /// The jobs queue the orchestrator receives from.
    pub queue: LanesQueue,
    /// Where the calls are made: by workers in the orchestrator's process, at each
    /// hand-off (none), or by simulated Lambda workers that carry batches and wait for
    /// each job's slot.
    pub lambda: Option<LambdaWorkers>,
    /// Shards, each with its own jobs queue, orchestrator and state, its lanes chosen by
    /// [`LaneId::shard`] and the shared tiers divided among them: the rolling tiers
    /// moving to where the work is through one share book (`paceline_shared::shares`), or
    /// with `fixed_shares` evenly and for good ([`Quota::share`]), the calendar tiers
    /// reserved from one counter; 1 for one orchestrator.
    pub shards: usize,
    pub fixed_shares: bool,
    /// The services' latencies (`simulate --latency`): SQS, DynamoDB, a Lambda worker's
    /// start, the API.
    pub profile: LatencyProfile,
    /// Each shard's orchestrator runs as deployed on AWS (`simulate --runs`): kicked
    /// every minute, each run relaying to the next, a run's jobs in hand given back to
    /// the queue when it stops; otherwise one run drains the whole backlog.
    pub runs: bool,
}

/// Simulated Lambda workers for a simulation of lanes: the account's concurrent
/// executions, and how old an event may grow while it is throttled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LambdaWorkers {
    pub concurrency: u64,
    pub max_event_age: Duration,
}

/// The jobs queue of a simulation of lanes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LanesQueue {
    /// The embedded store's (messages in line).
    #[default]
    Embedded,
    /// SQS, with its latencies and request count: a standard queue without message
    /// groups.
    Sqs,
    /// SQS as Paceline sends to it, each job in its lane's message group: a fair queue.
    SqsFair,
    /// A FIFO SQS queue, each lane a message group (what ordered lanes need).
    SqsFifo,
}

impl std::str::FromStr for LanesQueue {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "embedded" => Ok(Self::Embedded),
            "sqs" => Ok(Self::Sqs),
            "sqs-fair" => Ok(Self::SqsFair),
            "sqs-fifo" => Ok(Self::SqsFifo),
            other => Err(format!("`{other}` is not a queue: embedded, sqs, sqs-fair or sqs-fifo")),
        }
    }
}

impl LanesPlan {
    fn lanes_config(&self) -> &LanesConfig {
        self.settings.lanes.as_ref().expect("a plan of lanes has [lanes]")
    }

    /// The id of the `index`-th lane (from 0).
    fn lane_id(&self, index: usize) -> LaneId {
        LaneId::parse(&format!("t{:0width$}", index + 1, width = self.lanes.to_string().len())).expect("a valid lane id")
    }

    /// Each job's lane index, in queue order: lane 0 the busiest.
    fn job_lanes(&self) -> Vec<usize> {
        let mut rng = Pcg64Mcg::seed_from_u64(self.seed);
        match self.skew {
            Skew::Zipf(exponent) if exponent > 0.0 && self.lanes > 1 => {
                let zipf = Zipf::new(self.lanes as f64, exponent).expect("n >= 1 and s > 0");
                (0..self.jobs).map(|_| (zipf.sample(&mut rng) as usize).clamp(1, self.lanes) - 1).collect()
            }
            Skew::HeavyFirst(heavy) if self.lanes > 1 => {
                let heavy = heavy.min(self.jobs);
                (0..self.jobs).map(|job| if job < heavy { 0 } else { 1 + (job - heavy) % (self.lanes - 1) }).collect()
            }
            _ => (0..self.jobs).map(|job| job % self.lanes).collect(),
        }
    }
}

/// How a backlog's jobs fall on the lanes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Skew {
    /// By a Zipf law of this exponent (0: evenly), lane 1 the busiest.
    Zipf(f64),
    /// This many jobs of lane 1 first on the queue, then the rest spread evenly over the
    /// other lanes: light lanes' jobs behind a heavy lane's backlog.
    HeavyFirst(usize),
}

impl std::str::FromStr for Skew {
    type Err = String;

    /// `zipf:S` or `heavy-first:N`.
    fn from_str(text: &str) -> Result<Self, String> {
        if let Some(exponent) = text.strip_prefix("zipf:") {
            return match exponent.parse::<f64>() {
                Ok(s) if s.is_finite() && s >= 0.0 => Ok(Self::Zipf(s)),
                _ => Err(format!("`{exponent}` is not a Zipf exponent: give a number of 0 or more")),
            };
        }
        if let Some(jobs) = text.strip_prefix("heavy-first:") {
            return jobs.parse::<usize>().map(Self::HeavyFirst).map_err(|_| format!("`{jobs}` is not a number of jobs"));
        }
        Err(format!("`{text}` is not zipf:S (e.g. zipf:1.1) nor heavy-first:N (e.g. heavy-first:100000)"))
    }
}

/// A call as the provider saw it.
#[derive(Clone, Copy, Debug)]
struct Call {
    at: UnixMillis,
    lane: usize,
    cost: u64,
}

/// What one dispatcher did with the backlog.
#[derive(Clone, Debug, Serialize)]
pub struct LanesReport {
    pub dispatcher: String,
    pub lanes: usize,
    pub jobs: usize,
    /// Lanes that had jobs.
    pub lanes_with_jobs: usize,
    /// Hand-offs made: more than the jobs if a job went twice.
    pub calls: usize,
    /// From the start to the last call.
    pub seconds: f64,
    /// From the start to the first call (a Lambda worker's hand-off ahead of its slot,
    /// the kick of the first run): the windows below count from the first call, as a
    /// single lane's use of its tiers does.
    pub first_call_seconds: f64,
    /// Calls over a tier of their own lane (a strict provider refuses them).
    pub lane_violations: u64,
    /// Calls over a shared tier.
    pub shared_violations: u64,
    /// The shared quota's use in the windows where the backlogged lanes could have used it
    /// all (their own tiers together allowed at least as much); `None` when no window did.
    pub shared_utilization: Option<f64>,
    /// Jain's index of each contending lane's calls over its max-min fair share (by
    /// weight, under its own tiers and what it had left), in 10 s windows: the mean and
    /// the lowest. Contending: backlogged throughout the window, with more left than
    /// its share.
    pub jain_index_mean: Option<f64>,
    pub jain_index_min: Option<f64>,
    pub fairness_windows: usize,
    /// How long jobs waited from the start to their call: every job's, and the jobs of
    /// the lanes with fewer jobs than the mean (the light lanes).
    pub wait_p50_seconds: f64,
    pub wait_p99_seconds: f64,
    pub light_wait_p50_seconds: f64,
    pub light_wait_p99_seconds: f64,
    /// The same for the light lanes' jobs had the shared quota been divided max-min
    /// fairly from the start, with no lead and no queue (see `fair_share_times`): the
    /// issue asks the light lanes' p99 to be within its fair share's + 2 s.
    pub light_fair_share_p50_seconds: f64,
    pub light_fair_share_p99_seconds: f64,
    /// SQS requests per job (receives, deletes, visibility changes, sends: the
    /// orchestrator's), on an SQS queue.
    pub sqs_requests_per_job: Option<f64>,
    /// DynamoDB requests per job (the orchestrator's: lease, lanes' reads and
    /// snapshots, reservations), on an SQS queue, whose stack keeps its state there.
    pub dynamodb_requests_per_job: Option<f64>,
    /// The most messages in flight at once on a shard's SQS queue (received or given
    /// back for later, not yet deleted), which SQS holds to about 120,000.
    pub sqs_most_in_flight: Option<u64>,
    /// What SQS (the producers' sends too) and DynamoDB cost per million jobs at list
    /// prices (`sim/src/pricing.rs`), on an SQS queue: the orchestrator's requests, and
    /// with Lambda workers their call records too (in-process workers' are apart).
    pub queue_and_state_usd_per_million: Option<f64>,
    /// With Lambda workers: the most executions at once, the jobs whose events aged out
    /// unrun while throttled, the jobs whose worker started after their slot (re-queued,
    /// no call made), Lambda invokes per job, and the whole cost per million jobs
    /// (Lambda, SQS, the orchestrator's DynamoDB requests and one call-record write a job).
    pub lambda_peak_executions: Option<u64>,
    pub lambda_aged_out_jobs: Option<u64>,
    pub missed_slots: Option<u64>,
    pub lambda_invokes_per_job: Option<f64>,
    pub all_in_usd_per_million: Option<f64>,
    /// Wall-clock seconds the simulation took.
    pub wall_seconds: f64,
    /// Units called each second from the start: the [`PLOTTED_LANES`] lanes with most
    /// calls (by id) and then all the others together; what `--plot` stacks.
    #[serde(skip)]
    pub calls_per_second: Vec<(String, Vec<u32>)>,
}

/// The lanes a plot shows one by one; the others are one band.
pub const PLOTTED_LANES: usize = 6;

/// Records every call the provider sees. Workers in one process call at the slot, which
/// a hand-off without dispatch-ahead is: as the orchestrator's invoker, each hand-off is
/// its call. As simulated Lambda workers' handler, each job of a payload waits for its
/// slot and calls then, or goes back on the queue without a call if its worker started
/// after the slot, as a real worker does.
struct CallLog {
    clock: Arc<dyn Clock>,
    lanes: BTreeMap<LaneId, usize>,
    calls: Mutex<Vec<Call>>,
    /// The services' latencies: a Lambda worker's start, the API's answer, DynamoDB.
    world: Arc<World>,
    /// Each shard's queue (where a job whose slot was missed goes back) and state
    /// (where an ordered lane's job is settled, as its worker would); one without shards.
    shards: Vec<ShardPorts>,
    missed_slots: std::sync::atomic::AtomicU64,
}

/// One shard's jobs queue and state: the embedded store, or SQS and DynamoDB (`table`,
/// where its runs' lease is).
#[derive(Clone)]
struct ShardPorts {
    queue: Arc<dyn JobQueue>,
    state: Arc<dyn StateStore>,
    scoped: Arc<dyn ScopedStores>,
    table: Option<Arc<SimStore>>,
    /// On SQS, the queue itself: what it held in flight.
    sqs: Option<Arc<SimQueue>>,
}

impl ShardPorts {
    /// A shard's queue holding `bodies`, and its state: on SQS the state is in DynamoDB,
    /// as deployed, with its latency and requests.
    async fn build(plan: &LanesPlan, world: &Arc<World>, clock: &Arc<dyn Clock>, bodies: Vec<String>) -> Self {
        match plan.queue {
            LanesQueue::Embedded => {
                let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).expect("an in-memory store").with_ordering(plan.settings.lane_ordering()));
                let messages: Vec<OutgoingMessage> = bodies.into_iter().map(OutgoingMessage::fresh).collect();
                for batch in messages.chunks(10) {
                    store.send(batch).await.expect("enqueue");
                }
                Self { queue: store.clone(), state: store.clone(), scoped: store, table: None, sqs: None }
            }
            LanesQueue::Sqs | LanesQueue::SqsFair | LanesQueue::SqsFifo => {
                let queue = match plan.queue {
                    LanesQueue::SqsFair => SimQueue::fair(world.clone()),
                    LanesQueue::SqsFifo => SimQueue::fifo(world.clone()),
                    _ => SimQueue::new(world.clone()),
                };
                queue.preload(bodies);
                let queue = Arc::new(queue);
                let tables = Arc::new(SimStores::new(world.clone()));
                Self { queue: queue.clone(), state: tables.stack(), scoped: tables.clone(), table: Some(tables.stack()), sqs: Some(queue) }
            }
        }
    }
}

impl CallLog {
    /// The shard a job's lane lives on.
    fn shard_of(&self, job: &Job) -> &ShardPorts {
        &self.shards[job.lane.shard(self.shards.len())]
    }

    fn record(&self, job: &Job) {
        let lane = self.lanes.get(&job.lane).copied().unwrap_or(usize::MAX);
        self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(Call { at: self.clock.now(), lane, cost: job.cost });
    }

    /// Settles an ordered lane's job in its lane's mark once the API answered and the
    /// mark's write is done, as its worker would.
    fn settle_ordered(&self, job: &Job, attempt: u32) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (world, clock, job_id) = (self.world.clone(), self.clock.clone(), job.id.to_string());
        let store = self.shard_of(job).scoped.scoped(&StoreScope::Lane(job.lane.clone()));
        async move {
            world.call(Stream::Api).await;
            world.call(Stream::DynamoDb).await;
            if let Err(e) = store.settle_order(&job_id, attempt, OrderState::Settled { at: clock.now() }).await {
                tracing::warn!(error = %e, "could not settle an ordered job");
            }
        }
    }

    /// A Lambda worker's call of one job: its call record claimed (one DynamoDB write),
    /// then the call at its slot, or the job back on the queue if the slot has passed.
    async fn call_at_slot(&self, job: Job, attempt: u32, slot: Option<CallSlot>) -> PortResult<()> {
        self.world.ledger.count("dynamodb:PutItem (worker call record)", 1);
        self.world.ledger.dynamodb_write_units.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.world.call(Stream::DynamoDb).await;
        if let Some(slot) = slot {
            self.clock.sleep_until(slot.not_before).await;
            let now = self.clock.now();
            if now > slot.call_by {
                // As the worker does: back on the queue uncalled, to be handed off
                // earlier next time, and an ordered lane told it is coming back; or to
                // the DLQ, late again after it carried the most lateness a job learns.
                self.missed_slots.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let shard = self.shard_of(&job);
                let late = now.since(slot.call_by);
                let Some(job) = job.clone().after_late_start(late) else {
                    let reason = DeadLetterReason::late_start(&job, late);
                    return shard.queue.dead_letter(job.id.as_str(), &job.to_json(), attempt, &reason).await;
                };
                let message = OutgoingMessage { ahead: job.ordered, ..OutgoingMessage::again(job.to_json(), attempt, Duration::ZERO) };
                shard.queue.send(&[message]).await?;
                if job.ordered {
                    let store = shard.scoped.scoped(&StoreScope::Lane(job.lane.clone()));
                    store.settle_order(job.id.as_str(), attempt, OrderState::Retrying { at: now }).await?;
                }
                return Ok(());
            }
        }
        self.record(&job);
        if job.ordered {
            self.settle_ordered(&job, attempt).await;
        } else {
            self.world.call(Stream::Api).await;
        }
        Ok(())
    }
}

#[async_trait]
impl Invoker for CallLog {
    async fn invoke(&self, payload: &WorkerPayload, _from_receipt: Option<&str>) -> PortResult<()> {
        if let WorkerPayload::Job { job, .. } = payload {
            self.record(job);
        }
        if let Some((job, attempt)) = payload.ordered_job() {
            let (world, settle) = (self.world.clone(), self.settle_ordered(job, attempt));
            tokio::spawn(async move {
                world.call(Stream::AsyncStart).await;
                settle.await;
            });
        }
        Ok(())
    }
}

#[async_trait]
impl WorkerHandler for CallLog {
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
        let calls = payload.batch_calls().into_iter().filter_map(Result::ok).filter_map(|call| match call {
            WorkerPayload::Job { job, attempt, slot, .. } => Some(self.call_at_slot(job, attempt, slot)),
            _ => None,
        });
        for result in futures_util::future::join_all(calls).await {
            result?;
        }
        Ok(None)
    }
}

/// Drains the plan's backlog through the real orchestrator. Builds its own paused,
/// single-threaded runtime: call it from a plain thread.
///
/// # Panics
/// If the runtime or the in-memory store cannot be built.
#[must_use]
pub fn simulate_lanes(plan: &LanesPlan) -> LanesReport {
    let wall = crate::stopwatch();
    let job_lanes = plan.job_lanes();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("a tokio runtime");
    let (calls, requests, lambda) = runtime.block_on(async {
        let tokio_clock = Arc::new(TokioClock::anchored_at(SIM_START));
        let clock: Arc<dyn Clock> = tokio_clock.clone();
        let lanes: BTreeMap<LaneId, usize> = (0..plan.lanes).map(|i| (plan.lane_id(i), i)).collect();
        let world = Arc::new(World::new(tokio_clock, Sampler::new(plan.seed, plan.profile.clone())));
        // Each lane's jobs on its shard's queue, in queue order.
        let shard_count = plan.shards.max(1);
        let mut bodies: Vec<Vec<String>> = vec![Vec::new(); shard_count];
        for (n, lane) in job_lanes.iter().enumerate() {
            let lane = plan.lane_id(*lane);
            bodies[lane.shard(shard_count)].push(format!(r#"{{"id":"job-{n}","lane":"{lane}","request":{{"method":"GET","path":"/jobs/{n}"}}}}"#));
        }
        let mut shards = Vec::with_capacity(shard_count);
        for bodies in bodies {
            shards.push(ShardPorts::build(plan, &world, &clock, bodies).await);
        }
        let log = Arc::new(CallLog {
            clock: clock.clone(),
            lanes,
            calls: Mutex::new(Vec::new()),
            world: world.clone(),
            shards: shards.clone(),
            missed_slots: std::sync::atomic::AtomicU64::new(0),
        });
        // One account's Lambda for every shard's workers.
        let lambda = plan.lambda.map(|workers| {
            let handler: Arc<dyn WorkerHandler> = log.clone();
            Arc::new(SimLambda::new(world.clone(), handler, Arc::new(Mutex::new(vec![UnixMillis(0); plan.jobs])), plan.jobs).with_executions(
                workers.concurrency,
                workers.max_event_age,
                0.0,
            ))
        });
        // The stack's table, where the shards keep their documents (the book of their
        // shares, the lanes' homes).
        let documents = Arc::new(SimStore::new(world.clone()));
        let shard_queues: Vec<Arc<dyn JobQueue>> = shards.iter().map(|shard| shard.queue.clone()).collect();
        let orchestrators: Vec<Orchestrator> = shards
            .iter()
            .enumerate()
            .map(|(index, shard)| {
                // A shard paces its lanes under its share of the shared tiers.
                let (quota, most) = shard_quota(&plan.settings.quota, index, shard_count).expect("the plan's shared tiers divide among its shards");
                let share_most = most.filter(|_| !plan.fixed_shares);
                let settings = Settings { quota, share_most, shard: Shard { index, of: shard_count }, ..plan.settings.clone() };
                let invoker: Arc<dyn Invoker> = match &lambda {
                    Some(lambda) if settings.worker_batch() > 1 && !settings.hand_off_lead().is_zero() => {
                        Arc::new(BatchingInvoker::for_settings(lambda.clone(), clock.clone(), &settings))
                    }
                    Some(lambda) => lambda.clone(),
                    None => log.clone(),
                };
                let orchestrator = Orchestrator::new(shard.queue.clone(), shard.state.clone(), invoker, clock.clone(), settings)
                    .with_scoped_stores(shard.scoped.clone())
                    .with_stack_documents(documents.clone());
                if shard_count > 1 {
                    orchestrator.with_shard_queues(shard_queues.clone()).expect("a queue for each shard")
                } else {
                    orchestrator
                }
            })
            .collect();
        if plan.runs {
            run_as_deployed(plan, orchestrators, &shards, &world, lambda.as_deref()).await;
        } else {
            drain_in_one_run(&orchestrators, &shards, lambda.as_deref(), &clock).await;
        }
        let calls = log.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let requests = world.ledger.requests();
        let orchestrators = |service: &str| -> u64 {
            requests
                .iter()
                .filter(|(operation, _)| operation.starts_with(service) && !operation.contains("producer") && !operation.contains("worker"))
                .map(|(_, n)| n)
                .sum()
        };
        let cost =
            crate::pricing::estimate(&world.ledger, crate::pricing::FunctionMemory::default(), crate::pricing::TableCapacity::OnDemand, plan.jobs as u64);
        let queue_and_state: f64 =
            cost.lines.iter().filter(|line| line.item.starts_with("SQS") || line.item.starts_with("DynamoDB")).map(|line| line.per_million_jobs_usd).sum();
        let lambda_figures = lambda.map(|lambda| {
            let executions = lambda.executions();
            let load = |counter: &std::sync::atomic::AtomicU64| counter.load(std::sync::atomic::Ordering::Relaxed);
            LambdaFigures {
                peak_executions: load(&executions.peak_executing),
                aged_out_jobs: load(&executions.aged_out_jobs),
                missed_slots: load(&log.missed_slots),
                invokes: requests.iter().filter(|(operation, _)| operation.starts_with("lambda:")).map(|(_, n)| *n).sum(),
                all_in_usd_per_million: cost.per_million_jobs_usd,
            }
        });
        let most_in_flight = shards.iter().filter_map(|shard| shard.sqs.as_ref()).map(|queue| queue.in_flight_peak()).max();
        (calls, (orchestrators("sqs:"), orchestrators("dynamodb:"), queue_and_state, most_in_flight), lambda_figures)
    });
    let dispatcher = match plan.queue {
        LanesQueue::Embedded => "paceline (weighted fair lanes)",
        LanesQueue::Sqs => "paceline on SQS (standard queue)",
        LanesQueue::SqsFair => "paceline on SQS (fair queue)",
        LanesQueue::SqsFifo => "paceline on SQS (FIFO queue)",
    };
    let mut report = analyse(plan, dispatcher, &job_lanes, calls, wall.elapsed());
    let per_job = |requests: u64| (plan.queue != LanesQueue::Embedded).then(|| requests as f64 / plan.jobs.max(1) as f64);
    (report.sqs_requests_per_job, report.dynamodb_requests_per_job) = (per_job(requests.0), per_job(requests.1));
    report.queue_and_state_usd_per_million = (plan.queue != LanesQueue::Embedded).then_some(requests.2);
    report.sqs_most_in_flight = requests.3;
    if plan.shards > 1 {
        report.dispatcher.push_str(&format!(", {} shards", plan.shards));
    }
    if let Some(lambda) = lambda {
        report.dispatcher.push_str(", Lambda workers");
        report.lambda_peak_executions = Some(lambda.peak_executions);
        report.lambda_aged_out_jobs = Some(lambda.aged_out_jobs);
        report.missed_slots = Some(lambda.missed_slots);
        report.lambda_invokes_per_job = Some(lambda.invokes as f64 / plan.jobs.max(1) as f64);
        report.all_in_usd_per_million = Some(lambda.all_in_usd_per_million);
    }
    report
}

/// Each shard's orchestrator in one run that drains its queue, run again while Lambda
/// workers put back jobs whose slots they missed.
async fn drain_in_one_run(orchestrators: &[Orchestrator], shards: &[ShardPorts], lambda: Option<&SimLambda>, clock: &Arc<dyn Clock>) {
    let opts = RunOptions { holder: "simulate".into(), deadline: SIM_START.plus(Duration::from_secs(400 * 86_400)), drain: true, stop: None };
    loop {
        for result in futures_util::future::join_all(orchestrators.iter().map(|orchestrator| orchestrator.run(&opts))).await {
            if let Err(e) = result {
                tracing::warn!(error = %e, "simulated run failed");
            }
        }
        let Some(lambda) = lambda else { break };
        while lambda.executions().running.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            clock.sleep_until(clock.now().plus(Duration::from_millis(100))).await;
        }
        if all_called(shards, Some(lambda)).await {
            break;
        }
    }
}

/// Each shard's orchestrator as deployed: a run kicked every minute (after the kick's
/// latency), each run relaying to the next before it stops, until every shard's queue
/// is empty and no Lambda worker holds a job.
async fn run_as_deployed(plan: &LanesPlan, orchestrators: Vec<Orchestrator>, shards: &[ShardPorts], world: &Arc<World>, lambda: Option<&SimLambda>) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let timing = FunctionTiming { timeout: ORCHESTRATOR_TIMEOUT, schedule: SCHEDULE, deadline_margin: plan.settings.orchestrator.deadline_margin };
    let mut every_shard = Vec::with_capacity(shards.len());
    let mut relays_served = Vec::with_capacity(shards.len());
    for (orchestrator, shard) in orchestrators.into_iter().zip(shards) {
        let (relays, requests) = tokio::sync::mpsc::unbounded_channel();
        let orchestrator = orchestrator.with_relay(Arc::new(SimRelay::new(world.clone(), relays)));
        let table = shard.table.clone().expect("runs as deployed are on AWS: SQS and DynamoDB");
        let runs = Arc::new(OrchestratorRuns::new(Arc::new(orchestrator), table, world.clone(), timing, stopped.clone()));
        relays_served.push(runs.serve_relays(requests));
        every_shard.push(runs);
    }
    let clock = world.clock.clone();
    let (mut tick, mut kicks) = (SIM_START, 0_u64);
    loop {
        clock.sleep_until(tick.plus(world.sampler.latency(Stream::Kick, kicks))).await;
        if all_called(shards, lambda).await {
            break;
        }
        for runs in &every_shard {
            runs.kick(tick);
        }
        (tick, kicks) = (tick.plus(SCHEDULE), kicks + 1);
    }
    let _ = stop.send(true);
    for runs in &every_shard {
        runs.join().await;
    }
    for served in relays_served {
        served.abort();
    }
}

/// Whether every shard's queue is empty (nothing visible, nothing in flight) and no
/// Lambda worker is running.
async fn all_called(shards: &[ShardPorts], lambda: Option<&SimLambda>) -> bool {
    if lambda.is_some_and(|lambda| lambda.executions().running.load(std::sync::atomic::Ordering::Relaxed) > 0) {
        return false;
    }
    for shard in shards {
        if shard.queue.depth().await.map_or(1, |depth| depth.visible + depth.not_visible) > 0 {
            return false;
        }
    }
    true
}

/// What simulated Lambda workers did in a simulation of lanes.
struct LambdaFigures {
    peak_executions: u64,
    aged_out_jobs: u64,
    missed_slots: u64,
    invokes: u64,
    all_in_usd_per_million: f64,
}

/// The units called each second by the [`PLOTTED_LANES`] lanes with most calls, and by
/// the others together (lanes unknown to the plan among them).
fn plotted_calls(plan: &LanesPlan, calls: &[Call]) -> Vec<(String, Vec<u32>)> {
    let seconds = calls.last().map_or(0, |call| call.at.since(SIM_START).as_secs() as usize + 1);
    let mut units = vec![0_u64; plan.lanes];
    for call in calls.iter().filter(|call| call.lane < plan.lanes) {
        units[call.lane] += call.cost;
    }
    let mut busiest: Vec<usize> = (0..plan.lanes).filter(|lane| units[*lane] > 0).collect();
    busiest.sort_by_key(|lane| (std::cmp::Reverse(units[*lane]), *lane));
    busiest.truncate(PLOTTED_LANES);
    let mut series: Vec<(String, Vec<u32>)> = busiest.iter().map(|lane| (plan.lane_id(*lane).to_string(), vec![0; seconds])).collect();
    series.push(("the other lanes".to_owned(), vec![0; seconds]));
    for call in calls {
        let band = busiest.iter().position(|lane| *lane == call.lane).unwrap_or(series.len() - 1);
        let second = call.at.since(SIM_START).as_secs() as usize;
        series[band].1[second] += u32::try_from(call.cost).unwrap_or(u32::MAX);
    }
    series
}

/// Drains the plan's backlog first-come first-served over one queue: each job, in queue
/// order, goes as soon as its lane's tiers and the shared ones allow it, and no later job
/// before it.
#[must_use]
pub fn first_come_first_served(plan: &LanesPlan) -> LanesReport {
    let wall = crate::stopwatch();
    let job_lanes = plan.job_lanes();
    let mut pacers = Pacers::new(plan);
    let mut now = SIM_START;
    let calls = job_lanes
        .iter()
        .map(|lane| {
            now = pacers.earliest(*lane, now);
            pacers.commit(*lane, now);
            Call { at: now, lane: *lane, cost: 1 }
        })
        .collect();
    analyse(plan, "first come, first served (one queue)", &job_lanes, calls, wall.elapsed())
}

/// Drains the plan's backlog by unweighted round robin over the lanes with jobs: from the
/// lane after the last served, the first whose next job its tiers and the shared ones
/// allow now goes; when none may, time moves on to the first moment one may.
#[must_use]
pub fn round_robin(plan: &LanesPlan) -> LanesReport {
    let wall = crate::stopwatch();
    let job_lanes = plan.job_lanes();
    let mut pending: Vec<VecDeque<usize>> = vec![VecDeque::new(); plan.lanes];
    for (job, lane) in job_lanes.iter().enumerate() {
        pending[*lane].push_back(job);
    }
    let mut pacers = Pacers::new(plan);
    let mut now = SIM_START;
    let mut next = 0;
    let mut calls = Vec::with_capacity(job_lanes.len());
    while calls.len() < job_lanes.len() {
        let ready = (0..plan.lanes).map(|k| (next + k) % plan.lanes).filter(|lane| !pending[*lane].is_empty()).find(|lane| pacers.earliest(*lane, now) == now);
        match ready {
            Some(lane) => {
                pending[lane].pop_front();
                pacers.commit(lane, now);
                calls.push(Call { at: now, lane, cost: 1 });
                next = (lane + 1) % plan.lanes;
            }
            None => now = (0..plan.lanes).filter(|lane| !pending[*lane].is_empty()).map(|lane| pacers.earliest(lane, now)).min().unwrap_or(now),
        }
    }
    analyse(plan, "round robin (unweighted)", &job_lanes, calls, wall.elapsed())
}

/// Every lane's pacer and the shared one, for the baselines.
struct Pacers {
    shared: Quota,
    shared_state: PacerState,
    quotas: Vec<Quota>,
    states: Vec<PacerState>,
}

impl Pacers {
    fn new(plan: &LanesPlan) -> Self {
        let quotas: Vec<Quota> = (0..plan.lanes).map(|i| plan.lanes_config().lane(&plan.lane_id(i)).quota.clone()).collect();
        let states = quotas.iter().map(PacerState::new).collect();
        Self { shared_state: PacerState::new(&plan.settings.quota), shared: plan.settings.quota.clone(), quotas, states }
    }

    /// The first moment from `now` at which both `lane`'s tiers and the shared ones take
    /// one unit.
    fn earliest(&self, lane: usize, now: UnixMillis) -> UnixMillis {
        let mut at = now;
        loop {
            let lane_at = wait_until(&self.quotas[lane], &self.states[lane], at);
            let shared_at = wait_until(&self.shared, &self.shared_state, lane_at);
            if shared_at == at {
                return at;
            }
            at = shared_at;
        }
    }

    fn commit(&mut self, lane: usize, at: UnixMillis) {
        self.states[lane].commit(&self.quotas[lane], 1, at);
        self.shared_state.commit(&self.shared, 1, at);
    }
}

/// The first moment from `at` that `quota` takes one more unit.
fn wait_until(quota: &Quota, state: &PacerState, at: UnixMillis) -> UnixMillis {
    match quota.decide(state, 1, at) {
        Decision::WaitUntil { at, .. } => at,
        _ => at,
    }
}

/// Calls over a tier's limit in any window of it (for a calendar tier, its day or month).
fn calls_over(quota: &Quota, calls: &[(UnixMillis, u64)]) -> u64 {
    let mut over = 0;
    for tier in quota.tiers() {
        let mut first = 0;
        let mut units = 0;
        for (i, (at, cost)) in calls.iter().enumerate() {
            units += cost;
            let window_start = match tier.period {
                Period::Rolling(d) => at.minus(d),
                Period::Day | Period::Month => tier.window_at(quota.zone(), *at).0.minus(Duration::from_millis(1)),
            };
            while first < i && calls[first].0 <= window_start {
                units -= calls[first].1;
                first += 1;
            }
            if units > tier.limit {
                over += 1;
            }
        }
    }
    over
}

/// A lane's most units a second under its own rolling tiers (unbounded without).
fn own_rate(quota: &Quota) -> f64 {
    quota.pace_per_second()
}

/// Max-min fair shares of `capacity` among lanes with `caps` and `weights`: each lane
/// gets its weight's share, no more than its cap, what a capped lane leaves going to
/// the others (water-filling).
fn fair_shares(capacity: f64, caps: &[f64], weights: &[f64]) -> Vec<f64> {
    let mut shares = vec![0.0; caps.len()];
    let mut open: Vec<usize> = (0..caps.len()).collect();
    let mut left = capacity;
    while !open.is_empty() && left > 1e-9 {
        let weight: f64 = open.iter().map(|i| weights[*i]).sum();
        let capped: Vec<usize> = open.iter().copied().filter(|i| caps[*i] - shares[*i] <= left * weights[*i] / weight).collect();
        if capped.is_empty() {
            for i in &open {
                shares[*i] += left * weights[*i] / weight;
            }
            break;
        }
        for i in &capped {
            left -= caps[*i] - shares[*i];
            shares[*i] = caps[*i];
        }
        open.retain(|i| !capped.contains(i));
    }
    shares
}

/// Each lane's max-min fair share of `capacity` over a window, among the lanes with
/// units `left` when it began, each asking no more than its `own_caps` and its units
/// left (0 for a lane with none): a lane with 20 jobs left is owed 20, and the rest goes
/// to the others.
fn fair_shares_of_what_is_left(capacity: f64, left: &[u64], own_caps: &[f64], weights: &[f64]) -> Vec<f64> {
    let asking: Vec<usize> = (0..left.len()).filter(|lane| left[*lane] > 0).collect();
    let asks: Vec<f64> = asking.iter().map(|lane| own_caps[*lane].min(left[*lane] as f64)).collect();
    let asking_weights: Vec<f64> = asking.iter().map(|lane| weights[*lane]).collect();
    let mut fair = vec![0.0; left.len()];
    for (lane, share) in asking.iter().zip(fair_shares(capacity, &asks, &asking_weights)) {
        fair[*lane] = share;
    }
    fair
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// When each unit of each lane would go, in seconds from the start, were `pace` units a
/// second divided max-min fairly among the lanes with units left from the start (by
/// `weights`, none faster than its `own_paces`, a lane that runs out leaving its part to
/// the others): the fair share a lane's wait is measured against. Fluid: the k-th unit
/// goes when the lane's part reaches k.
fn fair_share_times(pace: f64, units: &[u64], own_paces: &[f64], weights: &[f64]) -> Vec<Vec<f64>> {
    let mut times: Vec<Vec<f64>> = units.iter().map(|n| Vec::with_capacity(usize::try_from(*n).unwrap_or(0))).collect();
    let mut given = vec![0.0_f64; units.len()];
    let mut now = 0.0;
    loop {
        let open: Vec<usize> = (0..units.len()).filter(|lane| (times[*lane].len() as u64) < units[*lane]).collect();
        if open.is_empty() {
            return times;
        }
        let caps: Vec<f64> = open.iter().map(|lane| own_paces[*lane]).collect();
        let open_weights: Vec<f64> = open.iter().map(|lane| weights[*lane]).collect();
        let rates = fair_shares(pace, &caps, &open_weights);
        // Until the next lane runs out of units.
        let step = open.iter().zip(&rates).map(|(lane, rate)| (units[*lane] as f64 - given[*lane]) / rate).fold(f64::INFINITY, f64::min);
        if !step.is_finite() {
            // No pace at all, or an unbounded one: what is left goes at once, or never.
            let at = if pace > 0.0 { now } else { f64::INFINITY };
            for lane in open {
                times[lane].resize(usize::try_from(units[lane]).unwrap_or(0), at);
            }
            return times;
        }
        for (lane, rate) in open.into_iter().zip(rates) {
            let reached = given[lane] + rate * step;
            while (times[lane].len() as u64) < units[lane] && (times[lane].len() + 1) as f64 <= reached + 1e-9 {
                let unit = (times[lane].len() + 1) as f64;
                times[lane].push(now + (unit - given[lane]) / rate);
            }
            given[lane] = reached;
        }
        now += step;
    }
}

/// The report of `calls`, made by `dispatcher` for the plan's jobs (`job_lanes`).
fn analyse(plan: &LanesPlan, dispatcher: &str, job_lanes: &[usize], mut calls: Vec<Call>, wall: Duration) -> LanesReport {
    calls.sort_by_key(|call| call.at);
    let lanes_config = plan.lanes_config();
    let quotas: Vec<&Quota> = (0..plan.lanes).map(|i| &lanes_config.lane(&plan.lane_id(i)).quota).collect();
    let weights: Vec<f64> = (0..plan.lanes).map(|i| lanes_config.lane(&plan.lane_id(i)).weight).collect();
    let mut by_lane: Vec<Vec<(UnixMillis, u64)>> = vec![Vec::new(); plan.lanes];
    for call in calls.iter().filter(|call| call.lane < plan.lanes) {
        by_lane[call.lane].push((call.at, call.cost));
    }
    let lane_violations = by_lane.iter().zip(&quotas).map(|(lane_calls, quota)| calls_over(quota, lane_calls)).sum();
    let all: Vec<(UnixMillis, u64)> = calls.iter().map(|call| (call.at, call.cost)).collect();
    let shared_violations = calls_over(&plan.settings.quota, &all);
    let (start, end) = (calls.first().map_or(SIM_START, |call| call.at), calls.last().map_or(SIM_START, |call| call.at));
    let last_call: Vec<Option<UnixMillis>> = by_lane.iter().map(|lane_calls| lane_calls.last().map(|(at, _)| *at)).collect();

    // Window by window: the lanes backlogged throughout (their last call after it), their
    // fair shares, what they got, and the shared quota's use where their own tiers let
    // them use it all. The fair shares are max-min over every lane with units left when
    // the window began, each asking no more than it could still call: its own tiers'
    // pace over the window, and those units (a lane with 20 jobs left is owed 20, and a
    // lane that runs out within the window takes its part of the quota with it).
    let window_ms = u64::try_from(WINDOW.as_millis()).unwrap_or(u64::MAX);
    let windows = usize::try_from(end.since(start).as_millis() as u64 / window_ms).unwrap_or(0);
    let mut got = vec![vec![0_u64; plan.lanes]; windows];
    for call in calls.iter().filter(|call| call.lane < plan.lanes) {
        let w = usize::try_from(call.at.since(start).as_millis() as u64 / window_ms).unwrap_or(usize::MAX);
        if w < windows {
            got[w][call.lane] += call.cost;
        }
    }
    let capacity = plan.settings.quota.pace_per_second() * WINDOW.as_secs_f64();
    let units: Vec<u64> = by_lane.iter().map(|lane_calls| lane_calls.iter().map(|(_, cost)| cost).sum()).collect();
    let mut left = units.clone();
    let own_paces: Vec<f64> = quotas.iter().map(|quota| own_rate(quota)).collect();
    let own_caps: Vec<f64> = own_paces.iter().map(|pace| pace * WINDOW.as_secs_f64()).collect();
    let (mut indexes, mut used, mut usable) = (Vec::new(), 0.0, 0.0);
    for (w, got) in got.iter().enumerate() {
        let window_end = start.plus(WINDOW * u32::try_from(w + 1).unwrap_or(u32::MAX));
        let backlogged: Vec<usize> = (0..plan.lanes).filter(|lane| last_call[*lane].is_some_and(|last| last >= window_end)).collect();
        let caps: Vec<f64> = backlogged.iter().map(|lane| own_caps[*lane]).collect();
        let fair = fair_shares_of_what_is_left(capacity, &left, &own_caps, &weights);
        // Contending: backlogged, with more left than its share (a lane owed all it had
        // left is not short of the quota, whatever the window's edge cut off).
        let contending: Vec<usize> = backlogged.iter().copied().filter(|lane| left[*lane] as f64 > fair[*lane] + 1e-9).collect();
        for (lane, units) in got.iter().enumerate() {
            left[lane] = left[lane].saturating_sub(*units);
        }
        if caps.iter().sum::<f64>() >= capacity {
            usable += capacity;
            used += got.iter().sum::<u64>() as f64;
        }
        if contending.len() >= 2 {
            let ratios: Vec<f64> = contending.iter().map(|lane| got[*lane] as f64 / fair[*lane].max(1e-9)).collect();
            indexes.push(jain_index(&ratios));
        }
    }
    let mut waits: Vec<f64> = calls.iter().map(|call| call.at.since(SIM_START).as_secs_f64()).collect();
    waits.sort_by(f64::total_cmp);
    let mut jobs_of = vec![0_usize; plan.lanes];
    for lane in job_lanes {
        jobs_of[*lane] += 1;
    }
    let lanes_with_jobs = jobs_of.iter().filter(|n| **n > 0).count();
    let mean = job_lanes.len() as f64 / lanes_with_jobs.max(1) as f64;
    let is_light = |lane: usize| (jobs_of[lane] as f64) < mean;
    let mut light: Vec<f64> =
        calls.iter().filter(|call| call.lane < plan.lanes && is_light(call.lane)).map(|call| call.at.since(SIM_START).as_secs_f64()).collect();
    light.sort_by(f64::total_cmp);
    let fair_times = fair_share_times(plan.settings.quota.pace_per_second(), &units, &own_paces, &weights);
    let mut light_fair: Vec<f64> = fair_times.into_iter().enumerate().filter(|(lane, _)| is_light(*lane)).flat_map(|(_, times)| times).collect();
    light_fair.sort_by(f64::total_cmp);
    let calls_per_second = plotted_calls(plan, &calls);
    LanesReport {
        calls_per_second,
        dispatcher: dispatcher.to_owned(),
        lanes: plan.lanes,
        jobs: plan.jobs,
        lanes_with_jobs,
        calls: calls.len(),
        seconds: end.since(SIM_START).as_secs_f64(),
        first_call_seconds: start.since(SIM_START).as_secs_f64(),
        lane_violations,
        shared_violations,
        shared_utilization: (usable > 0.0).then(|| used / usable),
        jain_index_mean: (!indexes.is_empty()).then(|| indexes.iter().sum::<f64>() / indexes.len() as f64),
        jain_index_min: indexes.iter().copied().reduce(f64::min),
        fairness_windows: indexes.len(),
        wait_p50_seconds: percentile(&waits, 0.5),
        wait_p99_seconds: percentile(&waits, 0.99),
        light_wait_p50_seconds: percentile(&light, 0.5),
        light_wait_p99_seconds: percentile(&light, 0.99),
        light_fair_share_p50_seconds: percentile(&light_fair, 0.5),
        light_fair_share_p99_seconds: percentile(&light_fair, 0.99),
        sqs_requests_per_job: None,
        dynamodb_requests_per_job: None,
        sqs_most_in_flight: None,
        queue_and_state_usd_per_million: None,
        lambda_peak_executions: None,
        lambda_aged_out_jobs: None,
        missed_slots: None,
        lambda_invokes_per_job: None,
        all_in_usd_per_million: None,
        wall_seconds: wall.as_secs_f64(),
    }
}

/// One figure of a report, as the table shows it.
type ReportCell = fn(&LanesReport) -> String;

/// `value` to `digits` decimals, or `-` when there is none.
fn optional(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The reports side by side, one column each.
#[must_use]
pub fn render_lanes(reports: &[LanesReport]) -> String {
    let Some(first) = reports.first() else { return String::new() };
    let mut out = format!("{} jobs over {} lanes ({} with jobs)\n", first.jobs, first.lanes, first.lanes_with_jobs);
    let mut header = vec!["".to_owned()];
    header.extend(reports.iter().map(|r| r.dispatcher.clone()));
    let mut table = paceline_shared::table::text_table(&header.iter().map(String::as_str).collect::<Vec<_>>(), &(1..=reports.len()).collect::<Vec<_>>());
    let rows: [(&str, ReportCell); 18] = [
        ("drained in", |r| format!("{:.1} s", r.seconds)),
        ("first call, from the start", |r| format!("{:.2} s", r.first_call_seconds)),
        ("calls over a lane's tier", |r| r.lane_violations.to_string()),
        ("calls over a shared tier", |r| r.shared_violations.to_string()),
        ("shared tier used (while the lanes could)", |r| optional(r.shared_utilization.map(|u| u * 100.0), 2) + " %"),
        ("Jain's index, mean (10 s windows)", |r| optional(r.jain_index_mean, 4)),
        ("Jain's index, lowest", |r| optional(r.jain_index_min, 4)),
        ("job wait p50 / p99", |r| format!("{:.1} / {:.1} s", r.wait_p50_seconds, r.wait_p99_seconds)),
        ("light lanes' job wait p50 / p99", |r| format!("{:.1} / {:.1} s", r.light_wait_p50_seconds, r.light_wait_p99_seconds)),
        ("  at their fair share from the start", |r| format!("{:.1} / {:.1} s", r.light_fair_share_p50_seconds, r.light_fair_share_p99_seconds)),
        ("SQS requests per job", |r| optional(r.sqs_requests_per_job, 3)),
        ("DynamoDB requests per job", |r| optional(r.dynamodb_requests_per_job, 3)),
        ("SQS messages in flight, most (a shard)", |r| r.sqs_most_in_flight.map_or_else(|| "-".to_owned(), |n| n.to_string())),
        ("SQS and DynamoDB per million jobs", |r| r.queue_and_state_usd_per_million.map_or_else(|| "-".to_owned(), |usd| format!("${usd:.3}"))),
        ("Lambda executions at once, most", |r| r.lambda_peak_executions.map_or_else(|| "-".to_owned(), |n| n.to_string())),
        ("jobs aged out / slots missed", |r| match (r.lambda_aged_out_jobs, r.missed_slots) {
            (Some(aged), Some(missed)) => format!("{aged} / {missed}"),
            _ => "-".to_owned(),
        }),
        ("Lambda invokes per job", |r| optional(r.lambda_invokes_per_job, 4)),
        ("all in, per million jobs", |r| r.all_in_usd_per_million.map_or_else(|| "-".to_owned(), |usd| format!("${usd:.3}"))),
    ];
    for (name, cell) in rows {
        let mut row = vec![name.to_owned()];
        row.extend(reports.iter().map(cell));
        table.add_row(row);
    }
    out += &format!("{table}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use paceline_shared::config::WorkerHost;

    #[test]
    fn max_min_fair_shares_give_a_capped_lane_its_cap_and_the_rest_by_weight() {
        let shares = fair_shares(100.0, &[10.0, 1_000.0, 1_000.0], &[1.0, 1.0, 2.0]);
        assert!((shares[0] - 10.0).abs() < 1e-9 && (shares[1] - 30.0).abs() < 1e-9 && (shares[2] - 60.0).abs() < 1e-9, "{shares:?}");
        let even = fair_shares(90.0, &[1e9; 3], &[1.0; 3]);
        assert!(even.iter().all(|s| (s - 30.0).abs() < 1e-9), "{even:?}");
    }

    #[test]
    fn at_their_fair_share_lanes_divide_the_pace_until_one_runs_out_and_the_others_take_its_part() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // 10 a second between 10 units and 30: 5 a second each until the first is done
        // at 2 s, then the second alone at 10 a second, its last unit at 4 s.
        let times = fair_share_times(10.0, &[10, 30], &[f64::INFINITY; 2], &[1.0; 2]);
        assert!(close(times[0][0], 0.2) && close(times[0][9], 2.0), "{:?}", times[0]);
        assert!(close(times[1][9], 2.0) && close(times[1][10], 2.1) && close(times[1][29], 4.0), "{:?}", times[1]);
        // A lane held to 2 a second by its own tiers leaves 8 to the other; weights 1:3
        // give the open lanes 2.5 and 7.5.
        let capped = fair_share_times(10.0, &[4, 16], &[2.0, f64::INFINITY], &[1.0; 2]);
        assert!(close(capped[0][3], 2.0) && close(capped[1][15], 2.0), "{capped:?}");
        let weighted = fair_share_times(10.0, &[5, 15], &[f64::INFINITY; 2], &[1.0, 3.0]);
        assert!(close(weighted[0][4], 2.0) && close(weighted[1][14], 2.0), "{weighted:?}");
        assert_eq!(fair_share_times(10.0, &[0, 3], &[f64::INFINITY; 2], &[1.0; 2])[0].len(), 0);
    }

    /// Fairness is measured against what a lane could still call: with 20 jobs left it is
    /// owed its 20 (an even third of 300 before, which counted it as starved when the
    /// window's edge cut its last jobs off), a lane with none left is owed nothing, and the
    /// rest goes to the others by weight, each under its own tiers.
    #[test]
    fn a_lane_is_owed_no_more_than_it_has_left_and_the_rest_goes_to_the_others() {
        let fair = fair_shares_of_what_is_left(300.0, &[20, 1_000, 1_000, 0], &[1_000.0, 1_000.0, 100.0, 1_000.0], &[1.0; 4]);
        assert_eq!(fair, vec![20.0, 180.0, 100.0, 0.0]);
    }

    fn plan(lanes: usize, jobs: usize) -> LanesPlan {
        let text =
            "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"50/s\"]\n[lanes]\ntiers = [\"5/s\"]\n[orchestrator]\ndispatch_ahead = \"0s\"\n";
        let settings = settings_of(text, WorkerHost::InProcess);
        LanesPlan {
            lanes,
            skew: Skew::Zipf(1.1),
            jobs,
            seed: 7,
            settings,
            queue: LanesQueue::Embedded,
            lambda: None,
            shards: 1,
            fixed_shares: false,
            profile: LatencyProfile::default(),
            runs: false,
        }
    }

    /// 40 lanes, a few with most of 3,000 jobs: no call over any tier, the shared tier
    /// used while the lanes could, an even division (Jain's index), and light lanes done
    /// long before first-come first-served over one queue gets to them.
    #[test]
    fn lanes_drain_within_every_tier_evenly_and_light_lanes_are_not_held_behind_heavy_ones() {
        let plan = plan(40, 3_000);
        let paceline = simulate_lanes(&plan);
        assert_eq!((paceline.lane_violations, paceline.shared_violations), (0, 0), "{paceline:?}");
        assert!(paceline.shared_utilization.is_some_and(|u| u >= 0.98), "{paceline:?}");
        assert!(paceline.jain_index_mean.is_some_and(|j| j >= 0.99), "{paceline:?}");
        let fcfs = first_come_first_served(&plan);
        assert_eq!((fcfs.lane_violations, fcfs.shared_violations), (0, 0), "the baselines keep the tiers too");
        assert!(
            paceline.light_wait_p99_seconds * 2.0 < fcfs.light_wait_p99_seconds,
            "{} s against {} s",
            paceline.light_wait_p99_seconds,
            fcfs.light_wait_p99_seconds
        );
        let rr = round_robin(&plan);
        assert!(rr.jain_index_mean.is_some_and(|j| j >= 0.99), "{rr:?}");
    }

    /// The plot of a run of many lanes: one panel per shared tier, the six lanes with
    /// most calls and the others as bands stacked in that order, the top band being all
    /// the calls, never over the shared limit.
    #[test]
    fn the_lanes_plot_stacks_the_busiest_lanes_under_the_shared_limit() {
        let plan = plan(40, 1_000);
        let report = simulate_lanes(&plan);
        let figure = crate::plot::lanes_figure(&report, &plan.settings.quota);
        assert_eq!(figure.panels.len(), 1);
        let panel = &figure.panels[0];
        assert!(panel.stacked && panel.lines.len() == PLOTTED_LANES + 1, "{:?}", panel.lines.iter().map(|l| &l.name).collect::<Vec<_>>());
        assert_eq!(panel.lines[0].name, "t01", "the busiest lane at the bottom");
        for pair in panel.lines.windows(2) {
            assert!(pair[0].mean.iter().zip(&pair[1].mean).all(|((_, below), (_, above))| below <= above), "each band includes the ones below it");
        }
        let top = &panel.lines.last().unwrap().mean;
        assert!(top.iter().all(|(_, calls)| *calls <= panel.limit), "{top:?}");
        let called: u32 = report.calls_per_second.iter().flat_map(|(_, calls)| calls).sum();
        assert_eq!(called, 1_000, "every call in a band");
    }

    /// 20 light lanes' jobs behind a heavy lane's 2,000 on the queue: each goes within
    /// its fair share (21 lanes under 50/s: a slot within about 0.4 s) plus a second;
    /// first come, first served holds them behind the whole backlog (40 s).
    #[test]
    fn light_lanes_behind_a_heavy_lane_s_backlog_wait_their_fair_share_not_the_backlog() {
        let plan = LanesPlan { skew: Skew::HeavyFirst(2_000), ..plan(21, 2_020) };
        let paceline = simulate_lanes(&plan);
        assert_eq!((paceline.lane_violations, paceline.shared_violations), (0, 0));
        assert!(paceline.light_wait_p99_seconds <= 21.0 / 50.0 + 1.0, "{paceline:?}");
        let fcfs = first_come_first_served(&plan);
        assert!(fcfs.light_wait_p50_seconds >= 39.0, "{fcfs:?}");
    }

    /// On SQS (its latencies: a receive's result is routed while other receives are on
    /// their way), lanes take jobs into hand by the share they have when the jobs come,
    /// and the share shrinks as more lanes get jobs: 150 lanes of 1,500 jobs under a
    /// shared 50/s. Jobs held past their visibility timeout came back and went twice
    /// (over 2,100 hand-offs, deletes with stale receipts) until the jobs in hand near it
    /// stayed hidden longer.
    #[test]
    fn jobs_a_lane_holds_past_the_visibility_timeout_stay_hidden_and_each_is_handed_off_once() {
        let plan = LanesPlan { queue: LanesQueue::Sqs, ..plan(150, 1_500) };
        let paceline = simulate_lanes(&plan);
        assert_eq!((paceline.calls, paceline.lane_violations, paceline.shared_violations), (1_500, 0, 0), "{paceline:?}");
    }

    #[test]
    fn ordered_lanes_on_a_fifo_queue_call_every_job_once_one_at_a_time_a_lane() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"50/s\"]\n[lanes]\ntiers = [\"5/s\"]\nordering = \"fifo\"\n";
        let settings = settings_of(text, WorkerHost::InProcess);
        let plan = LanesPlan {
            lanes: 3,
            skew: Skew::Zipf(0.0),
            jobs: 60,
            seed: 7,
            settings,
            queue: LanesQueue::SqsFifo,
            lambda: None,
            shards: 1,
            fixed_shares: false,
            profile: LatencyProfile::default(),
            runs: false,
        };
        let ordered = simulate_lanes(&plan);
        assert_eq!((ordered.calls, ordered.lane_violations, ordered.shared_violations), (60, 0, 0), "{ordered:?}");
        // 20 jobs a lane, each after the one before is settled (a Lambda start and the
        // API's answer, 300 ms at the median): far slower than the lanes' 5/s.
        assert!(ordered.seconds > 20.0 * 0.3, "{ordered:?}");
        assert!(ordered.dynamodb_requests_per_job.is_some_and(|n| n >= 3.0), "a mark opened, settled and read for each job: {ordered:?}");
    }

    /// A stack's settings: lanes of tier `lane_tier` under a shared `shared`, their
    /// workers where `workers` says.
    fn lanes_settings(shared: &str, lane_tier: &str, workers: WorkerHost) -> Settings {
        settings_of(&format!("[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"{shared}\"]\n[lanes]\ntiers = [\"{lane_tier}\"]\n"), workers)
    }

    /// A stack's settings from its config `text`, its workers where `workers` says.
    fn settings_of(text: &str, workers: WorkerHost) -> Settings {
        let config = paceline_shared::config::Config::parse(text, std::path::Path::new("/stack"), &|_| None).unwrap();
        Settings::from_config(&config, workers)
    }

    /// The units called in each second from the start, every lane's together.
    fn units_each_second(report: &LanesReport) -> Vec<u32> {
        (0..report.calls_per_second[0].1.len()).map(|second| report.calls_per_second.iter().map(|(_, units)| units[second]).sum()).collect()
    }

    /// `jobs` by a Zipf law (1.1) over `lanes` lanes of tier `lane_tier` under a shared
    /// `shared`, drained on a fair queue with the state in DynamoDB: every job called,
    /// none over any tier.
    fn drained_on_a_fair_queue(shared: &str, lane_tier: &str, lanes: usize, jobs: usize) -> LanesReport {
        let settings = lanes_settings(shared, lane_tier, WorkerHost::InProcess);
        let plan = LanesPlan {
            lanes,
            skew: Skew::Zipf(1.1),
            jobs,
            seed: 1,
            settings,
            queue: LanesQueue::SqsFair,
            lambda: None,
            shards: 1,
            fixed_shares: false,
            profile: LatencyProfile::default(),
            runs: false,
        };
        let paceline = simulate_lanes(&plan);
        assert_eq!((paceline.calls, paceline.lane_violations, paceline.shared_violations), (jobs, 0, 0), "{paceline:?}");
        paceline
    }

    /// `jobs` spread over `lanes` lanes as `skew` says (seed `seed`), on a fair queue, the
    /// calls made by simulated Lambda workers, `concurrency` executions at most.
    fn called_by_lambda_workers(settings: Settings, lanes: usize, skew: Skew, jobs: usize, seed: u64, concurrency: u64) -> LanesPlan {
        let lambda = LambdaWorkers { concurrency, max_event_age: crate::aws::DEFAULT_MAX_EVENT_AGE };
        LanesPlan {
            lanes,
            skew,
            jobs,
            seed,
            settings,
            queue: LanesQueue::SqsFair,
            lambda: Some(lambda),
            shards: 1,
            fixed_shares: false,
            profile: LatencyProfile::default(),
            runs: false,
        }
    }

    /// The report of `jobs` over `lanes` lanes (tiers `shared` and each lane's) called by
    /// Lambda workers as [`called_by_lambda_workers`] plans, having checked that each
    /// job was called once and none over any tier.
    fn every_job_called_once_by_lambda_workers(
        (shared, lane_tier): (&str, &str),
        lanes: usize,
        skew: Skew,
        jobs: usize,
        seed: u64,
        concurrency: u64,
    ) -> LanesReport {
        let settings = lanes_settings(shared, lane_tier, WorkerHost::Lambda);
        let report = simulate_lanes(&called_by_lambda_workers(settings, lanes, skew, jobs, seed, concurrency));
        assert_eq!((report.calls, report.lane_violations, report.shared_violations), (jobs, 0, 0), "{report:?}");
        report
    }

    /// 100 lanes at 20/s under a shared 1,000/s (the jobs spread evenly, so the shared
    /// tier binds throughout), on a fair queue, the calls made by
    /// simulated Lambda workers as deployed: handed off ahead (the default lead) in batches, each
    /// call at its slot. Every job is called once, none over any tier, within an
    /// account's concurrency, and once the first hand-offs are out every second of the
    /// shared tier is used (99% and more), as with workers in process.
    /// 1,000 lanes at a shared 500/s over 80 s, the orchestrator's runs as deployed:
    /// the run that stops at the first minute saves every lane's pace and releases the
    /// lease, and the next goes on at once, no second without calls. Saving the 1,000
    /// lanes' snapshots one after the other took the first run 5.8 s: the next found
    /// them older than the longest window, did not trust them, and held every lane a
    /// window, 5 s without a call.
    #[test]
    fn runs_as_deployed_hand_a_thousand_lanes_over_without_a_second_lost() {
        let settings = lanes_settings("500/s", "100/s", WorkerHost::Lambda);
        let plan = LanesPlan { runs: true, ..called_by_lambda_workers(settings, 1_000, Skew::Zipf(0.0), 40_000, 1, 1_000) };
        let report = simulate_lanes(&plan);
        assert_eq!((report.calls, report.lane_violations, report.shared_violations), (40_000, 0, 0), "{report:?}");
        let each_second = units_each_second(&report);
        let around_the_hand_over = &each_second[55..70];
        assert!(around_the_hand_over.iter().all(|calls| *calls >= 450), "calls in the seconds from 55 s: {around_the_hand_over:?}");
    }

    #[test]
    fn lanes_called_by_lambda_workers_keep_every_tier_within_the_account_s_concurrency() {
        let settings = lanes_settings("1000/s", "20/s", WorkerHost::Lambda);
        let report = simulate_lanes(&called_by_lambda_workers(settings, 100, Skew::Zipf(0.0), 30_000, 3, 50));
        assert_eq!((report.lane_violations, report.shared_violations), (0, 0), "{report:?}");
        assert_eq!(report.calls, 30_000, "every job called once: {report:?}");
        assert!(report.lambda_peak_executions.is_some_and(|peak| (1..=50).contains(&peak)), "{report:?}");
        assert_eq!(report.lambda_aged_out_jobs, Some(0), "{report:?}");
        assert!(report.lambda_invokes_per_job.is_some_and(|invokes| invokes < 0.1), "workers carry batches: {report:?}");
        // The first calls wait for the hand-off's lead and a Lambda start (the first
        // second holds a few dozen); from then on every second is full.
        let per_second = units_each_second(&report);
        let steady = &per_second[2..per_second.len() - 2];
        assert!(steady.iter().all(|units| (990..=1_000).contains(units)), "{per_second:?}");
    }

    /// Ten lanes of 100/s under a shared 10,000/s can go 1,000 calls a second together:
    /// their batches spread over two workers (500 calls a second each), not over the
    /// twenty the shared quota's pace would need, so each carries its stripe's 500 ms of
    /// calls (about 250). Spread over twenty, each batch carried 25: 0.04 invokes a job,
    /// and by a Zipf law at 40,000 calls/s over 4 shards, whose few heavy lanes go on
    /// alone for minutes, the account's 1,000 executions were all taken.
    #[test]
    fn lanes_that_cannot_use_the_shared_quota_gather_their_batches_over_the_workers_their_own_paces_need() {
        let report = every_job_called_once_by_lambda_workers(("10000/s", "100/s"), 10, Skew::Zipf(0.0), 10_000, 1, 1_000);
        assert!(report.lambda_invokes_per_job.is_some_and(|invokes| invokes < 0.01), "{report:?}");
    }

    /// Each lane's state is read before its first job goes, and at the start a hundred
    /// lanes are read one after another. The first lane read took its slots to its whole
    /// lead, the batch window's included (900 ms), while the others were still being
    /// read; the shared quota's schedule goes in order, so the others started after it,
    /// and the shared tier's first second held a few dozen calls. While lanes with jobs
    /// are being read, a lane now takes its slots no further than the hand-off's own
    /// lead, and 100 ms of slack, out: the others start nearer it.
    #[test]
    fn lanes_still_being_read_at_the_start_find_the_shared_quota_not_taken_ahead_of_them() {
        let report = every_job_called_once_by_lambda_workers(("1000/s", "20/s"), 100, Skew::Zipf(0.0), 5_000, 3, 50);
        let per_second = units_each_second(&report);
        // 118 before; a first second full from the lead (400 ms then) and a Lambda start on
        // would hold about 500: the lanes' first receives, whose jobs go the whole lead
        // out, still push the schedule out.
        assert!(per_second[0] >= 250, "the first second: {per_second:?}");
    }

    /// 1,000 lanes at 100/s under a shared 10,000/s, 100,000 jobs by a Zipf law (1.1),
    /// on a fair queue, called by Lambda workers: simulated once for the tests that read
    /// it.
    fn zipf_thousand_lanes_by_lambda_workers() -> &'static LanesReport {
        static REPORT: std::sync::OnceLock<LanesReport> = std::sync::OnceLock::new();
        REPORT.get_or_init(|| every_job_called_once_by_lambda_workers(("10000/s", "100/s"), 1_000, Skew::Zipf(1.1), 100_000, 1, 1_000))
    }

    /// The thousand lanes by a Zipf law above: the second after the start, once the
    /// first batches are out, holds 98% of the shared tier. The heaviest lanes, each at
    /// its own 100/s, took their slots the whole lead out ahead of the lanes received
    /// or woken next, and the shared quota's schedule, which goes in order, followed
    /// them: that second held 8,289 calls, 128 in one 100 ms of it.
    #[test]
    fn the_heaviest_lanes_leave_the_shared_slots_of_the_second_after_the_start_to_the_lanes_received_next() {
        let per_second = units_each_second(zipf_thousand_lanes_by_lambda_workers());
        assert!(per_second[1] >= 9_800, "{per_second:?}");
    }

    /// The calls the shared 10,000/s has room for in the first second after the
    /// hand-off's lead, before which no call goes.
    fn first_second_after_the_lead() -> u32 {
        let lead = u32::try_from(paceline_shared::config::LAMBDA_DISPATCH_AHEAD.as_millis()).expect("under a second");
        10 * (1_000 - lead)
    }

    /// The thousand lanes by a Zipf law above: the first second, after the hand-off's
    /// lead and the first reads (57 ms), holds no more than 1,250 calls fewer than the
    /// lead leaves room for (with a 400 ms lead: 4,930 of the 6,000; with 500 ms, 3,940
    /// of 5,000). The few lanes read first took the shared quota's schedule 100 ms out,
    /// and the lanes read a few milliseconds after them started there: 4,255 of 6,000.
    #[test]
    fn the_lanes_read_first_leave_the_shared_tier_s_first_slots_to_the_lanes_read_next() {
        let per_second = units_each_second(zipf_thousand_lanes_by_lambda_workers());
        assert!(per_second[0] >= first_second_after_the_lead() - 1_250, "{per_second:?}");
    }

    /// The thousand lanes by a Zipf law above: the first second holds no more than 1,100
    /// calls fewer than the lead leaves room for (4,009 of 5,000; its first call comes
    /// 556 ms after the start). While lanes were being read, the lanes read took their
    /// slots 25 ms past the lead only while a tenth of the shared pace waited for its
    /// reads. Where that dipped under a tenth for a moment, they took theirs 100 ms out,
    /// the shared quota's schedule (which goes in order) followed them, and the lanes
    /// read next started there: 40 ms of the schedule a tenth full, 3,772 calls.
    #[test]
    fn lanes_being_read_keep_the_lanes_read_near_the_lead_until_the_reads_end() {
        let per_second = units_each_second(zipf_thousand_lanes_by_lambda_workers());
        assert!(per_second[0] >= first_second_after_the_lead() - 1_100, "{per_second:?}");
    }

    /// The thousand lanes by a Zipf law above: the first second holds no more than 2,000
    /// calls fewer than the hand-off's lead leaves room for (4,255 of 6,000 then, with a
    /// 400 ms lead; 4,930 since the lanes read first leave the shared slots to those read
    /// next). Each lane's state is read before its first job goes; read 32 lanes at
    /// once, the first reads took most of a second and the first second held 3,740.
    #[test]
    fn the_first_reads_of_a_thousand_lanes_go_128_at_once_and_fill_the_first_second_sooner() {
        let per_second = units_each_second(zipf_thousand_lanes_by_lambda_workers());
        assert!(per_second[0] >= first_second_after_the_lead() - 2_000, "{per_second:?}");
    }

    /// The thousand lanes by a Zipf law above: from the first full second until the
    /// lanes still backlogged can no longer fill the shared tier, every second holds at
    /// least 98% of it. Receives go a few dozen at once at this pace, and the heaviest
    /// lanes hover at a tenth of the messages in flight, which SQS hands out in turn
    /// with the others'; four receives in a row that brought only their surplus paused
    /// every receive for 100 to 400 ms while the rest of the round kept jobs, and the
    /// lanes ran dry (seconds of 9,400 calls).
    #[test]
    fn receives_go_on_while_the_round_under_way_keeps_jobs_of_other_lanes() {
        let per_second = units_each_second(zipf_thousand_lanes_by_lambda_workers());
        let full = |units: &u32| *units >= 9_800;
        let (first_full, last_full) = (per_second.iter().position(full).unwrap_or(0), per_second.iter().rposition(full).unwrap_or(0));
        let short: Vec<(usize, u32)> = (first_full..=last_full).map(|second| (second, per_second[second])).filter(|(_, units)| !full(units)).collect();
        assert!(
            last_full >= first_full + 2 && short.is_empty(),
            "seconds under 98% of the shared tier while the lanes could fill it: {short:?} of {per_second:?}"
        );
    }

    /// 100 lanes over 4 shards, each shard its own fair queue, orchestrator and state,
    /// under a shared 1,000/s that the shards divide (250/s each): every job is called
    /// once on its lane's shard and the shards together never pass a shared or a lane's
    /// tier.
    #[test]
    fn shards_each_pace_their_lanes_under_their_share_and_together_keep_the_shared_tier() {
        let settings = lanes_settings("1000/s", "20/s", WorkerHost::InProcess);
        let plan = LanesPlan {
            lanes: 100,
            skew: Skew::Zipf(0.0),
            jobs: 20_000,
            seed: 5,
            settings,
            queue: LanesQueue::SqsFair,
            lambda: None,
            shards: 4,
            fixed_shares: false,
            profile: LatencyProfile::default(),
            runs: false,
        };
        let report = simulate_lanes(&plan);
        assert_eq!((report.calls, report.lane_violations, report.shared_violations), (20_000, 0, 0), "{report:?}");
        assert!(report.dispatcher.ends_with("4 shards"), "{report:?}");
        // Four shards at their share each: the first full second holds close to 1,000.
        let per_second = units_each_second(&report);
        assert!(per_second[1..4].iter().all(|units| (980..=1_000).contains(units)), "{per_second:?}");
    }

    /// 200 lanes at 20/s under a shared 1,000/s, 30,000 jobs by a Zipf law, on a fair
    /// queue: receives that bring only lanes' surplus do not pause while those lanes are
    /// quiet to SQS (each keeps its share, none holds a tenth of what is in flight), so
    /// the shared tier is used while the lanes could and divided evenly. Receives paused
    /// on any such run left it under 98% used (93.6%, Jain's index 0.975, with no dispatch ahead).
    #[test]
    fn on_a_fair_queue_receives_go_on_while_the_lanes_that_give_back_are_quiet() {
        let paceline = drained_on_a_fair_queue("1000/s", "20/s", 200, 30_000);
        assert!(paceline.shared_utilization.unwrap() >= 0.98, "{paceline:?}");
        assert!(paceline.jain_index_mean.unwrap() >= 0.99, "{paceline:?}");
    }

    /// 1,000 lanes at 5/s under a shared 200/s on SQS, their state in DynamoDB with its
    /// latency: each lane's first read and its re-reads each second go in the
    /// background, read together, and never hold the loop; the shared tier is used
    /// while the lanes could and light lanes wait their fair share. Read one lane at a
    /// time in the loop, the shared tier was 62% used and light lanes waited 57 s (p99).
    /// Lanes that get jobs are read on the grid the others are read on, and those back
    /// from idle on a finer one, not each at its own instant: 0.507 DynamoDB requests a
    /// job before, 0.408 since (0.267 by 2026-11-28). The first reads go 20 lanes
    /// together (one BatchGetItem and one transaction, where each lane's own took
    /// four requests): 0.132.
    #[test]
    fn a_thousand_lanes_reads_on_dynamodb_hold_no_dispatch() {
        let paceline = drained_on_a_fair_queue("200/s", "5/s", 1_000, 20_000);
        assert!(paceline.shared_utilization.unwrap() >= 0.98, "{paceline:?}");
        assert!(paceline.light_wait_p99_seconds <= 35.0, "{paceline:?}");
        assert!(paceline.dynamodb_requests_per_job.unwrap() <= 0.2, "{paceline:?}");
    }

    /// 200 lanes of 100/s under a shared 1,000/s on SQS, their state in DynamoDB: each
    /// lane goes at its share (5/s while all are backlogged) and is re-read as often as
    /// the breaker needs at that pace, not at its own tier's (every 200 ms): 0.167
    /// DynamoDB requests a job before, 0.115 now.
    #[test]
    fn lanes_held_to_their_share_of_the_shared_quota_are_re_read_at_that_pace() {
        let paceline = drained_on_a_fair_queue("1000/s", "100/s", 200, 20_000);
        assert!(paceline.dynamodb_requests_per_job.unwrap() <= 0.13, "{paceline:?}");
        assert!(paceline.shared_utilization.unwrap() >= 0.98, "{paceline:?}");
    }

    /// Lanes with nothing in common (`[quota]` left out): each goes at its own pace,
    /// none waits for the others: 10 lanes of 50 jobs at 5/s drain in 10 s.
    #[test]
    fn lanes_without_a_shared_quota_each_go_at_their_own_pace() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\n[lanes]\ntiers = [\"5/s\"]\n[orchestrator]\ndispatch_ahead = \"0s\"\n";
        let settings = settings_of(text, WorkerHost::InProcess);
        let plan = LanesPlan { skew: Skew::Zipf(0.0), settings, ..plan(10, 500) };
        let paceline = simulate_lanes(&plan);
        assert_eq!((paceline.lane_violations, paceline.shared_violations), (0, 0), "{paceline:?}");
        assert!(paceline.seconds <= 11.0, "{paceline:?}");
    }

    /// Two lanes of 10/s under a shared 20/s, called at the shared limit from 400 ms on
    /// for 30 s: the shared tier is all used from the first call, which came 0.4 s after
    /// the start (counted from the start, the first window was 96% used).
    #[test]
    fn the_shared_tier_s_use_counts_from_the_first_call() {
        let plan = LanesPlan { settings: lanes_settings("20/s", "10/s", WorkerHost::InProcess), ..plan(2, 600) };
        let calls: Vec<Call> =
            (0..600_u64).map(|n| Call { at: SIM_START.plus(Duration::from_millis(400 + n * 50)), lane: (n % 2) as usize, cost: 1 }).collect();
        let job_lanes: Vec<usize> = calls.iter().map(|call| call.lane).collect();
        let report = analyse(&plan, "test", &job_lanes, calls, Duration::ZERO);
        assert!((report.first_call_seconds - 0.4).abs() < 1e-9, "{}", report.first_call_seconds);
        assert_eq!(report.shared_utilization, Some(1.0));
    }

    #[test]
    fn a_call_over_a_tier_in_any_of_its_windows_is_counted() {
        let quota = Quota::new(vec!["2/s".parse().unwrap()], paceline_shared::quota::chrono_tz::UTC, Duration::ZERO).unwrap();
        let at = |ms: u64| (SIM_START.plus(Duration::from_millis(ms)), 1);
        assert_eq!(calls_over(&quota, &[at(0), at(500), at(1_000), at(1_500)]), 0);
        assert_eq!(calls_over(&quota, &[at(0), at(500), at(999), at(1_500)]), 1, "999 makes three within a second; by 1500, 0 and 500 have left");
    }
}
