//! The store master's core on one thread: `batch_exists` keys/s and put-start/put-end
//! pairs/s (the floor: 200 k and 50 k), on a master of four 4 GiB segments on two
//! hosts holding 100 k objects of 64 KiB.

use std::hint::black_box;
use std::time::Instant;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use railyard::store::master::{ClientId, MasterCore, SegmentSpec};
use railyard::store::{MasterPolicy, ReplicaConfig};

const OBJECTS: usize = 100_000;
const VALUE: u64 = 64 << 10;

fn master(now: Instant) -> MasterCore {
    let mut core = MasterCore::new(MasterPolicy::default());
    for i in 0..4u64 {
        core.mount_segment(
            ClientId(i),
            SegmentSpec {
                name: format!("segment-{i}"),
                host: format!("host-{}", i % 2),
                handshake_addr: format!("10.0.0.{i}:7400"),
                base: 1 << 40,
                size: 4 << 30,
            },
            now,
        )
        .expect("mounts");
    }
    let config = ReplicaConfig::default();
    for i in 0..OBJECTS {
        let key = format!("model/layer{}/block{i}", i % 64);
        let ticket = core
            .put_start(ClientId(9), &key, VALUE, &config, now)
            .expect("room");
        core.put_end(ClientId(9), &key, ticket.put, now)
            .expect("ends");
    }
    core
}

fn bench(c: &mut Criterion) {
    let now = Instant::now();
    let mut core = master(now);
    let keys: Vec<String> = (0..1024)
        .map(|i| format!("model/layer{}/block{}", i % 64, i * 97 % (2 * OBJECTS)))
        .collect();
    let mut group = c.benchmark_group("store_master");
    group.throughput(Throughput::Elements(keys.len() as u64));
    group.bench_function("batch_exists_1024_keys", |b| {
        b.iter(|| black_box(core.batch_exists(black_box(&keys))));
    });
    group.throughput(Throughput::Elements(1));
    let config = ReplicaConfig::default();
    let mut next = 0u64;
    group.bench_function("put_start_put_end_remove", |b| {
        b.iter_batched(
            || {
                next += 1;
                format!("fresh/{next}")
            },
            |key| {
                let ticket = core
                    .put_start(ClientId(9), &key, VALUE, &config, now)
                    .expect("room");
                core.put_end(ClientId(9), &key, ticket.put, now)
                    .expect("ends");
                // Keeps the master's size steady across samples.
                core.remove(&key, true, now).expect("removes");
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
