//! The link between a target queue pair's owner and whoever serves it: the flags each raises
//! for the other (the handle dropped, the serving closed) and the ring its immediates go by.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::ring::Producer;

/// What the control plane's target handle and the serving poller share.
#[derive(Debug, Default)]
pub(super) struct TargetShared {
    /// The handle was dropped: the poller closes the connection.
    pub(super) dropped: AtomicBool,
    /// Nothing serves the queue pair any more: its connection, if it had one, is closed
    /// (set by [`TargetLink`]'s drop).
    pub(super) closed: AtomicBool,
}

/// A target queue pair's serving end, held by whoever may serve it: the device's pending
/// table until the initiator's hello names it, then the connection the poller serves.
/// Dropping it acknowledges the close to the owner: nothing can serve the queue pair any
/// more (a served connection drops it only after its socket, see `Served`).
#[derive(Debug)]
pub(super) struct TargetLink {
    pub(super) shared: Arc<TargetShared>,
    pub(super) immediates: Producer<u32>,
}

impl Drop for TargetLink {
    fn drop(&mut self) {
        // Release: whatever the poller did to the queue pair's memory happens before an
        // owner's acquiring `TargetClosed::wait` sees this.
        self.shared.closed.store(true, Ordering::Release);
    }
}
