//! `railyard master`: the store's master as a process — metadata only, clients move the
//! bytes themselves.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use railyard::store::{MasterConfig, MasterPolicy, MasterServer};

use super::duration::parse_duration;
use super::engine_args::{SecretArgs, parse_metrics_addr};

#[derive(Debug, Args)]
pub(crate) struct MasterArgs {
    /// Where clients connect (port 0: any free port; the first line says which).
    #[arg(long, default_value = "127.0.0.1:7500")]
    listen: SocketAddr,
    /// How long a read's lease keeps its object from eviction and from remove without force.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    lease_ttl: Duration,
    /// Share of all segments' space above which objects are evicted (0 < x ≤ 1).
    #[arg(long, default_value_t = 0.9)]
    eviction_high_watermark: f64,
    /// Share of all segments' space one eviction frees (0 < x ≤ 1).
    #[arg(long, default_value_t = 0.05)]
    eviction_ratio: f64,
    /// How long a write may stay between put-start and put-end before it is abandoned and
    /// its space fenced.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    put_timeout: Duration,
    /// How long a member that contributes a segment may be silent (its pings stopped, e.g.
    /// a stopped process) before its segments are suspected: no put placed, no get pointed
    /// there. A dropped connection makes it suspected at once.
    #[arg(long, value_parser = parse_duration, default_value = "1500ms")]
    member_silence: Duration,
    /// How long a suspected member keeps its data: heard again within it (the same
    /// incarnation), its segments serve as before; past it, they and their replicas are
    /// forgotten.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    suspect_grace: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics (a bare port is loopback, 127.0.0.1; port 0:
    /// any free port; the first
    /// line then ends with `metrics ADDR`).
    #[arg(long, value_name = "[IP:]PORT", value_parser = parse_metrics_addr)]
    metrics: Option<SocketAddr>,
    /// Lead through etcd (`etcd://HOST:PORT[?ttl=SECONDS&prefix=…]`; the ttl is the leader's
    /// lease, 3 s unless given): run two or more masters with the same URL; one leads, the
    /// others wait and take over when its lease lapses, rebuilding from the journal every
    /// change is written to. A leader that loses its lease exits.
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// The address clients are told to connect to (default: where it listens).
    #[arg(long, value_name = "HOST:PORT", requires = "etcd")]
    advertise: Option<String>,
    #[command(flatten)]
    secret: SecretArgs,
    /// Exit when standard input closes (how tests and scripts stop it).
    #[arg(long)]
    until_stdin_closes: bool,
}

pub(crate) fn run(args: &MasterArgs) -> anyhow::Result<()> {
    #[cfg(feature = "sabotage")]
    railyard::dataplane::sabotage::turn_off_from_env();
    for (name, value) in [
        ("--eviction-high-watermark", args.eviction_high_watermark),
        ("--eviction-ratio", args.eviction_ratio),
    ] {
        if !(value > 0.0 && value <= 1.0) {
            bail!("{name} {value}: must be more than 0 and at most 1");
        }
    }
    if args.lease_ttl.is_zero() || args.put_timeout.is_zero() || args.member_silence.is_zero() {
        bail!("--lease-ttl, --put-timeout and --member-silence must be more than 0");
    }
    let secret = args.secret.secret()?;
    if secret.is_none() {
        tracing::warn!(
            target: "railyard::master",
            "no --secret-file: any process that can reach the master is admitted"
        );
    }
    let server = MasterServer::start(MasterConfig {
        listen: args.listen,
        policy: MasterPolicy {
            lease_ttl: args.lease_ttl,
            eviction_high_watermark: args.eviction_high_watermark,
            eviction_ratio: args.eviction_ratio,
            put_timeout: args.put_timeout,
            member_silence: args.member_silence,
            suspect_grace: args.suspect_grace,
        },
        secret,
        name: railyard::engine::default_name("master"),
        election: args.etcd.clone(),
        advertise: args.advertise.clone(),
    })
    .with_context(|| format!("listening on {}", args.listen))?;
    let metrics = args
        .metrics
        .map(|addr| {
            server
                .serve_metrics(addr)
                .with_context(|| format!("serving metrics on {addr}"))
        })
        .transpose()?;
    let mut out = std::io::stdout().lock();
    write!(out, "listening {}", server.addr())?;
    match metrics {
        Some(addr) => writeln!(out, " metrics {addr}")?,
        None => writeln!(out)?,
    }
    out.flush()?;
    drop(out);
    let (closed, stdin_closed) = std::sync::mpsc::channel::<()>();
    // Without --until-stdin-closes the sender stays here: the master runs until killed or
    // until it loses its term.
    let _runs_until_killed = if args.until_stdin_closes {
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut line = Vec::new();
            while matches!(stdin.read_until(b'\n', &mut line), Ok(read) if read > 0) {
                line.clear();
            }
            let _ = closed.send(());
        });
        None
    } else {
        Some(closed)
    };
    loop {
        match stdin_closed.recv_timeout(Duration::from_millis(100)) {
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(reason) = server.lost() {
            bail!("this master no longer leads: {reason}");
        }
    }
}
