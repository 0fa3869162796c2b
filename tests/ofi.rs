//! The libfabric fabric through the Engine, between two processes: a `railyard serve
//! --fabric ofi --ofi-provider "tcp;ofi_rxm"` target and this process, every byte checked;
//! notifications and immediates; a range the target never registered refused before it
//! reaches the wire; and the errors a user sees for a provider that is not there.

mod common;

use std::num::NonZeroUsize;

use common::{Serve, bytes_of, done, read_back};
use railyard::dataplane::{IdleStrategy, RequestOutcome};
use railyard::engine::{BuildError, Engine, FabricChoice, Op, RailChoice, Transfer};

const PROVIDER: &str = "tcp;ofi_rxm";

fn engine(name: &str, rails: usize) -> Engine {
    Engine::builder(name)
        .fabric(FabricChoice::Ofi)
        .ofi(PROVIDER)
        .rails(RailChoice::Count(NonZeroUsize::new(rails).expect("rails")))
        .idle(IdleStrategy::gentle())
        .slice_size(256 << 10)
        .build()
        .expect("the engine starts on libfabric's tcp provider")
}

fn serve(pool: &str) -> Serve {
    Serve::start_with(
        pool,
        &[
            "--rails",
            "2",
            "--fabric",
            "ofi",
            "--ofi-provider",
            PROVIDER,
        ],
    )
}

#[test]
fn two_processes_write_read_notify_and_signal_with_every_byte_checked() {
    let mut serve = serve("64MiB");
    let engine = engine("prefill-ofi", 2);
    assert_eq!(engine.fabric(), "ofi");
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine.alloc(16 << 20, None).expect("memory");
    let back = engine.alloc(16 << 20, None).expect("memory");
    for (i, byte) in bytes_of(source).iter_mut().enumerate() {
        *byte = (i % 251) as u8 ^ (i >> 16) as u8;
    }
    // 64 transfers of 256 KiB at scattered slots of the 64 MiB pool, over both rails.
    let slots: Vec<u64> = (0..64u64).map(|i| (i * 37 % 256) * (256 << 10)).collect();
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
    let mut submitter = engine.submitter().expect("a submitter");
    let batch = submitter
        .submit_and_notify(&peer, &writes, b"kv ready".to_vec())
        .expect("submitted");
    assert!(done(&batch), "{:?}", batch.outcomes());
    let line = serve.expect_line("notification from prefill-ofi");
    assert!(line.ends_with("8 bytes 6b76207265616479"), "{line}");
    // The target's own digest of each slot it received.
    for (i, &slot) in slots.iter().enumerate() {
        let answer = serve.command(&format!(
            "digest {} {slot} {} {}",
            serve.pool_id,
            256 << 10,
            256 << 10
        ));
        let expected = format!(
            "{:016x}",
            railyard::chaos::digest(&bytes_of(source)[i * (256 << 10)..][..256 << 10])
        );
        assert_eq!(answer, format!("digest {expected}"), "slot {i}");
    }

    let reads = read_back(&writes, back);
    let batch = submitter.submit(&peer, &reads).expect("submitted");
    assert!(done(&batch));
    assert!(bytes_of(back)[..16 << 20] == bytes_of(source)[..16 << 20]);

    // An immediate riding the data path, on both rails' writes.
    let batch = submitter
        .submit_and_signal(&peer, &writes, 0xC0FF_EE02)
        .expect("submitted");
    assert!(done(&batch));
    let line = serve.expect_line("immediate from prefill-ofi");
    assert!(line.ends_with(": 0xc0ffee02"), "{line}");

    let stats = engine.stats();
    assert!(
        stats.rails.iter().all(|rail| rail.poller.completed > 0),
        "both rails carried slices: {:?}",
        stats.rails
    );
}

#[test]
fn a_range_the_target_never_registered_fails_and_the_peer_stays_usable() {
    let serve = serve("4MiB");
    let engine = engine("prefill-ofi-range", 1);
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine.alloc(1 << 20, None).expect("memory");
    let mut submitter = engine.submitter().expect("a submitter");
    let outside = Transfer {
        op: Op::Write,
        local: source,
        local_offset: 0,
        remote_addr: serve.pool_base + serve.pool_len - 4096,
        len: 8192,
    };
    // Refused when the batch is prepared: the range is not inside one region.
    assert!(submitter.submit(&peer, &[outside]).is_err());
    let inside = Transfer {
        remote_addr: serve.pool_base,
        ..outside
    };
    let batch = submitter.submit(&peer, &[inside]).expect("submitted");
    assert!(done(&batch));
    assert_eq!(batch.outcomes(), [Some(RequestOutcome::Done)]);
}

#[test]
fn a_provider_that_is_not_there_is_a_clear_error() {
    let efa_here = railyard::dataplane::fabric::ofi::providers()
        .iter()
        .any(|provider| provider == "efa");
    for (provider, expected) in [
        (Some("no-such-provider"), "no-such-provider"),
        (None, "no efa provider"),
    ] {
        if provider.is_none() && efa_here {
            // The default works on this host.
            continue;
        }
        let mut builder = Engine::builder("prefill-ofi-none")
            .fabric(FabricChoice::Ofi)
            .rails(RailChoice::Count(NonZeroUsize::MIN));
        if let Some(provider) = provider {
            builder = builder.ofi(provider);
        }
        match builder.build() {
            Err(error @ BuildError::FabricUnavailable { .. }) => {
                let text = error.to_string();
                assert!(text.contains(expected), "{text}");
                assert!(
                    text.contains("tcp;ofi_rxm"),
                    "lists what is present: {text}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_gibibyte_round_trip_every_byte_checked() {
    const WINDOW: u64 = 64 << 20;
    let serve = serve("1GiB");
    let engine = engine("prefill-ofi-gib", 2);
    let peer = engine.open(&serve.addr).expect("the target answers");
    let source = engine.alloc(WINDOW, None).expect("memory");
    let back = engine.alloc(WINDOW, None).expect("memory");
    let mut submitter = engine.submitter().expect("a submitter");
    let started = std::time::Instant::now();
    // Each 64 MiB window of the target's 1 GiB pool written with its own pattern, then read
    // back whole and compared.
    for window in 0..(serve.pool_len / WINDOW) {
        // A 1 MiB pattern of its own, repeated (filling byte by byte would dominate an
        // unoptimised test build).
        let pattern: Vec<u8> = (0..1u64 << 20)
            .map(|i| (i * 7 + window * 131 + (i >> 12)) as u8)
            .collect();
        for chunk in bytes_of(source).chunks_exact_mut(1 << 20) {
            chunk.copy_from_slice(&pattern);
        }
        let writes: Vec<Transfer> = (0..WINDOW / (4 << 20))
            .map(|i| Transfer {
                op: Op::Write,
                local: source,
                local_offset: i * (4 << 20),
                remote_addr: serve.pool_base + window * WINDOW + i * (4 << 20),
                len: 4 << 20,
            })
            .collect();
        let batch = submitter.submit(&peer, &writes).expect("submitted");
        assert!(done(&batch), "window {window}: {:?}", batch.outcomes());
        bytes_of(back).fill(0);
        let batch = submitter
            .submit(&peer, &read_back(&writes, back))
            .expect("submitted");
        assert!(done(&batch), "window {window}: {:?}", batch.outcomes());
        assert!(
            bytes_of(back)[..WINDOW as usize] == bytes_of(source)[..WINDOW as usize],
            "window {window} came back different"
        );
    }
    eprintln!("1 GiB written and read back in {:.1?}", started.elapsed());
}

#[test]
fn bench_on_libfabric_reports_its_ratio_against_the_tcp_fabric_of_the_same_run() {
    let output = common::output_within(
        std::process::Command::new(env!("CARGO_BIN_EXE_railyard")).args([
            "bench",
            "--fabric",
            "ofi",
            "--ofi-provider",
            PROVIDER,
            "--rails",
            "1",
            "--duration",
            "0.5",
            "--pool",
            "64MiB",
            "--check",
            "--json",
        ]),
        common::BOUND * 6,
    );
    assert!(output.status.success(), "{output:?}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(report["fabric"], "ofi");
    assert_eq!(report["failed_requests"], 0);
    assert_eq!(report["check"]["mismatches"], 0);
    assert!(report["check"]["verified_bytes"].as_u64() > Some(0));
    assert!(
        report["ceiling"]
            .as_str()
            .is_some_and(|what| what.contains("TCP fabric")),
        "{report}"
    );
    assert!(report["ratio"].as_f64() > Some(0.0), "{report}");
}

#[test]
fn a_provider_without_the_ofi_fabric_is_refused() {
    // Refused before anything starts: exits at once.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["serve", "--ofi-provider", PROVIDER, "--pool", "1MiB"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("runs");
    let end = std::time::Instant::now() + common::BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waitable") {
            break status;
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            panic!("serve did not refuse at once");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(2));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("piped"), &mut stderr)
        .expect("stderr");
    assert!(
        stderr.contains("--ofi-provider is for --fabric ofi"),
        "{stderr}"
    );
}

#[test]
fn two_targets_with_one_name_on_one_host_are_two_peers_both_written() {
    // Seed 002's twins: two processes, one name, one host and interface.
    let twins = [(); 2].map(|()| {
        Serve::start_named(
            "decode-twin",
            "4MiB",
            &[
                "--rails",
                "1",
                "--fabric",
                "ofi",
                "--ofi-provider",
                PROVIDER,
            ],
        )
    });
    let engine = engine("prefill-ofi-twins", 1);
    let source = engine.alloc(1 << 20, None).expect("memory");
    let mut submitter = engine.submitter().expect("a submitter");
    let mut incarnations = Vec::new();
    for (i, twin) in twins.iter().enumerate() {
        bytes_of(source).fill(0x10 + i as u8);
        let peer = engine.open(&twin.addr).expect("the twin answers");
        assert_eq!(peer.name(), "decode-twin");
        incarnations.push(peer.incarnation());
        let write = Transfer {
            op: Op::Write,
            local: source,
            local_offset: 0,
            remote_addr: twin.pool_base,
            len: 1 << 20,
        };
        let batch = submitter.submit(&peer, &[write]).expect("submitted");
        assert!(done(&batch));
    }
    assert_ne!(incarnations[0], incarnations[1]);
    // Each twin holds what was meant for it.
    for (i, twin) in twins.into_iter().enumerate() {
        let mut twin = twin;
        let expected = format!(
            "digest {:016x}",
            railyard::chaos::digest(&vec![0x10 + i as u8; 1 << 20])
        );
        let answer = twin.command(&format!(
            "digest {} 0 {} {}",
            twin.pool_id,
            1 << 20,
            1 << 20
        ));
        assert_eq!(answer, expected, "twin {i}");
    }
    assert_eq!(engine.stats().peers.len(), 2);
}
