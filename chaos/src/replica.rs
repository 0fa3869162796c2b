//! `dead-replica`: one dead peer must not degrade the others, must fail fast — whether it
//! dies with a reset or just stops answering — and a new process on its port must never
//! receive what was meant for the dead one.
//!
//! Four `railyard serve` target processes; an initiator engine in this process writes to
//! each from a submitter thread of its own (batches of four 64 KiB writes from a
//! pattern-filled source, the default 5 s deadline).
//! - Phase 1: target 3 is killed (SIGKILL: its sockets reset). Requests to it must fail
//!   within the deadline, the batches in flight at the kill must all resolve, and the three
//!   live peers keep at least 80 % of their throughput. A newcomer under *another* name
//!   takes its port.
//! - Phase 2: target 2 is stopped (SIGSTOP: no reset, its memory still writable — only
//!   liveness can tell). Its requests must fail fast (`PeerUnavailable`) within 2.5 s. Then
//!   it is killed and a newcomer under the *same* name takes its port.
//!
//! Each newcomer is opened by the initiator as soon as it listens, while the submitter of
//! its predecessor keeps going: the predecessor's peer must be retired, not carried on into
//! the newcomer. Targets run without address-space randomisation, so a newcomer's pool sits
//! where its predecessor's was: a write still meant for the predecessor would land once a
//! descriptor refresh handed out the newcomer's keys. At the end each newcomer's memory is read through a fresh peer:
//! nothing is written to a newcomer on purpose, so any non-zero byte there was meant for its
//! predecessor.
//! Elsewhere every client kept sending to the dead endpoint, transfers hung for 60 s, and a
//! process that reused the port was taken for the dead one.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use railyard_engine::dataplane::{DEFAULT_DEADLINE, FailReason, IdleStrategy, RequestOutcome};
use railyard_engine::{Engine, Op, Peer, RailChoice, Region, Transfer};
use serde::Serialize;

use super::fabric::ChaosFabric;
use super::harness::{BOUND, any_port, read_through_fresh_peer, region_bytes};
use super::pattern::fill_pattern;
use super::process::Target;

/// What happened.
#[derive(Debug, Serialize)]
pub struct ReplicaReport {
    /// The seed.
    pub seed: u64,
    /// The fabric (`soft` or `ofi`).
    pub fabric: &'static str,
    /// Bytes per second to the three live peers in the window after the killed process was
    /// reaped over the window before the kill.
    pub live_throughput_ratio: f64,
    /// The lowest of the three live peers' own ratios.
    pub min_live_peer_ratio: f64,
    /// Longest a request to the killed peer took to resolve after the kill, in ms.
    pub dead_peer_max_fail_ms: u64,
    /// The batch deadline, in ms.
    pub deadline_ms: u64,
    /// Requests to the killed peer that failed with `PeerUnavailable`.
    pub dead_peer_unavailable: u64,
    /// Requests to the killed peer that failed with `PeerRestarted`.
    pub dead_peer_restarted: u64,
    /// Requests to the killed peer that failed otherwise.
    pub dead_peer_other_failures: u64,
    /// Batches in flight (submitted, unresolved) when target 3 was killed.
    pub in_flight_at_kill: u64,
    /// Batches in flight when target 2 was stopped.
    pub in_flight_at_stop: u64,
    /// Of those, the ones that resolved a second or more after the stop: stuck at the
    /// stopped target (none on the soft fabric, whose writes land in a stopped process).
    pub stuck_at_stop: u64,
    /// Of those, the ones that resolved later than their deadline plus [`IN_FLIGHT_SLACK`].
    pub in_flight_late: u64,
    /// From SIGSTOP of target 2 to its first request failing fast, in ms (0: never).
    pub stopped_peer_detection_ms: u64,
    /// Whether the initiator retired the killed and the stopped targets' peers once it
    /// reached their newcomers (it told each newcomer from its predecessor, whose handle
    /// kept submitting all along).
    pub predecessors_retired: bool,
    /// Whether the initiator could open both newcomers.
    pub newcomers_reached: bool,
    /// Whether each newcomer's pool sits where its predecessor's did: then a write still
    /// meant for the predecessor lands there once a descriptor refresh hands out the
    /// newcomer's keys (keys differ between processes), and `misdirected` shows it.
    pub same_layout: bool,
    /// Probe writes to the stopped target (made after the stop) that did not resolve by
    /// their deadline plus [`IN_FLIGHT_SLACK`] (checked at the end of the run).
    pub probes_late: u64,
    /// Non-zero bytes found in the newcomers' memory: meant for their predecessors.
    pub misdirected: u64,
    /// Whether the newcomers' memory could be read (through a fresh peer each).
    pub newcomers_checked: bool,
    /// Circuits the initiator opened.
    pub circuit_openings: u64,
}

impl ReplicaReport {
    /// Broken promises, empty when the run held.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        if self.live_throughput_ratio < 0.8 {
            broken.push(format!(
                "live_throughput_ratio = {:.2} (must be ≥ 0.8)",
                self.live_throughput_ratio
            ));
        }
        if self.dead_peer_max_fail_ms > self.deadline_ms {
            broken.push(format!(
                "dead_peer_max_fail_ms = {} (deadline {})",
                self.dead_peer_max_fail_ms, self.deadline_ms
            ));
        }
        if self.dead_peer_unavailable + self.dead_peer_restarted == 0 {
            broken.push("no request to the dead peer failed fast".into());
        }
        if self.in_flight_late > 0 {
            broken.push(format!(
                "{} batch(es) in flight at a failure resolved past their deadline + {IN_FLIGHT_SLACK:?}",
                self.in_flight_late
            ));
        }
        if self.in_flight_at_kill == 0 {
            broken.push("no batch was in flight at the kill: nothing was checked".into());
        }
        if self.in_flight_at_stop == 0 {
            broken.push("no batch was in flight at the stop: nothing was checked".into());
        }
        if self.probes_late > 0 {
            broken.push(format!(
                "{} probe write(s) to the stopped target resolved past their deadline + \
                 {IN_FLIGHT_SLACK:?}",
                self.probes_late
            ));
        }
        if !self.same_layout {
            broken.push(
                "a newcomer's pool is not where its predecessor's was: misdirection could not show"
                    .into(),
            );
        }
        if self.stopped_peer_detection_ms == 0
            || self.stopped_peer_detection_ms > DETECTION_BOUND.as_millis() as u64
        {
            broken.push(format!(
                "the stopped peer failed fast after {} ms (bound {DETECTION_BOUND:?}; 0: never)",
                self.stopped_peer_detection_ms
            ));
        }
        if !self.predecessors_retired {
            broken.push("a newcomer was taken for the dead process".into());
        }
        if !self.newcomers_reached {
            broken.push("a newcomer could not be opened".into());
        }
        if !self.newcomers_checked {
            broken.push("the newcomers' memory could not be read".into());
        }
        if self.misdirected != 0 {
            broken.push(format!("misdirected = {} (must be 0)", self.misdirected));
        }
        broken
    }
}

const PEERS: usize = 4;
/// Killed in phase 1.
const KILLED: usize = 3;
/// Stopped in phase 2.
const STOPPED: usize = 2;
const BLOCK: u64 = 64 * 1024;
const BLOCKS_PER_BATCH: u64 = 4;
/// How long the live peers' throughput is measured before the kill and after it: long
/// enough that one scheduling hiccup on a 2-core machine is not read as a degradation.
const WINDOW: Duration = Duration::from_millis(1500);
/// How soon a stopped target's requests must fail fast.
const DETECTION_BOUND: Duration = Duration::from_millis(2500);
/// How late past its deadline a batch in flight at a failure may resolve: the poller's
/// flush grace (`PollerConfig::flush_grace`, 1 s), the most a fabric gets to hand back work
/// of a queue pair taken out of service, and scheduling on a small machine.
pub const IN_FLIGHT_SLACK: Duration = Duration::from_secs(2);
/// How long target 2 stays stopped: past a deadline and its slack, so that a batch in flight
/// at the stop that cannot complete there (a software provider's write needs the target's
/// CPU) resolves by the in-flight rule, not by the kill that follows.
const STOP_HOLD: Duration = Duration::from_millis(
    DEFAULT_DEADLINE.as_millis() as u64 + IN_FLIGHT_SLACK.as_millis() as u64 + 500,
);

/// One peer's submitter's log.
#[derive(Default)]
struct PeerLog {
    /// (when, bytes done) per batch.
    completions: Mutex<Vec<(Instant, u64)>>,
    /// Per batch: (submitted, resolved, outcome of its first failed request).
    failures: Mutex<Vec<(Instant, Instant, RequestOutcome)>>,
    /// Per batch: (submitted, resolved).
    batches: Mutex<Vec<(Instant, Instant)>>,
    /// A batch is submitted and not yet resolved.
    in_flight: AtomicBool,
}

impl PeerLog {
    fn bytes_between(&self, from: Instant, to: Instant) -> u64 {
        lock(&self.completions)
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, bytes)| bytes)
            .sum()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn submit_loop(
    engine: &Engine,
    peer: &Peer,
    base: u64,
    source: Region,
    log: &PeerLog,
    stop: &AtomicBool,
) -> Result<()> {
    let mut submitter = engine.submitter()?;
    let writes: Vec<Transfer> = (0..BLOCKS_PER_BATCH)
        .map(|i| Transfer {
            op: Op::Write,
            local: source,
            local_offset: i * BLOCK,
            remote_addr: base + i * BLOCK,
            len: BLOCK,
        })
        .collect();
    while !stop.load(Ordering::Relaxed) {
        let submitted = Instant::now();
        log.in_flight.store(true, Ordering::Release);
        let Ok(batch) = submitter.submit(peer, &writes) else {
            log.in_flight.store(false, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        batch.wait(submitted + DEFAULT_DEADLINE + BOUND);
        let resolved = Instant::now();
        log.in_flight.store(false, Ordering::Relaxed);
        let outcomes = batch.outcomes();
        let done = outcomes
            .iter()
            .filter(|o| **o == Some(RequestOutcome::Done))
            .count() as u64;
        lock(&log.completions).push((resolved, done * BLOCK));
        lock(&log.batches).push((submitted, resolved));
        if done < BLOCKS_PER_BATCH {
            let outcome = outcomes
                .iter()
                .flatten()
                .find(|o| **o != RequestOutcome::Done)
                .copied()
                .unwrap_or(RequestOutcome::Failed(FailReason::Timeout));
            lock(&log.failures).push((submitted, resolved, outcome));
            // An application told "unavailable" routes elsewhere instead of spinning.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// Until the first of them fails fast (or `end`), submits one write to `peer` (at `base`,
/// from `source`) every [`PROBE_INTERVAL`], waiting for none longer, and logs the failure of
/// each that fails within the interval to `log`: requests made after a peer stopped must
/// fail fast once the stop is detected, whatever happens to those already in flight (on
/// fabrics whose target side needs the target's CPU — libfabric's software providers —
/// those resolve by their deadline). Then watches the probes until each has resolved or
/// passed its deadline plus [`IN_FLIGHT_SLACK`]; returns how many resolved later than that.
fn probe(
    engine: &Engine,
    peer: &Peer,
    (base, source): (u64, Region),
    log: &PeerLog,
    end: Instant,
) -> Result<u64> {
    let mut submitter = engine.submitter()?;
    let write = Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: base,
        len: BLOCK,
    };
    let mut probes = Vec::new();
    let mut detected = false;
    while !detected && Instant::now() < end {
        let submitted = Instant::now();
        if let Ok(batch) = submitter.submit(peer, &[write]) {
            batch.wait(submitted + PROBE_INTERVAL);
            if let Some(&Some(RequestOutcome::Failed(reason))) = batch.outcomes().first() {
                let outcome = RequestOutcome::Failed(reason);
                lock(&log.failures).push((submitted, Instant::now(), outcome));
                detected = reason == FailReason::PeerUnavailable;
            }
            probes.push((submitted, batch));
        }
        std::thread::sleep(PROBE_INTERVAL.saturating_sub(submitted.elapsed()));
    }
    let bound = |submitted: Instant| submitted + DEFAULT_DEADLINE + IN_FLIGHT_SLACK;
    let mut late = 0;
    while !probes.is_empty() {
        let now = Instant::now();
        probes.retain(|(submitted, batch)| {
            let resolved = batch.wait(now).is_complete();
            let overdue = now > bound(*submitted);
            late += u64::from(overdue);
            !resolved && !overdue
        });
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(late)
}

/// How often [`probe`] submits.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// Waits (at most a second) until `log`'s submitter has a batch in flight, and answers
/// when it saw one: the instant a fault sent right after counts from. (Read after the
/// signal, the batch seen might have resolved in between, on a loaded machine, and the
/// fault would have found nothing in flight to check.)
fn wait_for_a_batch_in_flight(log: &PeerLog) -> Instant {
    let end = Instant::now() + Duration::from_secs(1);
    while !log.in_flight.load(Ordering::Acquire) && Instant::now() < end {
        std::hint::spin_loop();
    }
    Instant::now()
}

/// Batches of `log` in flight at `at`, and how many of them resolved past their deadline
/// plus [`IN_FLIGHT_SLACK`].
fn in_flight_at(log: &PeerLog, at: Instant) -> (u64, u64) {
    let batches = lock(&log.batches);
    let spanning: Vec<_> = batches
        .iter()
        .filter(|(submitted, resolved)| *submitted < at && *resolved > at)
        .collect();
    let late = spanning
        .iter()
        .filter(|(submitted, resolved)| {
            resolved.duration_since(*submitted) > DEFAULT_DEADLINE + IN_FLIGHT_SLACK
        })
        .count();
    (spanning.len() as u64, late as u64)
}

/// Reads a newcomer's first `len` bytes through a fresh peer; counts the non-zero ones.
fn nonzero_bytes(engine: &Engine, newcomer: &Target, len: u64) -> Option<u64> {
    let back = engine.alloc(len, None).ok()?;
    if !read_through_fresh_peer(engine, newcomer.addr, newcomer.pool_base, back) {
        return None;
    }
    // SAFETY: the read has resolved; nothing else uses `back`.
    let bytes = unsafe { region_bytes(back) };
    Some(bytes.iter().filter(|&&b| b != 0).count() as u64)
}

/// Runs the scenario, with `binary`'s `serve` as the targets.
///
/// # Errors
/// When the targets or the initiator cannot start or connect.
pub fn run(seed: u64, binary: &Path, fabric: &ChaosFabric) -> Result<ReplicaReport> {
    let mut targets: Vec<Target> = (0..PEERS)
        .map(|n| Target::start(binary, fabric, &format!("decode-{n}"), any_port(), 0))
        .collect::<Result<_>>()?;
    let engine = fabric
        .builder("prefill-0")
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .context("starting the initiator")?;
    let len = BLOCKS_PER_BATCH * BLOCK;
    let mut sources = Vec::new();
    let mut peers = Vec::new();
    for (n, target) in targets.iter().enumerate() {
        let source = engine.alloc(len, None)?;
        // SAFETY: nothing transfers from it yet. Never zeros: a byte of it landing in a
        // newcomer's (zeroed) memory must show.
        let bytes = unsafe { region_bytes(source) };
        fill_pattern(bytes, seed ^ n as u64);
        bytes
            .iter_mut()
            .filter(|b| **b == 0)
            .for_each(|b| *b = 0xA5);
        sources.push(source);
        peers.push(
            engine
                .open(&target.addr.to_string())
                .with_context(|| format!("opening target {n}"))?,
        );
    }
    let logs: Vec<PeerLog> = (0..PEERS).map(|_| PeerLog::default()).collect();
    let stop = AtomicBool::new(false);
    let mut newcomers = Vec::new();
    let mut newcomer_peers = Vec::new();
    let mut probes_late = 0;
    let mut predecessor_bases = Vec::new();
    let (killed_at, reaped_at, stopped_at) =
        std::thread::scope(|scope| -> Result<(Instant, Instant, Instant)> {
            let threads: Vec<_> = (0..PEERS)
                .map(|n| {
                    let (engine, peer, log, stop) = (&engine, &peers[n], &logs[n], &stop);
                    let (base, source) = (targets[n].pool_base, sources[n]);
                    scope.spawn(move || submit_loop(engine, peer, base, source, log, stop))
                })
                .collect();
            let phases = (|| -> Result<(Instant, Instant, Instant)> {
                std::thread::sleep(WINDOW + Duration::from_millis(200));
                // Phase 1: killed, with a reset, while a batch to it is in flight; another name
                // takes the port.
                let killed_at = wait_for_a_batch_in_flight(&logs[KILLED]);
                targets[KILLED].signal(libc::SIGKILL);
                let _ = targets[KILLED].child.wait();
                // The after-window opens once the kernel has torn the process down: on two
                // cores its exit competes with everyone, and that is not the engine's doing.
                let reaped_at = Instant::now();
                std::thread::sleep(WINDOW);
                let addr: SocketAddr = targets[KILLED].addr;
                newcomers.push(Target::start(binary, fabric, "decode-3-newcomer", addr, 1)?);
                predecessor_bases.push(targets[KILLED].pool_base);
                // The application reaches the newcomer while its handle of the dead process
                // still submits: the two must not be confused.
                newcomer_peers.push(engine.open(&addr.to_string()).ok());
                std::thread::sleep(Duration::from_millis(300));
                // Phase 2: stopped, no reset: only liveness can tell.
                let stopped_at = wait_for_a_batch_in_flight(&logs[STOPPED]);
                targets[STOPPED].signal(libc::SIGSTOP);
                probes_late = probe(
                    &engine,
                    &peers[STOPPED],
                    (targets[STOPPED].pool_base, sources[STOPPED]),
                    &logs[STOPPED],
                    stopped_at + DETECTION_BOUND + Duration::from_millis(500),
                )?;
                std::thread::sleep(
                    (stopped_at + STOP_HOLD).saturating_duration_since(Instant::now()),
                );
                targets[STOPPED].signal(libc::SIGKILL);
                let _ = targets[STOPPED].child.wait();
                let addr = targets[STOPPED].addr;
                newcomers.push(Target::start(binary, fabric, "decode-2", addr, 1)?);
                predecessor_bases.push(targets[STOPPED].pool_base);
                newcomer_peers.push(engine.open(&addr.to_string()).ok());
                std::thread::sleep(Duration::from_secs(1));
                Ok((killed_at, reaped_at, stopped_at))
            })();
            stop.store(true, Ordering::Relaxed);
            for thread in threads {
                thread
                    .join()
                    .map_err(|_| anyhow::anyhow!("a submitter thread panicked"))??;
            }
            phases
        })?;

    let mut before_total = 0u64;
    let mut after_total = 0u64;
    let mut min_ratio = f64::INFINITY;
    for (n, log) in logs.iter().enumerate() {
        if n == KILLED || n == STOPPED {
            continue;
        }
        let before = log.bytes_between(killed_at - WINDOW, killed_at);
        let after = log.bytes_between(reaped_at, reaped_at + WINDOW);
        before_total += before;
        after_total += after;
        min_ratio = min_ratio.min(after as f64 / before.max(1) as f64);
    }
    // The stopped peer was live in phase 1: its ratio counts too.
    let stopped_log = &logs[STOPPED];
    let before = stopped_log.bytes_between(killed_at - WINDOW, killed_at);
    let after = stopped_log.bytes_between(reaped_at, reaped_at + WINDOW);
    before_total += before;
    after_total += after;
    min_ratio = min_ratio.min(after as f64 / before.max(1) as f64);

    let killed_failures: Vec<_> = lock(&logs[KILLED].failures)
        .iter()
        .filter(|(submitted, _, _)| *submitted >= killed_at)
        .copied()
        .collect();
    let count = |reason| {
        killed_failures
            .iter()
            .filter(|(_, _, o)| *o == RequestOutcome::Failed(reason))
            .count() as u64
    };
    let unavailable = count(FailReason::PeerUnavailable);
    let restarted = count(FailReason::PeerRestarted);
    let (in_flight_killed, late_killed) = in_flight_at(&logs[KILLED], killed_at);
    let (in_flight_stopped, late_stopped) = in_flight_at(&logs[STOPPED], stopped_at);
    let stuck_at_stop = lock(&logs[STOPPED].batches)
        .iter()
        .filter(|(submitted, resolved)| {
            *submitted < stopped_at && *resolved >= stopped_at + Duration::from_secs(1)
        })
        .count() as u64;
    let detection = lock(&logs[STOPPED].failures)
        .iter()
        .filter(|(submitted, _, outcome)| {
            *submitted >= stopped_at
                && *outcome == RequestOutcome::Failed(FailReason::PeerUnavailable)
        })
        .map(|(_, resolved, _)| resolved.duration_since(stopped_at).as_millis() as u64)
        .min()
        .unwrap_or(0);
    let predecessors_retired = peers[KILLED].is_retired() && peers[STOPPED].is_retired();
    let same_layout = newcomers.len() == 2
        && newcomers
            .iter()
            .zip(&predecessor_bases)
            .all(|(newcomer, &base)| newcomer.pool_base == base);
    let mut misdirected = 0;
    let mut checked = true;
    for newcomer in &newcomers {
        match nonzero_bytes(&engine, newcomer, len) {
            Some(bytes) => misdirected += bytes,
            None => checked = false,
        }
    }
    Ok(ReplicaReport {
        seed,
        fabric: fabric.name(),
        live_throughput_ratio: after_total as f64 / before_total.max(1) as f64,
        min_live_peer_ratio: min_ratio,
        dead_peer_max_fail_ms: killed_failures
            .iter()
            .map(|(submitted, resolved, _)| resolved.duration_since(*submitted).as_millis() as u64)
            .max()
            .unwrap_or(0),
        deadline_ms: DEFAULT_DEADLINE.as_millis() as u64,
        dead_peer_unavailable: unavailable,
        dead_peer_restarted: restarted,
        dead_peer_other_failures: killed_failures.len() as u64 - unavailable - restarted,
        in_flight_at_kill: in_flight_killed,
        in_flight_at_stop: in_flight_stopped,
        stuck_at_stop,
        in_flight_late: late_killed + late_stopped,
        stopped_peer_detection_ms: detection,
        predecessors_retired,
        newcomers_reached: newcomer_peers.len() == 2 && newcomer_peers.iter().all(Option::is_some),
        same_layout,
        probes_late,
        misdirected,
        newcomers_checked: checked,
        circuit_openings: engine.stats().control.circuit_openings,
    })
}
