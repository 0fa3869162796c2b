//! A target that gives up on an initiator fences it: once `Engine::revoke` returns, no write
//! the initiator submitted before that moment ever lands in the target's memory — not after
//! the initiator reconnects by itself, not after it retries — while its new writes land as
//! usual.
//!
//! Two engines in this process; the initiator keeps tagged writes in flight without pause
//! (each block carries its write's sequence number), across every fence. The target reads
//! how far submission had got, revokes the initiator, fills its buffer with a poison byte and
//! watches it: a tag from before the fence seen after it fails the test, with or without a
//! new handshake in between. Then it waits for a write from after the fence, which must land.
//! One more test puts 256 MiB in flight in one batch and revokes as its first bytes land.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::BOUND;
use common::mapped::{Buffer, PATTERN, POISON, one_rail_engine, open};
use common::tagged::{TaggedLoad, seq_of, tag};
use railyard::dataplane::{FailReason, IdleStrategy, RequestOutcome};
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, RevokeError, Transfer};

/// Each revoke looks like a flap to the initiator; three in a row stay below the flap limit
/// that would open its circuit.
const ROUNDS: usize = 3;
/// How long each round watches the poisoned buffer before it looks for new writes.
const WATCH: Duration = Duration::from_millis(150);

fn revoke_under_load(fabric: FabricChoice) {
    let target = one_rail_engine("decode-revoke", fabric);
    let initiator = one_rail_engine("prefill-revoke", fabric);
    let target_buffer = Buffer::new(POISON);
    let _target_region = target_buffer.register(&target);
    let source = Buffer::new(PATTERN);
    let source_region = source.register(&initiator);
    let peer = open(&initiator, &target);
    let load = TaggedLoad::default();
    thread::scope(|scope| {
        let _stop = load.stop_on_drop();
        scope.spawn(|| load.run(&initiator, &peer, &source, source_region));
        let mut after_last_fence = 0;
        for round in 0..ROUNDS {
            // Writes flow (from the second round on: writes submitted after the last fence,
            // through the queue pair the initiator made by itself after it).
            let flowing = Instant::now() + BOUND;
            while !load.landed_since(&target_buffer, POISON, after_last_fence) {
                assert!(Instant::now() < flowing, "round {round}: no write arrives");
                thread::sleep(Duration::from_millis(1));
            }
            let before = load.submitted();
            target
                .revoke(initiator.incarnation())
                .unwrap_or_else(|error| panic!("round {round}: {error}"));
            target_buffer.fill(POISON);
            after_last_fence = load.allocated();
            let end = Instant::now() + WATCH;
            while Instant::now() < end {
                if let Some((at, seq)) = load.stale_write(&target_buffer, POISON, before) {
                    panic!(
                        "round {round}: write {seq}, submitted before the fence (below \
                         {before}), landed at offset {at} after revoke returned"
                    );
                }
                thread::sleep(Duration::from_millis(1));
            }
        }
        // New writes after the last fence land; nothing from before it ever does.
        let flowing = Instant::now() + BOUND;
        while !load.landed_since(&target_buffer, POISON, after_last_fence) {
            assert!(
                Instant::now() < flowing,
                "no write lands after the last fence"
            );
            thread::sleep(Duration::from_millis(1));
        }
    });
    let stats = target.stats().control;
    assert!(
        stats.passive_retired >= ROUNDS as u64,
        "every revoke took queue pairs out of service: {stats:?}"
    );
    assert!(
        load.revoked() > 0,
        "no write was caught by a fence: the test proved nothing ({} succeeded, {} failed \
         otherwise)",
        load.succeeded(),
        load.other_failures()
    );
    assert!(load.succeeded() > 0, "no write succeeded at all");
}

#[test]
fn nothing_submitted_before_a_revoke_lands_after_it_on_tcp() {
    revoke_under_load(FabricChoice::Tcp);
}

#[test]
fn nothing_submitted_before_a_revoke_lands_after_it_on_the_soft_fabric() {
    revoke_under_load(FabricChoice::Soft);
}

/// libfabric's reliable-datagram endpoints keep nothing per initiator to take away: revoke
/// says so, and changes nothing (writes go on landing).
#[test]
fn revoke_is_refused_as_unsupported_on_libfabric_and_changes_nothing() {
    let build = |name: &str| {
        Engine::builder(name)
            .fabric(FabricChoice::Ofi)
            .ofi("tcp;ofi_rxm")
            .rails(RailChoice::Count(1.try_into().expect("one")))
            .idle(IdleStrategy::gentle())
            .build()
            .expect("the engine starts on libfabric's tcp provider")
    };
    let target = build("decode-revoke-ofi");
    let initiator = build("prefill-revoke-ofi");
    let target_buffer = Buffer::new(POISON);
    let _target_region = target_buffer.register(&target);
    let source = Buffer::new(PATTERN);
    let source_region = source.register(&initiator);
    let peer = open(&initiator, &target);
    let error = target
        .revoke(initiator.incarnation())
        .expect_err("libfabric cannot fence one peer");
    assert!(
        matches!(
            error,
            RevokeError::Unsupported {
                fabric: "libfabric"
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("libfabric"), "{error}");
    let mut submitter = initiator.submitter().expect("submitter");
    let batch = submitter
        .submit(
            &peer,
            &[Transfer {
                op: Op::Write,
                local: source_region,
                local_offset: 0,
                remote_addr: target_buffer_base(&peer),
                len: 4096,
            }],
        )
        .expect("submits");
    let status = batch.wait(Instant::now() + BOUND);
    assert_eq!(status.done, 1, "the peer was not fenced: {status:?}");
    assert_eq!(target_buffer.first_not(PATTERN), Some(4096));
}

fn target_buffer_base(peer: &railyard::engine::Peer) -> u64 {
    peer.descriptor().regions[0].base
}

/// Requests in the big batch, one MiB each.
const BIG_REQUESTS: usize = 256;
const MIB: usize = 1 << 20;

/// One batch of 256 × 1 MiB writes over TCP; the target revokes the initiator as soon as the
/// batch's first bytes land and poisons its memory. Nothing of the batch lands afterwards, and
/// every request resolves: done before the fence, or `Revoked`.
#[test]
fn a_revoke_as_a_big_batch_lands_stops_all_of_it_on_tcp() {
    let build = |name: &str| {
        Engine::builder(name)
            .fabric(FabricChoice::Tcp)
            .rails(RailChoice::Count(1.try_into().expect("one")))
            .idle(IdleStrategy::gentle())
            .default_deadline(Duration::from_secs(60))
            .build()
            .expect("the engine starts")
    };
    let target = build("decode-big");
    let initiator = build("prefill-big");
    let len = BIG_REQUESTS * MIB;
    let target_buffer = Buffer::sized(len, POISON);
    let _target_region = target_buffer.register(&target);
    let source = Buffer::sized(len, PATTERN);
    for request in 0..BIG_REQUESTS {
        source.fill_words(request * MIB, MIB, tag(request as u64));
    }
    let source_region = source.register(&initiator);
    let peer = open(&initiator, &target);
    let base = target_buffer_base(&peer);
    let transfers: Vec<Transfer> = (0..BIG_REQUESTS)
        .map(|request| Transfer {
            op: Op::Write,
            local: source_region,
            local_offset: (request * MIB) as u64,
            remote_addr: base + (request * MIB) as u64,
            len: MIB as u64,
        })
        .collect();
    let mut submitter = initiator.submitter().expect("submitter");
    let batch = submitter.submit(&peer, &transfers).expect("submits");
    // The first bytes land.
    let landing = Instant::now() + BOUND;
    while target_buffer.first_not(POISON).is_none() {
        assert!(Instant::now() < landing, "nothing of the batch arrives");
        thread::yield_now();
    }
    target
        .revoke(initiator.incarnation())
        .expect("the initiator is fenced");
    target_buffer.fill(POISON);
    let status = batch.wait(Instant::now() + BOUND);
    assert!(status.is_complete(), "every request resolves: {status:?}");
    // What is still on its way would land within a reconnect and a retry: watch for longer.
    let end = Instant::now() + Duration::from_millis(300);
    while Instant::now() < end {
        if let Some((at, word)) = target_buffer
            .words_other_than(u64::from_ne_bytes([POISON; 8]))
            .next()
        {
            panic!(
                "the batch's bytes landed at offset {at} after revoke returned (request {:?})",
                seq_of(word, BIG_REQUESTS as u64)
            );
        }
        thread::sleep(Duration::from_millis(5));
    }
    let outcomes = batch.outcomes();
    let revoked = outcomes
        .iter()
        .filter(|outcome| **outcome == Some(RequestOutcome::Failed(FailReason::Revoked)))
        .count();
    let done = outcomes
        .iter()
        .filter(|outcome| **outcome == Some(RequestOutcome::Done))
        .count();
    assert_eq!(
        done + revoked,
        BIG_REQUESTS,
        "each request is done before the fence or revoked: {outcomes:?}"
    );
    assert!(
        revoked > 0,
        "the fence caught none of the batch: {status:?}"
    );
}
