//! The control thread caps connections that are mid-handshake: beyond the cap the oldest
//! silent one is closed, so a flood of silent connections can neither exhaust it nor keep a
//! peer that speaks out.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use railyard_control::wire::{FrameDecoder, Message};
use railyard_control::{
    ControlConfig, ControlPlane, ControlRail, ControlShared, HostId, Incarnation, Policy,
};
use railyard_dataplane::fabric::soft::SoftDevice;

#[test]
fn a_speaker_gets_in_past_silent_connections_at_the_cap() {
    let config = ControlConfig {
        policy: Policy {
            max_handshakes: 2,
            connect_timeout: Duration::from_secs(2),
            ..Policy::default()
        },
        ..ControlConfig::new("capped")
    };
    let rails: Vec<ControlRail<SoftDevice>> = Vec::new();
    let plane = ControlPlane::start(config, rails, ControlShared::new(0)).expect("starts");
    let silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(plane.local_addr()).expect("connects"))
        .collect();
    std::thread::sleep(Duration::from_millis(50)); // both accepted, both silent

    let started = Instant::now();
    let mut speaker = TcpStream::connect(plane.local_addr()).expect("queued by the kernel");
    speaker
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let hello = Message::Hello {
        name: "speaker".into(),
        incarnation: Incarnation(7),
        host: HostId::this_process(),
        listen: String::new(),
        nonce: [0; railyard_control::wire::NONCE_LEN],
        encrypt: false,
    };
    speaker.write_all(&hello.encode()).expect("writes");
    let mut decoder = FrameDecoder::default();
    let mut buffer = [0u8; 512];
    let answer = loop {
        if let Some(message) = decoder.next_message().expect("well-formed") {
            break message;
        }
        let n = speaker
            .read(&mut buffer)
            .expect("an answer within the bound");
        assert!(n > 0, "the control thread closed the connection");
        decoder.push(&buffer[..n]).expect("one frame at a time");
    };
    let waited = started.elapsed();
    assert!(
        matches!(answer, Message::Hello { ref name, .. } if name == "capped"),
        "{answer:?}"
    );
    assert!(
        waited < Duration::from_secs(1),
        "answered after {waited:?}: the speaker waited for the silent ones to time out"
    );
    // The oldest silent one made room at once; the other is still open, until it is closed
    // for saying nothing within the connect timeout.
    assert_eq!(plane.stats().connections_closed, 1, "{:?}", plane.stats());
    let mut silent = silent.into_iter();
    let (mut oldest, mut other) = (silent.next().expect("two"), silent.next().expect("two"));
    let mut byte = [0u8; 1];
    oldest
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    assert_eq!(oldest.read(&mut byte).expect("evicted at once"), 0);
    other.set_nonblocking(true).expect("non-blocking");
    assert_eq!(
        other.read(&mut byte).map_err(|error| error.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "the newer silent connection was closed early"
    );
    other.set_nonblocking(false).expect("blocking");
    other
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    assert_eq!(other.read(&mut byte).expect("closed, not timed out"), 0);
}
