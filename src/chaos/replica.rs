//! `dead-replica`: one dead peer must not degrade the others, must fail fast, and a new
//! process on its port must never receive what was meant for the dead one.
//!
//! One initiator writes to four targets, one submitter thread each, batches of 64 KiB
//! slices with the default 5 s deadline. Mid-run target 3 dies: its control plane and
//! pollers stop, its listener closes, and the fault plan kills the link to it (in one
//! process nothing else would stop bytes from arriving). Its endpoint's queue pair fails
//! (RETRY_EXC_ERR), reconnects are refused, the flaps open its circuit and its requests
//! fail with `PeerUnavailable`. Then a new process with a new incarnation takes the port and
//! registers memory of its own; when the endpoint's cooldown ends it dials the newcomer,
//! which refuses the queue pair meant for its predecessor, and the endpoint is retired with
//! `PeerRestarted` (a fresh endpoint to the newcomer takes its place; nothing submitted for
//! the old process can use it). Elsewhere every client kept sending to the dead endpoint, transfers hung
//! for 60 s, and a process that reused the port was taken for the dead one.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use railyard_control::{EndpointView, Policy};
use railyard_dataplane::fabric::soft::{Fault, QpMatch};
use railyard_dataplane::{FailReason, PollerHandle, RequestOutcome, SliceSpec, Submitter};
use serde::Serialize;

use super::node::Node;
use super::{BOUND, any_port, write_slice};

/// What happened.
#[derive(Debug, Serialize)]
pub struct ReplicaReport {
    /// The seed.
    pub seed: u64,
    /// Bytes per second to the three live peers after the kill over before it.
    pub live_throughput_ratio: f64,
    /// The lowest of the three live peers' own ratios.
    pub min_live_peer_ratio: f64,
    /// Longest a request to the dead peer took to fail after the kill, in ms.
    pub dead_peer_max_fail_ms: u64,
    /// The batch deadline, in ms.
    pub deadline_ms: u64,
    /// Requests to the dead peer that failed with `PeerUnavailable`.
    pub dead_peer_unavailable: u64,
    /// Requests to the dead peer that failed with `PeerRestarted`.
    pub dead_peer_restarted: u64,
    /// Requests to the dead peer that failed otherwise.
    pub dead_peer_other_failures: u64,
    /// Whether the newcomer is a new incarnation.
    pub newcomer_is_new_incarnation: bool,
    /// Bytes of the newcomer's memory written by transfers meant for the dead process.
    pub misdirected: u64,
    /// Queue pairs the newcomer accepted: the initiator's fresh endpoints to the new
    /// incarnation, which carry nothing meant for the old one.
    pub newcomer_endpoints: u64,
    /// Queue-pair requests the newcomer refused (meant for its predecessor).
    pub newcomer_refused: u64,
    /// Times the initiator's circuit to the dead peer opened.
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
        if self.dead_peer_unavailable == 0 {
            broken.push("no request to the dead peer failed with PeerUnavailable".into());
        }
        if !self.newcomer_is_new_incarnation {
            broken.push("the newcomer was taken for the dead process".into());
        }
        if self.misdirected != 0 {
            broken.push(format!("misdirected = {} (must be 0)", self.misdirected));
        }
        broken
    }
}

const PEERS: usize = 4;
const DEAD: usize = 3;
const SLICE_LEN: usize = 64 * 1024;
const SLICES_PER_BATCH: u32 = 8;
const DEADLINE: Duration = railyard_dataplane::DEFAULT_DEADLINE;
const WINDOW: Duration = Duration::from_millis(500);

/// Completed bytes of one peer's submitter, with when they completed.
#[derive(Default)]
struct PeerLog {
    completions: Mutex<Vec<(Instant, u64)>>,
    /// After the kill: (how long the batch took, outcome of its first request).
    failures: Mutex<Vec<(Duration, RequestOutcome)>>,
}

impl PeerLog {
    fn bytes_between(&self, from: Instant, to: Instant) -> u64 {
        self.completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, bytes)| bytes)
            .sum()
    }
}

struct Peer<'a> {
    poller: &'a PollerHandle,
    view: Arc<EndpointView>,
    source: railyard_dataplane::fabric::MemoryRegion,
    target_base: u64,
    log: &'a PeerLog,
    killed_at: &'a Mutex<Option<Instant>>,
    stop: &'a AtomicBool,
}

fn submit_loop(peer: &Peer<'_>) -> Result<()> {
    let mut submitter = Submitter::new(&[peer.poller], 256)?;
    let descriptor = peer.view.descriptor().context("descriptor")?;
    let rkey = descriptor
        .rkey_for(peer.target_base, SLICE_LEN as u64, 0)
        .context("target region")?;
    while !peer.stop.load(Ordering::Relaxed) {
        let epoch = peer
            .view
            .epoch()
            .unwrap_or(railyard_dataplane::Epoch::FIRST);
        let specs: Vec<SliceSpec> = (0..SLICES_PER_BATCH)
            .map(|i| {
                let offset = u64::from(i) * SLICE_LEN as u64;
                write_slice(
                    &peer.view,
                    epoch,
                    i,
                    (peer.source, offset),
                    (peer.target_base + offset, rkey),
                    SLICE_LEN,
                )
            })
            .collect();
        let submitted = Instant::now();
        let batch = submitter.submit(SLICES_PER_BATCH as usize, &specs, submitted + DEADLINE)?;
        batch.wait(submitted + DEADLINE + Duration::from_secs(1));
        let now = Instant::now();
        let outcomes = batch.outcomes();
        let done = outcomes
            .iter()
            .filter(|o| **o == Some(RequestOutcome::Done))
            .count() as u64;
        peer.log
            .completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((now, done * SLICE_LEN as u64));
        let killed = *peer
            .killed_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if done < u64::from(SLICES_PER_BATCH) {
            if killed.is_some_and(|at| submitted >= at) {
                let outcome = outcomes
                    .iter()
                    .flatten()
                    .find(|o| **o != RequestOutcome::Done)
                    .copied()
                    .unwrap_or(RequestOutcome::Failed(FailReason::Timeout));
                peer.log
                    .failures
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((now.duration_since(submitted), outcome));
            }
            // An application told "unavailable" routes elsewhere instead of spinning.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// Runs the scenario.
///
/// # Errors
/// When the nodes cannot start or connect.
pub fn run(seed: u64) -> Result<ReplicaReport> {
    let policy = Policy {
        cooldown_min: Duration::from_millis(300),
        ..Policy::default()
    };
    let mut targets = Vec::new();
    for n in 0..PEERS {
        let mut node = Node::start(
            &format!("decode-{n}"),
            1,
            any_port(),
            seed.wrapping_add(n as u64),
            Policy::default(),
            None,
        )?;
        node.alloc(SLICES_PER_BATCH as usize * SLICE_LEN)?;
        targets.push(Some(node));
    }
    let mut initiator = Node::start("prefill-0", 1, any_port(), seed, policy, None)?;
    let source = initiator.alloc(SLICES_PER_BATCH as usize * SLICE_LEN)?;
    // Never zeros: a byte of it landing in the newcomer's (zeroed) memory must show.
    // SAFETY: nothing transfers from the source yet.
    unsafe { initiator.regions[source].buffer.as_mut_slice() }.fill(0xA5);
    let local = initiator.regions[source].regions[0];
    let mut views = Vec::new();
    let mut bases = Vec::new();
    let dead_addr: SocketAddr = targets[DEAD].as_ref().context("target")?.addr();
    let dead_incarnation = targets[DEAD]
        .as_ref()
        .context("target")?
        .control
        .incarnation();
    for target in targets.iter().flatten() {
        let view = initiator.control.connect(target.addr(), 0, 0)?;
        if !view.wait_ready(Instant::now() + BOUND) {
            bail!("{} never connected: {:?}", target.name, view.phase());
        }
        views.push(view);
        bases.push(target.regions[0].buffer.region().addr);
    }

    let logs: Vec<PeerLog> = (0..PEERS).map(|_| PeerLog::default()).collect();
    let killed_at = Mutex::new(None);
    let stop = AtomicBool::new(false);
    let newcomer_written = AtomicU64::new(0);
    let mut newcomer_facts = (false, 0u64, 0u64);
    std::thread::scope(|scope| -> Result<()> {
        let threads: Vec<_> = (0..PEERS)
            .map(|n| {
                let peer = Peer {
                    poller: &initiator.pollers[0],
                    view: views[n].clone(),
                    source: local,
                    target_base: bases[n],
                    log: &logs[n],
                    killed_at: &killed_at,
                    stop: &stop,
                };
                scope.spawn(move || submit_loop(&peer))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200) + WINDOW);
        // Target 3 dies: the link to it goes dark, then the process.
        initiator.faults(0).add(Fault::KillLink {
            on: QpMatch::Endpoint(views[DEAD].id),
        });
        *killed_at.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        drop(targets[DEAD].take());
        std::thread::sleep(Duration::from_millis(300));
        // A new process takes the port.
        let mut newcomer = Node::start(
            "decode-3",
            1,
            dead_addr,
            seed ^ 0xdead,
            Policy::default(),
            None,
        )?;
        newcomer.alloc(SLICES_PER_BATCH as usize * SLICE_LEN)?;
        std::thread::sleep(WINDOW + Duration::from_millis(200));
        stop.store(true, Ordering::Relaxed);
        for thread in threads {
            thread
                .join()
                .map_err(|_| anyhow::anyhow!("a submitter thread panicked"))??;
        }
        // SAFETY: the initiator's transfers have all resolved.
        let memory = unsafe { newcomer.regions[0].buffer.as_slice() };
        newcomer_written.store(
            memory.iter().filter(|&&b| b != 0).count() as u64,
            Ordering::Relaxed,
        );
        let stats = newcomer.control.stats();
        newcomer_facts = (
            newcomer.control.incarnation() != dead_incarnation,
            stats.passive_qps,
            stats.refused,
        );
        Ok(())
    })?;

    let killed = killed_at
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .context("the kill happened")?;
    let mut before_total = 0u64;
    let mut after_total = 0u64;
    let mut min_ratio = f64::INFINITY;
    for log in logs.iter().take(DEAD) {
        let before = log.bytes_between(killed - WINDOW, killed);
        let after = log.bytes_between(killed, killed + WINDOW);
        before_total += before;
        after_total += after;
        min_ratio = min_ratio.min(after as f64 / before.max(1) as f64);
    }
    let failures = logs[DEAD]
        .failures
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let count = |reason| {
        failures
            .iter()
            .filter(|(_, o)| *o == RequestOutcome::Failed(reason))
            .count() as u64
    };
    let unavailable = count(FailReason::PeerUnavailable);
    let restarted = count(FailReason::PeerRestarted);
    let (is_new, accepted, refused) = newcomer_facts;
    Ok(ReplicaReport {
        seed,
        live_throughput_ratio: after_total as f64 / before_total.max(1) as f64,
        min_live_peer_ratio: min_ratio,
        dead_peer_max_fail_ms: failures
            .iter()
            .map(|(took, _)| took.as_millis() as u64)
            .max()
            .unwrap_or(0),
        deadline_ms: DEADLINE.as_millis() as u64,
        dead_peer_unavailable: unavailable,
        dead_peer_restarted: restarted,
        dead_peer_other_failures: failures.len() as u64 - unavailable - restarted,
        newcomer_is_new_incarnation: is_new,
        misdirected: newcomer_written.load(Ordering::Relaxed),
        newcomer_endpoints: accepted,
        newcomer_refused: refused,
        circuit_openings: initiator.control.stats().circuit_openings,
    })
}
