//! [`SoftFabric`]: the soft device as one poller drives it — its queue pairs' send queues, its
//! completion queue and its asynchronous events.
//!
//! `post` only queues work requests (as ringing a doorbell does); `poll` is when the "NIC"
//! runs: it checks each queue pair's peer is alive (and drops mappings of the peer's
//! deregistered buffers), executes queued requests in order
//! ([`super::nic`]), applies the fault plan, and hands out completions whose (fault-plan)
//! delay has passed. A queue pair in ERR completes everything outstanding and everything
//! posted later with WR_FLUSH_ERR, always reported, as verbs does.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use super::config::SoftConfig;
use super::device::SoftDevice;
use super::error::SoftError;
use super::nic::{self, Execution};
use super::qp::SoftQp;
use crate::fabric::delayed::DelayedCompletions;
use crate::fabric::faults::{FaultPlan, FaultView, QpFaultState, Verdict};
use crate::fabric::{
    AsyncEvent, Fabric, FabricError, FabricLimits, PostError, QpNum, QpState, WcStatus,
    WorkCompletion, WorkRequest,
};
use crate::{EndpointId, Epoch};

/// A queue pair the fabric executes, with its send queue.
#[derive(Debug)]
struct ActiveQp {
    qp: SoftQp,
    send_queue: VecDeque<WorkRequest>,
    /// The fault verdict of the head request, once judged (it may wait for its receiver).
    head_verdict: Option<Verdict>,
    /// Since when the head request waits for its receiver.
    waiting_since: Option<Instant>,
    /// Completions not visible yet (fault-plan delays), in order.
    delayed: DelayedCompletions,
    faults: QpFaultState,
    next_liveness_check: Instant,
    /// Retired: gone once its delayed completions are out.
    destroyed: bool,
}

/// The soft device's queues for one poller. See the module docs.
#[derive(Debug)]
pub struct SoftFabric {
    device: SoftDevice,
    /// By number; ordered so that execution order never depends on hashing.
    qps: BTreeMap<u32, ActiveQp>,
    adopted: u32,
    /// The queue pair number `progress` starts at next (rotates).
    next_first: u32,
    /// Scratch: the order of one `progress` call.
    order: Vec<u32>,
    faults: FaultView,
    completions: VecDeque<WorkCompletion>,
    events: VecDeque<AsyncEvent>,
}

impl SoftDevice {
    /// A fabric for this device's poller.
    pub fn fabric(&self) -> SoftFabric {
        SoftFabric::new(self.clone())
    }
}

impl SoftFabric {
    fn new(device: SoftDevice) -> Self {
        let faults = FaultView::new(device.faults());
        Self {
            device,
            qps: BTreeMap::new(),
            adopted: 0,
            next_first: 0,
            order: Vec::new(),
            faults,
            completions: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// Takes over a connected (RTS) queue pair, for `endpoint` when it serves one (fault
    /// rules can name endpoints). Its number stays the same.
    ///
    /// # Errors
    /// [`SoftError::NotReady`] unless the queue pair is in RTS.
    pub fn adopt(&mut self, endpoint: Option<EndpointId>, qp: SoftQp) -> Result<QpNum, SoftError> {
        if qp.state() != QpState::ReadyToSend {
            return Err(SoftError::NotReady {
                qp: qp.num(),
                state: qp.state(),
            });
        }
        let num = qp.num();
        let ordinal = self.adopted;
        self.adopted += 1;
        self.qps.insert(
            num.0,
            ActiveQp {
                qp,
                send_queue: VecDeque::new(),
                head_verdict: None,
                waiting_since: None,
                delayed: DelayedCompletions::default(),
                faults: QpFaultState::new(self.faults.plan.seed, ordinal, endpoint),
                next_liveness_check: Instant::now(),
                destroyed: false,
            },
        );
        Ok(num)
    }

    /// The state of one of its queue pairs.
    pub fn qp_state(&self, qp: QpNum) -> Option<QpState> {
        self.qps
            .get(&qp.0)
            .filter(|active| !active.destroyed)
            .map(|active| active.qp.state())
    }

    /// Executes queued work and releases delayed completions. Each queue pair runs at most
    /// `budget` requests, and the call stops starting new ones after [`BYTES_PER_POLL`];
    /// each call starts at the queue pair after the previous call's first, so a busy queue
    /// pair cannot starve the others.
    fn progress(&mut self, budget: usize) {
        self.faults.refresh();
        let mut round = Round {
            now: Instant::now(),
            config: self.device.config(),
            plan: &self.faults.plan,
            cq: &mut self.completions,
            events: &mut self.events,
            bytes_left: BYTES_PER_POLL,
        };
        self.order.clear();
        self.order
            .extend(self.qps.range(self.next_first..).map(|(num, _)| *num));
        self.order
            .extend(self.qps.range(..self.next_first).map(|(num, _)| *num));
        if let Some(first) = self.order.first() {
            self.next_first = first.wrapping_add(1);
        }
        for num in &self.order {
            if let Some(active) = self.qps.get_mut(num) {
                active.delayed.release(round.now, round.cq);
                active.execute_queued(budget, &mut round);
            }
        }
        self.qps
            .retain(|_, active| !(active.destroyed && active.delayed.is_empty()));
    }
}

/// Bytes one `poll` moves before it returns to the poller (which then serves commands and
/// submissions): about a millisecond of copying.
const BYTES_PER_POLL: u64 = 16 << 20;

/// What one `progress` call shares among the queue pairs it runs.
struct Round<'a> {
    now: Instant,
    config: &'a SoftConfig,
    plan: &'a FaultPlan,
    cq: &'a mut VecDeque<WorkCompletion>,
    events: &'a mut VecDeque<AsyncEvent>,
    bytes_left: u64,
}

fn completion(qp: &SoftQp, request: &WorkRequest, status: WcStatus) -> WorkCompletion {
    WorkCompletion::of(request, qp.num(), status)
}

impl ActiveQp {
    /// Runs up to `budget` queued requests in order: liveness, fault plan, then the NIC.
    fn execute_queued(&mut self, budget: usize, round: &mut Round<'_>) {
        if self.send_queue.is_empty() || round.bytes_left == 0 || self.faults.stalled(round.plan) {
            return;
        }
        let now = round.now;
        if now >= self.next_liveness_check {
            self.next_liveness_check = now + round.config.liveness_interval;
            let exited = self.qp.peer.as_mut().is_some_and(|peer| {
                peer.forget_stale_mappings();
                peer.has_exited()
            });
            if exited {
                return self.fail_head(WcStatus::RetryExcErr, now, round.cq);
            }
        }
        for _ in 0..budget {
            let Some(request) = self.send_queue.front().copied() else {
                return;
            };
            if round.bytes_left == 0 {
                return;
            }
            let faults = &mut self.faults;
            let verdict = *self
                .head_verdict
                .get_or_insert_with(|| faults.judge(round.plan));
            let delay = match verdict {
                Verdict::Execute { delay } => delay,
                Verdict::Fail(status) => return self.fail_head(status, now, round.cq),
                Verdict::Fatal => {
                    self.go_to_error(now, round.cq);
                    round
                        .events
                        .push_back(AsyncEvent::QpFatal { qp: self.qp.num() });
                    return;
                }
            };
            let Some(peer) = self.qp.peer.as_mut() else {
                return self.fail_head(WcStatus::RetryExcErr, now, round.cq);
            };
            match nic::execute(&self.qp.table, peer, &request) {
                Execution::Completed(WcStatus::Success) => {
                    round.bytes_left = round.bytes_left.saturating_sub(u64::from(request.len));
                    self.send_queue.pop_front();
                    self.head_verdict = None;
                    self.waiting_since = None;
                    if request.signaled {
                        let done = completion(&self.qp, &request, WcStatus::Success);
                        self.delayed.emit(done, now + delay, round.cq);
                    }
                }
                Execution::Completed(status) => return self.fail_head(status, now, round.cq),
                Execution::ReceiverNotReady => {
                    let since = *self.waiting_since.get_or_insert(now);
                    if now.duration_since(since) >= round.config.peer_timeout
                        || self.faults.link_killed(round.plan)
                    {
                        self.fail_head(WcStatus::RetryExcErr, now, round.cq);
                    }
                    return;
                }
            }
        }
    }

    /// The head request completes with an error `status`; the queue pair goes to ERR.
    fn fail_head(&mut self, status: WcStatus, now: Instant, cq: &mut VecDeque<WorkCompletion>) {
        if let Some(request) = self.send_queue.pop_front() {
            let failed = completion(&self.qp, &request, status);
            self.delayed.emit(failed, now, cq);
        }
        self.go_to_error(now, cq);
    }

    /// ERR: everything still queued completes with WR_FLUSH_ERR.
    fn go_to_error(&mut self, now: Instant, cq: &mut VecDeque<WorkCompletion>) {
        self.qp.modify_to_error();
        self.head_verdict = None;
        self.waiting_since = None;
        while let Some(request) = self.send_queue.pop_front() {
            let flushed = completion(&self.qp, &request, WcStatus::WrFlushErr);
            self.delayed.emit(flushed, now, cq);
        }
    }
}

impl Fabric for SoftFabric {
    /// Adopts the queue pair the control plane connected and staged for `endpoint` at
    /// `epoch` ([`SoftDevice::stage`]).
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let connect_error = |reason: String| FabricError::Connect {
            endpoint,
            epoch,
            reason,
        };
        let qp = self
            .device
            .take_staged(endpoint, epoch)
            .map_err(|error| connect_error(error.to_string()))?;
        self.adopt(Some(endpoint), qp)
            .map_err(|error| connect_error(error.to_string()))
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        let depth = self.device.config().send_queue_depth;
        let Some(active) = self.qps.get_mut(&qp.0).filter(|a| !a.destroyed) else {
            return Err(PostError {
                posted: 0,
                error: FabricError::UnknownQp { qp },
            });
        };
        if active.qp.state() == QpState::Error {
            let now = Instant::now();
            for request in requests {
                let flushed = completion(&active.qp, request, WcStatus::WrFlushErr);
                active.delayed.emit(flushed, now, &mut self.completions);
            }
            return Ok(());
        }
        let room = depth.saturating_sub(active.send_queue.len());
        active
            .send_queue
            .extend(requests.iter().take(room).copied());
        if requests.len() > room {
            return Err(PostError {
                posted: room,
                error: FabricError::SendQueueFull { qp },
            });
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if self.completions.len() < max {
            self.progress(max.max(1));
        }
        let count = max.min(self.completions.len());
        out.extend(self.completions.drain(..count));
        count
    }

    fn retire(&mut self, qp: QpNum) {
        let now = Instant::now();
        if let Some(active) = self.qps.get_mut(&qp.0) {
            active.go_to_error(now, &mut self.completions);
            active.destroyed = true;
        }
        self.qps
            .retain(|_, active| !(active.destroyed && active.delayed.is_empty()));
    }

    /// This fabric copies only inside `poll`, on the poller's thread: dropping the queue
    /// pair drops its queued requests, so none of them is executed afterwards.
    fn abandon(&mut self, qp: QpNum) -> bool {
        self.qps.remove(&qp.0);
        self.completions.retain(|completion| completion.qp != qp);
        true
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front()
    }

    fn limits(&self) -> FabricLimits {
        FabricLimits {
            send_queue: self.device.config().send_queue_depth,
            // Completions wait in a queue that grows as needed.
            completion_queue: usize::MAX,
        }
    }
}
