//! How the engine's failures reach Python: the `TransferError` exception with its
//! attributes, the first failed request of a batch, and which memory errors are the
//! caller's (ValueError) rather than the engine's (RuntimeError).

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use railyard_engine::dataplane::{Batch as NativeBatch, RequestOutcome};
use railyard_engine::{MemoryError, RawTransfer};

create_exception!(
    railyard,
    TransferError,
    PyException,
    "A transfer failed or could not be queued. Attributes: peer, reason, index (the failed \
     request's index, or None), local_addr, remote_addr, length (None when not about one \
     range), kind (what a refused prepared post was about, or None)."
);

/// What a transfer error names, turned into the Python exception's attributes.
#[derive(Default)]
pub(crate) struct Failure {
    pub(crate) peer: String,
    pub(crate) reason: String,
    pub(crate) index: Option<usize>,
    pub(crate) range: Option<(u64, u64, u64)>,
    /// What kind of refusal it is, when the caller tells them apart (prepared posts).
    pub(crate) kind: Option<&'static str>,
}

impl Failure {
    pub(crate) fn into_err(self) -> PyErr {
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
            let _ = value.setattr("kind", self.kind);
            error
        })
    }
}

/// The first failed request of `batch` (every request of it has resolved).
pub(crate) fn first_failure(
    batch: &NativeBatch,
    session_id: &str,
    transfers: &[RawTransfer],
) -> Failure {
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
        ..Failure::default()
    }
}

pub(crate) fn memory_error(error: MemoryError) -> PyErr {
    match error {
        MemoryError::BadRange { .. }
        | MemoryError::NotHostMemory { .. }
        | MemoryError::Overlaps { .. }
        | MemoryError::RangesOverlap { .. }
        | MemoryError::UnknownRegion { .. } => PyValueError::new_err(error.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}
