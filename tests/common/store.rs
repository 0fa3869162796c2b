//! Helpers for the store's tests with real processes: `railyard` children (a master,
//! segment servers), `railyard store` command processes, values derived from their keys, and
//! an in-process client.

use std::num::NonZeroUsize;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use railyard::dataplane::IdleStrategy;
use railyard::engine::{Engine, FabricChoice, RailChoice};
use railyard::store::{Store, StoreOptions};

pub const BOUND: Duration = Duration::from_secs(20);

/// A `railyard` child that prints its address first and exits when its stdin closes;
/// killed when dropped.
pub struct Process {
    pub child: Child,
    stdin: Option<ChildStdin>,
    /// Its first line, by words (`listening ADDR …`).
    pub first: Vec<String>,
    _lines: Receiver<String>,
}

impl Process {
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// [`Self::start`] with `env` set for the child.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
            .env_remove("RAILYARD_SECRET_FILE")
            .envs(env.iter().copied())
            .args(args)
            .arg("--until-stdin-closes")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("railyard starts");
        let stdin = child.stdin.take();
        let lines = super::lines_of(child.stdout.take().expect("piped"));
        let first = lines
            .recv_timeout(BOUND)
            .expect("it prints where it listens")
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>();
        assert_eq!(first[0], "listening", "{first:?}");
        Self {
            child,
            stdin,
            first,
            _lines: lines,
        }
    }

    pub fn addr(&self) -> &str {
        &self.first[1]
    }

    /// Closes its stdin and waits (bounded) for it to exit; returns whether it succeeded.
    pub fn stop(mut self) -> bool {
        drop(self.stdin.take());
        let deadline = Instant::now() + BOUND;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `railyard store ARGS --master MASTER --fabric soft`.
pub fn store_command(master: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .env_remove("RAILYARD_SECRET_FILE")
        .arg("store")
        .args(args)
        .args(["--master", master, "--fabric", "soft"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("railyard store starts");
    if let Some(bytes) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(bytes)
            .expect("stdin takes the value");
    }
    drop(child.stdin.take());
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<_>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<_>));
    let end = Instant::now() + BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waitable") {
            break status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("railyard store {args:?} still running after {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().expect("the reader ends with the child"),
        stderr: stderr.join().expect("the reader ends with the child"),
    }
}

/// A value whose every byte depends on its key and position.
pub fn value_of(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..len)
        .map(|i| {
            (seed
                .wrapping_add(i as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                >> 56) as u8
        })
        .collect()
}

pub fn client(master: &str) -> (Engine, Store) {
    let engine = Engine::builder("store-test-client")
        .fabric(FabricChoice::Soft)
        .rails(RailChoice::Count(NonZeroUsize::MIN))
        .idle(IdleStrategy::gentle())
        .build()
        .expect("the engine starts");
    let store = Store::connect(
        &engine,
        StoreOptions {
            staging: 8 << 20,
            ..StoreOptions::new(master)
        },
    )
    .expect("connects to the master");
    (engine, store)
}
