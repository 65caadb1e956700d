//! Evaluation that does not disturb the run, and the fair clock.
//!
//! At every evaluation iteration each rank only takes a [`Snapshot`]: a copy of its replica
//! (parameters and buffers), its own training clock, its waiting and staleness so far and its
//! training losses since the previous snapshot. Nothing on the training path communicates for
//! it, so the drift between replicas and the lag between ranks are whatever the algorithm makes
//! them. After training, [`evaluate_snapshots`] forms, for each evaluation iteration t, the
//! consensus model (the mean of the ranks' snapshots of t), the consensus distance and rank 0's
//! replica, evaluates both on the held-out data (split among the ranks) and dates the point by
//! the fair clock: the time at which the *last* rank finished iteration t.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use wagma::algo::Worker;
use wagma::util::Histogram;
use wagma::{Payload, Rank};

use crate::error::TrainError;
use crate::flat::FlatModel;
use crate::trainer::Shared;
use crate::workloads::Workload;

/// One evaluation: a line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// Iterations done.
    pub iteration: u64,
    /// Seconds of training until the last rank finished this iteration (each rank's clock
    /// excludes only its own evaluation and checkpoint work, never its waiting).
    pub wall_s: f64,
    /// Samples processed by all ranks.
    pub samples: u64,
    /// Metrics of the consensus model (the global average of the ranks' replicas at this
    /// iteration).
    pub consensus: BTreeMap<String, f64>,
    /// Metrics of rank 0's replica at this iteration.
    pub replica0: Option<BTreeMap<String, f64>>,
    /// Mean squared distance of the replicas to their average.
    pub consensus_distance: f64,
    /// Share of the ranks' time spent waiting so far.
    #[serde(default)]
    pub wait_fraction: f64,
    /// Staleness of the contributions used so far, all ranks (values above 63 are counted
    /// at 63).
    #[serde(default)]
    pub staleness: Histogram,
    /// Ranks whose replica is in the consensus (fewer than the job's after a loss in elastic
    /// mode).
    #[serde(default)]
    pub ranks_alive: usize,
    /// Training loss since the previous evaluation, mean over ranks and steps.
    #[serde(default)]
    pub train_loss: Option<f64>,
}

/// Staleness buckets carried by a summation over ranks (the last one collects the rest).
const STALENESS_BUCKETS: usize = 64;

/// Numbers in [`Totals::local`].
const TOTALS: usize = 2 + STALENESS_BUCKETS;

/// Waiting, staleness and liveness of the ranks, summed over them.
pub(crate) struct Totals {
    pub(crate) wait_s: f64,
    pub(crate) staleness: Histogram,
    pub(crate) alive: usize,
}

impl Totals {
    /// This rank's part, as numbers to sum over ranks.
    pub(crate) fn local(cs: &wagma::exec::CommStats) -> Vec<f64> {
        let mut v = vec![0.0; TOTALS];
        v[0] = cs.wait_s;
        v[1] = 1.0;
        for (k, c) in cs.staleness.iter() {
            v[2 + (k as usize).min(STALENESS_BUCKETS - 1)] += c as f64;
        }
        v
    }

    /// Reads the sums of [`Totals::local`] from the front of `sums`.
    pub(crate) fn read(sums: &[f64]) -> Totals {
        let mut staleness = Histogram::default();
        for (k, &c) in sums[2..2 + STALENESS_BUCKETS].iter().enumerate() {
            staleness.record_n(k as u64, c.round() as u64);
        }
        Totals {
            wait_s: sums[0],
            alive: sums[1].round() as usize,
            staleness,
        }
    }

    /// Share of the ranks' time spent waiting over `wall_s`.
    pub(crate) fn wait_fraction(&self, wall_s: f64) -> f64 {
        self.wait_s / (wall_s.max(1e-9) * self.alive.max(1) as f64)
    }
}

/// This rank's training losses since the last evaluation.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LossSum {
    sum: f64,
    steps: u64,
}

impl LossSum {
    pub(crate) fn add(&mut self, loss: f32) {
        self.sum += f64::from(loss);
        self.steps += 1;
    }

    /// The mean loss, if any step was taken.
    pub(crate) fn mean(&self) -> Option<f64> {
        (self.steps > 0).then(|| self.sum / self.steps as f64)
    }
}

/// What one rank keeps of an evaluation iteration.
pub(crate) struct Snapshot {
    /// The iteration just finished.
    pub(crate) iteration: u64,
    /// Samples processed by all ranks so far (as this rank counts them).
    pub(crate) samples: u64,
    /// This rank's training clock when it finished the iteration, in nanoseconds.
    pub(crate) clock_ns: u64,
    /// Its replica.
    pub(crate) params: Vec<f32>,
    /// Its buffers.
    pub(crate) buffers: Vec<f32>,
    /// [`Totals::local`] at that moment.
    pub(crate) totals: Vec<f64>,
    /// Its training losses since the previous snapshot.
    pub(crate) losses: LossSum,
}

impl Snapshot {
    /// The snapshot of `worker` after `iteration` (no communication).
    pub(crate) fn take(
        worker: &mut Worker<'_>,
        iteration: u64,
        samples: u64,
        clock_s: f64,
        losses: LossSum,
    ) -> Snapshot {
        Snapshot {
            iteration,
            samples,
            clock_ns: secs_to_ns(clock_s),
            params: worker.params().to_vec(),
            buffers: worker.buffers().to_vec(),
            totals: Totals::local(worker.comm().stats()),
            losses,
        }
    }
}

/// Seconds as whole nanoseconds (for exact transport through [`wagma::exec::Comm::gather_u64`]).
pub(crate) fn secs_to_ns(s: f64) -> u64 {
    (s.max(0.0) * 1e9).round() as u64
}

/// A replica's squared distance from the consensus.
fn squared_distance(replica: &[f32], consensus: &[f32]) -> f64 {
    replica
        .iter()
        .zip(consensus)
        .map(|(&a, &b)| f64::from(a - b).powi(2))
        .sum()
}

/// The latest of the ranks' clocks in seconds; zeros (ranks with nothing to report) are absent.
pub(crate) fn latest_s(clocks: impl IntoIterator<Item = u64>) -> f64 {
    clocks.into_iter().max().unwrap_or(0) as f64 * 1e-9
}

/// The latest of the clocks (in nanoseconds) at position `i` of what each rank passed to
/// [`wagma::exec::Comm::gather_u64`].
pub(crate) fn latest_in(gathered: &[Vec<u64>], i: usize) -> f64 {
    latest_s(gathered.iter().filter_map(|v| v.get(i).copied()))
}

/// An evaluated point and the consensus model it was computed from.
pub(crate) struct Evaluation {
    pub(crate) record: EvalRecord,
    pub(crate) consensus: (Vec<f32>, Vec<f32>),
}

/// Evaluates every rank's snapshots, point by point (a collective: every rank calls it once,
/// after training). A rank without a snapshot of some point (it joined later, or was lost)
/// contributes nothing to that point, and the consensus is the mean over those that did.
pub(crate) async fn evaluate_snapshots<W: Workload>(
    worker: &mut Worker<'_>,
    fm: &mut FlatModel<W::Model>,
    s: &Shared<'_, W>,
    snaps: Vec<Snapshot>,
) -> Result<Vec<Evaluation>, TrainError> {
    let rank = worker.comm().rank();
    // The points: every evaluation iteration some rank has. Each end travels as iteration +
    // 1, so that a rank without snapshots and a lost rank (whose slots read as zeros) both
    // say nothing.
    let ends = [
        snaps.first().map_or(0, |x| x.iteration.saturating_add(1)),
        snaps.last().map_or(0, |x| x.iteration.saturating_add(1)),
    ];
    let ends = worker.comm().gather_u64(&ends).await?;
    let said = |i: usize| {
        ends.iter()
            .filter_map(move |e| e.get(i).copied().filter(|&x| x > 0))
    };
    let first = said(0).min().map(|x| x - 1);
    // No rank evaluates past the run's last step, whatever a peer reports.
    let last = said(1).max().map(|x| (x - 1).min(s.cfg.steps));
    let points: Vec<u64> = match (first, last) {
        (Some(a), Some(b)) if a <= b => {
            let mine: Vec<u64> = snaps.iter().map(|x| x.iteration).collect();
            // Evaluation iterations follow one rule on every rank; the union is that rule
            // between the earliest and the latest point.
            (a..=b)
                .filter(|&t| s.cfg.is_eval_point(t) || mine.contains(&t))
                .collect()
        }
        _ => Vec::new(),
    };
    let by_iter: BTreeMap<u64, Snapshot> = snaps.into_iter().map(|x| (x.iteration, x)).collect();
    let clocks: Vec<u64> = points
        .iter()
        .map(|t| by_iter.get(t).map_or(0, |x| x.clock_ns.max(1)))
        .collect();
    let clocks = worker.comm().gather_u64(&clocks).await?;
    let living = worker.comm().living_ranks().await?;
    let shard = living.iter().position(|&r| r == rank).unwrap_or(0);
    let (n, nb) = (s.init.params.len(), s.init.buffers.len());
    let mut out = Vec::with_capacity(points.len());
    for (j, t) in points.iter().enumerate() {
        let mine = by_iter.get(t);
        let wall_s = latest_in(&clocks, j);
        // The consensus: the sum of the snapshots and how many there are.
        // A rank without a snapshot adds -0.0, the exact identity (+0.0 would turn a -0.0
        // into +0.0).
        let mut v = vec![-0f32; n + nb + 1];
        if let Some(x) = mine {
            v[..n].copy_from_slice(&x.params);
            v[n..n + nb].copy_from_slice(&x.buffers);
            v[n + nb] = 1.0;
        }
        // Folded in rank order: the bits of the in-process consensus below.
        let mut sum = worker
            .comm()
            .allreduce_in_rank_order(Payload::Data(v))
            .await?
            .into_vec();
        let count = sum.pop().unwrap_or(0.0).max(1.0);
        for x in &mut sum {
            *x /= count;
        }
        let buffers = sum.split_off(n);
        let params = sum;
        let distance = mine.map_or(0.0, |x| squared_distance(&x.params, &params));
        let mut stats = eval_with(fm, s.w, &params, &buffers, shard, living.len());
        let k = stats.len();
        if s.cfg.eval_replica {
            let r0 = replica_of(worker, 0, mine, n, nb).await?;
            stats.extend(eval_with(fm, s.w, &r0[..n], &r0[n..], shard, living.len()));
        }
        let m = stats.len();
        match mine {
            Some(x) => stats.extend(&x.totals),
            None => stats.extend([0.0; TOTALS]),
        }
        let q = stats.len();
        let losses = mine.map(|x| x.losses).unwrap_or_default();
        stats.extend([losses.sum, losses.steps as f64, distance]);
        let sums = sum_over_ranks(worker, &stats).await?;
        let point = Point {
            iteration: *t,
            wall_s,
            samples: mine.map_or(0, |x| x.samples),
        };
        let replica = s.cfg.eval_replica.then(|| &sums[k..m]);
        let record = point.record(s, &sums[..k], replica, &sums[m..q], &sums[q..]);
        out.push(Evaluation {
            record,
            consensus: (params, buffers),
        });
    }
    Ok(out)
}

/// What identifies an evaluated point.
struct Point {
    iteration: u64,
    wall_s: f64,
    samples: u64,
}

impl Point {
    /// The record from statistics summed over the ranks: the consensus model's and the
    /// replica's evaluation statistics, the [`Totals`], and `[loss sum, loss steps, sum of
    /// squared distances]`.
    fn record<W: Workload>(
        &self,
        s: &Shared<'_, W>,
        consensus: &[f64],
        replica: Option<&[f64]>,
        totals: &[f64],
        rest: &[f64],
    ) -> EvalRecord {
        let named = |xs: &[f64]| -> BTreeMap<String, f64> {
            s.w.metrics(xs)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect()
        };
        let totals = Totals::read(totals);
        EvalRecord {
            iteration: self.iteration,
            wall_s: self.wall_s,
            samples: self.samples,
            consensus: named(consensus),
            replica0: replica.map(named),
            consensus_distance: rest[2] / totals.alive.max(1) as f64,
            // A resumed run's waiting is counted since its resume, and so is its time.
            wait_fraction: totals.wait_fraction(self.wall_s - s.resumed_s()),
            staleness: totals.staleness,
            ranks_alive: totals.alive,
            train_loss: (rest[1] > 0.0).then(|| rest[0] / rest[1]),
        }
    }
}

/// Evaluates the snapshots of every rank of a job that ran in this process (`ranks[r]`: rank
/// r's), on as many threads as the machine has cores: point by point, the consensus (the mean
/// over the ranks that have a snapshot of the point, summed in rank order) and rank 0's replica,
/// each on the whole held-out set.
pub(crate) fn evaluate_in_process<W: Workload>(
    s: &Shared<'_, W>,
    mut ranks: Vec<Vec<Snapshot>>,
) -> Result<Vec<Evaluation>, TrainError> {
    let mut iterations: Vec<u64> = ranks.iter().flatten().map(|x| x.iteration).collect();
    iterations.sort_unstable();
    iterations.dedup();
    let (n, nb) = (s.init.params.len(), s.init.buffers.len());
    struct Prepared {
        point: Point,
        consensus: (Vec<f32>, Vec<f32>),
        replica: Option<(Vec<f32>, Vec<f32>)>,
        totals: Vec<f64>,
        rest: [f64; 3],
    }
    let mut prepared = Vec::with_capacity(iterations.len());
    for &t in &iterations {
        // (rank, snapshot) of every rank that has one of iteration t.
        let present: Vec<(usize, Snapshot)> = ranks
            .iter_mut()
            .enumerate()
            .filter_map(|(r, snaps)| {
                let i = snaps.iter().position(|x| x.iteration == t)?;
                Some((r, snaps.remove(i)))
            })
            .collect();
        let count = present.len().max(1) as f32;
        // ((x0 + x1) + x2) + ...: the distributed consensus's fold, bit for bit.
        let (mut params, mut buffers) = match present.first() {
            Some((_, x)) => (x.params.clone(), x.buffers.clone()),
            None => (vec![0f32; n], vec![0f32; nb]),
        };
        for (_, x) in present.iter().skip(1) {
            for (a, b) in params.iter_mut().zip(&x.params) {
                *a += b;
            }
            for (a, b) in buffers.iter_mut().zip(&x.buffers) {
                *a += b;
            }
        }
        for v in params.iter_mut().chain(buffers.iter_mut()) {
            *v /= count;
        }
        let mut totals = vec![0.0; TOTALS];
        let mut rest = [0.0; 3];
        for (_, x) in &present {
            for (a, b) in totals.iter_mut().zip(&x.totals) {
                *a += b;
            }
            rest[0] += x.losses.sum;
            rest[1] += x.losses.steps as f64;
            rest[2] += squared_distance(&x.params, &params);
        }
        let point = Point {
            iteration: t,
            wall_s: latest_s(present.iter().map(|(_, x)| x.clock_ns)),
            samples: present.first().map_or(0, |(_, x)| x.samples),
        };
        let replica = present
            .into_iter()
            .find(|(r, _)| *r == 0 && s.cfg.eval_replica)
            .map(|(_, x)| (x.params, x.buffers));
        prepared.push(Prepared {
            point,
            consensus: (params, buffers),
            replica,
            totals,
            rest,
        });
    }
    // The models to evaluate: each point's consensus, then its replica.
    let models: Vec<(&[f32], &[f32])> = prepared
        .iter()
        .flat_map(|p| {
            std::iter::once((p.consensus.0.as_slice(), p.consensus.1.as_slice())).chain(
                p.replica
                    .as_ref()
                    .map(|(a, b)| (a.as_slice(), b.as_slice())),
            )
        })
        .collect();
    let mut stats = evaluate_models(s.w, &models)?.into_iter();
    let mut out = Vec::with_capacity(prepared.len());
    for p in prepared {
        let consensus = stats.next().unwrap_or_default();
        let replica = p.replica.as_ref().and_then(|_| stats.next());
        let record = p
            .point
            .record(s, &consensus, replica.as_deref(), &p.totals, &p.rest);
        out.push(Evaluation {
            record,
            consensus: p.consensus,
        });
    }
    Ok(out)
}

/// The evaluation statistics of each `(params, buffers)` on the whole held-out set, computed
/// on up to one thread per core.
fn evaluate_models<W: Workload>(
    w: &W,
    models: &[(&[f32], &[f32])],
) -> Result<Vec<Vec<f64>>, TrainError> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(models.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    std::thread::scope(|scope| -> Result<(), TrainError> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut fm = crate::trainer::build_flat(w);
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(params, buffers)) = models.get(i) else {
                            return done;
                        };
                        done.push((i, eval_with(&mut fm, w, params, buffers, 0, 1)));
                    }
                })
            })
            .collect();
        for h in workers {
            let done = h
                .join()
                .map_err(|_| TrainError::Internal("an evaluation thread panicked".into()))?;
            for (i, r) in done {
                results[i] = r;
            }
        }
        Ok(())
    })?;
    Ok(results)
}

/// Rank `owner`'s snapshot (parameters then buffers), sent to everyone (the others contribute
/// zeros); zeros when the owner has none.
async fn replica_of(
    worker: &mut Worker<'_>,
    owner: Rank,
    mine: Option<&Snapshot>,
    n: usize,
    nb: usize,
) -> Result<Vec<f32>, TrainError> {
    let mut v = vec![0f32; n + nb];
    if worker.comm().rank() == owner
        && let Some(x) = mine
    {
        v[..n].copy_from_slice(&x.params);
        v[n..].copy_from_slice(&x.buffers);
    }
    Ok(worker.comm().allreduce(Payload::Data(v)).await?.into_vec())
}

/// Sums `xs` over the ranks in `f64`, in rank order. The engine's own sums are `f32`, which
/// would round counts past 2^24: each value travels exactly, as its bits, through
/// [`wagma::exec::Comm::gather_u64`].
pub(crate) async fn sum_over_ranks(
    worker: &mut Worker<'_>,
    xs: &[f64],
) -> Result<Vec<f64>, TrainError> {
    let bits: Vec<u64> = xs.iter().map(|x| x.to_bits()).collect();
    let all = worker.comm().gather_u64(&bits).await?;
    Ok(sum_in_rank_order(&all, xs.len()))
}

/// The `k` sums of every rank's values, gathered as bits, in rank order.
fn sum_in_rank_order(all: &[Vec<u64>], k: usize) -> Vec<f64> {
    let mut sums = vec![0f64; k];
    for rank in all {
        for (sum, &b) in sums.iter_mut().zip(rank) {
            *sum += f64::from_bits(b);
        }
    }
    sums
}

/// Additive evaluation statistics of the model `(params, buffers)` over shard `rank` of `p`.
fn eval_with<W: Workload>(
    fm: &mut FlatModel<W::Model>,
    w: &W,
    params: &[f32],
    buffers: &[f32],
    rank: usize,
    p: usize,
) -> Vec<f64> {
    fm.set_params(params);
    if !buffers.is_empty() {
        fm.set_buffers(buffers);
    }
    w.evaluate(&fm.eval_model(), rank, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_over_ranks_keep_what_f32_would_round() {
        // Counts past 2^24 and fractions: an f32 sum would lose the odd samples and the tails.
        let per_rank: [Vec<f64>; 3] = [
            vec![16_777_217.0, 0.1, 3.0e9 + 1.0],
            vec![16_777_219.0, 0.2, 5.0],
            vec![1.0, 1e-9, 7.0],
        ];
        let ranks = per_rank.len();
        // Gathered through the engine, as the ranks of a job do.
        let job = wagma::exec::threaded::run(ranks, wagma::EngineConfig::default(), async |c| {
            let bits: Vec<u64> = per_rank[c.rank()].iter().map(|x| x.to_bits()).collect();
            Ok(sum_in_rank_order(&c.gather_u64(&bits).await?, 3))
        });
        for sums in job.unwrap().into_all().unwrap() {
            assert_eq!(sums[0], 33_554_437.0);
            assert!((sums[1] - 0.300_000_001).abs() < 1e-12, "{}", sums[1]);
            assert_eq!(sums[2], 3_000_000_013.0);
        }
        // An f32 sum of the values themselves would not.
        assert_ne!(f64::from(16_777_217f32 + 16_777_219f32 + 1.0), 33_554_437.0);
    }
}
