//! Where descriptors come from. [`Directory`] is the seam a cluster directory (etcd) plugs
//! into; [`P2pDirectory`] is the embedded default: descriptors fetched from each peer's own
//! handshake listener (by the control thread), cached by incarnation, and marked stale when
//! a work request names keys the peer refused.

use std::collections::HashMap;
use std::sync::Arc;

use crate::descriptor::SegmentDescriptor;
use crate::endpoint::Incarnation;

/// A source of peers' segment descriptors, by incarnation: two processes that share a name
/// are two peers.
pub trait Directory: Send {
    /// The cached descriptor of `peer`, unless it is unknown or stale.
    fn lookup(&self, peer: Incarnation) -> Option<Arc<SegmentDescriptor>>;

    /// Records a descriptor just fetched (it replaces what its incarnation had) and returns
    /// it as shared.
    fn record(&mut self, descriptor: SegmentDescriptor) -> Arc<SegmentDescriptor>;

    /// Marks `peer`'s descriptor stale: the next [`Self::lookup`] misses until a fresh one
    /// is recorded.
    fn invalidate(&mut self, peer: Incarnation);

    /// Drops what is cached of `peer`, which is gone, and returns it (stale or not: the
    /// fabrics forget what they learnt from it either way).
    fn forget(&mut self, peer: Incarnation) -> Option<Arc<SegmentDescriptor>>;
}

#[derive(Debug)]
struct Cached {
    descriptor: Arc<SegmentDescriptor>,
    stale: bool,
}

/// The embedded directory: a cache of what peers said about themselves.
#[derive(Debug, Default)]
pub struct P2pDirectory {
    cache: HashMap<Incarnation, Cached>,
}

impl P2pDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// About how many bytes of memory the cache holds: its table and every descriptor in it.
    pub fn footprint(&self) -> usize {
        let table = self.cache.capacity() * (size_of::<(Incarnation, Cached)>() + 1);
        let descriptors: usize = self
            .cache
            .values()
            .map(|cached| cached.descriptor.footprint())
            .sum();
        table + descriptors
    }
}

impl Directory for P2pDirectory {
    fn lookup(&self, peer: Incarnation) -> Option<Arc<SegmentDescriptor>> {
        self.cache
            .get(&peer)
            .filter(|cached| !cached.stale)
            .map(|cached| cached.descriptor.clone())
    }

    fn record(&mut self, descriptor: SegmentDescriptor) -> Arc<SegmentDescriptor> {
        let descriptor = Arc::new(descriptor);
        self.cache.insert(
            descriptor.incarnation,
            Cached {
                descriptor: descriptor.clone(),
                stale: false,
            },
        );
        descriptor
    }

    fn invalidate(&mut self, peer: Incarnation) {
        if let Some(cached) = self.cache.get_mut(&peer) {
            cached.stale = true;
        }
    }

    fn forget(&mut self, peer: Incarnation) -> Option<Arc<SegmentDescriptor>> {
        self.cache.remove(&peer).map(|cached| cached.descriptor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(incarnation: u64, generation: u64) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "decode-0".into(),
            incarnation: Incarnation(incarnation),
            handshake_addr: "127.0.0.1:7000".into(),
            rails: vec![],
            regions: vec![crate::descriptor::RegionDescriptor {
                base: 0x1000,
                len: 64,
                rkeys: vec![7],
                generation,
                access: railyard_dataplane::fabric::Access::ALL,
            }],
        }
    }

    #[test]
    fn descriptors_are_kept_per_incarnation_not_per_name() {
        let mut directory = P2pDirectory::new();
        directory.record(descriptor(1, 1));
        directory.record(descriptor(1, 2));
        assert_eq!(
            directory
                .lookup(Incarnation(1))
                .map(|d| d.regions[0].generation),
            Some(2),
            "a refresh replaces"
        );
        directory.record(descriptor(2, 7));
        assert_eq!(
            directory
                .lookup(Incarnation(1))
                .map(|d| d.regions[0].generation),
            Some(2),
            "another process with the same name does not replace it"
        );
        directory.invalidate(Incarnation(1));
        assert!(directory.lookup(Incarnation(1)).is_none());
        assert!(directory.lookup(Incarnation(2)).is_some());
        assert_eq!(
            directory.forget(Incarnation(1)).map(|d| d.incarnation),
            Some(Incarnation(1)),
            "a stale descriptor is handed back too"
        );
        assert!(directory.forget(Incarnation(2)).is_some());
        assert!(directory.lookup(Incarnation(2)).is_none());
        assert!(directory.forget(Incarnation(2)).is_none());
        assert!(directory.lookup(Incarnation(3)).is_none());
    }
}
