//! [`HostFabric`]: one rail's soft and TCP fabrics driven by one poller, so each peer can
//! be reached the cheapest way — the soft fabric for a process on this host, TCP for one on
//! another — with one registration (the TCP device serves the soft device's region table)
//! and one completion stream. Queue pairs are told apart by number
//! ([`tcp::is_tcp_qp`](super::tcp::is_tcp_qp)).

use super::soft::{SoftDevice, SoftFabric};
use super::tcp::{TcpDevice, TcpFabric, is_tcp_qp};
use super::{
    AsyncEvent, Fabric, FabricError, FabricLimits, PostError, QpNum, WorkCompletion, WorkRequest,
};
use crate::{EndpointId, Epoch};

/// A rail's soft and TCP fabrics for its poller. See the module docs.
#[derive(Debug)]
pub struct HostFabric {
    soft: SoftFabric,
    tcp: TcpFabric,
    tcp_device: TcpDevice,
}

impl HostFabric {
    /// The fabrics of `soft` and of `tcp` (opened on `soft`).
    ///
    /// # Errors
    /// When the TCP fabric's epoll instance cannot be created.
    pub fn new(soft: &SoftDevice, tcp: &TcpDevice) -> std::io::Result<Self> {
        Ok(Self {
            soft: soft.fabric(),
            tcp: tcp.fabric()?,
            tcp_device: tcp.clone(),
        })
    }
}

impl Fabric for HostFabric {
    /// Adopts whichever fabric's queue pair the control plane staged for `endpoint` at
    /// `epoch`.
    fn connect(&mut self, endpoint: EndpointId, epoch: Epoch) -> Result<QpNum, FabricError> {
        if self.tcp_device.has_staged(endpoint, epoch) {
            self.tcp.connect(endpoint, epoch)
        } else {
            self.soft.connect(endpoint, epoch)
        }
    }

    fn post(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Result<(), PostError> {
        if is_tcp_qp(qp) {
            self.tcp.post(qp, requests)
        } else {
            self.soft.post(qp, requests)
        }
    }

    fn poll(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let soft = self.soft.poll(out, max);
        soft + self.tcp.poll(out, max - soft)
    }

    fn retire(&mut self, qp: QpNum) {
        if is_tcp_qp(qp) {
            self.tcp.retire(qp);
        } else {
            self.soft.retire(qp);
        }
    }

    fn abandon(&mut self, qp: QpNum) -> bool {
        if is_tcp_qp(qp) {
            self.tcp.abandon(qp)
        } else {
            self.soft.abandon(qp)
        }
    }

    fn serve(&mut self) -> bool {
        self.tcp.serve()
    }

    fn serving(&self) -> bool {
        self.tcp.serving()
    }

    fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.soft.poll_event().or_else(|| self.tcp.poll_event())
    }

    /// The tighter of the two: a queue pair may be of either.
    fn limits(&self) -> FabricLimits {
        let (soft, tcp) = (self.soft.limits(), self.tcp.limits());
        FabricLimits {
            send_queue: soft.send_queue.min(tcp.send_queue),
            completion_queue: soft.completion_queue.min(tcp.completion_queue),
        }
    }
}
