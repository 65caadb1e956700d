//! Who talks to whom: groups per round, peer graphs and activation trees. Pure functions of
//! (rank, P, round, configuration); no data, time or transport.

mod graphs;
mod grouping;
mod tree;

pub use graphs::{ExponentialGraph, PairRole, Pairing, PeerOffsets, ring_neighbors};
pub(crate) use grouping::subset_members;
pub use grouping::{Grouping, GroupingKind, default_group_size};
pub use tree::{TreeEdge, activation_edges, tree_children, tree_parent};
