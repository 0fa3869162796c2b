//! Engine-allocated memory: a registered region backed by a sealed memfd, so that a peer on
//! the same host can map it and copy into it directly, with no system call per work request.
//!
//! The region table records the memfd's descriptor number beside the registration. A peer
//! that meets the rkey fetches the descriptor with `pidfd_getfd` (the same permission as
//! `process_vm_writev`), maps it once and keeps the mapping for as long as the registration
//! lives; every work request is still checked against the live table first.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::device::SoftDevice;
use super::error::SoftError;
use super::regions::RegionError;
use super::sys::{self, Mapping};
use crate::fabric::{Access, MemoryRegion};

/// What backs a [`SoftBuffer`]'s pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// 2 MiB pages from the hugetlb pool (`/proc/sys/vm/nr_hugepages`).
    HugeTlb,
    /// Normal pages with transparent huge pages requested (the kernel decides, per
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`).
    TransparentHugeAdvised,
    /// Normal 4 KiB pages.
    Normal,
}

impl Backing {
    /// How a person would say it.
    pub fn describe(self) -> &'static str {
        match self {
            Self::HugeTlb => "2 MiB huge pages (hugetlb)",
            Self::TransparentHugeAdvised => "transparent huge pages (advised)",
            Self::Normal => "normal pages",
        }
    }
}

/// Whether the kernel may back shared memory with transparent huge pages at all (the
/// bracketed choice of `shmem_enabled` is neither `never` nor `deny`).
fn shmem_thp_allowed() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .is_ok_and(|setting| !setting.contains("[never]") && !setting.contains("[deny]"))
}

/// Huge page size the allocator tries.
const HUGE_PAGE: usize = 2 << 20;

/// A registered buffer the device allocated. Deregistered, unmapped and closed on drop, in
/// that order.
///
/// Its pages are zero and are faulted in on first touch, or all at once by
/// [`SoftBuffer::prefault`].
#[derive(Debug)]
pub struct SoftBuffer {
    region: MemoryRegion,
    device: SoftDevice,
    map: Mapping,
    memfd: OwnedFd,
    backing: Backing,
    /// Its own registration was withdrawn by its owner: dropping it leaves the region
    /// table alone (the key may name someone else's registration by then).
    own_key_withdrawn: bool,
}

impl SoftDevice {
    /// Allocates and registers `len` bytes with `access`, shareable with same-host peers:
    /// 2 MiB huge pages when `len` is a multiple of 2 MiB and the hugetlb pool has room,
    /// else normal pages with transparent huge pages advised (for 2 MiB or more), else
    /// normal pages. [`SoftBuffer::backing`] says which.
    ///
    /// # Errors
    /// [`SoftError::Io`] when the memory cannot be created or mapped;
    /// [`SoftError::Region`] for zero bytes or when the region table is full.
    pub fn alloc(&self, len: usize, access: Access) -> Result<SoftBuffer, SoftError> {
        if len == 0 {
            return Err(RegionError::BadRange { addr: 0, len: 0 }.into());
        }
        let io = |what| move |source| SoftError::Io { what, source };
        let huge = (len % HUGE_PAGE == 0)
            .then(|| {
                let memfd = sys::sealed_hugetlb_memfd("railyard-buffer", len).ok()?;
                let map = Mapping::new(memfd.as_fd(), len, true).ok()?;
                Some((memfd, map, Backing::HugeTlb))
            })
            .flatten();
        let (memfd, map, backing) = match huge {
            Some(huge) => huge,
            None => {
                let memfd =
                    sys::sealed_memfd("railyard-buffer", len).map_err(io("create a buffer"))?;
                let map = Mapping::new(memfd.as_fd(), len, true).map_err(io("map a buffer"))?;
                let backing = if len >= HUGE_PAGE && shmem_thp_allowed() && map.advise_huge_pages()
                {
                    Backing::TransparentHugeAdvised
                } else {
                    Backing::Normal
                };
                (memfd, map, backing)
            }
        };
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
            memfd,
            backing,
            own_key_withdrawn: false,
        })
    }

    /// Registers another device's buffer on this device too (one registration per rail),
    /// keeping it shareable: peers map it through this device's table as well.
    ///
    /// # Safety
    /// `buffer` must outlive this registration: deregister it here before dropping the
    /// buffer.
    ///
    /// # Errors
    /// [`SoftError::Region`] when the region table is full.
    pub unsafe fn register_buffer(
        &self,
        buffer: &SoftBuffer,
        access: Access,
    ) -> Result<MemoryRegion, SoftError> {
        let key = self.table().register(
            buffer.region.addr,
            buffer.region.len,
            access,
            Some(buffer.memfd.as_raw_fd()),
        )?;
        Ok(MemoryRegion {
            lkey: key,
            rkey: key,
            access,
            ..buffer.region
        })
    }
}

impl SoftBuffer {
    /// Its registration.
    pub fn region(&self) -> MemoryRegion {
        self.region
    }

    /// Says that its own registration ([`Self::region`]) was withdrawn with
    /// [`SoftDevice::deregister`] (new keys took its place): dropping the buffer then does
    /// not withdraw that key again.
    pub fn own_key_withdrawn(&mut self) {
        self.own_key_withdrawn = true;
    }

    /// What backs its pages.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Faults every page in now, so that no transfer takes a page fault later. Call it
    /// before any transfer uses the buffer (and after binding it to a NUMA node, if at all).
    pub fn prefault(&mut self) {
        // SAFETY:
        // - `&mut self`: no slice of this process borrows the buffer, and the contract of
        //   this call is that no transfer uses it yet; each page keeps its contents.
        unsafe { self.map.prefault() }
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
        if !self.own_key_withdrawn {
            let _ = self.device.deregister(&self.region);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::fabric::soft::SoftConfig;

    /// Caught: a buffer whose own key its owner had withdrawn (a re-registration) withdrew
    /// that key again when dropped — by then, after the slot's generations wrapped, the key
    /// of someone else's live registration.
    #[test]
    fn a_buffer_whose_key_was_withdrawn_leaves_the_keys_reuse_alone() {
        let device = SoftDevice::open("own-key", SoftConfig::default()).expect("device");
        let mut buffer = device.alloc(4096, Access::ALL).expect("buffer");
        let own = buffer.region();
        device.deregister(&own).expect("withdrawn by its owner");
        buffer.own_key_withdrawn();
        let memory = [0u8; 64];
        let reused = loop {
            // SAFETY: `memory` outlives every registration of it (all withdrawn below or
            // before it drops).
            let other = unsafe { device.register(memory.as_ptr(), memory.len(), Access::ALL) }
                .expect("registered");
            if other.rkey == own.rkey {
                break other;
            }
            device.deregister(&other).expect("withdrawn");
        };
        drop(buffer);
        assert!(
            device.table().lookup(reused.rkey).is_some(),
            "the other registration under the reused key is still live"
        );
        device.deregister(&reused).expect("withdrawn");
    }
}
