//! Host memory for rails that register it themselves (verbs): an anonymous mapping, with 2 MiB
//! huge pages from the hugetlb pool when it has them, else transparent huge pages advised
//! when the kernel allows them, else normal pages — and a report of which.

use std::io;
use std::ptr::NonNull;

use railyard_dataplane::fabric::soft::Backing;

const HUGE_PAGE: usize = 2 << 20;

/// An anonymous mapping, unmapped on drop.
///
/// # Invariants
/// `ptr..ptr + len` is a live private anonymous mapping owned by this value.
#[derive(Debug)]
pub(crate) struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY:
// - Plain memory owned by this value; concurrent access to its bytes is the RDMA contract
//   (transfers resolve before the application reads what they wrote).
unsafe impl Send for HostMemory {}
// SAFETY: as for Send.
unsafe impl Sync for HostMemory {}

fn map(len: usize, extra: libc::c_int) -> Option<NonNull<u8>> {
    // SAFETY:
    // - A fresh anonymous mapping chosen by the kernel overlaps nothing we own.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        None
    } else {
        NonNull::new(ptr.cast())
    }
}

fn thp_allowed() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|setting| !setting.contains("[never]"))
}

impl HostMemory {
    /// Maps `len` bytes (more than 0).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        if len % HUGE_PAGE == 0 {
            if let Some(ptr) = map(len, libc::MAP_HUGETLB) {
                return Ok(Self {
                    ptr,
                    len,
                    backing: Backing::HugeTlb,
                });
            }
        }
        let ptr = map(len, 0).ok_or_else(io::Error::last_os_error)?;
        let advised = len >= HUGE_PAGE && thp_allowed() && {
            // SAFETY: the range is exactly the mapping just made; advice changes no contents.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) == 0 }
        };
        Ok(Self {
            ptr,
            len,
            backing: if advised {
                Backing::TransparentHugeAdvised
            } else {
                Backing::Normal
            },
        })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn backing(&self) -> Backing {
        self.backing
    }

    /// The bytes, for binding to a NUMA node before they are touched.
    ///
    /// # Safety
    /// Nothing may write the memory while the slice lives.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live and `len` bytes long (invariant); the caller excludes
        // writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Touches every page so that none faults on the data path.
    pub(crate) fn prefault(&mut self) {
        for offset in (0..self.len).step_by(4096) {
            // SAFETY: inside the live writable mapping; `&mut self` excludes other users.
            unsafe { self.ptr.as_ptr().add(offset).write_volatile(0) };
        }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: our mapping (invariant); registrations of it are withdrawn before the
        // engine drops the memory.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Whether `addr..addr + len` is covered, without a gap, by mappings of this process that
/// are readable and writable (`/proc/self/maps`). Device memory a GPU driver maps into the
/// address space (CUDA's unified addresses) is not mapped there like this, nor is an address
/// nothing backs. `false` when the table cannot be read.
pub(crate) fn mapped_read_write(addr: u64, len: u64) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let mut mappings: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, stop) = fields.next()?.split_once('-')?;
            let perms = fields.next()?;
            (perms.starts_with("rw")).then_some(())?;
            Some((
                u64::from_str_radix(start, 16).ok()?,
                u64::from_str_radix(stop, 16).ok()?,
            ))
        })
        .collect();
    mappings.sort_unstable();
    let mut covered = addr;
    for (start, stop) in mappings {
        if start > covered {
            break;
        }
        covered = covered.max(stop);
        if covered >= end {
            return true;
        }
    }
    false
}

/// This host's memory in bytes (`MemTotal`), if `/proc/meminfo` says.
pub(crate) fn host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_readable_writable_mappings_of_this_process_are_host_memory() {
        let memory = HostMemory::new(4 << 20).expect("maps");
        assert!(mapped_read_write(memory.addr(), 4 << 20));
        assert!(mapped_read_write(memory.addr() + 4096, 4096));
        // Past its end, a wrapping range, an address nothing maps, read-only code.
        assert!(!mapped_read_write(memory.addr(), (4 << 20) + (1 << 30)));
        assert!(!mapped_read_write(u64::MAX - 10, 100));
        assert!(!mapped_read_write(0x1000, 4096));
        let code = mapped_read_write as *const () as u64;
        assert!(!mapped_read_write(code, 16));
    }

    #[test]
    fn host_memory_maps_reports_its_backing_and_prefaults() {
        let mut memory = HostMemory::new(4 << 20).expect("maps");
        assert!(matches!(
            memory.backing(),
            Backing::HugeTlb | Backing::TransparentHugeAdvised | Backing::Normal
        ));
        memory.prefault();
        // SAFETY: nothing writes it now.
        assert!(unsafe { memory.as_slice() }.iter().all(|&b| b == 0));
        assert!(HostMemory::new(0).is_err());
        assert_eq!(
            HostMemory::new(4096).expect("maps").backing(),
            Backing::Normal
        );
    }
}
