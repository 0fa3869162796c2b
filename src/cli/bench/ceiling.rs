//! What the fabric's results are compared with, shape by shape, and on what memory it is
//! measured: railyard's TCP fabric's run for libfabric, a plain TCP stream for the TCP
//! fabric, memcpy for the others.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};
use railyard::dataplane::fabric::tcp::REQUESTS_PER_SEND;
use railyard::engine::{Engine, PeerAccess, Region};

use super::args::{BenchArgs, BenchOp};
use super::memcpy_ceiling::{MEMCPY_CEILING_ROUNDS, memcpy_ceiling};
use super::shapes::{Plan, Shape};
use super::tcp_ceiling::{CeilingSite, TCP_CEILING_ROUNDS, tcp_ceiling};
use super::worker::local_slice;
use crate::cli::size::format_size;

/// What the fabric's results are compared with.
#[derive(Clone)]
pub(super) struct Ceiling {
    pub(super) gbps: f64,
    pub(super) what: String,
}

/// How long each round of a ceiling runs: shorter for the short shapes of a sweep, at most
/// 300 ms.
pub(super) fn ceiling_round(shape_duration: Duration) -> Duration {
    (shape_duration / 4).clamp(Duration::from_millis(50), Duration::from_millis(300))
}

/// The same workload on railyard's TCP fabric, for as long: a `railyard bench --fabric tcp
/// --sweep` child with this bench's settings and shapes, one ceiling per shape, in order.
pub(super) fn tcp_fabric_ceilings(args: &BenchArgs, plan: &Plan) -> anyhow::Result<Vec<Ceiling>> {
    let list = |values: Vec<u64>| {
        let mut values = values;
        values.sort_unstable();
        values.dedup();
        values
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut command = Command::new(std::env::current_exe().context("finding this binary")?);
    command
        .args(["bench", "--fabric", "tcp", "--json", "--sweep"])
        .args([
            "--op",
            match args.op {
                BenchOp::Write => "write",
                BenchOp::Read => "read",
                BenchOp::Both => "both",
            },
        ])
        .args([
            "--block-sizes",
            &list(plan.shapes.iter().map(|s| s.block).collect()),
        ])
        .args([
            "--batch-sizes",
            &list(plan.shapes.iter().map(|s| s.batch).collect()),
        ])
        .args(["--threads", &args.threads.to_string()])
        .args(["--duration", &plan.duration.as_secs_f64().to_string()])
        .args(["--pool", &plan.pool.to_string()])
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
    let rows = report["shapes"]
        .as_array()
        .context("the TCP fabric's bench reported no shapes")?;
    plan.shapes
        .iter()
        .map(|shape| {
            let gbps = rows
                .iter()
                .find(|row| {
                    row["op"] == shape.op_name()
                        && row["block_size"] == shape.block
                        && row["batch"] == shape.batch
                })
                .and_then(|row| row["gbps"].as_f64())
                .filter(|gbps| *gbps > 0.0)
                .with_context(|| {
                    format!(
                        "the TCP fabric's bench moved nothing for {} blocks of {} ({})",
                        shape.batch,
                        format_size(shape.block),
                        shape.op_name()
                    )
                })?;
            Ok(Ceiling {
                gbps,
                what: "railyard's TCP fabric on the same workload, run just before".into(),
            })
        })
        .collect()
}

/// Measures the fabric's ceiling — a plain TCP stream for the TCP fabric, memcpy on one
/// thread per rail for the others — shape by shape, moving bytes between memory of the
/// kinds the fabric moves them between: from `source` (this engine's region the requests
/// are sent from) into random block slots of a pool that this engine allocates as the
/// target allocates its own (the same backing: huge pages where it can), at most
/// [`MAX_CEILING_POOL`], freed by [`Self::finish`].
pub(super) struct CeilingBench<'a> {
    engine: &'a Engine,
    site: CeilingSite,
    tcp: bool,
    source: Region,
    pool: Option<Region>,
    round: Duration,
    seed: u64,
    measured: HashMap<(u64, u64), Ceiling>,
}

impl<'a> CeilingBench<'a> {
    /// `source` holds at least the largest block; the target's pool is `pool_len` bytes.
    pub(super) fn new(
        engine: &'a Engine,
        site: CeilingSite,
        tcp: bool,
        source: Region,
        pool_len: u64,
        round: Duration,
        seed: u64,
    ) -> anyhow::Result<Self> {
        // A target elsewhere reads the TCP stream itself: no pool here.
        let discarding_sink =
            tcp && matches!(site, CeilingSite::Remote(addr) if !addr.ip().is_loopback());
        let pool = if discarding_sink {
            None
        } else {
            Some(
                engine
                    .alloc_with_access(pool_len.min(MAX_CEILING_POOL), None, PeerAccess::None)
                    .context("allocating the ceiling's pool")?,
            )
        };
        Ok(Self {
            engine,
            site,
            tcp,
            source,
            pool,
            round,
            seed,
            measured: HashMap::new(),
        })
    }

    /// The ceiling of `shape`.
    pub(super) fn measure(&mut self, shape: &Shape) -> anyhow::Result<Ceiling> {
        let request_bytes = shape.request_bytes();
        // Both directions move the same bytes: one ceiling per block and batch.
        let key = (shape.block, request_bytes);
        if let Some(known) = self.measured.get(&key) {
            return Ok(known.clone());
        }
        // A request larger than the source takes its blocks in turn, as the bench does.
        let source_len = request_bytes.min(self.source.len / shape.block * shape.block);
        let source_bytes = local_slice(self.source, 0, source_len.max(shape.block));
        let pool_bytes: &mut [u8] = match self.pool {
            // Whole blocks only.
            Some(pool) => local_slice(pool, 0, pool.len / shape.block * shape.block),
            None => &mut [],
        };
        let ceiling = if self.tcp {
            let slice = self.engine.slice_size();
            let landing = if self.pool.is_none() {
                "to the target's TCP port, which discards them"
            } else {
                "into random slots"
            };
            Ceiling {
                gbps: tcp_ceiling(
                    &self.site,
                    source_bytes,
                    pool_bytes,
                    shape.block,
                    slice,
                    self.seed,
                    self.round,
                )?,
                what: format!(
                    "plain TCP stream of {} requests of {} blocks, cut at {} and sent \
                     {REQUESTS_PER_SEND} pieces per vectored write, {landing}, best of \
                     {TCP_CEILING_ROUNDS} rounds",
                    format_size(request_bytes),
                    format_size(shape.block),
                    format_size(slice as u64)
                ),
            }
        } else {
            let slots = pool_bytes.len() as u64 / shape.block;
            if slots == 0 {
                bail!(
                    "the ceiling's pool holds no block of {}",
                    format_size(shape.block)
                );
            }
            // A thread per rail, as long as each has a block of the pool to itself.
            let threads = self.engine.rails().min(slots as usize).max(1);
            let slice = self.engine.slice_size();
            Ceiling {
                gbps: memcpy_ceiling(
                    (source_bytes, shape.block as usize),
                    pool_bytes,
                    self.seed,
                    (threads, slice),
                    self.round,
                )?,
                what: format!(
                    "memcpy of the request's {} blocks, cut at {}, into random slots on {threads} \
                     thread(s), one per rail, best of {MEMCPY_CEILING_ROUNDS} rounds",
                    format_size(shape.block),
                    format_size(slice as u64)
                ),
            }
        };
        self.measured.insert(key, ceiling.clone());
        Ok(ceiling)
    }

    /// Forgets what was measured: the next [`Self::measure`] of each shape measures again.
    pub(super) fn forget(&mut self) {
        self.measured.clear();
    }

    /// Frees the ceiling's pool.
    pub(super) fn finish(self) -> anyhow::Result<()> {
        if let Some(pool) = self.pool {
            self.engine
                .deregister(pool)
                .context("freeing the ceiling's pool")?;
        }
        Ok(())
    }
}

/// The largest pool a ceiling allocates (a remote target's may be far larger than this
/// host can spare).
pub(super) const MAX_CEILING_POOL: u64 = 1 << 30;
