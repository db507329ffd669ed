//! `paceline rate reset`: forget what the API's rate-limit headers and 429s said, so a
//! run goes at the configured pace again (within `state_refresh`). For a reading an
//! operator knows is wrong: a reset far in the future, a quota that no longer applies.

use clap::Subcommand;
use paceline_shared::lane::LaneId;

use crate::access::StackArgs;
use crate::commands::circuit::clear_provider_limits;

/// The rate the API's answers set.
#[derive(Debug, clap::Args)]
pub struct RateArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    #[command(subcommand)]
    pub action: RateAction,
    /// The lane whose state this acts on, with `[lanes]` (`default` without).
    #[arg(long, global = true, value_name = "ID")]
    pub lane: Option<LaneId>,
    /// Print what was cleared as JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum RateAction {
    /// Forget the provider's last rate-limit reading, any back-off after 429s and the
    /// cool-down: the configured tiers' pace again, until new answers say otherwise.
    /// The circuit is left as it is.
    Reset,
}

impl RateArgs {
    /// # Errors
    /// A bad lane or an unavailable store.
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open().await?;
        let state = stack.lane_state(self.lane.as_ref())?;
        let RateAction::Reset = self.action;
        let cleared = clear_provider_limits(&stack, state.as_ref()).await?;
        if self.json {
            let json = serde_json::json!({
                "cool_down_cleared": cleared.cool_down.map(|until| until.to_rfc3339()),
                "reading_forgotten": cleared.reading,
            });
            println!("{}", serde_json::to_string_pretty(&json)?);
        } else if cleared.cool_down.is_none() && cleared.reading.is_none() {
            println!("no reading stored and no cool-down running: the configured pace already (a run forgets any back-off it still holds)");
        } else {
            cleared.print();
        }
        Ok(())
    }
}
