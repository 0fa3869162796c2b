//! Seed 004 on real libfabric (`tcp;ofi_rxm`): a peer that keeps coming back as a new
//! endpoint (a new incarnation: a new address, so an address-vector insert, and later the
//! old entry's removal) a thousand times while two submitters keep WRITEs to it in flight on
//! a live poller. Nothing crashes, every request resolves exactly once within its bound, and
//! every WRITE reported done is found, byte for byte, in the memory of one of the peer's
//! incarnations.

#![cfg(not(loom))]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{BOUND, ENDPOINT, config};
use railyard_dataplane::fabric::ofi::{OfiConfig, OfiFabric, OfiPeer, OfiRail};
use railyard_dataplane::fabric::{Access, Fabric, Opcode};
use railyard_dataplane::{
    Command, Epoch, FailReason, PollerHandle, RepairCause, RequestOutcome, Slice, SliceSpec,
    Submitter,
};

/// Incarnations of the peer; `RAILYARD_OFI_INCARNATIONS` overrides (fewer under Valgrind).
fn incarnations() -> u64 {
    std::env::var("RAILYARD_OFI_INCARNATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000)
}
const BLOCK: usize = 4096;
/// Blocks of each incarnation's pool: half for each submitter.
const SLOTS: usize = 32;

fn rail(name: &str) -> Arc<OfiRail> {
    OfiRail::open(
        name,
        &OfiConfig {
            provider: "tcp;ofi_rxm".into(),
            domain: Some("lo".into()),
        },
    )
    .expect("libfabric's tcp;ofi_rxm provider on lo")
}

/// The live incarnations of the peer: epoch, rail, and the rail's poller side.
type Live = Arc<Mutex<Vec<(u64, Arc<OfiRail>, OfiFabric)>>>;

/// Where each epoch's incarnation keeps its pool: rkey and first byte.
type Placement = Arc<Mutex<HashMap<u64, (u32, u64)>>>;

/// The block submitter `who` writes as its `seq`-th request: a header naming both, then a
/// pattern derived from them.
fn block(who: u8, seq: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; BLOCK];
    bytes[0] = who;
    bytes[1..9].copy_from_slice(&seq.to_le_bytes());
    for (i, byte) in bytes.iter_mut().enumerate().skip(9) {
        *byte = (i as u64 ^ seq.wrapping_mul(31) ^ u64::from(who)) as u8;
    }
    bytes
}

#[test]
fn a_thousand_incarnations_while_writes_are_in_flight_lose_and_corrupt_nothing() {
    let initiator = rail("initiator");
    let placement: Placement = Arc::new(Mutex::new(HashMap::new()));
    let hook_placement = placement.clone();
    // The descriptor owner's part: a stale slice goes to the same slot of the incarnation
    // current now.
    let reprepare = move |slice: &mut Slice, current: Epoch, _: RepairCause| {
        let known = hook_placement.lock().expect("placement");
        let (Some(&(_, old_base)), Some(&(rkey, new_base))) =
            (known.get(&slice.epoch.get()), known.get(&current.get()))
        else {
            return Err(FailReason::PeerRestarted);
        };
        slice.remote_addr = new_base + (slice.remote_addr - old_base);
        slice.rkey = rkey;
        slice.epoch = current;
        Ok(())
    };
    let fabric = initiator.fabric().expect("the initiator's fabric");
    let limits = fabric.limits();
    assert!(limits.send_queue > 0);
    let poller = PollerHandle::spawn(config(), fabric, reprepare).expect("the poller starts");

    // Every incarnation: its rail (dropped when it goes) and its pool (kept to the end, to
    // find the blocks in).
    let pools: Arc<Mutex<Vec<Arc<Vec<u8>>>>> = Arc::new(Mutex::new(Vec::new()));
    let current = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Serves the live incarnations' progress (tcp;ofi_rxm moves data only then).
    let live: Live = Arc::new(Mutex::new(Vec::new()));

    // The incarnation that went last, whose regions are forgotten when the next one goes.
    let forgetting: Mutex<Option<(u64, Vec<u8>)>> = Mutex::new(None);
    let incarnate = |epoch: u64| {
        let target = rail(&format!("target-{epoch}"));
        let pool = Arc::new(vec![0u8; SLOTS * BLOCK]);
        // SAFETY: the pool lives (in `pools`) until the end of the test, after every rail.
        let region =
            unsafe { target.register(pool.as_ptr() as u64, pool.len() as u64, Access::ALL) }
                .expect("registered");
        initiator.learn_remote_regions(
            target.address(),
            epoch,
            [(region.rkey, region.addr, region.len, region.access)],
        );
        placement
            .lock()
            .expect("placement")
            .insert(epoch, (region.rkey, region.addr));
        pools.lock().expect("pools").push(pool);
        let fabric = target.fabric().expect("the target's fabric");
        initiator.stage(
            ENDPOINT,
            Epoch::new(epoch),
            OfiPeer {
                address: target.address().to_vec(),
                tag: 0,
            },
        );
        let mut live = live.lock().expect("live");
        live.push((epoch, target, fabric));
        // The previous incarnation goes at once, whatever was in flight to it. What the one
        // before it announced is forgotten now (the control plane forgets a peer once its
        // endpoints have retired, not while slices for it may still be posted).
        while live.len() > 1 {
            let (gone, rail, _) = live.remove(0);
            let mut forgetting = forgetting.lock().expect("forgetting");
            if let Some((epoch, address)) = forgetting.replace((gone, rail.address().to_vec())) {
                initiator.forget_remote_regions(&address, epoch);
            }
        }
    };

    std::thread::scope(|scope| {
        let serving = {
            let (live, stop) = (live.clone(), stop.clone());
            scope.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let mut moved = false;
                    for (_, _, fabric) in live.lock().expect("live").iter_mut() {
                        moved |= fabric.serve();
                    }
                    if !moved {
                        std::thread::yield_now();
                    }
                }
            })
        };
        incarnate(1);
        current.store(1, Ordering::Release);
        poller
            .send(Command::AddEndpoint {
                endpoint: ENDPOINT,
                epoch: Epoch::FIRST,
            })
            .expect("the poller runs");

        let submitters: Vec<_> = (0..2u8)
            .map(|who| {
                let (poller, placement, pools, current, stop, initiator) = (
                    &poller,
                    placement.clone(),
                    pools.clone(),
                    current.clone(),
                    stop.clone(),
                    &initiator,
                );
                scope.spawn(move || {
                    let source = vec![0u8; BLOCK * 4];
                    // SAFETY: `source` outlives the registration (the rail is dropped after
                    // the scope ends).
                    let local = unsafe {
                        initiator.register(source.as_ptr() as u64, source.len() as u64, Access::ALL)
                    }
                    .expect("registered");
                    let mut submitter = Submitter::new(&[poller], 64).expect("a submitter");
                    let (mut done, mut failed) = (0u64, 0u64);
                    let mut seq = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let epoch = current.load(Ordering::Acquire);
                        let Some(&(rkey, base)) = placement.lock().expect("placement").get(&epoch)
                        else {
                            continue;
                        };
                        // Four blocks per batch, each in a slot of its own.
                        let mut specs = Vec::new();
                        let mut expected = Vec::new();
                        for i in 0..4usize {
                            let bytes = block(who, seq);
                            let local_addr = local.addr + (i * BLOCK) as u64;
                            // SAFETY: `source` is ours and no request on it is in flight.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    bytes.as_ptr(),
                                    local_addr as *mut u8,
                                    BLOCK,
                                );
                            }
                            let slot = usize::from(who) * SLOTS / 2 + (seq as usize % (SLOTS / 2));
                            specs.push(SliceSpec {
                                rail: 0,
                                request: i as u32,
                                opcode: Opcode::Write,
                                local_addr,
                                lkey: local.lkey,
                                remote_addr: base + (slot * BLOCK) as u64,
                                rkey,
                                len: BLOCK as u32,
                                imm: 0,
                                endpoint: ENDPOINT,
                                epoch: Epoch::new(epoch),
                                generation: 0,
                            });
                            expected.push((slot, bytes));
                            seq += 1;
                        }
                        let batch = submitter
                            .submit(4, &specs, Instant::now() + Duration::from_secs(5))
                            .expect("submitted");
                        let status = batch.wait(Instant::now() + BOUND);
                        assert!(status.is_complete(), "a batch never resolved: {status:?}");
                        for (request, (slot, bytes)) in expected.iter().enumerate() {
                            match batch.outcome(request) {
                                Some(RequestOutcome::Done) => {
                                    done += 1;
                                    let pools = pools.lock().expect("pools");
                                    assert!(
                                        pools
                                            .iter()
                                            .any(|pool| pool[slot * BLOCK..][..BLOCK] == bytes[..]),
                                        "a WRITE reported done is in no incarnation's memory"
                                    );
                                }
                                Some(RequestOutcome::Failed(_)) => failed += 1,
                                None => panic!("request {request} resolved without an outcome"),
                            }
                        }
                    }
                    let _ = initiator.deregister(&local);
                    drop(source);
                    (done, failed)
                })
            })
            .collect();

        let started = Instant::now();
        let incarnations = incarnations();
        for epoch in 2..=incarnations {
            incarnate(epoch);
            current.store(epoch, Ordering::Release);
            poller
                .send(Command::BumpEpoch {
                    endpoint: ENDPOINT,
                    epoch: Epoch::new(epoch),
                })
                .expect("the poller runs");
            assert!(started.elapsed() < BOUND * 12, "churn too slow");
        }
        // Let the last incarnation carry some traffic, then stop.
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, Ordering::Relaxed);
        let mut totals = (0, 0);
        for submitter in submitters {
            let (done, failed) = submitter.join().expect("a submitter");
            totals.0 += done;
            totals.1 += failed;
        }
        serving.join().expect("the server");
        let counters = poller.counters();
        eprintln!(
            "{incarnations} incarnations in {:.1?}: {} writes done, {} failed; {} re-prepared, \
             {} stale dropped",
            started.elapsed(),
            totals.0,
            totals.1,
            counters.reprepared,
            counters.stale_dropped
        );
        assert!(totals.0 > 0, "some writes got through");
        assert_eq!(
            counters.ignored_completions, 0,
            "a completion arrived twice"
        );
        assert_eq!(
            initiator.known_peers(),
            2,
            "only the last two incarnations' regions are kept"
        );
        // tcp;ofi_rxm 1.17 now and then never completes a write whose target endpoint went
        // away around its connection (7 of ~8 000 in one run; not reproduced alone, and rxm
        // cannot cancel RMA): the poller resolves those after their deadline and flush grace
        // (`unflushed`). They must stay rare.
        assert!(
            counters.unflushed * 100 <= totals.0.max(100),
            "{} requests were never handed back",
            counters.unflushed
        );
    });
    poller.shutdown();
}
