//! `paceline kick`: start an orchestrator run now instead of at the next scheduled
//! minute (after a redrive, say). A run already going keeps the lease; the kick then
//! returns at once.

use crate::access::StackArgs;

/// Invoke the orchestrator function now.
#[derive(Debug, clap::Args)]
pub struct KickArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

impl KickArgs {
    /// # Errors
    /// No orchestrator function named, or Lambda refused the invoke.
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open().await?;
        let orchestrator = stack.orchestrator.map_err(anyhow::Error::msg)?;
        let event = serde_json::json!({ "source": "paceline.cli", "detail-type": "Kick", "detail": { "at": paceline_shared::time::system_now() } });
        orchestrator.kick(event.to_string()).await?;
        if self.json {
            println!("{}", serde_json::json!({ "kicked": true, "at": paceline_shared::time::system_now().to_rfc3339() }));
        } else {
            println!("orchestrator kicked: a run starts now (unless one is running already)");
        }
        Ok(())
    }
}
