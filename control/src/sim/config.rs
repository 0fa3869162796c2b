//! What a simulated run is asked to do ([`SimConfig`], its network and faults) and what it
//! reports ([`SimReport`], its [`Violation`]s).

use std::time::Duration;

use super::service::{ServiceFactory, ServiceReport};
use crate::policy::Policy;

/// What the simulated network does to control messages.
#[derive(Clone, Debug, PartialEq)]
pub struct NetFaults {
    /// The shortest one-way latency.
    pub latency_min: Duration,
    /// The longest one-way latency (each message draws one uniformly in between).
    pub latency_max: Duration,
    /// Probability that a message is lost. TCP never loses one message and carries on, so
    /// its connection is lost with it: both ends see it reset.
    pub loss: f64,
    /// Probability that a message arrives twice.
    pub duplicate: f64,
    /// Probability that a message overtakes those sent before it on its connection.
    pub reorder: f64,
}

impl Default for NetFaults {
    fn default() -> Self {
        Self {
            latency_min: Duration::from_micros(20),
            latency_max: Duration::from_micros(400),
            loss: 0.0002,
            duplicate: 0.0002,
            reorder: 0.0005,
        }
    }
}

impl NetFaults {
    /// A network that delays messages and does nothing else to them.
    pub fn quiet() -> Self {
        Self {
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            ..Self::default()
        }
    }
}

/// One fault the simulation injects (processes are numbered from 0 in the order they
/// start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The process crashes (its connections reset) and starts again after `restart_after`
    /// as a new incarnation on the same port.
    Kill {
        /// The process.
        peer: usize,
        /// How long it stays down.
        restart_after: Duration,
    },
    /// The process stops (SIGSTOP) for `duration`: its sockets stay open and nothing it
    /// receives is answered.
    Stop {
        /// The process.
        peer: usize,
        /// How long.
        duration: Duration,
    },
    /// Messages between these processes and the others are held for `duration` (what was
    /// sent arrives when it heals, as TCP retransmits it); dials across fail.
    Partition {
        /// One side.
        peers: Vec<usize>,
        /// How long.
        duration: Duration,
    },
    /// The directory loses the process's lease for `duration` (every other process is told
    /// it is gone, then that it returned).
    LeaseLoss {
        /// The process.
        peer: usize,
        /// How long.
        duration: Duration,
    },
}

/// A fault at a time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// When, from the start of the run.
    pub at: Duration,
    /// What.
    pub kind: FaultKind,
}

/// One simulated run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Processes.
    pub peers: usize,
    /// Decides everything random in the run.
    pub seed: u64,
    /// Simulated time.
    pub duration: Duration,
    /// How many other processes each one sends transfers to (chosen from the seed).
    pub fanout: usize,
    /// With `n > 0`, every process sends only to the first `n` processes (the decode
    /// ranks a whole cluster of prefill ranks writes into): each of them is the target of
    /// nearly every handshake.
    pub hot_targets: usize,
    /// How long a process takes to answer one ConnectQp (creating and connecting its
    /// queue pair); it answers them one at a time.
    pub handshake_cost: Duration,
    /// Each process starts a transfer this often.
    pub request_interval: Duration,
    /// A transfer's deadline.
    pub request_timeout: Duration,
    /// How often each process's core is ticked (its timers' resolution).
    pub tick: Duration,
    /// The network.
    pub net: NetFaults,
    /// The share of processes killed at once a third of the way in (a mass restart).
    pub kill_fraction: f64,
    /// How long a killed process stays down.
    pub restart_after: Duration,
    /// Processes stopped two thirds of the way in.
    pub stops: usize,
    /// How long each stays stopped.
    pub stop_for: Duration,
    /// Partitions of a few processes each, halfway through.
    pub partitions: usize,
    /// Directory leases lost (and then held again) 60 % of the way in.
    pub lease_losses: usize,
    /// Whether a cluster directory (etcd) tells every process when one restarts (its
    /// successor claims the name); without one, peers learn it by dialing the address.
    pub directory: bool,
    /// The faults, when given explicitly (as [`shrink`](super::shrink) does); otherwise drawn from the
    /// seed and the counts above.
    pub faults: Option<Vec<Fault>>,
    /// The cores' policy.
    pub policy: Policy,
    /// Reconnects (new queue pairs after an endpoint's first) a pair of live processes may
    /// need over the run before it counts as a storm.
    pub max_reconnects_per_pair: u64,
    /// Bytes of control state per known peer a process may hold.
    pub max_state_per_peer: usize,
    /// Keep every event's line (for printing a trace); otherwise only the hash.
    pub record_trace: bool,
    /// Services simulated beside the control plane (the store's master), on the same
    /// clock, processes and faults.
    pub services: Vec<ServiceFactory>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            peers: 100,
            seed: 1,
            duration: Duration::from_secs(20),
            fanout: 8,
            hot_targets: 0,
            handshake_cost: Duration::from_micros(200),
            request_interval: Duration::from_millis(50),
            request_timeout: Duration::from_secs(5),
            tick: Duration::from_millis(25),
            net: NetFaults::default(),
            kill_fraction: 0.1,
            restart_after: Duration::from_millis(500),
            stops: 1,
            stop_for: Duration::from_secs(4),
            partitions: 1,
            lease_losses: 1,
            directory: true,
            faults: None,
            policy: Policy::default(),
            max_reconnects_per_pair: 4,
            max_state_per_peer: 16 << 10,
            record_trace: false,
            services: Vec::new(),
        }
    }
}

/// Something that must hold and did not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// When (simulated, from the start).
    pub at: Duration,
    /// Which invariant (a short stable name).
    pub invariant: &'static str,
    /// What exactly.
    pub detail: String,
}

/// What a run did, and what broke.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimReport {
    /// Hash of every event in order: equal for equal configurations.
    pub trace_hash: u64,
    /// Processes.
    pub peers: usize,
    /// Simulated time run.
    pub simulated: Duration,
    /// Wall time taken.
    pub wall: Duration,
    /// Events processed.
    pub events: u64,
    /// ConnectQps received (handshakes, each attempt counted).
    pub handshakes: u64,
    /// ConnectQps a target told its initiator to wait their turn (`ConnectQpQueued`).
    pub handshakes_told_to_wait: u64,
    /// Handshakes per simulated second, over the run.
    pub handshakes_per_sec: f64,
    /// The most handshakes one process answered within one simulated second.
    pub peak_handshakes_per_sec_into_one: u64,
    /// When every process first had a ready endpoint to every peer it sends to.
    pub all_connected_after: Option<Duration>,
    /// From the killed processes' restart until every pair involving them was ready again.
    pub converged_after_restart: Option<Duration>,
    /// Reconnects per pair that ever connected: the most any pair needed.
    pub max_reconnects_per_pair: u64,
    /// Reconnects per pair: the mean.
    pub mean_reconnects_per_pair: f64,
    /// The most endpoints one rail of one process held at once.
    pub peak_endpoints_per_rail: usize,
    /// The most queue pairs (endpoints not parked) one rail of one process held at once.
    pub peak_queue_pairs_per_rail: usize,
    /// The most control-state bytes per known peer any process held.
    pub control_state_bytes_per_peer: usize,
    /// Control-path bytes sent, per process.
    pub control_wire_bytes_per_peer: u64,
    /// The longest a stopped peer went undetected by a process with traffic to it.
    pub max_stop_detection: Option<Duration>,
    /// Transfers started.
    pub requests: u64,
    /// Transfers that completed.
    pub completed: u64,
    /// Transfers that failed at once: their peer was known to be unavailable.
    pub failed_fast: u64,
    /// Transfers that failed otherwise (retired endpoint, deadline, lost queue pair).
    pub failed: u64,
    /// Slices re-prepared for a newer epoch before they were posted.
    pub reprepared: u64,
    /// Idle endpoints parked to stay within the rail's queue-pair cap.
    pub evictions: u64,
    /// Transfers that failed because their endpoint was parked under them (never, unless
    /// the idle check is sabotaged).
    pub failed_by_eviction: u64,
    /// Application connects that failed.
    pub connects_failed: u64,
    /// What each service simulated beside the control plane reported.
    pub services: Vec<ServiceReport>,
    /// What broke, in order.
    pub violations: Vec<Violation>,
    /// Every event's line, with `record_trace`.
    pub trace: Vec<String>,
}

impl SimReport {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}
