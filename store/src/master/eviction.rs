//! Eviction: when usage passes the high watermark or a write finds no space, which objects
//! go — least recently used first, soft-pinned ones last, never a leased, incomplete or
//! hard-pinned one — and how much.

use std::time::Instant;

use crate::master::core::MasterCore;

impl MasterCore {
    /// Whether the space reserved on segments that take writes is above the high watermark.
    pub(super) fn over_watermark(&self) -> bool {
        let (capacity, reserved) = self.segments.usage();
        capacity > 0 && reserved as f64 > self.policy.eviction_high_watermark * capacity as f64
    }

    /// Bytes one eviction round frees: the eviction ratio of the space that takes writes.
    pub(super) fn eviction_target(&self) -> u64 {
        let (capacity, _) = self.segments.usage();
        (self.policy.eviction_ratio * capacity as f64).ceil() as u64
    }

    /// Evicts objects until their values add up to `want` bytes or nothing evictable is
    /// left; returns the bytes freed (one replica each).
    pub(super) fn evict(&mut self, want: u64, now: Instant) -> u64 {
        let mut candidates: Vec<(bool, u64, String)> = self
            .objects
            .iter()
            .filter(|(_, object)| object.evictable(now))
            // Freeing only suspected or draining segments makes no room for new writes.
            .filter(|(_, object)| {
                object.complete.as_ref().is_some_and(|version| {
                    version
                        .replicas
                        .iter()
                        .any(|r| self.segments.writable_id(r.segment))
                })
            })
            .map(|(key, object)| (object.soft_pinned(now), object.last_used, key.clone()))
            .collect();
        // Unpinned before soft-pinned, then least recently used first.
        candidates.sort_unstable();
        let mut freed = 0;
        for (_, _, key) in candidates {
            if freed >= want {
                break;
            }
            let Some(version) = self.objects.remove(&key).and_then(|object| object.complete) else {
                continue;
            };
            freed += version.size;
            self.touched(&key);
            self.counters.evictions += 1;
            self.counters.evicted_bytes += version.size;
            for replica in version.replicas {
                self.segments.free(replica.segment, replica.extent);
            }
        }
        freed
    }
}
