//! [`VerbsFabric`]: a verbs rail as its poller drives it.
//!
//! Posting builds one linked list of send requests per call (one doorbell), signals every
//! k-th request and the last, carries small writes inline, and records every request in
//! its queue pair's [`Outstanding`] list. Polling takes completions in batches, maps their
//! statuses, and reports the unsignaled requests a completion implies before it, so the
//! poller sees exactly one completion per request, as from the other fabrics. Retiring a
//! queue pair moves it to ERR; it is destroyed once its flush completions are in.
//! Asynchronous events are read without blocking (the context's event descriptor is
//! non-blocking), at most once a millisecond, and turned into [`AsyncEvent::QpFatal`] for the queue pairs they name
//! (all of them for a port or device failure).

use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wc, ibv_wr_opcode};

use super::ffi::QueuePair;
use super::health::{HealthInput, RailHealth, Transition};
use super::rail::VerbsRail;
use super::signal::{Outstanding, PostedRequest, is_signaled};
use super::status::map_status;
use crate::fabric::{
    AsyncEvent, Fabric, FabricError, FabricLimits, Opcode, PostError, QpNum, WcStatus,
    WorkCompletion, WorkRequest, WrId,
};
use crate::{EndpointId, Epoch};

struct Entry {
    qp: QueuePair,
    outstanding: Outstanding,
    retired: bool,
}

/// Completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 64;

/// The poller's side of a [`VerbsRail`]. See the module docs.
pub struct VerbsFabric {
    rail: Arc<VerbsRail>,
    qps: HashMap<u32, Entry>,
    wcs: Vec<ibv_wc>,
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
    implied: Vec<PostedRequest>,
    ready: VecDeque<WorkCompletion>,
    events: VecDeque<AsyncEvent>,
    /// Asynchronous events cost a system call to look for: at most once per interval.
    next_event_check: Instant,
    /// Whether the rail carries work (see [`super::health`]).
    health: RailHealth,
}

/// How often `poll` looks for asynchronous events.
const EVENT_CHECK_INTERVAL: Duration = Duration::from_millis(1);

impl std::fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsFabric")
            .field("rail", &self.rail.name())
            .field("qps", &self.qps.len())
            .finish()
    }
}

// SAFETY:
// - The raw pointers inside `wrs`, `sges` and `wcs` are scratch space rebuilt on every call
//   and never shared; the fabric as a whole moves to its poller thread and stays there.
unsafe impl Send for VerbsFabric {}

fn zeroed<T>() -> T {
    // SAFETY: used only for verbs' plain C structs (`ibv_wc`, `ibv_send_wr`, `ibv_sge`),
    // for which all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

impl VerbsFabric {
    /// The fabric of `rail` (one per rail, for its poller).
    pub fn new(rail: Arc<VerbsRail>) -> Self {
        let async_fd: RawFd = {
            // SAFETY: the context is open for as long as the rail lives.
            unsafe { (*rail.context.as_ptr()).async_fd }
        };
        // SAFETY: fcntl on the context's own event descriptor; making it non-blocking lets
        // the poller read events without ever waiting.
        unsafe {
            let flags = libc::fcntl(async_fd, libc::F_GETFL);
            libc::fcntl(async_fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        Self {
            rail,
            qps: HashMap::new(),
            wcs: (0..POLL_BATCH).map(|_| zeroed()).collect(),
            wrs: Vec::new(),
            sges: Vec::new(),
            implied: Vec::new(),
            ready: VecDeque::new(),
            events: VecDeque::new(),
            next_event_check: Instant::now(),
            health: RailHealth::default(),
        }
    }

    /// Applies what the device (or a poll) said to the rail's health and acts on a change:
    /// down, its queue pairs are reported fatal — and when the completion queue is gone,
    /// their outstanding requests are handed back as flushed here, since nothing else will
    /// — and the poller is told; back up, the poller is told.
    fn health_changed(&mut self, input: HealthInput) {
        let Some(transition) = self.health.on(input) else {
            return;
        };
        match transition {
            Transition::WentDown {
                reason,
                lost_completions,
            } => {
                let live: Vec<u32> = self
                    .qps
                    .iter()
                    .filter(|(_, entry)| !entry.retired)
                    .map(|(num, _)| *num)
                    .collect();
                if lost_completions {
                    for (num, mut entry) in self.qps.drain() {
                        for request in entry.outstanding.take_all() {
                            self.ready.push_back(Self::completion(
                                num,
                                &request,
                                WcStatus::WrFlushErr,
                            ));
                        }
                    }
                }
                self.events.push_back(AsyncEvent::RailDown {
                    reason: format!("{}: {reason}", self.rail.name()),
                });
                self.events.extend(
                    live.into_iter()
                        .map(|n| AsyncEvent::QpFatal { qp: QpNum(n) }),
                );
            }
            Transition::CameBack => self.events.push_back(AsyncEvent::RailUp),
        }
    }

    fn completion(qp: u32, request: &PostedRequest, status: WcStatus) -> WorkCompletion {
        WorkCompletion::ended(
            request.wr_id,
            request.opcode,
            request.len,
            QpNum(qp),
            status,
        )
    }

    /// Reads asynchronous events if the interval has passed since the last look.
    fn look_for_events(&mut self) {
        let now = Instant::now();
        if now >= self.next_event_check {
            self.next_event_check = now + EVENT_CHECK_INTERVAL;
            self.read_events();
        }
    }

    fn read_events(&mut self) {
        loop {
            // SAFETY: `ibv_async_event` is plain old data; all-zero is valid.
            let mut event: rdma_sys::ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: the context is open; its descriptor is non-blocking, so this returns
            // -1 (EAGAIN) at once when there is no event.
            let got =
                unsafe { rdma_sys::ibv_get_async_event(self.rail.context.as_ptr(), &mut event) };
            if got != 0 {
                return;
            }
            use rdma_sys::ibv_event_type as kind;
            match event.event_type {
                kind::IBV_EVENT_QP_FATAL
                | kind::IBV_EVENT_QP_REQ_ERR
                | kind::IBV_EVENT_QP_ACCESS_ERR => {
                    // SAFETY: for QP events the element is the queue pair.
                    let qp = unsafe { event.element.qp };
                    if !qp.is_null() {
                        // SAFETY: the queue pair is live until the event is acknowledged.
                        let num = unsafe { (*qp).qp_num };
                        self.events
                            .push_back(AsyncEvent::QpFatal { qp: QpNum(num) });
                    }
                }
                kind::IBV_EVENT_PORT_ERR => self.health_changed(HealthInput::PortError),
                kind::IBV_EVENT_PORT_ACTIVE => self.health_changed(HealthInput::PortActive),
                kind::IBV_EVENT_CQ_ERR => {
                    self.health_changed(HealthInput::CompletionQueueError);
                }
                kind::IBV_EVENT_DEVICE_FATAL => self.health_changed(HealthInput::DeviceFatal),
                _ => {}
            }
            // SAFETY: every event got is acknowledged exactly once.
            unsafe { rdma_sys::ibv_ack_async_event(&mut event) };
        }
    }
}

impl Fabric for VerbsFabric {
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let qp = self
            .rail
            .staged
            .take_for_connect(endpoint, epoch, self.rail.name())?;
        if !self.health.is_up() {
            // The staged queue pair goes with `qp`.
            return Err(FabricError::Connect {
                endpoint,
                epoch,
                reason: format!(
                    "rail {} is down ({:?})",
                    self.rail.name(),
                    self.health.state()
                ),
            });
        }
        let num = qp.num();
        self.qps.insert(
            num,
            Entry {
                qp,
                outstanding: Outstanding::default(),
                retired: false,
            },
        );
        Ok(QpNum(num))
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        let Some(entry) = self.qps.get_mut(&qp.0).filter(|e| !e.retired) else {
            return Err(PostError {
                posted: 0,
                error: FabricError::UnknownQp { qp },
            });
        };
        if requests.is_empty() {
            return Ok(());
        }
        let every = self.rail.config.signal_every;
        let inline_max = self.rail.config.qp.caps.max_inline_data;
        self.sges.clear();
        self.wrs.clear();
        for request in requests {
            self.sges.push(ibv_sge {
                addr: request.local_addr,
                length: request.len,
                lkey: request.lkey,
            });
        }
        for (index, request) in requests.iter().enumerate() {
            let mut wr: ibv_send_wr = zeroed();
            wr.wr_id = request.wr_id.0;
            // A zero-length request names no memory: an entry of length 0 would mean 2 GiB
            // to some devices.
            wr.num_sge = i32::from(request.len > 0);
            wr.opcode = match request.opcode {
                Opcode::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Opcode::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                Opcode::WriteWithImm => ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            };
            let mut flags = ibv_send_flags(0);
            if is_signaled(index, requests.len(), every) {
                flags |= ibv_send_flags::IBV_SEND_SIGNALED;
            }
            if request.opcode != Opcode::Read && request.len > 0 && request.len <= inline_max {
                flags |= ibv_send_flags::IBV_SEND_INLINE;
            }
            wr.send_flags = flags.0;
            wr.imm_data_invalidated_rkey_union.imm_data = request.imm.to_be();
            wr.wr.rdma.remote_addr = request.remote_addr;
            wr.wr.rdma.rkey = request.rkey;
            self.wrs.push(wr);
        }
        // Link the list now that the vector no longer moves.
        let base = self.wrs.as_mut_ptr();
        let sges = self.sges.as_mut_ptr();
        for index in 0..self.wrs.len() {
            // SAFETY: `index` and `index + 1` are inside `wrs`/`sges`, which are not resized
            // until the post below returns.
            unsafe {
                (*base.add(index)).sg_list = sges.add(index);
                if index + 1 < self.wrs.len() {
                    (*base.add(index)).next = base.add(index + 1);
                }
            }
        }
        // SAFETY: the list is linked above, its scatter/gather entries name memory the
        // submitter registered on this rail, and both vectors outlive the call.
        let result = unsafe { entry.qp.post(base) };
        let posted = match &result {
            Ok(()) => requests.len(),
            // SAFETY: `bad` points into `wrs` (verbs reports the first refused request).
            Err((bad, _)) => unsafe { bad.offset_from(base) }.max(0) as usize,
        };
        for (index, request) in requests.iter().take(posted).enumerate() {
            entry.outstanding.push(PostedRequest {
                wr_id: request.wr_id,
                opcode: request.opcode,
                len: request.len,
                // As posted. If the post stopped part-way, the last accepted request may be
                // unsignaled: a later completion on this queue pair reports it.
                signaled: is_signaled(index, requests.len(), every),
            });
        }
        match result {
            Ok(()) => Ok(()),
            Err((_, error)) => Err(PostError {
                posted,
                error: if error.source.raw_os_error() == Some(libc::ENOMEM) {
                    FabricError::SendQueueFull { qp }
                } else {
                    FabricError::QpInError { qp }
                },
            }),
        }
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        self.look_for_events();
        let start = out.len();
        while out.len() - start < max {
            let Some(completion) = self.ready.pop_front() else {
                break;
            };
            out.push(completion);
        }
        let room = (max - (out.len() - start)).min(POLL_BATCH);
        if room > 0 {
            let taken = match self.rail.cq.poll(&mut self.wcs[..room]) {
                Ok(taken) => taken,
                Err(error) => {
                    let errno = error.source.raw_os_error().unwrap_or(0);
                    self.health_changed(HealthInput::PollError(errno));
                    0
                }
            };
            for wc in &self.wcs[..taken] {
                let Some(entry) = self.qps.get_mut(&wc.qp_num) else {
                    continue;
                };
                self.implied.clear();
                let Some(request) = entry
                    .outstanding
                    .complete(WrId(wc.wr_id), &mut self.implied)
                else {
                    continue;
                };
                for earlier in &self.implied {
                    self.ready
                        .push_back(Self::completion(wc.qp_num, earlier, WcStatus::Success));
                }
                self.ready
                    .push_back(Self::completion(wc.qp_num, &request, map_status(wc.status)));
            }
            self.qps
                .retain(|_, entry| !(entry.retired && entry.outstanding.is_empty()));
            while out.len() - start < max {
                let Some(completion) = self.ready.pop_front() else {
                    break;
                };
                out.push(completion);
            }
        }
        out.len() - start
    }

    fn retire(&mut self, qp: QpNum) {
        if let Some(entry) = self.qps.get_mut(&qp.0) {
            if let Err(error) = entry.qp.to_error() {
                tracing::warn!(
                    target: "railyard::verbs",
                    qp = qp.0,
                    %error,
                    "moving a retired queue pair to ERR failed"
                );
            }
            entry.retired = true;
        }
        self.qps
            .retain(|_, entry| !(entry.retired && entry.outstanding.is_empty()));
    }

    /// Destroys the queue pair (`ibv_destroy_qp`, when its entry drops): once that returns,
    /// the device no longer executes its requests.
    fn abandon(&mut self, qp: QpNum) -> bool {
        self.qps.remove(&qp.0);
        self.ready.retain(|completion| completion.qp != qp);
        true
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.look_for_events();
        self.events.pop_front()
    }

    /// What the rail asked the device for (it may grant more, never less). Every request —
    /// unsignaled ones included — completes into the shared CQ when its queue pair is
    /// flushed, so the CQ's depth bounds all requests in flight on the rail.
    fn limits(&self) -> FabricLimits {
        let config = &self.rail.config;
        FabricLimits {
            send_queue: config.qp.caps.max_send_wr as usize,
            completion_queue: usize::try_from(config.cq_depth).unwrap_or(0).max(1),
        }
    }
}
