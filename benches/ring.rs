//! Ring throughput across two threads, beside `crossbeam_queue::ArrayQueue` and
//! `std::sync::mpsc::sync_channel` in the same run: single items and batches of 32.

use std::hint::black_box;
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use crossbeam_queue::ArrayQueue;
use railyard::dataplane::ring;

const CAPACITY: usize = 1024;
const BATCH: usize = 32;

/// Runs `produce` on a second thread and times `consume` on this one, from a shared start.
fn two_threads(produce: impl FnOnce() + Send + 'static, consume: impl FnOnce()) -> Duration {
    let barrier = Arc::new(Barrier::new(2));
    let start = barrier.clone();
    let producer = thread::spawn(move || {
        start.wait();
        produce();
    });
    barrier.wait();
    let began = Instant::now();
    consume();
    let elapsed = began.elapsed();
    producer.join().expect("producer thread");
    elapsed
}

fn rings(c: &mut Criterion) {
    let mut group = c.benchmark_group("ring_two_threads");
    group.throughput(Throughput::Elements(1));

    group.bench_function("railyard_single", |b| {
        b.iter_custom(|items| {
            let (mut tx, mut rx) = ring::channel::<u64>(CAPACITY);
            two_threads(
                move || {
                    for i in 0..items {
                        while tx.push(i).is_err() {
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    let mut received = 0;
                    while received < items {
                        if let Some(value) = rx.pop() {
                            black_box(value);
                            received += 1;
                        }
                    }
                },
            )
        });
    });

    group.bench_function("railyard_batch32", |b| {
        b.iter_custom(|items| {
            let (mut tx, mut rx) = ring::channel::<u64>(CAPACITY);
            two_threads(
                move || {
                    let mut next = 0;
                    while next < items {
                        let end = (next + BATCH as u64).min(items);
                        let mut values = next..end;
                        next += tx.push_from(&mut values) as u64;
                    }
                },
                || {
                    let mut buffer = Vec::with_capacity(BATCH);
                    let mut received = 0;
                    while received < items {
                        buffer.clear();
                        received += rx.pop_into(&mut buffer, BATCH) as u64;
                        black_box(&buffer);
                    }
                },
            )
        });
    });

    group.bench_function("crossbeam_array_queue", |b| {
        b.iter_custom(|items| {
            let queue = Arc::new(ArrayQueue::<u64>::new(CAPACITY));
            let producer_queue = queue.clone();
            two_threads(
                move || {
                    for i in 0..items {
                        while producer_queue.push(i).is_err() {
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    let mut received = 0;
                    while received < items {
                        if let Some(value) = queue.pop() {
                            black_box(value);
                            received += 1;
                        }
                    }
                },
            )
        });
    });

    group.bench_function("std_sync_channel", |b| {
        b.iter_custom(|items| {
            let (tx, rx) = sync_channel::<u64>(CAPACITY);
            two_threads(
                move || {
                    for i in 0..items {
                        tx.send(i).expect("receiver alive");
                    }
                },
                || {
                    for _ in 0..items {
                        black_box(rx.recv().expect("sender alive"));
                    }
                },
            )
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = rings
}
criterion_main!(benches);
