//! `handshake-churn`: repeated handshakes from an unchanged peer change nothing, and two
//! peer processes on one host are two peers.
//!
//! The target is a `railyard serve` process. A raw peer (this module speaking the wire
//! format with its own rail of the scenario's fabric) connects a queue pair to it, then
//! repeats the very same
//! Hello and ConnectQp — same incarnation, same queue pair — on a new TCP connection each
//! time, as a peer whose connections keep dropping would. Each answer must be the target's same queue pair.
//! Meanwhile two initiator nodes on this host (two incarnations, two ports) connect to the
//! target and write, and ask again for their endpoints. Elsewhere each repeat was a
//! reconnect (address-vector churn, warning floods), and peers keyed by `host@nic` overwrote
//! each other.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use railyard_engine::control::wire::{FrameDecoder, Message, QpSide, WireKey};
use railyard_engine::control::{HostId, Incarnation, PeerLink, Policy, RailFabric};
use railyard_engine::dataplane::fabric::ofi::{OfiConfig, OfiRail};
use railyard_engine::dataplane::fabric::soft::{SoftConfig, SoftDevice};
use railyard_engine::dataplane::{RequestOutcome, Submitter};
use serde::Serialize;

use super::fabric::ChaosFabric;
use super::harness::{BOUND, any_port, write_slice};
use super::node::Node;
use super::pattern::digest;
use super::process::Target;

/// What happened.
#[derive(Debug, Serialize)]
pub struct ChurnReport {
    /// The seed.
    pub seed: u64,
    /// Handshakes the raw peer repeated.
    pub repeated_handshakes: u64,
    /// Passive queue pairs torn down or replaced, and endpoints retired, on every node.
    pub teardowns: u64,
    /// Queue pairs created after an endpoint's first, on every node.
    pub reconnects: u64,
    /// Passive queue pairs the target made (one per peer).
    pub passive_qps: u64,
    /// Repeats the target answered without change.
    pub idempotent_replies: u64,
    /// Repeats answered with a different queue pair than the first answer.
    pub changed_answers: u64,
    /// Warnings emitted by every node.
    pub warnings: u64,
    /// Whether both initiators on this host got distinct endpoints and their bytes arrived.
    pub peers_distinct: bool,
    /// Two initiator *processes* with one name (`railyard bench --name`) writing to one
    /// target process at once: requests that failed, summed over both.
    pub twin_failed_requests: u64,
    /// Their reconnects and teardowns, summed (each would be the other tearing it down).
    pub twin_reconnects: u64,
    /// See [`Self::twin_reconnects`].
    pub twin_teardowns: u64,
    /// Whether both twins ran, moved bytes and reported.
    pub twins_ran: bool,
}

/// Warnings the scenario tolerates.
pub const WARNING_BOUND: u64 = 10;

impl ChurnReport {
    /// Broken promises, empty when the run held.
    pub fn violations(&self) -> Vec<String> {
        let mut broken = Vec::new();
        if self.teardowns != 0 {
            broken.push(format!("teardowns = {} (must be 0)", self.teardowns));
        }
        if self.reconnects != 0 {
            broken.push(format!("reconnects = {} (must be 0)", self.reconnects));
        }
        if self.changed_answers != 0 {
            broken.push(format!(
                "{} repeated handshakes were answered with another queue pair",
                self.changed_answers
            ));
        }
        if self.idempotent_replies + 1 < self.repeated_handshakes {
            broken.push(format!(
                "only {} of {} repeats were answered idempotently",
                self.idempotent_replies, self.repeated_handshakes
            ));
        }
        if self.warnings > WARNING_BOUND {
            broken.push(format!(
                "warnings = {} (bound {WARNING_BOUND})",
                self.warnings
            ));
        }
        if !self.peers_distinct {
            broken.push("two peers on one host were not two endpoints".into());
        }
        if !self.twins_ran {
            broken.push("the two same-named initiator processes did not both run".into());
        }
        if self.twin_failed_requests + self.twin_reconnects + self.twin_teardowns != 0 {
            broken.push(format!(
                "two initiator processes named alike disturbed each other: {} failed, {} \
                 reconnects, {} teardowns",
                self.twin_failed_requests, self.twin_reconnects, self.twin_teardowns
            ));
        }
        broken
    }
}

/// One Hello + ConnectQp exchange on a fresh connection (closed with Bye after the reply),
/// as a raw peer speaks it; returns the target's side.
///
/// # Errors
/// When the target cannot be reached, closes early, sends garbage or refuses.
pub fn handshake_once(
    addr: SocketAddr,
    name: &str,
    incarnation: Incarnation,
    key: WireKey,
    side: &QpSide,
) -> Result<QpSide> {
    let mut stream = TcpStream::connect_timeout(&addr, BOUND)?;
    stream.set_read_timeout(Some(BOUND))?;
    stream.set_nodelay(true)?;
    let mut frames = Message::Hello {
        name: name.into(),
        incarnation,
        host: HostId::this_process(),
        listen: String::new(),
        nonce: [0; railyard_engine::control::wire::NONCE_LEN],
        encrypt: false,
    }
    .encode();
    frames.extend(
        Message::ConnectQp {
            key,
            epoch: 1,
            handshake: 1,
            side: side.clone(),
        }
        .encode(),
    );
    stream.write_all(&frames)?;
    let mut decoder = FrameDecoder::default();
    let mut buffer = [0u8; 4096];
    loop {
        while let Some(message) = decoder.next_message()? {
            if let Message::ConnectQpReply { result, .. } = message {
                let _ = stream.write_all(&Message::Bye.encode());
                return result.map_err(|reason| anyhow::anyhow!("refused: {reason}"));
            }
        }
        let n = stream.read(&mut buffer)?;
        if n == 0 {
            bail!("the target closed the connection before answering");
        }
        decoder.push(&buffer[..n])?;
    }
}

/// Connects one queue pair of `rail` to `target` as incarnation `incarnation`, then repeats
/// the very same handshake until there were `repeated`; returns the queue pair and how many
/// answers differed from the first.
fn repeat_handshakes<R: RailFabric>(
    target: &Target,
    rail: &R,
    incarnation: Incarnation,
    repeated: u64,
) -> Result<(R::Connected, u64)> {
    let link = PeerLink {
        same_host: true,
        local_ip: target.addr.ip(),
    };
    let (qp, side) = rail.create_qp(&link).map_err(anyhow::Error::msg)?;
    let key = WireKey {
        initiator: incarnation,
        target: target.incarnation,
        initiator_rail: 0,
        target_rail: 0,
    };
    let first = handshake_once(target.addr, "raw-peer", incarnation, key, &side)
        .context("the raw peer's first handshake")?;
    let qp = rail.connect_qp(qp, &first).map_err(anyhow::Error::msg)?;
    let mut changed = 0;
    for _ in 1..repeated {
        let answer = handshake_once(target.addr, "raw-peer", incarnation, key, &side)?;
        if answer != first {
            changed += 1;
        }
    }
    Ok((qp, changed))
}

/// Runs the scenario.
///
/// # Errors
/// When the nodes cannot start or connect.
pub fn run(seed: u64, binary: &std::path::Path, fabric: &ChaosFabric) -> Result<ChurnReport> {
    let options = ["--rails", "1", "--pool", "1MiB"];
    let mut target = Target::start_with(binary, fabric, "decode-0", any_port(), 0, &options)?;
    let target_base = target.pool_base;

    // The raw peer: its own rail and one queue pair, handshaken many times.
    let repeated = 1000 + seed % 100;
    // Kept (and with it the queue pair) until the twins start.
    let (raw_peer, changed): (Box<dyn std::any::Any>, u64) = match fabric {
        ChaosFabric::Soft => {
            let device = SoftDevice::open("raw-peer", SoftConfig::default())?;
            let incarnation = Incarnation(device.incarnation());
            let (qp, changed) = repeat_handshakes(&target, &device, incarnation, repeated)?;
            (Box::new((device, qp)), changed)
        }
        ChaosFabric::Ofi { provider } => {
            let config = OfiConfig {
                provider: provider.clone(),
                domain: None,
            };
            let rail = OfiRail::open("raw-peer", &config)?;
            // Any value no other process of the scenario uses.
            let incarnation = Incarnation(seed.rotate_left(32) ^ u64::from(std::process::id()));
            let (qp, changed) = repeat_handshakes(&target, &rail, incarnation, repeated)?;
            (Box::new((rail, qp)), changed)
        }
    };

    // Two initiator processes on this host: two incarnations, two ports.
    let mut initiators = Vec::new();
    for (n, name) in ["prefill-0", "prefill-1"].into_iter().enumerate() {
        let mut node = Node::start_on(
            fabric,
            name,
            1,
            any_port(),
            seed.wrapping_add(n as u64),
            Policy::default(),
            None,
        )?;
        let source = node.alloc(1 << 16)?;
        // SAFETY: nothing transfers yet.
        unsafe { node.bytes_mut(source) }.fill(0xA0 + n as u8);
        initiators.push((node, source));
    }
    let mut peers_distinct = true;
    for (n, (node, source)) in initiators.iter().enumerate() {
        let view = node.control.connect(target.addr, 0, 0)?;
        if !view.wait_ready(Instant::now() + BOUND) {
            bail!("{} never connected: {:?}", node.name, view.phase());
        }
        for _ in 0..50 {
            let again = node.control.connect(target.addr, 0, 0)?;
            peers_distinct &= again.id == view.id;
        }
        let descriptor = view.descriptor().context("descriptor")?;
        let offset = n as u64 * (1 << 16);
        let rkey = descriptor
            .rkey_for(target_base + offset, 1 << 16, 0)
            .context("target region")?;
        let epoch = view.epoch().context("epoch")?;
        let local = node.regions()[*source].regions[0];
        let spec = write_slice(
            &view,
            epoch,
            0,
            (local, 0),
            (target_base + offset, rkey),
            1 << 16,
        );
        let mut submitter = Submitter::new(&[&*node.pollers[0]], 16)?;
        let batch = submitter.submit(1, &[spec], Instant::now() + BOUND)?;
        batch.wait(Instant::now() + BOUND);
        peers_distinct &= batch.outcome(0) == Some(RequestOutcome::Done);
    }
    // Each initiator's 64 KiB, where it was meant to land (digests from the target).
    let landed = target.digests(target.pool_id, 0, 2 << 16, 1 << 16)?;
    let meant = [digest(&[0xA0; 1 << 16]), digest(&[0xA1; 1 << 16])];
    peers_distinct &= landed == meant;

    let passive_qps = target.stat("passive_qps")?;
    let mut report = ChurnReport {
        seed,
        repeated_handshakes: repeated,
        teardowns: target.stat("teardowns")?,
        reconnects: target.stat("reconnects")?,
        passive_qps,
        idempotent_replies: target.stat("idempotent_replies")?,
        changed_answers: changed,
        warnings: target.stat("warnings")?,
        peers_distinct: peers_distinct && passive_qps == 3,
        twin_failed_requests: 0,
        twin_reconnects: 0,
        twin_teardowns: 0,
        twins_ran: false,
    };
    for (node, _) in &initiators {
        let stats = node.control.stats();
        report.teardowns += stats.teardowns;
        report.reconnects += stats.reconnects;
        report.warnings += stats.warnings_total();
    }
    drop(raw_peer);
    let twins = twin_processes(binary, seed, fabric)?;
    report.twins_ran = twins.len() == 2
        && twins
            .iter()
            .all(|twin| twin["bytes"].as_u64().is_some_and(|bytes| bytes > 0));
    for twin in &twins {
        report.twin_failed_requests += twin["failed_requests"].as_u64().unwrap_or(0);
        report.twin_reconnects += twin["reconnects"].as_u64().unwrap_or(0);
        report.twin_teardowns += twin["teardowns"].as_u64().unwrap_or(0);
    }
    Ok(report)
}

/// Seed 002 across processes: one `railyard serve` target and two `railyard bench`
/// initiators started at once under the same name, each writing to it for two seconds.
/// Returns the JSON report of each bench that ran.
fn twin_processes(
    binary: &std::path::Path,
    seed: u64,
    fabric: &ChaosFabric,
) -> Result<Vec<serde_json::Value>> {
    let target = Target::start(binary, fabric, "decode-twins", any_port(), 0)?;
    let twins: Vec<_> = (0..2u64)
        .map(|twin| {
            std::process::Command::new(binary)
                .env_remove("RAILYARD_SECRET_FILE")
                .env_remove("RAILYARD_ENCRYPT_CONTROL")
                .args(["bench", "--target", &target.addr.to_string()])
                .args(["--name", "prefill-twin", "--duration", "2", "--json"])
                .args(["--rails", "1", "--batch", "8"])
                .args(["--seed", &(seed ^ twin).to_string()])
                .args(fabric.process_options())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("starting a twin bench")
        })
        .collect::<Result<_>>()?;
    let mut reports = Vec::new();
    for twin in twins {
        let output = twin.wait_with_output().context("waiting for a twin")?;
        if let Ok(report) = serde_json::from_slice::<serde_json::Value>(&output.stdout) {
            reports.push(report);
        }
    }
    drop(target);
    Ok(reports)
}
