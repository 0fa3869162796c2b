//! The simulated world: processes (each a real handshake core, its shared views and model
//! pollers), the network between them, the clock, the faults, and the checks. One thread,
//! one event queue ordered by (time, sequence), one seed.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use railyard_dataplane::FailReason;
use railyard_dataplane::fabric::WcStatus;
use railyard_dataplane::rng::SplitMix64;
use railyard_dataplane::sabotage::Protection;
use railyard_dataplane::{Command, EndpointId, Epoch, Event};

use super::config::{Fault, FaultKind, SimConfig, SimReport, Violation};
use super::fabric::{Registry, SimFabric, lock};
use super::model::{ModelEndpoint, ModelRail, Request};
use super::service::{Host, ProcessView, ServiceReport, ServiceWorld, SimService};
use super::trace::Trace;
use crate::endpoint::{Incarnation, Phase};
use crate::error::ControlError;
use crate::handshake::{Action, ConnId, Core, Identity, PeerChange};
use crate::host::HostId;
use crate::shared::{ControlShared, EndpointView};
use crate::wire::Message;

/// Simulated time, in microseconds from the start.
type Micros = u64;

/// One end of a control connection: (process slot, its generation, the core's id for it).
type End = (usize, u32, ConnId);

/// The port every simulated process listens on (each has its own address).
const PORT: u16 = 7000;

/// Runs one simulation and reports what happened.
pub fn simulate(config: &SimConfig) -> SimReport {
    let wall = Instant::now();
    let mut world = World::new(config.clone());
    world.run();
    world.finish(wall)
}

/// Something that happens at a time.
enum Happening {
    Deliver {
        to: End,
        message: Message,
    },
    Closed {
        to: End,
    },
    DialFailed {
        to: End,
    },
    Tick {
        slot: usize,
        generation: u32,
    },
    Work {
        slot: usize,
        generation: u32,
    },
    PollerEvent {
        slot: usize,
        generation: u32,
        rail: u16,
        event: Event,
    },
    Complete {
        request: u64,
        epoch: u64,
        ok: bool,
    },
    Deadline {
        request: u64,
    },
    Fault(usize),
    Restart {
        slot: usize,
    },
    Resume {
        slot: usize,
        generation: u32,
    },
    LeaseBack {
        slot: usize,
        incarnation: Incarnation,
    },
    StopBound {
        slot: usize,
        incarnation: Incarnation,
    },
    /// The process answers its next waiting ConnectQp (it has been busy with the one
    /// before for `handshake_cost`).
    Answer {
        slot: usize,
        generation: u32,
    },
    Sample,
    /// A wake-up a service asked for.
    Service {
        service: usize,
        token: u64,
    },
}

struct Scheduled {
    at: Micros,
    seq: u64,
    /// Boxed: the heap moves entries as it sifts them.
    what: Box<Happening>,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Earliest first out of the (max-)heap.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// An application's connect waiting for its answer: (target, answer, deadline).
type Open = (
    usize,
    Receiver<Result<Arc<EndpointView>, ControlError>>,
    Micros,
);

/// One simulated process (the current incarnation in its slot).
struct Node {
    generation: u32,
    incarnation: Incarnation,
    addr: SocketAddr,
    name: String,
    core: Core<SimFabric>,
    shared: Arc<ControlShared>,
    rails: Vec<ModelRail>,
    up: bool,
    stopped: bool,
    /// What reached it while stopped, in order.
    inbox: Vec<Happening>,
    /// The processes it sends transfers to, and which is next.
    targets: Vec<usize>,
    next_target: usize,
    /// The endpoint it uses for each target.
    uses: BTreeMap<usize, Arc<EndpointView>>,
    /// Connects waiting for their answer: (target, answer, deadline).
    opens: Vec<Open>,
    /// An [`Happening::Answer`] is scheduled: it answers ConnectQps one after another, each
    /// taking `handshake_cost` of its time.
    answering: bool,
}

pub(super) struct World {
    config: SimConfig,
    base: Instant,
    now: Micros,
    end: Micros,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    net_rng: SplitMix64,
    registry: Arc<Mutex<Registry>>,
    nodes: Vec<Node>,
    slot_of_addr: BTreeMap<SocketAddr, usize>,
    slot_of_incarnation: HashMap<Incarnation, usize>,
    links: BTreeMap<End, End>,
    /// When the last message sent from each end arrives (TCP keeps order).
    fifo: HashMap<End, Micros>,
    /// Active partitions: one side, and when it heals.
    partitions: Vec<(BTreeSet<usize>, Micros)>,
    faults: Vec<Fault>,
    requests: HashMap<u64, Request>,
    next_request: u64,
    next_port: u32,
    trace: Trace,
    report: SimReport,
    /// Reconnects per (initiator slot, target slot): ConnectQps after the first between
    /// two incarnations, but for those that end a park.
    reconnects: BTreeMap<(usize, usize), u64>,
    /// Incarnation pairs that have sent a ConnectQp, and their parks not yet followed by
    /// one.
    attempted: BTreeMap<(Incarnation, Incarnation), u64>,
    /// Pairs that have had a ready endpoint, and how many pairs there are.
    ever_ready: BTreeSet<(usize, usize)>,
    pairs: usize,
    /// Pairs involving a restarted process that are not ready again yet, and when the
    /// first restart happened.
    converging: BTreeSet<(usize, usize)>,
    restarted_at: Option<Micros>,
    /// Stopped incarnations, since when.
    stopped_since: BTreeMap<Incarnation, Micros>,
    /// Handshakes answered per slot in the current simulated second.
    handshake_window: HashMap<usize, (u64, u64)>,
    wire_bytes: u64,
    /// Services simulated beside the control plane (each taken out while it is called).
    services: Vec<Option<Box<dyn SimService>>>,
}

fn micros(duration: Duration) -> Micros {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

fn addr_of(slot: usize) -> SocketAddr {
    let n = slot + 1;
    let ip = Ipv4Addr::new(10, (n >> 16) as u8, (n >> 8) as u8, n as u8);
    SocketAddr::new(IpAddr::V4(ip), PORT)
}

/// A message's type and the fields that identify it (never a nonce drawn from the kernel).
fn fingerprint(message: &Message) -> [u64; 3] {
    match message {
        Message::Hello { incarnation, .. } => [1, incarnation.0, 0],
        Message::GetDescriptor => [2, 0, 0],
        Message::Descriptor(descriptor) => [3, descriptor.incarnation.0, 0],
        Message::ConnectQp {
            epoch, handshake, ..
        } => [4, *epoch, *handshake],
        Message::ConnectQpReply {
            epoch,
            handshake,
            result,
            ..
        } => [5, *epoch, handshake ^ u64::from(result.is_ok())],
        Message::Notify { target, .. } => [6, target.0, 0],
        Message::Bye => [7, 0, 0],
        Message::RetireQp { epoch, qp_num, .. } => [8, *epoch, u64::from(*qp_num)],
        Message::Ping { nonce } => [9, *nonce, 0],
        Message::Pong { nonce } => [10, *nonce, 0],
        Message::Auth { .. } => [11, 0, 0],
        Message::ConnectQpQueued {
            epoch,
            handshake,
            ahead,
            ..
        } => [12, *epoch, handshake ^ u64::from(*ahead)],
    }
}

fn chance(rng: &mut SplitMix64, probability: f64) -> bool {
    probability > 0.0 && (rng.next_u64() as f64) < probability * u64::MAX as f64
}

/// The faults a run injects: `config.faults` if given, otherwise those its seed draws.
pub fn faults(config: &SimConfig) -> Vec<Fault> {
    if let Some(faults) = &config.faults {
        return faults.clone();
    }
    let mut rng = SplitMix64::new(config.seed ^ 0xfa17_5eed);
    let peers = config.peers;
    let mut free: Vec<usize> = (0..peers).collect();
    let mut take = |rng: &mut SplitMix64| -> Option<usize> {
        (!free.is_empty()).then(|| free.swap_remove(rng.below(free.len() as u64) as usize))
    };
    let mut faults = Vec::new();
    let at = |fraction: f64| config.duration.mul_f64(fraction);
    let kills = (peers as f64 * config.kill_fraction).round() as usize;
    for _ in 0..kills {
        if let Some(peer) = take(&mut rng) {
            faults.push(Fault {
                at: at(1.0 / 3.0),
                kind: FaultKind::Kill {
                    peer,
                    restart_after: config.restart_after,
                },
            });
        }
    }
    for _ in 0..config.partitions {
        let size = (peers / 20).max(1);
        let side: Vec<usize> = (0..size).filter_map(|_| take(&mut rng)).collect();
        if !side.is_empty() {
            faults.push(Fault {
                at: at(0.5),
                kind: FaultKind::Partition {
                    peers: side,
                    duration: Duration::from_millis(800),
                },
            });
        }
    }
    for _ in 0..config.lease_losses {
        if let Some(peer) = take(&mut rng) {
            faults.push(Fault {
                at: at(0.6),
                kind: FaultKind::LeaseLoss {
                    peer,
                    duration: Duration::from_secs(1),
                },
            });
        }
    }
    for _ in 0..config.stops {
        if let Some(peer) = take(&mut rng) {
            faults.push(Fault {
                at: at(2.0 / 3.0),
                kind: FaultKind::Stop {
                    peer,
                    duration: config.stop_for,
                },
            });
        }
    }
    faults
}

impl World {
    fn new(config: SimConfig) -> Self {
        let faults = faults(&config);
        let mut world = Self {
            base: Instant::now(),
            now: 0,
            end: micros(config.duration),
            queue: BinaryHeap::new(),
            seq: 0,
            net_rng: SplitMix64::new(config.seed ^ 0x0be7_u64),
            registry: Arc::default(),
            nodes: Vec::with_capacity(config.peers),
            slot_of_addr: BTreeMap::new(),
            slot_of_incarnation: HashMap::new(),
            links: BTreeMap::new(),
            fifo: HashMap::new(),
            partitions: Vec::new(),
            faults,
            requests: HashMap::new(),
            next_request: 0,
            next_port: 0,
            trace: Trace::new(config.record_trace),
            report: SimReport {
                peers: config.peers,
                ..SimReport::default()
            },
            reconnects: BTreeMap::new(),
            attempted: BTreeMap::new(),
            ever_ready: BTreeSet::new(),
            pairs: 0,
            converging: BTreeSet::new(),
            restarted_at: None,
            stopped_since: BTreeMap::new(),
            handshake_window: HashMap::new(),
            wire_bytes: 0,
            services: config
                .services
                .iter()
                .map(|factory| Some(factory.make(config.seed, config.duration)))
                .collect(),
            config,
        };
        let mut choose = SplitMix64::new(world.config.seed ^ 0x07a2_9e75);
        for slot in 0..world.config.peers {
            let pool = match world.config.hot_targets {
                0 => world.config.peers,
                hot => hot.min(world.config.peers),
            };
            let targets = choose_targets(&mut choose, slot, pool, world.config.fanout);
            world.pairs += targets.len();
            let node = world.spawn(slot, 0, targets);
            world.nodes.push(node);
            world.start(slot);
        }
        for index in 0..world.faults.len() {
            let at = micros(world.faults[index].at);
            world.at(at, Happening::Fault(index));
        }
        world.at(1_000_000, Happening::Sample);
        world.call_services(|service, view| service.start(view));
        world
    }

    /// Calls every service in turn with its view of the world.
    fn call_services(&mut self, mut call: impl FnMut(&mut dyn SimService, &mut ServiceWorld<'_>)) {
        for index in 0..self.services.len() {
            self.call_service(index, &mut call);
        }
    }

    fn call_service(
        &mut self,
        index: usize,
        call: &mut impl FnMut(&mut dyn SimService, &mut ServiceWorld<'_>),
    ) {
        let Some(mut service) = self.services[index].take() else {
            return;
        };
        call(
            service.as_mut(),
            &mut ServiceWorld {
                world: self,
                service: index,
            },
        );
        self.services[index] = Some(service);
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_micros(self.now)
    }

    fn at(&mut self, at: Micros, what: Happening) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            what: Box::new(what),
        });
    }

    fn violation(&mut self, invariant: &'static str, detail: String) {
        let at = self.now;
        self.trace
            .event(at, 0, "VIOLATION", &[], || format!("{invariant}: {detail}"));
        self.report.violations.push(Violation {
            at: Duration::from_micros(at),
            invariant,
            detail,
        });
    }

    fn latency(&mut self) -> Micros {
        let (min, max) = (
            micros(self.config.net.latency_min),
            micros(self.config.net.latency_max),
        );
        min + self.net_rng.below(max.saturating_sub(min) + 1)
    }

    /// A process for `slot` at `generation`: a core with one rail over the shared registry.
    fn spawn(&mut self, slot: usize, generation: u32, targets: Vec<usize>) -> Node {
        let incarnation = Incarnation(
            SplitMix64::new(self.config.seed ^ ((slot as u64) << 20) ^ u64::from(generation))
                .next_u64()
                | 1,
        );
        let addr = addr_of(slot);
        let name = format!("p{slot}");
        let shared = ControlShared::new(1);
        let fabric = SimFabric {
            registry: self.registry.clone(),
            owner: incarnation,
            rail: 0,
        };
        let mut core = Core::new(
            Identity {
                name: name.clone(),
                incarnation,
                local_addr: addr,
                host: HostId::default(),
                secret: None,
                encrypt_control: false,
            },
            self.config.policy.clone(),
            self.config.seed,
            vec![fabric],
            shared.clone(),
        );
        // Every ConnectQp waits for its turn: the simulation charges each its cost.
        core.take_turns(0);
        self.slot_of_addr.insert(addr, slot);
        self.slot_of_incarnation.insert(incarnation, slot);
        Node {
            generation,
            incarnation,
            addr,
            name,
            core,
            shared,
            rails: vec![ModelRail::default()],
            up: true,
            stopped: false,
            inbox: Vec::new(),
            targets,
            next_target: 0,
            uses: BTreeMap::new(),
            opens: Vec::new(),
            answering: false,
        }
    }

    /// Starts `slot`'s timers: ticks and transfers, each at a phase of its own.
    fn start(&mut self, slot: usize) {
        let generation = self.nodes[slot].generation;
        let tick = micros(self.config.tick).max(1);
        let interval = micros(self.config.request_interval).max(1);
        let tick_phase = self.net_rng.below(tick);
        let work_phase = self.net_rng.below(interval);
        self.at(self.now + tick_phase, Happening::Tick { slot, generation });
        self.at(self.now + work_phase, Happening::Work { slot, generation });
    }

    fn run(&mut self) {
        while let Some(next) = self.queue.pop() {
            if next.at > self.end {
                break;
            }
            self.now = next.at;
            self.report.events += 1;
            self.handle(*next.what);
        }
        self.now = self.now.max(self.end);
    }

    /// The node in `slot` if it is `generation` and up.
    fn live(&self, slot: usize, generation: u32) -> bool {
        let node = &self.nodes[slot];
        node.up && node.generation == generation
    }

    fn handle(&mut self, what: Happening) {
        match what {
            Happening::Deliver { to, message } => {
                if !self.live(to.0, to.1) {
                    return;
                }
                if self.nodes[to.0].stopped {
                    return self.nodes[to.0]
                        .inbox
                        .push(Happening::Deliver { to, message });
                }
                let print = fingerprint(&message);
                let now = self.now;
                self.trace.event(
                    now,
                    to.0,
                    "deliver",
                    &[to.2.0, print[0], print[1], print[2]],
                    || format!("conn {} {message:?}", to.2.0),
                );
                match message {
                    Message::ConnectQp { .. } => self.count_handshake(to.0),
                    Message::ConnectQpQueued { .. } => self.report.handshakes_told_to_wait += 1,
                    _ => {}
                }
                let instant = self.instant();
                self.nodes[to.0].core.received(to.2, message, instant);
                self.pump(to.0);
                self.answer_soon(to.0);
            }
            Happening::Closed { to } | Happening::DialFailed { to } => {
                if !self.live(to.0, to.1) {
                    return;
                }
                if self.nodes[to.0].stopped {
                    return self.nodes[to.0].inbox.push(Happening::Closed { to });
                }
                let now = self.now;
                self.trace.event(now, to.0, "closed", &[to.2.0], || {
                    format!("conn {}", to.2.0)
                });
                let instant = self.instant();
                self.nodes[to.0].core.closed(to.2, "reset", instant);
                self.pump(to.0);
            }
            Happening::Tick { slot, generation } => {
                if !self.live(slot, generation) {
                    return;
                }
                if !self.nodes[slot].stopped {
                    let instant = self.instant();
                    self.nodes[slot].core.tick(instant);
                    self.pump(slot);
                    self.check_opens(slot);
                }
                let next = self.now + micros(self.config.tick).max(1);
                self.at(next, Happening::Tick { slot, generation });
            }
            Happening::Work { slot, generation } => {
                if !self.live(slot, generation) {
                    return;
                }
                if !self.nodes[slot].stopped {
                    self.work(slot);
                }
                let next = self.now + micros(self.config.request_interval).max(1);
                self.at(next, Happening::Work { slot, generation });
            }
            Happening::PollerEvent {
                slot,
                generation,
                rail,
                event,
            } => {
                if !self.live(slot, generation) {
                    return;
                }
                if self.nodes[slot].stopped {
                    return self.nodes[slot].inbox.push(Happening::PollerEvent {
                        slot,
                        generation,
                        rail,
                        event,
                    });
                }
                let now = self.now;
                self.trace.event(
                    now,
                    slot,
                    "poller-event",
                    &[u64::from(event.endpoint().0)],
                    || format!("{event:?}"),
                );
                let instant = self.instant();
                self.nodes[slot].core.poller_event(rail, event, instant);
                self.pump(slot);
            }
            Happening::Complete { request, epoch, ok } => self.complete(request, epoch, ok),
            Happening::Deadline { request } => {
                if self.requests.contains_key(&request) {
                    self.fail_request(request, FailReason::Timeout);
                }
            }
            Happening::Fault(index) => self.fault(index),
            Happening::Restart { slot } => self.restart(slot),
            Happening::Resume { slot, generation } => {
                if !self.live(slot, generation) {
                    return;
                }
                let now = self.now;
                self.trace.event(now, slot, "resume", &[], String::new);
                let incarnation = self.nodes[slot].incarnation;
                self.stopped_since.remove(&incarnation);
                self.nodes[slot].stopped = false;
                for waiting in std::mem::take(&mut self.nodes[slot].inbox) {
                    self.handle(waiting);
                }
                self.pump(slot);
                self.call_services(|service, view| service.process_changed(slot, view));
            }
            Happening::LeaseBack { slot, incarnation } => {
                let name = self.nodes[slot].name.clone();
                self.tell_directory(slot, &name, PeerChange::Returned { incarnation });
            }
            Happening::StopBound { slot, incarnation } => {
                self.check_stop_detected(slot, incarnation)
            }
            Happening::Answer { slot, generation } => {
                if !self.live(slot, generation) {
                    return;
                }
                if self.nodes[slot].stopped {
                    // Looked at again once it runs.
                    let next = self.now + micros(self.config.tick).max(1);
                    return self.at(next, Happening::Answer { slot, generation });
                }
                let answered = self.nodes[slot].core.answer_handshakes(1);
                self.pump(slot);
                let busy = if answered > 0 {
                    micros(self.config.handshake_cost)
                } else {
                    0
                };
                if self.nodes[slot].core.handshakes_unanswered() > 0 {
                    let next = self.now + busy;
                    self.at(next, Happening::Answer { slot, generation });
                } else {
                    self.nodes[slot].answering = false;
                }
            }
            Happening::Sample => {
                self.sample();
                let next = self.now + 1_000_000;
                self.at(next, Happening::Sample);
            }
            Happening::Service { service, token } => {
                self.call_service(service, &mut |service, view| service.wake(token, view));
            }
        }
    }

    /// Schedules `slot`'s next answer to a ConnectQp unless one is scheduled.
    fn answer_soon(&mut self, slot: usize) {
        let node = &mut self.nodes[slot];
        if node.answering || node.core.handshakes_unanswered() == 0 {
            return;
        }
        node.answering = true;
        let generation = node.generation;
        let now = self.now;
        self.at(now, Happening::Answer { slot, generation });
    }

    fn count_handshake(&mut self, slot: usize) {
        self.report.handshakes += 1;
        let second = self.now / 1_000_000;
        let window = self.handshake_window.entry(slot).or_insert((second, 0));
        if window.0 != second {
            *window = (second, 0);
        }
        window.1 += 1;
        self.report.peak_handshakes_per_sec_into_one =
            self.report.peak_handshakes_per_sec_into_one.max(window.1);
    }

    /// `slot` offers a queue pair to `target`: after the pair's first, a reconnect, unless
    /// it ends a park (a parked endpoint woken by traffic is not a reconnect) or `target`
    /// is dead (retrying a dead peer until its death is known is not a storm: backoff and
    /// the circuit bound it).
    fn count_attempt(&mut self, slot: usize, target: Incarnation) {
        let pair = (self.nodes[slot].incarnation, target);
        let Some(parks) = self.attempted.get_mut(&pair) else {
            self.attempted.insert(pair, 0);
            return;
        };
        if *parks > 0 {
            *parks -= 1;
            return;
        }
        let Some(&target_slot) = self.slot_of_incarnation.get(&target) else {
            return;
        };
        let node = &self.nodes[target_slot];
        if node.up && node.incarnation == target {
            *self.reconnects.entry((slot, target_slot)).or_insert(0) += 1;
        }
    }

    /// Carries out everything `slot`'s core asked for.
    fn pump(&mut self, slot: usize) {
        while let Some(action) = self.nodes[slot].core.next_action() {
            self.carry_out(slot, action);
        }
    }

    fn carry_out(&mut self, slot: usize, action: Action) {
        let generation = self.nodes[slot].generation;
        let now = self.now;
        match action {
            Action::Dial { conn, addr } => {
                self.trace.event(now, slot, "dial", &[conn.0], || {
                    format!("conn {} → {addr}", conn.0)
                });
                self.dial(slot, conn, addr);
            }
            Action::Send { conn, message } => {
                if let Message::ConnectQp { key, .. } = &message {
                    self.count_attempt(slot, key.target);
                }
                self.wire_bytes += message.encode().len() as u64;
                self.send((slot, generation, conn), message);
            }
            Action::Close { conn } => {
                self.trace
                    .event(now, slot, "close", &[conn.0], || format!("conn {}", conn.0));
                self.hang_up((slot, generation, conn));
            }
            // Simulated processes have no cluster secret, and their frames are messages,
            // not bytes: nothing to seal.
            Action::Protect { .. } => {}
            Action::Command { rail, command } => self.command(slot, rail, command),
            Action::AddEndpoint { rail, view, epoch } => {
                view.set_epoch(epoch);
                self.command(
                    slot,
                    rail,
                    Command::AddEndpoint {
                        endpoint: view.id,
                        epoch,
                    },
                );
            }
            Action::Publish {
                view,
                phase,
                probation,
            } => {
                view.publish(phase, probation);
                self.trace.event(
                    now,
                    slot,
                    "publish",
                    &[u64::from(view.id.0), phase as u64],
                    || format!("endpoint {} to {:?}: {phase:?}", view.id.0, view.key.peer),
                );
                match phase {
                    Phase::Ready => self.pair_ready(slot, &view),
                    Phase::CircuitOpen => self.detected(view.key.peer),
                    _ => {}
                }
            }
        }
    }

    /// Whether a partition separates `a` and `b` now.
    fn cut(&self, a: usize, b: usize) -> Option<Micros> {
        self.partitions
            .iter()
            .filter(|(side, heals)| *heals > self.now && side.contains(&a) != side.contains(&b))
            .map(|(_, heals)| *heals)
            .max()
    }

    fn dial(&mut self, slot: usize, conn: ConnId, addr: SocketAddr) {
        let generation = self.nodes[slot].generation;
        let listener = self
            .slot_of_addr
            .get(&addr)
            .copied()
            .filter(|&target| self.nodes[target].up);
        let Some(target) = listener else {
            let at = self.now + self.latency() * 2;
            return self.at(
                at,
                Happening::DialFailed {
                    to: (slot, generation, conn),
                },
            );
        };
        if self.cut(slot, target).is_some() {
            let at = self.now + micros(self.config.policy.connect_timeout);
            return self.at(
                at,
                Happening::DialFailed {
                    to: (slot, generation, conn),
                },
            );
        }
        self.next_port = self.next_port.wrapping_add(1);
        let port = 10_000 + (self.next_port % 50_000) as u16;
        let from = SocketAddr::new(self.nodes[slot].addr.ip(), port);
        let instant = self.instant();
        let theirs = self.nodes[target].core.accepted(from, addr.ip(), instant);
        let their_end = (target, self.nodes[target].generation, theirs);
        let my_end = (slot, generation, conn);
        self.links.insert(my_end, their_end);
        self.links.insert(their_end, my_end);
        let ip = self.nodes[slot].addr.ip();
        self.nodes[slot].core.dialed(conn, ip);
        if !self.nodes[target].stopped {
            self.pump(target);
        }
    }

    /// When a message sent now from `from` to `to` arrives, in order behind those before it.
    fn arrival(&mut self, from: End, to: End, in_order: bool) -> Micros {
        let mut at = self.now + self.latency();
        if in_order {
            at = at.max(self.fifo.get(&from).copied().unwrap_or(0));
        }
        if let Some(heals) = self.cut(from.0, to.0) {
            at = at.max(heals + self.latency());
        }
        let last = self.fifo.entry(from).or_insert(0);
        *last = (*last).max(at);
        at
    }

    fn send(&mut self, from: End, message: Message) {
        let Some(&to) = self.links.get(&from) else {
            return;
        };
        let now = self.now;
        if chance(&mut self.net_rng, self.config.net.loss) {
            // TCP never loses one message and carries on: the connection goes with it.
            let print = fingerprint(&message);
            self.trace
                .event(now, from.0, "lost", &print, || format!("{message:?}"));
            self.hang_up(from);
            let at = self.now + self.latency();
            self.at(at, Happening::Closed { to: from });
            return;
        }
        let in_order = !chance(&mut self.net_rng, self.config.net.reorder);
        let at = self.arrival(from, to, in_order);
        if chance(&mut self.net_rng, self.config.net.duplicate) {
            let again = self.arrival(from, to, true);
            self.at(
                again,
                Happening::Deliver {
                    to,
                    message: message.clone(),
                },
            );
        }
        self.at(at, Happening::Deliver { to, message });
    }

    fn hang_up(&mut self, mine: End) {
        if let Some(theirs) = self.links.remove(&mine) {
            self.links.remove(&theirs);
            let at = self.arrival(mine, theirs, true);
            self.at(at, Happening::Closed { to: theirs });
        }
        self.fifo.remove(&mine);
    }

    // ---- model pollers ----

    fn command(&mut self, slot: usize, rail: u16, command: Command) {
        let now = self.now;
        self.trace
            .event(now, slot, "command", &[u64::from(rail)], || {
                format!("rail {rail}: {command:?}")
            });
        let r = usize::from(rail);
        match command {
            Command::AddEndpoint { endpoint, epoch } => {
                let live = self.nodes[slot].rails[r]
                    .endpoints
                    .get(&endpoint)
                    .is_some_and(|model| !model.retired);
                if live {
                    return self.bump(slot, rail, endpoint, epoch);
                }
                let newest = self.nodes[slot].rails[r]
                    .newest_epoch
                    .get(&endpoint)
                    .copied()
                    .unwrap_or(0);
                if epoch.get() <= newest {
                    self.violation(
                        "epochs-only-grow",
                        format!(
                            "p{slot} endpoint {} got epoch {} after {newest}",
                            endpoint.0,
                            epoch.get()
                        ),
                    );
                }
                let peer = self.nodes[slot]
                    .shared
                    .view(rail, endpoint)
                    .map_or(Incarnation(0), |view| view.key.peer);
                self.nodes[slot].rails[r]
                    .endpoints
                    .insert(endpoint, ModelEndpoint::new(peer));
                self.connect(slot, rail, endpoint, epoch);
            }
            Command::BumpEpoch { endpoint, epoch } => self.bump(slot, rail, endpoint, epoch),
            Command::RetireEndpoint { endpoint, reason } => {
                let requests = match self.nodes[slot].rails[r].endpoints.get_mut(&endpoint) {
                    Some(model) => {
                        model.retired = true;
                        model.remote = None;
                        let mut requests: Vec<u64> = model.backlog.drain(..).collect();
                        requests.append(&mut model.in_flight);
                        requests
                    }
                    None => Vec::new(),
                };
                for request in requests {
                    self.resolve(request, Err(reason));
                }
                self.poller_event(slot, rail, Event::EndpointDrained { endpoint });
            }
            Command::SetCircuit { endpoint, open } => {
                let Some(model) = self.nodes[slot].rails[r].endpoints.get_mut(&endpoint) else {
                    return;
                };
                model.circuit_open = open;
                if open {
                    let backlog: Vec<u64> = model.backlog.drain(..).collect();
                    for request in backlog {
                        self.resolve(request, Err(FailReason::PeerUnavailable));
                    }
                } else {
                    self.pump_endpoint(slot, rail, endpoint);
                }
            }
            Command::Park { endpoint, epoch } => self.park(slot, rail, endpoint, epoch),
            Command::Unreachable { endpoint } => {
                let Some(model) = self.nodes[slot].rails[r].endpoints.get_mut(&endpoint) else {
                    return;
                };
                model.circuit_open = true;
                model.remote = None;
                let peer = model.peer;
                let mut requests: Vec<u64> = model.backlog.drain(..).collect();
                requests.append(&mut model.in_flight);
                for request in requests {
                    self.resolve(request, Err(FailReason::PeerUnavailable));
                }
                self.detected(peer);
            }
            _ => {}
        }
    }

    /// The poller's park: frees the queue pair only if the endpoint is idle (unless the
    /// idle check is sabotaged: then what was in flight on it fails).
    fn park(&mut self, slot: usize, rail: u16, endpoint: EndpointId, epoch: Epoch) {
        let sabotaged = railyard_dataplane::sabotage::is_off(Protection::IdleEviction);
        let model = self.nodes[slot].rails[usize::from(rail)]
            .endpoints
            .get_mut(&endpoint)
            .filter(|model| {
                model.epoch == epoch.get()
                    && model.remote.is_some()
                    && !model.retired
                    && (sabotaged || (model.backlog.is_empty() && model.in_flight.is_empty()))
            });
        let Some(model) = model else {
            return self.poller_event(slot, rail, Event::ParkRefused { endpoint, epoch });
        };
        model.remote = None;
        model.parked = true;
        model.wanted = false;
        let peer = model.peer;
        let lost: Vec<u64> = model.in_flight.drain(..).collect();
        let pair = (self.nodes[slot].incarnation, peer);
        *self.attempted.entry(pair).or_insert(0) += 1;
        self.report.evictions += 1;
        if !lost.is_empty() {
            self.violation(
                "evictions-fail-nothing",
                format!(
                    "p{slot} endpoint {} was parked with {} transfers in flight",
                    endpoint.0,
                    lost.len()
                ),
            );
        }
        for request in lost {
            self.report.failed_by_eviction += 1;
            self.resolve(request, Err(FailReason::EndpointRetired));
        }
        self.poller_event(slot, rail, Event::Parked { endpoint, epoch });
        self.pump_endpoint(slot, rail, endpoint);
    }

    fn poller_event(&mut self, slot: usize, rail: u16, event: Event) {
        let at = self.now + 5;
        let generation = self.nodes[slot].generation;
        self.at(
            at,
            Happening::PollerEvent {
                slot,
                generation,
                rail,
                event,
            },
        );
    }

    fn bump(&mut self, slot: usize, rail: u16, endpoint: EndpointId, epoch: Epoch) {
        let r = usize::from(rail);
        let Some(model) = self.nodes[slot].rails[r].endpoints.get_mut(&endpoint) else {
            return;
        };
        if model.retired || epoch.get() <= model.epoch {
            return;
        }
        // What was in flight on the old queue pair is retried on the new one.
        let retried: Vec<u64> = model.in_flight.drain(..).collect();
        for &request in retried.iter().rev() {
            model.backlog.push_front(request);
        }
        for request in retried {
            self.watch_deadline(request);
        }
        self.connect(slot, rail, endpoint, epoch);
    }

    /// The poller connects the queue pair the core staged for `endpoint` at `epoch`.
    fn connect(&mut self, slot: usize, rail: u16, endpoint: EndpointId, epoch: Epoch) {
        let r = usize::from(rail);
        let me = self.nodes[slot].incarnation;
        let newest = self.nodes[slot].rails[r]
            .newest_epoch
            .entry(endpoint)
            .or_insert(0);
        *newest = (*newest).max(epoch.get());
        let staged = {
            let mut registry = lock(&self.registry);
            let remote = registry.staged.remove(&(me, rail, endpoint, epoch.get()));
            remote.map(|remote| (remote, registry.owner.get(&remote).copied()))
        };
        let Some(model) = self.nodes[slot].rails[r].endpoints.get_mut(&endpoint) else {
            return;
        };
        model.epoch = epoch.get();
        model.confirmed = false;
        model.failed = false;
        model.parked = false;
        model.wanted = false;
        let peer = model.peer;
        match staged {
            Some((remote, owner)) => {
                model.remote = Some(remote);
                if owner != Some(peer) {
                    self.violation(
                        "queue-pair-reaches-its-peer",
                        format!(
                            "p{slot} endpoint {} for {peer:?} at epoch {} was handed a queue pair \
                             of {owner:?}",
                            endpoint.0,
                            epoch.get()
                        ),
                    );
                }
                self.pump_endpoint(slot, rail, endpoint);
            }
            None => {
                model.remote = None;
                self.poller_event(
                    slot,
                    rail,
                    Event::ConnectFailed {
                        endpoint,
                        epoch,
                        reason: "nothing staged".into(),
                    },
                );
            }
        }
    }

    /// Posts what waits on `endpoint`, if it has a queue pair and a closed circuit.
    fn pump_endpoint(&mut self, slot: usize, rail: u16, endpoint: EndpointId) {
        let r = usize::from(rail);
        let Some(model) = self.nodes[slot].rails[r].endpoints.get_mut(&endpoint) else {
            return;
        };
        if model.retired {
            return;
        }
        if model.circuit_open {
            let backlog: Vec<u64> = model.backlog.drain(..).collect();
            for request in backlog {
                self.resolve(request, Err(FailReason::PeerUnavailable));
            }
            return;
        }
        let Some(remote) = model.remote else {
            if model.parked && !model.wanted && !model.backlog.is_empty() {
                model.wanted = true;
                self.poller_event(slot, rail, Event::Wanted { endpoint });
            }
            return;
        };
        let epoch = model.epoch;
        let waiting: Vec<u64> = model.backlog.drain(..).collect();
        model.in_flight.extend(&waiting);
        let owner = lock(&self.registry).owner.get(&remote).copied();
        let revoked = lock(&self.registry).revoked.contains_key(&remote);
        let target = owner.and_then(|owner| self.slot_of_incarnation.get(&owner).copied());
        for request in waiting {
            let Some(prepared) = self.requests.get_mut(&request) else {
                continue;
            };
            if prepared.epoch > epoch {
                let prepared_for = prepared.epoch;
                self.violation(
                    "no-slice-on-an-older-queue-pair",
                    format!(
                        "p{slot} endpoint {} posted a slice prepared for epoch {prepared_for} \
                         on the queue pair of epoch {epoch}",
                        endpoint.0
                    ),
                );
            } else if prepared.epoch < epoch {
                prepared.epoch = epoch;
                self.report.reprepared += 1;
            }
            let rtt = self.latency() * 2;
            let outcome = match target {
                Some(target)
                    if self.nodes[target].up
                        && Some(self.nodes[target].incarnation) == owner
                        && !revoked =>
                {
                    if self.nodes[target].stopped || self.cut(slot, target).is_some() {
                        None
                    } else {
                        Some(true)
                    }
                }
                _ => Some(false),
            };
            match outcome {
                Some(ok) => self.at(self.now + rtt, Happening::Complete { request, epoch, ok }),
                None => self.watch_deadline(request),
            }
        }
    }

    fn complete(&mut self, request: u64, epoch: u64, ok: bool) {
        let Some(prepared) = self.requests.get(&request) else {
            return;
        };
        let (slot, generation) = prepared.node;
        let (rail, endpoint) = (prepared.rail, prepared.endpoint);
        if !self.live(slot, generation) {
            return;
        }
        let Some(model) = self.nodes[slot].rails[usize::from(rail)]
            .endpoints
            .get_mut(&endpoint)
        else {
            return;
        };
        if model.epoch != epoch || !model.in_flight.contains(&request) {
            return;
        }
        if ok {
            model.in_flight.retain(|&r| r != request);
            let first = !model.confirmed;
            model.confirmed = true;
            self.resolve(request, Ok(()));
            if first {
                self.poller_event(
                    slot,
                    rail,
                    Event::Confirmed {
                        endpoint,
                        epoch: Epoch::new(epoch),
                    },
                );
            }
        } else if !model.failed {
            // A transport error: the queue pair is in ERR, its work waits for a newer one.
            model.failed = true;
            model.remote = None;
            let waiting: Vec<u64> = model.in_flight.drain(..).collect();
            for &request in waiting.iter().rev() {
                model.backlog.push_front(request);
            }
            for request in waiting {
                self.watch_deadline(request);
            }
            self.poller_event(
                slot,
                rail,
                Event::QpFailed {
                    endpoint,
                    epoch: Epoch::new(epoch),
                    status: WcStatus::RetryExcErr,
                },
            );
        }
    }

    /// Schedules the sweep of `request` at its deadline: done whenever it waits without a
    /// completion on its way (a request completing at once needs none).
    fn watch_deadline(&mut self, request: u64) {
        if let Some(prepared) = self.requests.get(&request) {
            let deadline = prepared.deadline;
            self.at(deadline, Happening::Deadline { request });
        }
    }

    fn fail_request(&mut self, request: u64, reason: FailReason) {
        let Some(prepared) = self.requests.get(&request) else {
            return;
        };
        let (slot, generation) = prepared.node;
        let (rail, endpoint) = (prepared.rail, prepared.endpoint);
        if self.live(slot, generation) {
            if let Some(model) = self.nodes[slot].rails[usize::from(rail)]
                .endpoints
                .get_mut(&endpoint)
            {
                model.backlog.retain(|&r| r != request);
                model.in_flight.retain(|&r| r != request);
            }
        }
        self.resolve(request, Err(reason));
    }

    fn resolve(&mut self, request: u64, outcome: Result<(), FailReason>) {
        let Some(prepared) = self.requests.remove(&request) else {
            return;
        };
        let now = self.now;
        if now > prepared.deadline {
            self.violation(
                "requests-resolve-by-their-deadline",
                format!(
                    "request {request} resolved {} µs after its deadline",
                    now - prepared.deadline
                ),
            );
        }
        let code = outcome.map_or_else(|reason| reason as u64, |()| 0);
        self.trace
            .event(now, prepared.node.0, "resolve", &[request, code], || {
                format!("request {request}: {outcome:?}")
            });
        match outcome {
            Ok(()) => self.report.completed += 1,
            Err(_) => self.report.failed += 1,
        }
    }

    // ---- the application ----

    /// `slot` starts a transfer to its next target, opening the peer first if it must.
    fn work(&mut self, slot: usize) {
        let node = &mut self.nodes[slot];
        if node.targets.is_empty() {
            return;
        }
        let target = node.targets[node.next_target % node.targets.len()];
        node.next_target += 1;
        let view = node
            .uses
            .get(&target)
            .filter(|view| view.phase() != Phase::Retired)
            .cloned();
        let Some(view) = view else {
            if !node.opens.iter().any(|(t, ..)| *t == target) {
                self.open(slot, target);
            }
            return;
        };
        let Some(epoch) = view.epoch() else {
            return;
        };
        self.report.requests += 1;
        if view.phase() == Phase::CircuitOpen {
            self.report.failed_fast += 1;
            return;
        }
        self.next_request += 1;
        let request = self.next_request;
        let deadline = self.now + micros(self.config.request_timeout);
        let generation = self.nodes[slot].generation;
        let (rail, endpoint) = (view.key.local_rail, view.id);
        self.requests.insert(
            request,
            Request {
                node: (slot, generation),
                rail,
                endpoint,
                epoch: epoch.get(),
                deadline,
            },
        );
        let queued = match self.nodes[slot].rails[usize::from(rail)]
            .endpoints
            .get_mut(&endpoint)
        {
            Some(model) if !model.retired => {
                model.backlog.push_back(request);
                true
            }
            _ => false,
        };
        if queued {
            self.pump_endpoint(slot, rail, endpoint);
            let waits = self.nodes[slot].rails[usize::from(rail)]
                .endpoints
                .get(&endpoint)
                .is_some_and(|model| model.backlog.contains(&request));
            if waits {
                self.watch_deadline(request);
            }
        } else {
            self.resolve(request, Err(FailReason::UnknownEndpoint));
        }
    }

    fn open(&mut self, slot: usize, target: usize) {
        let (reply, answer) = mpsc::channel();
        let instant = self.instant();
        let deadline = self.now
            + micros(self.config.policy.connect_timeout)
            + 2 * micros(self.config.tick)
            + 1;
        let now = self.now;
        self.trace
            .event(now, slot, "open", &[target as u64], || format!("p{target}"));
        self.nodes[slot]
            .core
            .connect(addr_of(target), 0, 0, reply, instant);
        self.nodes[slot].opens.push((target, answer, deadline));
        self.pump(slot);
        self.check_opens(slot);
    }

    /// Takes the answers of `slot`'s connects; one not answered by its deadline is a
    /// violation.
    fn check_opens(&mut self, slot: usize) {
        let opens = std::mem::take(&mut self.nodes[slot].opens);
        let mut still = Vec::with_capacity(opens.len());
        for (target, answer, deadline) in opens {
            match answer.try_recv() {
                Ok(Ok(view)) => {
                    let now = self.now;
                    self.trace.event(
                        now,
                        slot,
                        "opened",
                        &[target as u64, u64::from(view.id.0)],
                        || format!("p{target}: endpoint {} to {:?}", view.id.0, view.key.peer),
                    );
                    self.nodes[slot].uses.insert(target, view);
                }
                Ok(Err(error)) => {
                    let now = self.now;
                    self.trace
                        .event(now, slot, "open-failed", &[target as u64], || {
                            format!("p{target}: {error}")
                        });
                    self.report.connects_failed += 1;
                }
                Err(TryRecvError::Empty) if self.now <= deadline => {
                    still.push((target, answer, deadline));
                }
                Err(TryRecvError::Empty) => self.violation(
                    "connects-answered-by-their-deadline",
                    format!("p{slot}'s connect to p{target} is unanswered past its deadline"),
                ),
                Err(TryRecvError::Disconnected) => self.violation(
                    "connects-answered-by-their-deadline",
                    format!("p{slot}'s connect to p{target} was dropped unanswered"),
                ),
            }
        }
        self.nodes[slot].opens = still;
    }

    fn pair_ready(&mut self, slot: usize, view: &EndpointView) {
        let Some(&target) = self.slot_of_incarnation.get(&view.key.peer) else {
            return;
        };
        if self.nodes[target].incarnation != view.key.peer {
            return;
        }
        let pair = (slot, target);
        if self.ever_ready.insert(pair)
            && self.ever_ready.len() == self.pairs
            && self.report.all_connected_after.is_none()
        {
            self.report.all_connected_after = Some(Duration::from_micros(self.now));
        }
        if self.converging.remove(&pair) && self.converging.is_empty() {
            if let Some(restarted) = self.restarted_at {
                self.report.converged_after_restart =
                    Some(Duration::from_micros(self.now - restarted));
            }
        }
    }

    /// Some process's endpoint to `peer` opened its circuit: if `peer` is stopped, how long
    /// that took.
    fn detected(&mut self, peer: Incarnation) {
        if let Some(&since) = self.stopped_since.get(&peer) {
            let took = Duration::from_micros(self.now - since);
            let longest = self.report.max_stop_detection.get_or_insert(took);
            *longest = (*longest).max(took);
        }
    }

    // ---- faults ----

    fn fault(&mut self, index: usize) {
        let fault = self.faults[index].clone();
        let now = self.now;
        self.trace.event(now, 0, "fault", &[index as u64], || {
            format!("{:?}", fault.kind)
        });
        match fault.kind {
            FaultKind::Kill {
                peer,
                restart_after,
            } => {
                if peer >= self.nodes.len() || !self.nodes[peer].up {
                    return;
                }
                self.kill(peer);
                let at = self.now + micros(restart_after);
                self.at(at, Happening::Restart { slot: peer });
            }
            FaultKind::Stop { peer, duration } => {
                if peer >= self.nodes.len() || !self.nodes[peer].up || self.nodes[peer].stopped {
                    return;
                }
                let node = &mut self.nodes[peer];
                node.stopped = true;
                let (incarnation, generation) = (node.incarnation, node.generation);
                self.stopped_since.insert(incarnation, self.now);
                let policy = &self.config.policy;
                let bound = policy.liveness_timeout
                    + policy.keepalive_interval
                    + self.config.tick * 2
                    + self.config.net.latency_max * 2;
                if bound < duration {
                    let at = self.now + micros(bound);
                    self.at(
                        at,
                        Happening::StopBound {
                            slot: peer,
                            incarnation,
                        },
                    );
                }
                let at = self.now + micros(duration);
                self.at(
                    at,
                    Happening::Resume {
                        slot: peer,
                        generation,
                    },
                );
                self.call_services(|service, view| service.process_changed(peer, view));
            }
            FaultKind::Partition { peers, duration } => {
                let side: BTreeSet<usize> = peers.into_iter().collect();
                let heals = self.now + micros(duration);
                self.partitions.retain(|(_, heals)| *heals > now);
                self.partitions.push((side, heals));
            }
            FaultKind::LeaseLoss { peer, duration } => {
                if peer >= self.nodes.len() || !self.nodes[peer].up {
                    return;
                }
                let incarnation = self.nodes[peer].incarnation;
                let name = self.nodes[peer].name.clone();
                self.tell_directory(peer, &name, PeerChange::Gone { incarnation });
                let at = self.now + micros(duration);
                self.at(
                    at,
                    Happening::LeaseBack {
                        slot: peer,
                        incarnation,
                    },
                );
            }
        }
    }

    /// The directory tells every live process but `about` that `name` changed.
    fn tell_directory(&mut self, about: usize, name: &str, change: PeerChange) {
        let instant = self.instant();
        for slot in 0..self.nodes.len() {
            let node = &mut self.nodes[slot];
            if slot == about || !node.up || node.stopped {
                continue;
            }
            node.core.peer_changed(name, change.clone(), instant);
            self.pump(slot);
        }
    }

    fn kill(&mut self, slot: usize) {
        let generation = self.nodes[slot].generation;
        self.nodes[slot].up = false;
        let incarnation = self.nodes[slot].incarnation;
        self.stopped_since.remove(&incarnation);
        let mine: Vec<End> = self
            .links
            .keys()
            .filter(|end| end.0 == slot && end.1 == generation)
            .copied()
            .collect();
        for end in mine {
            self.hang_up(end);
        }
        self.requests
            .retain(|_, request| request.node != (slot, generation));
        self.call_services(|service, view| service.process_changed(slot, view));
    }

    fn restart(&mut self, slot: usize) {
        let generation = self.nodes[slot].generation + 1;
        let targets = self.nodes[slot].targets.clone();
        let now = self.now;
        self.trace
            .event(now, slot, "restart", &[u64::from(generation)], String::new);
        let old = self.nodes[slot].incarnation;
        let node = self.spawn(slot, generation, targets);
        let (new, addr, name) = (node.incarnation, node.addr, node.name.clone());
        self.nodes[slot] = node;
        self.start(slot);
        if self.config.directory {
            // The newcomer claims its name: the directory's watchers hear of it at once.
            self.tell_directory(slot, &name, PeerChange::Restarted { old, new, addr });
        }
        self.restarted_at.get_or_insert(now);
        for &target in &self.nodes[slot].targets {
            self.converging.insert((slot, target));
        }
        for other in 0..self.nodes.len() {
            if other != slot && self.nodes[other].targets.contains(&slot) {
                self.converging.insert((other, slot));
            }
        }
        self.call_services(|service, view| service.process_changed(slot, view));
    }

    fn check_stop_detected(&mut self, slot: usize, incarnation: Incarnation) {
        if self.nodes[slot].incarnation != incarnation || !self.nodes[slot].stopped {
            return;
        }
        let mut undetected = Vec::new();
        for (other, node) in self.nodes.iter().enumerate() {
            if other == slot || !node.up || node.stopped || self.cut(other, slot).is_some() {
                continue;
            }
            for view in node.uses.values() {
                if view.key.peer == incarnation && view.phase() == Phase::Ready {
                    undetected.push(other);
                }
            }
        }
        for other in undetected {
            self.violation(
                "stopped-peers-detected-in-time",
                format!("p{other} still holds a ready endpoint to stopped p{slot}"),
            );
        }
    }

    fn sample(&mut self) {
        let mut over = Vec::new();
        let mut capped = Vec::new();
        for (slot, node) in self.nodes.iter().enumerate() {
            if !node.up {
                continue;
            }
            let endpoints = node.core.endpoint_count();
            self.report.peak_endpoints_per_rail =
                self.report.peak_endpoints_per_rail.max(endpoints);
            let queue_pairs = node.core.queue_pairs_on(0);
            self.report.peak_queue_pairs_per_rail =
                self.report.peak_queue_pairs_per_rail.max(queue_pairs);
            if queue_pairs > self.config.policy.max_endpoints_per_rail {
                capped.push((slot, queue_pairs));
            }
            let per_peer = node.core.footprint() / node.core.known_peers().max(1);
            self.report.control_state_bytes_per_peer =
                self.report.control_state_bytes_per_peer.max(per_peer);
            if per_peer > self.config.max_state_per_peer {
                over.push((slot, per_peer));
            }
        }
        for (slot, queue_pairs) in capped {
            self.violation(
                "queue-pairs-within-the-cap",
                format!("p{slot} holds {queue_pairs} queue pairs on rail 0"),
            );
        }
        for (slot, per_peer) in over {
            self.violation(
                "control-state-per-peer-bounded",
                format!("p{slot} holds {per_peer} bytes per known peer"),
            );
        }
    }

    fn finish(mut self, wall: Instant) -> SimReport {
        self.sample();
        let mut services = Vec::new();
        let names: Vec<&'static str> = self.config.services.iter().map(|f| f.name).collect();
        for (index, name) in names.into_iter().enumerate() {
            self.call_service(index, &mut |service, view| {
                services.push(ServiceReport {
                    name,
                    figures: service.finish(view),
                });
            });
        }
        self.report.services = services;
        let mut overdue: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, request)| request.deadline < self.now)
            .map(|(&id, _)| id)
            .collect();
        overdue.sort_unstable();
        for request in overdue {
            self.violation(
                "requests-resolve-by-their-deadline",
                format!("request {request} unresolved past its deadline"),
            );
        }
        let stormy: Vec<((usize, usize), u64)> = self
            .reconnects
            .iter()
            .filter(|(_, count)| **count > self.config.max_reconnects_per_pair)
            .map(|(&pair, &count)| (pair, count))
            .collect();
        for ((from, to), count) in stormy {
            self.violation(
                "no-reconnect-storm",
                format!("p{from} reconnected to p{to} {count} times"),
            );
        }
        let pairs = self.ever_ready.len().max(1) as f64;
        self.report.max_reconnects_per_pair = self.reconnects.values().copied().max().unwrap_or(0);
        self.report.mean_reconnects_per_pair = self.reconnects.values().sum::<u64>() as f64 / pairs;
        let seconds = self.config.duration.as_secs_f64().max(1e-9);
        self.report.handshakes_per_sec = self.report.handshakes as f64 / seconds;
        self.report.control_wire_bytes_per_peer =
            self.wire_bytes / (self.config.peers.max(1) as u64);
        self.report.simulated = Duration::from_micros(self.now);
        self.report.trace_hash = self.trace.hash();
        self.report.trace = self.trace.take_lines();
        self.report.wall = wall.elapsed();
        self.report
    }
}

impl Host for World {
    fn elapsed(&self) -> Duration {
        Duration::from_micros(self.now)
    }

    fn instant_now(&self) -> Instant {
        self.instant()
    }

    fn latency_range(&self) -> (Duration, Duration) {
        (self.config.net.latency_min, self.config.net.latency_max)
    }

    fn connection_loss(&self) -> f64 {
        self.config.net.loss
    }

    fn process_count(&self) -> usize {
        self.nodes.len()
    }

    fn process_view(&self, slot: usize) -> ProcessView {
        let node = &self.nodes[slot];
        ProcessView {
            incarnation: node.incarnation.0,
            up: node.up,
            stopped: node.stopped,
        }
    }

    fn partitioned(&self, a: usize, b: usize) -> bool {
        self.cut(a, b).is_some()
    }

    fn wake_service(&mut self, service: usize, delay: Duration, token: u64) {
        let at = self.now + micros(delay);
        self.at(at, Happening::Service { service, token });
    }

    fn trace_event(
        &mut self,
        slot: usize,
        what: &'static str,
        fields: &[u64],
        line: Box<dyn FnOnce() -> String + '_>,
    ) {
        let now = self.now;
        self.trace.event(now, slot, what, fields, line);
    }

    fn report_violation(&mut self, invariant: &'static str, detail: String) {
        self.violation(invariant, detail);
    }
}

/// `fanout` distinct processes among the first `peers`, other than `slot`, drawn from `rng`
/// (all of them if fewer).
fn choose_targets(rng: &mut SplitMix64, slot: usize, peers: usize, fanout: usize) -> Vec<usize> {
    let others = peers - usize::from(slot < peers);
    if fanout >= others {
        return (0..peers).filter(|&other| other != slot).collect();
    }
    let mut chosen = BTreeSet::new();
    while chosen.len() < fanout {
        let other = rng.below(peers as u64) as usize;
        if other != slot {
            chosen.insert(other);
        }
    }
    chosen.into_iter().collect()
}
