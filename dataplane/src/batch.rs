//! Batches: the completion side of a group of transfer requests.
//!
//! A [`Batch`] is what a submitter gets back. Each request in it resolves exactly once, to
//! [`RequestOutcome::Done`] or [`RequestOutcome::Failed`], when all of its slices have
//! resolved; the first failure of any of its slices is the request's reason. Pollers resolve
//! slices through the shared [`BatchState`]; the batch's owner reads it without locks and
//! can sleep until it completes.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use crate::{EndpointId, Epoch};

use crate::fabric::WcStatus;

/// Why a slice, and so its request, failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
#[repr(u8)]
pub enum FailReason {
    /// Prepared for an older epoch of its endpoint and could not be re-prepared.
    #[error("slice was prepared for an older epoch and could not be re-prepared")]
    StaleEpoch = 1,
    /// The batch's deadline passed first.
    #[error("deadline passed before the transfer completed")]
    Timeout,
    /// Its endpoint was retired.
    #[error("endpoint was retired")]
    EndpointRetired,
    /// Its endpoint is not known to the poller.
    #[error("endpoint is not known to the rail's poller")]
    UnknownEndpoint,
    /// The peer is unavailable (its circuit is open).
    #[error("peer is unavailable")]
    PeerUnavailable,
    /// The poller shut down before the slice completed.
    #[error("poller shut down")]
    Shutdown,
    /// The poller was gone before it read the slice.
    #[error("poller is gone")]
    PollerGone,
    /// The endpoint's backlog was full.
    #[error("endpoint backlog is full")]
    BacklogFull,
    /// The fabric refused to post the work request.
    #[error("fabric refused to post the work request")]
    PostFailed,
    /// LOC_LEN_ERR: local length error.
    #[error("local length error (LOC_LEN_ERR)")]
    LocalLength,
    /// LOC_PROT_ERR: local protection error (lkey or local range).
    #[error("local protection error (LOC_PROT_ERR)")]
    LocalProtection,
    /// REM_ACCESS_ERR: the remote side refused the rkey, range or access.
    #[error("remote access error (REM_ACCESS_ERR)")]
    RemoteAccess,
    /// REM_INV_REQ_ERR: the remote side found the request invalid.
    #[error("remote invalid request (REM_INV_REQ_ERR)")]
    RemoteInvalidRequest,
    /// RETRY_EXC_ERR: the transport gave up reaching the peer.
    #[error("transport retries exceeded (RETRY_EXC_ERR)")]
    RetryExceeded,
    /// WR_FLUSH_ERR: flushed by a queue pair in error, past the retry budget.
    #[error("flushed by a queue pair in error (WR_FLUSH_ERR)")]
    Flushed,
    /// The peer process restarted (a new incarnation): what was meant for the old one is
    /// never delivered to the new one.
    #[error("the peer restarted; the transfer was meant for its previous incarnation")]
    PeerRestarted,
    /// The target revoked this initiator (`Engine::revoke`) after the slice was prepared:
    /// work from before a fence never lands after it, so it is not retried.
    #[error("the target revoked this initiator after the transfer was submitted (a fence)")]
    Revoked,
    /// The remote region it was prepared against was withdrawn (deregistered; the memory
    /// may be registered again since): it is never retried into what is there now.
    #[error("the remote region the transfer was prepared against was withdrawn")]
    RegionWithdrawn,
}

impl FailReason {
    /// Number of reasons (for per-reason counters).
    pub const COUNT: usize = 18;

    /// Every reason, in code order.
    pub const ALL: [Self; Self::COUNT] = [
        Self::StaleEpoch,
        Self::Timeout,
        Self::EndpointRetired,
        Self::UnknownEndpoint,
        Self::PeerUnavailable,
        Self::Shutdown,
        Self::PollerGone,
        Self::BacklogFull,
        Self::PostFailed,
        Self::LocalLength,
        Self::LocalProtection,
        Self::RemoteAccess,
        Self::RemoteInvalidRequest,
        Self::RetryExceeded,
        Self::Flushed,
        Self::PeerRestarted,
        Self::Revoked,
        Self::RegionWithdrawn,
    ];

    /// Dense index in `0..COUNT`.
    pub fn index(self) -> usize {
        self as usize - 1
    }

    /// Its name in snake case (the `reason` label of the failure metric).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StaleEpoch => "stale_epoch",
            Self::Timeout => "timeout",
            Self::EndpointRetired => "endpoint_retired",
            Self::UnknownEndpoint => "unknown_endpoint",
            Self::PeerUnavailable => "peer_unavailable",
            Self::Shutdown => "shutdown",
            Self::PollerGone => "poller_gone",
            Self::BacklogFull => "backlog_full",
            Self::PostFailed => "post_failed",
            Self::LocalLength => "local_length",
            Self::LocalProtection => "local_protection",
            Self::RemoteAccess => "remote_access",
            Self::RemoteInvalidRequest => "remote_invalid_request",
            Self::RetryExceeded => "retry_exceeded",
            Self::Flushed => "flushed",
            Self::PeerRestarted => "peer_restarted",
            Self::Revoked => "revoked",
            Self::RegionWithdrawn => "region_withdrawn",
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// The reason an error completion status gives its slice.
    pub fn from_status(status: WcStatus) -> Option<Self> {
        match status {
            WcStatus::Success => None,
            WcStatus::LocLenErr => Some(Self::LocalLength),
            WcStatus::LocProtErr => Some(Self::LocalProtection),
            WcStatus::RemAccessErr => Some(Self::RemoteAccess),
            WcStatus::RemInvReqErr => Some(Self::RemoteInvalidRequest),
            WcStatus::RetryExcErr => Some(Self::RetryExceeded),
            WcStatus::WrFlushErr => Some(Self::Flushed),
        }
    }
}

/// How one request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Every byte moved.
    Done,
    /// At least one slice failed; this is the first reason.
    Failed(FailReason),
}

/// Progress of a batch, read without blocking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// Requests in the batch.
    pub total: usize,
    /// Requests resolved as done.
    pub done: usize,
    /// Requests resolved as failed.
    pub failed: usize,
}

impl BatchStatus {
    /// Whether every request has resolved.
    pub fn is_complete(&self) -> bool {
        self.done + self.failed == self.total
    }
}

/// Why a request failed, naming the range and the endpoint of the slice that failed first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestFailure {
    /// The reason.
    pub reason: FailReason,
    /// The endpoint the slice went to (the owner of endpoints names its peer).
    pub endpoint: EndpointId,
    /// The endpoint epoch the slice was prepared for last.
    pub epoch: Epoch,
    /// Its local start address.
    pub local_addr: u64,
    /// Its remote start address.
    pub remote_addr: u64,
    /// Its length.
    pub len: u32,
}

impl std::fmt::Display for RequestFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} bytes to remote {:#x} (from local {:#x}) through endpoint {} at {}",
            self.reason, self.len, self.remote_addr, self.local_addr, self.endpoint.0, self.epoch
        )
    }
}

struct RequestState {
    /// Slices not yet resolved.
    remaining: AtomicU32,
    /// First failure code, 0 while none.
    failure: AtomicU8,
    /// The first failure, set by the slice whose code won.
    detail: OnceLock<RequestFailure>,
}

/// State shared between a [`Batch`] and the pollers resolving its slices.
pub(crate) struct BatchState {
    requests: Box<[RequestState]>,
    done: AtomicUsize,
    failed: AtomicUsize,
    /// Requests with slices not yet resolved; reaches 0 exactly once.
    unresolved: AtomicUsize,
    /// Resolutions of a request that had no slice left: a slice resolved twice. Always 0
    /// unless there is a bug; counted in every build so that stress runs can report it.
    double_resolved: AtomicUsize,
    deadline: Instant,
    /// Threads inside [`Batch::wait`].
    waiters: AtomicUsize,
    lock: Mutex<()>,
    completed: Condvar,
    /// Called by whoever resolves the last slice ([`Batch::on_complete`]).
    hooks: Mutex<Vec<CompletionHook>>,
    /// Whether `hooks` holds any: the last resolution takes its lock only then.
    hooked: AtomicBool,
}

/// What [`Batch::on_complete`] calls.
type CompletionHook = Arc<dyn Fn() + Send + Sync>;

impl BatchState {
    /// A batch whose request `i` has `slices_per_request[i]` slices. Requests without slices
    /// are done at once.
    pub(crate) fn new(slices_per_request: &[u32], deadline: Instant) -> Self {
        let empty = slices_per_request.iter().filter(|&&n| n == 0).count();
        Self {
            requests: slices_per_request
                .iter()
                .map(|&n| RequestState {
                    remaining: AtomicU32::new(n),
                    failure: AtomicU8::new(0),
                    detail: OnceLock::new(),
                })
                .collect(),
            done: AtomicUsize::new(empty),
            failed: AtomicUsize::new(0),
            unresolved: AtomicUsize::new(slices_per_request.len() - empty),
            double_resolved: AtomicUsize::new(0),
            deadline,
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            completed: Condvar::new(),
            hooks: Mutex::new(Vec::new()),
            hooked: AtomicBool::new(false),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Resolves one slice of `request`. Returns `true` for exactly one call: the one that
    /// resolved the batch's last unresolved slice.
    ///
    /// # Panics
    /// In debug builds, when `request` has no unresolved slice left: a slice resolved twice.
    pub(crate) fn resolve_slice(&self, request: u32, outcome: Result<(), RequestFailure>) -> bool {
        let state = &self.requests[request as usize];
        // Acquire: pairs with the resolvers' AcqRel decrements.
        if state.remaining.load(Ordering::Acquire) == 0 {
            // Resolved again after the request was reported: it keeps its outcome. (A
            // duplicate racing the last resolution can still set the failure code; it is
            // counted below all the same.)
            return self.resolved_twice(request);
        }
        if let Err(failure) = outcome {
            // Relaxed: ordered before the AcqRel decrement below, which publishes it.
            let won = state
                .failure
                .compare_exchange(
                    0,
                    failure.reason as u8,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
            if won {
                let _ = state.detail.set(failure);
            }
        }
        // AcqRel: the last resolver must see every other resolver's failure write.
        let before = state.remaining.fetch_sub(1, Ordering::AcqRel);
        if before == 0 {
            // Resolved twice, racing the last resolution: undo the wrap, and never release
            // the batch's state a second time.
            state.remaining.fetch_add(1, Ordering::AcqRel);
            return self.resolved_twice(request);
        }
        if before != 1 {
            return false;
        }
        let counter = if state.failure.load(Ordering::Relaxed) == 0 {
            &self.done
        } else {
            &self.failed
        };
        // SeqCst: pairs with `wait`'s SeqCst increment of `waiters` (Dekker): either the
        // waiter sees the new count, or we see the waiter and notify it.
        counter.fetch_add(1, Ordering::SeqCst);
        let last = self.unresolved.fetch_sub(1, Ordering::AcqRel) == 1;
        if last && self.waiters.load(Ordering::SeqCst) > 0 {
            let _guard = self
                .lock
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            self.completed.notify_all();
        }
        if last {
            // Pairs with the fence in `Batch::on_complete`: either a hook is seen here, or
            // the batch is seen complete there (and the hook called there).
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.hooked.load(Ordering::Relaxed) {
                let hooks = self
                    .hooks
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .clone();
                for hook in hooks {
                    hook();
                }
            }
        }
        last
    }

    /// Counts a slice of `request` resolved a second time (a bug; asserted in debug builds).
    fn resolved_twice(&self, request: u32) -> bool {
        self.double_resolved.fetch_add(1, Ordering::Relaxed);
        debug_assert!(false, "a slice of request {request} was resolved twice");
        false
    }

    pub(crate) fn status(&self) -> BatchStatus {
        BatchStatus {
            total: self.requests.len(),
            done: self.done.load(Ordering::SeqCst),
            failed: self.failed.load(Ordering::SeqCst),
        }
    }

    fn outcome(&self, request: usize) -> Option<RequestOutcome> {
        let state = self.requests.get(request)?;
        // Acquire: pairs with the resolvers' AcqRel decrements.
        if state.remaining.load(Ordering::Acquire) != 0 {
            return None;
        }
        Some(
            match FailReason::from_code(state.failure.load(Ordering::Relaxed)) {
                None => RequestOutcome::Done,
                Some(reason) => RequestOutcome::Failed(reason),
            },
        )
    }
}

/// The handle to a submitted group of requests. `Send + Sync`; cheap to clone.
///
/// # What a reported request promises
/// Once [`Self::poll`] or [`Self::wait`] reports a request — done, failed or timed out — no
/// fabric operation of it will read or write the caller's local memory again: its buffers
/// may be reused at once. A request whose deadline passes while its work is posted is
/// reported only after its queue pair was taken out of service and the fabric handed the
/// work back (a fabric that breaks its promise to flush within the poller's `flush_grace`
/// is the one exception, counted as `unflushed`). On the remote side, a write of a failed or timed-out request may still land
/// at the target only until the target has processed the retirement of the queue pair it
/// came on.
#[derive(Clone)]
pub struct Batch {
    state: Arc<BatchState>,
}

impl Batch {
    pub(crate) fn new(state: Arc<BatchState>) -> Self {
        Self { state }
    }

    /// Progress so far. Never blocks.
    pub fn poll(&self) -> BatchStatus {
        self.state.status()
    }

    /// Sleeps (no spinning) until every request has resolved or `deadline` passes, and
    /// returns the progress at that moment.
    pub fn wait(&self, deadline: Instant) -> BatchStatus {
        let state = &self.state;
        state.waiters.fetch_add(1, Ordering::SeqCst);
        let mut guard = state
            .lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        loop {
            let status = state.status();
            let now = Instant::now();
            if status.is_complete() || now >= deadline {
                drop(guard);
                state.waiters.fetch_sub(1, Ordering::SeqCst);
                return status;
            }
            guard = state
                .completed
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// Calls `hook` once every request has resolved, on the thread that resolved the last
    /// one (a poller: `hook` must be quick and must not block), or at once on this thread if
    /// that has already happened; it may be called twice when the two race. A batch may
    /// have several hooks. Lets a thread that sleeps on something else (the control thread,
    /// which sends a notification after its batch) be woken instead of polling.
    pub fn on_complete(&self, hook: impl Fn() + Send + Sync + 'static) {
        let state = &self.state;
        let hook: CompletionHook = Arc::new(hook);
        state
            .hooks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(hook.clone());
        state.hooked.store(true, Ordering::Relaxed);
        // Pairs with the fence in `BatchState::resolve_slice`.
        std::sync::atomic::fence(Ordering::SeqCst);
        if state.unresolved.load(Ordering::Acquire) == 0 {
            hook();
        }
    }

    /// How request `request` ended, or `None` while it is pending (or out of range).
    pub fn outcome(&self, request: usize) -> Option<RequestOutcome> {
        self.state.outcome(request)
    }

    /// Why request `request` failed — the reason, and the range and endpoint of its first
    /// failing slice — or `None` while it is pending or when it is done.
    pub fn failure(&self, request: usize) -> Option<RequestFailure> {
        match self.outcome(request)? {
            RequestOutcome::Done => None,
            RequestOutcome::Failed(_) => self.state.requests.get(request)?.detail.get().copied(),
        }
    }

    /// Every request's outcome, `None` for those still pending.
    pub fn outcomes(&self) -> Vec<Option<RequestOutcome>> {
        (0..self.state.requests.len())
            .map(|i| self.state.outcome(i))
            .collect()
    }

    /// The deadline the batch was submitted with.
    pub fn deadline(&self) -> Instant {
        self.state.deadline
    }

    /// Slices of this batch that were resolved a second time. Zero unless railyard has a
    /// bug; stress runs report it.
    pub fn double_resolved(&self) -> usize {
        self.state.double_resolved.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("status", &self.poll())
            .finish()
    }
}

// `cfg(test)` alone on its line: cargo-mutants (`make mutants`) then knows this is test code.
#[cfg(test)]
#[cfg(not(loom))]
mod tests {
    use super::*;
    use std::thread;
    use std::time::Duration;

    fn failed(reason: FailReason) -> Result<(), RequestFailure> {
        Err(RequestFailure {
            reason,
            endpoint: EndpointId(3),
            epoch: Epoch::FIRST,
            local_addr: 0x1000,
            remote_addr: 0x9000,
            len: 64,
        })
    }

    fn batch(slices: &[u32]) -> (Arc<BatchState>, Batch) {
        let state = Arc::new(BatchState::new(
            slices,
            Instant::now() + Duration::from_secs(5),
        ));
        (state.clone(), Batch::new(state))
    }

    #[test]
    fn a_request_resolves_when_its_last_slice_does_with_the_first_failure() {
        let (state, batch) = batch(&[2, 1, 0]);
        assert_eq!(batch.outcomes(), [None, None, Some(RequestOutcome::Done)]);
        assert!(!state.resolve_slice(0, failed(FailReason::RemoteAccess)));
        assert_eq!(batch.outcome(0), None);
        assert_eq!(batch.failure(0), None, "pending");
        assert!(!state.resolve_slice(0, failed(FailReason::Timeout)));
        assert_eq!(
            batch.outcome(0),
            Some(RequestOutcome::Failed(FailReason::RemoteAccess))
        );
        let failure = batch.failure(0).expect("failed");
        assert_eq!(failure.reason, FailReason::RemoteAccess);
        assert_eq!(
            failure.to_string(),
            "remote access error (REM_ACCESS_ERR): 64 bytes to remote 0x9000 (from local \
             0x1000) through endpoint 3 at epoch 1"
        );
        assert!(state.resolve_slice(1, Ok(())));
        assert_eq!(
            batch.poll(),
            BatchStatus {
                total: 3,
                done: 2,
                failed: 1
            }
        );
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "resolved twice")]
    fn resolving_a_slice_twice_is_caught() {
        let (state, _batch) = batch(&[1]);
        state.resolve_slice(0, Ok(()));
        state.resolve_slice(0, Ok(()));
    }

    #[test]
    fn wait_sleeps_until_completion_or_the_deadline() {
        let (state, batch) = batch(&[1]);
        let start = Instant::now();
        let early = batch.wait(start + Duration::from_millis(30));
        assert!(!early.is_complete());
        assert!(start.elapsed() >= Duration::from_millis(30));
        let resolver = thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            state.resolve_slice(0, Ok(()));
        });
        let status = batch.wait(Instant::now() + Duration::from_secs(2));
        assert!(status.is_complete());
        resolver.join().unwrap();
    }

    #[test]
    fn reason_codes_round_trip() {
        for (i, reason) in FailReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i);
            assert_eq!(FailReason::from_code(*reason as u8), Some(*reason));
        }
        assert_eq!(FailReason::from_code(0), None);
    }

    #[test]
    fn requests_are_counted_done_or_failed_by_their_own_outcome() {
        let (state, batch) = batch(&[1, 1, 1, 2]);
        assert!(!state.resolve_slice(0, Ok(())));
        assert!(!state.resolve_slice(1, failed(FailReason::Flushed)));
        assert!(!state.resolve_slice(2, Ok(())));
        assert_eq!(
            batch.poll(),
            BatchStatus {
                total: 4,
                done: 2,
                failed: 1
            }
        );
        assert!(!state.resolve_slice(3, Ok(())), "one slice of it left");
        assert!(!batch.poll().is_complete());
        assert!(
            state.resolve_slice(3, Ok(())),
            "the last slice of the batch"
        );
        assert_eq!(batch.poll().done, 3);
        assert!(batch.poll().is_complete());
        assert_eq!(batch.double_resolved(), 0);
    }

    #[test]
    fn completion_hooks_run_once_the_last_slice_resolves_or_at_once_if_it_has() {
        use std::sync::atomic::AtomicUsize;
        let (state, pending) = batch(&[1, 2]);
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        pending.on_complete(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        let second = Arc::new(AtomicUsize::new(0));
        let also = second.clone();
        pending.on_complete(move || {
            also.fetch_add(1, Ordering::SeqCst);
        });
        state.resolve_slice(0, Ok(()));
        state.resolve_slice(1, Ok(()));
        assert_eq!(calls.load(Ordering::SeqCst), 0, "a slice is still pending");
        state.resolve_slice(1, failed(FailReason::Timeout));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "called by the last resolver"
        );
        assert_eq!(second.load(Ordering::SeqCst), 1, "every hook is called");

        let (state, complete) = batch(&[1]);
        state.resolve_slice(0, Ok(()));
        let late = Arc::new(AtomicUsize::new(0));
        let counted = late.clone();
        complete.on_complete(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(
            late.load(Ordering::SeqCst),
            1,
            "already complete: called at once"
        );
    }

    #[test]
    fn a_waiter_is_woken_when_the_last_slice_resolves() {
        let (state, batch) = batch(&[1, 1]);
        let resolver = thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            state.resolve_slice(0, Ok(()));
            thread::sleep(Duration::from_millis(20));
            state.resolve_slice(1, Ok(()));
        });
        // Woken by the resolution (40 ms away), not by the deadline.
        let start = Instant::now();
        let status = batch.wait(start + Duration::from_secs(2));
        assert!(status.is_complete());
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "woken by the deadline"
        );
        resolver.join().unwrap();
    }

    #[test]
    fn a_slice_resolved_twice_is_counted_and_changes_no_outcome() {
        let (state, batch) = batch(&[1]);
        assert!(state.resolve_slice(0, Ok(())));
        let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            state.resolve_slice(0, failed(FailReason::Timeout))
        }));
        // Debug builds assert; release builds go on.
        assert!(again.is_err() || matches!(again, Ok(false)));
        assert_eq!(batch.double_resolved(), 1);
        assert_eq!(batch.outcome(0), Some(RequestOutcome::Done));
        assert_eq!(batch.poll().done, 1);
    }

    #[test]
    fn reasons_name_themselves_in_snake_case() {
        for reason in FailReason::ALL {
            let mut snake = String::new();
            for (i, c) in format!("{reason:?}").chars().enumerate() {
                if c.is_ascii_uppercase() && i > 0 {
                    snake.push('_');
                }
                snake.push(c.to_ascii_lowercase());
            }
            assert_eq!(reason.as_str(), snake);
        }
    }

    #[test]
    fn error_statuses_map_to_their_reasons() {
        let expected = [
            (WcStatus::Success, None),
            (WcStatus::LocLenErr, Some(FailReason::LocalLength)),
            (WcStatus::LocProtErr, Some(FailReason::LocalProtection)),
            (WcStatus::RemAccessErr, Some(FailReason::RemoteAccess)),
            (
                WcStatus::RemInvReqErr,
                Some(FailReason::RemoteInvalidRequest),
            ),
            (WcStatus::RetryExcErr, Some(FailReason::RetryExceeded)),
            (WcStatus::WrFlushErr, Some(FailReason::Flushed)),
        ];
        for (status, reason) in expected {
            assert_eq!(FailReason::from_status(status), reason, "{status:?}");
        }
    }
}
