//! `railyard chaos soak`: several target processes (`railyard serve`), an initiator engine
//! in this process with workers writing, reading back and comparing blocks for the whole
//! duration, and a seeded schedule of every failure the engine must ride out — a target
//! killed (SIGKILL) and a newcomer on its port (under the same name or another), a target
//! stopped (SIGSTOP: no reset) and let go again, bursts of queue-pair errors, and a target
//! re-registering its pool (new keys: every initiator's descriptor of it goes stale). With
//! `--etcd` (feature `etcd`) it runs an etcd, every process publishes itself there, targets
//! are opened by name, and etcd itself is stopped for 1–3 s and started again: live targets
//! must keep serving through the outage, none failing fast for it.
//!
//! It reports requests, failures by reason, bytes verified, how long stopped targets took to
//! fail fast (from the signal to the first `PeerUnavailable` of the injector's own probe
//! writes), and this process's resident
//! memory and open descriptors after warming up and at the end. A violation is: a request
//! lost (unresolved by its deadline plus [`SLACK`]), resolved late, a block read back that
//! is not what was written (unverified or misdirected bytes), a stopped target not failing
//! fast within [`DETECTION_BOUND`], a live target failing fast or getting nothing done while
//! etcd is down, or growth beyond [`RSS_GROWTH_BOUND`] / [`FD_GROWTH_BOUND`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use railyard_engine::dataplane::fabric::WcStatus;
use railyard_engine::dataplane::fabric::soft::{Fault, QpMatch};
use railyard_engine::dataplane::rng::SplitMix64;
use railyard_engine::dataplane::{DEFAULT_DEADLINE, FailReason, IdleStrategy, RequestOutcome};
use railyard_engine::{DirectoryChoice, Engine, Op, Peer, RailChoice, Region, Transfer};

use super::fabric::ChaosFabric;
use super::harness::{read_through_fresh_peer, region_bytes};
use super::process::Target;

#[cfg(feature = "etcd")]
use super::etcd_server::EtcdServer;

/// Without the `etcd` feature there is no etcd to run: a type without values.
#[cfg(not(feature = "etcd"))]
enum EtcdServer {}

#[cfg(not(feature = "etcd"))]
impl EtcdServer {
    fn start(_ttl_seconds: u64) -> Result<Self> {
        anyhow::bail!("--etcd needs a railyard built with the `etcd` feature")
    }

    fn url(&self) -> String {
        match *self {}
    }

    fn stop(&mut self) {
        match *self {}
    }

    fn run(&mut self) -> Result<()> {
        match *self {}
    }
}

/// How often the stop prober writes to a stopped target.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);

/// Lease time to live of the soak's processes in etcd, in seconds.
const LEASE_TTL: u64 = 2;

/// How late past its deadline a request may resolve (the poller's flush grace and
/// scheduling on a small machine).
pub const SLACK: Duration = Duration::from_secs(2);
/// How soon after SIGSTOP work to the stopped target must fail fast.
pub const DETECTION_BOUND: Duration = Duration::from_millis(2500);
/// Resident memory this process may gain between warm-up and the end.
pub const RSS_GROWTH_BOUND: u64 = 64 << 10; // KiB
/// How soon after SIGCONT a stopped target must serve its old peer again (no reopening):
/// its circuit's cooldown, doubled for each time it was stopped again before its trial
/// succeeded (5 s, 10 s, 20 s by default), plus the trial.
pub const RESUME_BOUND: Duration = Duration::from_secs(25);
/// Open descriptors this process may gain between warm-up and the end: a live target
/// costs a few (its control connection, the pidfd of each queue pair to it, a mapped
/// memfd); more than this means something is kept per fault.
pub const FD_GROWTH_BOUND: u64 = 16;

/// Bytes per block written and read back.
const BLOCK: u64 = 64 << 10;
/// Blocks per worker in each target's pool.
const SLOTS: u64 = 16;
/// Writers.
const WORKERS: usize = 2;

/// What to run.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// The `railyard` binary (its `serve` subcommand runs the targets).
    pub binary: PathBuf,
    /// How long.
    pub duration: Duration,
    /// Seeds the fault schedule and the workers' choices.
    pub seed: u64,
    /// Target processes.
    pub targets: usize,
    /// Run an etcd, publish every process in it, open targets by name, and restart etcd
    /// now and then (feature `etcd`).
    pub etcd: bool,
    /// The fabric of the initiator and the targets.
    pub fabric: ChaosFabric,
}

/// What happened.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SoakReport {
    /// The seed.
    pub seed: u64,
    /// Seconds run.
    pub duration_s: f64,
    /// Requests submitted.
    pub requests: u64,
    /// Requests done.
    pub done: u64,
    /// Failed requests by reason.
    pub failures: BTreeMap<String, u64>,
    /// Requests not resolved by their deadline plus the slack.
    pub lost: u64,
    /// Requests resolved, but after their deadline plus the slack.
    pub late: u64,
    /// Bytes written, read back and found as written.
    pub bytes_verified: u64,
    /// Blocks read back that were not what was written there.
    pub mismatched_blocks: u64,
    /// Blocks found at the end in a target's memory that were meant for another target, or
    /// for an earlier process on its port (checked through a fresh peer, after the run).
    pub misdirected_blocks: u64,
    /// Requests to a stopped target, made before the stop was detected, that failed by their
    /// deadline instead of fast.
    pub timeouts_while_stopped: u64,
    /// Requests to a stopped target made after the stop was detected that failed by their
    /// deadline instead of fast (on every fabric a violation).
    pub timeouts_after_detection: u64,
    /// Whether writes complete at a stopped target on this fabric
    /// ([`ChaosFabric::writes_complete_at_stopped_targets`]). Where they do,
    /// `timeouts_while_stopped` is a violation too; where they do not, a request in flight at
    /// a stop can only resolve by its deadline (which `late` and `lost` bound).
    pub writes_complete_at_stopped_targets: bool,
    /// Targets killed, each replaced by a newcomer on its port.
    pub kills: u64,
    /// Of those newcomers, the ones under the dead target's name.
    pub same_name_takeovers: u64,
    /// Targets stopped and let go again.
    pub stops: u64,
    /// Bursts of injected queue-pair errors.
    pub qp_error_bursts: u64,
    /// Pools re-registered under new keys.
    pub descriptor_changes: u64,
    /// Times etcd was stopped and started again (`--etcd`).
    pub etcd_restarts: u64,
    /// Requests to targets that were live when etcd stopped that failed fast
    /// (`PeerUnavailable`) before it was back.
    pub unavailable_during_etcd_outage: u64,
    /// Per restart, the live targets that got no request done while etcd was down.
    pub stalled_during_etcd_outage: u64,
    /// Peers opened again (after a takeover or a failure).
    pub reopens: u64,
    /// From SIGSTOP to the first request failing fast, per stop, in ms: median.
    pub detection_ms_p50: u64,
    /// The same, 99th percentile.
    pub detection_ms_p99: u64,
    /// The same, longest.
    pub detection_ms_max: u64,
    /// Stops of a target whose peer was carrying traffic (the ones timed).
    pub timed_stops: u64,
    /// Timed stops after which nothing failed fast while stopped.
    pub undetected_stops: u64,
    /// From SIGCONT to the first request done through the same peer, longest, in ms.
    pub resume_ms_max: u64,
    /// Stopped targets not serving their peer again within [`RESUME_BOUND`] of SIGCONT.
    pub unresumed_stops: u64,
    /// Stopped (not killed) targets whose peer had to be opened again: a stop is not a
    /// restart, and traffic must resume without the application reopening.
    pub reopened_after_stop: u64,
    /// Targets whose memory could not be read for the misdirection check.
    pub unchecked_targets: u64,
    /// This process's resident memory after warm-up, KiB.
    pub rss_kib_start: u64,
    /// At the end.
    pub rss_kib_end: u64,
    /// Its open descriptors after warm-up.
    pub fds_start: u64,
    /// At the end.
    pub fds_end: u64,
}

impl SoakReport {
    /// The promises the run broke.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        if self.lost > 0 {
            broken.push(format!("{} request(s) never resolved", self.lost));
        }
        if self.late > 0 {
            broken.push(format!(
                "{} request(s) resolved past their deadline + {SLACK:?}",
                self.late
            ));
        }
        if self.misdirected_blocks > 0 {
            broken.push(format!(
                "{} block(s) landed in a process they were not meant for",
                self.misdirected_blocks
            ));
        }
        if self.timeouts_after_detection > 0 {
            broken.push(format!(
                "{} request(s) made after a stop was detected waited for their deadline",
                self.timeouts_after_detection
            ));
        }
        if self.timeouts_while_stopped > 0 && self.writes_complete_at_stopped_targets {
            broken.push(format!(
                "{} request(s) to a stopped target waited for their deadline",
                self.timeouts_while_stopped
            ));
        }
        if self.mismatched_blocks > 0 {
            broken.push(format!(
                "{} block(s) read back were not what was written",
                self.mismatched_blocks
            ));
        }
        if self.unresumed_stops > 0 {
            broken.push(format!(
                "{} stopped target(s) did not serve their peer again within {RESUME_BOUND:?}",
                self.unresumed_stops
            ));
        }
        if self.reopened_after_stop > 0 {
            broken.push(format!(
                "{} stopped target(s) had to be opened again",
                self.reopened_after_stop
            ));
        }
        if self.unchecked_targets > 0 {
            broken.push(format!(
                "{} target(s) could not be checked for misdirected blocks",
                self.unchecked_targets
            ));
        }
        if self.undetected_stops > 0 {
            broken.push(format!(
                "{} stopped target(s) never failed fast while stopped",
                self.undetected_stops
            ));
        }
        if self.detection_ms_max > DETECTION_BOUND.as_millis() as u64 {
            broken.push(format!(
                "a stopped target failed fast only after {} ms (bound {DETECTION_BOUND:?})",
                self.detection_ms_max
            ));
        }
        if self.unavailable_during_etcd_outage > 0 {
            broken.push(format!(
                "{} request(s) to live targets failed fast while etcd was down",
                self.unavailable_during_etcd_outage
            ));
        }
        if self.stalled_during_etcd_outage > 0 {
            broken.push(format!(
                "{} live target(s) got nothing done while etcd was down",
                self.stalled_during_etcd_outage
            ));
        }
        if self.done == 0 {
            broken.push("no request succeeded".into());
        }
        let rss = self.rss_kib_end.saturating_sub(self.rss_kib_start);
        if rss > RSS_GROWTH_BOUND {
            broken.push(format!("resident memory grew by {rss} KiB"));
        }
        let fds = self.fds_end.saturating_sub(self.fds_start);
        if fds > FD_GROWTH_BOUND {
            broken.push(format!("open descriptors grew by {fds}"));
        }
        broken
    }
}

/// What workers see of a target: where it is, and the peer they share.
struct Slot {
    addr: SocketAddr,
    /// Its name (what workers open with `--etcd`).
    name: String,
    pool_base: u64,
    generation: u8,
    peer: Option<Peer>,
    /// When it was stopped, until it is let go.
    stopped_at: Option<Instant>,
    /// Its stop was detected (a probe write failed fast), until it is let go.
    stop_detected: bool,
    /// When it was let go after a stop, until a request through the same peer is done.
    resumed_from: Option<Instant>,
}

/// Counts the workers add to.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    done: AtomicU64,
    lost: AtomicU64,
    late: AtomicU64,
    bytes_verified: AtomicU64,
    mismatched_blocks: AtomicU64,
    timeouts_while_stopped: AtomicU64,
    timeouts_after_detection: AtomicU64,
    reopens: AtomicU64,
    reopened_after_stop: AtomicU64,
    /// ms from SIGCONT to the first request done, per stop.
    resumes: Mutex<Vec<u64>>,
    failures: Mutex<BTreeMap<String, u64>>,
    /// Per target, what happened to it while etcd was down.
    outage: Vec<OutageCounts>,
}

/// What happened to one target's requests during an etcd outage.
#[derive(Default)]
struct OutageCounts {
    /// It was live when etcd stopped: its requests are counted until etcd is back.
    watched: AtomicBool,
    done: AtomicU64,
    unavailable: AtomicU64,
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Resident memory and open descriptors of this process.
fn footprint() -> (u64, u64) {
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count() as u64);
    (rss, fds)
}

/// The pattern of a block: its first 8 bytes are `tag` — which names the target, its
/// generation, the writer and the round — and the rest follows from it, so a block that
/// landed anywhere else, or stale, does not compare equal and says where it was meant to go.
fn fill(bytes: &mut [u8], tag: u64) {
    let mut rng = SplitMix64::new(tag);
    for chunk in bytes.chunks_mut(8) {
        let word = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    bytes[..8].copy_from_slice(&tag.to_le_bytes());
}

/// A block tag: target index, the generation of the process on its port, writer, round.
fn tag(index: usize, generation: u8, worker: usize, round: u64) -> u64 {
    (index as u64) << 56 | u64::from(generation) << 48 | (worker as u64) << 40 | round
}

/// After the run: reads every target's written slots through a fresh peer and counts the
/// blocks tagged for another target or another generation (a process that had the port);
/// returns them and the targets that could not be read.
fn misdirected(engine: &Engine, slots: &[RwLock<Slot>]) -> (u64, u64) {
    let len = WORKERS as u64 * SLOTS * BLOCK;
    let Ok(back) = engine.alloc(len, None) else {
        return (0, slots.len() as u64);
    };
    let (mut wrong, mut unchecked) = (0, 0);
    for (index, slot) in slots.iter().enumerate() {
        let (addr, base, generation) = {
            let slot = slot.read().unwrap_or_else(PoisonError::into_inner);
            (slot.addr, slot.pool_base, slot.generation)
        };
        // A target let go late in the run may still have its circuit open: its peer can be
        // read once the circuit's trial succeeds.
        let give_up = Instant::now() + RESUME_BOUND;
        let mut read = read_through_fresh_peer(engine, addr, base, back);
        while !read && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(200));
            read = read_through_fresh_peer(engine, addr, base, back);
        }
        if !read {
            unchecked += 1;
            continue;
        }
        // SAFETY: the read has resolved; nothing else uses `back`.
        let bytes = unsafe { region_bytes(back) };
        // Target and generation: the tag's top 16 bits.
        let meant = tag(index, generation, 0, 0) >> 48;
        for block in bytes.chunks(BLOCK as usize) {
            let mut word = [0u8; 8];
            word.copy_from_slice(&block[..8]);
            let found = u64::from_le_bytes(word);
            if found != 0 && found >> 48 != meant {
                wrong += 1;
            }
        }
    }
    (wrong, unchecked)
}

/// Runs the soak.
///
/// # Errors
/// When a target or the engine cannot start.
pub fn run(config: &SoakConfig) -> Result<SoakReport> {
    let mut rng = SplitMix64::new(config.seed ^ 0x50a4);
    let mut etcd = if config.etcd {
        Some(EtcdServer::start(LEASE_TTL)?)
    } else {
        None
    };
    let directory = etcd.as_ref().map(EtcdServer::url);
    let mut targets = Vec::new();
    for index in 0..config.targets.max(2) {
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let name = format!("soak-{index}");
        targets.push(start_target(
            config,
            &name,
            listen,
            0,
            directory.as_deref(),
        )?);
    }
    let engine = config
        .fabric
        .builder(railyard_engine::default_name("soak"))
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .directory(
            directory
                .clone()
                .map_or(DirectoryChoice::P2p, DirectoryChoice::Etcd),
        )
        .build()
        .context("starting the initiator")?;
    let slots: Vec<RwLock<Slot>> = targets
        .iter()
        .enumerate()
        .map(|(index, target)| {
            RwLock::new(Slot {
                addr: target.addr,
                name: format!("soak-{index}"),
                pool_base: target.pool_base,
                generation: target.generation,
                peer: None,
                stopped_at: None,
                stop_detected: false,
                resumed_from: None,
            })
        })
        .collect();
    let tally = Tally {
        outage: slots.iter().map(|_| OutageCounts::default()).collect(),
        ..Tally::default()
    };
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let end = started + config.duration;
    let mut report = SoakReport {
        seed: config.seed,
        writes_complete_at_stopped_targets: config.fabric.writes_complete_at_stopped_targets(),
        ..SoakReport::default()
    };
    std::thread::scope(|scope| -> Result<()> {
        for worker in 0..WORKERS {
            let (engine, slots, tally, stop) = (&engine, &slots, &tally, &stop);
            let seed = config.seed ^ (worker as u64 + 1) << 32;
            let by_name = config.etcd;
            scope.spawn(move || work(engine, slots, tally, stop, (worker, by_name), seed));
        }
        // Warm up, then take the footprint the end is compared with.
        std::thread::sleep(Duration::from_secs(2).min(config.duration / 4));
        (report.rss_kib_start, report.fds_start) = footprint();
        let result = inject(
            config,
            (&engine, etcd.as_mut()),
            &mut targets,
            (&slots, &tally),
            &mut rng,
            end,
            &mut report,
        );
        stop.store(true, Ordering::Relaxed);
        result
    })?;
    (report.rss_kib_end, report.fds_end) = footprint();
    report.duration_s = started.elapsed().as_secs_f64();
    report.requests = tally.requests.load(Ordering::Relaxed);
    report.done = tally.done.load(Ordering::Relaxed);
    report.lost = tally.lost.load(Ordering::Relaxed);
    report.late = tally.late.load(Ordering::Relaxed);
    report.bytes_verified = tally.bytes_verified.load(Ordering::Relaxed);
    report.mismatched_blocks = tally.mismatched_blocks.load(Ordering::Relaxed);
    report.timeouts_while_stopped = tally.timeouts_while_stopped.load(Ordering::Relaxed);
    report.timeouts_after_detection = tally.timeouts_after_detection.load(Ordering::Relaxed);
    (report.misdirected_blocks, report.unchecked_targets) = misdirected(&engine, &slots);
    report.reopened_after_stop = tally.reopened_after_stop.load(Ordering::Relaxed);
    report.resume_ms_max = tally
        .resumes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .copied()
        .max()
        .unwrap_or(0);
    report.unresumed_stops = slots
        .iter()
        .filter(|slot| {
            slot.read()
                .unwrap_or_else(PoisonError::into_inner)
                .resumed_from
                .is_some_and(|since| since.elapsed() > RESUME_BOUND)
        })
        .count() as u64;
    report.reopens = tally.reopens.load(Ordering::Relaxed);
    report.failures = tally
        .failures
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    Ok(report)
}

/// Starts target `name` on `listen`, published in `directory` if there is one.
fn start_target(
    config: &SoakConfig,
    name: &str,
    listen: SocketAddr,
    generation: u8,
    directory: Option<&str>,
) -> Result<Target> {
    let mut options = vec!["--rails", "1", "--pool", "8MiB"];
    if let Some(directory) = directory {
        options.extend(["--directory", directory]);
    }
    Target::start_with(
        &config.binary,
        &config.fabric,
        name,
        listen,
        generation,
        &options,
    )
}

fn write(slot: &RwLock<Slot>) -> std::sync::RwLockWriteGuard<'_, Slot> {
    slot.write().unwrap_or_else(PoisonError::into_inner)
}

/// The fault schedule: until `end`, one failure every 1–3 s.
fn inject(
    config: &SoakConfig,
    (engine, mut etcd): (&Engine, Option<&mut EtcdServer>),
    targets: &mut [Target],
    (slots, tally): (&[RwLock<Slot>], &Tally),
    rng: &mut SplitMix64,
    end: Instant,
    report: &mut SoakReport,
) -> Result<()> {
    let mut prober = Prober::new(engine)?;
    let mut detections = Vec::new();
    let directory = etcd.as_ref().map(|etcd| etcd.url());
    let kinds = if etcd.is_some() { 5 } else { 4 };
    while Instant::now() + Duration::from_secs(4) < end {
        std::thread::sleep(Duration::from_millis(1000 + rng.below(2000)));
        let index = rng.below(targets.len() as u64) as usize;
        match rng.below(kinds) {
            0 => {
                // Killed; a newcomer takes its port.
                let addr = targets[index].addr;
                targets[index].signal(libc::SIGKILL);
                let _ = targets[index].child.wait();
                let same_name = rng.below(2) == 0;
                let name = if same_name {
                    format!("soak-{index}")
                } else {
                    format!("soak-{index}-newcomer-{}", report.kills)
                };
                let generation = targets[index].generation.wrapping_add(1);
                let newcomer = start_target(config, &name, addr, generation, directory.as_deref())?;
                {
                    let mut slot = write(&slots[index]);
                    slot.name = name;
                    slot.pool_base = newcomer.pool_base;
                    slot.generation = generation;
                    slot.peer = None;
                    slot.stopped_at = None;
                    slot.resumed_from = None;
                }
                targets[index] = newcomer;
                report.kills += 1;
                report.same_name_takeovers += u64::from(same_name);
            }
            1 => {
                // Stopped without a reset, then let go. Timed (by a probe of its own, every
                // 20 ms) only when its peer was carrying traffic: a circuit open already
                // fails fast for another reason.
                let peer = {
                    let mut slot = write(&slots[index]);
                    slot.stopped_at = Some(Instant::now());
                    slot.peer
                        .clone()
                        .filter(|peer| !peer.is_unavailable())
                        .map(|peer| (peer, slot.pool_base))
                };
                targets[index].signal(libc::SIGSTOP);
                let stopped = Instant::now();
                let window = stopped + Duration::from_secs(3);
                if peer.is_none() {
                    // Its peer already fails fast (or there is none): the stop is known.
                    write(&slots[index]).stop_detected = true;
                }
                if let Some((peer, base)) = peer {
                    report.timed_stops += 1;
                    match prober.time_to_fail_fast(&peer, base, stopped, window) {
                        Some(ms) => {
                            detections.push(ms);
                            write(&slots[index]).stop_detected = true;
                        }
                        None => report.undetected_stops += 1,
                    }
                }
                std::thread::sleep(window.saturating_duration_since(Instant::now()));
                targets[index].signal(libc::SIGCONT);
                let mut slot = write(&slots[index]);
                slot.stopped_at = None;
                slot.stop_detected = false;
                slot.resumed_from = Some(Instant::now());
                drop(slot);
                report.stops += 1;
            }
            2 => {
                // Queue pairs fail now and then for a second.
                if let Some(faults) = engine.faults(0) {
                    faults.add(Fault::Random {
                        on: QpMatch::Any,
                        per_million: 50_000,
                        status: WcStatus::RetryExcErr,
                    });
                    std::thread::sleep(Duration::from_secs(1));
                    faults.clear();
                    report.qp_error_bursts += 1;
                }
            }
            3 => {
                // The target re-registers its pool: new keys, same memory. Whoever holds
                // the old ones is refused once, refreshes the descriptor and goes on.
                let target = &mut targets[index];
                target.pool_id = target.reregister(target.pool_id)?.id;
                report.descriptor_changes += 1;
            }
            _ => {
                if let Some(etcd) = etcd.as_deref_mut() {
                    etcd_outage(etcd, slots, tally, rng, report)?;
                }
            }
        }
    }
    std::thread::sleep(end.saturating_duration_since(Instant::now()));
    detections.sort_unstable();
    let at = |q: f64| {
        detections
            .get(((detections.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    report.detection_ms_p50 = at(0.5);
    report.detection_ms_p99 = at(0.99);
    report.detection_ms_max = detections.last().copied().unwrap_or(0);
    Ok(())
}

/// Stops etcd for 1–3 s and starts it again; counts, for the targets that were live when it
/// stopped, the requests done and those failed fast until it is back.
fn etcd_outage(
    etcd: &mut EtcdServer,
    slots: &[RwLock<Slot>],
    tally: &Tally,
    rng: &mut SplitMix64,
    report: &mut SoakReport,
) -> Result<()> {
    for (slot, counts) in slots.iter().zip(&tally.outage) {
        let live = slot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .peer
            .as_ref()
            .is_some_and(|peer| !peer.is_unavailable() && !peer.is_retired());
        counts.done.store(0, Ordering::Relaxed);
        counts.unavailable.store(0, Ordering::Relaxed);
        counts.watched.store(live, Ordering::Relaxed);
    }
    etcd.stop();
    std::thread::sleep(Duration::from_millis(1000 + rng.below(2000)));
    let restarted = etcd.run();
    // What follows etcd's return counts too: sessions re-claiming names, leases lapsing or
    // renewed, the watch replaying what changed.
    std::thread::sleep(Duration::from_secs(LEASE_TTL + 2));
    for counts in &tally.outage {
        if counts.watched.swap(false, Ordering::Relaxed) {
            report.unavailable_during_etcd_outage += counts.unavailable.load(Ordering::Relaxed);
            if counts.done.load(Ordering::Relaxed) == 0 {
                report.stalled_during_etcd_outage += 1;
            }
        }
    }
    report.etcd_restarts += 1;
    restarted
}

/// Where the soak's injector probes a stopped target: a block beyond the workers' slots.
const PROBE_OFFSET: u64 = WORKERS as u64 * SLOTS * BLOCK;

/// The injector's own writes to a stopped target, to time how soon it fails fast.
struct Prober {
    source: Region,
    submitter: railyard_engine::EngineSubmitter,
}

impl Prober {
    fn new(engine: &Engine) -> Result<Self> {
        Ok(Self {
            source: engine.alloc(BLOCK, None)?,
            submitter: engine.submitter()?,
        })
    }

    /// Writes to `peer` every 20 ms until a write fails with `PeerUnavailable` (returns the
    /// ms since `stopped`) or `until` passes (`None`). It waits for no write longer than
    /// that: one in flight at a stopped target may resolve only by its deadline (see
    /// [`ChaosFabric::writes_complete_at_stopped_targets`]), while those made after the
    /// stop was detected must fail at once.
    fn time_to_fail_fast(
        &mut self,
        peer: &Peer,
        base: u64,
        stopped: Instant,
        until: Instant,
    ) -> Option<u64> {
        let write = Transfer {
            op: Op::Write,
            local: self.source,
            local_offset: 0,
            remote_addr: base + PROBE_OFFSET,
            len: BLOCK,
        };
        while Instant::now() < until {
            if let Ok(batch) = self.submitter.submit(peer, &[write]) {
                batch.wait(Instant::now() + PROBE_INTERVAL);
                let failed_fast = batch.outcomes()
                    == vec![Some(RequestOutcome::Failed(FailReason::PeerUnavailable))];
                if failed_fast {
                    return Some(stopped.elapsed().as_millis() as u64);
                }
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
        None
    }
}

/// One worker: write a block to a target, read it back, compare; until told to stop.
fn work(
    engine: &Engine,
    slots: &[RwLock<Slot>],
    tally: &Tally,
    stop: &AtomicBool,
    (worker, by_name): (usize, bool),
    seed: u64,
) {
    let mut rng = SplitMix64::new(seed);
    let (Ok(source), Ok(back), Ok(mut submitter)) = (
        engine.alloc(BLOCK, None),
        engine.alloc(BLOCK, None),
        engine.submitter(),
    ) else {
        return;
    };
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let index = rng.below(slots.len() as u64) as usize;
        let Some((peer, remote, generation)) = peer_of(engine, &slots[index], tally, by_name)
        else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let tag =
            (index as u64) << 56 | u64::from(generation) << 48 | (worker as u64) << 40 | round;
        let slot = remote + (worker as u64 * SLOTS + round % SLOTS) * BLOCK;
        // SAFETY: `source` is this worker's own region; no transfer of it is in flight.
        fill(unsafe { region_bytes(source) }, tag);
        let write = Transfer {
            op: Op::Write,
            local: source,
            local_offset: 0,
            remote_addr: slot,
            len: BLOCK,
        };
        let Some(written) = transfer(&mut submitter, &peer, write, index, slots, tally) else {
            return; // lost: a violation; its buffers are not safe to reuse
        };
        if !written {
            // Told "unavailable" (or refused), an application routes elsewhere for a moment
            // instead of spinning on the same target.
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let read = Transfer {
            op: Op::Read,
            local: back,
            ..write
        };
        let read = transfer(&mut submitter, &peer, read, index, slots, tally);
        if read.is_none() {
            return; // lost, as above
        }
        if read == Some(true) {
            // SAFETY: both regions are this worker's own; no transfer of them is in flight.
            let same = unsafe { region_bytes(back) == region_bytes(source) };
            if same {
                tally.bytes_verified.fetch_add(BLOCK, Ordering::Relaxed);
            } else {
                count(&tally.mismatched_blocks);
            }
        }
    }
}

/// The shared peer of a target, opened (again, by name when `by_name`, else by address)
/// when there is none or it was retired.
fn peer_of(
    engine: &Engine,
    slot: &RwLock<Slot>,
    tally: &Tally,
    by_name: bool,
) -> Option<(Peer, u64, u8)> {
    let (target, after_stop) = {
        let slot = slot.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(peer) = slot.peer.as_ref().filter(|peer| !peer.is_retired()) {
            return Some((peer.clone(), slot.pool_base, slot.generation));
        }
        let target = if by_name {
            slot.name.clone()
        } else {
            slot.addr.to_string()
        };
        // Retired while (or after being) stopped: a stop is not a restart.
        let stopped = slot.stopped_at.is_some() || slot.resumed_from.is_some();
        (target, stopped && slot.peer.is_some())
    };
    let opened = engine.open(&target).ok()?;
    count(&tally.reopens);
    let mut slot = slot.write().unwrap_or_else(PoisonError::into_inner);
    if after_stop && slot.peer.as_ref().is_some_and(Peer::is_retired) {
        count(&tally.reopened_after_stop);
    }
    slot.peer = Some(opened.clone());
    Some((opened, slot.pool_base, slot.generation))
}

/// A request through `peer` was done: if its target was let go after a stop and this is
/// still the peer it had then, it is serving again.
fn resumed(slot: &RwLock<Slot>, peer: &Peer, tally: &Tally) {
    let since = {
        let slot = slot.read().unwrap_or_else(PoisonError::into_inner);
        match (slot.resumed_from, &slot.peer) {
            (Some(since), Some(current)) if current.incarnation() == peer.incarnation() => since,
            _ => return,
        }
    };
    let mut slot = slot.write().unwrap_or_else(PoisonError::into_inner);
    if slot.resumed_from.take().is_some() {
        tally
            .resumes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(since.elapsed().as_millis() as u64);
    }
}

fn slot_stopped(slot: &RwLock<Slot>) -> bool {
    slot.read()
        .unwrap_or_else(PoisonError::into_inner)
        .stopped_at
        .is_some()
}

/// Submits one transfer and waits for it: `Some(true)` done, `Some(false)` failed or
/// refused, `None` lost (unresolved past its deadline and the slack). Counts everything,
/// and a stopped target's first fast failure.
fn transfer(
    submitter: &mut railyard_engine::EngineSubmitter,
    peer: &Peer,
    transfer: Transfer,
    index: usize,
    slots: &[RwLock<Slot>],
    tally: &Tally,
) -> Option<bool> {
    let outage = tally
        .outage
        .get(index)
        .filter(|counts| counts.watched.load(Ordering::Relaxed));
    let stopped_at_submit = slot_stopped(&slots[index]);
    let detected_at_submit = slots[index]
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .stop_detected;
    let submitted = Instant::now();
    let Ok(batch) = submitter.submit(peer, &[transfer]) else {
        return Some(false);
    };
    count(&tally.requests);
    let bound = submitted + DEFAULT_DEADLINE + SLACK;
    let status = batch.wait(bound);
    if !status.is_complete() {
        count(&tally.lost);
        // The fabric may still read the source: the worker must not touch it again.
        return None;
    }
    if Instant::now() > bound {
        count(&tally.late);
    }
    match batch.outcomes().first().copied().flatten() {
        Some(RequestOutcome::Done) => {
            count(&tally.done);
            if let Some(outage) = outage {
                count(&outage.done);
            }
            resumed(&slots[index], peer, tally);
            Some(true)
        }
        Some(RequestOutcome::Failed(reason)) => {
            *tally
                .failures
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(reason.to_string())
                .or_default() += 1;
            if reason == FailReason::Timeout && detected_at_submit {
                count(&tally.timeouts_after_detection);
            } else if reason == FailReason::Timeout
                && (stopped_at_submit || slot_stopped(&slots[index]))
            {
                count(&tally.timeouts_while_stopped);
            }
            if let Some(outage) = outage.filter(|_| reason == FailReason::PeerUnavailable) {
                count(&outage.unavailable);
            }
            Some(false)
        }
        None => Some(false),
    }
}
