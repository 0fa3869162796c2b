//! Someone on the path of a control connection, after the handshake: a proxy between two
//! engines that share a secret flips a bit in (a body, a header), drops, replays, reorders
//! and injects frames from the member, and changes a region's address in a descriptor from
//! the target. Every tampered frame is refused and the connection closes; nothing it
//! carried takes effect (no notification delivered, no RetireQp applied, no descriptor
//! believed); the failure is counted; and the engines reconnect and move bytes again. With `--encrypt-control`, a capture of the
//! connection holds no region address, rkey, data-port token or notification in clear.
//!
//! The target listens on 127.0.0.1 and advertises 127.0.0.2, where the proxy listens on the
//! same port: the member dials the address the target names, as through a port forward, so
//! the handshake's proofs hold and only frames after it are touched.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{BOUND, bytes_of, done};
use railyard::control::auth::Role;
use railyard::control::session::{Protection, TAG_LEN};
use railyard::control::wire::{self, HEADER_LEN, Message, WireKey};
use railyard::control::{Incarnation, NotificationBody, SegmentDescriptor};
use railyard::dataplane::IdleStrategy;
use railyard::dataplane::fabric::tcp::TcpAttachment;
use railyard::engine::{
    ClusterSecret, Engine, FabricChoice, Op, Peer, RailChoice, RawTransfer, Region, Transfer,
};

fn secret() -> ClusterSecret {
    ClusterSecret::new(vec![0x42; 32]).expect("long enough")
}

/// A frame's message type, as its header says.
fn kind_of(frame: &[u8]) -> u16 {
    u16::from_le_bytes([frame[6], frame[7]])
}

fn kind(message: &Message) -> u16 {
    kind_of(&message.encode())
}

/// Which way a frame went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    ToTarget,
    ToMember,
}

/// What the proxy does to the next Notify frame from the member to the target.
#[derive(Debug)]
enum Tamper {
    /// Flips one bit of its body.
    FlipBit,
    /// Flips one bit of its header (the version's high byte).
    FlipHeader,
    /// Drops it (the next is forwarded).
    Drop,
    /// Forwards it twice.
    Replay,
    /// Holds it and forwards it after the next one.
    Reorder { held: Option<Vec<u8>> },
    /// Sends a forged RetireQp for the member's queue pair first (with a made-up tag).
    InjectRetire,
    /// Sends a forged Notify first (with a made-up tag).
    InjectNotify { target: Incarnation },
    /// In the next descriptor from the target that names a region at `base`, moves that
    /// region 256 bytes up.
    MoveRegion { base: u64 },
}

impl Tamper {
    /// Whether this frame (going `way`, of `frame_kind`) is the one to tamper with.
    fn picks(&self, way: Way, frame: &[u8]) -> bool {
        let frame_kind = kind_of(frame);
        match self {
            Self::MoveRegion { base } => {
                way == Way::ToMember
                    && frame_kind
                        == kind(&Message::Descriptor(SegmentDescriptor {
                            name: String::new(),
                            incarnation: Incarnation(0),
                            handshake_addr: String::new(),
                            rails: Vec::new(),
                            regions: Vec::new(),
                        }))
                    && frame.windows(8).any(|window| window == base.to_le_bytes())
            }
            _ => {
                way == Way::ToTarget
                    && frame_kind
                        == kind(&Message::Notify {
                            target: Incarnation(0),
                            bytes: Vec::new(),
                        })
            }
        }
    }
}

/// What the proxy shares with its threads.
#[derive(Default)]
struct ProxyState {
    tamper: Option<Tamper>,
    /// Every frame forwarded or dropped, whole, in the order read.
    capture: Vec<(Way, Vec<u8>)>,
    /// The member's last ConnectQp: (endpoint, epoch, queue pair number).
    last_connect: Option<(WireKey, u64, u32)>,
    /// Tampers carried out.
    done: usize,
}

/// Forwards control connections from `listen` to `upstream`, frame by frame.
struct Proxy {
    state: Arc<Mutex<ProxyState>>,
    stop: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    fn start(listen: SocketAddr, upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind(listen).expect("the proxy binds the advertised address");
        listener.set_nonblocking(true).expect("non-blocking");
        let state = Arc::new(Mutex::new(ProxyState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let acceptor = {
            let (state, stop, streams) = (state.clone(), stop.clone(), streams.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((client, _)) = listener.accept() else {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    };
                    let Ok(server) = TcpStream::connect(upstream) else {
                        continue;
                    };
                    client.set_nonblocking(false).expect("blocking");
                    let mut kept = streams.lock().expect("streams");
                    for stream in [&client, &server] {
                        kept.push(stream.try_clone().expect("clones"));
                    }
                    for (way, from, to) in [
                        (Way::ToTarget, client.try_clone(), server.try_clone()),
                        (Way::ToMember, server.try_clone(), client.try_clone()),
                    ] {
                        let (from, to) = (from.expect("clones"), to.expect("clones"));
                        let state = state.clone();
                        std::thread::spawn(move || pump(way, from, to, &state));
                    }
                }
            })
        };
        Self {
            state,
            stop,
            streams,
            acceptor: Some(acceptor),
        }
    }

    fn arm(&self, tamper: Tamper) {
        let mut state = self.state.lock().expect("state");
        state.tamper = Some(tamper);
    }

    fn tampers_done(&self) -> usize {
        self.state.lock().expect("state").done
    }

    fn capture(&self) -> Vec<(Way, Vec<u8>)> {
        self.state.lock().expect("state").capture.clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for stream in self.streams.lock().expect("streams").iter() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

/// Reads one whole frame (with its tag once `tagged`), or None when the stream ends.
fn read_frame(from: &mut TcpStream, tagged: bool) -> Option<Vec<u8>> {
    let mut frame = vec![0u8; HEADER_LEN];
    from.read_exact(&mut frame).ok()?;
    let header: [u8; HEADER_LEN] = frame[..].try_into().ok()?;
    let (_, len) = wire::decode_header(&header).ok()?;
    frame.resize(HEADER_LEN + len + if tagged { TAG_LEN } else { 0 }, 0);
    from.read_exact(&mut frame[HEADER_LEN..]).ok()?;
    Some(frame)
}

/// A frame of `message` with a tag made up by someone without the keys.
fn forged(message: &Message) -> Vec<u8> {
    let mut frame = message.encode();
    frame.extend_from_slice(&[0x5a; TAG_LEN]);
    frame
}

/// One direction of one connection: frames from `from` go to `to`, tampered as armed.
fn pump(way: Way, mut from: TcpStream, mut to: TcpStream, state: &Mutex<ProxyState>) {
    let auth = kind(&Message::Auth { mac: [0; 32] });
    // Each side tags its frames from the one after its own Auth.
    let mut tagged = false;
    while let Some(mut frame) = read_frame(&mut from, tagged) {
        let frame_kind = kind_of(&frame);
        let mut state = state.lock().expect("state");
        state.capture.push((way, frame.clone()));
        if way == Way::ToTarget && tagged {
            // Bodies are in clear without --encrypt-control.
            let body = &frame[HEADER_LEN..frame.len() - TAG_LEN];
            if let Ok(Message::ConnectQp {
                key, epoch, side, ..
            }) = Message::decode_body(frame_kind, body)
            {
                state.last_connect = Some((key, epoch, side.info.qp_num));
            }
        }
        let mut out = vec![];
        let armed = tagged
            && state
                .tamper
                .as_ref()
                .is_some_and(|tamper| tamper.picks(way, &frame));
        if armed {
            match state.tamper.take() {
                Some(Tamper::FlipBit) => {
                    let last_body_byte = frame.len() - TAG_LEN - 1;
                    frame[last_body_byte] ^= 0x01;
                    out.push(frame);
                }
                Some(Tamper::FlipHeader) => {
                    frame[5] ^= 0x01;
                    out.push(frame);
                }
                Some(Tamper::MoveRegion { base }) => {
                    let at = frame
                        .windows(8)
                        .position(|window| window == base.to_le_bytes())
                        .expect("picked for it");
                    frame[at + 1] ^= 0x01;
                    out.push(frame);
                }
                Some(Tamper::Drop) => {}
                Some(Tamper::Replay) => out.extend([frame.clone(), frame]),
                Some(Tamper::Reorder { held: None }) => {
                    state.tamper = Some(Tamper::Reorder { held: Some(frame) });
                }
                Some(Tamper::Reorder { held: Some(held) }) => out.extend([frame, held]),
                Some(Tamper::InjectRetire) => {
                    let (key, epoch, qp_num) = state.last_connect.expect("a ConnectQp was seen");
                    out.extend([forged(&Message::RetireQp { key, epoch, qp_num }), frame]);
                }
                Some(Tamper::InjectNotify { target }) => {
                    let forgery = Message::Notify {
                        target,
                        bytes: b"forged".to_vec(),
                    };
                    out.extend([forged(&forgery), frame]);
                }
                None => unreachable!("armed"),
            }
            if state.tamper.is_none() {
                state.done += 1;
            }
        } else {
            out.push(frame);
        }
        drop(state);
        if frame_kind == auth {
            tagged = true;
        }
        if out.iter().any(|frame| to.write_all(frame).is_err()) {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// A one-rail engine with the secret, parking when idle.
fn engine(name: &str, fabric: FabricChoice, encrypt: bool) -> Engine {
    Engine::builder(name)
        .fabric(fabric)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .secret(secret())
        .encrypt_control(encrypt)
        .build()
        .expect("the engine starts")
}

/// A target that listens on 127.0.0.1 and advertises 127.0.0.2 (where the proxy listens),
/// a member that holds the same secret, and the proxy between them.
fn behind_a_proxy(fabric: FabricChoice, encrypt: bool) -> (Engine, Engine, Proxy) {
    let target = Engine::builder("decode")
        .fabric(fabric)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .listen(SocketAddr::from(([127, 0, 0, 1], 0)))
        .advertise([127, 0, 0, 2].into())
        .secret(secret())
        .encrypt_control(encrypt)
        .build()
        .expect("the target starts");
    let advertised = target.addr();
    let upstream = SocketAddr::from(([127, 0, 0, 1], advertised.port()));
    let proxy = Proxy::start(advertised, upstream);
    (target, engine("prefill", fabric, false), proxy)
}

/// The notifications' bytes that reach `target` until `until`.
fn heard_until(target: &Engine, until: Instant) -> Vec<Vec<u8>> {
    let mut heard = Vec::new();
    while Instant::now() < until {
        for notification in target.wait_notifications(until) {
            if let NotificationBody::Bytes(bytes) = notification.body {
                heard.push(bytes);
            }
        }
    }
    heard
}

/// Writes 64 KiB of `fill` from `source` to the start of `pool`; whether it landed.
fn write_lands(member: &Engine, peer: &Peer, source: Region, pool: Region, fill: u8) -> bool {
    bytes_of(source)[..64 << 10].fill(fill);
    let write = Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: pool.addr,
        len: 64 << 10,
    };
    let Ok(batch) = member
        .submitter()
        .expect("a submitter")
        .submit(peer, &[write])
    else {
        return false;
    };
    done(&batch) && bytes_of(pool)[..64 << 10].iter().all(|&b| b == fill)
}

#[test]
fn frames_tampered_with_after_the_handshake_are_refused_and_the_engines_reconnect() {
    let (target, member, proxy) = behind_a_proxy(FabricChoice::Soft, false);
    let pool = target.alloc(1 << 20, None).expect("a pool");
    let source = member.alloc(64 << 10, None).expect("a source");
    let peer = member
        .open(&target.addr().to_string())
        .expect("the member connects through the proxy");
    assert!(write_lands(&member, &peer, source, pool, 1));
    let target_incarnation = peer.incarnation();
    let cases: Vec<(&str, Tamper, Vec<&[u8]>)> = vec![
        ("bit flip", Tamper::FlipBit, vec![b"flipped"]),
        (
            "header bit flip",
            Tamper::FlipHeader,
            vec![b"under a changed header"],
        ),
        ("drop", Tamper::Drop, vec![b"dropped", b"after a gap"]),
        ("replay", Tamper::Replay, vec![b"replayed"]),
        (
            "reorder",
            Tamper::Reorder { held: None },
            vec![b"first", b"second"],
        ),
        (
            "inject RetireQp",
            Tamper::InjectRetire,
            vec![b"behind a retire"],
        ),
        (
            "inject Notify",
            Tamper::InjectNotify {
                target: target_incarnation,
            },
            vec![b"behind a forgery"],
        ),
    ];
    for (round, (case, tamper, said)) in cases.into_iter().enumerate() {
        let before = target.stats().control;
        proxy.arm(tamper);
        for bytes in &said {
            member.notify(&peer, bytes.to_vec()).expect("queued");
        }
        let started = Instant::now();
        while target.stats().control.auth_failures == before.auth_failures
            && started.elapsed() < Duration::from_secs(2)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(proxy.tampers_done(), round + 1, "{case}");
        let heard = heard_until(&target, Instant::now() + Duration::from_millis(300));
        let after = target.stats().control;
        assert_eq!(
            after.passive_retired, before.passive_retired,
            "{case}: no RetireQp was applied"
        );
        assert!(
            !heard.iter().any(|bytes| bytes.as_slice() == b"forged"),
            "{case}: a forged notification was delivered"
        );
        if case == "replay" {
            // The genuine frame went through once; its copy closed the connection.
            assert_eq!(heard, vec![b"replayed".to_vec()], "{case}");
        } else {
            assert!(
                heard.is_empty(),
                "{case}: nothing tampered with (or after it) was delivered: {heard:?}"
            );
        }

        assert_eq!(after.auth_failures, before.auth_failures + 1, "{case}");
        assert_eq!(
            after.warnings[railyard::control::WarningKind::Auth.index()],
            before.warnings[railyard::control::WarningKind::Auth.index()] + 1,
            "{case}: one warning of kind auth"
        );

        // The member reconnects on a clean path: its next notification and write arrive.
        let clean = format!("after {case}").into_bytes();
        let started = Instant::now();
        loop {
            member.notify(&peer, clean.clone()).expect("queued");
            let heard = heard_until(&target, Instant::now() + Duration::from_millis(100));
            if heard.contains(&clean) {
                break;
            }
            assert!(
                started.elapsed() < BOUND,
                "{case}: the engines never reconnected"
            );
        }
        assert!(
            write_lands(&member, &peer, source, pool, round as u8 + 2),
            "{case}: bytes move after the reconnect"
        );
    }

    // The other way: the descriptor the target sends when the member looks for a region
    // registered after the open, with that region moved 256 bytes up on the path.
    let late = target.alloc(1 << 20, None).expect("a late region");
    let moved = late.addr ^ 0x100;
    assert_ne!(moved, late.addr);
    let before = member.stats().control;
    proxy.arm(Tamper::MoveRegion { base: late.addr });
    bytes_of(source).fill(0x3c);
    // At the region's first byte: inside the region the target registered, outside the
    // moved one.
    let write = [RawTransfer {
        op: Op::Write,
        local_addr: source.addr,
        remote_addr: late.addr,
        len: 64 << 10,
    }];
    let mut submitter = member.submitter().expect("a submitter");
    let started = Instant::now();
    loop {
        assert!(
            peer.descriptor().regions.iter().all(|r| r.base != moved),
            "the moved region was believed"
        );
        let submitted = submitter.submit_raw(&peer, &write, Instant::now() + BOUND);
        if submitted.is_ok_and(|batch| done(&batch)) {
            break;
        }
        assert!(
            started.elapsed() < BOUND,
            "the late region was never written"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        peer.descriptor().regions.iter().all(|r| r.base != moved),
        "the moved region was believed"
    );
    let after = member.stats().control;
    assert_eq!(
        after.auth_failures,
        before.auth_failures + 1,
        "the member refused the descriptor"
    );
    let auth = railyard::control::WarningKind::Auth.index();
    assert_eq!(after.warnings[auth], before.warnings[auth] + 1);
    assert_eq!(proxy.tampers_done(), 8, "the descriptor was tampered with");
    assert!(
        bytes_of(late)[..64 << 10].iter().all(|&b| b == 0x3c),
        "the write landed where the target registered the region"
    );
}

/// Every value in `frames` (each side's frames in order, decrypted with keys derived from
/// the secret and the Hellos' nonces) that must not be readable on the path: region
/// addresses and rkeys, data-port tokens, notifications.
fn secrets_in(frames: &[(Way, Vec<u8>)], protection: Protection) -> HashMap<String, Vec<u8>> {
    let hello_nonce = |way: Way| {
        frames
            .iter()
            .filter(|(w, _)| *w == way)
            .find_map(|(_, frame)| match wire::FrameDecoder::decode_frame(frame) {
                Ok(Message::Hello { nonce, .. }) => Some(nonce),
                _ => None,
            })
            .expect("a Hello each way")
    };
    let (dialer_nonce, listener_nonce) = (hello_nonce(Way::ToTarget), hello_nonce(Way::ToMember));
    let mut found = HashMap::new();
    for (way, role_opening) in [
        (Way::ToTarget, Role::Listener),
        (Way::ToMember, Role::Dialer),
    ] {
        let (_, mut opener) = secret()
            .session_keys(role_opening, &dialer_nonce, &listener_nonce, protection)
            .split();
        let mut tagged = false;
        for (_, frame) in frames.iter().filter(|(w, _)| *w == way) {
            let frame_kind = kind_of(frame);
            if !tagged {
                tagged = frame_kind == kind(&Message::Auth { mac: [0; 32] });
                continue;
            }
            let header: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().expect("a header");
            let (body, tag) = frame[HEADER_LEN..].split_at(frame.len() - HEADER_LEN - TAG_LEN);
            let mut body = body.to_vec();
            opener
                .open(&header, &mut body, tag.try_into().expect("a tag"))
                .expect("the capture opens with the session's keys");
            match Message::decode_body(frame_kind, &body).expect("a message") {
                Message::Descriptor(descriptor) => {
                    for region in descriptor.regions {
                        found.insert(
                            format!("region address {:#x}", region.base),
                            region.base.to_le_bytes().to_vec(),
                        );
                        for rkey in region.rkeys.into_iter().filter(|&rkey| rkey >= 1 << 16) {
                            found.insert(format!("rkey {rkey:#x}"), rkey.to_le_bytes().to_vec());
                        }
                    }
                }
                Message::ConnectQpReply {
                    result: Ok(side), ..
                } => {
                    if let Ok(TcpAttachment::Target { token, .. }) =
                        TcpAttachment::decode(&side.attachment)
                    {
                        found.insert(format!("token {token:#x}"), token.to_le_bytes().to_vec());
                    }
                }
                Message::Notify { bytes, .. } => {
                    found.insert(
                        format!("notification {:?}", String::from_utf8_lossy(&bytes)),
                        bytes,
                    );
                }
                _ => {}
            }
        }
    }
    found
}

#[test]
fn with_encrypt_control_a_capture_holds_no_address_key_token_or_notification_in_clear() {
    for encrypt in [true, false] {
        // The target alone asks for encryption: the member follows.
        let (target, member, proxy) = behind_a_proxy(FabricChoice::Tcp, encrypt);
        let pool = target.alloc(1 << 20, None).expect("a pool");
        let source = member.alloc(64 << 10, None).expect("a source");
        let peer = member
            .open(&target.addr().to_string())
            .expect("the member connects through the proxy");
        assert!(write_lands(&member, &peer, source, pool, 7));
        let said = b"kv blocks 17..42 are in place".to_vec();
        member.notify(&peer, said.clone()).expect("queued");
        let heard = heard_until(&target, Instant::now() + Duration::from_millis(300));
        assert_eq!(heard, vec![said], "encrypt={encrypt}");
        drop((member, target));
        let capture = proxy.capture();
        drop(proxy);

        let protection = if encrypt {
            Protection::Encrypt
        } else {
            Protection::Authenticate
        };
        let secrets = secrets_in(&capture, protection);
        for what in ["region address", "rkey", "token", "notification"] {
            assert!(
                secrets.keys().any(|name| name.starts_with(what)),
                "encrypt={encrypt}: the control frames carried a {what}: {:?}",
                secrets.keys()
            );
        }
        let raw: Vec<u8> = capture.into_iter().flat_map(|(_, frame)| frame).collect();
        for (what, bytes) in &secrets {
            let in_clear = raw.windows(bytes.len()).any(|window| window == bytes);
            // Without encryption the same search finds them: it can see what it looks for.
            assert_eq!(in_clear, !encrypt, "encrypt={encrypt}: {what}");
        }
    }
}
