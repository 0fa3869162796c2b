//! The control plane end to end: two nodes in one process connect over TCP, move bytes,
//! and answer repeated handshakes idempotently.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use railyard::chaos::node::Node;
use railyard::control::{Phase, Policy};
use railyard::dataplane::fabric::Opcode;
use railyard::dataplane::{RequestOutcome, SliceSpec, Submitter};

const BOUND: Duration = Duration::from_secs(10);

fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

#[test]
fn two_nodes_connect_and_move_bytes() {
    let mut target = Node::start("decode-0", 1, any_port(), 1, Policy::default(), None).unwrap();
    let region = target.alloc(1 << 20).unwrap();
    let mut initiator =
        Node::start("prefill-0", 1, any_port(), 2, Policy::default(), None).unwrap();
    let source = initiator.alloc(1 << 20).unwrap();
    // SAFETY: nothing transfers yet.
    unsafe { initiator.regions[source].buffer.as_mut_slice() }.fill(0x42);

    let view = initiator.control.connect(target.addr(), 0, 0).unwrap();
    assert!(
        view.wait_ready(Instant::now() + BOUND),
        "{:?}",
        view.phase()
    );
    assert_eq!(view.key.peer, target.control.incarnation());
    let descriptor = view.descriptor().expect("descriptor fetched");
    let remote = target.regions[region].buffer.region().addr;
    let rkey = descriptor.rkey_for(remote, 4096, 0).expect("registered");
    let local = initiator.regions[source].regions[0];
    let mut submitter = Submitter::new(&[&*initiator.pollers[0]], 64).unwrap();
    let specs: Vec<SliceSpec> = (0..16u32)
        .map(|i| SliceSpec {
            rail: 0,
            request: i,
            opcode: Opcode::Write,
            local_addr: local.addr + u64::from(i) * 4096,
            lkey: local.lkey,
            remote_addr: remote + u64::from(i) * 4096,
            rkey,
            len: 4096,
            imm: 0,
            endpoint: view.id,
            epoch: view.epoch().unwrap(),
        })
        .collect();
    let batch = submitter
        .submit(16, &specs, Instant::now() + BOUND)
        .unwrap();
    assert!(batch.wait(Instant::now() + BOUND).is_complete());
    assert!(
        batch
            .outcomes()
            .iter()
            .all(|o| *o == Some(RequestOutcome::Done))
    );
    // SAFETY: the transfers completed.
    let landed = unsafe { target.regions[region].buffer.as_slice() };
    assert!(landed[..16 * 4096].iter().all(|&b| b == 0x42));

    // Asking again for the same peer and rails is the same endpoint.
    let again = initiator.control.connect(target.addr(), 0, 0).unwrap();
    assert_eq!(again.id, view.id);
    assert_eq!(view.phase(), Phase::Ready);
    let stats = target.control.stats();
    assert_eq!((stats.passive_qps, stats.teardowns), (1, 0));
    assert_eq!(initiator.stale_posts(), 0);
}

#[test]
fn bad_input_gets_a_specific_error_and_breaks_nothing() {
    use std::io::{Read, Write};

    let mut target = Node::start("decode-0", 1, any_port(), 1, Policy::default(), None).unwrap();
    target.alloc(1 << 16).unwrap();
    let initiator = Node::start("prefill-0", 1, any_port(), 2, Policy::default(), None).unwrap();

    // Garbage on the listener: that connection is closed, nothing else notices.
    let mut garbage = std::net::TcpStream::connect(target.addr()).unwrap();
    garbage.set_read_timeout(Some(BOUND)).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = garbage.read_to_end(&mut answer);
    assert!(answer.is_empty(), "no reply to a non-railyard peer");

    // An unknown local rail, and a remote rail the target does not have.
    let unknown = initiator.control.connect(target.addr(), 7, 0).unwrap_err();
    assert!(
        unknown.to_string().contains("rail 7 does not exist"),
        "{unknown}"
    );
    let view = initiator.control.connect(target.addr(), 0, 5).unwrap();
    assert!(!view.wait_ready(Instant::now() + Duration::from_millis(300)));
    assert!(target.control.stats().refused >= 1);

    // A port nobody listens on.
    let closed = {
        let listener = std::net::TcpListener::bind(any_port()).unwrap();
        listener.local_addr().unwrap()
    };
    let unreachable = initiator.control.connect(closed, 0, 0).unwrap_err();
    assert!(
        unreachable.to_string().contains("cannot reach the peer"),
        "{unreachable}"
    );

    // The good path still works after all of that.
    let good = initiator.control.connect(target.addr(), 0, 0).unwrap();
    assert!(
        good.wait_ready(Instant::now() + BOUND),
        "{:?}",
        good.phase()
    );
}
