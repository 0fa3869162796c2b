//! `railyard doctor`: every check is reported with its status, detail and fix, the exit
//! status is 0 / 1 / 2 for the worst of them, and the verdicts follow the host: a low
//! locked-memory limit (set as `prlimit` does, in the child before it runs), a topology
//! snapshot with RDMA ports down or unreadable, a secret file others may read, an etcd that
//! does not answer.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

mod common;

/// How long one doctor run may take.
const BOUND: Duration = Duration::from_secs(60);

const CHECKS: [&str; 9] = [
    "memlock",
    "hugepages",
    "rdma",
    "libfabric",
    "numa",
    "cores",
    "secret",
    "etcd",
    "clocksource",
];

/// Runs `railyard doctor --json ARGS` with a locked-memory limit of 64 KiB: its report and
/// exit status.
fn doctor(args: &[&str]) -> (Value, i32) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_railyard"));
    command
        .args(["doctor", "--json"])
        .args(args)
        .env_remove("RAILYARD_SECRET_FILE");
    // SAFETY: between fork and exec the closure only calls setrlimit, which is
    // async-signal-safe, on a struct it owns.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let output = common::output_within(&mut command, BOUND);
    let report: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
        panic!(
            "not JSON: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (report, output.status.code().expect("exited"))
}

fn check<'r>(report: &'r Value, name: &str) -> &'r Value {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|check| check["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check in {report}"))
}

/// The exit status of a report's worst status.
fn exit_status_of(report: &Value) -> i32 {
    match report["status"].as_str() {
        Some("ok") => 0,
        Some("warning") => 1,
        Some("problem") => 2,
        other => panic!("status {other:?}"),
    }
}

#[test]
fn every_check_has_a_status_a_detail_and_a_fix_when_not_ok() {
    let (report, code) = doctor(&["--pool", "32KiB"]);
    let names: Vec<&str> = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|check| check["name"].as_str().expect("a name"))
        .collect();
    assert_eq!(names, CHECKS);
    let mut worst = "ok";
    for check in report["checks"].as_array().expect("checks") {
        let status = check["status"].as_str().expect("a status");
        assert!(["ok", "warning", "problem"].contains(&status), "{check}");
        assert!(!check["detail"].as_str().expect("a detail").is_empty());
        assert_eq!(check["fix"].is_string(), status != "ok", "{check}");
        if status == "problem" || (status == "warning" && worst == "ok") {
            worst = status;
        }
    }
    assert_eq!(report["status"], worst);
    assert_eq!(code, exit_status_of(&report));
    assert!(report["host"].is_string());
    // 32 KiB fits under 64 KiB of locked memory.
    assert_eq!(check(&report, "memlock")["status"], "ok", "{report}");
}

#[test]
fn a_low_locked_memory_limit_is_reported_with_its_fix() {
    let (report, code) = doctor(&["--pool", "1MiB"]);
    let memlock = check(&report, "memlock");
    assert_ne!(memlock["status"], "ok", "{memlock}");
    assert!(
        memlock["detail"]
            .as_str()
            .expect("detail")
            .contains("64 KiB"),
        "{memlock}"
    );
    assert!(
        memlock["fix"]
            .as_str()
            .expect("fix")
            .contains("ulimit -l unlimited"),
        "{memlock}"
    );
    assert!(code >= 1, "exit status {code}");
    assert_eq!(code, exit_status_of(&report));
}

#[test]
fn a_snapshot_with_rdma_rails_makes_low_locked_memory_a_problem_and_names_ports_down() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/topology/hicache-12nic.xml"
    );
    let (report, code) = doctor(&["--topology-xml", fixture, "--pool", "1MiB"]);
    assert_eq!(check(&report, "memlock")["status"], "problem", "{report}");
    assert_eq!(code, 2);
    let rdma = check(&report, "rdma");
    assert_eq!(rdma["status"], "warning", "{rdma}");
    let detail = rdma["detail"].as_str().expect("detail");
    assert!(detail.starts_with("12 device(s)"), "{detail}");
    assert!(detail.contains("mlx5_1/1 down"), "{detail}");
    let numa = check(&report, "numa")["detail"].as_str().expect("detail");
    assert!(numa.starts_with("2 NUMA node(s)"), "{numa}");
    assert!(
        numa.contains("node 1 has 32 PU(s) and NICs [mlx5_6"),
        "{numa}"
    );
    assert_eq!(check(&report, "cores")["status"], "ok");
    assert_eq!(report["host"], "hicache-12nic");

    // A snapshot that cannot be read fails the checks that need it, not the report.
    let (report, code) = doctor(&["--topology-xml", "/nonexistent.xml", "--pool", "32KiB"]);
    for name in ["rdma", "numa", "cores"] {
        assert_eq!(check(&report, name)["status"], "problem", "{report}");
    }
    assert_eq!(check(&report, "memlock")["status"], "ok", "{report}");
    assert_eq!(code, 2);
}

#[test]
fn a_secret_others_can_read_and_an_etcd_that_does_not_answer_are_problems() {
    let dir = std::env::temp_dir().join(format!("railyard-doctor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let secret = dir.join("secret");
    std::fs::File::create(&secret)
        .and_then(|mut file| file.write_all(b"0123456789abcdef0123456789abcdef\n"))
        .expect("written");
    let path = secret.to_str().expect("utf-8");

    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let (report, code) = doctor(&["--pool", "32KiB", "--secret-file", path]);
    let check_secret = check(&report, "secret");
    assert_eq!(check_secret["status"], "problem", "{check_secret}");
    assert_eq!(check_secret["fix"], format!("chmod 600 '{path}'"));
    assert_eq!(code, 2);

    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let (report, _) = doctor(&[
        "--pool",
        "32KiB",
        "--secret-file",
        path,
        "--directory",
        "etcd+tls://127.0.0.1:1?ca=/nonexistent",
    ]);
    assert_eq!(check(&report, "secret")["status"], "ok", "{report}");
    let etcd = check(&report, "etcd");
    assert_eq!(etcd["status"], "problem", "{etcd}");
    assert!(
        etcd["detail"]
            .as_str()
            .expect("detail")
            .contains("unreachable: [127.0.0.1:1]"),
        "{etcd}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
