//! `paceline status`: per tier used / limit / when it frees up or resets; the circuit (state, since when,
//! why, epoch); the lease holder; queue and DLQ depths; the rate the lane goes at and why
//! (the provider's rate-limit headers may call for less than the tiers); and about how
//! long the backlog takes at the quota. On the embedded store or AWS alike.

use std::sync::Arc;
use std::time::Duration;

use paceline_shared::adaptive::{EffectiveRate, ProviderReading, RateReason};
use paceline_shared::breaker::Circuit;
use paceline_shared::dlq::DlqSource;
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::pacer::PacerState;
use paceline_shared::ports::{load_calendar_usage, Lease, QueueDepth, StateStore};
use paceline_shared::quota::Quota;
use paceline_shared::time::{system_now, UnixMillis};
use serde::Serialize;

use crate::access::{OperatorStack, StackArgs};
use crate::commands::lanes::{lane_views, print_table, LaneView};

/// Show the stack's state (with `[lanes]`: the shared tiers and the lanes), or one lane's.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// One lane's state: its tiers, circuit, cool-down, rate and backlog.
    #[arg(long, value_name = "ID")]
    pub lane: Option<LaneId>,
    /// Print as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
pub struct TierUsage {
    pub tier: String,
    pub limit: u64,
    /// Used in the current window: a calendar tier's count, or a rolling tier's from
    /// the pacer's last snapshot (written every flush and at the end of a run); `None`
    /// for a rolling tier no run has paced yet.
    pub used: Option<u64>,
    /// Calendar tiers: when the window resets.
    pub resets_at: Option<String>,
    /// Rolling tiers: when the oldest unit in the window leaves it (none while empty).
    pub next_unit_frees_at: Option<String>,
}

/// The rate the last run went at, as it saved it with the pacer.
#[derive(Serialize)]
pub struct RateStatus {
    pub per_second: f64,
    pub configured_per_second: f64,
    /// Why, in words.
    pub reason: String,
    /// Why, as data.
    pub detail: RateReason,
    pub as_of: String,
}

/// What the provider's rate-limit headers last said.
#[derive(Serialize)]
pub struct ReadingStatus {
    pub limit: u64,
    pub remaining: u64,
    pub window_seconds: Option<f64>,
    pub resets_at: String,
    pub read_at: String,
}

impl From<ProviderReading> for ReadingStatus {
    fn from(r: ProviderReading) -> Self {
        Self {
            limit: r.limit,
            remaining: r.remaining,
            window_seconds: r.window_ms.map(|ms| ms as f64 / 1000.0),
            resets_at: r.resets_at.to_rfc3339(),
            read_at: r.at.to_rfc3339(),
        }
    }
}

#[derive(Serialize)]
pub struct Status {
    /// The lane shown (`status --lane`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// The queue's depths (of the lane's jobs, for one lane, where the store counts them
    /// by lane).
    pub queue: QueueDepth,
    /// `status --lane` on SQS, which counts no lane apart: `queue` is the whole stack's.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub queue_is_the_stacks: bool,
    /// In a stack of shards: each shard's jobs queue (`queue` adds them up, where it is
    /// the whole stack's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<Vec<ShardQueue>>,
    /// The worker's DLQ, where the lane has one.
    pub worker_dead: Option<u64>,
    /// The lane's circuit (none for a stack of many lanes: each has its own, in `lanes`).
    #[serde(serialize_with = "circuit_view")]
    pub circuit: Option<Circuit>,
    #[serde(serialize_with = "lease_view")]
    pub lease: Option<Lease>,
    pub cool_down_until: Option<String>,
    /// None before a run saved one.
    pub effective_rate: Option<RateStatus>,
    pub provider_reading: Option<ReadingStatus>,
    pub tiers: Vec<TierUsage>,
    /// The margin added to rolling windows: as configured, and as 429s widened it.
    pub safety_margin: Option<MarginStatus>,
    /// Seconds the waiting jobs take at the quota (one unit each), when the quota is known.
    pub drain_estimate_seconds: Option<u64>,
    /// With `[lanes]`: every lane, the largest backlog first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lanes: Option<Vec<LaneView>>,
}

/// One shard's jobs queue, in a stack of shards.
#[derive(Serialize)]
pub struct ShardQueue {
    pub shard: usize,
    pub visible: u64,
    pub not_visible: u64,
}

/// Each shard's jobs queue in a stack of shards, and the whole stack's (their jobs
/// added up, and the dead letters of the one DLQ they share); `None` with one shard.
async fn shard_queues(stack: &OperatorStack) -> anyhow::Result<Option<(Vec<ShardQueue>, QueueDepth)>> {
    if stack.shards() <= 1 {
        return Ok(None);
    }
    let (mut shards, mut whole) = (Vec::with_capacity(stack.shard_queues.len()), QueueDepth::default());
    for (shard, queue) in stack.shard_queues.iter().enumerate() {
        let depth = queue.depth().await?;
        shards.push(ShardQueue { shard, visible: depth.visible, not_visible: depth.not_visible });
        whole = QueueDepth { visible: whole.visible + depth.visible, not_visible: whole.not_visible + depth.not_visible, dead: depth.dead };
    }
    Ok(Some((shards, whole)))
}

/// The whole stack's queue: the stack's own, or in a stack of shards every shard's.
async fn whole_stack(stack: &OperatorStack, shards: Option<&(Vec<ShardQueue>, QueueDepth)>) -> anyhow::Result<QueueDepth> {
    match shards {
        Some((_, whole)) => Ok(*whole),
        None => Ok(stack.queues.depth().await?),
    }
}

/// How many lanes the text view lists (`--json` has all).
const LANES_SHOWN: usize = 20;

/// The safety margin as `status` shows it.
#[derive(Serialize)]
pub struct MarginStatus {
    pub configured_ms: u64,
    /// What the pacer adds now (more than configured after 429s showed more jitter).
    pub in_use_ms: u64,
}

/// The circuit as `status --json` shows it (times in RFC 3339).
#[derive(Serialize)]
struct CircuitView {
    status: paceline_shared::breaker::CircuitStatus,
    epoch: u64,
    since: String,
    reason: String,
    reopened: u32,
    held: bool,
}

fn circuit_view<S: serde::Serializer>(c: &Option<Circuit>, s: S) -> Result<S::Ok, S::Error> {
    c.as_ref()
        .map(|c| CircuitView { status: c.status, epoch: c.epoch, since: c.since.to_rfc3339(), reason: c.reason.clone(), reopened: c.reopened, held: c.held })
        .serialize(s)
}

/// The lease as `status --json` shows it.
#[derive(Serialize)]
struct LeaseView {
    holder: String,
    epoch: u64,
    expires_at: String,
}

fn lease_view<S: serde::Serializer>(lease: &Option<Lease>, s: S) -> Result<S::Ok, S::Error> {
    lease.as_ref().map(|l| LeaseView { holder: l.holder.clone(), epoch: l.epoch, expires_at: l.expires_at.to_rfc3339() }).serialize(s)
}

impl StatusArgs {
    /// # Errors
    /// A bad lane or an unreadable store.
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open().await?;
        let status = read_status(&stack, self.lane.as_ref(), system_now()).await?;
        if self.json {
            println!("{}", serde_json::to_string_pretty(&status)?);
        } else {
            print_status(&status, system_now());
        }
        Ok(())
    }
}

/// The stack's state at `now` (with `[lanes]` and no `lane`: the shared tiers and every
/// lane), or one lane's: what `status` prints and `serve` answers.
///
/// # Errors
/// A bad lane or an unreadable store.
pub async fn read_status(stack: &OperatorStack, lane: Option<&LaneId>, now: UnixMillis) -> anyhow::Result<Status> {
    let worker_dead = if stack.queues.sources().contains(&DlqSource::Worker) { Some(stack.queues.count(DlqSource::Worker).await?) } else { None };
    let with_lanes = stack.has_lanes();
    let shards = shard_queues(stack).await?;
    let mut queue_is_the_stacks = false;
    let (state, quota, queue, lanes): (Arc<dyn StateStore>, Option<Quota>, QueueDepth, Option<Vec<LaneView>>) = match lane {
        Some(lane) if with_lanes => {
            let (config, _) = stack.lanes()?;
            let state = stack.lane_state(Some(lane))?;
            let quota = config.lane_changed(lane, &state.lane_change().await?.unwrap_or_default())?.quota;
            let queue = match stack.backlog_by_lane()? {
                Some(depths) => depths.get(lane).copied().unwrap_or_default(),
                None => {
                    queue_is_the_stacks = true;
                    whole_stack(stack, shards.as_ref()).await?
                }
            };
            (state, Some(quota), queue, None)
        }
        None if with_lanes => {
            let shared = stack.lanes()?.1.scoped(&StoreScope::Stack);
            let quota = stack.shared_quota().cloned();
            (shared, quota, whole_stack(stack, shards.as_ref()).await?, Some(lane_views(stack).await?))
        }
        lane => {
            let state = stack.lane_state(lane)?;
            (state, stack.config.as_ref().map(|config| config.quota.clone()), stack.queues.depth().await?, None)
        }
    };
    let mut tiers = Vec::new();
    let mut drain_estimate_seconds = None;
    let mut safety_margin = None;
    let snapshot = state.load_pacer().await?;
    let cool_down = state.cool_down().await?;
    let provider_reading = state.provider_reading().await?;
    // A budget the provider set ends at its reset, or when an operator forgot its reading.
    let in_force = |rate: &EffectiveRate| match rate.reason {
        RateReason::ProviderBudget { resets_at, .. } => resets_at > now && provider_reading.is_some(),
        _ => true,
    };
    let effective_rate = snapshot.as_ref().and_then(|s| s.effective_rate.clone()).filter(in_force).map(|rate| RateStatus {
        per_second: (rate.per_second * 100.0).round() / 100.0,
        configured_per_second: rate.configured_per_second,
        reason: rate.reason.to_string(),
        detail: rate.reason,
        as_of: rate.at.to_rfc3339(),
    });
    if let Some(quota) = &quota {
        let calendar_used = load_calendar_usage(state.as_ref(), quota, now).await?;
        let pacer = snapshot.map(|snapshot| PacerState::restored(quota, &snapshot.state));
        let rolling_used = pacer.as_ref().map(|pacer| pacer.usage(quota, now));
        // A run forgets a learned margin whose 429's cool-down an operator cleared.
        let learned = pacer.as_ref().filter(|_| cool_down > UnixMillis(0));
        let in_use = learned.map_or(quota.safety_margin(), |pacer| pacer.safety_margin(quota));
        safety_margin = Some(MarginStatus { configured_ms: millis(quota.safety_margin()), in_use_ms: millis(in_use) });
        for (index, (tier, used)) in quota.tiers().iter().zip(&calendar_used).enumerate() {
            let usage = if tier.is_calendar() {
                TierUsage {
                    tier: tier.to_string(),
                    limit: tier.limit,
                    used: Some(*used),
                    resets_at: Some(tier.window_at(quota.zone(), now).1.to_rfc3339()),
                    next_unit_frees_at: None,
                }
            } else {
                TierUsage {
                    tier: tier.to_string(),
                    limit: tier.limit,
                    used: rolling_used.as_ref().map(|used| used[index]),
                    resets_at: None,
                    next_unit_frees_at: pacer.as_ref().and_then(|pacer| pacer.frees_at(index, now)).map(|at| at.to_rfc3339()),
                }
            };
            tiers.push(usage);
        }
        let waiting = queue.visible + queue.not_visible;
        // Lanes that share no quota drain at their own paces: no estimate for the stack;
        // nor one for a lane whose jobs are not counted apart.
        if !quota.tiers().is_empty() && !queue_is_the_stacks {
            drain_estimate_seconds = Some(quota.drain_estimate(waiting, &calendar_used, now).as_secs());
        }
    }
    // Nothing is dispatched before the cool-down ends.
    let drain_estimate_seconds = drain_estimate_seconds.map(|seconds| seconds + cool_down.since(now).as_secs());
    Ok(Status {
        lane: lane.map(ToString::to_string),
        queue,
        queue_is_the_stacks,
        shards: shards.map(|(shards, _)| shards).filter(|_| lane.is_none() || queue_is_the_stacks),
        worker_dead,
        circuit: if lanes.is_some() { None } else { Some(state.circuit().await?) },
        lease: stack.state.lease().await?.filter(|l| l.expires_at > now),
        cool_down_until: (cool_down > now).then(|| cool_down.to_rfc3339()),
        effective_rate,
        provider_reading: provider_reading.map(ReadingStatus::from),
        tiers,
        safety_margin,
        drain_estimate_seconds,
        lanes,
    })
}

fn print_status(status: &Status, now: UnixMillis) {
    let q = &status.queue;
    let whose = if status.queue_is_the_stacks { " (the whole stack's: SQS counts no lane apart)" } else { "" };
    println!("queue{whose}: {} ready, {} in flight or delayed", q.visible, q.not_visible);
    for shard in status.shards.iter().flatten() {
        println!("  shard {}'s queue: {} ready, {} in flight or delayed", shard.shard, shard.visible, shard.not_visible);
    }
    match status.worker_dead {
        Some(worker) => println!("dead letters: {} in the jobs DLQ, {worker} in the worker DLQ", q.dead),
        None => println!("dead letters: {}", q.dead),
    }
    if let Some(c) = &status.circuit {
        let since = if c.since.0 == 0 {
            String::from("the start")
        } else {
            format!("{} ({} ago)", c.since.to_rfc3339(), humantime::format_duration(Duration::from_secs(now.since(c.since).as_secs())))
        };
        let held = if c.held { ", held by an operator until `paceline circuit close`" } else { "" };
        println!("circuit: {} since {since}, epoch {}{}{held}", c.status, c.epoch, if c.reason.is_empty() { String::new() } else { format!(": {}", c.reason) });
    }
    match &status.lease {
        Some(l) => println!("lease: held by {} (epoch {}) until {}", l.holder, l.epoch, l.expires_at.to_rfc3339()),
        None => println!("lease: free (no run in progress)"),
    }
    if let Some(until) = &status.cool_down_until {
        println!("cool-down until {until} (the API asked us to wait; `paceline circuit close` ends it)");
    }
    if let Some(rate) = &status.effective_rate {
        let of = if rate.per_second < rate.configured_per_second { format!(" of the configured {:.2}/s", rate.configured_per_second) } else { String::new() };
        println!("rate: {:.2}/s{of}: {} (as of {})", rate.per_second, rate.reason, rate.as_of);
    }
    if let Some(r) = &status.provider_reading {
        let window = r.window_seconds.map_or(String::new(), |w| format!(" per {w} s"));
        println!("the provider said at {}: {} of {}{window} left, resets at {}", r.read_at, r.remaining, r.limit, r.resets_at);
    }
    if let Some(margin) = status.safety_margin.as_ref().filter(|m| m.in_use_ms > m.configured_ms) {
        println!(
            "safety margin: {} ms, widened from the configured {} ms by 429s that showed more network jitter (`paceline rate reset` restores it)",
            margin.in_use_ms, margin.configured_ms
        );
    }
    for t in &status.tiers {
        match (t.used, &t.resets_at, &t.next_unit_frees_at) {
            (Some(used), Some(reset), _) => println!("tier {}: {used}/{} used, resets at {reset}", t.tier, t.limit),
            (Some(used), None, Some(frees)) => println!("tier {}: {used}/{} used in the last window, the oldest frees up at {frees}", t.tier, t.limit),
            (Some(used), None, None) => println!("tier {}: {used}/{} used in the last window", t.tier, t.limit),
            (None, ..) => println!("tier {}: rolling window, not used yet", t.tier),
        }
    }
    if let Some(lanes) = &status.lanes {
        if status.tiers.is_empty() {
            println!("no quota shared by the lanes ([quota] left out); {} lane(s):", lanes.len());
        } else {
            println!("the tiers above are shared by every lane; {} lane(s):", lanes.len());
        }
        print_table(&lanes[..lanes.len().min(LANES_SHOWN)]);
        if lanes.len() > LANES_SHOWN {
            println!("... and {} more (`paceline lanes list`, or `status --json`)", lanes.len() - LANES_SHOWN);
        }
    }
    match status.drain_estimate_seconds {
        _ if q.visible + q.not_visible == 0 => println!("backlog: none"),
        Some(seconds) => println!("backlog drains in about {} at the quota", humantime::format_duration(Duration::from_secs(seconds))),
        None => {}
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
