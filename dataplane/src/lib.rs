//! railyard's data plane (DESIGN.md §3–§5).
//!
//! This crate owns the path a transfer takes after it has been prepared: application threads
//! hand [`Slice`]s to per-rail pollers ([`PollerHandle`]) over lock-free SPSC [`ring`]s; each poller checks
//! every slice's [`Epoch`] against its endpoint's, posts it to its [`fabric`], polls
//! completions and resolves each slice exactly once into its [`Batch`].
//!
//! It must not know about topology or the control plane: which PU a poller is pinned to,
//! which endpoints exist and what their epochs are all arrive as plain values and commands.
//! A rail's poller is the only code that touches that rail's fabric queues and endpoints.
//!
//! # Thread safety
//! [`Submitter`] and the ring handles are `Send` but not `Sync`: one per thread. [`Batch`]
//! is `Send + Sync` and can be waited on from any thread. [`PollerHandle`] is `Send + Sync`;
//! its counters are read without locks.
//!
//! # Resource cleanup
//! Every slice resolves exactly once, whatever happens: a slice still queued when its poller
//! shuts down fails with [`FailReason::Shutdown`], and one left in a ring whose poller is gone
//! fails with [`FailReason::PollerGone`] when the ring is dropped. A [`Batch`] whose slices
//! are all resolved frees its state when the last handle goes.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod batch;
pub mod entropy;
mod epoch;
pub mod fabric;
mod poller;
mod quiesce;
pub mod ring;
pub mod rng;
pub mod sabotage;
mod slice;
mod submitter;
mod sync;

pub use batch::{Batch, BatchStatus, FailReason, RequestFailure, RequestOutcome};
pub use epoch::{EndpointId, Epoch};
pub use poller::{
    COMMAND_WAIT, Command, CounterSnapshot, Event, FailStale, IdleStrategy, PollerConfig,
    PollerHandle, PollerStopped, RepairCause, Reprepare, SpawnError,
};
pub use slice::{Slice, SliceSpec};
pub use submitter::{DEFAULT_DEADLINE, SubmitError, Submitter};
