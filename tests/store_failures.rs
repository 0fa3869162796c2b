//! The store with segment processes that really die: a master, three `railyard store
//! serve` processes and a client, every value replicated twice and checked byte for byte.
//! A SIGKILLed holder costs no read (each falls over to the other replica), and the master
//! suspects it at once; a newcomer that takes its port is a new, empty member and the dead
//! one is forgotten; a SIGSTOPped holder is suspected within the silence bound, its
//! only-replica keys answer "not found" (not a transfer failure) meanwhile, and it serves
//! its data again once it runs.

mod common;

use std::time::{Duration, Instant};

use common::store::{BOUND, Process, client, value_of};
use railyard::store::{ReplicaConfig, Store, StoreErrorKind};

const VALUE: usize = 64 << 10;
const KEYS: usize = 24;

fn segment_server(master: &str, listen: &str) -> Process {
    Process::start(&[
        "store",
        "serve",
        "--master",
        master,
        "--segment",
        "16MiB",
        "--fabric",
        "soft",
        "--listen",
        listen,
    ])
}

/// Waits (within `bound`) until `check` holds; returns how long it took.
fn until(store: &Store, bound: Duration, what: &str, check: impl Fn(&Store) -> bool) -> Duration {
    let start = Instant::now();
    while !check(store) {
        assert!(start.elapsed() < bound, "{what}: not within {bound:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

fn suspected(store: &Store, segment: u64) -> bool {
    store
        .master_stats()
        .expect("stats")
        .segments
        .iter()
        .any(|s| s.segment.0 == segment && s.suspected)
}

#[test]
fn dead_and_stopped_holders_cost_no_read_and_a_newcomer_on_a_dead_port_is_not_mistaken_for_it() {
    let master = Process::start(&[
        "master",
        "--listen",
        "127.0.0.1:0",
        "--member-silence",
        "1500ms",
        "--suspect-grace",
        "30s",
    ]);
    let master_addr = master.addr().to_owned();
    let mut servers: Vec<Process> = (0..3)
        .map(|_| segment_server(&master_addr, "127.0.0.1:0"))
        .collect();
    let segment_of = |server: &Process| server.first[5].parse::<u64>().expect("a segment id");
    let (_engine, store) = client(&master_addr);
    let two = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    let keys: Vec<String> = (0..KEYS).map(|i| format!("kv-{i}")).collect();
    for key in &keys {
        store.put(key, &value_of(key, VALUE), &two).expect("put");
    }

    // SIGKILL the first holder: every read still answers, right, and fast.
    let dead = servers.remove(0);
    let dead_addr = dead.addr().to_owned();
    let dead_segment = segment_of(&dead);
    drop(dead);
    let killed = Instant::now();
    for key in &keys {
        let asked = Instant::now();
        let value = store.get(key).expect("the other replica serves it");
        assert!(value == value_of(key, VALUE), "{key}: wrong bytes");
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "{key}: {:?}",
            asked.elapsed()
        );
    }
    // The master learned it from the dropped connection, not from a timeout.
    let noticed = until(
        &store,
        Duration::from_secs(2),
        "the dead holder suspected",
        |s| suspected(s, dead_segment),
    );
    eprintln!(
        "reads after SIGKILL took {:?}; the master suspected it after {noticed:?}",
        killed.elapsed()
    );

    // A newcomer takes its port: a new incarnation, a new and empty segment; the dead one
    // is forgotten and none of its replicas is read or written through the newcomer.
    let newcomer = segment_server(&master_addr, &dead_addr);
    assert_eq!(newcomer.addr(), dead_addr);
    let stats = store.master_stats().expect("stats");
    assert_eq!(stats.counters.members_lost, 1, "{stats:?}");
    assert!(stats.segments.iter().all(|s| s.segment.0 != dead_segment));
    let fresh = stats
        .segments
        .iter()
        .find(|s| s.segment.0 == segment_of(&newcomer))
        .expect("mounted");
    assert_eq!(fresh.reserved, 0);
    for key in &keys {
        for replica in store.replica_descriptors(key).expect("replicas") {
            assert_ne!(replica.segment.0, dead_segment, "{key}");
        }
        assert!(
            store.get(key).expect("get") == value_of(key, VALUE),
            "{key}"
        );
    }
    for i in 0..8 {
        let key = format!("after-kill-{i}");
        store.put(&key, &value_of(&key, VALUE), &two).expect("put");
        assert!(store.get(&key).expect("get") == value_of(&key, VALUE));
    }

    // SIGSTOP the second: suspected within the silence bound (plus a tick), its keys with no
    // other replica left answer "not found" at once, the rest are read from the others.
    let stopped = &servers[0];
    let stopped_segment = segment_of(stopped);
    let only_there: Vec<&String> = keys
        .iter()
        .filter(|key| {
            let replicas = store.replica_descriptors(key).expect("replicas");
            replicas.len() == 1 && replicas[0].segment.0 == stopped_segment
        })
        .collect();
    common::signal_stop(&stopped.child);
    let detection = until(
        &store,
        Duration::from_secs(3),
        "the stopped holder suspected",
        |s| suspected(s, stopped_segment),
    );
    eprintln!(
        "the master suspected the stopped holder after {detection:?}; {} keys had their last \
         replica there",
        only_there.len()
    );
    for key in &keys {
        let asked = Instant::now();
        match store.get(key) {
            Ok(value) => assert!(value == value_of(key, VALUE), "{key}: wrong bytes"),
            Err(error) => {
                assert!(only_there.contains(&key), "{key}: {error}");
                assert_eq!(error.kind, StoreErrorKind::NotFound, "{key}: {error}");
            }
        }
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "{key}: {:?}",
            asked.elapsed()
        );
    }
    // Writes go to the live segments meanwhile.
    for i in 0..8 {
        let key = format!("while-stopped-{i}");
        store.put(&key, &value_of(&key, VALUE), &two).expect("put");
        for replica in store.replica_descriptors(&key).expect("replicas") {
            assert_ne!(replica.segment.0, stopped_segment);
        }
    }

    // It runs again within the grace: the same incarnation, its data served as before.
    common::signal_continue(&stopped.child);
    until(&store, BOUND, "the stopped holder heard again", |s| {
        !suspected(s, stopped_segment)
    });
    // This client's engine tries the holder again after its circuit's cooldown.
    let resumed = until(&store, BOUND, "reads from the holder that ran again", |s| {
        only_there.iter().all(|key| s.get(key).is_ok())
    });
    eprintln!("its last-replica keys were read again {resumed:?} after the master heard it");
    for key in &keys {
        assert!(
            store.get(key).expect("back") == value_of(key, VALUE),
            "{key}"
        );
    }
    assert_eq!(
        store.master_stats().expect("stats").counters.members_lost,
        1
    );
}
