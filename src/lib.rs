//! railyard: a zero-copy transfer engine for disaggregated LLM inference.
//!
//! A prefill process writes KV-cache blocks straight into a decode process's memory, over
//! RDMA where the host has it and over software fabrics where it does not. This root crate
//! is the top layer — the `railyard` CLI and the log subscriber — and re-exports the layers
//! below it under their usual paths:
//!
//! - [`topology`]: hwloc discovery, rails and the poller placement plan.
//! - [`dataplane`]: SPSC rings, epoch-tagged slices, pollers, batches and fabrics.
//! - [`control`]: endpoint lifecycle, handshakes, directory and failure policy.
//! - [`engine`]: the Engine API — memory, peers, transfers, notifications, stats (the
//!   `railyard-engine` crate, which an application may depend on alone).
//! - [`metrics`]: Prometheus metrics of an engine, and a server for `/metrics` (part of the
//!   engine crate).
//! - [`store`]: the distributed KV-cache store on the engine — its master, segments and
//!   client (the `railyard-store` crate).
//! - [`logging`]: the rate limit of repeated warnings, as a `tracing` layer, and the CLI's
//!   subscriber.
//! - [`chaos`]: deterministic reproductions of the production failures railyard exists to
//!   prevent (`railyard chaos`; the `railyard-chaos` crate).
//!
//! # Thread safety
//! Everything re-exported here documents its own thread safety.
//!
//! # Resource cleanup
//! Everything re-exported here documents its own cleanup.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod logging;

pub use railyard_chaos as chaos;
pub use railyard_control as control;
pub use railyard_dataplane as dataplane;
pub use railyard_engine as engine;
pub use railyard_engine::metrics;
pub use railyard_store as store;
pub use railyard_topology as topology;
