//! `railyard bench`: the main job. KV-cache-shaped transfers to a target, measured beside
//! the memcpy ceiling of this machine.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, IsTerminal};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use railyard::dataplane::fabric::tcp::REQUESTS_PER_SEND;
use railyard::dataplane::rng::SplitMix64;
use railyard::dataplane::{IdleStrategy, RequestOutcome};
use railyard::engine::{
    DirectoryChoice, Engine, FabricChoice, Op, Peer, PeerAccess, RailChoice, Region, Transfer,
    default_name,
};
use railyard::metrics::MetricsServer;

use super::size::{format_size, parse_size};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BenchOp {
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
    target: Option<String>,
    /// Where to find --target: p2p (by address) or etcd://HOST:PORT[,HOST:PORT...].
    #[arg(long, value_parser = super::parse_directory, default_value = "p2p")]
    directory: DirectoryChoice,
    /// This engine's segment name (default `bench-<host>-<pid>`). Two benches may share one:
    /// they are still two peers.
    #[arg(long)]
    name: Option<String>,
    /// Direction of the transfers.
    #[arg(long, value_enum, default_value = "write")]
    op: BenchOp,
    /// Bytes per block (one slice or more).
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    block_size: u64,
    /// Blocks per request (one batch per request).
    #[arg(long, default_value_t = 64)]
    batch: u64,
    /// Submitting threads, each with one request in flight.
    #[arg(long, default_value_t = 1)]
    threads: u64,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Software rails on both sides (default: one per NUMA node, from the topology plan).
    #[arg(long)]
    rails: Option<NonZeroUsize>,
    /// auto, soft, tcp, verbs or ofi (libfabric: --ofi-provider).
    #[arg(long, value_parser = super::parse_fabric, default_value = "auto")]
    fabric: FabricChoice,
    /// Pool of the target bench starts (ignored with --target).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pool: u64,
    /// Verify every byte: each request's blocks are read back (writes) or compared with
    /// what was written there first (reads), byte for byte; the exit status is non-zero
    /// when any byte differs or any request failed.
    #[arg(long)]
    check: bool,
    /// Seeds the block placement.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the results as one JSON object.
    #[arg(long)]
    json: bool,
    /// Serve this engine's Prometheus metrics at http://ADDR/metrics while it runs (port 0:
    /// any free port; stderr says which).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    #[command(flatten)]
    verbs: super::VerbsArgs,
    #[command(flatten)]
    secret: super::SecretArgs,
}

/// Largest block accepted.
const MAX_BLOCK: u64 = 1 << 30;
/// Most blocks per request.
const MAX_BATCH: u64 = 1 << 16;
/// Most threads.
const MAX_THREADS: u64 = 256;

fn validate(args: &BenchArgs) -> anyhow::Result<()> {
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

/// The target process bench started, stopped when dropped.
struct TargetChild(Child);

impl Drop for TargetChild {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_target(args: &BenchArgs, rails: usize) -> anyhow::Result<(TargetChild, SocketAddr)> {
    let mut command = Command::new(std::env::current_exe().context("finding this binary")?);
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--until-stdin-closes"])
        .args(["--name", &default_name("bench-target")])
        .args(["--pool", &args.pool.to_string()])
        .args([
            "--fabric",
            match args.fabric {
                FabricChoice::Auto => "auto",
                FabricChoice::Soft => "soft",
                FabricChoice::Tcp => "tcp",
                FabricChoice::Verbs => "verbs",
                FabricChoice::Ofi => "ofi",
            },
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // As many rails as this engine, always by count: the target runs on this host, and
    // pinning its pollers as planned would put them on the cores this process's pollers
    // spin on (a TCP target's poller is busy serving; two pollers on one core take turns
    // only at scheduler ticks).
    command.args(["--rails", &rails.to_string()]);
    if let Some(port) = args.verbs.ib_port {
        command.args(["--ib-port", &port.to_string()]);
    }
    if let Some(index) = args.verbs.gid_index {
        command.args(["--gid-index", &index.to_string()]);
    }
    if let Some(provider) = &args.verbs.ofi_provider {
        command.args(["--ofi-provider", provider]);
    }
    command.args(args.secret.options());
    let mut child = TargetChild(command.spawn().context("starting the target process")?);
    let stdout = child.0.stdout.take().context("the target's stdout")?;
    let (lines, first) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let ready = first.recv_timeout(Duration::from_secs(20)).ok();
    let addr = ready
        .as_deref()
        .and_then(|line| line.strip_prefix("listening "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|addr| addr.parse().ok());
    match addr {
        Some(addr) => {
            // Keep draining its output (notifications) so it never blocks on a full pipe.
            std::thread::spawn(move || for _ in first {});
            Ok((child, addr))
        }
        None => {
            let _ = child.0.kill();
            let mut stderr = String::new();
            if let Some(mut pipe) = child.0.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
            }
            bail!(
                "the target did not start: {}",
                stderr.lines().last().unwrap_or("no output")
            )
        }
    }
}

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
struct ThreadResult {
    latencies: Vec<Duration>,
    prepare: Duration,
    post: Duration,
    complete: Duration,
    requests: u64,
    failed_requests: u64,
    verified: u64,
    mismatches: u64,
}

struct Workload<'a> {
    engine: &'a Engine,
    peer: &'a Peer,
    local: Region,
    /// This thread's blocks start here in `local`; its check area follows them.
    local_offset: u64,
    remote_base: u64,
    /// This thread's slots of the target's pool: `first_slot..first_slot + slots`, no
    /// other thread's (so that a check never sees another thread's write).
    first_slot: u64,
    slots: u64,
    block: u64,
    batch: u64,
    op: Op,
    check: bool,
    seed: u64,
    stop: &'a AtomicBool,
    moved: &'a AtomicU64,
}

/// The slot tag the check pattern of a read uses: what the setup pass wrote there.
fn slot_tag(seed: u64, slot: u64) -> u64 {
    seed.wrapping_mul(31).wrapping_add(slot)
}

fn local_slice(region: Region, offset: u64, len: u64) -> &'static mut [u8] {
    // SAFETY:
    // - `offset + len` lies inside the engine-allocated region (the bench sized it), which
    //   lives until the engine drops, after every worker has joined.
    // - Each worker touches only its own blocks, and only while no transfer of its own is
    //   in flight (before submit and after completion).
    unsafe { std::slice::from_raw_parts_mut((region.addr + offset) as *mut u8, len as usize) }
}

fn run_worker(work: &Workload<'_>) -> anyhow::Result<ThreadResult> {
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
                local_offset: work.local_offset + j as u64 * work.block,
                remote_addr: work.remote_base + slot * work.block,
                len: work.block,
            })
            .collect();
        let started = Instant::now();
        let batch = submitter.submit(work.peer, &transfers)?;
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
        let batch = submitter.submit(work.peer, &transfers)?;
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
                slot_tag(work.seed, slot),
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

/// Writes the read-check pattern into every slot of the target's pool.
fn seed_pool(
    engine: &Engine,
    peer: &Peer,
    local: Region,
    args: &BenchArgs,
    remote_base: u64,
    slots: u64,
) -> anyhow::Result<()> {
    let mut submitter = engine.submitter()?;
    let block = args.block_size;
    let per_round = args.batch;
    let mut slot = 0;
    while slot < slots {
        let count = per_round.min(slots - slot);
        for j in 0..count {
            fill(
                local_slice(local, j * block, block),
                slot_tag(args.seed, slot + j),
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

/// What the fabric's results are compared with.
struct Ceiling {
    gbps: f64,
    what: String,
}

/// The same workload on railyard's TCP fabric, for as long: a `railyard bench --fabric tcp`
/// child with this bench's settings.
fn tcp_fabric_ceiling(args: &BenchArgs) -> anyhow::Result<Ceiling> {
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

/// Where the TCP ceiling's reader runs.
enum CeilingSite {
    /// A thread of this process on loopback: the target is on this host.
    Loopback,
    /// The TCP data port of a target elsewhere, which reads and discards (`open_sink`).
    Remote(SocketAddr),
}

/// The fabric's ceiling — a plain TCP stream for the TCP fabric, memcpy on one thread per
/// rail for the others — moving bytes between memory of the kinds the fabric moves them
/// between: from `source` (this engine's region the requests are sent from) into random
/// block slots of a pool of `pool_len` bytes that this engine allocates as the target
/// allocates its own (the same backing: huge pages where it can), at most
/// [`MAX_CEILING_POOL`], freed afterwards.
fn measure_ceiling(
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
/// Rounds of the TCP ceiling; the best counts.
const TCP_CEILING_ROUNDS: usize = 5;
/// How long the TCP ceiling's connection runs before its rounds are timed.
const TCP_CEILING_WARM_UP: Duration = Duration::from_millis(300);
/// How long each round of the TCP ceiling runs.
const TCP_CEILING_ROUND: Duration = Duration::from_millis(300);
/// Longest the TCP ceiling's writer or reader waits for the other to move a byte.
const CEILING_STALL: Duration = Duration::from_secs(10);
/// Rounds of the memcpy ceiling; the best counts.
const MEMCPY_CEILING_ROUNDS: usize = 5;

/// A plain TCP stream of the bench's requests — the blocks of `source` cut at `slice`
/// bytes and sent [`REQUESTS_PER_SEND`] pieces per vectored write, as the fabric sends a
/// batch's slices — to a reader that lands each `block`-sized
/// block in a random slot of `pool`, at most a slice per read, as a target lands writes: no protocol, no headers, no
/// replies. Writer and reader busy-poll non-blocking sockets, as the fabric's pollers do (a
/// blocking reader loses half the rate here to sleeping and waking). With the target on
/// this host the reader is a thread of this process on loopback (the socket path's own
/// ceiling, independent of railyard); otherwise the target's TCP data port reads and
/// discards (`open_sink`), and `pool` is not used.
///
/// One connection, warmed up first (a fresh one spends its first hundred milliseconds
/// growing its windows, which the fabric's long-lived connections have long done), then
/// timed in rounds at the writer: the bytes the kernel took per round, which differs from
/// what the reader took by at most the two socket buffers (a few MiB against the GB of a
/// round). The best round counts (an upper bound: on a small shared machine the others lost
/// time to something else).
fn tcp_ceiling(
    site: &CeilingSite,
    source: &[u8],
    pool: &mut [u8],
    block: u64,
    slice: usize,
    seed: u64,
) -> anyhow::Result<f64> {
    use std::io::{IoSlice, Read};
    let block = block as usize;
    let piece = slice.min(block).max(1);
    let remote = match site {
        CeilingSite::Remote(target) if !target.ip().is_loopback() => Some(*target),
        _ => None,
    };
    std::thread::scope(|scope| -> anyhow::Result<f64> {
        let (stream, reader) = match remote {
            Some(target) => {
                let sink = railyard::dataplane::fabric::tcp::open_sink(target, CEILING_STALL)
                    .with_context(|| {
                        format!(
                            "opening a raw stream to the target's TCP port {target} (a target with a \
                             cluster secret takes one only with `railyard serve \
                             --accept-sinks`)"
                        )
                    })?;
                (sink, None)
            }
            None => {
                let listener = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
                let addr = listener.local_addr()?;
                let pool = &mut *pool;
                listener.set_nonblocking(true)?;
                let reader = scope.spawn(move || -> std::io::Result<()> {
                    let socket = accept_within(&listener, CEILING_STALL)?;
                    let mut rng = SplitMix64::new(seed);
                    let slots = (pool.len() / block) as u64;
                    loop {
                        let at = rng.below(slots) as usize * block;
                        let mut got = 0;
                        while got < block {
                            // At most a slice per read, as the fabric receives a slice into
                            // its place.
                            let end = at + block.min(got + piece);
                            match read_spinning(&mut &socket, &mut pool[at + got..end])? {
                                0 => return Ok(()),
                                read => got += read,
                            }
                        }
                    }
                });
                (std::net::TcpStream::connect(addr)?, Some(reader))
            }
        };
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        // Sends the request's blocks for `duration`: the bytes the kernel took.
        let pieces: Vec<&[u8]> = source.chunks(piece).collect();
        let send_for = |duration: Duration| -> anyhow::Result<u64> {
            let started = Instant::now();
            let mut moved = 0u64;
            while started.elapsed() < duration {
                for send in pieces.chunks(REQUESTS_PER_SEND) {
                    let mut iov: Vec<IoSlice<'_>> = send.iter().map(|p| IoSlice::new(p)).collect();
                    let mut left: &mut [IoSlice<'_>] = &mut iov;
                    while !left.is_empty() {
                        let written = write_spinning(&stream, left)?;
                        IoSlice::advance_slices(&mut left, written);
                        moved += written as u64;
                    }
                }
            }
            Ok(moved)
        };
        send_for(TCP_CEILING_WARM_UP).with_context(|| match remote {
            Some(target) => format!(
                "the target's TCP port {target} closed the raw stream (a target with a cluster \
                 secret takes one only with `railyard serve --accept-sinks`)"
            ),
            None => "the ceiling's stream failed".into(),
        })?;
        let mut best = 0.0f64;
        for _ in 0..TCP_CEILING_ROUNDS {
            let started = Instant::now();
            let moved = send_for(TCP_CEILING_ROUND)?;
            best = best.max(moved as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
        stream.set_nonblocking(false)?;
        stream.shutdown(std::net::Shutdown::Write)?;
        match reader {
            Some(reader) => reader
                .join()
                .map_err(|_| anyhow::anyhow!("the ceiling's reader panicked"))??,
            None => {
                // The target closes once it has read the end of the stream.
                stream.set_read_timeout(Some(CEILING_STALL))?;
                let mut end = [0u8; 1];
                let _ = (&stream).read(&mut end);
            }
        }
        Ok(best)
    })
}

/// The first connection to a non-blocking `listener`, waited for at most `bound`.
fn accept_within(
    listener: &std::net::TcpListener,
    bound: Duration,
) -> std::io::Result<std::net::TcpStream> {
    let began = Instant::now();
    loop {
        match listener.accept() {
            Ok((socket, _)) => {
                socket.set_nonblocking(true)?;
                return Ok(socket);
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if began.elapsed() > bound {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the ceiling's writer never connected",
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(error) => return Err(error),
        }
    }
}

/// One vectored write to a non-blocking `stream`, spinning while its send buffer is full:
/// the bytes taken (at least one).
fn write_spinning(
    mut stream: &std::net::TcpStream,
    blocks: &[std::io::IoSlice<'_>],
) -> anyhow::Result<usize> {
    use std::io::Write;
    let waiting_since = Instant::now();
    loop {
        match stream.write_vectored(blocks) {
            Ok(0) => bail!("the ceiling's reader stopped taking bytes"),
            Ok(written) => return Ok(written),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if waiting_since.elapsed() > CEILING_STALL {
                    bail!("the ceiling's reader took no byte for {CEILING_STALL:?}");
                }
                std::hint::spin_loop();
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// One read from a non-blocking `socket` into `buffer`, spinning while nothing has
/// arrived: the bytes read (0 at the end of the stream).
fn read_spinning(socket: &mut impl std::io::Read, buffer: &mut [u8]) -> std::io::Result<usize> {
    let waiting_since = Instant::now();
    loop {
        match socket.read(buffer) {
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if waiting_since.elapsed() > CEILING_STALL {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the ceiling's writer sent nothing",
                    ));
                }
                std::hint::spin_loop();
            }
            result => return result,
        }
    }
}

/// memcpy of `block` into random block slots of `pool` on `threads` threads (one per
/// rail), each into its own part of the pool: this machine's ceiling for the copies the
/// soft fabric's rails make, measured over the same shape. The best of a few rounds counts.
fn memcpy_ceiling(block: &[u8], pool: &mut [u8], seed: u64, threads: usize) -> anyhow::Result<f64> {
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

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn micros(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e7).round() / 10.0
}

pub(crate) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    validate(args)?;
    args.verbs.check(args.fabric)?;
    let request_bytes = args.block_size * args.batch;
    let rails = args.rails.map_or(RailChoice::Plan, RailChoice::Count);
    // A name of its own, so that two benches never claim the same one in a directory.
    let name = args.name.clone().unwrap_or_else(|| default_name("bench"));
    if args.target.is_none() && args.pool / args.block_size < args.batch {
        bail!(
            "--pool {} holds {} blocks of {}, but a request needs {} (--batch)",
            format_size(args.pool),
            args.pool / args.block_size,
            format_size(args.block_size),
            args.batch
        );
    }
    // With the target on this host, the ceiling is measured first, on an engine of its own
    // whose pollers park while idle, before this bench's engine and its target start:
    // nothing of railyard runs beside it. (Measured beside spinning or yielding pollers,
    // the ceiling would lose cores to them, and a ratio above 1.0 would follow.)
    // libfabric off EFA replaces railyard's TCP fabric: its ratio is against that fabric,
    // run on the same workload just before, by a bench of its own.
    let ceiling_with_the_machine_to_itself = match args.target {
        Some(_) => None,
        None if args.fabric == FabricChoice::Ofi => Some(tcp_fabric_ceiling(args)?),
        None => {
            let ceiling_engine = args
                .secret
                .apply(args.verbs.apply(Engine::builder(format!("{name}-ceiling"))))?
                .fabric(args.fabric)
                .rails(rails)
                .idle(IdleStrategy::SpinThenPark {
                    spins: 64,
                    park: Duration::from_millis(1),
                })
                .build()
                .context("starting the ceiling's engine")?;
            let source = ceiling_engine
                .alloc_with_access(request_bytes, None, PeerAccess::None)
                .context("allocating the ceiling's source")?;
            Some(measure_ceiling(
                args,
                &ceiling_engine,
                CeilingSite::Loopback,
                source,
                args.pool,
                args.fabric == FabricChoice::Tcp,
            )?)
        }
    };
    let engine = args
        .secret
        .apply(args.verbs.apply(Engine::builder(name)))?
        .fabric(args.fabric)
        .rails(rails)
        .directory(args.directory.clone())
        .build()
        .context("starting the engine")?;
    let metrics = match args.metrics {
        Some(addr) => {
            let server = MetricsServer::start(&engine, addr)
                .with_context(|| format!("serving metrics on {addr}"))?;
            eprintln!(
                "railyard bench: metrics at http://{}/metrics",
                server.addr()
            );
            Some(server)
        }
        None => None,
    };
    // Each thread: its request's blocks, then a check area as large.
    let per_thread = request_bytes * 2;
    // Only this engine's transfers touch its buffers: peers get no access to them.
    let local = engine
        .alloc_with_access(per_thread * args.threads, None, PeerAccess::None)
        .context("allocating the local buffers")?;
    let (_child, target) = match &args.target {
        Some(target) => (None, target.clone()),
        None => {
            let (child, addr) = start_target(args, engine.rails())?;
            (Some(child), addr.to_string())
        }
    };
    let peer = engine
        .open(&target)
        .with_context(|| format!("opening the target {target}"))?;
    let descriptor = peer.descriptor();
    let Some(pool) = descriptor.regions.iter().max_by_key(|r| r.len) else {
        bail!("the target {target} has registered no memory");
    };
    let slots = pool.len / args.block_size;
    if slots < args.batch {
        bail!(
            "the target's pool of {} holds {slots} blocks of {}, but a request needs {} (--batch)",
            format_size(pool.len),
            format_size(args.block_size),
            args.batch
        );
    }
    let remote_base = pool.base;
    let slots_per_thread = slots / args.threads;
    if slots_per_thread < args.batch {
        bail!(
            "the target's pool holds {slots} blocks of {}: not {} per thread (--batch) for {} \
             threads, each writing its own",
            format_size(args.block_size),
            args.batch,
            args.threads
        );
    }
    let op = match args.op {
        BenchOp::Write => Op::Write,
        BenchOp::Read => Op::Read,
    };
    if args.check && op == Op::Read {
        seed_pool(&engine, &peer, local, args, remote_base, slots)?;
    }

    let ceiling = match ceiling_with_the_machine_to_itself {
        Some(ceiling) => ceiling,
        // A target elsewhere: measured now, before the run, beside this engine's idle
        // pollers; the TCP ceiling when the engine reached the peer over TCP (`auto` does
        // for another host), its TCP port taking the plain stream.
        None => measure_ceiling(
            args,
            &engine,
            CeilingSite::Remote(SocketAddr::new(
                peer.addr().ip(),
                descriptor.rails.first().map_or(0, |rail| rail.tcp_port),
            )),
            local,
            pool.len,
            // libfabric off EFA stands in for TCP: a remote target's ratio is against it too.
            engine.stats().control.tcp_qps > 0 || args.fabric == FabricChoice::Ofi,
        )?,
    };
    let stop = AtomicBool::new(false);
    let moved = AtomicU64::new(0);
    let duration = Duration::from_secs_f64(args.duration);
    let tty = std::io::stderr().is_terminal() && !args.json;
    let started = Instant::now();
    let results = std::thread::scope(|scope| -> anyhow::Result<Vec<ThreadResult>> {
        let workers: Vec<_> = (0..args.threads)
            .map(|thread| {
                let work = Workload {
                    engine: &engine,
                    peer: &peer,
                    local,
                    local_offset: thread * per_thread,
                    remote_base,
                    first_slot: thread * slots_per_thread,
                    slots: slots_per_thread,
                    block: args.block_size,
                    batch: args.batch,
                    op,
                    check: args.check,
                    seed: args.seed.wrapping_add(thread.wrapping_mul(0x9E37)),
                    stop: &stop,
                    moved: &moved,
                };
                scope.spawn(move || run_worker(&work))
            })
            .collect();
        let mut last_line = Instant::now();
        while started.elapsed() < duration {
            std::thread::sleep(Duration::from_millis(100));
            let elapsed = started.elapsed().min(duration);
            let gbps = moved.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64() / 1e9;
            if tty {
                let width = 30;
                let filled =
                    (width as f64 * elapsed.as_secs_f64() / duration.as_secs_f64()) as usize;
                eprint!(
                    "\r[{}{}] {:>5.1}/{:.1} s  {gbps:>7.2} GB/s",
                    "=".repeat(filled),
                    " ".repeat(width - filled.min(width)),
                    elapsed.as_secs_f64(),
                    duration.as_secs_f64()
                );
            } else if !args.json && last_line.elapsed() >= Duration::from_secs(1) {
                eprintln!("{:>5.1} s  {gbps:.2} GB/s", elapsed.as_secs_f64());
                last_line = Instant::now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        if tty {
            eprintln!();
        }
        workers
            .into_iter()
            .map(|worker| {
                worker
                    .join()
                    .map_err(|_| anyhow::anyhow!("a worker thread panicked"))?
            })
            .collect()
    })?;
    let elapsed = started.elapsed();

    let mut latencies: Vec<Duration> = results
        .iter()
        .flat_map(|r| r.latencies.iter().copied())
        .collect();
    latencies.sort();
    let requests: u64 = results.iter().map(|r| r.requests).sum();
    let failed: u64 = results.iter().map(|r| r.failed_requests).sum();
    let bytes = moved.load(Ordering::Relaxed);
    let gbps = bytes as f64 / elapsed.as_secs_f64() / 1e9;
    let per_request = |total: Duration| {
        if requests == 0 {
            0.0
        } else {
            micros(total) / requests as f64
        }
    };
    let prepare = per_request(results.iter().map(|r| r.prepare).sum());
    let post = per_request(results.iter().map(|r| r.post).sum());
    let complete = per_request(results.iter().map(|r| r.complete).sum());
    let avg = if latencies.is_empty() {
        Duration::ZERO
    } else {
        latencies.iter().sum::<Duration>() / latencies.len() as u32
    };
    // Which fabric reached the target: with `auto`, TCP only for a peer on another host.
    let tcp_queue_pairs = engine.stats().control.tcp_qps;
    let verified: u64 = results.iter().map(|r| r.verified).sum();
    let mismatches: u64 = results.iter().map(|r| r.mismatches).sum();
    let backing = local.backing.map_or("user memory", |b| b.describe());
    let report = serde_json::json!({
        "op": match op { Op::Write => "write", Op::Read => "read" },
        "target": target,
        "fabric": engine.fabric(),
        "rails": engine.rails(),
        "threads": args.threads,
        "block_size": args.block_size,
        "batch": args.batch,
        "request_bytes": request_bytes,
        "duration_s": (elapsed.as_secs_f64() * 1000.0).round() / 1000.0,
        "requests": requests,
        "failed_requests": failed,
        "bytes": bytes,
        "gbps": (gbps * 1000.0).round() / 1000.0,
        "requests_per_s": (requests as f64 / elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "latency_us": {
            "avg": micros(avg),
            "p50": micros(percentile(&latencies, 0.5)),
            "p99": micros(percentile(&latencies, 0.99)),
        },
        "time_us": {
            "prepare": (prepare * 10.0).round() / 10.0,
            "post": (post * 10.0).round() / 10.0,
            "complete": (complete * 10.0).round() / 10.0,
        },
        "ceiling": ceiling.what,
        "ceiling_gbps": (ceiling.gbps * 1000.0).round() / 1000.0,
        "ratio": ((gbps / ceiling.gbps) * 1000.0).round() / 1000.0,
        "local_memory": backing,
        "tcp_queue_pairs": tcp_queue_pairs,
        "reconnects": engine.stats().control.reconnects,
        "teardowns": engine.stats().control.teardowns,
        "check": { "enabled": args.check, "verified_bytes": verified, "mismatches": mismatches },
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{:>10} {:>6} {:>9} {:>11} {:>10} {:>10} {:>10}   {:>8} {:>8} {:>9}",
            "block",
            "batch",
            "GB/s",
            "requests/s",
            "avg us",
            "p50 us",
            "p99 us",
            "prepare",
            "post",
            "complete"
        );
        println!(
            "{:>10} {:>6} {:>9.2} {:>11.1} {:>10.1} {:>10.1} {:>10.1}   {:>8.1} {:>8.1} {:>9.1}",
            format_size(args.block_size),
            args.batch,
            gbps,
            requests as f64 / elapsed.as_secs_f64(),
            micros(avg),
            micros(percentile(&latencies, 0.5)),
            micros(percentile(&latencies, 0.99)),
            prepare,
            post,
            complete
        );
        println!(
            "ceiling ({}): {:.2} GB/s; ratio {:.2}",
            ceiling.what,
            ceiling.gbps,
            gbps / ceiling.gbps
        );
        println!(
            "{} requests ({} of {} each), {} thread(s), {} rail(s), local memory: {backing}",
            requests,
            if op == Op::Write { "writes" } else { "reads" },
            format_size(request_bytes),
            args.threads,
            engine.rails()
        );
        if args.check {
            println!(
                "check: {} verified, {mismatches} mismatching block(s)",
                format_size(verified)
            );
        }
        if failed > 0 {
            println!("{failed} request(s) failed");
        }
    }
    // Stop this engine before the target it started: otherwise it sees the target go away
    // and reports reconnecting to it. (The metrics server first: a scrape in progress
    // holds the engine.)
    drop(metrics);
    drop(peer);
    drop(engine);
    if args.check && mismatches > 0 {
        bail!("{mismatches} block(s) did not hold what was written");
    }
    if args.check && failed > 0 {
        bail!("{failed} request(s) failed");
    }
    Ok(())
}
