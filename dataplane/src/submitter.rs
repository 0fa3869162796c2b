//! Submitters: how an application thread hands slices to pollers.
//!
//! A [`Submitter`] owns one SPSC ring to each poller it was made for, so it is `Send` but
//! not `Sync`: one per thread. Submitting validates everything first, then creates the
//! batch, pushes each rail's slices with one publication per ring-full, and wakes pollers
//! that are parked. Nothing is allocated per slice.

use std::ptr::NonNull;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::batch::{Batch, BatchState, FailReason};
use crate::poller::{PollerHandle, PollerShared, PollerStopped};
use crate::ring::Producer;
use crate::slice::{Slice, SliceSpec};

/// Why a submission was refused. Nothing was queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// A slice names a rail the submitter does not have.
    #[error("slice {slice} names rail {rail}, but this submitter has {rails} rail(s)")]
    UnknownRail {
        /// Index of the slice in the submission.
        slice: usize,
        /// The rail it named.
        rail: usize,
        /// Rails the submitter has.
        rails: usize,
    },
    /// A slice names a request outside `0..requests`.
    #[error("slice {slice} names request {request}, but the batch has {requests} request(s)")]
    UnknownRequest {
        /// Index of the slice in the submission.
        slice: usize,
        /// The request it named.
        request: u32,
        /// Requests in the batch.
        requests: usize,
    },
    /// One request has more slices than a counter holds.
    #[error("request {request} has more than {max} slices", max = u32::MAX)]
    TooManySlices {
        /// The request.
        request: u32,
    },
    /// A poller stopped before the submitter could be made.
    #[error(transparent)]
    PollerStopped(#[from] PollerStopped),
}

struct Lane {
    ring: Producer<Slice>,
    poller: Arc<PollerShared>,
}

/// How long a batch submitted without a deadline may take: seconds, not a minute, so that
/// a dead peer can never hold a caller for long (DESIGN.md §1).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);

/// One thread's way into the pollers. `Send`, not `Sync`.
pub struct Submitter {
    lanes: Vec<Lane>,
    slices_per_request: Vec<u32>,
    default_deadline: Duration,
}

impl Submitter {
    /// A submitter with one ring of `ring_capacity` slots to each poller; slice specs name
    /// pollers by their index in `pollers`.
    ///
    /// # Errors
    /// [`SubmitError::PollerStopped`] when a poller no longer runs.
    pub fn new(pollers: &[&PollerHandle], ring_capacity: usize) -> Result<Self, SubmitError> {
        let lanes = pollers
            .iter()
            .map(|poller| {
                let (ring, poller) = poller.register_submitter(ring_capacity)?;
                Ok(Lane { ring, poller })
            })
            .collect::<Result<Vec<_>, SubmitError>>()?;
        Ok(Self {
            lanes,
            slices_per_request: Vec::new(),
            default_deadline: DEFAULT_DEADLINE,
        })
    }

    /// Changes the deadline [`Self::submit_now`] gives batches ([`DEFAULT_DEADLINE`] until
    /// then).
    pub fn set_default_deadline(&mut self, deadline: Duration) {
        self.default_deadline = deadline;
    }

    /// [`Self::submit`] with the default deadline from now.
    ///
    /// # Errors
    /// As [`Self::submit`].
    pub fn submit_now(
        &mut self,
        requests: usize,
        slices: &[SliceSpec],
    ) -> Result<Batch, SubmitError> {
        let deadline = Instant::now() + self.default_deadline;
        self.submit(requests, slices, deadline)
    }

    /// Submits `requests` requests made of `slices`. A request with no slice is done at once.
    /// A slice that finds its ring full waits (yielding) until there is room or `deadline`
    /// passes, when it fails with `Timeout`; one for a stopped poller fails with
    /// `PollerGone`. Either way it resolves through the returned batch.
    ///
    /// # Errors
    /// [`SubmitError`] when a slice names an unknown rail or request; nothing is queued.
    pub fn submit(
        &mut self,
        requests: usize,
        slices: &[SliceSpec],
        deadline: Instant,
    ) -> Result<Batch, SubmitError> {
        self.slices_per_request.clear();
        self.slices_per_request.resize(requests, 0);
        for (index, spec) in slices.iter().enumerate() {
            if spec.rail >= self.lanes.len() {
                return Err(SubmitError::UnknownRail {
                    slice: index,
                    rail: spec.rail,
                    rails: self.lanes.len(),
                });
            }
            let count = self
                .slices_per_request
                .get_mut(spec.request as usize)
                .ok_or(SubmitError::UnknownRequest {
                    slice: index,
                    request: spec.request,
                    requests,
                })?;
            *count = count.checked_add(1).ok_or(SubmitError::TooManySlices {
                request: spec.request,
            })?;
        }
        let state = Arc::new(BatchState::new(&self.slices_per_request, deadline));
        let batch = Batch::new(state.clone());
        if slices.is_empty() {
            return Ok(batch);
        }
        // One reference for all slices; the last slice to resolve releases it.
        // SAFETY: `Arc::into_raw` never returns null.
        let shared = unsafe { NonNull::new_unchecked(Arc::into_raw(state).cast_mut()) };
        for (rail, lane) in self.lanes.iter_mut().enumerate() {
            // SAFETY:
            // - `shared` is the reference reserved for this batch's slices.
            // - Every spec's request is in range and counted (validated above).
            let mut pending = slices
                .iter()
                .filter(|spec| spec.rail == rail)
                .map(|spec| unsafe { Slice::new(spec, shared) })
                .peekable();
            while pending.peek().is_some() {
                if lane.poller.is_stopped() {
                    pending
                        .by_ref()
                        .for_each(|slice| slice.resolve(Err(FailReason::PollerGone)));
                    break;
                }
                if lane.ring.push_from(&mut pending) > 0 {
                    lane.poller.wake();
                } else if Instant::now() >= deadline {
                    pending
                        .by_ref()
                        .for_each(|slice| slice.resolve(Err(FailReason::Timeout)));
                } else {
                    lane.poller.wake();
                    thread::yield_now();
                }
            }
        }
        Ok(batch)
    }

    /// Number of rails (pollers) this submitter feeds.
    pub fn rails(&self) -> usize {
        self.lanes.len()
    }
}

impl std::fmt::Debug for Submitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submitter")
            .field("rails", &self.lanes.len())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::batch::RequestOutcome;
    use crate::fabric::Opcode;
    use crate::fabric::scripted::ScriptedFabric;
    use crate::poller::{FailStale, IdleStrategy, PollerConfig};
    use crate::{EndpointId, Epoch};

    /// The race a submitter cannot rule out by looking first: it saw the poller running,
    /// the poller took its last look at the ring and stopped, then the push landed. Caught:
    /// before the fix such a slice stayed in the ring, unresolved, until the submitter was
    /// dropped.
    #[test]
    fn a_slice_pushed_after_the_pollers_last_look_is_resolved_by_the_pusher() {
        let (fabric, _script) = ScriptedFabric::new();
        let config = PollerConfig {
            idle: IdleStrategy::gentle(),
            ..PollerConfig::new("rail0")
        };
        let poller = PollerHandle::spawn(config, fabric, FailStale).expect("poller starts");
        let mut submitter = Submitter::new(&[&poller], 8).expect("poller runs");
        poller.shutdown();

        let state = Arc::new(BatchState::new(
            &[1],
            Instant::now() + Duration::from_secs(10),
        ));
        let batch = Batch::new(state.clone());
        let shared = NonNull::new(Arc::into_raw(state).cast_mut()).expect("not null");
        let spec = SliceSpec {
            rail: 0,
            request: 0,
            opcode: Opcode::Write,
            local_addr: 0x1000,
            lkey: 1,
            remote_addr: 0x2000,
            rkey: 2,
            len: 64,
            imm: 0,
            endpoint: EndpointId(0),
            epoch: Epoch::FIRST,
            generation: 0,
        };
        let lane = &mut submitter.lanes[0];
        // SAFETY: `shared` is the one reference reserved for this batch's only slice, whose
        // request 0 is counted.
        let slice = unsafe { Slice::new(&spec, shared) };
        assert!(lane.ring.push(slice).is_ok());
        lane.poller.wake();
        assert!(
            batch.poll().is_complete(),
            "the late slice is resolved at once"
        );
        assert_eq!(
            batch.outcome(0),
            Some(RequestOutcome::Failed(FailReason::PollerGone))
        );
    }
}
