//! The simulated rails' fabric: queue pairs are numbers in one registry shared by every
//! simulated process, which records who owns each one and what each process staged for its
//! pollers, so the model pollers can check that a queue pair reaches the incarnation its
//! endpoint names.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use railyard_dataplane::fabric::QpInfo;
use railyard_dataplane::{EndpointId, Epoch};

use crate::descriptor::RailDescriptor;
use crate::endpoint::Incarnation;
use crate::rail::{PeerLink, RailFabric, Revocation};
use crate::wire::QpSide;

/// Every simulated queue pair: its owner, and what each process staged for its pollers.
#[derive(Default)]
pub(super) struct Registry {
    next_qp: u32,
    /// The incarnation that created each queue pair.
    pub(super) owner: BTreeMap<u32, Incarnation>,
    /// (staging incarnation, rail, endpoint, epoch) → the remote queue pair it is connected
    /// to; the model poller takes it when the core's AddEndpoint arrives.
    pub(super) staged: BTreeMap<(Incarnation, u16, EndpointId, u64), u32>,
    /// Queue pairs their owner revoked or retired: nothing posted to them executes.
    pub(super) revoked: BTreeMap<u32, ()>,
}

/// One rail of one simulated process.
#[derive(Clone)]
pub(super) struct SimFabric {
    pub(super) registry: Arc<Mutex<Registry>>,
    pub(super) owner: Incarnation,
    pub(super) rail: u16,
}

/// The registry, locked (the simulation runs on one thread; the lock is never contended).
pub(super) fn lock(registry: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    registry.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SimFabric {
    fn new_qp(&self) -> (u32, QpSide) {
        let mut registry = lock(&self.registry);
        registry.next_qp += 1;
        let qp_num = registry.next_qp;
        registry.owner.insert(qp_num, self.owner);
        let side = QpSide {
            info: QpInfo {
                qp_num,
                lid: 0,
                gid: [0; 16],
                psn: 0,
                path_mtu: 4096,
            },
            attachment: Vec::new(),
        };
        (qp_num, side)
    }
}

impl RailFabric for SimFabric {
    type Qp = u32;
    /// (local queue pair, remote queue pair).
    type Connected = (u32, u32);

    fn create_qp(&self, _link: &PeerLink) -> Result<(u32, QpSide), String> {
        Ok(self.new_qp())
    }

    fn create_target_qp(
        &self,
        _link: &PeerLink,
        _initiator: &QpSide,
    ) -> Result<(u32, QpSide), String> {
        Ok(self.new_qp())
    }

    fn take_immediates(&self, _qp: &mut (u32, u32), _out: &mut Vec<u32>) -> Result<(), String> {
        Ok(())
    }

    fn connect_qp(&self, qp: u32, remote: &QpSide) -> Result<(u32, u32), String> {
        Ok((qp, remote.info.qp_num))
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: (u32, u32)) -> Result<(), String> {
        lock(&self.registry)
            .staged
            .insert((self.owner, self.rail, endpoint, epoch.get()), qp.1);
        Ok(())
    }

    fn revoke(&self, qp: (u32, u32)) -> Revocation {
        lock(&self.registry).revoked.insert(qp.0, ());
        Revocation::done()
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: format!("sim{}", self.rail),
            fabric: 0,
            tcp_port: 0,
            address: Vec::new(),
        }
    }
}
