//! `railyard chaos <scenario>`: run one of the failure reproductions and print its counts.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Args;
use railyard::chaos::{self, Scenario};

#[derive(Debug, Args)]
pub(crate) struct ChaosArgs {
    /// reconnect-storm, teardown-race, handshake-churn or dead-replica.
    scenario: String,
    /// Seeds the fault plan and every jitter: the same seed repeats the same failures.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the counts as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Exit status when the scenario ran but broke a promise.
const VIOLATED: u8 = 1;

pub(crate) fn run(args: &ChaosArgs) -> anyhow::Result<ExitCode> {
    let Some(scenario) = Scenario::from_name(&args.scenario) else {
        let names: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
        bail!(
            "unknown scenario {:?}; the scenarios are {}",
            args.scenario,
            names.join(", ")
        );
    };
    let outcome = chaos::run(scenario, args.seed)
        .with_context(|| format!("scenario {} could not run", scenario.name()))?;
    let passed = outcome.violations.is_empty();
    if args.json {
        let mut counts = outcome.counts;
        if let Some(object) = counts.as_object_mut() {
            object.insert("scenario".into(), scenario.name().into());
            object.insert("passed".into(), passed.into());
            object.insert("violations".into(), outcome.violations.clone().into());
        }
        println!("{counts}");
    } else {
        println!("{} (seed {})", scenario.name(), args.seed);
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
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(VIOLATED)
    })
}
