//! The master as a service: a TCP listener whose connections are admitted by railyard's
//! handshake, one thread per client reading its requests into the core (behind a lock),
//! and a ticker that runs the core's timers and pushes its actions — fences, finished
//! unmounts — to the segments' owners.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use railyard_engine::control::session::SessionKeys;
use railyard_engine::control::{ClusterSecret, HostId, Incarnation};

use crate::committer::{Committer, JournalSink};
use crate::config::MasterPolicy;
use crate::handshake::{self, Identity};
use crate::master::{ClientId, MasterAction, MasterCore, MasterStats};
use crate::metrics::{Latencies, MetricsServer};
use crate::protocol::{
    FrameWriter, PROTOCOL_VERSION, Reply, Request, ToClient, ToMaster, WireLease, is_unauthentic,
    read_frame,
};

/// How often the ticker runs the core's timers.
const TICK: Duration = Duration::from_millis(20);
/// How long a connection may take to say Hello and prove the secret.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a write to one client may block before its connection is given up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Requests of one connection queued for its worker (a client waits for each answer, so
/// only a misbehaving one fills it: its reader then waits).
const QUEUED_REQUESTS: usize = 256;
/// Longest a request waits for its changes to be written down.
const JOURNAL_WAIT: Duration = Duration::from_secs(5);
/// How often an elected master checks it still leads.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
const LEADERSHIP_CHECK: Duration = Duration::from_millis(20);
/// How often blocked reads look up to see whether the master is stopping.
const STOP_CHECK: Duration = Duration::from_millis(100);

/// How to run a master.
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// Where to listen (port 0: any).
    pub listen: SocketAddr,
    /// Leases, watermarks, timeouts.
    pub policy: MasterPolicy,
    /// The cluster secret clients must prove, if the cluster has one.
    pub secret: Option<ClusterSecret>,
    /// The master's name in its Hello.
    pub name: String,
    /// Lead through etcd (an `etcd://` URL; feature `etcd`): wait as a standby while
    /// another master leads, rebuild from the journal when elected, and answer a change
    /// only once it is written down under this master's term. `None`: a lone master.
    pub election: Option<String>,
    /// The address the leader writes down for clients (default: where it listens).
    pub advertise: Option<String>,
}

/// A running master. Dropping it stops it (its threads end within a fraction of a second).
pub struct MasterServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    metrics: Mutex<Option<MetricsServer>>,
    /// Its place in the election (dropped last: a leader steps down when it stops).
    election: Option<Election>,
}

/// A connection's sending half, shared by its reader (replies) and the ticker (events).
type Outbox = Arc<Mutex<FrameWriter>>;

struct Shared {
    core: Mutex<MasterCore>,
    /// Each connected client's connections.
    clients: Mutex<HashMap<ClientId, Vec<Outbox>>>,
    /// Events for owners with no connection, sent when one arrives.
    undelivered: Mutex<HashMap<ClientId, Vec<ToClient>>>,
    identity: Identity,
    secret: Option<ClusterSecret>,
    addr: SocketAddr,
    stop: AtomicBool,
    latencies: Latencies,
    /// Members whose pings arrived since the last tick, and when (the ticker tells the
    /// core).
    heard: Mutex<HashMap<ClientId, Instant>>,
    /// Whether it serves: a standby refuses every connection until it leads.
    serving: AtomicBool,
    /// Where a leader's changes are written down (none for a lone master).
    committer: Option<Arc<Committer>>,
    /// Why it stopped serving for good (a leader that lost its term).
    lost: Mutex<Option<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MasterServer {
    /// Binds `config.listen` and starts serving (with an election: once elected).
    ///
    /// # Errors
    /// The address cannot be bound, or the election cannot start (a bad etcd URL, or a
    /// build without the `etcd` feature).
    pub fn start(config: MasterConfig) -> io::Result<Self> {
        let listener = TcpListener::bind(config.listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let election = match &config.election {
            Some(url) => Some(Election::start(
                url,
                config.advertise.clone().unwrap_or_else(|| addr.to_string()),
            )?),
            None => None,
        };
        let committer = election
            .as_ref()
            .map(|election| Arc::new(Committer::new(election.sink())));
        let shared = Arc::new(Shared {
            core: Mutex::new(MasterCore::new(config.policy.clone())),
            clients: Mutex::new(HashMap::new()),
            undelivered: Mutex::new(HashMap::new()),
            identity: Identity {
                name: config.name,
                incarnation: Incarnation(railyard_engine::dataplane::entropy::random_u64()),
                host: HostId::this_process(),
            },
            secret: config.secret,
            addr,
            stop: AtomicBool::new(false),
            latencies: Latencies::new(),
            heard: Mutex::new(HashMap::new()),
            serving: AtomicBool::new(election.is_none()),
            committer,
            lost: Mutex::new(None),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("store-master".into())
                .spawn(move || accept_loop(&listener, &shared))?
        };
        let ticker = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("store-master-tick".into())
                .spawn(move || {
                    while !shared.stop.load(Ordering::Relaxed) {
                        thread::sleep(TICK);
                        if !shared.serving.load(Ordering::Relaxed) {
                            continue;
                        }
                        let heard = std::mem::take(&mut *lock(&shared.heard));
                        let actions = {
                            let mut core = lock(&shared.core);
                            for (client, at) in heard {
                                core.heard(client, at);
                            }
                            core.tick(Instant::now());
                            // Written down in order; nobody waits for what a tick changed.
                            let entries = core.take_journal();
                            if let Some(committer) = &shared.committer
                                && !entries.is_empty()
                            {
                                committer.enqueue(entries);
                            }
                            drain_actions(&mut core)
                        };
                        deliver(&shared, actions);
                    }
                })?
        };
        let mut threads = vec![acceptor, ticker];
        if let Some(election) = &election {
            threads.extend(election.run(&shared, config.policy)?);
        }
        Ok(Self {
            addr,
            shared,
            threads,
            metrics: Mutex::new(None),
            election,
        })
    }

    /// Whether it serves (a standby does not, until elected).
    pub fn is_serving(&self) -> bool {
        self.shared.serving.load(Ordering::Relaxed)
    }

    /// Why it stopped serving for good, if it did: a leader that lost its term (its lease
    /// lapsed, or etcd refused its journal) serves nothing more — run a new master.
    pub fn lost(&self) -> Option<String> {
        lock(&self.shared.lost).clone()
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it holds.
    pub fn stats(&self) -> MasterStats {
        lock(&self.shared.core).stats()
    }

    /// Serves Prometheus metrics at `http://addr/metrics` (port 0: any) until the master
    /// stops; returns where.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn serve_metrics(&self, addr: SocketAddr) -> io::Result<SocketAddr> {
        let server = MetricsServer::start(
            addr,
            Arc::downgrade(&self.shared),
            |shared: &Shared| lock(&shared.core).stats(),
            |shared: &Shared| &shared.latencies,
        )?;
        let addr = server.addr();
        *lock(&self.metrics) = Some(server);
        Ok(addr)
    }
}

impl Drop for MasterServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(committer) = &self.shared.committer {
            committer.stop();
        }
        lock(&self.metrics).take();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        self.election.take();
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            // A standby (or a leader that lost its term) serves nobody: the client finds
            // the leader in etcd.
            Ok(_) if !shared.serving.load(Ordering::Relaxed) => {}
            Ok((stream, _)) => {
                let shared = Arc::clone(shared);
                let spawned = thread::Builder::new()
                    .name("store-master-conn".into())
                    .spawn(move || serve(stream, &shared));
                match spawned {
                    Ok(handle) => connections.push(handle),
                    Err(error) => {
                        tracing::warn!(%error, "store master: no thread for a connection")
                    }
                }
                connections.retain(|handle| !handle.is_finished());
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(5))
            }
            Err(error) => {
                // EMFILE and the like: wait instead of spinning.
                tracing::warn!(%error, "store master: accept failed");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
    for handle in connections {
        let _ = handle.join();
    }
}

/// Reads that wait out the stop checks' timeouts, so a frame is never cut by one.
struct Patient<'a> {
    stream: &'a TcpStream,
    stop: &'a AtomicBool,
}

impl Read for Patient<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match (&mut &*self.stream).read(buf) {
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.stop.load(Ordering::Relaxed) {
                        // Not `Interrupted`: `read_exact` retries that forever.
                        return Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "master stopping",
                        ));
                    }
                }
                other => return other,
            }
        }
    }
}

/// One client connection, from the handshake to its end.
fn serve(mut stream: TcpStream, shared: &Arc<Shared>) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let peer = stream.peer_addr().ok();
    let local = stream.local_addr().unwrap_or(shared.addr);
    let (client, keys) =
        match handshake::accept(&mut stream, local, &shared.identity, shared.secret.as_ref()) {
            Ok((identity, keys)) => (ClientId(identity.incarnation.0), keys),
            Err(reason) => {
                tracing::warn!(peer = ?peer, %reason, "store master: connection refused");
                return;
            }
        };
    let (sealer, mut opener) = keys.map(SessionKeys::split).unzip();
    let _ = stream.set_read_timeout(Some(STOP_CHECK));
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    // A client that stops reading holds up only its own frames: a write blocked this long
    // fails, and the connection goes (the ticker that pushes events never waits longer).
    let _ = writer.set_write_timeout(Some(WRITE_TIMEOUT));
    let outbox: Outbox = Arc::new(Mutex::new(FrameWriter::new(writer, sealer)));
    // Requests are handled in order by a worker of this connection; pings are answered
    // here at once, so a request waiting for its journal never makes a live client look
    // silent (nor the master look stopped to it). Once the connection ends, what is still
    // queued is dropped: the client sends it again on its next connection.
    let (requests, queue) = mpsc::sync_channel::<ToMaster>(QUEUED_REQUESTS);
    let ended = Arc::new(AtomicBool::new(false));
    let worker = {
        let (shared, outbox, ended) = (Arc::clone(shared), Arc::clone(&outbox), Arc::clone(&ended));
        thread::Builder::new()
            .name("store-master-work".into())
            .spawn(move || {
                for frame in queue {
                    if ended.load(Ordering::Relaxed) {
                        return;
                    }
                    let (reply, actions) = handle(&shared, client, frame.request);
                    let sent = lock(&outbox).write(&ToClient::Reply {
                        id: frame.id,
                        reply,
                    });
                    deliver(&shared, actions);
                    if sent.is_err() || shared.stop.load(Ordering::Relaxed) {
                        lock(&outbox).shutdown();
                        return;
                    }
                }
            })
    };
    let Ok(worker) = worker else {
        tracing::warn!(peer = ?peer, "store master: no thread for a connection's requests");
        return;
    };
    lock(&shared.clients)
        .entry(client)
        .or_default()
        .push(Arc::clone(&outbox));
    let undelivered = lock(&shared.undelivered).remove(&client);
    if let Some(events) = undelivered {
        deliver_to(shared, client, events);
    }
    let mut reader = Patient {
        stream: &stream,
        stop: &shared.stop,
    };
    loop {
        let frame: ToMaster = match read_frame(&mut reader, opener.as_mut()) {
            Ok(frame) => frame,
            Err(error) if is_unauthentic(&error) => {
                lock(&shared.core).count_auth_failure();
                tracing::warn!(
                    kind = "auth",
                    peer = ?peer,
                    %error,
                    "store master: a frame failed its authentication check; closing"
                );
                break;
            }
            Err(error) => {
                if error.kind() == io::ErrorKind::InvalidData {
                    tracing::warn!(peer = ?peer, %error, "store master: malformed frame; closing");
                }
                break;
            }
        };
        if matches!(frame.request, Request::Ping) {
            // Noted for the core's next tick: the core's lock is not this reader's to wait for.
            lock(&shared.heard).insert(client, Instant::now());
            let pong = ToClient::Reply {
                id: frame.id,
                reply: Reply::Done(Ok(())),
            };
            if lock(&outbox).write(&pong).is_err() {
                break;
            }
        } else if requests.send(frame).is_err() {
            break;
        }
        if shared.stop.load(Ordering::Relaxed) {
            break;
        }
    }
    ended.store(true, Ordering::Relaxed);
    drop(requests);
    let _ = worker.join();
    let mut clients = lock(&shared.clients);
    if let Some(outboxes) = clients.get_mut(&client) {
        outboxes.retain(|other| !Arc::ptr_eq(other, &outbox));
        if outboxes.is_empty() {
            clients.remove(&client);
            drop(clients);
            // Its last connection is gone (a killed process's reset arrives at once): its
            // segments serve nothing until it is heard again.
            let mut core = lock(&shared.core);
            core.disconnected(client, Instant::now());
            let actions = drain_actions(&mut core);
            drop(core);
            deliver(shared, actions);
        }
    }
}

/// Answers `request` from `client`; returns the reply and the core's actions.
fn handle(shared: &Shared, client: ClientId, request: Request) -> (Reply, Vec<MasterAction>) {
    let now = Instant::now();
    let kind = request.kind();
    let mut core = lock(&shared.core);
    // A master that lost its term answers nothing more, whatever was already read.
    if !shared.serving.load(Ordering::Relaxed) {
        return (
            Reply::Refused("this master does not lead; find the leader again".into()),
            Vec::new(),
        );
    }
    core.heard(client, now);
    // Opening a connection rests on nothing written (and must not wait behind a backlog).
    let rests_on_nothing = matches!(request, Request::Ping | Request::Open { .. });
    let reply = match request {
        Request::Open { version } if version == PROTOCOL_VERSION => Reply::Opened {
            version: PROTOCOL_VERSION,
            client,
        },
        Request::Open { version } => Reply::Refused(format!(
            "store protocol version {version}; this master speaks {PROTOCOL_VERSION}"
        )),
        Request::Mount(spec) => Reply::Mounted(core.mount_segment(client, spec, now)),
        Request::Unmount { segment, grace } => {
            if core.segment_owner(segment) == Some(client) {
                Reply::Done(core.unmount_segment(segment, grace, now))
            } else {
                Reply::Refused(format!("segment #{} is not this client's", segment.0))
            }
        }
        Request::PutStart {
            items,
            config,
            upsert,
            avoid,
        } => Reply::Tickets(
            items
                .iter()
                .map(|item| core.start(client, &item.key, item.size, &config, upsert, &avoid, now))
                .collect(),
        ),
        Request::PutEnd { items } => Reply::Each(
            items
                .iter()
                .map(|(key, put)| core.put_end(client, key, *put, now))
                .collect(),
        ),
        Request::PutRevoke { items } => Reply::Each(
            items
                .iter()
                .map(|(key, put)| core.put_revoke(client, key, *put))
                .collect(),
        ),
        Request::Get { keys } => Reply::Leases(
            keys.iter()
                .map(|key| {
                    core.get(key, now).map(|lease| WireLease {
                        size: lease.size,
                        replicas: lease.replicas,
                        lease: lease.lease_until.saturating_duration_since(now),
                    })
                })
                .collect(),
        ),
        Request::Exists { keys } => Reply::Exists(core.batch_exists(&keys)),
        Request::Remove { keys, force } => Reply::Each(
            keys.iter()
                .map(|key| core.remove(key, force, now))
                .collect(),
        ),
        Request::RemoveAll { force } => Reply::Removed(core.remove_all(force, now) as u64),
        Request::Keys => Reply::Keys(core.keys()),
        Request::Stats => Reply::Stats(Box::new(core.stats())),
        Request::Fenced { fence } => match core.fence_owner(fence) {
            Some(owner) if owner == client => {
                core.fenced(fence);
                Reply::Done(Ok(()))
            }
            Some(_) => Reply::Refused(format!("fence #{} is another client's", fence.0)),
            None => Reply::Done(Ok(())),
        },
        Request::Ping => Reply::Done(Ok(())),
        Request::Quiesced => {
            core.quiesced(client);
            Reply::Done(Ok(()))
        }
    };
    let actions = drain_actions(&mut core);
    let entries = core.take_journal();
    // Everything queued so far, this request's changes included: what it answers may rest
    // on any of it (space an eviction freed, an object another request completed). A ping
    // rests on nothing.
    let written = match &shared.committer {
        Some(committer) if !entries.is_empty() => Some(committer.enqueue(entries)),
        Some(committer) if !rests_on_nothing => Some(committer.latest()),
        _ => None,
    };
    drop(core);
    // An answer leaves only once what it rests on is written down: a master that takes
    // over knows it.
    let reply = match (written, &shared.committer) {
        (Some(seq), Some(committer)) => match committer.wait(seq, now + JOURNAL_WAIT) {
            Ok(()) => reply,
            Err(reason) => Reply::Refused(format!(
                "this master could not write its changes down ({reason}); find the leader again"
            )),
        },
        _ => reply,
    };
    shared.latencies.observe(kind, now.elapsed());
    (reply, actions)
}

fn drain_actions(core: &mut MasterCore) -> Vec<MasterAction> {
    std::iter::from_fn(|| core.next_action()).collect()
}

/// Sends each action to the client it is for (kept for it while it has no connection).
fn deliver(shared: &Shared, actions: Vec<MasterAction>) {
    for action in actions {
        let (owner, event) = match action {
            MasterAction::Fence {
                fence,
                segment,
                owner,
                writer,
            } => (
                owner,
                ToClient::Fence {
                    fence,
                    segment,
                    writer,
                },
            ),
            MasterAction::Unmounted { segment, owner } => (owner, ToClient::Unmounted { segment }),
            MasterAction::MemberGone { client } => {
                tracing::warn!(
                    client = client.0,
                    "store master: a member is gone; its segments and their replicas are forgotten"
                );
                lock(&shared.undelivered).remove(&client);
                continue;
            }
        };
        deliver_to(shared, owner, vec![event]);
    }
}

fn deliver_to(shared: &Shared, client: ClientId, events: Vec<ToClient>) {
    let outboxes = lock(&shared.clients)
        .get(&client)
        .cloned()
        .unwrap_or_default();
    'events: for event in events {
        for outbox in &outboxes {
            let mut writer = lock(outbox);
            if writer.write(&event).is_ok() {
                continue 'events;
            }
            // Perhaps half a frame went out: the connection is no good any more.
            writer.shutdown();
        }
        lock(&shared.undelivered)
            .entry(client)
            .or_default()
            .push(event);
    }
}

/// A master's place in an etcd election (see `failover.rs`).
#[cfg(feature = "etcd")]
struct Election(Arc<crate::failover::Leadership>);

#[cfg(feature = "etcd")]
impl JournalSink for crate::failover::Leadership {
    fn commit(&self, entries: Vec<crate::master::JournalEntry>) -> Result<(), String> {
        crate::failover::Leadership::commit(self, entries)
    }
}

#[cfg(feature = "etcd")]
impl Election {
    fn start(url: &str, advertise: String) -> io::Result<Self> {
        let etcd = crate::failover::StoreEtcd::from_url(url).map_err(io::Error::other)?;
        let leadership =
            crate::failover::Leadership::start(etcd, advertise).map_err(io::Error::other)?;
        Ok(Self(Arc::new(leadership)))
    }

    fn sink(&self) -> Arc<dyn JournalSink> {
        Arc::clone(&self.0) as Arc<dyn JournalSink>
    }

    /// The threads of a master that leads through etcd: one writes the journal down, one
    /// waits to be elected, rebuilds the core from the journal and starts serving, then
    /// stops everything once the term is lost.
    fn run(&self, shared: &Arc<Shared>, policy: MasterPolicy) -> io::Result<Vec<JoinHandle<()>>> {
        use crate::failover::Standing;
        let committer = {
            let committer = shared.committer.clone();
            thread::Builder::new()
                .name("store-journal".into())
                .spawn(move || {
                    if let Some(committer) = committer {
                        committer.run();
                    }
                })?
        };
        let leadership = Arc::clone(&self.0);
        let shared = Arc::clone(shared);
        let watcher = thread::Builder::new()
            .name("store-leadership-watch".into())
            .spawn(move || {
                let term = loop {
                    if shared.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match leadership.standing() {
                        Standing::Leading(term) => break term,
                        Standing::Lost => return lose(&shared, "it could not campaign".into()),
                        Standing::Standby => thread::sleep(LEADERSHIP_CHECK),
                    }
                };
                let snapshot = match leadership.load() {
                    Ok(snapshot) => snapshot,
                    Err(reason) => return lose(&shared, format!("reading the journal: {reason}")),
                };
                let (core, report) = MasterCore::rebuild(policy, snapshot, term, Instant::now());
                tracing::info!(
                    term,
                    segments = report.segments,
                    objects = report.objects,
                    replicas_dropped = report.replicas_dropped,
                    objects_dropped = report.objects_dropped,
                    fences = report.fences,
                    "store master: elected; rebuilt from the journal"
                );
                let actions = {
                    let mut locked = lock(&shared.core);
                    *locked = core;
                    drain_actions(&mut locked)
                };
                deliver(&shared, actions);
                shared.serving.store(true, Ordering::Relaxed);
                while !shared.stop.load(Ordering::Relaxed) {
                    if let Some(reason) = shared.committer.as_ref().and_then(|c| c.failed()) {
                        return lose(&shared, reason);
                    }
                    if leadership.standing() != Standing::Leading(term) {
                        return lose(&shared, format!("the lease of term {term} lapsed"));
                    }
                    thread::sleep(LEADERSHIP_CHECK);
                }
            })?;
        Ok(vec![committer, watcher])
    }
}

/// Without the `etcd` feature there is no election to take part in: none exists.
#[cfg(not(feature = "etcd"))]
enum Election {}

#[cfg(not(feature = "etcd"))]
impl Election {
    fn start(_url: &str, _advertise: String) -> io::Result<Self> {
        Err(io::Error::other(
            "this railyard was built without the etcd feature: no election",
        ))
    }

    fn sink(&self) -> Arc<dyn JournalSink> {
        match *self {}
    }

    fn run(&self, _shared: &Arc<Shared>, _policy: MasterPolicy) -> io::Result<Vec<JoinHandle<()>>> {
        match *self {}
    }
}

/// Stops serving for good: the term is lost.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
fn lose(shared: &Shared, reason: String) {
    tracing::error!(%reason, "store master: no longer leading; serving nothing more");
    shared.serving.store(false, Ordering::Relaxed);
    *lock(&shared.lost) = Some(reason);
    shared.stop.store(true, Ordering::Relaxed);
    if let Some(committer) = &shared.committer {
        committer.stop();
    }
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;
