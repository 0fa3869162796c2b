//! The store end to end inside one process: a master, two engines that mount segments and
//! a third that only reads and writes, all on the soft fabric — every client call, batches
//! with good and bad keys, values checked byte for byte — and a read whose first replica
//! went bad served by the next (caught failing with the fail-over switched off).

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use railyard_engine::dataplane::IdleStrategy;
use railyard_engine::{Engine, FabricChoice, RailChoice};
use railyard_store::{
    LocalRange, MasterConfig, MasterPolicy, MasterServer, ReplicaConfig, Store, StoreErrorKind,
    StoreOptions,
};

/// The tests take turns: one of them switches a protection off for the whole process.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn engine(name: &str) -> Engine {
    Engine::builder(name)
        .fabric(FabricChoice::Soft)
        .rails(RailChoice::Count(NonZeroUsize::new(1).expect("one")))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts")
}

fn master() -> MasterServer {
    MasterServer::start(MasterConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        policy: MasterPolicy::default(),
        secret: None,
        name: "master".into(),
        election: None,
        advertise: None,
    })
    .expect("the master starts")
}

fn options(master: &MasterServer) -> StoreOptions {
    StoreOptions {
        staging: 8 << 20,
        timeout: Duration::from_secs(10),
        ..StoreOptions::new(master.addr().to_string())
    }
}

/// A value whose every byte depends on its key and position.
fn value_of(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..len)
        .map(|i| {
            (seed
                .wrapping_add(i as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                >> 56) as u8
        })
        .collect()
}

#[test]
fn objects_written_by_one_client_are_read_back_byte_for_byte_by_another() {
    let _turn = one_at_a_time();
    let master = master();
    let segment_a = engine("segment-a");
    let segment_b = engine("segment-b");
    let client = engine("client");
    let a = Store::connect(&segment_a, options(&master)).expect("connects");
    let b = Store::connect(&segment_b, options(&master)).expect("connects");
    let c = Store::connect(&client, options(&master)).expect("connects");
    a.mount(32 << 20).expect("mounts");
    b.mount(32 << 20).expect("mounts");

    let two = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    for (key, len) in [
        ("small", 1usize),
        ("page", 4096),
        ("big", 3 << 20),
        ("odd", 12_345),
    ] {
        let value = value_of(key, len);
        c.put(key, &value, &two).expect("put");
        assert_eq!(c.get(key).expect("get"), value, "{key}");
        assert_eq!(
            a.get(key).expect("get from a segment owner"),
            value,
            "{key} via a"
        );
        assert_eq!(c.replica_descriptors(key).expect("replicas").len(), 2);
    }
    assert!(c.exists("big").expect("valid key"));
    assert!(!c.exists("never").expect("valid key"));
    assert_eq!(
        c.put("big", b"again", &two).expect_err("exists").kind,
        StoreErrorKind::AlreadyExists
    );
    c.upsert("big", b"replaced", &two).expect("upsert");
    assert_eq!(c.get("big").expect("get"), b"replaced");
    c.put_parts("parts", &[b"ab", b"", b"cde"], &ReplicaConfig::default())
        .expect("put_parts");
    assert_eq!(c.get("parts").expect("get"), b"abcde");

    // Zero-copy from and into registered memory, in batches with bad keys among good ones.
    let source = client.alloc(1 << 20, None).expect("alloc");
    let sink = client.alloc(1 << 20, None).expect("alloc");
    // SAFETY: `source` is engine-allocated, 1 MiB, and nothing transfers into it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(source.addr as *mut u8, 1 << 20) };
    let keys = ["z0", "", "z2", "z3"];
    for (i, key) in keys.iter().enumerate() {
        bytes[i * 4096..(i + 1) * 4096].copy_from_slice(&value_of(key, 4096));
    }
    let ranges: Vec<LocalRange> = (0..4)
        .map(|i| LocalRange {
            region: source,
            offset: i * 4096,
            len: 4096,
        })
        .collect();
    let results = c.batch_put_from(&keys, &ranges, &ReplicaConfig::default());
    assert!(
        results[0].is_ok() && results[2].is_ok() && results[3].is_ok(),
        "{results:?}"
    );
    assert_eq!(
        results[1].as_ref().expect_err("empty key").kind,
        StoreErrorKind::EmptyKey
    );
    let outside = LocalRange {
        region: sink,
        offset: (1 << 20) - 100,
        len: 4096,
    };
    let sinks = vec![
        LocalRange {
            region: sink,
            offset: 0,
            len: 4096,
        },
        LocalRange {
            region: sink,
            offset: 4096,
            len: 4096,
        },
        outside,
    ];
    let got = c.batch_get_into(&["z0", "missing", "z3"], &sinks);
    assert_eq!(got[0], Ok(4096));
    assert_eq!(
        got[1].as_ref().expect_err("missing").kind,
        StoreErrorKind::NotFound
    );
    assert!(matches!(
        got[2].as_ref().expect_err("outside").kind,
        StoreErrorKind::InvalidArgument { .. }
    ));
    // SAFETY: `sink` is engine-allocated, 1 MiB; the reads into it have resolved.
    let read = unsafe { std::slice::from_raw_parts(sink.addr as *const u8, 8192) };
    assert_eq!(&read[..4096], value_of("z0", 4096).as_slice());

    // Remove: a lease holds it off without force.
    c.get("z2").expect("leased now");
    assert_eq!(
        c.remove("z2", false).expect_err("leased").kind,
        StoreErrorKind::HasLease
    );
    c.remove("z2", true).expect("forced");
    assert!(!c.exists("z2").expect("valid"));
    let removed = c.batch_remove(&["z0", "nope"], true);
    assert!(removed[0].is_ok());
    assert_eq!(
        removed[1].as_ref().expect_err("missing").kind,
        StoreErrorKind::NotFound
    );
    assert!(c.remove_all(true).expect("remove_all") >= 4);
    assert!(c.keys().expect("keys").is_empty());
    assert_eq!(master.stats().objects, 0);
}

/// Reads eight keys replicated on two segments, `a`'s replica first, once `a`'s engine no
/// longer has its segment's memory registered (so every read there fails, and `a` itself
/// stays alive); returns how many reads failed.
fn reads_after_the_first_replica_goes_bad() -> usize {
    let master = master();
    let segment_a = engine("segment-a");
    let segment_b = engine("segment-b");
    let client = engine("client");
    let a = Store::connect(&segment_a, options(&master)).expect("connects");
    let b = Store::connect(&segment_b, options(&master)).expect("connects");
    let c = Store::connect(&client, options(&master)).expect("connects");
    const SEGMENT: u64 = 16 << 20;
    let ids = [
        a.mount(SEGMENT).expect("mounts"),
        b.mount(SEGMENT).expect("mounts"),
    ];
    let stats = c.master_stats().expect("stats");
    let name = |id| {
        stats
            .segments
            .iter()
            .find(|s| s.segment == id)
            .expect("mounted")
            .name
            .clone()
    };
    let first_a = ReplicaConfig {
        replica_num: 2,
        preferred_segments: vec![name(ids[0]), name(ids[1])],
        ..ReplicaConfig::default()
    };
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    for key in &keys {
        c.put(key, &value_of(key, 4096), &first_a).expect("put");
        let replicas = c.replica_descriptors(key).expect("replicas");
        assert_eq!(replicas[0].segment, ids[0], "{key}: a's replica first");
    }
    let segment = segment_a
        .regions()
        .into_iter()
        .find(|region| region.len == SEGMENT)
        .expect("a's segment is registered");
    segment_a.deregister(segment).expect("deregistered");
    keys.iter()
        .filter(|key| match c.get(key) {
            Ok(value) => {
                assert_eq!(value, value_of(key, 4096), "{key}");
                false
            }
            Err(_) => true,
        })
        .count()
}

#[test]
fn a_read_whose_first_replica_fails_is_served_by_the_next() {
    let _turn = one_at_a_time();
    assert_eq!(reads_after_the_first_replica_goes_bad(), 0);
}

#[cfg(feature = "sabotage")]
#[test]
fn without_read_failover_a_failed_first_replica_fails_the_read() {
    use railyard_engine::dataplane::sabotage::{Protection, turn_off};
    let _turn = one_at_a_time();
    let _off = turn_off(Protection::StoreReadFailover);
    assert!(reads_after_the_first_replica_goes_bad() > 0);
}

/// With one segment mounted, two replicas are refused — unless best effort, which writes
/// one and says so; the value reads back.
#[test]
fn best_effort_writes_as_many_replicas_as_segments_take_and_counts_them() {
    let _turn = one_at_a_time();
    let master = master();
    let segment = engine("segment");
    let client = engine("client");
    let member = Store::connect(&segment, options(&master)).expect("connects");
    member.mount(8 << 20).expect("mounts");
    let store = Store::connect(&client, options(&master)).expect("connects");
    let source = client.alloc(64 << 10, None).expect("allocates");
    let range = railyard_store::LocalRange::whole(source);
    let two = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    let strict = store.batch_put_from_counted(&["strict"], &[range], &two);
    assert!(
        matches!(
            &strict[0],
            Err(error) if matches!(error.kind, StoreErrorKind::TooManyReplicas { asked: 2, segments: 1 })
        ),
        "{strict:?}"
    );
    let best_effort = ReplicaConfig {
        best_effort: true,
        ..two
    };
    let counted = store.batch_put_from_counted(&["best-effort"], &[range], &best_effort);
    assert_eq!(counted, [Ok(1)]);
    assert_eq!(
        store.replica_descriptors("best-effort").expect("one").len(),
        1
    );
    assert_eq!(store.get("best-effort").expect("reads").len(), 64 << 10);
}

/// A client whose first rail of two fails every transfer (a dead link) still reads every
/// value: a read that failed on both replicas through that rail, their holders alive, goes
/// through them again, and the engine routes it over the other rail. Not "not found".
#[test]
fn reads_go_around_a_dead_rail_of_their_own() {
    use railyard_engine::dataplane::fabric::soft::{Fault, QpMatch};
    let _turn = one_at_a_time();
    let master = master();
    let (segment_a, segment_b) = (engine("segment-a"), engine("segment-b"));
    let client = Engine::builder("client")
        .fabric(FabricChoice::Soft)
        .rails(RailChoice::Count(NonZeroUsize::new(2).expect("two")))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let a = Store::connect(&segment_a, options(&master)).expect("connects");
    let b = Store::connect(&segment_b, options(&master)).expect("connects");
    a.mount(32 << 20).expect("mounts");
    b.mount(32 << 20).expect("mounts");
    let store = Store::connect(&client, options(&master)).expect("connects");
    let two = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    let keys: Vec<String> = (0..8).map(|i| format!("around-{i}")).collect();
    for key in &keys {
        store.put(key, &value_of(key, 1 << 20), &two).expect("put");
    }
    client
        .faults(0)
        .expect("a soft rail has a fault plan")
        .add(Fault::KillLink { on: QpMatch::Any });
    for key in &keys {
        let value = store
            .get(key)
            .unwrap_or_else(|error| panic!("{key}: {error}"));
        assert!(value == value_of(key, 1 << 20), "{key}: other bytes");
    }
}

#[test]
fn master_reachable_answers_from_the_keepalive_and_sees_a_master_go() {
    let _turn = one_at_a_time();
    let master = master();
    let client = Store::connect(&engine("reachable-client"), options(&master)).expect("connects");
    assert!(client.master_reachable());
    drop(master);
    let deadline = Instant::now() + Duration::from_secs(5);
    while client.master_reachable() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!client.master_reachable(), "the master is gone");
    // It answered without a round trip: no call waited out the 10 s timeout.
    assert!(Instant::now() < deadline);
}
