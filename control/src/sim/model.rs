//! The model of a rail's poller: per endpoint, the queue pair it has (epoch and the remote
//! queue pair), its circuit, and the model slices waiting for or in flight on it. The rules
//! that move them live in the world (`world.rs`), which owns the clock and the network.

use std::collections::{BTreeMap, VecDeque};

use railyard_dataplane::EndpointId;

use crate::endpoint::Incarnation;

/// One endpoint as a poller holds it.
pub(super) struct ModelEndpoint {
    /// The incarnation its key names.
    pub(super) peer: Incarnation,
    /// The epoch of its queue pair (0: none yet).
    pub(super) epoch: u64,
    /// The remote queue pair its queue pair is connected to (none: down).
    pub(super) remote: Option<u32>,
    pub(super) circuit_open: bool,
    pub(super) retired: bool,
    /// A success was reported for the current queue pair (Confirmed sent).
    pub(super) confirmed: bool,
    /// A transport failure was reported for the current queue pair.
    pub(super) failed: bool,
    /// Its queue pair was freed while idle; waiting for a newer epoch.
    pub(super) parked: bool,
    /// Wanted was reported since it was parked.
    pub(super) wanted: bool,
    /// Requests waiting for a queue pair.
    pub(super) backlog: VecDeque<u64>,
    /// Requests posted on the current queue pair.
    pub(super) in_flight: Vec<u64>,
}

impl ModelEndpoint {
    pub(super) fn new(peer: Incarnation) -> Self {
        Self {
            peer,
            epoch: 0,
            remote: None,
            circuit_open: false,
            retired: false,
            confirmed: false,
            failed: false,
            parked: false,
            wanted: false,
            backlog: VecDeque::new(),
            in_flight: Vec::new(),
        }
    }
}

/// One rail's poller.
#[derive(Default)]
pub(super) struct ModelRail {
    pub(super) endpoints: BTreeMap<EndpointId, ModelEndpoint>,
    /// The newest epoch each endpoint id has had, across its occupants.
    pub(super) newest_epoch: BTreeMap<EndpointId, u64>,
}

/// A model transfer: one slice.
pub(super) struct Request {
    /// The process that started it, and its generation.
    pub(super) node: (usize, u32),
    pub(super) rail: u16,
    pub(super) endpoint: EndpointId,
    /// The epoch it is prepared for.
    pub(super) epoch: u64,
    /// Its deadline (µs).
    pub(super) deadline: u64,
}
