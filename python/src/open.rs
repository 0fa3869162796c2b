//! What the binding keeps beside an open engine (its submitter pool and the regions it
//! allocated or fenced) and how it opens a peer and submits transfers to it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use railyard_engine::dataplane::Batch as NativeBatch;
use railyard_engine::{
    Engine as NativeEngine, Peer, RawTransfer, Region, SubmitterPool, TransferError,
};

use crate::errors::Failure;

/// An open engine and what the binding keeps beside it.
pub(crate) struct Open {
    pub(crate) engine: NativeEngine,
    pub(crate) submitters: SubmitterPool,
    /// Regions `alloc` made, by address (`free` takes them back). A region stays here until
    /// its deregistration returned `Ok`, so a `free` refused with `Busy` (or a rail's
    /// refusal to withdraw it) can be retried.
    pub(crate) allocated: Mutex<HashMap<u64, Region>>,
    /// Regions the caller registered whose deregistration returned `Busy` or `Withdraw`
    /// (a rail refused), by address: the
    /// engine keeps them withdrawn but no longer lists them, so a later `deregister` of the
    /// address finds them here and waits for them again.
    pub(crate) fenced: Mutex<HashMap<u64, Region>>,
}

impl Open {
    pub(crate) fn peer(&self, session_id: &str) -> Result<Peer, Failure> {
        self.engine.peer(session_id).map_err(|error| Failure {
            peer: session_id.to_string(),
            reason: error.to_string(),
            ..Failure::default()
        })
    }

    /// Submits `transfers` to `session_id`, to be done by `deadline` (opening the peer
    /// counts against it), with `notify` sent once all of them are done.
    pub(crate) fn submit(
        &self,
        session_id: &str,
        transfers: &[RawTransfer],
        notify: Option<Vec<u8>>,
        deadline: Instant,
    ) -> Result<(NativeBatch, Peer), Failure> {
        let peer = self.peer(session_id)?;
        if Instant::now() >= deadline {
            return Err(Failure {
                peer: session_id.to_string(),
                reason: "the deadline passed while the peer was being opened".to_string(),
                ..Failure::default()
            });
        }
        let refused = |error: TransferError| {
            let index = match error {
                TransferError::LocalUnregistered { transfer, .. }
                | TransferError::RemoteRange { transfer, .. }
                | TransferError::Empty { transfer }
                | TransferError::LocalRange { transfer, .. }
                | TransferError::UnknownRegion { transfer, .. } => Some(transfer),
                _ => None,
            };
            Failure {
                peer: session_id.to_string(),
                reason: error.to_string(),
                index,
                range: index
                    .and_then(|index| transfers.get(index))
                    .map(|t| (t.local_addr, t.remote_addr, t.len)),
                ..Failure::default()
            }
        };
        let batch = self
            .submitters
            .with(|submitter| submitter.submit_raw(&peer, transfers, deadline))
            .map_err(refused)?
            .map_err(refused)?;
        if let Some(bytes) = notify {
            self.engine
                .notify_after(&peer, bytes, &batch)
                .map_err(|error| Failure {
                    peer: session_id.to_string(),
                    reason: format!("the notification cannot be sent: {error}"),
                    ..Failure::default()
                })?;
        }
        Ok((batch, peer))
    }
}
