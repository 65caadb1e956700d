//! Running under MPI: detecting it, starting `mpirun` for a local run, and the `MPI_Allreduce`
//! baselines of `wagma bench collectives --transport mpi`.

use std::process::{Command, Stdio};
#[cfg(any(feature = "mpi", test))]
use std::sync::mpsc;
#[cfg(any(feature = "mpi", test))]
use std::time::Duration;

use anyhow::{Context, bail};
use serde::de::DeserializeOwned;

/// True in a process started by an MPI launcher.
pub fn under_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Settings that let Open MPI run oversubscribed, as root and on loopback; set only where the
/// user has not set them.
const LOCAL_OPEN_MPI: [(&str, &str); 5] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
    ("OMPI_MCA_btl_tcp_if_include", "lo"),
    ("OMPI_MCA_oob_tcp_if_include", "lo"),
];

/// Runs this very command under `mpirun -n ranks` on this machine and returns what rank 0
/// reports.
pub fn run_and_collect<T: DeserializeOwned>(ranks: usize) -> anyhow::Result<T> {
    let exe = std::env::current_exe().context("locating the wagma binary")?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut cmd = Command::new(std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into()));
    cmd.args(["-n", &ranks.to_string()])
        .arg(exe)
        .args(argv)
        .env(crate::bench::WORKER, "1")
        .stdout(Stdio::piped());
    for (k, v) in LOCAL_OPEN_MPI {
        if std::env::var_os(k).is_none() {
            cmd.env(k, v);
        }
    }
    let mut child = cmd
        .spawn()
        .context("starting mpirun (install openmpi-bin, or set MPIRUN)")?;
    let out = child.stdout.take().context("mpirun has no stdout")?;
    let result = crate::bench::read_result(out);
    let status = child.wait()?;
    if !status.success() {
        bail!("mpirun failed ({status})");
    }
    result
}

/// Median seconds (slowest rank) of `MPI_Allreduce` of `n` f32 on the world communicator and
/// on a communicator of the butterfly group of size `s`. A blocking MPI call cannot be given a
/// deadline, so a [`Watchdog`] ends this rank, and with it the job, when one call takes longer
/// than `timeout`.
#[cfg(feature = "mpi")]
pub fn mpi_allreduce_times(
    n: usize,
    reps: usize,
    warmup: usize,
    s: usize,
    rank: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<f64>> {
    use mpi::collective::SystemOperation;
    use mpi::topology::{Color, SimpleCommunicator};
    use mpi::traits::*;
    use wagma::topology::{Grouping, GroupingKind};

    let world = SimpleCommunicator::world();
    let p = world.size() as usize;
    let group = Grouping::new(p, s, GroupingKind::Butterfly)?.group_of(rank, 0);
    let split = "splitting the world communicator into groups";
    let watchdog = Watchdog::start(rank, timeout, split.into(), end_job)?;
    let sub = world
        .split_by_color(Color::with_value(group[0] as i32))
        .context("splitting the world communicator")?;
    let send = vec![1.0f32; n];
    let mut recv = vec![0.0f32; n];
    let mut out = Vec::new();
    for (comm, name) in [(&world, "world"), (&sub, "group")] {
        let mut times = Vec::with_capacity(reps);
        for rep in 0..warmup + reps {
            // One step for both, so that no hand-off to the watchdog falls in the timed part.
            watchdog.enter(format!(
                "the barrier and MPI_Allreduce {rep} on the {name} communicator"
            ));
            world.barrier();
            let t0 = std::time::Instant::now();
            comm.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
            let dt = t0.elapsed().as_secs_f64();
            watchdog.enter(format!("the slowest time of MPI_Allreduce {rep} ({name})"));
            let mut slowest = 0.0f64;
            world.all_reduce_into(&dt, &mut slowest, SystemOperation::max());
            if rep >= warmup {
                times.push(slowest);
            }
        }
        out.push(crate::bench::median(&mut times));
    }
    Ok(out)
}

/// Ends this rank when one step of its work takes longer than a timeout: for waits that cannot
/// be given a deadline of their own, as a blocking MPI call. The launcher ends the job when a
/// rank exits, so no rank waits for ever.
#[cfg(any(feature = "mpi", test))]
struct Watchdog {
    steps: Option<mpsc::Sender<String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(any(feature = "mpi", test))]
impl Watchdog {
    /// Starts watching `first_step`; `expire` receives the message that says which step of
    /// `rank` ran out of time.
    fn start(
        rank: usize,
        timeout: Duration,
        first_step: String,
        expire: impl FnOnce(String) + Send + 'static,
    ) -> anyhow::Result<Watchdog> {
        let (steps, entered) = mpsc::channel::<String>();
        let thread = std::thread::Builder::new()
            .name(format!("watchdog-{rank}"))
            .spawn(move || {
                let mut step = first_step;
                loop {
                    match entered.recv_timeout(timeout) {
                        Ok(next) => step = next,
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            return expire(format!(
                                "rank {rank}: {step} took longer than {} s",
                                timeout.as_secs_f64()
                            ));
                        }
                    }
                }
            })
            .context("starting the watchdog thread")?;
        Ok(Watchdog {
            steps: Some(steps),
            thread: Some(thread),
        })
    }

    /// Starts the clock of the next step, named in the message if it runs out.
    fn enter(&self, step: String) {
        if let Some(s) = &self.steps {
            // A watchdog that has already expired has nothing left to watch.
            let _ = s.send(step);
        }
    }
}

#[cfg(any(feature = "mpi", test))]
impl Drop for Watchdog {
    fn drop(&mut self) {
        self.steps = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a rank stuck in a blocking MPI call does when its watchdog expires: it says why and
/// exits, and mpirun ends the other ranks.
#[cfg(feature = "mpi")]
fn end_job(message: String) {
    eprintln!("error: {message}; ending this rank so that mpirun ends the job");
    // Not `process::exit`: its exit handlers (MPI's among them) could wait for the call that
    // is stuck.
    // SAFETY: _exit(2) ends the process at once and touches no Rust state.
    unsafe { libc::_exit(1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watchdog_names_the_step_that_ran_out_of_time() {
        let (tx, rx) = mpsc::channel();
        let step = "MPI_Allreduce 7 on the world communicator";
        let _w = Watchdog::start(3, Duration::from_millis(200), step.into(), move |m| {
            let _ = tx.send(m);
        })
        .unwrap();
        let message = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(
            message,
            "rank 3: MPI_Allreduce 7 on the world communicator took longer than 0.2 s"
        );
    }

    #[test]
    fn a_watchdog_dropped_in_time_never_expires() {
        let (tx, rx) = mpsc::channel::<String>();
        // Far longer than the test: an expiry could only come from a wrong clock.
        let w = Watchdog::start(0, Duration::from_secs(3600), "start".into(), move |m| {
            let _ = tx.send(m);
        })
        .unwrap();
        for rep in 0..100 {
            w.enter(format!("step {rep}"));
        }
        drop(w);
        // The thread has ended and dropped its sender without expiring.
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(60)),
            Err(mpsc::RecvTimeoutError::Disconnected)
        );
    }
}
