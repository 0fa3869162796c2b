//! How a poller posts: what waited for credits first, then every ready slice through the
//! epoch rule to its place (posted, waiting for credits, backlogged, re-prepared or failed),
//! one post call per queue pair, and what a full send queue refuses back to its queue.

use std::collections::VecDeque;
use std::time::Instant;

use super::reprepare::RepairCause;
use super::rule::{self, BacklogRoom, LinkState, Placement, Route, epoch_rule};
use super::state::{Link, Poller, endpoint_mut};
use crate::EndpointId;
use crate::batch::FailReason;
use crate::fabric::{Fabric, FabricError, QpNum, WorkRequest, WrId};
use crate::sabotage::Protection;
use crate::slice::{FLAG_ADMITTED, FLAG_WR_ERROR_SEEN, Slice};

impl<F: Fabric> Poller<F> {
    /// Posts what waited for credits and has them now, then applies the epoch rule to every
    /// ready slice and posts those that pass: one post call per queue pair.
    pub(super) fn route_ready(&mut self) -> bool {
        if self.ready.is_empty() && self.starved.is_empty() {
            return false;
        }
        let now = Instant::now();
        let mut busy = self.release_credits(now);
        while let Some(slice) = self.ready.pop_front() {
            busy = true;
            self.route(slice, now);
        }
        self.flush_posts();
        busy
    }

    /// Posts the waiting slices of starved endpoints while their queue pairs and the rail
    /// have credits: in order per endpoint, one slice per endpoint in turn, so that the
    /// rail's credits are shared and no endpoint waits behind another's long queue. True
    /// when any was posted or failed.
    fn release_credits(&mut self, now: Instant) -> bool {
        let mut moved = false;
        let mut turn: VecDeque<EndpointId> = std::mem::take(&mut self.starved).into();
        while let Some(id) = turn.pop_front() {
            let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
                continue;
            };
            let Link::Up(qp) = endpoint.link else {
                // Its queue pair went: its slices went back through the epoch rule then.
                endpoint.listed = false;
                continue;
            };
            if endpoint.waiting.is_empty() {
                endpoint.listed = false;
                continue;
            }
            if !endpoint
                .credits
                .available(self.inflight.busy(), self.limits)
            {
                // Still listed: it waits for its completions (or the rail's).
                self.starved.push(id);
                continue;
            }
            let Some(slice) = endpoint.waiting.pop_front() else {
                continue;
            };
            moved = true;
            if now >= slice.deadline() {
                self.fail(slice, FailReason::Timeout);
            } else {
                self.post(qp, slice);
            }
            turn.push_back(id);
        }
        moved
    }

    fn route(&mut self, mut slice: Slice, now: Instant) {
        if now >= slice.deadline() {
            return self.fail(slice, FailReason::Timeout);
        }
        let id = slice.endpoint;
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return self.fail(slice, FailReason::UnknownEndpoint);
        };
        let state = match endpoint.link {
            Link::Retired => LinkState::Retired(endpoint.retired_reason),
            _ if endpoint.circuit_open => LinkState::CircuitOpen,
            Link::Up(_) => LinkState::Up,
            Link::Down | Link::Parked { .. } => LinkState::Down,
        };
        let up = match endpoint.link {
            Link::Up(qp) => Some(qp),
            Link::Down | Link::Parked { .. } | Link::Retired => None,
        };
        let mut route = epoch_rule(slice.epoch, endpoint.epoch, state);
        if route == Route::Reprepare && crate::sabotage::is_off(Protection::EpochCheck) {
            route = Route::Post;
        }
        let its_turn = endpoint.waiting.is_empty()
            && endpoint
                .credits
                .available(self.inflight.busy(), self.limits);
        let backlog = BacklogRoom {
            admitted_before: slice.flags & FLAG_ADMITTED != 0,
            fresh: endpoint.fresh_in_backlog,
            limit: self.config.backlog_limit,
        };
        match rule::place(route, up, its_turn, backlog) {
            Placement::Post(qp) => self.post(qp, slice),
            Placement::AwaitCredits => {
                self.shared.counters.credit_waits.add(1);
                slice.flags |= FLAG_ADMITTED;
                endpoint.waiting.push_back(slice);
                if !endpoint.listed {
                    endpoint.listed = true;
                    self.starved.push(id);
                }
            }
            Placement::Backlog { counted } => {
                endpoint.fresh_in_backlog += usize::from(counted);
                endpoint.backlog.push_back(slice);
                if endpoint.link == (Link::Parked { wanted: false }) {
                    endpoint.link = Link::Parked { wanted: true };
                    self.emit(crate::Event::Wanted { endpoint: id });
                }
            }
            Placement::Fail(reason) => self.fail(slice, reason),
            Placement::Reprepare => {
                let current = endpoint.epoch;
                let cause = if slice.flags & FLAG_WR_ERROR_SEEN != 0 {
                    RepairCause::AfterWorkRequestError
                } else {
                    RepairCause::StaleEpoch
                };
                let outcome = self.reprepare.reprepare(&mut slice, current, cause);
                match rule::after_reprepare(outcome, slice.epoch, current) {
                    Ok(()) => {
                        self.shared.counters.reprepared.add(1);
                        self.route(slice, now);
                    }
                    Err(reason) => {
                        self.shared.counters.stale_dropped.add(1);
                        self.fail(slice, reason);
                    }
                }
            }
        }
    }

    /// Adds `slice` to this round's list for `qp` (the caller checked its credits).
    fn post(&mut self, qp: QpNum, slice: Slice) {
        let request = WorkRequest {
            wr_id: WrId::new(0, 0),
            opcode: slice.opcode,
            local_addr: slice.local_addr,
            lkey: slice.lkey,
            remote_addr: slice.remote_addr,
            rkey: slice.rkey,
            len: slice.len,
            imm: slice.imm,
            signaled: true,
            epoch: slice.epoch,
        };
        let id = slice.endpoint;
        if let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) {
            endpoint.in_flight += 1;
            endpoint.credits.take();
        }
        let wr_id = self.inflight.insert(slice, id, qp, request.lkey);
        let request = WorkRequest { wr_id, ..request };
        match self.posts.iter_mut().find(|(listed, _)| *listed == qp) {
            Some((_, list)) => list.push(request),
            None => {
                let mut list = self.spare_lists.pop().unwrap_or_default();
                list.push(request);
                self.posts.push((qp, list));
            }
        }
    }

    /// Posts this round's list of each queue pair: one doorbell each.
    fn flush_posts(&mut self) {
        let mut posts = std::mem::take(&mut self.posts);
        for (qp, mut list) in posts.drain(..) {
            self.post_list(qp, &list);
            list.clear();
            self.spare_lists.push(list);
        }
        self.posts = posts;
    }

    /// Posts `list` on `qp`. What a full send queue refuses waits, in order, at the front of
    /// its endpoint's queue for credits; what any other error refuses fails `PostFailed`.
    fn post_list(&mut self, qp: QpNum, list: &[WorkRequest]) {
        if list.is_empty() {
            return;
        }
        self.shared.counters.doorbells.add(1);
        let (accepted, full) = match self.fabric.post(qp, list) {
            Ok(()) => (list.len(), false),
            Err(error) => (
                error.posted.min(list.len()),
                matches!(error.error, FabricError::SendQueueFull { .. }),
            ),
        };
        self.shared.counters.posted.add(accepted as u64);
        if accepted == list.len() {
            return;
        }
        if full {
            self.shared.counters.send_queue_full.add(1);
        }
        // Back to front, so that pushing each to the front of the queue keeps their order.
        for request in list[accepted..].iter().rev() {
            let Some((id, _, slice)) = self.inflight.take(request.wr_id) else {
                continue;
            };
            self.note_landed(id);
            let endpoint = endpoint_mut(&mut self.endpoints, id);
            if let Some(endpoint) = endpoint {
                if endpoint.link == Link::Up(qp) {
                    endpoint.credits.refused();
                }
            }
            let Some(slice) = slice else { continue };
            if !full {
                self.fail(slice, FailReason::PostFailed);
                continue;
            }
            match endpoint_mut(&mut self.endpoints, id) {
                Some(endpoint) if endpoint.link == Link::Up(qp) => {
                    endpoint.credits.send_queue_is_full();
                    let mut slice = slice;
                    slice.flags |= FLAG_ADMITTED;
                    endpoint.waiting.push_front(slice);
                    if !endpoint.listed {
                        endpoint.listed = true;
                        self.starved.push(id);
                    }
                }
                // Its queue pair went meanwhile: through the epoch rule again.
                _ => self.ready.push_front(slice),
            }
        }
    }
}
