//! Neighbour exchanges in chained pieces (the authors' per-tensor baselines): the same model as
//! one whole exchange, but a delay reaches one more ring hop with every piece, so with as many
//! pieces as half the ring every rank waits for the slowest in every iteration.

use std::time::Duration;

use wagma::algo::{AlgoConfig, Algorithm, OptimizerConfig, SendOrder, Worker};
use wagma::exec::virtual_time;
use wagma::topology::PeerOffsets;
use wagma::{Comm, ConfigError, EngineConfig, Error, Payload};

const D: usize = 12;

fn config(algorithm: Algorithm, pieces: u32) -> AlgoConfig {
    AlgoConfig {
        exchange_pieces: pieces,
        ..AlgoConfig::new(algorithm)
    }
}

/// Each rank's model after `steps` steps and the virtual time at which it finished each one.
/// Rank 0 computes `slow` at step 0; every other compute takes 1 ms.
fn run(p: usize, algo: AlgoConfig, steps: u64, slow: Duration) -> Vec<(Vec<f32>, Vec<Duration>)> {
    let network = virtual_time::JitterNetwork {
        jitter: 0.0,
        ..virtual_time::JitterNetwork::default()
    };
    let vcfg = virtual_time::VirtualConfig {
        seed: 3,
        network: Box::new(network),
    };
    let task = async |c: &mut Comm| -> Result<(Vec<f32>, Vec<Duration>), Error> {
        let rank = c.rank();
        let init: Vec<f32> = (0..D).map(|i| (rank * D + i) as f32 * 0.1).collect();
        let mut w = Worker::new(
            c,
            algo.clone(),
            OptimizerConfig::sgd(0.1),
            Payload::Data(init),
            Payload::Data(Vec::new()),
        )
        .await?;
        let mut finished = Vec::new();
        for t in 0..steps {
            let compute = if rank == 0 && t == 0 {
                slow
            } else {
                Duration::from_millis(1)
            };
            w.comm().compute(compute).await;
            let g: Vec<f32> = (0..D)
                .map(|i| ((rank + 3 * i) as f32 + t as f32).sin())
                .collect();
            w.step(&g).await?;
            finished.push(w.comm().now());
        }
        Ok((w.params().to_vec(), finished))
    };
    virtual_time::run(p, EngineConfig::default(), vcfg, task)
        .expect("at least one rank")
        .into_all()
        .expect("every rank succeeds")
}

#[test]
fn pieces_change_the_waiting_not_the_model() {
    for algorithm in [
        Algorithm::DPsgd,
        Algorithm::Sgp {
            peers: 1,
            offsets: PeerOffsets::Disjoint,
        },
    ] {
        let whole = run(8, config(algorithm.clone(), 1), 5, Duration::from_millis(1));
        // 5 pieces of 12 elements are uneven; 16 pieces leave some empty.
        for pieces in [5, 16] {
            let chained = run(
                8,
                config(algorithm.clone(), pieces),
                5,
                Duration::from_millis(1),
            );
            for (rank, (a, b)) in whole.iter().zip(&chained).enumerate() {
                assert_eq!(
                    a.0,
                    b.0,
                    "{} rank {rank}, {pieces} pieces",
                    algorithm.label()
                );
            }
        }
    }
}

#[test]
fn a_delay_reaches_one_more_ring_hop_with_every_piece() {
    // Ring of 9: rank 4 is 4 hops from rank 0, the farthest.
    let slow = Duration::from_millis(100);
    let finish_0 = |pieces| -> Vec<Duration> {
        run(9, config(Algorithm::DPsgd, pieces), 1, slow)
            .into_iter()
            .map(|(_, f)| f[0])
            .collect()
    };
    let distance = |r: usize| r.min(9 - r);
    for pieces in 1..=4u32 {
        let f = finish_0(pieces);
        for (rank, &t) in f.iter().enumerate() {
            if distance(rank) as u32 <= pieces {
                assert!(t >= slow, "{pieces} pieces: rank {rank} left at {t:?}");
            } else {
                // One millisecond of compute and a few 5-us messages: far below the delay.
                assert!(t < slow / 2, "{pieces} pieces: rank {rank} waited ({t:?})");
            }
        }
    }
}

fn right_then_left(pieces: u32) -> AlgoConfig {
    AlgoConfig {
        send_order: SendOrder::RightThenLeft,
        ..config(Algorithm::DPsgd, pieces)
    }
}

#[test]
fn sending_right_then_left_changes_the_waiting_not_the_model() {
    for p in [2, 3, 8] {
        let together = run(p, config(Algorithm::DPsgd, 1), 5, Duration::from_millis(1));
        for pieces in [1, 5] {
            let ordered = run(p, right_then_left(pieces), 5, Duration::from_millis(1));
            for (rank, (a, b)) in together.iter().zip(&ordered).enumerate() {
                assert_eq!(a.0, b.0, "P = {p}, rank {rank}, {pieces} pieces");
            }
        }
    }
}

#[test]
fn sending_right_then_left_also_waits_for_the_rank_two_to_the_right() {
    // Each blocking exchange waits for the left neighbour, the right one and the right one's
    // right: after k pieces a delay at rank 0 has reached ranks -2k..=k (ring of 13).
    let (p, slow) = (13usize, Duration::from_millis(100));
    for pieces in 1..=3u32 {
        let f: Vec<Duration> = run(p, right_then_left(pieces), 1, slow)
            .into_iter()
            .map(|(_, f)| f[0])
            .collect();
        let k = pieces as usize;
        for (rank, &t) in f.iter().enumerate() {
            let reached = rank <= k || rank >= p - 2 * k;
            if reached {
                assert!(t >= slow, "{pieces} pieces: rank {rank} left at {t:?}");
            } else {
                assert!(t < slow / 2, "{pieces} pieces: rank {rank} waited ({t:?})");
            }
        }
    }
    let mut sgp = right_then_left(1);
    sgp.algorithm = Algorithm::from_name("sgp").unwrap();
    assert!(matches!(
        sgp.validate(8),
        Err(ConfigError::Invalid {
            what: "send order",
            ..
        })
    ));
}

#[test]
fn pieces_are_for_neighbour_exchanges_only() {
    assert!(config(Algorithm::DPsgd, 161).validate(8).is_ok());
    assert!(
        config(
            Algorithm::Sgp {
                peers: 2,
                offsets: PeerOffsets::Disjoint,
            },
            161
        )
        .validate(8)
        .is_ok()
    );
    for a in [
        Algorithm::AllreduceSgd,
        Algorithm::from_name("wagma").unwrap(),
    ] {
        assert!(matches!(
            config(a, 2).validate(8),
            Err(ConfigError::Invalid {
                what: "exchange pieces",
                ..
            })
        ));
    }
    assert!(matches!(
        config(Algorithm::DPsgd, 0).validate(8),
        Err(ConfigError::Invalid { .. })
    ));
}
