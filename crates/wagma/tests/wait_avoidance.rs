//! The wait-avoiding group allreduce under the deterministic executor: who waits, what a late
//! rank contributes, what the results say, and that a seed replays a run exactly.

mod common;

use std::time::Duration;

use common::*;
use wagma::engine::{ContributionMode, ReadMode, RoundKind, Trigger};
use wagma::topology::{Grouping, GroupingKind};
use wagma::{EngineConfig, Payload};

const P: usize = 8;
const S: usize = 4;
const LEN: usize = 16;
const SLOW: usize = 5;

/// What a rank saw at one arrival.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    requested: u64,
    round: u64,
    fresh: bool,
    steps: Vec<u64>,
    waited: Duration,
    kind: RoundKind,
}

struct Observed {
    rounds: Vec<Seen>,
    max_staleness: u64,
}

/// Rank `SLOW` computes for `slow` per step, the others for 1 ms.
fn job(seed: u64, tau: Option<u64>, slow: Duration, steps: u64) -> Vec<Observed> {
    let g = Grouping::new(P, S, GroupingKind::Butterfly).unwrap();
    let cfg = stream(
        S,
        GroupingKind::Butterfly,
        Trigger::Solo,
        ContributionMode::Model,
        ReadMode::Latest,
        tau,
        vec![],
    );
    run(Exec::Virtual(seed), P, EngineConfig::default(), async |c| {
        let rank = c.rank();
        let mut init = cfg.clone();
        init.initial = Payload::Data(model(rank, 0, LEN));
        c.open_stream(init).await?;
        let mut rounds = Vec::new();
        for t in 0..steps {
            c.compute(if rank == SLOW { slow } else { ms(1) }).await;
            let t0 = c.now();
            let r = c
                .arrive(t, Payload::Data(model(rank, t + 1, LEN)), t + 1)
                .await?;
            let waited = c.now() - t0;
            check_round(rank, &r, &g, tau, LEN);
            rounds.push(Seen {
                requested: t,
                round: r.round,
                fresh: r.fresh,
                steps: r.members.iter().map(|m| m.steps).collect(),
                waited,
                kind: r.kind,
            });
        }
        Ok(Observed {
            rounds,
            max_staleness: c.stats().staleness.max().unwrap_or(0),
        })
    })
    .into_all()
    .unwrap()
}

#[test]
fn the_fastest_rank_never_waits_for_a_late_member() {
    let obs = job(1, None, ms(50), 30);
    for (rank, o) in obs.iter().enumerate() {
        if rank == SLOW {
            continue;
        }
        for s in &o.rounds {
            // Only network time: the slow member is 49 ms behind per step.
            assert!(
                s.waited < ms(1),
                "rank {rank} waited {:?} in round {}",
                s.waited,
                s.requested
            );
        }
    }
}

#[test]
fn a_late_rank_contributes_its_previous_model_and_the_result_says_so() {
    let obs = job(2, None, ms(50), 30);
    let slow = &obs[SLOW];
    let stale = slow.rounds.iter().filter(|s| !s.fresh).count();
    assert!(slow.rounds.iter().all(|s| s.round >= s.requested));
    assert!(
        stale > 20,
        "the slow rank should find most rounds already run ({stale} of 30)"
    );
    // In the groups of its fast peers, the slow rank shows up with an older model.
    let grouping = Grouping::new(P, S, GroupingKind::Butterfly).unwrap();
    let mut seen_stale = 0;
    for (rank, o) in obs.iter().enumerate() {
        if rank == SLOW {
            continue;
        }
        for s in &o.rounds {
            let g = grouping.group_of(rank, s.round);
            if let Some(i) = g.iter().position(|&m| m == SLOW) {
                assert!(
                    s.steps[i] < s.round + 1,
                    "the slow rank cannot be fresh in round {}",
                    s.round
                );
                seen_stale += 1;
            }
        }
    }
    assert!(seen_stale > 10);
}

#[test]
fn a_global_sync_waits_for_everyone_and_bounds_staleness() {
    let tau = 5;
    let obs = job(3, Some(tau), ms(30), 40);
    for (rank, o) in obs.iter().enumerate() {
        assert!(
            o.max_staleness <= tau,
            "rank {rank}: staleness {} > tau",
            o.max_staleness
        );
        for s in &o.rounds {
            let t = s.requested;
            if (t + 1).is_multiple_of(tau) {
                assert_eq!(s.kind, RoundKind::Sync);
                assert_eq!(s.round, t);
                assert!(
                    s.steps.iter().all(|&x| x == t + 1),
                    "sync {t}: {:?}",
                    s.steps
                );
                if rank != SLOW {
                    assert!(
                        s.waited > ms(20),
                        "rank {rank} should wait for the slow rank at sync {t}"
                    );
                }
            } else {
                assert_eq!(s.kind, RoundKind::Group);
            }
        }
    }
}

#[test]
fn the_same_seed_replays_the_same_run() {
    let a = job(9, Some(4), ms(7), 25);
    let b = job(9, Some(4), ms(7), 25);
    let c = job(10, Some(4), ms(7), 25);
    let all = |o: &[Observed]| -> Vec<Seen> { o.iter().flat_map(|x| x.rounds.clone()).collect() };
    assert_eq!(all(&a), all(&b));
    let waits = |o: &[Observed]| -> Vec<Duration> {
        o.iter()
            .flat_map(|x| x.rounds.iter().map(|r| r.waited))
            .collect()
    };
    assert_ne!(
        waits(&a),
        waits(&c),
        "another seed should give other network timings"
    );
}

#[test]
fn a_far_behind_rank_reads_results_that_were_not_overwritten() {
    // The slow rank is ~30 rounds behind before each sync; the results it reads must be the
    // sums of the members they name (checked in `check_round`), never a later round's data.
    let obs = job(4, Some(30), ms(40), 60);
    let slow = &obs[SLOW];
    assert!(
        slow.rounds.iter().any(|s| s.round > s.requested),
        "the slow rank should read later rounds"
    );
}

/// What one rank of [`eager_job`] saw: how many times each gradient was applied, indexed by
/// `rank * STEPS + t` (each gradient is one-hot), and whether its own gradient was in each
/// round it read.
struct EagerSeen {
    applied: Vec<f64>,
    fresh: Vec<bool>,
}

const EAGER_P: usize = 6;
const EAGER_STEPS: u64 = 24;
const EAGER_SLOW: usize = 2;

/// Eager-SGD's stream with exact reads over 6 ranks, rank 2 nine times slower, a sync every 8
/// rounds; every rank publishes a gradient that is one-hot at its own (rank, step) slot.
fn eager_job(mode: ContributionMode) -> Vec<EagerSeen> {
    let (p, steps) = (EAGER_P, EAGER_STEPS);
    let len = p * steps as usize;
    let cfg = stream(
        p,
        GroupingKind::Butterfly,
        Trigger::Solo,
        mode,
        ReadMode::Exact,
        Some(8),
        vec![0.0; len],
    );
    run(Exec::Virtual(5), p, EngineConfig::default(), async |c| {
        let rank = c.rank();
        c.open_stream(cfg.clone()).await?;
        let mut applied = vec![0f64; len];
        let mut fresh = Vec::new();
        for t in 0..steps {
            c.compute(ms(if rank == EAGER_SLOW { 9 } else { 1 })).await;
            let mut g = vec![0f32; len];
            g[rank * steps as usize + t as usize] = 1.0;
            let r = c.arrive(t, Payload::Data(g), t + 1).await?;
            assert_eq!(r.round, t, "exact reads apply every round once");
            for (x, y) in applied.iter_mut().zip(r.sum.as_slice()) {
                *x += *y as f64;
            }
            fresh.push(r.fresh);
        }
        Ok(EagerSeen { applied, fresh })
    })
    .into_all()
    .unwrap()
}

#[test]
fn eager_accumulation_never_drops_a_gradient() {
    // Every round applied once by every rank, and after the final sync every gradient
    // published has been applied exactly once, late ones included.
    let out = eager_job(ContributionMode::Accumulate);
    for (rank, seen) in out.iter().enumerate() {
        assert!(
            seen.applied.iter().all(|&x| x == 1.0),
            "rank {rank}: {:?}",
            seen.applied
        );
    }
    assert!(
        out[EAGER_SLOW].fresh.iter().any(|&f| !f),
        "the slow rank should have been late"
    );
}

#[test]
fn eager_drop_late_applies_a_gradient_at_most_once_and_drops_the_late_ones() {
    let out = eager_job(ContributionMode::DropLate);
    let steps = EAGER_STEPS as usize;
    for (rank, seen) in out.iter().enumerate() {
        assert_eq!(
            seen.applied, out[0].applied,
            "rank {rank}: replicas diverged"
        );
        assert!(seen.applied.iter().all(|&x| x == 0.0 || x == 1.0));
        // A gradient its own round carried is applied; one that missed it is not.
        for (t, &f) in seen.fresh.iter().enumerate() {
            assert_eq!(
                seen.applied[rank * steps + t] == 1.0,
                f,
                "rank {rank} step {t}"
            );
        }
    }
    let dropped = |r: usize| {
        out[0].applied[r * steps..(r + 1) * steps]
            .iter()
            .filter(|&&x| x == 0.0)
            .count()
    };
    assert!(
        dropped(EAGER_SLOW) > 0,
        "the slow rank's late gradients should be dropped"
    );
    // The fast ranks trigger their rounds themselves and are never late.
    for r in (0..EAGER_P).filter(|&r| r != EAGER_SLOW) {
        assert_eq!(dropped(r), 0, "rank {r}");
    }
}
