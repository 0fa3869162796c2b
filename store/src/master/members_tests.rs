//! Members' liveness on virtual time: suspected and heard again, gone past the grace, a new
//! incarnation at a dead member's address, and placement that does not herd onto an empty
//! segment.

use super::*;

const SILENCE: Duration = Duration::from_millis(1500);
const GRACE: Duration = Duration::from_secs(10);

/// Members 100 and 101, each with one 64 MiB segment (`s0`, `s1`) on its own host, heard at
/// `now`; a 1.5 s silence bound and a 10 s grace.
fn two_members(now: Instant) -> (MasterCore, [SegmentId; 2]) {
    let mut core = MasterCore::new(MasterPolicy {
        member_silence: SILENCE,
        suspect_grace: GRACE,
        ..MasterPolicy::default()
    });
    let s0 = core
        .mount_segment(ClientId(100), spec("s0", "a", 1 << 40, 64 * MIB), now)
        .expect("mounts");
    let s1 = core
        .mount_segment(ClientId(101), spec("s1", "b", 1 << 40, 64 * MIB), now)
        .expect("mounts");
    (core, [s0, s1])
}

fn on(segment: &str) -> ReplicaConfig {
    ReplicaConfig {
        preferred_segments: vec![segment.into()],
        ..ReplicaConfig::default()
    }
}

fn segments_of_ticket(ticket: &PutTicket) -> Vec<SegmentId> {
    ticket.replicas.iter().map(|r| r.segment).collect()
}

fn segments_of(lease: &ObjectLease) -> Vec<SegmentId> {
    lease.replicas.iter().map(|r| r.segment).collect()
}

#[test]
fn a_silent_member_is_suspected_and_heard_again_keeps_its_data() {
    let now = Instant::now();
    let (mut core, [s0, s1]) = two_members(now);
    put(&mut core, "on-s0", 4096, &on("s0"), now);
    put(&mut core, "on-s1", 4096, &on("s1"), now);
    let both = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    put(&mut core, "on-both", 4096, &both, now);

    // Member 101 keeps speaking; 100 falls silent.
    let t = now + SILENCE - Duration::from_millis(100);
    core.heard(ClientId(101), t);
    core.tick(t);
    assert!(
        core.stats().segments.iter().all(|s| !s.suspected),
        "not yet"
    );
    let t = now + SILENCE;
    core.heard(ClientId(101), t);
    core.tick(t);
    let suspected: Vec<bool> = core.stats().segments.iter().map(|s| s.suspected).collect();
    assert_eq!(suspected, [true, false]);
    assert_eq!(core.stats().counters.members_suspected, 1);

    // No reader is pointed at it, and no write placed on it — even one that prefers it.
    assert_eq!(kind(core.get("on-s0", t)), StoreErrorKind::NotFound);
    assert_eq!(core.exists("on-s0"), Ok(false));
    assert_eq!(
        segments_of(&core.get("on-both", t).expect("one left")),
        [s1]
    );
    for i in 0..8 {
        let ticket = core
            .put_start(WRITER, &format!("new-{i}"), 4096, &on("s0"), t)
            .expect("placed");
        assert_eq!(ticket.replicas[0].segment, s1);
    }
    assert!(matches!(
        kind(core.put_start(WRITER, "two", 4096, &both, t)),
        StoreErrorKind::TooManyReplicas { .. }
    ));
    // Best effort, it is written to the one segment that takes writes.
    let best_effort = ReplicaConfig {
        best_effort: true,
        ..both.clone()
    };
    let ticket = core
        .put_start(WRITER, "two", 4096, &best_effort, t)
        .expect("placed on fewer");
    assert_eq!(segments_of_ticket(&ticket), [s1]);
    core.put_end(WRITER, "two", ticket.put, t).expect("ends");
    assert_eq!(segments_of(&core.get("two", t).expect("one replica")), [s1]);

    // The same incarnation speaks again within the grace: its data serves as before.
    let back = t + GRACE - Duration::from_millis(1);
    core.heard(ClientId(100), back);
    core.heard(ClientId(101), back);
    core.tick(back);
    assert_eq!(segments_of(&core.get("on-s0", back).expect("back")), [s0]);
    assert_eq!(core.get("on-both", back).expect("both").replicas.len(), 2);
    assert_eq!(core.stats().counters.members_lost, 0);
}

#[test]
fn a_member_suspected_past_the_grace_is_gone_with_its_replicas_and_the_writes_into_them() {
    let now = Instant::now();
    let (mut core, [_, s1]) = two_members(now);
    put(&mut core, "on-s0", 4096, &on("s0"), now);
    let both = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    put(&mut core, "on-both", 4096, &both, now);
    let writing = core
        .put_start(WRITER, "writing", 8192, &both, now)
        .expect("placed");
    let before = reserved(&core);

    // Its connection drops: suspected at once, not after the silence bound.
    core.disconnected(ClientId(100), now);
    assert!(core.stats().segments[0].suspected);
    core.heard(ClientId(101), now + GRACE);
    core.tick(now + GRACE);

    let stats = core.stats();
    assert_eq!(stats.segments.len(), 1, "s0 is forgotten");
    assert_eq!(stats.counters.members_lost, 1);
    let actions: Vec<MasterAction> = std::iter::from_fn(|| core.next_action()).collect();
    assert!(
        actions.contains(&MasterAction::MemberGone {
            client: ClientId(100)
        }),
        "{actions:?}"
    );
    assert_eq!(
        kind(core.get("on-s0", now + GRACE)),
        StoreErrorKind::NotFound
    );
    assert_eq!(core.exists("on-s0"), Ok(false));
    assert_eq!(
        segments_of(&core.get("on-both", now + GRACE).expect("kept")),
        [s1]
    );
    // The write into it ends saying why; its replica on s1 waits for s1's owner's fence.
    assert_eq!(
        kind(core.put_end(WRITER, "writing", writing.put, now + GRACE)),
        StoreErrorKind::ReplicaLost {
            segment: "s0".into()
        }
    );
    let fences: Vec<(SegmentId, ClientId)> = actions
        .iter()
        .filter_map(|action| match action {
            MasterAction::Fence { segment, owner, .. } => Some((*segment, *owner)),
            _ => None,
        })
        .collect();
    assert_eq!(fences, [(s1, ClientId(101))]);
    assert_eq!(
        reserved(&core),
        before - 4096 - 4096 - 8192,
        "s0's space is gone with it; the write's replica on s1 waits for its fence"
    );
    // Heard again afterwards, it is nothing: gone is gone.
    core.heard(ClientId(100), now + GRACE);
    assert_eq!(core.stats().segments.len(), 1);
}

#[test]
fn another_incarnation_at_a_members_address_replaces_it_with_an_empty_segment() {
    let now = Instant::now();
    let (mut core, [s0, _]) = two_members(now);
    put(&mut core, "on-s0", 4096, &on("s0"), now);
    // Not even suspected yet: a process that answers at its address as another incarnation
    // proves it is gone (its port was taken).
    let newcomer = core
        .mount_segment(ClientId(200), spec("s0", "a", 1 << 40, 64 * MIB), now)
        .expect("mounts in its place");
    assert_ne!(newcomer, s0);
    assert_eq!(kind(core.get("on-s0", now)), StoreErrorKind::NotFound);
    let usage = core
        .stats()
        .segments
        .into_iter()
        .find(|s| s.segment == newcomer)
        .expect("mounted");
    assert_eq!(
        usage.reserved, 0,
        "a new incarnation is a new, empty segment"
    );
    assert_eq!(core.stats().counters.members_lost, 1);

    // A live member's segment name is not taken over from another address.
    let mut other = spec("s1", "c", 1 << 40, 64 * MIB);
    other.handshake_addr = "elsewhere:7000".into();
    assert!(matches!(
        kind(core.mount_segment(ClientId(300), other, now)),
        StoreErrorKind::SegmentExists { .. }
    ));
}

#[test]
fn a_dead_readers_lease_ends_with_its_ttl() {
    let now = Instant::now();
    let (mut core, _) = two_members(now);
    put(&mut core, "k", 4096, &on("s0"), now);
    core.get("k", now).expect("leased");
    // The reader (not a member) dies; its lease holds the object for its TTL, no longer.
    let ttl = MasterPolicy::default().lease_ttl;
    core.heard(ClientId(100), now + ttl);
    assert_eq!(
        kind(core.remove("k", false, now + ttl - Duration::from_millis(1))),
        StoreErrorKind::HasLease
    );
    core.remove("k", false, now + ttl).expect("the lease ended");
}

#[test]
fn a_segment_that_joins_empty_draws_its_share_of_puts_not_all_of_them() {
    let now = Instant::now();
    let (mut core, _) = master(
        MasterPolicy::default(),
        &[64 * MIB, 64 * MIB, 64 * MIB, 64 * MIB],
        &["a", "b", "c", "d"],
    );
    for i in 0..64 {
        put(&mut core, &format!("old-{i}"), 256 << 10, &one(1), now);
    }
    let joined = core
        .mount_segment(ClientId(9), spec("joined", "e", 1 << 40, 64 * MIB), now)
        .expect("mounts");
    let mut to_joined = 0;
    for i in 0..400 {
        let ticket = core
            .put_start(WRITER, &format!("new-{i}"), 4096, &one(1), now)
            .expect("placed");
        to_joined += usize::from(ticket.replicas[0].segment == joined);
    }
    // The better of two draws among five: about 36 %. Emptiest-first would send all 400.
    assert!(
        (80..240).contains(&to_joined),
        "{to_joined} of 400 puts went to the empty newcomer"
    );
}

#[test]
fn what_a_writer_avoids_is_never_placed_on_and_never_evicts_for_nothing() {
    let now = Instant::now();
    let (mut core, [s0, s1]) = two_members(now);
    for i in 0..8 {
        put(&mut core, &format!("old-{i}"), MIB, &on("s1"), now);
    }
    let both = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    let avoid = vec!["s1.b:7000".to_owned()];
    // Two replicas cannot go anywhere but s1: refused at once, nothing evicted for it.
    assert!(matches!(
        kind(core.start(WRITER, "two", 4096, &both, false, &avoid, now)),
        StoreErrorKind::TooManyReplicas { .. }
    ));
    assert_eq!(core.stats().counters.evictions, 0);
    assert_eq!(core.stats().objects, 8);
    let ticket = core
        .start(WRITER, "one", 4096, &on("s1"), false, &avoid, now)
        .expect("placed");
    assert_eq!(ticket.replicas[0].segment, s0);
    // A segment named twice among the preferred still holds one replica.
    let twice = ReplicaConfig {
        replica_num: 2,
        preferred_segments: vec!["s0".into(), "s0".into()],
        ..ReplicaConfig::default()
    };
    let ticket = core
        .put_start(WRITER, "twice", 4096, &twice, now)
        .expect("placed");
    let mut segments: Vec<SegmentId> = ticket.replicas.iter().map(|r| r.segment).collect();
    segments.sort();
    assert_eq!(segments, [s0, s1]);
}

#[test]
fn a_mount_that_is_refused_replaces_nobody() {
    let now = Instant::now();
    let (mut core, [s0, _]) = two_members(now);
    put(&mut core, "on-s0", 4096, &on("s0"), now);
    // At member 100's address, but not a segment that can be mounted.
    let refused = core.mount_segment(ClientId(300), spec("s0", "a", 1 << 40, 10), now);
    assert!(matches!(
        kind(refused),
        StoreErrorKind::InvalidSegment { .. }
    ));
    assert_eq!(
        segments_of(&core.get("on-s0", now).expect("still there")),
        [s0]
    );
    assert_eq!(core.stats().counters.members_lost, 0);
}

#[test]
fn a_write_removed_by_force_and_an_object_no_one_can_read_say_so() {
    let now = Instant::now();
    let (mut core, _) = two_members(now);
    let writing = core
        .put_start(WRITER, "writing", 4096, &on("s0"), now)
        .expect("placed");
    core.remove("writing", true, now).expect("forced");
    assert_eq!(
        kind(core.put_end(WRITER, "writing", writing.put, now)),
        StoreErrorKind::PutRemoved
    );
    // Every replica on a suspected segment: not found for readers, so a writer may put it
    // again (on a live segment) instead of being told it exists.
    put(&mut core, "cached", 4096, &on("s0"), now);
    core.disconnected(ClientId(100), now);
    assert_eq!(kind(core.get("cached", now)), StoreErrorKind::NotFound);
    put(&mut core, "cached", 4096, &on("s1"), now);
    assert_eq!(core.get("cached", now).expect("refilled").replicas.len(), 1);
    // Lost past the grace, the member is told its segment is no longer the store's.
    core.tick(now + GRACE);
    let actions: Vec<MasterAction> = std::iter::from_fn(|| core.next_action()).collect();
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, MasterAction::Unmounted { owner, .. } if *owner == ClientId(100))),
        "{actions:?}"
    );
}
