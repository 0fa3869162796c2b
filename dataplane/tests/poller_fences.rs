//! Nothing a poller reports is still in use, and nothing it is handed is lost: posted work
//! past its deadline resolves only after its queue pair is flushed; a poller that panics
//! stops and resolves what it held; commands to a stopped poller fail instead of spinning;
//! a burst of queue-pair failures reaches the owner of endpoints through a tiny event ring.

#![cfg(not(loom))]

mod common;

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use railyard_dataplane::fabric::scripted::ScriptedFabric;
use railyard_dataplane::fabric::{
    Fabric, FabricError, PostError, QpNum, WcStatus, WorkCompletion, WorkRequest,
};
use railyard_dataplane::{
    Command, EndpointId, Epoch, Event, FailReason, FailStale, PollerConfig, PollerHandle,
    RepairCause, RequestOutcome, Slice, SliceSpec, Submitter,
};

/// Re-prepares a stale slice for the current epoch (as the control plane's hook does).
fn restamp(slice: &mut Slice, current: Epoch, _: RepairCause) -> Result<(), FailReason> {
    slice.epoch = current;
    slice.rkey = rkey_for(current);
    Ok(())
}

/// Caught: before the fix the deadline sweep resolved posted slices with `Timeout` at once
/// while the fabric still held them (`outstanding` was 2 when the batch reported), so a late
/// completion could still read or write their buffers.
#[test]
fn a_posted_slice_past_its_deadline_resolves_only_after_its_queue_pair_is_flushed() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, restamp);
    let events = poller.take_events().expect("events");
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();

    script.hold(true);
    let soon = Instant::now() + Duration::from_millis(50);
    let late = submitter
        .submit(2, &[write(0, Epoch::FIRST), write(1, Epoch::FIRST)], soon)
        .unwrap();
    let patient = submitter
        .submit(
            2,
            &[
                SliceSpec {
                    request: 0,
                    ..write(2, Epoch::FIRST)
                },
                SliceSpec {
                    request: 1,
                    ..write(3, Epoch::FIRST)
                },
            ],
            deadline(),
        )
        .unwrap();
    finish(&late);
    // The moment the batch reports, the fabric holds none of its requests: the queue pair
    // was taken out of service and flushed first.
    assert_eq!(script.outstanding(), 0, "reported while still posted");
    for outcome in late.outcomes() {
        assert_eq!(outcome, Some(RequestOutcome::Failed(FailReason::Timeout)));
    }
    // The owner of endpoints hears of it as a transport failure and reconnects; the other
    // batch's slices, flushed with it, are retried on the new queue pair and succeed.
    let mut events = events;
    let mut failed = None;
    eventually("the queue pair's failure", || {
        while let Some(event) = events.pop() {
            if let Event::QpFailed { epoch, status, .. } = event {
                failed = Some((epoch, status));
            }
        }
        failed.is_some()
    });
    assert_eq!(failed, Some((Epoch::FIRST, WcStatus::RetryExcErr)));
    script.hold(false);
    poller
        .send(Command::BumpEpoch {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST.next(),
        })
        .unwrap();
    finish(&patient);
    assert_eq!(
        patient.outcomes(),
        vec![Some(RequestOutcome::Done), Some(RequestOutcome::Done)]
    );
    let counters = poller.counters();
    assert_eq!(counters.failed(FailReason::Timeout), 2);
    assert_eq!(counters.unflushed, 0);
}

/// Caught: before the fix a fabric that never flushed a retired queue pair had its overdue
/// slices resolved after the flush grace while it still held them (`outstanding` was 2 when
/// the batch reported): a NIC could still read or write their buffers. Now the queue pair is
/// torn down first, and the work behind it is flushed and retried like any flush.
#[test]
fn a_queue_pair_that_never_flushes_is_torn_down_before_its_work_is_reported() {
    let (fabric, script) = ScriptedFabric::new();
    let config = PollerConfig {
        flush_grace: Duration::from_millis(50),
        ..config()
    };
    let poller = PollerHandle::spawn(config, fabric, restamp).expect("the poller starts");
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST,
        })
        .unwrap();
    let events = poller.take_events().expect("events");
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    script.hold(true);
    script.never_flush(true);
    let patient = submitter
        .submit(
            1,
            &[SliceSpec {
                request: 0,
                ..write(2, Epoch::FIRST)
            }],
            deadline(),
        )
        .unwrap();
    // Long enough for both to be posted on the first queue pair on a loaded machine.
    let soon = Instant::now() + Duration::from_millis(500);
    let late = submitter
        .submit(2, &[write(0, Epoch::FIRST), write(1, Epoch::FIRST)], soon)
        .unwrap();
    eventually("all three are posted", || script.outstanding() == 3);
    finish(&late);
    assert_eq!(script.outstanding(), 0, "reported while still posted");
    let first_qp = script.posted()[0].qp;
    assert!(script.posted().iter().all(|posted| posted.qp == first_qp));
    assert_eq!(script.abandoned(), [first_qp]);
    for outcome in late.outcomes() {
        assert_eq!(outcome, Some(RequestOutcome::Failed(FailReason::Timeout)));
    }
    // The patient write went down with the queue pair, as a flush: retried on the next one.
    let mut events = events;
    eventually("the queue pair's failure", || {
        std::iter::from_fn(|| events.pop()).any(|event| matches!(event, Event::QpFailed { .. }))
    });
    script.hold(false);
    script.never_flush(false);
    poller
        .send(Command::BumpEpoch {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST.next(),
        })
        .unwrap();
    finish(&patient);
    assert_eq!(patient.outcomes(), [Some(RequestOutcome::Done)]);
    assert_eq!(
        poller.counters().unflushed,
        3,
        "two overdue, one behind them"
    );
    let retried = script.posted().last().map(|posted| posted.qp);
    assert!(retried.is_some_and(|qp| qp != first_qp));
}

/// A fabric with a bug: posting panics.
struct PanickingFabric;

impl Fabric for PanickingFabric {
    fn connect(&mut self, _: EndpointId, _: Epoch) -> Result<QpNum, FabricError> {
        Ok(QpNum(1))
    }

    fn post(&mut self, _: QpNum, _: &[WorkRequest]) -> Result<(), PostError> {
        panic!("a fabric bug (expected by this test)");
    }

    fn poll(&mut self, _: &mut Vec<WorkCompletion>, _: usize) -> usize {
        0
    }

    fn retire(&mut self, _: QpNum) {}

    fn abandon(&mut self, _: QpNum) -> bool {
        true
    }
}

/// Caught: before the fix a panicked poller never counted as stopped, so commands were
/// accepted into a ring nobody reads and, once it was full, `send` spun forever.
#[test]
fn a_poller_that_panics_stops_resolves_its_work_and_refuses_commands() {
    let poller = PollerHandle::spawn(
        PollerConfig {
            command_capacity: 2,
            ..config()
        },
        PanickingFabric,
        FailStale,
    )
    .unwrap();
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST,
        })
        .unwrap();
    let mut submitter = Submitter::new(&[&poller], 8).unwrap();
    let batch = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&batch);
    assert_eq!(
        batch.outcome(0),
        Some(RequestOutcome::Failed(FailReason::PollerGone))
    );
    // Many more commands than the ring holds: each is refused, none waits forever.
    let poller = std::sync::Arc::new(poller);
    let (done_tx, done_rx) = mpsc::channel();
    let sender = poller.clone();
    std::thread::spawn(move || {
        let refused = (0..16u64)
            .filter(|n| {
                sender
                    .send(Command::BumpEpoch {
                        endpoint: ENDPOINT,
                        epoch: Epoch::new(2 + n),
                    })
                    .is_err()
            })
            .count();
        let _ = done_tx.send(refused);
    });
    let refused = done_rx
        .recv_timeout(BOUND)
        .expect("commands to a panicked poller return");
    assert_eq!(refused, 16);
    let late = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&late);
    assert_eq!(
        late.outcome(0),
        Some(RequestOutcome::Failed(FailReason::PollerGone))
    );
}

/// Caught: before the fix the poller pushed events into its ring and dropped them when it
/// was full; with a ring of 2 slots nearly every endpoint of the burst stayed down for good
/// and its slices timed out.
#[test]
fn a_burst_of_queue_pair_failures_reaches_the_owner_through_a_tiny_event_ring() {
    const ENDPOINTS: u32 = 2000;
    let (fabric, script) = ScriptedFabric::new();
    let poller = PollerHandle::spawn(
        PollerConfig {
            event_capacity: 2,
            ..config()
        },
        fabric,
        restamp,
    )
    .unwrap();
    let mut events = poller.take_events().expect("events");
    for id in 0..ENDPOINTS {
        poller
            .send(Command::AddEndpoint {
                endpoint: EndpointId(id),
                epoch: Epoch::FIRST,
            })
            .unwrap();
    }
    // The first post on every endpoint fails its queue pair.
    for index in 0..ENDPOINTS as usize {
        script.fail_nth(index, WcStatus::RetryExcErr);
    }
    let specs: Vec<SliceSpec> = (0..ENDPOINTS)
        .map(|id| SliceSpec {
            endpoint: EndpointId(id),
            ..write(id, Epoch::FIRST)
        })
        .collect();
    let mut submitter = Submitter::new(&[&poller], 4096).unwrap();
    let batch = submitter
        .submit(ENDPOINTS as usize, &specs, deadline())
        .unwrap();
    // The owner reads events slowly: every endpoint's failure reaches it.
    let mut failed: BTreeMap<EndpointId, Epoch> = BTreeMap::new();
    let end = Instant::now() + BOUND;
    while failed.len() < ENDPOINTS as usize {
        assert!(
            Instant::now() < end,
            "{} of {ENDPOINTS} failures reported within {BOUND:?}",
            failed.len()
        );
        std::thread::sleep(Duration::from_millis(1));
        for _ in 0..64 {
            let Some(event) = events.pop() else { break };
            if let Event::QpFailed {
                endpoint, epoch, ..
            } = event
            {
                failed.insert(endpoint, epoch);
            }
        }
    }
    // And reconnecting each one brings its slice through.
    for (&endpoint, epoch) in &failed {
        poller
            .send(Command::BumpEpoch {
                endpoint,
                epoch: epoch.next(),
            })
            .unwrap();
    }
    finish(&batch);
    assert!(
        batch
            .outcomes()
            .iter()
            .all(|outcome| *outcome == Some(RequestOutcome::Done)),
        "every slice retried on its endpoint's new queue pair"
    );
}

/// Caught: before the fix a flushed WRITE_WITH_IMM was retried on the next queue pair like
/// any write, and a target that had already taken its immediate got it twice.
#[test]
fn a_flushed_immediate_is_never_posted_again() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, restamp);
    let mut submitter = Submitter::new(&[&poller], 8).unwrap();
    script.hold(true);
    let signal = SliceSpec {
        opcode: railyard_dataplane::fabric::Opcode::WriteWithImm,
        len: 0,
        imm: 0xfeed,
        ..write(0, Epoch::FIRST)
    };
    let data = SliceSpec {
        request: 1,
        ..write(1, Epoch::FIRST)
    };
    let batch = submitter.submit(2, &[signal, data], deadline()).unwrap();
    eventually("both posted", || script.outstanding() == 2);
    // A reconnect flushes both; only the write goes again.
    script.hold(false);
    poller
        .send(Command::BumpEpoch {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST.next(),
        })
        .unwrap();
    finish(&batch);
    assert_eq!(
        batch.outcome(0),
        Some(RequestOutcome::Failed(FailReason::Flushed))
    );
    assert_eq!(batch.outcome(1), Some(RequestOutcome::Done));
    let immediates = script
        .posted()
        .iter()
        .filter(|posted| posted.request.imm == 0xfeed)
        .count();
    assert_eq!(immediates, 1);
}

/// A fabric whose first round stops inside `serve` until the test lets it go.
struct HeldRound {
    entered: mpsc::Sender<()>,
    /// Taken by the first `serve`, which waits until the test drops the other end.
    gate: Option<mpsc::Receiver<()>>,
}

impl Fabric for HeldRound {
    fn connect(&mut self, _: EndpointId, _: Epoch) -> Result<QpNum, FabricError> {
        Ok(QpNum(1))
    }

    fn post(&mut self, _: QpNum, _: &[WorkRequest]) -> Result<(), PostError> {
        Ok(())
    }

    fn poll(&mut self, _: &mut Vec<WorkCompletion>, _: usize) -> usize {
        0
    }

    fn retire(&mut self, _: QpNum) {}

    fn abandon(&mut self, _: QpNum) -> bool {
        true
    }

    fn serve(&mut self) -> bool {
        if let Some(gate) = self.gate.take() {
            let _ = self.entered.send(());
            // Ends when the test drops the sender (or after the bound, so nothing hangs).
            let _ = gate.recv_timeout(BOUND);
        }
        false
    }
}

/// A poller stopped inside its first round; dropping the returned sender lets it go on.
fn poller_held_in_its_first_round(config: PollerConfig) -> (PollerHandle, mpsc::Sender<()>) {
    let (entered, in_round) = mpsc::channel();
    let (release, gate) = mpsc::channel();
    let fabric = HeldRound {
        entered,
        gate: Some(gate),
    };
    let poller = PollerHandle::spawn(config, fabric, FailStale).expect("the poller starts");
    in_round
        .recv_timeout(BOUND)
        .expect("the poller runs a round");
    (poller, release)
}

/// Caught: what deregistration relies on — `quiesce` returns only once the round the
/// poller is in has ended (a copy it checked a key for before the withdrawal is done).
#[test]
fn quiesce_waits_for_the_round_in_progress() {
    let (poller, held) = poller_held_in_its_first_round(config());
    let started = Instant::now();
    assert!(
        !poller.quiesce(Instant::now() + Duration::from_millis(50)),
        "the round is still in progress"
    );
    assert!(started.elapsed() >= Duration::from_millis(50));
    drop(held);
    assert!(poller.quiesce(Instant::now() + BOUND));
    drop(poller);
}

/// Caught: a READ posted before a local region's deregistration landed in it afterwards
/// (libfabric's software providers move the bytes themselves, registration or not):
/// `drain_local` returns only once nothing posted through the region's keys is outstanding.
#[test]
fn drain_local_waits_for_what_was_posted_through_the_keys() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, restamp);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    script.hold(true);
    let batch = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    eventually("the write is posted", || script.outstanding() == 1);
    let lkey = write(0, Epoch::FIRST).lkey;
    let started = Instant::now();
    assert!(
        !poller.drain_local(&[lkey], Instant::now() + Duration::from_millis(50)),
        "a request through the key is still outstanding"
    );
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert!(
        poller.drain_local(&[lkey + 1], Instant::now() + BOUND),
        "no request goes through another key"
    );
    script.release();
    assert!(poller.drain_local(&[lkey], Instant::now() + BOUND));
    finish(&batch);
    assert_eq!(batch.outcomes(), [Some(RequestOutcome::Done)]);
    drop(poller);
}

/// Caught: before the fix `send` spun for as long as a running poller left its command ring
/// full, and shutting such a poller down went through that ring.
#[test]
fn a_command_to_a_stalled_poller_gives_up_and_shutdown_does_not_need_the_ring() {
    let (poller, held) = poller_held_in_its_first_round(PollerConfig {
        command_capacity: 2,
        ..config()
    });
    let bump = |n: u64| Command::BumpEpoch {
        endpoint: ENDPOINT,
        epoch: Epoch::new(n),
    };
    poller.send(bump(2)).expect("room");
    poller.send(bump(3)).expect("room");
    let started = Instant::now();
    assert!(poller.send(bump(4)).is_err(), "a full ring refuses in time");
    let waited = started.elapsed();
    assert!(
        waited >= railyard_dataplane::COMMAND_WAIT && waited < BOUND,
        "{waited:?}"
    );
    // The ring is still full; shutdown goes around it.
    let (done_tx, done_rx) = mpsc::channel();
    let stopper = std::thread::spawn(move || {
        poller.shutdown();
        let _ = done_tx.send(());
    });
    drop(held);
    done_rx.recv_timeout(BOUND).expect("shutdown returns");
    stopper.join().unwrap();
}
