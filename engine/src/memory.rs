//! Host memory for rails that register it themselves (verbs): private memory of this
//! process, 2 MiB huge pages from the hugetlb pool when it has enough (allocated by
//! `hugepage-rs`), else an anonymous mapping (`memmap2`) with transparent huge pages advised
//! when the kernel allows them, else normal pages — and a report of which.

use std::alloc::Layout;
use std::io;
use std::ptr::NonNull;

use railyard_dataplane::fabric::soft::Backing;

const HUGE_PAGE: usize = 2 << 20;

/// Private memory of this process, freed on drop.
///
/// # Invariants
/// `pages` holds `len` bytes of live, readable and writable memory owned by this value.
/// Concurrent access to its bytes is the RDMA contract (transfers resolve before the
/// application reads what they wrote).
#[derive(Debug)]
pub struct HostMemory {
    pages: Pages,
    len: usize,
    backing: Backing,
}

/// Where a [`HostMemory`]'s bytes come from.
#[derive(Debug)]
enum Pages {
    /// 2 MiB pages of the hugetlb pool, from `hugepage_rs::alloc` with this layout.
    HugeTlb { first: NonNull<u8>, layout: Layout },
    /// An anonymous mapping.
    Mapped(memmap2::MmapRaw),
}

// SAFETY:
// - The memory is plain bytes owned by this value (hugetlb pages, or a mapping); the RDMA
//   contract above governs concurrent access, as for the mapping, which is Send and Sync.
unsafe impl Send for Pages {}
// SAFETY: as for Send.
unsafe impl Sync for Pages {}

impl Drop for Pages {
    fn drop(&mut self) {
        if let Self::HugeTlb { first, layout } = *self {
            // SAFETY:
            // - `first` came from `hugepage_rs::alloc` with this `layout` (the variant's
            //   invariant) and is freed once, here.
            // - Registrations of it are withdrawn before the engine drops the memory.
            unsafe { hugepage_rs::dealloc(first.as_ptr(), layout) };
        }
    }
}

impl Pages {
    fn first(&self) -> *mut u8 {
        match self {
            Self::HugeTlb { first, .. } => first.as_ptr(),
            Self::Mapped(map) => map.as_mut_ptr(),
        }
    }
}

/// Free bytes of the hugetlb pool, when its default page size is 2 MiB (what
/// `hugepage-rs` allocates and our alignment assumes); 0 otherwise.
fn hugetlb_free_bytes() -> usize {
    match (meminfo("Hugepagesize:"), meminfo("HugePages_Free:")) {
        (Some(2048), Some(free)) => usize::try_from(free)
            .unwrap_or(usize::MAX)
            .saturating_mul(HUGE_PAGE),
        _ => 0,
    }
}

/// The number after `field` (e.g. `"MemTotal:"`) in `/proc/meminfo`, in its own unit.
fn meminfo(field: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn thp_allowed() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|setting| !setting.contains("[never]"))
}

impl HostMemory {
    /// `len` bytes (more than 0).
    ///
    /// # Errors
    /// `InvalidInput` for 0 bytes; the mapping's error when there is no memory to map.
    pub fn new(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        if len % HUGE_PAGE == 0 && hugetlb_free_bytes() >= len {
            let layout = Layout::from_size_align(len, HUGE_PAGE)
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            // Null when the pool ran dry meanwhile: normal pages below.
            // SAFETY: a layout of `len` (more than 0) bytes; the memory is owned by the value
            // returned and freed with the same layout on drop.
            let first = unsafe { hugepage_rs::alloc(layout) };
            if let Some(first) = NonNull::new(first) {
                return Ok(Self {
                    pages: Pages::HugeTlb { first, layout },
                    len,
                    backing: Backing::HugeTlb,
                });
            }
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_anon()
            .map(memmap2::MmapRaw::from)?;
        let advised =
            len >= HUGE_PAGE && thp_allowed() && map.advise(memmap2::Advice::HugePage).is_ok();
        Ok(Self {
            pages: Pages::Mapped(map),
            len,
            backing: if advised {
                Backing::TransparentHugeAdvised
            } else {
                Backing::Normal
            },
        })
    }

    /// Its first byte's address.
    pub fn addr(&self) -> u64 {
        self.pages.first() as u64
    }

    /// Its length in bytes.
    #[allow(
        clippy::len_without_is_empty,
        reason = "never empty: `new` refuses 0 bytes"
    )]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Which pages it got.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The bytes, for binding to a NUMA node before they are touched.
    ///
    /// # Safety
    /// Nothing may write the memory while the slice lives.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live and `len` bytes long (invariant); the caller excludes
        // writers.
        unsafe { std::slice::from_raw_parts(self.pages.first(), self.len) }
    }

    /// Touches every page so that none faults on the data path.
    pub(crate) fn prefault(&mut self) {
        for offset in (0..self.len).step_by(4096) {
            // SAFETY: inside the live writable mapping; `&mut self` excludes other users.
            unsafe { self.pages.first().add(offset).write_volatile(0) };
        }
    }
}

/// This process's readable and writable mappings, read once from `/proc/self/maps`, sorted
/// by start: what registration checks ranges against. Device memory a GPU driver maps into
/// the address space (CUDA's unified addresses) is not mapped there like this, nor is an
/// address nothing backs.
pub(crate) struct ReadWriteMappings(Vec<(u64, u64)>);

impl ReadWriteMappings {
    /// The mappings now; `None` when `/proc/self/maps` cannot be read.
    pub(crate) fn read() -> Option<Self> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
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
        Some(Self(mappings))
    }

    /// Whether `addr..addr + len` lies inside them (adjacent mappings joined).
    pub(crate) fn cover(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        // Start from the last mapping starting at or before `addr`.
        let from = self.0.partition_point(|&(start, _)| start <= addr);
        let Some(first) = from.checked_sub(1) else {
            return false;
        };
        let mut covered = addr;
        for &(start, stop) in &self.0[first..] {
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
}

/// This host's memory in bytes (`MemTotal`), if `/proc/meminfo` says.
pub(crate) fn host_memory() -> Option<u64> {
    meminfo("MemTotal:")?.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_readable_writable_mappings_of_this_process_are_host_memory() {
        let memory = HostMemory::new(4 << 20).expect("maps");
        let mapped_read_write = |addr: u64, len: u64| {
            ReadWriteMappings::read().is_some_and(|mappings| mappings.cover(addr, len))
        };
        assert!(mapped_read_write(memory.addr(), 4 << 20));
        assert!(mapped_read_write(memory.addr() + 4096, 4096));
        // Past its end, a wrapping range, an address nothing maps, read-only code.
        assert!(!mapped_read_write(memory.addr(), (4 << 20) + (1 << 30)));
        assert!(!mapped_read_write(u64::MAX - 10, 100));
        assert!(!mapped_read_write(0x1000, 4096));
        let code =
            only_readable_writable_mappings_of_this_process_are_host_memory as *const () as u64;
        assert!(!mapped_read_write(code, 16));
    }

    #[test]
    fn host_memory_maps_reports_its_backing_and_prefaults() {
        // What the hugetlb pool holds decides the backing: with room, 2 MiB pages (and the
        // kernel says so for the mapping); without, an anonymous mapping with THP advised.
        let pool_had_room = hugetlb_free_bytes() >= 4 << 20;
        let mut memory = HostMemory::new(4 << 20).expect("maps");
        match memory.backing() {
            Backing::HugeTlb => assert_eq!(kernel_page_size_kib(memory.addr()), Some(2048)),
            backing => {
                assert_eq!(kernel_page_size_kib(memory.addr()), Some(4));
                let expected = if thp_allowed() {
                    Backing::TransparentHugeAdvised
                } else {
                    Backing::Normal
                };
                assert_eq!(backing, expected);
                // Normal pages although the pool had room: only if another test took it.
                assert!(!pool_had_room || hugetlb_free_bytes() < 4 << 20);
            }
        }
        memory.prefault();
        // SAFETY: nothing writes it now.
        assert!(unsafe { memory.as_slice() }.iter().all(|&b| b == 0));
        assert!(HostMemory::new(0).is_err());
        assert_eq!(
            HostMemory::new(4096).expect("maps").backing(),
            Backing::Normal
        );
    }

    /// The kernel's page size (KiB) for the mapping holding `addr` (`/proc/self/smaps`).
    fn kernel_page_size_kib(addr: u64) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((start, end)) = range.split_once('-') {
                    if let (Ok(start), Ok(end)) =
                        (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
                    {
                        inside = (start..end).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(size) = line.strip_prefix("KernelPageSize:") {
                    return size.split_whitespace().next()?.parse().ok();
                }
            }
        }
        None
    }
}
