//! `paceline`: run a paced lane locally, try the demo, and operate a lane (embedded or
//! on AWS): enqueue jobs, inspect state, redrive dead letters, steer the circuit.

use clap::CommandFactory as _;
use paceline_cli::cli::{Cli, Command, LogFormat};
use paceline_cli::commands::{OverQuota, EXIT_OVER_QUOTA};

/// Colour codes only on a terminal, and not when `NO_COLOR` is set (no-color.org).
fn colour_on_stderr() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Exit status of a command whose reader went away, as a process killed by SIGPIPE
/// reports in a shell (128 + 13).
const EXIT_READER_GONE: i32 = 141;

/// `paceline status | head -1`: once the reader has gone, writing to standard output
/// fails with a broken pipe, and `println!` (or a library writing there) panics. End
/// quietly instead, as Unix tools do; any other panic is reported as before.
fn end_quietly_on_a_broken_pipe() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info.payload().downcast_ref::<String>().map(String::as_str).or_else(|| info.payload().downcast_ref::<&str>().copied()).unwrap_or("");
        if message.contains("Broken pipe") || message.contains("BrokenPipe") {
            std::process::exit(EXIT_READER_GONE);
        }
        report(info);
    }));
}

fn main() -> std::process::ExitCode {
    end_quietly_on_a_broken_pipe();
    let cli = <Cli as clap::Parser>::parse();
    if cli.command.paces_calls() {
        // Before the runtime: its threads inherit the lanes' short time slice.
        paceline_shared::priority::wake_lanes_promptly();
    }
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(run(cli)),
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> std::process::ExitCode {
    let logs = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "error".into()))
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr());
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    let result = match cli.command {
        Command::Demo(args) => args.run().await,
        Command::Run(args) => args.run().await,
        Command::Serve(args) => args.run().await,
        Command::Enqueue(args) => args.run().await,
        Command::Status(args) => args.run().await,
        Command::Results(args) => args.run().await,
        Command::Dlq(args) => args.run().await,
        Command::Circuit(args) => args.run().await,
        Command::Kick(args) => args.run().await,
        Command::Lanes(args) => args.run().await,
        Command::Rate(args) => args.run().await,
        Command::Simulate(args) => args.run().await,
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "paceline", &mut std::io::stdout());
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.is::<OverQuota>() => {
            eprintln!("{e}");
            std::process::ExitCode::from(EXIT_OVER_QUOTA)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
