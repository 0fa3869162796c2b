//! `railyard._native`: the railyard engine for Python (see `railyard/_native.pyi` for the
//! documented API). Addresses are plain integers, as `tensor.data_ptr()` gives them; peers
//! are `"host:port"` session strings. Every call that waits (building an engine, opening a
//! peer, a transfer, waiting for notifications) releases the GIL.
//!
//! The Python `Engine` owns an `Arc` of the open engine; `close()` takes it out, and the
//! engine stops once the calls still running with their own `Arc` return.

mod args;
mod batch;
mod engine;
mod errors;
mod logging;
mod open;
mod prepared;
mod store;

use pyo3::prelude::*;

use crate::batch::Batch;
use crate::engine::Engine;
use crate::errors::TransferError;
use crate::prepared::{PreparedBatch, PreparedList, PreparedTransfer};
use crate::store::{ObjectNotFound, Store, StoreError};

/// The `railyard._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // At import, before any engine starts a thread: it writes the environment libfabric
    // reads when it starts.
    railyard_engine::dataplane::fabric::ofi::settle_parameters();
    logging::install(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "METRICS_CONTENT_TYPE",
        railyard_engine::metrics::CONTENT_TYPE,
    )?;
    m.add("MAX_NOTIFY", railyard_engine::control::wire::MAX_NOTIFY)?;
    m.add("TransferError", m.py().get_type::<TransferError>())?;
    m.add_class::<Engine>()?;
    m.add_class::<Batch>()?;
    m.add_class::<PreparedList>()?;
    m.add_class::<PreparedTransfer>()?;
    m.add_class::<PreparedBatch>()?;
    m.add("StoreError", m.py().get_type::<StoreError>())?;
    m.add("ObjectNotFound", m.py().get_type::<ObjectNotFound>())?;
    m.add_class::<Store>()?;
    Ok(())
}
