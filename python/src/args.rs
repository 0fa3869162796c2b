//! What the Python caller passes, turned into engine values and checked before anything
//! is opened or queued: integer lists, transfers, `op`, timeouts, notifications, session
//! strings and `peer_access`.

use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use railyard_engine::control::wire::MAX_NOTIFY;
use railyard_engine::{Op, PeerAccess, RawTransfer};

/// A list of integers from a list, a tuple, a single int, or anything with `tolist()`
/// (NumPy arrays; an integer array of at most one dimension is read from its bytes, with
/// no Python object per element).
pub(crate) fn ints(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    if let Some(values) = integer_array(value, what)? {
        return Ok(values);
    }
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

/// The values of a NumPy integer array of zero or one dimension, through `astype` and
/// `tobytes` (little-endian 64-bit); `None` for anything else.
fn integer_array(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<Vec<u64>>> {
    let Ok(dtype) = value.getattr("dtype") else {
        return Ok(None);
    };
    let kind: String = match dtype.getattr("kind").and_then(|kind| kind.extract()) {
        Ok(kind) => kind,
        Err(_) => return Ok(None),
    };
    let ndim: usize = match value.getattr("ndim").and_then(|ndim| ndim.extract()) {
        Ok(ndim) => ndim,
        Err(_) => return Ok(None),
    };
    if ndim > 1 || (kind != "i" && kind != "u") {
        return Ok(None);
    }
    let signed = kind == "i";
    let wide = value.call_method1("astype", (if signed { "<i8" } else { "<u8" },))?;
    let raw = wide.call_method0("tobytes")?;
    let bytes = raw
        .cast::<PyBytes>()
        .map_err(|_| PyTypeError::new_err(format!("{what}: tobytes() did not give bytes")))?
        .as_bytes();
    bytes
        .chunks_exact(8)
        .map(|chunk| {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let value = u64::from_le_bytes(word);
            if signed && (value as i64) < 0 {
                Err(PyValueError::new_err(format!(
                    "{what} must be between 0 and 2**64-1, not {}",
                    value as i64
                )))
            } else {
                Ok(value)
            }
        })
        .collect::<PyResult<Vec<u64>>>()
        .map(Some)
}

/// `local_addrs`, `remote_addrs` and `lengths` as transfers, checked: equal lengths, no
/// zero length.
pub(crate) fn transfers(
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

pub(crate) fn op_of(op: &str) -> PyResult<Op> {
    match op {
        "write" => Ok(Op::Write),
        "read" => Ok(Op::Read),
        other => Err(PyValueError::new_err(format!(
            "op must be \"write\" or \"read\", not {other:?}"
        ))),
    }
}

pub(crate) fn timeout_of(timeout_s: Option<f64>, default: Duration) -> PyResult<Duration> {
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
pub(crate) fn wait_of(timeout_s: f64) -> PyResult<Duration> {
    if timeout_s == 0.0 {
        Ok(Duration::ZERO)
    } else {
        timeout_of(Some(timeout_s), Duration::ZERO)
    }
}

/// A notification larger than one can carry is refused before anything is queued.
pub(crate) fn check_notify(notify: Option<&Vec<u8>>) -> PyResult<()> {
    match notify {
        Some(bytes) if bytes.len() > MAX_NOTIFY => Err(PyValueError::new_err(format!(
            "notify is {} bytes; a notification carries at most {MAX_NOTIFY}",
            bytes.len()
        ))),
        _ => Ok(()),
    }
}

/// The session string's form is checked before anything is opened.
pub(crate) fn check_session(session_id: &str) -> PyResult<()> {
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

/// `peer_access` as the Python API spells it.
pub(crate) fn parse_peer_access(text: &str) -> PyResult<PeerAccess> {
    match text {
        "read_write" => Ok(PeerAccess::ReadWrite),
        "read" => Ok(PeerAccess::Read),
        "none" => Ok(PeerAccess::None),
        other => Err(PyValueError::new_err(format!(
            "peer_access must be \"read_write\", \"read\" or \"none\", not {other:?}"
        ))),
    }
}
