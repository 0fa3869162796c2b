//! The judge of `railyard chaos hicache`: every call the client processes reported, replayed
//! against which incarnation of each segment process was alive and running when, and the
//! moments of the faults — what failed that a live replica could have served, how slow and
//! how fast the cluster was around each fault, and when it served again after its master's.

use std::time::Duration;

use super::report::{FaultMeasure, HicacheReport};
use super::workload::{Event, Holder};

/// own window lasts after the detection bound.
pub(super) const WINDOW: Duration = Duration::from_secs(4);

/// p99 bound, not by the throughput bound, until then.
pub(super) const DETECTION: Duration = Duration::from_millis(1500);

/// circuits and the master's suspicion of it take a moment to close again.
pub(super) const RESUME_MARGIN: Duration = Duration::from_secs(3);

/// violation of its own (`serve_again_ms`).
pub(super) const OUTAGE_CAP: u64 = 10_000;

/// One incarnation of a segment process, as the judge sees it.
#[derive(Clone, Debug)]
pub(super) struct Life {
    pub(super) addr: String,
    pub(super) incarnation: u64,
    pub(super) started: u64,
    pub(super) killed: Option<u64>,
    /// Stopped from, let go at.
    pub(super) stops: Vec<(u64, Option<u64>)>,
}

impl Life {
    /// Alive and running from `start` to `end`, and not recently let go.
    fn live_through(&self, start: u64, end: u64) -> bool {
        let margin = RESUME_MARGIN.as_millis() as u64;
        self.started <= start
            && self.killed.is_none_or(|killed| killed > end)
            && self.stops.iter().all(|&(stopped, resumed)| {
                stopped > end || resumed.is_some_and(|resumed| resumed + margin < start)
            })
    }
}

/// A fault's moment, for the judge.
pub(super) enum Moment {
    Segment {
        fault: &'static str,
        victim: String,
        at: u64,
        /// When the round's first fault began: its throughput before is the baseline of
        /// every fault of the round (the window before a later fault may still be
        /// recovering from an earlier one).
        round_began: u64,
    },
    MasterKill {
        at: u64,
    },
    MasterStop {
        from: u64,
        to: u64,
    },
}

/// Judges the clients' calls against the processes' lives and the faults' moments.
pub(super) fn judge(
    events: &[(String, Vec<Event>)],
    lives: &[Life],
    moments: &[Moment],
    report: &mut HicacheReport,
) {
    let live = |holders: &[Holder], start: u64, end: u64| {
        holders.iter().any(|holder| {
            lives.iter().any(|life| {
                life.addr == holder.addr
                    && life.incarnation == holder.incarnation
                    && life.live_through(start, end)
            })
        })
    };
    // Master outages: from a kill until a put and a get succeeded again, or a stop's span.
    let mut outages: Vec<(u64, u64)> = Vec::new();
    for moment in moments {
        match *moment {
            Moment::MasterKill { at } => {
                let back = serve_again(events, at);
                report.serve_again_ms.push(back.saturating_sub(at));
                outages.push((at, back.min(at + OUTAGE_CAP)));
            }
            Moment::MasterStop { from, to } => {
                let back = serve_again(events, from);
                report
                    .serve_again_after_stop_ms
                    .push(back.saturating_sub(from));
                outages.push((from, back.min(from + OUTAGE_CAP).max(to)));
            }
            Moment::Segment { .. } => {}
        }
    }
    let in_outage =
        |start: u64, end: u64| outages.iter().any(|&(from, to)| start <= to && end >= from);
    for (client, calls) in events {
        for event in calls {
            match event {
                Event::Put {
                    ok,
                    failed,
                    fewer,
                    errors,
                    ..
                } => {
                    report.puts_ok += u64::from(*ok);
                    report.puts_with_one_replica += u64::from(*fewer);
                    report.puts_failed += u64::from(*failed);
                    for kind in errors {
                        *report.put_errors.entry(kind.clone()).or_default() += 1;
                        if kind == "NotFound" || kind == "PutNotPending" {
                            report.puts_answered_not_found += 1;
                        }
                    }
                }
                Event::Get {
                    start,
                    end,
                    ok,
                    bytes,
                    wrong_bytes,
                    failures,
                } => {
                    report.gets_ok += u64::from(*ok);
                    report.gets_failed += failures.len() as u64;
                    report.bytes_checked += bytes;
                    report.wrong_bytes += wrong_bytes;
                    for failure in failures {
                        *report.get_errors.entry(failure.kind.clone()).or_default() += 1;
                        if !live(&failure.holders, *start, *end) {
                            report.gets_failed_holders_down += 1;
                            // Every holder gone: the typed answer, not a transfer failure.
                            if failure.kind != "NotFound" && !in_outage(*start, *end) {
                                report.holders_down_not_not_found += 1;
                            }
                            continue;
                        }
                        if in_outage(*start, *end) {
                            report.gets_failed_during_failover += 1;
                            continue;
                        }
                        report.gets_failed_with_live_replica += 1;
                        if report.first_wrong_failure.is_none() {
                            report.first_wrong_failure = Some(format!(
                                "{client}: {} at {start}..{end} ms: {}; holders {:?}",
                                failure.key, failure.error, failure.holders
                            ));
                        }
                    }
                }
                Event::Exists { start, end, absent } => {
                    report.exists_wrong_with_live_replica += absent
                        .iter()
                        .filter(|failure| {
                            live(&failure.holders, *start, *end) && !in_outage(*start, *end)
                        })
                        .count()
                        as u64;
                }
                Event::Done { remove_failed, .. } => {
                    report.removes_failed += remove_failed;
                    report.clients_done += 1;
                }
                Event::Ready { .. } | Event::Burst { .. } => {}
            }
        }
    }
    for moment in moments {
        let Moment::Segment {
            fault,
            victim,
            at,
            round_began,
        } = moment
        else {
            continue;
        };
        let at = *at;
        let window = WINDOW.as_millis() as u64;
        // A killed process resets its connections and a burst fails work at once; a stopped
        // one is noticed within the detection bound, and until then a call waiting on it is
        // bounded by the p99, not by throughput.
        let from = if *fault == "stop" {
            at + DETECTION.as_millis() as u64
        } else {
            at
        };
        let mut latencies: Vec<u64> = events
            .iter()
            .flat_map(|(_, calls)| calls)
            .filter_map(|event| match event {
                // In flight during the fault's window (one that started just before it and
                // waited on the victim counts).
                Event::Get { start, end, .. } if *end > at && *start < from + window => {
                    Some(end.saturating_sub(*start))
                }
                _ => None,
            })
            .collect();
        latencies.sort_unstable();
        let p99 = latencies
            .get(((latencies.len() as f64 - 1.0) * 0.99).round() as usize)
            .copied()
            .unwrap_or(0);
        let before = moved(events, round_began.saturating_sub(window), *round_began);
        let during = moved(events, from, from + window);
        report.faults.push(FaultMeasure {
            fault,
            victim: victim.clone(),
            p99_get_ms: p99,
            max_get_ms: latencies.last().copied().unwrap_or(0),
            gets: latencies.len() as u64,
            live_throughput_ratio: if before == 0 {
                0.0
            } else {
                during as f64 / before as f64
            },
        });
    }
    report.worst_p99_get_ms = report
        .faults
        .iter()
        .map(|f| f.p99_get_ms)
        .max()
        .unwrap_or(0);
    report.worst_live_throughput_ratio = report
        .faults
        .iter()
        .map(|f| f.live_throughput_ratio)
        .fold(f64::INFINITY, f64::min);
    if report.faults.is_empty() {
        report.worst_live_throughput_ratio = 0.0;
    }
}

/// Bytes written and read by calls that ended within `from..to`.
fn moved(events: &[(String, Vec<Event>)], from: u64, to: u64) -> u64 {
    events
        .iter()
        .flat_map(|(_, calls)| calls)
        .map(|event| match event {
            Event::Put { end, bytes, .. } | Event::Get { end, bytes, .. }
                if *end >= from && *end < to =>
            {
                *bytes
            }
            _ => 0,
        })
        .sum()
}

/// When every client had a put and a get that started at or after `at` succeed (the
/// later of them); `u64::MAX` if one never did.
fn serve_again(events: &[(String, Vec<Event>)], at: u64) -> u64 {
    events
        .iter()
        .map(|(_, calls)| {
            let first = |put: bool| {
                calls.iter().find_map(|event| match event {
                    Event::Put { start, end, ok, .. } if put && *start >= at && *ok > 0 => {
                        Some(*end)
                    }
                    Event::Get { start, end, ok, .. } if !put && *start >= at && *ok > 0 => {
                        Some(*end)
                    }
                    _ => None,
                })
            };
            first(true)
                .zip(first(false))
                .map_or(u64::MAX, |(put, get)| put.max(get))
        })
        .max()
        .unwrap_or(u64::MAX)
}
