//! A running schedule's own contribution list: merged in place as the peers' lists arrive,
//! and shared with the messages that carry it.

use crate::transport::{Contribution, Contributions};

/// This rank's contribution list in a schedule, and its interned copy while it is unchanged.
pub(super) struct OwnContributions {
    list: Vec<Contribution>,
    /// `list` as messages carry it ([`Contributions::interned`]), until `list` changes.
    shared: Option<Contributions>,
}

impl OwnContributions {
    /// A list to merge into; it is created with room for every member of a group round, so
    /// that merging never grows it.
    pub fn new(list: Vec<Contribution>) -> Self {
        OwnContributions { list, shared: None }
    }

    /// The list, sorted by rank.
    pub fn as_slice(&self) -> &[Contribution] {
        &self.list
    }

    /// The list for a message: after a group's reduce-scatter every member holds the same
    /// list, and interning gives them one copy, which their messages share.
    pub fn share(&mut self) -> Contributions {
        let list = &self.list;
        self.shared
            .get_or_insert_with(|| Contributions::interned(list))
            .clone()
    }

    /// True when `other` equals this list: at once when it is this list's shared copy.
    pub fn equals(&self, other: &Contributions) -> bool {
        self.shared.as_ref().is_some_and(|s| s.same_copy(other))
            || other.as_slice() == self.list.as_slice()
    }

    /// Adds a peer's checked list (see [`merge`]).
    pub fn merge(&mut self, more: &[Contribution]) {
        if !more.is_empty() {
            self.shared = None;
            merge(&mut self.list, more);
        }
    }

    /// The list, sorted by rank.
    pub fn into_list(self) -> Vec<Contribution> {
        self.list
    }
}

/// Adds the sorted, rank-unique `more` to the sorted, rank-unique `into`, keeping the newest
/// contribution of a rank named by both.
fn merge(into: &mut Vec<Contribution>, more: &[Contribution]) {
    if more.is_empty() {
        return;
    }
    if into.last().is_none_or(|l| l.rank < more[0].rank) {
        into.extend_from_slice(more);
        return;
    }
    // In place, from the back (no allocation once `into` has grown): `k` is where the next
    // largest goes; `k >= i` always (`k = i + j + ranks named by both so far`), so nothing
    // unread is overwritten.
    let n = into.len();
    into.extend_from_slice(more);
    let (mut i, mut j, mut k) = (n, more.len(), n + more.len());
    while j > 0 {
        k -= 1;
        let y = more[j - 1];
        match into[..i].last().copied() {
            Some(x) if x.rank > y.rank => {
                into[k] = x;
                i -= 1;
            }
            Some(x) if x.rank == y.rank => {
                into[k] = if y.steps > x.steps { y } else { x };
                i -= 1;
                j -= 1;
            }
            _ => {
                into[k] = y;
                j -= 1;
            }
        }
    }
    let both = k - i;
    into.copy_within(k.., i);
    into.truncate(n + more.len() - both);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::Rank;

    /// A list of `(rank, steps)` pairs.
    pub(in crate::engine) fn list(v: &[(Rank, u64)]) -> Vec<Contribution> {
        v.iter()
            .map(|&(rank, steps)| Contribution { rank, steps })
            .collect()
    }

    #[test]
    fn merge_keeps_ranks_sorted_unique_and_newest() {
        let mut a = list(&[(1, 5), (3, 2), (7, 9)]);
        merge(&mut a, &list(&[(0, 1), (3, 4), (7, 8), (9, 1)]));
        assert_eq!(a, list(&[(0, 1), (1, 5), (3, 4), (7, 9), (9, 1)]));
        let mut b = list(&[(0, 1)]);
        merge(&mut b, &list(&[(2, 2), (4, 4)]));
        assert_eq!(b, list(&[(0, 1), (2, 2), (4, 4)]));
        let mut d = list(&[(2, 1), (5, 5), (6, 6)]);
        merge(&mut d, &list(&[(1, 1), (2, 3), (6, 2)]));
        assert_eq!(d, list(&[(1, 1), (2, 3), (5, 5), (6, 6)]));
        let mut e = list(&[(1, 1), (2, 3)]);
        merge(&mut e, &list(&[(1, 1), (2, 3)]));
        assert_eq!(e, list(&[(1, 1), (2, 3)]));
        let mut c = Vec::new();
        merge(&mut c, &list(&[(2, 2)]));
        merge(&mut c, &[]);
        assert_eq!(c, list(&[(2, 2)]));
    }

    #[test]
    fn equal_lists_share_one_copy_until_one_changes() {
        let mut a = OwnContributions::new(list(&[(1, 1), (2, 2)]));
        let mut b = OwnContributions::new(list(&[(1, 1), (2, 2)]));
        let (sa, sb) = (a.share(), b.share());
        assert!(sa.same_copy(&sb) && a.equals(&sb) && b.equals(&sa));
        // Equal by content without being the same copy.
        let copy = Contributions::from(list(&[(1, 1), (2, 2)]));
        assert!(!copy.same_copy(&sa) && a.equals(&copy) && copy == sa);
        b.merge(&list(&[(3, 1)]));
        assert!(!b.equals(&sa) && a.equals(&sa));
        let sb = b.share();
        assert!(!sb.same_copy(&sa));
        assert_eq!(sb.as_slice(), list(&[(1, 1), (2, 2), (3, 1)]).as_slice());
        // Merging nothing keeps the shared copy.
        a.merge(&[]);
        assert!(a.share().same_copy(&sa));
        assert_eq!(a.into_list(), list(&[(1, 1), (2, 2)]));
    }
}
