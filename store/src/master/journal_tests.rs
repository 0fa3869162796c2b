//! The journal on virtual time: what one master writes down, another rebuilds — the same
//! objects at the same addresses, its segments suspected until their owners speak, and no
//! placement on a segment until earlier terms' writers are fenced there.

use std::collections::BTreeMap;

use super::*;
use crate::master::space::Space;

/// etcd, as far as the journal is concerned: the last record of each kind of key.
#[derive(Default)]
struct Written {
    segments: BTreeMap<SegmentId, SegmentRecord>,
    objects: BTreeMap<String, ObjectRecord>,
    writers: BTreeMap<ClientId, u64>,
}

impl Written {
    fn apply(&mut self, entries: Vec<JournalEntry>) {
        for entry in entries {
            match entry {
                JournalEntry::Segment {
                    id,
                    record: Some(r),
                } => {
                    self.segments.insert(id, r);
                }
                JournalEntry::Segment { id, record: None } => {
                    self.segments.remove(&id);
                }
                JournalEntry::Object {
                    key,
                    record: Some(r),
                } => {
                    self.objects.insert(key, r);
                }
                JournalEntry::Object { key, record: None } => {
                    self.objects.remove(&key);
                }
                JournalEntry::Writer { client, term } => {
                    self.writers.insert(client, term);
                }
                JournalEntry::ForgetWriter { client, term } => {
                    if self.writers.get(&client) == Some(&term) {
                        self.writers.remove(&client);
                    }
                }
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            segments: self.segments.clone().into_iter().collect(),
            objects: self.objects.clone().into_iter().collect(),
            writers: self.writers.clone().into_iter().collect(),
        }
    }
}

fn addresses(lease: &ObjectLease) -> Vec<u64> {
    let mut addrs: Vec<u64> = lease.replicas.iter().map(|r| r.addr).collect();
    addrs.sort_unstable();
    addrs
}

#[test]
fn a_new_master_rebuilds_what_the_old_one_wrote_down_and_fences_its_writers_first() {
    let now = Instant::now();
    let mut old = MasterCore::new(MasterPolicy::default());
    old.enable_journal();
    let s0 = old
        .mount_segment(ClientId(100), spec("s0", "a", 1 << 40, 64 * MIB), now)
        .expect("mounts");
    let s1 = old
        .mount_segment(ClientId(101), spec("s1", "b", 1 << 40, 64 * MIB), now)
        .expect("mounts");
    let mut written = Written::default();
    let two = one(2);
    for i in 0..20 {
        put(&mut old, &format!("k{i}"), 4096 + i * 1000, &two, now);
    }
    put(&mut old, "single", 100, &one(1), now);
    old.remove("k3", false, now).expect("removed");
    let pinned = ReplicaConfig {
        hard_pin: true,
        ..one(1)
    };
    put(&mut old, "pinned", 100, &pinned, now);
    // A write whose put-end answer may be lost in the failover.
    let answered = old
        .put_start(WRITER, "answer-lost", 100, &one(1), now)
        .expect("placed");
    old.put_end(WRITER, "answer-lost", answered.put, now)
        .expect("put-end");
    // A write in flight when the old master dies: never half-visible.
    let in_flight = old
        .put_start(WRITER, "in-flight", 4096, &two, now)
        .expect("placed");
    written.apply(old.take_journal());
    assert_eq!(written.segments.len(), 2);
    assert_eq!(
        written.objects.len(),
        22,
        "k3 is gone, in-flight is not there yet"
    );
    assert_eq!(written.writers.keys().collect::<Vec<_>>(), [&WRITER]);
    let before: Vec<(String, Vec<u64>)> = written
        .objects
        .keys()
        .map(|key| {
            (
                key.clone(),
                addresses(&old.get(key, now).expect("readable")),
            )
        })
        .collect();

    let (mut new, report) =
        MasterCore::rebuild(MasterPolicy::default(), written.snapshot(), 2, now);
    assert_eq!(
        report,
        RebuildReport {
            segments: 2,
            objects: 22,
            replicas_dropped: 0,
            objects_dropped: 0,
            fences: 2,
        }
    );
    // Unconfirmed until their owners speak: read (the engine checks who holds them), but
    // given nothing new: a write is told to wait for them, not that it asked too much.
    assert!(new.get("k0", now).is_ok());
    assert_eq!(
        kind(new.put_start(ClientId(8), "early", 4096, &one(1), now)),
        StoreErrorKind::SegmentsNotReady { asked: 1, ready: 0 }
    );
    new.heard(ClientId(100), now);
    new.heard(ClientId(101), now);
    for (key, addrs) in &before {
        assert_eq!(
            &addresses(&new.get(key, now).expect("rebuilt")),
            addrs,
            "{key}"
        );
    }
    assert_eq!(new.exists("k3"), Ok(false));
    assert_eq!(new.exists("in-flight"), Ok(false));
    assert_eq!(
        kind(new.put_end(WRITER, "in-flight", in_flight.put, now)),
        StoreErrorKind::MasterChanged
    );
    // Asked again of the new master, the committed one answers as the first time did.
    new.put_end(WRITER, "answer-lost", answered.put, now)
        .expect("the same answer");
    // No segment takes a replica until the earlier term's writer is fenced on it.
    assert_eq!(
        kind(new.put_start(ClientId(8), "fresh", 4096, &one(1), now)),
        StoreErrorKind::SegmentsNotReady { asked: 1, ready: 0 }
    );
    // The owners are asked to fence it only once it had the silence bound to attach and
    // say it has nothing in flight.
    assert_eq!(new.next_action(), None);
    let later = now + MasterPolicy::default().member_silence;
    new.tick(later);
    new.heard(ClientId(100), later);
    new.heard(ClientId(101), later);
    let fences: Vec<(FenceId, SegmentId, ClientId)> = std::iter::from_fn(|| new.next_action())
        .filter_map(|action| match action {
            MasterAction::Fence {
                fence,
                segment,
                writer,
                ..
            } => Some((fence, segment, writer)),
            _ => None,
        })
        .collect();
    assert_eq!(fences.len(), 2);
    assert!(fences.iter().all(|(_, _, writer)| *writer == WRITER));
    new.fenced(fences[0].0);
    // The second owner's answer is lost (say, with its connection): it is asked again,
    // and only it.
    let again = later + MasterPolicy::default().put_timeout / 4;
    new.heard(ClientId(100), again);
    new.heard(ClientId(101), again);
    new.tick(again);
    let asked_again: Vec<FenceId> = std::iter::from_fn(|| new.next_action())
        .filter_map(|action| match action {
            MasterAction::Fence { fence, .. } => Some(fence),
            _ => None,
        })
        .collect();
    assert_eq!(asked_again, [fences[1].0]);
    let ticket = new
        .put_start(ClientId(8), "fresh", 4096, &one(1), again)
        .expect("the fenced segment takes it");
    assert_eq!(ticket.replicas[0].segment, fences[0].1);
    assert_eq!(ticket.put.0 >> 32, 2, "put ids carry the term");
    new.fenced(fences[1].0);
    // Fenced everywhere: the old writer's record may go; the new writer's is written.
    written.apply(new.take_journal());
    assert_eq!(written.writers.keys().collect::<Vec<_>>(), [&ClientId(8)]);
    // New writes never land on rebuilt replicas' space.
    let rebuilt: Vec<(SegmentId, u64, u64)> = before
        .iter()
        .flat_map(|(key, _)| {
            let lease = new.get(key, now).expect("rebuilt");
            lease
                .replicas
                .into_iter()
                .map(move |r| (r.segment, r.addr, lease.size))
        })
        .collect();
    for i in 0..200 {
        let key = format!("new-{i}");
        let ticket = new
            .put_start(ClientId(8), &key, 8192, &two, later)
            .expect("placed");
        for replica in &ticket.replicas {
            let clash = rebuilt.iter().find(|(segment, addr, size)| {
                *segment == replica.segment
                    && replica.addr < addr + size
                    && *addr < replica.addr + 8192
            });
            assert!(
                clash.is_none(),
                "{key} overlaps the rebuilt replica {clash:?}"
            );
        }
        new.put_end(ClientId(8), &key, ticket.put, now)
            .expect("put-end");
    }
    assert!(s0 < s1, "ids kept their order");
}

#[test]
fn restored_space_puts_each_extent_where_it_was_and_refuses_overlaps() {
    // Near the end of the segment the allocator's size classes refuse requests close to
    // what is left: those are reserved in pieces, still exactly where they were.
    let near_end = (1 << 20) - 3 * 4096 - 640;
    let at_end = (1 << 20) - 4096 - 64 * 7;
    let (mut space, taken) = Space::restore(
        1 << 20,
        &[
            (0, 100),
            (4096, 5000),
            (4096 + 64, 10),
            (65536, 4096),
            (near_end, 700),
            (at_end, 4096 + 64 * 7),
            (1 << 20, 64),
        ],
    );
    let offsets: Vec<Option<u64>> = taken.iter().map(|e| e.as_ref().map(|e| e.offset)).collect();
    assert_eq!(
        offsets,
        [
            Some(0),
            Some(4096),
            None,
            Some(65536),
            Some(near_end),
            Some(at_end),
            None
        ]
    );
    // The gaps are free again, the extents are not.
    let lens = [100, 5000, 10, 4096, 700, 4096 + 64 * 7, 64];
    let mut fresh = Vec::new();
    while let Some(extent) = space.allocate(4096) {
        for (kept, len) in taken.iter().zip(lens) {
            if let Some(kept) = kept {
                assert!(
                    extent.offset + 4096 <= kept.offset || kept.offset + len <= extent.offset,
                    "{} overlaps {}",
                    extent.offset,
                    kept.offset
                );
            }
        }
        fresh.push(extent);
    }
    assert!(fresh.len() > 200, "the gaps were freed: {}", fresh.len());
    for extent in fresh {
        space.free(extent);
    }
    for extent in taken.into_iter().flatten() {
        space.free(extent);
    }
    assert!(space.is_empty());
}

#[test]
fn a_writer_that_attaches_with_nothing_in_flight_is_not_fenced_by_the_owners() {
    let now = Instant::now();
    let mut old = MasterCore::new(MasterPolicy::default());
    old.enable_journal();
    for (owner, name) in [(100, "s0"), (101, "s1")] {
        old.mount_segment(ClientId(owner), spec(name, name, 1 << 40, 64 * MIB), now)
            .expect("mounts");
    }
    put(&mut old, "k", 4096, &one(2), now);
    let mut written = Written::default();
    written.apply(old.take_journal());
    let (mut new, report) =
        MasterCore::rebuild(MasterPolicy::default(), written.snapshot(), 5, now);
    assert_eq!(report.fences, 2);
    new.heard(ClientId(100), now);
    new.heard(ClientId(101), now);
    new.quiesced(WRITER);
    let later = now + MasterPolicy::default().member_silence;
    new.heard(ClientId(100), later);
    new.heard(ClientId(101), later);
    new.tick(later);
    assert_eq!(new.next_action(), None, "no owner is asked to fence it");
    new.put_start(WRITER, "again", 4096, &one(2), later)
        .expect("both segments take writes");
    written.apply(new.take_journal());
    assert_eq!(
        written.writers.get(&WRITER),
        Some(&5),
        "its record names the new term"
    );
}

#[test]
fn an_earlier_masters_fence_reported_to_a_new_one_completes_none_of_its_fences() {
    let now = Instant::now();
    let policy = MasterPolicy::default();
    let mut old = MasterCore::new(policy.clone());
    old.enable_journal();
    for (owner, name) in [(100, "s0"), (101, "s1")] {
        old.mount_segment(ClientId(owner), spec(name, name, 1 << 40, 64 * MIB), now)
            .expect("mounts");
    }
    put(&mut old, "done", 4096, &one(2), now);
    // A write left behind: past the put timeout the old master asks the owners to fence.
    old.put_start(WRITER, "left", 4096, &one(2), now)
        .expect("put-start");
    old.tick(now + policy.put_timeout);
    let Some(MasterAction::Fence { fence, owner, .. }) = old.next_action() else {
        panic!("the owners are asked to fence the writer");
    };
    let mut written = Written::default();
    written.apply(old.take_journal());
    let (mut new, report) = MasterCore::rebuild(policy.clone(), written.snapshot(), 5, now);
    assert_eq!(
        report.fences, 2,
        "one per segment against the earlier writer"
    );
    new.heard(ClientId(100), now);
    new.heard(ClientId(101), now);
    // The owner reports the old master's fence to the new one (after it attached again).
    assert_eq!(
        new.fence_owner(fence),
        None,
        "not one of this term's fences"
    );
    new.fenced(fence);
    assert_eq!(
        kind(new.put_start(ClientId(7), "next", 4096, &one(1), now)),
        StoreErrorKind::SegmentsNotReady { asked: 1, ready: 0 },
        "both segments still wait for {owner:?}'s and the other owner's fences"
    );
}
