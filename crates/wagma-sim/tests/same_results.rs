//! The simulator's results are a function of the seed alone: every algorithm's virtual times,
//! waiting and staleness on small jobs match, bit for bit, the results recorded in
//! `golden/results.json` by an earlier version of the executor. A change that makes the
//! simulator faster must not change what it computes; a change that means to must say so by
//! recording the file anew (`WAGMA_RECORD_GOLDEN=1 cargo test --release -p wagma-sim --test
//! same_results`) and explaining why in its commit.

use std::collections::BTreeMap;
use std::path::PathBuf;

use wagma::algo::{AlgoConfig, Algorithm, WagmaOptions};
use wagma::imbalance::{Imbalance, Profile};
use wagma::topology::GroupingKind;
use wagma_sim::compute::Compute;
use wagma_sim::{LogGp, SimSpec, simulate};

/// Every algorithm with its defaults, plus variants of WAGMA's groups and blocking rule,
/// eager-SGD's sync and SGP's chained pieces.
fn algorithms() -> Vec<AlgoConfig> {
    let mut v: Vec<AlgoConfig> = Algorithm::NAMES
        .iter()
        .map(|n| AlgoConfig::new(Algorithm::from_name(n).unwrap()))
        .collect();
    v.push(AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        group_size: Some(4),
        tau: Some(3),
        ..WagmaOptions::default()
    })));
    v.push(AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        wait_avoiding: false,
        ..WagmaOptions::default()
    })));
    // Groups of two: at P = 32 a butterfly cycles through 5 partitions.
    v.push(AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        group_size: Some(2),
        ..WagmaOptions::default()
    })));
    v.push(AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        groups: GroupingKind::Random { seed: 5 },
        ..WagmaOptions::default()
    })));
    // A blocking sync within the run's steps.
    if let Algorithm::EagerSgd { mode, late, .. } = Algorithm::from_name("eager-sgd").unwrap() {
        v.push(AlgoConfig::new(Algorithm::EagerSgd {
            mode,
            sync_period: Some(5),
            late,
        }));
    }
    let mut pieces = AlgoConfig::new(Algorithm::from_name("sgp").unwrap());
    pieces.exchange_pieces = 3;
    v.push(pieces);
    v
}

fn results() -> BTreeMap<String, serde_json::Value> {
    let network = LogGp {
        latency_s: 2e-6,
        overhead_s: 1e-6,
        gap_s: 1e-7,
        per_byte_s: 1e-10,
        node_limit: true,
    };
    let mut out = BTreeMap::new();
    for (p, steps, seed) in [(6usize, 30u64, 1u64), (13, 25, 2), (32, 20, 4), (64, 20, 3)] {
        for algo in algorithms() {
            if algo.algorithm.validate(p).is_err() {
                continue;
            }
            let spec = SimSpec {
                ranks: p,
                algo: algo.clone(),
                steps,
                model_params: 1 << 20,
                batch: 8,
                compute: Compute::Profile(Imbalance {
                    profile: Profile::PaperResnet,
                    time_scale: 0.01,
                    seed,
                }),
                network,
                seed,
            };
            let r = simulate(&spec).unwrap();
            let case = format!("P={p} {}", algo.label());
            let stats = serde_json::to_value(&r.stats).unwrap();
            assert!(
                out.insert(case.clone(), stats).is_none(),
                "two cases are {case}"
            );
        }
    }
    out
}

#[test]
fn every_algorithm_computes_the_recorded_results() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/results.json");
    let now = results();
    if std::env::var_os("WAGMA_RECORD_GOLDEN").is_some() {
        std::fs::write(&path, serde_json::to_string_pretty(&now).unwrap() + "\n").unwrap();
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let recorded: BTreeMap<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    assert_eq!(
        recorded.keys().collect::<Vec<_>>(),
        now.keys().collect::<Vec<_>>()
    );
    for (case, stats) in &recorded {
        assert_eq!(stats, &now[case], "{case}");
    }
}
