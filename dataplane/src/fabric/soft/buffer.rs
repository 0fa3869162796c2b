//! Engine-allocated memory: a registered region backed by a sealed memfd, so that a peer on
//! the same host can map it and copy into it directly, with no system call per work request.
//!
//! The region table records the memfd's descriptor number beside the registration. A peer
//! that meets the rkey fetches the descriptor with `pidfd_getfd` (the same permission as
//! `process_vm_writev`), maps it once and keeps the mapping for as long as the registration
//! lives; every work request is still checked against the live table first.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::sys::{self, Mapping};
use super::{RegionError, SoftDevice, SoftError};
use crate::fabric::{Access, MemoryRegion};

/// A registered buffer the device allocated. Deregistered, unmapped and closed on drop, in
/// that order.
///
/// Its pages are zero and are faulted in on first touch.
#[derive(Debug)]
pub struct SoftBuffer {
    region: MemoryRegion,
    device: SoftDevice,
    map: Mapping,
    /// Kept open while registered: peers fetch it by number.
    _memfd: OwnedFd,
}

impl SoftDevice {
    /// Allocates and registers `len` bytes with `access`, shareable with same-host peers.
    ///
    /// # Errors
    /// [`SoftError::Io`] when the memory cannot be created or mapped;
    /// [`SoftError::Region`] when the region table is full.
    pub fn alloc(&self, len: usize, access: Access) -> Result<SoftBuffer, SoftError> {
        if len == 0 {
            return Err(RegionError::BadRange { addr: 0, len: 0 }.into());
        }
        let io = |what| move |source| SoftError::Io { what, source };
        let memfd = sys::sealed_memfd("railyard-buffer", len).map_err(io("create a buffer"))?;
        let map = Mapping::new(memfd.as_fd(), len, true).map_err(io("map a buffer"))?;
        let key = self
            .table()
            .register(map.addr(), len as u64, access, Some(memfd.as_raw_fd()))?;
        Ok(SoftBuffer {
            region: MemoryRegion {
                addr: map.addr(),
                len: len as u64,
                lkey: key,
                rkey: key,
                access,
            },
            device: self.clone(),
            map,
            _memfd: memfd,
        })
    }
}

impl SoftBuffer {
    /// Its registration.
    pub fn region(&self) -> MemoryRegion {
        self.region
    }

    /// Its first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.addr() as *mut u8
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it is empty (never: allocation refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Its bytes.
    ///
    /// # Safety
    /// No work request may write into the buffer (a local READ or a peer's WRITE) while the
    /// slice lives: wait for their completions first, as with any RDMA buffer.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY:
        // - The mapping is live, readable and `len` bytes long for as long as `self`.
        // - The caller promises no concurrent writer (see # Safety).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// Its bytes, for writing.
    ///
    /// # Safety
    /// No work request may read or write the buffer while the slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY:
        // - The mapping is live, writable and `len` bytes long for as long as `self`, and
        //   `&mut self` excludes other slices of it in this process.
        // - The caller promises no concurrent transfer (see # Safety).
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }
}

impl Drop for SoftBuffer {
    fn drop(&mut self) {
        // Deregister before the descriptor closes: a peer that fetched the descriptor and
        // then still sees the key live knows it got this memfd (see `nic`).
        let _ = self.device.deregister(&self.region);
    }
}
