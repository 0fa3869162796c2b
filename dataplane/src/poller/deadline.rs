//! Deadlines on the poller: how often they are swept, which queued slices expire, and what
//! an overdue posted slice calls for. Posted work cannot be recalled, only flushed: the
//! first sweep past its deadline marks it and takes its queue pair out of service; if the
//! fabric has not handed it back within the flush grace after that, the queue pair is torn
//! down without its flush and the work resolved. The poller (`state.rs`) owns the clock;
//! `sweep.rs` carries these decisions out.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How often deadlines of backlogged and in-flight slices are checked.
pub(super) const SWEEP_INTERVAL: Duration = Duration::from_millis(1);

/// When the last sweep ran.
#[derive(Debug)]
pub(super) struct SweepClock {
    last: Instant,
}

impl SweepClock {
    pub(super) fn new(now: Instant) -> Self {
        Self { last: now }
    }

    /// Whether a sweep is due at `now` (at most one per [`SWEEP_INTERVAL`]); if so, it is
    /// counted as run.
    pub(super) fn due(&mut self, now: Instant) -> bool {
        if now.duration_since(self.last) < SWEEP_INTERVAL {
            return false;
        }
        self.last = now;
        true
    }
}

/// Moves the entries of `queue` whose deadline is at or before `now` to `expired`, keeping
/// the others in order.
pub(super) fn take_expired<T>(
    queue: &mut VecDeque<T>,
    now: Instant,
    deadline: impl Fn(&T) -> Instant,
    expired: &mut Vec<T>,
) {
    let mut index = 0;
    while index < queue.len() {
        if now >= deadline(&queue[index]) {
            expired.extend(queue.remove(index));
        } else {
            index += 1;
        }
    }
}

/// What an in-flight slice's deadline calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Overdue {
    /// Not yet due, or due and waiting for its flush within the grace.
    No,
    /// Just past its deadline: mark it and take its queue pair out of service.
    TakeOutOfService,
    /// Marked, and the fabric missed the flush grace: tear its queue pair down, then resolve.
    Unflushed,
}

/// What a posted slice with `deadline` calls for at `now`; `marked` says whether an earlier
/// sweep already took its queue pair out of service.
pub(super) fn overdue(deadline: Instant, marked: bool, now: Instant, grace: Duration) -> Overdue {
    if now < deadline {
        Overdue::No
    } else if !marked {
        Overdue::TakeOutOfService
    } else if now >= deadline + grace {
        Overdue::Unflushed
    } else {
        Overdue::No
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_run_at_most_once_per_interval() {
        let start = Instant::now();
        let mut clock = SweepClock::new(start);
        assert!(!clock.due(start));
        assert!(!clock.due(start + SWEEP_INTERVAL / 2));
        assert!(clock.due(start + SWEEP_INTERVAL));
        assert!(!clock.due(start + SWEEP_INTERVAL + SWEEP_INTERVAL / 2));
        assert!(clock.due(start + SWEEP_INTERVAL * 2));
        assert!(clock.due(start + SWEEP_INTERVAL * 5));
    }

    #[test]
    fn expired_entries_leave_in_order_and_the_rest_stay_in_order() {
        let now = Instant::now();
        let at = |ms: u64| now + Duration::from_millis(ms);
        let mut queue: VecDeque<(u32, Instant)> = [
            (1, at(5)),
            (2, now),
            (3, at(7)),
            (4, now),
            (5, now),
            (6, at(9)),
        ]
        .into();
        let mut expired = Vec::new();
        take_expired(&mut queue, now, |entry| entry.1, &mut expired);
        let ids = |entries: &[(u32, Instant)]| entries.iter().map(|e| e.0).collect::<Vec<_>>();
        assert_eq!(
            ids(&expired),
            [2, 4, 5],
            "a deadline equal to now has passed"
        );
        assert_eq!(ids(queue.make_contiguous()), [1, 3, 6]);
        take_expired(&mut queue, at(7), |entry| entry.1, &mut expired);
        assert_eq!(ids(&expired), [2, 4, 5, 1, 3]);
        assert_eq!(ids(queue.make_contiguous()), [6]);
    }

    #[test]
    fn an_overdue_posted_slice_is_taken_out_of_service_once_then_resolved_after_the_grace() {
        let deadline = Instant::now();
        let grace = Duration::from_millis(10);
        let before = deadline - Duration::from_millis(1);
        assert_eq!(overdue(deadline, false, before, grace), Overdue::No);
        assert_eq!(overdue(deadline, true, before, grace), Overdue::No);
        assert_eq!(
            overdue(deadline, false, deadline, grace),
            Overdue::TakeOutOfService
        );
        let late = deadline + grace * 3;
        assert_eq!(
            overdue(deadline, false, late, grace),
            Overdue::TakeOutOfService
        );
        assert_eq!(overdue(deadline, true, deadline, grace), Overdue::No);
        let within = deadline + grace - Duration::from_millis(1);
        assert_eq!(overdue(deadline, true, within, grace), Overdue::No);
        assert_eq!(
            overdue(deadline, true, deadline + grace, grace),
            Overdue::Unflushed
        );
        assert_eq!(overdue(deadline, true, late, grace), Overdue::Unflushed);
    }
}
