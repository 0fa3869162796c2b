//! Discovery: turns an hwloc topology (live, or replayed from XML) into a [`Machine`], adds
//! what sysfs says of RDMA ports on a live host, exports snapshots, and pins threads and
//! binds memory through hwloc. This is the only module that talks to hwloc.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use hwlocality::Topology;
use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::cpu::cpuset::CpuSet;
use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
use hwlocality::memory::nodeset::NodeSet;
use hwlocality::object::TopologyObject;
use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{BridgeType, OSDeviceType, ObjectType};
use hwlocality::topology::builder::TypeFilter;
use hwlocality::topology::export::xml::XMLExportFlags;

use crate::TopologyError;
use crate::model::{
    Core, Gpu, LinkLayer, Machine, Nic, NumaNode, PciHop, PciPath, Port, PortState, Source,
};
use crate::plan::{Plan, PlanOptions};

/// Where a live host lists its RDMA devices.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// A discovered machine: the hwloc topology it came from and railyard's [`Machine`] view.
///
/// # Thread safety
/// `Send + Sync`: hwloc topologies are safe to query from several threads.
pub struct HostTopology {
    hwloc: Topology,
    machine: Machine,
}

impl HostTopology {
    /// Discovers the running host, with RDMA port facts from [`SYSFS_INFINIBAND`].
    ///
    /// # Errors
    /// [`TopologyError::Hwloc`] when hwloc cannot discover the host.
    pub fn live() -> Result<Self, TopologyError> {
        Self::live_with_sysfs(Path::new(SYSFS_INFINIBAND))
    }

    /// Discovers the running host, reading RDMA port facts below `sysfs_infiniband` (a
    /// directory laid out as `/sys/class/infiniband`).
    ///
    /// # Errors
    /// [`TopologyError::Hwloc`] when hwloc cannot discover the host.
    pub fn live_with_sysfs(sysfs_infiniband: &Path) -> Result<Self, TopologyError> {
        let hwloc = builder()?
            .build()
            .map_err(|e| hwloc_error("discover the live topology", e))?;
        let mut machine = read_machine(&hwloc, Source::Live);
        for nic in &mut machine.nics {
            enrich_ports_from_sysfs(nic, &sysfs_infiniband.join(&nic.name));
        }
        Ok(Self { hwloc, machine })
    }

    /// Replays an hwloc XML snapshot (as written by `lstopo --of xml` or [`Self::export_xml`]).
    ///
    /// # Errors
    /// [`TopologyError::XmlRead`] when the file cannot be read, [`TopologyError::XmlInvalid`]
    /// when hwloc rejects its contents.
    pub fn from_xml_file(path: &Path) -> Result<Self, TopologyError> {
        let xml = fs::read_to_string(path).map_err(|source| TopologyError::XmlRead {
            path: path.to_owned(),
            source,
        })?;
        Self::from_xml_str(&xml).map_err(|error| match error {
            TopologyError::XmlInvalid { reason, .. } => TopologyError::XmlInvalid {
                path: path.to_owned(),
                reason,
            },
            other => other,
        })
    }

    /// Replays an hwloc XML snapshot held in memory.
    ///
    /// # Errors
    /// [`TopologyError::XmlInvalid`] when hwloc rejects it.
    pub fn from_xml_str(xml: &str) -> Result<Self, TopologyError> {
        let invalid = |reason: String| TopologyError::XmlInvalid {
            path: "<memory>".into(),
            reason,
        };
        let hwloc = builder()?
            .from_xml(xml)
            .map_err(|e| invalid(e.to_string()))?
            .build()
            .map_err(|_| invalid("hwloc could not load it".to_owned()))?;
        let machine = read_machine(&hwloc, Source::Xml);
        Ok(Self { hwloc, machine })
    }

    /// Railyard's view of the machine.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// The rails and poller placement for this machine; see [`crate::plan`].
    ///
    /// # Errors
    /// [`TopologyError::UnknownNic`] when `options.nics` names a device that does not exist.
    pub fn plan(&self, options: &PlanOptions) -> Result<Plan, TopologyError> {
        Plan::build(&self.machine, options)
    }

    /// The topology as hwloc XML, with each RDMA port's link layer and rate added as
    /// `Port<N>LinkLayer` / `Port<N>Rate` infos (hwloc records only state and LID), so that
    /// [`Self::from_xml_str`] on the result yields the same [`Machine`].
    ///
    /// # Errors
    /// [`TopologyError::Hwloc`] when hwloc cannot serialize the topology.
    pub fn export_xml(&self) -> Result<String, TopologyError> {
        let xml = self
            .hwloc
            .export_xml(XMLExportFlags::empty())
            .map_err(|e| hwloc_error("export the topology as XML", e))?;
        Ok(add_port_infos(xml.as_str(), &self.machine.nics))
    }

    /// Writes [`Self::export_xml`] to `path`.
    ///
    /// # Errors
    /// [`TopologyError::Export`] when the file cannot be written, or as [`Self::export_xml`].
    pub fn export_xml_file(&self, path: &Path) -> Result<(), TopologyError> {
        let xml = self.export_xml()?;
        fs::write(path, xml).map_err(|source| TopologyError::Export {
            path: path.to_owned(),
            source,
        })
    }

    /// Pins the calling thread to one PU (by OS index).
    ///
    /// # Errors
    /// [`TopologyError::UnknownPu`] when the PU is not in this topology,
    /// [`TopologyError::PinThread`] when the OS refuses (for instance a cgroup that does
    /// not allow that CPU, or a topology replayed from XML).
    pub fn pin_current_thread(&self, pu: u32) -> Result<(), TopologyError> {
        let known = self.machine.numa_nodes.iter().any(|n| n.pus.contains(&pu))
            || self.machine.numa_nodes.is_empty();
        if !known {
            return Err(TopologyError::UnknownPu { pu });
        }
        let mut set = CpuSet::new();
        set.set(pu as usize);
        self.hwloc
            .bind_cpu(&set, CpuBindingFlags::THREAD | CpuBindingFlags::STRICT)
            .map_err(|e| TopologyError::PinThread {
                pu,
                reason: e.to_string(),
            })
    }

    /// Binds the pages of `area` to one NUMA node (by OS index). Bind before touching the
    /// memory: pages already faulted in stay where they are (hwloc does not allow migrating
    /// an area), which is why engine-allocated regions are bound first and prefaulted after.
    ///
    /// # Errors
    /// [`TopologyError::UnknownNumaNode`] when the node is not in this topology,
    /// [`TopologyError::BindMemory`] when the OS refuses.
    pub fn bind_memory(&self, area: &[u8], node: u32) -> Result<(), TopologyError> {
        if !self.machine.numa_nodes.iter().any(|n| n.os_index == node) {
            return Err(TopologyError::UnknownNumaNode { node });
        }
        let mut set = NodeSet::new();
        set.set(node as usize);
        self.hwloc
            .bind_memory_area(
                area,
                &set,
                MemoryBindingPolicy::Bind,
                MemoryBindingFlags::STRICT,
            )
            .map_err(|e| TopologyError::BindMemory {
                addr: area.as_ptr() as usize,
                len: area.len(),
                node,
                reason: e.to_string(),
            })
    }
}

fn hwloc_error(operation: &'static str, error: impl std::fmt::Display) -> TopologyError {
    TopologyError::Hwloc {
        operation,
        reason: error.to_string(),
    }
}

/// A builder that keeps every I/O object: rails and GPUs are I/O objects.
fn builder() -> Result<hwlocality::topology::builder::TopologyBuilder, TopologyError> {
    Topology::builder()
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(|e| hwloc_error("configure I/O discovery", e))
}

fn read_machine(hwloc: &Topology, source: Source) -> Machine {
    let host = hwloc
        .root_object()
        .info("HostName")
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    let numa_nodes = read_numa_nodes(hwloc);
    let numa_distances = read_numa_distances(hwloc, &numa_nodes);
    let mut nics = Vec::new();
    let mut gpus = Vec::new();
    for object in hwloc.objects_with_type(ObjectType::PCIDevice) {
        let Some(ObjectAttributes::PCIDevice(pci)) = object.attributes() else {
            continue;
        };
        let busid = format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            pci.domain(),
            pci.bus_id(),
            pci.bus_device(),
            pci.function()
        );
        let numa_node = numa_node_of(object);
        let pci_path = pci_path_of(object);
        let os_devices: Vec<&TopologyObject> = object
            .io_children()
            .filter(|child| child.object_type() == ObjectType::OSDevice)
            .collect();
        let netdev = os_devices
            .iter()
            .find(|dev| os_device_type(dev) == Some(OSDeviceType::Network))
            .and_then(|dev| object_name(dev));
        for dev in &os_devices {
            if os_device_type(dev) != Some(OSDeviceType::OpenFabrics) {
                continue;
            }
            let Some(name) = object_name(dev) else {
                continue;
            };
            nics.push(Nic {
                name,
                pci_busid: Some(busid.clone()),
                numa_node,
                ports: ports_from_infos(dev),
                netdev: netdev.clone(),
                pci_path: pci_path.clone(),
            });
        }
        if matches!(pci.class_id(), 0x0300 | 0x0302) {
            let name_of = |kind: OSDeviceType| {
                os_devices
                    .iter()
                    .find(|dev| os_device_type(dev) == Some(kind))
                    .and_then(|dev| object_name(dev))
            };
            let name = name_of(OSDeviceType::CoProcessor)
                .or_else(|| name_of(OSDeviceType::GPU))
                .unwrap_or_else(|| busid.clone());
            gpus.push(Gpu {
                name,
                pci_busid: busid,
                numa_node,
                pci_path,
            });
        }
    }
    Machine {
        host,
        source,
        numa_nodes,
        numa_distances,
        nics,
        gpus,
    }
}

fn object_name(object: &TopologyObject) -> Option<String> {
    object.name().map(|n| n.to_string_lossy().into_owned())
}

fn os_device_type(object: &TopologyObject) -> Option<OSDeviceType> {
    match object.attributes() {
        Some(ObjectAttributes::OSDevice(osdev)) => Some(osdev.device_type()),
        _ => None,
    }
}

fn bitmap_indices<'a>(
    indices: impl Iterator<Item = hwlocality::bitmap::BitmapIndex> + 'a,
) -> impl Iterator<Item = u32> + 'a {
    indices.map(|index| usize::from(index) as u32)
}

/// NUMA nodes with their PUs and physical cores. A PU without a `Core` ancestor (some
/// virtual machines, synthetic topologies) counts as a core of its own.
fn read_numa_nodes(hwloc: &Topology) -> Vec<NumaNode> {
    let mut nodes: Vec<(NumaNode, Vec<u32>)> = hwloc
        .objects_with_type(ObjectType::NUMANode)
        .map(|node| {
            let pus: Vec<u32> = node
                .cpuset()
                .map(|set| bitmap_indices(set.iter_set()).collect())
                .unwrap_or_default();
            let os_index = node.os_index().unwrap_or(0) as u32;
            (
                NumaNode {
                    os_index,
                    pus: pus.clone(),
                    cores: Vec::new(),
                },
                pus,
            )
        })
        .collect();
    if nodes.is_empty() {
        // hwloc always reports one NUMA node; tolerate a snapshot that does not.
        let pus: Vec<u32> = hwloc
            .objects_with_type(ObjectType::PU)
            .filter_map(|pu| pu.os_index().map(|i| i as u32))
            .collect();
        nodes.push((
            NumaNode {
                os_index: 0,
                pus: pus.clone(),
                cores: Vec::new(),
            },
            pus,
        ));
    }

    let mut core_order: Vec<u64> = Vec::new();
    let mut core_pus: HashMap<u64, Vec<u32>> = HashMap::new();
    for pu in hwloc.objects_with_type(ObjectType::PU) {
        let Some(os_index) = pu.os_index() else {
            continue;
        };
        let key = pu
            .first_ancestor_with_type(ObjectType::Core)
            .unwrap_or(pu)
            .global_persistent_index();
        let siblings = core_pus.entry(key).or_insert_with(|| {
            core_order.push(key);
            Vec::new()
        });
        siblings.push(os_index as u32);
    }
    for key in core_order {
        let mut pus = core_pus.remove(&key).unwrap_or_default();
        pus.sort_unstable();
        let Some(&first) = pus.first() else { continue };
        if let Some((node, _)) = nodes
            .iter_mut()
            .find(|(_, node_pus)| node_pus.contains(&first))
        {
            node.cores.push(Core { pus });
        }
    }
    let mut nodes: Vec<NumaNode> = nodes.into_iter().map(|(node, _)| node).collect();
    nodes.sort_by_key(|node| node.os_index);
    nodes
}

/// The NUMA distance matrix in `nodes` order, when hwloc has one that covers every node.
fn read_numa_distances(hwloc: &Topology, nodes: &[NumaNode]) -> Option<Vec<Vec<u64>>> {
    let matrices = hwloc.distances_with_type(None, ObjectType::NUMANode).ok()?;
    let matrix = matrices.first()?;
    let objects: Vec<&TopologyObject> = hwloc.objects_with_type(ObjectType::NUMANode).collect();
    let by_os_index = |os_index: u32| {
        objects
            .iter()
            .copied()
            .find(|o| o.os_index() == Some(os_index as usize))
    };
    let mut rows = Vec::with_capacity(nodes.len());
    for from in nodes {
        let mut row = Vec::with_capacity(nodes.len());
        for to in nodes {
            let pair = (by_os_index(from.os_index)?, by_os_index(to.os_index)?);
            row.push(matrix.object_pair_distance(pair)?.0);
        }
        rows.push(row);
    }
    Some(rows)
}

/// The NUMA node of an I/O object: the lowest node of its first non-I/O ancestor.
fn numa_node_of(object: &TopologyObject) -> u32 {
    object
        .first_non_io_ancestor()
        .and_then(|ancestor| ancestor.nodeset())
        .and_then(|set| set.first_set())
        .map_or(0, |index| usize::from(index) as u32)
}

fn pci_path_of(object: &TopologyObject) -> PciPath {
    let hops = object
        .ancestors()
        .take_while(|ancestor| ancestor.object_type() == ObjectType::Bridge)
        .map(|bridge| {
            let id = bridge.global_persistent_index();
            match bridge.attributes() {
                Some(ObjectAttributes::Bridge(b)) if b.upstream_type() == BridgeType::Host => {
                    PciHop::HostBridge { id }
                }
                _ => PciHop::Bridge { id },
            }
        })
        .collect();
    PciPath { hops }
}

/// Reads `Port<N>State`, `Port<N>LID`, `Port<N>LinkLayer` and `Port<N>Rate` infos.
///
/// A port without a link-layer info (a snapshot taken by plain `lstopo`) is taken to be
/// InfiniBand when it has a non-zero LID and Ethernet (RoCE) otherwise: RoCE ports have no LID.
fn ports_from_infos(device: &TopologyObject) -> Vec<Port> {
    let mut ports: Vec<Port> = Vec::new();
    for info in device.infos() {
        let (Ok(name), Ok(value)) = (info.name().to_str(), info.value().to_str()) else {
            continue;
        };
        let Some(rest) = name.strip_prefix("Port") else {
            continue;
        };
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        let (Ok(number), field) = (rest[..digits].parse::<u32>(), &rest[digits..]) else {
            continue;
        };
        let port = port_entry(&mut ports, number);
        match field {
            "State" => {
                port.state = value
                    .trim()
                    .parse()
                    .map_or(PortState::Unknown, PortState::from_code)
            }
            "LID" => port.lid = parse_lid(value),
            "LinkLayer" => port.link_layer = LinkLayer::parse(value),
            "Rate" => port.rate_gbps = parse_rate(value),
            _ => {}
        }
    }
    for port in &mut ports {
        if port.link_layer.is_none() {
            port.link_layer = Some(match port.lid {
                Some(lid) if lid != 0 => LinkLayer::InfiniBand,
                _ => LinkLayer::Ethernet,
            });
        }
    }
    ports
}

fn port_entry(ports: &mut Vec<Port>, number: u32) -> &mut Port {
    let index = match ports.binary_search_by_key(&number, |p| p.number) {
        Ok(index) => index,
        Err(index) => {
            ports.insert(
                index,
                Port {
                    number,
                    state: PortState::Unknown,
                    link_layer: None,
                    rate_gbps: None,
                    lid: None,
                },
            );
            index
        }
    };
    &mut ports[index]
}

fn parse_lid(text: &str) -> Option<u32> {
    let text = text.trim();
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// Parses `400`, `2.5` or sysfs's `400 Gb/sec (4X NDR)` into whole Gb/s.
fn parse_rate(text: &str) -> Option<u32> {
    let number: String = text
        .trim()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let rate: f64 = number.parse().ok()?;
    Some(rate.round() as u32)
}

/// Overrides port facts with what `/sys/class/infiniband/<dev>/ports/<n>/` says now.
fn enrich_ports_from_sysfs(nic: &mut Nic, device_dir: &Path) {
    let Ok(entries) = fs::read_dir(device_dir.join("ports")) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(number) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let read = |file: &str| fs::read_to_string(entry.path().join(file)).ok();
        let port = port_entry(&mut nic.ports, number);
        if let Some(state) = read("state") {
            // "4: ACTIVE"
            let code = state.split(':').next().and_then(|c| c.trim().parse().ok());
            port.state = code.map_or(PortState::Unknown, PortState::from_code);
        }
        if let Some(layer) = read("link_layer").as_deref().and_then(LinkLayer::parse) {
            port.link_layer = Some(layer);
        }
        if let Some(rate) = read("rate").as_deref().and_then(parse_rate) {
            port.rate_gbps = Some(rate);
        }
        if let Some(lid) = read("lid").as_deref().and_then(parse_lid) {
            port.lid = Some(lid);
        }
    }
}

/// Inserts the port infos hwloc does not record into each RDMA device's `<object>` element.
fn add_port_infos(xml: &str, nics: &[Nic]) -> String {
    let mut out = xml.to_owned();
    for nic in nics {
        let needle = format!(" name=\"{}\" osdev_type=", nic.name);
        let Some(name_at) = out.find(&needle) else {
            continue;
        };
        let Some(open_start) = out[..name_at].rfind("<object") else {
            continue;
        };
        let Some(tag_len) = out[name_at..].find('>') else {
            continue;
        };
        let tag_end = name_at + tag_len;
        let self_closing = out[..tag_end].ends_with('/');
        let indent: String = {
            let line_start = out[..open_start].rfind('\n').map_or(0, |i| i + 1);
            format!("{}  ", &out[line_start..open_start])
        };
        let element_text = &out[open_start..];
        let mut infos = String::new();
        for port in &nic.ports {
            let n = port.number;
            let mut push = |key: String, value: String| {
                if !element_text.contains(&format!("name=\"{key}\"")) {
                    infos.push_str(&format!(
                        "{indent}<info name=\"{key}\" value=\"{value}\"/>\n"
                    ));
                }
            };
            if let Some(layer) = port.link_layer {
                push(format!("Port{n}LinkLayer"), layer.as_str().to_owned());
            }
            if let Some(rate) = port.rate_gbps {
                push(format!("Port{n}Rate"), rate.to_string());
            }
        }
        if infos.is_empty() {
            continue;
        }
        if self_closing {
            let closing = format!(">\n{infos}{}</object>", &indent[2..]);
            out.replace_range(tag_end - 1..=tag_end, &closing);
        } else {
            out.insert_str(tag_end + 1, &format!("\n{}", infos.trim_end_matches('\n')));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_lids_parse_in_every_spelling() {
        assert_eq!(parse_rate("400 Gb/sec (4X NDR)"), Some(400));
        assert_eq!(parse_rate("2.5 Gb/sec (1X SDR)"), Some(3));
        assert_eq!(parse_rate("100"), Some(100));
        assert_eq!(parse_rate("fast"), None);
        assert_eq!(parse_lid("0x11f"), Some(0x11f));
        assert_eq!(parse_lid("7"), Some(7));
    }

    fn fixture_xml() -> String {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/topology/hicache-12nic.xml"
        );
        fs::read_to_string(path).unwrap()
    }

    #[test]
    fn sysfs_port_facts_override_hwloc_infos() {
        let dir = std::env::temp_dir().join(format!("railyard-sysfs-{}", std::process::id()));
        let port = dir.join("mlx5_0/ports/1");
        fs::create_dir_all(&port).unwrap();
        fs::write(port.join("state"), "1: DOWN\n").unwrap();
        fs::write(port.join("link_layer"), "Ethernet\n").unwrap();
        fs::write(port.join("rate"), "200 Gb/sec (4X HDR)\n").unwrap();
        let second = dir.join("mlx5_0/ports/2");
        fs::create_dir_all(&second).unwrap();
        fs::write(second.join("state"), "4: ACTIVE\n").unwrap();

        let host = HostTopology::from_xml_str(&fixture_xml()).unwrap();
        let mut nic = host.machine().nics[0].clone();
        enrich_ports_from_sysfs(&mut nic, &dir.join("mlx5_0"));
        fs::remove_dir_all(&dir).unwrap();
        let first = &nic.ports[0];
        assert_eq!(first.state, PortState::Down);
        assert_eq!(first.link_layer, Some(LinkLayer::Ethernet));
        assert_eq!(first.rate_gbps, Some(200));
        assert_eq!(first.lid, Some(0x11f), "facts sysfs lacks are kept");
        assert_eq!(
            (nic.ports[1].number, nic.ports[1].state),
            (2, PortState::Active)
        );
    }

    #[test]
    fn export_adds_the_port_facts_hwloc_does_not_record() {
        let full = HostTopology::from_xml_str(&fixture_xml()).unwrap();
        let hwloc_only: String = fixture_xml()
            .lines()
            .filter(|line| !line.contains("LinkLayer") && !line.contains("Port1Rate"))
            .collect::<Vec<_>>()
            .join("\n");
        let bare = HostTopology::from_xml_str(&hwloc_only).unwrap();
        assert_eq!(bare.machine().nics[0].ports[0].rate_gbps, None);
        let restored = add_port_infos(&hwloc_only, &full.machine().nics);
        let replayed = HostTopology::from_xml_str(&restored).unwrap();
        assert_eq!(replayed.machine(), full.machine());
    }

    #[test]
    fn lid_decides_the_link_layer_when_no_info_says() {
        let hwloc_only: String = fixture_xml()
            .lines()
            .filter(|line| !line.contains("LinkLayer"))
            .collect::<Vec<_>>()
            .join("\n");
        let host = HostTopology::from_xml_str(&hwloc_only).unwrap();
        let layer = |name: &str| {
            let nic = host.machine().nics.iter().find(|n| n.name == name).unwrap();
            nic.ports[0].link_layer
        };
        assert_eq!(layer("mlx5_0"), Some(LinkLayer::InfiniBand));
        assert_eq!(layer("mlx5_7"), Some(LinkLayer::Ethernet));
    }
}
