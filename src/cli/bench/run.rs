//! How one `railyard bench` run goes: its checks, the ceiling (measured first with the target
//! on this host, beside the idle engine otherwise), the engine and its target, the threads
//! for `--duration` with a progress line, then the report.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, FabricChoice, Op, PeerAccess, RailChoice, default_name};
use railyard::metrics::MetricsServer;

use super::args::{BenchArgs, BenchOp, validate};
use super::ceiling::{measure_ceiling, tcp_fabric_ceiling};
use super::report::{Run, Verdict, report};
use super::target::start_target;
use super::tcp_ceiling::CeilingSite;
use super::worker::{ThreadResult, Workload, run_worker, seed_pool};
use crate::cli::size::format_size;

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

    let Verdict { failed, mismatches } = report(
        args,
        &Run {
            engine: &engine,
            target: &target,
            op,
            local,
            results: &results,
            bytes: moved.load(Ordering::Relaxed),
            elapsed,
            ceiling: &ceiling,
        },
    );
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
