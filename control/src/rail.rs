//! What the control plane needs from a rail's fabric to connect queue pairs — create one,
//! connect it to the peer's side, hand it to the poller — and the soft fabric's answer.
//! The verbs fabric will answer the same three questions.

use railyard_dataplane::fabric::Access;
use railyard_dataplane::fabric::soft::{SoftAttachment, SoftDevice, SoftQp};
use railyard_dataplane::{EndpointId, Epoch};

use crate::wire::QpSide;

/// A rail's fabric, as the control thread drives it. Never touches a queue pair the poller
/// already owns: `stage` hands it over and that is the end of the control plane's part.
pub trait RailFabric: Send + Sync + 'static {
    /// A queue pair before it is handed over.
    type Qp: Send + 'static;

    /// A new queue pair in INIT, and what the peer needs to connect to it.
    ///
    /// # Errors
    /// Why the fabric could not make one.
    fn create_qp(&self) -> Result<(Self::Qp, QpSide), String>;

    /// Connects `qp` (INIT → RTR → RTS) to the peer's `remote` side.
    ///
    /// # Errors
    /// Why it could not connect (malformed side, unreachable peer).
    fn connect_qp(&self, qp: &mut Self::Qp, remote: &QpSide) -> Result<(), String>;

    /// Hands a connected queue pair to the rail's poller: its next connect for `endpoint` at
    /// `epoch` adopts it.
    ///
    /// # Errors
    /// When the queue pair is not connected.
    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: Self::Qp) -> Result<(), String>;
}

impl RailFabric for SoftDevice {
    type Qp = SoftQp;

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

    fn connect_qp(&self, qp: &mut SoftQp, remote: &QpSide) -> Result<(), String> {
        let attachment = SoftAttachment::decode(&remote.attachment)?;
        qp.connect(&remote.info, &attachment)
            .map_err(|e| e.to_string())
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: SoftQp) -> Result<(), String> {
        SoftDevice::stage(self, endpoint, epoch, qp).map_err(|e| e.to_string())
    }
}
