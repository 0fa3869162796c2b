//! The control thread's I/O driver: owns the handshake listener, the TCP connections
//! (non-blocking, polled with `poll(2)`), the rings to and from the pollers and the
//! application's request channel, and feeds what happens on them to the sans-IO
//! [`Core`], carrying out the [`Action`]s it answers with.
//!
//! It also enforces what one connection may cost: input is decoded one bounded frame at a
//! time ([`FrameDecoder::room`]), a frame must finish within [`Policy::frame_timeout`],
//! output a peer does not read is capped at [`Policy::max_queued_output`], and the
//! listener is left alone — not polled, so the thread does not spin — while the core is at
//! its connection caps or the process has run out of file descriptors.
//!
//! Notifications and immediates that wait for a batch live here too: they are released to
//! the core (bytes) or posted through this thread's own rings to the pollers (immediates)
//! once the batch has completed.
//!
//! [`Policy::frame_timeout`]: crate::policy::Policy::frame_timeout
//! [`Policy::max_queued_output`]: crate::policy::Policy::max_queued_output

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::Opcode;
use railyard_dataplane::ring::Consumer;
use railyard_dataplane::{Batch, EndpointId, Event, PollerHandle, SliceSpec, Submitter};

use crate::endpoint::Incarnation;
use crate::error::ControlError;
use crate::handshake::{Action, ConnId, Core, PeerChange};
use crate::policy::Policy;
use crate::rail::{RailFabric, Revocation};
use crate::session::{FrameOpener, FrameSealer};
use crate::shared::{ControlShared, EndpointView, bump, bump_by};
use crate::warn::{DirectoryWarning, WarningKind, control_warning};
use crate::wire::{FrameDecoder, MAX_BODY, MAX_HELLO_BODY, Message, WireError};

/// What the application asks of the control thread.
pub(crate) enum Request {
    Connect {
        addr: SocketAddr,
        local_rail: u16,
        remote_rail: u16,
        reply: Sender<Result<Arc<EndpointView>, ControlError>>,
    },
    Retire {
        rail: u16,
        id: EndpointId,
    },
    Notify {
        addr: SocketAddr,
        target: Incarnation,
        bytes: Vec<u8>,
        after: Option<Batch>,
    },
    Signal {
        views: Vec<Arc<EndpointView>>,
        imm: u32,
        after: Batch,
    },
    PeerChanged {
        name: String,
        change: PeerChange,
    },
    Revoke {
        peer: Incarnation,
        reply: Sender<Vec<Revocation>>,
    },
    RefreshDescriptor {
        addr: SocketAddr,
        peer: Incarnation,
    },
    DirectoryWarning(DirectoryWarning),
    Shutdown,
}

/// Longest the control thread sleeps while it polls something: pollers' events, the
/// immediates of passive queue pairs and batch completions have no descriptor to wait on.
const TICK: Duration = Duration::from_millis(1);

/// Longest it sleeps when there is nothing to poll for but poller events ([`Core::polls`]
/// is false): sockets and the application's requests wake it at once, and a poller's report
/// of a failed queue pair waits at most this long. Hundreds of engines on one host would
/// otherwise spend its cores waking each other.
const IDLE_TICK: Duration = Duration::from_millis(10);

/// How long the listener is left alone after the process ran out of file descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Bytes read from one connection per round, so that one busy peer cannot starve others.
const READ_BUDGET: usize = 256 * 1024;

/// TCP keepalive on every control connection: a peer whose host died without a reset (a
/// half-open connection) is closed by the kernel after about 10 s + 3 × 2 s of silence
/// instead of holding a connection slot forever.
fn keep_alive(stream: &TcpStream) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(2))
        .with_retries(3);
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive);
}

/// A notification waiting for its batch.
struct HeldNotification {
    addr: SocketAddr,
    target: Incarnation,
    bytes: Vec<u8>,
    after: Batch,
}

/// One TCP connection's I/O state.
struct Socket {
    stream: TcpStream,
    decoder: FrameDecoder,
    /// Frames queued; `out[sent..]` is still to be written.
    out: Vec<u8>,
    sent: usize,
    /// The application's notifications, encoded, waiting for `out` to drain below half
    /// its bound, and the bytes they hold.
    notifications: VecDeque<Vec<u8>>,
    notification_bytes: usize,
    /// A non-blocking connect still in progress.
    connecting: bool,
    /// `poll` reported it readable (or closed) since it was last read.
    readable: bool,
    /// Since when part of a frame has been buffered.
    partial_since: Option<Instant>,
    /// Since when queued output has waited without a byte taken.
    stalled_since: Option<Instant>,
    /// The process has a cluster secret and the peer has not proven it yet: frames stay as
    /// small as a Hello, and decoding pauses after an Auth until the core has checked it
    /// (without a secret, frames may grow after the first).
    awaiting_proof: bool,
    /// Seals every frame queued from this side's Auth on ([`crate::session`]).
    sealer: Option<FrameSealer>,
    /// Opens the peer's frames once its proof is accepted (then it moves to the decoder).
    opener: Option<FrameOpener>,
}

/// The control thread. See the module docs.
pub(crate) struct Driver<F: RailFabric> {
    core: Core<F>,
    policy: Policy,
    shared: Arc<ControlShared>,
    pollers: Vec<Arc<PollerHandle>>,
    events: Vec<Consumer<Event>>,
    listener: TcpListener,
    requests: Receiver<Request>,
    wake: UnixStream,
    sockets: HashMap<ConnId, Socket>,
    /// The listener is left alone until then (the process ran out of descriptors).
    accept_paused_until: Option<Instant>,
    /// The core was at a connection cap in the last round.
    at_cap: bool,
    /// ConnectQps the core had not answered at the end of this turn.
    handshakes_waiting: usize,
    held_notifications: Vec<HeldNotification>,
    /// Immediates waiting for their batch.
    held_signals: Vec<(Vec<Arc<EndpointView>>, u32, Batch)>,
    /// Immediates posted, waiting for their own completion (to count them).
    signals_in_flight: Vec<Batch>,
    /// This thread's rings to the pollers, for immediates.
    signals: Submitter,
    /// The `engine` field of its warnings (the segment name).
    engine: String,
}

/// What the driver is built from.
pub(crate) struct DriverParts {
    pub(crate) policy: Policy,
    pub(crate) shared: Arc<ControlShared>,
    pub(crate) pollers: Vec<Arc<PollerHandle>>,
    pub(crate) events: Vec<Consumer<Event>>,
    pub(crate) listener: TcpListener,
    pub(crate) requests: Receiver<Request>,
    pub(crate) wake: UnixStream,
    pub(crate) signals: Submitter,
    pub(crate) engine: String,
}

impl<F: RailFabric> Driver<F> {
    pub(crate) fn new(core: Core<F>, parts: DriverParts) -> Self {
        Self {
            core,
            policy: parts.policy,
            shared: parts.shared,
            pollers: parts.pollers,
            events: parts.events,
            listener: parts.listener,
            requests: parts.requests,
            wake: parts.wake,
            sockets: HashMap::new(),
            accept_paused_until: None,
            at_cap: false,
            handshakes_waiting: 0,
            held_notifications: Vec::new(),
            held_signals: Vec::new(),
            signals_in_flight: Vec::new(),
            signals: parts.signals,
            engine: parts.engine,
        }
    }

    /// Runs until [`Request::Shutdown`] or the application's handle is dropped.
    pub(crate) fn run(mut self) {
        loop {
            let now = Instant::now();
            if !self.take_requests(now) {
                self.core.say_goodbye();
                self.carry_out(now);
                self.flush(now);
                return;
            }
            self.accept(now);
            self.service(now);
            // A bounded number per turn: accepts and keepalives never wait behind a burst.
            self.core
                .answer_handshakes(self.policy.max_handshakes_per_target.max(1));
            self.handshakes_waiting = self.core.handshakes_unanswered();
            self.take_poller_events(now);
            self.core.tick(now);
            self.release_notifications(now);
            self.release_signals();
            self.carry_out(now);
            self.flush(now);
            self.sleep(now);
        }
    }

    /// Applies application requests; `false` on shutdown.
    fn take_requests(&mut self, now: Instant) -> bool {
        let mut drain = [0u8; 64];
        while matches!((&self.wake).read(&mut drain), Ok(n) if n > 0) {}
        loop {
            let request = match self.requests.try_recv() {
                Ok(request) => request,
                Err(std::sync::mpsc::TryRecvError::Empty) => return true,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return false,
            };
            match request {
                Request::Shutdown => return false,
                Request::Retire { rail, id } => self.core.retire(rail, id, now),
                Request::Notify {
                    addr,
                    target,
                    bytes,
                    after,
                } => match after {
                    Some(after) => self.held_notifications.push(HeldNotification {
                        addr,
                        target,
                        bytes,
                        after,
                    }),
                    None => self.core.notify(addr, target, bytes, now),
                },
                Request::Signal { views, imm, after } => {
                    self.held_signals.push((views, imm, after));
                }
                Request::PeerChanged { name, change } => self.core.peer_changed(&name, change, now),
                Request::Revoke { peer, reply } => {
                    let _ = reply.send(self.core.revoke(peer));
                }
                Request::RefreshDescriptor { addr, peer } => {
                    self.core.refresh_descriptor(addr, peer);
                }
                Request::DirectoryWarning(warning) => control_warning!(
                    self.shared,
                    self.engine,
                    WarningKind::Directory,
                    directory = %warning.directory,
                    peer = warning.peer.as_deref(),
                    incarnation = warning.incarnation.map(tracing::field::display),
                    reason = warning.reason.as_deref(),
                    "{}",
                    warning.message
                ),
                Request::Connect {
                    addr,
                    local_rail,
                    remote_rail,
                    reply,
                } => self.core.connect(addr, local_rail, remote_rail, reply, now),
            }
            self.carry_out(now);
        }
    }

    /// Carries out the core's actions, in order.
    fn carry_out(&mut self, now: Instant) {
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Dial { conn, addr } => self.dial(conn, addr, now),
                Action::Send { conn, message } => self.queue(conn, &message, now),
                Action::Protect { conn, keys } => {
                    if let Some(socket) = self.sockets.get_mut(&conn) {
                        let (sealer, opener) = keys.split();
                        socket.sealer = Some(sealer);
                        socket.opener = Some(opener);
                    }
                }
                Action::Close { conn } => {
                    if let Some(mut socket) = self.sockets.remove(&conn) {
                        bump_by(
                            &self.shared.counters.notifications_dropped,
                            socket.notifications.len(),
                        );
                        // Best effort: a refusal or Bye queued before the close goes out.
                        if !socket.connecting && socket.queued() > 0 {
                            let _ = socket.stream.write(&socket.out[socket.sent..]);
                        }
                    }
                }
                Action::Command { rail, command } => {
                    if let Some(poller) = self.pollers.get(usize::from(rail)) {
                        let _ = poller.send(command);
                    }
                }
                Action::AddEndpoint { rail, view, epoch } => {
                    if let Some(poller) = self.pollers.get(usize::from(rail)) {
                        let _ = poller.send(railyard_dataplane::Command::AddEndpoint {
                            endpoint: view.id,
                            epoch,
                        });
                    }
                    view.set_epoch(epoch);
                }
                Action::Publish {
                    view,
                    phase,
                    probation,
                } => view.publish(phase, probation),
            }
        }
    }

    /// Starts a non-blocking connect for `conn`.
    fn dial(&mut self, conn: ConnId, addr: SocketAddr, now: Instant) {
        let started = (|| {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                None,
            )?;
            socket.set_nonblocking(true)?;
            socket.set_tcp_nodelay(true)?;
            let connecting = match socket.connect(&addr.into()) {
                Ok(()) => false,
                Err(error) if error.raw_os_error() == Some(libc::EINPROGRESS) => true,
                Err(error) => return Err(error),
            };
            let stream: TcpStream = socket.into();
            keep_alive(&stream);
            let local_ip = stream.local_addr()?.ip();
            Ok((stream, connecting, local_ip))
        })();
        match started {
            Ok((stream, connecting, local_ip)) => {
                self.sockets.insert(
                    conn,
                    Socket::new(stream, connecting, self.core.proof_required()),
                );
                self.core.dialed(conn, local_ip);
            }
            Err(error) => self.core.closed(conn, &error.to_string(), now),
        }
    }

    /// Queues a frame on `conn`; a peer with more than [`Policy::max_queued_output`] of
    /// protocol frames unread is closed. The application's notifications wait in a queue of
    /// their own (up to the same bound, beyond which they are dropped and counted, never
    /// blamed on the peer) and move to the socket while less than half the bound is queued
    /// there.
    ///
    /// [`Policy::max_queued_output`]: crate::policy::Policy::max_queued_output
    fn queue(&mut self, conn: ConnId, message: &Message, now: Instant) {
        let Some(socket) = self.sockets.get_mut(&conn) else {
            if matches!(message, Message::Notify { .. }) {
                bump(&self.shared.counters.notifications_dropped);
            }
            return;
        };
        let frame = message.encode();
        let bound = self.policy.max_queued_output;
        if matches!(message, Message::Notify { .. }) {
            if socket.notification_bytes + frame.len() > bound {
                bump(&self.shared.counters.notifications_dropped);
                control_warning!(
                    self.shared,
                    self.engine,
                    WarningKind::Connection,
                    bytes = frame.len(),
                    queued = socket.notification_bytes,
                    "dropping a notification: the peer's bound of queued notifications is reached"
                );
                return;
            }
            socket.notification_bytes += frame.len();
            socket.notifications.push_back(frame);
            return;
        }
        if socket.queued() + frame.len() > bound {
            let reason = format!(
                "it does not read: {} bytes are queued for it (the bound is {bound})",
                socket.queued(),
            );
            return self.core.refuse(conn, &reason, now);
        }
        socket.push_out(frame);
    }

    /// Takes new connections while the core may accept them.
    fn accept(&mut self, now: Instant) {
        if self.accept_paused_until.is_some_and(|until| now < until) {
            return;
        }
        self.accept_paused_until = None;
        loop {
            let may_accept = self.core.may_accept(now);
            if !may_accept {
                if !self.at_cap {
                    bump(&self.shared.counters.accept_pauses);
                }
                self.at_cap = true;
                return;
            }
            self.at_cap = false;
            match self.listener.accept() {
                Ok((stream, addr)) => {
                    let local_ip = stream.local_addr().map(|local| local.ip());
                    let (Ok(()), Ok(local_ip)) = (stream.set_nonblocking(true), local_ip) else {
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    keep_alive(&stream);
                    let conn = self.core.accepted(addr, local_ip, now);
                    self.sockets
                        .insert(conn, Socket::new(stream, false, self.core.proof_required()));
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) if out_of_descriptors(&error) => {
                    bump(&self.shared.counters.accept_pauses);
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    control_warning!(
                        self.shared,
                        self.engine,
                        WarningKind::Connection,
                        reason = %error,
                        "cannot accept a connection; pausing the listener"
                    );
                    return;
                }
                // A connection reset before it was accepted, and the like.
                Err(_) => {}
            }
        }
    }

    /// Reads every connection and hands whole messages to the core.
    fn service(&mut self, now: Instant) {
        let conns: Vec<ConnId> = self.sockets.keys().copied().collect();
        for conn in conns {
            let Some(socket) = self.sockets.get_mut(&conn) else {
                continue;
            };
            let (messages, outcome, got_bytes) = if socket.readable || socket.connecting {
                socket.read(now, self.policy.frame_timeout)
            } else {
                let overdue = socket.frame_overdue(now, self.policy.frame_timeout);
                (Vec::new(), overdue, false)
            };
            if got_bytes {
                self.core.heard(conn, now);
            }
            for message in messages {
                self.core.received(conn, message, now);
            }
            // The core's answers first: a proof it accepted comes with the keys that open
            // the frames after it.
            self.carry_out(now);
            if self.core.admitted(conn) {
                let keyed = self.sockets.get_mut(&conn).is_none_or(Socket::proven);
                if !keyed {
                    self.core
                        .tampered(conn, "admitted without session keys", now);
                }
            }
            match outcome {
                ReadOutcome::Open => {}
                ReadOutcome::Closed(reason) => self.core.closed(conn, &reason, now),
                ReadOutcome::Refused(reason) => self.core.refuse(conn, &reason, now),
                ReadOutcome::Unauthentic(reason) => self.core.tampered(conn, &reason, now),
            }
            self.carry_out(now);
        }
    }

    /// Writes what is queued; a peer that takes no byte for [`Policy::frame_timeout`] while
    /// output waits is closed.
    ///
    /// [`Policy::frame_timeout`]: crate::policy::Policy::frame_timeout
    fn flush(&mut self, now: Instant) {
        let mut broken = Vec::new();
        let mut stalled = Vec::new();
        let half = self.policy.max_queued_output / 2;
        for (&conn, socket) in &mut self.sockets {
            if socket.connecting {
                continue;
            }
            bump_by(
                &self.shared.counters.notifications_sent,
                socket.admit_notifications(half),
            );
            if socket.queued() == 0 {
                continue;
            }
            match socket.stream.write(&socket.out[socket.sent..]) {
                Ok(n) => socket.wrote(n),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => broken.push((conn, error.to_string())),
            }
            if socket.queued() == 0 {
                socket.stalled_since = None;
            } else if now.duration_since(*socket.stalled_since.get_or_insert(now))
                > self.policy.frame_timeout
            {
                stalled.push(conn);
            }
        }
        for (conn, reason) in broken {
            self.core.closed(conn, &reason, now);
        }
        for conn in stalled {
            let reason = format!(
                "it does not read: nothing of its queued output was taken for {:?}",
                self.policy.frame_timeout
            );
            self.core.refuse(conn, &reason, now);
        }
        self.carry_out(now);
    }

    fn take_poller_events(&mut self, now: Instant) {
        for rail in 0..self.events.len() {
            while let Some(event) = self.events[rail].pop() {
                self.core.poller_event(rail as u16, event, now);
            }
        }
        self.carry_out(now);
    }

    /// Sends notifications whose batch has completed; drops those whose batch failed.
    fn release_notifications(&mut self, now: Instant) {
        let (complete, held): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held_notifications)
            .into_iter()
            .partition(|held| held.after.poll().is_complete());
        self.held_notifications = held;
        for released in complete {
            if released.after.poll().failed == 0 {
                self.core
                    .notify(released.addr, released.target, released.bytes, now);
            } else {
                bump(&self.shared.counters.notifications_dropped);
            }
        }
    }

    /// Posts the immediates whose batch has completed successfully (drops those whose batch
    /// failed) and counts the ones whose own write has completed.
    fn release_signals(&mut self) {
        let counters = &self.shared.counters;
        self.signals_in_flight.retain(|batch| {
            let progress = batch.poll();
            if !progress.is_complete() {
                return true;
            }
            bump(if progress.failed == 0 {
                &counters.notifications_sent
            } else {
                &counters.notifications_dropped
            });
            false
        });
        let (complete, held): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held_signals)
            .into_iter()
            .partition(|(_, _, batch)| batch.poll().is_complete());
        self.held_signals = held;
        for (views, imm, batch) in complete {
            let connected = views
                .iter()
                .enumerate()
                .find_map(|(rail, view)| view.epoch().map(|epoch| (rail, view, epoch)));
            let (true, Some((rail, view, epoch))) = (batch.poll().failed == 0, connected) else {
                bump(&counters.notifications_dropped);
                continue;
            };
            let spec = SliceSpec {
                rail,
                request: 0,
                opcode: Opcode::WriteWithImm,
                local_addr: 0,
                lkey: 0,
                remote_addr: 0,
                rkey: 0,
                len: 0,
                imm,
                endpoint: view.id,
                epoch,
                generation: 0,
            };
            match self.signals.submit_now(1, &[spec]) {
                Ok(sent) => self.signals_in_flight.push(sent),
                Err(_) => bump(&counters.notifications_dropped),
            }
        }
    }

    /// Waits for socket readiness, a wake-up, or the next tick. The listener is polled only
    /// while connections may be accepted.
    fn sleep(&mut self, now: Instant) {
        let mut fds = vec![libc::pollfd {
            fd: self.wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let accepting =
            self.core.may_accept(now) && self.accept_paused_until.is_none_or(|until| now >= until);
        if accepting {
            fds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let first_socket = fds.len();
        let mut polled = Vec::with_capacity(self.sockets.len());
        for (&conn, socket) in &self.sockets {
            let mut events = libc::POLLIN;
            if socket.connecting || socket.queued() > 0 || !socket.notifications.is_empty() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: socket.stream.as_raw_fd(),
                events,
                revents: 0,
            });
            polled.push(conn);
        }
        // ConnectQps still waiting are answered in the next turn, after a look at the sockets.
        let polling = self.core.polls()
            || self.at_cap
            || self.accept_paused_until.is_some()
            || !self.held_notifications.is_empty()
            || !self.held_signals.is_empty()
            || !self.signals_in_flight.is_empty();
        let timeout = if self.handshakes_waiting > 0 {
            0
        } else if polling {
            TICK.as_millis() as libc::c_int
        } else {
            IDLE_TICK.as_millis() as libc::c_int
        };
        // SAFETY:
        // - `fds` is a valid array of `fds.len()` pollfd structs that lives across the call;
        //   every descriptor in it is owned by this thread and open.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if ready <= 0 {
            return;
        }
        for (conn, fd) in polled.iter().zip(&fds[first_socket..]) {
            if fd.revents & !libc::POLLOUT != 0 {
                if let Some(socket) = self.sockets.get_mut(conn) {
                    socket.readable = true;
                }
            }
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

/// How a round of reading a connection ended.
enum ReadOutcome {
    /// Still open.
    Open,
    /// The peer closed it or it broke.
    Closed(String),
    /// The peer broke the protocol or a bound.
    Refused(String),
    /// A frame after the handshake failed its authentication check.
    Unauthentic(String),
}

impl Socket {
    fn new(stream: TcpStream, connecting: bool, proof_required: bool) -> Self {
        // A connection's first frame is a Hello: nothing larger is buffered before it.
        let mut decoder = FrameDecoder::default();
        decoder.set_max_body(MAX_HELLO_BODY);
        Self {
            stream,
            decoder,
            out: Vec::new(),
            sent: 0,
            notifications: VecDeque::new(),
            notification_bytes: 0,
            connecting,
            // Bytes may have arrived before the first poll.
            readable: true,
            partial_since: None,
            stalled_since: None,
            awaiting_proof: proof_required,
            sealer: None,
            opener: None,
        }
    }

    /// Decodes whole messages into `messages`; with a proof awaited, stops after an Auth
    /// (true) so that the core checks it before anything larger is buffered.
    fn decode(&mut self, messages: &mut Vec<Message>) -> Result<bool, WireError> {
        while let Some(message) = self.decoder.next_message()? {
            let auth = matches!(message, Message::Auth { .. });
            if !self.awaiting_proof {
                self.decoder.set_max_body(MAX_BODY);
            }
            messages.push(message);
            if self.awaiting_proof && auth {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The core admitted the peer: frames may be as large as any, and with a cluster secret
    /// every frame after the peer's Auth (where decoding paused) must pass the session's
    /// check.
    ///
    /// False if the peer proved the secret but this side has no keys to open its frames
    /// with (which no path of the core allows): the connection must close rather than take
    /// frames unchecked.
    fn proven(&mut self) -> bool {
        if self.awaiting_proof {
            self.awaiting_proof = false;
            self.decoder.set_max_body(MAX_BODY);
            let Some(opener) = self.opener.take() else {
                return false;
            };
            self.decoder.protect(opener);
        }
        true
    }

    /// Appends `frame` to the output, sealed if the session has begun: frames are sealed in
    /// the order they are written.
    fn push_out(&mut self, mut frame: Vec<u8>) {
        if let Some(sealer) = &mut self.sealer {
            sealer.seal(&mut frame);
        }
        self.out.extend_from_slice(&frame);
    }

    /// Moves waiting notifications to the output while less than `half` is queued there (at
    /// least one when it is empty); returns how many moved.
    fn admit_notifications(&mut self, half: usize) -> usize {
        let mut moved = 0;
        while let Some(frame) = self.notifications.front() {
            if self.queued() > 0 && self.queued() + frame.len() > half {
                break;
            }
            self.notification_bytes -= frame.len();
            if let Some(frame) = self.notifications.pop_front() {
                self.push_out(frame);
            }
            moved += 1;
        }
        moved
    }

    /// Bytes queued and not yet written.
    fn queued(&self) -> usize {
        self.out.len() - self.sent
    }

    /// `n` more bytes were written: the cursor moves, and the buffer is compacted when half
    /// of it is written (each byte is moved at most once) or released when empty.
    fn wrote(&mut self, n: usize) {
        self.sent += n;
        if n > 0 {
            self.stalled_since = None;
        }
        if self.sent == self.out.len() {
            self.out.clear();
            self.out.shrink_to(FrameDecoder::KEPT_CAPACITY);
            self.sent = 0;
        } else if self.sent > self.out.len() / 2 {
            self.out.drain(..self.sent);
            self.sent = 0;
        }
    }

    /// Reads up to [`READ_BUDGET`] bytes, one bounded frame at a time, and returns the
    /// whole messages.
    /// Also says whether any byte arrived.
    fn read(&mut self, now: Instant, frame_timeout: Duration) -> (Vec<Message>, ReadOutcome, bool) {
        let mut messages = Vec::new();
        if self.connecting {
            match self.stream.take_error() {
                Ok(None) if self.stream.peer_addr().is_ok() => self.connecting = false,
                Ok(None) => return (messages, ReadOutcome::Open, false),
                Ok(Some(error)) | Err(error) => {
                    return (messages, ReadOutcome::Closed(error.to_string()), false);
                }
            }
        }
        let malformed = |error: WireError| match error {
            WireError::Unauthentic(_) => ReadOutcome::Unauthentic(error.to_string()),
            _ => ReadOutcome::Refused(format!("malformed frame: {error}")),
        };
        // Frames left buffered when decoding paused at an Auth.
        match self.decode(&mut messages) {
            Ok(true) => {
                self.readable = true;
                return (messages, ReadOutcome::Open, false);
            }
            Ok(false) => {}
            Err(error) => return (messages, malformed(error), false),
        }
        self.readable = false;
        let mut buffer = [0u8; 16 * 1024];
        let mut budget = READ_BUDGET;
        let mut outcome = ReadOutcome::Open;
        while budget > 0 {
            let want = buffer.len().min(self.decoder.room()).min(budget);
            if want == 0 {
                break;
            }
            let read = match self.stream.read(&mut buffer[..want]) {
                Ok(0) => {
                    outcome = ReadOutcome::Closed("the peer closed the connection".into());
                    break;
                }
                Ok(n) => n,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    outcome = ReadOutcome::Closed(error.to_string());
                    break;
                }
            };
            budget -= read;
            if let Err(error) = self.decoder.push(&buffer[..read]) {
                // Unreachable: `want` is at most the decoder's room.
                return (messages, ReadOutcome::Refused(error.to_string()), true);
            }
            match self.decode(&mut messages) {
                Ok(false) => {}
                Ok(true) => {
                    // More may be buffered or waiting: read again once the core has checked
                    // the proof.
                    self.readable = true;
                    break;
                }
                Err(error) => return (messages, malformed(error), true),
            }
        }
        if !messages.is_empty() || !self.decoder.is_partial() {
            // A frame finished: the clock restarts for the one that follows.
            self.partial_since = None;
        }
        if self.decoder.is_partial() {
            self.partial_since.get_or_insert(now);
        }
        let got_bytes = budget < READ_BUDGET;
        match self.frame_overdue(now, frame_timeout) {
            ReadOutcome::Open => (messages, outcome, got_bytes),
            overdue => (messages, overdue, got_bytes),
        }
    }

    /// Whether a frame has been arriving for longer than `frame_timeout` (no system call).
    fn frame_overdue(&self, now: Instant, frame_timeout: Duration) -> ReadOutcome {
        match self.partial_since {
            Some(since) if now.duration_since(since) > frame_timeout => {
                ReadOutcome::Refused(format!("a frame did not finish within {frame_timeout:?}"))
            }
            _ => ReadOutcome::Open,
        }
    }
}
