//! The driver of `railyard chaos hicache`: starts the cluster (etcd, masters, segment and
//! client processes sharing a fresh secret), injects the round of faults, stops the
//! clients, hands their calls to the judge and counts what the master still holds.

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

use super::cluster::{self, Proc};
use super::judge::{DETECTION, Life, Moment, RESUME_MARGIN, WINDOW, judge};
use super::report::{HicacheConfig, HicacheReport};
use super::workload::{Event, now_ms};
use crate::etcd_server::EtcdServer;

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

/// How long the run's end may take to settle (leases end, fences finish).
const SETTLE: Duration = Duration::from_secs(15);

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
    let mut report = HicacheReport {
        clients: CLIENTS as u64,
        ..HicacheReport::default()
    };

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
        let round_began = at;
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
            round_began,
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
            round_began,
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
            round_began,
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
