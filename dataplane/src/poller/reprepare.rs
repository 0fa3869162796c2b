//! Who rewrites a stale slice for its endpoint's current epoch: the hook the poller hands a
//! slice the epoch rule refused, and why it does.

use crate::Epoch;
use crate::batch::FailReason;
use crate::slice::Slice;

/// Why a stale slice is being re-prepared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairCause {
    /// Its epoch is older than its endpoint's.
    StaleEpoch,
    /// Its own work request failed (length, protection, access) on the previous queue pair;
    /// the descriptor should be refreshed. This is its only second chance.
    AfterWorkRequestError,
}

/// Rewrites a stale slice for its endpoint's current epoch: supplied by the owner of
/// segment descriptors.
pub trait Reprepare: Send {
    /// Rewrites `slice` (remote address, keys, epoch) for `current`, or returns why it must
    /// fail. A slice still older than `current` afterwards fails with `StaleEpoch`.
    ///
    /// # Errors
    /// The reason the slice fails.
    fn reprepare(
        &mut self,
        slice: &mut Slice,
        current: Epoch,
        cause: RepairCause,
    ) -> Result<(), FailReason>;
}

impl<F> Reprepare for F
where
    F: FnMut(&mut Slice, Epoch, RepairCause) -> Result<(), FailReason> + Send,
{
    fn reprepare(
        &mut self,
        slice: &mut Slice,
        current: Epoch,
        cause: RepairCause,
    ) -> Result<(), FailReason> {
        self(slice, current, cause)
    }
}

/// A [`Reprepare`] that fails every stale slice with `StaleEpoch`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FailStale;

impl Reprepare for FailStale {
    fn reprepare(&mut self, _: &mut Slice, _: Epoch, _: RepairCause) -> Result<(), FailReason> {
        Err(FailReason::StaleEpoch)
    }
}
