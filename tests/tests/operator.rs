//! The operator commands (`enqueue`, `status`, `dlq`, `circuit`, `kick`) of the real
//! `paceline` binary, against an AWS lane on the moto server and on the embedded store.
#![expect(clippy::disallowed_methods, reason = "end-to-end: waits on this machine's clock for servers, processes and moto")]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use paceline_cli::fake_api::{FakeApi, FakeApiSpec};
use paceline_e2e::aws::{create_lane, create_queue, lambda_failure_record, lane_env, moto_env, moto_sdk_config, FakeLambda};
use paceline_e2e::{assert_times_are_rfc3339, job_lines, json_of, lane_dir, paceline, paceline_bin, paceline_with_env, write_config, LaneDir};
use paceline_orchestrator::{lambda as orchestrator_lambda, RunOptions, StopReason};
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames, SqsQueue};
use paceline_shared::check::peak_in_any_window;
use paceline_shared::job::{DeadLetterCause, DeadLetterReason, Job, WorkerPayload};
use paceline_shared::lambda_env::Env;
use paceline_shared::ports::{JobQueue, WorkerHandler};
use paceline_shared::time::{system_now, UnixMillis};

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:04}")).collect()
}

fn job(id: &str) -> Job {
    let path = if id.starts_with("gone") { format!("/missing/{id}") } else { format!("/items/{id}") };
    Job::parse(&format!(r#"{{"id":"{id}","request":{{"method":"POST","path":"{path}"}}}}"#)).unwrap()
}

fn job_payload(id: &str) -> WorkerPayload {
    WorkerPayload::Job { job: job(id), attempt: 0, circuit_epoch: 0, dispatched_at: system_now(), slot: None, trip: None, report_limits: false }
}

async fn api(tiers: &[&str], outage: Option<(Duration, Duration)>) -> FakeApi {
    let spec = FakeApiSpec {
        tiers: tiers.iter().map(|t| t.parse().unwrap()).collect(),
        latency: (Duration::from_millis(5), Duration::from_millis(20)),
        outage,
        server_error_every: None,
        max_concurrent: None,
        others_per_second: 0.0,
    };
    FakeApi::start(spec).await.unwrap()
}

/// A config file for an AWS lane on moto, naming everything the operator commands use.
fn aws_config(dir: &Path, names: &AwsNames, tiers: &str) -> PathBuf {
    let text = format!(
        "[api]\nbase_url = \"https://api.example.com\"\nheaders = {{ Authorization = {{ env = \"PACELINE_TEST_UNSET_TOKEN\" }} }}\n\
         [quota]\ntiers = [{tiers}]\n\
         [backend]\nkind = \"aws\"\nqueue_url = \"{}\"\ndlq_url = \"{}\"\ntable = \"{}\"\nworker_dlq_url = \"{}\"\n\
         orchestrator_function = \"paceline-orchestrator\"\nregion = \"us-east-1\"\n",
        names.queue_url,
        names.dlq_url,
        names.table,
        names.worker_dlq_url.as_deref().unwrap_or_default(),
    );
    let path = dir.join("paceline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// An AWS lane with a worker DLQ, and a config file for it in a folder the test holds.
async fn aws_lane(name: &str, tiers: &str) -> (aws_config::SdkConfig, AwsNames, PathBuf, LaneDir) {
    let sdk = moto_sdk_config().await;
    let mut names = create_lane(&sdk, "paceline-worker").await;
    names.worker_dlq_url = Some(create_queue(&sdk, "paceline-worker-dlq").await);
    let dir = lane_dir(name);
    let config = aws_config(&dir, &names, tiers);
    (sdk, names, config, dir)
}

async fn cli(config: &Path, args: &[&str]) -> std::process::Output {
    let mut all = args.to_vec();
    all.extend(["--config", config.to_str().unwrap()]);
    paceline_with_env(&all, "", &moto_env()).await
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Receives everything on a queue (deleting it), returning each job id with its attempt.
async fn take_all(queue: &SqsQueue) -> Vec<(String, u32)> {
    let mut taken = Vec::new();
    loop {
        let batch = queue.receive(10, Duration::from_secs(1), Duration::from_secs(30)).await.unwrap();
        if batch.is_empty() {
            return taken;
        }
        let receipts: Vec<String> = batch.iter().map(|m| m.receipt.clone()).collect();
        taken.extend(batch.into_iter().map(|m| (Job::parse(&m.body).unwrap().id.to_string(), m.attempt)));
        queue.delete(&receipts).await.unwrap();
    }
}

fn group_counts(summary: &serde_json::Value) -> BTreeMap<String, u64> {
    summary
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (format!("{}/{}", g["source"].as_str().unwrap(), g["cause"].as_str().unwrap()), g["count"].as_u64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_status_circuit_and_kick_on_an_aws_lane() {
    let (sdk, names, config, _dir) = aws_lane("ops-aws", r#""10/s", "100000/day""#).await;
    let jobs = ids("bulk", 1000);
    let mut input = job_lines(&jobs);
    input.insert_str(0, "{\"request\": 1}\n");
    input.push_str("not json\n{\"request\":{\"method\":\"GET\",\"path\":\"https://elsewhere.example/\"}}\n");
    let mut args = vec!["enqueue".to_owned(), "--config".to_owned(), config.to_str().unwrap().to_owned(), "-".to_owned()];
    let enqueued = paceline_with_env(&args.iter().map(String::as_str).collect::<Vec<_>>(), &input, &moto_env()).await;
    assert!(!enqueued.status.success(), "bad lines must fail the command");
    assert!(stdout(&enqueued).contains("enqueued 1000 job(s); 3 line(s) rejected"), "{}", stdout(&enqueued));
    let errors = stderr(&enqueued);
    assert!(errors.contains("line 1: ") && errors.contains("line 1002: ") && errors.contains("line 1003: "), "{errors}");

    let status = json_of(&cli(&config, &["status", "--json"]).await);
    assert_eq!(status["queue"]["visible"], 1000, "{status}");
    assert_eq!((status["queue"]["dead"].as_u64(), status["worker_dead"].as_u64()), (Some(0), Some(0)));
    assert_eq!(status["tiers"][1]["used"], 0);
    assert_eq!(status["drain_estimate_seconds"], 100, "1000 jobs at 10/s");
    assert!(status["lease"].is_null() && status["circuit"]["status"] == "closed");

    // Epoch-conditioned: a change decided from an old epoch is refused.
    let opened = cli(&config, &["circuit", "open", "--reason", "provider maintenance"]).await;
    assert!(opened.status.success(), "{}", stderr(&opened));
    let status = json_of(&cli(&config, &["status", "--json"]).await);
    assert!(assert_times_are_rfc3339(&status) >= 1, "the circuit's since at least: {status}");
    assert_eq!((status["circuit"]["status"].as_str(), status["circuit"]["epoch"].as_u64()), (Some("open"), Some(1)));
    assert_eq!(status["circuit"]["reason"], "operator: provider maintenance");
    let stale = cli(&config, &["circuit", "close", "--epoch", "0"]).await;
    assert!(!stale.status.success() && stderr(&stale).contains("epoch 1, not 0"), "{}", stderr(&stale));
    assert!(cli(&config, &["circuit", "close", "--epoch", "1"]).await.status.success());
    let text = stdout(&cli(&config, &["status"]).await);
    assert!(text.contains("circuit: closed") && text.contains("epoch 2") && text.contains("1000 ready"), "{text}");

    // Kick: an Event invoke of the orchestrator function (Lambda endpoint overridden).
    let lambda = FakeLambda::start().await;
    let mut env = moto_env();
    env.push(("AWS_ENDPOINT_URL_LAMBDA".into(), lambda.url.clone()));
    args = vec!["kick".into(), "--config".into(), config.to_str().unwrap().into()];
    let kicked = paceline_with_env(&args.iter().map(String::as_str).collect::<Vec<_>>(), "", &env).await;
    assert!(kicked.status.success(), "{}", stderr(&kicked));
    let kicks = lambda.kicks();
    assert_eq!(kicks.len(), 1);
    assert_eq!((kicks[0].0.as_str(), kicks[0].1["source"].as_str()), ("paceline-orchestrator", Some("paceline.cli")));

    // Names from flags alone, no config file: the same lane.
    let flags =
        ["status", "--json", "--config", "/nonexistent/paceline.toml", "--queue-url", &names.queue_url, "--dlq-url", &names.dlq_url, "--table", &names.table];
    let status = json_of(&paceline_with_env(&flags, "", &moto_env()).await);
    assert_eq!(status["queue"]["visible"], 1000);
    // --region overrides AWS_REGION: the lane's queue is not in another region.
    let elsewhere = paceline_with_env(&[&flags[..], &["--region", "eu-west-1"]].concat(), "", &moto_env()).await;
    assert!(!elsewhere.status.success() && stderr(&elsewhere).contains("queue does not exist"), "{}", stderr(&elsewhere));
    let missing = paceline_with_env(&["status", "--config", "/nonexistent/paceline.toml", "--queue-url", &names.queue_url], "", &moto_env()).await;
    assert!(stderr(&missing).contains("--dlq-url, --table"), "{}", stderr(&missing));

    // Or from a deployed stack's outputs (as infra/template.yaml names them).
    let stack = format!("paceline-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let outputs = [("JobsQueueUrl", &names.queue_url), ("JobsDlqUrl", &names.dlq_url), ("StateTableName", &names.table)];
    let template = serde_json::json!({
        "Resources": { "Placeholder": { "Type": "AWS::SQS::Queue" } },
        "Outputs": outputs.iter().map(|(k, v)| ((*k).to_owned(), serde_json::json!({ "Value": v }))).collect::<serde_json::Map<_, _>>(),
    });
    aws_sdk_cloudformation::Client::new(&sdk).create_stack().stack_name(&stack).template_body(template.to_string()).send().await.unwrap();
    let status = json_of(&paceline_with_env(&["status", "--json", "--config", "/nonexistent/paceline.toml", "--stack", &stack], "", &moto_env()).await);
    assert_eq!(status["queue"]["visible"], 1000);
    let unknown = paceline_with_env(&["status", "--config", "/nonexistent/paceline.toml", "--stack", "no-such-stack"], "", &moto_env()).await;
    assert!(stderr(&unknown).contains("cannot read stack no-such-stack"), "{}", stderr(&unknown));
}

/// Fills both DLQs as an outage would: the real worker (one attempt allowed) meets a
/// failing API (503), a dead connection and a 404; Lambda gives up on a few worker runs.
async fn outage_fills_the_dlqs(sdk: &aws_config::SdkConfig, names: &AwsNames) {
    let during_outage = api(&["1000/s"], Some((Duration::ZERO, Duration::from_secs(600)))).await;
    let up = api(&["1000/s"], None).await;
    for (base, prefix, n) in [(during_outage.base_url.as_str(), "down", 30), ("http://127.0.0.1:9", "unreachable", 5), (up.base_url.as_str(), "gone", 10)] {
        let env = lane_env(names, &[("PACELINE_API_BASE_URL", base), ("PACELINE_API_TIMEOUT", "2s"), ("PACELINE_MAX_ATTEMPTS", "1")]);
        let get = |k: &str| env.get(k).cloned();
        let worker = paceline_worker::lambda::from_env(&Env::new(&get), sdk).unwrap();
        for id in ids(prefix, n) {
            worker.handle(job_payload(&id)).await.unwrap();
        }
    }
    let adapters = AwsAdapters::new(sdk, names, None);
    for (i, text) in ["not json", "{}", "{\"request\":1}"].iter().enumerate() {
        let reason = DeadLetterReason { cause: DeadLetterCause::Malformed, detail: format!("not a job #{i}"), outcome: None };
        adapters.queue.dead_letter(&format!("m-{i}"), text, 0, &reason).await.unwrap();
    }
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let worker_dlq = names.worker_dlq_url.as_deref().unwrap();
    let health = WorkerPayload::HealthCheck { circuit_epoch: 3, sent_at: UnixMillis(0), slot: None, lane: Default::default() };
    let records = ids("lost", 12).iter().map(|id| job_payload(id)).chain([health.clone(), health]).collect::<Vec<_>>();
    for payload in records {
        let body = lambda_failure_record(&payload, "Transient", "sqs SendMessage: timed out");
        sqs.send_message().queue_url(worker_dlq).message_body(body).send().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_dlq_summary_groups_causes_and_redrive_moves_exactly_those_asked_for() {
    let (sdk, names, config, _dir) = aws_lane("ops-dlq", r#""10/s""#).await;
    outage_fills_the_dlqs(&sdk, &names).await;

    let summary = json_of(&cli(&config, &["dlq", "summary", "--json"]).await);
    let expected: BTreeMap<String, u64> = [
        ("jobs/attempts_exhausted:http_503", 30),
        ("jobs/http_404", 10),
        ("jobs/attempts_exhausted:connection", 5),
        ("jobs/malformed", 3),
        ("worker/worker:retries_exhausted:Unhandled", 14),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(group_counts(&summary), expected);
    // RFC 3339 in UTC with milliseconds: ordered as text.
    assert!(summary[0]["first_seen"].as_str().unwrap() <= summary[0]["last_seen"].as_str().unwrap(), "{summary}");

    let listed = json_of(&cli(&config, &["dlq", "list", "--cause", "4xx", "--json"]).await);
    let listed: BTreeSet<&str> = listed.as_array().unwrap().iter().map(|r| r["job_id"].as_str().unwrap()).collect();
    assert_eq!(listed, ids("gone", 10).iter().map(String::as_str).collect());
    let shown = stdout(&cli(&config, &["dlq", "show", "down-0007"]).await);
    assert!(shown.contains("attempts_exhausted:http_503") && shown.contains("gave up after 1 failed calls; last: HTTP 503"), "{shown}");

    let refused = cli(&config, &["dlq", "redrive"]).await;
    assert!(!refused.status.success() && stderr(&refused).contains("--all"), "{}", stderr(&refused));
    let dry = json_of(&cli(&config, &["dlq", "redrive", "--cause", "5xx", "--dry-run", "--json"]).await);
    assert_eq!((dry["matched"].as_u64(), dry["done"].as_u64(), dry["would"].as_array().map(Vec::len)), (Some(30), Some(0), Some(30)));

    let moved = json_of(&cli(&config, &["dlq", "redrive", "--cause", "5xx", "--json"]).await);
    assert_eq!(moved["done"], 30, "{moved}");
    let moved = json_of(&cli(&config, &["dlq", "redrive", "--dlq", "worker", "--cause", "worker", "--keep-attempts", "--json"]).await);
    assert_eq!((moved["done"].as_u64(), moved["no_job"].as_u64()), (Some(12), Some(2)), "{moved}");
    let purged = json_of(&cli(&config, &["dlq", "purge", "--dlq", "worker", "--all", "--json"]).await);
    assert_eq!(purged["done"], 2);

    let after = group_counts(&json_of(&cli(&config, &["dlq", "summary", "--json"]).await));
    let left: BTreeMap<String, u64> = expected.into_iter().filter(|(k, _)| !k.contains("503") && !k.starts_with("worker")).collect();
    assert_eq!(after, left, "only the redriven and purged groups left");

    // The outage opened the circuit; the API is back, the operator closes it, and the
    // redriven jobs are paced like any other.
    assert!(cli(&config, &["circuit", "close", "--reason", "API back"]).await.status.success());
    let healthy = api(&["10/s"], None).await;
    let lambda = FakeLambda::start().await;
    let env = lane_env(
        &names,
        &[
            ("PACELINE_WORKER_FUNCTION", "paceline-worker"),
            ("PACELINE_TIERS", "10/s"),
            ("PACELINE_SAFETY_MARGIN", "25ms"),
            ("PACELINE_API_BASE_URL", healthy.base_url.as_str()),
        ],
    );
    let get = |k: &str| env.get(k).cloned();
    let worker: Arc<dyn WorkerHandler> = Arc::new(paceline_worker::lambda::from_env(&Env::new(&get), &sdk).unwrap());
    lambda.run_worker(worker);
    let orchestrator = orchestrator_lambda::from_env(&Env::new(&get), &sdk, Some(&lambda.url)).unwrap().into_orchestrator();
    // A worker that starts after its slot re-queues the job (a loaded machine does that);
    // a job re-queued after the run found the queue empty goes at the next run, as the
    // next minute's kick would send it.
    // On a machine loaded by the other tests that can happen run after run: up to six.
    let queue = AwsAdapters::new(&sdk, &names, None).queue;
    for _ in 0..6 {
        let opts = RunOptions { holder: "test".into(), deadline: system_now().plus(Duration::from_secs(60)), drain: true, stop: None };
        let report = orchestrator.run(&opts).await.unwrap();
        lambda.settle(Duration::from_secs(10)).await;
        assert_eq!(report.stop, StopReason::Drained);
        let depth = queue.depth().await.unwrap();
        if depth.visible == 0 && depth.not_visible == 0 {
            break;
        }
    }
    // A worker that starts after its slot re-queues the job (a loaded machine does that),
    // so a job may be invoked twice; it reaches the API once, within the quota.
    let invoked: BTreeSet<String> = lambda
        .invocations()
        .into_iter()
        .flat_map(|i| i.payload.batch_calls())
        .filter_map(|call| match call {
            Ok(WorkerPayload::Job { job, .. }) => Some(job.id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(invoked.len(), 42, "{invoked:?}");
    let log = healthy.log();
    assert_eq!((log.ok, log.quota_rejections, log.ok_by_path.len()), (42, 0, 42), "{:?}", log.ok_by_path);
    let calls: Vec<(UnixMillis, u64)> = log.arrivals.iter().map(|at| (*at, 1)).collect();
    assert!(peak_in_any_window(&calls, Duration::from_secs(1)) <= 10, "redriven jobs exceeded the quota");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_worker_batch_in_the_worker_dlq_is_shown_and_redriven_job_by_job() {
    let (sdk, names, config, _dir) = aws_lane("ops-batch", r#""10/s""#).await;
    let calls: Vec<WorkerPayload> = ids("batched", 5).iter().map(|id| job_payload(id)).collect();
    let failed = lambda_failure_record(&WorkerPayload::batch("run-9#3".into(), &calls), "Transient", "sqs SendMessage: timed out");
    let sqs = aws_sdk_sqs::Client::new(&sdk);
    sqs.send_message().queue_url(names.worker_dlq_url.as_deref().unwrap()).message_body(failed).send().await.unwrap();

    let listed = json_of(&cli(&config, &["dlq", "list", "--dlq", "worker", "--json"]).await);
    let shown: Vec<(&str, u64)> = listed.as_array().unwrap().iter().map(|r| (r["job_id"].as_str().unwrap(), r["batch"]["index"].as_u64().unwrap())).collect();
    assert_eq!(shown, [("batched-0000", 0), ("batched-0001", 1), ("batched-0002", 2), ("batched-0003", 3), ("batched-0004", 4)], "{listed}");

    let one = json_of(&cli(&config, &["dlq", "redrive", "--dlq", "worker", "--id", "batched-0002", "--json"]).await);
    assert_eq!(one["done"], 1, "{one}");
    let queue = AwsAdapters::new(&sdk, &names, None).queue;
    assert_eq!(take_all(&queue).await, [("batched-0002".to_owned(), 0)], "that job alone is back on the queue");
    let left = json_of(&cli(&config, &["dlq", "list", "--dlq", "worker", "--json"]).await);
    let left: Vec<&str> = left.as_array().unwrap().iter().map(|r| r["job_id"].as_str().unwrap()).collect();
    assert_eq!(left, ["batched-0000", "batched-0001", "batched-0003", "batched-0004"], "the rest of the batch stays in the DLQ");

    let rest = json_of(&cli(&config, &["dlq", "redrive", "--dlq", "worker", "--all", "--json"]).await);
    assert_eq!(rest["done"], 4, "{rest}");
    let mut back = take_all(&queue).await;
    back.sort();
    assert_eq!(back.len(), 4);
    assert_eq!(json_of(&cli(&config, &["dlq", "list", "--dlq", "worker", "--json"]).await), serde_json::json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_killed_midway_and_run_again_loses_nothing_and_duplicates_nothing_in_the_dlq() {
    let (sdk, names, config, _dir) = aws_lane("ops-kill", r#""10/s""#).await;
    let queue = AwsAdapters::new(&sdk, &names, None).queue;
    let failed = ids("failed", 240);
    let refused = ids("refused", 120);
    let mut sends = tokio::task::JoinSet::new();
    for (id, status) in failed.iter().map(|id| (id.clone(), 503)).chain(refused.iter().map(|id| (id.clone(), 404))) {
        let queue = queue.clone();
        sends.spawn(async move {
            let cause =
                if status == 503 { DeadLetterCause::AttemptsExhausted { last_failure: Some("http_503".into()) } } else { DeadLetterCause::Rejected { status } };
            queue.dead_letter(&id, &job(&id).to_json(), 4, &DeadLetterReason { cause, detail: format!("HTTP {status}"), outcome: None }).await.unwrap();
        });
        if sends.len() >= 16 {
            sends.join_next().await;
        }
    }
    while sends.join_next().await.is_some() {}

    let mut child = tokio::process::Command::new(paceline_bin())
        .args(["dlq", "redrive", "--cause", "5xx", "--hold", "3s", "--config", config.to_str().unwrap()])
        .envs(moto_env())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = tokio::time::Instant::now();
    loop {
        let depth = queue.depth().await.unwrap();
        if depth.visible >= 40 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the redrive made no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().await.unwrap();
    let redriven_before_kill = queue.depth().await.unwrap().visible;
    assert!(redriven_before_kill < 240, "killed too late to test anything");

    // What the killed run held comes back after its hold; then the redrive is run again.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let again = cli(&config, &["dlq", "redrive", "--cause", "5xx", "--json"]).await;
    assert!(again.status.success(), "{}", stderr(&again));

    let mut on_queue: BTreeMap<String, u32> = BTreeMap::new();
    for (id, attempt) in take_all(&queue).await {
        assert_eq!(attempt, 0, "attempts are reset by default");
        *on_queue.entry(id).or_default() += 1;
    }
    assert_eq!(on_queue.keys().cloned().collect::<BTreeSet<_>>(), failed.iter().cloned().collect(), "every 5xx job redriven, nothing else");
    let doubled = on_queue.values().filter(|n| **n > 1).count();
    assert!(doubled <= 10, "at most the one batch in flight at the kill may be enqueued twice, got {doubled}");

    let left = json_of(&cli(&config, &["dlq", "list", "--limit", "1000", "--json"]).await);
    let mut in_dlq: Vec<String> = left.as_array().unwrap().iter().map(|r| r["job_id"].as_str().unwrap().to_owned()).collect();
    in_dlq.sort();
    assert_eq!(in_dlq, refused, "the DLQ keeps exactly the 404s, each once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_operator_commands_work_on_the_embedded_store() {
    let api = api(&["50/s"], None).await;
    let dir = lane_dir("ops-embedded");
    let config = write_config(&dir, &api.base_url, &["50/s", "100000/day"], "");
    let config = config.to_str().unwrap();
    let mut jobs = ids("fine", 20);
    jobs.extend(ids("gone", 6));
    let enqueued = json_of(&paceline(&["enqueue", "--config", config, "--json"], &format!("{}not a job\n", job_lines(&jobs))).await);
    assert_eq!(
        (enqueued["enqueued"].as_u64(), enqueued["job_ids"][0].as_str(), enqueued["rejected"].as_array().map(Vec::len)),
        (Some(26), Some("fine-0000"), Some(1))
    );
    let status = json_of(&paceline(&["status", "--config", config, "--json"], "").await);
    assert_eq!((status["queue"]["visible"].as_u64(), status["drain_estimate_seconds"].as_u64()), (Some(26), Some(0)));
    assert!(status["worker_dead"].is_null());

    assert!(paceline(&["run", "--config", config, "--drain"], "").await.status.success());
    let summary = json_of(&paceline(&["dlq", "summary", "--config", config, "--json"], "").await);
    assert_eq!(group_counts(&summary), [("jobs/http_404".to_owned(), 6)].into_iter().collect());
    let listed = json_of(&paceline(&["dlq", "list", "--config", config, "--json"], "").await);
    let dead_at = listed[0]["dead_at"].as_str().unwrap_or_default();
    assert!(UnixMillis::parse_rfc3339(dead_at).is_ok(), "times in JSON are RFC 3339: {}", listed[0]);
    assert_eq!(listed[0]["outcome"]["status"], 404, "the dead letter carries its outcome record");
    let status = json_of(&paceline(&["status", "--config", config, "--json"], "").await);
    assert_eq!((status["queue"]["dead"].as_u64(), status["tiers"][1]["used"].as_u64()), (Some(6), Some(26)));
    assert!(assert_times_are_rfc3339(&status) >= 2, "the circuit's since and the day's reset at least: {status}");

    let worker = paceline(&["dlq", "list", "--config", config, "--dlq", "worker"], "").await;
    assert!(stderr(&worker).contains("no worker DLQ"), "{}", stderr(&worker));
    let one = json_of(&paceline(&["dlq", "redrive", "--config", config, "--id", "gone-0003", "--json"], "").await);
    assert_eq!(one["done"], 1);
    let rest = json_of(&paceline(&["dlq", "purge", "--config", config, "--cause", "http_404", "--older-than", "0s", "--json"], "").await);
    assert_eq!(rest["done"], 5);
    let status = json_of(&paceline(&["status", "--config", config, "--json"], "").await);
    assert_eq!((status["queue"]["visible"].as_u64(), status["queue"]["dead"].as_u64()), (Some(1), Some(0)));

    let opened = json_of(&paceline(&["circuit", "open", "--config", config, "--reason", "drill", "--json"], "").await);
    assert_eq!((opened["changed"].as_bool(), opened["status"].as_str()), (Some(true), Some("open")), "{opened}");
    let again = json_of(&paceline(&["circuit", "open", "--config", config, "--json"], "").await);
    assert_eq!((again["changed"].as_bool(), again["epoch"].as_u64()), (Some(false), opened["epoch"].as_u64()), "{again}");
    let status = json_of(&paceline(&["status", "--config", config, "--json"], "").await);
    assert_eq!((status["circuit"]["status"].as_str(), status["circuit"]["reason"].as_str()), (Some("open"), Some("operator: drill")));
    assert_eq!(status["circuit"]["since"], opened["since"]);
    let kick = paceline(&["kick", "--config", config], "").await;
    assert!(!kick.status.success() && stderr(&kick).contains("paceline run"), "{}", stderr(&kick));
}

/// `paceline serve --no-run` over an AWS stack: what an operator does from a browser
/// after an outage (the summary by cause, a redrive) through the API, with nothing
/// paced by `serve` itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_a_run_shows_an_aws_stack_s_dead_letters_by_cause_and_redrives_them() {
    let (sdk, names, config, _dir) = aws_lane("ops-serve", r#""10/s""#).await;
    outage_fills_the_dlqs(&sdk, &names).await;
    let token = "a-token-for-serving-an-aws-stack-0123";
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("[serve]\ntoken = { env = \"PACELINE_TEST_SERVE_TOKEN\" }\n");
    std::fs::write(&config, text).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut serve = tokio::process::Command::new(paceline_bin())
        .args(["serve", "--no-run", "--config", config.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")])
        .envs(moto_env())
        .env("PACELINE_TEST_SERVE_TOKEN", token)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let call = |method: reqwest::Method, path: &str, body: Option<&str>| {
        let mut request = client.request(method, format!("{base}{path}")).bearer_auth(token);
        if let Some(body) = body {
            request = request.header("content-type", "application/json").body(body.to_owned());
        }
        async move {
            let response = request.send().await?;
            let status = response.status().as_u16();
            Ok::<_, reqwest::Error>((status, serde_json::from_str::<serde_json::Value>(&response.text().await?).unwrap_or_default()))
        }
    };
    let mut status = None;
    for _ in 0..100 {
        if serve.try_wait().unwrap().is_some() {
            let output = serve.wait_with_output().await.unwrap();
            panic!("serve ended: {}", String::from_utf8_lossy(&output.stderr));
        }
        if let Ok(answer) = call(reqwest::Method::GET, "/v1/status", None).await {
            status = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, status) = status.expect("serve listened within 10 s");
    assert_eq!(code, 200, "{status}");
    assert_eq!(status["worker_dead"], 14, "{status}");

    let (_, dlq) = call(reqwest::Method::GET, "/v1/dlq?cause=5xx&limit=5", None).await.unwrap();
    let causes: BTreeMap<String, u64> = dlq["summary"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (format!("{}/{}", g["source"].as_str().unwrap(), g["cause"].as_str().unwrap()), g["count"].as_u64().unwrap()))
        .collect();
    assert_eq!(causes.get("jobs/attempts_exhausted:http_503"), Some(&30), "{dlq}");
    assert_eq!(causes.get("worker/worker:retries_exhausted:Unhandled"), Some(&14), "{dlq}");
    assert_eq!(dlq["records"].as_array().unwrap().len(), 5);
    let (code, moved) = call(reqwest::Method::POST, "/v1/dlq/redrive", Some(r#"{"cause":["5xx"]}"#)).await.unwrap();
    assert_eq!((code, moved["done"].as_u64()), (200, Some(30)), "{moved}");
    let (code, results) = call(reqwest::Method::GET, "/v1/results", None).await.unwrap();
    assert_eq!(code, 404, "on AWS the records go to the results destination: {results}");
    let (code, enqueued) = call(reqwest::Method::POST, "/v1/jobs", Some(r#"{"id":"from-http","request":{"method":"GET","path":"/items/1"}}"#)).await.unwrap();
    assert_eq!((code, &enqueued["job_ids"]), (202, &serde_json::json!(["from-http"])), "{enqueued}");

    let adapters = AwsAdapters::new(&sdk, &names, None);
    let queued = take_all(&adapters.queue).await;
    assert_eq!(queued.len(), 31, "the 30 redriven and the one enqueued over HTTP: {queued:?}");
    let pid = serve.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let output = serve.wait_with_output().await.unwrap();
    assert!(output.status.success(), "serve stops cleanly on SIGTERM: {}", String::from_utf8_lossy(&output.stderr));
}
