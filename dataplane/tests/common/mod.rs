//! Helpers shared by the poller tests.

#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use railyard_dataplane::fabric::{Fabric, Opcode};
use railyard_dataplane::{
    Batch, Command, EndpointId, Epoch, IdleStrategy, PollerConfig, PollerHandle, Reprepare,
    SliceSpec,
};

/// Every wait in these tests ends by this bound.
pub const BOUND: Duration = Duration::from_secs(10);

pub const ENDPOINT: EndpointId = EndpointId(0);

/// The remote key a descriptor of `epoch` hands out: tests check every post against it.
pub fn rkey_for(epoch: Epoch) -> u32 {
    1000 + epoch.get() as u32
}

/// A WRITE slice of request `request`, prepared for `epoch`.
pub fn write(request: u32, epoch: Epoch) -> SliceSpec {
    SliceSpec {
        rail: 0,
        request,
        opcode: Opcode::Write,
        local_addr: 0x1000 + u64::from(request) * 64,
        lkey: 7,
        remote_addr: 0x9000 + u64::from(request) * 64,
        rkey: rkey_for(epoch),
        len: 64,
        imm: 0,
        endpoint: ENDPOINT,
        epoch,
    }
}

pub fn deadline() -> Instant {
    Instant::now() + BOUND
}

/// Waits (bounded) for the batch and asserts it completed.
pub fn finish(batch: &Batch) {
    let status = batch.wait(Instant::now() + BOUND);
    assert!(
        status.is_complete(),
        "batch did not complete within {BOUND:?}: {status:?}"
    );
}

/// Polls `check` until it holds, failing the test after the bound.
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let end = Instant::now() + BOUND;
    while !check() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A poller config that cannot starve a 2-core machine.
pub fn config() -> PollerConfig {
    PollerConfig {
        idle: IdleStrategy::gentle(),
        ..PollerConfig::new("rail0")
    }
}

/// A poller on `fabric` that already has [`ENDPOINT`] at the first epoch.
pub fn poller_with_endpoint(
    fabric: impl Fabric + 'static,
    reprepare: impl Reprepare + 'static,
) -> PollerHandle {
    let poller = PollerHandle::spawn(config(), fabric, reprepare).expect("poller starts");
    poller
        .send(Command::AddEndpoint {
            endpoint: ENDPOINT,
            epoch: Epoch::FIRST,
        })
        .expect("poller runs");
    poller
}
