//! How a poller handles completions and the fabric's events: resolving or retrying each
//! slice by the retry rule, returning credits, confirming a queue pair, and taking down a
//! queue pair that went to ERR.

use super::messages::Event;
use super::rule::{self, FailedRequest, Retry};
use super::state::{Link, Poller, endpoint_mut};
use crate::EndpointId;
use crate::batch::FailReason;
use crate::fabric::{AsyncEvent, Fabric, Opcode, QpNum, WcStatus, WorkCompletion};
use crate::slice::{FLAG_TIMED_OUT, FLAG_WR_ERROR_SEEN};

impl<F: Fabric> Poller<F> {
    /// One of `endpoint`'s work requests is no longer in flight.
    pub(super) fn note_landed(&mut self, id: EndpointId) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        endpoint.in_flight = endpoint.in_flight.saturating_sub(1);
        if endpoint.in_flight == 0 && endpoint.link == Link::Retired {
            self.emit(Event::EndpointDrained { endpoint: id });
        }
    }

    pub(super) fn poll_completions(&mut self) -> bool {
        if self.inflight.busy() == 0 {
            return false;
        }
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        let count = self.fabric.poll(&mut completions, self.config.max_batch);
        // Events first: a fatal queue pair is reported as such, not as its flushes.
        self.poll_fabric_events();
        for completion in completions.drain(..) {
            self.complete(completion);
        }
        self.completions = completions;
        count > 0
    }

    pub(super) fn complete(&mut self, completion: WorkCompletion) {
        let Some((id, posted_on, slice)) = self.inflight.take(completion.wr_id) else {
            self.shared.counters.ignored_completions.add(1);
            return;
        };
        self.note_landed(id);
        if let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) {
            if endpoint.link == Link::Up(posted_on) {
                endpoint.credits.completed();
            }
        }
        let status = completion.status;
        if status != WcStatus::Success {
            // A flush on a queue pair the poller did not retire means the fabric moved it
            // to ERR on its own; `queue_pair_failed` ignores replaced queue pairs.
            self.queue_pair_failed(id, completion.qp, status);
        }
        if status == WcStatus::Success {
            self.confirm(id, completion.qp);
        }
        // `None`: resolved without it when the fabric missed its flush grace.
        let Some(mut slice) = slice else { return };
        let Some(reason) = FailReason::from_status(status) else {
            self.shared.counters.completed.add(1);
            self.shared.counters.load_bytes.sub(u64::from(slice.len));
            return slice.resolve(Ok(()));
        };
        if slice.flags & FLAG_TIMED_OUT != 0 {
            return self.fail(slice, rule::timed_out_reason(status, reason));
        }
        if self.stopping {
            return self.fail(slice, FailReason::Shutdown);
        }
        let innocent = match self.endpoint(id) {
            None => return self.fail(slice, FailReason::EndpointRetired),
            Some(e) if e.link == Link::Retired => {
                let reason = e.retired_reason;
                return self.fail(slice, reason);
            }
            Some(e) if e.circuit_open => return self.fail(slice, FailReason::PeerUnavailable),
            // Its queue pair was freed under it: only a sabotaged park frees a busy one.
            Some(e) if matches!(e.link, Link::Parked { .. }) => {
                return self.fail(slice, FailReason::EndpointRetired);
            }
            // Flushed behind another slice's work-request error: not this slice's doing.
            Some(e) => {
                status == WcStatus::WrFlushErr && e.failed_by_work_request == Some(completion.qp)
            }
        };
        let retry = rule::retry_rule(FailedRequest {
            status,
            erred_before: slice.flags & FLAG_WR_ERROR_SEEN != 0,
            with_immediate: slice.opcode == Opcode::WriteWithImm,
            innocent,
            retries: slice.retries,
            budget: self.config.retry_budget,
        });
        if status.is_work_request_error() {
            slice.flags |= FLAG_WR_ERROR_SEEN;
        }
        match retry {
            Retry::Charged => {
                slice.retries += 1;
                self.ready.push_back(slice);
            }
            Retry::Free => self.ready.push_back(slice),
            Retry::No => self.fail(slice, reason),
        }
    }

    /// Reports the first success on endpoint `id`'s current queue pair.
    fn confirm(&mut self, id: EndpointId, qp: QpNum) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        if endpoint.confirmed || endpoint.link != Link::Up(qp) {
            return;
        }
        endpoint.confirmed = true;
        let epoch = endpoint.epoch;
        self.emit(Event::Confirmed {
            endpoint: id,
            epoch,
        });
    }

    /// An error completion moved `qp` to ERR: flush it and mark the endpoint down.
    fn queue_pair_failed(&mut self, id: EndpointId, qp: QpNum, status: WcStatus) {
        if status.is_work_request_error() {
            if let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) {
                if endpoint.link == Link::Up(qp) {
                    endpoint.failed_by_work_request = Some(qp);
                }
            }
        }
        if let Some(epoch) = self.take_down(id, qp) {
            self.emit(Event::QpFailed {
                endpoint: id,
                epoch,
                status,
            });
        }
    }

    /// Applies the fabric's asynchronous events. Returns whether there were any.
    pub(super) fn poll_fabric_events(&mut self) -> bool {
        let mut busy = false;
        while let Some(event) = self.fabric.poll_event() {
            busy = true;
            match event {
                AsyncEvent::QpFatal { qp } => {
                    let owner = self.endpoints.iter().position(|endpoint| {
                        endpoint.as_ref().is_some_and(|e| e.link == Link::Up(qp))
                    });
                    let Some(id) = owner.map(|index| EndpointId(index as u32)) else {
                        continue; // already retired or replaced
                    };
                    if let Some(epoch) = self.take_down(id, qp) {
                        self.emit(Event::QpFatal {
                            endpoint: id,
                            epoch,
                        });
                    }
                }
                // Its queue pairs come as QpFatal; new ones are refused while it is down
                // (the endpoints back off, and the engine sends their work elsewhere).
                AsyncEvent::RailDown { reason: _ } => self.shared.counters.rail_downs.add(1),
                AsyncEvent::RailUp => self.shared.counters.rail_ups.add(1),
            }
        }
        busy
    }
}
