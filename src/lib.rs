//! railyard: a zero-copy transfer engine for disaggregated LLM inference.
//!
//! A prefill process writes KV-cache blocks straight into a decode process's memory, over
//! RDMA where the host has it and over software fabrics where it does not. This root crate
//! wires the three layers together under the Engine API:
//!
//! - [`topology`]: hwloc discovery, rails and the poller placement plan.
//! - [`dataplane`]: SPSC rings, epoch-tagged slices, pollers, batches and fabrics.
//! - [`control`]: endpoint lifecycle, handshakes, directory and failure policy.
//! - [`engine`]: the Engine API — memory, peers, transfers, notifications, stats.
//! - [`metrics`]: Prometheus metrics of an engine, and a server for `/metrics`.
//! - [`logging`]: the rate limit of repeated warnings, as a `tracing` layer, and the CLI's
//!   subscriber.
//! - [`chaos`]: deterministic reproductions of the production failures railyard exists to
//!   prevent (`railyard chaos`).
//!
//! # Thread safety
//! Everything re-exported here documents its own thread safety.
//!
//! # Resource cleanup
//! Everything re-exported here documents its own cleanup.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod chaos;
pub mod engine;
pub mod logging;
pub mod metrics;

pub use railyard_control as control;
pub use railyard_dataplane as dataplane;
pub use railyard_topology as topology;
