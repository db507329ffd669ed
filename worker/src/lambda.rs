//! The worker as a Lambda function: built once at cold start from `PACELINE_*`
//! variables (the API's secrets fetched from Secrets Manager, never from plain text);
//! each asynchronous invocation carries one versioned payload (one job, a batch of
//! jobs, or a health check). An error
//! makes Lambda retry the event and, at last, send it to the on-failure destination
//! (the worker DLQ), so nothing is lost.

use std::collections::BTreeMap;
use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames, SqsResults};
use paceline_shared::job::WorkerPayload;
use paceline_shared::lambda_env::Env;
use paceline_shared::metrics::{emf_record, Metric};
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::ports::WorkerHandler;
use paceline_shared::time::{system_now, SystemClock, UnixMillis};
use secrecy::SecretString;
use serde_json::Value;
use tracing::Instrument as _;

use crate::{ApiClient, CallSlots, Worker, WorkerCounts};

/// Fetches the secrets `PACELINE_API_SECRETS` names (`{"API_TOKEN": "<secret ARN>"}`)
/// from Secrets Manager, once at cold start. A header reads one as it would an
/// environment variable (`{"env": "API_TOKEN"}`), but the value never enters the
/// process environment or the function's configuration.
///
/// # Errors
/// A bad `PACELINE_API_SECRETS`, or a secret that cannot be read (named by its id, the
/// value never shown).
pub async fn fetch_secrets(env: &Env<'_>, sdk: &aws_config::SdkConfig) -> Result<BTreeMap<String, SecretString>, String> {
    let wanted: BTreeMap<String, String> = match env.required("PACELINE_API_SECRETS") {
        Err(_) => return Ok(BTreeMap::new()),
        Ok(text) => serde_json::from_str(&text).map_err(|e| format!("PACELINE_API_SECRETS: not a JSON object of name to secret id: {e}"))?,
    };
    let client = aws_sdk_secretsmanager::Client::new(sdk);
    let mut secrets = BTreeMap::new();
    for (name, id) in wanted {
        let out = client
            .get_secret_value()
            .secret_id(&id)
            .send()
            .await
            .map_err(|e| format!("PACELINE_API_SECRETS: cannot read secret {name} ({id}): {}", paceline_shared::error_chain(&e)))?;
        let value = out.secret_string().ok_or_else(|| format!("PACELINE_API_SECRETS: secret {name} ({id}) holds no text"))?;
        secrets.insert(name, SecretString::from(value.trim_end().to_owned()));
    }
    Ok(secrets)
}

/// Builds the worker from the environment and an SDK configuration.
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
    // A batch's records go to the results queue itself, one message per job; a lone
    // job's is the function result, which the OnSuccess destination delivers.
    Ok(match env.required("PACELINE_RESULTS_QUEUE_URL") {
        Ok(url) if !url.is_empty() => worker.with_batch_results(Arc::new(SqsResults::new(aws_sdk_sqs::Client::new(sdk), url))),
        _ => worker,
    })
}

/// Handles one payload and prints what it did as a CloudWatch EMF record (lane `lane`).
/// The function result is the job's outcome record, which the async `OnSuccess`
/// destination delivers to the results queue (or bus, or topic); `null` when the
/// invocation ended no job (a re-queue, a health check, a fire-and-forget job).
///
/// # Errors
/// An unreadable payload, or a follow-up write that failed: Lambda retries.
pub async fn handle(event: LambdaEvent<Value>, worker: &Worker, lane: &str) -> Result<Value, lambda_runtime::Error> {
    // Every log line of the invocation carries the lane.
    let span = tracing::info_span!("worker", lane = %lane);
    async {
        let payload = WorkerPayload::from_json(&event.payload.to_string())?;
        let before = worker.stats().counts();
        let handled = worker.handle(payload).await;
        println!("{}", invocation_metrics(&worker.stats().counts().since(&before), lane, system_now()));
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
