//! [`TcpError`]: the ways opening a TCP device, dialing a target or decoding a peer's
//! attachment fail.

use std::io;
use std::net::SocketAddr;

use crate::{EndpointId, Epoch};

/// Why a TCP-fabric operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpError {
    /// The data port could not be opened.
    #[error("cannot listen for TCP fabric connections on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The target's data port could not be reached.
    #[error("cannot connect to the TCP fabric port {addr}: {source}")]
    Connect {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A peer's attachment bytes are malformed.
    #[error("malformed TCP fabric attachment: {0}")]
    Attachment(String),
    /// No connected queue pair was staged for the endpoint at that epoch.
    #[error("no connected TCP queue pair is staged for endpoint {endpoint:?} at {epoch}")]
    NotStaged {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
    },
}
