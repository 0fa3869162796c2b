//! What the Python binding stands on, through the Rust API: registration by address (the
//! same range twice is one region, an overlapping other range is refused, memory that is
//! not this process's is refused), transfers named by raw addresses, a descriptor fetched
//! again when a remote range is new, peers cached by session string and reopened when
//! replaced, the advertised address, waiting for notifications, and a submitter pool many
//! threads share.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mapped::{BUFFER, Buffer, one_rail_engine};
use common::{BOUND, bytes_of, done};
use railyard::control::NotificationBody;
use railyard::engine::{
    Engine, FabricChoice, MemoryError, Op, RawTransfer, SubmitterPool, TransferError,
};

fn engine(name: &str) -> Engine {
    one_rail_engine(name, FabricChoice::Soft)
}

#[test]
fn registering_a_range_twice_is_one_region_and_an_overlap_is_refused() {
    let engine = engine("registrar");
    let buffer = Buffer::new(0);
    let region = buffer.register(&engine);
    assert_eq!(
        buffer.register(&engine),
        region,
        "the same range is the same region"
    );
    assert_eq!(engine.regions(), [region]);

    let base = region.addr as *mut u8;
    // SAFETY: the range lies inside the test's live mapping; it is refused anyway.
    let inside = unsafe { engine.register(base.wrapping_add(4096), 4096) };
    assert!(
        matches!(inside, Err(MemoryError::Overlaps { region: id, .. }) if id == region.id),
        "{inside:?}"
    );
    assert_eq!(engine.region_at(region.addr + 4096, 4096), Some(region));
    assert_eq!(engine.region_at(region.addr + BUFFER as u64 - 1, 2), None);

    // Nothing is mapped at the first page; code is not writable.
    // SAFETY: refused before any rail sees it.
    let unmapped = unsafe { engine.register(0x1000 as *mut u8, 4096) };
    assert!(
        matches!(unmapped, Err(MemoryError::NotHostMemory { .. })),
        "{unmapped:?}"
    );
    let code = (one_rail_engine as fn(&str, FabricChoice) -> Engine) as *mut u8;
    // SAFETY: refused before any rail sees it.
    let code = unsafe { engine.register(code, 64) };
    assert!(
        matches!(code, Err(MemoryError::NotHostMemory { .. })),
        "{code:?}"
    );

    engine.deregister(region).expect("deregisters");
    assert!(engine.regions().is_empty());
    let again = buffer.register(&engine);
    assert_ne!(
        again.id, region.id,
        "a new registration after deregistering"
    );
}

#[test]
fn raw_transfers_resolve_their_regions_and_an_unregistered_range_queues_nothing() {
    let target = engine("raw-target");
    let initiator = engine("raw-initiator");
    let pool = target.alloc(1 << 20, None).expect("allocates");
    let source = initiator.alloc(1 << 20, None).expect("allocates");
    let back = initiator.alloc(1 << 20, None).expect("allocates");
    for (i, byte) in bytes_of(source).iter_mut().enumerate() {
        *byte = (i % 241) as u8;
    }
    let peer = initiator
        .peer(&target.addr().to_string())
        .expect("the target answers");
    let mut submitter = initiator.submitter().expect("a submitter");
    let deadline = || Instant::now() + BOUND;
    // Eight scattered 64 KiB blocks, named by address only.
    let writes: Vec<RawTransfer> = (0..8u64)
        .map(|i| RawTransfer {
            op: Op::Write,
            local_addr: source.addr + i * (64 << 10),
            remote_addr: pool.addr + ((i * 5) % 16) * (64 << 10),
            len: 64 << 10,
        })
        .collect();
    assert!(done(
        &submitter.submit_raw(&peer, &writes, deadline()).unwrap()
    ));
    let reads: Vec<RawTransfer> = writes
        .iter()
        .map(|write| RawTransfer {
            op: Op::Read,
            local_addr: back.addr + (write.local_addr - source.addr),
            ..*write
        })
        .collect();
    assert!(done(
        &submitter.submit_raw(&peer, &reads, deadline()).unwrap()
    ));
    assert_eq!(&bytes_of(back)[..8 << 16], &bytes_of(source)[..8 << 16]);

    // One range reaching past its region: the whole batch is refused, nothing moves.
    bytes_of(pool).fill(0x77);
    let mut bad = writes.clone();
    bad[5].local_addr = source.addr + (1 << 20) - 100;
    let refused = submitter.submit_raw(&peer, &bad, deadline());
    assert!(
        matches!(
            refused,
            Err(TransferError::LocalUnregistered { transfer: 5, .. })
        ),
        "{refused:?}"
    );
    assert!(
        bytes_of(pool).iter().all(|&b| b == 0x77),
        "a refused batch wrote"
    );
    let stats = initiator.stats();
    assert_eq!(
        stats.peers[0].requests(),
        16,
        "only the two good batches counted"
    );
}

#[test]
fn a_region_the_target_registers_after_the_open_is_found_by_fetching_its_descriptor() {
    let target = engine("late-target");
    let initiator = engine("late-initiator");
    let source = initiator.alloc(64 << 10, None).expect("allocates");
    bytes_of(source).fill(0x3c);
    let peer = initiator
        .peer(&target.addr().to_string())
        .expect("the target answers");
    assert!(peer.descriptor().regions.is_empty());
    // Registered after the initiator fetched the descriptor.
    let late = target.alloc(1 << 20, None).expect("allocates");
    let mut submitter = initiator.submitter().expect("a submitter");
    let write = [RawTransfer {
        op: Op::Write,
        local_addr: source.addr,
        remote_addr: late.addr + 4096,
        len: 64 << 10,
    }];
    let batch = submitter
        .submit_raw(&peer, &write, Instant::now() + BOUND)
        .expect("the descriptor is fetched again and names the new region");
    assert!(done(&batch));
    assert!(
        bytes_of(late)[4096..4096 + (64 << 10)]
            .iter()
            .all(|&b| b == 0x3c)
    );

    // A range no region of the target holds is refused after one fetch, not waited on.
    let began = Instant::now();
    let nowhere = [RawTransfer {
        remote_addr: 0x10,
        ..write[0]
    }];
    let refused = submitter.submit_raw(&peer, &nowhere, Instant::now() + BOUND);
    assert!(
        matches!(refused, Err(TransferError::RemoteRange { .. })),
        "{refused:?}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn a_session_is_opened_once_and_reopened_when_the_process_there_is_replaced() {
    let initiator = engine("sessions-initiator");
    let first = engine("sessions-target");
    let session = first.addr().to_string();
    let peer = initiator.peer(&session).expect("opens");
    let again = initiator.peer(&session).expect("cached");
    assert_eq!(again.incarnation(), peer.incarnation());
    assert_eq!(
        initiator.stats().control.active_qps,
        1,
        "one queue pair, not two"
    );

    // Another engine takes the address over once the first is gone.
    let addr = first.addr();
    drop(first);
    let heir = Engine::builder("sessions-heir")
        .listen(addr)
        .rails(railyard::engine::RailChoice::Count(
            std::num::NonZeroUsize::new(1).expect("one"),
        ))
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .build()
        .expect("the heir takes the port");
    let until = Instant::now() + BOUND;
    let reopened = loop {
        match initiator.peer(&session) {
            Ok(peer) if peer.incarnation() == heir.incarnation() => break peer,
            _ => {
                assert!(Instant::now() < until, "the session was not reopened");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert_eq!(reopened.name(), "sessions-heir");
}

#[test]
fn a_listener_on_every_address_advertises_one_peers_can_reach() {
    let any = Engine::builder("advertised")
        .listen("0.0.0.0:0".parse().expect("address"))
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .build()
        .expect("starts");
    assert!(!any.addr().ip().is_unspecified(), "{}", any.addr());
    let initiator = engine("advertised-initiator");
    let peer = initiator
        .peer(&any.addr().to_string())
        .expect("reachable at the advertised address");
    assert_eq!(peer.name(), "advertised");

    let chosen = Engine::builder("chosen")
        .listen("0.0.0.0:0".parse().expect("address"))
        .advertise("127.0.0.1".parse().expect("address"))
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .build()
        .expect("starts");
    assert_eq!(chosen.addr().ip().to_string(), "127.0.0.1");
    let described = initiator
        .peer(&chosen.addr().to_string())
        .expect("reachable at the advertised address")
        .descriptor();
    assert_eq!(described.handshake_addr, chosen.addr().to_string());
}

#[test]
fn waiting_for_notifications_returns_the_first_with_its_sender_or_nothing_at_the_deadline() {
    let receiver = engine("notified");
    let sender = engine("notifier");
    let began = Instant::now();
    assert!(
        receiver
            .wait_notifications(Instant::now() + Duration::from_millis(100))
            .is_empty()
    );
    assert!(began.elapsed() >= Duration::from_millis(100));

    let peer = sender.peer(&receiver.addr().to_string()).expect("answers");
    let waiter = {
        let receiver = receiver.clone();
        std::thread::spawn(move || receiver.wait_notifications(Instant::now() + BOUND))
    };
    std::thread::sleep(Duration::from_millis(50));
    sender
        .notify(&peer, b"layer 7 done".to_vec())
        .expect("sent");
    let got = waiter.join().expect("the waiter returns");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].from, "notifier");
    assert_eq!(
        got[0].body,
        NotificationBody::Bytes(b"layer 7 done".to_vec())
    );
}

#[test]
fn a_submitter_pool_serves_many_threads_with_every_byte_in_place() {
    const THREADS: u64 = 8;
    const BLOCKS: u64 = 16;
    let target = engine("pool-target");
    let initiator = engine("pool-initiator");
    let pool = target
        .alloc(THREADS * BLOCKS * 4096, None)
        .expect("allocates");
    let source = initiator
        .alloc(THREADS * BLOCKS * 4096, None)
        .expect("allocates");
    for (i, byte) in bytes_of(source).iter_mut().enumerate() {
        *byte = (i / 4096) as u8 ^ (i % 7) as u8;
    }
    let session = target.addr().to_string();
    let submitters = Arc::new(SubmitterPool::new(initiator.clone()));
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (submitters, initiator, session) =
                (submitters.clone(), initiator.clone(), session.clone());
            std::thread::spawn(move || {
                for round in 0..20 {
                    let peer = initiator.peer(&session).expect("the session");
                    let writes: Vec<RawTransfer> = (0..BLOCKS)
                        .map(|block| {
                            let at = (thread * BLOCKS + (block + round) % BLOCKS) * 4096;
                            RawTransfer {
                                op: Op::Write,
                                local_addr: source.addr + at,
                                remote_addr: pool.addr + at,
                                len: 4096,
                            }
                        })
                        .collect();
                    let batch = submitters
                        .with(|submitter| {
                            submitter.submit_raw(&peer, &writes, Instant::now() + BOUND)
                        })
                        .expect("a submitter")
                        .expect("submitted");
                    assert!(done(&batch));
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a submitting thread");
    }
    assert_eq!(bytes_of(pool), bytes_of(source));
    assert_eq!(
        initiator.stats().control.active_qps,
        1,
        "one queue pair for all threads"
    );
}

#[test]
fn a_session_that_failed_to_open_answers_with_that_failure_briefly_then_tries_again() {
    let initiator = engine("failing-initiator");
    let (_held, closed) = common::refusing_address();
    let session = closed.to_string();
    let first = initiator.peer(&session);
    assert!(
        matches!(first, Err(railyard::engine::PeerError::Unreachable { .. })),
        "{first:?}"
    );
    // Threads that were waiting behind that open are answered at once, not one by one.
    let began = Instant::now();
    let again = initiator.peer(&session);
    assert!(
        matches!(
            again,
            Err(railyard::engine::PeerError::RecentlyFailed { .. })
        ),
        "{again:?}"
    );
    assert!(began.elapsed() < Duration::from_millis(100));
    std::thread::sleep(railyard::engine::FAILED_OPEN_KEPT);
    let later = initiator.peer(&session);
    assert!(
        matches!(later, Err(railyard::engine::PeerError::Unreachable { .. })),
        "tried again after the pause: {later:?}"
    );
}
