//! A fabric for tests: records every posted work request with the epoch of the queue pair it
//! was posted on, and completes chosen requests with chosen statuses, with verbs' queue-pair
//! rules (an error completion moves the queue pair to ERR and flushes what is outstanding;
//! requests posted on a queue pair in ERR complete as flushed). It can also behave like a
//! loaded NIC: queues of a given depth (a post past the send queue is cut short with
//! `SendQueueFull`, one past the completion queue is counted as an overrun), completions
//! that trickle out a few per poll, and posts cut short at random.
//!
//! The fabric lives on the poller thread; the test keeps a [`ScriptHandle`] to steer it and
//! read what happened. The mutex between them is test-only machinery.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{
    AsyncEvent, Fabric, FabricError, FabricLimits, PostError, QpNum, WcStatus, WorkCompletion,
    WorkRequest,
};
use crate::rng::SplitMix64;
use crate::{EndpointId, Epoch};

/// One posted work request, as the test sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Posted {
    /// Position in the order of all posts, from 0.
    pub index: usize,
    /// The queue pair it was posted on.
    pub qp: QpNum,
    /// The endpoint of that queue pair.
    pub endpoint: EndpointId,
    /// The epoch that queue pair was connected for.
    pub qp_epoch: Epoch,
    /// The request itself.
    pub request: WorkRequest,
}

#[derive(Debug)]
struct Qp {
    endpoint: EndpointId,
    epoch: Epoch,
    in_error: bool,
    /// Posted, not yet completed (held).
    outstanding: Vec<WorkRequest>,
}

#[derive(Debug, Default)]
struct Script {
    next_qp: u32,
    qps: HashMap<u32, Qp>,
    posted: Vec<Posted>,
    /// Statuses for chosen post indices; others succeed.
    statuses: BTreeMap<usize, WcStatus>,
    /// While set, successful requests stay outstanding until released.
    hold: bool,
    ready: VecDeque<WorkCompletion>,
    refuse_connect: bool,
    /// The queues' depths (unlimited unless set).
    limits: Option<FabricLimits>,
    /// While non-zero, successful requests stay outstanding and each poll completes up to
    /// this many of them, one queue pair after another.
    drip: usize,
    /// While set, each post call accepts a random prefix of its list and refuses the rest
    /// with `SendQueueFull`.
    cut_posts: Option<SplitMix64>,
    /// (queue pair, requests) of every post call, in order.
    post_calls: Vec<(QpNum, usize)>,
    /// Posts that would have overrun the completion queue.
    cq_overruns: usize,
    /// The most requests a queue pair held outstanding at once.
    deepest: usize,
    /// Asynchronous events for the poller to take, in order.
    events: VecDeque<AsyncEvent>,
    /// While set, a retired queue pair keeps its outstanding requests instead of flushing
    /// them (a fabric that breaks its promise to flush).
    never_flush: bool,
    /// Queue pairs the poller abandoned, in order.
    abandoned: Vec<QpNum>,
}

impl Script {
    fn complete(&mut self, qp: QpNum, request: &WorkRequest, status: WcStatus) {
        if status == WcStatus::Success && !request.signaled {
            return;
        }
        self.ready
            .push_back(WorkCompletion::of(request, qp, status));
    }

    /// Moves `qp` to ERR and flushes its outstanding requests.
    fn fail_qp(&mut self, qp: QpNum) {
        let Some(state) = self.qps.get_mut(&qp.0) else {
            return;
        };
        state.in_error = true;
        let outstanding = std::mem::take(&mut state.outstanding);
        for request in &outstanding {
            self.complete(qp, request, WcStatus::WrFlushErr);
        }
    }
}

/// The test's side of a [`ScriptedFabric`].
#[derive(Clone, Debug, Default)]
pub struct ScriptHandle(Arc<Mutex<Script>>);

impl ScriptHandle {
    fn lock(&self) -> MutexGuard<'_, Script> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The post with this index (0 = first ever) completes with `status`.
    pub fn fail_nth(&self, index: usize, status: WcStatus) {
        self.lock().statuses.insert(index, status);
    }

    /// While `hold` is set, successful requests stay outstanding (in flight) until
    /// [`Self::release`].
    pub fn hold(&self, hold: bool) {
        self.lock().hold = hold;
    }

    /// Fails each queue pair that holds requests: its oldest completes with `status`, the
    /// rest are flushed (verbs' rules), as when a link dies under load.
    pub fn fail_outstanding(&self, status: WcStatus) {
        let mut script = self.lock();
        let busy: Vec<u32> = script
            .qps
            .iter()
            .filter(|(_, q)| !q.outstanding.is_empty())
            .map(|(number, _)| *number)
            .collect();
        for number in busy {
            let first = script.qps.get_mut(&number).map(|q| q.outstanding.remove(0));
            if let Some(request) = first {
                script.complete(QpNum(number), &request, status);
            }
            script.fail_qp(QpNum(number));
        }
    }

    /// While `never` is set, retiring a queue pair flushes nothing: its requests stay
    /// outstanding until the poller abandons it.
    pub fn never_flush(&self, never: bool) {
        self.lock().never_flush = never;
    }

    /// The queue pairs the poller abandoned (torn down without their flushes), in order.
    pub fn abandoned(&self) -> Vec<QpNum> {
        self.lock().abandoned.clone()
    }

    /// Completes every held request successfully.
    pub fn release(&self) {
        let mut script = self.lock();
        let qps: Vec<u32> = script.qps.keys().copied().collect();
        for qp in qps {
            let outstanding = script
                .qps
                .get_mut(&qp)
                .map(|q| std::mem::take(&mut q.outstanding));
            for request in outstanding.unwrap_or_default() {
                script.complete(QpNum(qp), &request, WcStatus::Success);
            }
        }
    }

    /// Every request posted so far.
    pub fn posted(&self) -> Vec<Posted> {
        self.lock().posted.clone()
    }

    /// Requests posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.lock().qps.values().map(|q| q.outstanding.len()).sum()
    }

    /// Queue pairs connected so far, as (endpoint, epoch), in order.
    pub fn connections(&self) -> Vec<(EndpointId, Epoch)> {
        let script = self.lock();
        let mut qps: Vec<(&u32, &Qp)> = script.qps.iter().collect();
        qps.sort_by_key(|(number, _)| **number);
        qps.into_iter()
            .map(|(_, qp)| (qp.endpoint, qp.epoch))
            .collect()
    }

    /// Makes further connects fail.
    pub fn refuse_connect(&self, refuse: bool) {
        self.lock().refuse_connect = refuse;
    }

    /// Gives the fabric queues of these depths (set before the poller starts: it reads
    /// them once).
    pub fn set_limits(&self, limits: FabricLimits) {
        self.lock().limits = Some(limits);
    }

    /// Completes at most `per_poll` successful requests per poll (0: all at once).
    pub fn drip(&self, per_poll: usize) {
        self.lock().drip = per_poll;
    }

    /// Cuts every post call short at a random point chosen from `seed` (`None`: never).
    pub fn cut_posts(&self, seed: Option<u64>) {
        self.lock().cut_posts = seed.map(SplitMix64::new);
    }

    /// Raises `event` for the poller (as a NIC's asynchronous event).
    pub fn raise(&self, event: AsyncEvent) {
        self.lock().events.push_back(event);
    }

    /// (queue pair, requests) of every post call so far.
    pub fn post_calls(&self) -> Vec<(QpNum, usize)> {
        self.lock().post_calls.clone()
    }

    /// Posts that found the completion queue full (a real one would have overrun).
    pub fn cq_overruns(&self) -> usize {
        self.lock().cq_overruns
    }

    /// The most requests any queue pair held outstanding at once.
    pub fn deepest_send_queue(&self) -> usize {
        self.lock().deepest
    }
}

/// The poller's side: a [`Fabric`] driven by a [`ScriptHandle`].
#[derive(Debug)]
pub struct ScriptedFabric {
    script: ScriptHandle,
}

impl ScriptedFabric {
    /// A fabric and the handle that steers it.
    pub fn new() -> (Self, ScriptHandle) {
        let script = ScriptHandle::default();
        (
            Self {
                script: script.clone(),
            },
            script,
        )
    }
}

impl Fabric for ScriptedFabric {
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let mut script = self.script.lock();
        if script.refuse_connect {
            return Err(FabricError::Connect {
                endpoint,
                epoch,
                reason: "refused by the script".into(),
            });
        }
        script.next_qp += 1;
        let number = script.next_qp;
        script.qps.insert(
            number,
            Qp {
                endpoint,
                epoch,
                in_error: false,
                outstanding: Vec::new(),
            },
        );
        Ok(QpNum(number))
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        let mut script = self.script.lock();
        let Some(state) = script.qps.get(&qp.0) else {
            return Err(PostError {
                posted: 0,
                error: FabricError::UnknownQp { qp },
            });
        };
        let (endpoint, qp_epoch) = (state.endpoint, state.epoch);
        let held = state.outstanding.len();
        script.post_calls.push((qp, requests.len()));
        let limits = script.limits.unwrap_or(FabricLimits::UNLIMITED);
        let mut accepted = requests.len().min(limits.send_queue.saturating_sub(held));
        if let Some(rng) = script.cut_posts.as_mut() {
            accepted = accepted.min(rng.below(requests.len() as u64 + 1) as usize);
        }
        let unpolled: usize = script.ready.len()
            + script
                .qps
                .values()
                .map(|q| q.outstanding.len())
                .sum::<usize>();
        if unpolled + accepted > limits.completion_queue {
            script.cq_overruns += 1;
        }
        let total = requests.len();
        for request in &requests[..accepted] {
            let index = script.posted.len();
            script.posted.push(Posted {
                index,
                qp,
                endpoint,
                qp_epoch,
                request: *request,
            });
            let in_error = script.qps.get(&qp.0).is_some_and(|q| q.in_error);
            if in_error {
                script.complete(qp, request, WcStatus::WrFlushErr);
                continue;
            }
            match script.statuses.remove(&index) {
                Some(status) if status != WcStatus::Success => {
                    script.complete(qp, request, status);
                    script.fail_qp(qp);
                }
                _ if script.hold || script.drip > 0 => {
                    if let Some(state) = script.qps.get_mut(&qp.0) {
                        state.outstanding.push(*request);
                        let depth = state.outstanding.len();
                        script.deepest = script.deepest.max(depth);
                    }
                }
                _ => script.complete(qp, request, WcStatus::Success),
            }
        }
        if accepted < total {
            return Err(PostError {
                posted: accepted,
                error: FabricError::SendQueueFull { qp },
            });
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut script = self.script.lock();
        // One request of each queue pair in turn, oldest first, until `drip` are done.
        let mut dripping = script.drip;
        let mut numbers: Vec<u32> = script.qps.keys().copied().collect();
        numbers.sort_unstable();
        while dripping > 0 {
            let mut any = false;
            for &number in &numbers {
                if dripping == 0 {
                    break;
                }
                let Some(request) = script
                    .qps
                    .get_mut(&number)
                    .filter(|q| !q.outstanding.is_empty())
                    .map(|q| q.outstanding.remove(0))
                else {
                    continue;
                };
                script.complete(QpNum(number), &request, WcStatus::Success);
                dripping -= 1;
                any = true;
            }
            if !any {
                break;
            }
        }
        let count = max.min(script.ready.len());
        out.extend(script.ready.drain(..count));
        count
    }

    fn limits(&self) -> FabricLimits {
        self.script.lock().limits.unwrap_or(FabricLimits::UNLIMITED)
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.script.lock().events.pop_front()
    }

    fn retire(&mut self, qp: QpNum) {
        let mut script = self.script.lock();
        if script.never_flush {
            if let Some(state) = script.qps.get_mut(&qp.0) {
                state.in_error = true;
            }
            return;
        }
        script.fail_qp(qp);
    }

    fn abandon(&mut self, qp: QpNum) -> bool {
        let mut script = self.script.lock();
        script.qps.remove(&qp.0);
        script.ready.retain(|completion| completion.qp != qp);
        script.abandoned.push(qp);
        true
    }
}
