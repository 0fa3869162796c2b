//! What `railyard bench` accepts on its command line (the request's shape, the run, the
//! target and the engine's settings) and which values it refuses.

use std::net::SocketAddr;
use std::num::NonZeroUsize;

use anyhow::bail;
use clap::{Args, ValueEnum};
use railyard::engine::{DirectoryChoice, FabricChoice};

use crate::cli::engine_args::{SecretArgs, VerbsArgs, parse_directory, parse_fabric};
use crate::cli::size::{format_size, parse_size};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum BenchOp {
    Write,
    Read,
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
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    pub(super) duration: f64,
    /// Software rails on both sides (default: one per NUMA node, from the topology plan).
    #[arg(long)]
    pub(super) rails: Option<NonZeroUsize>,
    /// auto, soft, tcp, verbs or ofi (libfabric: --ofi-provider).
    #[arg(long, value_parser = parse_fabric, default_value = "auto")]
    pub(super) fabric: FabricChoice,
    /// Pool of the target bench starts (ignored with --target).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pub(super) pool: u64,
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
    /// Serve this engine's Prometheus metrics at http://ADDR/metrics while it runs (port 0:
    /// any free port; stderr says which).
    #[arg(long, value_name = "ADDR")]
    pub(super) metrics: Option<SocketAddr>,
    #[command(flatten)]
    pub(super) verbs: VerbsArgs,
    #[command(flatten)]
    pub(super) secret: SecretArgs,
}

/// Largest block accepted.
const MAX_BLOCK: u64 = 1 << 30;
/// Most blocks per request.
const MAX_BATCH: u64 = 1 << 16;
/// Most threads.
const MAX_THREADS: u64 = 256;

pub(super) fn validate(args: &BenchArgs) -> anyhow::Result<()> {
    if args.block_size == 0 || args.block_size > MAX_BLOCK {
        bail!(
            "--block-size {} must be between 1 byte and {}",
            args.block_size,
            format_size(MAX_BLOCK)
        );
    }
    if args.batch == 0 || args.batch > MAX_BATCH {
        bail!("--batch {} must be between 1 and {MAX_BATCH}", args.batch);
    }
    if args.threads == 0 || args.threads > MAX_THREADS {
        bail!(
            "--threads {} must be between 1 and {MAX_THREADS}",
            args.threads
        );
    }
    if !(args.duration > 0.0 && args.duration <= 86_400.0) {
        bail!(
            "--duration {} must be between 0 and 86400 seconds",
            args.duration
        );
    }
    Ok(())
}
