//! What one submitting thread does: requests of random block slots, one in flight, timed;
//! with `--check`, each one's blocks compared byte for byte with the pattern meant to land.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use railyard::dataplane::RequestOutcome;
use railyard::dataplane::rng::SplitMix64;
use railyard::engine::{Engine, Op, Peer, Region, Transfer};

/// Fills a block with the check pattern of `tag`: one mixed 64-bit word per 8 bytes.
fn fill(block: &mut [u8], tag: u64) {
    let mut state = SplitMix64::new(tag);
    let mut chunks = block.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&state.next_u64().to_le_bytes());
    }
    let tail = chunks.into_remainder();
    let last = state.next_u64().to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// What one thread measured.
#[derive(Default)]
pub(super) struct ThreadResult {
    pub(super) latencies: Vec<Duration>,
    pub(super) prepare: Duration,
    pub(super) post: Duration,
    pub(super) complete: Duration,
    pub(super) requests: u64,
    pub(super) failed_requests: u64,
    pub(super) verified: u64,
    pub(super) mismatches: u64,
}

pub(super) struct Workload<'a> {
    pub(super) engine: &'a Engine,
    pub(super) peer: &'a Peer,
    pub(super) local: Region,
    /// This thread's blocks start here in `local`; its check area follows them.
    pub(super) local_offset: u64,
    /// Blocks of `local` this thread has: a request's block `j` is sent from (or read into)
    /// block `j % local_blocks` (every block of a request has its own with `--check`).
    pub(super) local_blocks: u64,
    pub(super) remote_base: u64,
    /// This thread's slots of the target's pool: `first_slot..first_slot + slots`, no
    /// other thread's (so that a check never sees another thread's write).
    pub(super) first_slot: u64,
    pub(super) slots: u64,
    pub(super) block: u64,
    pub(super) batch: u64,
    pub(super) op: Op,
    pub(super) check: bool,
    /// Seeds this thread's block placement.
    pub(super) seed: u64,
    /// The seed [`seed_pool`] wrote the read-check pattern with (every thread's).
    pub(super) pattern_seed: u64,
    pub(super) stop: &'a AtomicBool,
    pub(super) moved: &'a AtomicU64,
}

/// Slowest rate a request is given time for on top of the default deadline: a
/// request of a few GiB must not time out for its size alone.
const SLOWEST_BYTES_PER_SECOND: f64 = 1e8;

/// When a request of this workload submitted at `now` times out.
fn deadline(work: &Workload<'_>, now: Instant) -> Instant {
    let bytes = work.block * work.batch;
    now + railyard::dataplane::DEFAULT_DEADLINE
        + Duration::from_secs_f64(bytes as f64 / SLOWEST_BYTES_PER_SECOND)
}

/// The slot tag the check pattern of a read uses: what the setup pass wrote there.
fn slot_tag(seed: u64, slot: u64) -> u64 {
    seed.wrapping_mul(31).wrapping_add(slot)
}

pub(super) fn local_slice(region: Region, offset: u64, len: u64) -> &'static mut [u8] {
    // SAFETY:
    // - `offset + len` lies inside the engine-allocated region (the bench sized it), which
    //   lives until the engine drops, after every worker has joined.
    // - Each worker touches only its own blocks, and only while no transfer of its own is
    //   in flight (before submit and after completion).
    unsafe { std::slice::from_raw_parts_mut((region.addr + offset) as *mut u8, len as usize) }
}

pub(super) fn run_worker(work: &Workload<'_>) -> anyhow::Result<ThreadResult> {
    let mut submitter = work.engine.submitter()?;
    let mut rng = SplitMix64::new(work.seed);
    let mut result = ThreadResult::default();
    let mut slots = Vec::with_capacity(work.batch as usize);
    let mut seen = HashSet::new();
    let area = work.block * work.batch;
    while !work.stop.load(Ordering::Relaxed) {
        slots.clear();
        seen.clear();
        while (slots.len() as u64) < work.batch {
            let slot = work.first_slot + rng.below(work.slots);
            if seen.insert(slot) {
                slots.push(slot);
            }
        }
        let tag = rng.next_u64();
        if work.check && work.op == Op::Write {
            for (j, _) in slots.iter().enumerate() {
                let offset = work.local_offset + j as u64 * work.block;
                fill(local_slice(work.local, offset, work.block), tag ^ j as u64);
            }
        }
        let transfers: Vec<Transfer> = slots
            .iter()
            .enumerate()
            .map(|(j, &slot)| Transfer {
                op: work.op,
                local: work.local,
                local_offset: work.local_offset + (j as u64 % work.local_blocks) * work.block,
                remote_addr: work.remote_base + slot * work.block,
                len: work.block,
            })
            .collect();
        let started = Instant::now();
        let batch = submitter.submit_by(work.peer, &transfers, deadline(work, started))?;
        let timing = submitter.last_timing();
        let posted = Instant::now();
        batch.wait(batch.deadline() + Duration::from_secs(1));
        let done = Instant::now();
        result.latencies.push(done - started);
        result.prepare += timing.prepare;
        result.post += timing.post;
        result.complete += done - posted;
        result.requests += 1;
        let outcomes = batch.outcomes();
        if outcomes.iter().any(|o| *o != Some(RequestOutcome::Done)) {
            result.failed_requests += 1;
            continue;
        }
        work.moved.fetch_add(area, Ordering::Relaxed);
        if work.check {
            verify(work, &mut submitter, &slots, tag, &mut result)?;
        }
    }
    Ok(result)
}

/// Checks a completed request's blocks byte for byte: writes are read back into the check
/// area; reads are compared with what the setup pass wrote.
fn verify(
    work: &Workload<'_>,
    submitter: &mut railyard::engine::EngineSubmitter,
    slots: &[u64],
    tag: u64,
    result: &mut ThreadResult,
) -> anyhow::Result<()> {
    let area = work.block * work.batch;
    let mut expected_block = vec![0u8; work.block as usize];
    if work.op == Op::Write {
        let transfers: Vec<Transfer> = slots
            .iter()
            .enumerate()
            .map(|(j, &slot)| Transfer {
                op: Op::Read,
                local: work.local,
                local_offset: work.local_offset + area + j as u64 * work.block,
                remote_addr: work.remote_base + slot * work.block,
                len: work.block,
            })
            .collect();
        let batch = submitter.submit_by(work.peer, &transfers, deadline(work, Instant::now()))?;
        batch.wait(batch.deadline() + Duration::from_secs(1));
        if batch
            .outcomes()
            .iter()
            .any(|o| *o != Some(RequestOutcome::Done))
        {
            result.mismatches += slots.len() as u64;
            return Ok(());
        }
    }
    for (j, &slot) in slots.iter().enumerate() {
        let (offset, expected_tag) = match work.op {
            Op::Write => (
                work.local_offset + area + j as u64 * work.block,
                tag ^ j as u64,
            ),
            Op::Read => (
                work.local_offset + j as u64 * work.block,
                slot_tag(work.pattern_seed, slot),
            ),
        };
        fill(&mut expected_block, expected_tag);
        let landed = local_slice(work.local, offset, work.block);
        if *landed == *expected_block {
            result.verified += work.block;
        } else {
            result.mismatches += 1;
        }
    }
    Ok(())
}

/// Writes the read-check pattern of `seed` into every `block`-sized slot of the target's
/// pool, `per_round` blocks at a time.
pub(super) fn seed_pool(
    engine: &Engine,
    peer: &Peer,
    local: Region,
    (block, per_round): (u64, u64),
    seed: u64,
    remote_base: u64,
    slots: u64,
) -> anyhow::Result<()> {
    let mut submitter = engine.submitter()?;
    let mut slot = 0;
    while slot < slots {
        let count = per_round.min(slots - slot);
        for j in 0..count {
            fill(
                local_slice(local, j * block, block),
                slot_tag(seed, slot + j),
            );
        }
        let transfers: Vec<Transfer> = (0..count)
            .map(|j| Transfer {
                op: Op::Write,
                local,
                local_offset: j * block,
                remote_addr: remote_base + (slot + j) * block,
                len: block,
            })
            .collect();
        let batch = submitter.submit(peer, &transfers)?;
        batch.wait(batch.deadline() + Duration::from_secs(1));
        if batch
            .outcomes()
            .iter()
            .any(|o| *o != Some(RequestOutcome::Done))
        {
            bail!("writing the read-check pattern into the target failed");
        }
        slot += count;
    }
    Ok(())
}
