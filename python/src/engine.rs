//! The Python `Engine` class: its constructor's options, memory registration, the
//! synchronous and asynchronous transfers, notifications, probing, metrics and counters,
//! and closing.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use railyard_engine::control::NotificationBody;
use railyard_engine::dataplane::IdleStrategy;
use railyard_engine::{
    DirectoryChoice, Engine as NativeEngine, FabricChoice, MemoryError, Op, RailChoice,
    SubmitterPool, default_name,
};

use crate::args::{
    check_notify, check_session, ints, op_of, parse_peer_access, timeout_of, transfers, wait_of,
};
use crate::batch::Batch;
use crate::errors::{Failure, first_failure, memory_error};
use crate::open::Open;
use crate::prepared::{self, PreparedList, PreparedTransfer};

/// A railyard engine: registers memory, moves bytes to and from peers, sends and receives
/// notifications.
#[pyclass(module = "railyard._native", frozen)]
pub(crate) struct Engine {
    open: RwLock<Option<Arc<Open>>>,
    name: String,
    session_id: String,
    timeout: Duration,
}

/// How long one sleep of a synchronous call waiting for its batch to resolve lasts at most:
/// it wakes at once when the batch resolves, and only looks again after this.
const RESOLVE_STEP: Duration = Duration::from_secs(1);

/// Most rails an engine may be asked for.
const MAX_RAILS: usize = 64;

/// How long `probe` waits for an answer by default.
const PROBE_WAIT: Duration = Duration::from_secs(2);

/// How often a long wait for notifications looks whether the engine was closed.
const CLOSE_POLL: Duration = Duration::from_millis(100);

impl Engine {
    fn open(&self) -> PyResult<Arc<Open>> {
        self.open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the engine is closed"))
    }
}

/// How to start an engine: the options `Engine(...)` and `Store.setup(...)` share.
pub(crate) struct EngineSettings<'a> {
    pub(crate) name: Option<String>,
    pub(crate) listen: &'a str,
    pub(crate) advertise_host: Option<&'a str>,
    pub(crate) fabric: &'a str,
    pub(crate) directory: &'a str,
    pub(crate) timeout_s: f64,
    pub(crate) rails: Option<usize>,
    pub(crate) busy_poll: bool,
    pub(crate) ofi_provider: Option<String>,
    pub(crate) secret_file: Option<std::path::PathBuf>,
}

impl EngineSettings<'_> {
    /// The secret file named, else `RAILYARD_SECRET_FILE` (as the CLI reads it: set but
    /// empty is refused, not taken for no secret).
    pub(crate) fn secret(&self) -> PyResult<Option<railyard_engine::ClusterSecret>> {
        let path = match (&self.secret_file, std::env::var_os("RAILYARD_SECRET_FILE")) {
            (Some(path), _) => Some(path.clone()),
            (None, Some(path)) if path.is_empty() => {
                return Err(PyValueError::new_err(
                    "RAILYARD_SECRET_FILE is set but empty: name the cluster secret's file, \
                     or unset it to run without one",
                ));
            }
            (None, path) => path.map(Into::into),
        };
        path.map(|path| {
            railyard_engine::ClusterSecret::from_file(&path)
                .map_err(|error| PyValueError::new_err(error.to_string()))
        })
        .transpose()
    }

    /// Whether `RAILYARD_ENCRYPT_CONTROL` asks for encrypted control frames (as the CLI's
    /// `--encrypt-control` reads it): `1`, `true`, `yes` or `on`; unset, empty, `0`,
    /// `false`, `no` or `off` do not.
    pub(crate) fn encrypt_control() -> PyResult<bool> {
        let Some(value) = std::env::var_os("RAILYARD_ENCRYPT_CONTROL") else {
            return Ok(false);
        };
        match value.to_string_lossy().trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "" | "0" | "false" | "no" | "off" => Ok(false),
            other => Err(PyValueError::new_err(format!(
                "RAILYARD_ENCRYPT_CONTROL={other:?}: say 1 or 0"
            ))),
        }
    }

    /// Checks every option, then starts the engine (without the GIL): the engine, its
    /// name and its default timeout.
    pub(crate) fn start(self, py: Python<'_>) -> PyResult<(NativeEngine, String, Duration)> {
        let secret = self.secret()?;
        let encrypt_control = Self::encrypt_control()?;
        let EngineSettings {
            name,
            listen,
            advertise_host,
            fabric,
            directory,
            timeout_s,
            rails,
            busy_poll,
            ofi_provider,
            secret_file: _,
        } = self;
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
        if let Some(secret) = secret {
            builder = builder.secret(secret);
        }
        builder = builder.encrypt_control(encrypt_control);
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
        Ok((engine, name, timeout))
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
        let (engine, name, timeout) = EngineSettings {
            name,
            listen,
            advertise_host,
            fabric,
            directory,
            timeout_s,
            rails,
            busy_poll,
            ofi_provider,
            secret_file,
        }
        .start(py)?;
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

    /// This engine's incarnation, as text: a restarted process (or a new engine) is a new
    /// one.
    #[getter]
    fn incarnation(&self) -> PyResult<String> {
        Ok(self.open()?.engine.incarnation().to_string())
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

    /// Registers memory the caller owns, by address and length (lists or single ints),
    /// all of them or none, in one pass (peers see one new descriptor). The same range twice
    /// is a no-op; a range overlapping another registered one is refused (ValueError). The
    /// memory must stay valid until it is deregistered.
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
        let ranges = addrs
            .iter()
            .zip(&lengths)
            .map(|(&addr, &len)| {
                usize::try_from(len)
                    .map(|len| (addr, len))
                    .map_err(|_| memory_error(MemoryError::BadRange { addr, len }))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let open = self.open()?;
        py.detach(|| {
            let ranges: Vec<(*mut u8, usize)> = ranges
                .into_iter()
                .map(|(addr, len)| (addr as *mut u8, len))
                .collect();
            // SAFETY: the Python caller's contract (documented): each range is its memory
            // and stays mapped until it deregisters it. Registration refuses a range that
            // is not a read-write mapping of this process, and registers all or none.
            unsafe { open.engine.register_many_with_access(&ranges, peer_access) }
        })
        .map(|_| ())
        .map_err(memory_error)
    }

    /// Resolves this engine's ranges (each inside one registered region) once: a
    /// `PreparedList` for `prepare_transfer`. Raises ValueError naming the first range no
    /// region holds.
    fn prepare_local(
        &self,
        py: Python<'_>,
        addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> PyResult<PreparedList> {
        prepared::prepare_local(&*self.open()?, py, addrs, lengths)
    }

    /// Resolves ranges of the peer at `session_id` (each inside one region it registered)
    /// once: a `PreparedList` for `prepare_transfer`. The list outlives reconnects; a region
    /// the peer deregisters or registers anew, or a revoke by the peer, makes posts of it
    /// fail (TransferError with kind "stale_list"): prepare it again. Raises ValueError
    /// naming the first range the peer does not hold, TransferError when the peer cannot be
    /// opened within `timeout_s`.
    #[pyo3(signature = (session_id, addrs, lengths, *, timeout_s=None))]
    fn prepare_remote(
        &self,
        py: Python<'_>,
        session_id: &str,
        addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        timeout_s: Option<f64>,
    ) -> PyResult<PreparedList> {
        let timeout = timeout_of(timeout_s, self.timeout)?;
        prepared::prepare_remote(&*self.open()?, py, session_id, (addrs, lengths), timeout)
    }

    /// Pairs `local[local_indices[i]]` with `remote[remote_indices[i]]` (lists or
    /// one-dimensional integer arrays), checked now: a `PreparedTransfer` to post as often
    /// as needed. `op` is "write" or "read"; `notify` goes to the peer after each post's
    /// last byte; `merge=False` keeps contiguous pairs apart. Raises ValueError for indices
    /// out of range, pairs of different lengths or index lists of different lengths.
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, *, notify=None, merge=true))]
    #[allow(clippy::too_many_arguments)]
    fn prepare_transfer(
        &self,
        op: &str,
        local: PyRef<'_, PreparedList>,
        local_indices: &Bound<'_, PyAny>,
        remote: PyRef<'_, PreparedList>,
        remote_indices: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        merge: bool,
    ) -> PyResult<PreparedTransfer> {
        prepared::prepare_transfer(
            (&self.open()?, self.timeout),
            op,
            &local,
            local_indices,
            &remote,
            remote_indices,
            notify,
            merge,
        )
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

    /// The buffers the engine at `session_id` lets peers reach, as `(addr, length)` in the
    /// order it registered them (its descriptor, asked for again within `timeout_s`,
    /// default 2 s). Raises TransferError when the peer cannot be opened.
    #[pyo3(signature = (session_id, *, timeout_s=None))]
    fn peer_buffers(
        &self,
        py: Python<'_>,
        session_id: &str,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<(u64, u64)>> {
        check_session(session_id)?;
        let deadline = Instant::now() + timeout_of(timeout_s, PROBE_WAIT)?;
        let open = self.open()?;
        py.detach(|| {
            let peer = open.peer(session_id)?;
            // A descriptor that did not change answers false: what is known is current.
            open.engine.refresh_descriptor(&peer, deadline);
            Ok(peer
                .descriptor()
                .regions
                .iter()
                .map(|region| (region.base, region.len))
                .collect())
        })
        .map_err(Failure::into_err)
    }

    /// `(name, buffers)` of the engine at `session_id`: its segment name and the buffers it
    /// lets peers reach, as `peer_buffers` gives them. Raises TransferError when the peer
    /// cannot be opened.
    #[pyo3(signature = (session_id, *, timeout_s=None))]
    fn peer_info(
        &self,
        py: Python<'_>,
        session_id: &str,
        timeout_s: Option<f64>,
    ) -> PyResult<(String, Vec<(u64, u64)>)> {
        let buffers = self.peer_buffers(py, session_id, timeout_s)?;
        let open = self.open()?;
        let peer = py
            .detach(|| open.peer(session_id))
            .map_err(Failure::into_err)?;
        Ok((peer.name().to_string(), buffers))
    }

    /// Opens the peer at `session_id` again when the one kept no longer answers (it died,
    /// or a new process took its address), then asks it for its descriptor: True when it
    /// answered within `timeout_s` (default 2 s). Never raises for a dead peer.
    #[pyo3(signature = (session_id, *, timeout_s=None))]
    fn reconnect(
        &self,
        py: Python<'_>,
        session_id: &str,
        timeout_s: Option<f64>,
    ) -> PyResult<bool> {
        check_session(session_id)?;
        let deadline = Instant::now() + timeout_of(timeout_s, PROBE_WAIT)?;
        let open = self.open()?;
        Ok(py.detach(|| {
            let kept = open.engine.peer(session_id).ok();
            if kept.as_ref().is_none_or(|peer| peer.is_unavailable()) {
                // A fresh open dials the address: a new process there retires the old one,
                // and the session then opens the new one.
                let _ = open.engine.open(session_id);
            }
            open.engine.peer(session_id).is_ok_and(|peer| {
                !peer.is_unavailable() && open.engine.refresh_descriptor(&peer, deadline)
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
