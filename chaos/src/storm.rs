//! `reconnect-storm`: stale slices after a reconnect must never be posted.
//!
//! The target is a `railyard serve` process with three regions; the initiator is a node in
//! this process whose fabric checks every post. The initiator prepares 256 slices at epoch e — the first K
//! (K from the seed) into region A, the rest into region B — and submits them. Before they
//! go, the target re-registers region B (new keys, old ones withdrawn), so every slice into
//! B carries a stale key. The fault plan fails work request K with LOC_LEN_ERR on the first
//! queue pair: it goes to ERR and flushes everything behind it. The endpoint must reconnect
//! once, at e+1, with a fresh descriptor; every flushed or waiting slice is re-prepared at
//! e+1 with B's new key; the slice that failed gets its one second chance. Elsewhere this is
//! the storm: stale keys posted on the new queue pair fail it, which reconnects, which posts
//! more stale keys.
//!
//! A second phase withdraws a third region for good, so the descriptor stays wrong for
//! every slice into it: 64 such slices interleaved with 64 good ones in one batch, all at
//! the current epoch. The first bad one takes the queue pair down and the refreshed
//! descriptor fails the rest before they are posted; the work-request budget keeps the
//! replacements to a few, not one per bad slice, and the good slices flushed behind them
//! are retried without being charged.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};
use railyard_engine::control::Policy;
use railyard_engine::dataplane::fabric::WcStatus;
use railyard_engine::dataplane::fabric::soft::{Fault, FaultPlan, QpMatch};
use railyard_engine::dataplane::{FailReason, RequestOutcome, Submitter};
use serde::Serialize;

use super::fabric::ChaosFabric;
use super::harness::{BOUND, any_port, write_slice};
use super::node::Node;
use super::pattern::{digest, fill_pattern};
use super::process::{RemoteRegion, Target};
use super::tally::RequestTally;

/// What happened.
#[derive(Debug, Serialize)]
pub struct StormReport {
    /// The seed.
    pub seed: u64,
    /// How the requests ended.
    #[serde(flatten)]
    pub requests: RequestTally,
    /// Work requests posted on a queue pair newer than their epoch (seen at the fabric).
    pub stale_posts: u64,
    /// Queue pairs created after the first.
    pub reconnects: u64,
    /// Error completions (not flushes) on the queue pair made by the reconnect.
    pub new_qp_errors: u64,
    /// Which work request the fault plan failed.
    pub failed_work_request: u64,
    /// Slices re-prepared by the poller.
    pub reprepared: u64,
    /// Whether every byte arrived where it was meant to.
    pub bytes_verified: bool,
    /// Second phase: slices into a region the target withdrew for good (the descriptor
    /// stays wrong for them), interleaved with good slices, all at the current epoch.
    pub bad_slices: u64,
    /// Queue pairs replaced in that phase: bounded by the work-request error budget, not by
    /// the number of bad slices.
    pub bad_descriptor_reconnects: u64,
    /// Of the bad slices, those that failed with `RemoteAccess` (all must).
    pub bad_slices_failed: u64,
    /// Good slices of that phase that failed (none may: they are not charged for the bad).
    pub good_slices_failed: u64,
}

/// Queue pairs the bad-descriptor phase may replace: the free work-request errors, and one
/// more while the refreshed descriptor is on its way.
pub const BAD_DESCRIPTOR_RECONNECTS: u64 = 3;

impl StormReport {
    /// Broken promises, empty when the run held.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        if self.stale_posts != 0 {
            broken.push(format!("stale_posts = {} (must be 0)", self.stale_posts));
        }
        if self.reconnects > 1 {
            broken.push(format!("reconnects = {} (must be ≤ 1)", self.reconnects));
        }
        let requests = self.requests;
        if requests.resolved != requests.submitted || requests.lost != 0 {
            broken.push(format!(
                "resolved {} of {} submitted, lost {}",
                requests.resolved, requests.submitted, requests.lost
            ));
        }
        if self.new_qp_errors != 0 {
            broken.push(format!(
                "the new queue pair saw {} error completions",
                self.new_qp_errors
            ));
        }
        if self.bad_descriptor_reconnects > BAD_DESCRIPTOR_RECONNECTS {
            broken.push(format!(
                "{} bad slices cost {} queue pairs (bound {BAD_DESCRIPTOR_RECONNECTS})",
                self.bad_slices, self.bad_descriptor_reconnects
            ));
        }
        if self.bad_slices_failed != self.bad_slices {
            broken.push(format!(
                "{} of {} slices into a withdrawn region failed",
                self.bad_slices_failed, self.bad_slices
            ));
        }
        if self.good_slices_failed != 0 {
            broken.push(format!(
                "{} good slices failed beside the bad ones",
                self.good_slices_failed
            ));
        }
        if !self.bytes_verified {
            broken.push("bytes did not arrive where they were meant to".into());
        }
        broken
    }
}

const SLICES: u32 = 256;
const SLICE_LEN: usize = 16 * 1024;
const PER_REQUEST: u32 = 8;

/// Runs the scenario against a `railyard serve` target started from `binary`.
///
/// # Errors
/// When the target or the initiator cannot start or connect.
pub fn run(seed: u64, binary: &Path, fabric: &ChaosFabric) -> Result<StormReport> {
    let region_len = u64::from(SLICES) * SLICE_LEN as u64;
    let pool = region_len.to_string();
    let options = ["--rails", "1", "--pool", &pool];
    let mut target = Target::start_with(binary, fabric, "decode-0", any_port(), 0, &options)?;
    let region_a = RemoteRegion {
        id: target.pool_id,
        addr: target.pool_base,
    };
    let region_b = target.alloc(region_len)?;
    let region_c = target.alloc(region_len)?;
    let mut initiator = Node::start_on(
        fabric,
        "prefill-0",
        1,
        any_port(),
        seed,
        Policy::default(),
        None,
    )?;
    let source = initiator.alloc(SLICES as usize * SLICE_LEN)?;
    // SAFETY: nothing transfers yet.
    fill_pattern(unsafe { initiator.bytes_mut(source) }, seed);

    let view = initiator.control.connect(target.addr, 0, 0)?;
    if !view.wait_ready(Instant::now() + BOUND) {
        bail!("the endpoint did not become ready: {:?}", view.phase());
    }
    let Some(descriptor) = view.descriptor() else {
        bail!("no descriptor after the handshake");
    };
    let epoch = view
        .epoch()
        .unwrap_or(railyard_engine::dataplane::Epoch::FIRST);
    let failing = 8 + seed % 24;
    let local = initiator.regions()[source].regions[0];
    // Slice i goes to region A for i < failing - 1, else to region B, at the same offset.
    let mut specs = Vec::new();
    for i in 0..SLICES {
        let offset = u64::from(i) * SLICE_LEN as u64;
        let remote = if u64::from(i) + 1 < failing {
            region_a.addr
        } else {
            region_b.addr
        };
        let Some(rkey) = descriptor.rkey_for(remote + offset, SLICE_LEN as u64, 0) else {
            bail!("the descriptor lacks the target's regions");
        };
        specs.push(write_slice(
            &view,
            epoch,
            i / PER_REQUEST,
            (local, offset),
            (remote + offset, rkey),
            SLICE_LEN,
        ));
    }
    // The peer rebuilds region B: every slice into it now carries a withdrawn key.
    let region_b = target.reregister(region_b.id)?;
    initiator
        .faults(0)
        .set(FaultPlan::new(seed).with(Fault::FailNth {
            on: QpMatch::Ordinal(0),
            nth: failing,
            status: WcStatus::LocLenErr,
        }));

    let mut submitter = Submitter::new(&[&*initiator.pollers[0]], 1024)?;
    let requests = SLICES / PER_REQUEST;
    let batch = submitter.submit(requests as usize, &specs, Instant::now() + BOUND)?;
    batch.wait(Instant::now() + BOUND);
    let outcomes = batch.outcomes();
    let resolved = outcomes.iter().flatten().count() as u64;
    let done = outcomes
        .iter()
        .filter(|o| **o == Some(RequestOutcome::Done))
        .count() as u64;

    // SAFETY: the source is only read by transfers.
    let sent = unsafe { initiator.regions()[source].buffer.as_slice() };
    let split = (failing - 1) * SLICE_LEN as u64;
    let bytes_verified = landed_as_sent(&mut target, region_a.id, 0, &sent[..split as usize])?
        && landed_as_sent(&mut target, region_b.id, split, &sent[split as usize..])?;

    let counters = initiator.pollers[0].counters();
    let phase_one_reconnects = initiator.control.stats().reconnects;
    let new_qp_errors = initiator.late_errors();
    let phase_two = bad_descriptor_phase(
        &mut initiator,
        &mut target,
        &view,
        source,
        region_a,
        region_c,
    )?;
    let report = StormReport {
        seed,
        requests: RequestTally::new(u64::from(requests), resolved, done),
        stale_posts: initiator.stale_posts(),
        reconnects: phase_one_reconnects,
        new_qp_errors,
        failed_work_request: failing,
        reprepared: counters.reprepared,
        bytes_verified,
        bad_slices: u64::from(BAD_SLICES),
        bad_descriptor_reconnects: initiator.control.stats().reconnects - phase_one_reconnects,
        bad_slices_failed: phase_two.0,
        good_slices_failed: phase_two.1,
    };
    drop(initiator);
    drop(target);
    Ok(report)
}

/// Whether `sent.len()` bytes at `offset` of the target's region `id` are `sent`, slice by
/// slice (digests computed in the target process).
fn landed_as_sent(target: &mut Target, id: u64, offset: u64, sent: &[u8]) -> Result<bool> {
    let landed = target.digests(id, offset, sent.len() as u64, SLICE_LEN as u64)?;
    let meant: Vec<u64> = sent.chunks(SLICE_LEN).map(digest).collect();
    Ok(landed == meant)
}

/// Bad slices in the bad-descriptor phase (and as many good ones).
const BAD_SLICES: u32 = 64;

/// The second phase: the target withdraws region C for good; one batch interleaves slices
/// into C (its old key, the current epoch) with slices into region A, each its own request.
/// Returns (bad slices failed with `RemoteAccess`, good slices failed).
fn bad_descriptor_phase(
    initiator: &mut Node,
    target: &mut Target,
    view: &railyard_engine::control::EndpointView,
    source: usize,
    region_a: RemoteRegion,
    region_c: RemoteRegion,
) -> Result<(u64, u64)> {
    let Some(descriptor) = view.descriptor() else {
        bail!("no descriptor for the second phase");
    };
    let (base_a, base_c) = (region_a.addr, region_c.addr);
    let (Some(rkey_a), Some(rkey_c)) = (
        descriptor.rkey_for(base_a, SLICE_LEN as u64, 0),
        descriptor.rkey_for(base_c, SLICE_LEN as u64, 0),
    ) else {
        bail!("the descriptor lacks regions A or C");
    };
    target.deregister(region_c.id)?;
    let local = initiator.regions()[source].regions[0];
    let epoch = view
        .epoch()
        .unwrap_or(railyard_engine::dataplane::Epoch::FIRST);
    let specs: Vec<_> = (0..2 * BAD_SLICES)
        .map(|i| {
            let offset = u64::from(i / 2) * SLICE_LEN as u64;
            let remote = if i % 2 == 0 {
                (base_c + offset, rkey_c)
            } else {
                (base_a + offset, rkey_a)
            };
            write_slice(view, epoch, i, (local, offset), remote, SLICE_LEN)
        })
        .collect();
    let mut submitter = Submitter::new(&[&*initiator.pollers[0]], 1024)?;
    let batch = submitter.submit(specs.len(), &specs, Instant::now() + BOUND)?;
    batch.wait(Instant::now() + BOUND);
    let outcomes = batch.outcomes();
    let bad_failed = outcomes
        .iter()
        .step_by(2)
        .filter(|o| {
            // Posted, the target refuses the key; re-prepared after the reconnect, the
            // region is gone from the descriptor.
            matches!(
                o,
                Some(RequestOutcome::Failed(
                    FailReason::RemoteAccess | FailReason::RegionWithdrawn
                ))
            )
        })
        .count() as u64;
    let good_failed = outcomes
        .iter()
        .skip(1)
        .step_by(2)
        .filter(|o| **o != Some(RequestOutcome::Done))
        .count() as u64;
    Ok((bad_failed, good_failed))
}
