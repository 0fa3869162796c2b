//! A target that stops answering without a reset (SIGSTOP: its sockets stay open) is
//! declared unreachable within the liveness timeout, measured here from outside: requests to
//! it — queued or already posted on its TCP queue pair — fail with `PeerUnavailable` well
//! inside their 5 s deadline, none is lost, and once it runs again traffic resumes by
//! itself after the circuit's cooldown.

mod common;

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use common::{BOUND, Serve, done};
use railyard::control::Policy;
use railyard::dataplane::{FailReason, IdleStrategy, RequestOutcome};
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, Transfer};

fn signal(serve: &Serve, signal: libc::c_int) {
    // SAFETY: a signal to our own child process, which is alive until `serve` drops.
    let sent = unsafe { libc::kill(serve.child.id() as libc::pid_t, signal) };
    assert_eq!(sent, 0, "kill({signal})");
}

#[test]
fn a_stopped_target_fails_fast_with_peer_unavailable_and_comes_back() {
    let target = Serve::start_with("8MiB", &["--rails", "1", "--fabric", "tcp"]);
    let policy = Policy {
        cooldown_min: Duration::from_millis(500),
        ..Policy::default()
    };
    let engine = Engine::builder("prefill")
        .fabric(FabricChoice::Tcp)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .policy(policy)
        .build()
        .expect("the engine starts");
    let peer = engine.open(&target.addr).expect("the target answers");
    let source = engine.alloc(1 << 20, None).expect("memory");
    let write = Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: target.pool_base,
        len: 1 << 20,
    };
    let mut submitter = engine.submitter().expect("a submitter");
    let batch = submitter.submit(&peer, &[write]).expect("submitted");
    assert!(done(&batch));

    // Stop it, with writes in flight (a TCP queue pair holds them: nothing completes).
    signal(&target, libc::SIGSTOP);
    let stopped = Instant::now();
    let in_flight: Vec<_> = (0..8)
        .map(|_| submitter.submit(&peer, &[write]).expect("submitted"))
        .collect();
    // New requests until one fails fast.
    let detected = loop {
        let probe = submitter.submit(&peer, &[write]).expect("submitted");
        probe.wait(Instant::now() + BOUND);
        if probe.outcomes() == vec![Some(RequestOutcome::Failed(FailReason::PeerUnavailable))] {
            break stopped.elapsed();
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(5),
            "still not failing fast after {:?}: {:?}",
            stopped.elapsed(),
            probe.outcomes()
        );
    };
    // Every request posted at the stop resolved, before its deadline.
    for batch in &in_flight {
        let status = batch.wait(stopped + Duration::from_secs(5));
        assert!(status.is_complete(), "a request was lost: {status:?}");
        assert_eq!(
            batch.outcomes(),
            vec![Some(RequestOutcome::Failed(FailReason::PeerUnavailable))]
        );
    }
    let resolved = stopped.elapsed();
    let control = engine.stats().control;
    eprintln!(
        "unreachable after {detected:?} (detection {} ms), in-flight resolved by {resolved:?}",
        control.max_detection_ms
    );
    assert!(
        detected < Duration::from_millis(2500),
        "PeerUnavailable only after {detected:?}"
    );
    assert!(resolved < Duration::from_secs(4), "{resolved:?}");
    assert_eq!(control.unreachable_peers, 1, "{control:?}");
    assert!(
        (1500..2500).contains(&control.max_detection_ms),
        "{control:?}"
    );

    // It runs again: after the cooldown a trial queue pair carries traffic, no reopen.
    signal(&target, libc::SIGCONT);
    let resumed = Instant::now();
    loop {
        let batch = submitter.submit(&peer, &[write]).expect("submitted");
        batch.wait(Instant::now() + BOUND);
        if batch.outcomes() == vec![Some(RequestOutcome::Done)] {
            break;
        }
        assert!(
            resumed.elapsed() < BOUND,
            "traffic did not resume: {:?}",
            batch.outcomes()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!peer.is_retired());
}
