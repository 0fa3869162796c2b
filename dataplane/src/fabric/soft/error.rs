//! [`SoftError`]: the ways a soft-fabric operation fails, as the control plane sees them.

use std::io;

use super::regions::RegionError;
use crate::fabric::{QpNum, QpState};
use crate::{EndpointId, Epoch};

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
