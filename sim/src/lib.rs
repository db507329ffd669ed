//! `paceline simulate`: the real orchestrator and worker, on simulated SQS, DynamoDB,
//! Lambda and API backends, under tokio's paused clock. A backlog of jobs drains through
//! the lane as it would on AWS (an orchestrator run kicked every minute, reserved
//! concurrency 1, Lambda's async start delay...), in seconds of wall time; the provider
//! checks every call against every tier, and the ledger prices the AWS requests made.
//! The same harness runs the baseline dispatchers and the project's benchmark.

pub mod aws;
pub mod baselines;
pub mod diagram;
pub mod lanes;
pub mod plot;
pub mod pricing;
pub mod profile;
pub mod provider;
pub mod report;
pub mod runs;
mod sqs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use paceline_orchestrator::{BatchingInvoker, Orchestrator, Settings};
use paceline_shared::config::RetryConfig;
use paceline_shared::job::ApiRequest;
use paceline_shared::ports::WorkerHandler;
use paceline_shared::time::{Clock, TokioClock, UnixMillis};
use paceline_worker::{CallSlots, Worker, WorkerStats};

use crate::aws::{SimLambda, SimQueue, SimStore, World};
use crate::baselines::{dispatch_loop, tightest_rolling, Admission, ConcurrencyCap, FixedWindow, TokenBucket};
use crate::pricing::{FunctionMemory, TableCapacity};
use crate::profile::{Failures, LatencyProfile, Sampler, Stream};
use crate::provider::{job_path, Provider, ProviderModel};
pub use crate::report::SimReport;
use crate::runs::{FunctionTiming, OrchestratorRuns, RunCounts, SimRelay};

/// Where simulated time starts: a Monday at midnight UTC, so calendar tiers start fresh.
pub const SIM_START: UnixMillis = UnixMillis(1_798_761_600_000); // 2027-01-01T00:00:00Z

/// The API timeout the simulated workers assume (the config's default).
const SIM_API_TIMEOUT: Duration = Duration::from_secs(10);

/// Lambda's first retry of a throttled async event, doubled on each retry.
pub(crate) const THROTTLE_RETRY: Duration = Duration::from_secs(1);

/// Who decides when each job goes.
pub enum Dispatcher {
    /// The orchestrator, kicked every minute, with the plan's settings.
    Paceline,
    /// A per-second token bucket at the tightest rolling tier's rate.
    TokenBucket,
    /// A fixed-window counter at the tightest rolling tier.
    FixedWindow,
    /// A cap on running workers alone.
    ConcurrencyOnly { limit: u64 },
    /// Any other admission rule (tests use a deliberately broken one).
    Custom { name: String, admission: Box<dyn Fn() -> Box<dyn Admission> + Send + Sync> },
}

impl Dispatcher {
    /// The name reports use.
    #[must_use]
    pub fn name(&self, plan: &Plan) -> String {
        let ahead = plan.settings.dispatch_ahead();
        match self {
            Self::Paceline if ahead.is_zero() => "paceline".into(),
            Self::Paceline => format!("paceline (dispatch ahead {})", humantime::format_duration(ahead)),
            Self::TokenBucket => "token bucket (per second)".into(),
            Self::FixedWindow => "fixed window counter".into(),
            Self::ConcurrencyOnly { limit } => format!("concurrency only ({limit})"),
            Self::Custom { name, .. } => name.clone(),
        }
    }

    fn admission(&self, plan: &Plan) -> Option<Box<dyn Admission>> {
        let (limit, window_ms) = tightest_rolling(&plan.settings.quota).unwrap_or((u64::MAX / 2, 1_000));
        match self {
            Self::Paceline => None,
            Self::TokenBucket => Some(Box::new(TokenBucket::new(limit, window_ms))),
            Self::FixedWindow => Some(Box::new(FixedWindow::new(limit, window_ms))),
            Self::ConcurrencyOnly { limit } => Some(Box::new(ConcurrencyCap { limit: *limit })),
            Self::Custom { admission, .. } => Some(admission()),
        }
    }
}

/// The concurrency cap a user of a concurrency-only limiter would pick for `plan`: the
/// tightest rate times the API's median response time (Little's law), at least 2 (an
/// event source mapping's minimum).
#[must_use]
pub fn little_law_concurrency(plan: &Plan) -> u64 {
    let (limit, window_ms) = tightest_rolling(&plan.settings.quota).unwrap_or((1, 1_000));
    let median_ms = match plan.profile.api {
        profile::Latency::Fixed(d) => d.as_secs_f64() * 1e3,
        profile::Latency::LogNormal { p50, .. } => p50.as_secs_f64() * 1e3,
    };
    ((limit as f64 / window_ms as f64 * median_ms).round() as u64).max(2)
}

/// One simulation.
#[derive(Clone, Debug)]
pub struct Plan {
    pub jobs: usize,
    pub seed: u64,
    pub settings: Settings,
    pub retry: RetryConfig,
    pub profile: LatencyProfile,
    pub failures: Failures,
    /// How the simulated provider counts rolling tiers.
    pub provider: ProviderModel,
    /// The provider sends its rate-limit headers (`RateLimit`, `RateLimit-Policy`) on
    /// every answer.
    pub rate_limit_headers: bool,
    /// Each orchestrator run's Lambda timeout (the template's default, 70 s).
    pub orchestrator_timeout: Duration,
    /// How often EventBridge kicks the orchestrator.
    pub schedule: Duration,
    /// Each run starts its relay, the next run, before it stops (`--no-relay`: the
    /// next minute's kick starts it).
    pub relay: bool,
    pub memory: FunctionMemory,
    /// How the state table is billed, for the cost estimate.
    pub table: TableCapacity,
    /// Give up (and report "not drained") after this much simulated time.
    pub time_limit: Duration,
    /// The account's concurrent Lambda executions (`--lambda-concurrency`).
    pub lambda_concurrency: u64,
    /// How long Lambda keeps a worker event it cannot run yet (the template's
    /// `WorkerMaxEventAgeSeconds`).
    pub worker_max_event_age: Duration,
    /// Counts up the jobs that settle, across every simulation it is given to (for a
    /// progress bar).
    pub progress: Option<Arc<AtomicU64>>,
}

impl Plan {
    /// How much simulated time a simulation runs at most unless told (`--time-limit`).
    pub const DEFAULT_TIME_LIMIT: Duration = Duration::from_secs(400 * 86_400);

    /// A plan with the template's Lambda settings and the default profile.
    #[must_use]
    pub fn new(jobs: usize, seed: u64, settings: Settings, retry: RetryConfig) -> Self {
        Self {
            jobs,
            seed,
            settings,
            retry,
            profile: LatencyProfile::default(),
            failures: Failures::default(),
            provider: ProviderModel::default(),
            rate_limit_headers: true,
            orchestrator_timeout: runs::ORCHESTRATOR_TIMEOUT,
            schedule: runs::SCHEDULE,
            relay: true,
            memory: FunctionMemory::default(),
            table: TableCapacity::OnDemand,
            time_limit: Self::DEFAULT_TIME_LIMIT,
            lambda_concurrency: aws::DEFAULT_LAMBDA_CONCURRENCY,
            worker_max_event_age: aws::DEFAULT_MAX_EVENT_AGE,
            progress: None,
        }
    }
}

/// The job bodies the simulation enqueues: `job-N`, calling `/jobs/N`.
fn job_bodies(jobs: usize) -> impl Iterator<Item = String> {
    (0..jobs as u64).map(|n| format!(r#"{{"id":"job-{n}","request":{{"method":"GET","path":"{}"}}}}"#, job_path(n)))
}

/// The simulated lane: services, provider, worker.
struct Lane {
    world: Arc<World>,
    queue: Arc<SimQueue>,
    store: Arc<SimStore>,
    lambda: Arc<SimLambda>,
    provider: Arc<Provider>,
    stats: Arc<WorkerStats>,
    /// Wakes the watcher whenever a worker finishes.
    finished: Arc<tokio::sync::Notify>,
    jobs: u64,
    /// When the last job settled.
    done_at: Mutex<Option<UnixMillis>>,
    progress: Option<Arc<AtomicU64>>,
    /// Jobs settled that `progress` has been told of.
    reported: AtomicU64,
}

impl Lane {
    fn build(plan: &Plan) -> Self {
        let clock = Arc::new(TokioClock::anchored_at(SIM_START));
        let world = Arc::new(World::new(clock.clone(), Sampler::new(plan.seed, plan.profile.clone())));
        let queue = Arc::new(SimQueue::new(world.clone()));
        let store = Arc::new(SimStore::new(world.clone()));
        let dispatched_at = Arc::new(Mutex::new(vec![UnixMillis(0); plan.jobs]));
        let provider = Arc::new(
            Provider::new(world.clone(), &plan.settings.quota, plan.provider, plan.failures.clone(), dispatched_at.clone(), plan.jobs)
                .with_rate_limit_headers(plan.rate_limit_headers),
        );
        let stats = Arc::new(WorkerStats::default());
        let finished = Arc::new(tokio::sync::Notify::new());
        let health_check = ApiRequest { method: "GET".into(), path: "/health".into(), query: Default::default(), headers: Default::default(), body: None };
        let call_slots = CallSlots::for_api(plan.settings.quota.max_in_flight(), SIM_API_TIMEOUT);
        let worker = Arc::new(
            Worker::new(provider.clone(), queue.clone(), store.clone(), clock, plan.retry, health_check).with_stats(stats.clone()).with_call_slots(call_slots),
        );
        let handler: Arc<dyn WorkerHandler> = Arc::new(Notifying { worker, finished: finished.clone() });
        let lambda =
            Arc::new(
                SimLambda::new(world.clone(), handler, dispatched_at, plan.jobs)
                    .with_duplicate_delivery(plan.failures.rate_duplicate_delivery)
                    .with_executions(plan.lambda_concurrency, plan.worker_max_event_age, plan.failures.rate_worker_crash),
            );
        queue.preload(job_bodies(plan.jobs));
        Self {
            world,
            queue,
            store,
            lambda,
            provider,
            stats,
            finished,
            jobs: plan.jobs as u64,
            done_at: Mutex::new(None),
            progress: plan.progress.clone(),
            reported: AtomicU64::new(0),
        }
    }

    /// Jobs that reached an end: succeeded, dead-lettered, lost by a failing worker, or
    /// in an event Lambda could not run before it aged out (both in the worker DLQ).
    fn settled(&self) -> u64 {
        let lambda = self.lambda.executions();
        WorkerStats::get(&self.stats.succeeded)
            + self.queue.dead_count()
            + lambda.worker_errors.load(Ordering::Relaxed)
            + lambda.aged_out_jobs.load(Ordering::Relaxed)
    }

    fn done(&self) -> bool {
        self.settled() >= self.jobs && self.lambda.executions().running.load(Ordering::Relaxed) == 0
    }

    /// Adds the jobs settled since the last report to the plan's progress counter.
    fn report_progress(&self) {
        if let Some(progress) = &self.progress {
            let settled = self.settled().min(self.jobs);
            let before = self.reported.swap(settled, Ordering::Relaxed);
            progress.fetch_add(settled.saturating_sub(before), Ordering::Relaxed);
        }
    }

    /// Waits until every job settled or `until` comes; `true` if they all settled.
    async fn wait_done(&self, until: UnixMillis) -> bool {
        loop {
            let finished = self.finished.notified();
            tokio::pin!(finished);
            finished.as_mut().enable();
            self.report_progress();
            if self.done() {
                self.done_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(self.world.clock.now());
                return true;
            }
            if self.world.clock.now() >= until {
                return false;
            }
            tokio::select! {
                biased;
                () = finished => {}
                () = self.world.clock.sleep_until(until) => {}
            }
        }
    }
}

/// The worker, telling the watcher each time it finishes a payload.
struct Notifying {
    worker: Arc<Worker>,
    finished: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl WorkerHandler for Notifying {
    async fn handle(
        &self,
        payload: paceline_shared::job::WorkerPayload,
    ) -> paceline_shared::ports::PortResult<Option<paceline_shared::outcome::OutcomeRecord>> {
        let result = self.worker.handle(payload).await;
        self.finished.notify_waiters();
        result
    }
}

/// Kicks an orchestrator run every `schedule` and lets each run start its relay (unless
/// the plan has none), as EventBridge and Lambda would (see [`runs`]). Returns when every
/// job settled or time is up, with what became of the runs.
async fn run_paceline(plan: &Plan, lane: &Lane) -> (bool, RunCounts) {
    let settings = plan.settings.clone();
    let invoker: Arc<dyn paceline_shared::ports::Invoker> = if settings.worker_batch() > 1 && !settings.hand_off_lead().is_zero() {
        Arc::new(BatchingInvoker::for_settings(lane.lambda.clone(), lane.world.clock.clone(), &settings))
    } else {
        lane.lambda.clone()
    };
    let (relays, requests) = tokio::sync::mpsc::unbounded_channel();
    let mut orchestrator = Orchestrator::new(lane.queue.clone(), lane.store.clone(), invoker, lane.world.clock.clone(), settings);
    if plan.relay {
        orchestrator = orchestrator.with_relay(Arc::new(SimRelay::new(lane.world.clone(), relays)));
    }
    let clock = lane.world.clock.clone();
    let give_up = lane.world.start.plus(plan.time_limit);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let timing = FunctionTiming { timeout: plan.orchestrator_timeout, schedule: plan.schedule, deadline_margin: plan.settings.orchestrator.deadline_margin };
    let runs = Arc::new(OrchestratorRuns::new(Arc::new(orchestrator), lane.store.clone(), lane.world.clone(), timing, stop_rx));
    let serving = runs.serve_relays(requests);
    let faults = orchestrator_faults(plan, lane, &runs);
    let mut tick = lane.world.start;
    let mut kicks = 0_u64;
    loop {
        let kicked = tick.plus(lane.world.sampler.latency(Stream::Kick, kicks));
        if lane.wait_done(kicked.min(give_up)).await || clock.now() >= give_up {
            break;
        }
        kicks += 1;
        runs.kick(tick);
        tick = tick.plus(plan.schedule);
    }
    let drained = lane.done();
    let _ = stop_tx.send(true);
    runs.join().await;
    serving.abort();
    faults.abort();
    (drained, runs.counts())
}

/// Kills the run going at each `kill_run_at`, and makes the next run's end fail its
/// writes at each `fail_release_at`.
fn orchestrator_faults(plan: &Plan, lane: &Lane, runs: &Arc<OrchestratorRuns>) -> tokio::task::JoinHandle<()> {
    let mut faults: Vec<(Duration, bool)> = plan.failures.kill_run_at.iter().map(|at| (*at, true)).collect();
    faults.extend(plan.failures.fail_release_at.iter().map(|at| (*at, false)));
    faults.sort();
    let (world, store, runs) = (lane.world.clone(), lane.store.clone(), runs.clone());
    tokio::spawn(async move {
        for (at, kill) in faults {
            world.clock.sleep_until(world.start.plus(at)).await;
            if kill {
                runs.kill_current();
            } else {
                store.fail_next_release();
            }
        }
    })
}

/// Runs a baseline dispatcher until every job settled or time is up.
async fn run_baseline(plan: &Plan, lane: &Lane, admission: Box<dyn Admission>) -> bool {
    let give_up = lane.world.start.plus(plan.time_limit);
    let (world, queue, lambda) = (lane.world.clone(), lane.queue.clone(), lane.lambda.clone());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let poller = tokio::spawn(async move { dispatch_loop(world, queue, lambda, admission, move || stopped.load(Ordering::Relaxed)).await });
    let drained = lane.wait_done(give_up).await;
    stop.store(true, Ordering::Relaxed);
    poller.abort();
    drained
}

/// Starts timing the simulator's own run on this machine, for its report's wall time:
/// the simulator's one reading of the machine's clock (what it simulates runs on
/// tokio's paused clock).
#[expect(clippy::disallowed_methods, reason = "times the simulator's own run on this machine, not the simulated clock")]
pub(crate) fn stopwatch() -> std::time::Instant {
    std::time::Instant::now()
}

/// Runs `plan` with `dispatcher` to the end and reports. Builds its own paused,
/// single-threaded runtime: call it from a plain thread (not inside a runtime).
///
/// # Panics
/// If the runtime cannot be built.
#[must_use]
pub fn simulate(plan: &Plan, dispatcher: &Dispatcher) -> SimReport {
    let wall = stopwatch();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("a tokio runtime");
    runtime.block_on(async {
        let lane = Lane::build(plan);
        let (drained, runs) = match dispatcher.admission(plan) {
            None => run_paceline(plan, &lane).await,
            Some(admission) => (run_baseline(plan, &lane, admission).await, RunCounts::default()),
        };
        let ended = lane.done_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner).unwrap_or_else(|| lane.world.clock.now());
        report::build(plan, dispatcher.name(plan), &lane, drained, runs, ended.since(lane.world.start), wall.elapsed())
    })
}
