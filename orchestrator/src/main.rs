//! The orchestrator Lambda's entry point: read settings, build clients once, serve.

use lambda_runtime::{service_fn, LambdaEvent};
use paceline_orchestrator::lambda;
use paceline_shared::lambda_env::{cold_start, Env};

// One thread: at 128 MB Lambda gives a fraction of a vCPU, and the dispatch loop's work is
// waiting; a single-threaded scheduler cut its CPU per job from about 69 to 40 us at
// 1,000 jobs/s (see docs/benchmarks.md).
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), lambda_runtime::Error> {
    // JSON or text and the level as the function's logging configuration sets them
    // (AWS_LAMBDA_LOG_FORMAT, AWS_LAMBDA_LOG_LEVEL).
    lambda_runtime::tracing::init_default_subscriber();
    let sdk = paceline_shared::adapters::aws::load_sdk_config().await;
    let get = |name: &str| std::env::var(name).ok();
    let function = cold_start(lambda::from_env(&Env::new(&get), &sdk, None)).await?;
    lambda_runtime::run(service_fn(|event: LambdaEvent<lambda::Trigger>| lambda::handle(event, &function))).await
}
