//! The store's master in the deterministic simulation (`railyard sim`): the real
//! [`MasterCore`] (placement, leases, eviction, members' liveness, fences, the journal and
//! rebuilding from it) run on the control plane's simulated clock, against the same
//! processes and the same faults, in the same trace.
//!
//! Every simulated process (the first [`StoreSimConfig::clients`]) is also a store client:
//! it mounts a segment of its memory, puts
//! values (placed by the master, written replica by replica, then put-end) and gets them
//! back (a lease from the master, then a read of one replica). Two master processes
//! stand for election through a modelled etcd: one leads under a lease it renews, its
//! journal is committed under its term, and the other takes over (rebuilding from the
//! journal) when the leader is killed or stopped. The memory of each process is modelled
//! byte range by byte range, so a read sees exactly which write last landed there.
//!
//! What the model does on the master's behalf follows what `server.rs`, `failover.rs` and
//! the client do: a master answers only while its last renewal is within three quarters
//! of its lease, and a journal commit succeeds only under the current term; a writer
//! submits nothing past its ticket's expiry; its engine lets no write land after the
//! write's deadline or after it reported the write failed — but for a few it never
//! resolves, which may land later until their owner fences the writer — and writes waiting
//! in a stopped or stalled writer's poller land when it runs again, after their put may
//! have been abandoned and in another term (the zombies an owner's fence must stop); a
//! replica in the writer's own segment is a plain copy, done at once; an owner told to
//! fence a writer drops every write of it submitted before the fence; a killed process's
//! writes die with it.
//!
//! Each client's connection to the master is a TCP connection: in order, and a lost
//! message resets it. The master then sees it end after what was sent before (a client
//! stays connected while a newer connection of its is open) and drops what was still
//! queued on it; the client leaves it and attaches again, and the call the reset cut off
//! is made once more (a call cut off twice fails). A master's request to fence goes on
//! the owner's connection to it, and is lost with it (the master asks again). A client
//! that attaches — to a new
//! leader, or after a reset — submits nothing placed through the connection it left,
//! starts nothing until its writes in flight resolve, and then says it is quiesced if its
//! `InFlight` (the real client's bookkeeping) says nothing it placed can land.
//!
//! Checked at every step:
//!
//! | invariant | checked when |
//! |---|---|
//! | a read that ends within its lease sees the bytes of the object it read, never another's (leases hold against eviction and removal; an abandoned write's space is reused only once its writer is fenced, across terms too) | every read |
//! | no replica is placed on, and no reader pointed at, a member dead or stopped longer than the silence bound | every ticket and lease the master hands out |
//! | a master answers only while no later term has been elected (no split brain) | every answer |

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use railyard_engine::control::sim::{ServiceFactory, ServiceWorld, SimService};
use railyard_engine::dataplane::rng::{KeyedHasher, SplitMix64};
use railyard_engine::dataplane::sabotage::{self, Protection};

use crate::client::{InFlight, RESOLVE_GRACE};
use crate::config::{MasterPolicy, ReplicaConfig};
use crate::error::StoreError;
use crate::master::{
    ClientId, FenceId, JournalEntry, MasterAction, MasterCore, ObjectLease, ObjectRecord, PutId,
    ReplicaDescriptor, SegmentId, SegmentRecord, SegmentSpec, Snapshot,
};

/// What the store does in a simulated run.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreSimConfig {
    /// Master processes standing for election.
    pub masters: usize,
    /// How many processes (the first ones) are store clients. A new master holds a fence
    /// per earlier writer and segment until they are done, so the store's cost grows with
    /// the square of its clients: by default a thousand are, however many processes run.
    pub clients: usize,
    /// The leader's lease in the modelled etcd.
    pub leader_lease: Duration,
    /// Each client starts a put or a get this often (one at a time).
    pub op_interval: Duration,
    /// How long a client waits for an answer before it gives up, and its transfers'
    /// deadline (the engine resolves each by then: none lands later).
    pub op_timeout: Duration,
    /// Bytes per value.
    pub value_size: u64,
    /// Bytes each process contributes.
    pub segment_size: u64,
    /// Replicas per value.
    pub replicas: usize,
    /// Probability that a write takes up to twice the put timeout.
    pub slow_writes: f64,
    /// Probability that a write never resolves: its writer's engine reports nothing by
    /// its deadline, and it lands up to twice the put timeout later unless fenced.
    pub unresolved_writes: f64,
    /// When (a share of the run) the leading master is killed; it restarts a lease later.
    pub kill_leader_at: Option<f64>,
    /// When (a share of the run) the leading master is stopped, for two leases.
    pub stop_leader_at: Option<f64>,
    /// Writers (drawn with replacement: up to this many) whose poller stalls (descheduled,
    /// swapped out) across each fault of the leader, from just before it until a new
    /// leader has taken over: their writes wait in the poller, then land, long after their
    /// put timed out and in another term — the zombie writes a new master must fence
    /// before it reuses their space.
    pub stalled_writers: usize,
    /// The masters' policy.
    pub policy: MasterPolicy,
}

impl Default for StoreSimConfig {
    fn default() -> Self {
        Self {
            masters: 2,
            clients: 1000,
            leader_lease: Duration::from_secs(1),
            op_interval: Duration::from_millis(200),
            op_timeout: Duration::from_secs(4),
            value_size: 4096,
            segment_size: 64 << 10,
            replicas: 2,
            slow_writes: 0.01,
            unresolved_writes: 0.002,
            kill_leader_at: Some(0.3),
            stop_leader_at: Some(0.65),
            stalled_writers: 16,
            policy: MasterPolicy {
                lease_ttl: Duration::from_secs(1),
                put_timeout: Duration::from_secs(1),
                member_silence: Duration::from_millis(1500),
                suspect_grace: Duration::from_secs(3),
                ..MasterPolicy::default()
            },
        }
    }
}

impl StoreSimConfig {
    /// This store as a service of the control plane's simulation.
    pub fn service(self) -> ServiceFactory {
        ServiceFactory::new("store", move |seed, duration| {
            Box::new(StoreSim::new(self.clone(), seed, duration))
        })
    }
}

/// A client's pings keep it heard this often (the client's keepalive).
const PING_INTERVAL: Duration = crate::protocol::KEEPALIVE;

/// How often a master looks at its lease, the core's timers and its actions.
const MASTER_TICK: Duration = Duration::from_millis(50);

/// How long before a fault of the leader the stalled writers' pollers stall: long enough
/// for each to have started a put through the old leader.
const STALL_LEAD: Duration = Duration::from_millis(300);

/// How long past the leader's lease the stalled writers' pollers stay stalled, at least: a
/// new leader has taken over by then.
const STALL_PAST_LEASE_MIN: Duration = Duration::from_millis(500);

/// And at most this much longer: past when the new leader asks the owners to fence
/// (its silence bound after taking over), and still within the writes' deadline.
const STALL_PAST_LEASE_SPREAD: Duration = Duration::from_millis(1800);

/// Keys kept for gets, per client.
const RECENT_KEYS_PER_CLIENT: usize = 4;

/// How often something held (by a partition or a stopped process) is looked at again.
const RECHECK: Duration = Duration::from_millis(50);

/// A client process as the store knows it: its slot and its incarnation there.
type Caller = (usize, u64);

/// A request to the master.
#[derive(Clone, Debug)]
enum Ask {
    Mount(SegmentSpec),
    Ping,
    PutStart {
        key: String,
    },
    PutEnd {
        key: String,
        put: PutId,
    },
    PutRevoke {
        key: String,
        put: PutId,
    },
    Get {
        key: String,
    },
    Fenced {
        fence: FenceId,
    },
    Quiesced,
    /// The client's connection ended (its process died, or a lost message reset it).
    Disconnected,
}

/// A master's answer.
#[derive(Debug)]
enum Answer {
    Mounted(Result<SegmentId, StoreError>),
    Ticket(Result<crate::master::PutTicket, StoreError>),
    Lease(Result<ObjectLease, StoreError>),
    Done(Result<(), StoreError>),
    Refused,
}

/// Something scheduled, by its wake-up token.
#[derive(Debug)]
enum Event {
    ClientTick {
        client: Caller,
    },
    MasterTick {
        master: usize,
        generation: u32,
    },
    AtMaster {
        master: usize,
        generation: u32,
        from: Caller,
        /// The connection it came on.
        link: u64,
        op: Option<u64>,
        ask: Ask,
    },
    AtClient {
        client: Caller,
        /// The connection it comes on.
        link: u64,
        op: u64,
        answer: Answer,
    },
    WriteArrives {
        write: u64,
    },
    WriteAcked {
        client: Caller,
        op: u64,
        ok: bool,
    },
    ReadArrives {
        holder: Caller,
        reader: Caller,
        op: u64,
        addr: u64,
        len: u64,
    },
    ReadReturns {
        reader: Caller,
        op: u64,
        content: Option<u64>,
    },
    FenceArrives {
        owner: Caller,
        /// The connection it comes on.
        link: u64,
        fence: FenceId,
        writer: ClientId,
    },
    OpTimeout {
        op: u64,
    },
    KillLeader,
    StopLeader,
    StallWriters,
    MasterRestart {
        master: usize,
    },
    MasterResume {
        master: usize,
        generation: u32,
    },
}

/// A master process.
struct Master {
    generation: u32,
    up: bool,
    stopped: bool,
    /// What reached it while stopped, in order.
    inbox: Vec<Event>,
    /// Each client's newest connection to it, by incarnation: an older one closing
    /// leaves the client connected (the server's last-connection rule).
    links: BTreeMap<u64, u64>,
    /// Each client's newest connection that ended: what still arrives on it is dropped
    /// (the server drops a closed connection's queued requests).
    closed: BTreeMap<u64, u64>,
    leading: Option<Leading>,
}

/// A master's term as leader.
struct Leading {
    core: MasterCore,
    term: u64,
    /// When it took over.
    since: Duration,
    /// Its last lease renewal.
    renewed: Duration,
}

/// The modelled etcd: the leader's key under a lease, and the journal.
#[derive(Default)]
struct Etcd {
    /// (master, its generation, term).
    leader: Option<(usize, u32, u64)>,
    lease_until: Duration,
    revision: u64,
    segments: BTreeMap<SegmentId, SegmentRecord>,
    objects: BTreeMap<String, ObjectRecord>,
    writers: BTreeMap<ClientId, u64>,
}

impl Etcd {
    fn leader_now(&self, now: Duration) -> Option<(usize, u32, u64)> {
        self.leader.filter(|_| now < self.lease_until)
    }

    /// Applies `entries` if `term` still holds the leader's key (the transaction's
    /// compare); `false` if it does not.
    fn commit(&mut self, term: u64, now: Duration, entries: Vec<JournalEntry>) -> bool {
        if self.leader_now(now).map(|(_, _, t)| t) != Some(term)
            && !sabotage::is_off(Protection::StoreLeaderFencing)
        {
            return false;
        }
        for entry in entries {
            match entry {
                JournalEntry::Segment { id, record } => match record {
                    Some(record) => drop(self.segments.insert(id, record)),
                    None => drop(self.segments.remove(&id)),
                },
                JournalEntry::Object { key, record } => match record {
                    Some(record) => drop(self.objects.insert(key, record)),
                    None => drop(self.objects.remove(&key)),
                },
                JournalEntry::Writer { client, term } => drop(self.writers.insert(client, term)),
                JournalEntry::ForgetWriter { client, term } => {
                    if self.writers.get(&client) == Some(&term) {
                        self.writers.remove(&client);
                    }
                }
            }
        }
        true
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            segments: self.segments.iter().map(|(k, v)| (*k, v.clone())).collect(),
            objects: self
                .objects
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            writers: self.writers.iter().map(|(k, v)| (*k, *v)).collect(),
        }
    }
}

/// A client process (its current incarnation in its slot).
#[derive(Default)]
struct Client {
    incarnation: u64,
    segment: Option<SegmentId>,
    mounting: bool,
    /// The term it is attached to (`None`: its connection reset, it attaches again).
    attached: Option<u64>,
    /// The master (and its generation) its connection goes to.
    master: Option<(usize, u32)>,
    /// Its writes in flight and its connection to the master (the client's own
    /// bookkeeping, whose generation numbers the connection): a new connection each time
    /// it attaches.
    in_flight: InFlight,
    /// Attaching: it starts nothing until its writes resolve or this deadline passes,
    /// then tells the master it is quiesced if nothing of it can land (the client's
    /// `attach_again`).
    resolving_until: Option<Duration>,
    /// When it last attached.
    attached_at: Duration,
    /// Calls to make once attached: those a reset cut off (made again once, as the
    /// client's `call` does), and those made while attaching.
    deferred: VecDeque<Deferred>,
    /// Operations already sent again once.
    resent: Vec<u64>,
    /// When its last message to the master arrives, and its master's last to it: a TCP
    /// connection delivers in order.
    to_master_at: Duration,
    from_master_at: Duration,
    /// Its memory: the write that last landed at each byte range, by first byte.
    memory: BTreeMap<u64, (u64, u64)>,
    /// Writers it fenced, and when: their writes submitted before then never land.
    revoked: BTreeMap<ClientId, Duration>,
    next_key: u64,
    /// Its one operation in flight.
    busy: Option<u64>,
    /// Its poller is stalled until then: its writes wait, and it reports nothing.
    stalled_until: Duration,
}

/// A call a client makes once attached.
struct Deferred {
    /// Its operation, if it has one.
    op: Option<u64>,
    ask: Ask,
    /// Made again after a reset cut it off: cut off again, it fails.
    again: bool,
}

/// A write on its way to a replica.
struct Write {
    writer: Caller,
    owner: Caller,
    op: u64,
    submitted: Duration,
    /// Its transfer's deadline: the writer's engine never lets it land later.
    deadline: Duration,
    addr: u64,
    len: u64,
    value: u64,
    /// Stopped by its writer's report before it landed.
    cancelled: bool,
    /// Its writer's engine never resolves it: no report by its deadline, and it may land
    /// later, until its owner fences the writer.
    unresolved: bool,
    /// Still counted in its writer's writes in flight.
    counted: bool,
}

/// A client's operation in flight.
#[derive(Debug)]
enum Op {
    Mount,
    PutStart {
        key: String,
        sent: Duration,
    },
    Writing {
        key: String,
        put: PutId,
        left: usize,
        failed: bool,
        writes: Vec<u64>,
        /// The connection its ticket came on.
        link: u64,
    },
    PutEnd {
        key: String,
        put: PutId,
    },
    Get {
        key: String,
    },
    Reading {
        key: String,
        lease_until: Duration,
    },
}

/// What a run counted.
#[derive(Default)]
struct Counts {
    puts: u64,
    puts_completed: u64,
    puts_failed: u64,
    gets: u64,
    reads_verified: u64,
    reads_after_lease: u64,
    misses: u64,
    timeouts: u64,
    refused: u64,
    connection_resets: u64,
    deferred_calls: u64,
    quiesced: u64,
    quiesced_after_waiting: u64,
    unresolved_writes: u64,
    unresolved_writes_landed: u64,
    terms: u64,
    commits_refused: u64,
    fences: u64,
    fences_lost: u64,
    writes_dropped_by_fence: u64,
    no_leader: u64,
    longest_without_leader: Duration,
}

/// The store's part of one simulated run.
struct StoreSim {
    config: StoreSimConfig,
    seed: u64,
    duration: Duration,
    rng: SplitMix64,
    etcd: Etcd,
    masters: Vec<Master>,
    clients: Vec<Client>,
    events: BTreeMap<u64, Event>,
    next_token: u64,
    ops: BTreeMap<u64, (Caller, Op)>,
    next_op: u64,
    writes: BTreeMap<u64, Write>,
    next_write: u64,
    /// The latest keys whose put-end was answered (what gets ask for: older ones are
    /// mostly evicted).
    committed: VecDeque<String>,
    /// Since when each incarnation has been dead or stopped.
    silent_since: BTreeMap<u64, Duration>,
    /// The latest term whose leader heard each incarnation.
    heard_in: BTreeMap<u64, u64>,
    /// Since when no master leads.
    leaderless_since: Option<Duration>,
    counts: Counts,
}

/// The value a key's bytes hold (never 0).
fn value_of(key: &str) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for byte in key.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash | 1
}

fn slot_of(addr: &str) -> Option<usize> {
    addr.strip_prefix('p')?.parse().ok()
}

impl StoreSim {
    fn new(config: StoreSimConfig, seed: u64, duration: Duration) -> Self {
        let masters = (0..config.masters.max(1))
            .map(|_| Master {
                generation: 0,
                up: true,
                stopped: false,
                inbox: Vec::new(),
                links: BTreeMap::new(),
                closed: BTreeMap::new(),
                leading: None,
            })
            .collect();
        Self {
            config,
            seed,
            duration,
            rng: SplitMix64::new(seed ^ 0x5707e_u64),
            etcd: Etcd::default(),
            masters,
            clients: Vec::new(),
            events: BTreeMap::new(),
            next_token: 0,
            ops: BTreeMap::new(),
            next_op: 0,
            writes: BTreeMap::new(),
            next_write: 0,
            committed: VecDeque::new(),
            silent_since: BTreeMap::new(),
            heard_in: BTreeMap::new(),
            leaderless_since: Some(Duration::ZERO),
            counts: Counts::default(),
        }
    }

    fn schedule(&mut self, world: &mut ServiceWorld<'_>, delay: Duration, event: Event) {
        let token = self.next_token;
        self.next_token += 1;
        self.events.insert(token, event);
        world.wake_after(delay, token);
    }

    /// A one-way network latency, drawn as the control path's are.
    fn latency(&mut self, world: &ServiceWorld<'_>) -> Duration {
        let (shortest, longest) = world.latency_range();
        let spread = longest.saturating_sub(shortest).as_micros() as u64;
        shortest + Duration::from_micros(self.rng.below(spread + 1))
    }

    fn chance(&mut self, probability: f64) -> bool {
        probability > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < probability
    }

    /// Whether `client` is the process now in its slot and not killed.
    fn alive(world: &ServiceWorld<'_>, client: Caller) -> bool {
        let process = world.process(client.0);
        process.incarnation == client.1 && process.up
    }

    fn start_client(&mut self, slot: usize, world: &mut ServiceWorld<'_>) {
        let incarnation = world.process(slot).incarnation;
        self.clients[slot] = Client {
            incarnation,
            ..Client::default()
        };
        let phase = Duration::from_micros(
            self.rng
                .below(self.config.op_interval.as_micros() as u64 + 1),
        );
        self.schedule(
            world,
            phase,
            Event::ClientTick {
                client: (slot, incarnation),
            },
        );
    }

    fn leader(&self, world: &ServiceWorld<'_>) -> Option<(usize, u32, u64)> {
        self.etcd.leader_now(world.now())
    }

    /// Sends `ask` from `from` as operation `op` on its current connection: to the master
    /// it attached to (the leader, before it attached). A lost message resets the
    /// connection.
    fn ask(&mut self, world: &mut ServiceWorld<'_>, from: Caller, op: Option<u64>, ask: Ask) {
        self.send(
            world,
            from,
            Deferred {
                op,
                ask,
                again: false,
            },
        );
    }

    /// [`Self::ask`], for a call that may be made again once already.
    fn send(&mut self, world: &mut ServiceWorld<'_>, from: Caller, call: Deferred) {
        let Deferred { op, ask, again } = call;
        let attached_to = self.clients[from.0].master;
        let Some((master, generation)) = attached_to.or_else(|| {
            self.leader(world)
                .map(|(master, generation, _)| (master, generation))
        }) else {
            self.counts.no_leader += 1;
            if let Some(op) = op {
                self.end_op(op);
            }
            return;
        };
        if self.chance(world.connection_loss()) {
            // A call is made again once (one with an operation fails when cut off twice,
            // see `retry`); pings and Quiesced are the attaching's own.
            let retry = !matches!(ask, Ask::Ping | Ask::Quiesced | Ask::Disconnected)
                && (op.is_some() || !again);
            return self.connection_lost(world, master, from, retry.then_some((op, ask)));
        }
        let link = self.clients[from.0].in_flight.generation();
        let delay = self.in_order(world, from.0, true);
        self.schedule(
            world,
            delay,
            Event::AtMaster {
                master,
                generation,
                from,
                link,
                op,
                ask,
            },
        );
    }

    /// A call: made now when `client` is attached, or once it is (the client's calls wait
    /// while it attaches).
    fn call(&mut self, world: &mut ServiceWorld<'_>, client: Caller, op: Option<u64>, ask: Ask) {
        let me = &mut self.clients[client.0];
        if me.attached.is_none() || me.resolving_until.is_some() {
            me.deferred.push_back(Deferred {
                op,
                ask,
                again: false,
            });
        } else {
            self.ask(world, client, op, ask);
        }
    }

    /// The delay of a message on `slot`'s connection to the master (`to_master`) or from
    /// it: a TCP connection delivers in order, so none arrives before one sent earlier.
    fn in_order(&mut self, world: &ServiceWorld<'_>, slot: usize, to_master: bool) -> Duration {
        let now = world.now();
        let arrives = now + self.latency(world);
        let me = &mut self.clients[slot];
        let last = if to_master {
            &mut me.to_master_at
        } else {
            &mut me.from_master_at
        };
        *last = (*last).max(arrives);
        *last - now
    }

    /// `client`'s connection to `master` lost a message, so TCP resets it: the master sees
    /// the connection end (after what was sent before), and the client leaves it. The
    /// call the lost message carried (`retry`, with its operation) is made again once it
    /// has attached again — once: a call cut off twice fails.
    fn connection_lost(
        &mut self,
        world: &mut ServiceWorld<'_>,
        master: usize,
        client: Caller,
        retry: Option<(Option<u64>, Ask)>,
    ) {
        if self.clients[client.0].incarnation != client.1 || !Self::alive(world, client) {
            return;
        }
        self.counts.connection_resets += 1;
        let link = self.clients[client.0].in_flight.generation();
        if self.clients[client.0].attached.take().is_none() {
            // No connection was open: nothing to end.
            if let Some((op, ask)) = retry {
                self.retry(client, op, ask);
            }
            return;
        }
        self.leave(client, retry);
        world.trace(client.0, "store-reset", &[master as u64, link], || {
            format!("connection #{link} to master {master} resets")
        });
        let generation = self.masters[master].generation;
        let delay = self.in_order(world, client.0, true);
        self.schedule(
            world,
            delay,
            Event::AtMaster {
                master,
                generation,
                from: client,
                link,
                op: None,
                ask: Ask::Disconnected,
            },
        );
    }

    /// Starts operation `op` for `client`, timing it out after the op timeout.
    fn begin(&mut self, world: &mut ServiceWorld<'_>, client: Caller, op: Op) -> u64 {
        let id = self.next_op;
        self.next_op += 1;
        self.ops.insert(id, (client, op));
        self.clients[client.0].busy = Some(id);
        let timeout = self.config.op_timeout;
        self.schedule(world, timeout, Event::OpTimeout { op: id });
        id
    }

    fn end_op(&mut self, op: u64) -> Option<(Caller, Op)> {
        let (client, state) = self.ops.remove(&op)?;
        if let Some(slot) = self.clients.get_mut(client.0)
            && slot.incarnation == client.1
        {
            if slot.busy == Some(op) {
                slot.busy = None;
            }
            if matches!(state, Op::Mount) {
                // Unanswered: the next tick mounts again.
                slot.mounting = false;
            }
        }
        Some((client, state))
    }

    fn client_tick(&mut self, world: &mut ServiceWorld<'_>, client: Caller) {
        if !Self::alive(world, client) || self.clients[client.0].incarnation != client.1 {
            return;
        }
        let jitter = Duration::from_micros(
            self.rng
                .below(self.config.op_interval.as_micros() as u64 / 4 + 1),
        );
        let next = self.config.op_interval.min(PING_INTERVAL) + jitter;
        self.schedule(world, next, Event::ClientTick { client });
        if world.process(client.0).stopped {
            return;
        }
        let Some((_, _, term)) = self.leader(world) else {
            self.counts.no_leader += 1;
            return;
        };
        let slot = client.0;
        if self.clients[slot].attached != Some(term) {
            self.attach(world, client, term);
        }
        if let Some(until) = self.clients[slot].resolving_until {
            let now = world.now();
            let me = &mut self.clients[slot];
            if me.in_flight.writes() > 0 && now <= until {
                return self.ask(world, client, None, Ask::Ping);
            }
            // Attached: its writes resolved, or it gave up waiting for them.
            me.resolving_until = None;
            if me.in_flight.quiesced() {
                self.counts.quiesced += 1;
                if now > me.attached_at {
                    self.counts.quiesced_after_waiting += 1;
                }
                self.ask(world, client, None, Ask::Quiesced);
            }
            // One at a time: a reset cuts this connection too, and the rest wait for the
            // next one.
            let mut calls = 0;
            while self.clients[slot].attached.is_some() {
                let Some(call) = self.clients[slot].deferred.pop_front() else {
                    break;
                };
                calls += 1;
                match call.op.map(|op| self.ops.get_mut(&op)) {
                    // Timed out meanwhile.
                    Some(None) => continue,
                    Some(Some((_, Op::PutStart { sent, .. }))) => *sent = now,
                    _ => {}
                }
                self.counts.deferred_calls += 1;
                self.send(world, client, call);
            }
            let ops = &self.ops;
            self.clients[slot].resent.retain(|op| ops.contains_key(op));
            if calls > 0 || self.clients[slot].attached.is_none() {
                return;
            }
        }
        if self.clients[slot].busy.is_some() {
            return self.ask(world, client, None, Ask::Ping);
        }
        if self.clients[slot].segment.is_none() {
            if !self.clients[slot].mounting {
                self.clients[slot].mounting = true;
                let spec = self.segment_spec(slot);
                let op = self.begin(world, client, Op::Mount);
                self.ask(world, client, Some(op), Ask::Mount(spec));
            } else {
                self.ask(world, client, None, Ask::Ping);
            }
            return;
        }
        if self.committed.is_empty() || self.rng.below(2) == 0 {
            let key = format!(
                "k{slot}.{:x}.{}",
                client.1 & 0xffff,
                self.clients[slot].next_key
            );
            self.clients[slot].next_key += 1;
            self.counts.puts += 1;
            let sent = world.now();
            let op = self.begin(
                world,
                client,
                Op::PutStart {
                    key: key.clone(),
                    sent,
                },
            );
            self.ask(world, client, Some(op), Ask::PutStart { key });
        } else {
            let index = self.rng.below(self.committed.len() as u64) as usize;
            let key = self.committed[index].clone();
            self.counts.gets += 1;
            let op = self.begin(world, client, Op::Get { key: key.clone() });
            self.ask(world, client, Some(op), Ask::Get { key });
        }
    }

    /// `client` leaves its connection to the master: nothing placed through it is submitted
    /// any more, and the calls waiting on it (`retry`, and its busy operation's) fail, to
    /// be made again once it has attached again.
    fn leave(&mut self, client: Caller, retry: Option<(Option<u64>, Ask)>) {
        self.clients[client.0].in_flight.leave();
        let waiting = self.clients[client.0].busy.and_then(|op| {
            let (_, state) = self.ops.get(&op)?;
            Some((Some(op), self.request_of(client.0, state)?))
        });
        for (op, ask) in retry.into_iter().chain(waiting) {
            self.retry(client, op, ask);
        }
    }

    /// Makes a call cut off with its connection again once attached — once: an operation
    /// whose call was cut off twice fails.
    fn retry(&mut self, client: Caller, op: Option<u64>, ask: Ask) {
        let me = &mut self.clients[client.0];
        if op.is_some() && me.deferred.iter().any(|waiting| waiting.op == op) {
            return;
        }
        if let Some(op) = op
            && me.resent.contains(&op)
        {
            if let Some((_, Op::PutStart { .. } | Op::PutEnd { .. })) = self.end_op(op) {
                self.counts.puts_failed += 1;
            }
            return;
        }
        me.resent.extend(op);
        me.deferred.push_back(Deferred {
            op,
            ask,
            again: true,
        });
    }

    /// `client` attaches to the leader of `term` on a new connection (a new leader, or its
    /// connection reset), leaving the one before. It starts nothing until what it
    /// submitted resolves (see `client_tick`).
    fn attach(&mut self, world: &mut ServiceWorld<'_>, client: Caller, term: u64) {
        if self.clients[client.0].attached.replace(term).is_some() {
            self.leave(client, None);
        }
        let leader = self.leader(world);
        let me = &mut self.clients[client.0];
        me.master = leader.map(|(master, generation, _)| (master, generation));
        me.attached_at = world.now();
        me.resolving_until = Some(world.now() + self.config.op_timeout + RESOLVE_GRACE);
    }

    fn master_tick(&mut self, world: &mut ServiceWorld<'_>, master: usize, generation: u32) {
        let node = &self.masters[master];
        if !node.up || node.generation != generation {
            return;
        }
        let stopped = node.stopped;
        self.schedule(world, MASTER_TICK, Event::MasterTick { master, generation });
        if stopped {
            return;
        }
        let now = world.now();
        if self.masters[master].leading.is_none() {
            if self.etcd.leader_now(now).is_none() {
                self.campaign(world, master);
            }
            return;
        }
        if !self.still_leads(world, master) {
            return;
        }
        // Renew the lease, then the core's timers.
        self.etcd.lease_until = now + self.config.leader_lease;
        let instant = world.instant();
        if let Some(leading) = self.masters[master].leading.as_mut() {
            leading.renewed = now;
            leading.core.tick(instant);
        }
        self.after_core(world, master);
    }

    /// Whether `master` still leads (its renewal is recent enough and its term holds the
    /// key); a master that does not steps down.
    fn still_leads(&mut self, world: &mut ServiceWorld<'_>, master: usize) -> bool {
        let now = world.now();
        let generation = self.masters[master].generation;
        let Some(leading) = self.masters[master].leading.as_ref() else {
            return false;
        };
        // `failover.rs`'s rule (its sabotage switch turns both checks off there too).
        let fencing = !sabotage::is_off(Protection::StoreLeaderFencing);
        let fresh = now.saturating_sub(leading.renewed) <= self.config.leader_lease * 3 / 4;
        let holds = self.etcd.leader_now(now) == Some((master, generation, leading.term));
        if !fencing {
            return true;
        }
        if fresh && holds {
            return true;
        }
        let term = leading.term;
        self.masters[master].leading = None;
        world.trace(0, "store-step-down", &[master as u64, term], || {
            format!("master {master} steps down from term {term}")
        });
        false
    }

    fn campaign(&mut self, world: &mut ServiceWorld<'_>, master: usize) {
        let now = world.now();
        self.etcd.revision += 1;
        let term = self.etcd.revision;
        let generation = self.masters[master].generation;
        self.etcd.leader = Some((master, generation, term));
        self.etcd.lease_until = now + self.config.leader_lease;
        let (core, report) = MasterCore::rebuild_keyed(
            self.config.policy.clone(),
            self.etcd.snapshot(),
            term,
            world.instant(),
            KeyedHasher(self.seed ^ term),
        );
        self.masters[master].leading = Some(Leading {
            core,
            term,
            since: now,
            renewed: now,
        });
        self.counts.terms += 1;
        if let Some(since) = self.leaderless_since.take()
            && term > 1
        {
            let without = now.saturating_sub(since);
            self.counts.longest_without_leader = self.counts.longest_without_leader.max(without);
        }
        world.trace(
            0,
            "store-leader",
            &[master as u64, term, report.objects as u64],
            || format!("master {master} leads term {term}: {report:?}"),
        );
    }

    /// Carries out what the leader's core asks and commits its journal; steps down if
    /// the commit is refused. Returns whether it still leads.
    fn after_core(&mut self, world: &mut ServiceWorld<'_>, master: usize) -> bool {
        let now = world.now();
        let Some(leading) = self.masters[master].leading.as_mut() else {
            return false;
        };
        let term = leading.term;
        let mut actions = Vec::new();
        while let Some(action) = leading.core.next_action() {
            actions.push(action);
        }
        let entries = leading.core.take_journal();
        if !entries.is_empty() && !self.etcd.commit(term, now, entries) {
            self.counts.commits_refused += 1;
            self.masters[master].leading = None;
            world.trace(0, "store-commit-refused", &[master as u64, term], || {
                format!("master {master}'s commit under term {term} is refused")
            });
            return false;
        }
        for action in actions {
            if let MasterAction::Fence {
                fence,
                owner,
                writer,
                ..
            } = action
            {
                let Some(slot) = self.slot_of_incarnation(owner.0) else {
                    continue;
                };
                // Written into the owner's connection to this master, if it has one: a
                // fence is sent once, and lost with its connection.
                let generation = self.masters[master].generation;
                let me = &self.clients[slot];
                if me.attached.is_none() || me.master != Some((master, generation)) {
                    self.counts.fences_lost += 1;
                    continue;
                }
                let link = me.in_flight.generation();
                if self.chance(world.connection_loss()) {
                    self.counts.fences_lost += 1;
                    self.connection_lost(world, master, (slot, owner.0), None);
                    continue;
                }
                let delay = self.in_order(world, slot, false);
                self.schedule(
                    world,
                    delay,
                    Event::FenceArrives {
                        owner: (slot, owner.0),
                        link,
                        fence,
                        writer,
                    },
                );
            }
        }
        true
    }

    fn slot_of_incarnation(&self, incarnation: u64) -> Option<usize> {
        self.clients
            .iter()
            .position(|client| client.incarnation == incarnation)
    }

    fn at_master(
        &mut self,
        world: &mut ServiceWorld<'_>,
        master: usize,
        (from, link): (Caller, u64),
        op: Option<u64>,
        ask: Ask,
    ) {
        let now = world.now();
        let instant = world.instant();
        let node = &mut self.masters[master];
        let last_connection_ends = if matches!(ask, Ask::Disconnected) {
            let closed = node.closed.entry(from.1).or_insert(link);
            *closed = (*closed).max(link);
            // A connection older than the newest ending leaves the client connected; one
            // this master never heard from was not its.
            node.links
                .get(&from.1)
                .is_some_and(|&newest| newest <= link)
        } else if node
            .closed
            .get(&from.1)
            .is_some_and(|&closed| closed >= link)
        {
            // Its connection ended: what was still queued on it is dropped.
            return;
        } else {
            let newest = node.links.entry(from.1).or_insert(link);
            *newest = (*newest).max(link);
            false
        };
        if !self.still_leads(world, master) {
            if let Some(op) = op {
                self.counts.refused += 1;
                self.reply(world, master, (from, link), op, Answer::Refused);
            }
            return;
        }
        let Some(leading) = self.masters[master].leading.as_mut() else {
            return;
        };
        let (term, since) = (leading.term, leading.since);
        let client = ClientId(from.1);
        let core = &mut leading.core;
        if last_connection_ends {
            core.disconnected(client, instant);
        } else if !matches!(ask, Ask::Disconnected) {
            core.heard(client, instant);
            self.heard_in.insert(from.1, term);
        }
        let answer = match ask {
            Ask::Mount(spec) => Some(Answer::Mounted(core.mount_segment(client, spec, instant))),
            Ask::Ping | Ask::Disconnected => None,
            Ask::PutStart { key } => {
                let config = ReplicaConfig {
                    replica_num: self.config.replicas,
                    ..ReplicaConfig::default()
                };
                Some(Answer::Ticket(core.put_start(
                    client,
                    &key,
                    self.config.value_size,
                    &config,
                    instant,
                )))
            }
            Ask::PutEnd { key, put } => {
                Some(Answer::Done(core.put_end(client, &key, put, instant)))
            }
            Ask::PutRevoke { key, put } => {
                let _ = core.put_revoke(client, &key, put);
                None
            }
            Ask::Get { key } => Some(Answer::Lease(core.get(&key, instant))),
            Ask::Fenced { fence } => {
                if core.fence_owner(fence) == Some(client) {
                    core.fenced(fence);
                }
                None
            }
            Ask::Quiesced => {
                core.quiesced(client);
                None
            }
        };
        if !self.after_core(world, master) {
            if let Some(op) = op {
                self.counts.refused += 1;
                self.reply(world, master, (from, link), op, Answer::Refused);
            }
            return;
        }
        let (Some(op), Some(answer)) = (op, answer) else {
            return;
        };
        if term < self.etcd.revision {
            world.violation(
                "store-one-leader-answers",
                format!(
                    "master {master} answered under term {term} after term {} was elected",
                    self.etcd.revision
                ),
            );
        }
        match &answer {
            Answer::Ticket(Ok(ticket)) => self.check_placement(world, now, &ticket.replicas, None),
            Answer::Lease(Ok(lease)) => {
                self.check_placement(world, now, &lease.replicas, Some((term, since)))
            }
            _ => {}
        }
        self.reply(world, master, (from, link), op, answer);
    }

    /// No replica handed out lives on a member silent (dead or stopped) for longer than
    /// the master can take to notice. Readers (`read`: the term and when it began) may also
    /// be pointed at a member this term has not heard, until its grace ends: a new master
    /// lets readers try the segments it rebuilt before their owners are heard (the engine
    /// checks the holder's incarnation), and takes a member unheard for the grace as gone.
    fn check_placement(
        &mut self,
        world: &mut ServiceWorld<'_>,
        now: Duration,
        replicas: &[ReplicaDescriptor],
        read: Option<(u64, Duration)>,
    ) {
        let bound = self.config.policy.member_silence + PING_INTERVAL + MASTER_TICK * 4;
        let grace = self.config.policy.suspect_grace + MASTER_TICK * 2;
        for replica in replicas {
            let Some(&since) = self.silent_since.get(&replica.holder.0) else {
                continue;
            };
            let unheard = |term| self.heard_in.get(&replica.holder.0) < Some(&term);
            let rebuilt_unheard =
                read.is_some_and(|(term, began)| unheard(term) && now <= began + grace);
            if now.saturating_sub(since) > bound && !rebuilt_unheard {
                world.violation(
                    "store-no-replica-on-a-silent-member",
                    format!(
                        "a replica on {} ({:x}), silent for {:?}, was handed out",
                        replica.segment_name,
                        replica.holder.0,
                        now.saturating_sub(since)
                    ),
                );
            }
        }
    }

    /// `master` answers operation `op` of `client` on connection `link`. A lost answer
    /// resets the connection, and the client asks again once attached again.
    fn reply(
        &mut self,
        world: &mut ServiceWorld<'_>,
        master: usize,
        (client, link): (Caller, u64),
        op: u64,
        answer: Answer,
    ) {
        let current = self.clients[client.0].incarnation == client.1
            && self.clients[client.0].in_flight.generation() == link;
        if current && self.chance(world.connection_loss()) {
            let retry = match self.ops.get(&op) {
                Some((_, state)) => self.request_of(client.0, state),
                None => None,
            };
            return self.connection_lost(world, master, client, retry.map(|ask| (Some(op), ask)));
        }
        let delay = self.in_order(world, client.0, false);
        self.schedule(
            world,
            delay,
            Event::AtClient {
                client,
                link,
                op,
                answer,
            },
        );
    }

    /// The call operation `state` of the client in `slot` waits on, to make again.
    fn request_of(&self, slot: usize, state: &Op) -> Option<Ask> {
        Some(match state {
            Op::Mount => Ask::Mount(self.segment_spec(slot)),
            Op::PutStart { key, .. } => Ask::PutStart { key: key.clone() },
            Op::PutEnd { key, put } => Ask::PutEnd {
                key: key.clone(),
                put: *put,
            },
            Op::Get { key } => Ask::Get { key: key.clone() },
            Op::Writing { .. } | Op::Reading { .. } => return None,
        })
    }

    /// The segment the client in `slot` mounts.
    fn segment_spec(&self, slot: usize) -> SegmentSpec {
        SegmentSpec {
            name: format!("segment-{slot}"),
            host: format!("host-{slot}"),
            handshake_addr: format!("p{slot}"),
            base: 1 << 32,
            size: self.config.segment_size,
        }
    }

    fn at_client(
        &mut self,
        world: &mut ServiceWorld<'_>,
        (client, link): (Caller, u64),
        op: u64,
        answer: Answer,
    ) {
        if !self.ops.contains_key(&op) || !Self::alive(world, client) {
            return;
        }
        if world.process(client.0).stopped {
            // Read once it runs again.
            return self.schedule(
                world,
                RECHECK,
                Event::AtClient {
                    client,
                    link,
                    op,
                    answer,
                },
            );
        }
        if self.clients[client.0].in_flight.generation() != link {
            // Its connection was reset: nothing more arrives on it.
            return;
        }
        let Some((_, state)) = self.ops.remove(&op) else {
            return;
        };
        match (state, answer) {
            (Op::Mount, Answer::Mounted(Ok(segment))) => {
                let me = &mut self.clients[client.0];
                me.segment = Some(segment);
                me.mounting = false;
                me.busy = None;
            }
            (Op::Mount, _) => {
                self.clients[client.0].mounting = false;
                self.clients[client.0].busy = None;
            }
            (Op::PutStart { key, sent }, Answer::Ticket(Ok(ticket))) => {
                let expires = sent + ticket.expires_in;
                self.write_replicas(world, (client, link), op, key, ticket, expires);
            }
            (Op::PutEnd { key, .. }, Answer::Done(Ok(()))) => {
                self.counts.puts_completed += 1;
                self.committed.push_back(key);
                if self.committed.len() > self.clients.len() * RECENT_KEYS_PER_CLIENT {
                    self.committed.pop_front();
                }
                self.clients[client.0].busy = None;
            }
            (Op::Get { key }, Answer::Lease(Ok(lease))) => {
                self.read_replica(world, client, op, key, lease);
            }
            (Op::Get { .. }, Answer::Lease(Err(_))) => {
                self.counts.misses += 1;
                self.clients[client.0].busy = None;
            }
            (Op::PutStart { .. } | Op::PutEnd { .. }, _) => {
                self.counts.puts_failed += 1;
                self.clients[client.0].busy = None;
            }
            (_, _) => self.clients[client.0].busy = None,
        }
    }

    fn write_replicas(
        &mut self,
        world: &mut ServiceWorld<'_>,
        (client, link): (Caller, u64),
        op: u64,
        key: String,
        ticket: crate::master::PutTicket,
        expires: Duration,
    ) {
        let now = world.now();
        let value = value_of(&key);
        let mut writes = Vec::new();
        let mut failed = now >= expires;
        for replica in &ticket.replicas {
            let owner = slot_of(&replica.handshake_addr).map(|slot| (slot, replica.holder.0));
            let Some(owner) = owner.filter(|&owner| Self::alive(world, owner)) else {
                failed = true;
                continue;
            };
            if failed || world.partitioned(client.0, owner.0) {
                failed = true;
                continue;
            }
            if !self.clients[client.0].in_flight.start_write(link) {
                failed = true;
                continue;
            }
            let id = self.next_write;
            self.next_write += 1;
            // A replica in its own segment is a plain copy, done now.
            let copy = owner == client;
            let unresolved = !copy && self.chance(self.config.unresolved_writes);
            self.counts.unresolved_writes += u64::from(unresolved);
            self.writes.insert(
                id,
                Write {
                    writer: client,
                    owner,
                    op,
                    submitted: now,
                    deadline: now + self.config.op_timeout,
                    addr: replica.addr,
                    len: replica.len,
                    value,
                    cancelled: false,
                    unresolved,
                    counted: true,
                },
            );
            writes.push(id);
            let mut delay = self.latency(world);
            if copy {
                delay = Duration::ZERO;
            } else if unresolved {
                // It lands after its deadline, if its owner has not fenced its writer.
                let most = self.config.policy.put_timeout.as_micros() as u64 * 2;
                delay = self.config.op_timeout + Duration::from_micros(self.rng.below(most + 1));
            } else if self.chance(self.config.slow_writes) {
                let most = self.config.policy.put_timeout.as_micros() as u64 * 2;
                delay += Duration::from_micros(self.rng.below(most + 1));
            }
            self.schedule(world, delay, Event::WriteArrives { write: id });
        }
        let left = writes.len();
        self.ops.insert(
            op,
            (
                client,
                Op::Writing {
                    key,
                    put: ticket.put,
                    left,
                    failed,
                    writes,
                    link,
                },
            ),
        );
        if left == 0 {
            self.writes_done(world, client, op);
        }
    }

    fn write_arrives(&mut self, world: &mut ServiceWorld<'_>, id: u64) {
        let Some(write) = self.writes.get(&id) else {
            return;
        };
        let now = world.now();
        if !write.cancelled
            && write.writer != write.owner
            && (now < write.deadline || write.unresolved)
            && (self.frozen(world, write.writer)
                || world.partitioned(write.writer.0, write.owner.0))
        {
            // Waits in the frozen writer's poller, or in the network until it heals.
            return self.schedule(world, RECHECK, Event::WriteArrives { write: id });
        }
        let Some(write) = self.writes.remove(&id) else {
            return;
        };
        if !Self::alive(world, write.writer) {
            // Its queue pairs went with its process.
            return;
        }
        let writer = &mut self.clients[write.writer.0];
        if writer.incarnation == write.writer.1 && write.counted {
            writer.in_flight.end_write();
        }
        if write.cancelled || (now >= write.deadline && !write.unresolved) {
            return;
        }
        let landed = Self::alive(world, write.owner)
            && self.clients[write.owner.0].incarnation == write.owner.1
            && self.clients[write.owner.0]
                .revoked
                .get(&ClientId(write.writer.1))
                .is_none_or(|&fenced| write.submitted > fenced);
        if landed {
            let memory = &mut self.clients[write.owner.0].memory;
            let end = write.addr + write.len;
            let overlapping: Vec<u64> = memory
                .range(..end)
                .filter(|(start, (len, _))| **start + *len > write.addr)
                .map(|(start, _)| *start)
                .collect();
            for start in overlapping {
                memory.remove(&start);
            }
            memory.insert(write.addr, (write.len, write.value));
        } else if Self::alive(world, write.owner) {
            self.counts.writes_dropped_by_fence += 1;
        }
        if write.unresolved {
            self.counts.unresolved_writes_landed += u64::from(landed);
            // Its writer's engine never reports it.
            return;
        }
        world.trace(
            write.owner.0,
            "store-write",
            &[write.addr, write.value, u64::from(landed)],
            || {
                format!(
                    "write of {:x} at {:#x} from p{}: {}",
                    write.value,
                    write.addr,
                    write.writer.0,
                    if landed { "landed" } else { "dropped" }
                )
            },
        );
        let delay = self.latency(world);
        self.schedule(
            world,
            delay,
            Event::WriteAcked {
                client: write.writer,
                op: write.op,
                ok: landed,
            },
        );
    }

    fn write_acked(&mut self, world: &mut ServiceWorld<'_>, client: Caller, op: u64, ok: bool) {
        if !Self::alive(world, client) {
            return;
        }
        if self.frozen(world, client) {
            // Its poller reports it once it runs.
            return self.schedule(world, RECHECK, Event::WriteAcked { client, op, ok });
        }
        let Some((_, Op::Writing { left, failed, .. })) = self.ops.get_mut(&op) else {
            return;
        };
        *left = left.saturating_sub(1);
        *failed |= !ok;
        if *left == 0 {
            self.writes_done(world, client, op);
        }
    }

    /// Every write of `op` resolved: put-end, or put-revoke if one failed.
    fn writes_done(&mut self, world: &mut ServiceWorld<'_>, client: Caller, op: u64) {
        let Some((
            _,
            Op::Writing {
                key, put, failed, ..
            },
        )) = self.ops.remove(&op)
        else {
            return;
        };
        if failed {
            self.counts.puts_failed += 1;
            self.clients[client.0].busy = None;
            return self.call(world, client, None, Ask::PutRevoke { key, put });
        }
        self.ops.insert(
            op,
            (
                client,
                Op::PutEnd {
                    key: key.clone(),
                    put,
                },
            ),
        );
        self.call(world, client, Some(op), Ask::PutEnd { key, put });
    }

    fn read_replica(
        &mut self,
        world: &mut ServiceWorld<'_>,
        client: Caller,
        op: u64,
        key: String,
        lease: ObjectLease,
    ) {
        let lease_until =
            world.now() + lease.lease_until.saturating_duration_since(world.instant());
        let usable: Vec<&ReplicaDescriptor> = lease
            .replicas
            .iter()
            .filter(|replica| {
                slot_of(&replica.handshake_addr).is_some_and(|slot| {
                    Self::alive(world, (slot, replica.holder.0))
                        && !world.partitioned(client.0, slot)
                })
            })
            .collect();
        if usable.is_empty() {
            self.counts.misses += 1;
            self.clients[client.0].busy = None;
            return;
        }
        let replica = usable[self.rng.below(usable.len() as u64) as usize];
        let Some(slot) = slot_of(&replica.handshake_addr) else {
            return;
        };
        let (holder, addr, len) = ((slot, replica.holder.0), replica.addr, replica.len);
        self.ops
            .insert(op, (client, Op::Reading { key, lease_until }));
        let delay = self.latency(world);
        self.schedule(
            world,
            delay,
            Event::ReadArrives {
                holder,
                reader: client,
                op,
                addr,
                len,
            },
        );
    }

    fn read_arrives(
        &mut self,
        world: &mut ServiceWorld<'_>,
        holder: Caller,
        reader: Caller,
        op: u64,
        addr: u64,
        len: u64,
    ) {
        let content = (Self::alive(world, holder)
            && self.clients[holder.0].incarnation == holder.1)
            .then(|| {
                match self.clients[holder.0].memory.get(&addr) {
                    Some(&(written, value)) if written == len => value,
                    // Nothing written there, or a write of another length over part of it.
                    _ => 0,
                }
            });
        let delay = self.latency(world);
        self.schedule(
            world,
            delay,
            Event::ReadReturns {
                reader,
                op,
                content,
            },
        );
    }

    fn read_returns(
        &mut self,
        world: &mut ServiceWorld<'_>,
        reader: Caller,
        op: u64,
        content: Option<u64>,
    ) {
        if !Self::alive(world, reader) {
            return;
        }
        if self.frozen(world, reader) {
            return self.schedule(
                world,
                RECHECK,
                Event::ReadReturns {
                    reader,
                    op,
                    content,
                },
            );
        }
        let Some((_, Op::Reading { key, lease_until })) = self.end_op(op) else {
            return;
        };
        let Some(content) = content else {
            self.counts.misses += 1;
            return;
        };
        if world.now() > lease_until {
            // The reader does not trust it.
            self.counts.reads_after_lease += 1;
            return;
        }
        if content == value_of(&key) {
            self.counts.reads_verified += 1;
        } else {
            world.violation(
                "store-reads-under-lease-see-their-value",
                format!(
                    "p{} read {key} within its lease and saw {content:x}, not {:x}",
                    reader.0,
                    value_of(&key)
                ),
            );
        }
    }

    fn fence_arrives(
        &mut self,
        world: &mut ServiceWorld<'_>,
        (owner, link): (Caller, u64),
        fence: FenceId,
        writer: ClientId,
    ) {
        if !Self::alive(world, owner) || self.clients[owner.0].incarnation != owner.1 {
            return;
        }
        if world.process(owner.0).stopped {
            return self.schedule(
                world,
                RECHECK,
                Event::FenceArrives {
                    owner,
                    link,
                    fence,
                    writer,
                },
            );
        }
        if self.clients[owner.0].in_flight.generation() != link {
            // Its connection was reset: the fence went with it.
            self.counts.fences_lost += 1;
            return;
        }
        let now = world.now();
        self.clients[owner.0].revoked.insert(writer, now);
        self.counts.fences += 1;
        world.trace(owner.0, "store-fence", &[fence.0, writer.0], || {
            format!("fences writer {:x} (fence #{})", writer.0, fence.0)
        });
        self.call(world, owner, None, Ask::Fenced { fence });
    }

    fn op_timeout(&mut self, world: &mut ServiceWorld<'_>, op: u64) {
        let Some((client, _)) = self.ops.get(&op) else {
            return;
        };
        let client = *client;
        if !Self::alive(world, client) {
            // Died with it.
            self.end_op(op);
            return;
        }
        if self.frozen(world, client) {
            // Its engine reports once it runs.
            return self.schedule(world, RECHECK, Event::OpTimeout { op });
        }
        self.counts.timeouts += 1;
        if let Some((
            _,
            Op::Writing {
                key,
                put,
                writes,
                link,
                ..
            },
        )) = self.end_op(op)
        {
            // The engine reports the writes failed: nothing of them moves after that —
            // except one it never resolves, which may land until its owner fences this
            // writer. Such a put is not revoked: its space waits for the master to
            // abandon it and fence the writer.
            let mut unresolved = false;
            for id in writes {
                let Some(write) = self.writes.get_mut(&id) else {
                    continue;
                };
                if write.unresolved {
                    unresolved = true;
                    write.counted = false;
                    let me = &mut self.clients[client.0];
                    me.in_flight.end_write();
                    me.in_flight.unresolved(link);
                } else {
                    write.cancelled = true;
                }
            }
            self.counts.puts_failed += 1;
            if !unresolved {
                self.call(world, client, None, Ask::PutRevoke { key, put });
            }
        }
    }

    /// Whether `client`'s poller runs nothing now: its process is stopped, or it stalls.
    fn frozen(&self, world: &ServiceWorld<'_>, client: Caller) -> bool {
        let process = world.process(client.0);
        process.incarnation == client.1
            && (process.stopped || world.now() < self.clients[client.0].stalled_until)
    }

    /// Stalls the pollers of a few running writers until a new leader has taken over:
    /// some until before the new leader asks the owners to fence earlier terms' writers
    /// (their writes meet segments still held back), some until after (their writes meet
    /// the owners' fences).
    fn stall_writers(&mut self, world: &mut ServiceWorld<'_>) {
        if self.clients.is_empty() {
            return;
        }
        for _ in 0..self.config.stalled_writers {
            let past_lease = STALL_PAST_LEASE_MIN
                + Duration::from_micros(self.rng.below(STALL_PAST_LEASE_SPREAD.as_micros() as u64));
            let until = world.now() + STALL_LEAD + self.config.leader_lease + past_lease;
            let slot = self.rng.below(self.clients.len() as u64) as usize;
            let client = (slot, self.clients[slot].incarnation);
            if Self::alive(world, client) {
                self.clients[slot].stalled_until = until;
                world.trace(slot, "store-stall", &[until.as_micros() as u64], || {
                    format!("poller stalls until {until:?}")
                });
            }
        }
    }

    fn kill_or_stop_leader(&mut self, world: &mut ServiceWorld<'_>, stop: bool) {
        let Some((master, generation, term)) = self.leader(world) else {
            return;
        };
        if self.masters[master].generation != generation {
            return;
        }
        self.leaderless_since.get_or_insert(world.now());
        world.trace(
            0,
            "store-master-fault",
            &[master as u64, term, u64::from(stop)],
            || {
                format!(
                    "master {master} (term {term}) {}",
                    if stop { "stopped" } else { "killed" }
                )
            },
        );
        let lease = self.config.leader_lease;
        if stop {
            self.masters[master].stopped = true;
            self.schedule(world, lease * 2, Event::MasterResume { master, generation });
        } else {
            let node = &mut self.masters[master];
            node.up = false;
            node.leading = None;
            node.inbox.clear();
            self.schedule(world, lease, Event::MasterRestart { master });
        }
    }

    fn handle(&mut self, world: &mut ServiceWorld<'_>, event: Event) {
        match event {
            Event::ClientTick { client } => self.client_tick(world, client),
            Event::MasterTick { master, generation } => self.master_tick(world, master, generation),
            Event::AtMaster {
                master,
                generation,
                from,
                link,
                op,
                ask,
            } => {
                let node = &mut self.masters[master];
                if !node.up || node.generation != generation {
                    return;
                }
                if node.stopped {
                    return node.inbox.push(Event::AtMaster {
                        master,
                        generation,
                        from,
                        link,
                        op,
                        ask,
                    });
                }
                self.at_master(world, master, (from, link), op, ask);
            }
            Event::AtClient {
                client,
                link,
                op,
                answer,
            } => self.at_client(world, (client, link), op, answer),
            Event::WriteArrives { write } => self.write_arrives(world, write),
            Event::WriteAcked { client, op, ok } => self.write_acked(world, client, op, ok),
            Event::ReadArrives {
                holder,
                reader,
                op,
                addr,
                len,
            } => self.read_arrives(world, holder, reader, op, addr, len),
            Event::ReadReturns {
                reader,
                op,
                content,
            } => self.read_returns(world, reader, op, content),
            Event::FenceArrives {
                owner,
                link,
                fence,
                writer,
            } => self.fence_arrives(world, (owner, link), fence, writer),
            Event::OpTimeout { op } => self.op_timeout(world, op),
            Event::KillLeader => self.kill_or_stop_leader(world, false),
            Event::StopLeader => self.kill_or_stop_leader(world, true),
            Event::StallWriters => self.stall_writers(world),
            Event::MasterRestart { master } => {
                let node = &mut self.masters[master];
                node.generation += 1;
                node.up = true;
                node.stopped = false;
                node.links.clear();
                node.closed.clear();
                let generation = node.generation;
                self.schedule(world, MASTER_TICK, Event::MasterTick { master, generation });
            }
            Event::MasterResume { master, generation } => {
                let node = &mut self.masters[master];
                if !node.up || node.generation != generation {
                    return;
                }
                node.stopped = false;
                for waiting in std::mem::take(&mut node.inbox) {
                    self.handle(world, waiting);
                }
            }
        }
    }
}

impl SimService for StoreSim {
    fn start(&mut self, world: &mut ServiceWorld<'_>) {
        let clients = world.processes().min(self.config.clients);
        self.clients = (0..clients).map(|_| Client::default()).collect();
        for slot in 0..clients {
            self.start_client(slot, world);
        }
        for master in 0..self.masters.len() {
            let phase = MASTER_TICK * master as u32 / self.masters.len() as u32;
            self.schedule(
                world,
                phase,
                Event::MasterTick {
                    master,
                    generation: 0,
                },
            );
        }
        let duration = self.duration;
        for (share, fault) in [
            (self.config.kill_leader_at, Event::KillLeader),
            (self.config.stop_leader_at, Event::StopLeader),
        ] {
            let Some(share) = share else {
                continue;
            };
            let at = duration.mul_f64(share);
            self.schedule(world, at.saturating_sub(STALL_LEAD), Event::StallWriters);
            self.schedule(world, at, fault);
        }
    }

    fn wake(&mut self, token: u64, world: &mut ServiceWorld<'_>) {
        if let Some(event) = self.events.remove(&token) {
            self.handle(world, event);
        }
    }

    fn process_changed(&mut self, slot: usize, world: &mut ServiceWorld<'_>) {
        if slot >= self.clients.len() {
            return;
        }
        let process = world.process(slot);
        let known = self.clients[slot].incarnation;
        let now = world.now();
        if known != process.incarnation || !process.up {
            // Its incarnation died: its connection to the master resets.
            self.silent_since.entry(known).or_insert(now);
            let me = &self.clients[slot];
            if let Some((master, generation)) = me.master.filter(|_| me.attached.is_some()) {
                let link = me.in_flight.generation();
                let delay = self.in_order(world, slot, true);
                self.schedule(
                    world,
                    delay,
                    Event::AtMaster {
                        master,
                        generation,
                        from: (slot, known),
                        link,
                        op: None,
                        ask: Ask::Disconnected,
                    },
                );
            }
        }
        if process.up && known != process.incarnation {
            self.start_client(slot, world);
        } else if process.up && process.stopped {
            self.silent_since.insert(process.incarnation, now);
        } else if process.up {
            self.silent_since.remove(&process.incarnation);
        }
    }

    fn finish(&mut self, _world: &mut ServiceWorld<'_>) -> Vec<(&'static str, f64)> {
        let leader = self
            .masters
            .iter()
            .find_map(|master| master.leading.as_ref());
        let counters = leader
            .map(|leading| leading.core.stats().counters)
            .unwrap_or_default();
        let counts = &self.counts;
        vec![
            ("puts", counts.puts as f64),
            ("puts_completed", counts.puts_completed as f64),
            ("puts_failed", counts.puts_failed as f64),
            ("gets", counts.gets as f64),
            ("reads_verified", counts.reads_verified as f64),
            ("reads_after_lease", counts.reads_after_lease as f64),
            ("misses", counts.misses as f64),
            ("timeouts", counts.timeouts as f64),
            ("refused", counts.refused as f64),
            ("connection_resets", counts.connection_resets as f64),
            ("deferred_calls", counts.deferred_calls as f64),
            ("quiesced", counts.quiesced as f64),
            (
                "quiesced_after_waiting",
                counts.quiesced_after_waiting as f64,
            ),
            ("unresolved_writes", counts.unresolved_writes as f64),
            (
                "unresolved_writes_landed",
                counts.unresolved_writes_landed as f64,
            ),
            ("no_leader", counts.no_leader as f64),
            ("terms", counts.terms as f64),
            ("commits_refused", counts.commits_refused as f64),
            ("fences", counts.fences as f64),
            ("fences_lost", counts.fences_lost as f64),
            (
                "writes_dropped_by_fence",
                counts.writes_dropped_by_fence as f64,
            ),
            ("evictions_last_term", counters.evictions as f64),
            ("abandoned_last_term", counters.puts_abandoned as f64),
            (
                "longest_without_leader_s",
                counts.longest_without_leader.as_secs_f64(),
            ),
        ]
    }
}
