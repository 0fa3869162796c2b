//! `teardown-race`: tearing endpoints down while submitters post at full rate must never
//! crash, lose a request, resolve one twice, or post a stale slice.
//!
//! Two rails, three targets (`railyard serve` processes). One submitter thread per rail keeps four batches in flight at
//! all times, each to the next target in turn, preparing each from that endpoint's current
//! view. A churn thread retires every endpoint and connects a new one, over and over, while
//! the fault plan kills every queue pair after a few hundred work requests (QP fatal) and
//! fails others at random (RETRY_EXC_ERR), so queue pairs are re-handshaken constantly as
//! well. Every target gets its own bytes (the source holds a pattern per target): at the
//! end each slot of each target is either untouched or exactly what was meant for it, so a
//! slice re-pointed at the wrong peer would show. Elsewhere a
//! control-path teardown raced a data-path post on the same address vector and crashed:
//! here only the poller ever touches its queue pairs, and teardown is a command on a ring.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use railyard_engine::control::{EndpointView, Policy};
use railyard_engine::dataplane::fabric::WcStatus;
use railyard_engine::dataplane::fabric::soft::{Fault, FaultPlan, QpMatch};
use railyard_engine::dataplane::{Batch, PollerHandle, SliceSpec, Submitter};
use serde::Serialize;

use super::fabric::ChaosFabric;
use super::harness::{BOUND, any_port, write_slice};
use super::node::Node;
use super::pattern::{digest, fill_pattern};
use super::process::Target;
use super::tally::RequestTally;

/// What happened.
#[derive(Debug, Serialize)]
pub struct RaceReport {
    /// The seed.
    pub seed: u64,
    /// How the requests ended (most failures are retired endpoints, by design of the race).
    #[serde(flatten)]
    pub requests: RequestTally,
    /// Slices resolved a second time.
    pub double_resolved: u64,
    /// Work requests posted on a queue pair newer than their epoch (seen at the fabric).
    pub stale_posts: u64,
    /// Slots of a target's memory holding bytes that were not meant for it.
    pub misplaced_slots: u64,
    /// Slots of the targets' memory found written as they were meant to be.
    pub verified_slots: u64,
    /// Endpoints retired while traffic flowed.
    pub retirements: u64,
    /// Queue pairs handed to pollers (re-handshakes included).
    pub queue_pairs: u64,
    /// Queue pairs killed by the fault plan (QP fatal or RETRY_EXC_ERR).
    pub queue_pair_failures: u64,
}

impl RaceReport {
    /// Broken promises, empty when the run held.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        if self.requests.lost != 0 {
            broken.push(format!("lost = {} (must be 0)", self.requests.lost));
        }
        if self.double_resolved != 0 {
            broken.push(format!(
                "double_resolved = {} (must be 0)",
                self.double_resolved
            ));
        }
        if self.stale_posts != 0 {
            broken.push(format!("stale_posts = {} (must be 0)", self.stale_posts));
        }
        if self.misplaced_slots != 0 {
            broken.push(format!(
                "misplaced_slots = {} (must be 0)",
                self.misplaced_slots
            ));
        }
        if self.verified_slots == 0 {
            broken.push("no slot of any target was written".into());
        }
        if self.retirements < 2000 {
            broken.push(format!(
                "only {} retirements: the race was not run",
                self.retirements
            ));
        }
        broken
    }
}

const RAILS: usize = 2;
const TARGETS: usize = 3;
/// Slots per target (each `SLICE_LEN`).
const SLOTS: u64 = 256;
const SLICE_LEN: usize = 4096;
const SLICES_PER_BATCH: u32 = 16;
const RETIREMENTS_PER_RAIL: u64 = 1500;
/// Longest the churn runs, whatever the count: room for the 2000 retirements the report
/// requires on a 2-core machine that runs the other scenarios beside it (it ends at the
/// count, in about 4 s, when it has the cores to itself).
const CHURN_BUDGET: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Tally {
    submitted: AtomicU64,
    resolved: AtomicU64,
    done: AtomicU64,
    double_resolved: AtomicU64,
}

impl Tally {
    fn settle(&self, batch: &Batch, requests: u64) {
        batch.wait(Instant::now() + BOUND);
        let outcomes = batch.outcomes();
        let resolved = outcomes.iter().flatten().count() as u64;
        let done = outcomes
            .iter()
            .filter(|o| **o == Some(railyard_engine::dataplane::RequestOutcome::Done))
            .count() as u64;
        debug_assert!(resolved <= requests);
        self.resolved.fetch_add(resolved, Ordering::Relaxed);
        self.done.fetch_add(done, Ordering::Relaxed);
        self.double_resolved
            .fetch_add(batch.double_resolved() as u64, Ordering::Relaxed);
    }
}

/// Keeps four batches in flight on `rail` until `stop`.
fn submit_loop(
    rail: usize,
    poller: &PollerHandle,
    views: &[Mutex<Arc<EndpointView>>],
    source: railyard_engine::dataplane::fabric::MemoryRegion,
    target_bases: &[u64],
    tally: &Tally,
    stop: &AtomicBool,
) -> Result<()> {
    let mut submitter = Submitter::new(&[poller], 1024)?;
    let mut in_flight: VecDeque<Batch> = VecDeque::new();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let target = (round % TARGETS as u64) as usize;
        let target_base = target_bases[target];
        // This target's part of the source: bytes meant for it alone.
        let source_part = target as u64 * SLOTS * SLICE_LEN as u64;
        let current = views[target]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let (Some(epoch), Some(descriptor)) = (current.epoch(), current.descriptor()) else {
            std::thread::yield_now();
            continue;
        };
        let specs: Vec<SliceSpec> = (0..SLICES_PER_BATCH)
            .filter_map(|i| {
                let offset = ((round * u64::from(SLICES_PER_BATCH) + u64::from(i)) % SLOTS)
                    * SLICE_LEN as u64;
                let remote = target_base + offset;
                let rkey = descriptor.rkey_for(remote, SLICE_LEN as u64, rail as u16)?;
                Some(write_slice(
                    &current,
                    epoch,
                    i,
                    (source, source_part + offset),
                    (remote, rkey),
                    SLICE_LEN,
                ))
            })
            .collect();
        round += 1;
        if specs.len() != SLICES_PER_BATCH as usize {
            bail!("the target's descriptor lost its region");
        }
        let batch = submitter.submit(
            SLICES_PER_BATCH as usize,
            &specs,
            Instant::now() + Duration::from_secs(2),
        )?;
        tally
            .submitted
            .fetch_add(u64::from(SLICES_PER_BATCH), Ordering::Relaxed);
        in_flight.push_back(batch);
        if in_flight.len() >= 4 {
            if let Some(oldest) = in_flight.pop_front() {
                tally.settle(&oldest, u64::from(SLICES_PER_BATCH));
            }
        }
    }
    for batch in in_flight {
        tally.settle(&batch, u64::from(SLICES_PER_BATCH));
    }
    Ok(())
}

/// Runs the scenario against three `railyard serve` targets started from `binary`.
///
/// # Errors
/// When the targets or the initiator cannot start or connect.
pub fn run(seed: u64, binary: &Path, fabric: &ChaosFabric) -> Result<RaceReport> {
    let policy = Policy {
        backoff_min: Duration::from_micros(100),
        backoff_max: Duration::from_millis(5),
        cooldown_min: Duration::from_millis(5),
        cooldown_max: Duration::from_millis(50),
        flap_after_ready: Duration::from_millis(1),
        ..Policy::default()
    };
    let (pool, rails) = ((SLOTS * SLICE_LEN as u64).to_string(), RAILS.to_string());
    let options = ["--rails", &rails, "--pool", &pool];
    let mut targets = (0..TARGETS)
        .map(|n| {
            let name = format!("decode-{n}");
            Target::start_with(binary, fabric, &name, any_port(), 0, &options)
        })
        .collect::<Result<Vec<_>>>()?;
    let target_bases: Vec<u64> = targets.iter().map(|target| target.pool_base).collect();
    let mut initiator = Node::start_on(fabric, "prefill-0", RAILS, any_port(), seed, policy, None)?;
    let source = initiator.alloc(TARGETS * SLOTS as usize * SLICE_LEN)?;
    // SAFETY: nothing transfers yet.
    let sent = unsafe { initiator.bytes_mut(source) };
    for (n, part) in sent.chunks_mut(SLOTS as usize * SLICE_LEN).enumerate() {
        fill_pattern(part, seed ^ (n as u64 + 1) << 40);
    }
    for rail in 0..RAILS {
        initiator.faults(rail).set(
            FaultPlan::new(seed ^ rail as u64)
                .with(Fault::QpFatal {
                    on: QpMatch::Any,
                    after: 200 + seed % 200,
                })
                .with(Fault::Random {
                    on: QpMatch::Any,
                    per_million: 2_000,
                    status: WcStatus::RetryExcErr,
                }),
        );
    }
    // views[rail][target]
    let views = (0..RAILS)
        .map(|rail| {
            targets
                .iter()
                .map(|target| {
                    let view = initiator
                        .control
                        .connect(target.addr, rail as u16, rail as u16)?;
                    if !view.wait_ready(Instant::now() + BOUND) {
                        bail!("rail {rail} never connected: {:?}", view.phase());
                    }
                    Ok(Mutex::new(view))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;

    let tally = Tally::default();
    let stop = AtomicBool::new(false);
    let mut retirements = 0u64;
    std::thread::scope(|scope| -> Result<()> {
        let submitters: Vec<_> = (0..RAILS)
            .map(|rail| {
                let (poller, views, tally, stop, bases) = (
                    &*initiator.pollers[rail],
                    &views[rail],
                    &tally,
                    &stop,
                    &target_bases,
                );
                let local = initiator.regions()[source].regions[rail];
                scope.spawn(move || submit_loop(rail, poller, views, local, bases, tally, stop))
            })
            .collect();
        let started = Instant::now();
        let churn = (|| -> Result<()> {
            while retirements < RETIREMENTS_PER_RAIL * RAILS as u64
                && started.elapsed() < CHURN_BUDGET
            {
                for (rail, rail_views) in views.iter().enumerate() {
                    for (view, target) in rail_views.iter().zip(&targets) {
                        let old = view.lock().unwrap_or_else(PoisonError::into_inner).clone();
                        initiator.control.retire(&old)?;
                        let fresh = initiator
                            .control
                            .connect(target.addr, rail as u16, rail as u16)
                            .context("reconnecting after a retirement")?;
                        *view.lock().unwrap_or_else(PoisonError::into_inner) = fresh;
                        retirements += 1;
                    }
                }
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        for submitter in submitters {
            submitter
                .join()
                .map_err(|_| anyhow::anyhow!("a submitter thread panicked"))??;
        }
        churn
    })?;

    // Every slot of every target: untouched, or exactly its part of the source (digests
    // computed in the target processes).
    // SAFETY: every transfer has resolved (or the bound passed; the report says which).
    let sent = unsafe { initiator.regions()[source].buffer.as_slice() };
    let untouched = digest(&[0; SLICE_LEN]);
    let (mut misplaced_slots, mut verified_slots) = (0, 0);
    for (n, target) in targets.iter_mut().enumerate() {
        let pool_len = SLOTS * SLICE_LEN as u64;
        let landed = target.digests(target.pool_id, 0, pool_len, SLICE_LEN as u64)?;
        let meant = &sent[n * pool_len as usize..][..pool_len as usize];
        for (slot, expected) in landed.iter().zip(meant.chunks(SLICE_LEN)) {
            if *slot == digest(expected) {
                verified_slots += 1;
            } else if *slot != untouched {
                misplaced_slots += 1;
            }
        }
    }
    let submitted = tally.submitted.load(Ordering::Relaxed);
    let resolved = tally.resolved.load(Ordering::Relaxed);
    let done = tally.done.load(Ordering::Relaxed);
    let stats = initiator.control.stats();
    Ok(RaceReport {
        seed,
        requests: RequestTally::new(submitted, resolved, done),
        double_resolved: tally.double_resolved.load(Ordering::Relaxed),
        stale_posts: initiator.stale_posts(),
        misplaced_slots,
        verified_slots,
        retirements,
        queue_pairs: stats.active_qps,
        queue_pair_failures: initiator.errors(WcStatus::RetryExcErr) + initiator.fatal_events(),
    })
}
