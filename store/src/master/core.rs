//! The master's state machine: mounting and unmounting segments, two-phase writes
//! (put-start, put-end, put-revoke, upsert), reads under leases, removal, abandoned writes
//! fenced before their space is reused, and the timers that drive it all.
//!
//! It reads no clock and owns no socket: every call carries `now`, and what others must do
//! (fence a zombie writer, learn that an unmount finished) comes out of
//! [`MasterCore::next_action`], so tests replay any interleaving on virtual time.

use serde::{Deserialize, Serialize};

use std::collections::{HashMap, HashSet, VecDeque};

use railyard_engine::dataplane::rng::KeyedHasher;
use std::time::{Duration, Instant};

use crate::config::{MasterPolicy, ReplicaConfig};
use crate::error::{StoreError, StoreErrorKind, check_key};
use crate::master::objects::{Dirty, Object, PutId, Replica, Version, Write};
use crate::master::segments::{ClientId, Member, SegmentId, SegmentSpec, Segments};
use crate::master::space::Extent;
use crate::time::after;

/// Where one replica of an object lives: enough for a client to read or write it through
/// its engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaDescriptor {
    /// The segment.
    pub segment: SegmentId,
    /// Its name.
    pub segment_name: String,
    /// Its host.
    pub host: String,
    /// Its owner engine's handshake address.
    pub handshake_addr: String,
    /// Its owner engine's incarnation: a process answering at `handshake_addr` as another
    /// incarnation is not the holder (it took a dead one's port), and is neither read nor
    /// written for this replica.
    pub holder: ClientId,
    /// Address of the replica's first byte in the owner's address space.
    pub addr: u64,
    /// The value's size.
    pub len: u64,
    /// Reads recently pointed at its segment (halved every lease period): the client reads
    /// the least loaded of equally near replicas.
    pub load: u64,
}

/// A write the master has placed: write every replica, then put-end (or put-revoke).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutTicket {
    /// The write's id, for put-end and put-revoke.
    pub put: PutId,
    /// Where to write the value, one entry per replica.
    pub replicas: Vec<ReplicaDescriptor>,
    /// How long from put-start the write may take before it is abandoned (the master's
    /// put timeout): a writer submits none of its transfers later than that.
    pub expires_in: Duration,
}

/// A complete object a reader may read until `lease_until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectLease {
    /// The value's size.
    pub size: u64,
    /// Its complete replicas.
    pub replicas: Vec<ReplicaDescriptor>,
    /// The object is neither evicted nor removed (without force) before then; a reader
    /// whose transfer ends later must not trust what it read.
    pub lease_until: Instant,
}

/// A fence the master waits for, as it names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FenceId(pub u64);

/// The low bits of a term a put id carries (and of the count of puts it numbers).
const TERM_BITS: u64 = 0xffff_ffff;

/// What the master needs others to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MasterAction {
    /// A write by `writer` into `segment` was abandoned (put timeout, or removed by force):
    /// `owner` must revoke `writer` on its engine (`Engine::revoke`), so that none of its
    /// late bytes can land, and then report [`MasterCore::fenced`]. Until then the space
    /// stays reserved.
    Fence {
        /// The fence to report.
        fence: FenceId,
        /// The segment written.
        segment: SegmentId,
        /// Its owner, who revokes.
        owner: ClientId,
        /// The zombie writer.
        writer: ClientId,
    },
    /// `segment`'s unmount is over: no replica points into it any more; `owner` may
    /// deregister its memory.
    Unmounted {
        /// The segment.
        segment: SegmentId,
        /// Its owner.
        owner: ClientId,
    },
    /// `client` is gone (suspected past the grace period, or replaced by another
    /// incarnation): its segments are forgotten, and nothing is kept for it any more.
    MemberGone {
        /// The member.
        client: ClientId,
    },
}

/// Counters since the master started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterCounters {
    /// Writes started (put-start and upsert-start that placed replicas).
    pub puts_started: u64,
    /// Writes completed (put-end).
    pub puts_completed: u64,
    /// Writes revoked by their writer.
    pub puts_revoked: u64,
    /// Writes abandoned past the put timeout or removed by force while in progress.
    pub puts_abandoned: u64,
    /// Reads granted (a lease handed out).
    pub gets: u64,
    /// Objects evicted.
    pub evictions: u64,
    /// Bytes of values evicted.
    pub evicted_bytes: u64,
    /// Removes refused because a reader held a lease.
    pub lease_refusals: u64,
    /// Writes refused for lack of space after eviction.
    pub no_space: u64,
    /// Members suspected (silent, or their connection dropped).
    pub members_suspected: u64,
    /// Members gone (suspected past the grace period, or replaced by a new incarnation).
    pub members_lost: u64,
    /// Connections closed because a frame after the handshake failed its authentication
    /// check (changed, dropped, replayed, reordered or injected on the path).
    pub auth_failures: u64,
}

/// One segment's usage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentUsage {
    /// The segment.
    pub segment: SegmentId,
    /// Its name.
    pub name: String,
    /// Its host.
    pub host: String,
    /// Bytes it manages.
    pub capacity: u64,
    /// Bytes reserved by replicas (complete, being written, or waiting for a fence or a
    /// lease to end).
    pub reserved: u64,
    /// Live replicas' extents (and those waiting for a fence or a lease to end).
    pub extents: u32,
    /// Being unmounted.
    pub draining: bool,
    /// Its owner is suspected: it takes no replica and serves no read.
    pub suspected: bool,
}

/// What the master holds, for `stat` and metrics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterStats {
    /// Complete objects.
    pub objects: u64,
    /// Writes in progress.
    pub writes: u64,
    /// Bytes of complete values (one replica each).
    pub bytes: u64,
    /// Each segment.
    pub segments: Vec<SegmentUsage>,
    /// Fences waited for.
    pub fences_pending: u64,
    /// The leader's term (0: a master with no election).
    pub term: u64,
    /// Counters.
    pub counters: MasterCounters,
}

/// Space of an abandoned write, freed once the segment's owner has fenced the writer — or,
/// after a failover, a segment's guard against a writer of an earlier term (no extents; the
/// segment takes no replica until every such fence is done).
pub(super) struct PendingFence {
    pub(super) segment: SegmentId,
    pub(super) extents: Vec<Extent>,
    /// The earlier term's writer this fence guards against.
    pub(super) writer: Option<ClientId>,
}

/// The master's state machine. See the module docs.
pub struct MasterCore {
    pub(super) policy: MasterPolicy,
    pub(super) segments: Segments,
    pub(super) objects: HashMap<String, Object, KeyedHasher>,
    next_put: u64,
    next_fence: u64,
    /// Logical time of reads and completed writes, for least-recently-used eviction.
    pub(super) clock: u64,
    pub(super) fences: HashMap<FenceId, PendingFence, KeyedHasher>,
    /// Replicas no reader can be pointed at any more but one may still be reading, freed
    /// when the lease they were handed out under ends.
    pub(super) retired: Vec<(Instant, Replica)>,
    actions: VecDeque<MasterAction>,
    pub(super) counters: MasterCounters,
    /// When segments' recent reads were last halved (none before the first tick).
    load_decayed: Option<Instant>,
    /// Members that contribute segments, by liveness.
    pub(super) members: HashMap<ClientId, Member, KeyedHasher>,
    /// Why writes the master let go of ended (answered to a late put-end or put-revoke),
    /// kept until then.
    ended: HashMap<PutId, (Instant, StoreErrorKind), KeyedHasher>,
    /// The leader's term (0: a master with no journal). Put ids start at `term << 32`, so
    /// a write placed by an earlier master is never taken for one of this term's.
    pub(super) term: u64,
    /// What changed since the journal last took it (`None`: no journal).
    pub(super) dirty: Option<Dirty>,
    /// Clients that started writes this term (written down once each).
    writers: HashSet<ClientId, KeyedHasher>,
    /// Writers of earlier terms: their term and the fences against them still awaited.
    pub(super) old_writers: HashMap<ClientId, (u64, u32), KeyedHasher>,
    /// The fences against each earlier term's writer, some perhaps done since (a writer
    /// that attaches releases its own at once, whatever the number of segments).
    pub(super) fences_against: HashMap<ClientId, Vec<FenceId>, KeyedHasher>,
    /// When the owners are asked to fence earlier terms' writers that did not attach.
    pub(super) term_fences_due: Option<Instant>,
    /// When fences against earlier terms' writers stop holding segments back, done or not
    /// (an owner whose fabric cannot revoke would otherwise hold its segment forever): by
    /// then every write an earlier master placed has passed its put timeout and resolved.
    pub(super) term_fences_expire: Option<Instant>,
}

impl MasterCore {
    /// A master with no segment.
    pub fn new(policy: MasterPolicy) -> Self {
        Self::keyed(policy, KeyedHasher::random())
    }

    /// A master with no segment whose tables are keyed with `tables`: the same key and the
    /// same calls give the same answers, in the same order (the simulation replays a seed
    /// bit for bit); [`Self::new`] keys them at random, so clients cannot choose keys that
    /// collide.
    pub fn keyed(policy: MasterPolicy, tables: KeyedHasher) -> Self {
        Self {
            policy,
            segments: Segments::default(),
            objects: HashMap::with_hasher(tables),
            next_put: 0,
            next_fence: 0,
            clock: 0,
            fences: HashMap::with_hasher(tables),
            retired: Vec::new(),
            actions: VecDeque::new(),
            counters: MasterCounters::default(),
            load_decayed: None,
            members: HashMap::with_hasher(tables),
            ended: HashMap::with_hasher(tables),
            term: 0,
            dirty: None,
            writers: HashSet::with_hasher(tables),
            old_writers: HashMap::with_hasher(tables),
            fences_against: HashMap::with_hasher(tables),
            term_fences_due: None,
            term_fences_expire: None,
        }
    }

    /// Records that `key`'s complete version changed (for the journal).
    pub(super) fn touched(&mut self, key: &str) {
        if let Some(dirty) = self.dirty.as_mut()
            && dirty.touched.insert(key.to_owned())
        {
            dirty.objects.push(key.to_owned());
        }
    }

    /// Records that `segment` was mounted or went (for the journal).
    pub(super) fn touched_segment(&mut self, segment: SegmentId) {
        if let Some(dirty) = self.dirty.as_mut() {
            dirty.segments.insert(segment);
        }
    }

    /// Starts waiting for a fence; returns its id. Like a put id, it carries the term: an
    /// owner reporting an earlier master's fence to this one never completes another fence
    /// that happens to have the same number.
    pub(super) fn new_fence(&mut self, pending: PendingFence) -> FenceId {
        let fence = FenceId(((self.term & TERM_BITS) << 32) | (self.next_fence & TERM_BITS));
        self.next_fence += 1;
        self.fences.insert(fence, pending);
        fence
    }

    /// Drops the fences awaited on `segment` (it is gone): a guard against an earlier
    /// term's writer no longer waits on it.
    pub(super) fn drop_fences_of(&mut self, segment: SegmentId) {
        let gone: Vec<FenceId> = self
            .fences
            .iter()
            .filter(|(_, pending)| pending.segment == segment)
            .map(|(&fence, _)| fence)
            .collect();
        for fence in gone {
            if let Some(PendingFence {
                writer: Some(writer),
                ..
            }) = self.fences.remove(&fence)
            {
                self.fenced_writer(writer);
            }
        }
    }

    /// One more fence against an earlier term's `writer` is done (or no longer needed).
    fn fenced_writer(&mut self, writer: ClientId) {
        let Some((_, pending)) = self.old_writers.get_mut(&writer) else {
            return;
        };
        *pending = pending.saturating_sub(1);
        if *pending == 0 {
            self.forget_writer(writer);
        }
    }

    /// Its policy.
    pub fn policy(&self) -> &MasterPolicy {
        &self.policy
    }

    /// The next thing others must do.
    pub fn next_action(&mut self) -> Option<MasterAction> {
        self.actions.pop_front()
    }

    pub(super) fn push_action(&mut self, action: MasterAction) {
        self.actions.push_back(action);
    }

    /// Mounts `spec`, contributed by `owner`; from now on `owner`'s liveness counts (see
    /// [`Self::heard`]). Another incarnation's segment at the same handshake address — a
    /// dead process whose port `owner` took — is gone first.
    pub fn mount_segment(
        &mut self,
        owner: ClientId,
        spec: SegmentSpec,
        now: Instant,
    ) -> Result<SegmentId, StoreError> {
        let (addr, name) = (spec.handshake_addr.clone(), spec.name.clone());
        let mounted = match self.segments.mount(owner, spec.clone()) {
            Err(error) if matches!(error.kind, StoreErrorKind::SegmentExists { .. }) => {
                // Its name may be a suspected member's: replaced, it is free.
                if !self.replace_members(owner, &addr, &name) {
                    return Err(error);
                }
                self.segments.mount(owner, spec)?
            }
            mounted => mounted?,
        };
        self.replace_members(owner, &addr, &name);
        self.track_member(owner, now);
        self.touched_segment(mounted);
        Ok(mounted)
    }

    /// Starts unmounting `segment`: from now on no replica is placed on it and no read is
    /// pointed at it (objects left with no replica are gone; writes with a replica on it
    /// are abandoned). After `grace`, for readers already pointed at it to finish,
    /// [`MasterAction::Unmounted`] tells its owner its memory is free.
    pub fn unmount_segment(
        &mut self,
        segment: SegmentId,
        grace: Duration,
        now: Instant,
    ) -> Result<(), StoreError> {
        let Some(state) = self.segments.get_mut(segment) else {
            return Err(StoreError::new(
                "",
                StoreErrorKind::UnknownSegment {
                    segment: format!("#{}", segment.0),
                },
            ));
        };
        if state.draining_until.is_some() {
            return Ok(());
        }
        state.draining_until = Some(after(now, grace));
        let affected: Vec<String> = self
            .objects
            .iter()
            .filter(|(_, object)| {
                let on = |version: &Version| version.replicas.iter().any(|r| r.segment == segment);
                object.complete.as_ref().is_some_and(on)
                    || object.write.as_ref().is_some_and(|w| on(&w.version))
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in affected {
            self.touched(&key);
            if let Some(object) = self.objects.get_mut(&key)
                && let Some(write) = object
                    .write
                    .take_if(|w| w.version.replicas.iter().any(|r| r.segment == segment))
            {
                let name = self.segments.get(segment).map(|s| s.spec.name.clone());
                self.end_write(
                    write,
                    StoreErrorKind::ReplicaLost {
                        segment: name.unwrap_or_default(),
                    },
                );
            }
            let Some(object) = self.objects.get_mut(&key) else {
                continue;
            };
            if let Some(version) = object.complete.as_mut() {
                let (gone, kept): (Vec<Replica>, Vec<Replica>) = version
                    .replicas
                    .drain(..)
                    .partition(|r| r.segment == segment);
                version.replicas = kept;
                let until = object.lease_until.unwrap_or(now).max(now);
                self.retired.extend(gone.into_iter().map(|r| (until, r)));
                if version.replicas.is_empty() {
                    object.complete = None;
                }
            }
            if object.complete.is_none() && object.write.is_none() {
                self.objects.remove(&key);
            }
        }
        Ok(())
    }

    /// Places `config.replica_num` replicas of a `size`-byte value for `key`, written by
    /// `client`: write them, then [`Self::put_end`]. The key must not name an object yet.
    pub fn put_start(
        &mut self,
        client: ClientId,
        key: &str,
        size: u64,
        config: &ReplicaConfig,
        now: Instant,
    ) -> Result<PutTicket, StoreError> {
        self.start(client, key, size, config, false, &[], now)
    }

    /// Like [`Self::put_start`], but over a complete object too: its current value stays
    /// readable until put-end replaces it.
    pub fn upsert_start(
        &mut self,
        client: ClientId,
        key: &str,
        size: u64,
        config: &ReplicaConfig,
        now: Instant,
    ) -> Result<PutTicket, StoreError> {
        self.start(client, key, size, config, true, &[], now)
    }

    /// [`Self::put_start`] (or, with `upsert`, [`Self::upsert_start`]) placing nothing on
    /// segments whose owner's handshake address is in `avoid`: the writer's engine sees
    /// them dead, which the master may not know yet.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        client: ClientId,
        key: &str,
        size: u64,
        config: &ReplicaConfig,
        upsert: bool,
        avoid: &[String],
        now: Instant,
    ) -> Result<PutTicket, StoreError> {
        check_key(key)?;
        let fail = |kind| StoreError::new(key, kind);
        let replicas = self
            .segments
            .replicas_for(size, config, avoid)
            .map_err(fail)?;
        if let Some(object) = self.objects.get(key) {
            if object.write.is_some() {
                return Err(fail(if upsert {
                    StoreErrorKind::NotReady
                } else {
                    StoreErrorKind::AlreadyExists
                }));
            }
            // An object no reader can read now (every replica on a suspected segment) is
            // replaced as an upsert would: a cache that missed it refills it.
            let readable = object.complete.as_ref().is_some_and(|version| {
                version
                    .replicas
                    .iter()
                    .any(|r| self.segments.readable(r.segment))
            });
            if !upsert && readable {
                return Err(fail(StoreErrorKind::AlreadyExists));
            }
        }
        let placed = match self.segments.place(size, replicas, config, avoid) {
            Some(placed) => placed,
            None => {
                let want = self
                    .eviction_target()
                    .max(size.saturating_mul(replicas as u64));
                self.evict(want, now);
                match self.segments.place(size, replicas, config, avoid) {
                    Some(placed) => placed,
                    None => {
                        self.counters.no_space += 1;
                        return Err(fail(StoreErrorKind::NoSpace { size, replicas }));
                    }
                }
            }
        };
        let put = PutId(((self.term & TERM_BITS) << 32) | (self.next_put & TERM_BITS));
        self.next_put += 1;
        if self.writers.insert(client)
            && let Some(dirty) = self.dirty.as_mut()
        {
            dirty.writers.push(client);
        }
        let replicas: Vec<Replica> = placed
            .into_iter()
            .map(|(segment, extent)| Replica { segment, extent })
            .collect();
        let descriptors = self.describe(&replicas, size);
        let write = Write {
            version: Version {
                size,
                replicas,
                put,
            },
            writer: client,
            put,
            deadline: after(now, self.policy.put_timeout),
            soft_pin: config.soft_pin,
            hard_pin: config.hard_pin,
        };
        self.objects
            .entry(key.to_owned())
            .or_insert_with(|| Object {
                complete: None,
                write: None,
                lease_until: None,
                last_used: 0,
                soft_pin_until: None,
                hard_pin: false,
            })
            .write = Some(write);
        self.counters.puts_started += 1;
        if self.over_watermark() {
            self.evict(self.eviction_target(), now);
        }
        Ok(PutTicket {
            put,
            replicas: descriptors,
            expires_in: self.policy.put_timeout,
        })
    }

    /// `client` wrote every replica of `put`: the object becomes visible (replacing the
    /// value an upsert wrote over).
    pub fn put_end(
        &mut self,
        client: ClientId,
        key: &str,
        put: PutId,
        now: Instant,
    ) -> Result<(), StoreError> {
        // Asked again (its answer was lost with a connection, perhaps with a master that
        // failed over since): the object it made is there, the same answer.
        if self
            .objects
            .get(key)
            .and_then(|object| object.complete.as_ref())
            .is_some_and(|version| version.put == put)
        {
            return Ok(());
        }
        let write = self.take_write(client, key, put)?;
        self.clock += 1;
        let clock = self.clock;
        let object = self
            .objects
            .get_mut(key)
            .expect("take_write found the object");
        let old = object.complete.replace(write.version);
        if let Some(old) = old {
            let until = object.lease_until.unwrap_or(now).max(now);
            self.retired
                .extend(old.replicas.into_iter().map(|replica| (until, replica)));
        }
        object.lease_until = None;
        object.last_used = clock;
        object.soft_pin_until = write.soft_pin.map(|pin| after(now, pin));
        object.hard_pin = write.hard_pin;
        self.counters.puts_completed += 1;
        self.touched(key);
        self.free_retired(now);
        Ok(())
    }

    /// `client` gives up `put` after every transfer of it has resolved (the engine reports
    /// nothing before that, so none of its bytes can land later): its space is free at
    /// once.
    pub fn put_revoke(
        &mut self,
        client: ClientId,
        key: &str,
        put: PutId,
    ) -> Result<(), StoreError> {
        let write = self.take_write(client, key, put)?;
        for replica in write.version.replicas {
            self.segments.free(replica.segment, replica.extent);
        }
        if self
            .objects
            .get(key)
            .is_some_and(|object| object.complete.is_none())
        {
            self.objects.remove(key);
        }
        self.counters.puts_revoked += 1;
        Ok(())
    }

    /// Takes `key`'s write `put` by `client` out of its object.
    fn take_write(&mut self, client: ClientId, key: &str, put: PutId) -> Result<Write, StoreError> {
        check_key(key)?;
        let fail = |kind| StoreError::new(key, kind);
        // A write the master let go of says why; one it never knew is not pending.
        let not_pending = match self.ended.get(&put) {
            Some((_, why)) => why.clone(),
            None if put.0 >> 32 != self.term & TERM_BITS => StoreErrorKind::MasterChanged,
            None => StoreErrorKind::PutNotPending,
        };
        let Some(object) = self.objects.get_mut(key) else {
            return Err(fail(not_pending));
        };
        match &object.write {
            Some(write) if write.put == put && write.writer == client => {}
            Some(write) if write.put == put => return Err(fail(StoreErrorKind::NotWriter)),
            _ => return Err(fail(not_pending)),
        }
        Ok(object.write.take().expect("matched above"))
    }

    /// The complete replicas of `key` and a lease on them: the object is neither evicted
    /// nor removed (without force) before the lease ends.
    pub fn get(&mut self, key: &str, now: Instant) -> Result<ObjectLease, StoreError> {
        check_key(key)?;
        let fail = |kind| StoreError::new(key, kind);
        let lease_until = after(now, self.policy.lease_ttl);
        self.clock += 1;
        let clock = self.clock;
        let object = self
            .objects
            .get_mut(key)
            .ok_or_else(|| fail(StoreErrorKind::NotFound))?;
        let Some(version) = object.complete.as_ref() else {
            return Err(fail(StoreErrorKind::NotReady));
        };
        // Every replica on a suspected segment: nothing a reader could read now.
        if !version
            .replicas
            .iter()
            .any(|r| self.segments.readable(r.segment))
        {
            return Err(fail(StoreErrorKind::NotFound));
        }
        object.lease_until = Some(
            object
                .lease_until
                .map_or(lease_until, |u| u.max(lease_until)),
        );
        object.last_used = clock;
        let size = version.size;
        let object = &self.objects[key];
        let readable: Vec<&Replica> = object
            .complete
            .as_ref()
            .expect("checked")
            .replicas
            .iter()
            .filter(|r| self.segments.readable(r.segment))
            .collect();
        let replicas = self.describe(readable, size);
        for replica in &replicas {
            if let Some(segment) = self.segments.get_mut(replica.segment) {
                segment.recent_reads += 1;
            }
        }
        self.counters.gets += 1;
        Ok(ObjectLease {
            size,
            replicas,
            lease_until,
        })
    }

    /// Whether `key` names a complete object a reader could read now (one being written
    /// does not exist yet; one whose every replica is on a suspected segment does not
    /// either, while it is suspected).
    pub fn exists(&self, key: &str) -> Result<bool, StoreError> {
        check_key(key)?;
        Ok(self
            .objects
            .get(key)
            .and_then(|object| object.complete.as_ref())
            .is_some_and(|version| {
                version
                    .replicas
                    .iter()
                    .any(|r| self.segments.readable(r.segment))
            }))
    }

    /// [`Self::exists`] for each key: one result per key.
    pub fn batch_exists<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<bool, StoreError>> {
        keys.iter().map(|key| self.exists(key.as_ref())).collect()
    }

    /// Removes `key`. Without `force`, a leased object answers
    /// [`StoreErrorKind::HasLease`] and one being written [`StoreErrorKind::NotReady`];
    /// with it, both go (a write in progress is abandoned behind a fence).
    pub fn remove(&mut self, key: &str, force: bool, now: Instant) -> Result<(), StoreError> {
        check_key(key)?;
        let fail = |kind| StoreError::new(key, kind);
        let object = self
            .objects
            .get(key)
            .ok_or_else(|| fail(StoreErrorKind::NotFound))?;
        if !force {
            if object.write.is_some() {
                return Err(fail(StoreErrorKind::NotReady));
            }
            if object.leased(now) {
                self.counters.lease_refusals += 1;
                return Err(fail(StoreErrorKind::HasLease));
            }
        }
        let mut object = self.objects.remove(key).expect("found above");
        self.touched(key);
        if let Some(write) = object.write.take() {
            self.end_write(write, StoreErrorKind::PutRemoved);
        }
        if let Some(version) = object.complete.take() {
            // Forced past a lease: gone for new readers at once, its space free only once
            // the readers already pointed at it are done.
            let until = object.lease_until.unwrap_or(now).max(now);
            self.retired
                .extend(version.replicas.into_iter().map(|replica| (until, replica)));
            self.free_retired(now);
        }
        Ok(())
    }

    /// Removes every object [`Self::remove`] would; returns how many went.
    pub fn remove_all(&mut self, force: bool, now: Instant) -> usize {
        let keys: Vec<String> = self
            .objects
            .iter()
            .filter(|(_, object)| force || object.complete.is_some())
            .map(|(key, _)| key.clone())
            .collect();
        keys.iter()
            .filter(|key| self.remove(key, force, now).is_ok())
            .count()
    }

    /// Keys of complete objects, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .objects
            .iter()
            .filter(|(_, object)| object.complete.is_some())
            .map(|(key, _)| key.clone())
            .collect();
        keys.sort();
        keys
    }

    /// Who owns `segment`, if it is mounted.
    pub fn segment_owner(&self, segment: SegmentId) -> Option<ClientId> {
        self.segments.get(segment).map(|s| s.owner)
    }

    /// Who must report `fence`: the owner of the segment it waits on.
    pub fn fence_owner(&self, fence: FenceId) -> Option<ClientId> {
        let pending = self.fences.get(&fence)?;
        self.segment_owner(pending.segment)
    }

    /// `segment`'s owner revoked the writer of `fence`: its space is free again.
    pub fn fenced(&mut self, fence: FenceId) {
        if let Some(pending) = self.fences.remove(&fence) {
            for extent in pending.extents {
                self.segments.free(pending.segment, extent);
            }
            if let Some(writer) = pending.writer {
                if let Some(segment) = self.segments.get_mut(pending.segment) {
                    segment.fences_awaited = segment.fences_awaited.saturating_sub(1);
                }
                self.fenced_writer(writer);
            }
        }
    }

    /// Timers: writes past the put timeout are abandoned, replicas whose last lease ended
    /// are freed, unmounts whose grace ended finish, and usage above the high watermark is
    /// evicted.
    pub fn tick(&mut self, now: Instant) {
        let overdue: Vec<String> = self
            .objects
            .iter()
            .filter(|(_, object)| object.write.as_ref().is_some_and(|w| w.deadline <= now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in overdue {
            let Some(object) = self.objects.get_mut(&key) else {
                continue;
            };
            if let Some(write) = object.write.take() {
                if object.complete.is_none() {
                    self.objects.remove(&key);
                }
                self.end_write(write, StoreErrorKind::PutTimedOut);
            }
        }
        self.ended.retain(|_, (until, _)| *until > now);
        self.check_members(now);
        self.announce_term_fences(now);
        self.free_retired(now);
        let since = self.load_decayed.get_or_insert(now);
        if now.saturating_duration_since(*since) >= self.policy.lease_ttl {
            *since = now;
            self.segments.halve_recent_reads();
        }
        let finished: Vec<SegmentId> = self
            .segments
            .iter()
            .filter(|(_, segment)| segment.draining_until.is_some_and(|until| until <= now))
            .map(|(id, _)| id)
            .collect();
        for segment in finished {
            self.retired
                .retain(|(_, replica)| replica.segment != segment);
            self.drop_fences_of(segment);
            self.touched_segment(segment);
            if let Some(gone) = self.segments.remove(segment) {
                if self.segments.owned_by(gone.owner).is_empty() {
                    self.members.remove(&gone.owner);
                }
                self.actions.push_back(MasterAction::Unmounted {
                    segment,
                    owner: gone.owner,
                });
            }
        }
        if self.over_watermark() {
            self.evict(self.eviction_target(), now);
        }
    }

    /// A connection's frame failed its authentication check (the server closed it).
    pub fn count_auth_failure(&mut self) {
        self.counters.auth_failures += 1;
    }

    /// What the master holds.
    pub fn stats(&self) -> MasterStats {
        let complete = self.objects.values().filter_map(|o| o.complete.as_ref());
        MasterStats {
            objects: complete.clone().count() as u64,
            writes: self.objects.values().filter(|o| o.write.is_some()).count() as u64,
            bytes: complete.map(|version| version.size).sum(),
            segments: self
                .segments
                .iter()
                .map(|(id, segment)| SegmentUsage {
                    segment: id,
                    name: segment.spec.name.clone(),
                    host: segment.spec.host.clone(),
                    capacity: segment.space.capacity(),
                    reserved: segment.space.reserved(),
                    extents: segment.space.extents(),
                    draining: segment.draining_until.is_some(),
                    suspected: segment.suspected_since.is_some(),
                })
                .collect(),
            fences_pending: self.fences.len() as u64,
            term: self.term,
            counters: self.counters.clone(),
        }
    }

    /// Abandons `write` (its object already let go of it) for the reason a late put-end
    /// or put-revoke of it is told, until the write could not go on anyway.
    pub(super) fn end_write(&mut self, write: Write, why: StoreErrorKind) {
        let until = after(write.deadline, self.policy.put_timeout);
        self.ended.insert(write.put, (until, why));
        self.abandon(write);
    }

    /// Abandons `write` (its object already let go of it): its space waits for each
    /// segment's owner to fence the writer.
    fn abandon(&mut self, write: Write) {
        self.counters.puts_abandoned += 1;
        let mut by_segment: HashMap<SegmentId, Vec<Extent>> = HashMap::new();
        for replica in write.version.replicas {
            by_segment
                .entry(replica.segment)
                .or_default()
                .push(replica.extent);
        }
        let mut segments: Vec<SegmentId> = by_segment.keys().copied().collect();
        segments.sort();
        for segment in segments {
            let extents = by_segment.remove(&segment).unwrap_or_default();
            let Some(owner) = self.segments.get(segment).map(|s| s.owner) else {
                continue;
            };
            let fence = self.new_fence(PendingFence {
                segment,
                extents,
                writer: None,
            });
            self.actions.push_back(MasterAction::Fence {
                fence,
                segment,
                owner,
                writer: write.writer,
            });
        }
    }

    /// Frees retired replicas whose lease ended.
    fn free_retired(&mut self, now: Instant) {
        let (due, kept): (Vec<_>, Vec<_>) =
            self.retired.drain(..).partition(|(until, _)| *until <= now);
        self.retired = kept;
        for (_, replica) in due {
            self.segments.free(replica.segment, replica.extent);
        }
    }

    fn describe<'r>(
        &self,
        replicas: impl IntoIterator<Item = &'r Replica>,
        size: u64,
    ) -> Vec<ReplicaDescriptor> {
        replicas
            .into_iter()
            .filter_map(|replica| {
                let segment = self.segments.get(replica.segment)?;
                Some(ReplicaDescriptor {
                    segment: replica.segment,
                    segment_name: segment.spec.name.clone(),
                    host: segment.spec.host.clone(),
                    handshake_addr: segment.spec.handshake_addr.clone(),
                    holder: segment.owner,
                    addr: segment.spec.base + replica.extent.offset,
                    len: size,
                    load: segment.recent_reads,
                })
            })
            .collect()
    }
}
