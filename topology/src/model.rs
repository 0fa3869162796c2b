//! The machine as railyard sees it: plain data, filled by [`crate::discover`] from hwloc and
//! read by the planning rules. Nothing in this module talks to hwloc or the OS, so the rules
//! can be tested on any machine description.

use std::fmt;

use serde::Serialize;

/// Where a [`Machine`] description came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// Discovered on the running host (hwloc plus sysfs port facts).
    Live,
    /// Replayed from an hwloc XML snapshot.
    Xml,
}

/// Everything the planning rules need to know about one host.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// Host name, as hwloc recorded it (`HostName` info), or `"unknown"`.
    pub host: String,
    /// Live host or XML snapshot.
    pub source: Source,
    /// NUMA nodes in ascending OS index order.
    pub numa_nodes: Vec<NumaNode>,
    /// Relative NUMA distances (`numa_distances[i][j]` from `numa_nodes[i]` to
    /// `numa_nodes[j]`), when the firmware reported them.
    pub numa_distances: Option<Vec<Vec<u64>>>,
    /// RDMA devices in PCI discovery order.
    pub nics: Vec<Nic>,
    /// GPUs (PCI class 0300 or 0302) in PCI discovery order.
    pub gpus: Vec<Gpu>,
}

/// One NUMA node and the CPUs local to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    /// The OS index (`/sys/devices/system/node/nodeN`).
    pub os_index: u32,
    /// OS indices of the PUs local to this node, ascending.
    pub pus: Vec<u32>,
    /// Physical cores local to this node, in hwloc's logical order. May be empty: a
    /// memory-only node (CXL, HBM) has no CPUs.
    pub cores: Vec<Core>,
}

/// A physical core and its hardware threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Core {
    /// OS indices of the core's PUs (SMT siblings), ascending. Never empty.
    pub pus: Vec<u32>,
}

impl Core {
    /// The PU a poller pinned to this core runs on: the lowest-numbered sibling.
    pub fn primary_pu(&self) -> u32 {
        self.pus[0]
    }
}

/// The link layer of an RDMA port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum LinkLayer {
    /// Native InfiniBand.
    InfiniBand,
    /// RoCE (RDMA over Converged Ethernet).
    Ethernet,
}

impl LinkLayer {
    /// Parses the spelling used by sysfs and by railyard's XML infos.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "InfiniBand" => Some(Self::InfiniBand),
            "Ethernet" => Some(Self::Ethernet),
            _ => None,
        }
    }

    /// The spelling used by sysfs, XML infos and the JSON plan.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InfiniBand => "InfiniBand",
            Self::Ethernet => "Ethernet",
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Logical state of an RDMA port, numbered as verbs numbers `ibv_port_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// 1: no link.
    Down,
    /// 2: link up, not yet configured by the subnet manager.
    Init,
    /// 3: configured, not yet active.
    Armed,
    /// 4: carrying traffic.
    Active,
    /// 5: active, deferring (rare).
    ActiveDefer,
    /// Anything else, or not reported.
    Unknown,
}

impl PortState {
    /// Maps the verbs numbering used by hwloc's `Port<N>State` info and by sysfs.
    pub fn from_code(code: u32) -> Self {
        match code {
            1 => Self::Down,
            2 => Self::Init,
            3 => Self::Armed,
            4 => Self::Active,
            5 => Self::ActiveDefer,
            _ => Self::Unknown,
        }
    }

    /// Whether the port can carry traffic now.
    pub fn is_active(self) -> bool {
        matches!(self, Self::Active | Self::ActiveDefer)
    }

    /// Lower-case name for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Down => "down",
            Self::Init => "initializing",
            Self::Armed => "armed",
            Self::Active => "active",
            Self::ActiveDefer => "active (defer)",
            Self::Unknown => "in an unknown state",
        }
    }
}

/// One port of an RDMA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// Port number, starting at 1 as in verbs.
    pub number: u32,
    /// Logical state.
    pub state: PortState,
    /// Link layer, when known.
    pub link_layer: Option<LinkLayer>,
    /// Signalling rate in Gb/s, when known.
    pub rate_gbps: Option<u32>,
    /// Local identifier (InfiniBand only; 0 on RoCE).
    pub lid: Option<u32>,
}

/// An RDMA device (an hwloc OpenFabrics OS device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nic {
    /// Verbs device name, e.g. `mlx5_0`.
    pub name: String,
    /// PCI bus id of the function, e.g. `0000:12:00.0`.
    pub pci_busid: Option<String>,
    /// NUMA node the device is attached to.
    pub numa_node: u32,
    /// Ports in ascending number order.
    pub ports: Vec<Port>,
    /// The network interface of the same PCI function, e.g. `ibp26s0`.
    pub netdev: Option<String>,
    /// Where the device sits in the PCI tree.
    pub pci_path: PciPath,
}

/// A GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Name of its OS device (`cuda0`, `nvml0`, `card0`…), else the PCI bus id.
    pub name: String,
    /// PCI bus id of the function.
    pub pci_busid: String,
    /// NUMA node the device is attached to.
    pub numa_node: u32,
    /// Where the device sits in the PCI tree.
    pub pci_path: PciPath,
}

/// One object above a PCI device on its way to the CPU side of the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PciHop {
    /// A PCI-to-PCI bridge (a switch port).
    Bridge {
        /// Identity of the bridge object within its topology.
        id: u64,
    },
    /// A host bridge: the root of a PCI hierarchy.
    HostBridge {
        /// Identity of the bridge object within its topology.
        id: u64,
    },
}

impl PciHop {
    fn id(self) -> u64 {
        match self {
            Self::Bridge { id } | Self::HostBridge { id } => id,
        }
    }
}

/// The bridges above a PCI device, nearest first, up to and including its host bridge.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PciPath {
    /// Bridges from the device's parent upward.
    pub hops: Vec<PciHop>,
}

/// How far apart two PCI devices are, named as `nvidia-smi topo -m` names it. Ordered from
/// nearest to farthest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum PciDistance {
    /// Behind the same PCIe switch.
    #[serde(rename = "PIX")]
    Pix,
    /// Behind several PCIe switches, without crossing a host bridge.
    #[serde(rename = "PXB")]
    Pxb,
    /// Under the same host bridge.
    #[serde(rename = "PHB")]
    Phb,
    /// Same NUMA node, different host bridges.
    #[serde(rename = "NODE")]
    Node,
    /// Different NUMA nodes.
    #[serde(rename = "SYS")]
    Sys,
}

impl PciDistance {
    /// The `nvidia-smi topo -m` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        }
    }

    /// Distance class between two PCI devices.
    ///
    /// The nearest bridge both paths share decides: a PCI-to-PCI bridge at most one bridge
    /// above each device (the device's own switch port, or the switch's upstream port) means
    /// both hang off one switch, `PIX`; a deeper shared PCI-to-PCI bridge is `PXB`; a shared
    /// host bridge is `PHB`. Without a shared bridge the NUMA nodes decide (`NODE`, `SYS`).
    pub fn between(a: &PciPath, a_numa: u32, b: &PciPath, b_numa: u32) -> Self {
        for (a_depth, hop) in a.hops.iter().enumerate() {
            let Some(b_depth) = b.hops.iter().position(|other| other.id() == hop.id()) else {
                continue;
            };
            return match hop {
                PciHop::HostBridge { .. } => Self::Phb,
                PciHop::Bridge { .. } if a_depth <= 1 && b_depth <= 1 => Self::Pix,
                PciHop::Bridge { .. } => Self::Pxb,
            };
        }
        Self::between_nodes(a_numa, b_numa)
    }

    /// Distance class between things that share no PCI bridge: `NODE` or `SYS`.
    pub fn between_nodes(a_numa: u32, b_numa: u32) -> Self {
        if a_numa == b_numa {
            Self::Node
        } else {
            Self::Sys
        }
    }
}

impl fmt::Display for PciDistance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(hops: &[PciHop]) -> PciPath {
        PciPath {
            hops: hops.to_vec(),
        }
    }

    const HOST: PciHop = PciHop::HostBridge { id: 1 };
    const OTHER_HOST: PciHop = PciHop::HostBridge { id: 2 };
    const SWITCH_UP: PciHop = PciHop::Bridge { id: 10 };
    const PORT_A: PciHop = PciHop::Bridge { id: 11 };
    const PORT_B: PciHop = PciHop::Bridge { id: 12 };
    const SWITCH2_UP: PciHop = PciHop::Bridge { id: 20 };

    #[test]
    fn same_switch_is_pix_whether_or_not_downstream_ports_are_modelled() {
        let direct = path(&[SWITCH_UP, HOST]);
        assert_eq!(
            PciDistance::between(&direct, 0, &direct, 0),
            PciDistance::Pix
        );
        let a = path(&[PORT_A, SWITCH_UP, HOST]);
        let b = path(&[PORT_B, SWITCH_UP, HOST]);
        assert_eq!(PciDistance::between(&a, 0, &b, 0), PciDistance::Pix);
    }

    #[test]
    fn nested_switches_are_pxb() {
        let a = path(&[PORT_A, SWITCH2_UP, PORT_B, SWITCH_UP, HOST]);
        let b = path(&[SWITCH_UP, HOST]);
        assert_eq!(PciDistance::between(&a, 0, &b, 0), PciDistance::Pxb);
    }

    #[test]
    fn host_bridge_then_numa_decide() {
        let a = path(&[PORT_A, HOST]);
        let b = path(&[SWITCH2_UP, HOST]);
        assert_eq!(PciDistance::between(&a, 0, &b, 0), PciDistance::Phb);
        let c = path(&[SWITCH2_UP, OTHER_HOST]);
        assert_eq!(PciDistance::between(&a, 0, &c, 0), PciDistance::Node);
        assert_eq!(PciDistance::between(&a, 0, &c, 1), PciDistance::Sys);
        assert!(PciDistance::Pix < PciDistance::Pxb && PciDistance::Node < PciDistance::Sys);
    }
}
