//! A fence cannot complete while a peer is still inside a copy it checked before the fence:
//! `Engine::deregister` then returns `MemoryError::Busy` and `Engine::revoke` returns
//! `RevokeError::Busy` after their one-second wait, and both can be called again.
//!
//! Two soft-fabric engines in this process. The initiator's write of one block into the
//! target's buffer reads its source from a [`StallingBuffer`]: the initiator's poller passes
//! the key check, enters the copy and is held by the kernel on its first read of the source
//! (userfaultfd), until the test releases it. So the peer is inside the region at a known
//! moment, for as long as the test wants, with no race and no sleep. The fault plan's
//! `Fault::Stall` cannot do this: a stalled queue pair stops before it checks a key, outside
//! any copy, and fences do not wait for it.
//!
//! Checked: each fence waits its whole deadline and reports `Busy` naming what it waited for;
//! a call while the peer is still inside is `Busy` again; a deregistered region stays out of
//! the published descriptor and out of reach of writes submitted after the first call, but
//! mapped (the stopped copy finishes into it once let go); once the peer has left, the next
//! call succeeds, and a deregistration after that names an unknown region.

mod common;

use std::time::{Duration, Instant};

use common::BOUND;
use common::mapped::{BLOCK, Buffer, PATTERN, POISON, one_rail_engine, open};
use common::stalling::{Stall, StallingBuffer};
use railyard::dataplane::{Batch, FailReason, RequestOutcome};
use railyard::engine::{
    DEREGISTER_WAIT, Engine, EngineSubmitter, FabricChoice, MemoryError, Op, Peer, REVOKE_WAIT,
    Region, RevokeError, Transfer,
};

/// What the stopped copy writes once it is let go.
const COPIED: u8 = 0xc3;

/// Batches here outlive any stall the test makes: their outcome is the copy's, not a timeout.
const PATIENT: Duration = Duration::from_secs(60);

/// Two engines on the soft fabric; the initiator's write of the target buffer's first block
/// stopped inside its copy.
struct Stopped<'a> {
    /// First field, so dropped first: the stopped poller is let go before the engines drop
    /// (also when the test panics).
    stall: Stall<'a>,
    target: Engine,
    initiator: Engine,
    peer: Peer,
    submitter: EngineSubmitter,
    /// The target buffer, registered with the target.
    target_buffer: &'a Buffer,
    target_region: Region,
    /// A source of the initiator's that does not stall (PATTERN).
    source: Region,
    /// The stopped write.
    stopped: Batch,
}

impl Stopped<'_> {
    /// A write of one block from `local` into the target buffer at `offset`.
    fn write(&mut self, local: Region, offset: u64) -> Batch {
        write(
            &mut self.submitter,
            &self.peer,
            local,
            self.target_region.addr + offset,
        )
    }

    /// Words of the target buffer's block at `offset` that are not POISON.
    fn touched(&self, offset: u64) -> Vec<usize> {
        let block = offset as usize..(offset + BLOCK) as usize;
        self.target_buffer
            .words_other_than(u64::from_ne_bytes([POISON; 8]))
            .map(|(at, _)| at)
            .filter(|at| block.contains(at))
            .collect()
    }

    /// Lets the stopped copy go and checks that it finished into the target buffer: it was
    /// inside when the fence gave up.
    fn release(&self) {
        self.stall.release(COPIED);
        let status = self.stopped.wait(Instant::now() + BOUND);
        assert_eq!(
            self.stopped.outcome(0),
            Some(RequestOutcome::Done),
            "the stopped copy finishes once let go: {status:?}"
        );
        let missing = self
            .target_buffer
            .words_other_than(u64::from_ne_bytes([COPIED; 8]))
            .find(|&(at, _)| at < BLOCK as usize);
        assert_eq!(missing, None, "the stopped copy's bytes are in the region");
    }
}

/// A write of one block from `local` to `remote_addr`, with a deadline past any stall.
fn write(submitter: &mut EngineSubmitter, peer: &Peer, local: Region, remote_addr: u64) -> Batch {
    let transfer = Transfer {
        op: Op::Write,
        local,
        local_offset: 0,
        remote_addr,
        len: BLOCK,
    };
    submitter
        .submit_by(peer, &[transfer], Instant::now() + PATIENT)
        .expect("submitted")
}

/// Builds the engines, stops the initiator inside a write into the target, runs `test`, and
/// lets the initiator go before the engines drop (also when `test` panics).
fn with_a_peer_stopped_inside(name: &str, test: impl FnOnce(&mut Stopped<'_>)) {
    let stalling = StallingBuffer::new(BLOCK as usize);
    let target_buffer = Buffer::new(POISON);
    let source_buffer = Buffer::new(PATTERN);
    let target = one_rail_engine(&format!("decode-{name}"), FabricChoice::Soft);
    let initiator = one_rail_engine(&format!("prefill-{name}"), FabricChoice::Soft);
    let target_region = target_buffer.register(&target);
    let stalling_region = stalling.register(&initiator);
    let source = source_buffer.register(&initiator);
    let peer = open(&initiator, &target);
    let mut submitter = initiator.submitter().expect("a submitter");
    // Declared after the engines: dropped before them, so a stopped poller is let go first.
    let stall = stalling.arm();
    let written = write(&mut submitter, &peer, stalling_region, target_region.addr);
    let mut stopped = Stopped {
        stall,
        target,
        initiator,
        peer,
        submitter,
        target_buffer: &target_buffer,
        target_region,
        source,
        stopped: written,
    };
    // The initiator's poller checked the key and is inside the copy, held on its source.
    stopped.stall.wait_for_reader(Instant::now() + BOUND);
    assert!(
        stopped.touched(0).is_empty(),
        "the copy is stopped before its first byte"
    );
    test(&mut stopped);
}

/// The `call`-th deregistration of the target region while the peer is inside it: `Busy`,
/// naming the region, after waiting the whole deadline.
fn deregister_while_inside(stopped: &Stopped<'_>, call: &str) {
    let region = stopped.target_region;
    let started = Instant::now();
    let result = stopped.target.deregister(region);
    let took = started.elapsed();
    match &result {
        Err(
            error @ MemoryError::Busy {
                id,
                addr,
                len,
                waited,
            },
        ) => {
            assert_eq!(
                (*id, *addr, *len, *waited),
                (region.id, region.addr, region.len, DEREGISTER_WAIT),
                "{error}"
            );
            assert!(error.to_string().contains("still in use"), "{error}");
        }
        other => panic!("{call} deregister while the peer is inside the region: {other:?}"),
    }
    assert!(
        took >= DEREGISTER_WAIT,
        "{call} deregister: Busy only after waiting the whole deadline ({took:?})"
    );
}

/// The `call`-th revoke of the initiator while it is inside a copy: `Busy` after waiting the
/// whole deadline; how many queue pairs it was not let go of.
fn revoke_while_inside(stopped: &Stopped<'_>, call: &str) -> usize {
    let incarnation = stopped.initiator.incarnation();
    let started = Instant::now();
    let result = stopped.target.revoke(incarnation);
    let took = started.elapsed();
    let queue_pairs = match &result {
        Err(
            error @ RevokeError::Busy {
                peer,
                queue_pairs,
                waited,
            },
        ) => {
            assert_eq!((*peer, *waited), (incarnation, REVOKE_WAIT), "{error}");
            assert!(error.to_string().contains("still in use"), "{error}");
            *queue_pairs
        }
        other => panic!("{call} revoke while the peer is inside a copy: {other:?}"),
    };
    assert!(
        took >= REVOKE_WAIT,
        "{call} revoke: Busy only after waiting the whole deadline ({took:?})"
    );
    queue_pairs
}

#[test]
fn deregister_is_busy_while_a_peer_is_stopped_inside_a_copy_into_the_region() {
    with_a_peer_stopped_inside("dereg-busy", |stopped| {
        deregister_while_inside(stopped, "the first");
        // The region stayed mapped for the copy the fence waited for.
        stopped.release();
    });
}

#[test]
fn a_busy_region_stays_fenced_until_deregister_is_called_again_after_the_peer_leaves() {
    with_a_peer_stopped_inside("dereg-retry", |stopped| {
        let region = stopped.target_region;
        deregister_while_inside(stopped, "the first");

        // Fenced: gone from the engine's regions and from what a peer fetches now.
        assert!(
            stopped.target.regions().iter().all(|r| r.id != region.id),
            "a withdrawn region is not listed: {:?}",
            stopped.target.regions()
        );
        let observer = one_rail_engine("observer-dereg-retry", FabricChoice::Soft);
        let described = open(&observer, &stopped.target).descriptor();
        assert!(
            described.regions.iter().all(|r| r.base != region.addr),
            "a withdrawn region is not published: {:?}",
            described.regions
        );
        drop(observer);

        // A write submitted after the fence, with the keys the initiator still holds: it runs
        // once the initiator's poller is let go, and must not land.
        let late = stopped.write(stopped.source, BLOCK);

        // Still inside: the retry (from the fenced regions) waits again and keeps the region.
        deregister_while_inside(stopped, "a second");

        stopped.release();
        let status = late.wait(Instant::now() + BOUND);
        assert!(status.is_complete(), "the late write resolves: {status:?}");
        assert_eq!(
            late.outcome(0),
            Some(RequestOutcome::Failed(FailReason::RegionWithdrawn)),
            "a write submitted after the fence is refused"
        );
        assert_eq!(
            stopped.touched(BLOCK),
            Vec::<usize>::new(),
            "a write submitted after the fence landed"
        );

        // The peer has left: the retry finds the fenced region and completes.
        stopped
            .target
            .deregister(region)
            .unwrap_or_else(|error| panic!("deregister once the peer has left: {error}"));
        match stopped.target.deregister(region) {
            Err(MemoryError::UnknownRegion { id }) => assert_eq!(id, region.id),
            other => panic!("deregister after it succeeded: {other:?}"),
        }
        assert_eq!(stopped.touched(BLOCK), Vec::<usize>::new());
    });
}

#[test]
fn revoke_is_busy_while_the_peer_is_stopped_inside_a_copy_and_succeeds_once_it_leaves() {
    with_a_peer_stopped_inside("revoke-busy", |stopped| {
        assert_eq!(
            revoke_while_inside(stopped, "the first"),
            1,
            "the initiator's one queue pair (one rail) is not let go"
        );
        // Still inside: the next revoke waits for that queue pair again.
        assert!(revoke_while_inside(stopped, "a second") >= 1);

        // A copy that began before the revoke finishes; then the fence completes.
        stopped.release();
        stopped
            .target
            .revoke(stopped.initiator.incarnation())
            .unwrap_or_else(|error| panic!("revoke once the peer has left: {error}"));
    });
}
