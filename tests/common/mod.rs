//! Helpers shared by the integration tests that run a `railyard serve` child.

#![allow(dead_code, unreachable_pub)]

pub mod mapped;
pub mod stalling;
pub mod store;
pub mod tagged;

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use railyard::dataplane::RequestOutcome;
use railyard::engine::{Op, Region, Transfer};

pub const BOUND: Duration = Duration::from_secs(10);

/// The lines `stdout` prints, as they come (a thread reads them until it closes).
pub fn lines_of(stdout: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// Stops `child` (SIGSTOP: no reset, its sockets stay open) and returns once it is stopped.
pub fn signal_stop(child: &Child) {
    // SAFETY: kill(2) on our own child's pid, not reaped while `child` is borrowed.
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) };
    assert_eq!(sent, 0, "kill(SIGSTOP)");
    wait_until_stopped(child.id());
}

/// Lets a stopped `child` run again.
pub fn signal_continue(child: &Child) {
    // SAFETY: kill(2) on our own child's pid, not reaped while `child` is borrowed.
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGCONT) };
    assert_eq!(sent, 0, "kill(SIGCONT)");
}

/// Waits (within [`BOUND`]) until the kernel reports process `pid` stopped (state `T` in
/// `/proc/PID/stat`, the field after the parenthesised command name).
pub fn wait_until_stopped(pid: u32) {
    let deadline = Instant::now() + BOUND;
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        if state == Some('T') {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process {pid} not stopped after {BOUND:?}: state {state:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A `railyard serve` child; killed when dropped.
pub struct Serve {
    pub child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    pub addr: String,
    /// As printed (the incarnation's display form).
    pub incarnation: String,
    pub pool_base: u64,
    pub pool_len: u64,
    /// The pool's region id (for stdin commands).
    pub pool_id: u64,
    /// Where its metrics are served (with `--metrics`).
    pub metrics: Option<String>,
}

impl Serve {
    pub fn start(pool: &str) -> Self {
        Self::start_with(pool, &["--rails", "1"])
    }

    pub fn start_with(pool: &str, extra: &[&str]) -> Self {
        Self::start_named("decode-test", pool, extra)
    }

    pub fn start_named(name: &str, pool: &str, extra: &[&str]) -> Self {
        let mut options = vec!["--pool", pool, "--name", name];
        options.extend_from_slice(extra);
        Self::spawn(Command::new(env!("CARGO_BIN_EXE_railyard")), &options)
    }

    /// `railyard serve` (one rail) that may hold at most `descriptors` open files.
    pub fn start_with_descriptor_limit(descriptors: u32, pool: &str) -> Self {
        let mut shell = Command::new("sh");
        shell
            .arg("-c")
            .arg(format!("ulimit -n {descriptors} && exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_railyard"));
        Self::spawn(
            shell,
            &["--pool", pool, "--name", "limited", "--rails", "1"],
        )
    }

    /// Runs `command` with `serve` and `options` appended: the binary, or a shell that
    /// execs it.
    fn spawn(mut command: Command, options: &[&str]) -> Self {
        // A cluster secret in the environment is the test's to give, not the caller's.
        let mut child = command
            .env_remove("RAILYARD_SECRET_FILE")
            .env_remove("RAILYARD_ENCRYPT_CONTROL")
            .args(["serve", "--listen", "127.0.0.1:0", "--until-stdin-closes"])
            .args(options)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("railyard serve starts");
        let stdin = child.stdin.take().expect("piped");
        let lines = lines_of(child.stdout.take().expect("piped"));
        let first = lines
            .recv_timeout(BOUND)
            .expect("serve prints where it listens");
        // listening ADDR incarnation INC pool 0xBASE LEN region ID [metrics ADDR]
        let words: Vec<&str> = first.split_whitespace().collect();
        assert_eq!(
            (words[0], words[2], words[4], words[7]),
            ("listening", "incarnation", "pool", "region")
        );
        Self {
            addr: words[1].to_string(),
            incarnation: words[3].to_string(),
            pool_base: u64::from_str_radix(words[5].trim_start_matches("0x"), 16)
                .expect("a hex pool address"),
            pool_len: words[6].parse().expect("a pool length"),
            pool_id: words[8].parse().expect("a region id"),
            metrics: match words.get(9..) {
                Some(["metrics", addr]) => Some(addr.to_string()),
                Some([]) => None,
                rest => panic!("after the region: {rest:?}"),
            },
            child,
            stdin,
            lines,
        }
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, SIGKILL…) to the child. For SIGSTOP it returns
    /// once the child is stopped: kill(2) returns before the signal is delivered, and a
    /// child still running on another core would complete what the test submits next.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid, alive (not reaped) until `self` drops.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "kill({signal})");
        if signal == libc::SIGSTOP {
            wait_until_stopped(self.child.id());
        }
    }

    /// Sends one stdin command; returns its one-line answer (skipping what serve prints
    /// meanwhile: its banner, notifications).
    pub fn command(&mut self, command: &str) -> String {
        self.command_bytes(command.as_bytes())
    }

    /// [`Self::command`] with bytes that need not be UTF-8.
    pub fn command_bytes(&mut self, command: &[u8]) -> String {
        use std::io::Write as _;
        self.stdin
            .write_all(command)
            .and_then(|()| self.stdin.write_all(b"\n"))
            .expect("serve reads its stdin");
        let answers = ["region ", "deregistered ", "digest ", "stats ", "error: "];
        loop {
            let line = self.lines.recv_timeout(BOUND).expect("serve answers");
            if answers.iter().any(|answer| line.starts_with(answer)) {
                return line;
            }
        }
    }

    /// Waits (bounded) for an output line containing `needle`.
    pub fn expect_line(&self, needle: &str) -> String {
        let end = Instant::now() + BOUND;
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("serve never printed {needle:?}");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An address that refuses every connection for as long as the returned socket lives: the
/// socket holds the port (bound, never listening), so no engine of a test running beside
/// this one can be given it, as it could a port that was bound and let go.
pub fn refusing_address() -> (socket2::Socket, std::net::SocketAddr) {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().expect("an address");
    socket.bind(&loopback.into()).expect("binds a free port");
    let addr = socket
        .local_addr()
        .ok()
        .and_then(|addr| addr.as_socket())
        .expect("an IPv4 address");
    (socket, addr)
}

/// The resident memory of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process runs");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("a VmRSS line")
}

pub fn bytes_of(region: Region) -> &'static mut [u8] {
    // SAFETY: the tests touch a region only while no transfer of it is in flight, and the
    // engine (which frees it) outlives every use.
    unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, region.len as usize) }
}

/// The READs that bring `writes`' remote ranges back into `into`, at the same offsets.
pub fn read_back(writes: &[Transfer], into: Region) -> Vec<Transfer> {
    writes
        .iter()
        .map(|w| Transfer {
            op: Op::Read,
            local: into,
            ..*w
        })
        .collect()
}

pub fn done(batch: &railyard::dataplane::Batch) -> bool {
    batch.wait(Instant::now() + BOUND);
    batch
        .outcomes()
        .iter()
        .all(|o| *o == Some(RequestOutcome::Done))
}

/// A one-rail `railyard serve` on the TCP fabric, an engine on TCP with `policy` connected
/// to it, and a 1 MiB write of its pool from the engine's memory, done once.
pub struct TcpPair {
    pub target: Serve,
    pub engine: railyard::engine::Engine,
    pub peer: railyard::engine::Peer,
    pub submitter: railyard::engine::EngineSubmitter,
    pub write: Transfer,
}

impl TcpPair {
    pub fn start(policy: railyard::control::Policy) -> Self {
        use railyard::engine::{Engine, FabricChoice, RailChoice};
        let target = Serve::start_with("8MiB", &["--rails", "1", "--fabric", "tcp"]);
        let engine = Engine::builder("prefill")
            .fabric(FabricChoice::Tcp)
            .rails(RailChoice::Count(std::num::NonZeroUsize::MIN))
            .idle(railyard::dataplane::IdleStrategy::gentle())
            .policy(policy)
            .build()
            .expect("the engine starts");
        let peer = engine.open(&target.addr).expect("the target answers");
        let source = engine.alloc(1 << 20, None).expect("memory");
        let write = Transfer {
            op: Op::Write,
            local: source,
            local_offset: 0,
            remote_addr: target.pool_base,
            len: 1 << 20,
        };
        let mut submitter = engine.submitter().expect("a submitter");
        let batch = submitter.submit(&peer, &[write]).expect("submitted");
        assert!(done(&batch), "the first write");
        Self {
            target,
            engine,
            peer,
            submitter,
            write,
        }
    }
}

/// Runs `command` and returns its output (stdout and stderr), killing it and failing the
/// test if it has not exited within `bound`.
pub fn output_within(command: &mut Command, bound: Duration) -> std::process::Output {
    use std::io::Read as _;
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped")));
    let end = Instant::now() + bound;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waitable") {
            break status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {bound:?}: {command:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    std::process::Output {
        status,
        stdout: stdout.join().expect("the reader ends with the child"),
        stderr: stderr.join().expect("the reader ends with the child"),
    }
}
