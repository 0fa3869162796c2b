//! `railyard serve`: a target that registers a pool and waits for peers.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use railyard::control::NotificationBody;
use railyard::engine::{DirectoryChoice, Engine, FabricChoice, RailChoice, default_name};

use super::size::{format_size, parse_size};

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Where the handshake listener binds (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: SocketAddr,
    /// Size of the registered pool peers write into and read from (e.g. 1GiB).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pool: u64,
    /// auto, soft, tcp or verbs.
    #[arg(long, value_parser = super::parse_fabric, default_value = "auto")]
    pub(crate) fabric: FabricChoice,
    /// Where peers find this process: p2p (by address) or etcd://HOST:PORT[,HOST:PORT...]
    /// (published under --name with a lease).
    #[arg(long, value_parser = super::parse_directory, default_value = "p2p")]
    directory: DirectoryChoice,
    /// Software rails (default: one per NUMA node, from the topology plan).
    #[arg(long)]
    rails: Option<NonZeroUsize>,
    /// The segment name peers see (default `serve-<host>-<pid>`). A label: two processes
    /// with one name are still two peers, but a cluster directory holds each name once.
    #[arg(long)]
    name: Option<String>,
    /// Exit when standard input closes (how `railyard bench` stops the target it starts).
    #[arg(long)]
    until_stdin_closes: bool,
    #[command(flatten)]
    verbs: super::VerbsArgs,
}

pub(crate) fn run(args: &ServeArgs) -> anyhow::Result<()> {
    if args.pool == 0 {
        bail!("--pool must be more than 0 bytes");
    }
    let rails = args.rails.map_or(RailChoice::Plan, RailChoice::Count);
    let name = args.name.clone().unwrap_or_else(|| default_name("serve"));
    let engine = Engine::builder(name)
        .listen(args.listen)
        .fabric(args.fabric)
        .rails(rails)
        .verbs(args.verbs.config())
        .directory(args.directory.clone())
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .build()
        .context("starting the engine")?;
    let pool = engine
        .alloc(args.pool, None)
        .context("allocating the pool")?;
    let mut out = std::io::stdout().lock();
    // First line: machine-readable, for scripts and `railyard bench`.
    writeln!(
        out,
        "listening {} incarnation {} pool {:#x} {}",
        engine.addr(),
        engine.incarnation(),
        pool.addr,
        pool.len
    )?;
    writeln!(
        out,
        "railyard serve: {} on {} rail(s), pool {} ({})",
        engine.name(),
        engine.rails(),
        format_size(pool.len),
        pool.backing.map_or("user memory", |b| b.describe())
    )?;
    for warning in engine.warnings() {
        writeln!(out, "railyard serve: warning: {warning}")?;
    }
    out.flush()?;
    drop(out);
    let stdin_closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if args.until_stdin_closes {
        let flag = stdin_closed.clone();
        std::thread::spawn(move || {
            let _ = std::io::stdin().lock().lines().count();
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
    loop {
        for notification in engine.drain_notifications() {
            let from = format!("{} ({})", notification.from, notification.incarnation);
            match notification.body {
                NotificationBody::Bytes(bytes) => {
                    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                    println!("notification from {from}: {} bytes {hex}", bytes.len());
                }
                NotificationBody::Immediate(value) => {
                    println!("immediate from {from}: {value:#010x}");
                }
            }
        }
        if stdin_closed.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
