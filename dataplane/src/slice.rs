//! Slices: the unit of work a submitter hands to a poller.
//!
//! A slice is one work request's worth of a transfer: a local range, a remote range, the keys
//! that make them valid, and the [`Epoch`] of the endpoint it was prepared for. It reports to
//! one request of one [`Batch`](crate::Batch) and resolves exactly once: the type cannot be
//! cloned, resolving consumes it, and dropping an unresolved slice (a ring dropped with work
//! in it) resolves it as [`FailReason::PollerGone`].

use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use crate::batch::{BatchState, FailReason, RequestFailure};
use crate::epoch::{EndpointId, Epoch};
use crate::fabric::Opcode;

/// What a submitter says about one slice; see [`crate::Submitter::submit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceSpec {
    /// Index of the poller (rail) that carries it, in the submitter's poller list.
    pub rail: usize,
    /// Index of the request it belongs to, in `0..requests`.
    pub request: u32,
    /// READ, WRITE or WRITE_WITH_IMM.
    pub opcode: Opcode,
    /// Local start address.
    pub local_addr: u64,
    /// Key of the local registration.
    pub lkey: u32,
    /// Remote start address.
    pub remote_addr: u64,
    /// Key of the remote registration.
    pub rkey: u32,
    /// Bytes.
    pub len: u32,
    /// Immediate data (WRITE_WITH_IMM only).
    pub imm: u32,
    /// The endpoint it goes to.
    pub endpoint: EndpointId,
    /// The endpoint epoch its addresses and keys were prepared for.
    pub epoch: Epoch,
    /// The generation of the remote region it was prepared against (low 32 bits of the
    /// descriptor's `generation`; 0 for a slice naming no memory): re-preparing it may
    /// change its queue pair and epoch, never its generation.
    pub generation: u32,
}

/// Flag: this slice already took a queue pair down with a work-request error once.
pub(crate) const FLAG_WR_ERROR_SEEN: u8 = 1;

/// Flag: its deadline passed while it was posted; its queue pair was taken out of service and
/// it resolves with `Timeout` when the fabric hands it back (flushed), never earlier.
pub(crate) const FLAG_TIMED_OUT: u8 = 2;
/// Flag: its endpoint admitted it (it waited for credits there): a backlog it returns to
/// while the endpoint is down does not refuse it for being full.
pub(crate) const FLAG_ADMITTED: u8 = 4;

/// A prepared piece of a transfer, owned by whichever ring or poller holds it.
///
/// # Invariants
/// - `batch` points at a live `BatchState`: the submitter leaked one `Arc` reference to it
///   for all of the batch's slices, and only the resolution of the batch's last slice
///   releases it.
/// - A slice is resolved exactly once (`resolve` consumes it; `Drop` resolves the rest).
pub struct Slice {
    /// Local start address.
    pub local_addr: u64,
    /// Remote start address.
    pub remote_addr: u64,
    /// The endpoint epoch the addresses and keys are valid for.
    pub epoch: Epoch,
    batch: NonNull<BatchState>,
    /// Bytes.
    pub len: u32,
    /// Key of the local registration.
    pub lkey: u32,
    /// Key of the remote registration.
    pub rkey: u32,
    /// The generation of the remote region it was prepared against ([`SliceSpec::generation`]).
    pub generation: u32,
    /// The endpoint it goes to.
    pub endpoint: EndpointId,
    request: u32,
    /// Immediate data (WRITE_WITH_IMM only).
    pub imm: u32,
    /// READ, WRITE or WRITE_WITH_IMM.
    pub opcode: Opcode,
    /// How many times it was retried after a flush or transport error.
    pub retries: u8,
    pub(crate) flags: u8,
}

// A slice is one cache line at most: rings move them by value.
const _: () = assert!(std::mem::size_of::<Slice>() <= 64);

// SAFETY:
// - The only non-Send field is `batch`, a pointer to a `BatchState`, which is `Sync` (atomics
//   and a mutex) and kept alive by the leaked reference (type invariant), so the slice may
//   be resolved from any thread.
unsafe impl Send for Slice {}

impl Slice {
    /// A slice of `spec` reporting to `batch`.
    ///
    /// # Safety
    /// `batch` must come from `Arc::into_raw` of a reference reserved for this batch's slices
    /// (one for all of them), and `spec.request` must be a request of that batch with this
    /// slice counted in its slice count.
    pub(crate) unsafe fn new(spec: &SliceSpec, batch: NonNull<BatchState>) -> Self {
        Self {
            local_addr: spec.local_addr,
            remote_addr: spec.remote_addr,
            epoch: spec.epoch,
            batch,
            len: spec.len,
            lkey: spec.lkey,
            rkey: spec.rkey,
            generation: spec.generation,
            endpoint: spec.endpoint,
            request: spec.request,
            imm: spec.imm,
            opcode: spec.opcode,
            retries: 0,
            flags: 0,
        }
    }

    fn state(&self) -> &BatchState {
        // SAFETY:
        // - The batch state outlives every unresolved slice (type invariant), and `self` is
        //   unresolved while it exists.
        unsafe { self.batch.as_ref() }
    }

    /// The deadline of the batch it belongs to.
    pub fn deadline(&self) -> Instant {
        self.state().deadline()
    }

    /// The request it reports to.
    pub fn request(&self) -> u32 {
        self.request
    }

    /// Resolves the slice; consumes it so it cannot resolve again.
    pub(crate) fn resolve(self, outcome: Result<(), FailReason>) {
        let this = ManuallyDrop::new(self);
        this.resolve_in_place(outcome);
    }

    fn resolve_in_place(&self, outcome: Result<(), FailReason>) {
        let outcome = outcome.map_err(|reason| RequestFailure {
            reason,
            endpoint: self.endpoint,
            epoch: self.epoch,
            local_addr: self.local_addr,
            remote_addr: self.remote_addr,
            len: self.len,
        });
        if self.state().resolve_slice(self.request, outcome) {
            // SAFETY:
            // - This was the batch's last unresolved slice (`resolve_slice` returns true
            //   exactly once), so no other slice will touch the state, and the reference the
            //   submitter leaked for the slices is released exactly once, here.
            drop(unsafe { Arc::from_raw(self.batch.as_ptr()) });
        }
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.resolve_in_place(Err(FailReason::PollerGone));
    }
}

impl std::fmt::Debug for Slice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slice")
            .field("opcode", &self.opcode)
            .field("endpoint", &self.endpoint)
            .field("epoch", &self.epoch)
            .field(
                "local",
                &format_args!("{:#x}+{}", self.local_addr, self.len),
            )
            .field(
                "remote",
                &format_args!("{:#x} rkey {:#x}", self.remote_addr, self.rkey),
            )
            .field("request", &self.request)
            .field("retries", &self.retries)
            .finish()
    }
}
