//! The verbs fabric: real RDMA through rdma-sys, the only module that uses it.
//!
//! - [`device`]: run-time detection, with a specific reason when there is no device (here:
//!   `ibv_get_device_list: ENOSYS`), probed once.
//! - [`ffi`]: owners of verbs objects (context, protection domain, memory region, completion
//!   queue, queue pair) that hold their parents, a typestate for queue-pair set-up, and loud
//!   reports of failed destroys.
//! - [`rail`]: one RDMA rail — device, port (first ACTIVE), GID (RoCE v2 IPv4-mapped, from
//!   sysfs, or configured), protection domain, the rail's completion queue, registrations,
//!   and queue pairs staged for the poller.
//! - [`VerbsFabric`]: the poller's side — linked post lists (one doorbell), selective
//!   signaling, inline writes, batched polling, non-blocking asynchronous events.
//! - Device-independent parts, tested on any machine: [`attrs`] (queue-pair attributes per
//!   transition with documented defaults), [`mtu`] (negotiation: the smaller side),
//!   [`status`] (verbs statuses onto the model), [`gid`], [`signal`].
//!
//! The data path has not run on hardware in this repository's CI (no device);
//! `make test-rdma` runs it on a machine with a NIC or SoftRoCE. The Engine uses it when the
//! topology plan has RDMA rails (`--fabric auto` or `verbs`).

pub mod attrs;
pub mod device;
mod fabric;
pub mod ffi;
pub mod gid;
pub mod health;
pub mod mtu;
pub mod rail;
pub mod signal;
pub mod status;

pub use device::{VerbsUnavailable, devices};
pub use fabric::VerbsFabric;
pub use rail::{RailConfig, RailError, VerbsRail};
