//! The worker as a Lambda function: built once at cold start from `PACELINE_*`
//! variables (the API's secrets fetched from Secrets Manager, never from plain text);
//! each asynchronous invocation carries one versioned payload. An error
//! makes Lambda retry the event and, at last, send it to the on-failure destination
//! (the worker DLQ), so nothing is lost.

use std::collections::BTreeMap;
use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames};
use paceline_shared::job::WorkerPayload;
use paceline_shared::lambda_env::Env;
use paceline_shared::outcome::OutcomeRecord;
use paceline_shared::ports::WorkerHandler;
use paceline_shared::time::SystemClock;
use secrecy::SecretString;
use serde_json::Value;

use crate::{ApiClient, CallSlots, Worker};

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
    Ok(Worker::new(api, Arc::new(aws.queue), Arc::new(aws.store), Arc::new(SystemClock), env.retry()?, api_config.health_check)
        .with_call_slots(call_slots)
        .with_api_timeout(api_config.timeout)
        .with_outcomes(outcomes, None))
}

/// Handles one payload. The function result is the job's outcome record, which the
/// async `OnSuccess` destination delivers to the results queue (or bus, or topic); `null`
/// when the invocation ended no job (a re-queue, a health check, a fire-and-forget job).
///
/// # Errors
/// An unreadable payload, or a follow-up write that failed: Lambda retries.
pub async fn handle(event: LambdaEvent<Value>, worker: &Worker) -> Result<Value, lambda_runtime::Error> {
    let payload = WorkerPayload::from_json(&event.payload.to_string())?;
    Ok(function_result(worker.handle(payload).await?))
}

/// The function result for a handled payload: its outcome record, or `null`.
#[must_use]
pub fn function_result(record: Option<OutcomeRecord>) -> Value {
    record.and_then(|record| serde_json::to_value(record).ok()).unwrap_or(Value::Null)
}
