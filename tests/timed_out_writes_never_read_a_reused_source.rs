//! A new user's test of the local-side promise, across processes over TCP: the target
//! process is stopped (SIGSTOP: no reset, the data piles up in socket buffers), a 64 MiB
//! write times out and is reported, the caller overwrites its source with a new pattern at
//! once, and the target is resumed. Not one byte of the new pattern may ever reach the
//! target: the engine must not read a buffer it has handed back.
//!
//! Caught: before the fix the deadline sweep reported the requests while their work was
//! still queued in the TCP fabric, which kept sending from the source once the target woke —
//! about 61 MB of the new pattern landed after every request had been reported failed.

mod common;

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use common::{BOUND, Serve, bytes_of, done};
use railyard::dataplane::{FailReason, IdleStrategy, RequestOutcome};
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, Transfer};

const LEN: u64 = 64 << 20;
const REQUEST: u64 = 1 << 20;
const OLD: u8 = 0xa1;
const NEW: u8 = 0xb2;

#[test]
fn a_stopped_tcp_target_never_receives_the_reused_source_of_a_timed_out_write() {
    let serve = Serve::start_with("64MiB", &["--rails", "1", "--fabric", "tcp"]);
    let engine = Engine::builder("prefill-late-read")
        .fabric(FabricChoice::Tcp)
        .rails(RailChoice::Count(NonZeroUsize::new(1).expect("one")))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let peer = engine.open(&serve.addr).expect("serve answers");
    let source = engine.alloc(LEN, None).expect("source");
    bytes_of(source).fill(OLD);
    let writes: Vec<Transfer> = (0..LEN / REQUEST)
        .map(|index| Transfer {
            op: Op::Write,
            local: source,
            local_offset: index * REQUEST,
            remote_addr: serve.pool_base + index * REQUEST,
            len: REQUEST,
        })
        .collect();
    let mut submitter = engine.submitter().expect("submitter");

    serve.signal(libc::SIGSTOP);
    let batch = submitter
        .submit_by(&peer, &writes, Instant::now() + Duration::from_millis(500))
        .expect("valid");
    assert!(batch.wait(Instant::now() + BOUND).is_complete());
    assert!(
        batch
            .outcomes()
            .iter()
            .all(|outcome| *outcome == Some(RequestOutcome::Failed(FailReason::Timeout))),
        "every request of a batch to a stopped target times out"
    );
    // The caller takes its buffer back at once.
    bytes_of(source).fill(NEW);
    serve.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_millis(500));

    // Read the target's pool back (the endpoint reconnects by itself).
    let sink = engine.alloc(LEN, None).expect("sink");
    let reads: Vec<Transfer> = writes
        .iter()
        .map(|write| Transfer {
            op: Op::Read,
            local: sink,
            ..*write
        })
        .collect();
    let end = Instant::now() + BOUND;
    loop {
        let batch = submitter.submit(&peer, &reads).expect("valid");
        if done(&batch) {
            break;
        }
        assert!(
            Instant::now() < end,
            "the target never answered reads again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let landed_new = bytes_of(sink).iter().filter(|&&b| b == NEW).count();
    let landed_old = bytes_of(sink).iter().filter(|&&b| b == OLD).count();
    eprintln!(
        "after the report: {landed_old} bytes of the old pattern landed, {landed_new} of the new"
    );
    assert_eq!(
        landed_new, 0,
        "bytes of the source reused after the report reached the target"
    );
    // The old pattern is not asserted: the contract lets a write of a failed request land
    // until the target has processed the retirement of its queue pair. The target nearly
    // always sees the reset the moment it wakes (0 bytes); once, on a fresh clone, 127 968
    // bytes landed — a socket buffer's worth, most likely read by a poller that was stopped
    // in the middle of a round after it had found the connection readable, before it looked
    // for the hang-up.
}
