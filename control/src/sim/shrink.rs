//! Shrinking a failing run: the smallest configuration found that still breaks the same
//! invariant, by taking away one thing at a time — faults, then the network's misbehaviour,
//! then processes, then time — and keeping each change that still fails.

use std::time::Duration;

use super::config::{FaultKind, NetFaults, SimConfig, SimReport};
use super::world::{faults, simulate};

/// The smallest failing run found.
#[derive(Clone, Debug)]
pub struct Shrunk {
    /// Its configuration (faults explicit).
    pub config: SimConfig,
    /// Its report, with the trace's lines.
    pub report: SimReport,
    /// Runs tried while shrinking.
    pub runs: usize,
}

/// Shrinks `config`, whose run broke an invariant, in at most `budget` runs. `None` if the
/// run does not fail.
pub fn shrink(config: &SimConfig, budget: usize) -> Option<Shrunk> {
    let first = simulate(config);
    let broken = first.violations.first()?.invariant;
    let mut best = SimConfig {
        faults: Some(faults(config)),
        record_trace: false,
        ..config.clone()
    };
    let mut best_report = first;
    let mut runs = 1;
    let fails = |candidate: &SimConfig, runs: &mut usize| -> Option<SimReport> {
        *runs += 1;
        let report = simulate(candidate);
        report
            .violations
            .iter()
            .any(|violation| violation.invariant == broken)
            .then_some(report)
    };
    let mut progress = true;
    while progress && runs < budget {
        progress = false;
        for candidate in smaller(&best, &best_report) {
            if runs >= budget {
                break;
            }
            if let Some(report) = fails(&candidate, &mut runs) {
                best = candidate;
                best_report = report;
                progress = true;
                break;
            }
        }
    }
    let traced = SimConfig {
        record_trace: true,
        ..best.clone()
    };
    let report = simulate(&traced);
    Some(Shrunk {
        config: best,
        report,
        runs: runs + 1,
    })
}

/// Configurations one step smaller than `config`, most promising first.
fn smaller(config: &SimConfig, report: &SimReport) -> Vec<SimConfig> {
    let mut candidates = Vec::new();
    let faults = config.faults.clone().unwrap_or_default();
    // Stop just after the first violation.
    if let Some(first) = report.violations.first() {
        let cut = first.at + Duration::from_millis(100);
        if cut < config.duration {
            candidates.push(SimConfig {
                duration: cut,
                faults: Some(faults.iter().filter(|f| f.at < cut).cloned().collect()),
                ..config.clone()
            });
        }
    }
    for index in (0..faults.len()).rev() {
        let mut fewer = faults.clone();
        fewer.remove(index);
        candidates.push(SimConfig {
            faults: Some(fewer),
            ..config.clone()
        });
    }
    if config.net != NetFaults::quiet() {
        candidates.push(SimConfig {
            net: NetFaults::quiet(),
            ..config.clone()
        });
    }
    if config.peers > 2 {
        let peers = config.peers.div_ceil(2);
        let kept = faults
            .iter()
            .filter(|fault| match &fault.kind {
                FaultKind::Kill { peer, .. }
                | FaultKind::Stop { peer, .. }
                | FaultKind::LeaseLoss { peer, .. } => *peer < peers,
                FaultKind::Partition { peers: side, .. } => side.iter().all(|&p| p < peers),
            })
            .cloned()
            .collect();
        candidates.push(SimConfig {
            peers,
            fanout: config.fanout.min(peers - 1),
            faults: Some(kept),
            ..config.clone()
        });
    }
    if config.fanout > 1 {
        candidates.push(SimConfig {
            fanout: config.fanout / 2,
            ..config.clone()
        });
    }
    candidates
}
