//! Fitting LogGP's latency L and per-byte time G to measured collective times: simulate each
//! measured collective once with L = 1 s (and G = 0) and once with G = 1 s/byte (and L = 0);
//! a collective's time is then `a*L + b*G`, and a least-squares fit of relative errors over
//! all measurements gives L and G. What the real transport spends on reductions, copies and
//! scheduling ends up in G and L, which is what the simulator needs to predict throughput.

use serde::{Deserialize, Serialize};
use wagma::exec::virtual_time::{self, VirtualConfig};
use wagma::schedule::{AlgorithmChoice, AllreduceAlgorithm};
use wagma::topology::{Grouping, GroupingKind, ring_neighbors};
use wagma::{Comm, Payload};

use crate::SimError;
use crate::loggp::{LogGp, LogGpNetwork};

/// A collective that can be measured and simulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    /// Allreduce over all ranks.
    Allreduce(AllreduceAlgorithm),
    /// Allreduce in the round-0 butterfly group.
    GroupAllreduce(AllreduceAlgorithm),
    /// Ring neighbour exchange.
    NeighbourExchange,
}

/// One measurement: a collective of `elements` f32 among `ranks` ranks (groups of
/// `group_size`) took `seconds` (the slowest rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// The collective.
    pub collective: Collective,
    /// Ranks.
    pub ranks: usize,
    /// Group size.
    pub group_size: usize,
    /// Elements.
    pub elements: usize,
    /// Measured seconds.
    pub seconds: f64,
}

/// Runs `op` once on every rank (after a barrier) and returns the slowest rank's time.
pub async fn time_collective(
    c: &mut Comm,
    collective: Collective,
    group_size: usize,
    data: Payload,
    seq: u64,
) -> Result<f64, wagma::Error> {
    let (p, rank) = (c.size(), c.rank());
    c.barrier().await?;
    let t0 = c.now();
    match collective {
        Collective::Allreduce(a) | Collective::GroupAllreduce(a) => {
            let members: Vec<usize> = if matches!(collective, Collective::Allreduce(_)) {
                (0..p).collect()
            } else {
                Grouping::new(p, group_size, GroupingKind::Butterfly)?.group_of(rank, 0)
            };
            let choice = AlgorithmChoice {
                algorithm: a,
                ..AlgorithmChoice::default()
            };
            c.allreduce_with(&members, seq, data, 0, &choice).await?;
        }
        Collective::NeighbourExchange => {
            let nb = ring_neighbors(rank, p);
            c.exchange(seq, &nb, &nb, data, 0.0, 0).await?;
        }
    }
    Ok((c.now() - t0).as_secs_f64())
}

/// The simulated time of one measurement's collective over `network`.
pub fn simulated(m: &Measurement, network: LogGp) -> Result<f64, SimError> {
    let vcfg = VirtualConfig {
        seed: 1,
        network: Box::new(LogGpNetwork::new(network, m.ranks)),
    };
    let times = virtual_time::run(m.ranks, crate::virtual_engine(), vcfg, async |c| {
        time_collective(
            c,
            m.collective,
            m.group_size,
            Payload::Size(m.elements),
            1 << 40,
        )
        .await
    })?
    .into_all()?;
    Ok(times.into_iter().fold(0.0, f64::max))
}

/// Least-squares L and G (relative errors) for `measurements`; `o` and `g` are kept from
/// `template`.
pub fn fit(measurements: &[Measurement], template: LogGp) -> Result<LogGp, SimError> {
    if measurements.is_empty() {
        return Err(SimError::Config("no measurements to fit".into()));
    }
    let unit_l = LogGp {
        latency_s: 1.0,
        overhead_s: 0.0,
        gap_s: 0.0,
        per_byte_s: 0.0,
        ..template
    };
    let unit_g = LogGp {
        latency_s: 0.0,
        per_byte_s: 1.0,
        ..unit_l
    };
    // Rows: (a, b, t) with t ~ a*L + b*G, weighted by 1/t.
    let mut rows = Vec::with_capacity(measurements.len());
    for m in measurements {
        if !(m.seconds.is_finite() && m.seconds > 0.0) {
            continue;
        }
        let a = simulated(m, unit_l)?;
        let b = simulated(m, unit_g)?;
        rows.push((a / m.seconds, b / m.seconds));
    }
    if rows.is_empty() {
        return Err(SimError::Config("no usable measurement".into()));
    }
    let (saa, sab, sbb, sa, sb) = rows.iter().fold((0.0, 0.0, 0.0, 0.0, 0.0), |acc, &(a, b)| {
        (
            acc.0 + a * a,
            acc.1 + a * b,
            acc.2 + b * b,
            acc.3 + a,
            acc.4 + b,
        )
    });
    let det = saa * sbb - sab * sab;
    let (mut l, mut g) = if det.abs() > 1e-30 {
        ((sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det)
    } else {
        (0.0, 0.0)
    };
    // Keep both non-negative: refit one alone when the other comes out negative.
    if l < 0.0 || det.abs() <= 1e-30 {
        l = 0.0;
        g = if sbb > 0.0 { sb / sbb } else { 0.0 };
    }
    if g < 0.0 {
        g = 0.0;
        l = if saa > 0.0 { sa / saa } else { 0.0 };
    }
    Ok(LogGp {
        latency_s: l,
        per_byte_s: g,
        ..template
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_the_parameters_of_a_simulated_network() {
        let truth = LogGp {
            latency_s: 20e-6,
            overhead_s: 0.0,
            gap_s: 0.0,
            per_byte_s: 1.0 / 2e9,
            node_limit: true,
        };
        let mut ms = Vec::new();
        for c in [
            Collective::Allreduce(AllreduceAlgorithm::RecursiveDoubling),
            Collective::GroupAllreduce(AllreduceAlgorithm::ReduceScatterAllgather),
            Collective::NeighbourExchange,
        ] {
            for n in [0usize, 1 << 10, 1 << 16, 1 << 20] {
                let mut m = Measurement {
                    collective: c,
                    ranks: 8,
                    group_size: 4,
                    elements: n,
                    seconds: 0.0,
                };
                m.seconds = simulated(&m, truth).unwrap();
                ms.push(m);
            }
        }
        let fitted = fit(&ms, truth).unwrap();
        assert!(
            (fitted.latency_s / truth.latency_s - 1.0).abs() < 0.05,
            "{fitted:?}"
        );
        assert!(
            (fitted.per_byte_s / truth.per_byte_s - 1.0).abs() < 0.05,
            "{fitted:?}"
        );
    }
}
