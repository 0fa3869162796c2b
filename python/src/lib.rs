//! `railyard._native`: the railyard engine for Python (see `railyard/_native.pyi` for the
//! documented API). Addresses are plain integers, as `tensor.data_ptr()` gives them; peers
//! are `"host:port"` session strings. Every call that waits (building an engine, opening a
//! peer, a transfer, waiting for notifications) releases the GIL.
//!
//! The Python `Engine` owns an `Arc` of the open engine; `close()` takes it out, and the
//! engine stops once the calls still running with their own `Arc` return.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use railyard_engine::control::NotificationBody;
use railyard_engine::control::wire::MAX_NOTIFY;
use railyard_engine::dataplane::FailReason;
use railyard_engine::dataplane::{Batch as NativeBatch, IdleStrategy, RequestOutcome};
use railyard_engine::{
    DirectoryChoice, Engine as NativeEngine, FabricChoice, MemoryError, Op, Peer, PeerAccess,
    RailChoice, RawTransfer, Region, SubmitterPool, TransferError as TransferError_, default_name,
};

create_exception!(
    railyard,
    TransferError,
    PyException,
    "A transfer failed or could not be queued. Attributes: peer, reason, index (the failed \
     request's index, or None), local_addr, remote_addr, length (None when not about one \
     range)."
);

/// How long `Batch.wait()` without a timeout waits past the batch's deadline (the poller
/// fails what is overdue at the deadline, and posted work once its flush comes back; this is
/// slack for a busy machine).
const RESOLVE_GRACE: Duration = Duration::from_secs(2);

/// How long one sleep of a synchronous call waiting for its batch to resolve lasts at most:
/// it wakes at once when the batch resolves, and only looks again after this.
const RESOLVE_STEP: Duration = Duration::from_secs(1);

/// What a transfer error names, turned into the Python exception's attributes.
#[derive(Default)]
struct Failure {
    peer: String,
    reason: String,
    index: Option<usize>,
    range: Option<(u64, u64, u64)>,
}

impl Failure {
    fn into_err(self) -> PyErr {
        Python::attach(|py| {
            let message = match (self.index, self.range) {
                (Some(index), Some((local, remote, len))) => format!(
                    "request {index} ({len} bytes, local {local:#x}, remote {remote:#x}) to \
                     {}: {}",
                    self.peer, self.reason
                ),
                _ if self.peer.is_empty() => self.reason.clone(),
                _ => format!("{}: {}", self.peer, self.reason),
            };
            let error = TransferError::new_err(message);
            let value = error.value(py);
            let (local, remote, len) = match self.range {
                Some((local, remote, len)) => (Some(local), Some(remote), Some(len)),
                None => (None, None, None),
            };
            // Setting attributes on a fresh exception instance cannot fail in practice;
            // if it did, the exception still carries its message.
            let _ = value.setattr("peer", self.peer);
            let _ = value.setattr("reason", self.reason);
            let _ = value.setattr("index", self.index);
            let _ = value.setattr("local_addr", local);
            let _ = value.setattr("remote_addr", remote);
            let _ = value.setattr("length", len);
            error
        })
    }
}

/// An open engine and what the binding keeps beside it.
struct Open {
    engine: NativeEngine,
    submitters: SubmitterPool,
    /// Regions `alloc` made, by address (`free` takes them back). A region stays here until
    /// its deregistration returned `Ok`, so a `free` refused with `Busy` (or a rail's
    /// refusal to withdraw it) can be retried.
    allocated: Mutex<HashMap<u64, Region>>,
    /// Regions the caller registered whose deregistration returned `Busy` or `Withdraw`
    /// (a rail refused), by address: the
    /// engine keeps them withdrawn but no longer lists them, so a later `deregister` of the
    /// address finds them here and waits for them again.
    fenced: Mutex<HashMap<u64, Region>>,
}

/// A railyard engine: registers memory, moves bytes to and from peers, sends and receives
/// notifications.
#[pyclass(module = "railyard._native", frozen)]
struct Engine {
    open: RwLock<Option<Arc<Open>>>,
    name: String,
    session_id: String,
    timeout: Duration,
}

/// A list of integers from a list, a tuple, a single int, or anything with `tolist()`
/// (NumPy arrays).
fn ints(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let signed: Vec<i128> = if let Ok(one) = value.extract::<i128>() {
        vec![one]
    } else if let Ok(many) = value.extract::<Vec<i128>>() {
        many
    } else if let Ok(listed) = value.call_method0("tolist") {
        match listed.extract::<i128>() {
            Ok(one) => vec![one],
            Err(_) => listed
                .extract::<Vec<i128>>()
                .map_err(|_| PyTypeError::new_err(format!("{what} must be integers")))?,
        }
    } else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, a sequence of ints or an integer array"
        )));
    };
    signed
        .into_iter()
        .map(|value| {
            u64::try_from(value).map_err(|_| {
                PyValueError::new_err(format!("{what} must be between 0 and 2**64-1, not {value}"))
            })
        })
        .collect()
}

/// `local_addrs`, `remote_addrs` and `lengths` as transfers, checked: equal lengths, no
/// zero length.
fn transfers(
    op: Op,
    local_addrs: &Bound<'_, PyAny>,
    remote_addrs: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
) -> PyResult<Vec<RawTransfer>> {
    let local = ints(local_addrs, "local_addrs")?;
    let remote = ints(remote_addrs, "remote_addrs")?;
    let lengths = ints(lengths, "lengths")?;
    if local.len() != remote.len() || local.len() != lengths.len() {
        return Err(PyValueError::new_err(format!(
            "local_addrs, remote_addrs and lengths must be as long as each other: {}, {} and {}",
            local.len(),
            remote.len(),
            lengths.len()
        )));
    }
    if local.is_empty() {
        return Err(PyValueError::new_err("no transfers given"));
    }
    if let Some(index) = lengths.iter().position(|&len| len == 0) {
        return Err(PyValueError::new_err(format!("lengths[{index}] is 0")));
    }
    Ok(local
        .into_iter()
        .zip(remote)
        .zip(lengths)
        .map(|((local_addr, remote_addr), len)| RawTransfer {
            op,
            local_addr,
            remote_addr,
            len,
        })
        .collect())
}

fn op_of(op: &str) -> PyResult<Op> {
    match op {
        "write" => Ok(Op::Write),
        "read" => Ok(Op::Read),
        other => Err(PyValueError::new_err(format!(
            "op must be \"write\" or \"read\", not {other:?}"
        ))),
    }
}

fn timeout_of(timeout_s: Option<f64>, default: Duration) -> PyResult<Duration> {
    match timeout_s {
        None => Ok(default),
        Some(seconds) if seconds.is_finite() && seconds > 0.0 && seconds < 1e9 => {
            Ok(Duration::from_secs_f64(seconds))
        }
        Some(seconds) => Err(PyValueError::new_err(format!(
            "timeout_s must be a positive number of seconds, not {seconds}"
        ))),
    }
}

/// How long a wait may last: like [`timeout_of`], but 0 is allowed (just look).
fn wait_of(timeout_s: f64) -> PyResult<Duration> {
    if timeout_s == 0.0 {
        Ok(Duration::ZERO)
    } else {
        timeout_of(Some(timeout_s), Duration::ZERO)
    }
}

/// Most rails an engine may be asked for.
const MAX_RAILS: usize = 64;

/// How long `probe` waits for an answer by default.
const PROBE_WAIT: Duration = Duration::from_secs(2);

/// How often a long wait for notifications looks whether the engine was closed.
const CLOSE_POLL: Duration = Duration::from_millis(100);

/// A notification larger than one can carry is refused before anything is queued.
fn check_notify(notify: Option<&Vec<u8>>) -> PyResult<()> {
    match notify {
        Some(bytes) if bytes.len() > MAX_NOTIFY => Err(PyValueError::new_err(format!(
            "notify is {} bytes; a notification carries at most {MAX_NOTIFY}",
            bytes.len()
        ))),
        _ => Ok(()),
    }
}

/// The session string's form is checked before anything is opened.
fn check_session(session_id: &str) -> PyResult<()> {
    let valid = session_id
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if valid {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "session id {session_id:?} is not \"host:port\""
        )))
    }
}

fn memory_error(error: MemoryError) -> PyErr {
    match error {
        MemoryError::BadRange { .. }
        | MemoryError::NotHostMemory { .. }
        | MemoryError::Overlaps { .. }
        | MemoryError::UnknownRegion { .. } => PyValueError::new_err(error.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

impl Engine {
    fn open(&self) -> PyResult<Arc<Open>> {
        self.open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the engine is closed"))
    }
}

impl Open {
    fn peer(&self, session_id: &str) -> Result<Peer, Failure> {
        self.engine.peer(session_id).map_err(|error| Failure {
            peer: session_id.to_string(),
            reason: error.to_string(),
            ..Failure::default()
        })
    }

    /// Submits `transfers` to `session_id`, to be done by `deadline` (opening the peer
    /// counts against it), with `notify` sent once all of them are done.
    fn submit(
        &self,
        session_id: &str,
        transfers: &[RawTransfer],
        notify: Option<Vec<u8>>,
        deadline: Instant,
    ) -> Result<(NativeBatch, Peer), Failure> {
        let peer = self.peer(session_id)?;
        if Instant::now() >= deadline {
            return Err(Failure {
                peer: session_id.to_string(),
                reason: "the deadline passed while the peer was being opened".to_string(),
                ..Failure::default()
            });
        }
        let refused = |error: TransferError_| {
            let index = match error {
                TransferError_::LocalUnregistered { transfer, .. }
                | TransferError_::RemoteRange { transfer, .. }
                | TransferError_::Empty { transfer }
                | TransferError_::LocalRange { transfer, .. }
                | TransferError_::UnknownRegion { transfer, .. } => Some(transfer),
                _ => None,
            };
            Failure {
                peer: session_id.to_string(),
                reason: error.to_string(),
                index,
                range: index
                    .and_then(|index| transfers.get(index))
                    .map(|t| (t.local_addr, t.remote_addr, t.len)),
            }
        };
        let batch = self
            .submitters
            .with(|submitter| submitter.submit_raw(&peer, transfers, deadline))
            .map_err(refused)?
            .map_err(refused)?;
        if let Some(bytes) = notify {
            self.engine
                .notify_after(&peer, bytes, &batch)
                .map_err(|error| Failure {
                    peer: session_id.to_string(),
                    reason: format!("the notification cannot be sent: {error}"),
                    ..Failure::default()
                })?;
        }
        Ok((batch, peer))
    }
}

/// The first failed request of `batch` (every request of it has resolved).
fn first_failure(batch: &NativeBatch, session_id: &str, transfers: &[RawTransfer]) -> Failure {
    let outcomes = batch.outcomes();
    let (index, reason) = outcomes
        .iter()
        .enumerate()
        .find_map(|(index, outcome)| match outcome {
            Some(RequestOutcome::Failed(_)) => Some((
                index,
                batch
                    .failure(index)
                    .map_or_else(|| "failed".to_string(), |failure| failure.to_string()),
            )),
            _ => None,
        })
        .unwrap_or((0, "failed".to_string()));
    let range = transfers
        .get(index)
        .map(|t| (t.local_addr, t.remote_addr, t.len));
    Failure {
        peer: session_id.to_string(),
        reason,
        index: Some(index),
        range,
    }
}

/// `peer_access` as the Python API spells it.
fn parse_peer_access(text: &str) -> PyResult<PeerAccess> {
    match text {
        "read_write" => Ok(PeerAccess::ReadWrite),
        "read" => Ok(PeerAccess::Read),
        "none" => Ok(PeerAccess::None),
        other => Err(PyValueError::new_err(format!(
            "peer_access must be \"read_write\", \"read\" or \"none\", not {other:?}"
        ))),
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (name=None, *, listen="0.0.0.0:0", advertise_host=None, fabric="auto", directory="p2p", timeout_s=30.0, rails=None, busy_poll=true, ofi_provider=None, secret_file=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: Option<String>,
        listen: &str,
        advertise_host: Option<&str>,
        fabric: &str,
        directory: &str,
        timeout_s: f64,
        rails: Option<usize>,
        busy_poll: bool,
        ofi_provider: Option<String>,
        secret_file: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        // Unique within the process too: two engines of one process are two peers.
        let name = name.unwrap_or_else(|| {
            static CREATED: AtomicU64 = AtomicU64::new(0);
            let ordinal = CREATED.fetch_add(1, Ordering::Relaxed);
            format!("{}-{ordinal}", default_name("python"))
        });
        let listen: SocketAddr = listen
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| PyValueError::new_err(format!("listen {listen:?} is not host:port")))?;
        let fabric = match fabric {
            "auto" => FabricChoice::Auto,
            "soft" => FabricChoice::Soft,
            "tcp" => FabricChoice::Tcp,
            "verbs" | "rdma" => FabricChoice::Verbs,
            "ofi" | "efa" => FabricChoice::Ofi,
            other => {
                return Err(PyValueError::new_err(format!(
                    "fabric must be \"auto\", \"soft\", \"tcp\", \"verbs\" or \"ofi\", not \
                     {other:?}"
                )));
            }
        };
        let directory = match directory {
            "p2p" | "P2PHANDSHAKE" => DirectoryChoice::P2p,
            url if url.starts_with("etcd://") || url.starts_with("etcd+tls://") => {
                DirectoryChoice::Etcd(url.to_string())
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "directory must be \"p2p\" or \"etcd://host:port\", not {other:?}"
                )));
            }
        };
        let timeout = timeout_of(Some(timeout_s), Duration::ZERO)?;
        let mut builder = NativeEngine::builder(name.clone())
            .listen(listen)
            .fabric(fabric)
            .directory(directory)
            .default_deadline(timeout);
        if let Some(provider) = ofi_provider {
            if fabric != FabricChoice::Ofi {
                return Err(PyValueError::new_err("ofi_provider is for fabric=\"ofi\""));
            }
            builder = builder.ofi(provider);
        }
        // As the CLI: the argument, else RAILYARD_SECRET_FILE.
        let secret_file =
            secret_file.or_else(|| std::env::var_os("RAILYARD_SECRET_FILE").map(Into::into));
        if let Some(path) = secret_file {
            let secret = railyard_engine::ClusterSecret::from_file(&path)
                .map_err(|error| PyValueError::new_err(error.to_string()))?;
            builder = builder.secret(secret);
        }
        if let Some(host) = advertise_host {
            let ip: IpAddr = match host.parse() {
                Ok(ip) => ip,
                Err(_) => (host, 0)
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut addrs| addrs.next())
                    .map(|addr| addr.ip())
                    .ok_or_else(|| {
                        PyValueError::new_err(format!("advertise_host {host:?} does not resolve"))
                    })?,
            };
            builder = builder.advertise(ip);
        }
        if let Some(rails) = rails {
            let rails = NonZeroUsize::new(rails)
                .filter(|rails| rails.get() <= MAX_RAILS)
                .ok_or_else(|| {
                    PyValueError::new_err(format!("rails must be between 1 and {MAX_RAILS}"))
                })?;
            builder = builder.rails(RailChoice::Count(rails));
        }
        if !busy_poll {
            builder = builder.idle(IdleStrategy::gentle());
        }
        let engine = py.detach(|| builder.build()).map_err(|error| {
            PyRuntimeError::new_err(format!("the engine did not start: {error}"))
        })?;
        let session_id = engine.addr().to_string();
        Ok(Self {
            open: RwLock::new(Some(Arc::new(Open {
                submitters: SubmitterPool::new(engine.clone()),
                engine,
                allocated: Mutex::new(HashMap::new()),
                fenced: Mutex::new(HashMap::new()),
            }))),
            name,
            session_id,
            timeout,
        })
    }

    /// `"host:port"`: how peers reach this engine.
    #[getter]
    fn session_id(&self) -> String {
        self.session_id.clone()
    }

    /// This engine's segment name (what peers see as the sender of its notifications).
    #[getter]
    fn name(&self) -> String {
        self.name.clone()
    }

    /// The fabric in use ("soft", "tcp", "soft+tcp", "verbs", "ofi").
    #[getter]
    fn fabric(&self) -> PyResult<&'static str> {
        Ok(self.open()?.engine.fabric())
    }

    /// Allocates `nbytes` of registered engine memory (huge pages when it can): its address.
    /// `peer_access` says what peers may do to it: "read_write" (the default), "read" or
    /// "none".
    #[pyo3(signature = (nbytes, *, peer_access="read_write"))]
    fn alloc(&self, py: Python<'_>, nbytes: i128, peer_access: &str) -> PyResult<u64> {
        let peer_access = parse_peer_access(peer_access)?;
        let len = u64::try_from(nbytes)
            .ok()
            .filter(|&len| len > 0)
            .ok_or_else(|| {
                PyValueError::new_err(format!("nbytes must be positive, not {nbytes}"))
            })?;
        let open = self.open()?;
        let region = py
            .detach(|| open.engine.alloc_with_access(len, None, peer_access))
            .map_err(memory_error)?;
        open.allocated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(region.addr, region);
        Ok(region.addr)
    }

    /// Frees memory `alloc` returned. The region is forgotten only once its deregistration
    /// succeeded: after `Busy`, or a rail's refusal to withdraw it (RuntimeError), it stays
    /// allocated, and calling `free` again tries again.
    fn free(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let open = self.open()?;
        let region = open
            .allocated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&addr)
            .copied()
            .ok_or_else(|| {
                PyValueError::new_err(format!("{addr:#x} is not memory this engine allocated"))
            })?;
        let result = py.detach(|| open.engine.deregister(region));
        if !matches!(
            result,
            Err(MemoryError::Busy { .. } | MemoryError::Withdraw { .. })
        ) {
            // Deregistered, or unknown to the engine (freed meanwhile by another call):
            // either way nothing is left to retry.
            let mut allocated = open
                .allocated
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if allocated
                .get(&addr)
                .is_some_and(|kept| kept.id == region.id)
            {
                allocated.remove(&addr);
            }
        }
        result.map_err(memory_error)
    }

    /// Registers memory the caller owns, by address and length (lists or single ints).
    /// The same range twice is a no-op; a range overlapping another registered one is
    /// refused (ValueError). The memory must stay valid until it is deregistered.
    /// `peer_access` says what peers may do to it: "read_write" (the default), "read" or
    /// "none".
    #[pyo3(signature = (addrs, lengths, *, peer_access="read_write"))]
    fn register(
        &self,
        py: Python<'_>,
        addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        peer_access: &str,
    ) -> PyResult<()> {
        let peer_access = parse_peer_access(peer_access)?;
        let addrs = ints(addrs, "addrs")?;
        let lengths = ints(lengths, "lengths")?;
        if addrs.len() != lengths.len() {
            return Err(PyValueError::new_err(format!(
                "addrs and lengths must be as long as each other: {} and {}",
                addrs.len(),
                lengths.len()
            )));
        }
        let open = self.open()?;
        py.detach(|| {
            // What this call registered anew: withdrawn again if a later range is refused,
            // so a refused call leaves the registrations as they were.
            let mut added = Vec::new();
            let result = addrs.iter().zip(&lengths).try_for_each(|(&addr, &len)| {
                let len = usize::try_from(len).map_err(|_| MemoryError::BadRange { addr, len })?;
                let existed = open
                    .engine
                    .region_at(addr, len as u64)
                    .is_some_and(|region| {
                        region.addr == addr
                            && region.len == len as u64
                            && region.peer_access == peer_access
                    });
                // SAFETY: the Python caller's contract (documented): the range is its
                // memory and stays mapped until it deregisters it. `register` refuses a
                // range that is not a read-write mapping of this process.
                let region = unsafe {
                    open.engine
                        .register_with_access(addr as *mut u8, len, peer_access)
                }?;
                if !existed {
                    added.push(region);
                }
                Ok(())
            });
            if result.is_err() {
                for region in added {
                    let _ = open.engine.deregister(region);
                }
            }
            result
        })
        .map_err(memory_error)
    }

    /// Deregisters the regions starting at `addrs`; when it returns, no peer reads or writes
    /// them any more. Every region is tried; the first error is raised. A region whose
    /// deregistration was refused with `Busy` or by a rail (RuntimeError) stays withdrawn,
    /// and deregistering its address again tries again.
    fn deregister(&self, py: Python<'_>, addrs: &Bound<'_, PyAny>) -> PyResult<()> {
        let addrs = ints(addrs, "addrs")?;
        let open = self.open()?;
        let mut regions = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let fenced = || {
                open.fenced
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&addr)
                    .copied()
            };
            let region = open
                .engine
                .region_at(addr, 1)
                .filter(|region| region.addr == addr)
                .or_else(fenced)
                .ok_or_else(|| {
                    PyValueError::new_err(format!("no registered region starts at {addr:#x}"))
                })?;
            regions.push(region);
        }
        py.detach(|| {
            let mut first_error = None;
            for region in regions {
                let result = open.engine.deregister(region);
                let mut fenced = open.fenced.lock().unwrap_or_else(PoisonError::into_inner);
                match result {
                    Err(error @ (MemoryError::Busy { .. } | MemoryError::Withdraw { .. })) => {
                        fenced.insert(region.addr, region);
                        first_error.get_or_insert(error);
                    }
                    result => {
                        if fenced
                            .get(&region.addr)
                            .is_some_and(|kept| kept.id == region.id)
                        {
                            fenced.remove(&region.addr);
                        }
                        if let Err(error) = result {
                            first_error.get_or_insert(error);
                        }
                    }
                }
            }
            first_error.map_or(Ok(()), Err)
        })
        .map_err(memory_error)
    }

    /// Writes each local range to its remote range at `session_id` and waits; with
    /// `notify`, sends it once every byte is in place.
    #[pyo3(signature = (session_id, local_addrs, remote_addrs, lengths, *, notify=None, timeout_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        session_id: &str,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        timeout_s: Option<f64>,
    ) -> PyResult<()> {
        self.transfer_sync(
            py,
            session_id,
            Op::Write,
            (local_addrs, remote_addrs, lengths),
            notify,
            timeout_s,
        )
    }

    /// Reads each remote range at `session_id` into its local range and waits.
    #[pyo3(signature = (session_id, local_addrs, remote_addrs, lengths, *, timeout_s=None))]
    fn read(
        &self,
        py: Python<'_>,
        session_id: &str,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        timeout_s: Option<f64>,
    ) -> PyResult<()> {
        self.transfer_sync(
            py,
            session_id,
            Op::Read,
            (local_addrs, remote_addrs, lengths),
            None,
            timeout_s,
        )
    }

    /// Starts the transfers and returns at once: a `Batch` to poll or wait on.
    #[pyo3(signature = (session_id, op, local_addrs, remote_addrs, lengths, *, notify=None, timeout_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        session_id: &str,
        op: &str,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        timeout_s: Option<f64>,
    ) -> PyResult<Batch> {
        check_session(session_id)?;
        check_notify(notify.as_ref())?;
        let transfers = transfers(op_of(op)?, local_addrs, remote_addrs, lengths)?;
        let deadline = Instant::now() + timeout_of(timeout_s, self.timeout)?;
        let open = self.open()?;
        let (batch, _) = py
            .detach(|| open.submit(session_id, &transfers, notify, deadline))
            .map_err(Failure::into_err)?;
        Ok(Batch {
            batch,
            session_id: session_id.to_string(),
            transfers,
        })
    }

    /// Sends `data` to the engine at `session_id` now.
    fn notify(&self, py: Python<'_>, session_id: &str, data: Vec<u8>) -> PyResult<()> {
        check_session(session_id)?;
        let open = self.open()?;
        py.detach(|| {
            let peer = open.peer(session_id)?;
            open.engine.notify(&peer, data).map_err(|error| Failure {
                peer: session_id.to_string(),
                reason: error.to_string(),
                ..Failure::default()
            })
        })
        .map_err(Failure::into_err)
    }

    /// The notifications received so far, by sender name, oldest first; taken.
    fn get_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let open = self.open()?;
        let received = open.engine.drain_notifications();
        notifications_dict(py, received)
    }

    /// Like `get_notifs`, waiting up to `timeout_s` for at least one.
    /// Returns early, with nothing, when the engine is closed meanwhile.
    fn wait_notifs<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyDict>> {
        let deadline = Instant::now() + wait_of(timeout_s)?;
        let open = self.open()?;
        let received = py.detach(|| {
            loop {
                let step = deadline.min(Instant::now() + CLOSE_POLL);
                let received = open.engine.wait_notifications(step);
                let closed = self
                    .open
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .is_none();
                if !received.is_empty() || closed || Instant::now() >= deadline {
                    break received;
                }
            }
        });
        notifications_dict(py, received)
    }

    /// Whether the engine at `session_id` answers now: it is opened (again, if the one
    /// known was replaced) and asked for its descriptor, within `timeout_s` (default 2 s).
    #[pyo3(signature = (session_id, *, timeout_s=None))]
    fn probe(&self, py: Python<'_>, session_id: &str, timeout_s: Option<f64>) -> PyResult<bool> {
        check_session(session_id)?;
        let deadline = Instant::now() + timeout_of(timeout_s, PROBE_WAIT)?;
        let open = self.open()?;
        Ok(py.detach(|| {
            open.engine.peer(session_id).is_ok_and(|peer| {
                !peer.is_retired() && open.engine.refresh_descriptor(&peer, deadline)
            })
        }))
    }

    /// The engine's Prometheus metrics, in the text format (content type
    /// `railyard.METRICS_CONTENT_TYPE`), for the application's own `/metrics` endpoint.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        let open = self.open()?;
        Ok(py.detach(|| open.engine.metrics_text()))
    }

    /// Counters: per rail, per peer and of the control plane.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.open()?.engine.stats();
        let dict = PyDict::new(py);
        let rails = PyList::empty(py);
        for rail in &stats.rails {
            let entry = PyDict::new(py);
            entry.set_item("name", &rail.name)?;
            let counters = &rail.poller;
            entry.set_item("slices_posted", counters.posted)?;
            entry.set_item("slices_completed", counters.completed)?;
            entry.set_item("slices_failed", counters.failed.iter().sum::<u64>())?;
            entry.set_item("credit_waits", counters.credit_waits)?;
            entry.set_item("rail_downs", counters.rail_downs)?;
            entry.set_item("doorbells", counters.doorbells)?;
            rails.append(entry)?;
        }
        dict.set_item("rails", rails)?;
        let peers = PyList::empty(py);
        for peer in &stats.peers {
            let entry = PyDict::new(py);
            entry.set_item("name", &peer.name)?;
            entry.set_item("incarnation", peer.incarnation.to_string())?;
            entry.set_item("requests", peer.requests())?;
            entry.set_item("slices", peer.slices)?;
            entry.set_item("bytes", peer.bytes())?;
            for op in Op::ALL {
                let totals = peer.op(op);
                entry.set_item(format!("{}_requests", op.as_str()), totals.requests)?;
                entry.set_item(format!("{}_bytes", op.as_str()), totals.bytes)?;
            }
            peers.append(entry)?;
        }
        dict.set_item("peers", peers)?;
        let control = PyDict::new(py);
        let c = &stats.control;
        for (key, value) in [
            ("active_qps", c.active_qps),
            ("passive_qps", c.passive_qps),
            ("tcp_qps", c.tcp_qps),
            ("reconnects", c.reconnects),
            ("teardowns", c.teardowns),
            ("peer_restarts", c.peer_restarts),
            ("circuit_openings", c.circuit_openings),
            ("refused", c.refused),
            ("notifications_sent", c.notifications_sent),
            ("notifications_received", c.notifications_received),
            ("notifications_dropped", c.notifications_dropped),
            ("unreachable_peers", c.unreachable_peers),
        ] {
            control.set_item(key, value)?;
        }
        dict.set_item("control", control)?;
        Ok(dict)
    }

    /// Stops the engine (idempotent). Calls made afterwards raise RuntimeError.
    fn close(&self, py: Python<'_>) {
        let open = self
            .open
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // Stopping joins the engine's threads: without the GIL.
        py.detach(move || drop(open));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        let state = if self
            .open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            "open"
        } else {
            "closed"
        };
        format!(
            "<railyard.Engine {:?} at {} ({state})>",
            self.name, self.session_id
        )
    }
}

impl Engine {
    fn transfer_sync(
        &self,
        py: Python<'_>,
        session_id: &str,
        op: Op,
        (local_addrs, remote_addrs, lengths): (
            &Bound<'_, PyAny>,
            &Bound<'_, PyAny>,
            &Bound<'_, PyAny>,
        ),
        notify: Option<Vec<u8>>,
        timeout_s: Option<f64>,
    ) -> PyResult<()> {
        check_session(session_id)?;
        check_notify(notify.as_ref())?;
        let transfers = transfers(op, local_addrs, remote_addrs, lengths)?;
        let deadline = Instant::now() + timeout_of(timeout_s, self.timeout)?;
        let open = self.open()?;
        py.detach(|| {
            let (batch, _) = open.submit(session_id, &transfers, notify, deadline)?;
            // Only what the engine resolved is reported: a request past its deadline is
            // failed by the engine (Timeout) once its posted work is flushed, and until then
            // the caller's buffers may still be read or written.
            let status = loop {
                let status = batch.wait(Instant::now() + RESOLVE_STEP);
                if status.is_complete() {
                    break status;
                }
            };
            if status.done == status.total {
                Ok(())
            } else {
                Err(first_failure(&batch, session_id, &transfers))
            }
        })
        .map_err(Failure::into_err)
    }
}

fn notifications_dict(
    py: Python<'_>,
    received: Vec<railyard_engine::control::Notification>,
) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    for notification in received {
        let body = match notification.body {
            NotificationBody::Bytes(bytes) => PyBytes::new(py, &bytes),
            NotificationBody::Immediate(value) => PyBytes::new(py, &value.to_le_bytes()),
        };
        match dict.get_item(&notification.from)? {
            Some(list) => list.cast_into::<PyList>()?.append(body)?,
            None => dict.set_item(&notification.from, PyList::new(py, [body])?)?,
        }
    }
    Ok(dict)
}

/// Transfers started with `Engine.submit`.
#[pyclass(module = "railyard._native", frozen)]
struct Batch {
    batch: NativeBatch,
    session_id: String,
    transfers: Vec<RawTransfer>,
}

fn state(batch: &NativeBatch) -> &'static str {
    let status = batch.poll();
    if status.failed > 0 && status.is_complete() {
        "ERR"
    } else if status.is_complete() {
        "DONE"
    } else {
        "PROC"
    }
}

#[pymethods]
impl Batch {
    /// "DONE" (every request done), "ERR" (all resolved, some failed) or "PROC".
    fn poll(&self) -> &'static str {
        state(&self.batch)
    }

    /// Waits until every request has resolved, or `timeout_s` passed (default: the batch's
    /// deadline and a grace): "DONE", "ERR", or "PROC" if it is still running.
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<&'static str> {
        let until = match timeout_s {
            None => self.batch.deadline() + RESOLVE_GRACE,
            Some(seconds) => Instant::now() + wait_of(seconds)?,
        };
        py.detach(|| self.batch.wait(until));
        Ok(state(&self.batch))
    }

    /// Whether a request failed because the batch's deadline passed (rather than for
    /// another reason).
    fn timed_out(&self) -> bool {
        (0..self.transfers.len()).any(|index| {
            self.batch
                .failure(index)
                .is_some_and(|failure| failure.reason == FailReason::Timeout)
        })
    }

    /// `(request index, reason)` of every failed request.
    fn failures(&self) -> Vec<(usize, String)> {
        (0..self.transfers.len())
            .filter_map(|index| {
                self.batch
                    .failure(index)
                    .map(|failure| (index, failure.to_string()))
            })
            .collect()
    }

    fn __len__(&self) -> usize {
        self.transfers.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "<railyard.Batch of {} to {} ({})>",
            self.transfers.len(),
            self.session_id,
            state(&self.batch)
        )
    }
}

/// The `railyard._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // At import, before any engine starts a thread: it writes the environment libfabric
    // reads when it starts.
    railyard_engine::dataplane::fabric::ofi::settle_parameters();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "METRICS_CONTENT_TYPE",
        railyard_engine::metrics::CONTENT_TYPE,
    )?;
    m.add("TransferError", m.py().get_type::<TransferError>())?;
    m.add_class::<Engine>()?;
    m.add_class::<Batch>()?;
    Ok(())
}
