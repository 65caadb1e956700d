//! `wagma bench ...`: benchmarks that compare side by side in one run and report ratios.

mod collectives;

use clap::Subcommand;

/// Benchmarks.
#[derive(Subcommand)]
pub enum Bench {
    /// Collectives (global and group allreduce, wait-avoiding round, neighbour exchange) next
    /// to a memcpy of the same buffer.
    Collectives(collectives::Args),
}

/// Runs a benchmark.
pub fn run(b: Bench) -> anyhow::Result<()> {
    match b {
        Bench::Collectives(a) => collectives::run(a),
    }
}

/// Median of `xs` (sorted in place).
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}
