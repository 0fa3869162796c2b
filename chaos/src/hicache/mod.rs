//! `railyard chaos hicache`: DESIGN.md's seed 003 at the layer where it happened — a store
//! under an SGLang-HiCache-shaped load while its processes really die.
//!
//! An etcd, two masters (`railyard master --etcd`: a leader and a standby), four segment
//! processes (`railyard store serve`, 128 MiB each) and two client processes
//! ([`run_client`]: `batch_put_from` with two replicas, `batch_exists`, `batch_get_into` of
//! 64 KiB – 1 MiB values derived from their keys). Then, in a seeded order of victims, for
//! as long as asked (at least one round):
//!
//! 1. **SIGKILL of a segment process**, and a newcomer under its name on its port;
//! 2. **SIGSTOP of another** (no reset), let go after [`STOPPED_FOR`];
//! 3. **a burst of transfer errors** on one client's rail for [`BURST`];
//! 4. **SIGKILL of the leading master** (a new standby is started);
//! 5. **SIGSTOP of the leading master** until a standby leads, then SIGCONT: the deposed
//!    leader must not act (it exits; if it still answers, a mount is tried through it).
//!
//! What it judges, from every call the clients report (see [`HicacheReport`]): no wrong
//! byte; no get (or exists) failed while one of the key's replica holders was alive and
//! running throughout the call; the p99 of get batches started during each segment fault
//! ≤ [`P99_BOUND`]; the live part's throughput ≥ [`THROUGHPUT_BOUND`] of the window before
//! the fault (from the detection bound on: until then a call waiting on the stopped holder
//! is bounded by the p99); the cluster serving puts and gets again ≤ [`SERVE_AGAIN_BOUND`]
//! after the leader's SIGKILL; no deposed master acting; and after the run, once the
//! clients removed every key they tried, no write in progress, no object and no byte
//! reserved.

mod cluster;
mod judge;
mod report;
mod run;
mod workload;

pub use report::{
    FaultMeasure, HicacheConfig, HicacheReport, P99_BOUND, SERVE_AGAIN_BOUND, THROUGHPUT_BOUND,
};
pub use run::{BURST, CLIENTS, SEGMENTS, STOPPED_FOR, run};
pub use workload::run_client;
