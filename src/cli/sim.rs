//! `railyard sim`: the deterministic simulation of the control plane
//! ([`railyard::control::sim`]) — thousands of processes' handshake cores on one thread,
//! over a simulated network and clock, under kills, stops, partitions and lost leases —
//! with the store's master beside them ([`railyard_store::sim`]), and its figures; a run
//! that breaks an invariant is shrunk and its trace printed.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use railyard::control::sim::{self, NetFaults, SimConfig, SimReport};
use railyard_store::sim::StoreSimConfig;

use super::duration::parse_duration;

#[derive(Debug, Args)]
pub(crate) struct SimArgs {
    /// Simulated processes.
    #[arg(long, default_value_t = 1000)]
    peers: usize,
    /// Decides everything random: the same seed gives the same run (and trace hash).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated time (`60s`, `2m`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// How many other processes each one sends transfers to.
    #[arg(long, default_value_t = 8)]
    fanout: usize,
    /// The share of processes killed at once a third of the way in, each restarted on its
    /// port as a new incarnation.
    #[arg(long, default_value_t = 0.1)]
    kill_fraction: f64,
    /// Processes stopped (SIGSTOP) for 4 s two thirds of the way in.
    #[arg(long, default_value_t = 1)]
    stops: usize,
    /// Probability that a control message is lost (and, as given, duplicated and
    /// reordered).
    #[arg(long, default_value_t = NetFaults::default().loss)]
    loss: f64,
    /// Probability that a control message arrives twice.
    #[arg(long, default_value_t = NetFaults::default().duplicate)]
    duplicate: f64,
    /// Probability that a control message overtakes those before it on its connection.
    #[arg(long, default_value_t = NetFaults::default().reorder)]
    reorder: f64,
    /// Run without a cluster directory: survivors learn that a killed peer restarted only
    /// by dialing its address (after their circuit's cooldown).
    #[arg(long)]
    no_directory: bool,
    /// Queue pairs one rail of a process may hold ([`Policy::max_endpoints_per_rail`]):
    /// fewer than `--fanout` makes idle endpoints be parked and woken as traffic moves.
    ///
    /// [`Policy::max_endpoints_per_rail`]: railyard::control::Policy::max_endpoints_per_rail
    #[arg(long)]
    max_endpoints_per_rail: Option<usize>,
    /// Send every process's transfers to the first N processes only (a cluster writing
    /// into a few decode ranks): each of them is the target of nearly every handshake.
    #[arg(long, default_value_t = 0)]
    hot_targets: usize,
    /// How long a process takes to answer one ConnectQp (creating and connecting a queue
    /// pair); it answers them one at a time.
    #[arg(long, default_value = "200us", value_parser = parse_duration)]
    handshake_cost: Duration,
    /// Handshakes in progress per target and per initiator
    /// ([`Policy::max_handshakes_per_target`], [`Policy::max_handshakes_per_initiator`]);
    /// more wait their turn.
    ///
    /// [`Policy::max_handshakes_per_target`]: railyard::control::Policy::max_handshakes_per_target
    /// [`Policy::max_handshakes_per_initiator`]: railyard::control::Policy::max_handshakes_per_initiator
    #[arg(long, default_value_t = railyard::control::Policy::default().max_handshakes_per_target)]
    max_handshakes: usize,
    /// Leave the store out: by default processes are also store clients (see
    /// `--store-clients`), and two masters (the real master core, failing over through a
    /// modelled etcd) serve them.
    #[arg(long)]
    no_store: bool,
    /// How many processes (the first ones) are also store clients: a new master's term
    /// fences grow with the square of the store's members.
    #[arg(long, default_value_t = StoreSimConfig::default().clients)]
    store_clients: usize,
    /// Runs a failing seed may take to find its smallest failing run.
    #[arg(long, default_value_t = 60)]
    shrink_budget: usize,
    /// Print every event of the run (big: use with few peers).
    #[arg(long)]
    trace: bool,
    /// Print the figures as one JSON object.
    #[arg(long)]
    json: bool,
}

impl SimArgs {
    fn config(&self) -> anyhow::Result<SimConfig> {
        if self.peers < 2 {
            bail!(
                "--peers {}: a simulation needs at least 2 processes",
                self.peers
            );
        }
        for (name, value) in [
            ("--kill-fraction", self.kill_fraction),
            ("--loss", self.loss),
            ("--duplicate", self.duplicate),
            ("--reorder", self.reorder),
        ] {
            if !(0.0..=1.0).contains(&value) {
                bail!("{name} {value}: a probability is between 0 and 1");
            }
        }
        if self.duration.is_zero() {
            bail!("--duration must be longer than zero");
        }
        let mut policy = railyard::control::Policy::default();
        if let Some(cap) = self.max_endpoints_per_rail {
            if cap == 0 {
                bail!("--max-endpoints-per-rail must be at least 1");
            }
            policy.max_endpoints_per_rail = cap;
        }
        if self.max_handshakes == 0 {
            bail!("--max-handshakes must be at least 1");
        }
        if self.store_clients == 0 && !self.no_store {
            bail!("--store-clients must be at least 1 (--no-store leaves the store out)");
        }
        policy.max_handshakes_per_target = self.max_handshakes;
        policy.max_handshakes_per_initiator = self.max_handshakes;
        Ok(SimConfig {
            policy,
            peers: self.peers,
            seed: self.seed,
            duration: self.duration,
            fanout: self.fanout,
            hot_targets: self.hot_targets,
            handshake_cost: self.handshake_cost,
            kill_fraction: self.kill_fraction,
            stops: self.stops,
            net: NetFaults {
                loss: self.loss,
                duplicate: self.duplicate,
                reorder: self.reorder,
                ..NetFaults::default()
            },
            directory: !self.no_directory,
            record_trace: self.trace,
            services: if self.no_store {
                Vec::new()
            } else {
                vec![
                    StoreSimConfig {
                        clients: self.store_clients,
                        ..StoreSimConfig::default()
                    }
                    .service(),
                ]
            },
            ..SimConfig::default()
        })
    }
}

/// Exit status when an invariant broke.
const VIOLATED: u8 = 1;

/// Events of the shortest failing run printed.
const SHOWN: usize = 200;

/// The processes a violation names (`p12`), as the trace's process column writes them.
fn processes_named(detail: &str) -> Vec<String> {
    let mut named: Vec<String> = detail
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|word| {
            word.len() > 1 && word.starts_with('p') && word[1..].bytes().all(|b| b.is_ascii_digit())
        })
        .map(|word| format!("{word:<5}"))
        .collect();
    named.dedup();
    named
}

pub(crate) fn run(args: &SimArgs) -> anyhow::Result<ExitCode> {
    #[cfg(feature = "sabotage")]
    railyard::dataplane::sabotage::turn_off_from_env();
    let config = args.config()?;
    let report = sim::simulate(&config);
    if args.json {
        println!("{}", json(&config, &report));
    } else {
        for line in &report.trace {
            println!("{line}");
        }
        print_figures(&config, &report);
    }
    if report.passed() {
        return Ok(ExitCode::SUCCESS);
    }
    for violation in &report.violations {
        eprintln!(
            "violated at {:?}: {}: {}",
            violation.at, violation.invariant, violation.detail
        );
    }
    if let Some(shrunk) = sim::shrink(&config, args.shrink_budget) {
        let config = &shrunk.config;
        eprintln!(
            "\nshortest failing run found in {} runs: {} peers, fanout {}, {:?}, faults {:?}, \
             network {:?}",
            shrunk.runs, config.peers, config.fanout, config.duration, config.faults, config.net
        );
        let involved = shrunk
            .report
            .violations
            .first()
            .map(|violation| processes_named(&violation.detail))
            .unwrap_or_default();
        let lines: Vec<&String> = shrunk
            .report
            .trace
            .iter()
            .filter(|line| {
                involved.is_empty()
                    || involved.iter().any(|p| line.contains(&format!(" {p} ")))
                    || line.contains("VIOLATION")
                    || line.contains(" fault ")
            })
            .collect();
        let from = lines.len().saturating_sub(SHOWN);
        eprintln!(
            "its last {} events of {} (of {} in all):",
            lines.len() - from,
            if involved.is_empty() {
                "every process".to_string()
            } else {
                involved
                    .iter()
                    .map(|p| p.trim_end())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            shrunk.report.trace.len()
        );
        for line in &lines[from..] {
            eprintln!("{line}");
        }
    }
    Ok(ExitCode::from(VIOLATED))
}

fn ms(duration: Option<Duration>) -> serde_json::Value {
    duration.map_or(serde_json::Value::Null, |d| {
        serde_json::json!(d.as_secs_f64() * 1e3)
    })
}

fn json(config: &SimConfig, report: &SimReport) -> serde_json::Value {
    serde_json::json!({
        "peers": report.peers,
        "seed": config.seed,
        "fanout": config.fanout,
        "hot_targets": config.hot_targets,
        "handshake_cost_us": config.handshake_cost.as_secs_f64() * 1e6,
        "max_handshakes": config.policy.max_handshakes_per_target,
        "simulated_s": report.simulated.as_secs_f64(),
        "wall_s": report.wall.as_secs_f64(),
        "events": report.events,
        "trace_hash": format!("{:016x}", report.trace_hash),
        "handshakes": report.handshakes,
        "handshakes_per_s": report.handshakes_per_sec,
        "handshakes_told_to_wait": report.handshakes_told_to_wait,
        "peak_handshakes_per_s_into_one": report.peak_handshakes_per_sec_into_one,
        "all_connected_ms": ms(report.all_connected_after),
        "converged_after_restart_ms": ms(report.converged_after_restart),
        "max_reconnects_per_pair": report.max_reconnects_per_pair,
        "mean_reconnects_per_pair": report.mean_reconnects_per_pair,
        "peak_endpoints_per_rail": report.peak_endpoints_per_rail,
        "peak_queue_pairs_per_rail": report.peak_queue_pairs_per_rail,
        "max_endpoints_per_rail": config.policy.max_endpoints_per_rail,
        "evictions": report.evictions,
        "failed_by_eviction": report.failed_by_eviction,
        "control_state_bytes_per_peer": report.control_state_bytes_per_peer,
        "control_wire_bytes_per_peer": report.control_wire_bytes_per_peer,
        "max_stop_detection_ms": ms(report.max_stop_detection),
        "requests": report.requests,
        "completed": report.completed,
        "failed_fast": report.failed_fast,
        "failed": report.failed,
        "reprepared": report.reprepared,
        "connects_failed": report.connects_failed,
        "services": report.services.iter().map(|service| (
            service.name.to_string(),
            serde_json::Value::Object(service.figures.iter().map(|(name, value)| (name.to_string(), serde_json::json!(value)))
                .collect()),
        )).collect::<serde_json::Map<_, _>>(),
        "violations": report.violations.iter().map(|v| serde_json::json!({
            "at_ms": v.at.as_secs_f64() * 1e3,
            "invariant": v.invariant,
            "detail": v.detail,
        })).collect::<Vec<_>>(),
    })
}

fn print_figures(config: &SimConfig, report: &SimReport) {
    let opt = |d: Option<Duration>| d.map_or_else(|| "never".to_string(), |d| format!("{d:.3?}"));
    println!(
        "railyard sim: {} peers, seed {}, fanout {}, {:?} simulated in {:.2?} wall ({} events)",
        report.peers, config.seed, config.fanout, report.simulated, report.wall, report.events
    );
    println!("trace hash                     {:016x}", report.trace_hash);
    println!(
        "handshakes                     {} ({:.0}/s; at most {}/s into one process)",
        report.handshakes, report.handshakes_per_sec, report.peak_handshakes_per_sec_into_one
    );
    println!(
        "handshakes told to wait        {} (at most {} in progress per target, {} per \
         initiator; {:?} each)",
        report.handshakes_told_to_wait,
        config.policy.max_handshakes_per_target,
        config.policy.max_handshakes_per_initiator,
        config.handshake_cost
    );
    println!(
        "all pairs connected after      {}",
        opt(report.all_connected_after)
    );
    println!(
        "converged after the restart    {}",
        opt(report.converged_after_restart)
    );
    println!(
        "reconnects per pair            max {}, mean {:.3}",
        report.max_reconnects_per_pair, report.mean_reconnects_per_pair
    );
    println!(
        "peak endpoints per rail        {} ({} with a queue pair; {} evictions, {} failed by one)",
        report.peak_endpoints_per_rail,
        report.peak_queue_pairs_per_rail,
        report.evictions,
        report.failed_by_eviction
    );
    println!(
        "control state per peer         {} B",
        report.control_state_bytes_per_peer
    );
    println!(
        "control traffic per peer       {} B",
        report.control_wire_bytes_per_peer
    );
    println!(
        "stopped peer detected within   {}",
        opt(report.max_stop_detection)
    );
    println!(
        "transfers                      {} started, {} completed, {} failed fast, {} failed, \
         {} re-prepared",
        report.requests, report.completed, report.failed_fast, report.failed, report.reprepared
    );
    println!("connects failed                {}", report.connects_failed);
    for service in &report.services {
        let figures: Vec<String> = service
            .figures
            .iter()
            .map(|(name, value)| format!("{name} {value}"))
            .collect();
        println!("{:<31}{}", service.name, figures.join(", "));
    }
    println!(
        "invariants                     {}",
        if report.passed() {
            "all held".to_string()
        } else {
            format!("{} violations", report.violations.len())
        }
    );
}
