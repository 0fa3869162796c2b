//! The master core on virtual time: two-phase writes, leases against remove and eviction,
//! eviction order and watermarks, pins, placement across hosts, fences of abandoned writes,
//! unmounts, bad input — and space accounting under 100 k random operations.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use railyard_dataplane::rng::SplitMix64;

use super::*;
use crate::config::{MasterPolicy, ReplicaConfig};
use crate::error::{MAX_KEY_LEN, StoreError, StoreErrorKind};

const MIB: u64 = 1 << 20;
const WRITER: ClientId = ClientId(7);
const OWNER: ClientId = ClientId(1);

fn spec(name: &str, host: &str, base: u64, size: u64) -> SegmentSpec {
    SegmentSpec {
        name: name.into(),
        host: host.into(),
        // One process per segment: each its own handshake address.
        handshake_addr: format!("{name}.{host}:7000"),
        base,
        size,
    }
}

/// Long enough that no member of a test falls silent: tests of liveness set their own.
const NEVER_SILENT: Duration = Duration::from_secs(86_400 * 365);

/// A master with `sizes.len()` segments, segment `i` named `s{i}` on host `hosts[i]`, each
/// contributed by its own member (`ClientId(100 + i)`). Members are never suspected unless
/// `policy` bounds their silence below [`NEVER_SILENT`].
fn master(policy: MasterPolicy, sizes: &[u64], hosts: &[&str]) -> (MasterCore, Vec<SegmentId>) {
    let member_silence = if policy.member_silence == MasterPolicy::default().member_silence {
        NEVER_SILENT
    } else {
        policy.member_silence
    };
    let mut core = MasterCore::new(MasterPolicy {
        member_silence,
        ..policy
    });
    let now = Instant::now();
    let ids = sizes
        .iter()
        .zip(hosts)
        .enumerate()
        .map(|(i, (&size, host))| {
            core.mount_segment(
                ClientId(100 + i as u64),
                spec(&format!("s{i}"), host, 1 << 40, size),
                now,
            )
            .expect("mounts")
        })
        .collect();
    (core, ids)
}

fn one(replicas: usize) -> ReplicaConfig {
    ReplicaConfig {
        replica_num: replicas,
        ..ReplicaConfig::default()
    }
}

/// Writes `key` completely.
fn put(core: &mut MasterCore, key: &str, size: u64, config: &ReplicaConfig, now: Instant) {
    let ticket = core
        .put_start(WRITER, key, size, config, now)
        .expect("put-start");
    core.put_end(WRITER, key, ticket.put, now).expect("put-end");
}

fn reserved(core: &MasterCore) -> u64 {
    core.stats().segments.iter().map(|s| s.reserved).sum()
}

fn kind<T: std::fmt::Debug>(result: Result<T, StoreError>) -> StoreErrorKind {
    result.expect_err("an error").kind
}

#[test]
fn an_object_is_invisible_until_put_end_and_then_readable_with_a_lease() {
    let now = Instant::now();
    let (mut core, ids) = master(MasterPolicy::default(), &[64 * MIB], &["a"]);
    let ticket = core
        .put_start(WRITER, "k", 1000, &one(1), now)
        .expect("placed");
    assert_eq!(ticket.replicas.len(), 1);
    let replica = &ticket.replicas[0];
    assert_eq!(replica.segment, ids[0]);
    assert_eq!(replica.len, 1000);
    assert!(replica.addr >= 1 << 40 && replica.addr + 1000 <= (1 << 40) + 64 * MIB);
    assert_eq!(core.exists("k"), Ok(false));
    assert_eq!(kind(core.get("k", now)), StoreErrorKind::NotReady);

    core.put_end(WRITER, "k", ticket.put, now).expect("put-end");
    assert_eq!(core.exists("k"), Ok(true));
    let lease = core.get("k", now).expect("readable");
    assert_eq!(lease.size, 1000);
    assert_eq!(lease.replicas, ticket.replicas);
    assert_eq!(lease.lease_until, now + MasterPolicy::default().lease_ttl);
    // Ending it twice (its answer lost) answers the same, and is not a second object.
    core.put_end(WRITER, "k", ticket.put, now)
        .expect("the same answer");
    assert_eq!(core.stats().counters.puts_completed, 1);
}

#[test]
fn put_revoke_frees_the_space_at_once_and_only_the_writer_may_end_or_revoke() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[64 * MIB], &["a"]);
    let ticket = core
        .put_start(WRITER, "k", MIB, &one(1), now)
        .expect("placed");
    assert!(reserved(&core) >= MIB);
    assert_eq!(
        kind(core.put_end(ClientId(8), "k", ticket.put, now)),
        StoreErrorKind::NotWriter
    );
    assert_eq!(
        kind(core.put_revoke(ClientId(8), "k", ticket.put)),
        StoreErrorKind::NotWriter
    );
    assert_eq!(
        kind(core.put_end(WRITER, "k", PutId(ticket.put.0 + 1), now)),
        StoreErrorKind::PutNotPending
    );
    core.put_revoke(WRITER, "k", ticket.put).expect("revoked");
    assert_eq!(reserved(&core), 0);
    assert_eq!(core.exists("k"), Ok(false));
    assert_eq!(kind(core.get("k", now)), StoreErrorKind::NotFound);
    assert_eq!(
        core.next_action(),
        None,
        "a revoke by the writer needs no fence"
    );
}

#[test]
fn concurrent_writers_of_one_key_one_wins_the_other_is_told_it_exists() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[64 * MIB], &["a"]);
    let first = core
        .put_start(WRITER, "k", 100, &one(1), now)
        .expect("first");
    assert_eq!(
        kind(core.put_start(ClientId(8), "k", 100, &one(1), now)),
        StoreErrorKind::AlreadyExists
    );
    assert_eq!(
        kind(core.upsert_start(ClientId(8), "k", 100, &one(1), now)),
        StoreErrorKind::NotReady
    );
    core.put_end(WRITER, "k", first.put, now)
        .expect("first ends");
    assert_eq!(
        kind(core.put_start(ClientId(8), "k", 100, &one(1), now)),
        StoreErrorKind::AlreadyExists
    );
    assert_eq!(core.stats().objects, 1);
}

#[test]
fn an_abandoned_write_is_fenced_before_its_space_is_handed_out_again() {
    let now = Instant::now();
    let policy = MasterPolicy::default();
    let (mut core, ids) = master(policy.clone(), &[2 * MIB], &["a"]);
    let ticket = core
        .put_start(WRITER, "zombie", 2 * MIB, &one(1), now)
        .expect("placed");
    core.tick(now + policy.put_timeout - Duration::from_millis(1));
    assert_eq!(core.next_action(), None, "not yet overdue");

    let later = now + policy.put_timeout;
    core.tick(later);
    let Some(MasterAction::Fence {
        fence,
        segment,
        owner,
        writer,
    }) = core.next_action()
    else {
        panic!("an overdue write asks its segment's owner for a fence");
    };
    assert_eq!((segment, owner, writer), (ids[0], ClientId(100), WRITER));
    assert_eq!(core.exists("zombie"), Ok(false));
    // The zombie's late put-end is refused, saying why; its space is still not anyone
    // else's.
    assert_eq!(
        kind(core.put_end(WRITER, "zombie", ticket.put, later)),
        StoreErrorKind::PutTimedOut
    );
    assert!(matches!(
        kind(core.put_start(ClientId(8), "next", 2 * MIB, &one(1), later)),
        StoreErrorKind::NoSpace { .. }
    ));
    assert_eq!(core.stats().fences_pending, 1);

    core.fenced(fence);
    assert_eq!(reserved(&core), 0);
    let next = core
        .put_start(ClientId(8), "next", 2 * MIB, &one(1), later)
        .expect("room again");
    assert_eq!(
        next.replicas[0].addr, ticket.replicas[0].addr,
        "the same space, after the fence"
    );
}

#[test]
fn a_lease_holds_off_remove_until_it_ends_and_force_ignores_it() {
    let now = Instant::now();
    let policy = MasterPolicy::default();
    let (mut core, _) = master(policy.clone(), &[64 * MIB], &["a"]);
    put(&mut core, "k", 100, &one(1), now);
    put(&mut core, "j", 100, &one(1), now);
    core.get("k", now).expect("leased");
    let j = core.get("j", now).expect("leased");
    assert_eq!(kind(core.remove("k", false, now)), StoreErrorKind::HasLease);
    assert_eq!(core.stats().counters.lease_refusals, 1);
    let ended = now + policy.lease_ttl;
    core.remove("k", false, ended).expect("lease over");
    core.remove("j", true, now).expect("forced");
    assert_eq!(
        kind(core.get("j", now)),
        StoreErrorKind::NotFound,
        "gone for new readers"
    );
    // Its space waits for the reader already pointed at it: nothing is placed over it.
    assert!(reserved(&core) > 0, "held until the lease ends");
    let next = core
        .put_start(WRITER, "next", 100, &one(1), now)
        .expect("placed");
    assert_ne!(
        next.replicas[0].addr, j.replicas[0].addr,
        "not over a leased replica"
    );
    core.put_revoke(WRITER, "next", next.put).expect("revoked");
    core.tick(ended);
    assert_eq!(reserved(&core), 0);
    assert_eq!(
        kind(core.remove("k", false, ended)),
        StoreErrorKind::NotFound
    );
}

#[test]
fn remove_of_an_object_being_written_waits_unless_forced_and_force_fences() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[64 * MIB], &["a"]);
    core.put_start(WRITER, "k", 100, &one(1), now)
        .expect("placed");
    assert_eq!(kind(core.remove("k", false, now)), StoreErrorKind::NotReady);
    core.remove("k", true, now).expect("forced");
    assert!(matches!(
        core.next_action(),
        Some(MasterAction::Fence { writer: WRITER, .. })
    ));
    assert!(reserved(&core) > 0, "held for the fence");
}

#[test]
fn eviction_past_the_watermark_takes_least_recently_used_first_and_never_leased_pinned_or_incomplete()
 {
    let t0 = Instant::now();
    let policy = MasterPolicy {
        eviction_high_watermark: 0.5,
        eviction_ratio: 0.2,
        ..MasterPolicy::default()
    };
    let t1 = t0 + policy.lease_ttl;
    let (mut core, _) = master(policy, &[10 * MIB], &["a"]);
    let hard = ReplicaConfig {
        hard_pin: true,
        ..one(1)
    };
    let soft = ReplicaConfig {
        soft_pin: Some(Duration::from_secs(3600)),
        ..one(1)
    };
    put(&mut core, "hard", MIB, &hard, t0);
    put(&mut core, "soft", MIB, &soft, t0);
    put(&mut core, "older", MIB, &one(1), t0);
    put(&mut core, "newer", MIB, &one(1), t0);
    let writing = core
        .put_start(WRITER, "writing", MIB, &one(1), t0)
        .expect("placed");
    assert!(!core.over_watermark(), "5 MiB of 10 is not above half");
    // "older" was read after "newer" was written: "newer" is the least recently used. The
    // read's lease ends at t1.
    core.get("older", t0).expect("read");
    let gone = |core: &MasterCore| -> Vec<&str> {
        ["hard", "soft", "older", "newer", "leased", "writing"]
            .into_iter()
            .filter(|key| !core.objects.contains_key(*key))
            .collect()
    };
    // 6 MiB of 10 is above half: a round frees 2 MiB, least recently used first ("newer",
    // then "older"); the soft-pinned one is spared while unpinned ones are left.
    put(&mut core, "leased", MIB, &one(1), t1);
    core.get("leased", t1).expect("leased");
    assert_eq!(gone(&core), ["older", "newer"]);
    assert_eq!(core.stats().counters.evictions, 2);

    // Above half again: only the soft-pinned one may go now.
    core.put_start(WRITER, "more", 2 * MIB, &one(1), t1)
        .expect("placed");
    assert_eq!(gone(&core), ["soft", "older", "newer"]);
    core.put_end(WRITER, "writing", writing.put, t1)
        .expect("a write is never evicted");
    assert!(
        core.exists("hard").expect("valid"),
        "a hard pin is never evicted"
    );
    assert!(
        core.exists("leased").expect("valid"),
        "a lease holds off eviction"
    );
}

#[test]
fn a_put_that_finds_no_space_evicts_and_otherwise_says_no_space_without_leaking() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[4 * MIB], &["a"]);
    put(&mut core, "a", 2 * MIB, &one(1), now);
    put(&mut core, "b", 2 * MIB, &one(1), now);
    core.get("b", now).expect("b is newer by its read");
    // Full: the put evicts the least recently used ("a") and fits.
    put(&mut core, "c", 2 * MIB, &one(1), now);
    assert_eq!(core.exists("a"), Ok(false));
    assert_eq!(core.exists("b"), Ok(true));
    // b leased, c leased: nothing evictable, so no space — and nothing reserved for it.
    core.get("c", now).expect("leased");
    let before = reserved(&core);
    assert_eq!(
        kind(core.put_start(WRITER, "d", 2 * MIB, &one(1), now)),
        StoreErrorKind::NoSpace {
            size: 2 * MIB,
            replicas: 1
        }
    );
    assert_eq!(reserved(&core), before);
    assert_eq!(core.stats().counters.no_space, 1);
}

#[test]
fn replicas_go_to_different_segments_and_to_different_hosts_when_there_are_some() {
    let now = Instant::now();
    let (mut core, ids) = master(
        MasterPolicy::default(),
        &[64 * MIB, 64 * MIB, 32 * MIB],
        &["a", "a", "b"],
    );
    let ticket = core
        .put_start(WRITER, "k", MIB, &one(2), now)
        .expect("placed");
    let hosts: HashSet<&str> = ticket.replicas.iter().map(|r| r.host.as_str()).collect();
    assert_eq!(
        hosts.len(),
        2,
        "one replica per host: {:?}",
        ticket.replicas
    );
    let three = core
        .put_start(WRITER, "j", MIB, &one(3), now)
        .expect("placed");
    let segments: HashSet<SegmentId> = three.replicas.iter().map(|r| r.segment).collect();
    assert_eq!(segments.len(), 3);
    // Preferred segments come first, even on a host already used.
    let preferred = ReplicaConfig {
        replica_num: 2,
        preferred_segments: vec!["s1".into(), "s0".into()],
        ..ReplicaConfig::default()
    };
    let ticket = core
        .put_start(WRITER, "p", MIB, &preferred, now)
        .expect("placed");
    let placed: Vec<SegmentId> = ticket.replicas.iter().map(|r| r.segment).collect();
    assert_eq!(placed, [ids[1], ids[0]]);
}

#[test]
fn a_member_is_preferred_by_the_name_it_gave_its_engine() {
    let now = Instant::now();
    let mut core = MasterCore::new(MasterPolicy {
        member_silence: NEVER_SILENT,
        ..MasterPolicy::default()
    });
    let ids: Vec<SegmentId> = ["decode-0@7#1", "decode-1@x@3#1", "decode-1@9#1"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            core.mount_segment(
                ClientId(100 + i as u64),
                spec(name, "h", 1 << 40, 16 * MIB),
                now,
            )
            .expect("mounts")
        })
        .collect();
    for (preferred, expected) in [
        // Mounted first, `decode-1@x`'s segment is not `decode-1`'s.
        ("decode-1", ids[2]),
        ("decode-1@x", ids[1]),
        ("decode-0@7#1", ids[0]),
    ] {
        let config = ReplicaConfig {
            preferred_segments: vec![preferred.into()],
            ..ReplicaConfig::default()
        };
        let key = format!("k-{preferred}");
        let ticket = core
            .put_start(WRITER, &key, MIB, &config, now)
            .expect("placed");
        assert_eq!(ticket.replicas[0].segment, expected, "{preferred}");
    }
}

#[test]
fn bad_input_is_named_and_allocates_nothing() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[4 * MIB, 4 * MIB], &["a", "b"]);
    let long = "k".repeat(MAX_KEY_LEN + 1);
    let cases: Vec<(Result<PutTicket, StoreError>, StoreErrorKind)> = vec![
        (
            core.put_start(WRITER, "", 1, &one(1), now),
            StoreErrorKind::EmptyKey,
        ),
        (
            core.put_start(WRITER, &long, 1, &one(1), now),
            StoreErrorKind::KeyTooLong {
                len: MAX_KEY_LEN + 1,
            },
        ),
        (
            core.put_start(WRITER, "k", 0, &one(1), now),
            StoreErrorKind::EmptyValue,
        ),
        (
            core.put_start(WRITER, "k", 4 * MIB + 1, &one(1), now),
            StoreErrorKind::ValueTooLarge {
                size: 4 * MIB + 1,
                largest: 4 * MIB,
            },
        ),
        (
            core.put_start(WRITER, "k", 1, &one(3), now),
            StoreErrorKind::TooManyReplicas {
                asked: 3,
                segments: 2,
            },
        ),
        (
            core.put_start(WRITER, "k", 1, &one(0), now),
            StoreErrorKind::NoReplicas,
        ),
    ];
    for (result, expected) in cases {
        let error = result.expect_err("refused");
        assert_eq!(error.kind, expected);
        assert!(!error.to_string().is_empty());
    }
    assert!(
        core.put_start(WRITER, &"k".repeat(MAX_KEY_LEN), 1, &one(1), now)
            .is_ok()
    );
    assert_eq!(core.stats().writes, 1);
    assert_eq!(kind(core.get("", now)), StoreErrorKind::EmptyKey);
    assert_eq!(
        kind(core.exists(&long)),
        StoreErrorKind::KeyTooLong {
            len: MAX_KEY_LEN + 1
        }
    );
    assert_eq!(
        kind(core.remove("missing", false, now)),
        StoreErrorKind::NotFound
    );
    // Codes are Mooncake Store's.
    assert_eq!(StoreErrorKind::NotFound.code(), -704);
    assert_eq!(StoreErrorKind::HasLease.code(), -706);
    assert_eq!(
        StoreErrorKind::NoSpace {
            size: 1,
            replicas: 1
        }
        .code(),
        -200
    );
}

#[test]
fn a_put_no_set_of_segments_could_hold_is_refused_before_anything_is_evicted() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[8 * MIB, MIB], &["a", "b"]);
    for i in 0..6 {
        put(&mut core, &format!("k{i}"), MIB, &one(1), now);
    }
    assert_eq!(
        kind(core.put_start(WRITER, "big", 2 * MIB, &one(2), now)),
        StoreErrorKind::TooManyReplicas {
            asked: 2,
            segments: 1
        }
    );
    assert_eq!(
        core.stats().counters.evictions,
        0,
        "nothing evicted in vain"
    );
    assert_eq!(core.stats().objects, 6);
}

#[test]
fn segments_are_checked_when_mounted() {
    let mut core = MasterCore::new(MasterPolicy::default());
    core.mount_segment(OWNER, spec("s", "a", 4096, MIB), Instant::now())
        .expect("mounts");
    let refused = [
        (spec("s", "a", 1 << 30, MIB), "mounted already"),
        (spec("t", "a", 4096 + 100, MIB), "overlaps"),
        (spec("u", "a", 1 << 30, 10), "at least"),
        (spec("v", "a", u64::MAX - 10, MIB), "overflows"),
        (spec("", "a", 1 << 30, MIB), "empty name"),
        (spec("w", "a", 0, MAX_SEGMENT_BYTES + 1), "at most"),
    ];
    for (spec, said) in refused {
        let error = core
            .mount_segment(OWNER, spec, Instant::now())
            .expect_err("refused");
        assert!(error.to_string().contains(said), "{error}");
    }
    // Another process's memory may sit at the same addresses.
    core.mount_segment(ClientId(2), spec("x", "b", 4096, MIB), Instant::now())
        .expect("mounts");
}

#[test]
fn an_upsert_keeps_the_old_value_readable_until_put_end_and_frees_it_after_its_lease() {
    let now = Instant::now();
    let policy = MasterPolicy::default();
    let (mut core, _) = master(policy.clone(), &[64 * MIB], &["a"]);
    put(&mut core, "k", MIB, &one(1), now);
    let old = core.get("k", now).expect("readable");
    let ticket = core
        .upsert_start(WRITER, "k", 2 * MIB, &one(1), now)
        .expect("placed");
    assert_eq!(core.get("k", now).expect("still the old value").size, MIB);
    core.put_end(WRITER, "k", ticket.put, now)
        .expect("replaced");
    let new = core.get("k", now).expect("the new value");
    assert_eq!(new.size, 2 * MIB);
    assert_ne!(new.replicas[0].addr, old.replicas[0].addr);
    let both = reserved(&core);
    core.tick(old.lease_until);
    assert!(
        reserved(&core) < both,
        "the old replica is freed when its lease ends"
    );
}

#[test]
fn an_unmount_stops_placements_and_reads_at_once_and_finishes_after_its_grace() {
    let now = Instant::now();
    let (mut core, ids) = master(MasterPolicy::default(), &[64 * MIB, 64 * MIB], &["a", "b"]);
    put(&mut core, "both", MIB, &one(2), now);
    let only = ReplicaConfig {
        preferred_segments: vec!["s0".into()],
        ..one(1)
    };
    put(&mut core, "only-s0", MIB, &only, now);
    let writing = core
        .put_start(
            WRITER,
            "writing",
            MIB,
            &ReplicaConfig {
                replica_num: 2,
                ..one(2)
            },
            now,
        )
        .expect("placed");
    let grace = Duration::from_secs(2);
    core.unmount_segment(ids[0], grace, now).expect("draining");

    let left = core.get("both", now).expect("its other replica");
    assert_eq!(
        left.replicas.iter().map(|r| r.segment).collect::<Vec<_>>(),
        [ids[1]]
    );
    assert_eq!(kind(core.get("only-s0", now)), StoreErrorKind::NotFound);
    assert_eq!(
        kind(core.put_end(WRITER, "writing", writing.put, now)),
        StoreErrorKind::ReplicaLost {
            segment: "s0".into()
        }
    );
    assert!(matches!(
        core.next_action(),
        Some(MasterAction::Fence { .. })
    ));
    assert_eq!(
        kind(core.put_start(WRITER, "k", 1, &one(2), now)),
        StoreErrorKind::TooManyReplicas {
            asked: 2,
            segments: 1
        }
    );

    core.tick(now + grace - Duration::from_millis(1));
    while let Some(action) = core.next_action() {
        assert!(
            !matches!(action, MasterAction::Unmounted { .. }),
            "not before its grace"
        );
    }
    core.tick(now + grace);
    let mut unmounted = Vec::new();
    while let Some(action) = core.next_action() {
        if let MasterAction::Unmounted { segment, owner } = action {
            unmounted.push((segment, owner));
        }
    }
    assert_eq!(unmounted, [(ids[0], ClientId(100))]);
    assert_eq!(core.stats().segments.len(), 1);
}

#[test]
fn batch_exists_answers_each_key_on_its_own() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[64 * MIB], &["a"]);
    put(&mut core, "here", 10, &one(1), now);
    let answers = core.batch_exists(&["here", "", "gone"]);
    assert_eq!(answers[0], Ok(true));
    assert_eq!(
        answers[1].as_ref().map_err(|e| e.kind.clone()),
        Err(StoreErrorKind::EmptyKey)
    );
    assert_eq!(answers[2], Ok(false));
}

#[test]
fn remove_all_takes_what_remove_would_and_counts_it() {
    let now = Instant::now();
    let (mut core, _) = master(MasterPolicy::default(), &[64 * MIB], &["a"]);
    for key in ["a", "b", "c"] {
        put(&mut core, key, 10, &one(1), now);
    }
    core.get("c", now).expect("leased");
    core.put_start(WRITER, "d", 10, &one(1), now)
        .expect("writing");
    assert_eq!(core.remove_all(false, now), 2);
    assert_eq!(core.keys(), ["c"]);
    assert_eq!(
        core.remove_all(true, now),
        2,
        "the leased one and the write in progress"
    );
    assert!(core.keys().is_empty());
}

/// Every extent the master knows of, per segment: complete and written replicas, retired
/// ones and those waiting for a fence.
fn known_extents(core: &MasterCore) -> HashMap<SegmentId, u32> {
    let mut counts: HashMap<SegmentId, u32> = HashMap::new();
    for object in core.objects.values() {
        let versions = object
            .complete
            .iter()
            .chain(object.write.iter().map(|w| &w.version));
        for version in versions {
            for replica in &version.replicas {
                *counts.entry(replica.segment).or_default() += 1;
            }
        }
    }
    for (_, replica) in &core.retired {
        *counts.entry(replica.segment).or_default() += 1;
    }
    for pending in core.fences.values() {
        *counts.entry(pending.segment).or_default() += pending.extents.len() as u32;
    }
    counts
}

#[test]
fn no_space_leaks_after_100k_random_operations() {
    let mut rng = SplitMix64::new(0x5eed_0033);
    let start = Instant::now();
    let policy = MasterPolicy {
        lease_ttl: Duration::from_millis(50),
        put_timeout: Duration::from_millis(200),
        ..MasterPolicy::default()
    };
    let (mut core, _) = master(
        policy,
        &[8 * MIB, 8 * MIB, 4 * MIB, 4 * MIB],
        &["a", "a", "b", "c"],
    );
    let mut now = start;
    let mut writes: Vec<(ClientId, String, PutId)> = Vec::new();
    let mut fences: Vec<FenceId> = Vec::new();
    for step in 0..100_000u64 {
        now += Duration::from_micros(rng.below(2_000));
        let key = format!("k{}", rng.below(400));
        let client = ClientId(rng.below(4));
        match rng.below(10) {
            0..=2 => {
                let bound = if rng.below(8) == 0 {
                    3 * MIB
                } else {
                    64 * 1024
                };
                let size = 1 + rng.below(bound);
                let config = ReplicaConfig {
                    replica_num: 1 + rng.below(3) as usize,
                    soft_pin: (rng.below(10) == 0).then_some(Duration::from_millis(100)),
                    hard_pin: rng.below(50) == 0,
                    ..ReplicaConfig::default()
                };
                let started = if rng.below(5) == 0 {
                    core.upsert_start(client, &key, size, &config, now)
                } else {
                    core.put_start(client, &key, size, &config, now)
                };
                if let Ok(ticket) = started {
                    let segments: HashSet<SegmentId> =
                        ticket.replicas.iter().map(|r| r.segment).collect();
                    assert_eq!(segments.len(), config.replica_num, "step {step}");
                    writes.push((client, key, ticket.put));
                }
            }
            3..=4 if !writes.is_empty() => {
                let (client, key, put) =
                    writes.swap_remove(rng.below(writes.len() as u64) as usize);
                let _ = match rng.below(4) {
                    0 => core.put_revoke(client, &key, put),
                    _ => core.put_end(client, &key, put, now),
                };
            }
            5..=6 => {
                if let Ok(lease) = core.get(&key, now) {
                    for replica in &lease.replicas {
                        assert!(replica.addr >= 1 << 40, "step {step}");
                    }
                }
            }
            7 => {
                let _ = core.remove(&key, rng.below(4) == 0, now);
            }
            8 => core.tick(now),
            _ => {
                if rng.below(500) == 0 {
                    core.remove_all(rng.below(2) == 0, now);
                }
                if !fences.is_empty() {
                    let fence = fences.swap_remove(rng.below(fences.len() as u64) as usize);
                    core.fenced(fence);
                }
            }
        }
        while let Some(action) = core.next_action() {
            if let MasterAction::Fence { fence, .. } = action {
                fences.push(fence);
            }
        }
        if step % 997 == 0 {
            let known = known_extents(&core);
            for usage in core.stats().segments {
                assert_eq!(
                    usage.extents,
                    known.get(&usage.segment).copied().unwrap_or(0),
                    "step {step}: the allocator and the master disagree on {}",
                    usage.name
                );
                assert!(usage.reserved <= usage.capacity);
            }
        }
    }
    // Everything goes: every space is whole again.
    now += Duration::from_secs(3600);
    core.tick(now);
    core.remove_all(true, now);
    while let Some(action) = core.next_action() {
        if let MasterAction::Fence { fence, .. } = action {
            fences.push(fence);
        }
    }
    for fence in fences {
        core.fenced(fence);
    }
    core.tick(now);
    assert_eq!(core.stats().fences_pending, 0);
    assert!(core.objects.is_empty());
    for (_, segment) in core.segments.iter() {
        assert_eq!(segment.space.reserved(), 0, "{} leaks", segment.spec.name);
        assert!(
            segment.space.is_empty(),
            "{}: the allocator holds space",
            segment.spec.name
        );
    }
    assert!(
        core.stats().counters.evictions > 0,
        "the run exercised eviction"
    );
    assert!(
        core.stats().counters.puts_abandoned > 0,
        "the run exercised abandoned writes"
    );
}

#[path = "members_tests.rs"]
mod members;

#[path = "journal_tests.rs"]
mod journal;
