//! What the operator commands act on: a lane's queue, DLQs and state, on the embedded
//! store or on AWS. The config file names them; flags and `PACELINE_*` variables
//! override (and, with no config file, are enough on their own for an AWS lane).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use paceline_shared::adapters::aws::{load_sdk_config_with, AwsAdapters, AwsNames, LambdaInvoker};
use paceline_shared::config::{AwsBackend, Backend, Config};
use paceline_shared::ports::{DeadLetterQueues, StateStore};

use crate::lane::{load_config_for_operations, open_store};

/// Where the lane is: `--config`, and AWS names that override it.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LaneArgs {
    /// The lane's config file.
    #[arg(long, short, global = true, env = "PACELINE_CONFIG", default_value = "paceline.toml")]
    pub config: PathBuf,
    /// The jobs queue URL (an AWS lane; overrides the config file).
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
}

/// A lane opened for an operator command.
pub struct OperatorLane {
    /// The config file, when there is one (quota tiers for `status`).
    pub config: Option<Config>,
    pub queues: Arc<dyn DeadLetterQueues>,
    pub state: Arc<dyn StateStore>,
    /// How to start a run now, or why there is none.
    pub orchestrator: Result<LambdaInvoker, String>,
}

impl LaneArgs {
    fn any_aws_override(&self) -> bool {
        [&self.queue_url, &self.dlq_url, &self.worker_dlq_url, &self.table, &self.orchestrator_function].iter().any(|v| v.is_some())
    }

    /// The config's AWS names with the overrides applied; `None` for an embedded lane.
    fn aws_backend(&self, config: Option<&Config>) -> anyhow::Result<Option<AwsBackend>> {
        let mut aws = match config.map(|c| &c.backend) {
            Some(Backend::Aws(aws)) => aws.clone(),
            Some(Backend::Embedded { .. }) if !self.any_aws_override() => return Ok(None),
            _ => AwsBackend::default(),
        };
        let overrides = [
            (&mut aws.queue_url, &self.queue_url),
            (&mut aws.dlq_url, &self.dlq_url),
            (&mut aws.table, &self.table),
        ];
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
                "an AWS lane needs {} (flags, PACELINE_QUEUE_URL / PACELINE_DLQ_URL / PACELINE_TABLE, or [backend] kind = \"aws\" in {}; the stack's outputs list them)",
                missing.join(", "),
                self.config.display()
            );
        }
        Ok(Some(aws))
    }

    /// Opens the lane.
    ///
    /// # Errors
    /// A bad or missing config (when no AWS names are given), missing AWS names, or an
    /// embedded database that cannot be opened.
    pub async fn open(&self) -> anyhow::Result<OperatorLane> {
        let config = if self.config.exists() || !self.any_aws_override() {
            Some(load_config_for_operations(&self.config).with_context(|| "pass --config, or the AWS names (--queue-url, --dlq-url, --table)")?)
        } else {
            None
        };
        match self.aws_backend(config.as_ref())? {
            None => {
                let config = config.context("an embedded lane needs its config file")?;
                let store = open_store(&config)?;
                Ok(OperatorLane {
                    config: Some(config),
                    queues: store.clone(),
                    state: store,
                    orchestrator: Err("an embedded lane has no orchestrator function: `paceline run` runs one in this process".into()),
                })
            }
            Some(aws) => {
                let sdk = load_sdk_config_with(aws.region.as_deref(), aws.endpoint_url.as_deref()).await;
                let names = AwsNames {
                    queue_url: aws.queue_url,
                    dlq_url: aws.dlq_url,
                    table: aws.table,
                    worker_function: aws.worker_function.unwrap_or_default(),
                    worker_dlq_url: aws.worker_dlq_url,
                };
                let adapters = AwsAdapters::new(&sdk, &names, None);
                let orchestrator = aws.orchestrator_function.map(|f| adapters.invoker.for_function(f)).ok_or_else(|| {
                    "no orchestrator function is named: set orchestrator_function in [backend], --orchestrator-function or PACELINE_ORCHESTRATOR_FUNCTION".to_owned()
                });
                Ok(OperatorLane { config, queues: Arc::new(adapters.queue), state: Arc::new(adapters.store), orchestrator })
            }
        }
    }
}
