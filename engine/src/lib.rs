//! railyard's engine: railyard as an application embeds it, with nothing of the CLI, the
//! chaos scenarios or clap (the `railyard` crate re-exports it as `railyard::engine`, and
//! this crate's [`metrics`] as `railyard::metrics`).
//!
//! ```no_run
//! use railyard_engine::{Engine, Op, Transfer};
//! # fn main() -> anyhow::Result<()> {
//! let engine = Engine::builder("prefill-0").build()?;
//! let pool = engine.alloc(64 << 20, None)?;
//! let decode = engine.open("10.0.0.2:7400")?;
//! let target = decode.descriptor().regions[0].base;
//! let mut submitter = engine.submitter()?;
//! let batch = submitter.submit(
//!     &decode,
//!     &[Transfer { op: Op::Write, local: pool, local_offset: 0, remote_addr: target, len: 1 << 20 }],
//! )?;
//! batch.wait(std::time::Instant::now() + std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```
//!
//! An engine owns its rails (one device and one pinned poller each, all on the soft fabric
//! or all on the verbs fabric: [`FabricChoice`]), its control plane
//! (handshake listener, endpoints, directory) and its registered memory. Memory is
//! registered on every rail. A [`Peer`] is a remote process at one incarnation, with an
//! endpoint on each local rail. A [`EngineSubmitter`] (one per thread) turns transfers into
//! slices — validated, split at the slice size, striped across rails — and hands them to
//! the pollers.
//!
//! # When memory is free again
//! - **Local side, strict:** once [`Batch::wait`] (or [`Batch::poll`]) reports a request —
//!   done, failed or timed out — no fabric operation of it reads or writes your local memory
//!   again; reuse the buffers at once.
//! - **Remote side, bounded:** a write of a failed or timed-out request may still land at the
//!   target until the target has processed the retirement of the queue pair it came on.
//! - **Fences, for good:** after [`Engine::revoke`]`(peer)` returns `Ok`, no write or read
//!   that `peer` submitted before that moment ever touches this engine's memory — not after
//!   a reconnect, not after a retry, not ever. After [`Engine::deregister`]`(region)` returns
//!   `Ok`, nothing submitted before it touches that memory, whatever is registered there
//!   later. New work after a fence works as usual. Work caught by a fence fails with its own
//!   reason — `Revoked` or `RegionWithdrawn` ([`FailReason`](railyard_dataplane::FailReason))
//!   — and is never retried into other memory: a slice carries the generation of the remote
//!   region it was prepared against and the epoch it was prepared for, and a reconnect may
//!   move it to a new queue pair, never to a new generation or past a fence.
//!
//! # Thread safety
//! [`Engine`] is `Send + Sync` and cheap to clone (an `Arc`). [`EngineSubmitter`] is `Send`,
//! not `Sync`: one per thread. [`Batch`]es are `Send + Sync`.
//!
//! # Resource cleanup
//! Dropping the last clone of an engine stops its control plane, then its pollers (every
//! queued slice resolves with `Shutdown`), then deregisters and frees its memory. A
//! [`Region`] handle does not keep memory alive: [`Engine::deregister`] (or the engine's
//! end) does the freeing, and later transfers naming it fail with `UnknownRegion`.

mod directory;
mod error;
pub mod memory;
pub mod metrics;
mod rails;
mod session;
mod transfer;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

pub use railyard_control as control;
pub use railyard_control::{ClusterSecret, SecretError};
use railyard_control::{
    ControlConfig, ControlPlane, ControlShared, ControlStats, EndpointView, HostMode, Incarnation,
    Notification, Policy, RegionDescriptor, SegmentDescriptor,
};
pub use railyard_dataplane as dataplane;
use railyard_dataplane::fabric::MemoryRegion;
use railyard_dataplane::fabric::soft::{Backing, FaultHandle};
pub use railyard_dataplane::fabric::tcp::ServedStats;
pub use railyard_dataplane::fabric::verbs::RailConfig;
use railyard_dataplane::{Batch, CounterSnapshot, DEFAULT_DEADLINE, IdleStrategy, PollerHandle};
pub use railyard_topology as topology;
use railyard_topology::{HostTopology, PlanOptions, RailKind};

pub use error::{BuildError, MemoryError, PeerError, RevokeError, TransferError};
use rails::{Memory, PlannedRail, Rails};
pub use session::{FAILED_OPEN_KEPT, MAX_IDLE_SUBMITTERS, RawTransfer, SubmitterPool};
pub use transfer::{EngineSubmitter, Op, REFRESH_WAIT, SubmitTiming, Transfer};

/// Which fabric moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricChoice {
    /// Verbs when RDMA devices are rails; else, per peer, the soft fabric for a process on
    /// this host and TCP for one on another (told apart by boot id and PID namespace).
    Auto,
    /// The soft fabric (shared memory and `process_vm_*` on one host).
    Soft,
    /// TCP, for every peer.
    Tcp,
    /// RDMA verbs.
    Verbs,
    /// libfabric ([`EngineBuilder::ofi`] names the provider): EFA in production. `Auto`
    /// never picks it.
    Ofi,
}

/// How many rails, and where their pollers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RailChoice {
    /// From the topology plan: one software rail per NUMA node with CPUs, pollers pinned to
    /// the plan's cores.
    Plan,
    /// This many software rails, pollers unpinned.
    Count(NonZeroUsize),
}

/// Builds an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineBuilder {
    name: String,
    listen: SocketAddr,
    advertise: Option<IpAddr>,
    fabric: FabricChoice,
    rails: RailChoice,
    idle: IdleStrategy,
    slice_size: usize,
    deadline: Duration,
    policy: Policy,
    verbs: RailConfig,
    ofi: Option<String>,
    directory: DirectoryChoice,
    secret: Option<ClusterSecret>,
    accept_tcp_sinks: Option<bool>,
}

/// Where an engine finds its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirectoryChoice {
    /// By address only: each peer's own handshake listener describes it (the default).
    P2p,
    /// An etcd cluster (`etcd://HOST:PORT[,HOST:PORT...]`, or `etcd+tls://…?ca=FILE`, with
    /// `credentials=FILE` for an etcd that authenticates; see
    /// `railyard_control::etcd::EtcdConfig::from_url`): this engine publishes itself
    /// under its name with a lease, peers are opened by name, and a peer that restarts or
    /// dies is seen through etcd's watch (needs the cargo feature `etcd`).
    Etcd(String),
}

/// This host's address on its default route — where a connection to the outside world
/// would leave from (no packet is sent) — or loopback on a host without one.
pub fn primary_ip() -> IpAddr {
    let unspecified = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    std::net::UdpSocket::bind((unspecified, 0))
        .and_then(|socket| {
            // A documentation address (TEST-NET-1): routed like any other, never answered.
            socket.connect((Ipv4Addr::new(192, 0, 2, 1), 9))?;
            socket.local_addr()
        })
        .map(|local| local.ip())
        .ok()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Default largest slice: big enough that per-slice work is small beside the copy.
pub const DEFAULT_SLICE_SIZE: usize = 256 * 1024;

impl EngineBuilder {
    /// Where the handshake listener binds (default `127.0.0.1:0`, any port).
    #[must_use]
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// The address peers reach this engine at: what its descriptor, its directory record
    /// and [`Engine::addr`] name, with the listener's port. Default: the listener's own
    /// address, or — for a listener on every address (`0.0.0.0`, `::`) — this host's
    /// address on its default route ([`primary_ip`]).
    #[must_use]
    pub fn advertise(mut self, ip: IpAddr) -> Self {
        self.advertise = Some(ip);
        self
    }

    /// Which fabric (default [`FabricChoice::Auto`]).
    #[must_use]
    pub fn fabric(mut self, fabric: FabricChoice) -> Self {
        self.fabric = fabric;
        self
    }

    /// How many rails (default [`RailChoice::Plan`]).
    #[must_use]
    pub fn rails(mut self, rails: RailChoice) -> Self {
        self.rails = rails;
        self
    }

    /// What idle pollers do (default: spin, then yield).
    #[must_use]
    pub fn idle(mut self, idle: IdleStrategy) -> Self {
        self.idle = idle;
        self
    }

    /// Largest slice (default [`DEFAULT_SLICE_SIZE`]); transfers are split at it.
    #[must_use]
    pub fn slice_size(mut self, bytes: usize) -> Self {
        self.slice_size = bytes;
        self
    }

    /// Deadline of batches submitted without one (default [`DEFAULT_DEADLINE`], 5 s).
    #[must_use]
    pub fn default_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Reconnect, flap and circuit policy.
    #[must_use]
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// How verbs rails are set up: port and GID index (`None`: chosen per rail — first
    /// ACTIVE port, RoCE v2 IPv4-mapped GID), queue-pair capacities, timeout, retry and RNR
    /// retry counts, signaling interval. Defaults: [`RailConfig::default`]. A port set here
    /// wins over the plan's.
    #[must_use]
    pub fn verbs(mut self, config: RailConfig) -> Self {
        self.verbs = config;
        self
    }

    /// The libfabric provider of [`FabricChoice::Ofi`] rails, as `fi_info -l` names it (`efa`,
    /// `tcp;ofi_rxm`, `shm`). Default: `efa` when this machine has it; a software provider
    /// only when named here.
    #[must_use]
    pub fn ofi(mut self, provider: impl Into<String>) -> Self {
        self.ofi = Some(provider.into());
        self
    }

    /// The cluster secret (default: none, and a warning at start that peers are not
    /// authenticated). With one, every control connection starts with a mutual proof of it
    /// (HMAC-SHA256 over both sides' fresh nonces, incarnations and addresses), and nothing
    /// — no descriptor, no queue pair, no notification — is answered before it succeeds.
    /// Every process of the cluster needs the same secret.
    #[must_use]
    pub fn secret(mut self, secret: ClusterSecret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// Whether the TCP data ports read and discard a raw byte stream, which `railyard bench`
    /// uses as its ceiling against a target on another host (default: only without a cluster
    /// secret, as before there was one). Such a stream is bound to no handshake and costs a
    /// 64 MiB buffer: with a secret, leave it off outside benchmarks.
    #[must_use]
    pub fn accept_tcp_sinks(mut self, accept: bool) -> Self {
        self.accept_tcp_sinks = Some(accept);
        self
    }

    /// Where peers are found (default [`DirectoryChoice::P2p`]).
    #[must_use]
    pub fn directory(mut self, directory: DirectoryChoice) -> Self {
        self.directory = directory;
        self
    }

    /// Starts the engine: rails, pollers, control plane (directory: p2p).
    ///
    /// # Errors
    /// [`BuildError`] naming the part that could not start.
    pub fn build(self) -> Result<Engine, BuildError> {
        if self.slice_size == 0 || self.slice_size > 1 << 30 {
            return Err(BuildError::Setting(format!(
                "slice size {} must be between 1 byte and 1 GiB",
                self.slice_size
            )));
        }
        let mut warnings = Vec::new();
        let topology = HostTopology::live().ok().map(Arc::new);
        let plan = match (self.rails, topology.as_ref()) {
            (RailChoice::Plan, Some(topology)) => match topology.plan(&PlanOptions::default()) {
                Ok(plan) => Some(plan),
                Err(error) => {
                    warnings.push(format!("no topology plan ({error}); one unpinned rail"));
                    None
                }
            },
            (RailChoice::Plan, None) => {
                warnings.push("hwloc could not read this machine; one unpinned rail".into());
                None
            }
            (RailChoice::Count(_), _) => None,
        };
        let rdma: Vec<PlannedRail> = plan
            .iter()
            .flat_map(|plan| plan.rails.iter())
            .filter(|rail| rail.kind == RailKind::Rdma)
            .map(|rail| PlannedRail {
                device: Some(rail.name.clone()),
                port: rail.port.and_then(|p| u8::try_from(p).ok()),
                pu: Some(rail.poller_pu as usize),
                numa: rail.numa_node,
            })
            .collect();
        let software: Vec<PlannedRail> = match (self.rails, &plan) {
            (RailChoice::Count(count), _) => (0..count.get())
                .map(|_| PlannedRail {
                    device: None,
                    port: None,
                    pu: None,
                    numa: 0,
                })
                .collect(),
            (RailChoice::Plan, Some(plan)) => {
                let planned: Vec<PlannedRail> = plan
                    .rails
                    .iter()
                    .filter(|rail| rail.kind == RailKind::Software)
                    .map(|rail| PlannedRail {
                        device: None,
                        port: None,
                        pu: Some(rail.poller_pu as usize),
                        numa: rail.numa_node,
                    })
                    .collect();
                // A host whose plan chose RDMA rails has no software rails planned: one
                // per RDMA rail, on the same cores, if the soft fabric is used after all.
                if planned.is_empty() {
                    rdma.iter()
                        .map(|rail| PlannedRail {
                            device: None,
                            port: None,
                            ..rail.clone()
                        })
                        .collect()
                } else {
                    planned
                }
            }
            (RailChoice::Plan, None) => vec![PlannedRail {
                device: None,
                port: None,
                pu: None,
                numa: 0,
            }],
        };
        let verbs = railyard_dataplane::fabric::verbs::devices();
        let use_verbs = match (self.fabric, &verbs) {
            (FabricChoice::Soft | FabricChoice::Tcp | FabricChoice::Ofi, _) => false,
            (FabricChoice::Auto, Err(unavailable)) => {
                warnings.push(format!(
                    "no verbs fabric ({unavailable}); using the soft fabric for peers on this \
                     host and TCP for peers on others"
                ));
                false
            }
            (FabricChoice::Auto, Ok(_)) if rdma.is_empty() => {
                warnings.push(
                    "RDMA devices exist but none is a rail of the plan (or --rails asked for \
                     software rails); using the soft fabric for peers on this host and TCP \
                     for peers on others"
                        .into(),
                );
                false
            }
            (FabricChoice::Auto, Ok(_)) => true,
            (FabricChoice::Verbs, Err(unavailable)) => {
                return Err(BuildError::FabricUnavailable {
                    fabric: "verbs",
                    reason: unavailable.reason.clone(),
                });
            }
            (FabricChoice::Verbs, Ok(devices)) if rdma.is_empty() => {
                return Err(BuildError::FabricUnavailable {
                    fabric: "verbs",
                    reason: format!(
                        "devices {} exist but none is a rail of the topology plan (see \
                         `railyard topology`)",
                        devices.join(", ")
                    ),
                });
            }
            (FabricChoice::Verbs, Ok(_)) => true,
        };
        let ofi = match self.fabric {
            FabricChoice::Ofi => Some(ofi_provider(self.ofi.as_deref())?),
            _ => None,
        };
        // EFA devices are RDMA rails of the plan: one efa rail on each. Other providers run
        // on software rails.
        let planned = if use_verbs || (ofi.as_deref() == Some("efa") && !rdma.is_empty()) {
            rdma
        } else {
            software
        };
        let shared = ControlShared::new(planned.len());
        let advertise = self
            .advertise
            .or_else(|| self.listen.ip().is_unspecified().then(primary_ip));
        let control_config = ControlConfig {
            listen: self.listen,
            advertise,
            policy: self.policy.clone(),
            secret: self.secret.clone(),
            ..ControlConfig::new(self.name.clone())
        };
        if self.secret.is_none() {
            tracing::warn!(
                target: "railyard::engine",
                engine = %self.name,
                "peers are not authenticated: whoever reaches the handshake port can read this \
                 engine's descriptor and connect queue pairs to its memory (give every process \
                 of the cluster the same secret: --secret-file or RAILYARD_SECRET_FILE)"
            );
        }
        let started = if let Some(provider) = ofi {
            Rails::start_ofi(
                &self.name,
                &planned,
                &provider,
                self.idle,
                control_config,
                &shared,
                &mut warnings,
            )?
        } else if use_verbs {
            Rails::start_verbs(
                &planned,
                self.verbs,
                self.idle,
                control_config,
                &shared,
                &mut warnings,
            )?
        } else {
            let mode = match self.fabric {
                FabricChoice::Soft => HostMode::Soft,
                FabricChoice::Tcp => HostMode::Tcp,
                FabricChoice::Auto | FabricChoice::Verbs | FabricChoice::Ofi => HostMode::Auto,
            };
            let tcp = railyard_dataplane::fabric::tcp::TcpConfig {
                accept_sinks: self.accept_tcp_sinks.unwrap_or(self.secret.is_none()),
                ..Default::default()
            };
            Rails::start_host(
                &self.name,
                &planned,
                (mode, self.listen.ip()),
                &tcp,
                self.idle,
                control_config,
                &shared,
                &mut warnings,
            )?
        };
        let rail_numa = planned.iter().map(|rail| rail.numa).collect();
        let directory = directory::start(&self.directory, &started.control, self.secret.is_some())?;
        Ok(Engine {
            inner: Arc::new(Inner {
                directory,
                name: self.name,
                slice_size: self.slice_size,
                deadline: self.deadline,
                connect_timeout: self.policy.connect_timeout,
                rails: started.rails,
                pollers: started.pollers,
                control: started.control,
                shared,
                topology,
                rail_numa,
                regions: RwLock::new(Vec::new()),
                fencing: Mutex::new(Vec::new()),
                revoking: Mutex::new(Vec::new()),
                next_region: AtomicU64::new(1),
                regions_version: AtomicU64::new(0),
                registering: Mutex::new(()),
                warnings,
                peers: transfer::PeerTable::default(),
                sessions: session::SessionTable::default(),
            }),
        })
    }
}

/// The libfabric provider `--fabric ofi` runs: the one asked for if this machine has it;
/// else `efa` if present.
///
/// # Errors
/// [`BuildError::FabricUnavailable`] naming the providers present, when the one asked for is
/// not among them, or none was asked for and there is no `efa`.
pub fn ofi_provider(asked: Option<&str>) -> Result<String, BuildError> {
    let present = railyard_dataplane::fabric::ofi::providers();
    let unavailable = |reason: String| BuildError::FabricUnavailable {
        fabric: "ofi",
        reason,
    };
    match asked {
        Some(provider) if present.iter().any(|p| p == provider) => Ok(provider.to_string()),
        Some(provider) => Err(unavailable(format!(
            "libfabric has no provider {provider:?} with RMA on reliable-datagram endpoints \
             here (present: {})",
            if present.is_empty() {
                "none".into()
            } else {
                present.join(", ")
            }
        ))),
        None if present.iter().any(|p| p == "efa") => Ok("efa".into()),
        None => Err(unavailable(format!(
            "no efa provider on this machine; name a software provider to use one (present: \
             {})",
            if present.is_empty() {
                "none".into()
            } else {
                present.join(", ")
            }
        ))),
    }
}

/// A registered region: what transfers name as their local side. Cheap to copy; it does not
/// keep the memory alive (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The engine's id for it.
    pub id: u64,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// What backs it (engine-allocated memory only).
    pub backing: Option<Backing>,
    /// The NUMA node it is bound to, if any.
    pub numa: Option<u32>,
    /// What peers may do to it.
    pub peer_access: PeerAccess,
}

/// What peers may do to a region (this process may always read it, and write it with
/// READs). Register with the least a region needs: a prefill engine's source buffers, which
/// it only writes out of, need [`PeerAccess::None`]; a decode engine's KV cache, which
/// prefill writes into, [`PeerAccess::ReadWrite`] (what [`Engine::alloc`] and
/// [`Engine::register`] give).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PeerAccess {
    /// Peers may neither read nor write it: memory only this process's transfers use.
    None,
    /// Peers may READ from it.
    Read,
    /// Peers may READ from it and WRITE into it.
    #[default]
    ReadWrite,
}

impl PeerAccess {
    /// The registration flags.
    fn access(self) -> railyard_dataplane::fabric::Access {
        use railyard_dataplane::fabric::Access;
        match self {
            Self::None => Access::LOCAL_WRITE,
            Self::Read => Access::LOCAL_WRITE | Access::REMOTE_READ,
            Self::ReadWrite => Access::ALL,
        }
    }
}

impl Region {
    /// Whether `addr..addr + len` (at least one byte) lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// What an engine holds for one region.
struct RegionEntry {
    region: Region,
    /// Engine-allocated memory (`None`: the application's).
    memory: Option<Memory>,
    /// Its registration on each rail.
    registrations: Vec<MemoryRegion>,
    /// What peers' slices are prepared against (the descriptor's `generation`): the id of
    /// the region's first registration, kept by [`Engine::reregister`] (same memory, new
    /// keys) and new with every [`Engine::register`], so that a peer never re-prepares work
    /// from before a `deregister` into memory registered again at the same address.
    generation: u64,
    /// Registrations [`Engine::reregister`] replaced whose withdrawal a rail refused: still
    /// live there, so withdrawn again (idempotently) before the memory may go.
    lingering: Vec<Vec<MemoryRegion>>,
    /// Registrations [`Engine::reregister`] replaced and withdrew: requests this engine
    /// posted through their local keys before may still be in flight, so deregistration
    /// waits for those keys too.
    rekeyed: Vec<Vec<MemoryRegion>>,
    /// Set once every rail withdrew it: a deregistration retried after `Busy` does not
    /// withdraw again by keys that may since name another region (soft and verbs keys
    /// come back).
    withdrawn: bool,
}

impl RegionEntry {
    /// Its local keys on each rail: the current registration's and every earlier one's.
    fn local_keys(&self) -> Vec<Vec<u32>> {
        (0..self.registrations.len())
            .map(|rail| {
                std::iter::once(&self.registrations)
                    .chain(&self.lingering)
                    .chain(&self.rekeyed)
                    .filter_map(|registrations| registrations.get(rail))
                    .map(|registration| registration.lkey)
                    .collect()
            })
            .collect()
    }

    /// Withdraws every registration of it (current and lingering) from every rail; nothing
    /// once that succeeded. A rail that refused (libfabric, whose keys never come back) is
    /// asked again by the next call.
    ///
    /// # Errors
    /// The first rail that refused, with its error (see [`Rails::deregister`]).
    fn withdraw(&mut self, rails: &Rails) -> Result<(), (usize, String)> {
        if self.withdrawn {
            return Ok(());
        }
        rails.deregister(&self.registrations)?;
        while let Some(old) = self.lingering.last() {
            rails.deregister(old)?;
            self.rekeyed.extend(self.lingering.pop());
        }
        self.withdrawn = true;
        Ok(())
    }
}

struct Inner {
    /// First to go when the engine drops: revoking its lease tells peers at once.
    directory: directory::Directory,
    name: String,
    slice_size: usize,
    deadline: Duration,
    connect_timeout: Duration,
    rails: Rails,
    pollers: Vec<Arc<PollerHandle>>,
    control: ControlPlane,
    shared: Arc<ControlShared>,
    topology: Option<Arc<HostTopology>>,
    rail_numa: Vec<u32>,
    regions: RwLock<Vec<RegionEntry>>,
    /// Held by [`Engine::register`] from its overlap check to its insert.
    registering: Mutex<()>,
    /// Queue pairs revoked whose fence timed out ([`RevokeError::Busy`]), by peer: the next
    /// `revoke` of that peer waits for them again.
    revoking: Mutex<Vec<(Incarnation, railyard_control::Revocation)>>,
    /// Regions withdrawn whose deregistration timed out waiting for pollers or peers
    /// ([`MemoryError::Busy`]): kept mapped until a later `deregister` sees them quiet.
    fencing: Mutex<Vec<RegionEntry>>,
    next_region: AtomicU64,
    /// Bumped after each change of `regions`: a submitter keeps the registrations it looked
    /// up while it is equal.
    regions_version: AtomicU64,
    warnings: Vec<String>,
    peers: transfer::PeerTable,
    /// Peers by session string ([`Engine::peer`]).
    sessions: session::SessionTable,
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

/// Longest [`Engine::revoke`] waits for pollers and peers to let go of a peer's queue pairs.
pub const REVOKE_WAIT: Duration = Duration::from_secs(1);

impl From<&Peer> for Incarnation {
    fn from(peer: &Peer) -> Self {
        peer.incarnation()
    }
}

/// Longest [`Engine::deregister`] waits for pollers and peers to leave a withdrawn region.
/// A poller finishes its round within microseconds and a peer its copy within milliseconds;
/// one that has not by then is stopped or stuck.
pub const DEREGISTER_WAIT: Duration = Duration::from_secs(1);

/// A remote process at one incarnation, with an endpoint on each local rail.
#[derive(Clone, Debug)]
pub struct Peer {
    addr: SocketAddr,
    views: Vec<Arc<EndpointView>>,
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

/// Counters of one rail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailStats {
    /// The rail's name.
    pub name: String,
    /// Its poller's counters (posted, completed, failed by reason, re-prepared, stale
    /// dropped…).
    pub poller: CounterSnapshot,
    /// What its TCP target side carried out for initiators (`None` on verbs). Soft-fabric
    /// and RDMA transfers are one-sided: the target never sees them.
    pub served: Option<ServedStats>,
}

/// Counters of one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStats {
    /// Its name.
    pub name: String,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Requests and bytes submitted to it, by [`Op::index`].
    pub by_op: [OpTotals; 2],
    /// Slices submitted to it.
    pub slices: u64,
}

impl PeerStats {
    /// Requests submitted to it, of either op.
    pub fn requests(&self) -> u64 {
        self.by_op.iter().map(|op| op.requests).sum()
    }

    /// Bytes submitted to it, of either op.
    pub fn bytes(&self) -> u64 {
        self.by_op.iter().map(|op| op.bytes).sum()
    }

    /// Requests and bytes of `op`.
    pub fn op(&self, op: Op) -> OpTotals {
        self.by_op[op.index()]
    }
}

/// Requests of one op submitted to a peer, and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpTotals {
    /// Requests (transfers) submitted.
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// An engine's counters; cheap to read (atomics only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineStats {
    /// Per rail.
    pub rails: Vec<RailStats>,
    /// Per peer submitted to.
    pub peers: Vec<PeerStats>,
    /// The control plane's (reconnects, handshakes, circuits, notifications…).
    pub control: ControlStats,
}

/// railyard embedded in an application. See the module docs.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
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

/// A segment name unique on this host and across hosts, `<role>-<host>-<pid>` (for
/// example `serve-node7-4121`): what `railyard serve` and `railyard bench` use unless told
/// otherwise. Names are labels — two engines with the same name are still two peers — but a
/// cluster directory claims them exclusively, and people read them in logs.
pub fn default_name(role: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{role}-{host}-{}", std::process::id())
}

impl Engine {
    /// A builder for an engine named `name` (its segment name, what peers see; see
    /// [`default_name`]).
    pub fn builder(name: impl Into<String>) -> EngineBuilder {
        EngineBuilder {
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            fabric: FabricChoice::Auto,
            rails: RailChoice::Plan,
            idle: IdleStrategy::SpinThenYield { spins: 1 << 14 },
            slice_size: DEFAULT_SLICE_SIZE,
            deadline: DEFAULT_DEADLINE,
            policy: Policy::default(),
            verbs: RailConfig::default(),
            ofi: None,
            directory: DirectoryChoice::P2p,
            secret: None,
            accept_tcp_sinks: None,
        }
    }

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

    /// Allocates `len` bytes registered on every rail (the rails in parallel): huge pages where it can (then
    /// transparent huge pages, then normal pages: [`Region::backing`] says which), bound to
    /// NUMA node `numa` (default: the first rail's), prefaulted. Peers may read and write it
    /// ([`PeerAccess::ReadWrite`]); [`Self::alloc_with_access`] gives less.
    ///
    /// # Errors
    /// [`MemoryError`] naming what failed.
    pub fn alloc(&self, len: u64, numa: Option<u32>) -> Result<Region, MemoryError> {
        self.alloc_with_access(len, numa, PeerAccess::ReadWrite)
    }

    /// [`Self::alloc`], with what peers may do to the region.
    ///
    /// # Errors
    /// As [`Self::alloc`].
    pub fn alloc_with_access(
        &self,
        len: u64,
        numa: Option<u32>,
        peer_access: PeerAccess,
    ) -> Result<Region, MemoryError> {
        if len == 0 {
            return Err(MemoryError::BadRange { addr: 0, len });
        }
        if let Some(total) = memory::host_memory().filter(|&total| len > total) {
            // Prefaulting more than the host has would summon the OOM killer instead.
            return Err(MemoryError::Alloc {
                len,
                reason: format!("more than this host's {total} bytes of memory"),
            });
        }
        let mut memory = self.inner.rails.allocate(len, peer_access.access())?;
        let node = numa.or_else(|| self.inner.rail_numa.first().copied());
        let mut bound = None;
        if let (Some(node), Some(topology)) = (node, self.inner.topology.as_ref()) {
            // SAFETY: the memory is fresh; nothing transfers into it yet.
            let area = unsafe { memory.as_slice() };
            match topology.bind_memory(area, node) {
                Ok(()) => bound = Some(node),
                Err(error) if numa.is_some() => {
                    return Err(MemoryError::Bind {
                        node,
                        len,
                        reason: error.to_string(),
                    });
                }
                Err(_) => {}
            }
        }
        memory.prefault();
        let registrations =
            self.inner
                .rails
                .register_memory(&memory, len, false, peer_access.access())?;
        let region = Region {
            id: self.inner.next_region.fetch_add(1, Ordering::Relaxed),
            addr: memory.addr(),
            len,
            backing: Some(memory.backing()),
            numa: bound,
            peer_access,
        };
        self.insert(RegionEntry {
            region,
            memory: Some(memory),
            registrations,
            generation: region.id,
            lingering: Vec::new(),
            rekeyed: Vec::new(),
            withdrawn: false,
        });
        Ok(region)
    }

    /// Registers memory the application owns, on every rail (in parallel).
    ///
    /// # Safety
    /// `len` bytes at `ptr` must stay mapped, readable and writable until
    /// [`Self::deregister`] returns `Ok` (or the engine ends): peers read and write them at
    /// any time, as a NIC would. After [`MemoryError::Busy`] they are still in use.
    ///
    /// Registering exactly the range of a region registered already returns that region
    /// (nothing changes); a range that overlaps another region without being it is refused.
    /// So every registered byte belongs to one region, and an address names one.
    ///
    /// # Errors
    /// [`MemoryError::BadRange`] for an empty, null or wrapping range;
    /// [`MemoryError::NotHostMemory`] when the range is not readable and writable memory
    /// mapped in this process (device memory, say, or nothing);
    /// [`MemoryError::Overlaps`] for a range overlapping another region;
    /// [`MemoryError::Register`] when a rail refuses.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Region, MemoryError> {
        // SAFETY: the caller's contract.
        unsafe { self.register_with_access(ptr, len, PeerAccess::ReadWrite) }
    }

    /// [`Self::register`], with what peers may do to the region. Registering the range of a
    /// region registered already with other access is refused as an overlap.
    ///
    /// # Safety
    /// As [`Self::register`].
    ///
    /// # Errors
    /// As [`Self::register`].
    pub unsafe fn register_with_access(
        &self,
        ptr: *mut u8,
        len: usize,
        peer_access: PeerAccess,
    ) -> Result<Region, MemoryError> {
        let addr = ptr as u64;
        let len = len as u64;
        if ptr.is_null() || len == 0 || addr.checked_add(len).is_none() {
            return Err(MemoryError::BadRange { addr, len });
        }
        if !memory::mapped_read_write(addr, len) {
            return Err(MemoryError::NotHostMemory { addr, len });
        }
        // Held across the check and the registration, so that two threads registering one
        // range get one region; the regions' lock is taken only to read and then to insert,
        // so submitters never wait for a rail pinning memory.
        let _registering = self
            .inner
            .registering
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let overlapping =
            self.find_region(|region| region.addr < addr + len && addr < region.addr + region.len);
        if let Some(existing) = overlapping {
            if existing.addr == addr && existing.len == len && existing.peer_access == peer_access {
                return Ok(existing);
            }
            return Err(MemoryError::Overlaps {
                addr,
                len,
                region: existing.id,
                region_addr: existing.addr,
                region_len: existing.len,
            });
        }
        // SAFETY: the caller's contract is the rails'.
        let registrations = unsafe {
            self.inner
                .rails
                .register_user(addr, len, peer_access.access())
        }?;
        let region = Region {
            id: self.inner.next_region.fetch_add(1, Ordering::Relaxed),
            addr,
            len,
            backing: None,
            numa: None,
            peer_access,
        };
        self.insert(RegionEntry {
            region,
            memory: None,
            registrations,
            generation: region.id,
            lingering: Vec::new(),
            rekeyed: Vec::new(),
            withdrawn: false,
        });
        Ok(region)
    }

    /// The registered region holding all of `addr..addr + len`, if one does.
    pub fn region_at(&self, addr: u64, len: u64) -> Option<Region> {
        self.find_region(|region| region.contains(addr, len))
    }

    /// The first registered region `matches` accepts.
    fn find_region(&self, matches: impl Fn(&Region) -> bool) -> Option<Region> {
        self.inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|entry| entry.region)
            .find(|region| matches(region))
    }

    /// Every registered region (allocated or the application's), by address.
    pub fn regions(&self) -> Vec<Region> {
        let mut regions: Vec<Region> = self
            .inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|entry| entry.region)
            .collect();
        regions.sort_by_key(|region| region.addr);
        regions
    }

    /// Registers a region's memory anew — new keys on every rail — and withdraws its old
    /// keys; returns the region under its new id (the old id is gone). The memory, its address
    /// and its contents stay. Work requests that name an old key are refused before any byte
    /// moves (`RemoteAccess`); a peer holding the old keys refreshes this process's
    /// descriptor when that happens, and its work continues under the new ones (the region
    /// keeps its generation: it is the same memory, unlike a deregister and a register). A request a
    /// peer had already begun with an old key may finish: into the same memory. For rotating
    /// keys that may have leaked, or a rebuilt cache announcing itself. This engine's own
    /// transfers from or into the region that are in flight meanwhile carry the old local
    /// key and may fail (`LocalProtection`): rotate between them.
    ///
    /// # Errors
    /// [`MemoryError::UnknownRegion`]; [`MemoryError::Register`] when a rail refuses (the
    /// region then keeps its old keys and id); [`MemoryError::Withdraw`] when the new keys
    /// are in place (under the id the error names) but a rail refused to withdraw an old
    /// one: the old key stays live there until [`Self::deregister`] withdraws it.
    pub fn reregister(&self, region: Region) -> Result<Region, MemoryError> {
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = regions
            .iter_mut()
            .find(|entry| entry.region.id == region.id)
            .ok_or(MemoryError::UnknownRegion { id: region.id })?;
        let fresh = match &entry.memory {
            Some(memory) => self.inner.rails.register_memory(
                memory,
                entry.region.len,
                true,
                entry.region.peer_access.access(),
            )?,
            // SAFETY: the application's promise for this memory (see `register`) holds until
            // it deregisters the region, which now owns these registrations.
            None => unsafe {
                self.inner.rails.register_user(
                    entry.region.addr,
                    entry.region.len,
                    entry.region.peer_access.access(),
                )
            }?,
        };
        let withdrawn = std::mem::replace(&mut entry.registrations, fresh);
        entry.region.id = self.inner.next_region.fetch_add(1, Ordering::Relaxed);
        let renewed = entry.region;
        let refused = self.inner.rails.deregister(&withdrawn);
        if refused.is_err() {
            entry.lingering.push(withdrawn);
        } else {
            entry.rekeyed.push(withdrawn);
        }
        if let Some(rails::Memory::Soft(buffer)) = entry.memory.as_mut() {
            // Its own key (rail 0's first registration) is among the withdrawn ones.
            buffer.own_key_withdrawn();
        }
        self.publish(&regions);
        match refused {
            Ok(()) => Ok(renewed),
            Err((rail, reason)) => Err(MemoryError::Withdraw {
                id: renewed.id,
                addr: renewed.addr,
                len: renewed.len,
                rail,
                reason,
            }),
        }
    }

    fn insert(&self, entry: RegionEntry) {
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        regions.push(entry);
        self.publish(&regions);
    }

    /// The regions' version ([`Inner::regions_version`]).
    pub(crate) fn regions_version(&self) -> u64 {
        self.inner.regions_version.load(Ordering::Acquire)
    }

    fn publish(&self, regions: &[RegionEntry]) {
        // Release, under the regions' write lock: a submitter that sees the new version
        // finds the new table.
        self.inner.regions_version.fetch_add(1, Ordering::Release);
        self.inner.shared.set_regions(
            regions
                .iter()
                .filter(|entry| entry.region.peer_access != PeerAccess::None)
                .map(|entry| RegionDescriptor {
                    base: entry.region.addr,
                    len: entry.region.len,
                    rkeys: entry.registrations.iter().map(|r| r.rkey).collect(),
                    generation: entry.generation,
                    access: entry.region.peer_access.access(),
                })
                .collect(),
        );
        self.inner
            .directory
            .publish(|| self.inner.control.descriptor());
    }

    /// Withdraws a region from every rail and, once nothing can touch it any more, frees it
    /// (if the engine allocated it) and returns. Work requests that name it afterwards fail;
    /// peers learn of it at their next descriptor refresh.
    ///
    /// **When it returns `Ok`, no poller of this engine and no peer will read or write the
    /// region again, whatever is registered at its address later**: its keys are withdrawn
    /// on every rail (a peer's request that arrives later is refused before any byte moves,
    /// and peers fail work prepared against it with `RegionWithdrawn` rather than re-prepare
    /// it for a new registration of the same memory), every poller has finished the round in
    /// which it might have checked a key before the withdrawal, every request this engine
    /// posted through the region's local keys has completed or been flushed (a READ still
    /// in flight would land in it), and every peer process that copies itself (soft fabric)
    /// has left any copy it started before. The application may unmap
    /// or reuse registered memory at once. It waits at most [`DEREGISTER_WAIT`].
    ///
    /// # Errors
    /// [`MemoryError::UnknownRegion`]; [`MemoryError::Busy`] when a poller, a request posted
    /// through it or a peer is still inside the region at the deadline (a stopped process,
    /// say): the region stays withdrawn
    /// and mapped, and calling `deregister` again waits again; [`MemoryError::Withdraw`]
    /// when a rail refused to withdraw it (the provider's error): it stays mapped (and
    /// registered on that rail), and calling `deregister` again tries again. Either way
    /// the region is gone from this engine's descriptor: no new work names it.
    pub fn deregister(&self, region: Region) -> Result<(), MemoryError> {
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let mut entry = match regions
            .iter()
            .position(|entry| entry.region.id == region.id)
        {
            Some(index) => {
                let entry = regions.remove(index);
                self.publish(&regions);
                entry
            }
            None => {
                let mut fencing = self.fencing();
                let index = fencing
                    .iter()
                    .position(|entry| entry.region.id == region.id)
                    .ok_or(MemoryError::UnknownRegion { id: region.id })?;
                fencing.remove(index)
            }
        };
        drop(regions);
        let local_keys = entry.local_keys();
        if let Err((rail, reason)) = entry.withdraw(&self.inner.rails) {
            let region = entry.region;
            self.fencing().push(entry);
            return Err(MemoryError::Withdraw {
                id: region.id,
                addr: region.addr,
                len: region.len,
                rail,
                reason,
            });
        }
        let deadline = Instant::now() + DEREGISTER_WAIT;
        // Once every poller finished the round that might have posted through a withdrawn
        // key, wait for what it posted before to complete: some providers land a READ's
        // bytes in local memory whether or not its registration is still open.
        let quiet = self
            .inner
            .pollers
            .iter()
            .all(|poller| poller.quiesce(deadline))
            && self
                .inner
                .pollers
                .iter()
                .zip(&local_keys)
                .all(|(poller, lkeys)| poller.drain_local(lkeys, deadline))
            && self.inner.rails.quiesce_peers(deadline);
        if !quiet {
            let region = entry.region;
            self.fencing().push(entry);
            return Err(MemoryError::Busy {
                id: region.id,
                addr: region.addr,
                len: region.len,
                waited: DEREGISTER_WAIT,
            });
        }
        drop(entry);
        Ok(())
    }

    fn fencing(&self) -> MutexGuard<'_, Vec<RegionEntry>> {
        self.inner
            .fencing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The registrations of region `id` on each rail.
    pub(crate) fn registrations(&self, id: u64) -> Option<(Region, Vec<MemoryRegion>)> {
        self.inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|entry| entry.region.id == id)
            .map(|entry| (entry.region, entry.registrations.clone()))
    }

    /// Connects to the engine at `target` — `host:port`, or with a directory, a segment
    /// name — with an endpoint on every local rail, its descriptor fetched. Waits for the
    /// queue pairs (up to the connect timeout).
    ///
    /// # Errors
    /// [`PeerError`] when the address is bad, the name unknown, the peer cannot be reached
    /// in time, or the process answering is not the one asked for (the directory's record
    /// is stale, or it restarted while being opened).
    pub fn open(&self, target: &str) -> Result<Peer, PeerError> {
        let resolved;
        let (target, expected) = if target.contains(':') {
            (target, None)
        } else {
            let descriptor = self.inner.directory.resolve(target)?;
            resolved = descriptor.handshake_addr;
            (resolved.as_str(), Some(descriptor.incarnation))
        };
        let addr = target
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| PeerError::BadAddress {
                name: target.to_string(),
            })?;
        let unreachable = |reason: String| PeerError::Unreachable { addr, reason };
        let first = self
            .inner
            .control
            .connect(addr, 0, 0)
            .map_err(|error| unreachable(error.to_string()))?;
        let incarnation = first.key.peer;
        if let Some(expected) = expected.filter(|&expected| expected != incarnation) {
            // Not the process asked for: nothing is kept of it.
            let _ = self.inner.control.retire(&first);
            return Err(unreachable(format!(
                "the directory names incarnation {expected} there, but {incarnation} answers: \
                 the record is stale (look the name up again)"
            )));
        }
        let deadline = Instant::now() + self.inner.connect_timeout;
        if !first.wait_ready(deadline) {
            return Err(unreachable(format!(
                "no queue pair within the connect timeout ({:?})",
                first.phase()
            )));
        }
        let remote_rails = first.descriptor().map_or(1, |d| d.rails.len().max(1));
        let mut views = vec![first];
        for rail in 1..self.rails() {
            let view = self
                .inner
                .control
                .connect(addr, rail as u16, (rail % remote_rails) as u16)
                .map_err(|error| unreachable(error.to_string()))?;
            if view.key.peer != incarnation {
                for opened in views.iter().chain([&view]) {
                    let _ = self.inner.control.retire(opened);
                }
                return Err(unreachable(format!(
                    "the process there changed while it was being opened ({incarnation}, then \
                     {}); open it again",
                    view.key.peer
                )));
            }
            if !view.wait_ready(deadline) {
                return Err(unreachable(format!("rail {rail} did not connect")));
            }
            views.push(view);
        }
        Ok(Peer { addr, views })
    }

    /// What the segment named `name` last published in the directory (its incarnation,
    /// address, rails and regions), without connecting to it. A segment with a cluster secret
    /// publishes no regions: peers get them through the authenticated handshake, not from
    /// whoever can read the directory.
    ///
    /// # Errors
    /// [`PeerError::UnknownName`] when there is no directory or no such live segment.
    pub fn lookup(&self, name: &str) -> Result<SegmentDescriptor, PeerError> {
        self.inner.directory.resolve(name)
    }

    /// A submitter for this thread.
    ///
    /// # Errors
    /// [`TransferError::PollerStopped`] when a rail's poller has stopped.
    pub fn submitter(&self) -> Result<EngineSubmitter, TransferError> {
        EngineSubmitter::new(self.clone())
    }

    /// The fence a target uses when it gives up on an initiator itself (its own timeout, or
    /// before handing KV slots that peer was writing to another sequence).
    ///
    /// **After it returns `Ok`, no write or read that `peer` submitted before that moment
    /// ever touches this engine's memory** — not after a reconnect, not after a retry. It
    /// takes every queue pair `peer` connected to this engine out of service on every rail
    /// and returns only when nothing still buffered or in flight on them can land — the TCP
    /// fabric's pollers have closed the connections (discarding what was buffered), soft
    /// peers have left any copy they began and are refused from then on — and it bumps this
    /// engine's fence generation for `peer`, which every later handshake tells it: the peer
    /// reconnects on its own, as after any failure, and fails everything it had prepared
    /// before that handshake with `Revoked` instead of retrying it. Its new work lands as
    /// usual. `peer` is an initiator's incarnation: a [`Peer`]'s, or a [`Notification`]'s
    /// sender. Waits at most [`REVOKE_WAIT`].
    ///
    /// # Errors
    /// [`RevokeError::Busy`] when a poller or peer process did not let go in time: the queue
    /// pairs stay out of service, and the next `revoke` of the same peer waits for them
    /// again (the fence holds only once a call returns `Ok`); [`RevokeError::Stopped`] or
    /// [`RevokeError::Unresponsive`] when the control plane has stopped or is stuck;
    /// [`RevokeError::Unsupported`] on libfabric, which cannot fence one peer (nothing is
    /// changed: deregister the memory instead).
    pub fn revoke(&self, peer: impl Into<Incarnation>) -> Result<(), RevokeError> {
        if let Some(fabric) = self.inner.rails.fence_unsupported() {
            return Err(RevokeError::Unsupported { fabric });
        }
        let peer = peer.into();
        let mut revoked = self
            .inner
            .control
            .revoke(peer)
            .map_err(|error| match error {
                railyard_control::ControlError::Unresponsive => RevokeError::Unresponsive,
                _ => RevokeError::Stopped,
            })?;
        let mut revoking = self
            .inner
            .revoking
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let earlier = std::mem::take(&mut *revoking);
        let (mine, others): (Vec<_>, Vec<_>) =
            earlier.into_iter().partition(|(owner, _)| *owner == peer);
        *revoking = others;
        drop(revoking);
        revoked.extend(mine.into_iter().map(|(_, revocation)| revocation));
        let deadline = Instant::now() + REVOKE_WAIT;
        let busy: Vec<_> = revoked
            .into_iter()
            .filter(|revocation| !revocation.wait(deadline))
            .collect();
        if busy.is_empty() {
            return Ok(());
        }
        let queue_pairs = busy.len();
        self.inner
            .revoking
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(busy.into_iter().map(|revocation| (peer, revocation)));
        Err(RevokeError::Busy {
            peer,
            queue_pairs,
            waited: REVOKE_WAIT,
        })
    }

    /// Sends `bytes` to `peer` now.
    ///
    /// # Errors
    /// [`PeerError::Control`] when the control plane has stopped.
    pub fn notify(&self, peer: &Peer, bytes: Vec<u8>) -> Result<(), PeerError> {
        Ok(self
            .inner
            .control
            .notify(peer.addr, peer.incarnation(), bytes, None)?)
    }

    /// Sends `bytes` to `peer` once `batch` has completed successfully (all its data is in
    /// place before the notification leaves), and not at all if it failed.
    ///
    /// # Errors
    /// [`PeerError::Control`] when the control plane has stopped or `bytes` is larger than
    /// one notification carries.
    pub fn notify_after(
        &self,
        peer: &Peer,
        bytes: Vec<u8>,
        batch: &Batch,
    ) -> Result<(), PeerError> {
        Ok(self
            .inner
            .control
            .notify(peer.addr, peer.incarnation(), bytes, Some(batch.clone()))?)
    }

    pub(crate) fn signal_after(
        &self,
        peer: &Peer,
        value: u32,
        batch: &Batch,
    ) -> Result<(), PeerError> {
        Ok(self
            .inner
            .control
            .signal(peer.views.clone(), value, batch.clone())?)
    }

    /// The fault plan of rail `rail`, to make its queue pairs fail on purpose: for chaos
    /// drills and tests of what an application does when links fail. Host rails (soft and
    /// TCP) and libfabric rails; `None` on verbs or for a rail that does not exist. An empty
    /// plan (the default) costs one atomic load per post.
    pub fn faults(&self, rail: usize) -> Option<FaultHandle> {
        self.inner.rails.faults(rail)
    }

    /// Takes the notifications peers sent, oldest first.
    pub fn drain_notifications(&self) -> Vec<Notification> {
        self.inner.shared.drain_notifications()
    }

    /// Takes the notifications peers sent, oldest first, waiting until at least one has
    /// arrived or `deadline` passes (then it returns none).
    pub fn wait_notifications(&self, deadline: Instant) -> Vec<Notification> {
        self.inner.shared.wait_notifications(deadline)
    }

    /// Counters per rail, per peer and of the control plane.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            rails: self
                .inner
                .pollers
                .iter()
                .enumerate()
                .map(|(rail, poller)| RailStats {
                    name: self.inner.rails.name(rail),
                    poller: poller.counters(),
                    served: self.inner.rails.served(rail),
                })
                .collect(),
            peers: transfer::peer_stats(self),
            control: self.inner.control.stats(),
        }
    }

    /// A handle that does not keep it running.
    pub(crate) fn downgrade(&self) -> WeakEngine {
        WeakEngine(Arc::downgrade(&self.inner))
    }

    /// Every endpoint that exists now, with its rail.
    pub(crate) fn endpoint_views(&self) -> Vec<(u16, Arc<EndpointView>)> {
        self.inner.control.endpoints()
    }

    /// Rail `rail`'s name.
    pub(crate) fn rail_name(&self, rail: u16) -> String {
        self.inner.rails.name(usize::from(rail))
    }

    pub(crate) fn pollers(&self) -> &[Arc<PollerHandle>] {
        &self.inner.pollers
    }

    /// The largest slice: transfers are split at it ([`EngineBuilder::slice_size`]).
    pub fn slice_size(&self) -> usize {
        self.inner.slice_size
    }

    pub(crate) fn default_deadline(&self) -> Duration {
        self.inner.deadline
    }
}
