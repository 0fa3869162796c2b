//! What a bench run reports: each shape's rate, latencies and time per stage beside its
//! ceiling, as a table for people, one JSON object (`--json`) or CSV rows (`--csv`), and
//! what its exit status depends on.

use std::time::Duration;

use serde_json::json;

use super::args::BenchArgs;
use super::ceiling::Ceiling;
use super::shapes::{Shape, Skipped};
use super::worker::ThreadResult;
use crate::cli::size::format_size;

/// What one shape measured, against its ceiling.
pub(super) struct ShapeResult {
    pub(super) shape: Shape,
    pub(super) threads: u64,
    /// Per-request (per-batch) latencies, sorted.
    latencies: Vec<Duration>,
    pub(super) requests: u64,
    pub(super) failed: u64,
    /// Bytes of requests done.
    pub(super) bytes: u64,
    pub(super) elapsed: Duration,
    /// Microseconds per request spent preparing, posting and waiting for completion.
    prepare_us: f64,
    post_us: f64,
    complete_us: f64,
    pub(super) ceiling: Ceiling,
    pub(super) verified: u64,
    pub(super) mismatches: u64,
}

impl ShapeResult {
    pub(super) fn new(
        shape: Shape,
        threads: u64,
        results: &[ThreadResult],
        bytes: u64,
        elapsed: Duration,
        ceiling: Ceiling,
    ) -> Self {
        let mut latencies: Vec<Duration> = results
            .iter()
            .flat_map(|r| r.latencies.iter().copied())
            .collect();
        latencies.sort_unstable();
        let requests: u64 = results.iter().map(|r| r.requests).sum();
        let per_request = |total: Duration| {
            if requests == 0 {
                0.0
            } else {
                micros(total) / requests as f64
            }
        };
        Self {
            shape,
            threads,
            latencies,
            requests,
            failed: results.iter().map(|r| r.failed_requests).sum(),
            bytes,
            elapsed,
            prepare_us: per_request(results.iter().map(|r| r.prepare).sum()),
            post_us: per_request(results.iter().map(|r| r.post).sum()),
            complete_us: per_request(results.iter().map(|r| r.complete).sum()),
            ceiling,
            verified: results.iter().map(|r| r.verified).sum(),
            mismatches: results.iter().map(|r| r.mismatches).sum(),
        }
    }

    pub(super) fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e9
    }

    fn requests_per_s(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    fn ratio(&self) -> f64 {
        self.gbps() / self.ceiling.gbps
    }

    /// The `p`-quantile of the per-batch latencies, in microseconds (tebench's
    /// convention: one batch, submitted to completed).
    pub(super) fn latency_us(&self, p: f64) -> f64 {
        micros(percentile(&self.latencies, p))
    }

    /// The `p`-quantile for a table, `-` when too few batches ran to tell it from the
    /// largest (fewer than 1 / (1 − p)).
    fn quantile_text(&self, p: f64) -> String {
        let needed = (1.0 / (1.0 - p)).round() as usize;
        if self.latencies.len() < needed.max(1) {
            "-".into()
        } else {
            format!("{:.1}", self.latency_us(p))
        }
    }

    fn average_us(&self) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        micros(self.latencies.iter().sum::<Duration>() / self.latencies.len() as u32)
    }

    /// nixlbench's convention: a batch's average latency divided among its descriptors.
    fn amortised_per_descriptor_us(&self) -> f64 {
        self.average_us() / self.shape.batch as f64
    }

    /// The shape's fields of a JSON report.
    pub(super) fn json(&self) -> serde_json::Map<String, serde_json::Value> {
        let value = json!({
            "op": self.shape.op_name(),
            "block_size": self.shape.block,
            "batch": self.shape.batch,
            "threads": self.threads,
            "request_bytes": self.shape.request_bytes(),
            "duration_s": round(self.elapsed.as_secs_f64(), 3),
            "requests": self.requests,
            "failed_requests": self.failed,
            "bytes": self.bytes,
            "gbps": round(self.gbps(), 3),
            "requests_per_s": round(self.requests_per_s(), 1),
            "latency_us": {
                "avg": self.average_us(),
                "p50": self.latency_us(0.5),
                "p99": self.latency_us(0.99),
                "p999": self.latency_us(0.999),
            },
            "amortised_us_per_descriptor": round(self.amortised_per_descriptor_us(), 3),
            "time_us": {
                "prepare": round(self.prepare_us, 1),
                "post": round(self.post_us, 1),
                "complete": round(self.complete_us, 1),
            },
            "ceiling": self.ceiling.what,
            "ceiling_gbps": round(self.ceiling.gbps, 3),
            "ratio": round(self.ratio(), 3),
            "check": { "verified_bytes": self.verified, "mismatches": self.mismatches },
        });
        value.as_object().cloned().unwrap_or_default()
    }
}

/// The engine and target a run measured.
pub(super) struct Setting {
    pub(super) target: String,
    pub(super) fabric: &'static str,
    pub(super) rails: usize,
    /// How the local buffers are backed.
    pub(super) backing: &'static str,
    /// How long each shape ran.
    pub(super) shape_duration: Duration,
    /// The control plane's counters of the engine that ran the shapes.
    pub(super) tcp_queue_pairs: u64,
    pub(super) reconnects: u64,
    pub(super) teardowns: u64,
}

impl Setting {
    fn json(&self) -> serde_json::Value {
        json!({
            "target": self.target,
            "fabric": self.fabric,
            "rails": self.rails,
            "local_memory": self.backing,
            // Which fabric reached the target: with `auto`, TCP only for a peer on another
            // host.
            "tcp_queue_pairs": self.tcp_queue_pairs,
            "reconnects": self.reconnects,
            "teardowns": self.teardowns,
        })
    }
}

/// What the exit status of a run with `--check` depends on.
pub(super) struct Verdict {
    /// Requests that failed.
    pub(super) failed: u64,
    /// Blocks that did not hold what was written.
    pub(super) mismatches: u64,
}

impl Verdict {
    pub(super) fn of(rows: &[ShapeResult]) -> Self {
        Self {
            failed: rows.iter().map(|row| row.failed).sum(),
            mismatches: rows.iter().map(|row| row.mismatches).sum(),
        }
    }
}

/// Prints the report of a one-shape run (one JSON object with `--json`).
pub(super) fn report_one(args: &BenchArgs, setting: &Setting, row: &ShapeResult) {
    if args.json {
        let mut report = row.json();
        if let serde_json::Value::Object(more) = setting.json() {
            report.extend(more);
        }
        report.insert(
            "check".into(),
            json!({
                "enabled": args.check,
                "verified_bytes": row.verified,
                "mismatches": row.mismatches,
            }),
        );
        println!("{}", serde_json::Value::Object(report));
        return;
    }
    if args.csv {
        print_csv(std::slice::from_ref(row));
        return;
    }
    println!(
        "{:>10} {:>6} {:>9} {:>11} {:>10} {:>10} {:>10} {:>10}   {:>8} {:>8} {:>9}",
        "block",
        "batch",
        "GB/s",
        "requests/s",
        "avg us",
        "p50 us",
        "p99 us",
        "p999 us",
        "prepare",
        "post",
        "complete"
    );
    println!(
        "{:>10} {:>6} {:>9.2} {:>11.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}   {:>8.1} {:>8.1} {:>9.1}",
        format_size(row.shape.block),
        row.shape.batch,
        row.gbps(),
        row.requests_per_s(),
        row.average_us(),
        row.latency_us(0.5),
        row.latency_us(0.99),
        row.latency_us(0.999),
        row.prepare_us,
        row.post_us,
        row.complete_us
    );
    println!(
        "ceiling ({}): {:.2} GB/s; ratio {:.2}",
        row.ceiling.what,
        row.ceiling.gbps,
        row.ratio()
    );
    println!(
        "{} requests ({} of {} each), {} thread(s), {} rail(s), local memory: {}",
        row.requests,
        if row.shape.op_name() == "write" {
            "writes"
        } else {
            "reads"
        },
        format_size(row.shape.request_bytes()),
        row.threads,
        setting.rails,
        setting.backing
    );
    if args.check {
        println!(
            "check: {} verified, {} mismatching block(s)",
            format_size(row.verified),
            row.mismatches
        );
    }
    if row.failed > 0 {
        println!("{} request(s) failed", row.failed);
    }
}

/// Where and when a sweep ran: the plot's caption and the JSON report's header.
pub(super) struct Occasion {
    pub(super) host: String,
    /// RFC 3339, UTC, to the second.
    pub(super) date: String,
}

impl Occasion {
    pub(super) fn now() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|name| name.trim().to_string())
            .unwrap_or_else(|_| "this host".into());
        Self {
            host,
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        }
    }
}

/// Prints a sweep's report: a table, one JSON object with a row per shape, or CSV.
pub(super) fn report_sweep(
    args: &BenchArgs,
    setting: &Setting,
    occasion: &Occasion,
    rows: &[ShapeResult],
    skipped: &[Skipped],
) {
    let skipped_json: Vec<serde_json::Value> = skipped
        .iter()
        .map(|s| {
            json!({
                "op": s.shape.op_name(),
                "block_size": s.shape.block,
                "batch": s.shape.batch,
                "why": s.why,
            })
        })
        .collect();
    if args.json {
        let shapes: Vec<serde_json::Value> = rows
            .iter()
            .map(|row| serde_json::Value::Object(row.json()))
            .collect();
        let mut report = json!({
            "host": occasion.host,
            "date": occasion.date,
            "threads": args.threads,
            "check": args.check,
            "shapes": shapes,
            "skipped": skipped_json,
        });
        if let (Some(report), serde_json::Value::Object(more)) =
            (report.as_object_mut(), setting.json())
        {
            report.extend(more);
        }
        println!("{report}");
        return;
    }
    if args.csv {
        print_csv(rows);
        return;
    }
    println!(
        "{:>5} {:>8} {:>5} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9}   {:>7} {:>7} {:>8}   {:>9} {:>5}",
        "op",
        "block",
        "batch",
        "GB/s",
        "requests/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "us/desc",
        "prepare",
        "post",
        "complete",
        "ceiling",
        "ratio"
    );
    for row in rows {
        println!(
            "{:>5} {:>8} {:>5} {:>9.2} {:>11.1} {:>9} {:>9} {:>9} {:>9.2}   {:>7.1} {:>7.1} {:>8.1}   {:>9.2} {:>5.3}",
            row.shape.op_name(),
            format_size(row.shape.block),
            row.shape.batch,
            row.gbps(),
            row.requests_per_s(),
            row.quantile_text(0.5),
            row.quantile_text(0.99),
            row.quantile_text(0.999),
            row.amortised_per_descriptor_us(),
            row.prepare_us,
            row.post_us,
            row.complete_us,
            row.ceiling.gbps,
            row.ratio()
        );
    }
    for skip in skipped {
        println!(
            "{:>5} {:>8} {:>5}   skipped: {}",
            skip.shape.op_name(),
            format_size(skip.shape.block),
            skip.shape.batch,
            skip.why
        );
    }
    println!(
        "latencies are per batch, submitted to completed (tebench's convention; - where too \
         few batches ran to tell p99 or p999 from the largest); us/desc is a batch's average \
         divided by its blocks (nixlbench's amortised convention); prepare, post and complete \
         are microseconds per batch"
    );
    if let Some(first) = rows.first() {
        println!(
            "ceiling: GB/s of the same shape measured in this run; the first row's is {}",
            first.ceiling.what
        );
    }
    println!(
        "{} fabric, {} rail(s), {} thread(s), {:.1} s per shape; local memory: {}; {}, {}",
        setting.fabric,
        setting.rails,
        args.threads,
        setting.shape_duration.as_secs_f64(),
        setting.backing,
        occasion.host,
        occasion.date
    );
    let verdict = Verdict::of(rows);
    if args.check {
        let verified: u64 = rows.iter().map(|row| row.verified).sum();
        println!(
            "check: {} verified, {} mismatching block(s)",
            format_size(verified),
            verdict.mismatches
        );
    }
    if verdict.failed > 0 {
        println!("{} request(s) failed", verdict.failed);
    }
}

/// The CSV header and one row per shape.
fn print_csv(rows: &[ShapeResult]) {
    println!(
        "op,block_size,batch,threads,gbps,requests_per_s,p50_us,p99_us,p999_us,\
         amortised_us_per_descriptor,prepare_us,post_us,complete_us,ceiling_gbps,ratio,\
         requests,failed_requests"
    );
    for row in rows {
        println!(
            "{},{},{},{},{:.3},{:.1},{:.1},{:.1},{:.1},{:.3},{:.1},{:.1},{:.1},{:.3},{:.3},{},{}",
            row.shape.op_name(),
            row.shape.block,
            row.shape.batch,
            row.threads,
            row.gbps(),
            row.requests_per_s(),
            row.latency_us(0.5),
            row.latency_us(0.99),
            row.latency_us(0.999),
            row.amortised_per_descriptor_us(),
            row.prepare_us,
            row.post_us,
            row.complete_us,
            row.ceiling.gbps,
            row.ratio(),
            row.requests,
            row.failed
        );
    }
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

pub(super) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

pub(super) fn micros(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e7).round() / 10.0
}
