//! How an engine's memory comes and goes: allocating and registering regions on every rail,
//! re-keying them, the deregistration fence, and the region table that peers and submitters
//! read.

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, PoisonError};
use std::time::Instant;

use railyard_control::RegionDescriptor;
use railyard_dataplane::fabric::MemoryRegion;

use super::error::MemoryError;
use super::memory;
use super::rails::Memory;
use super::region::{DEREGISTER_WAIT, PeerAccess, Region, RegionEntry};
use super::state::Engine;

impl Engine {
    /// Allocates `len` bytes registered on every rail (the rails in parallel): huge pages where it can (then
    /// transparent huge pages, then normal pages: [`Region::backing`] says which), bound to
    /// NUMA node `numa` (default: the first rail's), prefaulted. Peers may read and write it
    /// ([`PeerAccess::ReadWrite`]); [`Self::alloc_with_access`] gives less.
    ///
    /// # Errors
    /// [`MemoryError`] naming what failed.
    pub fn alloc(&self, len: u64, numa: Option<u32>) -> Result<Region, MemoryError> {
        self.alloc_with_access(len, numa, PeerAccess::ReadWrite)
    }

    /// [`Self::alloc`], with what peers may do to the region.
    ///
    /// # Errors
    /// As [`Self::alloc`].
    pub fn alloc_with_access(
        &self,
        len: u64,
        numa: Option<u32>,
        peer_access: PeerAccess,
    ) -> Result<Region, MemoryError> {
        if len == 0 {
            return Err(MemoryError::BadRange { addr: 0, len });
        }
        if let Some(total) = memory::host_memory().filter(|&total| len > total) {
            // Prefaulting more than the host has would summon the OOM killer instead.
            return Err(MemoryError::Alloc {
                len,
                reason: format!("more than this host's {total} bytes of memory"),
            });
        }
        let mut memory = self.inner.rails.allocate(len, peer_access.access())?;
        let node = numa.or_else(|| self.inner.rail_numa.first().copied());
        let mut bound = None;
        if let (Some(node), Some(topology)) = (node, self.inner.topology.as_ref()) {
            // SAFETY: the memory is fresh; nothing transfers into it yet.
            let area = unsafe { memory.as_slice() };
            match topology.bind_memory(area, node) {
                Ok(()) => bound = Some(node),
                Err(error) if numa.is_some() => {
                    return Err(MemoryError::Bind {
                        node,
                        len,
                        reason: error.to_string(),
                    });
                }
                Err(_) => {}
            }
        }
        memory.prefault();
        let registrations =
            self.inner
                .rails
                .register_memory(&memory, len, false, peer_access.access())?;
        let region = Region {
            id: self.inner.next_region.fetch_add(1, Ordering::Relaxed),
            addr: memory.addr(),
            len,
            backing: Some(memory.backing()),
            numa: bound,
            peer_access,
        };
        self.insert(RegionEntry {
            region,
            memory: Some(memory),
            registrations,
            generation: region.id,
            lingering: Vec::new(),
            rekeyed: Vec::new(),
            withdrawn: false,
        });
        Ok(region)
    }

    /// Registers memory the application owns, on every rail (in parallel).
    ///
    /// # Safety
    /// `len` bytes at `ptr` must stay mapped, readable and writable until
    /// [`Self::deregister`] returns `Ok` (or the engine ends): peers read and write them at
    /// any time, as a NIC would. After [`MemoryError::Busy`] they are still in use.
    ///
    /// Registering exactly the range of a region registered already returns that region
    /// (nothing changes); a range that overlaps another region without being it is refused.
    /// So every registered byte belongs to one region, and an address names one.
    ///
    /// # Errors
    /// [`MemoryError::BadRange`] for an empty, null or wrapping range;
    /// [`MemoryError::NotHostMemory`] when the range is not readable and writable memory
    /// mapped in this process (device memory, say, or nothing);
    /// [`MemoryError::Overlaps`] for a range overlapping another region;
    /// [`MemoryError::Register`] when a rail refuses.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Region, MemoryError> {
        // SAFETY: the caller's contract.
        unsafe { self.register_with_access(ptr, len, PeerAccess::ReadWrite) }
    }

    /// [`Self::register`], with what peers may do to the region. Registering the range of a
    /// region registered already with other access is refused as an overlap.
    ///
    /// # Safety
    /// As [`Self::register`].
    ///
    /// # Errors
    /// As [`Self::register`].
    pub unsafe fn register_with_access(
        &self,
        ptr: *mut u8,
        len: usize,
        peer_access: PeerAccess,
    ) -> Result<Region, MemoryError> {
        // SAFETY: the caller's contract, for its one range.
        let regions = unsafe { self.register_many_with_access(&[(ptr, len)], peer_access) }?;
        regions.into_iter().next().ok_or(MemoryError::BadRange {
            addr: ptr as u64,
            len: len as u64,
        })
    }

    /// Registers many ranges of memory the application owns at once ([`Self::register`]
    /// for each, peers may read and write them): `/proc/self/maps` is read once, each rail
    /// registers every range in one thread (the rails in parallel), and peers see one new
    /// descriptor for all of them. Answers the regions in the order of `ranges`. All or
    /// nothing: on any error no range is registered. A range exactly equal to a region
    /// registered already (or to another range of the call) answers that region.
    ///
    /// # Safety
    /// As [`Self::register`], for every range.
    ///
    /// # Errors
    /// As [`Self::register`], naming the first bad range; [`MemoryError::RangesOverlap`] for
    /// two ranges of the call that overlap without being equal.
    pub unsafe fn register_many(
        &self,
        ranges: &[(*mut u8, usize)],
    ) -> Result<Vec<Region>, MemoryError> {
        // SAFETY: the caller's contract.
        unsafe { self.register_many_with_access(ranges, PeerAccess::ReadWrite) }
    }

    /// [`Self::register_many`], with what peers may do to the regions. A range equal to a
    /// region registered already with other access is refused as an overlap.
    ///
    /// # Safety
    /// As [`Self::register`], for every range.
    ///
    /// # Errors
    /// As [`Self::register_many`].
    pub unsafe fn register_many_with_access(
        &self,
        ranges: &[(*mut u8, usize)],
        peer_access: PeerAccess,
    ) -> Result<Vec<Region>, MemoryError> {
        let asked: Vec<(u64, u64)> = ranges
            .iter()
            .map(|&(ptr, len)| (ptr as u64, len as u64))
            .collect();
        for &(addr, len) in &asked {
            if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
                return Err(MemoryError::BadRange { addr, len });
            }
        }
        let mappings = memory::ReadWriteMappings::read();
        if let Some(&(addr, len)) = asked
            .iter()
            .find(|&&(addr, len)| !mappings.as_ref().is_some_and(|m| m.cover(addr, len)))
        {
            return Err(MemoryError::NotHostMemory { addr, len });
        }
        // Sorted by address, equal ranges side by side: overlaps are neighbours.
        let mut order: Vec<usize> = (0..asked.len()).collect();
        order.sort_by_key(|&index| asked[index]);
        for pair in order.windows(2) {
            let (a, b) = (asked[pair[0]], asked[pair[1]]);
            if a != b && b.0 < a.0 + a.1 {
                return Err(MemoryError::RangesOverlap {
                    addr: b.0,
                    len: b.1,
                    other_addr: a.0,
                    other_len: a.1,
                });
            }
        }
        // Held across the checks and the registrations, as in `register_with_access`.
        let _registering = self
            .inner
            .registering
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let existing = self.regions();
        let mut answers: Vec<Option<Region>> = vec![None; asked.len()];
        let mut fresh: Vec<(u64, u64)> = Vec::new();
        for &index in &order {
            let (addr, len) = asked[index];
            let after = existing.partition_point(|region| region.addr < addr + len);
            // Regions do not overlap each other: only the last one starting before the
            // range's end can overlap it.
            if let Some(region) = after
                .checked_sub(1)
                .map(|at| existing[at])
                .filter(|region| addr < region.addr + region.len)
            {
                if region.addr == addr && region.len == len && region.peer_access == peer_access {
                    answers[index] = Some(region);
                    continue;
                }
                return Err(MemoryError::Overlaps {
                    addr,
                    len,
                    region: region.id,
                    region_addr: region.addr,
                    region_len: region.len,
                });
            }
            if fresh.last() != Some(&(addr, len)) {
                fresh.push((addr, len));
            }
        }
        // SAFETY: the caller's contract is the rails'.
        let registered = unsafe {
            self.inner
                .rails
                .register_user_many(&fresh, peer_access.access())
        }?;
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let mut made = Vec::with_capacity(fresh.len());
        for (&(addr, len), registrations) in fresh.iter().zip(registered) {
            let region = Region {
                id: self.inner.next_region.fetch_add(1, Ordering::Relaxed),
                addr,
                len,
                backing: None,
                numa: None,
                peer_access,
            };
            regions.push(RegionEntry {
                region,
                memory: None,
                registrations,
                generation: region.id,
                lingering: Vec::new(),
                rekeyed: Vec::new(),
                withdrawn: false,
            });
            made.push(region);
        }
        if !made.is_empty() {
            self.publish(&regions);
        }
        drop(regions);
        Ok(asked
            .iter()
            .zip(answers)
            .map(|(range, answer)| {
                answer.unwrap_or_else(|| {
                    // Every range not answered by an existing region was registered.
                    let at = made.partition_point(|region| (region.addr, region.len) < *range);
                    made[at]
                })
            })
            .collect())
    }

    /// The registered region holding all of `addr..addr + len`, if one does.
    pub fn region_at(&self, addr: u64, len: u64) -> Option<Region> {
        self.find_region(|region| region.contains(addr, len))
    }

    /// The first registered region `matches` accepts.
    fn find_region(&self, matches: impl Fn(&Region) -> bool) -> Option<Region> {
        self.inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|entry| entry.region)
            .find(|region| matches(region))
    }

    /// Every registered region (allocated or the application's), by address.
    pub fn regions(&self) -> Vec<Region> {
        let mut regions: Vec<Region> = self
            .inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|entry| entry.region)
            .collect();
        regions.sort_by_key(|region| region.addr);
        regions
    }

    /// Registers a region's memory anew — new keys on every rail — and withdraws its old
    /// keys; returns the region under its new id (the old id is gone). The memory, its address
    /// and its contents stay. Work requests that name an old key are refused before any byte
    /// moves (`RemoteAccess`); a peer holding the old keys refreshes this process's
    /// descriptor when that happens, and its work continues under the new ones (the region
    /// keeps its generation: it is the same memory, unlike a deregister and a register). A request a
    /// peer had already begun with an old key may finish: into the same memory. For rotating
    /// keys that may have leaked, or a rebuilt cache announcing itself. This engine's own
    /// transfers from or into the region that are in flight meanwhile carry the old local
    /// key and may fail (`LocalProtection`): rotate between them.
    ///
    /// # Errors
    /// [`MemoryError::UnknownRegion`]; [`MemoryError::Register`] when a rail refuses (the
    /// region then keeps its old keys and id); [`MemoryError::Withdraw`] when the new keys
    /// are in place (under the id the error names) but a rail refused to withdraw an old
    /// one: the old key stays live there until [`Self::deregister`] withdraws it.
    pub fn reregister(&self, region: Region) -> Result<Region, MemoryError> {
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = regions
            .iter_mut()
            .find(|entry| entry.region.id == region.id)
            .ok_or(MemoryError::UnknownRegion { id: region.id })?;
        let fresh = match &entry.memory {
            Some(memory) => self.inner.rails.register_memory(
                memory,
                entry.region.len,
                true,
                entry.region.peer_access.access(),
            )?,
            // SAFETY: the application's promise for this memory (see `register`) holds until
            // it deregisters the region, which now owns these registrations.
            None => unsafe {
                self.inner.rails.register_user(
                    entry.region.addr,
                    entry.region.len,
                    entry.region.peer_access.access(),
                )
            }?,
        };
        let withdrawn = std::mem::replace(&mut entry.registrations, fresh);
        entry.region.id = self.inner.next_region.fetch_add(1, Ordering::Relaxed);
        let renewed = entry.region;
        let refused = self.inner.rails.deregister(&withdrawn);
        if refused.is_err() {
            entry.lingering.push(withdrawn);
        } else {
            entry.rekeyed.push(withdrawn);
        }
        if let Some(Memory::Soft(buffer)) = entry.memory.as_mut() {
            // Its own key (rail 0's first registration) is among the withdrawn ones.
            buffer.own_key_withdrawn();
        }
        self.publish(&regions);
        match refused {
            Ok(()) => Ok(renewed),
            Err((rail, reason)) => Err(MemoryError::Withdraw {
                id: renewed.id,
                addr: renewed.addr,
                len: renewed.len,
                rail,
                reason,
            }),
        }
    }

    fn insert(&self, entry: RegionEntry) {
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        regions.push(entry);
        self.publish(&regions);
    }

    /// The regions' version ([`Inner::regions_version`](crate::state::Inner::regions_version)).
    pub(crate) fn regions_version(&self) -> u64 {
        self.inner.regions_version.load(Ordering::Acquire)
    }

    fn publish(&self, regions: &[RegionEntry]) {
        // Release, under the regions' write lock: a submitter that sees the new version
        // finds the new table.
        self.inner.regions_version.fetch_add(1, Ordering::Release);
        self.inner.shared.set_regions(
            regions
                .iter()
                .filter(|entry| entry.region.peer_access != PeerAccess::None)
                .map(|entry| RegionDescriptor {
                    base: entry.region.addr,
                    len: entry.region.len,
                    rkeys: entry.registrations.iter().map(|r| r.rkey).collect(),
                    generation: entry.generation,
                    access: entry.region.peer_access.access(),
                })
                .collect(),
        );
        self.inner
            .directory
            .publish(|| self.inner.control.descriptor());
    }

    /// Withdraws a region from every rail and, once nothing can touch it any more, frees it
    /// (if the engine allocated it) and returns. Work requests that name it afterwards fail;
    /// peers learn of it at their next descriptor refresh.
    ///
    /// **When it returns `Ok`, no poller of this engine and no peer will read or write the
    /// region again, whatever is registered at its address later**: its keys are withdrawn
    /// on every rail (a peer's request that arrives later is refused before any byte moves,
    /// and peers fail work prepared against it with `RegionWithdrawn` rather than re-prepare
    /// it for a new registration of the same memory), every poller has finished the round in
    /// which it might have checked a key before the withdrawal, every request this engine
    /// posted through the region's local keys has completed or been flushed (a READ still
    /// in flight would land in it), and every peer process that copies itself (soft fabric)
    /// has left any copy it started before. The application may unmap
    /// or reuse registered memory at once. It waits at most [`DEREGISTER_WAIT`].
    ///
    /// # Errors
    /// [`MemoryError::UnknownRegion`]; [`MemoryError::Busy`] when a poller, a request posted
    /// through it or a peer is still inside the region at the deadline (a stopped process,
    /// say): the region stays withdrawn
    /// and mapped, and calling `deregister` again waits again; [`MemoryError::Withdraw`]
    /// when a rail refused to withdraw it (the provider's error): it stays mapped (and
    /// registered on that rail), and calling `deregister` again tries again. Either way
    /// the region is gone from this engine's descriptor: no new work names it.
    pub fn deregister(&self, region: Region) -> Result<(), MemoryError> {
        let mut regions = self
            .inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let mut entry = match regions
            .iter()
            .position(|entry| entry.region.id == region.id)
        {
            Some(index) => {
                let entry = regions.remove(index);
                self.publish(&regions);
                entry
            }
            None => {
                let mut fencing = self.fencing();
                let index = fencing
                    .iter()
                    .position(|entry| entry.region.id == region.id)
                    .ok_or(MemoryError::UnknownRegion { id: region.id })?;
                fencing.remove(index)
            }
        };
        drop(regions);
        let local_keys = entry.local_keys();
        if let Err((rail, reason)) = entry.withdraw(&self.inner.rails) {
            let region = entry.region;
            self.fencing().push(entry);
            return Err(MemoryError::Withdraw {
                id: region.id,
                addr: region.addr,
                len: region.len,
                rail,
                reason,
            });
        }
        let deadline = Instant::now() + DEREGISTER_WAIT;
        // Once every poller finished the round that might have posted through a withdrawn
        // key, wait for what it posted before to complete: some providers land a READ's
        // bytes in local memory whether or not its registration is still open.
        let quiet = self
            .inner
            .pollers
            .iter()
            .all(|poller| poller.quiesce(deadline))
            && self
                .inner
                .pollers
                .iter()
                .zip(&local_keys)
                .all(|(poller, lkeys)| poller.drain_local(lkeys, deadline))
            && self.inner.rails.quiesce_peers(deadline);
        if !quiet {
            let region = entry.region;
            self.fencing().push(entry);
            return Err(MemoryError::Busy {
                id: region.id,
                addr: region.addr,
                len: region.len,
                waited: DEREGISTER_WAIT,
            });
        }
        drop(entry);
        Ok(())
    }

    fn fencing(&self) -> MutexGuard<'_, Vec<RegionEntry>> {
        self.inner
            .fencing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The registrations of region `id` on each rail.
    pub(crate) fn registrations(&self, id: u64) -> Option<(Region, Vec<MemoryRegion>)> {
        self.inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|entry| entry.region.id == id)
            .map(|entry| (entry.region, entry.registrations.clone()))
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use railyard_dataplane::IdleStrategy;

    use crate::{Engine, FabricChoice, RailChoice};

    /// Peers learn of registrations from the descriptor this engine publishes: many ranges
    /// registered at once are one publication (one new regions version), not one each.
    #[test]
    fn register_many_publishes_once_for_all_its_ranges() {
        let mut memory = vec![0u8; 64 << 10];
        let engine = Engine::builder("register-many-unit")
            .fabric(FabricChoice::Soft)
            .rails(RailChoice::Count(NonZeroUsize::new(2).expect("two")))
            .idle(IdleStrategy::gentle())
            .build()
            .expect("the engine starts");
        let base = memory.as_mut_ptr();
        let ranges: Vec<(*mut u8, usize)> = (0..16)
            .map(|i| (base.wrapping_add(i * 4096), 4096))
            .collect();
        let before = engine.regions_version();
        // SAFETY: `memory` outlives the engine (declared before it, dropped after it).
        let regions = unsafe { engine.register_many(&ranges) }.expect("registered");
        assert_eq!(regions.len(), 16);
        assert_eq!(engine.regions().len(), 16);
        assert_eq!(engine.regions_version(), before + 1, "one publication");
        // A call that only names registered ranges publishes nothing.
        // SAFETY: as above.
        let again = unsafe { engine.register_many(&ranges[..4]) }.expect("the same regions");
        assert_eq!(again, regions[..4]);
        assert_eq!(engine.regions_version(), before + 1);
    }
}
