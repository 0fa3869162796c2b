//! [`TcpFabric`]: a TCP device as its rail's poller drives it — which connections a round
//! accepts, finds ready and serves, in what order and within what budget, and the [`Fabric`]
//! interface over its initiators' queue pairs.
//!
//! The initiators' connections send requests and take replies (module `initiator`); the
//! connections it serves as a target apply requests to this rail's memory and answer them
//! (module `served`). All are non-blocking, found ready with one `epoll_wait(0)` per round.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use super::connection::{REQUESTS_PER_SEND, would_block};
use super::device::TcpDevice;
use super::initiator::{Initiator, Round};
use super::qp::TcpQp;
use super::served::{ServeIo, Served};
use super::sys::{self, Epoll};
use crate::fabric::faults::{FaultView, QpFaultState};
use crate::fabric::{
    AsyncEvent, Fabric, FabricError, FabricLimits, PostError, QpNum, WorkCompletion, WorkRequest,
};
use crate::{EndpointId, Epoch};

/// Bytes one round moves (sent plus received) before it returns to the poller.
const BYTES_PER_ROUND: usize = 16 << 20;
/// With no connection, `serve` looks at the listener once every this many rounds.
const LISTENER_EVERY: u32 = 64;

const LISTENER: u64 = u64::MAX;
const INITIATOR_TOKEN: u64 = 1 << 32;
const SERVED_TOKEN: u64 = 2 << 32;

/// The TCP device's connections for one poller. See the module docs.
pub struct TcpFabric {
    device: TcpDevice,
    epoll: Epoll,
    ready: Vec<(u64, bool)>,
    /// By number; ordered so that work order never depends on hashing.
    initiators: BTreeMap<u32, Initiator>,
    served: Vec<Option<Served>>,
    /// Where the next round starts serving.
    next_served: usize,
    /// Rounds `serve` ran with no connection (see there).
    quiet_rounds: u32,
    /// The queue-pair number the next round's initiators start at.
    next_initiator: u32,
    adopted: u32,
    faults: FaultView,
    completions: VecDeque<WorkCompletion>,
    events: VecDeque<AsyncEvent>,
    /// Where raw streams go (allocated for the first one).
    sink: Vec<u8>,
    /// Scratch for vectored sends (rebuilt every send).
    iov: Vec<libc::iovec>,
    /// A round ran since the last `poll` (so `poll` need not run another).
    progressed: bool,
}

impl std::fmt::Debug for TcpFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFabric")
            .field("device", &self.device.name())
            .field("initiators", &self.initiators.len())
            .field("served", &self.served.iter().flatten().count())
            .finish()
    }
}

// SAFETY:
// - `iov` holds raw pointers only during one send and is rebuilt before the next; the
//   fabric as a whole moves to its poller thread and stays there.
unsafe impl Send for TcpFabric {}

impl TcpDevice {
    /// A fabric for this device's poller.
    ///
    /// # Errors
    /// When its epoll instance cannot be created.
    pub fn fabric(&self) -> io::Result<TcpFabric> {
        TcpFabric::new(self.clone())
    }
}

impl TcpFabric {
    fn new(device: TcpDevice) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.add(device.listener().as_raw_fd(), LISTENER)?;
        let faults = FaultView::new(device.faults());
        Ok(Self {
            device,
            epoll,
            ready: Vec::new(),
            initiators: BTreeMap::new(),
            served: Vec::new(),
            next_served: 0,
            quiet_rounds: 0,
            next_initiator: 0,
            adopted: 0,
            faults,
            completions: VecDeque::new(),
            events: VecDeque::new(),
            sink: Vec::new(),
            iov: Vec::with_capacity(2 * REQUESTS_PER_SEND),
            progressed: false,
        })
    }

    /// Takes over a connected queue pair, for `endpoint` when it serves one (fault rules can
    /// name endpoints).
    ///
    /// # Errors
    /// When its descriptor cannot be watched.
    pub fn adopt(&mut self, endpoint: Option<EndpointId>, qp: TcpQp) -> io::Result<QpNum> {
        let TcpQp { num, stream, hello } = qp;
        self.epoll
            .add(stream.as_raw_fd(), INITIATOR_TOKEN | u64::from(num.0))?;
        let ordinal = self.adopted;
        self.adopted += 1;
        let faults = QpFaultState::new(self.faults.plan.seed, ordinal, endpoint);
        self.initiators
            .insert(num.0, Initiator::new(num, stream, hello, faults));
        Ok(num)
    }

    /// One round: accept, read what is ready, send what is queued, time out the silent,
    /// release delayed completions. True when anything moved.
    fn progress(&mut self) -> bool {
        self.progressed = true;
        self.faults.refresh();
        let now = Instant::now();
        let mut moved = false;
        let mut ready = std::mem::take(&mut self.ready);
        self.epoll.ready(&mut ready);
        for &(token, hung_up) in &ready {
            match token {
                LISTENER => moved |= self.accept(now),
                _ if token & SERVED_TOKEN != 0 => {
                    if let Some(Some(served)) = self.served.get_mut((token & 0xffff_ffff) as usize)
                    {
                        served.readable = true;
                        served.hung_up |= hung_up;
                    }
                }
                _ => {
                    if let Some(initiator) =
                        self.initiators.get_mut(&((token & 0xffff_ffff) as u32))
                    {
                        initiator.readable = true;
                    }
                }
            }
        }
        self.ready = ready;
        let mut budget = BYTES_PER_ROUND;
        let mut io = ServeIo {
            device: &self.device,
            sink: &mut self.sink,
            iov: &mut self.iov,
            budget: &mut budget,
            now,
        };
        // Each round starts at the next connection, so that a busy one that spends the
        // budget cannot starve the others.
        let count = self.served.len();
        self.next_served = self.next_served.wrapping_add(1);
        for offset in 0..count {
            let entry = &mut self.served[self.next_served.wrapping_add(offset) % count];
            if let Some(served) = entry {
                moved |= served.serve(&mut io);
                if served.closed {
                    // Closing the descriptor also stops epoll watching it.
                    *entry = None;
                }
            }
        }
        while matches!(self.served.last(), Some(None)) {
            self.served.pop();
        }
        let mut round = Round {
            plan: &self.faults.plan,
            device: &self.device,
            epoll: &self.epoll,
            cq: &mut self.completions,
            events: &mut self.events,
            iov: &mut self.iov,
            now,
        };
        // Initiators too start one further each round.
        let start = self.next_initiator;
        self.next_initiator = self
            .initiators
            .range(start..)
            .next()
            .map_or(0, |(num, _)| num.wrapping_add(1));
        for initiator in self.initiators.range_mut(start..).map(|(_, i)| i) {
            moved |= initiator.step(&mut round, &mut budget);
        }
        for initiator in self.initiators.range_mut(..start).map(|(_, i)| i) {
            moved |= initiator.step(&mut round, &mut budget);
        }
        self.initiators.retain(|_, i| !i.finished());
        moved
    }

    /// Accepts every waiting connection; true if there was one.
    fn accept(&mut self, now: Instant) -> bool {
        let mut accepted = false;
        loop {
            let stream = match self.device.listener().accept() {
                Ok((stream, _)) => stream,
                Err(error) if would_block(&error) => return accepted,
                Err(_) => return accepted,
            };
            accepted = true;
            if stream.set_nonblocking(true).is_err()
                || sys::tune(&stream, self.device.config().socket_buffer).is_err()
            {
                continue;
            }
            let slot = self
                .served
                .iter()
                .position(Option::is_none)
                .unwrap_or(self.served.len());
            if self
                .epoll
                .add(stream.as_raw_fd(), SERVED_TOKEN | slot as u64)
                .is_err()
            {
                continue;
            }
            let served = Served::new(stream, now + self.device.config().connect_timeout);
            if slot == self.served.len() {
                self.served.push(Some(served));
            } else {
                self.served[slot] = Some(served);
            }
        }
    }
}

impl Fabric for TcpFabric {
    /// Adopts the queue pair the control plane connected and staged for `endpoint` at
    /// `epoch` ([`TcpDevice::stage`]).
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        let qp = self
            .device
            .staged()
            .take_for_connect(endpoint, epoch, self.device.name())?;
        self.adopt(Some(endpoint), qp)
            .map_err(|error| FabricError::Connect {
                endpoint,
                epoch,
                reason: error.to_string(),
            })
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        let depth = self.device.config().send_queue_depth;
        let Some(initiator) = self.initiators.get_mut(&qp.0).filter(|i| !i.retired) else {
            return Err(PostError {
                posted: 0,
                error: FabricError::UnknownQp { qp },
            });
        };
        let posted = initiator.post(requests, depth, Instant::now(), &mut self.completions);
        if posted < requests.len() {
            return Err(PostError {
                posted,
                error: FabricError::SendQueueFull { qp },
            });
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        if !std::mem::take(&mut self.progressed) && self.completions.len() < max {
            self.progress();
            self.progressed = false;
        }
        let count = max.min(self.completions.len());
        out.extend(self.completions.drain(..count));
        count
    }

    fn retire(&mut self, qp: QpNum) {
        if let Some(initiator) = self.initiators.get_mut(&qp.0) {
            if initiator.live() {
                let mut round = Round {
                    plan: &self.faults.plan,
                    device: &self.device,
                    epoll: &self.epoll,
                    cq: &mut self.completions,
                    events: &mut self.events,
                    iov: &mut self.iov,
                    now: Instant::now(),
                };
                initiator.go_to_error(&mut round);
            }
            initiator.retired = true;
        }
        self.initiators.retain(|_, i| !i.finished());
    }

    /// The poller moves every byte itself, in `post`, `poll` and `serve`: dropping the
    /// initiator closes its connection and drops its delayed requests, so nothing of them
    /// is read or written afterwards.
    fn abandon(&mut self, qp: QpNum) -> bool {
        self.initiators.remove(&qp.0);
        self.completions.retain(|completion| completion.qp != qp);
        true
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.events.pop_front()
    }

    fn serve(&mut self) -> bool {
        // With no connection at all there is only the listener to look at: every
        // LISTENER_EVERY rounds is soon enough, and spares a busy soft rail a system call
        // per round.
        if self.served.is_empty() && self.initiators.is_empty() {
            self.quiet_rounds = self.quiet_rounds.wrapping_add(1);
            if self.quiet_rounds % LISTENER_EVERY != 0 {
                return false;
            }
        }
        self.progress()
    }

    fn serving(&self) -> bool {
        !self.served.is_empty()
    }

    fn limits(&self) -> FabricLimits {
        FabricLimits {
            send_queue: self.device.config().send_queue_depth,
            // Completions wait in a queue that grows as needed.
            completion_queue: usize::MAX,
        }
    }
}
