//! What every clone of an engine shares: the one state its handles point at, the accessors
//! that read it, and the order it lets go of everything when the last handle drops.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use railyard_control::{ControlPlane, ControlShared, Incarnation, Revocation};
use railyard_dataplane::PollerHandle;
use railyard_dataplane::fabric::soft::FaultHandle;
use railyard_topology::HostTopology;

use super::directory::Directory;
use super::peer::SessionTable;
use super::rails::Rails;
use super::region::{DEREGISTER_WAIT, RegionEntry};
use super::stats::{EndpointStats, EngineStats, PeerTable, RailEndpoints, RailStats, peer_stats};

/// railyard embedded in an application. See the [crate docs](crate).
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
}

/// A handle that does not keep an engine running: for observers (the metrics server, a
/// registered collector), so that dropping the application's last [`Engine`] still stops it.
#[derive(Clone)]
pub(crate) struct WeakEngine(Weak<Inner>);

impl WeakEngine {
    /// The engine, while it runs.
    pub(crate) fn upgrade(&self) -> Option<Engine> {
        self.0.upgrade().map(|inner| Engine { inner })
    }
}

impl std::fmt::Debug for WeakEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.upgrade() {
            Some(engine) => f.debug_tuple("WeakEngine").field(&engine.name()).finish(),
            None => f.write_str("WeakEngine(stopped)"),
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.inner.name)
            .field("addr", &self.addr())
            .field("rails", &self.inner.rails.len())
            .field("fabric", &self.inner.rails.fabric())
            .finish()
    }
}

/// What every clone of an [`Engine`] points at; dropping it ends the engine.
pub(crate) struct Inner {
    /// First to go when the engine drops: revoking its lease tells peers at once.
    pub(crate) directory: Directory,
    pub(crate) name: String,
    pub(crate) slice_size: usize,
    pub(crate) deadline: Duration,
    pub(crate) connect_timeout: Duration,
    /// How long a handshake may wait its turn past the connect timeout.
    pub(crate) handshake_queue_timeout: Duration,
    pub(crate) rails: Rails,
    pub(crate) pollers: Vec<Arc<PollerHandle>>,
    pub(crate) control: ControlPlane,
    pub(crate) shared: Arc<ControlShared>,
    pub(crate) topology: Option<Arc<HostTopology>>,
    pub(crate) rail_numa: Vec<u32>,
    pub(crate) regions: RwLock<Vec<RegionEntry>>,
    /// Held by [`Engine::register`] from its overlap check to its insert.
    pub(crate) registering: Mutex<()>,
    /// Queue pairs revoked whose fence timed out ([`RevokeError::Busy`](crate::RevokeError::Busy)), by peer: the next
    /// `revoke` of that peer waits for them again.
    pub(crate) revoking: Mutex<Vec<(Incarnation, Revocation)>>,
    /// Regions withdrawn whose deregistration timed out waiting for pollers or peers
    /// ([`MemoryError::Busy`](crate::MemoryError::Busy)): kept mapped until a later `deregister` sees them quiet.
    pub(crate) fencing: Mutex<Vec<RegionEntry>>,
    pub(crate) next_region: AtomicU64,
    /// Bumped after each change of `regions`: a submitter keeps the registrations it looked
    /// up while it is equal.
    pub(crate) regions_version: AtomicU64,
    pub(crate) warnings: Vec<String>,
    pub(crate) peers: PeerTable,
    /// Peers by session string ([`Engine::peer`]).
    pub(crate) sessions: SessionTable,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.directory.stop();
        self.control.shutdown();
        for poller in &self.pollers {
            poller.shutdown();
        }
        let mut entries = std::mem::take(
            self.regions
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        entries.append(
            self.fencing
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let mut withdrawn = true;
        for entry in &mut entries {
            if let Err((rail, reason)) = entry.withdraw(&self.rails) {
                tracing::warn!(
                    target: "railyard::engine",
                    region = entry.region.id,
                    rail,
                    reason,
                    "a rail refused to withdraw a region as the engine ends: its memory is leaked"
                );
                withdrawn = false;
            }
        }
        // The pollers are gone; peers may still be inside a copy they checked before.
        if !withdrawn || !self.rails.quiesce_peers(Instant::now() + DEREGISTER_WAIT) {
            // Better a leak than memory a peer still writes into being reused.
            for entry in entries {
                std::mem::forget(entry.memory);
            }
        }
    }
}

impl Engine {
    /// Its segment name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Where its handshake listener is.
    pub fn addr(&self) -> SocketAddr {
        self.inner.control.local_addr()
    }

    /// Its incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.inner.control.incarnation()
    }

    /// How many rails it has.
    pub fn rails(&self) -> usize {
        self.inner.rails.len()
    }

    /// The fabric its rails run: `soft` or `verbs`.
    pub fn fabric(&self) -> &'static str {
        self.inner.rails.fabric()
    }

    /// Compromises made while building (no topology, unpinned pollers, RDMA present but
    /// unused), in words.
    pub fn warnings(&self) -> &[String] {
        &self.inner.warnings
    }

    /// The fault plan of rail `rail`, to make its queue pairs fail on purpose: for chaos
    /// drills and tests of what an application does when links fail. Host rails (soft and
    /// TCP) and libfabric rails; `None` on verbs or for a rail that does not exist. An empty
    /// plan (the default) costs one atomic load per post.
    pub fn faults(&self, rail: usize) -> Option<FaultHandle> {
        self.inner.rails.faults(rail)
    }

    /// Counters per rail, per peer and of the control plane.
    pub fn stats(&self) -> EngineStats {
        let views = self.inner.control.endpoints();
        let mut by_rail = vec![RailEndpoints::default(); self.inner.pollers.len()];
        for (rail, view) in &views {
            let Some(counts) = by_rail.get_mut(usize::from(*rail)) else {
                continue;
            };
            match view.phase() {
                railyard_control::Phase::Retired => counts.retiring += 1,
                _ if view.is_parked() => counts.parked += 1,
                _ => counts.live += 1,
            }
        }
        EngineStats {
            rails: self
                .inner
                .pollers
                .iter()
                .zip(by_rail)
                .enumerate()
                .map(|(rail, (poller, endpoints))| RailStats {
                    name: self.inner.rails.name(rail),
                    poller: poller.counters(),
                    served: self.inner.rails.served(rail),
                    endpoints,
                })
                .collect(),
            peers: peer_stats(&self.inner.peers),
            control: self.inner.control.stats(),
            endpoints: views
                .into_iter()
                .map(|(rail, view)| EndpointStats {
                    peer: view.peer_name.clone(),
                    incarnation: view.key.peer,
                    rail: self.inner.rails.name(usize::from(rail)),
                    endpoint: u64::from(view.id.0),
                    phase: view.phase(),
                    parked: view.is_parked(),
                })
                .collect(),
        }
    }

    /// A handle that does not keep it running.
    pub(crate) fn downgrade(&self) -> WeakEngine {
        WeakEngine(Arc::downgrade(&self.inner))
    }

    pub(crate) fn pollers(&self) -> &[Arc<PollerHandle>] {
        &self.inner.pollers
    }

    /// The largest slice: transfers are split at it ([`EngineBuilder::slice_size`](crate::EngineBuilder::slice_size)).
    pub fn slice_size(&self) -> usize {
        self.inner.slice_size
    }

    pub(crate) fn default_deadline(&self) -> Duration {
        self.inner.deadline
    }
}
