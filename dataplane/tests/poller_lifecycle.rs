//! Retirement, deadlines, shutdown and wake-ups: every slice resolves exactly once.

#![cfg(not(loom))]

mod common;

use std::time::{Duration, Instant};

use common::*;
use railyard_dataplane::fabric::WcStatus;
use railyard_dataplane::fabric::scripted::ScriptedFabric;
use railyard_dataplane::{
    Command, EndpointId, Epoch, Event, FailReason, FailStale, IdleStrategy, PollerConfig,
    PollerHandle, RequestOutcome, SliceSpec, SpawnError, Submitter,
};

fn all_failed(batch: &railyard_dataplane::Batch, reason: FailReason) {
    for (request, outcome) in batch.outcomes().into_iter().enumerate() {
        assert_eq!(
            outcome,
            Some(RequestOutcome::Failed(reason)),
            "request {request}"
        );
    }
}

#[test]
fn retiring_an_endpoint_drains_it_and_resolves_every_slice_once() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut events = poller.take_events().unwrap();
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    script.hold(true);
    let specs: Vec<_> = (0..32).map(|r| write(r, Epoch::FIRST)).collect();
    let batch = submitter.submit(32, &specs, deadline()).unwrap();
    eventually("32 posts", || script.outstanding() == 32);
    poller
        .send(Command::RetireEndpoint {
            endpoint: ENDPOINT,
            reason: FailReason::EndpointRetired,
        })
        .unwrap();
    finish(&batch);
    all_failed(&batch, FailReason::EndpointRetired);
    eventually("drained event", || {
        events.pop() == Some(Event::EndpointDrained { endpoint: ENDPOINT })
    });

    let after = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&after);
    all_failed(&after, FailReason::EndpointRetired);
    let counters = poller.counters();
    assert_eq!(counters.failed(FailReason::EndpointRetired), 33);
    assert_eq!(counters.completed, 0);
    assert_eq!(counters.posted, 32);
}

#[test]
fn deadlines_resolve_backlogged_and_in_flight_slices_with_timeout() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();

    // In flight and never completed.
    script.hold(true);
    let short = Instant::now() + Duration::from_millis(50);
    let held = submitter
        .submit(2, &[write(0, Epoch::FIRST), write(1, Epoch::FIRST)], short)
        .unwrap();
    finish(&held);
    all_failed(&held, FailReason::Timeout);
    // Their late completions free the slots and resolve nothing twice.
    script.release();
    script.hold(false);

    // The queue pair fails and nobody reconnects: the backlog times out.
    script.fail_nth(2, WcStatus::RetryExcErr);
    let short = Instant::now() + Duration::from_millis(100);
    let specs: Vec<_> = (0..8).map(|r| write(r, Epoch::FIRST)).collect();
    let stuck = submitter.submit(8, &specs, short).unwrap();
    finish(&stuck);
    all_failed(&stuck, FailReason::Timeout);
    assert_eq!(poller.counters().failed(FailReason::Timeout), 10);
}

#[test]
fn shutdown_with_work_in_flight_loses_nothing() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 256).unwrap();
    let done = submitter
        .submit(
            4,
            &(0..4).map(|r| write(r, Epoch::FIRST)).collect::<Vec<_>>(),
            deadline(),
        )
        .unwrap();
    finish(&done);
    script.hold(true);
    let specs: Vec<_> = (0..100).map(|r| write(r, Epoch::FIRST)).collect();
    let batch = submitter.submit(100, &specs, deadline()).unwrap();
    eventually("posts", || script.outstanding() > 0);
    poller.shutdown();
    finish(&batch);
    let outcomes = batch.outcomes();
    assert!(
        outcomes
            .iter()
            .all(|o| *o == Some(RequestOutcome::Failed(FailReason::Shutdown))),
        "{outcomes:?}"
    );
    let counters = poller.counters();
    assert_eq!(
        counters.completed + counters.failed_total(),
        104,
        "each slice counted once"
    );

    // After shutdown, submissions resolve at once instead of hanging.
    let late = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&late);
    all_failed(&late, FailReason::PollerGone);
}

#[test]
fn unknown_endpoints_fail_and_submitters_come_and_go() {
    let (fabric, _script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    for round in 0..5 {
        let mut submitter = Submitter::new(&[&poller], 8).unwrap();
        let mut spec = write(0, Epoch::FIRST);
        let ok = submitter.submit(1, &[spec], deadline()).unwrap();
        spec.endpoint = EndpointId(42);
        let unknown = submitter.submit(1, &[spec], deadline()).unwrap();
        finish(&ok);
        finish(&unknown);
        assert_eq!(ok.outcome(0), Some(RequestOutcome::Done), "round {round}");
        all_failed(&unknown, FailReason::UnknownEndpoint);
    }
    assert_eq!(poller.counters().completed, 5);
}

#[test]
fn invalid_submissions_are_refused_before_anything_is_queued() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 8).unwrap();
    let mut bad_rail = write(0, Epoch::FIRST);
    bad_rail.rail = 3;
    let error = submitter
        .submit(1, &[write(0, Epoch::FIRST), bad_rail], deadline())
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "slice 1 names rail 3, but this submitter has 1 rail(s)"
    );
    let error = submitter
        .submit(1, &[write(5, Epoch::FIRST)], deadline())
        .unwrap_err();
    assert!(error.to_string().contains("request 5"), "{error}");
    std::thread::sleep(Duration::from_millis(10));
    assert!(script.posted().is_empty());
    let empty = submitter.submit(3, &[], deadline()).unwrap();
    assert!(
        empty.poll().is_complete(),
        "requests without slices are done at once"
    );
}

#[test]
fn a_parked_poller_wakes_for_new_work() {
    let (fabric, _script) = ScriptedFabric::new();
    let lazy = PollerConfig {
        idle: IdleStrategy::SpinThenPark {
            spins: 0,
            park: Duration::from_secs(60),
        },
        ..PollerConfig::new("sleepy")
    };
    let poller = PollerHandle::spawn(lazy, fabric, FailStale).unwrap();
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST,
        })
        .unwrap();
    let mut submitter = Submitter::new(&[&poller], 8).unwrap();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(5));
        let batch = submitter
            .submit(1, &[write(0, Epoch::FIRST)], deadline())
            .unwrap();
        // Far below the 60 s park: only a wake-up completes it in time.
        let status = batch.wait(Instant::now() + Duration::from_secs(5));
        assert!(status.is_complete());
    }
}

#[test]
fn pollers_pin_to_the_pu_they_are_given_and_report_refusals() {
    let (fabric, _script) = ScriptedFabric::new();
    let pinned = PollerConfig {
        pin_pu: Some(0),
        ..config()
    };
    let poller = PollerHandle::spawn(pinned, fabric, FailStale).unwrap();
    poller.shutdown();
    let (fabric, _script) = ScriptedFabric::new();
    let impossible = PollerConfig {
        pin_pu: Some(100_000),
        ..config()
    };
    let error = PollerHandle::spawn(impossible, fabric, FailStale).unwrap_err();
    assert!(
        matches!(error, SpawnError::Pin { pu: 100_000, .. }),
        "{error}"
    );
}

#[test]
fn a_batch_spread_over_two_rails_resolves_each_request_once() {
    let (fabric_a, script_a) = ScriptedFabric::new();
    let (fabric_b, script_b) = ScriptedFabric::new();
    let rail_a = PollerHandle::spawn(config(), fabric_a, FailStale).unwrap();
    let rail_b = PollerHandle::spawn(PollerConfig::new("rail1"), fabric_b, FailStale).unwrap();
    for poller in [&rail_a, &rail_b] {
        poller
            .send(Command::AddEndpoint {
                endpoint: ENDPOINT,
                epoch: Epoch::FIRST,
            })
            .unwrap();
    }
    // Every 7th post on rail 1 fails its work request: its request fails, the rest succeed.
    for index in (0..2000).step_by(7) {
        script_b.fail_nth(index, WcStatus::LocProtErr);
    }
    let mut control = Reconnector::new(&rail_b);
    let mut submitter = Submitter::new(&[&rail_a, &rail_b], 64).unwrap();
    for _ in 0..50u32 {
        let specs: Vec<_> = (0..20u32)
            .map(|i| SliceSpec {
                rail: (i % 2) as usize,
                ..write(i / 2, Epoch::FIRST)
            })
            .collect();
        let batch = submitter.submit(10, &specs, deadline()).unwrap();
        control.serve_until_complete(&rail_b, &batch);
    }
    let (a, b) = (rail_a.counters(), rail_b.counters());
    assert_eq!(a.completed, 500);
    assert_eq!(a.failed_total(), 0);
    assert_eq!(
        b.completed + b.failed_total(),
        500,
        "every rail-1 slice resolved once"
    );
    assert!(b.failed(FailReason::LocalProtection) + b.failed(FailReason::StaleEpoch) > 0);
    assert_eq!(script_a.posted().len(), 500);
    // Slices prepared for the first epoch fail (FailStale) after the reconnects; none is
    // ever posted on a newer queue pair with the first epoch's key.
    assert!(
        script_b
            .posted()
            .iter()
            .all(|p| p.request.rkey == rkey_for(p.qp_epoch))
    );
}

#[test]
fn an_open_circuit_fails_the_backlog_and_new_slices_with_peer_unavailable() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut events = poller.take_events().unwrap();
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    // The queue pair fails; nobody reconnects, so later slices wait in the backlog.
    script.fail_nth(0, WcStatus::RetryExcErr);
    let failing = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    eventually("the queue pair failed", || {
        matches!(events.pop(), Some(Event::QpFailed { .. }))
    });
    let waiting = submitter
        .submit(
            4,
            &(0..4).map(|r| write(r, Epoch::FIRST)).collect::<Vec<_>>(),
            deadline(),
        )
        .unwrap();
    poller
        .send(Command::SetCircuit {
            endpoint: ENDPOINT,
            open: true,
        })
        .unwrap();
    finish(&waiting);
    all_failed(&waiting, FailReason::PeerUnavailable);
    finish(&failing);
    let fast = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&fast);
    all_failed(&fast, FailReason::PeerUnavailable);

    // Closed again and reconnected, traffic flows and the new queue pair is confirmed.
    poller
        .send(Command::SetCircuit {
            endpoint: ENDPOINT,
            open: false,
        })
        .unwrap();
    poller
        .send(Command::BumpEpoch {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST.next(),
        })
        .unwrap();
    let flowing = submitter
        .submit(1, &[write(0, Epoch::FIRST.next())], deadline())
        .unwrap();
    finish(&flowing);
    assert_eq!(flowing.outcome(0), Some(RequestOutcome::Done));
    eventually("confirmation of the new queue pair", || {
        events.pop()
            == Some(Event::Confirmed {
                endpoint: ENDPOINT,
                epoch: Epoch::FIRST.next(),
            })
    });
}

#[test]
fn a_retired_endpoint_fails_with_the_reason_it_was_retired_for() {
    let (fabric, _script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    poller
        .send(Command::RetireEndpoint {
            endpoint: ENDPOINT,
            reason: FailReason::PeerRestarted,
        })
        .unwrap();
    let after = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&after);
    all_failed(&after, FailReason::PeerRestarted);
}

#[test]
fn a_batch_without_a_deadline_gets_the_default_one() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    let before = Instant::now();
    let batch = submitter.submit_now(1, &[write(0, Epoch::FIRST)]).unwrap();
    let deadline = batch.deadline().duration_since(before);
    assert!(
        deadline >= railyard_dataplane::DEFAULT_DEADLINE
            && deadline < railyard_dataplane::DEFAULT_DEADLINE + Duration::from_secs(1)
    );
    finish(&batch);

    script.hold(true);
    submitter.set_default_deadline(Duration::from_millis(30));
    let held = submitter.submit_now(1, &[write(0, Epoch::FIRST)]).unwrap();
    finish(&held);
    all_failed(&held, FailReason::Timeout);
}
