//! Helpers shared by the soft-fabric tests.

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use railyard_dataplane::fabric::soft::{SoftConfig, SoftDevice, SoftQp, handshake};
use railyard_dataplane::fabric::{
    Access, Fabric, MemoryRegion, Opcode, WorkCompletion, WorkRequest, WrId,
};

/// Every wait in these tests ends by this bound.
pub const BOUND: Duration = Duration::from_secs(10);

/// A socket path no other test (or test process) uses.
pub fn socket_path(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("railyard-{}-{tag}-{n}.sock", std::process::id()))
}

pub fn device(name: &str) -> SoftDevice {
    SoftDevice::open(name, SoftConfig::default()).expect("soft device opens")
}

/// Connects two new queue pairs of `device` to each other through a listener: returns
/// (dialer, acceptor). The acceptor lets the dialer do `access`.
pub fn loopback(device: &SoftDevice, access: Access) -> (SoftQp, SoftQp) {
    let listener =
        handshake::SoftListener::bind(device, socket_path("loop")).expect("listener binds");
    std::thread::scope(|scope| {
        let acceptor = scope.spawn(|| listener.accept(access));
        let dialer = handshake::dial(device, listener.path(), Access::ALL).expect("dial");
        let acceptor = acceptor.join().expect("no panic").expect("accept");
        (dialer, acceptor)
    })
}

/// A buffer registered with a device; the bytes outlive the registration.
pub struct Registered {
    pub bytes: Vec<u8>,
    pub region: MemoryRegion,
}

/// Registers `len` bytes filled with `fill`.
pub fn register(device: &SoftDevice, len: usize, fill: u8, access: Access) -> Box<Registered> {
    let mut registered = Box::new(Registered {
        bytes: vec![fill; len],
        region: MemoryRegion {
            addr: 0,
            len: 0,
            lkey: 0,
            rkey: 0,
            access,
        },
    });
    // SAFETY:
    // - The Vec's heap buffer does not move while the Box lives, and tests keep the Box
    //   alive until the device and every fabric using it are dropped.
    registered.region = unsafe { device.register(registered.bytes.as_mut_ptr(), len, access) }
        .expect("registration");
    registered
}

/// A work request with id `id`.
pub fn request(
    id: u64,
    opcode: Opcode,
    local: u64,
    lkey: u32,
    remote: u64,
    rkey: u32,
    len: u32,
) -> WorkRequest {
    WorkRequest {
        wr_id: WrId(id),
        opcode,
        local_addr: local,
        lkey,
        remote_addr: remote,
        rkey,
        len,
        imm: id as u32,
        signaled: true,
        epoch: railyard_dataplane::Epoch::FIRST,
    }
}

/// Polls until `count` completions arrived; fails the test after [`BOUND`].
pub fn drain(fabric: &mut impl Fabric, count: usize) -> Vec<WorkCompletion> {
    let end = Instant::now() + BOUND;
    let mut out = Vec::new();
    while out.len() < count {
        assert!(
            Instant::now() < end,
            "only {} of {count} completions within {BOUND:?}: {out:?}",
            out.len()
        );
        let missing = count - out.len();
        if fabric.poll(&mut out, missing) == 0 {
            std::thread::yield_now();
        }
    }
    out
}

/// Runs this test binary again as a target process: only the ignored test `entry`, with
/// `envs`. Returns the child, its stdin, and its answers: the text after `@` on each line
/// it prints (the harness may print "test NAME ... " first on the same line).
pub fn spawn_target_process(
    entry: &str,
    envs: &[(&str, &str)],
) -> (Child, ChildStdin, Receiver<String>) {
    let mut child = Command::new(std::env::current_exe().expect("own test binary"))
        .args([
            entry,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .envs(envs.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the target starts");
    let stdin = child.stdin.take().expect("piped");
    let stdout = child.stdout.take().expect("piped");
    let (sender, answers) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some((_, answer)) = line.split_once('@') {
                if sender.send(answer.to_string()).is_err() {
                    break;
                }
            }
        }
    });
    (child, stdin, answers)
}
