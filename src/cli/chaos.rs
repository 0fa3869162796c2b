//! `railyard chaos <scenario>`: run one of the failure reproductions and print its counts.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use railyard::chaos::{self, ChaosFabric, Scenario};

#[derive(Debug, Args)]
pub(crate) struct ChaosArgs {
    /// reconnect-storm, teardown-race, handshake-churn, dead-replica, soak (target
    /// processes under a seeded mix of kills, port takeovers, stops and queue-pair errors),
    /// or hicache (the store under a HiCache-shaped load while segment processes and the
    /// leading master die; needs the `etcd` feature and etcd-server).
    scenario: String,
    /// How long the soak or hicache runs, in seconds (hicache: at least one round of its
    /// five faults, about 50 s).
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
    // A protection switched off for a test is off in the scenario and its processes.
    #[cfg(feature = "sabotage")]
    railyard::dataplane::sabotage::turn_off_from_env();
    // What was asked is checked before the fabric is opened.
    if args.scenario == "hicache" {
        return hicache(args);
    }
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
                "unknown scenario {:?}; the scenarios are {}, soak and hicache",
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
        return Ok(print(
            &outcome,
            "soak",
            fabric.name(),
            provider(&fabric),
            args,
        ));
    };
    let outcome = chaos::run(scenario, args.seed, &binary, &fabric)
        .with_context(|| format!("scenario {} could not run", scenario.name()))?;
    Ok(print(
        &outcome,
        scenario.name(),
        fabric.name(),
        provider(&fabric),
        args,
    ))
}

/// The libfabric provider of `fabric`, if it is libfabric.
fn provider(fabric: &ChaosFabric) -> Option<&str> {
    match fabric {
        ChaosFabric::Ofi { provider } => Some(provider),
        ChaosFabric::Soft => None,
    }
}

/// `railyard chaos hicache`: the store's processes under faults (see
/// [`railyard::chaos::hicache`]).
#[cfg(feature = "etcd")]
fn hicache(args: &ChaosArgs) -> anyhow::Result<ExitCode> {
    if args.fabric != "soft" || args.ofi_provider.is_some() || args.etcd {
        bail!(
            "hicache runs its processes on the TCP fabric (a stopped process stops serving, as behind a NIC) with an etcd of its own: no --fabric, --ofi-provider or --etcd"
        );
    }
    let config = chaos::hicache::HicacheConfig {
        binary: std::env::current_exe().context("finding this binary")?,
        seed: args.seed,
        duration: Duration::from_secs(args.duration),
    };
    let report = chaos::hicache::run(&config).context("hicache could not run")?;
    let outcome = chaos::Outcome {
        violations: report.violations(),
        counts: serde_json::to_value(&report)?,
    };
    Ok(print(&outcome, "hicache", "tcp", None, args))
}

/// `railyard chaos hicache` in a build without etcd.
#[cfg(not(feature = "etcd"))]
fn hicache(_: &ChaosArgs) -> anyhow::Result<ExitCode> {
    bail!(
        "hicache needs etcd: build railyard with `--features etcd` (`make run` and `make test` do)"
    )
}

/// Prints `outcome` of scenario `name` on `fabric` (libfabric: through `provider`), as JSON
/// with `--json`; the exit status says whether it held.
fn print(
    outcome: &chaos::Outcome,
    name: &str,
    fabric: &str,
    provider: Option<&str>,
    args: &ChaosArgs,
) -> ExitCode {
    let passed = outcome.violations.is_empty();
    if args.json {
        let mut counts = outcome.counts.clone();
        if let Some(object) = counts.as_object_mut() {
            object.insert("scenario".into(), name.into());
            object.insert("fabric".into(), fabric.into());
            if let Some(provider) = provider {
                object.insert("ofi_provider".into(), provider.into());
            }
            object.insert("passed".into(), passed.into());
            object.insert("violations".into(), outcome.violations.clone().into());
        }
        println!("{counts}");
    } else {
        match provider {
            None => println!("{name} (seed {}, {fabric} fabric)", args.seed),
            Some(provider) => println!("{name} (seed {}, libfabric {provider})", args.seed),
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
