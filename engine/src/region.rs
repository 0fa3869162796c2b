//! What a registered region is: the handle transfers name ([`Region`]), what peers may do to
//! it ([`PeerAccess`]), and the entry an engine keeps for it until nothing can touch its
//! memory any more.

use std::time::Duration;

use railyard_dataplane::fabric::MemoryRegion;
use railyard_dataplane::fabric::soft::Backing;

use super::rails::{Memory, Rails};

/// A registered region: what transfers name as their local side. Cheap to copy; it does not
/// keep the memory alive (see the [crate docs](crate)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The engine's id for it.
    pub id: u64,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// What backs it (engine-allocated memory only).
    pub backing: Option<Backing>,
    /// The NUMA node it is bound to, if any.
    pub numa: Option<u32>,
    /// What peers may do to it.
    pub peer_access: PeerAccess,
}

/// What peers may do to a region (this process may always read it, and write it with
/// READs). Register with the least a region needs: a prefill engine's source buffers, which
/// it only writes out of, need [`PeerAccess::None`]; a decode engine's KV cache, which
/// prefill writes into, [`PeerAccess::ReadWrite`] (what [`Engine::alloc`] and
/// [`Engine::register`] give).
///
/// [`Engine::alloc`]: crate::Engine::alloc
/// [`Engine::register`]: crate::Engine::register
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PeerAccess {
    /// Peers may neither read nor write it: memory only this process's transfers use.
    None,
    /// Peers may READ from it.
    Read,
    /// Peers may READ from it and WRITE into it.
    #[default]
    ReadWrite,
}

impl PeerAccess {
    /// The registration flags.
    pub(crate) fn access(self) -> railyard_dataplane::fabric::Access {
        use railyard_dataplane::fabric::Access;
        match self {
            Self::None => Access::LOCAL_WRITE,
            Self::Read => Access::LOCAL_WRITE | Access::REMOTE_READ,
            Self::ReadWrite => Access::ALL,
        }
    }
}

impl Region {
    /// Whether `addr..addr + len` (at least one byte) lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        len > 0
            && addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// What an engine holds for one region.
pub(crate) struct RegionEntry {
    pub(crate) region: Region,
    /// Engine-allocated memory (`None`: the application's).
    pub(crate) memory: Option<Memory>,
    /// Its registration on each rail.
    pub(crate) registrations: Vec<MemoryRegion>,
    /// What peers' slices are prepared against (the descriptor's `generation`): the id of
    /// the region's first registration, kept by [`Engine::reregister`] (same memory, new
    /// keys) and new with every [`Engine::register`], so that a peer never re-prepares work
    /// from before a `deregister` into memory registered again at the same address.
    ///
    /// [`Engine::reregister`]: crate::Engine::reregister
    /// [`Engine::register`]: crate::Engine::register
    pub(crate) generation: u64,
    /// Registrations [`Engine::reregister`] replaced whose withdrawal a rail refused: still
    /// live there, so withdrawn again (idempotently) before the memory may go.
    ///
    /// [`Engine::reregister`]: crate::Engine::reregister
    pub(crate) lingering: Vec<Vec<MemoryRegion>>,
    /// Registrations [`Engine::reregister`] replaced and withdrew: requests this engine
    /// posted through their local keys before may still be in flight, so deregistration
    /// waits for those keys too.
    ///
    /// [`Engine::reregister`]: crate::Engine::reregister
    pub(crate) rekeyed: Vec<Vec<MemoryRegion>>,
    /// Set once every rail withdrew it: a deregistration retried after `Busy` does not
    /// withdraw again by keys that may since name another region (soft and verbs keys
    /// come back).
    pub(crate) withdrawn: bool,
}

impl RegionEntry {
    /// Its local keys on each rail: the current registration's and every earlier one's.
    pub(crate) fn local_keys(&self) -> Vec<Vec<u32>> {
        (0..self.registrations.len())
            .map(|rail| {
                std::iter::once(&self.registrations)
                    .chain(&self.lingering)
                    .chain(&self.rekeyed)
                    .filter_map(|registrations| registrations.get(rail))
                    .map(|registration| registration.lkey)
                    .collect()
            })
            .collect()
    }

    /// Withdraws every registration of it (current and lingering) from every rail; nothing
    /// once that succeeded. A rail that refused (libfabric, whose keys never come back) is
    /// asked again by the next call.
    ///
    /// # Errors
    /// The first rail that refused, with its error (see [`Rails::deregister`]).
    pub(crate) fn withdraw(&mut self, rails: &Rails) -> Result<(), (usize, String)> {
        if self.withdrawn {
            return Ok(());
        }
        rails.deregister(&self.registrations)?;
        while let Some(old) = self.lingering.last() {
            rails.deregister(old)?;
            self.rekeyed.extend(self.lingering.pop());
        }
        self.withdrawn = true;
        Ok(())
    }
}

/// Longest [`Engine::deregister`] waits for pollers and peers to leave a withdrawn region.
/// A poller finishes its round within microseconds and a peer its copy within milliseconds;
/// one that has not by then is stopped or stuck.
///
/// [`Engine::deregister`]: crate::Engine::deregister
pub const DEREGISTER_WAIT: Duration = Duration::from_secs(1);
