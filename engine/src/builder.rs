//! How an engine comes to be: the builder's settings, and what `build` makes of them and of
//! the host — fabric, rails and their pollers, control plane, directory.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroUsize;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use railyard_control::{ClusterSecret, ControlConfig, ControlShared, HostMode, Policy};
use railyard_dataplane::fabric::verbs::RailConfig;
use railyard_dataplane::{DEFAULT_DEADLINE, IdleStrategy};
use railyard_topology::{HostTopology, PlanOptions, RailKind};

use super::directory::{self, DirectoryChoice};
use super::error::BuildError;
use super::peer::SessionTable;
use super::rails::{PlannedRail, Rails};
use super::state::{Engine, Inner};
use super::stats::PeerTable;

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
    encrypt_control: bool,
    accept_tcp_sinks: Option<bool>,
    tcp_max_half_open: usize,
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

    /// Encrypt control frames after the handshake (AES-256-GCM), not only
    /// authenticate them (default: off). With a secret, every frame after the handshake
    /// carries a MAC under keys derived from the secret and both sides' nonces, with a
    /// sequence number; encryption also hides the region addresses, keys, data-port tokens
    /// and notifications in those frames from the path (not the data path: a TCP data
    /// connection shows its token, and each request its address and key). Either side of a connection asking is enough. Needs
    /// [`Self::secret`]: [`Self::build`] refuses it alone.
    #[must_use]
    pub fn encrypt_control(mut self, encrypt: bool) -> Self {
        self.encrypt_control = encrypt;
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

    /// Most connections each TCP data port keeps bound to no queue pair, waiting for their
    /// hello or raw sink streams (default 64): beyond it the oldest is closed, so that
    /// clients that connect and say nothing can neither exhaust this process's file
    /// descriptors nor take a poller's time (see
    /// [`TcpConfig::max_half_open`](railyard_dataplane::fabric::tcp::TcpConfig::max_half_open)).
    /// Raise it where many peers connect at once over a slow network.
    #[must_use]
    pub fn tcp_max_half_open(mut self, connections: usize) -> Self {
        self.tcp_max_half_open = connections;
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
            encrypt_control: self.encrypt_control,
            ..ControlConfig::new(self.name.clone())
        };
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
                max_half_open: self.tcp_max_half_open,
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
        if self.secret.is_none() && !self.listen.ip().is_loopback() {
            // Once per process (a process of many engines has one decision to make), once
            // one listens. An engine on loopback only (a local benchmark, a test) is
            // reached from this host alone.
            static WARNED: std::sync::Once = std::sync::Once::new();
            let listening = started.control.local_addr();
            WARNED.call_once(|| {
                tracing::warn!(
                    target: "railyard::engine",
                    engine = %self.name,
                    listen = %listening,
                    "peers are not authenticated: whoever reaches {listening} can connect \
                     queue pairs to this process's memory; to set a secret, give every \
                     process of the cluster the same file with --secret-file FILE or \
                     RAILYARD_SECRET_FILE=FILE"
                );
            });
        }
        let rail_numa = planned.iter().map(|rail| rail.numa).collect();
        let directory = directory::start(&self.directory, &started.control, self.secret.is_some())?;
        Ok(Engine {
            inner: Arc::new(Inner {
                directory,
                name: self.name,
                slice_size: self.slice_size,
                deadline: self.deadline,
                connect_timeout: self.policy.connect_timeout,
                handshake_queue_timeout: self.policy.handshake_queue_timeout,
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
                peers: PeerTable::default(),
                sessions: SessionTable::default(),
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
            encrypt_control: false,
            accept_tcp_sinks: None,
            tcp_max_half_open: railyard_dataplane::fabric::tcp::TcpConfig::default().max_half_open,
        }
    }
}
