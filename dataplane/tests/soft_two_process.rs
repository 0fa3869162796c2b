//! The soft fabric between two processes: this test binary re-executes itself as the target
//! (`target_process`, ignored unless run by these tests), which registers a buffer, accepts
//! one queue pair and answers commands on stdin (checksums, deregistration, immediates).
//! The target's buffer is either user memory (bytes move with `process_vm_writev`) or an
//! engine-allocated `SoftBuffer` (the initiator maps it and copies directly); the tests
//! that matter run against both.
//! Every answer starts with `@`; every wait has a bound; the target is killed when its
//! handle drops.

#![cfg(not(loom))]

mod soft_common;

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::soft::{SoftBuffer, SoftDevice, handshake};
use railyard_dataplane::fabric::{Access, Fabric, MemoryRegion, Opcode, WcStatus, WorkRequest};
use railyard_dataplane::{
    Command, EndpointId, Epoch, FailStale, IdleStrategy, PollerConfig, PollerHandle,
    RequestOutcome, SliceSpec, Submitter,
};
use soft_common::{
    BOUND, Registered, device, drain, register, request, socket_path, spawn_target_process,
};

const TARGET_SOCKET: &str = "RAILYARD_TEST_TARGET_SOCKET";
const TARGET_BYTES: &str = "RAILYARD_TEST_TARGET_BYTES";
const TARGET_MEMORY: &str = "RAILYARD_TEST_TARGET_MEMORY";

/// What backs the target's registered buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    /// A `Vec` registered with `SoftDevice::register`.
    User,
    /// A `SoftBuffer` from `SoftDevice::alloc`.
    Engine,
}

/// The target's buffer, either kind.
enum TargetBuffer {
    User(Box<Registered>),
    Engine(SoftBuffer),
}

impl TargetBuffer {
    fn region(&self) -> MemoryRegion {
        match self {
            Self::User(registered) => registered.region,
            Self::Engine(buffer) => buffer.region(),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Self::User(registered) => &registered.bytes,
            // SAFETY:
            // - The initiator asks for bytes only after the completions of its writes.
            Self::Engine(buffer) => unsafe { buffer.as_slice() },
        }
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    hasher.write(bytes);
    hasher.finish()
}

/// The target process's side. Not a test: the entry point the tests below start.
#[test]
#[ignore = "entry point of the target process that the two-process tests start"]
fn target_process() {
    let (Ok(socket), Ok(bytes)) = (std::env::var(TARGET_SOCKET), std::env::var(TARGET_BYTES))
    else {
        panic!("run only by the two-process tests ({TARGET_SOCKET} is not set)");
    };
    let len: usize = bytes.parse().expect("a byte count");
    let device = device("target0");
    let target = match std::env::var(TARGET_MEMORY).as_deref() {
        Ok("engine") => TargetBuffer::Engine(device.alloc(len, Access::ALL).expect("allocates")),
        _ => TargetBuffer::User(register(&device, len, 0, Access::ALL)),
    };
    let listener = handshake::SoftListener::bind(&device, &socket).expect("listener binds");
    println!(
        "@ready {} {} {}",
        target.region().addr,
        target.region().rkey,
        len
    );
    let mut qp = listener
        .accept(Access::ALL)
        .expect("the initiator connects");
    let mut inbox = qp.take_recv_queue().expect("first take");
    println!("@connected");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| -> usize { words[i].parse().expect("a number") };
        match words.first().copied() {
            Some("checksum") => {
                let (offset, len) = (number(1), number(2));
                println!("@{}", checksum(&target.bytes()[offset..offset + len]));
            }
            Some("dereg") => {
                device.deregister(&target.region()).expect("registered");
                println!("@deregistered");
            }
            Some("recv") => {
                // Wait for one immediate; answer it with the checksum of the range it names
                // (offset and length as multiples of 4 KiB in its two halves).
                let mut received = Vec::new();
                let end = Instant::now() + BOUND;
                while inbox.poll(&mut received, 1) == 0 && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let Some(arrived) = received.first() else {
                    println!("@none");
                    continue;
                };
                let offset = (arrived.imm >> 16) as usize * 4096;
                let len = arrived.byte_len as usize;
                println!(
                    "@{} {}",
                    arrived.imm,
                    checksum(&target.bytes()[offset..offset + len])
                );
            }
            _ => break,
        }
    }
    drop(qp);
}

/// A running target process.
struct Target {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
    addr: u64,
    rkey: u32,
    len: usize,
    socket: std::path::PathBuf,
}

impl Target {
    /// Starts a target with `len` registered bytes of `memory` and waits until it listens.
    fn spawn(len: usize, memory: Memory) -> Self {
        let socket = socket_path("target");
        let memory = if memory == Memory::Engine {
            "engine"
        } else {
            "user"
        };
        let (socket_text, bytes) = (socket.to_string_lossy().into_owned(), len.to_string());
        let (child, stdin, answers) = spawn_target_process(
            "target_process",
            &[
                (TARGET_SOCKET, &socket_text),
                (TARGET_BYTES, &bytes),
                (TARGET_MEMORY, memory),
            ],
        );
        let mut target = Self {
            child,
            stdin,
            answers,
            addr: 0,
            rkey: 0,
            len,
            socket,
        };
        let ready = target.answer();
        let fields: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(fields[0], "ready", "{ready}");
        target.addr = fields[1].parse().expect("address");
        target.rkey = fields[2].parse().expect("rkey");
        target
    }

    fn answer(&mut self) -> String {
        self.answers
            .recv_timeout(BOUND)
            .expect("the target answers within the bound")
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("the target reads commands");
        self.answer()
    }

    /// Connects a queue pair of `device` to it.
    fn connect(&mut self, device: &SoftDevice) -> railyard_dataplane::fabric::soft::SoftQp {
        let qp = handshake::dial(device, &self.socket, Access::ALL).expect("handshake");
        assert_eq!(self.answer(), "connected");
        assert_eq!(qp.peer_pid(), Some(self.child.id()));
        qp
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sizes that cover every case: tiny, odd, page, large.
const SIZES: [usize; 7] = [1 << 20, 4096, 65536, 1, 12_345, 256 * 1024, 4097];

/// Cuts `0..len` into consecutive ranges of mixed sizes, starting at size `first`.
fn mixed_ranges(len: usize, first: usize) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    let mut offset = 0;
    let mut turn = first;
    while offset < len {
        let size = SIZES[turn % SIZES.len()].min(len - offset);
        ranges.push((offset, size));
        offset += size;
        turn += 1;
    }
    ranges
}

#[test]
fn a_gibibyte_is_written_and_read_back_in_mixed_sizes_through_a_poller() {
    gibibyte_round_trip(Memory::User);
}

#[test]
fn a_gibibyte_round_trip_into_engine_memory_the_initiator_maps() {
    gibibyte_round_trip(Memory::Engine);
}

fn gibibyte_round_trip(memory: Memory) {
    const WINDOW: usize = 64 << 20;
    const PASSES: usize = 16; // 16 × 64 MiB = 1 GiB each way
    let mut target = Target::spawn(WINDOW, memory);
    let device = device("rail0");
    let source = register(&device, WINDOW, 0, Access::LOCAL_WRITE);
    let readback = register(&device, WINDOW, 0, Access::LOCAL_WRITE);
    let qp = target.connect(&device);
    let endpoint = EndpointId(0);
    device.stage(endpoint, Epoch::FIRST, qp).expect("RTS");
    let config = PollerConfig {
        idle: IdleStrategy::gentle(),
        ..PollerConfig::new("rail0")
    };
    let poller = PollerHandle::spawn(config, device.fabric(), FailStale).expect("poller starts");
    poller
        .send(Command::AddEndpoint {
            endpoint,
            epoch: Epoch::FIRST,
        })
        .expect("running");
    let mut submitter = Submitter::new(&[&poller], 1024).expect("running");

    // A pattern block the passes copy from at shifting offsets: every pass is different.
    let pattern: Vec<u8> = (0..(1usize << 20) + 65536)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let (target_addr, target_rkey) = (target.addr, target.rkey);
    let slice = |opcode, local: &Registered, (offset, size): (usize, usize)| SliceSpec {
        rail: 0,
        request: 0,
        opcode,
        local_addr: local.region.addr + offset as u64,
        lkey: local.region.lkey,
        remote_addr: target_addr + offset as u64,
        rkey: target_rkey,
        len: size as u32,
        imm: 0,
        endpoint,
        epoch: Epoch::FIRST,
        generation: 0,
    };
    let mut source = source;
    for pass in 0..PASSES {
        for (index, chunk) in source.bytes.chunks_mut(1 << 20).enumerate() {
            let start = (pass * 977 + index * 131) % 65536;
            chunk.copy_from_slice(&pattern[start..start + chunk.len()]);
        }
        let writes: Vec<SliceSpec> = mixed_ranges(WINDOW, pass)
            .into_iter()
            .map(|range| slice(Opcode::Write, &source, range))
            .collect();
        let batch = submitter
            .submit(1, &writes, Instant::now() + BOUND)
            .expect("valid slices");
        let status = batch.wait(Instant::now() + BOUND);
        assert!(status.is_complete(), "pass {pass} writes: {status:?}");
        assert_eq!(
            batch.outcome(0),
            Some(RequestOutcome::Done),
            "pass {pass} writes"
        );
        assert_eq!(
            target.ask(&format!("checksum 0 {WINDOW}")),
            checksum(&source.bytes).to_string(),
            "pass {pass}: the target holds what was written"
        );

        let reads: Vec<SliceSpec> = mixed_ranges(WINDOW, pass + 3)
            .into_iter()
            .map(|range| slice(Opcode::Read, &readback, range))
            .collect();
        let batch = submitter
            .submit(1, &reads, Instant::now() + BOUND)
            .expect("valid slices");
        assert!(batch.wait(Instant::now() + BOUND).is_complete());
        assert_eq!(
            batch.outcome(0),
            Some(RequestOutcome::Done),
            "pass {pass} reads"
        );
        assert!(
            readback.bytes == source.bytes,
            "pass {pass}: read back what was written"
        );
    }
    let counters = poller.counters();
    assert_eq!(counters.failed_total(), 0);
    assert!(counters.completed >= 2 * (PASSES as u64) * (WINDOW as u64 >> 20));
    assert_eq!(target.len, WINDOW);
}

#[test]
fn write_with_imm_reaches_the_target_after_its_data() {
    for memory in [Memory::User, Memory::Engine] {
        write_with_imm(memory);
    }
}

fn write_with_imm(memory: Memory) {
    let mut target = Target::spawn(8 << 20, memory);
    let device = device("rail0");
    let mut source = register(&device, 8 << 20, 0, Access::LOCAL_WRITE);
    for (i, byte) in source.bytes.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    let mut fabric = device.fabric();
    let qp = fabric.adopt(None, target.connect(&device)).expect("RTS");
    for (page, len) in [(0u32, 1usize << 20), (300, 4096), (1000, 777)] {
        let offset = page as u64 * 4096;
        let imm = page << 16 | 7;
        let write = WorkRequest {
            opcode: Opcode::WriteWithImm,
            imm,
            ..request(
                1,
                Opcode::WriteWithImm,
                source.region.addr + offset,
                source.region.lkey,
                target.addr + offset,
                target.rkey,
                len as u32,
            )
        };
        fabric.post(qp, &[write]).expect("posted");
        assert_eq!(drain(&mut fabric, 1)[0].status, WcStatus::Success);
        let expected = checksum(&source.bytes[offset as usize..offset as usize + len]);
        assert_eq!(
            target.ask("recv"),
            format!("{imm} {expected}"),
            "{memory:?}"
        );
    }
}

#[test]
fn a_deregistration_in_the_target_fails_requests_already_posted() {
    for memory in [Memory::User, Memory::Engine] {
        deregistration_in_flight(memory);
    }
}

fn deregistration_in_flight(memory: Memory) {
    let mut target = Target::spawn(1 << 20, memory);
    let device = device("rail0");
    let source = register(&device, 1 << 20, 9, Access::LOCAL_WRITE);
    let mut fabric = device.fabric();
    let qp = fabric.adopt(None, target.connect(&device)).expect("RTS");
    let write = |id: u64| {
        request(
            id,
            Opcode::Write,
            source.region.addr,
            source.region.lkey,
            target.addr + id * 4096,
            target.rkey,
            4096,
        )
    };
    fabric.post(qp, &[write(0)]).expect("posted");
    assert_eq!(drain(&mut fabric, 1)[0].status, WcStatus::Success);
    let in_flight: Vec<_> = (1..5).map(write).collect();
    fabric
        .post(qp, &in_flight)
        .expect("posted, not executed yet");
    assert_eq!(target.ask("dereg"), "deregistered");
    let statuses: Vec<WcStatus> = drain(&mut fabric, 4).iter().map(|c| c.status).collect();
    assert_eq!(
        statuses,
        [
            WcStatus::RemAccessErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr
        ],
        "{memory:?}"
    );
}

#[test]
fn killing_the_target_mid_transfer_gives_retry_exceeded_within_the_bound() {
    killed_mid_transfer(Memory::User);
}

#[test]
fn killing_a_target_whose_memory_is_mapped_is_still_detected() {
    // Copies into a mapping cannot fail when the owner dies: only the pidfd tells.
    killed_mid_transfer(Memory::Engine);
}

fn killed_mid_transfer(memory: Memory) {
    /// What the test allows between the kill and the error completion; the device's own
    /// detection is one liveness interval (1 ms) after the next poll.
    const DETECTION_BOUND: Duration = Duration::from_millis(500);
    let mut target = Target::spawn(64 << 20, memory);
    let device = device("rail0");
    let source = register(&device, 1 << 20, 3, Access::LOCAL_WRITE);
    let mut fabric = device.fabric();
    let qp = fabric.adopt(None, target.connect(&device)).expect("RTS");
    let write = |id: u64| {
        request(
            id,
            Opcode::Write,
            source.region.addr,
            source.region.lkey,
            target.addr + (id % 64) * (1 << 20),
            target.rkey,
            1 << 20,
        )
    };
    let mut posted = 0u64;
    let mut completions = Vec::new();
    let mut killed_at = None;
    let mut failed_at = None;
    let end = Instant::now() + BOUND;
    while completions.len() < posted as usize || failed_at.is_none() {
        assert!(
            Instant::now() < end,
            "hung: {posted} posted, {} completed, killed: {}, last: {:?}",
            completions.len(),
            killed_at.is_some(),
            completions.last()
        );
        if failed_at.is_none() && posted - (completions.len() as u64) < 16 {
            fabric.post(qp, &[write(posted)]).expect("posted");
            posted += 1;
        }
        if killed_at.is_none() && completions.len() >= 32 {
            target.child.kill().expect("the target can be killed");
            killed_at = Some(Instant::now());
        }
        let before = completions.len();
        fabric.poll(&mut completions, 16);
        if failed_at.is_none()
            && completions[before..]
                .iter()
                .any(|c| c.status != WcStatus::Success)
        {
            failed_at = Some(Instant::now());
        }
    }
    let killed_at = killed_at.expect("killed");
    let failed_at = failed_at.expect("failed");
    let first_error = completions
        .iter()
        .find(|c| c.status != WcStatus::Success)
        .expect("an error");
    assert_eq!(first_error.status, WcStatus::RetryExcErr);
    assert!(
        failed_at.duration_since(killed_at) < DETECTION_BOUND,
        "detected after {:?}",
        failed_at.duration_since(killed_at)
    );
    let after_error = completions
        .iter()
        .skip_while(|c| c.status == WcStatus::Success)
        .skip(1);
    assert!(
        after_error
            .into_iter()
            .all(|c| c.status == WcStatus::WrFlushErr)
    );
    assert_eq!(completions.len() as u64, posted, "every request completed");
}
