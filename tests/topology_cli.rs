//! `railyard topology` as a user runs it: JSON on the production fixture, the human table,
//! and one-line errors with exit status 2 for bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

fn railyard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(args)
        .env_remove("RAILYARD_NICS")
        .output()
        .expect("the railyard binary runs")
}

fn fixture() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/topology/hicache-12nic.xml")
        .display()
        .to_string()
}

#[test]
fn json_plan_of_the_production_fixture() {
    let out = railyard(&["topology", "--xml", &fixture(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rails: Vec<&str> = plan["rails"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        rails,
        [
            "mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"
        ]
    );
    assert_eq!(plan["gpus"][7]["preferred_rails"][0], "mlx5_11");
    assert_eq!(plan["source"], "xml");
}

#[test]
fn human_output_lists_rails_skipped_devices_and_distances() {
    let out = railyard(&["topology", "--xml", &fixture()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("mlx5_0  InfiniBand 400 Gb/s 0    0000:12:00.0 2"),
        "{text}"
    );
    assert!(text.contains("mlx5_7       Ethernet, but the primary fabric is InfiniBand"));
    assert!(text.contains("*PIX"));
}

#[test]
fn nic_list_comes_from_the_flag_or_the_environment() {
    let out = railyard(&[
        "topology",
        "--xml",
        &fixture(),
        "--json",
        "--nics",
        "mlx5_3",
    ]);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["rails"].as_array().unwrap().len(), 1);
    let env = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["topology", "--xml", &fixture(), "--json"])
        .env("RAILYARD_NICS", "-mlx5_0")
        .output()
        .unwrap();
    let plan: serde_json::Value = serde_json::from_slice(&env.stdout).unwrap();
    assert_eq!(plan["rails"].as_array().unwrap().len(), 7);
}

fn assert_one_line_error(out: &Output, needle: &str) {
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(needle), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn bad_input_is_a_one_line_error_with_status_2() {
    assert_one_line_error(
        &railyard(&["topology", "--xml", "/nonexistent.xml"]),
        "/nonexistent.xml",
    );
    let dir = std::env::temp_dir().join(format!("railyard-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.xml");
    std::fs::write(&bad, "not xml at all").unwrap();
    assert_one_line_error(
        &railyard(&["topology", "--xml", bad.to_str().unwrap()]),
        "not a valid hwloc XML topology",
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert_one_line_error(
        &railyard(&["topology", "--xml", &fixture(), "--nics", "mlx5_42"]),
        "no such RDMA device",
    );
}

#[test]
fn live_topology_runs_and_exports_a_replayable_snapshot() {
    let dir = std::env::temp_dir().join(format!("railyard-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let export = dir.join("live.xml");
    let out = railyard(&["topology", "--json", "--export", export.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let live: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(live["source"], "live");
    let replay = railyard(&["topology", "--json", "--xml", export.to_str().unwrap()]);
    let replayed: serde_json::Value = serde_json::from_slice(&replay.stdout).unwrap();
    assert_eq!(replayed["rails"], live["rails"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
