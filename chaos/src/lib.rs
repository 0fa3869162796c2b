//! Reproductions of the four production failures of DESIGN.md §1, on the soft fabric with
//! fault plans: each scenario runs its targets as `railyard serve` processes (driven over
//! their stdin: regions, digests of their bytes, counters) and its initiators as whole nodes
//! in this process (rails, pollers, control planes; `handshake-churn` also as `railyard
//! bench` processes), injects its failure deterministically from a seed, and reports what
//! happened as counts. `railyard chaos <scenario>` prints them; the integration tests
//! assert them.
//!
//! | scenario | what it does | what must hold |
//! |---|---|---|
//! | [`storm`] `reconnect-storm` | a LOC_LEN_ERR with stale keys waiting behind it | no stale post, ≤ 1 reconnect, nothing lost |
//! | [`race`] `teardown-race` | full-rate submitters while endpoints are retired and queue pairs fail thousands of times | no crash, nothing lost or resolved twice, no stale post |
//! | [`churn`] `handshake-churn` | one peer repeats its handshake; two peers on one host | no teardown, no reconnect, bounded warnings |
//! | [`replica`] `dead-replica` | four `railyard serve` processes; one is killed, one stopped (no reset); newcomers take their ports | live peers keep ≥ 80 % throughput, the killed one fails fast, the stopped one within 2.5 s, nothing reaches a newcomer |
//!
//! [`hicache`] (`railyard chaos hicache`, feature `etcd`) is seed 003 one layer up: the
//! store (`railyard-store`) under a HiCache-shaped load of client processes while segment
//! processes are killed (a newcomer on the port), stopped and hit by transfer errors, and the
//! leading master is killed and stopped; it judges every call the clients made.
//!
//! [`soak`] (`railyard chaos soak --duration D [--etcd]`) runs target processes under a
//! seeded mix of kills with port takeovers, stops, queue-pair errors and key rotations (and
//! etcd restarts) for a whole duration.
//!
//! This crate drives the layers it exercises through `railyard-engine` (and the control
//! plane and data plane it re-exports) and `railyard-store`, never the CLI: the `railyard` crate re-exports it as
//! `railyard::chaos`, and its callers pass in the `railyard` binary whose `serve` (and
//! `bench`) the scenarios run as processes.

pub mod churn;
#[cfg(feature = "etcd")]
pub mod etcd_server;
mod fabric;
mod harness;
#[cfg(feature = "etcd")]
pub mod hicache;
pub mod node;
mod pattern;
mod process;
pub mod race;
pub mod replica;
mod scenario;
pub mod soak;
pub mod storm;
mod tally;

pub use fabric::ChaosFabric;
pub use harness::BOUND;
pub use pattern::{digest, digest_more};
pub use scenario::{Outcome, Scenario, run};
pub use tally::RequestTally;
