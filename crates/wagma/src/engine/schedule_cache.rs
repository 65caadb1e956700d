//! The schedules of the groups a rank averaged in most recently, shared by position.
//!
//! A round's allreduce is built over positions in its group, not ranks (the running schedule
//! maps a position to its rank), so it depends only on the algorithm, the group's size, the
//! rank's position in it and the buffer's length. Every rank at the same position of a group
//! of the same size runs one program: in a simulation of 4,096 ranks in groups of 64, the
//! group rounds need 64 schedules, not a few per rank (about 17 MB, read by every message,
//! against 64 KB that stay in cache).
//!
//! Two levels keep a schedule alive: each engine remembers the keys of its recent rounds (a
//! butterfly or fixed grouping repeats its partitions every [`Grouping::period`] rounds, and
//! building a schedule allocates every phase anew), and a table per thread shares one copy
//! among the engines of that thread (the simulator runs them all on one).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::Rank;
use crate::schedule::{AlgorithmChoice, AllreduceAlgorithm, Schedule, allreduce};
use crate::topology::Grouping;

/// The most schedules remembered; a grouping with a longer period is not cached, since a
/// least-recently-used cache smaller than a cycle never hits.
const MAX_CAPACITY: usize = 32;

/// Schedules a thread's table holds before it first drops those no engine remembers.
const SHARED_PURGE_MIN: usize = 256;

/// What a round's allreduce depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    algorithm: AllreduceAlgorithm,
    members: usize,
    position: usize,
    len: usize,
}

/// The schedules of a thread's engines, by key.
struct Shared {
    schedules: FxHashMap<Key, Arc<Schedule>>,
    purge_at: usize,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            schedules: FxHashMap::default(),
            purge_at: SHARED_PURGE_MIN,
        }
    }
}

thread_local! {
    static SHARED: RefCell<Shared> = RefCell::new(Shared::default());
}

/// An engine's recent round schedules, least recently used first.
#[derive(Default)]
pub(super) struct ScheduleCache {
    capacity: usize,
    entries: VecDeque<(Key, Arc<Schedule>)>,
}

impl ScheduleCache {
    /// A cache for the rounds of `grouping`: one entry per partition of its period and one for
    /// the global sync; none for groupings that do not repeat.
    pub fn for_grouping(grouping: &Grouping) -> Self {
        match grouping.period() {
            Some(period) if period < MAX_CAPACITY => Self::with_capacity(period + 1),
            _ => Self::default(),
        }
    }

    /// A cache of at most `capacity` schedules (none: each comes from the thread's table).
    fn with_capacity(capacity: usize) -> Self {
        ScheduleCache {
            capacity,
            entries: VecDeque::with_capacity(capacity),
        }
    }

    /// The allreduce `choice` picks for a buffer of `len` elements among `members` ranks, as
    /// run by the one at `position` in ascending rank order; its peers are positions.
    pub fn allreduce(
        &mut self,
        members: usize,
        position: usize,
        len: usize,
        choice: &AlgorithmChoice,
    ) -> Arc<Schedule> {
        let key = Key {
            algorithm: choice.resolve(members, len),
            members,
            position,
            len,
        };
        if let Some(i) = self.entries.iter().position(|(k, _)| *k == key)
            && let Some(entry) = self.entries.remove(i)
        {
            let schedule = Arc::clone(&entry.1);
            self.entries.push_back(entry);
            return schedule;
        }
        let schedule = shared(key);
        if self.capacity == 0 {
            return schedule;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((key, Arc::clone(&schedule)));
        schedule
    }
}

/// The thread's copy of the schedule of `key`, built if there is none.
fn shared(key: Key) -> Arc<Schedule> {
    SHARED.with_borrow_mut(|t| {
        if let Some(found) = t.schedules.get(&key) {
            return Arc::clone(found);
        }
        // Schedules only the table holds are dropped once it has doubled since the last purge,
        // so that it stays proportional to the schedules in use.
        if t.schedules.len() >= t.purge_at {
            t.schedules.retain(|_, s| Arc::strong_count(s) > 1);
            t.purge_at = (2 * t.schedules.len()).max(SHARED_PURGE_MIN);
        }
        let positions: Vec<Rank> = (0..key.members).collect();
        let choice = AlgorithmChoice {
            algorithm: key.algorithm,
            ..AlgorithmChoice::default()
        };
        let built = Arc::new(allreduce(key.position, &positions, key.len, &choice));
        t.schedules.insert(key, Arc::clone(&built));
        built
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{recursive_doubling, reduce_scatter_allgather};

    fn rd() -> AlgorithmChoice {
        AlgorithmChoice {
            algorithm: AllreduceAlgorithm::RecursiveDoubling,
            ..AlgorithmChoice::default()
        }
    }

    #[test]
    fn remembers_a_period_of_rounds_and_forgets_the_least_recent() {
        let mut cache = ScheduleCache::with_capacity(4);
        let a = cache.allreduce(2, 0, 8, &rd());
        let b = cache.allreduce(4, 1, 8, &rd());
        assert!(Arc::ptr_eq(&a, &cache.allreduce(2, 0, 8, &rd())));
        // Another length is another schedule.
        let c = cache.allreduce(2, 0, 16, &rd());
        assert_eq!(c.len, 16);
        assert_eq!(*a, recursive_doubling(0, &[0, 1], 8));
        assert_eq!(*b, recursive_doubling(1, &[0, 1, 2, 3], 8));
        cache.allreduce(8, 3, 8, &rd());
        cache.allreduce(8, 4, 8, &rd());
        // (4, 1, 8) was the least recently used of five; the engine no longer holds it.
        let held = |members, len| {
            cache
                .entries
                .iter()
                .any(|(k, _)| (k.members, k.len) == (members, len))
        };
        assert_eq!(cache.entries.len(), 4);
        assert!(!held(4, 8));
        assert!(held(2, 8) && held(2, 16) && held(8, 8));
    }

    #[test]
    fn engines_of_a_thread_share_a_position_s_schedule() {
        let mut one = ScheduleCache::with_capacity(2);
        let mut other = ScheduleCache::with_capacity(2);
        let choice = AlgorithmChoice::default();
        // 400 KB: reduce-scatter + allgather.
        let len = 100_000;
        let a = one.allreduce(64, 5, len, &choice);
        assert!(Arc::ptr_eq(&a, &other.allreduce(64, 5, len, &choice)));
        // Another position, group size or algorithm is another program.
        assert!(!Arc::ptr_eq(&a, &other.allreduce(64, 6, len, &choice)));
        assert!(!Arc::ptr_eq(&a, &other.allreduce(32, 5, len, &choice)));
        assert!(!Arc::ptr_eq(&a, &other.allreduce(64, 5, len, &rd())));
        let positions: Vec<Rank> = (0..64).collect();
        assert_eq!(*a, reduce_scatter_allgather(5, &positions, len));
        // Without a cache of its own an engine still finds a copy another engine holds.
        assert!(Arc::ptr_eq(
            &a,
            &ScheduleCache::default().allreduce(64, 5, len, &choice)
        ));
    }

    #[test]
    fn the_thread_s_table_drops_only_what_no_engine_holds() {
        let held = ScheduleCache::with_capacity(1).allreduce(3, 0, 5, &rd());
        let mut engine = ScheduleCache::with_capacity(1);
        let kept = engine.allreduce(3, 1, 5, &rd());
        let dropped =
            std::sync::Arc::downgrade(&ScheduleCache::default().allreduce(3, 2, 5, &rd()));
        // Enough other schedules, none held, to purge the table at least once.
        for len in 0..2 * SHARED_PURGE_MIN {
            ScheduleCache::default().allreduce(2, 0, 100 + len, &rd());
        }
        assert!(Arc::ptr_eq(
            &held,
            &ScheduleCache::default().allreduce(3, 0, 5, &rd())
        ));
        assert!(Arc::ptr_eq(&kept, &engine.allreduce(3, 1, 5, &rd())));
        assert_eq!(dropped.strong_count(), 0);
    }

    #[test]
    fn holds_a_grouping_s_period_and_the_sync() {
        use crate::topology::GroupingKind;
        let capacity =
            |p, s, kind| ScheduleCache::for_grouping(&Grouping::new(p, s, kind).unwrap()).capacity;
        // 32 ranks in groups of 8: windows of 3 of 5 bits repeat every 5 rounds.
        assert_eq!(capacity(32, 8, GroupingKind::Butterfly), 6);
        assert_eq!(capacity(16, 4, GroupingKind::Butterfly), 3);
        assert_eq!(capacity(16, 4, GroupingKind::Fixed), 2);
        assert_eq!(capacity(16, 4, GroupingKind::Random { seed: 1 }), 0);
    }
}
