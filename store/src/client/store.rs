//! [`Store`]: one process's client of the store. It asks the master where to put or find
//! objects and moves the bytes itself through its engine — zero-copy from and into memory
//! registered with the engine, through a registered bounce buffer for plain byte slices —
//! and, as the owner of the segments it mounted, fences zombie writers when the master asks.
//!
//! Batches answer one result per key: a failure of one key never fails another.
//!
//! This file holds the handle, its setup (connect, mount, unmount), metadata calls, the
//! link to the master (attaching again after a failover) and the fences it is asked for;
//! writes are in `store/writes.rs`, reads in `store/reads.rs`, and moving their bytes
//! through the engine in `store/transfer.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::thread;
use std::time::{Duration, Instant};

use railyard_engine::control::{ClusterSecret, HostId, Incarnation};
use railyard_engine::dataplane::sabotage::{self, Protection};
use railyard_engine::dataplane::{Batch, FailReason, RequestOutcome};
use railyard_engine::{Engine, EngineSubmitter, Op, Peer, Region, RevokeError, Transfer};

use crate::client::InFlight;
use crate::client::link::MasterLink;
use crate::client::staging::Staging;
use crate::config::ReplicaConfig;
use crate::error::{StoreError, StoreErrorKind};
use crate::handshake::Identity;
use crate::master::{
    ClientId, GRANULE, MAX_SEGMENT_BYTES, MasterStats, PutId, PutTicket, ReplicaDescriptor,
    SegmentId, SegmentSpec,
};
use crate::protocol::{KEEPALIVE, MASTER_SILENCE, PutItem, Reply, Request, ToClient, WireLease};
use crate::time::after;

mod reads;
mod transfer;
mod writes;

/// How a [`Store`] reaches its master and bounds its calls.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// The master's address (`host:port`).
    pub master: String,
    /// The cluster secret, if the cluster has one.
    pub secret: Option<ClusterSecret>,
    /// How long one call may take: its master round trips and its transfers (10 s).
    pub timeout: Duration,
    /// Bytes of the registered bounce buffer for `put` and `get` of plain slices (64 MiB).
    pub staging: u64,
    /// This process's host, for placing replicas on different hosts and reading the
    /// nearest one (default: the kernel's host name).
    pub host: Option<String>,
}

impl StoreOptions {
    /// Defaults for the master at `master`.
    pub fn new(master: impl Into<String>) -> Self {
        Self {
            master: master.into(),
            secret: None,
            timeout: Duration::from_secs(10),
            staging: 64 << 20,
            host: None,
        }
    }
}

/// Bytes of memory registered with the store's engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRange {
    /// The region.
    pub region: Region,
    /// Offset of the first byte in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl LocalRange {
    /// The whole of `region`.
    pub fn whole(region: Region) -> Self {
        Self {
            region,
            offset: 0,
            len: region.len,
        }
    }
}

/// A client of the store. See the module docs.
///
/// `Send + Sync`: threads share one store. Dropping it closes the connection to the master;
/// segments it mounted stay mounted until the master learns the process is gone.
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    /// The connection to the master (replaced when it fails: see [`Inner::attach_again`]).
    link: RwLock<(Arc<MasterLink>, u64)>,
    /// Where every link sends the master's events.
    events: Sender<ToClient>,
    /// Held while attaching again, so that one thread does it.
    attaching: Mutex<()>,
    /// Writes whose transfers may be in flight (see [`WritesInFlight`]).
    writes: (Mutex<InFlight>, Condvar),
    me: Identity,
    options: StoreOptions,
    host: String,
    staging: Staging,
    peers: Mutex<HashMap<String, Peer>>,
    submitters: Mutex<Vec<EngineSubmitter>>,
    /// Segments this process mounted: their memory, and whether the store allocated it.
    mounted: Mutex<HashMap<SegmentId, (Region, bool)>>,
    unmounted: (Mutex<HashSet<SegmentId>>, Condvar),
    next_segment: Mutex<u64>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A read of one key's value (from byte `at`) into `targets`, under `lease`.
struct Read<'a> {
    key: &'a str,
    lease: &'a (WireLease, Instant),
    targets: &'a [LocalRange],
    at: u64,
}

/// One replica write or read: which request of which batch, for which item.
struct Pending {
    item: usize,
    batch: usize,
    request: usize,
}

impl Store {
    /// Connects `engine` to the master of `options`.
    ///
    /// # Errors
    /// [`StoreErrorKind::MasterUnreachable`] when the master cannot be reached, refuses
    /// the handshake or speaks another protocol version; [`StoreErrorKind::TransferFailed`]
    /// when the bounce buffer cannot be registered.
    pub fn connect(engine: &Engine, options: StoreOptions) -> Result<Self, StoreError> {
        let fail = |kind| StoreError::new("", kind);
        let me = Identity {
            name: engine.name().to_owned(),
            incarnation: engine.incarnation(),
            host: HostId::this_process(),
        };
        let (events_tx, events_rx) = mpsc::channel();
        let link = connect_link(&options, &me, events_tx.clone()).map_err(fail)?;
        let staging = Staging::new(engine, options.staging).map_err(|error| {
            fail(StoreErrorKind::TransferFailed {
                detail: format!("the bounce buffer: {error}"),
            })
        })?;
        let host = options.host.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|name| name.trim().to_owned())
                .unwrap_or_else(|_| "localhost".into())
        });
        let inner = Arc::new(Inner {
            engine: engine.clone(),
            link: RwLock::new((Arc::new(link), 0)),
            events: events_tx,
            attaching: Mutex::new(()),
            writes: (Mutex::new(InFlight::default()), Condvar::new()),
            me,
            options,
            host,
            staging,
            peers: Mutex::new(HashMap::new()),
            submitters: Mutex::new(Vec::new()),
            mounted: Mutex::new(HashMap::new()),
            unmounted: (Mutex::new(HashSet::new()), Condvar::new()),
            next_segment: Mutex::new(0),
        });
        // Both end by themselves once the store goes: they hold only weak references (the
        // events channel closes with the last sender, which the store holds).
        let weak = Arc::downgrade(&inner);
        thread::Builder::new()
            .name("store-events".into())
            .spawn(move || handle_events(&weak, &events_rx))
            .map_err(|error| {
                fail(StoreErrorKind::TransferFailed {
                    detail: format!("no thread for the master's events: {error}"),
                })
            })?;
        let weak = Arc::downgrade(&inner);
        thread::Builder::new()
            .name("store-attach".into())
            .spawn(move || keep_attached(&weak))
            .map_err(|error| {
                fail(StoreErrorKind::TransferFailed {
                    detail: format!("no thread to watch the master's connection: {error}"),
                })
            })?;
        Ok(Self { inner })
    }

    /// What the master knows this process as.
    pub fn client_id(&self) -> ClientId {
        self.inner.link().client
    }

    /// The host this process says it is on.
    pub fn hostname(&self) -> &str {
        &self.inner.host
    }

    /// The engine it moves bytes with.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Allocates `size` bytes with the engine (huge pages where it can) and mounts them as
    /// a segment other members write and read.
    pub fn mount(&self, size: u64) -> Result<SegmentId, StoreError> {
        if !(GRANULE..=MAX_SEGMENT_BYTES).contains(&size) {
            return Err(StoreError::new(
                "",
                StoreErrorKind::InvalidSegment {
                    segment: format!("{size} bytes"),
                    reason: format!("a segment is {GRANULE} to {MAX_SEGMENT_BYTES} bytes"),
                },
            ));
        }
        let region = self.inner.engine.alloc(size, None).map_err(|error| {
            StoreError::new(
                "",
                StoreErrorKind::InvalidSegment {
                    segment: format!("{} bytes", size),
                    reason: error.to_string(),
                },
            )
        })?;
        let mounted = self.mount_with(region, true);
        if mounted.is_err() {
            let _ = self.inner.engine.deregister(region);
        }
        mounted
    }

    /// Mounts memory already registered with the engine as a segment (it stays the
    /// caller's: [`Self::unmount`] does not deregister it). Deregister it only after
    /// [`Self::unmount`] returned: until then the store reads and writes it.
    pub fn mount_region(&self, region: Region) -> Result<SegmentId, StoreError> {
        self.mount_with(region, false)
    }

    fn mount_with(&self, region: Region, owned: bool) -> Result<SegmentId, StoreError> {
        let index = {
            let mut next = lock(&self.inner.next_segment);
            *next += 1;
            *next
        };
        let spec = SegmentSpec {
            name: format!(
                "{}@{}#{index}",
                self.inner.engine.name(),
                self.inner.engine.incarnation()
            ),
            host: self.inner.host.clone(),
            handshake_addr: self.inner.engine.addr().to_string(),
            base: region.addr,
            size: region.len,
        };
        match self.call(Request::Mount(spec))? {
            Reply::Mounted(Ok(segment)) => {
                lock(&self.inner.mounted).insert(segment, (region, owned));
                Ok(segment)
            }
            Reply::Mounted(Err(error)) => Err(error),
            other => Err(unexpected(&other)),
        }
    }

    /// Unmounts `segment`: no new replica goes to it and no read is pointed at it from now
    /// on; after `grace` (for readers already pointed at it) the master lets go of it, and
    /// memory the store allocated for it is deregistered and freed. Returns then.
    pub fn unmount(&self, segment: SegmentId, grace: Duration) -> Result<(), StoreError> {
        if !lock(&self.inner.mounted).contains_key(&segment) {
            return Err(StoreError::new(
                "",
                StoreErrorKind::UnknownSegment {
                    segment: format!("#{}", segment.0),
                },
            ));
        }
        match self.call(Request::Unmount { segment, grace })? {
            Reply::Done(Ok(())) => {}
            Reply::Done(Err(error)) => return Err(error),
            other => return Err(unexpected(&other)),
        }
        let deadline = after(after(Instant::now(), grace), self.inner.options.timeout);
        let (set, changed) = &self.inner.unmounted;
        let mut gone = lock(set);
        while !gone.remove(&segment) {
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::new(
                    "",
                    StoreErrorKind::MasterUnreachable {
                        detail: format!(
                            "segment #{} not released within {grace:?} and the timeout",
                            segment.0
                        ),
                    },
                ));
            }
            gone = changed
                .wait_timeout(gone, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        drop(gone);
        if let Some((region, true)) = lock(&self.inner.mounted).remove(&segment) {
            self.inner.engine.deregister(region).map_err(|error| {
                StoreError::new(
                    "",
                    StoreErrorKind::TransferFailed {
                        detail: format!("deregistering segment #{}: {error}", segment.0),
                    },
                )
            })?;
        }
        Ok(())
    }

    // ---- metadata ----------------------------------------------------------------------

    /// Whether `key` names a complete object.
    pub fn exists(&self, key: &str) -> Result<bool, StoreError> {
        one(key, self.batch_exists(&[key]))
    }

    /// [`Self::exists`] for each key: one result per key.
    pub fn batch_exists<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<bool, StoreError>> {
        let request = Request::Exists {
            keys: keys.iter().map(|key| key.as_ref().to_owned()).collect(),
        };
        match self.call(request) {
            Ok(Reply::Exists(answers)) if answers.len() == keys.len() => answers,
            Ok(other) => each_failed(keys.iter().map(AsRef::as_ref), &unexpected(&other)),
            Err(error) => each_failed(keys.iter().map(AsRef::as_ref), &error),
        }
    }

    /// Removes `key`; without `force`, a leased object answers [`StoreErrorKind::HasLease`].
    pub fn remove(&self, key: &str, force: bool) -> Result<(), StoreError> {
        one(key, self.batch_remove(&[key], force))
    }

    /// [`Self::remove`] for each key: one result per key.
    pub fn batch_remove<K: AsRef<str>>(
        &self,
        keys: &[K],
        force: bool,
    ) -> Vec<Result<(), StoreError>> {
        let request = Request::Remove {
            keys: keys.iter().map(|key| key.as_ref().to_owned()).collect(),
            force,
        };
        match self.call(request) {
            Ok(Reply::Each(answers)) if answers.len() == keys.len() => answers,
            Ok(other) => each_failed(keys.iter().map(AsRef::as_ref), &unexpected(&other)),
            Err(error) => each_failed(keys.iter().map(AsRef::as_ref), &error),
        }
    }

    /// Removes every object [`Self::remove`] would; returns how many went.
    pub fn remove_all(&self, force: bool) -> Result<u64, StoreError> {
        match self.call(Request::RemoveAll { force })? {
            Reply::Removed(count) => Ok(count),
            other => Err(unexpected(&other)),
        }
    }

    /// Where `key`'s complete replicas live (a read lease comes with the answer).
    pub fn replica_descriptors(&self, key: &str) -> Result<Vec<ReplicaDescriptor>, StoreError> {
        self.lease(&[key])
            .remove(0)
            .map(|(lease, _)| lease.replicas)
    }

    /// Whether the master answers, from the connection's keepalive and without a round
    /// trip: the connection is up and the master answered a ping within
    /// [`MASTER_SILENCE`]. A dead master reads false at once (its connection reset), a
    /// stopped one after that silence.
    pub fn master_reachable(&self) -> bool {
        let (link, _) = self.inner.attached();
        !link.is_closed() && link.silent_for() <= MASTER_SILENCE
    }

    /// Keys of complete objects, sorted.
    pub fn keys(&self) -> Result<Vec<String>, StoreError> {
        match self.call(Request::Keys)? {
            Reply::Keys(keys) => Ok(keys),
            other => Err(unexpected(&other)),
        }
    }

    /// What the master holds.
    pub fn master_stats(&self) -> Result<MasterStats, StoreError> {
        match self.call(Request::Stats)? {
            Reply::Stats(stats) => Ok(*stats),
            other => Err(unexpected(&other)),
        }
    }
}

/// Why one item's bytes did not move.
#[derive(Clone, Debug)]
struct MoveFailure {
    /// What the engine (or the check that refused it) said.
    detail: String,
    /// Its holder is dead or replaced as far as this engine can tell: another replica may
    /// serve a read, and a write placed elsewhere may work.
    holder_gone: bool,
    /// A transfer of it may still land: its space waits for the put timeout and a fence.
    unresolved: bool,
    /// Nothing was submitted: the put timed out first (writing again would too).
    expired: bool,
}

impl MoveFailure {
    fn failed(detail: impl Into<String>) -> Self {
        Self {
            detail: detail.into(),
            holder_gone: false,
            unresolved: false,
            expired: false,
        }
    }

    fn holder_gone(detail: impl Into<String>) -> Self {
        Self {
            holder_gone: true,
            ..Self::failed(detail)
        }
    }

    fn expired() -> Self {
        Self {
            expired: true,
            ..Self::failed("the put timed out before its transfers were submitted")
        }
    }

    /// Nothing was submitted: the write was placed by a master this store has left since.
    fn master_changed() -> Self {
        Self::failed("the write was placed by a master this store has left; nothing was submitted")
    }
}

/// Tries of one write: the first, and again on live segments after a transfer failed or a
/// replica's segment went away.
const PUT_ATTEMPTS: u32 = 3;

/// When a write must have submitted its transfers: its put timeout, counted from before
/// put-start was sent (so never later than the master counts it), less a tenth for the
/// submission itself. Past it the writer submits nothing: its space may be someone else's
/// by the time its bytes land (transfers already submitted are the fence's to stop).
fn submit_by(sent: Instant, ticket: &PutTicket) -> Instant {
    after(sent, ticket.expires_in - ticket.expires_in / 10)
}

/// How long past a call's deadline it waits for the engine to resolve its transfers.
pub(crate) const RESOLVE_GRACE: Duration = Duration::from_secs(30);

impl Inner {
    /// The current connection to the master.
    fn link(&self) -> Arc<MasterLink> {
        self.attached().0
    }

    /// The current connection to the master and its generation (one more at each attach).
    fn attached(&self) -> (Arc<MasterLink>, u64) {
        let attached = self.link.read().unwrap_or_else(PoisonError::into_inner);
        (Arc::clone(&attached.0), attached.1)
    }

    /// Sends `request` to the master; when the connection is gone (the master died, lost
    /// its term, or stopped answering its pings), attaches again — to the leader etcd names
    /// now — and sends it once more. A refusal or an unanswered request is not sent again:
    /// it may have been carried out.
    fn call(&self, request: Request) -> Result<Reply, StoreErrorKind> {
        self.call_timed(request).map(|(reply, _, _)| reply)
    }

    /// [`Self::call`], saying when the request that was answered was sent and the
    /// generation of the connection that answered it.
    fn call_timed(&self, request: Request) -> Result<(Reply, Instant, u64), StoreErrorKind> {
        let (link, generation) = self.attached();
        let sent = Instant::now();
        match link.call(request.clone(), self.options.timeout) {
            Err(StoreErrorKind::MasterUnreachable { .. }) if link.is_closed() => {
                self.attach_again(&link)?;
                let (link, generation) = self.attached();
                let sent = Instant::now();
                Ok((link.call(request, self.options.timeout)?, sent, generation))
            }
            answered => Ok((answered?, sent, generation)),
        }
    }

    /// Replaces `failed` with a new connection — to the master etcd names as leader now,
    /// or the same address — trying for up to the call timeout. The master knows this
    /// process by its engine's incarnation, so its segments are its own again at once.
    fn attach_again(&self, failed: &Arc<MasterLink>) -> Result<(), StoreErrorKind> {
        let _one = self
            .attaching
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !Arc::ptr_eq(&self.link(), failed) {
            return Ok(());
        }
        let deadline = after(Instant::now(), self.options.timeout);
        let link = loop {
            match connect_link(&self.options, &self.me, self.events.clone()) {
                Ok(link) => break link,
                Err(error) if Instant::now() >= deadline => return Err(error),
                Err(_) => thread::sleep(ATTACH_RETRY),
            }
        };
        // From here no write placed by the master it left is submitted (its generation is
        // old); the ones already submitted resolve first, each by its own deadline. Then it
        // tells the new master so, and no segment owner has to fence it — unless one of its
        // writes, through any connection, never resolved (it may still land).
        let (writes, changed) = &self.writes;
        let resolved = after(Instant::now(), self.options.timeout + RESOLVE_GRACE);
        let mut state = writes.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = state.leave();
        while state.writes() > 0 && Instant::now() < resolved {
            state = changed
                .wait_timeout(state, resolved.saturating_duration_since(Instant::now()))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if state.quiesced() {
            let _ = link.call(Request::Quiesced, self.options.timeout);
        }
        drop(state);
        tracing::info!(master = %link.addr, "store: attached to the master again");
        *self.link.write().unwrap_or_else(PoisonError::into_inner) = (Arc::new(link), generation);
        Ok(())
    }

    /// Counts the transfers of writes placed through connection `generation` as in flight
    /// until the guard goes; `None` when that connection was given up (its master may be
    /// gone: nothing it placed is submitted any more).
    fn writing(&self, generation: u64) -> Option<WritesInFlight<'_>> {
        let mut state = self.writes.0.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .start_write(generation)
            .then_some(WritesInFlight(&self.writes))
    }

    /// A write placed through connection `generation` did not resolve: it may land any
    /// time, so this process does not tell a master it has nothing in flight any more.
    fn unresolved(&self, generation: u64) {
        self.writes
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unresolved(generation);
    }
}

/// A write whose transfers may be in flight: counted while it lives.
struct WritesInFlight<'a>(&'a (Mutex<InFlight>, Condvar));

impl Drop for WritesInFlight<'_> {
    fn drop(&mut self) {
        let (writes, changed) = self.0;
        writes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .end_write();
        changed.notify_all();
    }
}

/// Tries of a fence after the first whose peer was still busy.
const REVOKE_TRIES: usize = 3;

/// Times a read goes through a key's replicas when a failure was not its holder's death.
const READ_PASSES: usize = 3;
/// Pause before going through them again.
const PASS_PAUSE: Duration = Duration::from_millis(50);

/// Pause between put-starts while no segment takes writes yet (after a failover).
const READY_POLL: Duration = Duration::from_millis(20);

/// Pause between tries to attach to a master again.
const ATTACH_RETRY: Duration = Duration::from_millis(100);

/// Connects to the master `options` name: its address, or the leader an `etcd://` URL's
/// election names now.
fn connect_link(
    options: &StoreOptions,
    me: &Identity,
    events: Sender<ToClient>,
) -> Result<MasterLink, StoreErrorKind> {
    let master = leader_of(&options.master)?;
    MasterLink::connect(
        &master,
        me,
        options.secret.as_ref(),
        options.timeout,
        events,
    )
}

/// The master's address: `master` itself, or what etcd names as the leader for an
/// `etcd://` URL.
fn leader_of(master: &str) -> Result<String, StoreErrorKind> {
    if !(master.starts_with("etcd://") || master.starts_with("etcd+tls://")) {
        return Ok(master.to_owned());
    }
    let unreachable = |detail: String| StoreErrorKind::MasterUnreachable { detail };
    #[cfg(feature = "etcd")]
    {
        crate::failover::StoreEtcd::from_url(master)
            .and_then(|etcd| etcd.find_leader())
            .map_err(unreachable)?
            .ok_or_else(|| unreachable(format!("no master leads in {master} yet")))
    }
    #[cfg(not(feature = "etcd"))]
    Err(unreachable(format!(
        "{master}: this railyard was built without the etcd feature"
    )))
}

/// Keeps a store attached while it has nothing to ask: once the connection is gone (the
/// master died or lost its term) or the master fell silent (stopped: its pings go
/// unanswered for [`MASTER_SILENCE`]), attaches again — so a member that only holds
/// segments is heard by the new leader before its grace runs out.
fn keep_attached(inner: &Weak<Inner>) {
    loop {
        thread::sleep(KEEPALIVE);
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let link = inner.link();
        if !link.is_closed() && link.silent_for() > MASTER_SILENCE {
            tracing::warn!(master = %link.addr, "store: the master stopped answering; finding it again");
            link.close();
        }
        if link.is_closed() {
            let _ = inner.attach_again(&link);
        }
    }
}

/// The master's pushed events: fence a zombie writer (revoke it on this engine, then tell
/// the master), or note a finished unmount.
fn handle_events(inner: &Weak<Inner>, events: &Receiver<ToClient>) {
    while let Ok(event) = events.recv() {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        match event {
            ToClient::Fence { fence, writer, .. } => {
                tracing::info!(
                    fence = fence.0,
                    writer = writer.0,
                    "store: fencing a writer the master gave up on"
                );
                // A busy peer (queue pairs not quiet yet) is waited for again, a few times.
                let mut revoked = inner
                    .engine
                    .revoke(railyard_engine::control::Incarnation(writer.0));
                for _ in 0..REVOKE_TRIES {
                    if !matches!(revoked, Err(RevokeError::Busy { .. })) {
                        break;
                    }
                    revoked = inner
                        .engine
                        .revoke(railyard_engine::control::Incarnation(writer.0));
                }
                match revoked {
                    Ok(()) => {
                        let _ = inner.call(Request::Fenced { fence });
                    }
                    Err(error) => {
                        // The space stays reserved: better lost than written by a zombie.
                        tracing::warn!(fence = fence.0, writer = writer.0, %error, "store: could not fence a zombie writer");
                    }
                }
            }
            ToClient::Unmounted { segment } => {
                let (set, changed) = &inner.unmounted;
                lock(set).insert(segment);
                changed.notify_all();
            }
            ToClient::Reply { .. } => {}
        }
    }
}

/// Counted results of writes, without the count.
fn written(results: Vec<Result<usize, StoreError>>) -> Vec<Result<(), StoreError>> {
    results
        .into_iter()
        .map(|result| result.map(|_| ()))
        .collect()
}

fn one<T>(key: &str, mut results: Vec<Result<T, StoreError>>) -> Result<T, StoreError> {
    results
        .pop()
        .unwrap_or_else(|| Err(StoreError::new(key, StoreErrorKind::NotFound)))
}

/// `error` once per key: how a batch answers when its call to the master failed as a whole.
fn each_failed<'k, T>(
    keys: impl IntoIterator<Item = &'k str>,
    error: &StoreError,
) -> Vec<Result<T, StoreError>> {
    keys.into_iter()
        .map(|key| Err(rekey(key, error.clone())))
        .collect()
}

fn rekey(key: &str, error: StoreError) -> StoreError {
    StoreError::new(key, error.kind)
}

fn unexpected(reply: &Reply) -> StoreError {
    StoreError::new(
        "",
        StoreErrorKind::MasterUnreachable {
            detail: format!("unexpected answer: {reply:?}"),
        },
    )
}
