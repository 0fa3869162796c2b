//! How a poller enforces deadlines: failing queued slices whose deadline passed, taking the
//! queue pairs of overdue posted work out of service, and tearing down those whose flush
//! missed the grace.

use std::time::Instant;

use super::deadline::{self, Overdue};
use super::messages::Event;
use super::state::Poller;
use crate::batch::FailReason;
use crate::fabric::{Fabric, QpNum, WcStatus, WorkCompletion};
use crate::slice::{FLAG_ADMITTED, FLAG_TIMED_OUT, Slice};

impl<F: Fabric> Poller<F> {
    /// Fails backlogged slices whose deadline passed; takes the queue pairs of overdue posted
    /// slices out of service, so that the flush hands them back (see the poller's module
    /// docs).
    pub(super) fn sweep_deadlines(&mut self) {
        let now = Instant::now();
        if !self.sweep.due(now) {
            return;
        }
        let mut expired = Vec::new();
        for endpoint in self.endpoints.iter_mut().flatten() {
            for queue in [&mut endpoint.backlog, &mut endpoint.waiting] {
                deadline::take_expired(queue, now, Slice::deadline, &mut expired);
            }
            endpoint.fresh_in_backlog = endpoint
                .backlog
                .iter()
                .filter(|slice| slice.flags & FLAG_ADMITTED == 0)
                .count();
        }
        for slice in expired {
            self.fail(slice, FailReason::Timeout);
        }
        // Posted work cannot be recalled, only flushed: mark it and retire its queue pair.
        let mut overdue = std::mem::take(&mut self.overdue);
        let mut unflushed = Vec::new();
        for slot in self.inflight.posted_mut() {
            let Some(slice) = slot.slice.as_mut() else {
                continue;
            };
            let marked = slice.flags & FLAG_TIMED_OUT != 0;
            match deadline::overdue(slice.deadline(), marked, now, self.config.flush_grace) {
                Overdue::No => {}
                Overdue::TakeOutOfService => {
                    slice.flags |= FLAG_TIMED_OUT;
                    overdue.push((slot.endpoint, slot.qp));
                }
                Overdue::Unflushed => {
                    if !unflushed.contains(&slot.qp) {
                        unflushed.push(slot.qp);
                    }
                }
            }
        }
        for (id, qp) in overdue.drain(..) {
            // `None` for a queue pair already out of service: its flush is on its way.
            if let Some(epoch) = self.take_down(id, qp) {
                self.emit(Event::QpFailed {
                    endpoint: id,
                    epoch,
                    status: WcStatus::RetryExcErr,
                });
            }
        }
        self.overdue = overdue;
        for qp in unflushed {
            self.abandon(qp, now);
        }
    }

    /// Tears down `qp`, whose flush missed the grace ([`Fabric::abandon`]), and resolves the
    /// requests still posted on it as flushed: the overdue ones with `Timeout`, the others
    /// by the retry rule; each is counted as `unflushed`. A fabric that cannot promise to
    /// leave their memory alone has only the overdue ones resolved, and their slots wait
    /// for the completions (a local region's deregistration waits for those).
    fn abandon(&mut self, qp: QpNum, now: Instant) {
        if self.fabric.abandon(qp) {
            let flushed: Vec<WorkCompletion> = self
                .inflight
                .posted_on(qp)
                .filter_map(|(wr_id, slice)| {
                    let opcode = slice?.opcode;
                    Some(WorkCompletion::ended(
                        wr_id,
                        opcode,
                        0,
                        qp,
                        WcStatus::WrFlushErr,
                    ))
                })
                .collect();
            for completion in flushed {
                self.shared.counters.unflushed.add(1);
                self.complete(completion);
            }
            return;
        }
        tracing::warn!(
            target: "railyard::poller",
            qp = qp.0,
            "the fabric neither flushed nor can tear down a queue pair past its deadline: \
             its overdue requests are resolved while it may still move their bytes"
        );
        let grace = self.config.flush_grace;
        let overdue: Vec<Slice> = self
            .inflight
            .posted_mut()
            .filter(|slot| slot.qp == qp)
            .filter(|slot| {
                slot.slice.as_ref().is_some_and(|slice| {
                    let marked = slice.flags & FLAG_TIMED_OUT != 0;
                    deadline::overdue(slice.deadline(), marked, now, grace) == Overdue::Unflushed
                })
            })
            .filter_map(|slot| slot.slice.take())
            .collect();
        for slice in overdue {
            self.shared.counters.unflushed.add(1);
            self.fail(slice, FailReason::Timeout);
        }
    }
}
