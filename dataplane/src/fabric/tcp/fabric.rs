//! [`TcpFabric`]: a TCP device as its rail's poller drives it — the initiators' connections
//! (sending requests, taking replies) and the connections it serves as a target (applying
//! requests to this rail's memory, answering them), all non-blocking, found ready with one
//! `epoll_wait(0)` per round.
//!
//! Initiator: `post` queues work requests; each round judges the next ones (fault plan, then
//! the local key and range), sends as many as the socket takes in one vectored send (headers
//! and WRITE payloads straight from registered memory, their local keys checked again right
//! before), and reads exactly the reply headers it expects — never into a READ's data, which
//! is received straight into its destination (its key checked again before every receive).
//! A request the fault plan or a local check fails stops the sending; once everything before
//! it is answered, it completes with its status and the queue pair goes to ERR, which closes
//! the connection abortively (nothing the kernel still held goes out).
//!
//! Target: each served connection reads a request header, checks it against the live region
//! table, receives a WRITE's payload straight into the region (checking the key again before
//! every chunk), delivers a WRITE_WITH_IMM's immediate to the [`TcpTarget`](super::TcpTarget)
//! owner (waiting while its queue is full, as a receiver-not-ready), and queues the reply;
//! READ data is sent straight from the region (checked again before every send). A refused
//! request is answered with REM_ACCESS_ERR and stops the connection: nothing more is read
//! from it, and it closes once its replies are delivered. A connection whose owner closed the
//! queue pair closes before the next request, chunk or reply.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, ErrorKind};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::sys::{self, Epoll};
use super::wire::{
    HELLO_LEN, Hello, REPLY_LEN, REQUEST_LEN, ReplyHeader, RequestHeader, RequestOp,
};
use super::{ServedCounters, TargetLink, TcpDevice, TcpQp};
use crate::fabric::delayed::DelayedCompletions;
use crate::fabric::faults::{FaultView, QpFaultState, Verdict};
use crate::fabric::{
    Access, AsyncEvent, Fabric, FabricError, FabricLimits, Opcode, PostError, QpNum, WcStatus,
    WorkCompletion, WorkRequest,
};
use crate::{EndpointId, Epoch};

/// Largest message, as verbs allows.
const MAX_MESSAGE: u32 = 1 << 31;
/// Bytes one round moves (sent plus received) before it returns to the poller.
const BYTES_PER_ROUND: usize = 16 << 20;
/// Requests one vectored send carries at most (two entries each).
pub const REQUESTS_PER_SEND: usize = 64;
/// Replies a target queues before it stops reading requests (the initiator is not reading).
const MAX_QUEUED_REPLIES: usize = 4096;
/// A sink's buffer: as large as a big request, so that a raw stream lands in memory as
/// cold as the fabric's destinations, not in one cache-resident block.
const SINK_BUFFER: usize = 64 << 20;
/// With no connection, `serve` looks at the listener once every this many rounds.
const LISTENER_EVERY: u32 = 64;
/// Reply headers read in one receive at most.
const REPLIES_PER_RECEIVE: usize = 256;

const LISTENER: u64 = u64::MAX;
const INITIATOR_TOKEN: u64 = 1 << 32;
const SERVED_TOKEN: u64 = 2 << 32;

/// Why a request stops the sending before it goes out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Doom {
    /// It completes with this error status.
    Fail(WcStatus),
    /// The queue pair raises QP_FATAL.
    Fatal,
}

/// A posted request with its header, and once judged, the delay of its completion.
#[derive(Clone, Copy, Debug)]
struct Queued {
    request: WorkRequest,
    header: [u8; REQUEST_LEN],
    delay: Duration,
}

impl Queued {
    /// Bytes it puts on the wire.
    fn wire_len(&self) -> usize {
        REQUEST_LEN + self.payload_len()
    }

    fn payload_len(&self) -> usize {
        match self.request.opcode {
            Opcode::Read => 0,
            Opcode::Write | Opcode::WriteWithImm => self.request.len as usize,
        }
    }
}

/// The initiator's side of one queue pair.
#[derive(Debug)]
struct Initiator {
    num: QpNum,
    /// The connection; `None` once the queue pair is in ERR (closed abortively).
    stream: Option<TcpStream>,
    /// The hello, sent before anything else once the connection is up.
    hello: [u8; HELLO_LEN],
    /// Bytes of `hello` already sent.
    hello_sent: usize,
    /// Posted and not yet fully sent, in order.
    queued: VecDeque<Queued>,
    /// How many of `queued`, from the front, passed judgement.
    judged: usize,
    /// The verdict on `queued[judged]`, which stops the sending.
    doom: Option<Doom>,
    /// Bytes of `queued[0]` already sent.
    head_sent: usize,
    /// Sent, waiting for their replies, in order.
    inflight: VecDeque<Queued>,
    /// Reply-header bytes received so far.
    replies: Vec<u8>,
    /// A READ's data being received: destination and bytes left.
    read_data: Option<(u64, usize)>,
    /// When the peer last took or sent a byte (or work became outstanding).
    last_progress: Instant,
    /// Completions not visible yet (fault-plan delays), in order.
    delayed: DelayedCompletions,
    faults: QpFaultState,
    readable: bool,
    retired: bool,
}

/// What an accepted connection is.
#[derive(Debug)]
enum Role {
    /// Waiting for its hello.
    Hello {
        bytes: [u8; HELLO_LEN],
        got: usize,
        deadline: Instant,
    },
    /// Serving a target queue pair (boxed: its immediate ring's handle is cache-line
    /// aligned, far larger than the other roles).
    Target(Box<TargetLink>),
    /// A raw stream, read and discarded into the fabric's sink buffer, cycling from `at`.
    Sink { at: usize },
}

/// Where a served connection is in its current request.
#[derive(Clone, Copy, Debug)]
enum Incoming {
    /// Reading a header.
    Header,
    /// Receiving a WRITE's payload into the region.
    Payload {
        addr: u64,
        left: usize,
        header: RequestHeader,
    },
    /// An applied WRITE_WITH_IMM whose immediate waits for room.
    Immediate { header: RequestHeader },
    /// An error was answered: nothing more is read from this connection (what follows the
    /// error is flushed at the initiator, so it must never execute). It closes once its
    /// replies have reached the peer, or at `deadline` if they cannot.
    Stopped { deadline: Instant },
}

/// One reply, with a READ's data.
#[derive(Clone, Copy, Debug)]
struct Reply {
    header: [u8; REPLY_LEN],
    /// The request it answers.
    request: RequestHeader,
    data_addr: u64,
    data_len: usize,
}

impl Reply {
    fn wire_len(&self) -> usize {
        REPLY_LEN + self.data_len
    }
}

/// A connection this fabric accepted.
#[derive(Debug)]
struct Served {
    /// Declared before `role`: fields drop in declaration order, so the socket is closed
    /// before a target's link acknowledges the close to its owner.
    stream: TcpStream,
    role: Role,
    header: [u8; REQUEST_LEN],
    header_got: usize,
    incoming: Incoming,
    replies: VecDeque<Reply>,
    /// Bytes of `replies[0]` already sent.
    reply_sent: usize,
    readable: bool,
    /// The initiator reset or closed the connection: whatever it had sent and the kernel
    /// still buffers is not executed (the initiator has reported it flushed).
    hung_up: bool,
    closed: bool,
}

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

fn would_block(error: &io::Error) -> bool {
    error.kind() == ErrorKind::WouldBlock || error.kind() == ErrorKind::Interrupted
}

impl TcpFabric {
    pub(crate) fn new(device: TcpDevice) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.add(device.0.listener.as_raw_fd(), LISTENER)?;
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
        self.initiators.insert(
            num.0,
            Initiator {
                num,
                stream: Some(stream),
                hello,
                hello_sent: 0,
                queued: VecDeque::new(),
                judged: 0,
                doom: None,
                head_sent: 0,
                inflight: VecDeque::new(),
                replies: Vec::with_capacity(REPLIES_PER_RECEIVE * REPLY_LEN),
                read_data: None,
                last_progress: Instant::now(),
                delayed: DelayedCompletions::default(),
                faults: QpFaultState::new(self.faults.plan.seed, ordinal, endpoint),
                readable: false,
                retired: false,
            },
        );
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
        self.initiators
            .retain(|_, i| !(i.retired && i.delayed.is_empty()));
        moved
    }

    /// Accepts every waiting connection; true if there was one.
    fn accept(&mut self, now: Instant) -> bool {
        let mut accepted = false;
        loop {
            let stream = match self.device.0.listener.accept() {
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
            let served = Served {
                stream,
                role: Role::Hello {
                    bytes: [0; HELLO_LEN],
                    got: 0,
                    deadline: now + self.device.config().connect_timeout,
                },
                header: [0; REQUEST_LEN],
                header_got: 0,
                incoming: Incoming::Header,
                replies: VecDeque::new(),
                reply_sent: 0,
                readable: true,
                hung_up: false,
                closed: false,
            };
            if slot == self.served.len() {
                self.served.push(Some(served));
            } else {
                self.served[slot] = Some(served);
            }
        }
    }
}

/// Accounts `sent` bytes against `items`, oldest first, of which `front_sent` bytes of the
/// front were already sent; hands each item now wholly sent to `done`.
fn account_sent<T>(
    items: &mut VecDeque<T>,
    front_sent: &mut usize,
    mut sent: usize,
    wire_len: impl Fn(&T) -> usize,
    mut done: impl FnMut(T),
) {
    while sent > 0 {
        let Some(front) = items.front() else {
            return;
        };
        let left = wire_len(front) - *front_sent;
        if sent < left {
            *front_sent += sent;
            return;
        }
        sent -= left;
        *front_sent = 0;
        if let Some(item) = items.pop_front() {
            done(item);
        }
    }
}

/// What one round's served connections share.
struct ServeIo<'a> {
    device: &'a TcpDevice,
    sink: &'a mut Vec<u8>,
    iov: &'a mut Vec<libc::iovec>,
    budget: &'a mut usize,
    now: Instant,
}

/// What one round's initiators share.
struct Round<'a> {
    plan: &'a crate::fabric::faults::FaultPlan,
    device: &'a TcpDevice,
    epoll: &'a Epoll,
    cq: &'a mut VecDeque<WorkCompletion>,
    events: &'a mut VecDeque<AsyncEvent>,
    iov: &'a mut Vec<libc::iovec>,
    now: Instant,
}

/// Whether `key` still names a live registration of `device`'s rail that allows `needed`
/// and covers `[addr, addr + len)`. Asked again right before every system call that reads or
/// writes registered memory, so that a withdrawal takes effect from the next call on.
fn still_registered(device: &TcpDevice, key: u32, needed: Access, addr: u64, len: u64) -> bool {
    device
        .soft()
        .table()
        .lookup(key)
        .is_some_and(|region| region.access.contains(needed) && region.covers(addr, len))
}

impl Initiator {
    /// The connection's descriptor, or -1 once it is closed: every system call refuses that
    /// (EBADF), where a stale number could name a descriptor the process opened since.
    fn fd(&self) -> RawFd {
        self.stream.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// Not in ERR: the connection is open.
    fn live(&self) -> bool {
        self.stream.is_some()
    }

    fn outstanding(&self) -> bool {
        !self.inflight.is_empty() || !self.queued.is_empty()
    }

    /// Sends, receives, resolves a doomed head, times out; true when anything moved.
    fn step(&mut self, round: &mut Round<'_>, budget: &mut usize) -> bool {
        self.delayed.release(round.now, round.cq);
        if !self.live() {
            return false;
        }
        let mut moved = false;
        if self.readable {
            self.readable = false;
            match self.receive(round, budget) {
                Ok(progress) => moved |= progress,
                Err(()) => return true,
            }
        }
        match self.send(round, budget) {
            Ok(progress) => moved |= progress,
            Err(()) => return true,
        }
        if moved {
            self.last_progress = round.now;
        }
        if let Some(doom) = self
            .doom
            .filter(|_| self.judged == 0 && self.inflight.is_empty())
        {
            match doom {
                Doom::Fail(status) => self.fail_head(status, round),
                Doom::Fatal => {
                    self.go_to_error(round);
                    round.events.push_back(AsyncEvent::QpFatal { qp: self.num });
                }
            }
            return true;
        }
        if self.outstanding()
            && round.now.duration_since(self.last_progress) >= round.device.config().peer_timeout
        {
            self.fail_head(WcStatus::RetryExcErr, round);
            return true;
        }
        moved
    }

    /// The fault plan's verdict, then the local checks a NIC makes.
    fn judge(&mut self, index: usize, round: &Round<'_>) -> Result<Duration, Doom> {
        let request = self.queued[index].request;
        let delay = match self.faults.judge(round.plan) {
            Verdict::Execute { delay } => delay,
            Verdict::Fail(status) => return Err(Doom::Fail(status)),
            Verdict::Fatal => return Err(Doom::Fatal),
        };
        if request.len > MAX_MESSAGE {
            return Err(Doom::Fail(WcStatus::LocLenErr));
        }
        if request.len == 0 {
            return Ok(delay);
        }
        let table = round.device.soft().table();
        let Some(local) = table.lookup(request.lkey) else {
            return Err(Doom::Fail(WcStatus::LocProtErr));
        };
        if request.opcode == Opcode::Read && !local.access.contains(Access::LOCAL_WRITE) {
            return Err(Doom::Fail(WcStatus::LocProtErr));
        }
        if !local.covers(request.local_addr, u64::from(request.len)) {
            return Err(Doom::Fail(WcStatus::LocLenErr));
        }
        Ok(delay)
    }

    /// Sends judged requests until the socket is full or the budget is spent.
    fn send(&mut self, round: &mut Round<'_>, budget: &mut usize) -> Result<bool, ()> {
        let mut moved = false;
        while *budget > 0 {
            while self.doom.is_none()
                && self.judged < self.queued.len()
                && self.judged < REQUESTS_PER_SEND
            {
                match self.judge(self.judged, round) {
                    Ok(delay) => {
                        self.queued[self.judged].delay = delay;
                        self.judged += 1;
                    }
                    Err(doom) => self.doom = Some(doom),
                }
            }
            self.recheck_local_keys(round.device);
            let hello_left = HELLO_LEN - self.hello_sent;
            if self.judged == 0 && hello_left == 0 {
                return Ok(moved);
            }
            round.iov.clear();
            if hello_left > 0 {
                round.iov.push(libc::iovec {
                    iov_base: self.hello[self.hello_sent..].as_ptr().cast_mut().cast(),
                    iov_len: hello_left,
                });
            }
            for (index, queued) in self.queued.iter().take(self.judged).enumerate() {
                let skip = if index == 0 { self.head_sent } else { 0 };
                if skip < REQUEST_LEN {
                    round.iov.push(libc::iovec {
                        iov_base: queued.header[skip..].as_ptr().cast_mut().cast(),
                        iov_len: REQUEST_LEN - skip,
                    });
                }
                let payload = queued.payload_len();
                let payload_skip = skip.saturating_sub(REQUEST_LEN);
                if payload > payload_skip {
                    round.iov.push(libc::iovec {
                        iov_base: (queued.request.local_addr + payload_skip as u64) as *mut _,
                        iov_len: payload - payload_skip,
                    });
                }
            }
            // SAFETY: the hello and the headers live in `self`, untouched until the call
            // returns; payloads lie inside registrations of this process found live just now
            // (`recheck_local_keys`), and registered memory stays valid for reads until its
            // withdrawal is followed by the end of this poller's round (the engine's
            // deregistration waits for that, see the module docs): for the whole call.
            let sent = match unsafe { sys::send_vectored(self.fd(), round.iov) } {
                Ok(sent) => sent,
                // Also while the connection is still being set up.
                Err(error) if would_block(&error) => return Ok(moved),
                Err(_) => {
                    // A target that refused the head answers at its header and closes while
                    // the payload still goes: its answer may wait in the socket behind the
                    // broken send, and says why (else the connection just broke).
                    let mut ample = usize::MAX;
                    if self.receive(round, &mut ample).is_ok() {
                        self.connection_failed(round);
                    }
                    return Err(());
                }
            };
            round.iov.clear();
            moved = true;
            *budget = budget.saturating_sub(sent);
            let hello_part = sent.min(hello_left);
            self.hello_sent += hello_part;
            self.advance(sent - hello_part);
        }
        Ok(moved)
    }

    /// Checks again, right before a send, the local key of every judged payload that still
    /// has bytes to go: the first whose registration was withdrawn since it was judged becomes
    /// the doomed request (LOC_PROT_ERR), and nothing from it on is sent. If bytes of it are
    /// already out (the head), the rest never follows: it fails once the requests before it
    /// are answered, and the queue pair's close discards what the kernel still held.
    fn recheck_local_keys(&mut self, device: &TcpDevice) {
        let withdrawn =
            self.queued
                .iter()
                .take(self.judged)
                .enumerate()
                .position(|(index, queued)| {
                    let skip = if index == 0 { self.head_sent } else { 0 };
                    let payload = queued.payload_len();
                    let payload_skip = skip.saturating_sub(REQUEST_LEN);
                    payload > payload_skip
                        && !still_registered(
                            device,
                            queued.request.lkey,
                            Access::NONE,
                            queued.request.local_addr + payload_skip as u64,
                            (payload - payload_skip) as u64,
                        )
                });
        if let Some(index) = withdrawn {
            self.judged = index;
            self.doom = Some(Doom::Fail(WcStatus::LocProtErr));
        }
    }

    /// Accounts `sent` bytes: fully sent requests move to `inflight`.
    fn advance(&mut self, sent: usize) {
        let Self {
            queued,
            head_sent,
            judged,
            inflight,
            ..
        } = self;
        account_sent(queued, head_sent, sent, Queued::wire_len, |done| {
            *judged -= 1;
            inflight.push_back(done);
        });
    }

    /// Takes replies (and READ data) until the socket is empty or the budget is spent.
    fn receive(&mut self, round: &mut Round<'_>, budget: &mut usize) -> Result<bool, ()> {
        let mut moved = false;
        while *budget > 0 {
            if let Some((addr, left)) = self.read_data {
                let lkey = self.inflight.front().map_or(0, |front| front.request.lkey);
                if !still_registered(round.device, lkey, Access::LOCAL_WRITE, addr, left as u64) {
                    // Withdrawn while its data arrives: what came stays, nothing more is
                    // written there.
                    self.fail_head(WcStatus::LocProtErr, round);
                    return Err(());
                }
                // SAFETY: the destination lies inside a registration of this process
                // allowing local writes, found live just now; registered memory stays valid
                // for writes until its withdrawal is followed by the end of this poller's
                // round (the engine's deregistration waits for that, see the module docs).
                match unsafe { sys::recv_into(self.fd(), addr, left) } {
                    Ok(0) => return self.broken(round),
                    Ok(got) => {
                        moved = true;
                        *budget = budget.saturating_sub(got);
                        if got == left {
                            self.read_data = None;
                            self.complete_front(WcStatus::Success, round);
                        } else {
                            self.read_data = Some((addr + got as u64, left - got));
                        }
                        continue;
                    }
                    Err(error) if would_block(&error) => return Ok(moved),
                    Err(_) => return self.broken(round),
                }
            }
            if self.inflight.is_empty() && !self.head_may_be_refused() {
                // Nothing is expected: only an orderly close or a broken peer reads here.
                let mut probe = [0u8; 1];
                // SAFETY: `probe` is writable for one byte.
                return match unsafe { sys::recv_into(self.fd(), probe.as_mut_ptr() as u64, 1) } {
                    Err(error) if would_block(&error) => Ok(moved),
                    _ => self.broken(round),
                };
            }
            // Exactly the headers expected: one if a READ is next (its data follows), or if
            // only the head being sent may be answered (refused), else one per WRITE up to
            // the next READ.
            let expected = match self.inflight.front() {
                Some(front) if front.request.opcode == Opcode::Read => 1,
                None => 1,
                Some(_) => self
                    .inflight
                    .iter()
                    .take(REPLIES_PER_RECEIVE)
                    .take_while(|q| q.request.opcode != Opcode::Read)
                    .count(),
            };
            let have = self.replies.len();
            let want = expected * REPLY_LEN;
            if have >= want {
                return self.broken(round);
            }
            self.replies.resize(want, 0);
            // SAFETY: `replies[have..want]` is writable; it is not touched until the call
            // returns.
            let got = match unsafe {
                sys::recv_into(
                    self.fd(),
                    self.replies[have..].as_mut_ptr() as u64,
                    want - have,
                )
            } {
                Ok(0) => {
                    self.replies.truncate(have);
                    return self.broken(round);
                }
                Ok(got) => got,
                Err(error) => {
                    self.replies.truncate(have);
                    if would_block(&error) {
                        return Ok(moved);
                    }
                    return self.broken(round);
                }
            };
            moved = true;
            self.replies.truncate(have + got);
            let whole = self.replies.len() / REPLY_LEN;
            for index in 0..whole {
                let mut bytes = [0; REPLY_LEN];
                bytes.copy_from_slice(&self.replies[index * REPLY_LEN..(index + 1) * REPLY_LEN]);
                let Ok(reply) = ReplyHeader::decode(&bytes) else {
                    return self.broken(round);
                };
                // The request it answers: the oldest in flight, or the head being sent, which
                // a target refuses as soon as its header arrives.
                let (front, being_sent) = match self.inflight.front() {
                    Some(front) => (front, false),
                    None => match self.queued.front().filter(|_| self.head_may_be_refused()) {
                        Some(head) => (head, true),
                        None => return self.broken(round),
                    },
                };
                if reply.wr_id != front.request.wr_id.0 {
                    return self.broken(round);
                }
                if reply.status != WcStatus::Success {
                    // If it is the head being sent, the rest of its payload never goes out:
                    // the queue pair's close discards what the kernel still held.
                    self.replies.clear();
                    self.fail_head(reply.status, round);
                    return Err(());
                }
                if being_sent {
                    // Applied before all of it was sent: nonsense.
                    return self.broken(round);
                }
                if front.request.opcode == Opcode::Read && front.request.len > 0 {
                    if reply.len != front.request.len {
                        return self.broken(round);
                    }
                    self.read_data = Some((front.request.local_addr, front.request.len as usize));
                } else {
                    self.complete_front(WcStatus::Success, round);
                }
            }
            self.replies.drain(..whole * REPLY_LEN);
        }
        Ok(moved)
    }

    /// The head of `queued` has its header out and its payload still going: the target may
    /// already have refused it (it answers an error at the header, reading nothing after).
    fn head_may_be_refused(&self) -> bool {
        !self.queued.is_empty() && self.head_sent >= REQUEST_LEN
    }

    /// The front in-flight request completed with `status` (successes only when signaled).
    fn complete_front(&mut self, status: WcStatus, round: &mut Round<'_>) {
        if let Some(done) = self.inflight.pop_front() {
            if done.request.signaled || status != WcStatus::Success {
                let completion = WorkCompletion::of(&done.request, self.num, status);
                self.delayed
                    .emit(completion, round.now + done.delay, round.cq);
            }
        }
    }

    /// The connection broke, or the peer spoke out of turn (a reply that is not the next
    /// one expected): either way it cannot go on.
    fn broken(&mut self, round: &mut Round<'_>) -> Result<bool, ()> {
        self.connection_failed(round);
        Err(())
    }

    /// The connection broke or the peer spoke nonsense: RETRY_EXC_ERR for the oldest
    /// outstanding request, or, with none, QP_FATAL so the owner reconnects early.
    fn connection_failed(&mut self, round: &mut Round<'_>) {
        if self.outstanding() {
            self.fail_head(WcStatus::RetryExcErr, round);
        } else {
            self.go_to_error(round);
            round.events.push_back(AsyncEvent::QpFatal { qp: self.num });
        }
    }

    /// The oldest outstanding request completes with `status`; the queue pair goes to ERR.
    fn fail_head(&mut self, status: WcStatus, round: &mut Round<'_>) {
        let head = self.inflight.pop_front().or_else(|| {
            self.head_sent = 0;
            self.judged = self.judged.saturating_sub(1);
            self.queued.pop_front()
        });
        if let Some(head) = head {
            let failed = WorkCompletion::of(&head.request, self.num, status);
            self.delayed.emit(failed, round.now, round.cq);
        }
        self.go_to_error(round);
    }

    /// ERR: everything outstanding completes with WR_FLUSH_ERR; the connection closes
    /// abortively — a reset, and the kernel discards what it had not sent — so nothing of a
    /// request reported as flushed leaves this process afterwards.
    fn go_to_error(&mut self, round: &mut Round<'_>) {
        self.doom = None;
        self.judged = 0;
        self.head_sent = 0;
        self.read_data = None;
        self.replies.clear();
        if let Some(stream) = self.stream.take() {
            round.epoll.remove(stream.as_raw_fd());
            sys::close_abortively(stream);
        }
        let num = self.num;
        let flushed: Vec<_> = self
            .inflight
            .drain(..)
            .chain(self.queued.drain(..))
            .collect();
        for queued in flushed {
            let completion = WorkCompletion::of(&queued.request, num, WcStatus::WrFlushErr);
            self.delayed.emit(completion, round.now, round.cq);
        }
    }
}

impl Drop for Initiator {
    /// A queue pair still live when its fabric is dropped (the poller stopped) closes
    /// abortively too: its requests are about to be reported, so nothing the kernel still
    /// held may go out.
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            sys::close_abortively(stream);
        }
    }
}

impl Served {
    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The target queue pair's owner closed it: nothing more of this connection executes.
    fn owner_gone(&self) -> bool {
        // Acquire: pairs with the owner's Release when it drops its handle, so what the owner
        // did before (a queue pair that replaced this one) is ordered after this check.
        matches!(&self.role, Role::Target(link) if link.shared.dropped.load(Ordering::Acquire))
    }

    /// Sends queued replies, then reads requests; true when anything moved.
    fn serve(&mut self, io: &mut ServeIo<'_>) -> bool {
        let now = io.now;
        // A hung-up initiator has reported everything outstanding as flushed: what its
        // kernel still buffers here is not executed (the reset may even have dropped the
        // replies' way back).
        if self.owner_gone() || self.hung_up {
            self.closed = true;
            return true;
        }
        if let Role::Hello { deadline, .. } = self.role {
            if now >= deadline {
                self.closed = true;
                return true;
            }
        }
        let mut moved = self.send_replies(io);
        if let Incoming::Stopped { deadline } = self.incoming {
            // Nothing more is read; the close waits until the replies (the error last) have
            // reached the peer, as a close with unread input resets the connection and would
            // discard any the kernel still held.
            if !self.closed && self.replies.is_empty() && (self.delivered() || now >= deadline) {
                self.closed = true;
                moved = true;
            }
            return moved;
        }
        let waiting_immediate = matches!(self.incoming, Incoming::Immediate { .. });
        // A header read whole behind the last payload is in our buffer, not the socket:
        // epoll will not report it.
        let header_buffered =
            matches!(self.incoming, Incoming::Header) && self.header_got == REQUEST_LEN;
        if (self.readable || waiting_immediate || header_buffered) && !self.closed {
            self.readable = false;
            moved |= self.read(io);
            // Replies to what was just read go out in this round.
            moved |= self.send_replies(io);
        }
        moved
    }

    /// Whether the peer has acknowledged every byte sent (or the socket cannot say).
    fn delivered(&self) -> bool {
        sys::unacknowledged(self.fd()).map_or(true, |bytes| bytes == 0)
    }

    /// Sends queued replies, READ data straight from its region, until the socket is full or
    /// the budget is spent.
    fn send_replies(&mut self, io: &mut ServeIo<'_>) -> bool {
        let mut moved = false;
        while !self.replies.is_empty() && *io.budget > 0 && !self.closed {
            if self.owner_gone() {
                self.closed = true;
                return true;
            }
            // READ data goes out only from a region still registered, checked right before
            // each send: the replies up to the first whose region was withdrawn.
            let sendable = self
                .replies
                .iter()
                .take(REQUESTS_PER_SEND)
                .enumerate()
                .take_while(|&(index, reply)| {
                    let skip = if index == 0 { self.reply_sent } else { 0 };
                    let data_skip = skip.saturating_sub(REPLY_LEN);
                    reply.data_len <= data_skip
                        || still_registered(
                            io.device,
                            reply.request.rkey,
                            Access::REMOTE_READ,
                            reply.data_addr + data_skip as u64,
                            (reply.data_len - data_skip) as u64,
                        )
                })
                .count();
            if sendable == 0 {
                self.withdraw_front_read(io);
                moved = true;
                continue;
            }
            let iov = &mut *io.iov;
            iov.clear();
            for (index, reply) in self.replies.iter().take(sendable).enumerate() {
                let skip = if index == 0 { self.reply_sent } else { 0 };
                if skip < REPLY_LEN {
                    iov.push(libc::iovec {
                        iov_base: reply.header[skip..].as_ptr().cast_mut().cast(),
                        iov_len: REPLY_LEN - skip,
                    });
                }
                let data_skip = skip.saturating_sub(REPLY_LEN);
                if reply.data_len > data_skip {
                    iov.push(libc::iovec {
                        iov_base: (reply.data_addr + data_skip as u64) as *mut _,
                        iov_len: reply.data_len - data_skip,
                    });
                }
            }
            // SAFETY: headers live in `replies`, untouched until the call returns; READ data
            // lies inside registrations of this process allowing remote reads, found live
            // just now; registered memory stays valid for reads until its withdrawal is
            // followed by the end of this poller's round (the engine's deregistration waits
            // for that, see the module docs).
            let result = unsafe { sys::send_vectored(self.fd(), iov) };
            iov.clear();
            let sent = match result {
                Ok(sent) => sent,
                Err(error) if would_block(&error) => return moved,
                Err(_) => {
                    self.closed = true;
                    return true;
                }
            };
            moved = true;
            *io.budget = io.budget.saturating_sub(sent);
            account_sent(
                &mut self.replies,
                &mut self.reply_sent,
                sent,
                Reply::wire_len,
                drop,
            );
        }
        moved
    }

    /// The front reply's READ data lies in a region withdrawn since the READ was checked.
    /// If nothing of the reply went out, it becomes a REM_ACCESS_ERR answer, the replies after
    /// it are dropped (the initiator flushes what follows an error) and the connection stops.
    /// If its header went out, it promised data that will never come: the connection closes
    /// at once (the initiator sees it break).
    fn withdraw_front_read(&mut self, io: &ServeIo<'_>) {
        let Some(front) = self.replies.front().copied() else {
            return;
        };
        if self.reply_sent > 0 {
            self.closed = true;
            return;
        }
        self.replies.clear();
        self.refuse(front.request, WcStatus::RemAccessErr, io);
    }

    /// Reads the hello, requests and payloads until the socket is empty, the budget is
    /// spent, the initiator stops reading replies, or an error stops the connection.
    fn read(&mut self, io: &mut ServeIo<'_>) -> bool {
        let mut moved = false;
        while *io.budget > 0
            && !self.closed
            && self.replies.len() < MAX_QUEUED_REPLIES
            && !matches!(self.incoming, Incoming::Stopped { .. })
        {
            // Before every request, payload chunk or immediate.
            if self.owner_gone() {
                self.closed = true;
                return true;
            }
            let result = match self.role {
                Role::Hello { .. } => self.read_hello(io.device, io.sink),
                Role::Sink { .. } => self.read_sink(io.sink, *io.budget),
                Role::Target(_) => self.read_request(io),
            };
            match result {
                Ok(0) => {
                    self.closed = true;
                    return true;
                }
                Ok(got) => {
                    moved = true;
                    *io.budget = io.budget.saturating_sub(got);
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => return moved,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.closed = true;
                    return true;
                }
            }
        }
        moved
    }

    /// Reads the hello; once whole, becomes what it asks for (a target queue pair only if
    /// its token is pending on this device; a sink only if the device accepts them) or is
    /// closed, having allocated nothing.
    fn read_hello(&mut self, device: &TcpDevice, sink: &mut Vec<u8>) -> io::Result<usize> {
        let fd = self.fd();
        let Role::Hello { bytes, got, .. } = &mut self.role else {
            return Ok(0);
        };
        let at = *got;
        // SAFETY: `bytes[at..]` is writable.
        let read = unsafe { sys::recv_into(fd, bytes[at..].as_mut_ptr() as u64, HELLO_LEN - at) }?;
        *got += read;
        if *got < HELLO_LEN {
            return Ok(read);
        }
        match Hello::decode(bytes) {
            Ok(Hello::Sink) if device.config().accept_sinks => {
                if sink.is_empty() {
                    // Written once, so that no page faults in while a stream is timed.
                    *sink = vec![1; SINK_BUFFER];
                }
                self.role = Role::Sink { at: 0 };
            }
            Ok(Hello::QueuePair { token }) => match device.pending().remove(&token) {
                Some(link) => self.role = Role::Target(Box::new(link)),
                None => self.closed = true,
            },
            Ok(Hello::Sink) | Err(_) => self.closed = true,
        }
        Ok(read)
    }

    /// Receives raw bytes into the sink's buffer, where the last receive ended.
    fn read_sink(&mut self, buffer: &mut [u8], budget: usize) -> io::Result<usize> {
        let fd = self.fd();
        let Role::Sink { at } = &mut self.role else {
            return Ok(0);
        };
        let len = (buffer.len() - *at).min(budget);
        // SAFETY: `buffer[at..at + len]` is writable.
        let got = unsafe { sys::recv_into(fd, buffer[*at..].as_mut_ptr() as u64, len) }?;
        *at = (*at + got) % buffer.len();
        Ok(got)
    }

    /// Checks a request's header against the live region table and starts it.
    fn start(&mut self, header: RequestHeader, io: &ServeIo<'_>) {
        let len = u64::from(header.len);
        if header.len > MAX_MESSAGE {
            self.closed = true;
            return;
        }
        let needed = match header.op {
            RequestOp::Read => Access::REMOTE_READ,
            RequestOp::Write | RequestOp::WriteWithImm => Access::REMOTE_WRITE,
        };
        // A zero-length request names no memory: no key is checked (as in verbs).
        let allowed =
            len == 0 || still_registered(io.device, header.rkey, needed, header.remote_addr, len);
        self.incoming = Incoming::Header;
        match header.op {
            // A refused WRITE's payload is never read: the connection stops here.
            _ if !allowed => self.refuse(header, WcStatus::RemAccessErr, io),
            RequestOp::Read => {
                io.device.served_counters().read(header.len);
                self.replies.push_back(Reply {
                    header: ReplyHeader {
                        status: WcStatus::Success,
                        len: header.len,
                        wr_id: header.wr_id,
                    }
                    .encode(),
                    request: header,
                    data_addr: header.remote_addr,
                    data_len: header.len as usize,
                });
            }
            _ if len == 0 => self.applied(header, io.device.served_counters()),
            _ => {
                self.incoming = Incoming::Payload {
                    addr: header.remote_addr,
                    left: header.len as usize,
                    header,
                };
            }
        }
    }

    /// A WRITE's payload is in place: deliver its immediate (or wait for room), answer.
    fn applied(&mut self, header: RequestHeader, served: &ServedCounters) {
        if header.op == RequestOp::WriteWithImm {
            let Role::Target(link) = &mut self.role else {
                return;
            };
            if link.immediates.push(header.imm).is_err() {
                self.incoming = Incoming::Immediate { header };
                return;
            }
        }
        self.incoming = Incoming::Header;
        served.wrote(header.len);
        self.answer(header, WcStatus::Success);
    }

    /// Answers `header` with the error `status` and stops the connection: a target that saw
    /// an error executes nothing more from it, since the initiator flushes everything after.
    fn refuse(&mut self, header: RequestHeader, status: WcStatus, io: &ServeIo<'_>) {
        self.answer(header, status);
        self.incoming = Incoming::Stopped {
            deadline: io.now + io.device.config().peer_timeout,
        };
    }

    /// Queues the reply to a request that carries no data back.
    fn answer(&mut self, header: RequestHeader, status: WcStatus) {
        self.replies.push_back(Reply {
            header: ReplyHeader {
                status,
                len: if status == WcStatus::Success {
                    header.len
                } else {
                    0
                },
                wr_id: header.wr_id,
            }
            .encode(),
            request: header,
            data_addr: 0,
            data_len: 0,
        });
    }

    /// The header buffer holds a whole request header: decode it and start its request.
    fn take_header(&mut self, io: &ServeIo<'_>) {
        self.header_got = 0;
        match RequestHeader::decode(&self.header) {
            Ok(header) => self.start(header, io),
            Err(_) => self.closed = true,
        }
    }

    /// One step of the current request: `Ok(bytes)` moved (a completed step with no bytes,
    /// such as delivering an immediate or refusing a chunk, counts as 1), `WouldBlock` to
    /// stop.
    fn read_request(&mut self, io: &mut ServeIo<'_>) -> io::Result<usize> {
        let fd = self.fd();
        match self.incoming {
            Incoming::Header => {
                let at = self.header_got;
                if at == REQUEST_LEN {
                    // Read whole behind the previous payload.
                    self.take_header(io);
                    return Ok(1);
                }
                // SAFETY: `header[at..]` is writable.
                let got = unsafe {
                    sys::recv_into(fd, self.header[at..].as_mut_ptr() as u64, REQUEST_LEN - at)
                }?;
                self.header_got += got;
                if got > 0 && self.header_got == REQUEST_LEN {
                    self.take_header(io);
                }
                Ok(got)
            }
            Incoming::Payload { addr, left, header } => {
                if !still_registered(
                    io.device,
                    header.rkey,
                    Access::REMOTE_WRITE,
                    addr,
                    left as u64,
                ) {
                    // Withdrawn while the payload arrives: what came stays, nothing more is
                    // written there.
                    self.refuse(header, WcStatus::RemAccessErr, io);
                    return Ok(1);
                }
                // The rest of the payload, and the next request's header behind it in the
                // same receive: one system call per request where the bytes are there, not
                // two. (The header buffer is free: its request is this one, decoded.)
                debug_assert_eq!(self.header_got, 0);
                // SAFETY: `[addr, addr + left)` lies inside a registration of this process
                // allowing remote writes, found live just now; registered memory stays valid
                // for writes until its withdrawal is followed by the end of this poller's
                // round (the engine's deregistration waits for that, see the module docs).
                // `header` is writable.
                let got = unsafe {
                    sys::recv_into_both(
                        fd,
                        (addr, left),
                        (self.header.as_mut_ptr() as u64, REQUEST_LEN),
                    )
                }?;
                if got >= left {
                    // A header read whole is started by the next step, after the checks
                    // every request gets (its owner, the reply queue).
                    self.header_got = got - left;
                    self.applied(header, io.device.served_counters());
                } else if got > 0 {
                    self.incoming = Incoming::Payload {
                        addr: addr + got as u64,
                        left: left - got,
                        header,
                    };
                }
                Ok(got)
            }
            Incoming::Immediate { header } => {
                self.applied(header, io.device.served_counters());
                if matches!(self.incoming, Incoming::Immediate { .. }) {
                    Err(ErrorKind::WouldBlock.into())
                } else {
                    Ok(1)
                }
            }
            // `read` never asks: a stopped connection reads nothing more.
            Incoming::Stopped { .. } => Err(ErrorKind::WouldBlock.into()),
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
        let now = Instant::now();
        if !initiator.live() {
            for request in requests {
                let flushed = WorkCompletion::of(request, qp, WcStatus::WrFlushErr);
                initiator.delayed.emit(flushed, now, &mut self.completions);
            }
            return Ok(());
        }
        if !initiator.outstanding() {
            initiator.last_progress = now;
        }
        let room = depth.saturating_sub(initiator.queued.len() + initiator.inflight.len());
        initiator
            .queued
            .extend(requests.iter().take(room).map(|request| {
                Queued {
                    request: *request,
                    header: RequestHeader {
                        op: match request.opcode {
                            Opcode::Write => RequestOp::Write,
                            Opcode::WriteWithImm => RequestOp::WriteWithImm,
                            Opcode::Read => RequestOp::Read,
                        },
                        len: request.len,
                        wr_id: request.wr_id.0,
                        remote_addr: request.remote_addr,
                        rkey: request.rkey,
                        imm: request.imm,
                    }
                    .encode(),
                    delay: Duration::ZERO,
                }
            }));
        if requests.len() > room {
            return Err(PostError {
                posted: room,
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
        self.initiators
            .retain(|_, i| !(i.retired && i.delayed.is_empty()));
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
