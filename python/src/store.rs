//! The Python `Store` class: a client of railyard's KV-cache store (`railyard-store`) with
//! its own engine, the segment it contributes, and the buffers the caller registered.
//!
//! Everything a call is given is checked before anything is sent: keys are strings,
//! addresses and sizes are non-negative integers, and every `(ptr, size)` lies inside a
//! buffer registered with this store (`ValueError` otherwise, for the whole call). What the
//! store answers per key comes back as a `StoreError` (raised by single-key calls, returned
//! in its key's place by batch calls), whose `code` is Mooncake Store's code for the same
//! failure.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use railyard_engine::{Engine as NativeEngine, MemoryError, Region};
use railyard_store::error::MAX_KEY_LEN;
use railyard_store::master::SegmentId;
use railyard_store::{
    LocalRange, ReplicaConfig, Store as NativeStore, StoreError as NativeError, StoreErrorKind,
    StoreOptions,
};

use crate::engine::EngineSettings;
use crate::errors::memory_error;

create_exception!(
    railyard,
    StoreError,
    PyException,
    "A store operation failed for a key. Attributes: key, code (Mooncake Store's error \
     code: -704 not found, -706 has a lease, -200 no space, -800 transfer failed, ...), \
     kind (the cause's name, e.g. \"NotFound\")."
);

create_exception!(
    railyard,
    ObjectNotFound,
    StoreError,
    "No complete object has this key (code -704)."
);

/// How long a soft pin keeps an object from eviction (Mooncake's default soft-pin TTL).
const SOFT_PIN_TTL: Duration = Duration::from_secs(30 * 60);

/// A client of railyard's KV-cache store; see `railyard/_native.pyi`.
#[pyclass(module = "railyard._native", frozen, subclass)]
pub(crate) struct Store {
    open: RwLock<Option<Arc<OpenStore>>>,
}

/// A store that was set up, and what the binding keeps beside it.
struct OpenStore {
    store: NativeStore,
    engine: NativeEngine,
    /// The segment this process contributes, if any, and how long readers have on close.
    segment: Option<(SegmentId, Duration)>,
    /// Buffers the caller registered, by address: region and how many times registered.
    buffers: Mutex<HashMap<u64, (Region, usize)>>,
}

impl Store {
    fn open(&self) -> PyResult<Arc<OpenStore>> {
        self.open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the store is not set up (call setup first)"))
    }
}

impl OpenStore {
    /// `(ptr, size)` as a range of a buffer registered with this store.
    fn range(&self, ptr: u64, size: u64, what: &str) -> PyResult<LocalRange> {
        if size == 0 {
            return Err(PyValueError::new_err(format!("{what}: size is 0")));
        }
        let region = self.engine.region_at(ptr, size).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{what}: {size} bytes at {ptr:#x} are not inside a buffer registered with this \
                 store (register_buffer)"
            ))
        })?;
        Ok(LocalRange {
            region,
            offset: ptr - region.addr,
            len: size,
        })
    }

    /// Every key's buffers as ranges, checked before anything is sent.
    fn ranges(
        &self,
        keys: &[String],
        ptrs: &[Vec<u64>],
        sizes: &[Vec<u64>],
    ) -> PyResult<Vec<Vec<LocalRange>>> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys, {} buffer lists and {} size lists: one of each per key",
                keys.len(),
                ptrs.len(),
                sizes.len()
            )));
        }
        keys.iter()
            .zip(ptrs.iter().zip(sizes))
            .map(|(key, (ptrs, sizes))| {
                if ptrs.len() != sizes.len() || ptrs.is_empty() {
                    return Err(PyValueError::new_err(format!(
                        "key {key:?}: {} buffers and {} sizes (at least one of each, as many \
                         of one as of the other)",
                        ptrs.len(),
                        sizes.len()
                    )));
                }
                ptrs.iter()
                    .zip(sizes)
                    .map(|(&ptr, &size)| self.range(ptr, size, &format!("key {key:?}")))
                    .collect()
            })
            .collect()
    }
}

/// A Python exception for `error`.
pub(crate) fn store_error(error: &NativeError) -> PyErr {
    let exception = match error.kind {
        StoreErrorKind::NotFound => ObjectNotFound::new_err(error.to_string()),
        _ => StoreError::new_err(error.to_string()),
    };
    Python::attach(|py| {
        let value = exception.value(py);
        // Setting attributes on a fresh exception instance cannot fail in practice; if it
        // did, the exception still carries its message.
        let _ = value.setattr("key", error.key.clone());
        let _ = value.setattr("code", error.code());
        let _ = value.setattr("kind", kind_name(&error.kind));
    });
    exception
}

/// The cause's name, as `StoreErrorKind` spells it.
fn kind_name(kind: &StoreErrorKind) -> String {
    let debug = format!("{kind:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// One key's result in a batch: its value, or its `StoreError` instance (not raised).
fn per_key<'py, T>(
    py: Python<'py>,
    results: Vec<Result<T, NativeError>>,
    value: impl Fn(Python<'py>, T) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let items = results
        .into_iter()
        .map(|result| match result {
            Ok(ok) => value(py, ok),
            Err(error) => Ok(store_error(&error).into_value(py).into_bound(py).into_any()),
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// The name of `value`'s type, for messages.
fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "?".into(), |name| name.to_string())
}

/// A key the store can hold: not empty, at most [`MAX_KEY_LEN`] bytes (`ValueError`).
fn check_key(key: &str) -> PyResult<()> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(PyValueError::new_err(format!(
            "a key is 1 to {MAX_KEY_LEN} bytes of UTF-8, not {} bytes",
            key.len()
        )));
    }
    Ok(())
}

/// A non-negative integer (an address or a size): `TypeError` for anything else than an
/// int, `ValueError` below 0 or above 2**64-1.
fn natural(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, not bool"
        )));
    }
    let wide: i128 = value.extract().map_err(|_| {
        PyTypeError::new_err(format!("{what} must be an int, not {}", type_name(value)))
    })?;
    u64::try_from(wide).map_err(|_| {
        PyValueError::new_err(format!("{what} must be between 0 and 2**64-1, not {wide}"))
    })
}

/// A list of non-negative integers.
fn naturals(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    value
        .try_iter()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a list of ints")))?
        .enumerate()
        .map(|(index, item)| natural(&item?, &format!("{what}[{index}]")))
        .collect()
}

/// A list of lists of non-negative integers.
fn natural_lists(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Vec<u64>>> {
    value
        .try_iter()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a list of lists of ints")))?
        .enumerate()
        .map(|(index, item)| naturals(&item?, &format!("{what}[{index}]")))
        .collect()
}

/// Keys: a list of `str` (a `str` alone is refused: it would be a list of characters).
fn keys_of(value: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if value.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(
            "keys must be a list of str, not one str",
        ));
    }
    value
        .try_iter()
        .map_err(|_| PyTypeError::new_err("keys must be a list of str"))?
        .enumerate()
        .map(|(index, item)| {
            let item = item?;
            let key = item.extract::<String>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "keys[{index}] must be a str, not {}",
                    type_name(&item)
                ))
            })?;
            check_key(&key)?;
            Ok(key)
        })
        .collect()
}

/// Bytes of a value: `bytes`, or anything with the buffer protocol (`bytearray`, a
/// `memoryview`, a NumPy array) — copied, as they go through the store's bounce buffer
/// anyway.
fn value_of(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = value.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    if value.is_instance_of::<pyo3::types::PyString>() || value.is_none() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be bytes-like, not {}",
            type_name(value)
        )));
    }
    // Through a memoryview: only the buffer protocol (bytes() would also turn an int into
    // that many zero bytes and a list of ints into bytes).
    let view = value
        .py()
        .import("builtins")?
        .getattr("memoryview")?
        .call1((value,))
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be bytes-like (the buffer protocol), not {}",
                type_name(value)
            ))
        })?;
    let bytes = view.call_method0("tobytes")?;
    Ok(bytes.cast::<PyBytes>()?.as_bytes().to_vec())
}

/// [`value_of`], refusing an empty value (`ValueError`): the store holds none.
fn nonempty_value_of(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    let bytes = value_of(value, what)?;
    if bytes.is_empty() {
        return Err(PyValueError::new_err(format!("{what} is empty")));
    }
    Ok(bytes)
}

/// A `ReplicateConfig` (or anything with its attributes; `None`: the defaults) as the
/// store's [`ReplicaConfig`].
fn config_of(config: Option<&Bound<'_, PyAny>>) -> PyResult<ReplicaConfig> {
    let Some(config) = config.filter(|config| !config.is_none()) else {
        return Ok(ReplicaConfig::default());
    };
    if !config.hasattr("replica_num")? {
        return Err(PyTypeError::new_err(format!(
            "config must be a ReplicateConfig (with replica_num), not {}",
            type_name(config)
        )));
    }
    let attr = |name: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        match config.getattr(name) {
            Ok(value) if value.is_none() => Ok(None),
            Ok(value) => Ok(Some(value)),
            Err(_) => Ok(None),
        }
    };
    let mut out = ReplicaConfig::default();
    if let Some(replicas) = attr("replica_num")? {
        let replicas = natural(&replicas, "replica_num")?;
        if replicas == 0 {
            return Err(PyValueError::new_err("replica_num must be at least 1"));
        }
        out.replica_num = usize::try_from(replicas)
            .map_err(|_| PyValueError::new_err("replica_num is too large"))?;
    }
    if let Some(pin) = attr("with_soft_pin")? {
        if pin.is_truthy()? {
            out.soft_pin = Some(SOFT_PIN_TTL);
        }
    }
    if let Some(ttl) = attr("soft_pin_ttl_ms")? {
        if out.soft_pin.is_some() {
            out.soft_pin = Some(Duration::from_millis(natural(&ttl, "soft_pin_ttl_ms")?));
        }
    }
    if let Some(pin) = attr("with_hard_pin")? {
        out.hard_pin = pin.is_truthy()?;
    }
    if let Some(best) = attr("best_effort")? {
        out.best_effort = best.is_truthy()?;
    }
    if let Some(segments) = attr("preferred_segments")? {
        if segments.is_instance_of::<pyo3::types::PyString>() {
            return Err(PyTypeError::new_err(
                "preferred_segments must be a list of str, not one str",
            ));
        }
        out.preferred_segments = segments
            .extract::<Vec<String>>()
            .map_err(|_| PyTypeError::new_err("preferred_segments must be a list of str"))?;
    }
    if let Some(segment) = attr("preferred_segment")? {
        let segment: String = segment
            .extract()
            .map_err(|_| PyTypeError::new_err("preferred_segment must be a str"))?;
        if !segment.is_empty() && !out.preferred_segments.contains(&segment) {
            out.preferred_segments.insert(0, segment);
        }
    }
    Ok(out)
}

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    if (0.0..1e9).contains(&value) {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, not {value}"
        )))
    }
}

#[pymethods]
impl Store {
    /// A store not set up yet. (`railyard.Store`, the Python subclass, takes `setup`'s
    /// arguments in its constructor; they are ignored here.)
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, pyo3::types::PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        Self {
            open: RwLock::new(None),
        }
    }

    /// Starts this store's engine, connects it to the master at `master` and, when
    /// `segment_size` > 0, contributes that many bytes as a segment. See the stubs.
    #[pyo3(signature = (master, *, name=None, segment_size=0, staging_size=64 << 20, listen="0.0.0.0:0", advertise_host=None, fabric="auto", rails=None, busy_poll=true, timeout_s=10.0, host=None, secret_file=None, close_grace_s=1.0))]
    #[allow(clippy::too_many_arguments)]
    fn setup(
        &self,
        py: Python<'_>,
        master: &str,
        name: Option<String>,
        segment_size: i128,
        staging_size: i128,
        listen: &str,
        advertise_host: Option<&str>,
        fabric: &str,
        rails: Option<usize>,
        busy_poll: bool,
        timeout_s: f64,
        host: Option<String>,
        secret_file: Option<std::path::PathBuf>,
        close_grace_s: f64,
    ) -> PyResult<()> {
        if self
            .open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            return Err(PyRuntimeError::new_err(
                "the store is set up already (close it first)",
            ));
        }
        let size = |value: i128, what: &str| {
            u64::try_from(value).map_err(|_| {
                PyValueError::new_err(format!("{what} must be between 0 and 2**64-1, not {value}"))
            })
        };
        let segment_size = size(segment_size, "segment_size")?;
        let staging_size = size(staging_size, "staging_size")?;
        let grace = seconds(close_grace_s, "close_grace_s")?;
        let etcd = master.starts_with("etcd://") || master.starts_with("etcd+tls://");
        let host_port = master
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !etcd && !host_port {
            return Err(PyValueError::new_err(format!(
                "master {master:?} is neither \"host:port\" nor \"etcd://host:port\""
            )));
        }
        let settings = EngineSettings {
            name,
            listen,
            advertise_host,
            fabric,
            directory: "p2p",
            timeout_s,
            rails,
            busy_poll,
            ofi_provider: None,
            secret_file,
        };
        let secret = settings.secret()?;
        let (engine, _, timeout) = settings.start(py)?;
        let mut options = StoreOptions::new(master);
        options.secret = secret;
        options.timeout = timeout;
        options.staging = staging_size;
        options.host = host;
        let open = py.detach(|| -> Result<OpenStore, NativeError> {
            let store = NativeStore::connect(&engine, options)?;
            let segment = if segment_size > 0 {
                Some((store.mount(segment_size)?, grace))
            } else {
                None
            };
            Ok(OpenStore {
                store,
                engine,
                segment,
                buffers: Mutex::new(HashMap::new()),
            })
        });
        let open = open.map_err(|error| store_error(&error))?;
        *self.open.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(open));
        Ok(())
    }

    /// Takes this store's segment back (readers already pointed at it have `close_grace_s`),
    /// disconnects and stops the engine. Idempotent; `setup` may be called again.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let open = self
            .open
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(open) = open else { return Ok(()) };
        let unmounted = py.detach(move || {
            let unmounted = match open.segment {
                Some((segment, grace)) => open.store.unmount(segment, grace),
                None => Ok(()),
            };
            // The engine stops once the calls still running with their own `Arc` return.
            drop(open);
            unmounted
        });
        // Closed either way: a segment the master could not be told about goes when the
        // master finds this process gone. Said as a warning, so `with` never hides the
        // exception it is leaving with.
        if let Err(error) = unmounted {
            PyErr::warn(
                py,
                &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(),
                &std::ffi::CString::new(format!("railyard.Store.close: {error}"))
                    .unwrap_or_default(),
                1,
            )?;
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py)
    }

    /// Whether `setup` succeeded and `close` was not called since.
    #[getter]
    fn is_setup(&self) -> bool {
        self.open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Registers `size` bytes at `ptr` for `put_from`/`get_into` and their forms.
    /// Registering the same range again counts: it stays registered until unregistered as
    /// many times.
    fn register_buffer(
        &self,
        py: Python<'_>,
        ptr: &Bound<'_, PyAny>,
        size: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ptr = natural(ptr, "ptr")?;
        let size = natural(size, "size")?;
        if size == 0 {
            return Err(PyValueError::new_err("size is 0"));
        }
        let open = self.open()?;
        let len = usize::try_from(size).map_err(|_| PyValueError::new_err("size is too large"))?;
        py.detach(|| {
            let mut buffers = open.buffers.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((region, count)) = buffers.get_mut(&ptr) {
                if region.len == size {
                    *count += 1;
                    return Ok(());
                }
                return Err(PyValueError::new_err(format!(
                    "a buffer of {} bytes is registered at {ptr:#x} already",
                    region.len
                )));
            }
            // SAFETY: the Python caller's contract (documented): the range is its memory
            // and stays mapped until it unregisters it. `register` refuses a range that is
            // not a read-write mapping of this process.
            let region =
                unsafe { open.engine.register(ptr as *mut u8, len) }.map_err(memory_error)?;
            buffers.insert(ptr, (region, 1));
            Ok(())
        })
    }

    /// Unregisters the buffer registered at `ptr` (once per `register_buffer` of it).
    fn unregister_buffer(&self, py: Python<'_>, ptr: &Bound<'_, PyAny>) -> PyResult<()> {
        let ptr = natural(ptr, "ptr")?;
        let open = self.open()?;
        py.detach(|| {
            let mut buffers = open.buffers.lock().unwrap_or_else(PoisonError::into_inner);
            let Some((region, count)) = buffers.get_mut(&ptr) else {
                return Err(PyValueError::new_err(format!(
                    "no buffer is registered at {ptr:#x}"
                )));
            };
            if *count > 1 {
                *count -= 1;
                return Ok(());
            }
            let region = *region;
            match open.engine.deregister(region) {
                Ok(()) => {
                    buffers.remove(&ptr);
                    Ok(())
                }
                Err(error @ MemoryError::UnknownRegion { .. }) => {
                    buffers.remove(&ptr);
                    Err(memory_error(error))
                }
                Err(error) => Err(memory_error(error)),
            }
        })
    }

    /// Stores `value` (bytes-like) under a new `key`.
    #[pyo3(signature = (key, value, config=None))]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        check_key(key)?;
        let value = nonempty_value_of(value, "value")?;
        let config = config_of(config)?;
        let open = self.open()?;
        py.detach(|| open.store.put(key, &value, &config))
            .map_err(|error| store_error(&error))
    }

    /// Stores the concatenation of `parts` (bytes-like each) under a new `key`.
    #[pyo3(signature = (key, *parts, config=None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, pyo3::types::PyTuple>,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        check_key(key)?;
        let parts = parts
            .iter()
            .enumerate()
            .map(|(index, part)| value_of(&part, &format!("parts[{index}]")))
            .collect::<PyResult<Vec<_>>>()?;
        if parts.iter().all(Vec::is_empty) {
            return Err(PyValueError::new_err("the parts hold no bytes"));
        }
        let config = config_of(config)?;
        let open = self.open()?;
        py.detach(|| {
            let slices: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            open.store.put_parts(key, &slices, &config)
        })
        .map_err(|error| store_error(&error))
    }

    /// Stores `value` under `key`, replacing a complete object of that key.
    #[pyo3(signature = (key, value, config=None))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        check_key(key)?;
        let value = nonempty_value_of(value, "value")?;
        let config = config_of(config)?;
        let open = self.open()?;
        py.detach(|| open.store.upsert(key, &value, &config))
            .map_err(|error| store_error(&error))
    }

    /// `put` of each key: one result per key (`None`, or its `StoreError`).
    #[pyo3(signature = (keys, values, config=None))]
    fn batch_put<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        values: &Bound<'py, PyAny>,
        config: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let values = values
            .try_iter()
            .map_err(|_| PyTypeError::new_err("values must be a list of bytes-like values"))?
            .enumerate()
            .map(|(index, value)| nonempty_value_of(&value?, &format!("values[{index}]")))
            .collect::<PyResult<Vec<_>>>()?;
        if keys.len() != values.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys and {} values",
                keys.len(),
                values.len()
            )));
        }
        let config = config_of(config)?;
        let open = self.open()?;
        let results: Vec<Result<(), NativeError>> = py.detach(|| {
            keys.iter()
                .zip(&values)
                .map(|(key, value)| open.store.put(key, value, &config))
                .collect()
        });
        per_key(py, results, |py, ()| Ok(py.None().into_bound(py)))
    }

    /// Stores `size` bytes of a registered buffer at `ptr` under `key`, zero-copy.
    #[pyo3(signature = (key, ptr, size, config=None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &str,
        ptr: &Bound<'_, PyAny>,
        size: &Bound<'_, PyAny>,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        check_key(key)?;
        let ptr = natural(ptr, "ptr")?;
        let size = natural(size, "size")?;
        let config = config_of(config)?;
        let open = self.open()?;
        let range = open.range(ptr, size, "put_from")?;
        py.detach(|| open.store.put_from(key, range, &config))
            .map_err(|error| store_error(&error))
    }

    /// `put_from`, replacing a complete object of that key.
    #[pyo3(signature = (key, ptr, size, config=None))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: &str,
        ptr: &Bound<'_, PyAny>,
        size: &Bound<'_, PyAny>,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        check_key(key)?;
        let ptr = natural(ptr, "ptr")?;
        let size = natural(size, "size")?;
        let config = config_of(config)?;
        let open = self.open()?;
        let range = open.range(ptr, size, "upsert_from")?;
        py.detach(|| open.store.upsert_from(key, range, &config))
            .map_err(|error| store_error(&error))
    }

    /// `put_from` of each key: one result per key (the number of replicas written, or its
    /// `StoreError`).
    #[pyo3(signature = (keys, ptrs, sizes, config=None))]
    fn batch_put_from<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        ptrs: &Bound<'py, PyAny>,
        sizes: &Bound<'py, PyAny>,
        config: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let ptrs: Vec<Vec<u64>> = naturals(ptrs, "ptrs")?
            .into_iter()
            .map(|p| vec![p])
            .collect();
        let sizes: Vec<Vec<u64>> = naturals(sizes, "sizes")?
            .into_iter()
            .map(|s| vec![s])
            .collect();
        let config = config_of(config)?;
        let open = self.open()?;
        let ranges: Vec<LocalRange> = open
            .ranges(&keys, &ptrs, &sizes)?
            .into_iter()
            .flatten()
            .collect();
        let results = py.detach(|| open.store.batch_put_from_counted(&keys, &ranges, &config));
        per_key(py, results, |py, count| {
            Ok(count.into_pyobject(py)?.into_any())
        })
    }

    /// Stores, for each key, the concatenation of its buffers (scatter-gather): one result
    /// per key (`None`, or its `StoreError`).
    #[pyo3(signature = (keys, all_ptrs, all_sizes, config=None))]
    fn batch_put_from_multi_buffers<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        all_ptrs: &Bound<'py, PyAny>,
        all_sizes: &Bound<'py, PyAny>,
        config: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let ptrs = natural_lists(all_ptrs, "all_ptrs")?;
        let sizes = natural_lists(all_sizes, "all_sizes")?;
        let config = config_of(config)?;
        let open = self.open()?;
        let parts = open.ranges(&keys, &ptrs, &sizes)?;
        let results = py.detach(|| open.store.batch_put_from_multi(&keys, &parts, &config));
        per_key(py, results, |py, ()| Ok(py.None().into_bound(py)))
    }

    /// The value of `key` as bytes (`ObjectNotFound` when there is none).
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        check_key(key)?;
        let open = self.open()?;
        let value = py
            .detach(|| open.store.get(key))
            .map_err(|error| store_error(&error))?;
        Ok(PyBytes::new(py, &value))
    }

    /// `get` of each key: one result per key (`bytes`, or its `StoreError`).
    fn batch_get<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let open = self.open()?;
        let results: Vec<Result<Vec<u8>, NativeError>> =
            py.detach(|| keys.iter().map(|key| open.store.get(key)).collect());
        per_key(py, results, |py, value| {
            Ok(PyBytes::new(py, &value).into_any())
        })
    }

    /// Reads the value of `key` into the registered buffer at `ptr` (at most `size` bytes),
    /// zero-copy: its size.
    fn get_into(
        &self,
        py: Python<'_>,
        key: &str,
        ptr: &Bound<'_, PyAny>,
        size: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        check_key(key)?;
        let ptr = natural(ptr, "ptr")?;
        let size = natural(size, "size")?;
        let open = self.open()?;
        let range = open.range(ptr, size, "get_into")?;
        py.detach(|| open.store.get_into(key, range))
            .map_err(|error| store_error(&error))
    }

    /// `get_into` of each key: one result per key (its size, or its `StoreError`).
    fn batch_get_into<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        ptrs: &Bound<'py, PyAny>,
        sizes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let ptrs: Vec<Vec<u64>> = naturals(ptrs, "ptrs")?
            .into_iter()
            .map(|p| vec![p])
            .collect();
        let sizes: Vec<Vec<u64>> = naturals(sizes, "sizes")?
            .into_iter()
            .map(|s| vec![s])
            .collect();
        let open = self.open()?;
        let ranges: Vec<LocalRange> = open
            .ranges(&keys, &ptrs, &sizes)?
            .into_iter()
            .flatten()
            .collect();
        let results = py.detach(|| open.store.batch_get_into(&keys, &ranges));
        per_key(py, results, |py, size| {
            Ok(size.into_pyobject(py)?.into_any())
        })
    }

    /// Reads each key's value into its buffers, in order (scatter-gather): one result per
    /// key (its size, or its `StoreError`).
    fn batch_get_into_multi_buffers<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        all_ptrs: &Bound<'py, PyAny>,
        all_sizes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let ptrs = natural_lists(all_ptrs, "all_ptrs")?;
        let sizes = natural_lists(all_sizes, "all_sizes")?;
        let open = self.open()?;
        let parts = open.ranges(&keys, &ptrs, &sizes)?;
        let results = py.detach(|| open.store.batch_get_into_multi(&keys, &parts));
        per_key(py, results, |py, size| {
            Ok(size.into_pyobject(py)?.into_any())
        })
    }

    /// The size of `key`'s value (`ObjectNotFound` when there is none).
    fn get_size(&self, py: Python<'_>, key: &str) -> PyResult<u64> {
        check_key(key)?;
        let open = self.open()?;
        let replicas = py
            .detach(|| open.store.replica_descriptors(key))
            .map_err(|error| store_error(&error))?;
        Ok(replicas.first().map_or(0, |replica| replica.len))
    }

    /// Whether `key` names a complete object.
    fn is_exist(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        check_key(key)?;
        let open = self.open()?;
        py.detach(|| open.store.exists(key))
            .map_err(|error| store_error(&error))
    }

    /// `is_exist` of each key: one result per key (`bool`, or its `StoreError`).
    fn batch_is_exist<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let open = self.open()?;
        let results = py.detach(|| open.store.batch_exists(&keys));
        per_key(py, results, |py, exists| {
            Ok(pyo3::types::PyBool::new(py, exists).to_owned().into_any())
        })
    }

    /// Removes `key`'s object; one a reader holds a lease on only with `force`.
    #[pyo3(signature = (key, force=false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> PyResult<()> {
        check_key(key)?;
        let open = self.open()?;
        py.detach(|| open.store.remove(key, force))
            .map_err(|error| store_error(&error))
    }

    /// `remove` of each key: one result per key (`None`, or its `StoreError`).
    #[pyo3(signature = (keys, force=false))]
    fn batch_remove<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        force: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_of(keys)?;
        let open = self.open()?;
        let results = py.detach(|| open.store.batch_remove(&keys, force));
        per_key(py, results, |py, ()| Ok(py.None().into_bound(py)))
    }

    /// Removes every object (those under a lease only with `force`): how many.
    #[pyo3(signature = (force=false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        let open = self.open()?;
        py.detach(|| open.store.remove_all(force))
            .map_err(|error| store_error(&error))
    }

    /// Keys of complete objects, sorted.
    fn keys(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let open = self.open()?;
        py.detach(|| open.store.keys())
            .map_err(|error| store_error(&error))
    }

    /// `"host:port"` where this store's engine is reached.
    fn get_hostname(&self) -> PyResult<String> {
        Ok(self.open()?.engine.addr().to_string())
    }

    /// The name of the segment this store contributes (`None` without one): what
    /// `ReplicateConfig.preferred_segments` names.
    #[getter]
    fn segment_name(&self) -> PyResult<Option<String>> {
        let open = self.open()?;
        Ok(open.segment.map(|_| open.engine.name().to_owned()))
    }

    /// Whether the master answers, from the connection's keepalive (no round trip: a dead
    /// master reads false at once, a stopped one within 1.5 s).
    fn health_check(&self) -> PyResult<bool> {
        Ok(self.open()?.store.master_reachable())
    }

    /// What the master holds: objects, writes in progress, bytes, and each segment.
    fn master_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let open = self.open()?;
        let stats = py
            .detach(|| open.store.master_stats())
            .map_err(|error| store_error(&error))?;
        let dict = PyDict::new(py);
        dict.set_item("objects", stats.objects)?;
        dict.set_item("writes", stats.writes)?;
        dict.set_item("bytes", stats.bytes)?;
        dict.set_item("term", stats.term)?;
        let segments = PyList::empty(py);
        for segment in &stats.segments {
            let entry = PyDict::new(py);
            entry.set_item("name", &segment.name)?;
            entry.set_item("capacity", segment.capacity)?;
            entry.set_item("reserved", segment.reserved)?;
            entry.set_item("suspected", segment.suspected)?;
            segments.append(entry)?;
        }
        dict.set_item("segments", segments)?;
        Ok(dict)
    }

    fn __repr__(&self) -> String {
        match self
            .open
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            Some(open) => format!(
                "<railyard.Store {:?} at {}>",
                open.engine.name(),
                open.engine.addr()
            ),
            None => "<railyard.Store (not set up)>".to_owned(),
        }
    }
}
