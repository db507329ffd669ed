//! One module per `paceline` subcommand, each an `Args` struct with its own `run`.

pub mod circuit;
pub mod demo;
pub mod dlq;
pub mod enqueue;
pub mod kick;
pub mod lanes;
pub mod rate;
pub mod results;
pub mod run;
// A build without the simulator (`--no-default-features`) has a `simulate` that says how
// to get one with it.
#[cfg_attr(not(feature = "simulate"), path = "simulate_unavailable.rs")]
pub mod simulate;
pub mod status;

use std::path::PathBuf;

/// The `--config` flag every lane command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArg {
    /// The lane's config file.
    #[arg(long, short, env = "PACELINE_CONFIG", default_value = "paceline.toml")]
    pub config: PathBuf,
}

/// The exit code of a simulation in which the provider refused calls over quota.
pub const EXIT_OVER_QUOTA: u8 = 3;

/// The configured lane's calls were refused as over quota: the run failed its one
/// promise. Its report is printed all the same.
#[derive(Debug, thiserror::Error)]
#[error(
    "{violations} calls were refused as over quota (exit code {EXIT_OVER_QUOTA}). hint: hand jobs off ahead of their slot \
     (`orchestrator.dispatch_ahead`, 500ms where workers are Lambda functions) and keep `quota.safety_margin` above the \
     network's jitter; `--baselines` shows the difference"
)]
pub struct OverQuota {
    pub violations: u64,
}
