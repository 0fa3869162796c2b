//! Why a control-plane call failed, and how long a caller waits for the control thread.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// Why a control-plane call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The control thread could not start.
    #[error("cannot start the control thread: {0}")]
    Thread(#[source] io::Error),
    /// The control thread has stopped.
    #[error("the control plane has stopped")]
    Stopped,
    /// The control thread did not answer within [`REPLY_WAIT`] (it is stuck).
    #[error("the control plane did not answer within {REPLY_WAIT:?}")]
    Unresponsive,
    /// No such local rail.
    #[error("rail {rail} does not exist (this process has {rails})")]
    UnknownRail {
        /// The rail asked for.
        rail: u16,
        /// How many there are.
        rails: usize,
    },
    /// A notification larger than one frame carries.
    #[error("a notification of {len} bytes is larger than the {max} bytes one can carry")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The most allowed ([`crate::wire::MAX_NOTIFY`]).
        max: usize,
    },
    /// Encrypted control frames were asked for without a cluster secret to key them.
    #[error(
        "encrypting control frames needs a cluster secret (`railyard secret new FILE`, then --secret-file FILE)"
    )]
    EncryptionWithoutSecret,
    /// The peer could not be reached or did not answer in time.
    #[error("cannot reach the peer at {addr}: {reason}")]
    Unreachable {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
}

/// Longest a request that needs the control thread's answer waits for it (it answers within
/// a tick unless stuck).
pub const REPLY_WAIT: Duration = Duration::from_secs(2);
