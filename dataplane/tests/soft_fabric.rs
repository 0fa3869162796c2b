//! The soft fabric within one process, through its public API: bytes move, every verbs
//! status appears where verbs gives it, the queue-pair rules hold, and the fault plan fails
//! exactly what it says.

#![cfg(not(loom))]

mod soft_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::soft::{
    Fault, FaultPlan, QpMatch, SoftConfig, SoftDevice, SoftError, SoftFabric, handshake,
};
use railyard_dataplane::fabric::{
    Access, AsyncEvent, Fabric, FabricError, Opcode, QpNum, QpState, WcStatus, WorkCompletion,
};
use railyard_dataplane::{EndpointId, Epoch, SliceSpec};
use soft_common::{BOUND, Registered, device, drain, loopback, register, request, socket_path};

/// A device with a source and a target buffer and a fabric owning a connected queue pair.
struct Rig {
    source: Box<Registered>,
    target: Box<Registered>,
    fabric: SoftFabric,
    qp: QpNum,
    responder: railyard_dataplane::fabric::soft::SoftQp,
    device: SoftDevice,
}

/// `responder_access`: what the accepting queue pair lets the dialer do.
fn rig_with(responder_access: Access, target_access: Access) -> Rig {
    let device = device("soft0");
    let source = register(&device, 1 << 20, 0xAB, Access::LOCAL_WRITE);
    let target = register(&device, 1 << 20, 0, target_access);
    let (dialer, responder) = loopback(&device, responder_access);
    let mut fabric = device.fabric();
    let qp = fabric
        .adopt(Some(EndpointId(0)), dialer)
        .expect("RTS queue pair");
    Rig {
        source,
        target,
        fabric,
        qp,
        responder,
        device,
    }
}

fn rig() -> Rig {
    rig_with(Access::ALL, Access::ALL)
}

impl Rig {
    fn write(&self, id: u64, offset: u64, len: u32) -> railyard_dataplane::fabric::WorkRequest {
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

    fn post_one(&mut self, request: railyard_dataplane::fabric::WorkRequest) -> WorkCompletion {
        self.fabric.post(self.qp, &[request]).expect("posted");
        drain(&mut self.fabric, 1)[0]
    }
}

fn statuses(completions: &[WorkCompletion]) -> Vec<WcStatus> {
    completions.iter().map(|c| c.status).collect()
}

#[test]
fn write_read_and_write_with_imm_move_the_bytes() {
    let mut rig = rig();
    rig.source.bytes[..8].copy_from_slice(b"railyard");
    let done = rig.post_one(rig.write(1, 0, 4096));
    assert_eq!(
        (done.status, done.byte_len, done.qp),
        (WcStatus::Success, 4096, rig.qp)
    );
    assert_eq!(&rig.target.bytes[..8], b"railyard");
    assert!(rig.target.bytes[8..4096].iter().all(|&b| b == 0xAB));
    assert!(
        rig.target.bytes[4096..].iter().all(|&b| b == 0),
        "nothing past the range"
    );

    rig.target.bytes[100..104].copy_from_slice(b"back");
    let read = request(
        2,
        Opcode::Read,
        rig.source.region.addr + 8192,
        rig.source.region.lkey,
        rig.target.region.addr + 100,
        rig.target.region.rkey,
        4,
    );
    assert_eq!(rig.post_one(read).status, WcStatus::Success);
    assert_eq!(&rig.source.bytes[8192..8196], b"back");

    let mut inbox = rig.responder.take_recv_queue().expect("first take");
    let with_imm = railyard_dataplane::fabric::WorkRequest {
        opcode: Opcode::WriteWithImm,
        imm: 0xFEED,
        ..rig.write(3, 65536, 512)
    };
    assert_eq!(rig.post_one(with_imm).status, WcStatus::Success);
    let mut received = Vec::new();
    assert_eq!(inbox.poll(&mut received, 8), 1);
    assert_eq!((received[0].imm, received[0].byte_len), (0xFEED, 512));
    assert!(
        rig.target.bytes[65536..65536 + 512]
            .iter()
            .all(|&b| b == 0xAB)
    );
}

#[test]
fn a_zero_length_write_with_imm_is_a_bare_notification_and_checks_no_key() {
    let mut rig = rig();
    // No memory named, so neither key matters (as in verbs).
    let bare = railyard_dataplane::fabric::WorkRequest {
        opcode: Opcode::WriteWithImm,
        imm: 0xC0DE,
        lkey: 0,
        rkey: 0,
        local_addr: 0,
        remote_addr: 0,
        ..rig.write(1, 0, 0)
    };
    assert_eq!(rig.post_one(bare).status, WcStatus::Success);
    let mut immediates = Vec::new();
    rig.responder.take_immediates(&mut immediates);
    assert_eq!(immediates, [0xC0DE]);
    rig.responder.take_immediates(&mut immediates);
    assert_eq!(immediates, [0xC0DE], "each immediate is taken once");
    // A zero-length plain write with a bad key also succeeds and delivers nothing.
    let plain = railyard_dataplane::fabric::WorkRequest {
        opcode: Opcode::Write,
        ..bare
    };
    assert_eq!(rig.post_one(plain).status, WcStatus::Success);
    immediates.clear();
    rig.responder.take_immediates(&mut immediates);
    assert!(immediates.is_empty());
}

#[test]
fn unsignaled_successes_are_silent_but_errors_always_report() {
    let mut rig = rig();
    let quiet = |id| railyard_dataplane::fabric::WorkRequest {
        signaled: false,
        ..rig.write(id, 0, 64)
    };
    let bad = railyard_dataplane::fabric::WorkRequest {
        rkey: 0,
        ..quiet(3)
    };
    let posted = [quiet(1), quiet(2), bad, quiet(4)];
    rig.fabric.post(rig.qp, &posted).expect("posted");
    let out = drain(&mut rig.fabric, 2);
    assert_eq!(
        statuses(&out),
        [WcStatus::RemAccessErr, WcStatus::WrFlushErr]
    );
    assert_eq!(out[0].wr_id.0, 3);
    let mut more = Vec::new();
    assert_eq!(
        rig.fabric.poll(&mut more, 8),
        0,
        "the two successes were unsignaled"
    );
}

#[test]
fn local_errors_are_protection_for_keys_and_length_for_ranges() {
    let mut rig = rig();
    let unknown_lkey = railyard_dataplane::fabric::WorkRequest {
        lkey: 0x7777_0001,
        ..rig.write(1, 0, 64)
    };
    assert_eq!(rig.post_one(unknown_lkey).status, WcStatus::LocProtErr);

    let mut rig = self::rig();
    let past_the_end = rig.write(1, (1 << 20) - 32, 64);
    assert_eq!(rig.post_one(past_the_end).status, WcStatus::LocLenErr);

    // READ into memory registered without LOCAL_WRITE.
    let mut rig = self::rig();
    let read_only = register(&rig.device, 4096, 0, Access::NONE);
    let read = request(
        1,
        Opcode::Read,
        read_only.region.addr,
        read_only.region.lkey,
        rig.target.region.addr,
        rig.target.region.rkey,
        64,
    );
    assert_eq!(rig.post_one(read).status, WcStatus::LocProtErr);

    let mut rig = self::rig();
    let too_long = rig.write(1, 0, (1 << 31) + 1);
    assert_eq!(rig.post_one(too_long).status, WcStatus::LocLenErr);
}

#[test]
fn remote_errors_are_access_for_keys_and_ranges_and_invalid_request_for_the_queue_pair() {
    let mut rig = rig();
    let unknown_rkey = railyard_dataplane::fabric::WorkRequest {
        rkey: 0x0123_4fff,
        ..rig.write(1, 0, 64)
    };
    assert_eq!(rig.post_one(unknown_rkey).status, WcStatus::RemAccessErr);

    let mut rig = self::rig();
    let mut out_of_bounds = rig.write(1, 0, 64);
    out_of_bounds.remote_addr = rig.target.region.addr + (1 << 20) - 8;
    assert_eq!(rig.post_one(out_of_bounds).status, WcStatus::RemAccessErr);

    // The target region allows READ only.
    let mut rig = rig_with(Access::ALL, Access::REMOTE_READ);
    assert_eq!(
        rig.post_one(rig.write(1, 0, 64)).status,
        WcStatus::RemAccessErr
    );

    // The peer's queue pair allows READ only: the request itself is invalid there.
    let mut rig = rig_with(Access::REMOTE_READ, Access::ALL);
    assert_eq!(
        rig.post_one(rig.write(1, 0, 64)).status,
        WcStatus::RemInvReqErr
    );
}

#[test]
fn after_an_error_everything_outstanding_and_later_is_flushed() {
    let mut rig = rig();
    let bad = railyard_dataplane::fabric::WorkRequest {
        rkey: 0,
        ..rig.write(2, 0, 64)
    };
    let list = [
        rig.write(1, 0, 64),
        bad,
        rig.write(3, 64, 64),
        rig.write(4, 128, 64),
    ];
    rig.fabric.post(rig.qp, &list).expect("posted");
    let out = drain(&mut rig.fabric, 4);
    assert_eq!(
        statuses(&out),
        [
            WcStatus::Success,
            WcStatus::RemAccessErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr
        ]
    );
    assert_eq!(rig.fabric.qp_state(rig.qp), Some(QpState::Error));
    rig.fabric
        .post(rig.qp, &[rig.write(5, 0, 64)])
        .expect("posting to ERR is allowed");
    assert_eq!(drain(&mut rig.fabric, 1)[0].status, WcStatus::WrFlushErr);
    assert!(
        rig.target.bytes[64..192].iter().all(|&b| b == 0),
        "flushed work moved nothing"
    );

    rig.fabric.retire(rig.qp);
    assert_eq!(rig.fabric.qp_state(rig.qp), None);
    let refused = rig.fabric.post(rig.qp, &[rig.write(6, 0, 64)]).unwrap_err();
    assert!(matches!(refused.error, FabricError::UnknownQp { .. }));
}

#[test]
fn a_deregistration_is_seen_by_requests_already_posted() {
    let mut rig = rig();
    let list: Vec<_> = (0..4).map(|i| rig.write(i, i * 4096, 4096)).collect();
    rig.fabric
        .post(rig.qp, &list)
        .expect("posted, not executed yet");
    rig.device
        .deregister(&rig.target.region)
        .expect("registered");
    let out = drain(&mut rig.fabric, 4);
    assert_eq!(statuses(&out)[0], WcStatus::RemAccessErr);
    assert!(
        statuses(&out)[1..]
            .iter()
            .all(|s| *s == WcStatus::WrFlushErr)
    );
    assert!(rig.target.bytes.iter().all(|&b| b == 0));
    assert!(matches!(
        rig.device.deregister(&rig.target.region),
        Err(SoftError::Region(_))
    ));
}

#[test]
fn retire_flushes_what_is_outstanding() {
    let mut rig = rig();
    let list: Vec<_> = (0..3).map(|i| rig.write(i, 0, 64)).collect();
    rig.fabric.post(rig.qp, &list).expect("posted");
    rig.fabric.retire(rig.qp);
    let out = drain(&mut rig.fabric, 3);
    assert!(statuses(&out).iter().all(|s| *s == WcStatus::WrFlushErr));
}

#[test]
fn the_send_queue_has_a_depth() {
    let device = SoftDevice::open(
        "soft0",
        SoftConfig {
            send_queue_depth: 4,
            ..SoftConfig::default()
        },
    )
    .expect("opens");
    let source = register(&device, 4096, 1, Access::ALL);
    let (dialer, _responder) = loopback(&device, Access::ALL);
    let mut fabric = device.fabric();
    let qp = fabric.adopt(None, dialer).expect("RTS");
    let list: Vec<_> = (0..6)
        .map(|i| {
            request(
                i,
                Opcode::Write,
                source.region.addr,
                source.region.lkey,
                source.region.addr + 2048,
                source.region.rkey,
                8,
            )
        })
        .collect();
    let refused = fabric.post(qp, &list).unwrap_err();
    assert_eq!(refused.posted, 4);
    assert!(matches!(refused.error, FabricError::SendQueueFull { .. }));
    assert_eq!(drain(&mut fabric, 4).len(), 4);
}

#[test]
fn the_fault_plan_fails_the_nth_request_and_flapping_queue_pairs_die_after_m() {
    let mut rig = rig();
    rig.device.faults().set(
        FaultPlan::new(7)
            .with(Fault::FailNth {
                on: QpMatch::Ordinal(0),
                nth: 3,
                status: WcStatus::LocLenErr,
            })
            .with(Fault::Flap {
                on: QpMatch::Endpoint(EndpointId(1)),
                after: 2,
            }),
    );
    let list: Vec<_> = (0..5).map(|i| rig.write(i, 0, 64)).collect();
    rig.fabric.post(rig.qp, &list).expect("posted");
    assert_eq!(
        statuses(&drain(&mut rig.fabric, 5)),
        [
            WcStatus::Success,
            WcStatus::Success,
            WcStatus::LocLenErr,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr
        ]
    );
    // Every new queue pair of endpoint 1 works for two requests, then fails.
    for _ in 0..3 {
        let (dialer, _responder) = loopback(&rig.device, Access::ALL);
        let qp = rig.fabric.adopt(Some(EndpointId(1)), dialer).expect("RTS");
        let list: Vec<_> = (0..4).map(|i| rig.write(i, 0, 64)).collect();
        rig.fabric.post(qp, &list).expect("posted");
        assert_eq!(
            statuses(&drain(&mut rig.fabric, 4)),
            [
                WcStatus::Success,
                WcStatus::Success,
                WcStatus::RetryExcErr,
                WcStatus::WrFlushErr
            ]
        );
    }
}

#[test]
fn a_fatal_queue_pair_raises_an_event_and_flushes() {
    let mut rig = rig();
    rig.device.faults().add(Fault::QpFatal {
        on: QpMatch::Any,
        after: 1,
    });
    let list: Vec<_> = (0..3).map(|i| rig.write(i, 0, 64)).collect();
    rig.fabric.post(rig.qp, &list).expect("posted");
    assert_eq!(
        statuses(&drain(&mut rig.fabric, 3)),
        [
            WcStatus::Success,
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr
        ]
    );
    assert_eq!(
        rig.fabric.poll_event(),
        Some(AsyncEvent::QpFatal { qp: rig.qp })
    );
    assert_eq!(rig.fabric.poll_event(), None);
    assert_eq!(rig.fabric.qp_state(rig.qp), Some(QpState::Error));
}

#[test]
fn delayed_completions_arrive_late_and_in_order() {
    let mut rig = rig();
    rig.device.faults().add(Fault::Delay {
        on: QpMatch::Any,
        min: Duration::from_millis(20),
        max: Duration::from_millis(40),
    });
    let list: Vec<_> = (0..8).map(|i| rig.write(i, i * 64, 64)).collect();
    let posted_at = Instant::now();
    rig.fabric.post(rig.qp, &list).expect("posted");
    let mut out = Vec::new();
    rig.fabric.poll(&mut out, 8);
    assert!(out.is_empty(), "nothing is visible before the delay");
    let out = drain(&mut rig.fabric, 8);
    assert!(posted_at.elapsed() >= Duration::from_millis(20));
    let ids: Vec<u64> = out.iter().map(|c| c.wr_id.0).collect();
    assert_eq!(ids, (0..8).collect::<Vec<_>>());
    assert!(statuses(&out).iter().all(|s| *s == WcStatus::Success));
}

#[test]
fn a_killed_link_fails_with_retry_exceeded_until_it_heals() {
    let mut rig = rig();
    let faults = rig.device.faults();
    faults.add(Fault::KillLink {
        on: QpMatch::Endpoint(EndpointId(0)),
    });
    rig.fabric
        .post(rig.qp, &[rig.write(1, 0, 64), rig.write(2, 0, 64)])
        .expect("posted");
    assert_eq!(
        statuses(&drain(&mut rig.fabric, 2)),
        [WcStatus::RetryExcErr, WcStatus::WrFlushErr]
    );
    assert!(rig.target.bytes.iter().all(|&b| b == 0));
    faults.clear();
    let (dialer, _responder) = loopback(&rig.device, Access::ALL);
    let healed = rig.fabric.adopt(Some(EndpointId(0)), dialer).expect("RTS");
    rig.fabric
        .post(healed, &[rig.write(3, 0, 64)])
        .expect("posted");
    assert_eq!(drain(&mut rig.fabric, 1)[0].status, WcStatus::Success);
}

#[test]
fn seeded_random_faults_repeat_exactly() {
    let run = |seed: u64| {
        let mut rig = rig();
        rig.device
            .faults()
            .set(FaultPlan::new(seed).with(Fault::Random {
                on: QpMatch::Any,
                per_million: 50_000,
                status: WcStatus::RemAccessErr,
            }));
        // One queue pair per attempt: a failure takes it down, as verbs would.
        let mut first_failure = Vec::new();
        for _ in 0..8 {
            let (dialer, _responder) = loopback(&rig.device, Access::ALL);
            let qp = rig.fabric.adopt(None, dialer).expect("RTS");
            let list: Vec<_> = (0..64).map(|i| rig.write(i, 0, 8)).collect();
            rig.fabric.post(qp, &list).expect("posted");
            let out = drain(&mut rig.fabric, 64);
            first_failure.push(out.iter().position(|c| c.status != WcStatus::Success));
        }
        first_failure
    };
    let first = run(11);
    assert_eq!(first, run(11));
    assert!(
        first.iter().any(Option::is_some),
        "5 % of 512 requests fail: {first:?}"
    );
    assert_ne!(first, run(12));
}

#[test]
fn connect_adopts_only_the_queue_pair_staged_for_that_epoch() {
    let device = device("soft0");
    let mut fabric = device.fabric();
    let endpoint = EndpointId(4);
    let missing = fabric.connect(endpoint, Epoch::FIRST).unwrap_err();
    assert!(
        missing
            .to_string()
            .contains("no connected queue pair is staged"),
        "{missing}"
    );

    let (dialer, _responder) = loopback(&device, Access::ALL);
    device
        .stage(endpoint, Epoch::FIRST.next(), dialer)
        .expect("RTS queue pairs can be staged");
    let wrong_epoch = fabric.connect(endpoint, Epoch::FIRST).unwrap_err();
    assert!(
        wrong_epoch.to_string().contains("one is staged at"),
        "{wrong_epoch}"
    );
    let qp = fabric
        .connect(endpoint, Epoch::FIRST.next())
        .expect("staged");
    assert_eq!(fabric.qp_state(qp), Some(QpState::ReadyToSend));

    let fresh = device.create_qp(Access::ALL).expect("qp");
    assert!(matches!(
        device.stage(endpoint, Epoch::FIRST, fresh),
        Err(SoftError::NotReady {
            state: QpState::Reset,
            ..
        })
    ));
}

#[test]
fn the_queue_pair_state_machine_refuses_skipped_steps() {
    let device = device("soft0");
    let mut qp = device.create_qp(Access::ALL).expect("qp");
    assert_eq!(qp.state(), QpState::Reset);
    assert!(matches!(
        qp.modify_to_rts(),
        Err(SoftError::InvalidTransition {
            from: QpState::Reset,
            to: QpState::ReadyToSend,
            ..
        })
    ));
    qp.modify_to_init().expect("RESET → INIT");
    assert!(
        qp.modify_to_init().is_err(),
        "INIT → INIT is not a transition"
    );
    assert!(qp.modify_to_rts().is_err(), "INIT → RTS skips RTR");
    qp.modify_to_error();
    assert_eq!(qp.state(), QpState::Error);
    qp.reset();
    assert_eq!(qp.state(), QpState::Reset);
    let info = qp.info();
    assert_eq!((info.lid, info.path_mtu), (0, 4096));
    assert!(info.psn < 1 << 24);
    assert_eq!(&info.gid[..8], &device.incarnation().to_le_bytes());
}

#[test]
fn a_malformed_handshake_is_rejected_with_its_reason() {
    let device = device("soft0");
    let listener = handshake::SoftListener::bind(&device, socket_path("bad")).expect("binds");
    std::thread::scope(|scope| {
        let accept = scope.spawn(|| listener.accept(Access::ALL));
        let mut garbage = UnixStream::connect(listener.path()).expect("connects");
        garbage.set_read_timeout(Some(BOUND)).expect("timeout");
        garbage.write_all(&[0x5a; 256]).expect("writes");
        let mut answer = Vec::new();
        garbage
            .read_to_end(&mut answer)
            .expect("the listener answers and closes");
        let reason = String::from_utf8_lossy(&answer);
        assert!(reason.contains("bad magic"), "{reason}");
        let error = accept.join().expect("no panic").unwrap_err();
        assert!(error.to_string().contains("bad magic"), "{error}");
    });
    let nobody = handshake::dial(&device, socket_path("nobody"), Access::ALL).unwrap_err();
    assert!(matches!(nobody, SoftError::Handshake { .. }), "{nobody}");
}

/// Eight requests of `opcode`, one 4 KiB slice each, between the same offsets of `local`
/// and `remote`, for `endpoint` at the first epoch.
fn eight_requests(
    opcode: Opcode,
    local: &Registered,
    remote: &Registered,
    endpoint: EndpointId,
) -> Vec<SliceSpec> {
    (0..8u32)
        .map(|i| SliceSpec {
            rail: 0,
            request: i,
            opcode,
            local_addr: local.region.addr + u64::from(i) * 4096,
            lkey: local.region.lkey,
            remote_addr: remote.region.addr + u64::from(i) * 4096,
            rkey: remote.region.rkey,
            len: 4096,
            imm: 0,
            endpoint,
            epoch: Epoch::FIRST,
            generation: 0,
        })
        .collect()
}

#[test]
fn a_poller_on_the_soft_fabric_reports_a_fatal_queue_pair_and_retries_at_the_next_epoch() {
    use railyard_dataplane::{
        Command, Event, IdleStrategy, PollerConfig, PollerHandle, RequestOutcome, Submitter,
    };
    let device = device("rail0");
    let source = register(&device, 1 << 16, 0x5A, Access::LOCAL_WRITE);
    let target = register(&device, 1 << 16, 0, Access::ALL);
    let endpoint = EndpointId(0);
    let (dialer, _first_responder) = loopback(&device, Access::ALL);
    device.stage(endpoint, Epoch::FIRST, dialer).expect("RTS");
    device.faults().add(Fault::QpFatal {
        on: QpMatch::Ordinal(0),
        after: 2,
    });
    let config = PollerConfig {
        idle: IdleStrategy::gentle(),
        ..PollerConfig::new("rail0")
    };
    let poller = PollerHandle::spawn(
        config,
        device.fabric(),
        |slice: &mut railyard_dataplane::Slice, epoch, _| {
            slice.epoch = epoch; // keys and addresses do not change in this test
            Ok(())
        },
    )
    .expect("starts");
    let mut events = poller.take_events().expect("first take");
    poller
        .send(Command::AddEndpoint {
            endpoint,
            epoch: Epoch::FIRST,
        })
        .expect("running");
    let mut submitter = Submitter::new(&[&poller], 64).expect("running");
    let specs = eight_requests(Opcode::Write, &source, &target, endpoint);
    let batch = submitter
        .submit(8, &specs, Instant::now() + BOUND)
        .expect("valid");
    let end = Instant::now() + BOUND;
    let fatal = loop {
        assert!(Instant::now() < end, "no QpFatal event");
        match events.pop() {
            Some(Event::Confirmed { .. }) => continue,
            Some(event) => break event,
            None => {}
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(
        fatal,
        Event::QpFatal {
            endpoint,
            epoch: Epoch::FIRST
        }
    );
    // The owner of endpoints reconnects at the next epoch; the flushed slices go there.
    let (dialer, _second_responder) = loopback(&device, Access::ALL);
    device
        .stage(endpoint, Epoch::FIRST.next(), dialer)
        .expect("RTS");
    poller
        .send(Command::BumpEpoch {
            endpoint,
            epoch: Epoch::FIRST.next(),
        })
        .expect("running");
    assert!(batch.wait(Instant::now() + BOUND).is_complete());
    for request in 0..8 {
        assert_eq!(batch.outcome(request), Some(RequestOutcome::Done));
    }
    assert!(target.bytes[..8 * 4096].iter().all(|&b| b == 0x5A));
    assert!(poller.counters().reprepared >= 1);
}

/// Runs 8 requests of `opcode` on a stalled queue pair with a 50 ms deadline; once they are
/// reported timed out, the caller reuses its local buffer (fills it with 0xB2), and the
/// peer answers again. Returns (local bytes, remote bytes) 100 ms later.
fn timed_out_then_reused(opcode: Opcode) -> (Vec<u8>, Vec<u8>) {
    use railyard_dataplane::{
        Command, FailReason, IdleStrategy, PollerConfig, PollerHandle, RequestOutcome, Submitter,
    };
    let device = device("rail0");
    let mut local = register(&device, 1 << 16, 0xA1, Access::ALL);
    let remote = register(&device, 1 << 16, 0xC3, Access::ALL);
    let endpoint = EndpointId(0);
    let (dialer, _responder) = loopback(&device, Access::ALL);
    device.stage(endpoint, Epoch::FIRST, dialer).expect("RTS");
    device.faults().add(Fault::Stall { on: QpMatch::Any });
    let config = PollerConfig {
        idle: IdleStrategy::gentle(),
        ..PollerConfig::new("rail0")
    };
    let poller = PollerHandle::spawn(config, device.fabric(), railyard_dataplane::FailStale)
        .expect("starts");
    poller
        .send(Command::AddEndpoint {
            endpoint,
            epoch: Epoch::FIRST,
        })
        .expect("running");
    let mut submitter = Submitter::new(&[&poller], 64).expect("running");
    let specs = eight_requests(opcode, &local, &remote, endpoint);
    let batch = submitter
        .submit(8, &specs, Instant::now() + Duration::from_millis(50))
        .expect("valid");
    assert!(batch.wait(Instant::now() + BOUND).is_complete());
    for request in 0..8 {
        assert_eq!(
            batch.outcome(request),
            Some(RequestOutcome::Failed(FailReason::Timeout))
        );
    }
    // The caller reuses its buffer at once; then the peer answers again.
    local.bytes.fill(0xB2);
    device.faults().clear();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(poller.counters().unflushed, 0);
    drop(poller);
    (local.bytes.clone(), remote.bytes.clone())
}

/// Caught: before the fix the deadline sweep reported the posted writes as timed out while
/// they still sat in the stalled queue pair's send queue; when the peer answered again they
/// executed, copying the source the caller had already overwritten (the target received the
/// new pattern after every request was reported failed).
#[test]
fn a_timed_out_write_never_reads_its_source_after_it_is_reported() {
    let (_, remote) = timed_out_then_reused(Opcode::Write);
    assert!(
        !remote.contains(&0xB2),
        "the reused source reached the target after its request was reported"
    );
}

/// The same for READs: a destination handed back by a timed-out READ is never written by
/// it (before the fix, the peer's bytes overwrote what the caller put there).
#[test]
fn a_timed_out_read_never_writes_its_destination_after_it_is_reported() {
    let (local, _) = timed_out_then_reused(Opcode::Read);
    assert!(
        local.iter().all(|&b| b == 0xB2),
        "a READ landed in the destination after its request was reported"
    );
}

#[test]
fn an_engine_buffer_is_registered_until_it_drops() {
    let mut rig = rig();
    assert!(matches!(
        rig.device.alloc(0, Access::ALL),
        Err(SoftError::Region(_))
    ));
    let buffer = rig.device.alloc(1 << 16, Access::ALL).expect("allocates");
    let region = buffer.region();
    assert_eq!((region.addr, region.len), (buffer.as_ptr() as u64, 1 << 16));
    let into_buffer = railyard_dataplane::fabric::WorkRequest {
        remote_addr: region.addr + 100,
        rkey: region.rkey,
        ..rig.write(1, 0, 64)
    };
    assert_eq!(rig.post_one(into_buffer).status, WcStatus::Success);
    // SAFETY:
    // - The write above completed; nothing else writes the buffer.
    let bytes = unsafe { buffer.as_slice() };
    assert!(bytes[100..164].iter().all(|&b| b == 0xAB));
    assert!(bytes[..100].iter().all(|&b| b == 0), "fresh pages are zero");
    drop(buffer);
    assert_eq!(rig.post_one(into_buffer).status, WcStatus::RemAccessErr);
}

#[test]
fn a_busy_queue_pair_does_not_starve_another() {
    let mut rig = rig();
    let (dialer, _responder) = loopback(&rig.device, Access::ALL);
    let quiet = rig.fabric.adopt(None, dialer).expect("RTS");
    let busy_list: Vec<_> = (0..256).map(|i| rig.write(i, 0, 1 << 20)).collect();
    rig.fabric.post(rig.qp, &busy_list).expect("posted");
    rig.fabric
        .post(quiet, &[rig.write(9999, 0, 64)])
        .expect("posted");
    let mut out = Vec::new();
    for _ in 0..2 {
        rig.fabric.poll(&mut out, 64);
    }
    assert!(
        out.iter().any(|c| c.qp == quiet),
        "the quiet queue pair ran within two polls ({} completions of the busy one)",
        out.len()
    );
    assert!(
        out.len() < 256,
        "a poll returns long before the busy queue drains"
    );
}

#[test]
fn queue_pairs_connect_from_info_and_attachment_alone() {
    use railyard_dataplane::fabric::soft::SoftAttachment;
    let (a, b) = (device("a"), device("b"));
    let source = register(&a, 4096, 0x11, Access::LOCAL_WRITE);
    let target = register(&b, 4096, 0, Access::REMOTE_WRITE);
    let (mut qp_a, mut qp_b) = (
        a.create_qp(Access::NONE).expect("qp"),
        b.create_qp(Access::REMOTE_WRITE).expect("qp"),
    );
    qp_a.modify_to_init().expect("init");
    qp_b.modify_to_init().expect("init");
    // As if they crossed a TCP handshake: plain bytes.
    let wire_a = (qp_a.info().encode(), qp_a.attachment().encode());
    let wire_b = (qp_b.info().encode(), qp_b.attachment().encode());
    let decode = |(info, attachment): &([u8; 32], [u8; 36])| {
        let mut info = railyard_dataplane::fabric::QpInfo::decode(info).expect("valid");
        info.path_mtu = 1024;
        (info, SoftAttachment::decode(attachment).expect("valid"))
    };
    let (info_b, attachment_b) = decode(&wire_b);
    qp_a.connect(&info_b, &attachment_b).expect("connects");
    let (info_a, attachment_a) = decode(&wire_a);
    qp_b.connect(&info_a, &attachment_a).expect("connects");
    assert_eq!(qp_a.state(), QpState::ReadyToSend);
    assert_eq!(
        qp_a.peer_info().map(|i| i.path_mtu),
        Some(1024),
        "the smaller MTU"
    );

    let mut fabric = a.fabric();
    let qp = fabric.adopt(None, qp_a).expect("RTS");
    let write = request(
        1,
        Opcode::Write,
        source.region.addr,
        source.region.lkey,
        target.region.addr,
        target.region.rkey,
        4096,
    );
    fabric.post(qp, &[write]).expect("posted");
    assert_eq!(drain(&mut fabric, 1)[0].status, WcStatus::Success);
    assert!(target.bytes.iter().all(|&b| b == 0x11));

    // An attachment naming another device's incarnation is refused.
    let mut qp_c = a.create_qp(Access::ALL).expect("qp");
    qp_c.modify_to_init().expect("init");
    let wrong = SoftAttachment {
        incarnation: attachment_b.incarnation ^ 1,
        ..attachment_b
    };
    let refused = qp_c.connect(&info_b, &wrong).unwrap_err();
    assert!(refused.to_string().contains("does not belong"), "{refused}");
    assert!(SoftAttachment::decode(&[0; 5]).is_err());
}
