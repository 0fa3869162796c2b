//! What an engine counts: the per-peer counters its submitters bump, and the snapshot types
//! [`Engine::stats`](crate::Engine::stats) returns — the one way the metrics read an engine's
//! counters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use railyard_control::{ControlStats, Incarnation, Phase};
use railyard_dataplane::CounterSnapshot;
use railyard_dataplane::fabric::tcp::ServedStats;

use super::op::Op;

/// Counters of one rail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailStats {
    /// The rail's name.
    pub name: String,
    /// Its poller's counters (posted, completed, failed by reason, re-prepared, stale
    /// dropped…).
    pub poller: CounterSnapshot,
    /// What its TCP target side carried out for initiators (`None` on verbs). Soft-fabric
    /// and RDMA transfers are one-sided: the target never sees them.
    pub served: Option<ServedStats>,
    /// Its endpoints now, by what they hold.
    pub endpoints: RailEndpoints,
}

/// The endpoints of one rail now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RailEndpoints {
    /// Endpoints holding, connecting or waiting for room for a queue pair (those holding
    /// or connecting one are at most
    /// [`Policy::max_endpoints_per_rail`](railyard_control::Policy::max_endpoints_per_rail)).
    pub live: usize,
    /// Endpoints parked: idle, their queue pair freed until traffic wants them.
    pub parked: usize,
    /// Endpoints retired and not yet drained by the poller.
    pub retiring: usize,
}

/// Counters of one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStats {
    /// Its name.
    pub name: String,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Requests and bytes submitted to it, by [`Op::index`].
    pub by_op: [OpTotals; 2],
    /// Slices submitted to it.
    pub slices: u64,
}

impl PeerStats {
    /// Requests submitted to it, of either op.
    pub fn requests(&self) -> u64 {
        self.by_op.iter().map(|op| op.requests).sum()
    }

    /// Bytes submitted to it, of either op.
    pub fn bytes(&self) -> u64 {
        self.by_op.iter().map(|op| op.bytes).sum()
    }

    /// Requests and bytes of `op`.
    pub fn op(&self, op: Op) -> OpTotals {
        self.by_op[op.index()]
    }
}

/// Requests of one op submitted to a peer, and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpTotals {
    /// Requests (transfers) submitted.
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// An engine's counters; cheap to read (atomics only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineStats {
    /// Per rail.
    pub rails: Vec<RailStats>,
    /// Per peer submitted to.
    pub peers: Vec<PeerStats>,
    /// The control plane's (reconnects, handshakes, circuits, notifications…).
    pub control: ControlStats,
    /// Every endpoint that exists now.
    pub endpoints: Vec<EndpointStats>,
}

/// One endpoint (a peer on a rail) as it is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointStats {
    /// The peer's name.
    pub peer: String,
    /// The peer's incarnation.
    pub incarnation: Incarnation,
    /// The rail's name.
    pub rail: String,
    /// The endpoint's id.
    pub endpoint: u64,
    /// Its state.
    pub phase: Phase,
    /// Its queue pair was freed while it was idle; the next transfer connects a new one.
    pub parked: bool,
}

/// What an engine counts per peer.
#[derive(Debug, Default)]
pub(crate) struct PeerCounters {
    pub(crate) name: Mutex<String>,
    /// Requests and bytes, by [`Op::index`].
    pub(crate) requests: [AtomicU64; 2],
    pub(crate) bytes: [AtomicU64; 2],
    pub(crate) slices: AtomicU64,
}

/// The counters of every peer the engine submitted to, by incarnation.
pub(crate) type PeerTable = Mutex<HashMap<Incarnation, Arc<PeerCounters>>>;

/// Every peer's counters in `table`, by name.
pub(crate) fn peer_stats(table: &PeerTable) -> Vec<PeerStats> {
    let table = table.lock().unwrap_or_else(PoisonError::into_inner);
    let mut stats: Vec<PeerStats> = table
        .iter()
        .map(|(incarnation, counters)| PeerStats {
            name: counters
                .name
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            incarnation: *incarnation,
            by_op: std::array::from_fn(|op| OpTotals {
                requests: counters.requests[op].load(Ordering::Relaxed),
                bytes: counters.bytes[op].load(Ordering::Relaxed),
            }),
            slices: counters.slices.load(Ordering::Relaxed),
        })
        .collect();
    stats.sort_by(|a, b| a.name.cmp(&b.name));
    stats
}
