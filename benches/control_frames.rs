//! What protecting a control frame costs: sealing it
//! (the sender's MAC, or encryption and tag) and opening it (the receiver's check, or
//! decryption), for the frames a transfer's control path carries — a ConnectQp with a TCP
//! target attachment, a 256-byte notification, and a descriptor of 16 regions — with
//! `--secret-file` alone (HMAC-SHA256) and with `--encrypt-control` (AES-256-GCM).
//! Beside them, the same frame's encode and decode, which every frame pays with or without a
//! secret. A summary after criterion's figures gives what each end pays (the sender's seal,
//! the receiver's open) and its ratio to the 1 µs-per-frame budget.

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use railyard::control::auth::Role;
use railyard::control::session::{FrameOpener, FrameSealer, Protection, TAG_LEN};
use railyard::control::wire::{FrameDecoder, HEADER_LEN, QpSide, WireKey};
use railyard::control::{Incarnation, Message, RegionDescriptor, SegmentDescriptor};
use railyard::dataplane::fabric::tcp::TcpAttachment;
use railyard::dataplane::fabric::{Access, QpInfo};
use railyard::engine::ClusterSecret;

/// The budget the issue sets for protecting one frame.
const BUDGET: Duration = Duration::from_micros(1);

fn frames() -> Vec<(&'static str, Message)> {
    let connect = Message::ConnectQp {
        key: WireKey {
            initiator: Incarnation(0x1111),
            target: Incarnation(0x2222),
            initiator_rail: 0,
            target_rail: 0,
        },
        epoch: 3,
        handshake: 0x5eed,
        side: QpSide {
            info: QpInfo {
                qp_num: 0x1234,
                lid: 0,
                gid: [7; 16],
                psn: 0x42,
                path_mtu: 4096,
            },
            attachment: TcpAttachment::Target {
                addr: SocketAddr::from(([10, 0, 0, 2], 40_000)),
                token: 0xfeed_f00d_dead_beef,
            }
            .encode(),
        },
    };
    let notify = Message::Notify {
        target: Incarnation(0x2222),
        bytes: vec![0xab; 256],
    };
    let descriptor = Message::Descriptor(SegmentDescriptor {
        name: "decode-0".into(),
        incarnation: Incarnation(0x2222),
        handshake_addr: "10.0.0.2:7000".into(),
        rails: Vec::new(),
        regions: (0..16u64)
            .map(|i| RegionDescriptor {
                base: 0x7f00_0000_0000 + (i << 30),
                len: 1 << 30,
                rkeys: vec![0x1000 + i as u32],
                generation: 1,
                access: Access::ALL,
            })
            .collect(),
    });
    vec![
        ("connect_qp", connect),
        ("notify_256B", notify),
        ("descriptor_16_regions", descriptor),
    ]
}

/// A sealer and the opener of the other side of the same connection.
fn pair(protection: Protection) -> (FrameSealer, FrameOpener) {
    let secret = ClusterSecret::new(vec![0x42; 32]).expect("long enough");
    let (dialer_nonce, listener_nonce) = ([1; 32], [2; 32]);
    let (sealer, _) = secret
        .session_keys(Role::Dialer, &dialer_nonce, &listener_nonce, protection)
        .split();
    let (_, opener) = secret
        .session_keys(Role::Listener, &dialer_nonce, &listener_nonce, protection)
        .split();
    (sealer, opener)
}

/// Seals `frame` into `buffer` and opens it again, as the two ends of a connection do.
fn seal_and_open(
    frame: &[u8],
    buffer: &mut Vec<u8>,
    sealer: &mut FrameSealer,
    opener: &mut FrameOpener,
) {
    buffer.clear();
    buffer.extend_from_slice(frame);
    sealer.seal(buffer);
    open_in_place(buffer, opener);
}

/// Opens the sealed frame in `buffer` as the receiver does: header, body, tag.
fn open_in_place(buffer: &mut [u8], opener: &mut FrameOpener) {
    let (header, rest) = buffer.split_at_mut(HEADER_LEN);
    let (body, tag) = rest.split_at_mut(rest.len() - TAG_LEN);
    opener
        .open(header, body, (&*tag).try_into().expect("a tag"))
        .expect("opens");
}

/// The mean time of `work` over enough runs to take about 200 ms.
fn mean(mut work: impl FnMut()) -> Duration {
    let started = Instant::now();
    let mut runs = 0u32;
    while started.elapsed() < Duration::from_millis(200) {
        for _ in 0..256 {
            work();
        }
        runs += 256;
    }
    started.elapsed() / runs
}

/// The mean time the sender takes to seal `frame`, and the receiver to open it.
fn each_end(frame: &[u8], protection: Protection) -> (Duration, Duration) {
    const FRAMES: usize = 4096;
    let (mut sealer, mut opener) = pair(protection);
    let mut buffer = Vec::with_capacity(frame.len() + TAG_LEN);
    let seal = mean(|| {
        buffer.clear();
        buffer.extend_from_slice(black_box(frame));
        sealer.seal(&mut buffer);
    });
    // The receiver opens frames in the order they were sealed: seal them first.
    let (mut sealer, _) = pair(protection);
    let sealed: Vec<Vec<u8>> = (0..FRAMES)
        .map(|_| {
            let mut sealed = frame.to_vec();
            sealer.seal(&mut sealed);
            sealed
        })
        .collect();
    let mut opened = 0;
    let started = Instant::now();
    for sealed in &sealed {
        buffer.clear();
        buffer.extend_from_slice(sealed);
        open_in_place(&mut buffer, &mut opener);
        opened += 1;
    }
    (seal, started.elapsed() / opened)
}

fn protection_cost(c: &mut Criterion) {
    let mut summary = Vec::new();
    for (name, message) in frames() {
        let frame = message.encode();
        let mut group = c.benchmark_group(format!("control_frame/{name}"));
        group.bench_function("encode_and_decode", |b| {
            b.iter(|| FrameDecoder::decode_frame(&black_box(&message).encode()).expect("decodes"));
        });
        for (label, protection) in [
            ("hmac_sha256", Protection::Authenticate),
            ("aes_256_gcm", Protection::Encrypt),
        ] {
            let (mut sealer, mut opener) = pair(protection);
            let mut buffer = Vec::with_capacity(frame.len() + TAG_LEN);
            group.bench_function(format!("seal_and_open/{label}"), |b| {
                b.iter(|| seal_and_open(black_box(&frame), &mut buffer, &mut sealer, &mut opener));
            });
            let (seal, open) = each_end(&frame, protection);
            summary.push((name, frame.len(), label, seal, open));
        }
        group.finish();
    }
    println!("\nProtecting one control frame, at each end, against the 1 µs budget:");
    for (name, len, label, seal, open) in summary {
        println!(
            "  {name:<22} {len:>5} B  {label:<12} seal {:>5} ns ({:.2})  open {:>5} ns ({:.2})",
            seal.as_nanos(),
            seal.as_secs_f64() / BUDGET.as_secs_f64(),
            open.as_nanos(),
            open.as_secs_f64() / BUDGET.as_secs_f64()
        );
    }
}

criterion_group!(benches, protection_cost);
criterion_main!(benches);
