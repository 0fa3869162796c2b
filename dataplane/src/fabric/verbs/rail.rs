//! One RDMA rail: a device context, its protection domain and the rail's completion queue,
//! the port and GID it uses, its memory registrations, and the queue pairs the control
//! plane connected and staged for the poller ([`VerbsRail::stage`], then
//! [`Fabric::connect`](crate::fabric::Fabric::connect) adopts them, as the soft fabric does).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use super::attrs::{QpConfig, RemoteQp, access_flags};
use super::ffi::{
    CompletionQueue, Context, MemoryRegion, PortInfo, PreparedQp, ProtectionDomain, QueuePair,
    VerbsError,
};
use super::gid::{choose_gid, read_gid_table};
use super::mtu::PathMtu;
use crate::fabric::staging::Staging;
use crate::fabric::{Access, QpInfo};
use crate::{EndpointId, Epoch};

/// How a rail is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailConfig {
    /// The port; `None` picks the first ACTIVE one.
    pub port: Option<u8>,
    /// The GID index; `None` picks the RoCE v2 IPv4-mapped GID (Ethernet) or none (IB).
    pub gid_index: Option<u8>,
    /// Queue-pair capacities and timeouts.
    pub qp: QpConfig,
    /// Completion-queue depth.
    pub cq_depth: i32,
    /// One signaled completion every this many work requests (and the last of a list).
    pub signal_every: usize,
}

impl Default for RailConfig {
    fn default() -> Self {
        Self {
            port: None,
            gid_index: None,
            qp: QpConfig::default(),
            cq_depth: 16 * 1024,
            signal_every: 16,
        }
    }
}

/// Why a rail could not open.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RailError {
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// No port is ACTIVE (or the configured one is not).
    #[error("device {device}: no ACTIVE port{}", .port.map_or(String::new(), |p| format!(" {p}")))]
    NoActivePort {
        /// The device.
        device: String,
        /// The port asked for, if any.
        port: Option<u8>,
    },
    /// An Ethernet port without a usable GID.
    #[error("device {device} port {port}: no RoCE GID in its table")]
    NoGid {
        /// The device.
        device: String,
        /// The port.
        port: u8,
    },
}

/// One RDMA rail. Shared (`Arc`) by the control thread (registrations, queue-pair set-up)
/// and the rail's poller (its [`super::VerbsFabric`]).
#[derive(Debug)]
pub struct VerbsRail {
    pub(crate) context: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) port_info: PortInfo,
    gid: [u8; 16],
    pub(crate) config: RailConfig,
    regions: Mutex<HashMap<u32, MemoryRegion>>,
    pub(crate) staged: Staging<QueuePair>,
}

/// Ports a device is asked about when none is configured.
const MAX_PORTS: u8 = 4;

impl VerbsRail {
    /// Opens device `name` as a rail.
    ///
    /// # Errors
    /// [`RailError`] naming the step that failed.
    pub fn open(name: &str, mut config: RailConfig) -> Result<Arc<Self>, RailError> {
        let context = Context::open(name)?;
        let candidates: Vec<u8> = match config.port {
            Some(port) => vec![port],
            None => (1..=MAX_PORTS).collect(),
        };
        let (port, port_info) = candidates
            .into_iter()
            .filter_map(|port| context.query_port(port).ok().map(|info| (port, info)))
            .find(|(_, info)| info.active)
            .ok_or(RailError::NoActivePort {
                device: name.to_string(),
                port: config.port,
            })?;
        if port_info.ethernet && config.gid_index.is_none() {
            let table = read_gid_table(
                &Path::new("/sys/class/infiniband")
                    .join(name)
                    .join("ports")
                    .join(port.to_string()),
            );
            config.gid_index = Some(choose_gid(&table).ok_or(RailError::NoGid {
                device: name.to_string(),
                port,
            })?);
        }
        let gid = match config.gid_index {
            Some(index) => context.query_gid(port, index)?,
            None => [0; 16],
        };
        config.qp.port = port;
        config.qp.gid_index = config.gid_index;
        let (as_target, as_initiator) = context.read_depths()?;
        config.qp.max_rd_atomic =
            super::attrs::clamp_read_depth(config.qp.max_rd_atomic, as_target, as_initiator);
        let pd = ProtectionDomain::new(&context)?;
        let cq = CompletionQueue::new(&context, config.cq_depth)?;
        Ok(Arc::new(Self {
            context,
            pd,
            cq,
            port_info,
            gid,
            config,
            regions: Mutex::new(HashMap::new()),
            staged: Staging::default(),
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        self.context.name()
    }

    /// Registers `len` bytes at `addr` with `access`; returns (lkey, rkey).
    ///
    /// # Safety
    /// The memory must stay mapped until [`Self::deregister`] (the NIC reads and writes it).
    ///
    /// # Errors
    /// When the device refuses.
    pub unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(u32, u32), VerbsError> {
        let flags = access_flags(access);
        // SAFETY: forwarded from the caller.
        let region = unsafe { MemoryRegion::register(&self.pd, addr, len, flags) }?;
        let keys = (region.lkey(), region.rkey());
        self.regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(keys.1, region);
        Ok(keys)
    }

    /// Withdraws the registration with `rkey`; `false` when there is none.
    pub fn deregister(&self, rkey: u32) -> bool {
        self.regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&rkey)
            .is_some()
    }

    /// An initiator's queue pair in INIT and what the peer needs to connect to it. It
    /// takes no receives: both its queues complete into the rail's (the poller's) queue.
    ///
    /// # Errors
    /// When the device refuses.
    pub fn create_qp(&self, psn: u32) -> Result<(PreparedQp, QpInfo), VerbsError> {
        let prepared = PreparedQp::new(&self.pd, &self.cq, &self.cq, self.config.qp, psn)?;
        Ok(self.with_info(prepared))
    }

    /// A target's queue pair in INIT: its receives complete into a queue of its own, for
    /// whoever owns it to take WRITE_WITH_IMM immediates from
    /// ([`QueuePair::take_immediates`]), and its receive queue is already full, so a writer
    /// never waits for a receive.
    ///
    /// # Errors
    /// When the device refuses.
    pub fn create_target_qp(&self, psn: u32) -> Result<(PreparedQp, QpInfo), VerbsError> {
        let receives = self.config.qp.caps.max_recv_wr;
        let recv_cq = CompletionQueue::new(&self.context, receives as i32)?;
        let prepared = PreparedQp::new(&self.pd, &self.cq, &recv_cq, self.config.qp, psn)?;
        prepared.post_receives(receives as usize)?;
        Ok(self.with_info(prepared))
    }

    fn with_info(&self, prepared: PreparedQp) -> (PreparedQp, QpInfo) {
        let info = QpInfo {
            qp_num: prepared.num(),
            lid: self.port_info.lid,
            gid: self.gid,
            psn: prepared.psn(),
            path_mtu: self.port_info.mtu.bytes(),
        };
        (prepared, info)
    }

    /// Connects a prepared queue pair to the peer's `remote` side at the smaller MTU.
    ///
    /// # Errors
    /// When a transition is refused.
    pub fn connect(&self, prepared: PreparedQp, remote: &QpInfo) -> Result<QueuePair, VerbsError> {
        let remote_mtu = PathMtu::from_bytes(remote.path_mtu).unwrap_or(PathMtu::Mtu1024);
        let mtu = PathMtu::negotiate(self.port_info.mtu, remote_mtu);
        prepared.handshake(
            &RemoteQp {
                qp_num: remote.qp_num,
                lid: remote.lid,
                gid: remote.gid,
                psn: remote.psn,
            },
            mtu,
        )
    }

    /// Hands a connected queue pair to this rail's poller for `endpoint` at `epoch`.
    pub fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: QueuePair) {
        self.staged.stage(endpoint, epoch, qp);
    }
}
