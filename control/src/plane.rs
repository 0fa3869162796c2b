//! The control thread: one per engine. It owns the handshake listener and the dialed
//! connections (non-blocking, polled with `poll(2)`), the endpoint state machines, the
//! directory, and the passive queue pairs it answered ConnectQp with. It talks to pollers
//! only through their command and event rings, and to the application through
//! [`ControlPlane`] (a request channel plus a wake-up socket).
//!
//! # Endpoints and ids
//! Endpoints are keyed by [`EndpointKey`] (peer incarnation and rails), never by address.
//! Each gets a small [`EndpointId`] on its local rail; an id is reused only after the poller
//! reports the previous endpoint drained, and its epochs continue from the previous
//! occupant's, so a slice prepared for the old endpoint is always older than the new one:
//! the re-prepare hook ([`ControlShared::reprepare_hook`]) refuses it instead of pointing
//! it at a different peer.
//!
//! # Handshakes
//! A dialer opens one TCP connection per peer address and sends Hello and GetDescriptor,
//! then ConnectQp for each queue pair it needs; a reconnect fetches the descriptor again
//! before its ConnectQp, so slices re-prepared at the new epoch see the peer's current keys.
//! The listener answers ConnectQp idempotently: a request naming the same initiator
//! incarnation, rails and queue-pair number as the passive queue pair it already has is
//! answered with that queue pair's side and changes nothing. A Hello with a new
//! incarnation for a known name retires everything of the old incarnation
//! (`PeerRestarted`).
//!
//! # Notifications
//! Bytes go over the control connection ([`ControlPlane::notify`]). A 32-bit value can
//! instead ride the data path ([`ControlPlane::signal`]): once its batch has completed, the
//! control thread posts a zero-length WRITE_WITH_IMM through its own rings to the pollers,
//! and the target's control thread takes the immediate from the passive queue pair it owns
//! (verbs: that queue pair's receive completion queue; soft: its inbox).

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::Opcode;
use railyard_dataplane::fabric::tcp::TcpAttachment;
use railyard_dataplane::ring::Consumer;
use railyard_dataplane::rng::SplitMix64;
use railyard_dataplane::{
    Batch, Command, EndpointId, Epoch, Event, FailReason, PollerHandle, RepairCause, Reprepare,
    Slice, SliceSpec, Submitter,
};

use crate::descriptor::{RailDescriptor, RegionDescriptor, SegmentDescriptor};
use crate::directory::{Directory, P2pDirectory};
use crate::endpoint::{Endpoint, EndpointKey, Incarnation, Input, Output, Phase};
use crate::host::HostId;
use crate::policy::Policy;
use crate::rail::{PeerLink, RailFabric, Revocation};
use crate::warn::{RateLimiter, WarningKind};
use crate::wire::{FrameDecoder, Message, QpSide, WireKey};

/// How to run a control plane.
#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// This process's segment name.
    pub name: String,
    /// Where the handshake listener binds (port 0: any).
    pub listen: SocketAddr,
    /// Reconnect, flap and circuit policy.
    pub policy: Policy,
    /// Accepted connections that may be mid-handshake (before their Hello) at once; more
    /// wait in the kernel's backlog.
    pub max_handshakes: usize,
    /// Seeds every endpoint's reconnect jitter.
    pub seed: u64,
    /// The incarnation; `None` draws a random one.
    pub incarnation: Option<Incarnation>,
    /// Warning lines of one kind per [`Self::warn_window`].
    pub warn_burst: u32,
    /// See [`Self::warn_burst`].
    pub warn_window: Duration,
    /// Whether to print admitted warnings on stderr (counted either way).
    pub print_warnings: bool,
}

impl ControlConfig {
    /// Defaults for a process named `name` listening on localhost, any port.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            policy: Policy::default(),
            max_handshakes: 64,
            seed: 0,
            incarnation: None,
            warn_burst: 5,
            warn_window: Duration::from_secs(10),
            print_warnings: true,
        }
    }
}

/// Why a control-plane call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The control thread could not start.
    #[error("cannot start the control thread: {0}")]
    Thread(#[source] io::Error),
    /// The control thread has stopped.
    #[error("the control plane has stopped")]
    Stopped,
    /// The control thread did not answer within [`REPLY_WAIT`] (it is stuck).
    #[error("the control plane did not answer within {REPLY_WAIT:?}")]
    Unresponsive,
    /// No such local rail.
    #[error("rail {rail} does not exist (this process has {rails})")]
    UnknownRail {
        /// The rail asked for.
        rail: u16,
        /// How many there are.
        rails: usize,
    },
    /// The peer could not be reached or did not answer in time.
    #[error("cannot reach the peer at {addr}: {reason}")]
    Unreachable {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
}

/// An endpoint as the application and the re-prepare hook see it.
#[derive(Debug)]
pub struct EndpointView {
    /// Its id on its local rail's poller.
    pub id: EndpointId,
    /// Its key.
    pub key: EndpointKey,
    /// The peer's segment name.
    pub peer_name: String,
    /// The first epoch of this endpoint: older slices on this id were meant for a previous
    /// occupant.
    first_epoch: Epoch,
    /// The epoch whose queue pair the poller has (0: none yet).
    epoch: AtomicU64,
    phase: AtomicU8,
    descriptor: RwLock<Option<Arc<SegmentDescriptor>>>,
}

impl EndpointView {
    /// The epoch slices should be prepared for now, once a queue pair was handed over.
    pub fn epoch(&self) -> Option<Epoch> {
        match self.epoch.load(Ordering::Acquire) {
            0 => None,
            n => Some(Epoch::new(n)),
        }
    }

    /// Where the endpoint stands.
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Idle,
            1 => Phase::Connecting,
            2 => Phase::Ready,
            3 => Phase::Backoff,
            4 => Phase::CircuitOpen,
            _ => Phase::Retired,
        }
    }

    /// The peer's newest descriptor.
    pub fn descriptor(&self) -> Option<Arc<SegmentDescriptor>> {
        self.descriptor
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sleeps in 1 ms steps until the endpoint is ready or `deadline` passes.
    pub fn wait_ready(&self, deadline: Instant) -> bool {
        loop {
            if self.phase() == Phase::Ready && self.epoch().is_some() {
                return true;
            }
            if Instant::now() >= deadline || self.phase() == Phase::Retired {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn set_phase(&self, phase: Phase) {
        let code = match phase {
            Phase::Idle => 0,
            Phase::Connecting => 1,
            Phase::Ready => 2,
            Phase::Backoff => 3,
            Phase::CircuitOpen => 4,
            Phase::Retired => 5,
        };
        self.phase.store(code, Ordering::Release);
    }

    fn set_descriptor(&self, descriptor: Arc<SegmentDescriptor>) {
        *self
            .descriptor
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(descriptor);
    }
}

/// What the control plane has done, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlStats {
    /// Queue pairs this side created as dialer.
    pub active_qps: u64,
    /// Active queue pairs created after an endpoint's first (reconnects).
    pub reconnects: u64,
    /// ConnectQp requests answered by creating a passive queue pair.
    pub passive_qps: u64,
    /// Of the active and passive queue pairs, those on the TCP fabric.
    pub tcp_qps: u64,
    /// ConnectQp requests answered idempotently (same peer, same queue pair).
    pub idempotent_replies: u64,
    /// Passive queue pairs replaced or dropped, and endpoints retired: teardowns.
    pub teardowns: u64,
    /// Passive queue pairs taken out of service because their initiator retired them
    /// (RetireQp) or the application revoked their peer.
    pub passive_retired: u64,
    /// Peers seen coming back as a new incarnation.
    pub peer_restarts: u64,
    /// Circuit openings.
    pub circuit_openings: u64,
    /// ConnectQp requests refused.
    pub refused: u64,
    /// Warning lines printed.
    pub warnings_printed: u64,
    /// Warning lines suppressed by the rate limit.
    pub warnings_suppressed: u64,
    /// Notifications sent.
    pub notifications_sent: u64,
    /// Notifications not sent because the batch they rode on failed.
    pub notifications_dropped: u64,
    /// Notifications received.
    pub notifications_received: u64,
}

#[derive(Debug, Default)]
struct Counters {
    active_qps: AtomicU64,
    reconnects: AtomicU64,
    passive_qps: AtomicU64,
    tcp_qps: AtomicU64,
    idempotent_replies: AtomicU64,
    teardowns: AtomicU64,
    passive_retired: AtomicU64,
    peer_restarts: AtomicU64,
    circuit_openings: AtomicU64,
    refused: AtomicU64,
    warnings_printed: AtomicU64,
    warnings_suppressed: AtomicU64,
    notifications_sent: AtomicU64,
    notifications_dropped: AtomicU64,
    notifications_received: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Per rail: the endpoints by id, read by the re-prepare hook.
#[derive(Debug, Default)]
struct RailShared {
    endpoints: RwLock<Vec<Option<Arc<EndpointView>>>>,
}

/// What the control thread shares with pollers' re-prepare hooks and the application.
/// Create it first, give each poller its hook, then start the [`ControlPlane`] with it.
#[derive(Debug)]
pub struct ControlShared {
    rails: Vec<RailShared>,
    counters: Counters,
    regions: RwLock<(u64, Vec<RegionDescriptor>)>,
    notifications: Mutex<VecDeque<Notification>>,
}

impl ControlShared {
    /// Shared state for `rails` rails.
    pub fn new(rails: usize) -> Arc<Self> {
        Arc::new(Self {
            rails: (0..rails).map(|_| RailShared::default()).collect(),
            counters: Counters::default(),
            regions: RwLock::new((0, Vec::new())),
            notifications: Mutex::new(VecDeque::new()),
        })
    }

    /// The re-prepare hook for rail `rail`'s poller: rewrites a stale slice's rkey from the
    /// peer's newest descriptor (unless it is zero-length) and stamps the current epoch;
    /// refuses slices meant for a previous occupant of the endpoint id, or whose range the
    /// peer no longer registers.
    pub fn reprepare_hook(self: &Arc<Self>, rail: u16) -> impl Reprepare + 'static {
        let shared = self.clone();
        move |slice: &mut Slice, current: Epoch, _cause: RepairCause| {
            let view = shared
                .view(rail, slice.endpoint)
                .ok_or(FailReason::EndpointRetired)?;
            if slice.epoch.is_older_than(view.first_epoch) {
                return Err(FailReason::EndpointRetired);
            }
            if slice.len == 0 {
                // Names no memory (a bare immediate): only the epoch changes.
                slice.epoch = current;
                return Ok(());
            }
            let descriptor = view.descriptor().ok_or(FailReason::RemoteAccess)?;
            let rkey = descriptor
                .rkey_for(
                    slice.remote_addr,
                    u64::from(slice.len),
                    view.key.remote_rail,
                )
                .ok_or(FailReason::RemoteAccess)?;
            slice.rkey = rkey;
            slice.epoch = current;
            Ok(())
        }
    }

    /// The endpoint `id` of rail `rail`, while it exists: how a [`RequestFailure`]'s
    /// endpoint is named as a peer.
    ///
    /// [`RequestFailure`]: railyard_dataplane::RequestFailure
    pub fn view(&self, rail: u16, id: EndpointId) -> Option<Arc<EndpointView>> {
        self.rails
            .get(usize::from(rail))?
            .endpoints
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id.0 as usize)?
            .clone()
    }

    /// Publishes this process's regions (a new generation of its descriptor).
    pub fn set_regions(&self, regions: Vec<RegionDescriptor>) {
        let mut guard = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        guard.0 += 1;
        guard.1 = regions;
    }

    /// Takes the notifications peers sent, oldest first.
    pub fn drain_notifications(&self) -> Vec<Notification> {
        self.notifications
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect()
    }

    /// What the control plane has done so far.
    pub fn stats(&self) -> ControlStats {
        let c = &self.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ControlStats {
            active_qps: get(&c.active_qps),
            reconnects: get(&c.reconnects),
            passive_qps: get(&c.passive_qps),
            tcp_qps: get(&c.tcp_qps),
            idempotent_replies: get(&c.idempotent_replies),
            teardowns: get(&c.teardowns),
            passive_retired: get(&c.passive_retired),
            peer_restarts: get(&c.peer_restarts),
            circuit_openings: get(&c.circuit_openings),
            refused: get(&c.refused),
            warnings_printed: get(&c.warnings_printed),
            warnings_suppressed: get(&c.warnings_suppressed),
            notifications_sent: get(&c.notifications_sent),
            notifications_dropped: get(&c.notifications_dropped),
            notifications_received: get(&c.notifications_received),
        }
    }
}

/// A rail as the control plane drives it.
pub struct ControlRail<F: RailFabric> {
    /// Creates and connects its queue pairs.
    pub fabric: F,
    /// Its poller.
    pub poller: Arc<PollerHandle>,
}

enum Request {
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
    DirectoryWarning(String),
    Shutdown,
}

/// What a cluster directory learned about a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerChange {
    /// `old` was replaced by `new`, which listens at `addr`.
    Restarted {
        /// The incarnation that is gone.
        old: Incarnation,
        /// The one that replaced it.
        new: Incarnation,
        /// The new one's handshake address.
        addr: SocketAddr,
    },
    /// `incarnation` is gone and nothing replaced it.
    Gone {
        /// The incarnation that is gone.
        incarnation: Incarnation,
    },
}

/// How another thread (a cluster directory) tells the control thread about peers. Cheap to
/// clone; each call wakes the control thread.
#[derive(Clone, Debug)]
pub struct PeerEvents {
    requests: Sender<Request>,
    waker: Arc<UnixStream>,
}

impl PeerEvents {
    /// `name` changed: endpoints of an incarnation that is gone retire (`PeerRestarted` or
    /// `PeerUnavailable`), without waiting for a transport timeout.
    pub fn changed(&self, name: String, change: PeerChange) {
        self.send(Request::PeerChanged { name, change });
    }

    /// A warning about the directory, printed and counted (rate-limited) like the control
    /// plane's own.
    pub fn warn(&self, message: String) {
        self.send(Request::DirectoryWarning(message));
    }

    fn send(&self, request: Request) {
        if self.requests.send(request).is_ok() {
            let _ = (&*self.waker).write(&[1]);
        }
    }
}

/// A notification a peer sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name.
    pub from: String,
    /// The sender's incarnation.
    pub incarnation: Incarnation,
    /// What it said.
    pub body: NotificationBody,
}

/// What a notification carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotificationBody {
    /// Bytes sent on the control connection ([`ControlPlane::notify`]).
    Bytes(Vec<u8>),
    /// A 32-bit value that arrived as a WRITE_WITH_IMM's immediate on a rail
    /// ([`ControlPlane::signal`]).
    Immediate(u32),
}

/// Slots of the control thread's ring to each poller (for immediates).
const SIGNAL_RING_CAPACITY: usize = 256;

/// Notifications kept for the application before the oldest are dropped.
const NOTIFICATION_QUEUE: usize = 64 * 1024;

/// The application's handle to the control thread. Dropping it stops the thread.
pub struct ControlPlane {
    shared: Arc<ControlShared>,
    requests: Mutex<Sender<Request>>,
    waker: Arc<UnixStream>,
    local_addr: SocketAddr,
    incarnation: Incarnation,
    name: String,
    rails: Vec<RailDescriptor>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("local_addr", &self.local_addr)
            .field("incarnation", &self.incarnation)
            .finish()
    }
}

impl ControlPlane {
    /// Binds the listener and starts the control thread over `rails`.
    ///
    /// # Errors
    /// [`ControlError::Listen`] or [`ControlError::Thread`].
    pub fn start<F: RailFabric>(
        config: ControlConfig,
        rails: Vec<ControlRail<F>>,
        shared: Arc<ControlShared>,
    ) -> Result<Self, ControlError> {
        let listener = TcpListener::bind(config.listen).map_err(|source| ControlError::Listen {
            addr: config.listen,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(ControlError::Thread)?;
        let local_addr = listener.local_addr().map_err(ControlError::Thread)?;
        let incarnation = config
            .incarnation
            .unwrap_or_else(|| Incarnation(random_u64()));
        let (requests_tx, requests_rx) = mpsc::channel();
        let (waker, wake_rx) = UnixStream::pair().map_err(ControlError::Thread)?;
        waker.set_nonblocking(true).map_err(ControlError::Thread)?;
        wake_rx
            .set_nonblocking(true)
            .map_err(ControlError::Thread)?;
        let pollers: Vec<&PollerHandle> = rails.iter().map(|rail| &*rail.poller).collect();
        let signals = Submitter::new(&pollers, SIGNAL_RING_CAPACITY).map_err(|error| {
            ControlError::Thread(io::Error::other(format!(
                "cannot open rings to the pollers: {error}"
            )))
        })?;
        let events = rails
            .iter()
            .map(|rail| rail.poller.take_events())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ControlError::Thread(io::Error::other(
                    "a poller's events were already taken by another control plane",
                ))
            })?;
        let plane = Plane {
            rng: SplitMix64::new(config.seed ^ incarnation.0),
            warnings: RateLimiter::new(config.warn_window, config.warn_burst),
            config,
            incarnation,
            local_addr,
            shared: shared.clone(),
            rails,
            events,
            listener,
            requests: requests_rx,
            wake: wake_rx,
            conns: Vec::new(),
            by_addr: HashMap::new(),
            active: HashMap::new(),
            by_key: HashMap::new(),
            free_ids: Vec::new(),
            next_epochs: HashMap::new(),
            passive: HashMap::new(),
            peer_names: HashMap::new(),
            peer_hosts: HashMap::new(),
            host: HostId::this_process(),
            directory: P2pDirectory::new(),
            waiting: Vec::new(),
            pending_notifications: Vec::new(),
            pending_signals: Vec::new(),
            signals_in_flight: Vec::new(),
            signals,
            immediates: Vec::new(),
        };
        let name = plane.config.name.clone();
        let rails = plane
            .rails
            .iter()
            .map(|rail| rail.fabric.describe())
            .collect();
        let thread = std::thread::Builder::new()
            .name("railyard-control".into())
            .spawn(move || plane.run())
            .map_err(ControlError::Thread)?;
        Ok(Self {
            shared,
            requests: Mutex::new(requests_tx),
            waker: Arc::new(waker),
            local_addr,
            incarnation,
            name,
            rails,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// This process's segment descriptor as it stands (what a directory publishes).
    pub fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.name.clone(),
            incarnation: self.incarnation,
            handshake_addr: self.local_addr.to_string(),
            rails: self.rails.clone(),
            regions: self
                .shared
                .regions
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .1
                .clone(),
        }
    }

    /// A handle a cluster directory uses to report peers that restarted or left.
    pub fn peer_events(&self) -> PeerEvents {
        PeerEvents {
            requests: self
                .requests
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            waker: self.waker.clone(),
        }
    }

    /// Where the handshake listener is.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// This process's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// What the control plane has done so far.
    pub fn stats(&self) -> ControlStats {
        self.shared.stats()
    }

    fn request(&self, request: Request) -> Result<(), ControlError> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(request)
            .map_err(|_| ControlError::Stopped)?;
        let _ = (&*self.waker).write(&[1]);
        Ok(())
    }

    /// The endpoint from `local_rail` to rail `remote_rail` of the process listening at
    /// `addr`: dials it if needed, learns its incarnation and descriptor, and starts
    /// connecting a queue pair. Returns as soon as the endpoint exists (see
    /// [`EndpointView::wait_ready`]); asking again for the same peer incarnation and rails
    /// returns the same endpoint.
    ///
    /// # Errors
    /// [`ControlError::UnknownRail`], [`ControlError::Unreachable`] after the connect
    /// timeout, [`ControlError::Stopped`].
    pub fn connect(
        &self,
        addr: SocketAddr,
        local_rail: u16,
        remote_rail: u16,
    ) -> Result<Arc<EndpointView>, ControlError> {
        let (reply, answer) = mpsc::channel();
        self.request(Request::Connect {
            addr,
            local_rail,
            remote_rail,
            reply,
        })?;
        answer.recv().map_err(|_| ControlError::Stopped)?
    }

    /// Retires an endpoint: its slices fail with `EndpointRetired`.
    ///
    /// # Errors
    /// [`ControlError::Stopped`].
    pub fn retire(&self, view: &EndpointView) -> Result<(), ControlError> {
        self.request(Request::Retire {
            rail: view.key.local_rail,
            id: view.id,
        })
    }

    /// Sends `bytes` to the process listening at `addr`; with `after`, once that batch has
    /// completed successfully (its data is in place before the notification leaves), and
    /// not at all if it failed.
    ///
    /// # Errors
    /// [`ControlError::Stopped`].
    pub fn notify(
        &self,
        addr: SocketAddr,
        bytes: Vec<u8>,
        after: Option<Batch>,
    ) -> Result<(), ControlError> {
        self.request(Request::Notify { addr, bytes, after })
    }

    /// Sends `imm` to the peer of `views` (one endpoint per local rail, as connected) as the
    /// immediate of a zero-length WRITE_WITH_IMM on one of its rails, once `after` has
    /// completed successfully: posted only then, so every rail's data is in place when the
    /// peer sees it. Dropped (and counted) if the batch fails or no rail is connected.
    ///
    /// # Errors
    /// [`ControlError::Stopped`].
    pub fn signal(
        &self,
        views: Vec<Arc<EndpointView>>,
        imm: u32,
        after: Batch,
    ) -> Result<(), ControlError> {
        self.request(Request::Signal { views, imm, after })
    }

    /// Takes every target queue pair that `peer` (an initiator's incarnation) connected to
    /// this process out of service: its requests stop executing and what is buffered from
    /// it is discarded. Returns one [`Revocation`] per queue pair, to wait on; `peer` may
    /// connect again with a new handshake.
    ///
    /// # Errors
    /// [`ControlError::Stopped`]; [`ControlError::Unresponsive`] after [`REPLY_WAIT`].
    pub fn revoke(&self, peer: Incarnation) -> Result<Vec<Revocation>, ControlError> {
        let (reply, answer) = mpsc::channel();
        self.request(Request::Revoke { peer, reply })?;
        answer
            .recv_timeout(REPLY_WAIT)
            .map_err(|error| match error {
                mpsc::RecvTimeoutError::Timeout => ControlError::Unresponsive,
                mpsc::RecvTimeoutError::Disconnected => ControlError::Stopped,
            })
    }

    /// Stops the control thread (pollers keep running). Idempotent.
    pub fn shutdown(&self) {
        let _ = self.request(Request::Shutdown);
        if let Some(thread) = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = thread.join();
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// 64 random bits from the kernel (incarnations, first PSNs).
pub(crate) fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY:
    // - `bytes` is writable for its length; getrandom writes at most that many bytes.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if filled != bytes.len() as isize {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return now ^ u64::from(std::process::id()) << 32;
    }
    u64::from_le_bytes(bytes)
}

/// One TCP connection, either direction.
struct Conn {
    stream: TcpStream,
    addr: SocketAddr,
    decoder: FrameDecoder,
    out: Vec<u8>,
    /// A non-blocking connect still in progress.
    connecting: bool,
    /// The peer's Hello, once received.
    peer: Option<(String, Incarnation)>,
    /// The peer's descriptor has been asked for and not yet received.
    descriptor_pending: bool,
    opened: Instant,
    dialed: bool,
    closed: bool,
}

impl Conn {
    fn send(&mut self, message: &Message) {
        self.out.extend_from_slice(&message.encode());
    }
}

/// An application's connect waiting for the peer's Hello and descriptor.
struct Waiting {
    conn: usize,
    local_rail: u16,
    remote_rail: u16,
    reply: Sender<Result<Arc<EndpointView>, ControlError>>,
    deadline: Instant,
}

struct Active<Q> {
    machine: Endpoint,
    view: Arc<EndpointView>,
    addr: SocketAddr,
    /// The queue pair of the epoch being connected.
    pending: Option<(Epoch, Q)>,
    /// The epoch and number of the newest queue pair offered to the peer, until it is
    /// announced retired (RetireQp).
    offered: Option<(Epoch, u32)>,
}

struct Passive<Q> {
    /// The peer's queue pair is connected to it; immediates arrive on it.
    qp: Q,
    remote_qp_num: u32,
    local: QpSide,
}

struct Plane<F: RailFabric> {
    config: ControlConfig,
    incarnation: Incarnation,
    local_addr: SocketAddr,
    shared: Arc<ControlShared>,
    rails: Vec<ControlRail<F>>,
    events: Vec<Consumer<Event>>,
    listener: TcpListener,
    requests: Receiver<Request>,
    wake: UnixStream,
    conns: Vec<Option<Conn>>,
    by_addr: HashMap<SocketAddr, usize>,
    active: HashMap<(u16, EndpointId), Active<F::Qp>>,
    by_key: HashMap<EndpointKey, EndpointId>,
    /// Ids whose endpoint drained, per rail.
    free_ids: Vec<(u16, EndpointId)>,
    /// The next first epoch of each id that was used (epochs continue across occupants).
    next_epochs: HashMap<(u16, EndpointId), Epoch>,
    passive: HashMap<WireKey, Passive<F::Connected>>,
    /// What each peer name's newest incarnation is, from Hello in either direction.
    peer_names: HashMap<String, Incarnation>,
    /// Which host each peer incarnation said it runs on.
    peer_hosts: HashMap<Incarnation, HostId>,
    /// This process's host.
    host: HostId,
    directory: P2pDirectory,
    waiting: Vec<Waiting>,
    /// Notifications waiting for their batch.
    pending_notifications: Vec<(SocketAddr, Vec<u8>, Batch)>,
    /// Immediates waiting for their batch.
    pending_signals: Vec<(Vec<Arc<EndpointView>>, u32, Batch)>,
    /// Immediates posted, waiting for their own completion (to count them).
    signals_in_flight: Vec<Batch>,
    /// This thread's rings to the pollers, for immediates.
    signals: Submitter,
    /// Scratch for immediates taken from passive queue pairs.
    immediates: Vec<u32>,
    warnings: RateLimiter,
    rng: SplitMix64,
}

/// Where the immediates of passive queue pairs become the application's notifications.
struct Inbox<'a, F: RailFabric> {
    rails: &'a [ControlRail<F>],
    shared: &'a ControlShared,
    peer_names: &'a HashMap<String, Incarnation>,
    scratch: &'a mut Vec<u32>,
}

impl<F: RailFabric> Inbox<'_, F> {
    /// Queues the immediates that arrived on `qp` (the passive queue pair of `key`) as
    /// notifications.
    ///
    /// # Errors
    /// The fabric's reason when the queue pair is broken.
    fn deliver(&mut self, key: WireKey, qp: &mut F::Connected) -> Result<(), String> {
        let Some(rail) = self.rails.get(usize::from(key.target_rail)) else {
            return Ok(());
        };
        self.scratch.clear();
        let taken = rail.fabric.take_immediates(qp, self.scratch);
        if self.scratch.is_empty() {
            return taken;
        }
        let from = self
            .peer_names
            .iter()
            .find(|(_, incarnation)| **incarnation == key.initiator)
            .map_or_else(String::new, |(name, _)| name.clone());
        let counters = &self.shared.counters;
        let mut queue = self
            .shared
            .notifications
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for &imm in self.scratch.iter() {
            bump(&counters.notifications_received);
            if queue.len() >= NOTIFICATION_QUEUE {
                queue.pop_front();
            }
            queue.push_back(Notification {
                from: from.clone(),
                incarnation: key.initiator,
                body: NotificationBody::Immediate(imm),
            });
        }
        taken
    }
}

/// Longest a request that needs the control thread's answer waits for it (it answers within
/// a tick unless stuck).
pub const REPLY_WAIT: Duration = Duration::from_secs(2);

/// Longest the control thread sleeps: pollers' events have no descriptor to wait on.
const TICK: Duration = Duration::from_millis(1);

impl<F: RailFabric> Plane<F> {
    fn run(mut self) {
        loop {
            let now = Instant::now();
            if !self.take_requests(now) {
                self.say_goodbye();
                return;
            }
            self.accept(now);
            self.service_connections(now);
            self.take_poller_events(now);
            self.run_timers(now);
            self.expire_waiting(now);
            self.release_notifications(now);
            self.release_signals();
            self.take_immediates();
            self.flush_connections();
            self.sleep();
        }
    }

    fn warn(&mut self, kind: WarningKind, message: String) {
        let counters = &self.shared.counters;
        match self.warnings.admit(kind, &message, Instant::now()) {
            Some(line) => {
                bump(&counters.warnings_printed);
                if self.config.print_warnings {
                    eprintln!("railyard[{}]: warning: {line}", self.config.name);
                }
            }
            None => bump(&counters.warnings_suppressed),
        }
    }

    /// Applies application requests; `false` on shutdown.
    fn take_requests(&mut self, now: Instant) -> bool {
        let mut drain = [0u8; 64];
        while matches!((&self.wake).read(&mut drain), Ok(n) if n > 0) {}
        while let Ok(request) = self.requests.try_recv() {
            match request {
                Request::Shutdown => return false,
                Request::Retire { rail, id } => {
                    if let Some(active) = self.active.get_mut(&(rail, id)) {
                        active.machine.handle(Input::Retire, now);
                        self.drive(rail, id, now);
                    }
                }
                Request::Notify { addr, bytes, after } => match after {
                    Some(batch) => self.pending_notifications.push((addr, bytes, batch)),
                    None => self.send_notification(addr, bytes, now),
                },
                Request::Signal { views, imm, after } => {
                    self.pending_signals.push((views, imm, after));
                }
                Request::PeerChanged { name, change } => self.peer_changed(&name, change, now),
                Request::Revoke { peer, reply } => {
                    let _ = reply.send(self.revoke(peer));
                }
                Request::DirectoryWarning(message) => self.warn(WarningKind::Directory, message),
                Request::Connect {
                    addr,
                    local_rail,
                    remote_rail,
                    reply,
                } => {
                    if usize::from(local_rail) >= self.rails.len() {
                        let _ = reply.send(Err(ControlError::UnknownRail {
                            rail: local_rail,
                            rails: self.rails.len(),
                        }));
                        continue;
                    }
                    match self.conn_to(addr, now) {
                        Ok(conn) => self.waiting.push(Waiting {
                            conn,
                            local_rail,
                            remote_rail,
                            reply,
                            deadline: now + self.config.policy.connect_timeout,
                        }),
                        Err(error) => {
                            let _ = reply.send(Err(ControlError::Unreachable {
                                addr,
                                reason: error.to_string(),
                            }));
                        }
                    }
                }
            }
        }
        self.resolve_waiting(now);
        true
    }

    fn send_notification(&mut self, addr: SocketAddr, bytes: Vec<u8>, now: Instant) {
        match self.conn_to(addr, now) {
            Ok(index) => {
                if let Some(conn) = self.conns[index].as_mut() {
                    conn.send(&Message::Notify(bytes));
                    bump(&self.shared.counters.notifications_sent);
                }
            }
            Err(error) => {
                bump(&self.shared.counters.notifications_dropped);
                self.warn(
                    WarningKind::Handshake,
                    format!("cannot send a notification to {addr}: {error}"),
                );
            }
        }
    }

    /// Sends notifications whose batch has completed; drops those whose batch failed.
    fn release_notifications(&mut self, now: Instant) {
        let (complete, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending_notifications)
            .into_iter()
            .partition(|(_, _, batch)| batch.poll().is_complete());
        self.pending_notifications = waiting;
        for (addr, bytes, batch) in complete {
            if batch.poll().failed == 0 {
                self.send_notification(addr, bytes, now);
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
        let (complete, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending_signals)
            .into_iter()
            .partition(|(_, _, batch)| batch.poll().is_complete());
        self.pending_signals = waiting;
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
            };
            match self.signals.submit_now(1, &[spec]) {
                Ok(sent) => self.signals_in_flight.push(sent),
                Err(_) => bump(&counters.notifications_dropped),
            }
        }
    }

    /// Turns the immediates that arrived on passive queue pairs into notifications.
    fn take_immediates(&mut self) {
        let mut broken = Vec::new();
        for (key, passive) in &mut self.passive {
            let mut inbox = Inbox {
                rails: &self.rails,
                shared: &self.shared,
                peer_names: &self.peer_names,
                scratch: &mut self.immediates,
            };
            if let Err(reason) = inbox.deliver(*key, &mut passive.qp) {
                broken.push((*key, reason));
            }
        }
        for (key, reason) in broken {
            // The initiator sees its queue pair fail and reconnects with a new one.
            self.passive.remove(&key);
            bump(&self.shared.counters.teardowns);
            self.warn(
                WarningKind::Handshake,
                format!(
                    "dropping the queue pair for {} rail {}: {reason}",
                    key.initiator, key.initiator_rail
                ),
            );
        }
    }

    /// The open connection to `addr`, dialing it (non-blocking) if there is none.
    fn conn_to(&mut self, addr: SocketAddr, now: Instant) -> io::Result<usize> {
        if let Some(&index) = self.by_addr.get(&addr) {
            if self.conns[index].as_ref().is_some_and(|c| !c.closed) {
                return Ok(index);
            }
        }
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
        let mut conn = Conn {
            stream: socket.into(),
            addr,
            decoder: FrameDecoder::default(),
            out: Vec::new(),
            connecting,
            peer: None,
            descriptor_pending: true,
            opened: now,
            dialed: true,
            closed: false,
        };
        conn.send(&Message::Hello {
            name: self.config.name.clone(),
            incarnation: self.incarnation,
            host: self.host,
        });
        conn.send(&Message::GetDescriptor);
        let index = self.insert_conn(conn);
        self.by_addr.insert(addr, index);
        Ok(index)
    }

    fn insert_conn(&mut self, conn: Conn) -> usize {
        if let Some(index) = self.conns.iter().position(Option::is_none) {
            self.conns[index] = Some(conn);
            index
        } else {
            self.conns.push(Some(conn));
            self.conns.len() - 1
        }
    }

    fn accept(&mut self, now: Instant) {
        loop {
            let handshaking = self
                .conns
                .iter()
                .flatten()
                .filter(|c| !c.dialed && c.peer.is_none() && !c.closed)
                .count();
            if handshaking >= self.config.max_handshakes {
                return;
            }
            let Ok((stream, addr)) = self.listener.accept() else {
                return;
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.insert_conn(Conn {
                stream,
                addr,
                decoder: FrameDecoder::default(),
                out: Vec::new(),
                connecting: false,
                peer: None,
                descriptor_pending: false,
                opened: now,
                dialed: false,
                closed: false,
            });
        }
    }

    /// Reads every connection and handles whole messages; closes broken ones.
    fn service_connections(&mut self, now: Instant) {
        for index in 0..self.conns.len() {
            let mut messages = Vec::new();
            let mut failed = None;
            {
                let Some(conn) = self.conns[index].as_mut() else {
                    continue;
                };
                if conn.connecting {
                    match conn.stream.take_error() {
                        Ok(None) if conn.stream.peer_addr().is_ok() => conn.connecting = false,
                        Ok(None) => {}
                        Ok(Some(error)) | Err(error) => failed = Some(error.to_string()),
                    }
                }
                let timed_out = conn.peer.is_none()
                    && now.duration_since(conn.opened) > self.config.policy.connect_timeout;
                if timed_out && failed.is_none() {
                    failed = Some("no handshake within the connect timeout".into());
                }
                if failed.is_none() && !conn.connecting {
                    let mut buffer = [0u8; 16 * 1024];
                    loop {
                        match conn.stream.read(&mut buffer) {
                            Ok(0) => {
                                failed = Some("the peer closed the connection".into());
                                break;
                            }
                            Ok(n) => conn.decoder.push(&buffer[..n]),
                            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                            Err(error) => {
                                failed = Some(error.to_string());
                                break;
                            }
                        }
                    }
                    loop {
                        match conn.decoder.next_message() {
                            Ok(Some(message)) => messages.push(message),
                            Ok(None) => break,
                            Err(error) => {
                                failed = Some(format!("malformed frame: {error}"));
                                break;
                            }
                        }
                    }
                }
            }
            for message in messages {
                self.handle_message(index, message, now);
            }
            if let Some(reason) = failed {
                self.close(index, &reason, now);
            }
        }
    }

    fn flush_connections(&mut self) {
        let mut broken = Vec::new();
        for (index, slot) in self.conns.iter_mut().enumerate() {
            let Some(conn) = slot.as_mut() else { continue };
            if conn.connecting || conn.out.is_empty() {
                continue;
            }
            match conn.stream.write(&conn.out) {
                Ok(n) => {
                    conn.out.drain(..n);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => broken.push((index, error.to_string())),
            }
        }
        for (index, reason) in broken {
            self.close(index, &reason, Instant::now());
        }
    }

    /// Closes a connection: handshakes waiting on it fail.
    fn close(&mut self, index: usize, reason: &str, now: Instant) {
        let Some(conn) = self.conns[index].take() else {
            return;
        };
        if self.by_addr.get(&conn.addr) == Some(&index) {
            self.by_addr.remove(&conn.addr);
        }
        let mut still_waiting = Vec::new();
        for waiting in std::mem::take(&mut self.waiting) {
            if waiting.conn == index {
                let _ = waiting.reply.send(Err(ControlError::Unreachable {
                    addr: conn.addr,
                    reason: reason.to_string(),
                }));
            } else {
                still_waiting.push(waiting);
            }
        }
        self.waiting = still_waiting;
        if conn.dialed {
            let failing: Vec<(u16, EndpointId, Epoch)> = self
                .active
                .iter()
                .filter(|(_, a)| a.addr == conn.addr)
                .filter_map(|(&(rail, id), a)| a.pending.as_ref().map(|(e, _)| (rail, id, *e)))
                .collect();
            for (rail, id, epoch) in failing {
                self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        }
    }

    fn handle_message(&mut self, index: usize, message: Message, now: Instant) {
        match message {
            Message::Hello {
                name,
                incarnation,
                host,
            } => self.on_hello(index, name, incarnation, host, now),
            Message::GetDescriptor => {
                let descriptor = self.local_descriptor();
                if let Some(conn) = self.conns[index].as_mut() {
                    conn.send(&Message::Descriptor(descriptor));
                }
            }
            Message::Descriptor(descriptor) => self.on_descriptor(index, descriptor, now),
            Message::ConnectQp { key, epoch, side } => self.on_connect_qp(index, key, epoch, side),
            Message::ConnectQpReply { key, epoch, result } => {
                self.on_connect_reply(key, epoch, result, now);
            }
            Message::Notify(bytes) => {
                let Some((from, incarnation)) =
                    self.conns[index].as_ref().and_then(|c| c.peer.clone())
                else {
                    return self.close(index, "a notification before Hello", now);
                };
                bump(&self.shared.counters.notifications_received);
                let mut queue = self
                    .shared
                    .notifications
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if queue.len() >= NOTIFICATION_QUEUE {
                    queue.pop_front();
                }
                queue.push_back(Notification {
                    from,
                    incarnation,
                    body: NotificationBody::Bytes(bytes),
                });
            }
            Message::RetireQp {
                key,
                epoch: _,
                qp_num,
            } => self.on_retire_qp(index, key, qp_num),
            Message::Bye => self.close(index, "the peer said goodbye", now),
        }
    }

    /// The initiator of a passive queue pair retired it: drop it if it is still that one,
    /// so nothing buffered from it executes. Only the initiator itself may say so.
    fn on_retire_qp(&mut self, index: usize, key: WireKey, qp_num: u32) {
        let speaker = self.conns[index]
            .as_ref()
            .and_then(|conn| conn.peer.as_ref())
            .map(|(_, incarnation)| *incarnation);
        if speaker != Some(key.initiator) || key.target != self.incarnation {
            return;
        }
        let still_that_one = self
            .passive
            .get(&key)
            .is_some_and(|passive| passive.remote_qp_num == qp_num);
        if let Some(passive) = still_that_one.then(|| self.passive.remove(&key)).flatten() {
            self.revoke_passive(key, passive);
        }
    }

    /// Takes every passive queue pair of `peer` out of service.
    fn revoke(&mut self, peer: Incarnation) -> Vec<Revocation> {
        let keys: Vec<WireKey> = self
            .passive
            .keys()
            .filter(|key| key.initiator == peer)
            .copied()
            .collect();
        keys.into_iter()
            .filter_map(|key| {
                let passive = self.passive.remove(&key)?;
                Some(self.revoke_passive(key, passive))
            })
            .collect()
    }

    fn revoke_passive(&mut self, key: WireKey, mut passive: Passive<F::Connected>) -> Revocation {
        bump(&self.shared.counters.passive_retired);
        // Immediates that arrived before are the application's: deliver them first.
        let mut inbox = Inbox {
            rails: &self.rails,
            shared: &self.shared,
            peer_names: &self.peer_names,
            scratch: &mut self.immediates,
        };
        let _ = inbox.deliver(key, &mut passive.qp);
        match self.rails.get(usize::from(key.target_rail)) {
            Some(rail) => rail.fabric.revoke(passive.qp),
            // Unreachable: passive queue pairs exist only on rails that exist.
            None => Revocation::done(),
        }
    }

    /// Tells the target that our queue pair of `epoch` (or any, with `None`) for endpoint
    /// `id` is out of service, so that it executes nothing more it buffered from it.
    fn announce_retired_qp(&mut self, rail: u16, id: EndpointId, epoch: Option<Epoch>) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        let Some((offered_epoch, qp_num)) = active.offered else {
            return;
        };
        if epoch.is_some_and(|epoch| epoch != offered_epoch) {
            return;
        }
        active.offered = None;
        let key = active.machine.key();
        let message = Message::RetireQp {
            key: WireKey {
                initiator: self.incarnation,
                target: key.peer,
                initiator_rail: key.local_rail,
                target_rail: key.remote_rail,
            },
            epoch: offered_epoch.get(),
            qp_num,
        };
        let conn = self.by_addr.get(&active.addr).copied();
        if let Some(conn) = conn
            .and_then(|conn| self.conns.get_mut(conn))
            .and_then(Option::as_mut)
        {
            conn.send(&message);
        }
    }

    fn local_descriptor(&self) -> SegmentDescriptor {
        let regions = self
            .shared
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        SegmentDescriptor {
            name: self.config.name.clone(),
            incarnation: self.incarnation,
            handshake_addr: self.local_addr.to_string(),
            rails: self
                .rails
                .iter()
                .map(|rail| rail.fabric.describe())
                .collect(),
            regions: regions.1.clone(),
        }
    }

    fn on_hello(
        &mut self,
        index: usize,
        name: String,
        incarnation: Incarnation,
        host: HostId,
        now: Instant,
    ) {
        let Some(conn) = self.conns[index].as_mut() else {
            return;
        };
        let first = conn.peer.is_none();
        conn.peer = Some((name.clone(), incarnation));
        if first && !conn.dialed {
            conn.send(&Message::Hello {
                name: self.config.name.clone(),
                incarnation: self.incarnation,
                host: self.host,
            });
        }
        self.peer_hosts.insert(incarnation, host);
        if let Some(old) = self.peer_names.insert(name.clone(), incarnation) {
            if old != incarnation {
                self.peer_restarted(&name, old, incarnation, now, None);
            }
        }
        self.resolve_waiting(now);
    }

    /// Everything of `old` (a previous incarnation of `name`) goes: active endpoints fail
    /// with `PeerRestarted`, passive queue pairs are dropped. Fresh endpoints to `new`, on
    /// the same rails and at the same address, take the retired ones' place (an application
    /// that asks for the peer again gets them; nothing meant for `old` ever reaches them).
    /// A cluster directory saw `name` change: the same consequences as when a Hello or a
    /// descriptor says so, and for a peer that is simply gone, its endpoints retire with
    /// `PeerUnavailable` (nothing waits for a transport timeout).
    fn peer_changed(&mut self, name: &str, change: PeerChange, now: Instant) {
        match change {
            PeerChange::Restarted { old, new, addr } => {
                if self.peer_names.insert(name.to_string(), new) != Some(new) {
                    self.directory.invalidate(name);
                    self.peer_restarted(name, old, new, now, Some(addr));
                }
            }
            PeerChange::Gone { incarnation } => {
                if self.peer_names.get(name) == Some(&incarnation) {
                    self.peer_names.remove(name);
                }
                self.directory.invalidate(name);
                let gone: Vec<(u16, EndpointId)> = self
                    .active
                    .iter()
                    .filter(|(_, a)| {
                        a.machine.key().peer == incarnation && a.machine.phase() != Phase::Retired
                    })
                    .map(|(&key, _)| key)
                    .collect();
                if !gone.is_empty() {
                    self.warn(
                        WarningKind::Retire,
                        format!(
                            "peer {name} ({incarnation}) left the directory; retiring its endpoints"
                        ),
                    );
                }
                for (rail, id) in gone {
                    self.handle_input(rail, id, Input::PeerGone, now);
                }
                self.forget_incarnation(incarnation);
            }
        }
    }

    /// Drops what this side keeps for a peer incarnation that is gone: its host and the
    /// passive queue pairs it connected (teardowns).
    fn forget_incarnation(&mut self, gone: Incarnation) {
        self.peer_hosts.remove(&gone);
        let before = self.passive.len();
        self.passive.retain(|key, _| key.initiator != gone);
        let dropped = (before - self.passive.len()) as u64;
        self.shared
            .counters
            .teardowns
            .fetch_add(dropped, Ordering::Relaxed);
    }

    /// `new_addr`: where `new` listens, when known to differ from `old`'s address.
    fn peer_restarted(
        &mut self,
        name: &str,
        old: Incarnation,
        new: Incarnation,
        now: Instant,
        new_addr: Option<SocketAddr>,
    ) {
        bump(&self.shared.counters.peer_restarts);
        self.warn(
            WarningKind::Retire,
            format!(
                "peer {name} restarted ({old} is gone, {new} replaces it); retiring its endpoints"
            ),
        );
        let stale: Vec<(u16, EndpointId, u16, SocketAddr)> = self
            .active
            .iter()
            .filter(|(_, a)| a.machine.key().peer == old && a.machine.phase() != Phase::Retired)
            .map(|(&(rail, id), a)| (rail, id, a.machine.key().remote_rail, a.addr))
            .collect();
        for &(rail, id, _, _) in &stale {
            self.handle_input(rail, id, Input::PeerRestarted, now);
        }
        for (rail, _, remote_rail, addr) in stale {
            let addr = new_addr.unwrap_or(addr);
            self.endpoint_for(name.to_string(), new, addr, rail, remote_rail, now);
        }
        self.forget_incarnation(old);
    }

    fn on_descriptor(&mut self, index: usize, descriptor: SegmentDescriptor, now: Instant) {
        if let Some(conn) = self.conns[index].as_mut() {
            conn.descriptor_pending = false;
        }
        let name = descriptor.name.clone();
        let incarnation = descriptor.incarnation;
        if let Some(old) = self.directory.record(descriptor) {
            // A Hello usually told us first; a directory that learns it otherwise does here.
            if self.peer_names.insert(name.clone(), incarnation) != Some(incarnation) {
                self.peer_restarted(&name, old, incarnation, now, None);
            }
        }
        if let Some(fresh) = self.directory.lookup(&name) {
            for active in self.active.values() {
                if active.machine.key().peer == incarnation {
                    active.view.set_descriptor(fresh.clone());
                }
            }
        }
        self.resolve_waiting(now);
    }

    /// Turns connects whose peer is known into endpoints.
    fn resolve_waiting(&mut self, now: Instant) {
        let mut still_waiting = Vec::new();
        for waiting in std::mem::take(&mut self.waiting) {
            let known = self.conns[waiting.conn].as_ref().and_then(|conn| {
                let (name, incarnation) = conn.peer.clone()?;
                (!conn.descriptor_pending).then_some((name, incarnation, conn.addr))
            });
            match known {
                Some((name, incarnation, addr)) => {
                    let view = self.endpoint_for(
                        name,
                        incarnation,
                        addr,
                        waiting.local_rail,
                        waiting.remote_rail,
                        now,
                    );
                    let _ = waiting.reply.send(Ok(view));
                }
                None => still_waiting.push(waiting),
            }
        }
        self.waiting = still_waiting;
    }

    fn expire_waiting(&mut self, now: Instant) {
        let (expired, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| now >= w.deadline);
        self.waiting = kept;
        for waiting in expired {
            let addr = self.conns[waiting.conn]
                .as_ref()
                .map_or(self.local_addr, |c| c.addr);
            let _ = waiting.reply.send(Err(ControlError::Unreachable {
                addr,
                reason: "no handshake within the connect timeout".into(),
            }));
        }
    }

    /// The endpoint for a peer incarnation and rails, created if new.
    fn endpoint_for(
        &mut self,
        peer_name: String,
        incarnation: Incarnation,
        addr: SocketAddr,
        local_rail: u16,
        remote_rail: u16,
        now: Instant,
    ) -> Arc<EndpointView> {
        let key = EndpointKey {
            peer: incarnation,
            local_rail,
            remote_rail,
        };
        if let Some(id) = self.by_key.get(&key) {
            if let Some(active) = self.active.get(&(local_rail, *id)) {
                if active.machine.phase() != Phase::Retired {
                    return active.view.clone();
                }
            }
        }
        let id = match self
            .free_ids
            .iter()
            .position(|&(rail, _)| rail == local_rail)
        {
            Some(position) => self.free_ids.swap_remove(position).1,
            None => {
                let endpoints = self.shared.rails[usize::from(local_rail)]
                    .endpoints
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .len();
                EndpointId(endpoints as u32)
            }
        };
        let first_epoch = self
            .next_epochs
            .get(&(local_rail, id))
            .copied()
            .unwrap_or(Epoch::FIRST);
        let view = Arc::new(EndpointView {
            id,
            key,
            peer_name: peer_name.clone(),
            first_epoch,
            epoch: AtomicU64::new(0),
            phase: AtomicU8::new(0),
            descriptor: RwLock::new(self.directory.lookup(&peer_name)),
        });
        {
            let mut endpoints = self.shared.rails[usize::from(local_rail)]
                .endpoints
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let index = id.0 as usize;
            if endpoints.len() <= index {
                endpoints.resize(index + 1, None);
            }
            endpoints[index] = Some(view.clone());
        }
        let seed = self.rng.next_u64();
        let mut machine = Endpoint::new(key, self.config.policy.clone(), SplitMix64::new(seed));
        machine.start_at(first_epoch);
        self.by_key.insert(key, id);
        self.active.insert(
            (local_rail, id),
            Active {
                machine,
                view: view.clone(),
                addr,
                pending: None,
                offered: None,
            },
        );
        self.handle_input(local_rail, id, Input::ConnectWanted, now);
        view
    }

    /// Counts a new queue pair by fabric (its side's attachment says which).
    fn count_fabric(&self, side: &QpSide) {
        if TcpAttachment::is_tcp(&side.attachment) {
            bump(&self.shared.counters.tcp_qps);
        }
    }

    /// What is known of the peer `incarnation` reached over connection `conn`.
    fn link(&self, conn: usize, incarnation: Incarnation) -> PeerLink {
        let local_ip = self.conns[conn]
            .as_ref()
            .and_then(|c| c.stream.local_addr().ok())
            .map_or(self.local_addr.ip(), |addr| addr.ip());
        PeerLink {
            same_host: self
                .peer_hosts
                .get(&incarnation)
                .is_some_and(|host| host.same_host_as(&self.host)),
            local_ip,
        }
    }

    fn on_connect_qp(&mut self, index: usize, key: WireKey, epoch: u64, side: QpSide) {
        let link = self.link(index, key.initiator);
        let reply = self.answer_connect_qp(key, &side, &link);
        let message = Message::ConnectQpReply {
            key,
            epoch,
            result: reply,
        };
        if let Some(conn) = self.conns[index].as_mut() {
            conn.send(&message);
        }
    }

    fn answer_connect_qp(
        &mut self,
        key: WireKey,
        side: &QpSide,
        link: &PeerLink,
    ) -> Result<QpSide, String> {
        if key.target != self.incarnation {
            bump(&self.shared.counters.refused);
            return Err(format!(
                "the queue pair is meant for incarnation {}, this process is {}",
                key.target, self.incarnation
            ));
        }
        let Some(rail) = self.rails.get(usize::from(key.target_rail)) else {
            bump(&self.shared.counters.refused);
            return Err(format!(
                "rail {} does not exist (this process has {})",
                key.target_rail,
                self.rails.len()
            ));
        };
        if let Some(existing) = self.passive.get(&key) {
            if existing.remote_qp_num == side.info.qp_num {
                bump(&self.shared.counters.idempotent_replies);
                return Ok(existing.local.clone());
            }
        }
        let (qp, local) = rail.fabric.create_target_qp(link, side)?;
        let qp = match rail.fabric.connect_qp(qp, side) {
            Ok(connected) => connected,
            Err(reason) => {
                bump(&self.shared.counters.refused);
                return Err(reason);
            }
        };
        bump(&self.shared.counters.passive_qps);
        self.count_fabric(&local);
        let replaced = self.passive.insert(
            key,
            Passive {
                qp,
                remote_qp_num: side.info.qp_num,
                local: local.clone(),
            },
        );
        if replaced.is_some() {
            bump(&self.shared.counters.teardowns);
        }
        Ok(local)
    }

    fn on_connect_reply(
        &mut self,
        key: WireKey,
        epoch: u64,
        result: Result<QpSide, String>,
        now: Instant,
    ) {
        if key.initiator != self.incarnation {
            return;
        }
        if epoch == 0 {
            return;
        }
        let epoch = Epoch::new(epoch);
        let found = self.active.iter_mut().find(|(_, a)| {
            a.machine.key().local_rail == key.initiator_rail
                && a.machine.key().remote_rail == key.target_rail
                && a.pending.as_ref().is_some_and(|(e, _)| *e == epoch)
        });
        let Some((&(rail, id), active)) = found else {
            return;
        };
        let Some((_, qp)) = active.pending.take() else {
            return;
        };
        let fabric = &self.rails[usize::from(rail)].fabric;
        let outcome = result
            .and_then(|side| fabric.connect_qp(qp, &side))
            .and_then(|connected| fabric.stage(id, epoch, connected));
        match outcome {
            Ok(()) => self.handle_input(rail, id, Input::HandshakeDone { epoch }, now),
            Err(reason) => {
                let peer = active.view.peer_name.clone();
                self.warn(
                    WarningKind::Handshake,
                    format!("queue pair for {peer} at {epoch} refused: {reason}"),
                );
                self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        }
    }

    fn take_poller_events(&mut self, now: Instant) {
        for rail in 0..self.events.len() {
            while let Some(event) = self.events[rail].pop() {
                let rail = rail as u16;
                match event {
                    Event::QpFailed {
                        endpoint,
                        epoch,
                        status,
                    } => {
                        self.announce_retired_qp(rail, endpoint, Some(epoch));
                        self.handle_input(rail, endpoint, Input::QpError { epoch, status }, now);
                    }
                    Event::QpFatal { endpoint, epoch } => {
                        self.announce_retired_qp(rail, endpoint, Some(epoch));
                        self.handle_input(rail, endpoint, Input::QpFatal { epoch }, now);
                    }
                    Event::ConnectFailed {
                        endpoint, epoch, ..
                    } => {
                        self.announce_retired_qp(rail, endpoint, Some(epoch));
                        self.handle_input(rail, endpoint, Input::HandshakeFailed { epoch }, now);
                    }
                    Event::Confirmed { endpoint, epoch } => {
                        self.handle_input(rail, endpoint, Input::Confirmed { epoch }, now);
                    }
                    Event::EndpointDrained { endpoint } => self.drained(rail, endpoint),
                    _ => {}
                }
            }
        }
    }

    /// A retired endpoint has nothing in flight: its id may be reused.
    fn drained(&mut self, rail: u16, id: EndpointId) {
        let Some(active) = self.active.get(&(rail, id)) else {
            return;
        };
        if active.machine.phase() != Phase::Retired {
            return;
        }
        let next = active.machine.epoch().map_or(Epoch::FIRST, Epoch::next);
        let key = active.machine.key();
        self.active.remove(&(rail, id));
        if self.by_key.get(&key) == Some(&id) {
            self.by_key.remove(&key);
        }
        self.next_epochs.insert((rail, id), next);
        if let Some(slot) = self.shared.rails[usize::from(rail)]
            .endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(id.0 as usize)
        {
            *slot = None;
        }
        self.free_ids.push((rail, id));
    }

    fn run_timers(&mut self, now: Instant) {
        let due: Vec<(u16, EndpointId)> = self
            .active
            .iter()
            .filter(|(_, a)| a.machine.next_timeout().is_some_and(|t| t <= now))
            .map(|(&k, _)| k)
            .collect();
        for (rail, id) in due {
            if let Some(active) = self.active.get_mut(&(rail, id)) {
                active.machine.handle_timeout(now);
            }
            self.drive(rail, id, now);
        }
    }

    fn handle_input(&mut self, rail: u16, id: EndpointId, input: Input, now: Instant) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        active.machine.handle(input, now);
        self.drive(rail, id, now);
    }

    /// Carries out an endpoint's outputs.
    fn drive(&mut self, rail: u16, id: EndpointId, now: Instant) {
        loop {
            let Some(active) = self.active.get_mut(&(rail, id)) else {
                return;
            };
            active.view.set_phase(active.machine.phase());
            let Some(output) = active.machine.poll_output() else {
                return;
            };
            let poller = self.rails[usize::from(rail)].poller.clone();
            match output {
                Output::CreateQp { epoch } => self.create_qp(rail, id, epoch, now),
                Output::ConnectQp { epoch } => {
                    // The command before the epoch: a slice prepared for this epoch is then
                    // always pushed after the command, and the poller (which drains
                    // submissions before commands) finds the endpoint at that epoch.
                    let _ = poller.send(Command::AddEndpoint {
                        endpoint: id,
                        epoch,
                    });
                    active.view.epoch.store(epoch.get(), Ordering::Release);
                }
                Output::RefreshDescriptor => {
                    let (addr, name) = (active.addr, active.view.peer_name.clone());
                    self.directory.invalidate(&name);
                    if let Some(&index) = self.by_addr.get(&addr) {
                        if let Some(conn) = self.conns[index].as_mut() {
                            conn.descriptor_pending = true;
                            conn.send(&Message::GetDescriptor);
                        }
                    }
                }
                Output::RetireEndpoint { reason } => {
                    bump(&self.shared.counters.teardowns);
                    let peer = active.view.peer_name.clone();
                    let _ = poller.send(Command::RetireEndpoint {
                        endpoint: id,
                        reason,
                    });
                    self.warn(
                        WarningKind::Retire,
                        format!("endpoint {id:?} to {peer} retired: {reason}"),
                    );
                    self.announce_retired_qp(rail, id, None);
                }
                Output::OpenCircuit => {
                    bump(&self.shared.counters.circuit_openings);
                    let peer = active.view.peer_name.clone();
                    let _ = poller.send(Command::SetCircuit {
                        endpoint: id,
                        open: true,
                    });
                    self.warn(
                        WarningKind::Circuit,
                        format!("circuit to {peer} opened: it fails fast with PeerUnavailable"),
                    );
                }
                Output::CloseCircuit => {
                    let _ = poller.send(Command::SetCircuit {
                        endpoint: id,
                        open: false,
                    });
                }
            }
        }
    }

    /// Creates a queue pair for `epoch` and sends its ConnectQp (fetching the descriptor
    /// first on a reconnect, on the same ordered connection).
    fn create_qp(&mut self, rail: u16, id: EndpointId, epoch: Epoch, now: Instant) {
        let Some(active) = self.active.get(&(rail, id)) else {
            return;
        };
        let (addr, key, peer) = (
            active.addr,
            active.machine.key(),
            active.view.peer_name.clone(),
        );
        let reconnect = epoch != active.view.first_epoch;
        let conn = match self.conn_to(addr, now) {
            Ok(conn) => conn,
            Err(error) => {
                self.warn(
                    WarningKind::Handshake,
                    format!("cannot dial {peer} at {addr}: {error}"),
                );
                return self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        };
        let link = self.link(conn, key.peer);
        let created = self.rails[usize::from(rail)].fabric.create_qp(&link);
        let (qp, side) = match created {
            Ok(created) => created,
            Err(reason) => {
                self.warn(
                    WarningKind::Handshake,
                    format!("cannot create a queue pair for {peer}: {reason}"),
                );
                return self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        };
        bump(&self.shared.counters.active_qps);
        self.count_fabric(&side);
        // The queue pair this one replaces is out of service for good.
        self.announce_retired_qp(rail, id, None);
        let qp_num = side.info.qp_num;
        if reconnect {
            bump(&self.shared.counters.reconnects);
            self.warn(
                WarningKind::Reconnect,
                format!("reconnecting to {peer} at {epoch}"),
            );
        }
        if let Some(conn) = self.conns[conn].as_mut() {
            if reconnect {
                conn.send(&Message::GetDescriptor);
            }
            conn.send(&Message::ConnectQp {
                key: WireKey {
                    initiator: self.incarnation,
                    target: key.peer,
                    initiator_rail: key.local_rail,
                    target_rail: key.remote_rail,
                },
                epoch: epoch.get(),
                side,
            });
        }
        if let Some(active) = self.active.get_mut(&(rail, id)) {
            active.pending = Some((epoch, qp));
            active.offered = Some((epoch, qp_num));
        }
    }

    fn say_goodbye(&mut self) {
        for conn in self.conns.iter_mut().flatten() {
            conn.send(&Message::Bye);
        }
        self.flush_connections();
    }

    /// Waits for socket readiness, a wake-up, or the next tick.
    fn sleep(&mut self) {
        let mut fds = vec![
            libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        for conn in self.conns.iter().flatten() {
            let mut events = libc::POLLIN;
            if conn.connecting || !conn.out.is_empty() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: conn.stream.as_raw_fd(),
                events,
                revents: 0,
            });
        }
        let timeout = TICK.as_millis() as libc::c_int;
        // SAFETY:
        // - `fds` is a valid array of `fds.len()` pollfd structs that lives across the call;
        //   every descriptor in it is owned by this thread and open.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    }
}
