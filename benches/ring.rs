//! Ring throughput across two threads, beside `rtrb` (the reference SPSC ring),
//! `crossbeam_queue::ArrayQueue` and `std::sync::mpsc::sync_channel` in the same run: single
//! items and batches of 32, items/s.
//!
//! Each benchmark keeps one producer thread for its whole run (no thread is spawned per
//! sample): a sample asks it for `n` items and times this thread receiving them. With two
//! cores or more, the producer is pinned to one and this thread to another.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use crossbeam_queue::ArrayQueue;
use railyard::dataplane::ring;

const CAPACITY: usize = 1024;
const BATCH: usize = 32;

/// The cores this process may run on, read once, before any thread is pinned (a pinned
/// thread's children would see only its core).
fn cores() -> &'static [core_affinity::CoreId] {
    static CORES: OnceLock<Vec<core_affinity::CoreId>> = OnceLock::new();
    CORES.get_or_init(|| core_affinity::get_core_ids().unwrap_or_default())
}

/// Pins this thread to the `index`-th allowed core, when there are two or more.
fn pin(index: usize) {
    let cores = cores();
    if cores.len() > 1 {
        core_affinity::set_for_current(cores[index % cores.len()]);
    }
}

/// A producer thread for one benchmark's whole run.
struct Feeder {
    /// Items asked for and not yet taken by the producer (0: idle).
    wanted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Feeder {
    /// Starts a producer (pinned to the second core) that runs `produce(n)` whenever a
    /// sample asks for `n` items.
    fn start(mut produce: impl FnMut(u64) + Send + 'static) -> Self {
        let wanted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (asked, stopped) = (wanted.clone(), stop.clone());
        let thread = thread::spawn(move || {
            pin(1);
            while !stopped.load(Ordering::Acquire) {
                match asked.swap(0, Ordering::Acquire) {
                    0 => std::hint::spin_loop(),
                    items => produce(items),
                }
            }
        });
        Self {
            wanted,
            stop,
            thread: Some(thread),
        }
    }

    /// Times `consume(items)` on this thread while the producer sends `items`.
    fn sample(&self, items: u64, consume: impl FnOnce(u64)) -> Duration {
        let began = Instant::now();
        self.wanted.store(items, Ordering::Release);
        consume(items);
        began.elapsed()
    }
}

impl Drop for Feeder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn railyard_rings(c: &mut Criterion) {
    let mut group = c.benchmark_group("ring_two_threads");
    group.throughput(Throughput::Elements(1));

    {
        let (mut tx, mut rx) = ring::channel::<u64>(CAPACITY);
        let feeder = Feeder::start(move |items| {
            for i in 0..items {
                let mut value = i;
                while let Err(full) = tx.push(value) {
                    value = full.into_inner();
                    std::hint::spin_loop();
                }
            }
        });
        group.bench_function("railyard_single", |b| {
            b.iter_custom(|items| {
                feeder.sample(items, |items| {
                    let mut received = 0;
                    while received < items {
                        if let Some(value) = rx.pop() {
                            black_box(value);
                            received += 1;
                        }
                    }
                })
            });
        });
    }

    {
        let (mut tx, mut rx) = ring::channel::<u64>(CAPACITY);
        let feeder = Feeder::start(move |items| {
            let mut next = 0;
            while next < items {
                let end = (next + BATCH as u64).min(items);
                let mut values = next..end;
                next += tx.push_from(&mut values) as u64;
            }
        });
        let mut buffer = Vec::with_capacity(BATCH);
        group.bench_function("railyard_batch32", |b| {
            b.iter_custom(|items| {
                feeder.sample(items, |items| {
                    let mut received = 0;
                    while received < items {
                        buffer.clear();
                        received += rx.pop_into(&mut buffer, BATCH) as u64;
                        black_box(&buffer);
                    }
                })
            });
        });
    }
    group.finish();
}

fn reference_rings(c: &mut Criterion) {
    let mut group = c.benchmark_group("ring_two_threads");
    group.throughput(Throughput::Elements(1));

    {
        let (mut tx, mut rx) = rtrb::RingBuffer::<u64>::new(CAPACITY);
        let feeder = Feeder::start(move |items| {
            for i in 0..items {
                while tx.push(i).is_err() {
                    std::hint::spin_loop();
                }
            }
        });
        group.bench_function("rtrb_single", |b| {
            b.iter_custom(|items| {
                feeder.sample(items, |items| {
                    let mut received = 0;
                    while received < items {
                        if let Ok(value) = rx.pop() {
                            black_box(value);
                            received += 1;
                        }
                    }
                })
            });
        });
    }

    {
        let (mut tx, mut rx) = rtrb::RingBuffer::<u64>::new(CAPACITY);
        let mut buffer = Vec::with_capacity(BATCH);
        let feeder = Feeder::start(move |items| {
            let mut next = 0;
            while next < items {
                let want = (BATCH as u64).min(items - next) as usize;
                let room = tx.slots().min(want);
                if room == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                if let Ok(chunk) = tx.write_chunk_uninit(room) {
                    next += chunk.fill_from_iter(next..next + room as u64) as u64;
                }
            }
        });
        group.bench_function("rtrb_batch32", |b| {
            b.iter_custom(|items| {
                feeder.sample(items, |items| {
                    let mut received = 0;
                    while received < items {
                        let ready = rx.slots().min(BATCH);
                        if ready == 0 {
                            continue;
                        }
                        if let Ok(chunk) = rx.read_chunk(ready) {
                            // Moved out, as the poller takes slices.
                            buffer.clear();
                            buffer.extend(chunk);
                            black_box(&buffer);
                            received += ready as u64;
                        }
                    }
                })
            });
        });
    }

    {
        let queue = Arc::new(ArrayQueue::<u64>::new(CAPACITY));
        let producer_queue = queue.clone();
        let feeder = Feeder::start(move |items| {
            for i in 0..items {
                while producer_queue.push(i).is_err() {
                    std::hint::spin_loop();
                }
            }
        });
        group.bench_function("crossbeam_array_queue", |b| {
            b.iter_custom(|items| {
                feeder.sample(items, |items| {
                    let mut received = 0;
                    while received < items {
                        if let Some(value) = queue.pop() {
                            black_box(value);
                            received += 1;
                        }
                    }
                })
            });
        });
    }

    {
        let (tx, rx) = sync_channel::<u64>(CAPACITY);
        let feeder = Feeder::start(move |items| {
            for i in 0..items {
                if tx.send(i).is_err() {
                    return;
                }
            }
        });
        group.bench_function("std_sync_channel", |b| {
            b.iter_custom(|items| {
                feeder.sample(items, |items| {
                    for _ in 0..items {
                        black_box(rx.recv().expect("the producer lives"));
                    }
                })
            });
        });
    }
    group.finish();
}

fn setup() -> Criterion {
    // The consumer (this thread) on the first core, the producers on the second.
    pin(0);
    Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
}

criterion_group! {
    name = benches;
    config = setup();
    targets = railyard_rings, reference_rings
}
criterion_main!(benches);
