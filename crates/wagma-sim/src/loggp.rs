//! The LogGP network model (Alexandrov et al., 1995): a message of k bytes leaves its sender
//! after the CPU overhead `o` once the sender's network interface is free, occupies the
//! interface for `max(g, k*G)`, and arrives `L + k*G` later, plus the receiver's overhead `o`.
//! With the per-node injection limit, a receiving interface also takes messages one at a time.

use serde::{Deserialize, Serialize};
use wagma::Rank;
use wagma::exec::virtual_time::NetworkModel;

/// LogGP parameters, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LogGp {
    /// Wire latency L.
    pub latency_s: f64,
    /// CPU overhead o at each end.
    pub overhead_s: f64,
    /// Minimum gap g between two messages of one interface.
    pub gap_s: f64,
    /// Time per byte G (the inverse of the bandwidth).
    pub per_byte_s: f64,
    /// Receivers take one message at a time too (per-node injection limit at both ends).
    pub node_limit: bool,
}

impl LogGp {
    /// The paper's machine, Cray XC50 (Piz Daint) with the Aries interconnect: MPI latency
    /// about 1.3 us, injection bandwidth about 10 GB/s per node (9.7 GB/s measured point to
    /// point), a per-message software overhead of 0.5 us and a message gap of 0.1 us.
    pub fn aries() -> LogGp {
        LogGp {
            latency_s: 1.3e-6,
            overhead_s: 0.5e-6,
            gap_s: 0.1e-6,
            per_byte_s: 1.0 / 9.7e9,
            node_limit: true,
        }
    }

    /// Checks that every parameter is finite, non-negative and at most [`LogGp::MAX_S`].
    pub fn validate(&self) -> Result<(), String> {
        for (n, v) in [
            ("latency", self.latency_s),
            ("overhead", self.overhead_s),
            ("gap", self.gap_s),
            ("per-byte time", self.per_byte_s),
        ] {
            if !(v.is_finite() && (0.0..=Self::MAX_S).contains(&v)) {
                return Err(format!(
                    "LogGP {n} must be finite, >= 0 and <= {} s, got {v}",
                    Self::MAX_S
                ));
            }
        }
        Ok(())
    }

    /// The largest value of each parameter, in seconds: one second of latency, or a byte
    /// per second, is beyond any real network, and keeps a message's time representable.
    pub const MAX_S: f64 = 1.0;

    /// One-way time of a `bytes` message on an idle network.
    pub fn message_time(&self, bytes: usize) -> f64 {
        2.0 * self.overhead_s + self.latency_s + bytes as f64 * self.per_byte_s
    }
}

/// [`LogGp`] with the state of every interface.
pub struct LogGpNetwork {
    p: LogGp,
    send_free: Vec<f64>,
    recv_free: Vec<f64>,
}

impl LogGpNetwork {
    /// A network of `ranks` nodes.
    pub fn new(p: LogGp, ranks: usize) -> LogGpNetwork {
        LogGpNetwork {
            p,
            send_free: vec![0.0; ranks],
            recv_free: vec![0.0; ranks],
        }
    }
}

impl NetworkModel for LogGpNetwork {
    fn arrival(
        &mut self,
        now: std::time::Duration,
        from: Rank,
        to: Rank,
        bytes: usize,
        _noise: f64,
    ) -> std::time::Duration {
        let p = &self.p;
        let now = now.as_secs_f64();
        let wire = bytes as f64 * p.per_byte_s;
        let start = (now + p.overhead_s).max(self.send_free.get(from).copied().unwrap_or(0.0));
        if let Some(f) = self.send_free.get_mut(from) {
            *f = start + p.gap_s.max(wire);
        }
        let mut arrive = start + p.latency_s + wire;
        if p.node_limit
            && let Some(r) = self.recv_free.get_mut(to)
        {
            arrive = arrive.max(*r + wire);
            *r = arrive;
        }
        std::time::Duration::from_secs_f64(arrive + p.overhead_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parameters_beyond_any_network_are_refused() {
        assert!(LogGp::aries().validate().is_ok());
        let slow = LogGp {
            per_byte_s: 1e20,
            ..LogGp::aries()
        };
        assert!(slow.validate().is_err_and(|m| m.contains("per-byte time")));
        let late = LogGp {
            latency_s: 1e20,
            ..LogGp::aries()
        };
        assert!(late.validate().is_err_and(|m| m.contains("latency")));
    }

    #[test]
    fn serializes_an_interface() {
        let p = LogGp {
            latency_s: 1e-6,
            overhead_s: 0.0,
            gap_s: 0.0,
            per_byte_s: 1e-9,
            node_limit: true,
        };
        let mut n = LogGpNetwork::new(p, 3);
        let a = n.arrival(Duration::ZERO, 0, 1, 1000, 0.0).as_secs_f64();
        let b = n.arrival(Duration::ZERO, 0, 2, 1000, 0.0).as_secs_f64();
        assert!((a - 2e-6).abs() < 1e-12);
        // The second message waits for the first to leave the sender.
        assert!((b - 3e-6).abs() < 1e-12);
        // Two senders into one receiver: the receiver takes them one at a time.
        let mut n = LogGpNetwork::new(p, 3);
        let a = n.arrival(Duration::ZERO, 0, 2, 1000, 0.0).as_secs_f64();
        let b = n.arrival(Duration::ZERO, 1, 2, 1000, 0.0).as_secs_f64();
        assert!(b > a);
        assert!((p.message_time(1000) - 2e-6).abs() < 1e-12);
    }
}
