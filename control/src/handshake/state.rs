//! The peer table's state: what the handshake core knows about connections, peers and
//! endpoints, the actions it queues for the driver, and how a frame is queued on a
//! connection (held until the peer proved the cluster secret).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use railyard_dataplane::rng::{KeyedHasher, SplitMix64};
use railyard_dataplane::{Command, EndpointId, Epoch};

use crate::auth::ClusterSecret;
use crate::directory::P2pDirectory;
use crate::endpoint::{Endpoint, EndpointKey, Incarnation, Input, Phase};
use crate::error::ControlError;
use crate::host::HostId;
use crate::policy::Policy;
use crate::rail::RailFabric;
use crate::session::SessionKeys;
use crate::shared::{ControlShared, EndpointView, bump};
use crate::wire::{Message, NONCE_LEN, QpSide, WireKey};

/// How long an accepted connection is safe from eviction before its Hello: time for the
/// driver to read a Hello sent right after the connect.
pub(crate) const EVICTABLE_AFTER: Duration = Duration::from_millis(100);

/// How often the footprint gauge of the control stats is refreshed.
pub(super) const FOOTPRINT_EVERY: Duration = Duration::from_secs(1);

/// Messages that may wait on a connection for its peer to prove the cluster secret; one more
/// closes it at the next tick.
pub(super) const MAX_HELD: usize = 1024;

/// Counts and emits a warning of kind `$kind` for `$core` (see
/// [`control_warning`](crate::warn::control_warning)).
macro_rules! warning {
    ($core:expr, $kind:ident, $($fields:tt)+) => {
        control_warning!($core.shared, $core.me.name, WarningKind::$kind, $($fields)+)
    };
}
pub(super) use warning;

/// A table of the core's, iterated in an order fixed by its seed.
pub(crate) type Table<K, V> = HashMap<K, V, KeyedHasher>;

/// The memory a table holds at its capacity: its entries and a control byte each.
fn table_bytes<K, V>(table: &Table<K, V>) -> usize {
    table.capacity() * (size_of::<(K, V)>() + 1)
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
    /// From now on, protect `conn`'s frames with `keys` ([`crate::session`]): every frame
    /// queued after this action is sealed, and every frame received after the peer's Auth
    /// (which the driver decodes last before the core checks it) is opened.
    Protect {
        /// The connection.
        conn: ConnId,
        /// This side's keys for it.
        keys: Box<SessionKeys>,
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
    /// Whether this side asks for encrypted frames after the handshake.
    pub(crate) encrypt_control: bool,
}

/// A peer incarnation as its Hello described it.
#[derive(Clone, Debug)]
pub(super) struct PeerInfo {
    pub(super) name: String,
    pub(super) host: HostId,
    /// Where it says it listens (from an accepted connection's Hello): where this side
    /// probes before giving up on its target queue pairs.
    pub(super) listen: Option<SocketAddr>,
}

/// One control connection, either direction.
#[derive(Debug)]
pub(super) struct Conn {
    /// Dialed: the peer's handshake listener. Accepted: the peer's source address.
    pub(super) addr: SocketAddr,
    pub(super) dialed: bool,
    /// The local address the connection uses, once known.
    pub(super) local_ip: Option<IpAddr>,
    /// The incarnation its Hello announced, once it is admitted (with a cluster secret:
    /// once both sides proved it).
    pub(super) peer: Option<Incarnation>,
    /// This side's Hello nonce on it.
    pub(super) nonce: [u8; NONCE_LEN],
    /// The peer's Hello, while its proof of the cluster secret is awaited.
    pub(super) unproven: Option<Message>,
    /// Messages to send once the peer is admitted (nothing but Hello, Auth and Bye goes
    /// out before that).
    pub(super) held: Vec<Message>,
    /// Descriptors asked for on it (GetDescriptor) and not yet received; a Descriptor
    /// nobody asked for closes the connection.
    pub(super) descriptors_asked: u32,
    pub(super) opened: Instant,
    /// When the peer last said anything on it.
    pub(super) last_heard: Instant,
    /// When this side last sent a Ping on it.
    pub(super) last_ping: Option<Instant>,
    /// Its `handshake` span.
    pub(super) span: tracing::Span,
}

/// An application's connect waiting for the peer's Hello and descriptor.
pub(super) struct Waiting {
    pub(super) conn: ConnId,
    pub(super) local_rail: u16,
    pub(super) remote_rail: u16,
    pub(super) reply: Sender<Result<Arc<EndpointView>, ControlError>>,
    pub(super) deadline: Instant,
}

/// The handshake an endpoint waits for.
pub(super) struct Pending<Q> {
    pub(super) epoch: Epoch,
    pub(super) handshake: u64,
    /// The connection the ConnectQp went out on: the only one its reply is taken from.
    pub(super) conn: ConnId,
    pub(super) qp: Q,
    /// When the ConnectQp went out.
    pub(super) sent: Instant,
}

pub(super) struct Active<Q> {
    pub(super) machine: Endpoint,
    pub(super) view: Arc<EndpointView>,
    /// The peer's handshake listener.
    pub(super) addr: SocketAddr,
    pub(super) pending: Option<Pending<Q>>,
    /// The epoch and number of the newest queue pair offered to the peer, until it is
    /// announced retired (RetireQp).
    pub(super) offered: Option<(Epoch, u32)>,
    /// The phase (and probation) last handed to the driver to publish in `view`.
    pub(super) published: Option<(Phase, bool)>,
    /// The peer's fence generation for this side, as its last ConnectQp reply told it.
    pub(super) fence: Option<u64>,
    /// Its `endpoint` span.
    pub(super) span: tracing::Span,
    /// Its queue pair was freed while it was idle (see `eviction.rs`); it connects again
    /// when traffic wants it.
    pub(super) parked: bool,
    /// A park was asked of its poller for this epoch, at this time, and not answered yet.
    pub(super) parking: Option<(Epoch, Instant)>,
    /// It waits for room on its rail before connecting a queue pair.
    pub(super) wants_room: bool,
    /// When it was last created, woken, or found busy: parks go to the least recent.
    pub(super) last_wanted: Instant,
}

/// A ConnectQp received and not yet answered (see `turns.rs`).
pub(super) struct Unanswered {
    pub(super) conn: ConnId,
    pub(super) key: WireKey,
    pub(super) epoch: u64,
    pub(super) handshake: u64,
    pub(super) side: QpSide,
}

/// An endpoint's handshake waiting for its turn to go out (see `turns.rs`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Unsent {
    pub(super) rail: u16,
    pub(super) id: EndpointId,
    pub(super) epoch: Epoch,
    /// It ends a park.
    pub(super) woken: bool,
}

/// An initiator with target queue pairs here and no control connection.
#[derive(Clone, Copy, Debug)]
pub(super) struct Orphan {
    /// Since when it has had none.
    pub(super) since: Instant,
    /// When a probe of its listener was started, if one was.
    pub(super) probed: Option<Instant>,
}

pub(super) struct Passive<Q> {
    /// The peer's queue pair is connected to it; immediates arrive on it.
    pub(super) qp: Q,
    pub(super) remote_qp_num: u32,
    pub(super) local: QpSide,
    /// The connection its ConnectQp came on: a ConnectQp still buffered on an older one
    /// (which the initiator gave up) never replaces it.
    pub(super) conn: ConnId,
}

/// The peer table and handshake state machine. See the module docs.
pub(crate) struct Core<F: RailFabric> {
    pub(super) me: Identity,
    pub(super) policy: Policy,
    pub(super) shared: Arc<ControlShared>,
    pub(super) fabrics: Vec<F>,
    pub(super) conns: Table<ConnId, Conn>,
    pub(super) next_conn: u64,
    /// The open dialed connection to each handshake address.
    pub(super) dialed: Table<SocketAddr, ConnId>,
    /// When each listener was last heard on a dialed connection that closed since: the
    /// next one dialed to it counts its silence from then, so a connection lost to a peer
    /// that stopped answering does not restart the liveness clock.
    pub(super) heard_before: Table<SocketAddr, Instant>,
    /// Which incarnation listens at each address dialed: the newest Hello's.
    pub(super) listeners: Table<SocketAddr, Incarnation>,
    /// What each peer incarnation's Hello said.
    pub(super) peers: Table<Incarnation, PeerInfo>,
    pub(super) descriptors: P2pDirectory,
    pub(super) active: Table<(u16, EndpointId), Active<F::Qp>>,
    pub(super) by_key: Table<EndpointKey, EndpointId>,
    /// Ids whose endpoint drained, per rail.
    pub(super) free_ids: Vec<(u16, EndpointId)>,
    /// The next first epoch of each id that was used (epochs continue across occupants).
    pub(super) next_epochs: Table<(u16, EndpointId), Epoch>,
    /// Handshakes waiting for their reply, by id.
    pub(super) handshakes: Table<u64, (u16, EndpointId)>,
    pub(super) passive: Table<WireKey, Passive<F::Connected>>,
    /// ConnectQps received and not answered yet, in arrival order.
    pub(super) unanswered: VecDeque<Unanswered>,
    /// This side's handshakes waiting to go out, in order.
    pub(super) unsent: VecDeque<Unsent>,
    /// This side's handshakes their target told to wait (by id): taken in, they do not
    /// count against this side's cap on handshakes out.
    pub(super) waiting_at_target: BTreeSet<u64>,
    /// ConnectQps answered as they arrive in each turn of the driver before the rest wait
    /// in `unanswered` for [`Core::answer_handshakes`]; `None`: every one as it arrives.
    pub(super) turn_budget: Option<usize>,
    /// ConnectQps answered in this turn.
    pub(super) answered_this_turn: usize,
    /// This side's fence generation for each initiator it revoked (absent: 0), told in every
    /// ConnectQp reply. Kept for good: an initiator that reconnects after any number of
    /// revokes must still see that one happened.
    pub(super) fences: Table<Incarnation, u64>,
    /// Initiators holding target queue pairs here with no control connection left.
    pub(super) orphans: Table<Incarnation, Orphan>,
    /// When each listener was last dialed again for endpoints left without a connection
    /// (at most once per keepalive interval).
    pub(super) redialed: Table<SocketAddr, Instant>,
    pub(super) waiting: Vec<Waiting>,
    /// Endpoints waiting for room on their rail, in order, with the input that starts
    /// their queue pair once there is.
    pub(super) room_wanted: VecDeque<(u16, EndpointId, Input)>,
    /// When endpoints waiting for room next ask for parks (see `eviction.rs`).
    pub(super) park_retry: Option<Instant>,
    /// When the footprint gauge is next refreshed.
    pub(super) footprint_at: Option<Instant>,
    pub(super) rng: SplitMix64,
    pub(super) actions: VecDeque<Action>,
    /// Scratch for immediates taken from passive queue pairs.
    pub(super) immediates: Vec<u32>,
    /// Only with [`Protection::IncarnationCheck`] off: each newcomer taken for the
    /// predecessor at its address (newcomer → predecessor).
    #[cfg(feature = "sabotage")]
    pub(super) mistaken: Table<Incarnation, Incarnation>,
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
        let hasher = KeyedHasher(seed ^ me.incarnation.0);
        Self {
            rng: SplitMix64::new(seed ^ me.incarnation.0),
            me,
            policy,
            shared,
            fabrics,
            conns: Table::with_hasher(hasher),
            next_conn: 0,
            dialed: Table::with_hasher(hasher),
            heard_before: Table::with_hasher(hasher),
            listeners: Table::with_hasher(hasher),
            peers: Table::with_hasher(hasher),
            descriptors: P2pDirectory::new(),
            active: Table::with_hasher(hasher),
            by_key: Table::with_hasher(hasher),
            free_ids: Vec::new(),
            next_epochs: Table::with_hasher(hasher),
            handshakes: Table::with_hasher(hasher),
            passive: Table::with_hasher(hasher),
            unanswered: VecDeque::new(),
            unsent: VecDeque::new(),
            waiting_at_target: BTreeSet::new(),
            turn_budget: None,
            answered_this_turn: 0,
            fences: Table::with_hasher(hasher),
            orphans: Table::with_hasher(hasher),
            redialed: Table::with_hasher(hasher),
            waiting: Vec::new(),
            room_wanted: VecDeque::new(),
            park_retry: None,
            footprint_at: None,
            actions: VecDeque::new(),
            immediates: Vec::new(),
            #[cfg(feature = "sabotage")]
            mistaken: Table::with_hasher(hasher),
        }
    }

    /// Keys every table with `key` (drawn at random by a running control plane; see
    /// [`KeyedHasher`]). Called before the core is fed anything: the tables are empty.
    pub(crate) fn key_tables(&mut self, key: u64) {
        let hasher = KeyedHasher(key);
        self.conns = Table::with_hasher(hasher);
        self.dialed = Table::with_hasher(hasher);
        self.heard_before = Table::with_hasher(hasher);
        self.listeners = Table::with_hasher(hasher);
        self.peers = Table::with_hasher(hasher);
        self.active = Table::with_hasher(hasher);
        self.by_key = Table::with_hasher(hasher);
        self.next_epochs = Table::with_hasher(hasher);
        self.handshakes = Table::with_hasher(hasher);
        self.passive = Table::with_hasher(hasher);
        self.fences = Table::with_hasher(hasher);
        self.orphans = Table::with_hasher(hasher);
        self.redialed = Table::with_hasher(hasher);
        #[cfg(feature = "sabotage")]
        {
            self.mistaken = Table::with_hasher(hasher);
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

    /// Queues `message` on `conn`; with a cluster secret, holds all but Hello, Auth and Bye
    /// until the peer has proven it.
    pub(super) fn send(&mut self, conn: ConnId, message: Message) {
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

    /// Whether the driver must look every tick at what only polling finds: the immediates
    /// of passive queue pairs, and the poller's answers about parks (an endpoint woken by
    /// traffic, or one that waits for room). Everything else comes on a socket or can wait
    /// for the idle tick.
    pub(crate) fn polls(&self) -> bool {
        !self.passive.is_empty()
            || !self.room_wanted.is_empty()
            || self
                .active
                .values()
                .any(|active| active.parked || active.parking.is_some())
    }

    /// Endpoints that exist now, on every rail.
    pub(crate) fn endpoint_count(&self) -> usize {
        self.active.len()
    }

    /// Peer incarnations known (each said Hello on some connection).
    pub(crate) fn known_peers(&self) -> usize {
        self.peers.len()
    }

    /// About how many bytes of memory the peer table takes: every table at its capacity,
    /// each connection's held frames, each endpoint's view and each cached descriptor.
    pub(crate) fn footprint(&self) -> usize {
        let conns: usize = self
            .conns
            .values()
            .map(|conn| conn.held.len() * size_of::<Message>())
            .sum();
        let names: usize = self.peers.values().map(|peer| peer.name.len()).sum();
        let views: usize = self
            .active
            .values()
            .map(|active| size_of::<EndpointView>() + active.view.peer_name.len())
            .sum();
        let waiting = self.waiting.capacity() * size_of::<Waiting>();
        table_bytes(&self.conns)
            + conns
            + table_bytes(&self.dialed)
            + table_bytes(&self.heard_before)
            + table_bytes(&self.listeners)
            + table_bytes(&self.peers)
            + names
            + self.descriptors.footprint()
            + table_bytes(&self.active)
            + views
            + table_bytes(&self.by_key)
            + self.free_ids.capacity() * size_of::<(u16, EndpointId)>()
            + table_bytes(&self.next_epochs)
            + table_bytes(&self.handshakes)
            + table_bytes(&self.passive)
            + self.unanswered.capacity() * size_of::<Unanswered>()
            + self.unsent.capacity() * size_of::<Unsent>()
            + self.waiting_at_target.len() * size_of::<u64>() * 3
            + self
                .unanswered
                .iter()
                .map(|waiting| waiting.side.attachment.len())
                .sum::<usize>()
            + table_bytes(&self.fences)
            + table_bytes(&self.orphans)
            + table_bytes(&self.redialed)
            + waiting
    }

    /// The name `peer`'s Hello gave (empty if it never said Hello).
    pub(super) fn peer_name(&self, peer: Incarnation) -> String {
        self.peers
            .get(&peer)
            .map_or_else(String::new, |info| info.name.clone())
    }
}
