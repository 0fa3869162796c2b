//! The fabric interface: a verbs-like model of an RDMA NIC as one poller sees it.
//!
//! A fabric gives the poller reliable-connected queue pairs to endpoints, takes lists of work
//! requests (WRITE, READ, WRITE_WITH_IMM) and reports work completions with verbs' statuses.
//! Work-request ids encode a poller slot and its generation ([`WrId`]) so that a completion
//! for a slot that has moved on (a flush from a retired queue pair) is recognised and
//! ignored. A fabric value is owned by exactly one poller thread.
//!
//! The model every fabric shares, whatever moves the bytes: memory registrations with
//! [`Access`] flags and exact bounds, queue pairs with verbs' [`QpState`] machine connected by
//! exchanging [`QpInfo`], work requests and completions with verbs' statuses, and
//! [`AsyncEvent`]s for what verbs reports outside the completion queue.
//!
//! Here: [`null::NullFabric`] (completes everything at once, for benchmarks),
//! [`scripted::ScriptedFabric`] (completes chosen requests with chosen statuses, for tests) and
//! [`soft`] (verbs semantics in software across processes, with a fault plan), [`tcp`],
//! [`verbs`] (RDMA through rdma-sys) and [`ofi`] (libfabric). [`faults`] holds the fault
//! plans the soft and TCP fabrics honour themselves; [`faulted::Faulted`] applies them at
//! the boundary of any other fabric.

mod delayed;
pub mod faulted;
pub mod faults;
pub mod host;
mod model;
pub mod null;
pub mod ofi;
pub mod scripted;
pub mod soft;
mod staging;
pub mod tcp;
pub mod verbs;

pub use model::{
    Access, AsyncEvent, Fabric, FabricError, FabricLimits, MemoryRegion, Opcode, PATH_MTUS,
    PostError, QP_HIGH_BIT, QpInfo, QpInfoError, QpNum, QpState, TCP_QP_BIT, WcStatus,
    WorkCompletion, WorkRequest, WrId,
};
