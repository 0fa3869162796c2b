//! [`Store`]: one process's client of the store. It asks the master where to put or find
//! objects and moves the bytes itself through its engine — zero-copy from and into memory
//! registered with the engine, through a registered bounce buffer for plain byte slices —
//! and, as the owner of the segments it mounted, fences zombie writers when the master asks.
//!
//! Batches answer one result per key: a failure of one key never fails another.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::thread;
use std::time::{Duration, Instant};

use railyard_engine::control::{ClusterSecret, HostId, Incarnation};
use railyard_engine::dataplane::sabotage::{self, Protection};
use railyard_engine::dataplane::{Batch, FailReason, RequestOutcome};
use railyard_engine::{Engine, EngineSubmitter, Op, Peer, Region, RevokeError, Transfer};

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
    writes: (Mutex<Writes>, Condvar),
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
            writes: (Mutex::new(Writes::default()), Condvar::new()),
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

    // ---- writes ------------------------------------------------------------------------

    /// Stores `value` under `key` (a new key: an existing one answers
    /// [`StoreErrorKind::AlreadyExists`]).
    pub fn put(&self, key: &str, value: &[u8], config: &ReplicaConfig) -> Result<(), StoreError> {
        self.put_parts(key, &[value], config)
    }

    /// Stores the concatenation of `parts` under `key`.
    pub fn put_parts(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        self.put_bytes(key, parts, config, false)
    }

    /// Stores `value` under `key`, replacing a complete object of that key (readers see the
    /// old value until the new one is complete).
    pub fn upsert(
        &self,
        key: &str,
        value: &[u8],
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        self.put_bytes(key, &[value], config, true)
    }

    /// Stores the bytes of registered memory `range` under `key`, zero-copy.
    pub fn put_from(
        &self,
        key: &str,
        range: LocalRange,
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        one(key, self.batch_put_from(&[key], &[range], config))
    }

    /// [`Self::put_from`] for each key: one result per key.
    pub fn batch_put_from<K: AsRef<str>>(
        &self,
        keys: &[K],
        ranges: &[LocalRange],
        config: &ReplicaConfig,
    ) -> Vec<Result<(), StoreError>> {
        written(self.batch_put_from_counted(keys, ranges, config))
    }

    /// [`Self::batch_put_from`], each result the number of replicas written:
    /// `config.replica_num`, or fewer (at least one) with
    /// [`ReplicaConfig::best_effort`] when fewer segments could take one.
    pub fn batch_put_from_counted<K: AsRef<str>>(
        &self,
        keys: &[K],
        ranges: &[LocalRange],
        config: &ReplicaConfig,
    ) -> Vec<Result<usize, StoreError>> {
        let parts: Vec<Vec<LocalRange>> = ranges.iter().map(|range| vec![*range]).collect();
        self.put_ranges(keys, &parts, config, false)
    }

    /// Stores, for each key, the concatenation of its ranges (scatter-gather): one result
    /// per key.
    pub fn batch_put_from_multi<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
        config: &ReplicaConfig,
    ) -> Vec<Result<(), StoreError>> {
        written(self.put_ranges(keys, parts, config, false))
    }

    /// [`Self::put_from`], replacing a complete object of that key.
    pub fn upsert_from(
        &self,
        key: &str,
        range: LocalRange,
        config: &ReplicaConfig,
    ) -> Result<(), StoreError> {
        one(
            key,
            written(self.put_ranges(&[key], &[vec![range]], config, true)),
        )
    }

    /// Writes plain bytes through the bounce buffer, a chunk at a time.
    fn put_bytes(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicaConfig,
        upsert: bool,
    ) -> Result<(), StoreError> {
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut attempt = 1;
        loop {
            match self.put_bytes_once(key, parts, config, upsert, deadline) {
                Err((error, true)) if attempt < PUT_ATTEMPTS && Instant::now() < deadline => {
                    tracing::debug!(key, %error, attempt, "store: writing again on live segments");
                    attempt += 1;
                }
                result => return result.map_err(|(error, _)| error),
            }
        }
    }

    /// One try of [`Self::put_bytes`]; a failure says whether writing again may work.
    fn put_bytes_once(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicaConfig,
        upsert: bool,
        deadline: Instant,
    ) -> Result<(), (StoreError, bool)> {
        let size: u64 = parts.iter().map(|part| part.len() as u64).sum();
        let sent = Instant::now();
        let (mut tickets, generation) = self.start(
            &[PutItem {
                key: key.to_owned(),
                size,
            }],
            config,
            upsert,
            deadline,
        );
        let ticket = tickets.remove(0).map_err(|error| (error, false))?;
        let expires = submit_by(sent, &ticket);
        let Some(writing) = self.inner.writing(generation) else {
            return Err((StoreError::new(key, StoreErrorKind::MasterChanged), true));
        };
        let mut written = 0u64;
        let mut outcome: Result<(), MoveFailure> = Ok(());
        let mut sources = parts.iter().flat_map(|part| part.iter().copied());
        while written < size && outcome.is_ok() {
            let mut chunk = self.inner.staging.chunk(size - written);
            let len = chunk.len.min(size - written);
            for (slot, byte) in chunk.bytes()[..len as usize]
                .iter_mut()
                .zip(sources.by_ref())
            {
                *slot = byte;
            }
            let source = LocalRange {
                region: self.inner.staging.region(),
                offset: chunk.offset,
                len,
            };
            let writes: Vec<(usize, Transfer, &ReplicaDescriptor)> = ticket
                .replicas
                .iter()
                .map(|replica| {
                    (
                        0,
                        Transfer {
                            op: Op::Write,
                            local: source.region,
                            local_offset: source.offset,
                            remote_addr: replica.addr + written,
                            len,
                        },
                        replica,
                    )
                })
                .collect();
            outcome = if Instant::now() < expires {
                self.move_bytes(writes, 1, deadline).remove(0)
            } else {
                Err(MoveFailure::expired())
            };
            written += len;
        }
        if matches!(&outcome, Err(failure) if failure.unresolved) {
            self.inner.unresolved(generation);
        }
        // Its transfers are done with: ending it may attach again, which waits for none of
        // them.
        drop(writing);
        self.finish(vec![(key.to_owned(), ticket.put, outcome)])
            .remove(0)
    }

    fn put_ranges<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
        config: &ReplicaConfig,
        upsert: bool,
    ) -> Vec<Result<usize, StoreError>> {
        if keys.len() != parts.len() {
            return keys
                .iter()
                .map(|key| {
                    Err(StoreError::new(
                        key.as_ref(),
                        StoreErrorKind::InvalidArgument {
                            detail: format!("{} keys and {} values", keys.len(), parts.len()),
                        },
                    ))
                })
                .collect();
        }
        let mut results: Vec<Option<Result<usize, StoreError>>> = vec![None; keys.len()];
        let mut items = Vec::new();
        let mut asked = Vec::new();
        for (index, (key, ranges)) in keys.iter().zip(parts).enumerate() {
            match self.check_ranges(key.as_ref(), ranges) {
                Ok(size) => {
                    items.push(PutItem {
                        key: key.as_ref().to_owned(),
                        size,
                    });
                    asked.push(index);
                }
                Err(error) => results[index] = Some(Err(error)),
            }
        }
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut attempt = 1;
        while !asked.is_empty() {
            let round = self.put_round(keys, parts, &asked, &items, config, upsert, deadline);
            let mut again = Vec::new();
            for ((index, item), result) in asked.into_iter().zip(items).zip(round) {
                match result {
                    Err((error, true)) if attempt < PUT_ATTEMPTS && Instant::now() < deadline => {
                        tracing::debug!(key = item.key, %error, attempt, "store: writing again on live segments");
                        again.push((index, item));
                    }
                    result => results[index] = Some(result.map_err(|(error, _)| error)),
                }
            }
            (asked, items) = again.into_iter().unzip();
            attempt += 1;
        }
        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| Err(StoreError::new("", StoreErrorKind::NotFound)))
            })
            .collect()
    }

    /// One try of writing `items` (the values of `keys[asked[i]]` in `parts`): placed,
    /// moved, ended or revoked. A failure says whether writing again may work.
    #[allow(clippy::too_many_arguments)]
    fn put_round<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
        asked: &[usize],
        items: &[PutItem],
        config: &ReplicaConfig,
        upsert: bool,
        deadline: Instant,
    ) -> Vec<Result<usize, (StoreError, bool)>> {
        let mut results: Vec<Option<Result<usize, (StoreError, bool)>>> = vec![None; asked.len()];
        let sent = Instant::now();
        let (tickets, generation) = self.start(items, config, upsert, deadline);
        let mut writes = Vec::new();
        let mut started = Vec::new();
        for (slot, ticket) in tickets.into_iter().enumerate() {
            let index = asked[slot];
            match ticket {
                Ok(ticket) => {
                    let item = started.len();
                    let mut at = 0;
                    // An empty part moves nothing (and a transfer of 0 bytes is refused).
                    for range in parts[index].iter().filter(|range| range.len > 0) {
                        for replica in &ticket.replicas {
                            writes.push((
                                item,
                                Transfer {
                                    op: Op::Write,
                                    local: range.region,
                                    local_offset: range.offset,
                                    remote_addr: replica.addr + at,
                                    len: range.len,
                                },
                                replica.clone(),
                            ));
                        }
                        at += range.len;
                    }
                    started.push((slot, ticket));
                }
                Err(error) => results[slot] = Some(Err((error, false))),
            }
        }
        let borrowed: Vec<(usize, Transfer, &ReplicaDescriptor)> = writes
            .iter()
            .map(|(item, transfer, replica)| (*item, *transfer, replica))
            .collect();
        // Every write goes out before the earliest of their expiries, or none does.
        let expires = started
            .iter()
            .map(|(_, ticket)| submit_by(sent, ticket))
            .min();
        let writing = self.inner.writing(generation);
        let outcomes = if writing.is_none() {
            // Placed by a master this store left: nothing of it is submitted.
            vec![Err(MoveFailure::master_changed()); started.len()]
        } else if expires.is_none_or(|expires| Instant::now() < expires) {
            self.move_bytes(borrowed, started.len(), deadline)
        } else {
            vec![Err(MoveFailure::expired()); started.len()]
        };
        if outcomes
            .iter()
            .any(|outcome| matches!(outcome, Err(failure) if failure.unresolved))
        {
            self.inner.unresolved(generation);
        }
        drop(writing);
        let finished = self.finish(
            started
                .iter()
                .zip(outcomes)
                .map(|((slot, ticket), outcome)| {
                    (keys[asked[*slot]].as_ref().to_owned(), ticket.put, outcome)
                })
                .collect(),
        );
        for ((slot, ticket), result) in started.iter().zip(finished) {
            results[*slot] = Some(result.map(|()| ticket.replicas.len()));
        }
        results
            .into_iter()
            .map(|result| {
                result
                    .unwrap_or_else(|| Err((StoreError::new("", StoreErrorKind::NotFound), false)))
            })
            .collect()
    }

    /// Checks that every range lies in its region; returns the value's size.
    fn check_ranges(&self, key: &str, ranges: &[LocalRange]) -> Result<u64, StoreError> {
        let mut size = 0u64;
        for range in ranges {
            let inside = range
                .offset
                .checked_add(range.len)
                .is_some_and(|end| end <= range.region.len);
            let registered = self
                .inner
                .engine
                .region_at(range.region.addr, range.region.len)
                .is_some_and(|region| region.id == range.region.id);
            let mounted = lock(&self.inner.mounted)
                .values()
                .any(|(segment, _)| segment.id == range.region.id);
            if mounted {
                return Err(StoreError::new(
                    key,
                    StoreErrorKind::InvalidArgument {
                        detail:
                            "a range in a segment this process mounted: that memory is the store's"
                                .into(),
                    },
                ));
            }
            if !inside || !registered {
                return Err(StoreError::new(
                    key,
                    StoreErrorKind::InvalidArgument {
                        detail: format!(
                            "{} bytes at offset {} of a region of {} bytes{}",
                            range.len,
                            range.offset,
                            range.region.len,
                            if registered {
                                ""
                            } else {
                                " not registered with the engine"
                            }
                        ),
                    },
                ));
            }
            size += range.len;
        }
        Ok(size)
    }

    /// Put-start for each item (one request), with the generation of the connection that
    /// placed them. Right after a failover, while no segment takes writes yet (every item
    /// answered [`StoreErrorKind::SegmentsNotReady`]), asks again until `deadline`.
    fn start(
        &self,
        items: &[PutItem],
        config: &ReplicaConfig,
        upsert: bool,
        deadline: Instant,
    ) -> (Vec<Result<PutTicket, StoreError>>, u64) {
        loop {
            let (tickets, generation) = self.start_once(items, config, upsert);
            let not_ready = !tickets.is_empty()
                && tickets.iter().all(|ticket| {
                    matches!(ticket, Err(error) if matches!(error.kind, StoreErrorKind::SegmentsNotReady { .. }))
                });
            if !not_ready || Instant::now() + READY_POLL >= deadline {
                return (tickets, generation);
            }
            thread::sleep(READY_POLL);
        }
    }

    /// One put-start request for `items`.
    fn start_once(
        &self,
        items: &[PutItem],
        config: &ReplicaConfig,
        upsert: bool,
    ) -> (Vec<Result<PutTicket, StoreError>>, u64) {
        if items.is_empty() {
            return (Vec::new(), 0);
        }
        let request = Request::PutStart {
            items: items.to_vec(),
            config: config.clone(),
            upsert,
            avoid: self.quarantined(),
        };
        let keys = || items.iter().map(|item| item.key.as_str());
        match self.inner.call_timed(request) {
            Ok((Reply::Tickets(tickets), _, generation)) if tickets.len() == items.len() => {
                (tickets, generation)
            }
            Ok((other, _, _)) => (each_failed(keys(), &unexpected(&other)), 0),
            Err(kind) => (each_failed(keys(), &StoreError::new("", kind)), 0),
        }
    }

    /// Put-end for the writes that moved, put-revoke for those that failed (their transfers
    /// all resolved). A write whose transfers did not resolve is left to the put timeout
    /// and its fence. A failure says whether writing again (placed anew) may work: a
    /// revoked write's transfers failed, or put-end found a replica's segment gone.
    fn finish(
        &self,
        writes: Vec<(String, PutId, Result<(), MoveFailure>)>,
    ) -> Vec<Result<(), (StoreError, bool)>> {
        let mut ends = Vec::new();
        let mut revokes = Vec::new();
        let mut results: Vec<Option<Result<(), (StoreError, bool)>>> = Vec::new();
        for (index, (key, put, outcome)) in writes.iter().enumerate() {
            match outcome {
                Ok(()) => {
                    ends.push((index, (key.clone(), *put)));
                    results.push(None);
                }
                Err(failure) => {
                    let retryable = !failure.unresolved && !failure.expired;
                    if !failure.unresolved {
                        revokes.push((key.clone(), *put));
                    }
                    results.push(Some(Err((
                        StoreError::new(
                            key,
                            StoreErrorKind::TransferFailed {
                                detail: failure.detail.clone(),
                            },
                        ),
                        retryable,
                    ))));
                }
            }
        }
        if !revokes.is_empty() {
            // Best effort: a revoke that does not reach the master leaves the space to the
            // put timeout.
            let _ = self.call(Request::PutRevoke { items: revokes });
        }
        if !ends.is_empty() {
            let request = Request::PutEnd {
                items: ends.iter().map(|(_, item)| item.clone()).collect(),
            };
            let answers = match self.call(request) {
                Ok(Reply::Each(answers)) if answers.len() == ends.len() => answers,
                Ok(other) => ends
                    .iter()
                    .map(|(_, (key, _))| Err(rekey(key, unexpected(&other))))
                    .collect(),
                Err(error) => ends
                    .iter()
                    .map(|(_, (key, _))| Err(rekey(key, error.clone())))
                    .collect(),
            };
            for ((index, _), answer) in ends.iter().zip(answers) {
                results[*index] = Some(answer.map_err(|error| {
                    let retryable = matches!(
                        error.kind,
                        StoreErrorKind::ReplicaLost { .. } | StoreErrorKind::MasterChanged
                    );
                    (error, retryable)
                }));
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Ok(())))
            .collect()
    }

    // ---- reads -------------------------------------------------------------------------

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let lease = self.lease(&[key]).remove(0)?;
        let size = lease.0.size;
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut value = Vec::with_capacity(size as usize);
        while (value.len() as u64) < size {
            let at = value.len() as u64;
            let mut chunk = self.inner.staging.chunk(size - at);
            let len = chunk.len.min(size - at);
            let target = LocalRange {
                region: self.inner.staging.region(),
                offset: chunk.offset,
                len,
            };
            self.read_replica(key, &lease, &[target], at, deadline)?;
            value.extend_from_slice(&chunk.bytes()[..len as usize]);
        }
        Ok(value)
    }

    /// Reads the value of `key` into registered memory `range`, zero-copy; returns its size.
    pub fn get_into(&self, key: &str, range: LocalRange) -> Result<u64, StoreError> {
        one(key, self.batch_get_into(&[key], &[range]))
    }

    /// [`Self::get_into`] for each key: one result per key.
    pub fn batch_get_into<K: AsRef<str>>(
        &self,
        keys: &[K],
        ranges: &[LocalRange],
    ) -> Vec<Result<u64, StoreError>> {
        let parts: Vec<Vec<LocalRange>> = ranges.iter().map(|range| vec![*range]).collect();
        self.batch_get_into_multi(keys, &parts)
    }

    /// Reads each key's value into its ranges, in order (scatter-gather): one result per
    /// key, its size.
    pub fn batch_get_into_multi<K: AsRef<str>>(
        &self,
        keys: &[K],
        parts: &[Vec<LocalRange>],
    ) -> Vec<Result<u64, StoreError>> {
        if keys.len() != parts.len() {
            return keys
                .iter()
                .map(|key| {
                    Err(StoreError::new(
                        key.as_ref(),
                        StoreErrorKind::InvalidArgument {
                            detail: format!("{} keys and {} buffers", keys.len(), parts.len()),
                        },
                    ))
                })
                .collect();
        }
        let mut results: Vec<Result<u64, StoreError>> = Vec::with_capacity(keys.len());
        let mut wanted = Vec::new();
        for (key, ranges) in keys.iter().zip(parts) {
            match self.check_ranges(key.as_ref(), ranges) {
                Ok(_) => {
                    wanted.push(key.as_ref());
                    results.push(Ok(0));
                }
                Err(error) => results.push(Err(error)),
            }
        }
        let leases = self.lease(&wanted);
        let mut leases = leases.iter();
        let deadline = after(Instant::now(), self.inner.options.timeout);
        let mut reads: Vec<Read<'_>> = Vec::new();
        let mut read_of: Vec<(usize, u64)> = Vec::new();
        for (index, (key, ranges)) in keys.iter().zip(parts).enumerate() {
            if results[index].is_err() {
                continue;
            }
            let lease = match leases.next() {
                Some(Ok(lease)) => lease,
                Some(Err(error)) => {
                    results[index] = Err(error.clone());
                    continue;
                }
                None => continue,
            };
            let size = lease.0.size;
            let room: u64 = ranges.iter().map(|range| range.len).sum();
            if room < size {
                results[index] = Err(StoreError::new(
                    key.as_ref(),
                    StoreErrorKind::InvalidArgument {
                        detail: format!("a buffer of {room} bytes for a value of {size}"),
                    },
                ));
                continue;
            }
            reads.push(Read {
                key: key.as_ref(),
                lease,
                targets: ranges,
                at: 0,
            });
            read_of.push((index, size));
        }
        for ((index, size), read) in read_of.into_iter().zip(self.read_many(&reads, deadline)) {
            results[index] = read.map(|()| size);
        }
        results
    }

    /// Get for each key (one request): a lease on its replicas, best first.
    fn lease(&self, keys: &[&str]) -> Vec<Result<(WireLease, Instant), StoreError>> {
        if keys.is_empty() {
            return Vec::new();
        }
        let request = Request::Get {
            keys: keys.iter().map(|key| (*key).to_owned()).collect(),
        };
        let answer = self
            .inner
            .call_timed(request)
            .map_err(|kind| StoreError::new("", kind));
        let (leases, asked) = match answer {
            Ok((Reply::Leases(leases), asked, _)) if leases.len() == keys.len() => (leases, asked),
            Ok((other, _, _)) => return each_failed(keys.iter().copied(), &unexpected(&other)),
            Err(error) => return each_failed(keys.iter().copied(), &error),
        };
        leases
            .into_iter()
            .map(|lease| {
                lease.map(|mut lease| {
                    self.rank(&mut lease.replicas);
                    // The lease counts from when the master answered, which is after the
                    // request left: measured from then, it ends no later than the master's.
                    let until = after(asked, lease.lease);
                    (lease, until)
                })
            })
            .collect()
    }

    /// Orders replicas best first: this process's own segment, then this host, then the rest,
    /// each group least loaded first.
    /// Holders this engine sees dead (its quarantine, kept by the engine's own liveness)
    /// go last, whatever the master still says.
    fn rank(&self, replicas: &mut [ReplicaDescriptor]) {
        let own = self.inner.engine.addr().to_string();
        let quarantined = self.quarantined();
        replicas.sort_by_key(|replica| {
            let near = if replica.handshake_addr == own {
                0
            } else if replica.host == self.inner.host {
                1
            } else {
                2
            };
            (
                quarantined.contains(&replica.handshake_addr),
                near,
                replica.load,
            )
        });
    }

    /// Handshake addresses of holders this engine sees dead: their peer's circuit is open
    /// (it stopped answering or kept failing). A peer replaced by another incarnation is
    /// not one: its address now belongs to the newcomer, whose own segments are fine (the
    /// replicas of the one it replaced are refused by incarnation, see [`Self::peer`]).
    fn quarantined(&self) -> Vec<String> {
        lock(&self.inner.peers)
            .iter()
            .filter(|(_, peer)| peer.is_unavailable() && !peer.is_retired())
            .map(|(addr, _)| addr.clone())
            .collect()
    }

    /// Reads `lease`'s value from `at` into `targets`, trying each replica in turn until one
    /// succeeds, and checks the lease outlived the transfer.
    fn read_replica(
        &self,
        key: &str,
        lease: &(WireLease, Instant),
        targets: &[LocalRange],
        at: u64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let item = Read {
            key,
            lease,
            targets,
            at,
        };
        self.read_many(&[item], deadline).remove(0)
    }

    /// Reads every item at once — one batch per replica holder, not one round trip per key —
    /// moving each failed item to its next replica and trying again until every item has
    /// succeeded or run out of replicas; checks each lease outlived its transfer.
    fn read_many(&self, items: &[Read<'_>], deadline: Instant) -> Vec<Result<(), StoreError>> {
        let mut results: Vec<Option<Result<(), StoreError>>> = vec![None; items.len()];
        let mut attempt = vec![0usize; items.len()];
        let mut last: Vec<String> = vec![String::from("no replica"); items.len()];
        // Whether every replica tried on this pass failed because its holder is gone.
        let mut all_gone = vec![true; items.len()];
        let mut passes = vec![1usize; items.len()];
        loop {
            let pending: Vec<usize> = (0..items.len()).filter(|&i| results[i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let mut reads: Vec<(usize, Transfer, &ReplicaDescriptor)> = Vec::new();
            for (slot, &i) in pending.iter().enumerate() {
                let Read {
                    lease, targets, at, ..
                } = &items[i];
                let (lease, _) = lease;
                let Some(replica) = lease.replicas.get(attempt[i]) else {
                    continue;
                };
                let mut from = *at;
                for target in targets.iter() {
                    let len = target.len.min(lease.size.saturating_sub(from));
                    if len > 0 {
                        reads.push((
                            slot,
                            Transfer {
                                op: Op::Read,
                                local: target.region,
                                local_offset: target.offset,
                                remote_addr: replica.addr + from,
                                len,
                            },
                            replica,
                        ));
                    }
                    from += len;
                }
            }
            let outcomes = self.move_bytes(reads, pending.len(), deadline);
            let mut pause = false;
            for (&i, outcome) in pending.iter().zip(outcomes) {
                let Read { key, lease, .. } = &items[i];
                let (lease, until) = lease;
                if attempt[i] >= lease.replicas.len() {
                    // Every replica failed, one at least for a reason of its own (errors on
                    // a rail, a circuit open on one rail of several): with time left, each
                    // is tried again — the engine routes around a rail that is down.
                    let time_left = Instant::now() + PASS_PAUSE < deadline.min(*until);
                    if !all_gone[i] && passes[i] < READ_PASSES && time_left {
                        passes[i] += 1;
                        attempt[i] = 0;
                        // Judged again on this pass alone: holders seen alive on the last one
                        // may have died since.
                        all_gone[i] = true;
                        pause = true;
                        continue;
                    }
                    // No replica left whose holder lives: the object is gone for readers (the
                    // master learns it within its silence bound), not a transfer failure.
                    let kind = if all_gone[i] {
                        StoreErrorKind::NotFound
                    } else {
                        StoreErrorKind::TransferFailed {
                            detail: last[i].clone(),
                        }
                    };
                    results[i] = Some(Err(StoreError::new(key, kind)));
                    continue;
                }
                results[i] = match outcome {
                    Ok(()) if Instant::now() <= *until => Some(Ok(())),
                    Ok(()) => Some(Err(StoreError::new(key, StoreErrorKind::LeaseExpired))),
                    Err(failure) => {
                        all_gone[i] &= failure.holder_gone;
                        last[i] = failure.detail;
                        attempt[i] += 1;
                        if sabotage::is_off(Protection::StoreReadFailover) {
                            attempt[i] = lease.replicas.len();
                            passes[i] = READ_PASSES;
                        }
                        None
                    }
                };
            }
            if pause {
                thread::sleep(PASS_PAUSE);
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Ok(())))
            .collect()
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

    // ---- plumbing ----------------------------------------------------------------------

    fn call(&self, request: Request) -> Result<Reply, StoreError> {
        self.inner
            .call(request)
            .map_err(|kind| StoreError::new("", kind))
    }

    /// Moves `transfers` (each tagged with the item it belongs to, `items` in all) to their
    /// replicas; returns each item's outcome once every transfer of it has resolved.
    fn move_bytes(
        &self,
        transfers: Vec<(usize, Transfer, &ReplicaDescriptor)>,
        items: usize,
        deadline: Instant,
    ) -> Vec<Result<(), MoveFailure>> {
        let mut outcomes: Vec<Result<(), MoveFailure>> = vec![Ok(()); items];
        let own = self.inner.engine.addr().to_string();
        let me = ClientId(self.inner.engine.incarnation().0);
        let mut by_holder: HashMap<(&str, ClientId), Vec<(usize, Transfer)>> = HashMap::new();
        for (item, transfer, replica) in transfers {
            if replica.handshake_addr == own && replica.holder == me {
                if let Err(detail) = self.copy_locally(&transfer) {
                    outcomes[item] = Err(MoveFailure::failed(detail));
                }
                continue;
            }
            by_holder
                .entry((replica.handshake_addr.as_str(), replica.holder))
                .or_default()
                .push((item, transfer));
        }
        let mut submitter = match self.submitter() {
            Ok(submitter) => submitter,
            Err(detail) => return vec![Err(MoveFailure::failed(detail)); items],
        };
        let mut batches: Vec<(Batch, Peer)> = Vec::new();
        let mut pending: Vec<Pending> = Vec::new();
        for (&(addr, holder), group) in &by_holder {
            let submitted = self.peer(addr, holder).and_then(|peer| {
                let transfers: Vec<Transfer> =
                    group.iter().map(|(_, transfer)| *transfer).collect();
                submitter
                    .submit(&peer, &transfers)
                    .map(|batch| (batch, peer))
                    .map_err(|error| MoveFailure::failed(error.to_string()))
            });
            match submitted {
                Ok(batch) => {
                    for (request, (item, _)) in group.iter().enumerate() {
                        pending.push(Pending {
                            item: *item,
                            batch: batches.len(),
                            request,
                        });
                    }
                    batches.push(batch);
                }
                Err(failure) => {
                    for (item, _) in group {
                        outcomes[*item] = Err(MoveFailure {
                            detail: format!("{addr}: {}", failure.detail),
                            ..failure.clone()
                        });
                    }
                }
            }
        }
        lock(&self.inner.submitters).push(submitter);
        let mut resolved = vec![true; batches.len()];
        for (index, (batch, _)) in batches.iter().enumerate() {
            // The engine resolves every request by its own deadline; past ours, wait for that
            // too, so that "failed" always means "nothing of it moves any more".
            let status = batch.wait(deadline);
            if !status.is_complete() && !batch.wait(after(deadline, RESOLVE_GRACE)).is_complete() {
                resolved[index] = false;
            }
        }
        for Pending {
            item,
            batch,
            request,
        } in pending
        {
            if !resolved[batch] {
                outcomes[item] = Err(MoveFailure {
                    detail: format!(
                        "transfers not resolved within {RESOLVE_GRACE:?} after the deadline"
                    ),
                    holder_gone: false,
                    unresolved: true,
                    expired: false,
                });
                continue;
            }
            let (batch, peer) = &batches[batch];
            if let Some(RequestOutcome::Failed(reason)) = batch.outcome(request)
                && outcomes[item].is_ok()
            {
                // Gone means the peer as a whole: one rail's circuit open or endpoint retired
                // (its errors) while another rail carries traffic leaves that one.
                let holder_gone = matches!(
                    reason,
                    FailReason::PeerUnavailable | FailReason::EndpointRetired
                ) && !peer.is_up_on_a_rail();
                outcomes[item] = Err(MoveFailure {
                    detail: format!("{reason:?}"),
                    holder_gone,
                    unresolved: false,
                    expired: false,
                });
            }
        }
        outcomes
    }

    /// A transfer to a replica in this process's own segment: a plain copy.
    fn copy_locally(&self, transfer: &Transfer) -> Result<(), String> {
        let mounted = lock(&self.inner.mounted);
        let Some(segment) = mounted
            .values()
            .map(|(region, _)| *region)
            .find(|region| region.contains(transfer.remote_addr, transfer.len))
        else {
            return Err(format!(
                "{:#x}: not in a segment this process mounted",
                transfer.remote_addr
            ));
        };
        // Both ranges must still be the engine's: a region deregistered behind the store's
        // back is memory it may no longer touch.
        for region in [segment, transfer.local] {
            let live = self
                .inner
                .engine
                .region_at(region.addr, region.len)
                .is_some_and(|live| live.id == region.id);
            if !live {
                return Err(format!(
                    "region {} ({:#x}, {} bytes) is no longer registered",
                    region.id, region.addr, region.len
                ));
            }
        }
        let local = transfer.local.addr + transfer.local_offset;
        let (from, to) = match transfer.op {
            Op::Write => (local, transfer.remote_addr),
            Op::Read => (transfer.remote_addr, local),
        };
        // SAFETY:
        // - Both ranges lie in regions registered with this process's engine, checked just
        //   above: the local one was checked against its region's bounds, the remote one lies
        //   in a mounted segment. The lock on `mounted` keeps the store's own unmount from
        //   deregistering the segment during the copy; `mount_region`'s contract keeps the
        //   caller from doing so while it is mounted.
        // - They do not overlap: a caller's range is never in a mounted segment
        //   (`check_ranges` refuses that), and registered regions never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, transfer.len as usize);
        }
        Ok(())
    }

    fn submitter(&self) -> Result<EngineSubmitter, String> {
        if let Some(submitter) = lock(&self.inner.submitters).pop() {
            return Ok(submitter);
        }
        self.inner
            .engine
            .submitter()
            .map_err(|error| error.to_string())
    }

    /// The engine's peer at `addr` if it is `holder` (opened once, and again after it
    /// retired). Another incarnation answering there took a dead holder's port: its memory
    /// is not the replica's, and the holder is gone.
    fn peer(&self, addr: &str, holder: ClientId) -> Result<Peer, MoveFailure> {
        let gone = |incarnation: Incarnation| {
            MoveFailure::holder_gone(format!(
                "incarnation {} answers at {addr}, not the holder {}: the holder is gone",
                incarnation.0, holder.0
            ))
        };
        // A peer of another incarnation is opened again: the one cached may be the dead
        // holder (not yet retired) that the holder asked for replaced.
        if let Some(peer) = lock(&self.inner.peers)
            .get(addr)
            .filter(|peer| !peer.is_retired() && peer.incarnation().0 == holder.0)
        {
            return Ok(peer.clone());
        }
        // Not opening is no proof the holder is gone (it may be slow, or refuse for a while):
        // only a dead peer's transfers or another incarnation's answer are.
        let peer = self
            .inner
            .engine
            .open(addr)
            .map_err(|error| MoveFailure::failed(error.to_string()))?;
        lock(&self.inner.peers).insert(addr.to_owned(), peer.clone());
        if peer.incarnation().0 != holder.0 {
            return Err(gone(peer.incarnation()));
        }
        Ok(peer)
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
const RESOLVE_GRACE: Duration = Duration::from_secs(30);

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
        // writes never resolved (it may still land).
        let (writes, changed) = &self.writes;
        let resolved = after(Instant::now(), self.options.timeout + RESOLVE_GRACE);
        let mut state = writes.lock().unwrap_or_else(PoisonError::into_inner);
        let left = state.generation;
        state.generation += 1;
        let generation = state.generation;
        while state.in_flight > 0 && Instant::now() < resolved {
            state = changed
                .wait_timeout(state, resolved.saturating_duration_since(Instant::now()))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        // Unresolved writes of earlier connections were fenced when those were left.
        if state.in_flight == 0 && state.unresolved_in != Some(left) {
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
        if state.generation != generation {
            return None;
        }
        state.in_flight += 1;
        Some(WritesInFlight(&self.writes))
    }

    /// A write placed through connection `generation` did not resolve: it may land any
    /// time, so this process does not tell the next master it has nothing in flight.
    fn unresolved(&self, generation: u64) {
        self.writes
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unresolved_in = Some(generation);
    }
}

/// Writes in flight and the connection generation they may be placed through.
#[derive(Default)]
struct Writes {
    /// Writes whose transfers may be in flight.
    in_flight: usize,
    /// The generation of the connection to the master writes are placed through now.
    generation: u64,
    /// The connection generation a write whose transfers never resolved was placed
    /// through (the latest such).
    unresolved_in: Option<u64>,
}

/// A write whose transfers may be in flight: counted while it lives.
struct WritesInFlight<'a>(&'a (Mutex<Writes>, Condvar));

impl Drop for WritesInFlight<'_> {
    fn drop(&mut self) {
        let (writes, changed) = self.0;
        writes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_flight -= 1;
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
