//! The functions' real binaries as Lambda runs them: each `bootstrap` (built for the host
//! from the same crates) starts under a local Runtime API with the environment
//! `infra/template.yaml` gives it, SQS and DynamoDB on the moto server and a fake Lambda
//! Invoke endpoint. The orchestrator serves a scheduled event and hands jobs off; the
//! worker calls the API for a job and answers with its outcome record; a missing or bad
//! variable fails init with its name; a handler error is reported as Lambda expects.

use std::collections::BTreeMap;
use std::time::Duration;

use paceline_cli::fake_api::{FakeApi, FakeApiSpec};
use paceline_e2e::aws::{create_lane, moto_env, moto_sdk_config, FakeLambda};
use paceline_e2e::runtime_api::{function_binary, lambda_env, start_function, template_env, FunctionProcess, Reported, RuntimeApi};
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames};
use paceline_shared::job::{Job, WorkerPayload};
use paceline_shared::ports::{JobQueue, OutgoingMessage};
use paceline_shared::time::system_now;

const LANE: &str = "bootstrap-test";

/// What the template's references resolve to for a lane `names` calling `api`.
fn deployed(names: &AwsNames, api: &str, tiers: &str) -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("AWS::StackName", LANE.to_owned()),
        ("JobsQueue", names.queue_url.clone()),
        ("JobsDlq", names.dlq_url.clone()),
        ("StateTable", names.table.clone()),
        ("WorkerFunction", names.worker_function.clone()),
        ("QuotaTiers", tiers.to_owned()),
        ("ApiBaseUrl", api.to_owned()),
    ])
}

/// The whole environment of `function` (its logical id in the template): Lambda's own
/// variables, the template's, and moto's endpoint and credentials, with Lambda's API at
/// `lambda_url`.
fn function_env(function: &str, given: &BTreeMap<&str, String>, lambda_url: &str) -> BTreeMap<String, String> {
    let mut env = lambda_env(function, 128);
    env.extend(moto_env());
    env.insert("AWS_ENDPOINT_URL_LAMBDA".into(), lambda_url.to_owned());
    env.extend(template_env(function, given));
    env
}

/// The lines a function wrote that are JSON, once it is stopped.
async fn json_lines(function: FunctionProcess) -> Vec<serde_json::Value> {
    function.stop().await.lines().filter_map(|line| serde_json::from_str(line).ok()).collect()
}

async fn enqueue(names: &AwsNames, ids: &[&str]) {
    let adapters = AwsAdapters::new(&moto_sdk_config().await, names, None);
    let messages: Vec<OutgoingMessage> =
        ids.iter().map(|id| OutgoingMessage::fresh(format!(r#"{{"id":"{id}","request":{{"method":"GET","path":"/items/{id}"}}}}"#))).collect();
    adapters.queue.send(&messages).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orchestrator_binary_serves_a_scheduled_event_and_hands_each_job_to_the_worker_function() {
    let sdk = moto_sdk_config().await;
    let lambda = FakeLambda::start().await;
    let names = create_lane(&sdk, "paceline-worker").await;
    enqueue(&names, &["boot-1", "boot-2", "boot-3"]).await;
    let runtime = RuntimeApi::start().await;
    let env = function_env("OrchestratorFunction", &deployed(&names, "https://api.example.com", "5/s"), &lambda.url);
    assert_eq!(env["PACELINE_TIERS"], "5/s");
    assert_eq!(env["PACELINE_VISIBILITY_TIMEOUT"], "70s", "the template's default run length, as the template sets it");
    let orchestrator = start_function(&function_binary("orchestrator"), &runtime, &env);

    let scheduled = serde_json::json!({
        "version": "0", "id": uuid_like(), "detail-type": "Scheduled Event", "source": "aws.events", "account": "123456789012",
        "time": system_now().to_rfc3339(), "region": "us-east-1", "resources": ["arn:aws:events:us-east-1:123456789012:rule/paceline"], "detail": {}
    });
    // A deadline 8 s away: the run stops the template's 5 s margin before it.
    let request = runtime.invoke(&scheduled, Duration::from_secs(8));
    let reported = runtime.reported(&request, Duration::from_secs(30)).await.expect("the function answered the invocation");
    let Reported::Response(report) = reported else { panic!("the run failed: {reported:?}") };
    assert_eq!((report["dispatched"].as_u64(), report["stop"].as_str()), (Some(3), Some("deadline")), "{report}");
    let invocations = lambda.invocations();
    let mut handed_off: Vec<String> = invocations
        .iter()
        .flat_map(|i| i.payload.batch_calls())
        .filter_map(|call| match call {
            Ok(WorkerPayload::Job { job, .. }) => Some(job.id.to_string()),
            _ => None,
        })
        .collect();
    handed_off.sort();
    assert_eq!(handed_off, ["boot-1", "boot-2", "boot-3"], "each job handed off once, in batches: {invocations:?}");
    assert!(invocations.iter().all(|i| i.function == "paceline-worker" && i.invocation_type == "Event"), "{invocations:?}");

    // The run started its relay (the run shorter than the relay's lead: at once), an
    // asynchronous invoke of its own function; served, the relay finds the lease
    // released and runs.
    let relays: Vec<serde_json::Value> =
        lambda.kicks().into_iter().filter(|(function, _)| function == "OrchestratorFunction").map(|(_, event)| event).collect();
    assert_eq!(relays.len(), 1, "{relays:?}");
    assert_eq!(relays[0]["relay"]["after"].as_str(), Some(format!("lambda:{request}").as_str()), "{relays:?}");
    let relayed = runtime.invoke(&relays[0], Duration::from_secs(7));
    let Some(Reported::Response(relay_report)) = runtime.reported(&relayed, Duration::from_secs(30)).await else { panic!("the relay failed") };
    assert_eq!((relay_report["dispatched"].as_u64(), relay_report["stop"].as_str()), (Some(0), Some("deadline")), "{relay_report}");

    let lines = json_lines(orchestrator).await;
    let run = lines.iter().find(|l| l.get("_aws").is_some() && l.get("Dispatched").is_some()).expect("the run's EMF record on standard output");
    assert_eq!((run["Dispatched"].as_u64(), run["Lane"].as_str()), (Some(3), Some(LANE)), "{run}");
    let tier = lines.iter().find(|l| l.get("TierBusiestWindow").is_some()).expect("a tier's EMF record");
    assert_eq!(tier["Tier"], "5/s", "{tier}");
    let logs: Vec<_> = lines.iter().filter(|l| l.get("level").is_some()).collect();
    assert!(!logs.is_empty() && logs.iter().all(|l| l.to_string().contains(LANE)), "JSON logs, each with the lane: {logs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_binary_calls_the_api_for_a_job_answers_with_its_outcome_and_reports_a_bad_event_as_an_error() {
    let sdk = moto_sdk_config().await;
    let lambda = FakeLambda::start().await;
    let names = create_lane(&sdk, "paceline-worker").await;
    let api = FakeApi::start(FakeApiSpec { tiers: vec!["5/s".parse().unwrap()], ..FakeApiSpec::default() }).await.unwrap();
    let runtime = RuntimeApi::start().await;
    let env = function_env("WorkerFunction", &deployed(&names, &api.base_url, "5/s"), &lambda.url);
    let worker = start_function(&function_binary("worker"), &runtime, &env);

    let job = Job::parse(r#"{"id":"boot-w","request":{"method":"GET","path":"/items/boot-w","query":{"echo":"hello"}}}"#).unwrap();
    let payload = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: system_now(), slot: None, trip: None, report_limits: false };
    let payload: serde_json::Value = serde_json::from_str(&payload.to_json()).unwrap();
    let request = runtime.invoke(&payload, Duration::from_secs(60));
    let reported = runtime.reported(&request, Duration::from_secs(30)).await.expect("the function answered");
    let Reported::Response(record) = reported else { panic!("the job failed: {reported:?}") };
    assert_eq!((record["job_id"].as_str(), record["outcome"].as_str(), record["status"].as_u64()), (Some("boot-w"), Some("succeeded"), Some(200)), "{record}");
    assert_eq!(record["body"]["echo"], "hello", "the API's answer is kept: {record}");
    assert_eq!(api.log().ok, 1);

    // Not a payload: the handler's error, reported on the invocation's error path.
    let bad = runtime.invoke(&serde_json::json!({ "hello": "world" }), Duration::from_secs(60));
    let Some(Reported::Error(error)) = runtime.reported(&bad, Duration::from_secs(30)).await else { panic!("a bad event is an invocation error") };
    assert!(error["errorType"].is_string() && error["errorMessage"].as_str().is_some_and(|m| !m.is_empty()), "{error}");

    let lines = json_lines(worker).await;
    let metrics = lines.iter().find(|l| l.get("_aws").is_some() && l["Succeeded"] == 1).expect("the invocation's EMF record");
    assert_eq!(metrics["Lane"], LANE, "{metrics}");
    assert!(metrics["CallLatency"].is_u64(), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_binary_calls_a_batch_s_jobs_at_their_slots_and_sends_each_outcome_record_to_the_results_queue() {
    let sdk = moto_sdk_config().await;
    let lambda = FakeLambda::start().await;
    let names = create_lane(&sdk, "paceline-worker").await;
    let results = paceline_e2e::aws::create_queue(&sdk, "paceline-batch-results").await;
    let api = FakeApi::start(FakeApiSpec { tiers: vec!["5/s".parse().unwrap()], ..FakeApiSpec::default() }).await.unwrap();
    let runtime = RuntimeApi::start().await;
    let mut env = function_env("WorkerFunction", &deployed(&names, &api.base_url, "5/s"), &lambda.url);
    env.insert("PACELINE_RESULTS_QUEUE_URL".into(), results.clone());
    let worker = start_function(&function_binary("worker"), &runtime, &env);

    // The first slot leaves the process time to start on a loaded machine (a fresh
    // clone's first run: its binary and libraries not yet in the page cache).
    let first = system_now().plus(Duration::from_secs(2));
    let calls: Vec<WorkerPayload> = (0..3_u64)
        .map(|i| {
            let job = Job::parse(&format!(r#"{{"id":"batch-{i}","request":{{"method":"GET","path":"/items/batch-{i}"}}}}"#)).unwrap();
            let not_before = first.plus(Duration::from_millis(250 * i));
            // A window as wide as a loaded machine needs, still narrower than the 250 ms
            // between slots: a worker late by more than it skips the call, as it should.
            let slot = Some(paceline_shared::job::CallSlot { not_before, call_by: not_before.plus(Duration::from_millis(100)) });
            WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: system_now(), slot, trip: None, report_limits: false }
        })
        .collect();
    let payload: serde_json::Value = serde_json::from_str(&WorkerPayload::batch("boot#1".into(), &calls).to_json()).unwrap();
    let request = runtime.invoke(&payload, Duration::from_secs(60));
    let reported = runtime.reported(&request, Duration::from_secs(30)).await.expect("the function answered");
    assert_eq!(reported, Reported::Response(serde_json::Value::Null), "a batch's records are not its result");
    let log = api.log();
    assert_eq!(log.ok, 3);
    // Never before its slot; within its window (and the request's way to the API).
    let offsets: Vec<i64> = log.arrivals.iter().zip(0..).map(|(at, i)| at.0 as i64 - first.plus(Duration::from_millis(250 * i)).0 as i64).collect();
    assert!(offsets.iter().all(|offset| (0..=150).contains(offset)), "each call at its own slot, 250 ms apart: {offsets:?} ms after them");

    let sqs = aws_sdk_sqs::Client::new(&sdk);
    let mut ids = Vec::new();
    for _ in 0..5 {
        let out = sqs.receive_message().queue_url(&results).max_number_of_messages(10).send().await.unwrap();
        for message in out.messages() {
            let record = paceline_shared::outcome::from_destination(message.body().unwrap()).unwrap().expect("an outcome record");
            ids.push(record.job_id.clone());
        }
        if ids.len() == 3 {
            break;
        }
    }
    ids.sort();
    assert_eq!(ids, ["batch-0", "batch-1", "batch-2"], "one record per job, read as the OnSuccess destination's are");
    drop(worker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_bad_variable_fails_init_with_its_name_through_the_runtime_api() {
    let names = AwsNames {
        queue_url: "http://127.0.0.1:1/q".into(),
        dlq_url: "http://127.0.0.1:1/d".into(),
        table: "t".into(),
        worker_function: "w".into(),
        worker_dlq_url: None,
    };
    let cases = [
        ("orchestrator", "OrchestratorFunction", "PACELINE_TIERS", Some("ten a second")),
        ("orchestrator", "OrchestratorFunction", "PACELINE_TABLE", None),
        ("worker", "WorkerFunction", "PACELINE_API_BASE_URL", Some("ftp://api.example.com")),
        ("worker", "WorkerFunction", "PACELINE_QUEUE_URL", None),
    ];
    for (binary, function, variable, value) in cases {
        let runtime = RuntimeApi::start().await;
        let mut env = function_env(function, &deployed(&names, "https://api.example.com", "5/s"), "http://127.0.0.1:1");
        match value {
            Some(value) => env.insert(variable.into(), value.into()),
            None => env.remove(variable),
        };
        let mut function = start_function(&function_binary(binary), &runtime, &env);
        let error = runtime.init_error(Duration::from_secs(20)).await.unwrap_or_else(|| panic!("{binary} without a good {variable}: no init error"));
        let message = error["errorMessage"].as_str().unwrap_or_default();
        assert!(message.starts_with("cold start: ") && message.contains(variable), "{binary}, {variable}: {error}");
        let status = tokio::time::timeout(Duration::from_secs(10), function.child.wait()).await.expect("the process exits").unwrap();
        assert!(!status.success(), "{binary} exits with an error");
        assert!(runtime.first_next().is_none(), "{binary} never asked for an event");
    }
}

fn uuid_like() -> String {
    format!("{:032x}", system_now().0)
}
