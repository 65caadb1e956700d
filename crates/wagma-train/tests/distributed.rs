//! The burn wrapper with burn's own Adam: exact equivalences in deterministic mode, allreduce
//! against single-process Adam, WAGMA's blocking variant against a hand-written reference,
//! averaged BatchNorm statistics, the initial broadcast and the layout check.

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use wagma::algo::{AlgoConfig, Algorithm, WagmaOptions};
use wagma::exec::virtual_time::{self, VirtualConfig};
use wagma::exec::{JobResult, threaded};
use wagma::topology::{Grouping, GroupingKind};
use wagma::{Comm, EngineConfig, Error};
use wagma_train::DistributedOptimizer;
use wagma_train::flat::{FlatModel, train_device};

#[derive(Module, Debug)]
struct Mlp {
    a: Linear,
    b: Linear,
    act: Relu,
}

impl Mlp {
    fn new(hidden: usize, device: &Device) -> Mlp {
        Mlp {
            a: LinearConfig::new(3, hidden).init(device),
            b: LinearConfig::new(hidden, 1).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.act.forward(self.a.forward(x)))
    }

    /// A model with parameters computed from `seed` (not burn's global generator, which
    /// tests running in parallel share).
    fn seeded(hidden: usize, seed: u64) -> Mlp {
        let mut fm = FlatModel::new(Mlp::new(hidden, &train_device()));
        let n = fm.layout().params();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f64 * 0.71 + seed as f64 * 1.3).sin() * 0.5) as f32)
            .collect();
        fm.set_params(&v);
        fm.model().clone()
    }
}

const LR: f64 = 0.01;
const BATCH: usize = 8;

/// Rank `rank`'s batch at step `t`: deterministic inputs and targets (y = sum of x, squared).
fn batch(rank: usize, t: u64) -> (Vec<f32>, Vec<f32>) {
    let mut x = Vec::with_capacity(BATCH * 3);
    let mut y = Vec::with_capacity(BATCH);
    for i in 0..BATCH {
        let v: Vec<f32> = (0..3)
            .map(|j| (((rank * 31 + t as usize * 7 + i * 3 + j) as f32) * 0.37).sin())
            .collect();
        y.push(v.iter().sum::<f32>().powi(2));
        x.extend(v);
    }
    (x, y)
}

fn loss(m: &Mlp, x: Vec<f32>, y: Vec<f32>, n: usize) -> Tensor<1> {
    let dev = train_device();
    let x = Tensor::<2>::from_data(TensorData::new(x, [n, 3]), &dev);
    let y = Tensor::<2>::from_data(TensorData::new(y, [n, 1]), &dev);
    (m.forward(x) - y).powi_scalar(2).mean()
}

fn grads(m: &Mlp, x: Vec<f32>, y: Vec<f32>, n: usize) -> GradientsParams {
    GradientsParams::from_grads(loss(m, x, y, n).backward(), m)
}

fn params(m: &Mlp) -> Vec<f32> {
    FlatModel::new(m.clone()).params()
}

fn adam() -> ModuleOptimizer {
    AdamConfig::new().init()
}

/// Every rank's parameters after `steps` steps of `algo` through the wrapper (virtual time).
fn train(p: usize, algo: &AlgoConfig, steps: u64) -> Vec<Vec<f32>> {
    let job = virtual_time::run(
        p,
        EngineConfig::default(),
        VirtualConfig::seeded(3),
        async |c: &mut Comm| {
            // Each rank initialises differently: the wrapper starts all from rank 0's model.
            let rank = c.rank();
            let model = Mlp::seeded(8, 100 + rank as u64);
            let (mut opt, mut model) =
                DistributedOptimizer::new(c, algo.clone(), adam(), model).await?;
            for t in 0..steps {
                let (x, y) = batch(rank, t);
                let g = grads(&model, x, y, BATCH);
                model = opt.step(LR, model, g).await?;
            }
            Ok(params(&model))
        },
    )
    .unwrap();
    job.into_all().unwrap()
}

fn wagma(tau: Option<u64>, wait_avoiding: bool, group_size: Option<usize>) -> AlgoConfig {
    AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        tau,
        wait_avoiding,
        group_size,
        ..WagmaOptions::default()
    }))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn with_burns_adam_wagma_with_tau_one_is_local_sgd_with_period_one() {
    let a = train(4, &wagma(Some(1), true, None), 12);
    let b = train(4, &AlgoConfig::new(Algorithm::LocalSgd { period: 1 }), 12);
    for r in 0..4 {
        assert_eq!(bits(&a[r]), bits(&b[r]), "rank {r}");
        assert_eq!(
            bits(&a[r]),
            bits(&a[0]),
            "replicas agree after a global average"
        );
    }
}

#[test]
fn allreduce_sgd_with_adam_is_single_process_adam_on_the_whole_batch() {
    let p = 4;
    let steps = 10;
    let dist = train(p, &AlgoConfig::new(Algorithm::AllreduceSgd), steps);
    // One process: rank 0's initial model, the concatenated batches, burn's Adam.
    let mut model = Mlp::seeded(8, 100);
    let mut opt = adam();
    for t in 0..steps {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for r in 0..p {
            let (xr, yr) = batch(r, t);
            x.extend(xr);
            y.extend(yr);
        }
        let g = grads(&model, x, y, BATCH * p);
        model = opt.step(LR, model, g);
    }
    let want = params(&model);
    for (r, got) in dist.iter().enumerate() {
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "rank {r}: largest difference {worst}");
    }
}

#[test]
fn blocking_wagma_matches_a_hand_written_adam_then_group_average() {
    let (p, s, steps) = (4, 2, 6);
    let got = train(p, &wagma(None, false, Some(s)), steps);
    // The reference: P models in one thread, each stepped by its own Adam, then each group
    // of round t replaced by its mean (the test computes it).
    let init = Mlp::seeded(8, 100);
    let mut models: Vec<Mlp> = vec![init; p];
    let mut opts: Vec<ModuleOptimizer> = (0..p).map(|_| adam()).collect();
    let grouping = Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
    for t in 0..steps {
        for r in 0..p {
            let (x, y) = batch(r, t);
            let g = grads(&models[r], x, y, BATCH);
            models[r] = opts[r].step(LR, models[r].clone(), g);
        }
        let flat: Vec<Vec<f32>> = models.iter().map(params).collect();
        for r in 0..p {
            let group = grouping.group_of(r, t);
            let mean: Vec<f32> = (0..flat[r].len())
                .map(|i| group.iter().map(|&q| flat[q][i]).sum::<f32>() / group.len() as f32)
                .collect();
            let mut fm = FlatModel::new(models[r].clone());
            fm.set_params(&mean);
            models[r] = fm.model().clone();
        }
    }
    for r in 0..p {
        let want = params(&models[r]);
        let worst = got[r]
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "rank {r}: largest difference {worst}");
    }
}

#[derive(Module, Debug)]
struct Normed {
    fc: Linear,
    bn: BatchNorm,
}

#[test]
fn batchnorm_statistics_are_averaged_at_a_global_average() {
    let p = 3;
    let algo = wagma(Some(2), true, None);
    let job = virtual_time::run(
        p,
        EngineConfig::default(),
        VirtualConfig::seeded(5),
        async |c: &mut Comm| {
            let device = train_device();
            let rank = c.rank();
            let model = Normed {
                fc: LinearConfig::new(3, 4).init(&device),
                bn: BatchNormConfig::new(4).init(&device),
            };
            let before = FlatModel::new(model.clone()).buffers();
            let (mut opt, mut model) =
                DistributedOptimizer::new(c, algo.clone(), adam(), model).await?;
            for t in 0..2 {
                // Each rank's inputs are shifted differently: its statistics differ.
                let (x, _) = batch(rank, t);
                let x: Vec<f32> = x.iter().map(|v| v + rank as f32).collect();
                let x = Tensor::<3>::from_data(TensorData::new(x, [BATCH, 3, 1]), &device);
                let h = model.fc.forward(x.swap_dims(1, 2)).swap_dims(1, 2);
                let out = model.bn.forward(h).powi_scalar(2).mean();
                let g = GradientsParams::from_grads(out.backward(), &model);
                model = opt.step(LR, model, g).await?;
            }
            Ok((before, FlatModel::new(model).buffers()))
        },
    )
    .unwrap();
    let ranks: Vec<(Vec<f32>, Vec<f32>)> = job.into_all().unwrap();
    let first = &ranks[0].1;
    assert_eq!(first.len(), 8, "running mean and variance of 4 channels");
    assert_ne!(first, &ranks[0].0, "the statistics moved");
    for (r, (_, after)) in ranks.iter().enumerate() {
        assert_eq!(bits(after), bits(first), "rank {r}'s statistics");
    }
}

#[test]
fn every_rank_starts_from_rank_zeros_model_and_a_mismatched_layout_is_named() {
    // Threads: a different seed per rank, one shared start.
    let job: JobResult<Vec<f32>> =
        threaded::run(3, EngineConfig::default(), async |c: &mut Comm| {
            let model = Mlp::seeded(8, 50 + c.rank() as u64);
            let algo = AlgoConfig::new(Algorithm::AllreduceSgd);
            let (_, model) = DistributedOptimizer::new(c, algo, adam(), model).await?;
            Ok(params(&model))
        })
        .unwrap();
    let all = job.into_all().unwrap();
    assert!(all.iter().all(|v| bits(v) == bits(&all[0])));
    // Rank 2 builds a wider model: every rank fails naming rank 0 and rank 2.
    let job: JobResult<()> = threaded::run(3, EngineConfig::default(), async |c: &mut Comm| {
        let hidden = if c.rank() == 2 { 9 } else { 8 };
        let model = Mlp::seeded(hidden, 1);
        let algo = AlgoConfig::new(Algorithm::AllreduceSgd);
        DistributedOptimizer::new(c, algo, adam(), model).await?;
        Ok(())
    })
    .unwrap();
    // A rank that learns of the mismatch may leave before a slower one has read the
    // layouts; that one then reports its loss. The job's first failure is the mismatch.
    let mut named = 0;
    for (r, res) in job.ranks.iter().enumerate() {
        match res {
            Err(Error::LayoutMismatch {
                rank,
                peer,
                layout,
                peer_layout,
            }) => {
                assert_eq!(*rank, r);
                let pair = if r == 2 {
                    (2, 0)
                } else if r == 0 {
                    (0, 2)
                } else {
                    (1, 2)
                };
                assert_eq!((*rank, *peer), pair);
                assert_ne!(layout, peer_layout);
                let msg = res.as_ref().unwrap_err().to_string();
                assert!(msg.contains(&format!("rank {peer} has")), "{msg}");
                named += 1;
            }
            Err(Error::PeerLost { .. }) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(named >= 1);
    assert!(matches!(job.into_all(), Err(Error::LayoutMismatch { .. })));
}

const ROLE: &str = "WAGMA_TEST_DISTRIBUTED_ROLE";

/// A rank of the multi-process test below (does nothing when run by the test harness itself).
#[test]
fn tcp_rank() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    // The one start-up call: the launcher's environment says which transport, rank and peers.
    let how = wagma::exec::launch::Launch::from_env(1).unwrap();
    assert_ne!(how.choice(), wagma::exec::launch::TransportChoice::Threads);
    let r = wagma::exec::launch::launch(how, EngineConfig::default(), async |c: &mut Comm| {
        let rank = c.rank();
        let hidden = if role == "mismatch" && rank == 2 {
            9
        } else {
            8
        };
        let model = Mlp::seeded(hidden, 7 + rank as u64);
        let algo = wagma(Some(2), true, None);
        let (mut opt, mut model) = DistributedOptimizer::new(c, algo, adam(), model).await?;
        let start = params(&model);
        for t in 0..4 {
            let (x, y) = batch(rank, t);
            let g = grads(&model, x, y, BATCH);
            model = opt.step(LR, model, g).await?;
        }
        Ok((rank, start, params(&model)))
    })
    .and_then(|j| j.into_all());
    match r {
        Ok(v) => {
            let (rank, start, end) = &v[0];
            println!("RANK {rank} START {:?}", bits(start));
            println!("RANK {rank} END {:?}", bits(end));
            std::process::exit(0);
        }
        Err(e) => {
            println!("ERROR {e}");
            std::process::exit(3);
        }
    }
}

/// Runs 3 processes of this test binary as a TCP job; returns each one's exit code and stdout.
fn tcp_job(role: &str) -> Vec<(Option<i32>, String)> {
    use std::process::{Command, Stdio};
    let dir = std::env::temp_dir().join(format!("wagma-distributed-{role}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rendezvous");
    let _ = std::fs::remove_file(&file);
    let spawn = |rank: usize, rdv: &str, file: Option<&std::path::Path>| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "tcp_rank", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env("WAGMA_RANK", rank.to_string())
            .env("WAGMA_WORLD_SIZE", "3")
            .env("WAGMA_RENDEZVOUS", rdv)
            .env("WAGMA_JOB_ID", "distributed-test")
            .env("WAGMA_SECRET", "test")
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(f) = file {
            cmd.env("WAGMA_RENDEZVOUS_FILE", f);
        }
        cmd.spawn().unwrap()
    };
    let mut children = vec![spawn(0, "127.0.0.1:0", Some(&file))];
    let t0 = std::time::Instant::now();
    let rdv = loop {
        if let Some(a) = wagma::transport::tcp::read_rendezvous(&file) {
            break a;
        }
        assert!(
            children[0].try_wait().unwrap().is_none(),
            "rank 0 exited early"
        );
        if t0.elapsed() > std::time::Duration::from_secs(120) {
            let _ = children[0].kill();
            panic!("rank 0 published no rendezvous address in 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    children.extend((1..3).map(|r| spawn(r, &rdv, None)));
    let out = children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            (
                o.status.code(),
                String::from_utf8_lossy(&o.stdout).into_owned(),
            )
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn line<'a>(out: &'a str, key: &str) -> &'a str {
    // The harness may print "test tcp_rank ... " before the line.
    out.lines()
        .find_map(|l| l.split_once(key).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no {key} in {out}"))
}

#[test]
fn tcp_processes_start_from_rank_zeros_model_and_refuse_a_mismatched_layout() {
    let ok = tcp_job("same");
    for (r, (code, out)) in ok.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r}: {out}");
    }
    // The same start everywhere although each process seeded its own model, and (tau = 2,
    // 4 steps) the same model after the last global average.
    for key in ["START ", "END "] {
        let first = line(&ok[0].1, key);
        for (r, (_, out)) in ok.iter().enumerate() {
            assert!(out.contains(&format!("RANK {r} {key}")), "rank {r}: {out}");
            assert_eq!(line(out, key), first, "rank {r}: {key}");
        }
    }
    let bad = tcp_job("mismatch");
    let mut named = 0;
    for (r, (code, out)) in bad.iter().enumerate() {
        assert_eq!(*code, Some(3), "rank {r}: {out}");
        let e = line(out, "ERROR ");
        if e.contains("layout differs") {
            let other = if r == 0 || r == 1 { 2 } else { 0 };
            assert!(e.contains(&format!("rank {other} has")), "rank {r}: {e}");
            assert!(e.contains("layout hash"), "rank {r}: {e}");
            named += 1;
        } else {
            // It lost a peer that had already failed on the mismatch.
            assert!(e.contains("lost rank"), "rank {r}: {e}");
        }
    }
    assert!(named >= 1, "{bad:?}");
}

/// The same job under mpirun (a build with the `mpi` feature; skipped without mpirun).
#[cfg(feature = "mpi")]
#[test]
fn mpi_processes_start_from_rank_zeros_model_and_refuse_a_mismatched_layout() {
    use std::process::Command;
    let run = |role: &str| {
        Command::new("mpirun")
            .args(["-n", "3", "--oversubscribe"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "tcp_rank", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env("RAYON_NUM_THREADS", "1")
            .output()
    };
    let ok = match run("same") {
        Ok(o) => o,
        Err(e) => {
            println!("no mpirun on this machine ({e}); nothing to check");
            return;
        }
    };
    let out = String::from_utf8_lossy(&ok.stdout).into_owned();
    assert!(ok.status.success(), "{out}");
    for key in ["START ", "END "] {
        let values: Vec<&str> = (0..3)
            .map(|r| line(&out, &format!("RANK {r} {key}")))
            .collect();
        assert!(values.iter().all(|v| *v == values[0]), "{key}: {out}");
    }
    let bad = run("mismatch").unwrap();
    let out = String::from_utf8_lossy(&bad.stdout).into_owned();
    assert!(!bad.status.success(), "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains("ERROR") && l.contains("layout differs")),
        "{out}"
    );
}
