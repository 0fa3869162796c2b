//! `railyard bench --sweep` and `--latency` as a user runs them, on small sizes and short
//! durations: the shapes of the table, the JSON, the CSV and the SVG, not the speed.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::output_within;

/// Longest one bench of these tests may take (they take a few seconds).
const BOUND: Duration = Duration::from_secs(120);

fn bench(args: &[&str]) -> Output {
    let output = output_within(
        Command::new(env!("CARGO_BIN_EXE_railyard"))
            .arg("bench")
            .args(["--rails", "1", "--duration", "0.1"])
            .args(args),
        BOUND,
    );
    assert!(
        output.status.success(),
        "bench {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

const BLOCKS: [u64; 3] = [4096, 16384, 65536];
const BATCHES: [u64; 2] = [1, 4];

fn sweep(extra: &[&str]) -> Output {
    let mut args = vec![
        "--sweep",
        "--fabric",
        "soft",
        // Out of order and once twice: a sweep runs them smallest first, each once.
        "--block-sizes",
        "64KiB,4KiB,16KiB,4KiB",
        "--batch-sizes",
        "4,1",
    ];
    args.extend_from_slice(extra);
    bench(&args)
}

#[test]
fn a_sweep_reports_every_shape_beside_its_ceiling_as_json_and_draws_it() {
    let dir = std::env::temp_dir().join(format!("railyard-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let svg_path = dir.join("sweep.svg");
    let svg_arg = svg_path.to_str().expect("a UTF-8 path");
    let output = sweep(&["--json", "--plot", svg_arg]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one object");
    assert_eq!(report["fabric"], "soft");
    assert!(report["host"].as_str().is_some_and(|h| !h.is_empty()));
    assert!(report["date"].as_str().is_some_and(|d| d.starts_with("20")));
    let shapes = report["shapes"].as_array().expect("a row per shape");
    assert_eq!(shapes.len(), BLOCKS.len() * BATCHES.len());
    // In order: by batch, then block.
    for (row, (batch, block)) in shapes.iter().zip(
        BATCHES
            .iter()
            .flat_map(|batch| BLOCKS.iter().map(move |block| (batch, block))),
    ) {
        assert_eq!(row["op"], "write");
        assert_eq!(row["batch"], *batch, "{row}");
        assert_eq!(row["block_size"], *block, "{row}");
        assert_eq!(row["failed_requests"], 0, "{row}");
        assert!(row["requests"].as_u64() > Some(0), "{row}");
        assert!(row["gbps"].as_f64() > Some(0.0), "{row}");
        assert!(row["ceiling_gbps"].as_f64() > Some(0.0), "{row}");
        let ratio =
            row["gbps"].as_f64().unwrap_or(0.0) / row["ceiling_gbps"].as_f64().unwrap_or(1.0);
        assert!(
            (row["ratio"].as_f64().unwrap_or(-1.0) - ratio).abs() < 0.01,
            "the ratio is GB/s over the ceiling: {row}"
        );
        let latency = &row["latency_us"];
        let (p50, p99, p999) = (
            latency["p50"].as_f64().unwrap_or(-1.0),
            latency["p99"].as_f64().unwrap_or(-1.0),
            latency["p999"].as_f64().unwrap_or(-1.0),
        );
        assert!(0.0 < p50 && p50 <= p99 && p99 <= p999, "{row}");
        assert!(
            row["amortised_us_per_descriptor"].as_f64() > Some(0.0),
            "{row}"
        );
        for stage in ["prepare", "post", "complete"] {
            assert!(row["time_us"][stage].as_f64().is_some(), "{stage}: {row}");
        }
    }

    // The picture: each measured line in both panels, and the ceiling in the first, with one
    // point per block size; the names in the legends; units on the axes.
    let svg = std::fs::read_to_string(&svg_path).expect("the SVG was written");
    let polylines: Vec<(Vec<(f64, f64)>, &str)> = svg
        .match_indices("<polyline")
        .filter_map(|(at, _)| {
            let element = &svg[at..];
            let element = &element[..element.find("/>").unwrap_or(element.len())];
            let start = element.find("points=\"")? + 8;
            let list = &element[start..];
            let list = &list[..list.find('"')?];
            let points = list
                .split_whitespace()
                .filter_map(|pair| {
                    let (x, y) = pair.split_once(',')?;
                    Some((x.parse().ok()?, y.parse().ok()?))
                })
                .collect();
            Some((points, element))
        })
        .collect();
    // A line per batch size in each panel and the ceiling: one point per block size, left to
    // right. (The legend's samples are lines of two points.)
    let lines: Vec<&(Vec<(f64, f64)>, &str)> = polylines
        .iter()
        .filter(|(points, _)| points.len() == BLOCKS.len())
        .collect();
    assert_eq!(
        lines.len(),
        BATCHES.len() * 2 + 1,
        "two panels of {} lines, and the ceiling",
        BATCHES.len()
    );
    for (points, element) in &lines {
        assert!(
            points.windows(2).all(|pair| pair[0].0 < pair[1].0),
            "a line that doubles back: {element}"
        );
    }
    let width: f64 = 1400.0;
    let ceilings: Vec<_> = lines
        .iter()
        .filter(|(_, element)| element.contains("stroke-width=\"3\""))
        .collect();
    assert_eq!(ceilings.len(), 1, "one ceiling line");
    assert!(
        ceilings[0].0.iter().all(|(x, _)| *x < width / 2.0),
        "the ceiling is drawn in the bandwidth panel"
    );
    let in_right_panel = lines
        .iter()
        .filter(|(points, _)| points.iter().all(|(x, _)| *x > width / 2.0))
        .count();
    assert_eq!(in_right_panel, BATCHES.len(), "the latency panel's lines");
    for text in [
        "write, batch 1",
        "write, batch 4",
        "ceiling (same run)",
        "bandwidth (GB/s)",
        "p99 latency per batch (µs, log scale)",
        "block size (bytes, log scale)",
        "soft fabric on",
        "4 KiB",
        "64 KiB",
    ] {
        assert!(svg.contains(text), "the SVG lacks {text:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sweep_prints_csv_and_a_table_that_names_what_it_skipped() {
    let output = sweep(&["--csv"]);
    let csv = String::from_utf8_lossy(&output.stdout);
    let rows: Vec<Vec<&str>> = csv.lines().map(|line| line.split(',').collect()).collect();
    assert_eq!(rows.len(), 1 + BLOCKS.len() * BATCHES.len(), "{csv}");
    let header = &rows[0];
    for column in [
        "op",
        "block_size",
        "batch",
        "gbps",
        "p50_us",
        "p99_us",
        "p999_us",
    ] {
        assert!(header.contains(&column), "{column} missing: {csv}");
    }
    for row in &rows[1..] {
        assert_eq!(row.len(), header.len(), "{csv}");
    }

    // A pool of 128 KiB holds two 64 KiB blocks: not a batch of 4.
    let output = sweep(&["--pool", "128KiB"]);
    let table = String::from_utf8_lossy(&output.stdout);
    let measured = table
        .lines()
        .filter(|line| line.trim_start().starts_with("write") && !line.contains("skipped"))
        .count();
    assert_eq!(measured, BLOCKS.len() * BATCHES.len() - 1, "{table}");
    assert!(
        table.lines().any(|line| line.contains("64 KiB")
            && line.contains("skipped")
            && line.contains("--pool")),
        "{table}"
    );
    assert!(table.contains("ceiling"), "{table}");
}

#[test]
fn flags_that_do_not_go_together_are_refused_with_a_reason() {
    for args in [
        &["bench", "--block-sizes", "4KiB"][..],
        &["bench", "--sweep", "--block-sizes", "0"],
        &["bench", "--sweep", "--batch-sizes", "0"],
        &["bench", "--latency", "--round-trips", "0"],
        &["bench", "--plot", "x.svg"],
    ] {
        let output = output_within(
            Command::new(env!("CARGO_BIN_EXE_railyard")).args(args),
            BOUND,
        );
        assert!(!output.status.success(), "{args:?} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            !stderr.trim().is_empty(),
            "{args:?} failed without a reason"
        );
    }
}

/// `--latency --json` on `fabric`: a row per size, p50 ≤ p99 ≤ p999, beside the ceiling.
fn latency_on(fabric: &str) {
    let output = bench(&[
        "--latency",
        "--fabric",
        fabric,
        "--block-sizes",
        "4KiB,64KiB",
        "--round-trips",
        "300",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one object");
    assert_eq!(report["fabric"], fabric);
    assert_eq!(report["unit"], "us");
    assert!(report["ceiling"].as_str().is_some(), "{report}");
    let sizes = report["sizes"].as_array().expect("a row per size");
    assert_eq!(sizes.len(), 2, "{report}");
    for (row, size) in sizes.iter().zip([4096, 65536]) {
        assert_eq!(row["size"], size, "{row}");
        assert!(row["round_trips"].as_u64() >= Some(300), "{row}");
        for side in [row, &row["ceiling"]] {
            let (p50, p99, p999) = (
                side["p50"].as_f64().unwrap_or(-1.0),
                side["p99"].as_f64().unwrap_or(-1.0),
                side["p999"].as_f64().unwrap_or(-1.0),
            );
            assert!(0.0 < p50 && p50 <= p99 && p99 <= p999, "{side}");
        }
        assert!(row["p50_over_ceiling"].as_f64() > Some(0.0), "{row}");
    }
}

#[test]
fn latency_round_trips_on_the_soft_fabric_beside_shared_memory() {
    latency_on("soft");
}

#[test]
fn latency_round_trips_on_the_tcp_fabric_beside_a_socket() {
    latency_on("tcp");
}

#[test]
fn reads_checked_by_several_threads_see_the_pattern_written_for_every_slot() {
    // Each thread once compared what it read with a pattern of its own seed, while the pool
    // was written with the run's: every thread but the first saw mismatches.
    let output = bench(&[
        "--op",
        "read",
        "--check",
        "--threads",
        "2",
        "--batch",
        "4",
        "--pool",
        "8MiB",
        "--fabric",
        "soft",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one object");
    assert_eq!(report["check"]["mismatches"], 0, "{report}");
    assert!(
        report["check"]["verified_bytes"].as_u64() > Some(0),
        "{report}"
    );
}
