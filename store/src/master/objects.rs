//! The object table's records: an object's complete version, the write in progress, its
//! lease, pins and recency — and what makes an object readable, removable or evictable.

use serde::{Deserialize, Serialize};

use std::collections::{BTreeSet, HashSet};
use std::time::Instant;

use crate::master::segments::{ClientId, SegmentId};
use crate::master::space::Extent;

/// A write in progress, as the master names it: put-end and put-revoke must name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PutId(pub u64);

/// One replica's space.
pub(crate) struct Replica {
    pub(crate) segment: SegmentId,
    pub(crate) extent: Extent,
}

/// A value's replicas.
pub(crate) struct Version {
    pub(crate) size: u64,
    pub(crate) replicas: Vec<Replica>,
    /// The write that made it: a put-end asked again for it answers as the first did.
    pub(crate) put: PutId,
}

/// A write between put-start and put-end.
pub(crate) struct Write {
    pub(crate) version: Version,
    pub(crate) writer: ClientId,
    pub(crate) put: PutId,
    /// Past it, the write is abandoned (and its space fenced).
    pub(crate) deadline: Instant,
    /// Pins the object takes when the write completes.
    pub(crate) soft_pin: Option<std::time::Duration>,
    pub(crate) hard_pin: bool,
}

/// An object: at most one complete version (readable) and at most one write (an upsert
/// writes its new version while the old one stays readable).
pub(crate) struct Object {
    pub(crate) complete: Option<Version>,
    pub(crate) write: Option<Write>,
    /// Readers hold the complete version until then.
    pub(crate) lease_until: Option<Instant>,
    /// The master's logical clock at the last read or completed write (eviction order).
    pub(crate) last_used: u64,
    pub(crate) soft_pin_until: Option<Instant>,
    pub(crate) hard_pin: bool,
}

impl Object {
    /// A reader holds a lease on it.
    pub(crate) fn leased(&self, now: Instant) -> bool {
        self.lease_until.is_some_and(|until| until > now)
    }

    /// Soft-pinned now (evicted only after every unpinned object).
    pub(crate) fn soft_pinned(&self, now: Instant) -> bool {
        self.soft_pin_until.is_some_and(|until| until > now)
    }

    /// Eviction may take it: complete, not being written, not leased, not hard-pinned.
    pub(crate) fn evictable(&self, now: Instant) -> bool {
        self.complete.is_some() && self.write.is_none() && !self.hard_pin && !self.leased(now)
    }
}

/// What changed since the journal last took it (see `journal.rs`).
#[derive(Default)]
pub(crate) struct Dirty {
    /// Keys whose complete version changed (or went), in the order first touched.
    pub(crate) objects: Vec<String>,
    /// The same keys, to touch each once.
    pub(crate) touched: HashSet<String>,
    /// Segments mounted or gone.
    pub(crate) segments: BTreeSet<SegmentId>,
    /// Clients that started their first write of this term.
    pub(crate) writers: Vec<ClientId>,
    /// Writers of earlier terms fenced everywhere, with their term.
    pub(crate) forgotten: Vec<(ClientId, u64)>,
}
