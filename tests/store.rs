//! The store with real processes: a `railyard master`, two `railyard store serve` segment
//! processes, and clients — this test process and `railyard store` command processes —
//! putting and getting values checked byte for byte, batches with mixed good and bad keys,
//! concurrent writers of one key, `remove_all`, and an unmount with a grace period.

mod common;

use std::process::Output;

use common::store::{Process, client, store_command, value_of};
use railyard::store::{LocalRange, ReplicaConfig, StoreErrorKind};

#[test]
fn a_master_two_segment_servers_and_clients_in_separate_processes() {
    let master = Process::start(&[
        "master",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
    ]);
    let master_addr = master.addr().to_owned();
    let segment_args = |segment: &'static str| {
        vec![
            "store",
            "serve",
            "--master",
            master_addr.as_str(),
            "--segment",
            segment,
            "--fabric",
            "soft",
            "--grace",
            "500ms",
        ]
    };
    let first = Process::start(&segment_args("32MiB"));
    let second = Process::start(&segment_args("32MiB"));
    let (engine, store) = client(&master_addr);

    // Every value, replicated on both segments, read back byte for byte.
    let two = ReplicaConfig {
        replica_num: 2,
        ..ReplicaConfig::default()
    };
    for (key, len) in [
        ("one-byte", 1),
        ("page", 4096),
        ("megs", 3 << 20),
        ("odd", 70_001),
    ] {
        let value = value_of(key, len);
        store.put(key, &value, &two).expect("put");
        assert_eq!(store.get(key).expect("get"), value, "{key}");
        let replicas = store.replica_descriptors(key).expect("replicas");
        assert_eq!(replicas.len(), 2);
        assert_ne!(replicas[0].segment, replicas[1].segment);
    }

    // Another process reads what this one wrote, and writes what this one reads.
    let got = store_command(&master_addr, &["get", "page"], None);
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert_eq!(got.stdout, value_of("page", 4096));
    let put = store_command(
        &master_addr,
        &["put", "from-cli", "--replicas", "2"],
        Some(&value_of("from-cli", 100_000)),
    );
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    assert_eq!(
        store.get("from-cli").expect("get"),
        value_of("from-cli", 100_000)
    );

    // Concurrent writers of one key: exactly one wins, the other is told it exists.
    let racers: Vec<_> = (0..2)
        .map(|i| {
            let master = master_addr.clone();
            std::thread::spawn(move || {
                store_command(
                    &master,
                    &["put", "contended", "--value", &format!("writer {i}")],
                    None,
                )
            })
        })
        .collect();
    let outcomes: Vec<Output> = racers
        .into_iter()
        .map(|racer| racer.join().expect("joins"))
        .collect();
    let winners: Vec<usize> = (0..2).filter(|&i| outcomes[i].status.success()).collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    let loser = &outcomes[1 - winners[0]];
    assert!(
        String::from_utf8_lossy(&loser.stderr).contains("already exists"),
        "{loser:?}"
    );
    assert_eq!(
        store.get("contended").expect("get"),
        format!("writer {}", winners[0]).into_bytes()
    );

    // A batch with good and bad keys: one result per key.
    let source = engine.alloc(1 << 20, None).expect("alloc");
    let sink = engine.alloc(1 << 20, None).expect("alloc");
    // SAFETY: engine-allocated, 1 MiB; nothing transfers into it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(source.addr as *mut u8, 1 << 20) };
    let long = "k".repeat(257);
    let keys = ["b0", long.as_str(), "b2", "page"];
    for (i, key) in keys.iter().enumerate() {
        bytes[i * 65536..(i + 1) * 65536].copy_from_slice(&value_of(key, 65536));
    }
    let ranges: Vec<LocalRange> = (0..4u64)
        .map(|i| LocalRange {
            region: source,
            offset: i * 65536,
            len: 65536,
        })
        .collect();
    let results = store.batch_put_from(&keys, &ranges, &two);
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    assert!(matches!(
        results[1].as_ref().expect_err("too long").kind,
        StoreErrorKind::KeyTooLong { len: 257 }
    ));
    assert_eq!(
        results[3].as_ref().expect_err("exists").kind,
        StoreErrorKind::AlreadyExists
    );
    let sinks: Vec<LocalRange> = (0..3u64)
        .map(|i| LocalRange {
            region: sink,
            offset: i * 65536,
            len: 65536,
        })
        .collect();
    let got = store.batch_get_into(&["b0", "missing", "b2"], &sinks);
    assert_eq!(got[0], Ok(65536));
    assert_eq!(
        got[1].as_ref().expect_err("missing").kind,
        StoreErrorKind::NotFound
    );
    assert_eq!(got[2], Ok(65536));
    // SAFETY: engine-allocated, 1 MiB; the reads into it resolved.
    let read = unsafe { std::slice::from_raw_parts(sink.addr as *const u8, 3 * 65536) };
    assert_eq!(&read[..65536], value_of("b0", 65536).as_slice());
    assert_eq!(&read[2 * 65536..], value_of("b2", 65536).as_slice());

    // Scatter-gather: one key's value from (and into) several ranges; single-key forms.
    let multi_keys = ["sg-0", "sg-1"];
    let parts: Vec<Vec<LocalRange>> = (0..2u64)
        .map(|k| {
            (0..3u64)
                .map(|p| LocalRange {
                    region: source,
                    offset: k * 196_608 + p * 65536,
                    len: 65536,
                })
                .collect()
        })
        .collect();
    for result in store.batch_put_from_multi(&multi_keys, &parts, &two) {
        result.expect("put from parts");
    }
    let scattered: Vec<Vec<LocalRange>> = (0..2u64)
        .map(|k| {
            vec![
                LocalRange {
                    region: sink,
                    offset: k * 196_608,
                    len: 100_000,
                },
                LocalRange {
                    region: sink,
                    offset: k * 196_608 + 100_000,
                    len: 96_608,
                },
            ]
        })
        .collect();
    assert_eq!(
        store.batch_get_into_multi(&multi_keys, &scattered),
        [Ok(196_608), Ok(196_608)]
    );
    // SAFETY: both engine-allocated, 1 MiB; every transfer of them resolved.
    let (written, read) = unsafe {
        (
            std::slice::from_raw_parts(source.addr as *const u8, 2 * 196_608),
            std::slice::from_raw_parts(sink.addr as *const u8, 2 * 196_608),
        )
    };
    assert!(written == read, "scatter-gather round trip");
    let whole = LocalRange {
        region: sink,
        offset: 0,
        len: 1 << 20,
    };
    assert_eq!(
        store.get_into("page", whole).expect("fits"),
        4096,
        "get_into answers the value's size"
    );
    assert_eq!(
        store
            .batch_exists(&["page", "nope", ""])
            .into_iter()
            .map(|r| r.map_err(|e| e.kind))
            .collect::<Vec<_>>(),
        [Ok(true), Ok(false), Err(StoreErrorKind::EmptyKey)]
    );
    assert!(matches!(
        store
            .get_into("megs", whole)
            .expect_err("a buffer too small")
            .kind,
        StoreErrorKind::InvalidArgument { .. }
    ));

    // An unmount with a grace period: objects with a replica left stay readable; its
    // process exits cleanly once the master let go.
    let single = ReplicaConfig::default();
    for i in 0..8 {
        let key = format!("single-{i}");
        store
            .put(&key, &value_of(&key, 10_000), &single)
            .expect("put");
    }
    assert!(
        first.stop(),
        "the segment server unmounts and exits cleanly"
    );
    for key in ["page", "megs", "b0", "from-cli"] {
        assert_eq!(
            store.replica_descriptors(key).expect("still there").len(),
            1,
            "{key}"
        );
    }
    let (mut survivors, mut lost) = (0, 0);
    for i in 0..8 {
        let key = format!("single-{i}");
        match store.get(&key) {
            Ok(value) => {
                assert!(
                    value == value_of(&key, 10_000),
                    "{key}: a survivor is whole"
                );
                survivors += 1;
            }
            Err(error) => {
                assert_eq!(error.kind, StoreErrorKind::NotFound, "{key}");
                lost += 1;
            }
        }
    }
    assert!(
        lost > 0 && survivors > 0,
        "placement spread them over both segments"
    );

    // Replacing and removing, from this process and from a command process.
    store
        .put_parts("parts", &[b"head-", b"", b"tail"], &single)
        .expect("put_parts");
    assert_eq!(store.get("parts").expect("get"), b"head-tail");
    let upsert = store_command(
        &master_addr,
        &["put", "parts", "--upsert", "--value", "replaced"],
        None,
    );
    assert!(
        upsert.status.success(),
        "{}",
        String::from_utf8_lossy(&upsert.stderr)
    );
    assert_eq!(store.get("parts").expect("get"), b"replaced");
    store.upsert("parts", b"again", &single).expect("upsert");
    assert_eq!(store.get("parts").expect("get"), b"again");
    store.remove("parts", true).expect("remove");
    assert_eq!(
        store.get("parts").expect_err("removed").kind,
        StoreErrorKind::NotFound
    );
    let removed = store.batch_remove(&["b0", "never-there"], true);
    assert!(removed[0].is_ok());
    assert_eq!(
        removed[1].as_ref().expect_err("missing").kind,
        StoreErrorKind::NotFound
    );
    let rm = store_command(&master_addr, &["rm", "b2", "--force"], None);
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    assert!(!store.exists("b2").expect("valid"));

    let listed = store_command(&master_addr, &["ls"], None);
    assert!(
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            .any(|line| line == "megs")
    );
    assert!(store.remove_all(true).expect("remove_all") > 0);
    assert!(store.keys().expect("keys").is_empty());
    let stat = store_command(&master_addr, &["stat"], None);
    assert!(
        String::from_utf8_lossy(&stat.stdout).starts_with("objects 0"),
        "{stat:?}"
    );
    // The metrics say the same.
    let metrics_addr = master
        .first
        .iter()
        .skip_while(|word| *word != "metrics")
        .nth(1)
        .expect("metrics ADDR")
        .clone();
    let text = minreq::get(format!("http://{metrics_addr}/metrics"))
        .send()
        .expect("scraped");
    let text = text.as_str().expect("text");
    assert!(text.contains("railyard_store_objects 0"), "{text}");
    assert!(
        text.contains("railyard_store_request_seconds_count{request=\"put_start\"}")
            || text.contains("railyard_store_request_count{request=\"put_start\"}"),
        "{text}"
    );
    assert!(second.stop());
    assert!(master.stop());
}
