//! Memory the integration tests own and watch while engines write into it, and a load that
//! keeps transfers going.

use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Instant;

use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, FabricChoice, Op, Peer, RailChoice, Region, Transfer};

use super::BOUND;

pub const BUFFER: usize = 1 << 20;
pub const BLOCK: u64 = 64 << 10;
pub const POISON: u8 = 0x5a;
pub const PATTERN: u8 = 0xa5;

/// Memory the test owns, touched only through raw pointers (the engines write into it).
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain anonymous mapping; every access goes through raw volatile reads and
// writes, and the engines' accesses are what the test is about.
unsafe impl Send for Buffer {}
// SAFETY: as for Send.
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn new(fill: u8) -> Self {
        Self::sized(BUFFER, fill)
    }

    /// `len` bytes (a multiple of 8), each `fill`.
    pub fn sized(len: usize, fill: u8) -> Self {
        assert_eq!(len % 8, 0, "whole words");
        // SAFETY: a fresh private anonymous mapping overlaps nothing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        let buffer = Self {
            ptr: NonNull::new(ptr.cast()).expect("mapped"),
            len,
        };
        buffer.fill(fill);
        buffer
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The first byte's address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// A copy of `offset..offset + len` (inside the buffer), read byte by byte, volatile.
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        (offset..offset + len)
            // SAFETY: inside the live mapping (checked above); volatile, as an engine may be
            // writing.
            .map(|at| unsafe { self.ptr.as_ptr().add(at).read_volatile() })
            .collect()
    }

    /// Writes `bytes` at `offset` (inside the buffer).
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len);
        // SAFETY: inside the live mapping (checked above), which `bytes` cannot overlap (the
        // test holds it only through this handle).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset),
                bytes.len(),
            )
        };
    }

    pub fn fill(&self, byte: u8) {
        // SAFETY: inside the live mapping of `len` bytes.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.len) };
    }

    /// Writes `word` into every 8-byte word of `offset..offset + len` (both multiples of 8,
    /// inside the buffer).
    pub fn fill_words(&self, offset: usize, len: usize, word: u64) {
        assert!(offset % 8 == 0 && len % 8 == 0 && offset + len <= self.len);
        let base = self.ptr.as_ptr().cast::<u64>();
        for index in offset / 8..(offset + len) / 8 {
            // SAFETY: inside the live, page-aligned mapping (checked above); volatile, as a
            // fabric may read the buffer's other blocks meanwhile.
            unsafe { base.add(index).write_volatile(word) };
        }
    }

    /// Every 8-byte word that is not `skip`, with its offset (read one at a time, volatile).
    pub fn words_other_than(&self, skip: u64) -> impl Iterator<Item = (usize, u64)> + '_ {
        let base = self.ptr.as_ptr().cast::<u64>();
        (0..self.len / 8).filter_map(move |index| {
            // SAFETY: inside the live, page-aligned mapping; volatile, as an engine may be
            // writing (which is what the tests look for).
            let word = unsafe { base.add(index).read_volatile() };
            (word != skip).then_some((index * 8, word))
        })
    }

    /// Offset of the first byte that is not `byte` (8-byte words read one at a time).
    pub fn first_not(&self, byte: u8) -> Option<usize> {
        let word = u64::from_ne_bytes([byte; 8]);
        let base = self.ptr.as_ptr().cast::<u64>();
        let at = (0..self.len / 8).find(|&index| {
            // SAFETY: inside the live, page-aligned mapping; volatile, as an engine may be
            // writing (which is exactly what the test looks for).
            unsafe { base.add(index).read_volatile() != word }
        })?;
        // SAFETY: as above; the word at `at` differs, so one of its bytes does.
        let bytes = unsafe { base.add(at).read_volatile() }.to_ne_bytes();
        Some(at * 8 + bytes.iter().position(|&b| b != byte).unwrap_or(0))
    }

    pub fn register(&self, engine: &Engine) -> Region {
        // SAFETY: the mapping lives until the end of the test, after every engine is gone.
        unsafe { engine.register(self.ptr.as_ptr(), self.len) }.expect("registers")
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: our mapping; the engines that used it are dropped first.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// An engine with one rail and gentle pollers.
pub fn one_rail_engine(name: &str, fabric: FabricChoice) -> Engine {
    Engine::builder(name)
        .fabric(fabric)
        .rails(RailChoice::Count(NonZeroUsize::new(1).expect("one")))
        .idle(IdleStrategy::gentle())
        .slice_size(BLOCK as usize)
        .build()
        .expect("the engine starts")
}

/// Transfers that threads keep going while a test does something to the memory.
#[derive(Debug, Default)]
pub struct Load {
    stop: AtomicBool,
    succeeded: AtomicU64,
}

impl Load {
    /// Batches that succeeded so far.
    pub fn succeeded(&self) -> u64 {
        self.succeeded.load(Ordering::Relaxed)
    }

    /// Makes every [`Self::run`] return when the guard drops — also when the test body
    /// panics, so a scope joining the runners never hangs.
    pub fn stop_on_drop(&self) -> StopOnDrop<'_> {
        StopOnDrop(self)
    }

    /// Submits `op` transfers of one block between `local` (as it is at each submission)
    /// and random places of the peer's regions as last described, until [`Self::stop`];
    /// every batch must resolve within the bound.
    pub fn run(&self, engine: &Engine, peer: &Peer, op: Op, local: &Mutex<Option<Region>>) {
        let mut submitter = engine.submitter().expect("submitter");
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        while !self.stop.load(Ordering::Relaxed) {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let slot = (seed >> 33) % (BUFFER as u64 / BLOCK);
            let Some(local) = *local.lock().expect("lock") else {
                thread::yield_now();
                continue;
            };
            // A withdrawn region fails, which refreshes the description.
            let regions = peer.descriptor().regions.clone();
            let Some(remote) = regions
                .get((seed >> 20) as usize % regions.len().max(1))
                .map(|r| r.base)
            else {
                thread::yield_now();
                continue;
            };
            let transfer = Transfer {
                op,
                local,
                local_offset: slot * BLOCK,
                remote_addr: remote + slot * BLOCK,
                len: BLOCK,
            };
            // Refused submissions (a region just withdrawn) queue nothing: try again.
            if let Ok(batch) = submitter.submit(peer, &[transfer]) {
                let status = batch.wait(Instant::now() + BOUND);
                assert!(status.is_complete(), "a batch did not resolve: {status:?}");
                if status.failed == 0 {
                    self.succeeded.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Stops a [`Load`] when dropped.
#[derive(Debug)]
pub struct StopOnDrop<'a>(&'a Load);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Relaxed);
    }
}

/// The initiator's peer for `target`. Open it once the target has registered its memory:
/// the description it fetches is refreshed only after a failure.
pub fn open(initiator: &Engine, target: &Engine) -> Peer {
    initiator
        .open(&target.addr().to_string())
        .expect("the target answers")
}
