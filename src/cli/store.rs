//! `railyard store`: a pure memory node for the store (`serve`), and a person's tools on a
//! live cluster (`put`, `get`, `rm`, `ls`, `stat`).

use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use railyard::engine::{Engine, FabricChoice, RailChoice, default_name};
use railyard::store::{ReplicaConfig, Store, StoreOptions};

use super::duration::parse_duration;
use super::engine_args::{SecretArgs, parse_fabric};
use super::size::{format_size, parse_size};

#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    #[command(subcommand)]
    command: StoreCommand,
}

#[derive(Debug, Subcommand)]
enum StoreCommand {
    /// Contribute memory to the store as a segment, and serve it until stopped.
    Serve(ServeArgs),
    /// Store a value (from --value, --file, or standard input).
    Put(PutArgs),
    /// Print a value (or write it to --output).
    Get(GetArgs),
    /// Remove keys.
    Rm(RmArgs),
    /// List the keys of complete objects.
    Ls(ClientArgs),
    /// What the master holds: objects, bytes, segments, counters.
    Stat(ClientArgs),
    /// Throughput and latency of puts and gets against a live master.
    Bench(super::store_bench::StoreBenchArgs),
    /// One client process of `railyard chaos hicache` (JSON events on stdout, commands on
    /// stdin).
    #[cfg(feature = "etcd")]
    #[command(hide = true)]
    ChaosClient(ChaosClientArgs),
}

#[cfg(feature = "etcd")]
#[derive(Debug, Args)]
struct ChaosClientArgs {
    /// The master's address, or `etcd://…` to find the leader there.
    #[arg(long)]
    master: String,
    /// This client's engine name; its keys start with it.
    #[arg(long)]
    name: String,
    /// Seeds which keys it reads.
    #[arg(long)]
    seed: u64,
    #[command(flatten)]
    secret: SecretArgs,
}

/// How a store command reaches the cluster.
#[derive(Debug, Args)]
struct ClientArgs {
    /// The master's address.
    #[arg(long, default_value = "127.0.0.1:7500")]
    master: String,
    /// auto, soft, tcp, verbs or ofi: how this process moves bytes.
    #[arg(long, value_parser = parse_fabric, default_value = "auto")]
    fabric: FabricChoice,
    /// Where this process's handshake listener binds (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// How long one call may take.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    timeout: Duration,
    #[command(flatten)]
    secret: SecretArgs,
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// Bytes of memory to contribute (huge pages where the host has them).
    #[arg(long, value_parser = parse_size, default_value = "1GiB")]
    segment: u64,
    /// On exit, how long readers already pointed at the segment have to finish.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    grace: Duration,
    /// Exit (unmounting first) when standard input closes.
    #[arg(long)]
    until_stdin_closes: bool,
    /// The engine's (and so the segment's) name (default `store-serve-<host>-<pid>`). A
    /// process started under a dead one's name is still a new incarnation: none of the dead
    /// one's objects are taken for its own.
    #[arg(long)]
    name: Option<String>,
}

#[derive(Debug, Args)]
struct PutArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// The key.
    key: String,
    /// The value, as text.
    #[arg(long, conflicts_with = "file")]
    value: Option<String>,
    /// A file holding the value.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Replicas, each on a different segment.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Replace an existing object.
    #[arg(long)]
    upsert: bool,
}

#[derive(Debug, Args)]
struct GetArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// The key.
    key: String,
    /// Write the value here instead of standard output.
    #[arg(long)]
    output: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct RmArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// The keys.
    #[arg(required = true)]
    keys: Vec<String>,
    /// Despite leases and writes in progress.
    #[arg(long)]
    force: bool,
}

impl ClientArgs {
    /// An engine and a store client for one command.
    fn connect(&self, name: String, staging: u64) -> anyhow::Result<(Engine, Store)> {
        let engine = self
            .secret
            .apply(Engine::builder(name))?
            .listen(self.listen)
            .fabric(self.fabric)
            .rails(RailChoice::Count(NonZeroUsize::MIN))
            .idle(railyard::dataplane::IdleStrategy::gentle())
            .build()
            .context("starting the engine")?;
        let secret = self.secret.secret()?;
        let store = Store::connect(
            &engine,
            StoreOptions {
                secret,
                timeout: self.timeout,
                staging,
                ..StoreOptions::new(&self.master)
            },
        )?;
        Ok((engine, store))
    }
}

pub(crate) fn run(args: &StoreArgs) -> anyhow::Result<()> {
    #[cfg(feature = "sabotage")]
    railyard::dataplane::sabotage::turn_off_from_env();
    match &args.command {
        StoreCommand::Serve(args) => serve(args),
        StoreCommand::Bench(args) => super::store_bench::run(args),
        #[cfg(feature = "etcd")]
        StoreCommand::ChaosClient(args) => {
            let secret = args.secret.secret()?;
            railyard::chaos::hicache::run_client(&args.master, &args.name, args.seed, secret)
        }
        StoreCommand::Put(args) => {
            let value = match (&args.value, &args.file) {
                (Some(text), _) => text.clone().into_bytes(),
                (None, Some(path)) => {
                    std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
                }
                (None, None) => {
                    let mut bytes = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut bytes)
                        .context("reading standard input")?;
                    bytes
                }
            };
            let (_engine, store) = args.client.connect(
                default_name("store-put"),
                (value.len() as u64).clamp(1 << 20, 256 << 20),
            )?;
            let config = ReplicaConfig {
                replica_num: args.replicas,
                ..ReplicaConfig::default()
            };
            if args.upsert {
                store.upsert(&args.key, &value, &config)?;
            } else {
                store.put(&args.key, &value, &config)?;
            }
            println!("put {} ({})", args.key, format_size(value.len() as u64));
            Ok(())
        }
        StoreCommand::Get(args) => {
            let (_engine, store) = args.client.connect(default_name("store-get"), 16 << 20)?;
            let value = store.get(&args.key)?;
            match &args.output {
                Some(path) => std::fs::write(path, &value)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => std::io::stdout()
                    .lock()
                    .write_all(&value)
                    .context("writing standard output")?,
            }
            Ok(())
        }
        StoreCommand::Rm(args) => {
            let (_engine, store) = args.client.connect(default_name("store-rm"), 1 << 20)?;
            let mut failed = 0;
            for (key, result) in args
                .keys
                .iter()
                .zip(store.batch_remove(&args.keys, args.force))
            {
                match result {
                    Ok(()) => println!("removed {key}"),
                    Err(error) => {
                        failed += 1;
                        eprintln!("{error} (code {})", error.code());
                    }
                }
            }
            if failed > 0 {
                bail!("{failed} of {} keys not removed", args.keys.len());
            }
            Ok(())
        }
        StoreCommand::Ls(args) => {
            let (_engine, store) = args.connect(default_name("store-ls"), 1 << 20)?;
            let mut out = std::io::stdout().lock();
            for key in store.keys()? {
                writeln!(out, "{key}")?;
            }
            Ok(())
        }
        StoreCommand::Stat(args) => {
            let (_engine, store) = args.connect(default_name("store-stat"), 1 << 20)?;
            let stats = store.master_stats()?;
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "objects {}  bytes {}  writes in progress {}  fences awaited {}",
                stats.objects,
                format_size(stats.bytes),
                stats.writes,
                stats.fences_pending
            )?;
            for segment in &stats.segments {
                writeln!(
                    out,
                    "segment {} on {}: {} of {} reserved{}",
                    segment.name,
                    segment.host,
                    format_size(segment.reserved),
                    format_size(segment.capacity),
                    match (segment.draining, segment.suspected) {
                        (true, _) => " (unmounting)",
                        (false, true) => " (owner suspected: serves nothing)",
                        (false, false) => "",
                    }
                )?;
            }
            let c = &stats.counters;
            writeln!(
                out,
                "puts started {} completed {} revoked {} abandoned {}; gets {}; evictions {} ({}); lease refusals {}; no space {}; members suspected {} lost {}",
                c.puts_started,
                c.puts_completed,
                c.puts_revoked,
                c.puts_abandoned,
                c.gets,
                c.evictions,
                format_size(c.evicted_bytes),
                c.lease_refusals,
                c.no_space,
                c.members_suspected,
                c.members_lost
            )?;
            Ok(())
        }
    }
}

fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    if args.segment == 0 {
        bail!("--segment must be more than 0 bytes");
    }
    let (engine, store) = args.client.connect(
        args.name
            .clone()
            .unwrap_or_else(|| default_name("store-serve")),
        1 << 20,
    )?;
    let segment = store.mount(args.segment)?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "listening {} incarnation {} segment {} {}",
        engine.addr(),
        engine.incarnation(),
        segment.0,
        args.segment
    )?;
    out.flush()?;
    drop(out);
    if !args.until_stdin_closes {
        loop {
            std::thread::park();
        }
    }
    let mut stdin = std::io::stdin().lock();
    let mut line = Vec::new();
    while matches!(stdin.read_until(b'\n', &mut line), Ok(read) if read > 0) {
        line.clear();
    }
    store.unmount(segment, args.grace)?;
    Ok(())
}
