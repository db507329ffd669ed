//! `paceline lanes list|show|set|remove|move`: the lanes of a stack with `[lanes]` (on
//! AWS, the config's or those its orchestrator is deployed with), their settings, backlog
//! and circuit; an operator's change of a lane's tiers, weight or cap on calls in flight,
//! kept in the lane's state (the embedded store, or the stack's DynamoDB table), which a
//! run takes up within `state_refresh` (`remove` forgets it: the config's settings
//! again); and in a stack of shards, a lane's move to another shard.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::bail;
use clap::Subcommand;
use paceline_shared::breaker::CircuitStatus;
use paceline_shared::config::{LaneChange, LanesConfig, OrchestratorConfig};
use paceline_shared::homes::LaneHomes;
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::ports::{QueueDepth, StateStore};
use paceline_shared::quota::Tier;
use paceline_shared::time::system_now;
use serde::Serialize;

use crate::access::{OperatorStack, StackArgs};

/// The lanes of a stack with `[lanes]`.
#[derive(Debug, clap::Args)]
pub struct LanesArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    #[command(subcommand)]
    pub action: LanesAction,
    /// Print as JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum LanesAction {
    /// Every lane the config names, that has jobs or dead letters, or state in the
    /// store: its settings, backlog and circuit, the largest backlog first.
    List,
    /// One lane's settings (the config's, and an operator's change over them), backlog
    /// and circuit.
    Show {
        /// The lane id.
        lane: LaneId,
    },
    /// Change a lane's settings while the stack runs: a run takes it up within
    /// `state_refresh`. What is not given stays as it was.
    Set {
        /// The lane id (a lane the config does not name starts from the `[lanes]`
        /// defaults).
        lane: LaneId,
        /// The lane's own tiers, replacing its configured ones (e.g. `5/s,200/min`).
        #[arg(long, value_delimiter = ',', value_parser = parse_tier)]
        tiers: Option<Vec<Tier>>,
        /// Its share of the shared quota, relative to the others' (over 0).
        #[arg(long)]
        weight: Option<f64>,
        /// The most calls of this lane in flight at once.
        #[arg(long)]
        max_in_flight: Option<u32>,
    },
    /// Forget an operator's change of a lane: the config's settings again (`[lanes.ID]`,
    /// else the `[lanes]` defaults). Its jobs are not touched.
    Remove {
        /// The lane id.
        lane: LaneId,
    },
    /// In a stack of shards: move a lane to another shard. The shard it leaves sends its
    /// jobs on and hands its pace over within a second; the new one takes it up once
    /// the old one can no longer call for it (about 6 s), never over the lane's quota.
    Move {
        /// The lane id.
        lane: LaneId,
        /// The shard it goes to (0 to the stack's shards less one).
        #[arg(long)]
        to_shard: usize,
    },
}

fn parse_tier(text: &str) -> Result<Tier, String> {
    text.trim().parse().map_err(|e| format!("{e}"))
}

/// A lane as `lanes` shows it.
#[derive(Serialize)]
pub struct LaneView {
    pub lane: String,
    /// `config` (`[lanes.ID]`) or `defaults` (`[lanes]`), with `+ operator` when an
    /// operator's change is over them.
    pub settings: String,
    pub weight: f64,
    pub tiers: Vec<String>,
    pub max_in_flight: Option<u32>,
    /// An operator's change in force.
    pub changed: Option<LaneChange>,
    /// Its jobs on the queue, where the store counts them by lane (not SQS).
    pub backlog: Option<QueueDepth>,
    pub circuit: CircuitStatus,
    pub circuit_held: bool,
    pub cool_down_until: Option<String>,
    /// In a stack of shards: the shard it lives on (where its id's hash puts it, or
    /// where an operator moved it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<usize>,
}

impl LaneView {
    /// Lane `lane` of `lanes`, as `store` holds its state.
    pub(crate) async fn read(lanes: &LanesConfig, lane: &LaneId, store: &dyn StateStore, backlog: Option<QueueDepth>) -> anyhow::Result<Self> {
        let changed = store.lane_change().await?;
        let settings = lanes.lane_changed(lane, &changed.clone().unwrap_or_default())?;
        let from = if lanes.named.contains_key(lane) { "config" } else { "defaults" };
        let circuit = store.circuit().await?;
        let cool_down = store.cool_down().await?;
        Ok(Self {
            lane: lane.to_string(),
            settings: if changed.is_some() { format!("{from} + operator") } else { from.to_owned() },
            weight: settings.weight,
            tiers: settings.quota.tiers().iter().map(ToString::to_string).collect(),
            max_in_flight: settings.quota.max_in_flight(),
            changed,
            backlog,
            circuit: circuit.status,
            circuit_held: circuit.held,
            cool_down_until: (cool_down > system_now()).then(|| cool_down.to_rfc3339()),
            shard: None,
        })
    }

    /// The same view of lane `lane` saying which shard it lives on, in a stack of
    /// `shards` shards (none with one).
    fn on_shard(self, lane: &LaneId, shards: usize, homes: &LaneHomes) -> Self {
        Self { shard: (shards > 1).then(|| homes.home_of(lane, shards)), ..self }
    }

    fn print_one(&self) {
        println!("lane {} (settings from {})", self.lane, self.settings);
        println!("  tiers: {}", self.tiers.join(", "));
        println!("  weight: {}", self.weight);
        if let Some(max) = self.max_in_flight {
            println!("  max in flight: {max}");
        }
        match self.backlog {
            Some(backlog) => println!("  backlog: {} ready, {} in flight or delayed, {} dead letters", backlog.visible, backlog.not_visible, backlog.dead),
            None => println!("  backlog: not counted by lane on SQS (`paceline status` counts the whole queue)"),
        }
        if let Some(shard) = self.shard {
            println!("  shard: {shard}");
        }
        println!("  circuit: {}{}", self.circuit, if self.circuit_held { " (held)" } else { "" });
        if let Some(until) = &self.cool_down_until {
            println!("  cool-down until {until}");
        }
    }
}

/// Every lane of `stack` worth showing, the largest backlog first, then by id.
pub(crate) async fn lane_views(stack: &OperatorStack) -> anyhow::Result<Vec<LaneView>> {
    let (lanes, stores) = stack.lanes()?;
    let depths = stack.backlog_by_lane()?;
    let mut ids: BTreeSet<LaneId> = lanes.named.keys().cloned().collect();
    ids.extend(stores.scoped(&StoreScope::Stack).lanes_with_state().await?);
    ids.extend(depths.iter().flat_map(BTreeMap::keys).cloned());
    let homes = stack.lane_homes().await?.0;
    let mut views = Vec::with_capacity(ids.len());
    for id in &ids {
        let scoped = stores.scoped(&StoreScope::Lane(id.clone()));
        views.push(LaneView::read(lanes, id, scoped.as_ref(), backlog_of_lane(depths.as_ref(), id)).await?.on_shard(id, stack.shards(), &homes));
    }
    views.sort_by(|a, b| backlog_of(b).cmp(&backlog_of(a)).then_with(|| a.lane.cmp(&b.lane)));
    Ok(views)
}

/// Lane `lane`'s backlog among `depths` (none counted: `None`).
pub(crate) fn backlog_of_lane(depths: Option<&BTreeMap<LaneId, QueueDepth>>, lane: &LaneId) -> Option<QueueDepth> {
    depths.map(|depths| depths.get(lane).copied().unwrap_or_default())
}

fn backlog_of(view: &LaneView) -> u64 {
    view.backlog.map_or(0, |backlog| backlog.visible + backlog.not_visible)
}

/// The lanes as a table, one line each.
pub(crate) fn print_table(views: &[LaneView]) {
    println!("{:<24} {:>6} {:>9} {:>9} {:>6}  {:<9} tiers", "lane", "weight", "ready", "in flight", "dead", "circuit");
    let count = |count: Option<u64>| count.map_or_else(|| "-".to_owned(), |count| count.to_string());
    for v in views {
        let circuit = if v.cool_down_until.is_some() { format!("{} (cool-down)", v.circuit) } else { v.circuit.to_string() };
        let changed = if v.changed.is_some() { " (changed)" } else { "" };
        println!(
            "{:<24} {:>6} {:>9} {:>9} {:>6}  {:<9} {}{changed}",
            v.lane,
            v.weight,
            count(v.backlog.map(|b| b.visible)),
            count(v.backlog.map(|b| b.not_visible)),
            count(v.backlog.map(|b| b.dead)),
            circuit,
            v.tiers.join(", ")
        );
    }
}

impl LanesArgs {
    /// # Errors
    /// A stack without `[lanes]`, an unreadable store, or a change that cannot be used.
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open().await?;
        let (lanes, stores) = stack.lanes()?;
        let backlog = |lane: &LaneId| -> anyhow::Result<Option<QueueDepth>> { Ok(backlog_of_lane(stack.backlog_by_lane()?.as_ref(), lane)) };
        let refresh =
            humantime::format_duration(stack.config.as_ref().map_or_else(|| OrchestratorConfig::default().state_refresh, |c| c.orchestrator.state_refresh))
                .to_string();
        match self.action {
            LanesAction::List => {
                let views = lane_views(&stack).await?;
                if self.json {
                    println!("{}", serde_json::to_string_pretty(&views)?);
                } else if views.is_empty() {
                    println!("no lanes yet: the config names none and no job has come");
                } else {
                    print_table(&views);
                }
            }
            LanesAction::Show { lane } => {
                let homes = stack.lane_homes().await?.0;
                let view = LaneView::read(lanes, &lane, stores.scoped(&StoreScope::Lane(lane.clone())).as_ref(), backlog(&lane)?).await?;
                let view = view.on_shard(&lane, stack.shards(), &homes);
                if self.json {
                    println!("{}", serde_json::to_string_pretty(&view)?);
                } else {
                    view.print_one();
                }
            }
            LanesAction::Set { lane, tiers, weight, max_in_flight } => {
                let asked = LaneChange { tiers, weight, max_in_flight };
                if asked == LaneChange::default() {
                    bail!("nothing to change: give --tiers, --weight or --max-in-flight");
                }
                let scoped = stores.scoped(&StoreScope::Lane(lane.clone()));
                let change = scoped.lane_change().await?.unwrap_or_default().then(&asked);
                // Checked before it is kept: a run never reads a change it cannot use.
                lanes.lane_changed(&lane, &change)?;
                scoped.set_lane_change(Some(&change)).await?;
                let view = LaneView::read(lanes, &lane, scoped.as_ref(), backlog(&lane)?).await?;
                if self.json {
                    println!("{}", serde_json::to_string_pretty(&view)?);
                } else {
                    view.print_one();
                    println!("a run takes it up within state_refresh ({refresh})");
                }
            }
            LanesAction::Move { lane, to_shard } => {
                let from = stack.move_lane(&lane, to_shard).await?;
                if self.json {
                    println!("{}", serde_json::json!({ "lane": lane.to_string(), "from_shard": from, "to_shard": to_shard }));
                } else {
                    println!(
                        "lane {lane} moves from shard {from} to shard {to_shard}: shard {from} sends its jobs on to shard {to_shard}'s queue and hands its pace over within a second; \
                         shard {to_shard} takes it up about 6 s after the move. `paceline enqueue` sends its jobs to shard {to_shard}'s queue from now on \
                         (producers that route by the lane's hash may go on sending to shard {from}'s, which sends them on)"
                    );
                }
            }
            LanesAction::Remove { lane } => {
                let scoped = stores.scoped(&StoreScope::Lane(lane.clone()));
                let had = scoped.lane_change().await?;
                scoped.set_lane_change(None).await?;
                let from = if lanes.named.contains_key(&lane) { format!("[lanes.{lane}]") } else { "the [lanes] defaults".to_owned() };
                if self.json {
                    println!("{}", serde_json::json!({ "lane": lane.to_string(), "forgotten": had, "settings_from": from }));
                } else if had.is_some() {
                    println!("lane {lane}: the operator's change is forgotten; {from} again, within state_refresh ({refresh})");
                } else {
                    println!("lane {lane} had no operator's change: it runs with {from}");
                }
            }
        }
        Ok(())
    }
}
