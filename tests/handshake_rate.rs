//! `railyard handshakes`: initiator processes open one target at once, round after round.
//! Here a small run checks what it reports (every open a whole handshake, none failed, the
//! target's control memory per peer) and that bad arguments get a clear error; the figures
//! at 256 initiators come from running it (see docs/cli.md).

use std::process::Command;

#[test]
fn initiators_in_several_processes_open_one_target_and_the_rate_is_reported() {
    for fabric in ["tcp", "soft"] {
        let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["handshakes", "--initiators", "24", "--processes", "3"])
            .args(["--rounds", "2", "--fabric", fabric, "--json"])
            .output()
            .expect("runs");
        assert!(output.status.success(), "{output:?}");
        let report: serde_json::Value =
            serde_json::from_slice(&output.stdout).expect("one JSON object");
        assert_eq!(report["fabric"], fabric);
        assert_eq!(report["initiators"], 24);
        let rounds = report["rounds"].as_array().expect("rounds");
        assert_eq!(rounds.len(), 2);
        for round in rounds {
            assert_eq!(round["opened"], 24, "{round}");
            assert_eq!(round["failed"].as_array().map(Vec::len), Some(0), "{round}");
            assert!(round["handshakes_per_s"].as_f64() > Some(0.0));
            let per_peer = round["target_control_bytes_per_peer"].as_u64();
            assert!(
                per_peer.is_some_and(|bytes| bytes > 0 && bytes <= 16 << 10),
                "{round}"
            );
            assert!(round["target_known_peers"].as_u64() >= Some(24), "{round}");
        }
        let (p50, p99) = (
            report["open_p50_ms"].as_f64(),
            report["open_p99_ms"].as_f64(),
        );
        assert!(p50 > Some(0.0) && p99 >= p50, "{report}");
    }
}

#[test]
fn bad_arguments_are_refused_with_a_clear_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["handshakes", "--initiators", "0"])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--initiators"), "{stderr}");
}
