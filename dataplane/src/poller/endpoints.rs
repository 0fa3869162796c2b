//! How a poller's endpoints follow the owner's commands: connecting a queue pair, moving to a
//! newer epoch, retiring, opening and closing the circuit, and taking a queue pair out of
//! service.

use std::collections::VecDeque;

use super::credits::Credits;
use super::messages::{Command, Event};
use super::shared::Control;
use super::state::{Endpoint, Link, Poller, endpoint_mut};
use crate::batch::FailReason;
use crate::fabric::{Fabric, FabricError, QpNum};
use crate::sabotage::Protection;
use crate::{EndpointId, Epoch};

impl<F: Fabric> Poller<F> {
    /// Applies queued commands. Returns (did work, shutdown requested).
    pub(super) fn apply_control(&mut self) -> (bool, bool) {
        let mut busy = false;
        while let Some(control) = self.control.pop() {
            busy = true;
            match control {
                Control::AddSubmitter(ring) => self.submissions.push(ring),
                Control::Command(Command::Shutdown) => return (true, true),
                Control::Command(Command::AddEndpoint { endpoint, epoch }) => {
                    if self
                        .endpoint(endpoint)
                        .is_some_and(|e| e.link != Link::Retired)
                    {
                        self.bump_epoch(endpoint, epoch);
                    } else {
                        self.add_endpoint(endpoint, epoch);
                    }
                }
                Control::Command(Command::BumpEpoch { endpoint, epoch }) => {
                    self.bump_epoch(endpoint, epoch);
                }
                Control::Command(Command::RetireEndpoint { endpoint, reason }) => {
                    self.retire(endpoint, reason);
                }
                Control::Command(Command::Park { endpoint, epoch }) => self.park(endpoint, epoch),
                Control::Command(Command::SetCircuit { endpoint, open }) => {
                    self.set_circuit(endpoint, open);
                }
                Control::Command(Command::Unreachable { endpoint }) => {
                    self.set_circuit(endpoint, true);
                    let current = self.endpoint(endpoint).and_then(|e| match e.link {
                        Link::Up(qp) => Some(qp),
                        _ => None,
                    });
                    if let Some(qp) = current {
                        // Its flush finds the circuit open: PeerUnavailable.
                        self.take_down(endpoint, qp);
                    }
                }
            }
        }
        (busy, false)
    }

    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Link {
        match self.fabric.connect(endpoint, epoch) {
            Ok(qp) => Link::Up(qp),
            Err(error) => {
                let reason = match error {
                    FabricError::Connect { reason, .. } => reason,
                    other => other.to_string(),
                };
                self.emit(Event::ConnectFailed {
                    endpoint,
                    epoch,
                    reason,
                });
                Link::Down
            }
        }
    }

    fn add_endpoint(&mut self, id: EndpointId, epoch: Epoch) {
        let link = self.connect(id, epoch);
        let index = id.0 as usize;
        if self.endpoints.len() <= index {
            self.endpoints.resize_with(index + 1, || None);
        }
        let in_flight = self.endpoint(id).map_or(0, |e| e.in_flight);
        self.endpoints[index] = Some(Endpoint {
            epoch,
            link,
            backlog: VecDeque::new(),
            fresh_in_backlog: 0,
            in_flight,
            credits: Credits::default(),
            waiting: VecDeque::new(),
            listed: false,
            circuit_open: false,
            confirmed: false,
            retired_reason: FailReason::EndpointRetired,
            failed_by_work_request: None,
        });
    }

    fn bump_epoch(&mut self, id: EndpointId, epoch: Epoch) {
        let Some(current) = self.endpoint(id) else {
            return;
        };
        if current.link == Link::Retired || !epoch.is_newer_than(current.epoch) {
            return;
        }
        if let Link::Up(old) = current.link {
            self.fabric.retire(old);
        }
        let link = self.connect(id, epoch);
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        endpoint.epoch = epoch;
        endpoint.link = link;
        endpoint.confirmed = false;
        endpoint.credits.reset();
        // The backlog goes through the epoch rule again, ahead of newer work (and the
        // slices that waited for the old queue pair's credits ahead of it).
        let backlog = std::mem::take(&mut endpoint.backlog);
        endpoint.fresh_in_backlog = 0;
        for slice in backlog.into_iter().rev() {
            self.ready.push_front(slice);
        }
        self.requeue_waiting(id);
    }

    /// The slices of `id` that waited for credits of a queue pair it no longer has go
    /// through the epoch rule again, ahead of newer work.
    fn requeue_waiting(&mut self, id: EndpointId) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        let waiting = std::mem::take(&mut endpoint.waiting);
        for slice in waiting.into_iter().rev() {
            self.ready.push_front(slice);
        }
    }

    fn retire(&mut self, id: EndpointId, reason: FailReason) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            // Never added (retired while it waited for room or a handshake): nothing of it
            // is here, so it is drained, and its owner may reuse the id.
            return self.emit(Event::EndpointDrained { endpoint: id });
        };
        if let Link::Up(qp) = endpoint.link {
            self.fabric.retire(qp);
        }
        endpoint.link = Link::Retired;
        endpoint.retired_reason = reason;
        endpoint.credits.reset();
        let mut backlog = std::mem::take(&mut endpoint.backlog);
        endpoint.fresh_in_backlog = 0;
        backlog.append(&mut endpoint.waiting);
        let drained = endpoint.in_flight == 0;
        for slice in backlog {
            self.fail(slice, reason);
        }
        if drained {
            self.emit(Event::EndpointDrained { endpoint: id });
        }
    }

    /// Frees the queue pair of `id` at `epoch` if nothing of the endpoint is queued, waiting
    /// or in flight: the one check that makes evicting an endpoint safe, made by the owner of
    /// its work.
    fn park(&mut self, id: EndpointId, epoch: Epoch) {
        let parked = match endpoint_mut(&mut self.endpoints, id) {
            Some(endpoint)
                if endpoint.epoch == epoch
                    && matches!(endpoint.link, Link::Up(_))
                    && (endpoint.is_idle()
                        || crate::sabotage::is_off(Protection::IdleEviction)) =>
            {
                let Link::Up(qp) = endpoint.link else {
                    return;
                };
                endpoint.link = Link::Parked { wanted: false };
                endpoint.credits.reset();
                Some(qp)
            }
            _ => None,
        };
        match parked {
            Some(qp) => {
                // Nothing is posted on it (unless sabotaged: then its work is flushed and
                // fails, which is what the idle check prevents).
                self.fabric.retire(qp);
                self.requeue_waiting(id);
                self.emit(Event::Parked {
                    endpoint: id,
                    epoch,
                });
            }
            None => self.emit(Event::ParkRefused {
                endpoint: id,
                epoch,
            }),
        }
    }

    fn set_circuit(&mut self, id: EndpointId, open: bool) {
        let Some(endpoint) = endpoint_mut(&mut self.endpoints, id) else {
            return;
        };
        endpoint.circuit_open = open;
        if open {
            let mut backlog = std::mem::take(&mut endpoint.backlog);
            endpoint.fresh_in_backlog = 0;
            backlog.append(&mut endpoint.waiting);
            for slice in backlog {
                self.fail(slice, FailReason::PeerUnavailable);
            }
        }
    }

    /// Marks endpoint `id` down and retires `qp` when `qp` is its current queue pair;
    /// returns the endpoint's epoch then. `None` for a queue pair already replaced.
    pub(super) fn take_down(&mut self, id: EndpointId, qp: QpNum) -> Option<Epoch> {
        let endpoint = endpoint_mut(&mut self.endpoints, id)?;
        if endpoint.link != Link::Up(qp) {
            return None;
        }
        endpoint.link = Link::Down;
        endpoint.credits.reset();
        let epoch = endpoint.epoch;
        self.fabric.retire(qp);
        // What waited for its credits waits for the next queue pair instead.
        self.requeue_waiting(id);
        Some(epoch)
    }
}
