//! `wagma launch -n P -- CMD ...`: starts P local processes of CMD over TCP on loopback, with
//! the rendezvous environment; forwards SIGINT and SIGTERM to them, collects their exit codes
//! and names the first rank that failed.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, bail};
use clap::Args as ClapArgs;

use crate::local::{Binding, LocalJob, first_failure, summary};

/// Options of `wagma launch`.
#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Number of processes (ranks).
    #[arg(short = 'n', long)]
    pub ranks: usize,
    /// Kill the job after this many seconds (at most 1e9).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Elastic job: the failure of a rank other than 0 is reported but does not fail the job
    /// (use with `wagma train --elastic`); the exit status is rank 0's.
    #[arg(long)]
    pub elastic: bool,
    /// Where the ranks run: `auto` gives each an equal share of the physical cores this
    /// process may use (with their hyperthreads) when there are at least as many as ranks (two
    /// ranks on two cores: one each, as mpirun binds two ranks) and leaves them unbound
    /// otherwise; `core` binds rank r to one CPU, distinct cores first, round robin; `none`
    /// never binds. Default: the `WAGMA_CPU_BIND` variable, else `auto`.
    #[arg(long, value_enum)]
    pub cpu_bind: Option<Binding>,
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
    let binding = match a.cpu_bind {
        Some(b) => b,
        None => Binding::from_env()?,
    };
    let job = LocalJob::spawn(a.ranks, &program, rest, &[], false, binding)?;
    let limit = match a.timeout {
        Some(t) => Some(wagma::util::timeout_from_secs(t).with_context(|| {
            format!(
                "invalid --timeout {t} (a positive number of seconds up to {})",
                wagma::util::MAX_TIMEOUT.as_secs()
            )
        })?),
        None => None,
    };
    let exits = job.wait_or_stop(limit, &stop)?;
    let Some(first) = first_failure(&exits) else {
        return Ok(());
    };
    let rank0_ok = exits.first().is_some_and(|e| e.status.success());
    if a.elastic && rank0_ok {
        eprintln!(
            "wagma launch: the job went on without its failed ranks\n{}",
            summary(&exits)
        );
        return Ok(());
    }
    bail!("{}\n{}", first.headline(), summary(&exits))
}
