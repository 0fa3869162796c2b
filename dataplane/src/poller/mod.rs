//! The poller: one thread per rail, the only code that touches the rail's fabric queues and
//! endpoints.
//!
//! Its loop: drain the submission rings → apply commands (add an endpoint, bump its epoch,
//! retire it, open or close its circuit, shut down) → post what waited for credits and has
//! them now, apply the epoch rule to new slices and post what passes and has credits, one
//! doorbell per queue pair per round → poll completions and resolve slices → sweep
//! deadlines → idle. Submissions are drained before commands so that a slice prepared
//! for an epoch the control plane has announced always finds that epoch's command applied:
//! the control plane sends the command first and publishes the epoch to submitters after.
//!
//! The decisions the loop carries out live in small modules with their own tests: `rule`
//! (pure functions: the epoch rule, where a slice goes on its endpoint, the backlog's bound,
//! the retry rule), `credits` (an endpoint's credits on its queue pair), `deadline` (sweeps
//! and overdue work) and `inflight` (the table of posted work requests by slot and
//! generation). The loop itself is split by concern: `run` (a round's steps, idling, events,
//! stopping), `endpoints` (the owner's commands), `posting`, `completion` (completions and
//! the fabric's events) and `sweep` (deadlines), all on the tables of `state`; `handle` is
//! the owner's side and `shared` what both sides share.
//!
//! # Credits
//! A queue pair carries at most its send queue's depth of posted work requests and the rail
//! at most what its completion queue holds ([`FabricLimits`], flushes a retire will produce
//! included: every request completes exactly once). A slice that passes the epoch rule
//! without a credit waits, in order, in its endpoint's queue for credits until completions
//! return some (its deadline still applies). A post the fabric cuts short with
//! `SendQueueFull` is backpressure, not failure: the refused rest goes back to the front of
//! that queue. Only errors that cannot pass fail a slice `PostFailed`. Each round's posts
//! are gathered per queue pair and posted with one call (one doorbell) each.
//!
//! # The epoch rule
//! A slice whose epoch is older than its endpoint's current epoch is never posted: it goes
//! to the [`Reprepare`] hook, which rewrites it for the current epoch or names a reason to
//! fail it. A slice newer than its endpoint (the poller has not applied the reconnect yet)
//! and a slice for an endpoint whose queue pair failed wait in the endpoint's bounded
//! backlog until the epoch arrives or their deadline passes.
//!
//! # Failures
//! Any error completion leaves the queue pair in ERR (as verbs does): the poller retires it,
//! which flushes everything else outstanding on it, marks the endpoint down and reports
//! [`Event::QpFailed`] so the owner of endpoints can reconnect at a new epoch. Flushed and
//! transport-failed slices are retried (within [`PollerConfig::retry_budget`]) at the new
//! epoch — those flushed behind another slice's work-request error without being charged
//! for it; a slice whose own work request was wrong (length, protection, access) is
//! re-prepared once and fails the second time, so it can never take a fresh queue pair down
//! twice. A WRITE_WITH_IMM that was flushed or cut off is never retried: its immediate may
//! have been delivered, and an immediate is delivered at most once.
//!
//! # Nothing moves after it is reported
//! A slice resolves only when the fabric no longer holds its buffers. A slice whose deadline
//! passes while it is still queued here resolves with `Timeout` at once; one whose deadline
//! passes while it is posted is marked, its queue pair is taken out of service (retired: ERR,
//! flush, [`Event::QpFailed`] with RETRY_EXC_ERR, a new epoch for the endpoint's other work),
//! and it resolves with `Timeout` when the flush hands it back. Shutdown follows the same
//! rule. A fabric that breaks its promise to flush within [`PollerConfig::flush_grace`] has
//! the queue pair torn down ([`Fabric::abandon`]: destroyed, its connection closed) before
//! the work on it is resolved as flushed, so even then nothing moves after a report; each
//! such request is counted as `unflushed`. Only a fabric that cannot tear a queue pair down
//! (libfabric, whose operations only closing the shared endpoint would recall) has its
//! overdue work resolved while the provider still holds it.
//!
//! # Stopping
//! However the poller thread ends — a shutdown command or a panic — it marks itself stopped,
//! resolves what it held, and leaves its rings where a submitter that pushed too late finds
//! and resolves them ([`PollerShared::wake`]). Events to the owner of endpoints are never
//! dropped: when the event ring is full they wait, coalesced per endpoint (the latest wins).
//!
//! [`FabricLimits`]: crate::fabric::FabricLimits
//! [`Fabric::abandon`]: crate::fabric::Fabric::abandon

mod completion;
mod config;
mod counters;
mod credits;
mod deadline;
mod endpoints;
mod handle;
mod inflight;
#[cfg(all(test, loom))]
mod loom_models;
mod messages;
mod posting;
mod reprepare;
mod rule;
mod run;
mod shared;
mod state;
mod sweep;

pub use config::{IdleStrategy, PollerConfig};
pub use counters::CounterSnapshot;
pub use handle::{COMMAND_WAIT, PollerHandle, PollerStopped, SpawnError};
pub use messages::{Command, Event};
pub use reprepare::{FailStale, RepairCause, Reprepare};
pub(crate) use shared::PollerShared;
