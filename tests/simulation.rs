//! The deterministic simulation of the control plane (`railyard sim`): a seed replays bit for
//! bit, and a few seeds with hundreds of processes — kills and restarts on the same ports,
//! a stopped process, a partition, a lost lease, a misbehaving network — hold every
//! invariant and meet the figures the design promises.

use std::time::Duration;

use railyard::control::sim::{self, NetFaults, SimConfig, SimReport};
use railyard_store::sim::StoreSimConfig;

fn run(config: &SimConfig) -> SimReport {
    let report = sim::simulate(config);
    assert!(
        report.passed(),
        "seed {} broke invariants: {:#?}",
        config.seed,
        report.violations
    );
    report
}

/// The report without what differs between equal runs (the wall clock).
fn replayable(report: &SimReport) -> SimReport {
    SimReport {
        wall: Duration::ZERO,
        ..report.clone()
    }
}

#[test]
fn the_same_seed_replays_bit_for_bit() {
    let config = SimConfig {
        peers: 120,
        seed: 4242,
        duration: Duration::from_secs(9),
        ..SimConfig::default()
    };
    let first = run(&config);
    let again = run(&config);
    assert_eq!(first.trace_hash, again.trace_hash);
    assert_eq!(replayable(&first), replayable(&again));
    assert!(first.events > 100_000, "{} events", first.events);

    let other = run(&SimConfig {
        seed: 4243,
        ..config.clone()
    });
    assert_ne!(first.trace_hash, other.trace_hash);
}

#[test]
fn hundreds_of_peers_hold_every_invariant_under_faults() {
    let policy = railyard::control::Policy::default();
    for seed in [101, 202, 303] {
        let config = SimConfig {
            peers: 300,
            seed,
            duration: Duration::from_secs(15),
            // A lossier network than the default: connections reset, replies repeat and
            // overtake each other.
            net: NetFaults {
                loss: 0.001,
                duplicate: 0.001,
                reorder: 0.002,
                ..NetFaults::default()
            },
            ..SimConfig::default()
        };
        let report = run(&config);
        println!(
            "seed {seed}: {report:?}",
            report = SimReport {
                trace: Vec::new(),
                ..report.clone()
            }
        );
        let connected = report.all_connected_after.expect("every pair connected");
        assert!(connected < Duration::from_secs(2), "{connected:?}");
        let converged = report
            .converged_after_restart
            .expect("the restarted peers came back");
        assert!(converged < Duration::from_secs(2), "{converged:?}");
        let detected = report
            .max_stop_detection
            .expect("the stopped peer was noticed");
        assert!(
            detected <= policy.liveness_timeout + policy.keepalive_interval,
            "{detected:?}"
        );
        assert!(report.max_reconnects_per_pair <= config.max_reconnects_per_pair);
        assert!(report.control_state_bytes_per_peer <= 16 << 10);
        assert!(report.peak_endpoints_per_rail <= config.fanout);
        assert!(
            report.completed * 10 >= report.requests * 9,
            "{} of {} transfers completed",
            report.completed,
            report.requests
        );
    }
}

#[test]
fn without_a_directory_survivors_find_restarted_peers_by_their_address() {
    let policy = railyard::control::Policy::default();
    let report = run(&SimConfig {
        peers: 200,
        seed: 77,
        duration: Duration::from_secs(15),
        directory: false,
        // The restart alone: a partition or stop on top of it would add cooldowns.
        partitions: 0,
        stops: 0,
        lease_losses: 0,
        ..SimConfig::default()
    });
    let converged = report
        .converged_after_restart
        .expect("the restarted peers came back");
    // Dials refused while the peer was down open the survivors' circuits: they look again
    // when the cooldown ends.
    assert!(
        converged <= policy.cooldown_min + Duration::from_secs(2),
        "{converged:?}"
    );
}

/// With room for half the peers each process sends to, endpoints are parked and woken as
/// traffic moves: no rail ever holds more queue pairs than its cap, nothing fails because
/// of an eviction, and woken endpoints are not counted as reconnects.
#[test]
fn a_queue_pair_cap_below_the_fanout_parks_idle_endpoints_and_fails_nothing() {
    let report = run(&SimConfig {
        peers: 200,
        seed: 31,
        duration: Duration::from_secs(10),
        policy: railyard::control::Policy {
            max_endpoints_per_rail: 4,
            ..railyard::control::Policy::default()
        },
        ..SimConfig::default()
    });
    assert!(report.evictions > 1_000, "{} evictions", report.evictions);
    assert_eq!(report.failed_by_eviction, 0);
    assert!(report.peak_queue_pairs_per_rail <= 4);
    assert!(report.peak_endpoints_per_rail > 4);
    assert!(report.max_reconnects_per_pair <= 4);
    assert!(
        report.completed * 10 >= report.requests * 9,
        "{} of {} transfers completed",
        report.completed,
        report.requests
    );
}

/// A thousand processes all writing into eight, each handshake costing its target 1 ms:
/// with handshakes taking turns (at most 64 in progress per target), every pair connects
/// within 2 s of simulated time and none times out and asks again.
#[test]
fn a_thousand_initiators_into_eight_targets_connect_in_turn_within_two_seconds() {
    let report = run(&SimConfig {
        peers: 1000,
        seed: 7,
        duration: Duration::from_secs(4),
        hot_targets: 8,
        handshake_cost: Duration::from_millis(1),
        kill_fraction: 0.0,
        stops: 0,
        partitions: 0,
        lease_losses: 0,
        ..SimConfig::default()
    });
    let connected = report.all_connected_after.expect("every pair connected");
    assert!(connected <= Duration::from_secs(2), "after {connected:?}");
    assert!(report.handshakes_told_to_wait > 1_000, "{report:?}");
    // A lost message resets its connection now and then (the default network).
    assert!(report.max_reconnects_per_pair <= 1, "{report:?}");
    assert!(report.peak_handshakes_per_sec_into_one >= 900, "{report:?}");
}

/// The figure `name` the store reported.
fn store_figure(report: &SimReport, name: &str) -> f64 {
    let store = report
        .services
        .iter()
        .find(|service| service.name == "store")
        .expect("the store ran beside the control plane");
    store
        .figures
        .iter()
        .find(|(figure, _)| *figure == name)
        .map(|(_, value)| *value)
        .unwrap_or_else(|| panic!("the store reports no {name}"))
}

/// The store's master (the real core) beside the control plane: two masters failing over
/// through the modelled etcd (the leader killed, then stopped), writers whose pollers stall
/// across each failover, processes killed and stopped under it, connections to the master
/// reset by lost messages. Every read within its lease sees its own value, no replica is
/// handed out on a silent member, one term answers at a time, and the run replays bit for
/// bit.
#[test]
fn the_store_master_fails_over_and_holds_its_invariants_in_the_simulation() {
    for seed in [21, 22, 23] {
        let config = SimConfig {
            peers: 200,
            seed,
            duration: Duration::from_secs(12),
            services: vec![StoreSimConfig::default().service()],
            // Lossier than the default: the store's connections to the master reset too.
            net: NetFaults {
                loss: 0.001,
                ..NetFaults::default()
            },
            ..SimConfig::default()
        };
        let report = run(&config);
        let figure = |name| store_figure(&report, name);
        assert_eq!(figure("terms"), 3.0, "the leader was killed, then stopped");
        assert!(figure("connection_resets") > 0.0, "{:?}", report.services);
        assert!(
            figure("deferred_calls") > 0.0,
            "calls cut off by a reset or made while attaching went out once attached: {:?}",
            report.services
        );
        assert!(
            figure("quiesced_after_waiting") > 0.0,
            "writers that attached with writes out said so once they resolved: {:?}",
            report.services
        );
        assert!(figure("unresolved_writes") > 0.0, "{:?}", report.services);
        assert!(figure("reads_verified") > 1000.0, "{:?}", report.services);
        assert!(
            figure("puts_completed") > 2.0 * figure("puts_failed"),
            "{:?}",
            report.services
        );
        assert!(figure("fences") > 0.0, "{:?}", report.services);
        assert!(
            figure("writes_dropped_by_fence") > 0.0,
            "late writes were fenced off: {:?}",
            report.services
        );
        assert!(figure("evictions_last_term") > 0.0, "{:?}", report.services);
        assert!(
            figure("longest_without_leader_s") <= 1.5,
            "{:?}",
            report.services
        );
        if seed == 21 {
            let again = run(&config);
            assert_eq!(report.trace_hash, again.trace_hash);
            assert_eq!(report.services, again.services);
            let without = run(&SimConfig {
                services: Vec::new(),
                ..config.clone()
            });
            assert_ne!(report.trace_hash, without.trace_hash);
        }
    }
}
