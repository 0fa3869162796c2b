//! What the control plane needs from a rail's fabric to connect queue pairs — create one,
//! connect it to the peer's side, hand it to the poller — and the soft and verbs fabrics'
//! answers.

use std::sync::Arc;

use railyard_dataplane::fabric::soft::{SoftAttachment, SoftDevice, SoftQp};
use railyard_dataplane::fabric::verbs::VerbsRail;
use railyard_dataplane::fabric::verbs::ffi::{PreparedQp, QueuePair};
use railyard_dataplane::fabric::{Access, QpInfo};
use railyard_dataplane::{EndpointId, Epoch};

use crate::descriptor::{RailDescriptor, fabric};
use crate::wire::QpSide;

/// A rail's fabric, as the control thread drives it. Never touches a queue pair the poller
/// already owns: `stage` hands it over and that is the end of the control plane's part.
/// Set-up is a typestate: a created queue pair ([`Self::Qp`]) becomes a connected one
/// ([`Self::Connected`]).
pub trait RailFabric: Send + Sync + 'static {
    /// A queue pair in INIT.
    type Qp: Send + 'static;
    /// A queue pair in RTS, not yet handed over.
    type Connected: Send + 'static;

    /// A new queue pair in INIT, and what the peer needs to connect to it.
    ///
    /// # Errors
    /// Why the fabric could not make one.
    fn create_qp(&self) -> Result<(Self::Qp, QpSide), String>;

    /// A new queue pair in INIT for the target's side of a connection, ready to take
    /// WRITE_WITH_IMM immediates once connected ([`Self::take_immediates`]).
    ///
    /// # Errors
    /// Why the fabric could not make one.
    fn create_target_qp(&self) -> Result<(Self::Qp, QpSide), String>;

    /// Appends the immediates that arrived on a target's connected queue pair since the
    /// last call to `out`, oldest first, and re-arms its receives.
    ///
    /// # Errors
    /// Why it cannot take any (the queue pair is in error).
    fn take_immediates(&self, qp: &mut Self::Connected, out: &mut Vec<u32>) -> Result<(), String>;

    /// Connects `qp` (INIT → RTR → RTS) to the peer's `remote` side.
    ///
    /// # Errors
    /// Why it could not connect (malformed side, unreachable peer).
    fn connect_qp(&self, qp: Self::Qp, remote: &QpSide) -> Result<Self::Connected, String>;

    /// Hands a connected queue pair to the rail's poller: its next connect for `endpoint` at
    /// `epoch` adopts it.
    ///
    /// # Errors
    /// When the fabric refuses it.
    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: Self::Connected) -> Result<(), String>;

    /// How the rail appears in this process's segment descriptor.
    fn describe(&self) -> RailDescriptor;
}

impl RailFabric for SoftDevice {
    type Qp = SoftQp;
    type Connected = SoftQp;

    fn create_qp(&self) -> Result<(SoftQp, QpSide), String> {
        // Access is governed per registration; the queue pair itself allows everything.
        let mut qp = SoftDevice::create_qp(self, Access::ALL).map_err(|e| e.to_string())?;
        qp.modify_to_init().map_err(|e| e.to_string())?;
        let side = QpSide {
            info: qp.info(),
            attachment: qp.attachment().encode().to_vec(),
        };
        Ok((qp, side))
    }

    fn create_target_qp(&self) -> Result<(SoftQp, QpSide), String> {
        // Every soft queue pair has its inbox.
        RailFabric::create_qp(self)
    }

    fn take_immediates(&self, qp: &mut SoftQp, out: &mut Vec<u32>) -> Result<(), String> {
        qp.take_immediates(out);
        Ok(())
    }

    fn connect_qp(&self, mut qp: SoftQp, remote: &QpSide) -> Result<SoftQp, String> {
        let attachment = SoftAttachment::decode(&remote.attachment)?;
        qp.connect(&remote.info, &attachment)
            .map_err(|e| e.to_string())?;
        Ok(qp)
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: SoftQp) -> Result<(), String> {
        SoftDevice::stage(self, endpoint, epoch, qp).map_err(|e| e.to_string())
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: self.name().to_string(),
            fabric: fabric::SOFT,
        }
    }
}

impl RailFabric for Arc<VerbsRail> {
    type Qp = PreparedQp;
    type Connected = QueuePair;

    fn create_qp(&self) -> Result<(PreparedQp, QpSide), String> {
        // A random first PSN per queue pair, as verbs expects.
        let psn = crate::plane::random_u64() as u32;
        let (qp, info) = VerbsRail::create_qp(self, psn).map_err(|e| e.to_string())?;
        Ok((qp, verbs_side(info)))
    }

    fn create_target_qp(&self) -> Result<(PreparedQp, QpSide), String> {
        let psn = crate::plane::random_u64() as u32;
        let (qp, info) = VerbsRail::create_target_qp(self, psn).map_err(|e| e.to_string())?;
        Ok((qp, verbs_side(info)))
    }

    fn take_immediates(&self, qp: &mut QueuePair, out: &mut Vec<u32>) -> Result<(), String> {
        qp.take_immediates(out).map_err(|e| e.to_string())
    }

    fn connect_qp(&self, qp: PreparedQp, remote: &QpSide) -> Result<QueuePair, String> {
        self.connect(qp, &remote.info).map_err(|e| e.to_string())
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: QueuePair) -> Result<(), String> {
        VerbsRail::stage(self, endpoint, epoch, qp);
        Ok(())
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: self.name().to_string(),
            fabric: fabric::VERBS,
        }
    }
}

fn verbs_side(info: QpInfo) -> QpSide {
    QpSide {
        info,
        attachment: Vec::new(),
    }
}
