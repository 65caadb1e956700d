//! A few values keyed by round, in round order: a stream's activated rounds and its finished
//! rounds' results.

use std::collections::VecDeque;

/// Values by round, kept sorted in a deque. A stream holds a handful at a time and adds them
/// in round order (rounds run in order), so an insert is a push at the back and a removal
/// is usually at the front; unlike a `BTreeMap`, the deque keeps its memory when it empties,
/// as it does at nearly every round.
pub(super) struct RoundMap<T> {
    entries: VecDeque<(u64, T)>,
}

impl<T> Default for RoundMap<T> {
    fn default() -> Self {
        RoundMap {
            entries: VecDeque::new(),
        }
    }
}

impl<T> RoundMap<T> {
    /// Where `round` is, or where it would go.
    fn find(&self, round: u64) -> Result<usize, usize> {
        // Most lookups are for the newest round.
        match self.entries.back() {
            Some(&(last, _)) if last < round => Err(self.entries.len()),
            _ => self.entries.binary_search_by_key(&round, |e| e.0),
        }
    }

    /// Sets the value of `round`, replacing any it had.
    pub fn insert(&mut self, round: u64, value: T) {
        match self.find(round) {
            Ok(i) => self.entries[i].1 = value,
            Err(i) => self.entries.insert(i, (round, value)),
        }
    }

    /// Whether `round` has a value.
    pub fn contains(&self, round: u64) -> bool {
        self.find(round).is_ok()
    }

    /// The value of `round`.
    pub fn get(&self, round: u64) -> Option<&T> {
        self.find(round).ok().map(|i| &self.entries[i].1)
    }

    /// Takes the value of `round` out.
    pub fn remove(&mut self, round: u64) -> Option<T> {
        let i = self.find(round).ok()?;
        self.entries.remove(i).map(|(_, v)| v)
    }

    /// The latest round at or after `from`.
    pub fn latest_from(&self, from: u64) -> Option<u64> {
        self.entries.back().map(|e| e.0).filter(|&r| r >= from)
    }

    /// Takes out every value of a round before `round`, in round order.
    pub fn drain_before(&mut self, round: u64) -> impl Iterator<Item = T> + '_ {
        let n = self.entries.partition_point(|e| e.0 < round);
        self.entries.drain(..n).map(|(_, v)| v)
    }

    /// The rounds, in order.
    pub fn rounds(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.iter().map(|e| e.0)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        DrainBefore(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u64..40, any::<u32>()).prop_map(|(r, v)| Op::Insert(r, v)),
            1 => (0u64..40).prop_map(Op::Remove),
            1 => (0u64..40).prop_map(Op::DrainBefore),
        ]
    }

    proptest! {
        /// Whatever the order of the rounds, the map answers as a `BTreeMap` does.
        #[test]
        fn answers_as_a_tree_map(ops in prop::collection::vec(op(), 0..200), probe in 0u64..40) {
            let mut map = RoundMap::default();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(r, v) => {
                        map.insert(r, v);
                        model.insert(r, v);
                    }
                    Op::Remove(r) => prop_assert_eq!(map.remove(r), model.remove(&r)),
                    Op::DrainBefore(r) => {
                        let kept = model.split_off(&r);
                        let gone: Vec<u32> = std::mem::replace(&mut model, kept).into_values().collect();
                        prop_assert_eq!(map.drain_before(r).collect::<Vec<_>>(), gone);
                    }
                }
                prop_assert_eq!(map.rounds().collect::<Vec<_>>(), model.keys().copied().collect::<Vec<_>>());
            }
            prop_assert_eq!(map.contains(probe), model.contains_key(&probe));
            prop_assert_eq!(map.get(probe), model.get(&probe));
            prop_assert_eq!(map.latest_from(probe), model.range(probe..).next_back().map(|(&r, _)| r));
        }
    }
}
