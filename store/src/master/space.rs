//! A segment's free space: an offset allocator (the `offset-allocator` crate, the allocator
//! Mooncake Store uses too) over 64-byte granules, and the bytes it has handed out.

use offset_allocator::{Allocation, Allocator};

/// The unit of allocation: every extent starts at a multiple of it.
pub const GRANULE: u64 = 64;

/// The largest segment one allocator manages (its offsets count granules in a `u32`).
pub const MAX_SEGMENT_BYTES: u64 = GRANULE * (u32::MAX as u64);

/// The most extents live at once in one segment.
const MAX_EXTENTS: u32 = 1 << 20;

/// A segment's space.
pub(crate) struct Space {
    allocator: Allocator,
    capacity: u64,
    /// Bytes reserved by live extents (rounded up by the allocator's bins).
    reserved: u64,
    extents: u32,
}

/// Space reserved for one replica. Not `Clone`: an extent is freed exactly once, by moving
/// it back into [`Space::free`].
pub(crate) struct Extent {
    /// Offset of its first byte from the segment's base.
    pub(crate) offset: u64,
    /// Bytes reserved (at least the value's size).
    reserved: u64,
    handle: Allocation,
}

impl Space {
    /// The space of a segment of `capacity` bytes, rounded down to whole granules (the
    /// caller has checked it is at least one granule and at most [`MAX_SEGMENT_BYTES`]).
    pub(crate) fn new(capacity: u64) -> Self {
        let granules = u32::try_from(capacity / GRANULE).unwrap_or(u32::MAX);
        Self {
            allocator: Allocator::with_max_allocs(granules, granules.clamp(2, MAX_EXTENTS)),
            capacity: u64::from(granules) * GRANULE,
            reserved: 0,
            extents: 0,
        }
    }

    /// The space of a segment of `capacity` bytes with each of `extents` (offset, bytes;
    /// sorted by offset) reserved exactly where it was: `None` for one that overlaps the one
    /// before it or cannot be placed there. A fresh allocator hands out its one free region
    /// front to back, so reserving each gap and each extent in turn puts every extent at its
    /// old offset (checked); the gaps are then freed.
    pub(crate) fn restore(capacity: u64, extents: &[(u64, u64)]) -> (Self, Vec<Option<Extent>>) {
        let mut space = Self::new(capacity);
        let mut taken = Vec::with_capacity(extents.len());
        let mut gaps = Vec::new();
        let mut end = 0u64;
        for &(offset, len) in extents {
            let fits = offset % GRANULE == 0
                && offset >= end
                && len > 0
                && offset
                    .checked_add(len)
                    .is_some_and(|last| last <= space.capacity);
            if !fits {
                taken.push(None);
                continue;
            }
            if offset > end {
                match space.allocate(offset - end) {
                    Some(gap) if gap.offset == end => gaps.push(gap),
                    other => {
                        // The allocator did not hand out the front: nothing more can be placed
                        // exactly (what it handed out is freed below).
                        gaps.extend(other);
                        taken.push(None);
                        break;
                    }
                }
            }
            match space.allocate(len) {
                Some(extent) if extent.offset == offset => {
                    end = offset + extent.reserved;
                    taken.push(Some(extent));
                }
                other => {
                    gaps.extend(other);
                    taken.push(None);
                    break;
                }
            }
        }
        taken.resize_with(extents.len(), || None);
        for gap in gaps {
            space.free(gap);
        }
        (space, taken)
    }

    /// Reserves `len` bytes (more than 0), or `None` when no free region is large enough.
    pub(crate) fn allocate(&mut self, len: u64) -> Option<Extent> {
        let granules = u32::try_from(len.div_ceil(GRANULE)).ok()?;
        let handle = self.allocator.allocate(granules)?;
        let reserved = u64::from(self.allocator.allocation_size(handle)) * GRANULE;
        self.reserved += reserved;
        self.extents += 1;
        Some(Extent {
            offset: u64::from(handle.offset) * GRANULE,
            reserved,
            handle,
        })
    }

    /// Returns `extent`'s space.
    pub(crate) fn free(&mut self, extent: Extent) {
        self.reserved -= extent.reserved;
        self.extents -= 1;
        self.allocator.free(extent.handle);
    }

    /// Bytes it manages.
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes reserved by live extents.
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Live extents.
    pub(crate) fn extents(&self) -> u32 {
        self.extents
    }

    /// Whether every byte is free again, as the allocator itself reports it.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        u64::from(self.allocator.storage_report().total_free_space) * GRANULE == self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_granule_aligned_disjoint_and_returned_whole() {
        let mut space = Space::new(1 << 20);
        let a = space.allocate(100).expect("room");
        let b = space.allocate(4096).expect("room");
        assert_eq!(a.offset % GRANULE, 0);
        assert_eq!(b.offset % GRANULE, 0);
        assert!(a.offset + 100 <= b.offset || b.offset + 4096 <= a.offset);
        assert!(space.reserved() >= 4096 + 128);
        space.free(a);
        space.free(b);
        assert_eq!(space.reserved(), 0);
        assert!(space.is_empty());
    }

    #[test]
    fn a_full_segment_says_so_instead_of_overlapping() {
        let mut space = Space::new(4096);
        let whole = space.allocate(4096).expect("the whole segment");
        assert!(space.allocate(1).is_none());
        space.free(whole);
        assert!(space.allocate(4096).is_some());
    }
}
