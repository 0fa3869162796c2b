//! Soft queue pairs: verbs' state machine, and what a queue pair knows of its peer once it is
//! ready to receive.
//!
//! A [`SoftQp`] is created in RESET by [`SoftDevice::create_qp`](super::SoftDevice::create_qp)
//! and walks RESET → INIT → RTR → RTS; any state may go to ERR. RTR needs the peer's side of
//! the connection ([`Peer`]), which only the handshake ([`super::handshake`]) can build,
//! because it comes with the peer's shared memory. An RTS queue pair is handed to a
//! [`SoftFabric`](super::SoftFabric), which executes its work requests.
//!
//! The soft fabric's equivalents of verbs' addressing: LID 0; GID = the device's
//! incarnation (8 bytes) then the process id (4 bytes); a random first PSN; path MTU 4096.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::SoftError;
use super::inbox::{InboxWriter, RecvQueue};
use super::regions::{RegionTable, Registration, RemoteTable};
use super::sys::{self, Mapping};
use crate::fabric::{Access, QpInfo, QpNum, QpState};

/// The soft fabric's path MTU. Nothing is packetised, so it only travels in [`QpInfo`].
pub(crate) const SOFT_PATH_MTU: u32 = 4096;

/// The soft GID of a device: its incarnation, then the process id.
pub(crate) fn soft_gid(incarnation: u64, pid: u32) -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[..8].copy_from_slice(&incarnation.to_le_bytes());
    gid[8..12].copy_from_slice(&pid.to_le_bytes());
    gid
}

/// The peer's side of a connected queue pair, as the handshake established it.
#[derive(Debug)]
pub(crate) struct Peer {
    /// What the peer sent.
    pub(crate) info: QpInfo,
    /// What the peer's queue pair lets us do (its `qp_access_flags`).
    pub(crate) access: Access,
    /// The peer process, as the kernel named it on the handshake socket.
    pub(crate) pid: u32,
    /// Whether the peer is this very process (copies are plain memory copies).
    pub(crate) same_process: bool,
    /// Readable once the peer process exits; `None` for this process.
    pub(crate) pidfd: Option<OwnedFd>,
    /// The peer's live region table, read-only.
    pub(crate) table: RemoteTable,
    /// The peer queue pair's inbox, for immediates.
    pub(crate) inbox: InboxWriter,
    /// The peer's engine-allocated regions we mapped, by rkey; `None` for one that cannot be
    /// mapped (bytes go through `process_vm_writev`).
    pub(crate) mapped: HashMap<u32, Option<Mapping>>,
}

impl Peer {
    /// Whether the peer process is known to have exited.
    pub(crate) fn has_exited(&self) -> bool {
        self.pidfd
            .as_ref()
            .is_some_and(|fd| sys::has_exited(fd.as_fd()))
    }

    /// Our mapping of the peer's region `rkey` (live as `region`), mapping it on first use.
    /// `None` when the region is not engine-allocated or cannot be mapped.
    pub(crate) fn mapping(&mut self, rkey: u32, region: &Registration) -> Option<&Mapping> {
        let memfd = region.memfd?;
        let pidfd = self.pidfd.as_ref()?;
        if !self.mapped.contains_key(&rkey) {
            let mapped = sys::pidfd_getfd(pidfd.as_fd(), memfd)
                .ok()
                .filter(|fd| {
                    sys::sealed_len(fd.as_fd())
                        .ok()
                        .flatten()
                        .is_some_and(|len| len >= region.len)
                })
                .and_then(|fd| Mapping::new(fd.as_fd(), region.len as usize, true).ok());
            // The owner closes the descriptor only after deregistering the key. The key is
            // still live after we fetched the descriptor, so we fetched the region's memfd,
            // not a later file that reused its number.
            if self.table.lookup(rkey).as_ref() != Some(region) {
                return None;
            }
            self.mapped.insert(rkey, mapped);
        }
        self.mapped.get(&rkey).and_then(Option::as_ref)
    }

    /// Drops mappings of regions that are no longer registered.
    pub(crate) fn forget_stale_mappings(&mut self) {
        let table = &self.table;
        self.mapped.retain(|rkey, _| table.lookup(*rkey).is_some());
    }
}

/// A reliable-connected queue pair of a [`SoftDevice`](super::SoftDevice).
#[derive(Debug)]
pub struct SoftQp {
    num: QpNum,
    info: QpInfo,
    state: QpState,
    /// What the peer may do through this queue pair.
    access: Access,
    /// The device's own registrations, for lkey checks.
    pub(crate) table: Arc<RegionTable>,
    /// Our inbox's descriptor, sent to the peer at handshake.
    inbox_fd: OwnedFd,
    recv: Option<RecvQueue>,
    pub(crate) peer: Option<Peer>,
}

impl SoftQp {
    pub(crate) fn new(
        num: QpNum,
        info: QpInfo,
        access: Access,
        table: Arc<RegionTable>,
    ) -> Result<Self, SoftError> {
        let recv = RecvQueue::new().map_err(|source| SoftError::Io {
            what: "create a queue pair's inbox",
            source,
        })?;
        let inbox_fd = recv
            .fd()
            .try_clone_to_owned()
            .map_err(|source| SoftError::Io {
                what: "duplicate a queue pair's inbox descriptor",
                source,
            })?;
        Ok(Self {
            num,
            info,
            state: QpState::Reset,
            access,
            table,
            inbox_fd,
            recv: Some(recv),
            peer: None,
        })
    }

    /// Its number.
    pub fn num(&self) -> QpNum {
        self.num
    }

    /// What this side tells the peer.
    pub fn info(&self) -> QpInfo {
        self.info
    }

    /// Its state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// What the peer may do through it.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The peer's process id, once connected.
    pub fn peer_pid(&self) -> Option<u32> {
        self.peer.as_ref().map(|peer| peer.pid)
    }

    /// What the peer sent at handshake, once connected.
    pub fn peer_info(&self) -> Option<QpInfo> {
        self.peer.as_ref().map(|peer| peer.info)
    }

    /// Hands out the receive side (WRITE_WITH_IMM immediates sent by the peer). Once only.
    pub fn take_recv_queue(&mut self) -> Option<RecvQueue> {
        self.recv.take()
    }

    pub(crate) fn inbox_fd(&self) -> &OwnedFd {
        &self.inbox_fd
    }

    fn transition(&mut self, from: &[QpState], to: QpState) -> Result<(), SoftError> {
        if !from.contains(&self.state) {
            return Err(SoftError::InvalidTransition {
                qp: self.num,
                from: self.state,
                to,
            });
        }
        self.state = to;
        Ok(())
    }

    /// RESET → INIT.
    ///
    /// # Errors
    /// [`SoftError::InvalidTransition`] from any other state.
    pub fn modify_to_init(&mut self) -> Result<(), SoftError> {
        self.transition(&[QpState::Reset], QpState::Init)
    }

    /// INIT → RTR, attaching the peer.
    pub(crate) fn modify_to_rtr(&mut self, peer: Peer) -> Result<(), SoftError> {
        self.transition(&[QpState::Init], QpState::ReadyToReceive)?;
        self.peer = Some(peer);
        Ok(())
    }

    /// RTR → RTS.
    ///
    /// # Errors
    /// [`SoftError::InvalidTransition`] from any other state.
    pub fn modify_to_rts(&mut self) -> Result<(), SoftError> {
        self.transition(&[QpState::ReadyToReceive], QpState::ReadyToSend)
    }

    /// Any state → ERR.
    pub fn modify_to_error(&mut self) {
        self.state = QpState::Error;
    }

    /// Any state → RESET: forgets the peer; the queue pair can be connected again. Its
    /// inbox stays (immediates that arrived before the reset are still there to read).
    pub fn reset(&mut self) {
        self.state = QpState::Reset;
        self.peer = None;
    }
}
