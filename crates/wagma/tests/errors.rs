//! Bad input gives typed errors, never a panic or a hang.

mod common;

use std::time::Duration;

use common::*;
use wagma::engine::{ContributionMode, ReadMode, Trigger};
use wagma::exec::{threaded, virtual_time};
use wagma::topology::GroupingKind;
use wagma::{ConfigError, EngineConfig, Error, Payload};

#[test]
fn zero_ranks_is_refused() {
    let r = threaded::run(0, EngineConfig::default(), async |_c| Ok(()));
    assert_eq!(r.unwrap_err(), ConfigError::ZeroRanks);
    let r = virtual_time::run(
        0,
        EngineConfig::default(),
        virtual_time::VirtualConfig::seeded(0),
        async |_c| Ok(()),
    );
    assert_eq!(r.unwrap_err(), ConfigError::ZeroRanks);
}

fn open_with(group_size: usize, tau: Option<u64>) -> Error {
    let cfg = stream(
        group_size,
        GroupingKind::Butterfly,
        Trigger::Solo,
        ContributionMode::Model,
        ReadMode::Latest,
        tau,
        vec![0.0; 3],
    );
    run(Exec::Virtual(0), 4, EngineConfig::default(), async |c| {
        c.open_stream(cfg.clone()).await
    })
    .into_all()
    .unwrap_err()
}

#[test]
fn bad_stream_settings_are_typed_errors() {
    assert!(matches!(
        open_with(0, Some(2)),
        Error::Config(ConfigError::ZeroGroupSize)
    ));
    assert!(matches!(
        open_with(5, Some(2)),
        Error::Config(ConfigError::GroupSizeTooLarge {
            group_size: 5,
            ranks: 4
        })
    ));
    assert!(matches!(
        open_with(2, Some(0)),
        Error::Config(ConfigError::ZeroTau)
    ));
}

#[test]
fn mismatched_buffer_lengths_are_reported_with_both_lengths() {
    for exec in [Exec::Virtual(1), Exec::Threads] {
        let cfg = EngineConfig {
            timeout: Duration::from_secs(10),
            ..EngineConfig::default()
        };
        let out = run(exec, 4, cfg, async |c| {
            let len = if c.rank() == 1 { 12 } else { 10 };
            c.allreduce(Payload::Data(vec![1.0; len])).await.map(|_| ())
        });
        assert!(
            out.ranks.iter().all(Result::is_err),
            "every rank must fail: {:?}",
            out.ranks
        );
        let found = out.ranks.iter().any(|r| {
            matches!(r, Err(Error::LengthMismatch { local, remote, .. })
                if (*local, *remote) == (10, 12) || (*local, *remote) == (12, 10))
        });
        assert!(found, "{:?}", out.ranks);
        let first = out.first_failure.unwrap();
        assert!(matches!(
            out.ranks[first],
            Err(Error::LengthMismatch { .. })
        ));
    }
}

#[test]
fn a_missing_rank_times_out_with_its_name() {
    let cfg = EngineConfig {
        timeout: Duration::from_secs(2),
        ..EngineConfig::default()
    };
    // Rank 3 never joins the collective (it idles until the others give up).
    let out = run(Exec::Virtual(2), 4, cfg, async |c| {
        if c.rank() == 3 {
            c.compute(Duration::from_secs(30)).await;
            return Ok(());
        }
        c.allreduce(Payload::Data(vec![1.0; 4])).await.map(|_| ())
    });
    let partner = out.ranks[2].as_ref().unwrap_err();
    match partner {
        Error::Timeout {
            rank: 2,
            missing,
            waited,
            ..
        } => {
            assert_eq!(missing, &vec![3]);
            assert!(*waited >= Duration::from_secs(2));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(partner.to_string().contains("peer 3"), "{partner}");
    assert!(out.ranks[0].is_err() && out.ranks[1].is_err());
}

#[test]
fn protocol_misuse_is_a_typed_error() {
    let cfg = stream(
        2,
        GroupingKind::Butterfly,
        Trigger::Solo,
        ContributionMode::Model,
        ReadMode::Latest,
        None,
        vec![0.0; 3],
    );
    let out = run(Exec::Virtual(3), 2, EngineConfig::default(), async |c| {
        c.open_stream(cfg.clone()).await?;
        // Round 5 before rounds 0..5 ran.
        c.arrive(5, Payload::Data(vec![0.0; 3]), 6)
            .await
            .map(|_| ())
    });
    assert!(
        matches!(out.ranks[0], Err(Error::Protocol { .. })),
        "{:?}",
        out.ranks[0]
    );
    // A contribution of the wrong length.
    let out = run(Exec::Virtual(3), 2, EngineConfig::default(), async |c| {
        c.open_stream(cfg.clone()).await?;
        c.arrive(0, Payload::Data(vec![0.0; 4]), 1)
            .await
            .map(|_| ())
    });
    assert!(
        out.ranks[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("4 elements")
    );
}

#[test]
fn collectives_naming_ranks_outside_the_job_are_typed_errors() {
    use wagma::schedule::{Combine, Phase, Schedule, Transfer};
    use wagma::transport::Kind;

    // P = 4: members or peers beyond the job, a member list out of order, the rank itself as
    // its peer, a range past the buffer and the engine's own message kinds fail the call,
    // under either executor (the virtual one used to panic delivering to rank 9), and the rank
    // goes on.
    for exec in [Exec::Virtual(4), Exec::Threads] {
        let out = run(exec, 4, EngineConfig::default(), async |c| {
            let rank = c.rank();
            let data = || Payload::Data(vec![1.0; 3]);
            let unsorted: Vec<usize> = (0..4).rev().collect();
            let nothing = || Schedule {
                len: 3,
                phases: Vec::new(),
            };
            let past = Schedule {
                len: 3,
                phases: vec![Phase {
                    sends: [Transfer {
                        peer: (rank + 1) % 4,
                        range: 1..5,
                        step: 0,
                    }]
                    .into_iter()
                    .collect(),
                    recvs: Default::default(),
                    combine: Combine::Copy,
                }],
            };
            let refused = [
                c.allreduce_in(&[rank, 9], 0, data(), 0).await.err(),
                c.allreduce_in(&unsorted, 0, data(), 0).await.err(),
                c.exchange(0, &[9], &[9], data(), 0.0, 0).await.err(),
                c.exchange(0, &[rank], &[rank], data(), 0.0, 0).await.err(),
                c.run(Kind::Exchange, 0, past, data(), 0.0, 0).await.err(),
                // The engine's own kinds: their messages would never reach the run.
                c.run(Kind::Control, 0, nothing(), data(), 0.0, 0)
                    .await
                    .err(),
                c.run(Kind::Activation, 0, nothing(), data(), 0.0, 0)
                    .await
                    .err(),
                c.run(Kind::Round, 0, nothing(), data(), 0.0, 0).await.err(),
                c.run(Kind::Sync, 0, nothing(), data(), 0.0, 0).await.err(),
            ];
            let sum = c.allreduce(data()).await?.into_vec();
            Ok((refused, sum))
        });
        for (rank, r) in out.ranks.iter().enumerate() {
            let (refused, sum) = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            for e in refused {
                assert!(
                    matches!(e, Some(Error::Protocol { rank: r, .. }) if *r == rank),
                    "rank {rank}: {e:?}"
                );
            }
            assert_eq!(sum, &vec![4.0; 3]);
        }
    }
}

#[test]
fn real_parameters_with_virtual_buffers_are_refused() {
    use wagma::algo::{AlgoConfig, Algorithm, OptimizerConfig, Worker};

    // Averaging lays the buffers' values out after the parameters' (the consensus always
    // does): a virtual buffer has none, and used to panic there.
    let out = run(Exec::Virtual(5), 2, EngineConfig::default(), async |c| {
        let algo = AlgoConfig::new(Algorithm::AllreduceSgd);
        let params = Payload::Data(vec![0.0; 4]);
        let refused = Worker::new(
            c,
            algo.clone(),
            OptimizerConfig::sgd(0.1),
            params,
            Payload::Size(2),
        )
        .await
        .err();
        // Virtual parameters with or without real buffers, and real ones with none, are fine.
        for (params, buffers) in [
            (Payload::Size(4), Payload::Size(2)),
            (Payload::Size(4), Payload::Data(vec![1.0; 2])),
            (Payload::Data(vec![0.0; 4]), Payload::Size(0)),
        ] {
            Worker::new(c, algo.clone(), OptimizerConfig::sgd(0.1), params, buffers).await?;
        }
        Ok(refused)
    });
    for r in out.ranks {
        match r {
            Ok(Some(Error::Config(ConfigError::Invalid { what, .. }))) => {
                assert_eq!(what, "model buffers");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
