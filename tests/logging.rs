//! The CLI's log events go through `tracing` to stderr: `--log-format json` gives one JSON
//! object per line with the event's fields, `--log` filters (a level or `RUST_LOG`
//! directives), the default shows warnings only, and a filter that does not parse is a
//! one-line error.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BOUND: Duration = Duration::from_secs(30);

/// Runs `railyard serve` with `log_args` until it has printed its first line, then closes
/// its stdin: that first line and every stderr line.
fn serve_with(log_args: &[&str]) -> (String, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--pool",
            "4MiB",
            "--rails",
            "1",
        ])
        .arg("--until-stdin-closes")
        .args(log_args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    // Read to the end, so that serve never writes into a closed pipe.
    let stdout = child.stdout.take().expect("piped");
    let (first_line, first) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = first_line.send(line);
        }
        lines.for_each(drop);
    });
    let first = first.recv_timeout(BOUND).expect("a first line");
    drop(child.stdin.take());
    let end = Instant::now() + BOUND;
    while child.try_wait().expect("waitable").is_none() {
        assert!(
            Instant::now() < end,
            "serve did not stop when its stdin closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = errors
        .join()
        .expect("the reader")
        .lines()
        .map(str::to_string)
        .collect();
    (first, lines)
}

#[test]
fn json_log_lines_carry_the_events_fields() {
    let (first, lines) = serve_with(&["--log", "info", "--log-format", "json"]);
    let addr = first.split_whitespace().nth(1).expect("listening ADDR ...");
    let events: Vec<serde_json::Value> = lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect();
    let serving = events
        .iter()
        .find(|event| event["fields"]["message"] == "serving")
        .unwrap_or_else(|| panic!("no serving event in {lines:?}"));
    assert_eq!(serving["level"], "INFO");
    assert_eq!(serving["target"], "railyard::serve");
    assert_eq!(serving["fields"]["addr"], addr);
    assert_eq!(serving["fields"]["pool_bytes"], 4 << 20);
    assert!(serving["fields"]["incarnation"].is_string());
    assert!(serving["fields"]["engine"].is_string());
    assert!(serving["timestamp"].is_string());
}

#[test]
fn the_default_shows_warnings_only_and_a_bad_filter_is_one_line() {
    let (_, lines) = serve_with(&[]);
    assert!(
        lines.iter().all(|line| !line.contains("INFO")),
        "info events at the default level: {lines:?}"
    );
    let (_, lines) = serve_with(&["--log", "railyard::serve=info"]);
    assert!(
        lines
            .iter()
            .any(|line| line.contains("INFO") && line.contains("serving")),
        "{lines:?}"
    );

    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "serve",
            "--log",
            "nonsense[[",
            "--pool",
            "4MiB",
            "--until-stdin-closes",
        ])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("railyard: error: --log"), "{stderr}");
}
