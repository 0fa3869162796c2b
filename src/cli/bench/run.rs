//! How one `railyard bench` run goes: its checks and shapes, the ceilings (measured first
//! with the target on this host, beside the idle engine otherwise), the engine and its
//! target, the threads for `--duration` per shape with a progress line or bar, then the
//! report and the plot.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};
use railyard::dataplane::IdleStrategy;
use railyard::engine::{
    Engine, FabricChoice, Op, Peer, PeerAccess, RailChoice, Region, default_name,
};
use railyard::metrics::MetricsServer;

use super::args::{BenchArgs, validate};
use super::ceiling::{Ceiling, CeilingBench, MAX_CEILING_POOL, ceiling_round, tcp_fabric_ceilings};
use super::plot::plot;
use super::report::{Occasion, Setting, ShapeResult, Verdict, report_one, report_sweep};
use super::shapes::{Plan, Shape, Skipped, fit, plan};
use super::target::{OpenTarget, TargetChild, open_target};
use super::tcp_ceiling::CeilingSite;
use super::worker::{ThreadResult, Workload, run_worker, seed_pool};
use crate::cli::size::format_size;

pub(crate) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    validate(args)?;
    args.verbs.check(args.fabric)?;
    if args.latency {
        return super::latency::run(args);
    }
    let plan = plan(args);
    if !args.sweep
        && let Some(skipped) = plan.skipped.first()
    {
        bail!("{}", skipped.why);
    }
    if plan.shapes.is_empty() {
        bail!("no shape fits: {}", reasons(&plan.skipped));
    }
    if args.target.is_none() {
        check_memory(args, &plan)?;
    }
    // A plot that cannot be written is found out before the measuring, not after (an
    // earlier plot there stays until this one replaces it).
    if let Some(path) = &args.plot {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening {} to draw into", path.display()))?;
    }
    let progress = Progress::new(args, &plan);
    let (rows, setting, skipped) = match args.target {
        Some(_) => measure_elsewhere(args, plan, &progress)?,
        None if args.fabric == FabricChoice::Ofi => {
            // libfabric off EFA replaces railyard's TCP fabric: its ratio is against that
            // fabric, run on the same workload just before, by a bench of its own.
            progress.stage("railyard's TCP fabric, for the ceilings");
            let ceilings = tcp_fabric_ceilings(args, &plan)?;
            let bench = Bench::start(args, &plan)?;
            let mut rows = Vec::with_capacity(plan.shapes.len());
            for (shape, ceiling) in plan.shapes.iter().zip(ceilings) {
                progress.stage(&describe(shape));
                rows.push(bench.measure(args, shape, ceiling, plan.duration, &progress)?);
                progress.step();
            }
            let setting = bench.finish(&plan);
            (rows, setting, plan.skipped)
        }
        None => measure_here(args, plan, &progress)?,
    };
    progress.finish();
    // `--op both` measures two shapes: reported as a sweep of them.
    if args.sweep || rows.len() > 1 {
        let occasion = Occasion::now();
        report_sweep(args, &setting, &occasion, &rows, &skipped);
        if let Some(path) = &args.plot {
            plot(path, setting.fabric, &occasion, &rows)
                .with_context(|| format!("drawing {}", path.display()))?;
        }
    } else if let Some(row) = rows.first() {
        report_one(args, &setting, row);
    }
    let Verdict { failed, mismatches } = Verdict::of(&rows);
    if args.check && mismatches > 0 {
        bail!("{mismatches} block(s) did not hold what was written");
    }
    if args.check && failed > 0 {
        bail!("{failed} request(s) failed");
    }
    Ok(())
}

/// What a run measured: a row per shape, the setting, and the shapes it left out.
type Measured = (Vec<ShapeResult>, Setting, Vec<Skipped>);

/// With the target on this host: every shape's ceiling first, on an engine of its own
/// whose pollers park while idle, with no engine of the bench's and no target running
/// beside it (measured beside spinning or yielding pollers, a ceiling would lose cores to
/// them, and a ratio above 1.0 would follow); then one engine and target run every shape;
/// then, with them stopped, every ceiling again. The better of the two counts: this host's
/// speed changes from one minute to the next, and the runs fall between the two.
fn measure_here(args: &BenchArgs, plan: Plan, progress: &Progress) -> anyhow::Result<Measured> {
    let rails = args.rails.map_or(RailChoice::Plan, RailChoice::Count);
    let ceiling_engine = args
        .secret
        .apply(
            args.verbs
                .apply(Engine::builder(format!("{}-ceiling", bench_name(args)))),
        )?
        .fabric(args.fabric)
        .rails(rails)
        .idle(IdleStrategy::SpinThenPark {
            spins: 64,
            park: Duration::from_millis(1),
        })
        .build()
        .context("starting the ceiling's engine")?;
    let source = ceiling_engine
        .alloc_with_access(local_area(args, &plan.shapes), None, PeerAccess::None)
        .context("allocating the ceiling's source")?;
    let mut ceilings = CeilingBench::new(
        &ceiling_engine,
        CeilingSite::Loopback,
        args.fabric == FabricChoice::Tcp,
        source,
        plan.pool,
        ceiling_round(plan.duration),
        args.seed,
    )?;
    let mut before = Vec::with_capacity(plan.shapes.len());
    for shape in &plan.shapes {
        progress.stage(&format!("ceiling of {}", describe(shape)));
        before.push(ceilings.measure(shape)?);
        progress.step();
    }
    let bench = Bench::start(args, &plan)?;
    let mut rows = Vec::with_capacity(plan.shapes.len());
    for (shape, ceiling) in plan.shapes.iter().zip(before) {
        progress.stage(&describe(shape));
        rows.push(bench.measure(args, shape, ceiling, plan.duration, progress)?);
        progress.step();
    }
    let setting = bench.finish(&plan);
    ceilings.forget();
    for row in &mut rows {
        progress.stage(&format!("ceiling of {}, again", describe(&row.shape)));
        let after = ceilings.measure(&row.shape)?;
        if after.gbps > row.ceiling.gbps {
            row.ceiling = after;
        }
        row.ceiling.what += "; the better of a measure before the runs and one after";
        progress.step();
    }
    ceilings.finish()?;
    Ok((rows, setting, plan.skipped))
}

/// With a target elsewhere: one engine for every shape that fits the target's pool, each
/// shape's ceiling measured just before it, beside this engine's idle pollers; the TCP
/// ceiling when the engine reached the peer over TCP (`auto` does for another host), its
/// TCP port taking the plain stream.
fn measure_elsewhere(
    args: &BenchArgs,
    mut plan: Plan,
    progress: &Progress,
) -> anyhow::Result<Measured> {
    let bench = Bench::start(args, &plan)?;
    // The target's pool decides which shapes fit.
    let (fitting, skipped) = fit(
        std::mem::take(&mut plan.shapes),
        bench.pool_len,
        args.threads,
        "the target's `serve --pool`",
    );
    plan.shapes = fitting;
    plan.skipped.extend(skipped);
    progress.resize(2 * plan.shapes.len());
    if !args.sweep
        && let Some(skipped) = plan.skipped.first()
    {
        bail!("at the target {}: {}", bench.target, skipped.why);
    }
    if plan.shapes.is_empty() {
        bail!(
            "no shape fits the target {}: {}",
            bench.target,
            reasons(&plan.skipped)
        );
    }
    let site = CeilingSite::Remote(SocketAddr::new(
        bench.peer.addr().ip(),
        bench
            .peer
            .descriptor()
            .rails
            .first()
            .map_or(0, |rail| rail.tcp_port),
    ));
    // libfabric off EFA stands in for TCP: a remote target's ratio is against it too.
    let tcp = bench.engine.stats().control.tcp_qps > 0 || args.fabric == FabricChoice::Ofi;
    let mut rows = Vec::with_capacity(plan.shapes.len());
    let mut ceilings = CeilingBench::new(
        &bench.engine,
        site,
        tcp,
        bench.local,
        bench.pool_len,
        ceiling_round(plan.duration),
        args.seed,
    )?;
    for shape in &plan.shapes {
        progress.stage(&format!("ceiling of {}", describe(shape)));
        let ceiling = ceilings.measure(shape)?;
        progress.step();
        progress.stage(&describe(shape));
        rows.push(bench.measure(args, shape, ceiling, plan.duration, progress)?);
        progress.step();
    }
    ceilings.finish()?;
    let setting = bench.finish(&plan);
    Ok((rows, setting, plan.skipped))
}

/// A name of its own, so that two benches never claim the same one in a directory.
fn bench_name(args: &BenchArgs) -> String {
    args.name.clone().unwrap_or_else(|| default_name("bench"))
}

/// This bench's engine, its local buffers and the target it opened (started by it when no
/// `--target` was given). Fields drop in the order that stops them cleanly: the metrics
/// server (a scrape in progress holds the engine), the peer, the engine, then the target
/// it started (otherwise the engine sees the target go away and reports reconnecting).
struct Bench {
    _metrics: Option<MetricsServer>,
    peer: Peer,
    engine: Engine,
    _child: Option<TargetChild>,
    target: String,
    local: Region,
    /// Bytes of `local` each thread has to itself.
    per_thread: u64,
    /// The target's pool: its address and length.
    pool_base: u64,
    pool_len: u64,
}

impl Bench {
    fn start(args: &BenchArgs, plan: &Plan) -> anyhow::Result<Self> {
        let rails = args.rails.map_or(RailChoice::Plan, RailChoice::Count);
        let engine = args
            .secret
            .apply(args.verbs.apply(Engine::builder(bench_name(args))))?
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
        let OpenTarget {
            peer,
            name: target,
            pool_base,
            pool_len,
            child,
        } = open_target(args, &engine, plan.pool, false)?;
        // Sized for the shapes the target's pool holds (all of them when bench started it).
        let (fitting, _) = fit(
            plan.shapes.clone(),
            pool_len,
            args.threads,
            "the target's `serve --pool`",
        );
        let per_thread = local_area(args, &fitting);
        // Only this engine's transfers touch its buffers: peers get no access to them.
        let local = engine
            .alloc_with_access(
                per_thread.saturating_mul(args.threads),
                None,
                PeerAccess::None,
            )
            .context("allocating the local buffers")?;
        Ok(Self {
            _metrics: metrics,
            peer,
            engine,
            _child: child,
            target,
            local,
            per_thread,
            pool_base,
            pool_len,
        })
    }

    /// What the report says of this engine; then stops it, and the target it started.
    fn finish(self, plan: &Plan) -> Setting {
        let control = self.engine.stats().control;
        Setting {
            target: self.target.clone(),
            fabric: self.engine.fabric(),
            rails: self.engine.rails(),
            backing: self.local.backing.map_or("user memory", |b| b.describe()),
            shape_duration: plan.duration,
            tcp_queue_pairs: control.tcp_qps,
            reconnects: control.reconnects,
            teardowns: control.teardowns,
        }
    }

    /// Runs `shape` on every thread for `duration`.
    fn measure(
        &self,
        args: &BenchArgs,
        shape: &Shape,
        ceiling: Ceiling,
        duration: Duration,
        progress: &Progress,
    ) -> anyhow::Result<ShapeResult> {
        let slots = self.pool_len / shape.block;
        let slots_per_thread = slots / args.threads;
        if args.check && shape.op == Op::Read {
            // The slots the threads read, as many blocks per batch as the local buffers
            // hold (at most SEED_BATCH).
            let per_round = (self.local.len / shape.block).clamp(1, SEED_BATCH);
            seed_pool(
                &self.engine,
                &self.peer,
                self.local,
                (shape.block, per_round),
                args.seed,
                self.pool_base,
                slots_per_thread * args.threads,
            )?;
        }
        let stop = AtomicBool::new(false);
        let moved = AtomicU64::new(0);
        // One shape alone reports its rate as it goes; a sweep has its bar.
        let line_by_line = !args.sweep && !args.json && !args.csv;
        let tty = line_by_line && std::io::stderr().is_terminal();
        let started = Instant::now();
        let results = std::thread::scope(|scope| -> anyhow::Result<Vec<ThreadResult>> {
            let workers: Vec<_> = (0..args.threads)
                .map(|thread| {
                    let work = Workload {
                        engine: &self.engine,
                        peer: &self.peer,
                        local: self.local,
                        local_offset: thread * self.per_thread,
                        local_blocks: if args.check {
                            shape.batch
                        } else {
                            (self.per_thread / shape.block).max(1)
                        },
                        remote_base: self.pool_base,
                        first_slot: thread * slots_per_thread,
                        slots: slots_per_thread,
                        block: shape.block,
                        batch: shape.batch,
                        op: shape.op,
                        check: args.check,
                        seed: args.seed.wrapping_add(thread.wrapping_mul(0x9E37)),
                        pattern_seed: args.seed,
                        stop: &stop,
                        moved: &moved,
                    };
                    scope.spawn(move || run_worker(&work))
                })
                .collect();
            let mut last_line = Instant::now();
            while started.elapsed() < duration {
                std::thread::sleep(Duration::from_millis(100).min(duration));
                let elapsed = started.elapsed().min(duration);
                let gbps = moved.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64() / 1e9;
                progress.rate(gbps);
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
                } else if line_by_line && last_line.elapsed() >= Duration::from_secs(1) {
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
        Ok(ShapeResult::new(
            *shape,
            args.threads,
            &results,
            moved.load(Ordering::Relaxed),
            started.elapsed(),
            ceiling,
        ))
    }
}

/// A sweep's progress bar on stderr — shown only when both stdout and stderr are
/// terminals and the report is a table — one step per ceiling and per shape.
struct Progress(ProgressBar);

impl Progress {
    fn new(args: &BenchArgs, plan: &Plan) -> Self {
        let shown = args.sweep
            && !args.json
            && !args.csv
            && std::io::stdout().is_terminal()
            && std::io::stderr().is_terminal();
        if !shown {
            return Self(ProgressBar::hidden());
        }
        // Ceilings before and after the runs with the target here, before each run with
        // one elsewhere.
        let ceilings = match (&args.target, args.fabric) {
            (None, FabricChoice::Ofi) => 0,
            (None, _) => 2 * plan.shapes.len(),
            (Some(_), _) => plan.shapes.len(),
        };
        let bar = ProgressBar::new((plan.shapes.len() + ceilings) as u64);
        if let Ok(style) =
            ProgressStyle::with_template("[{bar:30}] {pos}/{len} {elapsed:>4} {wide_msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        Self(bar)
    }

    /// What runs now.
    fn stage(&self, what: &str) {
        self.0.set_message(what.to_string());
    }

    /// The rate of the shape running now.
    fn rate(&self, gbps: f64) {
        if !self.0.is_hidden() {
            let message = self.0.message();
            let what = message.split("  ").next().unwrap_or_default();
            self.0.set_message(format!("{what}  {gbps:.2} GB/s"));
        }
    }

    /// The steps left once a target elsewhere has decided which shapes fit.
    fn resize(&self, steps: usize) {
        self.0.set_length(steps as u64);
    }

    fn step(&self) {
        self.0.inc(1);
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// `write 16 × 64 KiB`: a shape as the progress bar names it.
fn describe(shape: &Shape) -> String {
    format!(
        "{} {} × {}",
        shape.op_name(),
        shape.batch,
        format_size(shape.block)
    )
}

/// Bytes of local memory each thread sends from (or reads into): the largest request, or
/// [`LOCAL_AREA`] when that is smaller (and holds the largest block): a request's blocks
/// then take its slots in turn, as many times over as needed. With `--check` every block
/// needs bytes of its own, and a check area as large follows.
fn local_area(args: &BenchArgs, shapes: &[Shape]) -> u64 {
    let largest_block = shapes.iter().map(|shape| shape.block).max().unwrap_or(1);
    let request = largest_request(shapes);
    if args.check {
        request * 2
    } else {
        request.min(LOCAL_AREA.max(largest_block))
    }
}

/// Most blocks one batch of the read check's seeding writes.
const SEED_BATCH: u64 = 4096;

/// The local memory one thread sends from, unless its largest request is smaller.
const LOCAL_AREA: u64 = 256 << 20;

/// The memory a run with the target on this host holds at once: the target's pool, the
/// bench's local buffers, and the ceiling's pool and source.
fn memory_needed(args: &BenchArgs, plan: &Plan) -> u64 {
    let local = local_area(args, &plan.shapes).saturating_mul(args.threads);
    let ceiling = plan
        .pool
        .min(MAX_CEILING_POOL)
        .saturating_add(local_area(args, &plan.shapes));
    plan.pool.saturating_add(local).saturating_add(ceiling)
}

/// Refuses a run whose memory this host does not have free (its buffers are prefaulted:
/// an oversized run would fail late, or wake the OOM killer).
fn check_memory(args: &BenchArgs, plan: &Plan) -> anyhow::Result<()> {
    let needed = memory_needed(args, plan);
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("MemAvailable:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map(|kib| kib << 10);
    if let Some(available) = available
        && needed > available
    {
        bail!(
            "this run needs about {} of memory (the target's pool of {}, local buffers and the \
             ceiling's), but {} is available: give a smaller --pool, fewer --threads or \
             smaller shapes",
            format_size(round_up_mib(needed)),
            format_size(plan.pool),
            format_size(round_up_mib(available))
        );
    }
    Ok(())
}

fn round_up_mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20) << 20
}

fn largest_request(shapes: &[Shape]) -> u64 {
    shapes.iter().map(Shape::request_bytes).max().unwrap_or(1)
}

/// Why each shape was left out, one after the other.
fn reasons(skipped: &[Skipped]) -> String {
    skipped
        .iter()
        .map(|skipped| format!("{}: {}", describe(&skipped.shape), skipped.why))
        .collect::<Vec<_>>()
        .join("; ")
}
