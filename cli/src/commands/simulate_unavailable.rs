//! `paceline simulate` in a build without the simulator (`--no-default-features`, as the
//! README's demo command builds `paceline`): says how to get one that has it.

/// Simulate draining a backlog through the lane: not in this build (`cargo install --path
/// cli` has it).
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// The simulator's flags, read by a build that has it.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    pub flags: Vec<String>,
}

impl SimulateArgs {
    /// # Errors
    /// Always: this build has no simulator.
    pub async fn run(self) -> anyhow::Result<()> {
        anyhow::bail!(
            "this paceline was built without the simulator (--no-default-features, as the demo's command builds it): `cargo install --path cli` builds one with `paceline simulate`"
        )
    }
}
