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
