//! The target process bench starts on this host when no `--target` is given: a `railyard
//! serve` child with this bench's fabric, rails and secret, stopped when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use railyard::engine::{Engine, FabricChoice, Peer, default_name};

use super::args::BenchArgs;

/// The target process bench started, stopped when dropped.
pub(super) struct TargetChild(Child);

impl Drop for TargetChild {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a `railyard serve` with a pool of `pool` bytes and `rails` rails; with `echo`, it
/// answers `--latency`'s pings.
fn start_target(
    args: &BenchArgs,
    pool: u64,
    rails: usize,
    echo: bool,
) -> anyhow::Result<(TargetChild, SocketAddr)> {
    let mut command = Command::new(std::env::current_exe().context("finding this binary")?);
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--until-stdin-closes"])
        .args(["--name", &default_name("bench-target")])
        .args(["--pool", &pool.to_string()])
        .args([
            "--fabric",
            match args.fabric {
                FabricChoice::Auto => "auto",
                FabricChoice::Soft => "soft",
                FabricChoice::Tcp => "tcp",
                FabricChoice::Verbs => "verbs",
                FabricChoice::Ofi => "ofi",
            },
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // As many rails as this engine, always by count: the target runs on this host, and
    // pinning its pollers as planned would put them on the cores this process's pollers
    // spin on (a TCP target's poller is busy serving; two pollers on one core take turns
    // only at scheduler ticks).
    command.args(["--rails", &rails.to_string()]);
    if let Some(port) = args.verbs.ib_port {
        command.args(["--ib-port", &port.to_string()]);
    }
    if let Some(index) = args.verbs.gid_index {
        command.args(["--gid-index", &index.to_string()]);
    }
    if let Some(provider) = &args.verbs.ofi_provider {
        command.args(["--ofi-provider", provider]);
    }
    command.args(args.secret.options());
    if echo {
        command.arg("--echo");
    }
    let mut child = TargetChild(command.spawn().context("starting the target process")?);
    let stdout = child.0.stdout.take().context("the target's stdout")?;
    let (lines, first) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let ready = first.recv_timeout(Duration::from_secs(20)).ok();
    let addr = ready
        .as_deref()
        .and_then(|line| line.strip_prefix("listening "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|addr| addr.parse().ok());
    match addr {
        Some(addr) => {
            // Keep draining its output (notifications) so it never blocks on a full pipe.
            std::thread::spawn(move || for _ in first {});
            Ok((child, addr))
        }
        None => {
            let _ = child.0.kill();
            let mut stderr = String::new();
            if let Some(mut pipe) = child.0.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
            }
            bail!(
                "the target did not start: {}",
                stderr.lines().last().unwrap_or("no output")
            )
        }
    }
}

/// The target a bench talks to, opened: the one `--target` names, else a `railyard serve`
/// started here (with a pool of `pool` bytes; answering pings with `echo`), kept until
/// dropped.
pub(super) struct OpenTarget {
    pub(super) peer: Peer,
    /// As it was opened.
    pub(super) name: String,
    /// Its largest registered region (its pool): address and length.
    pub(super) pool_base: u64,
    pub(super) pool_len: u64,
    /// Declared last: the target this bench started stops after the peer is dropped.
    pub(super) child: Option<TargetChild>,
}

pub(super) fn open_target(
    args: &BenchArgs,
    engine: &Engine,
    pool: u64,
    echo: bool,
) -> anyhow::Result<OpenTarget> {
    let (child, name) = match &args.target {
        Some(target) => (None, target.clone()),
        None => {
            let (child, addr) = start_target(args, pool, engine.rails(), echo)?;
            (Some(child), addr.to_string())
        }
    };
    let peer = engine
        .open(&name)
        .with_context(|| format!("opening the target {name}"))?;
    let Some((pool_base, pool_len)) = peer
        .descriptor()
        .regions
        .iter()
        .max_by_key(|region| region.len)
        .map(|region| (region.base, region.len))
    else {
        bail!("the target {name} has registered no memory");
    };
    Ok(OpenTarget {
        peer,
        name,
        pool_base,
        pool_len,
        child,
    })
}
