//! One schedule, two executors: every algorithm's messages (peer, size, order) are the same when
//! the engine runs on threads over the in-process transport and when the simulator runs it in
//! virtual time, for random P and S and random compute times. The order compared is each rank's
//! sending order, except for AD-PSGD, whose passive side answers requests whenever they arrive:
//! there the messages on each link are compared as a set.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use wagma::algo::measure::{self, Spec};
use wagma::algo::{AlgoConfig, Algorithm, WagmaOptions};
use wagma::exec::threaded;
use wagma::exec::virtual_time::NetworkModel;
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::{PairRole, Pairing};
use wagma::transport::{Envelope, Kind, Transport, mem};
use wagma::{Comm, EngineConfig, Rank};
use wagma_sim::compute::Compute;
use wagma_sim::{LogGp, LogGpNetwork, SimSpec, simulate_on};

/// Per rank, the messages it sent that carry model data: `(to, bytes on the wire)`, in order.
type Pattern = Vec<Vec<(Rank, usize)>>;

/// Data-carrying messages are what the schedules prescribe; activations and control messages
/// depend on who arrives first.
fn carries_data(env: &Envelope) -> bool {
    !env.data.is_empty() && !matches!(env.tag.kind, Kind::Control | Kind::Activation)
}

struct Recording<T> {
    inner: T,
    rank: Rank,
    log: Arc<Mutex<Pattern>>,
}

impl<T: Transport> Transport for Recording<T> {
    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), wagma::error::TransportError> {
        if carries_data(&env) {
            self.log.lock().unwrap()[self.rank].push((to, env.wire_bytes()));
        }
        self.inner.send(to, env)
    }
}

/// The LogGP model, recording what it is asked to carry. It sees sizes only, so it records
/// every message and the data-less ones are removed by size afterwards.
struct RecordingNetwork {
    inner: LogGpNetwork,
    log: Arc<Mutex<Pattern>>,
}

impl NetworkModel for RecordingNetwork {
    fn arrival(
        &mut self,
        now: Duration,
        from: Rank,
        to: Rank,
        bytes: usize,
        noise: f64,
    ) -> Duration {
        self.log.lock().unwrap()[from].push((to, bytes));
        self.inner.arrival(now, from, to, bytes, noise)
    }
}

/// Every algorithm with its defaults, WAGMA with group size `s` and tau 3.
fn algorithms(s: usize) -> Vec<Algorithm> {
    Algorithm::NAMES
        .iter()
        .filter(|&&n| n != "wagma")
        .map(|n| Algorithm::from_name(n).unwrap())
        .chain([Algorithm::Wagma(WagmaOptions {
            group_size: Some(s),
            tau: Some(3),
            ..WagmaOptions::default()
        })])
        .collect()
}

fn imbalance(seed: u64) -> Imbalance {
    Imbalance {
        profile: Profile::PaperResnet,
        time_scale: 0.002,
        seed,
    }
}

fn spec(algo: &Algorithm, p: usize, steps: u64, len: usize, seed: u64, real_data: bool) -> Spec {
    let im = imbalance(seed);
    Spec {
        algo: AlgoConfig::new(algo.clone()),
        steps,
        model_len: len,
        batch: 1,
        draws: Arc::new(im.table(steps, p)),
        real_data,
    }
}

fn threaded_pattern(s: &Spec, p: usize) -> Pattern {
    let log = Arc::new(Mutex::new(vec![Vec::new(); p]));
    let net = mem::network(p)
        .into_iter()
        .enumerate()
        .map(|(rank, (t, rx))| {
            let t = Recording {
                inner: t,
                rank,
                log: Arc::clone(&log),
            };
            (Box::new(t) as Box<dyn Transport + Send>, rx)
        })
        .collect();
    threaded::run_on(net, EngineConfig::default(), async |c: &mut Comm| {
        measure::run(c, s).await
    })
    .unwrap()
    .into_all()
    .unwrap();
    Arc::try_unwrap(log).unwrap().into_inner().unwrap()
}

fn simulated_pattern(s: &Spec, p: usize, seed: u64) -> Pattern {
    let log = Arc::new(Mutex::new(vec![Vec::new(); p]));
    let network = LogGp {
        latency_s: 2e-6,
        overhead_s: 1e-6,
        gap_s: 1e-7,
        per_byte_s: 1e-10,
        node_limit: true,
    };
    let sim = SimSpec {
        ranks: p,
        algo: s.algo.clone(),
        steps: s.steps,
        model_params: s.model_len,
        batch: 1,
        // The same draws as the threaded run's.
        compute: Compute::Profile(imbalance(seed)),
        network,
        seed,
    };
    let rec = RecordingNetwork {
        inner: LogGpNetwork::new(network, p),
        log: Arc::clone(&log),
    };
    let r = simulate_on(&sim, Box::new(rec)).unwrap();
    assert_eq!(sim.compute.table(s.steps, p), *s.draws);
    drop(r);
    Arc::try_unwrap(log).unwrap().into_inner().unwrap()
}

/// Per sender and receiver, the sizes sent (sorted): AD-PSGD's passive side answers its peers'
/// requests whenever they come, also between its own collectives, so no order is prescribed.
fn per_link(p: &Pattern) -> Vec<Vec<Vec<usize>>> {
    p.iter()
        .map(|sent| {
            (0..p.len())
                .map(|to| {
                    let mut v: Vec<usize> =
                        sent.iter().filter(|m| m.0 == to).map(|m| m.1).collect();
                    v.sort_unstable();
                    v
                })
                .collect()
        })
        .collect()
}

/// Keeps the messages larger than a header with no data.
fn data_only(p: Pattern, min_bytes: usize) -> Pattern {
    p.into_iter()
        .map(|r| r.into_iter().filter(|&(_, b)| b >= min_bytes).collect())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn the_simulator_sends_what_the_engine_sends(p in 2usize..=12, s_pick in 0usize..4, seed in 0u64..1000) {
        let s = 2 + s_pick % (p - 1);
        let len = 96;
        for algo in algorithms(s.min(p)) {
            if algo.validate(p).is_err() {
                continue;
            }
            let real = spec(&algo, p, 7, len, seed, true);
            let sized = spec(&algo, p, 7, len, seed, false);
            let threaded = threaded_pattern(&real, p);
            // The smallest data message in the threaded run bounds the simulator's from below;
            // data-less messages are far smaller than any model slice.
            let min = threaded.iter().flatten().map(|&(_, b)| b).min().unwrap_or(0);
            let simulated = data_only(simulated_pattern(&sized, p, seed), min);
            if matches!(algo, Algorithm::AdPsgd { .. }) {
                prop_assert_eq!(per_link(&threaded), per_link(&simulated), "{} on P = {}", algo.label(), p);
            } else {
                prop_assert_eq!(&threaded, &simulated, "{} on P = {}", algo.label(), p);
            }
            prop_assert!(threaded.iter().any(|r| !r.is_empty()), "{} sent nothing", algo.label());
        }
    }
}

/// AD-PSGD's gossip loop runs as many of its exchanges as the time between steps allows, so
/// how many there are depends on the executor's speed; whom each one goes to does not. In both
/// executors every active rank's model messages follow [`Pairing::gossip_peer`] from the first
/// exchange on. In virtual time, where an exchange is far shorter than a step, the whole budget
/// runs after every step but the last, whose budget the closing collective ends after the
/// exchange in flight.
#[test]
fn gossip_exchanges_follow_the_peer_sequence_in_both_executors() {
    let (k, steps, len, seed) = (2u32, 7u64, 256, 3);
    for p in [2usize, 5, 8] {
        let algo = Algorithm::AdPsgd { gossip: Some(k) };
        let pairing = Pairing::new(p).unwrap();
        let runs = [
            (
                "threaded",
                threaded_pattern(&spec(&algo, p, steps, len, seed, true), p),
            ),
            (
                "simulated",
                simulated_pattern(&spec(&algo, p, steps, len, seed, false), p, seed),
            ),
        ];
        for (executor, pattern) in runs {
            let model = pattern.iter().flatten().map(|m| m.1).max().unwrap();
            for (r, sent) in pattern.iter().enumerate() {
                if pairing.role(r) != PairRole::Active {
                    continue;
                }
                let to: Vec<Rank> = sent.iter().filter(|m| m.1 == model).map(|m| m.0).collect();
                let expected: Vec<Rank> = (0..to.len() as u64)
                    .map(|n| pairing.gossip_peer(r, n).unwrap())
                    .collect();
                assert_eq!(to, expected, "{executor}, P = {p}, rank {r}");
                assert!(
                    !to.is_empty(),
                    "{executor}, P = {p}, rank {r} never gossiped"
                );
                if executor == "simulated" {
                    assert_eq!(
                        to.len() as u64,
                        u64::from(k) * (steps - 1) + 1,
                        "P = {p}, rank {r}"
                    );
                }
            }
        }
    }
}
