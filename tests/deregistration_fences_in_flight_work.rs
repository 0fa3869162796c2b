//! Deregistration under load: once `Engine::deregister` returns, nothing reads or writes the
//! region any more — not this engine's pollers, not a peer.
//!
//! Two engines in this process, over the soft fabric (the peer copies itself, through
//! `process_vm_writev` or a plain copy) and over TCP (the target's poller receives the
//! payload into the region). One thread writes into the target's buffers without pause, one
//! reads them into a local buffer; the main thread deregisters one of the target's two
//! buffers (in turn) and the local one, 500 times each, fills each with a poison byte the
//! moment `deregister` returns, and checks a little later that the poison is whole, before
//! registering it again; every 25 cycles it waits until transfers succeed again. Every batch
//! must resolve.

mod common;

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use common::BOUND;
use common::mapped::{Buffer, Load, PATTERN, POISON, one_rail_engine, open};
use railyard::engine::{Engine, FabricChoice, Op, Region};

const CYCLES: usize = 500;
/// Every this many cycles, wait until transfers move bytes again.
const RECOVER_EVERY: usize = 25;

/// Deregisters `region` of `buffer`, poisons the buffer at once, and checks the poison a
/// little later; returns the region registered again.
fn cycle(engine: &Engine, buffer: &Buffer, region: Region, what: &str, round: usize) -> Region {
    engine
        .deregister(region)
        .unwrap_or_else(|error| panic!("deregistering the {what}: {error}"));
    buffer.fill(POISON);
    thread::sleep(Duration::from_micros(300));
    if let Some(at) = buffer.first_not(POISON) {
        panic!(
            "round {round}: a byte landed in the {what} at offset {at} after deregister returned"
        );
    }
    buffer.fill(PATTERN);
    buffer.register(engine)
}

fn deregistration_under_load(fabric: FabricChoice) {
    let target = one_rail_engine("decode-dereg", fabric);
    let initiator = one_rail_engine("prefill-dereg", fabric);
    // Two target buffers, cycled in turn: the peer's description always has one.
    let target_buffers = [Buffer::new(PATTERN), Buffer::new(PATTERN)];
    let source = Buffer::new(PATTERN);
    let sink = Buffer::new(PATTERN);
    let mut target_regions = target_buffers
        .each_ref()
        .map(|buffer| buffer.register(&target));
    let source_region = Mutex::new(Some(source.register(&initiator)));
    let sink_region = Mutex::new(Some(sink.register(&initiator)));
    let peer = open(&initiator, &target);
    let load = Load::default();
    thread::scope(|scope| {
        let _stop = load.stop_on_drop();
        scope.spawn(|| load.run(&initiator, &peer, Op::Write, &source_region));
        scope.spawn(|| load.run(&initiator, &peer, Op::Read, &sink_region));
        for round in 0..CYCLES {
            // Transfers recover after re-registrations (a refreshed description, a new queue
            // pair): now and then wait for one more success, so deregistrations keep racing
            // transfers that really move bytes.
            let before = load.succeeded();
            let end = Instant::now() + BOUND;
            while round % RECOVER_EVERY == 0 && load.succeeded() == before {
                assert!(
                    Instant::now() < end,
                    "round {round}: transfers never recovered"
                );
                thread::sleep(Duration::from_micros(200));
            }
            let turn = round % 2;
            target_regions[turn] = cycle(
                &target,
                &target_buffers[turn],
                target_regions[turn],
                "target's buffer",
                round,
            );
            let region = sink_region
                .lock()
                .expect("lock")
                .take()
                .expect("registered");
            let again = cycle(&initiator, &sink, region, "local READ buffer", round);
            *sink_region.lock().expect("lock") = Some(again);
        }
    });
    assert!(
        load.succeeded() > 0,
        "no transfer ran at all: the test proved nothing"
    );
    drop(initiator);
    drop(target);
}

/// A stress check of the whole path; the fences it relies on are caught deterministically by
/// `quiesce_waits_for_the_round_in_progress` (pollers) and the soft fence's unit test.
#[test]
fn nothing_lands_after_deregister_returns_on_the_soft_fabric() {
    deregistration_under_load(FabricChoice::Soft);
}

#[test]
fn nothing_lands_after_deregister_returns_on_the_tcp_fabric() {
    deregistration_under_load(FabricChoice::Tcp);
}
