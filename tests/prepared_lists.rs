//! Prepared descriptor lists (`Engine::prepare_local`, `Peer::prepare`,
//! `EngineSubmitter::submit_prepared`) and `Engine::register_many`, between two engines in
//! this process on the soft fabric: a list outlives a reconnect (its slices re-prepared,
//! its notification delivered once), but not a re-registration or a fence on either side;
//! bad indices are refused before anything is queued; contiguous pairs merge unless asked
//! not to.

mod common;

use std::time::{Duration, Instant};

use common::BOUND;
use common::mapped::{BLOCK, Buffer, PATTERN, POISON, one_rail_engine, open};
use railyard::control::NotificationBody;
use railyard::dataplane::fabric::soft::{Fault, QpMatch};
use railyard::dataplane::{FailReason, RequestOutcome};
use railyard::engine::{
    Engine, FabricChoice, MemoryError, Op, PostOptions, PrepareError, TransferError,
};

const PAGE: u64 = 4096;

/// Descriptors of `PAGE` bytes at every page of `buffer`.
fn pages(buffer: &Buffer) -> Vec<(u64, u64)> {
    (0..buffer.len() as u64 / PAGE)
        .map(|page| (buffer.addr() + page * PAGE, PAGE))
        .collect()
}

/// Fills `buffer` with bytes that say where they are, so misplaced pages show.
fn numbered(buffer: &Buffer) {
    let bytes: Vec<u8> = (0..buffer.len())
        .map(|i| (i / 4096 * 7 + i) as u8)
        .collect();
    buffer.write(0, &bytes);
}

fn wait_done(batch: &railyard::dataplane::Batch) -> Vec<Option<RequestOutcome>> {
    batch.wait(Instant::now() + BOUND);
    batch.outcomes()
}

fn notifications_from(engine: &Engine, name: &str, within: Duration) -> Vec<Vec<u8>> {
    let end = Instant::now() + within;
    let mut seen = Vec::new();
    while Instant::now() < end {
        for notification in
            engine.wait_notifications(end.min(Instant::now() + Duration::from_millis(50)))
        {
            if let (true, NotificationBody::Bytes(bytes)) =
                (notification.from == name, notification.body)
            {
                seen.push(bytes);
            }
        }
    }
    seen
}

#[test]
fn a_prepared_list_outlives_a_reconnect_and_its_notification_comes_once() {
    let target = one_rail_engine("decode-prepared", FabricChoice::Soft);
    let initiator = one_rail_engine("prefill-prepared", FabricChoice::Soft);
    let destination = Buffer::new(POISON);
    destination.register(&target);
    let source = Buffer::new(PATTERN);
    numbered(&source);
    source.register(&initiator);
    let peer = open(&initiator, &target);

    let local = initiator
        .prepare_local(&pages(&source))
        .expect("local list");
    let remote = peer.prepare(&pages(&destination)).expect("remote list");
    // The first queue pair dies after 10 work requests: every later slice of the batch is
    // flushed, re-prepared for the next epoch and posted again on the new queue pair.
    initiator
        .faults(0)
        .expect("a soft rail")
        .add(Fault::QpFatal {
            on: QpMatch::Ordinal(0),
            after: 10,
        });
    // Reversed: no two pairs are contiguous on both sides, so each page is a request.
    let count = local.len();
    let local_indices: Vec<usize> = (0..count).collect();
    let remote_indices: Vec<usize> = (0..count).rev().collect();
    let mut submitter = initiator.submitter().expect("submitter");
    let batch = submitter
        .submit_prepared(
            Op::Write,
            &local,
            &local_indices,
            &remote,
            &remote_indices,
            Some(b"req:1".to_vec()),
        )
        .expect("posted");
    assert_eq!(submitter.last_prepared().runs, count, "no pair merged");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    let rail = &initiator.stats().rails[0].poller;
    assert!(rail.reprepared > 0, "no slice was re-prepared: {rail:?}");
    assert!(initiator.stats().control.reconnects >= 1);
    for page in 0..count {
        let there = (count - 1 - page) * PAGE as usize;
        assert_eq!(
            destination.read(there, PAGE as usize),
            source.read(page * PAGE as usize, PAGE as usize),
            "page {page}"
        );
    }
    // After every byte, once.
    let notes = notifications_from(&target, "prefill-prepared", Duration::from_millis(300));
    assert_eq!(notes, vec![b"req:1".to_vec()]);

    // The same lists on the new queue pair (a new epoch): reads back into the source.
    source.fill(POISON);
    let batch = submitter
        .submit_prepared(
            Op::Read,
            &local,
            &local_indices,
            &remote,
            &remote_indices,
            None,
        )
        .expect("posted again");
    assert!(
        wait_done(&batch)
            .iter()
            .all(|o| *o == Some(RequestOutcome::Done))
    );
    for page in 0..count {
        let there = (count - 1 - page) * PAGE as usize;
        assert_eq!(
            source.read(page * PAGE as usize, PAGE as usize),
            destination.read(there, PAGE as usize),
            "page {page} read back"
        );
    }
}

#[test]
fn contiguous_pairs_merge_into_one_request_unless_asked_not_to() {
    let target = one_rail_engine("decode-merge", FabricChoice::Soft);
    let initiator = one_rail_engine("prefill-merge", FabricChoice::Soft);
    let destination = Buffer::new(POISON);
    destination.register(&target);
    let source = Buffer::new(PATTERN);
    numbered(&source);
    source.register(&initiator);
    let peer = open(&initiator, &target);
    let local = initiator.prepare_local(&pages(&source)).expect("local");
    let remote = peer.prepare(&pages(&destination)).expect("remote");
    let mut submitter = initiator.submitter().expect("submitter");
    let slices = |engine: &Engine| engine.stats().peers.iter().map(|p| p.slices).sum::<u64>();

    // 32 pages in order, contiguous on both sides: one run, split only at the slice size
    // (64 KiB: 2 slices).
    let indices: Vec<usize> = (0..32).collect();
    let before = slices(&initiator);
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    let posted = submitter.last_prepared();
    assert_eq!((posted.pairs, posted.runs, posted.slices), (32, 1, 2));
    assert_eq!(posted.bytes, 32 * PAGE);
    assert_eq!(slices(&initiator) - before, 32 * PAGE / BLOCK);
    assert_eq!(
        destination.read(0, 32 * PAGE as usize),
        source.read(0, 32 * PAGE as usize)
    );

    // The same pairs, merging refused: a run and a slice each.
    destination.fill(POISON);
    let before = slices(&initiator);
    let options = PostOptions {
        merge: false,
        ..PostOptions::default()
    };
    let batch = submitter
        .submit_prepared_with(Op::Write, &local, &indices, &remote, &indices, &options)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    let posted = submitter.last_prepared();
    assert_eq!((posted.runs, posted.slices), (32, 32));
    assert_eq!(slices(&initiator) - before, 32);
    assert_eq!(
        destination.read(0, 32 * PAGE as usize),
        source.read(0, 32 * PAGE as usize)
    );

    // Contiguous locally only (remote pages 0, 2, 4…): nothing merges.
    let every_other: Vec<usize> = (0..32).map(|i| i * 2).collect();
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &every_other, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    assert_eq!(submitter.last_prepared().runs, 32);
    // Runs broken where the order breaks: 0..4 and 10..14 merge, each on its own.
    let local_runs = [0, 1, 2, 3, 10, 11, 12, 13];
    let batch = submitter
        .submit_prepared(Op::Write, &local, &local_runs, &remote, &local_runs, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    assert_eq!(submitter.last_prepared().runs, 2);
    // Contiguous on both sides but across two registered regions: never one slice.
    let split = Buffer::new(PATTERN);
    let half = split.len() / 2;
    // SAFETY: the buffer outlives the engines' use of it (the test ends first).
    let halves = [
        (split.addr() as *mut u8, half),
        ((split.addr() as *mut u8).wrapping_add(half), half),
    ];
    // SAFETY: as above.
    unsafe { initiator.register_many(&halves) }.expect("two regions");
    let across = initiator
        .prepare_local(&[
            (split.addr() + half as u64 - PAGE, PAGE),
            (split.addr() + half as u64, PAGE),
        ])
        .expect("local across");
    let batch = submitter
        .submit_prepared(Op::Write, &across, &[0, 1], &remote, &[0, 1], None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    assert_eq!(submitter.last_prepared().runs, 2);
    // The same on the remote side: two adjacent regions of the target.
    let target_split = Buffer::new(POISON);
    let target_halves = [
        (target_split.addr() as *mut u8, half),
        ((target_split.addr() as *mut u8).wrapping_add(half), half),
    ];
    // SAFETY: as above.
    unsafe { target.register_many(&target_halves) }.expect("two regions at the target");
    assert!(initiator.refresh_descriptor(&peer, Instant::now() + BOUND));
    let boundary = target_split.addr() + half as u64;
    let remote_across = peer
        .prepare(&[(boundary - PAGE, PAGE), (boundary, PAGE)])
        .expect("remote across");
    let batch = submitter
        .submit_prepared(Op::Write, &local, &[0, 1], &remote_across, &[0, 1], None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    assert_eq!(submitter.last_prepared().runs, 2);
    assert_eq!(
        target_split.read(half - PAGE as usize, 2 * PAGE as usize),
        source.read(0, 2 * PAGE as usize)
    );
}

#[test]
fn bad_indices_are_refused_before_anything_is_queued() {
    let target = one_rail_engine("decode-indices", FabricChoice::Soft);
    let initiator = one_rail_engine("prefill-indices", FabricChoice::Soft);
    let destination = Buffer::new(POISON);
    destination.register(&target);
    let source = Buffer::new(PATTERN);
    source.register(&initiator);
    let peer = open(&initiator, &target);
    let local = initiator.prepare_local(&pages(&source)).expect("local");
    // Remote descriptors twice as long as the local ones past the first 8.
    let mut ranges = pages(&destination)[..8].to_vec();
    ranges.push((destination.addr() + 8 * PAGE, 2 * PAGE));
    let remote = peer.prepare(&ranges).expect("remote");
    let mut submitter = initiator.submitter().expect("submitter");
    let posted = |initiator: &Engine| initiator.stats().rails[0].poller.posted;
    let before = posted(&initiator);

    let past = local.len();
    let error = submitter
        .submit_prepared(Op::Write, &local, &[0, 1, past], &remote, &[0, 1, 2], None)
        .expect_err("local index past the end");
    assert_eq!(
        error,
        TransferError::IndexOutOfRange {
            side: "local",
            position: 2,
            index: past,
            len: past
        }
    );
    assert!(
        error
            .to_string()
            .contains("local index 256 is outside its list of 256"),
        "{error}"
    );
    let error = submitter
        .submit_prepared(Op::Read, &local, &[0, 1], &remote, &[0, 9], None)
        .expect_err("remote index past the end");
    assert!(matches!(
        error,
        TransferError::IndexOutOfRange {
            side: "remote",
            index: 9,
            ..
        }
    ));
    let error = submitter
        .submit_prepared(Op::Write, &local, &[0, 1], &remote, &[0], None)
        .expect_err("unpaired");
    assert_eq!(
        error,
        TransferError::IndicesMismatch {
            local: 2,
            remote: 1
        }
    );
    let error = submitter
        .submit_prepared(Op::Write, &local, &[0, 1], &remote, &[0, 8], None)
        .expect_err("lengths differ");
    assert_eq!(
        error,
        TransferError::LengthMismatch {
            position: 1,
            local: PAGE,
            remote: 2 * PAGE
        }
    );
    // A local list is this engine's own.
    let foreign = target
        .prepare_local(&pages(&destination))
        .expect("target's list");
    let error = submitter
        .submit_prepared(Op::Write, &foreign, &[0], &remote, &[0], None)
        .expect_err("another engine's list");
    assert!(matches!(
        error,
        TransferError::ForeignList { side: "local", .. }
    ));
    // A remote list is of a peer as one engine opened it: the target's own view of the
    // initiator is not the initiator's.
    let back = open(&target, &initiator);
    let theirs = back
        .prepare(&pages(&source))
        .expect("the target's list of the initiator");
    let error = submitter
        .submit_prepared(Op::Write, &local, &[0], &theirs, &[0], None)
        .expect_err("another engine's remote list");
    assert!(
        matches!(error, TransferError::ForeignList { side: "remote", .. }),
        "{error}"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        posted(&initiator),
        before,
        "a refused submission posted something"
    );
    assert_eq!(
        destination.first_not(POISON),
        None,
        "a refused submission wrote"
    );

    // Preparing refuses what is not there.
    let outside = destination.addr() + destination.len() as u64;
    assert_eq!(
        peer.prepare(&[(destination.addr(), PAGE), (outside - 8, 16)])
            .expect_err("outside"),
        PrepareError::RemoteRange {
            index: 1,
            peer: "decode-indices".into(),
            addr: outside - 8,
            len: 16
        }
    );
    assert!(matches!(
        initiator.prepare_local(&[(source.addr(), 0)]),
        Err(PrepareError::Empty { index: 0 })
    ));
    assert!(matches!(
        initiator.prepare_local(&[(destination.addr(), PAGE)]),
        Err(PrepareError::LocalUnregistered { index: 0, .. })
    ));
}

#[test]
fn a_list_is_refused_after_its_memory_is_registered_anew_on_either_side() {
    let target = one_rail_engine("decode-generation", FabricChoice::Soft);
    let initiator = one_rail_engine("prefill-generation", FabricChoice::Soft);
    let destination = Buffer::new(POISON);
    let target_region = destination.register(&target);
    let source = Buffer::new(PATTERN);
    let source_region = source.register(&initiator);
    let peer = open(&initiator, &target);
    let local = initiator.prepare_local(&pages(&source)).expect("local");
    let remote = peer.prepare(&pages(&destination)).expect("remote");
    let mut submitter = initiator.submitter().expect("submitter");
    let indices: Vec<usize> = (0..16).collect();
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);

    // The target lets its memory go and registers the same range again: a new generation.
    target.deregister(target_region).expect("deregistered");
    destination.fill(POISON);
    destination.register(&target);
    // Posted before the initiator has heard of it: refused at the target, never landing.
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    let outcome = wait_done(&batch)[0];
    assert!(
        matches!(outcome, Some(RequestOutcome::Failed(_))),
        "a list of the old generation wrote into new memory: {outcome:?}"
    );
    assert_eq!(
        destination.first_not(POISON),
        None,
        "bytes landed in the new registration"
    );
    // The failure made the initiator ask for the target's descriptor again; ask once more
    // in case that answer is still on its way.
    let _ = initiator.refresh_descriptor(&peer, Instant::now() + Duration::from_secs(1));
    let error = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect_err("stale once the new descriptor is known");
    assert!(
        matches!(error, TransferError::StaleList { side: "remote", .. }),
        "{error}"
    );
    assert!(error.to_string().contains("registered anew"), "{error}");
    // Prepared again, it works.
    let remote = peer.prepare(&pages(&destination)).expect("remote again");
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);

    // The local side: re-registering (new keys) or deregistering the source makes the local
    // list stale.
    let renewed = initiator.reregister(source_region).expect("re-keyed");
    let error = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect_err("stale local list");
    assert!(
        matches!(error, TransferError::StaleList { side: "local", .. }),
        "{error}"
    );
    let local = initiator
        .prepare_local(&pages(&source))
        .expect("local again");
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
    initiator.deregister(renewed).expect("deregistered");
    assert!(matches!(
        submitter.submit_prepared(Op::Write, &local, &indices, &remote, &indices, None),
        Err(TransferError::StaleList { side: "local", .. })
    ));
}

#[test]
fn a_list_prepared_before_the_peer_revoked_this_engine_is_refused() {
    let target = one_rail_engine("decode-fenced", FabricChoice::Soft);
    let initiator = one_rail_engine("prefill-fenced", FabricChoice::Soft);
    let destination = Buffer::new(POISON);
    destination.register(&target);
    let source = Buffer::new(PATTERN);
    source.register(&initiator);
    let peer = open(&initiator, &target);
    let local = initiator.prepare_local(&pages(&source)).expect("local");
    let remote = peer.prepare(&pages(&destination)).expect("remote");
    let mut submitter = initiator.submitter().expect("submitter");
    let indices: Vec<usize> = (0..8).collect();
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);

    target.revoke(initiator.incarnation()).expect("fenced");
    destination.fill(POISON);
    // Until the initiator's next handshake tells it of the fence its posts fail (`Revoked`,
    // or the queue pair's end); from then on the list is refused.
    let deadline = Instant::now() + BOUND;
    let error = loop {
        assert!(Instant::now() < deadline, "the list was never refused");
        match submitter.submit_prepared(Op::Write, &local, &indices, &remote, &indices, None) {
            Ok(batch) => {
                let outcome = wait_done(&batch)[0];
                assert_ne!(outcome, Some(RequestOutcome::Done), "a fenced list wrote");
                if let Some(RequestOutcome::Failed(reason)) = outcome {
                    assert_ne!(reason, FailReason::Timeout);
                }
            }
            Err(error) => break error,
        }
    };
    assert!(
        matches!(error, TransferError::StaleList { side: "remote", .. }),
        "{error}"
    );
    assert!(error.to_string().contains("revoked"), "{error}");
    assert_eq!(
        destination.first_not(POISON),
        None,
        "bytes landed after the fence"
    );
    // A list prepared after the fence is new work: it lands.
    let remote = peer.prepare(&pages(&destination)).expect("remote again");
    let batch = submitter
        .submit_prepared(Op::Write, &local, &indices, &remote, &indices, None)
        .expect("posted");
    assert_eq!(wait_done(&batch), vec![Some(RequestOutcome::Done)]);
}

#[test]
fn register_many_registers_all_or_nothing_and_peers_see_every_range() {
    let target = one_rail_engine("decode-many", FabricChoice::Soft);
    let initiator = one_rail_engine("prefill-many", FabricChoice::Soft);
    let memory = Buffer::new(POISON);
    let base = memory.addr() as *mut u8;
    let block = BLOCK as usize;
    let ranges: Vec<(*mut u8, usize)> = (0..16)
        // SAFETY (of the pointer arithmetic): inside the 1 MiB buffer.
        .map(|i| (base.wrapping_add(i * block), block))
        .collect();
    // SAFETY: the buffer outlives both engines.
    let regions = unsafe { target.register_many(&ranges) }.expect("registered");
    assert_eq!(regions.len(), 16);
    for (region, &(ptr, len)) in regions.iter().zip(&ranges) {
        assert_eq!((region.addr, region.len), (ptr as u64, len as u64));
    }
    let peer = open(&initiator, &target);
    assert_eq!(
        peer.descriptor().regions.len(),
        16,
        "one descriptor holds them all"
    );
    // Again, with one range already registered and one twice: the same regions.
    let again = [ranges[3], ranges[3], ranges[5]];
    // SAFETY: as above.
    let answered = unsafe { target.register_many(&again) }.expect("the same regions");
    assert_eq!(answered, vec![regions[3], regions[3], regions[5]]);

    // All or nothing: a bad range anywhere registers none.
    let other = Buffer::new(POISON);
    let start = other.addr() as *mut u8;
    let half = other.len() / 2;
    let overlapping = [(start, half), (start.wrapping_add(half - 8), 16)];
    // SAFETY: as above.
    let error = unsafe { target.register_many(&overlapping) }.expect_err("overlap");
    assert!(
        matches!(error, MemoryError::RangesOverlap { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("of the same call"), "{error}");
    let unmapped = [
        (start, half),
        (std::ptr::dangling_mut::<u8>().wrapping_add(64), 64),
    ];
    // SAFETY: as above; the second range is refused before anything is registered.
    let error = unsafe { target.register_many(&unmapped) }.expect_err("not memory");
    assert!(
        matches!(error, MemoryError::NotHostMemory { .. }),
        "{error}"
    );
    let crossing = [(start, half), (base.wrapping_add(block / 2), block)];
    // SAFETY: as above.
    let error = unsafe { target.register_many(&crossing) }.expect_err("crosses a region");
    assert!(
        matches!(error, MemoryError::Overlaps { region, .. } if region == regions[0].id || region == regions[1].id),
        "{error}"
    );
    assert_eq!(
        target.regions().len(),
        16,
        "a refused call registered something"
    );
}
