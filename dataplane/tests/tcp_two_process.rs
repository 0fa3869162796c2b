//! The TCP fabric between two processes over loopback: this test binary re-executes itself
//! as the target (`tcp_target_process`, ignored unless run by these tests), which registers
//! a read-write and a write-only buffer, hands out target queue pairs, serves them from a
//! poller-like loop, and answers checksum requests on stdin. Integrity in mixed sizes, every
//! error status the target or the connection produces, and a target killed mid-transfer.
//! Every answer starts with `@`; every wait has a bound; the target is killed when its
//! handle drops.

#![cfg(not(loom))]

mod soft_common;

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{BufRead, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Child, ChildStdin};
use std::sync::mpsc::Receiver;
use std::time::Instant;

use railyard_dataplane::fabric::tcp::{TcpAttachment, TcpConfig, TcpDevice, TcpFabric};
use railyard_dataplane::fabric::{Access, Fabric, Opcode, QpNum, WcStatus, WorkRequest};
use soft_common::{BOUND, Registered, device, drain, register, request, spawn_target_process};

const TARGET_ENV: &str = "RAILYARD_TEST_TCP_TARGET";
/// Target queue pairs the target hands out (one per test case that breaks one).
const QUEUE_PAIRS: usize = 6;
const LEN: usize = 8 << 20;

fn checksum(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    hasher.write(bytes);
    hasher.finish()
}

/// The target process's side. Not a test: the entry point the tests below start.
#[test]
#[ignore = "entry point of the target process that the two-process tests start"]
fn tcp_target_process() {
    assert!(
        std::env::var(TARGET_ENV).is_ok(),
        "run only by the two-process tests ({TARGET_ENV} is not set)"
    );
    let soft = device("target0");
    let rw = register(&soft, LEN, 0, Access::ALL);
    let write_only = register(&soft, 65536, 0, Access::REMOTE_WRITE);
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let tcp = TcpDevice::open(&soft, localhost, TcpConfig::default()).expect("data port");
    let handles: Vec<_> = (0..QUEUE_PAIRS)
        .map(|_| tcp.create_target(localhost))
        .collect();
    let attachments: Vec<String> = handles
        .iter()
        .map(|(_, _, attachment)| hex(&attachment.encode()))
        .collect();
    println!(
        "@ready {} {} {} {} {}",
        rw.region.addr,
        rw.region.rkey,
        write_only.region.addr,
        write_only.region.rkey,
        attachments.join(",")
    );
    let mut fabric = tcp.fabric().expect("epoll");
    std::thread::spawn(move || {
        loop {
            if !fabric.serve() {
                std::thread::yield_now();
            }
        }
    });
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let words: Vec<usize> = line
            .split_whitespace()
            .skip(1)
            .map(|w| w.parse().expect("a number"))
            .collect();
        match line.split_whitespace().next() {
            Some("checksum") => {
                let (offset, len) = (words[0], words[1]);
                println!("@{}", checksum(&rw.bytes[offset..offset + len]));
            }
            _ => break,
        }
    }
    drop(handles);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// A running target process.
struct Target {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
    rw: (u64, u32),
    write_only: (u64, u32),
    attachments: Vec<TcpAttachment>,
}

impl Target {
    fn spawn() -> Self {
        let (child, stdin, answers) =
            spawn_target_process("tcp_target_process", &[(TARGET_ENV, "1")]);
        let ready = answers.recv_timeout(BOUND).expect("the target starts");
        let fields: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(fields[0], "ready", "{ready}");
        let number = |i: usize| -> u64 { fields[i].parse().expect("a number") };
        Self {
            rw: (number(1), number(2) as u32),
            write_only: (number(3), number(4) as u32),
            attachments: fields[5]
                .split(',')
                .map(|a| TcpAttachment::decode(&unhex(a)).expect("an attachment"))
                .collect(),
            child,
            stdin,
            answers,
        }
    }

    fn checksum(&mut self, offset: u64, len: u64) -> u64 {
        writeln!(self.stdin, "checksum {offset} {len}").expect("target stdin");
        let answer = self
            .answers
            .recv_timeout(BOUND)
            .expect("the target answers");
        answer.trim().parse().expect("a checksum")
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// This side: a device, a source buffer and a fabric.
struct Initiator {
    source: Box<Registered>,
    device: TcpDevice,
    fabric: TcpFabric,
    _soft: railyard_dataplane::fabric::soft::SoftDevice,
}

impl Initiator {
    fn new() -> Self {
        let soft = device("init0");
        let mut source = register(&soft, LEN, 0, Access::ALL);
        for (i, byte) in source.bytes.iter_mut().enumerate() {
            *byte = (i as u64).wrapping_mul(0x9E37_79B9) as u8 ^ (i >> 13) as u8;
        }
        let device = TcpDevice::open(&soft, IpAddr::V4(Ipv4Addr::LOCALHOST), TcpConfig::default())
            .expect("data port");
        let fabric = device.fabric().expect("epoll");
        Self {
            source,
            device,
            fabric,
            _soft: soft,
        }
    }

    /// Connects to the target's `index`-th queue pair.
    fn connect(&mut self, target: &Target, index: usize) -> QpNum {
        let (prepared, _) = self.device.create_qp();
        let qp = self
            .device
            .connect(prepared, &target.attachments[index])
            .expect("the target's port answers");
        self.fabric.adopt(None, qp).expect("watched")
    }

    fn write(&self, id: u64, offset: u64, remote: (u64, u32), len: u32) -> WorkRequest {
        request(
            id,
            Opcode::Write,
            self.source.region.addr + offset,
            self.source.region.lkey,
            remote.0 + offset,
            remote.1,
            len,
        )
    }

    fn run(&mut self, qp: QpNum, requests: &[WorkRequest]) -> Vec<WcStatus> {
        self.fabric.post(qp, requests).expect("posted");
        drain(&mut self.fabric, requests.len())
            .iter()
            .map(|c| c.status)
            .collect()
    }
}

#[test]
fn mixed_sizes_arrive_intact_and_read_back_byte_for_byte() {
    let mut target = Target::spawn();
    let mut initiator = Initiator::new();
    let qp = initiator.connect(&target, 0);
    // 1 B to 1 MiB, packed one after another over the whole 8 MiB, in lists of 16.
    let sizes = [
        1u32,
        3,
        64,
        100,
        4096,
        4097,
        65536,
        1 << 20,
        7,
        262_144,
        12_345,
    ];
    let mut writes = Vec::new();
    let mut offset = 0u64;
    for (i, &len) in sizes.iter().cycle().enumerate() {
        if offset + u64::from(len) > LEN as u64 {
            break;
        }
        writes.push(initiator.write(i as u64, offset, target.rw, len));
        offset += u64::from(len);
    }
    for list in writes.chunks(16) {
        let statuses = initiator.run(qp, list);
        assert!(
            statuses.iter().all(|s| *s == WcStatus::Success),
            "{statuses:?}"
        );
    }
    assert_eq!(
        target.checksum(0, offset),
        checksum(&initiator.source.bytes[..offset as usize]),
        "{} writes of mixed sizes",
        writes.len()
    );
    // Read everything back into the upper half in 512 KiB reads, then compare.
    let half = (LEN / 2) as u64;
    let reads: Vec<WorkRequest> = (0..half / (512 << 10))
        .map(|i| WorkRequest {
            opcode: Opcode::Read,
            local_addr: initiator.source.region.addr + half + i * (512 << 10),
            ..initiator.write(1000 + i, i * (512 << 10), target.rw, 512 << 10)
        })
        .collect();
    let statuses = initiator.run(qp, &reads);
    assert!(
        statuses.iter().all(|s| *s == WcStatus::Success),
        "{statuses:?}"
    );
    let (low, high) = initiator.source.bytes.split_at(half as usize);
    assert!(
        low == high,
        "what was read back differs from what was written"
    );
}

#[test]
fn the_targets_checks_and_the_connection_give_verbs_statuses() {
    let mut target = Target::spawn();
    let mut initiator = Initiator::new();
    let write_only = target.write_only;
    let rw = target.rw;
    let cases: [(WorkRequest, WcStatus); 4] = [
        // An rkey the target never handed out.
        (
            initiator.write(1, 0, (rw.0, rw.1 ^ 0x40), 64),
            WcStatus::RemAccessErr,
        ),
        // Past the end of the region.
        (
            initiator.write(1, 0, (rw.0 + LEN as u64 - 8, rw.1), 64),
            WcStatus::RemAccessErr,
        ),
        // A READ of a region that allows remote writes only.
        (
            WorkRequest {
                opcode: Opcode::Read,
                ..initiator.write(1, 0, write_only, 64)
            },
            WcStatus::RemAccessErr,
        ),
        // A local key this side never registered.
        (
            WorkRequest {
                lkey: initiator.source.region.lkey ^ 0x40,
                ..initiator.write(1, 0, rw, 64)
            },
            WcStatus::LocProtErr,
        ),
    ];
    for (index, (bad, status)) in cases.into_iter().enumerate() {
        let qp = initiator.connect(&target, index);
        let good = initiator.write(2, 0, rw, 4096);
        let after = initiator.write(3, 4096, rw, 4096);
        assert_eq!(
            initiator.run(qp, &[good, bad, after]),
            [WcStatus::Success, status, WcStatus::WrFlushErr],
            "case {index}"
        );
    }
    // The write-only region takes writes.
    let qp = initiator.connect(&target, 4);
    assert_eq!(
        initiator.run(qp, &[initiator.write(1, 0, write_only, 4096)]),
        [WcStatus::Success]
    );

    // The target killed mid-transfer: RETRY_EXC_ERR for the first request not answered,
    // WR_FLUSH_ERR for the rest, within the bound; every request completes.
    let qp = initiator.connect(&target, 5);
    let writes: Vec<WorkRequest> = (0..2048)
        .map(|i| initiator.write(i, (i % 128) * 65536, rw, 65536))
        .collect();
    initiator.fabric.post(qp, &writes).expect("posted");
    let mut done = drain(&mut initiator.fabric, 16);
    target.child.kill().expect("the target dies");
    let killed = Instant::now();
    done.extend(drain(&mut initiator.fabric, writes.len() - done.len()));
    let statuses: Vec<WcStatus> = done.iter().map(|c| c.status).collect();
    let succeeded = statuses
        .iter()
        .take_while(|s| **s == WcStatus::Success)
        .count();
    assert!(
        succeeded < writes.len(),
        "the kill came too late to cut anything"
    );
    assert_eq!(statuses[succeeded], WcStatus::RetryExcErr);
    assert!(
        statuses[succeeded + 1..]
            .iter()
            .all(|s| *s == WcStatus::WrFlushErr)
    );
    assert!(killed.elapsed() < BOUND);
}
