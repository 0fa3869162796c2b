//! The target's side of a connection the TCP fabric accepted: what its hello makes it, which
//! requests it applies to this rail's memory, and how it answers them.
//!
//! Each served connection reads a request header, checks it against the live region
//! table, receives a WRITE's payload straight into the region (checking the key again before
//! every chunk), delivers a WRITE_WITH_IMM's immediate to the [`TcpTarget`](super::TcpTarget)
//! owner (waiting while its queue is full, as a receiver-not-ready), and queues the reply;
//! READ data is sent straight from the region (checked again before every send). A refused
//! request is answered with REM_ACCESS_ERR and stops the connection: nothing more is read
//! from it, and it closes once its replies are delivered. A connection whose owner closed the
//! queue pair closes before the next request, chunk or reply.

use std::collections::VecDeque;
use std::io::{self, ErrorKind};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::connection::{
    MAX_MESSAGE, REQUESTS_PER_SEND, account_sent, still_registered, would_block,
};
use super::device::TcpDevice;
use super::link::TargetLink;
use super::stats::ServedCounters;
use super::sys;
use super::wire::{
    HELLO_LEN, Hello, REPLY_LEN, REQUEST_LEN, ReplyHeader, RequestHeader, RequestOp,
};
use crate::fabric::{Access, WcStatus};

/// Replies a target queues before it stops reading requests (the initiator is not reading).
const MAX_QUEUED_REPLIES: usize = 4096;

/// A sink's buffer: as large as a big request, so that a raw stream lands in memory as
/// cold as the fabric's destinations, not in one cache-resident block.
const SINK_BUFFER: usize = 64 << 20;

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
pub(super) struct Served {
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
    /// Epoll found the connection readable since the last round served it.
    pub(super) readable: bool,
    /// The initiator reset or closed the connection: whatever it had sent and the kernel
    /// still buffers is not executed (the initiator has reported it flushed).
    pub(super) hung_up: bool,
    /// Done with: the fabric drops it, which closes the socket.
    pub(super) closed: bool,
    /// Its place in the order connections were accepted, and when.
    accepted: (u64, Instant),
}

/// What one round's served connections share.
pub(super) struct ServeIo<'a> {
    pub(super) device: &'a TcpDevice,
    pub(super) sink: &'a mut Vec<u8>,
    pub(super) iov: &'a mut Vec<libc::iovec>,
    pub(super) budget: &'a mut usize,
    pub(super) now: Instant,
}

impl Served {
    /// A connection just accepted — the `accepted.0`th, at `accepted.1` — which must say
    /// its hello before `hello_deadline`.
    pub(super) fn new(
        stream: TcpStream,
        hello_deadline: Instant,
        accepted: (u64, Instant),
    ) -> Self {
        Self {
            stream,
            role: Role::Hello {
                bytes: [0; HELLO_LEN],
                got: 0,
                deadline: hello_deadline,
            },
            header: [0; REQUEST_LEN],
            header_got: 0,
            incoming: Incoming::Header,
            replies: VecDeque::new(),
            reply_sent: 0,
            readable: true,
            hung_up: false,
            closed: false,
            accepted,
        }
    }

    /// When (in accept order, and in time) a connection bound to no queue pair was
    /// accepted: one still waiting for its hello, or a raw stream (a sink hello proves
    /// nothing); `None` for a target queue pair's.
    pub(super) fn unbound_since(&self) -> Option<(u64, Instant)> {
        match self.role {
            Role::Hello { .. } | Role::Sink { .. } => Some(self.accepted),
            Role::Target(_) => None,
        }
    }

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
    pub(super) fn serve(&mut self, io: &mut ServeIo<'_>) -> bool {
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
            // for that, see the `tcp` module docs).
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
                // round (the engine's deregistration waits for that, see the `tcp` module docs).
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
