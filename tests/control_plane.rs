//! The control plane end to end: two nodes in one process connect over TCP, move bytes,
//! and answer repeated handshakes idempotently.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use railyard::chaos::churn::handshake_once;
use railyard::chaos::node::Node;
use railyard::control::wire::{FrameDecoder, Message, WireKey};
use railyard::control::{HostId, Incarnation, PeerLink, Phase, Policy, RailFabric};
use railyard::dataplane::fabric::soft::{SoftConfig, SoftDevice};
use railyard::dataplane::fabric::{Access, Fabric, Opcode, WcStatus, WorkRequest, WrId};
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
    unsafe { initiator.bytes_mut(source) }.fill(0x42);

    let view = initiator.control.connect(target.addr(), 0, 0).unwrap();
    assert!(
        view.wait_ready(Instant::now() + BOUND),
        "{:?}",
        view.phase()
    );
    assert_eq!(view.key.peer, target.control.incarnation());
    let descriptor = view.descriptor().expect("descriptor fetched");
    let remote = target.regions()[region].buffer.addr();
    let rkey = descriptor.rkey_for(remote, 4096, 0).expect("registered");
    let local = initiator.regions()[source].regions[0];
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
            generation: 0,
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
    let landed = unsafe { target.regions()[region].buffer.as_slice() };
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

/// Sends `messages` on a fresh control connection after a Hello naming `incarnation`, then
/// waits for the answer to a GetDescriptor sent after them: by then the target has handled
/// every one of them (one connection is read in order).
fn say_in_order(addr: SocketAddr, name: &str, incarnation: Incarnation, messages: &[Message]) {
    let mut stream = TcpStream::connect_timeout(&addr, BOUND).expect("the target listens");
    stream
        .set_read_timeout(Some(BOUND))
        .expect("a read timeout");
    let mut frames = Message::Hello {
        name: name.into(),
        incarnation,
        host: HostId::this_process(),
        listen: String::new(),
        nonce: [0; railyard_control::wire::NONCE_LEN],
        encrypt: false,
    }
    .encode();
    for message in messages {
        frames.extend(message.encode());
    }
    frames.extend(Message::GetDescriptor.encode());
    stream.write_all(&frames).expect("the target reads");
    let mut decoder = FrameDecoder::default();
    let mut buffer = [0u8; 4096];
    loop {
        while let Some(message) = decoder.next_message().expect("well-formed frames") {
            if matches!(message, Message::Descriptor(_)) {
                let _ = stream.write_all(&Message::Bye.encode());
                return;
            }
        }
        let n = stream.read(&mut buffer).expect("the target answers");
        assert!(n > 0, "the target closed the connection");
        decoder.push(&buffer[..n]).expect("one frame at a time");
    }
}

/// RetireQp takes a passive queue pair out of service only when its own initiator names
/// it, by its current queue-pair number; after that the peer's soft queue pair is refused
/// (RETRY_EXC_ERR) before any byte moves.
#[test]
fn a_retire_qp_drops_the_passive_queue_pair_only_when_its_initiator_names_it() {
    let mut target = Node::start("decode-0", 1, any_port(), 1, Policy::default(), None).unwrap();
    let region = target.alloc(1 << 20).unwrap();
    let remote = target.regions()[region].regions[0];

    // The raw initiator: its own soft device and one queue pair, handshaken by hand.
    let device = SoftDevice::open("raw-peer", SoftConfig::default()).unwrap();
    let link = PeerLink {
        same_host: true,
        local_ip: target.addr().ip(),
    };
    let (qp, side) = RailFabric::create_qp(&device, &link).unwrap();
    let incarnation = Incarnation(device.incarnation());
    let key = WireKey {
        initiator: incarnation,
        target: target.control.incarnation(),
        initiator_rail: 0,
        target_rail: 0,
    };
    let answer = handshake_once(target.addr(), "raw-peer", incarnation, key, &side)
        .expect("the target accepts the queue pair");
    let qp = RailFabric::connect_qp(&device, qp, &answer).unwrap();
    let mut fabric = device.fabric();
    let qp = fabric.adopt(None, qp).unwrap();
    let source = vec![0x7eu8; 4096];
    // SAFETY: `source` outlives the device's use of it (the test ends with both).
    let local = unsafe { device.register(source.as_ptr(), source.len(), Access::ALL) }.unwrap();
    let write = |wr_id: u64| WorkRequest {
        wr_id: WrId(wr_id),
        opcode: Opcode::Write,
        local_addr: local.addr,
        lkey: local.lkey,
        remote_addr: remote.addr,
        rkey: remote.rkey,
        len: 4096,
        imm: 0,
        signaled: true,
        epoch: railyard::dataplane::Epoch::FIRST,
    };
    let completion = |fabric: &mut railyard::dataplane::fabric::soft::SoftFabric| {
        let end = Instant::now() + BOUND;
        let mut out = Vec::new();
        while out.is_empty() {
            assert!(Instant::now() < end, "no completion");
            fabric.poll(&mut out, 1);
        }
        out[0].status
    };
    fabric.post(qp, &[write(1)]).unwrap();
    assert_eq!(completion(&mut fabric), WcStatus::Success);

    let retired = || target.control.stats().passive_retired;
    let qp_num = side.info.qp_num;
    // Another process claiming to be the initiator, and the initiator naming another queue
    // pair: both ignored.
    say_in_order(
        target.addr(),
        "another-peer",
        Incarnation(incarnation.0 ^ 1),
        &[Message::RetireQp {
            key,
            epoch: 1,
            qp_num,
        }],
    );
    say_in_order(
        target.addr(),
        "raw-peer",
        incarnation,
        &[Message::RetireQp {
            key,
            epoch: 1,
            qp_num: qp_num ^ 1,
        }],
    );
    assert_eq!(retired(), 0);
    fabric.post(qp, &[write(2)]).unwrap();
    assert_eq!(completion(&mut fabric), WcStatus::Success);

    // The initiator itself, naming its queue pair: out of service.
    say_in_order(
        target.addr(),
        "raw-peer",
        incarnation,
        &[Message::RetireQp {
            key,
            epoch: 1,
            qp_num,
        }],
    );
    assert_eq!(retired(), 1);
    // SAFETY: nothing transfers into the region now.
    let bytes = unsafe { target.bytes_mut(region) };
    bytes[..4096].fill(0);
    fabric.post(qp, &[write(3)]).unwrap();
    assert_eq!(completion(&mut fabric), WcStatus::RetryExcErr);
    // SAFETY: as above.
    let landed = unsafe { target.bytes_mut(region) }[..4096]
        .iter()
        .any(|&b| b != 0);
    assert!(!landed, "a write through a retired queue pair landed");
}
