//! Argument parsing and dispatch for the `railyard` binary.

mod chaos;
mod topology;

use clap::{Parser, Subcommand};

/// railyard: zero-copy KV-cache transfer engine.
#[derive(Debug, Parser)]
#[command(name = "railyard", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
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
}

impl Cli {
    pub(crate) fn run(self) -> anyhow::Result<std::process::ExitCode> {
        match self.command {
            Command::Topology(args) => {
                topology::run(&args).map(|()| std::process::ExitCode::SUCCESS)
            }
            Command::Chaos(args) => chaos::run(&args),
        }
    }
}
