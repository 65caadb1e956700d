//! The combination rules pinned with numbers at the `Worker` level: WAGMA's fresh and stale
//! rules (paper and damped), the singleton no-op, SGP's push-sum with unequal weights, the
//! average-then-step order, and eager-SGD's buffer averaging at its synchronous rounds.
//!
//! Every expected value is computed in this file by hand-written f64 arithmetic on the known
//! inputs (plain SGD, constant rate, gradients chosen per rank and step), following the
//! schedule the delays produce; none calls the library's mixing code. The runs use the
//! virtual-time executor with a jitter-free network, so each scenario is deterministic.

use std::time::Duration;

use wagma::algo::{
    AlgoConfig, Algorithm, CombineRule, EagerMode, LateGradients, OptimizerConfig, Order, Resume,
    StepReport, WagmaOptions, Worker,
};
use wagma::exec::virtual_time;
use wagma::topology::{Grouping, GroupingKind, PeerOffsets};
use wagma::{Comm, ConfigError, EngineConfig, Error, Payload};

/// Two parameters per replica, as f64 for the references.
type V = [f64; 2];

fn add(a: V, b: V) -> V {
    [a[0] + b[0], a[1] + b[1]]
}

fn scale(a: V, k: f64) -> V {
    [a[0] * k, a[1] * k]
}

fn v(x: [f32; 2]) -> V {
    [f64::from(x[0]), f64::from(x[1])]
}

/// Plain SGD: `w - lr * g`.
fn sgd(w: V, lr: f32, g: [f32; 2]) -> V {
    add(w, scale(v(g), -f64::from(lr)))
}

fn assert_close(what: &str, got: &[f32], want: V) {
    assert_eq!(got.len(), 2, "{what}");
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (whole: {got:?} vs {want:?})"
        );
    }
}

/// A deterministic run: virtual time over a network without jitter (5 us per message).
fn run_virtual<R, F>(p: usize, task: F) -> Vec<R>
where
    F: AsyncFn(&mut Comm) -> Result<R, Error>,
{
    let network = virtual_time::JitterNetwork {
        jitter: 0.0,
        ..virtual_time::JitterNetwork::default()
    };
    let vcfg = virtual_time::VirtualConfig {
        seed: 1,
        network: Box::new(network),
    };
    virtual_time::run(p, EngineConfig::default(), vcfg, task)
        .expect("at least one rank")
        .into_all()
        .expect("every rank succeeds")
}

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

/// What a rank saw at each step: the report and its model after the step.
type Trace = Vec<(StepReport, Vec<f32>)>;

// ---------------------------------------------------------------------------------------------
// 1. WAGMA's fresh and stale rules with a late rank.
// ---------------------------------------------------------------------------------------------

const LR: f32 = 0.5;
const P4_INIT: [[f32; 2]; 4] = [[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0], [2.0, 2.0]];
/// `P4_GRAD[t][r]`: the gradient rank r hands over at step t.
const P4_GRAD: [[[f32; 2]; 4]; 3] = [
    [[0.5, 1.0], [-1.0, 0.25], [2.0, -0.5], [0.75, 1.5]],
    [[-0.25, 0.5], [1.5, -1.0], [0.5, 0.5], [-2.0, 1.0]],
    [[1.0, -1.5], [0.25, 0.75], [-0.5, 2.0], [1.25, -0.25]],
];
const LATE: usize = 3;

/// Compute time before each step. Step 0: everyone 1 ms (simultaneous arrivals). Step 1: rank
/// 3 computes 100 ms, so the others run round 1 without it. Step 2: ranks 0-2 compute 300 ms,
/// so rank 3 (arriving at about 102 ms) activates round 2 while they are busy.
fn p4_delay(rank: usize, t: u64) -> Duration {
    match (rank, t) {
        (LATE, 1) => ms(100),
        (r, 2) if r != LATE => ms(300),
        _ => ms(1),
    }
}

fn wagma_p4(combine: CombineRule) -> Vec<Trace> {
    let cfg = AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        group_size: Some(2),
        tau: None,
        combine,
        ..WagmaOptions::default()
    }));
    run_virtual(4, async |c: &mut Comm| {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            cfg.clone(),
            OptimizerConfig::sgd(LR),
            Payload::Data(P4_INIT[rank].to_vec()),
            Payload::Data(Vec::new()),
        )
        .await?;
        let mut trace = Vec::new();
        for (t, grads) in P4_GRAD.iter().enumerate() {
            w.comm().compute(p4_delay(rank, t as u64)).await;
            let report = w.step(&grads[rank]).await?;
            trace.push((report, w.params().to_vec()));
        }
        Ok(trace)
    })
}

/// The models after each step, by hand. Groups (P = 4, S = 2 butterfly): rounds 0 and 2
/// {0,1},{2,3}; round 1 {0,2},{1,3}. A member contributes the W' it published at its latest
/// arrival (the model its local step produced, before that round's averaging).
fn wagma_p4_expected(combine: CombineRule) -> [[V; 4]; 3] {
    let fresh = |sum: V, own: V, k: f64| match combine {
        // The paper: own W' is already in the sum.
        CombineRule::Paper => scale(sum, 1.0 / k),
        // The released code: own counted twice.
        CombineRule::Damped => scale(add(sum, own), 1.0 / (k + 1.0)),
    };
    let stale = |sum: V, own: V, k: f64| scale(add(sum, own), 1.0 / (k + 1.0));
    let w0: [V; 4] = P4_INIT.map(v);

    // Step 0, round 0 ({0,1},{2,3}): everyone arrives at 1 ms, everyone fresh.
    let p0: [V; 4] = std::array::from_fn(|r| sgd(w0[r], LR, P4_GRAD[0][r]));
    let s01 = add(p0[0], p0[1]);
    let s23 = add(p0[2], p0[3]);
    let w1 = [
        fresh(s01, p0[0], 2.0),
        fresh(s01, p0[1], 2.0),
        fresh(s23, p0[2], 2.0),
        fresh(s23, p0[3], 2.0),
    ];

    // Step 1, round 1 ({0,2},{1,3}): ranks 0-2 arrive at about 2 ms and run it; rank 3 is
    // computing, so its engine contributes its last published W' (p0[3], one step old). Rank
    // 3 arrives at about 101 ms, finds round 1 done (round 2 is not: the others compute until
    // about 302 ms) and applies the stale rule with its own new W' (p1[3]).
    let p1: [V; 4] = std::array::from_fn(|r| sgd(w1[r], LR, P4_GRAD[1][r]));
    let s02 = add(p1[0], p1[2]);
    let s13 = add(p1[1], p0[3]);
    let w2 = [
        fresh(s02, p1[0], 2.0),
        fresh(s13, p1[1], 2.0),
        fresh(s02, p1[2], 2.0),
        stale(s13, p1[3], 2.0),
    ];

    // Step 2, round 2 ({0,1},{2,3}): rank 3 arrives at about 102 ms and activates it; ranks
    // 0-2 are computing, so every one of them contributes p1. Rank 3 is fresh; ranks 0-2
    // arrive at about 302 ms and find the round done: stale rule with their own p2.
    let p2: [V; 4] = std::array::from_fn(|r| sgd(w2[r], LR, P4_GRAD[2][r]));
    let s01 = add(p1[0], p1[1]);
    let s23 = add(p1[2], p2[3]);
    let w3 = [
        stale(s01, p2[0], 2.0),
        stale(s01, p2[1], 2.0),
        stale(s23, p2[2], 2.0),
        fresh(s23, p2[3], 2.0),
    ];
    [w1, w2, w3]
}

/// Checks the trace of the late-rank scenario against the hand computation.
fn check_wagma_p4(combine: CombineRule) -> [[V; 4]; 3] {
    let got = wagma_p4(combine);
    let want = wagma_p4_expected(combine);
    // The schedule the delays are meant to produce: (fresh, round) per step and rank.
    let shape = |rank: usize, t: usize| -> (bool, u64) {
        match (t, rank) {
            (0, _) => (true, 0),
            (1, LATE) => (false, 1),
            (1, _) => (true, 1),
            (2, LATE) => (true, 2),
            (2, _) => (false, 2),
            _ => unreachable!(),
        }
    };
    for (rank, trace) in got.iter().enumerate() {
        assert_eq!(trace.len(), 3);
        for (t, (report, params)) in trace.iter().enumerate() {
            let (fresh, round) = shape(rank, t);
            assert_eq!(report.iteration, t as u64);
            assert_eq!(
                (report.fresh, report.round, report.synced),
                (Some(fresh), Some(round), false),
                "{combine:?}: rank {rank} step {t}: not the intended schedule"
            );
            assert_close(
                &format!("{combine:?}: rank {rank} after step {t}"),
                params,
                want[t][rank],
            );
        }
    }
    want
}

#[test]
fn a_late_rank_uses_the_stale_rule_and_fresh_members_divide_by_the_group_size() {
    let paper = check_wagma_p4(CombineRule::Paper);
    // Spot values of the hand computation (so that a mistake in the reference shows):
    // p0[3] = [2, 2] - 0.5 [0.75, 1.5] = [1.625, 1.25]; w1[1] = (p0[0] + p0[1]) / 2 =
    // ([0.75, -2.5] + [3.5, 0.375]) / 2 = [2.125, -1.0625]; p1[1] = w1[1] - 0.5 [1.5, -1] =
    // [1.375, -0.5625]; w1[3] = ([-2, 4.25] + p0[3]) / 2 = [-0.1875, 2.75]; p1[3] =
    // w1[3] - 0.5 [-2, 1] = [0.8125, 2.25].
    // Late rank 3 after step 1 (stale): (p1[1] + p0[3] + p1[3]) / 3 = [3.8125, 2.9375] / 3.
    let r3 = paper[1][LATE];
    assert!((r3[0] - 3.8125 / 3.0).abs() < 1e-12 && (r3[1] - 2.9375 / 3.0).abs() < 1e-12);
    // Rank 1 after step 1 (fresh, |G| = 2): (p1[1] + p0[3]) / 2 = [1.5, 0.34375].
    assert_eq!(paper[1][1], [1.5, 0.34375]);
}

#[test]
fn the_damped_rule_always_counts_the_own_model_twice() {
    let damped = check_wagma_p4(CombineRule::Damped);
    let paper = wagma_p4_expected(CombineRule::Paper);
    // The two rules differ already after the first (all-fresh) round: rank 0 is
    // (2 p0[0] + p0[1]) / 3 = [5, -4.625] / 3 instead of (p0[0] + p0[1]) / 2, with
    // p0[0] = [0.75, -2.5], p0[1] = [3.5, 0.375].
    assert!((damped[0][0][0] - 5.0 / 3.0).abs() < 1e-12);
    assert!((damped[0][0][1] - (-4.625 / 3.0)).abs() < 1e-12);
    assert_eq!(paper[0][0], [2.125, -1.0625]);
    for t in 0..3 {
        for r in 0..4 {
            assert_ne!(damped[t][r], paper[t][r], "step {t} rank {r}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A rank alone in its group keeps the model its local step produced.
// ---------------------------------------------------------------------------------------------

/// `GRAD3[t][r]`, dyadic values so that plain SGD with rate 0.5 is exact in f32.
const GRAD3: [[[f32; 2]; 3]; 4] = [
    [[0.5, -1.0], [1.25, 0.75], [-2.0, 0.5]],
    [[1.5, 0.25], [-0.5, 1.0], [0.75, -1.25]],
    [[-1.0, 2.0], [0.25, -0.5], [1.0, 1.0]],
    [[0.25, 0.5], [-1.5, -0.25], [0.5, -0.75]],
];
const INIT3: [[f32; 2]; 3] = [[1.0, 2.0], [-1.0, 0.5], [3.0, -2.0]];

/// WAGMA on 3 ranks with group size `s`, no sync, equal compute, wait-avoiding or blocking
/// groups: per rank, the model before each step, and what the step reported with the model
/// after it.
fn wagma_p3(s: usize, wait_avoiding: bool) -> Vec<(Vec<Vec<f32>>, Trace)> {
    let cfg = AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        group_size: Some(s),
        tau: None,
        wait_avoiding,
        ..WagmaOptions::default()
    }));
    run_virtual(3, async |c: &mut Comm| {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            cfg.clone(),
            OptimizerConfig::sgd(LR),
            Payload::Data(INIT3[rank].to_vec()),
            Payload::Data(Vec::new()),
        )
        .await?;
        let (mut before, mut trace) = (Vec::new(), Vec::new());
        for grads in &GRAD3 {
            w.comm().compute(ms(1)).await;
            before.push(w.params().to_vec());
            let report = w.step(&grads[rank]).await?;
            trace.push((report, w.params().to_vec()));
        }
        Ok((before, trace))
    })
}

#[test]
fn a_singleton_round_leaves_the_local_step_untouched() {
    // S = 1: every rank is alone in every round, so WAGMA is purely local SGD. With dyadic
    // inputs and rate 0.5 every value is exact: the check is bit for bit.
    for (rank, (before, trace)) in wagma_p3(1, true).iter().enumerate() {
        for (t, (report, after)) in trace.iter().enumerate() {
            assert_eq!(report.round, Some(t as u64));
            let want: Vec<f32> = before[t]
                .iter()
                .zip(&GRAD3[t][rank])
                .map(|(&w, &g)| w + -LR * g)
                .collect();
            assert_eq!(after, &want, "rank {rank} step {t}");
        }
        let mut closed = v(INIT3[rank]);
        for g in &GRAD3 {
            closed = sgd(closed, LR, g[rank]);
        }
        assert_eq!(v([trace[3].1[0], trace[3].1[1]]), closed, "rank {rank}");
    }
    // Rank 0 by hand: [1, 2] - 0.5 * ([0.5, -1] + [1.5, 0.25] + [-1, 2] + [0.25, 0.5]).
    assert_eq!(wagma_p3(1, true)[0].1[3].1, vec![0.375, 1.125]);

    // S = 2 on 3 ranks: each round pairs two ranks and leaves one alone. The lone rank keeps
    // exactly its W', bit for bit, whether the groups are wait-avoiding or blocking (with
    // wait-avoiding groups the lone rank, which needs no network, runs ahead and activates
    // the next round before the pair has finished, so pairs can be stale there).
    let grouping = Grouping::new(3, 2, GroupingKind::Butterfly).unwrap();
    for wait_avoiding in [true, false] {
        let mut singletons = 0;
        for (rank, (before, trace)) in wagma_p3(2, wait_avoiding).iter().enumerate() {
            for (t, (report, after)) in trace.iter().enumerate() {
                let g = grouping.group_of(rank, t as u64);
                assert!(g.len() <= 2 && g.contains(&rank));
                if g.len() == 1 {
                    singletons += 1;
                    assert_eq!(report.round, Some(t as u64));
                    let want: Vec<f32> = before[t]
                        .iter()
                        .zip(&GRAD3[t][rank])
                        .map(|(&w, &g)| w + -LR * g)
                        .collect();
                    assert_eq!(after, &want, "lone rank {rank} step {t} ({wait_avoiding})");
                }
            }
        }
        assert_eq!(singletons, GRAD3.len(), "one lone rank per round");
    }
    // With blocking groups every member is fresh: the pair's model is the mean of the two
    // W', the lone rank's its own W'.
    let got = wagma_p3(2, false);
    let mut w: [V; 3] = INIT3.map(v);
    for (t, grads) in GRAD3.iter().enumerate() {
        let stepped: [V; 3] = std::array::from_fn(|r| sgd(w[r], LR, grads[r]));
        let next: [V; 3] = std::array::from_fn(|r| match grouping.group_of(r, t as u64)[..] {
            [a, b] => scale(add(stepped[a], stepped[b]), 0.5),
            _ => stepped[r],
        });
        for (rank, (_, trace)) in got.iter().enumerate() {
            let (report, after) = &trace[t];
            assert_eq!(report.round, Some(t as u64), "rank {rank} step {t}");
            if grouping.group_of(rank, t as u64).len() == 2 {
                assert_eq!(report.fresh, Some(true), "rank {rank} step {t}");
            }
            assert_close(&format!("S=2 rank {rank} step {t}"), after, next[rank]);
        }
        w = next;
    }
    // Round 0 by hand: the partition is {0, 2}, {1}. Rank 1 keeps its W'
    // [-1, 0.5] - 0.5 [1.25, 0.75] = [-1.625, 0.125]; ranks 0 and 2 take the mean of
    // [0.75, 2.5] and [3, -2] - 0.5 [-2, 0.5] = [4, -2.25]: [2.375, 0.125].
    assert_eq!(grouping.partition(0), vec![vec![0, 2], vec![1]]);
    assert_eq!(got[1].1[0].1, vec![-1.625, 0.125]);
    assert_eq!(got[0].1[0].1, vec![2.375, 0.125]);
    assert_eq!(got[2].1[0].1, vec![2.375, 0.125]);
}

// ---------------------------------------------------------------------------------------------
// 3. SGP: push-sum with weights that differ from 1.
// ---------------------------------------------------------------------------------------------

/// Push-sum on the directed exponential graph, P = 3, one peer: levels L = ceil(log2 3) = 2,
/// so at step t every rank pushes to `r + 2^(t mod 2)` (mod 3) and receives from
/// `r - 2^(t mod 2)`: offsets 1, 2, 1, ... Each rank holds the de-biased model z (what
/// `Worker::params` shows) and a weight w; its numerator is x = z * w. One step at rank i:
///   z'_i = z_i - lr * g_i                        (the local SGD step on the de-biased model)
///   share_i = w_i / (peers + 1) = w_i / 2
///   keeps (share_i * z'_i, share_i) and pushes the same pair to its out-peer
///   x_i <- share_i z'_i + share_j z'_j, w_i <- share_i + share_j   (j its in-peer)
///   z_i <- x_i / w_i
/// Every rank has in-degree 1 in this graph, so from uniform weights they stay exactly 1;
/// the test resumes from unequal weights [0.5, 1, 1.5] (total mass 3) to exercise the
/// de-biasing.
fn push_sum_reference(weights: [f64; 3]) -> Vec<([V; 3], [f64; 3])> {
    let mut z: [V; 3] = INIT3.map(v);
    let mut w = weights;
    let mut out = Vec::new();
    for (t, grads) in GRAD3.iter().enumerate().take(3) {
        let offset = 1usize << (t % 2);
        let stepped: [V; 3] = std::array::from_fn(|r| sgd(z[r], LR, grads[r]));
        let share: [f64; 3] = std::array::from_fn(|r| w[r] / 2.0);
        let mut x = [[0.0; 2]; 3];
        let mut nw = [0.0; 3];
        for i in 0..3 {
            let j = (i + 3 - offset) % 3;
            x[i] = add(scale(stepped[i], share[i]), scale(stepped[j], share[j]));
            nw[i] = share[i] + share[j];
        }
        z = std::array::from_fn(|i| scale(x[i], 1.0 / nw[i]));
        w = nw;
        out.push((z, w));
    }
    out
}

fn sgp_p3(weights: Option<[f64; 3]>) -> Vec<Vec<(Vec<f32>, f64)>> {
    let cfg = AlgoConfig::new(Algorithm::Sgp {
        peers: 1,
        offsets: PeerOffsets::Disjoint,
    });
    run_virtual(3, async |c: &mut Comm| {
        let rank = c.rank();
        let resume = Resume {
            weight: weights.map(|w| w[rank]),
            ..Resume::default()
        };
        let mut w = Worker::resume(
            c,
            cfg.clone(),
            OptimizerConfig::sgd(LR),
            Payload::Data(INIT3[rank].to_vec()),
            Payload::Data(Vec::new()),
            resume,
        )
        .await?;
        let mut trace = Vec::new();
        for grads in GRAD3.iter().take(3) {
            w.comm().compute(ms(1)).await;
            let report = w.step(&grads[rank]).await?;
            let weight = report.weight.expect("SGP reports its weight");
            assert_eq!(w.weight(), Some(weight));
            trace.push((w.params().to_vec(), weight));
        }
        Ok(trace)
    })
}

#[test]
fn push_sum_de_biases_by_the_weight() {
    let weights = [0.5, 1.0, 1.5];
    let want = push_sum_reference(weights);
    // Weights by hand: t=0 (from r-1): [0.25+0.75, 0.5+0.25, 0.75+0.5] = [1, 0.75, 1.25];
    // t=1 (from r-2 = r+1): [0.5+0.375, 0.375+0.625, 0.625+0.5] = [0.875, 1, 1.125];
    // t=2 (from r-1): [0.4375+0.5625, 0.5+0.4375, 0.5625+0.5] = [1, 0.9375, 1.0625].
    assert_eq!(want[0].1, [1.0, 0.75, 1.25]);
    assert_eq!(want[1].1, [0.875, 1.0, 1.125]);
    assert_eq!(want[2].1, [1.0, 0.9375, 1.0625]);
    // Rank 1 after step 0: z' = [-1.625, 0.125] (own, share 0.5), rank 0's z' = [0.75, 2.5]
    // (share 0.25): ([-0.8125, 0.0625] + [0.1875, 0.625]) / 0.75 = [-0.8333.., 0.9166..].
    assert!((want[0].0[1][0] - (-0.625 / 0.75)).abs() < 1e-12);
    assert!((want[0].0[1][1] - (0.6875 / 0.75)).abs() < 1e-12);
    let got = sgp_p3(Some(weights));
    for (rank, trace) in got.iter().enumerate() {
        for (t, (params, weight)) in trace.iter().enumerate() {
            assert!(
                (weight - want[t].1[rank]).abs() < 1e-12,
                "rank {rank} step {t}: weight {weight}, want {}",
                want[t].1[rank]
            );
            assert_close(&format!("rank {rank} step {t}"), params, want[t].0[rank]);
        }
    }
    for t in 0..3 {
        let mass: f64 = got.iter().map(|tr| tr[t].1).sum();
        assert!((mass - 3.0).abs() < 1e-12, "step {t}: mass {mass}");
    }

    // From uniform weights (a fresh start) they stay exactly 1 and the model is the plain
    // average of the own and the in-peer's W'.
    let want = push_sum_reference([1.0; 3]);
    for (rank, trace) in sgp_p3(None).iter().enumerate() {
        for (t, (params, weight)) in trace.iter().enumerate() {
            assert_eq!(*weight, 1.0, "rank {rank} step {t}");
            assert_close(
                &format!("uniform rank {rank} step {t}"),
                params,
                want[t].0[rank],
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Average-then-step.
// ---------------------------------------------------------------------------------------------

/// Rank r minimises 0.5 |W - C[r]|^2: its gradient at W is W - C[r].
const C3: [[f32; 2]; 3] = [[2.0, -1.0], [-3.0, 0.5], [1.0, 4.0]];
const LR4: f32 = 0.25;

fn order_run(algorithm: Algorithm, order: Order, steps: usize) -> Vec<Vec<f32>> {
    let cfg = AlgoConfig {
        order,
        ..AlgoConfig::new(algorithm)
    };
    run_virtual(3, async |c: &mut Comm| {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            cfg.clone(),
            OptimizerConfig::sgd(LR4),
            Payload::Data(INIT3[rank].to_vec()),
            Payload::Data(Vec::new()),
        )
        .await?;
        for _ in 0..steps {
            w.comm().compute(ms(1)).await;
            let g: Vec<f32> = w
                .params()
                .iter()
                .zip(&C3[rank])
                .map(|(x, c)| x - c)
                .collect();
            w.step(&g).await?;
        }
        Ok(w.params().to_vec())
    })
}

/// Average-then-step by hand, on 3 ranks: at a step with averaging,
/// `W_{t+1}^i = mean_j W_t^j - lr (W_t^i - C_i)` (the gradient taken at the rank's own W_t
/// before the averaging); without, `W_t^i - lr (W_t^i - C_i)`. `average_at(t)` says which.
fn average_then_step(steps: usize, average_at: impl Fn(usize) -> bool) -> [V; 3] {
    let mut w: [V; 3] = INIT3.map(v);
    for t in 0..steps {
        let mean = scale(add(add(w[0], w[1]), w[2]), 1.0 / 3.0);
        w = std::array::from_fn(|i| {
            let step = scale(add(w[i], scale(v(C3[i]), -1.0)), -f64::from(LR4));
            add(if average_at(t) { mean } else { w[i] }, step)
        });
    }
    w
}

#[test]
fn average_then_step_averages_w_and_adds_the_gradient_taken_at_w() {
    // D-PSGD on 3 ranks: both ring neighbours are the other two ranks, 1/3 each, so it
    // averages over everyone every step, like local SGD with H = 1.
    let every = average_then_step(2, |_| true);
    // Rank 0 by hand: mean W_0 = [1, 1/6]; W_1^0 = [1, 1/6] - 0.25 ([1, 2] - [2, -1])
    // = [1.25, -7/12].
    let w1 = average_then_step(1, |_| true);
    assert!((w1[0][0] - 1.25).abs() < 1e-12 && (w1[0][1] - (-7.0 / 12.0)).abs() < 1e-12);
    for (algorithm, want) in [
        (Algorithm::DPsgd, every),
        (Algorithm::LocalSgd { period: 1 }, every),
        // H = 2: step 0 is purely local, step 1 averages.
        (
            Algorithm::LocalSgd { period: 2 },
            average_then_step(2, |t| t == 1),
        ),
    ] {
        let label = algorithm.label();
        let got = order_run(algorithm.clone(), Order::AverageThenStep, 2);
        for (rank, params) in got.iter().enumerate() {
            assert_close(&format!("{label} rank {rank}"), params, want[rank]);
        }
        // The replicas differ (each adds its own step after the average), unlike
        // step-then-average, which leaves every replica at the same average.
        assert!((got[0][0] - got[1][0]).abs() > 0.1, "{label}: {got:?}");
        let sta = order_run(algorithm, Order::StepThenAverage, 2);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        assert!(sta.iter().all(|p| same(p, &sta[0])), "{label}: {sta:?}");
    }
}

#[test]
fn average_then_step_is_rejected_for_gradient_averaging_algorithms() {
    for algorithm in [
        Algorithm::AllreduceSgd,
        Algorithm::EagerSgd {
            mode: EagerMode::Solo,
            sync_period: Some(2),
            late: LateGradients::Accumulate,
        },
        Algorithm::EagerSgd {
            mode: EagerMode::Majority,
            sync_period: None,
            late: LateGradients::Accumulate,
        },
    ] {
        let cfg = AlgoConfig {
            order: Order::AverageThenStep,
            ..AlgoConfig::new(algorithm.clone())
        };
        assert!(
            matches!(
                cfg.validate(3),
                Err(ConfigError::Invalid { what: "order", .. })
            ),
            "{}: {:?}",
            algorithm.label(),
            cfg.validate(3)
        );
        // The default order is fine.
        AlgoConfig::new(algorithm).validate(3).unwrap();
    }
    for algorithm in [Algorithm::DPsgd, Algorithm::LocalSgd { period: 1 }] {
        let cfg = AlgoConfig {
            order: Order::AverageThenStep,
            ..AlgoConfig::new(algorithm)
        };
        cfg.validate(3).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Eager-SGD averages the buffers at its synchronous rounds.
// ---------------------------------------------------------------------------------------------

#[test]
fn eager_sgd_averages_buffers_at_its_sync_rounds() {
    // `BUF[t][r]`: what rank r stores in its buffers before step t.
    const BUF: [[[f32; 2]; 3]; 2] = [
        [[1.0, 10.0], [2.0, 20.0], [4.0, 40.0]],
        [[-1.0, 0.0], [1.0, 1.0], [3.0, 4.0]],
    ];
    let cfg = AlgoConfig::new(Algorithm::EagerSgd {
        mode: EagerMode::Solo,
        sync_period: Some(2),
        late: LateGradients::Accumulate,
    });
    let got = run_virtual(3, async |c: &mut Comm| {
        let rank = c.rank();
        let mut w = Worker::new(
            c,
            cfg.clone(),
            OptimizerConfig::sgd(LR),
            Payload::Data(INIT3[rank].to_vec()),
            Payload::Data(vec![0.0; 2]),
        )
        .await?;
        let mut trace = Vec::new();
        for (t, bufs) in BUF.iter().enumerate() {
            w.comm().compute(ms(1 + rank as u64)).await;
            w.buffers_mut().copy_from_slice(&bufs[rank]);
            let report = w.step(&GRAD3[t][rank]).await?;
            trace.push((report.synced, w.buffers().to_vec()));
        }
        Ok(trace)
    });
    for (rank, trace) in got.iter().enumerate() {
        // Step 0 is a partial round: the gradient stream carries no buffers.
        assert_eq!(trace[0], (false, BUF[0][rank].to_vec()), "rank {rank}");
        // Step 1 is a sync: the mean of what the ranks stored before it,
        // [(-1 + 1 + 3) / 3, (0 + 1 + 4) / 3] = [1, 5/3].
        assert!(trace[1].0, "rank {rank}: step 1 must be a sync");
        assert_close(
            &format!("rank {rank} buffers"),
            &trace[1].1,
            [1.0, 5.0 / 3.0],
        );
    }
}
