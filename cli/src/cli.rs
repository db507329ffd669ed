//! The `paceline` command line: its global flags and one subcommand per command, parsed
//! by clap. Here, not in the binary, so that tests parse the docs' examples with it.

use clap::{Parser, Subcommand};

use crate::commands::{
    circuit::CircuitArgs, demo::DemoArgs, dlq::DlqArgs, enqueue::EnqueueArgs, kick::KickArgs, lanes::LanesArgs, rate::RateArgs, results::ResultsArgs,
    run::RunArgs, simulate::SimulateArgs, status::StatusArgs,
};
use crate::serve::ServeArgs;

/// Call rate-limited APIs as fast as their quotas allow, and never faster.
#[derive(Parser)]
#[command(name = "paceline", version, about)]
pub struct Cli {
    /// Log filter (error, warn, info, debug, or a tracing directive).
    #[arg(long, global = true, env = "PACELINE_LOG", default_value = "error")]
    pub log: String,
    /// Log lines (on standard error) as text or as JSON, one object a line.
    #[arg(long, global = true, env = "PACELINE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub enum Command {
    Demo(DemoArgs),
    Run(RunArgs),
    Serve(ServeArgs),
    Enqueue(EnqueueArgs),
    Status(StatusArgs),
    Results(ResultsArgs),
    Dlq(DlqArgs),
    Circuit(CircuitArgs),
    Kick(KickArgs),
    Lanes(LanesArgs),
    Rate(RateArgs),
    Simulate(SimulateArgs),
    /// Print a completion script for a shell (e.g. `paceline completions bash >
    /// ~/.local/share/bash-completion/completions/paceline`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

impl Command {
    /// Whether the command runs lanes in this process (and their threads should wake
    /// onto a busy core at once: see `paceline_shared::priority`).
    #[must_use]
    pub fn paces_calls(&self) -> bool {
        matches!(self, Self::Demo(_) | Self::Run(_) | Self::Serve(_))
    }
}
