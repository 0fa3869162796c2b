//! The model every fabric shares, whatever moves the bytes: queue-pair numbers, work
//! requests and completions with verbs' statuses, memory registrations with access flags,
//! queue-pair states and connection info, asynchronous events, and the [`Fabric`] trait a
//! poller drives.

use crate::{EndpointId, Epoch};

/// A queue pair number, unique within one fabric instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpNum(pub u32);

/// Queue-pair numbers are 24 bits, as in verbs, split in two halves so that two fabrics
/// behind one poller ([`host`](crate::fabric::host)) never hand out the same number: numbers of the high half
/// have this bit set.
pub const QP_HIGH_BIT: u32 = 1 << 23;

/// Queue-pair numbers of TCP queue pairs have this bit set: the TCP fabric numbers its
/// queue pairs in the high half ([`QP_HIGH_BIT`]), the soft fabric in the low one.
pub const TCP_QP_BIT: u32 = QP_HIGH_BIT;

impl QpNum {
    /// The low half's number for counter value `n` (wrapping within the half).
    pub fn low(n: u32) -> Self {
        Self(n & (QP_HIGH_BIT - 1))
    }

    /// The high half's number for counter value `n` (wrapping within the half).
    pub fn high(n: u32) -> Self {
        Self(QP_HIGH_BIT | (n & (QP_HIGH_BIT - 1)))
    }

    /// Whether it is in the high half.
    pub fn is_high(self) -> bool {
        self.0 & QP_HIGH_BIT != 0
    }
}

/// The operation of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Write the local range into the remote range.
    Write,
    /// Read the remote range into the local range.
    Read,
    /// Write, then deliver the immediate value to the target.
    WriteWithImm,
}

/// A work-request id: the poller's in-flight slot and that slot's generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WrId(pub u64);

impl WrId {
    /// Packs a slot and its generation.
    pub fn new(slot: u32, generation: u32) -> Self {
        Self((u64::from(generation) << 32) | u64::from(slot))
    }

    /// The in-flight slot.
    pub fn slot(self) -> u32 {
        self.0 as u32
    }

    /// The slot's generation when the request was posted.
    pub fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// One work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned in the completion.
    pub wr_id: WrId,
    /// What to do.
    pub opcode: Opcode,
    /// Local start address.
    pub local_addr: u64,
    /// Local registration key.
    pub lkey: u32,
    /// Remote start address.
    pub remote_addr: u64,
    /// Remote registration key.
    pub rkey: u32,
    /// Bytes.
    pub len: u32,
    /// Immediate data (WRITE_WITH_IMM).
    pub imm: u32,
    /// Whether a successful completion is reported (errors always are).
    pub signaled: bool,
    /// The endpoint epoch the request was prepared for. Fabrics do not act on it; it lets an
    /// observer at the fabric boundary check, independently of the poller, that nothing is
    /// ever posted on a queue pair newer than what it was prepared for.
    pub epoch: Epoch,
}

/// Completion statuses, as verbs names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// IBV_WC_SUCCESS.
    Success,
    /// IBV_WC_LOC_LEN_ERR.
    LocLenErr,
    /// IBV_WC_LOC_PROT_ERR.
    LocProtErr,
    /// IBV_WC_REM_ACCESS_ERR.
    RemAccessErr,
    /// IBV_WC_REM_INV_REQ_ERR.
    RemInvReqErr,
    /// IBV_WC_RETRY_EXC_ERR.
    RetryExcErr,
    /// IBV_WC_WR_FLUSH_ERR.
    WrFlushErr,
}

impl WcStatus {
    /// Errors that name one bad work request (charged to the slice, not the peer).
    pub fn is_work_request_error(self) -> bool {
        matches!(
            self,
            Self::LocLenErr | Self::LocProtErr | Self::RemAccessErr | Self::RemInvReqErr
        )
    }
}

/// One work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id of the completed request.
    pub wr_id: WrId,
    /// The queue pair it was posted on.
    pub qp: QpNum,
    /// How it ended.
    pub status: WcStatus,
    /// Its operation.
    pub opcode: Opcode,
    /// Bytes moved (successful completions).
    pub byte_len: u32,
    /// Immediate data, for WRITE_WITH_IMM.
    pub imm: Option<u32>,
}

/// What a memory registration allows, as verbs' `IBV_ACCESS_*` flags. Local read is always
/// allowed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Access(u32);

impl Access {
    /// Nothing beyond local read.
    pub const NONE: Self = Self(0);
    /// The local side may write it (the target of a READ).
    pub const LOCAL_WRITE: Self = Self(1);
    /// Peers may WRITE into it.
    pub const REMOTE_WRITE: Self = Self(2);
    /// Peers may READ from it.
    pub const REMOTE_READ: Self = Self(4);
    /// Everything.
    pub const ALL: Self = Self(7);

    /// Whether every flag of `other` is set here.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits, for wire formats.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw bits; unknown bits are dropped.
    pub const fn from_bits_truncate(bits: u32) -> Self {
        Self(bits & Self::ALL.0)
    }
}

impl std::ops::BitOr for Access {
    type Output = Self;

    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

/// A registered memory region: what a work request names with its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Key for local use (the local side of a work request).
    pub lkey: u32,
    /// Key peers use to name it.
    pub rkey: u32,
    /// What it allows.
    pub access: Access,
}

impl MemoryRegion {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// A queue pair's state, as verbs' `ibv_qp_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created; nothing can be posted.
    Reset,
    /// Local attributes set; receives could be posted.
    Init,
    /// Ready to receive: the remote side is known.
    ReadyToReceive,
    /// Ready to send: work requests execute.
    ReadyToSend,
    /// Failed: every outstanding and later work request completes with WR_FLUSH_ERR.
    Error,
}

/// Path MTUs verbs allows.
pub const PATH_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

/// What one side of a reliable connection tells the other so the pair can reach RTR: verbs'
/// QP number, LID, GID, first packet sequence number and path MTU. A software fabric fills
/// its own equivalents and says which in its docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpInfo {
    /// Queue pair number.
    pub qp_num: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID.
    pub gid: [u8; 16],
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Path MTU in bytes, one of [`PATH_MTUS`].
    pub path_mtu: u32,
}

impl QpInfo {
    /// Bytes of [`Self::encode`].
    pub const WIRE_LEN: usize = 32;

    /// Little-endian wire form.
    pub fn encode(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0u8; Self::WIRE_LEN];
        out[0..4].copy_from_slice(&self.qp_num.to_le_bytes());
        out[4..6].copy_from_slice(&self.lid.to_le_bytes());
        out[8..24].copy_from_slice(&self.gid);
        out[24..28].copy_from_slice(&self.psn.to_le_bytes());
        out[28..32].copy_from_slice(&self.path_mtu.to_le_bytes());
        out
    }

    /// Reads the wire form, checking every field.
    ///
    /// # Errors
    /// [`QpInfoError`] names the field that is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, QpInfoError> {
        if bytes.len() != Self::WIRE_LEN {
            return Err(QpInfoError::Length { len: bytes.len() });
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[8..24]);
        let info = Self {
            qp_num: u32_at(0),
            lid: u16::from_le_bytes([bytes[4], bytes[5]]),
            gid,
            psn: u32_at(24),
            path_mtu: u32_at(28),
        };
        if bytes[6..8] != [0, 0] {
            return Err(QpInfoError::Reserved);
        }
        if info.qp_num == 0 || info.qp_num >= 1 << 24 {
            return Err(QpInfoError::QpNum {
                qp_num: info.qp_num,
            });
        }
        if info.psn >= 1 << 24 {
            return Err(QpInfoError::Psn { psn: info.psn });
        }
        if !PATH_MTUS.contains(&info.path_mtu) {
            return Err(QpInfoError::PathMtu {
                path_mtu: info.path_mtu,
            });
        }
        Ok(info)
    }
}

/// A malformed [`QpInfo`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QpInfoError {
    /// Wrong size.
    #[error("queue pair info is {len} bytes, expected {}", QpInfo::WIRE_LEN)]
    Length {
        /// Bytes received.
        len: usize,
    },
    /// The reserved bytes after the LID are not zero.
    #[error("queue pair info has non-zero reserved bytes")]
    Reserved,
    /// QP number 0 or wider than 24 bits.
    #[error("queue pair number {qp_num} is not a valid 24-bit QP number")]
    QpNum {
        /// The number received.
        qp_num: u32,
    },
    /// PSN wider than 24 bits.
    #[error("packet sequence number {psn:#x} is wider than 24 bits")]
    Psn {
        /// The PSN received.
        psn: u32,
    },
    /// Not a verbs MTU.
    #[error("path MTU {path_mtu} is not one of 256, 512, 1024, 2048, 4096")]
    PathMtu {
        /// The MTU received.
        path_mtu: u32,
    },
}

/// What a fabric reports outside the completion queue (verbs' asynchronous events).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// IBV_EVENT_QP_FATAL: the queue pair went to ERR on its own; its outstanding work
    /// requests complete as flushed.
    QpFatal {
        /// The queue pair.
        qp: QpNum,
    },
    /// The rail cannot carry work (its port went down, its completion queue or device
    /// failed): its queue pairs are reported fatal as well, and new ones are refused.
    RailDown {
        /// Why, in words.
        reason: String,
    },
    /// The rail's port is back: new queue pairs may be made.
    RailUp,
}

impl WorkCompletion {
    /// The completion of `request` on `qp` with `status`: a successful one carries the
    /// request's length, a failed one none.
    pub fn of(request: &WorkRequest, qp: QpNum, status: WcStatus) -> Self {
        Self::ended(request.wr_id, request.opcode, request.len, qp, status)
    }

    /// The completion of request `wr_id` (`opcode`, `len` bytes) on `qp` with `status`.
    pub fn ended(wr_id: WrId, opcode: Opcode, len: u32, qp: QpNum, status: WcStatus) -> Self {
        Self {
            wr_id,
            qp,
            status,
            opcode,
            byte_len: if status == WcStatus::Success { len } else { 0 },
            imm: None,
        }
    }
}

/// Why a fabric operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The queue pair does not exist (never created, or destroyed).
    #[error("queue pair {qp:?} does not exist")]
    UnknownQp {
        /// The queue pair named.
        qp: QpNum,
    },
    /// The queue pair is in the error state; nothing can be posted.
    #[error("queue pair {qp:?} is in the error state")]
    QpInError {
        /// The queue pair named.
        qp: QpNum,
    },
    /// The send queue has no room for the list.
    #[error("send queue of {qp:?} is full")]
    SendQueueFull {
        /// The queue pair named.
        qp: QpNum,
    },
    /// Connecting to the endpoint failed.
    #[error("cannot connect to endpoint {endpoint:?} at {epoch}: {reason}")]
    Connect {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
        /// Why.
        reason: String,
    },
}

/// How much work a fabric holds at once. The poller never posts beyond these (credits):
/// past them, slices wait in their endpoint's backlog until completions free room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FabricLimits {
    /// Work requests one queue pair holds posted and not yet completed (verbs'
    /// `max_send_wr`).
    pub send_queue: usize,
    /// Completions the rail's completion queue holds unpolled (verbs' CQ depth). Every
    /// posted request completes into it exactly once — successfully, in error, or flushed
    /// by a retire — so the poller keeps its requests in flight, flushes to come included,
    /// at or below it.
    pub completion_queue: usize,
}

impl FabricLimits {
    /// No limit: a fabric whose queues grow as needed.
    pub const UNLIMITED: Self = Self {
        send_queue: usize::MAX,
        completion_queue: usize::MAX,
    };
}

/// A post that stopped part-way, as `ibv_post_send` reports through `bad_wr`.
#[derive(Debug)]
pub struct PostError {
    /// Requests of the list accepted before the failing one.
    pub posted: usize,
    /// Why the rest was refused.
    pub error: FabricError,
}

/// A verbs-like NIC as one poller drives it. Implementations must produce exactly one
/// completion for every signaled request and for every request that fails or is flushed.
pub trait Fabric: Send {
    /// Creates and connects a queue pair to `endpoint` for `epoch`.
    ///
    /// # Errors
    /// [`FabricError::Connect`] when the endpoint cannot be reached.
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError>;

    /// Posts a list of work requests on `qp` (one doorbell).
    ///
    /// # Errors
    /// [`PostError`] says how many were accepted and why the rest were not.
    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError>;

    /// Appends up to `max` completions to `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize;

    /// Moves `qp` to the error state: every outstanding request completes with
    /// [`WcStatus::WrFlushErr`], then the queue pair is destroyed.
    fn retire(&mut self, qp: QpNum);

    /// Tears down `qp`, retired already, without waiting for its flushes any longer: what
    /// the poller does when they miss its flush grace, before it resolves the requests.
    /// Returns true when, from the moment it returns, the fabric reads and writes no buffer
    /// of any request posted on `qp` and reports none of them (the queue pair is destroyed,
    /// its connection closed, its delayed work dropped); false when it cannot promise that
    /// (the requests are then resolved all the same, and the rail's documentation says what
    /// may still move).
    fn abandon(&mut self, qp: QpNum) -> bool;

    /// Work the fabric does for its peers in this poller — serving their requests to this
    /// rail's memory, for fabrics whose target side runs here (TCP) — and its own progress.
    /// Called every round, busy or not; true when anything moved. Others keep the default.
    fn serve(&mut self) -> bool {
        false
    }

    /// Whether peers depend on this poller to serve them (open target connections): an
    /// idle poller then yields instead of parking, so that their requests are not left
    /// waiting for a wake-up nobody sends.
    fn serving(&self) -> bool {
        false
    }

    /// The next asynchronous event, if any. Fabrics without them keep the default.
    fn poll_event(&mut self) -> Option<AsyncEvent> {
        None
    }

    /// How much work it holds at once ([`FabricLimits`]); read once when the poller starts.
    /// Fabrics whose queues grow as needed keep the default; a wrapper forwards its
    /// inner fabric's.
    fn limits(&self) -> FabricLimits {
        FabricLimits::UNLIMITED
    }
}
