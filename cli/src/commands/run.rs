//! `paceline run`: the orchestrator and workers in this process, on the embedded store.

use std::time::Duration;

use crate::commands::ConfigArg;
use crate::stack::{load_config, EmbeddedStack};
use crate::summary::Summary;

/// Run the lane: pace jobs from the queue to the API until stopped.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Exit once the queue is empty and nothing is in flight.
    #[arg(long)]
    pub drain: bool,
    /// Stop after this long (e.g. 90s, 10m).
    #[arg(long = "for", value_parser = humantime::parse_duration)]
    pub for_at_most: Option<Duration>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

impl RunArgs {
    /// # Errors
    /// Bad config, a held database, or a failed run.
    pub async fn run(self) -> anyhow::Result<()> {
        let config = load_config(&self.config.config)?;
        let lane = EmbeddedStack::open(&config)?;
        let outcome = lane.run(self.drain, self.for_at_most, !self.json).await?;
        let summary = Summary::new(&outcome);
        if self.json {
            println!("{}", serde_json::to_string_pretty(&summary)?);
        } else {
            print!("{}", summary.render());
        }
        Ok(())
    }
}
