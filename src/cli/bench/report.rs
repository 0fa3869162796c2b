//! What a bench run reports: its rate, latencies and time per stage beside the ceiling, as a
//! table for people or one JSON object (`--json`), and what its exit status depends on.

use std::time::Duration;

use railyard::engine::{Engine, Op, Region};

use super::args::BenchArgs;
use super::ceiling::Ceiling;
use super::worker::ThreadResult;
use crate::cli::size::format_size;

/// What a timed run gave: its threads' results and the bytes they moved.
pub(super) struct Run<'a> {
    /// The engine that ran it (its fabric, rails and counters are reported).
    pub(super) engine: &'a Engine,
    /// The target, as it was opened.
    pub(super) target: &'a str,
    /// Direction of the transfers.
    pub(super) op: Op,
    /// The local buffers (their backing is reported).
    pub(super) local: Region,
    /// What each thread measured.
    pub(super) results: &'a [ThreadResult],
    /// Bytes of requests done.
    pub(super) bytes: u64,
    /// How long the threads ran.
    pub(super) elapsed: Duration,
    /// What the rate is compared with.
    pub(super) ceiling: &'a Ceiling,
}

/// What the exit status of a run with `--check` depends on.
pub(super) struct Verdict {
    /// Requests that failed.
    pub(super) failed: u64,
    /// Blocks that did not hold what was written.
    pub(super) mismatches: u64,
}

/// Prints the report of `run` (one JSON object with `--json`).
pub(super) fn report(args: &BenchArgs, run: &Run<'_>) -> Verdict {
    let Run {
        engine,
        target,
        op,
        local,
        results,
        bytes,
        elapsed,
        ceiling,
    } = *run;
    let request_bytes = args.block_size * args.batch;
    let mut latencies: Vec<Duration> = results
        .iter()
        .flat_map(|r| r.latencies.iter().copied())
        .collect();
    latencies.sort();
    let requests: u64 = results.iter().map(|r| r.requests).sum();
    let failed: u64 = results.iter().map(|r| r.failed_requests).sum();
    let gbps = bytes as f64 / elapsed.as_secs_f64() / 1e9;
    let per_request = |total: Duration| {
        if requests == 0 {
            0.0
        } else {
            micros(total) / requests as f64
        }
    };
    let prepare = per_request(results.iter().map(|r| r.prepare).sum());
    let post = per_request(results.iter().map(|r| r.post).sum());
    let complete = per_request(results.iter().map(|r| r.complete).sum());
    let avg = if latencies.is_empty() {
        Duration::ZERO
    } else {
        latencies.iter().sum::<Duration>() / latencies.len() as u32
    };
    // Which fabric reached the target: with `auto`, TCP only for a peer on another host.
    let tcp_queue_pairs = engine.stats().control.tcp_qps;
    let verified: u64 = results.iter().map(|r| r.verified).sum();
    let mismatches: u64 = results.iter().map(|r| r.mismatches).sum();
    let backing = local.backing.map_or("user memory", |b| b.describe());
    let report = serde_json::json!({
        "op": match op { Op::Write => "write", Op::Read => "read" },
        "target": target,
        "fabric": engine.fabric(),
        "rails": engine.rails(),
        "threads": args.threads,
        "block_size": args.block_size,
        "batch": args.batch,
        "request_bytes": request_bytes,
        "duration_s": (elapsed.as_secs_f64() * 1000.0).round() / 1000.0,
        "requests": requests,
        "failed_requests": failed,
        "bytes": bytes,
        "gbps": (gbps * 1000.0).round() / 1000.0,
        "requests_per_s": (requests as f64 / elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "latency_us": {
            "avg": micros(avg),
            "p50": micros(percentile(&latencies, 0.5)),
            "p99": micros(percentile(&latencies, 0.99)),
        },
        "time_us": {
            "prepare": (prepare * 10.0).round() / 10.0,
            "post": (post * 10.0).round() / 10.0,
            "complete": (complete * 10.0).round() / 10.0,
        },
        "ceiling": ceiling.what,
        "ceiling_gbps": (ceiling.gbps * 1000.0).round() / 1000.0,
        "ratio": ((gbps / ceiling.gbps) * 1000.0).round() / 1000.0,
        "local_memory": backing,
        "tcp_queue_pairs": tcp_queue_pairs,
        "reconnects": engine.stats().control.reconnects,
        "teardowns": engine.stats().control.teardowns,
        "check": { "enabled": args.check, "verified_bytes": verified, "mismatches": mismatches },
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{:>10} {:>6} {:>9} {:>11} {:>10} {:>10} {:>10}   {:>8} {:>8} {:>9}",
            "block",
            "batch",
            "GB/s",
            "requests/s",
            "avg us",
            "p50 us",
            "p99 us",
            "prepare",
            "post",
            "complete"
        );
        println!(
            "{:>10} {:>6} {:>9.2} {:>11.1} {:>10.1} {:>10.1} {:>10.1}   {:>8.1} {:>8.1} {:>9.1}",
            format_size(args.block_size),
            args.batch,
            gbps,
            requests as f64 / elapsed.as_secs_f64(),
            micros(avg),
            micros(percentile(&latencies, 0.5)),
            micros(percentile(&latencies, 0.99)),
            prepare,
            post,
            complete
        );
        println!(
            "ceiling ({}): {:.2} GB/s; ratio {:.2}",
            ceiling.what,
            ceiling.gbps,
            gbps / ceiling.gbps
        );
        println!(
            "{} requests ({} of {} each), {} thread(s), {} rail(s), local memory: {backing}",
            requests,
            if op == Op::Write { "writes" } else { "reads" },
            format_size(request_bytes),
            args.threads,
            engine.rails()
        );
        if args.check {
            println!(
                "check: {} verified, {mismatches} mismatching block(s)",
                format_size(verified)
            );
        }
        if failed > 0 {
            println!("{failed} request(s) failed");
        }
    }
    Verdict { failed, mismatches }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn micros(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e7).round() / 10.0
}
