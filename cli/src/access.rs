//! What the operator commands act on: a stack's queue, DLQs and state, on the embedded
//! store or on AWS. The config file or a CloudFormation stack's outputs name them;
//! flags and `PACELINE_*` variables override (and, with no config file, are enough on
//! their own for an AWS stack).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};

#[cfg(feature = "aws")]
mod aws;
// Built without the `aws` feature, the same names refuse an AWS stack.
#[cfg(not(feature = "aws"))]
#[path = "access/no_aws.rs"]
mod aws;
pub use aws::OrchestratorFunction;
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::config::{AwsBackend, Backend, Config, CoolDownScope, LanesConfig};
use paceline_shared::homes::{LaneHomes, MoveProblem};
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::ports::{read_document, write_document, DeadLetterQueues, JobQueue, QueueDepth, ScopedStores, StackDocument, StackDocuments, StateStore};
use paceline_shared::quota::Quota;
use paceline_shared::time::system_now;

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
    pub orchestrator: Result<OrchestratorFunction, String>,
    /// The lanes the stack runs and the quota they share: the config's `[lanes]` and
    /// `[quota]`, or an AWS stack's as its orchestrator function is deployed with them
    /// (`PACELINE_LANES`, `PACELINE_TIERS`); or why there are none.
    pub lanes: Result<(LanesConfig, Quota), String>,
    /// The embedded store, for what only it can count (each lane's backlog).
    pub embedded: Option<Arc<EmbeddedStore>>,
    /// An AWS stack of several shards: each shard's jobs queue, by index (empty: one
    /// shard, `queues`). A job goes to its lane's shard's.
    pub shard_queues: Vec<Arc<dyn JobQueue>>,
    /// Where a stack of shards keeps its documents (where its lanes live): its table.
    pub documents: Option<Arc<dyn StackDocuments>>,
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
            shard_queues: Vec::new(),
            documents: None,
        }
    }

    /// How many shards the stack has (1 unless it is an AWS stack of shards).
    #[must_use]
    pub fn shards(&self) -> usize {
        self.shard_queues.len().max(1)
    }

    /// Where the stack's lanes live, and the version read (`None`: no lane was ever
    /// moved, or a stack of one shard).
    ///
    /// # Errors
    /// The stack's table could not be read.
    pub async fn lane_homes(&self) -> anyhow::Result<(LaneHomes, Option<u64>)> {
        let Some(documents) = self.documents.as_ref().filter(|_| self.shards() > 1) else { return Ok((LaneHomes::default(), None)) };
        let read = read_document::<LaneHomes>(documents.as_ref(), StackDocument::LaneHomes).await.context("reading where the stack's lanes live")?;
        Ok(read.map_or((LaneHomes::default(), None), |(homes, version)| (homes, Some(version))))
    }

    /// Moves lane `lane` to shard `to`: the shard it leaves sends its jobs on and hands
    /// its pace over, and `to` takes it up once that is done. Returns the shard it left.
    ///
    /// # Errors
    /// A stack of one shard, a shard that does not exist, the lane's own shard, or the
    /// table could not be read or written.
    pub async fn move_lane(&self, lane: &LaneId, to: usize) -> anyhow::Result<usize> {
        let shards = self.shards();
        let Some(documents) = self.documents.as_ref().filter(|_| shards > 1) else { bail!("{}", MoveProblem::OneShard) };
        // Written over the version read: a move another operator made meanwhile is read
        // again, never overwritten.
        for _ in 0..5 {
            let (homes, version) = self.lane_homes().await?;
            let moved = homes.with_move(lane, to, shards, system_now())?;
            if write_document(documents.as_ref(), StackDocument::LaneHomes, &moved, version).await.context("writing where the stack's lanes live")? {
                return Ok(homes.home_of(lane, shards));
            }
        }
        bail!("where the lanes live kept changing while lane {lane} was moved: try again")
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
            Some(aws) => aws::open(self, config, aws).await,
        }
    }
}
