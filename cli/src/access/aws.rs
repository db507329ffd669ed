//! The AWS side of the operator commands (the `aws` feature, on by default): a stack's
//! resources named by its config, a CloudFormation stack's outputs and flags, reached
//! with the SDK's credentials.

use std::sync::Arc;

use anyhow::{bail, Context};
use paceline_shared::adapters::aws::{load_sdk_config_with, AwsAdapters, AwsNames, LambdaInvoker};
use paceline_shared::config::{AwsBackend, Config, LanesConfig};
use paceline_shared::lambda_env::Env;
use paceline_shared::ports::JobQueue;
use paceline_shared::quota::Quota;

use super::{configured_lanes, OperatorStack, StackArgs, ONE_LANE};

/// A deployed orchestrator function, for `kick` and to read the lanes it runs.
pub struct OrchestratorFunction {
    invoker: LambdaInvoker,
}

impl OrchestratorFunction {
    /// Starts a run now with `event` (as the schedule's kick does).
    ///
    /// # Errors
    /// Lambda refused the invoke.
    pub async fn kick(&self, event: String) -> anyhow::Result<()> {
        Ok(self.invoker.invoke_event(event).await?)
    }
}

/// Opens the AWS stack `aws` names (with `config`, if there is one), as `args` override.
pub(super) async fn open(args: &StackArgs, config: Option<Config>, mut aws: AwsBackend) -> anyhow::Result<OperatorStack> {
    // Where and as whom to reach AWS comes first: the stack is read with it.
    if args.region.is_some() {
        aws.region.clone_from(&args.region);
    }
    if args.profile.is_some() {
        aws.profile.clone_from(&args.profile);
    }
    let sdk = load_sdk_config_with(aws.profile.as_deref(), aws.region.as_deref(), aws.endpoint_url.as_deref()).await;
    ensure_credentials(&sdk, aws.profile.as_deref()).await?;
    if let Some(stack) = &args.stack {
        fill_from_stack(&sdk, stack, &mut aws).await?;
    }
    apply_overrides(args, &mut aws)?;
    let names = AwsNames {
        queue_url: aws.queue_url,
        dlq_url: aws.dlq_url,
        table: aws.table,
        worker_function: aws.worker_function.unwrap_or_default(),
        worker_dlq_url: aws.worker_dlq_url,
    };
    let adapters = AwsAdapters::new(&sdk, &names, None);
    let orchestrator = aws.orchestrator_function.map(|f| OrchestratorFunction { invoker: adapters.invoker.for_function(f) }).ok_or_else(|| {
        "no orchestrator function is named: set orchestrator_function in [backend], --orchestrator-function or PACELINE_ORCHESTRATOR_FUNCTION".to_owned()
    });
    let (lanes, shard_urls) = match configured_lanes(config.as_ref()) {
        Some(lanes) => (Ok(lanes), Vec::new()),
        None => deployed_lanes(&orchestrator).await,
    };
    let shard_queues = shard_urls.iter().map(|url| Arc::new(adapters.queue.at(url)) as Arc<dyn JobQueue>).collect();
    let store = Arc::new(adapters.store);
    Ok(OperatorStack {
        config,
        queues: Arc::new(adapters.queue),
        state: store.clone(),
        stores: store.clone(),
        orchestrator,
        lanes,
        embedded: None,
        shard_queues,
        documents: Some(store),
    })
}

/// The lanes an AWS stack's orchestrator function is deployed with (its `PACELINE_LANES`
/// and `PACELINE_TIERS`), or why there are none; and each shard's jobs queue in a stack
/// of shards (its `PACELINE_SHARD_QUEUES`; none otherwise).
async fn deployed_lanes(orchestrator: &Result<OrchestratorFunction, String>) -> (Result<(LanesConfig, Quota), String>, Vec<String>) {
    let env = match orchestrator {
        Ok(orchestrator) => orchestrator.invoker.environment().await.map_err(|e| format!("cannot read the orchestrator function's lanes: {e}")),
        Err(_) => Err(format!("{ONE_LANE} (nor is an orchestrator function named, whose lanes could be read)")),
    };
    let env = match env {
        Ok(env) => env,
        Err(why) => return (Err(why), Vec::new()),
    };
    let shard_urls = env.get("PACELINE_SHARD_QUEUES").and_then(|urls| serde_json::from_str::<Vec<String>>(urls).ok()).unwrap_or_default();
    let get = |name: &str| env.get(name).cloned();
    let env = Env::new(&get);
    let lanes = env.quota().and_then(|quota| {
        env.lanes(&quota)?.map(|lanes| (lanes, quota)).ok_or_else(|| "this stack runs one lane, `default` (its orchestrator has no PACELINE_LANES)".to_owned())
    });
    (lanes, shard_urls)
}

/// Fails with a plain message when the SDK's provider chain finds no credentials, rather
/// than with the SDK's internals at the first request.
async fn ensure_credentials(sdk: &aws_config::SdkConfig, profile: Option<&str>) -> anyhow::Result<()> {
    use aws_credential_types::provider::{error::CredentialsError, ProvideCredentials as _};
    let advice = "run `aws configure` or `aws sso login`, set AWS_PROFILE, or pass --profile";
    let Some(provider) = sdk.credentials_provider() else { bail!("no AWS credentials found (no credentials provider is configured): {advice}") };
    match provider.provide_credentials().await {
        Ok(_) => Ok(()),
        Err(CredentialsError::CredentialsNotLoaded(_)) => {
            let profile = profile.map(str::to_owned).or_else(|| std::env::var("AWS_PROFILE").ok()).unwrap_or_else(|| "default".into());
            bail!(
                "no AWS credentials found (looked for AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, profile `{profile}` in ~/.aws/credentials and \
                 ~/.aws/config, SSO, web identity and a container or instance role): {advice}"
            )
        }
        Err(e) => bail!("cannot load AWS credentials: {}", paceline_shared::error_chain(&e)),
    }
}

/// Takes the resource names from a stack's outputs (as `infra/template.yaml` names them).
async fn fill_from_stack(sdk: &aws_config::SdkConfig, stack: &str, aws: &mut AwsBackend) -> anyhow::Result<()> {
    let described = aws_sdk_cloudformation::Client::new(sdk)
        .describe_stacks()
        .stack_name(stack)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot read stack {stack}: {} (check its name, region and your credentials)", paceline_shared::error_chain(&e)))?;
    let outputs: std::collections::BTreeMap<&str, &str> =
        described.stacks().iter().flat_map(|s| s.outputs()).filter_map(|o| Some((o.output_key()?, o.output_value()?))).collect();
    let get = |key: &str| outputs.get(key).map(|v| (*v).to_owned());
    let required = |key: &str| get(key).with_context(|| format!("stack {stack} has no output {key}: is it a Paceline stack (infra/template.yaml)?"));
    aws.queue_url = required("JobsQueueUrl")?;
    aws.dlq_url = required("JobsDlqUrl")?;
    aws.table = required("StateTableName")?;
    aws.worker_dlq_url = get("WorkerDlqUrl").or(aws.worker_dlq_url.take());
    aws.orchestrator_function = get("OrchestratorFunctionName").or(aws.orchestrator_function.take());
    aws.worker_function = get("WorkerFunctionName").or(aws.worker_function.take());
    Ok(())
}

/// Applies the flags (and their variables) over `aws`, and checks nothing is missing.
fn apply_overrides(args: &StackArgs, aws: &mut AwsBackend) -> anyhow::Result<()> {
    let overrides = [(&mut aws.queue_url, &args.queue_url), (&mut aws.dlq_url, &args.dlq_url), (&mut aws.table, &args.table)];
    for (field, value) in overrides {
        if let Some(value) = value {
            field.clone_from(value);
        }
    }
    if args.worker_dlq_url.is_some() {
        aws.worker_dlq_url.clone_from(&args.worker_dlq_url);
    }
    if args.orchestrator_function.is_some() {
        aws.orchestrator_function.clone_from(&args.orchestrator_function);
    }
    let missing: Vec<&str> = [("--queue-url", &aws.queue_url), ("--dlq-url", &aws.dlq_url), ("--table", &aws.table)]
        .into_iter()
        .filter(|(_, v)| v.is_empty())
        .map(|(flag, _)| flag)
        .collect();
    if !missing.is_empty() {
        bail!(
            "an AWS stack needs {} (--stack, flags, PACELINE_QUEUE_URL / PACELINE_DLQ_URL / PACELINE_TABLE, or [backend] kind = \"aws\" in {})",
            missing.join(", "),
            args.config.display()
        );
    }
    Ok(())
}
