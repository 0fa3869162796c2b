//! Segment descriptors: what a process publishes about itself so that peers can prepare
//! slices for it (DESIGN.md §6).

use crate::endpoint::Incarnation;
use railyard_dataplane::fabric::Access;

/// Fabric kinds a rail can be.
pub mod fabric {
    /// The soft fabric (shared memory and process_vm on one host).
    pub const SOFT: u8 = 1;
    /// RDMA verbs.
    pub const VERBS: u8 = 2;
    /// TCP between hosts.
    pub const TCP: u8 = 3;
    /// libfabric (EFA, or a software provider).
    pub const OFI: u8 = 4;
}

/// One rail of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailDescriptor {
    /// The rail's name (its NIC, or `soft<N>`).
    pub name: String,
    /// Its fabric ([`fabric`]).
    pub fabric: u8,
    /// Its TCP fabric data port, when it takes TCP queue pairs (0: it does not).
    pub tcp_port: u16,
    /// Its endpoint's fabric address, for fabrics whose peers address one endpoint per rail
    /// (libfabric: `fi_getname`); empty otherwise.
    pub address: Vec<u8>,
}

/// One registered region of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionDescriptor {
    /// First byte, in the owner's address space.
    pub base: u64,
    /// Bytes.
    pub len: u64,
    /// Its rkey on each rail, in rail order.
    pub rkeys: Vec<u32>,
    /// Which registration of this memory it is: new when the owner registers the range
    /// anew (after a deregistration), kept when it only re-keys it (same memory, new keys).
    /// A slice prepared against one generation is never re-prepared into another.
    pub generation: u64,
    /// What peers may do to it (its remote flags; fabrics that check requests before posting
    /// them refuse the rest there).
    pub access: Access,
}

impl RegionDescriptor {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base.saturating_add(self.len))
    }
}

/// What a process publishes: name, incarnation, handshake address, rails, regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// The segment (process) name.
    pub name: String,
    /// Its incarnation: a restarted process is a new one.
    pub incarnation: Incarnation,
    /// Where its handshake listener is (`host:port`).
    pub handshake_addr: String,
    /// Its rails, in order.
    pub rails: Vec<RailDescriptor>,
    /// Its registered regions.
    pub regions: Vec<RegionDescriptor>,
}

impl SegmentDescriptor {
    /// About how many bytes of memory it takes: itself, its strings and its lists.
    pub fn footprint(&self) -> usize {
        let rails: usize = self
            .rails
            .iter()
            .map(|rail| size_of::<RailDescriptor>() + rail.name.len() + rail.address.len())
            .sum();
        let regions: usize = self
            .regions
            .iter()
            .map(|region| size_of::<RegionDescriptor>() + 4 * region.rkeys.len())
            .sum();
        size_of::<Self>() + self.name.len() + self.handshake_addr.len() + rails + regions
    }

    /// The region holding `[addr, addr + len)`, if one does: a slice never crosses a region
    /// boundary.
    pub fn region_for(&self, addr: u64, len: u64) -> Option<&RegionDescriptor> {
        self.regions
            .iter()
            .find(|region| region.contains(addr, len))
    }

    /// The rkey of the region holding `[addr, addr + len)` on `rail`.
    pub fn rkey_for(&self, addr: u64, len: u64, rail: u16) -> Option<u32> {
        self.region_for(addr, len)?
            .rkeys
            .get(usize::from(rail))
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_resolve_to_one_region_and_a_rail_key() {
        let descriptor = SegmentDescriptor {
            name: "decode-0".into(),
            incarnation: Incarnation(9),
            handshake_addr: "127.0.0.1:1".into(),
            rails: vec![],
            regions: vec![
                RegionDescriptor {
                    base: 0x1000,
                    len: 0x1000,
                    rkeys: vec![11, 12],
                    generation: 1,
                    access: Access::ALL,
                },
                RegionDescriptor {
                    base: 0x2000,
                    len: 0x1000,
                    rkeys: vec![21, 22],
                    generation: 1,
                    access: Access::ALL,
                },
            ],
        };
        assert_eq!(descriptor.rkey_for(0x1800, 0x800, 1), Some(12));
        assert_eq!(descriptor.rkey_for(0x2000, 0x10, 0), Some(21));
        assert_eq!(
            descriptor.rkey_for(0x1800, 0x801, 0),
            None,
            "crosses a boundary"
        );
        assert_eq!(descriptor.rkey_for(0x1800, 8, 2), None, "no such rail");
        assert_eq!(descriptor.rkey_for(u64::MAX, 2, 0), None);
    }
}
