//! Builds a stack on the embedded backend from a config file: store, worker, in-process
//! invoker and orchestrator, all sharing one clock. Also runs it with a progress bar.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use paceline_orchestrator::{Orchestrator, RunOptions, RunReport, Settings};
use paceline_shared::adapters::embedded::{canonical_db_path, lock_exclusive, EmbeddedInvoker, EmbeddedStore};
use paceline_shared::breaker::Circuit;
use paceline_shared::config::{Backend, Config, WorkerHost};
use paceline_shared::lane::LaneId;
use paceline_shared::pacer::MissedSlots;
use paceline_shared::ports::{Invoker, JobQueue, WorkerHandler};
use paceline_shared::time::{Clock, SystemClock, UnixMillis};
use paceline_worker::lanes::{LaneStack, LaneWorkerBuild, LaneWorkers};
use paceline_worker::{Api, ApiClient, CallRecords, CallSlots, Worker, WorkerStats};

/// Reads the config file, with secrets from the process environment.
///
/// # Errors
/// The config error, naming the file, key and problem.
pub fn load_config(path: &Path) -> anyhow::Result<Config> {
    Ok(Config::load(path, &|name| std::env::var(name).ok())?)
}

/// Reads the config file for a command that inspects or feeds the lane and never calls
/// the API: an API secret missing from this environment is not an error (it is left
/// empty, unused).
///
/// # Errors
/// The config error, naming the file, key and problem.
pub fn load_config_for_operations(path: &Path) -> anyhow::Result<Config> {
    Ok(Config::load(path, &|name| Some(std::env::var(name).unwrap_or_default()))?)
}

/// The embedded database path of a config, or an error saying what to do.
///
/// # Errors
/// When the config's backend is not embedded.
pub fn embedded_path(config: &Config) -> anyhow::Result<PathBuf> {
    match &config.backend {
        Backend::Embedded { path } => Ok(path.clone()),
        Backend::Aws { .. } => {
            bail!("this command runs the embedded backend; the config's [backend] kind is \"aws\" (use the Lambda functions, or kind = \"embedded\")")
        }
    }
}

/// What opening a lane's database does where there is no file.
#[derive(Clone, Copy, Debug)]
pub enum IfMissing {
    /// Create it (feeding a lane that has not run yet).
    Create,
    /// Fail, naming the path (inspecting or repairing one: a typo is not a new lane).
    Refuse,
}

/// Opens the embedded store of a config (no lock: safe beside a running lane).
///
/// # Errors
/// When the backend is not embedded or the database cannot be opened.
pub fn open_store(config: &Config, if_missing: IfMissing) -> anyhow::Result<Arc<EmbeddedStore>> {
    let path = embedded_path(config)?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = match if_missing {
        IfMissing::Create => EmbeddedStore::open(&path, clock),
        IfMissing::Refuse => EmbeddedStore::open_existing(&path, clock),
    };
    Ok(Arc::new(store.with_context(|| format!("opening {}", path.display()))?.with_ordering(config.ordering())))
}

/// A stack ready to run in this process (its lanes share one quota today).
pub struct EmbeddedStack {
    pub store: Arc<EmbeddedStore>,
    pub orchestrator: Orchestrator,
    pub worker_stats: Arc<WorkerStats>,
    /// How long in-flight calls may take to finish after a stop: a call's timeout and
    /// the wait for its slot.
    settle_for: Duration,
    _lock: std::fs::File,
}

/// The lease holder a `paceline run` records: its process id.
fn run_holder(pid: u32) -> String {
    format!("paceline-run-{pid}")
}

/// Whether `holder` is a `paceline run` other than this one whose process is alive (as
/// Linux's `/proc` shows; elsewhere none is found, and a lease is cleared as before).
fn run_is_alive(holder: &str) -> bool {
    holder
        .strip_prefix("paceline-run-")
        .and_then(|pid| pid.parse::<u32>().ok())
        .is_some_and(|pid| pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists())
}

/// What a run did, from both sides.
pub struct LaneOutcome {
    pub report: RunReport,
    pub worker: Arc<WorkerStats>,
    pub dead_letters_total: u64,
    /// Calls still in flight when the run had waited for them as long as a call may
    /// take: their jobs go back on the queue at the next start.
    pub interrupted: usize,
    /// Each lane's circuit changes during the run, oldest first.
    pub circuit_changes: Vec<(LaneId, Circuit)>,
}

impl EmbeddedStack {
    /// Takes the database's lock, recovers what a killed run left, and wires the lane.
    ///
    /// # Errors
    /// When another run holds the database, or it cannot be opened.
    pub fn open(config: &Config) -> anyhow::Result<Self> {
        let path = embedded_path(config)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        // The lock and the database follow the real file, however its path is spelled.
        let lock = lock_exclusive(&path)?;
        let path = canonical_db_path(&path)?;
        let store = Arc::new(
            EmbeddedStore::open(&path, Arc::new(SystemClock))
                .with_context(|| format!("opening {}", path.display()))?
                .with_outcome_retention(config.outcomes.retention)
                .with_ordering(config.ordering())
                .with_background_checkpoints()
                .with_context(|| format!("opening {}", path.display()))?,
        );
        // We hold the lock, so whatever lease or in-flight work is recorded should belong
        // to a process that is gone; a live run's lease is refused all the same (one that
        // locked another file: an older paceline's `lane.lock`, or a lock file deleted).
        if let Some(lease) = store.recorded_lease()? {
            if lease.expires_at > SystemClock.now() && run_is_alive(&lease.holder) {
                bail!("{} is in use by {} (its lease runs to {}); stop that run first", path.display(), lease.holder, lease.expires_at.to_rfc3339());
            }
        }
        store.clear_lease()?;
        let (released, requeued) = store.recover_after_crash()?;
        if released + requeued > 0 {
            tracing::warn!(released, requeued, "recovered work left by an interrupted run");
            eprintln!("recovered {released} received and {requeued} in-flight job(s) left by an interrupted run");
        }
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let worker_stats = Arc::new(WorkerStats::default());
        // The slots workers start too late for go back to the orchestrator's pacer.
        let missed = Arc::new(MissedSlots::default());
        let worker: Arc<dyn WorkerHandler> = if config.lanes.is_some() {
            Arc::new(lane_workers(config, &store, &clock, &worker_stats, &missed))
        } else {
            let api = Arc::new(ApiClient::new(&config.api)?.keeping_bodies(config.outcomes.body_cap()));
            Arc::new(embedded_worker(config, &store, api, clock.clone(), worker_stats.clone(), &missed))
        };
        let invoker = Arc::new(EmbeddedInvoker::new(store.clone(), worker));
        let orchestrator = embedded_orchestrator(config, &store, invoker, clock, &missed).with_scoped_stores(store.clone());
        let settle_for = config.api.timeout + orchestrator.settings().dispatch_ahead() + Duration::from_secs(1);
        Ok(Self { store, orchestrator, worker_stats, settle_for, _lock: lock })
    }

    /// Runs until drained (`drain`), `for_at_most` passes, or Ctrl-C / SIGTERM (as
    /// systemd, Docker and Kubernetes stop a process); shows progress on a terminal.
    /// After a stop, calls in flight may finish (as long as a call may take) and record
    /// their results; what is still running then is reported as interrupted.
    ///
    /// # Errors
    /// When the run fails (lease held, fatal store error).
    pub async fn run(&self, drain: bool, for_at_most: Option<Duration>, show_progress: bool) -> anyhow::Result<LaneOutcome> {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("listening for SIGTERM")?;
        let listener = tokio::spawn(async move {
            tokio::select! {
                result = tokio::signal::ctrl_c() => if result.is_err() { return },
                _ = terminate.recv() => {}
            }
            let _ = stop_tx.send(true);
        });
        let now = self.orchestrator.clock().now();
        let deadline = for_at_most.map_or(UnixMillis(u64::MAX / 2), |d| now.plus(d).plus(self.orchestrator.settings().orchestrator.deadline_margin));
        let opts = RunOptions { holder: run_holder(std::process::id()), deadline, drain, stop: Some(stop_rx) };
        let bar = show_progress.then(|| self.progress_bar());
        let (changes_tx, changes_rx) = tokio::sync::watch::channel(Vec::new());
        let watcher = tokio::spawn(watch_circuit(self.store.clone(), self.orchestrator.clock().clone(), changes_tx));
        let report = self.orchestrator.run(&opts).await;
        if let Some((bar, ticker)) = bar {
            crate::tasks::end_all([ticker]).await;
            bar.finish_and_clear();
        }
        let interrupted = self.settle_in_flight().await;
        crate::tasks::end_all([listener, watcher]).await;
        let report = match report {
            Ok(report) => report,
            Err(failed) => return Err(anyhow::Error::from(failed).context(self.what_a_failed_run_did(interrupted))),
        };
        let circuit_changes = changes_rx.borrow().clone();
        let dead_letters_total = self.store.depth().await?.dead;
        Ok(LaneOutcome { report, worker: self.worker_stats.clone(), dead_letters_total, interrupted, circuit_changes })
    }

    /// What a run that ended on an error did before it (its summary needs a report).
    fn what_a_failed_run_did(&self, interrupted: usize) -> String {
        let handed_off = self.orchestrator.progress().dispatched.load(std::sync::atomic::Ordering::Relaxed);
        let stats = &self.worker_stats;
        format!(
            "the run stopped on an error after {handed_off} hand-off(s): {} call(s) made, {} succeeded, {} re-queued, {} dead-lettered; {interrupted} still in flight (re-queued at the next start)",
            WorkerStats::get(&stats.calls),
            WorkerStats::get(&stats.succeeded),
            WorkerStats::get(&stats.requeued),
            WorkerStats::get(&stats.dead_lettered),
        )
    }

    /// Waits for the workers' calls in flight to finish, at most as long as a call may
    /// take; returns how many are still running.
    async fn settle_in_flight(&self) -> usize {
        let clock = self.orchestrator.clock();
        let give_up = clock.now().plus(self.settle_for);
        let invoker = self.orchestrator.invoker();
        while invoker.in_flight() > 0 && clock.now() < give_up {
            clock.sleep_until_coarse(clock.now().plus(Duration::from_millis(20))).await;
        }
        invoker.in_flight()
    }

    fn progress_bar(&self) -> (ProgressBar, tokio::task::JoinHandle<()>) {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} jobs settled  {per_sec}  ETA {eta}  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let (store, stats, progress, ticking) = (self.store.clone(), self.worker_stats.clone(), self.orchestrator.progress().clone(), bar.clone());
        let (invoker, clock) = (self.orchestrator.invoker().clone(), self.orchestrator.clock().clone());
        let ticker = tokio::spawn(async move {
            loop {
                // Every job is settled, waiting on the queue, or with a worker: the total
                // stays put while jobs move between those.
                let depth = store.depth().await.unwrap_or_default();
                let settled = WorkerStats::get(&stats.succeeded) + depth.dead;
                let unsettled = depth.visible + depth.not_visible + invoker.in_flight() as u64;
                ticking.set_length(settled + unsettled);
                ticking.set_position(settled);
                let open = progress.circuit_open.load(std::sync::atomic::Ordering::Relaxed);
                ticking.set_message(if open { "circuit OPEN: waiting for a healthy check" } else { "" });
                clock.sleep_until_coarse(clock.now().plus(Duration::from_millis(200))).await;
            }
        });
        (bar, ticker)
    }
}

/// The worker of an embedded lane: calls `api`, keeps its queue, records and outcomes in
/// `store`, and reports the slots it makes no call at to `missed`.
fn embedded_worker(
    config: &Config,
    store: &Arc<EmbeddedStore>,
    api: Arc<dyn Api>,
    clock: Arc<dyn Clock>,
    stats: Arc<WorkerStats>,
    missed: &Arc<MissedSlots>,
) -> Worker {
    Worker::new(api, store.clone(), store.clone(), clock, config.retry, config.api.health_check.clone())
        .with_stats(stats)
        .with_call_slots(CallSlots::for_api(config.quota.max_in_flight(), config.api.timeout))
        .with_api_timeout(config.api.timeout)
        .with_call_records(CallRecords::AheadOfSlot)
        .with_outcomes(config.outcomes.clone(), Some(store.clone()))
        .with_missed_slots(missed.clone())
}

/// The workers of a stack of many lanes: each lane's calls its API (`[api]`, or the
/// lane's `base_url`) with the `[api]` headers and its own (`{lane}` filled in, keys
/// from this process's environment), keeps its state in its scope of `store`, and holds
/// its own call slots.
fn lane_workers(config: &Config, store: &Arc<EmbeddedStore>, clock: &Arc<dyn Clock>, stats: &Arc<WorkerStats>, missed: &Arc<MissedSlots>) -> LaneWorkers {
    let stack = LaneStack {
        lanes: config.lanes.clone().expect("[lanes]"),
        api: config.api.clone(),
        body_cap: config.outcomes.body_cap(),
        retry: config.retry,
        queue: store.clone(),
        shard_queues: Vec::new(),
        stores: store.clone(),
        clock: clock.clone(),
        stats: stats.clone(),
    };
    let (queue, stores) = (stack.queue.clone(), stack.stores.clone());
    let (outcomes, store, missed) = (config.outcomes.clone(), store.clone(), missed.clone());
    let build = move |lane: LaneId| -> LaneWorkerBuild {
        let worker = stack.worker(&lane, &|name| std::env::var(name).ok()).map(|worker| {
            worker.with_call_records(CallRecords::AheadOfSlot).with_outcomes(outcomes.clone(), Some(store.clone())).with_missed_slots(missed.clone())
        });
        Box::pin(std::future::ready(worker))
    };
    LaneWorkers::new(Box::new(build), queue, stores, clock.clone())
}

/// The orchestrator of an embedded lane: its queue and state in `store`, handing off
/// through `invoker`, giving back to its pacer the slots workers report to `missed`.
fn embedded_orchestrator(
    config: &Config,
    store: &Arc<EmbeddedStore>,
    invoker: Arc<dyn Invoker>,
    clock: Arc<dyn Clock>,
    missed: &Arc<MissedSlots>,
) -> Orchestrator {
    Orchestrator::new(store.clone(), store.clone(), invoker, clock, Settings::from_config(config, WorkerHost::InProcess))
        .with_outcomes(config.outcomes.clone(), store.clone())
        .with_missed_slots(missed.clone())
}

/// How often the circuit's state is read for the run's timeline: a state that lasts
/// less than this may be missed (the ramp's steps and a break last seconds).
const CIRCUIT_WATCH_EVERY: Duration = Duration::from_millis(100);

/// Every lane's circuit as the store last held it: what changed between two looks.
#[derive(Default)]
pub(crate) struct StoredCircuits {
    as_stored: HashMap<LaneId, String>,
}

impl StoredCircuits {
    /// The circuits `store` holds now whose stored text is not what the last look saw
    /// (on the first look, every circuit). A text that does not parse is looked at again.
    pub(crate) fn changed(&mut self, store: &EmbeddedStore) -> Vec<(LaneId, Circuit)> {
        let Ok(circuits) = store.circuits_as_stored() else { return Vec::new() };
        let mut changed = Vec::new();
        for (lane, text) in circuits {
            if self.as_stored.get(&lane) == Some(&text) {
                continue;
            }
            let Ok(circuit) = serde_json::from_str::<Circuit>(&text) else { continue };
            self.as_stored.insert(lane.clone(), text);
            changed.push((lane, circuit));
        }
        changed
    }
}

/// Records each new state of the circuit (a new epoch) in `changes`, reading it every
/// [`CIRCUIT_WATCH_EVERY`] on `clock`, until aborted.
async fn watch_circuit(store: Arc<EmbeddedStore>, clock: Arc<dyn Clock>, changes: tokio::sync::watch::Sender<Vec<(LaneId, Circuit)>>) {
    let mut stored = StoredCircuits::default();
    // What a lane's circuit was before the run is not a change in it.
    let mut epochs: HashMap<LaneId, u64> = stored.changed(&store).into_iter().map(|(lane, circuit)| (lane, circuit.epoch)).collect();
    loop {
        clock.sleep_until_coarse(clock.now().plus(CIRCUIT_WATCH_EVERY)).await;
        for (lane, circuit) in stored.changed(&store) {
            if epochs.insert(lane.clone(), circuit.epoch) != Some(circuit.epoch) {
                changes.send_modify(|changes| changes.push((lane, circuit)));
            }
        }
    }
}

#[cfg(test)]
#[expect(clippy::disallowed_methods, reason = "the tests wait on tokio's clock, paused or real, as the runs they check do")]
mod tests {
    use async_trait::async_trait;
    use paceline_shared::adapters::embedded::OutcomeQuery;
    use paceline_shared::job::WorkerPayload;
    use paceline_shared::outcome::{OutcomeRecord, StatusFilter};
    use paceline_shared::ports::{OutgoingMessage, PortResult, StateStore};
    use paceline_shared::time::TokioClock;
    use paceline_worker::testing::InstantApi;

    use super::*;

    /// The in-process hand-off of the `late`th job starts `by` late, as on a busy machine
    /// (or in a slow debug build) the task that runs it may.
    struct LateStart {
        worker: Worker,
        late: usize,
        by: Duration,
        started: std::sync::atomic::AtomicUsize,
    }

    #[async_trait]
    impl WorkerHandler for LateStart {
        async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<OutcomeRecord>> {
            if self.started.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == self.late {
                tokio::time::sleep(self.by).await;
            }
            self.worker.handle(payload).await
        }
    }

    /// Drains `bodies` through an embedded lane with `quota` (its `[quota]` lines) in one
    /// run under paused time, until every worker is done; `handler` is the worker as the
    /// in-process invoker runs it. Returns the store and the API the worker called.
    async fn drain(quota: &str, bodies: Vec<String>, handler: impl FnOnce(Worker) -> Arc<dyn WorkerHandler>) -> (Arc<EmbeddedStore>, Arc<InstantApi>) {
        let text = format!("[api]\nbase_url = \"https://api.example.com\"\n[quota]\n{quota}");
        let config = Config::parse(&text, Path::new("."), &|_| None).unwrap();
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
        let jobs: Vec<OutgoingMessage> = bodies.into_iter().map(OutgoingMessage::fresh).collect();
        store.send(&jobs).await.unwrap();
        let api = Arc::new(InstantApi::new(clock.clone()));
        let missed = Arc::new(MissedSlots::default());
        let worker = embedded_worker(&config, &store, api.clone(), clock.clone(), Arc::default(), &missed);
        let invoker = Arc::new(EmbeddedInvoker::new(store.clone(), handler(worker)));
        let orchestrator = embedded_orchestrator(&config, &store, invoker.clone(), clock.clone(), &missed);
        let opts = RunOptions { holder: "test".into(), deadline: clock.now().plus(Duration::from_secs(60)), drain: true, stop: None };
        orchestrator.run(&opts).await.unwrap();
        while invoker.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (store, api)
    }

    #[tokio::test(start_paused = true)]
    async fn an_in_process_hand_off_that_starts_late_still_leaves_every_window_within_the_quota() {
        let bodies = (0..15).map(|n| format!(r#"{{"id":"j{n}","request":{{"method":"GET","path":"/items/{n}"}}}}"#)).collect();
        let late = |worker| -> Arc<dyn WorkerHandler> { Arc::new(LateStart { worker, late: 2, by: Duration::from_millis(40), started: Default::default() }) };
        let (_, api) = drain("tiers = [\"10/s\"]\nsafety_margin = \"20ms\"\n", bodies, late).await;

        let arrivals = api.calls();
        assert_eq!(arrivals.len(), 15, "every job called once");
        let busiest = arrivals.iter().map(|from| arrivals.iter().filter(|t| **t >= *from && t.0 < from.0 + 1_000).count()).max().unwrap();
        assert!(busiest <= 10, "{busiest} calls in one second under 10/s: {arrivals:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_job_the_orchestrator_dead_letters_gets_its_outcome_record_like_one_the_worker_does() {
        let bodies = vec![
            r#"{"id":"too-big","request":{"method":"GET","path":"/items/1"},"cost":20,"metadata":{"batch":7}}"#.to_owned(),
            r#"{"id":"fits","request":{"method":"GET","path":"/items/2"}}"#.to_owned(),
        ];
        let (store, _) = drain("tiers = [\"10/s\"]\n", bodies, |worker| Arc::new(worker)).await;

        let dead = OutcomeQuery { status: Some(StatusFilter::Dead), limit: 10, ..OutcomeQuery::default() };
        let records: Vec<OutcomeRecord> = store.outcomes(&dead).unwrap().into_iter().map(|kept| kept.record).collect();
        assert_eq!(records.len(), 1, "{records:?}");
        let record = &records[0];
        assert_eq!((record.job_id.as_str(), record.status, record.attempts), ("too-big", None, 0));
        assert_eq!(record.metadata, Some(serde_json::json!({ "batch": 7 })));
        assert!(record.reason.as_deref().is_some_and(|r| r.starts_with("never_fits: cost 20")), "{:?}", record.reason);
        assert!(record.times.enqueued.is_some());
        let all = OutcomeQuery { limit: 10, ..OutcomeQuery::default() };
        assert_eq!(store.outcomes(&all).unwrap().len(), 2, "the job that fit succeeded and has its record too");
    }

    /// With `max_body = "64MiB"`, three 10 MB bodies made 27 hand-offs, 27 missed slots
    /// and no call in 30 s: the hand-off's own work (the payload written to the store)
    /// took longer than the lead, every time. In real time, on a 2-core machine.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_with_bodies_of_megabytes_are_called_not_missed_for_ever() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\nmax_body = \"64MiB\"\n[quota]\ntiers = [\"10/s\"]\n";
        let config = Config::parse(text, Path::new("."), &|_| None).unwrap();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
        let body = "x".repeat(10 << 20);
        let jobs: Vec<OutgoingMessage> = (0..3)
            .map(|n| format!(r#"{{"id":"big{n}","request":{{"method":"POST","path":"/upload","body":"{body}"}}}}"#))
            .map(OutgoingMessage::fresh)
            .collect();
        store.send(&jobs).await.unwrap();
        let api = Arc::new(InstantApi::new(clock.clone()));
        let stats = Arc::new(WorkerStats::default());
        let missed = Arc::new(MissedSlots::default());
        let worker = embedded_worker(&config, &store, api.clone(), clock.clone(), stats.clone(), &missed);
        let invoker = Arc::new(EmbeddedInvoker::new(store.clone(), Arc::new(worker)));
        let orchestrator = embedded_orchestrator(&config, &store, invoker.clone(), clock.clone(), &missed);
        let opts = RunOptions { holder: "test".into(), deadline: clock.now().plus(Duration::from_secs(20)), drain: true, stop: None };
        let report = orchestrator.run(&opts).await.unwrap();
        while invoker.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(report.stop, paceline_orchestrator::StopReason::Drained, "missed slots: {}", WorkerStats::get(&stats.missed_slots));
        assert_eq!(api.calls().len(), 3);
    }

    /// Opening a lane cleared whatever lease was recorded without checking it: a second
    /// run that got past the file lock (through a hard link) took over a live one's lane.
    #[tokio::test]
    async fn a_live_runs_lease_is_refused_on_open_and_a_gone_runs_is_taken_over() {
        let dir = std::env::temp_dir().join(format!("paceline-lease-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"10/s\"]\n[backend]\nkind = \"embedded\"\npath = \"lane.db\"\n";
        let config = Config::parse(text, &dir, &|_| None).unwrap();
        let mut other_run = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let store = EmbeddedStore::open(&dir.join("lane.db"), Arc::new(SystemClock)).unwrap();
        store.acquire_lease(&run_holder(other_run.id()), Duration::from_secs(60), SystemClock.now()).await.unwrap();
        drop(store);

        let Err(refused) = EmbeddedStack::open(&config) else { panic!("a live run's lease was cleared") };
        assert!(refused.to_string().contains(&format!("in use by paceline-run-{}", other_run.id())), "{refused}");
        other_run.kill().unwrap();
        other_run.wait().unwrap();
        assert!(EmbeddedStack::open(&config).is_ok(), "the lease of a run that is gone was not taken over");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// An embedded lane of 10/s in a folder of its own (`name`), its API on a port where
    /// nothing listens; the folder is for the test to remove.
    fn lane_of_10_per_second_in(name: &str) -> (PathBuf, EmbeddedStack) {
        let dir = std::env::temp_dir().join(format!("paceline-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = "[api]\nbase_url = \"http://127.0.0.1:9\"\n[quota]\ntiers = [\"10/s\"]\n[backend]\nkind = \"embedded\"\npath = \"lane.db\"\n";
        let config = Config::parse(text, &dir, &|_| None).unwrap();
        let lane = EmbeddedStack::open(&config).unwrap();
        (dir, lane)
    }

    /// A run that ended on an error (a damaged database, a lost lease) printed the error
    /// alone, not what it had done.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_run_that_fails_says_what_it_did_before_the_error() {
        let (dir, lane) = lane_of_10_per_second_in("failed-run");
        lane.store.acquire_lease("someone-else", Duration::from_secs(60), SystemClock.now()).await.unwrap();

        let Err(failed) = lane.run(true, Some(Duration::from_secs(5)), false).await else { panic!("ran under another's lease") };
        let text = format!("{failed:#}");
        assert!(text.starts_with("the run stopped on an error after 0 hand-off(s): 0 call(s) made"), "{text}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A run aborted its circuit watcher without waiting for it, and left its signal
    /// listener running. `paceline run` then returned, the runtime shut down, and a
    /// watcher still in its poll slept on the stopped timer: "A Tokio 1.x context was
    /// found, but it is being shutdown" on stderr, amid `--log-format json`'s lines.
    ///
    /// A task's join handle may return a moment before tokio stops counting the task (on
    /// a busy machine, CI once counted one left): the count is read again for up to 2 s.
    /// A task left running (a watcher's loop, a listener) is still counted then.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_returns_only_once_the_tasks_it_started_have_ended() {
        let (dir, lane) = lane_of_10_per_second_in("run-tasks");
        let tasks = || tokio::runtime::Handle::current().metrics().num_alive_tasks();
        let before = tasks();
        let tasks_once_settled = || async move {
            for _ in 0..200 {
                if tasks() == before {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tasks()
        };

        lane.run(true, Some(Duration::from_secs(5)), false).await.unwrap();
        assert_eq!(tasks_once_settled().await, before, "a drained run left tasks running");
        lane.store.acquire_lease("someone-else", Duration::from_secs(60), SystemClock.now()).await.unwrap();
        assert!(lane.run(true, Some(Duration::from_secs(5)), false).await.is_err());
        assert_eq!(tasks_once_settled().await, before, "a failed run left tasks running");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Jobs that reached the queue another way (as a producer on SQS would) with a valid
    /// id but a CR/LF header or TRACE were dead-lettered with `job_id: null` and no record.
    #[tokio::test(start_paused = true)]
    async fn a_malformed_job_keeps_the_id_its_json_names_in_its_dead_letter_and_outcome_record() {
        let bodies = vec![
            r#"{"id":"crlf","request":{"method":"GET","path":"/items/1","headers":{"X-A":"a\r\nX-B: 1"}}}"#.to_owned(),
            r#"{"id":"trace","request":{"method":"TRACE","path":"/items/2"}}"#.to_owned(),
            r#"{"request":"no id at all"}"#.to_owned(),
        ];
        let (store, _) = drain("tiers = [\"10/s\"]\n", bodies, |worker| Arc::new(worker)).await;

        let records =
            paceline_shared::ports::DeadLetterQueues::page(store.as_ref(), paceline_shared::dlq::DlqSource::Jobs, None, 10, Duration::ZERO).await.unwrap();
        let ids: Vec<Option<&str>> = records.iter().map(|r| r.job_id.as_deref()).collect();
        assert_eq!(ids, vec![Some("crlf"), Some("trace"), None]);
        let dead = OutcomeQuery { status: Some(StatusFilter::Dead), limit: 10, ..OutcomeQuery::default() };
        let mut kept: Vec<(String, Option<String>)> = store.outcomes(&dead).unwrap().into_iter().map(|kept| (kept.record.job_id, kept.record.reason)).collect();
        kept.sort();
        assert_eq!(kept.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), vec!["crlf", "trace"]);
        assert!(kept.iter().all(|(_, reason)| reason.as_deref().is_some_and(|r| r.starts_with("malformed: "))), "{kept:?}");
    }
}
