//! The AWS adapters and Lambda handlers end to end: SQS and DynamoDB on the moto server,
//! Lambda Invoke on a fake endpoint of ours that runs the real worker, and a strict
//! fake API. These drive the real drain loop through the real adapters.
#![expect(clippy::disallowed_methods, reason = "end-to-end: waits on this machine's clock for servers, processes and moto")]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use lambda_runtime::{Context, LambdaEvent};
use paceline_cli::fake_api::{FakeApi, FakeApiSpec};
use paceline_e2e::aws::{create_lane, create_lane_of, create_queue, lane_env, moto_sdk_config, FakeLambda, QueueKind};
use paceline_e2e::two_percent_failing_api;
use paceline_orchestrator::{lambda as orchestrator_lambda, Orchestrator, RunError, RunOptions, RunReport, StopReason};
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames, DynamoStateStore, SqsQueue};
use paceline_shared::adapters::memory::RecordingWorker;
use paceline_shared::check::peak_in_any_window;
use paceline_shared::dlq::DlqSource;
use paceline_shared::job::WorkerPayload;
use paceline_shared::keys::StoreScope;
use paceline_shared::lambda_env::Env;
use paceline_shared::outcome::{from_destination, Ending, OutcomeRecord};
use paceline_shared::ports::{call_record_key, CallClaim, DeadLetterQueues, PortError};
use paceline_shared::ports::{read_document, write_document, JobQueue, OutgoingMessage, StackDocument, StateStore, WorkerHandler};
use paceline_shared::shares::ShareBook;
use paceline_shared::testing::contract;
use paceline_shared::time::{system_now, SystemClock, UnixMillis};
use serde_json::json;

/// A lane on moto: resources, a fake Lambda, and the environment its functions read.
struct Lane {
    sdk: aws_config::SdkConfig,
    names: AwsNames,
    lambda: FakeLambda,
    env: BTreeMap<String, String>,
}

async fn lane(tiers: &str) -> Lane {
    lane_on(tiers, QueueKind::Standard).await
}

async fn lane_on(tiers: &str, kind: QueueKind) -> Lane {
    let sdk = moto_sdk_config().await;
    let names = create_lane_of(&sdk, "paceline-worker", kind).await;
    let lambda = FakeLambda::start().await;
    let env = lane_env(
        &names,
        &[
            ("PACELINE_WORKER_FUNCTION", "paceline-worker"),
            ("PACELINE_TIERS", tiers),
            // As the other end-to-end suites: on the 2-core machine that runs them, moto's
            // server and the parallel tests can hold a worker's call more than half the
            // default 10 ms margin after its slot's last check, and the fake API's limiter
            // is strict (once in CI: one 429 in the killed-run test).
            ("PACELINE_SAFETY_MARGIN", "25ms"),
            ("PACELINE_HEALTH_CHECK_INTERVAL", "1s"),
            ("PACELINE_DEADLINE_MARGIN", "1s"),
            ("PACELINE_VISIBILITY_TIMEOUT", "20s"),
            ("PACELINE_HEALTH_CHECK", r#"{"method":"GET","path":"/health"}"#),
        ],
    );
    Lane { sdk, names, lambda, env }
}

impl Lane {
    fn orchestrator(&self) -> Orchestrator {
        self.function().into_orchestrator()
    }

    fn function(&self) -> orchestrator_lambda::OrchestratorFunction {
        let get = |k: &str| self.env.get(k).cloned();
        orchestrator_lambda::from_env(&Env::new(&get), &self.sdk, Some(&self.lambda.url)).unwrap()
    }

    /// Runs the real worker (built from the same environment) behind the fake Lambda; it
    /// is returned for what it counted.
    fn with_worker_calling(&mut self, api: &FakeApi) -> Arc<paceline_worker::Worker> {
        self.env.insert("PACELINE_API_BASE_URL".into(), api.base_url.clone());
        let get = |k: &str| self.env.get(k).cloned();
        let worker = Arc::new(paceline_worker::lambda::from_env(&Env::new(&get), &self.sdk).unwrap());
        self.lambda.run_worker(worker.clone());
        worker
    }

    fn adapters(&self) -> AwsAdapters {
        AwsAdapters::new(&self.sdk, &self.names, Some(&self.lambda.url))
    }

    fn queue(&self) -> SqsQueue {
        self.adapters().queue
    }

    fn store(&self) -> DynamoStateStore {
        self.adapters().store
    }

    async fn enqueue(&self, bodies: Vec<String>) {
        let messages: Vec<OutgoingMessage> = bodies.into_iter().map(OutgoingMessage::fresh).collect();
        for batch in messages.chunks(10) {
            self.queue().send(batch).await.unwrap();
        }
    }

    /// Runs the lane's orchestrator again, draining, `pause` after the last run and up
    /// to `runs` times, until its queue is empty: what workers put back after a run (a
    /// re-queue with a delay, a job whose worker started after its slot on a loaded
    /// machine) the next scheduled runs take.
    async fn run_again_until_drained(&self, runs: usize, pause: Duration) {
        for _ in 0..runs {
            tokio::time::sleep(pause).await;
            self.orchestrator().run(&drain_opts("next", Duration::from_secs(30))).await.unwrap();
            self.lambda.settle(Duration::from_secs(10)).await;
            let depth = self.queue().depth().await.unwrap();
            if depth.visible == 0 && depth.not_visible == 0 {
                break;
            }
        }
    }

    fn job_ids(&self) -> Vec<String> {
        self.lambda
            .invocations()
            .into_iter()
            .flat_map(|i| i.payload.batch_calls())
            .filter_map(|call| match call {
                Ok(WorkerPayload::Job { job, .. }) => Some(job.id.to_string()),
                _ => None,
            })
            .collect()
    }
}

fn jobs(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!(r#"{{"id":"{prefix}-{i:03}","request":{{"method":"POST","path":"/items/{prefix}-{i:03}"}}}}"#)).collect()
}

fn drain_opts(holder: &str, within: Duration) -> RunOptions {
    RunOptions { holder: holder.into(), deadline: system_now().plus(within), drain: true, stop: None }
}

async fn api(tiers: &[&str], outage: Option<(Duration, Duration)>) -> FakeApi {
    FakeApi::start(FakeApiSpec {
        tiers: tiers.iter().map(|t| t.parse().unwrap()).collect(),
        latency: (Duration::from_millis(20), Duration::from_millis(80)),
        outage,
        server_error_every: None,
        max_concurrent: None,
        others_per_second: 0.0,
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_paced_through_sqs_and_lambda_and_deleted_only_once_handed_off() {
    let mut lane = lane("5/s").await;
    let api = api(&["5/s"], None).await;
    let worker = lane.with_worker_calling(&api);
    lane.lambda.refuse_next(2, 429);
    lane.enqueue(jobs("paced", 15)).await;

    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(60))).await.unwrap();
    lane.lambda.settle(Duration::from_secs(10)).await;
    assert_eq!(report.stop, StopReason::Drained);
    // A worker that started after its job's slot (a loaded machine) put the job back on
    // the queue without a call, as it should: if that came after the run drained, the
    // next run hands it off again.
    let left = lane.queue().depth().await.unwrap();
    if left.visible + left.not_visible > 0 {
        lane.orchestrator().run(&drain_opts("test-2", Duration::from_secs(30))).await.unwrap();
        lane.lambda.settle(Duration::from_secs(10)).await;
    }

    let invocations = lane.lambda.invocations();
    assert!(invocations.iter().all(|i| i.invocation_type == "Event" && i.function == "paceline-worker"));
    let ids = lane.job_ids();
    let missed = worker.stats().missed_slots.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        ids.len() as u64,
        15 + missed,
        "each job handed off once, throttled invokes retried, and again only after its worker missed its slot ({missed} times): {ids:?}"
    );
    assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), 15);
    // Handed off in batches ahead of their slots: the pace shows at the API.
    let log = api.log();
    assert_eq!((log.ok, log.quota_rejections), (15, 0));
    assert!(log.ok_by_path.values().all(|calls| *calls == 1), "each job called once: {:?}", log.ok_by_path);
    let arrivals: Vec<(UnixMillis, u64)> = log.arrivals.iter().map(|at| (*at, 1)).collect();
    assert!(peak_in_any_window(&arrivals, Duration::from_secs(1)) <= 5, "more than 5 calls in one second");
    let span = log.arrivals.last().unwrap().since(log.arrivals[0]);
    assert!(span >= Duration::from_millis(14 * 200 - 10), "15 jobs at 5/s took only {span:?}");
    let depth = lane.queue().depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible, depth.dead), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lambda_service_errors_are_retried_and_no_job_is_lost_or_doubled() {
    let lane = lane("20/s").await;
    lane.lambda.refuse_next(3, 500);
    lane.enqueue(jobs("flaky", 6)).await;
    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(60))).await.unwrap();
    assert_eq!((report.stop, report.dispatched), (StopReason::Drained, 6));
    let ids = lane.job_ids();
    assert_eq!((ids.len(), ids.iter().collect::<BTreeSet<_>>().len()), (6, 6), "{ids:?}");
    assert_eq!(lane.queue().depth().await.unwrap(), Default::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_reach_the_dlq_with_their_reason() {
    let lane = lane("20/s").await;
    lane.enqueue(vec!["garbage".into(), r#"{"request":{"method":"GET","path":"https://elsewhere.example/"}}"#.into(), jobs("ok", 1).remove(0)]).await;
    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(30))).await.unwrap();
    assert_eq!((report.dispatched, report.dead_lettered), (1, 2));

    let sqs = aws_sdk_sqs::Client::new(&lane.sdk);
    let out = sqs.receive_message().queue_url(&lane.names.dlq_url).max_number_of_messages(10).message_attribute_names("All").send().await.unwrap();
    let mut dead: Vec<(String, String, String)> = out
        .messages()
        .iter()
        .map(|m| {
            let attr = |k: &str| m.message_attributes().and_then(|a| a.get(k)).and_then(|v| v.string_value()).unwrap_or_default().to_owned();
            (m.body().unwrap_or_default().to_owned(), attr("cause"), attr("detail"))
        })
        .collect();
    dead.sort();
    assert_eq!(dead.len(), 2);
    assert_eq!((dead[0].0.as_str(), dead[0].1.as_str()), ("garbage", "malformed"));
    assert!(dead[0].2.starts_with("not a job"), "{}", dead[0].2);
    assert!(dead[1].2.contains("request.path"), "{}", dead[1].2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_orchestrator_is_kept_out_while_the_first_holds_the_lease() {
    let lane = lane("10/s").await;
    lane.enqueue(jobs("lease", 12)).await;
    let (first, second) = (lane.orchestrator(), lane.orchestrator());
    let (opts_a, opts_b) = (drain_opts("a", Duration::from_secs(30)), drain_opts("b", Duration::from_secs(30)));
    // The second starts 300 ms into the first run. (Two conditional writes that reach
    // moto in the same instant can both pass, as they cannot on DynamoDB: moto does not
    // serialize them.)
    let late_second = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        second.run(&opts_b).await
    };
    let (a, b) = tokio::join!(first.run(&opts_a), late_second);
    let held = [&a, &b].iter().filter(|r| matches!(r, Err(RunError::LeaseHeld(_)))).count();
    assert_eq!(held, 1, "exactly one was kept out: {:?} / {:?}", a.as_ref().map(|r| r.dispatched), b.as_ref().map(|r| r.dispatched));
    let ids = lane.job_ids();
    assert_eq!((ids.len(), ids.iter().collect::<BTreeSet<_>>().len()), (12, 12));
    // The lease is free again, with a higher epoch next time.
    let lease = lane.store().acquire_lease("later", Duration::from_secs(5), system_now()).await.unwrap();
    assert_eq!(lease.epoch, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn day_counters_survive_a_restart() {
    let lane = lane("20/s,4/day").await;
    lane.enqueue(jobs("day", 6)).await;
    let run = |holder: &'static str| {
        let orchestrator = lane.orchestrator();
        async move { orchestrator.run(&RunOptions { drain: false, ..drain_opts(holder, Duration::from_secs(4)) }).await.unwrap() }
    };
    let first = run("first").await;
    assert_eq!(first.dispatched, 4);
    let tier: paceline_shared::quota::Tier = "4/day".parse().unwrap();
    let key = tier.usage_key(paceline_shared::quota::chrono_tz::UTC, system_now());
    assert_eq!(lane.store().load_usage(&[key]).await.unwrap(), vec![4]);
    let second = run("second").await;
    assert_eq!(second.dispatched, 0, "a new run (a new process) still knows the day is used up");
    assert_eq!(lane.queue().depth().await.unwrap().visible, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_failure_opens_the_circuit_and_a_health_check_closes_it() {
    let mut lane = lane("10/s").await;
    let api = api(&["10/s"], Some((Duration::from_millis(500), Duration::from_secs(2)))).await;
    lane.with_worker_calling(&api);
    lane.enqueue(jobs("outage", 25)).await;
    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(90))).await.unwrap();
    lane.lambda.settle(Duration::from_secs(10)).await;
    // A job whose worker started after its slot (a loaded machine) went back uncalled.
    lane.run_again_until_drained(4, Duration::from_secs(1)).await;

    assert_eq!(report.stop, StopReason::Drained);
    assert!(report.health_checks >= 1);
    let circuit = lane.store().circuit().await.unwrap();
    assert!(circuit.is_closed() && circuit.epoch >= 2, "{circuit:?}");
    let log = api.log();
    assert!(log.outage_failures >= 1);
    let succeeded: BTreeSet<&str> = log.ok_by_path.keys().filter_map(|p| p.strip_prefix("/items/")).collect();
    assert_eq!(succeeded.len(), 25, "every job succeeded after the outage");
    assert_eq!(log.quota_rejections, 0);
    assert_eq!(lane.queue().depth().await.unwrap().dead, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_server_errors_retry_their_own_job_through_sqs_delays_and_never_open_the_circuit() {
    let mut lane = lane("10/s").await;
    lane.env.insert("PACELINE_BACKOFF_BASE".into(), "200ms".into());
    let spec = FakeApiSpec {
        tiers: vec!["10/s".parse().unwrap()],
        latency: (Duration::from_millis(20), Duration::from_millis(80)),
        server_error_every: Some(8),
        ..FakeApiSpec::default()
    };
    let api = FakeApi::start(spec).await.unwrap();
    lane.with_worker_calling(&api);
    lane.enqueue(jobs("noise", 30)).await;
    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(60))).await.unwrap();
    lane.lambda.settle(Duration::from_secs(10)).await;
    assert_eq!(report.stop, StopReason::Drained);
    // A worker answered after the drain may have re-queued its job with a delay (or
    // started after its slot, on a loaded machine, run after run).
    lane.run_again_until_drained(6, Duration::from_secs(1)).await;

    let log = api.log();
    assert!(log.server_errors >= 3, "{log:?}");
    let succeeded: BTreeSet<&str> = log.ok_by_path.keys().filter_map(|p| p.strip_prefix("/items/")).collect();
    assert_eq!(succeeded.len(), 30, "every job succeeded on a retry of its own");
    let circuit = lane.store().circuit().await.unwrap();
    assert_eq!((circuit.status, circuit.epoch), (paceline_shared::breaker::CircuitStatus::Closed, 0), "never opened");
    assert_eq!((log.quota_rejections, lane.queue().depth().await.unwrap().dead), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orchestrator_lambda_runs_a_scheduled_kick_until_its_deadline() {
    let lane = lane("10/s").await;
    lane.enqueue(jobs("kick", 3)).await;
    let mut context = Context::default();
    context.request_id = "req-1".into();
    context.deadline = system_now().plus(Duration::from_secs(4)).0;
    let scheduled = serde_json::json!({"version": "0", "detail-type": "Scheduled Event", "source": "aws.events", "detail": {}});
    let started = system_now();
    let out = orchestrator_lambda::handle(LambdaEvent::new(serde_json::from_value(scheduled).unwrap(), context), &lane.function()).await.unwrap();
    assert_eq!(out["dispatched"], 3, "{out}");
    assert_eq!(out["stop"], "deadline");
    let took = system_now().since(started);
    assert!(took >= Duration::from_millis(2_900) && took < Duration::from_secs(4), "stopped a margin before the deadline: {took:?}");

    // A kick while another run holds the lease returns at once, without error.
    let held = lane.store().acquire_lease("other", Duration::from_secs(30), system_now()).await.unwrap();
    let mut context = Context::default();
    context.deadline = system_now().plus(Duration::from_secs(10)).0;
    let out =
        orchestrator_lambda::handle(LambdaEvent::new(orchestrator_lambda::Trigger::Other(serde_json::json!({})), context), &lane.function()).await.unwrap();
    assert!(out["skipped"].as_str().unwrap().contains("other"), "{out}");
    lane.store().release_lease(&held).await.unwrap();
}

#[tokio::test]
async fn the_worker_reads_its_api_token_from_secrets_manager_and_a_missing_one_fails_the_cold_start() {
    use paceline_worker::lambda::ApiSecrets;
    use secrecy::ExposeSecret;
    let sdk = moto_sdk_config().await;
    let secrets = aws_sdk_secretsmanager::Client::new(&sdk);
    let prefix = format!("paceline-{}", uuid::Uuid::new_v4().simple());
    let created = secrets.create_secret().name(format!("{prefix}/token")).secret_string("t0ken\n").send().await.unwrap();
    let arn = created.arn().unwrap().to_owned();
    secrets.create_secret().name(format!("{prefix}/keys/acme")).secret_string("k-acme").send().await.unwrap();

    // A name with {lane} is each lane's own: not read at cold start.
    let wanted = format!(r#"{{"API_TOKEN": "{arn}", "KEY_{{lane}}": "{prefix}/keys/{{lane}}"}}"#);
    let get = |k: &str| (k == "PACELINE_API_SECRETS").then(|| wanted.clone());
    let read = ApiSecrets::fetch(&Env::new(&get), &sdk).await.unwrap();
    assert_eq!(read.value("API_TOKEN").map(ExposeSecret::expose_secret), Some("t0ken"));
    assert!(read.value("KEY_acme").is_none() && read.value("KEY_{lane}").is_none());
    let acme = read.for_lane(&"acme".parse().unwrap()).await.unwrap();
    assert_eq!(acme["KEY_acme"].expose_secret(), "k-acme");
    let missing = read.for_lane(&"nokey".parse().unwrap()).await.unwrap_err();
    assert!(missing.starts_with(&format!("cannot read secret KEY_nokey ({prefix}/keys/nokey)")), "{missing}");

    let missing = r#"{"API_TOKEN": "arn:aws:secretsmanager:us-east-1:123456789012:secret:nope"}"#.to_owned();
    let get = |k: &str| (k == "PACELINE_API_SECRETS").then(|| missing.clone());
    let Err(error) = ApiSecrets::fetch(&Env::new(&get), &sdk).await else { panic!("a missing secret fails the cold start") };
    assert!(error.contains("API_TOKEN") && error.contains("secret:nope"), "{error}");
    let none = |_: &str| None;
    assert!(ApiSecrets::fetch(&Env::new(&none), &sdk).await.unwrap().value("API_TOKEN").is_none());
}

/// Held by the tests that load moto most (an ordered lane's FIFO receives read the whole
/// queue) or need it quick (a run killed at 3.3 s, a lease of 2 s): they never run
/// beside each other.
static MOTO_BUSY_OR_TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orchestrator_killed_mid_run_never_lets_the_day_counter_fall_under_the_calls() {
    let _alone = MOTO_BUSY_OR_TIMED.lock().await;
    let mut lane = lane("5/s,60/day").await;
    lane.env.insert("PACELINE_LEASE_TTL".into(), "2s".into());
    lane.env.insert("PACELINE_VISIBILITY_TIMEOUT".into(), "4s".into());
    let api = api(&["5/s", "60/day"], None).await;
    lane.with_worker_calling(&api);
    lane.enqueue(jobs("crash", 30)).await;
    let key = "60/day".parse::<paceline_shared::quota::Tier>().unwrap().usage_key(paceline_shared::quota::chrono_tz::UTC, system_now());

    // Killed 3.3 s in: the run's future is dropped where it stands, nothing flushed.
    let killed = tokio::time::timeout(Duration::from_millis(3_300), lane.orchestrator().run(&drain_opts("killed", Duration::from_secs(60)))).await;
    assert!(killed.is_err(), "the run was meant to be cut off");
    let handed_off = lane.job_ids().len() as u64;
    let counted = lane.store().load_usage(std::slice::from_ref(&key)).await.unwrap()[0];
    assert!(handed_off >= 10, "the killed run had barely started ({handed_off})");
    assert!(counted >= handed_off, "the day counter says {counted} after {handed_off} hand-offs");

    // Once its lease expires, a second run finishes the drain.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let report = lane.orchestrator().run(&drain_opts("second", Duration::from_secs(60))).await.unwrap();
    assert_eq!(report.stop, StopReason::Drained);
    // Lambda workers get their job ahead of its slot (PACELINE_DISPATCH_AHEAD defaults
    // to 500 ms): the last ones call a moment after the run is drained.
    let settled_by = system_now().plus(Duration::from_secs(5));
    while api.log().ok_by_path.len() < 30 && system_now() < settled_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A job whose worker started after its slot (a loaded machine) went back uncalled.
    lane.run_again_until_drained(4, Duration::from_secs(1)).await;
    let log = api.log();
    let counted = lane.store().load_usage(&[key]).await.unwrap()[0];
    println!("killed after {handed_off} hand-offs; the API saw {} calls; day counter {counted}", log.arrivals.len());
    assert_eq!(log.quota_rejections, 0, "a window or the day went over its limit");
    assert!(counted <= 60 && log.arrivals.len() <= 60);
    assert!(counted >= log.arrivals.len() as u64, "the day counter {counted} is under the {} calls made", log.arrivals.len());
    let succeeded: BTreeSet<String> = log.ok_by_path.keys().filter_map(|p| p.strip_prefix("/items/")).map(str::to_owned).collect();
    assert_eq!(succeeded.len(), 30, "every job succeeded");
}

/// Every record on the results queue so far, read as a producer would (deleted once
/// read); with how many invocations ended no job (null payloads).
async fn read_results(sqs: &aws_sdk_sqs::Client, queue_url: &str) -> (BTreeMap<String, OutcomeRecord>, usize) {
    let (mut records, mut nulls) = (BTreeMap::new(), 0);
    loop {
        let out = sqs.receive_message().queue_url(queue_url).max_number_of_messages(10).wait_time_seconds(1).send().await.unwrap();
        let messages = out.messages.unwrap_or_default();
        if messages.is_empty() {
            return (records, nulls);
        }
        for message in messages {
            match from_destination(message.body().unwrap()).unwrap() {
                Some(record) => {
                    records.insert(record.job_id.clone(), record);
                }
                None => nulls += 1,
            }
            sqs.delete_message().queue_url(queue_url).receipt_handle(message.receipt_handle().unwrap()).send().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_results_queue_receives_each_job_s_outcome_record_through_the_on_success_destination() {
    let mut lane = lane("10/s").await;
    // One job an invocation, as a stack whose results go to SNS or EventBridge hands off.
    lane.env.insert("PACELINE_WORKER_BATCH".into(), "1".into());
    let api = api(&["10/s"], None).await;
    let worker = lane.with_worker_calling(&api);
    let results = paceline_e2e::aws::create_queue(&lane.sdk, "paceline-results").await;
    let sqs = aws_sdk_sqs::Client::new(&lane.sdk);
    lane.lambda.deliver_results_to(sqs.clone(), results.clone());
    let mut bodies: Vec<String> = (0..6)
        .map(|i| format!(r#"{{"id":"echo-{i}","request":{{"method":"GET","path":"/items/echo-{i}","query":{{"echo":"v{i}"}}}},"metadata":{{"n":{i}}}}}"#))
        .collect();
    bodies.push(r#"{"id":"gone-1","request":{"method":"GET","path":"/missing/1"}}"#.into());
    bodies.push(r#"{"id":"quiet-1","request":{"method":"GET","path":"/items/quiet-1"},"fire_and_forget":true}"#.into());
    lane.enqueue(bodies).await;

    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(60))).await.unwrap();
    lane.lambda.settle(Duration::from_secs(10)).await;
    assert_eq!(report.stop, StopReason::Drained);

    let (records, nulls) = read_results(&sqs, &results).await;
    assert_eq!(records.keys().map(String::as_str).collect::<Vec<_>>(), ["echo-0", "echo-1", "echo-2", "echo-3", "echo-4", "echo-5", "gone-1"]);
    for i in 0..6 {
        let record = &records[&format!("echo-{i}")];
        assert_eq!((record.outcome, record.status, record.attempts), (Ending::Succeeded, Some(200), 1));
        assert_eq!((record.body.as_ref().map(|b| b["echo"].clone()), record.metadata.clone()), (Some(json!(format!("v{i}"))), Some(json!({ "n": i }))));
        assert!(record.times.enqueued.is_some() && record.times.answered >= record.times.called, "{:?}", record.times);
    }
    let gone = &records["gone-1"];
    assert_eq!((gone.outcome, gone.status), (Ending::DeadLettered, Some(404)));
    // A worker that started after its job's slot returns null too, by design: it puts the
    // job back on the queue without a call, and the job's next invocation has its record.
    let missed = worker.stats().missed_slots.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(nulls as u64, 1 + missed, "the fire-and-forget job's invocation returned null, and each whose worker missed its slot ({missed})");
    // The dead letter carries the same record.
    let dead = lane.queue().page(DlqSource::Jobs, None, 10, Duration::from_secs(1)).await.unwrap();
    assert_eq!(dead.iter().map(|d| d.outcome.as_ref()).collect::<Vec<_>>(), [Some(gone)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_s_workers_send_each_job_s_outcome_record_to_the_results_queue_themselves() {
    let mut lane = lane("10/s").await;
    let results = paceline_e2e::aws::create_queue(&lane.sdk, "paceline-results").await;
    lane.env.insert("PACELINE_RESULTS_QUEUE_URL".into(), results.clone());
    let api = api(&["10/s"], None).await;
    lane.with_worker_calling(&api);
    let sqs = aws_sdk_sqs::Client::new(&lane.sdk);
    lane.lambda.deliver_results_to(sqs.clone(), results.clone());
    let mut bodies = jobs("told", 8);
    bodies.push(r#"{"id":"gone-2","request":{"method":"GET","path":"/missing/2"}}"#.into());
    lane.enqueue(bodies).await;

    // A worker that starts after a job's slot puts the job back without a call (by
    // design): the next run calls it.
    for _ in 0..3 {
        let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(60))).await.unwrap();
        lane.lambda.settle(Duration::from_secs(10)).await;
        assert_eq!(report.stop, StopReason::Drained);
        let depth = lane.queue().depth().await.unwrap();
        if depth.visible == 0 && depth.not_visible == 0 {
            break;
        }
    }
    assert!(lane.lambda.invocations().iter().any(|i| matches!(i.payload, WorkerPayload::Batch { .. })), "jobs went in batches");

    let (records, _) = read_results(&sqs, &results).await;
    let mut expected: Vec<String> = (0..8).map(|i| format!("told-{i:03}")).collect();
    expected.push("gone-2".into());
    expected.sort();
    assert_eq!(records.keys().cloned().collect::<Vec<_>>(), expected, "one record per job");
    assert_eq!((records["told-000"].outcome, records["gone-2"].outcome), (Ending::Succeeded, Ending::DeadLettered));
}

#[tokio::test]
async fn a_fifo_queue_drops_a_producer_s_repeated_send_of_a_job_but_never_a_re_queue() {
    let sdk = moto_sdk_config().await;
    let sqs = aws_sdk_sqs::Client::new(&sdk);
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let fifo = |name: String| {
        let sqs = sqs.clone();
        async move {
            let created = sqs.create_queue().queue_name(name).attributes(aws_sdk_sqs::types::QueueAttributeName::FifoQueue, "true").send().await.unwrap();
            created.queue_url().unwrap().to_owned()
        }
    };
    let queue = SqsQueue::new(sqs.clone(), fifo(format!("paceline-jobs-{suffix}.fifo")).await, fifo(format!("paceline-dlq-{suffix}.fifo")).await);
    let body = r#"{"id":"once","request":{"method":"GET","path":"/items/once"}}"#.to_owned();
    let produced = OutgoingMessage { dedup_id: Some("once".into()), ..OutgoingMessage::fresh(body.clone()) };
    queue.send(std::slice::from_ref(&produced)).await.unwrap();
    queue.send(&[produced]).await.unwrap();
    assert_eq!(queue.depth().await.unwrap().visible, 1, "the producer's second send of job `once` was dropped");
    let requeued = OutgoingMessage::fresh(body);
    queue.send(std::slice::from_ref(&requeued)).await.unwrap();
    queue.send(&[requeued]).await.unwrap();
    assert_eq!(queue.depth().await.unwrap().visible, 3, "Paceline's own re-queues are never taken for the first send");
}

#[tokio::test]
async fn sqs_on_moto_keeps_the_job_queue_and_dead_letter_contracts() {
    let lane = lane("5/s").await;
    contract::job_queue(&lane.queue(), &SystemClock).await;
    let fresh = self::lane("5/s").await;
    contract::dead_letter_queues(&fresh.queue()).await;
}

#[tokio::test]
async fn dynamodb_on_moto_keeps_the_state_store_contract() {
    let lane = lane("5/s").await;
    let quota = "5/s"
        .parse::<paceline_shared::quota::Tier>()
        .map(|t| paceline_shared::quota::Quota::new(vec![t], paceline_shared::quota::chrono_tz::UTC, Duration::ZERO))
        .unwrap()
        .unwrap();
    contract::state_store(Arc::new(lane.store()), &quota).await;
    let acme = StoreScope::Lane(paceline_shared::lane::LaneId::parse("acme").unwrap());
    let fresh = self::lane("5/s").await;
    contract::state_store(Arc::new(fresh.store().scoped(&acme)), &quota).await;
}

#[tokio::test]
async fn a_fifo_queue_gives_a_batch_s_jobs_back_in_the_order_they_were_sent() {
    let lane = lane_on("10/s", QueueKind::Fifo).await;
    let sent = jobs("batch", 10);
    lane.enqueue(sent.clone()).await;
    let received = lane.queue().receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap();
    assert_eq!(received.into_iter().map(|m| m.body).collect::<Vec<_>>(), sent, "a batch's entries go in as listed");
}

#[tokio::test]
async fn each_job_goes_in_its_lane_s_message_group_and_comes_back_with_it() {
    let lane = lane("5/s").await;
    let bodies = [
        r#"{"id":"a","lane":"acme","request":{"method":"GET","path":"/a"}}"#,
        r#"{"id":"b","request":{"method":"GET","path":"/b"}}"#,
        r#"{"id":"c","lane":"no lane","request":{"method":"GET","path":"/c"}}"#,
    ];
    lane.enqueue(bodies.iter().map(|body| (*body).to_owned()).collect()).await;
    let mut groups = BTreeMap::new();
    for _ in 0..5 {
        for message in lane.queue().receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap() {
            let id = serde_json::from_str::<serde_json::Value>(&message.body).unwrap()["id"].as_str().unwrap().to_owned();
            groups.insert(id, message.group);
        }
    }
    let group = |id: &str| groups.get(id).cloned().flatten();
    assert_eq!(
        (group("a").as_deref(), group("b").as_deref(), group("c").as_deref()),
        (Some("acme"), Some("default"), Some("default")),
        "a job naming no lane, or a bad one (dead-lettered when it is read), is the default lane's: {groups:?}"
    );
}

#[tokio::test]
async fn dynamodb_on_moto_keeps_the_shared_counters_contract() {
    let lane = lane("5/s").await;
    let stack: Arc<dyn StateStore> = Arc::new(lane.store().scoped(&StoreScope::Stack));
    contract::shared_counters(Arc::new(lane.store()), Some(stack)).await;
}

#[tokio::test]
async fn each_lane_s_items_in_dynamodb_are_its_own() {
    let lane = lane("5/s").await;
    let store = lane.store();
    contract::lanes_apart(&store, system_now()).await;
    contract::pacers_saved_together(&store, system_now()).await;
    // A lane's item keys carry the lane: 1,000 lanes are 1,000 partition keys.
    let item = aws_sdk_dynamodb::Client::new(&lane.sdk).get_item().table_name(&lane.names.table).key("pk", AttributeValue::S("lane#acme#circuit".into()));
    assert!(item.send().await.unwrap().item().is_some(), "acme's circuit is under its lane's key");
}

#[tokio::test]
async fn lambda_invoke_keeps_the_invoker_contract() {
    let lane = lane("5/s").await;
    let worker = Arc::new(RecordingWorker::default());
    lane.lambda.run_worker(worker.clone());
    let invoker = lane.adapters().invoker;
    contract::invoker(&invoker, || async {
        lane.lambda.settle(Duration::from_secs(5)).await;
        worker.ran()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_on_calls_in_flight_holds_across_workers_through_dynamodb() {
    let mut lane = lane("20/s").await;
    lane.env.insert("PACELINE_MAX_IN_FLIGHT".into(), "3".into());
    // 20/s with answers in 300 to 600 ms would keep about 9 calls in flight; the API
    // refuses any call past 3 at once.
    let spec = FakeApiSpec {
        tiers: vec!["20/s".parse().unwrap()],
        latency: (Duration::from_millis(300), Duration::from_millis(600)),
        max_concurrent: Some(3),
        ..FakeApiSpec::default()
    };
    let api = FakeApi::start(spec).await.unwrap();
    lane.with_worker_calling(&api);
    lane.enqueue(jobs("conc", 30)).await;
    let report = lane.orchestrator().run(&drain_opts("test", Duration::from_secs(60))).await.unwrap();
    lane.lambda.settle(Duration::from_secs(10)).await;
    assert_eq!(report.stop, StopReason::Drained);
    // A job turned away by a full cap is re-queued with a short delay (or put back by a
    // worker that started after its slot, on a loaded machine).
    lane.run_again_until_drained(4, Duration::from_secs(2)).await;

    let log = api.log();
    assert_eq!((log.concurrency_rejections, log.quota_rejections), (0, 0), "{log:?}");
    assert!(log.peak_in_flight <= 3, "{} calls in flight at once", log.peak_in_flight);
    let succeeded: BTreeSet<&str> = log.ok_by_path.keys().filter_map(|p| p.strip_prefix("/items/")).collect();
    assert_eq!(succeeded.len(), 30, "every job succeeded");
    assert_eq!(lane.queue().depth().await.unwrap().dead, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_delivery_of_an_event_calls_the_api_once_through_dynamodb() {
    let mut lane = lane("10/s").await;
    let spec = FakeApiSpec { tiers: vec!["10/s".parse().unwrap()], latency: (Duration::from_millis(20), Duration::from_millis(40)), ..FakeApiSpec::default() };
    let api = FakeApi::start(spec).await.unwrap();
    lane.env.insert("PACELINE_API_BASE_URL".into(), api.base_url.clone());
    let get = |k: &str| lane.env.get(k).cloned();
    let worker = paceline_worker::lambda::from_env(&Env::new(&get), &lane.sdk).unwrap();
    let job = paceline_shared::job::Job::parse(&jobs("twice", 1)[0]).unwrap();
    let event = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: system_now(), slot: None, trip: None, report_limits: false };
    // Lambda delivers the same event twice, one after the other and then at once.
    worker.handle(event.clone()).await.unwrap();
    worker.handle(event.clone()).await.unwrap();
    assert_eq!(api.log().arrivals.len(), 1, "the second delivery found the call done");
    // A delivery that arrives while another is calling: the other's claim is in place
    // (DynamoDB's conditional write is atomic; moto's is not under concurrent requests,
    // so the overlap is set up in order rather than raced).
    let WorkerPayload::Job { job, .. } = event else { unreachable!() };
    let record = call_record_key(job.id.as_str(), 1);
    let next = WorkerPayload::Job { job, attempt: 1, circuit_epoch: 0, dispatched_at: system_now(), slot: None, trip: None, report_limits: false };
    let store = lane.store();
    let now = system_now();
    assert_eq!(store.claim_call(&record, "the other delivery", now, now.plus(Duration::from_secs(30))).await.unwrap(), CallClaim::Taken);
    let meanwhile = worker.handle(next.clone()).await;
    assert!(matches!(meanwhile, Err(PortError::Transient(_))), "it fails, for Lambda to retry: {meanwhile:?}");
    assert_eq!(api.log().arrivals.len(), 1, "and does not call while the other is calling");
    store.finish_call(&record, now.plus(Duration::from_secs(60))).await.unwrap();
    assert_eq!(worker.handle(next).await.unwrap(), None, "retried after the other's call is done, it has nothing to do");
    assert_eq!(api.log().arrivals.len(), 1);
}

/// Three lanes of one stack, each with its own quota and key, under a quota they share,
/// deployed as the template deploys them (its functions' environment read from it): a
/// healthy lane, a lane whose API fails for a while, and a lane whose secret is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lanes_keep_their_own_quotas_and_keys_and_one_lane_s_failures_touch_no_other() {
    use paceline_e2e::runtime_api::template_env;
    let sdk = moto_sdk_config().await;
    let names = create_lane(&sdk, "paceline-worker").await;
    let lambda = FakeLambda::start().await;
    let secrets = aws_sdk_secretsmanager::Client::new(&sdk);
    let prefix = format!("paceline-{}/", uuid::Uuid::new_v4().simple());
    for lane in ["acme", "broken"] {
        secrets.create_secret().name(format!("{prefix}{lane}")).secret_string(format!("k-{lane}")).send().await.unwrap();
    }
    let acme_api = api(&["5/s"], None).await;
    let broken_api = api(&["5/s"], Some((Duration::ZERO, Duration::from_secs(2)))).await;
    let lanes = json!({
        "tiers": ["5/s"],
        "headers": {"Authorization": {"env": "API_TOKEN_{lane}", "prefix": "Bearer "}},
        "acme": {"base_url": acme_api.base_url},
        "broken": {"base_url": broken_api.base_url},
        "nokey": {"base_url": acme_api.base_url},
    })
    .to_string();
    let given = BTreeMap::from([
        ("AWS::StackName", "three-lanes".to_owned()),
        ("JobsQueue", names.queue_url.clone()),
        ("JobsDlq", names.dlq_url.clone()),
        ("StateTable", names.table.clone()),
        ("WorkerFunction", "paceline-worker".to_owned()),
        ("QuotaTiers", "8/s".to_owned()),
        ("ApiBaseUrl", acme_api.base_url.clone()),
        ("Lanes", lanes),
    ]);
    // Two failures among the last four calls (two buckets of about a second at 4/s)
    // open a lane's circuit: its 2 s outage always does.
    let tuned = [
        ("PACELINE_MINIMUM_CALLS", "4"),
        ("PACELINE_MINIMUM_FAILURES", "2"),
        ("PACELINE_HEALTH_CHECK_INTERVAL", "1s"),
        ("PACELINE_BACKOFF_BASE", "200ms"),
        ("PACELINE_DEADLINE_MARGIN", "1s"),
    ];
    let env_of = |function: &str| {
        let mut env = template_env(function, &given);
        env.extend(tuned.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        env
    };
    let worker_env = {
        let mut env = env_of("WorkerFunction");
        // As the template writes it with LaneSecretPrefix set (its `!If` left out here).
        env.insert("PACELINE_API_SECRETS".into(), format!(r#"{{"API_TOKEN_{{lane}}": "{prefix}{{lane}}"}}"#));
        env
    };
    let get = |k: &str| worker_env.get(k).cloned();
    let api_secrets = paceline_worker::lambda::ApiSecrets::fetch(&Env::new(&get), &sdk).await.unwrap();
    lambda.run_worker(paceline_worker::lambda::function_from_env(&Env::new(&get), &sdk, api_secrets).unwrap().handler());
    let orchestrator_env = env_of("OrchestratorFunction");
    let get = |k: &str| orchestrator_env.get(k).cloned();
    let orchestrator = orchestrator_lambda::from_env(&Env::new(&get), &sdk, Some(&lambda.url)).unwrap().into_orchestrator();

    let job = |lane: &str, i: usize| format!(r#"{{"id":"{lane}-{i:02}","lane":"{lane}","request":{{"method":"GET","path":"/items/{lane}-{i:02}"}}}}"#);
    let mut bodies: Vec<String> = (0..15).map(|i| job("acme", i)).collect();
    bodies.extend((0..10).map(|i| job("broken", i)));
    bodies.extend((0..4).map(|i| job("nokey", i)));
    let queue = AwsAdapters::new(&sdk, &names, None).queue;
    let messages: Vec<OutgoingMessage> = bodies.into_iter().map(OutgoingMessage::fresh).collect();
    queue.send(&messages).await.unwrap();

    let report = orchestrator.run(&drain_opts("three-lanes", Duration::from_secs(90))).await.unwrap();
    lambda.settle(Duration::from_secs(10)).await;
    assert_eq!(report.stop, StopReason::Drained, "{report:?}");
    // A worker that started after a job's slot (a loaded machine) put it back on the
    // queue, as it should, after the run had drained: the next run calls it.
    let left = queue.depth().await.unwrap();
    if left.visible + left.not_visible > 0 {
        orchestrator.run(&drain_opts("three-lanes-2", Duration::from_secs(30))).await.unwrap();
        lambda.settle(Duration::from_secs(10)).await;
    }

    // Each lane at its own quota, with its own key; all of them under the shared 8/s.
    let (acme, broken) = (acme_api.log(), broken_api.log());
    assert_eq!((acme.ok, acme.quota_rejections, broken.quota_rejections), (15, 0, 0), "no call over a lane's 5/s: {report:?}");
    assert_eq!(acme.by_authorization.keys().collect::<Vec<_>>(), ["Bearer k-acme"], "acme's calls carry acme's key, and no job of nokey was called");
    assert!(broken.by_authorization.keys().all(|key| key == "Bearer k-broken"), "{:?}", broken.by_authorization.keys());
    let mut both: Vec<(UnixMillis, u64)> = acme.arrivals.iter().chain(&broken.arrivals).map(|at| (*at, 1)).collect();
    both.sort();
    let t0 = both.iter().map(|(at, _)| *at).min().unwrap();
    let shown = |log: &paceline_cli::fake_api::FakeApiLog| log.arrivals.iter().map(|at| at.since(t0).as_millis()).collect::<Vec<_>>();
    assert!(
        peak_in_any_window(&both, Duration::from_secs(1)) <= 8,
        "the shared 8/s held across lanes: acme {:?}, broken {:?} (health checks {})",
        shown(&acme),
        shown(&broken),
        broken.health_checks
    );
    // The failing lane's circuit opened and closed; acme's never did, nor waited for it.
    let store = AwsAdapters::new(&sdk, &names, None).store;
    let lane = |id: &str| store.scoped(&StoreScope::Lane(id.parse().unwrap()));
    let broken_circuit = lane("broken").circuit().await.unwrap();
    assert!(broken.outage_failures >= 1 && broken_circuit.is_closed() && broken_circuit.epoch >= 2, "{broken_circuit:?}");
    assert_eq!(lane("acme").circuit().await.unwrap().epoch, 0, "acme's circuit never opened");
    let succeeded: BTreeSet<&str> = broken.ok_by_path.keys().filter_map(|path| path.strip_prefix("/items/")).collect();
    assert_eq!(succeeded.len(), 10, "every job of the failing lane succeeded after its outage");
    let acme_took = acme.arrivals.last().unwrap().since(acme.arrivals[0]);
    assert!(acme_took < Duration::from_secs(6), "15 jobs at 5/s took {acme_took:?}: held up by another lane");
    // The lane without its secret: every job dead-lettered as `credentials`, none lost.
    let sqs = aws_sdk_sqs::Client::new(&sdk);
    let mut dead = Vec::new();
    for _ in 0..5 {
        let out = sqs.receive_message().queue_url(&names.dlq_url).max_number_of_messages(10).message_attribute_names("All").send().await.unwrap();
        for m in out.messages() {
            let cause = m.message_attributes().and_then(|a| a.get("cause")).and_then(|v| v.string_value()).unwrap_or_default().to_owned();
            let id = serde_json::from_str::<serde_json::Value>(m.body().unwrap()).unwrap()["id"].as_str().unwrap().to_owned();
            dead.push((id, cause));
        }
    }
    dead.sort();
    let expected: Vec<(String, String)> = (0..4).map(|i| (format!("nokey-{i:02}"), "credentials".to_owned())).collect();
    assert_eq!(dead, expected);
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible), (0, 0));
}

/// A stack of lanes deployed as two shards (the template's environment, `Shards=2`) on
/// moto: its resources, the fake Lambda running its worker, the strict API of the
/// shared `6/s` (each lane `5/s`), and the orchestrator function running both shards.
struct TwoShards {
    sdk: aws_config::SdkConfig,
    names: AwsNames,
    queues: [String; 2],
    lambda: FakeLambda,
    api: FakeApi,
    function: orchestrator_lambda::OrchestratorFunction,
    /// The worker function the fake Lambda runs.
    worker: Arc<dyn WorkerHandler>,
}

async fn two_shards() -> TwoShards {
    two_shards_under("6/s").await
}

/// [`two_shards`] under the shared `quota_tiers` (the template's `QuotaTiers`), the API
/// holding its calls to their rolling tiers.
async fn two_shards_under(quota_tiers: &str) -> TwoShards {
    use paceline_e2e::runtime_api::template_env;
    let sdk = moto_sdk_config().await;
    let names = create_lane(&sdk, "paceline-worker").await;
    let queues = [names.queue_url.clone(), create_queue(&sdk, "paceline-jobs").await];
    let lambda = FakeLambda::start().await;
    let rolling: Vec<&str> = quota_tiers.split(',').filter(|tier| !tier.ends_with("/day") && !tier.ends_with("/month")).collect();
    let api = api(&rolling, None).await;
    let given = BTreeMap::from([
        ("AWS::StackName", "two-shards".to_owned()),
        ("JobsQueue", names.queue_url.clone()),
        ("JobsDlq", names.dlq_url.clone()),
        ("StateTable", names.table.clone()),
        ("WorkerFunction", "paceline-worker".to_owned()),
        ("QuotaTiers", quota_tiers.to_owned()),
        ("ApiBaseUrl", api.base_url.clone()),
        ("Lanes", json!({ "tiers": ["5/s"] }).to_string()),
    ]);
    let mut worker_env = template_env("WorkerFunction", &given);
    worker_env.insert("PACELINE_SHARD_QUEUES".into(), json!(queues).to_string());
    let get = |k: &str| worker_env.get(k).cloned();
    let secrets = paceline_worker::lambda::ApiSecrets::fetch(&Env::new(&get), &sdk).await.unwrap();
    let worker = paceline_worker::lambda::function_from_env(&Env::new(&get), &sdk, secrets).unwrap().handler();
    lambda.run_worker(worker.clone());
    let mut env = template_env("OrchestratorFunction", &given);
    env.insert("PACELINE_SHARD_QUEUES".into(), json!(queues).to_string());
    env.insert("PACELINE_DEADLINE_MARGIN".into(), "1s".into());
    // The 25 ms margin of the other lanes here (see `lane_on`): once in CI, one 429 in
    // the two shards' test.
    env.insert("PACELINE_SAFETY_MARGIN".into(), "25ms".into());
    env.insert("AWS_LAMBDA_FUNCTION_NAME".into(), "paceline-orchestrator".into());
    let get = |k: &str| env.get(k).cloned();
    let function = orchestrator_lambda::from_env(&Env::new(&get), &sdk, Some(&lambda.url)).unwrap();
    TwoShards { sdk, names, queues, lambda, api, function, worker }
}

/// A job the worker puts back (here: it started past its slot) goes to its lane's
/// shard's queue, where that shard's run takes it up, not to shard 0's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_the_worker_puts_back_goes_to_its_lane_s_shard_s_queue() {
    use paceline_shared::job::{CallSlot, Job};
    use paceline_shared::lane::LaneId;
    let TwoShards { sdk, names, queues, worker, .. } = two_shards().await;
    let lane = (0..).map(|n| LaneId::parse(&format!("tenant-{n}")).unwrap()).find(|lane| lane.shard(2) == 1).unwrap();
    let job = Job::parse(&format!(r#"{{"id":"late-1","lane":"{lane}","request":{{"method":"GET","path":"/items/late-1"}}}}"#)).unwrap();
    let past = system_now().minus(Duration::from_secs(5));
    let slot = CallSlot { not_before: past, call_by: past.plus(Duration::from_millis(100)) };
    let late = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: past, slot: Some(slot), trip: None, report_limits: false };
    worker.handle(late).await.unwrap();

    let sqs = AwsAdapters::new(&sdk, &names, None).queue;
    let depth = |index: usize| {
        let queue = sqs.at(&queues[index]);
        async move {
            let depth = queue.depth().await.unwrap();
            depth.visible + depth.not_visible
        }
    };
    assert_eq!((depth(0).await, depth(1).await), (0, 1), "put back on shard 1's queue");
}

/// Two shards under a shared `6/s,20/day`: a lane of shard 0 with 28 jobs, one of shard
/// 1 with 4. The shards reserve the day's units from one counter in the table, so shard
/// 0 spends the 16 that shard 1 does not need (10 with the day divided evenly, as
/// before), 20 calls between them and no more: what shard 1 reserved and did not spend
/// goes back when its run ends (at 5 s), and shard 0, short since, asks again 5 s after.
/// The other 12 jobs wait on shard 0's queue for the next day, none lost, and the
/// counter ends at the 20 calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_spend_a_shared_day_tier_from_one_counter_and_never_pass_it_together() {
    use paceline_shared::lane::LaneId;
    let _alone = MOTO_BUSY_OR_TIMED.lock().await;
    let TwoShards { sdk, names, queues, lambda, api, function, .. } = two_shards_under("6/s,20/day").await;
    let (first, second) = (function.shard(0).unwrap(), function.shard(1).unwrap());
    let on = |shard: usize| (0..).map(|n| LaneId::parse(&format!("tenant-{n}")).unwrap()).find(|lane| lane.shard(2) == shard).unwrap();
    let sqs_queue = AwsAdapters::new(&sdk, &names, None).queue;
    for (shard, jobs) in [(0, 28), (1, 4)] {
        let lane = on(shard);
        let messages: Vec<OutgoingMessage> = (0..jobs)
            .map(|i| OutgoingMessage::fresh(format!(r#"{{"id":"{lane}-{i}","lane":"{lane}","request":{{"method":"GET","path":"/items/{lane}-{i}"}}}}"#)))
            .collect();
        for batch in messages.chunks(10) {
            sqs_queue.at(&queues[shard]).send(batch).await.unwrap();
        }
    }
    let runs =
        |holder: &str, seconds: u64| RunOptions { holder: holder.into(), deadline: system_now().plus(Duration::from_secs(seconds)), drain: false, stop: None };
    let (opts_first, opts_second) = (runs("shard-0", 16), runs("shard-1", 6));
    let (ran_first, ran_second) = tokio::join!(first.run(&opts_first), second.run(&opts_second));
    let (ran_first, ran_second) = (ran_first.unwrap(), ran_second.unwrap());
    lambda.settle(Duration::from_secs(10)).await;

    // Shard 1 holds a sixth of the 6/s at first: on a busy machine its run may end before
    // its fourth job (which shard 0 then spends), or hand one off twice (its worker started
    // after its slot and put it back): the 20 units fall either way, shard 0's past 10.
    let dispatched = (ran_first.dispatched, ran_second.dispatched);
    assert!(dispatched.0 + dispatched.1 == 20 && dispatched.0 > 10, "the whole shared day, no more, shard 0 past its even half: {dispatched:?}");
    let log = api.log();
    // A worker that starts after its slot (a busy machine) puts its job back uncalled;
    // its unit stays spent.
    assert!(log.ok <= 20 && log.quota_rejections == 0, "{} calls, {} refused", log.ok, log.quota_rejections);
    assert!(log.ok_by_path.values().all(|calls| *calls == 1), "each job once: {:?}", log.ok_by_path);
    let day = "20/day".parse::<paceline_shared::quota::Tier>().unwrap().usage_key(paceline_shared::quota::chrono_tz::UTC, system_now());
    let stack = AwsAdapters::new(&sdk, &names, None).store.scoped(&StoreScope::Stack);
    assert_eq!(stack.load_usage(&[day]).await.unwrap(), vec![20], "the stack's counter holds the hand-offs: what was reserved and not spent went back");
    let mut left = 0;
    for queue in &queues {
        let depth = sqs_queue.at(queue).depth().await.unwrap();
        assert_eq!(depth.dead, 0, "none dead-lettered");
        left += depth.visible + depth.not_visible;
    }
    assert_eq!(log.ok + left, 32, "the rest wait on the queues for the next day, none lost");
}

/// `paceline lanes move` while both shards run: the lane's shard sends its jobs on to
/// the new shard's queue and hands its pace over; the new shard takes the lane up once
/// the old one can no longer call for it. Each job is called once, and no second holds
/// more of the lane's calls than its 5/s, across the move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_moved_to_another_shard_mid_run_is_called_once_a_job_and_never_over_its_tier() {
    use paceline_shared::homes::LaneHomes;
    use paceline_shared::lane::LaneId;
    let _alone = MOTO_BUSY_OR_TIMED.lock().await;
    let TwoShards { sdk, names, queues, lambda, api, function, .. } = two_shards().await;
    let (first, second) = (function.shard(0).unwrap(), function.shard(1).unwrap());
    let lane = (0..).map(|n| LaneId::parse(&format!("tenant-{n}")).unwrap()).find(|lane| lane.shard(2) == 0).unwrap();
    let adapters = AwsAdapters::new(&sdk, &names, None);
    let jobs: Vec<OutgoingMessage> = (0..30)
        .map(|i| OutgoingMessage::fresh(format!(r#"{{"id":"{lane}-{i}","lane":"{lane}","request":{{"method":"GET","path":"/items/{lane}-{i}"}}}}"#)))
        .collect();
    for batch in jobs.chunks(10) {
        adapters.queue.at(&queues[0]).send(batch).await.unwrap();
    }
    let runs = |holder: &str| RunOptions { holder: holder.into(), deadline: system_now().plus(Duration::from_secs(18)), drain: false, stop: None };
    let (opts_first, opts_second) = (runs("shard-0"), runs("shard-1"));
    let move_it = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let moved = LaneHomes::default().with_move(&lane, 1, 2, system_now()).unwrap();
        assert!(write_document(&adapters.store, StackDocument::LaneHomes, &moved, None).await.unwrap());
    };
    let (ran_first, ran_second, ()) = tokio::join!(first.run(&opts_first), second.run(&opts_second), move_it);
    let (ran_first, ran_second) = (ran_first.unwrap(), ran_second.unwrap());
    lambda.settle(Duration::from_secs(10)).await;
    // A worker that started after its slot (a loaded machine) put its job back on the
    // lane's shard's queue uncalled: the next runs take it.
    for again in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut left = 0;
        for queue in &queues {
            let depth = adapters.queue.at(queue).depth().await.unwrap();
            left += depth.visible + depth.not_visible;
        }
        if left == 0 {
            break;
        }
        let (next_first, next_second) =
            (drain_opts(&format!("shard-0-again-{again}"), Duration::from_secs(20)), drain_opts(&format!("shard-1-again-{again}"), Duration::from_secs(20)));
        let (a, b) = tokio::join!(first.run(&next_first), second.run(&next_second));
        a.unwrap();
        b.unwrap();
        lambda.settle(Duration::from_secs(10)).await;
    }

    let log = api.log();
    assert_eq!((log.ok, log.quota_rejections), (30, 0), "every job called: {ran_first:?} {ran_second:?}");
    assert!(log.ok_by_path.values().all(|calls| *calls == 1), "each job once: {:?}", log.ok_by_path);
    let arrivals: Vec<(UnixMillis, u64)> = log.arrivals.iter().map(|at| (*at, 1)).collect();
    assert!(peak_in_any_window(&arrivals, Duration::from_secs(1)) <= 5, "the lane's 5/s held across the move: {:?}", log.arrivals);
    let paced = |ran: &RunReport| ran.lanes.iter().find(|report| report.lane == lane.as_str()).map_or(0, |report| report.dispatched);
    assert!(paced(&ran_first) > 0 && paced(&ran_second) > 0, "both shards called for the lane: {} then {}", paced(&ran_first), paced(&ran_second));
    assert!(ran_first.forwarded > 0, "the jobs shard 0 held went on to shard 1's queue: {ran_first:?}");
}

/// A deploy that changes `Shards` while a run of the old layout goes on: no run of the
/// new layout starts (each would pace another share of the shared quota, and a lane may
/// live on another shard there) until every lease of either layout is free; then the
/// stack records the new layout and its runs go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_a_new_shard_layout_waits_until_the_old_layout_s_runs_have_ended() {
    let TwoShards { sdk, names, function, .. } = two_shards().await;
    let store = AwsAdapters::new(&sdk, &names, None).store;
    // The stack ran as one shard; its run still holds the lease.
    let old_run = store.acquire_lease("lambda:one-shard-run", Duration::from_secs(30), system_now()).await.unwrap();
    let kick = || LambdaEvent::new(serde_json::from_value(json!({ "kick_shard": 1 })).unwrap(), Context::default());
    let waited = orchestrator_lambda::handle(kick(), &function).await.unwrap();
    let why = waited["skipped"].as_str().unwrap_or_default();
    assert!(why.contains("from 1 to 2") && why.contains("[0]"), "{waited}");
    assert_eq!(store.shard_layout().await.unwrap(), 1);
    store.release_lease(&old_run).await.unwrap();
    let ran = orchestrator_lambda::handle(kick(), &function).await.unwrap();
    assert!(ran.get("skipped").is_none() && ran.get("stop").is_some(), "shard 1 ran: {ran}");
    assert_eq!(store.shard_layout().await.unwrap(), 2, "the stack runs as two shards from now");
}

/// Two shards of one stack, on one table and one worker, run by one orchestrator
/// function: each shard's run paces the lanes that live on it (by the hash of their
/// ids), received from its own queue under its own lease, at its share of the shared
/// quota, kept in the share book in the table; a job sent to the other shard's queue is
/// sent on to its lane's and called once. The schedule's kick starts shard 0's run and
/// kicks shard 1's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_pace_their_own_lanes_under_their_shares_of_the_shared_quota_and_send_on_a_misrouted_job() {
    use paceline_shared::lane::LaneId;
    let _alone = MOTO_BUSY_OR_TIMED.lock().await;
    let TwoShards { sdk, names, queues, lambda, api, function, .. } = two_shards().await;
    let (first, second) = (function.shard(0).unwrap(), function.shard(1).unwrap());
    assert!(function.shard(2).is_none());

    // Eight lanes, four jobs each, each on its lane's shard's queue; two jobs of a lane
    // of shard 1 sent to shard 0's by mistake.
    let lanes: Vec<LaneId> = (0..8).map(|n| LaneId::parse(&format!("tenant-{n}")).unwrap()).collect();
    let misrouted = lanes.iter().find(|lane| lane.shard(2) == 1).expect("a lane on shard 1").clone();
    assert!(lanes.iter().any(|lane| lane.shard(2) == 0), "a lane on shard 0");
    let sqs_queue = AwsAdapters::new(&sdk, &names, None).queue;
    for lane in &lanes {
        for i in 0..4 {
            let body = format!(r#"{{"id":"{lane}-{i}","lane":"{lane}","request":{{"method":"GET","path":"/items/{lane}-{i}"}}}}"#);
            let shard = if *lane == misrouted && i < 2 { 0 } else { lane.shard(2) };
            sqs_queue.at(&queues[shard]).send(&[OutgoingMessage::fresh(body)]).await.unwrap();
        }
    }
    let (opts_first, opts_second) = (drain_opts("shard-0", Duration::from_secs(60)), drain_opts("shard-1", Duration::from_secs(60)));
    let (ran_first, ran_second) = tokio::join!(first.run(&opts_first), second.run(&opts_second));
    let (ran_first, ran_second) = (ran_first.unwrap(), ran_second.unwrap());
    assert_eq!((ran_first.forwarded, ran_second.forwarded), (2, 0), "{ran_first:?}");
    // Shard 1 may have drained its queue before the two came: its next run calls them.
    let left = sqs_queue.at(&queues[1]).depth().await.unwrap();
    if left.visible + left.not_visible > 0 {
        second.run(&drain_opts("shard-1-again", Duration::from_secs(30))).await.unwrap();
    }
    lambda.settle(Duration::from_secs(10)).await;

    let log = api.log();
    assert_eq!((log.ok, log.quota_rejections), (32, 0), "every job called, none over the shared 6/s: {ran_first:?} {ran_second:?}");
    assert!(log.ok_by_path.values().all(|calls| *calls == 1), "each job once: {:?}", log.ok_by_path);
    let arrivals: Vec<(UnixMillis, u64)> = log.arrivals.iter().map(|at| (*at, 1)).collect();
    assert!(peak_in_any_window(&arrivals, Duration::from_secs(1)) <= 6, "the two shards' shares add up to the shared 6/s");
    // The shards reported to one share book in the table, whose 6 parts (a unit of the
    // 6/s each) are all held or free.
    let store = AwsAdapters::new(&sdk, &names, None).store;
    let (book, version): (ShareBook, u64) = read_document(&store, StackDocument::ShareBook).await.unwrap().expect("the share book");
    assert!(version >= 2, "both shards wrote it: version {version}");
    let parts: u64 = book.held.iter().map(|h| h.parts).chain(book.free.iter().map(|f| f.parts)).sum();
    assert_eq!((book.parts, book.held.len(), parts), (6, 2, 6), "{book:?}");
    // Each shard dispatched for its own lanes only (a job is dispatched again when its
    // worker started past its slot and put it back, by design: counts are not compared).
    for (index, ran) in [(0, &ran_first), (1, &ran_second)] {
        let paced: Vec<&str> = ran.lanes.iter().filter(|lane| lane.dispatched > 0).map(|lane| lane.lane.as_str()).collect();
        assert!(paced.iter().all(|lane| lane.parse::<LaneId>().unwrap().shard(2) == index), "shard {index} paced {paced:?}");
    }
    // Each shard ran under its own lease: the two runs overlapped.
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    for key in ["lease", "shard#1#lease"] {
        let item = dynamodb.get_item().table_name(&names.table).key("pk", AttributeValue::S(key.into())).send().await.unwrap();
        assert!(item.item().is_some(), "{key}");
    }
    // The schedule's kick runs shard 0 and starts shard 1's run; a shard's own kick does not.
    let kick = |event: serde_json::Value| LambdaEvent::new(serde_json::from_value(event).unwrap(), Context::default());
    orchestrator_lambda::handle(kick(json!({})), &function).await.unwrap();
    orchestrator_lambda::handle(kick(json!({ "kick_shard": 1 })), &function).await.unwrap();
    let skipped = orchestrator_lambda::handle(kick(json!({ "kick_shard": 2 })), &function).await.unwrap();
    assert_eq!(skipped["skipped"], json!("this stack has 2 shard(s), not shard 2"));
    let kicks: Vec<serde_json::Value> = lambda.kicks().into_iter().map(|(_, event)| event).filter(|event| event.get("kick_shard").is_some()).collect();
    assert_eq!(kicks, vec![json!({ "kick_shard": 1 })]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_lane_on_a_fifo_queue_calls_its_jobs_in_enqueue_order_and_each_retry_before_any_later_job() {
    let _alone = MOTO_BUSY_OR_TIMED.lock().await;
    let mut lane = lane_on("1000/s", QueueKind::Fifo).await;
    let settings = [
        ("PACELINE_ORDERING", "fifo"),
        ("PACELINE_BACKOFF_BASE", "20ms"),
        ("PACELINE_BACKOFF_MAX", "50ms"),
        // Scattered failures never open the circuit.
        ("PACELINE_MINIMUM_CALLS", "1000"),
        // Workers behind the fake Lambda start within a few store calls: no need to hand
        // off 500 ms early.
        ("PACELINE_DISPATCH_AHEAD", "50ms"),
    ];
    lane.env.extend(settings.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())));
    // 2% of calls fail (a 500): their jobs are retried, each before the job after it.
    let api = FakeApi::start(two_percent_failing_api()).await.unwrap();
    lane.with_worker_calling(&api);
    // 200, not the 10,000 of the embedded test: moto's FIFO receive reads the whole
    // queue each time, and this test shares moto with the others running beside it.
    let count = 200;
    lane.enqueue(jobs("fifo", count)).await;
    for _ in 0..5 {
        lane.orchestrator().run(&drain_opts("ordered", Duration::from_secs(240))).await.unwrap();
        lane.lambda.settle(Duration::from_secs(10)).await;
        let depth = lane.queue().depth().await.unwrap();
        if depth.visible == 0 && depth.not_visible == 0 {
            break;
        }
    }

    let log = api.log();
    let position = |path: &str| path.strip_prefix("/items/fifo-").and_then(|n| n.parse::<usize>().ok());
    let called: Vec<usize> = log.calls.iter().filter_map(|(path, _)| position(path)).collect();
    let succeeded: Vec<usize> = log.calls.iter().filter(|(_, ok)| *ok).filter_map(|(path, _)| position(path)).collect();
    assert!(log.server_errors >= 3, "about 2% of the calls failed: {}", log.server_errors);
    assert_eq!(called.windows(2).filter(|pair| pair[1] < pair[0]).count(), 0, "a call went before one enqueued earlier (its retries included)");
    assert_eq!(succeeded, (0..count).collect::<Vec<_>>(), "each job succeeded once, in enqueue order");
    assert_eq!(log.peak_in_flight, 1, "one call of the lane at a time");
    assert_eq!((log.quota_rejections, lane.queue().depth().await.unwrap().dead), (0, 0));
}
