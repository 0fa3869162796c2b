//! Prepared descriptor lists for Python (`Engine.prepare_local`, `Engine.prepare_remote`,
//! `Engine.prepare_transfer`): lists resolved once, a transfer of index pairs into them
//! checked once and posted as often as the caller likes, and the batch each post starts —
//! what `railyard.compat.nixl` builds NIXL's prepared lists and transfer handles on.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use railyard_engine::dataplane::{Batch as NativeBatch, FailReason, RequestOutcome};
use railyard_engine::{
    LocalList, Op, PostOptions, PrepareError, PreparedTotals, RemoteList, TransferError,
    check_pairs,
};

use crate::args::{check_notify, check_session, ints, op_of, timeout_of, wait_of};
use crate::batch::{RESOLVE_GRACE, state};
use crate::errors::Failure;
use crate::open::Open;

/// Which side a prepared list is of.
enum Side {
    Local(Arc<LocalList>),
    Remote {
        list: Arc<RemoteList>,
        session_id: String,
    },
}

/// Ranges resolved once to registered regions and keys: this engine's (`prepare_local`) or
/// a peer's (`prepare_remote`).
#[pyclass(module = "railyard._native", frozen)]
pub(crate) struct PreparedList {
    side: Side,
}

#[pymethods]
impl PreparedList {
    fn __len__(&self) -> usize {
        match &self.side {
            Side::Local(list) => list.len(),
            Side::Remote { list, .. } => list.len(),
        }
    }

    /// Whether it is this engine's memory (else a peer's).
    #[getter]
    fn is_local(&self) -> bool {
        matches!(self.side, Side::Local(_))
    }

    /// The peer's session string (`None` for a local list).
    #[getter]
    fn session_id(&self) -> Option<String> {
        match &self.side {
            Side::Local(_) => None,
            Side::Remote { session_id, .. } => Some(session_id.clone()),
        }
    }

    fn __repr__(&self) -> String {
        match &self.side {
            Side::Local(list) => format!("<railyard.PreparedList local, {} ranges>", list.len()),
            Side::Remote { list, session_id } => format!(
                "<railyard.PreparedList of {session_id}, {} ranges>",
                list.len()
            ),
        }
    }
}

/// `addrs` and `lengths` as ranges, checked to pair up.
fn ranges(addrs: &Bound<'_, PyAny>, lengths: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
    let addrs = ints(addrs, "addrs")?;
    let lengths = ints(lengths, "lengths")?;
    if addrs.len() != lengths.len() {
        return Err(PyValueError::new_err(format!(
            "addrs and lengths must be as long as each other: {} and {}",
            addrs.len(),
            lengths.len()
        )));
    }
    Ok(addrs.into_iter().zip(lengths).collect())
}

fn prepare_error(error: PrepareError) -> PyErr {
    PyValueError::new_err(error.to_string())
}

/// `Engine.prepare_local`.
pub(crate) fn prepare_local(
    open: &Open,
    py: Python<'_>,
    addrs: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
) -> PyResult<PreparedList> {
    let ranges = ranges(addrs, lengths)?;
    let list = py
        .detach(|| open.engine.prepare_local(&ranges))
        .map_err(prepare_error)?;
    Ok(PreparedList {
        side: Side::Local(Arc::new(list)),
    })
}

/// `Engine.prepare_remote`, within `timeout`: a range the peer's descriptor lacks makes it
/// ask for the descriptor once more (a region the peer registered since) before it refuses.
pub(crate) fn prepare_remote(
    open: &Open,
    py: Python<'_>,
    session_id: &str,
    (addrs, lengths): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    timeout: Duration,
) -> PyResult<PreparedList> {
    check_session(session_id)?;
    let ranges = ranges(addrs, lengths)?;
    let deadline = Instant::now() + timeout;
    let list = py.detach(|| {
        let peer = open.peer(session_id).map_err(Failure::into_err)?;
        match peer.prepare(&ranges) {
            Err(PrepareError::RemoteRange { .. })
                if open.engine.refresh_descriptor(&peer, deadline) =>
            {
                peer.prepare(&ranges)
            }
            other => other,
        }
        .map_err(prepare_error)
    })?;
    Ok(PreparedList {
        side: Side::Remote {
            list: Arc::new(list),
            session_id: session_id.to_string(),
        },
    })
}

/// Index pairs into a local and a remote list, checked once: `post()` starts them as one
/// batch, as often as the caller likes (one post at a time is the caller's business).
#[pyclass(module = "railyard._native", frozen)]
pub(crate) struct PreparedTransfer {
    /// The engine it posts on, while it is open (a transfer does not keep it running).
    open: Weak<Open>,
    /// Its default deadline.
    timeout: Duration,
    op: Op,
    local: Arc<LocalList>,
    remote: Arc<RemoteList>,
    session_id: String,
    local_indices: Vec<usize>,
    remote_indices: Vec<usize>,
    merge: bool,
    notify: Mutex<Option<Vec<u8>>>,
}

/// Indices from a list, a tuple or a one-dimensional integer array.
fn indices(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<usize>> {
    if let Ok(ndim) = value.getattr("ndim").and_then(|n| n.extract::<usize>()) {
        if ndim != 1 {
            return Err(PyValueError::new_err(format!(
                "{what} must be one-dimensional, not a {ndim}-dimensional array"
            )));
        }
    }
    ints(value, what)?
        .into_iter()
        .map(|index| {
            usize::try_from(index)
                .map_err(|_| PyValueError::new_err(format!("{what}: {index} is not an index")))
        })
        .collect()
}

/// `Engine.prepare_transfer`, posting on `open` with `timeout` as its default deadline.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare_transfer(
    (open, timeout): (&Arc<Open>, Duration),
    op: &str,
    local: &PreparedList,
    local_indices: &Bound<'_, PyAny>,
    remote: &PreparedList,
    remote_indices: &Bound<'_, PyAny>,
    notify: Option<Vec<u8>>,
    merge: bool,
) -> PyResult<PreparedTransfer> {
    let op = op_of(op)?;
    check_notify(notify.as_ref())?;
    let Side::Local(local) = &local.side else {
        return Err(PyTypeError::new_err(
            "local must be a list from prepare_local, not a peer's",
        ));
    };
    let Side::Remote {
        list: remote,
        session_id,
    } = &remote.side
    else {
        return Err(PyTypeError::new_err(
            "remote must be a list from prepare_remote, not this engine's",
        ));
    };
    let local_indices = indices(local_indices, "local_indices")?;
    let remote_indices = indices(remote_indices, "remote_indices")?;
    check_pairs(local, &local_indices, remote, &remote_indices)
        .map_err(|error| PyValueError::new_err(error.to_string()))?;
    Ok(PreparedTransfer {
        open: Arc::downgrade(open),
        timeout,
        op,
        local: local.clone(),
        remote: remote.clone(),
        session_id: session_id.clone(),
        local_indices,
        remote_indices,
        merge,
        notify: Mutex::new(notify),
    })
}

/// What a refused post was about, for the exception's `kind`.
fn refusal_kind(error: &TransferError) -> &'static str {
    match error {
        TransferError::StaleList { .. } | TransferError::ForeignList { .. } => "stale_list",
        TransferError::NotConnected { .. } => "not_connected",
        _ => "refused",
    }
}

#[pymethods]
impl PreparedTransfer {
    /// Starts the pairs as one batch: a `PreparedBatch`. `notify` (when given) replaces the
    /// notification sent to the peer once every pair is done, for this post and the next.
    /// Raises TransferError (with `kind` "stale_list", "not_connected" or "refused") when
    /// it cannot be posted; nothing is queued then.
    #[pyo3(signature = (*, notify=None, timeout_s=None))]
    fn post(
        &self,
        py: Python<'_>,
        notify: Option<Vec<u8>>,
        timeout_s: Option<f64>,
    ) -> PyResult<PreparedBatch> {
        check_notify(notify.as_ref())?;
        let deadline = Instant::now() + timeout_of(timeout_s, self.timeout)?;
        let open = self
            .open
            .upgrade()
            .ok_or_else(|| PyRuntimeError::new_err("the engine is closed"))?;
        let notify = {
            let mut kept = self.notify.lock().unwrap_or_else(PoisonError::into_inner);
            if notify.is_some() {
                *kept = notify;
            }
            kept.clone().filter(|bytes| !bytes.is_empty())
        };
        let options = PostOptions {
            notify,
            merge: self.merge,
            deadline: Some(deadline),
        };
        let session_id = &self.session_id;
        let refused = |error: TransferError| {
            Failure {
                peer: session_id.clone(),
                kind: Some(refusal_kind(&error)),
                reason: error.to_string(),
                ..Failure::default()
            }
            .into_err()
        };
        let (batch, totals) = py.detach(|| {
            open.submitters
                .with(|submitter| {
                    submitter
                        .submit_prepared_with(
                            self.op,
                            &self.local,
                            &self.local_indices,
                            &self.remote,
                            &self.remote_indices,
                            &options,
                        )
                        .map(|batch| (batch, submitter.last_prepared()))
                })
                .map_err(refused)?
                .map_err(refused)
        })?;
        Ok(PreparedBatch { batch, totals })
    }

    /// Index pairs it posts.
    fn __len__(&self) -> usize {
        self.local_indices.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "<railyard.PreparedTransfer {} of {} pairs to {}>",
            self.op.as_str(),
            self.local_indices.len(),
            self.session_id
        )
    }
}

/// One post of a `PreparedTransfer`: one request, done when every pair is.
#[pyclass(module = "railyard._native", frozen)]
pub(crate) struct PreparedBatch {
    batch: NativeBatch,
    totals: PreparedTotals,
}

#[pymethods]
impl PreparedBatch {
    /// "DONE", "ERR" or "PROC".
    fn poll(&self) -> &'static str {
        state(&self.batch)
    }

    /// Waits until it resolved or `timeout_s` passed (default: its deadline and a grace, as
    /// `Batch.wait`):
    /// "DONE", "ERR", or "PROC".
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<&'static str> {
        let until = match timeout_s {
            None => self.batch.deadline() + RESOLVE_GRACE,
            Some(seconds) => Instant::now() + wait_of(seconds)?,
        };
        py.detach(|| self.batch.wait(until));
        Ok(state(&self.batch))
    }

    /// `(reason, description)` of its failure — reason as the engine's metrics name it
    /// ("peer_unavailable", "timeout", …) — or None while it has not failed.
    fn failure(&self) -> Option<(&'static str, String)> {
        match self.batch.outcome(0) {
            Some(RequestOutcome::Failed(reason)) => Some((
                reason.as_str(),
                self.batch
                    .failure(0)
                    .map_or_else(|| reason.to_string(), |failure| failure.to_string()),
            )),
            _ => None,
        }
    }

    /// Whether it failed because the peer is gone or unreachable (stopped answering,
    /// restarted, retired), rather than for a reason of its own.
    fn peer_lost(&self) -> bool {
        matches!(
            self.batch.outcome(0),
            Some(RequestOutcome::Failed(
                FailReason::PeerUnavailable
                    | FailReason::PeerRestarted
                    | FailReason::EndpointRetired
                    | FailReason::RetryExceeded
            ))
        )
    }

    /// Descriptor pairs posted.
    #[getter]
    fn pairs(&self) -> usize {
        self.totals.pairs
    }

    /// Runs the pairs became once contiguous ones merged.
    #[getter]
    fn runs(&self) -> usize {
        self.totals.runs
    }

    /// Slices posted.
    #[getter]
    fn slices(&self) -> usize {
        self.totals.slices
    }

    /// Bytes.
    #[getter]
    fn bytes(&self) -> u64 {
        self.totals.bytes
    }

    fn __repr__(&self) -> String {
        format!(
            "<railyard.PreparedBatch of {} pairs ({})>",
            self.totals.pairs,
            state(&self.batch)
        )
    }
}
