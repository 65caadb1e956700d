//! `wagma`: train, benchmark and launch WAGMA-SGD jobs.

mod bench;
mod calibrate;
mod launch;
mod local;
mod mpirun;
mod plot;
mod simulate;
mod train;

use clap::{Parser, Subcommand};

/// The simulator's event loop allocates and frees millions of small objects across thousands
/// of engines; glibc's allocator fragments under that pattern (a 1,024-rank simulation ran
/// 1.6-2.0x slower with it), mimalloc does not.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay`: its place in the C enum `mi_option_e` (the Rust bindings
/// name no constant for it; a test checks its default).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory for reuse instead of returning it to the system a second after it is
/// freed. The simulator frees and reallocates small objects continually, and each return made
/// a later use fault and zero the pages again: at 4,096 simulated ranks, 21,000-26,000 page
/// faults in 100 iterations against fewer than 500, and 5% of the run's time. The process's
/// memory stays at its peak.
fn keep_freed_memory() {
    // SAFETY: sets one integer option, which mimalloc reads with atomic loads; no pointers.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

/// Wait-avoiding group model averaging (WAGMA-SGD) and its baselines.
#[derive(Parser)]
#[command(name = "wagma", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model with WAGMA-SGD or a baseline (with no options: the image workload,
    /// WAGMA-SGD, 8 in-process ranks, on Fashion-MNIST where it is installed and the built-in
    /// dataset otherwise).
    Train(Box<train::Args>),
    /// Start P local processes of a command over TCP (`wagma launch -n 4 -- wagma train
    /// --transport tcp ...`).
    Launch(launch::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Simulate the algorithms at up to thousands of ranks in virtual time.
    #[command(subcommand)]
    Simulate(simulate::Simulate),
}

fn main() -> anyhow::Result<()> {
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WAGMA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Logs redirected to files stay free of colour codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Train(a) => train::run(*a),
        Command::Launch(a) => launch::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Simulate(s) => simulate::run(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option's number is right: it holds mimalloc's default purge delay (1,000 ms) until set,
    /// and the value set after.
    #[test]
    fn purge_delay_is_the_option_set() {
        // SAFETY: reads one integer option.
        let default = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(default, 1000);
        keep_freed_memory();
        // SAFETY: as above.
        let set = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(set, -1);
    }
}
