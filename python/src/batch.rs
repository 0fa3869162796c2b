//! The Python `Batch` class: transfers started with `Engine.submit`, polled or waited on,
//! and the failures of their requests.

use std::time::{Duration, Instant};

use pyo3::prelude::*;
use railyard_engine::RawTransfer;
use railyard_engine::dataplane::{Batch as NativeBatch, FailReason};

use crate::args::wait_of;

/// How long `Batch.wait()` without a timeout waits past the batch's deadline (the poller
/// fails what is overdue at the deadline, and posted work once its flush comes back; this is
/// slack for a busy machine).
pub(crate) const RESOLVE_GRACE: Duration = Duration::from_secs(2);

/// Transfers started with `Engine.submit`.
#[pyclass(module = "railyard._native", frozen)]
pub(crate) struct Batch {
    pub(crate) batch: NativeBatch,
    pub(crate) session_id: String,
    pub(crate) transfers: Vec<RawTransfer>,
}

/// "DONE", "ERR" (every request resolved, one failed) or "PROC".
pub(crate) fn state(batch: &NativeBatch) -> &'static str {
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
