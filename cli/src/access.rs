//! What the operator commands act on: a stack's queue, DLQs and state, on the embedded
//! store or on AWS. The config file or a CloudFormation stack's outputs name them;
//! flags and `PACELINE_*` variables override (and, with no config file, are enough on
//! their own for an AWS stack).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use paceline_shared::adapters::aws::{load_sdk_config_with, AwsAdapters, AwsNames, LambdaInvoker};
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::config::{AwsBackend, Backend, Config, CoolDownScope, LanesConfig};
use paceline_shared::keys::StoreScope;
use paceline_shared::lambda_env::Env;
use paceline_shared::lane::LaneId;
use paceline_shared::ports::{DeadLetterQueues, QueueDepth, ScopedStores, StateStore};
use paceline_shared::quota::Quota;

use crate::stack::{load_config_for_operations, open_store, IfMissing};

/// Where the stack is: `--config`, and AWS names that override it.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Where the stack is")]
pub struct StackArgs {
    /// The stack's config file.
    #[arg(long, short, global = true, env = "PACELINE_CONFIG", default_value = "paceline.toml")]
    pub config: PathBuf,
    /// A deployed stack of `infra/template.yaml`, whose outputs name the AWS resources.
    #[arg(long, global = true, env = "PACELINE_STACK")]
    pub stack: Option<String>,
    /// The jobs queue URL (an AWS stack; overrides the config file and the stack).
    #[arg(long, global = true, env = "PACELINE_QUEUE_URL")]
    pub queue_url: Option<String>,
    /// The jobs DLQ URL.
    #[arg(long, global = true, env = "PACELINE_DLQ_URL")]
    pub dlq_url: Option<String>,
    /// The worker's DLQ URL (its Lambda on-failure destination).
    #[arg(long, global = true, env = "PACELINE_WORKER_DLQ_URL")]
    pub worker_dlq_url: Option<String>,
    /// The DynamoDB state table.
    #[arg(long, global = true, env = "PACELINE_TABLE")]
    pub table: Option<String>,
    /// The orchestrator function, for `kick`.
    #[arg(long, global = true, env = "PACELINE_ORCHESTRATOR_FUNCTION")]
    pub orchestrator_function: Option<String>,
    /// The AWS region (overrides `[backend] region` and `AWS_REGION`).
    #[arg(long, global = true)]
    pub region: Option<String>,
    /// The AWS profile of the shared config and credentials files (overrides
    /// `[backend] profile` and `AWS_PROFILE`).
    #[arg(long, global = true)]
    pub profile: Option<String>,
}

/// A stack opened for an operator command.
pub struct OperatorStack {
    /// The config file, when there is one (quota tiers for `status`).
    pub config: Option<Config>,
    pub queues: Arc<dyn DeadLetterQueues>,
    pub state: Arc<dyn StateStore>,
    /// Each lane's state and the stack's, in the stack's one store.
    pub stores: Arc<dyn ScopedStores>,
    /// How to start a run now, or why there is none.
    pub orchestrator: Result<LambdaInvoker, String>,
    /// The lanes the stack runs and the quota they share: the config's `[lanes]` and
    /// `[quota]`, or an AWS stack's as its orchestrator function is deployed with them
    /// (`PACELINE_LANES`, `PACELINE_TIERS`); or why there are none.
    pub lanes: Result<(LanesConfig, Quota), String>,
    /// The embedded store, for what only it can count (each lane's backlog).
    pub embedded: Option<Arc<EmbeddedStore>>,
}

/// Why a stack whose config has no `[lanes]` has one lane.
const ONE_LANE: &str = "this stack has no [lanes] in its config: its one lane is `default`";

impl OperatorStack {
    /// The embedded stack of `config` in `store` (the store a run in this process uses,
    /// or one opened beside it).
    #[must_use]
    pub fn embedded(config: Config, store: Arc<EmbeddedStore>) -> Self {
        Self {
            lanes: configured_lanes(Some(&config)).ok_or_else(|| ONE_LANE.to_owned()),
            config: Some(config),
            queues: store.clone(),
            state: store.clone(),
            stores: store.clone(),
            orchestrator: Err("an embedded stack has no orchestrator function: `paceline run` runs one in this process".into()),
            embedded: Some(store),
        }
    }

    /// The stack's lanes and each lane's state.
    ///
    /// # Errors
    /// A stack of one lane (no `[lanes]`), or deployed lanes that cannot be read.
    pub fn lanes(&self) -> anyhow::Result<(&LanesConfig, &Arc<dyn ScopedStores>)> {
        match &self.lanes {
            Ok((lanes, _)) => Ok((lanes, &self.stores)),
            Err(why) => bail!("{why}"),
        }
    }

    /// Whether the stack runs lanes.
    #[must_use]
    pub fn has_lanes(&self) -> bool {
        self.lanes.is_ok()
    }

    /// The quota the lanes share, in a stack of lanes.
    #[must_use]
    pub fn shared_quota(&self) -> Option<&Quota> {
        self.lanes.as_ref().ok().map(|(_, quota)| quota)
    }

    /// Each lane's jobs on the queue (ready, in flight, dead), where the store can count
    /// them by lane (the embedded one; SQS counts only the whole queue).
    ///
    /// # Errors
    /// An unreadable store.
    pub fn backlog_by_lane(&self) -> anyhow::Result<Option<BTreeMap<LaneId, QueueDepth>>> {
        Ok(self.embedded.as_ref().map(|store| store.depth_by_lane()).transpose()?)
    }

    /// The stack's own state where a 429 cools every lane (`[lanes] on_429 = "stack"`).
    #[must_use]
    pub fn stack_cool_down(&self) -> Option<Arc<dyn StateStore>> {
        let cools_stack = self.lanes.as_ref().is_ok_and(|(lanes, _)| lanes.on_429 == CoolDownScope::Stack);
        cools_stack.then(|| self.stores.scoped(&StoreScope::Stack))
    }

    /// The state of `lane`, or of the default lane (the whole stack's, without `[lanes]`).
    ///
    /// # Errors
    /// A lane other than `default` in a stack without lanes.
    pub fn lane_state(&self, lane: Option<&LaneId>) -> anyhow::Result<Arc<dyn StateStore>> {
        match lane.filter(|lane| !lane.is_default()) {
            None => Ok(self.state.clone()),
            Some(lane) => Ok(self.lanes()?.1.scoped(&StoreScope::Lane(lane.clone()))),
        }
    }
}

/// The lanes of `config`, with the quota they share.
fn configured_lanes(config: Option<&Config>) -> Option<(LanesConfig, Quota)> {
    let config = config?;
    Some((config.lanes.clone()?, config.quota.clone()))
}

/// The lanes an AWS stack's orchestrator function is deployed with (its `PACELINE_LANES`
/// and `PACELINE_TIERS`), or why there are none.
async fn deployed_lanes(orchestrator: &Result<LambdaInvoker, String>) -> Result<(LanesConfig, Quota), String> {
    let orchestrator = orchestrator.as_ref().map_err(|_| format!("{ONE_LANE} (nor is an orchestrator function named, whose lanes could be read)"))?;
    let env = orchestrator.environment().await.map_err(|e| format!("cannot read the orchestrator function's lanes: {e}"))?;
    let get = |name: &str| env.get(name).cloned();
    let env = Env::new(&get);
    let quota = env.quota()?;
    env.lanes(&quota)?.map(|lanes| (lanes, quota)).ok_or_else(|| "this stack runs one lane, `default` (its orchestrator has no PACELINE_LANES)".to_owned())
}

impl StackArgs {
    fn any_aws_override(&self) -> bool {
        [&self.stack, &self.queue_url, &self.dlq_url, &self.worker_dlq_url, &self.table, &self.orchestrator_function].iter().any(|v| v.is_some())
    }

    /// The config's AWS names to start from; `None` for an embedded stack.
    fn aws_base(&self, config: Option<&Config>) -> Option<AwsBackend> {
        match config.map(|c| &c.backend) {
            Some(Backend::Aws(aws)) => Some(aws.clone()),
            Some(Backend::Embedded { .. }) if !self.any_aws_override() => None,
            _ => Some(AwsBackend::default()),
        }
    }

    /// Applies the flags (and their variables) over `aws`, and checks nothing is missing.
    fn apply_overrides(&self, aws: &mut AwsBackend) -> anyhow::Result<()> {
        let overrides = [(&mut aws.queue_url, &self.queue_url), (&mut aws.dlq_url, &self.dlq_url), (&mut aws.table, &self.table)];
        for (field, value) in overrides {
            if let Some(value) = value {
                field.clone_from(value);
            }
        }
        if self.worker_dlq_url.is_some() {
            aws.worker_dlq_url.clone_from(&self.worker_dlq_url);
        }
        if self.orchestrator_function.is_some() {
            aws.orchestrator_function.clone_from(&self.orchestrator_function);
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
                self.config.display()
            );
        }
        Ok(())
    }

    /// Opens the stack to inspect or repair it: an embedded database must exist already
    /// (a mistyped path is an error, not a new empty stack).
    ///
    /// # Errors
    /// A bad or missing config (when no AWS names are given), missing AWS names, or an
    /// embedded database that is missing or cannot be opened.
    pub async fn open(&self) -> anyhow::Result<OperatorStack> {
        self.open_with(IfMissing::Refuse).await
    }

    /// Opens the stack to feed it: an embedded database is created where there is none.
    ///
    /// # Errors
    /// As [`StackArgs::open`], but for a missing embedded database.
    pub async fn open_to_enqueue(&self) -> anyhow::Result<OperatorStack> {
        self.open_with(IfMissing::Create).await
    }

    async fn open_with(&self, if_missing: IfMissing) -> anyhow::Result<OperatorStack> {
        let config = if self.config.exists() {
            Some(load_config_for_operations(&self.config)?)
        } else if !self.any_aws_override() {
            anyhow::bail!("config {} not found: pass --config FILE, or the AWS names (--stack, or --queue-url, --dlq-url and --table)", self.config.display());
        } else {
            None
        };
        match self.aws_base(config.as_ref()) {
            None => {
                let config = config.context("an embedded stack needs its config file")?;
                let store = open_store(&config, if_missing)?;
                Ok(OperatorStack::embedded(config, store))
            }
            Some(mut aws) => {
                // Where and as whom to reach AWS comes first: the stack is read with it.
                if self.region.is_some() {
                    aws.region.clone_from(&self.region);
                }
                if self.profile.is_some() {
                    aws.profile.clone_from(&self.profile);
                }
                let sdk = load_sdk_config_with(aws.profile.as_deref(), aws.region.as_deref(), aws.endpoint_url.as_deref()).await;
                ensure_credentials(&sdk, aws.profile.as_deref()).await?;
                if let Some(stack) = &self.stack {
                    fill_from_stack(&sdk, stack, &mut aws).await?;
                }
                self.apply_overrides(&mut aws)?;
                let names = AwsNames {
                    queue_url: aws.queue_url,
                    dlq_url: aws.dlq_url,
                    table: aws.table,
                    worker_function: aws.worker_function.unwrap_or_default(),
                    worker_dlq_url: aws.worker_dlq_url,
                };
                let adapters = AwsAdapters::new(&sdk, &names, None);
                let orchestrator = aws.orchestrator_function.map(|f| adapters.invoker.for_function(f)).ok_or_else(|| {
                    "no orchestrator function is named: set orchestrator_function in [backend], --orchestrator-function or PACELINE_ORCHESTRATOR_FUNCTION"
                        .to_owned()
                });
                let lanes = match configured_lanes(config.as_ref()) {
                    Some(lanes) => Ok(lanes),
                    None => deployed_lanes(&orchestrator).await,
                };
                let store = Arc::new(adapters.store);
                Ok(OperatorStack { config, queues: Arc::new(adapters.queue), state: store.clone(), stores: store, orchestrator, lanes, embedded: None })
            }
        }
    }
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
