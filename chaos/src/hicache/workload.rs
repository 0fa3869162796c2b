//! One client process of the `hicache` scenario (`railyard store chaos-client`): the calls
//! an SGLang HiCache tier makes of its store — `batch_put_from` of new KV blocks with two
//! replicas (best effort), `batch_exists` before a lookup, `batch_get_into` of blocks it
//! wrote — in a loop, each value's bytes derived from its key so every byte read is
//! checked. It prints one JSON [`Event`] per call on stdout for the driver to judge, and
//! takes commands on stdin: `burst MS` (transfer errors on its first rail of two for that
//! long) and `stop` (remove every key it ever tried to write, print [`Event::Done`], exit).

use std::io::{BufRead, Write};
use std::num::NonZeroUsize;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use railyard_engine::dataplane::IdleStrategy;
use railyard_engine::dataplane::fabric::WcStatus;
use railyard_engine::dataplane::fabric::soft::{Fault, QpMatch};
use railyard_engine::dataplane::rng::SplitMix64;
use railyard_engine::{ClusterSecret, Engine, FabricChoice, RailChoice, Region};
use railyard_store::{LocalRange, ReplicaConfig, Store, StoreError, StoreOptions};
use serde::{Deserialize, Serialize};

use crate::pattern::{digest, fill_pattern};

/// Keys per batch call.
pub(crate) const BATCH: usize = 4;
/// The smallest value, and the step between sizes.
const SIZE_STEP: u64 = 64 << 10;
/// The largest value (1 MiB).
pub(crate) const MAX_VALUE: u64 = 16 * SIZE_STEP;
/// Keys a client keeps: the oldest are removed beyond it, so the segments never fill up and
/// nothing is evicted (a key the scenario expects to read is never gone for that reason).
const KEPT: usize = 40;
/// A pause between rounds of calls: a serving stack's load comes in requests, not flat out,
/// and the scenario's processes share the host's cores.
const PACE: Duration = Duration::from_millis(20);
/// The least time between two batches of writes. A key removed while a read lease on it
/// lasts keeps its space until the lease ends (5 s): writing faster would fill the segments
/// with removed keys and fail writes with `NoSpace`.
const WRITE_EVERY: Duration = Duration::from_millis(250);
/// A client's rails: a burst of errors on one leaves the other.
const RAILS: NonZeroUsize = NonZeroUsize::new(2).expect("2 > 0");
/// Each call's bound (the store's timeout).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A holder of a replica, as the master named it right after the write.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Holder {
    /// Its engine's handshake address.
    pub(crate) addr: String,
    /// Its engine's incarnation.
    pub(crate) incarnation: u64,
}

/// A key a call failed for (or, for `batch_exists`, answered absent).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Failure {
    pub(crate) key: String,
    /// The error's kind (or "Absent").
    pub(crate) kind: String,
    /// The error in words.
    pub(crate) error: String,
    /// Where its replicas were written.
    pub(crate) holders: Vec<Holder>,
}

/// What a client did, one line each; times in milliseconds since the Unix epoch (the
/// driver runs on the same host).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Event {
    /// Set up; writing from now on.
    Ready { at: u64 },
    /// One `batch_put_from`.
    Put {
        start: u64,
        end: u64,
        ok: u32,
        failed: u32,
        /// Keys written with one replica (best effort: one segment took it).
        fewer: u32,
        bytes: u64,
        /// The errors' kinds, one per failed key.
        errors: Vec<String>,
    },
    /// One `batch_get_into` of keys this client wrote.
    Get {
        start: u64,
        end: u64,
        ok: u32,
        bytes: u64,
        /// Bytes read that differ from what was written.
        wrong_bytes: u64,
        failures: Vec<Failure>,
    },
    /// One `batch_exists` of keys this client wrote.
    Exists {
        start: u64,
        end: u64,
        absent: Vec<Failure>,
    },
    /// Transfer errors on this client's rail from `start` to `end`.
    Burst { start: u64, end: u64 },
    /// Stopped: every key tried was removed (or was not there).
    Done { removed: u64, remove_failed: u64 },
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// The size of `key`'s value: 64 KiB to 1 MiB, from the key.
pub(crate) fn size_of(key: &str) -> u64 {
    SIZE_STEP * (1 + digest(key.as_bytes()) % (MAX_VALUE / SIZE_STEP))
}

/// Fills `bytes` with `key`'s value.
pub(crate) fn value_of(key: &str, bytes: &mut [u8]) {
    fill_pattern(bytes, digest(key.as_bytes()));
}

/// Memory this process owns and registers with its engine: the values written from and
/// the buffer read into.
struct Buffer {
    memory: Box<[u8]>,
}

impl Buffer {
    fn new(len: usize) -> Self {
        Self {
            memory: vec![0u8; len].into_boxed_slice(),
        }
    }
}

/// A client process's workload, proving `secret` to its peers: runs until `stop` arrives
/// on stdin (or stdin closes).
///
/// # Errors
/// When the engine or the store cannot be set up.
pub fn run_client(
    master: &str,
    name: &str,
    seed: u64,
    secret: Option<ClusterSecret>,
) -> Result<()> {
    let mut builder = Engine::builder(name);
    if let Some(secret) = &secret {
        builder = builder.secret(secret.clone());
    }
    let engine = builder
        .listen("127.0.0.1:0".parse()?)
        .fabric(FabricChoice::Tcp)
        .rails(RailChoice::Count(RAILS))
        .idle(IdleStrategy::gentle())
        .build()
        .context("starting the client's engine")?;
    let store = Store::connect(
        &engine,
        StoreOptions {
            secret,
            timeout: CALL_TIMEOUT,
            staging: 1 << 20,
            ..StoreOptions::new(master)
        },
    )
    .context("connecting to the store")?;
    let slots = BATCH * MAX_VALUE as usize;
    let mut source = Buffer::new(slots);
    let mut sink = Buffer::new(slots);
    // SAFETY: both buffers live until the end of this function, after their deregistration
    // below; every store call that moves bytes in or out of them returns before this
    // function reads or writes them again, and the engine touches nothing of a call after
    // it returns.
    let (source_region, sink_region) = unsafe {
        (
            engine.register(source.memory.as_mut_ptr(), slots)?,
            engine.register(sink.memory.as_mut_ptr(), slots)?,
        )
    };
    let commands = commands_from_stdin();
    let mut out = std::io::stdout().lock();
    let mut emit = |event: &Event| -> Result<()> {
        writeln!(out, "{}", serde_json::to_string(event)?)?;
        out.flush()?;
        Ok(())
    };
    emit(&Event::Ready { at: now_ms() })?;
    let mut rng = SplitMix64::new(seed);
    // Keys written, oldest first, with their holders; every key ever tried.
    let mut written: Vec<(String, Vec<Holder>)> = Vec::new();
    let mut tried: Vec<String> = Vec::new();
    let mut next_key = 0u64;
    let mut burst_until: Option<Instant> = None;
    let mut last_write: Option<Instant> = None;
    loop {
        std::thread::sleep(PACE);
        match commands.try_recv() {
            Ok(Command::Stop) | Err(TryRecvError::Disconnected) => break,
            Ok(Command::Burst(length)) => {
                if let Some(faults) = engine.faults(0) {
                    faults.add(Fault::Random {
                        on: QpMatch::Any,
                        per_million: 200_000,
                        status: WcStatus::RetryExcErr,
                    });
                    burst_until = Some(Instant::now() + length);
                    let start = now_ms();
                    emit(&Event::Burst {
                        start,
                        end: start + length.as_millis() as u64,
                    })?;
                }
            }
            Err(TryRecvError::Empty) => {}
        }
        if burst_until.is_some_and(|until| Instant::now() >= until) {
            if let Some(faults) = engine.faults(0) {
                faults.clear();
            }
            burst_until = None;
        }

        if last_write.is_none_or(|last| last.elapsed() >= WRITE_EVERY) {
            last_write = Some(Instant::now());
            let keys: Vec<String> = (0..BATCH)
                .map(|_| {
                    next_key += 1;
                    format!("{name}/block-{next_key}")
                })
                .collect();
            tried.extend(keys.iter().cloned());
            write_batch(
                &store,
                &keys,
                &mut source,
                source_region,
                &mut written,
                &mut emit,
            )?;
        }
        if !written.is_empty() {
            read_some(
                &store,
                &mut rng,
                &written,
                &mut sink,
                sink_region,
                &mut emit,
            )?;
        }
    }
    if let Some(faults) = engine.faults(0) {
        faults.clear();
    }
    let (mut removed, mut remove_failed) = (0, 0);
    for chunk in tried.chunks(64) {
        for result in store.batch_remove(chunk, true) {
            match result {
                Ok(()) => removed += 1,
                Err(error) if error.kind == railyard_store::StoreErrorKind::NotFound => {}
                Err(_) => remove_failed += 1,
            }
        }
    }
    engine.deregister(source_region)?;
    engine.deregister(sink_region)?;
    emit(&Event::Done {
        removed,
        remove_failed,
    })?;
    drop(store);
    drop((source, sink));
    Ok(())
}

/// One `batch_put_from` of `keys` (two replicas each), their values written into `source`
/// first; the keys written join `written` with their holders, and the oldest beyond
/// [`KEPT`] are removed.
fn write_batch(
    store: &Store,
    keys: &[String],
    source: &mut Buffer,
    source_region: Region,
    written: &mut Vec<(String, Vec<Holder>)>,
    emit: &mut impl FnMut(&Event) -> Result<()>,
) -> Result<()> {
    // As a HiCache tier on Mooncake Store: two replicas where two segments take them.
    let two = ReplicaConfig {
        replica_num: 2,
        best_effort: true,
        ..ReplicaConfig::default()
    };
    let ranges: Vec<LocalRange> = keys
        .iter()
        .enumerate()
        .map(|(slot, key)| {
            let offset = slot as u64 * MAX_VALUE;
            let len = size_of(key);
            let at = offset as usize;
            value_of(key, &mut source.memory[at..at + len as usize]);
            LocalRange {
                region: source_region,
                offset,
                len,
            }
        })
        .collect();
    let start = now_ms();
    let results = store.batch_put_from_counted(keys, &ranges, &two);
    let end = now_ms();
    let mut errors = Vec::new();
    let (mut bytes, mut fewer) = (0, 0);
    for ((key, range), result) in keys.iter().zip(&ranges).zip(results) {
        match result {
            Ok(replicas) => {
                bytes += range.len;
                fewer += u32::from(replicas < two.replica_num);
                // Read back only keys whose holders are known: the judge needs them.
                let holders = holders_of(store, key);
                if !holders.is_empty() {
                    written.push((key.clone(), holders));
                }
            }
            Err(error) => errors.push(kind_of(&error)),
        }
    }
    emit(&Event::Put {
        start,
        end,
        ok: (keys.len() - errors.len()) as u32,
        failed: errors.len() as u32,
        fewer,
        bytes,
        errors,
    })?;
    if written.len() > KEPT {
        let old: Vec<String> = written
            .drain(..written.len() - KEPT)
            .map(|(key, _)| key)
            .collect();
        let _ = store.batch_remove(&old, true);
    }
    Ok(())
}

/// One `batch_exists` and one `batch_get_into` of keys picked from `written`, every byte
/// read checked against its key.
fn read_some(
    store: &Store,
    rng: &mut SplitMix64,
    written: &[(String, Vec<Holder>)],
    sink: &mut Buffer,
    sink_region: Region,
    emit: &mut impl FnMut(&Event) -> Result<()>,
) -> Result<()> {
    // Look some up, then read them back.
    let picked: Vec<usize> = (0..BATCH)
        .map(|_| (rng.next_u64() % written.len() as u64) as usize)
        .collect();
    let picked_keys: Vec<&str> = picked.iter().map(|&i| written[i].0.as_str()).collect();
    let start = now_ms();
    let answers = store.batch_exists(&picked_keys);
    let end = now_ms();
    let absent = picked
        .iter()
        .zip(answers)
        .filter_map(|(&i, answer)| match answer {
            Ok(true) => None,
            Ok(false) => Some(failure(
                &written[i],
                "Absent".to_owned(),
                "absent".to_owned(),
            )),
            Err(error) => Some(failure(&written[i], kind_of(&error), error.to_string())),
        })
        .collect();
    emit(&Event::Exists { start, end, absent })?;

    let ranges: Vec<LocalRange> = (0..BATCH)
        .map(|slot| LocalRange {
            region: sink_region,
            offset: slot as u64 * MAX_VALUE,
            len: MAX_VALUE,
        })
        .collect();
    let start = now_ms();
    let results = store.batch_get_into(&picked_keys, &ranges);
    let end = now_ms();
    let (mut ok, mut bytes, mut wrong_bytes) = (0, 0, 0);
    let mut failures = Vec::new();
    let mut expected = vec![0u8; MAX_VALUE as usize];
    for ((slot, &i), result) in picked.iter().enumerate().zip(results) {
        let (key, _) = &written[i];
        match result {
            Ok(len) => {
                let at = slot * MAX_VALUE as usize;
                let read = &sink.memory[at..at + len as usize];
                let want = &mut expected[..size_of(key) as usize];
                value_of(key, want);
                wrong_bytes += differing_bytes(read, want);
                ok += 1;
                bytes += len;
            }
            Err(error) => {
                failures.push(failure(&written[i], kind_of(&error), error.to_string()));
            }
        }
    }
    emit(&Event::Get {
        start,
        end,
        ok,
        bytes,
        wrong_bytes,
        failures,
    })?;
    Ok(())
}

/// A failure of `entry`'s key.
fn failure(entry: &(String, Vec<Holder>), kind: String, error: String) -> Failure {
    Failure {
        key: entry.0.clone(),
        kind,
        error,
        holders: entry.1.clone(),
    }
}

/// The name of `error`'s kind (`NotFound`, `TransferFailed`, …).
fn kind_of(error: &StoreError) -> String {
    let debug = format!("{:?}", error.kind);
    debug
        .split(|c: char| !c.is_ascii_alphanumeric())
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Where `key`'s replicas are, as the master says (empty when it cannot say).
fn holders_of(store: &Store, key: &str) -> Vec<Holder> {
    store
        .replica_descriptors(key)
        .map(|replicas| {
            replicas
                .into_iter()
                .map(|replica| Holder {
                    addr: replica.handshake_addr,
                    incarnation: replica.holder.0,
                })
                .collect()
        })
        .unwrap_or_else(|_: StoreError| Vec::new())
}

/// How many bytes of `read` differ from `want` (a length difference counts too).
fn differing_bytes(read: &[u8], want: &[u8]) -> u64 {
    let differing = read.iter().zip(want).filter(|(a, b)| a != b).count();
    (differing + read.len().abs_diff(want.len())) as u64
}

/// A command from the driver.
enum Command {
    Burst(Duration),
    Stop,
}

/// Commands read from stdin by a thread of their own.
fn commands_from_stdin() -> Receiver<Command> {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            let mut words = line.split_whitespace();
            let command = match (words.next(), words.next().map(str::parse::<u64>)) {
                (Some("burst"), Some(Ok(ms))) => Command::Burst(Duration::from_millis(ms)),
                (Some("stop"), None) => Command::Stop,
                _ => continue,
            };
            if sender.send(command).is_err() {
                break;
            }
        }
    });
    receiver
}
