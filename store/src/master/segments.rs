//! Mounted segments: who contributed each, where it lives, its free space, and on which
//! segments a new object's replicas go (placement).

use serde::{Deserialize, Serialize};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use railyard_engine::dataplane::rng::SplitMix64;

use crate::config::ReplicaConfig;
use crate::error::{StoreError, StoreErrorKind};
use crate::master::space::{Extent, GRANULE, MAX_SEGMENT_BYTES, Space};

/// A mounted segment, as the master names it. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SegmentId(pub u64);

/// A process taking part in the store, by its engine incarnation: what its engine's peers
/// call it, so a segment's owner can fence it ([`crate::master::MasterAction::Fence`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClientId(pub u64);

/// What the master knows of a member's liveness (see `members.rs`).
pub(crate) struct Member {
    /// When a frame from it last arrived.
    pub(crate) last_heard: Instant,
    /// When it went silent or lost its connection (none while alive).
    pub(crate) suspected_since: Option<Instant>,
}

/// Memory a process contributes: registered with its engine, readable and writable by every
/// member through it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentSpec {
    /// A name unique in the cluster.
    pub name: String,
    /// The host it lives on (replicas of one object go to different hosts when they can).
    pub host: String,
    /// Its owner engine's handshake address: where writers and readers connect.
    pub handshake_addr: String,
    /// Address of its first byte in the owner's address space (as registered).
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// A mounted segment.
pub(crate) struct Segment {
    pub(crate) spec: SegmentSpec,
    pub(crate) owner: ClientId,
    pub(crate) space: Space,
    /// Set by an unmount: takes no new replicas, and goes at this time.
    pub(crate) draining_until: Option<Instant>,
    /// Its owner went silent or lost its connection then: no replica is placed on it and
    /// no reader is pointed at it until the owner is heard again (or is declared gone).
    pub(crate) suspected_since: Option<Instant>,
    /// Reads pointed at it lately (halved every lease period).
    pub(crate) recent_reads: u64,
    /// Fences against an earlier term's writers still awaited: until none, it takes no
    /// replica (see `journal.rs`).
    pub(crate) fences_awaited: u32,
    /// Rebuilt by a new master and its owner not heard yet: readers may try it (the
    /// engine checks the holder's incarnation), writes wait for the owner.
    pub(crate) unconfirmed: bool,
}

impl Segment {
    fn new(spec: SegmentSpec, owner: ClientId, space: Space, unconfirmed: bool) -> Self {
        Self {
            space,
            spec,
            owner,
            draining_until: None,
            suspected_since: None,
            recent_reads: 0,
            fences_awaited: 0,
            unconfirmed,
        }
    }

    /// Whether new replicas may go here.
    fn takes_writes(&self) -> bool {
        self.draining_until.is_none()
            && self.suspected_since.is_none()
            && self.fences_awaited == 0
            && !self.unconfirmed
    }

    /// Whether it will take writes once its owner is heard again after a failover, or the
    /// fences against the earlier term's writers are done — not gone, draining or suspected.
    fn takes_writes_soon(&self) -> bool {
        !self.takes_writes()
            && self.draining_until.is_none()
            && self.suspected_since.is_none()
            && (self.unconfirmed || self.fences_awaited > 0)
    }

    fn free_bytes(&self) -> u64 {
        self.space.capacity() - self.space.reserved()
    }
}

/// Every mounted segment.
pub(crate) struct Segments {
    by_id: BTreeMap<SegmentId, Segment>,
    by_name: HashMap<String, SegmentId>,
    next: u64,
    /// Placement's random choices (a fixed seed keeps the core deterministic).
    random: SplitMix64,
}

impl Default for Segments {
    fn default() -> Self {
        Self {
            by_id: BTreeMap::new(),
            by_name: HashMap::new(),
            next: 0,
            random: SplitMix64::new(0x5eed_5e97_e475),
        }
    }
}

impl Segments {
    /// Mounts `spec` for `owner`.
    pub(crate) fn mount(
        &mut self,
        owner: ClientId,
        spec: SegmentSpec,
    ) -> Result<SegmentId, StoreError> {
        let invalid = |reason: String| {
            StoreError::new(
                "",
                StoreErrorKind::InvalidSegment {
                    segment: spec.name.clone(),
                    reason,
                },
            )
        };
        if spec.name.is_empty() {
            return Err(invalid("empty name".into()));
        }
        if spec.size < GRANULE {
            return Err(invalid(format!("{} bytes; at least {GRANULE}", spec.size)));
        }
        if spec.size > MAX_SEGMENT_BYTES {
            return Err(invalid(format!(
                "{} bytes; at most {MAX_SEGMENT_BYTES}",
                spec.size
            )));
        }
        let Some(end) = spec.base.checked_add(spec.size) else {
            return Err(invalid("base + size overflows the address space".into()));
        };
        if self.by_name.contains_key(&spec.name) {
            return Err(StoreError::new(
                "",
                StoreErrorKind::SegmentExists {
                    segment: spec.name.clone(),
                },
            ));
        }
        if let Some(other) = self.by_id.values().find(|other| {
            other.owner == owner
                && spec.base < other.spec.base + other.spec.size
                && other.spec.base < end
        }) {
            return Err(invalid(format!(
                "overlaps segment {:?} of the same process",
                other.spec.name
            )));
        }
        let id = SegmentId(self.next);
        self.next += 1;
        self.by_name.insert(spec.name.clone(), id);
        let space = Space::new(spec.size);
        self.by_id
            .insert(id, Segment::new(spec, owner, space, false));
        Ok(id)
    }

    /// Mounts a segment written down by an earlier master under its old `id`, unconfirmed
    /// until its owner is heard, with each of `extents` (offset, bytes; by
    /// offset) reserved exactly where it was — `None` for one that cannot be (it overlaps
    /// the one before, or lies outside the segment).
    pub(crate) fn restore(
        &mut self,
        id: SegmentId,
        owner: ClientId,
        spec: SegmentSpec,
        extents: &[(u64, u64)],
    ) -> Vec<Option<Extent>> {
        let (space, taken) = Space::restore(spec.size, extents);
        self.next = self.next.max(id.0 + 1);
        self.by_name.insert(spec.name.clone(), id);
        self.by_id
            .insert(id, Segment::new(spec, owner, space, true));
        taken
    }

    /// Forgets `id` (its extents die with it).
    pub(crate) fn remove(&mut self, id: SegmentId) -> Option<Segment> {
        let segment = self.by_id.remove(&id)?;
        self.by_name.remove(&segment.spec.name);
        Some(segment)
    }

    pub(crate) fn get(&self, id: SegmentId) -> Option<&Segment> {
        self.by_id.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: SegmentId) -> Option<&mut Segment> {
        self.by_id.get_mut(&id)
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<SegmentId> {
        self.by_name.get(name).copied()
    }

    /// The segment named `name`, else every segment the member (engine) named `name`
    /// mounted: a client's segments are named `{member}@{incarnation}#{n}`, and callers
    /// prefer a member by the name they gave it.
    pub(crate) fn named(&self, name: &str) -> Vec<SegmentId> {
        if let Some(id) = self.by_name(name) {
            return vec![id];
        }
        self.by_id
            .iter()
            .filter(|(_, segment)| {
                // The member's name is all before the last '@' (it may hold '@' itself).
                segment
                    .spec
                    .name
                    .rsplit_once('@')
                    .is_some_and(|(member, _)| member == name)
            })
            .map(|(&id, _)| id)
            .collect()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.by_id.iter().map(|(&id, segment)| (id, segment))
    }

    /// Halves every segment's count of recent reads.
    pub(crate) fn halve_recent_reads(&mut self) {
        for segment in self.by_id.values_mut() {
            segment.recent_reads /= 2;
        }
    }

    /// Returns `extent` to `segment`'s space (dropped if the segment is gone).
    pub(crate) fn free(&mut self, segment: SegmentId, extent: Extent) {
        if let Some(segment) = self.by_id.get_mut(&segment) {
            segment.space.free(extent);
        }
    }

    /// Segments that take new replicas: neither draining nor suspected.
    fn writable(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.iter().filter(|(_, segment)| segment.takes_writes())
    }

    /// Whether new replicas may go to `id`.
    pub(crate) fn writable_id(&self, id: SegmentId) -> bool {
        self.by_id.get(&id).is_some_and(Segment::takes_writes)
    }

    /// Whether readers may be pointed at `id`: mounted, and its owner not suspected.
    pub(crate) fn readable(&self, id: SegmentId) -> bool {
        self.by_id
            .get(&id)
            .is_some_and(|segment| segment.suspected_since.is_none())
    }

    /// The segments `owner` contributed.
    pub(crate) fn owned_by(&self, owner: ClientId) -> Vec<SegmentId> {
        self.iter()
            .filter(|(_, segment)| segment.owner == owner)
            .map(|(id, _)| id)
            .collect()
    }

    /// (capacity, reserved) of all segments that take new replicas.
    pub(crate) fn usage(&self) -> (u64, u64) {
        self.writable()
            .fold((0, 0), |(capacity, reserved), (_, s)| {
                (capacity + s.space.capacity(), reserved + s.space.reserved())
            })
    }

    /// How many replicas of `size` bytes to place (on segments not owned at an address in
    /// `avoid`): `config.replica_num`, or with `config.best_effort` as many as there are
    /// segments that could hold one (at least one). An error when that many can never be
    /// placed — or, right after a failover, [`StoreErrorKind::SegmentsNotReady`] when more
    /// could once the segments' owners are heard and the earlier term's writers fenced.
    pub(crate) fn replicas_for(
        &self,
        size: u64,
        config: &ReplicaConfig,
        avoid: &[String],
    ) -> Result<usize, StoreErrorKind> {
        if size == 0 {
            return Err(StoreErrorKind::EmptyValue);
        }
        if config.replica_num == 0 {
            return Err(StoreErrorKind::NoReplicas);
        }
        let eligible = |segment: &Segment| {
            segment.space.capacity() >= size && !avoid.contains(&segment.spec.handshake_addr)
        };
        let holding = self.writable().filter(|(_, s)| eligible(s)).count();
        let soon = self
            .iter()
            .filter(|(_, s)| s.takes_writes_soon() && eligible(s))
            .count();
        let enough = |segments: usize| {
            segments >= config.replica_num || (config.best_effort && segments > 0)
        };
        if holding >= config.replica_num {
            return Ok(config.replica_num);
        }
        // Fewer than asked take writes now, more will soon: wait for them rather than
        // writing fewer replicas (best effort) or refusing.
        if soon > 0 && enough(holding + soon) {
            return Err(StoreErrorKind::SegmentsNotReady {
                asked: config.replica_num,
                ready: holding,
            });
        }
        if config.best_effort && holding > 0 {
            return Ok(holding);
        }
        let largest = self
            .writable()
            .map(|(_, s)| s.space.capacity())
            .max()
            .unwrap_or(0);
        if size > largest && enough(self.writable().count()) {
            return Err(StoreErrorKind::ValueTooLarge { size, largest });
        }
        Err(StoreErrorKind::TooManyReplicas {
            asked: config.replica_num,
            segments: holding,
        })
    }

    /// Reserves `replicas` extents of `size` bytes on as many different segments
    /// (none owned at a handshake address in `avoid`): the preferred ones first (in order), then segments on hosts no replica is on yet, then
    /// any. Among the others each replica goes to the better of two segments drawn at random
    /// (more free bytes, then fewer recent reads): new objects spread by free space and load,
    /// and an empty segment that just joined draws its share, not every put. All or
    /// nothing: `None` when they do not fit.
    pub(crate) fn place(
        &mut self,
        size: u64,
        replicas: usize,
        config: &ReplicaConfig,
        avoid: &[String],
    ) -> Option<Vec<(SegmentId, Extent)>> {
        let preferred: Vec<SegmentId> = config
            .preferred_segments
            .iter()
            .flat_map(|name| self.named(name))
            .filter(|id| {
                let segment = &self.by_id[id];
                segment.takes_writes() && !avoid.contains(&segment.spec.handshake_addr)
            })
            .collect();
        let mut placed: Vec<(SegmentId, Extent)> = Vec::with_capacity(replicas);
        let mut hosts: HashSet<String> = HashSet::new();
        for &id in &preferred {
            if placed.len() == replicas {
                break;
            }
            // Named twice, it still holds one replica.
            if placed.iter().any(|(used, _)| *used == id) {
                continue;
            }
            let segment = self.by_id.get_mut(&id)?;
            if let Some(extent) = segment.space.allocate(size) {
                hosts.insert(segment.spec.host.clone());
                placed.push((id, extent));
            }
        }
        // First pass: a new host for each replica; second: any segment not used yet.
        for distinct_hosts in [true, false] {
            let mut candidates: Vec<SegmentId> = self
                .writable()
                .filter(|(id, segment)| {
                    let used = placed.iter().any(|(used, _)| used == id);
                    let host_taken = distinct_hosts && hosts.contains(&segment.spec.host);
                    let avoided = avoid.contains(&segment.spec.handshake_addr);
                    !used && !host_taken && !avoided && segment.free_bytes() >= size
                })
                .map(|(id, _)| id)
                .collect();
            while placed.len() < replicas && !candidates.is_empty() {
                let pick = self.better_of_two(&candidates);
                let id = candidates.swap_remove(pick);
                let segment = self.by_id.get_mut(&id)?;
                // Free bytes may be fragmented: a segment that cannot hold it is skipped.
                let Some(extent) = segment.space.allocate(size) else {
                    continue;
                };
                let host = segment.spec.host.clone();
                placed.push((id, extent));
                if distinct_hosts {
                    candidates.retain(|other| self.by_id[other].spec.host != host);
                }
                hosts.insert(host);
            }
        }
        if placed.len() < replicas {
            for (id, extent) in placed {
                self.free(id, extent);
            }
            return None;
        }
        Some(placed)
    }

    /// The index in `candidates` (not empty) of the better of two drawn at random: more free
    /// bytes, then fewer recent reads.
    fn better_of_two(&mut self, candidates: &[SegmentId]) -> usize {
        let first = self.random.below(candidates.len() as u64) as usize;
        let second = self.random.below(candidates.len() as u64) as usize;
        let score = |index: usize| {
            let segment = &self.by_id[&candidates[index]];
            (
                segment.free_bytes(),
                std::cmp::Reverse(segment.recent_reads),
            )
        };
        if score(second) > score(first) {
            second
        } else {
            first
        }
    }
}
