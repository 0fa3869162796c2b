//! Which scenarios `railyard chaos` knows by name, and how one runs to an [`Outcome`]: its
//! counts and the promises it broke.

use super::fabric::ChaosFabric;
use super::{churn, race, replica, storm};

/// The scenarios, by their command-line names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// [`storm`].
    ReconnectStorm,
    /// [`race`].
    TeardownRace,
    /// [`churn`].
    HandshakeChurn,
    /// [`replica`].
    DeadReplica,
}

impl Scenario {
    /// Every scenario, in the order DESIGN.md lists the failures.
    pub const ALL: [Self; 4] = [
        Self::ReconnectStorm,
        Self::TeardownRace,
        Self::HandshakeChurn,
        Self::DeadReplica,
    ];

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::ReconnectStorm => "reconnect-storm",
            Self::TeardownRace => "teardown-race",
            Self::HandshakeChurn => "handshake-churn",
            Self::DeadReplica => "dead-replica",
        }
    }

    /// The scenario called `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// What a scenario reports: its counts as JSON, and what it promised but did not hold.
#[derive(Debug)]
pub struct Outcome {
    /// The counts (field names are the contract).
    pub counts: serde_json::Value,
    /// Broken promises; empty when the scenario held.
    pub violations: Vec<String>,
}

/// Runs `scenario` with `seed` on `fabric`; `binary` is the `railyard` executable whose
/// `serve` runs the target processes.
///
/// # Errors
/// When the scenario could not run at all (a node did not start, a peer never connected).
pub fn run(
    scenario: Scenario,
    seed: u64,
    binary: &std::path::Path,
    fabric: &ChaosFabric,
) -> anyhow::Result<Outcome> {
    fn outcome<R: serde::Serialize>(
        report: &R,
        violations: Vec<String>,
    ) -> anyhow::Result<Outcome> {
        Ok(Outcome {
            counts: serde_json::to_value(report)?,
            violations,
        })
    }
    match scenario {
        Scenario::ReconnectStorm => {
            let report = storm::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
        Scenario::TeardownRace => {
            let report = race::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
        Scenario::HandshakeChurn => {
            let report = churn::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
        Scenario::DeadReplica => {
            let report = replica::run(seed, binary, fabric)?;
            outcome(&report, report.violations())
        }
    }
}
