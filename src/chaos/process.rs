//! Target processes for the scenarios that need real ones: `railyard serve` children that
//! die with this process (even when stopped), and say where they listen.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};

/// Each target's pool.
const POOL: &str = "8MiB";

/// A `railyard serve` child; killed (and reaped) when dropped.
pub(crate) struct Target {
    pub(crate) child: Child,
    /// Closing it stops the child (`--until-stdin-closes`).
    _stdin: ChildStdin,
    pub(crate) addr: SocketAddr,
    pub(crate) pool_base: u64,
    /// Its incarnation, as printed.
    pub(crate) incarnation: String,
    /// Changes with every newcomer on a port (the soak's block patterns carry it).
    pub(crate) generation: u8,
}

impl Target {
    /// Starts `binary serve` named `name` on `listen` (one rail, an 8 MiB pool) and reads
    /// where it listens.
    ///
    /// # Errors
    /// When it does not start or say where it listens within 10 s.
    pub(crate) fn start(
        binary: &Path,
        name: &str,
        listen: SocketAddr,
        generation: u8,
    ) -> Result<Self> {
        let mut command = Command::new(binary);
        command
            .args(["serve", "--until-stdin-closes", "--rails", "1"])
            .args(["--pool", POOL, "--name", name])
            .args(["--listen", &listen.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // prctl(2), which is async-signal-safe; it touches no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                // Dies with the soak, even stopped: no orphan keeps a port or its memory.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
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
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = first_line.send(lines.next());
            // Drain the rest so the child never blocks on a full pipe.
            lines.for_each(drop);
        });
        let first = match first.recv_timeout(Duration::from_secs(10)) {
            Ok(Some(Ok(line))) => line,
            outcome => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("serve did not say where it listens: {outcome:?}");
            }
        };
        // listening ADDR incarnation INC pool 0xBASE LEN
        let words: Vec<&str> = first.split_whitespace().collect();
        let parsed = match (words.get(1), words.get(3), words.get(5)) {
            (Some(addr), Some(incarnation), Some(base)) => addr
                .parse::<SocketAddr>()
                .ok()
                .zip(u64::from_str_radix(base.trim_start_matches("0x"), 16).ok())
                .map(|(addr, base)| (addr, base, incarnation.to_string())),
            _ => None,
        };
        let Some((addr, pool_base, incarnation)) = parsed else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("unexpected first line from serve: {first:?}");
        };
        Ok(Self {
            addr,
            pool_base,
            incarnation,
            child,
            _stdin: stdin,
            generation,
        })
    }

    /// Sends `signal` to it.
    pub(crate) fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid, alive until it is waited for.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
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
