//! The TCP fabric within one process over loopback, through its public API: an initiator
//! device and a target device (each on its own soft device's registrations), the target's
//! fabric served by a thread standing in for its poller. Bytes move, every status appears
//! where the fabric model says, and the fault plan works here too.

#![cfg(not(loom))]

mod soft_common;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::soft::{Fault, FaultPlan, QpMatch, SoftDevice};
use railyard_dataplane::fabric::tcp::{TcpAttachment, TcpConfig, TcpDevice, TcpFabric, TcpTarget};
use railyard_dataplane::fabric::{
    Access, AsyncEvent, Fabric, Opcode, QpNum, WcStatus, WorkCompletion, WorkRequest,
};
use railyard_dataplane::{EndpointId, Epoch};
use soft_common::{BOUND, Registered, device, drain, register, request};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// The target's poller: serves its fabric until stopped.
struct TargetPoller {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TargetPoller {
    fn start(mut fabric: TcpFabric) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if !fabric.serve() {
                    std::thread::yield_now();
                }
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for TargetPoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Rig {
    source: Box<Registered>,
    target: Box<Registered>,
    fabric: TcpFabric,
    qp: QpNum,
    handle: Option<TcpTarget>,
    /// Serves the target until dropped.
    _target_poller: Option<TargetPoller>,
    initiator_soft: SoftDevice,
    target_soft: SoftDevice,
    /// The target's device: its data port and what it served.
    target_device: TcpDevice,
}

fn rig_with(config: TcpConfig, target_access: Access, serve: bool) -> Rig {
    let (mut rig, target_fabric) = rig_parts(config.clone(), config, target_access, 1 << 20);
    rig._target_poller = serve.then(|| TargetPoller::start(target_fabric));
    rig
}

/// A rig whose target fabric is handed to the test, which serves it itself — standing in
/// for a poller it can pause (not calling `serve` is the pause) — each device with its own
/// configuration, and `len`-byte buffers (the source filled with 0xAB, the target zeroed).
fn rig_served_by_test(
    initiator_config: TcpConfig,
    target_config: TcpConfig,
    len: usize,
) -> (Rig, TcpFabric) {
    rig_parts(initiator_config, target_config, Access::ALL, len)
}

/// A connected rig whose target nothing serves yet, and the target's fabric.
fn rig_parts(
    initiator_config: TcpConfig,
    target_config: TcpConfig,
    target_access: Access,
    len: usize,
) -> (Rig, TcpFabric) {
    let initiator_soft = device("init0");
    let target_soft = device("target0");
    let source = register(&initiator_soft, len, 0xAB, Access::LOCAL_WRITE);
    let target = register(&target_soft, len, 0, target_access);
    let initiator =
        TcpDevice::open(&initiator_soft, LOCALHOST, initiator_config).expect("loopback set-up");
    let target_device =
        TcpDevice::open(&target_soft, LOCALHOST, target_config).expect("loopback set-up");
    let (handle, _, attachment) = target_device.create_target(LOCALHOST);
    let (prepared, _) = initiator.create_qp();
    let connected = initiator
        .connect(prepared, &attachment)
        .expect("loopback set-up");
    let target_fabric = target_device.fabric().expect("loopback set-up");
    let target_device_handle = target_device.clone();
    let mut fabric = initiator.fabric().expect("loopback set-up");
    let qp = fabric
        .adopt(Some(EndpointId(0)), connected)
        .expect("loopback set-up");
    let rig = Rig {
        source,
        target,
        fabric,
        qp,
        handle: Some(handle),
        _target_poller: None,
        initiator_soft,
        target_soft,
        target_device: target_device_handle,
    };
    (rig, target_fabric)
}

/// The default configuration but for a peer timeout as long as the tests' bound: a loaded
/// 2-core machine can keep a thread off the CPU long enough that the default 2 s would read
/// a merely starved target as a silent peer (RETRY_EXC_ERR). Tests of the timeout set their
/// own.
fn patient() -> TcpConfig {
    TcpConfig {
        peer_timeout: BOUND,
        ..TcpConfig::default()
    }
}

fn rig() -> Rig {
    rig_with(patient(), Access::ALL, true)
}

impl Rig {
    fn write(&self, id: u64, offset: u64, len: u32) -> WorkRequest {
        request(
            id,
            Opcode::Write,
            self.source.region.addr + offset,
            self.source.region.lkey,
            self.target.region.addr + offset,
            self.target.region.rkey,
            len,
        )
    }

    fn read(&self, id: u64, offset: u64, len: u32) -> WorkRequest {
        WorkRequest {
            opcode: Opcode::Read,
            ..self.write(id, offset, len)
        }
    }

    fn run(&mut self, requests: &[WorkRequest]) -> Vec<WorkCompletion> {
        self.fabric.post(self.qp, requests).expect("posted");
        drain(&mut self.fabric, requests.len())
    }
}

fn statuses(completions: &[WorkCompletion]) -> Vec<WcStatus> {
    completions.iter().map(|c| c.status).collect()
}

#[test]
fn writes_reads_and_immediates_move_the_bytes_in_mixed_sizes() {
    let mut rig = rig();
    for (i, byte) in rig.source.bytes.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    // Sizes from 1 byte to 256 KiB at scattered offsets, one list.
    let sizes = [1u32, 7, 64, 4096, 65536, 262_144, 100, 3];
    let mut offset = 0u64;
    let writes: Vec<WorkRequest> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let request = rig.write(i as u64, offset, len);
            offset += u64::from(len) + 13;
            request
        })
        .collect();
    let done = rig.run(&writes);
    assert!(
        done.iter().all(|c| c.status == WcStatus::Success),
        "{done:?}"
    );
    for write in &writes {
        let at = (write.remote_addr - rig.target.region.addr) as usize;
        let len = write.len as usize;
        assert_eq!(
            rig.target.bytes[at..at + len],
            rig.source.bytes[at..at + len]
        );
    }
    // Read back into the source's upper half, byte for byte.
    rig.target.bytes[600_000..600_000 + 70_000].fill(0x5A);
    let read = WorkRequest {
        local_addr: rig.source.region.addr + 700_000,
        remote_addr: rig.target.region.addr + 600_000,
        ..rig.read(50, 0, 70_000)
    };
    assert_eq!(statuses(&rig.run(&[read])), [WcStatus::Success]);
    assert!(
        rig.source.bytes[700_000..770_000]
            .iter()
            .all(|&b| b == 0x5A)
    );

    // A write with an immediate and a bare (zero-length, keyless) one: in order, after the
    // data.
    let with_imm = WorkRequest {
        opcode: Opcode::WriteWithImm,
        imm: 0xFEED,
        ..rig.write(60, 0, 512)
    };
    let bare = WorkRequest {
        opcode: Opcode::WriteWithImm,
        imm: 0xC0DE,
        lkey: 0,
        rkey: 0,
        ..rig.write(61, 0, 0)
    };
    assert_eq!(
        statuses(&rig.run(&[with_imm, bare])),
        [WcStatus::Success; 2]
    );
    let mut immediates = Vec::new();
    rig.handle
        .as_mut()
        .unwrap()
        .take_immediates(&mut immediates);
    assert_eq!(immediates, [0xFEED, 0xC0DE]);
}

/// The target's immediate queue holds 4096 (`IMMEDIATE_QUEUE`): more immediates than that,
/// none taken, make the target wait with the next request's header already read behind the
/// waiting write's payload (one receive takes both). Taking them lets every write finish, in
/// order, each with its own bytes and immediate.
#[test]
fn writes_past_a_full_immediate_queue_wait_and_then_finish_in_order() {
    const QUEUE: usize = 4096;
    const WRITES: usize = QUEUE + 300;
    const LEN: u32 = 24;
    let mut rig = rig();
    for (i, byte) in rig.source.bytes.iter_mut().enumerate() {
        *byte = (i % 253) as u8;
    }
    let writes: Vec<WorkRequest> = (0..WRITES)
        .map(|i| WorkRequest {
            opcode: Opcode::WriteWithImm,
            imm: i as u32,
            ..rig.write(i as u64, i as u64 * u64::from(LEN), LEN)
        })
        .collect();
    rig.fabric.post(rig.qp, &writes).expect("posted");
    let mut done = drain(&mut rig.fabric, QUEUE);
    // The rest waits for room: nothing more completes while no immediate is taken.
    let mut more = Vec::new();
    let quiet_until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < quiet_until {
        rig.fabric.poll(&mut more, WRITES);
        std::thread::yield_now();
    }
    assert!(
        more.is_empty(),
        "{} completed past a full queue",
        more.len()
    );
    let mut immediates = Vec::new();
    let handle = rig.handle.as_mut().expect("target handle");
    handle.take_immediates(&mut immediates);
    assert_eq!(immediates.len(), QUEUE);
    done.extend(drain(&mut rig.fabric, WRITES - QUEUE));
    handle.take_immediates(&mut immediates);
    assert!(
        done.iter().all(|c| c.status == WcStatus::Success),
        "{:?}",
        done.iter().find(|c| c.status != WcStatus::Success)
    );
    assert_eq!(immediates, (0..WRITES as u32).collect::<Vec<_>>());
    let end = WRITES * LEN as usize;
    assert_eq!(rig.target.bytes[..end], rig.source.bytes[..end]);
}

#[test]
fn unsignaled_successes_are_silent_and_a_completed_write_is_visible_to_a_later_read() {
    let mut rig = rig();
    let quiet: Vec<WorkRequest> = (0..10)
        .map(|i| WorkRequest {
            signaled: false,
            ..rig.write(i, i * 1000, 1000)
        })
        .collect();
    rig.fabric.post(rig.qp, &quiet).unwrap();
    // The read that follows sees every write (replies come in order).
    let read = WorkRequest {
        local_addr: rig.source.region.addr + 500_000,
        ..rig.read(10, 0, 10_000)
    };
    let done = rig.run(&[read]);
    assert_eq!(
        (done.len(), done[0].wr_id.0, done[0].status),
        (1, 10, WcStatus::Success)
    );
    assert!(
        rig.source.bytes[500_000..510_000]
            .iter()
            .all(|&b| b == 0xAB)
    );
}

#[test]
fn the_target_checks_its_live_table_remote_access_then_flush() {
    let mut rig = rig();
    let bad_key = WorkRequest {
        rkey: rig.target.region.rkey ^ 0x40,
        ..rig.write(1, 0, 4096)
    };
    let after = rig.write(2, 0, 64);
    assert_eq!(
        statuses(&rig.run(&[bad_key, after])),
        [WcStatus::RemAccessErr, WcStatus::WrFlushErr]
    );
    // Later posts on the failed queue pair flush at once.
    assert_eq!(
        statuses(&rig.run(&[rig.write(3, 0, 8)])),
        [WcStatus::WrFlushErr]
    );

    let mut rig = self::rig();
    let out_of_bounds = WorkRequest {
        remote_addr: rig.target.region.addr + (1 << 20) - 8,
        ..rig.read(1, 0, 16)
    };
    assert_eq!(
        statuses(&rig.run(&[out_of_bounds])),
        [WcStatus::RemAccessErr]
    );

    // Deregistered in the target: the next request naming it is refused.
    let mut rig = self::rig();
    assert_eq!(
        statuses(&rig.run(&[rig.write(1, 0, 64)])),
        [WcStatus::Success]
    );
    rig.target_soft.deregister(&rig.target.region).unwrap();
    assert_eq!(
        statuses(&rig.run(&[rig.write(2, 0, 64)])),
        [WcStatus::RemAccessErr]
    );

    // A region that does not allow remote reads.
    let mut rig = rig_with(patient(), Access::REMOTE_WRITE, true);
    assert_eq!(
        statuses(&rig.run(&[rig.read(1, 0, 64)])),
        [WcStatus::RemAccessErr]
    );
}

#[test]
fn local_checks_are_protection_for_keys_and_length_for_ranges() {
    let mut rig = rig();
    let bad_lkey = WorkRequest {
        lkey: rig.source.region.lkey ^ 0x40,
        ..rig.write(1, 0, 64)
    };
    assert_eq!(statuses(&rig.run(&[bad_lkey])), [WcStatus::LocProtErr]);
    let mut rig = self::rig();
    let past_end = rig.write(1, (1 << 20) - 8, 16);
    assert_eq!(statuses(&rig.run(&[past_end])), [WcStatus::LocLenErr]);
    let mut rig = self::rig();
    let into_read_only = WorkRequest {
        local_addr: rig.target.region.addr,
        lkey: rig.initiator_soft_region_without_local_write(),
        ..rig.read(1, 0, 16)
    };
    assert_eq!(
        statuses(&rig.run(&[into_read_only])),
        [WcStatus::LocProtErr]
    );
}

impl Rig {
    /// A registration of the initiator's that does not allow local writes.
    fn initiator_soft_region_without_local_write(&mut self) -> u32 {
        // SAFETY: the target buffer outlives the rig's devices.
        unsafe {
            self.initiator_soft.register(
                self.target.bytes.as_mut_ptr(),
                self.target.bytes.len(),
                Access::REMOTE_READ,
            )
        }
        .expect("registration")
        .lkey
    }
}

#[test]
fn a_cut_connection_is_retry_exceeded_then_flush_and_an_idle_one_raises_qp_fatal() {
    // A target that never serves the connection: nothing is answered until its device
    // closes (the connection is reset).
    let mut rig = rig_with(patient(), Access::ALL, false);
    let writes: Vec<WorkRequest> = (0..4).map(|i| rig.write(i, 0, 65536)).collect();
    rig.fabric.post(rig.qp, &writes).unwrap();
    let mut early = Vec::new();
    for _ in 0..100 {
        rig.fabric.poll(&mut early, 4);
    }
    assert!(
        early.is_empty(),
        "nothing is answered while the target is not served"
    );
    drop(rig.handle.take());
    let done = drain(&mut rig.fabric, 4);
    assert_eq!(
        statuses(&done),
        [
            WcStatus::RetryExcErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr
        ]
    );

    // Cut mid-transfer while served (the target's owner drops the queue pair): what was
    // applied completes, the first request not answered fails, the rest flush.
    let mut rig = self::rig();
    let writes: Vec<WorkRequest> = (0..256).map(|i| rig.write(i, 0, 65536)).collect();
    rig.fabric.post(rig.qp, &writes).unwrap();
    drop(rig.handle.take());
    let done = statuses(&drain(&mut rig.fabric, 256));
    let succeeded = done.iter().take_while(|s| **s == WcStatus::Success).count();
    assert_eq!(done[succeeded], WcStatus::RetryExcErr, "{done:?}");
    assert!(
        done[succeeded + 1..]
            .iter()
            .all(|s| *s == WcStatus::WrFlushErr)
    );

    // With nothing outstanding, the close is an asynchronous QP_FATAL.
    let mut rig = self::rig();
    assert_eq!(
        statuses(&rig.run(&[rig.write(1, 0, 64)])),
        [WcStatus::Success]
    );
    drop(rig.handle.take());
    let end = Instant::now() + BOUND;
    let event = loop {
        assert!(Instant::now() < end, "no QP_FATAL within {BOUND:?}");
        let mut out = Vec::new();
        rig.fabric.poll(&mut out, 1);
        if let Some(event) = rig.fabric.poll_event() {
            break event;
        }
        std::thread::yield_now();
    };
    assert_eq!(event, AsyncEvent::QpFatal { qp: rig.qp });
}

#[test]
fn a_silent_peer_is_retry_exceeded_after_the_peer_timeout() {
    let config = TcpConfig {
        peer_timeout: Duration::from_millis(100),
        ..TcpConfig::default()
    };
    // Never served: the connection is open, nothing answers.
    let mut rig = rig_with(config, Access::ALL, false);
    let started = Instant::now();
    let done = rig.run(&[rig.write(1, 0, 64), rig.write(2, 0, 64)]);
    assert_eq!(
        statuses(&done),
        [WcStatus::RetryExcErr, WcStatus::WrFlushErr]
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < BOUND,
        "{waited:?}"
    );
}

#[test]
fn the_fault_plan_fails_what_it_says_on_this_fabric_too() {
    let mut rig = rig();
    rig.initiator_soft
        .faults()
        .set(FaultPlan::new(7).with(Fault::FailNth {
            on: QpMatch::Any,
            nth: 3,
            status: WcStatus::RemAccessErr,
        }));
    let writes: Vec<WorkRequest> = (0..5).map(|i| rig.write(i, i * 64, 64)).collect();
    assert_eq!(
        statuses(&rig.run(&writes)),
        [
            WcStatus::Success,
            WcStatus::Success,
            WcStatus::RemAccessErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr
        ]
    );

    let mut rig = self::rig();
    rig.initiator_soft
        .faults()
        .set(FaultPlan::new(7).with(Fault::QpFatal {
            on: QpMatch::Endpoint(EndpointId(0)),
            after: 1,
        }));
    let done = rig.run(&[rig.write(1, 0, 64), rig.write(2, 0, 64)]);
    assert_eq!(statuses(&done), [WcStatus::Success, WcStatus::WrFlushErr]);
    assert_eq!(
        rig.fabric.poll_event(),
        Some(AsyncEvent::QpFatal { qp: rig.qp })
    );
}

#[test]
fn a_hello_with_an_unknown_token_or_garbage_is_closed_and_nothing_is_served() {
    let soft = device("target1");
    let target = register(&soft, 4096, 0, Access::ALL);
    let device = TcpDevice::open(&soft, LOCALHOST, TcpConfig::default()).unwrap();
    let _poller = TargetPoller::start(device.fabric().unwrap());
    let initiator_soft = self::device("init1");
    let initiator = TcpDevice::open(&initiator_soft, LOCALHOST, TcpConfig::default()).unwrap();
    let forged = TcpAttachment::Target {
        addr: device.local_addr(),
        token: 12345,
    };
    let (prepared, _) = initiator.create_qp();
    let connected = initiator.connect(prepared, &forged).unwrap();
    let mut fabric = initiator.fabric().unwrap();
    let qp = fabric.adopt(None, connected).unwrap();
    let write = request(
        1,
        Opcode::Write,
        0,
        0,
        target.region.addr,
        target.region.rkey,
        0,
    );
    fabric.post(qp, &[write]).unwrap();
    assert_eq!(statuses(&drain(&mut fabric, 1)), [WcStatus::RetryExcErr]);
    assert!(target.bytes.iter().all(|&b| b == 0));

    // Garbage instead of a hello: the target closes it.
    use std::io::{Read, Write};
    let mut raw = std::net::TcpStream::connect(device.local_addr()).unwrap();
    raw.write_all(&[0xFF; 64]).unwrap();
    raw.set_read_timeout(Some(BOUND)).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "closed without a word");

    // Staging: the poller adopts only what was staged for the endpoint at that epoch.
    let (handle, _, attachment) = device.create_target(LOCALHOST);
    let (prepared, _) = initiator.create_qp();
    let connected = initiator.connect(prepared, &attachment).unwrap();
    initiator.stage(EndpointId(4), Epoch::FIRST.next(), connected);
    assert!(fabric.connect(EndpointId(4), Epoch::FIRST).is_err());
    assert!(fabric.connect(EndpointId(4), Epoch::FIRST.next()).is_ok());
    drop(handle);
}

#[test]
fn a_dial_to_a_closed_port_returns_at_once_and_fails_the_queue_pair_not_the_caller() {
    let soft = device("init2");
    let source = register(&soft, 4096, 1, Access::ALL);
    let device = TcpDevice::open(&soft, LOCALHOST, TcpConfig::default()).unwrap();
    let closed = std::net::TcpListener::bind((LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .unwrap();
    let nowhere = TcpAttachment::Target {
        addr: closed,
        token: 1,
    };
    let mut fabric = device.fabric().unwrap();

    // Nothing posted: the refused connection raises QP_FATAL.
    let (prepared, _) = device.create_qp();
    let started = Instant::now();
    let qp = fabric
        .adopt(None, device.connect(prepared, &nowhere).unwrap())
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "the dial waited"
    );
    let end = Instant::now() + BOUND;
    loop {
        assert!(Instant::now() < end, "no QP_FATAL for a refused connection");
        fabric.serve();
        if let Some(event) = fabric.poll_event() {
            assert_eq!(event, AsyncEvent::QpFatal { qp });
            break;
        }
        std::thread::yield_now();
    }

    // Work posted: it fails with RETRY_EXC_ERR, the rest flushes.
    let (prepared, _) = device.create_qp();
    let qp = fabric
        .adopt(None, device.connect(prepared, &nowhere).unwrap())
        .unwrap();
    let write = request(
        1,
        Opcode::Write,
        source.region.addr,
        source.region.lkey,
        0,
        7,
        64,
    );
    let after = WorkRequest {
        wr_id: railyard_dataplane::fabric::WrId(2),
        ..write
    };
    fabric.post(qp, &[write, after]).unwrap();
    assert_eq!(
        statuses(&drain(&mut fabric, 2)),
        [WcStatus::RetryExcErr, WcStatus::WrFlushErr]
    );
}

/// What a target region holds where no byte was ever meant to land.
const POISON: u8 = 0x5A;

/// How many bytes from the start of `bytes` are `value`.
fn leading(bytes: &[u8], value: u8) -> usize {
    bytes.iter().take_while(|&&b| b == value).count()
}

impl Rig {
    /// Polls the initiator and serves `target` in turns until `count` completions arrived;
    /// fails the test after [`BOUND`].
    fn drain_serving(&mut self, target: &mut TcpFabric, count: usize) -> Vec<WorkCompletion> {
        let end = Instant::now() + BOUND;
        let mut out = Vec::new();
        while out.len() < count {
            assert!(
                Instant::now() < end,
                "only {} of {count} completions within {BOUND:?}: {out:?}",
                out.len()
            );
            let missing = count - out.len();
            let polled = self.fabric.poll(&mut out, missing);
            if !target.serve() && polled == 0 {
                std::thread::yield_now();
            }
        }
        out
    }

    /// Polls the initiator and serves `target` (when given) in turns for `time`; returns
    /// the completions seen.
    fn turns_for(&mut self, mut target: Option<&mut TcpFabric>, time: Duration) -> Vec<WcStatus> {
        let end = Instant::now() + time;
        let mut out = Vec::new();
        while Instant::now() < end {
            let polled = self.fabric.poll(&mut out, usize::MAX);
            let served = target.as_mut().is_some_and(|target| target.serve());
            if !served && polled == 0 {
                std::thread::yield_now();
            }
        }
        statuses(&out)
    }

    /// One small WRITE at the start of the target, served: the target has accepted the
    /// connection and serves the queue pair.
    fn establish(&mut self, target: &mut TcpFabric) {
        let write = self.write(0, 0, 64);
        self.fabric.post(self.qp, &[write]).expect("posted");
        assert_eq!(
            statuses(&self.drain_serving(target, 1)),
            [WcStatus::Success]
        );
    }

    /// Polls the initiator and serves `target` in turns until `landed` says something
    /// landed, then returns how much; fails the test after [`BOUND`].
    fn turns_until_part_landed(
        &mut self,
        target: &mut TcpFabric,
        landed: impl Fn(&Self) -> usize,
    ) -> usize {
        let end = Instant::now() + BOUND;
        let mut out = Vec::new();
        loop {
            assert!(Instant::now() < end, "nothing landed within {BOUND:?}");
            self.fabric.poll(&mut out, usize::MAX);
            target.serve();
            assert!(
                out.is_empty(),
                "completed before the test could cut in: {out:?}"
            );
            let part = landed(self);
            if part > 0 {
                return part;
            }
        }
    }
}

/// A target that answered an error executes nothing more from that connection: the writes
/// after the refused one, which the initiator reports as flushed, never land — even while
/// the target keeps serving.
///
/// Caught on the old code: after REM_ACCESS_ERR the target discarded the refused payload and
/// went back to reading headers, so W3..W20 (reported WR_FLUSH_ERR) all landed. The second
/// part guards the change itself: the target now answers a refused WRITE at its header, while
/// the initiator may still be sending the payload, and that early answer is REM_ACCESS_ERR
/// (taken for a peer speaking out of turn, it was RETRY_EXC_ERR).
#[test]
fn a_target_that_answered_an_error_executes_nothing_after_it() {
    const RANGE: u64 = 16 << 10;
    let mut rig = rig();
    let first = rig.write(1, 0, RANGE as u32);
    let refused = WorkRequest {
        rkey: rig.target.region.rkey ^ 0x40,
        ..rig.write(2, RANGE, RANGE as u32)
    };
    let later = (3..=20).map(|i| rig.write(i, (i - 1) * RANGE, RANGE as u32));
    let requests: Vec<WorkRequest> = [first, refused].into_iter().chain(later).collect();
    let done = statuses(&rig.run(&requests));
    assert_eq!(done[..2], [WcStatus::Success, WcStatus::RemAccessErr]);
    assert!(
        done[2..].iter().all(|s| *s == WcStatus::WrFlushErr),
        "{done:?}"
    );
    // The target's poller keeps serving: nothing more may land.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        rig.target.bytes[..RANGE as usize]
            .iter()
            .all(|&b| b == 0xAB)
    );
    for write in &requests[2..] {
        let at = (write.remote_addr - rig.target.region.addr) as usize;
        let range = &rig.target.bytes[at..at + write.len as usize];
        assert!(
            range.iter().all(|&b| b == 0),
            "W{} was flushed at the initiator but {} of its bytes landed",
            write.wr_id.0,
            range.iter().filter(|&&b| b != 0).count()
        );
    }

    // A refused payload far larger than the socket buffers.
    let mut rig = rig_with(small_buffers(), Access::ALL, true);
    let refused = WorkRequest {
        rkey: rig.target.region.rkey ^ 0x40,
        ..rig.write(1, 0, 1 << 20)
    };
    assert_eq!(
        statuses(&rig.run(&[refused, rig.write(2, 0, 64)])),
        [WcStatus::RemAccessErr, WcStatus::WrFlushErr]
    );
}

/// A retired queue pair closes abortively: the initiator's kernel discards what it had not
/// sent, and the target, seeing the reset, executes nothing of what its own kernel still
/// buffers. Of writes reported as flushed, not one byte lands.
///
/// Caught on the old code: `shutdown(Both)` sent a FIN after the whole send queue, so once
/// the target was served again megabytes of flushed writes landed (8.8 MB here). With the
/// abortive close but without the target's hang-up check, what the target's kernel had
/// received still landed (about 490 KB).
#[test]
fn nothing_of_a_retired_queue_pair_lands_at_the_target() {
    const WRITES: u64 = 64;
    const LEN: u64 = 256 << 10;
    // The target's buffer is set (the kernel doubles it); the initiator's is large, so
    // that its kernel holds megabytes not sent yet when the queue pair is retired.
    const TARGET_BUFFER: usize = 256 << 10;
    let initiator_config = TcpConfig {
        socket_buffer: Some(4 << 20),
        ..patient()
    };
    let target_config = TcpConfig {
        socket_buffer: Some(TARGET_BUFFER),
        ..patient()
    };
    let (mut rig, mut target) = rig_served_by_test(
        initiator_config,
        target_config,
        ((WRITES + 1) * LEN) as usize,
    );
    rig.establish(&mut target);
    // The target is paused while the writes fill both kernels' buffers.
    let writes: Vec<WorkRequest> = (1..=WRITES)
        .map(|i| rig.write(i, i * LEN, LEN as u32))
        .collect();
    rig.fabric.post(rig.qp, &writes).expect("posted");
    assert_eq!(
        rig.turns_for(None, Duration::from_millis(100)),
        [],
        "nothing is answered while the target is paused"
    );
    rig.fabric.retire(rig.qp);
    let flushed = statuses(&drain(&mut rig.fabric, writes.len()));
    assert!(flushed.iter().all(|s| *s == WcStatus::WrFlushErr));
    // Served again: whatever its kernel had received may still be applied, then the reset.
    rig.turns_for(Some(&mut target), Duration::from_millis(300));

    let landed: Vec<usize> = writes
        .iter()
        .map(|write| {
            let at = (write.remote_addr - rig.target.region.addr) as usize;
            let range = &rig.target.bytes[at..at + LEN as usize];
            let landed = leading(range, 0xAB);
            assert!(
                range[landed..].iter().all(|&b| b == 0),
                "W{}: bytes landed after a gap",
                write.wr_id.0
            );
            landed
        })
        .collect();
    let total: usize = landed.iter().sum();
    let posted = (WRITES * LEN) as usize;
    println!("after the retire, {total} of {posted} posted bytes landed");
    assert_eq!(
        total, 0,
        "writes reported flushed landed after the retire: {landed:?}"
    );
}

/// Closing a target queue pair discards what its poller had not applied, and is
/// acknowledged: `TargetClosed::wait` is true once the poller closed the connection (or
/// its fabric is gone), never before, and nothing lands after.
///
/// Caught on the old code: there was no acknowledgment at all (`close` and `TargetClosed`
/// are new). With the poller's checks of the owner's close taken out, `wait` never turns
/// true and the writes waiting in the receive buffer land; with the acknowledgment given at
/// `close` instead of by the poller, the first `wait` is true while nothing has closed.
#[test]
fn closing_a_target_queue_pair_discards_what_it_had_not_applied_and_is_acknowledged() {
    const LEN: u64 = 64 << 10;
    let (mut rig, mut target) = rig_served_by_test(patient(), patient(), 2 << 20);
    rig.establish(&mut target);
    // Paused: the writes wait in the target's receive buffer.
    let writes: Vec<WorkRequest> = (1..=16)
        .map(|i| rig.write(i, i * LEN, LEN as u32))
        .collect();
    rig.fabric.post(rig.qp, &writes).expect("posted");
    assert_eq!(rig.turns_for(None, Duration::from_millis(50)), []);
    let closed = rig.handle.take().expect("a handle").close();
    assert!(
        !closed.wait(Instant::now() + Duration::from_millis(20)),
        "acknowledged while nothing served the connection"
    );
    let end = Instant::now() + BOUND;
    while !closed.wait(Instant::now()) {
        assert!(Instant::now() < end, "no acknowledgment within {BOUND:?}");
        target.serve();
    }
    let after = rig.turns_for(Some(&mut target), Duration::from_millis(200));
    assert_eq!(after.first(), Some(&WcStatus::RetryExcErr), "{after:?}");
    assert_eq!(after.len(), writes.len());
    assert!(
        rig.target.bytes[LEN as usize..].iter().all(|&b| b == 0),
        "{} bytes of the discarded writes landed",
        rig.target.bytes[LEN as usize..]
            .iter()
            .filter(|&&b| b != 0)
            .count()
    );

    // A stopped poller never acknowledges; a dropped fabric (the poller is gone) does.
    let (mut rig, mut target) = rig_served_by_test(patient(), patient(), 1 << 20);
    rig.establish(&mut target);
    let closed = rig.handle.take().expect("a handle").close();
    assert!(!closed.wait(Instant::now() + Duration::from_millis(20)));
    drop(target);
    assert!(closed.wait(Instant::now()));

    // A queue pair no connection named yet: nothing can serve it, acknowledged at once.
    let soft = device("target2");
    let device = TcpDevice::open(&soft, LOCALHOST, TcpConfig::default()).expect("data port");
    let (handle, _, _) = device.create_target(LOCALHOST);
    assert!(handle.close().wait(Instant::now()));
}

/// Socket buffers small enough that a large payload takes many rounds.
fn small_buffers() -> TcpConfig {
    TcpConfig {
        socket_buffer: Some(64 << 10),
        ..patient()
    }
}

/// A target region withdrawn while a WRITE's payload arrives is never written again (the
/// initiator sees REM_ACCESS_ERR), and one withdrawn while a READ's data goes out is never
/// read again (the READ fails).
///
/// Caught on the old code: the target checked the key only when the header arrived, so the
/// rest of the WRITE's payload kept landing in the withdrawn region and the WRITE succeeded;
/// the READ kept sending from the withdrawn region (its new contents reached the initiator)
/// and succeeded.
#[test]
fn a_withdrawn_target_region_is_never_written_or_read_again() {
    const LEN: usize = 4 << 20;
    let (mut rig, mut target) = rig_served_by_test(small_buffers(), small_buffers(), LEN);
    rig.target.bytes.fill(POISON);
    rig.fabric
        .post(rig.qp, &[rig.write(1, 0, LEN as u32)])
        .expect("posted");
    let reached = rig.turns_until_part_landed(&mut target, |rig| leading(&rig.target.bytes, 0xAB));
    assert!(reached < LEN);
    rig.target_soft
        .deregister(&rig.target.region)
        .expect("registered");
    assert_eq!(
        statuses(&rig.drain_serving(&mut target, 1)),
        [WcStatus::RemAccessErr]
    );
    rig.turns_for(Some(&mut target), Duration::from_millis(50));
    let after = &rig.target.bytes[reached..];
    assert!(
        after.iter().all(|&b| b == POISON),
        "{} bytes landed past byte {reached}, where the payload stood at the deregistration",
        after.iter().filter(|&&b| b != POISON).count()
    );

    // A READ whose region is withdrawn, then reused, while its data goes out.
    let (mut rig, mut target) = rig_served_by_test(small_buffers(), small_buffers(), LEN);
    rig.target.bytes.fill(0x77);
    rig.source.bytes.fill(0);
    rig.fabric
        .post(rig.qp, &[rig.read(1, 0, LEN as u32)])
        .expect("posted");
    rig.turns_until_part_landed(&mut target, |rig| leading(&rig.source.bytes, 0x77));
    rig.target_soft
        .deregister(&rig.target.region)
        .expect("registered");
    rig.target.bytes.fill(0xEE);
    let status = statuses(&rig.drain_serving(&mut target, 1))[0];
    assert_ne!(status, WcStatus::Success);
    rig.turns_for(Some(&mut target), Duration::from_millis(50));
    assert!(
        !rig.source.bytes.contains(&0xEE),
        "the target read the region after its deregistration"
    );
}

/// A local region withdrawn while a WRITE's payload is being sent is never read again:
/// LOC_PROT_ERR, and nothing the application puts there afterwards reaches the target; one
/// withdrawn while a READ's data arrives is never written again: LOC_PROT_ERR.
///
/// Caught on the old code: the initiator checked the local key only when it judged the
/// request, so it kept sending the source's new contents (the WRITE succeeded) and kept
/// receiving the READ's data into the withdrawn destination (the READ succeeded).
#[test]
fn a_withdrawn_local_region_is_never_read_or_written_again() {
    const LEN: usize = 4 << 20;
    let (mut rig, mut target) = rig_served_by_test(small_buffers(), small_buffers(), LEN);
    rig.fabric
        .post(rig.qp, &[rig.write(1, 0, LEN as u32)])
        .expect("posted");
    rig.turns_until_part_landed(&mut target, |rig| leading(&rig.target.bytes, 0xAB));
    rig.initiator_soft
        .deregister(&rig.source.region)
        .expect("registered");
    // The application reuses the memory it was told is free.
    rig.source.bytes.fill(0xCD);
    assert_eq!(
        statuses(&rig.drain_serving(&mut target, 1)),
        [WcStatus::LocProtErr]
    );
    rig.turns_for(Some(&mut target), Duration::from_millis(50));
    assert!(
        !rig.target.bytes.contains(&0xCD),
        "the initiator read the source after its deregistration"
    );

    let (mut rig, mut target) = rig_served_by_test(small_buffers(), small_buffers(), LEN);
    rig.target.bytes.fill(0x77);
    rig.source.bytes.fill(POISON);
    rig.fabric
        .post(rig.qp, &[rig.read(1, 0, LEN as u32)])
        .expect("posted");
    let reached = rig.turns_until_part_landed(&mut target, |rig| leading(&rig.source.bytes, 0x77));
    assert!(reached < LEN);
    rig.initiator_soft
        .deregister(&rig.source.region)
        .expect("registered");
    assert_eq!(
        statuses(&rig.drain_serving(&mut target, 1)),
        [WcStatus::LocProtErr]
    );
    rig.turns_for(Some(&mut target), Duration::from_millis(50));
    let after = &rig.source.bytes[reached..];
    assert!(
        after.iter().all(|&b| b == POISON),
        "{} bytes landed past byte {reached}, where the data stood at the deregistration",
        after.iter().filter(|&&b| b != POISON).count()
    );
}

/// Reads from `stream` until it says something about its end: `true` if the other side
/// closed it (end of stream or reset), `false` if it is still open after `wait`.
fn closed_within(stream: &mut std::net::TcpStream, wait: Duration) -> bool {
    use std::io::Read;
    stream.set_read_timeout(Some(wait)).expect("a read timeout");
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(error) => !matches!(
            error.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn connections_that_never_say_hello_are_capped_oldest_first_and_a_real_peer_still_transfers() {
    const CAP: usize = 4;
    const SILENT: usize = 40;
    let target_config = TcpConfig {
        max_half_open: CAP,
        connect_timeout: BOUND,
        ..patient()
    };
    let (mut rig, mut target_fabric) = rig_served_by_test(patient(), target_config, 4096);
    let port = rig.target_device.local_addr();
    // The real peer's connection and its hello (sent by the initiator's first rounds) wait
    // in the backlog; then a crowd that says nothing, more than one round accepts.
    for _ in 0..8 {
        rig.fabric.serve();
    }
    let mut silent: Vec<std::net::TcpStream> = (0..SILENT)
        .map(|_| std::net::TcpStream::connect(port).expect("loopback connects"))
        .collect();
    let device = rig.target_device.clone();
    let served = |_: &TcpFabric| device.served();
    let deadline = Instant::now() + BOUND;
    while served(&target_fabric).half_open_closed < (SILENT - CAP) as u64 {
        assert!(Instant::now() < deadline, "the cap never closed the crowd");
        target_fabric.serve();
    }
    assert_eq!(
        served(&target_fabric).half_open_closed,
        (SILENT - CAP) as u64,
        "exactly the ones beyond the cap"
    );
    // The oldest were closed; the newest CAP still wait for their hello.
    for (index, stream) in silent.iter_mut().enumerate() {
        let closed = closed_within(
            stream,
            Duration::from_millis(if index < SILENT - CAP { 2_000 } else { 50 }),
        );
        assert_eq!(
            closed,
            index < SILENT - CAP,
            "connection {index} of {SILENT}"
        );
    }
    // The real peer, accepted first, said its hello in time and still transfers.
    let _poller = TargetPoller::start(target_fabric);
    let completions = rig.run(&[rig.write(1, 0, 4096)]);
    assert_eq!(statuses(&completions), [WcStatus::Success]);
    assert!(rig.target.bytes.iter().all(|&b| b == 0xAB));
}
