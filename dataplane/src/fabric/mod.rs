//! The fabric interface: a verbs-like model of an RDMA NIC as one poller sees it.
//!
//! A fabric gives the poller reliable-connected queue pairs to endpoints, takes lists of work
//! requests (WRITE, READ, WRITE_WITH_IMM) and reports work completions with verbs' statuses.
//! Work-request ids encode a poller slot and its generation ([`WrId`]) so that a completion
//! for a slot that has moved on (a flush from a retired queue pair) is recognised and
//! ignored. A fabric value is owned by exactly one poller thread.
//!
//! Here: [`null::NullFabric`] (completes everything at once, for benchmarks) and
//! [`scripted::ScriptedFabric`] (completes chosen requests with chosen statuses, for tests).

pub mod null;
pub mod scripted;

use crate::{EndpointId, Epoch};

/// A queue pair number, unique within one fabric instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpNum(pub u32);

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
}
