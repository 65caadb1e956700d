//! Which algorithm, with which options.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::topology::{ExponentialGraph, Grouping, GroupingKind, PeerOffsets, default_group_size};

/// How a WAGMA rank folds a group's sum into its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum CombineRule {
    /// The paper: `sum / |G|` when fresh, `(sum + own) / (|G| + 1)` when stale.
    #[default]
    Paper,
    /// The authors' released code: always `(sum + own) / (|G| + 1)`.
    Damped,
}

/// Whether the local step comes before or after the averaging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// `W' = W + dW(W)`, then average `W'` (the paper's Algorithm 2).
    #[default]
    StepThenAverage,
    /// Average `W`, then add `dW(W)` (the form the convergence proof models).
    AverageThenStep,
}

/// Which eager-SGD collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum EagerMode {
    /// The first arrival triggers each round.
    #[default]
    Solo,
    /// A random initiator, drawn from a shared seed, triggers each round.
    Majority,
}

/// What eager-SGD does with a gradient that misses the round it was computed for (the round
/// ran before its rank arrived).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LateGradients {
    /// Contribute it to the next round (the eager-SGD paper).
    #[default]
    Accumulate,
    /// Drop it: the authors' released code zeroes its send buffer after every round it reads.
    Drop,
}

impl std::str::FromStr for LateGradients {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "accumulate" => Ok(LateGradients::Accumulate),
            "drop" => Ok(LateGradients::Drop),
            _ => Err(ConfigError::Invalid {
                what: "late gradients",
                detail: format!("{s:?} (expected accumulate or drop)"),
            }),
        }
    }
}

impl std::fmt::Display for LateGradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LateGradients::Accumulate => "accumulate",
            LateGradients::Drop => "drop",
        })
    }
}

/// How D-PSGD sends to its two ring neighbours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SendOrder {
    /// Both at once, without waiting for either (the algorithm).
    #[default]
    Together,
    /// Blocking rendezvous sends, right neighbour first, as the WAGMA-SGD authors' baseline:
    /// a rank sends only once its right neighbour has entered the exchange, so each exchange
    /// also waits for the rank two to the right.
    RightThenLeft,
}

impl std::str::FromStr for SendOrder {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "together" => Ok(SendOrder::Together),
            "right-then-left" => Ok(SendOrder::RightThenLeft),
            _ => Err(ConfigError::Invalid {
                what: "send order",
                detail: format!("{s:?} (expected together or right-then-left)"),
            }),
        }
    }
}

impl std::fmt::Display for SendOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SendOrder::Together => "together",
            SendOrder::RightThenLeft => "right-then-left",
        })
    }
}

/// WAGMA-SGD's options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WagmaOptions {
    /// Group size S (`None`: sqrt(P) rounded up to a power of two).
    pub group_size: Option<usize>,
    /// Global synchronization period tau (`None`: never).
    pub tau: Option<u64>,
    /// Combination rule.
    pub combine: CombineRule,
    /// Grouping.
    pub groups: GroupingKind,
    /// `false` turns the wait-avoiding group allreduce into a blocking one (every member waits
    /// for the others): the paper's "beta" switch, and a lock-step configuration.
    pub wait_avoiding: bool,
}

impl Default for WagmaOptions {
    fn default() -> Self {
        WagmaOptions {
            group_size: None,
            tau: Some(10),
            combine: CombineRule::Paper,
            groups: GroupingKind::Butterfly,
            wait_avoiding: true,
        }
    }
}

/// A training algorithm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "name")]
pub enum Algorithm {
    /// WAGMA-SGD.
    Wagma(WagmaOptions),
    /// Gradient allreduce (average over P), then the local step; everybody waits for everybody.
    AllreduceSgd,
    /// H local steps, then a global model average.
    LocalSgd {
        /// The period H.
        period: u64,
    },
    /// Average with the two ring neighbours (1/3 each) every step.
    DPsgd,
    /// Asynchronous pairwise averaging between active and passive ranks.
    AdPsgd {
        /// `None`: the AD-PSGD paper's rule, one pairwise average per active step, whose
        /// reply the active rank awaits. `Some(k)`: the WAGMA-SGD authors' baseline, a gossip
        /// loop in each active rank's engine that runs `k` pairwise averages of a shared copy
        /// after every step (alternately with a forward and a backward peer), while the step
        /// only mixes with the copy and never waits.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gossip: Option<u32>,
    },
    /// Push-sum over the time-varying directed exponential graph.
    Sgp {
        /// Out-neighbours per iteration.
        peers: usize,
        /// Which powers of two the peers sit at.
        #[serde(default)]
        offsets: PeerOffsets,
    },
    /// Partial gradient allreduce triggered by the first arrival (solo) or a random initiator
    /// (majority); late gradients are accumulated into a later round, or dropped.
    EagerSgd {
        /// Solo or majority.
        mode: EagerMode,
        /// A blocking gradient allreduce every this many steps (bounds the lag; `None`: never).
        sync_period: Option<u64>,
        /// What happens to a gradient that misses its round.
        #[serde(default)]
        late: LateGradients,
    },
}

impl Algorithm {
    /// Every algorithm's name, for listings.
    pub const NAMES: [&'static str; 8] = [
        "wagma",
        "allreduce-sgd",
        "local-sgd",
        "d-psgd",
        "ad-psgd",
        "sgp",
        "eager-sgd-solo",
        "eager-sgd-majority",
    ];

    /// The algorithm called `name` with default options.
    pub fn from_name(name: &str) -> Result<Algorithm, ConfigError> {
        Ok(match name {
            "wagma" | "wagma-sgd" => Algorithm::Wagma(WagmaOptions::default()),
            "allreduce-sgd" | "allreduce" => Algorithm::AllreduceSgd,
            "local-sgd" => Algorithm::LocalSgd { period: 1 },
            "d-psgd" | "dpsgd" => Algorithm::DPsgd,
            "ad-psgd" | "adpsgd" => Algorithm::AdPsgd { gossip: None },
            "sgp" => Algorithm::Sgp {
                peers: 1,
                offsets: PeerOffsets::Disjoint,
            },
            "eager-sgd" | "eager-sgd-solo" => Algorithm::EagerSgd {
                mode: EagerMode::Solo,
                sync_period: Some(32),
                late: LateGradients::Accumulate,
            },
            "eager-sgd-majority" => Algorithm::EagerSgd {
                mode: EagerMode::Majority,
                sync_period: Some(32),
                late: LateGradients::Accumulate,
            },
            _ => {
                return Err(ConfigError::Invalid {
                    what: "algorithm",
                    detail: format!("{name:?} (expected one of {})", Algorithm::NAMES.join(", ")),
                });
            }
        })
    }

    /// A short name with the options that matter.
    pub fn label(&self) -> String {
        match self {
            Algorithm::Wagma(o) => {
                let mut s = "wagma".to_string();
                if let Some(g) = o.group_size {
                    s += &format!(" S={g}");
                }
                s += &match o.tau {
                    Some(t) => format!(" tau={t}"),
                    None => " tau=never".into(),
                };
                if o.combine == CombineRule::Damped {
                    s += " damped";
                }
                if o.groups != GroupingKind::Butterfly {
                    s += &format!(" {}", o.groups);
                }
                if !o.wait_avoiding {
                    s += " blocking";
                }
                s
            }
            Algorithm::AllreduceSgd => "allreduce-sgd".into(),
            Algorithm::LocalSgd { period } => format!("local-sgd H={period}"),
            Algorithm::DPsgd => "d-psgd".into(),
            Algorithm::AdPsgd { gossip: None } => "ad-psgd".into(),
            Algorithm::AdPsgd { gossip: Some(k) } => format!("ad-psgd gossip={k}"),
            Algorithm::Sgp { peers, offsets } => match offsets {
                PeerOffsets::Disjoint => format!("sgp {peers}n"),
                PeerOffsets::Sliding => format!("sgp {peers}n sliding"),
            },
            Algorithm::EagerSgd {
                mode,
                sync_period,
                late,
            } => {
                let mode = match mode {
                    EagerMode::Solo => "solo",
                    EagerMode::Majority => "majority",
                };
                // The periodic blocking round changes what the method waits for: say it.
                let mut s = match sync_period {
                    Some(k) => format!("eager-sgd {mode} sync={k}"),
                    None => format!("eager-sgd {mode} sync=never"),
                };
                if *late == LateGradients::Drop {
                    s += " drop-late";
                }
                s
            }
        }
    }

    /// Sets SGP's peer offsets, eager-SGD's treatment of late gradients and AD-PSGD's gossip
    /// exchanges; the other algorithms have none of them and are left as they are.
    pub fn set_variants(
        &mut self,
        sgp_offsets: PeerOffsets,
        late_gradients: LateGradients,
        ad_psgd_gossip: Option<u32>,
    ) {
        match self {
            Algorithm::Sgp { offsets, .. } => *offsets = sgp_offsets,
            Algorithm::EagerSgd { late, .. } => *late = late_gradients,
            Algorithm::AdPsgd { gossip } => *gossip = ad_psgd_gossip,
            _ => {}
        }
    }

    /// True for the algorithms that average models (the others average gradients).
    pub fn averages_models(&self) -> bool {
        !matches!(self, Algorithm::AllreduceSgd | Algorithm::EagerSgd { .. })
    }

    /// Checks the options against the number of ranks.
    pub fn validate(&self, ranks: usize) -> Result<(), ConfigError> {
        if ranks == 0 {
            return Err(ConfigError::ZeroRanks);
        }
        match self {
            Algorithm::Wagma(o) => {
                if o.tau == Some(0) {
                    return Err(ConfigError::ZeroTau);
                }
                Grouping::new(
                    ranks,
                    o.group_size.unwrap_or_else(|| default_group_size(ranks)),
                    o.groups,
                )?;
            }
            Algorithm::LocalSgd { period: 0 } => return Err(ConfigError::ZeroPeriod),
            Algorithm::Sgp { peers, offsets } => {
                if ranks > 1 {
                    ExponentialGraph::with_offsets(ranks, *peers, *offsets)?;
                } else if *peers != 0 {
                    return Err(ConfigError::TooManyPeers {
                        peers: *peers,
                        ranks,
                        max: 0,
                    });
                }
            }
            Algorithm::EagerSgd {
                sync_period: Some(0),
                ..
            } => return Err(ConfigError::ZeroSyncPeriod),
            Algorithm::AdPsgd { gossip: Some(0) } => {
                return Err(ConfigError::Invalid {
                    what: "ad-psgd gossip",
                    detail: "a gossip loop needs at least one exchange per step".into(),
                });
            }
            _ => {}
        }
        Ok(())
    }
}

/// What is averaged besides the trainable parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scope {
    /// Average non-trainable buffers (BatchNorm statistics).
    pub average_buffers: bool,
    /// Average wagma's optimizer state (SGD's momentum, Adam's moments) together with the
    /// model, at every averaging (group, gossip and global averages). Off by default, as in the
    /// paper: the state summarises this replica's own gradient stream, and averaging it
    /// multiplies the bytes sent (twice the model for momentum, three times for Adam). An
    /// update computed outside wagma keeps its state local.
    pub average_optimizer_state: bool,
}

impl Default for Scope {
    fn default() -> Self {
        Scope {
            average_buffers: true,
            average_optimizer_state: false,
        }
    }
}

/// An algorithm with its averaging scope and order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlgoConfig {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Averaging scope.
    pub scope: Scope,
    /// Step and average order (model-averaging algorithms; the others reject
    /// `average-then-step`).
    pub order: Order,
    /// Seed shared by all ranks (eager-SGD majority's initiators).
    pub seed: u64,
    /// Neighbour exchanges (D-PSGD, SGP) move the model as this many consecutive pieces, each
    /// exchanged only after the previous one completed, as the authors' baselines do with one
    /// exchange per parameter tensor (161 for ResNet-50). Every piece waits for the neighbours,
    /// so a rank waits for all ranks within this many hops in every iteration: the paper's
    /// D-PSGD and SGP. 1 (the default): the whole model in one exchange, as the algorithms
    /// need. The model that results is the same; only the waiting differs.
    #[serde(default = "one_piece")]
    pub exchange_pieces: u32,
    /// How D-PSGD sends to its ring neighbours (every piece, with `exchange_pieces`).
    #[serde(default)]
    pub send_order: SendOrder,
}

fn one_piece() -> u32 {
    1
}

impl AlgoConfig {
    /// True when, after `iteration` steps, the algorithm has nothing in flight that a
    /// checkpoint of the replicas would miss: right after a global average for WAGMA, local SGD
    /// and eager-SGD (whose engines hold late contributions between syncs), any iteration for
    /// the others (with [`super::Worker::quiesce`]).
    pub fn is_clean_point(&self, iteration: u64) -> bool {
        let at = |period: Option<u64>| match period {
            Some(k) => iteration.is_multiple_of(k),
            None => iteration == 0,
        };
        match &self.algorithm {
            Algorithm::Wagma(o) => at(o.tau),
            Algorithm::LocalSgd { period } => at(Some(*period)),
            Algorithm::EagerSgd { sync_period, .. } => at(*sync_period),
            _ => true,
        }
    }

    /// The algorithm's label, with the exchange options where they differ from the defaults
    /// (they change what a rank waits for, so runs that differ only in them must be told apart).
    pub fn label(&self) -> String {
        let mut s = self.algorithm.label();
        if self.exchange_pieces != 1 {
            s += &format!(" pieces={}", self.exchange_pieces);
        }
        if self.send_order != SendOrder::Together {
            s += &format!(" {}", self.send_order);
        }
        s
    }

    /// Checks the algorithm against the number of ranks, and the order against the algorithm.
    pub fn validate(&self, ranks: usize) -> Result<(), ConfigError> {
        self.algorithm.validate(ranks)?;
        if self.order == Order::AverageThenStep && !self.algorithm.averages_models() {
            return Err(ConfigError::Invalid {
                what: "order",
                detail: format!(
                    "average-then-step applies to model-averaging algorithms; {} averages gradients",
                    self.algorithm.label()
                ),
            });
        }
        let exchanges = matches!(self.algorithm, Algorithm::DPsgd | Algorithm::Sgp { .. });
        if self.exchange_pieces == 0 || (self.exchange_pieces > 1 && !exchanges) {
            return Err(ConfigError::Invalid {
                what: "exchange pieces",
                detail: format!(
                    "{} pieces: at least 1, and more than 1 only for the neighbour exchanges of \
                     d-psgd and sgp, not {}",
                    self.exchange_pieces,
                    self.algorithm.label()
                ),
            });
        }
        if self.send_order != SendOrder::Together && self.algorithm != Algorithm::DPsgd {
            return Err(ConfigError::Invalid {
                what: "send order",
                detail: format!(
                    "{} applies to d-psgd's ring exchange, not {}",
                    self.send_order,
                    self.algorithm.label()
                ),
            });
        }
        Ok(())
    }

    /// `algorithm` with the default scope and order.
    pub fn new(algorithm: Algorithm) -> AlgoConfig {
        AlgoConfig {
            algorithm,
            scope: Scope::default(),
            order: Order::default(),
            seed: 0,
            exchange_pieces: one_piece(),
            send_order: SendOrder::Together,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configurations_are_typed_errors() {
        assert_eq!(
            Algorithm::LocalSgd { period: 0 }.validate(4),
            Err(ConfigError::ZeroPeriod)
        );
        assert_eq!(
            Algorithm::EagerSgd {
                mode: EagerMode::Solo,
                sync_period: Some(0),
                late: LateGradients::Accumulate,
            }
            .validate(4),
            Err(ConfigError::ZeroSyncPeriod)
        );
        assert!(matches!(
            Algorithm::Sgp {
                peers: 4,
                offsets: PeerOffsets::Disjoint
            }
            .validate(4),
            Err(ConfigError::TooManyPeers { .. })
        ));
        for late in ["accumulate", "drop"] {
            assert_eq!(late.parse::<LateGradients>().unwrap().to_string(), late);
        }
        assert!("keep".parse::<LateGradients>().is_err());
        let mut eager = Algorithm::from_name("eager-sgd-majority").unwrap();
        eager.set_variants(PeerOffsets::Sliding, LateGradients::Drop, Some(2));
        assert_eq!(eager.label(), "eager-sgd majority sync=32 drop-late");
        let mut sgp = Algorithm::from_name("sgp").unwrap();
        sgp.set_variants(PeerOffsets::Sliding, LateGradients::Drop, Some(2));
        assert_eq!(sgp.label(), "sgp 1n sliding");
        let mut ad = Algorithm::from_name("ad-psgd").unwrap();
        ad.set_variants(PeerOffsets::Sliding, LateGradients::Drop, Some(2));
        assert_eq!(ad.label(), "ad-psgd gossip=2");
        assert!(matches!(
            Algorithm::AdPsgd { gossip: Some(0) }.validate(4),
            Err(ConfigError::Invalid { .. })
        ));
        // Configurations written before the gossip variant existed read as the canonical one.
        let old: Algorithm = serde_json::from_str(r#"{"name":"ad-psgd"}"#).unwrap();
        assert_eq!(old, Algorithm::AdPsgd { gossip: None });
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"name":"ad-psgd"}"#
        );
        let mut d = AlgoConfig::new(Algorithm::DPsgd);
        assert_eq!(d.label(), "d-psgd");
        d.exchange_pieces = 161;
        d.send_order = SendOrder::RightThenLeft;
        assert_eq!(d.label(), "d-psgd pieces=161 right-then-left");
        for offsets in [PeerOffsets::Disjoint, PeerOffsets::Sliding] {
            assert!(matches!(
                Algorithm::Sgp { peers: 3, offsets }.validate(8),
                Ok(())
            ));
        }
        let w = |tau, s| {
            Algorithm::Wagma(WagmaOptions {
                tau,
                group_size: s,
                ..WagmaOptions::default()
            })
        };
        assert_eq!(w(Some(0), None).validate(8), Err(ConfigError::ZeroTau));
        assert_eq!(
            w(Some(4), Some(0)).validate(8),
            Err(ConfigError::ZeroGroupSize)
        );
        assert!(matches!(
            w(Some(4), Some(9)).validate(8),
            Err(ConfigError::GroupSizeTooLarge { .. })
        ));
        assert!(matches!(
            Algorithm::from_name("sgd++"),
            Err(ConfigError::Invalid { .. })
        ));
        for n in Algorithm::NAMES {
            let a = Algorithm::from_name(n).unwrap();
            a.validate(8).unwrap();
            let late = AlgoConfig {
                order: Order::AverageThenStep,
                ..AlgoConfig::new(a.clone())
            };
            assert_eq!(late.validate(8).is_ok(), a.averages_models(), "{n}");
        }
    }
}
