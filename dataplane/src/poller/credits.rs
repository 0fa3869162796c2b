//! An endpoint's credits on its current queue pair: how many of its work requests that
//! queue pair holds (at most its send queue's depth), whether the fabric said the send
//! queue is full, and — with the rail's count of requests in flight, flushes to come
//! included — whether one more may be posted. The poller (`state.rs`) owns one per endpoint.

use crate::fabric::FabricLimits;

/// Credits of one endpoint's current queue pair.
#[derive(Debug, Default)]
pub(super) struct Credits {
    /// Work requests in flight on the current queue pair.
    posted: usize,
    /// The fabric refused a post for a full send queue: nothing more is posted until one of
    /// the queue pair's requests completes.
    send_queue_full: bool,
}

impl Credits {
    /// Whether one more work request may be posted: the send queue and the rail's
    /// completion queue (`rail_busy`: requests in flight on the rail) have room, and the
    /// fabric did not say the send queue is full.
    pub(super) fn available(&self, rail_busy: usize, limits: FabricLimits) -> bool {
        !self.send_queue_full
            && self.posted < limits.send_queue
            && rail_busy < limits.completion_queue
    }

    /// A work request was handed to the queue pair.
    pub(super) fn take(&mut self) {
        self.posted += 1;
    }

    /// One of the queue pair's requests completed: its credit is back, and so is room in the
    /// send queue.
    pub(super) fn completed(&mut self) {
        self.posted = self.posted.saturating_sub(1);
        self.send_queue_full = false;
    }

    /// The fabric refused a work request it was handed: its credit is back.
    pub(super) fn refused(&mut self) {
        self.posted = self.posted.saturating_sub(1);
    }

    /// The fabric refused a post for a full send queue. Full with nothing in flight would
    /// never be cleared by a completion: then the next round simply tries again.
    pub(super) fn send_queue_is_full(&mut self) {
        self.send_queue_full = self.posted > 0;
    }

    /// The queue pair went (or a new one came): nothing of the endpoint is on the new one.
    pub(super) fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: FabricLimits = FabricLimits {
        send_queue: 2,
        completion_queue: 3,
    };

    #[test]
    fn the_send_queue_depth_bounds_what_one_queue_pair_holds() {
        let mut credits = Credits::default();
        assert!(credits.available(0, LIMITS));
        credits.take();
        assert!(credits.available(1, LIMITS));
        credits.take();
        assert!(!credits.available(2, LIMITS), "the send queue holds two");
        credits.completed();
        assert!(credits.available(1, LIMITS));
        credits.refused();
        credits.completed();
        assert!(credits.available(0, LIMITS), "never below zero");
        credits.take();
        credits.take();
        assert!(!credits.available(0, LIMITS));
    }

    #[test]
    fn the_rails_completion_queue_bounds_every_endpoint() {
        let credits = Credits::default();
        assert!(credits.available(2, LIMITS));
        assert!(!credits.available(3, LIMITS));
        assert!(!credits.available(4, LIMITS));
    }

    #[test]
    fn a_full_send_queue_waits_for_a_completion_unless_nothing_is_in_flight() {
        let mut credits = Credits::default();
        credits.take();
        credits.take();
        credits.refused();
        credits.send_queue_is_full();
        assert!(!credits.available(1, LIMITS), "full until a completion");
        credits.refused();
        assert!(!credits.available(0, LIMITS), "a refusal does not clear it");
        credits.completed();
        assert!(credits.available(0, LIMITS));

        let mut idle = Credits::default();
        idle.take();
        idle.refused();
        idle.send_queue_is_full();
        assert!(
            idle.available(0, LIMITS),
            "nothing in flight: try again next round"
        );
    }

    #[test]
    fn a_new_queue_pair_starts_with_every_credit() {
        let mut credits = Credits::default();
        credits.take();
        credits.take();
        credits.send_queue_is_full();
        credits.reset();
        assert!(credits.available(0, LIMITS));
        credits.take();
        assert!(credits.available(1, LIMITS), "one of two taken");
    }
}
