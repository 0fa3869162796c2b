//! Machine discovery for railyard.
//!
//! This crate owns everything railyard knows about the host's hardware: NUMA nodes and
//! their cores, RDMA NICs and their ports, GPUs, the PCI distance between them, which NICs
//! become **rails**, and the **placement plan** that gives each rail's poller its own core.
//! It reads the machine through hwloc (live, or from an XML snapshot so that a bug report
//! can be replayed) and sysfs; it pins threads and binds memory when asked.
//!
//! It must not know about transfers: nothing here depends on the data plane or the control
//! plane, and nothing here starts a thread. Planning ([`plan`]) is pure: the same
//! [`Machine`] and [`PlanOptions`] always give the same [`Plan`].
//!
//! ```no_run
//! use railyard_topology::{HostTopology, PlanOptions};
//! let host = HostTopology::live()?;
//! let plan = host.plan(&PlanOptions::default())?;
//! for rail in &plan.rails {
//!     println!("{} polls on PU {}", rail.name, rail.poller_pu);
//! }
//! # Ok::<(), railyard_topology::TopologyError>(())
//! ```
//!
//! # Thread safety
//! [`HostTopology`] is `Send + Sync`; plans are plain data.
//!
//! # Resource cleanup
//! Dropping a [`HostTopology`] frees the hwloc topology. Pinning and memory binding last
//! until changed; nothing is undone on drop.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod discover;
mod error;
pub mod model;
pub mod plan;

pub use discover::HostTopology;
pub use error::TopologyError;
pub use model::{LinkLayer, Machine, PciDistance};
pub use plan::{NicSelection, Plan, PlanOptions, Rail, RailKind};
