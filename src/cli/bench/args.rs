//! What `railyard bench` accepts on its command line (the request's shape or the shapes of
//! a sweep, the run, the target and the engine's settings) and which values it refuses.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, ValueEnum};
use railyard::engine::{DirectoryChoice, FabricChoice};

use crate::cli::engine_args::{
    EngineSecretArgs, VerbsArgs, parse_directory, parse_fabric, parse_metrics_addr,
};
use crate::cli::size::{format_size, parse_size};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum BenchOp {
    Write,
    Read,
    /// Writes, then reads, of every shape.
    Both,
}

/// The default workload is KV-cache shaped: one request is one sequence's KV cache, `--batch`
/// blocks (default 64: 32 layers × K and V) of `--block-size` bytes (default 64 KiB: 16
/// tokens × 16 KV heads × 128 dims × fp16), placed at random block slots of the target's
/// pool and written (or read) as one batch per request.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// A running `railyard serve`: host:port, or its name with --directory. Without it,
    /// bench starts one itself.
    #[arg(long)]
    pub(super) target: Option<String>,
    /// Where to find --target: p2p (by address) or etcd://HOST:PORT[,HOST:PORT...].
    #[arg(long, value_parser = parse_directory, default_value = "p2p")]
    pub(super) directory: DirectoryChoice,
    /// This engine's segment name (default `bench-<host>-<pid>`). Two benches may share one:
    /// they are still two peers.
    #[arg(long)]
    pub(super) name: Option<String>,
    /// Direction of the transfers.
    #[arg(long, value_enum, default_value = "write")]
    pub(super) op: BenchOp,
    /// Bytes per block (one slice or more).
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    pub(super) block_size: u64,
    /// Blocks per request (one batch per request).
    #[arg(long, default_value_t = 64)]
    pub(super) batch: u64,
    /// Submitting threads, each with one request in flight.
    #[arg(long, default_value_t = 1)]
    pub(super) threads: u64,
    /// Seconds to run (each shape of a sweep, each size of --latency). Default: 5 for one
    /// shape, 1 per shape or size otherwise.
    #[arg(long)]
    pub(super) duration: Option<f64>,
    /// Measure every shape of --block-sizes × --batch-sizes, one table row each, each
    /// beside its own ceiling measured in the same run.
    #[arg(long, conflicts_with_all = ["block_size", "batch", "latency"])]
    pub(super) sweep: bool,
    /// The block sizes a sweep measures, comma-separated (default 4KiB to 64MiB in powers of
    /// 4).
    #[arg(long, value_parser = parse_size, value_delimiter = ',')]
    pub(super) block_sizes: Vec<u64>,
    /// The batch sizes (blocks per request) a sweep measures, comma-separated (default
    /// 1,16,128).
    #[arg(long, value_delimiter = ',', requires = "sweep")]
    pub(super) batch_sizes: Vec<u64>,
    /// Print the results as CSV, one row per shape.
    #[arg(long, conflicts_with = "json")]
    pub(super) csv: bool,
    /// Draw the sweep into this SVG file: GB/s and p99 latency against block size, one
    /// line per batch size, and the ceiling.
    #[arg(long, value_name = "FILE.svg", requires = "sweep")]
    pub(super) plot: Option<PathBuf>,
    /// Round trips instead of throughput: one write of each --block-sizes size (default
    /// 4KiB to 1MiB) and its notification there, answered by the target's write and
    /// notification back; p50/p99/p999 beside a ping-pong of the fabric's ceiling.
    #[arg(long, conflicts_with_all = [
        "block_size", "batch", "threads", "check", "plot", "op", "csv", "pool", "metrics", "seed",
    ])]
    pub(super) latency: bool,
    /// Fewest round trips per size with --latency (it runs for --duration too).
    #[arg(long, default_value_t = 10_000, requires = "latency")]
    pub(super) round_trips: u64,
    /// Software rails on both sides (default: one per NUMA node, from the topology plan).
    #[arg(long)]
    pub(super) rails: Option<NonZeroUsize>,
    /// auto, soft, tcp, verbs or ofi (libfabric: --ofi-provider).
    #[arg(long, value_parser = parse_fabric, default_value = "auto")]
    pub(super) fabric: FabricChoice,
    /// Pool of the target bench starts (with --target, the target's own pool counts).
    /// Default 256 MiB; a sweep's default fits its largest request, up to 1 GiB (larger
    /// shapes are skipped and said so).
    #[arg(long, value_parser = parse_size)]
    pub(super) pool: Option<u64>,
    /// Verify every byte: each request's blocks are read back (writes) or compared with
    /// what was written there first (reads), byte for byte; the exit status is non-zero
    /// when any byte differs or any request failed.
    #[arg(long)]
    pub(super) check: bool,
    /// Seeds the block placement.
    #[arg(long, default_value_t = 1)]
    pub(super) seed: u64,
    /// Print the results as one JSON object.
    #[arg(long)]
    pub(super) json: bool,
    /// Serve this engine's Prometheus metrics at http://ADDR/metrics while it runs (a bare port
    /// is loopback, 127.0.0.1; port 0:
    /// any free port; stderr says which).
    #[arg(long, value_name = "[IP:]PORT", value_parser = parse_metrics_addr)]
    pub(super) metrics: Option<SocketAddr>,
    #[command(flatten)]
    pub(super) verbs: VerbsArgs,
    #[command(flatten)]
    pub(super) secret: EngineSecretArgs,
}

/// Largest block accepted.
const MAX_BLOCK: u64 = 1 << 30;
/// Most blocks per request.
const MAX_BATCH: u64 = 1 << 16;
/// Most threads.
const MAX_THREADS: u64 = 256;
/// Most shapes in one sweep.
const MAX_SHAPES: usize = 256;

pub(super) fn validate(args: &BenchArgs) -> anyhow::Result<()> {
    let blocks = if args.block_sizes.is_empty() {
        vec![args.block_size]
    } else {
        args.block_sizes.clone()
    };
    for block in blocks {
        if block == 0 || block > MAX_BLOCK {
            bail!(
                "block size {} must be between 1 byte and {}",
                block,
                format_size(MAX_BLOCK)
            );
        }
    }
    let batches = if args.batch_sizes.is_empty() {
        vec![args.batch]
    } else {
        args.batch_sizes.clone()
    };
    for batch in batches {
        if batch == 0 || batch > MAX_BATCH {
            bail!("batch size {batch} must be between 1 and {MAX_BATCH}");
        }
    }
    let sized = args.sweep || args.latency;
    if !args.block_sizes.is_empty() && !sized {
        bail!("--block-sizes lists the sizes of a --sweep or of --latency: add one of them");
    }
    if args.block_sizes.len().max(1) * args.batch_sizes.len().max(1) > MAX_SHAPES {
        bail!("a sweep measures at most {MAX_SHAPES} shapes");
    }
    if args.threads == 0 || args.threads > MAX_THREADS {
        bail!(
            "--threads {} must be between 1 and {MAX_THREADS}",
            args.threads
        );
    }
    if let Some(duration) = args.duration
        && !(duration > 0.0 && duration <= 86_400.0)
    {
        bail!("--duration {duration} must be between 0 and 86400 seconds");
    }
    if args.latency && args.round_trips == 0 {
        bail!("--round-trips must be at least 1");
    }
    Ok(())
}
