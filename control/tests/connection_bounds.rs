//! What a connection may cost the control thread, through real sockets: a frame that never
//! finishes is closed after `frame_timeout` (frames that keep finishing are not), and past
//! `max_connections` new connections wait in the kernel until one closes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use railyard_control::wire::{FrameDecoder, HEADER_LEN, MAGIC, Message, VERSION};
use railyard_control::{
    ControlConfig, ControlPlane, ControlRail, ControlShared, HostId, Incarnation, Policy,
};
use railyard_dataplane::fabric::soft::SoftDevice;

const BOUND: Duration = Duration::from_secs(10);

fn plane(policy: Policy) -> ControlPlane {
    let config = ControlConfig {
        policy,
        ..ControlConfig::new("bounded")
    };
    let rails: Vec<ControlRail<SoftDevice>> = Vec::new();
    ControlPlane::start(config, rails, ControlShared::new(0)).expect("starts")
}

fn hello(incarnation: u64) -> Vec<u8> {
    Message::Hello {
        name: "peer".into(),
        incarnation: Incarnation(incarnation),
        host: HostId::this_process(),
        listen: String::new(),
        nonce: [0; railyard_control::wire::NONCE_LEN],
        encrypt: false,
    }
    .encode()
}

/// Connects, says Hello and reads the answering Hello (within `within`, if given).
fn greeted(addr: SocketAddr, incarnation: u64, within: Duration) -> Option<TcpStream> {
    let mut stream = TcpStream::connect(addr).expect("connects");
    stream.write_all(&hello(incarnation)).expect("writes");
    stream.set_read_timeout(Some(within)).expect("a timeout");
    let mut decoder = FrameDecoder::default();
    let mut buffer = [0u8; 512];
    loop {
        if let Some(message) = decoder.next_message().expect("well-formed") {
            assert!(matches!(message, Message::Hello { .. }), "{message:?}");
            return Some(stream);
        }
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return None,
            Ok(n) => decoder.push(&buffer[..n]).expect("one frame at a time"),
        }
    }
}

/// Reads until the control thread closes the connection; how long that took.
fn closed_after(mut stream: TcpStream) -> Duration {
    let started = Instant::now();
    stream.set_read_timeout(Some(BOUND)).expect("a timeout");
    let mut sink = [0u8; 4096];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return started.elapsed(),
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                return started.elapsed();
            }
            Err(error) => panic!("still open after {BOUND:?}: {error}"),
        }
    }
}

#[test]
fn an_unfinished_frame_is_closed_and_finished_frames_are_not() {
    let frame_timeout = Duration::from_millis(300);
    let plane = plane(Policy {
        frame_timeout,
        ..Policy::default()
    });
    let addr = plane.local_addr();

    // Starts a Bye frame that claims a 1 KiB body and sends only half of it.
    let mut stalled = greeted(addr, 1, BOUND).expect("greeted");
    let mut header = Vec::new();
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&7u16.to_le_bytes());
    header.extend_from_slice(&1024u32.to_le_bytes());
    assert_eq!(header.len(), HEADER_LEN);
    stalled.write_all(&header).expect("writes");
    stalled.write_all(&[0u8; 512]).expect("writes");

    // Trickles whole frames, each finishing well inside the timeout, for longer than it.
    let mut trickling = greeted(addr, 2, BOUND).expect("greeted");
    let request = Message::GetDescriptor.encode();
    let end = Instant::now() + frame_timeout * 3;
    while Instant::now() < end {
        let (first, second) = request.split_at(request.len() / 2);
        trickling.write_all(first).expect("still open");
        std::thread::sleep(frame_timeout / 4);
        trickling.write_all(second).expect("still open");
        std::thread::sleep(frame_timeout / 4);
    }

    let waited = closed_after(stalled);
    assert!(waited < BOUND, "closed after {waited:?}");
    assert_eq!(plane.stats().connections_closed, 1, "{:?}", plane.stats());
    // The trickling peer is still served: it gets the answers it asked for.
    trickling.set_read_timeout(Some(BOUND)).expect("a timeout");
    let mut decoder = FrameDecoder::default();
    let mut buffer = [0u8; 4096];
    let answer = loop {
        if let Some(message) = decoder.next_message().expect("well-formed") {
            break message;
        }
        let n = trickling.read(&mut buffer).expect("answers");
        assert!(n > 0, "the trickling peer was closed");
        decoder.push(&buffer[..n]).expect("one frame at a time");
    };
    assert!(matches!(answer, Message::Descriptor(_)), "{answer:?}");
}

#[test]
fn past_the_connection_cap_new_connections_wait_until_one_closes() {
    let plane = plane(Policy {
        max_connections: 3,
        ..Policy::default()
    });
    let addr = plane.local_addr();
    let mut held: Vec<TcpStream> = (0..3)
        .map(|i| greeted(addr, 10 + i, BOUND).expect("under the cap"))
        .collect();
    assert!(
        greeted(addr, 20, Duration::from_millis(300)).is_none(),
        "a fourth connection was served past the cap of three"
    );
    assert!(plane.stats().accept_pauses >= 1);
    // One leaves: the next is served.
    drop(held.pop());
    let late = greeted(addr, 21, BOUND);
    assert!(late.is_some(), "a connection was refused after one closed");
}
