//! What a peer is: a remote process at one incarnation with an endpoint on each local rail,
//! and the session slot that keeps one open under its session string.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use railyard_control::{EndpointView, Incarnation, SegmentDescriptor};

/// A remote process at one incarnation, with an endpoint on each local rail.
#[derive(Clone, Debug)]
pub struct Peer {
    pub(crate) addr: SocketAddr,
    pub(crate) views: Vec<Arc<EndpointView>>,
    /// The incarnation of the engine that opened it (its endpoints are that engine's).
    pub(crate) engine: Incarnation,
}

impl Peer {
    /// Its segment name.
    pub fn name(&self) -> &str {
        &self.views[0].peer_name
    }

    /// Its incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.views[0].key.peer
    }

    /// Where its handshake listener is.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether its endpoints are retired: this incarnation was replaced by a new one at its
    /// address or under its name (or the application retired them). Transfers to it fail at
    /// once; open the peer again (by name, with a directory) to reach what replaced it.
    pub fn is_retired(&self) -> bool {
        self.views
            .iter()
            .all(|view| view.phase() == railyard_control::Phase::Retired)
    }

    /// Whether transfers to it fail at once (`PeerUnavailable`, or retired): it stopped
    /// answering, lost its directory lease, or kept failing. Unlike [`Self::is_retired`]
    /// this passes: its endpoints try again after a cooldown, or at once when the
    /// directory sees it back, and the same `Peer` carries traffic again.
    pub fn is_unavailable(&self) -> bool {
        self.views.iter().all(|view| {
            matches!(
                view.phase(),
                railyard_control::Phase::CircuitOpen | railyard_control::Phase::Retired
            )
        })
    }

    /// Whether a queue pair to it carries traffic on one of the rails now: work that failed
    /// on another rail (its errors, its circuit open) may still reach it through this one.
    pub fn is_up_on_a_rail(&self) -> bool {
        self.views
            .iter()
            .any(|view| view.phase() == railyard_control::Phase::Ready)
    }

    /// Its newest descriptor (name, incarnation, rails, regions).
    pub fn descriptor(&self) -> Arc<SegmentDescriptor> {
        self.views
            .iter()
            .find_map(|view| view.descriptor())
            .unwrap_or_else(|| {
                Arc::new(SegmentDescriptor {
                    name: self.name().to_string(),
                    incarnation: self.incarnation(),
                    handshake_addr: self.addr.to_string(),
                    rails: Vec::new(),
                    regions: Vec::new(),
                })
            })
    }

    pub(crate) fn views(&self) -> &[Arc<EndpointView>] {
        &self.views
    }
}

impl From<&Peer> for Incarnation {
    fn from(peer: &Peer) -> Self {
        peer.incarnation()
    }
}

/// The engine's peers by session string (see the [`session`](super::session) module).
pub(crate) type SessionTable = Mutex<HashMap<String, Arc<Mutex<Session>>>>;

/// What is known of one session: the peer opened, or the last open that failed.
#[derive(Debug, Default)]
pub(crate) struct Session {
    pub(crate) peer: Option<Peer>,
    /// When the last open failed, and why.
    pub(crate) failed: Option<(Instant, String)>,
}
