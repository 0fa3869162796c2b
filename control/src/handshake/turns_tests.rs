//! Handshake admission on virtual time: a target past its cap on handshakes in progress
//! tells the initiators beyond it to wait and answers in order; an initiator past its own
//! cap sends handshakes as replies come back (the network and fake fabric of
//! `handshake::tests`).

use super::*;

/// ConnectQps that reached process `index` and were told to wait, by the initiator.
fn told_to_wait(messages: &[(usize, Message)], index: usize) -> usize {
    messages
        .iter()
        .filter(|(to, message)| *to == index && matches!(message, Message::ConnectQpQueued { .. }))
        .count()
}

#[test]
fn a_target_past_its_cap_tells_the_initiators_beyond_it_to_wait_and_answers_in_order() {
    let mut net = Net::new();
    let target = net.spawn_with(
        NAME,
        addr(1, 7000),
        11,
        1,
        Policy {
            max_handshakes_per_target: 2,
            ..policy()
        },
    );
    net.procs[target].core.take_turns(0);
    let initiators: Vec<usize> = (0..5)
        .map(|n| {
            net.spawn(
                &format!("prefill-{n}"),
                addr(2 + n, 7000),
                20 + u64::from(n),
                1,
            )
        })
        .collect();
    let answers: Vec<_> = initiators
        .iter()
        .map(|&initiator| net.connect(initiator, addr(1, 7000)))
        .collect();
    let heard = net.settle_recording();
    let views: Vec<Arc<EndpointView>> = answers
        .iter()
        .map(|answer| answer.try_recv().expect("answered").expect("an endpoint"))
        .collect();
    assert_eq!(net.procs[target].core.handshakes_unanswered(), 5);
    let waiting: Vec<usize> = initiators
        .iter()
        .map(|&initiator| told_to_wait(&heard, initiator))
        .collect();
    assert_eq!(
        waiting,
        [0, 0, 1, 1, 1],
        "two in progress, the rest told to wait"
    );
    assert_eq!(net.stats(target).handshakes_queued, 3);

    // Past the connect timeout, those told to wait still wait; the two in progress (the
    // target hung on them) time out as they should.
    net.advance(policy().connect_timeout + Duration::from_millis(1));
    net.pump();
    let phases: Vec<Phase> = views.iter().map(|view| view.phase()).collect();
    assert_eq!(
        phases,
        [
            Phase::Backoff,
            Phase::Backoff,
            Phase::Connecting,
            Phase::Connecting,
            Phase::Connecting
        ]
    );
    // They ask again: their newer ConnectQps replace the ones waiting (answered once each).
    net.advance(Duration::from_millis(10));
    net.settle();
    assert_eq!(net.procs[target].core.handshakes_unanswered(), 5);

    // The target works through the queue in arrival order.
    assert_eq!(net.procs[target].core.answer_handshakes(3), 3);
    net.settle();
    let ready: Vec<bool> = views.iter().map(|v| v.phase() == Phase::Ready).collect();
    assert_eq!(
        ready,
        [false, false, true, true, true],
        "first come, first answered"
    );
    assert_eq!(net.procs[target].core.answer_handshakes(10), 2);
    net.settle();
    assert!(views.iter().all(|view| view.phase() == Phase::Ready));
    let failures: u64 = initiators
        .iter()
        .map(|&initiator| net.stats(initiator).handshake_failures)
        .sum();
    assert_eq!(failures, 2, "only the two the target hung on in progress");
}

#[test]
fn an_initiator_past_its_cap_sends_its_handshakes_as_replies_come_back() {
    let mut net = Net::new();
    for n in 0..3u8 {
        net.spawn(
            &format!("decode-{n}"),
            addr(1, 7000 + u16::from(n)),
            11 + u64::from(n),
            1,
        );
    }
    let prefill = net.spawn_with(
        "prefill",
        addr(2, 7000),
        20,
        1,
        Policy {
            max_handshakes_per_initiator: 1,
            ..policy()
        },
    );
    let answers: Vec<_> = (0..3u16)
        .map(|n| net.connect(prefill, addr(1, 7000 + n)))
        .collect();
    let is_reply = |to: usize, message: &Message| {
        to == prefill && matches!(message, Message::ConnectQpReply { .. })
    };
    net.settle_holding(is_reply);
    let views: Vec<Arc<EndpointView>> = answers
        .iter()
        .map(|answer| answer.try_recv().expect("answered").expect("an endpoint"))
        .collect();
    assert_eq!(net.held.len(), 1, "one handshake out at a time");
    assert_eq!(net.stats(prefill).handshakes_queued, 2);
    assert!(views.iter().all(|view| view.phase() == Phase::Connecting));

    // The ones waiting here do not time out while they wait.
    net.advance(policy().connect_timeout / 2);
    for answered in 1..=3 {
        net.release(0);
        net.settle_holding(is_reply);
        let ready = views.iter().filter(|v| v.phase() == Phase::Ready).count();
        assert_eq!(ready, answered);
        assert!(net.held.len() <= 1, "never more than one out");
        // The next one's connect timeout runs from when it was sent.
        net.advance(policy().connect_timeout * 3 / 4);
    }
    assert_eq!(net.stats(prefill).handshake_failures, 0);
}

/// Caught in review: a ConnectQp waiting its turn and a RetireQp for the queue pair it
/// offers (its initiator gave it up) — answered later, the target would connect and keep a
/// queue pair its initiator had already taken out of service.
#[test]
fn a_retire_qp_takes_the_connect_qp_it_names_out_of_the_queue() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    net.procs[target].core.take_turns(0);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let _answer = net.connect(prefill, addr(1, 7000));
    net.settle();
    let waiting = net.procs[target].core.unanswered.front().map(|waiting| {
        (
            waiting.conn,
            waiting.key,
            waiting.epoch,
            waiting.side.info.qp_num,
        )
    });
    let (conn, key, epoch, qp_num) = waiting.expect("a ConnectQp waits its turn");
    let now = net.now;
    let retire = Message::RetireQp { key, epoch, qp_num };
    net.procs[target].core.received(conn, retire, now);
    assert_eq!(net.procs[target].core.handshakes_unanswered(), 0);
    assert_eq!(net.procs[target].core.answer_handshakes(10), 0);
    assert!(
        net.procs[target].core.passive.is_empty(),
        "nothing connected to it"
    );
}

/// Caught in review: a handshake its target told to wait kept its slot under this side's
/// cap, so one busy target held up the handshakes to every other peer.
#[test]
fn a_handshake_a_busy_target_queued_does_not_hold_up_those_to_other_peers() {
    let mut net = Net::new();
    let busy = net.spawn_with(
        NAME,
        addr(1, 7000),
        11,
        1,
        Policy {
            max_handshakes_per_target: 0,
            ..policy()
        },
    );
    net.procs[busy].core.take_turns(0);
    net.spawn("decode-b", addr(1, 7001), 12, 1);
    let prefill = net.spawn_with(
        "prefill",
        addr(2, 7000),
        20,
        1,
        Policy {
            max_handshakes_per_initiator: 1,
            ..policy()
        },
    );
    let to_busy = net.connect(prefill, addr(1, 7000));
    net.settle();
    let to_busy = to_busy.try_recv().expect("answered").expect("an endpoint");
    assert_eq!(net.stats(busy).handshakes_queued, 1, "told to wait");
    let to_idle = net.connect(prefill, addr(1, 7001));
    net.settle();
    let to_idle = ready(&to_idle);
    assert_eq!(to_idle.phase(), Phase::Ready);
    assert_eq!(to_busy.phase(), Phase::Connecting, "still waiting its turn");
    assert_eq!(
        net.stats(prefill).handshakes_queued,
        0,
        "nothing waited here"
    );
}
