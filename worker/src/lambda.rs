//! The worker as a Lambda function: built once at cold start from `PACELINE_*`
//! variables; each asynchronous invocation carries one versioned payload. An error
//! makes Lambda retry the event and, at last, send it to the on-failure destination
//! (the worker DLQ), so nothing is lost.

use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames};
use paceline_shared::job::WorkerPayload;
use paceline_shared::lambda_env::Env;
use paceline_shared::ports::WorkerHandler;
use paceline_shared::time::SystemClock;
use serde_json::Value;

use crate::{ApiClient, Worker, WorkerStats};

/// Builds the worker from the environment and an SDK configuration.
///
/// # Errors
/// The first missing or invalid variable, named.
pub fn from_env(env: &Env<'_>, sdk: &aws_config::SdkConfig) -> Result<Worker, String> {
    let names = AwsNames::from_env(env, false)?;
    let api_config = env.api()?;
    let aws = AwsAdapters::new(sdk, &names, None);
    Ok(Worker {
        api: ApiClient::new(&api_config).map_err(|e| e.to_string())?,
        queue: Arc::new(aws.queue),
        store: Arc::new(aws.store),
        clock: Arc::new(SystemClock),
        retry: env.retry()?,
        health_check: api_config.health_check,
        stats: Arc::new(WorkerStats::default()),
    })
}

/// Handles one payload.
///
/// # Errors
/// An unreadable payload, or a follow-up write that failed: Lambda retries.
pub async fn handle(event: LambdaEvent<Value>, worker: &Worker) -> Result<(), lambda_runtime::Error> {
    let payload = WorkerPayload::from_json(&event.payload.to_string())?;
    worker.handle(payload).await?;
    Ok(())
}
