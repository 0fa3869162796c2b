//! The control plane's sans-IO core: the peer table and the handshake state machine.
//!
//! [`Core`] is fed what happened — a connection accepted or dialed, a message received on
//! connection `c`, a connection closed, an application request, a poller event, the time —
//! and answers with [`Action`]s for the I/O driver ([`crate::driver`]) to carry out: dial,
//! send a frame, close, command a poller. It reads no clock, owns no socket
//! and draws randomness only from its seeded generator (and each connection's Hello nonce
//! from the kernel), so every interleaving can be replayed in a unit test on virtual time.
//! It calls the rails' fabrics ([`RailFabric`])
//! directly: creating, connecting, staging and revoking queue pairs are synchronous and
//! non-blocking.
//!
//! # Identity
//! A peer is an incarnation reached at an address; its name is a label. Two live processes
//! with the same name are two peers. The one place a restart is detected is
//! [`Core::listener_at`]: an address this side dialed answered with a new incarnation, so
//! the old one no longer listens there — its endpoints retire (`PeerRestarted`), fresh ones
//! to the new incarnation take their place, and the queue pairs it connected here go. A
//! cluster directory, whose names are exclusive claims, reports the same through
//! [`Core::peer_changed`]. What a peer announces as its listener is only where to probe it:
//! an initiator that has had no connection for [`Policy::passive_linger`] is dialed there,
//! and its queue pairs here go unless the same incarnation answers.
//!
//! # Authentication
//! With a cluster secret ([`crate::auth`]), a connection's peer is admitted — known by its
//! incarnation, answered, sent anything but Hello, Auth and Bye — only once both sides have
//! proven the secret over both Hellos; until then what this side would send waits on the
//! connection, and anything else the peer sends closes it (`auth_failures`).
//!
//! # Handshakes
//! Every ConnectQp carries a fresh handshake id and the target's incarnation. Its reply is
//! applied only if it arrives on the connection the request went out on, names that id, and
//! the endpoint still waits for exactly that attempt; anything else is a stray reply,
//! counted and ignored. An endpoint that leaves the attempt (retired, timed out, moved to a
//! newer epoch) cancels it. A ConnectQp is answered only for the incarnation that said
//! Hello on that connection; a notification is delivered only if it names this incarnation.
//!
//! # Log events
//! Warnings go out as `tracing` events with fields ([`crate::warn`]). Each control
//! connection has a `handshake` span (its address, and once it said Hello the peer's name
//! and incarnation) and each endpoint an `endpoint` span (peer, incarnation, address, rail,
//! id), both at level `info` and entered while the core works on them: with
//! `railyard=info`, one search for an incarnation shows its connections, queue pairs and
//! retirement in order.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use tracing::field::{Empty, display};

use railyard_dataplane::fabric::tcp::TcpAttachment;
use railyard_dataplane::rng::SplitMix64;
use railyard_dataplane::sabotage::{self, Protection};
use railyard_dataplane::{Command, EndpointId, Epoch, Event};

use crate::auth::{self, ClusterSecret, Role, Transcript};
use crate::descriptor::SegmentDescriptor;
use crate::directory::{Directory, P2pDirectory};
use crate::endpoint::{Endpoint, EndpointKey, Incarnation, Input, Output, Phase};
use crate::error::ControlError;
use crate::host::HostId;
use crate::policy::Policy;
use crate::rail::{PeerLink, RailFabric, Revocation};
use crate::shared::{ControlShared, EndpointView, Notification, NotificationBody, bump};
use crate::warn::{WarningKind, control_warning};
use crate::wire::{MAC_LEN, Message, NONCE_LEN, QpSide, WireKey};

/// How long an accepted connection is safe from eviction before its Hello: time for the
/// driver to read a Hello sent right after the connect.
pub(crate) const EVICTABLE_AFTER: Duration = Duration::from_millis(100);

/// Messages that may wait on a connection for its peer to prove the cluster secret; one more
/// closes it at the next tick.
const MAX_HELD: usize = 1024;

/// Counts and emits a warning of kind `$kind` for `$core` (see [`control_warning`]).
macro_rules! warning {
    ($core:expr, $kind:ident, $($fields:tt)+) => {
        control_warning!($core.shared, $core.me.name, WarningKind::$kind, $($fields)+)
    };
}

/// A control connection, as the core names it. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ConnId(pub(crate) u64);

/// What the driver must do, in order.
#[derive(Debug)]
pub(crate) enum Action {
    /// Open a TCP connection to `addr` for `conn` and report it with [`Core::dialed`], or
    /// [`Core::closed`] if it fails at once.
    Dial {
        /// The connection's id.
        conn: ConnId,
        /// The peer's handshake listener.
        addr: SocketAddr,
    },
    /// Queue `message` on `conn` (ignored if the driver has already closed it).
    Send {
        /// The connection.
        conn: ConnId,
        /// The frame.
        message: Message,
    },
    /// Close `conn`; the core has forgotten it.
    Close {
        /// The connection.
        conn: ConnId,
    },
    /// Send `command` to rail `rail`'s poller.
    Command {
        /// The rail.
        rail: u16,
        /// The command.
        command: Command,
    },
    /// Send AddEndpoint for `view` at `epoch` to rail `rail`'s poller, and only then
    /// publish the epoch in the view: a slice prepared for it is always pushed after the
    /// command, and the poller (which drains submissions before commands) finds the
    /// endpoint at that epoch.
    AddEndpoint {
        /// The rail.
        rail: u16,
        /// The endpoint.
        view: Arc<EndpointView>,
        /// Its new epoch.
        epoch: Epoch,
    },
    /// Publish `phase` (and whether the circuit is half-open) in `view`, after the actions
    /// before it (commands to the poller).
    Publish {
        /// The endpoint.
        view: Arc<EndpointView>,
        /// Its phase.
        phase: Phase,
        /// Its circuit is half-open.
        probation: bool,
    },
}

/// What the core is told about this process.
#[derive(Clone, Debug)]
pub(crate) struct Identity {
    /// Segment name (a label).
    pub(crate) name: String,
    /// This process's incarnation.
    pub(crate) incarnation: Incarnation,
    /// Where the handshake listener is.
    pub(crate) local_addr: SocketAddr,
    /// This process's host.
    pub(crate) host: HostId,
    /// The cluster secret peers must prove, if the cluster has one ([`crate::auth`]).
    pub(crate) secret: Option<ClusterSecret>,
}

/// A peer incarnation as its Hello described it.
#[derive(Clone, Debug)]
struct PeerInfo {
    name: String,
    host: HostId,
    /// Where it says it listens (from an accepted connection's Hello): where this side
    /// probes before giving up on its target queue pairs.
    listen: Option<SocketAddr>,
}

/// One control connection, either direction.
#[derive(Debug)]
struct Conn {
    /// Dialed: the peer's handshake listener. Accepted: the peer's source address.
    addr: SocketAddr,
    dialed: bool,
    /// The local address the connection uses, once known.
    local_ip: Option<IpAddr>,
    /// The incarnation its Hello announced, once it is admitted (with a cluster secret:
    /// once both sides proved it).
    peer: Option<Incarnation>,
    /// This side's Hello nonce on it.
    nonce: [u8; NONCE_LEN],
    /// The peer's Hello, while its proof of the cluster secret is awaited.
    unproven: Option<Message>,
    /// Messages to send once the peer is admitted (nothing but Hello, Auth and Bye goes
    /// out before that).
    held: Vec<Message>,
    /// Descriptors asked for on it (GetDescriptor) and not yet received; a Descriptor
    /// nobody asked for closes the connection.
    descriptors_asked: u32,
    opened: Instant,
    /// When the peer last said anything on it.
    last_heard: Instant,
    /// When this side last sent a Ping on it.
    last_ping: Option<Instant>,
    /// Its `handshake` span.
    span: tracing::Span,
}

/// An application's connect waiting for the peer's Hello and descriptor.
struct Waiting {
    conn: ConnId,
    local_rail: u16,
    remote_rail: u16,
    reply: Sender<Result<Arc<EndpointView>, ControlError>>,
    deadline: Instant,
}

/// The handshake an endpoint waits for.
struct Pending<Q> {
    epoch: Epoch,
    handshake: u64,
    /// The connection the ConnectQp went out on: the only one its reply is taken from.
    conn: ConnId,
    qp: Q,
    /// When the ConnectQp went out.
    sent: Instant,
}

struct Active<Q> {
    machine: Endpoint,
    view: Arc<EndpointView>,
    /// The peer's handshake listener.
    addr: SocketAddr,
    pending: Option<Pending<Q>>,
    /// The epoch and number of the newest queue pair offered to the peer, until it is
    /// announced retired (RetireQp).
    offered: Option<(Epoch, u32)>,
    /// The phase (and probation) last handed to the driver to publish in `view`.
    published: Option<(Phase, bool)>,
    /// The peer's fence generation for this side, as its last ConnectQp reply told it.
    fence: Option<u64>,
    /// Its `endpoint` span.
    span: tracing::Span,
}

/// An initiator with target queue pairs here and no control connection.
#[derive(Clone, Copy, Debug)]
struct Orphan {
    /// Since when it has had none.
    since: Instant,
    /// When a probe of its listener was started, if one was.
    probed: Option<Instant>,
}

struct Passive<Q> {
    /// The peer's queue pair is connected to it; immediates arrive on it.
    qp: Q,
    remote_qp_num: u32,
    local: QpSide,
    /// The connection its ConnectQp came on: a ConnectQp still buffered on an older one
    /// (which the initiator gave up) never replaces it.
    conn: ConnId,
}

/// The peer table and handshake state machine. See the module docs.
pub(crate) struct Core<F: RailFabric> {
    me: Identity,
    policy: Policy,
    shared: Arc<ControlShared>,
    fabrics: Vec<F>,
    conns: HashMap<ConnId, Conn>,
    next_conn: u64,
    /// The open dialed connection to each handshake address.
    dialed: HashMap<SocketAddr, ConnId>,
    /// Which incarnation listens at each address dialed: the newest Hello's.
    listeners: HashMap<SocketAddr, Incarnation>,
    /// What each peer incarnation's Hello said.
    peers: HashMap<Incarnation, PeerInfo>,
    descriptors: P2pDirectory,
    active: HashMap<(u16, EndpointId), Active<F::Qp>>,
    by_key: HashMap<EndpointKey, EndpointId>,
    /// Ids whose endpoint drained, per rail.
    free_ids: Vec<(u16, EndpointId)>,
    /// The next first epoch of each id that was used (epochs continue across occupants).
    next_epochs: HashMap<(u16, EndpointId), Epoch>,
    /// Handshakes waiting for their reply, by id.
    handshakes: HashMap<u64, (u16, EndpointId)>,
    passive: HashMap<WireKey, Passive<F::Connected>>,
    /// This side's fence generation for each initiator it revoked (absent: 0), told in every
    /// ConnectQp reply. Kept for good: an initiator that reconnects after any number of
    /// revokes must still see that one happened.
    fences: HashMap<Incarnation, u64>,
    /// Initiators holding target queue pairs here with no control connection left.
    orphans: HashMap<Incarnation, Orphan>,
    /// When each listener was last dialed again for endpoints left without a connection
    /// (at most once per keepalive interval).
    redialed: HashMap<SocketAddr, Instant>,
    waiting: Vec<Waiting>,
    rng: SplitMix64,
    actions: VecDeque<Action>,
    /// Scratch for immediates taken from passive queue pairs.
    immediates: Vec<u32>,
    /// Only with [`Protection::IncarnationCheck`] off: each newcomer taken for the
    /// predecessor at its address (newcomer → predecessor).
    #[cfg(feature = "sabotage")]
    mistaken: HashMap<Incarnation, Incarnation>,
}

impl<F: RailFabric> Core<F> {
    /// A core over `fabrics` (one per rail), drawing endpoint jitter and handshake ids from
    /// `seed`.
    pub(crate) fn new(
        me: Identity,
        policy: Policy,
        seed: u64,
        fabrics: Vec<F>,
        shared: Arc<ControlShared>,
    ) -> Self {
        Self {
            rng: SplitMix64::new(seed ^ me.incarnation.0),
            me,
            policy,
            shared,
            fabrics,
            conns: HashMap::new(),
            next_conn: 0,
            dialed: HashMap::new(),
            listeners: HashMap::new(),
            peers: HashMap::new(),
            descriptors: P2pDirectory::new(),
            active: HashMap::new(),
            by_key: HashMap::new(),
            free_ids: Vec::new(),
            next_epochs: HashMap::new(),
            handshakes: HashMap::new(),
            passive: HashMap::new(),
            fences: HashMap::new(),
            orphans: HashMap::new(),
            redialed: HashMap::new(),
            waiting: Vec::new(),
            actions: VecDeque::new(),
            immediates: Vec::new(),
            #[cfg(feature = "sabotage")]
            mistaken: HashMap::new(),
        }
    }

    /// Whether `conn`'s peer is admitted (said Hello, and proved the secret if there is one).
    pub(crate) fn admitted(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .is_some_and(|state| state.peer.is_some())
    }

    /// Whether peers must prove the cluster secret before anything but Hello and Auth.
    pub(crate) fn proof_required(&self) -> bool {
        self.me.secret.is_some()
    }

    /// The next thing the driver must do.
    pub(crate) fn next_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// This process's segment descriptor as it stands.
    pub(crate) fn local_descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.me.name.clone(),
            incarnation: self.me.incarnation,
            handshake_addr: self.me.local_addr.to_string(),
            rails: self.fabrics.iter().map(RailFabric::describe).collect(),
            regions: self.shared.regions(),
        }
    }

    fn send(&mut self, conn: ConnId, message: Message) {
        #[cfg(feature = "sabotage")]
        let message = self.undo_mistaken_identity(message);
        let proof_required = self.me.secret.is_some();
        if let Some(state) = self.conns.get_mut(&conn) {
            let handshake = matches!(
                message,
                Message::Hello { .. } | Message::Auth { .. } | Message::Bye
            );
            if proof_required && state.peer.is_none() && !handshake {
                // Nothing for a peer that has not proven the secret yet.
                // One past the bound marks the connection, which closes at the next tick.
                if state.held.len() <= MAX_HELD {
                    state.held.push(message);
                } else if matches!(message, Message::Notify { .. }) {
                    bump(&self.shared.counters.notifications_dropped);
                }
                return;
            }
        }
        self.actions.push_back(Action::Send { conn, message });
    }

    /// With [`Protection::IncarnationCheck`] off (sabotage builds only), a process that
    /// answers at an address this side dialed is taken for the incarnation that answered
    /// there before — the address treated as an identity. Returns the incarnation the Hello
    /// is then taken to say.
    #[cfg(feature = "sabotage")]
    fn mistake_identity(&mut self, conn: ConnId, said: Incarnation) -> Incarnation {
        if !sabotage::is_off(Protection::IncarnationCheck) {
            return said;
        }
        let Some(state) = self.conns.get(&conn).filter(|state| state.dialed) else {
            return said;
        };
        match self.listeners.get(&state.addr) {
            Some(&before) if before != said && state.peer.is_none() => {
                self.mistaken.insert(said, before);
                before
            }
            _ => said,
        }
    }

    /// What a mistaken newcomer says about itself is read as its predecessor's (sabotage).
    #[cfg(feature = "sabotage")]
    fn mistake_incoming(&self, mut message: Message) -> Message {
        let mistake = |incarnation: &mut Incarnation| {
            if let Some(&before) = self.mistaken.get(incarnation) {
                *incarnation = before;
            }
        };
        match &mut message {
            Message::Descriptor(descriptor) => mistake(&mut descriptor.incarnation),
            Message::ConnectQpReply { key, .. } => mistake(&mut key.target),
            _ => {}
        }
        message
    }

    /// What is addressed to a mistaken predecessor goes to its newcomer (sabotage).
    #[cfg(feature = "sabotage")]
    fn undo_mistaken_identity(&self, mut message: Message) -> Message {
        let undo = |incarnation: &mut Incarnation| {
            if let Some((&newcomer, _)) = self.mistaken.iter().find(|(_, b)| **b == *incarnation) {
                *incarnation = newcomer;
            }
        };
        match &mut message {
            Message::ConnectQp { key, .. } | Message::RetireQp { key, .. } => undo(&mut key.target),
            Message::Notify { target, .. } => undo(target),
            _ => {}
        }
        message
    }

    /// Asks for the peer's descriptor on `conn`; connects waiting on it wait for the answer.
    fn ask_descriptor(&mut self, conn: ConnId) {
        if let Some(state) = self.conns.get_mut(&conn) {
            state.descriptors_asked += 1;
            self.send(conn, Message::GetDescriptor);
        }
    }

    /// This side's Hello on `conn` (its nonce is the connection's own).
    fn hello(&self, conn: ConnId) -> Message {
        Message::Hello {
            name: self.me.name.clone(),
            incarnation: self.me.incarnation,
            host: self.me.host,
            listen: self.me.local_addr.to_string(),
            nonce: self
                .conns
                .get(&conn)
                .map_or([0; NONCE_LEN], |state| state.nonce),
        }
    }

    // ---- connections -------------------------------------------------------------------

    /// Whether the listener may take another connection: fewer than
    /// [`Policy::max_connections`] accepted, and either fewer than
    /// [`Policy::max_handshakes`] of them before their Hello or the oldest of those silent
    /// for [`EVICTABLE_AFTER`] — [`Self::accepted`] then closes it to make room, so a flood
    /// of silent connections churns but cannot keep a peer that speaks out.
    pub(crate) fn may_accept(&self, now: Instant) -> bool {
        let mut accepted = 0;
        let mut silent = 0;
        let mut evictable = false;
        for conn in self.conns.values().filter(|conn| !conn.dialed) {
            accepted += 1;
            if conn.peer.is_none() {
                silent += 1;
                evictable |= self.evictable(conn, now);
            }
        }
        let room_for_one_more = silent < self.policy.max_handshakes || evictable;
        accepted < self.policy.max_connections && room_for_one_more
    }

    /// Whether the not-yet-admitted connection `conn` may make room for a newer one: one
    /// that said nothing after [`EVICTABLE_AFTER`]; one whose proof of the cluster secret is
    /// under way only after half the connect timeout, so that a member a long round trip
    /// away is not pushed out by a flood of Hellos.
    fn evictable(&self, conn: &Conn, now: Instant) -> bool {
        let grace = if conn.unproven.is_some() {
            self.policy.connect_timeout / 2
        } else {
            EVICTABLE_AFTER
        };
        now.duration_since(conn.opened) >= grace
    }

    fn new_conn(&mut self, addr: SocketAddr, dialed: bool, now: Instant) -> ConnId {
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        // A root: a connection opened while an endpoint's span is entered is not part of
        // that endpoint's life (nor the other way round).
        let span = tracing::info_span!(
            target: "railyard::control",
            parent: None,
            "handshake",
            engine = %self.me.name,
            addr = %addr,
            dialed,
            peer = Empty,
            incarnation = Empty,
        );
        span.in_scope(|| {
            tracing::debug!(target: "railyard::control", "control connection opened");
        });
        self.conns.insert(
            id,
            Conn {
                addr,
                dialed,
                local_ip: None,
                peer: None,
                nonce: auth::nonce(),
                unproven: None,
                held: Vec::new(),
                descriptors_asked: 0,
                opened: now,
                last_heard: now,
                last_ping: None,
                span,
            },
        );
        id
    }

    /// The driver accepted a connection from `addr` on local address `local_ip`.
    pub(crate) fn accepted(&mut self, addr: SocketAddr, local_ip: IpAddr, now: Instant) -> ConnId {
        let conn = self.new_conn(addr, false, now);
        if let Some(state) = self.conns.get_mut(&conn) {
            state.local_ip = Some(local_ip);
        }
        let silent = || {
            self.conns
                .iter()
                .filter(|(_, state)| !state.dialed && state.peer.is_none())
        };
        if silent().count() > self.policy.max_handshakes {
            // Only one past its eviction grace (never the new one); those that said nothing
            // go before those whose proof is under way.
            if let Some(oldest) = silent()
                .filter(|(_, state)| self.evictable(state, now))
                .min_by_key(|(id, state)| (state.unproven.is_some(), state.opened, **id))
                .map(|(&id, _)| id)
            {
                let reason = format!(
                    "more than {} connections have not said Hello; the oldest goes",
                    self.policy.max_handshakes
                );
                self.refuse(oldest, &reason, now);
            }
        }
        conn
    }

    /// The driver started the dial of `conn` from local address `local_ip`.
    pub(crate) fn dialed(&mut self, conn: ConnId, local_ip: IpAddr) {
        if let Some(state) = self.conns.get_mut(&conn) {
            state.local_ip = Some(local_ip);
        }
    }

    /// The open dialed connection to `addr`, dialing it if there is none: Hello and
    /// GetDescriptor go first.
    fn conn_to(&mut self, addr: SocketAddr, now: Instant) -> ConnId {
        if let Some(&conn) = self.dialed.get(&addr) {
            return conn;
        }
        let conn = self.new_conn(addr, true, now);
        self.dialed.insert(addr, conn);
        self.actions.push_back(Action::Dial { conn, addr });
        self.send(conn, self.hello(conn));
        self.ask_descriptor(conn);
        conn
    }

    /// The driver saw `conn` close or fail (`reason`): handshakes waiting on it fail.
    pub(crate) fn closed(&mut self, conn: ConnId, reason: &str, now: Instant) {
        let Some(state) = self.conns.remove(&conn) else {
            return;
        };
        state.span.in_scope(|| {
            tracing::info!(target: "railyard::control", reason, "control connection closed");
        });
        self.actions.push_back(Action::Close { conn });
        if self.dialed.get(&state.addr) == Some(&conn) {
            self.dialed.remove(&state.addr);
        }
        let (failed, still_waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|waiting| waiting.conn == conn);
        self.waiting = still_waiting;
        let reason = if state.peer.is_none() && state.unproven.is_some() {
            format!(
                "{reason}, before the cluster secret was proven both ways (has the peer the same \
                 secret?)"
            )
        } else {
            reason.to_string()
        };
        for waiting in failed {
            let _ = waiting.reply.send(Err(ControlError::Unreachable {
                addr: state.addr,
                reason: reason.clone(),
            }));
        }
        let failing: Vec<(u16, EndpointId, Epoch)> = self
            .active
            .iter()
            .filter_map(|(&(rail, id), active)| {
                let pending = active.pending.as_ref()?;
                (pending.conn == conn).then_some((rail, id, pending.epoch))
            })
            .collect();
        for (rail, id, epoch) in failing {
            self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
        }
        if let Some(peer) = state.peer {
            self.forget_if_unused(peer);
        }
    }

    /// Forgets what `peer`'s Hello and descriptor said, and where it listens, once nothing
    /// refers to it any more — no connection, endpoint or target queue pair — so that peers
    /// that come and go (or a flood of Hellos) cost nothing lasting. (With nothing of it
    /// left, there is nothing to retire when another process takes its address.)
    fn forget_if_unused(&mut self, peer: Incarnation) {
        let used = self.conns.values().any(|conn| conn.peer == Some(peer))
            || self.active.values().any(|a| a.machine.key().peer == peer)
            || self.passive.keys().any(|key| key.initiator == peer);
        if !used {
            self.peers.remove(&peer);
            self.forget_descriptor(peer);
            self.listeners.retain(|_, listener| *listener != peer);
        }
    }

    /// Closes `conn` for breaking a bound or the protocol: counted, and a warning names the
    /// peer.
    pub(crate) fn refuse(&mut self, conn: ConnId, reason: &str, now: Instant) {
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        let peer = state
            .peer
            .and_then(|peer| self.peers.get(&peer))
            .map(|info| info.name.as_str());
        bump(&self.shared.counters.connections_closed);
        state.span.in_scope(|| {
            warning!(
                self,
                Connection,
                addr = %state.addr,
                peer,
                incarnation = state.peer.map(display),
                reason,
                "closing a control connection that broke a bound or the protocol"
            );
        });
        self.closed(conn, reason, now);
    }

    /// Sends Bye on every connection (the driver flushes them before stopping).
    pub(crate) fn say_goodbye(&mut self) {
        // With a secret, a Bye before the proof reads as a stranger's: those connections
        // just close.
        let proof_required = self.me.secret.is_some();
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, state)| !proof_required || state.peer.is_some())
            .map(|(&conn, _)| conn)
            .collect();
        for conn in conns {
            self.send(conn, Message::Bye);
        }
    }

    // ---- messages ----------------------------------------------------------------------

    /// A whole message arrived on `conn`.
    pub(crate) fn received(&mut self, conn: ConnId, message: Message, now: Instant) {
        #[cfg(feature = "sabotage")]
        let message = self.mistake_incoming(message);
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        state.last_heard = now;
        let speaker = state.peer;
        let span = state.span.clone();
        let _entered = span.enter();
        let handshake = matches!(
            message,
            Message::Hello { .. } | Message::Auth { .. } | Message::Bye
        );
        if speaker.is_none() && !handshake {
            if self.me.secret.is_some() {
                return self.auth_failed(
                    conn,
                    "a message before the cluster secret was proven",
                    now,
                );
            }
            return self.refuse(conn, "a message before Hello", now);
        }
        match message {
            Message::Hello { .. } => self.on_hello(conn, message, now),
            Message::Auth { mac } => self.on_auth(conn, &mac, now),
            Message::GetDescriptor => {
                let descriptor = self.local_descriptor();
                self.send(conn, Message::Descriptor(descriptor));
            }
            Message::Descriptor(descriptor) => self.on_descriptor(conn, descriptor, now),
            Message::ConnectQp {
                key,
                epoch,
                handshake,
                side,
            } => self.on_connect_qp(conn, key, epoch, handshake, &side),
            Message::ConnectQpReply {
                key,
                epoch,
                handshake,
                fence,
                result,
            } => self.on_connect_reply(conn, key, (epoch, handshake), fence, result, now),
            Message::RetireQp {
                key,
                epoch: _,
                qp_num,
            } => self.on_retire_qp(conn, key, qp_num),
            Message::Notify { target, bytes } => self.on_notify(conn, target, bytes),
            Message::Bye if speaker.is_none() && self.me.secret.is_some() => {
                self.auth_failed(conn, "goodbye before the cluster secret was proven", now);
            }
            Message::Bye => self.closed(conn, "the peer said goodbye", now),
            Message::Ping { nonce } => self.send(conn, Message::Pong { nonce }),
            // Heard: that is all a Pong is for.
            Message::Pong { .. } => {}
        }
    }

    /// With a cluster secret, closes connections whose peer said Hello but has not proven
    /// the secret within [`Policy::connect_timeout`] of their opening (`auth_failures`): a
    /// peer that says Hello and nothing more holds a connection no longer than that. (Those
    /// that said nothing at all, a dead host among them, time out as before.) Also closes
    /// connections on which more messages waited for the proof than [`MAX_HELD`].
    fn expire_unproven(&mut self, now: Instant) {
        if self.me.secret.is_none() {
            return;
        }
        let late: Vec<(ConnId, bool)> = self
            .conns
            .iter()
            .filter(|(_, conn)| {
                conn.held.len() > MAX_HELD
                    || (conn.unproven.is_some()
                        && now.duration_since(conn.opened) >= self.policy.connect_timeout)
            })
            .map(|(&id, conn)| (id, conn.held.len() > MAX_HELD))
            .collect();
        for (conn, overflowed) in late {
            if overflowed {
                let reason = format!(
                    "more than {MAX_HELD} messages waited for the peer to prove the cluster secret"
                );
                self.refuse(conn, &reason, now);
            } else {
                self.auth_failed(
                    conn,
                    "no proof of the cluster secret within the connect timeout",
                    now,
                );
            }
        }
    }

    /// Pings quiet connections; a peer that has said nothing for
    /// [`Policy::liveness_timeout`] is unreachable: its connection closes and, if this side
    /// dialed it, the endpoints to it at that address open their circuits at once.
    fn check_liveness(&mut self, now: Instant) {
        if sabotage::is_off(Protection::Liveness) {
            return;
        }
        self.redial_live_peers(now);
        let mut quiet = Vec::new();
        let mut silent = Vec::new();
        for (&id, conn) in &self.conns {
            let heard = now.duration_since(conn.last_heard);
            // A dialed connection to a listener this side has endpoints to must say Hello
            // within the same bound (a stopped process's kernel still accepts the connect).
            let peer = match conn.peer {
                Some(peer) => peer,
                None if conn.dialed => match self.listeners.get(&conn.addr) {
                    Some(&listener) => listener,
                    None => continue,
                },
                None => continue,
            };
            if heard >= self.policy.liveness_timeout {
                silent.push((id, peer, conn.addr, conn.dialed, heard));
            } else if conn.peer.is_some()
                && heard >= self.policy.keepalive_interval
                && conn
                    .last_ping
                    .is_none_or(|at| now.duration_since(at) >= self.policy.keepalive_interval)
            {
                quiet.push(id);
            }
        }
        for id in quiet {
            let nonce = self.rng.next_u64();
            if let Some(conn) = self.conns.get_mut(&id) {
                conn.last_ping = Some(now);
            }
            self.send(id, Message::Ping { nonce });
        }
        for (id, peer, addr, dialed, heard) in silent {
            if dialed {
                let endpoints: Vec<(u16, EndpointId)> = self
                    .active
                    .iter()
                    .filter(|(_, a)| {
                        a.addr == addr
                            && a.machine.key().peer == peer
                            && a.machine.phase() != Phase::Retired
                    })
                    .map(|(&key, _)| key)
                    .collect();
                if !endpoints.is_empty() {
                    self.shared.record_detection(heard);
                    let name = self.peer_name(peer);
                    warning!(
                        self,
                        Retire,
                        peer = %name,
                        incarnation = %peer,
                        addr = %addr,
                        silent = ?heard,
                        "peer unreachable: silent past the liveness timeout; failing its work fast"
                    );
                }
                for (rail, endpoint) in endpoints {
                    self.handle_input(rail, endpoint, Input::PeerUnreachable, now);
                }
            }
            self.closed(id, "no answer within the liveness timeout", now);
        }
    }

    /// Dials again the listeners of peers with endpoints that carry traffic (ready, or
    /// backing off) but no control connection — it closed under them (a stall of either
    /// side, a refusal): without one, nothing would notice the peer stop. An endpoint whose
    /// circuit is open dials when its cooldown ends.
    fn redial_live_peers(&mut self, now: Instant) {
        let interval = self.policy.keepalive_interval;
        let orphaned: HashSet<SocketAddr> = self
            .active
            .values()
            .filter(|a| matches!(a.machine.phase(), Phase::Ready | Phase::Backoff))
            .map(|a| a.addr)
            .filter(|addr| !self.dialed.contains_key(addr))
            .filter(|addr| {
                self.redialed
                    .get(addr)
                    .is_none_or(|&at| now.duration_since(at) >= interval)
            })
            .collect();
        self.redialed
            .retain(|_, at| now.duration_since(*at) < interval);
        for addr in orphaned {
            self.redialed.insert(addr, now);
            self.conn_to(addr, now);
        }
    }

    /// The driver read bytes from `conn`: the peer is alive even if its frame is not whole
    /// yet (a large descriptor on a slow link).
    pub(crate) fn heard(&mut self, conn: ConnId, now: Instant) {
        if let Some(state) = self.conns.get_mut(&conn) {
            state.last_heard = now;
        }
    }

    /// A Hello on `conn`. Without a cluster secret its peer is admitted at once; with one,
    /// the Hellos are exchanged first and the peer is admitted once both proofs are in
    /// ([`Self::on_auth`]).
    fn on_hello(&mut self, conn: ConnId, hello: Message, now: Instant) {
        let Message::Hello { incarnation, .. } = hello else {
            return;
        };
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        let said = match (state.peer, &state.unproven) {
            (Some(peer), _) => Some(peer),
            (None, Some(Message::Hello { incarnation, .. })) => Some(*incarnation),
            (None, _) => None,
        };
        match said {
            Some(known) if known != incarnation => {
                let reason = format!("a second Hello as {incarnation} after {known}");
                return self.refuse(conn, &reason, now);
            }
            Some(_) => return,
            None => {}
        }
        let (dialed, addr) = (state.dialed, state.addr);
        let reflected = matches!(&hello, Message::Hello { nonce, .. }
            if self.conns.iter().any(|(&other, state)| other != conn && state.nonce == *nonce));
        if reflected && self.me.secret.is_some() {
            // A Hello this process sent on another connection, handed back to it.
            return self.auth_failed(conn, "this process's own Hello, reflected", now);
        }
        if !dialed {
            self.send(conn, self.hello(conn));
        }
        let Some(secret) = self.me.secret.clone() else {
            return self.admit(conn, hello, now);
        };
        if let Some(state) = self.conns.get_mut(&conn) {
            state.unproven = Some(hello.clone());
        }
        if dialed {
            // The listener's Hello is in: the dialer proves first, for the address it dialed.
            let mine = self.hello(conn);
            let transcript = Transcript {
                dialer_hello: &mine,
                listener_hello: &hello,
                dialed: addr,
            };
            let proof = auth::prove(&secret, Role::Dialer, &transcript);
            self.send(conn, Message::Auth { mac: proof });
        }
    }

    /// The addresses a dialer may have dialed to reach this side on accepted connection
    /// `state`: the connection's own local address at the listener's port, and the handshake
    /// address this process announces.
    fn reached_at(&self, state: &Conn) -> Vec<SocketAddr> {
        let port = self.me.local_addr.port();
        let mut addresses: Vec<SocketAddr> = state
            .local_ip
            .map(|ip| SocketAddr::new(ip, port))
            .into_iter()
            .collect();
        if !addresses.contains(&self.me.local_addr) {
            addresses.push(self.me.local_addr);
        }
        addresses
    }

    /// A proof of the cluster secret on `conn`: checked against both Hellos; the listener
    /// answers a good one with its own, and either side admits the peer once the other's
    /// proof is good. Anything else closes the connection.
    fn on_auth(&mut self, conn: ConnId, proof: &[u8; MAC_LEN], now: Instant) {
        let Some(secret) = self.me.secret.clone() else {
            return self.refuse(conn, "an Auth, but this process has no cluster secret", now);
        };
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        let Some(theirs) = state.unproven.clone() else {
            return self.auth_failed(conn, "an Auth before Hello, or a second one", now);
        };
        let mine = self.hello(conn);
        let proven = if state.dialed {
            let transcript = Transcript {
                dialer_hello: &mine,
                listener_hello: &theirs,
                dialed: state.addr,
            };
            auth::verify(&secret, Role::Listener, &transcript, proof).then_some(transcript)
        } else {
            self.reached_at(state).into_iter().find_map(|dialed| {
                let transcript = Transcript {
                    dialer_hello: &theirs,
                    listener_hello: &mine,
                    dialed,
                };
                auth::verify(&secret, Role::Dialer, &transcript, proof).then_some(transcript)
            })
        };
        let Some(transcript) = proven else {
            return self.auth_failed(conn, "a wrong proof of the cluster secret", now);
        };
        if !state.dialed {
            let answer = auth::prove(&secret, Role::Listener, &transcript);
            self.send(conn, Message::Auth { mac: answer });
        }
        if let Some(state) = self.conns.get_mut(&conn) {
            state.unproven = None;
        }
        self.admit(conn, theirs, now);
    }

    /// Closes `conn`, whose peer did not prove the cluster secret: counted apart, and a
    /// warning names the address.
    fn auth_failed(&mut self, conn: ConnId, reason: &str, now: Instant) {
        let Some(state) = self.conns.get(&conn) else {
            return;
        };
        bump(&self.shared.counters.auth_failures);
        state.span.in_scope(|| {
            warning!(
                self,
                Auth,
                addr = %state.addr,
                reason,
                "closing a control connection whose peer did not prove the cluster secret"
            );
        });
        self.closed(conn, reason, now);
    }

    /// The peer of `conn`, whose Hello was `hello`, is who it said (and, with a cluster
    /// secret, a member): it is known from now on, and what waited for it goes out.
    fn admit(&mut self, conn: ConnId, hello: Message, now: Instant) {
        let Message::Hello {
            name,
            incarnation,
            host,
            listen,
            ..
        } = hello
        else {
            return;
        };
        #[cfg(feature = "sabotage")]
        let incarnation = self.mistake_identity(conn, incarnation);
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        state.peer = Some(incarnation);
        state.span.record("peer", name.as_str());
        state.span.record("incarnation", display(incarnation));
        tracing::info!(target: "railyard::control", listen, "peer said Hello");
        let (dialed, addr) = (state.dialed, state.addr);
        let held = std::mem::take(&mut state.held);
        for message in held {
            self.send(conn, message);
        }
        let listen = if dialed {
            Some(addr)
        } else {
            announced_listener(&listen, addr)
        };
        self.peers
            .insert(incarnation, PeerInfo { name, host, listen });
        if dialed {
            self.listener_at(addr, incarnation, now);
        }
        self.resolve_waiting(now);
    }

    /// The one place a restart is detected: `incarnation` answered at `addr`, an address this
    /// side dialed. If another incarnation listened there before, it is gone. (What a peer
    /// announces in its own Hello is only a hint of where to probe it: two containers
    /// behind one NAT, or loopback addresses on two hosts, can announce the same one.)
    fn listener_at(&mut self, addr: SocketAddr, incarnation: Incarnation, now: Instant) {
        match self.listeners.insert(addr, incarnation) {
            Some(old) if old != incarnation => {
                let name = self.peer_name(incarnation);
                self.peer_replaced(old, incarnation, name, addr, now);
            }
            _ => {}
        }
    }

    /// Everything of `old` goes: its active endpoints fail with `PeerRestarted`, its passive
    /// queue pairs are dropped. Fresh endpoints to `new` at `addr`, on the same rails, take
    /// the retired ones' place (an application that asks for the peer again gets them;
    /// nothing meant for `old` ever reaches them).
    fn peer_replaced(
        &mut self,
        old: Incarnation,
        new: Incarnation,
        name: String,
        addr: SocketAddr,
        now: Instant,
    ) {
        bump(&self.shared.counters.peer_restarts);
        warning!(
            self,
            Retire,
            peer = %name,
            incarnation = %old,
            successor = %new,
            addr = %addr,
            "peer restarted: a new incarnation listens at its address; retiring its endpoints"
        );
        let stale: Vec<(u16, EndpointId, u16)> = self
            .active
            .iter()
            .filter(|(_, a)| a.machine.key().peer == old && a.machine.phase() != Phase::Retired)
            .map(|(&(rail, id), a)| (rail, id, a.machine.key().remote_rail))
            .collect();
        for &(rail, id, _) in &stale {
            self.handle_input(rail, id, Input::PeerRestarted, now);
        }
        for (rail, _, remote_rail) in stale {
            self.endpoint_for(name.clone(), new, addr, rail, remote_rail, now);
        }
        self.forget_incarnation(old);
    }

    /// The name `peer`'s Hello gave (empty if it never said Hello).
    fn peer_name(&self, peer: Incarnation) -> String {
        self.peers
            .get(&peer)
            .map_or_else(String::new, |info| info.name.clone())
    }

    /// Drops what this side keeps for a peer incarnation that is gone: its Hello, its
    /// descriptor and the passive queue pairs it connected (teardowns).
    fn forget_incarnation(&mut self, gone: Incarnation) {
        self.peers.remove(&gone);
        self.forget_descriptor(gone);
        let before = self.passive.len();
        self.passive.retain(|key, _| key.initiator != gone);
        for _ in self.passive.len()..before {
            bump(&self.shared.counters.teardowns);
        }
    }

    /// Forgets `peer`'s descriptor, and what the rails' fabrics learnt from it.
    fn forget_descriptor(&mut self, peer: Incarnation) {
        // Stale or not: a peer that crashed had its descriptor invalidated by the reconnect
        // attempts before its restart was seen.
        if let Some(descriptor) = self.descriptors.forget(peer) {
            for fabric in &self.fabrics {
                fabric.forget_descriptor(&descriptor);
            }
        }
    }

    fn on_descriptor(&mut self, conn: ConnId, descriptor: SegmentDescriptor, now: Instant) {
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        let incarnation = descriptor.incarnation;
        if state.descriptors_asked == 0 {
            return self.refuse(conn, "a descriptor nobody asked for", now);
        }
        if state.peer != Some(incarnation) {
            let reason = format!("a descriptor of {incarnation} from another incarnation");
            return self.refuse(conn, &reason, now);
        }
        state.descriptors_asked -= 1;
        for fabric in &self.fabrics {
            fabric.learn_descriptor(&descriptor);
        }
        let fresh = self.descriptors.record(descriptor);
        for active in self.active.values() {
            if active.machine.key().peer == incarnation {
                active.view.set_descriptor(fresh.clone());
            }
        }
        self.resolve_waiting(now);
    }

    fn on_notify(&mut self, conn: ConnId, target: Incarnation, bytes: Vec<u8>) {
        let Some(from) = self.conns.get(&conn).and_then(|state| state.peer) else {
            return;
        };
        let name = self.peer_name(from);
        if target != self.me.incarnation {
            bump(&self.shared.counters.notifications_refused);
            warning!(
                self,
                Handshake,
                peer = %name,
                incarnation = %from,
                target = %target,
                "refusing a notification meant for another incarnation"
            );
            return;
        }
        self.shared.deliver([Notification {
            from: name,
            incarnation: from,
            body: NotificationBody::Bytes(bytes),
        }]);
    }

    /// The initiator of a passive queue pair retired it: drop it if it is still that one,
    /// so nothing buffered from it executes. Only the initiator itself may say so.
    fn on_retire_qp(&mut self, conn: ConnId, key: WireKey, qp_num: u32) {
        let speaker = self.conns.get(&conn).and_then(|state| state.peer);
        if speaker != Some(key.initiator) || key.target != self.me.incarnation {
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

    // ---- the target's side of a handshake ----------------------------------------------

    /// What is known of the peer `incarnation` reached over `conn`.
    fn link(&self, conn: ConnId, incarnation: Incarnation) -> PeerLink {
        PeerLink {
            same_host: self
                .peers
                .get(&incarnation)
                .is_some_and(|peer| peer.host.same_host_as(&self.me.host)),
            local_ip: self
                .conns
                .get(&conn)
                .and_then(|state| state.local_ip)
                .unwrap_or(self.me.local_addr.ip()),
        }
    }

    fn on_connect_qp(
        &mut self,
        conn: ConnId,
        key: WireKey,
        epoch: u64,
        handshake: u64,
        side: &QpSide,
    ) {
        let speaker = self.conns.get(&conn).and_then(|state| state.peer);
        let result = if speaker == Some(key.initiator) {
            let link = self.link(conn, key.initiator);
            self.answer_connect_qp(key, side, &link, conn)
        } else {
            bump(&self.shared.counters.refused);
            let reason = format!(
                "the queue pair is asked for {} on the connection of {}",
                key.initiator,
                speaker.map_or_else(|| "no one".into(), |s| s.to_string())
            );
            warning!(
                self,
                Handshake,
                incarnation = %key.initiator,
                speaker = speaker.map(display),
                rail = key.target_rail,
                epoch,
                reason,
                "refusing a ConnectQp"
            );
            Err(reason)
        };
        let fence = self.fences.get(&key.initiator).copied().unwrap_or(0);
        self.send(
            conn,
            Message::ConnectQpReply {
                key,
                epoch,
                handshake,
                fence,
                result,
            },
        );
    }

    fn answer_connect_qp(
        &mut self,
        key: WireKey,
        side: &QpSide,
        link: &PeerLink,
        conn: ConnId,
    ) -> Result<QpSide, String> {
        if key.target != self.me.incarnation {
            bump(&self.shared.counters.refused);
            return Err(format!(
                "the queue pair is meant for incarnation {}, this process is {}",
                key.target, self.me.incarnation
            ));
        }
        let Some(fabric) = self.fabrics.get(usize::from(key.target_rail)) else {
            bump(&self.shared.counters.refused);
            return Err(format!(
                "rail {} does not exist (this process has {})",
                key.target_rail,
                self.fabrics.len()
            ));
        };
        let existing = self.passive.get(&key);
        if let Some(existing) = existing {
            if existing.remote_qp_num == side.info.qp_num
                && !sabotage::is_off(Protection::IdempotentReplies)
            {
                bump(&self.shared.counters.idempotent_replies);
                return Ok(existing.local.clone());
            }
            if existing.conn > conn {
                bump(&self.shared.counters.refused);
                return Err(
                    "a ConnectQp from an older connection than the queue pair it would replace"
                        .into(),
                );
            }
        } else {
            let of_peer = self
                .passive
                .keys()
                .filter(|held| held.initiator == key.initiator)
                .count();
            if of_peer >= self.policy.max_queue_pairs_per_peer
                || self.passive.len() >= self.policy.max_target_queue_pairs
            {
                bump(&self.shared.counters.refused);
                return Err(format!(
                    "too many queue pairs: {of_peer} of {} held here (at most {} per peer, {} in all)",
                    key.initiator,
                    self.policy.max_queue_pairs_per_peer,
                    self.policy.max_target_queue_pairs
                ));
            }
        }
        let connected = fabric
            .create_target_qp(link, side)
            .and_then(|(qp, local)| Ok((fabric.connect_qp(qp, side)?, local)));
        let (qp, local) = match connected {
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
                conn,
            },
        );
        if replaced.is_some() {
            bump(&self.shared.counters.teardowns);
        }
        Ok(local)
    }

    /// Counts a new queue pair by fabric (its side's attachment says which).
    fn count_fabric(&self, side: &QpSide) {
        if TcpAttachment::is_tcp(&side.attachment) {
            bump(&self.shared.counters.tcp_qps);
        }
    }

    // ---- the initiator's side of a handshake -------------------------------------------

    /// A ConnectQp reply for `(epoch, handshake)`, with the peer's fence generation for this
    /// side: when it changed since the endpoint's previous queue pair, the peer revoked this
    /// side meanwhile, and every slice prepared for an older epoch fails `Revoked` before
    /// the new queue pair reaches the poller.
    fn on_connect_reply(
        &mut self,
        conn: ConnId,
        key: WireKey,
        (epoch, handshake): (u64, u64),
        fence: u64,
        result: Result<QpSide, String>,
        now: Instant,
    ) {
        let speaker = self.conns.get(&conn).and_then(|state| state.peer);
        let endpoint = self.handshakes.get(&handshake).copied();
        let found = endpoint.and_then(|endpoint| Some((endpoint, self.active.get_mut(&endpoint)?)));
        let me = self.me.incarnation;
        let Some(((rail, id), active)) = found.filter(|(_, active)| {
            let machine_key = active.machine.key();
            let expected = WireKey {
                initiator: me,
                target: machine_key.peer,
                initiator_rail: machine_key.local_rail,
                target_rail: machine_key.remote_rail,
            };
            key == expected
                && speaker == Some(machine_key.peer)
                && active.pending.as_ref().is_some_and(|pending| {
                    pending.handshake == handshake
                        && pending.conn == conn
                        && pending.epoch.get() == epoch
                })
        }) else {
            bump(&self.shared.counters.stray_replies);
            return;
        };
        self.handshakes.remove(&handshake);
        let Some(pending) = active.pending.take() else {
            return;
        };
        let epoch = pending.epoch;
        if active.fence.is_some_and(|known| known != fence) {
            active.view.revoke_before(epoch);
        }
        active.fence = Some(fence);
        let fabric = &self.fabrics[usize::from(rail)];
        let outcome = result
            .and_then(|side| fabric.connect_qp(pending.qp, &side))
            .and_then(|connected| fabric.stage(id, epoch, connected));
        let span = active.span.clone();
        let _entered = span.enter();
        match outcome {
            Ok(()) => {
                let took = now.saturating_duration_since(pending.sent);
                self.shared.counters.handshake_times.record(took);
                tracing::info!(
                    target: "railyard::control",
                    epoch = epoch.get(),
                    took = ?took,
                    "queue pair connected"
                );
                self.handle_input(rail, id, Input::HandshakeDone { epoch }, now);
            }
            Err(reason) => {
                warning!(
                    self,
                    Handshake,
                    peer = %active.view.peer_name,
                    incarnation = %key.target,
                    endpoint = id.0,
                    rail,
                    epoch = epoch.get(),
                    reason,
                    "the peer refused a queue pair"
                );
                self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        }
    }

    /// Creates a queue pair for `epoch` and sends its ConnectQp with a fresh handshake id
    /// (fetching the descriptor first on a reconnect, on the same ordered connection).
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
        let span = active.span.clone();
        let _entered = span.enter();
        let conn = self.conn_to(addr, now);
        let link = self.link(conn, key.peer);
        let (qp, side) = match self.fabrics[usize::from(rail)].create_qp(&link) {
            Ok(created) => created,
            Err(reason) => {
                warning!(
                    self,
                    Handshake,
                    peer = %peer,
                    incarnation = %key.peer,
                    endpoint = id.0,
                    rail,
                    epoch = epoch.get(),
                    reason,
                    "cannot create a queue pair"
                );
                return self.handle_input(rail, id, Input::HandshakeFailed { epoch }, now);
            }
        };
        bump(&self.shared.counters.active_qps);
        self.count_fabric(&side);
        // The queue pair this one replaces is out of service for good.
        self.announce_retired_qp(rail, id, None, now);
        let qp_num = side.info.qp_num;
        if reconnect {
            bump(&self.shared.counters.reconnects);
            warning!(
                self,
                Reconnect,
                peer = %peer,
                incarnation = %key.peer,
                addr = %addr,
                endpoint = id.0,
                rail,
                epoch = epoch.get(),
                "reconnecting"
            );
            self.descriptors.invalidate(key.peer);
            self.ask_descriptor(conn);
        }
        let handshake = self.rng.next_u64();
        tracing::info!(
            target: "railyard::control",
            epoch = epoch.get(),
            qp_num,
            "queue pair offered"
        );
        self.send(
            conn,
            Message::ConnectQp {
                key: WireKey {
                    initiator: self.me.incarnation,
                    target: key.peer,
                    initiator_rail: key.local_rail,
                    target_rail: key.remote_rail,
                },
                epoch: epoch.get(),
                handshake,
                side,
            },
        );
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        if let Some(replaced) = active.pending.replace(Pending {
            epoch,
            handshake,
            conn,
            qp,
            sent: now,
        }) {
            self.handshakes.remove(&replaced.handshake);
        }
        active.offered = Some((epoch, qp_num));
        self.handshakes.insert(handshake, (rail, id));
    }

    /// Tells the target that our queue pair of `epoch` (or any, with `None`) for endpoint
    /// `id` is out of service, so that it executes nothing more it buffered from it.
    fn announce_retired_qp(
        &mut self,
        rail: u16,
        id: EndpointId,
        epoch: Option<Epoch>,
        now: Instant,
    ) {
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
        let (key, addr) = (active.machine.key(), active.addr);
        let message = Message::RetireQp {
            key: WireKey {
                initiator: self.me.incarnation,
                target: key.peer,
                initiator_rail: key.local_rail,
                target_rail: key.remote_rail,
            },
            epoch: offered_epoch.get(),
            qp_num,
        };
        // Dialing if needed: a queue pair the target keeps would still execute what it
        // buffered from it.
        let conn = self.conn_to(addr, now);
        self.send(conn, message);
    }

    // ---- application requests ----------------------------------------------------------

    /// The application wants an endpoint from `local_rail` to `remote_rail` of the process
    /// listening at `addr`; the answer goes to `reply` once its Hello and descriptor are in.
    pub(crate) fn connect(
        &mut self,
        addr: SocketAddr,
        local_rail: u16,
        remote_rail: u16,
        reply: Sender<Result<Arc<EndpointView>, ControlError>>,
        now: Instant,
    ) {
        if usize::from(local_rail) >= self.fabrics.len() {
            let _ = reply.send(Err(ControlError::UnknownRail {
                rail: local_rail,
                rails: self.fabrics.len(),
            }));
            return;
        }
        // The answer carries the peer's current descriptor, even for an endpoint that
        // exists already: its regions may have changed since it was last fetched.
        let fresh = !self.dialed.contains_key(&addr);
        let conn = self.conn_to(addr, now);
        if !fresh {
            self.ask_descriptor(conn);
        }
        self.waiting.push(Waiting {
            conn,
            local_rail,
            remote_rail,
            reply,
            deadline: now + self.policy.connect_timeout,
        });
        self.resolve_waiting(now);
    }

    /// The application retires an endpoint.
    pub(crate) fn retire(&mut self, rail: u16, id: EndpointId, now: Instant) {
        self.handle_input(rail, id, Input::Retire, now);
    }

    /// Asks incarnation `peer`, dialed at `addr`, for its descriptor again; its endpoints'
    /// views take the answer. Nothing happens without a live dialed connection to that
    /// incarnation (a reconnect fetches the descriptor anyway).
    pub(crate) fn refresh_descriptor(&mut self, addr: SocketAddr, peer: Incarnation) {
        let Some(&conn) = self.dialed.get(&addr) else {
            return;
        };
        if self.conns.get(&conn).and_then(|state| state.peer) != Some(peer) {
            return;
        }
        self.descriptors.invalidate(peer);
        self.ask_descriptor(conn);
    }

    /// Sends `bytes` to incarnation `target` at `addr`.
    pub(crate) fn notify(
        &mut self,
        addr: SocketAddr,
        target: Incarnation,
        bytes: Vec<u8>,
        now: Instant,
    ) {
        let conn = self.conn_to(addr, now);
        self.send(conn, Message::Notify { target, bytes });
    }

    /// A cluster directory saw `name` change: the same consequences as when a dialed
    /// address answers with a new incarnation; for a peer that is simply gone, its
    /// endpoints retire with `PeerUnavailable` (nothing waits for a transport timeout).
    pub(crate) fn peer_changed(&mut self, name: &str, change: PeerChange, now: Instant) {
        match change {
            PeerChange::Restarted { old, new, addr } => {
                let known = self.peers.contains_key(&old)
                    || self.active.values().any(|a| {
                        a.machine.key().peer == old && a.machine.phase() != Phase::Retired
                    });
                match self.listeners.get(&addr) {
                    // A Hello there already said who listens now (`new` itself, or a third
                    // process): the event changes nothing there; `old` is gone all the same.
                    Some(&current) if current != old => {
                        if known && current != new {
                            // A third process listens there: `old` is gone for good.
                            for (rail, id) in self.endpoints_of(old) {
                                self.handle_input(rail, id, Input::PeerRestarted, now);
                            }
                            self.forget_incarnation(old);
                        } else if known {
                            self.peer_replaced(old, new, name.to_string(), addr, now);
                        }
                    }
                    _ => {
                        self.listeners.insert(addr, new);
                        if known {
                            self.peer_replaced(old, new, name.to_string(), addr, now);
                        }
                    }
                }
            }
            PeerChange::Gone { incarnation } => self.peer_gone(name, incarnation, now),
            PeerChange::Returned { incarnation } => {
                for (rail, id) in self.endpoints_of(incarnation) {
                    self.handle_input(rail, id, Input::PeerReturned, now);
                }
            }
        }
    }

    /// The directory lost `incarnation`'s lease and nothing replaced it: its endpoints fail
    /// new work fast (their circuits open) without waiting for a transport timeout — unless
    /// its control connection is alive, which says more than the directory. Nothing is
    /// forgotten: a healthy process that lost its lease claims its name again, and then
    /// [`PeerChange::Returned`] tries its endpoints at once.
    fn peer_gone(&mut self, name: &str, incarnation: Incarnation, now: Instant) {
        // A peer this side heard from within the liveness timeout is alive whatever etcd
        // says (it lost etcd, not its peers): transfers never depend on the directory, and
        // liveness fails its work fast if it does stop.
        let alive: HashSet<SocketAddr> = self
            .conns
            .values()
            .filter(|conn| {
                conn.dialed
                    && conn.peer == Some(incarnation)
                    && now.duration_since(conn.last_heard) < self.policy.liveness_timeout
            })
            .map(|conn| conn.addr)
            .collect();
        let gone: Vec<(u16, EndpointId)> = self
            .endpoints_of(incarnation)
            .into_iter()
            .filter(|key| {
                self.active
                    .get(key)
                    .is_some_and(|active| !alive.contains(&active.addr))
            })
            .collect();
        if !gone.is_empty() {
            warning!(
                self,
                Circuit,
                peer = name,
                incarnation = %incarnation,
                "peer lost its directory lease; failing its work fast"
            );
        }
        for (rail, id) in gone {
            self.handle_input(rail, id, Input::PeerGone, now);
        }
    }

    /// The live endpoints to `incarnation`.
    fn endpoints_of(&self, incarnation: Incarnation) -> Vec<(u16, EndpointId)> {
        self.active
            .iter()
            .filter(|(_, a)| {
                a.machine.key().peer == incarnation && a.machine.phase() != Phase::Retired
            })
            .map(|(&key, _)| key)
            .collect()
    }

    /// Fences `peer` (the application's revoke): bumps its fence generation, then takes
    /// every passive queue pair of it out of service.
    pub(crate) fn revoke(&mut self, peer: Incarnation) -> Vec<Revocation> {
        // Before anything else: every reply from now on tells the peer it was fenced.
        *self.fences.entry(peer).or_default() += 1;
        self.take_down_passive(peer)
    }

    /// Takes every passive queue pair of `peer` out of service, without fencing it: its
    /// work retries on new queue pairs as after any transport failure.
    fn take_down_passive(&mut self, peer: Incarnation) -> Vec<Revocation> {
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
        let _ = self.deliver_immediates(key, &mut passive.qp);
        match self.fabrics.get(usize::from(key.target_rail)) {
            Some(fabric) => fabric.revoke(passive.qp),
            // Unreachable: passive queue pairs exist only on rails that exist.
            None => Revocation::done(),
        }
    }

    // ---- endpoints ---------------------------------------------------------------------

    /// Turns connects whose peer is known into endpoints.
    fn resolve_waiting(&mut self, now: Instant) {
        let mut still_waiting = Vec::new();
        for waiting in std::mem::take(&mut self.waiting) {
            let known = self.conns.get(&waiting.conn).and_then(|conn| {
                let incarnation = conn.peer?;
                (conn.descriptors_asked == 0).then_some((incarnation, conn.addr))
            });
            match known {
                Some((incarnation, addr)) => {
                    let name = self.peer_name(incarnation);
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
            let addr = self
                .conns
                .get(&waiting.conn)
                .map_or(self.me.local_addr, |c| c.addr);
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
            None => EndpointId(self.shared.endpoint_slots(local_rail) as u32),
        };
        let first_epoch = self
            .next_epochs
            .get(&(local_rail, id))
            .copied()
            .unwrap_or(Epoch::FIRST);
        let view = Arc::new(EndpointView::new(
            id,
            key,
            peer_name,
            first_epoch,
            self.descriptors.lookup(incarnation),
        ));
        self.shared.publish(local_rail, id, Some(view.clone()));
        let seed = self.rng.next_u64();
        let mut machine = Endpoint::new(key, self.policy.clone(), SplitMix64::new(seed));
        machine.start_at(first_epoch);
        self.by_key.insert(key, id);
        let span = tracing::info_span!(
            target: "railyard::control",
            parent: None,
            "endpoint",
            engine = %self.me.name,
            peer = %view.peer_name,
            incarnation = %incarnation,
            addr = %addr,
            rail = local_rail,
            remote_rail,
            endpoint = id.0,
        );
        span.in_scope(|| {
            tracing::info!(
                target: "railyard::control",
                first_epoch = first_epoch.get(),
                "endpoint opened"
            );
        });
        self.active.insert(
            (local_rail, id),
            Active {
                machine,
                view: view.clone(),
                addr,
                pending: None,
                offered: None,
                published: None,
                fence: None,
                span,
            },
        );
        self.handle_input(local_rail, id, Input::ConnectWanted, now);
        view
    }

    /// A poller reported `event` on rail `rail`.
    pub(crate) fn poller_event(&mut self, rail: u16, event: Event, now: Instant) {
        match event {
            Event::QpFailed {
                endpoint,
                epoch,
                status,
            } => {
                self.announce_retired_qp(rail, endpoint, Some(epoch), now);
                self.handle_input(rail, endpoint, Input::QpError { epoch, status }, now);
            }
            Event::QpFatal { endpoint, epoch } => {
                self.announce_retired_qp(rail, endpoint, Some(epoch), now);
                self.handle_input(rail, endpoint, Input::QpFatal { epoch }, now);
            }
            Event::ConnectFailed {
                endpoint, epoch, ..
            } => {
                self.announce_retired_qp(rail, endpoint, Some(epoch), now);
                self.handle_input(rail, endpoint, Input::HandshakeFailed { epoch }, now);
            }
            Event::Confirmed { endpoint, epoch } => {
                self.handle_input(rail, endpoint, Input::Confirmed { epoch }, now);
            }
            Event::EndpointDrained { endpoint } => self.drained(rail, endpoint),
            _ => {}
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
        active.span.in_scope(|| {
            tracing::info!(
                target: "railyard::control",
                "endpoint drained: nothing in flight, its id is free"
            );
        });
        self.active.remove(&(rail, id));
        if self.by_key.get(&key) == Some(&id) {
            self.by_key.remove(&key);
        }
        self.next_epochs.insert((rail, id), next);
        self.shared.publish(rail, id, None);
        self.free_ids.push((rail, id));
        self.forget_if_unused(key.peer);
    }

    /// Timers: endpoint deadlines, connects waiting too long, accepted connections silent
    /// past the connect timeout; then the immediates that arrived on passive queue pairs.
    pub(crate) fn tick(&mut self, now: Instant) {
        self.expire_unproven(now);
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
        self.expire_waiting(now);
        let silent: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.peer.is_none() && now.duration_since(c.opened) > self.policy.connect_timeout
            })
            .map(|(&id, _)| id)
            .collect();
        for conn in silent {
            self.closed(conn, "no handshake within the connect timeout", now);
        }
        self.check_liveness(now);
        self.expire_orphaned_queue_pairs(now);
        self.take_immediates();
    }

    /// Takes out of service the target queue pairs of initiators that have had no control
    /// connection for [`Policy::passive_linger`] — a crashed initiator cannot say RetireQp —
    /// unless a probe of the listener it announced reaches it again: a live initiator whose
    /// connection dropped keeps them.
    fn expire_orphaned_queue_pairs(&mut self, now: Instant) {
        if self.passive.is_empty() && self.orphans.is_empty() {
            return;
        }
        let connected: HashSet<Incarnation> =
            self.conns.values().filter_map(|conn| conn.peer).collect();
        let orphaned: HashSet<Incarnation> = self
            .passive
            .keys()
            .map(|key| key.initiator)
            .filter(|initiator| !connected.contains(initiator))
            .collect();
        self.orphans
            .retain(|initiator, _| orphaned.contains(initiator));
        for initiator in orphaned {
            let orphan = *self.orphans.entry(initiator).or_insert(Orphan {
                since: now,
                probed: None,
            });
            if now.duration_since(orphan.since) < self.policy.passive_linger {
                continue;
            }
            let listen = self.peers.get(&initiator).and_then(|peer| peer.listen);
            match (orphan.probed, listen) {
                (None, Some(listen)) => {
                    // Its Hello, if it answers, makes it connected again.
                    self.conn_to(listen, now);
                    if let Some(orphan) = self.orphans.get_mut(&initiator) {
                        orphan.probed = Some(now);
                    }
                    continue;
                }
                (Some(probed), _) if now.duration_since(probed) < self.policy.connect_timeout => {
                    continue;
                }
                _ => {}
            }
            self.orphans.remove(&initiator);
            // Not a fence: an initiator that comes back retries its work as usual.
            let revoked = self.take_down_passive(initiator).len();
            let name = self.peer_name(initiator);
            warning!(
                self,
                Retire,
                peer = %name,
                incarnation = %initiator,
                queue_pairs = revoked,
                linger = ?self.policy.passive_linger,
                "initiator gone: no connection, and no answer at its listener; its queue pairs here go"
            );
            self.forget_if_unused(initiator);
        }
    }

    fn handle_input(&mut self, rail: u16, id: EndpointId, input: Input, now: Instant) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        active.machine.handle(input, now);
        let span = active.span.clone();
        let _entered = span.enter();
        self.drive(rail, id, now);
    }

    /// Carries out an endpoint's outputs, then cancels a handshake it no longer waits for.
    /// Each new phase is published for submitters by an [`Action::Publish`] behind the
    /// commands before it: an endpoint is seen ready only once the poller has the commands
    /// that make it so (a slice sent to it then finds its circuit closed).
    fn drive(&mut self, rail: u16, id: EndpointId, now: Instant) {
        loop {
            let Some(active) = self.active.get_mut(&(rail, id)) else {
                return;
            };
            let phase = active.machine.phase();
            let probation = active.machine.on_probation();
            if active.published != Some((phase, probation)) {
                // In order with the commands before it (all of one step's actions run
                // before the next step's).
                active.published = Some((phase, probation));
                let view = active.view.clone();
                self.actions.push_back(Action::Publish {
                    view,
                    phase,
                    probation,
                });
            }
            let Some(output) = active.machine.poll_output() else {
                break;
            };
            match output {
                Output::CreateQp { epoch } => self.create_qp(rail, id, epoch, now),
                Output::ConnectQp { epoch } => {
                    let view = active.view.clone();
                    self.actions
                        .push_back(Action::AddEndpoint { rail, view, epoch });
                }
                Output::RefreshDescriptor => {
                    let (addr, peer) = (active.addr, active.machine.key().peer);
                    self.descriptors.invalidate(peer);
                    if let Some(&conn) = self.dialed.get(&addr) {
                        self.ask_descriptor(conn);
                    }
                }
                Output::RetireEndpoint { reason } => {
                    bump(&self.shared.counters.teardowns);
                    warning!(
                        self,
                        Retire,
                        peer = %active.view.peer_name,
                        incarnation = %active.machine.key().peer,
                        addr = %active.addr,
                        endpoint = id.0,
                        rail,
                        epoch = active.machine.epoch().map(Epoch::get),
                        reason = %reason,
                        "endpoint retired"
                    );
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::RetireEndpoint {
                            endpoint: id,
                            reason,
                        },
                    });
                    self.announce_retired_qp(rail, id, None, now);
                }
                Output::OpenCircuit => {
                    bump(&self.shared.counters.circuit_openings);
                    warning!(
                        self,
                        Circuit,
                        peer = %active.view.peer_name,
                        incarnation = %active.machine.key().peer,
                        addr = %active.addr,
                        endpoint = id.0,
                        rail,
                        "circuit opened: work for the peer fails fast with PeerUnavailable"
                    );
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::SetCircuit {
                            endpoint: id,
                            open: true,
                        },
                    });
                }
                Output::Unreachable => {
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::Unreachable { endpoint: id },
                    });
                    self.announce_retired_qp(rail, id, None, now);
                }
                Output::CloseCircuit => {
                    self.actions.push_back(Action::Command {
                        rail,
                        command: Command::SetCircuit {
                            endpoint: id,
                            open: false,
                        },
                    });
                }
            }
        }
        self.cancel_abandoned_handshake(rail, id);
    }

    /// An endpoint that is no longer connecting at its pending handshake's epoch (retired,
    /// timed out, moved on) cancels it: a late reply finds no one waiting.
    fn cancel_abandoned_handshake(&mut self, rail: u16, id: EndpointId) {
        let Some(active) = self.active.get_mut(&(rail, id)) else {
            return;
        };
        let waiting_for_it = active.pending.as_ref().is_some_and(|pending| {
            active.machine.phase() == Phase::Connecting
                && active.machine.epoch() == Some(pending.epoch)
        });
        if !waiting_for_it {
            if let Some(abandoned) = active.pending.take() {
                self.handshakes.remove(&abandoned.handshake);
            }
        }
    }

    // ---- immediates --------------------------------------------------------------------

    /// Turns the immediates that arrived on passive queue pairs into notifications; drops
    /// passive queue pairs that broke (their initiator sees its side fail and reconnects).
    fn take_immediates(&mut self) {
        let keys: Vec<WireKey> = self.passive.keys().copied().collect();
        for key in keys {
            let Some(mut passive) = self.passive.remove(&key) else {
                continue;
            };
            match self.deliver_immediates(key, &mut passive.qp) {
                Ok(()) => {
                    self.passive.insert(key, passive);
                }
                Err(reason) => {
                    bump(&self.shared.counters.teardowns);
                    warning!(
                        self,
                        Handshake,
                        incarnation = %key.initiator,
                        rail = key.target_rail,
                        initiator_rail = key.initiator_rail,
                        reason,
                        "dropping a target queue pair that broke"
                    );
                }
            }
        }
    }

    /// Queues the immediates that arrived on `qp` (the passive queue pair of `key`) as
    /// notifications.
    ///
    /// # Errors
    /// The fabric's reason when the queue pair is broken.
    fn deliver_immediates(&mut self, key: WireKey, qp: &mut F::Connected) -> Result<(), String> {
        let Some(fabric) = self.fabrics.get(usize::from(key.target_rail)) else {
            return Ok(());
        };
        self.immediates.clear();
        let taken = fabric.take_immediates(qp, &mut self.immediates);
        if !self.immediates.is_empty() {
            let from = self.peer_name(key.initiator);
            self.shared
                .deliver(self.immediates.iter().map(|&imm| Notification {
                    from: from.clone(),
                    incarnation: key.initiator,
                    body: NotificationBody::Immediate(imm),
                }));
        }
        taken
    }
}

/// Where a peer that connected from `source` says it listens (`announced`, from its Hello):
/// an unspecified IP is the one it connects from; a loopback address from another host, or
/// nothing parseable, says nothing.
fn announced_listener(announced: &str, source: SocketAddr) -> Option<SocketAddr> {
    let announced: SocketAddr = announced.parse().ok()?;
    if announced.ip().is_unspecified() {
        return Some(SocketAddr::new(source.ip(), announced.port()));
    }
    if announced.ip().is_loopback() && !source.ip().is_loopback() {
        return None;
    }
    Some(announced)
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
    /// `incarnation`'s lease is gone and nothing replaced it: it died, stalled or lost the
    /// directory. Its endpoints fail fast until it returns or a new incarnation replaces it.
    Gone {
        /// The incarnation that is gone.
        incarnation: Incarnation,
    },
    /// `incarnation`, reported gone, holds its name again (a healthy process re-claimed it).
    Returned {
        /// The incarnation that is back.
        incarnation: Incarnation,
    },
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
