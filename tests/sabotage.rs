//! The detectors can fail: with one protection switched off (the `sabotage` feature, which
//! `make test` enables and release builds never do), the scenario that guards it reports a
//! violation. Each test holds a process-wide switch, so they take turns.

#![cfg(feature = "sabotage")]

mod common;

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use common::{BOUND, TcpPair};
use railyard::chaos::{self, Scenario};
use railyard::control::Policy;
use railyard::dataplane::sabotage::{self, Protection};
use railyard::dataplane::{FailReason, RequestOutcome};

static ONE_SWITCH_AT_A_TIME: Mutex<()> = Mutex::new(());

fn violations_without(
    protection: Protection,
    scenario: Scenario,
) -> (Vec<String>, serde_json::Value) {
    violations_without_on(&chaos::ChaosFabric::Soft, protection, scenario)
}

fn violations_without_on(
    fabric: &chaos::ChaosFabric,
    protection: Protection,
    scenario: Scenario,
) -> (Vec<String>, serde_json::Value) {
    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(protection);
    let outcome = chaos::run(
        scenario,
        5,
        std::path::Path::new(env!("CARGO_BIN_EXE_railyard")),
        fabric,
    )
    .expect("the scenario runs");
    (outcome.violations, outcome.counts)
}

#[test]
fn without_the_epoch_check_the_reconnect_storm_posts_stale_work() {
    let (violations, counts) = violations_without(Protection::EpochCheck, Scenario::ReconnectStorm);
    assert!(counts["stale_posts"].as_u64() > Some(0), "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("stale_posts")),
        "{violations:?}"
    );
}

#[test]
fn without_the_epoch_check_the_teardown_race_posts_stale_work() {
    let (violations, counts) = violations_without(Protection::EpochCheck, Scenario::TeardownRace);
    assert!(counts["stale_posts"].as_u64() > Some(0), "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("stale_posts")),
        "{violations:?}"
    );
}

/// The same detectors on libfabric (fault plans in front of `tcp;ofi_rxm`).
#[test]
fn on_libfabric_the_storm_churn_and_replica_detectors_fail_too() {
    let ofi = chaos::ChaosFabric::Ofi {
        provider: "tcp;ofi_rxm".into(),
    };
    let (violations, counts) =
        violations_without_on(&ofi, Protection::EpochCheck, Scenario::ReconnectStorm);
    assert!(counts["stale_posts"].as_u64() > Some(0), "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("stale_posts")),
        "{violations:?}"
    );
    let (violations, counts) = violations_without_on(
        &ofi,
        Protection::IdempotentReplies,
        Scenario::HandshakeChurn,
    );
    assert!(counts["teardowns"].as_u64() > Some(0), "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("teardowns")),
        "{violations:?}"
    );
    // Keys differ between a dead target and its newcomer here, but the refreshed descriptor
    // carries the newcomer's: taken for its predecessor, it receives what was meant for it.
    let (violations, counts) =
        violations_without_on(&ofi, Protection::IncarnationCheck, Scenario::DeadReplica);
    assert!(counts["misdirected"].as_u64() > Some(0), "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("misdirected")),
        "{violations:?}"
    );
}

/// With liveness off, dead-replica's stopped target is never failed fast: its phase 2
/// reports the detection bound broken.
#[test]
fn without_liveness_the_dead_replicas_stopped_target_is_not_failed_fast() {
    let (violations, counts) = violations_without(Protection::Liveness, Scenario::DeadReplica);
    assert!(
        violations
            .iter()
            .any(|v| v.starts_with("the stopped peer failed fast after")),
        "{violations:?} {counts}"
    );
}

#[test]
fn without_idempotent_replies_the_handshake_churn_tears_queue_pairs_down() {
    let (violations, counts) =
        violations_without(Protection::IdempotentReplies, Scenario::HandshakeChurn);
    assert!(counts["teardowns"].as_u64() > Some(0), "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("teardowns")),
        "{violations:?}"
    );
}

/// With the incarnation check off, the initiator takes each newcomer for the dead target
/// on its port: the dead target's handle carries on into the newcomer's memory.
#[test]
fn without_the_incarnation_check_a_newcomer_receives_what_was_meant_for_the_dead() {
    let (violations, counts) =
        violations_without(Protection::IncarnationCheck, Scenario::DeadReplica);
    assert!(counts["misdirected"].as_u64() > Some(0), "{counts}");
    assert_eq!(counts["predecessors_retired"], false, "{counts}");
    assert!(
        violations.iter().any(|v| v.starts_with("misdirected")),
        "{violations:?}"
    );
}

/// With liveness off, a stopped target is noticed only at the deadline: its work fails as
/// `Timeout` after 5 s, never fast as `PeerUnavailable`.
#[test]
fn without_liveness_a_stopped_target_is_detected_only_past_the_bound() {
    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(Protection::Liveness);
    let TcpPair {
        target,
        engine,
        peer,
        mut submitter,
        write,
    } = TcpPair::start(Policy::default());
    target.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let batch = submitter.submit(&peer, &[write]).expect("submitted");
    batch.wait(Instant::now() + BOUND);
    let resolved = stopped.elapsed();
    assert_ne!(
        batch.outcomes(),
        vec![Some(RequestOutcome::Failed(FailReason::PeerUnavailable))],
        "failed fast without liveness?"
    );
    assert!(
        resolved > Duration::from_millis(2500),
        "resolved after {resolved:?}: the detector would not have caught the loss"
    );
    assert_eq!(engine.stats().control.unreachable_peers, 0);
    target.signal(libc::SIGCONT);
}

/// The simulation's invariants can fail, and a failing run shrinks: with liveness off, the
/// stopped process is never noticed, and the shortest run that still shows it is found and
/// its trace printed.
#[test]
fn without_liveness_the_simulation_reports_a_stopped_peer_undetected_and_shrinks_the_run() {
    use railyard::control::sim::{self, SimConfig};

    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(Protection::Liveness);
    let config = SimConfig {
        peers: 40,
        seed: 5,
        duration: Duration::from_secs(12),
        ..SimConfig::default()
    };
    let report = sim::simulate(&config);
    let broken = "stopped-peers-detected-in-time";
    assert!(
        report.violations.iter().any(|v| v.invariant == broken),
        "{:?}",
        report.violations
    );
    let shrunk = sim::shrink(&config, 40).expect("the run fails, so it shrinks");
    assert!(shrunk.runs <= 41, "{} runs", shrunk.runs);
    assert!(
        shrunk
            .report
            .violations
            .iter()
            .any(|v| v.invariant == broken),
        "{:?}",
        shrunk.report.violations
    );
    let faults = shrunk.config.faults.as_ref().expect("explicit faults");
    assert!(
        shrunk.config.peers < config.peers && faults.len() < sim::faults(&config).len(),
        "not much was taken away: {:?}",
        shrunk.config
    );
    assert!(shrunk.config.duration < config.duration);
    assert!(
        shrunk
            .report
            .trace
            .iter()
            .any(|line| line.contains("VIOLATION")),
        "the trace shows the violation"
    );
}

/// With the poller's idle check off, the simulation's evictions take work in flight with
/// them: it reports the transfers they failed.
#[test]
fn without_the_idle_check_the_simulation_reports_evictions_that_fail_transfers() {
    use railyard::control::sim::{self, SimConfig};

    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(Protection::IdleEviction);
    let report = sim::simulate(&SimConfig {
        peers: 60,
        seed: 3,
        duration: Duration::from_secs(6),
        policy: Policy {
            max_endpoints_per_rail: 4,
            ..Policy::default()
        },
        ..SimConfig::default()
    });
    assert!(report.failed_by_eviction > 0, "{report:?}");
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.invariant == "evictions-fail-nothing"),
        "{:?}",
        report.violations
    );
}

/// Without handshake admission, initiators past what a busy target answers within the
/// connect timeout give up and ask again, and the target answers every abandoned attempt
/// too: the simulation's reconnect count shows the storm that taking turns prevents.
#[test]
fn without_handshake_admission_the_simulation_shows_a_reconnect_storm() {
    use railyard::control::sim::{self, SimConfig};

    let config = SimConfig {
        peers: 500,
        seed: 3,
        duration: Duration::from_secs(15),
        hot_targets: 4,
        handshake_cost: Duration::from_millis(10),
        ..SimConfig::default()
    };
    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let in_turns = sim::simulate(&config);
    assert!(in_turns.passed(), "{:?}", in_turns.violations);
    assert!(in_turns.all_connected_after.is_some());
    assert!(in_turns.max_reconnects_per_pair <= 1, "{in_turns:?}");
    let storm = {
        let _off = sabotage::turn_off(Protection::HandshakeAdmission);
        sim::simulate(&config)
    };
    assert_eq!(storm.handshakes_told_to_wait, 0);
    assert!(
        storm.mean_reconnects_per_pair > 100.0 * in_turns.mean_reconnects_per_pair.max(0.001),
        "reconnects per pair: {} with admission, {} without",
        in_turns.mean_reconnects_per_pair,
        storm.mean_reconnects_per_pair
    );
    assert!(storm.max_reconnects_per_pair >= 3, "{storm:?}");
    assert!(
        storm.handshakes > in_turns.handshakes * 3 / 2,
        "{} handshakes with admission, {} without",
        in_turns.handshakes,
        storm.handshakes
    );
    assert!(
        storm.all_connected_after.is_none(),
        "the storm never settles"
    );
}

/// A run of the simulation with the store's master beside the control plane.
fn store_simulation(seed: u64) -> railyard::control::sim::SimReport {
    use railyard::control::sim::{self, SimConfig};
    use railyard_store::sim::StoreSimConfig;

    sim::simulate(&SimConfig {
        peers: 200,
        seed,
        duration: Duration::from_secs(12),
        services: vec![StoreSimConfig::default().service()],
        ..SimConfig::default()
    })
}

/// Without term fences, a new master hands out space that writes its predecessor placed
/// still land on (writers whose pollers stalled across the failover): readers within their
/// lease see another object's bytes.
#[test]
fn without_term_fences_the_simulation_reads_another_objects_bytes_after_a_failover() {
    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(Protection::StoreTermFences);
    let broken: Vec<String> = (21..=26)
        .flat_map(|seed| store_simulation(seed).violations)
        .map(|violation| violation.invariant.to_string())
        .collect();
    assert!(
        broken
            .iter()
            .any(|invariant| invariant == "store-reads-under-lease-see-their-value"),
        "{broken:?}"
    );
}

/// Without leader fencing, a stopped leader that resumes after another took over answers
/// again under its old term.
#[test]
fn without_leader_fencing_the_simulation_sees_two_terms_answer() {
    let _turn = ONE_SWITCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(Protection::StoreLeaderFencing);
    let report = store_simulation(21);
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.invariant == "store-one-leader-answers"),
        "{:?}",
        report.violations
    );
}
