//! One start-up for every launcher: [`launch`] runs a rank's task on P in-process ranks, or on
//! this process's rank of a job started by `wagma launch`, `mpirun`, `srun` or torchrun, as
//! [`Launch::from_env`] finds it; [`Comm::share_model`] then gives every rank rank 0's initial
//! model after checking that all ranks hold the same layout.
//!
//! # Which transport (first match wins)
//! 1. `WAGMA_TRANSPORT=threads|tcp|mpi`, when set;
//! 2. a launcher's rank variables (see [`crate::transport::discover`]): `wagma launch` and
//!    torchrun give TCP; `mpirun`/`srun` (Open MPI, PMI, SLURM) give MPI in a build with the
//!    `mpi` feature, TCP otherwise (with the rendezvous from `WAGMA_RENDEZVOUS`,
//!    `MASTER_ADDR`/`MASTER_PORT` or the first SLURM host);
//! 3. nothing: the requested number of in-process ranks (threads).

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{Comm, JobResult, block_on, threaded};
use crate::engine::EngineConfig;
use crate::error::{ConfigError, Error};
use crate::payload::Payload;
use crate::transport::discover::discover;
use crate::transport::tcp::TcpConfig;

/// The environment variable that names the transport explicitly.
pub const TRANSPORT_ENV: &str = "WAGMA_TRANSPORT";

/// Which transport a job runs over, before any connection is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransportChoice {
    /// In-process ranks of this process.
    Threads,
    /// One rank per process, over TCP.
    Tcp,
    /// One rank per process, over MPI (feature `mpi`).
    Mpi,
}

impl TransportChoice {
    /// The choice the environment read through `get` makes (see the module's precedence).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        if let Some(v) = get(TRANSPORT_ENV) {
            return match v.trim() {
                "threads" => Ok(TransportChoice::Threads),
                "tcp" => Ok(TransportChoice::Tcp),
                "mpi" => Ok(TransportChoice::Mpi),
                other => Err(ConfigError::Invalid {
                    what: TRANSPORT_ENV,
                    detail: format!("{other:?} (expected threads, tcp or mpi)"),
                }),
            };
        }
        Ok(match discover(get)? {
            None => TransportChoice::Threads,
            Some(d) => match d.source {
                "Open MPI" | "PMI" | "SLURM" if cfg!(feature = "mpi") => TransportChoice::Mpi,
                _ => TransportChoice::Tcp,
            },
        })
    }
}

/// How this process takes part in a job.
#[derive(Debug, Clone)]
pub enum Launch {
    /// `ranks` in-process ranks (a compute and an engine thread each).
    Threads {
        /// Number of ranks.
        ranks: usize,
    },
    /// This process's rank of a TCP job.
    Tcp(Box<TcpConfig>),
    /// This process's rank of an MPI job.
    Mpi,
}

impl Launch {
    /// What the environment says (see the module's precedence); `ranks` in-process ranks when
    /// no launcher started this process.
    pub fn from_env(ranks: usize) -> Result<Launch, ConfigError> {
        Ok(
            match TransportChoice::from_lookup(&|k| std::env::var(k).ok())? {
                TransportChoice::Threads => Launch::Threads { ranks },
                TransportChoice::Tcp => Launch::Tcp(Box::new(TcpConfig::from_env()?)),
                TransportChoice::Mpi => Launch::Mpi,
            },
        )
    }

    /// The kind of transport.
    pub fn choice(&self) -> TransportChoice {
        match self {
            Launch::Threads { .. } => TransportChoice::Threads,
            Launch::Tcp(_) => TransportChoice::Tcp,
            Launch::Mpi => TransportChoice::Mpi,
        }
    }
}

/// Runs `task` on every rank this process hosts: all `ranks` of a [`Launch::Threads`] job, or
/// this process's one rank of a launched job (its result is the job result's only entry).
/// After a task succeeds its rank leaves cleanly; a failing task tells its peers.
///
/// ```
/// use wagma::exec::launch::{Launch, launch};
/// use wagma::{EngineConfig, Payload};
///
/// // Under `wagma launch` or mpirun this would be one rank per process; here, 3 threads.
/// let how = Launch::from_env(3)?;
/// let sums = launch(how, EngineConfig::default(), async |comm| {
///     let mine = Payload::Data(vec![comm.rank() as f32]);
///     Ok(comm.allreduce(mine).await?.as_slice()[0])
/// })?;
/// assert_eq!(sums.into_all()?, vec![3.0; 3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn launch<R, F>(how: Launch, engine: EngineConfig, task: F) -> Result<JobResult<R>, Error>
where
    F: AsyncFn(&mut Comm) -> Result<R, Error> + Sync,
    R: Send,
{
    let (mut comm, handle) = match how {
        Launch::Threads { ranks } => return Ok(threaded::run(ranks, engine, task)?),
        Launch::Tcp(tcp) => threaded::connect_tcp(&tcp, engine)?,
        Launch::Mpi => connect_mpi(engine)?,
    };
    let r = block_on(task(&mut comm));
    match &r {
        Ok(_) => {
            block_on(comm.finish())?;
        }
        Err(_) => comm.abort(),
    }
    let _ = handle.join();
    Ok(JobResult {
        first_failure: r.is_err().then_some(0),
        ranks: vec![r],
    })
}

#[cfg(feature = "mpi")]
fn connect_mpi(engine: EngineConfig) -> Result<(Comm, std::thread::JoinHandle<()>), Error> {
    threaded::connect_mpi(engine, crate::transport::DEFAULT_MAX_FRAME)
}

#[cfg(not(feature = "mpi"))]
fn connect_mpi(_: EngineConfig) -> Result<(Comm, std::thread::JoinHandle<()>), Error> {
    Err(Error::Config(ConfigError::Invalid {
        what: "transport",
        detail: "this build has no MPI support (build with --features mpi)".into(),
    }))
}

/// A model's layout as ranks compare it: value counts and a hash of every tensor's name and
/// shape (in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLayout {
    /// Trainable values.
    pub params: usize,
    /// Non-trainable buffer values.
    pub buffers: usize,
    /// Hash of the names and shapes, in order.
    pub hash: u64,
}

impl ModelLayout {
    /// The layout of tensors given as `(name, shape, is_buffer)`, in the model's order.
    pub fn of<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a [usize], bool)>) -> Self {
        let (mut params, mut buffers) = (0usize, 0usize);
        let mut h = Sha256::new();
        for (name, shape, buffer) in tensors {
            let n: usize = shape.iter().product();
            if buffer {
                buffers += n;
            } else {
                params += n;
            }
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update([u8::from(buffer), shape.len() as u8]);
            for &d in shape {
                h.update((d as u64).to_le_bytes());
            }
        }
        let d = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&d[..8]);
        ModelLayout {
            params,
            buffers,
            hash: u64::from_le_bytes(first),
        }
    }

    /// A flat model without names: one tensor of each kind.
    pub fn flat(params: usize, buffers: usize) -> Self {
        Self::of([
            ("params", &[params][..], false),
            ("buffers", &[buffers][..], true),
        ])
    }

    /// 16-bit pieces, each exact in an `f32` sum.
    fn pieces(&self) -> [f32; PIECES] {
        let mut out = [0f32; PIECES];
        for (k, v) in [self.params as u64, self.buffers as u64, self.hash]
            .into_iter()
            .enumerate()
        {
            for j in 0..4 {
                out[4 * k + j] = ((v >> (16 * j)) & 0xffff) as f32;
            }
        }
        out
    }

    fn from_pieces(p: &[f32]) -> Self {
        let word = |k: usize| -> u64 {
            (0..4)
                .map(|j| (p.get(4 * k + j).copied().unwrap_or(0.0) as u64 & 0xffff) << (16 * j))
                .sum()
        };
        ModelLayout {
            params: word(0) as usize,
            buffers: word(1) as usize,
            hash: word(2),
        }
    }
}

const PIECES: usize = 12;

impl fmt::Display for ModelLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} parameters and {} buffer values (layout hash {:016x})",
            self.params, self.buffers, self.hash
        )
    }
}

impl Comm {
    /// Checks that every rank holds a model of `layout` (a collective of all ranks): on a
    /// mismatch every rank fails with [`Error::LayoutMismatch`] naming the lowest rank whose
    /// layout differs from rank 0's, and both layouts (a rank whose peer fails first may
    /// report that peer's loss instead; the job's first failure is the mismatch).
    pub async fn check_layout(&mut self, layout: &ModelLayout) -> Result<(), Error> {
        let (rank, p) = (self.rank(), self.size());
        let mut all = vec![0f32; p * PIECES];
        all[rank * PIECES..(rank + 1) * PIECES].copy_from_slice(&layout.pieces());
        let all = self.allreduce(Payload::Data(all)).await?.into_vec();
        let of = |r: usize| ModelLayout::from_pieces(&all[r * PIECES..(r + 1) * PIECES]);
        let root = of(0);
        match (1..p).find(|&r| of(r) != root) {
            None => Ok(()),
            Some(r) if rank == 0 => Err(Error::LayoutMismatch {
                rank,
                layout: root,
                peer: r,
                peer_layout: of(r),
            }),
            Some(r) => {
                let (mine, peer) = if rank == r { (r, 0) } else { (rank, r) };
                Err(Error::LayoutMismatch {
                    rank,
                    layout: of(mine),
                    peer,
                    peer_layout: of(peer),
                })
            }
        }
    }

    /// Gives every rank rank 0's `params` and `buffers` (the initial model), after
    /// [`Comm::check_layout`]. Every rank ends with bit-identical values.
    pub async fn share_model(
        &mut self,
        layout: &ModelLayout,
        params: &mut [f32],
        buffers: &mut [f32],
    ) -> Result<(), Error> {
        self.check_layout(layout).await?;
        let (np, nb) = (params.len(), buffers.len());
        let mut v = vec![0f32; np + nb];
        if self.rank() == 0 {
            v[..np].copy_from_slice(params);
            v[np..].copy_from_slice(buffers);
        }
        // The others add zeros: the sum is rank 0's values (with -0 turned into +0 on every
        // rank alike).
        let v = self.allreduce(Payload::Data(v)).await?.into_vec();
        if v.len() != np + nb {
            return Err(Error::LengthMismatch {
                rank: self.rank(),
                op: crate::error::Op::Other("share model"),
                peer: 0,
                local: np + nb,
                remote: v.len(),
            });
        }
        params.copy_from_slice(&v[..np]);
        buffers.copy_from_slice(&v[np..]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| m.get(k).cloned()
    }

    #[test]
    fn the_environment_chooses_the_transport_in_the_documented_order() {
        let c = |vars: &[(&str, &str)]| TransportChoice::from_lookup(&lookup(vars));
        assert_eq!(c(&[]), Ok(TransportChoice::Threads));
        let launch = [("WAGMA_RANK", "1"), ("WAGMA_WORLD_SIZE", "4")];
        assert_eq!(c(&launch), Ok(TransportChoice::Tcp));
        let torchrun = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        assert_eq!(c(&torchrun), Ok(TransportChoice::Tcp));
        let mpirun = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let mpi = if cfg!(feature = "mpi") {
            TransportChoice::Mpi
        } else {
            TransportChoice::Tcp
        };
        assert_eq!(c(&mpirun), Ok(mpi));
        let srun = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")];
        assert_eq!(c(&srun), Ok(mpi));
        // An explicit choice wins over any launcher.
        let forced = [mpirun[0], mpirun[1], (TRANSPORT_ENV, "tcp")];
        assert_eq!(c(&forced), Ok(TransportChoice::Tcp));
        assert!(matches!(
            c(&[(TRANSPORT_ENV, "carrier-pigeon")]),
            Err(ConfigError::Invalid { .. })
        ));
    }

    #[test]
    fn layouts_round_trip_through_their_pieces_and_tell_models_apart() {
        let a = ModelLayout::of([
            ("fc.weight", &[10, 784][..], false),
            ("bn.running_mean", &[10][..], true),
        ]);
        assert_eq!((a.params, a.buffers), (7840, 10));
        assert_eq!(ModelLayout::from_pieces(&a.pieces()), a);
        let transposed = ModelLayout::of([
            ("fc.weight", &[784, 10][..], false),
            ("bn.running_mean", &[10][..], true),
        ]);
        assert_eq!(
            (transposed.params, transposed.buffers),
            (a.params, a.buffers)
        );
        assert_ne!(transposed.hash, a.hash);
        let big = ModelLayout {
            params: 25_600_000,
            buffers: 1 << 40,
            hash: u64::MAX,
        };
        assert_eq!(ModelLayout::from_pieces(&big.pieces()), big);
    }
}
