//! Every collective against a sequential f64 reference, for random P, S, rounds, arrival
//! orders and per-rank delays, under the deterministic executor (many seeds) and with threads.

mod common;

use common::*;
use proptest::prelude::*;
use wagma::engine::{ContributionMode, ReadMode, Trigger};
use wagma::schedule::{AlgorithmChoice, AllreduceAlgorithm};
use wagma::topology::{ExponentialGraph, Grouping, GroupingKind, ring_neighbors};
use wagma::{EngineConfig, Payload};

fn algorithm(k: u8) -> EngineConfig {
    EngineConfig {
        algorithm: AlgorithmChoice {
            algorithm: match k % 4 {
                0 => AllreduceAlgorithm::Auto,
                1 => AllreduceAlgorithm::RecursiveDoubling,
                2 => AllreduceAlgorithm::ReduceScatterAllgather,
                _ => AllreduceAlgorithm::ReduceBroadcast,
            },
            small_bytes: 256,
            // Auto with the in-process executor's preference for pairs, for one value of k,
            // and with the TCP executor's for another (the executors set their own).
            shared_memory: k % 8 == 4,
            fold_on_arrival: k.is_multiple_of(8),
        },
        ..EngineConfig::default()
    }
}

/// A delay per rank and step: mostly short, sometimes long, from the seed.
fn delay(seed: u64, rank: usize, t: u64) -> std::time::Duration {
    let h = (seed
        ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ t.wrapping_mul(0xBF58_476D_1CE4_E5B9))
    .wrapping_mul(0x94D0_49BB_1331_11EB);
    let x = (h >> 40) % 100;
    ms(if x < 10 { 20 + x } else { x % 4 })
}

fn allreduce_case(exec: Exec, p: usize, len: usize, alg: u8, seed: u64) {
    let out = run(exec, p, algorithm(alg), async |c| {
        c.compute(delay(seed, c.rank(), 0)).await;
        let r = c.allreduce(Payload::Data(model(c.rank(), 0, len))).await?;
        // A second collective on the same connections must not mix with the first.
        let r2 = c.allreduce(Payload::Data(model(c.rank(), 1, len))).await?;
        let max = c
            .allreduce_max(Payload::Data(model(c.rank(), 2, len)))
            .await?;
        Ok((r.into_vec(), r2.into_vec(), max.into_vec()))
    })
    .into_all()
    .unwrap();
    // A maximum is exact: the same bits as the sequential one.
    let want_max: Vec<f32> = (0..len)
        .map(|i| {
            (0..p)
                .map(|r| value(r, 2, i))
                .max_by(f32::total_cmp)
                .unwrap_or_default()
        })
        .collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(
            bits(&o.2),
            bits(&want_max),
            "maximum: P={p} len={len} alg={alg} rank {rank}"
        );
    }
    for (k, pick) in [0u64, 1].into_iter().zip([0usize, 1]) {
        let want: Vec<f64> = (0..len)
            .map(|i| (0..p).map(|r| value(r, k, i) as f64).sum())
            .collect();
        for (rank, o) in out.iter().enumerate() {
            let got = if pick == 0 { &o.0 } else { &o.1 };
            assert!(close(got, &want), "P={p} len={len} alg={alg} rank {rank}");
            let first = if pick == 0 { &out[0].0 } else { &out[0].1 };
            assert_eq!(got, first, "ranks disagree bitwise");
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn rounds_case(
    exec: Exec,
    p: usize,
    s: usize,
    tau: Option<u64>,
    rounds: u64,
    seed: u64,
    trigger: Trigger,
    grouping: GroupingKind,
    read: ReadMode,
    alg: u8,
) {
    let len = 7;
    let g = Grouping::new(p, s, grouping).unwrap();
    let cfg = stream(
        s,
        grouping,
        trigger,
        ContributionMode::Model,
        read,
        tau,
        model(0, 0, len),
    );
    let results = run(exec, p, algorithm(alg), async |c| {
        let rank = c.rank();
        let mut init = cfg.clone();
        init.initial = Payload::Data(model(rank, 0, len));
        c.open_stream(init).await?;
        let mut seen = Vec::new();
        for t in 0..rounds {
            c.compute(delay(seed, rank, t)).await;
            let r = c
                .arrive(t, Payload::Data(model(rank, t + 1, len)), t + 1)
                .await?;
            check_round(rank, &r, &g, tau, len);
            if read == ReadMode::Exact {
                assert_eq!(r.round, t);
            }
            if let Trigger::Majority { seed } = trigger
                && r.round == t
                && r.kind == wagma::engine::RoundKind::Group
            {
                let init = wagma::engine::initiator(seed, t, p);
                if let Some(c) = r.members.iter().find(|c| c.rank == init) {
                    assert_eq!(c.steps, t + 1, "the initiator of round {t} must be fresh");
                }
            }
            if trigger == Trigger::Lockstep {
                assert!(r.fresh && r.members.iter().all(|m| m.steps == t + 1));
            }
            seen.push(r.round);
        }
        let stats = c.engine_stats().await?;
        Ok((seen, stats))
    })
    .into_all()
    .unwrap();
    let syncs = (0..rounds)
        .filter(|t| tau.is_some_and(|tau| (t + 1) % tau == 0))
        .count() as u64;
    for (rank, (seen, stats)) in results.iter().enumerate() {
        assert!(
            seen.windows(2).all(|w| w[0] <= w[1]),
            "rank {rank} went back in rounds: {seen:?}"
        );
        // Every group round ran exactly once at every rank, every sync too.
        assert_eq!(stats.rounds, rounds - syncs, "rank {rank}");
        assert_eq!(stats.syncs, syncs, "rank {rank}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn allreduce_matches_reference(p in 1usize..=40, len in 0usize..150, alg in 0u8..8, seed: u64) {
        allreduce_case(Exec::Virtual(seed), p, len, alg, seed);
    }

    #[test]
    fn group_rounds_match_their_members(
        p in 1usize..=40,
        s_frac in 0.0f64..1.0,
        tau in proptest::option::of(1u64..6),
        rounds in 1u64..14,
        seed: u64,
        trig in 0u8..3,
        grp in 0u8..3,
        exact: bool,
        alg in 0u8..8,
    ) {
        let s = 1 + ((p - 1) as f64 * s_frac).round() as usize;
        let trigger = match trig {
            0 => Trigger::Solo,
            1 => Trigger::Majority { seed: seed ^ 7 },
            _ => Trigger::Lockstep,
        };
        let grouping = match grp {
            0 => GroupingKind::Butterfly,
            1 => GroupingKind::Fixed,
            _ => GroupingKind::Random { seed: seed ^ 3 },
        };
        let read = if exact { ReadMode::Exact } else { ReadMode::Latest };
        rounds_case(Exec::Virtual(seed), p, s, tau, rounds, seed, trigger, grouping, read, alg);
    }

    #[test]
    fn neighbour_exchange_and_push_sum(p in 1usize..=40, n_frac in 0.0f64..1.0, t in 0u64..20, seed: u64) {
        let len = 5;
        let levels = if p > 1 { (usize::BITS - (p - 1).leading_zeros()) as usize } else { 0 };
        let n = 1 + ((levels.max(1) - 1) as f64 * n_frac) as usize;
        let graph = (p > 1 && n < p).then(|| ExponentialGraph::new(p, n).unwrap());
        let out = run(Exec::Virtual(seed), p, EngineConfig::default(), async |c| {
            let rank = c.rank();
            c.compute(delay(seed, rank, t)).await;
            let nb = ring_neighbors(rank, p);
            let ring = c.exchange(2 * t, &nb, &nb, Payload::Data(model(rank, t, len)), 1.0, t).await?;
            let push = match &graph {
                Some(g) => {
                    let mut x = Payload::Data(model(rank, t, len));
                    let k = 1.0 / (n + 1) as f64;
                    x.scale(k as f32);
                    let e = c.exchange(2 * t + 1, &g.out_peers(rank, t), &g.in_peers(rank, t), x, k, t).await?;
                    Some((e.data.into_vec(), e.weight))
                }
                None => None,
            };
            Ok((ring.data.into_vec(), push))
        }).into_all().unwrap();
        let mut mass = 0.0;
        for (rank, (ring, push)) in out.iter().enumerate() {
            let mut who = ring_neighbors(rank, p);
            who.push(rank);
            let want: Vec<f64> = (0..len).map(|i| who.iter().map(|&r| value(r, t, i) as f64).sum()).collect();
            prop_assert!(close(ring, &want));
            if let (Some((x, w)), Some(g)) = (push, &graph) {
                let mut who = g.in_peers(rank, t);
                who.push(rank);
                let k = 1.0 / (n + 1) as f64;
                let want: Vec<f64> = (0..len).map(|i| who.iter().map(|&r| value(r, t, i) as f64 * k).sum()).collect();
                prop_assert!(close(x, &want));
                mass += w;
            }
        }
        if graph.is_some() {
            // Push-sum conserves the total weight.
            prop_assert!((mass - p as f64).abs() < 1e-9, "mass {mass}");
        }
    }
}

#[test]
fn threaded_allreduce_matches_reference() {
    for (p, len, alg) in [
        (1, 10, 0),
        (3, 1000, 0),
        (4, 5000, 1),
        (7, 333, 2),
        (8, 1 << 16, 0),
    ] {
        allreduce_case(Exec::Threads, p, len, alg, 11);
    }
}

#[test]
fn threaded_rounds_match_their_members() {
    rounds_case(
        Exec::Threads,
        8,
        4,
        Some(4),
        12,
        5,
        Trigger::Solo,
        GroupingKind::Butterfly,
        ReadMode::Latest,
        0,
    );
    rounds_case(
        Exec::Threads,
        6,
        3,
        Some(3),
        9,
        6,
        Trigger::Majority { seed: 2 },
        GroupingKind::Butterfly,
        ReadMode::Exact,
        2,
    );
    rounds_case(
        Exec::Threads,
        5,
        2,
        None,
        8,
        7,
        Trigger::Lockstep,
        GroupingKind::Random { seed: 1 },
        ReadMode::Latest,
        1,
    );
}
