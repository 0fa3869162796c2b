//! Where descriptors come from. [`Directory`] is the seam a cluster directory (etcd) plugs
//! into; [`P2pDirectory`] is the embedded default: descriptors fetched from each peer's own
//! handshake listener (by the control thread), cached with their incarnation, and marked
//! stale when a work request names keys the peer refused or the peer's incarnation changed.

use std::collections::HashMap;
use std::sync::Arc;

use crate::descriptor::SegmentDescriptor;
use crate::endpoint::Incarnation;

/// A source of peers' segment descriptors.
pub trait Directory: Send {
    /// The cached descriptor of segment `name`, unless it is unknown or stale.
    fn lookup(&self, name: &str) -> Option<Arc<SegmentDescriptor>>;

    /// Records a descriptor just fetched; returns what the cache held for that name before
    /// when it was another incarnation (the peer restarted).
    fn record(&mut self, descriptor: SegmentDescriptor) -> Option<Incarnation>;

    /// Marks `name`'s descriptor stale: the next [`Self::lookup`] misses until a fresh one
    /// is recorded.
    fn invalidate(&mut self, name: &str);
}

#[derive(Debug)]
struct Cached {
    descriptor: Arc<SegmentDescriptor>,
    stale: bool,
}

/// The embedded directory: a cache of what peers said about themselves.
#[derive(Debug, Default)]
pub struct P2pDirectory {
    cache: HashMap<String, Cached>,
}

impl P2pDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Directory for P2pDirectory {
    fn lookup(&self, name: &str) -> Option<Arc<SegmentDescriptor>> {
        self.cache
            .get(name)
            .filter(|cached| !cached.stale)
            .map(|cached| cached.descriptor.clone())
    }

    fn record(&mut self, descriptor: SegmentDescriptor) -> Option<Incarnation> {
        let incarnation = descriptor.incarnation;
        let previous = self.cache.insert(
            descriptor.name.clone(),
            Cached {
                descriptor: Arc::new(descriptor),
                stale: false,
            },
        );
        previous
            .map(|cached| cached.descriptor.incarnation)
            .filter(|&old| old != incarnation)
    }

    fn invalidate(&mut self, name: &str) {
        if let Some(cached) = self.cache.get_mut(name) {
            cached.stale = true;
        }
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
            }],
        }
    }

    #[test]
    fn a_refresh_replaces_and_a_new_incarnation_is_reported() {
        let mut directory = P2pDirectory::new();
        assert_eq!(directory.record(descriptor(1, 1)), None);
        assert_eq!(directory.record(descriptor(1, 2)), None, "same process");
        assert_eq!(
            directory
                .lookup("decode-0")
                .map(|d| d.regions[0].generation),
            Some(2)
        );
        directory.invalidate("decode-0");
        assert!(directory.lookup("decode-0").is_none());
        assert_eq!(directory.record(descriptor(2, 1)), Some(Incarnation(1)));
        assert!(directory.lookup("decode-0").is_some());
        assert!(directory.lookup("prefill-0").is_none());
    }
}
