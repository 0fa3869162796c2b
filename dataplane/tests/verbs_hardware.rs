//! The verbs data path on a real device (or SoftRoCE). Ignored unless asked for:
//! `RAILYARD_TEST_VERBS_DEVICE=mlx5_0 make test-rdma` (or `rxe0` after
//! `rdma link add rxe0 type rxe netdev <if>`). The no-device path runs everywhere.

#![cfg(not(loom))]

use std::time::{Duration, Instant};

use railyard_dataplane::fabric::verbs::{RailConfig, VerbsFabric, VerbsRail};
use railyard_dataplane::fabric::{
    Access, Fabric, Opcode, WcStatus, WorkCompletion, WorkRequest, WrId,
};
use railyard_dataplane::{EndpointId, Epoch};

#[test]
fn opening_a_device_that_is_not_there_is_a_specific_error() {
    let error = VerbsRail::open("railyard-no-such-device", RailConfig::default()).unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("ibv_get_device_list") || text.contains("no RDMA device"),
        "{text}"
    );
}

fn device() -> String {
    std::env::var("RAILYARD_TEST_VERBS_DEVICE")
        .expect("set RAILYARD_TEST_VERBS_DEVICE to the RDMA device to test (e.g. mlx5_0, rxe0)")
}

fn drain(fabric: &mut VerbsFabric, count: usize) -> Vec<WorkCompletion> {
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < count {
        assert!(Instant::now() < end, "completions: {out:?}");
        let missing = count - out.len();
        fabric.poll(&mut out, missing);
    }
    out
}

#[test]
#[ignore = "requires an RDMA device (RAILYARD_TEST_VERBS_DEVICE)"]
fn loopback_write_read_and_selective_signaling_on_a_device() {
    let rail = VerbsRail::open(&device(), RailConfig::default()).expect("the device opens");
    let mut source = vec![0u8; 1 << 20];
    let mut target = vec![0u8; 1 << 20];
    for (i, byte) in source.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    // SAFETY: both buffers outlive the registrations (deregistered at the end).
    let (lkey, source_rkey) =
        unsafe { rail.register(source.as_mut_ptr(), source.len(), Access::ALL) }.expect("reg");
    // SAFETY: as above.
    let (_, rkey) =
        unsafe { rail.register(target.as_mut_ptr(), target.len(), Access::ALL) }.expect("reg");
    let (a, info_a) = rail.create_qp(0x111).expect("qp");
    let (b, info_b) = rail.create_target_qp(0x222).expect("qp");
    let a = rail.connect(a, &info_b).expect("a connects");
    let mut b = rail.connect(b, &info_a).expect("b connects");
    rail.stage(EndpointId(0), Epoch::FIRST, a);
    let mut fabric = VerbsFabric::new(rail.clone());
    let qp = fabric.connect(EndpointId(0), Epoch::FIRST).expect("staged");
    // 40 writes of 16 KiB: only every 16th and the last are signaled, all 40 complete.
    let writes: Vec<WorkRequest> = (0..40u32)
        .map(|i| WorkRequest {
            wr_id: WrId::new(i, 1),
            opcode: Opcode::Write,
            local_addr: source.as_ptr() as u64 + u64::from(i) * 16384,
            lkey,
            remote_addr: target.as_ptr() as u64 + u64::from(i) * 16384,
            rkey,
            len: 16384,
            imm: 0,
            signaled: true,
            epoch: Epoch::FIRST,
        })
        .collect();
    fabric.post(qp, &writes).expect("posted");
    let done = drain(&mut fabric, 40);
    assert!(
        done.iter().all(|c| c.status == WcStatus::Success),
        "{done:?}"
    );
    assert_eq!(&target[..40 * 16384], &source[..40 * 16384]);
    // A write with an immediate, then a zero-length one (a bare notification, no keys):
    // the target's queue pair takes both immediates, in order.
    let with_imm = WorkRequest {
        wr_id: WrId::new(40, 1),
        opcode: Opcode::WriteWithImm,
        imm: 0xFEED,
        ..writes[0]
    };
    let bare = WorkRequest {
        wr_id: WrId::new(41, 1),
        len: 0,
        lkey: 0,
        rkey: 0,
        imm: 0xC0DE,
        ..with_imm
    };
    fabric.post(qp, &[with_imm, bare]).expect("posted");
    assert!(
        drain(&mut fabric, 2)
            .iter()
            .all(|c| c.status == WcStatus::Success)
    );
    let mut immediates = Vec::new();
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while immediates.len() < 2 && std::time::Instant::now() < end {
        b.take_immediates(&mut immediates)
            .expect("receives complete");
    }
    assert_eq!(immediates, [0xFEED, 0xC0DE]);
    // A bad rkey: REM_ACCESS_ERR, then the queue pair is in ERR.
    let bad = WorkRequest {
        rkey: rkey ^ 0x5a5a,
        ..writes[0]
    };
    fabric.post(qp, &[bad]).expect("posted");
    assert_eq!(drain(&mut fabric, 1)[0].status, WcStatus::RemAccessErr);
    assert!(rail.deregister(source_rkey) && rail.deregister(rkey));
    assert!(!rail.deregister(rkey), "deregistered once");
}
