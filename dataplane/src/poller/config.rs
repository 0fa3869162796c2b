//! How a poller runs: its thread, its idle strategy and the bounds of its queues and rings.

use std::time::Duration;

/// What a poller does when a round found no work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleStrategy {
    /// Spin forever: lowest latency, burns the core. For pinned production pollers.
    BusySpin,
    /// Spin `spins` rounds, then yield the core each round.
    SpinThenYield {
        /// Idle rounds spent spinning before yielding.
        spins: u32,
    },
    /// Spin `spins` rounds, then park for at most `park` (a submitter or command wakes it
    /// earlier). Parks only with nothing in flight and no peer to serve; otherwise it
    /// yields.
    SpinThenPark {
        /// Idle rounds spent spinning before parking.
        spins: u32,
        /// Longest park.
        park: Duration,
    },
}

impl IdleStrategy {
    /// An idle strategy that cannot starve a small machine: what tests use.
    pub const fn gentle() -> Self {
        Self::SpinThenPark {
            spins: 64,
            park: Duration::from_millis(2),
        }
    }
}

/// How to run a poller.
#[derive(Clone, Debug)]
pub struct PollerConfig {
    /// Thread name (the rail's name).
    pub name: String,
    /// PU (OS CPU index) to pin the thread to; `None` leaves it unpinned.
    pub pin_pu: Option<usize>,
    /// What to do when idle.
    pub idle: IdleStrategy,
    /// Most slices taken from one submission ring per round, and most completions polled.
    pub max_batch: usize,
    /// Retries of a flushed or transport-failed slice before it fails.
    pub retry_budget: u8,
    /// Most slices arriving for an endpoint while it is down (reconnecting) that it holds
    /// until its next queue pair; more fail with `BacklogFull`. Slices it had admitted
    /// before (waiting for credits when its queue pair went) do not count. 64 Ki by default:
    /// a burst of 16 GiB in 256 KiB slices rides out a reconnect, for a few MiB of records.
    pub backlog_limit: usize,
    /// Slots of the command ring.
    pub command_capacity: usize,
    /// Slots of the event ring (more events wait, coalesced per endpoint).
    pub event_capacity: usize,
    /// How long the fabric has to hand back the work of a queue pair taken out of service (a
    /// deadline passed while it was posted, or shutdown) before it is resolved without the
    /// flush. A fabric that keeps its promise flushes well within it.
    pub flush_grace: Duration,
}

impl PollerConfig {
    /// Defaults for a poller named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            pin_pu: None,
            idle: IdleStrategy::SpinThenYield { spins: 1024 },
            max_batch: 64,
            retry_budget: 3,
            backlog_limit: 64 * 1024,
            command_capacity: 256,
            event_capacity: 1024,
            flush_grace: Duration::from_secs(1),
        }
    }
}
