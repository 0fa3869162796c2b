//! Helpers shared by the poller tests.

#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use railyard_dataplane::fabric::{Fabric, Opcode, WcStatus};
use railyard_dataplane::ring::Consumer;
use railyard_dataplane::{
    Batch, Command, EndpointId, Epoch, Event, IdleStrategy, PollerConfig, PollerHandle, Reprepare,
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
        generation: 0,
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

/// Plays the control plane's part for [`ENDPOINT`]: every failed queue pair gets a new epoch.
pub struct Reconnector {
    events: Consumer<Event>,
    epoch: Epoch,
    /// Statuses of the queue-pair failures seen so far.
    pub failures: Vec<WcStatus>,
}

impl Reconnector {
    pub fn new(poller: &PollerHandle) -> Self {
        let events = poller.take_events().expect("events not taken yet");
        Self {
            events,
            epoch: Epoch::FIRST,
            failures: Vec::new(),
        }
    }

    fn react(&mut self, poller: &PollerHandle) {
        while let Some(event) = self.events.pop() {
            if let Event::QpFailed { status, .. } = event {
                self.failures.push(status);
                self.epoch = self.epoch.next();
                let bump = Command::BumpEpoch {
                    endpoint: ENDPOINT,
                    epoch: self.epoch,
                };
                poller.send(bump).expect("poller runs");
            }
        }
    }

    /// Reconnects on every failure until `batch` completes (bounded), then takes the events
    /// emitted before its last slice resolved.
    pub fn serve_until_complete(&mut self, poller: &PollerHandle, batch: &Batch) {
        let end = Instant::now() + BOUND;
        while !batch.poll().is_complete() {
            assert!(
                Instant::now() < end,
                "batch did not complete within {BOUND:?}"
            );
            self.react(poller);
            std::thread::sleep(Duration::from_millis(1));
        }
        self.react(poller);
    }
}
