//! The README's command lines are real: every `railyard …` line of its ```sh blocks parses
//! with the real binary (clap checks the subcommand, each flag and each value, then the
//! `--help` added at the end prints the usage instead of running it), and the cheap ones,
//! `doctor` and `topology`, run as written.

use std::process::Command;
use std::time::Duration;

mod common;

/// How long one run of the binary may take.
const BOUND: Duration = Duration::from_secs(60);

/// Subcommands cheap enough to run as written: they only look at this host.
const RUN_AS_WRITTEN: [&str; 2] = ["doctor", "topology"];

/// The words after `railyard` on each `railyard` line of the README's ```sh blocks, without
/// the comment that ends a line.
fn readme_command_lines() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("the README");
    let mut lines = Vec::new();
    let mut block: Option<&str> = None;
    for line in readme.lines() {
        if let Some(language) = line.strip_prefix("```") {
            block = if block.is_some() {
                None
            } else {
                Some(language)
            };
            continue;
        }
        if block != Some("sh") {
            continue;
        }
        let command = line.split_once(" #").map_or(line, |(command, _)| command);
        let Some(args) = command.trim().strip_prefix("railyard ") else {
            continue;
        };
        assert!(
            !args.contains(['|', ';', '&', '<', '>', '$', '"', '\'', '\\']),
            "a README command line is plain words, as this test splits them: {line}"
        );
        lines.push(args.split_whitespace().map(str::to_owned).collect());
    }
    lines
}

fn railyard(args: &[String]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_railyard"));
    command
        .args(args)
        .env_remove("RAILYARD_SECRET_FILE")
        .env_remove("RAILYARD_ENCRYPT_CONTROL")
        .env_remove("RAILYARD_NICS");
    command
}

#[test]
fn every_readme_command_line_parses() {
    let lines = readme_command_lines();
    assert!(lines.len() >= 3, "the README's CLI lines: {lines:?}");
    for args in &lines {
        let output = common::output_within(railyard(args).arg("--help"), BOUND);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains(&format!("Usage: railyard {}", args[0])),
            "`railyard {}` does not parse: {stdout}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn the_readme_doctor_and_topology_lines_run_as_written() {
    let cheap: Vec<Vec<String>> = readme_command_lines()
        .into_iter()
        .filter(|args| RUN_AS_WRITTEN.contains(&args[0].as_str()))
        .collect();
    assert!(
        !cheap.is_empty(),
        "the README runs none of {RUN_AS_WRITTEN:?}"
    );
    for args in &cheap {
        let output = common::output_within(&mut railyard(args), BOUND);
        let stdout = String::from_utf8_lossy(&output.stdout);
        // doctor: 0 all OK, 1 warnings, 2 problems; each is an answer. topology: 0.
        let answered = match args[0].as_str() {
            "doctor" => matches!(output.status.code(), Some(0..=2)) && stdout.contains("memlock"),
            _ => output.status.success() && stdout.contains("rails"),
        };
        assert!(
            answered,
            "`railyard {}` ({}): {stdout}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
