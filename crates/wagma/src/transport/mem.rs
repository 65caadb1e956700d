//! The in-process transport: ranks are threads of one process and a message is moved into the
//! receiver's inbox, payload included, without a copy.

use crossbeam_channel::{Receiver, Sender, unbounded};

use super::{Envelope, Incoming, Transport};
use crate::Rank;
use crate::error::TransportError;

/// One rank's end of an in-process network.
pub struct MemTransport {
    rank: Rank,
    peers: Vec<Sender<Incoming>>,
}

/// Creates the transports and inboxes of `ranks` in-process ranks.
pub fn network(ranks: usize) -> Vec<(MemTransport, Receiver<Incoming>)> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..ranks).map(|_| unbounded()).unzip();
    receivers
        .into_iter()
        .enumerate()
        .map(|(rank, rx)| {
            (
                MemTransport {
                    rank,
                    peers: senders.clone(),
                },
                rx,
            )
        })
        .collect()
}

impl Transport for MemTransport {
    fn send(&mut self, to: Rank, env: Envelope) -> Result<(), TransportError> {
        let Some(peer) = self.peers.get(to) else {
            return Err(TransportError::Peer {
                peer: to,
                message: format!("no such rank (job has {})", self.peers.len()),
            });
        };
        peer.send(Ok(env.into())).map_err(|_| TransportError::Peer {
            peer: to,
            message: format!("rank {to} has left (seen from rank {})", self.rank),
        })
    }
}
