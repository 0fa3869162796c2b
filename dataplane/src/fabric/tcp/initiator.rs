//! The initiator's side of a TCP queue pair: which posted requests go out and when, what the
//! replies mean, and how each request completes.
//!
//! `post` queues work requests; each round judges the next ones (fault plan, then
//! the local key and range), sends as many as the socket takes in one vectored send (headers
//! and WRITE payloads straight from registered memory, their local keys checked again right
//! before), and reads exactly the reply headers it expects — never into a READ's data, which
//! is received straight into its destination (its key checked again before every receive).
//! A request the fault plan or a local check fails stops the sending; once everything before
//! it is answered, it completes with its status and the queue pair goes to ERR, which closes
//! the connection abortively (nothing the kernel still held goes out).

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::connection::{
    MAX_MESSAGE, REQUESTS_PER_SEND, account_sent, still_registered, would_block,
};
use super::device::TcpDevice;
use super::sys::{self, Epoll};
use super::wire::{HELLO_LEN, REPLY_LEN, REQUEST_LEN, ReplyHeader, RequestHeader, RequestOp};
use crate::fabric::delayed::DelayedCompletions;
use crate::fabric::faults::{FaultPlan, QpFaultState, Verdict};
use crate::fabric::{Access, AsyncEvent, Opcode, QpNum, WcStatus, WorkCompletion, WorkRequest};

/// Reply headers read in one receive at most.
const REPLIES_PER_RECEIVE: usize = 256;

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
pub(super) struct Initiator {
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
    /// Epoll found the connection readable since the last step.
    pub(super) readable: bool,
    /// `retire`d: gone once its delayed completions are out.
    pub(super) retired: bool,
}

/// What one round's initiators share.
pub(super) struct Round<'a> {
    pub(super) plan: &'a FaultPlan,
    pub(super) device: &'a TcpDevice,
    pub(super) epoll: &'a Epoll,
    pub(super) cq: &'a mut VecDeque<WorkCompletion>,
    pub(super) events: &'a mut VecDeque<AsyncEvent>,
    pub(super) iov: &'a mut Vec<libc::iovec>,
    pub(super) now: Instant,
}

impl Initiator {
    /// A queue pair adopted with its connection (perhaps still being set up) and the hello
    /// to send first.
    pub(super) fn new(
        num: QpNum,
        stream: TcpStream,
        hello: [u8; HELLO_LEN],
        faults: QpFaultState,
    ) -> Self {
        Self {
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
            faults,
            readable: false,
            retired: false,
        }
    }

    /// Queues `requests` while fewer than `depth` are outstanding; in ERR, flushes them all.
    /// Returns how many it took (all of them, or the room there was).
    pub(super) fn post(
        &mut self,
        requests: &[WorkRequest],
        depth: usize,
        now: Instant,
        cq: &mut VecDeque<WorkCompletion>,
    ) -> usize {
        if !self.live() {
            for request in requests {
                let flushed = WorkCompletion::of(request, self.num, WcStatus::WrFlushErr);
                self.delayed.emit(flushed, now, cq);
            }
            return requests.len();
        }
        if !self.outstanding() {
            self.last_progress = now;
        }
        let room = depth.saturating_sub(self.queued.len() + self.inflight.len());
        self.queued
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
        requests.len().min(room)
    }

    /// Retired, and its delayed completions are out: the fabric forgets it.
    pub(super) fn finished(&self) -> bool {
        self.retired && self.delayed.is_empty()
    }

    /// The connection's descriptor, or -1 once it is closed: every system call refuses that
    /// (EBADF), where a stale number could name a descriptor the process opened since.
    fn fd(&self) -> RawFd {
        self.stream.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// Not in ERR: the connection is open.
    pub(super) fn live(&self) -> bool {
        self.stream.is_some()
    }

    fn outstanding(&self) -> bool {
        !self.inflight.is_empty() || !self.queued.is_empty()
    }

    /// Sends, receives, resolves a doomed head, times out; true when anything moved.
    pub(super) fn step(&mut self, round: &mut Round<'_>, budget: &mut usize) -> bool {
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
            // deregistration waits for that, see the `tcp` module docs): for the whole call.
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
                // round (the engine's deregistration waits for that, see the `tcp` module docs).
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
    pub(super) fn go_to_error(&mut self, round: &mut Round<'_>) {
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
