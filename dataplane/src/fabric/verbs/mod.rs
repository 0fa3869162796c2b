//! The verbs fabric: real RDMA through rdma-sys, the only module that uses it.
//!
//! Built so far: what can be right by construction and tested without a NIC —
//! [`device`] (run-time detection with a specific reason when there is no device),
//! [`attrs`] (queue-pair attributes for RESET → INIT → RTR → RTS → ERR with documented
//! defaults), [`mtu`] (path MTU negotiation: the smaller side), [`status`] (verbs statuses
//! onto the fabric model), [`gid`] (RoCE v2 GID selection from sysfs) and [`signal`]
//! (selective signaling: every k-th and the last request, and completing the unsignaled
//! ones a later completion implies). The device wrappers and the poller-side `Fabric`
//! come next.

pub mod attrs;
pub mod device;
pub mod gid;
pub mod mtu;
pub mod signal;
pub mod status;

pub use device::{VerbsUnavailable, devices};
