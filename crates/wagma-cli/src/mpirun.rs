//! Running under MPI: detecting it, starting `mpirun` for a local run, and the `MPI_Allreduce`
//! baselines of `wagma bench collectives --transport mpi`.

use std::process::{Command, Stdio};

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
/// on a communicator of the butterfly group of size `s`.
#[cfg(feature = "mpi")]
pub fn mpi_allreduce_times(
    n: usize,
    reps: usize,
    warmup: usize,
    s: usize,
    rank: usize,
) -> anyhow::Result<Vec<f64>> {
    use mpi::collective::SystemOperation;
    use mpi::topology::{Color, SimpleCommunicator};
    use mpi::traits::*;
    use wagma::topology::{Grouping, GroupingKind};

    let world = SimpleCommunicator::world();
    let p = world.size() as usize;
    let group = Grouping::new(p, s, GroupingKind::Butterfly)?.group_of(rank, 0);
    let sub = world
        .split_by_color(Color::with_value(group[0] as i32))
        .context("splitting the world communicator")?;
    let send = vec![1.0f32; n];
    let mut recv = vec![0.0f32; n];
    let mut out = Vec::new();
    for comm in [&world, &sub] {
        let mut times = Vec::with_capacity(reps);
        for rep in 0..warmup + reps {
            world.barrier();
            let t0 = std::time::Instant::now();
            comm.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
            let dt = t0.elapsed().as_secs_f64();
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
