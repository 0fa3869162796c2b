//! The soft fabric: RDMA verbs semantics in software, between processes of one host, with
//! deterministic fault injection (DESIGN.md §5).
//!
//! For hosts without RDMA NICs and for tests. The pieces mirror verbs:
//! - [`SoftDevice`]: one rail's device context and protection domain. [`SoftDevice::register`]
//!   returns lkey/rkey with [`Access`](crate::fabric::Access) flags and exact bounds; the
//!   registrations live in a region table in shared memory the process owns (module
//!   `regions`), which peers map read-only and check on every work request — a
//!   deregistration is seen by the next one.
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
mod config;
mod device;
mod error;
mod fabric;
mod fence;
pub mod handshake;
mod inbox;
mod nic;
mod qp;
mod regions;
mod sys;

pub use crate::fabric::faults::{Fault, FaultHandle, FaultPlan, QpMatch};
pub use buffer::{Backing, SoftBuffer};
pub use config::SoftConfig;
pub use device::SoftDevice;
pub use error::SoftError;
pub use fabric::SoftFabric;
pub use inbox::{INBOX_CAPACITY, InboxError, RecvCompletion, RecvQueue};
pub use qp::{SoftAttachment, SoftQp};
pub use regions::{CAPACITY as REGION_CAPACITY, RegionError, RemoteTableError};
