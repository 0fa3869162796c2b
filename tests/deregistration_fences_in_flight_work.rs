//! Deregistration under load: once `Engine::deregister` returns, nothing submitted before it
//! reads or writes that memory any more — not this engine's pollers, not a peer, and not
//! after the same memory is registered again at the same address (a new generation that
//! peers' retries must never reach).
//!
//! Two engines in this process, over the soft fabric (the peer copies itself, through
//! `process_vm_writev` or a plain copy), over TCP (the target's poller receives the payload
//! into the region) and over libfabric (`tcp;ofi_rxm`). One thread writes tagged blocks into
//! the target's buffers without pause (each block carries its write's sequence number), one
//! reads them into a local buffer; the main thread deregisters one of the target's two
//! buffers (in turn) and the local one, fills each with a poison byte the moment `deregister`
//! returns and registers it again at once. A tag from before a buffer's last deregistration
//! seen in it afterwards fails the test, however long after; so does a byte in the local
//! buffer while it is withdrawn. Every few cycles it waits until writes submitted after the
//! fence land. Every batch must resolve.

mod common;

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use common::BOUND;
use common::mapped::{Buffer, Load, PATTERN, POISON, one_rail_engine, open};
use common::tagged::TaggedLoad;
use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, Region};

/// Every this many cycles, wait until writes submitted since the last fence land.
const RECOVER_EVERY: usize = 50;

/// Deregisters the local READ buffer's `region`, poisons the buffer at once, and checks the
/// poison a little later; returns the region registered again.
fn cycle_local(engine: &Engine, buffer: &Buffer, region: Region, round: usize) -> Region {
    engine
        .deregister(region)
        .unwrap_or_else(|error| panic!("deregistering the local READ buffer: {error}"));
    buffer.fill(POISON);
    thread::sleep(Duration::from_micros(300));
    if let Some(at) = buffer.first_not(POISON) {
        panic!(
            "round {round}: a byte landed in the local READ buffer at offset {at} after \
             deregister returned"
        );
    }
    buffer.fill(PATTERN);
    buffer.register(engine)
}

fn deregistration_under_load(target: Engine, initiator: Engine, cycles: usize) {
    // Two target buffers, cycled in turn: the peer's description always has one.
    let target_buffers = [Buffer::new(POISON), Buffer::new(POISON)];
    let source = Buffer::new(PATTERN);
    let sink = Buffer::new(PATTERN);
    let mut target_regions = target_buffers
        .each_ref()
        .map(|buffer| buffer.register(&target));
    let source_region = source.register(&initiator);
    let sink_region = Mutex::new(Some(sink.register(&initiator)));
    let peer = open(&initiator, &target);
    let writes = TaggedLoad::default();
    let reads = Load::default();
    // Per target buffer: no write submitted before this may be in it.
    let mut fenced_below = [0u64; 2];
    let check = |fenced_below: &[u64; 2], round: usize| {
        for (turn, buffer) in target_buffers.iter().enumerate() {
            if let Some((at, seq)) = writes.stale_write(buffer, POISON, fenced_below[turn]) {
                panic!(
                    "round {round}: write {seq}, submitted before target buffer {turn} was \
                     deregistered (below {}), landed in it at offset {at}",
                    fenced_below[turn]
                );
            }
        }
    };
    thread::scope(|scope| {
        let _stop_writes = writes.stop_on_drop();
        let _stop_reads = reads.stop_on_drop();
        scope.spawn(|| writes.run(&initiator, &peer, &source, source_region));
        scope.spawn(|| reads.run(&initiator, &peer, Op::Read, &sink_region));
        for round in 0..cycles {
            check(&fenced_below, round);
            if round % RECOVER_EVERY == 0 {
                // Writes recover after re-registrations (a refreshed description): wait for
                // one from after the last fence, so deregistrations keep racing transfers
                // that really move bytes.
                let since = writes.allocated();
                let end = Instant::now() + BOUND;
                while !target_buffers
                    .iter()
                    .any(|buffer| writes.landed_since(buffer, POISON, since))
                {
                    assert!(
                        Instant::now() < end,
                        "round {round}: writes never recovered"
                    );
                    thread::sleep(Duration::from_micros(200));
                }
            }
            let turn = round % 2;
            let before = writes.submitted();
            target
                .deregister(target_regions[turn])
                .unwrap_or_else(|error| panic!("deregistering target buffer {turn}: {error}"));
            target_buffers[turn].fill(POISON);
            fenced_below[turn] = before;
            // The same memory, registered again at once: a new generation.
            target_regions[turn] = target_buffers[turn].register(&target);
            let region = sink_region
                .lock()
                .expect("lock")
                .take()
                .expect("registered");
            let again = cycle_local(&initiator, &sink, region, round);
            *sink_region.lock().expect("lock") = Some(again);
        }
        // Retries run within a reconnect and a descriptor refresh: look once more after them.
        thread::sleep(Duration::from_millis(100));
        check(&fenced_below, cycles);
    });
    assert!(
        writes.succeeded() > 0 && reads.succeeded() > 0,
        "no transfer ran at all: the test proved nothing"
    );
    assert!(
        writes.withdrawn() > 0,
        "no write was caught by a deregistration: the test proved nothing ({} succeeded, \
         {} failed otherwise)",
        writes.succeeded(),
        writes.other_failures()
    );
    drop(initiator);
    drop(target);
}

/// A stress check of the whole path; the fences it relies on are caught deterministically by
/// `quiesce_waits_for_the_round_in_progress` (pollers) and the soft fence's unit test.
#[test]
fn nothing_submitted_before_deregister_lands_after_it_on_the_soft_fabric() {
    deregistration_under_load(
        one_rail_engine("decode-dereg", FabricChoice::Soft),
        one_rail_engine("prefill-dereg", FabricChoice::Soft),
        2000,
    );
}

#[test]
fn nothing_submitted_before_deregister_lands_after_it_on_the_tcp_fabric() {
    deregistration_under_load(
        one_rail_engine("decode-dereg", FabricChoice::Tcp),
        one_rail_engine("prefill-dereg", FabricChoice::Tcp),
        2000,
    );
}

#[test]
fn nothing_submitted_before_deregister_lands_after_it_on_libfabric() {
    let build = |name: &str| {
        Engine::builder(name)
            .fabric(FabricChoice::Ofi)
            .ofi("tcp;ofi_rxm")
            .rails(RailChoice::Count(1.try_into().expect("one")))
            .idle(IdleStrategy::gentle())
            .slice_size(common::mapped::BLOCK as usize)
            .build()
            .expect("the engine starts on libfabric's tcp provider")
    };
    deregistration_under_load(build("decode-dereg-ofi"), build("prefill-dereg-ofi"), 300);
}
