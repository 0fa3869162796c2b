//! The four failure reproductions, each with seeds of its own, through the library and
//! through `railyard chaos --json`; and a minute of `railyard chaos soak`. Each also on
//! libfabric's `tcp;ofi_rxm` provider (`--fabric ofi`), with a shorter soak.

mod common;

use std::process::Command;
use std::sync::{Mutex, PoisonError};

use railyard::chaos::{self, Scenario};

/// Scenarios measure throughput and timing: one at a time, so that they do not disturb
/// each other on a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn held(scenario: Scenario, seed: u64) -> serde_json::Value {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let outcome = chaos::run(
        scenario,
        seed,
        std::path::Path::new(env!("CARGO_BIN_EXE_railyard")),
        &chaos::ChaosFabric::Soft,
    )
    .expect("the scenario runs");
    assert!(
        outcome.violations.is_empty(),
        "{} seed {seed}: {:?}\n{}",
        scenario.name(),
        outcome.violations,
        outcome.counts
    );
    outcome.counts
}

#[test]
fn reconnect_storm_posts_nothing_stale_and_reconnects_once() {
    for seed in [1, 17] {
        let counts = held(Scenario::ReconnectStorm, seed);
        assert_eq!(counts["stale_posts"], 0);
        assert_eq!(
            counts["reconnects"], 1,
            "the failure does cause one reconnect"
        );
        assert_eq!(counts["lost"], 0);
        assert_eq!(counts["resolved"], counts["submitted"]);
        assert_eq!(
            counts["failed"], 0,
            "every slice is re-prepared, none fails"
        );
        assert_eq!(counts["new_qp_errors"], 0);
        assert!(counts["reprepared"].as_u64() > Some(200), "{counts}");
        // The bad-descriptor phase: a few queue pairs, not one per bad slice.
        assert!(
            counts["bad_descriptor_reconnects"].as_u64() <= Some(3),
            "{counts}"
        );
        assert_eq!(counts["bad_slices_failed"], counts["bad_slices"]);
        assert_eq!(counts["good_slices_failed"], 0);
    }
}

#[test]
fn the_same_seed_gives_the_same_counts() {
    for scenario in [Scenario::ReconnectStorm, Scenario::HandshakeChurn] {
        assert_eq!(
            held(scenario, 23),
            held(scenario, 23),
            "{}",
            scenario.name()
        );
    }
    assert_ne!(
        held(Scenario::ReconnectStorm, 23)["failed_work_request"],
        held(Scenario::ReconnectStorm, 24)["failed_work_request"],
        "the seed chooses where the failure hits"
    );
}

#[test]
fn teardown_race_loses_nothing_and_resolves_nothing_twice() {
    let counts = held(Scenario::TeardownRace, 5);
    assert_eq!(counts["lost"], 0);
    assert_eq!(counts["double_resolved"], 0);
    assert_eq!(counts["stale_posts"], 0);
    assert_eq!(counts["misplaced_slots"], 0);
    assert!(counts["verified_slots"].as_u64() > Some(0), "{counts}");
    assert!(counts["retirements"].as_u64() >= Some(2000), "{counts}");
    assert!(
        counts["done"].as_u64() > Some(0),
        "traffic flowed: {counts}"
    );
}

#[test]
fn handshake_churn_tears_nothing_down() {
    let counts = held(Scenario::HandshakeChurn, 9);
    assert_eq!(counts["teardowns"], 0);
    assert_eq!(counts["reconnects"], 0);
    assert_eq!(
        counts["passive_qps"], 3,
        "one per peer, two of them on this host"
    );
    assert_eq!(counts["changed_answers"], 0);
    assert_eq!(counts["twins_ran"], true, "{counts}");
    assert_eq!(counts["twin_failed_requests"], 0);
    assert_eq!(counts["twin_reconnects"], 0);
    assert_eq!(counts["twin_teardowns"], 0);
}

#[test]
fn a_dead_replica_fails_fast_and_its_port_is_a_new_peer() {
    let counts = held(Scenario::DeadReplica, 2);
    assert!(
        counts["live_throughput_ratio"].as_f64() >= Some(0.8),
        "{counts}"
    );
    assert!(counts["dead_peer_max_fail_ms"].as_u64() <= counts["deadline_ms"].as_u64());
    assert!(counts["in_flight_at_kill"].as_u64() > Some(0), "{counts}");
    assert!(counts["in_flight_at_stop"].as_u64() > Some(0), "{counts}");
    assert_eq!(
        counts["stuck_at_stop"], 0,
        "soft writes land in a stopped process: {counts}"
    );
    assert_eq!(counts["probes_late"], 0, "{counts}");
    assert_eq!(counts["same_layout"], true, "{counts}");
    assert_eq!(counts["in_flight_late"], 0);
    assert!(
        (1..=2500).contains(&counts["stopped_peer_detection_ms"].as_u64().unwrap_or(0)),
        "{counts}"
    );
    assert_eq!(counts["misdirected"], 0);
    assert_eq!(counts["newcomers_checked"], true);
    assert_eq!(counts["predecessors_retired"], true);
    assert_eq!(counts["newcomers_reached"], true);
}

#[test]
fn the_cli_prints_the_counts_as_json_and_rejects_unknown_scenarios() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["chaos", "reconnect-storm", "--seed", "42", "--json"])
        .output()
        .expect("runs");
    assert!(output.status.success(), "{output:?}");
    let counts: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(counts["scenario"], "reconnect-storm");
    assert_eq!(counts["passed"], true);
    assert_eq!(counts["seed"], 42);
    assert_eq!(counts["stale_posts"], 0);

    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["chaos", "meteor-strike"])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("dead-replica"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1);

    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["chaos", "dead-replica", "--etcd"])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--etcd is for the soak"), "{stderr}");
}

#[test]
fn the_largest_seed_is_a_seed_like_any_other() {
    let counts = held(Scenario::HandshakeChurn, u64::MAX);
    assert_eq!(counts["seed"], u64::MAX);
}

/// A minute of target processes killed and taken over, stopped and let go, and queue pairs
/// failing in bursts, as `railyard chaos soak` runs it: nothing lost, late or misdirected,
/// every stop failing fast within the bound, no growth.
#[test]
fn a_minute_of_soak_loses_nothing_and_fails_fast() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let output = common::output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["chaos", "soak", "--json"])
            .args(["--duration", "60", "--seed", "11"]),
        std::time::Duration::from_secs(180),
    );
    let counts: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert!(output.status.success(), "{counts}");
    assert_eq!(counts["passed"], true, "{counts}");
    assert_eq!(counts["lost"], 0);
    assert_eq!(counts["mismatched_blocks"], 0);
    assert!(counts["kills"].as_u64() >= Some(1), "{counts}");
    assert!(counts["stops"].as_u64() >= Some(1), "{counts}");
    assert!(counts["descriptor_changes"].as_u64() >= Some(1), "{counts}");
    assert!(counts["bytes_verified"].as_u64() > Some(0), "{counts}");
    assert!(
        counts["detection_ms_max"].as_u64() <= Some(2500),
        "{counts}"
    );
}

/// `railyard chaos SCENARIO --fabric ofi --ofi-provider "tcp;ofi_rxm" --json`, with `extra`
/// options; its counts, once it held.
fn held_on_libfabric(scenario: &str, extra: &[&str]) -> serde_json::Value {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let output = common::output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["chaos", scenario, "--json"])
            .args(["--fabric", "ofi", "--ofi-provider", "tcp;ofi_rxm"])
            .args(extra),
        std::time::Duration::from_secs(180),
    );
    let counts: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|_| panic!("one JSON object: {output:?}"));
    assert!(output.status.success(), "{scenario}: {counts}");
    assert_eq!(counts["passed"], true, "{scenario}: {counts}");
    assert_eq!(counts["fabric"], "ofi", "{counts}");
    counts
}

#[test]
fn the_scenarios_hold_on_libfabric() {
    let storm = held_on_libfabric("reconnect-storm", &["--seed", "17"]);
    assert_eq!(storm["stale_posts"], 0);
    assert_eq!(storm["reconnects"], 1, "{storm}");
    assert_eq!(storm["failed"], 0, "{storm}");
    assert_eq!(storm["bytes_verified"], true);
    assert_eq!(storm["bad_slices_failed"], storm["bad_slices"]);

    let race = held_on_libfabric("teardown-race", &["--seed", "5"]);
    assert_eq!(race["lost"], 0);
    assert_eq!(race["double_resolved"], 0);
    assert_eq!(race["stale_posts"], 0);
    assert_eq!(race["misplaced_slots"], 0);
    assert!(race["retirements"].as_u64() >= Some(2000), "{race}");
    assert!(race["queue_pair_failures"].as_u64() > Some(0), "{race}");
    assert!(race["done"].as_u64() > Some(0), "{race}");

    let churn = held_on_libfabric("handshake-churn", &["--seed", "9"]);
    assert_eq!(churn["teardowns"], 0);
    assert_eq!(churn["reconnects"], 0);
    assert_eq!(churn["passive_qps"], 3);
    assert_eq!(churn["twins_ran"], true, "{churn}");
    assert_eq!(churn["twin_failed_requests"], 0);

    let replica = held_on_libfabric("dead-replica", &["--seed", "2"]);
    assert_eq!(replica["misdirected"], 0);
    assert!(replica["in_flight_at_stop"].as_u64() > Some(0), "{replica}");
    // Whether the one batch in flight at the stop waits for its deadline here depends on
    // whether its 256 KiB still fitted in the sockets' buffers (rxm completes a write once
    // sent): 2 runs of 5 it did, so `stuck_at_stop` is reported, not asserted. What must
    // hold either way: nothing in flight resolves later than its deadline.
    assert_eq!(replica["in_flight_late"], 0);
    assert_eq!(replica["probes_late"], 0);
    assert_eq!(replica["same_layout"], true, "{replica}");
    assert!(
        (1..=2500).contains(&replica["stopped_peer_detection_ms"].as_u64().unwrap_or(0)),
        "{replica}"
    );
}

#[test]
fn a_soak_on_libfabric_loses_nothing() {
    let counts = held_on_libfabric("soak", &["--duration", "20", "--seed", "3"]);
    assert_eq!(counts["lost"], 0);
    assert_eq!(counts["mismatched_blocks"], 0);
    assert!(counts["kills"].as_u64() >= Some(1), "{counts}");
    assert!(counts["timed_stops"].as_u64() >= Some(1), "{counts}");
    assert_eq!(counts["undetected_stops"], 0);
    assert_eq!(counts["timeouts_after_detection"], 0);
    assert!(counts["bytes_verified"].as_u64() > Some(0), "{counts}");
}

#[test]
fn the_cli_refuses_a_fabric_it_cannot_run() {
    for (options, expected) in [
        (
            &["--ofi-provider", "tcp;ofi_rxm"][..],
            "--ofi-provider is for --fabric ofi",
        ),
        (
            &["--fabric", "ofi", "--ofi-provider", "carrier-pigeon"][..],
            "present:",
        ),
        (&["--fabric", "verbs"][..], "soft, ofi"),
        (
            &[
                "--fabric",
                "ofi",
                "--ofi-provider",
                "carrier-pigeon",
                "--etcd",
            ][..],
            "--etcd is for the soak",
        ),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["chaos", "reconnect-storm"])
            .args(options)
            .output()
            .expect("runs");
        assert_eq!(output.status.code(), Some(2), "{options:?}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{options:?}: {stderr}");
    }
}

#[test]
fn a_misspelt_scenario_is_named_before_any_fabric_is_opened() {
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "chaos",
            "reconect-storm",
            "--fabric",
            "ofi",
            "--ofi-provider",
            "carrier-pigeon",
        ])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unknown scenario"), "{stderr}");
}
