//! The worker as a Lambda function: built once at cold start from `PACELINE_*`
//! variables (the API's secrets fetched from Secrets Manager, never from plain text;
//! with `PACELINE_LANES`, each lane's worker and keys when its first job comes); each
//! asynchronous invocation carries one versioned payload (one job, a batch of jobs, or
//! a health check). An error
//! makes Lambda retry the event and, at last, send it to the on-failure destination
//! (the worker DLQ), so nothing is lost.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames, SqsResults};
use paceline_shared::job::WorkerPayload;
use paceline_shared::lambda_env::Env;
use paceline_shared::lane::LaneId;
use paceline_shared::metrics::{emf_record, Metric};
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::ports::{JobQueue, OutcomeSink, WorkerHandler};
use paceline_shared::time::{system_now, Clock, SystemClock, UnixMillis};
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use tracing::Instrument as _;

use crate::lanes::{LaneStack, LaneWorkerBuild, LaneWorkers};
use crate::{ApiClient, CallSlots, Worker, WorkerCounts, WorkerStats};

/// What `{lane}` stands for in a secret's name or id (`PACELINE_API_SECRETS`).
const LANE: &str = paceline_shared::config::LANE_PLACEHOLDER;

/// How long a lane's worker, and the keys it read, are kept before they are read again
/// (`PACELINE_SECRETS_TTL`): a rotated key is taken up within this.
const DEFAULT_SECRETS_TTL: Duration = Duration::from_secs(300);

/// The secrets `PACELINE_API_SECRETS` names (`{"API_TOKEN": "<secret ARN>"}`), read from
/// Secrets Manager. A header reads one as it would an environment variable (`{"env":
/// "API_TOKEN"}`), but the value never enters the process environment or the
/// function's configuration. A name with `{lane}` is each lane's own (`{"KEY_{lane}":
/// "paceline/keys/{lane}"}`): it is read when the lane's first job comes, not at cold
/// start.
#[derive(Clone)]
pub struct ApiSecrets {
    /// Read at cold start.
    fixed: BTreeMap<String, SecretString>,
    /// Each lane's, by name and secret id, `{lane}` not yet replaced.
    per_lane: Vec<(String, String)>,
    client: aws_sdk_secretsmanager::Client,
}

impl ApiSecrets {
    /// Reads the secrets every lane shares, once at cold start.
    ///
    /// # Errors
    /// A bad `PACELINE_API_SECRETS`, or a secret that cannot be read (named by its id,
    /// the value never shown).
    pub async fn fetch(env: &Env<'_>, sdk: &aws_config::SdkConfig) -> Result<Self, String> {
        let wanted: BTreeMap<String, String> = match env.required("PACELINE_API_SECRETS") {
            Err(_) => BTreeMap::new(),
            Ok(text) => serde_json::from_str(&text).map_err(|e| format!("PACELINE_API_SECRETS: not a JSON object of name to secret id: {e}"))?,
        };
        let (per_lane, shared): (Vec<_>, Vec<_>) = wanted.into_iter().partition(|(name, id)| name.contains(LANE) || id.contains(LANE));
        let secrets = Self { fixed: BTreeMap::new(), per_lane, client: aws_sdk_secretsmanager::Client::new(sdk) };
        let fixed = secrets.read(&shared).await.map_err(|e| format!("PACELINE_API_SECRETS: {e}"))?;
        Ok(Self { fixed, ..secrets })
    }

    /// The value of secret `name` read at cold start.
    #[must_use]
    pub fn value(&self, name: &str) -> Option<&SecretString> {
        self.fixed.get(name)
    }

    /// Lane `lane`'s own secrets, read now, by name.
    ///
    /// # Errors
    /// The first that cannot be read, named by its id (the value never shown).
    pub async fn for_lane(&self, lane: &LaneId) -> Result<BTreeMap<String, SecretString>, String> {
        let wanted: Vec<(String, String)> =
            self.per_lane.iter().map(|(name, id)| (name.replace(LANE, lane.as_str()), id.replace(LANE, lane.as_str()))).collect();
        self.read(&wanted).await
    }

    async fn read(&self, wanted: &[(String, String)]) -> Result<BTreeMap<String, SecretString>, String> {
        let mut secrets = BTreeMap::new();
        for (name, id) in wanted {
            let out = self
                .client
                .get_secret_value()
                .secret_id(id)
                .send()
                .await
                .map_err(|e| format!("cannot read secret {name} ({id}): {}", paceline_shared::error_chain(&e)))?;
            let value = out.secret_string().ok_or_else(|| format!("secret {name} ({id}) holds no text"))?;
            secrets.insert(name.clone(), SecretString::from(value.trim_end().to_owned()));
        }
        Ok(secrets)
    }
}

/// The worker function: what handles each payload (the stack's one worker, or with
/// `PACELINE_LANES` each lane's), and one count of what they did.
pub struct WorkerFunction {
    handler: Arc<dyn WorkerHandler>,
    stats: Arc<WorkerStats>,
}

impl WorkerFunction {
    /// What handles each payload.
    #[must_use]
    pub fn handler(&self) -> Arc<dyn WorkerHandler> {
        self.handler.clone()
    }
}

/// Builds the function from `env` (the process's variables, then the secrets read at
/// cold start), an SDK configuration and the API's secrets (each lane's are read with
/// them when its first job comes).
///
/// # Errors
/// The first missing or invalid variable, named.
pub fn function_from_env(env: &Env<'_>, sdk: &aws_config::SdkConfig, secrets: ApiSecrets) -> Result<WorkerFunction, String> {
    let stats = Arc::new(WorkerStats::default());
    if env.optional("PACELINE_LANES").is_none() {
        let worker = from_env(env, sdk)?.with_stats(stats.clone());
        return Ok(WorkerFunction { handler: Arc::new(worker), stats });
    }
    let quota = env.quota()?;
    let lanes = env.lanes(&quota)?.expect("PACELINE_LANES is set");
    let names = AwsNames::from_env(env, false)?;
    let aws = AwsAdapters::new(sdk, &names, None);
    let outcomes = env.outcomes()?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let keep_for = env.duration("PACELINE_SECRETS_TTL", DEFAULT_SECRETS_TTL)?;
    let shard_queues = env.shard_queues()?.into_iter().map(|url| Arc::new(aws.queue.at(url)) as Arc<dyn JobQueue>).collect();
    let queue: Arc<dyn JobQueue> = Arc::new(aws.queue);
    let stack = LaneStack {
        lanes,
        api: env.api()?,
        body_cap: outcomes.body_cap(),
        retry: env.retry()?,
        queue: queue.clone(),
        shard_queues,
        stores: Arc::new(aws.store),
        clock: clock.clone(),
        stats: stats.clone(),
    };
    let results = batch_results(env, sdk);
    let secrets = Arc::new(secrets);
    let stores = stack.stores.clone();
    let build = move |lane: LaneId| -> LaneWorkerBuild {
        let (stack, secrets, outcomes, results) = (stack.clone(), secrets.clone(), outcomes.clone(), results.clone());
        Box::pin(async move {
            let own = secrets.for_lane(&lane).await?;
            let key =
                |name: &str| own.get(name).or_else(|| secrets.value(name)).map(|secret| secret.expose_secret().to_owned()).or_else(|| std::env::var(name).ok());
            let worker = stack.worker(&lane, &key)?.with_outcomes(outcomes, None);
            Ok(match results {
                Some(results) => worker.with_batch_results(results),
                None => worker,
            })
        })
    };
    let workers = LaneWorkers::new(Box::new(build), queue, stores, clock).rebuilt_after(keep_for);
    Ok(WorkerFunction { handler: Arc::new(workers), stats })
}

/// Where a batch's records go (`PACELINE_RESULTS_QUEUE_URL`), one message per job; a
/// lone job's is the function result, which the OnSuccess destination delivers.
fn batch_results(env: &Env<'_>, sdk: &aws_config::SdkConfig) -> Option<Arc<dyn OutcomeSink>> {
    let url = env.optional("PACELINE_RESULTS_QUEUE_URL")?;
    Some(Arc::new(SqsResults::new(aws_sdk_sqs::Client::new(sdk), url)))
}

/// Builds the worker of a stack of one lane from the environment and an SDK
/// configuration.
///
/// # Errors
/// The first missing or invalid variable, named.
pub fn from_env(env: &Env<'_>, sdk: &aws_config::SdkConfig) -> Result<Worker, String> {
    let names = AwsNames::from_env(env, false)?;
    let api_config = env.api()?;
    let aws = AwsAdapters::new(sdk, &names, None);
    let outcomes = env.outcomes()?;
    let api = Arc::new(ApiClient::new(&api_config).map_err(|e| e.to_string())?.keeping_bodies(outcomes.body_cap()));
    let call_slots = CallSlots::for_api(env.max_in_flight()?, api_config.timeout);
    let worker = Worker::new(api, Arc::new(aws.queue), Arc::new(aws.store), Arc::new(SystemClock), env.retry()?, api_config.health_check)
        .with_call_slots(call_slots)
        .with_api_timeout(api_config.timeout)
        .with_outcomes(outcomes, None);
    Ok(match batch_results(env, sdk) {
        Some(results) => worker.with_batch_results(results),
        None => worker,
    })
}

/// Handles one payload and prints what it did as a CloudWatch EMF record (lane `lane`).
/// The function result is the job's outcome record, which the async `OnSuccess`
/// destination delivers to the results queue (or bus, or topic); `null` when the
/// invocation ended no job (a re-queue, a health check, a fire-and-forget job).
///
/// # Errors
/// An unreadable payload, or a follow-up write that failed: Lambda retries.
pub async fn handle(event: LambdaEvent<Value>, function: &WorkerFunction, lane: &str) -> Result<Value, lambda_runtime::Error> {
    // Every log line of the invocation carries the lane.
    let span = tracing::info_span!("worker", lane = %lane);
    async {
        let payload = WorkerPayload::from_json(&event.payload.to_string())?;
        let before = function.stats.counts();
        let handled = function.handler.handle(payload).await;
        println!("{}", invocation_metrics(&function.stats.counts().since(&before), lane, system_now()));
        Ok(function_result(handled?))
    }
    .instrument(span)
    .await
}

/// One invocation's metrics: `Succeeded`, `RateLimited` (any is worth an alarm: the
/// configured quota is above the API's), `Requeued`, `DeadLettered`, `ApiFailures`,
/// `MissedSlots`, and for a call `CallLatency` and `SlotLag` (how long after its pacer
/// slot it went out).
#[must_use]
pub fn invocation_metrics(done: &WorkerCounts, lane: &str, at: UnixMillis) -> Value {
    let mut metrics = vec![
        Metric::count("Succeeded", done.succeeded),
        Metric::count("RateLimited", done.rate_limited),
        Metric::count("Requeued", done.requeued),
        Metric::count("DeadLettered", done.dead_lettered),
        Metric::count("ApiFailures", done.api_failures),
        Metric::count("MissedSlots", done.missed_slots),
    ];
    if let (Some(latency), Some(lag)) = (done.call_millis.checked_div(done.calls), done.slot_lag_millis.checked_div(done.calls)) {
        metrics.push(Metric::millis("CallLatency", latency));
        metrics.push(Metric::millis("SlotLag", lag));
    }
    let mut properties = serde_json::Map::new();
    properties.insert("Function".into(), "worker".into());
    emf_record(at, lane, &metrics, properties)
}

/// The function result for a handled payload: its outcome record, or `null`.
#[must_use]
pub fn function_result(record: Option<OutcomeRecord>) -> Value {
    record.and_then(|record| serde_json::to_value(record).ok()).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invocation_s_metrics_count_what_it_did_and_time_its_call() {
        let before = WorkerCounts { succeeded: 3, calls: 4, call_millis: 400, slot_lag_millis: 8, ..WorkerCounts::default() };
        let after = WorkerCounts { succeeded: 4, calls: 5, call_millis: 580, slot_lag_millis: 10, ..before };
        let record = invocation_metrics(&after.since(&before), "sms", UnixMillis(1_000));
        assert_eq!((record["Succeeded"].as_u64(), record["RateLimited"].as_u64()), (Some(1), Some(0)));
        assert_eq!((record["CallLatency"].as_u64(), record["SlotLag"].as_u64(), record["Lane"].as_str()), (Some(180), Some(2), Some("sms")));
        let requeued = WorkerCounts { requeued: 1, missed_slots: 1, ..WorkerCounts::default() };
        let record = invocation_metrics(&requeued, "sms", UnixMillis(1_000));
        assert!(record.get("CallLatency").is_none(), "no call, no latency: {record}");
        assert_eq!(record["MissedSlots"], 1);
    }
}
