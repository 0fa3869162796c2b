//! What the fabric's results are compared with, and on what memory it is measured: railyard's
//! TCP fabric's run for libfabric, a plain TCP stream for the TCP fabric, memcpy for the
//! others.

use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use railyard::dataplane::fabric::tcp::REQUESTS_PER_SEND;
use railyard::engine::{Engine, PeerAccess, Region};

use super::args::{BenchArgs, BenchOp};
use super::memcpy_ceiling::{MEMCPY_CEILING_ROUNDS, memcpy_ceiling};
use super::tcp_ceiling::{CeilingSite, TCP_CEILING_ROUNDS, tcp_ceiling};
use super::worker::local_slice;
use crate::cli::size::format_size;

/// What the fabric's results are compared with.
pub(super) struct Ceiling {
    pub(super) gbps: f64,
    pub(super) what: String,
}

/// The same workload on railyard's TCP fabric, for as long: a `railyard bench --fabric tcp`
/// child with this bench's settings.
pub(super) fn tcp_fabric_ceiling(args: &BenchArgs) -> anyhow::Result<Ceiling> {
    let mut command = Command::new(std::env::current_exe().context("finding this binary")?);
    command
        .args(["bench", "--fabric", "tcp", "--json"])
        .args([
            "--op",
            match args.op {
                BenchOp::Write => "write",
                BenchOp::Read => "read",
            },
        ])
        .args(["--block-size", &args.block_size.to_string()])
        .args(["--batch", &args.batch.to_string()])
        .args(["--threads", &args.threads.to_string()])
        .args(["--duration", &args.duration.to_string()])
        .args(["--pool", &args.pool.to_string()])
        .args(["--seed", &args.seed.to_string()]);
    if let Some(rails) = args.rails {
        command.args(["--rails", &rails.to_string()]);
    }
    command.args(args.secret.options());
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .context("running the TCP fabric's bench")?;
    if !output.status.success() {
        bail!("the TCP fabric's bench failed ({})", output.status);
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("reading the TCP fabric's bench")?;
    let gbps = report["gbps"]
        .as_f64()
        .filter(|gbps| *gbps > 0.0)
        .context("the TCP fabric's bench moved nothing")?;
    Ok(Ceiling {
        gbps,
        what: "railyard's TCP fabric on the same workload, run just before".into(),
    })
}

/// The fabric's ceiling — a plain TCP stream for the TCP fabric, memcpy on one thread per
/// rail for the others — moving bytes between memory of the kinds the fabric moves them
/// between: from `source` (this engine's region the requests are sent from) into random
/// block slots of a pool of `pool_len` bytes that this engine allocates as the target
/// allocates its own (the same backing: huge pages where it can), at most
/// [`MAX_CEILING_POOL`], freed afterwards.
pub(super) fn measure_ceiling(
    args: &BenchArgs,
    engine: &Engine,
    site: CeilingSite,
    source: Region,
    pool_len: u64,
    tcp: bool,
) -> anyhow::Result<Ceiling> {
    let request_bytes = args.block_size * args.batch;
    let rails = engine.rails();
    // A target elsewhere reads the TCP stream itself: no pool here.
    let discarding_sink =
        tcp && matches!(site, CeilingSite::Remote(addr) if !addr.ip().is_loopback());
    let slots = if discarding_sink {
        0
    } else {
        (pool_len.min(MAX_CEILING_POOL) / args.block_size).max(1)
    };
    let pool = if slots == 0 {
        None
    } else {
        Some(
            engine
                .alloc_with_access(slots * args.block_size, None, PeerAccess::None)
                .context("allocating the ceiling's pool")?,
        )
    };
    let source_bytes = local_slice(source, 0, request_bytes);
    let pool_bytes: &mut [u8] = match pool {
        Some(pool) => local_slice(pool, 0, slots * args.block_size),
        None => &mut [],
    };
    let measured = if tcp {
        let slice = engine.slice_size();
        let landing = if discarding_sink {
            "to the target's TCP port, which discards them"
        } else {
            "into random slots"
        };
        tcp_ceiling(
            &site,
            source_bytes,
            pool_bytes,
            args.block_size,
            slice,
            args.seed,
        )
        .map(|gbps| Ceiling {
            gbps,
            what: format!(
                "plain TCP stream of {} requests of {} blocks, cut at {} and sent \
                 {REQUESTS_PER_SEND} pieces per vectored write, {landing}, best of \
                 {TCP_CEILING_ROUNDS} rounds",
                format_size(request_bytes),
                format_size(args.block_size),
                format_size(slice as u64)
            ),
        })
    } else {
        let block = &source_bytes[..args.block_size as usize];
        // A thread per rail, as long as each has a block of the pool to itself.
        let threads = rails.min(slots as usize).max(1);
        memcpy_ceiling(block, pool_bytes, args.seed, threads).map(|gbps| Ceiling {
            gbps,
            what: format!(
                "memcpy of {} blocks into random slots on {threads} thread(s), one per rail, \
                 best of {MEMCPY_CEILING_ROUNDS} rounds",
                format_size(args.block_size)
            ),
        })
    };
    if let Some(pool) = pool {
        engine
            .deregister(pool)
            .context("freeing the ceiling's pool")?;
    }
    measured
}

/// The largest pool a ceiling allocates (a remote target's may be far larger than this
/// host can spare).
const MAX_CEILING_POOL: u64 = 1 << 30;
