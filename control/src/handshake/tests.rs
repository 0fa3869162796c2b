//! The handshake core on virtual time: several processes' cores wired together by an
//! in-memory network whose deliveries a test can hold back and reorder, over a fake fabric
//! that records which queue pair each endpoint was handed.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::{QpInfo, WcStatus};
use railyard_dataplane::{Command, EndpointId, Epoch, Event};

use super::state::{EVICTABLE_AFTER, MAX_HELD};
use super::*;
use crate::auth::ClusterSecret;
use crate::descriptor::RailDescriptor;
use crate::descriptor::SegmentDescriptor;
use crate::endpoint::{Incarnation, Phase};
use crate::error::ControlError;
use crate::host::HostId;
use crate::policy::Policy;
use crate::rail::{PeerLink, RailFabric, Revocation};
use crate::session::{FrameOpener, FrameSealer, SessionKeys, TAG_LEN};
use crate::shared::ControlShared;
use crate::shared::{EndpointView, NotificationBody};
use crate::warn::WarningKind;
use crate::wire::{HEADER_LEN, Message, NONCE_LEN, QpSide, WireKey};
use railyard_dataplane::fabric::tcp::TcpAttachment;

/// Who owns every fake queue pair, and what each process staged.
#[derive(Default)]
struct Registry {
    next_qp: u32,
    owner: HashMap<u32, Incarnation>,
    /// (staging process, endpoint, epoch, the remote queue pair it is connected to).
    staged: Vec<(Incarnation, EndpointId, Epoch, u32)>,
    revoked: Vec<u32>,
}

#[derive(Clone)]
struct FakeFabric {
    registry: Arc<Mutex<Registry>>,
    owner: Incarnation,
}

impl FakeFabric {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new_qp(&self) -> (u32, QpSide) {
        let mut registry = self.registry();
        registry.next_qp += 1;
        let qp_num = registry.next_qp;
        registry.owner.insert(qp_num, self.owner);
        let side = qp_side(qp_num);
        (qp_num, side)
    }
}

impl RailFabric for FakeFabric {
    type Qp = u32;
    type Connected = (u32, u32);

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

    fn take_immediates(&self, _qp: &mut (u32, u32), _out: &mut Vec<u32>) -> Result<(), String> {
        Ok(())
    }

    fn connect_qp(&self, qp: u32, remote: &QpSide) -> Result<(u32, u32), String> {
        Ok((qp, remote.info.qp_num))
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: (u32, u32)) -> Result<(), String> {
        let owner = self.owner;
        self.registry().staged.push((owner, endpoint, epoch, qp.1));
        Ok(())
    }

    fn revoke(&self, qp: (u32, u32)) -> Revocation {
        self.registry().revoked.push(qp.0);
        Revocation::done()
    }

    fn describe(&self) -> RailDescriptor {
        RailDescriptor {
            name: "fake".into(),
            fabric: 0,
            tcp_port: 0,
            address: Vec::new(),
        }
    }
}

struct Proc {
    core: Core<FakeFabric>,
    shared: Arc<ControlShared>,
    addr: SocketAddr,
    incarnation: Incarnation,
    commands: Vec<(u16, Command)>,
    /// Whether the process is still up (a crashed one drops what reaches it).
    up: bool,
    /// Stopped: up, connections open, but it neither handles nor answers anything.
    stopped: bool,
    /// The session keys the core handed over, by connection.
    keys: Vec<(ConnId, Box<SessionKeys>)>,
}

type Delivery = (usize, ConnId, Message);

/// Processes and the in-memory network between them.
struct Net {
    procs: Vec<Proc>,
    links: HashMap<(usize, ConnId), (usize, ConnId)>,
    wire: VecDeque<Delivery>,
    held: Vec<Delivery>,
    now: Instant,
    registry: Arc<Mutex<Registry>>,
    next_port: u16,
}

const NAME: &str = "decode";

/// The tests' policy: liveness is left to the tests about it (time here moves in jumps of
/// seconds, with no one answering pings in between).
fn policy() -> Policy {
    Policy {
        backoff_min: Duration::from_millis(1),
        keepalive_interval: Duration::from_secs(3600),
        liveness_timeout: Duration::from_secs(7200),
        ..Policy::default()
    }
}

impl Net {
    fn new() -> Self {
        Self {
            procs: Vec::new(),
            links: HashMap::new(),
            wire: VecDeque::new(),
            held: Vec::new(),
            now: Instant::now(),
            registry: Arc::default(),
            next_port: 40_000,
        }
    }

    /// Starts a process named `name` listening at `addr` with `rails` rails.
    fn spawn(&mut self, name: &str, addr: SocketAddr, incarnation: u64, rails: usize) -> usize {
        self.spawn_with(name, addr, incarnation, rails, policy())
    }

    fn spawn_with(
        &mut self,
        name: &str,
        addr: SocketAddr,
        incarnation: u64,
        rails: usize,
        policy: Policy,
    ) -> usize {
        let incarnation = Incarnation(incarnation);
        let shared = ControlShared::new(rails);
        let fabrics = (0..rails)
            .map(|_| FakeFabric {
                registry: self.registry.clone(),
                owner: incarnation,
            })
            .collect();
        let core = Core::new(
            Identity {
                name: name.into(),
                incarnation,
                local_addr: addr,
                host: HostId::default(),
                secret: None,
                encrypt_control: false,
            },
            policy,
            incarnation.0,
            fabrics,
            shared.clone(),
        );
        self.procs.push(Proc {
            core,
            shared,
            addr,
            incarnation,
            commands: Vec::new(),
            up: true,
            stopped: false,
            keys: Vec::new(),
        });
        self.procs.len() - 1
    }

    /// A process stops (SIGSTOP): it keeps its connections but handles nothing; what reaches
    /// it is lost to the test.
    fn stop(&mut self, index: usize) {
        self.procs[index].stopped = true;
    }

    /// A process crashes: its connections reset (the peers see them close).
    fn crash(&mut self, index: usize) {
        self.procs[index].up = false;
        let links: Vec<((usize, ConnId), (usize, ConnId))> = self
            .links
            .iter()
            .filter(|((from, _), _)| *from == index)
            .map(|(a, b)| (*a, *b))
            .collect();
        for (mine, (peer, conn)) in links {
            self.links.remove(&mine);
            self.links.remove(&(peer, conn));
            let now = self.now;
            self.procs[peer].core.closed(conn, "reset", now);
        }
        self.wire.retain(|(to, _, _)| *to != index);
    }

    /// Carries out every process's actions.
    fn pump(&mut self) {
        for index in 0..self.procs.len() {
            while let Some(action) = self.procs[index].core.next_action() {
                self.carry_out(index, action);
            }
        }
    }

    fn carry_out(&mut self, index: usize, action: Action) {
        let now = self.now;
        match action {
            Action::Dial { conn, addr } => {
                let listener = self
                    .procs
                    .iter()
                    .position(|proc| proc.up && proc.addr == addr);
                let Some(target) = listener else {
                    return self.procs[index].core.closed(conn, "refused", now);
                };
                self.next_port += 1;
                let from = SocketAddr::new(self.procs[index].addr.ip(), self.next_port);
                let accepted = self.procs[target].core.accepted(from, addr.ip(), now);
                self.links.insert((index, conn), (target, accepted));
                self.links.insert((target, accepted), (index, conn));
                let ip = self.procs[index].addr.ip();
                self.procs[index].core.dialed(conn, ip);
            }
            Action::Send { conn, message } => {
                if let Some(&(to, their_conn)) = self.links.get(&(index, conn)) {
                    self.wire.push_back((to, their_conn, message));
                }
            }
            Action::Close { conn } => {
                if let Some((peer, their_conn)) = self.links.remove(&(index, conn)) {
                    self.links.remove(&(peer, their_conn));
                    self.procs[peer].core.closed(their_conn, "closed", now);
                }
            }
            Action::Command { rail, command } => self.procs[index].commands.push((rail, command)),
            Action::AddEndpoint { rail, view, epoch } => {
                view.set_epoch(epoch);
                self.procs[index].commands.push((
                    rail,
                    Command::AddEndpoint {
                        endpoint: view.id,
                        epoch,
                    },
                ));
            }
            Action::Publish {
                view,
                phase,
                probation,
            } => view.publish(phase, probation),
            Action::Protect { conn, keys } => self.procs[index].keys.push((conn, keys)),
        }
    }

    /// Delivers until nothing moves; messages `hold` picks are kept back instead.
    fn settle_holding(&mut self, hold: impl Fn(usize, &Message) -> bool) {
        for _ in 0..10_000 {
            self.pump();
            let Some((to, conn, message)) = self.wire.pop_front() else {
                return;
            };
            if hold(to, &message) {
                self.held.push((to, conn, message));
                continue;
            }
            let now = self.now;
            if self.procs[to].up && !self.procs[to].stopped {
                self.procs[to].core.received(conn, message, now);
            }
        }
        panic!("the network did not settle");
    }

    fn settle(&mut self) {
        self.settle_holding(|_, _| false);
    }

    /// The cluster directory tells process `index` that [`NAME`] changed; then settles.
    fn directory_says(&mut self, index: usize, change: PeerChange) {
        let now = self.now;
        self.procs[index].core.peer_changed(NAME, change, now);
        self.settle();
    }

    /// Delivers the held message `position` now.
    fn release(&mut self, position: usize) {
        let (to, conn, message) = self.held.remove(position);
        let now = self.now;
        self.procs[to].core.received(conn, message, now);
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        let now = self.now;
        for proc in self.procs.iter_mut().filter(|proc| !proc.stopped) {
            proc.core.tick(now);
        }
    }

    /// Advances `by` in steps of `step`, delivering everything between steps (the way real
    /// time passes for live processes that answer pings).
    fn run_for(&mut self, by: Duration, step: Duration) {
        let end = self.now + by;
        while self.now < end {
            self.advance(step);
            self.settle();
        }
    }

    /// Asks process `index` for an endpoint to `addr`, rails 0 → 0.
    fn connect(
        &mut self,
        index: usize,
        addr: SocketAddr,
    ) -> Receiver<Result<Arc<EndpointView>, ControlError>> {
        let (reply, answer) = mpsc::channel();
        let now = self.now;
        self.procs[index].core.connect(addr, 0, 0, reply, now);
        answer
    }

    /// What process `index` staged: (endpoint's peer, owner of the remote queue pair).
    fn staged_by(&self, index: usize) -> Vec<(EndpointId, Epoch, Incarnation, Incarnation)> {
        let me = self.procs[index].incarnation;
        let registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        registry
            .staged
            .iter()
            .filter(|(owner, ..)| *owner == me)
            .map(|&(_, endpoint, epoch, remote)| {
                let meant = self.procs[index]
                    .shared
                    .view(0, endpoint)
                    .map_or(Incarnation(0), |view| view.key.peer);
                (endpoint, epoch, meant, registry.owner[&remote])
            })
            .collect()
    }

    fn retired_endpoints(&self, index: usize) -> usize {
        self.procs[index]
            .commands
            .iter()
            .filter(|(_, command)| matches!(command, Command::RetireEndpoint { .. }))
            .count()
    }

    fn stats(&self, index: usize) -> crate::shared::ControlStats {
        self.procs[index].shared.stats()
    }
}

/// A target (incarnation 11, named [`NAME`], at 10.0.0.1:7000) and an initiator (20,
/// "prefill", at 10.0.0.2:7000) with one ready endpoint from the initiator to the target:
/// (network, target, initiator, endpoint).
fn connected_pair() -> (Net, usize, usize, Arc<EndpointView>) {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let initiator = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(initiator, addr(1, 7000));
    net.settle();
    let view = ready(&answer);
    (net, target, initiator, view)
}

type Answer = Receiver<Result<Arc<EndpointView>, ControlError>>;

/// Two targets named [`NAME`] (11 at 10.0.0.1:7000, 12 at :7001) and an initiator that
/// opens both at once, on the same rails, both waiting at epoch 1: their ConnectQp replies
/// are held in `net.held`. (network, initiator, answer for 11, answer for 12).
fn two_targets_with_replies_held() -> (Net, usize, Answer, Answer) {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 1);
    net.spawn(NAME, addr(1, 7001), 12, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let to_b = net.connect(prefill, addr(1, 7000));
    let to_c = net.connect(prefill, addr(1, 7001));
    net.settle_holding(|to, message| {
        to == prefill && matches!(message, Message::ConnectQpReply { .. })
    });
    (net, prefill, to_b, to_c)
}

/// A Hello from a raw peer named `name` (it does not listen).
fn hello_from(name: &str, incarnation: u64) -> Message {
    Message::Hello {
        name: name.into(),
        incarnation: Incarnation(incarnation),
        host: HostId::default(),
        listen: String::new(),
        nonce: [0; crate::wire::NONCE_LEN],
        encrypt: false,
    }
}

/// A fake queue pair's side.
fn qp_side(qp_num: u32) -> QpSide {
    QpSide {
        info: QpInfo {
            qp_num,
            lid: 0,
            gid: [0; 16],
            psn: 0,
            path_mtu: 4096,
        },
        attachment: Vec::new(),
    }
}

fn addr(host: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, host)), port)
}

fn ready(answer: &Receiver<Result<Arc<EndpointView>, ControlError>>) -> Arc<EndpointView> {
    let view = answer
        .try_recv()
        .expect("answered")
        .expect("an endpoint, not an error");
    assert_eq!(view.phase(), Phase::Ready, "{view:?}");
    view
}

/// Every queue pair a process staged is connected to a queue pair of the peer its endpoint
/// is for.
fn assert_no_crossed_queue_pairs(net: &Net, index: usize) {
    let staged = net.staged_by(index);
    assert!(!staged.is_empty());
    for (endpoint, epoch, meant, connected_to) in staged {
        assert_eq!(
            meant, connected_to,
            "endpoint {endpoint:?} at {epoch} was handed a queue pair connected to {connected_to}, \
             but it is for {meant}"
        );
    }
}

#[test]
fn two_live_processes_with_one_name_are_two_peers() {
    let mut net = Net::new();
    let first = net.spawn(NAME, addr(1, 7000), 11, 1);
    let second = net.spawn(NAME, addr(1, 7001), 12, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let to_first = net.connect(prefill, addr(1, 7000));
    net.settle();
    let to_second = net.connect(prefill, addr(1, 7001));
    net.settle();
    let (a, b) = (ready(&to_first), ready(&to_second));
    assert_eq!(a.key.peer, Incarnation(11));
    assert_eq!(b.key.peer, Incarnation(12));
    assert_eq!(
        a.phase(),
        Phase::Ready,
        "the second peer did not retire the first"
    );
    assert_eq!(net.retired_endpoints(prefill), 0);
    assert_eq!(net.stats(prefill).peer_restarts, 0);
    assert_eq!(net.stats(first).passive_qps, 1);
    assert_eq!(net.stats(second).passive_qps, 1);
    assert_eq!(
        a.descriptor().map(|d| d.incarnation),
        Some(Incarnation(11)),
        "each endpoint sees its own peer's descriptor"
    );
    assert_eq!(b.descriptor().map(|d| d.incarnation), Some(Incarnation(12)));
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn a_new_incarnation_at_the_same_address_replaces_the_old_one() {
    let (mut net, old, prefill, view) = connected_pair();
    net.crash(old);
    net.settle();
    // A process with another name takes the port; the initiator dials it again.
    net.spawn("someone-else", addr(1, 7000), 13, 1);
    let again = net.connect(prefill, addr(1, 7000));
    net.settle();
    assert_eq!(view.phase(), Phase::Retired);
    assert_eq!(net.stats(prefill).peer_restarts, 1);
    let fresh = ready(&again);
    assert_eq!(fresh.key.peer, Incarnation(13));
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn replies_cannot_cross_between_peers_opened_at_once() {
    let (mut net, prefill, to_b, to_c) = two_targets_with_replies_held();
    assert_eq!(net.held.len(), 2);
    // Both endpoints wait at epoch 1 on the same rails; C's reply goes in first — the old
    // matcher (rails and epoch only) gave it to whichever endpoint the map yielded first.
    let c_first = net
        .held
        .iter()
        .position(|(_, _, message)| {
            matches!(message, Message::ConnectQpReply { key, .. } if key.target == Incarnation(12))
        })
        .expect("C's reply");
    net.release(c_first);
    net.release(0);
    net.settle();
    let (view_b, view_c) = (ready(&to_b), ready(&to_c));
    assert_eq!(
        (view_b.key.peer, view_c.key.peer),
        (Incarnation(11), Incarnation(12))
    );
    assert_no_crossed_queue_pairs(&net, prefill);
    assert_eq!(net.stats(prefill).stray_replies, 0);
}

#[test]
fn a_reply_on_another_connection_or_with_another_id_is_stray() {
    let (mut net, prefill, to_b, to_c) = two_targets_with_replies_held();
    let position = |net: &Net, target: u64| {
        net.held
            .iter()
            .position(|(_, _, message)| {
                matches!(message, Message::ConnectQpReply { key, .. } if key.target == Incarnation(target))
            })
            .expect("held")
    };
    // C's reply, delivered on B's connection: refused whatever it says.
    let (_, b_conn, _) = net.held[position(&net, 11)].clone();
    let (_, _, c_reply) = net.held[position(&net, 12)].clone();
    let now = net.now;
    net.procs[prefill]
        .core
        .received(b_conn, c_reply.clone(), now);
    // B's connection, B's key, but a handshake id nobody waits for.
    let Message::ConnectQpReply {
        key,
        epoch,
        fence,
        result,
        ..
    } = net.held[position(&net, 11)].2.clone()
    else {
        unreachable!("held replies only");
    };
    let forged = Message::ConnectQpReply {
        key,
        epoch,
        handshake: 0xdead_beef,
        fence,
        result,
    };
    net.procs[prefill].core.received(b_conn, forged, now);
    assert_eq!(net.stats(prefill).stray_replies, 2);
    assert!(net.staged_by(prefill).is_empty(), "nothing was staged");
    // The genuine replies still connect both.
    while !net.held.is_empty() {
        net.release(0);
    }
    net.settle();
    ready(&to_b);
    ready(&to_c);
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn a_retired_endpoint_cancels_its_handshake_and_swallows_no_other_reply() {
    let (mut net, prefill, to_b, to_c) = two_targets_with_replies_held();
    let view_b = to_b.try_recv().expect("answered").expect("endpoint");
    let now = net.now;
    net.procs[prefill].core.retire(0, view_b.id, now);
    net.pump();
    while !net.held.is_empty() {
        net.release(0);
    }
    net.settle();
    assert_eq!(view_b.phase(), Phase::Retired);
    assert_eq!(
        net.stats(prefill).stray_replies,
        1,
        "B's reply found no one"
    );
    let view_c = ready(&to_c);
    assert_eq!(view_c.key.peer, Incarnation(12));
    let staged = net.staged_by(prefill);
    assert_eq!(
        staged.len(),
        1,
        "only C's queue pair was staged: {staged:?}"
    );
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn every_endpoint_bumped_to_the_same_epochs_reconnects_to_its_own_peer() {
    let mut net = Net::new();
    let targets: Vec<usize> = (0..4)
        .map(|i| net.spawn(NAME, addr(1, 7000 + i), 100 + u64::from(i), 1))
        .collect();
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answers: Vec<_> = (0..4)
        .map(|i| net.connect(prefill, addr(1, 7000 + i)))
        .collect();
    net.settle();
    let views: Vec<_> = answers.iter().map(ready).collect();
    for round in 0..3 {
        // A NIC blip: every endpoint's queue pair fails at once.
        let now = net.now;
        for view in &views {
            let epoch = view.epoch().expect("connected");
            net.procs[prefill].core.poller_event(
                0,
                Event::QpFailed {
                    endpoint: view.id,
                    epoch,
                    status: WcStatus::RetryExcErr,
                },
                now,
            );
        }
        net.advance(Duration::from_millis(50)); // past the backoff
        // Replies come back in the reverse order of the requests.
        net.settle_holding(|to, message| {
            to == 4 && matches!(message, Message::ConnectQpReply { .. })
        });
        assert_eq!(net.held.len(), 4, "round {round}");
        while let Some(last) = net.held.len().checked_sub(1) {
            net.release(last);
        }
        net.settle();
        let now = net.now;
        for view in &views {
            assert_eq!(view.phase(), Phase::Ready, "round {round}: {view:?}");
            let epoch = view.epoch().expect("connected");
            net.procs[prefill].core.poller_event(
                0,
                Event::Confirmed {
                    endpoint: view.id,
                    epoch,
                },
                now,
            );
        }
        // Long enough up that the next failure is not a flap.
        net.advance(policy().flap_after_ready * 2);
    }
    assert_no_crossed_queue_pairs(&net, prefill);
    assert_eq!(
        net.stats(prefill).reconnects,
        12,
        "one reconnect per endpoint per bump"
    );
    assert_eq!(net.stats(prefill).stray_replies, 0);
    let _ = targets;
}

#[test]
fn a_stale_attempt_reply_is_stray_after_the_endpoint_moved_on() {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle_holding(|to, message| to == 1 && matches!(message, Message::ConnectQpReply { .. }));
    let view = answer.try_recv().expect("answered").expect("endpoint");
    // The handshake times out; the endpoint backs off and tries again at epoch 2.
    net.advance(policy().connect_timeout + Duration::from_millis(1));
    net.advance(Duration::from_millis(50));
    net.settle_holding(|to, message| {
        to == 1 && matches!(message, Message::ConnectQpReply { epoch: 1, .. })
    });
    assert_eq!(view.phase(), Phase::Ready);
    assert_eq!(view.epoch(), Some(Epoch::new(2)));
    net.release(0); // the reply of epoch 1 arrives late
    net.settle();
    assert_eq!(net.stats(prefill).stray_replies, 1);
    assert_eq!(view.epoch(), Some(Epoch::new(2)));
    assert_eq!(net.staged_by(prefill).len(), 1, "only epoch 2 was staged");
}

#[test]
fn a_connect_qp_for_another_initiator_is_refused() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle_holding(|to, message| to == target && matches!(message, Message::ConnectQp { .. }));
    let (to, conn, message) = net.held.remove(0);
    let Message::ConnectQp {
        key,
        epoch,
        handshake,
        side,
    } = message
    else {
        unreachable!("held ConnectQp only");
    };
    let impostor = WireKey {
        initiator: Incarnation(99),
        ..key
    };
    let now = net.now;
    net.procs[to].core.received(
        conn,
        Message::ConnectQp {
            key: impostor,
            epoch,
            handshake,
            side,
        },
        now,
    );
    net.settle();
    assert_eq!(net.stats(target).refused, 1);
    assert_eq!(net.stats(target).passive_qps, 0);
    let view = answer.try_recv().expect("answered").expect("endpoint");
    assert_ne!(
        view.phase(),
        Phase::Ready,
        "its own request was never answered"
    );
    assert_eq!(
        net.stats(prefill).stray_replies,
        1,
        "the refusal named a key it did not ask"
    );
}

#[test]
fn a_notification_reaches_only_the_incarnation_it_names() {
    let (mut net, old, prefill, view) = connected_pair();
    let now = net.now;
    net.procs[prefill]
        .core
        .notify(addr(1, 7000), view.key.peer, b"block 1".to_vec(), now);
    net.settle();
    let got = net.procs[old].shared.drain_notifications();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].incarnation, Incarnation(20));
    assert_eq!(got[0].body, NotificationBody::Bytes(b"block 1".to_vec()));
    // The target dies; another process takes its port under the same name.
    net.crash(old);
    net.settle();
    let heir = net.spawn(NAME, addr(1, 7000), 13, 1);
    let now = net.now;
    net.procs[prefill]
        .core
        .notify(addr(1, 7000), view.key.peer, b"block 2".to_vec(), now);
    net.settle();
    assert!(net.procs[heir].shared.drain_notifications().is_empty());
    assert_eq!(net.stats(heir).notifications_refused, 1);
}

#[test]
fn nothing_but_hello_is_answered_before_hello() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let conn = net.procs[target]
        .core
        .accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    net.procs[target]
        .core
        .received(conn, Message::GetDescriptor, now);
    let mut actions = Vec::new();
    while let Some(action) = net.procs[target].core.next_action() {
        actions.push(action);
    }
    assert!(
        !actions
            .iter()
            .any(|action| matches!(action, Action::Send { .. })),
        "{actions:?}"
    );
    assert!(
        actions
            .iter()
            .any(|action| matches!(action, Action::Close { conn: closed } if *closed == conn))
    );
    assert_eq!(net.stats(target).connections_closed, 1);
}

#[test]
fn a_second_identity_or_a_foreign_descriptor_closes_the_connection() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let hello = |incarnation| hello_from("x", incarnation);
    let conn = net.procs[target]
        .core
        .accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    net.procs[target].core.received(conn, hello(5), now);
    net.procs[target].core.received(conn, hello(5), now);
    assert_eq!(
        net.stats(target).connections_closed,
        0,
        "a repeated Hello is harmless"
    );
    net.procs[target].core.received(conn, hello(6), now);
    assert_eq!(net.stats(target).connections_closed, 1);
    let conn = net.procs[target]
        .core
        .accepted(addr(3, 5001), addr(1, 7000).ip(), now);
    net.procs[target].core.received(conn, hello(7), now);
    let mut descriptor = net.procs[target].core.local_descriptor();
    descriptor.incarnation = Incarnation(8);
    net.procs[target]
        .core
        .received(conn, Message::Descriptor(descriptor), now);
    assert_eq!(net.stats(target).connections_closed, 2);
}

#[test]
fn silent_connections_are_evicted_oldest_first_and_time_out() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let cap = policy().max_handshakes;
    let core = &mut net.procs[target].core;
    let silent: Vec<ConnId> = (0..cap)
        .map(|_| core.accepted(addr(3, 5000), addr(1, 7000).ip(), now))
        .collect();
    while core.next_action().is_some() {}
    // One more, once they are past the eviction grace: the oldest silent one goes, the
    // newcomer stays.
    let later = now + EVICTABLE_AFTER;
    let newcomer = core.accepted(addr(3, 5001), addr(1, 7000).ip(), later);
    let actions: Vec<Action> = std::iter::from_fn(|| core.next_action()).collect();
    assert_eq!(closes(&actions), vec![silent[0]]);
    core.received(newcomer, hello_from("x", 5), later);
    assert_eq!(net.stats(target).connections_closed, 1);
    net.advance(policy().connect_timeout + Duration::from_millis(1));
    let closed = std::iter::from_fn(|| net.procs[target].core.next_action())
        .filter(|action| matches!(action, Action::Close { .. }))
        .count();
    assert_eq!(closed, cap - 1, "every silent one, not the speaker");
}

#[test]
fn the_listener_stops_at_the_connection_cap() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let core = &mut net.procs[target].core;
    let cap = policy().max_connections;
    let mut accepted = 0;
    while core.may_accept(now) {
        assert!(accepted < cap, "accepting past the cap");
        let conn = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
        let hello = hello_from("x", 1000 + accepted as u64);
        core.received(conn, hello, now);
        accepted += 1;
    }
    assert_eq!(accepted, cap);
}

#[test]
fn a_directory_restart_replaces_endpoints_and_a_lost_lease_fails_fast_until_it_returns() {
    let (mut net, _, prefill, view) = connected_pair();
    let replacement_target = net.spawn(NAME, addr(1, 7100), 12, 1);
    let now = net.now;
    net.procs[prefill].core.peer_changed(
        NAME,
        PeerChange::Restarted {
            old: Incarnation(11),
            new: Incarnation(12),
            addr: addr(1, 7100),
        },
        now,
    );
    net.settle();
    assert_eq!(view.phase(), Phase::Retired);
    assert_eq!(net.stats(prefill).peer_restarts, 1);
    let replacement = net.procs[prefill]
        .shared
        .view(0, EndpointId(1))
        .expect("a fresh endpoint");
    assert_eq!(replacement.key.peer, Incarnation(12));
    assert_eq!(replacement.phase(), Phase::Ready);
    // Its lease is lost and its control connection is gone too (nothing says it is alive):
    // new work fails fast, nothing is retired.
    let dialed = net
        .links
        .iter()
        .find(|((proc, _), (other, _))| *proc == prefill && *other == replacement_target)
        .map(|(&(_, conn), _)| conn)
        .expect("the initiator's connection to it");
    let now = net.now;
    net.procs[prefill].core.closed(dialed, "reset", now);
    net.pump();
    let circuit_set = |net: &Net, open: bool| {
        net.procs[prefill].commands.iter().any(|(_, command)| {
            matches!(command, Command::SetCircuit { endpoint, open: set }
                if *endpoint == replacement.id && *set == open)
        })
    };
    let incarnation = Incarnation(12);
    net.directory_says(prefill, PeerChange::Gone { incarnation });
    assert_eq!(replacement.phase(), Phase::CircuitOpen);
    assert!(circuit_set(&net, true));
    // The same incarnation claims its name again: a trial queue pair at once.
    net.directory_says(prefill, PeerChange::Returned { incarnation });
    assert_eq!(replacement.phase(), Phase::Ready);
    assert!(circuit_set(&net, false));
    assert_no_crossed_queue_pairs(&net, prefill);
}

#[test]
fn a_retire_qp_is_honoured_only_from_its_initiator_for_the_current_queue_pair() {
    let (mut net, target, prefill, _) = connected_pair();
    let registry = net.registry.clone();
    let initiator_qp = {
        let registry = registry.lock().unwrap_or_else(PoisonError::into_inner);
        *registry
            .owner
            .iter()
            .find(|(_, owner)| **owner == Incarnation(20))
            .expect("the initiator's queue pair")
            .0
    };
    let key = WireKey {
        initiator: Incarnation(20),
        target: Incarnation(11),
        initiator_rail: 0,
        target_rail: 0,
    };
    let retire = |qp_num| Message::RetireQp {
        key,
        epoch: 1,
        qp_num,
    };
    let now = net.now;
    // Another process names it; the initiator names another queue pair: both ignored.
    let stranger = net.procs[target]
        .core
        .accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    let hello = hello_from("stranger", 30);
    net.procs[target].core.received(stranger, hello, now);
    net.procs[target]
        .core
        .received(stranger, retire(initiator_qp), now);
    let initiator_conn = *net
        .links
        .iter()
        .find(|((proc, _), (other, _))| *proc == target && *other == prefill)
        .expect("the initiator's connection")
        .0;
    net.procs[target]
        .core
        .received(initiator_conn.1, retire(initiator_qp + 1000), now);
    assert_eq!(net.stats(target).passive_retired, 0);
    assert!(
        registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .revoked
            .is_empty()
    );
    // The initiator names its own queue pair: revoked.
    net.procs[target]
        .core
        .received(initiator_conn.1, retire(initiator_qp), now);
    assert_eq!(net.stats(target).passive_retired, 1);
    assert_eq!(
        registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .revoked
            .len(),
        1
    );
}

#[test]
fn a_bye_fails_the_handshakes_waiting_on_its_connection() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle_holding(|to, message| {
        to == prefill && matches!(message, Message::ConnectQpReply { .. })
    });
    let view = answer.try_recv().expect("answered").expect("endpoint");
    assert_eq!(view.phase(), Phase::Connecting);
    net.procs[target].core.say_goodbye();
    net.held.clear();
    net.settle_holding(|to, message| {
        to == prefill && matches!(message, Message::ConnectQpReply { .. })
    });
    assert_eq!(
        view.phase(),
        Phase::Backoff,
        "the handshake on the closed connection failed at once"
    );
}

#[test]
fn peers_that_come_and_go_leave_nothing_behind() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    for incarnation in 0..1000 {
        let conn = net.procs[target]
            .core
            .accepted(addr(3, 5000), addr(1, 7000).ip(), now);
        let hello = hello_from("passer-by", 1000 + incarnation);
        net.procs[target].core.received(conn, hello, now);
        net.procs[target].core.received(conn, Message::Bye, now);
    }
    let core = &net.procs[target].core;
    assert!(core.conns.is_empty());
    assert!(core.peers.is_empty(), "{} peers kept", core.peers.len());
}

#[test]
fn queue_pairs_per_initiator_are_capped() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let core = &mut net.procs[target].core;
    let conn = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    core.received(conn, hello_from("greedy", 5), now);
    let cap = policy().max_queue_pairs_per_peer;
    for rail in 0..=cap {
        let side = qp_side(1 + rail as u32);
        core.received(
            conn,
            Message::ConnectQp {
                key: WireKey {
                    initiator: Incarnation(5),
                    target: Incarnation(11),
                    initiator_rail: rail as u16,
                    target_rail: 0,
                },
                epoch: 1,
                handshake: rail as u64,
                side,
            },
            now,
        );
    }
    assert_eq!(core.passive.len(), cap);
    assert_eq!(net.stats(target).refused, 1);
}

#[test]
fn a_connect_qp_left_on_an_older_connection_never_replaces_a_newer_queue_pair() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let hello = || hello_from("prefill", 5);
    let connect = |qp_num: u32, epoch: u64| Message::ConnectQp {
        key: WireKey {
            initiator: Incarnation(5),
            target: Incarnation(11),
            initiator_rail: 0,
            target_rail: 0,
        },
        epoch,
        handshake: u64::from(qp_num),
        side: qp_side(qp_num),
    };
    let core = &mut net.procs[target].core;
    let older = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    let newer = core.accepted(addr(3, 5001), addr(1, 7000).ip(), now);
    core.received(older, hello(), now);
    core.received(newer, hello(), now);
    core.received(newer, connect(2, 2), now);
    // The abandoned connection's request is read only now.
    core.received(older, connect(1, 1), now);
    let remote: Vec<u32> = core.passive.values().map(|p| p.remote_qp_num).collect();
    assert_eq!(remote, vec![2]);
    assert_eq!(net.stats(target).refused, 1);
}

#[test]
fn a_descriptor_nobody_asked_for_closes_the_connection() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let core = &mut net.procs[target].core;
    let conn = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    core.received(conn, hello_from("x", 5), now);
    let mut descriptor = core.local_descriptor();
    descriptor.incarnation = Incarnation(5);
    core.received(conn, Message::Descriptor(descriptor), now);
    assert_eq!(net.stats(target).connections_closed, 1);
}

#[test]
fn a_late_directory_restart_does_not_undo_a_newer_hello() {
    let (mut net, _, prefill, _) = connected_pair();
    let now = net.now;
    // The directory reports 11 replaced by 12 there, but a Hello already said 11 listens:
    // the stale report changes who listens only if it names the current one as old.
    net.procs[prefill].core.peer_changed(
        NAME,
        PeerChange::Restarted {
            old: Incarnation(10),
            new: Incarnation(12),
            addr: addr(1, 7000),
        },
        now,
    );
    assert_eq!(
        net.procs[prefill].core.listeners.get(&addr(1, 7000)),
        Some(&Incarnation(11))
    );
    assert_eq!(net.stats(prefill).peer_restarts, 0);
}

#[test]
fn initiators_announcing_one_address_do_not_disturb_each_other() {
    // Two containers behind one NAT, or loopback addresses of two hosts: both announce the
    // same listener. Neither is taken for the other's restart.
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let first = net.spawn("prefill", addr(2, 7000), 20, 1);
    let second = net.spawn("prefill", addr(2, 7000), 21, 1);
    let to_first = net.connect(first, addr(1, 7000));
    net.settle();
    let to_second = net.connect(second, addr(1, 7000));
    net.settle();
    let (a, b) = (ready(&to_first), ready(&to_second));
    assert_eq!(net.procs[target].core.passive.len(), 2);
    assert_eq!(net.stats(target).peer_restarts, 0);
    assert_eq!((a.phase(), b.phase()), (Phase::Ready, Phase::Ready));
}

#[test]
fn a_crashed_initiators_queue_pairs_go_after_the_linger_and_a_probe() {
    let (mut net, target, prefill, _) = connected_pair();
    net.crash(prefill);
    net.settle();
    net.advance(Duration::from_millis(1));
    net.advance(policy().passive_linger);
    net.settle();
    assert_eq!(
        net.procs[target].core.passive.len(),
        1,
        "kept while the probe of its listener runs"
    );
    net.advance(policy().connect_timeout);
    assert!(net.procs[target].core.passive.is_empty());
    assert_eq!(net.stats(target).passive_retired, 1);
    assert!(
        net.procs[target].core.peers.is_empty(),
        "nothing of it is left"
    );
}

#[test]
fn a_successor_at_the_initiators_listener_does_not_keep_its_queue_pairs() {
    let (mut net, target, old, _) = connected_pair();
    net.crash(old);
    net.settle();
    net.spawn("prefill", addr(2, 7000), 21, 1); // answers the probe, as someone else
    net.advance(Duration::from_millis(1));
    net.advance(policy().passive_linger);
    net.settle();
    net.advance(policy().connect_timeout);
    assert!(net.procs[target].core.passive.is_empty());
}

#[test]
fn a_live_initiator_whose_connection_dropped_keeps_its_queue_pairs() {
    let (mut net, target, _, view) = connected_pair();
    // The control connection drops (a keepalive, a stall); the data path is fine.
    let conn = *net
        .links
        .keys()
        .find(|(proc, _)| *proc == target)
        .expect("the connection");
    let now = net.now;
    net.procs[target].core.closed(conn.1, "dropped", now);
    net.settle();
    net.advance(Duration::from_millis(1));
    net.advance(policy().passive_linger);
    net.settle();
    net.advance(policy().connect_timeout);
    net.settle();
    assert_eq!(
        net.procs[target].core.passive.len(),
        1,
        "the probe found it alive"
    );
    assert_eq!(net.stats(target).passive_retired, 0);
    assert_eq!(view.phase(), Phase::Ready);
}

/// [`connected_pair`] with liveness on (see [`lively`]).
fn lively_pair() -> (Net, usize, usize, Arc<EndpointView>) {
    let mut net = Net::new();
    let target = net.spawn_with(NAME, addr(1, 7000), 11, 1, lively());
    let initiator = net.spawn_with("prefill", addr(2, 7000), 20, 1, lively());
    let answer = net.connect(initiator, addr(1, 7000));
    net.settle();
    let view = ready(&answer);
    (net, target, initiator, view)
}

/// Keepalives and liveness as by default.
fn lively() -> Policy {
    Policy {
        keepalive_interval: Duration::from_millis(250),
        liveness_timeout: Duration::from_millis(1500),
        ..policy()
    }
}

#[test]
fn live_peers_keep_their_connections_through_quiet_times() {
    let (mut net, _, prefill, view) = lively_pair();
    net.run_for(Duration::from_secs(10), Duration::from_millis(50));
    assert_eq!(view.phase(), Phase::Ready);
    assert_eq!(net.stats(prefill).unreachable_peers, 0);
    assert_eq!(net.stats(1).unreachable_peers, 0);
    assert_eq!(net.links.len(), 2, "one connection, both ends open");
}

#[test]
fn a_stopped_peer_is_unreachable_within_the_liveness_timeout() {
    let (mut net, target, prefill, view) = lively_pair();
    let stopped_at = net.now;
    net.stop(target);
    let mut detected = None;
    while net.now < stopped_at + Duration::from_secs(5) {
        net.advance(Duration::from_millis(10));
        net.settle();
        if view.phase() == Phase::CircuitOpen {
            detected = Some(net.now - stopped_at);
            break;
        }
    }
    let detected = detected.expect("the circuit opened");
    assert!(
        detected <= Duration::from_millis(1510),
        "unreachable after {detected:?}"
    );
    let stats = net.stats(prefill);
    assert_eq!(stats.unreachable_peers, 1);
    assert!((1500..=1510).contains(&stats.max_detection_ms), "{stats:?}");
    assert!(
        net.procs[prefill]
            .commands
            .iter()
            .any(|(_, command)| matches!(
                command,
                Command::Unreachable { endpoint } if *endpoint == view.id
            )),
        "the poller was told to fail its work fast"
    );
    assert!(
        !net.links.keys().any(|(proc, _)| *proc == prefill),
        "the dead connection is closed, never reused"
    );
}

/// Caught: submitters could not tell a half-open circuit from a healthy rail, so a rail
/// whose link was still dead took its share of every batch at each cooldown's end.
#[test]
fn a_half_open_circuit_is_published_until_its_first_success() {
    let (mut net, target, prefill, view) = lively_pair();
    net.stop(target);
    assert!(until_circuit_opens(&mut net, &view, Duration::from_secs(5)).is_some());
    assert!(!view.on_probation(), "open, not half-open");
    net.procs[target].stopped = false;
    // Past the cooldown: a trial queue pair, ready, on probation.
    net.run_for(policy().cooldown_max, Duration::from_millis(50));
    assert_eq!(view.phase(), Phase::Ready);
    assert!(view.on_probation());
    let (now, epoch) = (net.now, view.epoch().expect("connected"));
    net.procs[prefill].core.poller_event(
        0,
        Event::Confirmed {
            endpoint: view.id,
            epoch,
        },
        now,
    );
    net.settle();
    assert!(!view.on_probation(), "its first success closed it for good");
}

/// Steps time by 10 ms until `view`'s circuit opens (bounded); how long it took.
fn until_circuit_opens(net: &mut Net, view: &EndpointView, within: Duration) -> Option<Duration> {
    let started = net.now;
    while net.now < started + within {
        net.advance(Duration::from_millis(10));
        net.settle();
        if view.phase() == Phase::CircuitOpen {
            return Some(net.now - started);
        }
    }
    None
}

#[test]
fn liveness_outlives_the_control_connection_closing_under_a_ready_endpoint() {
    let (mut net, target, _, view) = lively_pair();
    // The target gives up on the connection (say, the initiator stalled past the timeout).
    let accepted = net
        .links
        .keys()
        .find(|(proc, _)| *proc == target)
        .map(|&(_, conn)| conn)
        .expect("the target's side");
    let now = net.now;
    net.procs[target].core.closed(accepted, "stalled", now);
    net.run_for(Duration::from_millis(500), Duration::from_millis(10));
    assert_eq!(net.links.len(), 2, "the initiator dialed again");
    assert_eq!(view.phase(), Phase::Ready);
    // Now the target stops: still noticed.
    net.stop(target);
    let took = until_circuit_opens(&mut net, &view, Duration::from_secs(5));
    assert!(
        took.is_some_and(|took| took <= Duration::from_millis(1510)),
        "{took:?}"
    );
}

#[test]
fn a_lost_lease_does_not_fail_a_peer_that_still_answers() {
    let (mut net, target, prefill, view) = lively_pair();
    net.run_for(Duration::from_millis(300), Duration::from_millis(10));
    // etcd lost its lease, but it answers pings: nothing fails.
    let now = net.now;
    let gone = PeerChange::Gone {
        incarnation: Incarnation(11),
    };
    net.procs[prefill].core.peer_changed(NAME, gone, now);
    net.settle();
    assert_eq!(view.phase(), Phase::Ready, "transfers never depend on etcd");
    // Silent as well: then it fails fast.
    net.stop(target);
    let took = until_circuit_opens(&mut net, &view, Duration::from_secs(3));
    assert!(took.is_some(), "liveness still applies");
}

// ---- the cluster secret -------------------------------------------------------------------

fn secret(byte: u8) -> ClusterSecret {
    ClusterSecret::new(vec![byte; 32]).expect("long enough")
}

impl Net {
    /// Gives process `index` the cluster secret `secret`.
    fn with_secret(&mut self, index: usize, secret: ClusterSecret) {
        self.procs[index].core.me.secret = Some(secret);
    }

    /// Opens a raw connection to process `index` from 10.0.0.9:9999, says `messages` on it
    /// and returns what the process sent in answer.
    fn raw_peer_says(&mut self, index: usize, messages: Vec<Message>) -> Vec<Message> {
        let now = self.now;
        let listen_ip = self.procs[index].addr.ip();
        let core = &mut self.procs[index].core;
        let conn = core.accepted(addr(9, 9999), listen_ip, now);
        for message in messages {
            core.received(conn, message, now);
        }
        let mut sent = Vec::new();
        while let Some(action) = core.next_action() {
            if let Action::Send { message, .. } = action {
                sent.push(message);
            }
        }
        sent
    }

    /// Every message delivered until the network settles, as (to, message).
    fn settle_recording(&mut self) -> Vec<(usize, Message)> {
        let log = std::cell::RefCell::new(Vec::new());
        self.settle_holding(|to, message| {
            log.borrow_mut().push((to, message.clone()));
            false
        });
        log.into_inner()
    }
}

/// A target and an initiator with the given secrets; the initiator connects:
/// (network, target, initiator, answer, what was delivered).
fn pair_with_secrets(
    target_secret: Option<ClusterSecret>,
    initiator_secret: Option<ClusterSecret>,
) -> (Net, usize, usize, Answer, Vec<(usize, Message)>) {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let initiator = net.spawn("prefill", addr(2, 7000), 20, 1);
    if let Some(secret) = target_secret {
        net.with_secret(target, secret);
    }
    if let Some(secret) = initiator_secret {
        net.with_secret(initiator, secret);
    }
    let answer = net.connect(initiator, addr(1, 7000));
    let delivered = net.settle_recording();
    (net, target, initiator, answer, delivered)
}

#[test]
fn members_with_the_same_secret_prove_it_both_ways_and_connect() {
    let (net, target, initiator, answer, delivered) =
        pair_with_secrets(Some(secret(1)), Some(secret(1)));
    ready(&answer);
    let auths: Vec<usize> = delivered
        .iter()
        .filter(|(_, message)| matches!(message, Message::Auth { .. }))
        .map(|&(to, _)| to)
        .collect();
    assert_eq!(auths, vec![target, initiator], "the dialer proves first");
    // Nothing but Hello and Auth reached either side before both proofs.
    let first_other = delivered
        .iter()
        .position(|(_, m)| !matches!(m, Message::Hello { .. } | Message::Auth { .. }))
        .expect("the handshake went on");
    let last_auth = delivered
        .iter()
        .rposition(|(_, m)| matches!(m, Message::Auth { .. }))
        .expect("proofs");
    assert!(last_auth < first_other, "{delivered:?}");
    assert_eq!(net.stats(target).auth_failures, 0);
    assert_eq!(net.stats(target).passive_qps, 1);
}

/// The one set of session keys `proc` was handed, split.
fn session_of(net: &mut Net, proc: usize) -> (FrameSealer, FrameOpener) {
    let mut keys = std::mem::take(&mut net.procs[proc].keys);
    assert_eq!(keys.len(), 1, "one connection, keyed once");
    keys.pop().expect("keys").1.split()
}

#[test]
fn both_sides_key_the_session_alike_and_encrypt_when_either_asks() {
    for (target_encrypts, initiator_encrypts) in [(false, false), (true, false), (false, true)] {
        let mut net = Net::new();
        let target = net.spawn(NAME, addr(1, 7000), 11, 1);
        let initiator = net.spawn("prefill", addr(2, 7000), 20, 1);
        net.with_secret(target, secret(1));
        net.with_secret(initiator, secret(1));
        net.procs[target].core.me.encrypt_control = target_encrypts;
        net.procs[initiator].core.me.encrypt_control = initiator_encrypts;
        let answer = net.connect(initiator, addr(1, 7000));
        net.settle();
        ready(&answer);
        let (mut target_seals, mut target_opens) = session_of(&mut net, target);
        let (mut initiator_seals, mut initiator_opens) = session_of(&mut net, initiator);
        let frame = Message::Notify {
            target: Incarnation(11),
            bytes: b"rkey 0x1234".to_vec(),
        }
        .encode();
        for (seals, opens) in [
            (&mut initiator_seals, &mut target_opens),
            (&mut target_seals, &mut initiator_opens),
        ] {
            let mut sealed = frame.clone();
            seals.seal(&mut sealed);
            let in_clear = sealed.windows(11).any(|w| w == b"rkey 0x1234");
            assert_eq!(
                in_clear,
                !(target_encrypts || initiator_encrypts),
                "{target_encrypts} {initiator_encrypts}"
            );
            let (header, rest) = sealed.split_at_mut(HEADER_LEN);
            let (body, tag) = rest.split_at_mut(rest.len() - TAG_LEN);
            let header: &[u8; HEADER_LEN] = (&*header).try_into().expect("a header");
            opens
                .open(header, body, (&*tag).try_into().expect("a tag"))
                .expect("the other side opens it");
            assert_eq!(&*body, &frame[HEADER_LEN..]);
        }
    }
}

#[test]
fn a_peer_with_another_secret_or_none_gets_nothing_and_is_counted() {
    for initiator_secret in [Some(secret(2)), None] {
        let (net, target, initiator, answer, delivered) =
            pair_with_secrets(Some(secret(1)), initiator_secret.clone());
        assert!(
            !matches!(answer.try_recv(), Ok(Ok(_))),
            "no endpoint for {initiator_secret:?}"
        );
        let answered = delivered.iter().any(|(to, message)| {
            *to == initiator
                && matches!(
                    message,
                    Message::Descriptor(_) | Message::ConnectQpReply { .. }
                )
        });
        assert!(
            !answered,
            "the target answered before a proof: {delivered:?}"
        );
        assert_eq!(net.stats(target).auth_failures, 1, "{initiator_secret:?}");
        assert_eq!(net.stats(target).passive_qps, 0);
        assert_eq!(net.stats(target).warnings[WarningKind::Auth.index()], 1);
    }
}

#[test]
fn a_listener_without_the_secret_is_not_taken_for_a_member() {
    let (net, target, initiator, answer, delivered) = pair_with_secrets(None, Some(secret(1)));
    assert!(!matches!(answer.try_recv(), Ok(Ok(_))));
    // The initiator sent nothing but its Hello and its proof: no GetDescriptor, no ConnectQp.
    let sent: Vec<&Message> = delivered
        .iter()
        .filter(|(to, _)| *to == target)
        .map(|(_, message)| message)
        .collect();
    assert!(
        sent.iter()
            .all(|m| matches!(m, Message::Hello { .. } | Message::Auth { .. })),
        "{sent:?}"
    );
    assert_eq!(net.stats(initiator).active_qps, 0);
}

#[test]
fn a_recorded_handshake_replayed_on_another_connection_fails() {
    let (mut net, target, initiator, answer, delivered) =
        pair_with_secrets(Some(secret(1)), Some(secret(1)));
    ready(&answer);
    let recorded: Vec<Message> = delivered
        .iter()
        .filter(|(to, m)| {
            *to == target && matches!(m, Message::Hello { .. } | Message::Auth { .. })
        })
        .map(|(_, m)| m.clone())
        .collect();
    assert_eq!(recorded.len(), 2, "the initiator's Hello and proof");
    net.raw_peer_says(target, recorded);
    net.pump();
    assert_eq!(net.stats(target).auth_failures, 1);
    assert_eq!(net.stats(initiator).auth_failures, 0);
}

#[test]
fn messages_before_the_proof_are_refused_not_answered() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    net.with_secret(target, secret(1));
    let sent = net.raw_peer_says(target, vec![hello_from("raw", 99), Message::GetDescriptor]);
    assert!(
        sent.iter().all(|m| matches!(m, Message::Hello { .. })),
        "only the target's Hello went out: {sent:?}"
    );
    assert_eq!(net.stats(target).auth_failures, 1);
}

/// What `core` wants done now: the connections it dials, and the messages it sends.
fn actions_of(core: &mut Core<FakeFabric>) -> (Vec<ConnId>, Vec<(ConnId, Message)>) {
    let (mut dials, mut sends) = (Vec::new(), Vec::new());
    while let Some(action) = core.next_action() {
        match action {
            Action::Dial { conn, .. } => dials.push(conn),
            Action::Send { conn, message } => sends.push((conn, message)),
            _ => {}
        }
    }
    (dials, sends)
}

#[test]
fn a_proof_signed_for_an_impostor_opens_no_member_not_even_the_signer() {
    // Member L (20) dials an impostor at 10.0.0.5:5000; the impostor relays between L and
    // member M (11), and back to L itself.
    let mut net = Net::new();
    let member_m = net.spawn(NAME, addr(1, 7000), 11, 1);
    let member_l = net.spawn("prefill", addr(2, 7000), 20, 1);
    net.with_secret(member_m, secret(1));
    net.with_secret(member_l, secret(1));
    let now = net.now;
    let (reply, _answer) = mpsc::channel();
    net.procs[member_l]
        .core
        .connect(addr(5, 5000), 0, 0, reply, now);
    let (dials, sends) = actions_of(&mut net.procs[member_l].core);
    let to_impostor = dials[0];
    let l_hello = sends[0].1.clone();
    assert!(matches!(l_hello, Message::Hello { .. }));

    for victim in [member_m, member_l] {
        // The impostor says L's Hello to the victim, and gets the victim's Hello back.
        let victim_ip = net.procs[victim].addr.ip();
        let core = &mut net.procs[victim].core;
        let relayed = core.accepted(addr(5, 5001), victim_ip, now);
        core.received(relayed, l_hello.clone(), now);
        let victim_hello = actions_of(core)
            .1
            .into_iter()
            .map(|(_, m)| m)
            .find(|m| matches!(m, Message::Hello { .. }));
        let Some(victim_hello) = victim_hello else {
            // The victim refused L's own Hello at once (it is L).
            assert_eq!(victim, member_l);
            assert_eq!(net.stats(member_l).auth_failures, 1);
            continue;
        };
        // ... and hands it to L as its own: L signs a proof for the impostor's address.
        let l_core = &mut net.procs[member_l].core;
        l_core.dialed(to_impostor, addr(2, 7000).ip());
        l_core.received(to_impostor, victim_hello, now);
        let proof = actions_of(l_core)
            .1
            .into_iter()
            .find_map(|(_, m)| match m {
                Message::Auth { mac } => Some(mac),
                _ => None,
            })
            .expect("L proves itself to whoever it dialed");
        let core = &mut net.procs[victim].core;
        core.received(relayed, Message::Auth { mac: proof }, now);
        let answered = actions_of(core).1;
        assert!(answered.is_empty(), "the victim answered: {answered:?}");
        assert_eq!(net.stats(victim).auth_failures, 1, "the relay failed");
        assert_eq!(net.stats(victim).passive_qps, 0);
    }
}

#[test]
fn a_peer_that_says_hello_and_nothing_more_is_closed_at_the_connect_timeout() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    net.with_secret(target, secret(1));
    net.raw_peer_says(target, vec![hello_from("raw", 99)]);
    net.advance(Duration::from_millis(100));
    assert_eq!(net.stats(target).auth_failures, 0, "it may still prove it");
    net.advance(policy().connect_timeout);
    assert_eq!(net.stats(target).auth_failures, 1);
    assert!(net.procs[target].core.conns.is_empty(), "closed");
}

#[test]
fn without_a_secret_the_descriptor_is_asked_for_with_the_hello() {
    let mut net = Net::new();
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let now = net.now;
    let (reply, _answer) = mpsc::channel();
    net.procs[prefill]
        .core
        .connect(addr(1, 7000), 0, 0, reply, now);
    let (_, sends) = actions_of(&mut net.procs[prefill].core);
    assert!(
        sends
            .iter()
            .any(|(_, m)| matches!(m, Message::GetDescriptor)),
        "pipelined, no round trip more than before: {sends:?}"
    );
}

#[test]
fn a_flood_of_hellos_without_proofs_does_not_keep_a_member_out() {
    let mut net = Net::new();
    let capped = Policy {
        max_handshakes: 4,
        ..policy()
    };
    let target = net.spawn_with(NAME, addr(1, 7000), 11, 1, capped);
    let member = net.spawn("prefill", addr(2, 7000), 20, 1);
    net.with_secret(target, secret(1));
    net.with_secret(member, secret(1));
    for n in 0..8 {
        net.raw_peer_says(target, vec![hello_from("flood", 100 + n)]);
    }
    net.advance(policy().connect_timeout / 2);
    let answer = net.connect(member, addr(1, 7000));
    net.settle();
    ready(&answer);
    let unproven = net.procs[target]
        .core
        .conns
        .values()
        .filter(|conn| conn.peer.is_none())
        .count();
    assert_eq!(
        unproven, 7,
        "the oldest of the flood made room for the member"
    );
}

mod unproven_peers {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::{MAC_LEN, WireKey};

    /// One message a peer that does not hold the secret might send.
    fn message() -> impl Strategy<Value = Message> {
        let key = (any::<u64>(), any::<u64>()).prop_map(|(initiator, target)| WireKey {
            initiator: Incarnation(initiator),
            target: Incarnation(target),
            initiator_rail: 0,
            target_rail: 0,
        });
        prop_oneof![
            (any::<u64>(), any::<[u8; NONCE_LEN]>()).prop_map(|(incarnation, nonce)| {
                Message::Hello {
                    name: "intruder".into(),
                    incarnation: Incarnation(incarnation),
                    host: HostId::default(),
                    listen: String::new(),
                    nonce,
                    encrypt: false,
                }
            }),
            any::<[u8; MAC_LEN]>().prop_map(|mac| Message::Auth { mac }),
            Just(Message::GetDescriptor),
            (key.clone(), any::<u64>()).prop_map(|(key, epoch)| Message::ConnectQp {
                key,
                epoch,
                handshake: 1,
                side: qp_side(7),
            }),
            (key, any::<u32>()).prop_map(|(key, qp_num)| Message::RetireQp {
                key,
                epoch: 1,
                qp_num,
            }),
            any::<u64>().prop_map(|target| Message::Notify {
                target: Incarnation(target),
                bytes: vec![1, 2, 3],
            }),
            any::<u64>().prop_map(|nonce| Message::Ping { nonce }),
        ]
    }

    proptest! {
        /// Whatever a peer without the secret sends, in whatever order, the target answers
        /// with nothing but its own Hello and makes no queue pair.
        #[test]
        fn a_peer_without_the_secret_hears_nothing_but_hello(
            said in prop::collection::vec(message(), 1..12)
        ) {
            let mut net = Net::new();
            let target = net.spawn(NAME, addr(1, 7000), 11, 1);
            net.with_secret(target, secret(1));
            let sent = net.raw_peer_says(target, said);
            prop_assert!(
                sent.iter().all(|m| matches!(m, Message::Hello { .. })),
                "{:?}", sent
            );
            prop_assert_eq!(net.stats(target).passive_qps, 0);
            prop_assert_eq!(net.stats(target).notifications_received, 0);
        }
    }
}

// ---- connections, goodbyes, connects and endpoint ids ------------------------------------

/// Everything `core` wants done now.
fn drain_actions<F: RailFabric>(core: &mut Core<F>) -> Vec<Action> {
    std::iter::from_fn(|| core.next_action()).collect()
}

/// The connections `actions` close.
fn closes(actions: &[Action]) -> Vec<ConnId> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Close { conn } => Some(*conn),
            _ => None,
        })
        .collect()
}

/// The connections `actions` say goodbye on, in order.
fn byes(actions: &[Action]) -> Vec<ConnId> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Send {
                conn,
                message: Message::Bye,
            } => Some(*conn),
            _ => None,
        })
        .collect()
}

/// The addresses `actions` dial.
fn dials(actions: &[Action]) -> Vec<SocketAddr> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Dial { addr, .. } => Some(*addr),
            _ => None,
        })
        .collect()
}

/// Process `index`'s end of its connection to process `other`.
fn conn_between(net: &Net, index: usize, other: usize) -> ConnId {
    net.links
        .iter()
        .find(|((proc, _), (peer, _))| *proc == index && *peer == other)
        .map(|(&(_, conn), _)| conn)
        .expect("a connection between them")
}

/// A ConnectQp from incarnation `initiator` to incarnation 11, rails 0 → 0, for its queue
/// pair `qp_num` at `epoch`.
fn connect_qp_from(initiator: u64, qp_num: u32, epoch: u64, handshake: u64) -> Message {
    Message::ConnectQp {
        key: WireKey {
            initiator: Incarnation(initiator),
            target: Incarnation(11),
            initiator_rail: 0,
            target_rail: 0,
        },
        epoch,
        handshake,
        side: qp_side(qp_num),
    }
}

/// [`policy`] with at most `cap` accepted connections before their Hello.
fn handshake_cap(cap: usize) -> Policy {
    Policy {
        max_handshakes: cap,
        ..policy()
    }
}

#[test]
fn a_peer_is_admitted_at_its_hello_or_with_a_secret_once_both_proofs_are_in() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let core = &mut net.procs[target].core;
    let conn = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    assert!(!core.admitted(conn), "not before its Hello");
    core.received(conn, hello_from("x", 5), now);
    assert!(core.admitted(conn), "no secret: at its Hello");
    core.received(conn, Message::Bye, now);
    assert!(!core.admitted(conn), "gone with its connection");

    let (mut net, target, initiator, answer, _) =
        pair_with_secrets(Some(secret(1)), Some(secret(1)));
    ready(&answer);
    let (to_initiator, to_target) = (
        conn_between(&net, target, initiator),
        conn_between(&net, initiator, target),
    );
    assert!(net.procs[target].core.admitted(to_initiator));
    assert!(net.procs[initiator].core.admitted(to_target));
    let now = net.now;
    let core = &mut net.procs[target].core;
    let raw = core.accepted(addr(9, 9999), addr(1, 7000).ip(), now);
    core.received(raw, hello_from("raw", 99), now);
    assert!(!core.admitted(raw), "said Hello, proved nothing");
}

#[test]
fn peers_must_prove_the_secret_exactly_when_the_cluster_has_one() {
    let mut net = Net::new();
    let open = net.spawn(NAME, addr(1, 7000), 11, 1);
    let closed = net.spawn(NAME, addr(1, 7001), 12, 1);
    net.with_secret(closed, secret(1));
    assert!(!net.procs[open].core.proof_required());
    assert!(net.procs[closed].core.proof_required());
}

#[test]
fn the_listener_pauses_at_the_handshake_cap_until_a_silent_connection_may_be_evicted() {
    let mut net = Net::new();
    let target = net.spawn_with(NAME, addr(1, 7000), 11, 1, handshake_cap(4));
    let now = net.now;
    let core = &mut net.procs[target].core;
    for port in 5000..5004 {
        assert!(core.may_accept(now), "room below the cap");
        core.accepted(addr(3, port), addr(1, 7000).ip(), now);
    }
    assert!(
        !core.may_accept(now),
        "4 silent, none past its eviction grace"
    );
    assert!(
        core.may_accept(now + EVICTABLE_AFTER),
        "the oldest may now make room"
    );
}

#[test]
fn a_silent_connection_is_evicted_only_past_the_handshake_cap() {
    let mut net = Net::new();
    let target = net.spawn_with(NAME, addr(1, 7000), 11, 1, handshake_cap(4));
    let now = net.now;
    let later = now + EVICTABLE_AFTER;
    let core = &mut net.procs[target].core;
    let oldest = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    core.accepted(addr(3, 5001), addr(1, 7000).ip(), now);
    core.accepted(addr(3, 5002), addr(1, 7000).ip(), now);
    // The fourth fills the cap: no one goes.
    core.accepted(addr(3, 5003), addr(1, 7000).ip(), later);
    assert_eq!(closes(&drain_actions(core)), vec![]);
    // The fifth is one past it: the oldest goes.
    core.accepted(addr(3, 5004), addr(1, 7000).ip(), later);
    assert_eq!(closes(&drain_actions(core)), vec![oldest]);
    assert_eq!(net.stats(target).connections_closed, 1);
}

#[test]
fn peers_that_said_hello_are_never_evicted_for_silent_newcomers() {
    let mut net = Net::new();
    let target = net.spawn_with(NAME, addr(1, 7000), 11, 1, handshake_cap(2));
    let now = net.now;
    let core = &mut net.procs[target].core;
    for n in 0..3 {
        let conn = core.accepted(addr(3, 5000 + n), addr(1, 7000).ip(), now);
        core.received(conn, hello_from("member", 100 + u64::from(n)), now);
    }
    core.accepted(addr(3, 6000), addr(1, 7000).ip(), now + EVICTABLE_AFTER);
    let actions = drain_actions(core);
    assert_eq!(closes(&actions), vec![], "{actions:?}");
    assert_eq!(net.stats(target).connections_closed, 0);
}

#[test]
fn a_refused_dial_fails_only_the_connects_waiting_on_it_and_blames_no_secret() {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let live = net.connect(prefill, addr(1, 7000));
    let nobody = net.connect(prefill, addr(1, 7999));
    net.pump(); // no one listens at :7999: refused at once
    match nobody.try_recv() {
        Ok(Err(ControlError::Unreachable { addr: at, reason })) => {
            assert_eq!(at, addr(1, 7999));
            assert_eq!(reason, "refused", "no secret is involved");
        }
        other => panic!("not failed at once: {other:?}"),
    }
    assert!(
        matches!(live.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "the other connect still waits"
    );
    net.settle();
    ready(&live);
}

#[test]
fn a_peer_that_leaves_is_forgotten_while_others_stay_connected() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let core = &mut net.procs[target].core;
    let leaving = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    let staying = core.accepted(addr(3, 5001), addr(1, 7000).ip(), now);
    core.received(leaving, hello_from("leaving", 5), now);
    core.received(staying, hello_from("staying", 6), now);
    core.received(leaving, Message::Bye, now);
    let known: Vec<Incarnation> = core.peers.keys().copied().collect();
    assert_eq!(known, vec![Incarnation(6)]);
}

#[test]
fn forgetting_a_passer_by_does_not_hide_the_restart_of_a_dialed_peer() {
    let (mut net, target, prefill, view) = connected_pair();
    // Someone connects to the initiator, says Hello and leaves: it is forgotten.
    let now = net.now;
    let core = &mut net.procs[prefill].core;
    let passer_by = core.accepted(addr(3, 5000), addr(2, 7000).ip(), now);
    core.received(passer_by, hello_from("passer-by", 30), now);
    core.received(passer_by, Message::Bye, now);
    net.settle();
    // The target restarts at its address: still a restart.
    net.crash(target);
    net.settle();
    net.spawn(NAME, addr(1, 7000), 13, 1);
    let again = net.connect(prefill, addr(1, 7000));
    net.settle();
    assert_eq!(view.phase(), Phase::Retired);
    assert_eq!(net.stats(prefill).peer_restarts, 1);
    assert_eq!(ready(&again).key.peer, Incarnation(13));
}

#[test]
fn without_a_secret_goodbye_goes_to_every_connection_even_before_hello() {
    let (mut net, target, prefill, _) = connected_pair();
    let member = conn_between(&net, target, prefill);
    let now = net.now;
    let core = &mut net.procs[target].core;
    let silent = core.accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    drain_actions(core);
    core.say_goodbye();
    let mut said = byes(&drain_actions(core));
    said.sort();
    assert_eq!(said, vec![member, silent]);
}

#[test]
fn with_a_secret_goodbye_goes_only_to_members_that_proved_it() {
    let (mut net, target, initiator, answer, _) =
        pair_with_secrets(Some(secret(1)), Some(secret(1)));
    ready(&answer);
    let member = conn_between(&net, target, initiator);
    net.raw_peer_says(target, vec![hello_from("raw", 99)]);
    let core = &mut net.procs[target].core;
    core.say_goodbye();
    assert_eq!(byes(&drain_actions(core)), vec![member]);
}

#[test]
fn a_members_goodbye_closes_its_connection_without_counting_an_auth_failure() {
    let (mut net, target, initiator, answer, _) =
        pair_with_secrets(Some(secret(1)), Some(secret(1)));
    ready(&answer);
    net.procs[initiator].core.say_goodbye();
    net.settle();
    assert!(net.procs[target].core.conns.is_empty(), "closed");
    assert_eq!(net.stats(target).auth_failures, 0);
    assert_eq!(net.stats(target).warnings[WarningKind::Auth.index()], 0);
}

#[test]
fn a_goodbye_before_the_proof_counts_as_an_auth_failure() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    net.with_secret(target, secret(1));
    net.raw_peer_says(target, vec![hello_from("raw", 99), Message::Bye]);
    assert_eq!(net.stats(target).auth_failures, 1);
    assert!(net.procs[target].core.conns.is_empty(), "closed");
}

/// A process with a cluster secret that dialed 10.0.0.1:7000, unanswered so far, with
/// `held` messages waiting on that connection for the proof (its GetDescriptor, then
/// notifications): (network, process, connection).
fn dialer_holding(held: usize) -> (Net, usize, ConnId) {
    let mut net = Net::new();
    let dialer = net.spawn("prefill", addr(2, 7000), 20, 1);
    net.with_secret(dialer, secret(1));
    let now = net.now;
    let core = &mut net.procs[dialer].core;
    for _ in 1..held {
        core.notify(addr(1, 7000), Incarnation(11), vec![1], now);
    }
    let (dialed, _) = actions_of(core);
    assert_eq!(dialed.len(), 1);
    (net, dialer, dialed[0])
}

#[test]
fn a_connection_holds_max_held_messages_for_the_proof_and_closes_one_past() {
    let (mut net, dialer, conn) = dialer_holding(MAX_HELD);
    net.advance(Duration::from_millis(1));
    let closed = closes(&drain_actions(&mut net.procs[dialer].core));
    assert_eq!(closed, vec![], "exactly at the bound: kept");
    let now = net.now;
    net.procs[dialer]
        .core
        .notify(addr(1, 7000), Incarnation(11), vec![1], now);
    net.advance(Duration::from_millis(1));
    let closed = closes(&drain_actions(&mut net.procs[dialer].core));
    assert_eq!(closed, vec![conn], "one past it: closed at the tick");
    let stats = net.stats(dialer);
    assert_eq!(
        (stats.connections_closed, stats.auth_failures),
        (1, 0),
        "an overflow, not a failed proof"
    );
}

#[test]
fn a_proof_that_never_comes_is_an_auth_failure_even_with_max_held_messages_waiting() {
    let (mut net, dialer, conn) = dialer_holding(MAX_HELD);
    // The listener says Hello, the dialer proves itself; no proof comes back.
    let now = net.now;
    net.procs[dialer]
        .core
        .received(conn, hello_from(NAME, 11), now);
    net.advance(policy().connect_timeout);
    let closed = closes(&drain_actions(&mut net.procs[dialer].core));
    assert_eq!(closed, vec![conn]);
    let stats = net.stats(dialer);
    assert_eq!((stats.auth_failures, stats.connections_closed), (1, 0));
}

#[test]
fn a_listener_behind_address_translation_accepts_a_proof_for_its_announced_address() {
    // The dialer dials the announced 10.0.0.1:7000; on the listener's side the connection
    // arrives at a translated local address.
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    net.with_secret(target, secret(1));
    net.with_secret(prefill, secret(1));
    let (reply, answer) = mpsc::channel();
    let now = net.now;
    net.procs[prefill]
        .core
        .connect(addr(1, 7000), 0, 0, reply, now);
    let Some(Action::Dial { conn, .. }) = net.procs[prefill].core.next_action() else {
        panic!("the dial goes first");
    };
    let translated = IpAddr::V4(Ipv4Addr::new(192, 168, 7, 1));
    let accepted = net.procs[target]
        .core
        .accepted(addr(2, 40_001), translated, now);
    net.links.insert((prefill, conn), (target, accepted));
    net.links.insert((target, accepted), (prefill, conn));
    net.procs[prefill].core.dialed(conn, addr(2, 7000).ip());
    net.settle();
    ready(&answer);
    assert_eq!(net.stats(target).auth_failures, 0);
    assert_eq!(net.stats(prefill).auth_failures, 0);
}

#[test]
fn a_connect_is_answered_only_once_the_peers_descriptor_is_in() {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle_holding(|to, message| to == prefill && matches!(message, Message::Descriptor(_)));
    assert!(
        matches!(answer.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "its Hello is in, its descriptor is not"
    );
    net.release(0);
    net.settle();
    let view = ready(&answer);
    assert_eq!(
        view.descriptor().map(|d| d.incarnation),
        Some(Incarnation(11))
    );
}

#[test]
fn a_connect_whose_descriptor_never_comes_fails_at_the_connect_timeout() {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle_holding(|to, message| to == prefill && matches!(message, Message::Descriptor(_)));
    net.advance(policy().connect_timeout - Duration::from_millis(1));
    assert!(
        matches!(answer.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "still within the connect timeout"
    );
    net.advance(Duration::from_millis(1));
    match answer.try_recv() {
        Ok(Err(ControlError::Unreachable { addr: at, reason })) => {
            assert_eq!(at, addr(1, 7000));
            assert_eq!(reason, "no handshake within the connect timeout");
        }
        other => panic!("not failed at the connect timeout: {other:?}"),
    }
}

#[test]
fn a_silent_connection_is_closed_only_once_the_connect_timeout_has_passed() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let now = net.now;
    let conn = net.procs[target]
        .core
        .accepted(addr(3, 5000), addr(1, 7000).ip(), now);
    net.advance(policy().connect_timeout);
    let closed = closes(&drain_actions(&mut net.procs[target].core));
    assert_eq!(closed, vec![], "not at the timeout itself");
    net.advance(Duration::from_millis(1));
    let closed = closes(&drain_actions(&mut net.procs[target].core));
    assert_eq!(closed, vec![conn]);
}

#[test]
fn a_lost_lease_fails_only_that_peers_endpoints() {
    let mut net = Net::new();
    let lost = net.spawn(NAME, addr(1, 7000), 11, 1);
    net.spawn("other", addr(1, 7001), 12, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let to_lost = net.connect(prefill, addr(1, 7000));
    let to_other = net.connect(prefill, addr(1, 7001));
    net.settle();
    let (gone, other) = (ready(&to_lost), ready(&to_other));
    // Its control connection is gone too: nothing says it is alive.
    let conn = conn_between(&net, prefill, lost);
    let now = net.now;
    net.procs[prefill].core.closed(conn, "reset", now);
    net.settle();
    let incarnation = Incarnation(11);
    net.directory_says(prefill, PeerChange::Gone { incarnation });
    assert_eq!(gone.phase(), Phase::CircuitOpen);
    assert_eq!(other.phase(), Phase::Ready, "another peer's endpoint");
}

#[test]
fn a_connect_to_a_known_peer_gets_its_endpoint_until_it_retires() {
    let (mut net, _, prefill, view) = connected_pair();
    let again = net.connect(prefill, addr(1, 7000));
    net.settle();
    assert!(Arc::ptr_eq(&ready(&again), &view), "the same endpoint");
    // Retired: a fresh endpoint takes its place, and stays the peer's endpoint once the
    // retired one drains.
    let now = net.now;
    net.procs[prefill].core.retire(0, view.id, now);
    net.settle();
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle();
    let fresh = ready(&answer);
    assert_ne!(fresh.id, view.id);
    let now = net.now;
    let drained = Event::EndpointDrained { endpoint: view.id };
    net.procs[prefill].core.poller_event(0, drained, now);
    let later = net.connect(prefill, addr(1, 7000));
    net.settle();
    assert!(Arc::ptr_eq(&ready(&later), &fresh), "not a second one");
}

#[test]
fn a_drained_endpoints_id_is_reused_with_its_epochs_continuing() {
    let (mut net, _, prefill, view) = connected_pair();
    let drained = || Event::EndpointDrained { endpoint: view.id };
    let now = net.now;
    // Reported drained while live: nothing changes.
    net.procs[prefill].core.poller_event(0, drained(), now);
    let slot = net.procs[prefill].shared.view(0, view.id);
    assert!(slot.is_some_and(|slot| Arc::ptr_eq(&slot, &view)));
    net.procs[prefill].core.retire(0, view.id, now);
    net.settle();
    net.procs[prefill].core.poller_event(0, drained(), now);
    assert!(
        net.procs[prefill].shared.view(0, view.id).is_none(),
        "its slot is free"
    );
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle();
    let fresh = ready(&answer);
    assert_eq!(fresh.id, view.id, "the id is reused");
    assert_eq!(fresh.epoch(), Some(Epoch::new(2)), "its epochs continue");
}

#[test]
fn a_freed_endpoint_id_is_reused_only_on_its_own_rail() {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 2);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 2);
    let connect = |net: &mut Net, local_rail: u16, remote_rail: u16| {
        let (reply, answer) = mpsc::channel();
        let now = net.now;
        net.procs[prefill]
            .core
            .connect(addr(1, 7000), local_rail, remote_rail, reply, now);
        net.settle();
        ready(&answer)
    };
    let on_rail_0 = connect(&mut net, 0, 0);
    let on_rail_1 = connect(&mut net, 1, 1);
    assert_eq!((on_rail_0.id, on_rail_1.id), (EndpointId(0), EndpointId(0)));
    // Rail 1's endpoint retires and drains: its id is free on rail 1.
    let now = net.now;
    net.procs[prefill].core.retire(1, on_rail_1.id, now);
    let drained = Event::EndpointDrained {
        endpoint: on_rail_1.id,
    };
    net.procs[prefill].core.poller_event(1, drained, now);
    net.settle();
    // A new endpoint on rail 0 never takes the slot of the live one there.
    let another = connect(&mut net, 0, 1);
    assert_ne!(another.id, on_rail_0.id);
    let slot = net.procs[prefill].shared.view(0, on_rail_0.id);
    assert!(slot.is_some_and(|slot| Arc::ptr_eq(&slot, &on_rail_0)));
}

#[test]
fn a_fatal_or_unadoptable_queue_pair_is_announced_retired_and_replaced() {
    type Failure = fn(EndpointId, Epoch) -> Event;
    let failures: [Failure; 2] = [
        |endpoint, epoch| Event::QpFatal { endpoint, epoch },
        |endpoint, epoch| Event::ConnectFailed {
            endpoint,
            epoch,
            reason: "the poller cannot adopt it".into(),
        },
    ];
    for failure in failures {
        let (mut net, target, prefill, view) = connected_pair();
        let (now, epoch) = (net.now, view.epoch().expect("connected"));
        let event = failure(view.id, epoch);
        net.procs[prefill].core.poller_event(0, event, now);
        net.settle();
        assert_eq!(
            net.stats(target).passive_retired,
            1,
            "the target dropped its side"
        );
        net.advance(Duration::from_millis(50)); // past the backoff
        net.settle();
        assert_eq!(view.phase(), Phase::Ready);
        assert_eq!(view.epoch(), Some(epoch.next()));
        assert_eq!(net.stats(prefill).reconnects, 1);
    }
}

#[test]
fn a_probe_answered_within_the_connect_timeout_keeps_the_initiators_queue_pairs() {
    let (mut net, target, prefill, _) = connected_pair();
    // The initiator stalls, and its control connection drops.
    net.stop(prefill);
    let conn = conn_between(&net, target, prefill);
    let now = net.now;
    net.procs[target].core.closed(conn, "dropped", now);
    net.settle();
    net.advance(Duration::from_millis(1));
    net.advance(policy().passive_linger);
    // The target probes its listener; the answer is slow to come.
    net.settle_holding(|to, message| to == prefill && matches!(message, Message::Hello { .. }));
    assert_eq!(net.held.len(), 1, "the probe's Hello");
    net.advance(policy().connect_timeout / 2);
    assert_eq!(
        net.procs[target].core.passive.len(),
        1,
        "kept while the probe runs"
    );
    // It answers in time.
    net.procs[prefill].stopped = false;
    net.release(0);
    net.settle();
    net.advance(policy().connect_timeout);
    net.settle();
    assert_eq!(net.procs[target].core.passive.len(), 1);
    assert_eq!(net.stats(target).passive_retired, 0);
}

#[test]
fn a_loopback_listener_is_probed_only_for_an_initiator_on_loopback() {
    let loopback: SocketAddr = "127.0.0.1:7000".parse().expect("an address");
    let local: SocketAddr = "127.0.0.1:40001".parse().expect("an address");
    // (where it connected from, to which local address, what the target probes)
    let cases = [
        (addr(2, 40_001), addr(1, 7000).ip(), None),
        (local, loopback.ip(), Some(loopback)),
    ];
    for (source, local_ip, probe) in cases {
        let mut net = Net::new();
        let target = net.spawn(NAME, addr(1, 7000), 11, 1);
        let now = net.now;
        let core = &mut net.procs[target].core;
        let conn = core.accepted(source, local_ip, now);
        let hello = Message::Hello {
            name: "prefill".into(),
            incarnation: Incarnation(20),
            host: HostId::default(),
            listen: loopback.to_string(),
            nonce: [0; NONCE_LEN],
            encrypt: false,
        };
        core.received(conn, hello, now);
        core.received(conn, connect_qp_from(20, 1, 1, 1), now);
        core.closed(conn, "reset", now);
        drain_actions(core);
        net.advance(Duration::from_millis(1));
        net.advance(policy().passive_linger);
        let probed = dials(&drain_actions(&mut net.procs[target].core));
        assert_eq!(probed, Vec::from_iter(probe), "from {source}");
        let revoked = if probe.is_some() { 0 } else { 1 };
        assert_eq!(net.stats(target).passive_retired, revoked, "from {source}");
        // Taking a gone initiator's queue pairs down is not the application's fence: were it
        // to come back, its work would be retried, not failed `Revoked`.
        assert_eq!(
            net.procs[target].core.fences.get(&Incarnation(20)),
            None,
            "from {source}"
        );
    }
}

// ---- the fabric's view of the core ---------------------------------------------------------

/// What a [`ScriptedFabric`] saw, and what it is told to hand out.
#[derive(Default)]
struct Script {
    /// The link each queue pair was created for, in order.
    links: Vec<PeerLink>,
    /// What the next take of immediates finds on a target queue pair.
    immediates: Vec<u32>,
}

/// The fake fabric, recording each queue pair's link and handing out scripted immediates.
#[derive(Clone)]
struct ScriptedFabric {
    fake: FakeFabric,
    script: Arc<Mutex<Script>>,
}

impl ScriptedFabric {
    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl RailFabric for ScriptedFabric {
    type Qp = u32;
    type Connected = (u32, u32);

    fn create_qp(&self, link: &PeerLink) -> Result<(u32, QpSide), String> {
        self.script().links.push(*link);
        self.fake.create_qp(link)
    }

    fn create_target_qp(
        &self,
        link: &PeerLink,
        initiator: &QpSide,
    ) -> Result<(u32, QpSide), String> {
        self.script().links.push(*link);
        self.fake.create_target_qp(link, initiator)
    }

    fn take_immediates(&self, _qp: &mut (u32, u32), out: &mut Vec<u32>) -> Result<(), String> {
        out.append(&mut self.script().immediates);
        Ok(())
    }

    fn connect_qp(&self, qp: u32, remote: &QpSide) -> Result<(u32, u32), String> {
        self.fake.connect_qp(qp, remote)
    }

    fn stage(&self, endpoint: EndpointId, epoch: Epoch, qp: (u32, u32)) -> Result<(), String> {
        self.fake.stage(endpoint, epoch, qp)
    }

    fn revoke(&self, qp: (u32, u32)) -> Revocation {
        self.fake.revoke(qp)
    }

    fn describe(&self) -> RailDescriptor {
        self.fake.describe()
    }
}

/// A one-rail core named `name` over a [`ScriptedFabric`], driven by hand: (core, its shared
/// state, the fabric's script).
fn scripted_core(
    name: &str,
    incarnation: u64,
    local_addr: SocketAddr,
) -> (Core<ScriptedFabric>, Arc<ControlShared>, Arc<Mutex<Script>>) {
    let script = Arc::new(Mutex::new(Script::default()));
    let fabric = ScriptedFabric {
        fake: FakeFabric {
            registry: Arc::default(),
            owner: Incarnation(incarnation),
        },
        script: script.clone(),
    };
    let shared = ControlShared::new(1);
    let me = Identity {
        name: name.into(),
        incarnation: Incarnation(incarnation),
        local_addr,
        host: HostId::default(),
        secret: None,
        encrypt_control: false,
    };
    let core = Core::new(me, policy(), incarnation, vec![fabric], shared.clone());
    (core, shared, script)
}

#[test]
fn a_queue_pair_is_created_for_the_local_address_its_dialed_connection_uses() {
    // A host with several addresses: the route to the peer leaves from 192.168.7.2, not
    // from the address its handshake listener announces.
    let (mut core, _, script) = scripted_core("prefill", 20, addr(2, 7000));
    let (reply, answer) = mpsc::channel();
    let now = Instant::now();
    core.connect(addr(1, 7000), 0, 0, reply, now);
    let conn = drain_actions(&mut core)
        .into_iter()
        .find_map(|action| match action {
            Action::Dial { conn, .. } => Some(conn),
            _ => None,
        })
        .expect("a dial");
    let route = IpAddr::V4(Ipv4Addr::new(192, 168, 7, 2));
    core.dialed(conn, route);
    core.received(conn, hello_from(NAME, 11), now);
    let mut descriptor = core.local_descriptor();
    descriptor.incarnation = Incarnation(11);
    core.received(conn, Message::Descriptor(descriptor), now);
    answer.try_recv().expect("answered").expect("an endpoint");
    let links: Vec<IpAddr> = script
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .links
        .iter()
        .map(|link| link.local_ip)
        .collect();
    assert_eq!(links, vec![route]);
}

#[test]
fn immediates_on_a_target_queue_pair_reach_the_application_at_the_next_tick() {
    let (mut core, shared, script) = scripted_core(NAME, 11, addr(1, 7000));
    let now = Instant::now();
    let conn = core.accepted(addr(2, 40_001), addr(1, 7000).ip(), now);
    core.received(conn, hello_from("prefill", 20), now);
    core.received(conn, connect_qp_from(20, 1, 1, 1), now);
    assert_eq!(shared.stats().passive_qps, 1);
    script
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .immediates
        .extend([7, 8]);
    core.tick(now);
    let delivered: Vec<(String, Incarnation, NotificationBody)> = shared
        .drain_notifications()
        .into_iter()
        .map(|n| (n.from, n.incarnation, n.body))
        .collect();
    let from = |imm| {
        (
            "prefill".to_string(),
            Incarnation(20),
            NotificationBody::Immediate(imm),
        )
    };
    assert_eq!(delivered, vec![from(7), from(8)]);
}

/// The peer table's tests: liveness, redials, directory changes, queue pairs and their
/// retirement (the same network and fake fabric as above).
#[path = "peer_tests.rs"]
mod peer_tests;

/// Handshake admission (the same network and fake fabric as above).
#[path = "turns_tests.rs"]
mod turns_tests;

/// Fails the endpoint's queue pair at `view`'s epoch and lets it reconnect.
fn reconnect(net: &mut Net, prefill: usize, view: &EndpointView) -> Epoch {
    let failed = view.epoch().expect("connected");
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::QpFailed {
            endpoint: view.id,
            epoch: failed,
            status: WcStatus::RetryExcErr,
        },
        now,
    );
    net.advance(Duration::from_millis(50)); // past the backoff
    net.settle();
    let epoch = view.epoch().expect("connected again");
    assert!(epoch.is_newer_than(failed), "{view:?}");
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::Confirmed {
            endpoint: view.id,
            epoch,
        },
        now,
    );
    // Long enough up that the next failure is not a flap.
    net.advance(policy().flap_after_ready * 2);
    epoch
}

#[test]
fn a_revoke_fences_off_every_epoch_before_the_initiators_next_queue_pair() {
    let mut net = Net::new();
    let target = net.spawn(NAME, addr(1, 7000), 11, 1);
    let prefill = net.spawn("prefill", addr(2, 7000), 20, 1);
    let answer = net.connect(prefill, addr(1, 7000));
    net.settle();
    let view = answer.try_recv().expect("answered").expect("endpoint");
    let first = view.epoch().expect("connected");
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::Confirmed {
            endpoint: view.id,
            epoch: first,
        },
        now,
    );
    net.advance(policy().flap_after_ready * 2);
    // A reconnect without a revoke fences nothing.
    let second = reconnect(&mut net, prefill, &view);
    assert!(!view.is_revoked(first), "{view:?}");
    // A revoke: the next reply tells the initiator, whose older epochs are fenced for good.
    let revoked = net.procs[target].core.revoke(Incarnation(20));
    assert_eq!(
        revoked.len(),
        1,
        "its one queue pair is taken out of service"
    );
    let third = reconnect(&mut net, prefill, &view);
    assert!(
        view.is_revoked(first) && view.is_revoked(second),
        "{view:?}"
    );
    assert!(
        !view.is_revoked(third),
        "work prepared after the fence goes on"
    );
    // A second revoke fences what came before it, and only that.
    net.procs[target].core.revoke(Incarnation(20));
    let fourth = reconnect(&mut net, prefill, &view);
    assert!(
        view.is_revoked(third) && !view.is_revoked(fourth),
        "{view:?}"
    );
    // Another reconnect without a revoke keeps the fence where it was.
    let fifth = reconnect(&mut net, prefill, &view);
    assert!(
        !view.is_revoked(fourth) && !view.is_revoked(fifth),
        "{view:?}"
    );
}

/// The Park commands process `index` sent, in order: (endpoint, epoch).
fn parks_sent(net: &Net, index: usize) -> Vec<(EndpointId, Epoch)> {
    net.procs[index]
        .commands
        .iter()
        .filter_map(|(_, command)| match *command {
            Command::Park { endpoint, epoch } => Some((endpoint, epoch)),
            _ => None,
        })
        .collect()
}

/// Two targets and an initiator with room for one queue pair, its endpoint to the first
/// target ready: (network, initiator, that endpoint).
fn capped_at_one() -> (Net, usize, Arc<EndpointView>) {
    let mut net = Net::new();
    net.spawn(NAME, addr(1, 7000), 11, 1);
    net.spawn("decode-b", addr(1, 7001), 12, 1);
    let prefill = net.spawn_with(
        "prefill",
        addr(2, 7000),
        20,
        1,
        Policy {
            max_endpoints_per_rail: 1,
            ..policy()
        },
    );
    let first = net.connect(prefill, addr(1, 7000));
    net.settle();
    let first = ready(&first);
    (net, prefill, first)
}

/// With room for one queue pair, a second endpoint waits while the first is asked to park;
/// a park answered after the first moved on frees nothing, and the first's next transfer
/// (Wanted) waits its turn in turn. Nothing is retired on the way.
#[test]
fn endpoints_beyond_the_rails_cap_wait_for_an_idle_one_to_park() {
    let (mut net, prefill, first) = capped_at_one();
    let second = net.connect(prefill, addr(1, 7001));
    net.settle();
    let second = second.try_recv().expect("answered").expect("an endpoint");
    // It exists, but waits for room: no handshake, and the first is asked to park.
    assert_eq!(second.phase(), Phase::Idle);
    assert_eq!(second.epoch(), None);
    let first_epoch = first.epoch().expect("ready");
    assert_eq!(parks_sent(&net, prefill), vec![(first.id, first_epoch)]);
    assert_eq!(net.stats(prefill).endpoint_waits, 1);

    // The poller refuses (the first is busy): the second keeps waiting, and the next look
    // asks again.
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::ParkRefused {
            endpoint: first.id,
            epoch: first_epoch,
        },
        now,
    );
    net.settle();
    assert_eq!(second.phase(), Phase::Idle);
    net.advance(Duration::from_millis(20));
    net.settle();
    assert_eq!(parks_sent(&net, prefill).len(), 2);

    // Parked: the second connects; the first stays ready, marked parked, and its target is
    // told to drop its queue pair.
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::Parked {
            endpoint: first.id,
            epoch: first_epoch,
        },
        now,
    );
    net.settle();
    assert_eq!(second.phase(), Phase::Ready);
    assert!(second.epoch().is_some());
    assert_eq!(first.phase(), Phase::Ready);
    assert!(first.is_parked());
    assert_eq!(net.stats(prefill).evictions, 1);

    // A transfer arrives for the first: it waits for room, and the second (idle) is asked
    // to park; once it is, the first connects at its next epoch.
    let now = net.now;
    net.procs[prefill]
        .core
        .poller_event(0, Event::Wanted { endpoint: first.id }, now);
    net.settle();
    let second_epoch = second.epoch().expect("ready");
    assert_eq!(
        parks_sent(&net, prefill).last(),
        Some(&(second.id, second_epoch))
    );
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::Parked {
            endpoint: second.id,
            epoch: second_epoch,
        },
        now,
    );
    net.settle();
    assert_eq!(first.phase(), Phase::Ready);
    assert!(!first.is_parked());
    assert!(first.epoch().expect("ready").is_newer_than(first_epoch));
    assert!(second.is_parked());
    assert_eq!(net.stats(prefill).wakes, 1);
    // A park answered for an epoch the endpoint has left frees nothing.
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::Parked {
            endpoint: first.id,
            epoch: first_epoch,
        },
        now,
    );
    net.settle();
    assert!(!first.is_parked());
    assert_eq!(net.stats(prefill).evictions, 2);
    assert_eq!(net.retired_endpoints(prefill), 0);
    assert_no_crossed_queue_pairs(&net, prefill);
}

/// A full event ring keeps only an endpoint's latest event: a Parked folded into the Wanted
/// after it still counts, and the endpoint connects again instead of waiting forever.
#[test]
fn a_wanted_whose_parked_was_folded_into_it_still_wakes_the_endpoint() {
    let (mut net, prefill, first) = capped_at_one();
    let first_epoch = first.epoch().expect("ready");
    let second = net.connect(prefill, addr(1, 7001));
    net.settle();
    let second = second.try_recv().expect("answered").expect("an endpoint");
    assert_eq!(parks_sent(&net, prefill), vec![(first.id, first_epoch)]);
    // Only the Wanted arrives: the first was parked, so the second connects, and the first
    // waits for room in turn (the second is asked to park).
    let now = net.now;
    net.procs[prefill]
        .core
        .poller_event(0, Event::Wanted { endpoint: first.id }, now);
    net.settle();
    assert_eq!(second.phase(), Phase::Ready);
    assert!(first.is_parked());
    // The second was still connecting when the first asked for room: the next look asks it.
    net.advance(Duration::from_millis(20));
    net.settle();
    let second_epoch = second.epoch().expect("ready");
    assert_eq!(
        parks_sent(&net, prefill).last(),
        Some(&(second.id, second_epoch))
    );
    let now = net.now;
    net.procs[prefill].core.poller_event(
        0,
        Event::Parked {
            endpoint: second.id,
            epoch: second_epoch,
        },
        now,
    );
    net.settle();
    assert!(!first.is_parked());
    assert!(first.epoch().expect("ready").is_newer_than(first_epoch));
}
