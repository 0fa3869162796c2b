//! The control plane's public handle: [`ControlPlane`] starts the control thread — the I/O
//! driver (`driver.rs`) around the sans-IO handshake core (`handshake/`) — and
//! passes the application's requests to it over a channel plus a wake-up socket.
//!
//! # Endpoints and ids
//! Endpoints are keyed by [`EndpointKey`](crate::EndpointKey) (peer incarnation and rails),
//! never by address or name. Each gets a small `EndpointId` on its local rail; an id is
//! reused only after the poller reports the previous endpoint drained, and its epochs
//! continue from the previous occupant's, so a slice prepared for the old endpoint is always
//! older than the new one: the re-prepare hook ([`ControlShared::reprepare_hook`]) refuses
//! it instead of pointing it at a different peer.
//!
//! # Handshakes
//! A dialer opens one TCP connection per peer address and sends Hello and GetDescriptor,
//! then ConnectQp for each queue pair it needs; a reconnect fetches the descriptor again
//! before its ConnectQp, so slices re-prepared at the new epoch see the peer's current keys.
//! The listener answers ConnectQp idempotently: a request naming the same initiator
//! incarnation, rails and queue-pair number as the passive queue pair it already has is
//! answered with that queue pair's side and changes nothing. Identity, restarts and which
//! reply belongs to which endpoint are the core's: see `handshake/`.
//!
//! # Notifications
//! Bytes go over the control connection ([`ControlPlane::notify`]), addressed to one
//! incarnation. A 32-bit value can instead ride the data path ([`ControlPlane::signal`]):
//! once its batch has completed, the control thread posts a zero-length WRITE_WITH_IMM
//! through its own rings to the pollers, and the target's control thread takes the
//! immediate from the passive queue pair it owns (verbs: that queue pair's receive
//! completion queue; soft: its inbox).

use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use railyard_dataplane::{Batch, PollerHandle, Submitter};

pub use crate::error::{ControlError, REPLY_WAIT};
pub use crate::handshake::PeerChange;
pub use crate::shared::{
    ControlShared, ControlStats, EndpointView, Notification, NotificationBody,
};
pub use crate::warn::DirectoryWarning;

use crate::auth::ClusterSecret;
use crate::descriptor::{RailDescriptor, SegmentDescriptor};
use crate::driver::{Driver, DriverParts, Request};
use crate::endpoint::Incarnation;
use crate::handshake::{Core, Identity};
use crate::host::HostId;
use crate::policy::Policy;
use crate::rail::{RailFabric, Revocation};
use crate::wire::MAX_NOTIFY;
use railyard_dataplane::entropy::random_u64;

/// How to run a control plane.
#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// This process's segment name: a label for people and for a cluster directory. Two
    /// processes may share it; they are still two peers.
    pub name: String,
    /// Where the handshake listener binds (port 0: any).
    pub listen: SocketAddr,
    /// The address peers reach this process at, published in its descriptor and Hello
    /// (with the bound port); `None`: the listener's own address.
    pub advertise: Option<IpAddr>,
    /// Reconnect, flap and circuit policy, and what one connection may cost.
    pub policy: Policy,
    /// Seeds every endpoint's reconnect jitter and the handshake ids.
    pub seed: u64,
    /// The incarnation; `None` draws a random one.
    pub incarnation: Option<Incarnation>,
    /// The cluster secret: peers must prove it before anything else is answered, and this
    /// side proves it to them ([`crate::auth`]), and every frame after the handshake is
    /// authenticated with keys derived from it ([`crate::session`]). `None`: peers are not
    /// authenticated.
    pub secret: Option<ClusterSecret>,
    /// Encrypt control frames after the handshake (region addresses, keys, data-port
    /// tokens, notifications), not only authenticate them; needs `secret`. Either side of a
    /// connection asking is enough.
    pub encrypt_control: bool,
}

impl ControlConfig {
    /// Defaults for a process named `name` listening on localhost, any port.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            policy: Policy::default(),
            seed: 0,
            incarnation: None,
            secret: None,
            encrypt_control: false,
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

/// Slots of the control thread's ring to each poller (for immediates).
const SIGNAL_RING_CAPACITY: usize = 256;

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

/// Connections the kernel completes and holds for the handshake listener before it accepts
/// them: room for a burst of hundreds of initiators (the standard library's 128 made those
/// beyond it retry their SYN a second later), and no more. A flood of connections that never
/// say Hello fills what there is, and the listener drains it at the pace it may evict silent
/// ones (64 per 100 ms): a genuine peer behind 512 of them is accepted well within its
/// connect timeout, behind 4 096 it is not (`tests/bounded_connections.rs`).
const LISTEN_BACKLOG: libc::c_int = 512;

impl ControlPlane {
    /// Binds the listener and starts the control thread over `rails`.
    ///
    /// # Errors
    /// [`ControlError::Listen`] or [`ControlError::Thread`];
    /// [`ControlError::EncryptionWithoutSecret`].
    pub fn start<F: RailFabric>(
        config: ControlConfig,
        rails: Vec<ControlRail<F>>,
        shared: Arc<ControlShared>,
    ) -> Result<Self, ControlError> {
        if config.encrypt_control && config.secret.is_none() {
            return Err(ControlError::EncryptionWithoutSecret);
        }
        let listener = TcpListener::bind(config.listen).map_err(|source| ControlError::Listen {
            addr: config.listen,
            source,
        })?;
        // SAFETY: `listener` owns an open, bound, listening socket for the whole call.
        if unsafe { libc::listen(listener.as_raw_fd(), LISTEN_BACKLOG) } != 0 {
            return Err(ControlError::Listen {
                addr: config.listen,
                source: std::io::Error::last_os_error(),
            });
        }
        listener
            .set_nonblocking(true)
            .map_err(ControlError::Thread)?;
        let bound = listener.local_addr().map_err(ControlError::Thread)?;
        let local_addr = config
            .advertise
            .map_or(bound, |ip| SocketAddr::new(ip, bound.port()));
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
        let (fabrics, pollers): (Vec<F>, Vec<Arc<PollerHandle>>) = rails
            .into_iter()
            .map(|rail| (rail.fabric, rail.poller))
            .unzip();
        let rails: Vec<RailDescriptor> = fabrics.iter().map(RailFabric::describe).collect();
        let name = config.name.clone();
        let me = Identity {
            name: name.clone(),
            incarnation,
            local_addr,
            host: HostId::this_process(),
            secret: config.secret.clone(),
            encrypt_control: config.encrypt_control,
        };
        let mut core = Core::new(
            me,
            config.policy.clone(),
            config.seed,
            fabrics,
            shared.clone(),
        );
        core.key_tables(railyard_dataplane::entropy::random_u64());
        core.take_turns(config.policy.max_handshakes_per_target.max(1));
        let driver = Driver::new(
            core,
            DriverParts {
                policy: config.policy,
                shared: shared.clone(),
                pollers,
                events,
                listener,
                requests: requests_rx,
                wake: wake_rx,
                signals,
                engine: name.clone(),
            },
        );
        let thread = std::thread::Builder::new()
            .name("railyard-control".into())
            .spawn(move || driver.run())
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
            regions: self.shared.regions(),
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

    /// Where peers reach the handshake listener: its advertised address
    /// ([`ControlConfig::advertise`]) with the bound port, else where it is bound.
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

    /// Every endpoint that exists now, with its rail (for reports: takes each rail's lock).
    pub fn endpoints(&self) -> Vec<(u16, Arc<EndpointView>)> {
        self.shared.endpoints()
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

    /// Asks incarnation `peer`, dialed at `addr`, for its descriptor again (regions it
    /// registered since, say); its endpoints' views take the answer
    /// ([`EndpointView::descriptor_version`] moves).
    ///
    /// # Errors
    /// [`ControlError::Stopped`].
    pub fn refresh_descriptor(
        &self,
        addr: SocketAddr,
        peer: Incarnation,
    ) -> Result<(), ControlError> {
        self.request(Request::RefreshDescriptor { addr, peer })
    }

    /// Sends `bytes` to incarnation `target`, listening at `addr`; with `after`, once that
    /// batch has completed successfully (its data is in place before the notification
    /// leaves), and not at all if it failed. A process that took over the address refuses
    /// it (its [`ControlStats::notifications_refused`]).
    ///
    /// # Errors
    /// [`ControlError::TooLarge`] beyond [`MAX_NOTIFY`] bytes; [`ControlError::Stopped`].
    pub fn notify(
        &self,
        addr: SocketAddr,
        target: Incarnation,
        bytes: Vec<u8>,
        after: Option<Batch>,
    ) -> Result<(), ControlError> {
        if bytes.len() > MAX_NOTIFY {
            return Err(ControlError::TooLarge {
                len: bytes.len(),
                max: MAX_NOTIFY,
            });
        }
        if let Some(after) = &after {
            self.wake_when_complete(after);
        }
        self.request(Request::Notify {
            addr,
            target,
            bytes,
            after,
        })
    }

    /// Wakes the control thread as soon as `batch` completes, so that what waits for it
    /// (a notification, an immediate) leaves at once rather than at the thread's next tick.
    fn wake_when_complete(&self, batch: &Batch) {
        let waker = self.waker.clone();
        batch.on_complete(move || {
            let _ = (&*waker).write(&[1]);
        });
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
        self.wake_when_complete(&after);
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

    /// A warning about the directory, counted and emitted like the control plane's own
    /// (kind `directory`).
    pub fn warn(&self, warning: DirectoryWarning) {
        self.send(Request::DirectoryWarning(warning));
    }

    fn send(&self, request: Request) {
        if self.requests.send(request).is_ok() {
            let _ = (&*self.waker).write(&[1]);
        }
    }
}
