//! The ceiling of the fabrics that do not go over TCP (soft, verbs): memcpy of the bench's
//! blocks into random slots, cut into slices as the fabric cuts them, one thread per rail,
//! best of a few rounds.

use std::time::{Duration, Instant};

use railyard::dataplane::rng::SplitMix64;

/// Rounds of the memcpy ceiling; the best counts.
pub(super) const MEMCPY_CEILING_ROUNDS: usize = 5;
/// Bytes each copying thread moves between looks at the clock.
const BYTES_BETWEEN_CLOCK_READS: usize = 4 << 20;

/// memcpy of the blocks of `request` (blocks of `block` bytes, taken in turn, as a batch's
/// are) into random block slots of `pool` on `threads` threads (one per rail), each into
/// its own part of the pool, one `slice`-sized piece after the other (as
/// the fabric copies a block: large copies of whole blocks would take glibc's non-temporal
/// path, slower here than the fabric's), in rounds of `round`: this machine's ceiling for
/// the copies the soft fabric's rails make, measured over the same shape. The best of a few
/// rounds counts.
pub(super) fn memcpy_ceiling(
    (request, block): (&[u8], usize),
    pool: &mut [u8],
    seed: u64,
    (threads, slice): (usize, usize),
    round: Duration,
) -> anyhow::Result<f64> {
    let threads = threads.max(1);
    let blocks: Vec<&[u8]> = request.chunks_exact(block.max(1)).collect();
    if blocks.is_empty() {
        anyhow::bail!("the memcpy ceiling's request holds no block of {block} bytes");
    }
    let part = (pool.len() / threads / block).max(1) * block;
    let mut best = 0.0f64;
    for index in 0..MEMCPY_CEILING_ROUNDS {
        let seed = seed.wrapping_add(index as u64);
        best = best.max(memcpy_round(
            &blocks,
            pool,
            part,
            seed,
            (threads, slice),
            round,
        )?);
    }
    Ok(best)
}

/// One round of [`memcpy_ceiling`], in GB/s: each thread copies into its `part` bytes of
/// `pool` for `duration`.
fn memcpy_round(
    blocks: &[&[u8]],
    pool: &mut [u8],
    part: usize,
    seed: u64,
    (threads, slice): (usize, usize),
    duration: Duration,
) -> anyhow::Result<f64> {
    let slice = slice.max(1);
    let block_len = blocks.first().map_or(1, |block| block.len()).max(1);
    let copies_between_clock_reads = (BYTES_BETWEEN_CLOCK_READS / block_len).clamp(1, 64);
    let copiers = pool.chunks_exact_mut(part).take(threads).count().max(1);
    // The threads' rates, added up; they start copying together.
    let start = std::sync::Barrier::new(copiers);
    let bytes_per_second = std::thread::scope(|scope| -> anyhow::Result<f64> {
        let spawned: Vec<_> = pool
            .chunks_exact_mut(part)
            .take(threads)
            .enumerate()
            .map(|(thread, target)| {
                let start = &start;
                scope.spawn(move || {
                    let slots = (target.len() / block_len) as u64;
                    let mut rng = SplitMix64::new(seed ^ thread as u64);
                    start.wait();
                    let started = Instant::now();
                    let mut moved = 0u64;
                    let mut next = blocks.iter().cycle();
                    while started.elapsed() < duration {
                        for block in next.by_ref().take(copies_between_clock_reads) {
                            let at = rng.below(slots) as usize * block_len;
                            let slot = &mut target[at..at + block_len];
                            for (to, from) in slot.chunks_mut(slice).zip(block.chunks(slice)) {
                                to.copy_from_slice(from);
                            }
                            moved += block_len as u64;
                        }
                    }
                    std::hint::black_box(&target);
                    moved as f64 / started.elapsed().as_secs_f64()
                })
            })
            .collect();
        let mut total = 0.0;
        for copier in spawned {
            total += copier
                .join()
                .map_err(|_| anyhow::anyhow!("a memcpy ceiling thread panicked"))?;
        }
        Ok(total)
    })?;
    Ok(bytes_per_second / 1e9)
}
