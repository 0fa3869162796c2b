//! Builds small hwloc XML topologies for tests, so each edge case is a few lines of Rust
//! rather than a hand-written snapshot that could drift from what hwloc accepts.

#![allow(dead_code, unreachable_pub)]

use std::fmt::Write as _;

/// A NUMA node: how many cores, and how many hardware threads per core.
pub struct Node {
    pub cores: usize,
    pub threads: usize,
}

/// An RDMA port: (state code, link layer, rate in Gb/s).
pub type Port = (u32, &'static str, u32);

/// An RDMA NIC on one node, alone on its own PCIe switch unless `switch` groups it.
pub struct NicSpec {
    pub name: &'static str,
    pub node: usize,
    pub switch: usize,
    pub ports: Vec<Port>,
}

/// A GPU on one node's PCIe switch.
pub struct GpuSpec {
    pub name: &'static str,
    pub node: usize,
    pub switch: usize,
}

#[derive(Default)]
pub struct Spec {
    pub nodes: Vec<Node>,
    pub nics: Vec<NicSpec>,
    pub gpus: Vec<GpuSpec>,
}

fn bitmap(bits: impl IntoIterator<Item = usize>) -> String {
    let bits: Vec<usize> = bits.into_iter().collect();
    let words = bits.iter().max().map_or(1, |max| max / 32 + 1);
    let mut values = vec![0u32; words];
    for bit in bits {
        values[bit / 32] |= 1 << (bit % 32);
    }
    values
        .iter()
        .rev()
        .map(|w| format!("0x{w:08x}"))
        .collect::<Vec<_>>()
        .join(",")
}

impl Spec {
    /// PUs numbered consecutively node by node, core by core.
    pub fn to_xml(&self) -> String {
        let mut gp = 1;
        let mut next_gp = || {
            gp += 1;
            gp
        };
        let mut pu = 0;
        let mut node_pus: Vec<Vec<usize>> = Vec::new();
        for node in &self.nodes {
            let count = node.cores * node.threads;
            node_pus.push((pu..pu + count).collect());
            pu += count;
        }
        let all_pus = bitmap(0..pu.max(1));
        let all_nodes = bitmap(0..self.nodes.len());
        let mut xml = String::new();
        let _ = writeln!(xml, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
        let _ = writeln!(xml, r#"<!DOCTYPE topology SYSTEM "hwloc2.dtd">"#);
        let _ = writeln!(xml, r#"<topology version="2.0">"#);
        let _ = writeln!(
            xml,
            r#"<object type="Machine" os_index="0" cpuset="{all_pus}" complete_cpuset="{all_pus}" nodeset="{all_nodes}" complete_nodeset="{all_nodes}" gp_index="1"><info name="HostName" value="testbox"/>"#
        );
        for (n, node) in self.nodes.iter().enumerate() {
            let pus = &node_pus[n];
            let nodeset = bitmap([n]);
            if node.cores == 0 {
                // Memory-only node: a memory child of the machine, with no CPUs.
                let _ = writeln!(
                    xml,
                    r#"<object type="NUMANode" os_index="{n}" cpuset="0x0" complete_cpuset="0x0" nodeset="{nodeset}" complete_nodeset="{nodeset}" gp_index="{}" local_memory="1073741824"/>"#,
                    next_gp()
                );
                continue;
            }
            let cpuset = bitmap(pus.iter().copied());
            let _ = writeln!(
                xml,
                r#"<object type="Package" os_index="{n}" cpuset="{cpuset}" complete_cpuset="{cpuset}" nodeset="{nodeset}" complete_nodeset="{nodeset}" gp_index="{}">"#,
                next_gp()
            );
            let _ = writeln!(
                xml,
                r#"<object type="NUMANode" os_index="{n}" cpuset="{cpuset}" complete_cpuset="{cpuset}" nodeset="{nodeset}" complete_nodeset="{nodeset}" gp_index="{}" local_memory="1073741824"/>"#,
                next_gp()
            );
            for (c, core_pus) in pus.chunks(node.threads).enumerate() {
                let core_set = bitmap(core_pus.iter().copied());
                let _ = writeln!(
                    xml,
                    r#"<object type="Core" os_index="{}" cpuset="{core_set}" complete_cpuset="{core_set}" nodeset="{nodeset}" complete_nodeset="{nodeset}" gp_index="{}">"#,
                    n * 100 + c,
                    next_gp()
                );
                for &p in core_pus {
                    let set = bitmap([p]);
                    let _ = writeln!(
                        xml,
                        r#"<object type="PU" os_index="{p}" cpuset="{set}" complete_cpuset="{set}" nodeset="{nodeset}" complete_nodeset="{nodeset}" gp_index="{}"/>"#,
                        next_gp()
                    );
                }
                let _ = writeln!(xml, "</object>");
            }
            // I/O: one host bridge per node, one PCIe switch per `switch` number.
            let mut switches: Vec<usize> = self
                .nics
                .iter()
                .filter(|nic| nic.node == n)
                .map(|nic| nic.switch)
                .chain(self.gpus.iter().filter(|g| g.node == n).map(|g| g.switch))
                .collect();
            switches.sort_unstable();
            switches.dedup();
            if !switches.is_empty() {
                let _ = writeln!(
                    xml,
                    r#"<object type="Bridge" gp_index="{}" bridge_type="0-1" depth="0" bridge_pci="0000:[{:02x}-{:02x}]">"#,
                    next_gp(),
                    n * 0x40 + 1,
                    n * 0x40 + 0x3f
                );
                for switch in switches {
                    let bus = n * 0x40 + switch * 4 + 2;
                    let _ = writeln!(
                        xml,
                        r#"<object type="Bridge" gp_index="{}" bridge_type="1-1" depth="1" bridge_pci="0000:[{:02x}-{:02x}]" pci_busid="0000:{:02x}:00.0" pci_type="0604 [1000:c030] [0000:0000] b0" pci_link_speed="31.5">"#,
                        next_gp(),
                        bus + 1,
                        bus + 3,
                        bus
                    );
                    let mut function = 0;
                    for gpu in self
                        .gpus
                        .iter()
                        .filter(|g| g.node == n && g.switch == switch)
                    {
                        let _ = writeln!(
                            xml,
                            r#"<object type="PCIDev" gp_index="{}" pci_busid="0000:{:02x}:00.{function}" pci_type="0302 [10de:2335] [10de:18be] a1" pci_link_speed="63.0"><object type="OSDev" gp_index="{}" name="{}" subtype="CUDA" osdev_type="5"/></object>"#,
                            next_gp(),
                            bus + 1,
                            next_gp(),
                            gpu.name
                        );
                        function += 1;
                    }
                    for nic in self
                        .nics
                        .iter()
                        .filter(|x| x.node == n && x.switch == switch)
                    {
                        let _ = writeln!(
                            xml,
                            r#"<object type="PCIDev" gp_index="{}" pci_busid="0000:{:02x}:00.{function}" pci_type="0207 [15b3:1021] [15b3:0023] 00" pci_link_speed="31.5">"#,
                            next_gp(),
                            bus + 2
                        );
                        let _ = writeln!(
                            xml,
                            r#"<object type="OSDev" gp_index="{}" name="{}" osdev_type="3">"#,
                            next_gp(),
                            nic.name
                        );
                        for (i, (state, layer, rate)) in nic.ports.iter().enumerate() {
                            let p = i + 1;
                            let _ = writeln!(
                                xml,
                                r#"<info name="Port{p}State" value="{state}"/><info name="Port{p}LinkLayer" value="{layer}"/><info name="Port{p}Rate" value="{rate}"/>"#
                            );
                        }
                        let _ = writeln!(xml, "</object></object>");
                        function += 1;
                    }
                    let _ = writeln!(xml, "</object>");
                }
                let _ = writeln!(xml, "</object>");
            }
            let _ = writeln!(xml, "</object>");
        }
        let _ = writeln!(xml, "</object>\n</topology>");
        xml
    }
}

pub const ACTIVE: u32 = 4;
pub const DOWN: u32 = 1;

pub fn ib(rate: u32) -> Port {
    (ACTIVE, "InfiniBand", rate)
}

pub fn roce(rate: u32) -> Port {
    (ACTIVE, "Ethernet", rate)
}

pub fn nic(name: &'static str, node: usize, switch: usize, ports: Vec<Port>) -> NicSpec {
    NicSpec {
        name,
        node,
        switch,
        ports,
    }
}
