//! The `railyard` command line: its global options, its subcommands, and which module runs
//! each.

use clap::{Parser, Subcommand};

use super::{bench, chaos, doctor, handshakes, master, secret, serve, sim, store, topology};

/// railyard: zero-copy KV-cache transfer engine.
#[derive(Debug, Parser)]
#[command(name = "railyard", version, about)]
pub(crate) struct Cli {
    /// Which log events to print: a level (error, warn, info, debug, trace) or `RUST_LOG`
    /// directives (`railyard::control=debug,warn`). Default: `RUST_LOG`, else `warn`
    /// (`chaos`: `warn,railyard::control=error`, as its scenarios provoke those warnings).
    #[arg(long, global = true, value_name = "FILTER")]
    log: Option<String>,
    /// How log events look on stderr: `text` for people, `json` (one object per line) for
    /// machines. Either way, at most 5 warnings of a kind per 10 s are written; a line
    /// before the next one says how many were suppressed.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Discover the machine (or replay an hwloc XML snapshot) and print its rails and
    /// poller placement plan.
    Topology(topology::TopologyArgs),
    /// Reproduce a production failure (reconnect-storm, teardown-race, handshake-churn,
    /// dead-replica on the soft fabric; soak; hicache: the store's processes killed under
    /// load) and print what happened as counts. Exit status 1 when the scenario breaks one
    /// of its promises.
    Chaos(chaos::ChaosArgs),
    /// Simulate the control plane of many processes (1 000 by default) deterministically
    /// from a seed, under kills, stops, partitions and lost leases, check its invariants at
    /// every step and print its figures. Exit status 1 (with the shortest failing trace)
    /// when an invariant broke.
    Sim(sim::SimArgs),
    /// Measure handshakes per second into one target: hundreds of initiator engines in
    /// several processes open it at once, round after round (each open a whole handshake);
    /// prints the rate, each open's p50/p99 and the target's control memory per peer.
    /// Exit status 1 when an open failed.
    Handshakes(handshakes::HandshakesArgs),
    /// Serve a registered pool to peers (a transfer target) until stopped.
    Serve(serve::ServeArgs),
    /// The main job: KV-cache-shaped transfers to a target (started here unless --target is
    /// given), measured beside this machine's memcpy ceiling. The default request is 64
    /// blocks (32 layers × K and V) of 64 KiB (16 tokens × 16 KV heads × 128 dims × fp16)
    /// at random slots of the target's pool, written as one batch.
    Bench(bench::BenchArgs),
    /// The store's master: metadata of a distributed KV-cache store whose clients move the
    /// bytes themselves.
    Master(master::MasterArgs),
    /// The store: serve a memory segment, or put, get, list and inspect objects.
    Store(store::StoreArgs),
    /// Check this host for what railyard needs (locked memory, huge pages, RDMA devices,
    /// libfabric providers, NUMA, cores for pollers, the cluster secret, etcd, the clock)
    /// and print, per check, OK, warning or problem with the command that fixes it. Exit
    /// status 0, 1 (warnings) or 2 (problems).
    Doctor(doctor::DoctorArgs),
    /// Cluster secrets: `railyard secret new FILE` writes a fresh one (mode 0600).
    Secret(secret::SecretArgs),
}

impl Cli {
    /// Installs the `tracing` subscriber every log event of the engine, the control plane
    /// and the CLI goes to: stderr, filtered by `--log` (else `RUST_LOG`, else `warn`), as
    /// text (coloured on a terminal) or JSON lines, warnings rate-limited
    /// ([`railyard::logging`]).
    ///
    /// # Errors
    /// A `--log` filter that does not parse.
    pub(crate) fn install_logging(&self) -> anyhow::Result<()> {
        use tracing_subscriber::EnvFilter;
        let filter = match &self.log {
            Some(directives) => EnvFilter::try_new(directives)
                .map_err(|error| anyhow::anyhow!("--log {directives:?}: {error}"))?,
            // Chaos scenarios provoke control-plane warnings on purpose (their report counts
            // them): by default it shows only the rest.
            None => EnvFilter::try_from_default_env().unwrap_or_else(|_| match self.command {
                Command::Chaos(_) => EnvFilter::new("warn,railyard::control=error"),
                // The simulation's faults make the store's master warn too.
                Command::Sim(_) => {
                    EnvFilter::new("warn,railyard::control=error,railyard_store=error")
                }
                // Hundreds of loopback engines: their warnings would bury the figures.
                Command::Handshakes(_) => EnvFilter::new("error"),
                _ => EnvFilter::new("warn"),
            }),
        };
        let format = match self.log_format {
            LogFormat::Text => railyard::logging::LogFormat::Text,
            LogFormat::Json => railyard::logging::LogFormat::Json,
        };
        railyard::logging::install(filter, format)
            .map_err(|error| anyhow::anyhow!("installing the log subscriber: {error}"))
    }

    pub(crate) fn run(self) -> anyhow::Result<std::process::ExitCode> {
        match self.command {
            Command::Topology(args) => {
                topology::run(&args).map(|()| std::process::ExitCode::SUCCESS)
            }
            Command::Chaos(args) => chaos::run(&args),
            Command::Sim(args) => sim::run(&args),
            Command::Handshakes(args) => handshakes::run(&args),
            Command::Serve(args) => serve::run(&args).map(|()| std::process::ExitCode::SUCCESS),
            Command::Bench(args) => bench::run(&args).map(|()| std::process::ExitCode::SUCCESS),
            Command::Master(args) => master::run(&args).map(|()| std::process::ExitCode::SUCCESS),
            Command::Store(args) => store::run(&args).map(|()| std::process::ExitCode::SUCCESS),
            Command::Doctor(args) => doctor::run(&args),
            Command::Secret(args) => secret::run(&args).map(|()| std::process::ExitCode::SUCCESS),
        }
    }
}
