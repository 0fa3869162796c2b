//! The Engine API across two processes: this test's engine and a `railyard serve` child.
//! Writes, reads, notifications (alone, after a batch, as an immediate on the data path),
//! byte-for-byte integrity, every documented error, and `railyard bench --json`'s shape.

mod common;

use std::num::NonZeroUsize;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{BOUND, Serve, bytes_of, done, read_back};
use railyard::control::NotificationBody;
use railyard::dataplane::{IdleStrategy, RequestOutcome};
use railyard::engine::{Engine, MemoryError, Op, PeerError, RailChoice, Transfer, TransferError};

fn engine() -> Engine {
    Engine::builder("prefill-test")
        .rails(RailChoice::Count(NonZeroUsize::new(2).expect("two")))
        .idle(IdleStrategy::gentle())
        .slice_size(64 * 1024)
        .build()
        .expect("the engine starts")
}

#[test]
fn two_processes_write_read_and_notify_with_every_byte_checked() {
    let serve = Serve::start("16MiB");
    let engine = engine();
    let peer = engine.open(&serve.addr).expect("the target answers");
    assert_eq!(peer.name(), "decode-test");
    let descriptor = peer.descriptor();
    assert_eq!(descriptor.regions[0].base, serve.pool_base);
    assert_eq!(descriptor.regions[0].len, serve.pool_len);

    let source = engine.alloc(4 << 20, None).unwrap();
    let back = engine.alloc(4 << 20, None).unwrap();
    assert!(source.backing.is_some());
    for (i, byte) in bytes_of(source).iter_mut().enumerate() {
        *byte = (i % 253) as u8;
    }
    // 16 transfers of 256 KiB at scattered slots, each split into 4 slices over 2 rails.
    let slots: Vec<u64> = (0..16).map(|i| (i * 7 % 16) * (1 << 20)).collect();
    let mut submitter = engine.submitter().unwrap();
    let writes: Vec<Transfer> = slots
        .iter()
        .enumerate()
        .map(|(i, &slot)| Transfer {
            op: Op::Write,
            local: source,
            local_offset: i as u64 * (256 << 10),
            remote_addr: serve.pool_base + slot,
            len: 256 << 10,
        })
        .collect();
    let batch = submitter
        .submit_and_notify(&peer, &writes, b"kv ready".to_vec())
        .unwrap();
    assert!(done(&batch));
    let line = serve.expect_line("notification from prefill-test");
    assert!(line.ends_with("8 bytes 6b76207265616479"), "{line}");

    let reads = read_back(&writes, back);
    let batch = submitter.submit(&peer, &reads).unwrap();
    assert!(done(&batch));
    assert_eq!(&bytes_of(back)[..4 << 20], &bytes_of(source)[..4 << 20]);

    engine.notify(&peer, vec![0xAB; 3]).unwrap();
    assert!(serve.expect_line("3 bytes abab").contains("prefill-test"));

    // The same writes with an immediate riding the data path instead of the control
    // connection: it reaches the other process's inbox and is printed.
    let batch = submitter
        .submit_and_signal(&peer, &writes, 0xC0FF_EE01)
        .unwrap();
    assert!(done(&batch));
    let line = serve.expect_line("immediate from prefill-test");
    assert!(line.ends_with(": 0xc0ffee01"), "{line}");

    let stats = engine.stats();
    assert_eq!(stats.rails.len(), 2);
    assert!(
        stats.rails.iter().all(|r| r.poller.completed > 0),
        "both rails carried slices"
    );
    assert_eq!(stats.peers[0].requests(), 48);
    assert_eq!(stats.peers[0].bytes(), 3 * (4 << 20));
    let end = Instant::now() + BOUND;
    while engine.stats().control.notifications_sent < 3 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(engine.stats().control.notifications_sent, 3);
}

/// Waits (bounded) for the next immediate `engine` receives.
fn next_immediate(engine: &Engine) -> Option<(String, u32)> {
    let end = Instant::now() + BOUND;
    while Instant::now() < end {
        for notification in engine.drain_notifications() {
            if let NotificationBody::Immediate(value) = notification.body {
                return Some((notification.from, value));
            }
        }
        std::thread::yield_now();
    }
    None
}

#[test]
fn an_immediate_arrives_after_its_batch_data_on_every_rail_and_never_for_a_failed_batch() {
    let target = Engine::builder("decode-imm")
        .rails(RailChoice::Count(NonZeroUsize::new(2).expect("two")))
        .idle(IdleStrategy::gentle())
        .build()
        .unwrap();
    let pool = target.alloc(32 << 20, None).unwrap();
    let engine = engine();
    let peer = engine.open(&target.addr().to_string()).unwrap();
    let source = engine.alloc(32 << 20, None).unwrap();
    let mut submitter = engine.submitter().unwrap();
    // 16 transfers of 2 MiB, 32 slices each over 2 rails; the target checks the whole pool
    // the moment it sees the round's immediate.
    let writes: Vec<Transfer> = (0..16)
        .map(|i| Transfer {
            op: Op::Write,
            local: source,
            local_offset: i * (2 << 20),
            remote_addr: pool.addr + (i * 5 % 16) * (2 << 20),
            len: 2 << 20,
        })
        .collect();
    for round in 1..=8u32 {
        bytes_of(source).fill(round as u8);
        let batch = submitter.submit_and_signal(&peer, &writes, round).unwrap();
        assert_eq!(
            next_immediate(&target),
            Some(("prefill-test".to_string(), round))
        );
        // The last byte of each slice first (fast, while a premature immediate would still
        // race the data), then every byte.
        let pool_bytes = bytes_of(pool);
        assert!(
            pool_bytes
                .iter()
                .skip(64 * 1024 - 1)
                .step_by(64 * 1024)
                .all(|&b| b == round as u8),
            "round {round}: the immediate came before all of its batch's data"
        );
        assert!(pool_bytes.iter().all(|&b| b == round as u8));
        assert!(done(&batch));
    }
    assert_eq!(target.stats().control.notifications_received, 8);

    // A batch that fails (the target no longer registers the range) sends no immediate.
    target.deregister(pool).unwrap();
    let dropped_before = engine.stats().control.notifications_dropped;
    let batch = submitter.submit_and_signal(&peer, &writes, 99).unwrap();
    assert!(!done(&batch));
    let end = Instant::now() + BOUND;
    while engine.stats().control.notifications_dropped == dropped_before && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        engine.stats().control.notifications_dropped,
        dropped_before + 1
    );
    assert!(
        target
            .drain_notifications()
            .iter()
            .all(|n| !matches!(n.body, NotificationBody::Immediate(_))),
        "no immediate for a failed batch"
    );
}

/// Key rotation: a target re-registers its pool; an initiator holding the old keys is
/// refused, refreshes the descriptor and its work lands under the new keys, in the same
/// memory.
#[test]
fn a_reregistered_region_refuses_its_old_keys_and_work_carries_on_under_the_new() {
    let mut serve = Serve::start("4MiB");
    let engine = engine();
    let peer = engine.open(&serve.addr).expect("the target answers");
    let old_rkeys = peer.descriptor().regions[0].rkeys.clone();
    let source = engine.alloc(1 << 20, None).unwrap();
    let back = engine.alloc(1 << 20, None).unwrap();
    let mut submitter = engine.submitter().unwrap();
    let pool_base = serve.pool_base;
    let mut write_then_read = |fill: u8| {
        bytes_of(source).fill(fill);
        for op in [Op::Write, Op::Read] {
            let local = if op == Op::Write { source } else { back };
            let transfer = Transfer {
                op,
                local,
                local_offset: 0,
                remote_addr: pool_base,
                len: 1 << 20,
            };
            let batch = submitter.submit(&peer, &[transfer]).unwrap();
            batch.wait(Instant::now() + BOUND);
            assert_eq!(batch.outcomes(), vec![Some(RequestOutcome::Done)], "{op:?}");
        }
        assert!(bytes_of(back).iter().all(|&b| b == fill));
    };
    write_then_read(0x11);

    let answer = serve.command(&format!("reregister {}", serve.pool_id));
    let words: Vec<&str> = answer.split_whitespace().collect();
    assert_eq!(words[0], "region", "{answer}");
    let renewed: u64 = words[1].parse().unwrap();
    assert_ne!(renewed, serve.pool_id, "a new id");
    assert_eq!(
        words[2],
        format!("{:#x}", serve.pool_base),
        "the same memory"
    );

    write_then_read(0x22);
    let new_rkeys = peer.descriptor().regions[0].rkeys.clone();
    assert_ne!(new_rkeys, old_rkeys, "the peer's view has the new keys");
    let reconnects = engine.stats().control.reconnects;
    assert!(reconnects >= 1, "refused once, then refreshed");
    // The submitter prepares with the new keys from now on: no more refusals.
    write_then_read(0x33);
    assert_eq!(engine.stats().control.reconnects, reconnects);
    // The old id is gone; the new one answers.
    let stale = serve.command(&format!("digest {} 0 16 16", serve.pool_id));
    assert!(stale.starts_with("error: no region"), "{stale}");
    let digest = serve.command(&format!("digest {renewed} 0 16 16"));
    assert!(digest.starts_with("digest "), "{digest}");

    // Locally: the old handle is gone, the new one deregisters.
    let region = engine.alloc(4096, None).unwrap();
    let renewed = engine.reregister(region).unwrap();
    assert_ne!(renewed.id, region.id);
    assert_eq!((renewed.addr, renewed.len), (region.addr, region.len));
    assert!(matches!(
        engine.deregister(region),
        Err(MemoryError::UnknownRegion { .. })
    ));
    assert!(matches!(
        engine.reregister(region),
        Err(MemoryError::UnknownRegion { .. })
    ));
    engine.deregister(renewed).unwrap();
}

/// Caught: slices were striped round-robin over every rail with a queue pair, so a dead
/// rail (its circuit open) failed part of every batch while the other rail was fine.
#[test]
fn with_one_of_two_rails_dead_batches_keep_succeeding_on_the_other() {
    let serve = Serve::start_with("16MiB", &["--rails", "2"]);
    let engine = engine();
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine.alloc(1 << 20, None).unwrap();
    bytes_of(source).fill(0x5a);
    let mut submitter = engine.submitter().unwrap();
    let writes: Vec<Transfer> = (0..4)
        .map(|i| Transfer {
            op: Op::Write,
            local: source,
            local_offset: i << 18,
            remote_addr: serve.pool_base + (i << 18),
            len: 1 << 18,
        })
        .collect();
    let batch_done = |submitter: &mut railyard::engine::EngineSubmitter| {
        let batch = submitter.submit(&peer, &writes).unwrap();
        batch.wait(Instant::now() + BOUND);
        batch
            .outcomes()
            .iter()
            .all(|o| *o == Some(RequestOutcome::Done))
    };
    assert!(batch_done(&mut submitter), "both rails work at first");
    // Rail 0's link dies: its queue pairs fail, reconnect, fail again — until its circuit
    // opens (a few flaps). What was on it then may fail; nothing after.
    engine
        .faults(0)
        .expect("soft rails")
        .add(railyard::dataplane::fabric::soft::Fault::KillLink {
            on: railyard::dataplane::fabric::soft::QpMatch::Any,
        });
    let end = Instant::now() + BOUND;
    while engine.stats().control.circuit_openings == 0 {
        assert!(Instant::now() < end, "rail 0's circuit never opened");
        batch_done(&mut submitter);
    }
    let rail_completed = |engine: &Engine, rail: usize| engine.stats().rails[rail].poller.completed;
    let (rail0, rail1) = (rail_completed(&engine, 0), rail_completed(&engine, 1));
    for round in 0..20 {
        assert!(batch_done(&mut submitter), "batch {round} with rail 0 down");
    }
    assert_eq!(
        rail_completed(&engine, 0),
        rail0,
        "nothing more on the dead rail"
    );
    assert_eq!(
        rail_completed(&engine, 1),
        rail1 + 20 * 4 * 4,
        "all on rail 1"
    );
}

/// serve's stdin commands answer bad input with one `error:` line and keep serving.
#[test]
fn serve_answers_a_bad_command_with_an_error_line_and_keeps_serving() {
    let mut serve = Serve::start("1MiB");
    for (command, error) in [
        ("launch rockets", "unknown command"),
        ("reregister 999", "no region 999"),
        ("deregister", "lacks argument 1"),
        ("alloc lots", "\"lots\""),
        ("digest 0 0 0 0", "do not fit"),
        ("digest 0 1048576 1 1", "do not fit"),
        ("digest 0 0 0 1", "do not fit"),
        ("digest 0 0 1MiB 1", "more than 65536 digests"),
        ("reregister 1k", "\"1k\" is not a number"),
        ("alloc 64TiB", "more than this host's"),
    ] {
        let command = command.replace("digest 0", &format!("digest {}", serve.pool_id));
        let answer = serve.command(&command);
        assert!(
            answer.starts_with("error: ") && answer.contains(error),
            "{command}: {answer}"
        );
    }
    let not_utf8 = serve.command_bytes(b"alloc \xff\xfe");
    assert!(not_utf8.starts_with("error: "), "{not_utf8}");
    let made = serve.command("alloc 64KiB");
    assert!(made.starts_with("region "), "{made}");
    let engine = engine();
    engine.open(&serve.addr).expect("still serving");
}

#[test]
fn every_documented_error_names_what_is_wrong_and_queues_nothing() {
    let serve = Serve::start("8MiB");
    let engine = engine();
    let peer = engine.open(&serve.addr).unwrap();
    let local = engine.alloc(1 << 20, None).unwrap();
    let mut submitter = engine.submitter().unwrap();
    let good = Transfer {
        op: Op::Write,
        local,
        local_offset: 0,
        remote_addr: serve.pool_base,
        len: 4096,
    };
    let submit = |submitter: &mut railyard::engine::EngineSubmitter, t: Transfer| {
        submitter.submit(&peer, &[good, t]).unwrap_err()
    };

    assert_eq!(
        submit(&mut submitter, Transfer { len: 0, ..good }),
        TransferError::Empty { transfer: 1 }
    );
    let outside = submit(
        &mut submitter,
        Transfer {
            local_offset: (1 << 20) - 10,
            ..good
        },
    );
    assert!(matches!(
        outside,
        TransferError::LocalRange { transfer: 1, .. }
    ));
    assert!(outside.to_string().contains("outside region"), "{outside}");
    let remote = submit(
        &mut submitter,
        Transfer {
            remote_addr: serve.pool_base + serve.pool_len - 100,
            ..good
        },
    );
    assert!(remote.to_string().contains("peer decode-test"), "{remote}");

    assert!(matches!(
        engine.alloc(0, None),
        Err(MemoryError::BadRange { len: 0, .. })
    ));
    // SAFETY: a null pointer is refused before anything touches it.
    let null = unsafe { engine.register(std::ptr::null_mut(), 64) };
    assert!(matches!(null, Err(MemoryError::BadRange { .. })));
    engine.deregister(local).unwrap();
    assert!(matches!(
        engine.deregister(local),
        Err(MemoryError::UnknownRegion { .. })
    ));
    assert!(matches!(
        submitter.submit(&peer, &[good]),
        Err(TransferError::UnknownRegion { .. })
    ));

    assert!(matches!(
        engine.open("host:notaport"),
        Err(PeerError::BadAddress { .. })
    ));
    assert!(matches!(
        engine.open("a-name-without-a-directory"),
        Err(PeerError::UnknownName { reason, .. }) if reason.contains("directory")
    ));
    let (_held, closed) = common::refusing_address();
    let unreachable = engine.open(&closed.to_string()).unwrap_err();
    assert!(
        matches!(unreachable, PeerError::Unreachable { .. }),
        "{unreachable}"
    );

    // Nothing was queued by the refusals: the engine still moves bytes.
    let fresh = engine.alloc(1 << 20, None).unwrap();
    let batch = submitter
        .submit(
            &peer,
            &[Transfer {
                local: fresh,
                ..good
            }],
        )
        .unwrap();
    assert!(done(&batch));
    assert_eq!(
        engine
            .stats()
            .rails
            .iter()
            .map(|r| r.poller.failed_total())
            .sum::<u64>(),
        0
    );
}

#[test]
fn bench_prints_its_results_as_json_and_checks_every_byte() {
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "--duration", "0.5", "--json", "--check"])
        .args(["--pool", "32MiB", "--batch", "8", "--rails", "1"])
        .output()
        .expect("runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one object");
    for key in [
        "op",
        "block_size",
        "batch",
        "threads",
        "rails",
        "requests",
        "bytes",
        "gbps",
        "requests_per_s",
        "latency_us",
        "time_us",
        "ceiling_gbps",
        "ratio",
        "check",
    ] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    for key in ["avg", "p50", "p99"] {
        assert!(report["latency_us"][key].as_f64().is_some());
    }
    for key in ["prepare", "post", "complete"] {
        assert!(report["time_us"][key].as_f64().is_some());
    }
    assert_eq!(report["check"]["mismatches"], 0);
    assert!(report["check"]["verified_bytes"].as_u64() > Some(0));
    assert!(report["requests"].as_u64() > Some(0));
    assert!(report["ratio"].as_f64() > Some(0.0));

    // Caught: threads picked slots from the whole pool, so two of them wrote one slot at
    // once and the check saw the other's bytes. Each thread now has slots of its own.
    let threads = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "--duration", "1", "--json", "--check"])
        .args(["--threads", "4", "--pool", "8MiB"])
        .args(["--batch", "8", "--rails", "1"])
        .output()
        .expect("runs");
    let report: serde_json::Value = serde_json::from_slice(&threads.stdout).expect("one object");
    assert!(threads.status.success(), "{report}");
    assert_eq!(report["check"]["mismatches"], 0, "{report}");
    assert_eq!(report["failed_requests"], 0, "{report}");
    let too_many = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "--threads", "32", "--pool", "8MiB"])
        .args(["--batch", "8", "--rails", "1"])
        .output()
        .expect("runs");
    assert_eq!(too_many.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&too_many.stderr);
    assert!(stderr.contains("per thread"), "{stderr}");

    let bad = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "--pool", "1MiB"])
        .output()
        .expect("runs");
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("a request needs 64"), "{stderr}");
}

#[test]
fn without_rdma_auto_falls_back_and_says_why_and_verbs_fails_with_the_reason() {
    let engine = engine();
    let verbs = railyard::dataplane::fabric::verbs::devices();
    let fabric_warning = engine
        .warnings()
        .iter()
        .find(|w| w.contains("soft fabric"))
        .cloned();
    match &verbs {
        Err(unavailable) => {
            let warning = fabric_warning.expect("auto says why it is not verbs");
            assert!(warning.contains(&unavailable.reason), "{warning}");
        }
        Ok(devices) => assert!(!devices.is_empty()),
    }
    let output = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "--fabric", "verbs", "--duration", "0.1"])
        .output()
        .expect("runs");
    if let Err(unavailable) = verbs {
        assert_eq!(output.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&unavailable.reason), "{stderr}");
    }
}

#[test]
#[ignore = "requires an RDMA device that the topology plan makes a rail (make test-rdma)"]
fn two_processes_over_the_verbs_fabric() {
    let serve = Serve::start_with("64MiB", &["--fabric", "verbs"]);
    let engine = Engine::builder("prefill-rdma")
        .fabric(railyard::engine::FabricChoice::Verbs)
        .idle(IdleStrategy::gentle())
        .build()
        .expect("an engine on the verbs fabric");
    assert_eq!(engine.fabric(), "verbs");
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine
        .alloc(8 << 20, None)
        .expect("registered on every rail");
    let back = engine
        .alloc(8 << 20, None)
        .expect("registered on every rail");
    for (i, byte) in bytes_of(source).iter_mut().enumerate() {
        *byte = (i % 241) as u8;
    }
    let mut submitter = engine.submitter().expect("pollers run");
    let writes: Vec<Transfer> = (0..32u64)
        .map(|i| Transfer {
            op: Op::Write,
            local: source,
            local_offset: i * (256 << 10),
            remote_addr: serve.pool_base + ((i * 13) % 32) * (256 << 10),
            len: 256 << 10,
        })
        .collect();
    let batch = submitter
        .submit_and_signal(&peer, &writes, 0x5EED_0001)
        .expect("valid");
    assert!(done(&batch));
    let line = serve.expect_line("immediate from");
    assert!(line.ends_with(": 0x5eed0001"), "{line}");
    let reads = read_back(&writes, back);
    assert!(done(&submitter.submit(&peer, &reads).expect("valid")));
    assert_eq!(&bytes_of(back)[..8 << 20], &bytes_of(source)[..8 << 20]);
}
