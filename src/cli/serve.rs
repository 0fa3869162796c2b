//! `railyard serve`: a target that registers a pool and waits for peers.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Args;
use railyard::control::NotificationBody;
use railyard::engine::{DirectoryChoice, Engine, FabricChoice, RailChoice, Region, default_name};
use railyard::metrics::MetricsServer;

use super::engine_args::{
    EngineSecretArgs, VerbsArgs, parse_directory, parse_fabric, parse_metrics_addr,
};
use super::ping::{Echo, Ping};
use super::size::{format_size, parse_size};

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Where the handshake listener binds (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: SocketAddr,
    /// Size of the registered pool peers write into and read from (e.g. 1GiB).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pool: u64,
    /// auto, soft, tcp, verbs or ofi (libfabric: --ofi-provider).
    #[arg(long, value_parser = parse_fabric, default_value = "auto")]
    pub(crate) fabric: FabricChoice,
    /// Where peers find this process: p2p (by address) or etcd://HOST:PORT[,HOST:PORT...]
    /// (published under --name with a lease).
    #[arg(long, value_parser = parse_directory, default_value = "p2p")]
    directory: DirectoryChoice,
    /// Software rails (default: one per NUMA node, from the topology plan).
    #[arg(long)]
    rails: Option<NonZeroUsize>,
    /// The segment name peers see (default `serve-<host>-<pid>`). A label: two processes
    /// with one name are still two peers, but a cluster directory holds each name once.
    #[arg(long)]
    name: Option<String>,
    /// Exit when standard input closes, and until then take commands from it, one per line,
    /// each answered with one line (how `railyard bench` and `railyard chaos` drive the
    /// targets they start): `alloc LEN` → `region ID 0xADDR LEN`; `reregister ID` (new keys,
    /// same memory) → `region NEWID 0xADDR LEN`; `deregister ID` → `deregistered ID`;
    /// `digest ID OFFSET LEN CHUNK` → `digest D...` (FNV-1a, one per CHUNK bytes); `stats` →
    /// `stats teardowns=N reconnects=N passive_qps=N idempotent_replies=N
    /// warnings=N auth_failures=N` (the control plane's counters); a command that cannot be done →
    /// `error: WHY`. The pool is the region the first line names.
    #[arg(long)]
    until_stdin_closes: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (a bare port is loopback, 127.0.0.1; port 0:
    /// any free port; the first
    /// line then ends with `metrics ADDR`).
    #[arg(long, value_name = "[IP:]PORT", value_parser = parse_metrics_addr)]
    metrics: Option<SocketAddr>,
    #[command(flatten)]
    verbs: VerbsArgs,
    #[command(flatten)]
    secret: EngineSecretArgs,
    /// With --secret-file, still read and discard a raw byte stream on the TCP data port: the
    /// ceiling `railyard bench` measures against a target on another host (without a secret
    /// it is read anyway). Bound to no handshake: for benchmarks only.
    #[arg(long)]
    accept_sinks: bool,
    /// Most connections each TCP data port keeps bound to no queue pair (waiting for their
    /// hello, or raw sink streams); beyond it the oldest is closed, so that clients that
    /// connect and say nothing cannot exhaust descriptors or poller time.
    #[arg(long, value_name = "N", default_value_t = railyard::dataplane::fabric::tcp::TcpConfig::default().max_half_open)]
    max_half_open: usize,
    /// Answer the pings of `railyard bench --latency`: each ping's bytes, which landed at the
    /// start of the pool, are written back to the pinger (into memory it registered) with
    /// a pong notification. The pinger is opened at the address it names.
    #[arg(long)]
    echo: bool,
}

pub(crate) fn run(args: &ServeArgs) -> anyhow::Result<()> {
    // A test that switched a protection off carries the switch into its targets.
    #[cfg(feature = "sabotage")]
    railyard::dataplane::sabotage::turn_off_from_env();
    if args.pool == 0 {
        bail!("--pool must be more than 0 bytes");
    }
    args.verbs.check(args.fabric)?;
    let rails = args.rails.map_or(RailChoice::Plan, RailChoice::Count);
    let name = args.name.clone().unwrap_or_else(|| default_name("serve"));
    let engine = args
        .secret
        .apply(args.verbs.apply(Engine::builder(name)))?
        .listen(args.listen)
        .accept_tcp_sinks(args.accept_sinks || !args.secret.has_secret())
        .tcp_max_half_open(args.max_half_open)
        .fabric(args.fabric)
        .rails(rails)
        .directory(args.directory.clone())
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .build()
        .context("starting the engine")?;
    let pool = engine
        .alloc(args.pool, None)
        .context("allocating the pool")?;
    let metrics = args
        .metrics
        .map(|addr| {
            MetricsServer::start(&engine, addr)
                .with_context(|| format!("serving metrics on {addr}"))
        })
        .transpose()?;
    let metrics_addr = metrics.as_ref().map(MetricsServer::addr);
    let mut out = std::io::stdout().lock();
    tracing::info!(
        target: "railyard::serve",
        engine = engine.name(),
        addr = %engine.addr(),
        incarnation = %engine.incarnation(),
        fabric = engine.fabric(),
        pool_bytes = pool.len,
        metrics = metrics_addr.map(tracing::field::display),
        "serving"
    );
    // First line: machine-readable, for scripts and `railyard bench`.
    write!(
        out,
        "listening {} incarnation {} pool {:#x} {} region {}",
        engine.addr(),
        engine.incarnation(),
        pool.addr,
        pool.len,
        pool.id
    )?;
    match metrics_addr {
        Some(addr) => writeln!(out, " metrics {addr}")?,
        None => writeln!(out)?,
    }
    writeln!(
        out,
        "railyard serve: {} on {} rail(s), pool {} ({})",
        engine.name(),
        engine.rails(),
        format_size(pool.len),
        pool.backing.map_or("user memory", |b| b.describe())
    )?;
    for warning in engine.warnings() {
        tracing::warn!(
            target: "railyard::serve",
            engine = engine.name(),
            compromise = %warning,
            "the engine runs with a compromise"
        );
    }
    out.flush()?;
    drop(out);
    let (command_line, commands) = std::sync::mpsc::channel();
    if args.until_stdin_closes {
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut line = Vec::new();
            // A line that is not UTF-8 is still a line (answered as an unknown command).
            while matches!(stdin.read_until(b'\n', &mut line), Ok(read) if read > 0) {
                let text = String::from_utf8_lossy(&line).trim_end().to_string();
                let _ = command_line.send(text);
                line.clear();
            }
            // Dropping the sender says stdin closed.
        });
    } else {
        // Never closes: serve runs until it is stopped.
        std::mem::forget(command_line);
    }
    let mut regions = HashMap::from([(pool.id, pool)]);
    let mut echo = if args.echo {
        Some(Echo::new(&engine, pool)?)
    } else {
        None
    };
    let mut echo_failures = 0u64;
    loop {
        // An echo waits for notifications (a ping is answered as soon as it arrives); a
        // plain target looks every few milliseconds.
        let notifications = if echo.is_some() {
            engine.wait_notifications(Instant::now() + COMMAND_POLL)
        } else {
            std::thread::sleep(COMMAND_POLL);
            engine.drain_notifications()
        };
        for notification in notifications {
            if let (Some(echo), NotificationBody::Bytes(bytes)) = (&mut echo, &notification.body)
                && let Some(ping) = Ping::decode(bytes)
            {
                if let Err(error) = echo.answer(&engine, &ping, notification.incarnation) {
                    echo_failures += 1;
                    // The first failure, then every power of two: a pinger that went away
                    // does not flood the log.
                    if echo_failures.is_power_of_two() {
                        tracing::warn!(
                            target: "railyard::serve",
                            failures = echo_failures,
                            "a ping was not answered: {error:#}"
                        );
                    }
                }
                continue;
            }
            let from = format!("{} ({})", notification.from, notification.incarnation);
            match notification.body {
                NotificationBody::Bytes(bytes) => {
                    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                    say(&format!(
                        "notification from {from}: {} bytes {hex}",
                        bytes.len()
                    ))?;
                }
                NotificationBody::Immediate(value) => {
                    say(&format!("immediate from {from}: {value:#010x}"))?;
                }
            }
        }
        loop {
            match commands.try_recv() {
                Ok(line) => say(&command(&engine, &mut regions, &line))?,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return Ok(()),
            }
        }
    }
}

/// How often serve looks at its stdin commands.
const COMMAND_POLL: Duration = Duration::from_millis(5);

/// Prints one line; an error (stdout closed) ends serve with it instead of a panic.
fn say(line: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

/// Most digests one `digest` command answers.
const MAX_DIGESTS: u64 = 1 << 16;

/// FNV-1a ([`railyard::chaos::digest`]) of `len` bytes at `addr`, read one byte at a time
/// with atomic loads: peers may be writing there.
///
/// # Safety
/// `len` bytes at `addr` are mapped and stay mapped during the call.
unsafe fn digest_live(addr: u64, len: u64) -> u64 {
    let mut hash = railyard::chaos::digest(&[]);
    for offset in 0..len {
        // SAFETY: inside the mapped range (the caller's promise); an `AtomicU8` has no
        // alignment requirement beyond a byte, and only atomic loads are made through it.
        let byte = unsafe { std::sync::atomic::AtomicU8::from_ptr((addr + offset) as *mut u8) }
            .load(std::sync::atomic::Ordering::Relaxed);
        hash = railyard::chaos::digest_more(hash, byte);
    }
    hash
}

/// Does one stdin command; returns its answer line.
fn command(engine: &Engine, regions: &mut HashMap<u64, Region>, line: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let word = |index: usize| {
        words
            .get(index)
            .copied()
            .ok_or_else(|| format!("{line:?} lacks argument {index}"))
    };
    // Sizes may carry a unit (64KiB); ids and offsets are plain numbers.
    let size = |index: usize| -> Result<u64, String> {
        let word = word(index)?;
        parse_size(word).map_err(|e| format!("{word:?}: {e}"))
    };
    let number = |index: usize| -> Result<u64, String> {
        let word = word(index)?;
        word.parse()
            .map_err(|_| format!("{word:?} is not a number"))
    };
    let region = |regions: &HashMap<u64, Region>, id: u64| {
        regions
            .get(&id)
            .copied()
            .ok_or_else(|| format!("no region {id}"))
    };
    let answer = (|| -> Result<String, String> {
        match words.first().copied() {
            Some("alloc") => {
                let made = engine.alloc(size(1)?, None).map_err(|e| e.to_string())?;
                regions.insert(made.id, made);
                Ok(format!("region {} {:#x} {}", made.id, made.addr, made.len))
            }
            Some("reregister") => {
                let old = region(regions, number(1)?)?;
                let renewed = engine.reregister(old).map_err(|e| e.to_string())?;
                regions.remove(&old.id);
                regions.insert(renewed.id, renewed);
                Ok(format!(
                    "region {} {:#x} {}",
                    renewed.id, renewed.addr, renewed.len
                ))
            }
            Some("deregister") => {
                let gone = region(regions, number(1)?)?;
                engine.deregister(gone).map_err(|e| e.to_string())?;
                regions.remove(&gone.id);
                Ok(format!("deregistered {}", gone.id))
            }
            Some("digest") => {
                let target = region(regions, number(1)?)?;
                let (offset, len, chunk) = (size(2)?, size(3)?, size(4)?);
                if len == 0
                    || chunk == 0
                    || offset.checked_add(len).is_none_or(|end| end > target.len)
                {
                    return Err(format!(
                        "{len} bytes at {offset} in chunks of {chunk} do not fit region {} of {} bytes",
                        target.id, target.len
                    ));
                }
                if len.div_ceil(chunk) > MAX_DIGESTS {
                    return Err(format!(
                        "{len} bytes in chunks of {chunk} make more than {MAX_DIGESTS} digests"
                    ));
                }
                let digests: Vec<String> = (offset..offset + len)
                    .step_by(chunk as usize)
                    .map(|start| {
                        let part = chunk.min(offset + len - start);
                        // SAFETY: inside a region this engine registered, mapped until it is
                        // deregistered (by this thread, not during the call).
                        let digest = unsafe { digest_live(target.addr + start, part) };
                        format!("{digest:016x}")
                    })
                    .collect();
                Ok(format!("digest {}", digests.join(" ")))
            }
            Some("stats") => {
                let control = engine.stats().control;
                Ok(format!(
                    "stats teardowns={} reconnects={} passive_qps={} idempotent_replies={} \
                     warnings={} auth_failures={}",
                    control.teardowns,
                    control.reconnects,
                    control.passive_qps,
                    control.idempotent_replies,
                    control.warnings_total(),
                    control.auth_failures
                ))
            }
            _ => Err(format!("unknown command {line:?}")),
        }
    })();
    answer.unwrap_or_else(|why| format!("error: {why}"))
}
