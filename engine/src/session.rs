//! Addressing the way inference servers do: peers by their `host:port` session string
//! (opened once, cached, reopened when the process there was replaced), transfers named by
//! raw addresses (each local range resolved to the registered region holding it), and a
//! pool of submitters that any thread may borrow.
//!
//! The engine owns the session table: one slot per session string, each with its own lock,
//! so that a slow open of one peer never holds up submissions to another. A submitter owns
//! its index of the local regions, rebuilt only when the engine's regions change.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use railyard_dataplane::Batch;

use super::error::{PeerError, TransferError};
use super::op::Op;
use super::peer::{Peer, Session};
use super::state::Engine;
use super::transfer::{EngineSubmitter, Transfer};

/// How long a failed open is the answer for a session: threads that were waiting for it
/// get the same error at once instead of each waiting out an open of its own.
pub const FAILED_OPEN_KEPT: Duration = Duration::from_millis(500);

/// One transfer named by raw addresses: a local range inside one registered region and a
/// remote range inside one region of the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawTransfer {
    /// Which way.
    pub op: Op,
    /// Local start address.
    pub local_addr: u64,
    /// Remote start address.
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
}

impl Engine {
    /// The peer at session `target` (`host:port`, or a name with a directory): opened on
    /// first use and kept; opened again when the one kept was retired (the process there
    /// restarted, died, or was revoked). Threads asking for different sessions do not wait
    /// for each other; threads asking for one that failed to open get that failure for
    /// [`FAILED_OPEN_KEPT`] instead of opening it again one after another.
    ///
    /// # Errors
    /// As [`Engine::open`].
    pub fn peer(&self, target: &str) -> Result<Peer, PeerError> {
        let slot = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(target.to_string())
            .or_default()
            .clone();
        let mut session = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(peer) = session.peer.as_ref().filter(|peer| !peer.is_retired()) {
            return Ok(peer.clone());
        }
        if let Some((at, reason)) = &session.failed {
            if at.elapsed() < FAILED_OPEN_KEPT {
                return Err(PeerError::RecentlyFailed {
                    target: target.to_string(),
                    reason: reason.clone(),
                });
            }
        }
        match self.open(target) {
            Ok(peer) => {
                *session = Session {
                    peer: Some(peer.clone()),
                    failed: None,
                };
                Ok(peer)
            }
            Err(error) => {
                session.failed = Some((Instant::now(), error.to_string()));
                Err(error)
            }
        }
    }
}

impl EngineSubmitter {
    /// Submits `transfers`, named by raw addresses, to `peer` as one batch (request `i` is
    /// transfer `i`), to be done by `deadline`. Each local range must lie inside one
    /// registered region; otherwise nothing is queued. A remote range the peer's descriptor
    /// does not hold makes the submitter fetch the descriptor again once (up to
    /// [`super::REFRESH_WAIT`]) before it refuses.
    ///
    /// # Errors
    /// [`TransferError::LocalUnregistered`] for a local range no region holds; otherwise as
    /// [`Self::submit_by`].
    pub fn submit_raw(
        &mut self,
        peer: &Peer,
        transfers: &[RawTransfer],
        deadline: Instant,
    ) -> Result<Batch, TransferError> {
        let mut resolved = std::mem::take(&mut self.resolved);
        resolved.clear();
        let result = self
            .resolve(transfers, &mut resolved)
            .and_then(|()| self.submit_by(peer, &resolved, deadline));
        self.resolved = resolved;
        result
    }

    /// Each raw transfer as a [`Transfer`] of the region holding its local range.
    fn resolve(
        &mut self,
        transfers: &[RawTransfer],
        resolved: &mut Vec<Transfer>,
    ) -> Result<(), TransferError> {
        for (index, raw) in transfers.iter().enumerate() {
            if raw.len == 0 {
                return Err(TransferError::Empty { transfer: index });
            }
            let region = self
                .region_index
                .find(&self.engine, raw.local_addr, raw.len)
                .ok_or(TransferError::LocalUnregistered {
                    transfer: index,
                    addr: raw.local_addr,
                    len: raw.len,
                })?;
            resolved.push(Transfer {
                op: raw.op,
                local: region,
                local_offset: raw.local_addr - region.addr,
                remote_addr: raw.remote_addr,
                len: raw.len,
            });
        }
        Ok(())
    }
}

/// Most submitters a [`SubmitterPool`] keeps between uses.
pub const MAX_IDLE_SUBMITTERS: usize = 64;

/// Submitters for any thread: [`Self::with`] lends one (creating it when all are lent) and
/// takes it back, so the pool holds as many as threads submit at once (up to
/// [`MAX_IDLE_SUBMITTERS`] kept idle), and their rings to the pollers live until the pool
/// is dropped. (A submitter kept per thread instead would hold the engine until the thread
/// exits, so closing an engine could not stop it while a thread pool lives on.)
#[derive(Debug)]
pub struct SubmitterPool {
    engine: Engine,
    idle: Mutex<Vec<EngineSubmitter>>,
}

impl SubmitterPool {
    /// An empty pool for `engine`.
    pub fn new(engine: Engine) -> Self {
        Self {
            engine,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `work` with a submitter of the pool. At most [`MAX_IDLE_SUBMITTERS`] are kept
    /// between uses; one returned beyond that is dropped, its rings released.
    ///
    /// # Errors
    /// [`TransferError::PollerStopped`] when a new submitter cannot open its rings.
    pub fn with<R>(
        &self,
        work: impl FnOnce(&mut EngineSubmitter) -> R,
    ) -> Result<R, TransferError> {
        let lent = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut submitter = match lent {
            Some(submitter) => submitter,
            None => self.engine.submitter()?,
        };
        let result = work(&mut submitter);
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE_SUBMITTERS {
            idle.push(submitter);
        }
        Ok(result)
    }
}
