//! The orchestrator as a Lambda function: built once at cold start from `PACELINE_*`
//! variables, then each invocation (the EventBridge schedule or an operator's kick)
//! runs the drain loop until the invocation's deadline, minus the margin.

use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use paceline_shared::adapters::aws::{AwsAdapters, AwsNames};
use paceline_shared::lambda_env::Env;
use paceline_shared::time::{SystemClock, UnixMillis};
use serde_json::{json, Value};

use crate::{Orchestrator, Progress, RunError, RunOptions, Settings};

/// Builds the orchestrator from the environment and an SDK configuration.
///
/// # Errors
/// The first missing or invalid variable, named.
pub fn from_env(env: &Env<'_>, sdk: &aws_config::SdkConfig, lambda_endpoint: Option<&str>) -> Result<Orchestrator, String> {
    let names = AwsNames::from_env(env, true)?;
    let settings = Settings { quota: env.quota()?, orchestrator: env.orchestrator()?, circuit: env.circuit()? };
    let aws = AwsAdapters::new(sdk, &names, lambda_endpoint);
    Ok(Orchestrator {
        queue: Arc::new(aws.queue),
        store: Arc::new(aws.store),
        invoker: Arc::new(aws.invoker),
        clock: Arc::new(SystemClock),
        settings,
        progress: Arc::new(Progress::default()),
    })
}

/// Handles one kick. A kick while another run holds the lease is not an error: it
/// returns at once, saying so.
///
/// # Errors
/// A fatal adapter error (the run released what it held first).
pub async fn handle(event: LambdaEvent<Value>, orchestrator: &Orchestrator) -> Result<Value, lambda_runtime::Error> {
    let opts = RunOptions {
        holder: format!("lambda:{}", event.context.request_id),
        deadline: UnixMillis(event.context.deadline),
        drain: false,
        stop: None,
    };
    match orchestrator.run(&opts).await {
        Ok(report) => Ok(serde_json::to_value(report)?),
        Err(RunError::LeaseHeld(why)) => {
            tracing::info!(%why, "another run holds the lease; nothing to do");
            Ok(json!({ "skipped": why }))
        }
        Err(e) => Err(e.into()),
    }
}
