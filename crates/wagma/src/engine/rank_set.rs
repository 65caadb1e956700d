//! A set of peers (dead, departed, joining) that costs nothing until a rank joins it: the
//! simulator holds thousands of engines, and one vector of P flags per engine and set meant
//! P^2 memory for sets that are almost always empty.

use fixedbitset::FixedBitSet;

use crate::Rank;

/// Ranks, as a bit set that grows only when a rank is added.
#[derive(Debug, Default, Clone)]
pub(super) struct RankSet(FixedBitSet);

impl RankSet {
    /// Whether `rank` is in the set.
    pub fn contains(&self, rank: Rank) -> bool {
        self.0.contains(rank)
    }

    /// Whether no rank is in the set (a few words to read: the set is as long as its
    /// largest rank ever added).
    pub fn is_empty(&self) -> bool {
        self.0.is_clear()
    }

    /// Adds `rank`.
    pub fn insert(&mut self, rank: Rank) {
        self.0.grow_and_insert(rank);
    }

    /// Removes `rank` (nothing if it is not in the set).
    pub fn remove(&mut self, rank: Rank) {
        if rank < self.0.len() {
            self.0.remove(rank);
        }
    }

    /// The ranks in the set, ascending.
    pub fn iter(&self) -> impl Iterator<Item = Rank> + '_ {
        self.0.ones()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_set_grows_on_insert_and_answers_for_any_rank() {
        let mut s = RankSet::default();
        assert!(!s.contains(0) && !s.contains(usize::MAX - 1) && s.is_empty());
        s.remove(7);
        s.insert(70);
        s.insert(3);
        s.insert(70);
        assert!(s.contains(3) && s.contains(70) && !s.contains(4) && !s.contains(500));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3, 70]);
        s.remove(70);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3]);
        s.remove(3);
        assert!(s.is_empty());
    }
}
