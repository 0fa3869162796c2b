//! Target processes for the scenarios: `railyard serve` children that die with this
//! process (even when stopped), say where they listen, and take commands on stdin (allocate,
//! re-register and deregister regions, digest their bytes).
//!
//! They run without address-space randomisation, so a newcomer on a dead target's port maps
//! its pool exactly where its predecessor's was (identical processes do that without ASLR,
//! and allocators that reuse address ranges do it with it): a write still aimed at the
//! predecessor, under keys from a refreshed descriptor, would land and be counted.

use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use railyard_engine::control::Incarnation;

use super::fabric::ChaosFabric;
use super::harness::BOUND;

/// How long a target may take to say where it listens: a newcomer under a name a dead
/// process held in etcd first waits that name's lease out.
const START_BOUND: Duration = Duration::from_secs(30);

/// Each target's pool unless told otherwise.
const POOL: &str = "8MiB";

/// A region of a target, as its `alloc` or `reregister` command answered.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RemoteRegion {
    pub(crate) id: u64,
    pub(crate) addr: u64,
}

/// A `railyard serve` child; killed (and reaped) when dropped.
pub(crate) struct Target {
    pub(crate) child: Child,
    /// Commands go here; closing it stops the child (`--until-stdin-closes`).
    stdin: ChildStdin,
    /// Its stdout after the first line.
    lines: Receiver<String>,
    /// A command went unanswered: a late answer could be taken for the next one's, so no
    /// more commands are sent.
    unanswered: bool,
    pub(crate) addr: SocketAddr,
    pub(crate) pool_base: u64,
    /// The pool's region id.
    pub(crate) pool_id: u64,
    /// Its incarnation, as printed.
    pub(crate) incarnation: Incarnation,
    /// Changes with every newcomer on a port (the soak's block patterns carry it).
    pub(crate) generation: u8,
}

impl Target {
    /// Starts `binary serve` on `fabric`, named `name`, on `listen` (one rail, an 8 MiB
    /// pool) and reads where it listens.
    ///
    /// # Errors
    /// When it does not start or say where it listens within 10 s.
    pub(crate) fn start(
        binary: &Path,
        fabric: &ChaosFabric,
        name: &str,
        listen: SocketAddr,
        generation: u8,
    ) -> Result<Self> {
        Self::start_with(
            binary,
            fabric,
            name,
            listen,
            generation,
            &["--rails", "1", "--pool", POOL],
        )
    }

    /// [`Self::start`] with serve's `options` instead of one rail and an 8 MiB pool.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub(crate) fn start_with(
        binary: &Path,
        fabric: &ChaosFabric,
        name: &str,
        listen: SocketAddr,
        generation: u8,
        options: &[&str],
    ) -> Result<Self> {
        let mut command = Command::new(binary);
        // The scenarios' nodes have no cluster secret: neither may their targets.
        command
            .env_remove("RAILYARD_SECRET_FILE")
            .env_remove("RAILYARD_ENCRYPT_CONTROL")
            .args(["serve", "--until-stdin-closes", "--name", name])
            .args(options)
            .args(fabric.process_options())
            .args(["--listen", &listen.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // A protection a test switched off is off in its targets too.
        #[cfg(feature = "sabotage")]
        command.env(
            railyard_engine::dataplane::sabotage::ENV,
            railyard_engine::dataplane::sabotage::switched_off(),
        );
        die_with_parent(&mut command);
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // personality(2), a plain system call; it touches no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                // The same layout for every target (see the module doc), on top of whatever
                // persona the child inherited.
                let persona = libc::personality(0xffff_ffff);
                let no_aslr = persona as libc::c_ulong | libc::ADDR_NO_RANDOMIZE as libc::c_ulong;
                if persona == -1 || libc::personality(no_aslr) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("serve's pipes were not set up");
        };
        let (first_line, first) = std::sync::mpsc::channel();
        let (line, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut stdout = BufReader::new(stdout).lines();
            let _ = first_line.send(stdout.next());
            // Read on, so the child never blocks on a full pipe.
            for next in stdout.map_while(Result::ok) {
                let _ = line.send(next);
            }
        });
        let first = match first.recv_timeout(START_BOUND) {
            Ok(Some(Ok(line))) => line,
            outcome => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("serve did not say where it listens: {outcome:?}");
            }
        };
        // listening ADDR incarnation INC pool 0xBASE LEN region ID
        let words: Vec<&str> = first.split_whitespace().collect();
        let parsed = match (words.get(1), words.get(3), words.get(5), words.get(8)) {
            (Some(addr), Some(incarnation), Some(base), Some(id)) => addr
                .parse::<SocketAddr>()
                .ok()
                .zip(hex(incarnation))
                .zip(hex(base))
                .zip(id.parse::<u64>().ok())
                .map(|(((addr, incarnation), base), id)| (addr, incarnation, base, id)),
            _ => None,
        };
        let Some((addr, incarnation, pool_base, pool_id)) = parsed else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("unexpected first line from serve: {first:?}");
        };
        Ok(Self {
            addr,
            pool_base,
            pool_id,
            incarnation: Incarnation(incarnation),
            child,
            stdin,
            lines,
            unanswered: false,
            generation,
        })
    }

    /// Sends one stdin command and returns its answer (what is printed meanwhile — a
    /// notification — is skipped).
    ///
    /// # Errors
    /// When the target answers `error:`, or not within [`BOUND`].
    fn command(&mut self, command: &str) -> Result<String> {
        if self.unanswered {
            bail!("not sending {command:?}: an earlier command went unanswered");
        }
        writeln!(self.stdin, "{command}").with_context(|| format!("sending {command:?}"))?;
        let deadline = Instant::now() + BOUND;
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = self.lines.recv_timeout(wait) else {
                self.unanswered = true;
                bail!("no answer to {command:?} within {BOUND:?}");
            };
            if let Some(why) = line.strip_prefix("error: ") {
                bail!("{command:?} failed: {why}");
            }
            if ["region ", "deregistered ", "digest ", "stats "]
                .iter()
                .any(|answer| line.starts_with(answer))
            {
                return Ok(line);
            }
        }
    }

    /// Allocates a region of `len` bytes in the target.
    pub(crate) fn alloc(&mut self, len: u64) -> Result<RemoteRegion> {
        region(&self.command(&format!("alloc {len}"))?)
    }

    /// Registers region `id` anew (new keys, old ones withdrawn; same memory).
    pub(crate) fn reregister(&mut self, id: u64) -> Result<RemoteRegion> {
        region(&self.command(&format!("reregister {id}"))?)
    }

    /// Deregisters region `id` (and frees it).
    pub(crate) fn deregister(&mut self, id: u64) -> Result<()> {
        self.command(&format!("deregister {id}")).map(drop)
    }

    /// The target's control-plane counter `name` (`stats` command).
    pub(crate) fn stat(&mut self, name: &str) -> Result<u64> {
        let answer = self.command("stats")?;
        answer
            .split_whitespace()
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .and_then(|value| value.parse().ok())
            .with_context(|| format!("no {name} in {answer:?}"))
    }

    /// Digests ([`super::digest`]) of `len` bytes at `offset` in region `id`, one per
    /// `chunk` bytes.
    pub(crate) fn digests(
        &mut self,
        id: u64,
        offset: u64,
        len: u64,
        chunk: u64,
    ) -> Result<Vec<u64>> {
        let answer = self.command(&format!("digest {id} {offset} {len} {chunk}"))?;
        answer
            .split_whitespace()
            .skip(1)
            .map(|word| u64::from_str_radix(word, 16).context("a digest in hex"))
            .collect()
    }

    /// Sends `signal` to it.
    pub(crate) fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid, alive until it is waited for.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
    }
}

/// Makes `command`'s child die (SIGKILL) with its parent, even when stopped: no orphan
/// keeps a port, memory or a data directory. The kernel sends the signal when the *thread*
/// that spawned the child ends, so spawn from one that lives as long as the child should
/// (the scenarios and the soak spawn from their main thread). A parent that died before
/// the child could ask is caught too: the child then does not start.
pub(crate) fn die_with_parent(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2)
    // and getppid(2), plain system calls; it allocates nothing and touches no memory of the
    // parent.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // Waited for already (killed): its pid may belong to another process by now.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        self.signal(libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(word: &str) -> Option<u64> {
    u64::from_str_radix(word.trim_start_matches("0x"), 16).ok()
}

/// Parses `region ID 0xADDR LEN`.
fn region(answer: &str) -> Result<RemoteRegion> {
    let words: Vec<&str> = answer.split_whitespace().collect();
    match (words.get(1), words.get(2), words.get(3)) {
        (Some(id), Some(addr), Some(len)) => id
            .parse()
            .ok()
            .zip(hex(addr))
            .filter(|_| len.parse::<u64>().is_ok())
            .map(|(id, addr)| RemoteRegion { id, addr }),
        _ => None,
    }
    .with_context(|| format!("unexpected answer {answer:?}"))
}
