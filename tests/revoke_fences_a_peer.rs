//! A target that gives up on an initiator fences it: once `Engine::revoke` returns, nothing
//! of that initiator lands in the target's memory until it makes a new handshake.
//!
//! Two engines in this process; the initiator writes into the target's buffer without pause
//! (so writes are in flight or buffered at every revoke). The target revokes it, fills its
//! buffer with a poison byte at once, and watches the buffer: a changed byte seen while the
//! target has answered no new ConnectQp since the revoke is a write that crossed the fence.

mod common;

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use common::mapped::{Buffer, Load, PATTERN, POISON, one_rail_engine, open};
use railyard::engine::{FabricChoice, Op};

/// Each revoke looks like a flap to the initiator; three in a row stay below the flap limit
/// that would open its circuit.
const ROUNDS: usize = 3;
/// How long each round watches the poisoned buffer.
const WATCH: Duration = Duration::from_millis(100);

fn revoke_under_load(fabric: FabricChoice) {
    let target = one_rail_engine("decode-revoke", fabric);
    let initiator = one_rail_engine("prefill-revoke", fabric);
    let target_buffer = Buffer::new(POISON);
    let _target_region = target_buffer.register(&target);
    let source = Buffer::new(PATTERN);
    let source_region = Mutex::new(Some(source.register(&initiator)));
    let peer = open(&initiator, &target);
    let load = Load::default();
    thread::scope(|scope| {
        let _stop = load.stop_on_drop();
        scope.spawn(|| load.run(&initiator, &peer, Op::Write, &source_region));
        for round in 0..ROUNDS {
            // Writes flow (again: from the second round on, this is the initiator having
            // reconnected by itself after the revoke).
            let flowing = Instant::now() + Duration::from_secs(5);
            while target_buffer.first_not(POISON).is_none() {
                assert!(Instant::now() < flowing, "round {round}: no write arrives");
                thread::sleep(Duration::from_millis(1));
            }
            let handshakes = target.stats().control.passive_qps;
            target
                .revoke(initiator.incarnation())
                .unwrap_or_else(|error| panic!("round {round}: {error}"));
            target_buffer.fill(POISON);
            let end = Instant::now() + WATCH;
            while Instant::now() < end {
                let changed = target_buffer.first_not(POISON);
                // Read after the look: a new handshake counted now may explain the change.
                let handshakes_now = target.stats().control.passive_qps;
                if let Some(at) = changed {
                    assert!(
                        handshakes_now > handshakes,
                        "round {round}: a write landed at offset {at} after revoke returned, \
                         with no new handshake"
                    );
                    break;
                }
                thread::sleep(Duration::from_millis(1));
            }
        }
    });
    let stats = target.stats().control;
    assert!(
        stats.passive_retired >= ROUNDS as u64,
        "every revoke took queue pairs out of service: {stats:?}"
    );
    assert!(
        load.succeeded() > 0,
        "no write ran at all: the test proved nothing"
    );
}

#[test]
fn nothing_of_a_revoked_peer_lands_until_it_handshakes_again_on_tcp() {
    revoke_under_load(FabricChoice::Tcp);
}

#[test]
fn nothing_of_a_revoked_peer_lands_until_it_handshakes_again_on_the_soft_fabric() {
    revoke_under_load(FabricChoice::Soft);
}
