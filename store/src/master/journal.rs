//! What the master writes down so another master can take over: segments and complete
//! objects as records, the writers of each term (whose zombie writes a new term fences
//! before it places anything), and rebuilding a core from those records.
//!
//! The core only tracks what changed ([`MasterCore::take_journal`]); where the records go
//! (etcd, for `railyard master --etcd`) and when a reply may leave (after they are there) is
//! the server's business. A master with no journal pays nothing for it.

use serde::{Deserialize, Serialize};

use std::collections::HashMap;
use std::time::Instant;

use railyard_engine::dataplane::rng::KeyedHasher;
use railyard_engine::dataplane::sabotage::{self, Protection};

use crate::config::MasterPolicy;
use crate::master::core::{FenceId, MasterAction, MasterCore, PendingFence};
use crate::master::objects::{Dirty, Object, PutId, Replica, Version};
use crate::master::segments::{ClientId, Member, SegmentId, SegmentSpec};
use crate::time::after;

/// A mounted segment, as written down.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRecord {
    /// The member that contributed it (its engine incarnation).
    pub owner: ClientId,
    /// What it is.
    pub spec: SegmentSpec,
}

/// One replica of a complete object, as written down.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    /// Its segment.
    pub segment: SegmentId,
    /// Offset of its first byte in the segment.
    pub offset: u64,
}

/// A complete object, as written down.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRecord {
    /// The value's size.
    pub size: u64,
    /// Where its replicas are.
    pub replicas: Vec<ReplicaRecord>,
    /// Never evicted.
    pub hard_pin: bool,
    /// The write that made it (a put-end asked again of a new master answers as the first
    /// did).
    pub put: PutId,
}

/// One change to write down. `None` records are deletions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JournalEntry {
    /// A segment mounted (or gone).
    Segment {
        /// Its id (ids are never reused).
        id: SegmentId,
        /// What it is now.
        record: Option<SegmentRecord>,
    },
    /// A complete object (or gone).
    Object {
        /// Its key.
        key: String,
        /// What it is now.
        record: Option<ObjectRecord>,
    },
    /// `client` started writes in `term`: a later term fences it before placing anything.
    Writer {
        /// The writer.
        client: ClientId,
        /// The term it wrote in.
        term: u64,
    },
    /// `client`'s writes of `term` are fenced on every segment: nobody needs to fence it
    /// again (unless it wrote in a later term, whose record stays).
    ForgetWriter {
        /// The writer.
        client: ClientId,
        /// The term it wrote in.
        term: u64,
    },
}

/// Everything written down, as another master reads it back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Mounted segments by id.
    pub segments: Vec<(SegmentId, SegmentRecord)>,
    /// Complete objects by key.
    pub objects: Vec<(String, ObjectRecord)>,
    /// Writers of earlier terms, with the last term each wrote in.
    pub writers: Vec<(ClientId, u64)>,
}

/// What a rebuild could not take back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RebuildReport {
    /// Segments rebuilt (suspected until their owner is heard).
    pub segments: usize,
    /// Objects rebuilt.
    pub objects: usize,
    /// Replicas dropped: their segment was not written down, or their space overlapped
    /// another's or could not be reserved exactly.
    pub replicas_dropped: usize,
    /// Objects dropped with no replica left.
    pub objects_dropped: usize,
    /// Fences asked of segment owners against earlier terms' writers.
    pub fences: usize,
}

impl MasterCore {
    /// Starts tracking changes for [`Self::take_journal`] (a master with a journal).
    pub fn enable_journal(&mut self) {
        self.dirty.get_or_insert_with(Dirty::default);
    }

    /// What changed since the last call, as records to write down (nothing without
    /// [`Self::enable_journal`]). Deletions come first, then segments, then objects in the
    /// order they were first touched: whatever prefix of them is written (etcd takes a
    /// bounded number per transaction), no record names space that a record still written
    /// down also names.
    pub fn take_journal(&mut self) -> Vec<JournalEntry> {
        let Some(dirty) = self.dirty.as_mut().map(std::mem::take) else {
            return Vec::new();
        };
        let mut deletions = Vec::new();
        let mut segments = Vec::new();
        let mut objects = Vec::new();
        let mut ids: Vec<SegmentId> = dirty.segments.into_iter().collect();
        ids.sort();
        for id in ids {
            let record = self.segments.get(id).map(|segment| SegmentRecord {
                owner: segment.owner,
                spec: segment.spec.clone(),
            });
            match record {
                Some(record) => segments.push(JournalEntry::Segment {
                    id,
                    record: Some(record),
                }),
                None => deletions.push(JournalEntry::Segment { id, record: None }),
            }
        }
        for key in dirty.objects {
            let record = self
                .objects
                .get(&key)
                .and_then(|object| Some((object, object.complete.as_ref()?)))
                .map(|(object, version)| ObjectRecord {
                    size: version.size,
                    replicas: version
                        .replicas
                        .iter()
                        .map(|replica| ReplicaRecord {
                            segment: replica.segment,
                            offset: replica.extent.offset,
                        })
                        .collect(),
                    hard_pin: object.hard_pin,
                    put: version.put,
                });
            match record {
                Some(record) => objects.push(JournalEntry::Object {
                    key,
                    record: Some(record),
                }),
                None => deletions.push(JournalEntry::Object { key, record: None }),
            }
        }
        let mut entries = deletions;
        entries.extend(segments);
        entries.extend(objects);
        for client in dirty.writers {
            entries.push(JournalEntry::Writer {
                client,
                term: self.term,
            });
        }
        for (client, term) in dirty.forgotten {
            entries.push(JournalEntry::ForgetWriter { client, term });
        }
        entries
    }

    /// A core for term `term` from what earlier terms wrote down, its journal on.
    ///
    /// Every segment comes back unconfirmed — read (the engine checks the holder is the
    /// same incarnation), but given no replica — until its owner is heard; an owner not
    /// heard within the grace is gone, as any suspected member.
    /// Each replica's exact space is reserved again; a replica that cannot be (its segment
    /// was not written down, or its space overlaps another's) is dropped. No segment takes
    /// a replica until every writer of an earlier term is fenced there: by itself, attached
    /// with no write in flight ([`Self::quiesced`]), or by the segment's owner
    /// ([`MasterAction::Fence`], asked once the silence bound has passed) — so a write
    /// placed by an earlier master lands nowhere it could hurt.
    pub fn rebuild(
        policy: MasterPolicy,
        snapshot: Snapshot,
        term: u64,
        now: Instant,
    ) -> (Self, RebuildReport) {
        Self::rebuild_keyed(policy, snapshot, term, now, KeyedHasher::random())
    }

    /// [`Self::rebuild`], with tables keyed as [`Self::keyed`] keys them.
    pub fn rebuild_keyed(
        policy: MasterPolicy,
        snapshot: Snapshot,
        term: u64,
        now: Instant,
        tables: KeyedHasher,
    ) -> (Self, RebuildReport) {
        let mut core = Self::keyed(policy, tables);
        core.term = term;
        core.enable_journal();
        let mut report = RebuildReport::default();
        // Each segment's replicas, in order of offset.
        let mut wanted: HashMap<SegmentId, Vec<(u64, u64)>> = HashMap::new();
        for (_, record) in &snapshot.objects {
            for replica in &record.replicas {
                wanted
                    .entry(replica.segment)
                    .or_default()
                    .push((replica.offset, record.size));
            }
        }
        // By segment, offset and size: two records naming the same offset never share one
        // reservation (only the one it was made for takes it).
        let mut reserved: HashMap<(SegmentId, u64, u64), crate::master::space::Extent> =
            HashMap::new();
        for (id, record) in snapshot.segments {
            let mut extents = wanted.remove(&id).unwrap_or_default();
            extents.sort_unstable();
            let owner = record.owner;
            let taken = core.segments.restore(id, owner, record.spec, &extents);
            for ((offset, size), extent) in extents.into_iter().zip(taken) {
                if let Some(extent) = extent {
                    reserved.insert((id, offset, size), extent);
                }
            }
            core.members.entry(owner).or_insert(Member {
                last_heard: now,
                suspected_since: Some(now),
            });
            report.segments += 1;
        }
        for (key, record) in snapshot.objects {
            let replicas: Vec<Replica> = record
                .replicas
                .iter()
                .filter_map(|replica| {
                    let extent = reserved.remove(&(replica.segment, replica.offset, record.size));
                    if extent.is_none() {
                        report.replicas_dropped += 1;
                    }
                    Some(Replica {
                        segment: replica.segment,
                        extent: extent?,
                    })
                })
                .collect();
            if replicas.is_empty() {
                report.objects_dropped += 1;
                core.touched(&key);
                continue;
            }
            if replicas.len() < record.replicas.len() {
                core.touched(&key);
            }
            core.clock += 1;
            core.objects.insert(
                key,
                Object {
                    complete: Some(Version {
                        size: record.size,
                        replicas,
                        put: record.put,
                    }),
                    write: None,
                    // A reader of the earlier term may still be reading it: neither evicted
                    // nor removed (without force) for one lease.
                    lease_until: Some(after(now, core.policy.lease_ttl)),
                    last_used: core.clock,
                    soft_pin_until: None,
                    hard_pin: record.hard_pin,
                },
            );
            report.objects += 1;
        }
        let segments: Vec<(SegmentId, ClientId)> = core
            .segments
            .iter()
            .map(|(id, segment)| (id, segment.owner))
            .collect();
        for (client, written_in) in snapshot.writers {
            if written_in >= term {
                continue;
            }
            let mut pending = 0u32;
            for &(segment, owner) in &segments {
                if owner == client {
                    continue;
                }
                let fence = core.new_fence(PendingFence {
                    segment,
                    extents: Vec::new(),
                    writer: Some(client),
                });
                core.fences_against.entry(client).or_default().push(fence);
                if let Some(segment) = core.segments.get_mut(segment)
                    && !sabotage::is_off(Protection::StoreTermFences)
                {
                    segment.fences_awaited += 1;
                }
                pending += 1;
            }
            report.fences += pending as usize;
            core.old_writers.insert(client, (written_in, pending));
            if pending == 0 {
                core.forget_writer(client);
            }
        }
        // Writers that attach meanwhile fence themselves ([`Self::quiesced`]); the owners
        // are asked to fence the others, which may be stopped with writes in flight.
        if report.fences > 0 {
            core.term_fences_due = Some(after(now, core.policy.member_silence));
            core.term_fences_expire = Some(after(now, core.policy.put_timeout * 2));
        }
        (core, report)
    }

    /// `client`, a writer of an earlier term, attached to this one with none of its writes
    /// in flight any more: no owner needs to fence it.
    pub fn quiesced(&mut self, client: ClientId) {
        self.release_term_fences(client);
        if self.old_writers.contains_key(&client) {
            self.forget_writer(client);
        }
    }

    /// Lets segments take replicas again as far as `client`'s fences go.
    fn release_term_fences(&mut self, client: ClientId) {
        for fence in self.fences_against.remove(&client).unwrap_or_default() {
            let Some(pending) = self.fences.remove(&fence) else {
                continue;
            };
            if let Some(segment) = self.segments.get_mut(pending.segment) {
                segment.fences_awaited = segment.fences_awaited.saturating_sub(1);
            }
        }
    }

    /// Timers: once writers of earlier terms had their time to attach, the owners of the
    /// segments are asked to fence the ones that did not, and asked again every quarter
    /// put timeout while they have not answered; twice the put timeout after the rebuild,
    /// what is still not fenced stops holding segments back.
    pub(super) fn announce_term_fences(&mut self, now: Instant) {
        if self.term_fences_expire.is_some_and(|expire| now >= expire) {
            self.term_fences_expire = None;
            let writers: Vec<ClientId> = self.old_writers.keys().copied().collect();
            for writer in writers {
                tracing::warn!(
                    writer = writer.0,
                    "store master: an earlier term's writer was never fenced on every segment; \
                     its writes are past their put timeout now"
                );
                // Its record stays: a later master fences it again.
                self.release_term_fences(writer);
            }
        }
        if self.term_fences_due.is_none_or(|due| now < due) {
            return;
        }
        self.term_fences_due = None;
        let mut due: Vec<(FenceId, SegmentId, ClientId)> = self
            .fences
            .iter()
            .filter_map(|(&fence, pending)| Some((fence, pending.segment, pending.writer?)))
            .collect();
        due.sort();
        // Asked once, a fence is lost with the owner's connection (a reset, a master it
        // had not attached to yet): the owners are asked again until they answer or the
        // fences expire.
        if !due.is_empty() && self.term_fences_expire.is_some() {
            self.term_fences_due = Some(after(now, self.policy.put_timeout / 4));
        }
        for (fence, segment, writer) in due {
            let Some(owner) = self.segments.get(segment).map(|s| s.owner) else {
                continue;
            };
            self.push_action(MasterAction::Fence {
                fence,
                segment,
                owner,
                writer,
            });
        }
    }

    /// A writer of an earlier term is fenced on every segment: its record may go.
    pub(super) fn forget_writer(&mut self, client: ClientId) {
        self.fences_against.remove(&client);
        if let Some((term, _)) = self.old_writers.remove(&client)
            && let Some(dirty) = self.dirty.as_mut()
        {
            dirty.forgotten.push((client, term));
        }
    }
}
