//! 64 engines on this host — 8 processes of 8 engines — write to each other all-to-all, on
//! the TCP fabric and on the soft fabric, each engine allowed fewer queue pairs than it has
//! peers: idle endpoints are parked and woken while transfers run. Every block is checked
//! where it landed, no transfer fails, descriptors and memory stay bounded, and the
//! handshake time p99 is printed. (That a rail never holds more queue pairs than its cap is
//! checked where it can be checked exactly: the simulation and the core's own tests.)
//!
//! The processes are this test binary again, run with [`CHILD`] set: the parent passes them
//! every engine's address and tells them when to start and when to check.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::thread;
use std::time::{Duration, Instant};

use common::lines_of;
use common::mapped::Buffer;
use railyard::control::Policy;
use railyard::engine::{Engine, FabricChoice, Op, RailChoice, Transfer};

/// Set in a child process: the fabric it runs (`tcp` or `soft`).
const CHILD: &str = "RAILYARD_MANY_ENGINES_CHILD";
const PROCESSES: usize = 8;
const ENGINES_PER_PROCESS: usize = 8;
const ENGINES: usize = PROCESSES * ENGINES_PER_PROCESS;
/// Queue pairs per rail each engine may hold: fewer than its 63 peers.
const CAP: usize = 16;
/// One block per (source, destination) pair.
const BLOCK: usize = 4096;
/// Rounds of all-to-all writes; the last round's blocks are what is checked.
const ROUNDS: usize = 2;
/// Opens at once per engine while warming up.
const WARMUP_PARALLEL: usize = 8;
/// Each transfer's deadline.
const DEADLINE: Duration = Duration::from_secs(60);
/// How long a child may take for each step.
const STEP: Duration = Duration::from_secs(300);

/// The bytes engine `source` writes to engine `destination` in `round`.
fn pattern(source: usize, destination: usize, round: usize) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u64 * 2_654_435_761 + (source * 131 + destination * 7 + round) as u64) as u8)
        .collect()
}

fn fabric_named(name: &str) -> FabricChoice {
    match name {
        "tcp" => FabricChoice::Tcp,
        _ => FabricChoice::Soft,
    }
}

fn engine(name: &str, fabric: FabricChoice) -> Engine {
    Engine::builder(name)
        .fabric(fabric)
        .rails(RailChoice::Count(
            std::num::NonZeroUsize::new(1).expect("one"),
        ))
        .idle(railyard::dataplane::IdleStrategy::gentle())
        .slice_size(BLOCK)
        .policy(Policy {
            max_endpoints_per_rail: CAP,
            // 64 engines' threads share this host's cores: a handshake can wait its turn.
            connect_timeout: Duration::from_secs(20),
            ..Policy::default()
        })
        .build()
        .expect("the engine starts")
}

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

/// A child: its engines, told their peers, write all-to-all and then check what landed.
#[test]
fn child_process() {
    let Ok(fabric) = std::env::var(CHILD) else {
        return;
    };
    let fabric = fabric_named(&fabric);
    let process: usize = std::env::var("RAILYARD_MANY_ENGINES_INDEX")
        .expect("an index")
        .parse()
        .expect("a number");
    let engines: Vec<Engine> = (0..ENGINES_PER_PROCESS)
        .map(|e| engine(&format!("many-{process}-{e}"), fabric))
        .collect();
    let buffers: Vec<Buffer> = engines
        .iter()
        .map(|engine| {
            let buffer = Buffer::sized(ENGINES * BLOCK, 0);
            buffer.register(engine);
            buffer
        })
        .collect();
    let sources: Vec<(Buffer, railyard::engine::Region)> = engines
        .iter()
        .map(|engine| {
            let buffer = Buffer::sized(BLOCK, 0);
            let region = buffer.register(engine);
            (buffer, region)
        })
        .collect();
    for (engine, buffer) in engines.iter().zip(&buffers) {
        println!("ADDR {} {}", engine.addr(), buffer.addr());
    }
    std::io::stdout().flush().expect("stdout");
    let mut stdin = BufReader::new(std::io::stdin()).lines();
    let all: Vec<(String, u64)> = stdin
        .next()
        .expect("the peers' addresses")
        .expect("a line")
        .split_whitespace()
        .map(|pair| {
            let (addr, base) = pair.split_once('@').expect("addr@base");
            (addr.to_string(), base.parse().expect("a base"))
        })
        .collect();
    assert_eq!(all.len(), ENGINES);

    let started = Instant::now();
    let failed: usize = thread::scope(|scope| {
        let runners: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(e, engine)| {
                let (all, (source, local)) = (&all, &sources[e]);
                let local = *local;
                scope.spawn(move || {
                    let me = process * ENGINES_PER_PROCESS + e;
                    let targets: Vec<&str> = all
                        .iter()
                        .enumerate()
                        .filter(|&(other, _)| other != me)
                        .map(|(_, (addr, _))| addr.as_str())
                        .collect();
                    let warmed = engine.warmup_with(&targets, WARMUP_PARALLEL);
                    let mut peers = Vec::new();
                    for warmed in warmed {
                        let peer = warmed.result.unwrap_or_else(|error| {
                            panic!("engine {me} could not open {}: {error}", warmed.target)
                        });
                        peers.push(peer);
                    }
                    let mut submitter = engine.submitter().expect("submitter");
                    let mut failed = 0;
                    for round in 0..ROUNDS {
                        // Each engine walks its peers from its own place in the ring.
                        for step in 0..peers.len() {
                            let index = (step + me) % peers.len();
                            let destination = if index >= me { index + 1 } else { index };
                            source.write(0, &pattern(me, destination, round));
                            // A parked endpoint's transfer waits for a handshake, which
                            // on two cores shared by 64 engines can take seconds.
                            let batch = submitter
                                .submit_by(
                                    &peers[index],
                                    &[Transfer {
                                        op: Op::Write,
                                        local,
                                        local_offset: 0,
                                        remote_addr: all[destination].1 + (me * BLOCK) as u64,
                                        len: BLOCK as u64,
                                    }],
                                    Instant::now() + DEADLINE,
                                )
                                .expect("submits");
                            let status = batch.wait(Instant::now() + STEP);
                            assert!(status.is_complete(), "engine {me} → {destination}");
                            if status.failed > 0 {
                                eprintln!("engine {me} → {destination}: {:?}", batch.outcomes());
                            }
                            failed += status.failed;
                        }
                    }
                    failed
                })
            })
            .collect();
        runners
            .into_iter()
            .map(|runner| runner.join().expect("the runner finishes"))
            .sum()
    });
    let mut p99 = 0;
    let (mut evictions, mut waits, mut handshakes) = (0, 0, 0);
    let mut most_live = 0;
    for engine in &engines {
        let stats = engine.stats();
        let times = stats.control.handshake_times;
        handshakes += times.count;
        p99 = p99.max(times.quantile_bound_us(0.99).unwrap_or(u64::MAX));
        evictions += stats.control.evictions;
        waits += stats.control.endpoint_waits;
        most_live = most_live.max(stats.rails[0].endpoints.live);
    }
    println!(
        "DONE failed={failed} handshakes={handshakes} p99_us={p99} evictions={evictions} \
         waits={waits} most_live={most_live} fds={} rss_kib={} secs={:.1}",
        open_descriptors(),
        common::rss_kib(std::process::id()),
        started.elapsed().as_secs_f64()
    );
    std::io::stdout().flush().expect("stdout");
    // Everyone has written: check what landed here.
    let go = stdin.next().expect("check").expect("a line");
    assert_eq!(go, "CHECK");
    let mut wrong = 0;
    for (e, buffer) in buffers.iter().enumerate() {
        let me = process * ENGINES_PER_PROCESS + e;
        for source in (0..ENGINES).filter(|&source| source != me) {
            let landed = buffer.read(source * BLOCK, BLOCK);
            if landed != pattern(source, me, ROUNDS - 1) {
                wrong += 1;
                // What landed instead, for the report: an older round's block, another
                // destination's, or something else.
                let whose = (0..ROUNDS)
                    .flat_map(|round| (0..ENGINES).map(move |to| (round, to)))
                    .find(|&(round, to)| landed == pattern(source, to, round));
                eprintln!("engine {me}: the block from {source} is wrong: {whose:?} (round, for)");
            }
        }
    }
    println!("CHECKED wrong={wrong}");
    std::io::stdout().flush().expect("stdout");
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Worker {
    fn start(fabric: &str, index: usize) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"))
            .args([
                "--exact",
                "child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, fabric)
            .env("RAILYARD_MANY_ENGINES_INDEX", index.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the child starts");
        let stdin = child.stdin.take().expect("stdin");
        let lines = lines_of(child.stdout.take().expect("stdout"));
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// What follows `prefix` on the next line that has it, within [`STEP`].
    fn expect(&self, prefix: &str) -> String {
        let end = Instant::now() + STEP;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no {prefix} line within {STEP:?}"));
            // The first line follows libtest's "test child_process ... ".
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_string();
            }
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("the child reads");
        self.stdin.flush().expect("flush");
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(line: &str, name: &str) -> u64 {
    line.split_whitespace()
        .find_map(|pair| pair.strip_prefix(&format!("{name}=")))
        .and_then(|value| value.parse::<f64>().ok())
        .map(|value| value as u64)
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

fn all_to_all(fabric: &str) {
    let mut workers: Vec<Worker> = (0..PROCESSES).map(|i| Worker::start(fabric, i)).collect();
    let mut addresses = Vec::new();
    for worker in &workers {
        for _ in 0..ENGINES_PER_PROCESS {
            let line = worker.expect("ADDR");
            let (addr, base) = line.split_once(' ').expect("addr and base");
            addresses.push(format!("{addr}@{base}"));
        }
    }
    let everyone = addresses.join(" ");
    for worker in &mut workers {
        worker.say(&everyone);
    }
    let done: Vec<String> = workers.iter().map(|worker| worker.expect("DONE")).collect();
    for worker in &mut workers {
        worker.say("CHECK");
    }
    for (index, worker) in workers.iter().enumerate() {
        let checked = worker.expect("CHECKED");
        assert_eq!(field(&checked, "wrong"), 0, "process {index}: {checked}");
    }
    let mut p99 = 0;
    for (index, line) in done.iter().enumerate() {
        println!("{fabric} process {index}: {line}");
        assert_eq!(field(line, "failed"), 0, "process {index}: {line}");
        // The engines wrote to 63 peers each through 16 queue pairs: idle ones were parked.
        assert!(field(line, "evictions") > 0, "{line}");
        // Descriptors: each engine's queue pairs are capped, its control connections and
        // the peers' queue pairs to it are one per peer at most.
        assert!(field(line, "fds") < 4_000, "{line}");
        assert!(field(line, "rss_kib") < 1 << 20, "{line}");
        p99 = p99.max(field(line, "p99_us"));
    }
    println!("{fabric}: handshake p99 ≤ {p99} µs (bucket bound) over {ENGINES} engines");
}

#[test]
fn sixty_four_engines_write_all_to_all_under_a_queue_pair_cap() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    for fabric in ["tcp", "soft"] {
        all_to_all(fabric);
    }
}
