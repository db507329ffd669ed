//! `paceline status`: queue and DLQ depths, circuit, lease and quota usage of a lane.

use paceline_shared::ports::{JobQueue, StateStore};
use serde::Serialize;

use crate::commands::ConfigArg;
use crate::lane::{load_config, open_store};

/// Show the lane's state.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Print as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct TierUsage {
    tier: String,
    limit: u64,
    used: Option<u64>,
    resets_at: Option<String>,
}

#[derive(Serialize)]
struct Status {
    queue: paceline_shared::ports::QueueDepth,
    circuit: paceline_shared::breaker::Circuit,
    lease: Option<paceline_shared::ports::Lease>,
    cool_down_until: Option<String>,
    tiers: Vec<TierUsage>,
}

impl StatusArgs {
    /// # Errors
    /// Bad config or an unreadable store.
    pub async fn run(self) -> anyhow::Result<()> {
        let config = load_config(&self.config.config)?;
        let store = open_store(&config)?;
        let now = paceline_shared::time::system_now();
        let mut tiers = Vec::new();
        for tier in &config.quota.tiers {
            let (used, resets_at) = if tier.is_calendar() {
                let used = store.load_usage(&[tier.usage_key(config.quota.zone, now)]).await?[0];
                (Some(used), Some(tier.window_at(config.quota.zone, now).1.to_rfc3339()))
            } else {
                (None, None)
            };
            tiers.push(TierUsage { tier: tier.to_string(), limit: tier.limit, used, resets_at });
        }
        let cool_down = store.cool_down().await?;
        let status = Status {
            queue: store.depth().await?,
            circuit: store.circuit().await?,
            lease: store.lease().await?.filter(|l| l.expires_at > now),
            cool_down_until: (cool_down > now).then(|| cool_down.to_rfc3339()),
            tiers,
        };
        if self.json {
            println!("{}", serde_json::to_string_pretty(&status)?);
            return Ok(());
        }
        println!("queue: {} ready, {} in flight or delayed, {} dead-lettered", status.queue.visible, status.queue.not_visible, status.queue.dead);
        let c = &status.circuit;
        let since = if c.since.0 == 0 { String::from("the start") } else { c.since.to_rfc3339() };
        println!("circuit: {} since {} (epoch {}){}", c.status, since, c.epoch, if c.reason.is_empty() { String::new() } else { format!(": {}", c.reason) });
        match &status.lease {
            Some(l) => println!("lease: held by {} (epoch {}) until {}", l.holder, l.epoch, l.expires_at),
            None => println!("lease: free"),
        }
        if let Some(until) = &status.cool_down_until {
            println!("cool-down until {until}");
        }
        for t in &status.tiers {
            match (t.used, &t.resets_at) {
                (Some(used), Some(reset)) => println!("tier {}: {used}/{} used, resets at {reset}", t.tier, t.limit),
                _ => println!("tier {}: rolling window, paced in memory", t.tier),
            }
        }
        Ok(())
    }
}
