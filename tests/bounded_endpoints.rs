//! Queue pairs per rail are bounded (`Policy::max_endpoints_per_rail`): an initiator with
//! room for one queue pair talks to three targets on the soft fabric. Idle endpoints are
//! parked to make room and woken by the next transfer to them; busy ones are never parked;
//! every byte arrives and no transfer fails because of an eviction.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, PoisonError, RwLock};
use std::thread;
use std::time::Instant;

use common::BOUND;
use common::mapped::{BLOCK, Buffer, POISON, one_rail_engine, open};
use railyard::control::Policy;
use railyard::engine::{Engine, FabricChoice, Op, Transfer};

/// The sabotage test switches a process-wide protection off: it runs alone.
static SABOTAGE: RwLock<()> = RwLock::new(());

fn capped_initiator(name: &str, fabric: FabricChoice, cap: usize) -> Engine {
    Engine::builder(name)
        .fabric(fabric)
        .rails(railyard::engine::RailChoice::Count(
            std::num::NonZeroUsize::new(1).expect("one"),
        ))
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .slice_size(BLOCK as usize)
        .policy(Policy {
            max_endpoints_per_rail: cap,
            ..Policy::default()
        })
        .build()
        .expect("the engine starts")
}

/// `count` target engines named after `name`, each with a registered buffer of
/// [`POISON`].
fn targets(name: &str, fabric: FabricChoice, count: usize) -> (Vec<Engine>, Vec<Buffer>) {
    let targets: Vec<Engine> = (0..count)
        .map(|t| one_rail_engine(&format!("decode-{name}-{t}"), fabric))
        .collect();
    let destinations = targets
        .iter()
        .map(|target| {
            let buffer = Buffer::new(POISON);
            buffer.register(target);
            buffer
        })
        .collect();
    (targets, destinations)
}

/// The bytes of block `round` to target `target`.
fn pattern(target: usize, round: usize) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|i| (i * 31 + target * 7 + round * 13) as u8)
        .collect()
}

#[test]
fn one_queue_pair_serves_three_targets_and_nothing_fails() {
    let _shared = SABOTAGE.read().unwrap_or_else(PoisonError::into_inner);
    let (targets, destinations) = targets("capped", FabricChoice::Soft, 3);
    let initiator = capped_initiator("prefill-capped", FabricChoice::Soft, 1);
    let source = Buffer::new(0);
    let local = source.register(&initiator);
    let peers: Vec<_> = targets
        .iter()
        .map(|target| open(&initiator, target))
        .collect();

    let mut submitter = initiator.submitter().expect("submitter");
    for round in 0..12 {
        for (t, peer) in peers.iter().enumerate() {
            let slot = (round * 3 + t) % 16;
            source.write(slot * BLOCK as usize, &pattern(t, round));
            let batch = submitter
                .submit(
                    peer,
                    &[Transfer {
                        op: Op::Write,
                        local,
                        local_offset: slot as u64 * BLOCK,
                        remote_addr: destinations[t].addr() + slot as u64 * BLOCK,
                        len: BLOCK,
                    }],
                )
                .expect("submits");
            let status = batch.wait(Instant::now() + BOUND);
            assert!(
                status.is_complete() && status.failed == 0,
                "round {round} to target {t}: {:?}",
                batch.outcomes()
            );
            assert_eq!(
                destinations[t].read(slot * BLOCK as usize, BLOCK as usize),
                pattern(t, round),
                "round {round} to target {t}"
            );
        }
    }
    let control = initiator.stats().control;
    // Each round moves the one queue pair around the three targets.
    assert!(control.evictions >= 30, "{control:?}");
    assert!(control.wakes >= 30, "{control:?}");
}

/// Two threads keep transfers going to two targets through an initiator with room for one
/// queue pair: (transfers failed, evictions).
fn two_busy_threads(name: &str, fabric: FabricChoice) -> (u64, u64) {
    let (targets, destinations) = targets(name, fabric, 2);
    let initiator = capped_initiator(&format!("prefill-{name}"), fabric, 1);
    let source = Buffer::new(0xc3);
    let local = source.register(&initiator);
    let peers: Vec<_> = targets
        .iter()
        .map(|target| open(&initiator, target))
        .collect();
    let start = Barrier::new(2);
    let failed = AtomicU64::new(0);
    thread::scope(|scope| {
        for (t, peer) in peers.iter().enumerate() {
            let (initiator, destination, start, failed) =
                (&initiator, &destinations[t], &start, &failed);
            scope.spawn(move || {
                let mut submitter = initiator.submitter().expect("submitter");
                start.wait();
                for round in 0..40u64 {
                    let slot = round % 16;
                    // Eight blocks per batch: the endpoint is busy for a while each time.
                    let transfers: Vec<Transfer> = (0..8)
                        .map(|block| Transfer {
                            op: Op::Write,
                            local,
                            local_offset: block * BLOCK,
                            remote_addr: destination.addr() + ((slot + block) % 16) * BLOCK,
                            len: BLOCK,
                        })
                        .collect();
                    // One thread's transfer may wait for the other's idle moment.
                    let batch = submitter
                        .submit_by(peer, &transfers, Instant::now() + BOUND)
                        .expect("submits");
                    let status = batch.wait(Instant::now() + BOUND);
                    assert!(status.is_complete(), "target {t} round {round}: {status:?}");
                    failed.fetch_add(status.failed as u64, Ordering::Relaxed);
                }
            });
        }
    });
    let failed = failed.load(Ordering::Relaxed);
    if failed == 0 {
        for destination in &destinations {
            assert_eq!(
                destination.read(0, 16 * BLOCK as usize),
                vec![0xc3; 16 * BLOCK as usize]
            );
        }
    }
    (failed, initiator.stats().control.evictions)
}

/// A busy endpoint refuses to be parked, so each thread waits for the other's idle moments;
/// both finish every transfer.
#[test]
fn busy_endpoints_are_never_parked_under_them() {
    let _shared = SABOTAGE.read().unwrap_or_else(PoisonError::into_inner);
    for fabric in [FabricChoice::Soft, FabricChoice::Tcp] {
        let (failed, evictions) = two_busy_threads("busy", fabric);
        assert_eq!(failed, 0);
        assert!(evictions > 0);
    }
}

/// The same with the poller's idle check switched off: endpoints are parked with work in
/// flight, and that work fails.
#[cfg(feature = "sabotage")]
#[test]
fn without_the_idle_check_evictions_fail_transfers() {
    use railyard::dataplane::sabotage::{self, Protection};

    let _alone = SABOTAGE.write().unwrap_or_else(PoisonError::into_inner);
    let _off = sabotage::turn_off(Protection::IdleEviction);
    // On TCP, work is in flight until the target answers: parking under it fails it.
    let (failed, evictions) = two_busy_threads("sabotaged", FabricChoice::Tcp);
    assert!(evictions > 0);
    assert!(
        failed > 0,
        "nothing failed although busy endpoints were parked"
    );
}
