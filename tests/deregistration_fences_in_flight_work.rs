//! Deregistration under load: once `Engine::deregister` returns, nothing reads or writes the
//! region any more — not this engine's pollers, not a peer.
//!
//! Two engines in this process, over the soft fabric (the peer copies itself, through
//! `process_vm_writev` or a plain copy) and over TCP (the target's poller receives the
//! payload into the region). One thread writes into the target's buffer without pause, one
//! reads the target's bytes into a local buffer; the main thread deregisters the target's
//! buffer and the local one again and again, fills each with a poison byte the moment
//! `deregister` returns, and checks a little later that the poison is whole, before
//! registering it again. Every batch must resolve.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::mapped::{Buffer, PATTERN, POISON, keep_moving, one_rail_engine};
use railyard::engine::{Engine, FabricChoice, Op, Region};

const CYCLES: usize = 400;

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
    let target_buffer = Buffer::new(PATTERN);
    let source = Buffer::new(PATTERN);
    let sink = Buffer::new(PATTERN);
    let mut target_region = target_buffer.register(&target);
    let source_region = Arc::new(Mutex::new(Some(source.register(&initiator))));
    let sink_region = Arc::new(Mutex::new(Some(sink.register(&initiator))));
    let peer = initiator
        .open(&target.addr().to_string())
        .expect("the target answers");
    let stop = AtomicBool::new(false);
    let resolved = AtomicU64::new(0);
    thread::scope(|scope| {
        scope.spawn(|| {
            keep_moving(
                &initiator,
                &peer,
                Op::Write,
                &source_region,
                &stop,
                &resolved,
            )
        });
        scope.spawn(|| keep_moving(&initiator, &peer, Op::Read, &sink_region, &stop, &resolved));
        for round in 0..CYCLES {
            target_region = cycle(
                &target,
                &target_buffer,
                target_region,
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
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        resolved.load(Ordering::Relaxed) > 0,
        "no transfer ran at all: the test proved nothing"
    );
    drop(initiator);
    drop(target);
}

/// Caught (soft fabric, before the fence): bytes of a peer's `process_vm_writev` that had
/// passed the key check landed after `deregister` returned.
#[test]
fn nothing_lands_after_deregister_returns_on_the_soft_fabric() {
    deregistration_under_load(FabricChoice::Soft);
}

#[test]
fn nothing_lands_after_deregister_returns_on_the_tcp_fabric() {
    deregistration_under_load(FabricChoice::Tcp);
}
