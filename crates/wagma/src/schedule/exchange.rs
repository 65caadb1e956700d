//! Point-to-point patterns: neighbour exchange, push-sum step, AD-PSGD's pairwise request and
//! the activation broadcast's cost.

use smallvec::smallvec;

use super::{Combine, Cost, Phase, Schedule, Transfer};
use crate::Rank;
use crate::payload::Reduce;
use crate::topology::activation_edges;

/// One phase that sends the whole buffer to every rank of `send_to` and sums what arrives from
/// every rank of `recv_from` (in rank order, with the local buffer). With `send_to == recv_from`
/// the ring neighbours this is D-PSGD's neighbour exchange; with the out- and in-peers of the
/// exponential graph it is SGP's push-sum step (the caller scales the buffer and its weight
/// first).
pub fn exchange(send_to: &[Rank], recv_from: &[Rank], len: usize) -> Schedule {
    let t = |&peer: &Rank| Transfer {
        peer,
        range: 0..len,
        step: 0,
    };
    let phases = if send_to.is_empty() && recv_from.is_empty() {
        Vec::new()
    } else {
        vec![Phase {
            sends: send_to.iter().map(t).collect(),
            recvs: recv_from.iter().map(t).collect(),
            combine: Combine::Reduce(Reduce::Sum),
        }]
    };
    Schedule { len, phases }
}

/// D-PSGD's neighbour exchange as the WAGMA-SGD authors' baseline runs it: blocking
/// rendezvous `Send(right)` then `Send(left)` after both receives are posted. A rank may send
/// only once its right neighbour has entered the exchange, so the right neighbour's data
/// depends on the rank two to the right. Phase 0 carries the rendezvous: an empty ready
/// message to `left` (whose first send is to this rank) and one awaited from `right`; phase 1
/// sends to `right`, then `left`, and sums what both send. The sum is [`exchange`]'s.
pub fn exchange_right_then_left(left: Rank, right: Rank, len: usize) -> Schedule {
    let t = |peer: Rank, range: std::ops::Range<usize>, step: u16| Transfer { peer, range, step };
    let mut both = vec![right, left];
    both.dedup();
    let mut from = both.clone();
    from.sort_unstable();
    Schedule {
        len,
        phases: vec![
            Phase {
                sends: smallvec![t(left, 0..0, 0)],
                recvs: smallvec![t(right, 0..0, 0)],
                combine: Combine::Copy,
            },
            Phase {
                sends: both.iter().map(|&p| t(p, 0..len, 1)).collect(),
                recvs: from.iter().map(|&p| t(p, 0..len, 1)).collect(),
                combine: Combine::Reduce(Reduce::Sum),
            },
        ],
    }
}

/// A sum among `members` as one full exchange with every other member: unlike the staged
/// allreduce algorithms, it completes whichever members turn out to be dead (elastic mode).
pub fn exchange_among(rank: Rank, members: impl IntoIterator<Item = Rank>, len: usize) -> Schedule {
    let others: Vec<Rank> = members.into_iter().filter(|&m| m != rank).collect();
    exchange(&others, &others, len)
}

/// The active side of an AD-PSGD pairwise averaging: send the model to `passive` (step 0) and
/// receive the pair's average back (step 1). The passive side is answered by its engine.
pub fn pair_request(passive: Rank, len: usize) -> Schedule {
    Schedule {
        len,
        phases: vec![
            Phase {
                sends: smallvec![Transfer {
                    peer: passive,
                    range: 0..len,
                    step: 0,
                }],
                recvs: smallvec![],
                combine: Combine::Copy,
            },
            Phase {
                sends: smallvec![],
                recvs: smallvec![Transfer {
                    peer: passive,
                    range: 0..len,
                    step: 1,
                }],
                combine: Combine::Copy,
            },
        ],
    }
}

/// Messages `rank` sends to forward a round's activation received on dimension `received_on`
/// (`None`: it activates the round), along [`activation_edges`]; a rank sends each edge at most
/// once per round, whoever activated it. Activation messages carry no payload.
pub fn activation_cost(rank: Rank, ranks: usize, received_on: Option<u32>) -> Cost {
    Cost {
        messages: activation_edges(rank, ranks, received_on).len(),
        bytes: 0,
        phases: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_shapes() {
        let s = exchange(&[1, 3], &[1, 3], 10);
        assert_eq!(s.cost().messages, 2);
        assert_eq!(s.peers(), vec![1, 3]);
        assert!(exchange(&[], &[], 10).phases.is_empty());
        assert_eq!(pair_request(5, 4).cost().bytes, 16);
        assert_eq!(activation_cost(0, 8, None).messages, 3);
        assert_eq!(activation_cost(4, 8, Some(2)).messages, 0);
    }
}
