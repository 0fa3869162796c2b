//! The shapes one `railyard bench` measures — its `--op`, `--block-size` and `--batch`, or a
//! sweep's grid of block sizes × batch sizes — the pool they share, and which shapes that
//! pool cannot hold.

use std::time::Duration;

use railyard::engine::Op;

use super::args::{BenchArgs, BenchOp};
use crate::cli::size::format_size;

/// What one row of the report measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    pub(super) op: Op,
    /// Bytes per block.
    pub(super) block: u64,
    /// Blocks per request.
    pub(super) batch: u64,
}

impl Shape {
    /// Bytes of one request.
    pub(super) fn request_bytes(&self) -> u64 {
        self.block * self.batch
    }

    /// `write` or `read`, as reports spell it.
    pub(super) fn op_name(&self) -> &'static str {
        match self.op {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

/// A shape left out of a sweep, and why.
pub(super) struct Skipped {
    pub(super) shape: Shape,
    pub(super) why: String,
}

/// What a run measures and with how much memory.
pub(super) struct Plan {
    /// In the order they run and are reported: by direction, then batch size, then block
    /// size (so each line of a plot is one stretch of rows).
    pub(super) shapes: Vec<Shape>,
    pub(super) skipped: Vec<Skipped>,
    /// The pool of the target bench starts.
    pub(super) pool: u64,
    /// How long each shape runs.
    pub(super) duration: Duration,
}

/// A sweep's block sizes: 4 KiB to 64 MiB in powers of 4, as nixlbench sweeps them.
pub(super) const SWEEP_BLOCK_SIZES: [u64; 8] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];
/// A sweep's batch sizes.
const SWEEP_BATCH_SIZES: [u64; 3] = [1, 16, 128];
/// The target's pool when none is asked for: one shape's.
const DEFAULT_POOL: u64 = 256 << 20;
/// The largest pool a sweep sizes for itself (its largest shapes need 8 GiB; `--pool`
/// gives them more).
const MAX_SWEEP_POOL: u64 = 1 << 30;
/// Seconds one shape runs when `--duration` is not given: one shape, or each of a sweep's.
const SINGLE_SECONDS: f64 = 5.0;
const SWEEP_SECONDS: f64 = 1.0;

/// The directions `op` names.
pub(super) fn ops(op: BenchOp) -> Vec<Op> {
    match op {
        BenchOp::Write => vec![Op::Write],
        BenchOp::Read => vec![Op::Read],
        BenchOp::Both => vec![Op::Write, Op::Read],
    }
}

pub(super) fn plan(args: &BenchArgs) -> Plan {
    let (blocks, batches) = if args.sweep {
        (
            or_default(&args.block_sizes, &SWEEP_BLOCK_SIZES),
            or_default(&args.batch_sizes, &SWEEP_BATCH_SIZES),
        )
    } else {
        (vec![args.block_size], vec![args.batch])
    };
    let mut all = Vec::new();
    for op in ops(args.op) {
        for &batch in &batches {
            for &block in &blocks {
                all.push(Shape { op, block, batch });
            }
        }
    }
    let pool = args.pool.unwrap_or_else(|| {
        if args.sweep {
            let largest = all
                .iter()
                .map(|shape| shape.request_bytes().saturating_mul(args.threads))
                .max()
                .unwrap_or(0);
            largest.clamp(DEFAULT_POOL, MAX_SWEEP_POOL)
        } else {
            DEFAULT_POOL
        }
    });
    // A target elsewhere has a pool of its own: its shapes are fitted once it answers.
    let (shapes, skipped) = match args.target {
        Some(_) => (all, Vec::new()),
        None => fit(all, pool, args.threads, "--pool"),
    };
    let seconds = args.duration.unwrap_or(if args.sweep {
        SWEEP_SECONDS
    } else {
        SINGLE_SECONDS
    });
    Plan {
        shapes,
        skipped,
        pool,
        duration: Duration::from_secs_f64(seconds),
    }
}

/// Splits `shapes` into those a pool of `pool` bytes holds — each of `threads` threads
/// writing a request's blocks into block slots of its own — and those it does not, which
/// `larger` would run.
pub(super) fn fit(
    shapes: Vec<Shape>,
    pool: u64,
    threads: u64,
    larger: &str,
) -> (Vec<Shape>, Vec<Skipped>) {
    let mut fitting = Vec::new();
    let mut skipped = Vec::new();
    for shape in shapes {
        let slots_per_thread = pool / shape.block / threads;
        if slots_per_thread >= shape.batch {
            fitting.push(shape);
        } else {
            skipped.push(Skipped {
                shape,
                why: format!(
                    "the pool of {} holds {} blocks of {}: not {} per thread (a request needs \
                     {}) for {threads} thread(s) ({larger})",
                    format_size(pool),
                    pool / shape.block,
                    format_size(shape.block),
                    shape.batch,
                    shape.batch
                ),
            });
        }
    }
    (fitting, skipped)
}

/// `given`, else `default`: smallest first, each once (a plot's lines run left to right).
fn or_default(given: &[u64], default: &[u64]) -> Vec<u64> {
    let mut sizes = if given.is_empty() {
        default.to_vec()
    } else {
        given.to_vec()
    };
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(block: u64, batch: u64) -> Shape {
        Shape {
            op: Op::Write,
            block,
            batch,
        }
    }

    #[test]
    fn a_pool_holds_a_shape_only_when_every_thread_has_a_request_of_slots() {
        let (fitting, skipped) = fit(
            vec![shape(1 << 20, 64), shape(1 << 20, 65)],
            128 << 20,
            2,
            "--pool",
        );
        assert_eq!(fitting, vec![shape(1 << 20, 64)]);
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].shape, shape(1 << 20, 65));
        assert!(
            skipped[0].why.contains("128 blocks of 1 MiB"),
            "{}",
            skipped[0].why
        );
    }
}
