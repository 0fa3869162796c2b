//! [`SoftDevice`]: one rail's soft device — what it registers, which queue pairs it creates
//! and which connected ones it stages for its poller.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::config::SoftConfig;
use super::error::SoftError;
use super::fence::Guests;
use super::qp::{self, SoftQp};
use super::regions::RegionTable;
use crate::fabric::faults::FaultHandle;
use crate::fabric::staging::Staging;
use crate::fabric::{Access, MemoryRegion, QpInfo, QpNum, QpState};
use crate::{EndpointId, Epoch};

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
    guests: Arc<Guests>,
    faults: FaultHandle,
}

/// One rail's soft device: context, protection domain and region table. Cheap to clone;
/// `Send + Sync`: the control plane registers memory and connects queue pairs from any
/// thread while the rail's poller drives the [`SoftFabric`](super::SoftFabric).
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
    /// [`RegionError::BadRange`](super::RegionError::BadRange) for an empty, null or
    /// wrapping range; [`RegionError::TableFull`](super::RegionError::TableFull) past
    /// [`REGION_CAPACITY`](super::REGION_CAPACITY) registrations.
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
    /// [`RegionError::UnknownKey`](super::RegionError::UnknownKey) when it is not registered
    /// (any more).
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
        // The low half of the number space: the high half is another fabric's.
        let num = QpNum::low(self.0.next_qp.fetch_add(1, Ordering::Relaxed)).0;
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

    pub(crate) fn table(&self) -> &RegionTable {
        &self.0.table
    }

    pub(crate) fn pid(&self) -> u32 {
        self.0.pid
    }
}
