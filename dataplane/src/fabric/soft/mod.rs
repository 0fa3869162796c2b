//! The soft fabric: RDMA verbs semantics in software, between processes of one host, with
//! deterministic fault injection (DESIGN.md §5).
//!
//! For hosts without RDMA NICs and for tests. The pieces mirror verbs:
//! - [`SoftDevice`]: one rail's device context and protection domain. [`SoftDevice::register`]
//!   returns lkey/rkey with [`Access`] flags and exact bounds; the registrations live in a
//!   region table in shared memory the process owns (module `regions`), which peers map read-only
//!   and check on every work request — a deregistration is seen by the next one.
//! - [`SoftQp`]: an RC queue pair with verbs' state machine (RESET → INIT → RTR → RTS → ERR),
//!   connected by exchanging `QpInfo` over a Unix socket together
//!   with the descriptors of the region table and of the queue pair's inbox
//!   ([`handshake`]).
//! - [`SoftFabric`]: the completion queue and send queues one poller drives; executing work
//!   requests is the poller's job, so the poller is the NIC (module `nic`). Bytes move with
//!   `process_vm_writev` / `process_vm_readv` (any memory of the target), or with a plain
//!   copy within one process and into a peer's [`SoftBuffer`] (engine-allocated memory
//!   that peers map); errors are verbs' statuses, where verbs gives them.
//! - [`FaultPlan`]: failures on purpose, the same for the same seed.
//!
//! # Peer liveness
//! A queue pair holds a pidfd of its peer process. Before executing queued work the fabric
//! checks it at most every [`SoftConfig::liveness_interval`]; a copy that finds the process
//! gone (ESRCH) fails at once. Either way the request completes with RETRY_EXC_ERR and the
//! queue pair goes to ERR, so a dead target is reported within one liveness interval of the
//! next poll, never by a hang. A WRITE_WITH_IMM whose receiver stays full fails the same way
//! after [`SoftConfig::peer_timeout`].
//!
//! # Permissions
//! `process_vm_writev` needs ptrace access to the target (same user, and with Yama's
//! `ptrace_scope` = 1 the target must allow it). The handshake proves access both ways by
//! reading the peer's table magic through `process_vm_readv`, so a host that forbids it
//! fails at connect time with [`SoftError::ProbeRefused`], not at the first transfer.

mod buffer;
mod fabric;
mod fence;
pub mod handshake;
mod inbox;
mod nic;
mod qp;
mod regions;
mod sys;

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub use crate::fabric::faults::{Fault, FaultHandle, FaultPlan, QpMatch};
pub use buffer::{Backing, SoftBuffer};
pub use fabric::SoftFabric;
pub use inbox::{INBOX_CAPACITY, InboxError, RecvCompletion, RecvQueue};
pub use qp::{SoftAttachment, SoftQp};
pub use regions::{CAPACITY as REGION_CAPACITY, RegionError, RemoteTableError};

use super::staging::Staging;
use crate::fabric::{Access, MemoryRegion, QpInfo, QpNum, QpState};
use crate::{EndpointId, Epoch};
use regions::RegionTable;

/// How a soft device behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftConfig {
    /// How often, at most, a queue pair with queued work checks that its peer process lives.
    /// A dead peer is reported (RETRY_EXC_ERR) within this much of the next poll.
    pub liveness_interval: Duration,
    /// How long a WRITE_WITH_IMM waits for room in the receiver's inbox before
    /// RETRY_EXC_ERR.
    pub peer_timeout: Duration,
    /// Work requests a queue pair queues before `post` refuses more (verbs' `max_send_wr`).
    pub send_queue_depth: usize,
    /// Longest a handshake may take, per step.
    pub handshake_timeout: Duration,
}

impl Default for SoftConfig {
    fn default() -> Self {
        Self {
            liveness_interval: Duration::from_millis(1),
            peer_timeout: Duration::from_millis(200),
            send_queue_depth: 16 * 1024,
            handshake_timeout: Duration::from_secs(2),
        }
    }
}

/// Why a soft-fabric operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SoftError {
    /// A system call failed.
    #[error("cannot {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A registration was refused.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// A queue-pair state change verbs does not allow.
    #[error("queue pair {qp:?} cannot go from {from:?} to {to:?}")]
    InvalidTransition {
        /// The queue pair.
        qp: QpNum,
        /// Its state.
        from: QpState,
        /// The state asked for.
        to: QpState,
    },
    /// The queue pair is not ready to send.
    #[error("queue pair {qp:?} is in {state:?}, not ready to send")]
    NotReady {
        /// The queue pair.
        qp: QpNum,
        /// Its state.
        state: QpState,
    },
    /// No connected queue pair was staged for the endpoint at that epoch.
    #[error("no connected queue pair is staged for endpoint {endpoint:?} at {epoch}{staged}")]
    NotStaged {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
        /// What is staged instead, if anything.
        staged: String,
    },
    /// The handshake failed.
    #[error("handshake with {peer}: {reason}")]
    Handshake {
        /// The peer's socket path.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// The peer's process cannot be accessed with `process_vm_readv`.
    #[error(
        "cannot access the memory of peer process {pid} ({source}); process_vm_writev needs \
         the same user and ptrace permission (see /proc/sys/kernel/yama/ptrace_scope)"
    )]
    ProbeRefused {
        /// The peer.
        pid: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

#[derive(Debug)]
struct DeviceInner {
    name: String,
    config: SoftConfig,
    pid: u32,
    incarnation: u64,
    table: Arc<RegionTable>,
    next_qp: AtomicU32,
    /// Connected queue pairs waiting for their poller's `connect`, by endpoint.
    staged: Staging<SoftQp>,
    /// Queue pairs through which peers may copy into and out of this device's memory.
    guests: Arc<fence::Guests>,
    faults: FaultHandle,
}

/// One rail's soft device: context, protection domain and region table. Cheap to clone;
/// `Send + Sync`: the control plane registers memory and connects queue pairs from any
/// thread while the rail's poller drives the [`SoftFabric`].
#[derive(Clone, Debug)]
pub struct SoftDevice(Arc<DeviceInner>);

impl SoftDevice {
    /// Opens a device named `name` (the rail) with a new random incarnation.
    ///
    /// # Errors
    /// [`SoftError::Io`] when the region table's shared memory cannot be created.
    pub fn open(name: impl Into<String>, config: SoftConfig) -> Result<Self, SoftError> {
        let pid = std::process::id();
        let incarnation = crate::entropy::random_u64();
        let table = RegionTable::new(pid, incarnation).map_err(|source| SoftError::Io {
            what: "create the region table",
            source,
        })?;
        Ok(Self(Arc::new(DeviceInner {
            name: name.into(),
            config,
            pid,
            incarnation,
            table: Arc::new(table),
            next_qp: AtomicU32::new(1),
            staged: Staging::default(),
            guests: Arc::default(),
            faults: FaultHandle::default(),
        })))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Its configuration.
    pub fn config(&self) -> &SoftConfig {
        &self.0.config
    }

    /// The random id chosen when it opened.
    pub fn incarnation(&self) -> u64 {
        self.0.incarnation
    }

    /// Changes this device's fault plan, for every fabric made from it.
    pub fn faults(&self) -> FaultHandle {
        self.0.faults.clone()
    }

    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// Until it is withdrawn and fenced, the range must stay mapped and valid for reads (and
    /// for writes, when `access` allows peers to write or READs to land in it): this process
    /// and its peers copy into and out of it at any time, as a NIC would. Fenced means:
    /// [`Self::deregister`] returned, every poller driving a fabric of this device passed
    /// [`PollerHandle::quiesce`](crate::PollerHandle::quiesce) after it, and
    /// [`Self::quiesce_peers`] returned true.
    ///
    /// # Errors
    /// [`RegionError::BadRange`] for an empty, null or wrapping range;
    /// [`RegionError::TableFull`] past [`REGION_CAPACITY`] registrations.
    pub unsafe fn register(
        &self,
        addr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, SoftError> {
        let addr = addr as u64;
        let len = len as u64;
        let key = self.0.table.register(addr, len, access, None)?;
        Ok(MemoryRegion {
            addr,
            len,
            lkey: key,
            rkey: key,
            access,
        })
    }

    /// Withdraws a registration. Work requests that name it afterwards — including those
    /// already posted and not yet executed — fail with LOC_PROT_ERR (as lkey) or
    /// REM_ACCESS_ERR (as rkey). A copy whose check came before may still be running: see
    /// [`Self::register`] for the fence that waits for it.
    ///
    /// # Errors
    /// [`RegionError::UnknownKey`] when it is not registered (any more).
    pub fn deregister(&self, region: &MemoryRegion) -> Result<(), SoftError> {
        Ok(self.0.table.deregister(region.rkey)?)
    }

    /// Call after [`Self::deregister`] (or after dropping queue pairs to take them out of
    /// service): returns true once no peer process is still inside a copy into or out of
    /// this device's memory whose key check came before, so the memory may be unmapped or
    /// reused. False if `deadline` passes first (a peer stopped mid-copy, say); a peer that
    /// has exited is not waited for. See the `fence` module.
    pub fn quiesce_peers(&self, deadline: std::time::Instant) -> bool {
        self.0.guests.quiesce(deadline)
    }

    /// A new queue pair in RESET; the peer may do `access` through it.
    ///
    /// # Errors
    /// [`SoftError::Io`] when its inbox cannot be created.
    pub fn create_qp(&self, access: Access) -> Result<SoftQp, SoftError> {
        // 23 bits: numbers with bit 23 set are the TCP fabric's.
        let num = self.0.next_qp.fetch_add(1, Ordering::Relaxed) & (crate::fabric::TCP_QP_BIT - 1);
        let info = QpInfo {
            qp_num: num.max(1),
            lid: 0,
            gid: qp::soft_gid(self.0.incarnation, self.0.pid),
            psn: (crate::entropy::random_u64() & 0x00ff_ffff) as u32,
            path_mtu: qp::SOFT_PATH_MTU,
        };
        SoftQp::new(
            QpNum(info.qp_num),
            info,
            access,
            self.0.table.clone(),
            self.0.guests.clone(),
        )
    }

    /// Hands a connected queue pair to the poller of this rail: its next
    /// [`Fabric::connect`](crate::fabric::Fabric::connect) for `endpoint` at `epoch` adopts
    /// it. A queue pair staged earlier for the same endpoint and not adopted is dropped.
    ///
    /// # Errors
    /// [`SoftError::NotReady`] unless it is in RTS.
    pub fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: SoftQp) -> Result<(), SoftError> {
        if qp.state() != QpState::ReadyToSend {
            return Err(SoftError::NotReady {
                qp: qp.num(),
                state: qp.state(),
            });
        }
        self.0.staged.stage(endpoint, epoch, qp);
        Ok(())
    }

    pub(crate) fn take_staged(
        &self,
        endpoint: EndpointId,
        epoch: Epoch,
    ) -> Result<SoftQp, SoftError> {
        self.0
            .staged
            .take(endpoint, epoch)
            .map_err(|staged| SoftError::NotStaged {
                endpoint,
                epoch,
                staged: staged.map_or(String::new(), |other| {
                    format!(" (one is staged at {other})")
                }),
            })
    }

    /// A fabric for this device's poller.
    pub fn fabric(&self) -> SoftFabric {
        SoftFabric::new(self.clone())
    }

    pub(crate) fn table(&self) -> &RegionTable {
        &self.0.table
    }

    pub(crate) fn pid(&self) -> u32 {
        self.0.pid
    }
}
