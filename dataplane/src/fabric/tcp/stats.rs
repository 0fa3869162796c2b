//! What a TCP device's target side carried out for initiators: counted by the poller that
//! serves its connections ([`ServedCounters`]), read by anyone ([`ServedStats`]).

use std::sync::atomic::{AtomicU64, Ordering};

/// What this device's target side carried out for initiators, counted by the poller that
/// serves its connections (one writer).
#[derive(Debug, Default)]
pub(super) struct ServedCounters {
    writes: AtomicU64,
    write_bytes: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    half_open_closed: AtomicU64,
    accept_failures: AtomicU64,
}

impl ServedCounters {
    /// A WRITE (or WRITE_WITH_IMM) of `len` bytes landed in registered memory.
    pub(super) fn wrote(&self, len: u32) {
        add(&self.writes, 1);
        add(&self.write_bytes, u64::from(len));
    }

    /// A READ of `len` bytes was checked and its data queued to go back.
    pub(super) fn read(&self, len: u32) {
        add(&self.reads, 1);
        add(&self.read_bytes, u64::from(len));
    }

    /// A connection that had not said its hello was closed to make room for a newer one.
    pub(super) fn half_open_closed(&self) {
        add(&self.half_open_closed, 1);
    }

    /// `accept` failed for lack of file descriptors or memory.
    pub(super) fn accept_failed(&self) -> u64 {
        add(&self.accept_failures, 1);
        self.accept_failures.load(Ordering::Relaxed)
    }

    /// What they count so far.
    pub(super) fn stats(&self) -> ServedStats {
        ServedStats {
            writes: self.writes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            half_open_closed: self.half_open_closed.load(Ordering::Relaxed),
            accept_failures: self.accept_failures.load(Ordering::Relaxed),
        }
    }
}

/// Relaxed load and store, no read-modify-write: the device's one poller is the only writer.
fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// What a TCP device's target side carried out for initiators: WRITEs whose payload landed
/// in this process's registered memory, READs whose data it sent back. (Soft-fabric and RDMA
/// transfers are one-sided: the target's CPU never sees them, so only TCP counts them.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServedStats {
    /// WRITEs applied.
    pub writes: u64,
    /// Their bytes.
    pub write_bytes: u64,
    /// READs answered.
    pub reads: u64,
    /// Their bytes.
    pub read_bytes: u64,
    /// Accepted connections bound to no queue pair (no hello yet, or a raw stream) closed to
    /// stay within
    /// [`TcpConfig::max_half_open`](super::TcpConfig::max_half_open).
    pub half_open_closed: u64,
    /// Times the data port's `accept` failed for lack of file descriptors or memory
    /// (EMFILE, ENFILE, ENOBUFS, ENOMEM); accepting pauses briefly after each.
    pub accept_failures: u64,
}
