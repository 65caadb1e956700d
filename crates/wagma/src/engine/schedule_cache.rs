//! The schedules of the groups a rank averaged in most recently.
//!
//! A butterfly or fixed grouping repeats its partitions every few rounds
//! ([`Grouping::period`]), so the same members come back; building their schedule allocates
//! every phase anew, which in the simulator is a measurable share of each round's cost. A
//! global sync is remembered by the job's size, not a list of its P ranks: P such lists in P
//! engines would be P^2 memory in the simulator.

use std::collections::VecDeque;
use std::sync::Arc;

use super::run::Members;
use crate::schedule::Schedule;
use crate::topology::Grouping;

/// The most schedules remembered; a grouping with a longer period is not cached, since a
/// least-recently-used cache smaller than a cycle never hits.
const MAX_CAPACITY: usize = 32;

/// Schedules by the members they sum over and the buffer's length, least recently used first.
#[derive(Default)]
pub(super) struct ScheduleCache {
    capacity: usize,
    entries: VecDeque<(Members, usize, Arc<Schedule>)>,
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

    /// A cache of at most `capacity` schedules (none: every schedule is built).
    fn with_capacity(capacity: usize) -> Self {
        ScheduleCache {
            capacity,
            entries: VecDeque::with_capacity(capacity),
        }
    }

    /// The schedule over `members` for a buffer of `len` elements, built by `build` unless it
    /// was among the last ones used.
    pub fn get_or_build(
        &mut self,
        members: &Members,
        len: usize,
        build: impl FnOnce() -> Schedule,
    ) -> Arc<Schedule> {
        if let Some(i) = self
            .entries
            .iter()
            .position(|(m, l, _)| *l == len && m == members)
            && let Some(entry) = self.entries.remove(i)
        {
            let schedule = Arc::clone(&entry.2);
            self.entries.push_back(entry);
            return schedule;
        }
        let schedule = Arc::new(build());
        if self.capacity == 0 {
            return schedule;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries
            .push_back((members.clone(), len, Arc::clone(&schedule)));
        schedule
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rank;
    use crate::schedule::recursive_doubling;

    #[test]
    fn builds_each_group_once_while_it_recurs_and_forgets_the_least_recent() {
        let mut cache = ScheduleCache::with_capacity(4);
        let built = std::cell::Cell::new(0);
        let mut get = |members: &[Rank], len: usize| {
            cache.get_or_build(&Members::Group(members.to_vec()), len, || {
                built.set(built.get() + 1);
                recursive_doubling(members[0], members, len)
            })
        };
        let a = get(&[0, 1], 8);
        let b = get(&[0, 2], 8);
        assert!(Arc::ptr_eq(&a, &get(&[0, 1], 8)));
        assert!(Arc::ptr_eq(&b, &get(&[0, 2], 8)));
        // Another length is another schedule.
        let c = get(&[0, 1], 16);
        assert_eq!(c.len, 16);
        assert_eq!(*a, recursive_doubling(0, &[0, 1], 8));
        get(&[0, 3], 8);
        get(&[0, 4], 8);
        // [0, 1] x 8 was the least recently used of five; [0, 2] x 8 is still remembered.
        assert!(Arc::ptr_eq(&b, &get(&[0, 2], 8)));
        assert!(!Arc::ptr_eq(&a, &get(&[0, 1], 8)));
        assert_eq!(built.get(), 6);
    }

    #[test]
    fn the_whole_job_is_its_own_key() {
        let mut cache = ScheduleCache::with_capacity(4);
        let all: Vec<Rank> = (0..4).collect();
        let job = cache.get_or_build(&Members::Job(4), 8, || recursive_doubling(0, &all, 8));
        assert!(Arc::ptr_eq(
            &job,
            &cache.get_or_build(&Members::Job(4), 8, || unreachable!())
        ));
        // The same ranks as a group, or another job size, are other keys.
        let group = cache.get_or_build(&Members::Group(all.clone()), 8, || {
            recursive_doubling(0, &all, 8)
        });
        assert!(!Arc::ptr_eq(&job, &group));
        let three = cache.get_or_build(&Members::Job(3), 8, || recursive_doubling(0, &all[..3], 8));
        assert!(!Arc::ptr_eq(&job, &three));
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
