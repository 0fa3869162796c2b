//! Writes that say when they were submitted: every write's payload is its sequence number,
//! so a test that fences memory can tell a write submitted before the fence from one
//! submitted after it, wherever and whenever its bytes land.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Instant;

use railyard::dataplane::{Batch, FailReason, RequestOutcome};
use railyard::engine::{Engine, Op, Peer, Region, Transfer};

use super::BOUND;
use super::mapped::{BLOCK, BUFFER, Buffer};

/// Batches one writer keeps in flight (one block of its source buffer each).
const WINDOW: usize = 8;

/// The payload word of the write with sequence number `seq`: never 0 and never a fill byte
/// repeated (sequence numbers stay far below 2^56).
pub fn tag(seq: u64) -> u64 {
    seq + 1
}

/// The sequence number `word` tags, if it can be one of the `written` tags so far (a word
/// read while a copy was under way may mix a tag with what was there: that is no tag).
pub fn seq_of(word: u64, written: u64) -> Option<u64> {
    let seq = word.checked_sub(1)?;
    (seq < written).then_some(seq)
}

/// One writer of tagged blocks into the peer's regions, and what became of its writes.
#[derive(Debug, Default)]
pub struct TaggedLoad {
    stop: AtomicBool,
    /// Sequence numbers handed out: every tag seen in memory is below it.
    allocated: AtomicU64,
    /// Every write with a lower sequence number was submitted (its `submit` returned).
    submitted: AtomicU64,
    succeeded: AtomicU64,
    revoked: AtomicU64,
    withdrawn: AtomicU64,
    /// Requests failed for any other reason.
    other_failures: AtomicU64,
}

impl TaggedLoad {
    /// Every write with a lower sequence number has been submitted: read it before a fence,
    /// and no tag below it may land after the fence returned.
    pub fn submitted(&self) -> u64 {
        self.submitted.load(Ordering::Acquire)
    }

    /// Sequence numbers handed out so far.
    pub fn allocated(&self) -> u64 {
        self.allocated.load(Ordering::Acquire)
    }

    /// Writes that succeeded.
    pub fn succeeded(&self) -> u64 {
        self.succeeded.load(Ordering::Relaxed)
    }

    /// Writes that failed `Revoked`.
    pub fn revoked(&self) -> u64 {
        self.revoked.load(Ordering::Relaxed)
    }

    /// Writes that failed `RegionWithdrawn`.
    pub fn withdrawn(&self) -> u64 {
        self.withdrawn.load(Ordering::Relaxed)
    }

    /// Writes that failed for another reason.
    pub fn other_failures(&self) -> u64 {
        self.other_failures.load(Ordering::Relaxed)
    }

    /// Makes [`Self::run`] return when the guard drops — also when the test body panics.
    pub fn stop_on_drop(&self) -> StopOnDrop<'_> {
        StopOnDrop(self)
    }

    /// The offset and sequence number of a write submitted before `before` found in
    /// `buffer` (which the caller filled with `fill` after the fence), if there is one.
    pub fn stale_write(&self, buffer: &Buffer, fill: u8, before: u64) -> Option<(usize, u64)> {
        let written = self.allocated();
        buffer
            .words_other_than(u64::from_ne_bytes([fill; 8]))
            .find_map(|(at, word)| {
                seq_of(word, written)
                    .filter(|&seq| seq < before)
                    .map(|seq| (at, seq))
            })
    }

    /// Whether a write submitted at or after `from` has landed in `buffer`.
    pub fn landed_since(&self, buffer: &Buffer, fill: u8, from: u64) -> bool {
        let written = self.allocated();
        buffer
            .words_other_than(u64::from_ne_bytes([fill; 8]))
            .any(|(_, word)| seq_of(word, written).is_some_and(|seq| seq >= from))
    }

    /// Writes blocks of `source` (registered as `local`), each filled with its tag, to random
    /// blocks of the peer's regions as last described, [`WINDOW`] batches in flight, until
    /// stopped. Every batch must resolve within the bound.
    pub fn run(&self, engine: &Engine, peer: &Peer, source: &Buffer, local: Region) {
        let mut submitter = engine.submitter().expect("submitter");
        let mut in_flight: VecDeque<(Batch, usize)> = VecDeque::new();
        let mut free: Vec<usize> = (0..WINDOW.min(BUFFER / BLOCK as usize)).collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        while !self.stop.load(Ordering::Relaxed) {
            let Some(block) = free.pop() else {
                let (batch, block) = in_flight.pop_front().expect("a full window");
                self.settle(&batch);
                free.push(block);
                continue;
            };
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let regions = peer.descriptor().regions.clone();
            let Some(remote) = regions.get((seed >> 20) as usize % regions.len().max(1)) else {
                free.push(block);
                thread::yield_now();
                continue;
            };
            let slot = (seed >> 33) % (remote.len / BLOCK).max(1);
            let seq = self.allocated.fetch_add(1, Ordering::AcqRel);
            let offset = block * BLOCK as usize;
            source.fill_words(offset, BLOCK as usize, tag(seq));
            let transfer = Transfer {
                op: Op::Write,
                local,
                local_offset: offset as u64,
                remote_addr: remote.base + slot * BLOCK,
                len: BLOCK,
            };
            let submitted = submitter.submit(peer, &[transfer]);
            self.submitted.store(seq + 1, Ordering::Release);
            match submitted {
                Ok(batch) => in_flight.push_back((batch, block)),
                // Refused before anything was queued (a region just withdrawn): try again.
                Err(_) => {
                    free.push(block);
                    thread::yield_now();
                }
            }
        }
        for (batch, _) in in_flight {
            self.settle(&batch);
        }
    }

    /// Waits for `batch` (within the bound) and counts its outcome.
    fn settle(&self, batch: &Batch) {
        let status = batch.wait(Instant::now() + BOUND);
        assert!(status.is_complete(), "a batch did not resolve: {status:?}");
        let counter = match batch.outcome(0) {
            Some(RequestOutcome::Done) => &self.succeeded,
            Some(RequestOutcome::Failed(FailReason::Revoked)) => &self.revoked,
            Some(RequestOutcome::Failed(FailReason::RegionWithdrawn)) => &self.withdrawn,
            _ => &self.other_failures,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Stops a [`TaggedLoad`] when dropped.
#[derive(Debug)]
pub struct StopOnDrop<'a>(&'a TaggedLoad);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Relaxed);
    }
}
