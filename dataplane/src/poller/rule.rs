//! The poller's rules, as pure functions of what it knows: the epoch rule, where a slice
//! then goes on its endpoint (posted, queued for credits, backlogged within its bound,
//! re-prepared or failed), what a re-prepared slice becomes, and what a failed work request
//! earns (a retry, charged or not, or its failure). The poller's loop (`run.rs`,
//! `posting.rs`) applies them; the loom model of the control/poller hand-off shares the
//! epoch rule.

use crate::Epoch;
use crate::batch::FailReason;
use crate::fabric::{QpNum, WcStatus};

/// What the epoch rule needs to know of an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkState {
    /// A queue pair at the endpoint's epoch carries traffic.
    Up,
    /// No queue pair: waiting for a newer epoch.
    Down,
    /// Its circuit is open: fail fast.
    CircuitOpen,
    /// Retired, for this reason.
    Retired(FailReason),
}

/// What the epoch rule does with a slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Post it on the endpoint's queue pair.
    Post,
    /// Hold it in the endpoint's backlog until a newer epoch arrives.
    Wait,
    /// It is older than the endpoint: re-prepare it (or fail it) first.
    Reprepare,
    /// Fail it.
    Fail(FailReason),
}

/// The epoch rule: never post a slice on a queue pair newer than the epoch it was prepared
/// for; hold one that is ahead of the endpoint.
pub(crate) fn epoch_rule(slice: Epoch, endpoint: Epoch, link: LinkState) -> Route {
    match link {
        LinkState::Retired(reason) => Route::Fail(reason),
        LinkState::CircuitOpen => Route::Fail(FailReason::PeerUnavailable),
        LinkState::Down => Route::Wait,
        LinkState::Up if slice.is_newer_than(endpoint) => Route::Wait,
        LinkState::Up if slice.is_older_than(endpoint) => Route::Reprepare,
        LinkState::Up => Route::Post,
    }
}

/// Where a slice goes on its endpoint once the epoch rule has routed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Post it on this queue pair now.
    Post(QpNum),
    /// Wait, in order, in the endpoint's queue for credits of its queue pair.
    AwaitCredits,
    /// Wait in the endpoint's backlog for a newer epoch; `counted` against its bound.
    Backlog {
        /// It arrived while the endpoint was down (it was not admitted before).
        counted: bool,
    },
    /// Re-prepare it for the endpoint's epoch first.
    Reprepare,
    /// Fail it.
    Fail(FailReason),
}

/// What the backlog's bound needs to know of a slice and its endpoint.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BacklogRoom {
    /// The slice was admitted before (it waited for credits when its queue pair went).
    pub(crate) admitted_before: bool,
    /// Slices in the backlog that arrived while the endpoint was down.
    pub(crate) fresh: usize,
    /// [`crate::PollerConfig::backlog_limit`].
    pub(crate) limit: usize,
}

/// Routing: where a slice the epoch rule gave `route` goes, on an endpoint whose queue pair
/// is `queue_pair` (none while it is down or retired). `its_turn`: nothing of the endpoint
/// waits for credits before it and a credit is free — a slice to post otherwise queues for
/// credits, however long the queue. A slice for a queue pair the endpoint does not have
/// waits in the backlog, within its bound.
pub(crate) fn place(
    route: Route,
    queue_pair: Option<QpNum>,
    its_turn: bool,
    backlog: BacklogRoom,
) -> Placement {
    match (route, queue_pair) {
        (Route::Fail(reason), _) => Placement::Fail(reason),
        (Route::Reprepare, _) => Placement::Reprepare,
        (Route::Post, Some(qp)) if its_turn => Placement::Post(qp),
        (Route::Post, Some(_)) => Placement::AwaitCredits,
        (Route::Wait | Route::Post, _) => {
            match backlog_admission(backlog.admitted_before, backlog.fresh, backlog.limit) {
                Ok(counted) => Placement::Backlog { counted },
                Err(reason) => Placement::Fail(reason),
            }
        }
    }
}

/// What becomes of a stale slice the re-prepare hook answered with `outcome`, the slice now
/// at `repaired`: `Ok` to go through the epoch rule again (a hook that knows of a newer epoch
/// than the poller has applied makes it wait for it), else why it fails — a slice still older
/// than `current` fails `StaleEpoch`.
pub(crate) fn after_reprepare(
    outcome: Result<(), FailReason>,
    repaired: Epoch,
    current: Epoch,
) -> Result<(), FailReason> {
    match outcome {
        Ok(()) if repaired.is_older_than(current) => Err(FailReason::StaleEpoch),
        other => other,
    }
}

/// Whether a slice may join its endpoint's backlog, which holds `fresh` slices that arrived
/// while it was down. New work is refused past `limit`; work the endpoint had admitted
/// before (it waited for credits when its queue pair went) never is, nor is it counted.
/// `Ok(true)`: admitted, and it counts against the limit.
fn backlog_admission(
    admitted_before: bool,
    fresh: usize,
    limit: usize,
) -> Result<bool, FailReason> {
    if admitted_before {
        Ok(false)
    } else if fresh >= limit {
        Err(FailReason::BacklogFull)
    } else {
        Ok(true)
    }
}

/// A slice's failed work request, as the retry rule sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FailedRequest {
    /// How it completed (not `Success`).
    pub(crate) status: WcStatus,
    /// A work-request error of this slice was seen before (it was re-prepared once).
    pub(crate) erred_before: bool,
    /// A WRITE_WITH_IMM: its immediate may have been delivered.
    pub(crate) with_immediate: bool,
    /// Flushed behind another slice's work-request error on the same queue pair.
    pub(crate) innocent: bool,
    /// Retries it was charged so far.
    pub(crate) retries: u8,
    /// Retries it may be charged ([`crate::PollerConfig::retry_budget`]).
    pub(crate) budget: u8,
}

/// What a failed work request earns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Through the epoch rule again, charged to its retry budget.
    Charged,
    /// Through the epoch rule again, free: its failure was not its doing, or it is the first
    /// error of its own request (re-prepared once).
    Free,
    /// It fails.
    No,
}

/// The retry rule (see the poller's module docs): a slice whose own work request was wrong
/// is re-prepared once and fails the second time; a WRITE_WITH_IMM that was flushed or cut
/// off is never retried (an immediate is delivered at most once); one flushed behind
/// another's error is retried free; others within their budget.
pub(crate) fn retry_rule(failed: FailedRequest) -> Retry {
    if failed.status.is_work_request_error() {
        if failed.erred_before {
            Retry::No
        } else {
            Retry::Free
        }
    } else if failed.with_immediate {
        Retry::No
    } else if failed.innocent {
        Retry::Free
    } else if failed.retries < failed.budget {
        Retry::Charged
    } else {
        Retry::No
    }
}

/// Why a slice whose deadline passed while it was posted fails when its completion comes:
/// its own work-request error says more than the deadline; a flush (or a transport error)
/// is the deadline's doing.
pub(crate) fn timed_out_reason(status: WcStatus, reason: FailReason) -> FailReason {
    if status.is_work_request_error() {
        reason
    } else {
        FailReason::Timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINKS: [LinkState; 4] = [
        LinkState::Up,
        LinkState::Down,
        LinkState::CircuitOpen,
        LinkState::Retired(FailReason::Shutdown),
    ];

    #[test]
    fn the_epoch_rule_posts_only_at_the_endpoints_epoch() {
        let (old, current, ahead) = (Epoch::new(4), Epoch::new(5), Epoch::new(6));
        assert_eq!(epoch_rule(current, current, LinkState::Up), Route::Post);
        assert_eq!(epoch_rule(old, current, LinkState::Up), Route::Reprepare);
        assert_eq!(epoch_rule(ahead, current, LinkState::Up), Route::Wait);
        for slice in [old, current, ahead] {
            for link in LINKS {
                let route = epoch_rule(slice, current, link);
                assert!(route != Route::Post || (slice == current && link == LinkState::Up));
            }
        }
    }

    #[test]
    fn a_link_that_is_not_up_decides_whatever_the_epoch() {
        let current = Epoch::new(5);
        for slice in [Epoch::new(4), current, Epoch::new(6)] {
            assert_eq!(epoch_rule(slice, current, LinkState::Down), Route::Wait);
            assert_eq!(
                epoch_rule(slice, current, LinkState::CircuitOpen),
                Route::Fail(FailReason::PeerUnavailable)
            );
            assert_eq!(
                epoch_rule(slice, current, LinkState::Retired(FailReason::Shutdown)),
                Route::Fail(FailReason::Shutdown)
            );
        }
    }

    const QP: QpNum = QpNum(3);

    fn room(admitted_before: bool, fresh: usize) -> BacklogRoom {
        BacklogRoom {
            admitted_before,
            fresh,
            limit: 2,
        }
    }

    #[test]
    fn a_slice_to_post_is_posted_in_its_turn_and_queues_for_credits_otherwise() {
        let fresh = room(false, 0);
        assert_eq!(
            place(Route::Post, Some(QP), true, fresh),
            Placement::Post(QP)
        );
        assert_eq!(
            place(Route::Post, Some(QP), false, fresh),
            Placement::AwaitCredits
        );
        // Without a queue pair (it went since the rule looked): the backlog.
        assert_eq!(
            place(Route::Post, None, true, fresh),
            Placement::Backlog { counted: true }
        );
    }

    #[test]
    fn a_slice_waiting_for_its_epoch_is_backlogged_within_the_bound() {
        for queue_pair in [Some(QP), None] {
            for its_turn in [true, false] {
                let wait = |backlog| place(Route::Wait, queue_pair, its_turn, backlog);
                assert_eq!(wait(room(false, 1)), Placement::Backlog { counted: true });
                assert_eq!(
                    wait(room(false, 2)),
                    Placement::Fail(FailReason::BacklogFull)
                );
                assert_eq!(wait(room(true, 2)), Placement::Backlog { counted: false });
            }
        }
    }

    #[test]
    fn failing_and_stale_slices_go_their_way_whatever_the_room() {
        for queue_pair in [Some(QP), None] {
            for its_turn in [true, false] {
                let full = room(false, 2);
                assert_eq!(
                    place(Route::Reprepare, queue_pair, its_turn, full),
                    Placement::Reprepare
                );
                let failed = Route::Fail(FailReason::PeerUnavailable);
                assert_eq!(
                    place(failed, queue_pair, its_turn, full),
                    Placement::Fail(FailReason::PeerUnavailable)
                );
            }
        }
    }

    #[test]
    fn a_re_prepared_slice_is_routed_again_unless_it_is_still_stale() {
        let current = Epoch::new(5);
        assert_eq!(after_reprepare(Ok(()), current, current), Ok(()));
        assert_eq!(
            after_reprepare(Ok(()), Epoch::new(6), current),
            Ok(()),
            "newer: it will wait for that epoch"
        );
        assert_eq!(
            after_reprepare(Ok(()), Epoch::new(4), current),
            Err(FailReason::StaleEpoch)
        );
        assert_eq!(
            after_reprepare(Err(FailReason::PeerRestarted), current, current),
            Err(FailReason::PeerRestarted)
        );
    }

    #[test]
    fn the_backlog_refuses_new_work_at_its_limit_and_never_admitted_work() {
        assert_eq!(backlog_admission(false, 0, 2), Ok(true));
        assert_eq!(backlog_admission(false, 1, 2), Ok(true));
        assert_eq!(backlog_admission(false, 2, 2), Err(FailReason::BacklogFull));
        assert_eq!(backlog_admission(false, 3, 2), Err(FailReason::BacklogFull));
        assert_eq!(backlog_admission(true, 2, 2), Ok(false));
        assert_eq!(backlog_admission(true, 0, 2), Ok(false));
        assert_eq!(backlog_admission(false, 0, 0), Err(FailReason::BacklogFull));
    }

    fn flushed() -> FailedRequest {
        FailedRequest {
            status: WcStatus::WrFlushErr,
            erred_before: false,
            with_immediate: false,
            innocent: false,
            retries: 0,
            budget: 2,
        }
    }

    #[test]
    fn transport_failures_are_retried_within_the_budget() {
        assert_eq!(retry_rule(flushed()), Retry::Charged);
        let last = FailedRequest {
            retries: 1,
            ..flushed()
        };
        assert_eq!(retry_rule(last), Retry::Charged);
        let spent = FailedRequest {
            retries: 2,
            ..flushed()
        };
        assert_eq!(retry_rule(spent), Retry::No);
        let transport = FailedRequest {
            status: WcStatus::RetryExcErr,
            ..flushed()
        };
        assert_eq!(retry_rule(transport), Retry::Charged);
    }

    #[test]
    fn a_slice_flushed_behind_anothers_error_is_retried_free_even_with_no_budget_left() {
        let innocent = FailedRequest {
            innocent: true,
            retries: 2,
            ..flushed()
        };
        assert_eq!(retry_rule(innocent), Retry::Free);
    }

    #[test]
    fn a_work_request_error_is_forgiven_once() {
        let wrong = FailedRequest {
            status: WcStatus::LocProtErr,
            retries: 2,
            ..flushed()
        };
        assert_eq!(retry_rule(wrong), Retry::Free);
        let again = FailedRequest {
            erred_before: true,
            retries: 0,
            innocent: true,
            ..wrong
        };
        assert_eq!(retry_rule(again), Retry::No);
    }

    #[test]
    fn a_write_with_immediate_is_never_retried_after_a_flush() {
        let imm = FailedRequest {
            with_immediate: true,
            innocent: true,
            ..flushed()
        };
        assert_eq!(retry_rule(imm), Retry::No);
        // Its own request being wrong means nothing was delivered: re-prepared once.
        let wrong = FailedRequest {
            status: WcStatus::RemAccessErr,
            ..imm
        };
        assert_eq!(retry_rule(wrong), Retry::Free);
    }

    #[test]
    fn a_timed_out_slice_keeps_its_own_errors_reason() {
        assert_eq!(
            timed_out_reason(WcStatus::WrFlushErr, FailReason::Flushed),
            FailReason::Timeout
        );
        assert_eq!(
            timed_out_reason(WcStatus::RemAccessErr, FailReason::RemoteAccess),
            FailReason::RemoteAccess
        );
    }
}
