//! The processes of the `hicache` scenario: `railyard master --etcd` (a leader and a
//! standby), `railyard store serve` segment processes on fixed ports, and
//! `railyard store chaos-client` workload processes — each a child that dies with the
//! driver, reports its lines through a channel, and is killed (and reaped) when dropped.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use crate::process::die_with_parent;

/// How long a process may take to print its first line.
const START_BOUND: Duration = Duration::from_secs(30);

/// A `railyard` child.
pub(crate) struct Proc {
    pub(crate) child: Child,
    stdin: Option<ChildStdin>,
    /// Its stdout after the first line.
    pub(crate) lines: Receiver<String>,
    /// Its first line, by words.
    pub(crate) first: Vec<String>,
}

impl Proc {
    /// Starts `binary args…` with the cluster secret in the file `secret` and waits for its
    /// first line.
    pub(crate) fn start(binary: &Path, secret: &Path, args: &[&str]) -> Result<Self> {
        let mut command = Command::new(binary);
        command
            .env("RAILYARD_SECRET_FILE", secret)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // A protection a test switched off is off in every process of the scenario.
        #[cfg(feature = "sabotage")]
        command.env(
            railyard_engine::dataplane::sabotage::ENV,
            railyard_engine::dataplane::sabotage::switched_off(),
        );
        die_with_parent(&mut command);
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {} {}", binary.display(), args.join(" ")))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("stdout is piped")?;
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut proc = Self {
            child,
            stdin,
            lines,
            first: Vec::new(),
        };
        match proc.lines.recv_timeout(START_BOUND) {
            Ok(line) => proc.first = line.split_whitespace().map(str::to_owned).collect(),
            Err(_) => bail!("`railyard {}` printed nothing", args.join(" ")),
        }
        Ok(proc)
    }

    /// The address its first line names after `listening`.
    pub(crate) fn listening(&self) -> Result<&str> {
        match self.first.as_slice() {
            [word, addr, ..] if word == "listening" => Ok(addr),
            other => bail!("expected `listening ADDR …`, got {other:?}"),
        }
    }

    /// Writes a command line to its stdin.
    pub(crate) fn command(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("its stdin is closed")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// Sends `signal`; SIGSTOP returns once the process is stopped (within a bound), since
    /// kill(2) returns before the signal is delivered.
    pub(crate) fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid, alive (or a zombie) until it is waited for.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        if signal == libc::SIGSTOP {
            let stat = format!("/proc/{}/stat", self.child.id());
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(2) {
                let state = std::fs::read_to_string(&stat).unwrap_or_default();
                // The state follows the command's closing parenthesis.
                if state
                    .rsplit(')')
                    .next()
                    .is_some_and(|rest| rest.trim_start().starts_with('T'))
                {
                    return;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// Kills it now (SIGKILL, no goodbye) and reaps it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it has exited.
    pub(crate) fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Closes its stdin and waits up to `bound` for it to exit.
    pub(crate) fn finish(&mut self, bound: Duration) -> bool {
        drop(self.stdin.take());
        let start = Instant::now();
        while start.elapsed() < bound {
            if self.exited() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited() {
            return;
        }
        self.signal(libc::SIGCONT);
        self.kill();
    }
}

/// A master elected through etcd at `url`.
pub(crate) fn master(binary: &Path, secret: &Path, url: &str) -> Result<Proc> {
    Proc::start(
        binary,
        secret,
        &[
            "master",
            "--listen",
            "127.0.0.1:0",
            "--etcd",
            url,
            "--until-stdin-closes",
        ],
    )
}

/// A segment process named `name` on `port`, contributing `size` bytes.
pub(crate) fn segment(
    binary: &Path,
    secret: &Path,
    url: &str,
    name: &str,
    port: u16,
    size: &str,
) -> Result<Proc> {
    Proc::start(
        binary,
        secret,
        &[
            "store",
            "serve",
            "--master",
            url,
            "--segment",
            size,
            "--fabric",
            "tcp",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--name",
            name,
            "--until-stdin-closes",
        ],
    )
}

/// A workload process named `name`.
pub(crate) fn client(
    binary: &Path,
    secret: &Path,
    url: &str,
    name: &str,
    seed: u64,
) -> Result<Proc> {
    Proc::start(
        binary,
        secret,
        &[
            "store",
            "chaos-client",
            "--master",
            url,
            "--name",
            name,
            "--seed",
            &seed.to_string(),
        ],
    )
}
