//! A peer is an incarnation at an address, never a name or a port: two `railyard serve`
//! processes with one name are two peers under load; eight targets opened at once from
//! four threads, with every queue pair failing together again and again, each get only the
//! bytes meant for them; a process that takes over a dead peer's port gets nothing meant
//! for its predecessor.

mod common;

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::{BOUND, Serve, bytes_of, done};
use railyard::control::Policy;
use railyard::dataplane::IdleStrategy;
use railyard::dataplane::fabric::soft::{Fault, QpMatch};
use railyard::engine::{Engine, Op, Peer, RailChoice, Region, Transfer};

const BLOCK: u64 = 4096;

fn initiator(name: &str, policy: Policy) -> Engine {
    Engine::builder(name)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .slice_size(64 * 1024)
        .policy(policy)
        .build()
        .expect("the engine starts")
}

/// The byte at `offset` of a block written to target `target` by `writer` in `round`: the
/// first byte of every block names the target, so a block that landed in another target's
/// memory is caught.
fn pattern(target: usize, writer: usize, round: usize, offset: usize) -> u8 {
    if offset % BLOCK as usize == 0 {
        0xA0 | target as u8
    } else {
        (offset as u8)
            .wrapping_mul(31)
            .wrapping_add((writer * 7 + round * 13 + target) as u8)
    }
}

/// Writes `blocks` blocks of the pattern for (`target`, `writer`, `round`) from `source` to
/// `remote`, reads them back into `back` and compares.
#[allow(clippy::too_many_arguments)]
fn write_and_check(
    submitter: &mut railyard::engine::EngineSubmitter,
    peer: &Peer,
    (source, back): (Region, Region),
    remote: u64,
    blocks: u64,
    (target, writer, round): (usize, usize, usize),
) {
    let len = blocks * BLOCK;
    for (offset, byte) in bytes_of(source)[..len as usize].iter_mut().enumerate() {
        *byte = pattern(target, writer, round, offset);
    }
    let write = Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: remote,
        len,
    };
    let batch = submitter.submit(peer, &[write]).expect("submitted");
    assert!(
        done(&batch),
        "write to target {target}: {:?}",
        batch.outcomes()
    );
    let read = Transfer {
        op: Op::Read,
        local: back,
        ..write
    };
    let batch = submitter.submit(peer, &[read]).expect("submitted");
    assert!(
        done(&batch),
        "read from target {target}: {:?}",
        batch.outcomes()
    );
    assert!(
        bytes_of(back)[..len as usize] == bytes_of(source)[..len as usize],
        "target {target} round {round}: what was read back is not what was written"
    );
}

/// Reads `len` bytes at `remote` of `peer` and checks that every block names `target`.
fn assert_only_meant_for(engine: &Engine, peer: &Peer, remote: u64, len: u64, target: usize) {
    let back = engine.alloc(len, None).expect("memory");
    let mut submitter = engine.submitter().expect("a submitter");
    let read = Transfer {
        op: Op::Read,
        local: back,
        local_offset: 0,
        remote_addr: remote,
        len,
    };
    let batch = submitter.submit(peer, &[read]).expect("submitted");
    assert!(done(&batch), "{:?}", batch.outcomes());
    for (block, bytes) in bytes_of(back)[..len as usize]
        .chunks(BLOCK as usize)
        .enumerate()
    {
        assert_eq!(
            bytes[0],
            0xA0 | target as u8,
            "block {block} of target {target} holds a block meant for target {}",
            bytes[0] & 0x0f
        );
    }
}

#[test]
fn two_serve_processes_with_one_name_are_two_peers_under_load() {
    let targets = [
        Serve::start_named("decode", "4MiB", &["--rails", "1"]),
        Serve::start_named("decode", "4MiB", &["--rails", "1"]),
    ];
    let engine = initiator("prefill", Policy::default());
    let peers: Vec<Peer> = targets
        .iter()
        .map(|target| engine.open(&target.addr).expect("the target answers"))
        .collect();
    assert_eq!(peers[0].name(), peers[1].name());
    assert_ne!(peers[0].incarnation(), peers[1].incarnation());
    assert!(
        !peers[0].is_retired(),
        "opening the second retired the first"
    );

    const ROUNDS: usize = 500;
    const BLOCKS: u64 = 4; // 16 KiB per batch
    let bases: Vec<u64> = targets.iter().map(|target| target.pool_base).collect();
    let barrier = Barrier::new(2);
    std::thread::scope(|scope| {
        for writer in 0..2 {
            let (engine, peers, bases, barrier) = (&engine, &peers, &bases, &barrier);
            scope.spawn(move || {
                let source = engine.alloc(BLOCKS * BLOCK, None).expect("memory");
                let back = engine.alloc(BLOCKS * BLOCK, None).expect("memory");
                let mut submitter = engine.submitter().expect("a submitter");
                barrier.wait();
                for round in 0..ROUNDS {
                    for (target, peer) in peers.iter().enumerate() {
                        // Each writer has its own 1 MiB of each target, in 16 KiB slots.
                        let slot = (round as u64 % 64) * BLOCKS * BLOCK;
                        let remote = bases[target] + writer as u64 * (1 << 20) + slot;
                        write_and_check(
                            &mut submitter,
                            peer,
                            (source, back),
                            remote,
                            BLOCKS,
                            (target, writer, round),
                        );
                    }
                }
            });
        }
    });
    for (target, peer) in peers.iter().enumerate() {
        assert!(!peer.is_retired());
        assert_only_meant_for(&engine, peer, targets[target].pool_base, 2 << 20, target);
    }
    let control = engine.stats().control;
    assert_eq!(control.peer_restarts, 0, "{control:?}");
    assert_eq!(control.teardowns, 0, "no endpoint retired: {control:?}");
    assert_eq!(control.reconnects, 0, "{control:?}");
    assert_eq!(control.stray_replies, 0, "{control:?}");
}

#[test]
fn eight_targets_opened_at_once_and_bumped_together_get_only_their_own_bytes() {
    const TARGETS: usize = 8;
    const THREADS: usize = 4;
    const ROUNDS: usize = 40;
    // Every queue pair executes this many work requests, then fails: all endpoints carry
    // the same load, so they fail and reconnect at about the same time, epoch after epoch.
    const LIFE: u64 = 30;
    let targets: Vec<Serve> = (0..TARGETS)
        .map(|_| Serve::start_named("decode", "2MiB", &["--rails", "1"]))
        .collect();
    let policy = Policy {
        backoff_min: Duration::from_millis(1),
        backoff_max: Duration::from_millis(20),
        flaps_to_open: u32::MAX,
        ..Policy::default()
    };
    let engine = initiator("prefill", policy);

    // Four threads open all eight at once, each in its own order.
    let addrs: Vec<String> = targets.iter().map(|target| target.addr.clone()).collect();
    let bases: Vec<u64> = targets.iter().map(|target| target.pool_base).collect();
    let barrier = Barrier::new(THREADS);
    let opened: Vec<Vec<Peer>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (engine, addrs, barrier) = (&engine, &addrs, &barrier);
                scope.spawn(move || {
                    barrier.wait();
                    let mut peers: Vec<Option<Peer>> = (0..TARGETS).map(|_| None).collect();
                    for step in 0..TARGETS {
                        let target = (step * (thread + 1) + thread) % TARGETS;
                        let target = if peers[target].is_some() {
                            peers.iter().position(Option::is_none).expect("one left")
                        } else {
                            target
                        };
                        peers[target] =
                            Some(engine.open(&addrs[target]).expect("the target answers"));
                    }
                    peers.into_iter().flatten().collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("an opener"))
            .collect()
    });
    for peers in &opened {
        for (target, peer) in peers.iter().enumerate() {
            assert_eq!(
                peer.incarnation(),
                opened[0][target].incarnation(),
                "every thread reached the same process at target {target}'s address"
            );
        }
    }

    let faults = engine.faults(0).expect("a host rail");
    faults.add(Fault::Flap {
        on: QpMatch::Any,
        after: LIFE,
    });
    std::thread::scope(|scope| {
        for (writer, peers) in opened.iter().enumerate() {
            let (engine, bases) = (&engine, &bases);
            scope.spawn(move || {
                let source = engine.alloc(BLOCK, None).expect("memory");
                let back = engine.alloc(BLOCK, None).expect("memory");
                let mut submitter = engine.submitter().expect("a submitter");
                for round in 0..ROUNDS {
                    for (target, peer) in peers.iter().enumerate() {
                        let remote = bases[target] + (writer * ROUNDS + round) as u64 * BLOCK;
                        write_and_check(
                            &mut submitter,
                            peer,
                            (source, back),
                            remote,
                            1,
                            (target, writer, round),
                        );
                    }
                }
            });
        }
    });
    faults.clear();
    let control = engine.stats().control;
    for (target, peer) in opened[0].iter().enumerate() {
        assert_only_meant_for(
            &engine,
            peer,
            targets[target].pool_base,
            (THREADS * ROUNDS) as u64 * BLOCK,
            target,
        );
    }
    // Each queue pair executes LIFE work requests and fails the next, which is retried on
    // the next queue pair (with whatever was flushed behind it): an endpoint's
    // 2 × THREADS × ROUNDS requests take exactly ⌈that / LIFE⌉ queue pairs. A reply applied
    // to the wrong endpoint hands it a queue pair into another target, whose keys and
    // addresses differ: its requests fail and both endpoints reconnect once more.
    let per_endpoint = (2 * THREADS * ROUNDS) as u64;
    let bumps_each = per_endpoint.div_ceil(LIFE) - 1;
    assert!(
        bumps_each >= 5,
        "the test bumps every endpoint several times"
    );
    let bumps = TARGETS as u64 * bumps_each;
    assert!(
        (bumps..=bumps + 1).contains(&control.reconnects),
        "{bumps} bumps, {} reconnects: {control:?}",
        control.reconnects
    );
    assert_eq!(control.stray_replies, 0, "{control:?}");
    assert_eq!(control.peer_restarts, 0, "{control:?}");
}

/// A port taken over by another process after its owner died: first under the same name,
/// then under another. Nothing meant for the dead process reaches the new one.
#[test]
fn a_process_that_takes_over_a_port_gets_nothing_meant_for_its_predecessor() {
    let engine = initiator("prefill", Policy::default());
    let source = engine.alloc(BLOCK, None).expect("memory");
    bytes_of(source).fill(0x5a);
    let mut submitter = engine.submitter().expect("a submitter");

    let first = Serve::start_named("decode", "1MiB", &["--rails", "1"]);
    let addr: SocketAddr = first.addr.parse().expect("an address");
    let peer = engine.open(&first.addr).expect("the target answers");
    let first_base = first.pool_base;
    let batch = submitter
        .submit(&peer, &[write(source, first_base)])
        .expect("submitted");
    assert!(done(&batch));
    drop(first); // killed

    let (heir, heir_memory, fresh) = take_over(
        &engine,
        &mut submitter,
        source,
        (addr, &peer, first_base),
        "decode",
    );
    // The heir is a peer of its own: writes to it, opened as itself, land.
    let batch = submitter
        .submit(&fresh, &[write(source, heir_memory.addr)])
        .expect("submitted");
    assert!(done(&batch));
    assert!(
        bytes_of(heir_memory)[..BLOCK as usize]
            .iter()
            .all(|&b| b == 0x5a)
    );
    drop(heir);

    take_over(
        &engine,
        &mut submitter,
        source,
        (addr, &fresh, heir_memory.addr),
        "someone-else",
    );
}

fn write(source: Region, remote: u64) -> Transfer {
    Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: remote,
        len: BLOCK,
    }
}

/// A process named `heir_name` takes `addr` over from `predecessor` (already dead, its
/// memory at `remote`); the initiator writes and notifies the predecessor. Returns the
/// heir, its memory, and the heir opened as a peer.
fn take_over(
    engine: &Engine,
    submitter: &mut railyard::engine::EngineSubmitter,
    source: Region,
    (addr, predecessor, remote): (SocketAddr, &Peer, u64),
    heir_name: &str,
) -> (Engine, Region, Peer) {
    let heir = Engine::builder(heir_name)
        .listen(addr)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the heir takes the port");
    let heir_memory = heir.alloc(1 << 20, None).expect("memory");

    let batch = submitter
        .submit(predecessor, &[write(source, remote)])
        .expect("submitted");
    batch.wait(Instant::now() + BOUND);
    assert!(
        !done(&batch),
        "{heir_name}: a write to a dead process cannot succeed"
    );
    engine
        .notify(predecessor, b"meant for the dead".to_vec())
        .expect("queued");
    let end = Instant::now() + BOUND;
    while heir.stats().control.notifications_refused == 0 {
        assert!(
            Instant::now() < end,
            "{heir_name}: the notification never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(heir.drain_notifications().is_empty(), "{heir_name}");
    let stats = heir.stats().control;
    assert_eq!(stats.notifications_refused, 1, "{heir_name}: {stats:?}");
    assert!(
        bytes_of(heir_memory).iter().all(|&byte| byte == 0),
        "{heir_name}: a byte meant for the predecessor landed in the heir"
    );
    let end = Instant::now() + BOUND;
    while !predecessor.is_retired() {
        assert!(
            Instant::now() < end,
            "{heir_name}: the predecessor's endpoints were not retired"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let batch = submitter
        .submit(predecessor, &[write(source, remote)])
        .expect("submitted");
    assert!(!done(&batch));
    let fresh = engine.open(&addr.to_string()).expect("the heir answers");
    assert_eq!(fresh.incarnation(), heir.incarnation());
    assert_eq!(fresh.name(), heir_name);
    (heir, heir_memory, fresh)
}
