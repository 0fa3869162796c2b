//! Deterministic simulation of the control plane at scale (`railyard sim`).
//!
//! [`simulate`] runs N processes' real sans-IO handshake cores (the `handshake` module: peer
//! table, endpoint state machines, the p2p directory) in one thread, over a simulated
//! network and clock, with a model of each rail's poller in place of the data plane. One
//! seed decides everything: message latencies, loss, duplication and reordering on the
//! control path, partitions, which processes are killed (and restarted on the same port as
//! new incarnations), stopped (SIGSTOP: they keep their sockets and say nothing) or lose
//! their directory lease, and the application's transfers. The same seed gives the same
//! run, bit for bit: [`SimReport::trace_hash`] hashes every event in order.
//!
//! The model pollers apply the poller's rules to model slices — the epoch rule (a slice
//! prepared for an older epoch is re-prepared before it is posted), retirement, circuits,
//! deadlines — and the simulation checks at every step what must hold whatever happens:
//!
//! | invariant | checked when |
//! |---|---|
//! | a queue pair handed to an endpoint is connected to the incarnation the endpoint names (no reply applied to another peer) | every queue pair a poller connects |
//! | no slice is posted on a queue pair older than the epoch it was prepared for, and an endpoint id's epochs only grow across occupants | every post and every new endpoint |
//! | every application connect is answered by its deadline, and every transfer resolved by its own | each tick, and at the end |
//! | a stopped peer is detected (circuit open) within the liveness bound | the bound after each stop |
//! | each pair reconnects at most a small number of times, even after a mass restart | at the end |
//! | the control state per known peer stays under a bound | each second, per process |
//! | a rail never holds more queue pairs than its cap | each second, per process |
//! | an eviction fails nothing: only idle endpoints are parked | every park |
//!
//! A run that breaks one reports [`Violation`]s; [`shrink`] then looks for the smallest
//! run (fewer faults, fewer peers, less time, a quieter network) that still breaks it, and
//! its trace is what `railyard sim` prints.
//!
//! Other crates' sans-IO state machines run beside the cores as [`SimService`]s (the
//! store's master, `railyard_store::sim`), on the same clock, processes, faults and trace:
//! the world tells a service when a process dies, restarts, stops or resumes, wakes it when
//! it asked to be woken, and records the violations of its own invariants with the rest.
//!
//! The model poller is a model: it checks the control plane's side of the contract (what
//! it hands pollers, and when), not the data plane's code, which its own tests and loom
//! models cover.

mod config;
mod fabric;
mod model;
mod service;
mod shrink;
mod trace;
mod world;

pub use config::{Fault, FaultKind, NetFaults, SimConfig, SimReport, Violation};
pub use service::{ProcessView, ServiceFactory, ServiceReport, ServiceWorld, SimService};
pub use shrink::{Shrunk, shrink};
pub use world::{faults, simulate};
