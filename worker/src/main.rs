//! The worker Lambda's entry point: read settings, build clients once, serve.

use lambda_runtime::{service_fn, LambdaEvent};
use paceline_shared::lambda_env::{cold_start, Env};
use paceline_worker::lambda;
use secrecy::ExposeSecret;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    // JSON or text and the level as the function's logging configuration sets them
    // (AWS_LAMBDA_LOG_FORMAT, AWS_LAMBDA_LOG_LEVEL).
    lambda_runtime::tracing::init_default_subscriber();
    let sdk = paceline_shared::adapters::aws::load_sdk_config().await;
    let from_process = |name: &str| std::env::var(name).ok();
    let secrets = cold_start(lambda::ApiSecrets::fetch(&Env::new(&from_process), &sdk).await).await?;
    let get = |name: &str| secrets.value(name).map(|s| s.expose_secret().to_owned()).or_else(|| std::env::var(name).ok());
    let function = cold_start(lambda::function_from_env(&Env::new(&get), &sdk, secrets.clone())).await?;
    let stack = Env::new(&get).stack_name();
    lambda_runtime::run(service_fn(|event: LambdaEvent<serde_json::Value>| lambda::handle(event, &function, &stack))).await
}
