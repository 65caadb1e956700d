//! How runs are measured, in virtual time: an iteration's time is the slowest rank's, for
//! unsynchronised algorithms too; evaluation does not change the run; a virtual-time run
//! replays bit for bit.

use std::path::{Path, PathBuf};

use wagma::algo::{AlgoConfig, Algorithm};
use wagma::imbalance::{Imbalance, Profile};
use wagma_train::data::mnist1d;
use wagma_train::trainer::{self, EvalRecord, FINAL_MODEL, Quiet};
use wagma_train::workloads::image::ImageWorkload;
use wagma_train::{Execution, Summary, TrainConfig, WorkloadKind};

fn out(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wagma-measure-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn image() -> ImageWorkload {
    ImageWorkload::new(mnist1d::generate(800, 1), mnist1d::generate(200, 2), 8, 8)
}

fn config(algo: &str, ranks: usize, steps: u64, eval_every: u64, dir: &Path) -> TrainConfig {
    TrainConfig {
        workload: WorkloadKind::Image,
        algo: AlgoConfig::new(Algorithm::from_name(algo).unwrap()),
        ranks,
        steps,
        eval_every,
        out: dir.to_path_buf(),
        progress: false,
        execution: Execution::Virtual,
        ..TrainConfig::default()
    }
}

/// A compute profile at the paper's scale.
fn at_paper_scale(profile: Profile, seed: u64) -> Option<Imbalance> {
    Some(Imbalance {
        profile,
        time_scale: 1.0,
        seed,
    })
}

fn curve(dir: &Path) -> Vec<EvalRecord> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn run(c: &TrainConfig) -> Summary {
    trainer::run(&image(), c, "test".into(), &Quiet).unwrap()
}

/// Rank `slow` takes `slow_s` per step, every other rank `fast_s` (a compute trace).
fn trace(dir: &Path, ranks: usize, steps: u64, slow: usize, fast_s: f64, slow_s: f64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("compute.jsonl");
    let mut text = String::new();
    for rank in 0..ranks {
        for step in 0..steps {
            let seconds = if rank == slow { slow_s } else { fast_s };
            text.push_str(&format!(
                "{{\"rank\":{rank},\"step\":{step},\"seconds\":{seconds}}}\n"
            ));
        }
    }
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn an_unsynchronised_run_is_timed_by_its_slowest_rank() {
    let (ranks, steps) = (4, 12);
    let (fast, slow) = (0.1, 0.3);
    for algo in [
        "eager-sgd-solo",
        "ad-psgd",
        "d-psgd",
        "wagma",
        "allreduce-sgd",
    ] {
        let dir = out(&format!("slow-{algo}"));
        let mut c = config(algo, ranks, steps, 3, &dir);
        if let Algorithm::EagerSgd { sync_period, .. } = &mut c.algo.algorithm {
            // Never synchronise: nobody ever waits for the slow rank.
            *sync_period = None;
        }
        c.compute_trace = Some(trace(&dir, ranks, steps, 2, fast, slow));
        let s = run(&c);
        for e in curve(&dir) {
            // Rank 2 finishes iteration t after t slow steps and its (microsecond) messages; a
            // clock that followed rank 0 would say about t * 0.1 for the unsynchronised ones.
            let t = e.iteration as f64;
            let lo = t * slow;
            assert!(
                e.wall_s >= lo && e.wall_s < lo + 0.01,
                "{algo}: iteration {} dated {} s, the slow rank finished it at {lo} s",
                e.iteration,
                e.wall_s
            );
        }
        assert!(
            (s.wall_s - steps as f64 * slow).abs() < 0.01,
            "{algo}: {}",
            s.wall_s
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn evaluation_leaves_the_run_unchanged() {
    for algo in ["ad-psgd", "eager-sgd-solo", "wagma", "sgp"] {
        let often = out(&format!("eval-often-{algo}"));
        let once = out(&format!("eval-once-{algo}"));
        let mut c = config(algo, 4, 16, 2, &often);
        // Stragglers make the replicas drift apart between evaluations.
        c.imbalance = at_paper_scale(Profile::PaperResnet, 3);
        let a = run(&c);
        c.eval_every = 16;
        c.out = once.clone();
        let b = run(&c);
        assert_eq!(curve(&often).len(), 8);
        assert_eq!(curve(&once).len(), 1);
        let (ma, mb) = (
            std::fs::read(often.join(FINAL_MODEL)).unwrap(),
            std::fs::read(once.join(FINAL_MODEL)).unwrap(),
        );
        assert!(
            ma == mb,
            "{algo}: evaluating every 2 iterations changed the final model"
        );
        assert_eq!(a.wall_s, b.wall_s, "{algo}");
        assert_eq!(a.final_metrics, b.final_metrics, "{algo}");
        // The same last point, but for the training loss, which averages since the previous
        // evaluation.
        let strip = |mut e: EvalRecord| {
            e.train_loss = None;
            e
        };
        let last = strip(curve(&often).pop().unwrap());
        assert_eq!(last, strip(curve(&once).pop().unwrap()), "{algo}");
        std::fs::remove_dir_all(&often).unwrap();
        std::fs::remove_dir_all(&once).unwrap();
    }
}

#[test]
fn an_elastic_run_without_failures_is_the_run_without_elasticity() {
    // Only the global averages of an elastic WAGMA-SGD job over TCP admit restarted ranks;
    // elsewhere elasticity must not add a single collective to the training path. (The
    // methods with collectives over all ranks are left out: elastic ones run as exchanges
    // that survive a loss, which sum in another order.)
    for algo in ["ad-psgd", "d-psgd", "sgp"] {
        let plain = out(&format!("inelastic-{algo}"));
        let elastic = out(&format!("elastic-{algo}"));
        let mut c = config(algo, 4, 8, 8, &plain);
        c.imbalance = at_paper_scale(Profile::PaperResnet, 5);
        let a = run(&c);
        c.elastic = true;
        c.out = elastic.clone();
        let b = run(&c);
        assert!(
            std::fs::read(plain.join(FINAL_MODEL)).unwrap()
                == std::fs::read(elastic.join(FINAL_MODEL)).unwrap(),
            "{algo}: elasticity changed the final model"
        );
        // Elastic collectives over all ranks run as exchanges that survive a loss, so the
        // start-up's costs a few microseconds more; a collective per step would cost the
        // stragglers' 320 ms.
        assert!(
            (a.wall_s - b.wall_s).abs() < 1e-3,
            "{algo}: {} s against {} s",
            a.wall_s,
            b.wall_s
        );
        assert_eq!(a.final_metrics, b.final_metrics, "{algo}");
        std::fs::remove_dir_all(&plain).unwrap();
        std::fs::remove_dir_all(&elastic).unwrap();
    }
}

#[test]
fn no_algorithm_beats_the_no_wait_ideal_of_its_compute_draws() {
    for algo in Algorithm::NAMES {
        let dir = out(&format!("ideal-{algo}"));
        let mut c = config(algo, 5, 10, 5, &dir);
        c.imbalance = at_paper_scale(Profile::Lengths, 7);
        let s = run(&c);
        let ideal = s.ideal_s.expect("virtual time knows its ideal");
        assert!(ideal > 10.0 * 0.179, "{algo}: ideal {ideal}");
        assert!(
            s.wall_s >= ideal,
            "{algo}: {} s beats the ideal {ideal} s",
            s.wall_s
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn rank_zero_replica_is_reported_beside_the_consensus() {
    let dir = out("replica");
    let mut c = config("ad-psgd", 4, 12, 4, &dir);
    c.imbalance = at_paper_scale(Profile::PaperResnet, 1);
    run(&c);
    let points = curve(&dir);
    assert_eq!(points.len(), 3);
    for e in &points {
        let r0 = e.replica0.as_ref().expect("rank 0's replica is evaluated");
        assert!(r0.contains_key("accuracy") && e.consensus.contains_key("accuracy"));
        // AD-PSGD's replicas differ: the distance to their mean is positive.
        assert!(e.consensus_distance > 0.0, "{e:?}");
        assert_eq!(e.ranks_alive, 4);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
