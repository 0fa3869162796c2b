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
use std::time::{Duration, Instant};

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
/// Most connections one round accepts: a flood of connections costs the poller a bounded
/// amount per round (the rest wait in the listen backlog).
const ACCEPTS_PER_ROUND: usize = 8;
/// How long accepting pauses after `accept` ran out of file descriptors or memory (retrying
/// at once would spin).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long a connection may wait for its hello before the cap may close it: its dialer
/// sends the hello as soon as its poller takes the queue pair, but the kernel may hand the
/// connection over before the hello arrives.
const HALF_OPEN_GRACE: Duration = Duration::from_millis(20);
/// Fewest seconds between two warnings about failed accepts.
const ACCEPT_WARNING_EVERY: Duration = Duration::from_secs(10);

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
    /// Accepting waits until then after `accept` ran out of descriptors or memory.
    accept_paused_until: Option<Instant>,
    /// When the last warning about failed accepts was logged.
    accept_warned_at: Option<Instant>,
    /// Connections accepted so far (each served connection's place in that order).
    accepted_count: u64,
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
            accept_paused_until: None,
            accept_warned_at: None,
            accepted_count: 0,
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
        let mut accepted = false;
        // A pause that ends now: the cap is looked at again even if nothing more arrives
        // (a burst that ended inside the grace period leaves its newest connections over it).
        let pause_over = self.accept_paused_until.is_some_and(|until| now >= until);
        if pause_over {
            self.accept_paused_until = None;
        }
        let mut ready = std::mem::take(&mut self.ready);
        self.epoll.ready(&mut ready);
        for &(token, hung_up) in &ready {
            match token {
                LISTENER if self.accept_paused_until.is_none() => {
                    accepted = self.accept(now);
                    moved |= accepted;
                }
                LISTENER => {}
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
        // After the newly accepted have been read once: a peer whose hello was already in
        // its socket is past it by now, whatever else arrived with it.
        if accepted || pause_over {
            self.close_half_open_beyond_cap(now);
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

    /// Accepts waiting connections, at most [`ACCEPTS_PER_ROUND`]; true if there was one.
    /// Pauses accepting for [`ACCEPT_BACKOFF`] when the process is out of descriptors or
    /// memory. (The round then reads them, and closes the oldest of those bound to no queue
    /// pair beyond `max_half_open`.)
    fn accept(&mut self, now: Instant) -> bool {
        let mut accepted = false;
        for _ in 0..ACCEPTS_PER_ROUND {
            let stream = match self.device.listener().accept() {
                Ok((stream, _)) => stream,
                Err(error) if would_block(&error) => break,
                Err(error) if out_of_descriptors(&error) => {
                    self.accept_failed(&error, now);
                    break;
                }
                // The connection went before it was taken (ECONNABORTED), or a firewall
                // refused it: the next round tries again.
                Err(_) => break,
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
            self.accepted_count += 1;
            let served = Served::new(
                stream,
                now + self.device.config().connect_timeout,
                (self.accepted_count, now),
            );
            if slot == self.served.len() {
                self.served.push(Some(served));
            } else {
                self.served[slot] = Some(served);
            }
        }
        accepted
    }

    /// While more than `max_half_open` connections are bound to no queue pair (waiting for
    /// their hello, or raw streams), closes the first accepted of them — unless it was
    /// accepted less than [`HALF_OPEN_GRACE`] ago: then accepting pauses until it is that
    /// old, so that a real peer whose hello is on its way is never taken for a silent one.
    fn close_half_open_beyond_cap(&mut self, now: Instant) {
        let cap = self.device.config().max_half_open;
        loop {
            let mut unbound = 0;
            let mut oldest: Option<(u64, Instant, usize)> = None;
            for (slot, served) in self.served.iter().enumerate() {
                if let Some((order, at)) = served.as_ref().and_then(Served::unbound_since) {
                    unbound += 1;
                    if oldest.is_none_or(|(first, _, _)| order < first) {
                        oldest = Some((order, at, slot));
                    }
                }
            }
            match oldest {
                Some((_, at, _)) if unbound > cap && now.duration_since(at) < HALF_OPEN_GRACE => {
                    self.accept_paused_until = Some(at + HALF_OPEN_GRACE);
                    return;
                }
                Some((_, _, slot)) if unbound > cap => {
                    // Closing the descriptor also stops epoll watching it.
                    self.served[slot] = None;
                    self.device.served_counters().half_open_closed();
                }
                _ => return,
            }
        }
    }

    /// Counts a failed `accept`, pauses accepting, and warns at most every
    /// [`ACCEPT_WARNING_EVERY`].
    fn accept_failed(&mut self, error: &io::Error, now: Instant) {
        let failures = self.device.served_counters().accept_failed();
        self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
        if self
            .accept_warned_at
            .is_none_or(|last| now.duration_since(last) >= ACCEPT_WARNING_EVERY)
        {
            self.accept_warned_at = Some(now);
            tracing::warn!(
                target: "railyard::tcp",
                device = self.device.name(),
                failures,
                "the TCP data port cannot accept ({error}): accepting pauses for {ACCEPT_BACKOFF:?} \
                 each time; out of file descriptors, raise the limit (ulimit -n, or the \
                 system's fs.file-max for ENFILE); out of memory, free some"
            );
        }
    }
}

/// Whether `accept` failed for lack of descriptors or memory (retrying at once would spin).
fn out_of_descriptors(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
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
