//! The store's client: a process's view of the store through its [`railyard_engine::Engine`]
//! — mounting segments, putting and getting objects zero-copy through the engine, batches —
//! talking to the master over one admitted connection.

mod in_flight;
pub(crate) mod link;
mod staging;
mod store;

pub(crate) use in_flight::InFlight;
pub(crate) use store::RESOLVE_GRACE;
pub use store::{LocalRange, Store, StoreOptions};
