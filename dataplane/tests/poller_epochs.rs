//! The epoch rule on a live poller: a reconnect never lets a stale slice reach the fabric.

#![cfg(not(loom))]

mod common;

use common::*;
use railyard_dataplane::fabric::WcStatus;
use railyard_dataplane::fabric::scripted::ScriptedFabric;
use railyard_dataplane::{
    Command, Epoch, FailReason, FailStale, PollerConfig, PollerHandle, RepairCause, RequestOutcome,
    Slice, SliceSpec, Submitter,
};

/// The descriptor owner's hook: rewrite keys for the current epoch, refuse odd requests.
fn refresh(slice: &mut Slice, current: Epoch, _: RepairCause) -> Result<(), FailReason> {
    if slice.request() % 5 == 4 {
        return Err(FailReason::StaleEpoch);
    }
    slice.rkey = rkey_for(current);
    slice.epoch = current;
    Ok(())
}

#[test]
fn a_reconnect_reprepares_or_fails_every_stale_slice_and_posts_none() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, refresh);
    let first = Epoch::FIRST;
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();

    // 20 slices in flight on the first queue pair when the endpoint reconnects.
    script.hold(true);
    let specs: Vec<_> = (0..20).map(|r| write(r, first)).collect();
    let in_flight = submitter.submit(20, &specs, deadline()).unwrap();
    eventually("20 posts", || script.outstanding() == 20);
    let second = first.next();
    poller
        .send(Command::BumpEpoch {
            endpoint: ENDPOINT,
            epoch: second,
        })
        .unwrap();
    // And 10 more slices still prepared for the old epoch, after it.
    let late: Vec<_> = (0..10).map(|r| write(r, first)).collect();
    let late_batch = submitter.submit(10, &late, deadline()).unwrap();
    eventually("re-posts on the new queue pair", || {
        script.outstanding() >= 16 + 8
    });
    script.hold(false);
    script.release();
    finish(&in_flight);
    finish(&late_batch);

    for posted in script.posted() {
        assert_eq!(
            posted.request.rkey,
            rkey_for(posted.qp_epoch),
            "a slice was posted with keys of another epoch: {posted:?}"
        );
        assert_eq!(
            posted.request.epoch, posted.qp_epoch,
            "a slice was posted on a queue pair of another epoch: {posted:?}"
        );
    }
    let outcomes = in_flight.outcomes();
    for (request, outcome) in outcomes.iter().enumerate() {
        let expected = if request % 5 == 4 {
            RequestOutcome::Failed(FailReason::StaleEpoch)
        } else {
            RequestOutcome::Done
        };
        assert_eq!(*outcome, Some(expected), "request {request}");
    }
    let counters = poller.counters();
    assert_eq!(counters.reprepared, 16 + 8);
    assert_eq!(counters.stale_dropped, 4 + 2);
    assert_eq!(counters.completed, 24);
    assert_eq!(counters.failed(FailReason::StaleEpoch), 6);
    assert_eq!(
        script.connections(),
        [(ENDPOINT, first), (ENDPOINT, second)]
    );
}

#[test]
fn a_repeated_bump_changes_nothing_and_newer_slices_wait_for_their_epoch() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    let third = Epoch::new(3);
    // Prepared for an epoch the poller has not applied yet: held back, not posted.
    let early = submitter.submit(1, &[write(0, third)], deadline()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(script.posted().is_empty());
    for _ in 0..3 {
        poller
            .send(Command::BumpEpoch {
                endpoint: ENDPOINT,
                epoch: third,
            })
            .unwrap();
    }
    poller
        .send(Command::BumpEpoch {
            endpoint: ENDPOINT,
            epoch: Epoch::new(2),
        })
        .unwrap();
    finish(&early);
    assert_eq!(early.outcome(0), Some(RequestOutcome::Done));
    assert_eq!(
        script.connections().len(),
        2,
        "one reconnect, however often it is asked"
    );
    assert_eq!(script.posted()[0].qp_epoch, third);

    // With FailStale, an old slice fails and is never posted.
    let stale = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    finish(&stale);
    assert_eq!(
        stale.outcome(0),
        Some(RequestOutcome::Failed(FailReason::StaleEpoch))
    );
    assert_eq!(script.posted().len(), 1);
    assert_eq!(poller.counters().stale_dropped, 1);
}

#[test]
fn an_endpoint_id_taken_over_at_a_continued_epoch_refuses_its_predecessors_slices() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, FailStale);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    poller
        .send(Command::RetireEndpoint {
            endpoint: ENDPOINT,
            reason: FailReason::EndpointRetired,
        })
        .unwrap();
    // The id's next occupant continues its epochs (the control plane's start_at).
    let continued = Epoch::new(2);
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: continued,
        })
        .unwrap();
    let old = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();
    let new = submitter
        .submit(1, &[write(0, continued)], deadline())
        .unwrap();
    finish(&old);
    finish(&new);
    assert_eq!(
        old.outcome(0),
        Some(RequestOutcome::Failed(FailReason::StaleEpoch))
    );
    assert_eq!(new.outcome(0), Some(RequestOutcome::Done));
    let posted = script.posted();
    assert_eq!(posted.len(), 1, "the predecessor's slice is never posted");
    assert_eq!(posted[0].qp_epoch, continued);
    assert_eq!(
        script.connections(),
        [(ENDPOINT, Epoch::FIRST), (ENDPOINT, continued)]
    );
}

#[test]
fn a_bad_work_request_takes_a_queue_pair_down_at_most_once() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller_with_endpoint(fabric, refresh);
    let mut control = Reconnector::new(&poller);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    // The first post fails with REM_ACCESS_ERR, and so does its re-prepared repost.
    script.fail_nth(0, WcStatus::RemAccessErr);
    script.fail_nth(1, WcStatus::RemAccessErr);
    let batch = submitter
        .submit(1, &[write(0, Epoch::FIRST)], deadline())
        .unwrap();

    control.serve_until_complete(&poller, &batch);
    assert_eq!(
        batch.outcome(0),
        Some(RequestOutcome::Failed(FailReason::RemoteAccess))
    );
    assert_eq!(
        script.posted().len(),
        2,
        "posted once, re-prepared once, never again"
    );
    assert_eq!(
        control.failures,
        [WcStatus::RemAccessErr, WcStatus::RemAccessErr]
    );
    assert_eq!(poller.counters().reprepared, 1);
    // The error names the range and the endpoint, at the epoch it was re-prepared for.
    let failure = batch.failure(0).expect("failed");
    let spec = write(0, Epoch::FIRST);
    assert_eq!(
        (failure.remote_addr, failure.len, failure.endpoint),
        (spec.remote_addr, spec.len, ENDPOINT)
    );
    assert_eq!(failure.epoch, Epoch::FIRST.next());
    assert!(failure.to_string().contains("REM_ACCESS_ERR"), "{failure}");
}

#[test]
fn slices_flushed_behind_a_bad_work_request_are_not_charged_for_it() {
    let (fabric, script) = ScriptedFabric::new();
    let config = PollerConfig {
        retry_budget: 0,
        ..config()
    };
    let poller = PollerHandle::spawn(config, fabric, refresh).unwrap();
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST,
        })
        .unwrap();
    let mut control = Reconnector::new(&poller);
    let mut submitter = Submitter::new(&[&poller], 64).unwrap();
    // Four in flight; the first is refused by the target and the other three are flushed
    // behind it. With no retry budget at all, they go on at the next epoch all the same.
    script.hold(true);
    script.fail_nth(0, WcStatus::RemAccessErr);
    let specs: Vec<SliceSpec> = (0..4).map(|request| write(request, Epoch::FIRST)).collect();
    let batch = submitter.submit(4, &specs, deadline()).unwrap();
    eventually("the bad request to fail its queue pair", || {
        script.posted().len() >= 4 && script.outstanding() == 0
    });
    script.hold(false);
    control.serve_until_complete(&poller, &batch);
    for request in 0..4 {
        assert_eq!(
            batch.outcome(request),
            Some(RequestOutcome::Done),
            "request {request}"
        );
    }
    assert_eq!(control.failures, [WcStatus::RemAccessErr]);
}
