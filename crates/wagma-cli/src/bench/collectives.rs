//! `wagma bench collectives`: every collective and algorithm, median time and bandwidth, next
//! to a memcpy of the same buffer and (over TCP) raw loopback streams, measured in the same
//! run.
//!
//! Bandwidths follow NCCL tests' convention: the algorithm bandwidth is the buffer's bytes over
//! the time; the bus bandwidth is the bytes each rank must send at the least over the time,
//! `2(n-1)/n` buffers for an allreduce of n members (one per neighbour for the exchange), so
//! that it compares with a link's speed whatever n is.

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args as ClapArgs;
use comfy_table::Table;
use serde::{Deserialize, Serialize};
use wagma::engine::{ContributionMode, ReadMode, Trigger};
use wagma::schedule::{self, AlgorithmChoice, AllreduceAlgorithm};
use wagma::topology::{Grouping, GroupingKind, default_group_size, ring_neighbors};
use wagma::{Comm, Payload, RoundResult, StreamConfig};

use super::{TransportKind, median};

/// Options of `wagma bench collectives`.
#[derive(ClapArgs, Debug, Clone, Serialize, Deserialize)]
pub struct Args {
    /// Transport.
    #[arg(long, value_enum, default_value_t = TransportKind::Mem)]
    pub transport: TransportKind,
    /// Number of ranks P.
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Group size S (default: sqrt(P) rounded up to a power of two).
    #[arg(long)]
    pub group_size: Option<usize>,
    /// Elements (f32) per buffer.
    #[arg(long, default_value_t = 16 << 20)]
    pub elements: usize,
    /// Measured repetitions per collective.
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Unmeasured warm-up repetitions.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One measured line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// What was measured.
    pub collective: String,
    /// Algorithm.
    pub algorithm: String,
    /// Ranks taking part in one instance.
    pub members: usize,
    /// Median seconds (slowest rank per repetition).
    pub median_s: f64,
    /// Algorithm bandwidth: bytes of the buffer over the median time, in GB/s.
    pub gb_per_s: f64,
    /// Bus bandwidth: the least bytes each rank must send over the median time, in GB/s.
    pub bus_gb_per_s: f64,
    /// Algorithm bandwidth relative to the memcpy of the same buffer.
    pub vs_memcpy: f64,
    /// In-process transport: the algorithm bandwidth that memory traffic allows, in GB/s: the
    /// busiest rank's reads and writes at the fastest memcpy's rate, or every rank's at the
    /// rate of the fastest memcpys on all the cores they share, whichever is lower.
    pub memory_bound_gb_per_s: Option<f64>,
    /// Messages each rank sends (rank 0).
    pub messages_per_rank: usize,
    /// Payload bytes each rank sends (rank 0).
    pub bytes_per_rank: usize,
    /// The least payload bytes each rank must send (`2(n-1)/n` buffers for an allreduce).
    pub optimal_bytes_per_rank: usize,
    /// Ranks in processes of their own (TCP, MPI, the loopback streams): the CPU the timed
    /// repetitions kept busy, and per byte the ranks sent.
    #[serde(default)]
    pub cpu: Option<CpuUse>,
}

/// CPU time spent during the timed repetitions, all ranks' processes together.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct CpuUse {
    /// CPU seconds over wall seconds: the cores kept busy on average.
    pub cores: f64,
    /// CPU nanoseconds per payload byte that all ranks sent.
    pub ns_per_byte: f64,
}

impl CpuUse {
    /// `cpu_s` CPU seconds spent over `wall_s` seconds while `bytes` were sent.
    fn new(cpu_s: f64, wall_s: f64, bytes: usize) -> CpuUse {
        CpuUse {
            cores: cpu_s / wall_s,
            ns_per_byte: cpu_s * 1e9 / bytes as f64,
        }
    }
}

/// One case as the ranks measured it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Measured {
    /// Median over repetitions of the slowest rank's time.
    median_s: f64,
    /// Ranks in processes of their own: all ranks' CPU seconds and the slowest rank's wall
    /// seconds, summed over the timed repetitions.
    cpu_s: Option<(f64, f64)>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Options.
    pub args: Args,
    /// Group size used.
    pub group_size: usize,
    /// Bytes of one buffer.
    pub buffer_bytes: usize,
    /// memcpy of the same buffer, GB/s.
    pub memcpy_gb_per_s: f64,
    /// In-process transport: the copy rates of the memory bound.
    #[serde(default)]
    pub memory_rates: Option<MemoryRates>,
    /// TCP transport: one loopback TCP stream carrying the buffer, GB/s.
    pub loopback_gb_per_s: Option<f64>,
    /// TCP transport: the rate of each of P loopback streams that carry the buffer at the same
    /// time, as when every rank sends to its partner (what this machine's loopback gives a
    /// rank while all ranks send), GB/s.
    #[serde(default)]
    pub concurrent_loopback_gb_per_s: Option<f64>,
    /// Measurements.
    pub rows: Vec<Row>,
}

/// The fastest memcpys of the buffer seen, that the in-process memory bound uses.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct MemoryRates {
    /// One thread copying, GB/s.
    pub one_gb_per_s: f64,
    /// Threads copying at once (the cores the ranks share, at most one per rank).
    pub threads: usize,
    /// Those threads' rates summed, GB/s.
    pub all_gb_per_s: f64,
}

struct Case {
    name: &'static str,
    algorithm: Option<AllreduceAlgorithm>,
}

const CASES: [Case; 7] = [
    Case {
        name: "allreduce",
        algorithm: Some(AllreduceAlgorithm::RecursiveDoubling),
    },
    Case {
        name: "allreduce",
        algorithm: Some(AllreduceAlgorithm::ReduceScatterAllgather),
    },
    Case {
        name: "group-allreduce",
        algorithm: Some(AllreduceAlgorithm::RecursiveDoubling),
    },
    Case {
        name: "group-allreduce",
        algorithm: Some(AllreduceAlgorithm::ReduceScatterAllgather),
    },
    Case {
        name: "group-allreduce",
        algorithm: Some(AllreduceAlgorithm::ReduceBroadcast),
    },
    Case {
        name: "wait-avoiding-round",
        algorithm: None,
    },
    Case {
        name: "neighbour-exchange",
        algorithm: None,
    },
];

fn algo_name(a: Option<AllreduceAlgorithm>) -> String {
    match a {
        Some(AllreduceAlgorithm::RecursiveDoubling) => "recursive-doubling".into(),
        Some(AllreduceAlgorithm::ReduceScatterAllgather) => "reduce-scatter-allgather".into(),
        Some(AllreduceAlgorithm::ReduceBroadcast) => "reduce-broadcast".into(),
        Some(AllreduceAlgorithm::Auto) | None => "auto".into(),
    }
}

/// Runs the benchmark (or, in a process started by it, one TCP rank).
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    let s = args
        .group_size
        .unwrap_or_else(|| default_group_size(args.ranks));
    Grouping::new(args.ranks, s, GroupingKind::Butterfly)?;
    let mpi = args.transport == TransportKind::Mpi;
    let a = args.clone();
    let Some(times) = super::run_job(
        args.transport,
        args.ranks,
        super::engine_config(),
        async move |c: &mut Comm| {
            let mut times = measure(c, &a, s).await?;
            if mpi {
                times.extend(mpi_baselines(c.rank(), &a, s)?.into_iter().map(|median_s| {
                    Measured {
                        median_s,
                        cpu_s: None,
                    }
                }));
            }
            Ok(times)
        },
    )?
    else {
        return Ok(());
    };
    let reps = args.reps.max(3);
    let (memcpy, fastest) = memcpy_gb_per_s(args.elements, reps, 1);
    // The ranks of the in-process transport share this process's cores. A bound takes the
    // fastest copies seen: a busy moment on a shared machine must not lower it.
    let memory = (args.transport == TransportKind::Mem).then(|| {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = cores.min(args.ranks).max(1);
        MemoryRates {
            one_gb_per_s: fastest,
            threads,
            all_gb_per_s: memcpy_gb_per_s(args.elements, 3 * reps, threads).1,
        }
    });
    let (loopback, concurrent) = match args.transport {
        TransportKind::Tcp => {
            let bytes = args.elements * 4;
            (
                Some(loopback_gb_per_s(bytes, 1, reps)?),
                Some(loopback_gb_per_s(bytes, args.ranks, reps)?),
            )
        }
        _ => (None, None),
    };
    let mut report = build_report(&args, s, memcpy, memory, loopback, times);
    if let Some(streams) = concurrent {
        report.concurrent_loopback_gb_per_s = Some(streams.gb_per_s);
        report.rows.push(stream_row(
            "loopback-streams",
            format!("{} TCP connections at once", args.ranks),
            args.ranks,
            report.buffer_bytes,
            streams,
            memcpy,
        ));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// The rate of memcpy of an `n`-element buffer, in buffer bytes per second summed over
/// `threads` threads copying buffers of their own at the same time, over `reps` rounds after
/// a first: the median round's and the fastest round's, GB/s.
fn memcpy_gb_per_s(n: usize, reps: usize, threads: usize) -> (f64, f64) {
    let round = std::sync::Barrier::new(threads);
    let mut times = std::thread::scope(|scope| {
        let copiers: Vec<_> = (0..threads)
            .map(|_| {
                let round = &round;
                scope.spawn(move || {
                    let src = vec![1.0f32; n];
                    let mut dst = vec![0.0f32; n];
                    (0..reps + 1)
                        .map(|_| {
                            round.wait();
                            let t = Instant::now();
                            dst.copy_from_slice(std::hint::black_box(&src));
                            std::hint::black_box(&mut dst);
                            let dt = t.elapsed().as_secs_f64();
                            // A round lasts until its slowest copy ends.
                            round.wait();
                            dt
                        })
                        .skip(1)
                        .collect::<Vec<f64>>()
                })
            })
            .collect();
        let mut slowest = vec![0.0f64; reps];
        for c in copiers {
            // A copier cannot panic short of an allocation failure, which aborts anyway.
            let times = c.join().unwrap_or_default();
            for (s, t) in slowest.iter_mut().zip(times) {
                *s = s.max(t);
            }
        }
        slowest
    });
    let rate = |t: f64| (threads * n * 4) as f64 / t / 1e9;
    let fastest = times.iter().copied().fold(f64::INFINITY, f64::min);
    (rate(median(&mut times)), rate(fastest))
}

/// Raw loopback streams as measured.
#[derive(Debug, Clone, Copy)]
struct Streams {
    /// The rate of each stream, GB/s.
    gb_per_s: f64,
    /// The writing and reading threads' CPU, from the first copy to the last.
    cpu: CpuUse,
}

/// `streams` TCP connections on loopback, each with a thread writing the buffer `reps + 1`
/// times and one reading it into a buffer of its own; the writers start each copy together.
/// The median over the rounds after the first of the time from the last stream delivering one
/// copy to the last delivering the next, as a rate per stream.
fn loopback_gb_per_s(bytes: usize, streams: usize, reps: usize) -> anyhow::Result<Streams> {
    use std::io::{Read, Write};
    use std::sync::{Arc, Barrier};
    const PATIENCE: Duration = Duration::from_secs(60);
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let round = Arc::new(Barrier::new(streams));
    let mut writers = Vec::with_capacity(streams);
    let mut readers = Vec::with_capacity(streams);
    for _ in 0..streams {
        let round = Arc::clone(&round);
        writers.push(std::thread::spawn(
            move || -> std::io::Result<(Instant, f64)> {
                let src = vec![1u8; bytes];
                let mut s = std::net::TcpStream::connect_timeout(&addr, PATIENCE).and_then(|s| {
                    s.set_nodelay(true)?;
                    s.set_write_timeout(Some(PATIENCE))?;
                    Ok(s)
                });
                // Every writer meets the others before every copy, even after a failure of its
                // own, so that none waits for a writer that gave up.
                round.wait();
                let (at, cpu) = (Instant::now(), super::cpu_seconds(true));
                for copy in 0..=reps {
                    if copy > 0 {
                        round.wait();
                    }
                    // In the pieces the TCP transport writes (the fastest way found here).
                    if let Ok(st) = &mut s
                        && let Err(e) = src
                            .chunks(wagma::transport::tcp::WRITE_PIECE_BYTES)
                            .try_for_each(|piece| st.write_all(piece))
                    {
                        s = Err(e);
                    }
                }
                s.map(|_| (at, super::cpu_seconds(true) - cpu))
            },
        ));
        let deadline = Instant::now() + PATIENCE;
        let mut s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        bail!("no loopback connection within {PATIENCE:?}");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e.into()),
            }
        };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(PATIENCE))?;
        readers.push(std::thread::spawn(
            move || -> std::io::Result<(Vec<Instant>, f64)> {
                let mut dst = vec![0u8; bytes];
                let cpu = super::cpu_seconds(true);
                let delivered = (0..=reps)
                    .map(|_| s.read_exact(&mut dst).map(|()| Instant::now()))
                    .collect::<std::io::Result<_>>()?;
                Ok((delivered, super::cpu_seconds(true) - cpu))
            },
        ));
    }
    let mut delivered: Vec<Vec<Instant>> = Vec::with_capacity(streams);
    let mut cpu_s = 0.0;
    for r in readers {
        match r.join() {
            Ok(r) => {
                let (d, cpu) = r?;
                delivered.push(d);
                cpu_s += cpu;
            }
            Err(_) => bail!("a loopback reader thread panicked"),
        }
    }
    let mut first = None::<Instant>;
    for w in writers {
        match w.join() {
            Ok(r) => {
                let (at, cpu) = r?;
                first = Some(first.map_or(at, |f| f.min(at)));
                cpu_s += cpu;
            }
            Err(_) => bail!("a loopback writer thread panicked"),
        }
    }
    // When every stream had delivered copy k.
    let all: Vec<Instant> = (0..=reps)
        .filter_map(|k| delivered.iter().map(|d| d[k]).max())
        .collect();
    let mut times: Vec<f64> = all
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    let wall_s = match (first, all.last()) {
        (Some(first), Some(&last)) => (last - first).as_secs_f64(),
        _ => f64::NAN,
    };
    Ok(Streams {
        gb_per_s: bytes as f64 / median(&mut times) / 1e9,
        cpu: CpuUse::new(cpu_s, wall_s, bytes * streams * (reps + 1)),
    })
}

/// The least bytes a rank must send in an allreduce of `n` members of `bytes` each:
/// `2(n-1)/n` buffers (reduce-scatter then allgather).
fn optimal_allreduce_bytes(n: usize, bytes: usize) -> usize {
    if n <= 1 { 0 } else { 2 * (n - 1) * bytes / n }
}

/// Bytes of memory a rank reads and writes in the in-process transport: its reductions, and
/// one join of the buffer when it was gathered in pieces (received ranges are moved in as
/// segments, joined once at the end).
fn in_process_traffic(sched: &schedule::Schedule) -> usize {
    let len = sched.len;
    let gathered = sched.phases.iter().any(|p| {
        p.combine == schedule::Combine::Copy && p.recvs.iter().any(|r| r.range.len() < len)
    });
    sched.reduction_traffic() + if gathered { 2 * len * 4 } else { 0 }
}

/// What a timed collective hands back.
enum Finished {
    Buffer(Payload),
    Round(RoundResult),
}

/// Per case, the median over repetitions of the slowest rank's time and, where each rank is a
/// process of its own, the CPU all ranks spent in the timed regions.
async fn measure(c: &mut Comm, args: &Args, s: usize) -> Result<Vec<Measured>, wagma::Error> {
    let own_process = args.transport != TransportKind::Mem;
    let (p, rank, n) = (c.size(), c.rank(), args.elements);
    let grouping = Grouping::new(p, s, GroupingKind::Butterfly)?;
    let everyone: Vec<usize> = (0..p).collect();
    let group = grouping.group_of(rank, 0);
    let mut data = Payload::Data(vec![1.0; n]);
    let mut seq = 1u64 << 32;
    let mut medians = Vec::with_capacity(CASES.len());
    c.open_stream(StreamConfig {
        group_size: s,
        grouping: GroupingKind::Fixed,
        trigger: Trigger::Solo,
        mode: ContributionMode::Model,
        read: ReadMode::Exact,
        sync_period: None,
        initial: Payload::Data(vec![0.0; n]),
        initial_steps: 0,
    })
    .await?;
    let mut round = 0u64;
    for case in &CASES {
        let mut times = Vec::with_capacity(args.reps);
        let (mut cpu_s, mut wall_s) = (0.0, 0.0);
        for rep in 0..args.warmup + args.reps {
            c.barrier().await?;
            let cpu0 = super::cpu_seconds(false);
            let t0 = Instant::now();
            let choice = AlgorithmChoice {
                algorithm: case.algorithm.unwrap_or_default(),
                ..AlgorithmChoice::default()
            };
            seq += 1;
            // What each case returns is turned into the next repetition's input only after
            // every rank has stopped its clock: untimed work on one rank must not compete for
            // the cores with a rank still inside the timed region.
            let (finished, dt) = match case.name {
                "allreduce" => {
                    let d = c
                        .allreduce_with(&everyone, seq, data, 0, &choice)
                        .await?
                        .data;
                    (Finished::Buffer(d), t0.elapsed())
                }
                "group-allreduce" => {
                    let d = c.allreduce_with(&group, seq, data, 0, &choice).await?.data;
                    (Finished::Buffer(d), t0.elapsed())
                }
                "wait-avoiding-round" => {
                    let r = c.arrive(round, data, round + 1).await?;
                    let dt = t0.elapsed();
                    round += 1;
                    (Finished::Round(r), dt)
                }
                _ => {
                    let nb = ring_neighbors(rank, p);
                    let d = c.exchange(seq, &nb, &nb, data, 0.0, 0).await?.data;
                    (Finished::Buffer(d), t0.elapsed())
                }
            };
            // Read as this rank's collective returns: what follows (waiting for the slowest
            // rank, which a polling transport spends CPU on) is not the collective's.
            let cpu = super::cpu_seconds(false) - cpu0;
            let slowest = super::slowest(c, dt.as_secs_f64()).await?;
            if rep >= args.warmup {
                times.push(slowest);
                cpu_s += cpu;
                wall_s += slowest;
            }
            data = match finished {
                Finished::Buffer(d) => d,
                // The stream keeps the published buffer; the next contribution is a copy of
                // the shared result.
                Finished::Round(r) => {
                    let next = r.sum.duplicate();
                    r.recycle();
                    next
                }
            };
            // Keep values bounded.
            data.scale(1.0 / p as f32);
        }
        let cpu_s = if own_process {
            Some((super::total(c, cpu_s).await?, wall_s))
        } else {
            None
        };
        medians.push(Measured {
            median_s: median(&mut times),
            cpu_s,
        });
    }
    Ok(medians)
}

/// A case's collective as rank `rank` runs it: members of one instance, the rank's schedule,
/// and the least bytes it must send.
fn case_schedule(
    case: &Case,
    rank: usize,
    p: usize,
    grouping: Option<&Grouping>,
    len: usize,
    choice: &AlgorithmChoice,
) -> (usize, schedule::Schedule, usize) {
    let bytes = len * 4;
    match case.name {
        "allreduce" => {
            let everyone: Vec<usize> = (0..p).collect();
            (
                p,
                schedule::allreduce(rank, &everyone, len, choice),
                optimal_allreduce_bytes(p, bytes),
            )
        }
        "neighbour-exchange" => {
            let nb = ring_neighbors(rank, p);
            (
                nb.len() + 1,
                schedule::exchange(&nb, &nb, len),
                nb.len() * bytes,
            )
        }
        _ => {
            let group = grouping.map_or_else(|| vec![rank], |g| g.group_of(rank, 0));
            (
                group.len(),
                schedule::allreduce(rank, &group, len, choice),
                optimal_allreduce_bytes(group.len(), bytes),
            )
        }
    }
}

/// The algorithm bandwidth that memory traffic allows the in-process transport, in GB/s: the
/// busiest rank's reads and writes at one memcpy's rate, and every rank's at the rate of
/// memcpys on all the cores the ranks share, whichever takes longer. memcpy moves 2 bytes of
/// traffic per byte of buffer.
fn memory_bound_gb_per_s(bytes: usize, traffic: &[usize], rates: &MemoryRates) -> Option<f64> {
    let busiest = traffic.iter().copied().max().filter(|&t| t > 0)?;
    let total: usize = traffic.iter().sum();
    let seconds = |traffic: usize, gb: f64| traffic as f64 / (2.0 * gb * 1e9);
    let t = seconds(busiest, rates.one_gb_per_s).max(seconds(total, rates.all_gb_per_s));
    Some(bytes as f64 / t / 1e9)
}

fn build_report(
    args: &Args,
    s: usize,
    memcpy: f64,
    memory: Option<MemoryRates>,
    loopback: Option<Streams>,
    times: Vec<Measured>,
) -> Report {
    let p = args.ranks;
    let bytes = args.elements * 4;
    let grouping = Grouping::new(p, s, GroupingKind::Butterfly).ok();
    let group = grouping
        .as_ref()
        .map(|g| g.group_of(0, 0))
        .unwrap_or_else(|| vec![0]);
    let baselines: Vec<(String, usize, f64)> = times
        .iter()
        .skip(CASES.len())
        .zip([("world", p), ("group communicator", group.len())])
        .map(|(t, (name, members))| (name.to_string(), members, t.median_s))
        .collect();
    let mut rows: Vec<Row> = CASES
        .iter()
        .zip(times)
        .map(|(case, measured)| {
            let t = measured.median_s;
            let choice = AlgorithmChoice {
                algorithm: case.algorithm.unwrap_or_default(),
                // As the threaded executor sets them for the streams' rounds.
                shared_memory: args.transport == TransportKind::Mem,
                fold_on_arrival: args.transport == TransportKind::Tcp,
                ..AlgorithmChoice::default()
            };
            // Every rank's schedule; the row reports rank 0's.
            let per_rank: Vec<(usize, schedule::Schedule, usize)> = (0..p)
                .map(|r| case_schedule(case, r, p, grouping.as_ref(), args.elements, &choice))
                .collect();
            let (members, optimal) = (per_rank[0].0, per_rank[0].2);
            let cost = per_rank[0].1.cost();
            let gb = bytes as f64 / t / 1e9;
            let memory_bound = memory.as_ref().and_then(|rates| {
                let traffic: Vec<usize> = per_rank
                    .iter()
                    .map(|(_, s, _)| in_process_traffic(s))
                    .collect();
                memory_bound_gb_per_s(bytes, &traffic, rates)
            });
            let sent: usize = per_rank.iter().map(|(_, s, _)| s.cost().bytes).sum();
            let cpu = measured
                .cpu_s
                .map(|(cpu_s, wall_s)| CpuUse::new(cpu_s, wall_s, sent * args.reps));
            Row {
                collective: case.name.into(),
                algorithm: algo_name(case.algorithm),
                members,
                median_s: t,
                gb_per_s: gb,
                bus_gb_per_s: optimal as f64 / t / 1e9,
                vs_memcpy: gb / memcpy,
                memory_bound_gb_per_s: memory_bound,
                messages_per_rank: cost.messages,
                bytes_per_rank: cost.bytes,
                optimal_bytes_per_rank: optimal,
                cpu,
            }
        })
        .collect();
    for (name, members, t) in baselines {
        let gb = bytes as f64 / t / 1e9;
        let optimal = optimal_allreduce_bytes(members, bytes);
        rows.push(Row {
            collective: "MPI_Allreduce".into(),
            algorithm: name,
            members,
            median_s: t,
            gb_per_s: gb,
            bus_gb_per_s: optimal as f64 / t / 1e9,
            vs_memcpy: gb / memcpy,
            memory_bound_gb_per_s: None,
            messages_per_rank: 0,
            bytes_per_rank: 0,
            optimal_bytes_per_rank: optimal,
            cpu: None,
        });
    }
    if let Some(stream) = loopback {
        rows.push(stream_row(
            "loopback-stream",
            "one TCP connection".into(),
            2,
            bytes,
            stream,
            memcpy,
        ));
    }
    Report {
        args: args.clone(),
        group_size: s,
        buffer_bytes: bytes,
        memcpy_gb_per_s: memcpy,
        memory_rates: memory,
        loopback_gb_per_s: loopback.map(|l| l.gb_per_s),
        concurrent_loopback_gb_per_s: None,
        rows,
    }
}

/// A row for raw loopback streams that carry `bytes` each.
fn stream_row(
    collective: &str,
    algorithm: String,
    members: usize,
    bytes: usize,
    streams: Streams,
    memcpy: f64,
) -> Row {
    let gb = streams.gb_per_s;
    Row {
        collective: collective.into(),
        algorithm,
        members,
        median_s: bytes as f64 / gb / 1e9,
        gb_per_s: gb,
        bus_gb_per_s: gb,
        vs_memcpy: gb / memcpy,
        memory_bound_gb_per_s: None,
        messages_per_rank: 1,
        bytes_per_rank: bytes,
        optimal_bytes_per_rank: bytes,
        cpu: Some(streams.cpu),
    }
}

fn print_table(r: &Report) {
    let loopback = r
        .loopback_gb_per_s
        .map(|g| format!("; one loopback TCP stream: {g:.2} GB/s"))
        .unwrap_or_default()
        + &r.concurrent_loopback_gb_per_s
            .map(|g| format!(", each of {} at once: {g:.2} GB/s", r.args.ranks))
            .unwrap_or_default();
    println!(
        "{} ranks over {}, group size {}, buffer {:.1} MiB; memcpy of the buffer: {:.2} GB/s{loopback}",
        r.args.ranks,
        r.args.transport.name(),
        r.group_size,
        r.buffer_bytes as f64 / (1 << 20) as f64,
        r.memcpy_gb_per_s
    );
    println!(
        "algbw: buffer bytes / time; busbw: least bytes a rank sends / time (2(n-1)/n buffers \
         for an allreduce of n); x optimal: bytes sent over that least"
    );
    // The bound columns exist where the bound was computed.
    let mem = r.memory_rates.is_some();
    if let Some(m) = r.memory_rates {
        println!(
            "memory bound: the busiest rank's reads and writes at one memcpy's rate, or every \
             rank's at the rate of {} memcpys at once, whichever takes longer (fastest copies \
             seen: one {:.2} GB/s, {} at once {:.2} GB/s in all)",
            m.threads, m.one_gb_per_s, m.threads, m.all_gb_per_s
        );
    }
    let mut header = vec![
        "collective",
        "algorithm",
        "members",
        "median ms",
        "algbw GB/s",
        "busbw GB/s",
        "x memcpy",
    ];
    if mem {
        header.extend(["memory bound GB/s", "x bound"]);
    }
    if r.loopback_gb_per_s.is_some() {
        header.push("busbw x loopback");
    }
    if r.concurrent_loopback_gb_per_s.is_some() {
        header.push("busbw x P streams");
    }
    header.extend(["msgs/rank", "MiB/rank", "x optimal"]);
    let cpu = r.rows.iter().any(|row| row.cpu.is_some());
    if cpu {
        println!(
            "cores busy: the CPU time of all ranks' processes (of the streams' threads) in the \
             timed repetitions over their wall time; CPU ns/B: that CPU time per byte all ranks \
             sent"
        );
        header.extend(["cores busy", "CPU ns/B"]);
    }
    let mut t = Table::new();
    t.set_header(header);
    for row in &r.rows {
        let mut cells = vec![
            row.collective.clone(),
            row.algorithm.clone(),
            row.members.to_string(),
            format!("{:.2}", row.median_s * 1e3),
            format!("{:.3}", row.gb_per_s),
            format!("{:.3}", row.bus_gb_per_s),
            format!("{:.3}", row.vs_memcpy),
        ];
        let or_dash = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.3}"));
        if mem {
            cells.push(or_dash(row.memory_bound_gb_per_s));
            cells.push(or_dash(row.memory_bound_gb_per_s.map(|b| row.gb_per_s / b)));
        }
        for l in [r.loopback_gb_per_s, r.concurrent_loopback_gb_per_s]
            .into_iter()
            .flatten()
        {
            cells.push(format!("{:.3}", row.bus_gb_per_s / l));
        }
        let ratio = (row.optimal_bytes_per_rank > 0 && row.bytes_per_rank > 0)
            .then(|| row.bytes_per_rank as f64 / row.optimal_bytes_per_rank as f64);
        cells.extend([
            row.messages_per_rank.to_string(),
            format!("{:.1}", row.bytes_per_rank as f64 / (1 << 20) as f64),
            or_dash(ratio),
        ]);
        if cpu {
            cells.push(or_dash(row.cpu.map(|c| c.cores)));
            cells.push(or_dash(row.cpu.map(|c| c.ns_per_byte)));
        }
        t.add_row(cells);
    }
    println!("{t}");
}

/// `MPI_Allreduce` on the world communicator and on a communicator of the group's size, run
/// after our collectives in the same job.
#[cfg(feature = "mpi")]
fn mpi_baselines(rank: usize, args: &Args, s: usize) -> Result<Vec<f64>, wagma::Error> {
    let timeout = super::engine_config().timeout;
    crate::mpirun::mpi_allreduce_times(args.elements, args.reps, args.warmup, s, rank, timeout)
        .map_err(|e| wagma::Error::Task {
            rank,
            message: format!("{e:#}"),
        })
}

#[cfg(not(feature = "mpi"))]
fn mpi_baselines(rank: usize, _args: &Args, _s: usize) -> Result<Vec<f64>, wagma::Error> {
    Err(wagma::Error::Task {
        rank,
        message: "this wagma was built without MPI support".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_bound_counts_the_cores_the_ranks_share() {
        let gb = 1e9 as usize;
        // A core per rank: the busiest rank's traffic decides (3 GB at 2 GB/s of traffic).
        let rates = |one, all| MemoryRates {
            one_gb_per_s: one,
            threads: 2,
            all_gb_per_s: all,
        };
        let one_each = memory_bound_gb_per_s(gb, &[3 * gb, gb], &rates(1.0, 2.0)).unwrap();
        assert!((one_each - 1.0 / 1.5).abs() < 1e-12, "{one_each}");
        // Four ranks on two cores that copy 1.6 GB/s together: 12 GB at 3.2 GB/s of traffic.
        let shared = memory_bound_gb_per_s(gb, &[3 * gb; 4], &rates(1.0, 1.6)).unwrap();
        assert!((shared - 1.0 / 3.75).abs() < 1e-12, "{shared}");
        assert_eq!(memory_bound_gb_per_s(gb, &[0, 0], &rates(1.0, 2.0)), None);
    }

    #[test]
    fn the_bound_uses_every_ranks_schedule() {
        // Reduce-broadcast in pairs: the lowest member of each pair does all the reducing.
        let grouping = Grouping::new(4, 2, GroupingKind::Butterfly).unwrap();
        let case = &CASES[4];
        let choice = AlgorithmChoice {
            algorithm: AllreduceAlgorithm::ReduceBroadcast,
            ..AlgorithmChoice::default()
        };
        let traffic: Vec<usize> = (0..4)
            .map(|r| {
                in_process_traffic(&case_schedule(case, r, 4, Some(&grouping), 100, &choice).1)
            })
            .collect();
        let roots: Vec<usize> = (0..4).filter(|&r| traffic[r] > 0).collect();
        assert_eq!(roots.len(), 2, "{traffic:?}");
        assert_eq!(traffic[roots[0]], traffic[roots[1]]);
    }
}
