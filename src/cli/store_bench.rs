//! `railyard store bench`: store throughput and latency against a live master — clients
//! (threads, each with its own engine) putting and getting batches of values through the
//! store, reported as GB/s, objects/s and per-batch latency p50/p99/p999.

use std::io::{IsTerminal, Write};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use railyard::engine::{Engine, FabricChoice, RailChoice, default_name};
use railyard::store::{LocalRange, ReplicaConfig, Store, StoreOptions};

use super::duration::parse_duration;
use super::engine_args::{SecretArgs, parse_fabric};
use super::size::{format_size, parse_size};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BenchOp {
    Put,
    Get,
    Mixed,
    /// `batch_exists` of the batch's keys: the master's rate, no data moved.
    Exists,
}

#[derive(Debug, Args)]
pub(crate) struct StoreBenchArgs {
    /// The master's address.
    #[arg(long, default_value = "127.0.0.1:7500")]
    master: String,
    /// Client threads, each with its own engine and store client.
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    clients: NonZeroUsize,
    /// Bytes per value.
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    value_size: u64,
    /// Values per batch call (`batch_put_from`, `batch_get_into`).
    #[arg(long, default_value_t = NonZeroUsize::new(32).expect("32"))]
    batch: NonZeroUsize,
    /// Replicas per value.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// put, get, mixed (alternating batches) or exists (batch_exists: the master alone).
    #[arg(long, value_enum, default_value = "put")]
    op: BenchOp,
    /// How long to measure.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    duration: Duration,
    /// auto, soft, tcp, verbs or ofi.
    #[arg(long, value_parser = parse_fabric, default_value = "auto")]
    fabric: FabricChoice,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    secret: SecretArgs,
}

/// What one op measured across clients.
#[derive(Default)]
struct Tally {
    batches: Vec<Duration>,
    objects: u64,
    failed: u64,
}

pub(crate) fn run(args: &StoreBenchArgs) -> anyhow::Result<()> {
    if args.value_size == 0 {
        bail!("--value-size must be more than 0 bytes");
    }
    let buffer = args
        .value_size
        .checked_mul(args.batch.get() as u64)
        .context("--value-size × --batch overflows")?;
    let secret = args.secret.secret()?;
    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let tallies: [Mutex<Tally>; 3] = Default::default();
    // The clock starts once every client has its engine, its connection and its values.
    let ready = Barrier::new(args.clients.get() + 1);
    let results = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..args.clients.get())
            .map(|client| {
                let (stop, progress, tallies, secret, ready) =
                    (&stop, &progress, &tallies, secret.clone(), &ready);
                scope.spawn(move || {
                    bench_client(args, client, buffer, secret, stop, progress, tallies, ready)
                })
            })
            .collect();
        ready.wait();
        let started = Instant::now();
        let terminal = std::io::stderr().is_terminal() && !args.json;
        while started.elapsed() < args.duration && !clients.iter().all(|c| c.is_finished()) {
            std::thread::sleep(Duration::from_millis(250));
            if terminal {
                let done = progress.load(Ordering::Relaxed);
                eprint!(
                    "\r{:>5.1}/{:.0} s  {done} objects",
                    started
                        .elapsed()
                        .as_secs_f64()
                        .min(args.duration.as_secs_f64()),
                    args.duration.as_secs_f64()
                );
            }
        }
        if terminal {
            eprintln!();
        }
        stop.store(true, Ordering::Relaxed);
        let elapsed = started.elapsed();
        let joined: Vec<anyhow::Result<()>> = clients
            .into_iter()
            .map(|client| {
                client
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client panicked")))
            })
            .collect();
        (joined, elapsed)
    });
    let (results, elapsed) = results;
    for result in results {
        result?;
    }
    let mut out = std::io::stdout().lock();
    let mut reports = Vec::new();
    for (name, tally) in ["put", "get", "exists"].iter().zip(&tallies) {
        let mut tally = tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if tally.batches.is_empty() {
            continue;
        }
        tally.batches.sort();
        let bytes = if *name == "exists" {
            0
        } else {
            tally.objects * args.value_size
        };
        let seconds = elapsed.as_secs_f64();
        let gbps = bytes as f64 / seconds / 1e9;
        let objects_per_s = tally.objects as f64 / seconds;
        let (p50, p99, p999) = (
            percentile(&tally.batches, 0.5),
            percentile(&tally.batches, 0.99),
            percentile(&tally.batches, 0.999),
        );
        if args.json {
            reports.push(serde_json::json!({
                "op": name,
                "clients": args.clients.get(),
                "value_size": args.value_size,
                "batch": args.batch.get(),
                "replicas": args.replicas,
                "duration_s": (seconds * 1000.0).round() / 1000.0,
                "requests": tally.objects,
                "failed_requests": tally.failed,
                "bytes": bytes,
                "gbps": (gbps * 1000.0).round() / 1000.0,
                "requests_per_s": (objects_per_s * 10.0).round() / 10.0,
                "batch_latency_us": { "p50": micros(p50), "p99": micros(p99), "p999": micros(p999) },
            }));
        } else {
            writeln!(
                out,
                "{name}: {gbps:.2} GB/s, {objects_per_s:.0} objects/s ({} of {} in batches of {}, {} failed); batch latency p50 {:.0} µs, p99 {:.0} µs, p999 {:.0} µs",
                tally.objects,
                format_size(args.value_size),
                args.batch,
                tally.failed,
                micros(p50),
                micros(p99),
                micros(p999),
            )?;
        }
    }
    if args.json {
        writeln!(out, "{}", serde_json::json!({ "store_bench": reports }))?;
    }
    Ok(())
}

/// One client, which reaches `ready` whether or not it could set itself up (so that nobody
/// waits there for it forever).
#[allow(clippy::too_many_arguments)]
fn bench_client(
    args: &StoreBenchArgs,
    client: usize,
    buffer: u64,
    secret: Option<railyard::engine::ClusterSecret>,
    stop: &AtomicBool,
    progress: &AtomicU64,
    tallies: &[Mutex<Tally>; 3],
    ready: &Barrier,
) -> anyhow::Result<()> {
    let mut waited = false;
    let result = run_client(
        args,
        client,
        buffer,
        secret,
        stop,
        progress,
        tallies,
        ready,
        &mut waited,
    );
    if !waited {
        ready.wait();
    }
    result
}

/// One client: its own engine and store, putting (and getting) batches until told to stop.
#[allow(clippy::too_many_arguments)]
fn run_client(
    args: &StoreBenchArgs,
    client: usize,
    buffer: u64,
    secret: Option<railyard::engine::ClusterSecret>,
    stop: &AtomicBool,
    progress: &AtomicU64,
    tallies: &[Mutex<Tally>; 3],
    ready: &Barrier,
    waited: &mut bool,
) -> anyhow::Result<()> {
    let mut builder = Engine::builder(default_name(&format!("store-bench-{client}")))
        .listen("127.0.0.1:0".parse()?)
        .fabric(args.fabric)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(railyard::dataplane::IdleStrategy::gentle());
    if let Some(secret) = &secret {
        builder = builder.secret(secret.clone());
    }
    let engine = builder.build().context("starting a client's engine")?;
    let store = Store::connect(
        &engine,
        StoreOptions {
            secret,
            staging: 1 << 20,
            ..StoreOptions::new(&args.master)
        },
    )?;
    let source = engine
        .alloc(buffer, None)
        .context("allocating the values")?;
    let sink = engine
        .alloc(buffer, None)
        .context("allocating the read buffer")?;
    let ranges = |region| -> Vec<LocalRange> {
        (0..args.batch.get() as u64)
            .map(|i| LocalRange {
                region,
                offset: i * args.value_size,
                len: args.value_size,
            })
            .collect()
    };
    let (sources, sinks) = (ranges(source), ranges(sink));
    let config = ReplicaConfig {
        replica_num: args.replicas,
        ..ReplicaConfig::default()
    };
    let prefix = format!("bench/{}/{client}", engine.incarnation());
    let mut round = 0u64;
    // A batch to read from, written before the clock counts (get and mixed).
    let resident: Vec<String> = (0..args.batch.get())
        .map(|i| format!("{prefix}/resident/{i}"))
        .collect();
    if args.op != BenchOp::Put {
        for result in store.batch_put_from(&resident, &sources, &config) {
            result.context("writing the values to read")?;
        }
    }
    ready.wait();
    *waited = true;
    while !stop.load(Ordering::Relaxed) {
        // 0: put, 1: get, 2: exists.
        let op = match args.op {
            BenchOp::Put => 0,
            BenchOp::Get => 1,
            BenchOp::Mixed => usize::from(round % 2 == 1),
            BenchOp::Exists => 2,
        };
        round += 1;
        let began = Instant::now();
        let (ok, failed, written) = if op == 2 {
            let answers = store.batch_exists(&resident);
            let ok = answers.iter().filter(|a| matches!(a, Ok(true))).count() as u64;
            (ok, answers.len() as u64 - ok, None)
        } else if op == 0 {
            let keys: Vec<String> = (0..args.batch.get())
                .map(|i| format!("{prefix}/{round}/{i}"))
                .collect();
            let results = store.batch_put_from(&keys, &sources, &config);
            let ok = results.iter().filter(|r| r.is_ok()).count() as u64;
            (ok, results.len() as u64 - ok, Some(keys))
        } else {
            let results = store.batch_get_into(&resident, &sinks);
            let ok = results.iter().filter(|r| r.is_ok()).count() as u64;
            (ok, results.len() as u64 - ok, None)
        };
        let took = began.elapsed();
        {
            let mut tally = tallies[op]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            tally.batches.push(took);
            tally.objects += ok;
            tally.failed += failed;
        }
        progress.fetch_add(ok, Ordering::Relaxed);
        if let Some(keys) = written {
            // Not timed: keeps the store from filling up over a long run.
            store.batch_remove(&keys, true);
        }
    }
    let _ = store.batch_remove(&resident, true);
    Ok(())
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
