//! `railyard bench --latency`: round trips of one write and its notification, answered by
//! the target's write of the same bytes back and a notification (`serve --echo`), size by
//! size; p50/p99/p999 over at least `--round-trips` of them, beside the same-run ceiling of
//! a ping-pong that carries the same bytes without railyard — over a plain TCP socket for
//! the fabrics that go over TCP, through shared memory for the others.

use std::io::IoSlice;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use railyard::engine::{Engine, FabricChoice, Op, PeerAccess, RailChoice, Transfer, default_name};
use serde_json::json;

use super::args::BenchArgs;
use super::report::{micros, percentile};
use super::target::{OpenTarget, open_target};
use super::tcp_ceiling::{read_spinning, write_spinning};
use super::worker::local_slice;
use crate::cli::ping::{Ping, wait_for_pong};
use crate::cli::size::format_size;

/// The sizes measured when `--block-sizes` is not given: 4 KiB to 1 MiB in powers of 4.
const LATENCY_SIZES: [u64; 5] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];
/// Seconds each size runs at least when `--duration` is not given.
const LATENCY_SECONDS: f64 = 1.0;
/// Round trips made before any is timed.
const WARM_UP: u64 = 100;
/// Longest one round trip may take before the run fails.
const ROUND_TRIP_BOUND: Duration = Duration::from_secs(5);

/// One side's round-trip times, sorted.
struct Distribution(Vec<Duration>);

impl Distribution {
    fn json(&self) -> serde_json::Value {
        json!({
            "round_trips": self.0.len(),
            "p50": self.us(0.5),
            "p99": self.us(0.99),
            "p999": self.us(0.999),
            "min": self.us(0.0),
        })
    }

    fn us(&self, p: f64) -> f64 {
        micros(percentile(&self.0, p))
    }
}

/// How long and how often each size runs.
#[derive(Clone, Copy)]
struct Budget {
    round_trips: u64,
    duration: Duration,
}

impl Budget {
    /// Whether a size that made `done` timed round trips since `started` is finished.
    fn spent(&self, done: u64, started: Instant) -> bool {
        done >= self.round_trips && started.elapsed() >= self.duration
    }
}

pub(super) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let sizes = if args.block_sizes.is_empty() {
        LATENCY_SIZES.to_vec()
    } else {
        args.block_sizes.clone()
    };
    let largest = sizes.iter().copied().max().unwrap_or(1);
    let budget = Budget {
        round_trips: args.round_trips,
        duration: Duration::from_secs_f64(args.duration.unwrap_or(LATENCY_SECONDS)),
    };
    // The ceiling, with the machine to itself (before any engine starts), on this host: a
    // target elsewhere answers only railyard's pings.
    let socket_ceiling = matches!(args.fabric, FabricChoice::Tcp | FabricChoice::Ofi);
    let ceilings: Option<Vec<Distribution>> = match args.target {
        Some(_) => None,
        None => Some(
            sizes
                .iter()
                .map(|&size| {
                    if socket_ceiling {
                        socket_ping_pong(size, budget)
                    } else {
                        shared_memory_ping_pong(size, budget)
                    }
                })
                .collect::<anyhow::Result<_>>()?,
        ),
    };
    let rails = args.rails.map_or(RailChoice::Plan, RailChoice::Count);
    let name = args.name.clone().unwrap_or_else(|| default_name("bench"));
    // The target writes back: a target elsewhere must reach this engine.
    let listen = match args.target {
        Some(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        None => SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
    };
    let engine = args
        .secret
        .apply(args.verbs.apply(Engine::builder(name)))?
        .fabric(args.fabric)
        .rails(rails)
        .listen(listen)
        .directory(args.directory.clone())
        .build()
        .context("starting the engine")?;
    // What is sent, then where the answer lands; the target may write into the second half.
    let local = engine
        .alloc_with_access(largest * 2, None, PeerAccess::ReadWrite)
        .context("allocating the local buffers")?;
    let opened = open_target(args, &engine, largest, true)?;
    let (peer, target, pool_base, pool_len) = (
        &opened.peer,
        &opened.name,
        opened.pool_base,
        opened.pool_len,
    );
    if pool_len < largest {
        bail!(
            "the target's pool of {} holds no {} ping",
            format_size(pool_len),
            format_size(largest)
        );
    }
    let mut submitter = engine.submitter()?;
    let reply_to = engine.addr().to_string();
    let mut seq = 0u64;
    let mut rows = Vec::new();
    for (index, &size) in sizes.iter().enumerate() {
        let sent = local_slice(local, 0, size);
        for (i, byte) in sent.iter_mut().enumerate() {
            *byte = (i as u64 ^ size ^ seq) as u8;
        }
        local_slice(local, largest, size).fill(0);
        let mut times = Vec::new();
        let started = Instant::now();
        let mut made = 0u64;
        while !budget.spent(times.len() as u64, started) {
            seq += 1;
            let ping = Ping {
                reply_to: reply_to.clone(),
                landing: local.addr + largest,
                len: size,
                seq,
            };
            let write = Transfer {
                op: Op::Write,
                local,
                local_offset: 0,
                remote_addr: pool_base,
                len: size,
            };
            let began = Instant::now();
            let batch = submitter.submit_and_notify(peer, &[write], ping.encode())?;
            if !wait_for_pong(&engine, seq, began + ROUND_TRIP_BOUND) {
                bail!(
                    "no answer to a {} ping within {ROUND_TRIP_BOUND:?} (write: {:?}): a \
                     --target must run `railyard serve --echo`",
                    format_size(size),
                    batch.outcomes().first().copied().flatten()
                );
            }
            let took = began.elapsed();
            made += 1;
            if made > WARM_UP {
                times.push(took);
            }
        }
        if local_slice(local, largest, size) != local_slice(local, 0, size) {
            bail!(
                "the {} answered did not hold the bytes sent",
                format_size(size)
            );
        }
        times.sort_unstable();
        rows.push((
            size,
            Distribution(times),
            ceilings.as_ref().map(|c| &c[index]),
        ));
    }
    let ceiling_what = if socket_ceiling {
        "plain TCP ping-pong on loopback: the same bytes each way on one connection, both ends \
         busy-polling non-blocking sockets, TCP_NODELAY"
    } else {
        "shared-memory ping-pong between two threads: the same bytes copied each way, a \
         spinning flag each way"
    };
    if args.json {
        let sizes: Vec<serde_json::Value> = rows
            .iter()
            .map(|(size, railyard, ceiling)| {
                let mut row = railyard.json();
                if let Some(row) = row.as_object_mut() {
                    row.insert("size".into(), json!(size));
                    row.insert("ceiling".into(), ceiling.map_or(json!(null), |c| c.json()));
                    row.insert(
                        "p50_over_ceiling".into(),
                        ceiling.map_or(json!(null), |c| {
                            json!(((railyard.us(0.5) / c.us(0.5).max(0.1)) * 100.0).round() / 100.0)
                        }),
                    );
                }
                row
            })
            .collect();
        println!(
            "{}",
            json!({
                "fabric": engine.fabric(),
                "target": target,
                "unit": "us",
                "round_trip": "one write with its notification, answered by a write of the same bytes back with a notification",
                "ceiling": args.target.is_none().then_some(ceiling_what),
                "sizes": sizes,
            })
        );
    } else {
        println!(
            "{:>8} {:>11} {:>9} {:>9} {:>9}   {:>9} {:>9} {:>9} {:>7}",
            "size",
            "round trips",
            "p50 us",
            "p99 us",
            "p999 us",
            "ceil p50",
            "ceil p99",
            "ceil p999",
            "p50 ×"
        );
        for (size, railyard, ceiling) in &rows {
            let ceiling_columns = match ceiling {
                Some(c) => format!(
                    "{:>9.1} {:>9.1} {:>9.1} {:>7.1}",
                    c.us(0.5),
                    c.us(0.99),
                    c.us(0.999),
                    railyard.us(0.5) / c.us(0.5).max(0.1)
                ),
                None => format!("{:>9} {:>9} {:>9} {:>7}", "-", "-", "-", "-"),
            };
            println!(
                "{:>8} {:>11} {:>9.1} {:>9.1} {:>9.1}   {ceiling_columns}",
                format_size(*size),
                railyard.0.len(),
                railyard.us(0.5),
                railyard.us(0.99),
                railyard.us(0.999),
            );
        }
        println!(
            "round trip: one write with its notification, answered by the target's write of the \
             same bytes back with a notification ({} fabric, {} rail(s))",
            engine.fabric(),
            engine.rails()
        );
        match args.target {
            None => println!("ceiling, measured in this run: {ceiling_what}"),
            Some(_) => println!("no ceiling: the target is elsewhere"),
        }
    }
    // This engine stops before the target it started (which it would see go away).
    let OpenTarget { peer, child, .. } = opened;
    drop(peer);
    drop(engine);
    drop(child);
    Ok(())
}

/// The round trip over a plain TCP connection on loopback: `size` bytes each way, the
/// answering thread reading them all before writing them back. Both ends busy-poll
/// non-blocking sockets, as railyard's pollers do (a blocking reader would pay for sleeping
/// and waking, which the fabric does not).
fn socket_ping_pong(size: u64, budget: Budget) -> anyhow::Result<Distribution> {
    let size = size as usize;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    std::thread::scope(|scope| -> anyhow::Result<Distribution> {
        let answering = scope.spawn(move || -> anyhow::Result<()> {
            let (socket, _) = listener.accept()?;
            socket.set_nodelay(true)?;
            socket.set_nonblocking(true)?;
            let mut buffer = vec![0u8; size];
            while read_all_spinning(&socket, &mut buffer)? {
                write_all_spinning(&socket, &buffer)?;
            }
            Ok(())
        });
        let socket = TcpStream::connect(addr)?;
        socket.set_nodelay(true)?;
        socket.set_nonblocking(true)?;
        let sent = vec![0x5au8; size];
        let mut back = vec![0u8; size];
        let mut times = Vec::new();
        let started = Instant::now();
        let mut made = 0u64;
        let result = (|| -> anyhow::Result<()> {
            while !budget.spent(times.len() as u64, started) {
                let began = Instant::now();
                write_all_spinning(&socket, &sent)?;
                if !read_all_spinning(&socket, &mut back)? {
                    bail!("the socket ceiling's answering side closed");
                }
                made += 1;
                if made > WARM_UP {
                    times.push(began.elapsed());
                }
            }
            Ok(())
        })();
        socket.shutdown(std::net::Shutdown::Both)?;
        answering
            .join()
            .map_err(|_| anyhow::anyhow!("the socket ceiling's answering thread panicked"))??;
        result?;
        times.sort_unstable();
        Ok(Distribution(times))
    })
}

/// Writes all of `bytes` to a non-blocking `socket`, spinning while its buffer is full.
fn write_all_spinning(socket: &TcpStream, mut bytes: &[u8]) -> anyhow::Result<()> {
    while !bytes.is_empty() {
        let written = write_spinning(socket, &[IoSlice::new(bytes)])?;
        bytes = &bytes[written..];
    }
    Ok(())
}

/// Fills `buffer` from a non-blocking `socket`, spinning while nothing has arrived: false
/// if the stream ended before the first byte.
fn read_all_spinning(mut socket: &TcpStream, buffer: &mut [u8]) -> anyhow::Result<bool> {
    let mut got = 0;
    while got < buffer.len() {
        match read_spinning(&mut socket, &mut buffer[got..])? {
            0 if got == 0 => return Ok(false),
            0 => bail!("the socket ceiling's stream ended inside a message"),
            read => got += read,
        }
    }
    Ok(true)
}

/// The round trip through shared memory between two threads: `size` bytes copied into a
/// buffer the other thread sees, a flag raised, the other thread copying them into a
/// buffer of its own and raising a flag back.
fn shared_memory_ping_pong(size: u64, budget: Budget) -> anyhow::Result<Distribution> {
    let size = size as usize;
    let there = Mailbox::new(size);
    let back = Mailbox::new(size);
    let sent = vec![0x5au8; size];
    std::thread::scope(|scope| -> anyhow::Result<Distribution> {
        let answering = scope.spawn(|| -> anyhow::Result<()> {
            let mut copy = vec![0u8; size];
            let mut seq = 1;
            loop {
                match there.take(seq, &mut copy)? {
                    true => back.put(seq, &copy),
                    false => return Ok(()),
                }
                seq += 1;
            }
        });
        let mut landed = vec![0u8; size];
        let mut times = Vec::new();
        let started = Instant::now();
        let mut seq = 1;
        let result = (|| -> anyhow::Result<()> {
            while !budget.spent(times.len() as u64, started) {
                let began = Instant::now();
                there.put(seq, &sent);
                back.take(seq, &mut landed)?;
                if seq > WARM_UP {
                    times.push(began.elapsed());
                }
                seq += 1;
            }
            Ok(())
        })();
        there.close();
        answering.join().map_err(|_| {
            anyhow::anyhow!("the shared-memory ceiling's answering thread panicked")
        })??;
        result?;
        times.sort_unstable();
        Ok(Distribution(times))
    })
}

/// One direction of the shared-memory ping-pong: a buffer and the sequence number of the
/// message in it (`u64::MAX`: closed).
struct Mailbox {
    bytes: std::sync::Mutex<Vec<u8>>,
    seq: AtomicU64,
}

impl Mailbox {
    fn new(size: usize) -> Self {
        Self {
            bytes: std::sync::Mutex::new(vec![0; size]),
            seq: AtomicU64::new(0),
        }
    }

    fn put(&self, seq: u64, bytes: &[u8]) {
        self.bytes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .copy_from_slice(bytes);
        self.seq.store(seq, Ordering::Release);
    }

    /// Spins until message `seq` is in, then copies it out: false if the box was closed.
    fn take(&self, seq: u64, into: &mut [u8]) -> anyhow::Result<bool> {
        let began = Instant::now();
        loop {
            match self.seq.load(Ordering::Acquire) {
                u64::MAX => return Ok(false),
                current if current == seq => break,
                _ if began.elapsed() > ROUND_TRIP_BOUND => {
                    bail!("the shared-memory ceiling's other side stopped answering")
                }
                _ => std::hint::spin_loop(),
            }
        }
        into.copy_from_slice(
            &self
                .bytes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        Ok(true)
    }

    fn close(&self) {
        self.seq.store(u64::MAX, Ordering::Release);
    }
}
