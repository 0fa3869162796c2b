//! The store's master: the sans-IO state machine that holds the store's metadata — mounted
//! segments and their free space, objects and where their replicas live, writes in
//! progress, leases and pins — and never touches data.
//!
//! [`MasterCore`] is fed requests and the time and answers with results; what others must do
//! comes out as [`MasterAction`]s. Files by concern: `space.rs` (a segment's allocator),
//! `segments.rs` (mounting and placement), `objects.rs` (the object table's records),
//! `core.rs` (writes, reads, removal, fences, timers), `eviction.rs` (what goes when space
//! runs short), `members.rs` (which contributing processes are alive, suspected or gone), `journal.rs`
//! (what another master needs to take over, and taking over).

mod core;
mod eviction;
mod journal;
mod members;
mod objects;
mod segments;
mod space;

pub use self::core::{
    FenceId, MasterAction, MasterCore, MasterCounters, MasterStats, ObjectLease, PutTicket,
    ReplicaDescriptor, SegmentUsage,
};
pub use journal::{
    JournalEntry, ObjectRecord, RebuildReport, ReplicaRecord, SegmentRecord, Snapshot,
};
pub use objects::PutId;
pub use segments::{ClientId, SegmentId, SegmentSpec};
pub use space::{GRANULE, MAX_SEGMENT_BYTES};

#[cfg(test)]
mod tests;
