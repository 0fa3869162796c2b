//! What a poller counts: counters with the poller thread as their single writer, and the
//! snapshot its handle reads without locks.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::batch::FailReason;

/// A counter with a single writer (the poller thread).
#[derive(Debug, Default)]
pub(super) struct Counter(AtomicU64);

impl Counter {
    pub(super) fn add(&self, n: u64) {
        // Relaxed load + store: only the poller writes, readers want a recent value.
        self.0
            .store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }

    pub(super) fn sub(&self, n: u64) {
        // As `add`: one writer.
        self.0.store(
            self.0.load(Ordering::Relaxed).saturating_sub(n),
            Ordering::Relaxed,
        );
    }

    pub(super) fn set(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }

    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything a poller counts.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) posted: Counter,
    pub(super) completed: Counter,
    pub(super) failed: [Counter; FailReason::COUNT],
    pub(super) reprepared: Counter,
    pub(super) stale_dropped: Counter,
    pub(super) idle_rounds: Counter,
    pub(super) busy_rounds: Counter,
    /// Work requests posted and not yet completed, as of the last busy round.
    pub(super) in_flight: Counter,
    pub(super) ignored_completions: Counter,
    pub(super) events_coalesced: Counter,
    pub(super) unflushed: Counter,
    pub(super) doorbells: Counter,
    pub(super) credit_waits: Counter,
    pub(super) send_queue_full: Counter,
    /// Bytes of the slices taken from the rings and not yet resolved: the rail's load.
    pub(super) load_bytes: Counter,
    pub(super) rail_downs: Counter,
    pub(super) rail_ups: Counter,
}

impl Counters {
    /// The counters now. Lock-free.
    pub(super) fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            posted: self.posted.get(),
            completed: self.completed.get(),
            failed: std::array::from_fn(|i| self.failed[i].get()),
            reprepared: self.reprepared.get(),
            stale_dropped: self.stale_dropped.get(),
            idle_rounds: self.idle_rounds.get(),
            busy_rounds: self.busy_rounds.get(),
            in_flight: self.in_flight.get(),
            ignored_completions: self.ignored_completions.get(),
            events_coalesced: self.events_coalesced.get(),
            unflushed: self.unflushed.get(),
            doorbells: self.doorbells.get(),
            credit_waits: self.credit_waits.get(),
            send_queue_full: self.send_queue_full.get(),
            load_bytes: self.load_bytes.get(),
            rail_downs: self.rail_downs.get(),
            rail_ups: self.rail_ups.get(),
        }
    }
}

/// A poller's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Work requests posted.
    pub posted: u64,
    /// Slices completed successfully.
    pub completed: u64,
    /// Slices failed, by [`FailReason::index`].
    pub failed: [u64; FailReason::COUNT],
    /// Stale slices re-prepared for a newer epoch.
    pub reprepared: u64,
    /// Stale slices the re-prepare hook refused (failed, never posted).
    pub stale_dropped: u64,
    /// Rounds that found no work.
    pub idle_rounds: u64,
    /// Rounds that did some work: with [`Self::idle_rounds`], how busy the poller's core is.
    pub busy_rounds: u64,
    /// Work requests posted to the fabric and not yet completed.
    pub in_flight: u64,
    /// Completions for a slot that had moved on (ignored).
    pub ignored_completions: u64,
    /// Events replaced by a later event of the same endpoint while the event ring was full.
    pub events_coalesced: u64,
    /// Posted slices the fabric did not hand back within [`PollerConfig::flush_grace`] of
    /// being taken out of service, resolved once their queue pair was torn down (a fabric
    /// bug: zero).
    ///
    /// [`PollerConfig::flush_grace`]: super::PollerConfig::flush_grace
    pub unflushed: u64,
    /// Post calls made (one per queue pair per round with work for it).
    pub doorbells: u64,
    /// Slices that waited for credits (a full send queue or completion queue) before they
    /// were posted.
    pub credit_waits: u64,
    /// Post calls the fabric cut short with `SendQueueFull` (their rest waited, then went).
    pub send_queue_full: u64,
    /// Bytes of the slices taken from the rings and not yet resolved (queued, waiting for
    /// credits or in flight): the rail's load, which submitters balance.
    pub load_bytes: u64,
    /// Times the fabric said the rail went down (port, completion queue, device).
    pub rail_downs: u64,
    /// Times it said the rail's port came back.
    pub rail_ups: u64,
}

impl CounterSnapshot {
    /// Slices failed with `reason`.
    pub fn failed(&self, reason: FailReason) -> u64 {
        self.failed[reason.index()]
    }

    /// Slices failed for any reason.
    pub fn failed_total(&self) -> u64 {
        self.failed.iter().sum()
    }
}
