//! The orchestrator as a Lambda function: built once at cold start from `PACELINE_*`
//! variables, then each invocation (the EventBridge schedule, an operator's kick, or
//! the relay a run started) runs the drain loop until the invocation's deadline, minus
//! the margin (a scheduled run hands over just before the next kick it would overlap),
//! and prints its figures as CloudWatch metrics (embedded metric format) for the stack's
//! alarms. A run starts its relay, an asynchronous invoke of this same function, a few
//! seconds before it stops; the relay waits for the lease and takes it the moment it is
//! released (reserved concurrency 2: a run and its relay).

use std::sync::Arc;
use std::time::Duration;

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames, DynamoStateStore, LambdaInvoker};
use paceline_shared::config::{check_fifo_for_ordering, LanesConfig, WorkerHost};
use paceline_shared::keys::Shard;
use paceline_shared::lambda_env::Env;
use paceline_shared::metrics::{emf_record, emf_record_by, Metric};
use paceline_shared::ports::{Invoker, JobQueue, PortResult, StateStore as _};
use paceline_shared::shares::shard_quota;
use paceline_shared::time::{system_now, Clock, SystemClock, UnixMillis};
use serde::Deserialize;
use serde_json::{json, Value};
use tracing::Instrument as _;

use crate::handover::{Relay, RelayRequest, Release};
use crate::{handover_deadline, BatchingInvoker, Orchestrator, RunError, RunOptions, RunReport, Settings, HANDOVER};

/// How often the stack's schedule kicks the orchestrator (`rate(1 minute)` in
/// `infra/template.yaml`).
const SCHEDULE_EVERY: Duration = Duration::from_secs(60);

/// The function as built at cold start: each shard's orchestrator (one, for a stack of
/// one shard), the lane's name (the metrics' dimension) and, in a stack of shards, how
/// it starts the other shards' runs. Nothing is read from the environment after this.
pub struct OrchestratorFunction {
    /// Each shard's drain loop, by shard index.
    shards: Vec<Orchestrator>,
    lane: String,
    /// This function, which a kick of shard 0 invokes once for each other shard.
    kicker: Option<LambdaInvoker>,
    /// Where the stack records how many shards its runs run as (deployed functions).
    layout: Option<ShardLayout>,
}

impl OrchestratorFunction {
    #[must_use]
    pub fn new(orchestrator: Orchestrator, lane: impl Into<String>) -> Self {
        Self { shards: vec![orchestrator], lane: lane.into(), kicker: None, layout: None }
    }

    /// The drain loop the function runs on each kick (shard 0's in a stack of shards).
    #[must_use]
    pub fn orchestrator(&self) -> &Orchestrator {
        &self.shards[0]
    }

    /// Shard `index`'s drain loop, if the stack has that shard.
    #[must_use]
    pub fn shard(&self, index: usize) -> Option<&Orchestrator> {
        self.shards.get(index)
    }

    #[must_use]
    pub fn into_orchestrator(self) -> Orchestrator {
        self.shards.into_iter().next().expect("a function runs at least one shard")
    }

    /// Starts the runs of shards 1 and up (a kick of shard 0 does), each an asynchronous
    /// invoke of this function. One that fails is only logged: that shard's next kick
    /// comes within a minute.
    async fn kick_other_shards(&self) {
        let Some(kicker) = &self.kicker else { return };
        for index in 1..self.shards.len() {
            if let Err(e) = kicker.invoke_event(json!({ "kick_shard": index }).to_string()).await {
                tracing::warn!(error = %e, shard = index, "could not start the shard's run; its next kick comes within a minute");
            }
        }
    }
}

/// Builds the function from the environment and an SDK configuration.
///
/// # Errors
/// The first missing or invalid variable, named.
pub fn from_env(env: &Env<'_>, sdk: &aws_config::SdkConfig, lambda_endpoint: Option<&str>) -> Result<OrchestratorFunction, String> {
    let names = AwsNames::from_env(env, true)?;
    let quota = env.quota()?;
    let lanes = env.lanes(&quota)?;
    let ordering = env.ordering()?;
    let lane_ordering = LanesConfig::ordering_of_stack(lanes.as_ref(), ordering);
    check_fifo_for_ordering(&lane_ordering, &names.queue_url).map_err(|e| format!("PACELINE_ORDERING or PACELINE_LANES: {e}"))?;
    let shard_urls = shard_queues_from_env(env, lanes.is_some(), lane_ordering.any(), &names.queue_url)?;
    let (orchestrator_config, circuit) = (env.orchestrator()?, env.circuit()?);
    let aws = AwsAdapters::new(sdk, &names, lambda_endpoint);
    let relay = relay_function(env)?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let shard_queues: Vec<Arc<dyn JobQueue>> = shard_urls.iter().map(|url| Arc::new(aws.queue.at(url)) as Arc<dyn JobQueue>).collect();
    let count = shard_urls.len().max(1);
    let mut shards = Vec::with_capacity(count);
    for index in 0..count {
        let shard = Shard { index, of: count };
        // A shard paces its lanes under its share of the shared quota, which moves to where
        // the work is through the share book in the table.
        let (quota, share_most) = shard_quota(&quota, index, count).map_err(|e| format!("PACELINE_TIERS among PACELINE_SHARD_QUEUES's {count} shards: {e}"))?;
        let settings =
            Settings { quota, orchestrator: orchestrator_config, circuit, workers: WorkerHost::Lambda, lanes: lanes.clone(), ordering, shard, share_most };
        let invoker: Arc<dyn Invoker> = if settings.worker_batch() > 1 {
            Arc::new(BatchingInvoker::for_settings(Arc::new(aws.invoker.clone()), clock.clone(), &settings))
        } else {
            Arc::new(aws.invoker.clone())
        };
        let queue = shard_urls.get(index).map_or_else(|| aws.queue.clone(), |url| aws.queue.at(url));
        let store = Arc::new(aws.store.clone().for_shard(shard));
        let mut orchestrator = Orchestrator::new(Arc::new(queue), store.clone(), invoker, clock.clone(), settings)
            .with_scoped_stores(store)
            .with_stack_documents(Arc::new(aws.store.clone()));
        if count > 1 {
            orchestrator = orchestrator.with_shard_queues(shard_queues.clone())?;
        }
        if let Some(name) = &relay {
            orchestrator = orchestrator.with_relay(Arc::new(LambdaRelay { invoker: aws.invoker.for_function(name.clone()), shard: index }));
        }
        shards.push(orchestrator);
    }
    let kicker = (count > 1).then(|| env.optional("AWS_LAMBDA_FUNCTION_NAME")).flatten().map(|name| aws.invoker.for_function(name));
    let layout = Some(ShardLayout { store: aws.store.clone(), shards: count });
    Ok(OrchestratorFunction { shards, lane: env.stack_name(), kicker, layout })
}

/// The stack's shards as this function runs them, and the table that records how many
/// its runs last ran as. Runs of another layout (still going after a deploy changed
/// `Shards`) pace other shares of the shared quota, and each lane may live on another
/// shard there: no run of this layout starts while one of theirs holds a lease.
struct ShardLayout {
    store: DynamoStateStore,
    shards: usize,
}

/// What a run does about the stack's shard layout.
#[derive(Debug, PartialEq, Eq)]
enum LayoutStep {
    /// The stack runs as this function's shards: go.
    Run,
    /// It ran as `from` shards and none of their runs (nor of this layout's) holds a
    /// lease: record this function's layout, then go.
    Switch { from: usize },
    /// A run holds a lease while the layout changes: this kick does nothing; the next
    /// looks again.
    Wait(String),
}

/// The step for a function of `shards` shards in a stack whose runs last ran as
/// `recorded`, while the shards `held` (of either layout) hold their leases.
fn layout_step(shards: usize, recorded: usize, held: &[usize]) -> LayoutStep {
    if recorded == shards {
        LayoutStep::Run
    } else if held.is_empty() {
        LayoutStep::Switch { from: recorded }
    } else {
        LayoutStep::Wait(format!("the stack's shards change from {recorded} to {shards}: waiting for the runs holding the leases of shard(s) {held:?} to end"))
    }
}

impl ShardLayout {
    /// `Ok(None)` when a run may start now, `Ok(Some(why))` when it must wait.
    ///
    /// # Errors
    /// The table's.
    async fn settle(&self) -> PortResult<Option<String>> {
        let recorded = self.store.shard_layout().await?;
        if recorded == self.shards {
            return Ok(None);
        }
        let now = system_now();
        let mut held = Vec::new();
        for index in 0..recorded.max(self.shards) {
            let lease = self.store.clone().for_shard(Shard { index, of: self.shards }).lease().await?;
            if lease.is_some_and(|lease| lease.expires_at > now) {
                held.push(index);
            }
        }
        match layout_step(self.shards, recorded, &held) {
            LayoutStep::Run => Ok(None),
            LayoutStep::Wait(why) => Ok(Some(why)),
            LayoutStep::Switch { from } => {
                if self.store.switch_shard_layout(from, self.shards).await? || self.store.shard_layout().await? == self.shards {
                    tracing::info!(from, to = self.shards, "the stack's runs run as this layout's shards from now");
                    Ok(None)
                } else {
                    Ok(Some("another run changed the stack's shards first; the next kick looks again".into()))
                }
            }
        }
    }
}

/// Each shard's jobs queue by index (`PACELINE_SHARD_QUEUES`, a JSON list of URLs, the
/// first `PACELINE_QUEUE_URL`) in a stack of shards, whose runs this function starts
/// one per shard; none for a stack of one shard.
///
/// # Errors
/// Shards without lanes (a lane lives on one shard) or with ordered ones (a job sent on
/// to its shard would lose its place), or a list that is not JSON or does not start with
/// this stack's queue.
fn shard_queues_from_env(env: &Env<'_>, has_lanes: bool, ordered: bool, own_queue: &str) -> Result<Vec<String>, String> {
    let queues = env.shard_queues()?;
    if queues.is_empty() {
        return Ok(queues);
    }
    if !has_lanes {
        return Err("PACELINE_SHARD_QUEUES: shards divide a stack's lanes, and this stack has none (PACELINE_LANES)".into());
    }
    if ordered {
        return Err("PACELINE_SHARD_QUEUES: a stack of shards cannot have ordered lanes (ordering = \"fifo\") yet: deploy them in a stack of one shard".into());
    }
    if queues[0] != own_queue {
        return Err("PACELINE_SHARD_QUEUES: the first queue must be shard 0's, PACELINE_QUEUE_URL".into());
    }
    Ok(queues)
}

/// The function a run's relay invokes: this one (`AWS_LAMBDA_FUNCTION_NAME`, which Lambda
/// sets), unless `PACELINE_RELAY` is `off` (then the next minute's kick starts the next
/// run).
///
/// # Errors
/// `PACELINE_RELAY` other than `on` or `off`.
fn relay_function(env: &Env<'_>) -> Result<Option<String>, String> {
    match env.optional("PACELINE_RELAY").map(|relay| relay.trim().to_ascii_lowercase()).as_deref() {
        None | Some("on") => Ok(env.optional("AWS_LAMBDA_FUNCTION_NAME")),
        Some("off") => Ok(None),
        Some(other) => Err(format!("PACELINE_RELAY: `{other}` is neither on nor off")),
    }
}

/// Starts the relay: an asynchronous invoke of the orchestrator function with the
/// request (and the shard whose run it continues) as its event.
struct LambdaRelay {
    invoker: LambdaInvoker,
    shard: usize,
}

#[async_trait::async_trait]
impl Relay for LambdaRelay {
    async fn start_next(&self, request: &RelayRequest) -> paceline_shared::ports::PortResult<()> {
        self.invoker.invoke_event(json!({ "relay": request, "shard": self.shard }).to_string()).await
    }
}

/// Handles one kick. Not an error (the invocation succeeds, saying why it did nothing
/// or stopped): a kick while another run holds the lease, and a run ended by a passing
/// fault (throttling, a network blip; the next kick, a minute later, runs again). An
/// error, for the function's Errors alarm: a fault retrying will not mend (a missing
/// resource, a permission), after the run released what it held.
///
/// # Errors
/// A run error that is not retryable.
pub async fn handle(event: LambdaEvent<Trigger>, function: &OrchestratorFunction) -> Result<Value, lambda_runtime::Error> {
    // Every log line of the run carries the lane and, in a stack of shards, the shard.
    let shard = event.payload.shard();
    let span = tracing::info_span!("orchestrator", lane = %function.lane, shard);
    run_once(event, shard, function).instrument(span).await
}

async fn run_once(event: LambdaEvent<Trigger>, shard: usize, function: &OrchestratorFunction) -> Result<Value, lambda_runtime::Error> {
    let Some(orchestrator) = function.shard(shard) else {
        return Ok(json!({ "skipped": format!("this stack has {} shard(s), not shard {shard}", function.shards.len()) }));
    };
    if event.payload.starts_every_shard() {
        function.kick_other_shards().await;
    }
    let deadline = UnixMillis(event.context.deadline);
    let margin = orchestrator.settings().orchestrator.deadline_margin;
    let deadline = match &event.payload {
        Trigger::Relay(RelayEvent { relay, .. }) => {
            match orchestrator.await_release(relay, deadline.minus(margin)).await {
                // It stops before the kick the run it relays stopped for, as a scheduled run.
                Ok(Release::Free) => handover_deadline(deadline, relay.release_by.plus(HANDOVER), SCHEDULE_EVERY, margin),
                Ok(Release::TakenBy(holder)) => return Ok(json!({ "skipped": format!("the lease went to {holder}") })),
                Ok(Release::StillHeld) => return Ok(json!({ "skipped": format!("{} still held the lease", relay.after) })),
                Err(e) => return ended_by(RunError::Port(e)),
            }
        }
        trigger => match trigger.scheduled_for() {
            Some(tick) => handover_deadline(deadline, tick, SCHEDULE_EVERY, margin),
            None => deadline,
        },
    };
    if let Some(layout) = &function.layout {
        match layout.settle().await {
            Ok(None) => {}
            Ok(Some(why)) => {
                tracing::info!(%why, "not running");
                return Ok(json!({ "skipped": why }));
            }
            Err(e) => return ended_by(RunError::Port(e)),
        }
    }
    let opts = RunOptions { holder: format!("lambda:{}", event.context.request_id), deadline, drain: false, stop: None };
    match orchestrator.run(&opts).await {
        Ok(report) => {
            let circuit_open = orchestrator.progress().circuit_open.load(std::sync::atomic::Ordering::Relaxed);
            // Lambda sends standard output to CloudWatch Logs, which turns these into metrics.
            for record in metrics_records(&report, circuit_open, &function.lane) {
                println!("{record}");
            }
            Ok(serde_json::to_value(report)?)
        }
        Err(e) => ended_by(e),
    }
}

/// The invocation's answer to a run that ended on `e` (see [`handle`]).
fn ended_by(e: RunError) -> Result<Value, lambda_runtime::Error> {
    match e {
        RunError::LeaseHeld(why) => {
            tracing::info!(%why, "another run holds the lease; nothing to do");
            Ok(json!({ "skipped": why }))
        }
        e if e.is_retryable() => {
            tracing::warn!(error = %e, "the run ended on a passing fault; the next kick runs again");
            Ok(json!({ "failed": e.to_string(), "retryable": true }))
        }
        e => Err(e.into()),
    }
}

/// What starts a run: a run's relay, shard 0's kick of another shard, an EventBridge
/// event (the stack's schedule, or `paceline kick`'s event), or anything else a caller
/// sends (a test invocation's `{}`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Trigger {
    Relay(RelayEvent),
    ShardKick(ShardKick),
    Event(EventBridgeEvent),
    Other(Value),
}

/// The event a run's relay is started with: `{"relay": {"after": holder, "release_by":
/// ms}, "shard": index}` (no shard: shard 0).
#[derive(Clone, Debug, Deserialize)]
pub struct RelayEvent {
    pub relay: RelayRequest,
    #[serde(default)]
    pub shard: usize,
}

/// The event a kick of shard 0 starts another shard's run with: `{"kick_shard": index}`.
#[derive(Clone, Debug, Deserialize)]
pub struct ShardKick {
    pub kick_shard: usize,
}

impl Trigger {
    /// Which shard's run this starts.
    #[must_use]
    pub fn shard(&self) -> usize {
        match self {
            Self::Relay(relay) => relay.shard,
            Self::ShardKick(kick) => kick.kick_shard,
            Self::Event(_) | Self::Other(_) => 0,
        }
    }

    /// Whether this kick starts every shard's run (the schedule's, an operator's): not a
    /// relay, nor a shard's own kick.
    #[must_use]
    pub fn starts_every_shard(&self) -> bool {
        matches!(self, Self::Event(_) | Self::Other(_))
    }

    /// The minute a scheduled event (`aws.events`, `Scheduled Event`) was due: its `time`.
    /// `None` for any other event (an operator's kick).
    #[must_use]
    pub fn scheduled_for(&self) -> Option<UnixMillis> {
        match self {
            Self::Event(event) if event.source == "aws.events" && event.detail_type == "Scheduled Event" => {
                event.time.and_then(|time| u64::try_from(time.timestamp_millis()).ok()).map(UnixMillis)
            }
            _ => None,
        }
    }
}

/// The run's figures as CloudWatch embedded-metric-format records in namespace
/// `Paceline`. Under dimension `Lane`: `Dispatched`, `DeadLettered`, `HealthChecks`,
/// `CircuitOpen` (1 when the run ended with the circuit open), `QuotaExhausted` (1 when a
/// day or month tier has no room left) and `LongestWait` (seconds the oldest job handed
/// off had waited). Then one record per tier under `Lane` and `Tier`: `TierBusiestWindow`
/// (the busiest window's fill, percent of the limit: 100 is the limit) and
/// `TierUtilization` (percent of the tier's rate achieved while jobs waited; a calendar
/// tier's share of its day or month).
#[must_use]
pub fn metrics_records(report: &RunReport, circuit_open: bool, lane: &str) -> Vec<Value> {
    let exhausted = report.tiers.iter().any(|t| t.tier.is_calendar() && t.utilization >= 1.0);
    let metrics = [
        Metric::count("Dispatched", report.dispatched),
        Metric::count("DeadLettered", report.dead_lettered),
        Metric::count("HealthChecks", report.health_checks),
        Metric::flag("CircuitOpen", circuit_open),
        Metric::flag("QuotaExhausted", exhausted),
        Metric::seconds("LongestWait", report.longest_wait_ms / 1_000),
    ];
    let mut properties = serde_json::Map::new();
    properties.insert("Stop".into(), json!(report.stop));
    let mut records = vec![emf_record(report.ended_at, lane, &metrics, properties)];
    for tier in &report.tiers {
        let name = tier.tier.to_string();
        let fill = tier.peak_window as f64 / tier.tier.max_in_one_window().max(1) as f64;
        let metrics = [Metric::percent("TierBusiestWindow", fill), Metric::percent("TierUtilization", tier.utilization)];
        records.push(emf_record_by(report.ended_at, &[("Lane", lane), ("Tier", &name)], &metrics, serde_json::Map::new()));
    }
    records
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StopReason, TierReport};
    use paceline_shared::adapters::embedded::EmbeddedStore;
    use paceline_shared::adapters::memory::RecordingInvoker;
    use paceline_shared::ports::PortError;
    use paceline_shared::testing::faults::{Faulty, Method};

    /// A function over the embedded store whose lease acquire fails with `error`.
    fn function_failing_with(error: &PortError) -> OrchestratorFunction {
        let clock: Arc<SystemClock> = Arc::new(SystemClock);
        let store = Arc::new(Faulty::new(Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap())));
        store.fail_next(Method::AcquireLease, 1, error);
        let quota = paceline_shared::quota::Quota::new(vec!["5/s".parse().unwrap()], paceline_shared::quota::chrono_tz::UTC, Duration::ZERO).unwrap();
        let settings = Settings::defaults_for(quota, WorkerHost::Lambda);
        let orchestrator = Orchestrator::new(store.clone(), store, Arc::new(RecordingInvoker::new(clock.clone())), clock, settings);
        OrchestratorFunction::new(orchestrator, "sms")
    }

    #[tokio::test]
    async fn a_passing_fault_ends_the_invocation_without_error_and_a_fatal_one_with_an_error() {
        let kick = || LambdaEvent::new(Trigger::Other(json!({})), lambda_runtime::Context::default());
        let throttled = function_failing_with(&PortError::Throttled("ProvisionedThroughputExceededException".into()));
        let out = handle(kick(), &throttled).await.expect("a throttled store is not the invocation's error");
        assert_eq!(out["retryable"], true, "{out}");
        assert!(out["failed"].as_str().unwrap().contains("ProvisionedThroughput"), "{out}");
        let fatal = function_failing_with(&PortError::Fatal("ResourceNotFoundException: table paceline".into()));
        let err = handle(kick(), &fatal).await.expect_err("a missing table is");
        assert!(err.to_string().contains("ResourceNotFound"), "{err}");
    }

    #[test]
    fn metrics_record_flags_an_open_circuit_and_an_exhausted_calendar_tier() {
        let tier = |text: &str, utilization: f64| TierReport { tier: text.parse().unwrap(), units: 5, peak_window: 5, utilization };
        let mut report = RunReport {
            started_at: UnixMillis(1_000),
            ended_at: UnixMillis(61_000),
            stop: StopReason::Deadline,
            dispatched: 42,
            health_checks: 1,
            dead_lettered: 2,
            forwarded: 0,
            released: 0,
            sent_again: 0,
            paced_ms: 60_000,
            paced_by: Some("10/s".parse().unwrap()),
            slowest_rate: None,
            tiers: vec![tier("10/s", 1.0), tier("1000/day", 0.5)],
            longest_wait_ms: 95_400,
            slots_given_back: 0,
            lanes: Vec::new(),
            fairness: None,
        };
        let records = metrics_records(&report, true, "sms");
        let record = &records[0];
        assert_eq!((record["Dispatched"].as_u64(), record["CircuitOpen"].as_u64(), record["QuotaExhausted"].as_u64()), (Some(42), Some(1), Some(0)));
        assert_eq!(record["_aws"]["CloudWatchMetrics"][0]["Metrics"].as_array().unwrap().len(), 6);
        assert_eq!((record["Lane"].as_str(), record["_aws"]["Timestamp"].as_u64(), record["LongestWait"].as_u64()), (Some("sms"), Some(61_000), Some(95)));
        // One record per tier, under Lane and Tier: the busiest window's fill (5 of 10)
        // and the utilization, in percent.
        assert_eq!(records.len(), 3);
        let second = &records[1];
        assert_eq!((second["Tier"].as_str(), &second["_aws"]["CloudWatchMetrics"][0]["Dimensions"]), (Some("10/s"), &json!([["Lane", "Tier"]])));
        assert_eq!((second["TierBusiestWindow"].as_f64(), second["TierUtilization"].as_f64()), (Some(50.0), Some(100.0)));
        assert_eq!((records[2]["Tier"].as_str(), records[2]["TierUtilization"].as_f64()), (Some("1000/day"), Some(50.0)));
        report.tiers[1].utilization = 1.0;
        assert_eq!(metrics_records(&report, false, "sms")[0]["QuotaExhausted"], 1);
    }

    #[test]
    fn only_scheduled_events_carry_a_tick() {
        let trigger = |event: Value| serde_json::from_value::<Trigger>(event).unwrap();
        let scheduled = json!({
            "version": "0", "id": "53dc4d37-cffa-4f76-80c9-8b7d4a4d2eaa", "detail-type": "Scheduled Event", "source": "aws.events",
            "account": "123456789012", "time": "2026-11-23T01:46:00Z", "region": "us-east-1",
            "resources": ["arn:aws:events:us-east-1:123456789012:rule/paceline-schedule"], "detail": {}
        });
        assert!(matches!(trigger(scheduled.clone()), Trigger::Event(_)));
        assert_eq!(trigger(scheduled).scheduled_for(), Some(UnixMillis(1_795_398_360_000)));
        let kick = json!({ "source": "paceline.cli", "detail-type": "Kick", "detail": { "at": "2026-11-23T01:46:00Z" } });
        assert!(matches!(trigger(kick.clone()), Trigger::Event(_)), "paceline kick sends an EventBridge-shaped event");
        assert_eq!(trigger(kick).scheduled_for(), None);
        assert_eq!(trigger(json!({})).scheduled_for(), None);
        assert_eq!(trigger(json!({ "detail-type": "Scheduled Event", "source": "aws.events", "time": "soon", "detail": {} })).scheduled_for(), None);
        let relay = trigger(json!({ "relay": { "after": "lambda:8f1c", "release_by": 1_795_398_419_750_u64 } }));
        let Trigger::Relay(RelayEvent { relay, shard: 0 }) = relay else { panic!("a relay's event is read as a relay of shard 0: {relay:?}") };
        assert_eq!(relay, RelayRequest { after: "lambda:8f1c".into(), release_by: UnixMillis(1_795_398_419_750) });
        // In a stack of shards: a shard's relay, and shard 0's kick of another shard.
        let relay = trigger(json!({ "relay": { "after": "lambda:8f1c", "release_by": 1_795_398_419_750_u64 }, "shard": 2 }));
        assert_eq!((relay.shard(), relay.starts_every_shard()), (2, false));
        let kick = trigger(json!({ "kick_shard": 3 }));
        assert!(matches!(kick, Trigger::ShardKick(_)), "{kick:?}");
        assert_eq!((kick.shard(), kick.starts_every_shard()), (3, false));
        assert!(trigger(json!({})).starts_every_shard(), "a kick of the stack starts every shard's run");
    }

    #[test]
    fn a_run_relays_to_its_own_function_unless_paceline_relay_is_off() {
        let relay = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            let get = move |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            relay_function(&Env::new(&get))
        };
        assert_eq!(relay(&[("AWS_LAMBDA_FUNCTION_NAME", "sms-orchestrator")]), Ok(Some("sms-orchestrator".into())));
        assert_eq!(relay(&[("AWS_LAMBDA_FUNCTION_NAME", "sms-orchestrator"), ("PACELINE_RELAY", "On")]), Ok(Some("sms-orchestrator".into())));
        assert_eq!(relay(&[("AWS_LAMBDA_FUNCTION_NAME", "sms-orchestrator"), ("PACELINE_RELAY", "off")]), Ok(None));
        assert_eq!(relay(&[]), Ok(None), "outside Lambda: no function to relay to");
        assert_eq!(relay(&[("PACELINE_RELAY", "sometimes")]), Err("PACELINE_RELAY: `sometimes` is neither on nor off".into()));
    }

    #[test]
    fn a_new_shard_layout_waits_for_every_lease_of_either_layout_then_is_recorded() {
        assert_eq!(layout_step(2, 2, &[0, 1]), LayoutStep::Run, "the same layout: leases are the runs' own business");
        assert_eq!(layout_step(4, 2, &[]), LayoutStep::Switch { from: 2 });
        let LayoutStep::Wait(why) = layout_step(1, 3, &[2]) else { panic!("a held lease of the old layout holds the new") };
        assert!(why.contains("from 3 to 1") && why.contains("[2]"), "{why}");
    }

    #[test]
    fn shards_need_lanes_without_order_and_the_first_queue_is_the_stack_s_own() {
        let shards = |queues: Option<&str>, lanes: bool, ordered: bool| {
            let queues = queues.map(str::to_owned);
            let get = move |name: &str| (name == "PACELINE_SHARD_QUEUES").then(|| queues.clone()).flatten();
            shard_queues_from_env(&Env::new(&get), lanes, ordered, "https://sqs/q0")
        };
        assert_eq!(shards(None, false, false), Ok(Vec::new()), "a stack of one shard");
        assert_eq!(shards(Some(r#"["https://sqs/q0"]"#), true, false), Ok(Vec::new()), "one shard listed");
        let two = r#"["https://sqs/q0", "https://sqs/q1"]"#;
        assert_eq!(shards(Some(two), true, false).unwrap().len(), 2);
        let refused = |queues: &str, lanes: bool, ordered: bool, says: &str| {
            let error = shards(Some(queues), lanes, ordered).unwrap_err();
            assert!(error.contains(says), "{error}");
        };
        refused(two, false, false, "has none (PACELINE_LANES)");
        refused(two, true, true, "cannot have ordered lanes");
        refused(r#"["https://sqs/q1", "https://sqs/q0"]"#, true, false, "the first queue must be shard 0's");
        refused("q0,q1", true, false, "not a JSON list");
    }
}
