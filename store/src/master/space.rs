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
    /// The pieces after the first, for an extent a rebuild reserved in several (empty
    /// otherwise: no allocation).
    more: Vec<Allocation>,
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
    /// before it or lies outside the segment. A fresh allocator has one free region, and
    /// reserving from its front in turn — each gap, then each extent — puts every extent at
    /// its old offset (checked); the gaps are then freed.
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
            let (Ok(at), Ok(front), Ok(granules)) = (
                u32::try_from(offset / GRANULE),
                u32::try_from(end / GRANULE),
                u32::try_from(len.div_ceil(GRANULE)),
            ) else {
                taken.push(None);
                continue;
            };
            if !fits {
                taken.push(None);
                continue;
            }
            if at > front {
                match space.take_front(front, at - front) {
                    Some(pieces) => gaps.extend(pieces),
                    None => {
                        taken.push(None);
                        continue;
                    }
                }
            }
            let Some(mut pieces) = space.take_front(at, granules) else {
                // The gap stays reserved until the end: the front moved past it.
                end = offset;
                taken.push(None);
                continue;
            };
            let handle = pieces.remove(0);
            let reserved = u64::from(granules) * GRANULE;
            space.reserved += reserved;
            space.extents += 1;
            end = offset + reserved;
            taken.push(Some(Extent {
                offset,
                reserved,
                handle,
                more: pieces,
            }));
        }
        for gap in gaps {
            space.allocator.free(gap);
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
            more: Vec::new(),
        })
    }

    /// Returns `extent`'s space.
    pub(crate) fn free(&mut self, extent: Extent) {
        self.reserved -= extent.reserved;
        self.extents -= 1;
        self.allocator.free(extent.handle);
        for piece in extent.more {
            self.allocator.free(piece);
        }
    }

    /// Reserves `granules` granules at granule `at`, the front of the one free region, in
    /// as many pieces as the allocator's size classes need (it refuses a request close to
    /// the size of the region it would come from); `None`, with nothing reserved, when a
    /// piece lands elsewhere or cannot be had.
    fn take_front(&mut self, at: u32, granules: u32) -> Option<Vec<Allocation>> {
        let mut pieces = Vec::new();
        let mut taken = 0u32;
        let mut asked = granules;
        while taken < granules {
            match self.allocator.allocate(asked.min(granules - taken)) {
                Some(piece) if piece.offset == at + taken => {
                    taken += self.allocator.allocation_size(piece);
                    pieces.push(piece);
                    asked = granules - taken;
                }
                Some(elsewhere) => {
                    self.allocator.free(elsewhere);
                    break;
                }
                None if asked > 1 => asked /= 2,
                None => break,
            }
        }
        if taken == granules {
            return Some(pieces);
        }
        for piece in pieces {
            self.allocator.free(piece);
        }
        None
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
