//! Prepared lists against plain submissions, per descriptor: the time `submit_prepared`
//! takes to turn 1 024 index pairs of 4 KiB into queued slices beside the time `submit`
//! takes for the same 1 024 transfers, on two layouts — one registered region per side
//! (every other descriptor, so that nothing merges: one slice each), and fragmented KV
//! memory, 64 regions per side with each descriptor in another region than the one before
//! (as a KV cache registered per layer is) — and the prepared pairs of one region in order,
//! merged as `submit_prepared` does by default. Then a batch of 100 000 pairs (past the
//! ring's 4 096 slots, so it also waits for the poller), and `register_many` of 1 000
//! ranges beside 1 000 `register` calls. Two engines in this process on the soft fabric,
//! one rail each; only the submission call is timed (each batch is waited for outside the
//! clock). A summary with the ratios, and the split of each call into preparing and
//! handing slices to the poller, is printed after criterion's figures.

use std::hint::black_box;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use railyard::dataplane::{Batch, IdleStrategy};
use railyard::engine::{
    Engine, EngineSubmitter, FabricChoice, LocalList, Op, Peer, PostOptions, RailChoice, Region,
    RemoteList, Transfer,
};

const DESCRIPTOR: u64 = 4096;
const BATCH: usize = 1024;
const BIG_BATCH: usize = 100_000;
const RANGES: usize = 1000;
/// Regions per side of the fragmented layout.
const FRAGMENTS: usize = 64;

fn engine(name: &str, idle: IdleStrategy) -> Engine {
    Engine::builder(name)
        .fabric(FabricChoice::Soft)
        .rails(RailChoice::Count(NonZeroUsize::new(1).expect("one")))
        .idle(idle)
        .build()
        .expect("the engine starts")
}

/// Two engines, `regions` regions per side holding `2 × BATCH` descriptors (descriptor `i`
/// in region `i % regions`), both lists prepared, and the pairs a batch posts: `indices`
/// into both lists (and the same as `Transfer`s for `submit`).
struct Setup {
    initiator: Engine,
    _target: Engine,
    peer: Peer,
    local: LocalList,
    remote: RemoteList,
    indices: Vec<usize>,
    transfers: Vec<Transfer>,
}

fn setup(regions: usize, indices: Vec<usize>) -> Setup {
    // The target only serves (the soft fabric copies on the initiator's poller): let its
    // poller park so that the two cores go to the submitting thread and that poller.
    let target = engine("decode-bench", IdleStrategy::gentle());
    let initiator = engine("prefill-bench", IdleStrategy::SpinThenYield { spins: 256 });
    let per_region = (2 * BATCH / regions) as u64 * DESCRIPTOR;
    let alloc = |engine: &Engine| -> Vec<Region> {
        (0..regions)
            .map(|_| engine.alloc(per_region, None).expect("memory"))
            .collect()
    };
    let (sources, destinations) = (alloc(&initiator), alloc(&target));
    let place = |regions: &[Region], i: usize| -> (Region, u64) {
        let region = regions[i % regions.len()];
        (region, (i / regions.len()) as u64 * DESCRIPTOR)
    };
    let ranges = |regions: &[Region]| -> Vec<(u64, u64)> {
        (0..2 * BATCH)
            .map(|i| {
                let (region, offset) = place(regions, i);
                (region.addr + offset, DESCRIPTOR)
            })
            .collect()
    };
    let peer = initiator
        .open(&target.addr().to_string())
        .expect("the target answers");
    let local = initiator.prepare_local(&ranges(&sources)).expect("local");
    let remote = peer.prepare(&ranges(&destinations)).expect("remote");
    let transfers = indices
        .iter()
        .map(|&i| {
            let (source, offset) = place(&sources, i);
            let (destination, remote_offset) = place(&destinations, i);
            Transfer {
                op: Op::Write,
                local: source,
                local_offset: offset,
                remote_addr: destination.addr + remote_offset,
                len: DESCRIPTOR,
            }
        })
        .collect();
    Setup {
        initiator,
        _target: target,
        peer,
        local,
        remote,
        indices,
        transfers,
    }
}

fn finish(batch: &Batch) {
    let status = batch.wait(Instant::now() + Duration::from_secs(60));
    assert_eq!(status.done, status.total, "{status:?}");
}

/// Times `submit` of `batches` batches, each waited for outside the clock.
fn timed(batches: u64, mut submit: impl FnMut() -> Batch) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..batches {
        let began = Instant::now();
        let batch = submit();
        spent += began.elapsed();
        finish(&batch);
    }
    spent
}

fn prepared(c: &mut Criterion) {
    let unmerged = PostOptions {
        merge: false,
        ..PostOptions::default()
    };
    let every_other: Vec<usize> = (0..BATCH).map(|i| 2 * i).collect();
    let one_region = setup(1, every_other);
    let fragmented = setup(FRAGMENTS, (0..BATCH).collect());
    let mut summaries = Vec::new();
    for (layout, s) in [("one_region", &one_region), ("64_regions", &fragmented)] {
        let mut submitter = s.initiator.submitter().expect("submitter");
        let mut group = c.benchmark_group(format!("prepared_1024x4KiB_{layout}"));
        group.throughput(Throughput::Elements(BATCH as u64));
        group.bench_function("submit", |b| {
            b.iter_custom(|n| timed(n, || submitter.submit(&s.peer, &s.transfers).expect("ok")));
        });
        group.bench_function("submit_prepared", |b| {
            b.iter_custom(|n| timed(n, || post(&mut submitter, s, &s.indices, &unmerged)));
        });
        group.finish();
        summaries.push((layout, summary(s, &mut submitter, &unmerged)));
    }
    for (layout, line) in summaries {
        println!("prepared summary, {BATCH} × 4 KiB, {layout}: {line}");
    }

    let s = &one_region;
    let mut submitter = s.initiator.submitter().expect("submitter");
    let in_order: Vec<usize> = (0..BATCH).collect();
    let merged = PostOptions::default();
    let mut group = c.benchmark_group("prepared_1024x4KiB_one_region_in_order");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("submit_prepared_merged", |b| {
        b.iter_custom(|n| timed(n, || post(&mut submitter, s, &in_order, &merged)));
    });
    group.finish();
    let per_descriptor = median_per_descriptor(|| post(&mut submitter, s, &in_order, &merged));
    println!(
        "prepared summary, {BATCH} × 4 KiB in order, merged: {} slices; {per_descriptor:.1} \
         ns/descriptor (median of 200)",
        submitter.last_prepared().slices
    );

    let big: Vec<usize> = (0..BIG_BATCH).map(|i| s.indices[i % BATCH]).collect();
    let big_transfers: Vec<Transfer> = (0..BIG_BATCH).map(|i| s.transfers[i % BATCH]).collect();
    let mut group = c.benchmark_group("prepared_100k_x4KiB");
    group.sample_size(10);
    group.throughput(Throughput::Elements(BIG_BATCH as u64));
    group.bench_function("submit", |b| {
        b.iter_custom(|n| timed(n, || submitter.submit(&s.peer, &big_transfers).expect("ok")));
    });
    group.bench_function("submit_prepared", |b| {
        b.iter_custom(|n| timed(n, || post(&mut submitter, s, &big, &unmerged)));
    });
    group.finish();

    registration(c, &s.initiator);
}

fn post(
    submitter: &mut EngineSubmitter,
    s: &Setup,
    indices: &[usize],
    options: &PostOptions,
) -> Batch {
    submitter
        .submit_prepared_with(Op::Write, &s.local, indices, &s.remote, indices, options)
        .expect("ok")
}

/// Median nanoseconds per descriptor of `submit` over 200 batches.
fn median_per_descriptor(mut submit: impl FnMut() -> Batch) -> f64 {
    let mut times: Vec<Duration> = (0..200).map(|_| timed(1, &mut submit)).collect();
    times.sort_unstable();
    times[times.len() / 2].as_nanos() as f64 / BATCH as f64
}

/// Median nanoseconds per descriptor of each way over 200 batches — whole, and split into
/// preparing the slices and handing them to the poller — and the ratio, in words.
fn summary(s: &Setup, submitter: &mut EngineSubmitter, unmerged: &PostOptions) -> String {
    let per_descriptor = |times: &mut Vec<Duration>| {
        times.sort_unstable();
        times[times.len() / 2].as_nanos() as f64 / BATCH as f64
    };
    let mut plain = [Vec::new(), Vec::new(), Vec::new()];
    let mut prepared = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..200 {
        plain[0].push(timed(1, || {
            submitter.submit(&s.peer, &s.transfers).expect("ok")
        }));
        let timing = submitter.last_timing();
        plain[1].push(timing.prepare);
        plain[2].push(timing.post);
        prepared[0].push(timed(1, || post(submitter, s, &s.indices, unmerged)));
        let timing = submitter.last_timing();
        prepared[1].push(timing.prepare);
        prepared[2].push(timing.post);
    }
    let [plain, plain_prepare, plain_post] = plain.map(|mut times| per_descriptor(&mut times));
    let [whole, prepare, post] = prepared.map(|mut times| per_descriptor(&mut times));
    format!(
        "one slice each (ns/descriptor, median of 200): submit {plain:.1} (prepare \
         {plain_prepare:.1}, post {plain_post:.1}), submit_prepared {whole:.1} (prepare \
         {prepare:.1}, post {post:.1}): {:.2}× cheaper whole, {:.2}× cheaper to prepare",
        plain / whole,
        plain_prepare / prepare
    )
}

/// `register_many` of 1 000 ranges of one region's memory beside 1 000 `register` calls,
/// each round deregistered outside the clock.
fn registration(c: &mut Criterion, engine: &Engine) {
    let len = RANGES * DESCRIPTOR as usize;
    let mut area = vec![0u8; len];
    let base = area.as_mut_ptr();
    let ranges: Vec<(*mut u8, usize)> = (0..RANGES)
        .map(|i| {
            (
                base.wrapping_add(i * DESCRIPTOR as usize),
                DESCRIPTOR as usize,
            )
        })
        .collect();
    let release = |regions: Vec<Region>| {
        for region in regions {
            engine.deregister(region).expect("deregistered");
        }
    };
    let mut group = c.benchmark_group("register_1000_ranges");
    group.sample_size(10);
    group.throughput(Throughput::Elements(RANGES as u64));
    group.bench_function("register_many", |b| {
        b.iter_custom(|n| {
            let mut spent = Duration::ZERO;
            for _ in 0..n {
                let began = Instant::now();
                // SAFETY: `area` outlives every registration (each round deregisters).
                let regions = unsafe { engine.register_many(&ranges) }.expect("registered");
                spent += began.elapsed();
                release(black_box(regions));
            }
            spent
        });
    });
    group.bench_function("register_each", |b| {
        b.iter_custom(|n| {
            let mut spent = Duration::ZERO;
            for _ in 0..n {
                let began = Instant::now();
                let regions: Vec<Region> = ranges
                    .iter()
                    // SAFETY: as above.
                    .map(|&(ptr, len)| unsafe { engine.register(ptr, len) }.expect("registered"))
                    .collect();
                spent += began.elapsed();
                release(black_box(regions));
            }
            spent
        });
    });
    group.finish();
    drop(area);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = prepared
}
criterion_main!(benches);
