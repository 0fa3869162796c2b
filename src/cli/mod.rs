//! Argument parsing and dispatch for the `railyard` binary.

mod bench;
mod chaos;
mod serve;
mod size;
mod topology;

use clap::{Parser, Subcommand};

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
    /// dead-replica) on the soft fabric and print what happened as counts. Exit status 1
    /// when the scenario breaks one of its promises.
    Chaos(chaos::ChaosArgs),
    /// Serve a registered pool to peers (a transfer target) until stopped.
    Serve(serve::ServeArgs),
    /// The main job: KV-cache-shaped transfers to a target (started here unless --target is
    /// given), measured beside this machine's memcpy ceiling. The default request is 64
    /// blocks (32 layers × K and V) of 64 KiB (16 tokens × 16 KV heads × 128 dims × fp16)
    /// at random slots of the target's pool, written as one batch.
    Bench(bench::BenchArgs),
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
            Command::Serve(args) => serve::run(&args).map(|()| std::process::ExitCode::SUCCESS),
            Command::Bench(args) => bench::run(&args).map(|()| std::process::ExitCode::SUCCESS),
        }
    }
}

/// `--fabric auto|soft|tcp|verbs|ofi`.
fn parse_fabric(text: &str) -> Result<railyard::engine::FabricChoice, String> {
    use railyard::engine::FabricChoice;
    match text {
        "auto" => Ok(FabricChoice::Auto),
        "soft" => Ok(FabricChoice::Soft),
        "tcp" => Ok(FabricChoice::Tcp),
        "verbs" => Ok(FabricChoice::Verbs),
        "ofi" => Ok(FabricChoice::Ofi),
        other => Err(format!(
            "{other:?} is not a fabric (auto, soft, tcp, verbs, ofi)"
        )),
    }
}

/// `--directory p2p|etcd[+tls]://HOST:PORT[,HOST:PORT...][?…]`.
fn parse_directory(text: &str) -> Result<railyard::engine::DirectoryChoice, String> {
    use railyard::engine::DirectoryChoice;
    match text {
        "p2p" => Ok(DirectoryChoice::P2p),
        url if url.starts_with("etcd://") || url.starts_with("etcd+tls://") => {
            Ok(DirectoryChoice::Etcd(url.to_string()))
        }
        other => Err(format!(
            "{other:?} is not a directory (p2p, or etcd[+tls]://HOST:PORT[,HOST:PORT...])"
        )),
    }
}

/// The cluster secret of `serve` and `bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct SecretArgs {
    /// A file holding the cluster's secret (at least 16 bytes; a trailing newline is not
    /// part of it): peers must prove they hold the same before anything is answered, and
    /// this process proves it to them. Without one, peers are not authenticated (a warning
    /// says so).
    #[arg(long, value_name = "PATH", env = "RAILYARD_SECRET_FILE")]
    pub(crate) secret_file: Option<std::path::PathBuf>,
}

impl SecretArgs {
    /// `builder` with the secret, if one was given.
    ///
    /// # Errors
    /// The file cannot be read, or holds too short a secret.
    pub(crate) fn apply(
        &self,
        builder: railyard::engine::EngineBuilder,
    ) -> anyhow::Result<railyard::engine::EngineBuilder> {
        let Some(path) = &self.secret_file else {
            return Ok(builder);
        };
        Ok(builder.secret(railyard::engine::ClusterSecret::from_file(path)?))
    }

    /// The options that give a child process the same secret.
    pub(crate) fn options(&self) -> Vec<std::ffi::OsString> {
        self.secret_file
            .iter()
            .flat_map(|path| ["--secret-file".into(), path.clone().into_os_string()])
            .collect()
    }
}

/// Verbs and libfabric rail settings shared by `serve` and `bench` (ignored on the soft
/// fabric).
#[derive(Debug, clap::Args)]
pub(crate) struct VerbsArgs {
    /// The libfabric provider of `--fabric ofi`, as `fi_info -l` names it (default: efa when
    /// this machine has it; a software provider such as "tcp;ofi_rxm" only when named).
    #[arg(long, value_name = "NAME")]
    pub(crate) ofi_provider: Option<String>,
    /// RDMA port of every rail (default: the first ACTIVE one).
    #[arg(long, value_name = "N")]
    pub(crate) ib_port: Option<u8>,
    /// GID index of every rail (default: RoCE v2 IPv4-mapped GID on Ethernet, none on IB).
    #[arg(long, value_name = "N")]
    pub(crate) gid_index: Option<u8>,
    /// Traffic class of RoCE v2 packets (DSCP << 2 | ECN; e.g. 106 for DSCP 26 on a lossless
    /// class).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) traffic_class: u8,
}

impl VerbsArgs {
    /// Refuses settings of another fabric than `fabric`.
    ///
    /// # Errors
    /// `--ofi-provider` without `--fabric ofi`.
    pub(crate) fn check(&self, fabric: railyard::engine::FabricChoice) -> anyhow::Result<()> {
        if self.ofi_provider.is_some() && fabric != railyard::engine::FabricChoice::Ofi {
            anyhow::bail!("--ofi-provider is for --fabric ofi");
        }
        Ok(())
    }

    /// `builder` with these settings.
    pub(crate) fn apply(
        &self,
        builder: railyard::engine::EngineBuilder,
    ) -> railyard::engine::EngineBuilder {
        let builder = builder.verbs(self.config());
        match &self.ofi_provider {
            Some(provider) => builder.ofi(provider),
            None => builder,
        }
    }

    fn config(&self) -> railyard::engine::RailConfig {
        let defaults = railyard::engine::RailConfig::default();
        railyard::engine::RailConfig {
            port: self.ib_port,
            gid_index: self.gid_index,
            qp: railyard::dataplane::fabric::verbs::attrs::QpConfig {
                traffic_class: self.traffic_class,
                ..defaults.qp
            },
            ..defaults
        }
    }
}
