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
}

fn rig_with(config: TcpConfig, target_access: Access, serve: bool) -> Rig {
    let initiator_soft = device("init0");
    let target_soft = device("target0");
    let source = register(&initiator_soft, 1 << 20, 0xAB, Access::LOCAL_WRITE);
    let target = register(&target_soft, 1 << 20, 0, target_access);
    let initiator =
        TcpDevice::open(&initiator_soft, LOCALHOST, config.clone()).expect("loopback set-up");
    let target_device = TcpDevice::open(&target_soft, LOCALHOST, config).expect("loopback set-up");
    let (handle, _, attachment) = target_device.create_target(LOCALHOST);
    let (prepared, _) = initiator.create_qp();
    let connected = initiator
        .connect(prepared, &attachment)
        .expect("loopback set-up");
    let target_fabric = target_device.fabric().expect("loopback set-up");
    let target_poller = serve.then(|| TargetPoller::start(target_fabric));
    let mut fabric = initiator.fabric().expect("loopback set-up");
    let qp = fabric
        .adopt(Some(EndpointId(0)), connected)
        .expect("loopback set-up");
    Rig {
        source,
        target,
        fabric,
        qp,
        handle: Some(handle),
        _target_poller: target_poller,
        initiator_soft,
        target_soft,
    }
}

fn rig() -> Rig {
    rig_with(TcpConfig::default(), Access::ALL, true)
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
    let mut rig = rig_with(TcpConfig::default(), Access::REMOTE_WRITE, true);
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
    let mut rig = rig_with(TcpConfig::default(), Access::ALL, false);
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
