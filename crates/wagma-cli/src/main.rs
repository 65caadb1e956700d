//! `wagma`: train, benchmark and launch WAGMA-SGD jobs.

mod bench;
mod local;

use clap::{Parser, Subcommand};

/// Wait-avoiding group model averaging (WAGMA-SGD) and its baselines.
#[derive(Parser)]
#[command(name = "wagma", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::Bench),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WAGMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(b) => bench::run(b),
    }
}
