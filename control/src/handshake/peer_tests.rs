//! The peer table on virtual time: liveness and redials, what the directory says about
//! peers, and the queue pairs passed between them (the network and fake fabric of
//! `handshake::tests`).

use std::sync::mpsc::TryRecvError;

use railyard_dataplane::fabric::Access;

use super::*;
use crate::descriptor::RegionDescriptor;

// ---- helpers ------------------------------------------------------------------------------

/// Process `index`'s open connection to the listener at `addr`.
fn dialed_conn(net: &Net, index: usize, addr: SocketAddr) -> ConnId {
    *net.procs[index]
        .core
        .dialed
        .get(&addr)
        .expect("a dialed connection")
}

/// Process `index`'s end of a connection process `peer` opened to it.
fn accepted_from(net: &Net, index: usize, peer: usize) -> ConnId {
    net.links
        .iter()
        .find(|&(&(proc, conn), &(other, _))| {
            proc == index && other == peer && !net.procs[index].core.conns[&conn].dialed
        })
        .map(|(&(_, conn), _)| conn)
        .expect("a connection the peer opened")
}

/// Asks process `index` for an endpoint from its rail `local` to rail `remote` of the
/// process listening at `addr`.
fn connect_rails(net: &mut Net, index: usize, addr: SocketAddr, local: u16, remote: u16) -> Answer {
    let (reply, answer) = mpsc::channel();
    let now = net.now;
    net.procs[index]
        .core
        .connect(addr, local, remote, reply, now);
    answer
}

/// Process `index`'s endpoint (not retired) to `peer` on remote rail `remote_rail`.
fn endpoint_to(
    net: &Net,
    index: usize,
    peer: Incarnation,
    remote_rail: u16,
) -> Option<Arc<EndpointView>> {
    net.procs[index]
        .shared
        .endpoints()
        .into_iter()
        .map(|(_, view)| view)
        .find(|view| {
            view.key.peer == peer
                && view.key.remote_rail == remote_rail
                && view.phase() != Phase::Retired
        })
}

/// The initiators of the queue pairs process `index` holds as a target.
fn initiators(net: &Net, index: usize) -> Vec<Incarnation> {
    let mut initiators: Vec<Incarnation> = net.procs[index]
        .core
        .passive
        .keys()
        .map(|key| key.initiator)
        .collect();
    initiators.sort();
    initiators
}

/// Advances `by` in steps of `step`, delivering everything between steps, and returns when
/// process `index` dialed on its timers.
fn dial_times(net: &mut Net, index: usize, by: Duration, step: Duration) -> Vec<Instant> {
    let end = net.now + by;
    let mut dials = Vec::new();
    while net.now < end {
        net.advance(step);
        while let Some(action) = net.procs[index].core.next_action() {
            if matches!(action, Action::Dial { .. }) {
                dials.push(net.now);
            }
            net.carry_out(index, action);
        }
        net.settle();
    }
    dials
}

/// The queue pair numbers of the successful ConnectQp replies among `sent`.
fn granted(sent: &[Message]) -> Vec<u32> {
    sent.iter()
        .filter_map(|message| match message {
            Message::ConnectQpReply {
                result: Ok(side), ..
            } => Some(side.info.qp_num),
            _ => None,
        })
        .collect()
}

fn region() -> RegionDescriptor {
    RegionDescriptor {
        base: 0x1000,
        len: 4096,
        rkeys: vec![7],
        generation: 1,
        access: Access::ALL,
    }
}

/// The regions in the descriptor `view` carries.
fn regions(view: &EndpointView) -> Vec<RegionDescriptor> {
    view.descriptor().expect("a descriptor").regions.clone()
}

/// What the rails' fabrics were told about peers' descriptors.
#[derive(Default)]
struct FabricLog {
    next_qp: u32,
    learnt: Vec<Incarnation>,
    forgotten: Vec<Incarnation>,
}

/// A fabric whose queue pairs are TCP's (by their attachment), recording the descriptors it
/// learns and forgets.
#[derive(Clone, Default)]
struct TcpLikeFabric {
    log: Arc<Mutex<FabricLog>>,
}

impl TcpLikeFabric {
    fn log(&self) -> std::sync::MutexGuard<'_, FabricLog> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new_qp(&self) -> (u32, QpSide) {
        let mut log = self.log();
        log.next_qp += 1;
        let mut side = qp_side(log.next_qp);
        side.attachment = TcpAttachment::Initiator.encode();
        (log.next_qp, side)
    }
}

impl RailFabric for TcpLikeFabric {
    type Qp = u32;
    type Connected = u32;

    fn create_qp(&self, _link: &PeerLink) -> Result<(u32, QpSide), String> {
        Ok(self.new_qp())
    }

    fn create_target_qp(
        &self,
        _link: &PeerLink,
        _initiator: &QpSide,
    ) -> Result<(u32, QpSide), String> {
        Ok(self.new_qp())
    }

    fn take_immediates(&self, _qp: &mut u32, _out: &mut Vec<u32>) -> Result<(), String> {
        Ok(())
    }

    fn connect_qp(&self, qp: u32, _remote: &QpSide) -> Result<u32, String> {
        Ok(qp)
    }

    fn stage(&self, _endpoint: EndpointId, _epoch: Epoch, _qp: u32) -> Result<(), String> {
        Ok(())
    }

    fn revoke(&self, _qp: u32) -> Revocation {
        Revocation::done()
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: "tcp-like".into(),
            fabric: 0,
            tcp_port: 0,
            address: Vec::new(),
        }
    }

    fn learn_descriptor(&self, descriptor: &SegmentDescriptor) {
        self.log().learnt.push(descriptor.incarnation);
    }

    fn forget_descriptor(&self, descriptor: &SegmentDescriptor) {
        self.log().forgotten.push(descriptor.incarnation);
    }
}

/// A core of its own (incarnation 11, [`NAME`], at 10.0.0.1:7000) over one rail of
/// `fabric`, driven by hand.
fn lone_core(fabric: TcpLikeFabric) -> (Core<TcpLikeFabric>, Arc<ControlShared>) {
    let shared = ControlShared::new(1);
    let core = Core::new(
        Identity {
            name: NAME.into(),
            incarnation: Incarnation(11),
            local_addr: addr(1, 7000),
            host: HostId::default(),
            secret: None,
            encrypt_control: false,
        },
        policy(),
        11,
        vec![fabric],
        shared.clone(),
    );
    (core, shared)
}

/// `core` asks for an endpoint to 10.0.0.2:7000, where `incarnation` answers: its Hello and
/// descriptor come in on the connection dialed.
fn lone_core_meets(
    core: &mut Core<TcpLikeFabric>,
    incarnation: u64,
    now: Instant,
) -> (ConnId, Answer) {
    let (reply, answer) = mpsc::channel();
    core.connect(addr(2, 7000), 0, 0, reply, now);
    let conn = std::iter::from_fn(|| core.next_action())
        .find_map(|action| match action {
            Action::Dial { conn, .. } => Some(conn),
            _ => None,
        })
        .expect("a dial");
    while core.next_action().is_some() {}
    core.dialed(conn, addr(1, 7000).ip());
    core.received(conn, hello_from("prefill", incarnation), now);
    let descriptor = SegmentDescriptor {
        name: "prefill".into(),
        incarnation: Incarnation(incarnation),
        handshake_addr: addr(2, 7000).to_string(),
        rails: Vec::new(),
        regions: Vec::new(),
    };
    core.received(conn, Message::Descriptor(descriptor), now);
    // Only the endpoints' phases are published; the rest goes nowhere.
    publish_phases(core);
    (conn, answer)
}

/// Carries out what `core` asks as far as these tests need: endpoints' phases are
/// published; the other actions are returned (the parent's `drain_actions` publishes none).
fn publish_phases(core: &mut Core<TcpLikeFabric>) -> Vec<Action> {
    let mut rest = Vec::new();
    while let Some(action) = core.next_action() {
        match action {
            Action::Publish {
                view,
                phase,
                probation,
            } => view.publish(phase, probation),
            other => rest.push(other),
        }
    }
    rest
}

/// The directory saying `old` restarted as `new` at `addr`.
fn restarted(old: Incarnation, new: Incarnation, addr: SocketAddr) -> PeerChange {
    PeerChange::Restarted { old, new, addr }
}

// ---- liveness ---------------------------------------------------------------------------

#[test]
fn bytes_still_arriving_keep_a_peer_alive_and_unpinged() {
    let (mut net, target, prefill, view) = lively_pair();
    // The target is sending a large frame slowly: bytes arrive, no whole message (it is
    // stopped, and the driver reports the reads).
    net.stop(target);
    let conn = dialed_conn(&net, prefill, addr(1, 7000));
    let mut pings = 0;
    let end = net.now + Duration::from_secs(3);
    while net.now < end {
        net.advance(Duration::from_millis(10));
        let now = net.now;
        net.procs[prefill].core.heard(conn, now);
        pings += net
            .settle_recording()
            .iter()
            .filter(|(to, message)| *to == target && matches!(message, Message::Ping { .. }))
            .count();
    }
    assert_eq!(view.phase(), Phase::Ready, "heard all along");
    assert_eq!(net.stats(prefill).unreachable_peers, 0);
    assert_eq!(pings, 0, "a connection that hears its peer is not quiet");
}

#[test]
fn a_redial_a_stopped_peer_accepts_but_never_answers_opens_the_circuit_in_time() {
    let (mut net, target, prefill, view) = lively_pair();
    // The target drops the connection and stops; its kernel still accepts the redial.
    let accepted = accepted_from(&net, target, prefill);
    let now = net.now;
    net.procs[target].core.closed(accepted, "stalled", now);
    net.pump();
    net.stop(target);
    let took = until_circuit_opens(&mut net, &view, Duration::from_secs(5));
    // The liveness timeout, plus the two 10 ms steps `until_circuit_opens` may overshoot by.
    let bound = lively().liveness_timeout + Duration::from_millis(20);
    assert!(
        took.is_some_and(|took| took <= bound),
        "a redial that never hears Hello is silent like any other: {took:?}"
    );
    assert_eq!(net.stats(prefill).unreachable_peers, 1);
}

/// Caught by the simulation (seed 13, no directory, lossy network): a peer stopped, its
/// connection was lost 0.6 s later, and the redial's silence was counted from the redial —
/// the stopped peer went unnoticed for 2.1 s instead of 1.5 s.
#[test]
fn a_connection_lost_under_a_silent_peer_does_not_restart_the_liveness_clock() {
    let (mut net, target, prefill, view) = lively_pair();
    let stopped_at = net.now;
    net.stop(target);
    net.run_for(Duration::from_millis(600), Duration::from_millis(10));
    // The connection resets (a lost segment); the redial reaches the stopped target's
    // kernel, which accepts it, and nothing more.
    let conn = dialed_conn(&net, prefill, addr(1, 7000));
    let now = net.now;
    net.procs[prefill].core.closed(conn, "reset", now);
    net.settle();
    let took =
        until_circuit_opens(&mut net, &view, Duration::from_secs(5)).map(|_| net.now - stopped_at);
    // The liveness timeout, plus the 10 ms steps the two loops may overshoot by.
    let bound = lively().liveness_timeout + Duration::from_millis(20);
    assert!(
        took.is_some_and(|took| took <= bound),
        "silent since the stop, not since the redial: {took:?}"
    );
}

#[test]
fn an_accepted_connection_without_hello_gets_the_connect_timeout_not_the_liveness_bound() {
    let (mut net, _, prefill, _) = lively_pair();
    // Accepted from the very address this side dials the target at.
    let now = net.now;
    let ip = net.procs[prefill].addr.ip();
    let conn = net.procs[prefill].core.accepted(addr(1, 7000), ip, now);
    let step = Duration::from_millis(10);
    net.run_for(lively().liveness_timeout + Duration::from_millis(100), step);
    assert!(
        net.procs[prefill].core.conns.contains_key(&conn),
        "the liveness bound on Hello is for connections this side dialed"
    );
    net.run_for(lively().connect_timeout - lively().liveness_timeout, step);
    assert!(
        !net.procs[prefill].core.conns.contains_key(&conn),
        "closed past the connect timeout"
    );
}

#[test]
fn a_silent_address_fails_only_the_endpoints_reached_through_it() {
    // One incarnation reached at two addresses (two cores with one incarnation stand for a
    // process's two routes); the route through 7000 goes silent, the other still answers.
    let mut net = Net::new();
    let first_route = net.spawn_with(NAME, addr(1, 7000), 11, 2, lively());
    net.spawn_with(NAME, addr(1, 7001), 11, 2, lively());
    let prefill = net.spawn_with("prefill", addr(2, 7000), 20, 1, lively());
    let through_first = connect_rails(&mut net, prefill, addr(1, 7000), 0, 0);
    net.settle();
    let through_second = connect_rails(&mut net, prefill, addr(1, 7001), 0, 1);
    net.settle();
    let (silent, other) = (ready(&through_first), ready(&through_second));
    assert_eq!(other.key.peer, silent.key.peer);
    net.stop(first_route);
    assert!(until_circuit_opens(&mut net, &silent, Duration::from_secs(5)).is_some());
    assert_eq!(
        other.phase(),
        Phase::Ready,
        "the endpoint through the other address still works"
    );
    assert_eq!(net.stats(prefill).unreachable_peers, 1);
}

#[test]
fn a_listener_that_refuses_is_redialed_at_most_once_per_keepalive_interval() {
    let (mut net, target, prefill, view) = lively_pair();
    net.crash(target);
    net.settle();
    let step = Duration::from_millis(10);
    let dials = dial_times(&mut net, prefill, Duration::from_secs(1), step);
    assert!(dials.len() >= 3, "it keeps trying: {dials:?}");
    for pair in dials.windows(2) {
        assert!(
            pair[1] - pair[0] >= lively().keepalive_interval,
            "redialed after {:?}",
            pair[1] - pair[0]
        );
    }
    assert_eq!(view.phase(), Phase::Ready, "a refusal fails nothing");
}

// ---- restarts -------------------------------------------------------------------------------

#[test]
fn a_restart_at_one_address_retires_only_that_peers_endpoints() {
    let mut net = Net::new();
    let restarting = net.spawn(NAME, addr(1, 7000), 11, 1);
    net.spawn(NAME, addr(1, 7001), 12, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let to_first = net.connect(prefill, addr(1, 7000));
    let to_second = net.connect(prefill, addr(1, 7001));
    net.settle();
    let (old, bystander) = (ready(&to_first), ready(&to_second));
    net.crash(restarting);
    net.settle();
    net.spawn(NAME, addr(1, 7000), 13, 1);
    let again = net.connect(prefill, addr(1, 7000));
    net.settle();
    assert_eq!(old.phase(), Phase::Retired);
    assert_eq!(ready(&again).key.peer, Incarnation(13));
    assert_eq!(
        bystander.phase(),
        Phase::Ready,
        "another peer's endpoint is untouched"
    );
    assert_eq!(net.retired_endpoints(prefill), 1);
    assert_eq!(net.stats(prefill).peer_restarts, 1);
}

#[test]
fn endpoints_and_notifications_carry_the_name_the_peer_said_hello_with() {
    let (mut net, target, prefill, view) = connected_pair();
    assert_eq!(view.peer_name, NAME);
    let now = net.now;
    net.procs[prefill]
        .core
        .notify(addr(1, 7000), view.key.peer, b"kv".to_vec(), now);
    net.settle();
    let got = net.procs[target].shared.drain_notifications();
    let from: Vec<&str> = got.iter().map(|n| n.from.as_str()).collect();
    assert_eq!(from, vec!["prefill"]);
}

#[test]
fn a_restarted_peers_queue_pairs_here_go_and_other_initiators_keep_theirs() {
    let mut net = Net::new();
    let hub = net.spawn(NAME, addr(1, 7000), 11, 1);
    let restarting = net.spawn("prefill", addr(2, 7000), 20, 1);
    let other = net.spawn("other", addr(3, 7000), 30, 1);
    let answers = [
        net.connect(restarting, addr(1, 7000)),
        net.connect(other, addr(1, 7000)),
        net.connect(hub, addr(2, 7000)),
    ];
    net.settle();
    for answer in &answers {
        ready(answer);
    }
    assert_eq!(
        initiators(&net, hub),
        vec![Incarnation(20), Incarnation(30)]
    );
    net.crash(restarting);
    net.settle();
    net.spawn("prefill", addr(2, 7000), 21, 1);
    let again = net.connect(hub, addr(2, 7000));
    net.settle();
    assert_eq!(ready(&again).key.peer, Incarnation(21));
    assert_eq!(
        initiators(&net, hub),
        vec![Incarnation(30)],
        "the restarted initiator's queue pair went, no one else's"
    );
    assert_eq!(
        net.stats(hub).teardowns,
        2,
        "the endpoint to it and its queue pair here"
    );
}

#[test]
fn the_fabrics_forget_a_restarted_peers_descriptor() {
    let fabric = TcpLikeFabric::default();
    let (mut core, _) = lone_core(fabric.clone());
    let now = Instant::now();
    let (conn, answer) = lone_core_meets(&mut core, 20, now);
    let old = answer.try_recv().expect("answered").expect("an endpoint");
    assert_eq!(fabric.log().learnt, vec![Incarnation(20)]);
    core.closed(conn, "reset", now);
    assert!(
        fabric.log().forgotten.is_empty(),
        "its endpoint still refers to it"
    );
    // Another incarnation answers at its address: 20 is gone.
    lone_core_meets(&mut core, 21, now);
    assert_eq!(old.phase(), Phase::Retired);
    assert_eq!(fabric.log().forgotten, vec![Incarnation(20)]);
}

#[test]
fn the_fabrics_forget_a_restarted_peers_descriptor_made_stale_by_reconnects() {
    let fabric = TcpLikeFabric::default();
    let (mut core, _) = lone_core(fabric.clone());
    let now = Instant::now();
    let (conn, answer) = lone_core_meets(&mut core, 20, now);
    let old = answer.try_recv().expect("answered").expect("an endpoint");
    // The peer crashes: its queue pair fails and the endpoint tries a new one, which asks
    // for a fresh descriptor (the cached one is stale from then on).
    core.closed(conn, "reset", now);
    core.poller_event(
        0,
        Event::QpFatal {
            endpoint: old.id,
            epoch: Epoch::FIRST,
        },
        now,
    );
    let later = now + Duration::from_secs(6);
    core.tick(later);
    // (The first redial, made at the failure, timed out unanswered: the last one is open.)
    let redial = publish_phases(&mut core)
        .into_iter()
        .filter_map(|action| match action {
            Action::Dial { conn, .. } => Some(conn),
            _ => None,
        })
        .last()
        .expect("a redial");
    assert_ne!(old.phase(), Phase::Ready);
    // Another incarnation answers at its address before any descriptor of 20 came back.
    core.dialed(redial, addr(1, 7000).ip());
    core.received(redial, hello_from("prefill", 21), later);
    publish_phases(&mut core);
    assert_eq!(old.phase(), Phase::Retired);
    assert_eq!(fabric.log().forgotten, vec![Incarnation(20)]);
}

// ---- target queue pairs ----------------------------------------------------------------

#[test]
fn a_repeated_connect_qp_is_answered_with_the_same_queue_pair() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let sent = net.raw_peer_says(
        target,
        vec![
            hello_from("prefill", 5),
            connect_qp_from(5, 1, 1, 1),
            connect_qp_from(5, 1, 1, 2),
        ],
    );
    let granted = granted(&sent);
    assert_eq!(granted.len(), 2, "{sent:?}");
    assert_eq!(
        granted[0], granted[1],
        "the same queue pair, not a second one"
    );
    let stats = net.stats(target);
    assert_eq!(
        (stats.passive_qps, stats.idempotent_replies, stats.teardowns),
        (1, 1, 0)
    );
}

#[test]
fn a_connect_qp_on_the_same_or_a_newer_connection_replaces_the_queue_pair() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let remote = |net: &Net| -> Vec<u32> {
        net.procs[target]
            .core
            .passive
            .values()
            .map(|passive| passive.remote_qp_num)
            .collect()
    };
    let sent = net.raw_peer_says(
        target,
        vec![
            hello_from("prefill", 5),
            connect_qp_from(5, 1, 1, 1),
            connect_qp_from(5, 2, 2, 2),
        ],
    );
    assert_eq!(granted(&sent).len(), 2, "{sent:?}");
    assert_eq!(remote(&net), vec![2]);
    let sent = net.raw_peer_says(
        target,
        vec![hello_from("prefill", 5), connect_qp_from(5, 3, 3, 3)],
    );
    assert_eq!(granted(&sent).len(), 1, "{sent:?}");
    assert_eq!(remote(&net), vec![3]);
    let stats = net.stats(target);
    assert_eq!((stats.refused, stats.teardowns), (0, 2));
}

#[test]
fn queue_pairs_are_counted_by_fabric() {
    let (net, target, prefill, _) = connected_pair();
    assert_eq!(
        (net.stats(target).tcp_qps, net.stats(prefill).tcp_qps),
        (0, 0),
        "the fake fabric's queue pairs are not TCP's"
    );
    let (mut core, shared) = lone_core(TcpLikeFabric::default());
    let now = Instant::now();
    let conn = core.accepted(addr(9, 9999), addr(1, 7000).ip(), now);
    core.received(conn, hello_from("prefill", 5), now);
    core.received(conn, connect_qp_from(5, 1, 1, 1), now);
    assert_eq!((shared.stats().passive_qps, shared.stats().tcp_qps), (1, 1));
    lone_core_meets(&mut core, 20, now);
    assert_eq!((shared.stats().active_qps, shared.stats().tcp_qps), (1, 2));
}

// ---- the initiator's side ----------------------------------------------------------------

#[test]
fn a_reply_is_taken_only_from_the_connection_its_request_went_out_on() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    // The target has a connection of its own to the initiator.
    let back = net.connect(target, addr(2, 7000));
    net.settle();
    ready(&back);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle_holding(|to, message| {
        to == prefill && matches!(message, Message::ConnectQpReply { .. })
    });
    let view = answer.try_recv().expect("answered").expect("an endpoint");
    // The genuine reply, from the same peer, but on the connection the target opened.
    let (_, _, reply) = net.held[0].clone();
    let other = accepted_from(&net, prefill, target);
    let now = net.now;
    net.procs[prefill].core.received(other, reply, now);
    net.settle();
    assert_eq!(net.stats(prefill).stray_replies, 1);
    assert!(net.staged_by(prefill).is_empty(), "nothing was staged");
    assert_eq!(view.phase(), Phase::Connecting);
    net.release(0);
    net.settle();
    assert_eq!(view.phase(), Phase::Ready);
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn a_failed_queue_pair_is_announced_retired_at_once_and_a_stale_failure_retires_nothing() {
    let (mut net, target, prefill, view) = connected_pair();
    let failed = |net: &mut Net, epoch: Epoch| {
        let now = net.now;
        net.procs[prefill].core.poller_event(
            0,
            Event::QpFailed {
                endpoint: view.id,
                epoch,
                status: WcStatus::RetryExcErr,
            },
            now,
        );
        net.settle();
    };
    failed(&mut net, Epoch::new(1));
    assert_eq!(
        net.stats(target).passive_retired,
        1,
        "the target executes nothing more from it, before any reconnect"
    );
    assert!(net.procs[target].core.passive.is_empty());
    net.advance(Duration::from_millis(50));
    net.settle();
    assert_eq!(
        (view.phase(), view.epoch()),
        (Phase::Ready, Some(Epoch::new(2)))
    );
    // A late report about epoch 1.
    failed(&mut net, Epoch::new(1));
    assert_eq!(
        net.stats(target).passive_retired,
        1,
        "the queue pair of epoch 2 stays"
    );
    assert_eq!(net.procs[target].core.passive.len(), 1);
    assert_eq!(view.phase(), Phase::Ready);
}

// ---- application requests ----------------------------------------------------------------

#[test]
fn a_connect_on_an_open_connection_answers_with_the_peers_current_descriptor() {
    let (mut net, target, prefill, view) = connected_pair();
    assert!(regions(&view).is_empty());
    net.procs[target].shared.set_regions(vec![region()]);
    let again = net.connect(prefill, addr(1, 7000));
    assert!(
        matches!(again.try_recv(), Err(TryRecvError::Empty)),
        "not before the peer's current descriptor is in"
    );
    net.settle();
    let same = ready(&again);
    assert!(Arc::ptr_eq(&same, &view), "the endpoint that exists");
    assert_eq!(regions(&same), vec![region()]);
}

#[test]
fn a_connect_waits_for_the_peer_up_to_the_connect_timeout() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    net.stop(target); // its kernel accepts; it never answers
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle();
    net.advance(policy().connect_timeout - Duration::from_millis(1));
    assert!(
        matches!(answer.try_recv(), Err(TryRecvError::Empty)),
        "still waiting"
    );
    net.advance(Duration::from_millis(1));
    assert!(
        matches!(answer.try_recv(), Ok(Err(ControlError::Unreachable { .. }))),
        "given up at the connect timeout"
    );
}

#[test]
fn a_descriptor_refresh_asks_the_incarnation_named_and_no_other() {
    let (mut net, target, prefill, view) = connected_pair();
    net.procs[target].shared.set_regions(vec![region()]);
    net.procs[prefill]
        .core
        .refresh_descriptor(addr(1, 7000), Incarnation(12));
    net.settle();
    assert!(regions(&view).is_empty(), "12 is not who listens there");
    net.procs[prefill]
        .core
        .refresh_descriptor(addr(1, 7000), Incarnation(11));
    net.settle();
    assert_eq!(regions(&view), vec![region()]);
}

// ---- the cluster directory ---------------------------------------------------------------

#[test]
fn a_directory_restart_of_an_initiator_drops_its_queue_pairs_here() {
    let (mut net, target, _, _) = connected_pair();
    // The target holds 20's queue pair and has no endpoint to it.
    assert_eq!(initiators(&net, target), vec![Incarnation(20)]);
    let now = net.now;
    net.procs[target].core.peer_changed(
        "prefill",
        restarted(Incarnation(20), Incarnation(21), addr(2, 7000)),
        now,
    );
    net.settle();
    assert!(initiators(&net, target).is_empty());
    assert_eq!(net.stats(target).peer_restarts, 1);
    assert_eq!(net.stats(target).teardowns, 1);
}

#[test]
fn a_successor_that_never_said_hello_is_replaced_in_turn() {
    let (mut net, _, prefill, first) = connected_pair();
    // The directory names 12 at 7100, where nothing answers yet...
    net.directory_says(
        prefill,
        restarted(Incarnation(11), Incarnation(12), addr(1, 7100)),
    );
    assert_eq!(first.phase(), Phase::Retired);
    let second = endpoint_to(&net, prefill, Incarnation(12), 0).expect("an endpoint to 12");
    // ... and 12 is replaced by 13 at 7200 before it ever answered.
    net.spawn(NAME, addr(1, 7200), 13, 1);
    net.directory_says(
        prefill,
        restarted(Incarnation(12), Incarnation(13), addr(1, 7200)),
    );
    assert_eq!(second.phase(), Phase::Retired);
    let third = endpoint_to(&net, prefill, Incarnation(13), 0).expect("an endpoint to 13");
    assert_eq!(third.phase(), Phase::Ready);
    assert_eq!(net.stats(prefill).peer_restarts, 2);
}

#[test]
fn a_directory_restart_of_a_stranger_changes_nothing_here() {
    let (mut net, _, prefill, view) = connected_pair();
    net.directory_says(
        prefill,
        restarted(Incarnation(50), Incarnation(51), addr(5, 7000)),
    );
    assert_eq!(net.stats(prefill).peer_restarts, 0);
    assert_eq!(net.retired_endpoints(prefill), 0);
    assert_eq!(view.phase(), Phase::Ready);
}

#[test]
fn a_directory_restart_at_the_same_address_replaces_endpoints_before_the_newcomer_answers() {
    let (mut net, old, prefill, view) = connected_pair();
    net.crash(old);
    net.settle();
    net.spawn(NAME, addr(1, 7000), 12, 1);
    net.directory_says(
        prefill,
        restarted(Incarnation(11), Incarnation(12), addr(1, 7000)),
    );
    assert_eq!(view.phase(), Phase::Retired);
    let fresh = endpoint_to(&net, prefill, Incarnation(12), 0).expect("an endpoint to 12");
    assert_eq!(fresh.phase(), Phase::Ready);
    assert_eq!(net.stats(prefill).peer_restarts, 1);
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn a_directory_restart_to_a_successor_already_answering_moves_the_endpoints_to_it() {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 2);
    net.spawn(NAME, addr(1, 7100), 12, 2);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let to_old = connect_rails(&mut net, prefill, addr(1, 7000), 0, 1);
    let to_new = net.connect(prefill, addr(1, 7100));
    net.settle();
    let (old, new) = (ready(&to_old), ready(&to_new));
    // 12 answers at 7100 already when the directory reports that it replaced 11.
    net.directory_says(
        prefill,
        restarted(Incarnation(11), Incarnation(12), addr(1, 7100)),
    );
    assert_eq!(old.phase(), Phase::Retired);
    assert_eq!(new.phase(), Phase::Ready);
    let moved = endpoint_to(&net, prefill, Incarnation(12), 1).expect("the rails of the old one");
    assert_eq!(moved.phase(), Phase::Ready);
    assert_eq!(net.stats(prefill).peer_restarts, 1);
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn a_lost_lease_spares_a_peer_heard_within_the_liveness_timeout_and_no_longer() {
    let (mut net, _, prefill, view) = connected_pair();
    let circuit_warnings = |net: &Net| net.stats(prefill).warnings[WarningKind::Circuit.index()];
    let incarnation = Incarnation(11);
    // The lease events come before the next tick.
    net.now += policy().liveness_timeout - Duration::from_millis(1);
    net.directory_says(prefill, PeerChange::Gone { incarnation });
    assert_eq!(view.phase(), Phase::Ready);
    assert_eq!(
        circuit_warnings(&net),
        0,
        "nothing failed, nothing to warn of"
    );
    net.now += Duration::from_millis(1);
    net.directory_says(prefill, PeerChange::Gone { incarnation });
    assert_eq!(view.phase(), Phase::CircuitOpen);
    assert_eq!(
        circuit_warnings(&net),
        2,
        "the lost lease, and the circuit it opened"
    );
}

#[test]
fn a_redial_still_waiting_for_hello_does_not_vouch_for_a_peer_that_lost_its_lease() {
    let (mut net, target, prefill, view) = connected_pair();
    // The target drops the connection and stops; its kernel accepts the redial.
    let accepted = accepted_from(&net, target, prefill);
    let now = net.now;
    net.procs[target].core.closed(accepted, "stalled", now);
    net.pump();
    net.stop(target);
    net.advance(Duration::from_millis(10));
    net.settle();
    let redial = dialed_conn(&net, prefill, addr(1, 7000));
    assert!(!net.procs[prefill].core.admitted(redial), "no Hello on it");
    net.directory_says(
        prefill,
        PeerChange::Gone {
            incarnation: Incarnation(11),
        },
    );
    assert_eq!(view.phase(), Phase::CircuitOpen);
}
