//! Soft-fabric bandwidth between two processes through one rail, beside its ceilings.
//!
//! `cargo run --release --example soft_bandwidth -- [--json] [--seconds S]`
//!
//! The example re-executes itself as the target process, which registers two 64 MiB
//! windows behind a handshake listener: one of user memory (a `Vec`, reached with
//! `process_vm_writev`) and one engine-allocated (`SoftDevice::alloc`, which the initiator
//! maps and copies into directly). For 4 KiB, 64 KiB and 1 MiB blocks it measures, in the
//! same run and over the same offsets (each window block after block):
//! - `gbps`: WRITEs through the whole engine path — a `Submitter`, one poller running the soft
//!   fabric, the bytes into the target's engine-allocated window, completions back into a
//!   `Batch` — and `ceiling_gbps`: single-thread memcpy of the same blocks within one
//!   process, what that path does at its core; `ratio` = `gbps / ceiling_gbps`;
//! - `user_memory_gbps`: the same engine path into the target's user-memory window, and
//!   `process_vm_gbps`: a bare `process_vm_writev` loop of the same blocks, its ceiling;
//!   `user_memory_ratio` = `user_memory_gbps / process_vm_gbps`.
//!
//! Each figure is the best of three alternating trials. With `--json` it prints
//! `{"results": [{"block", "gbps", "ceiling_gbps", "ratio", "user_memory_gbps",
//! "process_vm_gbps", "user_memory_ratio"}, ...]}`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command as Process, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use railyard::dataplane::fabric::soft::{SoftConfig, SoftDevice, handshake};
use railyard::dataplane::fabric::{Access, MemoryRegion, Opcode};
use railyard::dataplane::{
    Command, EndpointId, Epoch, FailStale, IdleStrategy, PollerConfig, PollerHandle, SliceSpec,
    Submitter,
};

const WINDOW: usize = 64 << 20;
const BLOCKS: [usize; 3] = [4 << 10, 64 << 10, 1 << 20];
const TRIALS: usize = 3;
const TARGET_ENV: &str = "RAILYARD_SOFT_BANDWIDTH_TARGET";

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("soft_bandwidth: error: {error:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run() -> Result<()> {
    if let Ok(socket) = std::env::var(TARGET_ENV) {
        return target(&socket);
    }
    let mut json = false;
    let mut seconds = 0.3f64;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--seconds" => {
                seconds = args
                    .next()
                    .context("--seconds needs a value")?
                    .parse()
                    .context("--seconds takes a number")?;
            }
            other => bail!("unknown argument {other:?} (expected --json, --seconds S)"),
        }
    }
    let results = initiator(Duration::from_secs_f64(seconds))?;
    if json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "block": r.block,
                    "gbps": round(r.engine_memory),
                    "ceiling_gbps": round(r.memcpy),
                    "ratio": round(r.engine_memory / r.memcpy),
                    "user_memory_gbps": round(r.user_memory),
                    "process_vm_gbps": round(r.process_vm),
                    "user_memory_ratio": round(r.user_memory / r.process_vm),
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "results": rows }));
    } else {
        println!("            engine memory (mapped)          user memory (process_vm_writev)");
        println!("  block   engine GB/s  memcpy GB/s  ratio   engine GB/s  bare GB/s  ratio");
        for r in &results {
            println!(
                "{:>7}   {:>11.2}  {:>11.2}  {:>5.2}   {:>11.2}  {:>9.2}  {:>5.2}",
                r.block,
                r.engine_memory,
                r.memcpy,
                r.engine_memory / r.memcpy,
                r.user_memory,
                r.process_vm,
                r.user_memory / r.process_vm
            );
        }
    }
    Ok(())
}

fn round(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// A page-touched buffer of `len` bytes.
fn buffer(len: usize, fill: u8) -> Vec<u8> {
    vec![fill; len]
}

fn register(device: &SoftDevice, bytes: &mut [u8], access: Access) -> Result<MemoryRegion> {
    // SAFETY:
    // - Every buffer registered here lives until the end of its function, after the device,
    //   the poller and the target process using it are gone.
    Ok(unsafe { device.register(bytes.as_mut_ptr(), bytes.len(), access) }?)
}

/// The target: registers two windows, accepts one queue pair, waits for stdin to close.
fn target(socket: &str) -> Result<()> {
    let device = SoftDevice::open("target0", SoftConfig::default())?;
    let mut user = buffer(WINDOW, 1);
    let user = register(&device, &mut user, Access::ALL)?;
    let mut engine = device.alloc(WINDOW, Access::ALL)?;
    // SAFETY:
    // - No transfer runs yet; this touches every page before the measurements.
    unsafe { engine.as_mut_slice() }.fill(1);
    let engine = engine.region();
    let listener = handshake::SoftListener::bind(&device, socket)?;
    println!(
        "ready {} {} {} {}",
        user.addr, user.rkey, engine.addr, engine.rkey
    );
    std::io::stdout().flush()?;
    let _qp = listener.accept(Access::ALL)?;
    // The initiator closes our stdin when it is done.
    let _ = std::io::stdin().lock().lines().count();
    Ok(())
}

/// GB/s of one block size.
struct Row {
    block: usize,
    /// Engine path into the engine-allocated window.
    engine_memory: f64,
    /// Single-thread memcpy.
    memcpy: f64,
    /// Engine path into the user-memory window.
    user_memory: f64,
    /// Bare process_vm_writev.
    process_vm: f64,
}

fn gbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

/// Repeats `pass` (which moves `WINDOW` bytes) for at least `span`; returns GB/s.
fn measure(span: Duration, mut pass: impl FnMut() -> Result<()>) -> Result<f64> {
    pass()?; // warm-up
    let start = Instant::now();
    let mut moved = 0;
    while start.elapsed() < span {
        pass()?;
        moved += WINDOW;
    }
    Ok(gbps(moved, start.elapsed()))
}

fn initiator(span: Duration) -> Result<Vec<Row>> {
    let socket = std::env::temp_dir().join(format!("railyard-bw-{}.sock", std::process::id()));
    let mut child = TargetProcess(
        Process::new(std::env::current_exe()?)
            .env(TARGET_ENV, &socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the target process")?,
    );
    let child = &mut child.0;
    let mut ready = String::new();
    BufReader::new(child.stdout.take().context("piped stdout")?).read_line(&mut ready)?;
    let fields: Vec<&str> = ready.split_whitespace().collect();
    let (user_window, engine_window): ((u64, u32), (u64, u32)) = match fields.as_slice() {
        ["ready", user_addr, user_rkey, engine_addr, engine_rkey] => (
            (user_addr.parse()?, user_rkey.parse()?),
            (engine_addr.parse()?, engine_rkey.parse()?),
        ),
        _ => bail!("the target did not start: {ready:?}"),
    };
    let target_pid = child.id() as libc::pid_t;

    let device = SoftDevice::open("rail0", SoftConfig::default())?;
    let mut source = buffer(WINDOW, 7);
    let mut local_copy = buffer(WINDOW, 2);
    let source_region = register(&device, &mut source, Access::LOCAL_WRITE)?;
    let qp = handshake::dial(&device, &socket, Access::ALL)?;
    let endpoint = EndpointId(0);
    device.stage(endpoint, Epoch::FIRST, qp)?;
    let config = PollerConfig {
        idle: IdleStrategy::SpinThenYield { spins: 1 << 16 },
        max_batch: 64,
        ..PollerConfig::new("rail0")
    };
    let poller = PollerHandle::spawn(config, device.fabric(), FailStale)?;
    poller.send(Command::AddEndpoint {
        endpoint,
        epoch: Epoch::FIRST,
    })?;
    let mut submitter = Submitter::new(&[&poller], 4096)?;

    let mut rows = Vec::new();
    for block in BLOCKS {
        let offsets: Vec<usize> = (0..WINDOW / block).map(|i| i * block).collect();
        let writes_into = |(addr, rkey): (u64, u32)| -> Vec<SliceSpec> {
            offsets
                .iter()
                .map(|&offset| SliceSpec {
                    rail: 0,
                    request: 0,
                    opcode: Opcode::Write,
                    local_addr: source_region.addr + offset as u64,
                    lkey: source_region.lkey,
                    remote_addr: addr + offset as u64,
                    rkey,
                    len: block as u32,
                    imm: 0,
                    endpoint,
                    epoch: Epoch::FIRST,
                    generation: 0,
                })
                .collect()
        };
        let (into_engine, into_user) = (writes_into(engine_window), writes_into(user_window));
        let mut engine_pass = |specs: &[SliceSpec]| -> Result<()> {
            let batch = submitter.submit(1, specs, Instant::now() + Duration::from_secs(10))?;
            let status = batch.wait(Instant::now() + Duration::from_secs(10));
            if !status.is_complete() || status.failed > 0 {
                bail!("a transfer failed: {status:?} ({:?})", batch.outcome(0));
            }
            Ok(())
        };
        let process_vm_pass = || -> Result<()> {
            for &offset in &offsets {
                process_vm_write(
                    target_pid,
                    source_region.addr as usize + offset,
                    user_window.0 as usize + offset,
                    block,
                )?;
            }
            Ok(())
        };
        let mut memcpy_pass = || -> Result<()> {
            for &offset in &offsets {
                local_copy[offset..offset + block].copy_from_slice(&source[offset..offset + block]);
            }
            std::hint::black_box(&local_copy);
            Ok(())
        };
        let mut row = Row {
            block,
            engine_memory: 0.0,
            memcpy: 0.0,
            user_memory: 0.0,
            process_vm: 0.0,
        };
        for _ in 0..TRIALS {
            row.memcpy = row.memcpy.max(measure(span, &mut memcpy_pass)?);
            row.engine_memory = row
                .engine_memory
                .max(measure(span, || engine_pass(&into_engine))?);
            row.process_vm = row.process_vm.max(measure(span, process_vm_pass)?);
            row.user_memory = row
                .user_memory
                .max(measure(span, || engine_pass(&into_user))?);
        }
        rows.push(row);
    }
    let counters = poller.counters();
    poller.shutdown();
    drop(child.stdin.take());
    let _ = child.wait();
    if counters.failed_total() > 0 {
        bail!("{} slices failed", counters.failed_total());
    }
    Ok(rows)
}

/// The target process, killed if the initiator stops early (it would wait for a handshake).
struct TargetProcess(std::process::Child);

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One bare `process_vm_writev` of `len` bytes: the ceiling's inner loop.
fn process_vm_write(pid: libc::pid_t, local: usize, remote: usize, len: usize) -> Result<()> {
    let local_iov = libc::iovec {
        iov_base: local as *mut libc::c_void,
        iov_len: len,
    };
    let remote_iov = libc::iovec {
        iov_base: remote as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY:
    // - The kernel checks both ranges and reports faults as errors; the local range is
    //   inside `source`, which outlives every call.
    let written = unsafe { libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0) };
    if written != len as isize {
        bail!(
            "process_vm_writev wrote {written} of {len} bytes: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}
