//! The bounce buffer for values the caller hands over as plain bytes (`put`, `get`): one
//! engine-registered region carved into chunks, so such values move through the engine too.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use offset_allocator::{Allocation, Allocator};
use railyard_engine::{Engine, MemoryError, Region};

/// Chunks are carved in units of this many bytes.
const UNIT: u64 = 4096;

/// A registered region and which of its chunks are in use.
pub(crate) struct Staging {
    region: Region,
    free: Mutex<Allocator>,
    returned: Condvar,
}

/// A chunk of the staging region, returned on drop.
pub(crate) struct Chunk<'a> {
    staging: &'a Staging,
    allocation: Option<Allocation>,
    /// Offset in the staging region.
    pub(crate) offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

impl Staging {
    /// Allocates and registers `len` bytes (at least one unit).
    pub(crate) fn new(engine: &Engine, len: u64) -> Result<Self, MemoryError> {
        let units = u32::try_from((len / UNIT).max(1)).unwrap_or(u32::MAX);
        let region = engine.alloc(u64::from(units) * UNIT, None)?;
        Ok(Self {
            region,
            free: Mutex::new(Allocator::with_max_allocs(units, units.clamp(2, 1 << 16))),
            returned: Condvar::new(),
        })
    }

    /// The registered region.
    pub(crate) fn region(&self) -> Region {
        self.region
    }

    /// The largest chunk one call hands out.
    pub(crate) fn max_chunk(&self) -> u64 {
        self.region.len / 4
    }

    fn lock(&self) -> MutexGuard<'_, Allocator> {
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A chunk of at most `want` bytes (and at most [`Self::max_chunk`]), waiting for
    /// another caller to return one when all are in use.
    pub(crate) fn chunk(&self, want: u64) -> Chunk<'_> {
        let len = want.clamp(1, self.max_chunk().max(UNIT));
        let units = u32::try_from(len.div_ceil(UNIT)).unwrap_or(u32::MAX);
        let mut free = self.lock();
        loop {
            if let Some(allocation) = free.allocate(units) {
                return Chunk {
                    staging: self,
                    offset: u64::from(allocation.offset) * UNIT,
                    allocation: Some(allocation),
                    len,
                };
            }
            free = self
                .returned
                .wait(free)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Chunk<'_> {
    /// The chunk's bytes.
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY:
        // - The staging region is engine-allocated memory of `region.len` bytes, mapped for
        //   the engine's life (the store holds the engine), and `offset + len` lies inside it.
        // - This chunk is the only holder of its range until it is dropped, and no transfer
        //   of it is in flight while the caller holds this borrow (transfers are waited for
        //   before the chunk is used again or dropped).
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.staging.region.addr + self.offset) as *mut u8,
                self.len as usize,
            )
        }
    }
}

impl Drop for Chunk<'_> {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            self.staging.lock().free(allocation);
            self.staging.returned.notify_all();
        }
    }
}
