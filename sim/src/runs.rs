//! The orchestrator's runs as Lambda starts them: the schedule's kick every minute
//! (after the kick's latency), the relay each run starts before it stops, reserved
//! concurrency 2 (a run and its relay), and a throttled event retried by Lambda after
//! 1 s, 2 s, 4 s... until it is a minute old.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use paceline_orchestrator::handover::{await_release, Relay, RelayRequest, Release};
use paceline_orchestrator::{handover_deadline, Orchestrator, RunOptions, HANDOVER};
use paceline_shared::ports::PortResult;
use paceline_shared::time::{Clock, UnixMillis};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::aws::{lock, SimStore, World};
use crate::profile::Stream;
use crate::THROTTLE_RETRY;

/// The orchestrator function's reserved concurrency in the template: a run and the
/// relay waiting for its lease.
pub const ORCHESTRATOR_CONCURRENCY: u64 = 2;

/// The orchestrator function's timeout and the schedule's period in the template.
pub const ORCHESTRATOR_TIMEOUT: Duration = Duration::from_secs(70);
pub const SCHEDULE: Duration = Duration::from_secs(60);

/// How long Lambda keeps retrying a throttled orchestrator event (the template's
/// maximum event age).
const EVENT_MAX_AGE: Duration = Duration::from_secs(60);

/// What became of the orchestrator's executions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RunCounts {
    /// Executions that ran, by kick or relay.
    pub executions: u64,
    /// Runs that took the lease as a relay.
    pub relayed: u64,
    /// Runs killed part-way (`--kill-run-at`).
    pub killed: u64,
}

/// Why an execution of the orchestrator function starts.
#[derive(Clone, Debug)]
enum Start {
    /// The schedule's kick for this minute.
    Kick { tick: UnixMillis },
    /// A run's relay, to take its lease at the release.
    Relay(RelayRequest),
}

/// The function's timing, as the template sets it.
#[derive(Clone, Copy, Debug)]
pub struct FunctionTiming {
    pub timeout: Duration,
    pub schedule: Duration,
    pub deadline_margin: Duration,
}

/// Starts executions of the orchestrator function and keeps count of them.
pub struct OrchestratorRuns {
    orchestrator: Arc<Orchestrator>,
    store: Arc<SimStore>,
    world: Arc<World>,
    timing: FunctionTiming,
    stop: watch::Receiver<bool>,
    /// Executions running now (reserved concurrency counts them).
    running: AtomicU64,
    /// Events Lambda took, by any cause (names holders, keys latency draws).
    events: AtomicU64,
    /// Executions that ran (an event throttled until it aged out never did).
    started: AtomicU64,
    relayed: AtomicU64,
    killed: AtomicU64,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The drain loops going now, by holder, to kill the lease's.
    going: Mutex<Vec<(String, tokio::task::AbortHandle)>>,
}

impl OrchestratorRuns {
    pub fn new(orchestrator: Arc<Orchestrator>, store: Arc<SimStore>, world: Arc<World>, timing: FunctionTiming, stop: watch::Receiver<bool>) -> Self {
        Self {
            orchestrator,
            store,
            world,
            timing,
            stop,
            running: AtomicU64::new(0),
            events: AtomicU64::new(0),
            started: AtomicU64::new(0),
            relayed: AtomicU64::new(0),
            killed: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
            going: Mutex::new(Vec::new()),
        }
    }

    /// Kills the run going now, as a crashed execution ends: no final snapshot, no
    /// release. Its lease expires; the work it handed off goes on.
    pub fn kill_current(&self) {
        let Some(holder) = self.store.lease_holder(self.world.clock.now()) else { return };
        let mut going = lock(&self.going);
        if let Some(index) = going.iter().position(|(name, _)| *name == holder) {
            going.remove(index).1.abort();
            self.killed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What became of the executions so far.
    #[must_use]
    pub fn counts(&self) -> RunCounts {
        RunCounts {
            executions: self.started.load(Ordering::Relaxed),
            relayed: self.relayed.load(Ordering::Relaxed),
            killed: self.killed.load(Ordering::Relaxed),
        }
    }

    /// The kick for `tick` arrives (EventBridge's latency is behind it).
    pub fn kick(self: &Arc<Self>, tick: UnixMillis) {
        self.world.ledger.count("lambda:Invoke (schedule)", 1);
        self.spawn(Start::Kick { tick });
    }

    /// Starts the executions relays ask for, until the channel closes.
    pub fn serve_relays(self: &Arc<Self>, mut requests: mpsc::UnboundedReceiver<RelayRequest>) -> JoinHandle<()> {
        let runs = self.clone();
        tokio::spawn(async move {
            while let Some(request) = requests.recv().await {
                runs.spawn(Start::Relay(request));
            }
        })
    }

    /// Waits for every execution to end.
    pub async fn join(&self) {
        loop {
            let tasks: Vec<_> = std::mem::take(&mut *lock(&self.tasks));
            if tasks.is_empty() {
                return;
            }
            for task in tasks {
                let _ = task.await;
            }
        }
    }

    fn spawn(self: &Arc<Self>, start: Start) {
        let runs = self.clone();
        let task = tokio::spawn(async move { runs.execute(start).await });
        lock(&self.tasks).push(task);
    }

    /// One event, from Lambda's queue to the end of its execution: throttled while
    /// reserved concurrency is in use, retried until the event is too old.
    async fn execute(&self, start: Start) {
        let received = self.world.clock.now();
        let n = self.events.fetch_add(1, Ordering::Relaxed) + 1;
        self.world.wait(Stream::AsyncStart, u64::MAX - n).await;
        let mut retry = THROTTLE_RETRY;
        while self.running.load(Ordering::Relaxed) >= ORCHESTRATOR_CONCURRENCY {
            if self.world.clock.now().since(received) + retry > EVENT_MAX_AGE || *self.stop.borrow() {
                return;
            }
            self.world.clock.sleep_until(self.world.clock.now().plus(retry)).await;
            retry *= 2;
        }
        self.running.fetch_add(1, Ordering::Relaxed);
        self.started.fetch_add(1, Ordering::Relaxed);
        let began = self.world.clock.now();
        self.run(start, n, began).await;
        self.world.ledger.orchestrator_ms.fetch_add(self.world.clock.now().since(began).as_millis() as u64, Ordering::Relaxed);
        self.running.fetch_sub(1, Ordering::Relaxed);
    }

    async fn run(&self, start: Start, n: u64, began: UnixMillis) {
        let FunctionTiming { timeout, schedule, deadline_margin } = self.timing;
        let deadline = began.plus(timeout);
        let tick = match &start {
            Start::Kick { tick } => *tick,
            Start::Relay(request) => {
                let give_up = deadline.minus(deadline_margin);
                match await_release(self.store.as_ref(), self.world.clock.as_ref(), request, give_up).await {
                    Ok(Release::Free) => {}
                    Ok(Release::TakenBy(_) | Release::StillHeld) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "simulated relay could not read the lease");
                        return;
                    }
                }
                self.relayed.fetch_add(1, Ordering::Relaxed);
                // The kick the released run stopped for.
                request.release_by.plus(HANDOVER)
            }
        };
        let deadline = handover_deadline(deadline, tick, schedule, deadline_margin);
        let holder = format!("run-{n}");
        let opts = RunOptions { holder: holder.clone(), deadline, drain: false, stop: Some(self.stop.clone()) };
        let orchestrator = self.orchestrator.clone();
        let run = tokio::spawn(async move { orchestrator.run(&opts).await });
        lock(&self.going).push((holder.clone(), run.abort_handle()));
        let ended = run.await;
        lock(&self.going).retain(|(name, _)| *name != holder);
        match ended {
            Ok(Ok(_) | Err(paceline_orchestrator::RunError::LeaseHeld(_))) | Err(_) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "simulated orchestrator run failed"),
        }
    }
}

/// The relay as Lambda carries it: an asynchronous invoke of the orchestrator function,
/// queued for [`OrchestratorRuns::serve_relays`].
pub struct SimRelay {
    world: Arc<World>,
    requests: mpsc::UnboundedSender<RelayRequest>,
}

impl SimRelay {
    #[must_use]
    pub fn new(world: Arc<World>, requests: mpsc::UnboundedSender<RelayRequest>) -> Self {
        Self { world, requests }
    }
}

#[async_trait::async_trait]
impl Relay for SimRelay {
    async fn start_next(&self, request: &RelayRequest) -> PortResult<()> {
        self.world.ledger.count("lambda:Invoke (relay)", 1);
        self.world.wait(Stream::Invoke, u64::MAX / 2 - request.release_by.0).await;
        // Closed only when the simulation is over.
        let _ = self.requests.send(request.clone());
        Ok(())
    }
}
