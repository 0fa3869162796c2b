//! The TCP fabric: the soft fabric's one-sided semantics between hosts without RDMA.
//!
//! A [`TcpDevice`] belongs to one rail. It serves the registrations of that rail's
//! [`SoftDevice`](crate::fabric::soft::SoftDevice) (same keys, same live region table, same
//! fault plan), so one registration is reachable over either fabric, and it listens for data
//! connections on one port.
//!
//! # Queue pairs
//! A queue pair is one TCP connection. The initiator's side ([`TcpDevice::create_qp`],
//! [`TcpDevice::connect`]) starts a non-blocking connection to the target's data port (the
//! control thread never waits on a peer) and the control plane stages it for the poller, as
//! with the other fabrics; the poller's first bytes on it are a hello naming the token the
//! target handed out at ConnectQp ([`TcpDevice::create_target`]). The target's side is served by the
//! target rail's own poller ([`TcpFabric`], through
//! [`Fabric::serve`](crate::fabric::Fabric::serve)), never by a thread of its own; the
//! control plane keeps a [`TcpTarget`] handle, which takes the WRITE_WITH_IMM immediates
//! and closes the connection when dropped or [closed](TcpTarget::close) (which also returns
//! the poller's acknowledgment).
//!
//! # Work requests
//! A WRITE is a header (rkey, remote address, length, work-request id) then the payload,
//! sent straight from the registered source; the target checks the header against its live
//! region table and receives the payload straight into the region — no intermediate copy in
//! user space on either side. A READ is a header answered by a reply header and the data,
//! sent straight from the region and received straight into the local one. Every request is
//! answered, in order; a WRITE completes at the initiator only once the target has applied
//! it, so a completed WRITE is visible to any later READ.
//!
//! # Statuses
//! As the other fabrics: LOC_PROT_ERR / LOC_LEN_ERR from the initiator's own checks,
//! REM_ACCESS_ERR from the target's, RETRY_EXC_ERR when the connection breaks or the peer
//! sends nothing for [`TcpConfig::peer_timeout`] while work is outstanding, WR_FLUSH_ERR for
//! everything outstanding or posted after an error. A connection that breaks with nothing
//! outstanding raises [`AsyncEvent::QpFatal`](crate::fabric::AsyncEvent::QpFatal) so the
//! control plane reconnects before the next transfer needs it.
//!
//! # Nothing moves after it is reported
//! - A target that answers an error reads nothing more from that connection — no header, no
//!   payload: it sends the replies it owes (the error last) and closes. What the initiator
//!   will see flushed is never executed.
//! - A target queue pair whose owner closed it ([`TcpTarget`] dropped or
//!   [closed](TcpTarget::close)) executes nothing more: the poller looks before every request
//!   it starts, every payload chunk it receives and every READ reply it sends, and closes the
//!   connection, so the kernel discards whatever was buffered. [`TcpTarget::close`]'s
//!   [`TargetClosed`] tells when that happened.
//! - An initiator's queue pair that goes to ERR (an error, or
//!   [`Fabric::retire`](crate::fabric::Fabric::retire)) closes its connection abortively: the
//!   kernel sends a reset and drops what it had not sent yet. What the peer's kernel had
//!   already received may still be applied by a target that keeps serving it; closing the
//!   target queue pair is what ends that.
//! - Withdrawn registrations are never touched again. Each side checks the key against the
//!   live region table
//!   ([`SoftDevice::deregister`](crate::fabric::soft::SoftDevice::deregister) withdraws it)
//!   not only when a request is judged but again right before every system call that reads
//!   or writes registered memory: every vectored send of WRITE payloads and READ replies, every receive of a WRITE's
//!   payload or a READ's data. A withdrawal fails the request that names it — LOC_PROT_ERR
//!   at the initiator; REM_ACCESS_ERR at the target, or a closed connection (RETRY_EXC_ERR)
//!   once a READ reply's data has started — and the queue pair goes to ERR without moving
//!   the rest; a payload received in part stays partial. So once `deregister` has returned
//!   and this rail's poller has finished the round it was in, this fabric never reads or
//!   writes the region again.

mod attachment;
mod config;
mod connection;
mod device;
mod error;
mod fabric;
mod initiator;
mod link;
mod qp;
mod served;
mod sink;
mod stats;
mod sys;
mod target;
#[cfg(all(test, not(loom)))]
mod tests;
mod wire;

pub use super::TCP_QP_BIT;
pub use attachment::TcpAttachment;
pub use config::TcpConfig;
pub use connection::REQUESTS_PER_SEND;
pub use device::TcpDevice;
pub use error::TcpError;
pub use fabric::TcpFabric;
pub use qp::{TcpPreparedQp, TcpQp, is_tcp_qp};
pub use sink::open_sink;
pub use stats::ServedStats;
pub use target::{TargetClosed, TcpTarget, is_unspecified};
