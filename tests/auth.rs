//! Authenticated peers: engines that share a cluster secret move bytes on every fabric; an
//! engine with another secret or none gets no descriptor, no queue pair and no byte of the
//! target's memory; and raw clients that skip the handshake, replay a recorded one, present a
//! made-up data-connection token, ask for a raw sink, or say Hello and nothing more are closed
//! without the target answering or allocating, and its counters and resident memory say so.
//! A peer of the previous wire version is refused with a message naming both versions.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{BOUND, Serve, bytes_of, done, rss_kib};
use railyard::control::auth::{self, Role, Transcript};
use railyard::control::session::Protection;
use railyard::control::wire::{FrameDecoder, Message, NONCE_LEN};
use railyard::control::{HostId, Incarnation};
use railyard::dataplane::IdleStrategy;
use railyard::engine::{ClusterSecret, Engine, FabricChoice, Op, RailChoice, Transfer};

/// A secret file of this test process with `byte` repeated, and a trailing newline.
fn secret_file(name: &str, byte: u8) -> PathBuf {
    let path = std::env::temp_dir().join(format!("railyard-auth-{}-{name}", std::process::id()));
    let mut text = vec![byte; 32];
    text.push(b'\n');
    std::fs::write(&path, text).expect("writes the secret");
    path
}

fn secret(byte: u8) -> ClusterSecret {
    ClusterSecret::new(vec![byte; 32]).expect("long enough")
}

/// A one-rail engine on `fabric` with `secret`, parking when idle.
fn engine(name: &str, fabric: FabricChoice, secret: Option<ClusterSecret>) -> Engine {
    let mut builder = Engine::builder(name)
        .fabric(fabric)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle());
    if fabric == FabricChoice::Ofi {
        builder = builder.ofi("tcp;ofi_rxm");
    }
    if let Some(secret) = secret {
        builder = builder.secret(secret);
    }
    builder.build().expect("the engine starts")
}

#[test]
fn members_move_bytes_on_every_fabric_and_outsiders_get_nothing() {
    for fabric in [FabricChoice::Soft, FabricChoice::Tcp, FabricChoice::Ofi] {
        let target = engine("decode", fabric, Some(secret(1)));
        let pool = target.alloc(1 << 20, None).expect("a pool");
        bytes_of(pool).fill(0);
        let member = engine("prefill", fabric, Some(secret(1)));
        let source = member.alloc(64 << 10, None).expect("a source");
        bytes_of(source).fill(0x5a);
        let peer = member
            .open(&target.addr().to_string())
            .unwrap_or_else(|error| panic!("{fabric:?}: a member connects: {error}"));
        let write = Transfer {
            op: Op::Write,
            local: source,
            local_offset: 0,
            remote_addr: pool.addr,
            len: 64 << 10,
        };
        let batch = member
            .submitter()
            .expect("a submitter")
            .submit(&peer, &[write])
            .expect("submitted");
        batch.wait(Instant::now() + BOUND);
        assert!(done(&batch), "{fabric:?}: the member's write lands");
        assert!(bytes_of(pool)[..64 << 10].iter().all(|&b| b == 0x5a));

        for outsider_secret in [Some(secret(2)), None] {
            let outsider = engine("intruder", fabric, outsider_secret.clone());
            let error = outsider
                .open(&target.addr().to_string())
                .expect_err("an outsider does not connect");
            assert!(
                outsider_secret.is_none() || error.to_string().contains("cluster secret"),
                "{fabric:?}: the error says why: {error}"
            );
        }
        let stats = target.stats().control;
        assert_eq!(stats.auth_failures, 2, "{fabric:?}: {stats:?}");
        assert_eq!(
            stats.passive_qps, 1,
            "{fabric:?}: only the member's queue pair"
        );
        assert!(
            bytes_of(pool)[64 << 10..].iter().all(|&b| b == 0),
            "{fabric:?}: nothing else was written"
        );
    }
}

/// Every message in `bytes` (as much as decodes).
fn messages(bytes: &[u8]) -> Vec<Message> {
    let mut decoder = FrameDecoder::default();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4096) {
        if decoder.push(chunk).is_err() {
            break;
        }
        while let Ok(Some(message)) = decoder.next_message() {
            out.push(message);
        }
    }
    out
}

/// Sends `bytes` on a fresh connection to `addr` and reads what comes back until the other
/// side closes (within the bound): what it said.
fn say_and_listen(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).expect("connects");
    stream.set_read_timeout(Some(BOUND)).expect("a timeout");
    let _ = stream.write_all(bytes);
    let mut heard = Vec::new();
    let started = Instant::now();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return heard,
            Ok(n) => heard.extend_from_slice(&buffer[..n]),
            Err(_) => return heard,
        }
        assert!(started.elapsed() < BOUND, "the target never closed");
    }
}

fn hello(incarnation: u64) -> Message {
    Message::Hello {
        name: "intruder".into(),
        incarnation: Incarnation(incarnation),
        host: HostId::this_process(),
        listen: String::new(),
        nonce: [9; NONCE_LEN],
        encrypt: false,
    }
}

/// A client that holds the secret does the handshake by hand at `target` and asks for the
/// descriptor, sealing its frames after its Auth and opening the target's after the
/// target's Auth: returns what it sent (Hello, Auth, a sealed GetDescriptor) and the
/// descriptor.
fn handshake_by_hand(
    target: SocketAddr,
    secret: &ClusterSecret,
) -> (Vec<u8>, railyard::control::SegmentDescriptor) {
    let mut stream = TcpStream::connect(target).expect("connects");
    stream.set_read_timeout(Some(BOUND)).expect("a timeout");
    let nonce: [u8; NONCE_LEN] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5c);
    let mine = Message::Hello {
        name: "by-hand".into(),
        incarnation: Incarnation(0x0b1_4a2d),
        host: HostId::this_process(),
        listen: String::new(),
        nonce,
        encrypt: false,
    };
    let mut said = mine.encode();
    stream.write_all(&said).expect("writes");
    let mut decoder = FrameDecoder::default();
    let theirs = read_with(&mut stream, &mut decoder, |m| {
        matches!(m, Message::Hello { .. }).then_some(m)
    });
    let Message::Hello {
        nonce: their_nonce, ..
    } = &theirs
    else {
        unreachable!("picked a Hello");
    };
    let transcript = Transcript {
        dialer_hello: &mine,
        listener_hello: &theirs,
        dialed: target,
    };
    let mac = auth::prove(secret, Role::Dialer, &transcript);
    let keys = secret.session_keys(Role::Dialer, &nonce, their_nonce, Protection::Authenticate);
    let (mut sealer, opener) = keys.split();
    let mut rest = Message::Auth { mac }.encode();
    let mut ask = Message::GetDescriptor.encode();
    sealer.seal(&mut ask);
    rest.extend(ask);
    stream.write_all(&rest).expect("writes");
    said.extend(rest);
    read_with(&mut stream, &mut decoder, |m| {
        matches!(m, Message::Auth { .. }).then_some(())
    });
    decoder.protect(opener);
    let descriptor = read_with(&mut stream, &mut decoder, |m| match m {
        Message::Descriptor(descriptor) => Some(descriptor),
        _ => None,
    });
    (said, descriptor)
}

/// Reads frames from `stream` through `decoder` until one that `pick` takes (within the
/// bound); frames after it stay in the decoder.
fn read_with<T>(
    stream: &mut TcpStream,
    decoder: &mut FrameDecoder,
    pick: impl Fn(Message) -> Option<T>,
) -> T {
    let mut buffer = [0u8; 1];
    let started = Instant::now();
    loop {
        while let Some(message) = decoder.next_message().expect("well-formed frames") {
            if let Some(picked) = pick(message) {
                return picked;
            }
        }
        assert!(started.elapsed() < BOUND, "the awaited frame never came");
        // A byte at a time: nothing after the awaited frame is pushed before the caller
        // may protect the decoder.
        let n = stream.read(&mut buffer).expect("reads");
        assert!(n > 0, "closed before the awaited frame");
        decoder.push(&buffer[..n]).expect("room");
    }
}

/// The value of `key` in the target's `stats` line.
fn stat(serve: &mut Serve, key: &str) -> u64 {
    let line = serve.command("stats");
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// A TCP fabric data-connection hello: magic, kind (1: a queue pair's token, 2: a raw
/// sink), token.
fn data_hello(kind: u64, token: u64) -> Vec<u8> {
    let mut bytes = b"RYTCPv01".to_vec();
    bytes.extend_from_slice(&kind.to_le_bytes());
    bytes.extend_from_slice(&token.to_le_bytes());
    bytes
}

#[test]
fn raw_clients_that_skip_replay_or_forge_are_closed_unanswered() {
    let secret_path = secret_file("raw", 7);
    let path = secret_path.to_str().expect("a UTF-8 path");
    let mut serve = Serve::start_with("8MiB", &["--rails", "1", "--secret-file", path]);
    let target: SocketAddr = serve.addr.parse().expect("an address");

    // A client with the secret gets the descriptor (and the data port); what it said is
    // recorded.
    let (recorded, descriptor) = handshake_by_hand(target, &secret(7));
    let data_port = descriptor.rails[0].tcp_port;
    assert_ne!(data_port, 0, "the target takes TCP queue pairs");
    let failures_before = stat(&mut serve, "auth_failures");
    let pid = serve.child.id();
    let rss_before = rss_kib(pid);

    // Straight to the descriptor; a Hello and then the descriptor; a replayed handshake.
    let skipped = say_and_listen(&serve.addr, &Message::GetDescriptor.encode());
    let mut asked = hello(0xbad).encode();
    asked.extend(Message::GetDescriptor.encode());
    let unproven = say_and_listen(&serve.addr, &asked);
    let replayed = say_and_listen(&serve.addr, &recorded);
    // A Hello, and then silence: closed at the connect timeout.
    let silent = say_and_listen(&serve.addr, &hello(0x5117).encode());
    for (what, heard) in [
        ("no handshake", skipped),
        ("no proof", unproven),
        ("a replay", replayed),
        ("silence", silent),
    ] {
        let heard = messages(&heard);
        assert!(
            heard.iter().all(|m| matches!(m, Message::Hello { .. })),
            "{what}: the target said only its Hello: {heard:?}"
        );
    }
    assert_eq!(stat(&mut serve, "auth_failures"), failures_before + 4);

    // The data port: a made-up token, and a raw sink, are closed at their hello.
    let data = format!("127.0.0.1:{data_port}");
    for (what, hello) in [
        ("a made-up token", data_hello(1, 0x5eed_5eed_5eed_5eed)),
        ("a sink", data_hello(2, 0)),
    ] {
        let mut stream = TcpStream::connect(&data).expect("connects");
        stream.set_read_timeout(Some(BOUND)).expect("a timeout");
        stream.write_all(&hello).expect("writes the hello");
        // A request header and 64 KiB of payload that must land nowhere.
        let _ = stream.write_all(&vec![0xee; 32 + (64 << 10)]);
        let started = Instant::now();
        let mut buffer = [0u8; 64];
        let read = stream.read(&mut buffer);
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "{what}: closed without an answer: {read:?}"
        );
        assert!(started.elapsed() < BOUND);
    }
    std::thread::sleep(Duration::from_millis(200));
    let grown = rss_kib(pid).saturating_sub(rss_before);
    assert!(grown < 8 << 10, "the target grew by {grown} KiB");
    let digest = serve.command(&format!(
        "digest {} 0 {} {}",
        serve.pool_id,
        1 << 20,
        1 << 20
    ));
    let zeros = format!(
        "digest {:016x}",
        railyard::chaos::digest(&vec![0u8; 1 << 20])
    );
    assert_eq!(digest, zeros, "nothing was written into the pool");
    let _ = std::fs::remove_file(secret_path);
}

#[test]
fn the_cli_names_a_bad_secret_file() {
    let short = std::env::temp_dir().join(format!("railyard-auth-{}-short", std::process::id()));
    std::fs::write(&short, b"too short\n").expect("writes");
    for (file, expected) in [
        (short.clone(), "too short"),
        (PathBuf::from("/nonexistent/railyard-secret"), "cannot read"),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args(["serve", "--listen", "127.0.0.1:0", "--pool", "1MiB"])
            .arg("--secret-file")
            .arg(&file)
            .output()
            .expect("runs");
        assert_eq!(output.status.code(), Some(2), "{output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{stderr}");
    }
    let _ = std::fs::remove_file(short);
}

/// One request's outcome: done, or why not (`not submitted` when the engine refused it
/// before it went anywhere).
fn outcome(member: &Engine, peer: &railyard::engine::Peer, transfer: Transfer) -> String {
    let submitted = member
        .submitter()
        .expect("a submitter")
        .submit(peer, &[transfer]);
    let Ok(batch) = submitted else {
        return "not submitted".into();
    };
    batch.wait(Instant::now() + BOUND);
    format!("{:?}", batch.outcomes()[0])
}

#[test]
fn regions_give_peers_only_the_access_they_were_registered_with() {
    use railyard::engine::PeerAccess;
    for fabric in [FabricChoice::Soft, FabricChoice::Tcp, FabricChoice::Ofi] {
        let target = engine("decode", fabric, Some(secret(3)));
        let region = |access| {
            let region = target
                .alloc_with_access(64 << 10, None, access)
                .expect("a region");
            bytes_of(region).fill(0x11);
            region
        };
        let (writable, readable, private) = (
            region(PeerAccess::ReadWrite),
            region(PeerAccess::Read),
            region(PeerAccess::None),
        );
        let member = engine("prefill", fabric, Some(secret(3)));
        let local = member
            .alloc_with_access(64 << 10, None, PeerAccess::None)
            .expect("a buffer");
        bytes_of(local).fill(0x77);
        let peer = member
            .open(&target.addr().to_string())
            .unwrap_or_else(|error| panic!("{fabric:?}: {error}"));
        let transfer = |op, remote: railyard::engine::Region| Transfer {
            op,
            local,
            local_offset: 0,
            remote_addr: remote.addr,
            len: 4096,
        };
        let done = "Some(Done)".to_string();
        let refused = "Some(Failed(RemoteAccess))".to_string();
        assert_eq!(
            outcome(&member, &peer, transfer(Op::Write, writable)),
            done,
            "{fabric:?}"
        );
        assert_eq!(
            outcome(&member, &peer, transfer(Op::Write, readable)),
            refused,
            "{fabric:?}"
        );
        assert_eq!(
            outcome(&member, &peer, transfer(Op::Read, readable)),
            done,
            "{fabric:?}"
        );
        // A region peers may not touch is not even in the descriptor: it cannot be named.
        assert!(
            peer.descriptor()
                .regions
                .iter()
                .all(|region| region.base != private.addr),
            "{fabric:?}"
        );
        for op in [Op::Read, Op::Write] {
            assert_eq!(
                outcome(&member, &peer, transfer(op, private)),
                "not submitted",
                "{fabric:?}"
            );
        }
        assert!(bytes_of(writable)[..4096].iter().all(|&b| b == 0x77));
        assert!(
            bytes_of(readable)
                .iter()
                .chain(bytes_of(private).iter())
                .all(|&b| b == 0x11),
            "{fabric:?}: nothing landed where peers may not write"
        );
        assert!(
            bytes_of(local)[..4096].iter().all(|&b| b == 0x11),
            "the READ landed"
        );
    }
}

#[test]
fn a_peer_of_the_previous_wire_version_is_refused_with_a_clear_message() {
    // A listener that answers as railyard before version 9 did: its Hello's header says 8.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("an address");
    let old_peer = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("the member dials");
        let mut hello = hello(0x01d).encode();
        hello[4..6].copy_from_slice(&8u16.to_le_bytes());
        stream.write_all(&hello).expect("writes");
        stream.set_read_timeout(Some(BOUND)).expect("a timeout");
        // Until the member closes.
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    });
    let member = engine("prefill", FabricChoice::Soft, Some(secret(1)));
    let error = member
        .open(&addr.to_string())
        .expect_err("a peer of version 8 is refused");
    let said = error.to_string();
    assert!(
        said.contains("version 8")
            && said.contains("this build speaks 9")
            && said.contains("same railyard release"),
        "{said}"
    );
    drop(member);
    old_peer.join().expect("the old peer's thread");
}
