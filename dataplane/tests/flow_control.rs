//! Load never turns into failures: the poller keeps each queue pair within its send queue
//! and the rail within its completion queue (credits), treats a full send queue as
//! backpressure, and rings one doorbell per queue pair per round.

mod common;

use std::time::Instant;

use common::{BOUND, ENDPOINT, Reconnector, config, write};
use railyard_dataplane::fabric::scripted::ScriptedFabric;
use railyard_dataplane::fabric::{AsyncEvent, FabricLimits, WcStatus};
use railyard_dataplane::{
    Command, EndpointId, Epoch, FailReason, FailStale, PollerConfig, PollerHandle, RepairCause,
    RequestOutcome, Slice, SliceSpec, Submitter,
};

/// A poller on `fabric` with endpoints `0..endpoints` at the first epoch.
fn poller(fabric: ScriptedFabric, endpoints: u32) -> PollerHandle {
    let poller = PollerHandle::spawn(config(), fabric, FailStale).expect("poller starts");
    for endpoint in 0..endpoints {
        poller
            .send(Command::AddEndpoint {
                endpoint: EndpointId(endpoint),
                epoch: Epoch::FIRST,
            })
            .expect("poller runs");
    }
    poller
}

/// `count` one-slice requests of `len` bytes, striped over endpoints `0..endpoints`.
fn striped(count: u32, endpoints: u32, len: u32) -> Vec<SliceSpec> {
    (0..count)
        .map(|request| SliceSpec {
            endpoint: EndpointId(request % endpoints),
            len,
            ..write(request, Epoch::FIRST)
        })
        .collect()
}

/// Submits `specs` (one request each) and waits for every outcome.
fn run(poller: &PollerHandle, specs: &[SliceSpec]) -> Vec<Option<RequestOutcome>> {
    let mut submitter = Submitter::new(&[poller], 1024).expect("submitter");
    let batch = submitter
        .submit(specs.len(), specs, Instant::now() + BOUND)
        .expect("submitted");
    batch.wait(Instant::now() + BOUND);
    batch.outcomes()
}

/// Caught: the poller drained its rings into posted work without limit, so a send queue of
/// a few entries refused most of a large transfer and those slices failed `PostFailed` for
/// good; nothing bounded the completion queue either.
#[test]
fn a_gibibyte_per_queue_pair_through_tiny_queues_completes_without_a_failure() {
    let (fabric, script) = ScriptedFabric::new();
    let limits = FabricLimits {
        send_queue: 4,
        completion_queue: 6,
    };
    script.set_limits(limits);
    script.drip(3);
    let poller = poller(fabric, 2);
    // 4096 slices of 256 KiB per queue pair: 1 GiB each.
    let specs = striped(2 * 4096, 2, 256 << 10);
    let outcomes = run(&poller, &specs);
    assert!(
        outcomes.iter().all(|o| *o == Some(RequestOutcome::Done)),
        "{} of {} done",
        outcomes
            .iter()
            .filter(|o| **o == Some(RequestOutcome::Done))
            .count(),
        outcomes.len()
    );
    let counters = poller.counters();
    assert_eq!(counters.failed(FailReason::PostFailed), 0);
    assert_eq!(counters.completed, 2 * 4096);
    assert!(counters.credit_waits > 0, "the credits held slices back");
    assert!(script.deepest_send_queue() <= limits.send_queue);
    assert_eq!(
        script.cq_overruns(),
        0,
        "the completion queue never overran"
    );
}

/// Caught: a post cut short with `SendQueueFull` failed the rest of its list.
#[test]
fn posts_cut_short_at_random_fail_nothing() {
    let (fabric, script) = ScriptedFabric::new();
    script.cut_posts(Some(7));
    script.drip(16);
    let poller = poller(fabric, 3);
    let specs = striped(6000, 3, 4096);
    let outcomes = run(&poller, &specs);
    assert!(outcomes.iter().all(|o| *o == Some(RequestOutcome::Done)));
    let counters = poller.counters();
    assert!(counters.send_queue_full > 0, "posts were cut short");
    assert_eq!(counters.failed_total(), 0);
    assert_eq!(counters.completed, 6000);
}

/// Caught: a change of queue pair flushed the post list, so work striped across peers got
/// one doorbell per request.
#[test]
fn interleaved_peers_get_one_doorbell_per_queue_pair_per_round() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller(fabric, 2);
    let specs = striped(256, 2, 4096);
    let outcomes = run(&poller, &specs);
    assert!(outcomes.iter().all(|o| *o == Some(RequestOutcome::Done)));
    let calls = script.post_calls();
    let requests: usize = calls.iter().map(|(_, count)| count).sum();
    assert_eq!(requests, 256);
    // The poller takes up to `max_batch` (64) slices from a ring per round: 4 rounds or
    // more, two queue pairs each. One call per request would be 256.
    assert!(
        calls.len() <= 2 * 256 / 64 + 2,
        "{} post calls",
        calls.len()
    );
    assert_eq!(poller.counters().doorbells, calls.len() as u64);
}

/// A full send queue with nothing of its queue pair in flight (the fabric's own limit,
/// lower than it said) is retried, not waited on forever.
#[test]
fn a_send_queue_full_with_nothing_in_flight_is_tried_again() {
    let (fabric, script) = ScriptedFabric::new();
    script.cut_posts(Some(1));
    let poller = poller(fabric, 1);
    let specs = striped(500, 1, 64);
    let outcomes = run(&poller, &specs);
    assert!(outcomes.iter().all(|o| *o == Some(RequestOutcome::Done)));
    assert_eq!(poller.counters().failed_total(), 0);
    assert!(script.post_calls().len() > 1, "cut short, then tried again");
}

/// Caught: credits freed by completions went to the endpoints first in line, so with the
/// completion queue shared, the rest waited until those had nothing left (or their
/// deadlines passed).
#[test]
fn the_rails_credits_are_shared_between_starved_endpoints() {
    let (fabric, script) = ScriptedFabric::new();
    // One endpoint's send queue could take the whole completion queue.
    script.set_limits(FabricLimits {
        send_queue: 8,
        completion_queue: 8,
    });
    script.drip(2);
    let poller = poller(fabric, 4);
    let specs = striped(4 * 400, 4, 4096);
    let outcomes = run(&poller, &specs);
    assert!(outcomes.iter().all(|o| *o == Some(RequestOutcome::Done)));
    // In the first half of all posts, every endpoint has had a fair part of its own.
    let posted = script.posted();
    let first_half = &posted[..posted.len() / 2];
    for endpoint in 0..4 {
        let share = first_half
            .iter()
            .filter(|post| post.endpoint == EndpointId(endpoint))
            .count();
        assert!(
            share >= 400 / 4,
            "endpoint {endpoint}: {share} of the first half"
        );
    }
}

/// Caught: when a queue pair failed under load, what waited for its credits went back to
/// the endpoint's backlog and everything past the backlog limit failed `BacklogFull`.
#[test]
fn slices_waiting_for_credits_when_their_queue_pair_fails_are_not_refused() {
    let (fabric, script) = ScriptedFabric::new();
    script.set_limits(FabricLimits {
        send_queue: 4,
        completion_queue: 4,
    });
    script.hold(true);
    let backlog_limit = 1000;
    let config = PollerConfig {
        backlog_limit,
        ..config()
    };
    // The re-prepare a control plane provides: the slice is valid at the new epoch.
    let restamp = |slice: &mut Slice, current: Epoch, _: RepairCause| {
        slice.epoch = current;
        Ok(())
    };
    let poller = PollerHandle::spawn(config, fabric, restamp).expect("poller starts");
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST,
        })
        .expect("poller runs");
    let mut reconnector = Reconnector::new(&poller);
    let count = 3 * backlog_limit as u32;
    let specs: Vec<SliceSpec> = (0..count)
        .map(|request| write(request, Epoch::FIRST))
        .collect();
    let mut submitter = Submitter::new(&[&poller], 4096).expect("submitter");
    let batch = submitter
        .submit(specs.len(), &specs, Instant::now() + BOUND)
        .expect("submitted");
    // Four posted and held, the rest admitted and waiting for credits: then the link dies.
    common::eventually("every slice admitted", || {
        poller.counters().credit_waits >= u64::from(count) - 4
    });
    script.fail_outstanding(WcStatus::RetryExcErr);
    script.hold(false);
    reconnector.serve_until_complete(&poller, &batch);
    let counters = poller.counters();
    assert_eq!(counters.failed(FailReason::BacklogFull), 0, "{counters:?}");
    assert_eq!(reconnector.failures, vec![WcStatus::RetryExcErr]);
    assert!(
        batch
            .outcomes()
            .iter()
            .all(|o| *o == Some(RequestOutcome::Done)),
        "every slice done after the reconnect: {counters:?}"
    );
}

/// A rail that goes down and comes back is counted both ways; its queue pairs come down as
/// their own events.
#[test]
fn rail_health_events_are_counted() {
    let (fabric, script) = ScriptedFabric::new();
    let poller = poller(fabric, 1);
    script.raise(AsyncEvent::RailDown {
        reason: "the port's link went down".into(),
    });
    common::eventually("the rail counted down", || {
        poller.counters().rail_downs == 1
    });
    script.raise(AsyncEvent::RailUp);
    common::eventually("the rail counted up", || poller.counters().rail_ups == 1);
}
