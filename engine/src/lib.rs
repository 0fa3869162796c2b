//! railyard's engine: railyard as an application embeds it, with nothing of the CLI, the
//! chaos scenarios or clap (the `railyard` crate re-exports it as `railyard::engine`, and
//! this crate's [`metrics`] as `railyard::metrics`; [`logging`] holds the rate limit of
//! repeated warnings that `railyard::logging` and the Python module's log bridge use).
//!
//! ```no_run
//! use railyard_engine::{Engine, Op, Transfer};
//! # fn main() -> anyhow::Result<()> {
//! let engine = Engine::builder("prefill-0").build()?;
//! let pool = engine.alloc(64 << 20, None)?;
//! let decode = engine.open("10.0.0.2:7400")?;
//! let target = decode.descriptor().regions[0].base;
//! let mut submitter = engine.submitter()?;
//! let batch = submitter.submit(
//!     &decode,
//!     &[Transfer { op: Op::Write, local: pool, local_offset: 0, remote_addr: target, len: 1 << 20 }],
//! )?;
//! batch.wait(std::time::Instant::now() + std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```
//!
//! An engine owns its rails (one device and one pinned poller each, all on the soft fabric
//! or all on the verbs fabric: [`FabricChoice`]), its control plane
//! (handshake listener, endpoints, directory) and its registered memory. Memory is
//! registered on every rail. A [`Peer`] is a remote process at one incarnation, with an
//! endpoint on each local rail. A [`EngineSubmitter`] (one per thread) turns transfers into
//! slices — validated, split at the slice size, striped across rails — and hands them to
//! the pollers.
//!
//! # When memory is free again
//! - **Local side, strict:** once [`Batch::wait`] (or [`Batch::poll`]) reports a request —
//!   done, failed or timed out — no fabric operation of it reads or writes your local memory
//!   again; reuse the buffers at once.
//! - **Remote side, bounded:** a write of a failed or timed-out request may still land at the
//!   target until the target has processed the retirement of the queue pair it came on.
//! - **Fences, for good:** after [`Engine::revoke`]`(peer)` returns `Ok`, no write or read
//!   that `peer` submitted before that moment ever touches this engine's memory — not after
//!   a reconnect, not after a retry, not ever. After [`Engine::deregister`]`(region)` returns
//!   `Ok`, nothing submitted before it touches that memory, whatever is registered there
//!   later. New work after a fence works as usual. Work caught by a fence fails with its own
//!   reason — `Revoked` or `RegionWithdrawn` ([`FailReason`](railyard_dataplane::FailReason))
//!   — and is never retried into other memory: a slice carries the generation of the remote
//!   region it was prepared against and the epoch it was prepared for, and a reconnect may
//!   move it to a new queue pair, never to a new generation or past a fence.
//!
//! # Thread safety
//! [`Engine`] is `Send + Sync` and cheap to clone (an `Arc`). [`EngineSubmitter`] is `Send`,
//! not `Sync`: one per thread. [`Batch`]es are `Send + Sync`.
//!
//! # Resource cleanup
//! Dropping the last clone of an engine stops its control plane, then its pollers (every
//! queued slice resolves with `Shutdown`), then deregisters and frees its memory. A
//! [`Region`] handle does not keep memory alive: [`Engine::deregister`] (or the engine's
//! end) does the freeing, and later transfers naming it fail with `UnknownRegion`.
//!
//! [`Batch`]: railyard_dataplane::Batch
//! [`Batch::wait`]: railyard_dataplane::Batch::wait
//! [`Batch::poll`]: railyard_dataplane::Batch::poll

mod builder;
mod connect;
mod directory;
mod error;
pub mod logging;
pub mod memory;
pub mod metrics;
mod op;
mod peer;
mod prepared;
mod rails;
mod region;
mod registration;
mod revoke;
mod session;
mod state;
mod stats;
mod transfer;

pub use railyard_control as control;
pub use railyard_control::{ClusterSecret, SecretError};
pub use railyard_dataplane as dataplane;
pub use railyard_dataplane::fabric::tcp::ServedStats;
pub use railyard_dataplane::fabric::verbs::RailConfig;
pub use railyard_topology as topology;

pub use builder::{
    DEFAULT_SLICE_SIZE, EngineBuilder, FabricChoice, RailChoice, default_name, ofi_provider,
    primary_ip,
};
pub use connect::{WARMUP_PARALLEL, Warmed};
pub use directory::DirectoryChoice;
pub use error::{BuildError, MemoryError, PeerError, PrepareError, RevokeError, TransferError};
pub use op::Op;
pub use peer::Peer;
pub use prepared::{LocalList, PostOptions, RemoteList, check_pairs};
pub use region::{DEREGISTER_WAIT, PeerAccess, Region};
pub use revoke::REVOKE_WAIT;
pub use session::{FAILED_OPEN_KEPT, MAX_IDLE_SUBMITTERS, RawTransfer, SubmitterPool};
pub use state::Engine;
pub use stats::{EndpointStats, EngineStats, OpTotals, PeerStats, RailEndpoints, RailStats};
pub use transfer::{EngineSubmitter, PreparedTotals, REFRESH_WAIT, SubmitTiming, Transfer};
