//! The fence an engine puts up against one peer ([`Engine::revoke`]), and how long it waits
//! for the peer's queue pairs to fall quiet.

use std::sync::PoisonError;
use std::time::{Duration, Instant};

use railyard_control::Incarnation;

use super::error::RevokeError;
use super::state::Engine;

/// Longest [`Engine::revoke`] waits for pollers and peers to let go of a peer's queue pairs.
pub const REVOKE_WAIT: Duration = Duration::from_secs(1);

impl Engine {
    /// The fence a target uses when it gives up on an initiator itself (its own timeout, or
    /// before handing KV slots that peer was writing to another sequence).
    ///
    /// **After it returns `Ok`, no write or read that `peer` submitted before that moment
    /// ever touches this engine's memory** — not after a reconnect, not after a retry. It
    /// takes every queue pair `peer` connected to this engine out of service on every rail
    /// and returns only when nothing still buffered or in flight on them can land — the TCP
    /// fabric's pollers have closed the connections (discarding what was buffered), soft
    /// peers have left any copy they began and are refused from then on — and it bumps this
    /// engine's fence generation for `peer`, which every later handshake tells it: the peer
    /// reconnects on its own, as after any failure, and fails everything it had prepared
    /// before that handshake with `Revoked` instead of retrying it. Its new work lands as
    /// usual. `peer` is an initiator's incarnation: a [`Peer`]'s, or a [`Notification`]'s
    /// sender. Waits at most [`REVOKE_WAIT`].
    ///
    /// # Errors
    /// [`RevokeError::Busy`] when a poller or peer process did not let go in time: the queue
    /// pairs stay out of service, and the next `revoke` of the same peer waits for them
    /// again (the fence holds only once a call returns `Ok`); [`RevokeError::Stopped`] or
    /// [`RevokeError::Unresponsive`] when the control plane has stopped or is stuck;
    /// [`RevokeError::Unsupported`] on libfabric, which cannot fence one peer (nothing is
    /// changed: deregister the memory instead).
    ///
    /// [`Peer`]: crate::Peer
    /// [`Notification`]: railyard_control::Notification
    pub fn revoke(&self, peer: impl Into<Incarnation>) -> Result<(), RevokeError> {
        if let Some(fabric) = self.inner.rails.fence_unsupported() {
            return Err(RevokeError::Unsupported { fabric });
        }
        let peer = peer.into();
        let mut revoked = self
            .inner
            .control
            .revoke(peer)
            .map_err(|error| match error {
                railyard_control::ControlError::Unresponsive => RevokeError::Unresponsive,
                _ => RevokeError::Stopped,
            })?;
        let mut revoking = self
            .inner
            .revoking
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let earlier = std::mem::take(&mut *revoking);
        let (mine, others): (Vec<_>, Vec<_>) =
            earlier.into_iter().partition(|(owner, _)| *owner == peer);
        *revoking = others;
        drop(revoking);
        revoked.extend(mine.into_iter().map(|(_, revocation)| revocation));
        let deadline = Instant::now() + REVOKE_WAIT;
        let busy: Vec<_> = revoked
            .into_iter()
            .filter(|revocation| !revocation.wait(deadline))
            .collect();
        if busy.is_empty() {
            return Ok(());
        }
        let queue_pairs = busy.len();
        self.inner
            .revoking
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(busy.into_iter().map(|revocation| (peer, revocation)));
        Err(RevokeError::Busy {
            peer,
            queue_pairs,
            waited: REVOKE_WAIT,
        })
    }
}
