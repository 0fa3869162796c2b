//! The master as a service: a TCP listener whose connections are admitted by railyard's
//! handshake, one thread per client reading its requests into the core (behind a lock),
//! and a ticker that runs the core's timers and pushes its actions — fences, finished
//! unmounts — to the segments' owners.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use railyard_engine::control::{ClusterSecret, HostId, Incarnation};

use crate::config::MasterPolicy;
use crate::handshake::{self, Identity};
use crate::master::{ClientId, MasterAction, MasterCore, MasterStats};
use crate::metrics::{Latencies, MetricsServer};
use crate::protocol::{
    PROTOCOL_VERSION, Reply, Request, ToClient, ToMaster, WireLease, read_frame, write_frame,
};

/// How often the ticker runs the core's timers.
const TICK: Duration = Duration::from_millis(20);
/// How long a connection may take to say Hello and prove the secret.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a write to one client may block before its connection is given up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
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
}

/// A running master. Dropping it stops it (its threads end within a fraction of a second).
pub struct MasterServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    metrics: Mutex<Option<MetricsServer>>,
}

/// A connection's sending half, shared by its reader (replies) and the ticker (events).
type Outbox = Arc<Mutex<TcpStream>>;

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
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MasterServer {
    /// Binds `config.listen` and starts serving.
    pub fn start(config: MasterConfig) -> io::Result<Self> {
        let listener = TcpListener::bind(config.listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            core: Mutex::new(MasterCore::new(config.policy)),
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
                        let actions = {
                            let mut core = lock(&shared.core);
                            core.tick(Instant::now());
                            drain_actions(&mut core)
                        };
                        deliver(&shared, actions);
                    }
                })?
        };
        Ok(Self {
            addr,
            shared,
            threads: vec![acceptor, ticker],
            metrics: Mutex::new(None),
        })
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
        lock(&self.metrics).take();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
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
    let client =
        match handshake::accept(&mut stream, local, &shared.identity, shared.secret.as_ref()) {
            Ok(identity) => ClientId(identity.incarnation.0),
            Err(reason) => {
                tracing::warn!(peer = ?peer, %reason, "store master: connection refused");
                return;
            }
        };
    let _ = stream.set_read_timeout(Some(STOP_CHECK));
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    // A client that stops reading holds up only its own frames: a write blocked this long
    // fails, and the connection goes (the ticker that pushes events never waits longer).
    let _ = writer.set_write_timeout(Some(WRITE_TIMEOUT));
    let outbox: Outbox = Arc::new(Mutex::new(writer));
    lock(&shared.clients)
        .entry(client)
        .or_default()
        .push(Arc::clone(&outbox));
    if let Some(events) = lock(&shared.undelivered).remove(&client) {
        deliver_to(shared, client, events);
    }
    let mut reader = Patient {
        stream: &stream,
        stop: &shared.stop,
    };
    loop {
        let frame: ToMaster = match read_frame(&mut reader) {
            Ok(frame) => frame,
            Err(error) => {
                if error.kind() == io::ErrorKind::InvalidData {
                    tracing::warn!(peer = ?peer, %error, "store master: malformed frame; closing");
                }
                break;
            }
        };
        let (reply, actions) = handle(shared, client, frame.request);
        let sent = write_frame(
            &mut *lock(&outbox),
            &ToClient::Reply {
                id: frame.id,
                reply,
            },
        );
        deliver(shared, actions);
        if sent.is_err() {
            break;
        }
    }
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
    core.heard(client, now);
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
    };
    let actions = drain_actions(&mut core);
    drop(core);
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
            let mut stream = lock(outbox);
            if write_frame(&mut *stream, &event).is_ok() {
                continue 'events;
            }
            // Perhaps half a frame went out: the connection is no good any more.
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        lock(&shared.undelivered)
            .entry(client)
            .or_default()
            .push(event);
    }
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;
