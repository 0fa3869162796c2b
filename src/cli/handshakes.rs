//! `railyard handshakes`: how many peers per second one target takes on when hundreds of
//! initiators open it at once. Child processes (this binary again, with `--child`) each
//! build their share of the initiator engines, wait for the word, and open the target all
//! together, each engine in its own thread; every open is a whole handshake — a control
//! connection, Hello, the descriptor and a ConnectQp. The rate is the opens of a round over
//! the time from the word to the last one done; the target's control memory per peer is
//! read once the round's peers sit idle.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Args;
use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, FabricChoice, RailChoice};

use super::engine_args::parse_fabric;

#[derive(Debug, Args)]
pub(crate) struct HandshakesArgs {
    /// Initiator engines opening the target at once (each its own incarnation).
    #[arg(long, default_value_t = 256)]
    initiators: usize,
    /// Processes the initiators are spread over.
    #[arg(long, default_value_t = 8)]
    processes: usize,
    /// Rounds: each builds fresh initiators, opens the target with all of them at once,
    /// then drops them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The fabric (`tcp` or `soft`).
    #[arg(long, default_value = "tcp", value_parser = parse_fabric)]
    fabric: FabricChoice,
    /// Open this engine (`host:port`) instead of one started here; its control memory is
    /// then not reported.
    #[arg(long)]
    target: Option<String>,
    /// Print the figures as one JSON object.
    #[arg(long)]
    json: bool,
    /// Run as one of the initiator processes (started by the command itself).
    #[arg(long, hide = true)]
    child: bool,
}

/// What a child says when its engines are built.
const READY: &str = "ready";
/// What the parent says to start a round's opens.
const GO: &str = "go";
/// How long a child may take to build its engines, to answer a line, or to end.
const STEP: Duration = Duration::from_secs(300);

pub(crate) fn run(args: &HandshakesArgs) -> anyhow::Result<ExitCode> {
    if args.initiators == 0 || args.processes == 0 || args.rounds == 0 {
        bail!("--initiators, --processes and --rounds must be at least 1");
    }
    if !matches!(args.fabric, FabricChoice::Tcp | FabricChoice::Soft) {
        bail!("--fabric: handshakes are measured on tcp or soft");
    }
    if args.child {
        let target = args.target.as_deref().context("a child needs --target")?;
        return child(target, args.initiators, args.rounds, args.fabric)
            .map(|()| ExitCode::SUCCESS);
    }
    let local = match &args.target {
        Some(_) => None,
        None => Some(engine("handshake-target", args.fabric)?),
    };
    let target = match (&args.target, &local) {
        (Some(target), _) => target.clone(),
        (None, Some(engine)) => engine.addr().to_string(),
        (None, None) => unreachable!("a local target is started without --target"),
    };
    let processes = args.processes.min(args.initiators);
    let mut children = (0..processes)
        .map(|index| {
            let share =
                args.initiators / processes + usize::from(index < args.initiators % processes);
            Initiators::spawn(&target, share, args)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut rounds = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds {
        for child in &mut children {
            child.expect(READY)?;
        }
        let started = Instant::now();
        for child in &mut children {
            writeln!(child.stdin, "{GO}").context("telling an initiator process to go")?;
        }
        let mut round = Round::default();
        for child in &mut children {
            child.collect(&mut round)?;
        }
        round.wall = started.elapsed();
        if let Some(engine) = &local {
            // The footprint gauge is refreshed every second; the round's peers are idle.
            std::thread::sleep(Duration::from_millis(1_100));
            let control = engine.stats().control;
            round.known_peers = control.known_peers;
            round.bytes_per_peer = Some(control.control_bytes_per_peer());
        }
        rounds.push(round);
    }
    for mut child in children {
        child.finish()?;
    }
    let summary = Summary::of(&rounds, args);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary.json(&rounds))?);
    } else {
        summary.print(&rounds);
    }
    let failed: usize = rounds.iter().map(|round| round.failed.len()).sum();
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// An engine as the benchmark runs them: one rail, its poller parked while idle (hundreds
/// share this host's cores; a command or a submission wakes it at once).
fn engine(name: &str, fabric: FabricChoice) -> anyhow::Result<Engine> {
    Engine::builder(name)
        .fabric(fabric)
        .rails(RailChoice::Count(std::num::NonZeroUsize::MIN))
        .idle(IdleStrategy::SpinThenPark {
            spins: 16,
            park: Duration::from_millis(100),
        })
        .build()
        .map_err(|error| anyhow!("starting engine {name}: {error}"))
}

/// A child: per round, builds its engines, says [`READY`], waits for [`GO`], opens the
/// target from all of them at once and prints each open's time (or error), then `done`.
fn child(
    target: &str,
    initiators: usize,
    rounds: usize,
    fabric: FabricChoice,
) -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let pid = std::process::id();
    for round in 0..rounds {
        let engines = (0..initiators)
            .map(|index| engine(&format!("initiator-{pid}-{round}-{index}"), fabric))
            .collect::<anyhow::Result<Vec<_>>>()?;
        writeln!(stdout, "{READY}")?;
        stdout.flush()?;
        let mut word = String::new();
        stdin.lock().read_line(&mut word)?;
        if word.trim() != GO {
            bail!("expected {GO:?}, read {word:?}");
        }
        let opened: Vec<Result<Duration, String>> = std::thread::scope(|scope| {
            let opens: Vec<_> = engines
                .iter()
                .map(|engine| {
                    scope.spawn(move || {
                        let started = Instant::now();
                        engine
                            .open(target)
                            .map(|_| started.elapsed())
                            .map_err(|error| error.to_string())
                    })
                })
                .collect();
            opens
                .into_iter()
                .map(|open| {
                    open.join()
                        .unwrap_or_else(|_| Err("the open panicked".into()))
                })
                .collect()
        });
        for outcome in opened {
            match outcome {
                Ok(took) => writeln!(stdout, "opened {}", took.as_micros())?,
                Err(error) => writeln!(stdout, "failed {}", error.replace('\n', " "))?,
            }
        }
        writeln!(stdout, "done")?;
        stdout.flush()?;
    }
    Ok(())
}

/// One initiator process, as the parent drives it.
struct Initiators {
    process: Child,
    stdin: ChildStdin,
    /// Its stdout's lines, read by a thread of their own so that every wait has a bound.
    lines: Receiver<std::io::Result<String>>,
}

/// Reads `stdout`'s lines into a channel until it ends.
fn lines_of(stdout: ChildStdout) -> Receiver<std::io::Result<String>> {
    let (send, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if send.send(line).is_err() {
                return;
            }
        }
    });
    lines
}

impl Initiators {
    fn spawn(target: &str, initiators: usize, args: &HandshakesArgs) -> anyhow::Result<Self> {
        let fabric = match args.fabric {
            FabricChoice::Soft => "soft",
            _ => "tcp",
        };
        let mut process = Command::new(std::env::current_exe()?)
            .args([
                "handshakes",
                "--child",
                "--target",
                target,
                "--fabric",
                fabric,
            ])
            .args(["--initiators", &initiators.to_string()])
            .args(["--rounds", &args.rounds.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting an initiator process")?;
        let stdin = process.stdin.take().context("its stdin")?;
        let stdout = process.stdout.take().context("its stdout")?;
        Ok(Self {
            process,
            stdin,
            lines: lines_of(stdout),
        })
    }

    fn line(&mut self) -> anyhow::Result<String> {
        match self.lines.recv_timeout(STEP) {
            Ok(line) => Ok(line?),
            Err(RecvTimeoutError::Timeout) => {
                let _ = self.process.kill();
                bail!("an initiator process said nothing for {STEP:?}")
            }
            Err(RecvTimeoutError::Disconnected) => {
                bail!(
                    "an initiator process ended early ({:?})",
                    self.process.try_wait()?
                )
            }
        }
    }

    fn expect(&mut self, word: &str) -> anyhow::Result<()> {
        let line = self.line()?;
        if line != word {
            bail!("an initiator process said {line:?}, not {word:?}");
        }
        Ok(())
    }

    /// Reads a round's outcomes up to `done`.
    fn collect(&mut self, round: &mut Round) -> anyhow::Result<()> {
        loop {
            let line = self.line()?;
            if line == "done" {
                return Ok(());
            }
            if let Some(micros) = line.strip_prefix("opened ") {
                round.opens.push(Duration::from_micros(micros.parse()?));
            } else if let Some(error) = line.strip_prefix("failed ") {
                round.failed.push(error.to_string());
            } else {
                bail!("an initiator process said {line:?}");
            }
        }
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.process.try_wait()? {
                if !status.success() {
                    bail!("an initiator process failed: {status}");
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                self.process.kill()?;
                bail!("an initiator process did not end");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One round: every open's time, the failures, and the target's state after it.
#[derive(Debug, Default)]
struct Round {
    opens: Vec<Duration>,
    failed: Vec<String>,
    wall: Duration,
    known_peers: u64,
    bytes_per_peer: Option<u64>,
}

impl Round {
    fn rate(&self) -> f64 {
        self.opens.len() as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// The figures over all rounds.
struct Summary {
    initiators: usize,
    processes: usize,
    fabric: &'static str,
    p50: Duration,
    p99: Duration,
    best_rate: f64,
    mean_rate: f64,
}

impl Summary {
    fn of(rounds: &[Round], args: &HandshakesArgs) -> Self {
        let mut all: Vec<Duration> = rounds
            .iter()
            .flat_map(|r| r.opens.iter().copied())
            .collect();
        all.sort_unstable();
        let at = |q: f64| {
            all.get(((all.len() as f64 * q).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or_default()
        };
        let rates: Vec<f64> = rounds.iter().map(Round::rate).collect();
        Self {
            initiators: args.initiators,
            processes: args.processes.min(args.initiators),
            fabric: match args.fabric {
                FabricChoice::Soft => "soft",
                _ => "tcp",
            },
            p50: at(0.50),
            p99: at(0.99),
            best_rate: rates.iter().copied().fold(0.0, f64::max),
            mean_rate: rates.iter().sum::<f64>() / rates.len().max(1) as f64,
        }
    }

    fn json(&self, rounds: &[Round]) -> serde_json::Value {
        serde_json::json!({
            "fabric": self.fabric,
            "initiators": self.initiators,
            "processes": self.processes,
            "handshakes_per_s_best": self.best_rate,
            "handshakes_per_s_mean": self.mean_rate,
            "open_p50_ms": self.p50.as_secs_f64() * 1e3,
            "open_p99_ms": self.p99.as_secs_f64() * 1e3,
            "rounds": rounds.iter().map(|round| serde_json::json!({
                "opened": round.opens.len(),
                "failed": round.failed,
                "wall_ms": round.wall.as_secs_f64() * 1e3,
                "handshakes_per_s": round.rate(),
                "target_known_peers": round.known_peers,
                "target_control_bytes_per_peer": round.bytes_per_peer,
            })).collect::<Vec<_>>(),
        })
    }

    fn print(&self, rounds: &[Round]) {
        println!(
            "railyard handshakes: {} initiators in {} processes opening one target at once ({})",
            self.initiators, self.processes, self.fabric
        );
        for (index, round) in rounds.iter().enumerate() {
            let memory = round.bytes_per_peer.map_or_else(String::new, |bytes| {
                format!(
                    "; target: {} peers, {bytes} B of control state per peer",
                    round.known_peers
                )
            });
            println!(
                "round {}: {} opened, {} failed in {:.1?}: {:.0} handshakes/s{memory}",
                index + 1,
                round.opens.len(),
                round.failed.len(),
                round.wall,
                round.rate()
            );
            for error in round.failed.iter().take(3) {
                println!("  failed: {error}");
            }
        }
        println!(
            "handshakes/s: best {:.0}, mean {:.0}; one open: p50 {:.1?}, p99 {:.1?}",
            self.best_rate, self.mean_rate, self.p50, self.p99
        );
    }
}
