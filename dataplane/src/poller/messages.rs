//! What the owner of endpoints and a poller tell each other: the commands a poller applies
//! and the events it reports back.

use crate::batch::FailReason;
use crate::fabric::WcStatus;
use crate::{EndpointId, Epoch};

/// A command to a poller. Commands are applied between posts, in order.
#[derive(Debug)]
#[non_exhaustive]
pub enum Command {
    /// Connect a queue pair to `endpoint` at `epoch`. For an endpoint the poller already has,
    /// this is [`Command::BumpEpoch`].
    AddEndpoint {
        /// The endpoint.
        endpoint: EndpointId,
        /// Its epoch.
        epoch: Epoch,
    },
    /// Replace the endpoint's queue pair by a new one at `epoch` (retiring the old one,
    /// whose outstanding work is flushed and retried at `epoch`). Ignored unless `epoch` is
    /// newer than the endpoint's: a repeated command changes nothing.
    BumpEpoch {
        /// The endpoint.
        endpoint: EndpointId,
        /// The new epoch.
        epoch: Epoch,
    },
    /// Retire the endpoint: flush its queue pair, fail its backlog and everything later sent
    /// to it with `reason` (usually `EndpointRetired`; `PeerRestarted` when the peer came
    /// back as a new incarnation), and report [`Event::EndpointDrained`] once nothing of it
    /// is in flight.
    RetireEndpoint {
        /// The endpoint.
        endpoint: EndpointId,
        /// What its slices fail with.
        reason: FailReason,
    },
    /// Open or close the endpoint's circuit. While it is open its backlog and every slice
    /// sent to it fail at once with `PeerUnavailable`, so a dead peer never holds work
    /// until deadlines.
    SetCircuit {
        /// The endpoint.
        endpoint: EndpointId,
        /// Open (fail fast) or closed (carry traffic).
        open: bool,
    },
    /// The peer stopped answering: open the circuit (as `SetCircuit`) and take the current
    /// queue pair out of service, so that what is posted on it is flushed and fails with
    /// `PeerUnavailable` instead of waiting for its deadline.
    Unreachable {
        /// The endpoint.
        endpoint: EndpointId,
    },
    /// Free the endpoint's queue pair if the endpoint is idle — nothing of it queued,
    /// waiting for credits or in flight — and still at `epoch`: the queue pair is destroyed
    /// (it carries nothing, so nothing fails) and the endpoint is parked; otherwise nothing
    /// changes. Either way the poller answers ([`Event::Parked`] or
    /// [`Event::ParkRefused`]). A parked endpoint keeps what is sent to it in its backlog
    /// and reports [`Event::Wanted`] once, until a newer epoch's queue pair arrives.
    Park {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the queue pair to free.
        epoch: Epoch,
    },
    /// Resolve everything (in-flight work is flushed; queued work fails with `Shutdown`) and
    /// stop the thread.
    Shutdown,
}

/// What a poller reports to the owner of endpoints.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A queue pair went to ERR; the endpoint is down until a newer epoch arrives.
    QpFailed {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the failed queue pair.
        epoch: Epoch,
        /// The completion status that failed it (work-request errors are the slice's fault,
        /// transport errors the peer's).
        status: WcStatus,
    },
    /// The fabric reported the queue pair fatal (IBV_EVENT_QP_FATAL): it is in ERR, its work
    /// is flushed and retried at a newer epoch; the endpoint is down until then. A transport
    /// failure, charged to the peer.
    QpFatal {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the failed queue pair.
        epoch: Epoch,
    },
    /// Connecting a queue pair failed; the endpoint is down.
    ConnectFailed {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
        /// The fabric's reason.
        reason: String,
    },
    /// The first successful completion on the endpoint's queue pair at `epoch`: the peer
    /// answers on it (what closes a half-open circuit and ends a flap window).
    Confirmed {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the queue pair.
        epoch: Epoch,
    },
    /// A retired endpoint has nothing left in flight.
    EndpointDrained {
        /// The endpoint.
        endpoint: EndpointId,
    },
    /// The endpoint was idle: its queue pair of `epoch` is gone and it is parked
    /// ([`Command::Park`]).
    Parked {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch of the queue pair freed.
        epoch: Epoch,
    },
    /// The endpoint was busy (or no longer at `epoch`): it keeps its queue pair.
    ParkRefused {
        /// The endpoint.
        endpoint: EndpointId,
        /// The epoch asked for.
        epoch: Epoch,
    },
    /// A slice arrived for a parked endpoint: it waits in the backlog for a queue pair at a
    /// newer epoch.
    Wanted {
        /// The endpoint.
        endpoint: EndpointId,
    },
}

impl Event {
    /// The endpoint it is about.
    pub fn endpoint(&self) -> EndpointId {
        match *self {
            Self::QpFailed { endpoint, .. }
            | Self::QpFatal { endpoint, .. }
            | Self::ConnectFailed { endpoint, .. }
            | Self::Confirmed { endpoint, .. }
            | Self::EndpointDrained { endpoint }
            | Self::Parked { endpoint, .. }
            | Self::ParkRefused { endpoint, .. }
            | Self::Wanted { endpoint } => endpoint,
        }
    }
}
