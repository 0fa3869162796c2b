//! `railyard chaos hicache` as a user runs it: one round of its five faults (a segment
//! process killed and replaced on its port, another stopped, a burst of transfer errors on
//! a client's rail, the leading master killed, the next one stopped and let go) against a
//! store under a HiCache-shaped load, judged from every call the client processes made.
//! With read fail-over or leader fencing switched off, the same run reports the violation
//! and exits 1: the scenario can fail.

#![cfg(feature = "etcd")]

use std::process::Command;
use std::sync::{Mutex, PoisonError};

/// Each run measures latency and throughput on a small machine: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `railyard chaos hicache --seed SEED --duration 1 --json` with `sabotage` switched
/// off in every process (none if empty); returns its exit code and report.
fn hicache(seed: u64, sabotage: &str) -> (Option<i32>, serde_json::Value) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["chaos", "hicache", "--duration", "1", "--json", "--seed"])
        .arg(seed.to_string())
        .env("RAILYARD_SABOTAGE", sabotage)
        .output()
        .expect("railyard runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = serde_json::from_str(stdout.trim()).unwrap_or_else(|error| {
        panic!(
            "no JSON report ({error}): {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code(), report)
}

#[test]
fn a_round_of_faults_reads_no_wrong_byte_and_fails_no_get_a_live_replica_could_serve() {
    let (code, report) = hicache(3, "");
    assert_eq!(report["violations"], serde_json::json!([]), "{report:#}");
    assert_eq!(code, Some(0));
    assert_eq!(report["passed"], true);
    for fault in [
        "segment_kills",
        "segment_stops",
        "error_bursts",
        "master_kills",
        "master_stops",
    ] {
        assert_eq!(report[fault], 1, "{fault}: {report:#}");
    }
    assert_eq!(report["wrong_bytes"], 0);
    assert_eq!(report["gets_failed_with_live_replica"], 0);
    assert_eq!(report["deposed_master_acted"], 0);
    assert_eq!(report["stuck_puts"], 0);
    assert_eq!(report["leaked_bytes"], 0);
    assert_eq!(report["objects_left"], 0);
    // It did real work: every byte read was checked, and each fault was measured.
    assert!(report["gets_ok"].as_u64() > Some(100), "{report:#}");
    assert!(
        report["bytes_checked"].as_u64() > Some(50 << 20),
        "{report:#}"
    );
    assert_eq!(report["faults"].as_array().map(Vec::len), Some(3));
    assert_eq!(report["serve_again_ms"].as_array().map(Vec::len), Some(1));
}

#[cfg(feature = "sabotage")]
#[test]
fn without_read_fail_over_gets_fail_while_a_replica_lives_and_the_run_fails() {
    let (code, report) = hicache(3, "store-read-failover");
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(report["passed"], false);
    assert!(
        report["gets_failed_with_live_replica"].as_u64() > Some(0),
        "{report:#}"
    );
}

#[cfg(feature = "sabotage")]
#[test]
fn without_leader_fencing_the_deposed_master_acts_and_the_run_fails() {
    let (code, report) = hicache(3, "store-leader-fencing");
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(report["passed"], false);
    assert_eq!(report["deposed_master_acted"], 1, "{report:#}");
}

#[test]
fn hicache_refuses_options_of_the_other_scenarios() {
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["chaos", "hicache", "--fabric", "ofi"])
        .output()
        .expect("railyard runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("TCP fabric"), "{stderr}");
}
