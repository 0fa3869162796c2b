//! `railyard chaos hicache`: DESIGN.md's seed 003 at the layer where it happened — a store
//! under an SGLang-HiCache-shaped load while its processes really die.
//!
//! An etcd, two masters (`railyard master --etcd`: a leader and a standby), four segment
//! processes (`railyard store serve`, 128 MiB each) and two client processes
//! ([`run_client`]: `batch_put_from` with two replicas, `batch_exists`, `batch_get_into` of
//! 64 KiB – 1 MiB values derived from their keys). Then, in a seeded order of victims, for
//! as long as asked (at least one round):
//!
//! 1. **SIGKILL of a segment process**, and a newcomer under its name on its port;
//! 2. **SIGSTOP of another** (no reset), let go after [`STOPPED_FOR`];
//! 3. **a burst of transfer errors** on one client's rail for [`BURST`];
//! 4. **SIGKILL of the leading master** (a new standby is started);
//! 5. **SIGSTOP of the leading master** until a standby leads, then SIGCONT: the deposed
//!    leader must not act (it exits; if it still answers, a mount is tried through it).
//!
//! What it judges, from every call the clients report (see [`HicacheReport`]): no wrong
//! byte; no get (or exists) failed while one of the key's replica holders was alive and
//! running throughout the call; the p99 of get batches started during each segment fault
//! ≤ [`P99_BOUND`]; the live part's throughput ≥ [`THROUGHPUT_BOUND`] of the window before
//! the fault (from the detection bound on: until then a call waiting on the stopped holder
//! is bounded by the p99); the cluster serving puts and gets again ≤ [`SERVE_AGAIN_BOUND`]
//! after the leader's SIGKILL; no deposed master acting; and after the run, once the
//! clients removed every key they tried, no write in progress, no object and no byte
//! reserved.

mod cluster;
mod workload;

pub use workload::run_client;

use std::collections::BTreeMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use railyard_engine::dataplane::IdleStrategy;
use railyard_engine::dataplane::rng::SplitMix64;
use railyard_engine::{ClusterSecret, Engine, FabricChoice, RailChoice};
use railyard_store::failover::StoreEtcd;
use railyard_store::{Store, StoreOptions};
use serde::Serialize;

use crate::etcd_server::EtcdServer;
use cluster::Proc;
use workload::{Event, Holder, now_ms};

/// Segment processes.
pub const SEGMENTS: usize = 4;
/// Client processes.
pub const CLIENTS: usize = 2;
/// Each segment's memory.
const SEGMENT_SIZE: &str = "128MiB";
/// The leader's etcd lease (seconds): a killed leader is replaced within it.
const LEASE_TTL: u64 = 2;
/// How long a stopped segment process stays stopped.
pub const STOPPED_FOR: Duration = Duration::from_millis(5500);
/// How long a burst of transfer errors lasts.
pub const BURST: Duration = Duration::from_secs(1);
/// How long before a fault the baseline throughput is measured, and how long the fault's
/// own window lasts after the detection bound.
const WINDOW: Duration = Duration::from_secs(4);
/// The engine's bound on noticing a stopped peer: a call waiting on one is bounded by the
/// p99 bound, not by the throughput bound, until then.
const DETECTION: Duration = Duration::from_millis(1500);
/// A process let go after a stop is not counted as a live holder for this long: its peers'
/// circuits and the master's suspicion of it take a moment to close again.
const RESUME_MARGIN: Duration = Duration::from_secs(3);
/// The p99 of get batches started during a segment fault.
pub const P99_BOUND: Duration = Duration::from_secs(2);
/// The live part's throughput during a segment fault, as a share of the window before.
pub const THROUGHPUT_BOUND: f64 = 0.8;
/// Until both puts and gets succeed again after the leading master's SIGKILL.
pub const SERVE_AGAIN_BOUND: Duration = Duration::from_secs(3);
/// The longest a master's replacement excuses failed gets (ms): one that never ends is a
/// violation of its own (`serve_again_ms`).
const OUTAGE_CAP: u64 = 10_000;
/// How long the run's end may take to settle (leases end, fences finish).
const SETTLE: Duration = Duration::from_secs(15);

/// What to run.
#[derive(Clone, Debug)]
pub struct HicacheConfig {
    /// The `railyard` binary whose `master` and `store` the scenario runs.
    pub binary: PathBuf,
    /// Seeds the victims and the clients' choices.
    pub seed: u64,
    /// How long to go on with rounds of faults (at least one round runs).
    pub duration: Duration,
}

/// One segment fault, measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FaultMeasure {
    /// kill, stop or burst.
    pub fault: &'static str,
    /// The victim: a segment name or a client name.
    pub victim: String,
    /// p99 of get batches in flight during the fault's window, in milliseconds.
    pub p99_get_ms: u64,
    /// Get batches it covers.
    pub gets: u64,
    /// Bytes per second moved in the fault's window over the window before.
    pub live_throughput_ratio: f64,
}

/// What happened, and what must hold.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HicacheReport {
    /// Rounds of the five faults.
    pub rounds: u64,
    /// Segment processes killed (each replaced by a newcomer under its name and port).
    pub segment_kills: u64,
    /// Segment processes stopped and let go.
    pub segment_stops: u64,
    /// Bursts of transfer errors.
    pub error_bursts: u64,
    /// Leading masters killed.
    pub master_kills: u64,
    /// Leading masters stopped until deposed.
    pub master_stops: u64,
    /// Keys written.
    pub puts_ok: u64,
    /// Keys written with one replica of two: best effort, when one segment took it.
    pub puts_with_one_replica: u64,
    /// Keys whose write failed (a clear error each; the failure itself is no violation).
    pub puts_failed: u64,
    /// Failed writes by the error's kind.
    pub put_errors: BTreeMap<String, u64>,
    /// Keys read and checked.
    pub gets_ok: u64,
    /// Keys whose read failed (judged below).
    pub gets_failed: u64,
    /// Bytes read back checked against their keys.
    pub bytes_checked: u64,
    /// Bytes read that differ from what was written. Must be 0.
    pub wrong_bytes: u64,
    /// Gets that failed although a holder of one of the key's replicas was alive and
    /// running throughout the call. Must be 0.
    pub gets_failed_with_live_replica: u64,
    /// `exists` that answered absent (or failed) in the same case. Must be 0.
    pub exists_wrong_with_live_replica: u64,
    /// Failed reads by the error's kind.
    pub get_errors: BTreeMap<String, u64>,
    /// Gets that failed with every holder of the key's replicas dead or stopped (allowed:
    /// the answer is `NotFound`, not a transfer failure after 60 s).
    pub gets_failed_holders_down: u64,
    /// Gets that failed while the master was being replaced (not counted above: no master,
    /// no lease).
    pub gets_failed_during_failover: u64,
    /// The first get counted in `gets_failed_with_live_replica`, for whoever debugs it.
    pub first_wrong_failure: Option<String>,
    /// Each segment fault.
    pub faults: Vec<FaultMeasure>,
    /// The worst p99 of them, in milliseconds (≤ 2000).
    pub worst_p99_get_ms: u64,
    /// The lowest throughput ratio of them (≥ 0.8).
    pub worst_live_throughput_ratio: f64,
    /// After each SIGKILL of the leader: until puts and gets succeed again (ms, ≤ 3000).
    pub serve_again_ms: Vec<u64>,
    /// Masters that stepped down and exited without being killed or stopped (a leader whose
    /// lease renewals did not come back in time: the machine was too busy).
    pub masters_stepped_down: u64,
    /// After each SIGSTOP of the leader: until puts and gets succeed again (ms; no bound
    /// but that they do: a stopped leader is noticed only by its lease).
    pub serve_again_after_stop_ms: Vec<u64>,
    /// Deposed leaders that took a change after they were let go. Must be 0.
    pub deposed_master_acted: u64,
    /// After the run, once every key was removed: writes still in progress. Must be 0.
    pub stuck_puts: u64,
    /// Objects left. Must be 0.
    pub objects_left: u64,
    /// Bytes still reserved in segments. Must be 0.
    pub leaked_bytes: u64,
    /// Removals at the end that failed. Must be 0.
    pub removes_failed: u64,
}

impl HicacheReport {
    /// The promises broken, in words; empty when every one held.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        let mut check = |held: bool, what: String| {
            if !held {
                broken.push(what);
            }
        };
        check(
            self.wrong_bytes == 0,
            format!("{} wrong bytes read", self.wrong_bytes),
        );
        check(
            self.gets_failed_with_live_replica == 0,
            format!(
                "{} gets failed while a replica's holder was alive ({})",
                self.gets_failed_with_live_replica,
                self.first_wrong_failure.as_deref().unwrap_or("")
            ),
        );
        check(
            self.exists_wrong_with_live_replica == 0,
            format!(
                "{} exists answered absent while a replica's holder was alive",
                self.exists_wrong_with_live_replica
            ),
        );
        for fault in &self.faults {
            check(
                fault.p99_get_ms <= P99_BOUND.as_millis() as u64,
                format!(
                    "p99 get {} ms during the {} of {} (bound {} ms)",
                    fault.p99_get_ms,
                    fault.fault,
                    fault.victim,
                    P99_BOUND.as_millis()
                ),
            );
            check(
                fault.live_throughput_ratio >= THROUGHPUT_BOUND,
                format!(
                    "live throughput {:.2} of before during the {} of {} (bound {THROUGHPUT_BOUND})",
                    fault.live_throughput_ratio, fault.fault, fault.victim
                ),
            );
        }
        for &ms in &self.serve_again_ms {
            check(
                ms <= SERVE_AGAIN_BOUND.as_millis() as u64,
                format!(
                    "served again {ms} ms after the leader's SIGKILL (bound {} ms)",
                    SERVE_AGAIN_BOUND.as_millis()
                ),
            );
        }
        for &ms in &self.serve_again_after_stop_ms {
            check(
                ms < u64::MAX / 2,
                "never served again after the leader's SIGSTOP".to_owned(),
            );
        }
        check(
            self.deposed_master_acted == 0,
            format!("{} deposed masters acted", self.deposed_master_acted),
        );
        check(
            self.stuck_puts == 0,
            format!("{} puts stuck", self.stuck_puts),
        );
        check(
            self.objects_left == 0,
            format!("{} objects left", self.objects_left),
        );
        check(
            self.leaked_bytes == 0,
            format!("{} bytes leaked", self.leaked_bytes),
        );
        check(
            self.removes_failed == 0,
            format!("{} removals failed", self.removes_failed),
        );
        broken
    }
}

/// One incarnation of a segment process, as the judge sees it.
#[derive(Clone, Debug)]
struct Life {
    addr: String,
    incarnation: u64,
    started: u64,
    killed: Option<u64>,
    /// Stopped from, let go at.
    stops: Vec<(u64, Option<u64>)>,
}

impl Life {
    /// Alive and running from `start` to `end`, and not recently let go.
    fn live_through(&self, start: u64, end: u64) -> bool {
        let margin = RESUME_MARGIN.as_millis() as u64;
        self.started <= start
            && self.killed.is_none_or(|killed| killed > end)
            && self.stops.iter().all(|&(stopped, resumed)| {
                stopped > end || resumed.is_some_and(|resumed| resumed + margin < start)
            })
    }
}

/// A segment slot: its name and port stay, its process changes.
struct Slot {
    name: String,
    port: u16,
    proc: Proc,
    life: usize,
}

/// A client process and what it reported.
struct ClientProc {
    name: String,
    proc: Proc,
    events: Arc<Mutex<Vec<Event>>>,
}

/// A fault's moment, for the judge.
enum Moment {
    Segment {
        fault: &'static str,
        victim: String,
        at: u64,
    },
    MasterKill {
        at: u64,
    },
    MasterStop {
        from: u64,
        to: u64,
    },
}

/// Runs the scenario.
///
/// # Errors
/// When a process cannot be started or the cluster never forms (not a broken promise:
/// those are in the report).
pub fn run(config: &HicacheConfig) -> Result<HicacheReport> {
    let binary = config.binary.as_path();
    let secret = SecretFile::new()?;
    let cluster_secret = ClusterSecret::from_file(&secret)?;
    let etcd = EtcdServer::start(LEASE_TTL).context("starting etcd (install etcd-server)")?;
    let url = etcd.url();
    let election = StoreEtcd::from_url(&url).map_err(anyhow::Error::msg)?;
    let mut rng = SplitMix64::new(config.seed);
    let mut report = HicacheReport::default();

    let mut masters = vec![cluster::master(binary, &secret, &url)?];
    leader_of(&election, None)?;
    masters.push(cluster::master(binary, &secret, &url)?);

    let mut lives: Vec<Life> = Vec::new();
    let mut slots = Vec::new();
    for index in 0..SEGMENTS {
        let name = format!("hicache-segment-{index}");
        let port = free_port()?;
        let proc = cluster::segment(binary, &secret, &url, &name, port, SEGMENT_SIZE)?;
        lives.push(life_of(&proc)?);
        slots.push(Slot {
            name,
            port,
            proc,
            life: lives.len() - 1,
        });
    }
    let mut clients = Vec::new();
    for index in 0..CLIENTS {
        let name = format!("hicache-client-{index}");
        let mut proc = cluster::client(binary, &secret, &url, &name, rng.next_u64())?;
        let events = Arc::new(Mutex::new(Vec::new()));
        collect(&mut proc, Arc::clone(&events));
        clients.push(ClientProc { name, proc, events });
    }
    // The judge's own client, for the deposed leader's probe and the count at the end.
    let engine = Engine::builder("hicache-judge")
        .secret(cluster_secret.clone())
        .listen("127.0.0.1:0".parse()?)
        .fabric(FabricChoice::Tcp)
        .rails(RailChoice::Count(std::num::NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()?;

    let mut moments = Vec::new();
    let started = Instant::now();
    std::thread::sleep(WINDOW);
    loop {
        report.rounds += 1;
        // 1. A segment process killed; a newcomer under its name on its port.
        let killed = (rng.next_u64() % SEGMENTS as u64) as usize;
        let slot = &mut slots[killed];
        let at = now_ms();
        slot.proc.kill();
        lives[slot.life].killed = Some(at);
        slot.proc = cluster::segment(binary, &secret, &url, &slot.name, slot.port, SEGMENT_SIZE)?;
        lives.push(life_of(&slot.proc)?);
        slot.life = lives.len() - 1;
        report.segment_kills += 1;
        moments.push(Moment::Segment {
            fault: "kill",
            victim: slot.name.clone(),
            at,
        });
        std::thread::sleep(DETECTION + WINDOW + Duration::from_millis(500));

        // 2. Another one stopped (no reset), then let go.
        let stopped = (killed + 1 + (rng.next_u64() % (SEGMENTS as u64 - 1)) as usize) % SEGMENTS;
        let slot = &slots[stopped];
        let at = now_ms();
        slot.proc.signal(libc::SIGSTOP);
        lives[slot.life].stops.push((at, None));
        moments.push(Moment::Segment {
            fault: "stop",
            victim: slot.name.clone(),
            at,
        });
        std::thread::sleep(STOPPED_FOR);
        slot.proc.signal(libc::SIGCONT);
        if let Some(stop) = lives[slot.life].stops.last_mut() {
            stop.1 = Some(now_ms());
        }
        report.segment_stops += 1;
        std::thread::sleep(RESUME_MARGIN + WINDOW);

        // 3. A burst of transfer errors on one client's rail.
        let client = &mut clients[(rng.next_u64() % CLIENTS as u64) as usize];
        let at = now_ms();
        client
            .proc
            .command(&format!("burst {}", BURST.as_millis()))?;
        report.error_bursts += 1;
        moments.push(Moment::Segment {
            fault: "burst",
            victim: client.name.clone(),
            at,
        });
        std::thread::sleep(DETECTION + WINDOW + Duration::from_millis(500));

        // 4. The leading master killed; a new standby.
        replace_exited(binary, &secret, &url, &mut masters, &mut report)?;
        let leading = leader_of(&election, None)?;
        let at = now_ms();
        kill_master(&mut masters, &leading)?;
        report.master_kills += 1;
        moments.push(Moment::MasterKill { at });
        leader_of(&election, Some(&leading)).context("after the leader's SIGKILL")?;
        masters.push(cluster::master(binary, &secret, &url)?);
        std::thread::sleep(WINDOW);

        // 5. The leading master stopped until deposed, then let go: it must not act.
        replace_exited(binary, &secret, &url, &mut masters, &mut report)?;
        let leading = leader_of(&election, None)?;
        let index = master_at(&masters, &leading)?;
        let from = now_ms();
        masters[index].signal(libc::SIGSTOP);
        leader_of(&election, Some(&leading)).context("after the leader's SIGSTOP")?;
        masters[index].signal(libc::SIGCONT);
        let to = now_ms();
        report.master_stops += 1;
        moments.push(Moment::MasterStop { from, to });
        let mut deposed = masters.remove(index);
        if deposed_acts(&engine, &cluster_secret, &mut deposed, &leading) {
            report.deposed_master_acted += 1;
        }
        deposed.kill();
        masters.push(cluster::master(binary, &secret, &url)?);
        std::thread::sleep(WINDOW);

        if started.elapsed() >= config.duration {
            break;
        }
    }

    // The end: clients remove every key they tried and say so.
    for client in &mut clients {
        client.proc.command("stop")?;
    }
    let bound = Instant::now() + Duration::from_secs(30);
    for client in &mut clients {
        while !done(&client.events) && Instant::now() < bound {
            std::thread::sleep(Duration::from_millis(20));
        }
        client.proc.finish(Duration::from_secs(5));
    }
    let events: Vec<(String, Vec<Event>)> = clients
        .iter()
        .map(|client| {
            let events = client.events.lock().unwrap_or_else(PoisonError::into_inner);
            (client.name.clone(), events.clone())
        })
        .collect();
    judge(&events, &lives, &moments, &mut report);
    settle(&engine, &cluster_secret, &url, &mut report)?;
    drop(clients);
    drop(slots);
    drop(masters);
    Ok(report)
}

/// A fresh cluster secret in a file only this user reads, removed when dropped: the
/// scenario's processes prove it to each other, as a deployment's would.
struct SecretFile(PathBuf);

impl SecretFile {
    fn new() -> Result<Self> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let secret: String = (0..4)
            .map(|_| format!("{:016x}", railyard_engine::dataplane::entropy::random_u64()))
            .collect();
        let path = std::env::temp_dir().join(format!(
            "railyard-hicache-{}-{:08x}.secret",
            std::process::id(),
            railyard_engine::dataplane::entropy::random_u64() as u32
        ));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("writing the cluster secret to {}", path.display()))?;
        file.write_all(secret.as_bytes())?;
        Ok(Self(path))
    }
}

impl Deref for SecretFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether a client said it is done.
fn done(events: &Mutex<Vec<Event>>) -> bool {
    events
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .any(|event| matches!(event, Event::Done { .. }))
}

/// Collects `proc`'s events on a thread of its own.
fn collect(proc: &mut Proc, events: Arc<Mutex<Vec<Event>>>) {
    let lines = std::mem::replace(&mut proc.lines, std::sync::mpsc::channel().1);
    std::thread::spawn(move || {
        while let Ok(line) = lines.recv() {
            if let Ok(event) = serde_json::from_str::<Event>(&line) {
                events
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(event);
            }
        }
    });
}

/// A segment process's incarnation, from its first line
/// (`listening ADDR incarnation HEX segment ID SIZE`).
fn life_of(proc: &Proc) -> Result<Life> {
    let addr = proc.listening()?.to_owned();
    let incarnation = match proc.first.get(2..4) {
        Some([word, hex]) if word == "incarnation" => u64::from_str_radix(hex, 16)?,
        _ => bail!("no incarnation in {:?}", proc.first),
    };
    Ok(Life {
        addr,
        incarnation,
        started: now_ms(),
        killed: None,
        stops: Vec::new(),
    })
}

/// A port free now on loopback.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The leader's address once etcd names one (other than `not`), within a bound.
fn leader_of(election: &StoreEtcd, not: Option<&str>) -> Result<String> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(Some(addr)) = election.find_leader()
            && Some(addr.as_str()) != not
        {
            return Ok(addr);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("no master leads (other than {not:?}) within 20 s")
}

/// Replaces masters that exited by themselves (a leader whose lease lapsed steps down and
/// exits), so that each master fault finds a leader and a standby.
fn replace_exited(
    binary: &Path,
    secret: &Path,
    url: &str,
    masters: &mut Vec<Proc>,
    report: &mut HicacheReport,
) -> Result<()> {
    let before = masters.len();
    masters.retain_mut(|master| !master.exited());
    report.masters_stepped_down += (before - masters.len()) as u64;
    while masters.len() < 2 {
        masters.push(cluster::master(binary, secret, url)?);
    }
    Ok(())
}

/// The index of the master listening at `addr`.
fn master_at(masters: &[Proc], addr: &str) -> Result<usize> {
    masters
        .iter()
        .position(|master| master.listening().is_ok_and(|own| own == addr))
        .with_context(|| format!("no master of ours listens at {addr}"))
}

/// SIGKILLs the master listening at `addr`.
fn kill_master(masters: &mut Vec<Proc>, addr: &str) -> Result<()> {
    let index = master_at(masters, addr)?;
    masters.remove(index).kill();
    Ok(())
}

/// Whether the deposed leader at `addr`, let go, still takes a change: it should exit
/// (within a bound); if it still answers, a mount through it must be refused.
fn deposed_acts(engine: &Engine, secret: &ClusterSecret, deposed: &mut Proc, addr: &str) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        if deposed.exited() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let Ok(store) = Store::connect(
        engine,
        StoreOptions {
            secret: Some(secret.clone()),
            timeout: Duration::from_secs(2),
            staging: 1 << 20,
            ..StoreOptions::new(addr)
        },
    ) else {
        return false;
    };
    store.mount(1 << 20).is_ok()
}

/// Judges the clients' calls against the processes' lives and the faults' moments.
fn judge(
    events: &[(String, Vec<Event>)],
    lives: &[Life],
    moments: &[Moment],
    report: &mut HicacheReport,
) {
    let live = |holders: &[Holder], start: u64, end: u64| {
        holders.iter().any(|holder| {
            lives.iter().any(|life| {
                life.addr == holder.addr
                    && life.incarnation == holder.incarnation
                    && life.live_through(start, end)
            })
        })
    };
    // Master outages: from a kill until a put and a get succeeded again, or a stop's span.
    let mut outages: Vec<(u64, u64)> = Vec::new();
    for moment in moments {
        match *moment {
            Moment::MasterKill { at } => {
                let back = serve_again(events, at);
                report.serve_again_ms.push(back.saturating_sub(at));
                outages.push((at, back.min(at + OUTAGE_CAP)));
            }
            Moment::MasterStop { from, to } => {
                let back = serve_again(events, from);
                report
                    .serve_again_after_stop_ms
                    .push(back.saturating_sub(from));
                outages.push((from, back.min(from + OUTAGE_CAP).max(to)));
            }
            Moment::Segment { .. } => {}
        }
    }
    let in_outage =
        |start: u64, end: u64| outages.iter().any(|&(from, to)| start <= to && end >= from);
    for (client, calls) in events {
        for event in calls {
            match event {
                Event::Put {
                    ok,
                    failed,
                    fewer,
                    errors,
                    ..
                } => {
                    report.puts_ok += u64::from(*ok);
                    report.puts_with_one_replica += u64::from(*fewer);
                    report.puts_failed += u64::from(*failed);
                    for kind in errors {
                        *report.put_errors.entry(kind.clone()).or_default() += 1;
                    }
                }
                Event::Get {
                    start,
                    end,
                    ok,
                    bytes,
                    wrong_bytes,
                    failures,
                } => {
                    report.gets_ok += u64::from(*ok);
                    report.gets_failed += failures.len() as u64;
                    report.bytes_checked += bytes;
                    report.wrong_bytes += wrong_bytes;
                    for failure in failures {
                        *report.get_errors.entry(failure.kind.clone()).or_default() += 1;
                        if !live(&failure.holders, *start, *end) {
                            report.gets_failed_holders_down += 1;
                            continue;
                        }
                        if in_outage(*start, *end) {
                            report.gets_failed_during_failover += 1;
                            continue;
                        }
                        report.gets_failed_with_live_replica += 1;
                        if report.first_wrong_failure.is_none() {
                            report.first_wrong_failure = Some(format!(
                                "{client}: {} at {start}..{end} ms: {}; holders {:?}",
                                failure.key, failure.error, failure.holders
                            ));
                        }
                    }
                }
                Event::Exists { start, end, absent } => {
                    report.exists_wrong_with_live_replica += absent
                        .iter()
                        .filter(|failure| {
                            live(&failure.holders, *start, *end) && !in_outage(*start, *end)
                        })
                        .count()
                        as u64;
                }
                Event::Done { remove_failed, .. } => report.removes_failed += remove_failed,
                Event::Ready { .. } | Event::Burst { .. } => {}
            }
        }
    }
    for moment in moments {
        let Moment::Segment { fault, victim, at } = moment else {
            continue;
        };
        let at = *at;
        let window = WINDOW.as_millis() as u64;
        let detection = DETECTION.as_millis() as u64;
        let mut latencies: Vec<u64> = events
            .iter()
            .flat_map(|(_, calls)| calls)
            .filter_map(|event| match event {
                // In flight during the fault's window (one that started just before it and
                // waited on the victim counts).
                Event::Get { start, end, .. } if *end > at && *start < at + detection + window => {
                    Some(end - start)
                }
                _ => None,
            })
            .collect();
        latencies.sort_unstable();
        let p99 = latencies
            .get(((latencies.len() as f64 - 1.0) * 0.99).round() as usize)
            .copied()
            .unwrap_or(0);
        let before = moved(events, at.saturating_sub(window), at);
        let during = moved(events, at + detection, at + detection + window);
        report.faults.push(FaultMeasure {
            fault,
            victim: victim.clone(),
            p99_get_ms: p99,
            gets: latencies.len() as u64,
            live_throughput_ratio: if before == 0 {
                0.0
            } else {
                (during as f64 / before as f64 * 100.0).round() / 100.0
            },
        });
    }
    report.worst_p99_get_ms = report
        .faults
        .iter()
        .map(|f| f.p99_get_ms)
        .max()
        .unwrap_or(0);
    report.worst_live_throughput_ratio = report
        .faults
        .iter()
        .map(|f| f.live_throughput_ratio)
        .fold(f64::INFINITY, f64::min);
    if report.faults.is_empty() {
        report.worst_live_throughput_ratio = 0.0;
    }
}

/// Bytes written and read by calls that ended within `from..to`.
fn moved(events: &[(String, Vec<Event>)], from: u64, to: u64) -> u64 {
    events
        .iter()
        .flat_map(|(_, calls)| calls)
        .map(|event| match event {
            Event::Put { end, bytes, .. } | Event::Get { end, bytes, .. }
                if *end >= from && *end < to =>
            {
                *bytes
            }
            _ => 0,
        })
        .sum()
}

/// When every client had a put and a get that started at or after `at` succeed (the
/// later of them); `u64::MAX` if one never did.
fn serve_again(events: &[(String, Vec<Event>)], at: u64) -> u64 {
    events
        .iter()
        .map(|(_, calls)| {
            let first = |put: bool| {
                calls.iter().find_map(|event| match event {
                    Event::Put { start, end, ok, .. } if put && *start >= at && *ok > 0 => {
                        Some(*end)
                    }
                    Event::Get { start, end, ok, .. } if !put && *start >= at && *ok > 0 => {
                        Some(*end)
                    }
                    _ => None,
                })
            };
            first(true)
                .zip(first(false))
                .map_or(u64::MAX, |(put, get)| put.max(get))
        })
        .max()
        .unwrap_or(u64::MAX)
}

/// After the clients removed everything: waits (bounded) for the master to hold no write,
/// no object and no reserved byte, and reports what is left.
fn settle(
    engine: &Engine,
    secret: &ClusterSecret,
    url: &str,
    report: &mut HicacheReport,
) -> Result<()> {
    let store = Store::connect(
        engine,
        StoreOptions {
            secret: Some(secret.clone()),
            staging: 1 << 20,
            ..StoreOptions::new(url)
        },
    )
    .context("the judge connecting to the store")?;
    let start = Instant::now();
    loop {
        let stats = store.master_stats().context("the master's stats")?;
        report.stuck_puts = stats.writes;
        report.objects_left = stats.objects;
        report.leaked_bytes = stats.segments.iter().map(|segment| segment.reserved).sum();
        let clean = report.stuck_puts == 0 && report.objects_left == 0 && report.leaked_bytes == 0;
        if clean || start.elapsed() > SETTLE {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
