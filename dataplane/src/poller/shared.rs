//! What the poller thread shares with its handle and its submitters: counters, the parking
//! and stopping flags, the rings a stopped poller leaves behind, rounds and local drains, and
//! what travels on the control ring.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::Thread;

use super::counters::Counters;
use super::messages::Command;
use crate::batch::FailReason;
use crate::quiesce::Rounds;
use crate::ring::Consumer;
use crate::slice::Slice;

/// What submitters and the handle share with the poller thread.
#[derive(Debug, Default)]
pub(crate) struct PollerShared {
    pub(super) counters: Counters,
    /// Set while the poller is (about to be) parked.
    pub(super) parked: AtomicBool,
    pub(super) thread: OnceLock<Thread>,
    /// Set once the poller stops reading its rings.
    pub(super) stopped: AtomicBool,
    /// Set by [`PollerHandle::shutdown`](super::PollerHandle::shutdown): stop, even if the
    /// command ring has no room.
    pub(super) stop_requested: AtomicBool,
    /// The rings of a stopped poller, for late pushes to be resolved.
    pub(super) orphans: Mutex<Orphans>,
    /// Rounds finished. See [`PollerHandle::quiesce`](super::PollerHandle::quiesce).
    pub(super) rounds: Rounds,
    /// Waits for local keys to fall out of use. See
    /// [`PollerHandle::drain_local`](super::PollerHandle::drain_local).
    pub(super) drains: Mutex<Vec<LocalDrain>>,
    /// How many `drains` there are: the poller looks at them only when there are some.
    pub(super) drains_pending: AtomicU64,
}

/// One [`PollerHandle::drain_local`](super::PollerHandle::drain_local) call, answered by the
/// poller.
#[derive(Debug)]
pub(super) struct LocalDrain {
    pub(super) lkeys: Vec<u32>,
    /// Set by the poller once no posted request goes through `lkeys`.
    pub(super) drained: Arc<AtomicBool>,
}

/// What a stopped poller leaves behind: its command ring (which may still bring a new
/// submission ring) and its submission rings.
#[derive(Default)]
pub(super) struct Orphans {
    pub(super) control: Option<Consumer<Control>>,
    pub(super) rings: Vec<Consumer<Slice>>,
}

impl Orphans {
    /// Resolves (`PollerGone`) every slice left in the rings.
    pub(super) fn resolve_leftovers(&mut self) {
        if let Some(control) = &mut self.control {
            while let Some(control) = control.pop() {
                if let Control::AddSubmitter(ring) = control {
                    self.rings.push(ring);
                }
            }
        }
        for ring in &mut self.rings {
            while let Some(slice) = ring.pop() {
                slice.resolve(Err(FailReason::PollerGone));
            }
        }
    }
}

impl std::fmt::Debug for Orphans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Orphans")
            .field("rings", &self.rings.len())
            .finish()
    }
}

impl PollerShared {
    /// Wakes the poller if it is parked. Call after publishing work: if the poller has
    /// stopped meanwhile, what was published is resolved here (`PollerGone`).
    pub(crate) fn wake(&self) {
        // SeqCst fence: pairs with the poller's fence between setting `parked` and
        // re-checking its rings (either it sees our work, or we see it parked), and with its
        // fence between setting `stopped` and its last look at the rings (either that look
        // sees our work, or we see it stopped).
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) {
            if let Some(thread) = self.thread.get() {
                thread.unpark();
            }
        }
        if self.stopped.load(Ordering::Relaxed) {
            // The poller hands its rings over under this lock after its last look, so either
            // they are here, or its last look comes after this and sees our work.
            lock(&self.orphans).resolve_leftovers();
        }
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }
}

/// What travels on the control ring.
pub(super) enum Control {
    Command(Command),
    AddSubmitter(Consumer<Slice>),
}

/// Locks `mutex`, whether or not a panic poisoned it.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
