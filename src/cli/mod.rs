//! Argument parsing and dispatch for the `railyard` binary.

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
}

impl Cli {
    pub(crate) fn run(self) -> anyhow::Result<()> {
        match self.command {
            Command::Topology(args) => topology::run(&args),
        }
    }
}
