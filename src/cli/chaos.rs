//! `railyard chaos <scenario>`: run one of the failure reproductions and print its counts.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use railyard::chaos::{self, ChaosFabric, Scenario};

#[derive(Debug, Args)]
pub(crate) struct ChaosArgs {
    /// reconnect-storm, teardown-race, handshake-churn, dead-replica, or soak (target
    /// processes under a seeded mix of kills, port takeovers, stops and queue-pair errors).
    scenario: String,
    /// How long the soak runs, in seconds (soak only).
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// Target processes of the soak (soak only).
    #[arg(long, default_value_t = 3)]
    targets: usize,
    /// Soak only, with the `etcd` feature: run an etcd (the `etcd` binary of etcd-server),
    /// publish every process there, open targets by name, and stop and restart etcd among
    /// the faults.
    #[arg(long)]
    etcd: bool,
    /// Seeds the fault plan and every jitter: the same seed repeats the same failures.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the counts as one JSON object.
    #[arg(long)]
    json: bool,
    /// The fabric of the scenario's initiators and target processes: soft (default), or ofi
    /// (libfabric; fault plans are applied in front of the provider).
    #[arg(long, default_value = "soft", value_name = "soft|ofi")]
    fabric: String,
    /// The libfabric provider of `--fabric ofi` (default: efa when this machine has it;
    /// a software provider such as "tcp;ofi_rxm" only when named).
    #[arg(long, value_name = "NAME")]
    ofi_provider: Option<String>,
}

impl ChaosArgs {
    /// The fabric asked for.
    fn fabric(&self) -> anyhow::Result<ChaosFabric> {
        match (self.fabric.as_str(), &self.ofi_provider) {
            ("soft", None) => Ok(ChaosFabric::Soft),
            ("soft", Some(_)) => bail!("--ofi-provider is for --fabric ofi"),
            ("ofi", asked) => Ok(ChaosFabric::Ofi {
                provider: railyard::engine::ofi_provider(asked.as_deref())?,
            }),
            (other, _) => bail!("{other:?} is not a fabric the scenarios run on (soft, ofi)"),
        }
    }
}

/// Exit status when the scenario ran but broke a promise.
const VIOLATED: u8 = 1;

pub(crate) fn run(args: &ChaosArgs) -> anyhow::Result<ExitCode> {
    // What was asked is checked before the fabric is opened.
    let scenario = match Scenario::from_name(&args.scenario) {
        _ if args.scenario == "soak" => None,
        Some(_) if args.etcd => bail!(
            "--etcd is for the soak; {} runs without a directory",
            args.scenario
        ),
        Some(scenario) => Some(scenario),
        None => {
            let names: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
            bail!(
                "unknown scenario {:?}; the scenarios are {} and soak",
                args.scenario,
                names.join(", ")
            );
        }
    };
    let fabric = args.fabric()?;
    let binary = std::env::current_exe().context("finding this binary")?;
    let Some(scenario) = scenario else {
        let config = chaos::soak::SoakConfig {
            binary,
            duration: Duration::from_secs(args.duration),
            seed: args.seed,
            targets: args.targets,
            etcd: args.etcd,
            fabric: fabric.clone(),
        };
        let report = chaos::soak::run(&config).context("the soak could not run")?;
        let outcome = chaos::Outcome {
            violations: report.violations(),
            counts: serde_json::to_value(&report)?,
        };
        return Ok(print(&outcome, "soak", &fabric, args));
    };
    let outcome = chaos::run(scenario, args.seed, &binary, &fabric)
        .with_context(|| format!("scenario {} could not run", scenario.name()))?;
    Ok(print(&outcome, scenario.name(), &fabric, args))
}

/// Prints `outcome` of scenario `name` on `fabric` (as JSON with `--json`); the exit status
/// says whether it held.
fn print(outcome: &chaos::Outcome, name: &str, fabric: &ChaosFabric, args: &ChaosArgs) -> ExitCode {
    let passed = outcome.violations.is_empty();
    if args.json {
        let mut counts = outcome.counts.clone();
        if let Some(object) = counts.as_object_mut() {
            object.insert("scenario".into(), name.into());
            object.insert("fabric".into(), fabric.name().into());
            if let ChaosFabric::Ofi { provider } = fabric {
                object.insert("ofi_provider".into(), provider.as_str().into());
            }
            object.insert("passed".into(), passed.into());
            object.insert("violations".into(), outcome.violations.clone().into());
        }
        println!("{counts}");
    } else {
        match fabric {
            ChaosFabric::Soft => println!("{name} (seed {}, soft fabric)", args.seed),
            ChaosFabric::Ofi { provider } => {
                println!("{name} (seed {}, libfabric {provider})", args.seed);
            }
        }
        if let Some(object) = outcome.counts.as_object() {
            for (name, value) in object {
                println!("  {name:<28} {value}");
            }
        }
        if passed {
            println!("held: every promise of the scenario");
        }
        for violation in &outcome.violations {
            println!("VIOLATED: {violation}");
        }
    }
    if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(VIOLATED)
    }
}
