//! A target that stops answering without a reset (SIGSTOP: its sockets stay open) is
//! declared unreachable within the liveness timeout, measured here from outside: requests to
//! it — queued or already posted on its TCP queue pair — fail with `PeerUnavailable` well
//! inside their 5 s deadline, none is lost, and once it runs again traffic resumes by
//! itself after the circuit's cooldown.

mod common;

use std::time::{Duration, Instant};

use common::{BOUND, TcpPair};
use railyard::control::Policy;
use railyard::dataplane::{FailReason, RequestOutcome};

#[test]
fn a_stopped_target_fails_fast_with_peer_unavailable_and_comes_back() {
    let TcpPair {
        target,
        engine,
        peer,
        mut submitter,
        write,
    } = TcpPair::start(Policy {
        cooldown_min: Duration::from_millis(500),
        ..Policy::default()
    });

    // Stop it, with writes in flight (a TCP queue pair holds them: nothing completes).
    target.signal(libc::SIGSTOP);
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
    target.signal(libc::SIGCONT);
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
