//! Soft queue pairs: verbs' state machine, and what a queue pair knows of its peer once it is
//! ready to receive.
//!
//! A [`SoftQp`] is created in RESET by [`SoftDevice::create_qp`](super::SoftDevice::create_qp)
//! and walks RESET → INIT → RTR → RTS; any state may go to ERR. RTR needs the peer's side of
//! the connection ([`Peer`]): its shared memory, which arrives either as descriptors over
//! the Unix-socket handshake ([`super::handshake`]) or as descriptor numbers in a
//! [`SoftAttachment`] carried over any channel ([`SoftQp::connect`]). An RTS queue pair is
//! handed to a [`SoftFabric`](super::SoftFabric), which executes its work requests.
//!
//! The soft fabric's equivalents of verbs' addressing: LID 0; GID = the device's
//! incarnation (8 bytes) then the process id (4 bytes); a random first PSN; path MTU 4096.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::error::SoftError;
use super::fence::Guests;
use super::inbox::{InboxWatch, InboxWriter, RecvQueue};
use super::regions::{PROBE_WORD, RegionTable, Registration, RemoteTable};
use super::sys::{self, Direction, Mapping};
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

/// What the peer says about itself at handshake, however it travelled.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PeerFacts {
    pub(crate) info: QpInfo,
    pub(crate) access: Access,
    pub(crate) pid: u32,
    pub(crate) incarnation: u64,
    pub(crate) probe_addr: u64,
}

impl Peer {
    /// Maps the peer's table and inbox from its descriptors, checks they are the peer's
    /// (owner pid and incarnation in the table header), and proves we can reach its memory.
    pub(crate) fn attach(
        facts: &PeerFacts,
        table_fd: OwnedFd,
        inbox_fd: OwnedFd,
        own_pid: u32,
    ) -> Result<Self, SoftError> {
        let failed = |reason: String| SoftError::Handshake {
            peer: format!("pid {}", facts.pid),
            reason,
        };
        let table = RemoteTable::map(table_fd).map_err(|e| failed(e.to_string()))?;
        if table.owner_pid != facts.pid || table.incarnation != facts.incarnation {
            return Err(failed(
                "the region table does not belong to the peer that named it".into(),
            ));
        }
        let inbox = InboxWriter::map(inbox_fd).map_err(|e| failed(e.to_string()))?;
        let same_process = facts.pid == own_pid;
        let pidfd = if same_process {
            None
        } else {
            probe(facts.pid, facts.probe_addr)?;
            Some(
                sys::pidfd_open(facts.pid as libc::pid_t).map_err(|source| SoftError::Io {
                    what: "open a pidfd for the peer",
                    source,
                })?,
            )
        };
        Ok(Self {
            info: facts.info,
            access: facts.access,
            pid: facts.pid,
            same_process,
            pidfd,
            table,
            inbox,
            mapped: HashMap::new(),
        })
    }

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

/// Reads the peer's table magic at `addr` in its memory: proves we may access that process
/// and that it is the one whose table we mapped.
fn probe(pid: u32, addr: u64) -> Result<(), SoftError> {
    let mut word = [0u8; 8];
    sys::process_vm(
        Direction::Read,
        pid as libc::pid_t,
        word.as_mut_ptr() as u64,
        addr,
        word.len(),
    )
    .map_err(|source| SoftError::ProbeRefused { pid, source })?;
    if u64::from_le_bytes(word) != PROBE_WORD {
        return Err(SoftError::ProbeRefused {
            pid,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the probe address does not hold the peer's region table",
            ),
        });
    }
    Ok(())
}

/// What a soft queue pair tells its peer besides [`QpInfo`] so that the pair can connect
/// over any channel (the control plane's TCP handshake carries it as opaque bytes): its
/// process, its device's incarnation, and the descriptor numbers — in its own process — of
/// its region table and inbox, which the peer fetches with `pidfd_getfd` (the permission
/// `process_vm_writev` needs anyway).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftAttachment {
    /// The process.
    pub pid: u32,
    /// The device's incarnation (also in the region table's header).
    pub incarnation: u64,
    /// Descriptor number of the region table.
    pub table_fd: i32,
    /// Descriptor number of the queue pair's inbox.
    pub inbox_fd: i32,
    /// What the queue pair lets the peer do.
    pub access: Access,
    /// Address of the region table's magic, for the access probe.
    pub probe_addr: u64,
}

impl SoftAttachment {
    /// Bytes of [`Self::encode`].
    pub const WIRE_LEN: usize = 36;

    /// Little-endian wire form.
    pub fn encode(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0u8; Self::WIRE_LEN];
        out[0..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..12].copy_from_slice(&self.incarnation.to_le_bytes());
        out[12..16].copy_from_slice(&self.table_fd.to_le_bytes());
        out[16..20].copy_from_slice(&self.inbox_fd.to_le_bytes());
        out[20..24].copy_from_slice(&self.access.bits().to_le_bytes());
        out[24..32].copy_from_slice(&self.probe_addr.to_le_bytes());
        out
    }

    /// Reads the wire form.
    ///
    /// # Errors
    /// A message naming what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() != Self::WIRE_LEN {
            return Err(format!(
                "a soft-fabric attachment is {} bytes, got {}",
                Self::WIRE_LEN,
                bytes.len()
            ));
        }
        let word4 = |at: usize| [bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]];
        let mut word8 = [0u8; 8];
        word8.copy_from_slice(&bytes[4..12]);
        let incarnation = u64::from_le_bytes(word8);
        word8.copy_from_slice(&bytes[24..32]);
        let attachment = Self {
            pid: u32::from_le_bytes(word4(0)),
            incarnation,
            table_fd: i32::from_le_bytes(word4(12)),
            inbox_fd: i32::from_le_bytes(word4(16)),
            access: Access::from_bits_truncate(u32::from_le_bytes(word4(20))),
            probe_addr: u64::from_le_bytes(word8),
        };
        if attachment.pid == 0 || attachment.table_fd < 0 || attachment.inbox_fd < 0 {
            return Err(
                "a soft-fabric attachment names no process or a negative descriptor".into(),
            );
        }
        Ok(attachment)
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
    /// Our inbox's access fence, for the device's guests and for revoking on drop.
    watch: InboxWatch,
    guests: Arc<Guests>,
    pub(crate) peer: Option<Peer>,
}

impl Drop for SoftQp {
    /// A queue pair that goes away is out of service for its peer too: the peer's next
    /// check-and-copy through it fails, however long the peer keeps its mappings.
    fn drop(&mut self) {
        self.watch.revoke();
    }
}

impl SoftQp {
    pub(crate) fn new(
        num: QpNum,
        info: QpInfo,
        access: Access,
        table: Arc<RegionTable>,
        guests: Arc<Guests>,
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
        let watch = recv.watch();
        Ok(Self {
            num,
            info,
            state: QpState::Reset,
            access,
            table,
            inbox_fd,
            recv: Some(recv),
            watch,
            guests,
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

    /// Appends the immediates of the WRITE_WITH_IMM requests that arrived since the last
    /// call to `out`, oldest first (none once the receive side was handed out).
    pub fn take_immediates(&mut self, out: &mut Vec<u32>) {
        let Some(recv) = self.recv.as_mut() else {
            return;
        };
        let mut arrived = Vec::new();
        while recv.poll(&mut arrived, 256) > 0 {
            out.extend(arrived.drain(..).map(|completion| completion.imm));
        }
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

    /// INIT → RTR, attaching the peer, who may copy through it from now on (a guest of
    /// the device, see [`super::fence`]).
    pub(crate) fn modify_to_rtr(&mut self, peer: Peer) -> Result<(), SoftError> {
        self.transition(&[QpState::Init], QpState::ReadyToReceive)?;
        let pidfd = match &peer.pidfd {
            Some(fd) => Some(fd.try_clone().map_err(|source| SoftError::Io {
                what: "duplicate the peer's pidfd",
                source,
            })?),
            None => None,
        };
        self.guests.admit(self.watch.clone(), pidfd);
        self.peer = Some(peer);
        Ok(())
    }

    /// What the peer needs besides [`Self::info`] to connect to this queue pair.
    pub fn attachment(&self) -> SoftAttachment {
        use std::os::fd::AsRawFd;
        SoftAttachment {
            pid: self.table.owner_pid,
            incarnation: self.table.incarnation,
            table_fd: self.table.fd().as_raw_fd(),
            inbox_fd: self.inbox_fd.as_raw_fd(),
            access: self.access,
            probe_addr: self.table.probe_addr(),
        }
    }

    /// INIT → RTR → RTS with the peer's `remote` info and `attachment`, fetching its shared
    /// memory by descriptor number (`pidfd_getfd`). The path MTU is the smaller of the two
    /// sides'.
    ///
    /// # Errors
    /// [`SoftError::InvalidTransition`] unless in INIT; [`SoftError::Handshake`] when the
    /// descriptors are not the peer's table and inbox; [`SoftError::ProbeRefused`] or
    /// [`SoftError::Io`] when the peer process cannot be reached.
    pub fn connect(
        &mut self,
        remote: &QpInfo,
        attachment: &SoftAttachment,
    ) -> Result<(), SoftError> {
        if self.state != QpState::Init {
            return Err(SoftError::InvalidTransition {
                qp: self.num,
                from: self.state,
                to: QpState::ReadyToReceive,
            });
        }
        let io = |what| move |source| SoftError::Io { what, source };
        let pidfd = sys::pidfd_open(attachment.pid as libc::pid_t)
            .map_err(io("open a pidfd for the peer"))?;
        let table_fd = sys::pidfd_getfd(pidfd.as_fd(), attachment.table_fd)
            .map_err(io("fetch the peer's region table"))?;
        let inbox_fd = sys::pidfd_getfd(pidfd.as_fd(), attachment.inbox_fd)
            .map_err(io("fetch the peer's inbox"))?;
        let facts = PeerFacts {
            info: QpInfo {
                path_mtu: remote.path_mtu.min(self.info.path_mtu),
                ..*remote
            },
            access: attachment.access,
            pid: attachment.pid,
            incarnation: attachment.incarnation,
            probe_addr: attachment.probe_addr,
        };
        let peer = Peer::attach(&facts, table_fd, inbox_fd, self.table.owner_pid)?;
        self.modify_to_rtr(peer)?;
        self.modify_to_rts()
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
