//! The ceiling of the fabrics that do not go over TCP (soft, verbs): memcpy of the bench's
//! blocks into random slots, one thread per rail, best of a few rounds.

use std::time::{Duration, Instant};

use railyard::dataplane::rng::SplitMix64;

/// Rounds of the memcpy ceiling; the best counts.
pub(super) const MEMCPY_CEILING_ROUNDS: usize = 5;

/// memcpy of `block` into random block slots of `pool` on `threads` threads (one per
/// rail), each into its own part of the pool: this machine's ceiling for the copies the
/// soft fabric's rails make, measured over the same shape. The best of a few rounds counts.
pub(super) fn memcpy_ceiling(
    block: &[u8],
    pool: &mut [u8],
    seed: u64,
    threads: usize,
) -> anyhow::Result<f64> {
    let threads = threads.max(1);
    let part = (pool.len() / threads / block.len()).max(1) * block.len();
    let mut best = 0.0f64;
    for round in 0..MEMCPY_CEILING_ROUNDS {
        let seed = seed.wrapping_add(round as u64);
        best = best.max(memcpy_round(block, pool, part, seed, threads)?);
    }
    Ok(best)
}

/// One round of [`memcpy_ceiling`], in GB/s: each thread copies into its `part` bytes of
/// `pool`.
fn memcpy_round(
    block: &[u8],
    pool: &mut [u8],
    part: usize,
    seed: u64,
    threads: usize,
) -> anyhow::Result<f64> {
    let duration = Duration::from_millis(300);
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
                    let slots = (target.len() / block.len()) as u64;
                    let mut rng = SplitMix64::new(seed ^ thread as u64);
                    start.wait();
                    let started = Instant::now();
                    let mut moved = 0u64;
                    while started.elapsed() < duration {
                        for _ in 0..64 {
                            let at = rng.below(slots) as usize * block.len();
                            target[at..at + block.len()].copy_from_slice(block);
                            moved += block.len() as u64;
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
