//! `wagma launch -n P -- CMD ...`: starts P local processes of CMD over TCP on loopback, with
//! the rendezvous environment; forwards SIGINT and SIGTERM to them, collects their exit codes
//! and names the first rank that failed.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args as ClapArgs;

use crate::local::LocalJob;

/// Options of `wagma launch`.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Number of processes (ranks).
    #[arg(short = 'n', long)]
    pub ranks: usize,
    /// Kill the job after this many seconds.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// The command each rank runs (`wagma` means this very binary).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub command: Vec<String>,
}

/// Runs `wagma launch`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.ranks == 0 {
        bail!("-n must be at least 1");
    }
    let (program, rest) = a.command.split_first().context("no command given")?;
    let program = if program == "wagma" {
        std::env::current_exe().context("locating the wagma binary")?
    } else {
        program.into()
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("installing a signal handler")?;
    }
    let job = LocalJob::spawn(a.ranks, &program, rest, &[], false)?;
    let limit = match a.timeout {
        Some(t) => Some(Duration::try_from_secs_f64(t).context("invalid --timeout")?),
        None => None,
    };
    job.wait_or_stop(limit, &stop)?;
    Ok(())
}
