//! The slice path: one submitter thread → ring → poller → null fabric → batch completion,
//! in slices per second of one poller core — to one endpoint, and striped over eight peers
//! with two queue pairs each (their slices interleaved, as a prefill node's are over its
//! decode peers; railyard opens one queue pair per endpoint, so a peer with two queue pairs
//! is two endpoints: sixteen in all) — beside the ring alone moving the same number of
//! 64-byte items (the ceiling the poller's work is measured against). Then the latency from
//! submit to resolution of 16-slice batches over those endpoints, p50 and p99, printed after
//! criterion's figures.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use railyard::dataplane::fabric::Opcode;
use railyard::dataplane::fabric::null::NullFabric;
use railyard::dataplane::ring;
use railyard::dataplane::{
    Command, EndpointId, Epoch, FailStale, IdleStrategy, PollerConfig, PollerHandle, SliceSpec,
    Submitter,
};

const SLICES_PER_BATCH: usize = 256;
/// Peers of the interleaved benchmark.
const PEERS: u32 = 8;
/// Queue pairs (endpoints) to each peer in the interleaved benchmark.
const QUEUE_PAIRS_PER_PEER: u32 = 2;
/// Endpoints of the interleaved benchmark: endpoint `peer * QUEUE_PAIRS_PER_PEER + pair`.
const ENDPOINTS: u32 = PEERS * QUEUE_PAIRS_PER_PEER;

fn spec(request: u32) -> SliceSpec {
    SliceSpec {
        rail: 0,
        request,
        opcode: Opcode::Write,
        local_addr: 0x1000,
        lkey: 1,
        remote_addr: 0x2000,
        rkey: 2,
        len: 4096,
        imm: 0,
        endpoint: EndpointId(0),
        epoch: Epoch::FIRST,
        generation: 0,
    }
}

fn slice_path(c: &mut Criterion) {
    let config = PollerConfig {
        idle: IdleStrategy::SpinThenYield { spins: 256 },
        max_batch: 256,
        ..PollerConfig::new("bench-rail")
    };
    let poller = PollerHandle::spawn(config, NullFabric::new(), FailStale).expect("poller starts");
    for endpoint in 0..ENDPOINTS {
        poller
            .send(Command::AddEndpoint {
                endpoint: EndpointId(endpoint),
                epoch: Epoch::FIRST,
            })
            .expect("poller runs");
    }
    let mut submitter = Submitter::new(&[&poller], 4096).expect("poller runs");
    // 16 requests of 16 slices each per batch.
    let specs: Vec<SliceSpec> = (0..SLICES_PER_BATCH)
        .map(|i| spec((i / 16) as u32))
        .collect();

    // The same, each slice to the next peer, alternating between each peer's queue pairs.
    let interleaved: Vec<SliceSpec> = (0..SLICES_PER_BATCH as u32)
        .map(|i| {
            let (peer, pair) = (i % PEERS, (i / PEERS) % QUEUE_PAIRS_PER_PEER);
            SliceSpec {
                endpoint: EndpointId(peer * QUEUE_PAIRS_PER_PEER + pair),
                ..spec(i / 16)
            }
        })
        .collect();

    let mut group = c.benchmark_group("slice_path");
    group.throughput(Throughput::Elements(SLICES_PER_BATCH as u64));
    group.bench_function("submit_poll_null_fabric", |b| {
        b.iter_custom(|batches| submit_and_wait(&mut submitter, &specs, batches));
    });
    group.bench_function("submit_poll_null_fabric_8_peers_2_queue_pairs", |b| {
        b.iter_custom(|batches| submit_and_wait(&mut submitter, &interleaved, batches));
    });
    group.bench_function("ring_only_64_byte_items", |b| {
        b.iter_custom(|batches| {
            let items = batches * SLICES_PER_BATCH as u64;
            let (mut tx, mut rx) = ring::channel::<[u64; 8]>(4096);
            let producer = std::thread::spawn(move || {
                let mut sent = 0;
                while sent < items {
                    let mut values = (sent..items).map(|i| [i; 8]);
                    sent += tx.push_from(&mut values) as u64;
                }
            });
            let began = Instant::now();
            let mut buffer = Vec::with_capacity(256);
            let mut received = 0;
            while received < items {
                buffer.clear();
                received += rx.pop_into(&mut buffer, 256) as u64;
                black_box(&buffer);
            }
            let elapsed = began.elapsed();
            producer.join().expect("producer thread");
            elapsed
        });
    });
    group.finish();
    latency(&mut submitter, &interleaved[..16]);
    poller.shutdown();
}

/// Submits `batches` batches of `specs` (16 slices per request), then waits for all of
/// them: the time it took.
fn submit_and_wait(submitter: &mut Submitter, specs: &[SliceSpec], batches: u64) -> Duration {
    let deadline = Instant::now() + Duration::from_secs(600);
    let began = Instant::now();
    let mut pending = Vec::with_capacity(batches as usize);
    for _ in 0..batches {
        pending.push(
            submitter
                .submit(specs.len() / 16, specs, deadline)
                .expect("valid"),
        );
    }
    for batch in &pending {
        let status = batch.wait(deadline);
        assert_eq!(status.done, status.total, "{status:?}");
    }
    let elapsed = began.elapsed();
    black_box(pending);
    elapsed
}

/// Submit-to-resolution time of `specs` as one batch (one request per slice), one batch at
/// a time: p50 and p99 over 20 000 batches, printed.
fn latency(submitter: &mut Submitter, specs: &[SliceSpec]) {
    let one_each: Vec<SliceSpec> = specs
        .iter()
        .enumerate()
        .map(|(i, spec)| SliceSpec {
            request: i as u32,
            ..*spec
        })
        .collect();
    let mut times: Vec<Duration> = (0..20_000)
        .map(|_| {
            let began = Instant::now();
            let batch = submitter
                .submit(one_each.len(), &one_each, began + Duration::from_secs(10))
                .expect("valid");
            batch.wait(began + Duration::from_secs(10));
            began.elapsed()
        })
        .collect();
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    println!(
        "slice_path latency, {}-slice batches over {PEERS} peers × {QUEUE_PAIRS_PER_PEER} queue pairs: p50 {:?}, p99 {:?}",
        one_each.len(),
        at(0.5),
        at(0.99)
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = slice_path
}
criterion_main!(benches);
